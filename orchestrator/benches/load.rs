//! Load benchmark of the orchestrator on loopback, against a real PostgreSQL (`DATABASE_URL`,
//! e.g. from `scripts/pg.sh start`) and a localnet subnet with 1,000 registered miners (on its
//! own runtime, as a node is its own process, making a block every 12 s as finney does, so the
//! orchestrator reads the metagraph again at that pace):
//!
//! * signed work polls (`POST /v1/miner/work`, the request every miner sends in a loop) per
//!   second with p50/p99 latency, next to an unsigned no-op (`GET /v1/noop`) as the ceiling, with
//!   the same client concurrency (one closed loop per miner, or each miner polling once per
//!   `IOTA_BENCH_POLL_INTERVAL_MS` as idle miners do), alternating in one run; each poll signed
//!   in two ways, in windows of their own: with the miner's session (a MAC, what `ApiClient`
//!   sends; each miner opens its session after it joins) and with its own sr25519 signature;
//! * then the target, in three rounds: each runs another closed-loop no-op window, then offers
//!   each kind of signed poll in turn half the median of every no-op window so far (the
//!   ceiling), each miner
//!   polling on a fixed schedule, with the rate served and the latency counted from when each
//!   poll was due (so a client or server that falls behind shows as latency, and so does the up
//!   to a millisecond by which tokio's timer wakes a paced loop late); then the no-op at the
//!   rounds' mean pace, for reference;
//! * CPU time per request of each route: the orchestrator's threads, the client's, the
//!   localnet's and PostgreSQL's (from Linux's `schedstat`), which a shared machine's other load
//!   moves less than the request rates;
//! * what else the machine did in each closed-loop window and each half-ceiling round: cores busy
//!   in all (`/proc/stat`), steal, this process's and PostgreSQL's threads waiting for a core,
//!   and how late a thread that sleeps a millisecond at a time woke (a pause of the whole machine
//!   shows there); and the cores each side kept busy in each closed-loop window (a route whose
//!   closed loops leave cores idle is held back by something other than CPU);
//! * activation upload and download MB/s through the orchestrator (local directory store; the
//!   uploads read back five times, the median round reported);
//! * microseconds per signature verified one by one and through the batched verifier;
//! * the CPU of the orchestrator's metagraph refresh at a new block (the subnet's members), next
//!   to a full metagraph read.
//!
//! `cargo bench -p iota-orchestrator --bench load`. Client and server share this machine, so both
//! figures include the client's own HTTP cost. What a signed poll's figure includes: the server's
//! whole work (body buffering, sr25519 verification, metagraph and rate-limit checks, the replay
//! caches, the poll view or the poll's SQL, the JSON answer) and the client's HTTP request and
//! answer. It leaves out the client's signing: each miner's polls are signed before the window
//! (all stamped a few seconds ahead, inside the server's accepted clock window, each with its own
//! uuid), since a real miner signs on its own machine. The run prints how many were pre-signed
//! and how many had to be signed inside the window (when a miner's pool ran out).
//! `IOTA_BENCH_SIGN_IN_LOOP=1` signs every poll inside the loop, as the client's cost was counted
//! before. A miner whose poll is leased work stops polling for the rest of the window (a real
//! miner computes its hops instead); the run prints how many did. In closed loops a route's
//! latency is about miners / throughput (Little's law), the no-op's included: the latency target
//! is read at half the ceiling, and at a fleet's idle pace (`IOTA_BENCH_POLL_INTERVAL_MS=1000`).
//! `IOTA_BENCH_DB_CONNECTIONS` sets the orchestrator's pool (32, the CLI's default).
//! `IOTA_BENCH_SERVER_THREADS` and `IOTA_BENCH_CLIENT_THREADS` set the worker threads of the
//! orchestrator's runtime and of the miners' (one per core each, as the `iota` binary's runtime).
//! `IOTA_BENCH_TIMELINE=1` prints each paced window's p99 and worst latency per quarter second,
//! with the worst lateness over 3 ms of the sleeping thread (`os`) and of a task sleeping a
//! millisecond at a time on the orchestrator's runtime (`srv`) and on the client's (`cli`).
//! `IOTA_BENCH_LOG` takes a tracing filter (`iota_chain=debug` logs each metagraph read, with the
//! seconds since start that the timeline prints too). `IOTA_BENCH_BLOCK_MS` (12,000) and
//! `IOTA_BENCH_REFRESH_S` (5) set the chain's block time and how often the orchestrator checks
//! for a new block: a read at every second shows what a refresh costs the rounds.
//! The process uses the `iota` binary's allocator.

use iota_testkit::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::StreamExt;
use iota_chain::calls::Hyperparam;
use iota_chain::{ConnectOptions, Subtensor};
use iota_localnet::{Localnet, LocalnetConfig};
use iota_orchestrator::signatures::SignatureVerifier;
use iota_orchestrator::{Config, Limits, StoreConfig};
use iota_protocol::api::{Capacity, RunConfig, WorkRequest};
use iota_protocol::session::{ClientSession, HEADER_SESSION_MAC};
use iota_protocol::signing::{
    HEADER_SIGNATURE, HEADER_UUID, RequestSigner, SignedMessage, SkewWindow, authenticate_request,
    check_request,
};
use iota_protocol::tensor::{WireEncoding, encode_boundary_i8};
use iota_protocol::{ApiClient, BlobDescriptor, RetryPolicy};
use rand::{Rng, SeedableRng};
use reqwest::Method;
use sp_core::Pair as _;
use sp_core::sr25519;

// The allocator of the `iota` binary, which serves the orchestrator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MINERS: usize = 1000;
/// Miners on stage 0 that move activations in the transfer part.
const MOVERS: usize = 4;
/// Times the uploaded activations are read back (the median is reported).
const DOWNLOAD_ROUNDS: usize = 5;
const WARMUP: Duration = Duration::from_secs(2);
const WINDOW: Duration = Duration::from_secs(8);
const ROUNDS: usize = 3;
/// Rounds of the half-ceiling measurement (each a closed-loop no-op window, then the signed poll
/// paced at half the median of every such window so far).
const HALF_ROUNDS: usize = 3;

