//! Signed routes for miners: join, heartbeat, leased work, uploads, completions, merges.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, Request, State};
use axum::response::IntoResponse;
use chrono::{DateTime, Utc};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::{BlobDescriptor, is_blake3_hex};
use iota_protocol::tensor::{TensorSpec, check_tensor};

use serde::Deserialize;
use sqlx::{Postgres, Row, Transaction};
use uuid::Uuid;

use crate::app::App;
use crate::auth::{Caller, Gate, SharedReplay, SignedRoutes};
use crate::error::{ApiResult, AppError};
use crate::extract::{ApiJson, ApiPath, ApiQuery, Bigint};
use crate::objects::{SealedIn, delete_unless_recorded};
use crate::routing::{StageLoad, admit, pickup_s, reservations_hold_until, secs};
use crate::samples::{abandon_sample, close_epoch, route_forward_sample, run_now};
use crate::store::StoreError;
use crate::views;

/// `POST /v1/miner/register`: join the run (idempotent).
#[utoipa::path(post, path = "/v1/miner/register", tag = "miner",
    request_body = RegisterRequest,
    responses((status = 200, body = RegisterResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn register(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<RegisterRequest>,
) -> ApiResult<Json<RegisterResponse>> {
    let cap = &req.capacity;
    if !throughput_in_range(cap.tokens_per_s) || cap.device.len() > 64 {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            format!(
                "capacity needs tokens_per_s from 0 to {MAX_TOKENS_PER_S:e} and a device name of \
                 at most 64 bytes"
            ),
        ));
    }
    let run = app.run.id;
    let mut tx = app.db.begin().await?;
    // Serialise joins of one run so two replicas cannot both fill the same emptiest stage.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('iota-join'), $1::int)")
        .bind(run as i32)
        .execute(&mut *tx)
        .await?;
    // A restart closes the miner's epoch and re-routes its hops: not while the epoch ends (its
    // re-routed hops would outlive it).
    crate::driver::phase_lock_shared(&mut tx, run).await?;
    let now = run_now(&mut *tx, run).await?;
    let existing = sqlx::query(
        "SELECT stage, ended_epoch, status = 'active' AS active,
            EXISTS (SELECT 1 FROM tasks WHERE run_id = $1 AND epoch = $3 AND miner = $2
                      AND status = 'done') AS worked
         FROM miners WHERE run_id = $1 AND hotkey = $2",
    )
    .bind(run)
    .bind(&caller.ss58)
    .bind(now.epoch as i64)
    .fetch_optional(&mut *tx)
    .await?;
    let mut work_ended = false;
    let stage = match existing {
        Some(row) => {
            let stage: i32 = row.try_get("stage")?;
            let ended: Option<i64> = row.try_get("ended_epoch")?;
            work_ended = ended == Some(now.epoch as i64);
            if !work_ended && !req.holds_epoch_state && row.try_get::<bool, _>("worked")? {
                close_epoch(&mut tx, &app, &caller.ss58, now.epoch).await?;
                work_ended = true;
                tracing::info!(miner = %caller.ss58, epoch = now.epoch, "a restarted miner sits out the rest of the epoch");
            }
            // A stage with no miner takes one that joins again from a stage that keeps others
            // (the driver releases one for it, see `driver::release_for_an_empty_stage`).
            let loads = stage_loads(&mut tx, &app).await?;
            let me = u32::from(row.try_get::<bool, _>("active")?);
            let others_stay = loads.get(stage as usize).is_some_and(|l| l.miners > me);
            let empty = loads
                .iter()
                .find(|l| l.miners == 0 && l.memory_needed <= cap.memory_bytes);
            let stage = match empty.map(|l| l.stage) {
                Some(empty) if others_stay && empty != stage as u32 => {
                    tracing::info!(miner = %caller.ss58, from = stage, to = empty, "a miner joining again takes a stage with no miner");
                    empty as i32
                }
                _ => stage,
            };
            sqlx::query(
                "UPDATE miners SET status = 'active', uid = $3, device = $4, memory_bytes = $5,
                 tokens_per_s = $6, last_seen = now(), stage = $7 WHERE run_id = $1 AND hotkey = $2",
            )
            .bind(run)
            .bind(&caller.ss58)
            .bind(i32::from(caller.uid))
            .bind(&cap.device)
            .bind(cap.memory_bytes.min(i64::MAX as u64) as i64)
            .bind(cap.tokens_per_s)
            .bind(stage)
            .execute(&mut *tx)
            .await?;
            stage as u32
        }
        None => {
            let loads = stage_loads(&mut tx, &app).await?;
            let stage = admit(&loads, cap.memory_bytes)
                .map_err(|why| AppError::new(ErrorCode::Forbidden, why))?;
            sqlx::query(
                "INSERT INTO miners (run_id, hotkey, uid, stage, status, device, memory_bytes,
                 tokens_per_s, joined_epoch) VALUES ($1, $2, $3, $4, 'active', $5, $6, $7, $8)",
            )
            .bind(run)
            .bind(&caller.ss58)
            .bind(i32::from(caller.uid))
            .bind(stage as i32)
            .bind(&cap.device)
            .bind(cap.memory_bytes.min(i64::MAX as u64) as i64)
            .bind(cap.tokens_per_s)
            .bind(now.epoch as i64)
            .execute(&mut *tx)
            .await?;
            tracing::info!(miner = %caller.ss58, stage, epoch = now.epoch, "miner joined");
            stage
        }
    };
    tx.commit().await?;
    metrics::counter!("iota_miner_registrations_total").increment(1);
    // The weights the epoch in `status` started from: a miner joining while the epoch merges
    // must not train what is left of it from merges the epoch has already accepted (validators
    // replay its hops from the epoch's start weights).
    let status = views::epoch_status(&app).await?;
    let weights = views::stage_weights(&app, stage, Some(status.epoch)).await?;
    Ok(Json(RegisterResponse {
        run: views::run_info(&app),
        uid: caller.uid,
        stage,
        status,
        weights,
        work_ended: work_ended.then_some(now.epoch),
    }))
}

async fn stage_loads(tx: &mut Transaction<'_, Postgres>, app: &App) -> ApiResult<Vec<StageLoad>> {
    // Each miner's throughput counts up to `MAX_WEIGHT_OVER_MEDIAN` times the run's median, as
    // in routing: one claiming far more would make its stage look served, and every newcomer
    // would go elsewhere.
    let rows = sqlx::query(
        "WITH active AS (SELECT stage, tokens_per_s FROM miners
                         WHERE run_id = $1 AND status = 'active'),
              cap AS (SELECT $2 * percentile_disc(0.5) WITHIN GROUP (ORDER BY tokens_per_s)
                        AS tps FROM active)
         SELECT stage, count(*) AS miners,
                coalesce(sum(LEAST(tokens_per_s, (SELECT tps FROM cap))), 0) AS tps
         FROM active GROUP BY stage",
    )
    .bind(app.run.id)
    .bind(crate::routing::MAX_WEIGHT_OVER_MEDIAN)
    .fetch_all(&mut **tx)
    .await?;
    let cfg = app.config();
    let mut loads: Vec<StageLoad> = (0..cfg.stages)
        .map(|s| StageLoad {
            stage: s,
            memory_needed: cfg.memory_needed(s).unwrap_or(0),
            miners: 0,
            tokens_per_s: 0.0,
        })
        .collect();
    for row in rows {
        let s: i32 = row.try_get("stage")?;
        if let Some(l) = loads.get_mut(s as usize) {
            l.miners = row.try_get::<i64, _>("miners")? as u32;
            l.tokens_per_s = row.try_get("tps")?;
        }
    }
    Ok(loads)
}

/// The caller's stage, or 403 if it has not joined (or was released and must re-register).
async fn miner_stage<'e, E: sqlx::PgExecutor<'e>>(
    db: E,
    app: &App,
    caller: &Caller,
) -> ApiResult<u32> {
    let row = sqlx::query("SELECT stage, status FROM miners WHERE run_id = $1 AND hotkey = $2")
        .bind(app.run.id)
        .bind(&caller.ss58)
        .fetch_optional(db)
        .await?
        .ok_or_else(|| {
            AppError::new(
                ErrorCode::NotAMiner,
                "not a miner of this run: call POST /v1/miner/register first",
            )
        })?;
    let status: String = row.try_get("status")?;
    if status != "active" {
        return Err(AppError::new(
            ErrorCode::NotAMiner,
            "released after missing heartbeats: call POST /v1/miner/register again",
        ));
    }
    Ok(row.try_get::<i32, _>("stage")? as u32)
}

/// `POST /v1/miner/heartbeat`.
#[utoipa::path(post, path = "/v1/miner/heartbeat", tag = "miner",
    request_body = HeartbeatRequest,
    responses((status = 200, body = HeartbeatResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn heartbeat(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<HeartbeatRequest>,
) -> ApiResult<Json<HeartbeatResponse>> {
    if let Some(tps) = req.tokens_per_s
        && !throughput_in_range(tps)
    {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            format!("tokens_per_s must be from 0 to {MAX_TOKENS_PER_S:e}, not {tps}"),
        ));
    }
    let stage = miner_stage(&app.db, &app, &caller).await?;
    let tps = req.tokens_per_s;
    sqlx::query(
        "UPDATE miners SET last_seen = now(), tokens_per_s = coalesce($3, tokens_per_s)
         WHERE run_id = $1 AND hotkey = $2",
    )
    .bind(app.run.id)
    .bind(&caller.ss58)
    .bind(tps)
    .execute(&app.db)
    .await?;
    Ok(Json(HeartbeatResponse {
        stage,
        status: views::epoch_status(&app).await?,
    }))
}

fn work_item(row: &sqlx::postgres::PgRow, stages: u32) -> ApiResult<WorkItem> {
    let direction: String = row.try_get("direction")?;
    let direction = Direction::parse(&direction)
        .ok_or_else(|| AppError::new(ErrorCode::Internal, "bad direction"))?;
    let stage = row.try_get::<i32, _>("stage")? as u32;
    let input: Option<serde_json::Value> = row.try_get("input")?;
    let input = input
        .map(serde_json::from_value::<BlobDescriptor>)
        .transpose()
        .map_err(|e| AppError::new(ErrorCode::Internal, format!("stored blob: {e}")))?;
    let until: DateTime<Utc> = row.try_get("leased_until")?;
    Ok(WorkItem {
        task_id: row.try_get("id")?,
        lease: row.try_get("lease")?,
        lease_expires_ms: until.timestamp_millis(),
        epoch: row.try_get::<i64, _>("epoch")? as u64,
        sample_id: row.try_get("sample_id")?,
        stage,
        direction,
        input,
        expects_output: expects_output(direction, stage, stages),
    })
}

/// Every hop produces a tensor except those at stage 0 that have nowhere to send it: the
/// backward, and in a run of one stage the forward too (its loss is all it gives).
fn expects_output(direction: Direction, stage: u32, stages: u32) -> bool {
    !(stage == 0 && (direction == Direction::Backward || stages == 1))
}

/// Refuses an output for a hop that has none.
fn check_expects_output(app: &App, task: &LeasedTask) -> ApiResult<()> {
    if expects_output(task.direction, task.stage, app.config().stages) {
        Ok(())
    } else {
        Err(AppError::new(
            ErrorCode::BadRequest,
            format!(
                "the {} hop of stage {} has no output",
                task.direction.as_str(),
                task.stage
            ),
        ))
    }
}

