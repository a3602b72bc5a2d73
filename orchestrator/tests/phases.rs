//! The epoch state machine under a clock the test controls: deadlines pass without sleeping,
//! and an epoch always advances whatever miners do (or fail to do).
//!
//! The orchestrator's handlers are served in-process over a metagraph the test builds; the phase
//! driver is stepped by hand with `driver::step(app, now)` at chosen times.

use crate::common;

use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};
use common::*;
use iota_chain::{Member, Members, MetagraphIndex};
use iota_orchestrator::clock::{Clock, OffsetClock, SystemClock};
use iota_orchestrator::{App, AppState, BlobStore, Limits, StoreConfig, driver};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use iota_protocol::signing::SkewWindow;
use iota_testkit::sim::SimMiner;
use sqlx::PgPool;

/// Seeds from this one on have validator permits.
const FIRST_VALIDATOR: u8 = 240;

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
                validator_permit: *s >= FIRST_VALIDATOR,
                stake: 0,
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

/// Lock requests on this database that are waiting (of advisory locks only, when `advisory`).
async fn lock_waits(db: &sqlx::PgPool, advisory: bool) -> i64 {
    sqlx::query_scalar(
        // By the waiting session's database: a row lock's wait is on a transaction id, which
        // names no database.
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE a.datname = current_database() AND NOT l.granted
           AND (l.locktype = 'advisory' OR NOT $1)",
    )
    .bind(advisory)
    .fetch_one(db)
    .await
    .expect("locks")
}

/// Waits until `n` lock requests on this database are waiting (advisory locks only, when
/// `advisory`): the concurrent step under test has reached the lock it must wait for, so what
/// the test does next races with it for certain, not only when it happened to be quick.
async fn until_waiting_for_locks(db: &sqlx::PgPool, n: i64, advisory: bool) {
    eventually(
        "the step under test waits for a lock",
        std::time::Duration::from_secs(10),
        || async { (lock_waits(db, advisory).await >= n).then_some(()) },
    )
    .await;
}

/// Handlers served over a fixed metagraph; no phase driver runs on its own.
async fn serve(seeds: &[u8], run: RunConfig) -> Served {
    serve_with(seeds, run, None).await
}

/// [`serve`], with blobs in `store` (a local directory if `None`).
async fn serve_with(seeds: &[u8], run: RunConfig, store_config: Option<StoreConfig>) -> Served {
    serve_on(seeds, run, store_config, Arc::new(SystemClock)).await
}

/// [`serve_with`], on the run's clock `clock`.
async fn serve_on(
    seeds: &[u8],
    run: RunConfig,
    store_config: Option<StoreConfig>,
    clock: Arc<dyn Clock>,
) -> Served {
    let db_url = fresh_db().await;
    let db = iota_orchestrator::connect_db(&db_url, 8).await.expect("db");
    if store_config.is_some() {
        // Keys in a shared bucket start with the run's id: one of this test's own, not the 1
        // every fresh database gives, which the tests running beside it would write too.
        let id = i64::from(seeds[0]) * 1_000_000 + i64::from(std::process::id() % 1_000_000);
        sqlx::query("SELECT setval(pg_get_serial_sequence('runs', 'id'), $1)")
            .bind(id)
            .execute(&db)
            .await
            .expect("run id");
    }
    let row = iota_orchestrator::ensure_run(&db, &run, 7, &pair(200).ss58_of(), clock.now())
        .await
        .expect("run");
    let store = tempfile::tempdir().expect("tempdir");
    let store_config = store_config.unwrap_or_else(|| StoreConfig::Local(store.path().into()));
    let blobs = BlobStore::open(&store_config).expect("store");
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(metagraph(seeds)));
    let app: App = Arc::new(
        AppState::new(
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
        )
        .with_clock(clock),
    );
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

/// Steps the driver one second past the current phase's deadline; the run's status after it.
async fn past_the_deadline(s: &Served) -> (u64, Phase, DateTime<Utc>, i32) {
    let (_, _, deadline, _) = now_status(s).await;
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("step");
    now_status(s).await
}

/// A simulated miner for each seed, joined in order (throughput 10, 11, … tokens/s).
async fn join_all(s: &Served, seeds: &[u8]) -> Vec<SimMiner> {
    let mut miners = Vec::new();
    for (i, seed) in seeds.iter().enumerate() {
        miners.push(
            SimMiner::join(&s.base, signer(*seed), 10.0 + i as f64, u64::from(*seed))
                .await
                .expect("join"),
        );
    }
    miners
}

/// Steps every miner, up to 40 rounds, until `enough` holds of the hotkeys that have done
/// gradient work in epoch 0 (a backward, or a forward on the last stage); those hotkeys.
async fn step_until_workers(
    s: &Served,
    miners: &mut [SimMiner],
    stages: u32,
    enough: impl Fn(&[String]) -> bool,
) -> Vec<String> {
    let mut worked = Vec::new();
    for _ in 0..40 {
        for m in miners.iter_mut() {
            m.step().await.expect("step");
        }
        worked = sqlx::query_scalar(
            "SELECT DISTINCT miner FROM tasks WHERE epoch = 0 AND status = 'done'
               AND (direction = 'backward' OR stage = $1)",
        )
        .bind(stages as i32 - 1)
        .fetch_all(&s.db)
        .await
        .expect("workers");
        if enough(&worked) {
            break;
        }
    }
    worked
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

/// A hop routed to a miner that stays registered (its heartbeats go on) but never asks for work
/// moves once it has waited two leases: a forward hop to another miner of its stage. Such a
/// miner (its work loop hung, or it only claims throughput to draw hops) once held every hop
/// routed to it until the epoch ended, each a sample in flight that stage 0 could not replace.
/// Handlers stamp the run's state by the run's clock, the one the driver compares it with: on a
/// clock ten days ahead of the database's, a lease just taken and its miner's heartbeat are fresh
/// to the driver's next step (by the database's clock both would be ten days old: the miner
/// released as silent, its hop taken back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_and_the_driver_read_one_clock() {
    init_tracing();
    let ahead = Duration::days(10);
    let seeds = [111u8, 112, 113];
    let s = serve_on(&seeds, config(), None, Arc::new(OffsetClock(ahead))).await;
    let miners = join_all(&s, &seeds).await;
    let mut leased = Vec::new();
    for m in &miners {
        leased.extend(m.client().work(1).await.expect("poll").items);
    }
    assert!(!leased.is_empty(), "no miner was given a hop");
    let (leased_at, last_seen): (DateTime<Utc>, DateTime<Utc>) = sqlx::query_as(
        "SELECT t.leased_at, m.last_seen FROM tasks t JOIN miners m ON m.hotkey = t.miner
         WHERE t.status = 'leased' ORDER BY t.id LIMIT 1",
    )
    .fetch_one(&s.db)
    .await
    .expect("a leased hop");
    let ahead_of_wall = Utc::now() + ahead - Duration::minutes(1);
    assert!(
        leased_at > ahead_of_wall && last_seen > ahead_of_wall,
        "stamped by another clock: leased at {leased_at}, miner seen at {last_seen}"
    );
    driver::step(&s.app, s.app.now()).await.expect("step");
    let (leases, active): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM tasks WHERE status = 'leased'),
                (SELECT count(*) FROM miners WHERE status = 'active')",
    )
    .fetch_one(&s.db)
    .await
    .expect("counts");
    assert_eq!(leases, leased.len() as i64, "a fresh lease was taken back");
    assert_eq!(
        active,
        seeds.len() as i64,
        "a miner that just polled was released"
    );
}

/// A miner that is working (it holds a live lease) keeps its backlog however long it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hop_its_miner_never_leases_moves_after_two_leases() {
    init_tracing();
    let seeds = [101u8, 102, 103, 104, 105, 106];
    let mut run = config();
    run.lease_s = 60;
    // Enough samples that two reach the miner that never polls: the other's measured throughput
    // may draw up to four in five of the stage's hops.
    run.samples_per_epoch = 48;
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    // A later stage with two miners: one of them never polls.
    let stage = (1..run.stages)
        .find(|st| miners.iter().filter(|m| m.stage == *st).count() >= 2)
        .expect("a later stage with two miners");
    let hung = miners
        .iter()
        .position(|m| m.stage == stage)
        .expect("the hung miner");
    let hung_key = pair(seeds[hung]).ss58_of();
    let pending_for_hung = || async {
        sqlx::query_as::<_, (i64, i64, i32)>(
            "SELECT id, sample_id, attempt FROM tasks
             WHERE miner = $1 AND status = 'pending' AND direction = 'forward'",
        )
        .bind(&hung_key)
        .fetch_all(&s.db)
        .await
        .expect("tasks")
    };
    let mut routed = Vec::new();
    for _ in 0..160 {
        for (i, m) in miners.iter_mut().enumerate() {
            if i != hung {
                m.step().await.expect("step");
            }
        }
        routed = pending_for_hung().await;
        if routed.len() >= 2 {
            break;
        }
    }
    assert!(
        routed.len() >= 2,
        "two hops were not routed to the miner that never polls: {routed:?}"
    );

    // Not yet due.
    driver::step(&s.app, Utc::now() + Duration::seconds(1))
        .await
        .expect("step");
    assert_eq!(pending_for_hung().await, routed, "moved before its time");
    // While the miner works on one of them (a live lease), the others wait for it.
    let due = Utc::now() + Duration::seconds(2 * run.lease_s as i64 + 5);
    let (working, waiting) = (routed[0].0, routed[1..].to_vec());
    sqlx::query(
        "UPDATE tasks SET status = 'leased', lease = gen_random_uuid(), leased_at = now(),
             leased_until = $2 + interval '1 hour' WHERE id = $1",
    )
    .bind(working)
    .bind(due)
    .execute(&s.db)
    .await
    .expect("a live lease");
    driver::step(&s.app, due).await.expect("step");
    // (The other miners' leases lapse at that time too, and some of their hops may be
    // re-routed to this miner.)
    let still = pending_for_hung().await;
    assert!(
        waiting.iter().all(|hop| still.contains(hop)),
        "a working miner's backlog was moved: {waiting:?} against {still:?}"
    );
    // Once it holds no live lease, two leases after routing they move to the other miner of
    // the stage, as the next attempt.
    sqlx::query("UPDATE tasks SET leased_until = now() WHERE id = $1")
        .bind(working)
        .execute(&s.db)
        .await
        .expect("the lease lapses");
    driver::step(&s.app, due).await.expect("step");
    for (id, sample, attempt) in &routed {
        let status: String = sqlx::query_scalar("SELECT status FROM tasks WHERE id = $1")
            .bind(id)
            .fetch_one(&s.db)
            .await
            .expect("status");
        assert_eq!(
            status, "expired",
            "task {id} still waits for the miner that never polls"
        );
        let next: (String, String) = sqlx::query_as(
            "SELECT miner, status FROM tasks
             WHERE sample_id = $1 AND stage = $2 AND direction = 'forward' AND attempt = $3",
        )
        .bind(sample)
        .bind(stage as i32)
        .bind(attempt + 1)
        .fetch_one(&s.db)
        .await
        .expect("the next attempt");
        assert_ne!(next.0, hung_key, "re-routed to the same miner");
        assert_eq!(next.1, "pending");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_advances_when_miners_go_silent_at_every_phase() {
    init_tracing();
    let seeds = [51u8, 52, 53];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
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
    let (epoch, phase, deadline, _) = past_the_deadline(&s).await;
    assert_eq!((epoch, phase), (0, Phase::Uploading));

    // Only the stage-0 miner uploads; the deadline passes for the others.
    let stage0 = miners.iter_mut().find(|m| m.stage == 0).expect("stage 0");
    let report = step_until_report(stage0, |r| r.pseudo_gradients > 0).await;
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
                3,
                "three owners even with one miner on the stage"
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
    let (counted, abandoned) = abandoned_counts(&s.db).await;
    assert_eq!(counted, abandoned, "samples_abandoned disagrees");
    let open_hops: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tasks WHERE epoch = 0 AND status IN ('pending', 'leased')",
    )
    .fetch_one(&s.db)
    .await
    .expect("count");
    assert_eq!(open_hops, 0);
}

/// The uploading quorum counts the uploads of the miners still expected to upload. A miner
/// whose gradient work was failed after it uploaded (a bad object it produced) is no longer one,
/// and its partitions once stood in for those of a worker that had not uploaded yet: merging
/// started early, and that worker's upload was refused with `wrong_phase`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upload_quorum_waits_for_every_worker_still_expected() {
    init_tracing();
    let seeds = [121u8, 122, 123, 124, 125, 126];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let worked = step_until_workers(&s, &mut miners, run.stages, |w| w.len() >= 3).await;
    assert_eq!(past_the_deadline(&s).await.1, Phase::Uploading);
    let workers: Vec<usize> = (0..seeds.len())
        .filter(|&i| worked.contains(&pair(seeds[i]).ss58_of()))
        .collect();
    // Every worker but the last uploads, the failed one among them: with its uploads counted,
    // the quorum would be met.
    let [_, failed, .., late] = workers[..] else {
        panic!("three workers: {worked:?}");
    };
    for &i in workers.iter().filter(|&&i| i != late) {
        let report = step_until_report(&mut miners[i], |r| r.pseudo_gradients > 0).await;
        assert_eq!(
            report.pseudo_gradients, run.partitions,
            "every partition uploaded"
        );
    }
    // The second's gradient work is failed afterwards.
    sqlx::query(
        "UPDATE tasks SET status = 'failed'
         WHERE miner = $1 AND status = 'done' AND (direction = 'backward' OR stage = $2)",
    )
    .bind(pair(seeds[failed]).ss58_of())
    .bind(run.stages as i32 - 1)
    .execute(&s.db)
    .await
    .expect("fail its hops");
    driver::step(&s.app, Utc::now()).await.expect("step");
    assert_eq!(
        now_status(&s).await.1,
        Phase::Uploading,
        "merging started without the upload of a worker still expected"
    );
    let report = step_until_report(&mut miners[late], |r| r.pseudo_gradients > 0).await;
    assert_eq!(report.pseudo_gradients, run.partitions);
    driver::step(&s.app, Utc::now()).await.expect("step");
    assert_eq!(now_status(&s).await.1, Phase::Merging, "the quorum is met");
}

/// A hop of an ended epoch left open (routed by a statement that raced with the switch to the
/// next epoch) is closed at the driver's next step, and never leased. Nothing looked at such a
/// hop again: it was leased, lapsed and re-routed for the rest of the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_hop_of_an_ended_epoch_is_closed() {
    init_tracing();
    let seeds = [131u8, 132, 133];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    step_until_workers(&s, &mut miners, run.stages, |w| !w.is_empty()).await;
    past_the_deadline(&s).await;
    step_until(&s, &mut miners, |st| st.0 == 1).await;
    // What such a race leaves: a hop of epoch 0, routed to a miner of its stage.
    let i = miners
        .iter()
        .position(|m| m.stage == 1)
        .expect("a stage-1 miner");
    let sample: i64 = sqlx::query_scalar("SELECT min(id) FROM samples WHERE epoch = 0")
        .fetch_one(&s.db)
        .await
        .expect("a sample of epoch 0");
    let stale: i64 = sqlx::query_scalar(
        "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, attempt, miner, status,
             leased_until)
         VALUES ($1, 0, $2, 1, 'forward', 99, $3, 'pending', now() + interval '1 hour')
         RETURNING id",
    )
    .bind(s.app.run.id)
    .bind(sample)
    .bind(pair(seeds[i]).ss58_of())
    .fetch_one(&s.db)
    .await
    .expect("a stale hop");
    driver::step(&s.app, Utc::now()).await.expect("step");
    let status: String = sqlx::query_scalar("SELECT status FROM tasks WHERE id = $1")
        .bind(stale)
        .fetch_one(&s.db)
        .await
        .expect("status");
    assert_eq!(status, "abandoned");
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tasks WHERE epoch = 0 AND status IN ('pending', 'leased')",
    )
    .fetch_one(&s.db)
    .await
    .expect("count");
    assert_eq!(open, 0, "a hop of the ended epoch was re-routed");
    let work = miners[i].client().work(32).await.expect("poll");
    assert!(
        work.items.iter().all(|item| item.task_id != stale),
        "a hop of an ended epoch was leased"
    );
}

