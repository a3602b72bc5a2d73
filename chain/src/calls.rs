//! Every call the client sends, built as the runtime's call enum ([`Call`]).
//!
//! A [`Call`] is encoded against the *node's* metadata at submission (by pallet, call and field
//! name), which is also what `--dry-run` prints. The builders are pure, so tests can encode them
//! against any metadata, finney's included.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use subxt::utils::{AccountId32, H256};

use crate::api::runtime_types::bounded_collections::bounded_vec::BoundedVec;
use crate::api::runtime_types::pallet_admin_utils::pallet::Call as AdminCall;
use crate::api::runtime_types::pallet_balances::pallet::Call as BalancesCall;
use crate::api::runtime_types::pallet_subtensor::pallet::Call as SubtensorCall;
use crate::api::runtime_types::pallet_sudo::pallet::Call as SudoCall;
use crate::error::ChainError;
use crate::signer::account;
use crate::wallet::PublicKey;

/// The runtime's outer call enum.
pub type Call = crate::api::Call;

/// Rao per TAO.
pub const RAO_PER_TAO: u64 = 1_000_000_000;

/// Converts a TAO amount to rao, refusing negative, non-finite or unrepresentable amounts.
///
/// # Errors
///
/// [`ChainError::InvalidArgument`].
pub fn tao_to_rao(tao: f64) -> Result<u64, ChainError> {
    // Round to the nearest rao: 0.1 TAO is not exact in binary.
    let rao = (tao * RAO_PER_TAO as f64).round();
    if !tao.is_finite() || tao < 0.0 || rao > u64::MAX as f64 {
        return Err(ChainError::InvalidArgument(format!(
            "{tao} is not a usable TAO amount"
        )));
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Ok(rao as u64)
}

/// Formats rao as TAO with all nine decimals.
pub fn format_tao(rao: u64) -> String {
    format!("{}.{:09}", rao / RAO_PER_TAO, rao % RAO_PER_TAO)
}

/// `SubtensorModule.set_weights`.
pub fn set_weights(netuid: u16, uids: Vec<u16>, values: Vec<u16>, version_key: u64) -> Call {
    Call::SubtensorModule(SubtensorCall::set_weights {
        netuid,
        dests: uids,
        weights: values,
        version_key,
    })
}

/// `SubtensorModule.commit_weights` (commit-reveal v2).
pub fn commit_weights(netuid: u16, commit_hash: [u8; 32]) -> Call {
    Call::SubtensorModule(SubtensorCall::commit_weights {
        netuid,
        commit_hash: H256(commit_hash),
    })
}

/// `SubtensorModule.commit_timelocked_weights` (commit-reveal v3/v4): `commit` is the weights
/// sealed to drand round `reveal_round`; `commit_reveal_version` must be the chain's
/// `CommitRevealWeightsVersion`.
pub fn commit_timelocked_weights(
    netuid: u16,
    commit: Vec<u8>,
    reveal_round: u64,
    commit_reveal_version: u16,
) -> Call {
    Call::SubtensorModule(SubtensorCall::commit_timelocked_weights {
        netuid,
        commit: BoundedVec(commit),
        reveal_round,
        commit_reveal_version,
    })
}

/// `SubtensorModule.reveal_weights`.
pub fn reveal_weights(
    netuid: u16,
    uids: Vec<u16>,
    values: Vec<u16>,
    salt: Vec<u16>,
    version_key: u64,
) -> Call {
    Call::SubtensorModule(SubtensorCall::reveal_weights {
        netuid,
        uids,
        values,
        salt,
        version_key,
    })
}

/// `SubtensorModule.burned_register`, signed by the coldkey that pays the burn.
pub fn burned_register(netuid: u16, hotkey: &PublicKey) -> Call {
    Call::SubtensorModule(SubtensorCall::burned_register {
        netuid,
        hotkey: account(hotkey),
    })
}

/// Where an axon listens, as `serve_axon` encodes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AxonEndpoint {
    /// IPv4 or IPv6 address.
    pub ip: IpAddr,
    /// TCP port.
    pub port: u16,
    /// Axon software version (the SDK sends its `version_as_int`).
    pub version: u32,
    /// Protocol number; the Python SDK sends 4.
    pub protocol: u8,
}

impl AxonEndpoint {
    /// An endpoint with version 0 and protocol 4.
    pub fn new(ip: IpAddr, port: u16) -> Self {
        Self {
            ip,
            port,
            version: 0,
            protocol: 4,
        }
    }

