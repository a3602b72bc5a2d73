//! `iota localnet up`: a whole subnet in this process — chain, PostgreSQL, orchestrator, miners
//! and two validators — training the `tiny` model for a few epochs, then a `report.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use iota_chain::TxOptions;
use iota_chain::wallet::{Keypair, Wallet};
use iota_devnet::{Devnet, DevnetConfig, DevnetMiner, Neuron, Role};
use iota_localnet::LocalnetConfig;
use iota_miner::{Adversary, DeviceSpec, MinerConfig};
use iota_model::ModelConfig;
use iota_protocol::api::{PartitionState, RunConfig, SparseEncoding, ThroughputPoint};
use iota_protocol::client::ApiClient;
use iota_protocol::signing::SkewWindow;
use iota_validator::ValidatorConfig;

mod report;
mod setup;

pub use report::{Generation, NeuronRow, PartitionCounts, UpReport, WeightsSet};
use setup::{entropy_floor, local_run, up_data, up_model};

/// Flags of `iota localnet up`.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Miners per pipeline stage.
    #[arg(long, env = "IOTA_UP_MINERS_PER_STAGE", default_value_t = 2)]
    pub miners_per_stage: u32,
    /// Epochs to train (Ctrl-C stops earlier).
    #[arg(long, env = "IOTA_UP_EPOCHS", default_value_t = 3)]
    pub epochs: u64,
    /// Add a cheating miner of this kind (two for `colluding-merge`).
    #[arg(long, env = "IOTA_UP_ADVERSARY", value_enum)]
    pub adversary: Option<Adversary>,
    /// Miners' device: `cpu`, `cuda:N` (f32 compute) or `cuda:N:bf16`.
    #[arg(long, env = "IOTA_UP_DEVICE", default_value = "cpu", value_parser = DeviceSpec::parse)]
    pub device: DeviceSpec,
    /// Where to write the report (default: `report.json` in the run directory).
    #[arg(long, env = "IOTA_UP_REPORT")]
    pub report: Option<PathBuf>,
    /// Run directory: wallets, blobs, report.
    #[arg(long, env = "IOTA_UP_DIR", default_value = "iota-localnet-run")]
    pub dir: PathBuf,
    /// Samples per epoch.
    #[arg(long, env = "IOTA_UP_SAMPLES_PER_EPOCH", default_value_t = 48)]
    pub samples_per_epoch: u64,
    /// Model: `tiny`, `small` or a model config JSON file (the fields of `ModelConfig`).
    #[arg(long, env = "IOTA_UP_MODEL", default_value = "tiny")]
    pub model: String,
    /// Pipeline stages: the model's blocks re-split into N stages (default: the model's own).
    #[arg(long, env = "IOTA_UP_STAGES")]
    pub stages: Option<u32>,
    /// Train on real text: a prepared dataset folder (`iota data prepare`), or raw text files
    /// and folders to prepare into the run directory with `--tokenizer`. A preset model's
    /// vocabulary is widened to hold the tokenizer. Default: the embedded grammar corpus.
    #[arg(long, env = "IOTA_UP_DATA", num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// The tokenizer for raw `--data` (default: a 1,024-token byte-level BPE trained on its
    /// `.txt` and `.jsonl` files).
    #[arg(long, env = "IOTA_UP_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// How pseudo-gradients travel: `dense`, or `top-K/CHUNK` (compressed, with the outer
    /// momentum off, as `iota orchestrator --pseudo-gradients` describes).
    #[arg(
        long = "pseudo-gradients",
        env = "IOTA_UP_PSEUDO_GRADIENTS",
        default_value = "dense",
        value_parser = iota_orchestrator::config::parse_pseudo_gradients
    )]
    pub pseudo_gradients: iota_orchestrator::config::PseudoGradients,
    /// With `--pseudo-gradients top-K/CHUNK`: values each merged update keeps per chunk (K to
    /// CHUNK; default K).
    #[arg(long = "merged-top", env = "IOTA_UP_MERGED_TOP")]
    pub merged_top: Option<u32>,
    /// With `--pseudo-gradients top-K/CHUNK`: bits of each kept value, 8 or 4 (default 8).
    #[arg(long = "sparse-bits", env = "IOTA_UP_SPARSE_BITS")]
    pub sparse_bits: Option<u8>,
}

