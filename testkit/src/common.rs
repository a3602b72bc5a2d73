//! The orchestrator's side of a test: a fresh PostgreSQL database per test
//! (on the server `DATABASE_URL` names; `scripts/test.sh` starts one), a localnet chain with a
//! subnet and registered hotkeys, and orchestrators started in-process on port 0.

use std::sync::Arc;
use std::time::Duration;

use iota_chain::calls::Hyperparam;
use iota_chain::wallet::{Keypair, PublicKey};
use iota_chain::{ConnectOptions, Subtensor, TxOptions};
use iota_devnet::{PermitWait, SubnetPlan, bootstrap};
use iota_localnet::{Localnet, LocalnetConfig};
use iota_orchestrator::{Config, Limits, StoreConfig};
use iota_protocol::api::{Capacity, RegisterRequest, RegisterResponse, RunConfig};
use iota_protocol::signing::{RequestSigner, SkewWindow};
use iota_protocol::tensor::WireEncoding;
use iota_protocol::{ApiClient, ApiError, ErrorCode, RetryPolicy};
use sp_core::Pair as _;
use sp_core::sr25519;

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// Flips the last byte of the object stored at `path` (a local store's file): its size and
/// layout stay, its hash no longer matches what was committed.
pub fn corrupt_stored(path: &std::path::Path) {
    let mut bytes = std::fs::read(path).expect("stored object");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(path, &bytes).expect("corrupt it");
}

/// The S3-protocol store `scripts/test.sh` starts (moto, `scripts/s3.sh`) and exports.
pub fn s3_store() -> iota_orchestrator::StoreConfig {
    let endpoint = std::env::var("IOTA_TEST_S3_ENDPOINT").expect(
        "IOTA_TEST_S3_ENDPOINT is not set: run the tests through scripts/test.sh, which starts an \
         S3-protocol server (or eval \"$(scripts/s3.sh start)\")",
    );
    iota_orchestrator::StoreConfig::S3 {
        bucket: std::env::var("IOTA_TEST_S3_BUCKET").unwrap_or_else(|_| "iota-test".into()),
        endpoint: Some(endpoint),
        region: Some(std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into())),
        // Short, so that an ended epoch's objects are collected within a test's time (no sooner
        // than twice this after it ended); long enough for a test's uploads.
        presign_ttl: std::time::Duration::from_secs(10),
        part_bytes: iota_orchestrator::store::DEFAULT_PART_BYTES,
    }
}

/// A new, empty database on the test server. Fails (never skips) without `DATABASE_URL`.
pub async fn fresh_db() -> String {
    let base = std::env::var("DATABASE_URL").expect(
        "DATABASE_URL is not set: run the tests through scripts/test.sh, which starts PostgreSQL",
    );
    let name = format!("iota_test_{}", uuid::Uuid::new_v4().simple());
    iota_devnet::create_database(&base, &name)
        .await
        .expect("create a test database on DATABASE_URL's server")
}

pub fn pair(seed: u8) -> sr25519::Pair {
    sr25519::Pair::from_seed(&[seed; 32])
}

pub fn signer(seed: u8) -> Arc<dyn RequestSigner> {
    Arc::new(pair(seed))
}

pub fn public(p: &sr25519::Pair) -> PublicKey {
    PublicKey::from_bytes(p.public().0)
}

/// A development account of the localnet (Alice is its sudo key).
pub fn dev(name: &str) -> Keypair {
    Keypair::from_private_key(&iota_localnet::dev_pair(name).to_raw_vec()).expect("dev key")
}

/// Sets each of `settings` on the chain's subnet, as sudo.
pub async fn set_hyperparams(chain: &Chain, settings: impl IntoIterator<Item = Hyperparam>) {
    for setting in settings {
        chain
            .chain
            .set_hyperparam(&dev("Alice"), chain.netuid, setting, true, &tx())
            .await
            .expect("hyperparameter");
    }
}

