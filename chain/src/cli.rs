//! `iota chain …`: chain operations for operators, with the Bittensor SDK's flag names.
//!
//! ```text
//! iota chain [--subtensor.network finney|test|local|ws://…] [--subtensor.chain_endpoint URL]
//!            [--json] [--dry-run] <command>
//!   metagraph     --netuid N
//!   hyperparams   --netuid N
//!   check                                   runtime shape check against this build
//!   balance       [--address SS58]          default: the wallet's coldkey
//!   register      --netuid N                burned_register of the wallet hotkey (idempotent)
//!   serve-axon    --netuid N --axon.ip IP --axon.port P
//!   stake         --netuid N --amount TAO [--hotkey SS58]
//!   unstake       --netuid N --amount ALPHA [--hotkey SS58]
//!   transfer      --dest SS58 --amount TAO [--allow-death]
//!   set-weights   --netuid N --uids 1,2 --weights 0.3,0.7 [--version-key K] [--no-wait]
//!   reveal        [--wait SECONDS]          reveal pending commits whose window is open
//!   register-subnet                         a new subnet owned by the wallet coldkey
//!   start-call    --netuid N
//!   hyperparam    --netuid N --name NAME --value V [--sudo]
//! ```
//!
//! Wallet flags (`--wallet.name`, `--wallet.hotkey`, `--wallet.path`, env `BT_WALLET_*`) select
//! the keys; passwords come from `BT_PW_…` or a prompt. `--dry-run` prints the SCALE-encoded
//! call as hex and submits nothing.

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::calls::{self, AxonEndpoint, Hyperparam};
use crate::client::{Subtensor, TxOptions, WaitFor};
use crate::commit::JsonFileCommitStore;
use crate::error::ChainError;
use crate::metagraph::Metagraph;
use crate::network::{ConnectOptions, ShapeCheck};
use crate::ops::Outcome;
use crate::set_weights::{VersionKey, WeightOptions, WeightsOutcome};
use crate::wallet::cli::WalletArgs;
use crate::wallet::{PasswordSource, PublicKey, Wallet, expand_tilde};

/// Which node to use and how long to wait for it.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct SubtensorArgs {
    /// Network: finney, test, archive, local, or a ws:// / wss:// URL.
    #[arg(
        long = "subtensor.network",
        env = "BT_SUBTENSOR_NETWORK",
        default_value = "finney",
        global = true
    )]
    pub network: String,
    /// Node endpoint (ws:// or wss://); overrides --subtensor.network.
    #[arg(
        long = "subtensor.chain_endpoint",
        env = "BT_SUBTENSOR_CHAIN_ENDPOINT",
        global = true
    )]
    pub chain_endpoint: Option<String>,
    /// Seconds allowed to connect and for each request.
    #[arg(
        long = "subtensor.timeout",
        env = "BT_SUBTENSOR_TIMEOUT",
        default_value_t = 30,
        global = true
    )]
    pub timeout: u64,
}

impl SubtensorArgs {
    /// Connection options for these flags.
    ///
    /// # Errors
    ///
    /// [`ChainError::InvalidArgument`] for an unknown network name.
    pub fn connect_options(&self) -> Result<ConnectOptions, ChainError> {
        let mut opts = ConnectOptions::for_network(&self.network, self.chain_endpoint.as_deref())?;
        opts.connect_timeout = Duration::from_secs(self.timeout.max(1));
        opts.request_timeout = Duration::from_secs(self.timeout.max(1));
        Ok(opts)
    }
}

/// `iota chain`.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct ChainArgs {
    #[command(flatten)]
    pub subtensor: SubtensorArgs,
    /// Print results as JSON.
    #[arg(long, env = "IOTA_JSON", global = true)]
    pub json: bool,
    /// Print the SCALE-encoded call as hex instead of submitting it.
    #[arg(long = "dry-run", env = "IOTA_DRY_RUN", global = true)]
    pub dry_run: bool,
    /// Spend without asking: register burns, transfers and stake moves show their cost and ask
    /// for confirmation unless this is given (and refuse to run unattended without it).
    #[arg(long, short = 'y', env = "IOTA_YES", global = true)]
    pub yes: bool,
    /// Wait for finalization instead of inclusion in a block.
    #[arg(
        long = "wait-for-finalization",
        env = "BT_WAIT_FOR_FINALIZATION",
        global = true
    )]
    pub wait_for_finalization: bool,
    #[command(subcommand)]
    pub command: ChainCommand,
}

