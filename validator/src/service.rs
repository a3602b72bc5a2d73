//! The validator loop: for each finished epoch, draw what to check from a seed nobody knew while
//! the work was done, replay and re-derive it, fit CLASP on every sample, store the scores, then
//! set weights on chain from the database; settle the orchestrator's merge disputes as they come.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use iota_chain::wallet::Keypair;
use iota_chain::{Subtensor, TxOptions};
use iota_protocol::BlobDescriptor;
use iota_protocol::api::limits::MAX_SAMPLES_PER_EPOCH;
use iota_protocol::api::{
    Direction, EpochRecord, HopRecord, PartitionState, PartitionStatus, RunConfig, SampleRecord,
    SpotCheckReport, SpotCheckResult,
};
use iota_protocol::client::{ApiClient, RetryPolicy};
use iota_protocol::signing::RequestSigner;
use iota_protocol::tensor::decode_merged;
use iota_protocol::{ClientError, ErrorCode};
use iota_trainer::sparse::SparseWeights;
use rand::SeedableRng;
use rand::seq::SliceRandom;

use crate::clasp::{ClaspConfig, HotkeyEffects, fit_samples};
use crate::error::ValidatorError;
use crate::owed::OwedWeights;
use crate::published;
use crate::replay::{RecordedHop, ReplayThresholds, replay_miner};
use crate::score::{CheckRow, EpochScore, ScoreConfig, epoch_scores, failures};
use crate::store::Store;

mod disputes;
mod publish;
mod sparse;
mod weights;

pub(crate) use weights::{PROCESS_WEIGHTS, chain_values};

/// Settings of a validator.
#[derive(Clone, Debug)]
pub struct ValidatorConfig {
    /// The orchestrator's base URL.
    pub orchestrator_url: String,
    /// Subnet.
    pub netuid: u16,
    /// Pause between loop steps.
    pub poll_interval: Duration,
    /// Miners whose epoch is replayed per scored epoch (0: every miner).
    pub replays_per_epoch: usize,
    /// Accepted partitions re-derived per scored epoch (0: every partition).
    pub merges_per_epoch: usize,
    /// Replay thresholds.
    pub thresholds: ReplayThresholds,
    /// Runs each replayed micro-batch is cut into, trained side by side
    /// (`StageOptions::sub_batches`; 1: whole).
    pub replay_sub_batches: usize,
    /// CLASP settings.
    pub clasp: ClaspConfig,
    /// Scoring settings.
    pub score: ScoreConfig,
    /// A share of the weights for this uid (the subnet owner's burn), in [0, 1).
    pub burn: Option<(u16, f64)>,
    /// Set weights on chain (off: score only).
    pub set_weights: bool,
    /// Chain transaction options.
    pub tx: TxOptions,
    /// Retries of orchestrator requests; once they are spent the orchestrator counts as
    /// unreachable and the validator copies the chain's consensus weights instead.
    pub retry: RetryPolicy,
    /// A local copy of the run's prepared dataset, for a run that names one (without it, the
    /// dataset is fetched from the run's store into `data_cache`).
    pub data_dir: Option<std::path::PathBuf>,
    /// Where a dataset fetched from the run's store is kept: `<data_cache>/<manifest BLAKE3>/`.
    pub data_cache: std::path::PathBuf,
}

impl ValidatorConfig {
    /// Defaults for the orchestrator at `url` on `netuid`.
    pub fn new(url: impl Into<String>, netuid: u16) -> Self {
        Self {
            orchestrator_url: url.into(),
            netuid,
            poll_interval: Duration::from_secs(2),
            replays_per_epoch: 4,
            merges_per_epoch: 4,
            thresholds: ReplayThresholds::default(),
            replay_sub_batches: 1,
            clasp: ClaspConfig::default(),
            score: ScoreConfig::default(),
            burn: None,
            set_weights: true,
            tx: TxOptions::default(),
            retry: RetryPolicy::default(),
            data_dir: None,
            data_cache: iota_protocol::dataset_cache::DEFAULT_DATA_CACHE.into(),
        }
    }
}

/// What scoring one epoch found.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EpochOutcome {
    /// Epoch.
    pub epoch: u64,
    /// The draw's seed (hex) and the block whose hash went into it.
    pub seed: String,
    /// Seed block.
    pub seed_block: u64,
    /// Every check's outcome.
    pub checks: Vec<SpotCheckResult>,
    /// Scores.
    pub scores: Vec<EpochScore>,
}

/// The orchestrator side of a validator, known once the orchestrator has answered.
struct Online {
    client: ApiClient,
    run_id: i64,
    run: RunConfig,
    /// The run's prepared dataset: the configured copy, or the one fetched into the cache.
    data_dir: Option<std::path::PathBuf>,
}

/// A validator with its clients and database.
pub struct Validator {
    cfg: ValidatorConfig,
    chain: Subtensor,
    hotkey: Keypair,
    store: Store,
    online: tokio::sync::OnceCell<Online>,
    /// When owed weights may be tried again ([`Validator::weights_owed`]).
    owed: std::sync::Mutex<OwedWeights>,
    /// Held while revealing: [`run`] reveals beside a step that may reveal too, and a commit
    /// revealed twice would have its second reveal refused and be recorded as failed.
    revealing: tokio::sync::Mutex<()>,
    /// A sparse run's weights per stage at the latest epoch start folded so far.
    sparse_weights: tokio::sync::Mutex<HashMap<u32, SparseWeights>>,
}

