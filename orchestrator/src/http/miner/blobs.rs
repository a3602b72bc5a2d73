//! Signed downloads of stored objects, and miners' reports of bad ones.

use axum::Json;
use axum::extract::{Extension, State};
use axum::response::IntoResponse;
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use iota_protocol::tensor::check_tensor;

use super::merges::merged_partition_of;
use super::uploads::boundary_spec;
use crate::app::App;
use crate::auth::Caller;
use crate::db;
use crate::db::partitions::PartitionKey;
use crate::error::{ApiResult, AppError};
use crate::http::extract::{ApiJson, ApiPath};
use crate::samples::abandon_sample;
use crate::store::StoreError;

/// `GET /v1/blobs/{key}`: an object's bytes (for stores that do not presign).
#[utoipa::path(get, path = "/v1/blobs/{key}", tag = "miner",
    params(("key" = String, Path, description = "Object key")),
    responses((status = 200, content_type = "application/octet-stream", body = Vec<u8>), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn blob(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiPath(key): ApiPath<String>,
) -> ApiResult<axum::response::Response> {
    let prefix = format!("runs/{}/", app.run.id);
    let in_run = key.strip_prefix(&prefix);
    // Besides the run's own objects: its dataset's files, for every member.
    if in_run.is_none() && !crate::dataset::is_run_dataset_key(&app, &key) {
        return Err(AppError::new(
            ErrorCode::NotFound,
            format!("no object {key}"),
        ));
    }
    if let Some(partition) = in_run.and_then(merged_partition_of) {
        check_merge_readable(&app, &caller, partition).await?;
    }
    // Streamed: a presigned PUT is not bounded by the store, so an object here may be larger
    // than any slot, and must not be read into memory whole.
    let (size, chunks) = app.store.get_stream(&key).await?;
    metrics::counter!("iota_download_bytes_total").increment(size);
    Ok((
        [
            (
                http::header::CONTENT_TYPE,
                "application/octet-stream".to_owned(),
            ),
            (http::header::CONTENT_LENGTH, size.to_string()),
        ],
        axum::body::Body::from_stream(chunks),
    )
        .into_response())
}

/// An owner that could read another owner's merged result before the partition is settled
/// could submit it as its own instead of merging, and the two would agree. Validators read them
/// at any time (to settle disputes), unless they have a stake in the partition themselves (a
/// hotkey with a permit may also have joined as a miner).
async fn check_merge_readable(
    app: &App,
    caller: &Caller,
    (epoch, stage, partition): (i64, i32, i32),
) -> ApiResult<()> {
    let key = PartitionKey {
        epoch,
        stage,
        partition,
    };
    let state = db::partitions::state(&app.db, app.run.id, key).await?;
    let unsettled = matches!(state.as_deref(), Some("open" | "disputed"));
    if !unsettled {
        return Ok(());
    }
    let stake = (epoch, stage, partition);
    if caller.permit && !crate::driver::has_stake(&app.db, app.run.id, &caller.ss58, stake).await? {
        return Ok(());
    }
    Err(AppError::new(
        ErrorCode::Forbidden,
        format!(
            "merged results of partition {stage}/{partition} of epoch {epoch} can be read once \
             it is settled (validators that do not own it: at any time)"
        ),
    ))
}

/// What separates a report's reason from the problem that confirmed it, in `bad_objects`.
const CONFIRMED: &str = "; confirmed: ";

/// The verdict on `key` if a report confirmed it already, as that report was answered.
async fn confirmed_already(
    app: &App,
    key: &str,
    task_id: i64,
) -> ApiResult<Option<BadObjectVerdict>> {
    let reason = db::objects::bad_reason(&app.db, app.run.id, key).await?;
    Ok(reason.map(|reason| {
        let problem = reason
            .rsplit_once(CONFIRMED)
            .map_or(reason.as_str(), |(_, problem)| problem);
        BadObjectVerdict {
            confirmed: true,
            detail: format!("confirmed: {problem}; the producer's hop {task_id} failed"),
        }
    }))
}

/// `POST /v1/miner/reports/bad-object`: a consumer says an object failed its checks. The
/// orchestrator re-checks it; if it is bad, the producer's hop fails and the object is removed.
#[utoipa::path(post, path = "/v1/miner/reports/bad-object", tag = "miner",
    request_body = BadObjectReport,
    responses((status = 200, body = BadObjectVerdict), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn report_bad_object(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiJson(report): ApiJson<BadObjectReport>,
) -> ApiResult<Json<BadObjectVerdict>> {
    let Some((task_id, sample_id, blob)) = producer(&app, &report.key).await? else {
        return Ok(Json(BadObjectVerdict {
            confirmed: false,
            detail: "no hop output has this key".into(),
        }));
    };
    // Confirmed already (a retry whose first answer was lost, or another consumer's report):
    // answered as the first was, not from the object, which the first deleted.
    if let Some(verdict) = confirmed_already(&app, &report.key, task_id).await? {
        return Ok(Json(verdict));
    }
    let problem = match recheck(&app, &blob).await? {
        Recheck::Bad(problem) => problem,
        Recheck::Good => {
            return Ok(Json(BadObjectVerdict {
                confirmed: false,
                detail: "the object checks out here; download it again".into(),
            }));
        }
        Recheck::Gone => {
            // Deleted by a confirmation that committed since the look above, or collected.
            let verdict = confirmed_already(&app, &report.key, task_id).await?;
            return Ok(Json(verdict.unwrap_or_else(|| BadObjectVerdict {
                confirmed: false,
                detail: "the object is gone (its epoch was collected); nothing to check".into(),
            })));
        }
    };
    fail_producer(&app, &caller, &report, task_id, sample_id, &problem).await?;
    app.store.delete(&blob.key).await?;
    tracing::warn!(key = %report.key, task_id, %problem, "bad object confirmed; producer's hop failed");
    Ok(Json(BadObjectVerdict {
        confirmed: true,
        detail: format!("confirmed: {problem}; the producer's hop {task_id} failed"),
    }))
}

/// The hop whose output is `key`: its id, its sample and the output.
async fn producer(app: &App, key: &str) -> ApiResult<Option<(i64, i64, BlobDescriptor)>> {
    let Some((id, sample_id, output)) = db::hops::producer(&app.db, app.run.id, key).await? else {
        return Ok(None);
    };
    let blob = serde_json::from_value(output)
        .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
    Ok(Some((id, sample_id, blob)))
}

/// What a second look at a reported object finds.
enum Recheck {
    /// Its own fault: too large, not its descriptor, or not a boundary tensor.
    Bad(String),
    /// Nothing wrong.
    Good,
    /// It is not in the store.
    Gone,
}

/// Only the object's own faults confirm a report. A missing object was collected with its epoch
/// (no presigned URL deletes), and a failing store is nobody's hop's fault: neither may let a
/// reporter fail another miner's hop.
async fn recheck(app: &App, blob: &BlobDescriptor) -> ApiResult<Recheck> {
    let spec = boundary_spec(app.config());
    let _slot = crate::auth::object_slot(app).await?;
    let problem = match app.store.get_bounded(&blob.key, spec.max_bytes()).await {
        Err(e @ StoreError::TooLarge { .. }) => Some(e.to_string()),
        Err(StoreError::NotFound(_)) => return Ok(Recheck::Gone),
        Err(e) => return Err(e.into()),
        Ok(bytes) => blob
            .check_bytes(&bytes)
            .err()
            .or_else(|| check_tensor(&bytes, &spec).err().map(|e| e.to_string())),
    };
    Ok(problem.map_or(Recheck::Good, Recheck::Bad))
}

/// Fails the producer's hop `task_id`, ends its sample and records the confirmed report.
async fn fail_producer(
    app: &App,
    caller: &Caller,
    report: &BadObjectReport,
    task_id: i64,
    sample_id: i64,
    problem: &str,
) -> ApiResult<()> {
    let mut tx = app.db.begin().await?;
    db::hops::fail(&mut *tx, task_id).await?;
    abandon_sample(&mut tx, sample_id, app.now(), "bad object").await?;
    let reason = format!(
        "{}{CONFIRMED}{problem}",
        report.reason.chars().take(500).collect::<String>()
    );
    db::objects::record_bad(&mut *tx, app.run.id, &report.key, &caller.ss58, &reason).await?;
    tx.commit().await?;
    Ok(())
}
