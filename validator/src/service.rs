//! The validator loop: for each finished epoch, draw what to check from a seed nobody knew while
//! the work was done, replay and re-derive it, fit CLASP on every sample, store the scores, then
//! set weights on chain from the database; settle the orchestrator's merge disputes as they come.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use iota_chain::set_weights::{WeightOptions, WeightsOutcome, convert_as_given, weights_for_chain};
use iota_chain::wallet::Keypair;
use iota_chain::{Subtensor, TxOptions};
use iota_protocol::BlobDescriptor;
use iota_protocol::api::{
    Direction, EpochRecord, HopRecord, PartitionState, RunConfig, SampleRecord, SpotCheckReport,
    SpotCheckResult,
};
use iota_protocol::client::{ApiClient, RetryPolicy};
use iota_protocol::signing::RequestSigner;
use iota_protocol::tensor::{decode_merged, decode_partition};
use rand::SeedableRng;
use rand::seq::SliceRandom;

use iota_miner::startup::HotkeySigner;

use crate::clasp::{ClaspConfig, HotkeyEffects, fit_samples};
use crate::error::ValidatorError;
use crate::fallback::{consensus_weights, stake_weighted_mean};
use crate::merges::recompute_merge;
use crate::onchain::weight_rows;
use crate::replay::{RecordedHop, ReplayThresholds, replay_miner};
use crate::score::{EpochScore, ScoreConfig, chain_scores, epoch_scores, failures, weights_by_uid};
use crate::store::{CheckRow, Store, WeightSource};

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
            clasp: ClaspConfig::default(),
            score: ScoreConfig::default(),
            burn: None,
            set_weights: true,
            tx: TxOptions::default(),
            retry: RetryPolicy::default(),
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
}