/// Whether `e` means the orchestrator cannot be reached (the network failed on every retry, or a
/// gateway in front of it answers that it is down), as opposed to an answer the validator must
/// act on.
pub fn orchestrator_unreachable(e: &ValidatorError) -> bool {
    match e {
        ValidatorError::Api(iota_protocol::ClientError::Network(_)) => true,
        ValidatorError::Api(iota_protocol::ClientError::Api { status, .. }) => {
            matches!(status, 502..=504)
        }
        // Fetched again on the next connection attempt.
        ValidatorError::Dataset(e) => e.is_transient(),
        _ => false,
    }
}

/// The seed of an epoch's draw: BLAKE3 keyed by the validator's secret over the hash of a block
/// produced after the epoch's uploads closed and the epoch number.
pub fn draw_seed(secret: &[u8; 32], block_hash: &[u8], epoch: u64) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(secret);
    h.update(block_hash);
    h.update(&epoch.to_le_bytes());
    *h.finalize().as_bytes()
}

/// CLASP over every sample of an epoch whose forward reached the loss (see [`fit_samples`]);
/// `None` (logged) when nothing can be fitted. The service and the audit both fit here.
pub(crate) fn fit_epoch(
    epoch: u64,
    stages: u32,
    samples: &[SampleRecord],
    cfg: &ClaspConfig,
) -> Option<HotkeyEffects> {
    match fit_samples(stages as usize, samples, cfg) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(epoch, error = %e, "no CLASP fit this epoch");
            None
        }
    }
}

/// Who a finding about the orchestrator's own records is recorded against (no miner's hotkey).
pub const ORCHESTRATOR_FINDING: &str = "orchestrator";

/// The finding that the orchestrator listed `missing` as `miner`'s hops and did not return
/// them: a failed check of the orchestrator, which costs no miner anything.
fn missing_hops_finding(miner: &str, missing: &[i64]) -> SpotCheckResult {
    SpotCheckResult {
        hotkey: ORCHESTRATOR_FINDING.into(),
        kind: "missing_hops".into(),
        target: format!("{} hops of {miner}", missing.len()),
        passed: false,
        detail: serde_json::json!({ "miner": miner, "task_ids": missing }).to_string(),
    }
}

fn pick<T: Clone>(items: &[T], n: usize, rng: &mut rand::rngs::StdRng) -> Vec<T> {
    if n == 0 || n >= items.len() {
        return items.to_vec();
    }
    items.choose_multiple(rng, n).cloned().collect()
}

/// The merges a validator recomputes: every partition whose owners submitted different results
/// (a dispute, whose losers are penalised on this validator's own recomputation, not on whoever
/// settled it), and `n` drawn among the other partitions with a result (0: all of them).
fn merges_to_check(
    partitions: &[PartitionStatus],
    n: usize,
    rng: &mut rand::rngs::StdRng,
) -> Vec<PartitionStatus> {
    let (disputed, agreed): (Vec<_>, Vec<_>) = partitions
        .iter()
        .filter(|p| p.state == PartitionState::Accepted || !p.results.is_empty())
        .cloned()
        .partition(|p| {
            let hashes: HashSet<&str> = p
                .results
                .iter()
                .filter_map(|r| r.blake3.as_deref())
                .collect();
            hashes.len() > 1
        });
    let mut checked = disputed;
    checked.extend(pick(&agreed, n, rng));
    checked
}

/// The most sample records read for one epoch: an epoch starts at most the run's
/// `samples_per_epoch`, which a valid run keeps at or below this.
pub const MAX_SAMPLE_RECORDS: usize = MAX_SAMPLES_PER_EPOCH as usize;

/// The most hop records scanned for one epoch (only those of the miners replayed are kept): a
/// sample makes two hops per stage and a few more when leases lapse, so this is far above any
/// real epoch, and it bounds how long an orchestrator can keep a validator paging.
pub const MAX_HOP_RECORDS: usize = 1 << 24;

/// Reads the pages `fetch(after)` returns (records, next cursor) into `keep`, starting after 0.
/// A page that names a next cursor must hold records and move the cursor strictly forward, and
/// at most `max_records` records are read in all: an orchestrator cannot keep the validator
/// paging (or growing what it keeps) for ever.
pub(crate) async fn read_pages<T, F, Fut>(
    what: &str,
    max_records: usize,
    mut fetch: F,
    mut keep: impl FnMut(T),
) -> Result<(), ValidatorError>
where
    F: FnMut(i64) -> Fut,
    Fut: Future<Output = Result<(Vec<T>, Option<i64>), ValidatorError>>,
{
    let mut after = 0i64;
    let mut read = 0usize;
    loop {
        let (records, next) = fetch(after).await?;
        read = read.saturating_add(records.len());
        if read > max_records {
            return Err(ValidatorError::BadAnswer(format!(
                "{what}: more than {max_records} records"
            )));
        }
        let empty = records.is_empty();
        records.into_iter().for_each(&mut keep);
        match next {
            None => return Ok(()),
            Some(n) if n > after && !empty => after = n,
            Some(n) => {
                return Err(ValidatorError::BadAnswer(format!(
                    "{what}: the page after {after} names {n} as the next (records: {})",
                    if empty { "none" } else { "some" }
                )));
            }
        }
    }
}

/// Whether the orchestrator may have collected objects that checking `epoch` needs by the time
/// the run is in `current`. It deletes the objects of epochs before `current -
/// retention_epochs` (at least one epoch is kept), merged weights too unless the oldest kept
/// epoch starts from them; a replay of `epoch` needs its objects and the weights merged at the
/// end of the epoch before. (So the oldest kept epoch could still be checked; it is counted as
/// collected, which is on the safe side.)
pub fn objects_collected(epoch: u64, current: u64, retention_epochs: u64) -> bool {
    epoch
        .saturating_sub(1)
        .saturating_add(retention_epochs.max(1))
        < current
}

