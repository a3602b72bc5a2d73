//! The validator loop: for each finished epoch, draw what to check from a seed nobody knew while
//! the work was done, replay and re-derive it, fit CLASP on every sample, store the scores, then
//! set weights on chain from the database; settle the orchestrator's merge disputes as they come.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use iota_chain::set_weights::{WeightOptions, WeightsOutcome};
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

use crate::clasp::{ClaspConfig, fit_samples};
use crate::error::ValidatorError;
use crate::merges::recompute_merge;
use crate::replay::{RecordedHop, ReplayThresholds, replay_miner};
use crate::score::{EpochScore, ScoreConfig, decayed_totals, quality, weights};
use crate::store::{CheckRow, Store};

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

/// A validator with its clients and database.
pub struct Validator {
    cfg: ValidatorConfig,
    client: ApiClient,
    chain: Subtensor,
    hotkey: Keypair,
    store: Store,
    run_id: i64,
    run: RunConfig,
}

/// The seed of an epoch's draw: BLAKE3 keyed by the validator's secret over the hash of a block
/// produced after the epoch's uploads closed and the epoch number.
pub fn draw_seed(secret: &[u8; 32], block_hash: &[u8], epoch: u64) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(secret);
    h.update(block_hash);
    h.update(&epoch.to_le_bytes());
    *h.finalize().as_bytes()
}

fn pick<T: Clone>(items: &[T], n: usize, rng: &mut rand::rngs::StdRng) -> Vec<T> {
    if n == 0 || n >= items.len() {
        return items.to_vec();
    }
    items.choose_multiple(rng, n).cloned().collect()
}

impl Validator {
    /// Connects to the orchestrator, the chain and the database.
    pub async fn connect(
        cfg: ValidatorConfig,
        hotkey: Keypair,
        chain: Subtensor,
        store: Store,
    ) -> Result<Self, ValidatorError> {
        let signer: Arc<dyn RequestSigner> = Arc::new(HotkeySigner(hotkey.clone()));
        let client =
            ApiClient::connect(&cfg.orchestrator_url, signer, RetryPolicy::default()).await?;
        let info: iota_protocol::api::RunInfo = client.public_get("/v1/run").await?;
        // A previous run of this validator may have stopped in the middle of a submission.
        let settled = store.recover_interrupted().await?;
        if settled > 0 {
            tracing::warn!(
                settled,
                "weight submissions interrupted by a stop were settled"
            );
        }
        Ok(Self {
            cfg,
            client,
            chain,
            hotkey,
            store,
            run_id: info.id,
            run: info.config,
        })
    }

    /// The database.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The orchestrator client.
    pub fn client(&self) -> &ApiClient {
        &self.client
    }

    async fn download_all<T>(
        &self,
        blobs: impl IntoIterator<Item = (T, BlobDescriptor)>,
    ) -> Result<Vec<(T, Vec<u8>)>, ValidatorError> {
        let mut out = Vec::new();
        for (k, b) in blobs {
            out.push((k, self.client.download(&b).await?.to_vec()));
        }
        Ok(out)
    }

    async fn start_weights(
        &self,
        record: &EpochRecord,
        stage: u32,
    ) -> Result<Vec<Option<(Vec<f32>, Vec<f32>)>>, ValidatorError> {
        let mut out = vec![None; self.run.partitions as usize];
        let Some(sw) = record.start_weights.iter().find(|w| w.stage == stage) else {
            return Ok(out);
        };
        for (j, blob) in sw.partitions.iter().enumerate() {
            let (Some(blob), Some(slot)) = (blob, out.get_mut(j)) else {
                continue;
            };
            let len = self
                .run
                .partition_range(stage, j as u32)
                .map(|r| r.end - r.start)
                .unwrap_or(0);
            let bytes = self.client.download(blob).await?;
            *slot = Some(
                decode_merged(&bytes, len).map_err(|e| ValidatorError::BadObject(e.to_string()))?,
            );
        }
        Ok(out)
    }

