//! When a validator tries again to send weights it owes (the latest scored epoch's, which have
//! not reached the chain): a plain state machine over block numbers, so that a pass every few
//! seconds neither reads the metagraph nor sends into a refusal each time.

/// Most blocks between two tries after failed sends (about 13 minutes of 12-second blocks).
pub const MAX_BACKOFF_BLOCKS: u64 = 64;

/// What the validator knows about its owed weights between passes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OwedWeights {
    /// The latest scored epoch whose scores gave nothing to send (no scored hotkey has a uid).
    nothing_for: Option<u64>,
    /// No try before this block: the rate limit as last read, or the back-off after failures.
    not_before: u64,
    /// Failed sends in a row.
    failures: u32,
}

impl OwedWeights {
    /// Whether weights owed for `epoch` may be tried when the chain's best block is `best` (a
    /// transaction sent now lands in `best + 1`).
    pub fn may_try(&self, epoch: u64, best: u64) -> bool {
        self.nothing_for != Some(epoch) && best.saturating_add(1) >= self.not_before
    }

    /// The rate limit lets this uid set weights from block `allowed_from` on.
    pub fn rate_limited_until(&mut self, allowed_from: u64) {
        self.not_before = self.not_before.max(allowed_from);
    }

    /// A send at best block `best` failed: the next try waits 2, 4, 8… blocks, at most
    /// [`MAX_BACKOFF_BLOCKS`], so a refusal that persists (no permit, too little stake) is not
    /// sent again at every pass.
    pub fn failed(&mut self, best: u64) {
        self.failures = self.failures.saturating_add(1);
        let wait = 1u64
            .checked_shl(self.failures.min(6))
            .unwrap_or(MAX_BACKOFF_BLOCKS)
            .min(MAX_BACKOFF_BLOCKS);
        self.not_before = best.saturating_add(1).saturating_add(wait);
    }

    /// The weights reached the chain (or there were none to send for `epoch`).
    pub fn settled(&mut self, nothing_for: Option<u64>) {
        self.failures = 0;
        if nothing_for.is_some() {
            self.nothing_for = nothing_for;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_back_off_to_a_bound_and_a_success_resets_them() {
        let mut owed = OwedWeights::default();
        assert!(owed.may_try(3, 100));
        let mut waits = Vec::new();
        for _ in 0..9 {
            owed.failed(100);
            let next = (100..1000).find(|b| owed.may_try(3, *b)).expect("a retry");
            waits.push(next - 100);
        }
        assert_eq!(waits, [2, 4, 8, 16, 32, 64, 64, 64, 64]);
        owed.settled(None);
        owed.failed(500);
        assert!(!owed.may_try(3, 501));
        assert!(owed.may_try(3, 502));
    }

    #[test]
    fn the_rate_limit_holds_tries_back_and_an_epoch_with_nothing_to_send_is_not_retried() {
        let mut owed = OwedWeights::default();
        owed.rate_limited_until(120);
        assert!(!owed.may_try(3, 118));
        // A transaction sent at best 119 lands in 120.
        assert!(owed.may_try(3, 119));
        // A back-off shorter than the rate limit does not shorten it.
        owed.failed(100);
        owed.rate_limited_until(120);
        assert!(!owed.may_try(3, 118));
        owed.settled(Some(3));
        assert!(!owed.may_try(3, 1000));
        // The next scored epoch may give something to send.
        assert!(owed.may_try(4, 1000));
    }
}
