//! A whole subnet in one process, set up the one way both `iota localnet up` and the
//! integration tests set it up.
//!
//! * [`bootstrap`] registers a subnet on a chain, starts it, makes room for every uid, applies
//!   the caller's hyperparameters, registers the neurons, stakes the validators and waits the
//!   tempo after which they hold validator permits.
//! * [`Devnet`]: a localnet chain with such a subnet, an orchestrator, validators and miners,
//!   started together and stopped together ([`Devnet::stop`], or on drop).
//!
//! It sits above the services (chain client, localnet, orchestrator, miner, validator) and below
//! the `iota` binary and the test kit; no service depends on it.

mod devnet;

pub use devnet::{
    Devnet, DevnetConfig, DevnetMiner, DevnetValidator, Neuron, Role, create_database,
};

use std::time::Duration;

use iota_chain::calls::{Hyperparam, RAO_PER_TAO};
use iota_chain::wallet::{Keypair, PublicKey};
use iota_chain::{ChainError, Subtensor, TxOptions};
use iota_localnet::Localnet;

/// Stake each validator gets, in TAO: enough for a permit on a subnet of dev accounts.
pub const VALIDATOR_STAKE_TAO: u64 = 1_000;

/// Why a bootstrap step or the devnet failed.
#[derive(Debug, thiserror::Error)]
pub enum DevnetError {
    #[error("{step}: {source}")]
    Chain {
        step: &'static str,
        #[source]
        source: ChainError,
    },
    #[error("register_network was a dry run: no subnet was created")]
    DryRun,
    #[error("key: {0}")]
    Key(#[from] iota_chain::wallet::WalletError),
    #[error("the localnet: {0}")]
    Localnet(#[from] iota_localnet::LocalnetError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("the database URL has no database name")]
    DatabaseUrl,
    #[error("validator: {0}")]
    Validator(#[from] iota_validator::ValidatorError),
    #[error("the validators' thread ended before its validators were ready")]
    ValidatorThread,
    #[error("a devnet needs at least one neuron")]
    NoNeurons,
    #[error("the devnet is stopped")]
    Stopped,
    #[error("the orchestrator did not start")]
    OrchestratorDidNotStart,
    #[error("{name} stopped before joining: {why}")]
    MinerStopped { name: String, why: String },
    #[error("{0} did not join")]
    MinerDidNotJoin(String),
}

pub(crate) fn step(step: &'static str) -> impl FnOnce(ChainError) -> DevnetError {
    move |source| DevnetError::Chain { step, source }
}

/// How the bootstrap lets a tempo pass after staking, so that the staked validators get their
/// permits at the chain's epoch.
#[derive(Clone, Copy)]
pub enum PermitWait<'a> {
    /// No validators, or the caller waits itself.
    Skip,
    /// A localnet that seals blocks on demand: seal the tempo's blocks now.
    Produce(&'a Localnet),
    /// A chain that seals blocks on its own: wait for them, at most this long.
    Await(Duration),
}

/// The subnet to bootstrap.
pub struct SubnetPlan<'a> {
    /// Funded sudo coldkey that registers, starts, configures and stakes (Alice on a localnet).
    pub sudo: &'a Keypair,
    /// The subnet owner's hotkey.
    pub owner: &'a PublicKey,
    /// `MaxAllowedUids`, set before anyone registers.
    pub max_uids: u16,
    /// Further hyperparameters, set (as sudo) after the uid limit and before registration.
    pub settings: &'a [Hyperparam],
    /// Hotkeys to register, in order: their uids follow this order.
    pub neurons: &'a [PublicKey],
    /// Hotkeys (registered above) to stake [`VALIDATOR_STAKE_TAO`] each.
    pub validators: &'a [PublicKey],
    pub permits: PermitWait<'a>,
    pub tx: &'a TxOptions,
}

/// Registers and starts the subnet of `plan` on `chain`, registers and stakes its neurons and
/// lets a tempo pass for the validators' permits. Returns its netuid.
pub async fn bootstrap(chain: &Subtensor, plan: &SubnetPlan<'_>) -> Result<u16, DevnetError> {
    let SubnetPlan {
        sudo, owner, tx, ..
    } = *plan;
    let netuid = chain
        .register_network(sudo, owner, tx)
        .await
        .map_err(step("register_network"))?
        .done()
        .ok_or(DevnetError::DryRun)?;
    chain
        .start_call(sudo, netuid, tx)
        .await
        .map_err(step("start_call"))?;
    for setting in std::iter::once(Hyperparam::MaxAllowedUids(plan.max_uids))
        .chain(plan.settings.iter().copied())
    {
        chain
            .set_hyperparam(sudo, netuid, setting, true, tx)
            .await
            .map_err(step("set_hyperparam"))?;
    }
    for hotkey in plan.neurons {
        chain
            .register(sudo, netuid, hotkey, tx)
            .await
            .map_err(step("register"))?;
    }
    for hotkey in plan.validators {
        chain
            .add_stake(sudo, hotkey, netuid, VALIDATOR_STAKE_TAO * RAO_PER_TAO, tx)
            .await
            .map_err(step("add_stake"))?;
    }
    tracing::info!(
        netuid,
        neurons = plan.neurons.len(),
        validators = plan.validators.len(),
        "subnet registered"
    );
    // Validator permits are handed out at the chain's epoch, one tempo on.
    match plan.permits {
        PermitWait::Skip => {}
        PermitWait::Produce(net) => {
            let tempo = chain
                .hyperparams(netuid)
                .await
                .map_err(step("hyperparams"))?
                .tempo;
            net.produce_blocks(u32::from(tempo) + 2);
        }
        PermitWait::Await(timeout) => {
            let tempo = chain
                .hyperparams(netuid)
                .await
                .map_err(step("hyperparams"))?
                .tempo;
            let now = chain
                .best_block_number()
                .await
                .map_err(step("best_block_number"))?;
            chain
                .wait_for_block(now + u64::from(tempo) + 2, timeout)
                .await
                .map_err(step("waiting a tempo for permits"))?;
        }
    }
    Ok(netuid)
}
