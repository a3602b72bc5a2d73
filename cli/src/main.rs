//! `iota`: one binary for operators: local chain, wallets, chain operations, the orchestrator,
//! the miner.

use clap::{Parser, Subcommand};
use iota_orchestrator::dataset::DatasetSource;

mod alloc;
mod data;
mod model_cmd;
mod plot;
mod up;

#[derive(Debug, Parser)]
#[command(name = "iota", version, about = "IOTA (Bittensor subnet 9) in Rust")]
struct Cli {
    /// Threads one tensor operation may use on the CPU. Default: the physical cores, or for
    /// `localnet up` (many models in one process) the cores shared out between its models with
    /// one thread per element-wise operation. `RAYON_NUM_THREADS` and `CANDLE_NUM_THREADS`, if
    /// set, win over the `localnet up` default.
    #[arg(long, global = true, env = "IOTA_CPU_THREADS")]
    cpu_threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A subtensor-compatible local chain, or a whole subnet on this machine (`up`).
    Localnet {
        #[command(subcommand)]
        command: LocalnetCommand,
    },
    /// btcli-compatible wallets: create, restore, list, show.
    Wallet {
        #[command(subcommand)]
        command: iota_chain::wallet::cli::WalletCommand,
    },
    /// Chain operations: metagraph, register, serve-axon, stake, transfer, set-weights, …
    Chain(iota_chain::cli::ChainArgs),
    /// The orchestrator: signed HTTP API, run state in PostgreSQL, blobs in object storage.
    Orchestrator(OrchestratorCmd),
    /// A miner: trains one pipeline stage for an orchestrator.
    #[command(args_override_self = true)]
    Miner(iota_miner::MinerArgs),
    /// A validator: verifies miners' work, scores it, sets weights on chain.
    Validator {
        #[command(subcommand)]
        command: ValidatorCommand,
    },
    /// Datasets: prepare token shards from raw text.
    Data {
        #[command(subcommand)]
        command: data::DataCommand,
    },
    /// Training-core tools.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
}

#[derive(Debug, Subcommand)]
enum LocalnetCommand {
    /// Run a whole subnet here: chain, PostgreSQL, orchestrator, miners and two validators
    /// training `tiny` for a few epochs, then a report.
    Up(up::UpArgs),
    #[command(flatten)]
    Chain(iota_localnet::cli::LocalnetCommand),
}

#[derive(Debug, clap::Args)]
struct OrchestratorCmd {
    /// Model config: `tiny`, `small`, `iota-1.5b`, `iota-15b` or a JSON file.
    #[arg(long, env = "IOTA_MODEL", default_value = "tiny")]
    model: String,
    /// A prepared dataset (`iota data prepare`) to train on: its folder, or an object-store
    /// prefix holding the same files (`s3://bucket/prefix`, with the `--store` URL's options:
    /// `?endpoint=…&region=…`). Its manifest's BLAKE3 goes into the run's public config and its
    /// files into the run's store (`datasets/<BLAKE3>/`), where miners and validators fetch them.
    /// Without it, the embedded grammar corpus.
    #[arg(long, env = "IOTA_DATA")]
    data: Option<String>,
    /// Print the OpenAPI document and exit.
    #[arg(long = "print-openapi")]
    print_openapi: bool,
    #[command(flatten)]
    args: iota_orchestrator::OrchestratorArgs,
}

/// The shape of a model as the orchestrator needs it, without loading weights, training on the
/// dataset whose manifest hashes to `dataset` (see [`dataset_hash`]).
fn model_shape(
    name: &str,
    dataset: Option<String>,
    micro_batch: usize,
    seq_len: usize,
) -> anyhow::Result<iota_orchestrator::config::ModelShape> {
    let cfg = iota_model::ModelConfig::load(name)?;
    let stage_params = (0..cfg.num_stages())
        .map(|k| cfg.stage_param_count(k).map(|n| n as u64))
        .collect::<Result<Vec<_>, _>>()?;
    // What a miner needs per stage at the run's micro-batch, which the orchestrator admits by.
    let stage_memory = (0..cfg.num_stages())
        .map(|k| iota_model::memory::miner_stage_bytes(&cfg, k, micro_batch, seq_len))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(iota_orchestrator::config::ModelShape {
        model: name.to_owned(),
        stage_params,
        stage_memory,
        boundary_dim: u32::try_from(cfg.boundary_dim())?,
        dataset,
    })
}

