//! Pseudo-gradient partitions: reserving the uploading phase, uploads, presigned commits, what each contribution weighs.

use super::uploads::UploadBody;
use axum::Json;
use axum::extract::{Extension, State};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use iota_protocol::tensor::TensorSpec;

use super::join::miner_stage;
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
use crate::domain::phases::{reservation_open, reservations_hold_until};
use crate::error::{ApiResult, AppError};
use crate::http::extract::{ApiJson, ApiPath, ApiQuery, Bigint};
use crate::objects::{SealedIn, delete_unless_recorded};
use crate::samples::{close_epoch, run_now};

/// Weight of a miner's pseudo-gradient: its completed hops this epoch that updated its
/// gradients: every backward hop, and the last stage's forward hops (the last stage runs its
/// backward in the same hop).
pub(crate) async fn backward_work<'e, E: sqlx::PgExecutor<'e>>(
    db: E,
    app: &App,
    epoch: u64,
    miner: &str,
) -> ApiResult<i64> {
    let last_stage = app.config().stages as i32 - 1;
    Ok(db::uploads::backward_work(db, app.run.id, (epoch as i64, last_stage), miner).await?)
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
    partition_in_phase(
        app,
        "pseudo-gradients",
        Phase::Uploading,
        epoch,
        stage,
        partition,
    )
    .await?;
    may_contribute(app, caller, epoch).await?;
    let spec = app
        .run
        .config
        .pseudo_gradient_spec(stage, partition)
        .ok_or_else(|| AppError::new(ErrorCode::NotFound, "no such partition"))?;
    Ok((pg_key(app, epoch, stage, partition, &caller.ss58), spec))
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
    if db::uploads::ended_without_upload(&app.db, app.run.id, &caller.ss58, epoch as i64).await? {
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
/// harmless. A miner that left a reservation unused (it held every miner's phase open and
/// uploaded nothing) may still upload, but not reserve again until it has uploaded without one:
/// holding the phase open for nothing costs it the right to hold it.
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
    let at = app.now();
    let held = holds_reservation(&mut tx, &app, &caller, epoch).await?;
    if !held
        && let Some(unused) =
            db::uploads::unused_reservation_before(&mut *tx, app.run.id, epoch as i64, &caller.ss58)
                .await?
    {
        return Err(AppError::new(
            ErrorCode::Forbidden,
            format!(
                "your upload reservation of epoch {unused} was never used: upload your \
                 pseudo-gradient before the deadline, without a reservation, to reserve again"
            ),
        ));
    }
    if !reservation_open(now.epoch, now.phase, now.phase_deadline, epoch, at, held) {
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
    db::uploads::reserve(&mut *tx, app.run.id, epoch as i64, &caller.ss58, at).await?;
    tx.commit().await?;
    Ok(Json(ReservationResponse {
        epoch,
        holds_until_ms: reservations_hold_until(app.config(), now.phase_deadline)
            .timestamp_millis(),
    }))
}

/// Whether the caller reserved its upload of `epoch` already.
async fn holds_reservation(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    app: &App,
    caller: &Caller,
    epoch: u64,
) -> ApiResult<bool> {
    Ok(db::uploads::is_reserved(&mut **tx, app.run.id, epoch as i64, &caller.ss58).await?)
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
    let pg = db::uploads::NewPseudoGradient {
        key: PartitionKey::new(epoch, stage, partition),
        miner: &caller.ss58,
        blob: &value,
        blake3: &blob.blake3,
        weight,
    };
    let existing = db::uploads::record(&mut *tx, app.run.id, pg).await?;
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
    body: UploadBody,
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
pub(crate) async fn to_completion<T: Send + 'static>(
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
pub(crate) async fn already_recorded(
    app: &App,
    table: SealedIn,
    who: &str,
    (epoch, stage, partition): (u64, u32, u32),
    blake3: &str,
) -> ApiResult<Option<BlobDescriptor>> {
    let conflict = match table {
        SealedIn::PseudoGradients => {
            "a different pseudo-gradient was already accepted for this partition"
        }
        SealedIn::MergeResults => "you already submitted a different result for this partition",
    };
    let key = PartitionKey::new(epoch, stage, partition);
    let row = db::uploads::recorded(&app.db, app.run.id, table, key, who).await?;
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
    presign(&app, key, &req).await
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