/// Why an object could not be used.
#[derive(Clone, Debug)]
enum Fault {
    /// The store does not have it (deleted by its producer, or collected).
    Missing(String),
    /// Not the bytes its descriptor names, or they do not decode.
    Bad(String),
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing(m) | Self::Bad(m) => f.write_str(m),
        }
    }
}

/// What one scoring pass learned about objects it could not use: the failed checks against
/// their producers (each object blamed once on each) and whether any was missing from the store.
#[derive(Default)]
struct Objects {
    checks: Vec<SpotCheckResult>,
    /// (object key, producer) pairs already failed.
    blamed: HashSet<(String, String)>,
    missing: bool,
}

impl Objects {
    /// Notes `fault` of `blob`, and fails `producer`'s check `kind` on `target` for it.
    fn blame(
        &mut self,
        producer: Option<&str>,
        kind: &str,
        target: String,
        blob: &BlobDescriptor,
        fault: &Fault,
    ) {
        self.missing |= matches!(fault, Fault::Missing(_));
        tracing::warn!(key = %blob.key, producer, error = %fault, "object unusable");
        let Some(producer) = producer else { return };
        if !self.blamed.insert((blob.key.clone(), producer.to_owned())) {
            return;
        }
        self.checks.push(SpotCheckResult {
            hotkey: producer.to_owned(),
            kind: kind.to_owned(),
            target,
            passed: false,
            detail: serde_json::json!({ "key": blob.key, "error": fault.to_string() }).to_string(),
        });
    }
}

impl Validator {
    /// Connects to the orchestrator, the chain and the database. An unreachable orchestrator is
    /// not an error: the validator starts without it (and copies consensus weights, see
    /// [`Validator::step`]) and connects once it answers.
    pub async fn connect(
        cfg: ValidatorConfig,
        hotkey: Keypair,
        chain: Subtensor,
        store: Store,
    ) -> Result<Self, ValidatorError> {
        // A previous run of this validator may have stopped in the middle of a submission.
        let settled = store.recover_interrupted().await?;
        if settled > 0 {
            tracing::warn!(
                settled,
                "weight submissions interrupted by a stop were settled"
            );
        }
        let v = Self {
            cfg,
            chain,
            hotkey,
            store,
            online: tokio::sync::OnceCell::new(),
            owed: std::sync::Mutex::default(),
            revealing: tokio::sync::Mutex::new(()),
            sparse_weights: tokio::sync::Mutex::default(),
        };
        match v.online().await {
            Ok(_) => {}
            Err(e) if orchestrator_unreachable(&e) => {
                tracing::warn!(url = %v.cfg.orchestrator_url, error = %e,
                    "orchestrator unreachable; starting without it");
            }
            Err(e) => return Err(e),
        }
        Ok(v)
    }

    /// The orchestrator's client and run, connecting on first use.
    async fn online(&self) -> Result<&Online, ValidatorError> {
        self.online
            .get_or_try_init(|| async {
                let signer: Arc<dyn RequestSigner> = Arc::new(self.hotkey.as_pair().clone());
                let client =
                    ApiClient::connect(&self.cfg.orchestrator_url, signer, self.cfg.retry).await?;
                // Checked: the run sizes what the validator allocates.
                let info = client.run_info().await?;
                let mut data_dir = self.cfg.data_dir.clone();
                if let (Some(hash), None) = (&info.config.dataset, &data_dir) {
                    let dir = iota_protocol::dataset_cache::cache_dir(&self.cfg.data_cache, hash);
                    let fetched =
                        iota_protocol::dataset_cache::fetch_dataset(&client, hash, &dir).await?;
                    tracing::info!(dataset = %hash, dir = %dir.display(),
                        downloaded = fetched.downloaded.len(), kept = fetched.kept.len(),
                        "the run's dataset is in the cache");
                    data_dir = Some(dir);
                }
                Ok(Online {
                    client,
                    run_id: info.id,
                    run: info.config,
                    data_dir,
                })
            })
            .await
    }

    /// The database.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The chain client.
    pub fn chain(&self) -> &Subtensor {
        &self.chain
    }

    /// The validator's hotkey.
    pub fn hotkey(&self) -> &Keypair {
        &self.hotkey
    }

    /// The settings.
    pub fn config(&self) -> &ValidatorConfig {
        &self.cfg
    }

    /// The orchestrator client (connecting if not yet connected).
    pub async fn client(&self) -> Result<&ApiClient, ValidatorError> {
        Ok(&self.online().await?.client)
    }

    /// The run's id and settings (connecting if not yet connected).
    pub async fn run_info(&self) -> Result<(i64, &RunConfig), ValidatorError> {
        let o = self.online().await?;
        Ok((o.run_id, &o.run))
    }

