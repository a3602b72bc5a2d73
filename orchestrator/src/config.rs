//! Configuration: the library's [`Config`] and the `iota orchestrator` flags that build it.

use std::net::SocketAddr;
use std::time::Duration;

use iota_chain::cli::SubtensorArgs;
use iota_chain::wallet::cli::WalletArgs;
use iota_protocol::api::{RunConfig, SparseEncoding};
use iota_protocol::signing::SkewWindow;
use iota_protocol::tensor::{MAX_SPARSE_CHUNK, WireEncoding};

use crate::app::Limits;
use crate::store::StoreConfig;

/// Everything [`crate::run`] needs.
#[derive(Clone, Debug)]
pub struct Config {
    /// PostgreSQL URL.
    pub database_url: String,
    /// Pool size.
    pub db_max_connections: u32,
    /// Blob store.
    pub store: StoreConfig,
    /// Chain endpoint (ws:// or wss://).
    pub chain_endpoint: String,
    /// Time allowed to connect to the chain and for each request to it.
    pub chain_timeout: Duration,
    /// Reverse proxies whose `X-Forwarded-For` names the client (see `--trusted-proxies`).
    pub trusted_proxies: Vec<std::net::IpAddr>,
    /// Subnet.
    pub netuid: u16,
    /// The orchestrator's hotkey (SS58): what miners sign their requests for.
    pub hotkey: String,
    /// The run.
    pub run: RunConfig,
    /// Time between checks of the chain's finalized block (the metagraph is read when it is
    /// new).
    pub metagraph_refresh: Duration,
    /// Accepted clock skew of signed requests.
    pub skew: SkewWindow,
    /// Rate and size limits.
    pub limits: Limits,
    /// Time between phase-driver steps.
    pub tick: Duration,
    /// Merge reassignment rounds before the last merge deadline.
    pub max_merge_rounds: u32,
    /// Where the run's prepared dataset is, copied into the store at start (`None`: the run
    /// names none, or it is in the store already).
    pub dataset: Option<crate::dataset::DatasetSource>,
}

/// The model-derived parts of a run config, computed by the caller (the orchestrator never
/// loads the model).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Model name or path, as miners should load it.
    pub model: String,
    /// Flat parameter count per stage.
    pub stage_params: Vec<u64>,
    /// Width of the boundary tensor between stages.
    pub boundary_dim: u32,
    /// BLAKE3 of the prepared dataset's manifest, checked by the caller against the model's
    /// vocabulary; `None` for the embedded grammar corpus.
    pub dataset: Option<String>,
    /// Bytes a miner needs for each stage at the run's micro-batch (see
    /// [`RunConfig::stage_memory`]); empty to count parameters only.
    pub stage_memory: Vec<u64>,
}

/// The fewest database connections an orchestrator can work with.
pub const MIN_DB_CONNECTIONS: u32 = 4;

/// Bounds of the signed requests' clock window (`--max-request-age-ms`,
/// `--max-request-future-ms`), in milliseconds.
pub const MIN_REQUEST_AGE_MS: u64 = 1_000;
/// See [`MIN_REQUEST_AGE_MS`].
pub const MAX_SKEW_MS: u64 = 3_600_000;
/// Longest a session may last (`--session-ttl-s` is clamped to a minute .. this).
pub const MAX_SESSION_TTL_S: u64 = 86_400;

