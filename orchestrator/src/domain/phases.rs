//! When a phase ends: by quorum or by deadline, so an epoch always advances.

use chrono::{DateTime, Utc};
use iota_protocol::api::{Phase, RunConfig};

use super::leases::secs;

/// What the phase driver sees of the current phase.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseView {
    /// Phase.
    pub phase: Phase,
    /// Its deadline.
    pub deadline: DateTime<Utc>,
    /// Merge reassignment round.
    pub merge_round: u32,
    /// Samples started / target this epoch.
    pub samples_started: u64,
    /// Target.
    pub samples_target: u64,
    /// Samples still travelling (forward or backward).
    pub samples_in_flight: u64,
    /// Pseudo-gradient partitions expected from miners that did work.
    pub uploads_expected: u64,
    /// Of those, received.
    pub uploads_received: u64,
    /// Partitions without an accepted result.
    pub partitions_open: u64,
    /// Miners that reserved their pseudo-gradient upload and have not uploaded every partition.
    pub uploads_reserved: u64,
    /// The latest the uploading phase waits for them.
    pub reserved_until: DateTime<Utc>,
}

/// What the driver does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhaseStep {
    /// Nothing yet.
    Wait,
    /// Training → uploading.
    StartUploading,
    /// Uploading → merging (freeze contributions, assign owners).
    StartMerging,
    /// Merging deadline passed with partitions open: add an owner to each and extend.
    ReassignRound,
    /// Merging is over (all accepted, or the last round ended): settle leftovers, next epoch.
    NextEpoch,
}

/// Decides the next step. Each phase ends by quorum or by deadline, so an epoch always advances
/// within `training_s + uploading_s + merging_s + max_rounds · merge_round_s`.
pub fn next_step(view: &PhaseView, now: DateTime<Utc>, max_rounds: u32) -> PhaseStep {
    let expired = now >= view.deadline;
    match view.phase {
        Phase::Training => {
            let quorum = view.samples_started >= view.samples_target && view.samples_in_flight == 0;
            if quorum || expired {
                PhaseStep::StartUploading
            } else {
                PhaseStep::Wait
            }
        }
        Phase::Uploading => {
            let quorum = view.uploads_received >= view.uploads_expected;
            // Uploads reserved before the deadline hold it open, for a bounded time.
            let held = view.uploads_reserved > 0 && now < view.reserved_until;
            if quorum || (expired && !held) {
                PhaseStep::StartMerging
            } else {
                PhaseStep::Wait
            }
        }
        Phase::Merging => {
            if view.partitions_open == 0 {
                PhaseStep::NextEpoch
            } else if !expired {
                PhaseStep::Wait
            } else if view.merge_round < max_rounds {
                PhaseStep::ReassignRound
            } else {
                PhaseStep::NextEpoch
            }
        }
    }
}

/// The latest an uploading phase with reservations outstanding stays open: its deadline plus
/// one more phase length.
pub(crate) fn reservations_hold_until(run: &RunConfig, deadline: DateTime<Utc>) -> DateTime<Utc> {
    deadline + secs(run.uploading_s)
}

/// Whether a miner may reserve its pseudo-gradient upload of `epoch` at `at`, the run being in
/// `run_epoch`'s `phase` until `deadline`: during that epoch's uploading phase, before its
/// deadline; a retry of a reservation made in time (`held`, its answer lost) holds as the first
/// did.
pub fn reservation_open(
    run_epoch: u64,
    phase: Phase,
    deadline: DateTime<Utc>,
    epoch: u64,
    at: DateTime<Utc>,
    held: bool,
) -> bool {
    run_epoch == epoch && phase == Phase::Uploading && (at < deadline || held)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;

    fn view(phase: Phase) -> PhaseView {
        PhaseView {
            phase,
            deadline: DateTime::<Utc>::UNIX_EPOCH + Duration::seconds(100),
            merge_round: 0,
            samples_started: 0,
            samples_target: 10,
            samples_in_flight: 0,
            uploads_expected: 4,
            uploads_received: 0,
            partitions_open: 3,
            uploads_reserved: 0,
            reserved_until: DateTime::<Utc>::UNIX_EPOCH + Duration::seconds(200),
        }
    }

    #[test]
    fn phases_end_by_quorum_or_deadline() {
        let before = DateTime::<Utc>::UNIX_EPOCH + Duration::seconds(50);
        let after = DateTime::<Utc>::UNIX_EPOCH + Duration::seconds(100);
        let mut v = view(Phase::Training);
        assert_eq!(next_step(&v, before, 2), PhaseStep::Wait);
        assert_eq!(next_step(&v, after, 2), PhaseStep::StartUploading);
        v.samples_started = 10;
        v.samples_in_flight = 1;
        assert_eq!(next_step(&v, before, 2), PhaseStep::Wait);
        v.samples_in_flight = 0;
        assert_eq!(next_step(&v, before, 2), PhaseStep::StartUploading);

        let mut v = view(Phase::Uploading);
        assert_eq!(next_step(&v, before, 2), PhaseStep::Wait);
        v.uploads_received = 4;
        assert_eq!(next_step(&v, before, 2), PhaseStep::StartMerging);
        v.uploads_received = 0;
        assert_eq!(next_step(&v, after, 2), PhaseStep::StartMerging);
        // A reserved upload holds the deadline, until the hold ends; not the quorum.
        v.uploads_reserved = 1;
        assert_eq!(next_step(&v, after, 2), PhaseStep::Wait);
        let held_to = DateTime::<Utc>::UNIX_EPOCH + Duration::seconds(200);
        assert_eq!(next_step(&v, held_to, 2), PhaseStep::StartMerging);
        v.uploads_received = 4;
        assert_eq!(next_step(&v, before, 2), PhaseStep::StartMerging);

        let mut v = view(Phase::Merging);
        assert_eq!(next_step(&v, before, 2), PhaseStep::Wait);
        assert_eq!(next_step(&v, after, 2), PhaseStep::ReassignRound);
        v.merge_round = 2;
        assert_eq!(next_step(&v, after, 2), PhaseStep::NextEpoch);
        v.merge_round = 0;
        v.partitions_open = 0;
        assert_eq!(next_step(&v, before, 2), PhaseStep::NextEpoch);
    }

    #[test]
    fn uploads_are_reserved_in_the_epochs_uploading_phase_before_its_deadline() {
        let deadline = DateTime::<Utc>::from_timestamp(1_000, 0).expect("a time");
        let before = deadline - Duration::seconds(1);
        let open = |e, p, at, held| reservation_open(4, p, deadline, e, at, held);
        assert!(open(4, Phase::Uploading, before, false));
        assert!(
            !open(4, Phase::Uploading, deadline, false),
            "at the deadline"
        );
        assert!(open(4, Phase::Uploading, deadline, true), "a retry holds");
        assert!(!open(3, Phase::Uploading, before, true), "another epoch");
        assert!(!open(4, Phase::Training, before, false));
        assert!(!open(4, Phase::Merging, before, true));
    }
}
