//! Runtime APIs beyond `Core` and `Metadata`: the shapes subtensor's `rpc_info` returns (field
//! names, order and compact-ness as in finney's spec 393) filled from the localnet's storage.
//! Wallets and SDKs decode these by the types the metadata declares, so a field out of place
//! here is a wrong number in someone's metagraph.

use parity_scale_codec::{Compact, Decode, Encode};
use scale_info::TypeInfo;

use super::event::{DispatchClass, Weight};
use super::storage::subtensor::*;
use super::types::{AccountId32, AxonInfo};
use crate::state::State;

type C16 = Compact<u16>;
type C64 = Compact<u64>;

fn c16(v: u16) -> C16 {
    Compact(v)
}

fn c64(v: u64) -> C64 {
    Compact(v)
}

/// `substrate_fixed::FixedI128<U64>` as SCALE carries it: the raw bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct FixedI128 {
    pub bits: i128,
}

/// `substrate_fixed::FixedI64<U32>`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct FixedI64 {
    pub bits: i64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct SubnetIdentityV3 {
    pub subnet_name: Vec<u8>,
    pub github_repo: Vec<u8>,
    pub subnet_contact: Vec<u8>,
    pub subnet_url: Vec<u8>,
    pub discord: Vec<u8>,
    pub description: Vec<u8>,
    pub logo_url: Vec<u8>,
    pub additional: Vec<u8>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct ChainIdentityV2 {
    pub name: Vec<u8>,
    pub url: Vec<u8>,
    pub github_repo: Vec<u8>,
    pub image: Vec<u8>,
    pub discord: Vec<u8>,
    pub description: Vec<u8>,
    pub additional: Vec<u8>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct PrometheusInfo {
    pub block: u64,
    pub version: u32,
    pub ip: u128,
    pub port: u16,
    pub ip_type: u8,
}

/// `sp_core::OpaqueMetadata`: a byte vector in a newtype.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct OpaqueMetadata(pub Vec<u8>);

/// `pallet_transaction_payment::RuntimeDispatchInfo<u64, Weight>`.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct RuntimeDispatchInfo {
    pub weight: Weight,
    pub class: DispatchClass,
    pub partial_fee: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct NeuronInfoLite {
    pub hotkey: AccountId32,
    pub coldkey: AccountId32,
    pub uid: C16,
    pub netuid: C16,
    pub active: bool,
    pub axon_info: AxonInfo,
    pub prometheus_info: PrometheusInfo,
    pub stake: Vec<(AccountId32, C64)>,
    pub rank: C16,
    pub emission: C64,
    pub incentive: C16,
    pub consensus: C16,
    pub trust: C16,
    pub validator_trust: C16,
    pub dividends: C16,
    pub last_update: C64,
    pub validator_permit: bool,
    pub pruning_score: C16,
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct NeuronInfo {
    pub hotkey: AccountId32,
    pub coldkey: AccountId32,
    pub uid: C16,
    pub netuid: C16,
    pub active: bool,
    pub axon_info: AxonInfo,
    pub prometheus_info: PrometheusInfo,
    pub stake: Vec<(AccountId32, C64)>,
    pub rank: C16,
    pub emission: C64,
    pub incentive: C16,
    pub consensus: C16,
    pub trust: C16,
    pub validator_trust: C16,
    pub dividends: C16,
    pub last_update: C64,
    pub validator_permit: bool,
    pub weights: Vec<(C16, C16)>,
    pub bonds: Vec<(C16, C16)>,
    pub pruning_score: C16,
}

/// Declares `Metagraph` and `SelectiveMetagraph` from one field list: the selective form is the
/// same fields, each optional, selected by its position, plus two trailing extras.
macro_rules! metagraph {
    ($( $field:ident : $ty:ty ),* $(,)?) => {
        #[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
        pub struct Metagraph {
            pub netuid: C16,
            $( pub $field: $ty, )*
        }

        #[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
        pub struct SelectiveMetagraph {
            pub netuid: C16,
            $( pub $field: Option<$ty>, )*
            pub validators: Option<Vec<C16>>,
            pub commitments: Option<Vec<(AccountId32, Vec<Compact<u8>>)>>,
        }

        impl SelectiveMetagraph {
            /// Keeps the fields whose index (0 = netuid, then in declaration order) is asked for.
            pub fn select(full: Metagraph, indexes: &[u16]) -> Self {
                let mut index = 0u16;
                let mut wanted = || {
                    index += 1;
                    indexes.contains(&index)
                };
                SelectiveMetagraph {
                    netuid: full.netuid,
                    $( $field: wanted().then_some(full.$field), )*
                    // The validator list and commitments are not kept by the localnet.
                    validators: None,
                    commitments: None,
                }
            }
        }
    };
}

// `netuid` leads both forms and is always present, so it sits outside the macro's list.
metagraph! {
    name: Vec<Compact<u8>>,
    symbol: Vec<Compact<u8>>,
    identity: Option<SubnetIdentityV3>,
    network_registered_at: C64,
    owner_hotkey: AccountId32,
    owner_coldkey: AccountId32,
    block: C64,
    tempo: C16,
    last_step: C64,
    blocks_since_last_step: C64,
    subnet_emission: C64,
    alpha_in: C64,
    alpha_out: C64,
    tao_in: C64,
    alpha_out_emission: C64,
    alpha_in_emission: C64,
    tao_in_emission: C64,
    pending_alpha_emission: C64,
    pending_root_emission: C64,
    subnet_volume: Compact<u128>,
    moving_price: FixedI128,
    rho: C16,
    kappa: C16,
    min_allowed_weights: C16,
    max_weights_limit: C16,
    weights_version: C64,
    weights_rate_limit: C64,
    activity_cutoff: C16,
    max_validators: C16,
    num_uids: C16,
    max_uids: C16,
    burn: C64,
    difficulty: C64,
    registration_allowed: bool,
    pow_registration_allowed: bool,
    immunity_period: C16,
    min_difficulty: C64,
    max_difficulty: C64,
    min_burn: C64,
    max_burn: C64,
    adjustment_alpha: C64,
    adjustment_interval: C16,
    target_regs_per_interval: C16,
    max_regs_per_block: C16,
    serving_rate_limit: C64,
    commit_reveal_weights_enabled: bool,
    commit_reveal_period: C64,
    liquid_alpha_enabled: bool,
    alpha_high: C16,
    alpha_low: C16,
    bonds_moving_avg: C64,
    hotkeys: Vec<AccountId32>,
    coldkeys: Vec<AccountId32>,
    identities: Vec<Option<ChainIdentityV2>>,
    axons: Vec<AxonInfo>,
    active: Vec<bool>,
    validator_permit: Vec<bool>,
    pruning_score: Vec<C16>,
    last_update: Vec<C64>,
    emission: Vec<C64>,
    dividends: Vec<C16>,
    incentives: Vec<C16>,
    consensus: Vec<C16>,
    trust: Vec<C16>,
    rank: Vec<C16>,
    block_at_registration: Vec<C64>,
    alpha_stake: Vec<C64>,
    tao_stake: Vec<C64>,
    total_stake: Vec<C64>,
    tao_dividends_per_hotkey: Vec<(AccountId32, C64)>,
    alpha_dividends_per_hotkey: Vec<(AccountId32, C64)>,
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct SubnetHyperparamsV2 {
    pub rho: C16,
    pub kappa: C16,
    pub immunity_period: C16,
    pub min_allowed_weights: C16,
    pub max_weights_limit: C16,
    pub tempo: C16,
    pub min_difficulty: C64,
    pub max_difficulty: C64,
    pub weights_version: C64,
    pub weights_rate_limit: C64,
    pub adjustment_interval: C16,
    pub activity_cutoff: C16,
    pub registration_allowed: bool,
    pub target_regs_per_interval: C16,
    pub min_burn: C64,
    pub max_burn: C64,
    pub bonds_moving_avg: C64,
    pub max_regs_per_block: C16,
    pub serving_rate_limit: C64,
    pub max_validators: C16,
    pub adjustment_alpha: C64,
    pub difficulty: C64,
    pub commit_reveal_period: C64,
    pub commit_reveal_weights_enabled: bool,
    pub alpha_high: C16,
    pub alpha_low: C16,
    pub liquid_alpha_enabled: bool,
    pub alpha_sigmoid_steepness: FixedI64,
    pub yuma_version: C16,
    pub subnet_is_active: bool,
    pub transfers_enabled: bool,
    pub bonds_reset_enabled: bool,
    pub user_liquidity_enabled: bool,
}

/// The localnet's fixed difficulty knobs: PoW registration is not offered, burn is.
const DIFFICULTY: u64 = 10_000_000;
const ADJUSTMENT_INTERVAL: u16 = 100;
const TARGET_REGS_PER_INTERVAL: u16 = 2;
const RHO: u16 = 10;
const ALPHA_LOW: u16 = 45_875;
const ALPHA_HIGH: u16 = 58_982;

fn column<T: Clone>(values: &[T], n: u16, default: T) -> Vec<T> {
    (0..n as usize)
        .map(|i| values.get(i).cloned().unwrap_or_else(|| default.clone()))
        .collect()
}

fn exists(state: &State, netuid: u16) -> bool {
    NetworksAdded::get(state, &netuid)
}

fn hotkey_stake(state: &State, hotkey: &AccountId32, netuid: u16) -> u64 {
    TotalHotkeyAlpha::get(state, hotkey, &netuid)
}

/// `SubnetInfoRuntimeApi::get_metagraph` at `block`.
pub fn metagraph(state: &State, netuid: u16, block: u64) -> Option<Metagraph> {
    if !exists(state, netuid) {
        return None;
    }
    let n = SubnetworkN::get(state, &netuid);
    let hotkeys: Vec<AccountId32> = (0..n).map(|uid| Keys::get(state, &netuid, &uid)).collect();
    let coldkeys: Vec<AccountId32> = hotkeys.iter().map(|h| Owner::get(state, h)).collect();
    let stakes: Vec<u64> = hotkeys
        .iter()
        .map(|h| hotkey_stake(state, h, netuid))
        .collect();
    let u16s = |v: Vec<u16>| column(&v, n, 0).into_iter().map(c16).collect::<Vec<_>>();
    let u64s = |v: Vec<u64>| column(&v, n, 0).into_iter().map(c64).collect::<Vec<_>>();
    let name: Vec<Compact<u8>> = format!("subnet {netuid}").bytes().map(Compact).collect();
    let dividends_per_hotkey: Vec<(AccountId32, C64)> = hotkeys
        .iter()
        .map(|h| {
            (
                h.clone(),
                c64(AlphaDividendsPerSubnet::get(state, &netuid, h)),
            )
        })
        .collect();
    Some(Metagraph {
        netuid: c16(netuid),
        name: name.clone(),
        symbol: name,
        identity: None,
        network_registered_at: c64(NetworkRegisteredAt::get(state, &netuid)),
        owner_hotkey: SubnetOwnerHotkey::get(state, &netuid),
        owner_coldkey: SubnetOwner::get(state, &netuid),
        block: c64(block),
        tempo: c16(Tempo::get(state, &netuid)),
        last_step: c64(LastMechansimStepBlock::get(state, &netuid)),
        blocks_since_last_step: c64(BlocksSinceLastStep::get(state, &netuid)),
        subnet_emission: c64(0),
        alpha_in: c64(SubnetAlphaIn::get(state, &netuid)),
        alpha_out: c64(SubnetAlphaOut::get(state, &netuid)),
        tao_in: c64(SubnetTAO::get(state, &netuid)),
        alpha_out_emission: c64(0),
        alpha_in_emission: c64(0),
        tao_in_emission: c64(0),
        pending_alpha_emission: c64(PendingServerEmission::get(state, &netuid)
            .saturating_add(PendingValidatorEmission::get(state, &netuid))),
        pending_root_emission: c64(0),
        subnet_volume: Compact(0),
        // One alpha is worth one TAO on the localnet (no AMM): 1.0 in U64F64 bits.
        moving_price: FixedI128 { bits: 1 << 64 },
        rho: c16(RHO),
        kappa: c16(Kappa::get(state, &netuid)),
        min_allowed_weights: c16(MinAllowedWeights::get(state, &netuid)),
        max_weights_limit: c16(MaxWeightsLimit::get(state, &netuid)),
        weights_version: c64(WeightsVersionKey::get(state, &netuid)),
        weights_rate_limit: c64(WeightsSetRateLimit::get(state, &netuid)),
        activity_cutoff: c16(ActivityCutoff::get(state, &netuid)),
        max_validators: c16(MaxAllowedValidators::get(state, &netuid)),
        num_uids: c16(n),
        max_uids: c16(MaxAllowedUids::get(state, &netuid)),
        burn: c64(Burn::get(state, &netuid)),
        difficulty: c64(DIFFICULTY),
        registration_allowed: NetworkRegistrationAllowed::get(state, &netuid),
        pow_registration_allowed: false,
        immunity_period: c16(ImmunityPeriod::get(state, &netuid)),
        min_difficulty: c64(DIFFICULTY),
        max_difficulty: c64(DIFFICULTY),
        min_burn: c64(MinBurn::get(state, &netuid)),
        max_burn: c64(MaxBurn::get(state, &netuid)),
        adjustment_alpha: c64(0),
        adjustment_interval: c16(ADJUSTMENT_INTERVAL),
        target_regs_per_interval: c16(TARGET_REGS_PER_INTERVAL),
        max_regs_per_block: c16(MaxRegistrationsPerBlock::get(state, &netuid)),
        serving_rate_limit: c64(ServingRateLimit::get(state, &netuid)),
        commit_reveal_weights_enabled: CommitRevealWeightsEnabled::get(state, &netuid),
        commit_reveal_period: c64(RevealPeriodEpochs::get(state, &netuid)),
        liquid_alpha_enabled: LiquidAlphaOn::get(state, &netuid),
        alpha_high: c16(ALPHA_HIGH),
        alpha_low: c16(ALPHA_LOW),
        bonds_moving_avg: c64(BondsMovingAverage::get(state, &netuid)),
        identities: vec![None; n as usize],
        axons: hotkeys
            .iter()
            .map(|h| Axons::get(state, &netuid, h).unwrap_or_default())
            .collect(),
        active: column(&Active::get(state, &netuid), n, false),
        validator_permit: column(&ValidatorPermit::get(state, &netuid), n, false),
        pruning_score: u16s(PruningScores::get(state, &netuid)),
        last_update: u64s(LastUpdate::get(state, &netuid)),
        emission: u64s(Emission::get(state, &netuid)),
        dividends: u16s(Dividends::get(state, &netuid)),
        incentives: u16s(Incentive::get(state, &netuid)),
        consensus: u16s(Consensus::get(state, &netuid)),
        trust: u16s(Trust::get(state, &netuid)),
        rank: u16s(Rank::get(state, &netuid)),
        block_at_registration: (0..n)
            .map(|uid| c64(BlockAtRegistration::get(state, &netuid, &uid)))
            .collect(),
        alpha_stake: stakes.iter().copied().map(c64).collect(),
        tao_stake: vec![c64(0); n as usize],
        total_stake: stakes.iter().copied().map(c64).collect(),
        tao_dividends_per_hotkey: hotkeys.iter().map(|h| (h.clone(), c64(0))).collect(),
        alpha_dividends_per_hotkey: dividends_per_hotkey,
        hotkeys,
        coldkeys,
    })
}

fn neuron_lite(state: &State, netuid: u16, uid: u16) -> Option<NeuronInfoLite> {
    if !exists(state, netuid) || uid >= SubnetworkN::get(state, &netuid) {
        return None;
    }
    let hotkey = Keys::get(state, &netuid, &uid);
    let coldkey = Owner::get(state, &hotkey);
    let at = |v: Vec<u16>| v.get(uid as usize).copied().unwrap_or(0);
    let stake = hotkey_stake(state, &hotkey, netuid);
    Some(NeuronInfoLite {
        axon_info: Axons::get(state, &netuid, &hotkey).unwrap_or_default(),
        prometheus_info: PrometheusInfo::default(),
        stake: vec![(coldkey.clone(), c64(stake))],
        hotkey,
        coldkey,
        uid: c16(uid),
        netuid: c16(netuid),
        active: Active::get(state, &netuid)
            .get(uid as usize)
            .copied()
            .unwrap_or(false),
        rank: c16(at(Rank::get(state, &netuid))),
        emission: c64(Emission::get(state, &netuid)
            .get(uid as usize)
            .copied()
            .unwrap_or(0)),
        incentive: c16(at(Incentive::get(state, &netuid))),
        consensus: c16(at(Consensus::get(state, &netuid))),
        trust: c16(at(Trust::get(state, &netuid))),
        validator_trust: c16(at(ValidatorTrust::get(state, &netuid))),
        dividends: c16(at(Dividends::get(state, &netuid))),
        last_update: c64(LastUpdate::get(state, &netuid)
            .get(uid as usize)
            .copied()
            .unwrap_or(0)),
        validator_permit: ValidatorPermit::get(state, &netuid)
            .get(uid as usize)
            .copied()
            .unwrap_or(false),
        pruning_score: c16(at(PruningScores::get(state, &netuid))),
    })
}

fn neuron_full(state: &State, netuid: u16, uid: u16) -> Option<NeuronInfo> {
    let lite = neuron_lite(state, netuid, uid)?;
    let pairs = |v: Vec<(u16, u16)>| v.into_iter().map(|(a, b)| (c16(a), c16(b))).collect();
    Some(NeuronInfo {
        hotkey: lite.hotkey,
        coldkey: lite.coldkey,
        uid: lite.uid,
        netuid: lite.netuid,
        active: lite.active,
        axon_info: lite.axon_info,
        prometheus_info: lite.prometheus_info,
        stake: lite.stake,
        rank: lite.rank,
        emission: lite.emission,
        incentive: lite.incentive,
        consensus: lite.consensus,
        trust: lite.trust,
        validator_trust: lite.validator_trust,
        dividends: lite.dividends,
        last_update: lite.last_update,
        validator_permit: lite.validator_permit,
        weights: pairs(Weights::get(state, &netuid, &uid)),
        bonds: pairs(Bonds::get(state, &netuid, &uid)),
        pruning_score: lite.pruning_score,
    })
}

fn uids(state: &State, netuid: u16) -> std::ops::Range<u16> {
    0..if exists(state, netuid) {
        SubnetworkN::get(state, &netuid)
    } else {
        0
    }
}

pub fn neurons_lite(state: &State, netuid: u16) -> Vec<NeuronInfoLite> {
    uids(state, netuid)
        .filter_map(|uid| neuron_lite(state, netuid, uid))
        .collect()
}

pub fn neurons(state: &State, netuid: u16) -> Vec<NeuronInfo> {
    uids(state, netuid)
        .filter_map(|uid| neuron_full(state, netuid, uid))
        .collect()
}

pub fn neuron(state: &State, netuid: u16, uid: u16) -> Option<NeuronInfo> {
    neuron_full(state, netuid, uid)
}

pub fn neuron_lite_at(state: &State, netuid: u16, uid: u16) -> Option<NeuronInfoLite> {
    neuron_lite(state, netuid, uid)
}

pub fn hyperparams_v2(state: &State, netuid: u16) -> Option<SubnetHyperparamsV2> {
    let m = metagraph(state, netuid, 0)?;
    Some(SubnetHyperparamsV2 {
        rho: m.rho,
        kappa: m.kappa,
        immunity_period: m.immunity_period,
        min_allowed_weights: m.min_allowed_weights,
        max_weights_limit: m.max_weights_limit,
        tempo: m.tempo,
        min_difficulty: m.min_difficulty,
        max_difficulty: m.max_difficulty,
        weights_version: m.weights_version,
        weights_rate_limit: m.weights_rate_limit,
        adjustment_interval: m.adjustment_interval,
        activity_cutoff: m.activity_cutoff,
        registration_allowed: m.registration_allowed,
        target_regs_per_interval: m.target_regs_per_interval,
        min_burn: m.min_burn,
        max_burn: m.max_burn,
        bonds_moving_avg: m.bonds_moving_avg,
        max_regs_per_block: m.max_regs_per_block,
        serving_rate_limit: m.serving_rate_limit,
        max_validators: m.max_validators,
        adjustment_alpha: m.adjustment_alpha,
        difficulty: m.difficulty,
        commit_reveal_period: m.commit_reveal_period,
        commit_reveal_weights_enabled: m.commit_reveal_weights_enabled,
        alpha_high: m.alpha_high,
        alpha_low: m.alpha_low,
        liquid_alpha_enabled: m.liquid_alpha_enabled,
        alpha_sigmoid_steepness: FixedI64 { bits: 1_000 << 32 },
        yuma_version: c16(if Yuma3On::get(state, &netuid) { 3 } else { 2 }),
        subnet_is_active: SubtokenEnabled::get(state, &netuid),
        transfers_enabled: true,
        bonds_reset_enabled: false,
        user_liquidity_enabled: false,
    })
}

/// What `register_network` locks now (the same rule its dispatch applies).
pub fn network_registration_cost(state: &State) -> u64 {
    NetworkMinLockCost::get(state).max(NetworkLastLockCost::get(state))
}

/// Transaction fee the localnet charges: none (its blocks have no weight market), reported in
/// `RuntimeDispatchInfo` shape so wallets can show it.
pub fn query_info(len: u32) -> RuntimeDispatchInfo {
    RuntimeDispatchInfo {
        weight: Weight {
            ref_time: 1_000_000 + u64::from(len) * 1_000,
            proof_size: 0,
        },
        class: DispatchClass::Normal,
        partial_fee: 0,
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct StakeInfo {
    pub hotkey: AccountId32,
    pub coldkey: AccountId32,
    pub netuid: C16,
    pub stake: C64,
    pub locked: C64,
    pub emission: C64,
    pub tao_emission: C64,
    pub drain: C64,
    pub is_registered: bool,
}

/// `StakeInfoRuntimeApi::get_stake_info_for_hotkey_coldkey_netuid`.
pub fn stake_info(
    state: &State,
    hotkey: &AccountId32,
    coldkey: &AccountId32,
    netuid: u16,
) -> Option<StakeInfo> {
    if !exists(state, netuid) {
        return None;
    }
    Some(StakeInfo {
        hotkey: hotkey.clone(),
        coldkey: coldkey.clone(),
        netuid: c16(netuid),
        stake: c64(super::subtensor::stake_of(state, hotkey, coldkey, netuid)),
        locked: c64(0),
        emission: c64(AlphaDividendsPerSubnet::get(state, &netuid, hotkey)),
        tao_emission: c64(0),
        drain: c64(0),
        is_registered: Uids::contains(state, &netuid, hotkey),
    })
}

/// `StakeInfoRuntimeApi::get_stake_info_for_coldkey`: every non-zero position of `coldkey`.
pub fn stake_info_for_coldkey(state: &State, coldkey: &AccountId32) -> Vec<StakeInfo> {
    let netuids: Vec<u16> = {
        let prefix = NetworksAdded::prefix();
        state
            .keys_with_prefix(&prefix, None)
            .filter_map(|k| k.get(prefix.len()..prefix.len() + 2))
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    };
    StakingHotkeys::get(state, coldkey)
        .iter()
        .flat_map(|hotkey| {
            netuids
                .iter()
                .filter_map(|netuid| stake_info(state, hotkey, coldkey, *netuid))
        })
        .filter(|info| info.stake.0 > 0)
        .collect()
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct SimSwapResult {
    pub tao_amount: u64,
    pub alpha_amount: u64,
    pub tao_fee: u64,
    pub alpha_fee: u64,
    pub tao_slippage: u64,
    pub alpha_slippage: u64,
}

/// The localnet has no AMM: staking converts TAO to alpha one to one, without fee or slippage
/// (what `add_stake` does), so a simulated swap in either direction returns the same amount.
pub fn sim_swap(amount: u64) -> SimSwapResult {
    SimSwapResult {
        tao_amount: amount,
        alpha_amount: amount,
        tao_fee: 0,
        alpha_fee: 0,
        tao_slippage: 0,
        alpha_slippage: 0,
    }
}

/// Alpha's price in rao per alpha: one TAO.
pub const ALPHA_PRICE: u64 = super::TAO;

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct SubnetState {
    pub netuid: C16,
    pub hotkeys: Vec<AccountId32>,
    pub coldkeys: Vec<AccountId32>,
    pub active: Vec<bool>,
    pub validator_permit: Vec<bool>,
    pub pruning_score: Vec<C16>,
    pub last_update: Vec<C64>,
    pub emission: Vec<C64>,
    pub dividends: Vec<C16>,
    pub incentives: Vec<C16>,
    pub consensus: Vec<C16>,
    pub trust: Vec<C16>,
    pub rank: Vec<C16>,
    pub block_at_registration: Vec<C64>,
    pub alpha_stake: Vec<C64>,
    pub tao_stake: Vec<C64>,
    pub total_stake: Vec<C64>,
    pub emission_history: Vec<Vec<C64>>,
}

/// `SubnetInfoRuntimeApi::get_subnet_state`: the per-neuron columns of the metagraph.
pub fn subnet_state(state: &State, netuid: u16) -> Option<SubnetState> {
    let m = metagraph(state, netuid, 0)?;
    Some(SubnetState {
        netuid: m.netuid,
        hotkeys: m.hotkeys,
        coldkeys: m.coldkeys,
        active: m.active,
        validator_permit: m.validator_permit,
        pruning_score: m.pruning_score,
        last_update: m.last_update,
        emission_history: vec![m.emission.clone()],
        emission: m.emission,
        dividends: m.dividends,
        incentives: m.incentives,
        consensus: m.consensus,
        trust: m.trust,
        rank: m.rank,
        block_at_registration: m.block_at_registration,
        alpha_stake: m.alpha_stake,
        tao_stake: m.tao_stake,
        total_stake: m.total_stake,
    })
}
