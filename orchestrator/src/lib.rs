//! The IOTA orchestrator: assigns miners to stages, routes samples along random pathways, moves
//! tensors through object storage, drives the epoch phases, and serves explorers and validators.
//! It never runs the model.
//!
//! * [`run`] serves one training run on a listener until shutdown; several processes on one
//!   database serve the same run (the phase driver runs in the one holding an advisory lock).
//! * [`app`]: state, errors, the request-signing gate; [`clock`]: the one time routes and
//!   driver read; [`replay`]: its group-committed replay
//!   cache; [`signatures`]: its batched signature verification. [`miner`], [`validator`],
//!   [`views`]: routes.
//! * [`driver`]: leases, heartbeats, phases, merges, garbage collection.
//! * [`domain`]: the rules as pure functions (phase steps, stage choice, pathway draws, owners,
//!   hop and lease transitions, merge verdicts); the driver and the routes apply them.
//! * [`store`]: object storage (local directory or S3 with presigned URLs).
//! * [`dataset`]: the run's prepared dataset, published in the store and listed for members.
//! * [`replicas`]: one schema at a time on a database, across upgrades.
//!
//! `orchestrator/API.md` describes the API; `orchestrator/openapi.json` is its contract.

pub mod app;
pub mod auth;
mod batch;
mod body;
pub mod clock;
pub mod config;
pub mod dashboard;
pub mod dataset;
pub mod domain;
pub mod driver;
pub mod error;
pub mod extract;
mod json_objects;
pub mod miner;
mod objects;
pub mod poll_view;
pub mod replay;
pub mod replicas;

mod samples;
pub mod session_secret;
pub mod sessions;
pub mod signatures;
mod status;
pub mod store;
pub mod validator;
pub mod views;

use std::future::Future;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use chrono::{DateTime, Utc};
use iota_chain::{ConnectOptions, MetagraphWatcher, Subtensor, WatchOptions};
use iota_protocol::api::RunConfig;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;

pub use app::{App, AppState, Limits, RunRow, max_upload_bytes};
pub use auth::{Gate, SharedReplay, SignedRoutes};
pub use config::{Config, OrchestratorArgs};
pub use error::OrchestratorError;
pub use store::{BlobStore, StoreConfig};

/// Connects to PostgreSQL and applies the orchestrator's migrations (refusing a database that a
/// newer version migrated, or that replicas built for an older schema still serve). Every
/// connection is named [`replicas::application_name`], in place of any the URL gives: that is how
/// a later version finds this one's connections.
pub async fn connect_db(url: &str, max_connections: u32) -> Result<PgPool, OrchestratorError> {
    // The pool asserts on zero.
    if max_connections == 0 {
        return Err(OrchestratorError::Database(
            "a pool of 0 connections: give at least one".into(),
        ));
    }
    let options = PgConnectOptions::from_str(url)
        .map_err(|e| OrchestratorError::Database(e.to_string()))?
        .application_name(&replicas::application_name());
    let db = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options.clone())
        .await
        .map_err(|e| OrchestratorError::Database(e.to_string()))?;
    replicas::migrate(&options, &db).await?;
    Ok(db)
}