/// A hop output sent again after its hop completed (a retry whose answer was lost): answered
/// from the record when it names the recorded object, never re-checked or rewritten (consumers
/// may be reading it).
fn recorded_output(
    task: &LeasedTask,
    task_id: i64,
    key: Option<&str>,
    blake3: &str,
) -> ApiResult<Json<UploadResponse>> {
    let stored = task
        .output
        .clone()
        .and_then(|v| serde_json::from_value::<BlobDescriptor>(v).ok());
    match stored {
        Some(blob) if key.is_none_or(|k| k == blob.key) && blob.blake3 == blake3 => {
            Ok(Json(UploadResponse { blob }))
        }
        _ => Err(AppError::new(
            ErrorCode::Conflict,
            format!("task {task_id} was completed with a different output"),
        )),
    }
}

/// `POST /v1/miner/work`: lease work. Leases the caller still holds come back first (so a retried
/// poll is harmless: a miner skips task ids it is already running), then pending hops routed to
/// it (backward before forward, oldest first, since a pending backward holds a cache in the
/// miner's memory); a stage-0 miner with room then gets new samples while the epoch trains.
#[utoipa::path(post, path = "/v1/miner/work", tag = "miner",
    request_body = WorkRequest,
    responses((status = 200, body = WorkResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn work(State(app): State<App>, request: Request) -> ApiResult<Json<WorkResponse>> {
    // The signed gate's steps, inline: this is the request every miner sends in a loop.
    let (parts, body) = request.into_parts();
    // A poll is a few bytes: read before its signature is checked, as any body that small is.
    let poll_limit = app
        .limits
        .json_body_bytes
        .min(crate::auth::MAX_UNCHECKED_BODY);
    crate::auth::check_content_length(&parts, poll_limit)?;
    let checked = crate::auth::check_caller(&app, &parts)?;
    let bytes = checked.read_unchecked_body(&app, body, poll_limit).await?;
    let auth = checked.with_body(&parts, &bytes);
    // Parsed while the request is still in this core's cache (the signature check waits for a
    // batch, and after it everything here would be read cold). Nothing acts on it until the
    // signature holds, and a bad body is reported only then, as behind the gate.
    let parsed: ApiResult<WorkRequest> = crate::extract::json_body(&parts.headers, &bytes);
    // Freed now, while in this core's cache, rather than after the batch wait (cold, and
    // perhaps on another thread).
    drop((parts, bytes));
    let (caller, uuid) = auth
        .finish(
            &app,
            SignedRoutes {
                gate: Gate::Registered,
                body_limit: poll_limit,
                shared_replay: SharedReplay::ByHandler,
                uploads: false,
            },
        )
        .await?;
    let req = parsed?;
    let max = req.max_items.clamp(1, 32) as i64;
    let cfg = app.config();
    // Most polls find nothing to do: the poll view answers those from memory (see `poll_view`
    // for why a view a little behind is safe). Read after the signature check, not before: a
    // hop routed to this miner while its poll waited for the batch is then seen in this answer.
    if let Some(glance) = app.poll_view.glance(&caller.ss58)
        && !glance.open_tasks
        && !may_start_samples(cfg, glance.stage, &glance.status)
    {
        app.poll_view.seen(&caller.ss58);
        app.counters().polls_from_view.increment(1);
        return Ok(Json(WorkResponse {
            items: Vec::new(),
            status: glance.status,
        }));
    }
    app.counters().polls_from_database.increment(1);
    // Boxed: the poll's own future stays small (it is moved about on every idle poll).
    Box::pin(lease(&app, &caller, uuid, max)).await.map(Json)
}

/// A work poll past the poll view: held leases, pending hops and new samples, from the database.
async fn lease(
    app: &App,
    caller: &Caller,
    mut uuid: crate::auth::PendingUuid,
    max: i64,
) -> ApiResult<WorkResponse> {
    let cfg = app.config();
    // Before anything is leased: a replay of this poll is refused by every process from now on.
    uuid.record(app).await?;
    // Otherwise one statement (see POLL_SQL), no transaction. Only a stage-0 miner that may
    // still start samples needs a transaction after it.
    let (stage, mut items, mut status) = poll(app, caller, max).await?;
    let room = max - items.len() as i64;
    // Once the epoch's sample budget is spent, stage 0 polls skip the locking budget update.
    if room > 0 && may_start_samples(cfg, stage, &status) {
        let mut tx = app.db.begin().await?;
        let started = start_samples(&mut tx, app, caller, status.epoch, room).await?;
        tx.commit().await?;
        if !started.is_empty() {
            status = views::epoch_status(app).await?;
        }
        items.extend(started);
    }
    for item in &mut items {
        presign_input(app, item).await?;
    }
    metrics::counter!("iota_work_items_leased_total").increment(items.len() as u64);
    Ok(WorkResponse { items, status })
}

/// Whether a miner of `stage` may be given new samples now.
fn may_start_samples(cfg: &RunConfig, stage: u32, status: &EpochStatus) -> bool {
    stage == 0 && status.phase == Phase::Training && status.samples_started < cfg.samples_per_epoch
}

/// The poll statement for `caller`: its stage, its items (held leases first, then new ones) and
/// the epoch status.
async fn poll(
    app: &App,
    caller: &Caller,
    max: i64,
) -> ApiResult<(u32, Vec<WorkItem>, EpochStatus)> {
    // Twice at most: a caller that was not active when the statement ran but is by the time the
    // full check looks (it registered in between) polls again.
    for _ in 0..2 {
        let rows = sqlx::query(POLL_SQL)
            .bind(app.run.id)
            .bind(&caller.ss58)
            .bind(app.config().lease_s as f64)
            .bind(max)
            .fetch_all(&app.db)
            .await?;
        let Some(first) = rows.first() else {
            // Not a miner, or released: the full check says which.
            miner_stage(&app.db, app, caller).await?;
            continue;
        };
        let stage = first.try_get::<i32, _>("miner_stage")? as u32;
        let status = crate::status::status_from_row(first)?;
        let mut items = Vec::with_capacity(rows.len());
        for row in &rows {
            if row.try_get::<Option<i64>, _>("id")?.is_some() {
                items.push(work_item(row, app.config().stages)?);
            }
        }
        return Ok((stage, items, status));
    }
    Err(AppError::new(
        ErrorCode::Internal,
        "the miner's state changed during the poll; poll again",
    ))
}

/// The work poll as one statement: checks the caller (active miner of this run) and marks it seen
/// (at most once a second), returns the leases it still holds, leases pending hops routed to it
/// up to `$4` in all (none of an epoch the caller has ended, see [`close_epoch`]), and reads the
/// epoch status. One row per item, or one row with null item
/// columns; no row when the caller is not an active miner (nothing is leased then).
const POLL_SQL: &str = "
WITH me AS (
    SELECT stage, ended_epoch FROM miners
    WHERE run_id = $1 AND hotkey = $2 AND status = 'active'
), touched AS (
    UPDATE miners SET last_seen = now()
    WHERE run_id = $1 AND hotkey = $2 AND status = 'active'
      AND last_seen < now() - interval '1 second'
), held AS (
    SELECT id, lease, leased_until, epoch, sample_id, stage, direction, input FROM tasks
    WHERE run_id = $1 AND miner = $2 AND status = 'leased' AND leased_until > now()
      AND EXISTS (SELECT 1 FROM me)
    ORDER BY id LIMIT $4
), fresh AS (
    UPDATE tasks SET status = 'leased', lease = gen_random_uuid(), leased_at = now(),
        leased_until = now() + make_interval(secs => $3)
    WHERE id IN (
        SELECT id FROM tasks WHERE run_id = $1 AND miner = $2 AND status = 'pending'
          AND EXISTS (SELECT 1 FROM me)
          AND tasks.epoch IS DISTINCT FROM (SELECT ended_epoch FROM me)
        ORDER BY (direction = 'backward') DESC, id
        LIMIT greatest($4 - (SELECT count(*) FROM held), 0)
        FOR UPDATE SKIP LOCKED)
    RETURNING id, lease, leased_until, epoch, sample_id, stage, direction, input
), items AS (
    SELECT 0 AS part, * FROM held UNION ALL SELECT 1 AS part, * FROM fresh
)
SELECT me.stage AS miner_stage, r.epoch AS status_epoch, r.phase AS status_phase,
       r.phase_started AS status_phase_started, r.phase_deadline AS status_phase_deadline,
       r.merge_round AS status_merge_round, e.samples_started AS status_samples_started,
       e.samples_completed AS status_samples_completed,
       e.samples_abandoned AS status_samples_abandoned,
       i.id, i.lease, i.leased_until, i.epoch, i.sample_id, i.stage, i.direction, i.input
FROM me CROSS JOIN runs r JOIN epochs e ON e.run_id = r.id AND e.epoch = r.epoch
LEFT JOIN items i ON true
WHERE r.id = $1
ORDER BY i.part, i.part = 1 AND i.direction = 'backward' DESC, i.id";

async fn presign_input(app: &App, item: &mut WorkItem) -> ApiResult<()> {
    if let Some(input) = &mut item.input {
        input.url = app.store.presign(http::Method::GET, &input.key).await?;
    }
    Ok(())
}

/// Starts up to `room` new samples at stage 0 for the caller, within the epoch's sample budget
/// and the miner's in-flight limit.
async fn start_samples(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    caller: &Caller,
    epoch: u64,
    room: i64,
) -> ApiResult<Vec<WorkItem>> {
    let cfg = app.config();
    // The phase as it is now, not as the poll's statement read it: samples start before the
    // training phase ends or not at all (a poll that raced with `start_uploading` started
    // samples into the uploading phase, where they were abandoned unfinished).
    crate::driver::phase_lock_shared(tx, app.run.id).await?;
    let training: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM runs WHERE id = $1 AND epoch = $2 AND phase = 'training')",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .fetch_one(&mut **tx)
    .await?;
    if !training {
        return Ok(Vec::new());
    }
    // The miner's row first: two polls of one miner (on one process or two) then count its
    // samples in flight one after the other, each seeing what the other started, and a miner
    // whose work in the epoch has ended (`close_epoch`) starts none.
    let ended: Option<Option<i64>> = sqlx::query_scalar(
        "SELECT ended_epoch FROM miners WHERE run_id = $1 AND hotkey = $2 AND status = 'active'
         FOR NO KEY UPDATE",
    )
    .bind(app.run.id)
    .bind(&caller.ss58)
    .fetch_optional(&mut **tx)
    .await?;
    match ended {
        Some(ended) if ended != Some(epoch as i64) => {}
        _ => return Ok(Vec::new()),
    }
    let in_flight: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM samples s JOIN tasks t
           ON t.sample_id = s.id AND t.stage = 0 AND t.direction = 'forward'
              AND t.status IN ('pending', 'leased', 'done')
         WHERE s.run_id = $1 AND s.epoch = $2 AND s.status IN ('forward', 'backward')
           AND t.miner = $3",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(&caller.ss58)
    .fetch_one(&mut **tx)
    .await?;
    let want = room.min(i64::from(cfg.max_in_flight) - in_flight);
    if want <= 0 {
        return Ok(Vec::new());
    }
    let granted: Option<i64> = sqlx::query_scalar(
        "WITH cur AS (SELECT samples_started FROM epochs WHERE run_id = $1 AND epoch = $2 FOR UPDATE)
         UPDATE epochs e SET samples_started = LEAST(cur.samples_started + $3, $4)
         FROM cur WHERE e.run_id = $1 AND e.epoch = $2
         RETURNING e.samples_started - cur.samples_started",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(want)
    .bind(cfg.samples_per_epoch.min(i64::MAX as u64) as i64)
    .fetch_optional(&mut **tx)
    .await?;
    let granted = granted.unwrap_or(0);
    let mut items = Vec::new();
    for _ in 0..granted {
        let sample_id: i64 = sqlx::query_scalar(
            "INSERT INTO samples (run_id, epoch, status) VALUES ($1, $2, 'forward') RETURNING id",
        )
        .bind(app.run.id)
        .bind(epoch as i64)
        .fetch_one(&mut **tx)
        .await?;
        let row = sqlx::query(
            "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, miner, status, lease,
                 leased_at, leased_until)
             VALUES ($1, $2, $3, 0, 'forward', $4, 'leased', gen_random_uuid(), now(),
                 now() + make_interval(secs => $5))
             RETURNING id, lease, leased_until, epoch, sample_id, stage, direction, input",
        )
        .bind(app.run.id)
        .bind(epoch as i64)
        .bind(sample_id)
        .bind(&caller.ss58)
        .bind(cfg.lease_s as f64)
        .fetch_one(&mut **tx)
        .await?;
        items.push(work_item(&row, cfg.stages)?);
    }
    Ok(items)
}

/// Query of a direct upload.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UploadQuery {
    /// The lease (task outputs only).
    #[serde(default)]
    pub lease: Option<Uuid>,
    /// BLAKE3 (hex) of the body.
    pub blake3: String,
}

