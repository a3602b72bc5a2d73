//! Read-only views: the public explorer API and the records validators read.

use axum::Json;
use axum::extract::State;
use chrono::{DateTime, Utc};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use serde::Deserialize;
use sqlx::Row;

use crate::app::App;
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
    }
}

/// Where the run is now.
pub async fn epoch_status(app: &App) -> ApiResult<EpochStatus> {
    Ok(crate::status::read_epoch_status(&app.db, app.run.id, app.now()).await?)
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
    let rows = sqlx::query(
        "SELECT p.partition, x.epoch, x.accepted
         FROM generate_series(0, $3 - 1) AS p(partition)
         CROSS JOIN LATERAL (
             SELECT epoch, accepted FROM partitions
             WHERE run_id = $1 AND stage = $2 AND partition = p.partition
               AND state = 'accepted' AND epoch < $4
             ORDER BY epoch DESC LIMIT 1) x",
    )
    .bind(app.run.id)
    .bind(stage as i32)
    .bind(count as i32)
    .bind(before.map_or(i64::MAX, |e| e.min(i64::MAX as u64) as i64))
    .fetch_all(&app.db)
    .await?;
    let mut partitions: Vec<Option<BlobDescriptor>> = vec![None; count as usize];
    let mut latest: Option<u64> = None;
    for row in rows {
        let p = row.try_get::<i32, _>("partition")? as usize;
        latest = latest.max(Some(row.try_get::<i64, _>("epoch")? as u64));
        if let Some(slot) = partitions.get_mut(p) {
            *slot = Some(serde_json::from_value(row.try_get("accepted")?).map_err(json_err)?);
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
    let rows = sqlx::query(
        "SELECT stage, count(*) AS n, coalesce(sum(tokens_per_s), 0) AS tps FROM miners
         WHERE run_id = $1 AND status = 'active' GROUP BY stage",
    )
    .bind(app.run.id)
    .fetch_all(&app.db)
    .await?;
    let cfg = app.config();
    let mut out: Vec<StageInfo> = (0..cfg.stages)
        .map(|s| StageInfo {
            stage: s,
            params: cfg.params_of(s).unwrap_or(0),
            active_miners: 0,
            tokens_per_s: 0.0,
        })
        .collect();
    for row in rows {
        if let Some(s) = out.get_mut(row.try_get::<i32, _>("stage")? as usize) {
            s.active_miners = row.try_get::<i64, _>("n")? as u32;
            s.tokens_per_s = row.try_get("tps")?;
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
    let rows = sqlx::query(
        "SELECT m.hotkey, m.uid, m.stage, m.status, m.device, m.memory_bytes, m.tokens_per_s,
                m.last_seen, m.joined_epoch,
                (SELECT count(*) FROM tasks t WHERE t.run_id = m.run_id AND t.miner = m.hotkey
                   AND t.epoch = $2 AND t.status = 'done') AS hops
         FROM miners m
         WHERE m.run_id = $1 AND ($3::text IS NULL OR m.hotkey > $3)
           AND ($4::text IS NULL OR m.status = $4)
         ORDER BY m.hotkey LIMIT $5",
    )
    .bind(app.run.id)
    .bind(now.epoch as i64)
    .bind(q.after.as_deref())
    .bind(q.status.map(MinerStatusFilter::as_str))
    .bind(page_limit(q.limit))
    .fetch_all(&app.db)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let last_seen: DateTime<Utc> = r.try_get("last_seen")?;
        out.push(MinerInfo {
            hotkey: r.try_get("hotkey")?,
            uid: r.try_get::<i32, _>("uid")? as u16,
            stage: r.try_get::<i32, _>("stage")? as u32,
            status: r.try_get("status")?,
            capacity: Capacity {
                device: r.try_get("device")?,
                memory_bytes: r.try_get::<i64, _>("memory_bytes")? as u64,
                tokens_per_s: r.try_get("tokens_per_s")?,
            },
            last_seen_ms: last_seen.timestamp_millis(),
            joined_epoch: r.try_get::<i64, _>("joined_epoch")? as u64,
            hops_this_epoch: r.try_get::<i64, _>("hops")? as u64,
        });
    }
    Ok(Json(out))
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

/// What `GET /v1/loss` runs: finished epochs' stored means, and the running epoch's from its
/// own samples (so a request reads one row per epoch and one epoch's samples, however long the
/// run), the latest `$3` epochs before `$2`. Epochs without a loss are left out.
pub const LOSS_SQL: &str = "SELECT epoch, n, mean FROM (
       SELECT epoch, loss_samples AS n, loss_mean AS mean FROM epochs
       WHERE run_id = $1 AND epoch < $2 AND ended_at IS NOT NULL AND loss_samples > 0
       UNION ALL
       SELECT epoch, count(loss), avg(loss) FROM samples
       WHERE run_id = $1 AND epoch = (SELECT epoch FROM runs WHERE id = $1) AND epoch < $2
         AND loss IS NOT NULL
       GROUP BY epoch
       ORDER BY epoch DESC LIMIT $3) latest
     ORDER BY epoch";

/// `GET /v1/loss`: mean last-stage loss per epoch, the latest epochs.
#[utoipa::path(get, path = "/v1/loss", tag = "explorer", params(EpochsQuery),
    responses((status = 200, body = Vec<LossPoint>), (status = 400, body = iota_protocol::ApiError)))]
pub async fn get_loss(
    State(app): State<App>,
    ApiQuery(q): ApiQuery<EpochsQuery>,
) -> ApiResult<Json<Vec<LossPoint>>> {
    let rows: Vec<(i64, i64, f64)> = sqlx::query_as(LOSS_SQL)
        .bind(app.run.id)
        .bind(q.before())
        .bind(page_limit(q.limit))
        .fetch_all(&app.db)
        .await?;
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
    let rows = sqlx::query(
        "SELECT * FROM (
           SELECT epoch, samples_completed, wire_bytes,
             extract(epoch FROM coalesce(training_ended_at, $4) - started_at)::float8 AS secs
           FROM epochs WHERE run_id = $1 AND epoch < $2 ORDER BY epoch DESC LIMIT $3) latest
         ORDER BY epoch",
    )
    .bind(app.run.id)
    .bind(q.before())
    .bind(page_limit(q.limit))
    .bind(app.now())
    .fetch_all(&app.db)
    .await?;
    let tokens_per_sample = u64::from(app.config().micro_batch) * u64::from(app.config().seq_len);
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let samples = r.try_get::<i64, _>("samples_completed")? as u64;
        out.push(ThroughputPoint {
            epoch: r.try_get::<i64, _>("epoch")? as u64,
            samples,
            tokens: samples * tokens_per_sample,
            seconds: r.try_get("secs")?,
            wire_bytes: r.try_get::<i64, _>("wire_bytes")? as u64,
        });
    }
    Ok(Json(out))
}

