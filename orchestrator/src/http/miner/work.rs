//! Leased work: polls that lease hops (and start new samples on stage 0), answered from the poll view when idle.

use axum::Json;
use axum::extract::{Request, State};
use chrono::{DateTime, Utc};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;

use sqlx::{Postgres, Row, Transaction};

use super::join::miner_stage;
use crate::app::App;
use crate::auth::{Caller, Gate, PendingUuid, SharedReplay, SignedRoutes};
use crate::domain::hops::expects_output;
use crate::error::{ApiResult, AppError};
use crate::http::views;

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

/// `POST /v1/miner/work`: lease work. Leases the caller still holds come back first (so a retried
/// poll is harmless: a miner skips task ids it is already running), then pending hops routed to
/// it (backward before forward, oldest first, since a pending backward holds a cache in the
/// miner's memory); a stage-0 miner with room then gets new samples while the epoch trains.
#[utoipa::path(post, path = "/v1/miner/work", tag = "miner",
    request_body = WorkRequest,
    responses((status = 200, body = WorkResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn work(State(app): State<App>, request: Request) -> ApiResult<Json<WorkResponse>> {
    let (caller, uuid, req) = check_poll(&app, request).await?;
    let max = i64::from(req.max_items);
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

/// The signed gate's steps, inline: this is the request every miner sends in a loop. The
/// caller, the request's id and the poll.
async fn check_poll(app: &App, request: Request) -> ApiResult<(Caller, PendingUuid, WorkRequest)> {
    let (parts, body) = request.into_parts();
    // A poll is a few bytes: read before its signature is checked, as any body that small is.
    let poll_limit = app
        .limits
        .json_body_bytes
        .min(crate::auth::MAX_UNCHECKED_BODY);
    crate::auth::check_content_length(&parts, poll_limit)?;
    let checked = crate::auth::check_caller(app, &parts)?;
    let bytes = checked.read_unchecked_body(app, body, poll_limit).await?;
    let auth = checked.with_body(&parts, &bytes);
    // Parsed while the request is still in this core's cache (the signature check waits for a
    // batch, and after it everything here would be read cold). Nothing acts on it until the
    // signature holds, and a bad body is reported only then, as behind the gate.
    let parsed: ApiResult<WorkRequest> = crate::http::extract::json_body(&parts.headers, &bytes);
    // Freed now, while in this core's cache, rather than after the batch wait (cold, and
    // perhaps on another thread).
    drop((parts, bytes));
    let (caller, uuid) = auth
        .finish(
            app,
            SignedRoutes {
                gate: Gate::Registered,
                body_limit: poll_limit,
                shared_replay: SharedReplay::ByHandler,
                uploads: false,
            },
        )
        .await?;
    let req = parsed?;
    if !(1..=MAX_WORK_ITEMS).contains(&req.max_items) {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            format!("max_items must be from 1 to {MAX_WORK_ITEMS}"),
        ));
    }
    Ok((caller, uuid, req))
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
            .bind(app.now())
            .fetch_all(&app.db)
            .await?;
        let Some(first) = rows.first() else {
            // Not a miner, or released: the full check says which.
            miner_stage(&app.db, app, caller).await?;
            continue;
        };
        let stage = first.try_get::<i32, _>("miner_stage")? as u32;
        let status = crate::status::status_from_row(first, app.now())?;
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
    UPDATE miners SET last_seen = $5
    WHERE run_id = $1 AND hotkey = $2 AND status = 'active'
      AND last_seen < $5 - interval '1 second'
), held AS (
    SELECT id, lease, leased_until, epoch, sample_id, stage, direction, input FROM tasks
    WHERE run_id = $1 AND miner = $2 AND status = 'leased' AND leased_until > $5
      AND EXISTS (SELECT 1 FROM me)
    ORDER BY id LIMIT $4
), fresh AS (
    UPDATE tasks SET status = 'leased', lease = gen_random_uuid(), leased_at = $5,
        leased_until = $5 + make_interval(secs => $3)
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
             VALUES ($1, $2, $3, 0, 'forward', $4, 'leased', gen_random_uuid(), $6,
                 $6 + make_interval(secs => $5))
             RETURNING id, lease, leased_until, epoch, sample_id, stage, direction, input",
        )
        .bind(app.run.id)
        .bind(epoch as i64)
        .bind(sample_id)
        .bind(&caller.ss58)
        .bind(cfg.lease_s as f64)
        .bind(app.now())
        .fetch_one(&mut **tx)
        .await?;
        items.push(work_item(&row, cfg.stages)?);
    }
    Ok(items)
}