/// A leased task, locked for update.
pub(crate) struct LeasedTask {
    epoch: u64,
    sample_id: i64,
    stage: u32,
    direction: Direction,
    attempt: i32,
    status: String,
    lease: Option<Uuid>,
    miner: String,
    staged: Option<serde_json::Value>,
    output: Option<serde_json::Value>,
    next_task_id: Option<i64>,
}

async fn lock_task(tx: &mut Transaction<'_, Postgres>, run: i64, id: i64) -> ApiResult<LeasedTask> {
    let row = sqlx::query(
        "SELECT epoch, sample_id, stage, direction, attempt, status, lease, miner, staged_output,
                output,
                (SELECT min(n.id) FROM tasks n WHERE n.sample_id = t.sample_id AND n.id > t.id
                   AND n.attempt = 0) AS next_task_id
         FROM tasks t WHERE id = $1 AND run_id = $2 FOR UPDATE",
    )
    .bind(id)
    .bind(run)
    .fetch_optional(&mut **tx)
    .await?
    .ok_or_else(|| AppError::new(ErrorCode::NotFound, format!("no task {id}")))?;
    let direction: String = row.try_get("direction")?;
    Ok(LeasedTask {
        epoch: row.try_get::<i64, _>("epoch")? as u64,
        sample_id: row.try_get("sample_id")?,
        stage: row.try_get::<i32, _>("stage")? as u32,
        direction: Direction::parse(&direction)
            .ok_or_else(|| AppError::new(ErrorCode::Internal, "bad direction"))?,
        attempt: row.try_get("attempt")?,
        status: row.try_get("status")?,
        lease: row.try_get("lease")?,
        miner: row.try_get("miner")?,
        staged: row.try_get("staged_output")?,
        output: row.try_get("output")?,
        next_task_id: row.try_get("next_task_id")?,
    })
}

fn check_lease(task: &LeasedTask, caller: &Caller, lease: Uuid, id: i64) -> ApiResult<()> {
    if task.miner != caller.ss58 {
        return Err(AppError::new(
            ErrorCode::Forbidden,
            format!("task {id} is not routed to you"),
        ));
    }
    if task.lease != Some(lease) {
        return Err(AppError::new(
            ErrorCode::LeaseExpired,
            format!("lease {lease} of task {id} is not current: the hop was re-routed"),
        ));
    }
    Ok(())
}

/// The task `task_id` if the caller holds `lease` on it (read without locking: the write that
/// follows re-checks the lease).
async fn leased_task(
    app: &App,
    caller: &Caller,
    task_id: i64,
    lease: Option<Uuid>,
) -> ApiResult<(LeasedTask, Uuid)> {
    let lease = lease.ok_or_else(|| AppError::new(ErrorCode::BadRequest, "lease is required"))?;
    let mut tx = app.db.begin().await?;
    let task = lock_task(&mut tx, app.run.id, task_id).await?;
    tx.commit().await?;
    check_lease(&task, caller, lease, task_id)?;
    Ok((task, lease))
}

/// Refuses a presigned upload larger than its slot before handing out a URL.
fn check_presign_size(req: &PresignRequest, spec: &TensorSpec) -> ApiResult<()> {
    if req.size > spec.max_bytes() {
        return Err(AppError::new(
            ErrorCode::PayloadTooLarge,
            format!(
                "{} bytes, this slot takes at most {}",
                req.size,
                spec.max_bytes()
            ),
        ));
    }
    Ok(())
}

pub(crate) fn boundary_spec(cfg: &RunConfig) -> TensorSpec {
    TensorSpec::Boundary {
        shape: cfg.boundary_shape(),
        encoding: cfg.wire,
    }
}

/// Where an accepted object is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// At its slot's key. For hop outputs: a producer that replaces its own output after the
    /// commit only fails its own hop (the consumer reports the object).
    Slot,
    /// At a key named by its hash ([`sealed_key`]), which no presigned URL names. For merged
    /// partitions and pseudo-gradients, which others build on: once accepted, their bytes
    /// cannot be replaced by the uploader.
    Sealed,
}

/// The key of an accepted object of `slot_key` with this hash (see [`Placement::Sealed`]).
pub(crate) fn sealed_key(slot_key: &str, blake3: &str) -> String {
    match slot_key.strip_suffix(".safetensors") {
        Some(stem) => format!("{stem}.{blake3}.safetensors"),
        None => format!("{slot_key}.{blake3}"),
    }
}

/// Checks an upload's bytes against its slot and declared hash, then stores it. Nothing is
/// written unless every check passes.
pub(crate) async fn accept_upload(
    app: &App,
    key: String,
    spec: &TensorSpec,
    bytes: Bytes,
    declared_blake3: &str,
    placement: Placement,
) -> ApiResult<BlobDescriptor> {
    if !is_blake3_hex(declared_blake3) {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            "blake3 must be 64 lowercase hex digits",
        ));
    }
    let mut blob = check_bytes(spec, key, &bytes, declared_blake3)?;
    if placement == Placement::Sealed {
        blob.key = sealed_key(&blob.key, &blob.blake3);
    }
    app.store.put(&blob.key, bytes).await?;
    metrics::counter!("iota_upload_bytes_total").increment(blob.size);
    Ok(blob)
}

pub(crate) fn check_bytes(
    spec: &TensorSpec,
    key: String,
    bytes: &[u8],
    declared_blake3: &str,
) -> ApiResult<BlobDescriptor> {
    let max = spec.max_bytes();
    if bytes.len() as u64 > max {
        return Err(AppError::new(
            ErrorCode::PayloadTooLarge,
            format!("{} bytes, this slot takes at most {max}", bytes.len()),
        ));
    }
    let actual = blake3::hash(bytes).to_hex().to_string();
    if actual != declared_blake3 {
        return Err(AppError::new(
            ErrorCode::InvalidTensor,
            format!("BLAKE3 of the body is {actual}, the request declared {declared_blake3}"),
        ));
    }
    check_tensor(bytes, spec)
        .map_err(|e| AppError::new(ErrorCode::InvalidTensor, e.to_string()))?;
    let (dtype, shape) = spec.dtype_and_shape();
    Ok(BlobDescriptor {
        key,
        size: bytes.len() as u64,
        dtype,
        shape,
        blake3: actual,
        url: None,
    })
}

fn task_output_key(app: &App, task_id: i64, t: &LeasedTask) -> String {
    format!(
        "runs/{}/epoch-{}/samples/{}/s{}-{}-a{}-t{}.safetensors",
        app.run.id,
        t.epoch,
        t.sample_id,
        t.stage,
        t.direction.as_str(),
        t.attempt,
        task_id
    )
}

