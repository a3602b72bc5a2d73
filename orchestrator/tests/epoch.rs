//! Scripted epochs with simulated miners (random tensors of the right shapes, no model): every
//! phase runs, vanished miners' work is re-routed and their partitions reassigned, and two
//! orchestrators on one database serve one run; replicas built for two schemas never do.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::future::join_all;
use iota_orchestrator::OrchestratorError;
use iota_orchestrator::replicas;
use iota_protocol::api::*;
use iota_protocol::{ApiClient, RetryPolicy};
use iota_testkit::sim::SimMiner;
use sqlx::{Connection, PgPool};

async fn validator_client(base: &str, seed: u8) -> ApiClient {
    ApiClient::connect(base, signer(seed), RetryPolicy::default())
        .await
        .expect("validator client")
}

async fn join(base: &str, seeds: &[u8]) -> Vec<SimMiner> {
    let mut out = Vec::new();
    for (i, s) in seeds.iter().enumerate() {
        out.push(
            SimMiner::join(base, signer(*s), 100.0 + i as f64, u64::from(*s))
                .await
                .expect("join"),
        );
    }
    out
}

async fn step_all(miners: &mut [SimMiner]) {
    let results = join_all(miners.iter_mut().map(|m| m.step())).await;
    for r in results {
        r.expect("miner step");
    }
}

/// Until the orchestrator at `base` says it leads its run.
async fn until_leads(base: &str, timeout: Duration) {
    eventually(&format!("{base} leads its run"), timeout, || async move {
        let h: Health = reqwest::get(format!("{base}/healthz"))
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        h.leader.then_some(())
    })
    .await;
}

async fn status(base: &str) -> EpochStatus {
    reqwest::get(format!("{base}/v1/status"))
        .await
        .expect("status")
        .json()
        .await
        .expect("json")
}

