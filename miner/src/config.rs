//! Configuration: the library's [`MinerConfig`] and the `iota miner` flags that build it.
//!
//! Flags follow Bittensor's conventions (`--wallet.name`, `--subtensor.network`, `--netuid`, …);
//! every flag can also come from the environment, and `--config FILE` reads a TOML file whose
//! keys are flag names (`"wallet.name" = "miner"`, `netuid = 9`). Precedence: command line, then
//! the file, then the environment, then the default.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use iota_chain::cli::SubtensorArgs;
use iota_chain::wallet::cli::WalletArgs;
use iota_model::{DType, Device, StageOptions};
use iota_protocol::client::RetryPolicy;

use crate::adversary::Adversary;
use crate::error::MinerError;

/// Where the stage trains. The CUDA default computes in f32: an epoch replayed by a validator
/// on the CPU then matches it within the default spot-check thresholds, while bf16 compute, about
/// 1.4x faster on an H100, drifts past them (model/README.md, "Half precision").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU, f32.
    Cpu,
    /// CUDA device `n`, f32 compute; needs the `cuda` feature.
    Cuda(usize),
    /// CUDA device `n`, bf16 compute with f32 master weights; needs the `cuda` feature. Only for
    /// runs whose validators replay in bf16 on a GPU.
    CudaBf16(usize),
}

impl DeviceSpec {
    /// Parses `cpu`, `cuda:N` or `cuda:N:bf16` (`cuda` alone is device 0).
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || format!("device {s:?}: use cpu, cuda:N or cuda:N:bf16");
        let Some(rest) = s.strip_prefix("cuda") else {
            return if s == "cpu" {
                Ok(Self::Cpu)
            } else {
                Err(bad())
            };
        };
        let (ordinal, bf16) = match rest.strip_suffix(":bf16") {
            Some(r) => (r, true),
            None => (rest, false),
        };
        let n = match ordinal {
            "" => 0,
            o => o
                .strip_prefix(':')
                .and_then(|n| n.parse().ok())
                .ok_or_else(bad)?,
        };
        Ok(if bf16 {
            Self::CudaBf16(n)
        } else {
            Self::Cuda(n)
        })
    }

    /// `cpu`, `cuda:N` or `cuda:N:bf16`.
    pub fn name(&self) -> String {
        match self {
            Self::Cpu => "cpu".into(),
            Self::Cuda(n) => format!("cuda:{n}"),
            Self::CudaBf16(n) => format!("cuda:{n}:bf16"),
        }
    }

    /// The CUDA ordinal, if any.
    pub fn cuda_ordinal(&self) -> Option<usize> {
        match self {
            Self::Cpu => None,
            Self::Cuda(n) | Self::CudaBf16(n) => Some(*n),
        }
    }

    /// The dtype of the stage's arithmetic on this device.
    pub fn compute_dtype(&self) -> DType {
        match self {
            Self::CudaBf16(_) => DType::BF16,
            Self::Cpu | Self::Cuda(_) => DType::F32,
        }
    }

    /// The stage options for this device.
    pub fn stage_options(&self) -> Result<StageOptions, MinerError> {
        let Some(n) = self.cuda_ordinal() else {
            return Ok(StageOptions::cpu());
        };
        let device = Device::new_cuda(n).map_err(|e| {
            MinerError::Config(format!(
                "{}: {e} (build with `--features cuda` on a machine with a GPU)",
                self.name()
            ))
        })?;
        Ok(StageOptions {
            device,
            compute_dtype: self.compute_dtype(),
            ..StageOptions::cpu()
        })
    }
}

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProgressMode {
    /// A status line on a terminal, log lines otherwise.
    Auto,
    /// A status line, redrawn in place.
    Line,
    /// A structured log line every few seconds.
    Log,
    /// Nothing beyond the logs.
    Off,
}

