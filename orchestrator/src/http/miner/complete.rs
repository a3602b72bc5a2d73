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
use crate::db;
use crate::domain::hops::{self, Close, Completion, HopSnapshot, HopStatus, SampleStatus, Then};
use crate::domain::leases::{pickup_s, secs};
use crate::domain::throughput;
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
    let ended = db::miners::lock_ended_epoch(&mut **tx, app.run.id, &caller.ss58).await?;
    hop.miner_ended_epoch = ended.flatten().map(|e| e as u64);
    let sample = db::samples::lock(&mut **tx, task.sample_id).await?;
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
    let done = db::hops::Done {
        output: output_json.as_ref(),
        inner_step: req.inner_step.min(i64::MAX as u64) as i64,
        weights_digest: &req.weights_digest,
        compute_ms: req.compute_ms.map(|m| m.min(i64::MAX as u64) as i64),
        at: app.now(),
    };
    let done_at = done.at;
    db::hops::close_done(&mut **tx, task_id, done).await?;
    // The miner's throughput, measured from this hop (see `domain::throughput`); its row of
    // `miner_throughput` last, after the hop's and the sample's.
    if let Some(leased_at) = task.leased_at {
        let cfg = app.config();
        let tokens = u64::from(cfg.micro_batch) * u64::from(cfg.seq_len);
        let previous = db::miners::lock_measured(&mut **tx, app.run.id, &task.miner).await?;
        let measured = throughput::after_hop(previous.as_ref(), leased_at, done_at, tokens);
        db::miners::set_measured(&mut **tx, app.run.id, &task.miner, &measured).await?;
    }
    if let Some(o) = &close.output {
        db::epochs::add_wire_bytes(&mut **tx, app.run.id, task.epoch as i64, o.size as i64).await?;
    }
    if close.records_loss {
        let losses = req.sequence_losses.as_deref();
        db::samples::record_loss(&mut **tx, task.sample_id, req.loss, losses).await?;
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
    db::samples::finish(&mut **tx, sample_id, app.now()).await?;
    db::epochs::count_completed(&mut **tx, app.run.id, epoch as i64).await?;
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
    db::samples::set_backward(&mut **tx, from.sample_id).await?;
    let miner = db::hops::forward_miner(&mut **tx, from.sample_id, stage as i32).await?;
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
    let hop = db::hops::NewHop {
        run: app.run.id,
        epoch: from.epoch as i64,
        sample_id: from.sample_id,
        stage: stage as i32,
        attempt: 0,
        miner: &miner,
        input: grad,
        pickup_by: app.now() + secs(pickup_s(app.config())),
    };
    Ok(Some(db::hops::insert_backward(&mut **tx, hop).await?))
}
