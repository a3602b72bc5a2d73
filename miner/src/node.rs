//! The miner loop: join the run, then poll for work and do what the epoch's phase asks for.
//!
//! Network failures never end the loop: the client retries with backoff and jitter, and what a
//! failed round computed stays in `pending` to be re-sent at the start of the next round (the
//! orchestrator's handlers are idempotent). A hop is only dropped when the orchestrator says its
//! lease lapsed.
//!
//! The trainer takes in a hop's gradients only once the orchestrator has recorded the hop, and
//! pending hops are settled before anything new is computed, in the order they were computed: so
//! the trainer's state always follows the hops a validator will replay, in the order it replays
//! them (the order the orchestrator recorded their completions).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use iota_protocol::BlobDescriptor;
use iota_protocol::ErrorCode;
use iota_protocol::api::{
    Capacity, CompleteRequest, Direction, EpochStatus, Phase, RunConfig, WorkItem,
};
use iota_protocol::client::{ApiClient, ClientError};
use iota_protocol::signing::RequestSigner;
use tokio::sync::{oneshot, watch};

use crate::adversary::Adversary;
use crate::blobs::MergedBlobs;
use crate::capacity;
use crate::config::MinerConfig;
use crate::error::MinerError;
use crate::pulse::{LastContact, Pulse};
use crate::status::MinerStatus;
use crate::trainer::MinerTrainer;
use iota_trainer::{HopOutput, StageTrainer, run_model};

mod all_reduce;

/// A miner running on the tokio runtime (see [`spawn`]).
pub struct MinerHandle {
    status: watch::Receiver<MinerStatus>,
    stop: Option<oneshot::Sender<()>>,
    join: tokio::task::JoinHandle<Result<MinerStatus, MinerError>>,
}

impl MinerHandle {
    /// The latest status.
    pub fn status(&self) -> MinerStatus {
        self.status.borrow().clone()
    }
    /// A receiver of status updates.
    pub fn subscribe(&self) -> watch::Receiver<MinerStatus> {
        self.status.clone()
    }
    /// Whether the loop has ended.
    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }
    /// Asks the miner to finish its current hop and exit; waits for it.
    pub async fn stop(mut self) -> Result<MinerStatus, MinerError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.join
            .await
            .map_err(|e| MinerError::Internal(format!("miner task: {e}")))?
    }
    /// Ends the miner at once, as a crash would (its leases lapse).
    pub fn abort(&self) {
        self.join.abort();
    }
}

/// Starts a miner signing as `signer`; several can run in one process.
pub fn spawn(config: MinerConfig, signer: Arc<dyn RequestSigner>) -> MinerHandle {
    let (status_tx, status_rx) = watch::channel(MinerStatus::new(signer.ss58()));
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let join = tokio::spawn(run(
        config,
        signer,
        async {
            let _ = stop_rx.await;
        },
        status_tx,
    ));
    MinerHandle {
        status: status_rx,
        stop: Some(stop_tx),
        join,
    }
}

/// Runs a miner until `shutdown` resolves (then it finishes the hop in hand and returns) or a
/// fatal error (a run this miner cannot train). Progress goes to `status`.
pub async fn run(
    config: MinerConfig,
    signer: Arc<dyn RequestSigner>,
    shutdown: impl Future<Output = ()> + Send,
    status: watch::Sender<MinerStatus>,
) -> Result<MinerStatus, MinerError> {
    tokio::pin!(shutdown);
    let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stopping.clone();
    let body = async move {
        // An orchestrator that goes away while this miner joins (a restart) is waited for, as
        // in the loop: only an answer that the run cannot be trained here ends the miner.
        let mut attempt = 0u32;
        let mut node = loop {
            match Node::join(config.clone(), signer.clone(), status.clone(), &flag).await {
                Ok(Some(n)) => break n,
                Ok(None) => return Ok(MinerStatus::default()),
                Err(e) if e.is_transient() => {
                    attempt += 1;
                    tracing::warn!(error = %e, attempt, "joining failed; retrying");
                    let wait = config
                        .retry
                        .backoff(attempt.min(6), &mut rand::thread_rng());
                    pause(wait, &flag).await;
                    if flag.load(std::sync::atomic::Ordering::SeqCst) {
                        return Ok(MinerStatus::default());
                    }
                }
                Err(e) => return Err(e),
            }
        };
        node.run(&flag).await?;
        Ok(node.status.borrow().clone())
    };
    tokio::pin!(body);
    tokio::select! {
        r = &mut body => r,
        _ = &mut shutdown => {
            stopping.store(true, std::sync::atomic::Ordering::SeqCst);
            tracing::info!("stopping: finishing the hop in hand");
            body.await
        }
    }
}