async fn sample_record(app: &App, id: i64) -> ApiResult<Option<SampleRecord>> {
    let row = sqlx::query(
        "SELECT s.id, s.epoch, s.status, s.loss, s.sequence_losses,
            coalesce((SELECT array_agg(t.miner ORDER BY t.stage) FROM tasks t
              WHERE t.sample_id = s.id AND t.direction = 'forward' AND t.status = 'done'),
              '{}') AS pathway
         FROM samples s WHERE s.run_id = $1 AND s.id = $2",
    )
    .bind(app.run.id)
    .bind(id)
    .fetch_optional(&app.db)
    .await?;
    row.map(|r| sample_from_row(&r)).transpose()
}

fn sample_from_row(r: &sqlx::postgres::PgRow) -> ApiResult<SampleRecord> {
    Ok(SampleRecord {
        sample_id: r.try_get("id")?,
        epoch: r.try_get::<i64, _>("epoch")? as u64,
        status: r.try_get("status")?,
        pathway: r.try_get("pathway")?,
        loss: r.try_get("loss")?,
        sequence_losses: r.try_get("sequence_losses")?,
    })
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
    sample_record(&app, id)
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
    let rows = sqlx::query(
        "SELECT p.stage, p.partition, p.state, p.accepted, p.resolved_by,
            coalesce((SELECT array_agg(o.miner ORDER BY o.round, o.assigned_at, o.miner)
              FROM partition_owners o WHERE o.run_id = p.run_id AND o.epoch = p.epoch
              AND o.stage = p.stage AND o.partition = p.partition), '{}') AS owners,
            coalesce((SELECT jsonb_agg(jsonb_build_object('hotkey', r.submitter, 'blake3', r.blake3)
              ORDER BY r.submitted_at, r.submitter)
              FROM merge_results r WHERE r.run_id = p.run_id AND r.epoch = p.epoch
              AND r.stage = p.stage AND r.partition = p.partition), '[]'::jsonb) AS results
         FROM partitions p WHERE p.run_id = $1 AND p.epoch = $2 ORDER BY p.stage, p.partition",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .fetch_all(&app.db)
    .await?;
    // Whether a validator mines too: any miner may be made an owner of any partition (a stage
    // short of miners borrows them, and a reassignment takes whoever has the fewest), so such a
    // validator reads no unsettled hash (see `driver::has_stake`).
    let mines: bool = match audience {
        Audience::Public => false,
        Audience::Validator(hotkey) => {
            sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM miners WHERE run_id = $1 AND hotkey = $2
                              AND status = 'active')",
            )
            .bind(app.run.id)
            .bind(hotkey)
            .fetch_one(&app.db)
            .await?
        }
    };
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let state: String = r.try_get("state")?;
        let state = PartitionState::parse(&state)
            .ok_or_else(|| AppError::new(ErrorCode::Internal, "bad partition state"))?;
        let accepted: Option<serde_json::Value> = r.try_get("accepted")?;
        let owners: Vec<String> = r.try_get("owners")?;
        let mut results: Vec<MergeResult> =
            serde_json::from_value(r.try_get("results")?).map_err(json_err)?;
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
            stage: r.try_get::<i32, _>("stage")? as u32,
            partition: r.try_get::<i32, _>("partition")? as u32,
            state,
            owners,
            results,
            accepted: accepted
                .map(serde_json::from_value)
                .transpose()
                .map_err(json_err)?,
            resolved_by: r.try_get("resolved_by")?,
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

