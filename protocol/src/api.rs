//! Request and response types of the orchestrator's HTTP API (`orchestrator/API.md` describes the
//! routes; `orchestrator/openapi.json` is the generated contract).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::blob::BlobDescriptor;

/// Milliseconds since the Unix epoch, the API's one time format.
pub type UnixMs = i64;

mod run;
mod validator;

pub use run::{
    BYTES_PER_PARAM, HELD_OUT_BASE, MIN_RETENTION_EPOCHS, RunConfig, SPARSE_BYTES_PER_PARAM,
    SparseEncoding, limits, partition_range,
};
pub use validator::{
    Dispute, EpochRecord, MinerScore, MinerWork, ScoreRecord, ScoreSubmission, ScoringParams,
    SettleRequest, SpotCheckCandidate, SpotCheckReport, SpotCheckResult, SpotCheckTasks,
    WeightsSet,
};

/// Epoch phases, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Samples flow through the pipeline.
    Training,
    /// Miners upload pseudo-gradient partitions.
    Uploading,
    /// Partition owners merge.
    Merging,
}

impl Phase {
    /// The name stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Training => "training",
            Self::Uploading => "uploading",
            Self::Merging => "merging",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "training" => Some(Self::Training),
            "uploading" => Some(Self::Uploading),
            "merging" => Some(Self::Merging),
            _ => None,
        }
    }
}

/// Where the run is now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EpochStatus {
    /// Current epoch (0-based).
    pub epoch: u64,
    /// Current phase.
    pub phase: Phase,
    /// When the phase started.
    pub phase_started_ms: UnixMs,
    /// When the phase ends at the latest.
    pub phase_deadline_ms: UnixMs,
    /// Merge reassignment round (0 in the first merging round).
    pub merge_round: u32,
    /// Samples started this epoch.
    pub samples_started: u64,
    /// Samples whose backward pass reached stage 0 this epoch.
    pub samples_completed: u64,
    /// Samples given up on this epoch (a hop with nowhere to go, a lapsed backward, the epoch's
    /// end). Started minus completed minus abandoned are still travelling.
    #[serde(default)]
    pub samples_abandoned: u64,
    /// The server's clock when this was read.
    pub server_time_ms: UnixMs,
}

/// What a miner reports about its machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Capacity {
    /// `cpu`, `cuda:0`, … (at most 64 characters).
    #[schema(max_length = 64)]
    pub device: String,
    /// Memory available for training, in bytes (at most `i64::MAX`, as stored).
    #[schema(maximum = 9223372036854775807_u64)]
    pub memory_bytes: u64,
    /// Measured forward+backward throughput, tokens per second (at most [`MAX_TOKENS_PER_S`]).
    #[schema(minimum = 0.0, maximum = 1e9)]
    pub tokens_per_s: f64,
}

/// The largest throughput a miner may report, in tokens per second: far above what any accelerator
/// trains at, and small enough that a sum over every miner of a run stays finite (routing draws
/// from such sums).
pub const MAX_TOKENS_PER_S: f64 = 1e9;

/// Whether `tokens_per_s` is a throughput the orchestrator accepts: finite, from 0 to
/// [`MAX_TOKENS_PER_S`].
pub fn throughput_in_range(tokens_per_s: f64) -> bool {
    (0.0..=MAX_TOKENS_PER_S).contains(&tokens_per_s)
}

/// `POST /v1/miner/register`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RegisterRequest {
    /// The miner's machine.
    pub capacity: Capacity,
    /// Whether this process registered earlier in the running epoch and still holds what it
    /// computed (a miner re-joining after it was released for silence). `false`, the default,
    /// for a process that starts: if the hotkey completed hops of the running epoch before, its
    /// work in the epoch ends (see [`RegisterResponse::work_ended`]), since the state those hops
    /// left is gone and no pseudo-gradient it could upload would match them.
    #[serde(default)]
    pub holds_epoch_state: bool,
}

/// The answer to a registration: the stage to train and the weights to start from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RegisterResponse {
    /// The run.
    pub run: RunInfo,
    /// The miner's uid on the subnet.
    pub uid: u16,
    /// Assigned stage.
    pub stage: u32,
    /// Where the run is.
    pub status: EpochStatus,
    /// The weights the epoch in `status` started from (merges of earlier epochs), one blob per
    /// partition in partition order; `None` for a partition never merged (start it from
    /// `init_seed`).
    pub weights: StageWeights,
    /// An epoch in which the caller's work has ended (it uploaded its pseudo-gradient, or
    /// registered from a new process after completing hops of it): it is routed no more of
    /// that epoch's hops, completes none, and uploads no pseudo-gradient for it; it merges the
    /// partitions it owns and trains again from the next epoch.
    #[serde(default)]
    pub work_ended: Option<u64>,
}