/// A partition nobody merged by the merge deadline is put to validators as well as to a new
/// owner, and a validator's own merge settles it: it is merged even with no miner left to do
/// it. Such a partition once kept its weights at the epoch's end (`unmerged`), its
/// contributions dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_nobody_merged_is_merged_by_a_validator() {
    init_tracing();
    let seeds = [141u8, 142, 143];
    let validator = FIRST_VALIDATOR;
    let run = config();
    let s = serve(&[&seeds[..], &[validator]].concat(), run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let deadline = merging_after_uploads(&s, &mut miners, &seeds).await;
    let open: Vec<(i32, i32)> = sqlx::query_as(
        "SELECT stage, partition FROM partitions WHERE epoch = 0 AND state = 'open'
         ORDER BY stage, partition",
    )
    .fetch_all(&s.db)
    .await
    .expect("open partitions");
    assert!(!open.is_empty(), "partitions to merge");
    // Nobody merges by the deadline: a new owner each, and a dispute each for validators.
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("step");
    assert_eq!(now_status(&s).await.3, 1, "a reassignment round");
    let v = iota_protocol::ApiClient::new(
        s.base.clone(),
        signer(validator),
        pair(200).ss58_of(),
        iota_protocol::RetryPolicy::default(),
    )
    .expect("client");
    let disputes = v.disputes().await.expect("disputes");
    let asked: Vec<(i32, i32)> = disputes
        .iter()
        .map(|d| (d.partition.stage as i32, d.partition.partition as i32))
        .collect();
    assert_eq!(asked, open, "every unmerged partition is put to validators");
    // A validator merges one itself and settles it with its own result.
    let d = &disputes[0];
    let (stage, partition) = (d.partition.stage, d.partition.partition);
    let range = run.partition_range(stage, partition).expect("partition");
    let len = (range.end - range.start) as usize;
    let bytes = iota_protocol::tensor::encode_merged(&vec![0.5; len], &vec![0.0; len]);
    let hash = iota_protocol::blob::blake3_hex(&bytes);
    v.validator_merge(0, stage, partition, bytes.into())
        .await
        .expect("the validator's merge");
    let settled = v.settle(d.id, &hash).await.expect("settled");
    assert_eq!(settled.state, PartitionState::Accepted, "{settled:?}");
    assert_eq!(
        settled.accepted.as_ref().map(|b| b.blake3.as_str()),
        Some(hash.as_str())
    );
    assert_eq!(
        settled.resolved_by,
        Some(format!("validator:{}", pair(validator).ss58_of()))
    );
}

/// Two processes that both take a step from the same view (a second leader, in the moment
/// before the first notices its lost lock connection) take it once: each phase change decides
/// again under the exclusive phase lock. A merge round was taken twice, using up the rounds and
/// adding owners for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_taken_twice_from_one_view_changes_the_phase_once() {
    init_tracing();
    let seeds = [151u8, 152, 153];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let deadline = merging_after_uploads(&s, &mut miners, &seeds).await;
    // Both steps read the run past the merge deadline, then wait for the phase lock held here.
    let mut holder = s.db.begin().await.expect("tx");
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2::int)")
        .bind(0x696f_7461i32)
        .bind(s.app.run.id as i32)
        .execute(&mut *holder)
        .await
        .expect("the phase lock");
    let t = deadline + Duration::seconds(1);
    let steps: Vec<_> = (0..2)
        .map(|_| {
            let app = s.app.clone();
            tokio::spawn(async move { driver::step(&app, t).await })
        })
        .collect();
    // Both steps wait for the phase lock.
    until_waiting_for_locks(&s.db, 2, true).await;
    holder.commit().await.expect("release");
    for step in steps {
        step.await.expect("join").expect("step");
    }
    assert_eq!(now_status(&s).await.3, 1, "one merge round, not two");
}

/// One owner merges, the others never do: at the last deadline its lone results, which nobody
/// verified, are not adopted; every partition keeps its weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_merge_result_is_not_adopted_at_the_last_deadline() {
    init_tracing();
    let seeds = [61u8, 62, 63];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
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
        step_until_report(m, |r| r.pseudo_gradients > 0).await;
    }
    driver::step(&s.app, t).await.expect("step");
    let (_, phase, deadline, _) = now_status(&s).await;
    assert_eq!(phase, Phase::Merging, "uploading ends by quorum");
    // Only one miner merges; for its partitions it is the only result.
    let report = step_until_report(&mut miners[0], |r| r.merges > 0).await;
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
    // Nobody checked the lone results: none of them became weights.
    let unverified: Vec<&PartitionStatus> = merges
        .iter()
        .filter(|p| p.resolved_by.as_deref() == Some("unverified"))
        .collect();
    assert_eq!(unverified.len(), mine, "{merges:?}");
    assert!(
        unverified
            .iter()
            .all(|p| p.state == PartitionState::Unchanged && p.results.len() == 1),
        "{unverified:?}"
    );
    assert!(merges.iter().all(|p| p.accepted.is_none()), "{merges:?}");
    assert_eq!(
        merges
            .iter()
            .filter(|p| p.resolved_by.as_deref() == Some("unmerged"))
            .count(),
        merges.len() - mine
    );
}

/// Epoch 0's count of abandoned samples, and the samples table's.
async fn abandoned_counts(db: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT e.samples_abandoned, (SELECT count(*) FROM samples s
             WHERE s.epoch = 0 AND s.status = 'abandoned')
         FROM epochs e WHERE e.epoch = 0",
    )
    .fetch_one(db)
    .await
    .expect("counts")
}

/// The open hops of `miner` in epoch 0, by sample.
async fn open_hops(db: &PgPool, miner: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT sample_id FROM tasks WHERE epoch = 0 AND miner = $1
           AND status IN ('pending', 'leased') ORDER BY sample_id",
    )
    .bind(miner)
    .fetch_all(db)
    .await
    .expect("open hops")
}

/// Routes a forward hop of a new sample at `stage` to `miner`, as a completion at the stage
/// before would: pending, or leased (with its lease).
async fn routed_hop(
    db: &PgPool,
    run_id: i64,
    stage: u32,
    miner: &str,
    leased: bool,
) -> (i64, i64, Option<uuid::Uuid>) {
    let sample: i64 = sqlx::query_scalar(
        "INSERT INTO samples (run_id, epoch, status) VALUES ($1, 0, 'forward') RETURNING id",
    )
    .bind(run_id)
    .fetch_one(db)
    .await
    .expect("sample");
    // The input a completion at the stage before would have passed on.
    let input: Option<serde_json::Value> = sqlx::query_scalar(
        "SELECT output FROM tasks WHERE stage = $1 AND direction = 'forward' AND status = 'done'
           AND output IS NOT NULL LIMIT 1",
    )
    .bind(stage as i32 - 1)
    .fetch_optional(db)
    .await
    .expect("input")
    .flatten();
    let (task, lease): (i64, Option<uuid::Uuid>) = sqlx::query_as(
        "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, attempt, miner, status,
             input, lease, leased_at, leased_until)
         VALUES ($1, 0, $2, $3, 'forward', 0, $4, $5, $6,
             CASE WHEN $7 THEN gen_random_uuid() END, CASE WHEN $7 THEN now() END,
             CASE WHEN $7 THEN now() + interval '1 hour' END)
         RETURNING id, lease",
    )
    .bind(run_id)
    .bind(sample)
    .bind(stage as i32)
    .bind(miner)
    .bind(if leased { "leased" } else { "pending" })
    .bind(input)
    .bind(leased)
    .fetch_one(db)
    .await
    .expect("task");
    (sample, task, lease)
}

/// Uploads partition 0 of `miner`'s pseudo-gradient of epoch 0 (random values).
async fn upload_pseudo_gradient(miner: &SimMiner) {
    let range = miner
        .config
        .partition_range(miner.stage, 0)
        .expect("partition 0");
    let values = vec![0.001f32; (range.end - range.start) as usize];
    let bytes = bytes::Bytes::from(iota_protocol::tensor::encode_partition(&values));
    miner
        .client()
        .upload_pseudo_gradient(0, 0, bytes)
        .await
        .expect("pseudo-gradient");
}

/// A miner's pseudo-gradient ends its epoch. Validators replay every hop it completed in the
/// epoch and compare the result with its pseudo-gradient; a hop completed after the upload (the
/// last stage's forward trains, and so does any backward) would make an honest miner fail that
/// replay. So its open hops move to another miner of its stage, it is leased nothing more of the
/// epoch, a hop routed to it by a completion that raced with the upload moves at the driver's
/// next step, and once every miner of the stage has ended its epoch, such hops end their samples
/// rather than go back to one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pseudo_gradient_ends_its_miners_epoch() {
    init_tracing();
    let seeds = [71u8, 72, 73, 74, 75, 76];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let key = |i: usize| pair(seeds[i]).ss58_of();
    // Samples travel until two miners of one stage have done gradient work (the upload needs
    // some), with other samples still in flight.
    let stages: Vec<u32> = miners.iter().map(|m| m.stage).collect();
    let pair_of_stage = |worked: &[String]| {
        (0..stages.len())
            .flat_map(|i| (i + 1..stages.len()).map(move |j| (i, j)))
            .find(|&(i, j)| {
                stages[i] == stages[j] && worked.contains(&key(i)) && worked.contains(&key(j))
            })
    };
    let worked =
        step_until_workers(&s, &mut miners, run.stages, |w| pair_of_stage(w).is_some()).await;
    let pair_of_stage = pair_of_stage(&worked);
    let (a, b) = pair_of_stage.expect("two miners of one stage did gradient work");
    let (first, second) = (key(a), key(b));
    let stage = miners[a].stage;
    assert_eq!(
        miners.iter().filter(|m| m.stage == stage).count(),
        2,
        "six miners on three stages: two each"
    );

    assert_eq!(past_the_deadline(&s).await.1, Phase::Uploading);

    // The first miner holds a lease and has a hop waiting when it uploads.
    let (held_sample, held_task, lease) =
        routed_hop(&s.db, s.app.run.id, stage, &first, true).await;
    let (waiting_sample, _, _) = routed_hop(&s.db, s.app.run.id, stage, &first, false).await;
    upload_pseudo_gradient(&miners[a]).await;
    assert!(
        open_hops(&s.db, &first).await.is_empty(),
        "hops stayed with a miner that ended its epoch"
    );
    let mut moved = open_hops(&s.db, &second).await;
    moved.retain(|x| [held_sample, waiting_sample].contains(x));
    assert_eq!(
        moved.len(),
        2,
        "its hops did not move to the other miner of the stage"
    );
    let late = miners[a]
        .client()
        .complete(
            held_task,
            &CompleteRequest {
                lease: lease.expect("leased"),
                output: None,
                inner_step: 1,
                weights_digest: "00".into(),
                loss: Some(2.0),
                sequence_losses: Some(vec![2.0; run.micro_batch as usize]),
                compute_ms: Some(1),
            },
        )
        .await
        .expect_err("a hop completed after the pseudo-gradient");
    assert_eq!(late.code(), Some(ErrorCode::LeaseExpired), "{late}");

    // A hop routed to it by a completion that raced with the upload: never leased to it, and
    // moved at the driver's next step.
    let (raced_sample, _, _) = routed_hop(&s.db, s.app.run.id, stage, &first, false).await;
    // Polls for a second: the first ones may be answered by the poll view before its
    // notification arrives, the later ones read the database.
    let window = std::time::Instant::now();
    while window.elapsed() < std::time::Duration::from_secs(1) {
        let work = miners[a].client().work(4).await.expect("poll");
        assert!(
            work.items.is_empty(),
            "a miner that ended its epoch was leased {:?}",
            work.items
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    driver::step(&s.app, Utc::now()).await.expect("step");
    assert!(open_hops(&s.db, &first).await.is_empty());
    assert!(
        open_hops(&s.db, &second).await.contains(&raced_sample),
        "the raced hop did not move"
    );

    // The other miner ends its epoch too: its hops have nowhere to go on the stage, and their
    // samples end instead of going back to the first.
    upload_pseudo_gradient(&miners[b]).await;
    driver::step(&s.app, Utc::now()).await.expect("step");
    assert!(open_hops(&s.db, &first).await.is_empty());
    assert!(open_hops(&s.db, &second).await.is_empty());
    let ended: Vec<String> =
        sqlx::query_scalar("SELECT status FROM samples WHERE id = ANY($1) ORDER BY id")
            .bind(vec![held_sample, waiting_sample, raced_sample])
            .fetch_all(&s.db)
            .await
            .expect("samples");
    assert_eq!(ended, ["abandoned"; 3]);
    // Counted as they end, so that the status says how many still travel (the miners wait
    // for none before they upload).
    let (counted, abandoned) = abandoned_counts(&s.db).await;
    assert!(abandoned >= 3);
    assert_eq!(counted, abandoned, "samples_abandoned disagrees");
}

/// A miner joining while an epoch merges trains what is left of that epoch (samples still in
/// flight) from the weights the epoch started from, which is what validators replay it from:
/// not from the merges the epoch has already accepted. Explorers still see the latest merges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miner_joining_while_merging_gets_the_epochs_start_weights() {
    init_tracing();
    let seeds = [81u8, 82, 83, 84];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds[..3]).await;
    // Train to quorum, upload, and merge everything; the driver has not ended the epoch yet.
    let t = Utc::now();
    for _ in 0..200 {
        for m in &mut miners {
            m.step().await.expect("step");
        }
        driver::step(&s.app, t).await.expect("step");
        if now_status(&s).await.1 == Phase::Merging {
            break;
        }
    }
    assert_eq!(now_status(&s).await.1, Phase::Merging);
    // Every partition with contributions merged, whichever stage the newcomer joins (after one
    // round of steps some stages' partitions could still be open, and that stage's latest
    // weights then the same as its start weights).
    let mut merges: Vec<PartitionStatus> = Vec::new();
    for _ in 0..20 {
        for m in &mut miners {
            m.step().await.expect("merge");
        }
        merges = reqwest::get(format!("{}/v1/epochs/0/merges", s.base))
            .await
            .expect("merges")
            .json()
            .await
            .expect("json");
        if merges.iter().all(|p| {
            matches!(
                p.state,
                PartitionState::Accepted | PartitionState::Unchanged
            )
        }) {
            break;
        }
    }
    assert!(
        merges.iter().all(|p| p.state != PartitionState::Open),
        "partitions still open: {merges:?}"
    );
    assert!(
        merges.iter().any(|p| p.state == PartitionState::Accepted),
        "nothing merged: {merges:?}"
    );
    assert_eq!(now_status(&s).await.0, 0, "still epoch 0");

    let (_, joined) = registered_miner(&s.base, seeds[3]).await;
    assert_eq!(joined.status.epoch, 0);
    assert_eq!(
        joined.work_ended, None,
        "a newcomer has done no work to end"
    );
    let stage = joined.stage;
    let weights = |query: &'static str| {
        let url = format!("{}/v1/stages/{stage}/weights{query}", s.base);
        async move {
            reqwest::get(url)
                .await
                .expect("weights")
                .json::<StageWeights>()
                .await
                .expect("json")
        }
    };
    assert!(
        merges
            .iter()
            .any(|p| p.stage == stage && p.state == PartitionState::Accepted),
        "nothing of the newcomer's stage {stage} merged: {merges:?}"
    );
    let latest = weights("").await;
    assert_eq!(latest.epoch, Some(0), "epoch 0's merges are the latest");
    let start = weights("?before=0").await;
    assert_eq!(start.epoch, None);
    assert!(start.partitions.iter().all(Option::is_none));
    assert_eq!(
        joined.weights, start,
        "a miner joining while epoch 0 merges got weights epoch 0 did not start from"
    );
}

/// A miner process that restarts mid-epoch has lost the state its completed hops left, so its
/// work in the epoch ends at the new registration (validators would replay those hops against a
/// pseudo-gradient it can no longer produce): its open hops move, and the uploading phase does
/// not wait for its pseudo-gradient. A process that re-joins holding its state (after a release
/// for silence) goes on as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miner_restarted_mid_epoch_sits_the_rest_of_it_out() {
    init_tracing();
    let seeds = [91u8, 92, 93, 94, 95, 96];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let key = |i: usize| pair(seeds[i]).ss58_of();
    // Samples travel until two miners have done gradient work.
    let worked = step_until_workers(&s, &mut miners, run.stages, |w| w.len() >= 2).await;
    let restarted = (0..miners.len())
        .find(|&i| worked.contains(&key(i)))
        .expect("a miner did gradient work");
    let rejoined = (0..miners.len())
        .find(|&i| i != restarted && worked.contains(&key(i)))
        .expect("another miner did gradient work");
    let stage = miners[restarted].stage;

    // The restarted process registers anew, with a hop routed to it.
    let (waiting, _, _) = routed_hop(&s.db, s.app.run.id, stage, &key(restarted), false).await;
    let (_, joined) = registered_miner(&s.base, seeds[restarted]).await;
    assert_eq!(joined.work_ended, Some(0), "a restarted miner trains on");
    assert!(open_hops(&s.db, &key(restarted)).await.is_empty());
    let moved: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tasks WHERE sample_id = $1 AND status IN ('pending', 'leased')
           AND miner <> $2",
    )
    .bind(waiting)
    .bind(key(restarted))
    .fetch_one(&s.db)
    .await
    .expect("moved");
    let others_on_stage = miners.iter().filter(|m| m.stage == stage).count() > 1;
    assert_eq!(moved, i64::from(others_on_stage), "its hop did not move");
    // Registering again does not undo it.
    let (_, again) = registered_miner(&s.base, seeds[restarted]).await;
    assert_eq!(again.work_ended, Some(0));

    // A process that re-joins with its state goes on.
    let rejoin = miners[rejoined]
        .client()
        .rejoin(Capacity {
            device: "sim".into(),
            memory_bytes: 64 << 30,
            tokens_per_s: 10.0,
        })
        .await
        .expect("rejoin");
    assert_eq!(rejoin.work_ended, None);

    // Uploading ends by quorum without the restarted miner's pseudo-gradient.
    let (_, phase, deadline, _) = past_the_deadline(&s).await;
    assert_eq!(phase, Phase::Uploading);
    // Its pseudo-gradient would be compared with hops it no longer holds the state of.
    let range = run.partition_range(stage, 0).expect("partition 0");
    let values = vec![0.001f32; (range.end - range.start) as usize];
    let refused = miners[restarted]
        .client()
        .upload_pseudo_gradient(
            0,
            0,
            bytes::Bytes::from(iota_protocol::tensor::encode_partition(&values)),
        )
        .await
        .expect_err("a pseudo-gradient after a restart");
    assert_eq!(refused.code(), Some(ErrorCode::Conflict), "{refused}");
    for (i, m) in miners.iter_mut().enumerate() {
        if i != restarted && worked.contains(&key(i)) {
            step_until_report(m, |r| r.pseudo_gradients > 0).await;
        } else if i != restarted {
            m.step().await.expect("step");
        }
    }
    driver::step(&s.app, deadline - Duration::seconds(1))
        .await
        .expect("step");
    assert_eq!(
        now_status(&s).await.1,
        Phase::Merging,
        "uploading waited for a miner that restarted"
    );
}