/// The BLAKE3 of the dataset's manifest, once its tokenizer is known to fit model `name`'s
/// vocabulary. A local folder is checked whole (every shard's hash); in a store, each file is
/// checked as it is copied into the run's store.
async fn dataset_hash(source: &DatasetSource, name: &str) -> anyhow::Result<String> {
    let cfg = iota_model::ModelConfig::load(name)?;
    let (hash, vocab) = match source {
        DatasetSource::Dir(dir) => {
            use iota_model::Dataset as _;
            let ds = iota_model::data::PreparedDataset::open(dir, None, 1, 0)?;
            ds.verify_all()?;
            (ds.manifest_blake3().to_owned(), ds.vocab_size() as u64)
        }
        DatasetSource::Store { .. } => {
            let bytes = source
                .open()?
                .manifest()
                .await
                .map_err(|e| anyhow::anyhow!("--data {source}: {e}"))?;
            let manifest: iota_model::data::prepare::Manifest = serde_json::from_slice(&bytes)
                .map_err(|e| anyhow::anyhow!("--data {source}: manifest.json: {e}"))?;
            (iota_protocol::blob::blake3_hex(&bytes), manifest.vocab_size)
        }
    };
    if vocab > cfg.vocab_size as u64 {
        anyhow::bail!(
            "--data {source}: its tokenizer has {vocab} tokens, more than model {name:?}'s \
             vocabulary of {}",
            cfg.vocab_size
        );
    }
    Ok(hash)
}

async fn orchestrator(cmd: OrchestratorCmd) -> anyhow::Result<()> {
    if cmd.print_openapi {
        use std::io::Write as _;
        // A closed pipe (`| head`) is not an error worth a panic.
        let _ = writeln!(std::io::stdout(), "{}", iota_orchestrator::openapi_json());
        return Ok(());
    }
    let source = cmd
        .data
        .as_deref()
        .map(DatasetSource::parse)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--data: {e}"))?;
    let dataset = match &source {
        Some(s) => Some(dataset_hash(s, &cmd.model).await?),
        None => None,
    };
    let shape = model_shape(
        &cmd.model,
        dataset,
        cmd.args.micro_batch as usize,
        cmd.args.seq_len as usize,
    )?;
    let wallet = cmd.args.wallet.wallet()?;
    let hotkey = wallet.hotkeypub().map_err(|e| {
        anyhow::anyhow!("the orchestrator's hotkey: {e} (create one with `iota wallet new-hotkey`)")
    })?;
    let mut config = cmd
        .args
        .config(shape, hotkey.ss58())
        .map_err(|e| anyhow::anyhow!(e))?;
    // Published in the run's store at start, for members without a local copy.
    config.dataset = source;
    let listener = tokio::net::TcpListener::bind(cmd.args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cmd.args.listen))?;
    println!(
        "orchestrator on http://{} (dashboard at /)",
        listener.local_addr()?
    );
    iota_orchestrator::run(config, listener, shutdown_signal()).await?;
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM, so services finish in-flight requests and exit cleanly.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    tracing::info!("shutting down");
}

#[derive(Debug, Subcommand)]
enum ValidatorCommand {
    /// Run the validator loop.
    Run(iota_validator::ValidatorArgs),
    /// Print the latest scores and weight submissions from the validator's database.
    Scores(iota_validator::ValidatorArgs),
    /// Recompute a scored epoch's CLASP fit, scores and weights from the orchestrator's records
    /// and compare them with the database and the chain (exit status 1 on any difference). With
    /// --validator, anyone's audit of any validator from public records alone: no database, no
    /// wallet.
    Audit(AuditArgs),
}

#[derive(Debug, clap::Args)]
struct AuditArgs {
    /// The epoch to audit (one this validator scored).
    #[arg(long)]
    epoch: u64,
    /// Print the report as JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Audit this validator (SS58 hotkey) from what it published and the chain, without its
    /// database or any wallet.
    #[arg(long = "validator", env = "IOTA_AUDIT_VALIDATOR")]
    public: Option<String>,
    #[command(flatten)]
    validator: iota_validator::ValidatorArgs,
}

