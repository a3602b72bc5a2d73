//! Orchestrator memory while miners upload large pseudo-gradient partitions.
//!
//! 16 simulated miners of one stage train an epoch, then each uploads a pseudo-gradient partition
//! of `IOTA_BENCH_PARTITION_MB` (524 by default: a stage of 131M parameters in one partition),
//! all at once:
//! * through the orchestrator into a local directory store (the bytes stream through it to
//!   disk, each checked on the way);
//! * straight to an S3-compatible store (`IOTA_TEST_S3_ENDPOINT`, which `scripts/bench.sh`
//!   starts with `scripts/s3.sh`) through presigned URLs, then committed (the orchestrator
//!   streams each object back from the store to check it).
//!
//! The orchestrator runs in a process of its own (this binary, started again as one), so its
//! resident memory is its own: the kernel's peak (`VmHWM`), reset just before the uploads, is
//! the figure; its resident memory before them is printed beside it. Goal: peak under 512 MB.
//!
//! `scripts/bench.sh uploads`. Needs `DATABASE_URL`, `IOTA_TEST_S3_ENDPOINT` and about
//! 16 × the partition size of free disk (twice that with the S3 store).

use iota_testkit::common;

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use common::*;
use iota_orchestrator::StoreConfig;
use iota_protocol::api::*;
use iota_protocol::client::{ApiClient, RetryPolicy};
use iota_testkit::sim::SimMiner;

// The allocator of the `iota` binary, which serves the orchestrator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MINERS: u8 = 16;
/// Where the child learns what to serve: a JSON [`ServeSpec`].
const SERVE_ENV: &str = "IOTA_BENCH_SERVE";

/// What the orchestrator process serves.
#[derive(serde::Serialize, serde::Deserialize)]
struct ServeSpec {
    chain: String,
    netuid: u16,
    db: String,
    store: String,
    run: RunConfig,
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match std::env::var(SERVE_ENV) {
        Ok(spec) => runtime.block_on(serve(serde_json::from_str(&spec)?)),
        Err(_) => runtime.block_on(bench()),
    }
}

/// The orchestrator process: serves until its standard input closes, printing its address.
async fn serve(spec: ServeSpec) -> anyhow::Result<()> {
    let store = StoreConfig::parse(&spec.store).map_err(anyhow::Error::msg)?;
    let mut config = config_for(&spec.chain, spec.netuid, &spec.db, store, spec.run);
    config.tick = Duration::from_millis(100);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("http://{}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        while std::io::stdin().lock().read_line(&mut line).unwrap_or(0) > 0 {
            line.clear();
        }
    });
    iota_orchestrator::run(config, listener, async {
        let _ = stdin_closed.await;
    })
    .await?;
    Ok(())
}

async fn bench() -> anyhow::Result<()> {
    let mb = |name: &str, default: u64| -> anyhow::Result<u64> {
        Ok(std::env::var(name)
            .ok()
            .map(|v| v.parse())
            .transpose()?
            .unwrap_or(default))
    };
    let seeds: Vec<u8> = (1..=MINERS).collect();
    let chain = chain_with(&seeds, &[]).await;
    println!(
        "orchestrator memory while {MINERS} miners upload a pseudo-gradient partition each, all at once (one stage, one partition); load average before: {}",
        load_average()
    );
    println!(
        "{:<38} {:>12} {:>11} {:>12} {:>9} {:>8}",
        "store", "partition", "RSS before", "peak RSS", "seconds", "MB/s"
    );
    let dir = tempfile::tempdir()?;
    let mut stores = vec![(
        "directory, through the orchestrator",
        format!("file://{}", dir.path().display()),
        mb("IOTA_BENCH_PARTITION_MB", 524)?,
    )];
    let endpoint = std::env::var("IOTA_TEST_S3_ENDPOINT").context(
        "IOTA_TEST_S3_ENDPOINT is not set: run through scripts/bench.sh, which starts an \
         S3-protocol server (or eval \"$(scripts/s3.sh start)\")",
    )?;
    // moto (scripts/s3.sh) keeps every object in its own memory, twice while a commit copies
    // it to its sealed key: smaller partitions, so that it fits beside the rest.
    stores.push((
        "S3, presigned PUT then commit",
        format!(
            "s3://{}?endpoint={endpoint}&region=us-east-1",
            std::env::var("IOTA_TEST_S3_BUCKET").unwrap_or_else(|_| "iota-test".into())
        ),
        mb("IOTA_BENCH_S3_PARTITION_MB", 128)?,
    ));
    for (name, store, partition_mb) in stores {
        let len = partition_mb * 1_000_000 / 4;
        // One partition for every miner (each upload is its own object all the same): the
        // client side holds one copy, not sixteen.
        let values: Vec<f32> = (0..len)
            .map(|i| ((i % 1000) as f32 - 500.0) * 1e-5)
            .collect();
        let body = Bytes::from(iota_protocol::tensor::encode_partition(&values));
        drop(values);
        let figures = round(&chain, &store, len, body.clone()).await?;
        println!(
            "{name:<38} {:>9.1} MB {:>8.0} MB {:>9.0} MB {:>9.1} {:>8.0}",
            body.len() as f64 / 1e6,
            figures.rss_before as f64 / 1e6,
            figures.peak as f64 / 1e6,
            figures.seconds,
            (MINERS as usize * body.len()) as f64 / 1e6 / figures.seconds
        );
        let blobs = iota_orchestrator::BlobStore::open(
            &StoreConfig::parse(&store).map_err(anyhow::Error::msg)?,
        )?;
        blobs.delete_prefix("runs").await?;
    }
    println!(
        "peak RSS: the kernel's VmHWM of the orchestrator's process, reset just before the uploads; goal < 512 MB"
    );
    Ok(())
}

