//! The run's clock: the one time that handlers stamp the run's state with (leases, heartbeats,
//! samples, scores) and that the phase driver compares it against. PostgreSQL's `now()` is not
//! used for run state, so a test (or a replica whose database host's clock differs) sees one time.
//!
//! Signed requests' freshness is checked against the wall clock instead ([`crate::auth::now_ms`]):
//! it is compared with the signer's wall clock, not with the run's state. The processes' own
//! bookkeeping in the database (the replicas' registry, the shared replay cache's expiry) keeps
//! the database's clock: it is what every replica of every version reads the same.

use chrono::{DateTime, Utc};

/// A source of the current time.
pub trait Clock: Send + Sync {
    /// Now.
    fn now(&self) -> DateTime<Utc>;
}

/// The system's wall clock, the production clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// The wall clock moved by a fixed offset (tests: a run whose time is ahead of the database's).
#[derive(Clone, Copy, Debug)]
pub struct OffsetClock(pub chrono::Duration);

impl Clock for OffsetClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now() + self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offset_clock_runs_ahead_of_the_wall_clock_by_its_offset() {
        let ahead = OffsetClock(chrono::Duration::hours(1));
        let before = Utc::now();
        let t = ahead.now();
        let after = Utc::now();
        assert!(t >= before + chrono::Duration::hours(1));
        assert!(t <= after + chrono::Duration::hours(1));
    }
}