/// Creates the run on first start, or loads it (refusing a changed config).
pub async fn ensure_run(
    db: &PgPool,
    config: &RunConfig,
    netuid: u16,
    hotkey: &str,
    now: DateTime<Utc>,
) -> Result<RunRow, OrchestratorError> {
    let dberr = |e: sqlx::Error| OrchestratorError::Database(e.to_string());
    let json =
        serde_json::to_value(config).map_err(|e| OrchestratorError::Config(e.to_string()))?;
    let mut tx = db.begin().await.map_err(dberr)?;
    sqlx::query(
        "INSERT INTO runs (name, config, netuid, orchestrator, created_at, phase_started,
             phase_deadline)
         VALUES ($1, $2, $3, $4, $6, $6, $6 + make_interval(secs => $5))
         ON CONFLICT (name) DO NOTHING",
    )
    .bind(&config.name)
    .bind(&json)
    .bind(i32::from(netuid))
    .bind(hotkey)
    .bind(config.training_s as f64)
    .bind(now)
    .execute(&mut *tx)
    .await
    .map_err(dberr)?;
    let row = sqlx::query(
        "SELECT id, config, netuid, created_at, session_secret FROM runs WHERE name = $1",
    )
    .bind(&config.name)
    .fetch_one(&mut *tx)
    .await
    .map_err(dberr)?;
    let id: i64 = row.try_get("id").map_err(dberr)?;
    let stored: RunConfig = serde_json::from_value(row.try_get("config").map_err(dberr)?)
        .map_err(|e| OrchestratorError::Config(format!("stored run config: {e}")))?;
    let stored_netuid: i32 = row.try_get("netuid").map_err(dberr)?;
    if stored != *config || stored_netuid != i32::from(netuid) {
        let detail = if stored_netuid != i32::from(netuid) {
            format!("netuid {stored_netuid} stored, {netuid} given")
        } else {
            format!(
                "stored {}, given {}",
                serde_json::to_string(&stored).unwrap_or_default(),
                serde_json::to_string(config).unwrap_or_default()
            )
        };
        return Err(OrchestratorError::RunMismatch {
            name: config.name.clone(),
            detail,
        });
    }
    sqlx::query(
        "INSERT INTO epochs (run_id, epoch, started_at) VALUES ($1, 0, $2) ON CONFLICT DO NOTHING",
    )
    .bind(id)
    .bind(now)
    .execute(&mut *tx)
    .await
    .map_err(dberr)?;
    let created_at: DateTime<Utc> = row.try_get("created_at").map_err(dberr)?;
    let secret: Vec<u8> = row.try_get("session_secret").map_err(dberr)?;
    let session_secret = session_secret::SessionSecret::from_slice(&secret).ok_or_else(|| {
        OrchestratorError::Database(format!(
            "run {id}'s session secret is {} bytes, not 32",
            secret.len()
        ))
    })?;
    tx.commit().await.map_err(dberr)?;
    Ok(RunRow {
        id,
        config: config.clone(),
        netuid,
        created_at,
        session_secret,
    })
}

/// How often the recorder's histogram samples are folded into their summaries.
pub const METRICS_UPKEEP_EVERY: Duration = Duration::from_secs(1);

/// The process-wide Prometheus recorder (installed once; every orchestrator in the process
/// shares it).
///
/// A histogram keeps every sample recorded (one per request) until upkeep folds them into its
/// summary. Without upkeep that happens only when `/metrics` is scraped: memory grows with the
/// request rate for as long as nobody scrapes, and the scrape that finally comes folds them all
/// at once, on the runtime thread serving it (in the load benchmark's half-ceiling rounds, the
/// signed poll's p99 over the 750 ms after the bench's scrape was 57-93 ms in 3 of 6 rounds,
/// against 10-15 ms later in those rounds; with upkeep, 3-12 ms in all of 3).
/// A thread of its own runs upkeep every [`METRICS_UPKEEP_EVERY`], off the runtime's threads.
pub fn metrics_handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be installed (a host program's); ours still renders.
        let _ = metrics::set_global_recorder(recorder);
        let upkept = handle.clone();
        let started = std::thread::Builder::new()
            .name("metrics-upkeep".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(METRICS_UPKEEP_EVERY);
                    upkept.run_upkeep();
                }
            });
        if let Err(e) = started {
            tracing::warn!(error = %e, "no metrics upkeep thread: histograms fold only when scraped");
        }
        handle
    })
}

async fn metrics_text(State(app): State<App>) -> Response {
    let (hotkeys, addresses) = app.limiter_keys();
    metrics::gauge!("iota_rate_limit_keys", "scope" => "hotkey").set(hotkeys as f64);
    metrics::gauge!("iota_rate_limit_keys", "scope" => "ip").set(addresses as f64);
    // Rendered on a blocking thread: it folds the samples since the last upkeep and formats every
    // series, which a runtime thread's queued requests should not wait for.
    match tokio::task::spawn_blocking(|| metrics_handle().render()).await {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4",
            )],
            text,
        )
            .into_response(),
        Err(e) => crate::error::AppError::new(
            iota_protocol::ErrorCode::Internal,
            format!("rendering the metrics: {e}"),
        )
        .into_response(),
    }
}

