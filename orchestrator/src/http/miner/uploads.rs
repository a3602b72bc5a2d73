//! A hop's output: uploaded through the orchestrator or presigned into the store, checked, sealed and committed.

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, FromRequest, State};
use chrono::{DateTime, Utc};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::{BlobDescriptor, is_blake3_hex};
use iota_protocol::tensor::{StreamCheck, TensorError, TensorSpec, check_tensor};

use serde::Deserialize;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::app::App;
use crate::auth::Caller;
use crate::db;
use crate::domain::hops::expects_output;
use crate::domain::leases::secs;
use crate::error::{ApiResult, AppError};
use crate::http::extract::{ApiJson, ApiPath, ApiQuery};
use crate::store::StoreError;

/// Query of a direct upload of a pseudo-gradient or a merge.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UploadQuery {
    /// BLAKE3 of the body (64 lowercase hex digits).
    #[param(pattern = "^[0-9a-f]{64}$")]
    pub blake3: String,
}

/// Query of a direct upload of a hop's output.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct OutputUploadQuery {
    /// The lease from the work item.
    pub lease: Uuid,
    /// BLAKE3 of the body (64 lowercase hex digits).
    #[param(pattern = "^[0-9a-f]{64}$")]
    pub blake3: String,
}

/// Query of a presigned upload's steps for a hop's output.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LeaseQuery {
    /// The lease from the work item.
    pub lease: Uuid,
}

/// A leased task, locked for update.
pub(crate) struct LeasedTask {
    pub(crate) epoch: u64,
    pub(crate) sample_id: i64,
    pub(crate) stage: u32,
    pub(crate) direction: Direction,
    pub(crate) attempt: i32,
    pub(crate) status: String,
    pub(crate) lease: Option<Uuid>,
    pub(crate) miner: String,
    pub(crate) staged: Option<serde_json::Value>,
    pub(crate) output: Option<serde_json::Value>,
    pub(crate) next_task_id: Option<i64>,
    pub(crate) leased_at: Option<chrono::DateTime<chrono::Utc>>,
}

pub(crate) async fn lock_task(
    tx: &mut Transaction<'_, Postgres>,
    run: i64,
    id: i64,
) -> ApiResult<LeasedTask> {
    let hop = db::hops::lock(&mut **tx, run, id)
        .await?
        .ok_or_else(|| AppError::new(ErrorCode::NotFound, format!("no task {id}")))?;
    Ok(LeasedTask {
        epoch: hop.epoch as u64,
        sample_id: hop.sample_id,
        stage: hop.stage as u32,
        direction: Direction::parse(&hop.direction)
            .ok_or_else(|| AppError::new(ErrorCode::Internal, "bad direction"))?,
        attempt: hop.attempt,
        status: hop.status,
        lease: hop.lease,
        miner: hop.miner,
        staged: hop.staged,
        output: hop.output,
        next_task_id: hop.next_task_id,
        leased_at: hop.leased_at,
    })
}

pub(crate) fn check_lease(
    task: &LeasedTask,
    caller: &Caller,
    lease: Uuid,
    id: i64,
) -> ApiResult<()> {
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
    lease: Uuid,
) -> ApiResult<(LeasedTask, Uuid)> {
    let mut tx = app.db.begin().await?;
    let task = lock_task(&mut tx, app.run.id, task_id).await?;
    tx.commit().await?;
    check_lease(&task, caller, lease, task_id)?;
    Ok((task, lease))
}

/// Refuses a presigned upload larger than its slot before handing out a URL.
pub(crate) fn check_presign_size(req: &PresignRequest, spec: &TensorSpec) -> ApiResult<()> {
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

/// An upload's body, as the signed gate passes it on ([`crate::body::verified_body`]), with the
/// length its request declared: a partition's check needs the object's size before its first
/// byte.
pub struct UploadBody {
    body: Body,
    len: u64,
}

impl<S: Send + Sync> FromRequest<S> for UploadBody {
    type Rejection = AppError;

    async fn from_request(req: axum::extract::Request, _: &S) -> Result<Self, AppError> {
        let len = req
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| {
                AppError::new(
                    ErrorCode::BadRequest,
                    "an upload declares its length (Content-Length)",
                )
            })?;
        Ok(Self {
            body: req.into_body(),
            len,
        })
    }
}

