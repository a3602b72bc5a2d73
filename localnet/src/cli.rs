//! `iota localnet …`: run a local chain, or regenerate its committed metadata.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::{ChainConfig, Localnet, LocalnetConfig, LocalnetError};

#[derive(Debug, clap::Args)]
pub struct LocalnetArgs {
    #[command(subcommand)]
    pub command: LocalnetCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum LocalnetCommand {
    /// Run a subtensor-compatible chain serving JSON-RPC on WebSocket and HTTP.
    Chain(ChainArgs),
    /// Write the localnet's runtime metadata (the committed `metadata/localnet.scale`).
    Metadata {
        /// Output file.
        #[arg(long, env = "IOTA_LOCALNET_METADATA_OUT", default_value = crate::metadata::COMMITTED_PATH)]
        out: PathBuf,
    },
}

#[derive(Debug, clap::Args)]
pub struct ChainArgs {
    /// Address to listen on.
    #[arg(long, env = "IOTA_LOCALNET_HOST", default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Port for JSON-RPC (WebSocket and HTTP on the same port); 0 picks a free one.
    #[arg(long, env = "IOTA_LOCALNET_PORT", default_value_t = 9944)]
    pub port: u16,
    /// Block interval, e.g. `250ms` or `2s`; `0` turns the timer off.
    #[arg(long, env = "IOTA_LOCALNET_BLOCK_TIME", default_value = "250ms", value_parser = parse_duration)]
    pub block_time: Duration,
    /// Also make a block as soon as a transaction arrives.
    #[arg(long, env = "IOTA_LOCALNET_INSTANT")]
    pub instant: bool,
    /// Tempo (blocks between epochs) given to newly registered subnets.
    #[arg(long, env = "IOTA_LOCALNET_TEMPO", default_value_t = 10)]
    pub tempo: u16,
    /// `CommitRevealWeightsVersion` at genesis: 4 for drand-timelocked commits (finney's), 2
    /// for hash commits.
    #[arg(long, env = "IOTA_LOCALNET_COMMIT_REVEAL_VERSION", default_value_t = crate::chain::DEFAULT_COMMIT_REVEAL_VERSION)]
    pub commit_reveal_version: u16,
    /// Seconds between rounds of the chain's own drand beacon.
    #[arg(long, env = "IOTA_LOCALNET_DRAND_PERIOD", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub drand_period: u32,
    /// 32 bytes of hex seeding the beacon's key, for a test that opens commits itself; a fixed
    /// default otherwise (the localnet's beacon guards nothing).
    #[arg(long, env = "IOTA_LOCALNET_DRAND_SEED", value_parser = parse_seed)]
    pub drand_seed: Option<[u8; 32]>,
}

/// Parses 32 bytes of hex, with or without `0x`.
pub fn parse_seed(s: &str) -> Result<[u8; 32], String> {
    let bytes = hex::decode(s.trim().trim_start_matches("0x"))
        .map_err(|e| format!("seed `{s}` is not hex: {e}"))?;
    <[u8; 32]>::try_from(bytes.as_slice())
        .map_err(|_| format!("seed `{s}` is {} bytes, not 32", bytes.len()))
}

/// Parses `250ms`, `2s`, `1m` or a bare number of milliseconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("invalid duration `{s}`"))?;
    match unit {
        "" | "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("invalid duration unit in `{s}` (use ms, s or m)")),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Localnet(#[from] LocalnetError),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub async fn run(args: LocalnetArgs) -> Result<(), CliError> {
    match args.command {
        LocalnetCommand::Chain(a) => {
            let config = LocalnetConfig {
                addr: SocketAddr::new(a.host, a.port),
                chain: ChainConfig {
                    block_time: (!a.block_time.is_zero()).then_some(a.block_time),
                    instant: a.instant || a.block_time.is_zero(),
                    new_subnet_tempo: a.tempo,
                    commit_reveal_version: a.commit_reveal_version,
                    drand_period_secs: a.drand_period,
                    drand_seed: a.drand_seed.unwrap_or(ChainConfig::default().drand_seed),
                    ..ChainConfig::default()
                },
            };
            let net = Localnet::spawn(config).await?;
            println!(
                "localnet ready at {} (dev accounts Alice..Ferdie, Alice is sudo)",
                net.ws_url()
            );
            tokio::select! {
                _ = net.stopped() => {}
                _ = tokio::signal::ctrl_c() => net.stop().await,
            }
            Ok(())
        }
        LocalnetCommand::Metadata { out } => {
            std::fs::write(&out, crate::metadata::metadata_bytes()).map_err(|source| {
                CliError::Write {
                    path: out.clone(),
                    source,
                }
            })?;
            println!(
                "wrote {} ({} bytes)",
                out.display(),
                crate::metadata::metadata_bytes().len()
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("15"), Ok(Duration::from_millis(15)));
        assert!(parse_duration("2h").is_err());
        assert!(parse_duration("fast").is_err());
    }

    #[test]
    fn seeds_parse() {
        let hex = "ab".repeat(32);
        assert_eq!(parse_seed(&hex), Ok([0xab; 32]));
        assert_eq!(parse_seed(&format!("0x{hex}")), Ok([0xab; 32]));
        assert!(parse_seed("abcd").is_err());
        assert!(parse_seed(&"zz".repeat(32)).is_err());
    }
}