/// The driver steps at `t` in `phase`; nobody drives the run for ten minutes; a new leader takes
/// over. Checks that the phase got back the time it had left and goes on; its new deadline.
async fn resumes_after_a_gap(s: &Served, t: DateTime<Utc>, phase: Phase) -> DateTime<Utc> {
    driver::step(&s.app, t).await.expect("step");
    let (epoch, now_phase, deadline, _) = now_status(s).await;
    assert_eq!((epoch, now_phase), (0, phase));
    let left = deadline - t;
    assert!(left > Duration::seconds(1), "{phase:?}: {left}");
    let t = t + Duration::minutes(10);
    driver::forgive_gap(&s.app, t)
        .await
        .expect("forgive the gap");
    let (_, _, resumed, _) = now_status(s).await;
    assert_eq!(resumed - t, left, "{phase:?}: the time left is given back");
    // Given back once: forgiving again at once (a new leader's and its first tick's) adds nothing.
    driver::forgive_gap(&s.app, t).await.expect("forgive again");
    assert_eq!(
        now_status(s).await.2,
        resumed,
        "{phase:?}: the gap was given back twice"
    );
    driver::step(&s.app, t + Duration::seconds(1))
        .await
        .expect("step");
    assert_eq!(now_status(s).await.1, phase, "the phase goes on");
    // Another new leader without a gap changes nothing.
    driver::forgive_gap(&s.app, t + Duration::seconds(1))
        .await
        .expect("forgive no gap");
    assert_eq!(now_status(s).await.2, resumed);
    resumed
}

/// A process taking the lead after nobody drove the run (a restart, or the leader died) gives the
/// phase the time it had left at the last step: miners could not reach the run in that gap, so a
/// deadline that passed in it must not end the phase (it once ended it at the new leader's first
/// step, refusing the pseudo-gradients still to come). A gap in training and one in uploading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_gives_the_phase_the_time_it_had_left() {
    init_tracing();
    let seeds = [151u8, 152, 153];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    // A miner with gradient work, so that uploading waits for its pseudo-gradient.
    let worked = step_until_workers(&s, &mut miners, run.stages, |w| !w.is_empty()).await;
    assert!(!worked.is_empty(), "no miner did gradient work");
    let deadline = resumes_after_a_gap(&s, Utc::now(), Phase::Training).await;
    let t = deadline + Duration::seconds(1);
    let deadline = resumes_after_a_gap(&s, t, Phase::Uploading).await;
    // Its own deadline still ends the phase.
    driver::step(&s.app, deadline + Duration::seconds(1))
        .await
        .expect("step");
    assert_eq!(now_status(&s).await.1, Phase::Merging);
}

/// Steps every miner and then the driver (at `now`, so only quorums end phases), up to 40 rounds,
/// until `done` holds of the run's status.
async fn step_until(
    s: &Served,
    miners: &mut [SimMiner],
    done: impl Fn(&(u64, Phase, DateTime<Utc>, i32)) -> bool,
) {
    for _ in 0..40 {
        for m in miners.iter_mut() {
            m.step().await.expect("step");
        }
        driver::step(&s.app, Utc::now()).await.expect("step");
        if done(&now_status(s).await) {
            return;
        }
    }
    panic!("not reached in 40 rounds: {:?}", now_status(s).await);
}

/// Steps `miner` until `done` holds of its report; the report. A poll is answered from the
/// process's poll view, which follows a phase change a moment after it: a step just after one
/// may still see the phase before it (the miner's next poll sees the new one).
async fn step_until_report(
    miner: &mut SimMiner,
    done: impl Fn(&iota_testkit::sim::StepReport) -> bool,
) -> iota_testkit::sim::StepReport {
    for _ in 0..100 {
        let report = miner.step().await.expect("step");
        if done(&report) {
            return report;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the miner's steps never did what was expected");
}

/// A completion of the hop leased with `lease`, at inner step 0; a loss comes with its samples'
/// sequence losses (each equal to it).
fn completion(
    lease: uuid::Uuid,
    output: Option<BlobDescriptor>,
    loss: Option<f64>,
) -> CompleteRequest {
    CompleteRequest {
        lease,
        output,
        inner_step: 0,
        weights_digest: "0".repeat(64),
        loss,
        sequence_losses: loss.map(|l| vec![l; config().micro_batch as usize]),
        compute_ms: Some(1),
    }
}

/// Steps the miners (of `seeds`) until one has done gradient work, past the training deadline,
/// has every one with gradient work upload, and steps past the uploading deadline: the run is
/// merging, in round 0. The merge deadline.
async fn merging_after_uploads(s: &Served, miners: &mut [SimMiner], seeds: &[u8]) -> DateTime<Utc> {
    let stages = s.app.config().stages;
    let worked = step_until_workers(s, miners, stages, |w| !w.is_empty()).await;
    assert_eq!(past_the_deadline(s).await.1, Phase::Uploading);
    for (m, seed) in miners.iter_mut().zip(seeds) {
        if worked.contains(&pair(*seed).ss58_of()) {
            step_until_report(m, |r| r.pseudo_gradients > 0).await;
        }
    }
    let (_, phase, deadline, round) = past_the_deadline(s).await;
    assert_eq!((phase, round), (Phase::Merging, 0));
    deadline
}

/// A recorded pseudo-gradient partition of epoch 0 (`merges` false) or merge result of it by a
/// miner: its hotkey, stage, partition, descriptor and bytes.
async fn a_recorded(s: &Served, merges: bool) -> (String, u32, u32, BlobDescriptor, bytes::Bytes) {
    let sql = if merges {
        "SELECT submitter, stage, partition, blob FROM merge_results
         WHERE epoch = 0 AND submitter NOT LIKE 'validator:%' ORDER BY stage, partition LIMIT 1"
    } else {
        "SELECT miner, stage, partition, blob FROM pseudo_gradients
         WHERE epoch = 0 ORDER BY stage, partition LIMIT 1"
    };
    let (hotkey, stage, partition, blob): (String, i32, i32, serde_json::Value) =
        sqlx::query_as(sql)
            .fetch_one(&s.db)
            .await
            .expect("a recorded submission");
    let blob: BlobDescriptor = serde_json::from_value(blob).expect("blob");
    let bytes = s.app.store.get(&blob.key).await.expect("its bytes");
    (hotkey, stage as u32, partition as u32, blob, bytes)
}

/// A submission whose answer was lost is sent again by its client; when the phase changed in
/// between, the retry is answered from the record (it was refused with `wrong_phase`, telling
/// the miner that its accepted work was not), while anything not recorded is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_submission_retried_after_its_phase_is_answered_from_the_record() {
    init_tracing();
    let seeds = [161u8, 162, 163, 164, 165, 166];
    let newcomer = 167u8;
    let run = config();
    let s = serve(&[&seeds[..], &[newcomer]].concat(), run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let by_key = |hotkey: &str| {
        seeds
            .iter()
            .position(|seed| pair(*seed).ss58_of() == hotkey)
            .expect("a miner of the test")
    };
    step_until_workers(&s, &mut miners, run.stages, |w| w.len() >= 2).await;
    past_the_deadline(&s).await;
    step_until(&s, &mut miners, |st| st.1 == Phase::Merging).await;

    let (hotkey, _, partition, blob, bytes) = a_recorded(&s, false).await;
    let client = miners[by_key(&hotkey)].client();
    let again = client
        .upload_pseudo_gradient(0, partition, bytes.clone())
        .await
        .expect("a recorded pseudo-gradient sent again while merging");
    assert_eq!((again.blob.key, again.blob.blake3), (blob.key, blob.blake3));
    // The same bytes from a miner without a record are refused.
    let (late, _) = registered_miner(&s.base, newcomer).await;
    let other = late
        .upload_pseudo_gradient(0, partition, bytes)
        .await
        .expect_err("a pseudo-gradient while merging");
    assert_eq!(other.code(), Some(ErrorCode::WrongPhase), "{other}");

    step_until(&s, &mut miners, |st| st.0 == 1).await;
    let (hotkey, stage, partition, blob, bytes) = a_recorded(&s, true).await;
    let client = miners[by_key(&hotkey)].client();
    let again = client
        .upload_merge(0, stage, partition, bytes.clone())
        .await
        .expect("a recorded merge sent again in the next epoch");
    assert_eq!((again.blob.key, again.blob.blake3), (blob.key, blob.blake3));
    let other = late
        .upload_merge(0, stage, partition, bytes)
        .await
        .expect_err("a merge of the last epoch");
    assert_eq!(other.code(), Some(ErrorCode::WrongPhase), "{other}");
}

/// A merge owner cannot copy another owner's result: until the partition is settled, the public
/// merge status leaves the results' hashes out (the sealed object's key names its hash) and the
/// object is not served to miners. Both were open to anyone, so the second owner could submit
/// the first's bytes without merging and the partition was accepted as an agreement. Once the
/// partition is settled, both are open again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_cannot_read_another_owners_result_before_the_partition_is_settled() {
    init_tracing();
    let seeds = [111u8, 112, 113, 114, 115, 116];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    step_until_workers(&s, &mut miners, run.stages, |w| w.len() >= 2).await;
    past_the_deadline(&s).await;
    step_until(&s, &mut miners, |st| st.1 == Phase::Merging).await;
    let index_of = |hotkey: &str| {
        seeds
            .iter()
            .position(|seed| pair(*seed).ss58_of() == hotkey)
            .expect("a miner of the test")
    };
    // One owner submits its results; another owner of one of its partitions has not yet.
    let (first, other): (String, String) = sqlx::query_as(
        "SELECT a.miner, b.miner FROM partition_owners a JOIN partition_owners b
           ON (b.epoch, b.stage, b.partition) = (a.epoch, a.stage, a.partition) AND b.miner <> a.miner
         WHERE a.epoch = 0 ORDER BY a.stage, a.partition LIMIT 1",
    )
    .fetch_one(&s.db)
    .await
    .expect("a partition with two owners");
    step_until_report(&mut miners[index_of(&first)], |r| r.merges > 0).await;
    let (stage, partition, blob): (i32, i32, serde_json::Value) = sqlx::query_as(
        "SELECT r.stage, r.partition, r.blob FROM merge_results r
         JOIN partition_owners o ON (o.epoch, o.stage, o.partition) = (r.epoch, r.stage, r.partition)
         JOIN partitions p ON (p.epoch, p.stage, p.partition) = (r.epoch, r.stage, r.partition)
         WHERE r.epoch = 0 AND r.submitter = $1 AND o.miner = $2 AND p.state = 'open'
         LIMIT 1",
    )
    .bind(&first)
    .bind(&other)
    .fetch_one(&s.db)
    .await
    .expect("an open partition of both with the first owner's result");
    let blob: BlobDescriptor = serde_json::from_value(blob).expect("blob");
    let status_of = |all: Vec<PartitionStatus>| {
        all.into_iter()
            .find(|p| p.stage == stage as u32 && p.partition == partition as u32)
            .expect("the partition")
    };
    let reader = miners[index_of(&other)].client().clone();
    let open = status_of(reader.merge_status(0).await.expect("merge status"));
    assert_eq!(open.state, PartitionState::Open);
    let submitted = open
        .results
        .iter()
        .find(|r| r.hotkey == first)
        .expect("the first owner's result is listed");
    assert_eq!(submitted.blake3, None, "its hash is public: {open:?}");
    let refused = reader
        .download(&blob)
        .await
        .expect_err("another owner's result before the partition is settled");
    assert_eq!(refused.code(), Some(ErrorCode::Forbidden), "{refused}");

    // The other owners merge for themselves; the partition is settled and every result is open.
    let owners: Vec<String> = sqlx::query_scalar(
        "SELECT miner FROM partition_owners WHERE epoch = 0 AND stage = $1 AND partition = $2",
    )
    .bind(stage)
    .bind(partition)
    .fetch_all(&s.db)
    .await
    .expect("owners");
    for owner in owners.iter().filter(|o| **o != first) {
        step_until_report(&mut miners[index_of(owner)], |r| r.merges > 0).await;
    }
    let settled = status_of(reader.merge_status(0).await.expect("merge status"));
    assert_eq!(settled.state, PartitionState::Accepted, "{settled:?}");
    assert!(
        settled.results.iter().all(|r| r.blake3.is_some()),
        "{settled:?}"
    );
    let bytes = reader.download(&blob).await.expect("a settled result");
    assert_eq!(iota_protocol::blob::blake3_hex(&bytes), blob.blake3);
}

/// A hotkey with a validator permit that also joined as a miner does not see, through the
/// validator routes, the results of any unsettled partition, its own or another stage's:
/// validators read every hash and object (to settle disputes), and such a miner could otherwise
/// copy another owner's result like anyone without the fix above, also after being made an owner
/// of another stage's partition (it read those before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_with_a_validator_permit_cannot_read_the_other_owners_result() {
    init_tracing();
    let seeds = [201u8, 202, 203, 204, 205, FIRST_VALIDATOR + 1];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    step_until_workers(&s, &mut miners, run.stages, |w| w.len() >= 2).await;
    past_the_deadline(&s).await;
    step_until(&s, &mut miners, |st| st.1 == Phase::Merging).await;
    let both = pair(FIRST_VALIDATOR + 1).ss58_of();
    let index_of = |hotkey: &str| {
        seeds
            .iter()
            .position(|seed| pair(*seed).ss58_of() == hotkey)
            .expect("a miner of the test")
    };
    let (stage, partition, other): (i32, i32, String) = sqlx::query_as(
        "SELECT a.stage, a.partition, b.miner FROM partition_owners a JOIN partition_owners b
           ON (b.epoch, b.stage, b.partition) = (a.epoch, a.stage, a.partition) AND b.miner <> a.miner
         WHERE a.epoch = 0 AND a.miner = $1 ORDER BY a.stage, a.partition LIMIT 1",
    )
    .bind(&both)
    .fetch_one(&s.db)
    .await
    .expect("a partition the permit holder owns with another miner");
    step_until_report(&mut miners[index_of(&other)], |r| r.merges > 0).await;
    let blob: serde_json::Value = sqlx::query_scalar(
        "SELECT r.blob FROM merge_results r JOIN partitions p
           ON (p.epoch, p.stage, p.partition) = (r.epoch, r.stage, r.partition)
         WHERE r.epoch = 0 AND r.stage = $1 AND r.partition = $2 AND r.submitter = $3
           AND p.state = 'open'",
    )
    .bind(stage)
    .bind(partition)
    .bind(&other)
    .fetch_one(&s.db)
    .await
    .expect("the other owner's result, the partition still open");
    let blob: BlobDescriptor = serde_json::from_value(blob).expect("blob");
    let reader = miners[index_of(&both)].client().clone();
    let record = reader.epoch_record(0).await.expect("the epoch record");
    let seen = record
        .partitions
        .iter()
        .find(|p| p.stage == stage as u32 && p.partition == partition as u32)
        .expect("the partition");
    assert!(
        seen.results.iter().all(|r| r.blake3.is_none()),
        "its owner read the results' hashes: {seen:?}"
    );
    let refused = reader
        .download(&blob)
        .await
        .expect_err("another owner's result before the partition is settled");
    assert_eq!(refused.code(), Some(ErrorCode::Forbidden), "{refused}");
    // Nor a hash or object of any other stage's unsettled partition: any miner may be made an
    // owner of any partition (a stage short of miners borrows them, and a reassignment takes
    // whoever has the fewest), so it read them, then could copy one as its own.
    let mine = miners[index_of(&both)].stage;
    let owner_elsewhere: String = sqlx::query_scalar(
        "SELECT o.miner FROM partition_owners o JOIN partitions p
           ON (p.epoch, p.stage, p.partition) = (o.epoch, o.stage, o.partition)
         WHERE o.epoch = 0 AND o.stage <> $1 AND p.state = 'open' AND o.miner <> $2
           AND NOT EXISTS (SELECT 1 FROM merge_results r WHERE r.submitter = o.miner)
         ORDER BY o.stage, o.partition LIMIT 1",
    )
    .bind(mine as i32)
    .bind(&both)
    .fetch_one(&s.db)
    .await
    .expect("an owner of another stage's open partition");
    step_until_report(&mut miners[index_of(&owner_elsewhere)], |r| r.merges > 0).await;
    let (other_stage, other_blob): (i32, serde_json::Value) = sqlx::query_as(
        "SELECT r.stage, r.blob FROM merge_results r JOIN partitions p
           ON (p.epoch, p.stage, p.partition) = (r.epoch, r.stage, r.partition)
         WHERE r.epoch = 0 AND r.stage <> $1 AND p.state IN ('open', 'disputed')
         ORDER BY r.stage, r.partition LIMIT 1",
    )
    .bind(mine as i32)
    .fetch_one(&s.db)
    .await
    .expect("an unsettled result of another stage");
    let record = reader.epoch_record(0).await.expect("the epoch record");
    let unsettled = record
        .partitions
        .iter()
        .filter(|p| matches!(p.state, PartitionState::Open | PartitionState::Disputed));
    let mut others = 0;
    for p in unsettled {
        others += usize::from(p.stage as i32 == other_stage && !p.results.is_empty());
        assert!(
            p.results.iter().all(|r| r.blake3.is_none()),
            "a miner read a hash of stage {}: {p:?}",
            p.stage
        );
    }
    assert!(
        others > 0,
        "no unsettled result of stage {other_stage} in the record"
    );
    let other_blob: BlobDescriptor = serde_json::from_value(other_blob).expect("blob");
    let refused = reader
        .download(&other_blob)
        .await
        .expect_err("another stage's unsettled result");
    assert_eq!(refused.code(), Some(ErrorCode::Forbidden), "{refused}");
}