/// A computed hop not yet accepted by the orchestrator.
struct Pending {
    /// Order of computation.
    seq: u64,
    item: WorkItem,
    out: HopOutput,
    compute_ms: u64,
    output: Option<BlobDescriptor>,
}

struct Node {
    cfg: MinerConfig,
    client: ApiClient,
    run: RunConfig,
    stage: u32,
    trainer: Arc<Mutex<MinerTrainer>>,
    /// Epoch whose start weights are loaded.
    epoch: u64,
    /// The trainer is new (a move to another stage) and its weights did not load yet.
    weights_stale: bool,
    /// The epoch whose work this miner ended (its pseudo-gradient uploaded, or a restart after
    /// completing hops of it): it takes no more of that epoch's hops.
    ended: Option<u64>,
    merged: HashSet<(u64, u32, u32)>,
    /// The stage's latest merged partitions and this miner's own merge results.
    merged_blobs: MergedBlobs,
    pending: HashMap<i64, Pending>,
    /// Hops computed so far (orders `pending`).
    computed: u64,
    status: watch::Sender<MinerStatus>,
    last_contact: LastContact,
    /// Heartbeats while the loop is busy; stops when the node is dropped.
    _pulse: Pulse,
    tokens_per_s: f64,
    /// The memory this miner registered with.
    memory_bytes: u64,
}

fn stopping(flag: &std::sync::atomic::AtomicBool) -> bool {
    flag.load(std::sync::atomic::Ordering::SeqCst)
}

/// Sleeps `d`, returning early when the miner is stopping.
async fn pause(d: Duration, flag: &std::sync::atomic::AtomicBool) {
    let end = Instant::now() + d;
    while Instant::now() < end && !stopping(flag) {
        tokio::time::sleep((end - Instant::now()).min(Duration::from_millis(50))).await;
    }
}

async fn blocking<T, F>(trainer: &Arc<Mutex<MinerTrainer>>, f: F) -> Result<T, MinerError>
where
    T: Send + 'static,
    F: FnOnce(&mut MinerTrainer) -> Result<T, MinerError> + Send + 'static,
{
    let t = trainer.clone();
    tokio::task::spawn_blocking(move || {
        let mut guard = t
            .lock()
            .map_err(|_| MinerError::Internal("trainer lock poisoned".into()))?;
        f(&mut guard)
    })
    .await
    .map_err(|e| MinerError::Internal(format!("compute task: {e}")))?
}

/// Whether to upload the pseudo-gradient now, in the uploading phase `st` describes. The upload
/// ends this miner's work in the epoch, and a sample whose next hop finds only such miners on its
/// stage is abandoned: so first the samples still travelling finish (their hops add to the
/// contributions), until half the phase is gone.
fn upload_now(st: &EpochStatus, uploading_s: u64) -> bool {
    let travelling = st
        .samples_started
        .saturating_sub(st.samples_completed)
        .saturating_sub(st.samples_abandoned);
    let left_ms = st.phase_deadline_ms.saturating_sub(st.server_time_ms);
    let half_ms = i64::try_from(uploading_s.saturating_mul(500)).unwrap_or(i64::MAX);
    travelling == 0 || left_ms < half_ms
}

/// Counts time spent in one step of the weight all-reduce (`load`: the epoch-start weights,
/// `upload`: the pseudo-gradient, `merge`: the partitions this miner owns), so that a slow link's
/// cost can be told from compute (`iota_miner_all_reduce_ms_total{step}`).
fn all_reduce_time(step: &'static str, started: Instant) {
    let ms = started.elapsed().as_millis() as u64;
    metrics::counter!("iota_miner_all_reduce_ms_total", "step" => step).increment(ms);
}