/// Seals a block every 100 ms, for ever: the localnet seals blocks on demand, and a
/// validator's draw waits for a new one, as it would on a real chain.
pub async fn keep_sealing(net: &Localnet) {
    loop {
        net.produce_blocks(1);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn tx() -> TxOptions {
    TxOptions {
        timeout: Duration::from_secs(30),
        ..TxOptions::default()
    }
}

/// A localnet with a started subnet whose registered hotkeys are `miners` and `validators`
/// (seeds); validators are staked and hold permits after the epoch this waits for.
pub struct Chain {
    pub net: Localnet,
    pub chain: Subtensor,
    pub netuid: u16,
}

/// A subnet on `chain`, registered and started by Alice with hotkey 250 as its owner, room for
/// 1,024 uids and `settings` applied, and `hotkeys` registered in order (uids 1, 2, …). Returns
/// its netuid.
pub async fn register_subnet(
    chain: &Subtensor,
    hotkeys: &[PublicKey],
    settings: &[Hyperparam],
) -> u16 {
    bootstrap(
        chain,
        &SubnetPlan {
            sudo: &dev("Alice"),
            owner: &public(&pair(250)),
            max_uids: 1024,
            settings,
            neurons: hotkeys,
            validators: &[],
            permits: PermitWait::Skip,
            tx: &tx(),
        },
    )
    .await
    .expect("subnet bootstrap")
}

pub async fn chain_with(miners: &[u8], validators: &[u8]) -> Chain {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("localnet");
    let mut opts = ConnectOptions::new(net.ws_url());
    opts.connect_timeout = Duration::from_secs(20);
    let chain = Subtensor::connect(opts).await.expect("connect");
    let keys = |seeds: &[u8]| -> Vec<PublicKey> {
        seeds.iter().map(|seed| public(&pair(*seed))).collect()
    };
    let hotkeys: Vec<PublicKey> = keys(miners).into_iter().chain(keys(validators)).collect();
    let netuid = bootstrap(
        &chain,
        &SubnetPlan {
            sudo: &dev("Alice"),
            owner: &public(&pair(250)),
            max_uids: 1024,
            settings: &[],
            neurons: &hotkeys,
            validators: &keys(validators),
            permits: PermitWait::Produce(&net),
            tx: &tx(),
        },
    )
    .await
    .expect("subnet bootstrap");
    Chain { net, chain, netuid }
}

/// Small shapes: 3 stages of a few thousand parameters, 4 partitions.
pub fn run_config(name: &str) -> RunConfig {
    RunConfig {
        name: name.into(),
        model: "sim".into(),
        stages: 3,
        stage_params: vec![4000, 3000, 5000],
        partitions: 4,
        micro_batch: 2,
        seq_len: 8,
        boundary_dim: 16,
        wire: WireEncoding::F32,
        samples_per_epoch: 12,
        max_in_flight: 4,
        training_s: 30,
        uploading_s: 20,
        merging_s: 20,
        merge_round_s: 10,
        lease_s: 5,
        heartbeat_timeout_s: 4,
        retention_epochs: 2,
        init_seed: 1,
        outer_lr: 0.7,
        outer_momentum: 0.9,
        inner_lr: 3e-3,
        inner_steps_every: 2,
        dataset: None,
        stage_memory: Vec::new(),
        sparse: None,
    }
}

pub fn config(chain: &Chain, db: &str, store: &std::path::Path, run: RunConfig) -> Config {
    config_for(
        &chain.net.ws_url(),
        chain.netuid,
        db,
        StoreConfig::Local(store.into()),
        run,
    )
}

/// [`config`] for a chain known by its endpoint (an orchestrator in another process).
pub fn config_for(
    chain_endpoint: &str,
    netuid: u16,
    db: &str,
    store: StoreConfig,
    run: RunConfig,
) -> Config {
    Config {
        database_url: db.into(),
        db_max_connections: 16,
        store,
        chain_endpoint: chain_endpoint.into(),
        chain_timeout: std::time::Duration::from_secs(30),
        trusted_proxies: Vec::new(),
        netuid,
        hotkey: pair(200).ss58(),
        run,
        metagraph_refresh: Duration::from_millis(200),
        skew: SkewWindow::default(),
        limits: Limits {
            per_hotkey_rps: 1000,
            per_hotkey_burst: 1000,
            per_ip_rps: 1000,
            per_ip_burst: 1000,
            ..Limits::default()
        },
        tick: Duration::from_millis(100),
        max_merge_rounds: 2,
        dataset: None,
    }
}

/// An orchestrator running in this process.
pub struct Running {
    pub base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<Result<(), iota_orchestrator::OrchestratorError>>>,
}

impl Running {
    /// What `run` returned when it stopped by itself, failing if it still serves after
    /// `timeout`.
    pub async fn exited(
        mut self,
        timeout: Duration,
    ) -> Result<(), iota_orchestrator::OrchestratorError> {
        let handle = self.handle.take().expect("running");
        tokio::time::timeout(timeout, handle)
            .await
            .expect("the orchestrator still serves")
            .expect("the orchestrator's task")
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.handle.take() {
            let _ = h.await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(h) = &self.handle {
            h.abort();
        }
    }
}

pub async fn start(config: Config) -> Running {
    start_on(config, "127.0.0.1:0").await
}

/// [`start`] on a given address (to restart an orchestrator where its clients expect it).
pub async fn start_on(config: Config, addr: &str) -> Running {
    let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let handle = tokio::spawn(iota_orchestrator::run(config, listener, async {
        let _ = rx.await;
    }));
    // Ready when the public API answers.
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = http.get(format!("{base}/healthz")).send().await
            && r.status().is_success()
        {
            break;
        }
        if handle.is_finished() {
            let out = handle.await;
            panic!("orchestrator exited at start: {out:?}");
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "orchestrator did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Running {
        base,
        stop: Some(tx),
        handle: Some(handle),
    }
}

/// Polls `check` until it returns `Some`, failing after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Files under `dir`, recursively.
/// The Prometheus text an orchestrator at `base` serves at `/metrics`.
pub async fn metrics_text(base: &str) -> String {
    reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text")
}

pub fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(entries) = std::fs::read_dir(&d) {
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    out.push(p);
                }
            }
        }
    }
    out
}

