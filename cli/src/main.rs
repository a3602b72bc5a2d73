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
    /// Training-core tools.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
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
    }
    Ok(())
}