    /// An object's bytes; `Ok(Err(fault))` when its producer is to blame for not having them
    /// (other failures, such as an unreachable orchestrator, are errors: the epoch is retried).
    async fn fetch(&self, blob: &BlobDescriptor) -> Result<Result<Vec<u8>, Fault>, ValidatorError> {
        let o = self.online().await?;
        match o.client.download(blob).await {
            Ok(b) => Ok(Ok(b.to_vec())),
            Err(e @ ClientError::BadObject(_)) => Ok(Err(Fault::Bad(e.to_string()))),
            Err(e) if e.code() == Some(ErrorCode::NotFound) => {
                Ok(Err(Fault::Missing(e.to_string())))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The weights and momentum `stage` started `record`'s epoch with, per partition (`None`:
    /// never merged). `None` when one of them cannot be used: nothing that depends on them can
    /// be checked. Accepted merges are sealed under their hash, where no owner can write, so
    /// bytes that do not decode are what the owners submitted: each owner whose result carries
    /// that hash fails. A missing merge is nobody's fault (the orchestrator may have collected
    /// it).
    async fn start_weights(
        &self,
        record: &EpochRecord,
        stage: u32,
        objects: &mut Objects,
    ) -> Result<Option<Vec<Option<(Vec<f32>, Vec<f32>)>>>, ValidatorError> {
        let o = self.online().await?;
        // A valid run bounds the partitions (`RunConfig::validate`).
        let mut out = vec![None; o.run.partitions as usize];
        let Some(sw) = record.start_weights.iter().find(|w| w.stage == stage) else {
            return Ok(Some(out));
        };
        for (j, blob) in sw.partitions.iter().enumerate() {
            let (Some(blob), Some(slot)) = (blob, out.get_mut(j)) else {
                continue;
            };
            let len = o
                .run
                .partition_range(stage, j as u32)
                .map(|r| r.end - r.start)
                .unwrap_or(0);
            let decoded = match self.fetch(blob).await? {
                Ok(bytes) => decode_merged(&bytes, len).map_err(|e| Fault::Bad(e.to_string())),
                Err(f) => Err(f),
            };
            match decoded {
                Ok(v) => *slot = Some(v),
                Err(f) => {
                    let owners = match (&f, sw.epoch) {
                        (Fault::Bad(_), Some(merged_in)) => {
                            self.merge_owners(merged_in, stage, j as u32, &blob.blake3)
                                .await?
                        }
                        _ => Vec::new(),
                    };
                    let target = format!("merged {stage}/{j}");
                    if owners.is_empty() {
                        objects.blame(None, "object", target, blob, &f);
                    } else {
                        for owner in &owners {
                            objects.blame(Some(owner), "object", target.clone(), blob, &f);
                        }
                    }
                    return Ok(None);
                }
            }
        }
        Ok(Some(out))
    }

    /// The owners of partition `partition` of `stage` in `epoch` whose submitted result has hash
    /// `blake3`.
    async fn merge_owners(
        &self,
        epoch: u64,
        stage: u32,
        partition: u32,
        blake3: &str,
    ) -> Result<Vec<String>, ValidatorError> {
        let o = self.online().await?;
        let statuses = o.client.merge_status(epoch).await?;
        Ok(statuses
            .iter()
            .filter(|p| p.stage == stage && p.partition == partition)
            .flat_map(|p| &p.results)
            .filter(|r| r.blake3.as_deref() == Some(blake3))
            .map(|r| r.hotkey.clone())
            .collect())
    }

    /// Hands every hop record of `epoch` to `each`, page by page (at most [`MAX_HOP_RECORDS`]).
    async fn each_hop(
        &self,
        epoch: u64,
        each: impl FnMut(HopRecord),
    ) -> Result<(), ValidatorError> {
        let o = self.online().await?;
        read_pages(
            "hop records",
            MAX_HOP_RECORDS,
            |after| async move {
                let page = o.client.hops(epoch, after, 500).await?;
                Ok((page.hops, page.next_after))
            },
            each,
        )
        .await
    }

    /// The hop records of `epoch` whose task ids are in `wanted`.
    async fn all_hops(
        &self,
        epoch: u64,
        wanted: &HashSet<i64>,
    ) -> Result<HashMap<i64, HopRecord>, ValidatorError> {
        let mut out = HashMap::new();
        self.each_hop(epoch, |h| {
            if wanted.contains(&h.task_id) {
                out.insert(h.task_id, h);
            }
        })
        .await?;
        Ok(out)
    }

    /// The miner whose hop of `epoch` produced the object `key`.
    async fn producer_of(&self, epoch: u64, key: &str) -> Result<Option<String>, ValidatorError> {
        let mut found = None;
        self.each_hop(epoch, |h| {
            if h.output.as_ref().is_some_and(|b| b.key == key) {
                found = Some(h.miner);
            }
        })
        .await?;
        Ok(found)
    }

    pub(crate) async fn all_samples(
        &self,
        epoch: u64,
    ) -> Result<Vec<SampleRecord>, ValidatorError> {
        let o = self.online().await?;
        let mut out = Vec::new();
        read_pages(
            "sample records",
            MAX_SAMPLE_RECORDS,
            |after| async move {
                let page = o.client.samples(epoch, after, 1000).await?;
                Ok((page.samples, page.next_after))
            },
            |s| out.push(s),
        )
        .await?;
        Ok(out)
    }

    /// The samples of the epochs before `epoch` in a CLASP window of `window` epochs.
    async fn samples_before(
        &self,
        epoch: u64,
        window: u64,
    ) -> Result<Vec<SampleRecord>, ValidatorError> {
        let mut out = Vec::new();
        for e in (epoch + 1).saturating_sub(window.max(1))..epoch {
            out.extend(self.all_samples(e).await?);
        }
        Ok(out)
    }

    /// A block produced after the epoch's uploads closed: the next block from now (called once
    /// the epoch has finished). Returns its number and hash.
    async fn fresh_block(&self) -> Result<(u64, Vec<u8>), ValidatorError> {
        let now = self.chain.best_block_number().await?;
        let n = self
            .chain
            .wait_for_block(now + 1, Duration::from_secs(120))
            .await?;
        let hash = self
            .chain
            .rpc()
            .chain_get_block_hash(Some(n.into()))
            .await
            .map_err(|e| ValidatorError::Chain(iota_chain::ChainError::Rpc(e.to_string())))?
            .ok_or_else(|| {
                ValidatorError::Chain(iota_chain::ChainError::Rpc(format!("no block {n}")))
            })?;
        Ok((n, hash.0.to_vec()))
    }

    /// Verifies and scores a finished epoch, and stores the result (once per epoch).
    pub async fn score_epoch(&self, epoch: u64) -> Result<EpochOutcome, ValidatorError> {
        let o = self.online().await?;
        let gone = |reason: String| ValidatorError::EpochGone { epoch, reason };
        let current = o.client.status().await?.epoch;
        if objects_collected(epoch, current, o.run.retention_epochs) {
            return Err(gone(format!(
                "the run is in epoch {current} and keeps {} epochs of objects",
                o.run.retention_epochs
            )));
        }
        let record = match o.client.epoch_record(epoch).await {
            Ok(r) => r,
            Err(e) if e.code() == Some(ErrorCode::NotFound) => return Err(gone(e.to_string())),
            Err(e) => return Err(e.into()),
        };
        if record.phase.is_some() {
            return Err(ValidatorError::Config(format!(
                "epoch {epoch} has not finished"
            )));
        }
        let secret = self.store.secret().await?;
        let (seed_block, block_hash) = self.fresh_block().await?;
        let seed = draw_seed(&secret, &block_hash, epoch);
        let seed_hex = hex::encode(seed);
        tracing::info!(epoch, seed = %seed_hex, seed_block, "spot-check draw");
        let mut rng = rand::rngs::StdRng::from_seed(seed);
        let mut checks: Vec<SpotCheckResult> = Vec::new();
        // Objects that cannot be used fail their producer's check; they never stop the epoch.
        let mut objects = Objects::default();

        // Replays.
        let tasks = o.client.spot_checks(epoch).await?;
        let chosen = pick(&tasks.miners, self.cfg.replays_per_epoch, &mut rng);
        let wanted: HashSet<i64> = chosen
            .iter()
            .flat_map(|c| c.hop_task_ids.iter().copied())
            .collect();
        let hops = if chosen.is_empty() {
            HashMap::new()
        } else {
            self.all_hops(epoch, &wanted).await?
        };
        let samples = self.all_samples(epoch).await?;
        let losses: HashMap<i64, Vec<f64>> = samples
            .iter()
            .filter_map(|s| s.sequence_losses.clone().map(|l| (s.sample_id, l)))
            .collect();
        let last = o.run.stages.saturating_sub(1);
        for cand in &chosen {
            // Its pseudo-gradient first: what it uploaded is checked even when the replay
            // cannot run.
            let mut claimed_pg = Vec::new();
            for pg in record
                .pseudo_gradients
                .iter()
                .filter(|p| p.hotkey == cand.hotkey)
            {
                let j = pg.partition;
                let len = o
                    .run
                    .partition_range(cand.stage, j)
                    .map(|r| r.end - r.start)
                    .unwrap_or(0);
                let decoded = match self.fetch(&pg.blob).await? {
                    Ok(bytes) => sparse::claimed_values(&o.run, cand.stage, j, len, &bytes)
                        .map_err(|e| Fault::Bad(e.to_string())),
                    Err(f) => Err(f),
                };
                match decoded {
                    Ok(v) => claimed_pg.push((j, v)),
                    // Recorded as a check of its own, so the penalty can be re-derived from the
                    // database (the audit does).
                    Err(f) => objects.blame(
                        Some(&cand.hotkey),
                        "pseudo_gradient",
                        format!("{}/{j}", cand.stage),
                        &pg.blob,
                        &f,
                    ),
                }
            }
            // A hop the orchestrator lists as this miner's but does not return cannot be
            // replayed, and a replay of the rest would judge an incomplete record: a finding
            // against the orchestrator, stored and published with the checks, and no verdict
            // on the miner.
            let missing: Vec<i64> = cand
                .hop_task_ids
                .iter()
                .filter(|id| !hops.contains_key(id))
                .copied()
                .collect();
            if !missing.is_empty() {
                tracing::error!(epoch, miner = %cand.hotkey, ?missing,
                    "the orchestrator lists hops it does not return; replay skipped");
                checks.push(missing_hops_finding(&cand.hotkey, &missing));
                continue;
            }
            let mut recorded = Vec::new();
            let mut miner_compute_ms = 0u64;
            // An input nobody can read leaves the replay without what the miner computed from:
            // its producer is blamed and this miner's replay is inconclusive.
            let mut replayable = true;
            for h in cand.hop_task_ids.iter().filter_map(|id| hops.get(id)) {
                miner_compute_ms += h.compute_ms.unwrap_or(0);
                let input = match &h.input {
                    Some(b) => match self.fetch(b).await? {
                        Ok(bytes) => Some(bytes),
                        Err(f) => {
                            let producer = self.producer_of(epoch, &b.key).await?;
                            objects.blame(
                                producer.as_deref(),
                                "object",
                                format!("input of task {}", h.task_id),
                                b,
                                &f,
                            );
                            replayable = false;
                            break;
                        }
                    },
                    None => None,
                };
                // A claimed output nobody can read fails its hop in the replay, and the miner.
                let output = match &h.output {
                    Some(b) => match self.fetch(b).await? {
                        Ok(bytes) => Some(bytes),
                        Err(f) => {
                            objects.blame(
                                Some(&h.miner),
                                "object",
                                format!("output of task {}", h.task_id),
                                b,
                                &f,
                            );
                            None
                        }
                    },
                    None => None,
                };
                let last_forward = h.stage == last && h.direction == Direction::Forward;
                recorded.push(RecordedHop {
                    task_id: h.task_id,
                    sample_id: h.sample_id,
                    direction: h.direction,
                    input,
                    output,
                    sequence_losses: if last_forward {
                        losses.get(&h.sample_id).cloned()
                    } else {
                        None
                    },
                });
            }
            let start = match o.run.sparse {
                Some(_) => self.sparse_start(cand.stage, epoch).await?,
                None => self
                    .start_weights(&record, cand.stage, &mut objects)
                    .await?
                    .map(|s| s.into_iter().map(|p| p.map(|(v, _)| v)).collect()),
            };
            let start: Vec<Option<Vec<f32>>> = match start {
                Some(s) if replayable => s,
                _ => {
                    tracing::warn!(epoch, miner = %cand.hotkey,
                        "replay skipped: an object it needs cannot be used");
                    continue;
                }
            };
            let (run, stage, t) = (o.run.clone(), cand.stage, self.cfg.thresholds);
            let sub_batches = self.cfg.replay_sub_batches;
            let data_dir = o.data_dir.clone();
            let report = tokio::task::spawn_blocking(move || {
                replay_miner(
                    &run,
                    data_dir.as_deref(),
                    stage,
                    epoch,
                    &start,
                    &recorded,
                    &claimed_pg,
                    &t,
                    sub_batches,
                )
            })
            .await
            .map_err(|e| ValidatorError::Config(format!("replay task: {e}")))??;
            // What a check costs next to the work it checks (the miner's reported compute).
            let cost_ratio = report.compute_s / (miner_compute_ms as f64 / 1e3).max(1e-3);
            tracing::info!(epoch, miner = %cand.hotkey, passed = report.passed, hops = report.hops,
                replay_s = report.compute_s, miner_compute_s = miner_compute_ms as f64 / 1e3, cost_ratio,
                worst_cosine = report.worst_cosine, worst_relative_error = report.worst_relative_error,
                pg_cosine = report.pseudo_gradient_cosine, "replay");
            checks.push(SpotCheckResult {
                hotkey: cand.hotkey.clone(),
                kind: "replay".into(),
                target: format!("{} hops", report.hops),
                passed: report.passed,
                detail: serde_json::to_string(&report).unwrap_or_default(),
            });
        }

        // Merges: every owner's submitted hash against the recomputation (none when an object
        // the recomputation needs cannot be used: its producer is blamed instead).
        for p in merges_to_check(&record.partitions, self.cfg.merges_per_epoch, &mut rng) {
            let hash = match self
                .recompute(&record, p.stage, p.partition, &mut objects)
                .await
            {
                Ok(Some((_, hash))) => hash,
                Ok(None) => continue,
                // The merge itself cannot be computed (its outer step is not finite): nobody's
                // result is judged against it, and the epoch is scored all the same.
                Err(ValidatorError::Model(e)) => {
                    tracing::warn!(epoch, stage = p.stage, partition = p.partition, error = %e,
                        "cannot recompute the merge; not judged");
                    continue;
                }
                Err(e) => return Err(e),
            };
            for r in &p.results {
                let passed = r.blake3.as_deref() == Some(hash.as_str());
                checks.push(SpotCheckResult {
                    hotkey: r.hotkey.clone(),
                    kind: "merge".into(),
                    target: format!("{}/{}", p.stage, p.partition),
                    passed,
                    detail: serde_json::json!({"submitted": r.blake3, "recomputed": hash})
                        .to_string(),
                });
            }
        }
        // An object missing because the epoch was collected meanwhile is nobody's fault.
        if objects.missing {
            let current = o.client.status().await?.epoch;
            if objects_collected(epoch, current, o.run.retention_epochs) {
                return Err(gone(format!(
                    "its objects were collected while it was scored (the run is in epoch {current})"
                )));
            }
        }
        checks.append(&mut objects.checks);

        // CLASP over every finished sample of the epoch and of those before it in its window.
        let mut pooled = self.samples_before(epoch, self.cfg.clasp.window).await?;
        pooled.extend(samples);
        let fit = fit_epoch(epoch, o.run.stages, &pooled, &self.cfg.clasp);
        let rows: Vec<CheckRow> = checks.iter().map(CheckRow::from).collect();
        // Penalties come from the check rows as stored, the same derivation the audit redoes.
        let scores: Vec<EpochScore> = epoch_scores(
            &record,
            o.run.stages,
            fit.as_ref(),
            &failures(&rows),
            &self.cfg.score,
        );
        self.store
            .record_epoch(
                o.run_id,
                epoch,
                &seed_hex,
                seed_block,
                &rows,
                fit.as_ref().map(|f| (&f.fit, f.hotkeys.as_slice())),
                &scores,
                &self.scoring_params(),
            )
            .await?;
        // Published for everyone to check (the spot checks; the scores for `GET /v1/scores` and
        // the dashboard's panel). A failure loses nothing: a later pass sends them again from
        // the rows just stored (`publish_pending`).
        let report = SpotCheckReport {
            validator: String::new(),
            seed: seed_hex.clone(),
            seed_block,
            checks: checks.clone(),
        };
        let effects = fit
            .as_ref()
            .map(HotkeyEffects::by_hotkey)
            .unwrap_or_default();
        let submission = published::submission(&scores, &effects, self.scoring_params(), None);
        self.publish(o.run_id, epoch, &report, &submission).await?;
        Ok(EpochOutcome {
            epoch,
            seed: seed_hex,
            seed_block,
            checks,
            scores,
        })
    }

    /// One pass: reveals, disputes, every finished epoch not scored yet, then weights if the
    /// latest scored epoch's have not reached the chain ([`Validator::weights_owed`]). Returns
    /// the epochs scored. When the orchestrator cannot be reached, the pass copies the chain's
    /// consensus weights at the subnet's cadence instead ([`Validator::copy_consensus_weights`]).
    pub async fn step(&self) -> Result<Vec<u64>, ValidatorError> {
        if self.cfg.set_weights
            && let Err(e) = self.reveal().await
        {
            tracing::warn!(error = %e, "reveal");
        }
        let status = match self.online().await {
            Ok(o) => o.client.status().await.map_err(ValidatorError::from),
            Err(e) => Err(e),
        };
        let status = match status {
            Ok(s) => s,
            Err(e) if orchestrator_unreachable(&e) => {
                tracing::warn!(error = %e, "orchestrator unreachable");
                if self.cfg.set_weights {
                    match self.copy_consensus_weights().await {
                        Ok(_) => {}
                        Err(ValidatorError::Chain(e)) => {
                            tracing::warn!(error = %e, "consensus weights not set");
                        }
                        Err(e) => return Err(e),
                    }
                }
                return Ok(Vec::new());
            }
            Err(e) => return Err(e),
        };
        let o = self.online().await?;
        if let Err(e) = self.settle_disputes().await {
            tracing::warn!(error = %e, "disputes");
        }
        let mut scored = Vec::new();
        let from = self
            .store
            .latest_scored(o.run_id)
            .await?
            .map(|e| e + 1)
            .unwrap_or(0);
        for epoch in from..status.epoch {
            if self.store.is_scored(o.run_id, epoch).await?
                || self.store.skipped(o.run_id, epoch).await?.is_some()
            {
                continue;
            }
            // An epoch that can no longer be checked is passed over, not retried for ever: the
            // epochs after it are scored (and weights set) as usual. So is one whose scoring
            // fails on its own records, recorded with the reason so an operator sees it.
            match self.score_epoch(epoch).await {
                Ok(_) => scored.push(epoch),
                Err(e @ ValidatorError::EpochGone { .. }) => {
                    tracing::warn!(epoch, error = %e, "epoch skipped");
                }
                Err(e) if e.repeats_on_retry() => {
                    tracing::error!(epoch, error = %e, "epoch cannot be scored; skipped");
                    self.store
                        .skip_epoch(o.run_id, epoch, &e.to_string())
                        .await?;
                }
                Err(e) => return Err(e),
            }
        }
        match self.publish_pending().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(epochs = n, "earlier epochs' checks and scores published"),
            Err(e) => tracing::warn!(error = %e, "publishing earlier epochs"),
        }
        if self.cfg.set_weights {
            let sent = match self.weights_owed(o.run_id).await {
                Ok(Some((epoch, meta))) => match self.submit_weights(&meta).await {
                    Ok(outcome) => {
                        self.owed().settled(outcome.is_none().then_some(epoch));
                        Ok(())
                    }
                    Err(e) => {
                        self.owed().failed(meta.block);
                        Err(e)
                    }
                },
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            };
            match sent {
                Ok(()) => {}
                Err(ValidatorError::Chain(e)) => tracing::warn!(error = %e, "weights not set"),
                Err(e) => return Err(e),
            }
        }
        Ok(scored)
    }
}

/// Runs `validator` until `shutdown`: a failed step is logged and retried at the next poll.
/// Pending commits are also revealed at every poll beside the steps: a commit must be revealed
/// within one of the subnet's epochs, and a step that scores several epochs (a validator back
/// from a restart) can take longer than that.
pub async fn run(validator: Validator, shutdown: impl Future<Output = ()> + Send) {
    let steps = async {
        loop {
            match validator.step().await {
                Ok(scored) if !scored.is_empty() => tracing::info!(?scored, "epochs scored"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "validator step failed; retrying"),
            }
            tokio::time::sleep(validator.cfg.poll_interval).await;
        }
    };
    // Polled together with the steps (not run while they wait), so a reveal waiting for a lock
    // a step holds never stops that step.
    let reveals = async {
        if !validator.cfg.set_weights {
            return std::future::pending().await;
        }
        loop {
            tokio::time::sleep(validator.cfg.poll_interval).await;
            if let Err(e) = validator.reveal().await {
                tracing::warn!(error = %e, "reveal");
            }
        }
    };
    tokio::select! {
        _ = shutdown => {}
        _ = steps => {}
        _ = reveals => {}
    }
}

/// Scored epochs a pass publishes at most, the rest waiting for the next.
const PUBLISH_PER_PASS: u32 = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use iota_protocol::api::MergeResult;
    use iota_protocol::{ApiError, ClientError, ErrorCode};

    /// Hops the orchestrator lists but does not return are a finding against it, recorded as a
    /// failed check that no miner's score reads (the miner is not judged on a partial record).
    #[test]
    fn missing_hops_are_a_finding_against_the_orchestrator() {
        let finding = missing_hops_finding("5miner", &[7, 9]);
        assert!(!finding.passed);
        assert_eq!(finding.hotkey, ORCHESTRATOR_FINDING);
        let row = crate::score::CheckRow {
            hotkey: finding.hotkey.clone(),
            kind: finding.kind.clone(),
            target: finding.target.clone(),
            passed: finding.passed,
            detail: serde_json::from_str(&finding.detail).expect("json"),
        };
        assert_eq!(row.detail["task_ids"], serde_json::json!([7, 9]));
        let failed = crate::score::failures(&[row]);
        assert_eq!(failed.len(), 1);
        assert!(!failed.contains_key("5miner"), "{failed:?}");
        assert_eq!(failed[ORCHESTRATOR_FINDING], "missing_hops check failed");
    }

    /// Every partition whose owners disagreed is checked, however few others are drawn: a dispute
    /// lost is a merge check failed, as the README says.
    #[test]
    fn every_disputed_merge_is_checked_and_a_draw_of_the_others() {
        use rand::SeedableRng;
        let partition = |i: u32, hashes: &[&str]| PartitionStatus {
            epoch: 0,
            stage: i / 4,
            partition: i % 4,
            state: PartitionState::Accepted,
            owners: Vec::new(),
            results: hashes
                .iter()
                .enumerate()
                .map(|(k, h)| MergeResult {
                    hotkey: format!("owner-{i}-{k}"),
                    blake3: Some((*h).to_owned()),
                })
                .collect(),
            accepted: None,
            resolved_by: None,
        };
        let mut all: Vec<PartitionStatus> = (0..12).map(|i| partition(i, &["aa", "aa"])).collect();
        all[3] = partition(3, &["aa", "bb"]);
        all[9] = partition(9, &["aa", "bb", "aa"]);
        for seed in 0..20 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let checked = merges_to_check(&all, 1, &mut rng);
            let ids: Vec<u32> = checked.iter().map(|p| p.stage * 4 + p.partition).collect();
            assert_eq!(checked.len(), 3, "{ids:?}");
            assert!(ids.contains(&3) && ids.contains(&9), "{ids:?}");
        }
        // 0 draws every partition.
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        assert_eq!(merges_to_check(&all, 0, &mut rng).len(), 12);
    }

