//! When an open hop stops waiting for its miner, and where it goes then.
//!
//! A routed hop waits [`pickup_s`] for its miner to lease it and a lease lasts `lease_s`. A hop
//! that lapsed moves: forward hops to another miner of their stage as the next attempt, while a
//! backward hop cannot move (only its miner holds the activation cache), so its sample ends.

use chrono::{DateTime, Utc};
use iota_protocol::api::{Direction, RunConfig};

use super::hops::HopStatus;

/// Seconds a routed hop waits for its miner to lease it (`leased_until` of a pending hop): two
/// leases; past that it moves unless the miner is working (holds a live lease). A miner that
/// heartbeats but does not poll (its work loop hung, or it only claims throughput to draw hops)
/// would otherwise hold every hop routed to it until the epoch ended, each one a sample in flight
/// that a stage-0 miner may not replace.
pub fn pickup_s(cfg: &RunConfig) -> u64 {
    cfg.lease_s.saturating_mul(2)
}

/// `s` seconds as a duration, saturating where chrono's range ends.
pub fn secs(s: u64) -> chrono::Duration {
    chrono::Duration::seconds(s.min(i64::MAX as u64 / 1000) as i64)
}

/// An open hop as the lease sweep sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenHop {
    /// Pending or leased.
    pub status: HopStatus,
    /// Its epoch.
    pub epoch: u64,
    /// When its pick-up time (pending) or its lease (leased) runs out; `None`: never.
    pub leased_until: Option<DateTime<Utc>>,
    /// Whether its miner holds a live lease on some hop.
    pub miner_working: bool,
    /// The last epoch whose work its miner ended.
    pub miner_ended_epoch: Option<u64>,
}

/// Why an open hop stops waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lapse {
    /// Its epoch has ended: the hop closes and goes nowhere (the epoch's end already settled its
    /// sample).
    EpochOver,
    /// Its lease, or its pick-up time while its miner works on nothing, ran out.
    LeaseLapsed,
    /// Its miner ended its work in the epoch (a completion raced with its pseudo-gradient).
    MinerEndedEpoch,
}

impl Lapse {
    /// Why, for the logs.
    pub fn reason(self) -> &'static str {
        match self {
            Lapse::EpochOver => "its epoch ended",
            Lapse::LeaseLapsed => "lease lapsed",
            Lapse::MinerEndedEpoch => "its miner ended its epoch",
        }
    }
}

/// Whether `hop` stops waiting at `now`, in epoch `current_epoch`. A routed hop waits past its
/// pick-up time while its miner works (a slow miner with a backlog leases it in turn, and moving
/// its backward hops would end their samples); one whose miner holds no lease gives it up.
pub fn lapse(hop: &OpenHop, current_epoch: u64, now: DateTime<Utc>) -> Option<Lapse> {
    if !hop.status.is_open() {
        return None;
    }
    if hop.epoch < current_epoch {
        return Some(Lapse::EpochOver);
    }
    if hop.epoch > current_epoch {
        return None;
    }
    let ran_out = hop.leased_until.is_some_and(|until| until < now);
    if ran_out && (hop.status == HopStatus::Leased || !hop.miner_working) {
        return Some(Lapse::LeaseLapsed);
    }
    if hop.miner_ended_epoch == Some(hop.epoch) {
        return Some(Lapse::MinerEndedEpoch);
    }
    None
}

/// Where a hop that lapsed goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reroute {
    /// A new attempt at the same stage, to another miner if there is one.
    Forward {
        /// The stage.
        stage: u32,
        /// The new attempt's number.
        attempt: i32,
    },
    /// Nowhere: its sample ends.
    AbandonSample,
}

