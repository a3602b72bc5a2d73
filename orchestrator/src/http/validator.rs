//! Signed routes for validators (registered with a validator permit).
//!
//! The orchestrator does not choose what gets checked: a draw it could predict, a miner could
//! too. Validators read the full record of an epoch and draw their own spot checks from a seed
//! the orchestrator cannot know (a block hash after the upload deadline mixed with their secret).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use axum::Json;
use axum::extract::{Extension, State};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;

use crate::app::App;
use crate::auth::Caller;
use crate::db;
use crate::error::{ApiResult, AppError};
use crate::http::extract::{ApiJson, ApiPath, ApiQuery, Bigint};
use crate::http::miner::merges::upload_merge_as;
use crate::http::miner::uploads::{UploadBody, UploadQuery};
use crate::samples::run_now;

/// Most uids in a submission's weights (and scores per submission): more than a subnet holds.
const MAX_UIDS: usize = 4096;
/// Longest hotkey in a submission's scores (an SS58 address is 47 or 48 characters).
const MAX_HOTKEY_LEN: usize = 64;
/// Longest penalty text in a submission's scores.
const MAX_PENALTY_LEN: usize = 1024;
use crate::http::views::{self, PageQuery};

/// `GET /v1/validator/epochs/{epoch}/hops`: every hop attempt of the epoch, by task id.
#[utoipa::path(get, path = "/v1/validator/epochs/{epoch}/hops", tag = "validator",
    params(("epoch" = u64, Path, description = "Epoch"), PageQuery),
    responses((status = 200, body = HopPage), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn hops(
    State(app): State<App>,
    Extension(_v): Extension<Caller>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<Json<HopPage>> {
    Ok(Json(views::hops_page(&app, epoch, &q).await?))
}

/// `GET /v1/validator/epochs/{epoch}/samples`: samples with pathway and loss (CLASP's input).
#[utoipa::path(get, path = "/v1/validator/epochs/{epoch}/samples", tag = "validator",
    params(("epoch" = u64, Path, description = "Epoch"), PageQuery),
    responses((status = 200, body = SamplePage), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn samples(
    State(app): State<App>,
    Extension(_v): Extension<Caller>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<Json<SamplePage>> {
    Ok(Json(views::samples_page(&app, epoch, &q).await?))
}

/// `GET /v1/validator/epochs/{epoch}`: miners' work, pseudo-gradients, merges and the
/// epoch-start weights, everything a spot check is drawn from.
#[utoipa::path(get, path = "/v1/validator/epochs/{epoch}", tag = "validator",
    params(("epoch" = u64, Path, description = "Epoch")),
    responses((status = 200, body = EpochRecord), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn epoch(
    State(app): State<App>,
    Extension(v): Extension<Caller>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
) -> ApiResult<Json<EpochRecord>> {
    let cur = run_now(&app.db, app.run.id).await?;
    if epoch > cur.epoch {
        return Err(AppError::new(
            ErrorCode::NotFound,
            format!("epoch {epoch} has not started"),
        ));
    }
    let audience = views::Audience::Validator(&v.ss58);
    Ok(Json(
        views::epoch_record(&app, epoch, cur.epoch, cur.phase, audience).await?,
    ))
}

/// `GET /v1/validator/disputes`: open disputes with what is needed to recompute them.
#[utoipa::path(get, path = "/v1/validator/disputes", tag = "validator",
    responses((status = 200, body = Vec<Dispute>), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn disputes(
    State(app): State<App>,
    Extension(v): Extension<Caller>,
) -> ApiResult<Json<Vec<Dispute>>> {
    let rows = db::validators::open_disputes(&app.db, app.run.id).await?;
    let mut out = Vec::with_capacity(rows.len());
    // Each epoch's partitions read once, however many of them are disputed.
    let mut epochs: HashMap<u64, Vec<PartitionStatus>> = HashMap::new();
    for r in rows {
        let epoch = r.key.epoch as u64;
        let stage = r.key.stage as u32;
        let partition = r.key.partition as u32;
        let partitions = match epochs.entry(epoch) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(
                views::partitions_of(&app, epoch, views::Audience::Validator(&v.ss58)).await?,
            ),
        };
        let status = partitions
            .iter()
            .find(|p| p.stage == stage && p.partition == partition)
            .cloned()
            .ok_or_else(|| AppError::new(ErrorCode::Internal, "dispute without partition"))?;
        out.push(Dispute {
            id: r.id,
            partition: status,
            contributions: serde_json::from_value(r.contributions)
                .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?,
            state: r.state,
        });
    }
    Ok(Json(out))
}

/// `POST /v1/validator/disputes/{id}/settle`: the validator's recomputed hash.
#[utoipa::path(post, path = "/v1/validator/disputes/{id}/settle", tag = "validator",
    params(("id" = i64, Path, description = "Dispute")),
    request_body = SettleRequest,
    responses((status = 200, body = PartitionStatus), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn settle(
    State(app): State<App>,
    Extension(v): Extension<Caller>,
    ApiPath(id): ApiPath<i64>,
    ApiJson(req): ApiJson<SettleRequest>,
) -> ApiResult<Json<PartitionStatus>> {
    if !iota_protocol::blob::is_blake3_hex(&req.blake3) {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            "blake3 must be 64 lowercase hex digits",
        ));
    }
    crate::driver::settle_dispute(&app, &v.ss58, id, &req.blake3).await?;
    let key = db::validators::dispute_partition(&app.db, id).await?;
    views::partitions_of(&app, key.epoch as u64, views::Audience::Validator(&v.ss58))
        .await?
        .into_iter()
        .find(|p| p.stage == key.stage as u32 && p.partition == key.partition as u32)
        .map(Json)
        .ok_or_else(|| AppError::new(ErrorCode::Internal, "partition vanished"))
}

/// `PUT /v1/validator/epochs/{epoch}/merges/{stage}/{partition}?blake3=…`: a validator's own
/// merge of a partition: a result that disputes the partition when it differs from an owner's,
/// and that a vote can then name; it never completes the owners' agreement.
#[utoipa::path(put, path = "/v1/validator/epochs/{epoch}/merges/{stage}/{partition}", tag = "validator",
    params(("epoch" = u64, Path, description = "Epoch"), ("stage" = u32, Path, description = "Stage"),
        ("partition" = u32, Path, description = "Partition"), UploadQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = UploadResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn upload_merge(
    State(app): State<App>,
    Extension(v): Extension<Caller>,
    ApiPath((Bigint(epoch), stage, partition)): ApiPath<(Bigint, u32, u32)>,
    ApiQuery(q): ApiQuery<UploadQuery>,
    body: UploadBody,
) -> ApiResult<Json<UploadResponse>> {
    let who = format!("validator:{}", v.ss58);
    upload_merge_as(&app, &who, true, (epoch, stage, partition), body, &q.blake3).await
}

/// `POST /v1/validator/epochs/{epoch}/scores`: the validator's scores (and the weights they
/// produced). A resubmission for the same epoch replaces the previous one.
#[utoipa::path(post, path = "/v1/validator/epochs/{epoch}/scores", tag = "validator",
    params(("epoch" = u64, Path, description = "Epoch")),
    request_body = ScoreSubmission,
    responses((status = 200, body = ScoreRecord), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn scores(
    State(app): State<App>,
    Extension(v): Extension<Caller>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
    ApiJson(sub): ApiJson<ScoreSubmission>,
) -> ApiResult<Json<ScoreRecord>> {
    check_submission(&sub)?;
    let cur = run_now(&app.db, app.run.id).await?;
    if epoch > cur.epoch {
        return Err(AppError::new(
            ErrorCode::WrongPhase,
            format!("epoch {epoch} has not started"),
        ));
    }
    let new = db::validators::NewScores {
        validator: v.ss58.clone(),
        epoch: epoch as i64,
        scores: to_json(&sub.scores)?,
        weights: sub.weights.as_ref().map(to_json).transpose()?,
        params: sub.params.as_ref().map(to_json).transpose()?,
        at: app.now(),
    };
    Ok(Json(
        db::validators::store_scores(&app.db, app.run.id, new).await?,
    ))
}

/// Scores a validator may submit, and weights a chain could hold: one per uid of a subnet, each
/// uid once. They are served to anyone (`GET /v1/scores`), so they are kept to that.
fn check_submission(sub: &ScoreSubmission) -> ApiResult<()> {
    if sub.scores.len() > MAX_UIDS
        || sub
            .scores
            .iter()
            .any(|s| !(s.score.is_finite() && s.score >= 0.0))
    {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            "scores: at most 4096 finite, non-negative values",
        ));
    }
    let finite = |v: Option<f64>| v.is_none_or(f64::is_finite);
    if !sub.scores.iter().all(|s| {
        finite(s.work)
            && finite(s.quality)
            && finite(s.effect)
            && s.penalty
                .as_ref()
                .is_none_or(|p| p.chars().count() <= MAX_PENALTY_LEN)
    }) {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            format!(
                "scores: work, quality and effect finite, a penalty of at most {MAX_PENALTY_LEN} \
                 characters"
            ),
        ));
    }
    if sub.params.as_ref().is_some_and(|p| !p.is_valid()) {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            format!(
                "params: finite values, a decay in (0, 1], a window of 1 to {} epochs, a CLASP \
                 window of 1 to {} and a burn share in [0, 1)",
                ScoringParams::MAX_WINDOW,
                ScoringParams::MAX_CLASP_WINDOW
            ),
        ));
    }
    if sub
        .scores
        .iter()
        .any(|s| s.hotkey.chars().count() > MAX_HOTKEY_LEN)
    {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            format!("scores: a hotkey is at most {MAX_HOTKEY_LEN} characters"),
        ));
    }
    if let Some(w) = &sub.weights {
        let mut uids = w.uids.clone();
        uids.sort_unstable();
        uids.dedup();
        if w.uids.len() != w.weights.len()
            || w.uids.len() > MAX_UIDS
            || uids.len() != w.uids.len()
            || i64::try_from(w.block).is_err()
        {
            return Err(AppError::new(
                ErrorCode::BadRequest,
                format!(
                    "weights: as many weights as uids, at most {MAX_UIDS}, each uid once, and a \
                     block of at most {}",
                    i64::MAX
                ),
            ));
        }
    }
    Ok(())
}