/// A run in its merging phase with a hotkey holding a validator permit among its miners (the
/// last seed), and an open partition that it owns with another miner.
struct PermitHolderOwner {
    s: Served,
    miners: Vec<SimMiner>,
    /// The permit holder's miner, and the other owner's.
    both: usize,
    other: usize,
    stage: u32,
    partition: u32,
    /// Merged bytes of the partition, every value this one.
    merged: Box<dyn Fn(f32) -> bytes::Bytes>,
}

impl PermitHolderOwner {
    async fn new(seeds: &[u8]) -> Self {
        let run = config();
        let s = serve(seeds, run.clone()).await;
        let mut miners = join_all(&s, seeds).await;
        step_until_workers(&s, &mut miners, run.stages, |w| w.len() >= 2).await;
        past_the_deadline(&s).await;
        step_until(&s, &mut miners, |st| st.1 == Phase::Merging).await;
        let index_of = |hotkey: &str| {
            seeds
                .iter()
                .position(|seed| pair(*seed).ss58_of() == hotkey)
                .expect("a miner of the test")
        };
        let both = seeds.len() - 1;
        let (stage, partition, other): (i32, i32, String) = sqlx::query_as(
            "SELECT a.stage, a.partition, b.miner FROM partition_owners a JOIN partition_owners b
               ON (b.epoch, b.stage, b.partition) = (a.epoch, a.stage, a.partition)
                 AND b.miner <> a.miner
             JOIN partitions p ON (p.epoch, p.stage, p.partition) = (a.epoch, a.stage, a.partition)
             WHERE a.epoch = 0 AND a.miner = $1 AND p.state = 'open'
             ORDER BY a.stage, a.partition LIMIT 1",
        )
        .bind(pair(seeds[both]).ss58_of())
        .fetch_one(&s.db)
        .await
        .expect("an open partition the permit holder owns with another miner");
        let (stage, partition) = (stage as u32, partition as u32);
        let range = run.partition_range(stage, partition).expect("partition");
        let len = (range.end - range.start) as usize;
        Self {
            s,
            miners,
            both,
            other: index_of(&other),
            stage,
            partition,
            merged: Box::new(move |value| {
                bytes::Bytes::from(iota_protocol::tensor::encode_merged(
                    &vec![value; len],
                    &vec![0.0; len],
                ))
            }),
        }
    }

    async fn state(&self) -> String {
        sqlx::query_scalar(
            "SELECT state FROM partitions WHERE epoch = 0 AND stage = $1 AND partition = $2",
        )
        .bind(self.stage as i32)
        .bind(self.partition as i32)
        .fetch_one(&self.s.db)
        .await
        .expect("state")
    }
}

/// A hotkey with a validator permit that also joined as a miner does not judge a partition it
/// has a stake in: its merge through the validator route is refused (it was a second vote for
/// its own result as an owner, which agreement then accepted with no other merge), and so is
/// its settlement of the partition's dispute. Each stake counts alone: being an active miner,
/// owning the partition, and having submitted a result for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validator_does_not_judge_a_partition_it_has_a_stake_in() {
    init_tracing();
    let seeds = [211u8, 212, 213, 214, 215, FIRST_VALIDATOR + 3];
    let t = PermitHolderOwner::new(&seeds).await;
    let (stage, partition, merged) = (t.stage, t.partition, &t.merged);
    let client = t.miners[t.both].client().clone();
    let hotkey = pair(seeds[t.both]).ss58_of();
    let set_status = |status: &'static str| {
        let (db, hotkey) = (&t.s.db, &hotkey);
        async move {
            sqlx::query("UPDATE miners SET status = $2 WHERE hotkey = $1")
                .bind(hotkey)
                .bind(status)
                .execute(db)
                .await
                .expect("miner status");
        }
    };
    let votes = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM merge_results WHERE epoch = 0 AND stage = $1 AND partition = $2",
        )
        .bind(stage as i32)
        .bind(partition as i32)
        .fetch_one(&t.s.db)
        .await
        .expect("results")
    };
    let as_validator = || client.validator_merge(0, stage, partition, merged(0.25));

    // Released as a miner, it still owns the partition.
    set_status("released").await;
    let owner_only = as_validator()
        .await
        .expect_err("an owner's merge as a validator");
    assert_eq!(
        owner_only.code(),
        Some(ErrorCode::Forbidden),
        "{owner_only}"
    );
    assert_eq!(votes().await, 0, "the refused merge left a result");
    set_status("active").await;

    client
        .upload_merge(0, stage, partition, merged(0.25))
        .await
        .expect("its merge as an owner");
    let second = as_validator()
        .await
        .expect_err("the same bytes again as a validator");
    assert_eq!(second.code(), Some(ErrorCode::Forbidden), "{second}");
    assert_eq!(t.state().await, "open", "one hotkey agreed with itself");
    assert_eq!(votes().await, 1, "the refused merge left a result");

    // The other owner disagrees: a dispute, which the permit holder may not settle.
    t.miners[t.other]
        .client()
        .upload_merge(0, stage, partition, merged(0.75))
        .await
        .expect("the other owner's merge");
    assert_eq!(t.state().await, "disputed");
    let dispute = client
        .disputes()
        .await
        .expect("disputes")
        .into_iter()
        .find(|d| d.partition.stage == stage && d.partition.partition == partition)
        .expect("the partition's dispute");
    let own_hash = iota_protocol::blob::blake3_hex(&merged(0.25));
    let refused = client
        .settle(dispute.id, &own_hash)
        .await
        .expect_err("settling its own dispute");
    assert_eq!(refused.code(), Some(ErrorCode::Forbidden), "{refused}");
    // Released, and no longer an owner (as after a reassignment), it still submitted a result.
    set_status("released").await;
    sqlx::query("DELETE FROM partition_owners WHERE miner = $1 AND epoch = 0 AND stage = $2 AND partition = $3")
        .bind(&hotkey)
        .bind(stage as i32)
        .bind(partition as i32)
        .execute(&t.s.db)
        .await
        .expect("no longer an owner");
    let submitter_only = client
        .settle(dispute.id, &own_hash)
        .await
        .expect_err("settling the dispute over its own result");
    assert_eq!(
        submitter_only.code(),
        Some(ErrorCode::Forbidden),
        "{submitter_only}"
    );
    assert_eq!(t.state().await, "disputed");
}

/// Steps the miners until one has done gradient work in epoch 0, then past the training
/// deadline: the run is uploading. That miner's index.
async fn uploading_with_a_worker(s: &Served, miners: &mut [SimMiner], seeds: &[u8]) -> usize {
    let stages = s.app.config().stages;
    let worked = step_until_workers(s, miners, stages, |w| !w.is_empty()).await;
    let i = (0..seeds.len())
        .find(|&i| worked.contains(&pair(seeds[i]).ss58_of()))
        .expect("a miner with gradient work");
    assert_eq!(past_the_deadline(s).await.1, Phase::Uploading);
    i
}

/// Partition `p` of `hotkey`'s pseudo-gradient in epoch 0 (stage `stage`), every value `value`:
/// its bytes, and their commit from the miner's slot (where a presigned PUT leaves them).
fn pg_commit(s: &Served, stage: u32, hotkey: &str, p: u32, value: f32) -> (Vec<u8>, CommitRequest) {
    let range = s.app.config().partition_range(stage, p).expect("partition");
    let bytes =
        iota_protocol::tensor::encode_partition(&vec![value; (range.end - range.start) as usize]);
    let commit = CommitRequest {
        key: format!(
            "runs/{}/epoch-0/pseudo-gradients/s{stage}/p{p}/{hotkey}.safetensors",
            s.app.run.id
        ),
        size: bytes.len() as u64,
        blake3: iota_protocol::blob::blake3_hex(&bytes),
        multipart: None,
    };
    (bytes, commit)
}

/// What the bucket keeps of `hotkey`'s in the directory of `commit`'s slot.
async fn kept_of(bucket: &BlobStore, commit: &CommitRequest, hotkey: &str) -> Vec<String> {
    let dir = commit.key.rsplit_once('/').expect("a directory").0;
    bucket
        .list(dir)
        .await
        .expect("list")
        .into_iter()
        .filter(|k| k.contains(hotkey))
        .collect()
}

/// The objects a commit of `slot` moved aside (being checked, or left by an attempt).
async fn aside_of(store: &BlobStore, slot: &str) -> Vec<String> {
    let dir = slot.rsplit_once('/').expect("a directory").0;
    store
        .list(dir)
        .await
        .expect("list")
        .into_iter()
        .filter(|k| k.starts_with(&format!("{slot}.pending-")))
        .collect()
}

/// Where `commit`'s bytes are kept once accepted.
fn sealed_of(commit: &CommitRequest) -> String {
    format!(
        "{}.{}.safetensors",
        commit.key.trim_end_matches(".safetensors"),
        commit.blake3
    )
}

/// A commit of a presigned pseudo-gradient that checked and sealed the object, then failed to
/// record it (here the database refuses the first insert; a crash there does the same), is taken
/// by the client's retry: the retry finds the slot empty, and once answered that nothing was
/// uploaded, which a client takes as final, so the checked upload was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_failed_after_sealing_is_taken_by_its_retry() {
    init_tracing();
    let seeds = [171u8, 172, 173];
    let s = serve(&seeds, config()).await;
    let mut miners = join_all(&s, &seeds).await;
    let i = uploading_with_a_worker(&s, &mut miners, &seeds).await;
    let hotkey = pair(seeds[i]).ss58_of();
    // What a presigned PUT leaves in the slot.
    let (bytes, commit) = pg_commit(&s, miners[i].stage, &hotkey, 0, 0.002);
    let slot = commit.key.clone();
    s.app
        .store
        .put(&slot, bytes::Bytes::from(bytes.clone()))
        .await
        .expect("put");
    for sql in [
        "CREATE SEQUENCE inserts_tried",
        "CREATE FUNCTION refuse_the_first() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('inserts_tried') = 1 THEN RAISE EXCEPTION 'injected failure'; END IF;
             RETURN NEW;
         END $$",
        "CREATE TRIGGER refuse_the_first BEFORE INSERT ON pseudo_gradients
         FOR EACH ROW EXECUTE FUNCTION refuse_the_first()",
    ] {
        sqlx::query(sql)
            .execute(&s.db)
            .await
            .expect("inject a failure");
    }
    let taken: UploadResponse = miners[i]
        .client()
        .signed_json(reqwest::Method::POST, PG0_COMMIT, &commit)
        .await
        .expect("the retried commit is taken");
    let tried: i64 = sqlx::query_scalar("SELECT last_value FROM inserts_tried")
        .fetch_one(&s.db)
        .await
        .expect("tries");
    assert_eq!(
        tried, 2,
        "the first record failed and the retry's was taken"
    );
    let recorded: (String, String) = sqlx::query_as(
        "SELECT blob->>'key', blake3 FROM pseudo_gradients WHERE epoch = 0 AND partition = 0
           AND miner = $1",
    )
    .bind(&hotkey)
    .fetch_one(&s.db)
    .await
    .expect("recorded");
    assert_eq!(recorded, (taken.blob.key.clone(), commit.blake3.clone()));
    assert_eq!(taken.blob.key, sealed_of(&commit), "kept at its sealed key");
    assert_eq!(
        s.app
            .store
            .get(&taken.blob.key)
            .await
            .expect("sealed object")
            .as_ref(),
        bytes.as_slice()
    );
}

/// A commit retried while its first attempt is still checking the object (a client that gave up
/// waiting for a large one) is told to retry, where it was once told that nothing was uploaded,
/// which a client takes as final; the retry then takes what the first attempt sealed. An
/// attempt's object left aside for longer than any check takes (its process died) is taken over
/// by the next commit, where it once stayed there unused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_retried_during_its_first_attempts_check_waits_and_an_abandoned_one_is_taken_over()
{
    init_tracing();
    let seeds = [174u8, 175, 176];
    let s = serve(&seeds, config()).await;
    let mut miners = join_all(&s, &seeds).await;
    let i = uploading_with_a_worker(&s, &mut miners, &seeds).await;
    let hotkey = pair(seeds[i]).ss58_of();
    let stage = miners[i].stage;
    let partition = |p: u32, value: f32| pg_commit(&s, stage, &hotkey, p, value);
    let aside = |slot: &str, at: DateTime<Utc>| {
        format!(
            "{slot}.pending-{}-{}",
            at.timestamp_millis(),
            uuid::Uuid::new_v4()
        )
    };
    let recorded = |p: u32| {
        let (db, hotkey) = (s.db.clone(), hotkey.clone());
        async move {
            sqlx::query_as::<_, (String, String)>(
                "SELECT blob->>'key', blake3 FROM pseudo_gradients
                 WHERE epoch = 0 AND partition = $1 AND miner = $2",
            )
            .bind(p as i32)
            .bind(&hotkey)
            .fetch_optional(&db)
            .await
            .expect("record")
        }
    };

    // Partition 0: the first attempt moved the object aside a moment ago and is checking it.
    let (bytes, commit) = partition(0, 0.003);
    let checking = aside(&commit.key, Utc::now());
    s.app
        .store
        .put(&checking, bytes::Bytes::from(bytes.clone()))
        .await
        .expect("put");
    let path = PG0_COMMIT;
    let body = serde_json::to_vec(&commit).expect("json");
    let retried = Raw::to(&s.base)
        .signed(&*signer(seeds[i]), reqwest::Method::POST, path, body)
        .await;
    assert_eq!(
        (retried.0, code(&retried)),
        (503, Some(ErrorCode::InProgress)),
        "{retried:?}"
    );
    assert_eq!(
        s.app
            .store
            .get(&checking)
            .await
            .expect("untouched")
            .as_ref(),
        bytes.as_slice(),
        "the first attempt's object was moved while it checked it"
    );
    assert_eq!(recorded(0).await, None);
    // The first attempt seals it, and its answer is lost; the client's retry takes it.
    let sealed = sealed_of(&commit);
    s.app.store.rename(&checking, &sealed).await.expect("seal");
    let taken: UploadResponse = miners[i]
        .client()
        .signed_json(reqwest::Method::POST, path, &commit)
        .await
        .expect("the retry takes the sealed object");
    assert_eq!(taken.blob.key, sealed);
    assert_eq!(recorded(0).await, Some((sealed, commit.blake3.clone())));

    // Partitions 1-3: `bytes` moved aside an hour ago by an attempt that died before sealing
    // them; the commit of partition `p`'s own.
    let abandon_then_commit = |p: u32, bytes: Vec<u8>, commit: CommitRequest| {
        let (store, client) = (s.app.store.clone(), miners[i].client().clone());
        let abandoned = aside(&commit.key, Utc::now() - Duration::hours(1));
        async move {
            store
                .put(&abandoned, bytes::Bytes::from(bytes))
                .await
                .expect("put");
            let answer = client
                .signed_json::<_, UploadResponse>(
                    reqwest::Method::POST,
                    &format!("/v1/miner/epochs/0/pseudo-gradients/{p}/commit"),
                    &commit,
                )
                .await;
            (abandoned, answer)
        }
    };
    // Partition 1: the commit's own bytes.
    let (bytes, commit) = partition(1, 0.004);
    let (_, answer) = abandon_then_commit(1, bytes.clone(), commit.clone()).await;
    let taken = answer.expect("the abandoned object is checked and taken");
    assert_eq!(
        recorded(1).await,
        Some((taken.blob.key.clone(), commit.blake3.clone()))
    );
    assert_eq!(
        s.app
            .store
            .get(&taken.blob.key)
            .await
            .expect("sealed")
            .as_ref(),
        bytes.as_slice()
    );
    let left = aside_of(&s.app.store, &commit.key).await;
    assert!(left.is_empty(), "left aside: {left:?}");

    // Partition 2: an abandoned object of another size is not this commit's, and stays.
    let (bytes, commit) = partition(2, 0.005);
    let (other, answer) = abandon_then_commit(2, bytes[..bytes.len() - 4].to_vec(), commit).await;
    let refused = answer.expect_err("nothing of the declared size was uploaded");
    assert_eq!(refused.code(), Some(ErrorCode::InvalidTensor), "{refused}");
    assert!(
        s.app.store.get(&other).await.is_ok(),
        "another size was taken"
    );

    // Partition 3: an abandoned object of the declared size but other bytes is checked, found not
    // to be this commit's, and put back where it was: it may be another commit's only copy.
    let (bytes, commit) = partition(3, 0.007);
    let (others, _) = partition(3, 0.008);
    assert_eq!(others.len(), bytes.len());
    let (other, answer) = abandon_then_commit(3, others.clone(), commit).await;
    let refused = answer.expect_err("other bytes than declared");
    assert_eq!(refused.code(), Some(ErrorCode::InvalidTensor), "{refused}");
    assert_eq!(
        s.app.store.get(&other).await.expect("put back").as_ref(),
        others.as_slice(),
        "another commit's object was deleted"
    );
}