/// Task ids of computed hops, `(task id, order of computation)`, in the order they were computed:
/// validators replay a miner's hops in the order the orchestrator recorded them, and each hop's
/// gradients and inner steps build on the ones computed before it.
fn in_computed_order(pending: impl Iterator<Item = (i64, u64)>) -> Vec<i64> {
    let mut waiting: Vec<(u64, i64)> = pending.map(|(id, seq)| (seq, id)).collect();
    waiting.sort_unstable();
    waiting.into_iter().map(|(_, id)| id).collect()
}

/// A trainer of `stage`, built off the async threads, and the throughput to report for it: the
/// configured figure, or the start-up test's on this very stage, one sequence at a time. Unless
/// one is configured, its cache budget follows from `memory_bytes` and what the test measured a
/// forward to hold.
async fn build_trainer(
    cfg: &MinerConfig,
    run: &RunConfig,
    stage: u32,
    memory_bytes: u64,
) -> Result<(MinerTrainer, f64), MinerError> {
    let (run, opts, adv, seed, data, device) = (
        run.clone(),
        cfg.stage_options()?,
        cfg.adversary,
        cfg.seed,
        cfg.data_dir.clone(),
        cfg.device.clone(),
    );
    let (fixed_rate, fixed_budget) = (cfg.tokens_per_s, cfg.cache_budget);
    tokio::task::spawn_blocking(move || {
        let most = 2 * run.max_in_flight as usize;
        let budget = fixed_budget.unwrap_or(most);
        let honest = StageTrainer::new(run.clone(), stage, opts, budget, data.as_deref())?;
        let mut t = MinerTrainer::new(honest, adv, seed);
        if let (Some(rate), Some(_)) = (fixed_rate, fixed_budget) {
            return Ok((t, rate));
        }
        let speed = t.measure_speed(&device)?;
        tracing::info!(
            stage,
            tokens_per_s = speed.tokens_per_s,
            bytes_per_sequence = speed.bytes_per_sequence,
            "start-up test of this stage"
        );
        if fixed_budget.is_none() {
            let memory = t.memory()?;
            let budget = capacity::cache_budget(
                &memory,
                u64::from(run.micro_batch),
                speed.bytes_per_sequence,
                memory_bytes,
                most,
            );
            tracing::info!(
                stage,
                budget,
                memory_gb = memory_bytes as f64 / 1e9,
                "forward caches kept for pending backwards"
            );
            t.set_cache_budget(budget);
        }
        Ok((t, fixed_rate.unwrap_or(speed.tokens_per_s)))
    })
    .await
    .map_err(|e| MinerError::Internal(e.to_string()))?
}

/// How often to say the miner is alive: three times per timeout, at most five times a second.
/// Saturating: the timeout comes from the orchestrator.
fn heartbeat_interval(timeout_s: u64) -> Duration {
    (Duration::from_secs(timeout_s) / 3).max(Duration::from_millis(200))
}

fn is(e: &MinerError, code: ErrorCode) -> bool {
    matches!(e, MinerError::Api(c) if c.code() == Some(code))
}

/// Whether sending the same request again cannot succeed: a 4xx answer other than 408 (the
/// body was slow) and 429 (rate limited), or a hop this miner cannot submit at all.
fn refused(e: &MinerError) -> bool {
    match e {
        MinerError::Api(ClientError::Api { status, .. }) => {
            (400..500).contains(status) && *status != 408 && *status != 429
        }
        MinerError::Internal(_) => true,
        _ => false,
    }
}