struct Figures {
    rss_before: u64,
    peak: u64,
    seconds: f64,
}

/// One run on a fresh database with the orchestrator on `store`: the epoch trained, then every
/// miner's upload at once.
async fn round(chain: &Chain, store: &str, len: u64, body: Bytes) -> anyhow::Result<Figures> {
    let mut run = run_config("uploads");
    run.stages = 1;
    run.stage_params = vec![len];
    run.partitions = 1;
    run.micro_batch = 1;
    // Enough that every miner is leased some (the routing draws miners at random).
    run.samples_per_epoch = 16 * MINERS as u64;
    run.max_in_flight = 4;
    run.training_s = 20;
    run.uploading_s = 600;
    run.lease_s = 30;
    run.heartbeat_timeout_s = 600;
    let spec = ServeSpec {
        chain: chain.net.ws_url(),
        netuid: chain.netuid,
        db: fresh_db().await,
        store: store.to_owned(),
        run,
    };
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .env(SERVE_ENV, serde_json::to_string(&spec)?)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let base = {
        let out = child.stdout.take().context("child stdout")?;
        let mut line = String::new();
        std::io::BufReader::new(out).read_line(&mut line)?;
        line.trim().to_owned()
    };
    let result = uploads(&base, pid, body).await;
    drop(child.stdin.take());
    let _ = child.wait();
    result
}

async fn uploads(base: &str, pid: u32, body: Bytes) -> anyhow::Result<Figures> {
    wait_for(base).await?;
    let mut miners = Vec::new();
    for seed in 1..=MINERS {
        let mut miner = SimMiner::join(base, signer(seed), 1000.0, seed as u64).await?;
        miner.uploads_pseudo_gradients = false;
        miners.push(miner);
    }
    // Train until the uploading phase, every miner with gradient work (hops at the last stage).
    let mut worked = vec![false; miners.len()];
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        for (i, miner) in miners.iter_mut().enumerate() {
            worked[i] |= miner.step().await?.hops > 0;
        }
        let status: EpochStatus = miners[0].client().public_get("/v1/status").await?;
        if status.phase == Phase::Uploading {
            break;
        }
        if Instant::now() > deadline {
            bail!("no uploading phase after 300 s ({:?})", status.phase);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let uploaders: Vec<u8> = (1..=MINERS).filter(|s| worked[*s as usize - 1]).collect();
    if uploaders.len() != MINERS as usize {
        bail!("only {} of {MINERS} miners trained", uploaders.len());
    }
    let rss_before = status_kb(pid, "VmRSS")? * 1024;
    // The kernel's peak from here on (clear_refs 5 resets VmHWM to the current size).
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")?;
    let patient = RetryPolicy {
        attempts: 1,
        timeout: Duration::from_secs(1200),
        ..RetryPolicy::default()
    };
    let started = Instant::now();
    let mut all = Vec::new();
    for seed in uploaders {
        let client = ApiClient::connect(base, signer(seed), patient).await?;
        let body = body.clone();
        all.push(tokio::spawn(async move { upload(&client, body).await }));
    }
    for each in all {
        let blob = each.await??;
        if blob.size != body.len() as u64 {
            bail!("stored {} bytes of {}", blob.size, body.len());
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let peak = status_kb(pid, "VmHWM")? * 1024;
    Ok(Figures {
        rss_before,
        peak,
        seconds,
    })
}

/// Uploads `body` as partition 0 of epoch 0: presigned where the store presigns, else through
/// the orchestrator.
async fn upload(
    client: &ApiClient,
    body: Bytes,
) -> anyhow::Result<iota_protocol::blob::BlobDescriptor> {
    let path = "/v1/miner/epochs/0/pseudo-gradients/0";
    let blake3 = blake3::hash(&body).to_hex().to_string();
    let request = PresignRequest {
        size: body.len() as u64,
        blake3: blake3.clone(),
        multipart: false,
    };
    let presigned: Result<PresignResponse, _> = client
        .signed_json(reqwest::Method::POST, &format!("{path}/presign"), &request)
        .await;
    let target = match presigned {
        Ok(target) => target,
        Err(e) if e.code() == Some(iota_protocol::ErrorCode::BadRequest) => {
            return Ok(client.upload_pseudo_gradient(0, 0, body).await?.blob);
        }
        Err(e) => return Err(e.into()),
    };
    reqwest::Client::new()
        .put(&target.url)
        .body(body.clone())
        .send()
        .await?
        .error_for_status()?;
    let commit = CommitRequest {
        key: target.key,
        size: body.len() as u64,
        blake3,
        multipart: None,
    };
    let done: UploadResponse = client
        .signed_json(reqwest::Method::POST, &format!("{path}/commit"), &commit)
        .await?;
    Ok(done.blob)
}

async fn wait_for(base: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(r) = http.get(format!("{base}/healthz")).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("the orchestrator at {base} did not start")
}

/// A `/proc/<pid>/status` field in kB.
fn status_kb(pid: u32, field: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