/// A pseudo-gradient partition in its slot on the S3 store, as a presigned PUT leaves it, with
/// the orchestrator's store reached through a relay that holds back its first copy to the
/// partition's sealed key (the last step of a commit's check).
struct HeldCommit {
    s: Served,
    slow: SlowStore,
    /// The bucket directly, not through the relay.
    bucket: BlobStore,
    client: iota_protocol::ApiClient,
    /// The miner's seed and hotkey.
    seed: u8,
    hotkey: String,
    slot: String,
    bytes: Vec<u8>,
    commit: CommitRequest,
    sealed: String,
}

const PG0_COMMIT: &str = "/v1/miner/epochs/0/pseudo-gradients/0/commit";

/// A presigned upload of partition 0 of epoch 0 for `commit`'s bytes, in parts if `multipart`
/// (and the store's part size asks for them).
async fn presign_pg0(
    client: &iota_protocol::ApiClient,
    commit: &CommitRequest,
    multipart: bool,
) -> PresignResponse {
    client
        .signed_json(
            reqwest::Method::POST,
            "/v1/miner/epochs/0/pseudo-gradients/0/presign",
            &PresignRequest {
                size: commit.size,
                blake3: commit.blake3.clone(),
                multipart,
            },
        )
        .await
        .expect("presign")
}

async fn held_commit(seeds: [u8; 3]) -> HeldCommit {
    let s3 = s3_store();
    let slow = slow_store(&s3).await;
    let s = serve_with(&seeds, config(), Some(slow.store.clone())).await;
    let bucket = BlobStore::open(&s3).expect("store");
    let mut miners = join_all(&s, &seeds).await;
    let i = uploading_with_a_worker(&s, &mut miners, &seeds).await;
    let hotkey = pair(seeds[i]).ss58_of();
    let (bytes, commit) = pg_commit(&s, miners[i].stage, &hotkey, 0, 0.006);
    let slot = commit.key.clone();
    bucket
        .put(&slot, bytes::Bytes::from(bytes.clone()))
        .await
        .expect("put");
    let sealed = sealed_of(&commit);
    // Only the copy to the sealed key names the hash.
    *slow.marker.lock().expect("marker") = Some(("PUT", commit.blake3.clone()));
    HeldCommit {
        client: miners[i].client().clone(),
        seed: seeds[i],
        s,
        slow,
        bucket,
        hotkey,
        slot,
        bytes,
        commit,
        sealed,
    }
}

impl HeldCommit {
    /// The commit, sent by the miner's client in a task of its own.
    fn send(&self) -> tokio::task::JoinHandle<Result<UploadResponse, iota_protocol::ClientError>> {
        let (client, commit) = (self.client.clone(), self.commit.clone());
        tokio::spawn(async move {
            client
                .signed_json(reqwest::Method::POST, PG0_COMMIT, &commit)
                .await
        })
    }

    /// Until the relay holds the commit's copy to the sealed key: the object is checked.
    async fn until_held(&self) {
        tokio::time::timeout(
            std::time::Duration::from_secs(20),
            self.slow.held.notified(),
        )
        .await
        .expect("the commit checked the object and is sealing it");
    }

    /// The commit sent again is answered with the sealed object, and recorded with it.
    async fn retry_takes_the_sealed_object(&self) {
        let retried = self
            .send()
            .await
            .expect("join")
            .expect("the retry takes the sealed object");
        assert_eq!(retried.blob.key, self.sealed);
        self.recorded_sealed().await;
    }

    /// The partition is recorded with the sealed object, which holds the bytes.
    async fn recorded_sealed(&self) {
        let recorded: (String, String) = sqlx::query_as(
            "SELECT blob->>'key', blake3 FROM pseudo_gradients WHERE epoch = 0 AND partition = 0
               AND miner = $1",
        )
        .bind(&self.hotkey)
        .fetch_one(&self.s.db)
        .await
        .expect("recorded");
        assert_eq!(recorded, (self.sealed.clone(), self.commit.blake3.clone()));
        assert_eq!(
            self.bucket
                .get(&self.sealed)
                .await
                .expect("sealed")
                .as_ref(),
            self.bytes.as_slice()
        );
    }
}

/// An attempt of a commit whose object another attempt took over while it checked it (it ran
/// longer than `abandoned_after`) finds its object gone when it seals it: it answers from what
/// the other attempt sealed, where it once failed with the store's "not found". On the S3 store
/// (a move there is a copy and a delete), through a relay that holds the first attempt's copy to
/// the sealed key while the takeover happens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_object_was_taken_over_answers_from_the_sealed_object() {
    init_tracing();
    let h = held_commit([177, 178, 179]).await;
    let first = h.send();
    h.until_held().await;
    // Meanwhile another attempt takes the object over and seals it.
    let (bucket, slot, sealed) = (&h.bucket, &h.slot, &h.sealed);
    let aside = aside_of(bucket, slot).await;
    let [checked] = &aside[..] else {
        panic!("one object aside: {aside:?}");
    };
    let taken = format!("{slot}.pending-0-takeover");
    bucket.rename(checked, &taken).await.expect("take over");
    bucket.rename(&taken, sealed).await.expect("seal");
    h.slow.release.notify_one();
    let answered = first
        .await
        .expect("join")
        .expect("the first attempt answers from the sealed object");
    assert_eq!(
        (answered.blob.key.as_str(), answered.blob.blake3.as_str()),
        (sealed.as_str(), h.commit.blake3.as_str())
    );
    h.recorded_sealed().await;
}

/// A client that stops waiting for its commit (a large object takes long to check) and closes
/// its connection does not stop the check: it seals the object, and the client's next try takes
/// it. The server drops such a request with its handler, which once stopped the check and left
/// the object aside, and every retry `in_progress`, until it counted as abandoned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_client_stopped_waiting_is_sealed_for_its_retry() {
    init_tracing();
    let h = held_commit([187, 188, 189]).await;
    // Held instead as the check reads the object it moved aside.
    *h.slow.marker.lock().expect("marker") = Some(("GET", ".pending-".into()));
    // The first attempt, on a connection of its own that the client then closes.
    let body = serde_json::to_vec(&h.commit).expect("json");
    let signed = iota_protocol::signing::sign_request(
        &*signer(h.seed),
        &pair(200).ss58_of(),
        "POST",
        PG0_COMMIT,
        &body,
        now_ms(),
        uuid::Uuid::new_v4(),
    );
    let addr = h.s.base.trim_start_matches("http://");
    let mut request = format!(
        "POST {PG0_COMMIT} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in signed.headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    let mut first = tokio::net::TcpStream::connect(addr).await.expect("connect");
    {
        use tokio::io::AsyncWriteExt;
        first.write_all(request.as_bytes()).await.expect("send");
        first.write_all(&body).await.expect("send");
    }
    h.until_held().await;
    // The client gives up while the check reads the object: its connection closes.
    drop(first);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    h.slow.release.notify_one();
    eventually(
        "the object is sealed",
        std::time::Duration::from_secs(10),
        || async { h.bucket.get(&h.sealed).await.ok().map(|_| ()) },
    )
    .await;
    h.retry_takes_the_sealed_object().await;
}

/// A commit whose check could not read the object back (the store failed) puts the object back
/// in its slot, and the client's retry checks and seals it. Left aside, it was the only copy, and
/// every retry was told `in_progress` until it counted as abandoned (minutes). On the S3 store,
/// through a relay that refuses the check's read of the object it moved aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_check_failed_on_the_store_leaves_the_object_for_its_retry() {
    init_tracing();
    let h = held_commit([191, 192, 193]).await;
    *h.slow.marker.lock().expect("marker") = Some(("GET", ".pending-".into()));
    h.slow
        .refuse
        .store(true, std::sync::atomic::Ordering::SeqCst);
    // The first attempt alone, without the client's own retries.
    let once = iota_protocol::ApiClient::new(
        h.s.base.clone(),
        signer(h.seed),
        pair(200).ss58_of(),
        iota_protocol::RetryPolicy {
            attempts: 1,
            ..Default::default()
        },
    )
    .expect("client");
    let failed = once
        .signed_json::<_, UploadResponse>(reqwest::Method::POST, PG0_COMMIT, &h.commit)
        .await
        .expect_err("the store refused the check's read");
    assert_eq!(failed.code(), Some(ErrorCode::Internal), "{failed}");
    assert_eq!(
        h.bucket
            .get(&h.slot)
            .await
            .expect("back in its slot")
            .as_ref(),
        h.bytes.as_slice()
    );
    let aside = aside_of(&h.bucket, &h.slot).await;
    assert!(aside.is_empty(), "nothing left aside: {aside:?}");
    h.retry_takes_the_sealed_object().await;
}

/// A miner that reserved its upload before the uploading deadline gets every partition in after
/// it: the phase waits for it (a large upload under way when the deadline passed was refused at
/// the switch to merging, and its epoch's work lost), also across a gap in which nobody drove the
/// run. A miner that restarted after reserving holds nothing (its uploads are refused), a
/// reservation after the phase is refused, and the wait is bounded (see `domain::phases::next_step`'s
/// test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserved_upload_lands_after_the_deadline() {
    init_tracing();
    let seeds = [181u8, 182, 183];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    // Three with gradient work: the third uploads nothing, so no quorum ends the phase.
    let worked = step_until_workers(&s, &mut miners, run.stages, |w| w.len() >= 3).await;
    let workers: Vec<usize> = (0..seeds.len())
        .filter(|&i| worked.contains(&pair(seeds[i]).ss58_of()))
        .collect();
    let [i, restarted, _] = workers[..] else {
        panic!("three miners with gradient work: {worked:?}");
    };
    let hotkey = pair(seeds[i]).ss58_of();
    let (_, phase, deadline, _) = past_the_deadline(&s).await;
    assert_eq!(phase, Phase::Uploading);

    let uploading = Duration::seconds(run.uploading_s as i64);
    for m in [i, restarted] {
        let reserved = miners[m]
            .client()
            .reserve_pseudo_gradients(0)
            .await
            .expect("reserve before the deadline");
        assert_eq!(
            reserved.holds_until_ms,
            (deadline + uploading).timestamp_millis()
        );
    }
    miners[i]
        .client()
        .reserve_pseudo_gradients(0)
        .await
        .expect("a retried reservation");
    // One of them restarts: its uploads would be refused, so it holds nothing.
    let (_, joined) = registered_miner(&s.base, seeds[restarted]).await;
    assert_eq!(joined.work_ended, Some(0));

    // The deadline passes with nothing uploaded yet: the phase waits.
    let mut t = deadline + Duration::seconds(1);
    driver::step(&s.app, t).await.expect("step");
    assert_eq!(
        now_status(&s).await.1,
        Phase::Uploading,
        "the reservation was not held"
    );
    // Nobody drives the run for longer than the hold; a new leader gives its time back.
    t += Duration::minutes(10);
    driver::forgive_gap(&s.app, t)
        .await
        .expect("forgive the gap");
    t += Duration::seconds(1);
    driver::step(&s.app, t).await.expect("step");
    assert_eq!(
        now_status(&s).await.1,
        Phase::Uploading,
        "the hold did not outlive the gap"
    );

    let stage = miners[i].stage;
    for partition in 0..run.partitions {
        let range = run.partition_range(stage, partition).expect("partition");
        let values = vec![0.001f32; (range.end - range.start) as usize];
        miners[i]
            .client()
            .upload_pseudo_gradient(
                0,
                partition,
                bytes::Bytes::from(iota_protocol::tensor::encode_partition(&values)),
            )
            .await
            .expect("an upload after the deadline, reserved before it");
        // Held until the last partition is in; then the restarted miner holds nothing.
        driver::step(&s.app, t).await.expect("step");
        let phase = now_status(&s).await.1;
        if partition + 1 < run.partitions {
            assert_eq!(phase, Phase::Uploading, "partition {partition}");
        } else {
            assert_eq!(phase, Phase::Merging, "held for a restarted miner");
        }
    }
    let contributed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM partitions WHERE epoch = 0 AND stage = $1
           AND contributions::text LIKE '%' || $2 || '%'",
    )
    .bind(stage as i32)
    .bind(&hotkey)
    .fetch_one(&s.db)
    .await
    .expect("contributions");
    assert_eq!(
        contributed,
        i64::from(run.partitions),
        "its partitions are merged"
    );
    let late = miners[i]
        .client()
        .reserve_pseudo_gradients(0)
        .await
        .expect_err("a reservation while merging");
    assert_eq!(late.code(), Some(ErrorCode::WrongPhase), "{late}");
}

/// The race the switch to merging decides again for: a reservation whose transaction has not
/// committed when the driver first looks, and commits while the driver waits for its lock.
/// A trigger holds the reservation's transaction (and its shared phase lock) open until the
/// driver is seen waiting for the exclusive one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_committed_while_the_switch_waits_for_its_lock_holds_the_phase() {
    init_tracing();
    let seeds = [184u8, 185, 186];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    // Three with gradient work and nothing uploaded: past the deadline the phase ends unless
    // someone reserved.
    let worked = step_until_workers(&s, &mut miners, run.stages, |w| w.len() >= 3).await;
    let i = (0..seeds.len())
        .find(|&i| worked.contains(&pair(seeds[i]).ss58_of()))
        .expect("a miner with gradient work");
    let (_, phase, deadline, _) = past_the_deadline(&s).await;
    assert_eq!(phase, Phase::Uploading);

    for sql in [
        "CREATE FUNCTION wait_for_the_driver() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             FOR _ IN 1..200 LOOP
                 IF EXISTS (SELECT 1 FROM pg_locks l JOIN pg_database d ON d.oid = l.database
                            WHERE d.datname = current_database()
                              AND l.locktype = 'advisory' AND NOT l.granted) THEN
                     RETURN NEW;
                 END IF;
                 PERFORM pg_sleep(0.05);
             END LOOP;
             RAISE EXCEPTION 'the driver never waited for the phase lock';
         END $$",
        "CREATE TRIGGER wait_for_the_driver AFTER INSERT ON upload_reservations
         FOR EACH ROW EXECUTE FUNCTION wait_for_the_driver()",
    ] {
        sqlx::query(sql)
            .execute(&s.db)
            .await
            .expect("hold reservations open");
    }
    let client = miners[i].client().clone();
    let reserving = tokio::spawn(async move { client.reserve_pseudo_gradients(0).await });
    // The reservation is inserted, not committed, and its transaction holds the shared lock.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let inserted: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                            WHERE datname = current_database() AND wait_event = 'PgSleep')",
        )
        .fetch_one(&s.db)
        .await
        .expect("activity");
        if inserted {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the reservation never reached its insert"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The driver sees no reservation, decides to merge, and waits for the exclusive lock; the
    // trigger sees it waiting and lets the reservation commit.
    let t = deadline + Duration::seconds(1);
    driver::step(&s.app, t).await.expect("step");
    // Taken, so the trigger saw the driver waiting (it refuses the insert otherwise).
    reserving
        .await
        .expect("task")
        .expect("a reservation taken before the deadline, committed while the driver waited");
    assert_eq!(
        now_status(&s).await.1,
        Phase::Uploading,
        "the switch to merging did not count a reservation committed while it waited"
    );
}