impl Node {
    /// Connects, measures, registers and loads the stage's current weights. `None` when asked
    /// to stop before joining.
    async fn join(
        mut cfg: MinerConfig,
        signer: Arc<dyn RequestSigner>,
        status: watch::Sender<MinerStatus>,
        flag: &std::sync::atomic::AtomicBool,
    ) -> Result<Option<Self>, MinerError> {
        let mut attempt = 0u32;
        let client = loop {
            match ApiClient::connect(&cfg.orchestrator_url, signer.clone(), cfg.retry).await {
                Ok(c) => {
                    let direct = c.direct_uploads() && cfg.direct_uploads;
                    break c.with_direct_uploads(direct);
                }
                // Asking again gets the same run: not something to wait out.
                Err(e @ ClientError::InvalidRun(_)) => return Err(e.into()),
                Err(e) => {
                    attempt += 1;
                    tracing::warn!(url = %cfg.orchestrator_url, error = %e, attempt, "orchestrator unreachable; retrying");
                    let wait = cfg.retry.backoff(attempt.min(6), &mut rand::thread_rng());
                    pause(wait, flag).await;
                    if stopping(flag) {
                        return Ok(None);
                    }
                }
            }
        };
        // Checked against the protocol's bounds: the run sizes what this miner allocates.
        let run = client.run_info().await?.config;
        let model = run_model(&run)?;
        // Before registering: the orchestrator expects work from a miner once it has joined.
        if let (Some(hash), None) = (&run.dataset, &cfg.data_dir) {
            let dir = iota_protocol::dataset_cache::cache_dir(&cfg.data_cache, hash);
            let fetched = iota_protocol::dataset_cache::fetch_dataset(&client, hash, &dir).await?;
            tracing::info!(dataset = %hash, dir = %dir.display(), downloaded = fetched.downloaded.len(),
                kept = fetched.kept.len(), "the run's dataset is in the cache");
            cfg.data_dir = Some(dir);
        }
        let memory_bytes = cfg
            .memory_bytes
            .unwrap_or_else(|| capacity::available_memory(&cfg.device));
        // The stage is not known before registering: a one-block estimate places this miner,
        // and its own stage's figure follows in the heartbeats.
        let claimed = |t: f64| match cfg.adversary {
            Some(Adversary::ClaimSpeed) => t * crate::adversary::CLAIMED_SPEED_FACTOR,
            _ => t,
        };
        let estimate = if let Some(t) = cfg.tokens_per_s {
            t
        } else {
            let (run, device) = (run.clone(), cfg.device.clone());
            tokio::task::spawn_blocking(move || {
                capacity::estimate_tokens_per_s(&run, &model, &device)
            })
            .await
            .map_err(|e| MinerError::Internal(e.to_string()))??
        };
        let estimate = claimed(estimate);
        let capacity = Capacity {
            device: cfg.device.name(),
            memory_bytes,
            tokens_per_s: estimate,
        };
        tracing::info!(device = %capacity.device, memory_gb = capacity.memory_bytes as f64 / 1e9, tokens_per_s = estimate, "capacity");
        if cfg.device.compute_dtype() == iota_model::DType::BF16 {
            tracing::warn!(
                device = %capacity.device,
                "bf16 compute: a validator that replays this stage in f32 (on a CPU) will find \
                 its work outside the default spot-check thresholds; use cuda:N for f32"
            );
        }
        let joined = client.register(capacity).await?;
        let stage = joined.stage;
        // From here on the orchestrator expects heartbeats, also while the trainer is built and
        // the weights load.
        let heartbeat_every = heartbeat_interval(run.heartbeat_timeout_s);
        let last_contact = LastContact::now();
        let pulse = Pulse::spawn(
            client.clone(),
            status.subscribe(),
            heartbeat_every,
            last_contact.clone(),
        );
        tracing::info!(
            stage,
            uid = joined.uid,
            epoch = joined.status.epoch,
            work_ended = ?joined.work_ended,
            "joined the run"
        );
        let (trainer, measured) = build_trainer(&cfg, &run, stage, memory_bytes).await?;
        status.send_modify(|s| {
            s.stage = Some(stage);
            s.uid = Some(joined.uid);
            s.adversary = cfg.adversary;
            s.tokens_per_s = claimed(measured);
        });
        let mut node = Self {
            cfg,
            client,
            run,
            stage,
            trainer: Arc::new(Mutex::new(trainer)),
            epoch: joined.status.epoch,
            weights_stale: false,
            ended: joined.work_ended,
            merged: HashSet::new(),
            merged_blobs: MergedBlobs::default(),
            pending: HashMap::new(),
            computed: 0,
            status,
            last_contact,
            _pulse: pulse,
            tokens_per_s: measured,
            memory_bytes,
        };
        node.load_weights(joined.status.epoch).await?;
        node.observe(&joined.status);
        Ok(Some(node))
    }

