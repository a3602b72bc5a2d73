//! A hop's completion: read the hop, its miner's end of epoch and its sample under lock, let
//! [`hops::plan_completion`] decide, then close the hop and move the sample in one transaction.

use axum::Json;
use axum::extract::{Extension, State};
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;

use sqlx::{Postgres, Transaction};

use super::uploads::LeasedTask;
use super::uploads::check_lease;
use super::uploads::lock_task;
use crate::app::App;
use crate::auth::Caller;
use crate::domain::hops::{self, Close, Completion, HopSnapshot, HopStatus, SampleStatus, Then};
use crate::domain::leases::pickup_s;
use crate::error::{ApiResult, AppError};
use crate::http::extract::{ApiJson, ApiPath};
use crate::samples::{abandon_sample, route_forward_sample};
use iota_protocol::ErrorCode;

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
    let hop = snapshot(&mut tx, &app, &caller, task_id, &task).await?;
    let (next_task_id, sample_done) =
        match hops::plan_completion(&hop, &req, cfg.stages, cfg.micro_batch)? {
            Completion::Repeat {
                next_task_id,
                sample_done,
            } => {
                return Ok(Json(CompleteResponse {
                    task_id,
                    next_task_id,
                    sample_done,
                }));
            }
            Completion::Close(close) => apply(&mut tx, &app, task_id, &task, &req, close).await?,
        };
    tx.commit().await?;
    metrics::counter!("iota_hops_completed_total", "direction" => task.direction.as_str())
        .increment(1);
    Ok(Json(CompleteResponse {
        task_id,
        next_task_id,
        sample_done,
    }))
}

/// What the plan needs: the hop as locked, and for a leased hop its miner's end of epoch and
/// its sample's status, locked in the order the epoch's end takes them (the hop, the miner's
/// row shared, the sample), so that no hop of an ended epoch completes.
async fn snapshot(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    caller: &Caller,
    task_id: i64,
    task: &LeasedTask,
) -> ApiResult<HopSnapshot> {
    let status = HopStatus::parse(&task.status)
        .ok_or_else(|| AppError::new(ErrorCode::Internal, "bad task status"))?;
    let blob = |v: &Option<serde_json::Value>| {
        v.clone()
            .and_then(|v| serde_json::from_value::<BlobDescriptor>(v).ok())
    };
    let mut hop = HopSnapshot {
        task_id,
        status,
        epoch: task.epoch,
        stage: task.stage,
        direction: task.direction,
        staged: blob(&task.staged),
        output: blob(&task.output),
        next_task_id: task.next_task_id,
        miner_ended_epoch: None,
        sample: None,
    };
    if status != HopStatus::Leased {
        return Ok(hop);
    }
    let ended: Option<Option<i64>> = sqlx::query_scalar(
        "SELECT ended_epoch FROM miners WHERE run_id = $1 AND hotkey = $2 FOR SHARE",
    )
    .bind(app.run.id)
    .bind(&caller.ss58)
    .fetch_optional(&mut **tx)
    .await?;
    hop.miner_ended_epoch = ended.flatten().map(|e| e as u64);
    let sample: Option<String> =
        sqlx::query_scalar("SELECT status FROM samples WHERE id = $1 FOR UPDATE")
            .bind(task.sample_id)
            .fetch_optional(&mut **tx)
            .await?;
    hop.sample = sample.as_deref().and_then(SampleStatus::parse);
    Ok(hop)
}

/// Closes the hop as `close` says and moves its sample: the next hop's id, and whether the
/// sample finished.
async fn apply(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    task_id: i64,
    task: &LeasedTask,
    req: &CompleteRequest,
    close: Close,
) -> ApiResult<(Option<i64>, bool)> {
    let output_json = close
        .output
        .as_ref()
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
    sqlx::query(
        "UPDATE tasks SET status = 'done', output = $2, inner_step = $3, weights_digest = $4,
             compute_ms = $5, completed_at = $6 WHERE id = $1",
    )
    .bind(task_id)
    .bind(&output_json)
    .bind(req.inner_step.min(i64::MAX as u64) as i64)
    .bind(&req.weights_digest)
    .bind(req.compute_ms.map(|m| m.min(i64::MAX as u64) as i64))
    .bind(app.now())
    .execute(&mut **tx)
    .await?;
    if let Some(o) = &close.output {
        sqlx::query(
            "UPDATE epochs SET wire_bytes = wire_bytes + $3 WHERE run_id = $1 AND epoch = $2",
        )
        .bind(app.run.id)
        .bind(task.epoch as i64)
        .bind(o.size as i64)
        .execute(&mut **tx)
        .await?;
    }
    if close.records_loss {
        sqlx::query(
            "UPDATE samples SET loss = $2, sequence_losses = $3, status = 'backward' WHERE id = $1",
        )
        .bind(task.sample_id)
        .bind(req.loss)
        .bind(req.sequence_losses.clone())
        .execute(&mut **tx)
        .await?;
    }
    match close.then {
        Then::Forward(stage) => {
            let next = route_forward(tx, app, task, stage, output_json, None).await?;
            Ok((next, false))
        }
        Then::Backward(stage) => {
            let next = route_backward(tx, app, task, stage, output_json).await?;
            Ok((next, false))
        }
        Then::Finish => {
            finish_sample(tx, app, task.sample_id, task.epoch).await?;
            Ok((None, true))
        }
    }
}

async fn finish_sample(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    sample_id: i64,
    epoch: u64,
) -> ApiResult<()> {
    sqlx::query("UPDATE samples SET status = 'done', completed_at = $2 WHERE id = $1")
        .bind(sample_id)
        .bind(app.now())
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
    .map_err(Into::into)
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
            app.now(),
            "the pathway's miner left, or ended its epoch, before its backward",
        )
        .await?;
        return Ok(None);
    };
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, attempt, miner, status, input,
             leased_until)
         VALUES ($1, $2, $3, $4, 'backward', 0, $5, 'pending', $6, $8 + make_interval(secs => $7))
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
    .bind(app.now())
    .fetch_one(&mut **tx)
    .await?;
    Ok(Some(id))
}
