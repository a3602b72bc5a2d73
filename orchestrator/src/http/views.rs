//! Read-only views: the public explorer API and the records validators read.

use axum::Json;
use axum::extract::State;
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use serde::Deserialize;

use crate::app::App;
use crate::db;
use crate::error::{ApiResult, AppError};
use crate::http::extract::{ApiPath, ApiQuery, Bigint};
use crate::samples::run_now;

fn json_err(e: serde_json::Error) -> AppError {
    AppError::new(ErrorCode::Internal, format!("stored JSON: {e}"))
}

/// The run's identity.
pub fn run_info(app: &App) -> RunInfo {
    RunInfo {
        id: app.run.id,
        config: app.run.config.clone(),
        orchestrator_hotkey: app.hotkey.clone(),
        netuid: app.run.netuid,
        created_ms: app.run.created_at.timestamp_millis(),
        direct_uploads: app.store.presigns(),
    }
}

/// Where the run is now.
pub async fn epoch_status(app: &App) -> ApiResult<EpochStatus> {
    Ok(crate::db::status::read_epoch_status(&app.db, app.run.id, app.now()).await?)
}

/// The latest accepted merge of every partition of `stage` (older epochs fill partitions that
/// were left unchanged since) from an epoch before `before` (any epoch: `None`): with `before`
/// an epoch, the weights that epoch started from. With a presigning store each carries a
/// download URL (for a signed caller: see [`public_stage_weights`]).
pub async fn stage_weights(app: &App, stage: u32, before: Option<u64>) -> ApiResult<StageWeights> {
    let mut weights = public_stage_weights(app, stage, before).await?;
    for blob in weights.partitions.iter_mut().flatten() {
        blob.url = app.store.presign(http::Method::GET, &blob.key).await?;
    }
    Ok(weights)
}

/// [`stage_weights`] without download URLs, for anyone: the bytes come from the store to
/// members of the subnet only, as `GET /v1/blobs/{key}` does (a presigned URL would let anyone
/// pull the whole model from the bucket, as often as they like, at the run's expense).
pub async fn public_stage_weights(
    app: &App,
    stage: u32,
    before: Option<u64>,
) -> ApiResult<StageWeights> {
    if stage >= app.config().stages {
        return Err(AppError::new(
            ErrorCode::NotFound,
            format!("no stage {stage}"),
        ));
    }
    latest_accepted(app, stage, before).await
}

/// Each partition's latest accepted merge of `stage` from an epoch before `before` (any epoch:
/// `None`), and the latest epoch among them. One index probe per partition
/// (`partitions_accepted_latest`), not a read of every epoch's partitions.
pub(crate) async fn latest_accepted(
    app: &App,
    stage: u32,
    before: Option<u64>,
) -> ApiResult<StageWeights> {
    let count = app.config().partitions;
    let before = before.map_or(i64::MAX, |e| e.min(i64::MAX as u64) as i64);
    let slots = (stage as i32, count as i32);
    let mut rows = db::views::latest_accepted(&app.db, app.run.id, slots, before).await?;
    if app.config().sparse.is_some() {
        // A sparse run's merges are updates, not weights: only the last epoch's are asked for.
        let last = match before {
            i64::MAX => rows.iter().map(|(_, e, _)| *e).max(),
            b => Some(b - 1),
        };
        rows.retain(|(_, e, _)| Some(*e) == last);
    }
    let mut partitions: Vec<Option<BlobDescriptor>> = vec![None; count as usize];
    let mut latest: Option<u64> = None;
    for (partition, epoch, accepted) in rows {
        latest = latest.max(Some(epoch as u64));
        if let Some(slot) = partitions.get_mut(partition as usize) {
            *slot = Some(serde_json::from_value(accepted).map_err(json_err)?);
        }
    }
    Ok(StageWeights {
        epoch: latest,
        stage,
        partitions,
    })
}

/// `GET /v1/run`.
#[utoipa::path(get, path = "/v1/run", tag = "explorer", responses((status = 200, body = RunInfo)))]
pub async fn get_run(State(app): State<App>) -> Json<RunInfo> {
    Json(run_info(&app))
}

/// `GET /v1/status`.
#[utoipa::path(get, path = "/v1/status", tag = "explorer", responses((status = 200, body = EpochStatus)))]
pub async fn get_status(State(app): State<App>) -> ApiResult<Json<EpochStatus>> {
    Ok(Json(epoch_status(&app).await?))
}