    /// `(ip as u128, ip_type)` as subtensor stores them.
    pub fn ip_and_type(&self) -> (u128, u8) {
        match self.ip {
            IpAddr::V4(v4) => (u128::from(u32::from(v4)), 4),
            IpAddr::V6(v6) => (u128::from(v6), 6),
        }
    }
}

impl fmt::Display for AxonEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ip {
            IpAddr::V4(ip) => write!(f, "{ip}:{}", self.port),
            IpAddr::V6(ip) => write!(f, "[{ip}]:{}", self.port),
        }
    }
}

/// `SubtensorModule.serve_axon`, signed by the hotkey.
pub fn serve_axon(netuid: u16, axon: &AxonEndpoint) -> Call {
    let (ip, ip_type) = axon.ip_and_type();
    Call::SubtensorModule(SubtensorCall::serve_axon {
        netuid,
        version: axon.version,
        ip,
        port: axon.port,
        ip_type,
        protocol: axon.protocol,
        placeholder1: 0,
        placeholder2: 0,
    })
}

/// `SubtensorModule.add_stake` of `amount_rao` TAO onto `hotkey`, signed by the coldkey.
pub fn add_stake(hotkey: &PublicKey, netuid: u16, amount_rao: u64) -> Call {
    Call::SubtensorModule(SubtensorCall::add_stake {
        hotkey: account(hotkey),
        netuid,
        amount_staked: amount_rao,
    })
}

/// `SubtensorModule.remove_stake` of `amount_alpha` (rao of alpha), signed by the coldkey.
pub fn remove_stake(hotkey: &PublicKey, netuid: u16, amount_alpha: u64) -> Call {
    Call::SubtensorModule(SubtensorCall::remove_stake {
        hotkey: account(hotkey),
        netuid,
        amount_unstaked: amount_alpha,
    })
}

/// `SubtensorModule.register_network`: a new subnet owned by the signing coldkey, with `hotkey`
/// as its owner hotkey.
pub fn register_network(hotkey: &PublicKey) -> Call {
    Call::SubtensorModule(SubtensorCall::register_network {
        hotkey: account(hotkey),
    })
}

/// `SubtensorModule.start_call`: starts emission on a subnet (owner only).
pub fn start_call(netuid: u16) -> Call {
    Call::SubtensorModule(SubtensorCall::start_call { netuid })
}

/// A balance transfer; `keep_alive` refuses to reap the sender.
pub fn transfer(dest: &PublicKey, amount_rao: u64, keep_alive: bool) -> Call {
    let dest = crate::api::Address::Id(account(dest));
    Call::Balances(if keep_alive {
        BalancesCall::transfer_keep_alive {
            dest,
            value: amount_rao,
        }
    } else {
        BalancesCall::transfer_allow_death {
            dest,
            value: amount_rao,
        }
    })
}

/// `Sudo.sudo(call)`: dispatches `call` as root (the localnet's sudo key is Alice).
pub fn sudo(call: Call) -> Call {
    Call::Sudo(SudoCall::sudo {
        call: Box::new(call),
    })
}