/// Merged weights of one stage after an epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StageWeights {
    /// The epoch whose merge produced them (`None`: initial weights from the seed).
    pub epoch: Option<u64>,
    /// Stage.
    pub stage: u32,
    /// Per partition: its merged blob, or `None` when the partition kept its previous value.
    ///
    /// In a sparse run ([`RunConfig::sparse`]) a merge is the compressed update of one epoch,
    /// and these are the updates accepted in the epoch just before the one asked for (`None`:
    /// that partition was not updated); the weights are the initial ones with every epoch's
    /// updates applied in turn by the outer step.
    pub partitions: Vec<Option<BlobDescriptor>>,
}

/// Identity and configuration of the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunInfo {
    /// Run id.
    pub id: i64,
    /// Shapes and timing.
    pub config: RunConfig,
    /// The orchestrator's hotkey (what requests are signed for).
    pub orchestrator_hotkey: String,
    /// Subnet.
    pub netuid: u16,
    /// When the run was created.
    pub created_ms: UnixMs,
    /// Whether the run's store takes uploads straight from miners through presigned URLs
    /// (`…/presign`, PUT, then `…/commit`); otherwise they go through the orchestrator.
    #[serde(default)]
    pub direct_uploads: bool,
}

/// `POST /v1/miner/heartbeat`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HeartbeatRequest {
    /// Updated throughput measurement, if any (from 0 to [`MAX_TOKENS_PER_S`]).
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 1e9)]
    pub tokens_per_s: Option<f64>,
}

/// The answer to a heartbeat.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HeartbeatResponse {
    /// The miner's stage.
    pub stage: u32,
    /// Where the run is.
    pub status: EpochStatus,
}

/// `POST /v1/sessions` (signed with sr25519): open a session whose requests carry a MAC instead
/// of a signature (see [`crate::session`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OpenSessionRequest {
    /// The caller's handshake point `A = a·G`: a compressed Ristretto point, 64 hex digits.
    #[schema(pattern = "^(0x)?[0-9a-fA-F]{64}$")]
    pub public_key: String,
}

/// The answer to an open-session request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OpenSessionResponse {
    /// The session's token, sent as `Iota-Session` on each request of the session.
    pub session: String,
    /// The server's handshake point `B = b·G`, 64 hex digits.
    pub public_key: String,
    /// The session key sealed for the caller (`K ⊕ pad`, see [`crate::session`]), 64 hex digits.
    pub sealed_key: String,
    /// When the server stops taking the session, in milliseconds since the Unix epoch.
    pub expires_at_ms: u64,
}

/// The most work items one poll may ask for.
pub const MAX_WORK_ITEMS: u32 = 32;

/// `POST /v1/miner/work`: ask for leased work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WorkRequest {
    /// At most this many items, from 1 to [`MAX_WORK_ITEMS`].
    #[schema(minimum = 1, maximum = 32)]
    pub max_items: u32,
}

/// Direction of a hop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Activations towards the last stage.
    Forward,
    /// Gradients back towards stage 0.
    Backward,
}

impl Direction {
    /// The name stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::Backward => "backward",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "forward" => Some(Self::Forward),
            "backward" => Some(Self::Backward),
            _ => None,
        }
    }
}

/// One leased unit of work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WorkItem {
    /// Task id.
    pub task_id: i64,
    /// Lease: present it when uploading and completing.
    pub lease: Uuid,
    /// When the lease lapses.
    pub lease_expires_ms: UnixMs,
    /// Epoch of the sample.
    pub epoch: u64,
    /// Sample id (stage 0 builds its batch from it).
    pub sample_id: i64,
    /// Stage.
    pub stage: u32,
    /// Forward or backward.
    pub direction: Direction,
    /// The input: the previous stage's activations (forward at stage > 0) or the next stage's
    /// gradient (backward). `None` for a forward at stage 0.
    pub input: Option<BlobDescriptor>,
    /// Whether the task expects an output blob (everything except the backward at stage 0).
    pub expects_output: bool,
}

/// Answer to a work poll.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WorkResponse {
    /// Leased items (possibly none).
    pub items: Vec<WorkItem>,
    /// Where the run is.
    pub status: EpochStatus,
}

