//! A hop's life and what its completion does to its sample.
//!
//! A hop is routed to a miner (`pending`), leased by it (`leased`), then `done`; or `expired`
//! when its lease lapsed and it moved to another miner, or `abandoned` when its sample ended. A
//! sample travels `forward` through the stages, then `backward` from the last stage to stage 0,
//! and ends `done` or `abandoned`. Completing a leased hop either answers a retry as the first
//! completion did, or closes the hop and moves its sample one step: a forward hop to the next
//! stage; the last stage's forward records the loss, then goes backward; a backward hop to the
//! stage below; stage 0's backward (or the forward of a model in one stage) ends the sample.

use iota_protocol::ErrorCode;
use iota_protocol::api::{CompleteRequest, Direction};
use iota_protocol::blob::BlobDescriptor;

/// How far a sample's loss may be from the mean of its sequences' losses, relative to that
/// mean (at least 1): rounding, in the miner's f32 arithmetic, and nothing more.
pub const LOSS_AGREEMENT: f64 = 1e-3;

/// Largest loss a completion may report. A cross-entropy in nats is never negative and a
/// language model's starts near ln(vocabulary), about 11; PostgreSQL's `avg` over float8 keeps a
/// sum of squares, which one loss above about 1e154 overflows, failing the epoch's loss mean (and
/// with it the step to the next epoch) every time it runs.
pub const MAX_LOSS: f64 = 1e4;

/// Longest weights digest a completion may carry, in characters.
pub const MAX_WEIGHTS_DIGEST: usize = 128;

/// Where a hop is in its life (the `tasks.status` column).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HopStatus {
    /// Routed to a miner, not leased yet.
    Pending,
    /// Leased by its miner.
    Leased,
    /// Completed.
    Done,
    /// Its lease lapsed and it moved.
    Expired,
    /// Refused by its miner.
    Failed,
    /// Its sample ended.
    Abandoned,
}

impl HopStatus {
    /// Every status, in the order of the column's check.
    pub const ALL: [HopStatus; 6] = [
        HopStatus::Pending,
        HopStatus::Leased,
        HopStatus::Done,
        HopStatus::Expired,
        HopStatus::Failed,
        HopStatus::Abandoned,
    ];

    /// The column's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            HopStatus::Pending => "pending",
            HopStatus::Leased => "leased",
            HopStatus::Done => "done",
            HopStatus::Expired => "expired",
            HopStatus::Failed => "failed",
            HopStatus::Abandoned => "abandoned",
        }
    }

    /// From the column's spelling.
    pub fn parse(s: &str) -> Option<HopStatus> {
        HopStatus::ALL.into_iter().find(|h| h.as_str() == s)
    }

    /// Whether the hop still waits for its miner.
    pub fn is_open(self) -> bool {
        matches!(self, HopStatus::Pending | HopStatus::Leased)
    }
}

/// Where a sample is (the `samples.status` column).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleStatus {
    /// Travelling up the stages.
    Forward,
    /// Travelling back down.
    Backward,
    /// Finished.
    Done,
    /// Given up.
    Abandoned,
}

impl SampleStatus {
    /// The column's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SampleStatus::Forward => "forward",
            SampleStatus::Backward => "backward",
            SampleStatus::Done => "done",
            SampleStatus::Abandoned => "abandoned",
        }
    }

    /// From the column's spelling.
    pub fn parse(s: &str) -> Option<SampleStatus> {
        [
            SampleStatus::Forward,
            SampleStatus::Backward,
            SampleStatus::Done,
            SampleStatus::Abandoned,
        ]
        .into_iter()
        .find(|x| x.as_str() == s)
    }

    /// Whether the sample is still travelling.
    pub fn in_flight(self) -> bool {
        matches!(self, SampleStatus::Forward | SampleStatus::Backward)
    }
}