impl UpArgs {
    /// The prepared dataset folder, once [`up`] has resolved `--data`.
    fn data_dir(&self) -> Option<&Path> {
        self.data.first().map(PathBuf::as_path)
    }

    /// Models that train or replay at once in this process: every miner (the adversary
    /// included) and the two validators. An unreadable `--model` counts three stages here; it is
    /// reported properly when the run starts.
    pub fn models_at_once(&self) -> usize {
        let stages = self
            .stages
            .map(|n| n as usize)
            .unwrap_or_else(|| ModelConfig::load(&self.model).map_or(3, |m| m.num_stages()));
        stages * self.miners_per_stage as usize + self.adversary.map_or(0, Adversary::miners) + 2
    }
}

/// A throwaway PostgreSQL started by `scripts/pg.sh`, stopped on drop.
struct Postgres {
    script: PathBuf,
    dir: String,
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = std::process::Command::new("bash")
            .arg(&self.script)
            .arg("stop")
            .arg(&self.dir)
            .status();
    }
}

fn pg_script() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/pg.sh");
    if built.exists() {
        built
    } else {
        PathBuf::from("scripts/pg.sh")
    }
}

fn postgres_installed() -> bool {
    std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().any(|v| v.path().join("bin/initdb").exists()))
        .unwrap_or(false)
}

/// `DATABASE_URL`, or a throwaway server (with its guard).
fn database() -> anyhow::Result<(String, Option<Postgres>)> {
    if let Ok(url) = std::env::var("DATABASE_URL") {
        return Ok((url, None));
    }
    if !postgres_installed() {
        anyhow::bail!(
            "no PostgreSQL: install the server (Debian/Ubuntu: `sudo apt-get install postgresql`) \
             or set DATABASE_URL to a server where this user may create databases"
        );
    }
    let script = pg_script();
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg("start")
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        anyhow::bail!(
            "starting PostgreSQL failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let var = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("export {name}=")))
            .map(str::to_owned)
    };
    let (Some(url), Some(dir)) = (var("DATABASE_URL"), var("IOTA_PG_DIR")) else {
        anyhow::bail!("scripts/pg.sh printed no DATABASE_URL: {text}");
    };
    Ok((url, Some(Postgres { script, dir })))
}

/// A deterministic key per role name, so a rerun in the same directory keeps its wallets.
fn key_for(name: &str) -> Keypair {
    Keypair::from_seed(*blake3::hash(format!("iota-localnet-up/{name}").as_bytes()).as_bytes())
}

fn tx() -> TxOptions {
    TxOptions {
        timeout: Duration::from_secs(30),
        ..TxOptions::default()
    }
}

/// The subnet's neurons: two validators, `miners_per_stage` miners per stage, and the adversary
/// (two miners for `colluding-merge`), in the order the miners join. A miner joins the stage with
/// the least throughput (then the fewest miners, then the lowest index), so an adversary that
/// cheats only at the last stage joins after one honest miner for each other stage: the last
/// stage is then the only one without a miner, and it goes there.
fn neurons(args: &UpArgs, stages: u32) -> Vec<Neuron> {
    let neuron = |name: String, role, adversary| Neuron {
        key: key_for(&name),
        name,
        role,
        adversary,
    };
    let validators = (0..2).map(|v| neuron(format!("validator{v}"), Role::Validator, None));
    let miners =
        (0..stages * args.miners_per_stage).map(|m| neuron(format!("miner{m}"), Role::Miner, None));
    let adversary = args.adversary.into_iter().flat_map(|kind| {
        let n = kind.miners();
        (0..n).map(move |i| {
            let name = match n {
                1 => format!("adversary-{kind}"),
                _ => format!("adversary-{kind}-{i}"),
            };
            neuron(name, Role::Miner, Some(kind))
        })
    });
    let mut miners: Vec<Neuron> = miners.collect();
    let adversary: Vec<Neuron> = adversary.collect();
    let at = match args.adversary {
        Some(kind) if kind.acts_at_the_last_stage() => (stages as usize - 1).min(miners.len()),
        _ => miners.len(),
    };
    miners.splice(at..at, adversary);
    validators.chain(miners).collect()
}

