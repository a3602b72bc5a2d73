//! Joining the run and staying in it: registration (a stage chosen by load), heartbeats.

use axum::Json;
use axum::extract::{Extension, State};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;

use sqlx::{Postgres, Row, Transaction};

use crate::app::App;
use crate::auth::Caller;
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
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('iota-join'), $1::int)")
        .bind(run as i32)
        .execute(&mut *tx)
        .await?;
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
    let existing = sqlx::query(
        "SELECT stage, ended_epoch, status = 'active' AS active,
            EXISTS (SELECT 1 FROM tasks WHERE run_id = $1 AND epoch = $3 AND miner = $2
                      AND status = 'done') AS worked
         FROM miners WHERE run_id = $1 AND hotkey = $2",
    )
    .bind(run)
    .bind(&caller.ss58)
    .bind(epoch as i64)
    .fetch_optional(&mut **tx)
    .await?;
    let loads = stage_loads(tx, app).await?;
    let Some(row) = existing else {
        let stage = admit(&loads, cap.memory_bytes)
            .map_err(|why| AppError::new(ErrorCode::Forbidden, why))?;
        sqlx::query(
            "INSERT INTO miners (run_id, hotkey, uid, stage, status, device, memory_bytes,
             tokens_per_s, joined_epoch, registered_at, last_seen)
             VALUES ($1, $2, $3, $4, 'active', $5, $6, $7, $8, $9, $9)",
        )
        .bind(run)
        .bind(&caller.ss58)
        .bind(i32::from(caller.uid))
        .bind(stage as i32)
        .bind(&cap.device)
        .bind(cap.memory_bytes as i64)
        .bind(cap.tokens_per_s)
        .bind(epoch as i64)
        .bind(app.now())
        .execute(&mut **tx)
        .await?;
        tracing::info!(miner = %caller.ss58, stage, epoch, "miner joined");
        return Ok((stage, false));
    };
    let held = row.try_get::<i32, _>("stage")? as u32;
    let ended = row
        .try_get::<Option<i64>, _>("ended_epoch")?
        .map(|e| e as u64);
    let restart = restart_ends_work(ended, epoch, req.holds_epoch_state, row.try_get("worked")?);
    if restart == Restart::EndsWork {
        close_epoch(tx, app, &caller.ss58, epoch).await?;
        tracing::info!(miner = %caller.ss58, epoch, "a restarted miner sits out the rest of the epoch");
    }
    let stage = rejoin_stage(&loads, held, row.try_get("active")?, cap.memory_bytes);
    if stage != held {
        tracing::info!(miner = %caller.ss58, from = held, to = stage, "a miner joining again takes a stage with no miner");
    }
    sqlx::query(
        "UPDATE miners SET status = 'active', uid = $3, device = $4, memory_bytes = $5,
         tokens_per_s = $6, last_seen = $8, stage = $7 WHERE run_id = $1 AND hotkey = $2",
    )
    .bind(run)
    .bind(&caller.ss58)
    .bind(i32::from(caller.uid))
    .bind(&cap.device)
    .bind(cap.memory_bytes as i64)
    .bind(cap.tokens_per_s)
    .bind(stage as i32)
    .bind(app.now())
    .execute(&mut **tx)
    .await?;
    Ok((stage, restart != Restart::Continues))
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
    .bind(crate::domain::placement::MAX_WEIGHT_OVER_MEDIAN)
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
pub(crate) async fn miner_stage<'e, E: sqlx::PgExecutor<'e>>(
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
        "UPDATE miners SET last_seen = $4, tokens_per_s = coalesce($3, tokens_per_s)
         WHERE run_id = $1 AND hotkey = $2",
    )
    .bind(app.run.id)
    .bind(&caller.ss58)
    .bind(tps)
    .bind(app.now())
    .execute(&app.db)
    .await?;
    Ok(Json(HeartbeatResponse {
        stage,
        status: views::epoch_status(&app).await?,
    }))
}