macro_rules! hyperparams {
    ($(
        $(#[$doc:meta])*
        $variant:ident($ty:ty) => $name:literal, $scope:ident $call:ident . $field:ident, $origin:ident;
    )*) => {
        /// A subnet setting changed through `AdminUtils`, with its new value.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[non_exhaustive]
        pub enum Hyperparam {
            $( $(#[$doc])* $variant($ty), )*
        }

        impl Hyperparam {
            /// Every setting name [`Hyperparam::parse`] accepts.
            pub const NAMES: &'static [&'static str] = &[$($name),*];

            /// The setting's name (the Python SDK's hyperparameter name).
            pub fn name(&self) -> &'static str {
                match self { $( Hyperparam::$variant(_) => $name, )* }
            }

            /// Who may set it: the subnet owner, or only root (through `Sudo.sudo`).
            pub fn origin(&self) -> SetterOrigin {
                match self { $( Hyperparam::$variant(_) => SetterOrigin::$origin, )* }
            }

            /// Whether the call takes a netuid (a few settings are chain-wide).
            pub fn per_subnet(&self) -> bool {
                match self { $( Hyperparam::$variant(_) => hyperparams!(@per_subnet $scope), )* }
            }

            /// Parses `name` and `value` (`true`/`false` for flags).
            ///
            /// # Errors
            ///
            /// [`ChainError::InvalidArgument`] for an unknown name or a value of the wrong kind.
            pub fn parse(name: &str, value: &str) -> Result<Self, ChainError> {
                let name = name.trim().to_ascii_lowercase().replace('-', "_");
                match name.as_str() {
                    $( $name => Ok(Hyperparam::$variant(parse_value::<$ty>($name, value)?)), )*
                    other => Err(ChainError::InvalidArgument(format!(
                        "unknown hyperparameter {other:?}; known: {}",
                        Self::NAMES.join(", ")
                    ))),
                }
            }

            /// The `AdminUtils` call that sets it on `netuid` (ignored for chain-wide settings).
            pub fn call(&self, netuid: u16) -> Call {
                Call::AdminUtils(match *self {
                    $( Hyperparam::$variant(value) => hyperparams!(@call $scope $call $field value netuid), )*
                })
            }
        }
    };
    (@per_subnet subnet) => { true };
    (@per_subnet global) => { false };
    (@call subnet $call:ident $field:ident $value:ident $netuid:ident) => {
        AdminCall::$call { netuid: $netuid, $field: $value }
    };
    (@call global $call:ident $field:ident $value:ident $netuid:ident) => {{
        let _ = $netuid;
        AdminCall::$call { $field: $value }
    }};
}

/// Who may change a hyperparameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetterOrigin {
    /// The subnet owner's coldkey (or root).
    Owner,
    /// Root only: wrap the call in `Sudo.sudo`.
    Root,
}

fn parse_value<T: FromStr>(name: &str, value: &str) -> Result<T, ChainError> {
    value.trim().parse().map_err(|_| {
        ChainError::InvalidArgument(format!(
            "{value:?} is not a valid value for {name} (expected {})",
            std::any::type_name::<T>()
        ))
    })
}

hyperparams! {
    /// `WeightsVersionKey`: the lowest version key `set_weights` accepts.
    WeightsVersionKey(u64) => "weights_version", subnet sudo_set_weights_version_key.weights_version_key, Owner;
    /// `WeightsSetRateLimit`, in blocks.
    WeightsRateLimit(u64) => "weights_rate_limit", subnet sudo_set_weights_set_rate_limit.weights_set_rate_limit, Root;
    /// `CommitRevealWeightsEnabled`.
    CommitRevealWeightsEnabled(bool) => "commit_reveal_weights_enabled", subnet sudo_set_commit_reveal_weights_enabled.enabled, Owner;
    /// `RevealPeriodEpochs`, in epochs.
    CommitRevealPeriod(u64) => "commit_reveal_period", subnet sudo_set_commit_reveal_weights_interval.interval, Owner;
    /// `Tempo`, in blocks.
    Tempo(u16) => "tempo", subnet sudo_set_tempo.tempo, Root;
    /// `ImmunityPeriod`, in blocks.
    ImmunityPeriod(u16) => "immunity_period", subnet sudo_set_immunity_period.immunity_period, Owner;
    /// `MinAllowedWeights`.
    MinAllowedWeights(u16) => "min_allowed_weights", subnet sudo_set_min_allowed_weights.min_allowed_weights, Owner;
    /// `MaxAllowedUids`.
    MaxAllowedUids(u16) => "max_allowed_uids", subnet sudo_set_max_allowed_uids.max_allowed_uids, Owner;
    /// `Kappa`.
    Kappa(u16) => "kappa", subnet sudo_set_kappa.kappa, Owner;
    /// `ActivityCutoff`, in blocks.
    ActivityCutoff(u16) => "activity_cutoff", subnet sudo_set_activity_cutoff.activity_cutoff, Owner;
    /// `NetworkRegistrationAllowed`.
    RegistrationAllowed(bool) => "registration_allowed", subnet sudo_set_network_registration_allowed.registration_allowed, Root;
    /// `MinBurn`, in rao.
    MinBurn(u64) => "min_burn", subnet sudo_set_min_burn.min_burn, Owner;
    /// `MaxBurn`, in rao.
    MaxBurn(u64) => "max_burn", subnet sudo_set_max_burn.max_burn, Owner;
    /// `MaxAllowedValidators`.
    MaxAllowedValidators(u16) => "max_validators", subnet sudo_set_max_allowed_validators.max_allowed_validators, Root;
    /// `BondsMovingAverage`.
    BondsMovingAverage(u64) => "bonds_moving_avg", subnet sudo_set_bonds_moving_average.bonds_moving_average, Owner;
    /// `MaxRegistrationsPerBlock`.
    MaxRegistrationsPerBlock(u16) => "max_regs_per_block", subnet sudo_set_max_registrations_per_block.max_registrations_per_block, Root;
    /// `ServingRateLimit`, in blocks.
    ServingRateLimit(u64) => "serving_rate_limit", subnet sudo_set_serving_rate_limit.serving_rate_limit, Owner;
    /// `Yuma3On`.
    Yuma3Enabled(bool) => "yuma3_enabled", subnet sudo_set_yuma3_enabled.enabled, Owner;
    /// `NetworkRateLimit` (chain-wide), in blocks.
    NetworkRateLimit(u64) => "network_rate_limit", global sudo_set_network_rate_limit.rate_limit, Root;
    /// `NetworkMinLockCost` (chain-wide), in rao.
    NetworkMinLockCost(u64) => "network_min_lock_cost", global sudo_set_network_min_lock_cost.lock_cost, Root;
    /// `StakeThreshold` (chain-wide), in rao.
    StakeThreshold(u64) => "stake_threshold", global sudo_set_stake_threshold.min_stake, Root;
    /// `CommitRevealWeightsVersion` (chain-wide): 4 for drand-timelocked commits.
    CommitRevealVersion(u16) => "commit_reveal_version", global sudo_set_commit_reveal_version.version, Root;
}

