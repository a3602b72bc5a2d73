//! Merging: the partitions a miner owns, their bases, the merged results it publishes, the stage's weights.

use super::uploads::UploadBody;
use axum::Json;
use axum::extract::{Extension, State};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use iota_protocol::tensor::TensorSpec;

use super::pseudo_gradients::already_recorded;
use super::pseudo_gradients::to_completion;
use super::uploads::Placement;
use super::uploads::UploadQuery;
use super::uploads::accept_committed;
use super::uploads::accept_upload;
use super::uploads::check_presign_size;
use super::uploads::{partition_in_phase, presign};
use crate::app::App;
use crate::auth::Caller;
use crate::db;
use crate::db::partitions::PartitionKey;
use crate::error::{ApiResult, AppError};
use crate::http::extract::{ApiJson, ApiPath, ApiQuery, Bigint};
use crate::http::views;
use crate::objects::SealedIn;
use crate::samples::{RunNow, run_now};

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
        for (stage, partition, contributions) in owned_unmerged(&app, &caller, now.epoch).await? {
            assignments.push(assignment(&app, &now, stage, partition, contributions).await?);
        }
    }
    Ok(Json(MergeAssignments {
        assignments,
        status: views::epoch_status(&app).await?,
    }))
}

/// The partitions of `epoch` the caller owns, not settled and with no result of its own yet:
/// stage, partition and contributions.
async fn owned_unmerged(
    app: &App,
    caller: &Caller,
    epoch: u64,
) -> ApiResult<Vec<(u32, u32, Vec<MergeContribution>)>> {
    let rows = db::partitions::owned_unmerged(&app.db, app.run.id, epoch as i64, &caller.ss58);
    rows.await?
        .into_iter()
        .map(|(stage, partition, contributions)| {
            let contributions = serde_json::from_value(contributions)
                .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
            Ok((stage as u32, partition as u32, contributions))
        })
        .collect()
}

/// One partition to merge, with download URLs for its contributions and its base.
async fn assignment(
    app: &App,
    now: &RunNow,
    stage: u32,
    partition: u32,
    mut contributions: Vec<MergeContribution>,
) -> ApiResult<MergeAssignment> {
    let range = app
        .config()
        .partition_range(stage, partition)
        .ok_or_else(|| AppError::new(ErrorCode::Internal, "partition out of range"))?;
    for c in &mut contributions {
        c.blob.url = app.store.presign(http::Method::GET, &c.blob.key).await?;
    }
    Ok(MergeAssignment {
        epoch: now.epoch,
        stage,
        partition,
        start: range.start,
        end: range.end,
        contributions,
        base: merge_base(app, now.epoch, stage, partition).await?,
        deadline_ms: now.phase_deadline.timestamp_millis(),
    })
}

/// The latest accepted merge of a partition from an epoch before `epoch`: what a merge of
/// `epoch` starts from (`None`: the initial weights).
pub(crate) async fn merge_base(
    app: &App,
    epoch: u64,
    stage: u32,
    partition: u32,
) -> ApiResult<Option<BlobDescriptor>> {
    let key = PartitionKey::new(epoch, stage, partition);
    let Some(accepted) = db::partitions::base(&app.db, app.run.id, key).await? else {
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
    partition_in_phase(app, "merges", Phase::Merging, epoch, stage, partition).await?;
    if as_validator {
        let hotkey = who.strip_prefix("validator:").unwrap_or(who);
        let slot = (epoch as i64, stage as i32, partition as i32);
        if crate::driver::has_stake(&app.db, app.run.id, hotkey, slot).await? {
            return Err(crate::driver::interested_validator(stage, partition).into());
        }
    } else {
        let key = PartitionKey::new(epoch, stage, partition);
        if !db::partitions::is_owner(&app.db, app.run.id, key, who).await? {
            return Err(AppError::new(
                ErrorCode::Forbidden,
                format!("you do not own stage {stage} partition {partition} this epoch"),
            ));
        }
    }
    let spec = app
        .run
        .config
        .merged_spec(stage, partition)
        .ok_or_else(|| AppError::new(ErrorCode::NotFound, "no such partition"))?;
    Ok((merged_key(app, epoch, stage, partition, who), spec))
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
    body: UploadBody,
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
    body: UploadBody,
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
        let recorded =
            crate::driver::record_merge_result(&app, &who, epoch, stage, partition, blob);
        Ok(Json(recorded.await?))
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
    presign(&app, key, &req).await
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
        let recorded =
            crate::driver::record_merge_result(&app, &caller.ss58, epoch, stage, partition, blob);
        Ok(Json(recorded.await?))
    })
    .await
}

/// The epoch, stage and partition of a merged result's key below its run's prefix
/// (`epoch-{e}/merged/s{s}/p{p}/…`).
pub(crate) fn merged_partition_of(key: &str) -> Option<(i64, i32, i32)> {
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