/// An epoch's objects are collected only once no presigned URL for them can still be used: a
/// PUT that lands after its epoch ended, through a URL handed out while it ran, is deleted with
/// the epoch's other objects. (Collected as soon as retention passed, such an object stayed in
/// the bucket for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_presigned_put_landing_after_its_epoch_ended_is_collected() {
    init_tracing();
    let seeds = [191u8, 192, 193];
    let run = config();
    let s = serve_with(&seeds, run.clone(), Some(s3_store())).await;
    let grace = Duration::from_std(s.app.store.upload_grace()).expect("grace");
    assert!(
        grace > Duration::zero(),
        "a presigning store waits for its URLs"
    );
    let key = format!(
        "runs/{}/epoch-0/samples/late-output.safetensors",
        s.app.run.id
    );
    let url = s
        .app
        .store
        .presign(http::Method::PUT, &key)
        .await
        .expect("presign")
        .expect("an S3 store presigns");

    // Deadlines pass until epoch 0 is past the retention window.
    for _ in 0..40 {
        if now_status(&s).await.0 > run.retention_epochs {
            break;
        }
        past_the_deadline(&s).await;
    }
    let (epoch, ..) = now_status(&s).await;
    assert!(epoch > run.retention_epochs, "epoch {epoch}");
    let ended: DateTime<Utc> = sqlx::query_scalar("SELECT ended_at FROM epochs WHERE epoch = 0")
        .fetch_one(&s.db)
        .await
        .expect("epoch 0 ended");
    let collected = || async {
        sqlx::query_scalar::<_, bool>("SELECT gc_done FROM epochs WHERE epoch = 0")
            .fetch_one(&s.db)
            .await
            .expect("gc_done")
    };

    // While the URL may still be used, the epoch is kept.
    driver::collect_garbage(&s.app, ended + grace - Duration::seconds(1))
        .await
        .expect("collect");
    assert!(!collected().await, "collected while its URLs were live");
    // The PUT lands late (the URL was handed out while epoch 0 ran).
    let put = reqwest::Client::new()
        .put(&url)
        .body(vec![7u8; 64])
        .send()
        .await
        .expect("PUT");
    assert!(put.status().is_success(), "{}", put.status());
    assert!(s.app.store.get(&key).await.is_ok(), "the late PUT landed");

    driver::collect_garbage(&s.app, ended + grace + Duration::seconds(1))
        .await
        .expect("collect");
    assert!(collected().await, "epoch 0 collected once its URLs expired");
    assert!(
        s.app.store.get(&key).await.is_err(),
        "the late PUT is collected with its epoch"
    );
}

/// One hotkey is one vote: a result it submitted through the validator route (before it joined
/// as a miner, when nothing refused it) and the same result as an owner are counted once, so the
/// partition waits for another owner instead of being accepted on its word alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hotkey_submitting_as_validator_and_as_owner_is_one_vote() {
    init_tracing();
    let t = PermitHolderOwner::new(&[221u8, 222, 223, 224, 225, FIRST_VALIDATOR + 4]).await;
    let bytes = (t.merged)(0.25);
    let hash = iota_protocol::blob::blake3_hex(&bytes);
    let hotkey = pair(FIRST_VALIDATOR + 4).ss58_of();
    sqlx::query(
        "INSERT INTO merge_results (run_id, epoch, stage, partition, submitter, blob, blake3,
                                    submitted_at)
         SELECT id, 0, $1, $2, 'validator:' || $3,
                jsonb_build_object('key', 'earlier', 'size', 1, 'dtype', 'f32',
                                   'shape', '[1]'::jsonb, 'blake3', $4::text),
                $4, now() - interval '1 minute'
         FROM runs",
    )
    .bind(t.stage as i32)
    .bind(t.partition as i32)
    .bind(&hotkey)
    .bind(&hash)
    .execute(&t.s.db)
    .await
    .expect("an earlier validator submission");
    t.miners[t.both]
        .client()
        .upload_merge(0, t.stage, t.partition, bytes)
        .await
        .expect("its merge as an owner");
    assert_eq!(t.state().await, "open", "one hotkey's two results agreed");
}

/// A stage-0 miner whose work in the epoch has ended (here: it restarted without the state its
/// hops left) is given no new samples, and a hop leased to it by a poll that raced with the end
/// does not complete. Its polls started samples that the driver then moved, over and over,
/// spending the epoch's sample budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miner_whose_work_ended_starts_no_samples_and_completes_no_hop() {
    init_tracing();
    let seeds = [231u8, 232, 233];
    let mut run = config();
    // Room for more samples than its first step takes.
    run.max_in_flight = 32;
    run.samples_per_epoch = 128;
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let first = miners
        .iter()
        .position(|m| m.stage == 0)
        .expect("a stage-0 miner");
    step_until_report(&mut miners[first], |r| r.hops > 0).await;
    let (client, joined) = registered_miner(&s.base, seeds[first]).await;
    assert_eq!(joined.work_ended, Some(0), "restarted without its state");
    let started = |db: PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT samples_started FROM epochs WHERE epoch = 0")
            .fetch_one(&db)
            .await
            .expect("samples started")
    };
    let before = started(s.db.clone()).await;
    assert!(
        before + 8 < i64::from(run.max_in_flight),
        "room left: {before} started"
    );
    let polled = client.work(4).await.expect("poll");
    assert!(
        polled.items.is_empty(),
        "work for an ended miner: {:?}",
        polled.items
    );
    assert_eq!(
        started(s.db.clone()).await,
        before,
        "samples started for it"
    );

    // A hop that a completion racing with the end routed to it, and a poll leased: a backward
    // hop at stage 0, which needs no output.
    let (task_id, lease): (i64, uuid::Uuid) = sqlx::query_as(
        "WITH sample AS (INSERT INTO samples (run_id, epoch, status)
                         SELECT id, 0, 'backward' FROM runs RETURNING run_id, id)
         INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, miner, status, lease,
                            leased_at, leased_until)
         SELECT run_id, 0, id, 0, 'backward', $1, 'leased', gen_random_uuid(), now(),
                now() + interval '1 hour'
         FROM sample RETURNING id, lease",
    )
    .bind(pair(seeds[first]).ss58_of())
    .fetch_one(&s.db)
    .await
    .expect("a raced hop");
    let refused = client
        .complete(task_id, &completion(lease, None, None))
        .await
        .expect_err("a hop completed after the miner's work ended");
    assert_eq!(refused.code(), Some(ErrorCode::LeaseExpired), "{refused}");
}

/// Polls of one stage-0 miner sent at once start no more samples than its in-flight limit:
/// each counted the samples in flight before any had started its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_sent_at_once_keep_a_miner_within_its_in_flight_limit() {
    init_tracing();
    let seeds = [241u8, 242, 243];
    let mut run = config();
    run.max_in_flight = 2;
    run.samples_per_epoch = 64;
    let s = serve(&seeds, run.clone()).await;
    let miners = join_all(&s, &seeds).await;
    let first = miners
        .iter()
        .position(|m| m.stage == 0)
        .expect("a stage-0 miner");
    let client = miners[first].client().clone();
    let polls = (0..16).map(|_| {
        let client = client.clone();
        tokio::spawn(async move { client.work(2).await })
    });
    let mut leased = 0;
    for poll in futures::future::join_all(polls).await {
        leased += poll.expect("join").expect("poll").items.len();
    }
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tasks WHERE miner = $1 AND stage = 0 AND status = 'leased'",
    )
    .bind(pair(seeds[first]).ss58_of())
    .fetch_one(&s.db)
    .await
    .expect("held");
    assert!(
        held <= i64::from(run.max_in_flight),
        "{held} samples in flight for one miner (limit {}), {leased} items answered",
        run.max_in_flight
    );
}

/// In a run of one stage no hop has an output (the forward's loss is all it gives): the work
/// item says so, an upload is refused before it is stored, a loss outside 0 to 10,000 is
/// refused, and a completion retried after its answer was lost is answered as the first was.
/// The item asked for an output the completion then dropped, so a retry sending it again was a
/// conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_stage_run_takes_no_hop_output() {
    init_tracing();
    let seeds = [251u8];
    let mut run = config();
    run.stages = 1;
    run.stage_params = vec![4000];
    let s = serve(&seeds, run.clone()).await;
    let (client, _) = registered_miner(&s.base, seeds[0]).await;
    let item = client
        .work(1)
        .await
        .expect("poll")
        .items
        .pop()
        .expect("a sample");
    assert_eq!((item.stage, item.direction), (0, Direction::Forward));
    assert!(!item.expects_output, "{item:?}");
    let refused = client
        .upload_output(item.task_id, item.lease, bytes::Bytes::from(vec![0u8; 64]))
        .await
        .expect_err("an output for a hop that has none");
    assert_eq!(refused.code(), Some(ErrorCode::BadRequest), "{refused}");
    // Losses no model reports are refused: one above about 1e154 overflowed the epoch's loss
    // mean in PostgreSQL, and the run never left merging.
    for loss in [1e300, -1.0, f64::MAX] {
        let refused = client
            .complete(item.task_id, &completion(item.lease, None, Some(loss)))
            .await
            .expect_err("an impossible loss");
        assert_eq!(
            refused.code(),
            Some(ErrorCode::BadRequest),
            "{loss}: {refused}"
        );
    }
    let refused = client
        .complete(
            item.task_id,
            &CompleteRequest {
                sequence_losses: Some(vec![2.5, 1e300]),
                ..completion(item.lease, None, Some(2.5))
            },
        )
        .await
        .expect_err("an impossible sequence loss");
    assert_eq!(refused.code(), Some(ErrorCode::BadRequest), "{refused}");
    // A loss that is not the mean of the sample's own sequence losses: a replay checks the
    // sequences and CLASP fits the loss, so it would pass the one and steer the other.
    let refused = client
        .complete(
            item.task_id,
            &CompleteRequest {
                sequence_losses: Some(vec![2.0, 3.0]),
                ..completion(item.lease, None, Some(1.0))
            },
        )
        .await
        .expect_err("a loss other than its sequences' mean");
    assert_eq!(refused.code(), Some(ErrorCode::BadRequest), "{refused}");
    assert!(
        refused.to_string().contains("mean of sequence_losses"),
        "{refused}"
    );
    let complete = CompleteRequest {
        sequence_losses: Some(vec![2.0, 3.0]),
        ..completion(item.lease, None, Some(2.5))
    };
    let first = client
        .complete(item.task_id, &complete)
        .await
        .expect("complete");
    let retried = client
        .complete(item.task_id, &complete)
        .await
        .expect("the completion retried");
    assert_eq!(retried, first);
}

/// A reservation retried after the uploading deadline (the first was made in time and its
/// answer lost) is answered as the first was: the hold is in force. It was refused as too late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_retried_after_the_deadline_is_answered_as_the_first_was() {
    init_tracing();
    let seeds = [161u8, 162, 163];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let i = uploading_with_a_worker(&s, &mut miners, &seeds).await;
    let first = miners[i]
        .client()
        .reserve_pseudo_gradients(0)
        .await
        .expect("a reservation in time");
    // The deadline passes on the clock the handler reads.
    let deadline: DateTime<Utc> = sqlx::query_scalar(
        "UPDATE runs SET phase_deadline = now() - interval '1 second' RETURNING phase_deadline",
    )
    .fetch_one(&s.db)
    .await
    .expect("deadline");
    let retried = miners[i]
        .client()
        .reserve_pseudo_gradients(0)
        .await
        .expect("the reservation retried after the deadline");
    assert_eq!(retried.epoch, first.epoch);
    assert_eq!(
        retried.holds_until_ms,
        (deadline + Duration::seconds(run.uploading_s as i64)).timestamp_millis()
    );
}

/// A completion retried after its sample has moved on (its answer lost) is answered as the
/// first was: the hop it routed, not the sample's latest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_retried_later_names_the_hop_it_routed() {
    init_tracing();
    let seeds = [171u8, 172, 173];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let at = |stage: u32| {
        miners
            .iter()
            .position(|m| m.stage == stage)
            .expect("a miner of each stage")
    };
    let second = at(1);
    let (_, client, item, blob) = a_first_hop_output(&run, &miners).await;
    let complete = completion(item.lease, Some(blob), None);
    let answer = client
        .complete(item.task_id, &complete)
        .await
        .expect("complete");
    let routed = answer.next_task_id.expect("the hop it routed");
    // The next stage does its hop: the sample has a later hop now.
    step_until_report(&mut miners[second], |r| r.hops > 0).await;
    let later: i64 = sqlx::query_scalar("SELECT max(id) FROM tasks WHERE sample_id = $1")
        .bind(item.sample_id)
        .fetch_one(&s.db)
        .await
        .expect("later hop");
    assert!(later > routed, "the sample moved on");
    let retried = client
        .complete(item.task_id, &complete)
        .await
        .expect("the completion retried");
    assert_eq!(retried, answer);
    // Once later hops have finished the sample, a retry still answers that this completion did
    // not finish it (it answered from the sample's state at the time).
    for _ in 0..60 {
        let status: String = sqlx::query_scalar("SELECT status FROM samples WHERE id = $1")
            .bind(item.sample_id)
            .fetch_one(&s.db)
            .await
            .expect("sample");
        if status == "done" {
            break;
        }
        for m in miners.iter_mut() {
            m.step().await.expect("step");
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let status: String = sqlx::query_scalar("SELECT status FROM samples WHERE id = $1")
        .bind(item.sample_id)
        .fetch_one(&s.db)
        .await
        .expect("sample");
    assert_eq!(status, "done", "the later hops finished the sample");
    let after_done = client
        .complete(item.task_id, &complete)
        .await
        .expect("the completion retried after its sample was done");
    assert_eq!(after_done, answer);
}

/// A hop whose sample is no longer in flight is not completed. A completion that raced with the
/// end of the epoch could leave a hop of an abandoned sample open until the next sweep; a miner
/// that leased it and completed it moved the sample on again (here: routed its next hop), after
/// the epoch's loss mean had been stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hop_of_an_abandoned_sample_is_not_completed() {
    init_tracing();
    let seeds = [174u8, 175, 176];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let miners = join_all(&s, &seeds).await;
    let (_, client, item, blob) = a_first_hop_output(&run, &miners).await;
    // As `next_epoch` leaves it when the hop escaped its sweep.
    sqlx::query("UPDATE samples SET status = 'abandoned' WHERE id = $1")
        .bind(item.sample_id)
        .execute(&s.db)
        .await
        .expect("abandon");
    let refused = client
        .complete(item.task_id, &completion(item.lease, Some(blob), None))
        .await
        .expect_err("a hop of an abandoned sample");
    assert_eq!(refused.code(), Some(ErrorCode::LeaseExpired), "{refused}");
    let hops: i64 = sqlx::query_scalar("SELECT count(*) FROM tasks WHERE sample_id = $1")
        .bind(item.sample_id)
        .fetch_one(&s.db)
        .await
        .expect("hops");
    assert_eq!(hops, 1, "the sample moved on");
}

/// A stage-0 poll that read the training phase, and starts samples only once the driver has
/// moved the run to uploading, starts none: samples begin before training ends or not at all.
/// Such a poll started samples into the uploading phase, where they were abandoned unfinished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sample_starts_after_training_has_ended() {
    init_tracing();
    let seeds = [177u8, 178, 179];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let miners = join_all(&s, &seeds).await;
    let first = miners
        .iter()
        .position(|m| m.stage == 0)
        .expect("a miner of stage 0");
    let client = miners[first].client().clone();
    // The driver's side of a phase change: the phase lock, held while the phase changes.
    let mut driver = s.db.begin().await.expect("tx");
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2::int)")
        .bind(driver::PHASE_LOCK_CLASS)
        .bind(s.app.run.id as i32)
        .execute(&mut *driver)
        .await
        .expect("phase lock");
    let poll = tokio::spawn(async move { client.work(4).await });
    // The poll reads the training phase and waits for the phase lock to start samples.
    until_waiting_for_locks(&s.db, 1, true).await;
    sqlx::query("UPDATE runs SET phase = 'uploading' WHERE id = $1")
        .bind(s.app.run.id)
        .execute(&mut *driver)
        .await
        .expect("uploading");
    driver.commit().await.expect("commit");
    let answer = poll.await.expect("join").expect("poll");
    assert!(answer.items.is_empty(), "{:?}", answer.items);
    let started: i64 = sqlx::query_scalar("SELECT count(*) FROM samples WHERE run_id = $1")
        .bind(s.app.run.id)
        .fetch_one(&s.db)
        .await
        .expect("samples");
    assert_eq!(started, 0);
}