    /// Bookkeeping once epoch `epoch`'s start weights are loaded.
    async fn started(&mut self, epoch: u64) -> Result<(), MinerError> {
        let digest = blocking(&self.trainer, |t| t.weights_digest()).await?;
        self.epoch = epoch;
        self.weights_stale = false;
        self.pending.clear();
        tracing::info!(epoch, stage = self.stage, weights = %digest, merged_bytes_held = self.merged_blobs.bytes(), "epoch-start weights loaded");
        self.status.send_modify(|s| {
            s.weights_epoch = Some(epoch);
            s.weights_digest = Some(digest.clone());
            s.weights_history.push((epoch, digest));
            if s.weights_history.len() > MinerStatus::HISTORY {
                s.weights_history.remove(0);
            }
            s.epoch_hops = 0;
        });
        Ok(())
    }

    /// Takes up `stage`, given to this miner when it joined again (the orchestrator moves a
    /// miner to a stage left with none, so that samples can pass it): a trainer of that stage,
    /// started from its current weights at the next round. The hops of the old stage computed
    /// this epoch are dropped with its trainer: their samples were re-routed at the release.
    async fn move_to(&mut self, stage: u32) -> Result<(), MinerError> {
        tracing::warn!(
            from = self.stage,
            to = stage,
            "the orchestrator moved this miner to another stage; taking it up"
        );
        let (trainer, measured) =
            build_trainer(&self.cfg, &self.run, stage, self.memory_bytes).await?;
        self.trainer = Arc::new(Mutex::new(trainer));
        self.tokens_per_s = measured;
        self.stage = stage;
        self.weights_stale = true;
        self.pending.clear();
        self.merged_blobs = MergedBlobs::default();
        self.status.send_modify(|s| {
            s.stage = Some(stage);
            s.tokens_per_s = measured;
        });
        Ok(())
    }

    fn observe(&self, st: &EpochStatus) {
        self.status.send_modify(|s| {
            s.epoch = st.epoch;
            s.phase = Some(st.phase);
            s.phase_deadline_ms = st.phase_deadline_ms;
            s.server_time_ms = st.server_time_ms;
        });
        metrics::gauge!("iota_miner_epoch").set(st.epoch as f64);
    }

    async fn run(&mut self, flag: &std::sync::atomic::AtomicBool) -> Result<(), MinerError> {
        let mut failures = 0u32;
        while !stopping(flag) {
            match self.round(flag).await {
                Ok(busy) => {
                    failures = 0;
                    if !busy {
                        pause(self.cfg.poll_interval, flag).await;
                    }
                }
                Err(e @ (MinerError::RunMismatch(_) | MinerError::Config(_))) => return Err(e),
                Err(e) if is(&e, ErrorCode::NotAMiner) => {
                    tracing::warn!("released by the orchestrator; joining again");
                    // This process still holds its work of the epoch.
                    let joined =
                        self.client
                            .rejoin(Capacity {
                                device: self.cfg.device.name(),
                                memory_bytes: self.cfg.memory_bytes.unwrap_or_else(|| {
                                    capacity::available_memory(&self.cfg.device)
                                }),
                                tokens_per_s: self.tokens_per_s,
                            })
                            .await;
                    // Not joined again (the orchestrator is away): the next round asks again.
                    if let Ok(j) = joined {
                        self.ended = self.ended.max(j.work_ended);
                        if j.stage != self.stage {
                            self.move_to(j.stage).await?;
                        }
                    }
                }
                Err(e) => {
                    failures += 1;
                    self.status.send_modify(|s| s.errors += 1);
                    tracing::warn!(error = %e, failures, "round failed; retrying");
                    let wait = self
                        .cfg
                        .retry
                        .backoff(failures.min(6), &mut rand::thread_rng());
                    pause(wait, flag).await;
                }
            }
        }
        Ok(())
    }