/// Wallets under the run directory: the subnet owner's and every neuron's.
fn write_wallets(dir: &Path, owner: &Keypair, neurons: &[Neuron]) -> anyhow::Result<()> {
    let wallets = dir.join("wallets");
    let owner_wallet = Wallet::new(&wallets, "owner", "default")?;
    owner_wallet.set_coldkey(&key_for("owner-cold"), None, true)?;
    owner_wallet.set_hotkey(owner, None, true)?;
    for n in neurons {
        let w = Wallet::new(&wallets, &n.name, "default")?;
        w.set_coldkey(&key_for(&format!("{}-cold", n.name)), None, true)?;
        w.set_hotkey(&n.key, None, true)?;
    }
    Ok(())
}

/// The devnet of a local run: 250 ms blocks, fast polling, no rate limits that a handful of
/// local parties could hit.
fn devnet_config(
    args: &UpArgs,
    dir: &Path,
    database_url: String,
    run: &RunConfig,
    neurons: Vec<Neuron>,
) -> anyhow::Result<DevnetConfig> {
    let mut chain = LocalnetConfig::with_block_time(Duration::from_millis(250));
    // 5 s chain epochs: a validator busy replaying on a small machine still reveals its
    // commit inside the one-epoch window.
    chain.chain.new_subnet_tempo = 20;
    let owner = key_for("owner");
    let orchestrator = iota_orchestrator::Config {
        // The devnet fills in the database, chain endpoint, netuid and hotkey.
        database_url: String::new(),
        db_max_connections: 16,
        store: iota_orchestrator::StoreConfig::Local(dir.join("store")),
        chain_endpoint: String::new(),
        chain_timeout: Duration::from_secs(30),
        trusted_proxies: Vec::new(),
        netuid: 0,
        hotkey: owner.ss58(),
        run: run.clone(),
        metagraph_refresh: Duration::from_millis(500),
        skew: SkewWindow::default(),
        limits: iota_orchestrator::Limits {
            per_hotkey_rps: 1000,
            per_hotkey_burst: 1000,
            per_ip_rps: 1000,
            per_ip_burst: 1000,
            ..iota_orchestrator::Limits::default()
        },
        tick: Duration::from_millis(100),
        max_merge_rounds: 2,
        dataset: None,
    };
    let mut validator = ValidatorConfig::new(String::new(), 0);
    validator.poll_interval = Duration::from_millis(500);
    // A handful of miners: replay every one and re-derive every merge, so a cheater is never
    // missed by the draw.
    validator.replays_per_epoch = 0;
    validator.merges_per_epoch = 0;
    validator.tx = tx();
    validator.data_dir = args.data_dir().map(Path::to_path_buf);
    let mut miner = MinerConfig::new(String::new());
    miner.device = args.device.clone();
    miner.poll_interval = Duration::from_millis(50);
    miner.tokens_per_s = Some(1000.0);
    miner.data_dir = args.data_dir().map(Path::to_path_buf);
    let database_prefix = format!(
        "iota_up_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
    );
    Ok(DevnetConfig {
        chain,
        permit_timeout: Duration::from_secs(120),
        owner,
        neurons,
        database_url,
        database_prefix,
        orchestrator,
        validator,
        miner,
        miner_join_timeout: Duration::from_secs(60),
        tx: tx(),
    })
}