/// Consistency of the run state, checked by queries: no sample counted twice, every finished
/// sample has exactly one done hop per stage and direction, counters match rows.
async fn check_consistency(db: &PgPool) {
    let double: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT sample_id, stage, direction FROM tasks WHERE status = 'done'
           GROUP BY sample_id, stage, direction HAVING count(*) > 1) d",
    )
    .fetch_one(db)
    .await
    .expect("query");
    assert_eq!(double, 0, "a hop was completed twice");
    // Each epoch's counters against the samples table.
    for (counter, mismatches) in [
        (
            "samples_completed",
            "SELECT count(*) FROM epochs e WHERE e.samples_completed <>
               (SELECT count(*) FROM samples s WHERE s.run_id = e.run_id AND s.epoch = e.epoch
                  AND s.status = 'done')",
        ),
        (
            "samples_abandoned",
            "SELECT count(*) FROM epochs e WHERE e.samples_abandoned <>
               (SELECT count(*) FROM samples s WHERE s.run_id = e.run_id AND s.epoch = e.epoch
                  AND s.status = 'abandoned')",
        ),
    ] {
        let mismatched: i64 = sqlx::query_scalar(mismatches)
            .fetch_one(db)
            .await
            .expect("query");
        assert_eq!(mismatched, 0, "{counter} disagrees with the samples table");
    }
    let stages: i64 = sqlx::query_scalar("SELECT (config->>'stages')::bigint FROM runs LIMIT 1")
        .fetch_one(db)
        .await
        .expect("stages");
    let incomplete: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM samples s WHERE s.status = 'done' AND
           (SELECT count(*) FROM tasks t WHERE t.sample_id = s.id AND t.status = 'done') <> 2 * $1 - 1",
    )
    .bind(stages)
    .fetch_one(db)
    .await
    .expect("query");
    assert_eq!(incomplete, 0, "a done sample lacks a hop (or has extra)");
    let lossless: i64 =
        sqlx::query_scalar("SELECT count(*) FROM samples WHERE status = 'done' AND loss IS NULL")
            .fetch_one(db)
            .await
            .expect("query");
    assert_eq!(lossless, 0, "a done sample has no loss");
    let open_tasks_of_closed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tasks t JOIN samples s ON s.id = t.sample_id
         WHERE s.status IN ('done', 'abandoned') AND t.status IN ('pending', 'leased')",
    )
    .fetch_one(db)
    .await
    .expect("query");
    assert_eq!(
        open_tasks_of_closed, 0,
        "a closed sample still has open hops"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_completes_with_a_vanished_miner() {
    init_tracing();
    let seeds = [1u8, 2, 3, 4, 5, 6];
    let late_joiner = 7u8;
    let chain = chain_with(&[1, 2, 3, 4, 5, 6, late_joiner], &[10]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("vanish");
    run.training_s = 60;
    run.uploading_s = 15;
    run.merging_s = 6;
    run.merge_round_s = 4;
    run.lease_s = 2;
    // Long enough that a surviving miner's heartbeat is not late on a loaded CI machine (at 2 s
    // one was released mid-run), short enough that the vanished miner is released before the
    // epoch's samples are done.
    run.heartbeat_timeout_s = 5;
    let orch = start(config(&chain, &db_url, store.path(), run.clone())).await;
    let db = PgPool::connect(&db_url).await.expect("db");

    let mut miners = join(&orch.base, &seeds).await;
    let mut stages: Vec<u32> = miners.iter().map(|m| m.stage).collect();
    stages.sort_unstable();
    assert_eq!(stages, vec![0, 0, 1, 1, 2, 2], "joins balance the stages");

    // Work until samples flow, then one stage-1 miner leases work and vanishes with it.
    let vanisher_index = miners
        .iter()
        .position(|m| m.stage == 1)
        .expect("a stage-1 miner");
    let vanisher = miners.remove(vanisher_index);
    let vanisher_key = vanisher.client().hotkey();
    let mut leased = 0;
    for _ in 0..200 {
        step_all(&mut miners).await;
        leased += vanisher.client().work(4).await.expect("poll").items.len();
        if leased > 0 {
            break;
        }
    }
    assert!(leased > 0, "the vanishing miner never got work");
    drop(vanisher);

    // The rest carry on until epoch 1 begins.
    let mut rounds = 0;
    while status(&orch.base).await.epoch == 0 {
        step_all(&mut miners).await;
        rounds += 1;
        assert!(rounds < 3000, "epoch 0 did not complete");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The vanished miner was released and its leased hops re-routed to its stage peer.
    let released: String = sqlx::query_scalar("SELECT status FROM miners WHERE hotkey = $1")
        .bind(&vanisher_key)
        .fetch_one(&db)
        .await
        .expect("miner row");
    assert_eq!(released, "released");
    let rerouted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tasks old JOIN tasks new ON new.sample_id = old.sample_id
           AND new.stage = old.stage AND new.direction = 'forward' AND new.attempt = old.attempt + 1
         WHERE old.miner = $1 AND old.status = 'expired' AND old.direction = 'forward'
           AND new.miner <> $1",
    )
    .bind(&vanisher_key)
    .fetch_one(&db)
    .await
    .expect("query");
    assert!(
        rerouted >= 1,
        "no lapsed hop of the vanished miner was re-routed"
    );

    // A late result on the lapsed lease is refused cleanly. (Hops routed to the miner but never
    // leased expire too when it is released, with no lease to answer with: not those.)
    let late: (i64, uuid::Uuid) = sqlx::query_as(
        "SELECT id, lease FROM tasks
         WHERE miner = $1 AND status = 'expired' AND lease IS NOT NULL LIMIT 1",
    )
    .bind(&vanisher_key)
    .fetch_one(&db)
    .await
    .expect("lapsed task");
    let ghost = ApiClient::connect(
        &orch.base,
        signer(seeds[vanisher_index]),
        RetryPolicy::default(),
    )
    .await
    .expect("client");
    let refused = ghost
        .complete(
            late.0,
            &CompleteRequest {
                lease: late.1,
                output: None,
                inner_step: 0,
                weights_digest: String::new(),
                loss: None,
                sequence_losses: None,
                compute_ms: None,
            },
        )
        .await
        .expect_err("late completion");
    assert_eq!(refused.code(), Some(iota_protocol::ErrorCode::LeaseExpired));

    // Every partition of every stage was merged; the vanished miner owns no accepted result.
    let merges = ghost.merge_status(0).await.expect("merge status");
    assert_eq!(merges.len(), (run.stages * run.partitions) as usize);
    for p in &merges {
        assert_eq!(p.state, PartitionState::Accepted, "{p:?}");
        assert!(p.results.iter().all(|r| r.hotkey != vanisher_key));
        let agreeing = p
            .results
            .iter()
            .filter(|r| r.blake3.as_ref() == p.accepted.as_ref().map(|b| &b.blake3))
            .count();
        assert!(
            agreeing >= 2,
            "accepted without two agreeing results: {p:?}"
        );
    }

    // The next epoch starts from those merged weights.
    let v = validator_client(&orch.base, 10).await;
    let record = v.epoch_record(1).await.expect("epoch record");
    for w in &record.start_weights {
        assert_eq!(w.epoch, Some(0));
        assert!(w.partitions.iter().all(Option::is_some));
    }
    let record0 = v.epoch_record(0).await.expect("epoch 0");
    assert!(
        record0
            .miners
            .iter()
            .any(|m| m.hotkey == vanisher_key && m.failed >= 1)
    );
    let samples = v.samples(0, 0, 1000).await.expect("samples");
    assert!(
        samples
            .samples
            .iter()
            .any(|s| s.status == "done" && s.pathway.len() == 3 && s.loss.is_some())
    );
    let hops = v.hops(0, 0, 1000).await.expect("hops");
    assert!(
        hops.hops
            .iter()
            .all(|h| h.status != "done" || h.inner_step.is_some())
    );
    check_consistency(&db).await;

    // Each phase change of the epoch was timed.
    let metrics = metrics_text(&orch.base).await;
    for step in ["start_uploading", "start_merging", "next_epoch"] {
        let count = metrics
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "iota_phase_change_seconds_count{{step=\"{step}\"}}"
                ))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
        assert!(count.is_some_and(|n| n >= 1.0), "{step} untimed: {count:?}");
    }

    // A miner joining now goes where miners are fewest: the stage that lost one, unless a slow
    // machine let another miner's heartbeats lapse too (then the lowest of the emptiest).
    let active: Vec<(i32, i64)> =
        sqlx::query_as("SELECT stage, count(*) FROM miners WHERE status = 'active' GROUP BY stage")
            .fetch_all(&db)
            .await
            .expect("active miners");
    let fewest = active.iter().map(|(_, n)| *n).min().unwrap_or(0);
    let count_of = |stage: i32| {
        active
            .iter()
            .find(|(s, _)| *s == stage)
            .map_or(0, |(_, n)| *n)
    };
    assert_eq!(
        count_of(1),
        fewest,
        "the stage that lost a miner has the fewest: {active:?}"
    );
    let expected = (0..run.stages as i32)
        .find(|s| count_of(*s) == fewest)
        .expect("a stage");
    // It gets the merged weights of its stage, and they check out.
    let late = ApiClient::connect(&orch.base, signer(late_joiner), RetryPolicy::default())
        .await
        .expect("client");
    let joined = late
        .register(Capacity {
            device: "cpu".into(),
            memory_bytes: 1 << 30,
            tokens_per_s: 1.0,
        })
        .await
        .expect("late join");
    assert_eq!(
        joined.stage as i32, expected,
        "the newcomer goes where miners are fewest: {active:?}"
    );
    assert_eq!(joined.weights.epoch, Some(0));
    for (p, blob) in joined.weights.partitions.iter().enumerate() {
        let blob = blob.as_ref().expect("every partition merged");
        let accepted = merges
            .iter()
            .find(|m| m.stage == joined.stage && m.partition as usize == p)
            .and_then(|m| m.accepted.clone())
            .expect("accepted");
        assert_eq!(blob.blake3, accepted.blake3);
        let bytes = late.download(blob).await.expect("download merged weights");
        let range = run.partition_range(joined.stage, p as u32).expect("range");
        iota_protocol::tensor::decode_merged(&bytes, range.end - range.start)
            .expect("a merged partition");
    }
    orch.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_orchestrators_serve_one_run_and_fail_over() {
    init_tracing();
    let seeds = [21u8, 22, 23, 24, 25, 26];
    let chain = chain_with(&seeds, &[]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("replicas");
    run.samples_per_epoch = 8;
    run.uploading_s = 15;
    run.merging_s = 15;
    let a = start(config(&chain, &db_url, store.path(), run.clone())).await;
    let b = start(config(&chain, &db_url, store.path(), run.clone())).await;
    let db = PgPool::connect(&db_url).await.expect("db");

    // Half the miners talk to each replica.
    let mut miners = join(&a.base, &seeds[..3]).await;
    miners.extend(join(&b.base, &seeds[3..]).await);

    let leaders = |bases: Vec<String>| async move {
        let mut n = 0;
        for base in bases {
            let h: Health = reqwest::get(format!("{base}/healthz"))
                .await
                .expect("health")
                .json()
                .await
                .expect("json");
            n += usize::from(h.leader);
        }
        n
    };
    eventually("one leader", Duration::from_secs(10), || {
        let bases = vec![a.base.clone(), b.base.clone()];
        async move { (leaders(bases).await == 1).then_some(()) }
    })
    .await;

    let mut rounds = 0;
    while status(&a.base).await.epoch == 0 {
        step_all(&mut miners).await;
        rounds += 1;
        assert!(rounds < 3000, "epoch 0 did not complete on two replicas");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        status(&b.base).await.epoch,
        1,
        "both replicas read one state"
    );
    let merges: Vec<PartitionStatus> = reqwest::get(format!("{}/v1/epochs/0/merges", b.base))
        .await
        .expect("merges")
        .json()
        .await
        .expect("json");
    assert!(merges.iter().all(|p| p.state == PartitionState::Accepted));
    check_consistency(&db).await;

    // Stop whichever leads; the other takes over the phases and the run goes on.
    let a_leads: Health = reqwest::get(format!("{}/healthz", a.base))
        .await
        .expect("health")
        .json()
        .await
        .expect("json");
    let (survivor, stopped) = if a_leads.leader { (b, a) } else { (a, b) };
    stopped.stop().await;
    until_leads(&survivor.base, Duration::from_secs(10)).await;
    let mut miners: Vec<SimMiner> = Vec::new();
    for (i, s) in seeds.iter().enumerate() {
        miners.push(
            SimMiner::join(
                &survivor.base,
                Arc::new(pair(*s)),
                100.0 + i as f64,
                u64::from(*s),
            )
            .await
            .expect("rejoin"),
        );
    }
    let mut rounds = 0;
    while status(&survivor.base).await.epoch == 1 {
        step_all(&mut miners).await;
        rounds += 1;
        assert!(rounds < 3000, "epoch 1 did not complete after fail-over");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check_consistency(&db).await;
    survivor.stop().await;
}

/// What a newer version leaves in the migrations table: a migration this binary lacks.
async fn migrate_as_a_newer_version(db: &PgPool) -> i64 {
    let newer = replicas::schema_version() + 1;
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES ($1, 'from a newer version', true, '\\x00'::bytea, 0)",
    )
    .bind(newer)
    .execute(db)
    .await
    .expect("record a newer migration");
    newer
}

async fn replicas_recorded(db: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orchestrator_replicas")
        .fetch_one(db)
        .await
        .expect("count replicas")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stops_serving_when_a_newer_version_migrates_its_database() {
    init_tracing();
    let chain = chain_with(&[], &[]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let running = start(config(
        &chain,
        &db_url,
        store.path(),
        run_config("upgraded"),
    ))
    .await;
    let base = running.base.clone();
    let db = PgPool::connect(&db_url).await.expect("db");
    let known = replicas::schema_version();
    let row: (i64, String, String, i64) =
        sqlx::query_as("SELECT schema_version, address, host, pid FROM orchestrator_replicas")
            .fetch_one(&db)
            .await
            .expect("the replica recorded itself");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let address = base.trim_start_matches("http://").to_owned();
    let pid = i64::from(std::process::id());
    assert_eq!(row, (known, address, host.trim().to_owned(), pid));
    // Its beats, on a database of its own schema, keep it serving.
    eventually("a beat", replicas::BEAT * 3, || async {
        let beaten: bool =
            sqlx::query_scalar("SELECT last_seen > started_at FROM orchestrator_replicas")
                .fetch_one(&db)
                .await
                .ok()?;
        beaten.then_some(())
    })
    .await;
    let status = reqwest::get(format!("{base}/healthz"))
        .await
        .expect("serving");
    assert!(status.status().is_success());

    let newer = migrate_as_a_newer_version(&db).await;
    match running.exited(replicas::BEAT * 3).await {
        Err(OrchestratorError::SchemaNewer { applied, known: k }) => {
            assert_eq!((applied, k), (newer, known));
        }
        other => panic!("expected SchemaNewer, got {other:?}"),
    }
    assert!(
        reqwest::get(format!("{base}/healthz")).await.is_err(),
        "the stopped replica still answers"
    );
    assert_eq!(replicas_recorded(&db).await, 0, "its row outlived it");
    // And it does not start again on that database.
    let again = iota_orchestrator::connect_db(&db_url, 2).await;
    let message = match again {
        Err(e @ OrchestratorError::SchemaNewer { .. }) => e.to_string(),
        other => panic!("expected SchemaNewer at start, got {other:?}"),
    };
    assert!(
        message.contains(&format!(
            "at migration {newer}, newer than this orchestrator's {known}"
        )),
        "{message}"
    );
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_waits_for_replicas_built_for_an_older_schema() {
    let db_url = fresh_db().await;
    let known = replicas::schema_version();
    let connect_as = |name: String| {
        let db_url = db_url.clone();
        async move {
            let options = db_url
                .parse::<sqlx::postgres::PgConnectOptions>()
                .expect("url")
                .application_name(&name);
            sqlx::PgConnection::connect_with(&options)
                .await
                .expect("connect")
        }
    };
    let older_name = format!("iota-orchestrator 0.0.9 schema {}", known - 1);
    // Connections are looked at before the first migration too.
    let early = connect_as(older_name.clone()).await;
    match iota_orchestrator::connect_db(&db_url, 2).await {
        Err(OrchestratorError::OlderReplicas { .. }) => {}
        other => panic!("expected OlderReplicas before the first migration, got {other:?}"),
    }
    early.close().await.expect("close");
    let pool = iota_orchestrator::connect_db(&db_url, 2)
        .await
        .expect("first start");
    let record = |host: &'static str, schema: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO orchestrator_replicas (id, host, address, pid, version, schema_version)
                 VALUES ($1, $2, '10.0.0.7:8700', 4242, '0.0.9', $3)",
            )
            .bind(uuid::Uuid::new_v4())
            .bind(host)
            .bind(schema)
            .execute(&pool)
            .await
            .expect("record a replica");
        }
    };
    // A replica of this schema is no obstacle; one built for an older schema is.
    record("same-box", known).await;
    iota_orchestrator::connect_db(&db_url, 2)
        .await
        .expect("beside a replica of this schema");
    record("old-box", known - 1).await;
    let message = match iota_orchestrator::connect_db(&db_url, 2).await {
        Err(e @ OrchestratorError::OlderReplicas { .. }) => e.to_string(),
        other => panic!("expected OlderReplicas, got {other:?}"),
    };
    for part in [
        "old-box 10.0.0.7:8700 pid 4242, iota 0.0.9",
        &format!("schema {}", known - 1),
        "stop every one before starting this version",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    assert!(!message.contains("same-box"), "{message}");
    // Once it has not been seen for the live window, it is taken as stopped.
    sqlx::query(
        "UPDATE orchestrator_replicas SET last_seen = now() - make_interval(secs => $1)
         WHERE host = 'old-box'",
    )
    .bind(replicas::LIVE_WITHIN.as_secs_f64() + 1.0)
    .execute(&pool)
    .await
    .expect("age the old replica");
    iota_orchestrator::connect_db(&db_url, 2)
        .await
        .expect("after the old replica stopped");

    // Every connection of a start carries its version and schema, as a later version reads them.
    assert_eq!(
        replicas::application_name(),
        format!(
            "iota-orchestrator {} schema {known}",
            env!("CARGO_PKG_VERSION")
        )
    );
    let named: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND datname = current_database()",
    )
    .bind(replicas::application_name())
    .fetch_one(&pool)
    .await
    .expect("count named connections");
    assert!(named >= 1, "the pool's connections are named");
    // A replica that stalled past the live window still holds its connections: one of the same
    // schema is no obstacle, one built for an older schema is, until it closes.
    let same = connect_as(format!("iota-orchestrator 9.9.9 schema {known}")).await;
    iota_orchestrator::connect_db(&db_url, 2)
        .await
        .expect("beside a connection of this schema");
    let mut stalled = connect_as(older_name).await;
    let stalled_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut stalled)
        .await
        .expect("pid");
    let message = match iota_orchestrator::connect_db(&db_url, 2).await {
        Err(e @ OrchestratorError::OlderReplicas { .. }) => e.to_string(),
        other => panic!("expected OlderReplicas, got {other:?}"),
    };
    for part in [
        "1 connection ",
        &format!(
            "(iota-orchestrator 0.0.9 schema {}), server pid {stalled_pid}",
            known - 1
        ),
        "pg_terminate_backend(pid)",
        "stop every one before starting this version",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    assert!(!message.contains("9.9.9"), "{message}");
    assert!(!message.contains("old-box"), "{message}");
    stalled.close().await.expect("close");
    iota_orchestrator::connect_db(&db_url, 2)
        .await
        .expect("once the stalled replica's connections closed");
    same.close().await.expect("close");
    pool.close().await;
}

async fn upgrade_lock_free(db_url: &str) -> bool {
    let mut conn = sqlx::PgConnection::connect(db_url).await.expect("connect");
    let free: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, 0)")
        .bind(replicas::UPGRADE_LOCK_CLASS)
        .fetch_one(&mut conn)
        .await
        .expect("try the upgrade lock");
    conn.close().await.expect("close");
    free
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_ups_take_the_upgrade_lock_in_turn_and_give_it_back() {
    let db_url = fresh_db().await;
    let pool = iota_orchestrator::connect_db(&db_url, 2)
        .await
        .expect("first start");
    replicas::Replica::join(&pool, "127.0.0.1:1".into())
        .await
        .expect("join");
    // Neither the migration nor the join keeps the lock (a pooled connection would).
    assert!(
        upgrade_lock_free(&db_url).await,
        "the lock outlived the start-up"
    );

    // While another start-up holds it, both wait.
    let mut holder = sqlx::PgConnection::connect(&db_url).await.expect("connect");
    sqlx::query("SELECT pg_advisory_lock($1, 0)")
        .bind(replicas::UPGRADE_LOCK_CLASS)
        .execute(&mut holder)
        .await
        .expect("hold the upgrade lock");
    let migrating = tokio::spawn({
        let url = db_url.clone();
        async move { iota_orchestrator::connect_db(&url, 2).await.map(|_| ()) }
    });
    let joining = tokio::spawn({
        let pool = pool.clone();
        async move {
            replicas::Replica::join(&pool, "127.0.0.1:2".into())
                .await
                .map(|_| ())
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !migrating.is_finished(),
        "migrated under another start-up's lock"
    );
    assert!(
        !joining.is_finished(),
        "joined under another start-up's lock"
    );
    holder.close().await.expect("release");
    migrating
        .await
        .expect("task")
        .expect("migrate after the lock");
    joining.await.expect("task").expect("join after the lock");
    assert_eq!(replicas_recorded(&pool).await, 2);
    pool.close().await;
}

/// Two runs on one database each have a driver: the leader lock is per run. With one lock for
/// the database, the process that took it drove its own run and the other run's epochs never
/// advanced (no deadline, no lease expiry, no garbage collection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runs_on_one_database_each_have_a_driver() {
    init_tracing();
    let chain = chain_with(&[], &[]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut first = run_config("first");
    first.training_s = 1;
    let second = RunConfig {
        name: "second".into(),
        ..first.clone()
    };
    let a = start(config(&chain, &db_url, store.path(), first)).await;
    let b = start(config(&chain, &db_url, store.path(), second)).await;
    for base in [&a.base, &b.base] {
        until_leads(base, Duration::from_secs(20)).await;
    }
    // And each run leaves training at its deadline.
    let db = PgPool::connect(&db_url).await.expect("db");
    eventually(
        "both runs past training",
        std::time::Duration::from_secs(20),
        || async {
            let training: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM runs WHERE phase = 'training' AND epoch = 0",
            )
            .fetch_one(&db)
            .await
            .ok()?;
            (training == 0).then_some(())
        },
    )
    .await;
    db.close().await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disputes_are_settled_by_a_validator_and_scores_recorded() {
    init_tracing();
    // Two validators of equal stake: neither alone holds more than half of it.
    let chain = chain_with(&[41, 42], &[43, 47]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("disputes");
    run.stages = 2;
    run.stage_params = vec![4000, 3000];
    run.samples_per_epoch = 6;
    run.merging_s = 60;
    let orch = start(config(&chain, &db_url, store.path(), run.clone())).await;
    let mut miners = join(&orch.base, &[41, 42]).await;
    miners[1].wrong_merge = true;
    let cheat = miners[1].client().hotkey();
    let v = validator_client(&orch.base, 43).await;
    let second = validator_client(&orch.base, 47).await;

    // Run until the two owners' results disagree: with no third miner to break the tie, the
    // dispute waits for a validator.
    let mut disputes = Vec::new();
    for _ in 0..3000 {
        step_all(&mut miners).await;
        disputes = v.disputes().await.expect("disputes");
        if disputes.len() == (run.stages * run.partitions) as usize {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        disputes.len(),
        (run.stages * run.partitions) as usize,
        "every partition disputed"
    );

    // A hash that names no submitted result settles nothing: the dispute stays open (before,
    // it was closed and the partition left to the deadline's plurality of wrong results).
    let unknown = "ab".repeat(32);
    let refused = v
        .settle(disputes[0].id, &unknown)
        .await
        .expect_err("a hash nobody submitted");
    assert_eq!(refused.code(), Some(iota_protocol::ErrorCode::Conflict));
    assert!(
        v.disputes()
            .await
            .expect("disputes")
            .iter()
            .any(|d| d.id == disputes[0].id),
        "still open"
    );

    // The validator recomputes each merge from the contributions and settles.
    let mut settled_with = Vec::new();
    for d in &disputes {
        let p = &d.partition;
        let range = run.partition_range(p.stage, p.partition).expect("range");
        let len = range.end - range.start;
        let mut parts = Vec::new();
        for c in &d.contributions {
            let bytes = v.download(&c.blob).await.expect("download contribution");
            parts.push((
                c.weight,
                iota_protocol::tensor::decode_partition(&bytes, len).expect("decode"),
            ));
        }
        let merged = iota_testkit::sim::average(&parts, len as usize);
        let bytes = iota_protocol::tensor::encode_merged(&merged, &vec![0.0; len as usize]);
        let hash = iota_protocol::blob::blake3_hex(&bytes);
        // One validator's vote is half the permit holders' stake: recorded, nothing settled.
        let voted = v.settle(d.id, &hash).await.expect("a vote");
        assert_eq!(voted.state, PartitionState::Disputed, "{voted:?}");
        assert_eq!(voted.accepted, None);
        let changed = v
            .settle(d.id, &"cd".repeat(32))
            .await
            .expect_err("another vote by the same validator");
        assert_eq!(changed.code(), Some(iota_protocol::ErrorCode::Conflict));
        // The second validator's vote for the same hash makes a majority of the stake.
        let settled = second.settle(d.id, &hash).await.expect("settle");
        assert_eq!(settled.state, PartitionState::Accepted);
        assert_eq!(
            settled.accepted.as_ref().map(|b| b.blake3.as_str()),
            Some(hash.as_str())
        );
        assert!(
            settled
                .resolved_by
                .as_deref()
                .is_some_and(|r| r.starts_with("validator:"))
        );
        let cheat_result = settled
            .results
            .iter()
            .find(|r| r.hotkey == cheat)
            .expect("cheat's result");
        assert_ne!(
            cheat_result.blake3.as_ref(),
            settled.accepted.as_ref().map(|b| &b.blake3)
        );
        let cheat_hash = cheat_result.blake3.clone().expect("cheat's hash");
        settled_with.push((d.id, hash, cheat_hash));
    }
    assert!(
        v.disputes().await.expect("disputes").is_empty(),
        "all settled"
    );
    // A settled dispute is not settled again with another submitted result's hash; the same
    // settlement again (a retry) is answered as the first was.
    let (id, accepted, cheat_hash) = &settled_with[0];
    let other = v
        .settle(*id, cheat_hash)
        .await
        .expect_err("another result's hash for a settled dispute");
    assert_eq!(other.code(), Some(iota_protocol::ErrorCode::Conflict));
    assert!(other.to_string().contains("already settled"), "{other}");
    let again = v
        .settle(*id, accepted)
        .await
        .expect("the settlement retried");
    assert_eq!(again.state, PartitionState::Accepted);

    // With everything settled the epoch ends without waiting for the merge deadline.
    let mut rounds = 0;
    while status(&orch.base).await.epoch == 0 {
        step_all(&mut miners).await;
        rounds += 1;
        assert!(rounds < 500, "epoch 0 did not end after settlement");
    }

    // Scores, weights and spot checks are recorded and published.
    let submission = ScoreSubmission {
        scores: vec![
            MinerScore {
                hotkey: miners[0].client().hotkey(),
                score: 1.0,
                work: Some(2.0),
                quality: Some(0.5),
                effect: Some(-0.01),
                flagged: Some(false),
                ..MinerScore::default()
            },
            MinerScore {
                hotkey: cheat.clone(),
                score: 0.0,
                penalty: Some("merge 0/0 is not the average".into()),
                ..MinerScore::default()
            },
        ],
        weights: Some(WeightsSet {
            block: 12,
            uids: vec![0, 1],
            weights: vec![65535, 0],
        }),
        params: Some(ScoringParams {
            clasp_ridge: 1.0,
            clasp_z_threshold: 3.0,
            clasp_min_effect: 0.02,
            clasp_min_samples: 30,
            clasp_window: 10,
            clasp_median_of_seen: true,
            quality_scale: 0.1,
            decay: 0.7,
            window: 10,
            burn_uid: None,
            burn_share: 0.0,
        }),
    };
    // Settings no validator could score with are refused.
    for bad in [
        ScoringParams {
            window: 0,
            ..submission.params.clone().expect("params")
        },
        ScoringParams {
            decay: f64::NAN,
            ..submission.params.clone().expect("params")
        },
        ScoringParams {
            clasp_window: ScoringParams::MAX_CLASP_WINDOW + 1,
            ..submission.params.clone().expect("params")
        },
    ] {
        let refused = v
            .submit_scores(
                0,
                &ScoreSubmission {
                    params: Some(bad),
                    ..submission.clone()
                },
            )
            .await
            .expect_err("bad settings");
        assert_eq!(refused.code(), Some(iota_protocol::ErrorCode::BadRequest));
    }
    let stored = v.submit_scores(0, &submission).await.expect("scores");
    assert_eq!(stored.scores, submission.scores);
    let again = v
        .submit_scores(0, &submission)
        .await
        .expect("idempotent resubmission");
    assert_eq!(again.scores, stored.scores);
    let public: Vec<ScoreRecord> = reqwest::get(format!("{}/v1/scores", orch.base))
        .await
        .expect("scores")
        .json()
        .await
        .expect("json");
    assert_eq!(public.len(), 1);
    assert_eq!(public[0].weights.as_ref().map(|w| w.block), Some(12));
    let tasks = v.spot_checks(0).await.expect("spot-check tasks");
    assert_eq!(tasks.miners.len(), 2);
    assert!(tasks.miners.iter().all(|m| !m.hop_task_ids.is_empty()));
    // A page at a time, by hotkey; the client put the pages together.
    let page = |query: String| {
        let v = &v;
        async move {
            v.signed_raw::<SpotCheckTasks>(
                reqwest::Method::GET,
                &format!("/v1/validator/epochs/0/spot-checks{query}"),
                None,
            )
            .await
            .expect("a page")
        }
    };
    let first = page("?limit=1".into()).await;
    assert_eq!(first.miners.len(), 1);
    let after = first.next_after.clone().expect("more after a full page");
    assert_eq!(after, first.miners[0].hotkey);
    let second = page(format!("?limit=1&after={after}")).await;
    assert_eq!(second.miners.len(), 1);
    assert!(second.miners[0].hotkey > after);
    let rest = page(format!("?after={}", second.miners[0].hotkey)).await;
    assert!(
        rest.miners.is_empty() && rest.next_after.is_none(),
        "{rest:?}"
    );
    assert_eq!(
        tasks.miners,
        [first.miners, second.miners].concat(),
        "the client's pages"
    );
    assert_eq!(
        tasks.partitions.len(),
        (run.stages * run.partitions) as usize
    );
    let report = SpotCheckReport {
        validator: String::new(),
        seed: "ab".repeat(32),
        seed_block: 20,
        checks: vec![SpotCheckResult {
            hotkey: cheat.clone(),
            kind: "merge".into(),
            target: "0/0".into(),
            passed: false,
            detail: "hash mismatch".into(),
        }],
    };
    v.report_spot_checks(0, &report).await.expect("report");
    let tasks = v.spot_checks(0).await.expect("spot-check tasks");
    assert_eq!(tasks.reported.len(), 1);

    // Everything the validator scored from and published is public once the epoch is over, to
    // anyone without a key (`iota validator audit --validator`).
    let anyone = ApiClient::public(&orch.base, RetryPolicy::default()).expect("public client");
    let theirs = v.epoch_record(0).await.expect("validator's record");
    let public_record = anyone.finished_epoch(0).await.expect("public record");
    assert_eq!(public_record.miners, theirs.miners);
    assert_eq!(public_record.pseudo_gradients, theirs.pseudo_gradients);
    assert_eq!(public_record.phase, None);
    let states = |r: &EpochRecord| -> Vec<_> {
        r.partitions
            .iter()
            .map(|p| (p.stage, p.partition, p.state))
            .collect()
    };
    assert_eq!(states(&public_record), states(&theirs));
    let mut theirs_samples = v.samples(0, 0, 5000).await.expect("validator's samples");
    let public_samples = anyone.finished_samples(0, 0, 5000).await.expect("samples");
    assert!(!public_samples.samples.is_empty());
    assert_eq!(
        public_samples.samples,
        std::mem::take(&mut theirs_samples.samples)
    );
    let published = anyone.epoch_scores(0).await.expect("published scores");
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].validator, v.hotkey());
    assert_eq!(published[0].scores, submission.scores);
    assert_eq!(published[0].params, submission.params);
    assert_eq!(
        anyone.reported_spot_checks(0).await.expect("checks"),
        tasks.reported
    );
    // A running epoch is not public (its pseudo-gradients' keys would let a miner copy
    // another's), and the keyless client cannot use a signed route.
    let running = status(&orch.base).await.epoch;
    let refused = anyone
        .finished_epoch(running)
        .await
        .expect_err("a running epoch");
    assert_eq!(refused.code(), Some(iota_protocol::ErrorCode::NotFound));
    let refused = anyone
        .finished_samples(running, 0, 10)
        .await
        .expect_err("a running epoch's samples");
    assert_eq!(refused.code(), Some(iota_protocol::ErrorCode::NotFound));
    assert!(anyone.epoch_record(0).await.is_err(), "a signed route");
    assert_eq!(tasks.reported[0].validator, v.hotkey());
    // The merges and reports come with the first page, and later pages do not repeat them.
    let first = page("?limit=1".into()).await;
    assert_eq!(first.reported, tasks.reported);
    assert_eq!(first.partitions, tasks.partitions);
    let second = page(format!("?limit=1&after={after}")).await;
    assert_eq!(second.miners.len(), 1);
    assert!(
        second.partitions.is_empty() && second.reported.is_empty(),
        "{second:?}"
    );
    // Reports are kept per epoch: one for an epoch that has not started is refused.
    let future = v
        .report_spot_checks(1 << 40, &report)
        .await
        .expect_err("a report for a future epoch");
    assert_eq!(future.code(), Some(iota_protocol::ErrorCode::WrongPhase));
    // Miners may not use validator routes.
    let refused = miners[0]
        .client()
        .spot_checks(0)
        .await
        .expect_err("miner refused");
    assert_eq!(refused.code(), Some(iota_protocol::ErrorCode::NotValidator));
    orch.stop().await;
}

/// Disputes nobody settles are closed when their epoch ends (they leave the validators' list, and
/// a late settlement is refused instead of being recorded against weights the next epoch did not
/// start from); their partitions keep their weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disputes_left_open_close_with_their_epoch() {
    init_tracing();
    let chain = chain_with(&[44, 45], &[46]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("dispute-deadline");
    run.stages = 2;
    run.stage_params = vec![4000, 3000];
    run.samples_per_epoch = 6;
    run.merging_s = 4;
    run.merge_round_s = 2;
    let orch = start(config(&chain, &db_url, store.path(), run.clone())).await;
    let mut miners = join(&orch.base, &[44, 45]).await;
    miners[1].wrong_merge = true;
    let v = validator_client(&orch.base, 46).await;

    let mut open = Vec::new();
    for _ in 0..3000 {
        step_all(&mut miners).await;
        open = v.disputes().await.expect("disputes");
        if !open.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!open.is_empty(), "a dispute opened");
    let mut rounds = 0;
    while status(&orch.base).await.epoch == 0 {
        step_all(&mut miners).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        rounds += 1;
        assert!(rounds < 3000, "epoch 0 did not end at its deadline");
    }
    let left: Vec<i64> = v
        .disputes()
        .await
        .expect("disputes")
        .iter()
        .filter(|d| d.partition.epoch == 0)
        .map(|d| d.id)
        .collect();
    assert!(left.is_empty(), "epoch 0's disputes still open: {left:?}");
    let db = PgPool::connect(&db_url).await.expect("db");
    let closed: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT state, settled_by FROM disputes WHERE epoch = 0 ORDER BY id")
            .fetch_all(&db)
            .await
            .expect("disputes");
    assert_eq!(closed.len(), open.len(), "{closed:?}");
    assert!(
        closed
            .iter()
            .all(|(state, by)| state == "settled" && by.as_deref() == Some("deadline")),
        "{closed:?}"
    );
    // Nothing unverified is adopted: each disputed partition kept its weights, and its dispute
    // closed with no hash.
    let ended: Vec<(Option<String>, String, Option<String>)> = sqlx::query_as(
        "SELECT d.settled_hash, p.state, p.resolved_by FROM disputes d
         JOIN partitions p USING (run_id, epoch, stage, partition) WHERE d.epoch = 0",
    )
    .fetch_all(&db)
    .await
    .expect("partitions");
    assert!(
        ended.iter().all(|(hash, state, by)| hash.is_none()
            && state == "unchanged"
            && by.as_deref() == Some("unverified")),
        "{ended:?}"
    );
    // A late settlement is refused as late, whatever its hash: even a submitted result's (a 200
    // would tell the validator it had settled it).
    let closed_with: String = sqlx::query_scalar(
        "SELECT r.blake3 FROM merge_results r JOIN disputes d USING (run_id, epoch, stage, partition)
         WHERE d.id = $1 LIMIT 1",
    )
    .bind(open[0].id)
    .fetch_one(&db)
    .await
    .expect("a submitted result's hash");
    for hash in ["cd".repeat(32), closed_with] {
        let late = v
            .settle(open[0].id, &hash)
            .await
            .expect_err("a settlement after the epoch");
        assert_eq!(
            late.code(),
            Some(iota_protocol::ErrorCode::WrongPhase),
            "{late}"
        );
    }
    orch.stop().await;
}

/// Hops leased now.
async fn leased(db: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM tasks WHERE status = 'leased'")
        .fetch_one(db)
        .await
        .expect("leased")
}

/// Work in flight: the miners poll until hops are leased. How many.
async fn lease_work(miners: &mut [SimMiner], db: &PgPool) -> i64 {
    let mut rounds = 0;
    while leased(db).await == 0 {
        for m in miners.iter_mut() {
            m.client().work(4).await.expect("poll");
        }
        rounds += 1;
        assert!(rounds < 500, "no work was leased");
    }
    leased(db).await
}

/// The phase and the seconds it has left, by the database's clock.
async fn time_left(db: &PgPool) -> (String, f64) {
    sqlx::query_as("SELECT phase, extract(epoch FROM phase_deadline - now())::float8 FROM runs")
        .fetch_one(db)
        .await
        .expect("time left")
}

/// After a gap in which the run was not driven and its miners were silent (longer than the
/// heartbeat timeout and the lease), and a few driver ticks: nothing was held against the
/// miners, their leases are kept, and the phase goes on with the time it had left before the gap
/// (less the ticks and what ending the gap took), given back once.
async fn assert_gap_forgiven(db: &PgPool, leased_before: i64, before: (String, f64), gap: &str) {
    let (released, expired, abandoned): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM miners WHERE status = 'released'),
                (SELECT count(*) FROM tasks WHERE status = 'expired'),
                (SELECT count(*) FROM samples WHERE status = 'abandoned')",
    )
    .fetch_one(db)
    .await
    .expect("counts");
    assert_eq!(
        (released, expired, abandoned),
        (0, 0, 0),
        "{gap}: held against the miners"
    );
    assert_eq!(leased(db).await, leased_before, "{gap}: leases lost");
    let ((phase_before, left_before), (phase_after, left_after)) = (before, time_left(db).await);
    assert_eq!(phase_after, phase_before, "{gap}: the phase changed");
    assert!(
        left_after > left_before - 4.0,
        "{gap}: it took the phase's time: {left_before:.1} s left before, {left_after:.1} s after"
    );
    assert!(
        left_after < left_before + 2.0,
        "{gap}: given back more than once: {left_before:.1} s left before, {left_after:.1} s after"
    );
}

/// Regression: an orchestrator restarted after an outage longer than the heartbeat timeout
/// released every miner at its first tick (they could not be heard while it was down) and
/// abandoned their samples, so the epoch could end with none completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_after_a_long_outage_keeps_miners_and_leases() {
    init_tracing();
    let seeds = [71u8, 72, 73, 74, 75, 76];
    let chain = chain_with(&seeds, &[]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let run = run_config("outage");
    let cfg = config(&chain, &db_url, store.path(), run.clone());
    let orch = start(cfg.clone()).await;
    let addr = orch.base.trim_start_matches("http://").to_owned();
    let db = PgPool::connect(&db_url).await.expect("db");
    let mut miners = join(&orch.base, &seeds).await;
    let before = lease_work(&mut miners, &db).await;
    let left_before = time_left(&db).await;
    orch.stop().await;
    // Down for longer than both the heartbeat timeout and the lease.
    tokio::time::sleep(Duration::from_secs(
        run.heartbeat_timeout_s.max(run.lease_s) + 2,
    ))
    .await;
    let orch = start_on(cfg, &addr).await;
    // Several driver ticks with the miners still silent (they have not noticed the restart).
    // The outage alone took 7 s of the phase's time before.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_gap_forgiven(&db, before, left_before, "the outage").await;
    // And they are released as usual when they stay silent for a timeout after the restart.
    all_released(
        &db,
        seeds.len(),
        "silent miners released after the restart",
        Duration::from_secs(run.heartbeat_timeout_s + run.lease_s + 5),
    )
    .await;
    orch.stop().await;
}

/// A leader whose steps failed for longer than the heartbeat timeout and the lease (here the
/// database refuses every write to the run's row; a full disk or a read-only failover does the
/// same, while its lock's connection still answers) gives that time back before it steps again,
/// as a new leader does: its first good step once released every miner and expired every lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_steps_failed_for_a_while_gives_the_time_back() {
    init_tracing();
    let seeds = [77u8, 78, 79, 80, 81, 82];
    let chain = chain_with(&seeds, &[]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let run = run_config("failed-steps");
    let orch = start(config(&chain, &db_url, store.path(), run.clone())).await;
    let db = PgPool::connect(&db_url).await.expect("db");
    let mut miners = join(&orch.base, &seeds).await;
    let before = lease_work(&mut miners, &db).await;
    let left_before = time_left(&db).await;
    for sql in [
        "CREATE FUNCTION refuse_run_writes() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'injected: the run cannot be written'; END $$",
        "CREATE TRIGGER refuse_run_writes BEFORE UPDATE ON runs
         FOR EACH ROW EXECUTE FUNCTION refuse_run_writes()",
    ] {
        sqlx::query(sql).execute(&db).await.expect("refuse writes");
    }
    // The miners are silent meanwhile, as they are when their requests fail.
    tokio::time::sleep(Duration::from_secs(
        run.heartbeat_timeout_s.max(run.lease_s) + 2,
    ))
    .await;
    sqlx::query("DROP TRIGGER refuse_run_writes ON runs")
        .execute(&db)
        .await
        .expect("writes again");
    let driven = || async {
        let at: Option<chrono::DateTime<chrono::Utc>> =
            sqlx::query_scalar("SELECT driven_at FROM runs")
                .fetch_one(&db)
                .await
                .expect("driven_at");
        at
    };
    let stalled = driven().await;
    eventually(
        "the driver steps again",
        Duration::from_secs(10),
        || async { (driven().await > stalled).then_some(()) },
    )
    .await;
    // A few more steps.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_gap_forgiven(&db, before, left_before, "the failed steps").await;
    orch.stop().await;
}

/// A phase change that keeps failing while the step's bookkeeping succeeds (the database takes
/// writes, and miners' requests go through) is no outage: silent miners are still released. The
/// leader gave every such failure's time back, which moved every miner's last-seen mark forward
/// each time, so none was ever released and no lease lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_miners_are_released_while_a_phase_change_keeps_failing() {
    init_tracing();
    let seeds = [83u8, 84, 85];
    let chain = chain_with(&seeds, &[]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let run = run_config("failing-phase-change");
    let orch = start(config(&chain, &db_url, store.path(), run.clone())).await;
    let db = PgPool::connect(&db_url).await.expect("db");
    let _miners = join(&orch.base, &seeds).await;
    for sql in [
        "CREATE FUNCTION refuse_phase_changes() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.phase IS DISTINCT FROM OLD.phase THEN
             RAISE EXCEPTION 'injected: the phase cannot change';
           END IF;
           RETURN NEW;
         END $$",
        "CREATE TRIGGER refuse_phase_changes BEFORE UPDATE ON runs
         FOR EACH ROW EXECUTE FUNCTION refuse_phase_changes()",
        // The training deadline is past: every step tries to start uploading, and fails.
        "UPDATE runs SET phase_deadline = now() - interval '1 second'",
    ] {
        sqlx::query(sql).execute(&db).await.expect("inject");
    }
    // The miners are silent from now on.
    all_released(
        &db,
        seeds.len(),
        "silent miners released while the phase change fails",
        Duration::from_secs(run.heartbeat_timeout_s + 10),
    )
    .await;
    let phase: String = sqlx::query_scalar("SELECT phase FROM runs")
        .fetch_one(&db)
        .await
        .expect("phase");
    assert_eq!(phase, "training", "the phase changed after all");
    orch.stop().await;
}

/// A chain that takes connections but never answers stops the start-up with one line naming the
/// endpoint, within `--subtensor.timeout` (it took 30 s whatever the flag said).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_that_never_answers_is_a_one_line_error_within_its_timeout() {
    init_tracing();
    let chain = chain_with(&[], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("ws://{}", silent.local_addr().expect("addr"));
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            held.push(conn);
        }
    });
    let mut cfg = config(&chain, &db, store.path(), run_config("silent-chain"));
    cfg.chain_endpoint = url.clone();
    cfg.chain_timeout = Duration::from_secs(1);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let started = std::time::Instant::now();
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        iota_orchestrator::run(cfg, listener, std::future::pending()),
    )
    .await
    .expect("the start-up gave up on the chain");
    let line = out.expect_err("no chain").to_string();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert!(!line.contains('\n') && line.contains(&url), "{line}");
}

/// Waits until `n` miners are released.
async fn all_released(db: &PgPool, n: usize, what: &str, timeout: Duration) {
    eventually(what, timeout, || async {
        let released: i64 =
            sqlx::query_scalar("SELECT count(*) FROM miners WHERE status = 'released'")
                .fetch_one(db)
                .await
                .ok()?;
        (released == n as i64).then_some(())
    })
    .await;
}