/// `iota orchestrator` flags. Every flag can also come from the environment.
#[derive(Clone, Debug, clap::Args)]
pub struct OrchestratorArgs {
    /// Address to listen on.
    #[arg(long, env = "IOTA_LISTEN", default_value = "127.0.0.1:8700")]
    pub listen: SocketAddr,
    /// PostgreSQL URL (required to serve).
    #[arg(long = "database-url", env = "DATABASE_URL")]
    pub database_url: Option<String>,
    /// Database pool size.
    #[arg(
        long = "db-max-connections",
        env = "IOTA_DB_MAX_CONNECTIONS",
        default_value_t = 32
    )]
    pub db_max_connections: u32,
    /// Blob store: a directory (`./store`, `file:///srv/iota`) or
    /// `s3://bucket?endpoint=http://host:port&region=…&presign_ttl_s=900` (credentials from
    /// AWS_* variables; presigned URLs last presign_ttl_s).
    #[arg(long, env = "IOTA_STORE", default_value = "./iota-store")]
    pub store: String,
    /// Chain endpoint selection.
    #[command(flatten)]
    pub subtensor: SubtensorArgs,
    /// Subnet (required to serve).
    #[arg(long, env = "BT_NETUID")]
    pub netuid: Option<u16>,
    /// The orchestrator's wallet (only the hotkey's public key is read).
    #[command(flatten)]
    pub wallet: WalletArgs,
    /// Run name: a database holds several runs, each resumed by name.
    #[arg(long = "run-name", env = "IOTA_RUN_NAME", default_value = "iota")]
    pub run_name: String,
    /// Partitions per stage for the butterfly merge.
    #[arg(long, env = "IOTA_PARTITIONS", default_value_t = 4)]
    pub partitions: u32,
    /// Sequences per sample.
    #[arg(long = "micro-batch", env = "IOTA_MICRO_BATCH", default_value_t = 4)]
    pub micro_batch: u32,
    /// Tokens per sequence.
    #[arg(long = "seq-len", env = "IOTA_SEQ_LEN", default_value_t = 64)]
    pub seq_len: u32,
    /// Boundary tensor encoding: f32, int8 or int4.
    #[arg(long, env = "IOTA_WIRE", default_value = "int8", value_parser = parse_wire)]
    pub wire: WireEncoding,
    /// How pseudo-gradients travel: `dense` (f32 partitions, merges carry the new weights) or
    /// `top-K/CHUNK` (K of every CHUNK values kept, quantised, with error feedback; merges are the
    /// compressed average update, which every miner applies), e.g. `top-64/4096`.
    #[arg(
        long = "pseudo-gradients",
        env = "IOTA_PSEUDO_GRADIENTS",
        default_value = "dense",
        value_parser = parse_pseudo_gradients
    )]
    pub pseudo_gradients: PseudoGradients,
    /// With `--pseudo-gradients top-K/CHUNK`: values each merged update keeps per chunk, K to
    /// CHUNK (default K). The average of N uploads holds up to N·K values a chunk; keeping more
    /// of them costs every miner the same bytes whatever N is.
    #[arg(long = "merged-top", env = "IOTA_MERGED_TOP")]
    pub merged_top: Option<u32>,
    /// With `--pseudo-gradients top-K/CHUNK`: bits of each kept value, 8 or 4 (default 8).
    #[arg(long = "sparse-bits", env = "IOTA_SPARSE_BITS")]
    pub sparse_bits: Option<u8>,
    /// Samples per epoch.
    #[arg(
        long = "samples-per-epoch",
        env = "IOTA_SAMPLES_PER_EPOCH",
        default_value_t = 256
    )]
    pub samples_per_epoch: u64,
    /// Samples one miner holds in flight.
    #[arg(
        long = "max-in-flight",
        env = "IOTA_MAX_IN_FLIGHT",
        default_value_t = 8
    )]
    pub max_in_flight: u32,
    /// Seconds of the training phase.
    #[arg(long = "training-s", env = "IOTA_TRAINING_S", default_value_t = 600)]
    pub training_s: u64,
    /// Seconds of the uploading phase.
    #[arg(long = "uploading-s", env = "IOTA_UPLOADING_S", default_value_t = 120)]
    pub uploading_s: u64,
    /// Seconds of the merging phase.
    #[arg(long = "merging-s", env = "IOTA_MERGING_S", default_value_t = 120)]
    pub merging_s: u64,
    /// Seconds of each merge reassignment round.
    #[arg(
        long = "merge-round-s",
        env = "IOTA_MERGE_ROUND_S",
        default_value_t = 60
    )]
    pub merge_round_s: u64,
    /// Merge reassignment rounds.
    #[arg(long = "merge-rounds", env = "IOTA_MERGE_ROUNDS", default_value_t = 2)]
    pub merge_rounds: u32,
    /// Seconds a work lease lasts.
    #[arg(long = "lease-s", env = "IOTA_LEASE_S", default_value_t = 60)]
    pub lease_s: u64,
    /// Seconds without heartbeat before a miner is released.
    #[arg(
        long = "heartbeat-timeout-s",
        env = "IOTA_HEARTBEAT_TIMEOUT_S",
        default_value_t = 90
    )]
    pub heartbeat_timeout_s: u64,
    /// Epochs of objects to keep (at least 2: a validator replays an epoch from the weights merged
    /// at the end of the epoch before).
    #[arg(
        long = "retention-epochs",
        env = "IOTA_RETENTION_EPOCHS",
        default_value_t = 3
    )]
    pub retention_epochs: u64,
    /// Seed of the epoch-0 weights.
    #[arg(long = "init-seed", env = "IOTA_INIT_SEED", default_value_t = 0)]
    pub init_seed: u64,
    /// Outer learning rate.
    #[arg(long = "outer-lr", env = "IOTA_OUTER_LR", default_value_t = 0.7)]
    pub outer_lr: f64,
    /// Outer Nesterov momentum.
    #[arg(
        long = "outer-momentum",
        env = "IOTA_OUTER_MOMENTUM",
        default_value_t = 0.9
    )]
    pub outer_momentum: f64,
    /// Miners' inner AdamW learning rate.
    #[arg(long = "inner-lr", env = "IOTA_INNER_LR", default_value_t = 3e-3)]
    pub inner_lr: f64,
    /// Gradient hops a miner accumulates per local optimizer step.
    #[arg(
        long = "inner-steps-every",
        env = "IOTA_INNER_STEPS_EVERY",
        default_value_t = 2
    )]
    pub inner_steps_every: u32,
    /// Seconds between checks of the chain's finalized block; the metagraph is read again when
    /// that block is new (a newly registered miner is accepted within about this long).
    #[arg(
        long = "metagraph-refresh-s",
        env = "IOTA_METAGRAPH_REFRESH_S",
        default_value_t = 12
    )]
    pub metagraph_refresh_s: u64,
    /// Oldest accepted request, in milliseconds.
    #[arg(
        long = "max-request-age-ms",
        env = "IOTA_MAX_REQUEST_AGE_MS",
        default_value_t = 10_000
    )]
    pub max_request_age_ms: u64,
    /// Furthest accepted request timestamp in the future, in milliseconds.
    #[arg(
        long = "max-request-future-ms",
        env = "IOTA_MAX_REQUEST_FUTURE_MS",
        default_value_t = 5_000
    )]
    pub max_request_future_ms: u64,
    /// Signed requests per second per hotkey.
    #[arg(
        long = "rate-per-hotkey",
        env = "IOTA_RATE_PER_HOTKEY",
        default_value_t = 50
    )]
    pub rate_per_hotkey: u32,
    /// Public requests per second per IP.
    #[arg(long = "rate-per-ip", env = "IOTA_RATE_PER_IP", default_value_t = 50)]
    pub rate_per_ip: u32,
    /// Uploads arriving at once (a partition or a merge streams into the store; a hop's output
    /// is read whole first).
    #[arg(
        long = "max-concurrent-uploads",
        env = "IOTA_MAX_CONCURRENT_UPLOADS",
        default_value_t = 64
    )]
    pub max_concurrent_uploads: usize,
    /// Of those, most from one IP address (0: no limit; behind a proxy that is not in
    /// `--trusted-proxies`, every miner has the proxy's address).
    #[arg(
        long = "max-uploads-per-ip",
        env = "IOTA_MAX_UPLOADS_PER_IP",
        default_value_t = 16
    )]
    pub max_uploads_per_ip: usize,
    /// Of those, most for one hotkey, from however many addresses (0: no limit). A miner
    /// uploads one object at a time.
    #[arg(
        long = "max-uploads-per-hotkey",
        env = "IOTA_MAX_UPLOADS_PER_HOTKEY",
        default_value_t = 4
    )]
    pub max_uploads_per_hotkey: usize,
    /// Signed request bodies (64 KiB at most, read before their signature is checked) that one
    /// IP address may have still arriving at once (0: no limit). A request sent whole takes
    /// none; past the limit a slow one is answered 429 at once.
    #[arg(
        long = "max-unchecked-bodies-per-ip",
        env = "IOTA_MAX_UNCHECKED_BODIES_PER_IP",
        default_value_t = 64
    )]
    pub max_unchecked_bodies_per_ip: usize,
    /// Addresses of the reverse proxies (load balancers) in front of this orchestrator,
    /// comma-separated. A request from one is counted, for the per-IP limits, by the client
    /// address its `X-Forwarded-For` names (the last one that is not itself a proxy); from any
    /// other peer the header is ignored, as anyone can send it.
    #[arg(
        long = "trusted-proxies",
        env = "IOTA_TRUSTED_PROXIES",
        value_delimiter = ','
    )]
    pub trusted_proxies: Vec<std::net::IpAddr>,
    /// Seconds a signed request's body may take to start arriving; then it must keep up 1 MiB
    /// a second on average: a client that falls behind is answered 408 and its slot freed.
    #[arg(
        long = "body-timeout-s",
        env = "IOTA_BODY_TIMEOUT_S",
        default_value_t = 30
    )]
    pub body_timeout_s: u64,
    /// Seconds a session lasts from when it is opened (`POST /v1/sessions`); its requests carry
    /// a MAC instead of an sr25519 signature (see the API documentation).
    #[arg(
        long = "session-ttl-s",
        env = "IOTA_SESSION_TTL_S",
        default_value_t = 3600
    )]
    pub session_ttl_s: u64,
    /// Milliseconds between phase-driver steps.
    #[arg(long = "tick-ms", env = "IOTA_TICK_MS", default_value_t = 500)]
    pub tick_ms: u64,
}