async fn validator(command: ValidatorCommand) -> anyhow::Result<()> {
    let (args, audit) = match command {
        ValidatorCommand::Run(a) => (a, None),
        ValidatorCommand::Scores(a) => {
            let store = iota_validator::Store::connect(&database_url(&a)?).await?;
            return print_scores(&store).await;
        }
        ValidatorCommand::Audit(AuditArgs {
            epoch,
            json,
            public: Some(hotkey),
            validator: args,
        }) => {
            let client = iota_protocol::client::ApiClient::public(
                &args.orchestrator_url,
                iota_protocol::client::RetryPolicy::default(),
            )?;
            let chain = iota_chain::Subtensor::connect(args.subtensor.connect_options()?).await?;
            let auditor =
                iota_validator::audit::public::PublicAudit::new(client, chain, args.netuid);
            return print_audit(&auditor.audit(&hotkey, epoch).await?, epoch, json);
        }
        ValidatorCommand::Audit(a) => (a.validator, Some((a.epoch, a.json))),
    };
    let store = iota_validator::Store::connect(&database_url(&args)?).await?;
    let password = iota_chain::wallet::PasswordSource::EnvOrPrompt;
    let hotkey = args.wallet.wallet()?.hotkey(&password)?;
    let chain = iota_chain::Subtensor::connect(args.subtensor.connect_options()?).await?;
    if chain.uid_of(args.netuid, &hotkey.public()).await?.is_none() {
        anyhow::bail!(
            "hotkey {} is not registered on netuid {}: run `iota chain register --netuid {}`",
            hotkey.ss58(),
            args.netuid,
            args.netuid
        );
    }
    let v =
        iota_validator::Validator::connect(args.validator_config(), hotkey, chain, store).await?;
    if let Some((epoch, json)) = audit {
        return print_audit(&v.audit(epoch).await?, epoch, json);
    }
    println!(
        "validator for {} on netuid {}",
        args.orchestrator_url, args.netuid
    );
    iota_validator::run(v, shutdown_signal()).await;
    Ok(())
}

/// Prints an audit's report; an error (exit status 1) when it found a difference.
fn print_audit(report: &iota_validator::AuditReport, epoch: u64, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{report}");
    }
    if !report.matches {
        anyhow::bail!(
            "audit of epoch {epoch}: {} difference(s)",
            report.mismatches.len().max(1)
        );
    }
    Ok(())
}

fn database_url(args: &iota_validator::ValidatorArgs) -> anyhow::Result<String> {
    args.database_url.clone().ok_or_else(|| {
        anyhow::anyhow!("no database: pass --database.url or set IOTA_VALIDATOR_DATABASE_URL")
    })
}

async fn print_scores(store: &iota_validator::Store) -> anyhow::Result<()> {
    let rows = store.latest_scores().await?;
    println!(
        "{:>6}  {:<50} {:>8} {:>8} {:>10}  penalty",
        "epoch", "hotkey", "work", "quality", "score"
    );
    for (epoch, hotkey, work, quality, score, penalty) in rows {
        println!(
            "{epoch:>6}  {hotkey:<50} {work:>8.0} {quality:>8.3} {score:>10.1}  {}",
            penalty.unwrap_or_default()
        );
    }
    println!("\nweight submissions (newest first):");
    for s in store.submissions(10).await? {
        let pairs: Vec<String> = s
            .uids
            .iter()
            .zip(&s.weights)
            .map(|(u, w)| format!("{u}:{w:.3}"))
            .collect();
        println!(
            "  #{} {} {} {} block {} [{}]",
            s.id,
            s.epoch
                .map(|e| format!("epoch {e}"))
                .unwrap_or_else(|| "no epoch".into()),
            s.source,
            s.state,
            s.block.map(|b| b.to_string()).unwrap_or_else(|| "-".into()),
            pairs.join(" ")
        );
    }
    Ok(())
}

