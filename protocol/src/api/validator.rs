//! What validators read of an epoch and what they report: spot checks, disputes, scores and
//! the settings they scored with.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    MergeContribution, PartitionStatus, Phase, PseudoGradientRecord, StageWeights, UnixMs,
};

/// What a validator may check for one epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EpochRecord {
    /// Epoch.
    pub epoch: u64,
    /// Current phase if the epoch is running, `None` when finished.
    pub phase: Option<Phase>,
    /// Per miner: stage and the work it did.
    pub miners: Vec<MinerWork>,
    /// Every pseudo-gradient submission.
    pub pseudo_gradients: Vec<PseudoGradientRecord>,
    /// Every partition's merge status.
    pub partitions: Vec<PartitionStatus>,
    /// Merged weights of the previous epoch per stage (the epoch-start weights to replay from).
    pub start_weights: Vec<StageWeights>,
}

/// A miner's work in one epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MinerWork {
    /// Miner.
    pub hotkey: String,
    /// The stage it worked in during the epoch (its pseudo-gradient's, else its last hop's),
    /// which may not be the stage it is in now.
    pub stage: u32,
    /// Completed forward hops.
    pub forward_done: u64,
    /// Completed backward hops.
    pub backward_done: u64,
    /// Leases that lapsed or were failed.
    pub failed: u64,
}

/// An open or settled dispute over a partition.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Dispute {
    /// Dispute id.
    pub id: i64,
    /// The partition.
    pub partition: PartitionStatus,
    /// The contributions the merge must be computed from.
    pub contributions: Vec<MergeContribution>,
    /// `open` or `settled`.
    pub state: String,
}

/// What a validator may spot-check in an epoch, and what validators reported checking.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SpotCheckTasks {
    /// Epoch.
    pub epoch: u64,
    /// Per miner with work in the epoch (a page of them, by hotkey): the hops that can be
    /// replayed, in the order they ran.
    pub miners: Vec<SpotCheckCandidate>,
    /// The last miner of a full page: ask again with `?after=` it for the next.
    #[serde(default)]
    pub next_after: Option<String>,
    /// Partitions whose merge can be re-derived (accepted ones, with their hash); on the first
    /// page only (empty on a page asked for with `?after=`).
    pub partitions: Vec<PartitionStatus>,
    /// Spot checks validators have reported for this epoch; on the first page only.
    pub reported: Vec<SpotCheckReport>,
}

/// One miner's replayable work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SpotCheckCandidate {
    /// Miner.
    pub hotkey: String,
    /// The stage it worked in during the epoch (its pseudo-gradient's, else its last hop's),
    /// which may not be the stage it is in now: the stage to replay it on.
    pub stage: u32,
    /// Completed hops at `stage`, by completion time (the replay order). Hops of another stage
    /// (before a move) are left out: the miner began the new stage afresh.
    pub hop_task_ids: Vec<i64>,
    /// Partitions of its pseudo-gradient that were uploaded.
    pub pseudo_gradient_partitions: Vec<u32>,
}

/// The outcome of one check.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SpotCheckResult {
    /// Miner checked.
    pub hotkey: String,
    /// `replay`, `merge`, `loss`, …
    pub kind: String,
    /// What was checked (task ids, `stage/partition`, …).
    pub target: String,
    /// Whether it passed.
    pub passed: bool,
    /// Measurements (cosine, relative error, hashes).
    pub detail: String,
}

/// `POST /v1/validator/epochs/{epoch}/spot-checks`: what a validator checked and found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SpotCheckReport {
    /// Validator (filled in by the orchestrator from the signature).
    #[serde(default)]
    pub validator: String,
    /// The seed the draw came from (hex), so anyone can redo the draw.
    #[schema(max_length = 256)]
    pub seed: String,
    /// The chain block whose hash went into the seed.
    pub seed_block: u64,
    /// Results.
    #[schema(max_items = 10000)]
    pub checks: Vec<SpotCheckResult>,
}

/// `POST /v1/validator/disputes/{id}/settle`: the hash the validator recomputed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SettleRequest {
    /// BLAKE3 of the recomputed merge (64 lowercase hex digits).
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub blake3: String,
}