    /// One poll and what follows from it; whether anything was done.
    async fn round(&mut self, flag: &std::sync::atomic::AtomicBool) -> Result<bool, MinerError> {
        self.settle_pending().await?;
        let work = self.client.work(self.cfg.max_items).await?;
        self.last_contact.touch();
        let st = work.status.clone();
        self.observe(&st);
        if st.epoch > self.epoch || self.weights_stale {
            let started = Instant::now();
            self.load_weights(st.epoch).await?;
            all_reduce_time("load", started);
        }
        let mut busy = false;
        for item in work.items {
            if stopping(flag) {
                break;
            }
            if item.epoch != self.epoch || self.ended == Some(item.epoch) {
                // Work of an epoch whose weights are gone, or whose work this miner ended (the
                // orchestrator no longer takes its hops of that epoch: validators replay them
                // against its pseudo-gradient): let the lease lapse.
                continue;
            }
            busy = true;
            self.hop(item).await?;
        }
        match st.phase {
            Phase::Uploading
                if !busy
                    && self.pending.is_empty()
                    && self.ended != Some(st.epoch)
                    && upload_now(&st, self.run.uploading_s) =>
            {
                let started = Instant::now();
                if self.upload_pseudo_gradients(st.epoch).await? {
                    all_reduce_time("upload", started);
                    busy = true;
                }
            }
            Phase::Merging => {
                let started = Instant::now();
                if self.merge().await? {
                    all_reduce_time("merge", started);
                    busy = true;
                }
            }
            _ => {}
        }
        Ok(busy)
    }