/// Checks an upload's bytes against its slot and declared hash as they arrive, storing them on
/// the way: nothing appears in the store unless every check passes. A partition or a merge is
/// streamed (memory is a part's, whatever its size); a hop's output is read whole first.
pub(crate) async fn accept_upload(
    app: &App,
    key: String,
    spec: &TensorSpec,
    upload: UploadBody,
    declared_blake3: &str,
    placement: Placement,
) -> ApiResult<BlobDescriptor> {
    if !is_blake3_hex(declared_blake3) {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            "blake3 must be 64 lowercase hex digits",
        ));
    }
    let max = spec.max_bytes();
    if upload.len > max {
        return Err(AppError::new(
            ErrorCode::PayloadTooLarge,
            format!("{} bytes, this slot takes at most {max}", upload.len),
        ));
    }
    let stored = store_checked(
        app,
        key,
        spec,
        crate::body::upload_chunks(upload.body),
        upload.len,
        declared_blake3,
        placement,
    )
    .await;
    let blob = stored?;
    metrics::counter!("iota_upload_bytes_total").increment(blob.size);
    Ok(blob)
}

/// [`accept_upload`]'s checks and store of a body of `len` bytes, its chunks as they come.
async fn store_checked(
    app: &App,
    key: String,
    spec: &TensorSpec,
    chunks: impl futures::Stream<Item = Result<Bytes, AppError>>,
    len: u64,
    declared_blake3: &str,
    placement: Placement,
) -> ApiResult<BlobDescriptor> {
    Ok(match spec {
        // Small objects (a compressed partition is a few percent of a dense one): held whole.
        TensorSpec::Boundary { .. } | TensorSpec::Sparse(_) => {
            let bytes = gather(chunks, len).await?;
            let mut blob = check_bytes(spec, key, &bytes, declared_blake3)?;
            if placement == Placement::Sealed {
                blob.key = sealed_key(&blob.key, &blob.blake3);
            }
            app.store.put(&blob.key, bytes).await?;
            blob
        }
        TensorSpec::Partition { .. } | TensorSpec::Merged { .. } => {
            let key = match placement {
                Placement::Sealed => sealed_key(&key, declared_blake3),
                Placement::Slot => key,
            };
            let mut check = Some(StreamCheck::new(spec, len).map_err(refusal)?);
            let checked = |chunk: Option<&[u8]>| match (chunk, check.as_mut()) {
                (Some(chunk), Some(check)) => check.feed(chunk).map_err(refusal),
                (_, _) => {
                    let Some(check) = check.take() else {
                        return Err(AppError::new(ErrorCode::Internal, "checked twice"));
                    };
                    let actual = check.finish().map_err(refusal)?;
                    match actual == declared_blake3 {
                        true => Ok(()),
                        false => Err(hash_mismatch(&actual, declared_blake3)),
                    }
                }
            };
            // The check compared the object's BLAKE3 with the declared one before it completed.
            let size = app.store.put_checked(&key, chunks, checked).await?;
            let (dtype, shape) = spec.dtype_and_shape();
            BlobDescriptor {
                key,
                size,
                dtype,
                shape,
                blake3: declared_blake3.to_owned(),
                url: None,
            }
        }
    })
}

/// A body of `len` bytes, read whole: one that is longer or shorter than it said is refused.
async fn gather(
    chunks: impl futures::Stream<Item = Result<Bytes, AppError>>,
    len: u64,
) -> ApiResult<Bytes> {
    use futures::StreamExt;
    let wrong_length = |got: u64| {
        AppError::new(
            ErrorCode::BadRequest,
            format!("the body is {got} bytes or more, its Content-Length {len}"),
        )
    };
    let mut chunks = std::pin::pin!(chunks);
    let mut bytes = Vec::with_capacity(len as usize);
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk?;
        if (bytes.len() + chunk.len()) as u64 > len {
            return Err(wrong_length((bytes.len() + chunk.len()) as u64));
        }
        bytes.extend_from_slice(&chunk);
    }
    if bytes.len() as u64 != len {
        return Err(wrong_length(bytes.len() as u64));
    }
    Ok(Bytes::from(bytes))
}