fn miner_pair(i: usize) -> sr25519::Pair {
    let mut seed = [0xb5u8; 32];
    seed[..8].copy_from_slice(&(i as u64).to_le_bytes());
    sr25519::Pair::from_seed(&seed)
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `name`'s value, or `default` when it is unset or not a number.
fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Worker threads of the orchestrator's runtime and of the miners' (the client's): one per core
/// each, as the `iota` binary's runtime has (`#[tokio::main]`), so that on any machine both sides
/// may use all of it, as they do on a 2-core one. `IOTA_BENCH_SERVER_THREADS` and
/// `IOTA_BENCH_CLIENT_THREADS` set others (2 and 2 is how this bench ran before on any machine).
static RUNTIME_THREADS: std::sync::LazyLock<(usize, usize)> = std::sync::LazyLock::new(|| {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    (
        env_or("IOTA_BENCH_SERVER_THREADS", cores).max(1) as usize,
        env_or("IOTA_BENCH_CLIENT_THREADS", cores).max(1) as usize,
    )
});

/// Medians over alternating reads of what the orchestrator's metagraph watcher reads at each new
/// block (the subnet's members) and of the full metagraph: (orchestrator CPU, node CPU, wall),
/// in milliseconds. Run on the server's runtime, so the client's decoding counts as the
/// orchestrator's.
struct RefreshCosts {
    reads: usize,
    uids: usize,
    members: (f64, f64, f64),
    metagraph: (f64, f64, f64),
}

async fn refresh_costs(url: String, netuid: u16) -> anyhow::Result<RefreshCosts> {
    const READS: usize = 10;
    let chain = Subtensor::connect(ConnectOptions::new(url)).await?;
    let at = chain.at_finalized().await?;
    // Warm: the first read of a block fetches and decodes its runtime's metadata.
    let uids = chain.metagraph_at(&at, netuid).await?.neurons.len();
    let mut members = Vec::new();
    let mut metagraph = Vec::new();
    for _ in 0..READS {
        for full in [false, true] {
            let (before, started) = (CpuSnapshot::now(), Instant::now());
            if full {
                chain.metagraph_at(&at, netuid).await?;
            } else {
                chain.members_at(&at, netuid).await?;
            }
            let wall = started.elapsed().as_secs_f64() * 1e3;
            let Some(cpu) = CpuSnapshot::now().zip(before).map(|(a, b)| a.since(&b)) else {
                bail!("thread CPU times cannot be read");
            };
            let ms = |ns: u64| ns as f64 / 1e6;
            let sample = (ms(cpu.server_ns), ms(cpu.chain_ns), wall);
            if full { &mut metagraph } else { &mut members }.push(sample);
        }
    }
    let medians = |v: &[(f64, f64, f64)]| {
        (
            median(&v.iter().map(|s| s.0).collect::<Vec<_>>()),
            median(&v.iter().map(|s| s.1).collect::<Vec<_>>()),
            median(&v.iter().map(|s| s.2).collect::<Vec<_>>()),
        )
    };
    Ok(RefreshCosts {
        reads: READS,
        uids,
        members: medians(&members),
        metagraph: medians(&metagraph),
    })
}

/// Boundary tensors of a small real model's size: 8 sequences of 1,024 tokens of width 2,048,
/// int8 on the wire (16 MiB plus per-row scales).
fn run_config() -> RunConfig {
    RunConfig {
        name: "load".into(),
        model: "sim".into(),
        stages: 3,
        stage_params: vec![4000, 3000, 5000],
        partitions: 4,
        micro_batch: 8,
        seq_len: 1024,
        boundary_dim: 2048,
        wire: WireEncoding::Int8,
        samples_per_epoch: (MOVERS * 4) as u64,
        max_in_flight: 4,
        training_s: 3600,
        uploading_s: 60,
        merging_s: 60,
        merge_round_s: 30,
        lease_s: 3600,
        heartbeat_timeout_s: 3600,
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

/// A localnet subnet with every miner's hotkey registered by Alice.
async fn chain(
    runtime: &tokio::runtime::Handle,
    pairs: &[sr25519::Pair],
) -> anyhow::Result<(Localnet, u16)> {
    // On its own runtime, as a chain node is its own process: its RPC answers (a metagraph read
    // of 1,000 uids is milliseconds of work) must not hold up the client's miner loops.
    // A block for each registration, then one every 12 s as on finney: the orchestrator reads
    // the metagraph again at each new block.
    let mut config = LocalnetConfig::instant();
    config.chain.block_time = Some(Duration::from_millis(env_or("IOTA_BENCH_BLOCK_MS", 12_000)));
    let net = runtime.spawn(Localnet::spawn(config)).await??;
    let mut opts = ConnectOptions::new(net.ws_url());
    opts.connect_timeout = Duration::from_secs(20);
    let chain = Subtensor::connect(opts).await?;
    // Room for every miner, at the smallest burn (one registration per block is the default,
    // and the instant localnet makes a block per transaction).
    let started = Instant::now();
    let hotkeys: Vec<_> = pairs.iter().map(common::public).collect();
    let netuid = common::register_subnet(&chain, &hotkeys, &[Hyperparam::MaxBurn(500_000)]).await;
    eprintln!(
        "registered the subnet and {} hotkeys in {:.1} s",
        pairs.len(),
        started.elapsed().as_secs_f64()
    );
    Ok((net, netuid))
}

struct Window {
    requests: usize,
    errors: usize,
    /// Signed requests whose signing fell inside the loop (the pre-signed pool ran out).
    signed_in_loop: usize,
    /// Failed requests by HTTP status (0: no answer).
    error_statuses: std::collections::BTreeMap<u16, usize>,
    /// Most requests one miner sent, warm-up included.
    busiest_miner: usize,
    /// Miners that were leased work (and stopped polling).
    got_work: usize,
    latencies_us: Vec<u32>,
    /// CPU spent over the measured window, by side.
    cpu: Option<CpuSplit>,
    /// What else the machine did over the measured window.
    machine: Option<Interference>,
    /// Signature batches the orchestrator verified over the measured window: how many, and how
    /// many signatures in all.
    batches: Option<(f64, f64)>,
}

impl Window {
    /// How the window's signatures were batched.
    fn batching(&self) -> String {
        match self.batches {
            Some((count, signatures)) if count > 0.0 => format!(
                "{count:.0} signature batches, {:.1} signatures each on average",
                signatures / count
            ),
            _ => "signature batches unknown".to_owned(),
        }
    }

    fn rps(&self) -> f64 {
        self.requests as f64 / WINDOW.as_secs_f64()
    }

    fn percentile_ms(&self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let i = ((self.latencies_us.len() - 1) as f64 * p).round() as usize;
        f64::from(self.latencies_us[i]) / 1000.0
    }
}

/// One round of the half-ceiling measurement.
struct Half {
    /// The no-op's closed-loop rate in the window just before, requests per second.
    just_before: f64,
    /// The no-op's closed-loop rate in the window just after (the next round's window before).
    after: f64,
    /// The median of every closed-loop no-op window so far, that one included.
    ceiling: f64,
    /// Half of it: the rate the signed poll was offered.
    offered: f64,
    /// Each polling miner's interval.
    every: Duration,
    /// Fewest polls one miner had pre-signed.
    fewest: usize,
    signed: Window,
}

impl Half {
    /// What the signed poll served, as a percentage of what it was offered.
    fn served_pct(&self) -> f64 {
        100.0 * self.signed.rps() / self.offered
    }

    /// What the signed poll was offered, as a percentage of the no-op's rate around the round
    /// (the mean of the windows just before and just after): above 50 when the machine slowed
    /// between the windows that set the rate and the round.
    fn offered_of_around_pct(&self) -> f64 {
        200.0 * self.offered / (self.just_before + self.after)
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    Noop,
    /// Each poll with its own sr25519 signature.
    SignedPoll,
    /// Each poll with a MAC under its miner's session key (see `iota_protocol::session`).
    SessionPoll,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Noop => "no-op",
            Kind::SignedPoll => "signed poll (sr25519)",
            Kind::SessionPoll => "signed poll (session)",
        }
    }
}

/// Headers of one signed work poll.
type Headers = reqwest::header::HeaderMap;

const WORK_PATH: &str = "/v1/miner/work";

fn work_body() -> Vec<u8> {
    serde_json::to_vec(&WorkRequest { max_items: 1 }).unwrap_or_default()
}

/// A work poll's headers, with a fresh uuid: in `session` if given, otherwise signed with
/// sr25519.
fn poll_headers(
    pair: &sr25519::Pair,
    session: Option<&ClientSession>,
    orchestrator: &str,
    body: &[u8],
    timestamp_ms: u64,
) -> iota_protocol::signing::SignedHeaders {
    authenticate_request(
        pair,
        session,
        orchestrator,
        "POST",
        WORK_PATH,
        body,
        timestamp_ms,
        uuid::Uuid::new_v4(),
    )
}

fn sign_poll(
    pair: &sr25519::Pair,
    session: Option<&ClientSession>,
    orchestrator: &str,
    body: &[u8],
    timestamp_ms: u64,
) -> Headers {
    let signed = poll_headers(pair, session, orchestrator, body, timestamp_ms);
    let mut headers = Headers::with_capacity(signed.headers.len() + 1);
    headers.insert(
        reqwest::header::CONTENT_TYPE,
        reqwest::header::HeaderValue::from_static("application/json"),
    );
    for (name, value) in signed.headers {
        if let Ok(value) = reqwest::header::HeaderValue::from_str(&value) {
            headers.insert(name, value);
        }
    }
    headers
}

// Built at compile time: the loop inserts them into every signed request.
const UUID_HEADER: reqwest::header::HeaderName =
    reqwest::header::HeaderName::from_static(HEADER_UUID);
const SIGNATURE_HEADER: reqwest::header::HeaderName =
    reqwest::header::HeaderName::from_static(HEADER_SIGNATURE);
const SESSION_MAC_HEADER: reqwest::header::HeaderName =
    reqwest::header::HeaderName::from_static(HEADER_SESSION_MAC);

/// A header value that lives as long as the process: handing it to a request copies a pointer,
/// with no reference count to touch.
fn static_value(value: &[u8]) -> Option<reqwest::header::HeaderValue> {
    let value: &'static [u8] = Box::leak(value.to_vec().into_boxed_slice());
    reqwest::header::HeaderValue::from_maybe_shared(Bytes::from_static(value)).ok()
}

/// One miner's polls signed ahead, parsed when signed (as a miner's own machine would). Only a
/// poll's uuid and signature (or session MAC) differ from its neighbours' (one timestamp covers
/// the window): those two are kept per poll, slices of one buffer; the rest once per miner, in
/// memory that lives as
/// long as the process (a few hundred bytes a miner each window). The loop builds each request's
/// headers from values already parsed. Kept whole, each poll held six values and their
/// bookkeeping (about 750 bytes, a window's pools about 300 MB, each read once, cold), and in a
/// profile taking them apart was the largest item of the client's extra cost for a signed poll.
#[derive(Default)]
struct Presigned {
    /// Content type, version, timestamp, signer and receiver (and session).
    fixed: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
    /// Each poll's uuid and signature (or MAC).
    polls: Vec<Option<[reqwest::header::HeaderValue; 2]>>,
    /// The header the second of each poll's pair goes in.
    proof: Option<reqwest::header::HeaderName>,
    next: usize,
}

/// A [`Presigned`] being filled.
#[derive(Default)]
struct Signing {
    fixed: Vec<(&'static str, String)>,
    values: Vec<u8>,
    /// Each poll's uuid and signature (or MAC): their spans in `values`.
    polls: Vec<[(usize, usize); 2]>,
    session: bool,
}

impl Signing {
    fn sign(
        &mut self,
        pair: &sr25519::Pair,
        session: Option<&ClientSession>,
        orchestrator: &str,
        body: &[u8],
        timestamp_ms: u64,
    ) {
        let signed = poll_headers(pair, session, orchestrator, body, timestamp_ms);
        self.session = session.is_some();
        let mut spans = [(0, 0); 2];
        let mut fixed = Vec::new();
        for (name, value) in signed.headers {
            let slot = match name {
                HEADER_UUID => 0,
                HEADER_SIGNATURE | HEADER_SESSION_MAC => 1,
                _ => {
                    fixed.push((name, value));
                    continue;
                }
            };
            let start = self.values.len();
            self.values.extend_from_slice(value.as_bytes());
            spans[slot] = (start, self.values.len());
        }
        // Every poll of a pool shares these; a pool signed across two stamps would not.
        debug_assert!(self.fixed.is_empty() || self.fixed == fixed);
        self.fixed = fixed;
        self.polls.push(spans);
    }

    fn done(self) -> Presigned {
        let values = Bytes::from(self.values);
        let mut fixed = vec![(
            reqwest::header::CONTENT_TYPE,
            reqwest::header::HeaderValue::from_static("application/json"),
        )];
        fixed.extend(self.fixed.iter().filter_map(|(name, value)| {
            Some((
                reqwest::header::HeaderName::from_static(name),
                static_value(value.as_bytes())?,
            ))
        }));
        let value = |(start, end): (usize, usize)| {
            reqwest::header::HeaderValue::from_maybe_shared(values.slice(start..end)).ok()
        };
        let polls = self
            .polls
            .into_iter()
            .map(|[uuid, signature]| Some([value(uuid)?, value(signature)?]))
            .collect();
        Presigned {
            fixed,
            polls,
            proof: Some(match self.session {
                true => SESSION_MAC_HEADER,
                false => SIGNATURE_HEADER,
            }),
            next: 0,
        }
    }
}

impl Presigned {
    fn len(&self) -> usize {
        self.polls.len()
    }

    /// The next poll's headers, or `None` when all are used.
    fn next_headers(&mut self) -> Option<Headers> {
        let [uuid, proof] = self.polls.get_mut(self.next)?.take()?;
        self.next += 1;
        let mut headers = Headers::with_capacity(self.fixed.len() + 2);
        for (name, value) in &self.fixed {
            headers.insert(name.clone(), value.clone());
        }
        headers.insert(UUID_HEADER, uuid);
        headers.insert(self.proof.clone().unwrap_or(SIGNATURE_HEADER), proof);
        Some(headers)
    }
}

/// How far ahead of the signing clock pre-signed polls are stamped. The server takes timestamps
/// up to 5 s ahead and 10 s old, so one stamp covers a 2 s warm-up and an 8 s window as long as
/// signing ends within this lead.
const PRESIGN_LEAD_MS: u64 = 4_900;
/// Longest the pre-signing may take (inside the lead, with room for the last round and for
/// parsing the headers). At 3.5 s the pools fell short once the signed window passed about
/// 35,000 polls a second.
const PRESIGN_BUDGET: Duration = Duration::from_millis(4_000);

/// Signing that ends this close to the lead leaves stamps the server refuses as too old before
/// the window ends.
const PRESIGN_LATE_MS: u64 = PRESIGN_LEAD_MS - 300;

/// `presign_once`, signed again (up to twice) when it ended too late for its stamps to last the
/// window: on a 16-core machine one pre-signing ran 5.3 s against its 4 s budget, and the server
/// rightly refused the last 0.8 s of that window's polls as stale (401).
fn presign(
    pairs: &[Arc<sr25519::Pair>],
    sessions: Option<&[ClientSession]>,
    orchestrator: &str,
    per_miner: usize,
) -> (Vec<Presigned>, usize, f64) {
    let mut tries = 1;
    loop {
        let (pools, fewest, secs) = presign_once(pairs, sessions, orchestrator, per_miner);
        if secs * 1000.0 < PRESIGN_LATE_MS as f64 || tries == 3 {
            if tries > 1 {
                eprintln!(
                    "pre-signing ended late and was redone: {tries} tries, the last {secs:.1} s"
                );
            }
            return (pools, fewest, secs);
        }
        tries += 1;
    }
}

/// Signs up to `per_miner` polls for every miner (in its session, with `sessions`), on every
/// client thread, all stamped `PRESIGN_LEAD_MS` ahead of now, stopping at `PRESIGN_BUDGET`.
/// Returns the pools, the fewest polls one miner got and the seconds it took.
fn presign_once(
    pairs: &[Arc<sr25519::Pair>],
    sessions: Option<&[ClientSession]>,
    orchestrator: &str,
    per_miner: usize,
) -> (Vec<Presigned>, usize, f64) {
    let started = Instant::now();
    let deadline = started + PRESIGN_BUDGET;
    let stamp = now_ms() + PRESIGN_LEAD_MS;
    let body = work_body();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let size = pairs.len().div_ceil(threads).max(1);
    // Each thread signs its miners in rounds of a few polls each, so that the pools stay even
    // when the budget ends the signing early.
    const ROUND: usize = 4;
    let pools = std::thread::scope(|scope| {
        let workers: Vec<_> = pairs
            .chunks(size)
            .enumerate()
            .map(|(c, chunk)| {
                let body = &body;
                // This chunk's miners' sessions.
                let sessions = sessions.map(|s| &s[(c * size).min(s.len())..]);
                scope.spawn(move || {
                    let mut pools: Vec<Signing> =
                        chunk.iter().map(|_| Signing::default()).collect();
                    let mut signed = 0;
                    while signed < per_miner && Instant::now() < deadline {
                        let n = ROUND.min(per_miner - signed);
                        for (i, (pool, pair)) in pools.iter_mut().zip(chunk).enumerate() {
                            let session = sessions.and_then(|s| s.get(i));
                            for _ in 0..n {
                                pool.sign(pair, session, orchestrator, body, stamp);
                            }
                        }
                        signed += n;
                    }
                    pools.into_iter().map(Signing::done).collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect::<Vec<_>>()
    });
    let fewest = pools.iter().map(Presigned::len).min().unwrap_or(0);
    (pools, fewest, started.elapsed().as_secs_f64())
}

/// One loop per miner for `WARMUP + WINDOW`; counts requests that start after the warm-up and
/// end inside the window. With a zero `interval` each loop is closed (the next request as soon
/// as the last answer came); otherwise each miner polls once per `interval`, as an idle miner
/// does; a paced poll's latency runs from when it was due, not from when the loop got to send
/// it, so a client that falls behind shows as latency. A signed loop takes its headers from
/// `presigned[miner]` while it lasts and signs in the loop after that (counted in
/// `signed_in_loop`).
#[allow(clippy::too_many_arguments)]
async fn miner_loops(
    kind: Kind,
    interval: Duration,
    http: &reqwest::Client,
    base: &str,
    orchestrator: &str,
    pairs: &[Arc<sr25519::Pair>],
    sessions: &[ClientSession],
    presigned: Vec<Presigned>,
) -> Window {
    eprintln!("{} window", kind.name());
    let start = Instant::now();
    let measure_from = start + WARMUP;
    let end = measure_from + WINDOW;
    // Static: a shared body's reference count is one cache line that every request of both
    // client threads would write twice.
    let body: &'static [u8] = Box::leak(work_body().into_boxed_slice());
    let body = Bytes::from_static(body);
    let mut presigned = presigned.into_iter();
    // Parsed once: both routes build their requests the same way.
    let work_url = reqwest::Url::parse(&format!("{base}{WORK_PATH}")).expect("work URL");
    let noop_url = reqwest::Url::parse(&format!("{base}/v1/noop")).expect("no-op URL");
    let loops = pairs.iter().enumerate().map(|(i, pair)| {
        let http = http.clone();
        let body = body.clone();
        let pair = pair.clone();
        let session = match kind {
            Kind::SessionPoll => sessions.get(i).cloned(),
            _ => None,
        };
        let orchestrator = orchestrator.to_owned();
        let mut pool = presigned.next().unwrap_or_default();
        let (work_url, noop_url) = (work_url.clone(), noop_url.clone());
        async move {
            let mut ok = 0usize;
            let mut errors = std::collections::BTreeMap::new();
            let mut signed_in_loop = 0usize;
            let mut got_work = false;
            let mut sent = 0usize;
            // (milliseconds into the window when the poll was due or sent, latency in us)
            let mut latencies = Vec::new();
            // Paced miners start spread over one interval, then poll once per interval.
            let mut next =
                start + interval.mul_f64(rand::rngs::StdRng::from_entropy().gen_range(0.0..1.0));
            loop {
                let t0 = if interval.is_zero() {
                    Instant::now()
                } else {
                    tokio::time::sleep_until(next.into()).await;
                    next += interval;
                    next - interval
                };
                if t0 >= end {
                    break;
                }
                let req = match kind {
                    Kind::Noop => reqwest::Request::new(Method::GET, noop_url.clone()),
                    Kind::SignedPoll | Kind::SessionPoll => {
                        let headers = pool.next_headers().unwrap_or_else(|| {
                            signed_in_loop += 1;
                            sign_poll(
                                pair.as_ref(),
                                session.as_ref(),
                                &orchestrator,
                                &body,
                                now_ms(),
                            )
                        });
                        let mut req = reqwest::Request::new(Method::POST, work_url.clone());
                        *req.headers_mut() = headers;
                        *req.body_mut() = Some(body.clone().into());
                        req
                    }
                };
                sent += 1;
                let (good, status, leased) = match http.execute(req).await {
                    Ok(resp) => {
                        let status = resp.status();
                        let body = resp.bytes().await;
                        // `WorkResponse` serialises `items` first: anything but an empty list
                        // is work leased to this miner.
                        let leased = kind != Kind::Noop
                            && body
                                .as_ref()
                                .is_ok_and(|b| !b.starts_with(br#"{"items":[]"#));
                        (body.is_ok() && status.is_success(), status.as_u16(), leased)
                    }
                    Err(_) => (false, 0, false),
                };
                let t1 = Instant::now();
                if t0 >= measure_from && t1 <= end {
                    if good {
                        ok += 1;
                        let us = (t1 - t0).as_micros().min(u128::from(u32::MAX)) as u32;
                        latencies.push(((t0 - measure_from).as_millis() as u32, us));
                    } else {
                        *errors.entry(status).or_insert(0usize) += 1;
                    }
                }
                // A miner given work computes it (seconds of a real stage's forward or backward)
                // instead of polling again; these do nothing with it for the rest of the window.
                // Polling on in a closed loop while holding a lease would be a client no real
                // miner is: every such poll re-reads its leases from the database.
                if good && leased {
                    got_work = true;
                    break;
                }
            }
            (ok, errors, signed_in_loop, sent, latencies, got_work)
        }
    });
    let (scrape, metrics_url) = (http.clone(), format!("{base}/metrics"));
    let cpu = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        // Scraped before the CPU snapshot, so that rendering the metrics is not counted.
        let batches_before = signature_batches(&scrape, &metrics_url).await;
        let (before, machine_before) = (CpuSnapshot::now(), MachineSnapshot::now());
        tokio::time::sleep_until(end.into()).await;
        let cpu = CpuSnapshot::now()
            .zip(before)
            .map(|(after, before)| after.since(&before));
        let machine = MachineSnapshot::now()
            .zip(machine_before)
            .zip(cpu)
            .map(|((after, before), cpu)| after.since(&before, &cpu, WINDOW));
        let batches = signature_batches(&scrape, &metrics_url)
            .await
            .zip(batches_before)
            .map(|(after, before)| (after.0 - before.0, after.1 - before.1));
        (cpu, machine, batches)
    });
    // Each loop is a task of the client runtime, beside its connection's task (a loop polled by
    // the bench's own thread handed every request and answer across threads).
    let results: Vec<_> = futures::future::join_all(loops.map(tokio::spawn))
        .await
        .into_iter()
        .filter_map(Result::ok)
        .collect();
    let mut w = Window {
        requests: 0,
        errors: 0,
        signed_in_loop: 0,
        error_statuses: Default::default(),
        busiest_miner: 0,
        got_work: 0,
        latencies_us: Vec::new(),
        cpu: None,
        machine: None,
        batches: None,
    };
    if let Ok((cpu, machine, batches)) = cpu.await {
        (w.cpu, w.machine, w.batches) = (cpu, machine, batches);
    }
    let mut timeline = Vec::new();
    for (ok, errors, signed_in_loop, sent, lat, got_work) in results {
        w.requests += ok;
        w.got_work += usize::from(got_work);
        w.errors += errors.values().sum::<usize>();
        for (status, n) in errors {
            *w.error_statuses.entry(status).or_insert(0) += n;
        }
        w.signed_in_loop += signed_in_loop;
        w.busiest_miner = w.busiest_miner.max(sent);
        w.latencies_us.extend(lat.iter().map(|&(_, us)| us));
        timeline.extend(lat);
    }
    w.latencies_us.sort_unstable();
    if *TIMELINE && !interval.is_zero() {
        print_timeline(kind, &mut timeline, measure_from);
    }
    w
}

/// The orchestrator's signature batches so far (how many, and their signatures in all), from
/// its own metrics.
async fn signature_batches(http: &reqwest::Client, url: &str) -> Option<(f64, f64)> {
    let text = http.get(url).send().await.ok()?.text().await.ok()?;
    let value = |suffix: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("iota_signature_batch_size_{suffix} ")))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    Some((value("count").unwrap_or(0.0), value("sum").unwrap_or(0.0)))
}

/// Prints a paced window's latency per quarter second (p99 and worst, from when each poll was
/// due): a tail made of a few stalls looks different from a machine that is short of CPU
/// throughout.
fn print_timeline(kind: Kind, timeline: &mut [(u32, u32)], measure_from: Instant) {
    timeline.sort_unstable();
    let late = std::mem::take(&mut *LATE_WAKES.lock().unwrap_or_else(|e| e.into_inner()));
    let mut line = format!(" (from {:.1} s)", (measure_from - *STARTED).as_secs_f64());
    for bucket in timeline.chunk_by(|a, b| a.0 / 250 == b.0 / 250) {
        let mut us: Vec<u32> = bucket.iter().map(|&(_, us)| us).collect();
        us.sort_unstable();
        let p99 = us[(us.len() - 1) * 99 / 100];
        let worst = us[us.len() - 1];
        line += &format!(" {}:{}/{}", bucket[0].0 / 250, p99 / 1000, worst / 1000);
        let from = measure_from + Duration::from_millis(u64::from(bucket[0].0 / 250 * 250));
        for (name, source) in [("os", 0u8), ("srv", 1), ("cli", 2)] {
            let worst = late
                .iter()
                .filter(|w| w.0 == source && w.1 >= from && w.1 < from + Duration::from_millis(250))
                .map(|w| w.2)
                .max();
            if let Some(worst) = worst {
                line += &format!("[{name}{}]", worst / 1000);
            }
        }
    }
    eprintln!("{kind:?} window, p99/worst ms per 250 ms:{line}");
}

/// CPU time in nanoseconds (Linux's `schedstat`) of the orchestrator's threads (its runtime is
/// named `orchestrator`, blocking threads included, and its metrics upkeep thread), the localnet
/// chain's (runtime `localnet`), the client's (every other thread of this process) and
/// PostgreSQL's processes.
#[derive(Clone, Copy, Default)]
struct CpuSplit {
    server_ns: u64,
    client_ns: u64,
    chain_ns: u64,
    postgres_ns: u64,
    /// Time all these threads spent ready to run with no core to run them (`schedstat`'s
    /// second field).
    waiting_ns: u64,
}

impl CpuSplit {
    fn total_ns(&self) -> u64 {
        self.server_ns + self.client_ns + self.chain_ns + self.postgres_ns
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Server,
    Chain,
    Client,
}

/// Nanoseconds on a core and waiting for one, from `schedstat`.
type Times = (u64, u64);

/// CPU time of each thread of this process (by thread id, with whether it is the server's) and
/// of each PostgreSQL process (by pid), and their time waiting for a core: threads come and go
/// (idle blocking threads exit), so a window's CPU is summed per thread.
#[derive(Default)]
struct CpuSnapshot {
    threads: std::collections::HashMap<String, (Side, Times)>,
    postgres: std::collections::HashMap<String, Times>,
}

impl CpuSnapshot {
    fn now() -> Option<Self> {
        let mut snap = Self::default();
        for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
            let path = task.path();
            let Some(times) = schedstat(&path) else {
                continue; // exited meanwhile
            };
            let name = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
            let id = task.file_name().to_string_lossy().into_owned();
            let side = match name.trim_end() {
                // Neither side's: it measures the machine.
                "stall-probe" => continue,
                "orchestrator" | "metrics-upkeep" => Side::Server,
                "localnet" => Side::Chain,
                _ => Side::Client,
            };
            snap.threads.insert(id, (side, times));
        }
        for proc in std::fs::read_dir("/proc").ok()?.flatten() {
            let path = proc.path();
            let id = proc.file_name().to_string_lossy().into_owned();
            if id.bytes().all(|b| b.is_ascii_digit())
                && std::fs::read_to_string(path.join("comm"))
                    .is_ok_and(|c| c.trim_end() == "postgres")
                && let Some(times) = schedstat(&path)
            {
                snap.postgres.insert(id, times);
            }
        }
        Some(snap)
    }

    /// CPU spent between `before` and this snapshot (threads and processes that ended meanwhile
    /// are missing, with what they spent since `before`).
    fn since(&self, before: &Self) -> CpuSplit {
        let mut split = CpuSplit::default();
        let since = |now: Times, then: Option<Times>| {
            let then = then.unwrap_or_default();
            (now.0.saturating_sub(then.0), now.1.saturating_sub(then.1))
        };
        for (id, (side, times)) in &self.threads {
            let (ran, waited) = since(*times, before.threads.get(id).map(|t| t.1));
            *match side {
                Side::Server => &mut split.server_ns,
                Side::Chain => &mut split.chain_ns,
                Side::Client => &mut split.client_ns,
            } += ran;
            split.waiting_ns += waited;
        }
        for (id, times) in &self.postgres {
            let (ran, waited) = since(*times, before.postgres.get(id).copied());
            split.postgres_ns += ran;
            split.waiting_ns += waited;
        }
        split
    }
}

/// Worst lateness, in microseconds, of [`stall_probe`]'s wake-ups since it was last read.
static PROBE_WORST_US: AtomicU64 = AtomicU64::new(0);
/// Wake-ups of [`stall_probe`] more than [`PROBE_LATE`] late since last read.
static PROBE_LATE_WAKES: AtomicU64 = AtomicU64::new(0);
const PROBE_LATE: Duration = Duration::from_millis(10);

/// A thread that sleeps a millisecond at a time and records how late it wakes. It is runnable
/// for a few microseconds per wake-up, so the scheduler lets it in soon even with every core
/// busy; waking tens of milliseconds late means nothing of this machine ran (a hypervisor
/// pause) or something outside this benchmark held the cores.
fn stall_probe() {
    const NAP: Duration = Duration::from_millis(1);
    loop {
        let slept = Instant::now();
        std::thread::sleep(NAP);
        let late = slept.elapsed().saturating_sub(NAP);
        note_late(0, late);
        PROBE_WORST_US.fetch_max(late.as_micros() as u64, Ordering::Relaxed);
        if late > PROBE_LATE {
            PROBE_LATE_WAKES.fetch_add(1, Ordering::Relaxed);
        }
    }
}

static STARTED: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);
/// Wake-ups more than 3 ms late: (0 OS thread, 1 server runtime, 2 client runtime; when; us).
static LATE_WAKES: std::sync::Mutex<Vec<(u8, Instant, u32)>> = std::sync::Mutex::new(Vec::new());

/// Whether `IOTA_BENCH_TIMELINE=1`.
static TIMELINE: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var("IOTA_BENCH_TIMELINE").is_ok_and(|v| v == "1"));

fn note_late(source: u8, late: Duration) {
    if *TIMELINE && late > Duration::from_millis(3) {
        LATE_WAKES.lock().unwrap_or_else(|e| e.into_inner()).push((
            source,
            Instant::now(),
            late.as_micros() as u32,
        ));
    }
}

/// A task that sleeps a millisecond at a time on a runtime and notes how late it wakes.
async fn runtime_probe(source: u8) {
    const NAP: Duration = Duration::from_millis(1);
    loop {
        let slept = Instant::now();
        tokio::time::sleep(NAP).await;
        // Tokio's timer rounds up to the next millisecond.
        note_late(source, slept.elapsed().saturating_sub(2 * NAP));
    }
}

/// What the machine did besides this benchmark's own work, over a window.
#[derive(Clone, Copy)]
struct Interference {
    /// Cores busy, all processes (from `/proc/stat`, steal excluded).
    busy_cores: f64,
    /// Cores the hypervisor gave to other guests while this one wanted them (`steal`).
    steal_cores: f64,
    /// This process's and PostgreSQL's threads (the probe's not) waiting on a run queue, on
    /// average: above zero when a thread was ready and no core ran it.
    waiting_threads: f64,
    /// The probe's worst wake-up lateness, and how many wake-ups were late by over
    /// [`PROBE_LATE`].
    probe_worst: Duration,
    probe_late_wakes: u64,
}

/// `/proc/stat`'s machine totals and the probe's record since the last snapshot (which it
/// resets).
struct MachineSnapshot {
    /// (busy, steal, all) ticks.
    ticks: (u64, u64, u64),
    probe_worst_us: u64,
    probe_late_wakes: u64,
}

impl MachineSnapshot {
    fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        // cpu  user nice system idle iowait irq softirq steal guest guest_nice
        let fields: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        let all: u64 = fields.iter().take(8).sum();
        let (idle, steal) = (fields[3] + fields[4], *fields.get(7)?);
        Some(Self {
            ticks: (all - idle - steal, steal, all),
            probe_worst_us: PROBE_WORST_US.swap(0, Ordering::Relaxed),
            probe_late_wakes: PROBE_LATE_WAKES.swap(0, Ordering::Relaxed),
        })
    }

    /// What happened since `before`, over a window of `window` in which this process's and
    /// PostgreSQL's threads waited `cpu.waiting_ns` for a core.
    fn since(&self, before: &Self, cpu: &CpuSplit, window: Duration) -> Interference {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let all = self.ticks.2.saturating_sub(before.ticks.2).max(1) as f64;
        let share = |now: u64, then: u64| now.saturating_sub(then) as f64 / all * cores;
        Interference {
            busy_cores: share(self.ticks.0, before.ticks.0),
            steal_cores: share(self.ticks.1, before.ticks.1),
            waiting_threads: cpu.waiting_ns as f64 / window.as_nanos().max(1) as f64,
            probe_worst: Duration::from_micros(self.probe_worst_us),
            probe_late_wakes: self.probe_late_wakes,
        }
    }
}

impl std::fmt::Display for Interference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "machine busy {:.2} cores, steal {:.2}; threads waiting for a core {:.2} on average; probe woke at worst {:.1} ms late, {} times over {} ms",
            self.busy_cores,
            self.steal_cores,
            self.waiting_threads,
            self.probe_worst.as_secs_f64() * 1e3,
            self.probe_late_wakes,
            PROBE_LATE.as_millis()
        )
    }
}