/// The subcommands.
#[derive(Debug, Clone, PartialEq, clap::Subcommand)]
pub enum ChainCommand {
    /// Every neuron of a subnet with its stake, permit, incentive, emission and axon.
    Metagraph {
        /// The subnet.
        #[arg(long, env = "BT_NETUID")]
        netuid: u16,
    },
    /// A subnet's hyperparameters.
    Hyperparams {
        /// The subnet.
        #[arg(long, env = "BT_NETUID")]
        netuid: u16,
    },
    /// Compare the node's runtime with the one this build expects.
    Check,
    /// Free balance of an account.
    Balance {
        /// Account to look up (default: the wallet's coldkey).
        #[arg(long)]
        address: Option<String>,
        #[command(flatten)]
        wallet: WalletArgs,
    },
    /// Register the wallet hotkey on a subnet by burning TAO from the coldkey.
    Register {
        /// The subnet.
        #[arg(long, env = "BT_NETUID")]
        netuid: u16,
        /// Refuse when the burn is higher than this many TAO.
        #[arg(long = "max-burn", env = "IOTA_MAX_BURN")]
        max_burn: Option<f64>,
        #[command(flatten)]
        wallet: WalletArgs,
    },
    /// Publish the wallet hotkey's axon address.
    ServeAxon {
        /// The subnet.
        #[arg(long, env = "BT_NETUID")]
        netuid: u16,
        /// Public IP of the axon.
        #[arg(long = "axon.ip", env = "BT_AXON_IP")]
        ip: IpAddr,
        /// Port of the axon.
        #[arg(long = "axon.port", env = "BT_AXON_PORT")]
        port: u16,
        /// Version number to publish.
        #[arg(long = "axon.version", env = "BT_AXON_VERSION", default_value_t = 0)]
        version: u32,
        #[command(flatten)]
        wallet: WalletArgs,
    },
    /// Stake TAO from the coldkey onto a hotkey.
    Stake {
        /// The subnet.
        #[arg(long, env = "BT_NETUID")]
        netuid: u16,
        /// TAO to stake.
        #[arg(long)]
        amount: f64,
        /// Hotkey to stake on, SS58 (default: the wallet hotkey).
        #[arg(long = "hotkey", id = "target_hotkey")]
        hotkey: Option<String>,
        #[command(flatten)]
        wallet: WalletArgs,
    },
    /// Unstake alpha from a hotkey back to the coldkey.
    Unstake {
        /// The subnet.
        #[arg(long, env = "BT_NETUID")]
        netuid: u16,
        /// Alpha to unstake (in units of 1e9 rao).
        #[arg(long)]
        amount: f64,
        /// Hotkey to unstake from, SS58 (default: the wallet hotkey).
        #[arg(long = "hotkey", id = "target_hotkey")]
        hotkey: Option<String>,
        #[command(flatten)]
        wallet: WalletArgs,
    },
    /// Send TAO from the wallet coldkey.
    Transfer {
        /// Destination SS58 address.
        #[arg(long)]
        dest: String,
        /// TAO to send.
        #[arg(long)]
        amount: f64,
        /// Allow the transfer to empty the sending account.
        #[arg(long)]
        allow_death: bool,
        #[command(flatten)]
        wallet: WalletArgs,
    },
    /// Set weights from float scores (commit when the subnet uses commit-reveal).
    SetWeights {
        /// The subnet.
        #[arg(long, env = "BT_NETUID")]
        netuid: u16,
        /// Uids, comma separated.
        #[arg(long, value_delimiter = ',', required = true)]
        uids: Vec<u16>,
        /// Weights for those uids, comma separated (any scale; max-normalised and sent as given).
        #[arg(
            long,
            value_delimiter = ',',
            required = true,
            allow_hyphen_values = true
        )]
        weights: Vec<f32>,
        /// Version key to send (default: the subnet's WeightsVersionKey).
        #[arg(long = "version-key")]
        version_key: Option<u64>,
        /// Fail instead of waiting when the weights rate limit has not passed.
        #[arg(long = "no-wait")]
        no_wait: bool,
        /// Apply the validator's `process_weights` first (pad to MinAllowedWeights, clip at
        /// MaxWeightsLimit); without it the given weights are only converted, as the SDK does.
        #[arg(long = "process")]
        process: bool,
        /// Where commit-reveal keeps salts until the reveal.
        #[arg(long = "commit-store", env = "IOTA_COMMIT_STORE")]
        commit_store: Option<PathBuf>,
        #[command(flatten)]
        wallet: WalletArgs,
    },
    /// Reveal pending weight commits whose window is open.
    Reveal {
        /// Wait up to this many seconds for windows to open.
        #[arg(long, default_value_t = 0)]
        wait: u64,
        /// Where commit-reveal keeps salts until the reveal.
        #[arg(long = "commit-store", env = "IOTA_COMMIT_STORE")]
        commit_store: Option<PathBuf>,
        #[command(flatten)]
        wallet: WalletArgs,
    },
    /// Create a subnet owned by the wallet coldkey, with the wallet hotkey as uid 0.
    RegisterSubnet {
        #[command(flatten)]
        wallet: WalletArgs,
    },
    /// Start emission on a subnet (owner only).
    StartCall {
        /// The subnet.
        #[arg(long, env = "BT_NETUID")]
        netuid: u16,
        #[command(flatten)]
        wallet: WalletArgs,
    },
    /// Change a subnet setting through AdminUtils.
    Hyperparam {
        /// The subnet (ignored for chain-wide settings).
        #[arg(long, env = "BT_NETUID")]
        netuid: u16,
        /// Setting name, e.g. tempo, weights_rate_limit, commit_reveal_weights_enabled.
        #[arg(long = "name", id = "param_name")]
        name: String,
        /// New value (true/false for flags).
        #[arg(long)]
        value: String,
        /// Dispatch through Sudo.sudo (root-only settings; needs the sudo key).
        #[arg(long)]
        sudo: bool,
        #[command(flatten)]
        wallet: WalletArgs,
    },
}

