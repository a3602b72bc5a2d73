//! The IOTA orchestrator: assigns miners to stages, routes samples along random pathways, moves
//! tensors through object storage, drives the epoch phases, and serves explorers and validators.
//! It never runs the model.
//!
//! * [`run`] serves one training run on a listener until shutdown; several processes on one
//!   database serve the same run (the phase driver runs in the one holding an advisory lock).
//! * [`http`]: the router, the OpenAPI document, extractors and the thin route handlers
//!   (`miner`, `validator`, `views`, `dashboard`, `dataset`, `sessions`). Below it the driver,
//!   the run's transitions and the domain know nothing of HTTP.
//! * [`app`]: the state the routes share; [`auth`]: the request-signing gate, rate limits and
//!   upload slots; [`clock`]: the one time routes and driver read; [`replay`]: the
//!   group-committed replay cache; [`signatures`]: batched signature verification.
//! * [`driver`]: leases, heartbeats, phases, merges, garbage collection; with [`samples`], the
//!   run's transitions below the routes ([`error::RunError`]).
//! * [`db`]: every statement of the run's state, one function per statement (`replicas` keeps
//!   the schema's own).
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
pub mod dataset;
pub mod db;
pub mod domain;
pub mod driver;
pub mod error;
pub mod http;
mod json_objects;
mod objects;
pub mod poll_view;
pub mod replay;
pub mod replicas;

mod samples;
pub mod session_secret;
pub mod signatures;
pub mod store;

use std::future::Future;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use iota_chain::{ConnectOptions, MetagraphWatcher, Subtensor, WatchOptions};
use iota_protocol::api::RunConfig;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use app::{App, AppState, Limits, RunRow, max_upload_bytes};
pub use auth::{Gate, SharedReplay, SignedRoutes};
pub use config::{Config, OrchestratorArgs};
pub use error::OrchestratorError;
pub use http::metrics::{METRICS_UPKEEP_EVERY, metrics_handle};
pub use http::openapi::{openapi, openapi_json};
pub use http::router;
pub use store::{BlobStore, PresignedParts, StoreConfig};

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
    let new = db::runs::NewRun {
        name: &config.name,
        config: &json,
        netuid: i32::from(netuid),
        orchestrator: hotkey,
        at: now,
        training_until: now + domain::leases::secs(config.training_s),
    };
    db::runs::create(&mut *tx, new).await.map_err(dberr)?;
    let row = db::runs::by_name(&mut *tx, &config.name)
        .await
        .map_err(dberr)?;
    let id = row.id;
    let stored: RunConfig = serde_json::from_value(row.config)
        .map_err(|e| OrchestratorError::Config(format!("stored run config: {e}")))?;
    let stored_netuid = row.netuid;
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
    db::epochs::start(&mut *tx, id, 0, now)
        .await
        .map_err(dberr)?;
    let created_at = row.created_at;
    let secret = row.session_secret;
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