/// `POST /v1/miner/tasks/{task_id}/complete`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompleteRequest {
    /// The lease from the work item.
    pub lease: Uuid,
    /// The uploaded output (from the upload response), if the task expects one.
    #[serde(default)]
    pub output: Option<BlobDescriptor>,
    /// Inner optimizer steps the miner had taken this epoch when it ran this hop.
    pub inner_step: u64,
    /// BLAKE3 (hex) of the miner's stage weights when it ran this hop (at most 128 characters).
    #[schema(max_length = 128)]
    pub weights_digest: String,
    /// Mean token loss of the sample, nats (required on the last stage's forward).
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 1e4)]
    pub loss: Option<f64>,
    /// Per-sequence losses of the sample: exactly `micro_batch` on the last stage's forward,
    /// whose mean is `loss`; none on other hops.
    #[serde(default)]
    pub sequence_losses: Option<Vec<f64>>,
    /// Milliseconds the miner spent on the hop.
    #[serde(default)]
    pub compute_ms: Option<u64>,
}

/// Answer to a completion.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompleteResponse {
    /// The hop's task id.
    pub task_id: i64,
    /// The next task created for the sample, if any.
    pub next_task_id: Option<i64>,
    /// True when this completion finished the sample.
    pub sample_done: bool,
}

/// Answer to any direct upload: the stored object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct UploadResponse {
    /// The object as stored.
    pub blob: BlobDescriptor,
}

/// Answer to `POST /v1/miner/epochs/{epoch}/pseudo-gradients/reserve`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReservationResponse {
    /// The epoch whose uploading phase is held open for the caller's partitions.
    pub epoch: u64,
    /// The latest the phase stays open for them (its deadline plus one more phase length).
    pub holds_until_ms: UnixMs,
}

/// `POST …/presign`: ask to upload straight to the store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PresignRequest {
    /// Exact size the upload will have.
    pub size: u64,
    /// BLAKE3 the bytes will have (64 lowercase hex digits).
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub blake3: String,
    /// Whether the client can upload in parts ([`PresignResponse::multipart`]). Without it, the
    /// answer is always one URL for one PUT.
    #[serde(default)]
    pub multipart: bool,
}

/// A presigned upload target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PresignResponse {
    /// PUT the bytes here (with [`PresignResponse::multipart`]: the first part).
    pub url: String,
    /// Object key to name in the commit.
    pub key: String,
    /// When the URL stops working.
    pub expires_ms: UnixMs,
    /// For an object larger than the store's part size, when the request allowed it: upload it
    /// in parts, each PUT to its own URL (a part whose connection drops is sent again alone),
    /// then commit with [`CommitRequest::multipart`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multipart: Option<MultipartTarget>,
}

/// A presigned upload in parts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MultipartTarget {
    /// The store's id of the upload, named again in the commit.
    pub upload_id: String,
    /// Bytes of every part but the last, which holds the rest.
    pub part_bytes: u64,
    /// Where to PUT each part, in order (part numbers 1, 2, …).
    pub part_urls: Vec<String>,
}

/// The parts of a presigned upload in parts, for its commit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MultipartCommit {
    /// [`MultipartTarget::upload_id`].
    pub upload_id: String,
    /// The `ETag` the store answered to each part's PUT, in order.
    pub etags: Vec<String>,
}

/// `POST …/commit`: after a presigned upload, have the orchestrator check and record it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CommitRequest {
    /// The key from the presign response.
    pub key: String,
    /// Size.
    pub size: u64,
    /// BLAKE3 (64 lowercase hex digits).
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub blake3: String,
    /// For an upload in parts: the orchestrator completes it (the object appears at `key`)
    /// before checking it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multipart: Option<MultipartCommit>,
}

/// One partition a miner must merge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MergeAssignment {
    /// Epoch.
    pub epoch: u64,
    /// Stage.
    pub stage: u32,
    /// Partition index.
    pub partition: u32,
    /// Value range of the partition in the stage's flat parameter vector.
    pub start: u64,
    /// End of the range (exclusive).
    pub end: u64,
    /// Contributions in the fixed order to average them in, with their weights.
    pub contributions: Vec<MergeContribution>,
    /// The partition's latest merged weights and momentum from before this epoch
    /// (`iota-merged/v1`): the outer step starts from them. `None`: the initial weights from
    /// `init_seed` and zero momentum.
    #[serde(default)]
    pub base: Option<BlobDescriptor>,
    /// Upload the result by this time.
    pub deadline_ms: UnixMs,
}