/// Where a lapsed hop of `stage` in `direction`, attempt `attempt`, goes.
pub fn reroute(direction: Direction, stage: u32, attempt: i32) -> Reroute {
    match direction {
        Direction::Forward => Reroute::Forward {
            stage,
            attempt: attempt.saturating_add(1),
        },
        Direction::Backward => Reroute::AbandonSample,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;

    fn hop(status: HopStatus, until: DateTime<Utc>) -> OpenHop {
        OpenHop {
            status,
            epoch: 5,
            leased_until: Some(until),
            miner_working: false,
            miner_ended_epoch: None,
        }
    }

    #[test]
    fn a_lease_lapses_when_it_runs_out() {
        let now = DateTime::<Utc>::from_timestamp(1_000_000, 0).expect("a time");
        let later = now + Duration::seconds(1);
        let earlier = now - Duration::seconds(1);
        assert_eq!(lapse(&hop(HopStatus::Leased, later), 5, now), None);
        assert_eq!(lapse(&hop(HopStatus::Leased, now), 5, now), None, "not yet");
        assert_eq!(
            lapse(&hop(HopStatus::Leased, earlier), 5, now),
            Some(Lapse::LeaseLapsed)
        );
        // A leased hop lapses even while its miner holds other live leases.
        let mut working = hop(HopStatus::Leased, earlier);
        working.miner_working = true;
        assert_eq!(lapse(&working, 5, now), Some(Lapse::LeaseLapsed));
    }

    #[test]
    fn a_routed_hop_waits_past_its_pickup_only_while_its_miner_works() {
        let now = DateTime::<Utc>::from_timestamp(1_000_000, 0).expect("a time");
        let earlier = now - Duration::seconds(1);
        let mut pending = hop(HopStatus::Pending, earlier);
        assert_eq!(lapse(&pending, 5, now), Some(Lapse::LeaseLapsed));
        pending.miner_working = true;
        assert_eq!(lapse(&pending, 5, now), None);
        pending.leased_until = Some(now + Duration::seconds(1));
        pending.miner_working = false;
        assert_eq!(lapse(&pending, 5, now), None);
        pending.leased_until = None;
        assert_eq!(lapse(&pending, 5, now), None, "no deadline never runs out");
    }

    #[test]
    fn hops_of_an_ended_epoch_close_and_of_a_miner_that_ended_its_move() {
        let now = DateTime::<Utc>::from_timestamp(1_000_000, 0).expect("a time");
        let later = now + Duration::seconds(60);
        let live = hop(HopStatus::Leased, later);
        assert_eq!(lapse(&live, 6, now), Some(Lapse::EpochOver));
        // The epoch's end comes first, even for a lease that also ran out.
        let mut both = hop(HopStatus::Leased, now - Duration::seconds(1));
        both.miner_ended_epoch = Some(5);
        assert_eq!(lapse(&both, 6, now), Some(Lapse::EpochOver));
        assert_eq!(lapse(&both, 5, now), Some(Lapse::LeaseLapsed));
        let mut ended = hop(HopStatus::Pending, later);
        ended.miner_ended_epoch = Some(5);
        assert_eq!(lapse(&ended, 5, now), Some(Lapse::MinerEndedEpoch));
        ended.miner_ended_epoch = Some(4);
        assert_eq!(lapse(&ended, 5, now), None, "it ended an earlier epoch");
        for status in [HopStatus::Done, HopStatus::Expired, HopStatus::Abandoned] {
            assert_eq!(
                lapse(&hop(status, now - Duration::seconds(9)), 6, now),
                None
            );
        }
    }

    #[test]
    fn forward_hops_move_as_the_next_attempt_and_backward_ones_end_their_sample() {
        assert_eq!(
            reroute(Direction::Forward, 2, 0),
            Reroute::Forward {
                stage: 2,
                attempt: 1
            }
        );
        assert_eq!(
            reroute(Direction::Forward, 0, i32::MAX),
            Reroute::Forward {
                stage: 0,
                attempt: i32::MAX
            }
        );
        assert_eq!(reroute(Direction::Backward, 1, 0), Reroute::AbandonSample);
    }

    #[test]
    fn durations_saturate_where_chrono_ends() {
        assert_eq!(secs(90), Duration::seconds(90));
        assert_eq!(secs(u64::MAX), secs(i64::MAX as u64 / 1000));
    }
}
