//! Faults on a running subnet: `iota orchestrator`, four `iota miner` processes (2 stages × 2)
//! and one `iota validator run` train a 2-stage `tiny` model against an in-process localnet and
//! PostgreSQL, while a seeded RNG picks the moments at which a miner, the orchestrator and the
//! validator are SIGKILLed and restarted. The run must still finish its epochs, lose none,
//! count no sample twice, leave every database row consistent, and the restarted validator
//! must get weights onto the chain.
//!
//! The seed is printed; `IOTA_FAULT_SEED=N` replays a schedule. Needs PostgreSQL
//! (`DATABASE_URL`, started by scripts/test.sh).

use crate::miner_support::{fresh_db, tx};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use iota_chain::wallet::{Keypair, Wallet};
use iota_chain::{ConnectOptions, Subtensor};
use iota_devnet::{PermitWait, SubnetPlan, bootstrap};
use iota_localnet::{Localnet, LocalnetConfig};
use iota_protocol::api::{EpochStatus, Phase, ThroughputPoint};
use rand::{Rng as _, SeedableRng as _};
use sp_core::Pair as _;
use sqlx::PgPool;

/// Epochs the run must finish.
const EPOCHS: u64 = 3;
const STAGES: u32 = 2;
const PARTITIONS: u32 = 2;
const MINERS: usize = 4;
const SAMPLES: u64 = 24;
const MICRO_BATCH: u64 = 2;
const SEQ_LEN: u64 = 16;
const TEMPO: u16 = 20;
const ORCH_SEED: u8 = 90;
const VALIDATOR_SEED: u8 = 91;
const MINER_SEEDS: [u8; MINERS] = [92, 93, 94, 95];

