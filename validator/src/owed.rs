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
    /// No look at whether sent weights need refreshing before this block.
    refresh_check_at: u64,
}

/// Whether weights already on chain are due again: a validator whose last update is older than
/// the subnet's activity cutoff drops out of Yuma's consensus, so they are sent again once half
/// of it has passed, new epoch scored or not (a stalled run scores none).
pub fn refresh_due(last_update: u64, block: u64, activity_cutoff: u16) -> bool {
    block.saturating_sub(last_update) >= refresh_interval(activity_cutoff)
}

/// Blocks between two sends of the same weights: half the activity cutoff, at least one.
fn refresh_interval(activity_cutoff: u16) -> u64 {
    (u64::from(activity_cutoff) / 2).max(1)
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

    /// Whether to read the chain at best block `best` to see if sent weights need refreshing.
    pub fn may_check_refresh(&self, best: u64) -> bool {
        best >= self.refresh_check_at
    }

    /// The weights on chain were updated at `last_update`: no refresh is due before half the
    /// activity cutoff has passed since.
    pub fn refreshed_at(&mut self, last_update: u64, activity_cutoff: u16) {
        self.refresh_check_at = last_update.saturating_add(refresh_interval(activity_cutoff));
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
    fn weights_are_refreshed_after_half_the_activity_cutoff() {
        assert!(!refresh_due(100, 100, 5000));
        assert!(!refresh_due(100, 2599, 5000));
        assert!(refresh_due(100, 2600, 5000));
        // A cutoff of 0 or 1 still waits a block.
        assert!(!refresh_due(100, 100, 1));
        assert!(refresh_due(100, 101, 0));
        let mut owed = OwedWeights::default();
        assert!(owed.may_check_refresh(0));
        owed.refreshed_at(100, 40);
        assert!(!owed.may_check_refresh(119));
        assert!(owed.may_check_refresh(120));
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