/// `PUT /v1/miner/tasks/{task_id}/output?lease=…&blake3=…`: upload a hop's output tensor.
#[utoipa::path(put, path = "/v1/miner/tasks/{task_id}/output", tag = "miner",
    params(("task_id" = i64, Path, description = "Task"), UploadQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = UploadResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn upload_output(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath(task_id): ApiPath<i64>,
    ApiQuery(q): ApiQuery<UploadQuery>,
    body: Bytes,
) -> ApiResult<Json<UploadResponse>> {
    // Check the lease before touching the store.
    let (task, lease) = leased_task(&app, &caller, task_id, q.lease).await?;
    if task.status == "done" {
        return recorded_output(&task, task_id, None, &q.blake3);
    }
    if task.status != "leased" {
        return Err(AppError::new(
            ErrorCode::LeaseExpired,
            format!("task {task_id} is {}", task.status),
        ));
    }
    check_expects_output(&app, &task)?;
    let key = task_output_key(&app, task_id, &task);
    let blob = accept_upload(
        &app,
        key,
        &boundary_spec(app.config()),
        body,
        &q.blake3,
        Placement::Slot,
    )
    .await?;
    stage_output(&app, task_id, lease, blob).await
}

async fn stage_output(
    app: &App,
    task_id: i64,
    lease: Uuid,
    blob: BlobDescriptor,
) -> ApiResult<Json<UploadResponse>> {
    let value = serde_json::to_value(&blob)
        .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
    let updated = sqlx::query(
        "UPDATE tasks SET staged_output = $3 WHERE id = $1 AND lease = $2 AND status = 'leased'",
    )
    .bind(task_id)
    .bind(lease)
    .bind(value)
    .execute(&app.db)
    .await?;
    if updated.rows_affected() == 0 {
        // An earlier attempt of this same upload (a client that timed out and retried) may have
        // been staged and the hop completed meanwhile: the object at this key is then the hop's
        // output, which consumers read, and it stays.
        let recorded: Option<Option<String>> = sqlx::query_scalar(
            "SELECT output->>'blake3' FROM tasks WHERE id = $1 AND lease = $2 AND status = 'done'
               AND output->>'key' = $3",
        )
        .bind(task_id)
        .bind(lease)
        .bind(&blob.key)
        .fetch_optional(&app.db)
        .await?;
        return match recorded {
            Some(Some(hash)) if hash == blob.blake3 => Ok(Json(UploadResponse { blob })),
            Some(_) => Err(AppError::new(
                ErrorCode::Conflict,
                format!("task {task_id} was completed with a different output"),
            )),
            None => {
                // The lease lapsed while the bytes were in flight: leave nothing behind.
                app.store.delete(&blob.key).await?;
                Err(AppError::new(
                    ErrorCode::LeaseExpired,
                    format!("task {task_id}'s lease lapsed during the upload"),
                ))
            }
        };
    }
    Ok(Json(UploadResponse { blob }))
}

/// `POST /v1/miner/tasks/{task_id}/output/presign`: a URL to PUT the output straight to the
/// store (S3-compatible stores only).
#[utoipa::path(post, path = "/v1/miner/tasks/{task_id}/output/presign", tag = "miner",
    params(("task_id" = i64, Path, description = "Task"), UploadQuery),
    request_body = PresignRequest,
    responses((status = 200, body = PresignResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn presign_output(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath(task_id): ApiPath<i64>,
    ApiQuery(q): ApiQuery<UploadQuery>,
    ApiJson(req): ApiJson<PresignRequest>,
) -> ApiResult<Json<PresignResponse>> {
    let (task, _) = leased_task(&app, &caller, task_id, q.lease).await?;
    if task.status != "leased" {
        return Err(AppError::new(
            ErrorCode::LeaseExpired,
            format!("task {task_id} is {}", task.status),
        ));
    }
    check_expects_output(&app, &task)?;
    let spec = boundary_spec(app.config());
    check_presign_size(&req, &spec)?;
    presign(&app, task_output_key(&app, task_id, &task)).await
}

pub(crate) async fn presign(app: &App, key: String) -> ApiResult<Json<PresignResponse>> {
    let url = app
        .store
        .presign(http::Method::PUT, &key)
        .await?
        .ok_or_else(|| {
            AppError::new(
                ErrorCode::BadRequest,
                "this orchestrator's store does not presign: PUT the bytes to the orchestrator",
            )
        })?;
    let ttl = chrono::Duration::from_std(app.store.presign_ttl())
        .unwrap_or_else(|_| chrono::Duration::seconds(900));
    Ok(Json(PresignResponse {
        url,
        key,
        expires_ms: (Utc::now() + ttl).timestamp_millis(),
    }))
}

/// Reads a presigned upload back, checks it in full, and deletes it if it fails. With
/// [`Placement::Sealed`], the object is first moved to a key no presigned URL names and checked
/// there, so a PUT that lands after the check cannot change what is accepted; it is then kept at
/// its [`sealed_key`].
pub(crate) async fn accept_committed(
    app: &App,
    expected_key: &str,
    spec: &TensorSpec,
    commit: &CommitRequest,
    placement: Placement,
) -> ApiResult<BlobDescriptor> {
    if commit.key != expected_key {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            format!("key {} is not this slot's {expected_key}", commit.key),
        ));
    }
    if placement == Placement::Slot {
        return check_stored(app, expected_key, spec, commit).await;
    }
    // Its callers run it in a task of their own (`to_completion`): a client that stops waiting
    // (a large object takes long to read) closes its connection and the server drops the
    // handler, which would leave the object aside until it counts as abandoned, and every retry
    // `in_progress` meanwhile. The task moves, checks, seals and records it whatever the client
    // does, and a retry finds it recorded.
    seal_committed(app, expected_key, spec, commit).await
}

/// [`accept_committed`] of a [`Placement::Sealed`] object.
async fn seal_committed(
    app: &App,
    expected_key: &str,
    spec: &TensorSpec,
    commit: &CommitRequest,
) -> ApiResult<BlobDescriptor> {
    let pending = pending_key(expected_key, Utc::now());
    // Where the bytes came from: the slot, or an abandoned attempt's key (taken over).
    let mut source = None;
    // Twice: an attempt whose check failed on a store error puts the object back in the slot.
    for _ in 0..2 {
        match app.store.rename(expected_key, &pending).await {
            Ok(()) => {
                source = Some(expected_key.to_owned());
                break;
            }
            Err(StoreError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
        match moved_earlier(app, expected_key, spec, commit).await? {
            Moved::Sealed(blob) => return Ok(blob),
            Moved::Checking => return Err(in_progress(expected_key)),
            Moved::Abandoned(key) => match app.store.rename(&key, &pending).await {
                Ok(()) => {
                    source = Some(key);
                    break;
                }
                Err(StoreError::NotFound(_)) => return Err(in_progress(expected_key)),
                Err(e) => return Err(e.into()),
            },
            Moved::Nothing => {}
        }
    }
    let Some(source) = source else {
        return Err(nothing_uploaded(expected_key));
    };
    // Bad bytes from the slot are this commit's upload, and are deleted; an abandoned attempt's
    // may be another commit's (of the same size), and go back where they were.
    let bad = if source == expected_key {
        Bad::Delete
    } else {
        Bad::Keep
    };
    let checked = match check_stored_if_there(app, &pending, spec, commit, bad).await {
        Ok(checked) => checked,
        Err(e) => {
            // What is left (not bad bytes from the slot, deleted by the check) goes back for a
            // retry, or stays aside, where a later commit takes it over once it is abandoned:
            // never deleted here, it may be the only copy.
            let _ = app.store.rename(&pending, &source).await;
            return Err(e);
        }
    };
    if let Some(mut blob) = checked {
        blob.key = sealed_key(expected_key, &blob.blake3);
        match app.store.rename(&pending, &blob.key).await {
            Ok(()) => return Ok(blob),
            Err(StoreError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    // Taken over while this attempt checked it, by a later one that found it abandoned (this
    // attempt ran longer than `abandoned_after`): that one seals the same bytes.
    match sealed_earlier(app, expected_key, spec, commit).await? {
        Some(blob) => Ok(blob),
        None => Err(in_progress(expected_key)),
    }
}

/// Where a commit moves its slot's object while checking it: beside the slot, named by when
/// (milliseconds since 1970) and by the attempt, so that another attempt can tell a live check
/// from one that died (see [`moved_earlier`]).
fn pending_key(slot_key: &str, at: DateTime<Utc>) -> String {
    format!(
        "{slot_key}{PENDING}{}-{}",
        at.timestamp_millis(),
        Uuid::new_v4()
    )
}

const PENDING: &str = ".pending-";

/// How long a check of an object of at most `max_bytes` may take before its pending object is
/// taken as abandoned: two minutes (longer than the client's 60 s request timeout, after which
/// it retries), plus a second per 10 MB (a store read at 10 MB/s).
fn abandoned_after(max_bytes: u64) -> chrono::Duration {
    secs(120 + max_bytes / 10_000_000)
}

/// What became of a slot's object that another attempt of the commit moved.
enum Moved {
    /// Checked and sealed.
    Sealed(BlobDescriptor),
    /// Being checked now.
    Checking,
    /// Left pending by an attempt that stopped before sealing it (its process died): this
    /// attempt checks it instead.
    Abandoned(String),
    /// Nowhere: nothing was uploaded.
    Nothing,
}

fn in_progress(slot_key: &str) -> AppError {
    AppError::new(
        ErrorCode::InProgress,
        format!("another attempt of this commit is checking the object of {slot_key}"),
    )
}

fn nothing_uploaded(key: &str) -> AppError {
    AppError::new(
        ErrorCode::InvalidTensor,
        format!("nothing was uploaded to {key}"),
    )
}

/// A commit that finds nothing in its slot: an earlier attempt moved the object. That attempt
/// may have sealed it and then failed to record it (the database failed, or the process died);
/// it may still be checking it (a client retried while its first attempt ran: this one is told
/// to retry, not that nothing was uploaded); or it may have died while checking, and its pending
/// object (of the declared size) is taken over.
async fn moved_earlier(
    app: &App,
    slot_key: &str,
    spec: &TensorSpec,
    commit: &CommitRequest,
) -> ApiResult<Moved> {
    // Listed before the sealed key is looked for: an attempt's pending object goes only once its
    // sealed key holds the bytes (a rename, or on S3 a copy and then a delete), so one of the two
    // is seen.
    let dir = slot_key.rsplit_once('/').map_or("", |(dir, _)| dir);
    let prefix = format!("{slot_key}{PENDING}");
    let pending: Vec<(i64, String, u64)> = app
        .store
        .list_sizes(dir)
        .await?
        .into_iter()
        .filter_map(|(key, size)| {
            let rest = key.strip_prefix(&prefix)?;
            // Pending names of earlier versions carry no time: long abandoned.
            let ms = rest
                .split_once('-')
                .and_then(|(ms, _)| ms.parse().ok())
                .unwrap_or(0);
            Some((ms, key, size))
        })
        .collect();
    if let Some(blob) = sealed_earlier(app, slot_key, spec, commit).await? {
        return Ok(Moved::Sealed(blob));
    }
    let abandoned_before =
        Utc::now().timestamp_millis() - abandoned_after(spec.max_bytes()).num_milliseconds();
    if pending.iter().any(|(ms, _, _)| *ms > abandoned_before) {
        return Ok(Moved::Checking);
    }
    // Another size is not what this commit declares: left alone, not checked (and deleted).
    Ok(pending
        .into_iter()
        .filter(|(_, _, size)| *size == commit.size)
        .max()
        .map_or(Moved::Nothing, |(_, key, _)| Moved::Abandoned(key)))
}

/// The object an earlier attempt of this commit checked and sealed, if there is one: it was
/// checked in full before it was sealed, and no presigned URL names its key; it is read and
/// checked again all the same, and never deleted here (it may be recorded by an attempt still
/// running).
async fn sealed_earlier(
    app: &App,
    slot_key: &str,
    spec: &TensorSpec,
    commit: &CommitRequest,
) -> ApiResult<Option<BlobDescriptor>> {
    if !is_blake3_hex(&commit.blake3) {
        return Ok(None);
    }
    let sealed = sealed_key(slot_key, &commit.blake3);
    let _slot = crate::auth::object_slot(app).await?;
    let bytes = match app.store.get_bounded(&sealed, spec.max_bytes()).await {
        Ok(bytes) => bytes,
        Err(StoreError::NotFound(_) | StoreError::TooLarge { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if bytes.len() as u64 != commit.size {
        return Ok(None);
    }
    check_bytes(spec, sealed, &bytes, &commit.blake3).map(Some)
}

/// Reads the object at `key` back (at most the slot's size) and checks it against `commit`'s
/// size and hash and the slot's tensor spec; deletes it if it fails.
async fn check_stored(
    app: &App,
    key: &str,
    spec: &TensorSpec,
    commit: &CommitRequest,
) -> ApiResult<BlobDescriptor> {
    check_stored_if_there(app, key, spec, commit, Bad::Delete)
        .await?
        .ok_or_else(|| nothing_uploaded(key))
}

/// What becomes of an object that fails its check.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Bad {
    Delete,
    Keep,
}

/// [`check_stored`], with `None` when there is no object at `key`, and a bad object deleted
/// only with [`Bad::Delete`].
async fn check_stored_if_there(
    app: &App,
    key: &str,
    spec: &TensorSpec,
    commit: &CommitRequest,
    bad: Bad,
) -> ApiResult<Option<BlobDescriptor>> {
    let refuse = |e: AppError| async move {
        if bad == Bad::Delete {
            app.store.delete(key).await?;
        }
        Err(e)
    };
    // A presigned PUT is not bounded by the store: an oversized object is refused here, and
    // deleted like any other bad upload.
    let _slot = crate::auth::object_slot(app).await?;
    let bytes = match app.store.get_bounded(key, spec.max_bytes()).await {
        Ok(bytes) => bytes,
        Err(e @ StoreError::TooLarge { .. }) => return refuse(e.into()).await,
        Err(StoreError::NotFound(_)) => return Ok(None),
        // The store failed, not the upload: the object stays for a retried commit.
        Err(e) => return Err(e.into()),
    };
    if bytes.len() as u64 != commit.size {
        return refuse(AppError::new(
            ErrorCode::InvalidTensor,
            format!(
                "stored object is {} bytes, commit declared {}",
                bytes.len(),
                commit.size
            ),
        ))
        .await;
    }
    match check_bytes(spec, key.to_owned(), &bytes, &commit.blake3) {
        Ok(blob) => Ok(Some(blob)),
        Err(e) => refuse(e).await,
    }
}

/// `POST /v1/miner/tasks/{task_id}/output/commit?lease=…`: after a presigned upload.
#[utoipa::path(post, path = "/v1/miner/tasks/{task_id}/output/commit", tag = "miner",
    params(("task_id" = i64, Path, description = "Task"), UploadQuery),
    request_body = CommitRequest,
    responses((status = 200, body = UploadResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn commit_output(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath(task_id): ApiPath<i64>,
    ApiQuery(q): ApiQuery<UploadQuery>,
    ApiJson(req): ApiJson<CommitRequest>,
) -> ApiResult<Json<UploadResponse>> {
    let (task, lease) = leased_task(&app, &caller, task_id, q.lease).await?;
    let key = task_output_key(&app, task_id, &task);
    if task.status == "done" {
        // A failed re-check would delete the hop's output.
        return recorded_output(&task, task_id, Some(&req.key), &req.blake3);
    }
    if task.status != "leased" {
        // A late upload to a re-routed hop: nobody will read it.
        app.store.delete(&key).await?;
        return Err(AppError::new(
            ErrorCode::LeaseExpired,
            format!("task {task_id} is {}: the hop was re-routed", task.status),
        ));
    }
    check_expects_output(&app, &task)?;
    let blob = accept_committed(
        &app,
        &key,
        &boundary_spec(app.config()),
        &req,
        Placement::Slot,
    )
    .await?;
    stage_output(&app, task_id, lease, blob).await
}

/// How far a sample's loss may be from the mean of its sequences' losses, relative to that
/// mean (at least 1): rounding, in the miner's f32 arithmetic, and nothing more.
const LOSS_AGREEMENT: f64 = 1e-3;

/// Largest loss a completion may report. A cross-entropy in nats is never negative and a
/// language model's starts near ln(vocabulary), about 11; PostgreSQL's `avg` over float8 keeps a
/// sum of squares, which one loss above about 1e154 overflows, failing the epoch's loss mean (and
/// with it the step to the next epoch) every time it runs.
pub const MAX_LOSS: f64 = 1e4;

/// Whether `loss` is one a completion may report.
fn loss_in_range(loss: f64) -> bool {
    (0.0..=MAX_LOSS).contains(&loss)
}

/// `POST /v1/miner/tasks/{task_id}/complete`: finish a hop and route the sample on.
#[utoipa::path(post, path = "/v1/miner/tasks/{task_id}/complete", tag = "miner",
    params(("task_id" = i64, Path, description = "Task")),
    request_body = CompleteRequest,
    responses((status = 200, body = CompleteResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn complete(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath(task_id): ApiPath<i64>,
    ApiJson(req): ApiJson<CompleteRequest>,
) -> ApiResult<Json<CompleteResponse>> {
    let cfg = app.config();
    let mut tx = app.db.begin().await?;
    let task = lock_task(&mut tx, app.run.id, task_id).await?;
    check_lease(&task, &caller, req.lease, task_id)?;
    if task.status == "done" {
        // A retry of a completion that already went through.
        let same = match (&task.output, &req.output) {
            (Some(stored), Some(sent)) => serde_json::from_value::<BlobDescriptor>(stored.clone())
                .map(|b| b.blake3 == sent.blake3)
                .unwrap_or(false),
            (None, None) => true,
            _ => false,
        };
        if !same {
            return Err(AppError::new(
                ErrorCode::Conflict,
                format!("task {task_id} was completed with a different output"),
            ));
        }
        // The first answer's, not the sample's state now: a later hop may have finished it.
        return Ok(Json(CompleteResponse {
            task_id,
            next_task_id: task.next_task_id,
            sample_done: finishes_sample(task.stage, task.direction, cfg.stages),
        }));
    }
    if task.status != "leased" {
        return Err(AppError::new(
            ErrorCode::LeaseExpired,
            format!("task {task_id} is {}: the hop was re-routed", task.status),
        ));
    }
    // Shared: waits for an end of the miner's epoch in flight (`close_epoch` takes the hops,
    // then this row), after which no hop of the epoch completes.
    let ended: Option<Option<i64>> = sqlx::query_scalar(
        "SELECT ended_epoch FROM miners WHERE run_id = $1 AND hotkey = $2 FOR SHARE",
    )
    .bind(app.run.id)
    .bind(&caller.ss58)
    .fetch_optional(&mut *tx)
    .await?;
    if ended.flatten() == Some(task.epoch as i64) {
        return Err(AppError::new(
            ErrorCode::LeaseExpired,
            format!(
                "task {task_id}: your work in epoch {} has ended; the hop is moved",
                task.epoch
            ),
        ));
    }
    // A hop of a sample that is no longer in flight (abandoned when its epoch ended: a hop routed
    // by a completion that raced with `next_epoch` stays open until the next sweep) moves
    // nothing on; completing it revived the sample after its epoch's loss mean was stored.
    let sample: Option<String> =
        sqlx::query_scalar("SELECT status FROM samples WHERE id = $1 FOR UPDATE")
            .bind(task.sample_id)
            .fetch_optional(&mut *tx)
            .await?;
    if !matches!(sample.as_deref(), Some("forward" | "backward")) {
        return Err(AppError::new(
            ErrorCode::LeaseExpired,
            format!(
                "task {task_id}: its sample is {}; the hop is closed",
                sample.as_deref().unwrap_or("gone")
            ),
        ));
    }
    let last = task.stage + 1 == cfg.stages;
    let is_last_forward = last && task.direction == Direction::Forward;
    let needs_output = expects_output(task.direction, task.stage, cfg.stages);
    let output = if needs_output {
        let staged = task
            .staged
            .clone()
            .and_then(|v| serde_json::from_value::<BlobDescriptor>(v).ok())
            .ok_or_else(|| {
                AppError::new(
                    ErrorCode::BadRequest,
                    format!("task {task_id} has no uploaded output: upload it first"),
                )
            })?;
        match &req.output {
            Some(o) if o.key == staged.key && o.blake3 == staged.blake3 => Some(staged),
            _ => {
                return Err(AppError::new(
                    ErrorCode::BadRequest,
                    "output does not match the uploaded object",
                ));
            }
        }
    } else {
        None
    };
    if is_last_forward && !req.loss.is_some_and(loss_in_range) {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            format!("the last stage's forward must report a loss from 0 to {MAX_LOSS}"),
        ));
    }
    if let Some(seq) = &req.sequence_losses
        && (seq.len() > cfg.micro_batch as usize || !seq.iter().copied().all(loss_in_range))
    {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            format!("sequence_losses: at most micro_batch values, each from 0 to {MAX_LOSS}"),
        ));
    }
    // Every sequence has `seq_len` tokens, so the sample's mean token loss is the mean of its
    // sequences' losses. CLASP fits the first and a replay checks the second: a loss that
    // disagrees with its own sequences would pass the replay and still steer CLASP.
    if let (Some(loss), Some(seq)) = (req.loss, &req.sequence_losses)
        && !seq.is_empty()
    {
        let mean = seq.iter().sum::<f64>() / seq.len() as f64;
        if (loss - mean).abs() > LOSS_AGREEMENT * mean.abs().max(1.0) {
            return Err(AppError::new(
                ErrorCode::BadRequest,
                format!("loss {loss} is not the mean of sequence_losses ({mean})"),
            ));
        }
    }
    if req.weights_digest.len() > 128 {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            "weights_digest too long",
        ));
    }
    let output_json = output
        .as_ref()
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
    sqlx::query(
        "UPDATE tasks SET status = 'done', output = $2, inner_step = $3, weights_digest = $4,
             compute_ms = $5, completed_at = now() WHERE id = $1",
    )
    .bind(task_id)
    .bind(&output_json)
    .bind(req.inner_step.min(i64::MAX as u64) as i64)
    .bind(&req.weights_digest)
    .bind(req.compute_ms.map(|m| m.min(i64::MAX as u64) as i64))
    .execute(&mut *tx)
    .await?;
    if let Some(o) = &output {
        sqlx::query(
            "UPDATE epochs SET wire_bytes = wire_bytes + $3 WHERE run_id = $1 AND epoch = $2",
        )
        .bind(app.run.id)
        .bind(task.epoch as i64)
        .bind(o.size as i64)
        .execute(&mut *tx)
        .await?;
    }
    let mut next_task_id = None;
    let mut sample_done = false;
    match task.direction {
        Direction::Forward if !last => {
            next_task_id = route_forward(
                &mut tx,
                &app,
                &task,
                task.stage + 1,
                output_json.clone(),
                None,
            )
            .await?;
        }
        Direction::Forward => {
            sqlx::query(
                "UPDATE samples SET loss = $2, sequence_losses = $3, status = 'backward' WHERE id = $1",
            )
            .bind(task.sample_id)
            .bind(req.loss)
            .bind(req.sequence_losses.clone())
            .execute(&mut *tx)
            .await?;
            if task.stage == 0 {
                finish_sample(&mut tx, &app, task.sample_id, task.epoch).await?;
                sample_done = true;
            } else {
                next_task_id =
                    route_backward(&mut tx, &app, &task, task.stage - 1, output_json.clone())
                        .await?;
            }
        }
        Direction::Backward if task.stage > 0 => {
            next_task_id =
                route_backward(&mut tx, &app, &task, task.stage - 1, output_json.clone()).await?;
        }
        Direction::Backward => {
            finish_sample(&mut tx, &app, task.sample_id, task.epoch).await?;
            sample_done = true;
        }
    }
    debug_assert_eq!(
        sample_done,
        finishes_sample(task.stage, task.direction, cfg.stages),
        "a retried completion answers from finishes_sample"
    );
    tx.commit().await?;
    metrics::counter!("iota_hops_completed_total", "direction" => task.direction.as_str())
        .increment(1);
    Ok(Json(CompleteResponse {
        task_id,
        next_task_id,
        sample_done,
    }))
}

/// Whether completing a hop of `stage` in `direction` finishes its sample: the backward pass
/// reaching stage 0, or the forward of a model in one stage (which has no backward hop).
fn finishes_sample(stage: u32, direction: Direction, stages: u32) -> bool {
    stage == 0 && (direction == Direction::Backward || stage + 1 == stages)
}

async fn finish_sample(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    sample_id: i64,
    epoch: u64,
) -> ApiResult<()> {
    sqlx::query("UPDATE samples SET status = 'done', completed_at = now() WHERE id = $1")
        .bind(sample_id)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "UPDATE epochs SET samples_completed = samples_completed + 1 WHERE run_id = $1 AND epoch = $2",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .execute(&mut **tx)
    .await?;
    metrics::counter!("iota_samples_completed_total").increment(1);
    Ok(())
}

/// Routes a forward hop of the sample to a miner of `stage`, drawn by throughput. With no miner
/// on that stage the sample is abandoned. `exclude` keeps a re-route off the miner that failed.
pub(crate) async fn route_forward(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    from: &LeasedTask,
    stage: u32,
    input: Option<serde_json::Value>,
    exclude: Option<&str>,
) -> ApiResult<Option<i64>> {
    route_forward_sample(
        tx,
        app,
        from.epoch,
        from.sample_id,
        stage,
        0,
        input,
        exclude,
    )
    .await
}

/// Routes a backward hop to the miner that ran the sample's forward at `stage` (it holds the
/// activation cache). If that miner is gone, or has ended its epoch, the sample is abandoned.
async fn route_backward(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    from: &LeasedTask,
    stage: u32,
    grad: Option<serde_json::Value>,
) -> ApiResult<Option<i64>> {
    sqlx::query("UPDATE samples SET status = 'backward' WHERE id = $1")
        .bind(from.sample_id)
        .execute(&mut **tx)
        .await?;
    let miner: Option<String> = sqlx::query_scalar(
        "SELECT t.miner FROM tasks t JOIN miners m ON m.run_id = t.run_id AND m.hotkey = t.miner
         WHERE t.sample_id = $1 AND t.stage = $2 AND t.direction = 'forward' AND t.status = 'done'
           AND m.status = 'active' AND m.ended_epoch IS DISTINCT FROM t.epoch",
    )
    .bind(from.sample_id)
    .bind(stage as i32)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(miner) = miner else {
        abandon_sample(
            tx,
            from.sample_id,
            "the pathway's miner left, or ended its epoch, before its backward",
        )
        .await?;
        return Ok(None);
    };
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, attempt, miner, status, input,
             leased_until)
         VALUES ($1, $2, $3, $4, 'backward', 0, $5, 'pending', $6, now() + make_interval(secs => $7))
         ON CONFLICT (sample_id, stage, direction, attempt) DO UPDATE SET attempt = tasks.attempt
         RETURNING id",
    )
    .bind(app.run.id)
    .bind(from.epoch as i64)
    .bind(from.sample_id)
    .bind(stage as i32)
    .bind(&miner)
    .bind(grad)
    .bind(pickup_s(app.config()) as f64)
    .fetch_one(&mut **tx)
    .await?;
    Ok(Some(id))
}

/// Weight of a miner's pseudo-gradient: its completed hops this epoch that updated its
/// gradients: every backward hop, and the last stage's forward hops (the last stage runs its
/// backward in the same hop).
pub(crate) async fn backward_work<'e, E: sqlx::PgExecutor<'e>>(
    db: E,
    app: &App,
    epoch: u64,
    miner: &str,
) -> ApiResult<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM tasks WHERE run_id = $1 AND epoch = $2 AND miner = $3
           AND status = 'done' AND (direction = 'backward' OR stage = $4)",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(miner)
    .bind(app.config().stages as i32 - 1)
    .fetch_one(db)
    .await?)
}

fn pg_key(app: &App, epoch: u64, stage: u32, partition: u32, miner: &str) -> String {
    format!(
        "runs/{}/epoch-{epoch}/pseudo-gradients/s{stage}/p{partition}/{miner}.safetensors",
        app.run.id
    )
}

/// Checks that a pseudo-gradient upload to `stage` (the caller's) fits the current phase and the
/// miner's work; returns the slot key and the spec.
async fn pg_slot(
    app: &App,
    caller: &Caller,
    stage: u32,
    epoch: u64,
    partition: u32,
) -> ApiResult<(String, TensorSpec)> {
    let now = run_now(&app.db, app.run.id).await?;
    if now.epoch != epoch || now.phase != Phase::Uploading {
        return Err(AppError::new(
            ErrorCode::WrongPhase,
            format!(
                "pseudo-gradients of epoch {epoch} are taken in its uploading phase; the run is in epoch {} {}",
                now.epoch,
                now.phase.as_str()
            ),
        ));
    }
    let range = app
        .config()
        .partition_range(stage, partition)
        .ok_or_else(|| {
            AppError::new(
                ErrorCode::NotFound,
                format!("stage {stage} has no partition {partition}"),
            )
        })?;
    may_contribute(app, caller, epoch).await?;
    Ok((
        pg_key(app, epoch, stage, partition, &caller.ss58),
        TensorSpec::Partition {
            len: range.end - range.start,
        },
    ))
}

/// Whether the caller has a pseudo-gradient to give for `epoch`: gradient work in it, by this
/// process.
async fn may_contribute(app: &App, caller: &Caller, epoch: u64) -> ApiResult<()> {
    let work = backward_work(&app.db, app, epoch, &caller.ss58).await?;
    if work == 0 {
        return Err(AppError::new(
            ErrorCode::Conflict,
            "no completed backward pass this epoch: there is nothing to contribute",
        ));
    }
    let ended_without_upload: bool = sqlx::query_scalar(
        "SELECT m.ended_epoch IS NOT DISTINCT FROM $3
             AND NOT EXISTS (SELECT 1 FROM pseudo_gradients g WHERE g.run_id = m.run_id
                               AND g.epoch = $3 AND g.miner = m.hotkey)
         FROM miners m WHERE m.run_id = $1 AND m.hotkey = $2",
    )
    .bind(app.run.id)
    .bind(&caller.ss58)
    .bind(epoch as i64)
    .fetch_optional(&app.db)
    .await?
    .unwrap_or(false);
    if ended_without_upload {
        return Err(AppError::new(
            ErrorCode::Conflict,
            format!(
                "your work in epoch {epoch} ended when a new process registered: its hops were \
                 done by an earlier one, and no pseudo-gradient is taken for them"
            ),
        ));
    }
    Ok(())
}

/// `POST /v1/miner/epochs/{epoch}/pseudo-gradients/reserve`: before the uploading phase's
/// deadline, hold the phase open for the caller's partitions. While a miner that reserved has not
/// uploaded every partition, the phase goes on past its deadline, for at most one more phase
/// length, so that an upload that started in time is not lost to the deadline. Retrying is
/// harmless.
#[utoipa::path(post, path = "/v1/miner/epochs/{epoch}/pseudo-gradients/reserve", tag = "miner",
    params(("epoch" = u64, Path, description = "Epoch")),
    responses((status = 200, body = ReservationResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn reserve_pg(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
) -> ApiResult<Json<ReservationResponse>> {
    miner_stage(&app.db, &app, &caller).await?;
    may_contribute(&app, &caller, epoch).await?;
    let mut tx = app.db.begin().await?;
    // Atomic with the switch to merging, which counts the reservations again under its
    // exclusive lock.
    crate::driver::phase_lock_shared(&mut tx, app.run.id).await?;
    let now = run_now(&mut *tx, app.run.id).await?;
    let at = Utc::now();
    // A retry of a reservation made in time (its answer lost) holds as the first did.
    let held: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM upload_reservations
                        WHERE run_id = $1 AND epoch = $2 AND miner = $3)",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(&caller.ss58)
    .fetch_one(&mut *tx)
    .await?;
    if now.epoch != epoch || now.phase != Phase::Uploading || (at >= now.phase_deadline && !held) {
        return Err(AppError::new(
            ErrorCode::WrongPhase,
            format!(
                "uploads of epoch {epoch} are reserved before its uploading phase's deadline; \
                 the run is in epoch {} {}",
                now.epoch,
                now.phase.as_str()
            ),
        ));
    }
    sqlx::query(
        "INSERT INTO upload_reservations (run_id, epoch, miner, reserved_at)
         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(&caller.ss58)
    .bind(at)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Json(ReservationResponse {
        epoch,
        holds_until_ms: reservations_hold_until(app.config(), now.phase_deadline)
            .timestamp_millis(),
    }))
}

/// Records a pseudo-gradient partition. Atomic with phase changes: the shared advisory lock
/// makes a commit land wholly before the switch to merging (and count) or after it (refused).
/// The miner's work in the epoch ends first (see [`close_epoch`]), so the merge weight counted
/// after it is final: every partition carries the same one.
async fn record_pg(
    app: &App,
    caller: &Caller,
    epoch: u64,
    stage: u32,
    partition: u32,
    blob: BlobDescriptor,
) -> ApiResult<Json<UploadResponse>> {
    let mut tx = app.db.begin().await?;
    crate::driver::phase_lock_shared(&mut tx, app.run.id).await?;
    let now = run_now(&mut *tx, app.run.id).await?;
    if now.epoch != epoch || now.phase != Phase::Uploading {
        drop(tx);
        delete_unless_recorded(app, SealedIn::PseudoGradients, &blob.key).await?;
        return Err(AppError::new(
            ErrorCode::WrongPhase,
            "the uploading phase ended while this partition was in flight",
        ));
    }
    close_epoch(&mut tx, app, &caller.ss58, epoch).await?;
    let weight = backward_work(&mut *tx, app, epoch, &caller.ss58).await? as f64;
    let value = serde_json::to_value(&blob)
        .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
    let existing: Option<String> = sqlx::query_scalar(
        "INSERT INTO pseudo_gradients (run_id, epoch, stage, partition, miner, blob, blake3, weight)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
         ON CONFLICT (run_id, epoch, stage, partition, miner) DO UPDATE SET weight = pseudo_gradients.weight
         RETURNING blake3",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(stage as i32)
    .bind(partition as i32)
    .bind(&caller.ss58)
    .bind(value)
    .bind(&blob.blake3)
    .bind(weight)
    .fetch_optional(&mut *tx)
    .await?;
    if existing.as_deref() != Some(blob.blake3.as_str()) {
        drop(tx);
        // Sealed under its own hash, so not the accepted object's key.
        app.store.delete(&blob.key).await?;
        return Err(AppError::new(
            ErrorCode::Conflict,
            "a different pseudo-gradient was already accepted for this partition",
        ));
    }
    tx.commit().await?;
    Ok(Json(UploadResponse { blob }))
}

/// `PUT /v1/miner/epochs/{epoch}/pseudo-gradients/{partition}?blake3=…`.
#[utoipa::path(put, path = "/v1/miner/epochs/{epoch}/pseudo-gradients/{partition}", tag = "miner",
    params(("epoch" = u64, Path, description = "Epoch"), ("partition" = u32, Path, description = "Partition"), UploadQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = UploadResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn upload_pg(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath((Bigint(epoch), partition)): ApiPath<(Bigint, u32)>,
    ApiQuery(q): ApiQuery<UploadQuery>,
    body: Bytes,
) -> ApiResult<Json<UploadResponse>> {
    let stage = miner_stage(&app.db, &app, &caller).await?;
    // Before the phase check: a retry whose first attempt was recorded (its answer lost) is
    // answered from the record after the phase has changed too.
    if let Some(same) =
        already_accepted_pg(&app, &caller, epoch, stage, partition, &q.blake3).await?
    {
        return Ok(Json(UploadResponse { blob: same }));
    }
    let (key, spec) = pg_slot(&app, &caller, stage, epoch, partition).await?;
    to_completion(async move {
        let blob = accept_upload(&app, key, &spec, body, &q.blake3, Placement::Sealed).await?;
        record_pg(&app, &caller, epoch, stage, partition, blob).await
    })
    .await
}

/// Runs a stored upload's store-then-record steps in a task of its own. A client that closes
/// its connection makes the server drop the handler with whatever it awaits: between the two
/// steps, that left the stored object without its row, and nothing then refused the next upload
/// to the slot (each left another object until the epoch was collected).
async fn to_completion<T: Send + 'static>(
    steps: impl std::future::Future<Output = ApiResult<T>> + Send + 'static,
) -> ApiResult<T> {
    tokio::spawn(steps)
        .await
        .map_err(|e| AppError::new(ErrorCode::Internal, format!("upload task: {e}")))?
}

async fn already_accepted_pg(
    app: &App,
    caller: &Caller,
    epoch: u64,
    stage: u32,
    partition: u32,
    blake3: &str,
) -> ApiResult<Option<BlobDescriptor>> {
    let slot = (epoch, stage, partition);
    already_recorded(app, SealedIn::PseudoGradients, &caller.ss58, slot, blake3).await
}

/// The object `who` has recorded in `table` for this slot if it has this hash (a retried
/// submission, answered from the record), or a conflict if it has another; `None` if none yet.
async fn already_recorded(
    app: &App,
    table: SealedIn,
    who: &str,
    (epoch, stage, partition): (u64, u32, u32),
    blake3: &str,
) -> ApiResult<Option<BlobDescriptor>> {
    let (sql, conflict) = match table {
        SealedIn::PseudoGradients => (
            "SELECT blob, blake3 FROM pseudo_gradients
             WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4 AND miner = $5",
            "a different pseudo-gradient was already accepted for this partition",
        ),
        SealedIn::MergeResults => (
            "SELECT blob, blake3 FROM merge_results
             WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4 AND submitter = $5",
            "you already submitted a different result for this partition",
        ),
    };
    let row: Option<(serde_json::Value, String)> = sqlx::query_as(sql)
        .bind(app.run.id)
        .bind(epoch as i64)
        .bind(stage as i32)
        .bind(partition as i32)
        .bind(who)
        .fetch_optional(&app.db)
        .await?;
    match row {
        None => Ok(None),
        Some((blob, hash)) if hash == blake3 => serde_json::from_value(blob)
            .map(Some)
            .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string())),
        Some(_) => Err(AppError::new(ErrorCode::Conflict, conflict)),
    }
}

/// `POST /v1/miner/epochs/{epoch}/pseudo-gradients/{partition}/presign`.
#[utoipa::path(post, path = "/v1/miner/epochs/{epoch}/pseudo-gradients/{partition}/presign", tag = "miner",
    params(("epoch" = u64, Path, description = "Epoch"), ("partition" = u32, Path, description = "Partition")),
    request_body = PresignRequest,
    responses((status = 200, body = PresignResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn presign_pg(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath((Bigint(epoch), partition)): ApiPath<(Bigint, u32)>,
    ApiJson(req): ApiJson<PresignRequest>,
) -> ApiResult<Json<PresignResponse>> {
    let stage = miner_stage(&app.db, &app, &caller).await?;
    let (key, spec) = pg_slot(&app, &caller, stage, epoch, partition).await?;
    check_presign_size(&req, &spec)?;
    presign(&app, key).await
}

/// `POST /v1/miner/epochs/{epoch}/pseudo-gradients/{partition}/commit`.
#[utoipa::path(post, path = "/v1/miner/epochs/{epoch}/pseudo-gradients/{partition}/commit", tag = "miner",
    params(("epoch" = u64, Path, description = "Epoch"), ("partition" = u32, Path, description = "Partition")),
    request_body = CommitRequest,
    responses((status = 200, body = UploadResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn commit_pg(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath((Bigint(epoch), partition)): ApiPath<(Bigint, u32)>,
    ApiJson(req): ApiJson<CommitRequest>,
) -> ApiResult<Json<UploadResponse>> {
    let stage = miner_stage(&app.db, &app, &caller).await?;
    // Before the phase check, as in `upload_pg`.
    if let Some(same) =
        already_accepted_pg(&app, &caller, epoch, stage, partition, &req.blake3).await?
    {
        return Ok(Json(UploadResponse { blob: same }));
    }
    let (key, spec) = pg_slot(&app, &caller, stage, epoch, partition).await?;
    to_completion(async move {
        let blob = accept_committed(&app, &key, &spec, &req, Placement::Sealed).await?;
        record_pg(&app, &caller, epoch, stage, partition, blob).await
    })
    .await
}

/// `GET /v1/miner/stages/{stage}/weights?before=…`: as the public route, with a download URL
/// for each partition when the store presigns (the signed way to the bytes of the weights).
#[utoipa::path(get, path = "/v1/miner/stages/{stage}/weights", tag = "miner",
    params(("stage" = u32, Path, description = "Stage"), views::WeightsQuery),
    responses((status = 200, body = StageWeights), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn weights(
    State(app): State<App>,
    ApiPath(stage): ApiPath<u32>,
    ApiQuery(q): ApiQuery<views::WeightsQuery>,
) -> ApiResult<Json<StageWeights>> {
    Ok(Json(
        views::stage_weights(&app, stage, q.before.map(|b| b.0)).await?,
    ))
}

/// `GET /v1/miner/merges`: the partitions the caller owns in the current merging round and has
/// not yet submitted.
#[utoipa::path(get, path = "/v1/miner/merges", tag = "miner",
    responses((status = 200, body = MergeAssignments), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn merges(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<MergeAssignments>> {
    let now = run_now(&app.db, app.run.id).await?;
    let mut assignments = Vec::new();
    if now.phase == Phase::Merging {
        let rows = sqlx::query(
            "SELECT p.stage, p.partition, p.contributions FROM partition_owners o
             JOIN partitions p ON p.run_id = o.run_id AND p.epoch = o.epoch AND p.stage = o.stage
                  AND p.partition = o.partition
             WHERE o.run_id = $1 AND o.epoch = $2 AND o.miner = $3
               AND p.state IN ('open', 'disputed')
               AND NOT EXISTS (SELECT 1 FROM merge_results r WHERE r.run_id = o.run_id
                   AND r.epoch = o.epoch AND r.stage = o.stage AND r.partition = o.partition
                   AND r.submitter = o.miner)
             ORDER BY p.stage, p.partition",
        )
        .bind(app.run.id)
        .bind(now.epoch as i64)
        .bind(&caller.ss58)
        .fetch_all(&app.db)
        .await?;
        for row in rows {
            let stage = row.try_get::<i32, _>("stage")? as u32;
            let partition = row.try_get::<i32, _>("partition")? as u32;
            let range = app
                .config()
                .partition_range(stage, partition)
                .ok_or_else(|| AppError::new(ErrorCode::Internal, "partition out of range"))?;
            let mut contributions: Vec<MergeContribution> =
                serde_json::from_value(row.try_get("contributions")?)
                    .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
            for c in &mut contributions {
                c.blob.url = app.store.presign(http::Method::GET, &c.blob.key).await?;
            }
            let base = merge_base(&app, now.epoch, stage, partition).await?;
            assignments.push(MergeAssignment {
                epoch: now.epoch,
                stage,
                partition,
                start: range.start,
                end: range.end,
                contributions,
                base,
                deadline_ms: now.phase_deadline.timestamp_millis(),
            });
        }
    }
    Ok(Json(MergeAssignments {
        assignments,
        status: views::epoch_status(&app).await?,
    }))
}

/// The latest accepted merge of a partition from an epoch before `epoch`: what a merge of
/// `epoch` starts from (`None`: the initial weights).
pub(crate) async fn merge_base(
    app: &App,
    epoch: u64,
    stage: u32,
    partition: u32,
) -> ApiResult<Option<BlobDescriptor>> {
    let accepted: Option<serde_json::Value> = sqlx::query_scalar(
        "SELECT accepted FROM partitions
         WHERE run_id = $1 AND stage = $2 AND partition = $3 AND epoch < $4 AND state = 'accepted'
         ORDER BY epoch DESC LIMIT 1",
    )
    .bind(app.run.id)
    .bind(stage as i32)
    .bind(partition as i32)
    .bind(epoch as i64)
    .fetch_optional(&app.db)
    .await?;
    let Some(accepted) = accepted else {
        return Ok(None);
    };
    let mut blob: BlobDescriptor = serde_json::from_value(accepted)
        .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
    blob.url = app.store.presign(http::Method::GET, &blob.key).await?;
    Ok(Some(blob))
}

fn merged_key(app: &App, epoch: u64, stage: u32, partition: u32, who: &str) -> String {
    format!(
        "runs/{}/epoch-{epoch}/merged/s{stage}/p{partition}/{who}.safetensors",
        app.run.id
    )
}

/// Checks that `who` may submit a merge of this partition now; returns the slot.
pub(crate) async fn merge_slot(
    app: &App,
    who: &str,
    as_validator: bool,
    epoch: u64,
    stage: u32,
    partition: u32,
) -> ApiResult<(String, TensorSpec)> {
    let now = run_now(&app.db, app.run.id).await?;
    if now.epoch != epoch || now.phase != Phase::Merging {
        return Err(AppError::new(
            ErrorCode::WrongPhase,
            format!(
                "merges of epoch {epoch} are taken in its merging phase; the run is in epoch {} {}",
                now.epoch,
                now.phase.as_str()
            ),
        ));
    }
    let range = app
        .config()
        .partition_range(stage, partition)
        .ok_or_else(|| {
            AppError::new(
                ErrorCode::NotFound,
                format!("stage {stage} has no partition {partition}"),
            )
        })?;
    if as_validator {
        let hotkey = who.strip_prefix("validator:").unwrap_or(who);
        let slot = (epoch as i64, stage as i32, partition as i32);
        if crate::driver::has_stake(&app.db, app.run.id, hotkey, slot).await? {
            return Err(crate::driver::interested_validator(stage, partition));
        }
    } else {
        let owner: Option<i32> = sqlx::query_scalar(
            "SELECT round FROM partition_owners WHERE run_id = $1 AND epoch = $2 AND stage = $3
               AND partition = $4 AND miner = $5",
        )
        .bind(app.run.id)
        .bind(epoch as i64)
        .bind(stage as i32)
        .bind(partition as i32)
        .bind(who)
        .fetch_optional(&app.db)
        .await?;
        if owner.is_none() {
            return Err(AppError::new(
                ErrorCode::Forbidden,
                format!("you do not own stage {stage} partition {partition} this epoch"),
            ));
        }
    }
    Ok((
        merged_key(app, epoch, stage, partition, who),
        TensorSpec::Merged {
            len: range.end - range.start,
        },
    ))
}

/// `PUT /v1/miner/epochs/{epoch}/merges/{stage}/{partition}?blake3=…`: an owner's merged result.
#[utoipa::path(put, path = "/v1/miner/epochs/{epoch}/merges/{stage}/{partition}", tag = "miner",
    params(("epoch" = u64, Path, description = "Epoch"), ("stage" = u32, Path, description = "Stage"),
        ("partition" = u32, Path, description = "Partition"), UploadQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = UploadResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn upload_merge(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath((Bigint(epoch), stage, partition)): ApiPath<(Bigint, u32, u32)>,
    ApiQuery(q): ApiQuery<UploadQuery>,
    body: Bytes,
) -> ApiResult<Json<UploadResponse>> {
    upload_merge_as(
        &app,
        &caller.ss58,
        false,
        (epoch, stage, partition),
        body,
        &q.blake3,
    )
    .await
}

/// Stores a merged partition uploaded through the orchestrator and records it as `who`'s result
/// (an owner, or `validator:<ss58>` for a validator's own merge).
pub(crate) async fn upload_merge_as(
    app: &App,
    who: &str,
    as_validator: bool,
    (epoch, stage, partition): (u64, u32, u32),
    body: Bytes,
    blake3: &str,
) -> ApiResult<Json<UploadResponse>> {
    // Before the phase check: a retry whose first attempt was recorded (its answer lost) is
    // answered from the record after the phase has changed too.
    if let Some(same) = already_merged(app, who, (epoch, stage, partition), blake3).await? {
        return Ok(Json(UploadResponse { blob: same }));
    }
    let (key, spec) = merge_slot(app, who, as_validator, epoch, stage, partition).await?;
    let (app, who, blake3) = (app.clone(), who.to_owned(), blake3.to_owned());
    to_completion(async move {
        let blob = accept_upload(&app, key, &spec, body, &blake3, Placement::Sealed).await?;
        crate::driver::record_merge_result(&app, &who, epoch, stage, partition, blob).await
    })
    .await
}

/// `who`'s recorded result for this partition if it has this hash (a retried submission), or a
/// conflict if it has another; `None` if there is none yet. Checked before the store is touched.
async fn already_merged(
    app: &App,
    who: &str,
    slot: (u64, u32, u32),
    blake3: &str,
) -> ApiResult<Option<BlobDescriptor>> {
    already_recorded(app, SealedIn::MergeResults, who, slot, blake3).await
}

/// `POST /v1/miner/epochs/{epoch}/merges/{stage}/{partition}/presign`.
#[utoipa::path(post, path = "/v1/miner/epochs/{epoch}/merges/{stage}/{partition}/presign", tag = "miner",
    params(("epoch" = u64, Path, description = "Epoch"), ("stage" = u32, Path, description = "Stage"),
        ("partition" = u32, Path, description = "Partition")),
    request_body = PresignRequest,
    responses((status = 200, body = PresignResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn presign_merge(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath((Bigint(epoch), stage, partition)): ApiPath<(Bigint, u32, u32)>,
    ApiJson(req): ApiJson<PresignRequest>,
) -> ApiResult<Json<PresignResponse>> {
    let (key, spec) = merge_slot(&app, &caller.ss58, false, epoch, stage, partition).await?;
    check_presign_size(&req, &spec)?;
    // Once a result is recorded nothing more is taken: the same bytes are answered from the
    // record by the commit, other bytes are a conflict.
    let slot = (epoch, stage, partition);
    if already_merged(&app, &caller.ss58, slot, &req.blake3)
        .await?
        .is_some()
    {
        return Err(AppError::new(
            ErrorCode::Conflict,
            "your result for this partition is already recorded",
        ));
    }
    presign(&app, key).await
}

/// `POST /v1/miner/epochs/{epoch}/merges/{stage}/{partition}/commit`.
#[utoipa::path(post, path = "/v1/miner/epochs/{epoch}/merges/{stage}/{partition}/commit", tag = "miner",
    params(("epoch" = u64, Path, description = "Epoch"), ("stage" = u32, Path, description = "Stage"),
        ("partition" = u32, Path, description = "Partition")),
    request_body = CommitRequest,
    responses((status = 200, body = UploadResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn commit_merge(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath((Bigint(epoch), stage, partition)): ApiPath<(Bigint, u32, u32)>,
    ApiJson(req): ApiJson<CommitRequest>,
) -> ApiResult<Json<UploadResponse>> {
    // Before the phase check, as in `upload_merge_as`.
    if let Some(same) =
        already_merged(&app, &caller.ss58, (epoch, stage, partition), &req.blake3).await?
    {
        return Ok(Json(UploadResponse { blob: same }));
    }
    let (key, spec) = merge_slot(&app, &caller.ss58, false, epoch, stage, partition).await?;
    to_completion(async move {
        let blob = accept_committed(&app, &key, &spec, &req, Placement::Sealed).await?;
        crate::driver::record_merge_result(&app, &caller.ss58, epoch, stage, partition, blob).await
    })
    .await
}

/// The epoch, stage and partition of a merged result's key below its run's prefix
/// (`epoch-{e}/merged/s{s}/p{p}/…`).
fn merged_partition_of(key: &str) -> Option<(i64, i32, i32)> {
    let rest = key.strip_prefix("epoch-")?;
    let (epoch, rest) = rest.split_once('/')?;
    let rest = rest.strip_prefix("merged/s")?;
    let (stage, rest) = rest.split_once('/')?;
    let (partition, _) = rest.strip_prefix('p')?.split_once('/')?;
    Some((
        epoch.parse().ok()?,
        stage.parse().ok()?,
        partition.parse().ok()?,
    ))
}

/// `GET /v1/blobs/{key}`: an object's bytes (for stores that do not presign).
#[utoipa::path(get, path = "/v1/blobs/{key}", tag = "miner",
    params(("key" = String, Path, description = "Object key")),
    responses((status = 200, content_type = "application/octet-stream", body = Vec<u8>), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn blob(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath(key): ApiPath<String>,
) -> ApiResult<axum::response::Response> {
    let prefix = format!("runs/{}/", app.run.id);
    let in_run = key.strip_prefix(&prefix);
    // Besides the run's own objects: its dataset's files, for every member.
    if in_run.is_none() && !crate::dataset::is_run_dataset_key(&app, &key) {
        return Err(AppError::new(
            ErrorCode::NotFound,
            format!("no object {key}"),
        ));
    }
    // An owner that could read another owner's merged result before the partition is settled
    // could submit it as its own instead of merging, and the two would agree.
    // Validators read them at any time (to settle disputes), unless they have a stake in the
    // partition themselves (a hotkey with a permit may also have joined as a miner).
    if let Some((epoch, stage, partition)) = in_run.and_then(merged_partition_of) {
        let state: Option<String> = sqlx::query_scalar(
            "SELECT state FROM partitions
             WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4",
        )
        .bind(app.run.id)
        .bind(epoch)
        .bind(stage)
        .bind(partition)
        .fetch_optional(&app.db)
        .await?;
        let unsettled = matches!(state.as_deref(), Some("open" | "disputed"));
        if unsettled
            && (!caller.permit
                || crate::driver::has_stake(
                    &app.db,
                    app.run.id,
                    &caller.ss58,
                    (epoch, stage, partition),
                )
                .await?)
        {
            return Err(AppError::new(
                ErrorCode::Forbidden,
                format!(
                    "merged results of partition {stage}/{partition} of epoch {epoch} can be \
                     read once it is settled (validators that do not own it: at any time)"
                ),
            ));
        }
    }
    // Streamed: a presigned PUT is not bounded by the store, so an object here may be larger
    // than any slot, and must not be read into memory whole.
    let (size, chunks) = app.store.get_stream(&key).await?;
    metrics::counter!("iota_download_bytes_total").increment(size);
    Ok((
        [
            (
                http::header::CONTENT_TYPE,
                "application/octet-stream".to_owned(),
            ),
            (http::header::CONTENT_LENGTH, size.to_string()),
        ],
        axum::body::Body::from_stream(chunks),
    )
        .into_response())
}

/// What separates a report's reason from the problem that confirmed it, in `bad_objects`.
const CONFIRMED: &str = "; confirmed: ";

/// The verdict on `key` if a report confirmed it already, as that report was answered.
async fn confirmed_already(
    app: &App,
    key: &str,
    task_id: i64,
) -> ApiResult<Option<BadObjectVerdict>> {
    let reason: Option<String> =
        sqlx::query_scalar("SELECT reason FROM bad_objects WHERE run_id = $1 AND key = $2")
            .bind(app.run.id)
            .bind(key)
            .fetch_optional(&app.db)
            .await?;
    Ok(reason.map(|reason| {
        let problem = reason
            .rsplit_once(CONFIRMED)
            .map_or(reason.as_str(), |(_, problem)| problem);
        BadObjectVerdict {
            confirmed: true,
            detail: format!("confirmed: {problem}; the producer's hop {task_id} failed"),
        }
    }))
}

/// `POST /v1/miner/reports/bad-object`: a consumer says an object failed its checks. The
/// orchestrator re-checks it; if it is bad, the producer's hop fails and the object is removed.
#[utoipa::path(post, path = "/v1/miner/reports/bad-object", tag = "miner",
    request_body = BadObjectReport,
    responses((status = 200, body = BadObjectVerdict), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn report_bad_object(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiJson(report): ApiJson<BadObjectReport>,
) -> ApiResult<Json<BadObjectVerdict>> {
    let row = sqlx::query(
        "SELECT id, sample_id, output FROM tasks WHERE run_id = $1 AND output->>'key' = $2",
    )
    .bind(app.run.id)
    .bind(&report.key)
    .fetch_optional(&app.db)
    .await?;
    let Some(row) = row else {
        return Ok(Json(BadObjectVerdict {
            confirmed: false,
            detail: "no hop output has this key".into(),
        }));
    };
    let task_id: i64 = row.try_get("id")?;
    let sample_id: i64 = row.try_get("sample_id")?;
    // Confirmed already (a retry whose first answer was lost, or another consumer's report):
    // answered as the first was, not from the object, which the first deleted.
    if let Some(verdict) = confirmed_already(&app, &report.key, task_id).await? {
        return Ok(Json(verdict));
    }
    let blob: BlobDescriptor = serde_json::from_value(row.try_get("output")?)
        .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
    let spec = boundary_spec(app.config());
    // Only the object's own faults confirm a report. A missing object was collected with its
    // epoch (no presigned URL deletes), and a failing store is nobody's hop's fault: neither may
    // let a reporter fail another miner's hop.
    let _slot = crate::auth::object_slot(&app).await?;
    let problem = match app.store.get_bounded(&blob.key, spec.max_bytes()).await {
        Err(e @ StoreError::TooLarge { .. }) => Some(e.to_string()),
        Err(StoreError::NotFound(_)) => {
            // Deleted by a confirmation that committed since the look above, or collected.
            let verdict = confirmed_already(&app, &report.key, task_id).await?;
            return Ok(Json(verdict.unwrap_or_else(|| BadObjectVerdict {
                confirmed: false,
                detail: "the object is gone (its epoch was collected); nothing to check".into(),
            })));
        }
        Err(e) => return Err(e.into()),
        Ok(bytes) => blob
            .check_bytes(&bytes)
            .err()
            .or_else(|| check_tensor(&bytes, &spec).err().map(|e| e.to_string())),
    };
    let Some(problem) = problem else {
        return Ok(Json(BadObjectVerdict {
            confirmed: false,
            detail: "the object checks out here; download it again".into(),
        }));
    };
    let mut tx = app.db.begin().await?;
    sqlx::query("UPDATE tasks SET status = 'failed' WHERE id = $1")
        .bind(task_id)
        .execute(&mut *tx)
        .await?;
    abandon_sample(&mut tx, sample_id, "bad object").await?;
    sqlx::query(
        "INSERT INTO bad_objects (run_id, key, reporter, reason) VALUES ($1, $2, $3, $4)
         ON CONFLICT DO NOTHING",
    )
    .bind(app.run.id)
    .bind(&report.key)
    .bind(&caller.ss58)
    .bind(format!(
        "{}{CONFIRMED}{problem}",
        report.reason.chars().take(500).collect::<String>()
    ))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    app.store.delete(&blob.key).await?;
    tracing::warn!(key = %report.key, task_id, %problem, "bad object confirmed; producer's hop failed");
    Ok(Json(BadObjectVerdict {
        confirmed: true,
        detail: format!("confirmed: {problem}; the producer's hop {task_id} failed"),
    }))
}