    #[test]
    fn only_a_silent_or_gatewayed_orchestrator_is_unreachable() {
        let api = |status| {
            ValidatorError::Api(ClientError::Api {
                status,
                error: ApiError::new(ErrorCode::BadRequest, "x"),
            })
        };
        assert!(orchestrator_unreachable(&ValidatorError::Api(
            ClientError::Network("refused".into())
        )));
        assert!(orchestrator_unreachable(&api(502)));
        assert!(orchestrator_unreachable(&api(504)));
        // An orchestrator that answers is reachable, even when it refuses.
        assert!(!orchestrator_unreachable(&api(500)));
        assert!(!orchestrator_unreachable(&api(403)));
        assert!(!orchestrator_unreachable(&ValidatorError::Api(
            ClientError::Decode("?".into())
        )));
        assert!(!orchestrator_unreachable(&ValidatorError::Config(
            "x".into()
        )));
    }

    /// Reads pages from `next(after)` (records, next cursor) with a bound of `max` records;
    /// returns what was kept and how many pages were asked for.
    async fn pages(
        max: usize,
        next: impl Fn(i64) -> (Vec<i64>, Option<i64>),
    ) -> (Result<(), ValidatorError>, Vec<i64>, usize) {
        let mut kept = Vec::new();
        let asked = std::cell::Cell::new(0usize);
        let r = read_pages(
            "test records",
            max,
            |after| {
                asked.set(asked.get() + 1);
                let page = next(after);
                async move { Ok(page) }
            },
            |x| kept.push(x),
        )
        .await;
        (r, kept, asked.get())
    }