/// `GET /v1/stages`.
#[utoipa::path(get, path = "/v1/stages", tag = "explorer", responses((status = 200, body = Vec<StageInfo>)))]
pub async fn get_stages(State(app): State<App>) -> ApiResult<Json<Vec<StageInfo>>> {
    let rows = db::views::stage_loads(&app.db, app.run.id).await?;
    let cfg = app.config();
    let mut out: Vec<StageInfo> = (0..cfg.stages)
        .map(|s| StageInfo {
            stage: s,
            params: cfg.params_of(s).unwrap_or(0),
            active_miners: 0,
            tokens_per_s: 0.0,
        })
        .collect();
    for (stage, miners, tokens_per_s) in rows {
        if let Some(s) = out.get_mut(stage as usize) {
            s.active_miners = miners as u32;
            s.tokens_per_s = tokens_per_s;
        }
    }
    Ok(Json(out))
}

/// Query of the stage weights.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WeightsQuery {
    /// Only merges of epochs before this one: the weights this epoch started from, what a miner
    /// trains the epoch from. Without it, the latest merges, including those the running epoch
    /// has accepted while merging.
    #[serde(default)]
    #[param(value_type = Option<u64>)]
    pub before: Option<Bigint>,
}

/// `GET /v1/stages/{stage}/weights?before=…`: keys, sizes and hashes, no download URLs (those
/// come signed: `GET /v1/miner/stages/{stage}/weights`).
#[utoipa::path(get, path = "/v1/stages/{stage}/weights", tag = "explorer",
    params(("stage" = u32, Path, description = "Stage"), WeightsQuery),
    responses((status = 200, body = StageWeights), (status = 400, body = iota_protocol::ApiError),
        (status = 404, body = iota_protocol::ApiError)))]
pub async fn get_stage_weights(
    State(app): State<App>,
    ApiPath(stage): ApiPath<u32>,
    ApiQuery(q): ApiQuery<WeightsQuery>,
) -> ApiResult<Json<StageWeights>> {
    Ok(Json(
        public_stage_weights(&app, stage, q.before.map(|b| b.0)).await?,
    ))
}

/// `GET /v1/miners?after=…&status=…&limit=…`: a page of miners, by hotkey.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct MinersQuery {
    /// Only miners whose hotkey sorts after this one (the last of the page before).
    #[serde(default)]
    pub after: Option<String>,
    /// Only miners in this status.
    #[serde(default)]
    #[param(inline)]
    pub status: Option<MinerStatusFilter>,
    /// At most this many (default 1000).
    #[serde(default)]
    #[param(value_type = Option<u32>, minimum = 1, maximum = 5000)]
    pub limit: Option<PageSize>,
}

/// A miner's status, as `GET /v1/miners?status=` filters it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MinerStatusFilter {
    /// Serving the run.
    Active,
    /// Gone: timed out, or left.
    Released,
}

impl MinerStatusFilter {
    fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Released => "released",
        }
    }
}

/// The most rows a page of an explorer list holds, and how many unless asked.
const MAX_PAGE: u32 = 5000;
const DEFAULT_PAGE: u32 = 1000;

/// How many rows a page holds, as a request asks: 1 to [`MAX_PAGE`] (the document says so;
/// anything else is a 400).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "u32")]
pub struct PageSize(u32);

impl TryFrom<u32> for PageSize {
    type Error = String;

    fn try_from(n: u32) -> Result<Self, String> {
        if (1..=MAX_PAGE).contains(&n) {
            Ok(Self(n))
        } else {
            Err(format!("limit {n}: a page holds 1 to {MAX_PAGE} rows"))
        }
    }
}

/// A page's size: `limit`, or the default.
pub(crate) fn page_limit(limit: Option<PageSize>) -> i64 {
    i64::from(limit.map_or(DEFAULT_PAGE, |l| l.0))
}

/// `GET /v1/miners`: every miner that joined the run (active or released), by hotkey, a page at
/// a time.
#[utoipa::path(get, path = "/v1/miners", tag = "explorer", params(MinersQuery),
    responses((status = 200, body = Vec<MinerInfo>), (status = 400, body = iota_protocol::ApiError)))]
pub async fn get_miners(
    State(app): State<App>,
    ApiQuery(q): ApiQuery<MinersQuery>,
) -> ApiResult<Json<Vec<MinerInfo>>> {
    let now = run_now(&app.db, app.run.id).await?;
    let filter = (q.after.as_deref(), q.status.map(MinerStatusFilter::as_str));
    let page = db::views::miners_page(
        &app.db,
        app.run.id,
        now.epoch as i64,
        filter,
        page_limit(q.limit),
    );
    Ok(Json(page.await?))
}

