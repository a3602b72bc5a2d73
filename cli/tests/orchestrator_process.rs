//! `iota orchestrator` as a process: SIGKILL mid-epoch and a restart lose nothing, and SIGTERM
//! exits cleanly. Needs PostgreSQL (`DATABASE_URL`, started by scripts/test.sh).

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use iota_chain::calls::Hyperparam;
use iota_chain::wallet::{Keypair, PublicKey, Wallet};
use iota_chain::{ConnectOptions, Subtensor, TxOptions};
use iota_localnet::{Localnet, LocalnetConfig};
use iota_orchestrator::sim::SimMiner;
use iota_protocol::api::{EpochStatus, PartitionState, PartitionStatus, Phase};
use sp_core::Pair as _;
use sp_core::sr25519;
use sqlx::PgPool;

fn pair(seed: u8) -> sr25519::Pair {
    sr25519::Pair::from_seed(&[seed; 32])
}

fn tx() -> TxOptions {
    TxOptions {
        timeout: Duration::from_secs(30),
        ..TxOptions::default()
    }
}

async fn fresh_db() -> String {
    let base = std::env::var("DATABASE_URL").expect(
        "DATABASE_URL is not set: run the tests through scripts/test.sh, which starts PostgreSQL",
    );
    let name = format!("iota_test_{}", uuid::Uuid::new_v4().simple());
    let admin = PgPool::connect(&base).await.expect("connect");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .expect("create database");
    admin.close().await;
    let (prefix, _) = base.rsplit_once('/').expect("database name");
    format!("{prefix}/{name}")
}

/// Kills the child on drop, so a failing test leaves no process behind.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

async fn status(base: &str) -> Option<EpochStatus> {
    reqwest::get(format!("{base}/v1/status"))
        .await
        .ok()?
        .json()
        .await
        .ok()
}