    #[tokio::test]
    async fn paging_follows_only_advancing_cursors_and_stops_at_the_bound() {
        // Honest: pages of two until the end.
        let (r, kept, _) = pages(100, |after| {
            let recs: Vec<i64> = (after + 1..=(after + 2).min(7)).collect();
            let next = (after + 2 < 7).then(|| after + 2);
            (recs, next)
        })
        .await;
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(kept, (1..=7).collect::<Vec<_>>());
        // A cursor that stays or goes back, and a page without records that names a next one,
        // are refused at once instead of looping for ever.
        for (what, step) in [("same", 0), ("back", -1)] {
            let (r, _, asked) =
                pages(100, move |after| (vec![after + 1], Some(after + step))).await;
            assert!(
                matches!(r, Err(ValidatorError::BadAnswer(_))),
                "{what}: {r:?}"
            );
            assert!(asked <= 2, "{what}: {asked} pages");
        }
        let (r, _, asked) = pages(100, |after| (Vec::new(), Some(after + 1))).await;
        assert!(matches!(r, Err(ValidatorError::BadAnswer(_))), "{r:?}");
        assert_eq!(asked, 1);
        // An endless but advancing sequence stops at the record bound.
        let (r, kept, _) = pages(50, |after| (vec![after + 1; 10], Some(after + 10))).await;
        assert!(matches!(r, Err(ValidatorError::BadAnswer(m)) if m.contains("more than 50")));
        assert!(kept.len() <= 50);
    }