/// Runs `args`, writing results to `out`.
///
/// # Errors
///
/// Any [`ChainError`].
pub async fn run(args: &ChainArgs, out: &mut dyn Write) -> Result<(), ChainError> {
    run_with_password(args, out, &PasswordSource::EnvOrPrompt).await
}

/// As [`run`], with an explicit password source (for embedding programs and tests).
///
/// # Errors
///
/// Any [`ChainError`].
pub async fn run_with_password(
    args: &ChainArgs,
    out: &mut dyn Write,
    password: &PasswordSource,
) -> Result<(), ChainError> {
    let mut opts = args.subtensor.connect_options()?;
    if matches!(args.command, ChainCommand::Check) {
        opts.shape_check = ShapeCheck::Warn;
    }
    let chain = Subtensor::connect(opts).await?;
    let tx = TxOptions {
        dry_run: args.dry_run,
        wait_for: if args.wait_for_finalization {
            WaitFor::Finalized
        } else {
            WaitFor::InBlock
        },
        ..TxOptions::default()
    };
    let p = Printer {
        json: args.json,
        out,
    };
    match &args.command {
        ChainCommand::Metagraph { netuid } => {
            let mg = chain.metagraph(*netuid).await?;
            if args.json {
                p.json(&mg)
            } else {
                write_metagraph(p.out, &mg)
            }
        }
        ChainCommand::Hyperparams { netuid } => {
            let hp = chain.hyperparams(*netuid).await?;
            if args.json {
                p.json(&hp)
            } else {
                let value = serde_json::to_value(&hp).map_err(|e| ChainError::decode("json", e))?;
                let mut lines = Vec::new();
                if let Some(map) = value.as_object() {
                    for (k, v) in map {
                        lines.push(format!("{k:<24} {v}"));
                    }
                }
                p.line(&lines.join("\n"))
            }
        }
        ChainCommand::Check => {
            let diffs: Vec<String> = chain
                .shape_differences()
                .iter()
                .map(ToString::to_string)
                .collect();
            let breaking = chain.shape_differences().iter().any(|d| d.breaking);
            if args.json {
                p.json(&serde_json::json!({
                    "url": chain.url(),
                    "spec_version": chain.spec_version(),
                    "compatible": !breaking,
                    "differences": diffs,
                }))?;
            } else {
                let mut text = format!(
                    "{} runs spec {}: {}",
                    chain.url(),
                    chain.spec_version(),
                    if breaking {
                        "INCOMPATIBLE with this build"
                    } else {
                        "compatible"
                    }
                );
                for d in &diffs {
                    text.push_str("\n  ");
                    text.push_str(d);
                }
                p.line(&text)?;
            }
            if breaking {
                return Err(ChainError::ShapeMismatch(
                    chain
                        .shape_differences()
                        .iter()
                        .filter(|d| d.breaking)
                        .map(|d| d.description.clone())
                        .collect(),
                ));
            }
            Ok(())
        }
        ChainCommand::Balance { address, wallet } => {
            let account = match address {
                Some(a) => calls::parse_account(a)?,
                None => wallet.wallet()?.coldkeypub()?,
            };
            let rao = chain.free_balance(&account).await?;
            if args.json {
                p.json(&serde_json::json!({ "address": account.ss58(), "free_rao": rao, "free_tao": calls::format_tao(rao) }))
            } else {
                p.line(&format!(
                    "{}  {} TAO",
                    account.ss58(),
                    calls::format_tao(rao)
                ))
            }
        }
        ChainCommand::Register {
            netuid,
            max_burn,
            wallet,
        } => {
            let w = wallet.wallet()?;
            let hotkey = w.hotkeypub()?;
            if chain.uid_of(*netuid, &hotkey).await?.is_none() {
                let burn = chain.registration_burn(*netuid, *max_burn).await?;
                confirm(
                    args,
                    &format!(
                        "Registering {} on netuid {netuid} burns {} TAO from the coldkey.",
                        hotkey.ss58(),
                        calls::format_tao(burn)
                    ),
                )?;
            }
            let coldkey = w.coldkey(password)?;
            let r = chain.register(&coldkey, *netuid, &hotkey, &tx).await?;
            p.outcome(&r, |r| {
                if r.already_registered {
                    format!(
                        "{} is already registered on netuid {netuid} as uid {}",
                        hotkey.ss58(),
                        r.uid
                    )
                } else {
                    format!(
                        "registered {} on netuid {netuid} as uid {}",
                        hotkey.ss58(),
                        r.uid
                    )
                }
            })
        }
        ChainCommand::ServeAxon {
            netuid,
            ip,
            port,
            version,
            wallet,
        } => {
            let hotkey = wallet.wallet()?.hotkey(password)?;
            let axon = AxonEndpoint {
                ip: *ip,
                port: *port,
                version: *version,
                protocol: 4,
            };
            match chain
                .serve_axon_if_changed(&hotkey, *netuid, &axon, &tx)
                .await?
            {
                Some(r) => p.outcome(&r, |i| {
                    format!("axon {axon} served on netuid {netuid} (block {})", i.block)
                }),
                None => p.line(&format!(
                    "axon {axon} already served on netuid {netuid}; nothing submitted"
                )),
            }
        }
        ChainCommand::Stake {
            netuid,
            amount,
            hotkey,
            wallet,
        } => {
            let w = wallet.wallet()?;
            let target = target_hotkey(hotkey.as_deref(), &w)?;
            let rao = calls::tao_to_rao(*amount)?;
            confirm(
                args,
                &format!(
                    "Staking {} TAO from the coldkey onto {} on netuid {netuid}.",
                    calls::format_tao(rao),
                    target.ss58()
                ),
            )?;
            let coldkey = w.coldkey(password)?;
            let r = chain
                .add_stake(&coldkey, &target, *netuid, rao, &tx)
                .await?;
            p.outcome(&r, |i| {
                format!(
                    "staked {} TAO on {} (netuid {netuid}, block {})",
                    calls::format_tao(rao),
                    target.ss58(),
                    i.block
                )
            })
        }
        ChainCommand::Unstake {
            netuid,
            amount,
            hotkey,
            wallet,
        } => {
            let w = wallet.wallet()?;
            let target = target_hotkey(hotkey.as_deref(), &w)?;
            let rao = calls::tao_to_rao(*amount)?;
            confirm(
                args,
                &format!(
                    "Unstaking {} alpha from {} on netuid {netuid} back to the coldkey.",
                    calls::format_tao(rao),
                    target.ss58()
                ),
            )?;
            let coldkey = w.coldkey(password)?;
            let r = chain
                .remove_stake(&coldkey, &target, *netuid, rao, &tx)
                .await?;
            p.outcome(&r, |i| {
                format!(
                    "unstaked {} alpha from {} (block {})",
                    calls::format_tao(rao),
                    target.ss58(),
                    i.block
                )
            })
        }
        ChainCommand::Transfer {
            dest,
            amount,
            allow_death,
            wallet,
        } => {
            let dest = calls::parse_account(dest)?;
            let rao = calls::tao_to_rao(*amount)?;
            confirm(
                args,
                &format!(
                    "Sending {} TAO from the coldkey to {}.",
                    calls::format_tao(rao),
                    dest.ss58()
                ),
            )?;
            let coldkey = wallet.wallet()?.coldkey(password)?;
            let r = chain
                .transfer(&coldkey, &dest, rao, !allow_death, &tx)
                .await?;
            p.outcome(&r, |i| {
                format!(
                    "sent {} TAO to {} (block {})",
                    calls::format_tao(rao),
                    dest.ss58(),
                    i.block
                )
            })
        }
        ChainCommand::SetWeights {
            netuid,
            uids,
            weights,
            version_key,
            no_wait,
            process,
            commit_store,
            wallet,
        } => {
            let w = wallet.wallet()?;
            let hotkey = w.hotkey(password)?;
            let store = JsonFileCommitStore::new(store_path(commit_store.as_ref(), &w));
            let opts = WeightOptions {
                version_key: version_key.map_or(VersionKey::FromChain, VersionKey::Exact),
                wait_for_rate_limit: !no_wait,
                process_weights: *process,
                tx: tx.clone(),
                ..WeightOptions::default()
            };
            let r = chain
                .set_weights(&hotkey, *netuid, uids, weights, &store, &opts)
                .await?;
            if args.json {
                return p.json(&r);
            }
            p.line(&match &r {
                WeightsOutcome::Set { block, uids, values, version_key } => format!(
                    "weights set in block {block} (version key {version_key}): uids {uids:?} values {values:?}"
                ),
                WeightsOutcome::Committed { block, hash, reveal_from_block, .. } => format!(
                    "weights committed in block {block} ({hash}); reveal from block {reveal_from_block} with `iota chain reveal` (salt kept in {})",
                    store.path().display()
                ),
                WeightsOutcome::TimelockCommitted { block, hash, reveal_round, reveal_from_block, .. } => format!(
                    "weights committed in block {block} ({hash}), sealed to drand round {reveal_round}; the chain reveals them from block {reveal_from_block} (`iota chain reveal` reports when)"
                ),
                WeightsOutcome::DryRun { call_hex, uids, values, version_key, commit } => format!(
                    "dry run ({}): {call_hex}\n  uids {uids:?} values {values:?} version key {version_key}",
                    if *commit { "commit" } else { "set_weights" }
                ),
            })
        }
        ChainCommand::Reveal {
            wait,
            commit_store,
            wallet,
        } => {
            let w = wallet.wallet()?;
            let hotkey = w.hotkey(password)?;
            let store = JsonFileCommitStore::new(store_path(commit_store.as_ref(), &w));
            let report = if *wait > 0 {
                chain
                    .reveal_when_ready(&hotkey, &store, &tx, Duration::from_secs(*wait))
                    .await?
            } else {
                chain.reveal_pending(&hotkey, &store, &tx).await?
            };
            if args.json {
                return p.json(&report);
            }
            let mut lines = Vec::new();
            for (hash, block) in &report.revealed {
                lines.push(format!("revealed {hash} in block {block}"));
            }
            for (hash, from) in &report.waiting {
                lines.push(format!("waiting {hash}: window opens at block {from}"));
            }
            for (hash, why) in &report.dropped {
                lines.push(format!("dropped {hash}: {why}"));
            }
            for call in &report.dry_run {
                lines.push(format!("dry run: {call}"));
            }
            if lines.is_empty() {
                lines.push("no pending commits".to_owned());
            }
            p.line(&lines.join("\n"))
        }
        ChainCommand::RegisterSubnet { wallet } => {
            let w = wallet.wallet()?;
            let hotkey = w.hotkeypub()?;
            let coldkey = w.coldkey(password)?;
            let r = chain.register_network(&coldkey, &hotkey, &tx).await?;
            p.outcome(&r, |netuid| {
                format!(
                    "registered subnet {netuid} owned by {}",
                    coldkey.public().ss58()
                )
            })
        }
        ChainCommand::StartCall { netuid, wallet } => {
            let coldkey = wallet.wallet()?.coldkey(password)?;
            let r = chain.start_call(&coldkey, *netuid, &tx).await?;
            p.outcome(&r, |i| {
                format!("netuid {netuid} started (block {})", i.block)
            })
        }
        ChainCommand::Hyperparam {
            netuid,
            name,
            value,
            sudo,
            wallet,
        } => {
            let setting = Hyperparam::parse(name, value)?;
            let coldkey = wallet.wallet()?.coldkey(password)?;
            let r = chain
                .set_hyperparam(&coldkey, *netuid, setting, *sudo, &tx)
                .await?;
            p.outcome(&r, |i| {
                format!(
                    "{} set to {value} on netuid {netuid} (block {})",
                    setting.name(),
                    i.block
                )
            })
        }
    }
}

