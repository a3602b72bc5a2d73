//! The localnet alone, without building the whole `iota` binary:
//! `cargo run -p iota-localnet --example localnet -- chain --port 9944`.

use clap::Parser;

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    command: iota_localnet::cli::LocalnetCommand,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    iota_localnet::cli::run(iota_localnet::cli::LocalnetArgs {
        command: args.command,
    })
    .await?;
    Ok(())
}