/// Whether completing a hop of `stage` in `direction` finishes its sample: the backward pass
/// reaching stage 0, or the forward of a model in one stage (which has no backward hop).
pub fn finishes_sample(stage: u32, direction: Direction, stages: u32) -> bool {
    stage == 0 && (direction == Direction::Backward || stage + 1 == stages)
}

/// Whether a hop hands an object on (activations forward, gradients backward): every hop but
/// the one that finishes its sample.
pub fn expects_output(direction: Direction, stage: u32, stages: u32) -> bool {
    !finishes_sample(stage, direction, stages)
}

/// Whether `loss` is one a completion may report.
pub fn loss_in_range(loss: f64) -> bool {
    (0.0..=MAX_LOSS).contains(&loss)
}

/// What a completion reads, under lock, before deciding.
#[derive(Clone, Debug)]
pub struct HopSnapshot {
    /// The hop's id.
    pub task_id: i64,
    /// Its status.
    pub status: HopStatus,
    /// Its epoch.
    pub epoch: u64,
    /// Its stage.
    pub stage: u32,
    /// Its direction.
    pub direction: Direction,
    /// The output it uploaded, not yet completed.
    pub staged: Option<BlobDescriptor>,
    /// The output a done hop was completed with.
    pub output: Option<BlobDescriptor>,
    /// The hop a done hop routed its sample to.
    pub next_task_id: Option<i64>,
    /// The last epoch whose work the hop's miner ended (read only for a leased hop).
    pub miner_ended_epoch: Option<u64>,
    /// Its sample's status (read only for a leased hop; `None` when the sample is gone).
    pub sample: Option<SampleStatus>,
}

/// What a completion does.
#[derive(Clone, Debug, PartialEq)]
pub enum Completion {
    /// A retry of a completion that went through: answer as the first one did (not from the
    /// sample's state now: a later hop may have finished it).
    Repeat {
        /// The hop the first completion routed the sample to.
        next_task_id: Option<i64>,
        /// Whether the first completion finished the sample.
        sample_done: bool,
    },
    /// Close the hop and move its sample.
    Close(Close),
}

/// A hop closed by its completion.
#[derive(Clone, Debug, PartialEq)]
pub struct Close {
    /// The output it hands on, the uploaded object.
    pub output: Option<BlobDescriptor>,
    /// Whether the sample's loss is recorded (the last stage's forward).
    pub records_loss: bool,
    /// Where the sample goes.
    pub then: Then,
}

/// Where a sample goes after a hop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Then {
    /// A forward hop of this stage, to a miner drawn by throughput.
    Forward(u32),
    /// A backward hop of this stage, to the miner that ran its forward there.
    Backward(u32),
    /// The sample is done.
    Finish,
}

/// Why a completion is refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum HopRefusal {
    /// A retry that does not repeat the first completion.
    #[error("task {0} was completed with a different output")]
    DifferentOutput(i64),
    /// The hop moved on without this miner.
    #[error("task {task} is {}: the hop was re-routed", status.as_str())]
    Moved {
        /// The hop.
        task: i64,
        /// What it is now.
        status: HopStatus,
    },
    /// The miner's work in the hop's epoch has ended.
    #[error("task {task}: your work in epoch {epoch} has ended; the hop is moved")]
    EpochEnded {
        /// The hop.
        task: i64,
        /// Its epoch.
        epoch: u64,
    },
    /// The hop's sample is no longer in flight.
    #[error("task {task}: its sample is {}; the hop is closed", sample.map_or("gone", SampleStatus::as_str))]
    SampleClosed {
        /// The hop.
        task: i64,
        /// The sample's status, `None` when it is gone.
        sample: Option<SampleStatus>,
    },
    /// A hop that hands an object on completed before uploading it.
    #[error("task {0} has no uploaded output: upload it first")]
    NotUploaded(i64),
    /// The completion names another object than the one uploaded.
    #[error("output does not match the uploaded object")]
    OutputMismatch,
    /// The last stage's forward came without a loss, or with one out of range.
    #[error("the last stage's forward must report a loss from 0 to {MAX_LOSS}")]
    LossMissing,
    /// A loss on a hop other than the last stage's forward.
    #[error("only the last stage's forward reports a loss")]
    LossNotExpected,
    /// Sequence losses on a hop that records none, the wrong number of them on one that does, or
    /// one out of range.
    #[error(
        "sequence_losses: the last stage's forward reports exactly micro_batch ({0}) values, \
         each from 0 to {MAX_LOSS}; other hops report none"
    )]
    SequenceLosses(u32),
    /// The loss is not the mean of the sequences' losses.
    #[error("loss {loss} is not the mean of sequence_losses ({mean})")]
    LossDisagrees {
        /// The sample's loss.
        loss: f64,
        /// The mean of its sequences' losses.
        mean: f64,
    },
    /// The weights digest is longer than [`MAX_WEIGHTS_DIGEST`].
    #[error("weights_digest too long")]
    DigestTooLong,
}