fn key(seed: u8) -> Keypair {
    Keypair::from_seed([seed; 32])
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// One service process, restartable; killed on drop so a failing test leaves nothing behind.
struct Service {
    name: String,
    args: Vec<String>,
    logs: PathBuf,
    child: Option<Child>,
    starts: u32,
}

impl Service {
    fn new(name: &str, args: Vec<String>, logs: &Path) -> Self {
        Self {
            name: name.into(),
            args,
            logs: logs.to_path_buf(),
            child: None,
            starts: 0,
        }
    }

    fn start(&mut self) {
        let log = self.logs.join(format!("{}.{}.log", self.name, self.starts));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_iota"))
            .args(&self.args)
            .env("RUST_LOG", "warn")
            .env_remove("DATABASE_URL")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.name));
        self.child = Some(child);
        self.starts += 1;
    }

    /// SIGKILL: no clean-up, no goodbye to the orchestrator or the chain.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("SIGKILL");
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits for the clean exit (SIGKILL after 20 s).
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            for _ in 0..200 {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Panics if the process has exited on its own (only kills end these).
    fn assert_running(&mut self, seed: u64) {
        if let Some(c) = self.child.as_mut()
            && let Ok(Some(exit)) = c.try_wait()
        {
            panic!(
                "{} exited by itself ({exit}); seed {seed}\n{}",
                self.name,
                self.log_tail()
            );
        }
    }

    fn log_tail(&self) -> String {
        let mut out = String::new();
        for i in 0..self.starts {
            let p = self.logs.join(format!("{}.{i}.log", self.name));
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(15);
            out.push_str(&format!(
                "--- {} ---\n{}\n",
                p.display(),
                lines[from..].join("\n")
            ));
        }
        out
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Victim {
    Miner(usize),
    Orchestrator,
    Validator,
}

/// A kill: once the run is at (or past) `epoch` in `phase`, wait `delay`, SIGKILL the victim,
/// leave it down for `down`, start it again.
#[derive(Clone, Debug)]
struct Fault {
    epoch: u64,
    phase: u8,
    delay: Duration,
    down: Duration,
    victim: Victim,
}

fn phase_index(p: Phase) -> u8 {
    match p {
        Phase::Training => 0,
        Phase::Uploading => 1,
        Phase::Merging => 2,
    }
}

const PHASES: [&str; 3] = ["training", "uploading", "merging"];

fn schedule(seed: u64) -> Vec<Fault> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let miner = rng.gen_range(0..MINERS);
    let mut faults: Vec<Fault> = [
        Victim::Miner(miner),
        Victim::Orchestrator,
        Victim::Validator,
    ]
    .into_iter()
    .map(|victim| Fault {
        // The validator has work only once an epoch has ended, and must have an epoch left
        // to score after its restart; the others are killed early enough that the run must
        // recover before its last epoch ends. (A kill lands `delay` into its phase, or at the
        // phase's end if that is sooner, so always inside the target epochs.)
        epoch: match victim {
            Victim::Validator => rng.gen_range(1..EPOCHS - 1),
            _ => rng.gen_range(0..EPOCHS - 1),
        },
        phase: rng.gen_range(0..3),
        delay: Duration::from_millis(rng.gen_range(0..2_000)),
        // Shorter than the heartbeat timeout at times, longer at others; the validator
        // stays down for less than a reveal window (one tempo, 5 s).
        down: Duration::from_millis(match victim {
            Victim::Validator => rng.gen_range(200..2_500),
            _ => rng.gen_range(200..8_000),
        }),
        victim,
    })
    .collect();
    faults.sort_by_key(|f| (f.epoch, f.phase, f.delay));
    faults
}

async fn status(base: &str) -> Option<EpochStatus> {
    reqwest::get(format!("{base}/v1/status"))
        .await
        .ok()?
        .json()
        .await
        .ok()
}

async fn wait_up(base: &str, svc: &mut Service, seed: u64) {
    for _ in 0..1200 {
        if status(base).await.is_some() {
            return;
        }
        svc.assert_running(seed);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the orchestrator did not come up; seed {seed}");
}

/// A subnet on a localnet with 250 ms blocks: every hotkey registered, the validator staked
/// and holding its permit.
async fn subnet() -> (Localnet, Subtensor, u16) {
    let mut config = LocalnetConfig::with_block_time(Duration::from_millis(250));
    config.chain.new_subnet_tempo = TEMPO;
    let net = Localnet::spawn(config).await.expect("localnet");
    let mut opts = ConnectOptions::new(net.ws_url());
    opts.connect_timeout = Duration::from_secs(20);
    let chain = Subtensor::connect(opts).await.expect("connect");
    let alice =
        Keypair::from_private_key(&iota_localnet::dev_pair("Alice").to_raw_vec()).expect("alice");
    let neurons: Vec<_> = MINER_SEEDS
        .iter()
        .chain([&VALIDATOR_SEED])
        .map(|s| key(*s).public())
        .collect();
    let netuid = bootstrap(
        &chain,
        &SubnetPlan {
            sudo: &alice,
            owner: &key(ORCH_SEED).public(),
            max_uids: 64,
            settings: &[],
            neurons: &neurons,
            validators: &[key(VALIDATOR_SEED).public()],
            permits: PermitWait::Await(Duration::from_secs(60)),
            tx: &tx(),
        },
    )
    .await
    .expect("subnet bootstrap");
    (net, chain, netuid)
}

fn wallet(dir: &Path, name: &str, seed: u8) {
    Wallet::new(dir, name, "default")
        .expect("wallet")
        .set_hotkey(&key(seed), None, false)
        .expect("hotkey");
}

/// `(id, epoch, state, block, commit_hash, outcome)` of a weight submission.
type Submission = (
    i64,
    i64,
    String,
    Option<i64>,
    Option<String>,
    Option<serde_json::Value>,
);

fn s(v: &str) -> String {
    v.to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sigkills_lose_no_epoch_and_no_sample() {
    let started = Instant::now();
    let seed: u64 = match std::env::var("IOTA_FAULT_SEED") {
        Ok(v) => v.parse().expect("IOTA_FAULT_SEED is a u64"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos() as u64,
    };
    let faults = schedule(seed);
    println!("fault seed {seed} (replay with IOTA_FAULT_SEED={seed})");
    for f in &faults {
        println!(
            "  {:?}: epoch {} {} +{:?}, down {:?}",
            f.victim, f.epoch, PHASES[f.phase as usize], f.delay, f.down
        );
    }

    let (net, chain, netuid) = subnet().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let wallets = root.join("wallets");
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs).expect("logs dir");
    wallet(&wallets, "orchestrator", ORCH_SEED);
    wallet(&wallets, "validator", VALIDATOR_SEED);
    for (i, s) in MINER_SEEDS.iter().enumerate() {
        wallet(&wallets, &format!("miner{i}"), *s);
    }
    // `tiny` cut into 2 one-block stages: every party loads the model from this file.
    let model = root.join("tiny-2.json");
    let mut cfg = iota_model::ModelConfig::tiny().with_stages(vec![1; STAGES as usize]);
    cfg.name = "tiny-2".into();
    std::fs::write(&model, cfg.to_json().expect("json")).expect("model file");
    let store = root.join("store");
    let orch_db_url = fresh_db().await;
    let val_db_url = fresh_db().await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let wallet_path = wallets.to_str().expect("utf-8 path").to_owned();
    let ws = net.ws_url();

    let mut orch = Service::new(
        "orchestrator",
        [
            "orchestrator",
            "--model",
            model.to_str().expect("utf-8 path"),
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--database-url",
            &orch_db_url,
            "--store",
            store.to_str().expect("utf-8 path"),
            "--subtensor.network",
            &ws,
            "--netuid",
            &netuid.to_string(),
            "--wallet.path",
            &wallet_path,
            "--wallet.name",
            "orchestrator",
            "--wallet.hotkey",
            "default",
            "--run-name",
            "faults",
            "--samples-per-epoch",
            &SAMPLES.to_string(),
            "--micro-batch",
            &MICRO_BATCH.to_string(),
            "--seq-len",
            &SEQ_LEN.to_string(),
            "--partitions",
            &PARTITIONS.to_string(),
            "--max-in-flight",
            "2",
            "--training-s",
            "60",
            "--uploading-s",
            "15",
            "--merging-s",
            "20",
            "--merge-round-s",
            "6",
            "--lease-s",
            "6",
            "--heartbeat-timeout-s",
            "5",
            "--init-seed",
            "7",
            // Keep every object: the checks below read all of them.
            "--retention-epochs",
            "100",
            "--inner-lr",
            "5e-3",
            "--outer-momentum",
            "0.5",
            "--metagraph-refresh-s",
            "1",
            "--tick-ms",
            "100",
            "--rate-per-hotkey",
            "1000",
            "--rate-per-ip",
            "1000",
        ]
        .map(s)
        .to_vec(),
        &logs,
    );
    orch.start();
    wait_up(&base, &mut orch, seed).await;

    let mut miners: Vec<Service> = (0..MINERS)
        .map(|i| {
            let mut m = Service::new(
                &format!("miner{i}"),
                [
                    "miner",
                    "--wallet.path",
                    &wallet_path,
                    "--wallet.name",
                    &format!("miner{i}"),
                    "--wallet.hotkey",
                    "default",
                    "--subtensor.chain_endpoint",
                    &ws,
                    "--netuid",
                    &netuid.to_string(),
                    "--orchestrator.url",
                    &base,
                    "--progress",
                    "off",
                    "--poll-interval-ms",
                    "50",
                    "--memory-gb",
                    "8",
                ]
                .map(s)
                .to_vec(),
                &logs,
            );
            m.start();
            m
        })
        .collect();
    let mut validator = Service::new(
        "validator",
        [
            "validator",
            "run",
            "--wallet.path",
            &wallet_path,
            "--wallet.name",
            "validator",
            "--wallet.hotkey",
            "default",
            "--subtensor.chain_endpoint",
            &ws,
            "--netuid",
            &netuid.to_string(),
            "--orchestrator.url",
            &base,
            "--database.url",
            &val_db_url,
            "--poll-interval-s",
            "1",
            "--replays-per-epoch",
            "2",
            "--merges-per-epoch",
            "2",
        ]
        .map(s)
        .to_vec(),
        &logs,
    );
    validator.start();

    let tails = |orch: &Service, miners: &[Service], validator: &Service| {
        let mut t = orch.log_tail();
        for m in miners {
            t.push_str(&m.log_tail());
        }
        t.push_str(&validator.log_tail());
        t
    };

    // The faults, each on its own clock: one victim's time down never delays another's kill.
    #[derive(Clone, Copy)]
    enum State {
        Waiting,
        /// Due at the instant, or as soon as the run leaves the phase it was armed in, if that
        /// comes first: phases can be shorter than the delay, and a kill must land in (or at
        /// the end of) its phase, not epochs later.
        Armed(Instant, (u64, u8)),
        Down(Instant),
        Done,
    }
    let mut states = vec![State::Waiting; faults.len()];
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut validator_restart_block = 0u64;
    let mut last_epoch = 0u64;
    while states.iter().any(|s| !matches!(s, State::Done)) {
        assert!(
            Instant::now() < deadline,
            "the run stalled during the faults; seed {seed}\n{}",
            tails(&orch, &miners, &validator)
        );
        orch.assert_running(seed);
        validator.assert_running(seed);
        for m in &mut miners {
            m.assert_running(seed);
        }
        let st = status(&base).await;
        if let Some(st) = &st {
            last_epoch = st.epoch;
        }
        let now = Instant::now();
        for (f, state) in faults.iter().zip(states.iter_mut()) {
            let svc = match f.victim {
                Victim::Miner(i) => &mut miners[i],
                Victim::Orchestrator => &mut orch,
                Victim::Validator => &mut validator,
            };
            match *state {
                State::Waiting => {
                    if let Some(st) = &st
                        && (st.epoch, phase_index(st.phase)) >= (f.epoch, f.phase)
                    {
                        *state = State::Armed(now + f.delay, (st.epoch, phase_index(st.phase)));
                    }
                }
                State::Armed(at, armed_in)
                    if now >= at
                        || st
                            .as_ref()
                            .is_some_and(|s| (s.epoch, phase_index(s.phase)) > armed_in) =>
                {
                    println!(
                        "{:>6.1}s SIGKILL {:?} at {}",
                        started.elapsed().as_secs_f64(),
                        f.victim,
                        st.as_ref()
                            .map(|s| format!("epoch {} {}", s.epoch, s.phase.as_str()))
                            .unwrap_or_else(|| format!("epoch {last_epoch} (orchestrator down)"))
                    );
                    // A kill after the last target epoch would test nothing.
                    assert!(
                        last_epoch < EPOCHS,
                        "{:?} was due after the target epochs (epoch {last_epoch}): the run is \
                         too fast for the schedule; seed {seed}",
                        f.victim
                    );
                    svc.kill();
                    *state = State::Down(now + f.down);
                }
                State::Down(until) if now >= until => {
                    svc.start();
                    if f.victim == Victim::Validator {
                        validator_restart_block = chain.best_block_number().await.expect("block");
                    }
                    println!(
                        "{:>6.1}s restarted {:?}",
                        started.elapsed().as_secs_f64(),
                        f.victim
                    );
                    *state = State::Done;
                }
                _ => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The run finishes its epochs.
    loop {
        assert!(
            Instant::now() < deadline,
            "the run did not reach epoch {EPOCHS}: {:?}; seed {seed}\n{}",
            status(&base).await,
            tails(&orch, &miners, &validator)
        );
        orch.assert_running(seed);
        if status(&base).await.is_some_and(|s| s.epoch >= EPOCHS) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "{:>6.1}s epoch {EPOCHS} reached",
        started.elapsed().as_secs_f64()
    );

    // The orchestrator's database and store, checked while everything still runs.
    let db = PgPool::connect(&orch_db_url)
        .await
        .expect("orchestrator db");
    let throughput: Vec<ThroughputPoint> = reqwest::get(format!("{base}/v1/throughput"))
        .await
        .expect("throughput")
        .json()
        .await
        .expect("json");
    orchestrator_invariants(&db, &store, &throughput, seed).await;
    checks_catch_corruption(&db).await;
    // The miners' work is done: their clean exit leaves the cores to the validator.
    for m in &mut miners {
        m.stop();
    }

    // The restarted validator scores every finished epoch and its weights land on chain (a
    // reveal or a direct set updates its uid's last_update).
    let vdb = PgPool::connect(&val_db_url).await.expect("validator db");
    let vuid = chain
        .uid_of(netuid, &key(VALIDATOR_SEED).public())
        .await
        .expect("uid")
        .expect("validator registered");
    let weights_deadline = Instant::now() + Duration::from_secs(120);
    let landed_at = loop {
        validator.assert_running(seed);
        let scored: Option<i64> = sqlx::query_scalar("SELECT max(epoch) FROM scored_epochs")
            .fetch_one(&vdb)
            .await
            .expect("scored");
        let meta = chain.metagraph(netuid).await.expect("metagraph");
        let last_update = meta
            .neurons
            .iter()
            .find(|n| n.uid == vuid)
            .map(|n| n.last_update)
            .unwrap_or(0);
        // Every commit revealed (or refused) in the end: none left in flight.
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM weight_submissions WHERE state IN ('pending', 'committed')",
        )
        .fetch_one(&vdb)
        .await
        .expect("open submissions");
        if scored.is_some_and(|e| e + 1 >= EPOCHS as i64)
            && last_update > validator_restart_block
            && open == 0
        {
            break last_update;
        }
        if Instant::now() >= weights_deadline {
            let subs: Vec<Submission> = sqlx::query_as(
                "SELECT id, epoch, state, block, commit_hash, outcome FROM weight_submissions
                     ORDER BY id",
            )
            .fetch_all(&vdb)
            .await
            .expect("submissions");
            let commits: Vec<String> = sqlx::query_scalar("SELECT hash FROM pending_commits")
                .fetch_all(&vdb)
                .await
                .expect("commits");
            println!("weight submissions: {subs:#?}\npending commits: {commits:?}");
        }
        assert!(
            Instant::now() < weights_deadline,
            "the restarted validator (block {validator_restart_block}) set no weights: scored up to \
             {scored:?}, last_update {last_update}, {open} submissions unsettled; seed {seed}\n{}",
            validator.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!(
        "{:>6.1}s validator weights on chain at block {landed_at} (restarted at {validator_restart_block})",
        started.elapsed().as_secs_f64()
    );

    let head = chain.best_block_number().await.expect("block");
    validator_invariants(&vdb, head, seed).await;

    for m in &mut miners {
        m.kill();
    }
    validator.kill();
    orch.kill();
    net.stop().await;
    println!(
        "fault test passed in {:.1}s (seed {seed})",
        started.elapsed().as_secs_f64()
    );
}

// Invariants the self-check below also runs against a corrupted copy of the state.
const HOPS_TWICE: &str = "SELECT count(*) FROM (SELECT 1 FROM tasks WHERE status = 'done'
           GROUP BY sample_id, stage, direction HAVING count(*) > 1) d";
const COMPLETED_MISMATCH: &str = "SELECT count(*) FROM epochs e WHERE e.samples_completed <>
           (SELECT count(*) FROM samples s WHERE s.run_id = e.run_id AND s.epoch = e.epoch
              AND s.status = 'done')";
const WIRE_MISMATCH: &str = "SELECT count(*) FROM epochs e WHERE e.wire_bytes <>
           (SELECT coalesce(sum((t.output->>'size')::bigint), 0) FROM tasks t
             WHERE t.run_id = e.run_id AND t.epoch = e.epoch AND t.status = 'done'
               AND t.output IS NOT NULL)";
const LAPSED_LEASES: &str = "SELECT count(*) FROM tasks WHERE status = 'leased'
           AND leased_until < now() - interval '3 seconds'";

/// Checks a blob descriptor (`{key, size, blake3, …}`) against the file in the local store.
fn check_blob(store: &Path, blob: &serde_json::Value, what: &str, seed: u64) {
    let key = blob["key"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: no key in {blob}; seed {seed}"));
    let bytes = std::fs::read(store.join(key))
        .unwrap_or_else(|e| panic!("{what}: blob {key} missing from the store ({e}); seed {seed}"));
    assert_eq!(
        Some(bytes.len() as u64),
        blob["size"].as_u64(),
        "{what}: size of {key}; seed {seed}"
    );
    assert_eq!(
        Some(blake3::hash(&bytes).to_hex().as_str()),
        blob["blake3"].as_str(),
        "{what}: BLAKE3 of {key}; seed {seed}"
    );
}

/// Each check must see the fault it guards against: inside a transaction that is rolled back,
/// corrupt the final state the way the bug would and expect a violation.
async fn checks_catch_corruption(db: &PgPool) {
    let cases = [
        (
            HOPS_TWICE,
            "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, attempt, miner, status)
             SELECT run_id, epoch, sample_id, stage, direction, attempt + 1000, miner, 'done'
             FROM tasks WHERE status = 'done' ORDER BY id LIMIT 1",
        ),
        (
            COMPLETED_MISMATCH,
            "UPDATE epochs SET samples_completed = samples_completed + 1 WHERE epoch = 0",
        ),
        (
            WIRE_MISMATCH,
            "UPDATE epochs SET wire_bytes = wire_bytes + 1 WHERE epoch = 0",
        ),
        (
            LAPSED_LEASES,
            "UPDATE tasks SET status = 'leased', leased_until = now() - interval '1 minute'
             WHERE id = (SELECT max(id) FROM tasks WHERE status = 'done')",
        ),
    ];
    for (check, corruption) in cases {
        let mut tx = db.begin().await.expect("transaction");
        sqlx::query(sqlx::AssertSqlSafe(corruption))
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{corruption}: {e}"));
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(check))
            .fetch_one(&mut *tx)
            .await
            .expect("check");
        assert!(n > 0, "{check}\nmissed the corruption\n{corruption}");
        tx.rollback().await.expect("rollback");
    }
}

async fn count(db: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(db)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Asserts `sql` (a `count(*)` of violations) becomes zero within a few driver ticks: for
/// state the running orchestrator cleans up (a hop routed to a miner released a moment ago).
async fn soon_none(db: &PgPool, what: &str, sql: &str, seed: u64) {
    for _ in 0..30 {
        if count(db, sql).await == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    none(db, what, sql, seed).await;
}

/// Asserts `sql` (a `count(*)` of violations) is zero.
async fn none(db: &PgPool, what: &str, sql: &str, seed: u64) {
    let n = count(db, sql).await;
    assert_eq!(n, 0, "{what}: {n} rows; seed {seed}\n{sql}");
}

async fn orchestrator_invariants(
    db: &PgPool,
    store: &Path,
    throughput: &[ThroughputPoint],
    seed: u64,
) {
    let finished = EPOCHS as i64;
    // No epoch lost: 0..=current with none missing, each finished one through every phase in
    // order.
    // (The run goes on meanwhile: read the current epoch first, then what is up to it.)
    let current: i64 = sqlx::query_scalar("SELECT epoch FROM runs")
        .fetch_one(db)
        .await
        .expect("run");
    let epochs: Vec<i64> =
        sqlx::query_scalar("SELECT epoch FROM epochs WHERE epoch <= $1 ORDER BY epoch")
            .bind(current)
            .fetch_all(db)
            .await
            .expect("epochs");
    assert_eq!(
        epochs,
        (0..=current).collect::<Vec<_>>(),
        "epochs consecutive; seed {seed}"
    );
    assert!(current >= finished);
    none(
        db,
        "finished epochs that skipped a phase",
        &format!(
            "SELECT count(*) FROM epochs WHERE epoch < {finished} AND NOT (
               training_ended_at IS NOT NULL AND uploading_ended_at IS NOT NULL
               AND ended_at IS NOT NULL AND started_at <= training_ended_at
               AND training_ended_at <= uploading_ended_at AND uploading_ended_at <= ended_at)"
        ),
        seed,
    )
    .await;
    // Every partition of a finished epoch exists and is settled.
    let settled = count(
        db,
        &format!(
            "SELECT count(*) FROM partitions WHERE epoch < {finished}
               AND state IN ('accepted', 'unchanged')"
        ),
    )
    .await;
    assert_eq!(
        settled,
        finished * i64::from(STAGES * PARTITIONS),
        "settled partitions of the finished epochs; seed {seed}"
    );
    let accepted = count(
        db,
        &format!("SELECT count(*) FROM partitions WHERE epoch < {finished} AND state = 'accepted'"),
    )
    .await;
    println!("partitions of {finished} epochs: {settled} settled, {accepted} merged");
    assert!(
        accepted > 0,
        "no partition was merged in {finished} epochs; seed {seed}"
    );

    // No sample counted twice: each done sample has exactly one done hop per (stage,
    // direction) of its pathway (K forward, K-1 backward), a loss, and the counters equal the
    // distinct done samples.
    let k = i64::from(STAGES);
    none(db, "hops done twice", HOPS_TWICE, seed).await;
    none(
        db,
        "done samples without their full pathway",
        &format!(
            "SELECT count(*) FROM samples s WHERE s.status = 'done' AND (
               s.loss IS NULL OR s.completed_at IS NULL
               OR (SELECT count(*) FROM tasks t WHERE t.sample_id = s.id AND t.status = 'done'
                     AND t.direction = 'forward') <> {k}
               OR (SELECT count(*) FROM tasks t WHERE t.sample_id = s.id AND t.status = 'done'
                     AND t.direction = 'backward' AND t.stage < {k} - 1) <> {k} - 1)"
        ),
        seed,
    )
    .await;
    none(
        db,
        "epochs whose samples_completed differs from their done samples",
        COMPLETED_MISMATCH,
        seed,
    )
    .await;
    none(
        db,
        "epochs that started more samples than they hold or than the target",
        &format!(
            "SELECT count(*) FROM epochs e WHERE e.samples_started > {SAMPLES}
               OR e.samples_started <> (SELECT count(*) FROM samples s
                   WHERE s.run_id = e.run_id AND s.epoch = e.epoch)"
        ),
        seed,
    )
    .await;
    // Bytes on the wire are counted once per accepted hop output.
    none(
        db,
        "epochs whose wire_bytes differ from their done hops' outputs",
        WIRE_MISMATCH,
        seed,
    )
    .await;
    let done_by_epoch: BTreeMap<i64, i64> = sqlx::query_as::<_, (i64, i64)>(
        "SELECT epoch, count(DISTINCT id) FROM samples WHERE status = 'done' GROUP BY epoch",
    )
    .fetch_all(db)
    .await
    .expect("done samples")
    .into_iter()
    .collect();
    let reported: Vec<u64> = throughput.iter().map(|t| t.epoch).collect();
    assert!(
        (0..EPOCHS).all(|e| reported.contains(&e)),
        "throughput lacks a finished epoch: {reported:?}; seed {seed}"
    );
    for t in throughput.iter().filter(|t| (t.epoch as i64) < finished) {
        let done = done_by_epoch.get(&(t.epoch as i64)).copied().unwrap_or(0);
        assert_eq!(
            t.samples, done as u64,
            "throughput samples of epoch {}; seed {seed}",
            t.epoch
        );
        assert_eq!(t.tokens, done as u64 * MICRO_BATCH * SEQ_LEN);
        assert!(
            done > 0,
            "epoch {} completed no sample; seed {seed}",
            t.epoch
        );
    }

    // No hop result without its task: a loss only with the last stage's forward done; a
    // backward hop only on the miner that ran the forward (only it holds the cache).
    none(
        db,
        "losses without a done last-stage forward",
        &format!(
            "SELECT count(*) FROM samples s WHERE s.loss IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM tasks t WHERE t.sample_id = s.id AND t.status = 'done'
                 AND t.direction = 'forward' AND t.stage = {k} - 1)"
        ),
        seed,
    )
    .await;
    none(
        db,
        "done backward hops without the same miner's done forward",
        "SELECT count(*) FROM tasks b WHERE b.status = 'done' AND b.direction = 'backward'
           AND NOT EXISTS (SELECT 1 FROM tasks f WHERE f.sample_id = b.sample_id
             AND f.stage = b.stage AND f.direction = 'forward' AND f.status = 'done'
             AND f.miner = b.miner)",
        seed,
    )
    .await;
    none(
        db,
        "done hops of samples that are still in flight or of another epoch",
        "SELECT count(*) FROM tasks t JOIN samples s ON s.id = t.sample_id
           WHERE t.status = 'done' AND (t.epoch <> s.epoch)",
        seed,
    )
    .await;
    none(
        db,
        "done hops without the output they owe",
        "SELECT count(*) FROM tasks WHERE status = 'done' AND output IS NULL
           AND NOT (direction = 'backward' AND stage = 0)",
        seed,
    )
    .await;

    // Merges: every accepted partition has contributions, each an uploaded pseudo-gradient,
    // and its blob is one an owner submitted (or a settled dispute's).
    none(
        db,
        "merged partitions without contributions or blob",
        "SELECT count(*) FROM partitions WHERE state = 'accepted' AND (accepted IS NULL
           OR resolved_by IS NULL OR jsonb_typeof(contributions) <> 'array'
           OR jsonb_array_length(contributions) = 0)",
        seed,
    )
    .await;
    none(
        db,
        "contributions that are not uploaded pseudo-gradients",
        "SELECT count(*) FROM partitions p, jsonb_array_elements(p.contributions) c
           WHERE NOT EXISTS (SELECT 1 FROM pseudo_gradients g WHERE g.run_id = p.run_id
             AND g.epoch = p.epoch AND g.stage = p.stage AND g.partition = p.partition
             AND g.miner = c->>'hotkey' AND g.blake3 = c->'blob'->>'blake3')",
        seed,
    )
    .await;
    none(
        db,
        "accepted blobs nobody submitted",
        "SELECT count(*) FROM partitions p WHERE p.state = 'accepted' AND NOT EXISTS (
           SELECT 1 FROM merge_results r WHERE r.run_id = p.run_id AND r.epoch = p.epoch
             AND r.stage = p.stage AND r.partition = p.partition
             AND r.blake3 = p.accepted->>'blake3')
           AND NOT EXISTS (SELECT 1 FROM disputes d WHERE d.run_id = p.run_id
             AND d.epoch = p.epoch AND d.stage = p.stage AND d.partition = p.partition
             AND d.settled_hash = p.accepted->>'blake3')",
        seed,
    )
    .await;
    none(
        db,
        "agreements without two matching owners",
        "SELECT count(*) FROM partitions p WHERE p.resolved_by = 'agreement' AND (
           SELECT count(*) FROM merge_results r WHERE r.run_id = p.run_id AND r.epoch = p.epoch
             AND r.stage = p.stage AND r.partition = p.partition
             AND r.blake3 = p.accepted->>'blake3') < 2",
        seed,
    )
    .await;
    none(
        db,
        "open disputes of finished epochs",
        &format!("SELECT count(*) FROM disputes WHERE state = 'open' AND epoch < {finished}"),
        seed,
    )
    .await;

    // Every accepted upload's blob is in the store, with its size and hash.
    let blobs: Vec<(String, serde_json::Value)> = sqlx::query_as(
        "SELECT 'hop ' || id, output FROM tasks WHERE status = 'done' AND output IS NOT NULL
         UNION ALL SELECT 'pseudo-gradient ' || epoch || '/' || stage || '/' || partition
           || ' of ' || miner, blob FROM pseudo_gradients
         UNION ALL SELECT 'merge ' || epoch || '/' || stage || '/' || partition || ' by '
           || submitter, blob FROM merge_results
         UNION ALL SELECT 'accepted ' || epoch || '/' || stage || '/' || partition, accepted
           FROM partitions WHERE accepted IS NOT NULL
         UNION ALL SELECT 'contribution to ' || p.epoch || '/' || p.stage || '/' || p.partition
           || ' by ' || (c->>'hotkey'), c->'blob'
           FROM partitions p, jsonb_array_elements(p.contributions) c",
    )
    .fetch_all(db)
    .await
    .expect("blobs");
    for (what, blob) in &blobs {
        check_blob(store, blob, what, seed);
    }
    println!("{} blobs checked against the store", blobs.len());

    // No lease held by dead state: nothing open in a finished epoch, nothing leased past its
    // lease (plus slack for the driver's tick), nothing open on a released miner, and every
    // miner (the killed one restarted) active.
    none(
        db,
        "open hops or samples in finished epochs",
        "SELECT (SELECT count(*) FROM tasks t WHERE t.epoch < (SELECT epoch FROM runs)
                   AND t.status IN ('pending', 'leased'))
              + (SELECT count(*) FROM samples s WHERE s.epoch < (SELECT epoch FROM runs)
                   AND s.status IN ('forward', 'backward'))",
        seed,
    )
    .await;
    soon_none(db, "leases past their end", LAPSED_LEASES, seed).await;
    soon_none(
        db,
        "open hops of released miners",
        "SELECT count(*) FROM tasks t JOIN miners m ON m.run_id = t.run_id AND m.hotkey = t.miner
           WHERE m.status = 'released' AND t.status IN ('pending', 'leased')",
        seed,
    )
    .await;
    soon_none(
        db,
        "miners not active at the end (the killed one must have rejoined)",
        &format!("SELECT {MINERS} - count(*) FROM miners WHERE status = 'active'"),
        seed,
    )
    .await;
}

async fn validator_invariants(db: &PgPool, head: u64, seed: u64) {
    // Every finished epoch scored once, none skipped.
    let scored: Vec<i64> = sqlx::query_scalar("SELECT epoch FROM scored_epochs ORDER BY epoch")
        .fetch_all(db)
        .await
        .expect("scored");
    let expect: Vec<i64> = (0..scored.len() as i64).collect();
    assert_eq!(
        scored, expect,
        "scored epochs consecutive from 0; seed {seed}"
    );
    assert!(scored.len() as u64 >= EPOCHS);
    none(
        db,
        "scored epochs without scores",
        "SELECT count(*) FROM scored_epochs e WHERE NOT EXISTS
           (SELECT 1 FROM scores s WHERE s.run_id = e.run_id AND s.epoch = e.epoch)",
        seed,
    )
    .await;
    none(
        db,
        "scores, checks or effects of epochs never recorded as scored",
        "SELECT (SELECT count(*) FROM scores s WHERE NOT EXISTS (SELECT 1 FROM scored_epochs e
                   WHERE e.run_id = s.run_id AND e.epoch = s.epoch))
              + (SELECT count(*) FROM spot_checks s WHERE NOT EXISTS (SELECT 1 FROM scored_epochs e
                   WHERE e.run_id = s.run_id AND e.epoch = s.epoch))
              + (SELECT count(*) FROM clasp_effects s WHERE NOT EXISTS (SELECT 1 FROM scored_epochs e
                   WHERE e.run_id = s.run_id AND e.epoch = s.epoch))",
        seed,
    )
    .await;
    // Every weight submission comes from committed scores and was settled one way or another.
    none(
        db,
        "weight submissions without committed scores",
        "SELECT count(*) FROM weight_submissions w WHERE NOT EXISTS (SELECT 1 FROM scored_epochs e
           WHERE e.run_id = w.run_id AND e.epoch = w.epoch)
           OR cardinality(w.uids) <> cardinality(w.weights) OR cardinality(w.uids) = 0",
        seed,
    )
    .await;
    // The validator is still running: read submissions and commits from one snapshot, so that
    // a step it takes between two reads cannot look like a broken invariant.
    let mut snapshot = db.begin().await.expect("transaction");
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *snapshot)
        .await
        .expect("isolation");
    let states: Vec<(i64, String, Option<i64>, Option<String>)> =
        sqlx::query_as("SELECT id, state, block, commit_hash FROM weight_submissions ORDER BY id")
            .fetch_all(&mut *snapshot)
            .await
            .expect("submissions");
    println!("weight submissions: {states:?}");
    let newest = states.iter().map(|(id, ..)| *id).max();
    let pending: BTreeSet<String> = sqlx::query_scalar("SELECT hash FROM pending_commits")
        .fetch_all(&mut *snapshot)
        .await
        .expect("pending commits")
        .into_iter()
        .collect();
    snapshot.rollback().await.expect("end of snapshot");
    for (id, state, block, hash) in &states {
        match state.as_str() {
            "set" | "revealed" => assert!(block.is_some(), "submission {id} without block"),
            // A commit still waiting must be in the commit store (so it gets revealed), and
            // its reveal window (the next tempo) must not have passed.
            "committed" => {
                let hash = hash.as_deref().unwrap_or_default();
                assert!(
                    pending.contains(hash),
                    "submission {id} committed but its salt is gone; seed {seed}"
                );
                let block = block.unwrap_or_default() as u64;
                assert!(
                    head < block + 2 * u64::from(TEMPO) + 2,
                    "submission {id} committed at block {block} and still unrevealed at {head}; \
                     seed {seed}"
                );
            }
            "failed" => {}
            // The validator is still running and submits on every tempo: the newest submission
            // may be in flight now. Any older one left pending was lost.
            "pending" if Some(*id) == newest => {}
            other => panic!("submission {id} left in state {other:?}; seed {seed}"),
        }
    }
    assert!(
        states
            .iter()
            .any(|(_, s, _, _)| s == "revealed" || s == "set"),
        "no weights landed; seed {seed}"
    );
    // Every pending commit belongs to a submission still waiting for its reveal (or to the one
    // in flight, whose commit may be stored before its state says so).
    for hash in &pending {
        assert!(
            states.iter().any(|(id, s, _, h)| {
                h.as_deref() == Some(hash.as_str())
                    && (s == "committed" || (s == "pending" && Some(*id) == newest))
            }),
            "pending commit {hash} without a committed submission; seed {seed}"
        );
    }
}