/// `GET /v1/loss` and `GET /v1/throughput`: the latest epochs, a page at a time.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EpochsQuery {
    /// Only epochs before this one (the first of the page after).
    #[serde(default)]
    #[param(value_type = Option<u64>)]
    pub before: Option<Bigint>,
    /// At most this many, the latest (default 1000); in epoch order.
    #[serde(default)]
    #[param(value_type = Option<u32>, minimum = 1, maximum = 5000)]
    pub limit: Option<PageSize>,
}

impl EpochsQuery {
    fn before(&self) -> i64 {
        // Within i64 by `Bigint`.
        self.before.map_or(i64::MAX, |e| e.0 as i64)
    }
}

/// `GET /v1/loss`: mean last-stage loss per epoch, the latest epochs.
#[utoipa::path(get, path = "/v1/loss", tag = "explorer", params(EpochsQuery),
    responses((status = 200, body = Vec<LossPoint>), (status = 400, body = iota_protocol::ApiError)))]
pub async fn get_loss(
    State(app): State<App>,
    ApiQuery(q): ApiQuery<EpochsQuery>,
) -> ApiResult<Json<Vec<LossPoint>>> {
    let rows = db::views::losses(&app.db, app.run.id, q.before(), page_limit(q.limit)).await?;
    Ok(Json(
        rows.into_iter()
            .map(|(epoch, samples, mean_loss)| LossPoint {
                epoch: epoch as u64,
                samples: samples as u64,
                mean_loss,
            })
            .collect(),
    ))
}

/// `GET /v1/throughput`: samples, tokens and bytes per epoch, the latest epochs.
#[utoipa::path(get, path = "/v1/throughput", tag = "explorer", params(EpochsQuery),
    responses((status = 200, body = Vec<ThroughputPoint>), (status = 400, body = iota_protocol::ApiError)))]
pub async fn get_throughput(
    State(app): State<App>,
    ApiQuery(q): ApiQuery<EpochsQuery>,
) -> ApiResult<Json<Vec<ThroughputPoint>>> {
    let page = (q.before(), page_limit(q.limit));
    let rows = db::views::throughput(&app.db, app.run.id, page, app.now()).await?;
    let tokens_per_sample = u64::from(app.config().micro_batch) * u64::from(app.config().seq_len);
    let mut out = Vec::with_capacity(rows.len());
    for (epoch, samples, wire_bytes, seconds) in rows {
        let samples = samples as u64;
        out.push(ThroughputPoint {
            epoch: epoch as u64,
            samples,
            tokens: samples * tokens_per_sample,
            seconds,
            wire_bytes: wire_bytes as u64,
        });
    }
    Ok(Json(out))
}

/// `GET /v1/samples/{id}`: a sample's pathway and loss.
#[utoipa::path(get, path = "/v1/samples/{id}", tag = "explorer",
    params(("id" = i64, Path, description = "Sample")),
    responses((status = 200, body = SampleRecord), (status = 400, body = iota_protocol::ApiError),
        (status = 404, body = iota_protocol::ApiError)))]
pub async fn get_sample(
    State(app): State<App>,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<SampleRecord>> {
    db::views::sample(&app.db, app.run.id, id)
        .await?
        .map(Json)
        .ok_or_else(|| AppError::new(ErrorCode::NotFound, format!("no sample {id}")))
}

/// Whose eyes a partition's merge status is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Audience<'a> {
    /// Anyone: the hashes of an open or disputed partition's results are left out. With one, an
    /// owner could read another's object (its key names the hash) and submit it unmerged.
    Public,
    /// A validator (signed, with a permit; its hotkey): every hash, to settle disputes and
    /// spot-check, but those of the partitions it has a stake in (`driver::has_stake`: a hotkey
    /// with a permit may also have joined as a miner), which are left out as for anyone.
    Validator(&'a str),
}

/// Merge status of every partition of an epoch.
pub async fn partitions_of(
    app: &App,
    epoch: u64,
    audience: Audience<'_>,
) -> ApiResult<Vec<PartitionStatus>> {
    let rows = db::views::partitions(&app.db, app.run.id, epoch as i64).await?;
    // Whether a validator mines too: any miner may be made an owner of any partition (a stage
    // short of miners borrows them, and a reassignment takes whoever has the fewest), so such a
    // validator reads no unsettled hash (see `driver::has_stake`).
    let mines: bool = match audience {
        Audience::Public => false,
        Audience::Validator(hotkey) => {
            db::views::is_active_miner(&app.db, app.run.id, hotkey).await?
        }
    };
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let state = PartitionState::parse(&r.state)
            .ok_or_else(|| AppError::new(ErrorCode::Internal, "bad partition state"))?;
        let owners = r.owners;
        let mut results: Vec<MergeResult> = serde_json::from_value(r.results).map_err(json_err)?;
        let hidden = match audience {
            Audience::Public => true,
            Audience::Validator(hotkey) => {
                mines
                    || owners.iter().any(|o| o == hotkey)
                    || results.iter().any(|m| m.hotkey == hotkey)
            }
        };
        if hidden && matches!(state, PartitionState::Open | PartitionState::Disputed) {
            for result in &mut results {
                result.blake3 = None;
            }
        }
        out.push(PartitionStatus {
            epoch,
            stage: r.stage as u32,
            partition: r.partition as u32,
            state,
            owners,
            results,
            accepted: r
                .accepted
                .map(serde_json::from_value)
                .transpose()
                .map_err(json_err)?,
            resolved_by: r.resolved_by,
        });
    }
    Ok(out)
}

