//! `iota orchestrator` as a process: SIGKILL mid-epoch and a restart lose nothing, and SIGTERM
//! exits cleanly. Needs PostgreSQL (`DATABASE_URL`, started by scripts/test.sh).

use crate::miner_support::{fresh_db, tx};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use iota_chain::wallet::{Keypair, PublicKey, Wallet};
use iota_chain::{ConnectOptions, Subtensor};
use iota_devnet::{PermitWait, SubnetPlan, bootstrap};
use iota_localnet::{Localnet, LocalnetConfig};
use iota_protocol::api::{EpochStatus, PartitionState, PartitionStatus, Phase};
use iota_testkit::sim::SimMiner;
use sp_core::Pair as _;
use sp_core::sr25519;
use sqlx::PgPool;

fn pair(seed: u8) -> sr25519::Pair {
    sr25519::Pair::from_seed(&[seed; 32])
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

/// The JSON body of a GET that must succeed.
async fn get_json<T: serde::de::DeserializeOwned>(url: String) -> T {
    reqwest::get(&url)
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: body: {e}"))
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

/// A localnet with a subnet that has `seeds`' hotkeys registered, and a wallet for the
/// orchestrator.
struct Subnet {
    net: Localnet,
    netuid: u16,
    dir: tempfile::TempDir,
}

impl Subnet {
    async fn new(seeds: &[u8]) -> Self {
        let net = Localnet::spawn(LocalnetConfig::instant())
            .await
            .expect("localnet");
        let chain = Subtensor::connect(ConnectOptions::new(net.ws_url()))
            .await
            .expect("connect");
        let alice = Keypair::from_private_key(&iota_localnet::dev_pair("Alice").to_raw_vec())
            .expect("alice");
        let neurons: Vec<PublicKey> = seeds
            .iter()
            .map(|s| PublicKey::from_bytes(pair(*s).public().0))
            .collect();
        let netuid = bootstrap(
            &chain,
            &SubnetPlan {
                sudo: &alice,
                owner: &PublicKey::from_bytes(pair(250).public().0),
                max_uids: 64,
                settings: &[],
                neurons: &neurons,
                validators: &[],
                permits: PermitWait::Skip,
                tx: &tx(),
            },
        )
        .await
        .expect("subnet bootstrap");
        let dir = tempfile::tempdir().expect("tempdir");
        let wallet = Wallet::new(dir.path(), "orchestrator", "default").expect("wallet");
        wallet.create_hotkey(12, None, false).expect("hotkey");
        Self { net, netuid, dir }
    }

    /// The store folder the orchestrator of [`Subnet::orchestrator`] uses.
    fn store(&self) -> std::path::PathBuf {
        self.dir.path().join("store")
    }

    /// `iota orchestrator` of a small run of `model` on this subnet, listening on `port`.
    fn orchestrator(&self, port: u16, db_url: &str, model: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_iota"));
        c.args(["orchestrator", "--model", model])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--database-url", db_url])
            .args(["--store", self.store().to_str().expect("utf-8 path")])
            .args(["--subtensor.network", &self.net.ws_url()])
            .args(["--netuid", &self.netuid.to_string()])
            .args([
                "--wallet.path",
                self.dir.path().to_str().expect("utf-8 path"),
            ])
            .args([
                "--wallet.name",
                "orchestrator",
                "--wallet.hotkey",
                "default",
            ])
            .args(["--samples-per-epoch", "16"])
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
            .stderr(Stdio::inherit());
        c
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_restart_lose_nothing() {
    let seeds = [31u8, 32, 33, 34, 35, 36];
    let subnet = Subnet::new(&seeds).await;
    let db_url = fresh_db().await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let spawn_on = |port: u16| {
        Proc(
            subnet
                .orchestrator(port, &db_url, "tiny")
                .args(["--run-name", "restart"])
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
            let h: iota_protocol::api::Health = get_json(format!("{b}/healthz")).await;
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
    let merges: Vec<PartitionStatus> = get_json(format!("{base}/v1/epochs/0/merges")).await;
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

/// `--data s3://bucket/prefix`: the orchestrator copies a prepared dataset from a bucket into the
/// run's store at start and names its manifest's BLAKE3 in the run; a prefix that holds none
/// stops it at start with an error that says which file is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataset_in_a_bucket_is_published_at_start() {
    let endpoint = std::env::var("IOTA_TEST_S3_ENDPOINT").expect(
        "IOTA_TEST_S3_ENDPOINT is not set: run the tests through scripts/test.sh, which starts an \
         S3-protocol server",
    );
    let bucket = std::env::var("IOTA_TEST_S3_BUCKET").unwrap_or_else(|_| "iota-test".into());
    let region = std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into());
    let subnet = Subnet::new(&[]).await;

    // A prepared dataset, and a model whose vocabulary holds its tokenizer.
    let tmp = tempfile::tempdir().expect("tmp");
    let raw = tmp.path().join("raw.txt");
    let text: String = (0..200)
        .map(|i| format!("{i}. The miller watched the water turn the wheel.\n"))
        .collect();
    std::fs::write(&raw, text).expect("write");
    let tok = tmp.path().join("tokenizer.json");
    iota_model::train_bpe_tokenizer(std::slice::from_ref(&raw), 300, &tok).expect("tokenizer");
    let ds = tmp.path().join("ds");
    let opts = iota_model::data::prepare::PrepareOptions {
        shard_tokens: 2048,
        held_out_ppm: 100_000,
        ..Default::default()
    };
    let (_, hash) =
        iota_model::data::prepare::prepare(&[raw], &tok, &ds, &opts, &mut |_| {}).expect("prepare");
    let model = tmp.path().join("model.json");
    let config = iota_model::ModelConfig::tiny().with_vocab_size(512);
    std::fs::write(&model, config.to_json().expect("json")).expect("write");
    let model = model.to_str().expect("utf-8 path");

    // The files under a fresh prefix of the test bucket.
    let blobs = iota_orchestrator::BlobStore::open(&iota_orchestrator::StoreConfig::S3 {
        bucket: bucket.clone(),
        endpoint: Some(endpoint.clone()),
        region: Some(region.clone()),
        presign_ttl: Duration::from_secs(60),
        part_bytes: iota_orchestrator::store::DEFAULT_PART_BYTES,
    })
    .expect("s3");
    let prefix = format!("prepared/{}", uuid::Uuid::new_v4().simple());
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&ds).expect("ds") {
        let name = entry.expect("entry").file_name();
        let name = name.to_str().expect("utf-8 name").to_owned();
        blobs
            .put_file(&format!("{prefix}/{name}"), &ds.join(&name))
            .await
            .expect("upload");
        names.push(name);
    }
    assert!(names.len() >= 4, "{names:?}");
    let url = |prefix: &str| format!("s3://{bucket}/{prefix}?endpoint={endpoint}&region={region}");

    let db_url = fresh_db().await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut child = Proc(
        subnet
            .orchestrator(port, &db_url, model)
            .args(["--run-name", "bucket", "--data", &url(&prefix)])
            .spawn()
            .expect("spawn iota orchestrator"),
    );
    wait_up(&base, &mut child).await;
    let run: iota_protocol::api::RunInfo = get_json(format!("{base}/v1/run")).await;
    assert_eq!(run.config.dataset.as_deref(), Some(hash.as_str()));
    let stored = subnet
        .store()
        .join(iota_protocol::dataset::dataset_prefix(&hash));
    for name in &names {
        assert_eq!(
            std::fs::read(stored.join(name)).expect("stored"),
            std::fs::read(ds.join(name)).expect("prepared"),
            "{name}"
        );
    }
    drop(child);

    // A prefix without a dataset: a start-up error naming the missing manifest, not a crash.
    let out = subnet
        .orchestrator(free_port(), &fresh_db().await, model)
        .args(["--run-name", "empty", "--data", &url("nothing-here")])
        .stderr(Stdio::piped())
        .output()
        .expect("run iota orchestrator");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nothing-here/manifest.json") && !err.contains("panicked"),
        "{err}"
    );
}
