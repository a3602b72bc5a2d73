//! Leased work: polls that lease hops (and start new samples on stage 0), answered from the poll view when idle.

use axum::Json;
use axum::extract::{Request, State};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;

use sqlx::{Postgres, Transaction};

use super::join::miner_stage;
use crate::app::App;
use crate::auth::{Caller, Gate, PendingUuid, SharedReplay, SignedRoutes};
use crate::db;
use crate::domain::hops::expects_output;
use crate::error::{ApiResult, AppError};
use crate::http::views;

fn work_item(hop: db::work::Leased, stages: u32) -> ApiResult<WorkItem> {
    let direction = Direction::parse(&hop.direction)
        .ok_or_else(|| AppError::new(ErrorCode::Internal, "bad direction"))?;
    let stage = hop.stage as u32;
    let input = hop
        .input
        .map(serde_json::from_value::<BlobDescriptor>)
        .transpose()
        .map_err(|e| AppError::new(ErrorCode::Internal, format!("stored blob: {e}")))?;
    Ok(WorkItem {
        task_id: hop.id,
        lease: hop.lease,
        lease_expires_ms: hop.leased_until.timestamp_millis(),
        epoch: hop.epoch as u64,
        sample_id: hop.sample_id,
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
        let lease = (app.config().lease_s as f64, max);
        let polled = db::work::poll(&app.db, app.run.id, &caller.ss58, lease, app.now()).await?;
        let Some(polled) = polled else {
            // Not a miner, or released: the full check says which.
            miner_stage(&app.db, app, caller).await?;
            continue;
        };
        let stages = app.config().stages;
        let items = polled
            .items
            .into_iter()
            .map(|hop| work_item(hop, stages))
            .collect::<ApiResult<Vec<_>>>()?;
        return Ok((polled.stage as u32, items, polled.status));
    }
    Err(AppError::new(
        ErrorCode::Internal,
        "the miner's state changed during the poll; poll again",
    ))
}

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
    if !db::work::is_training(&mut **tx, app.run.id, epoch as i64).await? {
        return Ok(Vec::new());
    }
    // The miner's row first: two polls of one miner (on one process or two) then count its
    // samples in flight one after the other, each seeing what the other started, and a miner
    // whose work in the epoch has ended (`close_epoch`) starts none.
    let ended = db::work::lock_active_miner(&mut **tx, app.run.id, &caller.ss58).await?;
    match ended {
        Some(ended) if ended != Some(epoch as i64) => {}
        _ => return Ok(Vec::new()),
    }
    let in_flight =
        db::work::started_in_flight(&mut **tx, app.run.id, epoch as i64, &caller.ss58).await?;
    let want = room.min(i64::from(cfg.max_in_flight) - in_flight);
    if want <= 0 {
        return Ok(Vec::new());
    }
    let budget = cfg.samples_per_epoch.min(i64::MAX as u64) as i64;
    let granted =
        db::work::grant_samples(&mut **tx, app.run.id, epoch as i64, (want, budget)).await?;
    let mut items = Vec::new();
    for _ in 0..granted {
        let sample_id = db::work::start_sample(&mut **tx, app.run.id, epoch as i64).await?;
        let slot = (epoch as i64, sample_id);
        let lease = (cfg.lease_s as f64, app.now());
        let hop = db::work::lease_first_hop(&mut **tx, app.run.id, slot, &caller.ss58, lease);
        items.push(work_item(hop.await?, cfg.stages)?);
    }
    Ok(items)
}