/// One miner's score from one validator, with what went into it (so anyone can recompute it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MinerScore {
    /// Miner (at most 64 characters).
    #[schema(max_length = 64)]
    pub hotkey: String,
    /// Score (non-negative): `work * quality`.
    #[schema(minimum = 0.0)]
    pub score: f64,
    /// Gradient hops completed, times the share of the miner's pseudo-gradient merged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work: Option<f64>,
    /// Quality factor in [0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<f64>,
    /// Why the score is zero, when a check failed (at most 1024 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 1024)]
    pub penalty: Option<String>,
    /// The miner's CLASP effect on the loss (absent: not fitted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<f64>,
    /// Whether CLASP flagged the miner as harmful.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flagged: Option<bool>,
}

/// The settings a validator scored an epoch with, published with its scores: with them and the
/// public records, anyone can recompute its fit, scores and weights
/// (`iota validator audit --validator`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScoringParams {
    /// CLASP's ridge penalty.
    pub clasp_ridge: f64,
    /// CLASP's z-score above which a harmful effect is flagged.
    pub clasp_z_threshold: f64,
    /// CLASP's smallest flagged effect, in nats.
    pub clasp_min_effect: f64,
    /// CLASP's fewest samples for a flag.
    pub clasp_min_samples: u64,
    /// Epochs of samples one CLASP fit pools: the scored epoch and those before it (at most
    /// 64; absent in publications from before it was a setting, which fitted one epoch).
    #[serde(default = "one_epoch")]
    #[schema(minimum = 1, maximum = 64)]
    pub clasp_window: u64,
    /// Whether a stage's median effect, which flags and quality are judged against, is that
    /// of its miners fitted on at least `clasp_min_samples` samples (or of all of them where none
    /// is). Absent, and false, in publications from before it was the rule: they took the
    /// median of every miner.
    #[serde(default)]
    pub clasp_median_of_seen: bool,
    /// Loss difference (nats) at which quality halves.
    pub quality_scale: f64,
    /// Per-epoch decay of older scores, in (0, 1].
    pub decay: f64,
    /// Epochs of scores that count toward the weights (at most 1000).
    #[schema(maximum = 1000)]
    pub window: u64,
    /// The uid that receives the burn share, if any.
    #[serde(default)]
    pub burn_uid: Option<u16>,
    /// The share of the weights burnt, in [0, 1).
    #[serde(default)]
    pub burn_share: f64,
}

fn one_epoch() -> u64 {
    1
}

impl ScoringParams {
    /// Most epochs a published score window may span.
    pub const MAX_WINDOW: u64 = 1000;
    /// Most epochs one CLASP fit may pool (what it holds in memory grows with them).
    pub const MAX_CLASP_WINDOW: u64 = 64;

    /// Whether every value is one a validator could have scored with.
    pub fn is_valid(&self) -> bool {
        let finite = [
            self.clasp_ridge,
            self.clasp_z_threshold,
            self.clasp_min_effect,
            self.quality_scale,
            self.decay,
            self.burn_share,
        ]
        .iter()
        .all(|v| v.is_finite());
        finite
            && self.clasp_ridge >= 0.0
            && self.quality_scale > 0.0
            && self.decay > 0.0
            && self.decay <= 1.0
            && (1..=Self::MAX_WINDOW).contains(&self.window)
            && (1..=Self::MAX_CLASP_WINDOW).contains(&self.clasp_window)
            && (0.0..1.0).contains(&self.burn_share)
    }
}

/// Weights a validator set on chain.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WeightsSet {
    /// Block the weights landed in.
    #[schema(maximum = 9223372036854775807_u64)]
    pub block: u64,
    /// Uids, each once.
    #[schema(max_items = 4096)]
    pub uids: Vec<u16>,
    /// Weights, u16 as set, one per uid.
    #[schema(max_items = 4096)]
    pub weights: Vec<u16>,
}

/// `POST /v1/validator/epochs/{epoch}/scores`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScoreSubmission {
    /// Scores per miner.
    #[schema(max_items = 4096)]
    pub scores: Vec<MinerScore>,
    /// The on-chain weights these scores produced, once they are on chain (set, or revealed).
    #[serde(default)]
    pub weights: Option<WeightsSet>,
    /// The settings the epoch was scored with.
    #[serde(default)]
    pub params: Option<ScoringParams>,
}

/// A stored score submission.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScoreRecord {
    /// Validator.
    pub validator: String,
    /// Epoch.
    pub epoch: u64,
    /// Scores.
    pub scores: Vec<MinerScore>,
    /// Weights set.
    pub weights: Option<WeightsSet>,
    /// The settings the epoch was scored with.
    #[serde(default)]
    pub params: Option<ScoringParams>,
    /// When submitted.
    pub submitted_ms: UnixMs,
}