    #[test]
    fn collected_epochs_follow_the_retention() {
        // In epoch 6 with 3 kept, the orchestrator has deleted epochs 0 to 2: epoch 3 started
        // from weights merged in epoch 2, so 4 and 5 can be checked and 3 no longer.
        assert!(!objects_collected(5, 6, 3));
        assert!(!objects_collected(4, 6, 3));
        assert!(objects_collected(3, 6, 3));
        // With one epoch kept, an epoch's start weights go as soon as it ends.
        assert!(objects_collected(5, 6, 1));
        assert!(!objects_collected(5, 5, 1));
        // Epoch 0 starts from the seed: only its own objects count. A retention of 0 keeps
        // one epoch, as the orchestrator does.
        assert!(!objects_collected(0, 1, 1));
        assert!(objects_collected(0, 2, 1));
        assert!(objects_collected(0, 2, 0));
        assert!(!objects_collected(u64::MAX - 1, u64::MAX, u64::MAX));
    }

    #[test]
    fn draws_differ_by_secret_block_and_epoch() {
        let s = draw_seed(&[1; 32], b"block", 3);
        assert_eq!(s, draw_seed(&[1; 32], b"block", 3));
        assert_ne!(s, draw_seed(&[2; 32], b"block", 3));
        assert_ne!(s, draw_seed(&[1; 32], b"other", 3));
        assert_ne!(s, draw_seed(&[1; 32], b"block", 4));
    }
}