    async fn all_hops(&self, epoch: u64) -> Result<HashMap<i64, HopRecord>, ValidatorError> {
        let mut out = HashMap::new();
        let mut after = 0;
        loop {
            let page = self.client.hops(epoch, after, 500).await?;
            for h in page.hops {
                out.insert(h.task_id, h);
            }
            match page.next_after {
                Some(a) => after = a,
                None => return Ok(out),
            }
        }
    }

    async fn all_samples(&self, epoch: u64) -> Result<Vec<SampleRecord>, ValidatorError> {
        let mut out = Vec::new();
        let mut after = 0;
        loop {
            let page = self.client.samples(epoch, after, 1000).await?;
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
        let record = self.client.epoch_record(epoch).await?;
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
        let mut checks = Vec::new();
        let mut failed: HashMap<String, String> = HashMap::new();

        // Replays.
        let tasks = self.client.spot_checks(epoch).await?;
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
        let last = self.run.stages - 1;
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
                    Some(b) => Some(self.client.download(b).await?.to_vec()),
                    None => None,
                };
                let output = match &h.output {
                    Some(b) => Some(self.client.download(b).await?.to_vec()),
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
                let len = self
                    .run
                    .partition_range(cand.stage, j)
                    .map(|r| r.end - r.start)
                    .unwrap_or(0);
                match decode_partition(&bytes, len) {
                    Ok(v) => claimed_pg.push((j, v)),
                    Err(e) => {
                        failed.insert(cand.hotkey.clone(), format!("bad pseudo-gradient: {e}"));
                    }
                }
            }
            let (run, stage, t) = (self.run.clone(), cand.stage, self.cfg.thresholds);
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
            if !report.passed {
                failed.entry(cand.hotkey.clone()).or_insert_with(|| {
                    format!("replay: {}", report.reason.clone().unwrap_or_default())
                });
            }
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
                if !passed {
                    failed.entry(r.hotkey.clone()).or_insert_with(|| {
                        format!("merge {}/{} is not the average", p.stage, p.partition)
                    });
                }
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
        let fit = match fit_samples(self.run.stages as usize, &samples, &self.cfg.clasp) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(epoch, error = %e, "no CLASP fit this epoch");
                None
            }
        };
        let effects: HashMap<&str, (f64, bool)> = fit
            .as_ref()
            .map(|f| {
                f.fit
                    .effects
                    .iter()
                    .filter_map(|e| {
                        f.hotkeys
                            .get(e.miner as usize)
                            .map(|h| (h.as_str(), (e.effect, e.flagged)))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let scores: Vec<EpochScore> = record
            .miners
            .iter()
            .map(|m| {
                let work = m.backward_done as f64
                    + if m.stage == last {
                        m.forward_done as f64
                    } else {
                        0.0
                    };
                let (effect, flagged) = effects
                    .get(m.hotkey.as_str())
                    .map(|(e, f)| (Some(*e), *f))
                    .unwrap_or((None, false));
                let (q, penalty) = quality(
                    effect,
                    flagged,
                    failed.get(&m.hotkey).map(String::as_str),
                    &self.cfg.score,
                );
                EpochScore {
                    hotkey: m.hotkey.clone(),
                    epoch,
                    work,
                    quality: q,
                    score: work * q,
                    penalty,
                }
            })
            .collect();
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
        self.store
            .record_epoch(
                self.run_id,
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
        if let Err(e) = self.client.report_spot_checks(epoch, &report).await {
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
        let len = self
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
            let bytes = self.client.download(&pg.blob).await?;
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
        let run = self.run.clone();
        let (_, hash) = tokio::task::spawn_blocking(move || {
            recompute_merge(&run, stage, partition, contributions, base)
        })
        .await
        .map_err(|e| ValidatorError::Config(format!("merge task: {e}")))??;
        Ok(hash)
    }

    /// Settles the orchestrator's open disputes with recomputed hashes.
    pub async fn settle_disputes(&self) -> Result<usize, ValidatorError> {
        let mut settled = 0;
        for d in self.client.disputes().await? {
            if d.state != "open" {
                continue;
            }
            let epoch = d.partition.epoch;
            let record = self.client.epoch_record(epoch).await?;
            let hash = self
                .recompute(&record, d.partition.stage, d.partition.partition)
                .await?;
            match self.client.settle(d.id, &hash).await {
                Ok(_) => {
                    settled += 1;
                    tracing::info!(dispute = d.id, epoch, blake3 = %hash, "dispute settled");
                }
                Err(e) => tracing::warn!(dispute = d.id, error = %e, "could not settle"),
            }
        }
        Ok(settled)
    }

    /// The weights the stored scores give, by uid (hotkeys not on the subnet are dropped).
    pub async fn weights_from_db(
        &self,
    ) -> Result<Option<(u64, Vec<u16>, Vec<f64>)>, ValidatorError> {
        let Some(latest) = self.store.latest_scored(self.run_id).await? else {
            return Ok(None);
        };
        let scores = self
            .store
            .recent_scores(self.run_id, self.cfg.score.window)
            .await?;
        let totals = decayed_totals(&scores, &self.cfg.score);
        let meta = self.chain.metagraph(self.cfg.netuid).await?;
        let uid_of: BTreeMap<String, u16> = meta
            .neurons
            .iter()
            .map(|n| (n.hotkey.ss58(), n.uid))
            .collect();
        let burn_key = self.cfg.burn.map(|(uid, _)| format!("uid:{uid}"));
        let w = weights(
            &totals,
            self.cfg
                .burn
                .as_ref()
                .zip(burn_key.as_deref())
                .map(|((_, b), k)| (k, *b)),
        );
        let mut by_uid: BTreeMap<u16, f64> = BTreeMap::new();
        for (k, v) in w {
            let uid = match k.strip_prefix("uid:") {
                Some(u) => u.parse().ok(),
                None => uid_of.get(&k).copied(),
            };
            if let Some(uid) = uid {
                *by_uid.entry(uid).or_insert(0.0) += v;
            }
        }
        if by_uid.is_empty() {
            return Ok(None);
        }
        let (uids, values): (Vec<u16>, Vec<f64>) = by_uid.into_iter().unzip();
        Ok(Some((latest, uids, values)))
    }

    /// Sets weights from the database: the submission is recorded before it is sent and its
    /// outcome after.
    pub async fn submit_weights(&self) -> Result<Option<WeightsOutcome>, ValidatorError> {
        let Some((epoch, uids, values)) = self.weights_from_db().await? else {
            return Ok(None);
        };
        let id = self
            .store
            .begin_submission(self.run_id, epoch, self.cfg.netuid, &uids, &values)
            .await?;
        let scores: Vec<f32> = values.iter().map(|v| *v as f32).collect();
        let opts = WeightOptions {
            tx: self.cfg.tx.clone(),
            wait_for_rate_limit: false,
            ..WeightOptions::default()
        };
        match self
            .chain
            .set_weights(
                &self.hotkey,
                self.cfg.netuid,
                &uids,
                &scores,
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
                tracing::info!(epoch, ?block, state, uids = ?uids, "weights submitted");
                Ok(Some(outcome))
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

    /// One pass: disputes, reveals, every finished epoch not scored yet, then weights if a new
    /// epoch was scored. Returns the epochs scored.
    pub async fn step(&self) -> Result<Vec<u64>, ValidatorError> {
        if let Err(e) = self.settle_disputes().await {
            tracing::warn!(error = %e, "disputes");
        }
        if self.cfg.set_weights
            && let Err(e) = self.reveal().await
        {
            tracing::warn!(error = %e, "reveal");
        }
        let status = self.client.status().await?;
        let mut scored = Vec::new();
        let from = self
            .store
            .latest_scored(self.run_id)
            .await?
            .map(|e| e + 1)
            .unwrap_or(0);
        for epoch in from..status.epoch {
            if self.store.is_scored(self.run_id, epoch).await? {
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
