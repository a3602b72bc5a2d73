//! The HTTP layer: the router, the OpenAPI document, extractors and the thin route handlers. A
//! handler reads its request, asks the driver, the run's transitions (`samples`) or the domain
//! what to do, and answers; nothing below this module knows HTTP.
//!
//! * [`miner`], [`validator`], [`views`], [`dashboard`]: the routes, by caller.
//! * [`extract`]: extractors that answer with the API's error body.
//! * [`openapi`]: the document (`orchestrator/openapi.json`); [`metrics`]: `/metrics` and the
//!   per-request series.

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use tower_http::trace::TraceLayer;

use crate::app::{App, max_upload_bytes};
use crate::auth::{Gate, SharedReplay};
use metrics::{metrics_text, track};
use openapi::openapi_route;

pub mod dashboard;
pub mod dataset;
pub mod extract;
pub mod metrics;
pub mod miner;
pub mod openapi;
pub mod sessions;
pub mod validator;
pub mod views;

/// The HTTP routes over `app`.
pub fn router(app: App) -> Router {
    let json_limit = app.limits.json_body_bytes;
    let upload_limit = max_upload_bytes(app.config());
    // Upload routes hold one of the upload slots while their body is read and handled.
    let signed = |gate, body_limit, shared_replay, uploads| {
        (
            app.clone(),
            crate::auth::SignedRoutes {
                gate,
                body_limit,
                shared_replay,
                uploads,
            },
        )
    };
    // The work poll runs the gate's steps itself (see `miner::work::work`), and records its uuid in
    // the shared replay cache only when it goes past the poll view (see `replay`).
    let miner_poll = Router::new().route("/v1/miner/work", post(miner::work::work));
    let sessions = Router::new()
        .route("/v1/sessions", post(sessions::open))
        .route_layer(middleware::from_fn_with_state(
            signed(Gate::Registered, json_limit, SharedReplay::Before, false),
            crate::auth::signed_gate,
        ));
    let miner_json = Router::new()
        .route("/v1/miner/register", post(miner::join::register))
        .route("/v1/miner/heartbeat", post(miner::join::heartbeat))
        .route(
            "/v1/miner/tasks/{task_id}/complete",
            post(miner::complete::complete),
        )
        .route(
            "/v1/miner/tasks/{task_id}/output/presign",
            post(miner::uploads::presign_output),
        )
        .route(
            "/v1/miner/tasks/{task_id}/output/commit",
            post(miner::uploads::commit_output),
        )
        .route(
            "/v1/miner/epochs/{epoch}/pseudo-gradients/reserve",
            post(miner::pseudo_gradients::reserve_pg),
        )
        .route(
            "/v1/miner/epochs/{epoch}/pseudo-gradients/{partition}/presign",
            post(miner::pseudo_gradients::presign_pg),
        )
        .route(
            "/v1/miner/epochs/{epoch}/pseudo-gradients/{partition}/commit",
            post(miner::pseudo_gradients::commit_pg),
        )
        .route("/v1/miner/merges", get(miner::merges::merges))
        .route(
            "/v1/miner/stages/{stage}/weights",
            get(miner::merges::weights),
        )
        .route(
            "/v1/miner/epochs/{epoch}/merges/{stage}/{partition}/presign",
            post(miner::merges::presign_merge),
        )
        .route(
            "/v1/miner/epochs/{epoch}/merges/{stage}/{partition}/commit",
            post(miner::merges::commit_merge),
        )
        .route(
            "/v1/miner/reports/bad-object",
            post(miner::blobs::report_bad_object),
        )
        .route("/v1/blobs/{*key}", get(miner::blobs::blob))
        .route("/v1/dataset", get(dataset::files))
        .route_layer(middleware::from_fn_with_state(
            signed(Gate::Registered, json_limit, SharedReplay::Before, false),
            crate::auth::signed_gate,
        ));
    let miner_upload = Router::new()
        .route(
            "/v1/miner/tasks/{task_id}/output",
            put(miner::uploads::upload_output),
        )
        .route(
            "/v1/miner/epochs/{epoch}/pseudo-gradients/{partition}",
            put(miner::pseudo_gradients::upload_pg),
        )
        .route(
            "/v1/miner/epochs/{epoch}/merges/{stage}/{partition}",
            put(miner::merges::upload_merge),
        )
        .route_layer(middleware::from_fn_with_state(
            signed(Gate::Registered, upload_limit, SharedReplay::Before, true),
            crate::auth::signed_gate,
        ));
    let validator_json = Router::new()
        .route("/v1/validator/epochs/{epoch}/hops", get(validator::hops))
        .route(
            "/v1/validator/epochs/{epoch}/samples",
            get(validator::samples),
        )
        .route("/v1/validator/epochs/{epoch}", get(validator::epoch))
        .route("/v1/validator/disputes", get(validator::disputes))
        .route(
            "/v1/validator/disputes/{id}/settle",
            post(validator::settle),
        )
        .route(
            "/v1/validator/epochs/{epoch}/scores",
            post(validator::scores),
        )
        .route(
            "/v1/validator/epochs/{epoch}/spot-checks",
            get(validator::spot_checks).post(validator::report_spot_checks),
        )
        .route_layer(middleware::from_fn_with_state(
            signed(Gate::Validator, json_limit, SharedReplay::Before, false),
            crate::auth::signed_gate,
        ));
    let validator_upload = Router::new()
        .route(
            "/v1/validator/epochs/{epoch}/merges/{stage}/{partition}",
            put(validator::upload_merge),
        )
        .route_layer(middleware::from_fn_with_state(
            signed(Gate::Validator, upload_limit, SharedReplay::Before, true),
            crate::auth::signed_gate,
        ));
    let public = Router::new()
        .route("/v1/run", get(views::get_run))
        .route("/v1/status", get(views::get_status))
        .route("/v1/stages", get(views::get_stages))
        .route("/v1/stages/{stage}/weights", get(views::get_stage_weights))
        .route("/v1/miners", get(views::get_miners))
        .route("/v1/loss", get(views::get_loss))
        .route("/v1/throughput", get(views::get_throughput))
        .route("/v1/samples/{id}", get(views::get_sample))
        .route("/v1/epochs/{epoch}", get(views::get_epoch))
        .route("/v1/epochs/{epoch}/samples", get(views::get_epoch_samples))
        .route("/v1/epochs/{epoch}/merges", get(views::get_merges))
        .route("/v1/epochs/{epoch}/scores", get(views::get_epoch_scores))
        .route(
            "/v1/epochs/{epoch}/spot-checks",
            get(views::get_epoch_spot_checks),
        )
        .route("/v1/scores", get(views::get_scores))
        .route("/v1/noop", get(views::health))
        .route("/healthz", get(views::health))
        .route("/openapi.json", get(openapi_route))
        .route("/metrics", get(metrics_text))
        .route("/", get(dashboard::page))
        .route("/dashboard", get(dashboard::page))
        .route_layer(middleware::from_fn_with_state(
            app.clone(),
            crate::auth::public_gate,
        ));
    Router::new()
        .merge(miner_poll)
        .merge(sessions)
        .merge(miner_json)
        .merge(miner_upload)
        .merge(validator_json)
        .merge(validator_upload)
        .merge(public)
        .fallback(not_found)
        // After every route is merged: it applies to the routes present when it is called.
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(upload_limit.max(json_limit)))
        .layer(middleware::from_fn(track))
        .layer(TraceLayer::new_for_http())
        .with_state(app)
}

async fn not_found(State(_): State<App>) -> Response {
    crate::error::AppError::new(iota_protocol::ErrorCode::NotFound, "no such route").into_response()
}

/// The error body for a known path with the wrong method (axum adds the `Allow` header).
async fn method_not_allowed(method: http::Method) -> Response {
    crate::error::AppError::new(
        iota_protocol::ErrorCode::MethodNotAllowed,
        format!("this route does not take {method}"),
    )
    .into_response()
}