#[derive(Debug, Subcommand)]
enum ModelCommand {
    /// Train a byte-level BPE tokenizer on local `.txt`/`.jsonl` files (offline).
    TrainTokenizer {
        /// Text files: `.txt` (one document per file) or `.jsonl` with a `text` field.
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
        /// Vocabulary size, at least 258 (bytes plus the end-of-text token).
        #[arg(long, env = "IOTA_TOKENIZER_VOCAB_SIZE", default_value_t = 8_192)]
        vocab_size: usize,
        /// Where to write the `tokenizer.json`.
        #[arg(long, env = "IOTA_TOKENIZER_OUT", default_value = "tokenizer.json")]
        out: std::path::PathBuf,
    },
    /// Write an epoch's merged weights as one safetensors file with `config.json` and
    /// `tokenizer.json` (format: model/README.md, "Exported checkpoints").
    Export(model_cmd::ExportArgs),
    /// Continue a prompt with an exported model (greedy, or seeded temperature/top-p sampling).
    Generate(model_cmd::GenerateArgs),
    /// Held-out loss and perplexity of an exported model on a prepared dataset.
    Eval(model_cmd::EvalArgs),
}

/// `iota miner --config FILE`: the file's values become flags placed before the command line's,
/// so the command line wins.
fn args_with_config_file() -> anyhow::Result<Vec<String>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some("miner") {
        return Ok(args);
    }
    let mut path = std::env::var("IOTA_MINER_CONFIG").ok();
    let mut it = args.iter().skip(2);
    while let Some(a) = it.next() {
        if a == "--config" {
            path = it.next().cloned();
        } else if let Some(p) = a.strip_prefix("--config=") {
            path = Some(p.to_owned());
        }
    }
    let Some(path) = path else {
        return Ok(args);
    };
    let extra = iota_miner::config::config_file_args(std::path::Path::new(&path))?;
    let mut out = args[..2].to_vec();
    out.extend(extra);
    out.extend(args[2..].iter().cloned());
    Ok(out)
}

async fn miner(args: iota_miner::MinerArgs) -> anyhow::Result<()> {
    if let Some(addr) = args.metrics_addr {
        iota_miner::progress::serve_metrics(addr)?;
    }
    let password = iota_chain::wallet::PasswordSource::EnvOrPrompt;
    let ready = iota_miner::startup::prepare(&args, &password).await?;
    println!(
        "miner {} (uid {}) for {}",
        ready.signer.ss58(),
        ready.uid,
        args.orchestrator_url
    );
    let (tx, rx) = tokio::sync::watch::channel(iota_miner::MinerStatus::new(ready.signer.ss58()));
    let progress = tokio::spawn(iota_miner::progress::show(rx, args.progress));
    let result = iota_miner::run(args.miner_config(), ready.signer, shutdown_signal(), tx).await;
    let _ = progress.await;
    let last = result?;
    println!(
        "miner stopped: {} hops, {} tokens, {} pseudo-gradient partitions, {} merges",
        last.hops, last.tokens, last.pseudo_gradients, last.merges
    );
    Ok(())
}

