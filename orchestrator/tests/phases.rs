//! The epoch state machine under a clock the test controls: deadlines pass without sleeping,
//! and an epoch always advances whatever miners do (or fail to do).
//!
//! The orchestrator's handlers are served in-process over a metagraph the test builds; the phase
//! driver is stepped by hand with `driver::step(app, now)` at chosen times.

mod common;

use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};
use common::*;
use iota_chain::{Member, Members, MetagraphIndex};
use iota_orchestrator::sim::SimMiner;
use iota_orchestrator::{App, AppState, BlobStore, Limits, StoreConfig, driver};
use iota_protocol::api::*;
use iota_protocol::signing::SkewWindow;
use sqlx::PgPool;

fn metagraph(seeds: &[u8]) -> MetagraphIndex {
    MetagraphIndex::new(Members {
        netuid: 7,
        block: 1,
        members: seeds
            .iter()
            .enumerate()
            .map(|(i, s)| Member {
                uid: i as u16,
                hotkey: public(&pair(*s)),
                validator_permit: false,
            })
            .collect(),
    })
}

struct Served {
    app: App,
    base: String,
    db: PgPool,
    _store: tempfile::TempDir,
    _metagraph: tokio::sync::watch::Sender<Arc<MetagraphIndex>>,
}

/// Handlers served over a fixed metagraph; no phase driver runs on its own.
async fn serve(seeds: &[u8], run: RunConfig) -> Served {
    let db_url = fresh_db().await;
    let db = iota_orchestrator::connect_db(&db_url, 8).await.expect("db");
    let row = iota_orchestrator::ensure_run(&db, &run, 7, &pair(200).ss58_of())
        .await
        .expect("run");
    let store = tempfile::tempdir().expect("tempdir");
    let blobs = BlobStore::open(&StoreConfig::Local(store.path().into())).expect("store");
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(metagraph(seeds)));
    let app: App = Arc::new(AppState::new(
        db.clone(),
        blobs,
        row,
        pair(200).ss58_of(),
        rx,
        SkewWindow::default(),
        Limits {
            per_hotkey_rps: 1000,
            per_hotkey_burst: 1000,
            per_ip_rps: 1000,
            per_ip_burst: 1000,
            ..Limits::default()
        },
        2,
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let router = iota_orchestrator::router(app.clone());
    tokio::spawn(async move {
        let _ = axum::serve(
            listener,
            router.into_make_service_with_connect_info::<std::net::SocketAddr>(),
        )
        .await;
    });
    Served {
        app,
        base,
        db,
        _store: store,
        _metagraph: tx,
    }
}

trait Ss58Of {
    fn ss58_of(&self) -> String;
}

impl Ss58Of for sp_core::sr25519::Pair {
    fn ss58_of(&self) -> String {
        iota_protocol::signing::RequestSigner::ss58(self)
    }
}

async fn now_status(s: &Served) -> (u64, Phase, DateTime<Utc>, i32) {
    let (epoch, phase, deadline, round): (i64, String, DateTime<Utc>, i32) =
        sqlx::query_as("SELECT epoch, phase, phase_deadline, merge_round FROM runs")
            .fetch_one(&s.db)
            .await
            .expect("run row");
    (
        epoch as u64,
        Phase::parse(&phase).expect("phase"),
        deadline,
        round,
    )
}

fn config() -> RunConfig {
    let mut run = run_config("phases");
    run.training_s = 600;
    run.uploading_s = 300;
    run.merging_s = 300;
    run.merge_round_s = 100;
    run.heartbeat_timeout_s = 3600;
    run.lease_s = 3600;
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_advances_when_miners_go_silent_at_every_phase() {
    init_tracing();
    let seeds = [51u8, 52, 53];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = Vec::new();
    for (i, seed) in seeds.iter().enumerate() {
        miners.push(
            SimMiner::join(&s.base, signer(*seed), 10.0 + i as f64, u64::from(*seed))
                .await
                .expect("join"),
        );
    }
    // Some samples go all the way; then the miners stop, with samples still in flight.
    for _ in 0..6 {
        for m in &mut miners {
            m.step().await.expect("step");
        }
    }
    let done: i64 = sqlx::query_scalar("SELECT count(*) FROM samples WHERE status = 'done'")
        .fetch_one(&s.db)
        .await
        .expect("count");
    assert!(done >= 1, "no sample finished");
    let t0 = Utc::now();
    driver::step(&s.app, t0).await.expect("step");
    assert_eq!(
        now_status(&s).await.1,
        Phase::Training,
        "nothing is due yet"
    );

    // The training deadline passes with work in flight.
    let (_, _, deadline, _) = now_status(&s).await;
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("step");
    let (epoch, phase, deadline, _) = now_status(&s).await;
    assert_eq!((epoch, phase), (0, Phase::Uploading));

    // Only the stage-0 miner uploads; the deadline passes for the others.
    let stage0 = miners.iter_mut().find(|m| m.stage == 0).expect("stage 0");
    let report = stage0.step().await.expect("upload");
    assert_eq!(report.pseudo_gradients, run.partitions);
    driver::step(&s.app, deadline - Duration::seconds(1))
        .await
        .expect("step");
    assert_eq!(
        now_status(&s).await.1,
        Phase::Uploading,
        "quorum not reached before the deadline"
    );
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("step");
    let (_, phase, deadline, round) = now_status(&s).await;
    assert_eq!((phase, round), (Phase::Merging, 0));
    let merges: Vec<PartitionStatus> = reqwest::get(format!("{}/v1/epochs/0/merges", s.base))
        .await
        .expect("merges")
        .json()
        .await
        .expect("json");
    let stage0_index = stage0.stage;
    for p in &merges {
        if p.stage == stage0_index {
            assert_eq!(p.state, PartitionState::Open);
            assert_eq!(
                p.owners.len(),
                2,
                "two owners even with one miner on the stage"
            );
        } else {
            assert_eq!(
                p.state,
                PartitionState::Unchanged,
                "no contributions: {p:?}"
            );
        }
    }

    // Nobody merges: two reassignment rounds, then the epoch ends anyway. The clock jump also
    // releases the silent miners.
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("step");
    let (_, phase, deadline, round) = now_status(&s).await;
    assert_eq!((phase, round), (Phase::Merging, 1));
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("step");
    let (_, phase, deadline, round) = now_status(&s).await;
    assert_eq!((phase, round), (Phase::Merging, 2));
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("step");
    let (epoch, phase, _, _) = now_status(&s).await;
    assert_eq!((epoch, phase), (1, Phase::Training), "the epoch advanced");
    let merges: Vec<PartitionStatus> = reqwest::get(format!("{}/v1/epochs/0/merges", s.base))
        .await
        .expect("merges")
        .json()
        .await
        .expect("json");
    assert!(
        merges.iter().all(|p| p.state == PartitionState::Unchanged),
        "{merges:?}"
    );
    let in_flight: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM samples WHERE epoch = 0 AND status IN ('forward', 'backward')",
    )
    .fetch_one(&s.db)
    .await
    .expect("count");
    assert_eq!(in_flight, 0, "samples of the ended epoch are closed");
    let open_hops: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tasks WHERE epoch = 0 AND status IN ('pending', 'leased')",
    )
    .fetch_one(&s.db)
    .await
    .expect("count");
    assert_eq!(open_hops, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_merge_result_is_taken_at_the_last_deadline() {
    init_tracing();
    let seeds = [61u8, 62, 63];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = Vec::new();
    for (i, seed) in seeds.iter().enumerate() {
        miners.push(
            SimMiner::join(&s.base, signer(*seed), 10.0 + i as f64, u64::from(*seed))
                .await
                .expect("join"),
        );
    }
    // Train until every sample is done: training ends by quorum, not deadline.
    let t = Utc::now();
    for _ in 0..200 {
        for m in &mut miners {
            m.step().await.expect("step");
        }
        driver::step(&s.app, t).await.expect("step");
        if now_status(&s).await.1 != Phase::Training {
            break;
        }
    }
    assert_eq!(
        now_status(&s).await.1,
        Phase::Uploading,
        "training ends by quorum"
    );
    // Everyone uploads: uploading ends by quorum too.
    for m in &mut miners {
        m.step().await.expect("upload");
    }
    driver::step(&s.app, t).await.expect("step");
    let (_, phase, deadline, _) = now_status(&s).await;
    assert_eq!(phase, Phase::Merging, "uploading ends by quorum");
    // Only one miner merges; for its partitions it is the only result.
    let report = miners[0].step().await.expect("merge");
    assert!(report.merges > 0);
    let mine = report.merges as usize;
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("round 1");
    let (_, _, deadline, _) = now_status(&s).await;
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("round 2");
    let (_, _, deadline, _) = now_status(&s).await;
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("end");
    assert_eq!(now_status(&s).await.0, 1);
    let merges: Vec<PartitionStatus> = reqwest::get(format!("{}/v1/epochs/0/merges", s.base))
        .await
        .expect("merges")
        .json()
        .await
        .expect("json");
    let single: Vec<&PartitionStatus> = merges
        .iter()
        .filter(|p| p.resolved_by.as_deref() == Some("single"))
        .collect();
    assert_eq!(single.len(), mine, "{merges:?}");
    assert!(
        single
            .iter()
            .all(|p| p.state == PartitionState::Accepted && p.results.len() == 1)
    );
    assert_eq!(
        merges
            .iter()
            .filter(|p| p.state == PartitionState::Unchanged)
            .count(),
        merges.len() - mine
    );
}