/// Everything [`crate::run`] needs besides the signer.
#[derive(Clone, Debug)]
pub struct MinerConfig {
    /// The orchestrator's base URL.
    pub orchestrator_url: String,
    /// Training device.
    pub device: DeviceSpec,
    /// Pause between polls when there is nothing to do.
    pub poll_interval: Duration,
    /// Work items asked for per poll.
    pub max_items: u32,
    /// Forward caches kept for pending backward passes before recomputing instead (default:
    /// what the memory holds, from the start-up test; see [`crate::capacity::cache_budget`]).
    pub cache_budget: Option<usize>,
    /// Keep only each block's input between a forward and its backward, which recomputes the
    /// blocks one at a time: far less memory per sample in flight for about one more forward
    /// (the gradients are the same bits).
    pub checkpoint_blocks: bool,
    /// Runs each micro-batch is cut into, side by side on the CPU's cores
    /// ([`StageOptions::sub_batches`]; 1: the micro-batch whole).
    pub sub_batches: usize,
    /// Memory to report; measured when `None`.
    pub memory_bytes: Option<u64>,
    /// Throughput to report; measured when `None` (a one-block estimate at registration, then
    /// the start-up test of the miner's own stage).
    pub tokens_per_s: Option<f64>,
    /// A dishonest behaviour, for testing validators.
    pub adversary: Option<Adversary>,
    /// Retries of network errors, 429 and 5xx.
    pub retry: RetryPolicy,
    /// Seed of the miner's own randomness (the noise adversary).
    pub seed: u64,
    /// A local copy of the run's prepared dataset (`iota data prepare`), for a run that names
    /// one. Without it, the dataset is fetched from the run's store into `data_cache`.
    pub data_dir: Option<std::path::PathBuf>,
    /// Where a dataset fetched from the run's store is kept: `<data_cache>/<manifest BLAKE3>/`.
    pub data_cache: std::path::PathBuf,
    /// Upload straight to the run's store through presigned URLs where it takes them (off:
    /// always through the orchestrator).
    pub direct_uploads: bool,
}

impl MinerConfig {
    /// Defaults for a miner of the orchestrator at `url` on the CPU.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            orchestrator_url: url.into(),
            device: DeviceSpec::Cpu,
            poll_interval: Duration::from_millis(200),
            max_items: 4,
            cache_budget: None,
            checkpoint_blocks: false,
            sub_batches: 1,
            memory_bytes: None,
            tokens_per_s: None,
            adversary: None,
            retry: RetryPolicy::default(),
            seed: 0,
            data_dir: None,
            data_cache: iota_protocol::dataset_cache::DEFAULT_DATA_CACHE.into(),
            direct_uploads: true,
        }
    }

    /// The stage options for the configured device.
    pub fn stage_options(&self) -> Result<StageOptions, MinerError> {
        Ok(StageOptions {
            checkpoint_blocks: self.checkpoint_blocks,
            sub_batches: self.sub_batches.max(1),
            ..self.device.stage_options()?
        })
    }
}