/// The call's name (`Pallet.call`, with the inner call of `Sudo.sudo`), for messages and logs.
pub fn describe(call: &Call) -> String {
    match call {
        Call::System(_) => "System".to_owned(),
        Call::Balances(c) => format!("Balances.{}", variant_name(c)),
        Call::SubtensorModule(c) => format!("SubtensorModule.{}", variant_name(c)),
        Call::Sudo(SudoCall::sudo { call }) => format!("Sudo.sudo({})", describe(call)),
        Call::AdminUtils(c) => format!("AdminUtils.{}", variant_name(c)),
    }
}

fn variant_name(value: &impl fmt::Debug) -> String {
    let text = format!("{value:?}");
    text.split([' ', '{', '('])
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// An account from its SS58 address.
///
/// # Errors
///
/// [`ChainError::Wallet`] for a malformed address.
pub fn parse_account(ss58: &str) -> Result<PublicKey, ChainError> {
    Ok(PublicKey::from_ss58(ss58.trim())?)
}

/// Converts a subxt account to a wallet public key.
pub fn to_public(account: &AccountId32) -> PublicKey {
    crate::signer::public(account)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tao_converts_to_rao() {
        assert_eq!(tao_to_rao(1.0).ok(), Some(RAO_PER_TAO));
        assert_eq!(tao_to_rao(0.1).ok(), Some(100_000_000));
        assert!(tao_to_rao(-1.0).is_err());
        assert!(tao_to_rao(f64::NAN).is_err());
        assert_eq!(format_tao(1_500_000_001), "1.500000001");
    }

    #[test]
    fn hyperparams_parse_by_name() {
        let p = Hyperparam::parse("tempo", "12").expect("tempo");
        assert_eq!(p, Hyperparam::Tempo(12));
        assert_eq!(p.origin(), SetterOrigin::Root);
        assert!(matches!(
            p.call(3),
            Call::AdminUtils(AdminCall::sudo_set_tempo {
                netuid: 3,
                tempo: 12
            })
        ));
        let p = Hyperparam::parse("commit-reveal-weights-enabled", "false").expect("flag");
        assert_eq!(p, Hyperparam::CommitRevealWeightsEnabled(false));
        assert!(Hyperparam::parse("tempo", "x").is_err());
        assert!(Hyperparam::parse("nope", "1").is_err());
        assert!(!Hyperparam::StakeThreshold(1).per_subnet());
        assert_eq!(
            describe(&sudo(Hyperparam::Tempo(1).call(1))),
            "Sudo.sudo(AdminUtils.sudo_set_tempo)"
        );
    }

    #[test]
    fn axon_ip_encodes_like_the_sdk() {
        let v4 = AxonEndpoint::new("1.2.3.4".parse().expect("ip"), 8091);
        assert_eq!(v4.ip_and_type(), (0x0102_0304, 4));
        let v6 = AxonEndpoint::new("::1".parse().expect("ip"), 1);
        assert_eq!(v6.ip_and_type(), (1, 6));
    }
}