/// A validator with its clients and database.
pub struct Validator {
    cfg: ValidatorConfig,
    chain: Subtensor,
    hotkey: Keypair,
    store: Store,
    online: tokio::sync::OnceCell<Online>,
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

/// CLASP over every finished sample of an epoch; `None` (logged) when nothing can be fitted. The
/// service and the audit both fit here.
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

fn pick<T: Clone>(items: &[T], n: usize, rng: &mut rand::rngs::StdRng) -> Vec<T> {
    if n == 0 || n >= items.len() {
        return items.to_vec();
    }
    items.choose_multiple(rng, n).cloned().collect()
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
                let signer: Arc<dyn RequestSigner> = Arc::new(HotkeySigner(self.hotkey.clone()));
                let client =
                    ApiClient::connect(&self.cfg.orchestrator_url, signer, self.cfg.retry).await?;
                let info: iota_protocol::api::RunInfo = client.public_get("/v1/run").await?;
                Ok(Online {
                    client,
                    run_id: info.id,
                    run: info.config,
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

    async fn download_all<T>(
        &self,
        blobs: impl IntoIterator<Item = (T, BlobDescriptor)>,
    ) -> Result<Vec<(T, Vec<u8>)>, ValidatorError> {
        let o = self.online().await?;
        let mut out = Vec::new();
        for (k, b) in blobs {
            out.push((k, o.client.download(&b).await?.to_vec()));
        }
        Ok(out)
    }

    async fn start_weights(
        &self,
        record: &EpochRecord,
        stage: u32,
    ) -> Result<Vec<Option<(Vec<f32>, Vec<f32>)>>, ValidatorError> {
        let o = self.online().await?;
        let mut out = vec![None; o.run.partitions as usize];
        let Some(sw) = record.start_weights.iter().find(|w| w.stage == stage) else {
            return Ok(out);
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
            let bytes = o.client.download(blob).await?;
            *slot = Some(
                decode_merged(&bytes, len).map_err(|e| ValidatorError::BadObject(e.to_string()))?,
            );
        }
        Ok(out)
    }

    async fn all_hops(&self, epoch: u64) -> Result<HashMap<i64, HopRecord>, ValidatorError> {
        let o = self.online().await?;
        let mut out = HashMap::new();
        let mut after = 0;
        loop {
            let page = o.client.hops(epoch, after, 500).await?;
            for h in page.hops {
                out.insert(h.task_id, h);
            }
            match page.next_after {
                Some(a) => after = a,
                None => return Ok(out),
            }
        }
    }

    pub(crate) async fn all_samples(
        &self,
        epoch: u64,
    ) -> Result<Vec<SampleRecord>, ValidatorError> {
        let o = self.online().await?;
        let mut out = Vec::new();
        let mut after = 0;
        loop {
            let page = o.client.samples(epoch, after, 1000).await?;
            out.extend(page.samples);
            match page.next_after {
                Some(a) => after = a,
                None => return Ok(out),
            }
        }
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
        let record = o.client.epoch_record(epoch).await?;
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

        // Replays.
        let tasks = o.client.spot_checks(epoch).await?;
        let chosen = pick(&tasks.miners, self.cfg.replays_per_epoch, &mut rng);
        let (hops, samples) = if chosen.is_empty() {
            (HashMap::new(), self.all_samples(epoch).await?)
        } else {
            (self.all_hops(epoch).await?, self.all_samples(epoch).await?)
        };
        let losses: HashMap<i64, Vec<f64>> = samples
            .iter()
            .filter_map(|s| s.sequence_losses.clone().map(|l| (s.sample_id, l)))
            .collect();
        let last = o.run.stages.saturating_sub(1);
        for cand in &chosen {
            let start: Vec<Option<Vec<f32>>> = self
                .start_weights(&record, cand.stage)
                .await?
                .into_iter()
                .map(|p| p.map(|(v, _)| v))
                .collect();
            let mut recorded = Vec::new();
            let mut miner_compute_ms = 0u64;
            for id in &cand.hop_task_ids {
                let Some(h) = hops.get(id) else { continue };
                miner_compute_ms += h.compute_ms.unwrap_or(0);
                let input = match &h.input {
                    Some(b) => Some(o.client.download(b).await?.to_vec()),
                    None => None,
                };
                let output = match &h.output {
                    Some(b) => Some(o.client.download(b).await?.to_vec()),
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
            let pg_blobs = record
                .pseudo_gradients
                .iter()
                .filter(|p| p.hotkey == cand.hotkey)
                .map(|p| (p.partition, p.blob.clone()));
            let mut claimed_pg = Vec::new();
            for (j, bytes) in self.download_all(pg_blobs).await? {
                let len = o
                    .run
                    .partition_range(cand.stage, j)
                    .map(|r| r.end - r.start)
                    .unwrap_or(0);
                match decode_partition(&bytes, len) {
                    Ok(v) => claimed_pg.push((j, v)),
                    // Recorded as a check of its own, so the penalty can be re-derived from the
                    // database (the audit does).
                    Err(e) => checks.push(SpotCheckResult {
                        hotkey: cand.hotkey.clone(),
                        kind: "pseudo_gradient".into(),
                        target: format!("{}/{j}", cand.stage),
                        passed: false,
                        detail: serde_json::json!({ "error": e.to_string() }).to_string(),
                    }),
                }
            }
            let (run, stage, t) = (o.run.clone(), cand.stage, self.cfg.thresholds);
            let report = tokio::task::spawn_blocking(move || {
                replay_miner(&run, stage, epoch, &start, &recorded, &claimed_pg, &t)
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

        // Merges: every owner's submitted hash against the recomputation.
        let accepted: Vec<_> = record
            .partitions
            .iter()
            .filter(|p| p.state == PartitionState::Accepted || !p.results.is_empty())
            .cloned()
            .collect();
        for p in pick(&accepted, self.cfg.merges_per_epoch, &mut rng) {
            let hash = self.recompute(&record, p.stage, p.partition).await?;
            for r in &p.results {
                let passed = r.blake3 == hash;
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

        // CLASP over every finished sample.
        let fit = fit_epoch(epoch, o.run.stages, &samples, &self.cfg.clasp);
        let rows: Vec<CheckRow> = checks
            .iter()
            .map(|c| CheckRow {
                hotkey: c.hotkey.clone(),
                kind: c.kind.clone(),
                target: c.target.clone(),
                passed: c.passed,
                detail: serde_json::from_str(&c.detail).unwrap_or(serde_json::Value::Null),
            })
            .collect();
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
            )
            .await?;
        // Published for everyone to check; a failure to publish loses nothing here.
        let report = SpotCheckReport {
            validator: String::new(),
            seed: seed_hex.clone(),
            seed_block,
            checks: checks.clone(),
        };
        if let Err(e) = o.client.report_spot_checks(epoch, &report).await {
            tracing::warn!(epoch, error = %e, "could not publish the spot checks");
        }
        Ok(EpochOutcome {
            epoch,
            seed: seed_hex,
            seed_block,
            checks,
            scores,
        })
    }

    /// The honest merge hash of a partition of a finished or merging epoch.
    async fn recompute(
        &self,
        record: &EpochRecord,
        stage: u32,
        partition: u32,
    ) -> Result<String, ValidatorError> {
        let o = self.online().await?;
        let len = o
            .run
            .partition_range(stage, partition)
            .map(|r| r.end - r.start)
            .unwrap_or(0);
        let mut contributions = Vec::new();
        for pg in record
            .pseudo_gradients
            .iter()
            .filter(|p| p.stage == stage && p.partition == partition)
        {
            let bytes = o.client.download(&pg.blob).await?;
            let values = decode_partition(&bytes, len)
                .map_err(|e| ValidatorError::BadObject(e.to_string()))?;
            contributions.push((pg.hotkey.clone(), pg.weight, values));
        }
        let base = self
            .start_weights(record, stage)
            .await?
            .into_iter()
            .nth(partition as usize)
            .flatten();
        let run = o.run.clone();
        let (_, hash) = tokio::task::spawn_blocking(move || {
            recompute_merge(&run, stage, partition, contributions, base)
        })
        .await
        .map_err(|e| ValidatorError::Config(format!("merge task: {e}")))??;
        Ok(hash)
    }

    /// Settles the orchestrator's open disputes with recomputed hashes.
    pub async fn settle_disputes(&self) -> Result<usize, ValidatorError> {
        let o = self.online().await?;
        let mut settled = 0;
        for d in o.client.disputes().await? {
            if d.state != "open" {
                continue;
            }
            let epoch = d.partition.epoch;
            let record = o.client.epoch_record(epoch).await?;
            let hash = self
                .recompute(&record, d.partition.stage, d.partition.partition)
                .await?;
            match o.client.settle(d.id, &hash).await {
                Ok(_) => {
                    settled += 1;
                    tracing::info!(dispute = d.id, epoch, blake3 = %hash, "dispute settled");
                }
                Err(e) => tracing::warn!(dispute = d.id, error = %e, "could not settle"),
            }
        }
        Ok(settled)
    }

    /// The weights the stored scores give, by uid (hotkeys not on the subnet are dropped), with
    /// the latest scored epoch they come from.
    pub async fn weights_from_db(
        &self,
    ) -> Result<Option<(u64, Vec<u16>, Vec<f64>)>, ValidatorError> {
        let o = self.online().await?;
        let Some(latest) = self.store.latest_scored(o.run_id).await? else {
            return Ok(None);
        };
        let scores = self
            .store
            .recent_scores(o.run_id, self.cfg.score.window)
            .await?;
        let meta = self.chain.metagraph(self.cfg.netuid).await?;
        let uid_of: BTreeMap<String, u16> = meta
            .neurons
            .iter()
            .map(|n| (n.hotkey.ss58(), n.uid))
            .collect();
        Ok(
            weights_by_uid(&scores, &self.cfg.score, self.cfg.burn, &uid_of)
                .map(|(uids, values)| (latest, uids, values)),
        )
    }

    /// Sets weights from the database: the submission is recorded before it is sent and its
    /// outcome after.
    pub async fn submit_weights(&self) -> Result<Option<WeightsOutcome>, ValidatorError> {
        let o = self.online().await?;
        let Some((epoch, uids, values)) = self.weights_from_db().await? else {
            return Ok(None);
        };
        self.send_weights(
            WeightSource::Scores,
            Some(o.run_id),
            Some(epoch),
            &uids,
            &values,
        )
        .await
        .map(Some)
    }

    /// How weights are sent.
    fn weight_options(&self) -> WeightOptions {
        WeightOptions {
            tx: self.cfg.tx.clone(),
            wait_for_rate_limit: false,
            ..WeightOptions::default()
        }
    }

    /// The `(uids, values)` the chain client turns `weights` into when this validator sends
    /// them: its own conversion, chosen as `set_weights` chooses it (the audit compares the
    /// chain with this).
    pub(crate) fn chain_values(
        &self,
        hyperparams: &iota_chain::Hyperparams,
        uids: &[u16],
        weights: &[f64],
    ) -> Result<(Vec<u16>, Vec<u16>), iota_chain::ChainError> {
        let scores = chain_scores(weights);
        if self.weight_options().process_weights {
            weights_for_chain(hyperparams, uids, &scores)
        } else {
            convert_as_given(hyperparams, uids, &scores)
        }
    }

    /// Records, sends and records the outcome of one weight submission.
    async fn send_weights(
        &self,
        source: WeightSource,
        run_id: Option<i64>,
        epoch: Option<u64>,
        uids: &[u16],
        values: &[f64],
    ) -> Result<WeightsOutcome, ValidatorError> {
        let id = self
            .store
            .begin_submission(run_id, epoch, self.cfg.netuid, uids, values, source)
            .await?;
        let opts = self.weight_options();
        match self
            .chain
            .set_weights(
                &self.hotkey,
                self.cfg.netuid,
                uids,
                &chain_scores(values),
                &self.store,
                &opts,
            )
            .await
        {
            Ok(outcome) => {
                let json = serde_json::to_value(&outcome).unwrap_or(serde_json::Value::Null);
                let (state, block, version, hash) = match &outcome {
                    WeightsOutcome::Set {
                        block, version_key, ..
                    } => ("set", Some(*block), Some(*version_key), None),
                    WeightsOutcome::Committed {
                        block,
                        version_key,
                        hash,
                        ..
                    } => (
                        "committed",
                        Some(*block),
                        Some(*version_key),
                        Some(hash.as_str()),
                    ),
                    WeightsOutcome::DryRun { version_key, .. } => {
                        ("dry_run", None, Some(*version_key), None)
                    }
                };
                self.store
                    .finish_submission(id, state, block, version, hash, &json)
                    .await?;
                tracing::info!(?epoch, ?block, state, source = source.as_str(), uids = ?uids,
                    "weights submitted");
                Ok(outcome)
            }
            Err(e) => {
                self.store
                    .finish_submission(
                        id,
                        "failed",
                        None,
                        None,
                        None,
                        &serde_json::json!({"error": e.to_string()}),
                    )
                    .await?;
                Err(e.into())
            }
        }
    }

    /// The fallback while the orchestrator cannot be reached: once per cadence (the subnet's
    /// tempo, or its weights rate limit if longer) since this validator last set weights, set
    /// the chain's stake-weighted consensus weights ([`crate::fallback`]). Returns `None` when
    /// it is not time yet or there is nothing to copy.
    pub async fn copy_consensus_weights(&self) -> Result<Option<WeightsOutcome>, ValidatorError> {
        let meta = self.chain.metagraph(self.cfg.netuid).await?;
        let public = self.hotkey.public();
        let me = meta.neuron_by_hotkey(&public).ok_or_else(|| {
            iota_chain::ChainError::NotRegistered {
                hotkey: public.ss58(),
                netuid: self.cfg.netuid,
            }
        })?;
        let hp = &meta.hyperparams;
        let cadence = (u64::from(hp.tempo) + 1).max(hp.weights_rate_limit);
        // A commit only moves LastUpdate when revealed: count our own recorded sends too.
        let last = me
            .last_update
            .max(self.store.last_submission_block().await?.unwrap_or(0));
        if last > 0 && meta.block < last + cadence {
            tracing::debug!(
                block = meta.block,
                last,
                cadence,
                "consensus weights: not due yet"
            );
            return Ok(None);
        }
        let copied = match consensus_weights(&meta, me.uid) {
            Some(w) => Some((w, "consensus")),
            None => {
                let rows = weight_rows(&self.chain, &meta).await?;
                stake_weighted_mean(&meta, &rows, me.uid).map(|w| (w, "stake-weighted mean"))
            }
        };
        let Some(((uids, values), how)) = copied else {
            tracing::warn!(block = meta.block, "no consensus weights on chain to copy");
            return Ok(None);
        };
        let run_id = self.online.get().map(|o| o.run_id);
        tracing::warn!(block = meta.block, how, uids = ?uids,
            "orchestrator unreachable: copying the chain's consensus weights");
        self.send_weights(WeightSource::Consensus, run_id, None, &uids, &values)
            .await
            .map(Some)
    }

    /// Reveals pending commits whose window opened (also those made before a restart).
    pub async fn reveal(&self) -> Result<usize, ValidatorError> {
        let report = self
            .chain
            .reveal_pending(&self.hotkey, &self.store, &self.cfg.tx)
            .await?;
        for (hash, block) in &report.revealed {
            self.store.mark_revealed(hash, *block).await?;
        }
        for (hash, why) in &report.dropped {
            self.store.mark_dropped(hash, why).await?;
        }
        Ok(report.revealed.len())
    }

    /// One pass: reveals, disputes, every finished epoch not scored yet, then weights if a new
    /// epoch was scored. Returns the epochs scored. When the orchestrator cannot be reached,
    /// the pass copies the chain's consensus weights at the subnet's cadence instead
    /// ([`Validator::copy_consensus_weights`]).
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
            if self.store.is_scored(o.run_id, epoch).await? {
                continue;
            }
            self.score_epoch(epoch).await?;
            scored.push(epoch);
        }
        if self.cfg.set_weights && !scored.is_empty() {
            match self.submit_weights().await {
                Ok(_) => {}
                Err(ValidatorError::Chain(e)) => tracing::warn!(error = %e, "weights not set"),
                Err(e) => return Err(e),
            }
        }
        Ok(scored)
    }
}

/// Runs `validator` until `shutdown`: a failed step is logged and retried at the next poll.
pub async fn run(validator: Validator, shutdown: impl Future<Output = ()> + Send) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            r = validator.step() => match r {
                Ok(scored) if !scored.is_empty() => tracing::info!(?scored, "epochs scored"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "validator step failed; retrying"),
            }
        }
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(validator.cfg.poll_interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iota_protocol::{ApiError, ClientError, ErrorCode};

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

    #[test]
    fn draws_differ_by_secret_block_and_epoch() {
        let s = draw_seed(&[1; 32], b"block", 3);
        assert_eq!(s, draw_seed(&[1; 32], b"block", 3));
        assert_ne!(s, draw_seed(&[2; 32], b"block", 3));
        assert_ne!(s, draw_seed(&[1; 32], b"other", 3));
        assert_ne!(s, draw_seed(&[1; 32], b"block", 4));
    }
}