/// Regression: `iota validator run` started while its orchestrator was down (restarting) exited
/// with a network error instead of waiting for it, as the miner does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validator_waits_for_an_orchestrator_that_is_down() {
    let (net, _chain, netuid) = subnet().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let wallets = dir.path().join("wallets");
    wallet(&wallets, "validator", VALIDATOR_SEED);
    let db = fresh_db().await;
    // Nothing listens there.
    let base = format!("http://127.0.0.1:{}", free_port());
    let mut validator = Service::new(
        "validator",
        [
            "validator",
            "run",
            "--wallet.path",
            wallets.to_str().expect("utf-8 path"),
            "--wallet.name",
            "validator",
            "--wallet.hotkey",
            "default",
            "--subtensor.chain_endpoint",
            &net.ws_url(),
            "--netuid",
            &netuid.to_string(),
            "--orchestrator.url",
            &base,
            "--database.url",
            &db,
        ]
        .map(s)
        .to_vec(),
        dir.path(),
    );
    validator.start();
    let log = dir.path().join("validator.0.log");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("orchestrator unreachable")
    {
        validator.assert_running(0);
        assert!(Instant::now() < deadline, "{}", validator.log_tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    validator.assert_running(0);
    // SIGTERM while waiting: a clean exit.
    let mut child = validator.child.take().expect("running");
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let mut exit = None;
    for _ in 0..100 {
        if let Ok(Some(e)) = child.try_wait() {
            exit = Some(e);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let exit = exit.unwrap_or_else(|| {
        let _ = child.kill();
        panic!("no exit after SIGTERM")
    });
    assert!(exit.success(), "exit status {exit}");
    net.stop().await;
}
