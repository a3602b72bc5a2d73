//! Joining the run and staying in it: registration (a stage chosen by load), heartbeats.

use axum::Json;
use axum::extract::{Extension, State};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;

use sqlx::{Postgres, Transaction};

use crate::app::App;
use crate::auth::Caller;
use crate::db;
use crate::domain::placement::{Restart, StageLoad, admit, rejoin_stage, restart_ends_work};
use crate::error::{ApiResult, AppError};
use crate::http::extract::ApiJson;
use crate::http::views;
use crate::samples::{close_epoch, run_now};

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
    check_capacity(&req.capacity)?;
    let run = app.run.id;
    let mut tx = app.db.begin().await?;
    // Serialise joins of one run so two replicas cannot both fill the same emptiest stage.
    db::locks::join_lock(&mut tx, run).await?;
    // A restart closes the miner's epoch and re-routes its hops: not while the epoch ends (its
    // re-routed hops would outlive it).
    crate::driver::phase_lock_shared(&mut tx, run).await?;
    let now = run_now(&mut *tx, run).await?;
    let (stage, work_ended) = join(&mut tx, &app, &caller, &req, now.epoch).await?;
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

fn check_capacity(cap: &Capacity) -> ApiResult<()> {
    if throughput_in_range(cap.tokens_per_s)
        && cap.device.chars().count() <= 64
        && i64::try_from(cap.memory_bytes).is_ok()
    {
        return Ok(());
    }
    Err(AppError::new(
        ErrorCode::BadRequest,
        format!(
            "capacity needs tokens_per_s from 0 to {MAX_TOKENS_PER_S:e}, a device name of at \
             most 64 characters and memory_bytes of at most {}",
            i64::MAX
        ),
    ))
}

/// Admits the caller in `epoch`, or takes it back: its stage, and whether its work in the epoch
/// has ended.
async fn join(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    caller: &Caller,
    req: &RegisterRequest,
    epoch: u64,
) -> ApiResult<(u32, bool)> {
    let run = app.run.id;
    let cap = &req.capacity;
    let existing = db::miners::member(&mut **tx, run, &caller.ss58, epoch as i64).await?;
    let loads = stage_loads(tx, app).await?;
    let Some(row) = existing else {
        let stage = admit(&loads, cap.memory_bytes)
            .map_err(|why| AppError::new(ErrorCode::Forbidden, why))?;
        let joining = joining(app, caller, cap, stage);
        db::miners::insert(&mut **tx, run, epoch as i64, joining).await?;
        tracing::info!(miner = %caller.ss58, stage, epoch, "miner joined");
        return Ok((stage, false));
    };
    let held = row.stage as u32;
    let ended = row.ended_epoch.map(|e| e as u64);
    let restart = restart_ends_work(ended, epoch, req.holds_epoch_state, row.worked);
    if restart == Restart::EndsWork {
        close_epoch(tx, app, &caller.ss58, epoch).await?;
        tracing::info!(miner = %caller.ss58, epoch, "a restarted miner sits out the rest of the epoch");
    }
    let stage = rejoin_stage(&loads, held, row.active, cap.memory_bytes);
    if stage != held {
        tracing::info!(miner = %caller.ss58, from = held, to = stage, "a miner joining again takes a stage with no miner");
    }
    db::miners::rejoin(&mut **tx, run, joining(app, caller, cap, stage)).await?;
    Ok((stage, restart != Restart::Continues))
}

/// What `caller` declares, joining `stage` now.
fn joining<'a>(
    app: &App,
    caller: &'a Caller,
    cap: &'a Capacity,
    stage: u32,
) -> db::miners::Joining<'a> {
    db::miners::Joining {
        hotkey: &caller.ss58,
        uid: i32::from(caller.uid),
        stage: stage as i32,
        device: &cap.device,
        memory_bytes: cap.memory_bytes as i64,
        tokens_per_s: cap.tokens_per_s,
        at: app.now(),
    }
}

async fn stage_loads(tx: &mut Transaction<'_, Postgres>, app: &App) -> ApiResult<Vec<StageLoad>> {
    // Each miner's throughput counts up to `MAX_WEIGHT_OVER_MEDIAN` times the run's median, as
    // in routing: one claiming far more would make its stage look served, and every newcomer
    // would go elsewhere.
    let cap = crate::domain::placement::MAX_WEIGHT_OVER_MEDIAN;
    let rows = db::miners::capped_loads(&mut **tx, app.run.id, cap).await?;
    let cfg = app.config();
    let mut loads: Vec<StageLoad> = (0..cfg.stages)
        .map(|s| StageLoad {
            stage: s,
            memory_needed: cfg.memory_needed(s).unwrap_or(0),
            miners: 0,
            tokens_per_s: 0.0,
        })
        .collect();
    for (stage, miners, tokens_per_s) in rows {
        if let Some(l) = loads.get_mut(stage as usize) {
            l.miners = miners as u32;
            l.tokens_per_s = tokens_per_s;
        }
    }
    Ok(loads)
}

/// The caller's stage, or 403 if it has not joined (or was released and must re-register).
pub(crate) async fn miner_stage<'e, E: sqlx::PgExecutor<'e>>(
    db: E,
    app: &App,
    caller: &Caller,
) -> ApiResult<u32> {
    let (stage, status) = db::miners::stage_and_status(db, app.run.id, &caller.ss58)
        .await?
        .ok_or_else(|| {
            AppError::new(
                ErrorCode::NotAMiner,
                "not a miner of this run: call POST /v1/miner/register first",
            )
        })?;
    if status != "active" {
        return Err(AppError::new(
            ErrorCode::NotAMiner,
            "released after missing heartbeats: call POST /v1/miner/register again",
        ));
    }
    Ok(stage as u32)
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
    db::miners::heartbeat(&app.db, app.run.id, &caller.ss58, tps, app.now()).await?;
    Ok(Json(HeartbeatResponse {
        stage,
        status: views::epoch_status(&app).await?,
    }))
}
