//! A miner's throughput as the orchestrator measures it: from the hops it completes, never from
//! what it claims.
//!
//! A miner computes its hops one at a time, so each completion ends a stretch of work that began
//! when the hop was leased or, if the miner was still busy then, when its previous hop was done.
//! A hop's rate is its tokens over that stretch; the measure is an exponentially weighted mean of
//! those rates. A miner can raise it only by completing hops sooner, which needs the work done
//! (or faked, which the validators' replays catch).

use chrono::{DateTime, Utc};
use iota_protocol::api::MAX_TOKENS_PER_S;

/// Weight of the newest hop in the mean: about the last ten hops count.
pub const SMOOTHING: f64 = 0.2;

/// Shortest stretch a hop is credited with: a clock step backwards, or two completions in the
/// same instant, must not make a rate infinite.
const MIN_SECONDS: f64 = 1e-3;

/// A miner's measured throughput after some hops.
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// When its latest hop was done.
    pub last_done_at: DateTime<Utc>,
    /// Hops measured.
    pub hops: u64,
}

/// The measure after a hop of `tokens` leased at `leased_at` was done at `done_at`.
pub fn after_hop(
    previous: Option<&Measured>,
    leased_at: DateTime<Utc>,
    done_at: DateTime<Utc>,
    tokens: u64,
) -> Measured {
    let started = match previous {
        Some(p) if p.last_done_at > leased_at => p.last_done_at,
        _ => leased_at,
    };
    let seconds =
        ((done_at - started).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6).max(MIN_SECONDS);
    let rate = (tokens as f64 / seconds).min(MAX_TOKENS_PER_S);
    let tokens_per_s = match previous {
        Some(p) => p.tokens_per_s + SMOOTHING * (rate - p.tokens_per_s),
        None => rate,
    };
    Measured {
        tokens_per_s,
        last_done_at: previous.map_or(done_at, |p| p.last_done_at.max(done_at)),
        hops: previous.map_or(0, |p| p.hops) + 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::<Utc>::UNIX_EPOCH + Duration::seconds(s)
    }

    #[test]
    fn hops_leased_together_are_timed_one_after_another() {
        // Three hops of 100 tokens leased at once, done at 1, 2 and 3 s: each took a second,
        // though the last waited three.
        let mut m = after_hop(None, at(0), at(1), 100);
        assert_eq!(m.tokens_per_s, 100.0);
        for done in [2, 3] {
            m = after_hop(Some(&m), at(0), at(done), 100);
            assert!((m.tokens_per_s - 100.0).abs() < 1e-9, "{m:?}");
        }
        assert_eq!((m.hops, m.last_done_at), (3, at(3)));
    }

    #[test]
    fn idle_time_between_hops_is_not_counted() {
        let m = after_hop(None, at(0), at(2), 100);
        // Idle from 2 to 60 s, then a hop leased at 60 done at 62.
        let m = after_hop(Some(&m), at(60), at(62), 100);
        assert!((m.tokens_per_s - 50.0).abs() < 1e-9, "{m:?}");
    }

    #[test]
    fn the_mean_follows_a_miner_that_slows_down() {
        let mut m = after_hop(None, at(0), at(1), 1000);
        let mut t = 1;
        for _ in 0..40 {
            m = after_hop(Some(&m), at(t), at(t + 10), 1000);
            t += 10;
        }
        assert!((m.tokens_per_s - 100.0).abs() < 1.0, "{m:?}");
    }

    #[test]
    fn instant_completions_stay_finite() {
        let m = after_hop(None, at(5), at(5), 100);
        assert!(m.tokens_per_s.is_finite() && m.tokens_per_s <= MAX_TOKENS_PER_S);
        // Done "before" it was leased (clocks of two replicas): still finite, still counted.
        let m = after_hop(Some(&m), at(9), at(8), 100);
        assert!(m.tokens_per_s.is_finite() && m.hops == 2, "{m:?}");
    }
}