/// `GET /v1/epochs/{epoch}/merges`.
#[utoipa::path(get, path = "/v1/epochs/{epoch}/merges", tag = "explorer",
    params(("epoch" = u64, Path, description = "Epoch")),
    responses((status = 200, body = Vec<PartitionStatus>), (status = 400, body = iota_protocol::ApiError)))]
pub async fn get_merges(
    State(app): State<App>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
) -> ApiResult<Json<Vec<PartitionStatus>>> {
    Ok(Json(partitions_of(&app, epoch, Audience::Public).await?))
}

/// The record of `epoch` (the run being in `current`, at `phase`) as `audience` may read it.
pub async fn epoch_record(
    app: &App,
    epoch: u64,
    current: u64,
    phase: Phase,
    audience: Audience<'_>,
) -> ApiResult<EpochRecord> {
    let miners = epoch_work(app, epoch).await?;
    let pseudo_gradients = epoch_pseudo_gradients(app, epoch).await?;
    let mut start_weights = Vec::new();
    for stage in 0..app.config().stages {
        start_weights.push(start_weights_of(app, stage, epoch).await?);
    }
    Ok(EpochRecord {
        epoch,
        phase: (epoch == current).then_some(phase),
        miners,
        pseudo_gradients,
        partitions: partitions_of(app, epoch, audience).await?,
        start_weights,
    })
}

/// Each miner's hops in `epoch`, with the stage it worked in.
async fn epoch_work(app: &App, epoch: u64) -> ApiResult<Vec<MinerWork>> {
    Ok(db::validators::epoch_work(&app.db, app.run.id, epoch as i64).await?)
}

/// The pseudo-gradients uploaded in `epoch`.
async fn epoch_pseudo_gradients(app: &App, epoch: u64) -> ApiResult<Vec<PseudoGradientRecord>> {
    Ok(db::validators::epoch_pseudo_gradients(&app.db, app.run.id, epoch as i64).await?)
}

/// The weights a stage started `epoch` with: the latest accepted merges of earlier epochs.
async fn start_weights_of(app: &App, stage: u32, epoch: u64) -> ApiResult<StageWeights> {
    latest_accepted(app, stage, Some(epoch)).await
}

/// `GET /v1/epochs/{epoch}`: a finished epoch's record (miners' work, pseudo-gradients, merges,
/// start weights), what a validator scored it from.
#[utoipa::path(get, path = "/v1/epochs/{epoch}", tag = "explorer",
    params(("epoch" = u64, Path, description = "Epoch")),
    responses((status = 200, body = EpochRecord), (status = 400, body = iota_protocol::ApiError),
        (status = 404, description = "The epoch has not finished", body = iota_protocol::ApiError)))]
pub async fn get_epoch(
    State(app): State<App>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
) -> ApiResult<Json<EpochRecord>> {
    let cur = finished(&app, epoch).await?;
    Ok(Json(
        epoch_record(&app, epoch, cur.epoch, cur.phase, Audience::Public).await?,
    ))
}

/// `GET /v1/epochs/{epoch}/samples`: a finished epoch's samples with pathway and loss (CLASP's
/// input), a page at a time.
#[utoipa::path(get, path = "/v1/epochs/{epoch}/samples", tag = "explorer",
    params(("epoch" = u64, Path, description = "Epoch"), PageQuery),
    responses((status = 200, body = SamplePage), (status = 400, body = iota_protocol::ApiError),
        (status = 404, description = "The epoch has not finished", body = iota_protocol::ApiError)))]