fn to_json<T: serde::Serialize>(v: &T) -> ApiResult<serde_json::Value> {
    serde_json::to_value(v).map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))
}

/// `GET /v1/validator/epochs/{epoch}/spot-checks?after=…&limit=…`: which miners a page holds.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SpotCheckQuery {
    /// Only miners whose hotkey sorts after this one (the page before's `next_after`).
    #[serde(default)]
    pub after: Option<String>,
    /// At most this many miners (default 1000).
    #[serde(default)]
    #[param(value_type = Option<u32>, minimum = 1, maximum = 5000)]
    pub limit: Option<crate::http::views::PageSize>,
}

/// `GET /v1/validator/epochs/{epoch}/spot-checks`: the replayable work of the miners that did
/// any in the epoch, a page of them at a time (by hotkey), the re-derivable merges, and what
/// validators reported checking.
#[utoipa::path(get, path = "/v1/validator/epochs/{epoch}/spot-checks", tag = "validator",
    params(("epoch" = u64, Path, description = "Epoch"), SpotCheckQuery),
    responses((status = 200, body = SpotCheckTasks), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn spot_checks(
    State(app): State<App>,
    Extension(v): Extension<Caller>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
    ApiQuery(q): ApiQuery<SpotCheckQuery>,
) -> ApiResult<Json<SpotCheckTasks>> {
    let limit = views::page_limit(q.limit);
    let miners = workers_page(&app, epoch, q.after.as_deref(), limit).await?;
    let next_after = (miners.len() as i64 == limit)
        .then(|| miners.last().map(|m| m.hotkey.clone()))
        .flatten();
    let mut page = SpotCheckTasks {
        epoch,
        miners,
        next_after,
        partitions: Vec::new(),
        reported: Vec::new(),
    };
    // The epoch's merges and reports come with the first page only: later pages would repeat
    // them (up to every partition of every stage, and 10,000 checks per validator).
    if q.after.is_none() {
        page.partitions = views::partitions_of(&app, epoch, views::Audience::Validator(&v.ss58))
            .await?
            .into_iter()
            .filter(|p| p.state == PartitionState::Accepted)
            .collect();
        page.reported = reported_checks(&app, epoch).await?;
    }
    Ok(Json(page))
}

/// The miners with work in `epoch` (from its hops and pseudo-gradients, not every miner that
/// ever joined), a page of them by hotkey after `after`.
async fn workers_page(
    app: &App,
    epoch: u64,
    after: Option<&str>,
    limit: i64,
) -> ApiResult<Vec<SpotCheckCandidate>> {
    let page = (after, limit);
    Ok(db::validators::workers_page(&app.db, app.run.id, epoch as i64, page).await?)
}

/// What validators reported checking in `epoch`.
async fn reported_checks(app: &App, epoch: u64) -> ApiResult<Vec<SpotCheckReport>> {
    Ok(db::validators::reported_checks(&app.db, app.run.id, epoch as i64).await?)
}

/// `POST /v1/validator/epochs/{epoch}/spot-checks`: publish what this validator checked (one
/// report per validator and epoch; a resubmission replaces it).
#[utoipa::path(post, path = "/v1/validator/epochs/{epoch}/spot-checks", tag = "validator",
    params(("epoch" = u64, Path, description = "Epoch")),
    request_body = SpotCheckReport,
    responses((status = 200, body = SpotCheckReport), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn report_spot_checks(
    State(app): State<App>,
    Extension(v): Extension<Caller>,
    ApiPath(Bigint(epoch)): ApiPath<Bigint>,
    ApiJson(mut report): ApiJson<SpotCheckReport>,
) -> ApiResult<Json<SpotCheckReport>> {
    check_report(&report)?;
    // Only epochs that exist: each report is kept, so any u64 would grow the table without end.
    let cur = run_now(&app.db, app.run.id).await?;
    if epoch > cur.epoch {
        return Err(AppError::new(
            ErrorCode::WrongPhase,
            format!("epoch {epoch} has not started"),
        ));
    }
    report.validator = v.ss58.clone();
    let stored = (to_json(&report.checks)?, app.now());
    db::validators::store_spot_checks(&app.db, app.run.id, epoch as i64, &report, stored).await?;
    Ok(Json(report))
}

fn check_report(report: &SpotCheckReport) -> ApiResult<()> {
    if report.checks.len() > 10_000 || report.seed.chars().count() > 256 {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            "at most 10000 checks and a seed of at most 256 characters",
        ));
    }
    // Stored as PostgreSQL's bigint; anything larger would be kept as another block than the
    // one the draw names.
    if i64::try_from(report.seed_block).is_err() {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            format!("seed_block must be at most {}", i64::MAX),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// PostgreSQL's `jsonb` writes a large float as the integer it equals; a stored score must
    /// read back as exactly that float (serde_json's `float_roundtrip`), not as an overflow that
    /// turns `GET /v1/scores` into a 500.
    #[test]
    fn the_largest_score_reads_back_as_postgresql_writes_it() {
        let written = format!("[17976931348623157{}]", "0".repeat(292));
        let read: Vec<f64> = serde_json::from_str(&written).expect("a finite float");
        assert_eq!(read, vec![f64::MAX]);
    }
}