/// `iota miner` flags. Every flag can also come from the environment.
#[derive(Clone, Debug, clap::Args)]
pub struct MinerArgs {
    /// A TOML file of flag values (`"wallet.name" = "m1"`, `netuid = 9`); the command line wins.
    #[arg(long, env = "IOTA_MINER_CONFIG")]
    pub config: Option<PathBuf>,
    /// The miner's wallet (the hotkey signs every request).
    #[command(flatten)]
    pub wallet: WalletArgs,
    /// Chain endpoint selection.
    #[command(flatten)]
    pub subtensor: SubtensorArgs,
    /// Subnet.
    #[arg(long, env = "BT_NETUID", default_value_t = 9)]
    pub netuid: u16,
    /// The orchestrator's base URL.
    #[arg(
        long = "orchestrator.url",
        env = "IOTA_ORCHESTRATOR_URL",
        default_value = "http://127.0.0.1:8700"
    )]
    pub orchestrator_url: String,
    /// Training device: cpu, cuda:N (f32 compute) or cuda:N:bf16.
    #[arg(long, env = "IOTA_DEVICE", default_value = "cpu", value_parser = DeviceSpec::parse)]
    pub device: DeviceSpec,
    /// Debug logging.
    #[arg(long = "logging.debug", env = "BT_LOGGING_DEBUG")]
    pub debug: bool,
    /// Register the hotkey (burned_register) if it is not registered yet.
    #[arg(long, env = "IOTA_REGISTER")]
    pub register: bool,
    /// Refuse to register when the burn is above this many TAO.
    #[arg(long = "max-burn", env = "IOTA_MAX_BURN")]
    pub max_burn: Option<f64>,
    /// Register without asking for confirmation.
    #[arg(long, env = "IOTA_YES")]
    pub yes: bool,
    /// Axon IP to publish on-chain (submitted only when it differs from what is served).
    #[arg(long = "axon.ip", env = "BT_AXON_IP")]
    pub axon_ip: Option<IpAddr>,
    /// Axon port to publish on-chain.
    #[arg(long = "axon.port", env = "BT_AXON_PORT", default_value_t = 8091)]
    pub axon_port: u16,
    /// Serve Prometheus metrics on this address (`127.0.0.1:9100`).
    #[arg(long = "metrics.addr", env = "IOTA_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Progress display.
    #[arg(long, env = "IOTA_PROGRESS", value_enum, default_value = "auto")]
    pub progress: ProgressMode,
    /// Milliseconds between polls when idle.
    #[arg(
        long = "poll-interval-ms",
        env = "IOTA_POLL_INTERVAL_MS",
        default_value_t = 200
    )]
    pub poll_interval_ms: u64,
    /// Work items per poll.
    #[arg(long = "max-items", env = "IOTA_MAX_ITEMS", default_value_t = 4)]
    pub max_items: u32,
    /// Forward caches kept before recomputing (default: as many as the free memory holds beside
    /// the stage, by the start-up test's measure of one sequence, at most twice the run's
    /// in-flight limit).
    #[arg(long = "cache-budget", env = "IOTA_CACHE_BUDGET")]
    pub cache_budget: Option<usize>,
    /// Activation checkpointing: keep each block's input only and recompute the blocks one at a
    /// time in the backward (much less memory per sample in flight, about one more forward).
    #[arg(long = "checkpoint-blocks", env = "IOTA_CHECKPOINT_BLOCKS")]
    pub checkpoint_blocks: bool,
    /// Cut each micro-batch into this many runs of sequences, trained side by side, one per
    /// core: on a CPU of 2 cores or more, 2 is faster than 1 (`BENCHMARKS.md`, cpu-vs-torch).
    /// Unless the environment chooses, `iota miner` then runs element-wise operations on one
    /// thread each, since candle's element-wise pool makes concurrent runs take turns.
    #[arg(long = "sub-batches", env = "IOTA_SUB_BATCHES", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub sub_batches: u16,
    /// Memory to report to the orchestrator, in GB (measured when absent).
    #[arg(long = "memory-gb", env = "IOTA_MEMORY_GB")]
    pub memory_gb: Option<f64>,
    /// Cheat in this way (for testing validators only).
    #[arg(long, env = "IOTA_ADVERSARY", value_enum)]
    pub adversary: Option<Adversary>,
    /// A local copy of the run's prepared dataset folder (`iota data prepare`), refused unless
    /// its manifest hashes to the run's. Without it, a run's dataset is fetched from its store
    /// into --data-cache.
    #[arg(long = "data-dir", env = "IOTA_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Where a dataset fetched from the run's store is kept, in a folder named by its
    /// manifest's BLAKE3; files already there that hash right are not fetched again.
    #[arg(long = "data-cache", env = "IOTA_DATA_CACHE", default_value = iota_protocol::dataset_cache::DEFAULT_DATA_CACHE)]
    pub data_cache: PathBuf,
    /// Send every upload through the orchestrator, even where the run's store takes them
    /// straight through presigned URLs (for a network that cannot reach the store).
    #[arg(long = "no-direct-uploads", env = "IOTA_NO_DIRECT_UPLOADS")]
    pub no_direct_uploads: bool,
}

impl MinerArgs {
    /// The library config.
    pub fn miner_config(&self) -> MinerConfig {
        MinerConfig {
            orchestrator_url: self.orchestrator_url.clone(),
            device: self.device.clone(),
            poll_interval: Duration::from_millis(self.poll_interval_ms),
            max_items: self.max_items.clamp(1, iota_protocol::api::MAX_WORK_ITEMS),
            cache_budget: self.cache_budget,
            checkpoint_blocks: self.checkpoint_blocks,
            sub_batches: usize::from(self.sub_batches),
            memory_bytes: self.memory_gb.map(|g| (g * 1e9) as u64),
            tokens_per_s: None,
            adversary: self.adversary,
            retry: RetryPolicy::default(),
            seed: rand::random(),
            data_dir: self.data_dir.clone(),
            data_cache: self.data_cache.clone(),
            direct_uploads: !self.no_direct_uploads,
        }
    }
}