pub async fn get_epoch_samples(
    State(app): State<App>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<Json<SamplePage>> {
    finished(&app, epoch).await?;
    Ok(Json(samples_page(&app, epoch, &q).await?))
}

/// `GET /v1/epochs/{epoch}/scores`: every validator's scores for the epoch, with the settings
/// it scored with and the weights they produced once on chain.
#[utoipa::path(get, path = "/v1/epochs/{epoch}/scores", tag = "explorer",
    params(("epoch" = u64, Path, description = "Epoch")),
    responses((status = 200, body = Vec<ScoreRecord>), (status = 400, body = iota_protocol::ApiError)))]
pub async fn get_epoch_scores(
    State(app): State<App>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
) -> ApiResult<Json<Vec<ScoreRecord>>> {
    Ok(Json(
        db::views::epoch_scores(&app.db, app.run.id, epoch as i64).await?,
    ))
}

/// `GET /v1/epochs/{epoch}/spot-checks`: what each validator reported checking in the epoch
/// (the failures its scores read).
#[utoipa::path(get, path = "/v1/epochs/{epoch}/spot-checks", tag = "explorer",
    params(("epoch" = u64, Path, description = "Epoch")),
    responses((status = 200, body = Vec<SpotCheckReport>), (status = 400, body = iota_protocol::ApiError)))]
pub async fn get_epoch_spot_checks(
    State(app): State<App>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
) -> ApiResult<Json<Vec<SpotCheckReport>>> {
    Ok(Json(
        db::validators::reported_checks(&app.db, app.run.id, epoch as i64).await?,
    ))
}

/// Where the run is, once `epoch` has finished. An epoch still running is not shown to anyone
/// without a permit: its pseudo-gradients' keys would let a miner copy another's.
async fn finished(app: &App, epoch: u64) -> ApiResult<crate::samples::RunNow> {
    let cur = run_now(&app.db, app.run.id).await?;
    if epoch >= cur.epoch {
        return Err(AppError::new(
            ErrorCode::NotFound,
            format!("epoch {epoch} has not finished"),
        ));
    }
    Ok(cur)
}

/// Latest score submission of every validator.
pub async fn latest_scores(app: &App) -> ApiResult<Vec<ScoreRecord>> {
    Ok(db::views::latest_scores(&app.db, app.run.id).await?)
}

/// `GET /v1/scores`: each validator's latest scores and weights.
#[utoipa::path(get, path = "/v1/scores", tag = "explorer", responses((status = 200, body = Vec<ScoreRecord>)))]
pub async fn get_scores(State(app): State<App>) -> ApiResult<Json<Vec<ScoreRecord>>> {
    Ok(Json(latest_scores(&app).await?))
}

/// `GET /healthz` (and `/v1/noop`, the unsigned ceiling of the load benchmark).
#[utoipa::path(get, path = "/healthz", tag = "explorer", responses((status = 200, body = Health)))]
pub async fn health(State(app): State<App>) -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        leader: app.is_leader(),
    })
}

/// Paging query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// Return records after this id.
    #[serde(default)]
    pub after: i64,
    /// At most this many (default 1000).
    #[serde(default)]
    #[param(value_type = Option<u32>, minimum = 1, maximum = 5000)]
    pub limit: Option<crate::http::views::PageSize>,
}

impl PageQuery {
    fn limit(&self) -> i64 {
        page_limit(self.limit)
    }
}

/// Hop records of an epoch, by task id.
pub async fn hops_page(app: &App, epoch: u64, q: &PageQuery) -> ApiResult<HopPage> {
    let limit = q.limit();
    let page = (q.after, limit);
    let hops = db::views::hops_page(&app.db, app.run.id, epoch as i64, page).await?;
    let next_after = (hops.len() as i64 == limit)
        .then(|| hops.last().map(|h| h.task_id))
        .flatten();
    Ok(HopPage { hops, next_after })
}

/// Samples of an epoch with pathways and losses, by id.
pub async fn samples_page(app: &App, epoch: u64, q: &PageQuery) -> ApiResult<SamplePage> {
    let limit = q.limit();
    let page = (q.after, limit);
    let samples = db::views::samples_page(&app.db, app.run.id, epoch as i64, page).await?;
    let next_after = (samples.len() as i64 == limit)
        .then(|| samples.last().map(|s| s.sample_id))
        .flatten();
    Ok(SamplePage {
        samples,
        next_after,
    })
}