/// One miner's pseudo-gradient partition in a merge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MergeContribution {
    /// Contributor.
    pub hotkey: String,
    /// Weight (completed backward passes this epoch).
    pub weight: f64,
    /// The partition blob.
    pub blob: BlobDescriptor,
}

/// Answer to `GET /v1/miner/merges`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MergeAssignments {
    /// Assignments of the current merging round.
    pub assignments: Vec<MergeAssignment>,
    /// Where the run is.
    pub status: EpochStatus,
}

/// State of one partition's merge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PartitionState {
    /// Waiting for owners.
    Open,
    /// Every first-round owner's result agrees (or a validator settled it).
    Accepted,
    /// Results disagree; validators recompute it.
    Disputed,
    /// Nobody contributed to this stage this epoch: weights are unchanged.
    Unchanged,
}

impl PartitionState {
    /// The name stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Accepted => "accepted",
            Self::Disputed => "disputed",
            Self::Unchanged => "unchanged",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "open" => Some(Self::Open),
            "accepted" => Some(Self::Accepted),
            "disputed" => Some(Self::Disputed),
            "unchanged" => Some(Self::Unchanged),
            _ => None,
        }
    }
}

/// Merge status of one partition.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PartitionStatus {
    /// Epoch.
    pub epoch: u64,
    /// Stage.
    pub stage: u32,
    /// Partition.
    pub partition: u32,
    /// State.
    pub state: PartitionState,
    /// Owners so far, in assignment order.
    pub owners: Vec<String>,
    /// Submitted results: owner and hash.
    pub results: Vec<MergeResult>,
    /// The accepted result.
    pub accepted: Option<BlobDescriptor>,
    /// Who settled it: `agreement` (every first-round owner, at least two, submitted the same
    /// hash) or `validator:<ss58>` (accepted by validators' votes holding a majority of the
    /// permit holders' stake; the vote that made it); `unmerged` (no result by the last
    /// deadline) or `unverified` (results that disagreed, or too few, and no validator majority
    /// settled them by then), both keeping the partition's weights.
    pub resolved_by: Option<String>,
}

/// One owner's merged result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MergeResult {
    /// Who submitted it.
    pub hotkey: String,
    /// BLAKE3 of the result. Absent from the public view (`GET /v1/epochs/{epoch}/merges`) while
    /// the partition is open or disputed: an owner who saw another's hash (and so its object's
    /// key) could submit that result as its own instead of merging.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blake3: Option<String>,
}

/// `POST /v1/miner/reports/bad-object`: a downloaded object failed its checks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct BadObjectReport {
    /// Object key.
    pub key: String,
    /// What was wrong.
    pub reason: String,
}

/// Answer to a bad-object report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct BadObjectVerdict {
    /// True when the orchestrator re-checked the object, found it bad and failed its producer.
    pub confirmed: bool,
    /// What happened.
    pub detail: String,
}

/// One recorded hop, as validators and explorers read it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HopRecord {
    /// Task id (increasing in creation order).
    pub task_id: i64,
    /// Epoch.
    pub epoch: u64,
    /// Sample.
    pub sample_id: i64,
    /// Stage.
    pub stage: u32,
    /// Direction.
    pub direction: Direction,
    /// Attempt number of this hop (re-routing adds one).
    pub attempt: u32,
    /// Miner that held it.
    pub miner: String,
    /// `pending`, `leased`, `done`, `expired`, `failed`, `abandoned`.
    pub status: String,
    /// Input blob.
    pub input: Option<BlobDescriptor>,
    /// Output blob.
    pub output: Option<BlobDescriptor>,
    /// Inner step the miner reported.
    pub inner_step: Option<u64>,
    /// Weight digest the miner reported.
    pub weights_digest: Option<String>,
    /// Created.
    pub created_ms: UnixMs,
    /// Leased.
    pub leased_ms: Option<UnixMs>,
    /// Completed.
    pub completed_ms: Option<UnixMs>,
    /// Miner-reported compute time.
    pub compute_ms: Option<u64>,
}

/// A page of hop records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HopPage {
    /// Records, by task id.
    pub hops: Vec<HopRecord>,
    /// Pass as `after` for the next page; `None` at the end.
    pub next_after: Option<i64>,
}