/// Reads a `--config` TOML file into command-line arguments (`--key value`, `--flag` for
/// `true`), to be placed before the real ones so that those win.
pub fn config_file_args(path: &Path) -> Result<Vec<String>, MinerError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| MinerError::Config(format!("{}: {e}", path.display())))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| MinerError::Config(format!("{}: {e}", path.display())))?;
    let mut args = Vec::new();
    flatten_toml("", &table, &mut args, path)?;
    Ok(args)
}

fn flatten_toml(
    prefix: &str,
    table: &toml::Table,
    args: &mut Vec<String>,
    path: &Path,
) -> Result<(), MinerError> {
    for (k, v) in table {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            // `[wallet] name = "x"` is the same as `"wallet.name" = "x"`.
            toml::Value::Table(t) => flatten_toml(&key, t, args, path)?,
            toml::Value::Boolean(true) => args.push(format!("--{key}")),
            toml::Value::Boolean(false) => {}
            toml::Value::String(s) => args.extend([format!("--{key}"), s.clone()]),
            toml::Value::Integer(i) => args.extend([format!("--{key}"), i.to_string()]),
            toml::Value::Float(f) => args.extend([format!("--{key}"), f.to_string()]),
            other => {
                return Err(MinerError::Config(format!(
                    "{}: {key} = {other}: use a string, number or boolean",
                    path.display()
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_uploads_are_on_unless_turned_off() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: MinerArgs,
        }
        let parse = |flags: &[&str]| {
            let argv = std::iter::once("miner").chain(flags.iter().copied());
            <Cli as clap::Parser>::try_parse_from(argv)
                .expect("parses")
                .args
                .miner_config()
        };
        assert!(parse(&[]).direct_uploads);
        assert!(!parse(&["--no-direct-uploads"]).direct_uploads);
    }

    #[test]
    fn devices_parse() {
        assert_eq!(DeviceSpec::parse("cpu"), Ok(DeviceSpec::Cpu));
        assert_eq!(DeviceSpec::parse("cuda"), Ok(DeviceSpec::Cuda(0)));
        assert_eq!(DeviceSpec::parse("cuda:1"), Ok(DeviceSpec::Cuda(1)));
        assert_eq!(DeviceSpec::parse("cuda:bf16"), Ok(DeviceSpec::CudaBf16(0)));
        assert_eq!(
            DeviceSpec::parse("cuda:2:bf16"),
            Ok(DeviceSpec::CudaBf16(2))
        );
        for bad in [
            "gpu",
            "cuda:x",
            "cuda:",
            "cuda1",
            "cuda:1:f16",
            "cuda:1:bf16:2",
            "cpu:bf16",
        ] {
            assert!(DeviceSpec::parse(bad).is_err(), "{bad}");
        }
        for spec in ["cpu", "cuda:0", "cuda:3:bf16"] {
            assert_eq!(DeviceSpec::parse(spec).unwrap().name(), spec);
        }
    }

    /// A GPU miner computes in f32 unless bf16 is asked for: an f32 replay on a validator's CPU
    /// does not match bf16 work within the default thresholds.
    #[test]
    fn cuda_computes_in_f32_unless_bf16_is_asked_for() {
        assert_eq!(DeviceSpec::Cpu.compute_dtype(), DType::F32);
        assert_eq!(DeviceSpec::Cuda(0).compute_dtype(), DType::F32);
        assert_eq!(DeviceSpec::CudaBf16(0).compute_dtype(), DType::BF16);
    }

    #[test]
    fn config_file_becomes_flags() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("miner.toml");
        std::fs::write(
            &path,
            "netuid = 7\nregister = true\nyes = false\n\"orchestrator.url\" = \"http://o:1\"\n[wallet]\nname = \"m1\"\n",
        )
        .expect("write");
        let mut args = config_file_args(&path).expect("parse");
        args.sort();
        let mut want: Vec<String> = [
            "--netuid",
            "7",
            "--register",
            "--orchestrator.url",
            "http://o:1",
            "--wallet.name",
            "m1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        want.sort();
        assert_eq!(args, want);
        std::fs::write(&path, "netuid = [1]\n").expect("write");
        assert!(config_file_args(&path).is_err());
    }
}