/// Two owners agreeing do not settle a partition that has three: a colluding pair's merge waits
/// for the third owner's, and when that differs the partition is disputed for the validators,
/// with no owner added (more owners' results cannot outvote a wrong agreement). Before, the
/// first two agreeing results were accepted, and a disagreement took a tie-break owner whose
/// result made a majority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_that_agrees_does_not_outvote_the_third_owner() {
    init_tracing();
    let seeds = [216u8, 217, 218, 219, 220, FIRST_VALIDATOR + 4];
    let t = PermitHolderOwner::new(&seeds).await;
    let (stage, partition, merged) = (t.stage, t.partition, &t.merged);
    let mut conn = t.s.db.acquire().await.expect("connection");
    let owners = owners_of(&mut conn, stage, partition).await;
    assert_eq!(owners.len(), 3, "three owners: {owners:?}");
    let index_of = |hotkey: &str| {
        seeds
            .iter()
            .position(|seed| pair(*seed).ss58_of() == hotkey)
            .expect("a miner of the test")
    };
    let (pair_a, pair_b, honest) = (
        index_of(&owners[0]),
        index_of(&owners[1]),
        index_of(&owners[2]),
    );
    for colluder in [pair_a, pair_b] {
        t.miners[colluder]
            .client()
            .upload_merge(0, stage, partition, merged(0.25))
            .await
            .expect("a colluder's merge");
    }
    assert_eq!(
        t.state().await,
        "open",
        "two of three agreeing settle nothing"
    );
    t.miners[honest]
        .client()
        .upload_merge(0, stage, partition, merged(0.75))
        .await
        .expect("the third owner's merge");
    assert_eq!(t.state().await, "disputed");
    let disputes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM disputes WHERE epoch = 0 AND stage = $1 AND partition = $2
           AND state = 'open'",
    )
    .bind(stage as i32)
    .bind(partition as i32)
    .fetch_one(&t.s.db)
    .await
    .expect("disputes");
    assert_eq!(disputes, 1, "put to the validators");
    let after = owners_of(&mut conn, stage, partition).await;
    assert_eq!(after.len(), 3, "no tie-break owner: {after:?}");
}

/// A bad-object report reads the whole object into memory, so it takes one of the upload slots
/// as an upload's body does, and waits while every slot is busy. Reports took none: a hotkey
/// sending many at once held as many objects in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_object_report_takes_an_upload_slot() {
    init_tracing();
    let seeds = [181u8, 182, 183];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let miners = join_all(&s, &seeds).await;
    let (first, client, item, blob) = a_first_hop_output(&run, &miners).await;
    client
        .complete(
            item.task_id,
            &completion(item.lease, Some(blob.clone()), None),
        )
        .await
        .expect("complete");
    let slots = s.app.limits.concurrent_uploads as u32;
    let held = s
        .app
        .object_slots
        .clone()
        .acquire_many_owned(slots)
        .await
        .expect("every slot");
    let body = serde_json::to_vec(&BadObjectReport {
        key: blob.key.clone(),
        reason: "checking".into(),
    })
    .expect("json");
    let report = tokio::spawn({
        let raw = Raw::to(&s.base);
        let reporter = pair(seeds[(first + 1) % seeds.len()]);
        async move {
            raw.send(Call::new(
                &reporter,
                reqwest::Method::POST,
                "/v1/miner/reports/bad-object",
                body,
            ))
            .await
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(
        !report.is_finished(),
        "the report read the object with every slot busy"
    );
    drop(held);
    let answer = report.await.expect("join");
    assert_eq!(answer.0, 200, "{answer:?}");
}

/// An upload whose client goes away between storing its object and recording it is recorded all
/// the same. The server dropped the handler with the connection, which left the stored object
/// with no row, and nothing then refused another upload to the slot (each left an object behind
/// until the epoch was collected).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_whose_client_went_away_is_recorded_all_the_same() {
    init_tracing();
    let seeds = [184u8, 185, 186];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let i = uploading_with_a_worker(&s, &mut miners, &seeds).await;
    let (stage, hotkey) = (miners[i].stage, pair(seeds[i]).ss58_of());
    let range = run.partition_range(stage, 0).expect("partition");
    let bytes =
        iota_protocol::tensor::encode_partition(&vec![0.5; (range.end - range.start) as usize]);
    let blake3 = iota_protocol::blob::blake3_hex(&bytes);
    let path = format!("/v1/miner/epochs/0/pseudo-gradients/0?blake3={blake3}");
    // The driver's side of a phase change: the phase lock, which recording waits for.
    let mut driver = s.db.begin().await.expect("tx");
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2::int)")
        .bind(driver::PHASE_LOCK_CLASS)
        .bind(s.app.run.id as i32)
        .execute(&mut *driver)
        .await
        .expect("phase lock");
    let signed = iota_protocol::signing::sign_request(
        &pair(seeds[i]),
        &pair(200).ss58_of(),
        "PUT",
        &path,
        &bytes,
        now_ms(),
        uuid::Uuid::new_v4(),
    );
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(2))
        .build()
        .expect("client");
    let mut put = client
        .put(format!("{}{path}", s.base))
        .header("content-type", "application/octet-stream")
        .body(bytes);
    for (name, value) in signed.headers {
        put = put.header(name, value);
    }
    let gone = put.send().await;
    assert!(
        gone.is_err(),
        "answered while the phase lock was held: {gone:?}"
    );
    driver.commit().await.expect("release");
    let recorded = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pseudo_gradients WHERE miner = $1 AND partition = 0",
        )
        .bind(&hotkey)
        .fetch_one(&s.db)
        .await
        .expect("rows")
    };
    eventually(
        "the upload recorded after its client went away",
        std::time::Duration::from_secs(10),
        || async { (recorded().await == 1).then_some(()) },
    )
    .await;
}

/// A pseudo-gradient uploaded through the orchestrator streams into the store, checked on the
/// way: one that fails a check anywhere in it (its last value, its length, its hash), or whose
/// sender stops half-way, leaves nothing in the store, not even a part; a good one is stored
/// whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_pseudo_gradient_that_fails_its_checks_leaves_nothing() {
    use iota_protocol::blob::blake3_hex;
    use iota_protocol::tensor::encode_partition;
    init_tracing();
    let seeds = [187u8, 188, 189];
    let mut run = config();
    // Partitions of 8M values (32 MB): many frames of a body, many parts of the store's upload,
    // and more than the connection's buffers take, so a refusal comes while the body is sent
    // (the sender must still read it, not a broken pipe).
    run.stage_params = vec![32_000_000; 3];
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds).await;
    let i = uploading_with_a_worker(&s, &mut miners, &seeds).await;
    let (stage, seed) = (miners[i].stage, seeds[i]);
    let range = run.partition_range(stage, 0).expect("partition");
    let n = (range.end - range.start) as usize;
    let good = encode_partition(&vec![0.001; n]);
    let mut nan_last = good.clone();
    let end = nan_last.len();
    nan_last[end - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
    let short = encode_partition(&vec![0.001; n - 1]);
    let path = |blake3: &str| format!("/v1/miner/epochs/0/pseudo-gradients/0?blake3={blake3}");
    let stored = || files_under(s._store.path());
    let before = stored();
    let raw = Raw::to(&s.base);
    for (what, bytes, declared) in [
        (
            "NaN as its last value",
            nan_last.clone(),
            blake3_hex(&nan_last),
        ),
        ("a value short", short.clone(), blake3_hex(&short)),
        ("another hash", good.clone(), blake3_hex(b"other bytes")),
    ] {
        let r = raw
            .signed(&pair(seed), reqwest::Method::PUT, &path(&declared), bytes)
            .await;
        assert_eq!(code(&r), Some(ErrorCode::InvalidTensor), "{what}: {r:?}");
        assert_eq!(stored(), before, "{what}: refused, yet left files");
    }

    // The good bytes, of which the sender sends half and then stops.
    let signed = iota_protocol::signing::sign_request(
        &pair(seed),
        &pair(200).ss58_of(),
        "PUT",
        &path(&blake3_hex(&good)),
        &good,
        now_ms(),
        uuid::Uuid::new_v4(),
    );
    let half = bytes::Bytes::copy_from_slice(&good[..good.len() / 2]);
    let body = futures::stream::iter([Ok(half), Err(std::io::Error::other("the sender stopped"))]);
    let mut put = reqwest::Client::new()
        .put(format!("{}{}", s.base, path(&blake3_hex(&good))))
        .header("content-length", good.len())
        .body(reqwest::Body::wrap_stream(body));
    for (name, value) in signed.headers {
        put = put.header(name, value);
    }
    assert!(put.send().await.is_err(), "half a body was answered");
    eventually(
        "the cut-off upload's part removed",
        std::time::Duration::from_secs(10),
        || async { (stored() == before).then_some(()) },
    )
    .await;

    let r = raw
        .signed(
            &pair(seed),
            reqwest::Method::PUT,
            &path(&blake3_hex(&good)),
            good.clone(),
        )
        .await;
    assert_eq!(r.0, 200, "{r:?}");
    let added: Vec<_> = stored()
        .into_iter()
        .filter(|f| !before.contains(f))
        .collect();
    assert_eq!(added.len(), 1, "{added:?}");
    assert_eq!(std::fs::read(&added[0]).expect("stored"), good);
}

/// A miner's throughput counts up to four times the run's median when stages are chosen: one
/// claiming a billion tokens a second made its stage look served for good, and every newcomer
/// went to the other stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miner_claiming_a_huge_throughput_does_not_keep_newcomers_away_from_its_stage() {
    init_tracing();
    let seeds = [191u8, 192, 193, 194, 195, 196];
    let mut run = config();
    run.stages = 2;
    run.stage_params = vec![4000, 4000];
    let s = serve(&seeds, run).await;
    let liar = SimMiner::join(&s.base, signer(seeds[0]), 1e9, 1)
        .await
        .expect("join");
    let mut stages = vec![liar.stage];
    for seed in &seeds[1..] {
        let m = SimMiner::join(&s.base, signer(*seed), 1000.0, u64::from(*seed))
            .await
            .expect("join");
        stages.push(m.stage);
    }
    // Counted as 4,000 (four times the median): after four honest miners on the other stage the
    // two stages weigh the same, and the next goes to the liar's, which has fewer miners.
    assert_eq!(
        stages.iter().filter(|s| **s == stages[0]).count(),
        2,
        "stages in order of joining: {stages:?}"
    );
}

/// A stage whose last miner left takes one from the fullest stage: the driver releases that
/// stage's slowest miner, and it is given the empty stage when it joins again. A miner kept its
/// stage when it joined again and only new hotkeys chose one, so the stage stayed empty for good
/// and the run trained nothing (no sample passes a stage with no miner).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_stage_takes_a_miner_from_the_fullest() {
    init_tracing();
    let seeds = [197u8, 198, 199, 200];
    let mut run = config();
    run.stages = 2;
    run.stage_params = vec![4000, 4000];
    let s = serve(&seeds, run).await;
    let mut miners = Vec::new();
    for (i, seed) in seeds.iter().enumerate() {
        let tps = if i == 0 { 1000.0 } else { 100.0 + i as f64 };
        miners.push(
            SimMiner::join(&s.base, signer(*seed), tps, u64::from(*seed))
                .await
                .expect("join"),
        );
    }
    let stages: Vec<u32> = miners.iter().map(|m| m.stage).collect();
    assert_eq!(stages, vec![0, 1, 1, 1], "the setup");
    // The only miner of stage 0 leaves (silent, and released for it).
    sqlx::query(
        "UPDATE miners SET status = 'released', last_seen = now() - interval '1 hour'
         WHERE hotkey = $1",
    )
    .bind(pair(seeds[0]).ss58_of())
    .execute(&s.db)
    .await
    .expect("release");
    driver::step(&s.app, Utc::now()).await.expect("step");
    // One at a time: until it joins again, no other is released.
    driver::step(&s.app, Utc::now()).await.expect("step");
    let released: Vec<String> =
        sqlx::query_scalar("SELECT hotkey FROM miners WHERE status = 'released' ORDER BY hotkey")
            .fetch_all(&s.db)
            .await
            .expect("released");
    let slowest = pair(seeds[1]).ss58_of();
    assert!(released.contains(&slowest), "{released:?}");
    assert_eq!(released.len(), 2, "{released:?}");
    // It joins again and takes stage 0; stage 1 keeps two.
    let again = miners[1]
        .client()
        .rejoin(Capacity {
            device: "cpu".into(),
            memory_bytes: 1 << 30,
            tokens_per_s: 101.0,
        })
        .await
        .expect("join again");
    assert_eq!(again.stage, 0);
    // The first miner comes back: no stage is empty, it keeps its own.
    let back = miners[0]
        .client()
        .rejoin(Capacity {
            device: "cpu".into(),
            memory_bytes: 1 << 30,
            tokens_per_s: 1000.0,
        })
        .await
        .expect("back");
    assert_eq!(back.stage, 0);
    driver::step(&s.app, Utc::now()).await.expect("step");
    let active: i64 = sqlx::query_scalar("SELECT count(*) FROM miners WHERE status = 'active'")
        .fetch_one(&s.db)
        .await
        .expect("active");
    assert_eq!(active, 4, "a miner released with no stage empty");
}

/// The miner of stage 0 among `miners` (its index and client), a sample it leased, and the
/// output it uploaded for the sample's first hop (not completed).
async fn a_first_hop_output(
    run: &RunConfig,
    miners: &[SimMiner],
) -> (usize, iota_protocol::ApiClient, WorkItem, BlobDescriptor) {
    let first = miners
        .iter()
        .position(|m| m.stage == 0)
        .expect("a miner of stage 0");
    let client = miners[first].client().clone();
    let item = client
        .work(1)
        .await
        .expect("poll")
        .items
        .pop()
        .expect("a sample");
    let shape = run.boundary_shape();
    let n = (shape[0] * shape[1] * shape[2]) as usize;
    let bytes = iota_protocol::tensor::encode_boundary_f32(shape, &vec![0.5; n]);
    let blob = client
        .upload_output(item.task_id, item.lease, bytes::Bytes::from(bytes))
        .await
        .expect("upload")
        .blob;
    (first, client, item, blob)
}

/// The end of an epoch abandons the samples still travelling, and takes their open hops before
/// their samples and the epoch's row: the order a completion takes them in (its hop, its
/// sample, then the epoch's counters). It took a sample and the epoch's row before the next
/// sample's hops, so a completion of a hop of that next sample and the epoch's end deadlocked:
/// PostgreSQL aborted one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ending_an_epoch_and_completing_a_travelling_hop_do_not_deadlock() {
    init_tracing();
    let seeds = [231u8, 232, 233];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let miners = join_all(&s, &seeds).await;
    let first = miners
        .iter()
        .position(|m| m.stage == 0)
        .expect("a miner of stage 0");
    let items = miners[first].client().work(4).await.expect("poll").items;
    assert!(items.len() >= 2, "two samples travel: {items:?}");
    // The completion's hop: of the sample the epoch's end reaches last.
    let last = items.iter().max_by_key(|i| i.sample_id).expect("an item");
    let (task, sample) = (last.task_id, last.sample_id);
    let mut steps = 0;
    loop {
        let (epoch, phase, deadline, _) = now_status(&s).await;
        assert_eq!(epoch, 0, "the epoch ended without a step reaching the hops");
        steps += 1;
        assert!(steps < 20, "no step ended the epoch");
        // A completion's order: the hop, then its sample, and (below) the epoch's row.
        let mut completing = s.db.begin().await.expect("tx");
        sqlx::query("SELECT id FROM tasks WHERE id = $1 FOR UPDATE")
            .bind(task)
            .execute(&mut *completing)
            .await
            .expect("the hop");
        sqlx::query("SELECT id FROM samples WHERE id = $1 FOR UPDATE")
            .bind(sample)
            .execute(&mut *completing)
            .await
            .expect("the sample");
        let step = tokio::spawn({
            let app = s.app.clone();
            async move { driver::step(&app, deadline + Duration::seconds(1)).await }
        });
        // A step that moves the phase without touching the hops ends on its own.
        let waits = loop {
            if step.is_finished() {
                break false;
            }
            if lock_waits(&s.db, false).await > 0 {
                break true;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        };
        if !waits {
            completing.rollback().await.expect("rollback");
            step.await.expect("join").expect("step");
            continue;
        }
        assert_eq!(
            phase,
            Phase::Merging,
            "a step before the epoch's end waited"
        );
        let counters =
            sqlx::query("UPDATE epochs SET samples_abandoned = samples_abandoned WHERE epoch = 0")
                .execute(&mut *completing)
                .await;
        assert!(counters.is_ok(), "the completion's side: {counters:?}");
        completing.commit().await.expect("commit");
        let stepped = step.await.expect("join");
        assert!(
            stepped.is_ok(),
            "the epoch's end: {:?}",
            stepped.err().map(|e| e.detail())
        );
        break;
    }
    assert_eq!(now_status(&s).await.0, 1, "the epoch ended");
    let travelling: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM samples WHERE epoch = 0 AND status IN ('forward', 'backward')",
    )
    .fetch_one(&s.db)
    .await
    .expect("samples");
    assert_eq!(travelling, 0, "every travelling sample was abandoned");
}