fn parse_wire(s: &str) -> Result<WireEncoding, String> {
    match s {
        "f32" => Ok(WireEncoding::F32),
        "int8" => Ok(WireEncoding::Int8),
        "int4" => Ok(WireEncoding::Int4),
        other => Err(format!("wire encoding {other:?}: use f32, int8 or int4")),
    }
}

/// The `--pseudo-gradients` choice: `None` for dense.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PseudoGradients(pub Option<SparseEncoding>);

/// Parses `--pseudo-gradients`: `dense` or `top-K/CHUNK`.
pub fn parse_pseudo_gradients(s: &str) -> Result<PseudoGradients, String> {
    if s == "dense" {
        return Ok(PseudoGradients(None));
    }
    let bad = || format!("pseudo-gradients {s:?}: use dense or top-K/CHUNK, e.g. top-64/4096");
    let (k, chunk) = s
        .strip_prefix("top-")
        .and_then(|rest| rest.split_once('/'))
        .ok_or_else(bad)?;
    let (k, chunk) = (
        k.parse().map_err(|_| bad())?,
        chunk.parse().map_err(|_| bad())?,
    );
    if !(1..=MAX_SPARSE_CHUNK).contains(&chunk) || !(1..=chunk).contains(&k) {
        return Err(format!(
            "pseudo-gradients {s:?}: K must be 1 to CHUNK, and CHUNK 1 to {MAX_SPARSE_CHUNK}"
        ));
    }
    Ok(PseudoGradients(Some(SparseEncoding::new(chunk, k))))
}