/// What the tests' miners report: a CPU, 1 GiB and 100 tokens/s.
pub fn cpu_capacity() -> Capacity {
    Capacity {
        device: "cpu".into(),
        memory_bytes: 1 << 30,
        tokens_per_s: 100.0,
    }
}

/// The body of a registration with [`cpu_capacity`], holding no epoch state: for requests
/// signed by hand.
pub fn register_body() -> Vec<u8> {
    serde_json::to_vec(&RegisterRequest {
        capacity: cpu_capacity(),
        holds_epoch_state: false,
    })
    .expect("json")
}

/// A client for the miner of `seed`, registered with [`cpu_capacity`].
pub async fn registered_miner(base: &str, seed: u8) -> (ApiClient, RegisterResponse) {
    let client = ApiClient::connect(base, signer(seed), RetryPolicy::default())
        .await
        .expect("connect");
    let joined = client.register(cpu_capacity()).await.expect("register");
    (client, joined)
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
}

/// Signed requests built by hand, to send what no well-behaved client would.
#[derive(Clone)]
pub struct Raw {
    pub http: reqwest::Client,
    pub base: String,
    pub receiver: String,
}

impl Raw {
    /// A sender to the orchestrator at `base` (hotkey `pair(200)`, as [`config`] sets).
    pub fn to(base: &str) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: base.into(),
            receiver: pair(200).ss58(),
        }
    }

    /// Sends `call`; the status and the answer's bytes.
    pub async fn send_bytes(&self, call: Call<'_>) -> (u16, Vec<u8>) {
        let (signed_method, signed_path) =
            call.signed_as.unwrap_or((call.method.as_str(), call.path));
        let headers = iota_protocol::signing::authenticate_request(
            call.signer,
            call.session,
            &self.receiver,
            signed_method,
            signed_path,
            &call.body,
            call.ts,
            call.uuid,
        );
        let mut req = self
            .http
            .request(call.method.clone(), format!("{}{}", self.base, call.path));
        for (k, v) in headers.headers {
            req = req.header(k, v);
        }
        let resp = req
            .header("content-type", "application/json")
            .body(call.body)
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        (status, resp.bytes().await.expect("body").to_vec())
    }

    /// [`Raw::send_bytes`], with the answer read as the API's error body (if it is one).
    pub async fn send(&self, call: Call<'_>) -> (u16, Option<ApiError>) {
        let (status, bytes) = self.send_bytes(call).await;
        (status, serde_json::from_slice(&bytes).ok())
    }

    /// A well-signed request (now, a fresh uuid).
    pub async fn signed(
        &self,
        signer: &dyn RequestSigner,
        method: reqwest::Method,
        path: &str,
        body: Vec<u8>,
    ) -> (u16, Option<ApiError>) {
        self.send(Call::new(signer, method, path, body)).await
    }
}

/// One request for [`Raw`]: by default signed for its own method and path, now, with a fresh
/// uuid; each field can be set to something a well-behaved client would not send.
pub struct Call<'a> {
    pub signer: &'a dyn RequestSigner,
    pub method: reqwest::Method,
    pub path: &'a str,
    pub body: Vec<u8>,
    /// The method and path the signature covers, if not the request's own.
    pub signed_as: Option<(&'a str, &'a str)>,
    pub ts: u64,
    pub uuid: uuid::Uuid,
    /// The session whose key makes the request's MAC, in place of `signer`'s signature
    /// (`signer` still names the sender).
    pub session: Option<&'a iota_protocol::session::ClientSession>,
}

impl<'a> Call<'a> {
    pub fn new(
        signer: &'a dyn RequestSigner,
        method: reqwest::Method,
        path: &'a str,
        body: Vec<u8>,
    ) -> Self {
        Self {
            signer,
            method,
            path,
            body,
            signed_as: None,
            ts: now_ms(),
            uuid: uuid::Uuid::new_v4(),
            session: None,
        }
    }
}

