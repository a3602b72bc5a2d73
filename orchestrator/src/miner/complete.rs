//! A hop's completion: its loss checks, the sample's next hop routed, the sample finished.

use axum::Json;
use axum::extract::{Extension, State};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;

use sqlx::{Postgres, Transaction};

use super::uploads::LeasedTask;
use super::uploads::check_lease;
use super::uploads::expects_output;
use super::uploads::lock_task;
use crate::app::App;
use crate::auth::Caller;
use crate::error::{ApiResult, AppError};
use crate::extract::{ApiJson, ApiPath};
use crate::routing::pickup_s;
use crate::samples::{abandon_sample, route_forward_sample};

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