/// A sample with its pathway and loss.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SampleRecord {
    /// Sample id.
    pub sample_id: i64,
    /// Epoch.
    pub epoch: u64,
    /// `forward`, `backward`, `done`, `abandoned`.
    pub status: String,
    /// Miner (ss58) per stage on the pathway, as far as it got (the miner of the latest
    /// successful forward attempt at each stage).
    pub pathway: Vec<String>,
    /// Mean token loss from the last stage.
    pub loss: Option<f64>,
    /// Per-sequence losses.
    pub sequence_losses: Option<Vec<f64>>,
}

/// A page of samples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SamplePage {
    /// Samples, by id.
    pub samples: Vec<SampleRecord>,
    /// Pass as `after` for the next page; `None` at the end.
    pub next_after: Option<i64>,
}

/// A pseudo-gradient submission.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PseudoGradientRecord {
    /// Epoch.
    pub epoch: u64,
    /// Stage.
    pub stage: u32,
    /// Partition.
    pub partition: u32,
    /// Miner.
    pub hotkey: String,
    /// Blob.
    pub blob: BlobDescriptor,
    /// Merge weight.
    pub weight: f64,
}

/// A stage as explorers see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StageInfo {
    /// Stage.
    pub stage: u32,
    /// Flat parameter count.
    pub params: u64,
    /// Active miners.
    pub active_miners: u32,
    /// Sum of their reported throughput.
    pub tokens_per_s: f64,
}

/// A miner as explorers see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MinerInfo {
    /// Hotkey.
    pub hotkey: String,
    /// Uid at registration.
    pub uid: u16,
    /// Stage.
    pub stage: u32,
    /// `active` or `released`.
    pub status: String,
    /// Capacity as the miner reported it (its `tokens_per_s` claimed, not measured).
    pub capacity: Capacity,
    /// Last heartbeat or request.
    pub last_seen_ms: UnixMs,
    /// Epoch it joined in.
    pub joined_epoch: u64,
    /// Completed hops in the current epoch.
    pub hops_this_epoch: u64,
    /// Throughput as the orchestrator measured it from the miner's completed hops, tokens per
    /// second (`None` before its first); routing uses it in place of the claimed
    /// `capacity.tokens_per_s` once there is one.
    #[serde(default)]
    pub measured_tokens_per_s: Option<f64>,
}

/// One point of the loss series.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LossPoint {
    /// Epoch.
    pub epoch: u64,
    /// Samples with a loss.
    pub samples: u64,
    /// Mean loss over them.
    pub mean_loss: f64,
}

/// Throughput per epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ThroughputPoint {
    /// Epoch.
    pub epoch: u64,
    /// Completed samples.
    pub samples: u64,
    /// Tokens of completed samples.
    pub tokens: u64,
    /// Seconds from the epoch's start to the end of its training phase (or now).
    pub seconds: f64,
    /// Bytes of boundary tensors moved.
    pub wire_bytes: u64,
}

/// `GET /healthz` and the unsigned no-op.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// Always `ok`.
    pub status: String,
    /// Whether this process currently drives the epoch phases.
    pub leader: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Phases, directions and partition states are stored and sent by the names serde gives
    /// them, and read back.
    #[test]
    fn stored_names_round_trip() {
        for phase in [Phase::Training, Phase::Uploading, Phase::Merging] {
            assert_eq!(Phase::parse(phase.as_str()), Some(phase));
            let json = serde_json::to_string(&phase).expect("json");
            assert_eq!(json, format!("\"{}\"", phase.as_str()));
        }
        for direction in [Direction::Forward, Direction::Backward] {
            assert_eq!(Direction::parse(direction.as_str()), Some(direction));
            let json = serde_json::to_string(&direction).expect("json");
            assert_eq!(json, format!("\"{}\"", direction.as_str()));
        }
        for state in [
            PartitionState::Open,
            PartitionState::Accepted,
            PartitionState::Disputed,
            PartitionState::Unchanged,
        ] {
            assert_eq!(PartitionState::parse(state.as_str()), Some(state));
            let json = serde_json::to_string(&state).expect("json");
            assert_eq!(json, format!("\"{}\"", state.as_str()));
        }
        assert_eq!(PartitionState::parse("closed"), None);
        assert_eq!(Phase::parse("Training"), None);
        assert_eq!(Direction::parse("sideways"), None);
    }

    #[test]
    fn throughput_bounds() {
        for ok in [0.0, 1.5, MAX_TOKENS_PER_S] {
            assert!(throughput_in_range(ok), "{ok}");
        }
        for bad in [-1.0, MAX_TOKENS_PER_S * 1.5, f64::NAN, f64::INFINITY] {
            assert!(!throughput_in_range(bad), "{bad}");
        }
    }
}