impl HopRefusal {
    /// The API's code for it.
    pub fn code(&self) -> ErrorCode {
        match self {
            HopRefusal::DifferentOutput(_) => ErrorCode::Conflict,
            HopRefusal::Moved { .. }
            | HopRefusal::EpochEnded { .. }
            | HopRefusal::SampleClosed { .. } => ErrorCode::LeaseExpired,
            HopRefusal::NotUploaded(_)
            | HopRefusal::OutputMismatch
            | HopRefusal::LossMissing
            | HopRefusal::LossNotExpected
            | HopRefusal::SequenceLosses(_)
            | HopRefusal::LossDisagrees { .. }
            | HopRefusal::DigestTooLong => ErrorCode::BadRequest,
        }
    }
}

/// Decides a completion of `hop` (whose lease the caller holds) carrying `req`, in a run of
/// `stages` stages whose samples hold `micro_batch` sequences.
pub fn plan_completion(
    hop: &HopSnapshot,
    req: &CompleteRequest,
    stages: u32,
    micro_batch: u32,
) -> Result<Completion, HopRefusal> {
    match hop.status {
        HopStatus::Done => {
            let same = match (&hop.output, &req.output) {
                (Some(stored), Some(sent)) => stored.blake3 == sent.blake3,
                (None, None) => true,
                _ => false,
            };
            return if same {
                Ok(Completion::Repeat {
                    next_task_id: hop.next_task_id,
                    sample_done: finishes_sample(hop.stage, hop.direction, stages),
                })
            } else {
                Err(HopRefusal::DifferentOutput(hop.task_id))
            };
        }
        HopStatus::Leased => {}
        status => {
            return Err(HopRefusal::Moved {
                task: hop.task_id,
                status,
            });
        }
    }
    if hop.miner_ended_epoch == Some(hop.epoch) {
        return Err(HopRefusal::EpochEnded {
            task: hop.task_id,
            epoch: hop.epoch,
        });
    }
    // A hop of a sample that is no longer in flight (abandoned when its epoch ended: a hop routed
    // by a completion that raced with the epoch's end stays open until the next sweep) moves
    // nothing on; completing it would revive the sample after its epoch's loss mean was stored.
    if !hop.sample.is_some_and(SampleStatus::in_flight) {
        return Err(HopRefusal::SampleClosed {
            task: hop.task_id,
            sample: hop.sample,
        });
    }
    let output = if expects_output(hop.direction, hop.stage, stages) {
        let staged = hop
            .staged
            .as_ref()
            .ok_or(HopRefusal::NotUploaded(hop.task_id))?;
        match &req.output {
            Some(o) if o.key == staged.key && o.blake3 == staged.blake3 => Some(staged.clone()),
            _ => return Err(HopRefusal::OutputMismatch),
        }
    } else {
        None
    };
    let last = hop.stage + 1 == stages;
    let records_loss = last && hop.direction == Direction::Forward;
    check_losses(req, records_loss, micro_batch)?;
    if req.weights_digest.chars().count() > MAX_WEIGHTS_DIGEST {
        return Err(HopRefusal::DigestTooLong);
    }
    let then = match hop.direction {
        Direction::Forward if !last => Then::Forward(hop.stage + 1),
        _ if hop.stage == 0 => Then::Finish,
        _ => Then::Backward(hop.stage - 1),
    };
    Ok(Completion::Close(Close {
        output,
        records_loss,
        then,
    }))
}