fn main() {
    // One line that says what to fix, not a backtrace: the errors carry their context.
    if let Err(e) = start() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Parses the command line and, while this is the only thread, sets the CPU thread counts (the
/// tensor library reads them from the environment) and the allocator's options for commands
/// that train, then starts the runtime.
fn start() -> anyhow::Result<()> {
    let cli = Cli::parse_from(args_with_config_file()?);
    if let Some(threads) = cpu_threads(&cli) {
        set_cpu_threads(threads);
    }
    if trains(&cli.command) {
        alloc::keep_freed_memory();
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(cli))
}

/// The thread counts to set, if any: `--cpu-threads`, else `localnet up`'s share per model
/// unless the environment already chooses.
fn cpu_threads(cli: &Cli) -> Option<iota_model::CpuThreads> {
    if let Some(n) = cli.cpu_threads {
        return Some(iota_model::CpuThreads::uniform(n));
    }
    match &cli.command {
        Command::Localnet {
            command: LocalnetCommand::Up(args),
        } if !iota_model::CpuThreads::set_in_env() => Some(iota_model::CpuThreads::shared(
            args.models_at_once(),
            iota_model::threads::available_cores(),
        )),
        Command::Miner(m) if m.sub_batches > 1 && !iota_model::CpuThreads::set_in_env() => {
            Some(iota_model::CpuThreads::side_by_side())
        }
        Command::Validator {
            command: ValidatorCommand::Run(v),
        } if v.sub_batches > 1 && !iota_model::CpuThreads::set_in_env() => {
            Some(iota_model::CpuThreads::side_by_side())
        }
        _ => None,
    }
}

/// Whether the command runs training steps (a miner, a validator's replays, a whole local
/// subnet), whose buffers are freed and allocated again at every step.
fn trains(command: &Command) -> bool {
    matches!(
        command,
        Command::Miner(_)
            | Command::Validator {
                command: ValidatorCommand::Run(_)
            }
            | Command::Localnet {
                command: LocalnetCommand::Up(_)
            }
    )
}

#[allow(unsafe_code)]
fn set_cpu_threads(threads: iota_model::CpuThreads) {
    for (name, value) in threads.env() {
        // SAFETY: called from `start` before the runtime exists, while this is the process's
        // only thread, so nothing reads the environment concurrently.
        unsafe { std::env::set_var(name, value) };
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let default_level = match &cli.command {
        Command::Miner(m) if m.debug => "debug",
        Command::Validator {
            command: ValidatorCommand::Run(v),
        } if v.debug => "debug",
        // Warnings only: the status line owns the terminal. The local subnet's 5 s tempo lets a
        // validator busy replaying miss a reveal window, which is expected here (the report
        // checks that weights landed), so set_weights speaks up only for errors.
        Command::Localnet {
            command: LocalnetCommand::Up(_),
        } => "warn,iota_chain::set_weights=error",
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Command::Miner(args) => miner(args).await?,
        Command::Localnet {
            command: LocalnetCommand::Up(args),
        } => {
            up::up(args, shutdown_signal()).await?;
        }
        Command::Localnet {
            command: LocalnetCommand::Chain(command),
        } => iota_localnet::cli::run(iota_localnet::cli::LocalnetArgs { command }).await?,
        Command::Wallet { command } => {
            iota_chain::wallet::cli::run(&command, &mut std::io::stdout())?;
        }
        Command::Chain(args) => iota_chain::cli::run(&args, &mut std::io::stdout()).await?,
        Command::Orchestrator(cmd) => orchestrator(cmd).await?,
        Command::Validator { command } => validator(command).await?,
        Command::Data { command } => tokio::task::block_in_place(|| data::run(command))?,
        Command::Model {
            command:
                ModelCommand::TrainTokenizer {
                    files,
                    vocab_size,
                    out,
                },
        } => {
            let size = iota_model::train_bpe_tokenizer(&files, vocab_size, &out)?;
            println!("wrote {} ({size} tokens)", out.display());
        }
        Command::Model {
            command: ModelCommand::Export(a),
        } => model_cmd::export(a).await?,
        Command::Model {
            command: ModelCommand::Generate(a),
        } => tokio::task::block_in_place(|| model_cmd::generate(a))?,
        Command::Model {
            command: ModelCommand::Eval(a),
        } => tokio::task::block_in_place(|| model_cmd::eval(a))?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every flag of the services (and of the one command that runs a subnet) can also come
    /// from the environment, as services are configured. One-shot commands (`wallet`, `chain`,
    /// `validator audit`) and actions (`--print-openapi`) are left out: an amount, a
    /// destination or an exit taken from a stray environment variable would be worse than none.
    #[test]
    fn every_service_flag_has_an_environment_variable() {
        const ONE_SHOT: [&str; 4] = [
            "iota wallet",
            "iota chain",
            "iota validator audit",
            "iota orchestrator --print-openapi",
        ];
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if arg.is_positional() || id == "help" || id == "version" {
                    continue;
                }
                let flag = format!("{path} --{}", arg.get_long().unwrap_or(id));
                if arg.get_env().is_none() && !ONE_SHOT.contains(&flag.as_str()) {
                    missing.push(flag);
                }
            }
            for sub in cmd.get_subcommands() {
                let path = format!("{path} {}", sub.get_name());
                if !ONE_SHOT.contains(&path.as_str()) {
                    walk(sub, &path, missing);
                }
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "iota", &mut missing);
        assert!(
            missing.is_empty(),
            "flags without an environment variable: {missing:#?}"
        );
        // The walk reaches the services' flags.
        let mut all = Vec::new();
        fn flags(cmd: &clap::Command, out: &mut Vec<String>) {
            out.extend(
                cmd.get_arguments()
                    .filter_map(|a| a.get_long().map(str::to_owned)),
            );
            cmd.get_subcommands().for_each(|s| flags(s, out));
        }
        flags(&Cli::command(), &mut all);
        assert!(all.iter().any(|f| f == "db-max-connections"));
    }

    #[test]
    fn cpu_threads_flag_and_the_localnet_up_default() {
        let parse = |args: &[&str]| Cli::try_parse_from(args).expect("parses");
        let flag = parse(&["iota", "validator", "scores", "--cpu-threads", "3"]);
        assert_eq!(cpu_threads(&flag), Some(iota_model::CpuThreads::uniform(3)));
        // A dedicated miner keeps candle's defaults.
        assert_eq!(cpu_threads(&parse(&["iota", "miner"])), None);
        // Runs of a cut micro-batch side by side: products on every core, element-wise
        // operations on one thread each (candle's pool would make the runs take turns).
        if !iota_model::CpuThreads::set_in_env() {
            assert_eq!(
                cpu_threads(&parse(&["iota", "miner", "--sub-batches", "2"])),
                Some(iota_model::CpuThreads::side_by_side())
            );
            let validator = parse(&["iota", "validator", "run", "--sub-batches", "2"]);
            assert_eq!(
                cpu_threads(&validator),
                Some(iota_model::CpuThreads::side_by_side())
            );
        }
        assert!(Cli::try_parse_from(["iota", "miner", "--sub-batches", "0"]).is_err());
        // `localnet up` shares the cores out between its 3 x 2 miners, one adversary and two
        // validators, unless the environment already chooses.
        fn up_args(cli: &Cli) -> &up::UpArgs {
            match &cli.command {
                Command::Localnet {
                    command: LocalnetCommand::Up(args),
                } => args,
                other => panic!("parsed as {other:?}"),
            }
        }
        let up = parse(&["iota", "localnet", "up", "--adversary", "zeros"]);
        assert_eq!(up_args(&up).models_at_once(), 9);
        let stages4 = parse(&["iota", "localnet", "up", "--stages", "4"]);
        assert_eq!(up_args(&stages4).models_at_once(), 10);
        if !iota_model::CpuThreads::set_in_env() {
            assert_eq!(
                cpu_threads(&up),
                Some(iota_model::CpuThreads::shared(
                    9,
                    iota_model::threads::available_cores()
                ))
            );
        }
    }

    #[test]
    fn flags_are_consistent_and_audit_parses() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "iota",
            "validator",
            "audit",
            "--epoch",
            "41",
            "--netuid",
            "3",
            "--database.url",
            "postgres://v@db/v",
        ])
        .expect("audit parses");
        match cli.command {
            Command::Validator {
                command: ValidatorCommand::Audit(a),
            } => {
                assert_eq!((a.epoch, a.json, a.validator.netuid), (41, false, 3));
                assert_eq!(
                    a.validator.database_url.as_deref(),
                    Some("postgres://v@db/v")
                );
            }
            other => panic!("parsed as {other:?}"),
        }
        assert!(
            Cli::try_parse_from(["iota", "validator", "audit"]).is_err(),
            "--epoch is required"
        );
        // The public audit names the validator and needs neither database nor wallet.
        let cli = Cli::try_parse_from([
            "iota",
            "validator",
            "audit",
            "--epoch",
            "7",
            "--validator",
            "5Validator",
        ])
        .expect("public audit parses");
        match cli.command {
            Command::Validator {
                command: ValidatorCommand::Audit(a),
            } => {
                assert_eq!(a.public.as_deref(), Some("5Validator"));
                assert_eq!(a.validator.database_url, None);
            }
            other => panic!("parsed as {other:?}"),
        }
    }
}