fn target_hotkey(given: Option<&str>, wallet: &Wallet) -> Result<PublicKey, ChainError> {
    match given {
        Some(ss58) => calls::parse_account(ss58),
        None => Ok(wallet.hotkeypub()?),
    }
}

/// Default commit store: `<wallet path>/<wallet>/iota-commits/<hotkey>.json`, beside the keys it
/// belongs to.
fn store_path(given: Option<&PathBuf>, wallet: &Wallet) -> PathBuf {
    match given {
        Some(p) => expand_tilde(p),
        None => wallet
            .dir()
            .join("iota-commits")
            .join(format!("{}.json", wallet.hotkey_name())),
    }
}

/// Shows what a spending command costs and asks before going on. A dry run spends nothing and
/// `--yes` answers for the user; without a terminal to ask on, it refuses instead of guessing.
fn confirm(args: &ChainArgs, what: &str) -> Result<(), ChainError> {
    use std::io::{BufRead, IsTerminal};
    if args.dry_run || args.yes {
        return Ok(());
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(ChainError::InvalidArgument(format!(
            "{what} Not asking without a terminal: pass --yes (or set IOTA_YES=1) to confirm."
        )));
    }
    eprint!("{what} Proceed? [y/N] ");
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .map_err(ChainError::Output)?;
    if matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes") {
        Ok(())
    } else {
        Err(ChainError::InvalidArgument("cancelled".into()))
    }
}