async fn wait_up(base: &str, child: &mut Proc) {
    for _ in 0..600 {
        if status(base).await.is_some() {
            return;
        }
        if let Ok(Some(exit)) = child.0.try_wait() {
            panic!("orchestrator exited at start: {exit}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("orchestrator did not come up");
}

async fn counts(db: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM samples WHERE status = 'done'),
                (SELECT count(*) FROM tasks WHERE status = 'done')",
    )
    .fetch_one(db)
    .await
    .expect("counts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_restart_lose_nothing() {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("localnet");
    let chain = Subtensor::connect(ConnectOptions::new(net.ws_url()))
        .await
        .expect("connect");
    let alice =
        Keypair::from_private_key(&iota_localnet::dev_pair("Alice").to_raw_vec()).expect("alice");
    let netuid = chain
        .register_network(&alice, &PublicKey::from_bytes(pair(250).public().0), &tx())
        .await
        .expect("network")
        .done()
        .expect("done");
    chain
        .start_call(&alice, netuid, &tx())
        .await
        .expect("start");
    chain
        .set_hyperparam(&alice, netuid, Hyperparam::MaxAllowedUids(64), true, &tx())
        .await
        .expect("uids");
    let seeds = [31u8, 32, 33, 34, 35, 36];
    for s in seeds {
        chain
            .register(
                &alice,
                netuid,
                &PublicKey::from_bytes(pair(s).public().0),
                &tx(),
            )
            .await
            .expect("register");
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let wallet = Wallet::new(dir.path(), "orchestrator", "default").expect("wallet");
    wallet.create_hotkey(12, None, false).expect("hotkey");
    let db_url = fresh_db().await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let store = dir.path().join("store");
    let spawn_on = |port: u16| {
        Proc(
            Command::new(env!("CARGO_BIN_EXE_iota"))
                .args(["orchestrator", "--model", "tiny"])
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args(["--database-url", &db_url])
                .args(["--store", store.to_str().expect("utf-8 path")])
                .args(["--subtensor.network", &net.ws_url()])
                .args(["--netuid", &netuid.to_string()])
                .args(["--wallet.path", dir.path().to_str().expect("utf-8 path")])
                .args([
                    "--wallet.name",
                    "orchestrator",
                    "--wallet.hotkey",
                    "default",
                ])
                .args(["--run-name", "restart", "--samples-per-epoch", "16"])
                .args(["--micro-batch", "2", "--seq-len", "16", "--partitions", "2"])
                .args([
                    "--training-s",
                    "120",
                    "--uploading-s",
                    "20",
                    "--merging-s",
                    "20",
                ])
                .args(["--lease-s", "5", "--heartbeat-timeout-s", "15"])
                .args(["--metagraph-refresh-s", "1", "--tick-ms", "100"])
                .args(["--rate-per-hotkey", "1000", "--rate-per-ip", "1000"])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn iota orchestrator"),
        )
    };
    let spawn = || spawn_on(port);
    let mut child = spawn();
    wait_up(&base, &mut child).await;
    let db = PgPool::connect(&db_url).await.expect("db");

    let mut miners = Vec::new();
    for (i, s) in seeds.iter().enumerate() {
        miners.push(
            SimMiner::join(&base, Arc::new(pair(*s)), 100.0 + i as f64, u64::from(*s))
                .await
                .expect("join"),
        );
    }
    // Train until some samples are done, then SIGKILL in the middle of the epoch.
    for _ in 0..2000 {
        for m in &mut miners {
            m.step().await.expect("step");
        }
        if counts(&db).await.0 >= 4 {
            break;
        }
    }
    let before = status(&base).await.expect("status");
    assert_eq!((before.epoch, before.phase), (0, Phase::Training));
    let (done_samples, done_hops) = counts(&db).await;
    assert!(done_samples >= 4);
    let killed_at = std::time::Instant::now();
    child.0.kill().expect("SIGKILL");
    let _ = child.0.wait();
    drop(child);

    let mut child = spawn();
    wait_up(&base, &mut child).await;
    let after = status(&base).await.expect("status");
    assert_eq!(
        (after.epoch, after.phase),
        (0, Phase::Training),
        "same epoch and phase"
    );
    // The same deadline, moved out by the time nobody drove the run (the new leader gives the
    // phase the time it had left), and by no more than the restart took.
    let down_ms = killed_at.elapsed().as_millis() as i64;
    let moved = after.phase_deadline_ms - before.phase_deadline_ms;
    assert!(
        (0..=down_ms + 1000).contains(&moved),
        "deadline moved by {moved} ms over a restart of {down_ms} ms"
    );
    let (s2, h2) = counts(&db).await;
    assert!(s2 >= done_samples && h2 >= done_hops, "work was lost");

    // A second process on the same database serves the same run; one of the two leads.
    let port2 = free_port();
    let base2 = format!("http://127.0.0.1:{port2}");
    let mut second = spawn_on(port2);
    wait_up(&base2, &mut second).await;
    let mut leaders = Vec::new();
    for _ in 0..100 {
        leaders.clear();
        for b in [&base, &base2] {
            let h: iota_protocol::api::Health = reqwest::get(format!("{b}/healthz"))
                .await
                .expect("health")
                .json()
                .await
                .expect("json");
            leaders.push(h.leader);
        }
        if leaders.iter().filter(|l| **l).count() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        leaders.iter().filter(|l| **l).count(),
        1,
        "exactly one leader: {leaders:?}"
    );
    let s2 = status(&base2)
        .await
        .expect("status from the second process");
    assert_eq!((s2.epoch, s2.phase), (after.epoch, after.phase));
    for (i, s) in seeds.iter().enumerate().skip(3) {
        miners[i] = SimMiner::join(&base2, Arc::new(pair(*s)), 100.0 + i as f64, u64::from(*s))
            .await
            .expect("join through the second process");
    }

    // The miners carry on through the restart and the epoch completes.
    let mut rounds = 0;
    while status(&base).await.map(|s| s.epoch) != Some(1) {
        for m in &mut miners {
            // A request in flight at the kill may fail once; the next step retries.
            let _ = m.step().await;
        }
        rounds += 1;
        assert!(rounds < 4000, "epoch 0 did not complete after the restart");
    }
    let merges: Vec<PartitionStatus> = reqwest::get(format!("{base}/v1/epochs/0/merges"))
        .await
        .expect("merges")
        .json()
        .await
        .expect("json");
    assert!(!merges.is_empty());
    assert!(
        merges.iter().all(|p| p.state == PartitionState::Accepted),
        "{merges:?}"
    );
    let double: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT sample_id, stage, direction FROM tasks WHERE status = 'done'
           GROUP BY sample_id, stage, direction HAVING count(*) > 1) d",
    )
    .fetch_one(&db)
    .await
    .expect("query");
    assert_eq!(double, 0, "a hop was counted twice");
    let mismatched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM epochs e WHERE e.samples_completed <>
           (SELECT count(*) FROM samples s WHERE s.run_id = e.run_id AND s.epoch = e.epoch
              AND s.status = 'done')",
    )
    .fetch_one(&db)
    .await
    .expect("query");
    assert_eq!(mismatched, 0);

    drop(second);

    // SIGTERM: a clean exit.
    let pid = child.0.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let mut exit = None;
    for _ in 0..200 {
        if let Ok(Some(code)) = child.0.try_wait() {
            exit = Some(code);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let exit = exit.expect("exited after SIGTERM");
    assert!(exit.success(), "exit status {exit}");
}