/// Each validator's latest score submission (`$1`: the run), reading one row per validator: the
/// validators one after another from the index (a skip scan), and each one's latest epoch. A
/// `DISTINCT ON` over the table read and sorted every submission of the run, on every request
/// (the dashboard asks every 2 s), and validators can submit for any past epoch.
pub const SCORES_SQL: &str = "WITH RECURSIVE validators AS (
        (SELECT validator FROM validator_scores WHERE run_id = $1 ORDER BY validator LIMIT 1)
        UNION ALL
        SELECT (SELECT s.validator FROM validator_scores s
                WHERE s.run_id = $1 AND s.validator > v.validator
                ORDER BY s.validator LIMIT 1)
        FROM validators v WHERE v.validator IS NOT NULL
    )
    SELECT l.validator, l.epoch, l.scores, l.weights, l.submitted_at
    FROM validators v CROSS JOIN LATERAL (
        SELECT s.validator, s.epoch, s.scores, s.weights, s.submitted_at FROM validator_scores s
        WHERE s.run_id = $1 AND s.validator = v.validator
        ORDER BY s.epoch DESC LIMIT 1
    ) l
    WHERE v.validator IS NOT NULL
    ORDER BY l.validator";

/// Latest score submission of every validator.
pub async fn latest_scores(app: &App) -> ApiResult<Vec<ScoreRecord>> {
    let rows = sqlx::query(SCORES_SQL)
        .bind(app.run.id)
        .fetch_all(&app.db)
        .await?;
    rows.iter().map(score_from_row).collect()
}