struct Printer<'a> {
    json: bool,
    out: &'a mut dyn Write,
}

impl Printer<'_> {
    fn line(self, text: &str) -> Result<(), ChainError> {
        writeln!(self.out, "{text}").map_err(ChainError::Output)
    }

    fn json<T: Serialize>(self, value: &T) -> Result<(), ChainError> {
        let text =
            serde_json::to_string_pretty(value).map_err(|e| ChainError::decode("json", e))?;
        self.line(&text)
    }

    fn outcome<T: Serialize>(
        self,
        outcome: &Outcome<T>,
        describe: impl FnOnce(&T) -> String,
    ) -> Result<(), ChainError> {
        if self.json {
            return self.json(outcome);
        }
        match outcome {
            Outcome::Done(t) => {
                let text = describe(t);
                self.line(&text)
            }
            Outcome::DryRun { call_hex } => {
                self.line(&format!("dry run, not submitted: {call_hex}"))
            }
        }
    }
}

fn write_metagraph(out: &mut dyn Write, mg: &Metagraph) -> Result<(), ChainError> {
    let h = &mg.hyperparams;
    let short = |k: &PublicKey| {
        let s = k.ss58();
        format!("{}…{}", &s[..6], &s[s.len() - 4..])
    };
    let mut text = format!(
        "netuid {} at block {} ({} / {} uids)  tempo {}  weights rate limit {}  version key {}  commit-reveal {}  burn {} TAO\n",
        mg.netuid,
        mg.block,
        h.n,
        h.max_uids,
        h.tempo,
        h.weights_rate_limit,
        h.weights_version_key,
        if h.commit_reveal_enabled { "on" } else { "off" },
        calls::format_tao(h.burn)
    );
    text.push_str(&format!(
        "{:>4}  {:<13} {:<13} {:>16} {:>2} {:>8} {:>8} {:>14} {:>8} {:>10}  {}\n",
        "UID",
        "HOTKEY",
        "COLDKEY",
        "STAKE",
        "VP",
        "INCENT",
        "DIVS",
        "EMISSION",
        "CONSENS",
        "UPDATED",
        "AXON"
    ));
    for n in &mg.neurons {
        let frac = |v: u16| f64::from(v) / f64::from(u16::MAX);
        text.push_str(&format!(
            "{:>4}  {:<13} {:<13} {:>16} {:>2} {:>8.5} {:>8.5} {:>14} {:>8.5} {:>10}  {}\n",
            n.uid,
            short(&n.hotkey),
            n.coldkey
                .as_ref()
                .map(short)
                .unwrap_or_else(|| "-".to_owned()),
            calls::format_tao(n.stake),
            if n.validator_permit { "*" } else { "" },
            frac(n.incentive),
            frac(n.dividends),
            calls::format_tao(n.emission),
            frac(n.consensus),
            n.last_update,
            n.axon
                .as_ref()
                .map(|a| a.address())
                .unwrap_or_else(|| "-".to_owned()),
        ));
    }
    write!(out, "{text}").map_err(ChainError::Output)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        chain: ChainArgs,
    }

    fn parse(args: &[&str]) -> Result<ChainArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("iota-chain").chain(args.iter().copied()))
            .map(|c| c.chain)
    }

    #[test]
    fn command_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn bittensor_flag_names_parse() {
        let a = parse(&[
            "--subtensor.network",
            "local",
            "set-weights",
            "--netuid",
            "9",
            "--uids",
            "1,2,3",
            "--weights",
            "0.5,0.25,0.25",
            "--wallet.name",
            "val",
            "--wallet.hotkey",
            "h1",
            "--dry-run",
        ])
        .expect("parses");
        assert!(a.dry_run);
        assert_eq!(a.subtensor.network, "local");
        let ChainCommand::SetWeights {
            netuid,
            uids,
            weights,
            wallet,
            ..
        } = a.command
        else {
            panic!("{a:?}");
        };
        assert_eq!((netuid, uids), (9, vec![1, 2, 3]));
        assert_eq!(weights, vec![0.5, 0.25, 0.25]);
        assert_eq!(
            (wallet.name.as_str(), wallet.hotkey.as_str()),
            ("val", "h1")
        );

        let a = parse(&[
            "serve-axon",
            "--netuid",
            "1",
            "--axon.ip",
            "1.2.3.4",
            "--axon.port",
            "8091",
            "--subtensor.chain_endpoint",
            "ws://127.0.0.1:9944",
        ])
        .expect("parses");
        assert_eq!(
            a.subtensor.connect_options().expect("url").url,
            "ws://127.0.0.1:9944"
        );
        assert!(parse(&["metagraph"]).is_err(), "--netuid is required");
    }
}