/// The loss rules: the last stage's forward reports a loss in range and exactly `micro_batch`
/// sequence losses in range whose mean is the loss; other hops report neither.
fn check_losses(
    req: &CompleteRequest,
    records_loss: bool,
    micro_batch: u32,
) -> Result<(), HopRefusal> {
    if !records_loss {
        // Stored nowhere, so refused rather than dropped: a miner that sends them is confused
        // about its stage, and a last-stage check must not be skipped by sending them elsewhere.
        return match (req.loss, &req.sequence_losses) {
            (None, None) => Ok(()),
            (Some(_), _) => Err(HopRefusal::LossNotExpected),
            (None, Some(_)) => Err(HopRefusal::SequenceLosses(micro_batch)),
        };
    }
    let Some(loss) = req.loss.filter(|l| loss_in_range(*l)) else {
        return Err(HopRefusal::LossMissing);
    };
    // CLASP fits the sample's loss and a replay checks each sequence's: a loss sent without its
    // sequences, or one that disagrees with them, would steer CLASP with a number no replay can
    // check.
    let seq = match &req.sequence_losses {
        Some(seq)
            if seq.len() == micro_batch as usize && seq.iter().copied().all(loss_in_range) =>
        {
            seq
        }
        _ => return Err(HopRefusal::SequenceLosses(micro_batch)),
    };
    // Every sequence has `seq_len` tokens, so the sample's mean token loss is the mean of its
    // sequences' losses.
    let mean = seq.iter().sum::<f64>() / seq.len().max(1) as f64;
    if (loss - mean).abs() > LOSS_AGREEMENT * mean.abs().max(1.0) {
        return Err(HopRefusal::LossDisagrees { loss, mean });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(key: &str, hash: &str) -> BlobDescriptor {
        BlobDescriptor {
            key: key.into(),
            size: 10,
            dtype: iota_protocol::blob::BlobDtype::F32,
            shape: vec![10],
            blake3: hash.into(),
            url: None,
        }
    }

    /// A leased hop of a sample in flight, with its output uploaded as `a`.
    fn leased(stage: u32, direction: Direction) -> HopSnapshot {
        HopSnapshot {
            task_id: 7,
            status: HopStatus::Leased,
            epoch: 3,
            stage,
            direction,
            staged: Some(blob("k", "a")),
            output: None,
            next_task_id: None,
            miner_ended_epoch: None,
            sample: Some(if direction == Direction::Forward {
                SampleStatus::Forward
            } else {
                SampleStatus::Backward
            }),
        }
    }

    /// A completion; a loss comes with the 4 equal sequence losses of the tests' samples.
    fn request(output: Option<BlobDescriptor>, loss: Option<f64>) -> CompleteRequest {
        CompleteRequest {
            lease: uuid::Uuid::from_u128(1),
            output,
            inner_step: 1,
            weights_digest: String::new(),
            loss,
            sequence_losses: loss.map(|l| vec![l; 4]),
            compute_ms: None,
        }
    }

    fn closes(hop: &HopSnapshot, req: &CompleteRequest, stages: u32) -> Close {
        match plan_completion(hop, req, stages, 4) {
            Ok(Completion::Close(c)) => c,
            other => panic!("expected the hop closed, got {other:?}"),
        }
    }

    #[test]
    fn a_sample_goes_up_the_stages_then_back_down_then_finishes() {
        let up = request(Some(blob("k", "a")), None);
        let c = closes(&leased(0, Direction::Forward), &up, 3);
        assert_eq!(c.then, Then::Forward(1));
        assert!(!c.records_loss);
        assert_eq!(c.output, Some(blob("k", "a")));
        assert_eq!(
            closes(&leased(1, Direction::Forward), &up, 3).then,
            Then::Forward(2)
        );
        let top = request(Some(blob("k", "a")), Some(2.5));
        let c = closes(&leased(2, Direction::Forward), &top, 3);
        assert_eq!(c.then, Then::Backward(1));
        assert!(c.records_loss, "the last stage's forward records the loss");
        assert_eq!(
            closes(&leased(1, Direction::Backward), &up, 3).then,
            Then::Backward(0)
        );
        let bottom = request(None, None);
        let c = closes(&leased(0, Direction::Backward), &bottom, 3);
        assert_eq!((c.then, c.output), (Then::Finish, None));
    }

    #[test]
    fn a_model_in_one_stage_finishes_on_its_forward_with_the_loss() {
        let c = closes(&leased(0, Direction::Forward), &request(None, Some(3.0)), 1);
        assert_eq!(c.then, Then::Finish);
        assert!(c.records_loss);
        assert_eq!(c.output, None);
        assert!(finishes_sample(0, Direction::Forward, 1));
        assert!(!finishes_sample(0, Direction::Forward, 2));
        assert!(finishes_sample(0, Direction::Backward, 2));
        assert!(!expects_output(Direction::Backward, 0, 2));
        assert!(expects_output(Direction::Backward, 1, 2));
    }

    #[test]
    fn a_retry_repeats_the_first_answer_only_with_the_same_output() {
        let mut hop = leased(0, Direction::Backward);
        hop.status = HopStatus::Done;
        hop.next_task_id = None;
        assert_eq!(
            plan_completion(&hop, &request(None, None), 2, 4),
            Ok(Completion::Repeat {
                next_task_id: None,
                sample_done: true
            })
        );
        let mut hop = leased(0, Direction::Forward);
        hop.status = HopStatus::Done;
        hop.output = Some(blob("k", "a"));
        hop.next_task_id = Some(12);
        // A done hop is answered as it was even after its sample ended.
        hop.sample = Some(SampleStatus::Abandoned);
        assert_eq!(
            plan_completion(&hop, &request(Some(blob("k", "a")), None), 2, 4),
            Ok(Completion::Repeat {
                next_task_id: Some(12),
                sample_done: false
            })
        );
        assert_eq!(
            plan_completion(&hop, &request(Some(blob("k", "b")), None), 2, 4),
            Err(HopRefusal::DifferentOutput(7))
        );
        assert_eq!(
            plan_completion(&hop, &request(None, None), 2, 4),
            Err(HopRefusal::DifferentOutput(7))
        );
    }

    #[test]
    fn a_hop_that_moved_or_whose_sample_ended_is_refused_as_expired() {
        let req = request(Some(blob("k", "a")), None);
        for status in [
            HopStatus::Pending,
            HopStatus::Expired,
            HopStatus::Failed,
            HopStatus::Abandoned,
        ] {
            let mut hop = leased(0, Direction::Forward);
            hop.status = status;
            let refusal = plan_completion(&hop, &req, 2, 4).expect_err("refused");
            assert_eq!(refusal, HopRefusal::Moved { task: 7, status });
            assert_eq!(refusal.code(), ErrorCode::LeaseExpired);
        }
        let mut hop = leased(0, Direction::Forward);
        hop.miner_ended_epoch = Some(3);
        assert_eq!(
            plan_completion(&hop, &req, 2, 4),
            Err(HopRefusal::EpochEnded { task: 7, epoch: 3 })
        );
        hop.miner_ended_epoch = Some(2);
        assert!(
            plan_completion(&hop, &req, 2, 4).is_ok(),
            "an earlier epoch"
        );
        for sample in [
            None,
            Some(SampleStatus::Done),
            Some(SampleStatus::Abandoned),
        ] {
            hop.sample = sample;
            assert_eq!(
                plan_completion(&hop, &req, 2, 4),
                Err(HopRefusal::SampleClosed { task: 7, sample })
            );
        }
    }

    #[test]
    fn the_output_must_be_the_uploaded_object() {
        let hop = leased(0, Direction::Forward);
        for sent in [None, Some(blob("k", "b")), Some(blob("other", "a"))] {
            assert_eq!(
                plan_completion(&hop, &request(sent, None), 2, 4),
                Err(HopRefusal::OutputMismatch)
            );
        }
        let mut hop = hop;
        hop.staged = None;
        assert_eq!(
            plan_completion(&hop, &request(Some(blob("k", "a")), None), 2, 4),
            Err(HopRefusal::NotUploaded(7))
        );
    }

    #[test]
    fn the_last_forward_reports_micro_batch_sequence_losses_whose_mean_is_its_loss() {
        let hop = leased(1, Direction::Forward);
        let out = Some(blob("k", "a"));
        for loss in [None, Some(-0.1), Some(MAX_LOSS * 2.0), Some(f64::NAN)] {
            assert_eq!(
                plan_completion(&hop, &request(out.clone(), loss), 2, 4),
                Err(HopRefusal::LossMissing),
                "{loss:?}"
            );
        }
        let with = |loss: f64, seq: Option<Vec<f64>>| {
            let mut req = request(out.clone(), Some(loss));
            req.sequence_losses = seq;
            plan_completion(&hop, &req, 2, 4)
        };
        assert!(with(2.0, Some(vec![1.0, 3.0, 1.5, 2.5])).is_ok());
        assert!(
            with(2.0005, Some(vec![1.0, 3.0, 1.5, 2.5])).is_ok(),
            "within rounding"
        );
        assert_eq!(
            with(2.5, Some(vec![1.0, 3.0, 1.0, 3.0])),
            Err(HopRefusal::LossDisagrees {
                loss: 2.5,
                mean: 2.0
            })
        );
        // A forged loss: one number, no sequences a replay could check.
        assert_eq!(with(1.0, None), Err(HopRefusal::SequenceLosses(4)));
        assert_eq!(with(1.0, Some(vec![])), Err(HopRefusal::SequenceLosses(4)));
        assert_eq!(
            with(1.0, Some(vec![1.0; 3])),
            Err(HopRefusal::SequenceLosses(4)),
            "fewer than micro_batch"
        );
        assert_eq!(
            with(1.0, Some(vec![1.0; 5])),
            Err(HopRefusal::SequenceLosses(4)),
            "more than micro_batch"
        );
        assert_eq!(
            with(1.0, Some(vec![1.0, -1.0, 1.0, 3.0])),
            Err(HopRefusal::SequenceLosses(4))
        );
        let mut req = request(out.clone(), Some(1.0));
        req.weights_digest = "x".repeat(MAX_WEIGHTS_DIGEST + 1);
        assert_eq!(
            plan_completion(&hop, &req, 2, 4),
            Err(HopRefusal::DigestTooLong)
        );
        // Other hops report neither.
        let first = leased(0, Direction::Forward);
        assert_eq!(
            plan_completion(&first, &request(out.clone(), Some(2.0)), 2, 4),
            Err(HopRefusal::LossNotExpected)
        );
        let mut req = request(out, None);
        req.sequence_losses = Some(vec![2.0; 4]);
        assert_eq!(
            plan_completion(&first, &req, 2, 4),
            Err(HopRefusal::SequenceLosses(4))
        );
    }

    #[test]
    fn statuses_read_back_as_written() {
        for s in HopStatus::ALL {
            assert_eq!(HopStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(HopStatus::parse("lost"), None);
        assert!(HopStatus::Pending.is_open() && HopStatus::Leased.is_open());
        assert!(!HopStatus::Done.is_open());
        assert_eq!(
            SampleStatus::parse("backward"),
            Some(SampleStatus::Backward)
        );
    }
}