impl OrchestratorArgs {
    /// The run config for a model of `shape`.
    pub fn run_config(&self, shape: ModelShape) -> RunConfig {
        let stage_params = shape.stage_params;
        let mut run = RunConfig {
            name: self.run_name.clone(),
            model: shape.model,
            stages: stage_params.len() as u32,
            stage_params: stage_params.clone(),
            partitions: self.partitions,
            micro_batch: self.micro_batch,
            seq_len: self.seq_len,
            boundary_dim: shape.boundary_dim,
            wire: self.wire,
            samples_per_epoch: self.samples_per_epoch,
            max_in_flight: self.max_in_flight,
            training_s: self.training_s,
            uploading_s: self.uploading_s,
            merging_s: self.merging_s,
            merge_round_s: self.merge_round_s,
            lease_s: self.lease_s,
            heartbeat_timeout_s: self.heartbeat_timeout_s,
            retention_epochs: self.retention_epochs,
            init_seed: self.init_seed,
            outer_lr: self.outer_lr,
            outer_momentum: self.outer_momentum,
            inner_lr: self.inner_lr,
            inner_steps_every: self.inner_steps_every,
            dataset: shape.dataset,
            stage_memory: shape.stage_memory,
            sparse: None,
        };
        run.set_sparse(self.pseudo_gradients.0.map(|s| SparseEncoding {
            merged_k: self.merged_top,
            bits: self.sparse_bits,
            ..s
        }));
        run
    }