    /// Computes (unless already computed), uploads and completes one hop.
    async fn hop(&mut self, item: WorkItem) -> Result<(), MinerError> {
        let task_id = item.task_id;
        let handling = Instant::now();
        if !self.pending.contains_key(&task_id) {
            let input = match &item.input {
                Some(blob) => match self.client.download(blob).await {
                    Ok(bytes) => Some(bytes),
                    // Not the bytes its producer committed (replaced in the store, or damaged):
                    // the producer's fault, reported so that its hop fails, and this one is
                    // skipped. Failing the round instead failed every round after it, as the
                    // lease comes back on every poll until it lapses.
                    Err(ClientError::BadObject(why)) => {
                        tracing::warn!(task_id, key = %blob.key, why, "bad input; reporting it");
                        let _ = self.client.report_bad_object(&blob.key, &why).await;
                        return Ok(());
                    }
                    // Gone (its sample ended, its epoch was collected): nothing to compute.
                    Err(e) if e.code() == Some(ErrorCode::NotFound) => {
                        tracing::warn!(task_id, key = %blob.key, "input gone; skipping the hop");
                        return Ok(());
                    }
                    Err(e) => return Err(e.into()),
                },
                None => None,
            };
            let started = Instant::now();
            let (sample, direction) = (item.sample_id, item.direction);
            let computed = blocking(&self.trainer, move |t| match direction {
                Direction::Forward => t.forward(sample, input.as_deref()),
                Direction::Backward => match &input {
                    Some(g) => t.backward(sample, g),
                    None => Err(MinerError::BadInput(
                        "a backward hop without a gradient".into(),
                    )),
                },
            })
            .await;
            let out = match computed {
                Ok(out) => out,
                Err(MinerError::BadInput(why)) => {
                    if let Some(blob) = &item.input {
                        tracing::warn!(task_id, key = %blob.key, why, "bad input; reporting it");
                        let _ = self.client.report_bad_object(&blob.key, &why).await;
                    }
                    return Ok(());
                }
                Err(MinerError::NonFinite(_)) => {
                    self.status.send_modify(|s| s.nonfinite_events += 1);
                    return Ok(());
                }
                // A backward whose forward this miner no longer holds (it restarted, or the
                // cache was dropped): the sample cannot finish here.
                Err(MinerError::Model(e)) if direction == Direction::Backward => {
                    tracing::warn!(task_id, error = %e, "cannot run this backward; dropping it");
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            let compute_ms = started.elapsed().as_millis() as u64;
            let secs = started.elapsed().as_secs_f64().max(1e-6);
            let rate = out.tokens as f64 / secs;
            self.tokens_per_s = if self.tokens_per_s > 0.0 {
                0.9 * self.tokens_per_s + 0.1 * rate
            } else {
                rate
            };
            self.computed += 1;
            self.pending.insert(
                task_id,
                Pending {
                    seq: self.computed,
                    item: item.clone(),
                    out,
                    compute_ms,
                    output: None,
                },
            );
        }
        if self.settle(task_id).await? {
            let ms = handling.elapsed().as_secs_f64() * 1e3;
            self.status.send_modify(|s| s.busy_ms += ms);
            metrics::counter!("iota_miner_busy_ms_total").increment(ms.round() as u64);
        }
        Ok(())
    }

    /// Re-sends the hops an earlier round computed but could not submit, oldest first.
    async fn settle_pending(&mut self) -> Result<(), MinerError> {
        for task_id in in_computed_order(self.pending.iter().map(|(id, p)| (*id, p.seq))) {
            self.settle(task_id).await?;
        }
        Ok(())
    }

    /// Submits a computed hop; whether the orchestrator took it. A hop it refused is dropped,
    /// and its gradients with it; a failure that may pass (the network, 429, 5xx) leaves it
    /// pending, and the round fails so that it is sent again first.
    async fn settle(&mut self, task_id: i64) -> Result<bool, MinerError> {
        match self.submit(task_id).await {
            Ok(()) => Ok(true),
            Err(e) if is(&e, ErrorCode::LeaseExpired) || is(&e, ErrorCode::Forbidden) => {
                if let Some(p) = self.pending.remove(&task_id) {
                    let (sample, direction) = (p.item.sample_id, p.item.direction);
                    blocking(&self.trainer, move |t| {
                        t.discard(sample);
                        if direction == Direction::Forward {
                            t.forget(sample as u64);
                        }
                        Ok(())
                    })
                    .await?;
                }
                self.status.send_modify(|s| s.leases_lost += 1);
                metrics::counter!("iota_miner_leases_lost_total").increment(1);
                tracing::info!(task_id, "lease lapsed; the hop was re-routed");
                Ok(false)
            }
            Err(e) if is(&e, ErrorCode::WrongPhase) || refused(&e) => {
                if !is(&e, ErrorCode::WrongPhase) {
                    tracing::warn!(task_id, error = %e, "the orchestrator refused the hop; dropping it");
                }
                if let Some(p) = self.pending.remove(&task_id) {
                    let sample = p.item.sample_id;
                    blocking(&self.trainer, move |t| {
                        t.discard(sample);
                        Ok(())
                    })
                    .await?;
                }
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    async fn submit(&mut self, task_id: i64) -> Result<(), MinerError> {
        let Some(p) = self.pending.get(&task_id) else {
            return Ok(());
        };
        let (lease, bytes) = (p.item.lease, p.out.bytes.clone());
        let output = match (&p.output, bytes, p.item.expects_output) {
            (Some(done), _, _) => Some(done.clone()),
            (None, Some(bytes), true) => {
                let size = bytes.len();
                let started = Instant::now();
                let blob = self
                    .client
                    .upload_output(task_id, lease, Bytes::from(bytes))
                    .await?
                    .blob;
                let secs = started.elapsed().as_secs_f64().max(1e-6);
                self.status.send_modify(|s| {
                    s.bytes_uploaded += size as u64;
                    s.boundary_bytes += size as u64;
                    s.upload_mb_per_s = size as f64 / 1e6 / secs;
                });
                metrics::counter!("iota_miner_upload_bytes_total").increment(size as u64);
                if let Some(p) = self.pending.get_mut(&task_id) {
                    p.output = Some(blob.clone());
                }
                Some(blob)
            }
            (None, None, true) => {
                return Err(MinerError::Internal(format!(
                    "task {task_id} expects an output this stage does not produce"
                )));
            }
            (None, _, false) => None,
        };
        let Some(p) = self.pending.get(&task_id) else {
            return Ok(());
        };
        let req = CompleteRequest {
            lease,
            output,
            inner_step: p.out.inner_step,
            weights_digest: p.out.weights_digest.clone(),
            loss: p.out.loss.map(f64::from),
            sequence_losses: p
                .out
                .sequence_losses
                .as_ref()
                .map(|v| v.iter().map(|x| f64::from(*x)).collect()),
            compute_ms: Some(p.compute_ms),
        };
        self.client.complete(task_id, &req).await?;
        if let Some(p) = self.pending.remove(&task_id) {
            // Recorded: its gradients are part of the epoch now.
            let sample = p.item.sample_id;
            blocking(&self.trainer, move |t| t.commit(sample)).await?;
            let dir = p.item.direction;
            self.status.send_modify(|s| {
                s.hops += 1;
                s.compute_ms += p.compute_ms as f64;
                s.epoch_hops += 1;
                s.tokens += p.out.tokens;
                s.tokens_per_s = self.tokens_per_s;
                if let Some(l) = p.out.loss {
                    s.last_loss = Some(l);
                }
            });
            metrics::counter!("iota_miner_hops_total", "direction" => dir.as_str()).increment(1);
            metrics::counter!("iota_miner_tokens_total").increment(p.out.tokens);
            metrics::counter!("iota_miner_compute_ms_total").increment(p.compute_ms);
            if let Some(l) = p.out.loss {
                metrics::gauge!("iota_miner_loss").set(f64::from(l));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_follow_the_timeout_without_overflow() {
        assert_eq!(heartbeat_interval(90), Duration::from_secs(30));
        assert_eq!(heartbeat_interval(0), Duration::from_millis(200));
        // `timeout * 1000` overflowed here before: a run saying u64::MAX must not panic.
        assert!(heartbeat_interval(u64::MAX) > Duration::from_secs(u64::MAX / 4));
    }

    #[test]
    fn the_upload_waits_for_travelling_samples_until_half_the_phase_is_gone() {
        // Uploading for 60 s: 40 s left.
        let st = |started, completed, abandoned| EpochStatus {
            epoch: 3,
            phase: Phase::Uploading,
            phase_started_ms: 1_000_000,
            phase_deadline_ms: 1_060_000,
            merge_round: 0,
            samples_started: started,
            samples_completed: completed,
            samples_abandoned: abandoned,
            server_time_ms: 1_020_000,
        };
        assert!(!upload_now(&st(10, 6, 2), 60), "two samples travel");
        assert!(upload_now(&st(10, 8, 2), 60), "none travels");
        assert!(upload_now(&st(10, 10, 0), 60), "none travels");
        // Counters that disagree (read at different instants) do not wrap into "travelling".
        assert!(upload_now(&st(10, 9, 3), 60));
        // Past half the phase, the upload goes whatever travels.
        let late = EpochStatus {
            server_time_ms: 1_031_000,
            ..st(10, 6, 2)
        };
        assert!(upload_now(&late, 60));
        assert!(!upload_now(
            &EpochStatus {
                server_time_ms: 1_029_000,
                ..late.clone()
            },
            60
        ));
        // A phase length that does not fit in milliseconds does not panic.
        let _ = upload_now(&st(10, 6, 2), u64::MAX);
    }

    #[test]
    fn computed_hops_are_sent_in_the_order_they_were_computed() {
        // Task ids tell nothing of the order: a later task can be computed first.
        let pending: HashMap<i64, u64> = [(40, 3), (7, 5), (12, 1), (99, 2), (3, 4)].into();
        assert_eq!(
            in_computed_order(pending.into_iter()),
            vec![12, 99, 40, 3, 7]
        );
        assert!(in_computed_order(std::iter::empty()).is_empty());
    }

    #[test]
    fn only_answers_that_cannot_change_drop_a_computed_hop() {
        let api = |status: u16, code: ErrorCode| {
            MinerError::Api(ClientError::Api {
                status,
                error: iota_protocol::ApiError {
                    code,
                    message: String::new(),
                },
            })
        };
        // Sent again, these go through (or the lease lapses, which says so).
        for pass in [
            api(429, ErrorCode::RateLimited),
            api(408, ErrorCode::BadRequest),
            api(500, ErrorCode::Internal),
            api(503, ErrorCode::Internal),
            MinerError::Api(ClientError::Network("reset".into())),
        ] {
            assert!(!refused(&pass), "{pass}");
        }
        // These never will: kept pending, the hop would be sent first in every round for good.
        for stuck in [
            api(400, ErrorCode::BadRequest),
            api(409, ErrorCode::Conflict),
            api(413, ErrorCode::PayloadTooLarge),
            MinerError::Internal("expects an output this stage does not produce".into()),
        ] {
            assert!(refused(&stuck), "{stuck}");
        }
    }
}