async fn track(matched: Option<MatchedPath>, req: Request, next: Next) -> Response {
    let method = method_label(req.method());
    let start = std::time::Instant::now();
    let resp = next.run(req).await;
    let route = matched.as_ref().map_or("unmatched", |m| m.as_str());
    http_metrics().record(route, method, resp.status().as_u16(), start.elapsed());
    resp
}

/// A request method as a metric label: the standard ones by name, any other as `other`, so that
/// made-up methods cannot add series without bound.
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        _ => "other",
    }
}

/// The per-request HTTP metrics, with each series' handle looked up once: naming a series by
/// owned labels allocated several times per request; a lookup here allocates nothing once the
/// series exists.
#[derive(Default)]
struct HttpMetrics(std::sync::RwLock<std::collections::HashMap<String, RouteSeries>>);

/// One route's series: requests by method and status, latency by method.
#[derive(Default)]
struct RouteSeries {
    requests: Vec<(&'static str, u16, metrics::Counter)>,
    seconds: Vec<(&'static str, metrics::Histogram)>,
}

impl RouteSeries {
    fn counter(&self, method: &'static str, status: u16) -> Option<&metrics::Counter> {
        self.requests
            .iter()
            .find(|(m, s, _)| *m == method && *s == status)
            .map(|(_, _, c)| c)
    }

    fn histogram(&self, method: &'static str) -> Option<&metrics::Histogram> {
        self.seconds
            .iter()
            .find(|(m, _)| *m == method)
            .map(|(_, h)| h)
    }

    /// Records one request, or says that a series is missing.
    fn record(&self, method: &'static str, status: u16, elapsed: Duration) -> bool {
        let (Some(counter), Some(histogram)) =
            (self.counter(method, status), self.histogram(method))
        else {
            return false;
        };
        counter.increment(1);
        histogram.record(elapsed.as_secs_f64());
        true
    }
}

impl HttpMetrics {
    /// Counts a request to `route` (a route pattern or `unmatched`: a bounded set).
    fn record(&self, route: &str, method: &'static str, status: u16, elapsed: Duration) {
        let recorded = self
            .0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(route)
            .is_some_and(|series| series.record(method, status, elapsed));
        if recorded {
            return;
        }
        let mut routes = self.0.write().unwrap_or_else(|e| e.into_inner());
        let series = routes.entry(route.to_owned()).or_default();
        if series.counter(method, status).is_none() {
            let counter = metrics::counter!("iota_http_requests_total",
                "route" => route.to_owned(), "method" => method, "status" => status.to_string());
            series.requests.push((method, status, counter));
        }
        if series.histogram(method).is_none() {
            let histogram = metrics::histogram!("iota_http_request_seconds",
                "route" => route.to_owned(), "method" => method);
            series.seconds.push((method, histogram));
        }
        series.record(method, status, elapsed);
    }
}

fn http_metrics() -> &'static HttpMetrics {
    static METRICS: OnceLock<HttpMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        // Handles are bound to the recorder installed when they are made: install ours first.
        metrics_handle();
        HttpMetrics::default()
    })
}

/// The OpenAPI document.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "IOTA orchestrator API",
        description = "Signed routes carry Epistula v2 headers with the method and path bound into the signature (see API.md)."
    ),
    paths(
        miner::join::register, miner::join::heartbeat, miner::work::work, miner::uploads::upload_output, miner::uploads::presign_output,
        miner::uploads::commit_output, miner::complete::complete, miner::pseudo_gradients::reserve_pg, miner::pseudo_gradients::upload_pg, miner::pseudo_gradients::presign_pg, miner::pseudo_gradients::commit_pg,
        miner::merges::merges, miner::merges::weights, miner::merges::upload_merge, miner::merges::presign_merge, miner::merges::commit_merge, miner::blobs::blob,
        miner::blobs::report_bad_object, dataset::files, sessions::open,
        validator::hops, validator::samples, validator::epoch, validator::disputes,
        validator::settle, validator::upload_merge, validator::scores,
        validator::spot_checks, validator::report_spot_checks,
        views::get_run, views::get_status, views::get_stages, views::get_stage_weights,
        views::get_miners, views::get_loss, views::get_throughput, views::get_sample,
        views::get_merges, views::get_scores, views::health,
    ),
    modifiers(&EpistulaScheme, &UnsignedRanges),
)]
pub struct ApiDoc;