pub fn code(r: &(u16, Option<ApiError>)) -> Option<ErrorCode> {
    r.1.as_ref().map(|e| e.code)
}

/// A relay to the S3 server that holds back the first request whose line starts with
/// `marker`'s method and names its text (once set) until `release` is notified, as a slow store
/// write would; or, with `refuse` set, answers that request with a 403 itself, as a failing store
/// would; or, with `drop` set, closes its connection part-way through, unanswered, as a network
/// that fails mid-upload does.
pub struct SlowStore {
    /// The S3 store it was made for, reached through the relay.
    pub store: StoreConfig,
    /// (method, text): `("PUT", key fragment)`.
    pub marker: Arc<std::sync::Mutex<Option<(&'static str, String)>>>,
    pub held: Arc<tokio::sync::Notify>,
    pub release: Arc<tokio::sync::Notify>,
    /// Refuse the marked request instead of holding it.
    pub refuse: Arc<std::sync::atomic::AtomicBool>,
    /// Drop the marked request's connection instead of holding it.
    pub drop: Arc<std::sync::atomic::AtomicBool>,
    /// Whether the marked request came.
    pub tripped: Arc<std::sync::atomic::AtomicBool>,
    /// The request line of every request it relayed, or began to.
    pub requests: Arc<std::sync::Mutex<Vec<String>>>,
}

/// A relay in front of `store`, an S3 store with an endpoint.
pub async fn slow_store(store: &StoreConfig) -> SlowStore {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let StoreConfig::S3 {
        bucket,
        endpoint: Some(upstream),
        region,
        presign_ttl,
        part_bytes,
    } = store.clone()
    else {
        panic!("an S3 store with an endpoint");
    };
    let upstream = upstream
        .strip_prefix("http://")
        .expect("an http:// S3 endpoint")
        .trim_end_matches('/')
        .to_owned();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
    let marker: Arc<std::sync::Mutex<Option<(&'static str, String)>>> = Arc::default();
    let (held, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let tripped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let refuse = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let drop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let requests: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let (m, h, r, f, d, t, log) = (
        marker.clone(),
        held.clone(),
        release.clone(),
        refuse.clone(),
        drop.clone(),
        tripped.clone(),
        requests.clone(),
    );
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let (mut client_r, client_w) = client.into_split();
            let client_w = Arc::new(tokio::sync::Mutex::new(client_w));
            let (mut server_r, mut server_w) = server.into_split();
            let to_client = client_w.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n @ 1..) = server_r.read(&mut buf).await {
                    if to_client.lock().await.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = to_client.lock().await.shutdown().await;
            });
            let (m, h, r, f, d, tripped, log) = (
                m.clone(),
                h.clone(),
                r.clone(),
                f.clone(),
                d.clone(),
                t.clone(),
                log.clone(),
            );
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match client_r.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let text = String::from_utf8_lossy(&buf[..n]);
                    if let Some(line) = text.lines().next().filter(|l| {
                        l.ends_with(" HTTP/1.1")
                            && ["GET ", "PUT ", "POST ", "HEAD ", "DELETE "]
                                .iter()
                                .any(|m| l.starts_with(m))
                    }) {
                        log.lock().expect("log").push(line.to_owned());
                    }
                    let wanted =
                        m.lock()
                            .expect("marker")
                            .as_ref()
                            .is_some_and(|(method, mark)| {
                                text.strip_prefix(method)
                                    .is_some_and(|rest| rest.starts_with(' '))
                                    && text
                                        .lines()
                                        .next()
                                        .is_some_and(|l| l.contains(mark.as_str()))
                            });
                    if wanted && !tripped.swap(true, std::sync::atomic::Ordering::SeqCst) {
                        if d.load(std::sync::atomic::Ordering::SeqCst) {
                            // Half the bytes reach the store, then the connection goes. The
                            // client's side closes first: the store's answer to the cut request
                            // (a 400) must never reach the client, as it would not over a
                            // network that failed.
                            let _ = client_w.lock().await.shutdown().await;
                            let _ = server_w.write_all(&buf[..n / 2]).await;
                            let _ = server_w.shutdown().await;
                            break;
                        }
                        if f.load(std::sync::atomic::Ordering::SeqCst) {
                            let mut client_w = client_w.lock().await;
                            let _ = client_w
                                .write_all(
                                    b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                                )
                                .await;
                            let _ = client_w.shutdown().await;
                            break;
                        }
                        h.notify_one();
                        r.notified().await;
                    }
                    if server_w.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    SlowStore {
        store: StoreConfig::S3 {
            bucket,
            endpoint: Some(endpoint),
            region,
            presign_ttl,
            part_bytes,
        },
        marker,
        held,
        release,
        refuse,
        drop,
        tripped,
        requests,
    }
}