/// Runs the subnet until `epochs` are trained or `shutdown` resolves; writes the report.
pub async fn up(
    args: UpArgs,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<UpReport> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = std::fs::canonicalize(&args.dir)?;
    if args.miners_per_stage == 0 {
        anyhow::bail!("--miners-per-stage must be at least 1");
    }
    let data = up_data(&args.data, args.tokenizer.as_deref(), &dir)?;
    let model = up_model(
        &args.model,
        args.stages,
        &dir,
        data.as_ref().map_or(0, |d| d.vocab_size),
    )?;
    let sparse = match (args.pseudo_gradients.0, args.merged_top, args.sparse_bits) {
        (None, Some(_), _) | (None, _, Some(_)) => anyhow::bail!(
            "--merged-top and --sparse-bits are for sparse runs: pass --pseudo-gradients top-K/CHUNK"
        ),
        (s, merged_k, bits) => s.map(|s| SparseEncoding {
            merged_k,
            bits,
            ..s
        }),
    };
    let run = local_run(&model, args.samples_per_epoch, data.as_ref(), sparse)?;
    // From here on `--data` names the prepared folder that every miner and validator reads.
    let mut args = args;
    args.data = data.map(|d| d.dir).into_iter().collect();
    args.tokenizer = None;
    let (db_base, _pg) = database()?;

    if args.device == DeviceSpec::Cpu {
        let var = |name| std::env::var(name).unwrap_or_else(|_| "candle's default".into());
        println!(
            "CPU threads per tensor operation: {} per matrix product, {} per element-wise op (--cpu-threads)",
            var(iota_model::threads::MATMUL_VAR),
            var(iota_model::threads::ELEMENTWISE_VAR)
        );
    }
    let neurons = neurons(&args, run.stages);
    let config = devnet_config(&args, &dir, db_base, &run, neurons)?;
    write_wallets(&dir, &config.owner, &config.neurons)?;
    println!("starting the localnet chain");
    println!(
        "registering the subnet and {} hotkeys",
        config.neurons.len()
    );
    let mut devnet = Devnet::start(config).await?;
    println!("dashboard: {}/", devnet.base);
    println!("{} miners and 2 validators running", devnet.miners.len());
    let report = train_and_report(&args, &dir, &run, &mut devnet, shutdown).await;
    devnet.stop().await;
    report
}

/// Held-out loss before the first epoch and after each trained one.
struct LossCurve {
    initial: f32,
    per_epoch: Vec<f32>,
}

