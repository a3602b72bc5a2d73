//! `iota`: one binary for operators: local chain, wallets, chain operations.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "iota", version, about = "IOTA (Bittensor subnet 9) in Rust")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A subtensor-compatible local chain.
    Localnet(iota_localnet::cli::LocalnetArgs),
    /// btcli-compatible wallets: create, restore, list, show.
    Wallet {
        #[command(subcommand)]
        command: iota_chain::wallet::cli::WalletCommand,
    },
    /// Chain operations: metagraph, register, serve-axon, stake, transfer, set-weights, …
    Chain(iota_chain::cli::ChainArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Localnet(args) => iota_localnet::cli::run(args).await?,
        Command::Wallet { command } => {
            iota_chain::wallet::cli::run(&command, &mut std::io::stdout())?;
        }
        Command::Chain(args) => iota_chain::cli::run(&args, &mut std::io::stdout()).await?,
    }
    Ok(())
}