/// A confirmed bad-object report abandons the sample, and takes the sample's open hops before
/// the sample: the order a completion of one of those hops takes them in. It took the sample
/// and the epoch's row first, and a completion holding the consumer's hop then deadlocked with
/// it over the sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_object_report_and_completing_the_samples_hop_do_not_deadlock() {
    init_tracing();
    let seeds = [236u8, 237, 238];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let miners = join_all(&s, &seeds).await;
    let (_, client, item, blob) = a_first_hop_output(&run, &miners).await;
    let done = client
        .complete(
            item.task_id,
            &completion(item.lease, Some(blob.clone()), None),
        )
        .await
        .expect("complete");
    let consumer_hop = done.next_task_id.expect("a hop at stage 1");
    let reporter = miners
        .iter()
        .position(|m| m.stage == 1)
        .expect("a miner of stage 1");
    // The object goes bad in the store.
    corrupt_stored(&s._store.path().join(&blob.key));

    // A completion's order: its hop, then (once the report waits) its sample.
    let mut completing = s.db.begin().await.expect("tx");
    sqlx::query("SELECT id FROM tasks WHERE id = $1 FOR UPDATE")
        .bind(consumer_hop)
        .execute(&mut *completing)
        .await
        .expect("the hop");
    // Sent once (the client would retry a 500, and its retry would hide an aborted attempt).
    let body = serde_json::to_vec(&BadObjectReport {
        key: blob.key.clone(),
        reason: "corrupt".into(),
    })
    .expect("json");
    let report = tokio::spawn({
        let raw = Raw::to(&s.base);
        let reporter = pair(seeds[reporter]);
        async move {
            raw.send_bytes(Call::new(
                &reporter,
                reqwest::Method::POST,
                "/v1/miner/reports/bad-object",
                body,
            ))
            .await
        }
    });
    until_waiting_for_locks(&s.db, 1, false).await;
    let sample = sqlx::query("SELECT id FROM samples WHERE id = $1 FOR UPDATE")
        .bind(item.sample_id)
        .execute(&mut *completing)
        .await;
    assert!(sample.is_ok(), "the completion's side: {sample:?}");
    completing.commit().await.expect("commit");
    let (status, answer) = report.await.expect("join");
    let answer = String::from_utf8_lossy(&answer);
    assert_eq!(status, 200, "the report's side: {answer}");
    let verdict: BadObjectVerdict = serde_json::from_str(&answer).expect("verdict");
    assert!(verdict.confirmed, "{verdict:?}");
    let status: String = sqlx::query_scalar("SELECT status FROM samples WHERE id = $1")
        .bind(item.sample_id)
        .fetch_one(&s.db)
        .await
        .expect("sample");
    assert_eq!(status, "abandoned");
}

/// A validator reads the stage each miner worked in during an epoch, not the stage it is in
/// now: a miner moved to a stage left empty was replayed on its new stage, against the wrong
/// weights and shapes, and penalised for honest work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validator_reads_the_stage_a_miner_worked_in() {
    init_tracing();
    let seeds = [241u8, 242, 243, FIRST_VALIDATOR + 6];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = join_all(&s, &seeds[..3]).await;
    let worked = step_until_workers(&s, &mut miners, run.stages, |w| !w.is_empty()).await;
    let hotkey = worked.first().expect("a miner with gradient work").clone();
    let stage: i32 = sqlx::query_scalar("SELECT stage FROM miners WHERE hotkey = $1")
        .bind(&hotkey)
        .fetch_one(&s.db)
        .await
        .expect("its stage");
    // It moves on, as a miner released to fill an empty stage does.
    sqlx::query("UPDATE miners SET stage = $2 WHERE hotkey = $1")
        .bind(&hotkey)
        .bind((stage + 1) % run.stages as i32)
        .execute(&s.db)
        .await
        .expect("moved");
    let validator = iota_protocol::ApiClient::connect(
        &s.base,
        signer(FIRST_VALIDATOR + 6),
        iota_protocol::RetryPolicy::default(),
    )
    .await
    .expect("validator");
    let record = validator.epoch_record(0).await.expect("epoch record");
    let work = record
        .miners
        .iter()
        .find(|m| m.hotkey == hotkey)
        .expect("its work");
    assert_eq!(work.stage, stage as u32, "{work:?}");
    let tasks = validator.spot_checks(0).await.expect("spot checks");
    let candidate = tasks
        .miners
        .iter()
        .find(|m| m.hotkey == hotkey)
        .expect("a candidate");
    assert_eq!(candidate.stage, stage as u32, "{candidate:?}");
}

/// An owner added to a partition is drawn at random among the miners that rank the same (same
/// stage preference, as few assignments): by hotkey, a miner could know it would be the tie-break
/// owner of a dispute, and choose a hotkey to be.
/// The owners of a partition of epoch 0, as `tx` sees them.
async fn owners_of(tx: &mut sqlx::PgConnection, stage: u32, partition: u32) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT miner FROM partition_owners WHERE epoch = 0 AND stage = $1 AND partition = $2",
    )
    .bind(stage as i32)
    .bind(partition as i32)
    .fetch_all(tx)
    .await
    .expect("owners")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_owner_is_drawn_at_random_among_equals() {
    init_tracing();
    let seeds = [221u8, 222, 223, 224, 225, FIRST_VALIDATOR + 5];
    let t = PermitHolderOwner::new(&seeds).await;
    let mut picks = std::collections::HashSet::new();
    for _ in 0..24 {
        let mut tx = t.s.db.begin().await.expect("tx");
        // Every other partition's owners gone (rolled back below): the miners that do not own
        // this one rank the same, whatever the draw gave them.
        sqlx::query(
            "DELETE FROM partition_owners WHERE epoch = 0 AND (stage, partition) <> ($1, $2)",
        )
        .bind(t.stage as i32)
        .bind(t.partition as i32)
        .execute(&mut *tx)
        .await
        .expect("other owners");
        let before = owners_of(&mut tx, t.stage, t.partition).await;
        assert!(
            driver::add_owners(&mut tx, &t.s.app, 0, &[(t.stage, t.partition)], 0)
                .await
                .expect("add")
                == 1,
            "no miner to add"
        );
        let after = owners_of(&mut tx, t.stage, t.partition).await;
        picks.extend(after.into_iter().filter(|m| !before.contains(m)));
        tx.rollback().await.expect("rollback");
    }
    assert!(picks.len() > 1, "always the same owner: {picks:?}");
}

/// Releasing a silent miner takes its open hops before its row, the order a completion takes
/// them in (the hop, then the miner's row), so a completion of that miner's hop and the release
/// wait for each other. The release took the row first, and the two deadlocked: PostgreSQL
/// aborted one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_miner_and_completing_its_hop_do_not_deadlock() {
    init_tracing();
    let seeds = [226u8, 227, 228];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let miners = join_all(&s, &seeds).await;
    let (first, _, item, _) = a_first_hop_output(&run, &miners).await;
    let hotkey = pair(seeds[first]).ss58_of();
    sqlx::query("UPDATE miners SET last_seen = now() - interval '1 hour' WHERE hotkey = $1")
        .bind(&hotkey)
        .execute(&s.db)
        .await
        .expect("silent");
    // A completion's order: the hop, then (after the driver has started) the miner's row.
    let mut completing = s.db.begin().await.expect("tx");
    sqlx::query("SELECT id FROM tasks WHERE id = $1 FOR UPDATE")
        .bind(item.task_id)
        .execute(&mut *completing)
        .await
        .expect("the hop");
    let step = tokio::spawn({
        let app = s.app.clone();
        async move { driver::step(&app, Utc::now()).await }
    });
    // The release waits for the hop held here (with the old order, holding the miner's row).
    until_waiting_for_locks(&s.db, 1, false).await;
    let row = sqlx::query("SELECT ended_epoch FROM miners WHERE hotkey = $1 FOR SHARE")
        .bind(&hotkey)
        .execute(&mut *completing)
        .await;
    assert!(row.is_ok(), "the completion's side: {row:?}");
    completing.commit().await.expect("commit");
    let stepped = step.await.expect("join");
    assert!(
        stepped.is_ok(),
        "the driver's side: {:?}",
        stepped.err().map(|e| e.detail())
    );
    let status: String = sqlx::query_scalar("SELECT status FROM miners WHERE hotkey = $1")
        .bind(&hotkey)
        .fetch_one(&s.db)
        .await
        .expect("status");
    assert_eq!(status, "released");
}

/// Routing and the explorer go by the throughput the orchestrator measured from a miner's
/// completed hops, not the one it claimed: a miner claiming a billion tokens a second is measured
/// at what it does, and so is its stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_is_measured_from_completed_hops_not_claimed() {
    init_tracing();
    let seeds = [246u8, 247, 248, 249];
    let run = config();
    let s = serve(&seeds, run.clone()).await;
    let mut miners = vec![
        SimMiner::join(&s.base, signer(seeds[0]), 1e9, 1)
            .await
            .expect("join"),
    ];
    for seed in &seeds[1..] {
        miners.push(
            SimMiner::join(&s.base, signer(*seed), 100.0, u64::from(*seed))
                .await
                .expect("join"),
        );
    }
    let liar = miners[0].client().hotkey();
    let worked = step_until_workers(&s, &mut miners, run.stages, |w| w.contains(&liar)).await;
    assert!(worked.contains(&liar), "the claimer did no gradient work");
    let infos: Vec<MinerInfo> = reqwest::get(format!("{}/v1/miners", s.base))
        .await
        .expect("miners")
        .json()
        .await
        .expect("json");
    let me = infos.iter().find(|m| m.hotkey == liar).expect("listed");
    assert_eq!(
        me.capacity.tokens_per_s, 1e9,
        "the claim is shown as claimed"
    );
    let measured = me
        .measured_tokens_per_s
        .expect("a throughput measured from its hops");
    // A sample's tokens over at least a millisecond each.
    let ceiling = f64::from(run.micro_batch * run.seq_len) / 1e-3;
    assert!(measured > 0.0 && measured <= ceiling, "{me:?}");
    let stages: Vec<StageInfo> = reqwest::get(format!("{}/v1/stages", s.base))
        .await
        .expect("stages")
        .json()
        .await
        .expect("json");
    let its = stages
        .iter()
        .find(|x| x.stage == miners[0].stage)
        .expect("its stage");
    assert!(
        its.tokens_per_s < 1e6,
        "its stage still counts the claim: {its:?}"
    );
}

/// A miner's client on a presigning store uploads straight to the bucket (presign, PUT, commit),
/// and the orchestrator checks the object at the commit: bytes PUT to a presigned URL that are
/// not the ones presigned are refused there and nothing of them is kept; the right bytes, sent
/// by the client's own upload, are accepted and sealed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_direct_upload_is_refused_at_its_commit() {
    init_tracing();
    let seeds = [181u8, 182, 183];
    let s = serve_with(&seeds, config(), Some(s3_store())).await;
    let bucket = BlobStore::open(&s3_store()).expect("store");
    let mut miners = join_all(&s, &seeds).await;
    let i = uploading_with_a_worker(&s, &mut miners, &seeds).await;
    let client = miners[i].client().clone();
    assert!(client.direct_uploads(), "the run's store presigns");
    let hotkey = pair(seeds[i]).ss58_of();
    let (bytes, commit) = pg_commit(&s, miners[i].stage, &hotkey, 0, 0.004);

    let target = presign_pg0(&client, &commit, false).await;
    assert_eq!(target.key, commit.key);
    // Another value in the last float: same size, finite, not the bytes presigned.
    let mut tampered = bytes.clone();
    let last = tampered.len() - 1;
    tampered[last] ^= 0x01;
    let put = reqwest::Client::new()
        .put(&target.url)
        .body(tampered)
        .send()
        .await
        .expect("PUT to the bucket");
    assert!(put.status().is_success(), "{}", put.status());
    let refused = client
        .signed_json::<_, UploadResponse>(reqwest::Method::POST, PG0_COMMIT, &commit)
        .await
        .expect_err("a tampered object");
    assert_eq!(refused.code(), Some(ErrorCode::InvalidTensor), "{refused}");
    let left = kept_of(&bucket, &commit, &hotkey).await;
    assert!(left.is_empty(), "kept after the refusal: {left:?}");

    let blob = client
        .upload_pseudo_gradient(0, 0, bytes.into())
        .await
        .expect("the client's direct upload")
        .blob;
    assert_eq!(blob.blake3, commit.blake3);
    assert_eq!(blob.key, sealed_of(&commit));
    bucket.get(&blob.key).await.expect("sealed in the bucket");
}

/// An object larger than the store's part size goes up in parts. A part whose connection drops
/// is sent again alone (the parts already in the store stay), and the commit completes the
/// upload and checks the object; an object with a tampered part is refused at its commit and
/// nothing of it is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_in_parts_resumes_at_its_dropped_part_and_a_tampered_one_is_refused() {
    init_tracing();
    let seeds = [190u8, 191, 192];
    let mut s3 = s3_store();
    if let StoreConfig::S3 { part_bytes, .. } = &mut s3 {
        *part_bytes = 5 << 20;
    }
    let relay = slow_store(&s3).await;
    let mut run = config();
    // Partitions of 3M values (12 MB): three parts of 5 MiB.
    run.stage_params = vec![12_000_000; 3];
    let s = serve_with(&seeds, run, Some(relay.store.clone())).await;
    let bucket = BlobStore::open(&s3).expect("store");
    let mut miners = join_all(&s, &seeds).await;
    let i = uploading_with_a_worker(&s, &mut miners, &seeds).await;
    let client = miners[i].client().clone();
    let hotkey = pair(seeds[i]).ss58_of();
    let (bytes, commit) = pg_commit(&s, miners[i].stage, &hotkey, 0, 0.006);

    let target = presign_pg0(&client, &commit, true).await;
    let parts = target.multipart.clone().expect("an upload in parts");
    assert_eq!(parts.part_urls.len(), 3, "{parts:?}");
    let piece = parts.part_bytes as usize;
    // The last part's last byte changed: the same size, finite, not the bytes presigned.
    let mut tampered = bytes.clone();
    let end = tampered.len();
    tampered[end - 1] ^= 0x01;
    let http = reqwest::Client::new();
    let mut etags = Vec::new();
    for (k, url) in parts.part_urls.iter().enumerate() {
        let part = tampered[k * piece..((k + 1) * piece).min(end)].to_vec();
        let put = http.put(url).body(part).send().await.expect("PUT a part");
        assert!(put.status().is_success(), "{}", put.status());
        let etag = put.headers().get("etag").expect("an ETag");
        etags.push(etag.to_str().expect("text").to_owned());
    }
    let mut tampered_commit = commit.clone();
    tampered_commit.multipart = Some(MultipartCommit {
        upload_id: parts.upload_id,
        etags,
    });
    let refused = client
        .signed_json::<_, UploadResponse>(reqwest::Method::POST, PG0_COMMIT, &tampered_commit)
        .await
        .expect_err("a tampered part");
    assert_eq!(refused.code(), Some(ErrorCode::InvalidTensor), "{refused}");
    let kept = || kept_of(&bucket, &commit, &hotkey);
    assert!(kept().await.is_empty(), "kept after the refusal");

    // The client's own upload in parts, the second part's connection dropped once.
    let before = relay.requests.lock().expect("log").len();
    *relay.marker.lock().expect("marker") = Some(("PUT", "partNumber=2".into()));
    relay.drop.store(true, std::sync::atomic::Ordering::SeqCst);
    let blob = client
        .upload_pseudo_gradient(0, 0, bytes.into())
        .await
        .expect("the upload resumed")
        .blob;
    assert!(relay.tripped.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(blob.blake3, commit.blake3);
    assert_eq!(blob.key, sealed_of(&commit));
    assert_eq!(kept().await, std::slice::from_ref(&blob.key));
    let sent: Vec<usize> = (1..=3)
        .map(|n| {
            relay.requests.lock().expect("log")[before..]
                .iter()
                .filter(|l| {
                    l.starts_with("PUT ")
                        && l.split(['?', '&', ' '])
                            .any(|kv| kv == format!("partNumber={n}"))
                })
                .count()
        })
        .collect();
    assert_eq!(
        sent,
        [1, 2, 1],
        "each part sent once, the dropped one twice"
    );
}

/// A direct upload whose connection to the store drops part-way through is sent again by the
/// client, and the commit takes the object the second PUT left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_upload_whose_connection_drops_is_sent_again() {
    init_tracing();
    let seeds = [184u8, 185, 186];
    let s3 = s3_store();
    let relay = slow_store(&s3).await;
    let s = serve_with(&seeds, config(), Some(relay.store.clone())).await;
    let mut miners = join_all(&s, &seeds).await;
    let i = uploading_with_a_worker(&s, &mut miners, &seeds).await;
    let client = miners[i].client().clone();
    assert!(client.direct_uploads());
    let hotkey = pair(seeds[i]).ss58_of();
    let (bytes, commit) = pg_commit(&s, miners[i].stage, &hotkey, 0, 0.005);
    // The presigned PUT is the first request naming the miner's slot.
    *relay.marker.lock().expect("marker") = Some(("PUT", hotkey.clone()));
    relay.drop.store(true, std::sync::atomic::Ordering::SeqCst);
    let blob = client
        .upload_pseudo_gradient(0, 0, bytes.into())
        .await
        .expect("sent again after the drop")
        .blob;
    assert!(
        relay.tripped.load(std::sync::atomic::Ordering::SeqCst),
        "the relay never saw the PUT"
    );
    assert_eq!(blob.blake3, commit.blake3);
    assert_eq!(blob.key, sealed_of(&commit));
}