async fn train_and_report(
    args: &UpArgs,
    dir: &Path,
    run: &RunConfig,
    devnet: &mut Devnet,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<UpReport> {
    let trained = train(args, &devnet.client, run, &devnet.miners, shutdown).await;
    devnet.stop_miners().await;
    match trained? {
        Some(curve) => finish(args, dir, run, devnet, curve).await,
        None => Err(anyhow::anyhow!("interrupted before the first epoch ended")),
    }
}

async fn held_out_loss(
    client: &ApiClient,
    run: &RunConfig,
    epoch: u64,
    data_dir: Option<&Path>,
) -> anyhow::Result<f32> {
    Ok(iota_miner::eval::held_out_loss(client, run, epoch, data_dir).await?)
}

/// Trains until `args.epochs` epochs are merged or `shutdown`; returns the held-out loss after
/// each finished epoch and before the first (none when stopped before the first epoch ended).
async fn train(
    args: &UpArgs,
    client: &ApiClient,
    run: &RunConfig,
    miners: &[DevnetMiner],
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<Option<LossCurve>> {
    let floor = entropy_floor(run)?;
    let initial = held_out_loss(client, run, 0, args.data_dir()).await?;
    let mut losses: Vec<f32> = Vec::new();
    // Throughput over the last poll interval.
    let mut last_tokens: u64 = miners.iter().map(|m| m.handle.status().tokens).sum();
    let (mut last_at, mut rate) = (Instant::now(), 0.0);
    tokio::pin!(shutdown);
    loop {
        let st = tokio::select! {
            _ = &mut shutdown => {
                eprintln!();
                println!("interrupted: stopping");
                break;
            }
            st = client.status() => st?,
        };
        while (losses.len() as u64) < st.epoch.min(args.epochs) {
            let e = losses.len() as u64 + 1;
            losses.push(held_out_loss(client, run, e, args.data_dir()).await?);
        }
        let tokens: u64 = miners.iter().map(|m| m.handle.status().tokens).sum();
        let hops: Vec<String> = miners
            .iter()
            .map(|m| {
                let s = m.handle.status();
                format!(
                    "{}:{}",
                    s.stage.map(|k| k.to_string()).unwrap_or("-".into()),
                    s.hops
                )
            })
            .collect();
        let elapsed = last_at.elapsed().as_secs_f64();
        if elapsed > 0.2 {
            rate = tokens.saturating_sub(last_tokens) as f64 / elapsed;
            (last_tokens, last_at) = (tokens, Instant::now());
        }
        let loss = losses.last().copied().unwrap_or(initial);
        let against = match floor {
            Some(f) => format!("floor {f:.3}"),
            None => format!("perplexity {:.1}", loss.exp()),
        };
        eprint!(
            "\repoch {} {:<9} samples {}/{}  loss {loss:.3} ({against})  {:.0} tok/s (all stages)  hops {}   ",
            st.epoch,
            st.phase.as_str(),
            st.samples_completed,
            run.samples_per_epoch,
            rate,
            hops.join(" ")
        );
        if st.epoch >= args.epochs {
            eprintln!();
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok((!losses.is_empty()).then_some(LossCurve {
        initial,
        per_epoch: losses,
    }))
}

/// After training: the final weights exported, the partitions and throughput of the trained
/// epochs, the validators' weights on the chain and their scores; writes the report and its
/// loss plot and prints the summary.
async fn finish(
    args: &UpArgs,
    dir: &Path,
    run: &RunConfig,
    devnet: &Devnet,
    curve: LossCurve,
) -> anyhow::Result<UpReport> {
    let LossCurve {
        initial,
        per_epoch: losses,
    } = curve;
    let client = &devnet.client;
    let epochs = losses.len() as u64;
    let floor = entropy_floor(run)?;
    // The final weights as an export folder, as `iota model export` writes them.
    let export_dir = dir.join("model");
    let tokenizer = crate::model_cmd::tokenizer_of(run, args.data_dir())?;
    iota_miner::eval::export_epoch(client, run, epochs, tokenizer, &export_dir).await?;
    // A short sample of what the last epoch's merged weights write, for a run on real text.
    let generation = match args.data_dir() {
        Some(d) => {
            let (prompt, text) =
                iota_miner::eval::sample_text(client, run, epochs, d, 8, 24).await?;
            Some(Generation {
                epoch: epochs,
                prompt,
                text,
            })
        }
        None => None,
    };

    let partitions = partition_counts(client, epochs).await?;
    let throughput: Vec<ThroughputPoint> = client.public_get("/v1/throughput").await?;
    let done: Vec<&ThroughputPoint> = throughput.iter().filter(|t| t.epoch < epochs).collect();
    let tokens: u64 = done.iter().map(|t| t.tokens).sum();
    let wire: u64 = done.iter().map(|t| t.wire_bytes).sum();
    // The same boundary tensors in f32: activations forward and gradients back across each of
    // the stage boundaries, per token.
    let fp32_per_token = 2 * (u64::from(run.stages) - 1) * u64::from(run.boundary_dim) * 4;

    // Every validator scores the trained epochs and gets its weights onto the chain.
    println!("waiting for both validators to score {epochs} epochs and set weights");
    // A second Ctrl-C gives up on the validators (and the report).
    let weights_set = tokio::select! {
        r = weights_landed(devnet, epochs) => r?,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted while waiting for the validators: no report"),
    };
    let meta = devnet.chain.metagraph(devnet.netuid).await?;

    let mut scores: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for v in &devnet.validators {
        for total in v.store.score_totals().await? {
            scores.entry(total.hotkey).or_default().push(total.total);
        }
    }
    let neurons = devnet
        .neurons
        .iter()
        .map(|m| {
            let hotkey = m.key.ss58();
            let n = meta.neurons.iter().find(|n| n.hotkey.ss58() == hotkey);
            NeuronRow {
                uid: n.map(|n| n.uid),
                score: scores
                    .get(&hotkey)
                    .map(|v| v.iter().sum::<f64>() / v.len() as f64),
                hotkey,
                name: m.name.clone(),
                role: m.role.as_str().to_owned(),
                adversary: m.adversary.map(|a| a.as_str().to_owned()),
                incentive: n.map(|n| f64::from(n.incentive) / f64::from(u16::MAX)),
                emission: n.map(|n| n.emission),
            }
        })
        .collect();

    let path = args
        .report
        .clone()
        .unwrap_or_else(|| dir.join("report.json"));
    // The loss curve beside the report: `report.json` -> `report.png`.
    let plot = if path.extension().is_some_and(|e| e == "png") {
        path.with_extension("loss.png")
    } else {
        path.with_extension("png")
    };
    let curve: Vec<f32> = std::iter::once(initial)
        .chain(losses.iter().copied())
        .collect();
    crate::plot::write_loss_png(&plot, &curve, floor.map(|f| f as f32))?;
    let report = UpReport {
        model: run.model.clone(),
        stages: run.stages,
        epochs,
        initial_loss: initial,
        initial_perplexity: initial.exp(),
        perplexity_per_epoch: losses.iter().map(|l| l.exp()).collect(),
        loss_per_epoch: losses,
        entropy_floor: floor,
        dataset: run.dataset.clone(),
        generation,
        export: export_dir.to_string_lossy().into_owned(),
        partitions,
        tokens,
        wire_bytes_per_token: if tokens > 0 {
            wire as f64 / tokens as f64
        } else {
            0.0
        },
        fp32_bytes_per_token: fp32_per_token,
        weights_set,
        neurons,
        plot: plot.to_string_lossy().into_owned(),
    };
    report.write(&path)?;
    report.print_summary(&path);
    Ok(report)
}

/// Partitions of the trained epochs: all, merged, and merged with every result agreeing.
async fn partition_counts(client: &ApiClient, epochs: u64) -> anyhow::Result<PartitionCounts> {
    let mut counts = PartitionCounts {
        total: 0,
        merged: 0,
        agreeing: 0,
    };
    for e in 0..epochs {
        for p in client.merge_status(e).await? {
            counts.total += 1;
            if p.state == PartitionState::Accepted {
                counts.merged += 1;
                let hashes: std::collections::HashSet<&str> = p
                    .results
                    .iter()
                    .filter_map(|r| r.blake3.as_deref())
                    .collect();
                if p.resolved_by.as_deref() == Some("agreement") && hashes.len() == 1 {
                    counts.agreeing += 1;
                }
            }
        }
    }
    Ok(counts)
}

/// Waits for every validator's weights that count the last of `epochs` to land in a block,
/// then for the tempo boundary at which Yuma runs on them.
async fn weights_landed(devnet: &Devnet, epochs: u64) -> anyhow::Result<Vec<WeightsSet>> {
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut weights_set = Vec::new();
    for v in &devnet.validators {
        let hotkey = v.neuron.key.ss58();
        loop {
            let subs = v.store.submissions(20).await?;
            let landed = subs.iter().find(|s| {
                (s.state == "set" || s.state == "revealed")
                    && s.block.is_some()
                    && s.epoch.is_some_and(|e| e + 1 >= epochs)
            });
            if let Some(s) = landed {
                weights_set.push(WeightsSet {
                    validator: hotkey,
                    block: s.block,
                    epoch: s.epoch,
                    state: s.state.clone(),
                });
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "validator {hotkey} did not set weights for epoch {} in time",
                epochs - 1
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    // Yuma runs at the next tempo boundary.
    let chain = &devnet.chain;
    let tempo = chain.hyperparams(devnet.netuid).await?.tempo;
    let now = chain.best_block_number().await?;
    chain
        .wait_for_block(now + u64::from(tempo) + 2, Duration::from_secs(120))
        .await?;
    Ok(weights_set)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A miner that cheats only at the last stage joins there, whatever the throughputs the
    /// miners before it measured: joined in [`neurons`]' order by the orchestrator's own rule,
    /// it lands on the last stage, and every other miner where it would have.
    #[test]
    fn a_last_stage_cheater_joins_the_last_stage() {
        use clap::Parser as _;
        use iota_orchestrator::domain::placement::{StageLoad, choose_stage};
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            up: UpArgs,
        }
        for (kind, stages, per_stage) in [
            ("forge-loss", 3, 2),
            ("lazy-loss", 4, 1),
            ("forge-loss", 1, 2),
        ] {
            let args = Cli::try_parse_from([
                "up",
                "--adversary",
                kind,
                "--miners-per-stage",
                &per_stage.to_string(),
            ])
            .expect("flags")
            .up;
            let mut loads: Vec<StageLoad> = (0..stages)
                .map(|stage| StageLoad {
                    stage,
                    memory_needed: 0,
                    miners: 0,
                    tokens_per_s: 0.0,
                })
                .collect();
            let miners = neurons(&args, stages)
                .into_iter()
                .filter(|n| n.role == Role::Miner);
            for (i, miner) in miners.enumerate() {
                let stage = choose_stage(&loads, 1).expect("a stage") as usize;
                loads[stage].miners += 1;
                // Measured speeds differ from miner to miner.
                loads[stage].tokens_per_s += 100.0 + 37.0 * ((i * 7) % 5) as f64;
                if miner.adversary.is_some() {
                    assert_eq!(stage as u32, stages - 1, "{kind} over {stages} stages");
                }
            }
            let placed: Vec<u32> = loads.iter().map(|l| l.miners).collect();
            let honest = stages * per_stage;
            assert_eq!(placed.iter().sum::<u32>(), honest + 1, "{kind}: {placed:?}");
        }
        let other = Cli::try_parse_from(["up", "--adversary", "noise"])
            .expect("flags")
            .up;
        let last = neurons(&other, 3).pop().expect("neurons");
        assert_eq!(
            last.adversary.map(|a| a.as_str()),
            Some("noise"),
            "joins last"
        );
    }

    #[test]
    fn colluding_mergers_come_in_pairs() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            up: UpArgs,
        }
        let args = |adversary: &str| {
            Cli::try_parse_from(["up", "--adversary", adversary])
                .expect("flags")
                .up
        };
        let names = |a: &UpArgs| -> Vec<String> {
            neurons(a, 3)
                .into_iter()
                .filter(|n| n.adversary.is_some())
                .map(|n| n.name)
                .collect()
        };
        let pair = args("colluding-merge");
        assert_eq!(
            names(&pair),
            ["adversary-colluding-merge-0", "adversary-colluding-merge-1"]
        );
        assert_eq!(pair.models_at_once(), 3 * 2 + 2 + 2);
        let lone = args("wrong-merge");
        assert_eq!(names(&lone), ["adversary-wrong-merge"]);
        assert_eq!(lone.models_at_once(), 3 * 2 + 1 + 2);
    }
}