/// A thread's or process's time on a core and waiting for one (`schedstat`'s first two fields).
fn schedstat(path: &std::path::Path) -> Option<Times> {
    let stat = std::fs::read_to_string(path.join("schedstat")).ok()?;
    let mut fields = stat.split_whitespace().map(|f| f.parse::<u64>().ok());
    Some((fields.next()??, fields.next()??))
}

/// Whether curve25519-dalek can pick its AVX-512 IFMA backend on this processor (what it checks
/// by CPUID when `.cargo/config.toml` compiled that backend in).
fn has_ifma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512ifma")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// CPU time of every thread of this process so far, in nanoseconds (Linux's per-thread
/// `schedstat`), or `None` where that cannot be read.
fn process_cpu_ns() -> Option<u64> {
    let mut total = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

/// Cost of `f` per request: wall-clock and CPU microseconds (CPU time of all threads, so a
/// verifier that spreads batches over both cores is not counted as twice as cheap).
async fn measured<F: std::future::Future<Output = usize>>(n: f64, f: F) -> (usize, Cost) {
    let (wall, cpu) = (Instant::now(), process_cpu_ns());
    let ok = f.await;
    let cost = Cost {
        wall_us: wall.elapsed().as_secs_f64() * 1e6 / n,
        cpu_us: cpu
            .zip(process_cpu_ns())
            .map(|(a, b)| b.saturating_sub(a) as f64 / 1e3 / n),
    };
    (ok, cost)
}

/// Per signature: verified one by one, and through the orchestrator's batched verifier with
/// all requests waiting at once (as under load), first with every key new to it and then, with
/// other requests from the same keys, once it knows them (as when the same miners poll again
/// and again). The server is idle meanwhile (the windows are over).
async fn signature_costs(orchestrator: &str, pairs: &[Arc<sr25519::Pair>]) -> SignatureCosts {
    let now = now_ms();
    let body = work_body();
    let sign_all = || -> Vec<SignedMessage> {
        pairs
            .iter()
            .flat_map(|p| (0..4).map(move |_| p))
            .map(|p| {
                let headers = sign_poll(p, None, orchestrator, &body, now);
                check_request(
                    |name| headers.get(name).and_then(|v| v.to_str().ok()),
                    "POST",
                    WORK_PATH,
                    &body,
                    orchestrator,
                    now,
                    SkewWindow::default(),
                )
            })
            .collect::<Result<_, _>>()
            .unwrap_or_default()
    };
    let (first, again) = (sign_all(), sign_all());
    let n = first.len().max(1) as f64;
    let (alone, alone_cost) = measured(n, async {
        first
            .iter()
            .filter(|m| (*m).clone().verify().is_ok())
            .count()
    })
    .await;
    let verifier = SignatureVerifier::default();
    let mut batched = Vec::new();
    for messages in [first, again] {
        let (ok, cost) = measured(n, async {
            futures::future::join_all(messages.into_iter().map(|m| verifier.verify(m)))
                .await
                .into_iter()
                .filter(Result::is_ok)
                .count()
        })
        .await;
        if alone != ok || alone as f64 != n {
            eprintln!("signature check: {alone} verified alone, {ok} batched, of {n}");
        }
        batched.push(cost);
    }
    let known_keys = batched.pop().unwrap_or_default();
    let new_keys = batched.pop().unwrap_or_default();
    // Through the verifier one at a time, as at an idle fleet's pace (each request alone), keys
    // known. Signed before the clock starts, like the other sets.
    let lone_set = sign_all();
    let (lone_ok, lone) = measured(n, async {
        let mut ok = 0;
        for m in lone_set {
            ok += usize::from(verifier.verify(m).await.is_ok());
        }
        ok
    })
    .await;
    if lone_ok != alone {
        eprintln!(
            "signature check: {alone} verified alone, {lone_ok} through the verifier one at a time"
        );
    }
    SignatureCosts {
        requests: n as usize,
        alone: alone_cost,
        new_keys,
        known_keys,
        lone,
    }
}

/// Microseconds per request.
#[derive(Clone, Copy, Default)]
struct Cost {
    wall_us: f64,
    cpu_us: Option<f64>,
}

impl std::fmt::Display for Cost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.cpu_us {
            Some(cpu) => write!(f, "{cpu:.1} us CPU ({:.1} us wall)", self.wall_us),
            None => write!(f, "{:.1} us wall (CPU time unavailable)", self.wall_us),
        }
    }
}