    /// The library config. `hotkey` is the orchestrator's SS58 address.
    pub fn config(&self, shape: ModelShape, hotkey: String) -> Result<Config, String> {
        let store = StoreConfig::parse(&self.store)?;
        let chain_endpoint = iota_chain::network::resolve_endpoint(
            &self.subtensor.network,
            self.subtensor.chain_endpoint.as_deref(),
        )
        .map_err(|e| e.to_string())?;
        if (self.merged_top.is_some() || self.sparse_bits.is_some())
            && self.pseudo_gradients.0.is_none()
        {
            return Err(
                "--merged-top and --sparse-bits are for sparse runs: pass --pseudo-gradients top-K/CHUNK"
                    .into(),
            );
        }
        let run = self.run_config(shape);
        run.validate()?;
        let database_url = self
            .database_url
            .clone()
            .ok_or("no database: pass --database-url or set DATABASE_URL")?;
        let netuid = self
            .netuid
            .ok_or("no subnet: pass --netuid or set BT_NETUID")?;
        // The phase driver's lock and the poll view's listener each hold a connection for good;
        // with fewer than two more, requests and driver steps only time out (0 panics in the
        // pool).
        if self.db_max_connections < MIN_DB_CONNECTIONS {
            return Err(format!(
                "--db-max-connections {} is too few: give at least {MIN_DB_CONNECTIONS}",
                self.db_max_connections
            ));
        }
        // Sums and deadlines are taken of these (the replay caches keep uuids for both, and
        // PostgreSQL stamps their expiry): past an hour they overflow nothing, and a window that
        // short of a second refuses requests that took a normal trip.
        if !(MIN_REQUEST_AGE_MS..=MAX_SKEW_MS).contains(&self.max_request_age_ms)
            || self.max_request_future_ms > MAX_SKEW_MS
        {
            return Err(format!(
                "--max-request-age-ms must be {MIN_REQUEST_AGE_MS} to {MAX_SKEW_MS}, and \
                 --max-request-future-ms at most {MAX_SKEW_MS}"
            ));
        }
        if self.max_concurrent_uploads == 0 {
            return Err(
                "--max-concurrent-uploads 0 would refuse every upload: give at least 1".into(),
            );
        }
        Ok(Config {
            database_url,
            db_max_connections: self.db_max_connections,
            store,
            chain_endpoint,
            chain_timeout: Duration::from_secs(self.subtensor.timeout.max(1)),
            // As peers are compared: IPv4-mapped IPv6 as IPv4.
            trusted_proxies: self
                .trusted_proxies
                .iter()
                .map(|ip| crate::auth::unmapped(*ip))
                .collect(),
            netuid,
            hotkey,
            run,
            metagraph_refresh: Duration::from_secs(self.metagraph_refresh_s.max(1)),
            skew: SkewWindow {
                max_age_ms: self.max_request_age_ms,
                max_future_ms: self.max_request_future_ms,
            },
            limits: Limits {
                per_hotkey_rps: self.rate_per_hotkey,
                per_hotkey_burst: self.rate_per_hotkey.saturating_mul(4),
                per_ip_rps: self.rate_per_ip,
                per_ip_burst: self.rate_per_ip.saturating_mul(4),
                concurrent_uploads: self.max_concurrent_uploads,
                concurrent_uploads_per_ip: self.max_uploads_per_ip,
                concurrent_uploads_per_hotkey: self.max_uploads_per_hotkey,
                unchecked_bodies_per_ip: self.max_unchecked_bodies_per_ip,
                body_timeout: Duration::from_secs(self.body_timeout_s.max(1)),
                session_ttl: Duration::from_secs(self.session_ttl_s.clamp(60, MAX_SESSION_TTL_S)),
                ..Limits::default()
            },
            tick: Duration::from_millis(self.tick_ms.max(10)),
            max_merge_rounds: self.merge_rounds,
            dataset: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: OrchestratorArgs,
    }

    fn config(flags: &[&str]) -> Result<Config, String> {
        let mut argv = vec!["iota", "--database-url", "postgres://x/y", "--netuid", "3"];
        argv.extend_from_slice(flags);
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        let shape = ModelShape {
            model: "tiny".into(),
            stage_params: vec![1000, 1000],
            boundary_dim: 8,
            dataset: None,
            stage_memory: vec![5000, 6000],
        };
        cli.args.config(shape, "5Grw".into())
    }

    #[test]
    fn pseudo_gradients_are_dense_or_top_k_of_a_chunk() {
        let run = |flags: &[&str]| config(flags).map(|c| c.run.sparse);
        assert_eq!(run(&[]), Ok(None));
        assert_eq!(run(&["--pseudo-gradients", "dense"]), Ok(None));
        assert_eq!(
            run(&["--pseudo-gradients", "top-64/4096"]),
            Ok(Some(SparseEncoding::new(4096, 64)))
        );
        assert_eq!(
            run(&["--pseudo-gradients", "top-64/4096", "--merged-top", "256"]),
            Ok(Some(SparseEncoding {
                chunk: 4096,
                k: 64,
                merged_k: Some(256),
                bits: None,
            }))
        );
        assert_eq!(
            run(&["--pseudo-gradients", "top-64/4096", "--sparse-bits", "4"]),
            Ok(Some(SparseEncoding {
                bits: Some(4),
                ..SparseEncoding::new(4096, 64)
            }))
        );
        for (flags, says) in [
            (
                &["--merged-top", "256"][..],
                "--merged-top and --sparse-bits are for sparse runs",
            ),
            (
                &["--sparse-bits", "4"][..],
                "--merged-top and --sparse-bits are for sparse runs",
            ),
            (
                &["--pseudo-gradients", "top-64/4096", "--sparse-bits", "2"],
                "8 or 4 bits, not 2",
            ),
            (
                &["--pseudo-gradients", "top-64/4096", "--merged-top", "32"],
                "keep 64 to 4096",
            ),
            (
                &["--pseudo-gradients", "top-64/4096", "--merged-top", "4097"],
                "keep 64 to 4096",
            ),
        ] {
            let e = run(flags).unwrap_err();
            assert!(e.contains(says), "{flags:?}: {e}");
        }
        // Its miners need room for the error feedback and the outer momentum too.
        let memory = |flags: &[&str]| config(flags).map(|c| c.run.stage_memory);
        assert_eq!(memory(&[]), Ok(vec![5000, 6000]));
        assert_eq!(
            memory(&["--pseudo-gradients", "top-64/4096"]),
            Ok(vec![13_000, 14_000])
        );
        for bad in [
            "top-0/4096",
            "top-65/64",
            "top-1/65537",
            "top-64",
            "64/4096",
            "sparse",
        ] {
            let e = run(&["--pseudo-gradients", bad]).unwrap_err();
            assert!(e.contains("pseudo-gradients"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_clock_window_out_of_bounds_is_a_clear_error() {
        for flags in [
            ["--max-request-age-ms", "18446744073709551615"],
            ["--max-request-age-ms", "0"],
            ["--max-request-future-ms", "18446744073709551615"],
        ] {
            let e = config(&flags).expect_err(flags[1]);
            assert!(e.contains(flags[0]), "{e}");
        }
        let ok = config(&["--max-request-age-ms", "3600000"]).expect("an hour");
        assert_eq!(ok.skew.max_age_ms, MAX_SKEW_MS);
    }

    #[test]
    fn every_limit_flag_reaches_the_limits() {
        let c = config(&[
            "--rate-per-hotkey",
            "7",
            "--rate-per-ip",
            "9",
            "--max-concurrent-uploads",
            "5",
            "--max-uploads-per-ip",
            "3",
            "--max-uploads-per-hotkey",
            "2",
            "--max-unchecked-bodies-per-ip",
            "11",
            "--body-timeout-s",
            "13",
            "--session-ttl-s",
            "600",
        ])
        .expect("valid limits");
        let l = &c.limits;
        assert_eq!((l.per_hotkey_rps, l.per_hotkey_burst), (7, 28));
        assert_eq!((l.per_ip_rps, l.per_ip_burst), (9, 36));
        assert_eq!(
            (
                l.concurrent_uploads,
                l.concurrent_uploads_per_ip,
                l.concurrent_uploads_per_hotkey,
                l.unchecked_bodies_per_ip
            ),
            (5, 3, 2, 11)
        );
        assert_eq!(l.body_timeout, Duration::from_secs(13));
        assert_eq!(l.session_ttl, Duration::from_secs(600));
        // A session lasts at least a minute (the client renews one that has less left) and at
        // most a day.
        let ttl = |s: &str| {
            config(&["--session-ttl-s", s])
                .expect("valid")
                .limits
                .session_ttl
        };
        assert_eq!(ttl("1"), Duration::from_secs(60));
        assert_eq!(ttl("999999999"), Duration::from_secs(MAX_SESSION_TTL_S));
        // The widest clock window allowed each way is accepted.
        let widest = MAX_SKEW_MS.to_string();
        let c = config(&[
            "--max-request-age-ms",
            &widest,
            "--max-request-future-ms",
            &widest,
        ])
        .expect("the widest window");
        assert_eq!(c.skew.max_future_ms, MAX_SKEW_MS);
    }

    #[test]
    fn too_small_a_pool_or_no_upload_slot_is_a_clear_error() {
        for n in ["0", "2", "3"] {
            let e = config(&["--db-max-connections", n]).expect_err(n);
            assert!(e.contains("--db-max-connections"), "{e}");
        }
        let e = config(&["--max-concurrent-uploads", "0"]).expect_err("no slot");
        assert!(e.contains("--max-concurrent-uploads"), "{e}");
        let ok = config(&["--db-max-connections", "4"]).expect("the fewest that work");
        assert_eq!(ok.db_max_connections, MIN_DB_CONNECTIONS);
        let quick = config(&["--subtensor.timeout", "2"]).expect("a chain timeout");
        assert_eq!(quick.chain_timeout, Duration::from_secs(2));
    }
}