pub(crate) fn score_from_row(r: &sqlx::postgres::PgRow) -> ApiResult<ScoreRecord> {
    let submitted: DateTime<Utc> = r.try_get("submitted_at")?;
    let weights: Option<serde_json::Value> = r.try_get("weights")?;
    Ok(ScoreRecord {
        validator: r.try_get("validator")?,
        epoch: r.try_get::<i64, _>("epoch")? as u64,
        scores: serde_json::from_value(r.try_get("scores")?).map_err(json_err)?,
        weights: weights
            .map(serde_json::from_value)
            .transpose()
            .map_err(json_err)?,
        submitted_ms: submitted.timestamp_millis(),
    })
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
    let rows = sqlx::query(
        "SELECT id, epoch, sample_id, stage, direction, attempt, miner, status, input, output,
                inner_step, weights_digest, created_at, leased_at, completed_at, compute_ms
         FROM tasks WHERE run_id = $1 AND epoch = $2 AND id > $3 ORDER BY id LIMIT $4",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(q.after)
    .bind(limit)
    .fetch_all(&app.db)
    .await?;
    let mut hops = Vec::with_capacity(rows.len());
    for r in &rows {
        let direction: String = r.try_get("direction")?;
        let input: Option<serde_json::Value> = r.try_get("input")?;
        let output: Option<serde_json::Value> = r.try_get("output")?;
        let created: DateTime<Utc> = r.try_get("created_at")?;
        let leased: Option<DateTime<Utc>> = r.try_get("leased_at")?;
        let completed: Option<DateTime<Utc>> = r.try_get("completed_at")?;
        hops.push(HopRecord {
            task_id: r.try_get("id")?,
            epoch: r.try_get::<i64, _>("epoch")? as u64,
            sample_id: r.try_get("sample_id")?,
            stage: r.try_get::<i32, _>("stage")? as u32,
            direction: Direction::parse(&direction)
                .ok_or_else(|| AppError::new(ErrorCode::Internal, "bad direction"))?,
            attempt: r.try_get::<i32, _>("attempt")? as u32,
            miner: r.try_get("miner")?,
            status: r.try_get("status")?,
            input: input
                .map(serde_json::from_value)
                .transpose()
                .map_err(json_err)?,
            output: output
                .map(serde_json::from_value)
                .transpose()
                .map_err(json_err)?,
            inner_step: r.try_get::<Option<i64>, _>("inner_step")?.map(|v| v as u64),
            weights_digest: r.try_get("weights_digest")?,
            created_ms: created.timestamp_millis(),
            leased_ms: leased.map(|t| t.timestamp_millis()),
            completed_ms: completed.map(|t| t.timestamp_millis()),
            compute_ms: r.try_get::<Option<i64>, _>("compute_ms")?.map(|v| v as u64),
        });
    }
    let next_after = (hops.len() as i64 == limit)
        .then(|| hops.last().map(|h| h.task_id))
        .flatten();
    Ok(HopPage { hops, next_after })
}

/// Samples of an epoch with pathways and losses, by id.
pub async fn samples_page(app: &App, epoch: u64, q: &PageQuery) -> ApiResult<SamplePage> {
    let limit = q.limit();
    let rows = sqlx::query(
        "SELECT s.id, s.epoch, s.status, s.loss, s.sequence_losses,
            coalesce((SELECT array_agg(t.miner ORDER BY t.stage) FROM tasks t
              WHERE t.sample_id = s.id AND t.direction = 'forward' AND t.status = 'done'),
              '{}') AS pathway
         FROM samples s WHERE s.run_id = $1 AND s.epoch = $2 AND s.id > $3 ORDER BY s.id LIMIT $4",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(q.after)
    .bind(limit)
    .fetch_all(&app.db)
    .await?;
    let samples = rows
        .iter()
        .map(sample_from_row)
        .collect::<ApiResult<Vec<_>>>()?;
    let next_after = (samples.len() as i64 == limit)
        .then(|| samples.last().map(|s| s.sample_id))
        .flatten();
    Ok(SamplePage {
        samples,
        next_after,
    })
}