/// What [`signature_costs`] measured.
struct SignatureCosts {
    requests: usize,
    alone: Cost,
    new_keys: Cost,
    known_keys: Cost,
    lone: Cost,
}

fn boundary(run: &RunConfig) -> Bytes {
    let shape = run.boundary_shape();
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let values: Vec<i8> = (0..shape.iter().product::<u64>())
        .map(|_| rng.gen_range(-127..=127))
        .collect();
    let scales: Vec<f32> = (0..shape[0] * shape[1])
        .map(|_| rng.gen_range(0.001..0.01))
        .collect();
    Bytes::from(encode_boundary_i8(shape, &values, &scales))
}

async fn bench(
    server: tokio::runtime::Handle,
    localnet: tokio::runtime::Handle,
) -> anyhow::Result<()> {
    let Ok(_) = std::env::var("DATABASE_URL") else {
        bail!("DATABASE_URL is not set: eval \"$(scripts/pg.sh start)\" first");
    };
    let pairs: Vec<sr25519::Pair> = (0..MINERS).map(miner_pair).collect();
    let (net, netuid) = chain(&localnet, &pairs).await?;
    let refresh = server.spawn(refresh_costs(net.ws_url(), netuid)).await??;
    let db = common::fresh_db().await;
    let store = tempfile::tempdir()?;
    let run = run_config();
    let orchestrator_key = common::pair(200).ss58();
    let config = Config {
        database_url: db,
        // The CLI's default pool; IOTA_BENCH_DB_CONNECTIONS tries others.
        db_max_connections: std::env::var("IOTA_BENCH_DB_CONNECTIONS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(32),
        store: StoreConfig::Local(store.path().into()),
        chain_endpoint: net.ws_url(),
        chain_timeout: std::time::Duration::from_secs(30),
        trusted_proxies: Vec::new(),
        netuid,
        hotkey: orchestrator_key.clone(),
        run: run.clone(),
        // IOTA_BENCH_REFRESH_S and IOTA_BENCH_BLOCK_MS make the reads more frequent.
        metagraph_refresh: Duration::from_secs(env_or("IOTA_BENCH_REFRESH_S", 5)),
        skew: SkewWindow::default(),
        limits: Limits {
            per_hotkey_rps: 10_000,
            per_hotkey_burst: 10_000,
            per_ip_rps: 10_000_000,
            per_ip_burst: 10_000_000,
            ..Limits::default()
        },
        tick: Duration::from_millis(500),
        max_merge_rounds: 2,
        dataset: None,
    };
    // The orchestrator runs on its own runtime, as it would in its own process.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let base = format!("http://{}", listener.local_addr()?);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let served = server.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        iota_orchestrator::run(config, listener, async {
            let _ = stop_rx.await;
        })
        .await
        .map_err(anyhow::Error::from)
    });
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(MINERS)
        .timeout(Duration::from_secs(30))
        .build()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !http
        .get(format!("{base}/healthz"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        if served.is_finished() || Instant::now() > deadline {
            bail!("the orchestrator did not start: {:?}", served.await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Every miner joins (the metagraph watcher sees the registrations at start-up).
    let started = Instant::now();
    let pairs: Vec<Arc<sr25519::Pair>> = pairs.into_iter().map(Arc::new).collect();
    let sigs = signature_costs(&orchestrator_key, &pairs).await;
    let joined: Vec<(usize, u32, ClientSession)> = futures::stream::iter(pairs.iter().enumerate())
        .map(|(i, pair)| {
            let base = base.clone();
            let key = orchestrator_key.clone();
            let signer: Arc<dyn RequestSigner> = pair.clone();
            async move {
                let client =
                    ApiClient::new(base, signer, key, RetryPolicy::default())?.with_sessions(false);
                let r = client
                    .register(Capacity {
                        device: "sim".into(),
                        memory_bytes: 64 << 30,
                        tokens_per_s: 100.0,
                    })
                    .await?;
                // Each miner's session for the session-signed windows.
                let session = client.open_session().await?;
                anyhow::Ok((i, r.stage, session))
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    let per_stage: Vec<usize> = (0..run.stages)
        .map(|s| joined.iter().filter(|(_, st, _)| *st == s).count())
        .collect();
    let mut sessions: Vec<Option<ClientSession>> = vec![None; MINERS];
    for (i, _, session) in &joined {
        sessions[*i] = Some(session.clone());
    }
    let sessions: Vec<ClientSession> = sessions
        .into_iter()
        .collect::<Option<_>>()
        .context("a miner without a session")?;
    eprintln!(
        "{MINERS} miners joined in {:.1} s; per stage {per_stage:?}",
        started.elapsed().as_secs_f64()
    );

    // Activations: stage-0 miners lease the epoch's samples, upload one boundary tensor per hop
    // through the orchestrator, and read them back.
    let bytes = boundary(&run);
    let movers: Vec<ApiClient> = joined
        .iter()
        .filter(|(_, s, _)| *s == 0)
        .take(MOVERS)
        .map(|(i, _, _)| {
            let signer: Arc<dyn RequestSigner> = pairs[*i].clone();
            ApiClient::new(
                base.clone(),
                signer,
                orchestrator_key.clone(),
                RetryPolicy::default(),
            )
        })
        .collect::<Result<_, _>>()?;
    let upload_start = Instant::now();
    let uploaded: Vec<Vec<BlobDescriptor>> = futures::future::join_all(movers.iter().map(|m| {
        let bytes = bytes.clone();
        async move {
            let mut blobs = Vec::new();
            for item in m.work(4).await?.items {
                blobs.push(
                    m.upload_output(item.task_id, item.lease, bytes.clone())
                        .await?
                        .blob,
                );
            }
            anyhow::Ok(blobs)
        }
    }))
    .await
    .into_iter()
    .collect::<Result<_, _>>()?;
    let upload_s = upload_start.elapsed().as_secs_f64();
    let n_up: usize = uploaded.iter().map(Vec::len).sum();
    if n_up == 0 {
        bail!("no hop was leased to upload to");
    }
    // Read back DOWNLOAD_ROUNDS times: one round takes about a quarter of a second on 2 cores,
    // too short for one round to tell two builds apart.
    let mb = bytes.len() as f64 / 1e6;
    let mut download_rates = Vec::with_capacity(DOWNLOAD_ROUNDS);
    let mut n_down = 0;
    for _ in 0..DOWNLOAD_ROUNDS {
        let download_start = Instant::now();
        let downloaded: Vec<usize> =
            futures::future::join_all(movers.iter().zip(&uploaded).map(|(m, blobs)| async move {
                for blob in blobs {
                    m.download(blob).await?;
                }
                anyhow::Ok(blobs.len())
            }))
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        n_down = downloaded.iter().sum();
        download_rates.push(n_down as f64 * mb / download_start.elapsed().as_secs_f64());
    }

    // Polls: the same 1,000 loops against the no-op and the signed work route, alternating.
    // IOTA_BENCH_POLL_INTERVAL_MS paces each miner (0, the default: closed loops).
    let interval = Duration::from_millis(
        std::env::var("IOTA_BENCH_POLL_INTERVAL_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );
    // Signed polls are signed before their window (see `presign`), as many per miner as the
    // busiest miner sent in the no-op window before (an upper bound: a signed poll is never
    // cheaper than the no-op), within what the client can sign in PRESIGN_BUDGET.
    // IOTA_BENCH_SIGN_IN_LOOP=1 signs every poll inside the loop instead.
    let sign_in_loop = std::env::var("IOTA_BENCH_SIGN_IN_LOOP").is_ok_and(|v| v == "1");
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let run_loops = |kind, every, pools| {
        miner_loops(
            kind,
            every,
            &http,
            &base,
            &orchestrator_key,
            &pairs,
            &sessions,
            pools,
        )
    };
    // The pools for `kind`'s window.
    let presign_for = |kind, per_miner| {
        let in_session = (kind == Kind::SessionPoll).then_some(&sessions[..]);
        presign(&pairs, in_session, &orchestrator_key, per_miner)
    };
    let mut noop = Vec::new();
    let mut signed = Vec::new();
    let mut in_session = Vec::new();
    let mut presigning = Vec::new();
    for _ in 0..ROUNDS {
        let n = run_loops(Kind::Noop, interval, Vec::new()).await;
        let per_miner = if sign_in_loop {
            0
        } else {
            n.busiest_miner + n.busiest_miner / 10 + 2
        };
        noop.push(n);
        for (kind, windows) in [
            (Kind::SignedPoll, &mut signed),
            (Kind::SessionPoll, &mut in_session),
        ] {
            let (pools, fewest, secs) = presign_for(kind, per_miner);
            presigning.push((kind, fewest, secs));
            windows.push(run_loops(kind, interval, pools).await);
        }
    }

    let mean = |ws: &[Window]| ws.iter().map(Window::rps).sum::<f64>() / ws.len() as f64;
    // The target: offered half the no-op's closed-loop rate on a fixed schedule, does the signed
    // poll serve all of it, and how fast? Each of HALF_ROUNDS rounds first runs another
    // closed-loop no-op window, then offers half the median of every no-op window so far. A
    // shared machine's speed moves under the run: one 8 s window ran 41% faster than the one
    // before it, and over a minute the machine slowed by 40%. The median keeps one fast or slow
    // window from setting the rate alone, and the window just before each round keeps the
    // ceiling current. The few miners leased work in the closed windows stop polling here too,
    // so the others' interval is set for the rate to hold without them.
    let polling = MINERS
        - signed
            .iter()
            .chain(&in_session)
            .map(|w| w.got_work)
            .max()
            .unwrap_or(0);
    let mut ceilings: Vec<f64> = noop.iter().map(Window::rps).collect();
    // Each round offers the session-signed poll half the ceiling, then the sr25519-signed one.
    let mut halves: Vec<Half> = Vec::new();
    let mut halves_signed: Vec<Half> = Vec::new();
    if interval.is_zero() {
        for _ in 0..HALF_ROUNDS {
            let just_before = run_loops(Kind::Noop, Duration::ZERO, Vec::new())
                .await
                .rps();
            ceilings.push(just_before);
            let ceiling = median(&ceilings);
            let offered = ceiling / 2.0;
            if offered <= 0.0 {
                break;
            }
            let every = Duration::from_secs_f64(polling as f64 / offered);
            let per_miner =
                ((WARMUP + WINDOW).as_secs_f64() / every.as_secs_f64()).ceil() as usize + 2;
            for (kind, rounds) in [
                (Kind::SessionPoll, &mut halves),
                (Kind::SignedPoll, &mut halves_signed),
            ] {
                let (pools, fewest, _) = presign_for(kind, per_miner);
                let signed = run_loops(kind, every, pools).await;
                if let Some(previous) = rounds.last_mut() {
                    previous.after = just_before;
                }
                rounds.push(Half {
                    just_before,
                    after: f64::NAN,
                    ceiling,
                    offered,
                    every,
                    fewest,
                    signed,
                });
            }
        }
        // The last round's window after: one more closed-loop no-op window.
        let after = run_loops(Kind::Noop, Duration::ZERO, Vec::new())
            .await
            .rps();
        for rounds in [&mut halves, &mut halves_signed] {
            if let Some(last) = rounds.last_mut() {
                last.after = after;
            }
        }
    }
    // The no-op at the rounds' mean pace, for reference: the HTTP path's own latency there.
    let noop_at_half = if halves.is_empty() {
        None
    } else {
        let offered = halves.iter().map(|h| h.offered).sum::<f64>() / halves.len() as f64;
        let every = Duration::from_secs_f64(polling as f64 / offered);
        Some((offered, run_loops(Kind::Noop, every, Vec::new()).await))
    };

    println!();
    let pacing = if interval.is_zero() {
        "closed loops".to_owned()
    } else {
        format!("each polling every {} ms", interval.as_millis())
    };
    let (server_threads, client_threads) = *RUNTIME_THREADS;
    println!(
        "orchestrator load, {MINERS} miners on loopback, {pacing}, {ROUNDS} alternating windows of {} s each; \
         worker threads: orchestrator {server_threads}, miners {client_threads}, on {threads} cores",
        WINDOW.as_secs()
    );
    println!(
        "{:<30} {:>10} {:>9} {:>9} {:>8}",
        "route", "req/s", "p50 ms", "p99 ms", "errors"
    );
    for (r, n) in noop.iter().enumerate() {
        for (name, w) in [
            ("GET /v1/noop (unsigned)", n),
            ("POST /v1/miner/work (sr25519)", &signed[r]),
            ("POST /v1/miner/work (session)", &in_session[r]),
        ] {
            println!(
                "{:<30} {:>10.0} {:>9.2} {:>9.2} {:>8}   (window {}){}",
                name,
                w.rps(),
                w.percentile_ms(0.50),
                w.percentile_ms(0.99),
                w.errors,
                r + 1,
                if w.errors > 0 {
                    format!(" errors by status {:?}", w.error_statuses)
                } else {
                    String::new()
                }
            );
        }
    }
    // The cores this benchmark's threads kept busy over a window.
    let busy = |w: &Window| {
        w.cpu.map_or("CPU time unavailable".to_owned(), |c| {
            let cores = |ns: u64| ns as f64 / WINDOW.as_secs_f64() / 1e9;
            format!(
                "{:.2} of {threads} cores (orchestrator {:.2}, client {:.2}, chain {:.2}, PostgreSQL {:.2})",
                cores(c.total_ns()),
                cores(c.server_ns),
                cores(c.client_ns),
                cores(c.chain_ns),
                cores(c.postgres_ns),
            )
        })
    };
    let windows = |r: usize| {
        [
            (Kind::SignedPoll, &signed[r]),
            (Kind::SessionPoll, &in_session[r]),
        ]
    };
    for (r, pre) in presigning.chunks(2).enumerate() {
        for ((kind, fewest, secs), (_, s)) in pre.iter().zip(windows(r)) {
            println!(
                "{} window {}: at least {fewest} polls per miner signed before it ({secs:.1} s on {threads} threads), {} signed inside it; {} miners were leased work and stopped polling; {}",
                kind.name(),
                r + 1,
                s.signed_in_loop,
                s.got_work,
                s.batching()
            );
        }
    }
    // Closed loops keep every core busy unless something other than CPU holds a route back.
    for (r, n) in noop.iter().enumerate() {
        for (kind, w) in [(Kind::Noop, n)].into_iter().chain(windows(r)) {
            println!(
                "window {}, {}: CPU busy {}{}",
                r + 1,
                kind.name(),
                busy(w),
                w.machine.map_or(String::new(), |m| format!("; {m}"))
            );
        }
    }
    // CPU per request over all windows of a route: less moved by other load on a shared
    // machine than the request rates are.
    let cpu_per_request = |ws: &[Window]| -> Option<[f64; 5]> {
        let requests: usize = ws.iter().map(|w| w.requests).sum();
        let mut sum = CpuSplit::default();
        for w in ws {
            let c = w.cpu?;
            sum.server_ns += c.server_ns;
            sum.client_ns += c.client_ns;
            sum.chain_ns += c.chain_ns;
            sum.postgres_ns += c.postgres_ns;
        }
        let per = |ns: u64| ns as f64 / 1e3 / requests.max(1) as f64;
        Some([
            per(sum.total_ns()),
            per(sum.server_ns),
            per(sum.client_ns),
            per(sum.chain_ns),
            per(sum.postgres_ns),
        ])
    };
    if let (Some(n), Some(s), Some(m)) = (
        cpu_per_request(&noop),
        cpu_per_request(&signed),
        cpu_per_request(&in_session),
    ) {
        for (kind, [total, server, client, chain, pg]) in [
            (Kind::Noop, n),
            (Kind::SignedPoll, s),
            (Kind::SessionPoll, m),
        ] {
            println!(
                "CPU per request, {}: {total:.1} us (server {server:.1}, client {client:.1}, chain {chain:.1}, PostgreSQL {pg:.1})",
                kind.name()
            );
        }
        println!(
            "no-op / signed poll CPU per request: sr25519 {:.1}%, session {:.1}%",
            100.0 * n[0] / s[0],
            100.0 * n[0] / m[0]
        );
    }
    for (kind, windows) in [
        (Kind::SignedPoll, &signed),
        (Kind::SessionPoll, &in_session),
    ] {
        let worst_p99 = windows
            .iter()
            .map(|w| w.percentile_ms(0.99))
            .fold(0.0f64, f64::max);
        println!(
            "{} / no-op ceiling: {:.1}% (target >= 50%); worst p99 {:.2} ms{}",
            kind.name(),
            100.0 * mean(windows) / mean(&noop),
            worst_p99,
            if interval.is_zero() {
                " (closed loops: about miners / throughput)"
            } else {
                " (target < 50 ms)"
            }
        );
    }
    for (kind, halves) in [
        (Kind::SessionPoll, &halves),
        (Kind::SignedPoll, &halves_signed),
    ] {
        if halves.is_empty() {
            continue;
        }
        println!();
        println!(
            "{} at half the no-op ceiling, {} rounds: each a closed-loop no-op window, then {polling} miners offered half the median of every no-op window so far as polls on a fixed schedule (latency from when each poll was due), windows of {} s, the session-signed round first; \"of around\": offered as a share of the mean of the no-op windows just before and just after the round",
            kind.name(),
            halves.len(),
            WINDOW.as_secs()
        );
        println!(
            "{:<6} {:>11} {:>9} {:>9} {:>11} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9} {:>7}",
            "round",
            "no-op just",
            "median",
            "offered",
            "no-op after",
            "of around",
            "served",
            "served",
            "every",
            "p50 ms",
            "p99 ms",
            "errors"
        );
        for (r, h) in halves.iter().enumerate() {
            println!(
                "{:<6} {:>11.0} {:>9.0} {:>9.0} {:>11.0} {:>8.1}% {:>9.0} {:>7.1}% {:>5.1} ms {:>9.2} {:>9.2} {:>7}",
                r + 1,
                h.just_before,
                h.ceiling,
                h.offered,
                h.after,
                h.offered_of_around_pct(),
                h.signed.rps(),
                h.served_pct(),
                h.every.as_secs_f64() * 1e3,
                h.signed.percentile_ms(0.50),
                h.signed.percentile_ms(0.99),
                h.signed.errors
            );
        }
        // Polls due in the window's last moments finish after it and are not counted: served
        // trails offered by about the latency over the window even when nothing falls behind.
        let p99s: Vec<f64> = halves
            .iter()
            .map(|h| h.signed.percentile_ms(0.99))
            .collect();
        let held = p99s.iter().filter(|&&p99| p99 < 50.0).count();
        let worst = p99s.iter().copied().fold(0.0f64, f64::max);
        let served: Vec<f64> = halves.iter().map(Half::served_pct).collect();
        let fewest = halves.iter().map(|h| h.fewest).min().unwrap_or(0);
        let signed_in_loop: usize = halves.iter().map(|h| h.signed.signed_in_loop).sum();
        println!(
            "{} at half the ceiling: p99 < 50 ms in {held} of {} rounds (worst p99 {worst:.2} ms; target < 50 ms); served {:.1}-{:.1}% of offered; at least {fewest} polls per miner pre-signed, {signed_in_loop} signed inside the windows",
            kind.name(),
            halves.len(),
            served.iter().copied().fold(f64::INFINITY, f64::min),
            served.iter().copied().fold(0.0f64, f64::max),
        );
        // How busy the machine was: near all of its cores, queueing alone makes the latency.
        for (r, h) in halves.iter().enumerate() {
            println!(
                "round {}, {} at half the ceiling: CPU busy {}; {}",
                r + 1,
                kind.name(),
                busy(&h.signed),
                h.signed.batching()
            );
            if let Some(machine) = h.signed.machine {
                println!("round {}: {machine}", r + 1);
            }
        }
    }
    if let Some((offered, n)) = &noop_at_half {
        println!(
            "GET /v1/noop (unsigned) offered the rounds' mean, {offered:.0} req/s: served {:.0}, p50 {:.2} ms, p99 {:.2} ms, {} errors; CPU busy {}",
            n.rps(),
            n.percentile_ms(0.50),
            n.percentile_ms(0.99),
            n.errors,
            busy(n)
        );
    }
    println!(
        "signature verification per request ({} requests): one by one (schnorrkel) {}; through the verifier one at a time {}; batched, every key new {}; batched, known keys {}; processor has AVX-512 IFMA (the verifier's fastest backend): {}",
        sigs.requests,
        sigs.alone,
        sigs.lone,
        sigs.new_keys,
        sigs.known_keys,
        if has_ifma() { "yes" } else { "no" }
    );
    println!(
        "caller-check refresh at a new block, {} uids (medians of {} reads each, alternating, before the windows): the members the watcher reads {:.1} ms of orchestrator CPU, {:.1} ms of the node's, {:.1} ms wall; the full metagraph {:.1}, {:.1} and {:.1} ms",
        refresh.uids,
        refresh.reads,
        refresh.members.0,
        refresh.members.1,
        refresh.members.2,
        refresh.metagraph.0,
        refresh.metagraph.1,
        refresh.metagraph.2,
    );
    println!(
        "activation upload:   {n_up} x {mb:.1} MB in {upload_s:.2} s = {:.0} MB/s ({MOVERS} miners at once, through the orchestrator)",
        n_up as f64 * mb / upload_s
    );
    let first = download_rates[0];
    let mut sorted = download_rates.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "activation download: {n_down} x {mb:.1} MB, {DOWNLOAD_ROUNDS} rounds: median {:.0} MB/s, first {first:.0}, range {:.0}-{:.0} ({MOVERS} miners at once, GET /v1/blobs, hash checked)",
        sorted[sorted.len() / 2],
        sorted[0],
        sorted[sorted.len() - 1],
    );

    // How the server batched its work over the whole run (the orchestrator's own metrics).
    if let Ok(text) = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await
    {
        for name in ["iota_signature_batch_size", "iota_replay_batch_size"] {
            let value = |suffix: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(&format!("{name}_{suffix} ")))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            };
            if let (Some(sum), Some(count)) = (value("sum"), value("count")) {
                println!(
                    "{name}: {count:.0} batches, {:.1} per batch on average",
                    sum / count.max(1.0)
                );
            }
        }
    }
    let _ = stop_tx.send(());
    served.await??;
    net.stop().await;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let _ = *STARTED;
    if let Ok(filter) = std::env::var("IOTA_BENCH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_timer(tracing_subscriber::fmt::time::uptime())
            .with_writer(std::io::stderr)
            .init();
    }
    std::thread::Builder::new()
        .name("stall-probe".into())
        .spawn(stall_probe)?;
    let (server_threads, client_threads) = *RUNTIME_THREADS;
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(server_threads)
        .thread_name("orchestrator")
        .enable_all()
        .build()?;
    let clients = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(client_threads)
        .thread_name("miners")
        .enable_all()
        .build()?;
    let localnet = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("localnet")
        .enable_all()
        .build()?;
    if *TIMELINE {
        server.spawn(runtime_probe(1));
        clients.spawn(runtime_probe(2));
    }
    clients.block_on(bench(server.handle().clone(), localnet.handle().clone()))
}