struct EpistulaScheme;

impl utoipa::Modify for EpistulaScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{ApiKey, ApiKeyValue, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "epistula",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "epistula-request-signature",
                "sr25519 signature over sha256(body).uuid.timestamp.signed_for.METHOD.path_and_query, with the other Epistula-* headers and Iota-Body-Sha256 (required on uploads and bodies over 64 KiB)",
            ))),
        );
        components.add_security_scheme(
            "session",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "iota-session-mac",
                "keyed BLAKE3 (the session's key) over the same message as an epistula signature, with Iota-Session naming the session (POST /v1/sessions) and the other Epistula-* headers but Epistula-Request-Signature",
            ))),
        );
        // Every signed route takes a session's MAC too, but the route that opens a session.
        let epistula =
            utoipa::openapi::security::SecurityRequirement::new("epistula", Vec::<String>::new());
        let session =
            utoipa::openapi::security::SecurityRequirement::new("session", Vec::<String>::new());
        for (path, item) in openapi.paths.paths.iter_mut() {
            if path == iota_protocol::session::SESSIONS_PATH {
                continue;
            }
            for operation in [&mut item.get, &mut item.post, &mut item.put]
                .into_iter()
                .flatten()
            {
                if let Some(security) = &mut operation.security
                    && security.contains(&epistula)
                {
                    security.push(session.clone());
                }
            }
        }
    }
}

/// Declares the range the server takes for unsigned path and query integers. utoipa writes a
/// `u64` as `int64` from 0 and a `u32` as `int32` from 0; the server parses a `u64` parameter as an
/// [`extract::Bigint`] (at most `i64::MAX`, the database's `bigint`) and a `u32` up to
/// `u32::MAX`, which `int32` would not allow. So a client (or a fuzzer) reading the document
/// knows exactly which values are refused.
struct UnsignedRanges;