/// A tensor check's refusal as the client is told it.
fn refusal(e: TensorError) -> AppError {
    match e {
        TensorError::TooLarge { .. } => AppError::new(ErrorCode::PayloadTooLarge, e.to_string()),
        e => AppError::new(ErrorCode::InvalidTensor, e.to_string()),
    }
}

fn hash_mismatch(actual: &str, declared: &str) -> AppError {
    AppError::new(
        ErrorCode::InvalidTensor,
        format!("BLAKE3 of the body is {actual}, the request declared {declared}"),
    )
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
        return Err(hash_mismatch(&actual, declared_blake3));
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
    params(("task_id" = i64, Path, description = "Task"), OutputUploadQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = UploadResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn upload_output(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath(task_id): ApiPath<i64>,
    ApiQuery(q): ApiQuery<OutputUploadQuery>,
    body: UploadBody,
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
    if !db::hops::stage_output(&app.db, task_id, lease, &value).await? {
        // An earlier attempt of this same upload (a client that timed out and retried) may have
        // been staged and the hop completed meanwhile: the object at this key is then the hop's
        // output, which consumers read, and it stays.
        let recorded = db::hops::output_hash(&app.db, task_id, lease, &blob.key).await?;
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
    params(("task_id" = i64, Path, description = "Task"), LeaseQuery),
    request_body = PresignRequest,
    responses((status = 200, body = PresignResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn presign_output(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath(task_id): ApiPath<i64>,
    ApiQuery(q): ApiQuery<LeaseQuery>,
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
    presign(&app, task_output_key(&app, task_id, &task), &req).await
}

/// A URL to PUT the slot's object to, or one per part when the client can upload in parts
/// and the object is larger than the store's part size.
pub(crate) async fn presign(
    app: &App,
    key: String,
    req: &PresignRequest,
) -> ApiResult<Json<PresignResponse>> {
    let parts = match req.multipart {
        true => app.store.presign_parts(&key, req.size).await?,
        false => None,
    };
    let url = match parts.as_ref().and_then(|p| p.urls.first()) {
        Some(first) => first.clone(),
        None => app
            .store
            .presign(http::Method::PUT, &key)
            .await?
            .ok_or_else(|| {
                AppError::new(
                    ErrorCode::BadRequest,
                    "this orchestrator's store does not presign: PUT the bytes to the orchestrator",
                )
            })?,
    };
    let ttl = chrono::Duration::from_std(app.store.presign_ttl())
        .unwrap_or_else(|_| chrono::Duration::seconds(900));
    Ok(Json(PresignResponse {
        url,
        key,
        expires_ms: (Utc::now() + ttl).timestamp_millis(),
        multipart: parts.map(|p| MultipartTarget {
            upload_id: p.upload_id,
            part_bytes: p.part_bytes,
            part_urls: p.urls,
        }),
    }))
}

/// Completes a commit's upload in parts, so that its object is at the slot's key to check. One
/// that cannot be completed (completed by an earlier attempt of this commit, or never begun) is
/// logged and left: the check then finds the object, or refuses a commit with nothing uploaded.
async fn complete_parts(app: &App, key: &str, commit: &CommitRequest) {
    let Some(parts) = &commit.multipart else {
        return;
    };
    if let Err(e) = app
        .store
        .complete_parts(key, &parts.upload_id, &parts.etags)
        .await
    {
        tracing::info!(key, error = %e, "an upload in parts could not be completed");
    }
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
    complete_parts(app, expected_key, commit).await;
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
    let pending = pending_key(expected_key, app.now());
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
        app.now().timestamp_millis() - abandoned_after(spec.max_bytes()).num_milliseconds();
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
    if matches!(
        spec,
        TensorSpec::Partition { .. } | TensorSpec::Merged { .. }
    ) {
        // Read as it streams: a stage's partition is too large to hold for a retried commit.
        if app.store.size_of(&sealed).await? != Some(commit.size) {
            return Ok(None);
        }
        return match check_streamed(app, &sealed, spec, commit).await? {
            None => Ok(None),
            Some(checked) => checked.map(Some),
        };
    }
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
    if matches!(
        spec,
        TensorSpec::Partition { .. } | TensorSpec::Merged { .. }
    ) {
        return match check_streamed(app, key, spec, commit).await? {
            None => Ok(None),
            Some(Ok(blob)) => Ok(Some(blob)),
            Some(Err(e)) => refuse(e).await,
        };
    }
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

/// Checks the partition or merge at `key` as it streams from the store ([`StreamCheck`]), so
/// that a commit holds a chunk and the header, not the object, whatever its size: `None` when
/// there is no object, `Some(Err)` when it is bad; `Err` when the store failed (the object
/// stays for a retried commit).
async fn check_streamed(
    app: &App,
    key: &str,
    spec: &TensorSpec,
    commit: &CommitRequest,
) -> ApiResult<Option<Result<BlobDescriptor, AppError>>> {
    use futures::StreamExt;
    let bad = refusal;
    let (size, mut stream) = match app.store.get_stream(key).await {
        Ok(found) => found,
        Err(StoreError::NotFound(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if size != commit.size {
        return Ok(Some(Err(AppError::new(
            ErrorCode::InvalidTensor,
            format!(
                "stored object is {size} bytes, commit declared {}",
                commit.size
            ),
        ))));
    }
    let mut check = match StreamCheck::new(spec, size) {
        Ok(check) => check,
        Err(e) => return Ok(Some(Err(bad(e)))),
    };
    while let Some(chunk) = stream.next().await {
        if let Err(e) = check.feed(&chunk?) {
            return Ok(Some(Err(bad(e))));
        }
    }
    let actual = match check.finish() {
        Ok(hash) => hash,
        Err(e) => return Ok(Some(Err(bad(e)))),
    };
    if actual != commit.blake3 {
        return Ok(Some(Err(hash_mismatch(&actual, &commit.blake3))));
    }
    let (dtype, shape) = spec.dtype_and_shape();
    Ok(Some(Ok(BlobDescriptor {
        key: key.to_owned(),
        size,
        dtype,
        shape,
        blake3: actual,
        url: None,
    })))
}

/// `POST /v1/miner/tasks/{task_id}/output/commit?lease=…`: after a presigned upload.
#[utoipa::path(post, path = "/v1/miner/tasks/{task_id}/output/commit", tag = "miner",
    params(("task_id" = i64, Path, description = "Task"), LeaseQuery),
    request_body = CommitRequest,
    responses((status = 200, body = UploadResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn commit_output(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath(task_id): ApiPath<i64>,
    ApiQuery(q): ApiQuery<LeaseQuery>,
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

/// Refuses an output for a hop that has none.
pub(crate) fn check_expects_output(app: &App, task: &LeasedTask) -> ApiResult<()> {
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
pub(crate) fn recorded_output(
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

/// The flat range of `partition` of `stage`, for a submission of `what` that `phase` of `epoch`
/// takes: a wrong phase or epoch is `wrong_phase`, a partition the stage lacks `not_found`.
pub(crate) async fn partition_in_phase(
    app: &App,
    what: &str,
    phase: Phase,
    epoch: u64,
    stage: u32,
    partition: u32,
) -> ApiResult<std::ops::Range<u64>> {
    let now = crate::samples::run_now(&app.db, app.run.id).await?;
    if now.epoch != epoch || now.phase != phase {
        return Err(AppError::new(
            ErrorCode::WrongPhase,
            format!(
                "{what} of epoch {epoch} are taken in its {} phase; the run is in epoch {} {}",
                phase.as_str(),
                now.epoch,
                now.phase.as_str()
            ),
        ));
    }
    app.config()
        .partition_range(stage, partition)
        .ok_or_else(|| {
            AppError::new(
                ErrorCode::NotFound,
                format!("stage {stage} has no partition {partition}"),
            )
        })
}