impl utoipa::Modify for UnsignedRanges {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::Number;
        use utoipa::openapi::RefOr;
        use utoipa::openapi::schema::{KnownFormat, Schema, SchemaFormat};
        for item in openapi.paths.paths.values_mut() {
            let operations = [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.delete,
            ];
            for op in operations.into_iter().flatten() {
                for param in op.parameters.iter_mut().flatten() {
                    let RefOr::T(param) = param else { continue };
                    let Some(RefOr::T(Schema::Object(o))) = param.schema.as_mut() else {
                        continue;
                    };
                    let from_zero = match o.minimum {
                        Some(Number::UInt(n)) => n == 0,
                        Some(Number::Int(n)) => n == 0,
                        Some(Number::Float(n)) => n == 0.0,
                        None => false,
                    };
                    if !from_zero || o.maximum.is_some() {
                        continue;
                    }
                    match &o.format {
                        Some(SchemaFormat::KnownFormat(KnownFormat::Int64)) => {
                            o.maximum = Some(Number::UInt(i64::MAX as usize));
                        }
                        Some(SchemaFormat::KnownFormat(KnownFormat::Int32)) => {
                            o.format = Some(SchemaFormat::KnownFormat(KnownFormat::Int64));
                            o.maximum = Some(Number::UInt(u32::MAX as usize));
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

/// The OpenAPI document as pretty JSON (what `orchestrator/openapi.json` holds).
pub fn openapi_json() -> String {
    ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

async fn openapi_route() -> impl IntoResponse {
    // Built once: a public route, and the document does not change while the process runs.
    static DOC: OnceLock<bytes::Bytes> = OnceLock::new();
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        DOC.get_or_init(|| bytes::Bytes::from(openapi_json()))
            .clone(),
    )
}

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
        .route("/v1/epochs/{epoch}/merges", get(views::get_merges))
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

/// Serves the run until `shutdown` resolves: migrations, run row, metagraph watcher, phase
/// driver, HTTP. Stops by itself, with [`OrchestratorError::SchemaNewer`], when a newer version
/// migrates the database under it.
pub async fn run(
    config: Config,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), OrchestratorError> {
    config.run.validate().map_err(OrchestratorError::Config)?;
    let store =
        BlobStore::open(&config.store).map_err(|e| OrchestratorError::Store(e.to_string()))?;
    let db = connect_db(&config.database_url, config.db_max_connections).await?;
    let clock: Arc<dyn clock::Clock> = Arc::new(clock::SystemClock);
    let run = ensure_run(&db, &config.run, config.netuid, &config.hotkey, clock.now()).await?;
    if let Some(source) = &config.dataset {
        // Before serving: a member that finds the run finds its dataset.
        let Some(hash) = config.run.dataset.as_deref() else {
            return Err(OrchestratorError::Config(format!(
                "a dataset ({source}) for a run that names no dataset"
            )));
        };
        let done = dataset::publish(&store, source, hash)
            .await
            .map_err(|e| OrchestratorError::Dataset(e.to_string()))?;
        tracing::info!(dataset = %hash, uploaded = done.uploaded.len(), kept = done.kept.len(),
            "dataset published in the run's store");
    }
    let chain_err = |reason: String| OrchestratorError::Chain {
        url: config.chain_endpoint.clone(),
        netuid: config.netuid,
        reason,
    };
    let mut options = ConnectOptions::new(config.chain_endpoint.clone());
    options.connect_timeout = config.chain_timeout;
    options.request_timeout = config.chain_timeout;
    let chain = tokio::time::timeout(config.chain_timeout, Subtensor::connect(options))
        .await
        .map_err(|_| {
            chain_err(format!(
                "no answer within {} s",
                config.chain_timeout.as_secs_f64()
            ))
        })?
        .map_err(|e| chain_err(e.to_string()))?;
    let watcher = MetagraphWatcher::spawn(
        chain,
        config.netuid,
        WatchOptions {
            every: config.metagraph_refresh,
            // A chain back from an outage is read again within this: hotkeys registered
            // meanwhile are refused until then.
            max_backoff: config.metagraph_refresh.max(Duration::from_secs(30)),
        },
    )
    .await
    .map_err(|e| chain_err(e.to_string()))?;
    let mut state = AppState::new(
        db,
        store,
        run,
        config.hotkey.clone(),
        watcher.subscribe(),
        config.skew,
        config.limits,
        config.max_merge_rounds,
    );
    state.trusted_proxies = config.trusted_proxies.clone();
    let state = state.with_clock(clock);
    let state: App = Arc::new(state);
    // Before anything is spawned: a refused join leaves no task behind.
    let addr = listener.local_addr()?;
    let replica = replicas::Replica::join(&state.db, addr.to_string()).await?;
    metrics_handle();
    state.poll_view.start();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let driver = tokio::spawn(driver::run_driver(
        state.clone(),
        config.tick,
        stop_rx.clone(),
    ));
    let (upgraded_tx, upgraded) = tokio::sync::watch::channel(None);
    let beats = tokio::spawn(replica.keep_alive(state.db.clone(), upgraded_tx, stop_rx));
    let mut upgrade_seen = upgraded.clone();
    let shutdown = async move {
        tokio::select! {
            () = shutdown => {}
            // Also when the beats end, which they do only on an upgrade or after the stop.
            _ = upgrade_seen.wait_for(Option::is_some) => {}
        }
    };
    tracing::info!(%addr, run = state.run.id, netuid = config.netuid, "orchestrator serving");
    let served = axum::serve(
        listener,
        router(state.clone()).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await;
    let _ = stop_tx.send(true);
    let _ = driver.await;
    let _ = beats.await;
    drop(watcher);
    served?;
    if let Some(applied) = *upgraded.borrow() {
        return Err(OrchestratorError::SchemaNewer {
            applied,
            known: replicas::schema_version(),
        });
    }
    Ok(())
}

/// Re-exported for the CLI's `openapi` command and tests.
pub fn openapi() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}
