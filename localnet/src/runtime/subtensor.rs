//! `SubtensorModule`: subnets, registration, axons, stake and weights, with subtensor's checks and
//! error names, plus the per-block emission and the Yuma epoch every `tempo` blocks.
//!
//! Simplifications, documented for users of the localnet:
//! * stake: TAO is converted to alpha one to one (no AMM pool, no slippage, no fees); a hotkey's
//!   stake is `TotalHotkeyAlpha`, split among coldkeys by `Alpha` shares as on finney;
//! * emission: every started subnet receives 1 alpha (1e9 rao) per block; 18% goes to the owner,
//!   the rest half to miners and half to validators (the single-subnet case of subtensor's
//!   coinbase with no root stake); validator take and childkeys are not modelled;
//! * epochs follow spec 393's rule: a subnet's epoch runs when `(block + netuid + 1) % (tempo + 1)
//!   == 0`; commit-reveal is the hash scheme (v2), revealed in the epoch after the commit, or
//!   drand-timelocked (v4, when `CommitRevealWeightsVersion` says so), opened by the chain with
//!   the pulses of the localnet's own beacon ([`super::drand`]);
//! * the registration burn stays where it is set (no per-interval adjustment) and subnet
//!   registration has no rate limit and a fixed lock cost (`NetworkMinLockCost`).

use parity_scale_codec::{Decode, Encode};

use super::balances;
use super::call::SubtensorCall;
use super::error::SubtensorError as E;
use super::event::{DispatchError, Pays, RuntimeEvent, SubtensorEvent};
use super::extrinsic::InvalidTransaction;
use super::storage::drand::Pulses;
use super::storage::subtensor::*;
use super::types::{AccountId32, AxonInfo, BoundedVec, FixedU128, H256};
use super::{DispatchResult, Exec, Origin, SUBTENSOR_INDEX, TAO, module_error};
use crate::state::State;
use crate::yuma;

impl From<E> for DispatchError {
    fn from(e: E) -> Self {
        module_error(SUBTENSOR_INDEX, e as u8)
    }
}

const ROOT_NETUID: u16 = 0;
/// Per-block alpha emission of a started subnet, in rao.
pub const BLOCK_EMISSION: u64 = TAO;
/// Subnet owner's share of emission (`SubnetOwnerCut` default, out of 65 535).
const OWNER_CUT: u64 = 11_796;
/// Smallest stake operation subtensor accepts (`DefaultMinStake`), in rao.
const MIN_STAKE: u64 = 500_000;
/// Most unrevealed weight commits a hotkey may hold per subnet.
const MAX_UNREVEALED_COMMITS: usize = 10;
/// Largest timelocked commit (`BoundedVec<u8, ConstU32<5000>>`).
const MAX_TIMELOCKED_COMMIT_LEN: usize = 5_000;

/// Where the tempo for new subnets is kept: not a finney storage item, so under its own key.
fn default_tempo_key() -> Vec<u8> {
    super::storage::item_prefix("IotaLocalnet", "DefaultTempo")
}

pub fn set_default_new_subnet_tempo(state: &mut State, tempo: u16) {
    state.put(default_tempo_key(), tempo.encode());
}

fn default_new_subnet_tempo(state: &State) -> u16 {
    state
        .get(&default_tempo_key())
        .and_then(|b| <u16 as parity_scale_codec::Decode>::decode(&mut &b[..]).ok())
        .unwrap_or(360)
}

pub fn init_root_network(state: &mut State) {
    NetworksAdded::insert(state, &ROOT_NETUID, &true);
    TotalNetworks::insert(state, &1);
}

fn ensure_subnet(state: &State, netuid: u16) -> Result<(), DispatchError> {
    if NetworksAdded::get(state, &netuid) {
        Ok(())
    } else {
        Err(E::SubnetNotExists.into())
    }
}

/// Epoch index of a block under spec 393's epoch rule.
pub fn epoch_index(state: &State, netuid: u16, block: u64) -> u64 {
    let tempo = Tempo::get(state, &netuid) as u64;
    (block + netuid as u64 + 1) / (tempo + 1)
}

fn is_epoch_block(state: &State, netuid: u16, block: u64) -> bool {
    blocks_until_next_epoch(netuid, Tempo::get(state, &netuid), block) == 0
}

/// Subtensor's `blocks_until_next_epoch` (spec 393): the epoch runs in the block where this is
/// zero, i.e. where `(block + netuid + 1) % (tempo + 1) == tempo`; tempo 0 never runs one.
pub fn blocks_until_next_epoch(netuid: u16, tempo: u16, block: u64) -> u64 {
    if tempo == 0 {
        return u64::MAX;
    }
    let remainder = block.wrapping_add(netuid as u64 + 1) % (tempo as u64 + 1);
    (tempo as u64).saturating_sub(remainder)
}

/// Checks subtensor's transaction extension makes before a transaction enters the pool; a
/// failure is an invalid transaction with subtensor's custom code, refused at submission.
pub fn pool_checks(
    state: &State,
    next_block: u64,
    signer: &AccountId32,
    call: &super::call::RuntimeCall,
) -> Result<(), InvalidTransaction> {
    // Custom codes of subtensor's `CustomTransactionError`.
    const STAKE_AMOUNT_TOO_LOW: u8 = 1;
    const HOTKEY_NOT_REGISTERED_IN_NETWORK: u8 = 10;
    const INVALID_IP_ADDRESS: u8 = 11;
    const SERVING_RATE_LIMIT_EXCEEDED: u8 = 12;
    const INVALID_PORT: u8 = 13;
    const INVALID_REVEAL_ROUND: u8 = 15;
    let super::call::RuntimeCall::SubtensorModule(call) = call else {
        return Ok(());
    };
    match call {
        SubtensorCall::set_weights { netuid, .. }
        | SubtensorCall::set_mechanism_weights { netuid, .. }
        | SubtensorCall::commit_weights { netuid, .. }
        | SubtensorCall::reveal_weights { netuid, .. }
        | SubtensorCall::commit_timelocked_weights { netuid, .. }
        | SubtensorCall::commit_timelocked_mechanism_weights { netuid, .. }
            if TotalHotkeyAlpha::get(state, signer, netuid) < StakeThreshold::get(state) =>
        {
            return Err(InvalidTransaction::Custom(STAKE_AMOUNT_TOO_LOW));
        }
        // A round whose pulse is already out could be opened by anyone before the reveal.
        SubtensorCall::commit_timelocked_weights { reveal_round, .. }
        | SubtensorCall::commit_timelocked_mechanism_weights { reveal_round, .. }
            if *reveal_round < super::storage::drand::LastStoredRound::get(state) =>
        {
            return Err(InvalidTransaction::Custom(INVALID_REVEAL_ROUND));
        }
        SubtensorCall::serve_axon {
            netuid,
            ip,
            port,
            ip_type,
            ..
        } => {
            if !Uids::contains(state, netuid, signer) {
                return Err(InvalidTransaction::Custom(HOTKEY_NOT_REGISTERED_IN_NETWORK));
            }
            if !valid_ip(*ip_type, *ip) {
                return Err(InvalidTransaction::Custom(INVALID_IP_ADDRESS));
            }
            if *port == 0 {
                return Err(InvalidTransaction::Custom(INVALID_PORT));
            }
            if serving_rate_limited(state, *netuid, signer, next_block) {
                return Err(InvalidTransaction::Custom(SERVING_RATE_LIMIT_EXCEEDED));
            }
        }
        _ => {}
    }
    Ok(())
}

fn valid_ip(ip_type: u8, ip: u128) -> bool {
    match ip_type {
        4 => ip != 0 && ip <= u32::MAX as u128,
        6 => ip != 0,
        _ => false,
    }
}

fn serving_rate_limited(state: &State, netuid: u16, hotkey: &AccountId32, block: u64) -> bool {
    Axons::get(state, &netuid, hotkey).is_some_and(|previous| {
        previous.block != 0
            && block.saturating_sub(previous.block) < ServingRateLimit::get(state, &netuid)
    })
}

pub fn dispatch(exec: &mut Exec<'_>, origin: &Origin, call: &SubtensorCall) -> DispatchResult {
    let who = origin.signed()?.clone();
    match call {
        SubtensorCall::register_network { hotkey } => register_network(exec, &who, hotkey),
        SubtensorCall::start_call { netuid } => start_call(exec, &who, *netuid),
        SubtensorCall::burned_register { netuid, hotkey } => {
            burned_register(exec, &who, *netuid, hotkey)
        }
        SubtensorCall::serve_axon {
            netuid,
            version,
            ip,
            port,
            ip_type,
            protocol,
            placeholder1,
            placeholder2,
        } => serve_axon(
            exec,
            &who,
            *netuid,
            AxonInfo {
                block: exec.block,
                version: *version,
                ip: *ip,
                port: *port,
                ip_type: *ip_type,
                protocol: *protocol,
                placeholder1: *placeholder1,
                placeholder2: *placeholder2,
            },
        ),
        SubtensorCall::add_stake {
            hotkey,
            netuid,
            amount_staked,
        } => add_stake(exec, &who, hotkey, *netuid, *amount_staked),
        SubtensorCall::remove_stake {
            hotkey,
            netuid,
            amount_unstaked,
        } => remove_stake(exec, &who, hotkey, *netuid, *amount_unstaked),
        SubtensorCall::set_weights {
            netuid,
            dests,
            weights,
            version_key,
        } => {
            if CommitRevealWeightsEnabled::get(exec.state, netuid) {
                return Err(E::CommitRevealEnabled.into());
            }
            set_weights(exec, &who, *netuid, dests, weights, *version_key, true)?;
            Ok(Pays::No)
        }
        // The localnet runs one mechanism per subnet (MechanismCountCurrent = 1): mechanism 0 is
        // the subnet's own weights, any other does not exist.
        SubtensorCall::set_mechanism_weights {
            netuid,
            mecid,
            dests,
            weights,
            version_key,
        } => {
            ensure_subnet(exec.state, *netuid)?;
            if *mecid >= MechanismCountCurrent::get(exec.state, netuid) {
                return Err(E::MechanismDoesNotExist.into());
            }
            if CommitRevealWeightsEnabled::get(exec.state, netuid) {
                return Err(E::CommitRevealEnabled.into());
            }
            set_weights(exec, &who, *netuid, dests, weights, *version_key, true)?;
            Ok(Pays::No)
        }
        SubtensorCall::commit_weights {
            netuid,
            commit_hash,
        } => commit_weights(exec, &who, *netuid, *commit_hash),
        SubtensorCall::reveal_weights {
            netuid,
            uids,
            values,
            salt,
            version_key,
        } => reveal_weights(exec, &who, *netuid, uids, values, salt, *version_key),
        SubtensorCall::commit_timelocked_weights {
            netuid,
            commit,
            reveal_round,
            commit_reveal_version,
        } => commit_timelocked_weights(
            exec,
            &who,
            *netuid,
            commit,
            *reveal_round,
            *commit_reveal_version,
        ),
        SubtensorCall::commit_timelocked_mechanism_weights {
            netuid,
            mecid,
            commit,
            reveal_round,
            commit_reveal_version,
        } => {
            ensure_subnet(exec.state, *netuid)?;
            if *mecid >= MechanismCountCurrent::get(exec.state, netuid) {
                return Err(E::MechanismDoesNotExist.into());
            }
            commit_timelocked_weights(
                exec,
                &who,
                *netuid,
                commit,
                *reveal_round,
                *commit_reveal_version,
            )
        }
    }
}

fn register_network(
    exec: &mut Exec<'_>,
    coldkey: &AccountId32,
    hotkey: &AccountId32,
) -> DispatchResult {
    let owner = Owner::get(exec.state, hotkey);
    if owner != AccountId32::new([0; 32]) && &owner != coldkey {
        return Err(E::NonAssociatedColdKey.into());
    }
    let lock = NetworkMinLockCost::get(exec.state).max(NetworkLastLockCost::get(exec.state));
    if balances::free_balance(exec, coldkey) < lock {
        return Err(E::NotEnoughBalanceToStake.into());
    }
    let netuid = (1..u16::MAX)
        .find(|n| !NetworksAdded::get(exec.state, n))
        .ok_or(E::SubnetLimitReached)?;
    balances::withdraw(exec, coldkey, lock).map_err(|_| E::NotEnoughBalanceToStake)?;

    let state = &mut *exec.state;
    NetworksAdded::insert(state, &netuid, &true);
    TotalNetworks::mutate(state, |n| *n = n.saturating_add(1));
    NetworkRegisteredAt::insert(state, &netuid, &exec.block);
    SubnetLocked::insert(state, &netuid, &lock);
    SubnetOwner::insert(state, &netuid, coldkey);
    SubnetOwnerHotkey::insert(state, &netuid, hotkey);
    Tempo::insert(state, &netuid, &default_new_subnet_tempo(state));
    // New-subnet values of `init_new_network`.
    MinAllowedWeights::insert(state, &netuid, &1);
    MaxAllowedValidators::insert(state, &netuid, &64);
    ImmunityPeriod::insert(state, &netuid, &5_000);
    Burn::insert(state, &netuid, &TAO);
    Yuma3On::insert(state, &netuid, &true);
    SubnetTAO::insert(state, &netuid, &lock);
    SubnetAlphaIn::insert(state, &netuid, &lock);
    associate_hotkey(state, coldkey, hotkey);

    exec.deposit(RuntimeEvent::SubtensorModule(SubtensorEvent::NetworkAdded(
        netuid, 0,
    )));
    // The owner's hotkey takes uid 0, as subtensor does.
    let uid = append_neuron(exec.state, netuid, hotkey, exec.block);
    exec.deposit(RuntimeEvent::SubtensorModule(
        SubtensorEvent::NeuronRegistered(netuid, uid, hotkey.clone()),
    ));
    Ok(Pays::Yes)
}

fn associate_hotkey(state: &mut State, coldkey: &AccountId32, hotkey: &AccountId32) {
    if Owner::get(state, hotkey) == AccountId32::new([0; 32]) {
        Owner::insert(state, hotkey, coldkey);
    }
    OwnedHotkeys::mutate(state, coldkey, |keys| {
        if !keys.contains(hotkey) {
            keys.push(hotkey.clone());
        }
    });
}

fn start_call(exec: &mut Exec<'_>, coldkey: &AccountId32, netuid: u16) -> DispatchResult {
    ensure_subnet(exec.state, netuid)?;
    if &SubnetOwner::get(exec.state, &netuid) != coldkey {
        return Err(DispatchError::BadOrigin);
    }
    if FirstEmissionBlockNumber::contains(exec.state, &netuid) {
        return Err(E::FirstEmissionBlockNumberAlreadySet.into());
    }
    let first = exec.block + 1;
    FirstEmissionBlockNumber::insert(exec.state, &netuid, &first);
    SubtokenEnabled::insert(exec.state, &netuid, &true);
    exec.deposit(RuntimeEvent::SubtensorModule(
        SubtensorEvent::FirstEmissionBlockNumberSet(netuid, first),
    ));
    Ok(Pays::Yes)
}

/// Applies `f` to every per-uid `Vec<u16>` the epoch writes.
fn for_each_u16_vector(state: &mut State, netuid: u16, f: impl Fn(&mut Vec<u16>)) {
    Rank::mutate(state, &netuid, &f);
    Trust::mutate(state, &netuid, &f);
    Consensus::mutate(state, &netuid, &f);
    Incentive::mutate(state, &netuid, &f);
    Dividends::mutate(state, &netuid, &f);
    ValidatorTrust::mutate(state, &netuid, &f);
    PruningScores::mutate(state, &netuid, &f);
    StakeWeight::mutate(state, &netuid, &f);
}

/// Appends a neuron at uid `SubnetworkN`, growing every per-uid vector.
fn append_neuron(state: &mut State, netuid: u16, hotkey: &AccountId32, block: u64) -> u16 {
    let uid = SubnetworkN::get(state, &netuid);
    SubnetworkN::insert(state, &netuid, &(uid + 1));
    for_each_u16_vector(state, netuid, |v| v.resize(uid as usize + 1, 0));
    Emission::mutate(state, &netuid, |v| v.resize(uid as usize + 1, 0));
    Active::mutate(state, &netuid, |v| v.resize(uid as usize + 1, true));
    ValidatorPermit::mutate(state, &netuid, |v| v.resize(uid as usize + 1, false));
    LastUpdate::mutate(state, &netuid, |v| v.resize(uid as usize + 1, 0));
    LastUpdate::mutate(state, &netuid, |v| v[uid as usize] = block);
    place_neuron(state, netuid, uid, hotkey, block);
    uid
}

fn place_neuron(state: &mut State, netuid: u16, uid: u16, hotkey: &AccountId32, block: u64) {
    Keys::insert(state, &netuid, &uid, hotkey);
    Uids::insert(state, &netuid, hotkey, &uid);
    BlockAtRegistration::insert(state, &netuid, &uid, &block);
    IsNetworkMember::insert(state, hotkey, &netuid, &true);
}

/// Replaces the neuron at `uid` with a new hotkey, clearing everything the old one earned.
fn replace_neuron(state: &mut State, netuid: u16, uid: u16, hotkey: &AccountId32, block: u64) {
    let old = Keys::get(state, &netuid, &uid);
    Uids::remove(state, &netuid, &old);
    Axons::remove(state, &netuid, &old);
    IsNetworkMember::remove(state, &old, &netuid);
    Weights::remove(state, &netuid, &uid);
    Bonds::remove(state, &netuid, &uid);
    let i = uid as usize;
    for_each_u16_vector(state, netuid, |v| {
        if let Some(x) = v.get_mut(i) {
            *x = 0;
        }
    });
    Emission::mutate(state, &netuid, |v| {
        if let Some(x) = v.get_mut(i) {
            *x = 0
        }
    });
    ValidatorPermit::mutate(state, &netuid, |v| {
        if let Some(x) = v.get_mut(i) {
            *x = false
        }
    });
    LastUpdate::mutate(state, &netuid, |v| {
        if let Some(x) = v.get_mut(i) {
            *x = block
        }
    });
    place_neuron(state, netuid, uid, hotkey, block);
}

/// The uid a full subnet gives up: the non-immune neuron with the lowest emission (ties: the
/// lowest uid), never the owner's.
fn neuron_to_prune(state: &State, netuid: u16, block: u64) -> Option<u16> {
    let n = SubnetworkN::get(state, &netuid);
    let immunity = ImmunityPeriod::get(state, &netuid) as u64;
    let owner_hotkey = SubnetOwnerHotkey::get(state, &netuid);
    let emission = Emission::get(state, &netuid);
    (0..n)
        .filter(|uid| Keys::get(state, &netuid, uid) != owner_hotkey)
        .filter(|uid| {
            block.saturating_sub(BlockAtRegistration::get(state, &netuid, uid)) >= immunity
        })
        .min_by_key(|uid| (emission.get(*uid as usize).copied().unwrap_or(0), *uid))
}

fn burned_register(
    exec: &mut Exec<'_>,
    coldkey: &AccountId32,
    netuid: u16,
    hotkey: &AccountId32,
) -> DispatchResult {
    if netuid == ROOT_NETUID {
        return Err(E::RegistrationNotPermittedOnRootSubnet.into());
    }
    ensure_subnet(exec.state, netuid)?;
    if !NetworkRegistrationAllowed::get(exec.state, &netuid) {
        return Err(E::SubNetRegistrationDisabled.into());
    }
    if RegistrationsThisBlock::get(exec.state, &netuid)
        >= MaxRegistrationsPerBlock::get(exec.state, &netuid)
    {
        return Err(E::TooManyRegistrationsThisBlock.into());
    }
    if Uids::contains(exec.state, &netuid, hotkey) {
        return Err(E::HotKeyAlreadyRegisteredInSubNet.into());
    }
    let owner = Owner::get(exec.state, hotkey);
    if owner != AccountId32::new([0; 32]) && &owner != coldkey {
        return Err(E::NonAssociatedColdKey.into());
    }
    let burn = Burn::get(exec.state, &netuid);
    if balances::free_balance(exec, coldkey) < burn {
        return Err(E::NotEnoughBalanceToStake.into());
    }
    let n = SubnetworkN::get(exec.state, &netuid);
    let uid = if n < MaxAllowedUids::get(exec.state, &netuid) {
        None
    } else {
        Some(neuron_to_prune(exec.state, netuid, exec.block).ok_or(E::NoNeuronIdAvailable)?)
    };
    balances::withdraw(exec, coldkey, burn).map_err(|_| E::NotEnoughBalanceToStake)?;
    RAORecycledForRegistration::mutate(exec.state, &netuid, |r| *r = r.saturating_add(burn));
    RegistrationsThisBlock::mutate(exec.state, &netuid, |r| *r = r.saturating_add(1));
    associate_hotkey(exec.state, coldkey, hotkey);
    let uid = match uid {
        None => append_neuron(exec.state, netuid, hotkey, exec.block),
        Some(uid) => {
            replace_neuron(exec.state, netuid, uid, hotkey, exec.block);
            uid
        }
    };
    exec.deposit(RuntimeEvent::SubtensorModule(
        SubtensorEvent::NeuronRegistered(netuid, uid, hotkey.clone()),
    ));
    Ok(Pays::Yes)
}

fn serve_axon(
    exec: &mut Exec<'_>,
    hotkey: &AccountId32,
    netuid: u16,
    axon: AxonInfo,
) -> DispatchResult {
    if !Uids::contains(exec.state, &netuid, hotkey) {
        return Err(E::HotKeyNotRegisteredInNetwork.into());
    }
    if axon.ip_type != 4 && axon.ip_type != 6 {
        return Err(E::InvalidIpType.into());
    }
    if !valid_ip(axon.ip_type, axon.ip) {
        return Err(E::InvalidIpAddress.into());
    }
    if axon.port == 0 {
        return Err(E::InvalidPort.into());
    }
    if serving_rate_limited(exec.state, netuid, hotkey, exec.block) {
        return Err(E::ServingRateLimitExceeded.into());
    }
    Axons::insert(exec.state, &netuid, hotkey, &axon);
    exec.deposit(RuntimeEvent::SubtensorModule(SubtensorEvent::AxonServed(
        netuid,
        hotkey.clone(),
    )));
    Ok(Pays::Yes)
}

/// A coldkey's alpha on (hotkey, netuid): its share of the hotkey's pool.
pub fn stake_of(state: &State, hotkey: &AccountId32, coldkey: &AccountId32, netuid: u16) -> u64 {
    let shares = Alpha::get(state, hotkey, coldkey, &netuid).bits;
    let total_shares = TotalHotkeyShares::get(state, hotkey, &netuid).bits;
    let total_alpha = TotalHotkeyAlpha::get(state, hotkey, &netuid) as u128;
    if total_shares == 0 {
        return 0;
    }
    (shares.saturating_mul(total_alpha) / total_shares).min(u64::MAX as u128) as u64
}

/// Adds `alpha` to the pool of (hotkey, netuid) on behalf of `coldkey`, minting shares at the
/// pool's current price.
fn stake_into(
    state: &mut State,
    hotkey: &AccountId32,
    coldkey: &AccountId32,
    netuid: u16,
    alpha: u64,
) {
    let total_alpha = TotalHotkeyAlpha::get(state, hotkey, &netuid) as u128;
    let total_shares = TotalHotkeyShares::get(state, hotkey, &netuid).bits;
    let new_shares = if total_shares == 0 || total_alpha == 0 {
        FixedU128::from_int(alpha).bits
    } else {
        (alpha as u128).saturating_mul(total_shares) / total_alpha
    };
    Alpha::mutate(state, hotkey, coldkey, &netuid, |s| {
        s.bits = s.bits.saturating_add(new_shares)
    });
    TotalHotkeyShares::mutate(state, hotkey, &netuid, |s| {
        s.bits = s.bits.saturating_add(new_shares)
    });
    TotalHotkeyAlpha::mutate(state, hotkey, &netuid, |a| *a = a.saturating_add(alpha));
    StakingHotkeys::mutate(state, coldkey, |keys| {
        if !keys.contains(hotkey) {
            keys.push(hotkey.clone());
        }
    });
}

/// Adds emission to a hotkey's pool: existing shares gain value; a pool nobody holds goes to the
/// hotkey's owner.
fn emit_to_hotkey(state: &mut State, hotkey: &AccountId32, netuid: u16, alpha: u64) {
    if alpha == 0 {
        return;
    }
    if TotalHotkeyShares::get(state, hotkey, &netuid).bits == 0 {
        let owner = Owner::get(state, hotkey);
        stake_into(state, hotkey, &owner, netuid, alpha);
    } else {
        TotalHotkeyAlpha::mutate(state, hotkey, &netuid, |a| *a = a.saturating_add(alpha));
    }
    SubnetAlphaOut::mutate(state, &netuid, |a| *a = a.saturating_add(alpha));
}

fn add_stake(
    exec: &mut Exec<'_>,
    coldkey: &AccountId32,
    hotkey: &AccountId32,
    netuid: u16,
    amount: u64,
) -> DispatchResult {
    ensure_subnet(exec.state, netuid)?;
    if Owner::get(exec.state, hotkey) == AccountId32::new([0; 32]) {
        return Err(E::HotKeyAccountNotExists.into());
    }
    if amount < MIN_STAKE {
        return Err(E::AmountTooLow.into());
    }
    if balances::free_balance(exec, coldkey) < amount {
        return Err(E::NotEnoughBalanceToStake.into());
    }
    balances::withdraw(exec, coldkey, amount).map_err(|_| E::NotEnoughBalanceToStake)?;
    stake_into(exec.state, hotkey, coldkey, netuid, amount);
    TotalStake::mutate(exec.state, |t| *t = t.saturating_add(amount));
    SubnetTAO::mutate(exec.state, &netuid, |t| *t = t.saturating_add(amount));
    exec.deposit(RuntimeEvent::SubtensorModule(SubtensorEvent::StakeAdded(
        coldkey.clone(),
        hotkey.clone(),
        amount,
        amount,
        netuid,
        0,
    )));
    Ok(Pays::Yes)
}

fn remove_stake(
    exec: &mut Exec<'_>,
    coldkey: &AccountId32,
    hotkey: &AccountId32,
    netuid: u16,
    alpha: u64,
) -> DispatchResult {
    ensure_subnet(exec.state, netuid)?;
    if Owner::get(exec.state, hotkey) == AccountId32::new([0; 32]) {
        return Err(E::HotKeyAccountNotExists.into());
    }
    if alpha == 0 {
        return Err(E::AmountTooLow.into());
    }
    let owned = stake_of(exec.state, hotkey, coldkey, netuid);
    if alpha > owned {
        return Err(E::NotEnoughStakeToWithdraw.into());
    }
    let total_alpha = TotalHotkeyAlpha::get(exec.state, hotkey, &netuid) as u128;
    let total_shares = TotalHotkeyShares::get(exec.state, hotkey, &netuid).bits;
    let mut shares = (alpha as u128)
        .saturating_mul(total_shares)
        .div_ceil(total_alpha.max(1));
    let held = Alpha::get(exec.state, hotkey, coldkey, &netuid).bits;
    if alpha == owned || shares > held {
        shares = held;
    }
    let state = &mut *exec.state;
    Alpha::mutate(state, hotkey, coldkey, &netuid, |s| s.bits -= shares);
    TotalHotkeyShares::mutate(state, hotkey, &netuid, |s| {
        s.bits = s.bits.saturating_sub(shares)
    });
    TotalHotkeyAlpha::mutate(state, hotkey, &netuid, |a| *a = a.saturating_sub(alpha));
    TotalStake::mutate(state, |t| *t = t.saturating_sub(alpha));
    SubnetTAO::mutate(state, &netuid, |t| *t = t.saturating_sub(alpha));
    balances::deposit(exec, coldkey, alpha);
    exec.deposit(RuntimeEvent::SubtensorModule(SubtensorEvent::StakeRemoved(
        coldkey.clone(),
        hotkey.clone(),
        alpha,
        alpha,
        netuid,
        0,
    )));
    Ok(Pays::Yes)
}

/// `vec_u16_max_upscale_to_u16`: scales so the largest weight is 65 535, rounding to nearest.
fn max_upscale(values: &[u16]) -> Vec<u16> {
    let max = values.iter().copied().max().unwrap_or(0) as u64;
    if max == 0 {
        return values.to_vec();
    }
    values
        .iter()
        .map(|&v| ((v as u64 * 65_535 + max / 2) / max) as u16)
        .collect()
}

/// Subtensor's `set_weights` checks, in its order, then the write. `rate_limited` is false for
/// reveals, whose timing the commit-reveal window governs instead.
#[allow(clippy::too_many_arguments)]
fn set_weights(
    exec: &mut Exec<'_>,
    hotkey: &AccountId32,
    netuid: u16,
    uids: &[u16],
    values: &[u16],
    version_key: u64,
    rate_limited: bool,
) -> Result<(), DispatchError> {
    let state = &*exec.state;
    if netuid == ROOT_NETUID {
        return Err(E::CanNotSetRootNetworkWeights.into());
    }
    if uids.len() != values.len() {
        return Err(E::WeightVecNotEqualSize.into());
    }
    ensure_subnet(state, netuid)?;
    let n = SubnetworkN::get(state, &netuid);
    if uids.len() > n as usize {
        return Err(E::UidsLengthExceedUidsInSubNet.into());
    }
    let uid = Uids::get(state, &netuid, hotkey).ok_or(E::HotKeyNotRegisteredInSubNet)?;
    if TotalHotkeyAlpha::get(state, hotkey, &netuid) < StakeThreshold::get(state) {
        return Err(E::NotEnoughStakeToSetWeights.into());
    }
    let required_key = WeightsVersionKey::get(state, &netuid);
    if required_key != 0 && version_key < required_key {
        return Err(E::IncorrectWeightVersionKey.into());
    }
    if rate_limited && !weights_rate_limit_passed(state, netuid, uid, exec.block) {
        return Err(E::SettingWeightsTooFast.into());
    }
    let self_weight = uids.len() == 1 && uids[0] == uid;
    let is_owner = &SubnetOwnerHotkey::get(state, &netuid) == hotkey;
    let permitted = ValidatorPermit::get(state, &netuid)
        .get(uid as usize)
        .copied()
        .unwrap_or(false);
    if !self_weight && !is_owner && !permitted {
        return Err(E::NeuronNoValidatorPermit.into());
    }
    let mut seen = std::collections::BTreeSet::new();
    if !uids.iter().all(|u| seen.insert(*u)) {
        return Err(E::DuplicateUids.into());
    }
    if uids.iter().any(|u| *u >= n) {
        return Err(E::UidVecContainInvalidOne.into());
    }
    let min_weights = MinAllowedWeights::get(state, &netuid).min(n) as usize;
    if !self_weight && uids.len() < min_weights {
        return Err(E::WeightVecLengthIsLow.into());
    }
    let upscaled = max_upscale(values);
    let limit = MaxWeightsLimit::get(state, &netuid);
    if !self_weight && limit != u16::MAX {
        let sum: u64 = upscaled.iter().map(|&w| w as u64).sum();
        if sum > 0
            && upscaled
                .iter()
                .any(|&w| (w as u64 * 65_535) / sum > limit as u64)
        {
            return Err(E::MaxWeightExceeded.into());
        }
    }
    let row: Vec<(u16, u16)> = uids.iter().copied().zip(upscaled).collect();
    Weights::insert(exec.state, &netuid, &uid, &row);
    set_last_update(exec, netuid, uid);
    exec.deposit(RuntimeEvent::SubtensorModule(SubtensorEvent::WeightsSet(
        netuid, uid,
    )));
    Ok(())
}

/// Subtensor's weights rate limit, for sets and commits alike: `WeightsSetRateLimit` blocks
/// since the uid's `LastUpdate`; a uid that never set or committed weights is not limited.
fn weights_rate_limit_passed(state: &State, netuid: u16, uid: u16, block: u64) -> bool {
    let last = LastUpdate::get(state, &netuid)
        .get(uid as usize)
        .copied()
        .unwrap_or(0);
    last == 0 || block.saturating_sub(last) >= WeightsSetRateLimit::get(state, &netuid)
}

fn set_last_update(exec: &mut Exec<'_>, netuid: u16, uid: u16) {
    let block = exec.block;
    LastUpdate::mutate(exec.state, &netuid, |v| {
        if let Some(x) = v.get_mut(uid as usize) {
            *x = block;
        }
    });
}

/// The commit hash subtensor checks reveals against: blake2-256 of the SCALE tuple.
pub fn weights_commit_hash(
    who: &AccountId32,
    netuid: u16,
    uids: &[u16],
    values: &[u16],
    salt: &[u16],
    version_key: u64,
) -> H256 {
    let encoded = (who, netuid, uids, values, salt, version_key).encode();
    H256(sp_crypto_hashing::blake2_256(&encoded))
}

fn commit_weights(
    exec: &mut Exec<'_>,
    hotkey: &AccountId32,
    netuid: u16,
    hash: H256,
) -> DispatchResult {
    ensure_subnet(exec.state, netuid)?;
    if !CommitRevealWeightsEnabled::get(exec.state, &netuid) {
        return Err(E::CommitRevealDisabled.into());
    }
    let uid = Uids::get(exec.state, &netuid, hotkey).ok_or(E::HotKeyNotRegisteredInSubNet)?;
    // As subtensor's `do_commit_weights`: commits share the weights rate limit, and a commit
    // counts as an update.
    if !weights_rate_limit_passed(exec.state, netuid, uid, exec.block) {
        return Err(E::CommittingWeightsTooFast.into());
    }
    let epoch = epoch_index(exec.state, netuid, exec.block);
    let reveal_epoch = epoch + RevealPeriodEpochs::get(exec.state, &netuid);
    let mut commits = WeightCommits::get(exec.state, &netuid, hotkey).unwrap_or_default();
    // Commits whose reveal epoch has passed can no longer be revealed.
    commits.retain(|(_, _, _, reveal)| *reveal >= epoch);
    if commits.len() >= MAX_UNREVEALED_COMMITS {
        return Err(E::TooManyUnrevealedCommits.into());
    }
    commits.push((hash, epoch, exec.block, reveal_epoch));
    WeightCommits::insert(exec.state, &netuid, hotkey, &commits);
    set_last_update(exec, netuid, uid);
    exec.deposit(RuntimeEvent::SubtensorModule(
        SubtensorEvent::WeightsCommitted(hotkey.clone(), netuid, hash),
    ));
    Ok(Pays::No)
}

#[allow(clippy::too_many_arguments)]
fn reveal_weights(
    exec: &mut Exec<'_>,
    hotkey: &AccountId32,
    netuid: u16,
    uids: &[u16],
    values: &[u16],
    salt: &[u16],
    version_key: u64,
) -> DispatchResult {
    ensure_subnet(exec.state, netuid)?;
    if !CommitRevealWeightsEnabled::get(exec.state, &netuid) {
        return Err(E::CommitRevealDisabled.into());
    }
    let mut commits =
        WeightCommits::get(exec.state, &netuid, hotkey).ok_or(E::NoWeightsCommitFound)?;
    let hash = weights_commit_hash(hotkey, netuid, uids, values, salt, version_key);
    let epoch = epoch_index(exec.state, netuid, exec.block);
    let position = commits
        .iter()
        .position(|(h, ..)| *h == hash)
        .ok_or(E::InvalidRevealCommitHashNotMatch)?;
    let (_, _, _, reveal_epoch) = commits[position];
    if epoch < reveal_epoch {
        return Err(E::RevealTooEarly.into());
    }
    if epoch > reveal_epoch {
        return Err(E::ExpiredWeightCommit.into());
    }
    commits.remove(position);
    if commits.is_empty() {
        WeightCommits::remove(exec.state, &netuid, hotkey);
    } else {
        WeightCommits::insert(exec.state, &netuid, hotkey, &commits);
    }
    set_weights(exec, hotkey, netuid, uids, values, version_key, false)?;
    exec.deposit(RuntimeEvent::SubtensorModule(
        SubtensorEvent::WeightsRevealed(hotkey.clone(), netuid, hash),
    ));
    Ok(Pays::No)
}

/// Subtensor's `do_commit_timelocked_weights`: the ciphertext is kept under the epoch it was made
/// in, to be opened by the chain once the beacon's pulse for `reveal_round` is stored and the
/// reveal epoch has come ([`reveal_timelocked_commits`]).
fn commit_timelocked_weights(
    exec: &mut Exec<'_>,
    hotkey: &AccountId32,
    netuid: u16,
    commit: &BoundedVec<u8>,
    reveal_round: u64,
    version: u16,
) -> DispatchResult {
    ensure_subnet(exec.state, netuid)?;
    if !CommitRevealWeightsEnabled::get(exec.state, &netuid) {
        return Err(E::CommitRevealDisabled.into());
    }
    if version != CommitRevealWeightsVersion::get(exec.state) {
        return Err(E::IncorrectCommitRevealVersion.into());
    }
    if commit.0.len() > MAX_TIMELOCKED_COMMIT_LEN {
        return Err(E::InvalidValue.into());
    }
    let uid = Uids::get(exec.state, &netuid, hotkey).ok_or(E::HotKeyNotRegisteredInSubNet)?;
    if !weights_rate_limit_passed(exec.state, netuid, uid, exec.block) {
        return Err(E::CommittingWeightsTooFast.into());
    }
    let epoch = epoch_index(exec.state, netuid, exec.block);
    let mut commits = TimelockedWeightCommits::get(exec.state, &netuid, &epoch);
    if commits.iter().filter(|(who, ..)| who == hotkey).count() >= MAX_UNREVEALED_COMMITS {
        return Err(E::TooManyUnrevealedCommits.into());
    }
    commits.push((hotkey.clone(), exec.block, commit.clone(), reveal_round));
    TimelockedWeightCommits::insert(exec.state, &netuid, &epoch, &commits);
    set_last_update(exec, netuid, uid);
    let hash = H256(sp_crypto_hashing::blake2_256(&commit.0));
    exec.deposit(RuntimeEvent::SubtensorModule(
        SubtensorEvent::TimelockedWeightsCommitted(hotkey.clone(), netuid, hash, reveal_round),
    ));
    Ok(Pays::No)
}

/// Subtensor's `reveal_crv3_commits`, run every block: the commits made `RevealPeriodEpochs`
/// epochs ago are opened with their round's pulse and set as weights. A commit whose pulse is not
/// stored yet waits for a later block of the reveal epoch; older epochs' commits are dropped. A
/// commit that does not open, does not decode, names another hotkey than its sender (v4) or
/// fails the weights checks is dropped, as on finney, without failing the block.
fn reveal_timelocked_commits(exec: &mut Exec<'_>, netuid: u16) {
    let current = epoch_index(exec.state, netuid, exec.block);
    let Some(reveal_epoch) = current.checked_sub(RevealPeriodEpochs::get(exec.state, &netuid))
    else {
        return;
    };
    // The netuid's part of the key: prefix ++ twox64(netuid) ++ netuid, then the epoch's part,
    // twox64(epoch) ++ epoch.
    let mut prefix = TimelockedWeightCommits::prefix();
    super::storage::Hasher::Twox64Concat.hash_into(&netuid.encode(), &mut prefix);
    let stale: Vec<u64> = exec
        .state
        .keys_with_prefix(&prefix, None)
        .filter_map(|k| {
            let tail = k.get(prefix.len() + 8..prefix.len() + 16)?;
            Some(u64::from_le_bytes(tail.try_into().ok()?))
        })
        .filter(|epoch| *epoch < reveal_epoch)
        .collect();
    for epoch in stale {
        TimelockedWeightCommits::remove(exec.state, &netuid, &epoch);
    }
    let commits = TimelockedWeightCommits::get(exec.state, &netuid, &reveal_epoch);
    if commits.is_empty() {
        return;
    }
    let mut waiting = Vec::new();
    for (who, commit_block, commit, round) in commits {
        let Some(pulse) = Pulses::get(exec.state, &round) else {
            waiting.push((who, commit_block, commit, round));
            continue;
        };
        let opened = iota_drand::decrypt_with_signature(&commit.0, &pulse.signature.0)
            .map_err(|e| e.to_string())
            .and_then(|plain| {
                iota_drand::WeightsTlockPayload::decode(&mut &plain[..]).map_err(|e| e.to_string())
            });
        let payload = match opened {
            Ok(p) if p.hotkey.as_slice() == AsRef::<[u8]>::as_ref(&who) => p,
            Ok(_) => {
                tracing::debug!(netuid, ?who, "timelocked commit names another hotkey");
                continue;
            }
            Err(error) => {
                tracing::debug!(netuid, ?who, %error, "timelocked commit does not open");
                continue;
            }
        };
        let set = exec.transactional(|exec| {
            set_weights(
                exec,
                &who,
                netuid,
                &payload.uids,
                &payload.values,
                payload.version_key,
                false,
            )
        });
        match set {
            Ok(()) => exec.deposit(RuntimeEvent::SubtensorModule(
                SubtensorEvent::TimelockedWeightsRevealed(netuid, who),
            )),
            Err(error) => tracing::debug!(netuid, ?who, ?error, "revealed weights refused"),
        }
    }
    if waiting.is_empty() {
        TimelockedWeightCommits::remove(exec.state, &netuid, &reveal_epoch);
    } else {
        TimelockedWeightCommits::insert(exec.state, &netuid, &reveal_epoch, &waiting);
    }
}

fn subnets(state: &State) -> Vec<u16> {
    let prefix = NetworksAdded::prefix();
    state
        .keys_with_prefix(&prefix, None)
        .filter_map(|k| {
            k.get(prefix.len()..prefix.len() + 2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
        })
        .filter(|n| *n != ROOT_NETUID && NetworksAdded::get(state, n))
        .collect()
}

/// Per-block work: registration counters reset, emission accrues on started subnets, and the
/// subnets whose epoch falls on this block run Yuma consensus and pay out.
pub fn block_step(exec: &mut Exec<'_>) {
    for netuid in subnets(exec.state) {
        RegistrationsThisBlock::insert(exec.state, &netuid, &0);
        let started = FirstEmissionBlockNumber::get(exec.state, &netuid)
            .is_some_and(|b| exec.block >= b)
            && SubtokenEnabled::get(exec.state, &netuid);
        if started {
            let owner_cut = BLOCK_EMISSION * OWNER_CUT / 65_535;
            let rest = BLOCK_EMISSION - owner_cut;
            PendingOwnerCut::mutate(exec.state, &netuid, |p| *p = p.saturating_add(owner_cut));
            PendingServerEmission::mutate(exec.state, &netuid, |p| *p = p.saturating_add(rest / 2));
            PendingValidatorEmission::mutate(exec.state, &netuid, |p| {
                *p = p.saturating_add(rest - rest / 2)
            });
        }
        BlocksSinceLastStep::mutate(exec.state, &netuid, |b| *b = b.saturating_add(1));
        reveal_timelocked_commits(exec, netuid);
        if is_epoch_block(exec.state, netuid, exec.block) {
            run_epoch(exec, netuid);
        }
    }
}

fn run_epoch(exec: &mut Exec<'_>, netuid: u16) {
    let state = &mut *exec.state;
    let block = exec.block;
    let n = SubnetworkN::get(state, &netuid);
    let server = PendingServerEmission::get(state, &netuid);
    let validator = PendingValidatorEmission::get(state, &netuid);
    let owner_cut = PendingOwnerCut::get(state, &netuid);
    PendingServerEmission::insert(state, &netuid, &0);
    PendingValidatorEmission::insert(state, &netuid, &0);
    PendingOwnerCut::insert(state, &netuid, &0);

    let hotkeys: Vec<AccountId32> = (0..n).map(|uid| Keys::get(state, &netuid, &uid)).collect();
    let owner_hotkey = SubnetOwnerHotkey::get(state, &netuid);
    let last_update = LastUpdate::get(state, &netuid);
    let permits = ValidatorPermit::get(state, &netuid);
    let neurons: Vec<yuma::Neuron> = (0..n)
        .map(|uid| yuma::Neuron {
            stake: TotalHotkeyAlpha::get(state, &hotkeys[uid as usize], &netuid),
            last_update: last_update.get(uid as usize).copied().unwrap_or(0),
            block_at_registration: BlockAtRegistration::get(state, &netuid, &uid),
            validator_permit: permits.get(uid as usize).copied().unwrap_or(false),
            weights: Weights::get(state, &netuid, &uid),
            bonds: Bonds::get(state, &netuid, &uid),
        })
        .collect();
    let params = yuma::EpochParams {
        current_block: block,
        activity_cutoff: ActivityCutoff::get(state, &netuid) as u64,
        kappa: Kappa::get(state, &netuid),
        bonds_moving_average: BondsMovingAverage::get(state, &netuid),
        bonds_penalty: BondsPenalty::get(state, &netuid),
        max_allowed_validators: MaxAllowedValidators::get(state, &netuid),
        stake_threshold: StakeThreshold::get(state),
        yuma3: Yuma3On::get(state, &netuid),
        last_mechanism_step_block: LastMechansimStepBlock::get(state, &netuid),
        tempo: Tempo::get(state, &netuid),
        owner_uid: Uids::get(state, &netuid, &owner_hotkey),
    };
    let result = yuma::run_epoch(&params, &neurons, server.saturating_add(validator));

    Active::insert(state, &netuid, &result.active);
    Consensus::insert(state, &netuid, &result.consensus);
    Incentive::insert(state, &netuid, &result.incentive);
    Dividends::insert(state, &netuid, &result.dividends);
    ValidatorTrust::insert(state, &netuid, &result.validator_trust);
    ValidatorPermit::insert(state, &netuid, &result.new_validator_permit);
    StakeWeight::insert(state, &netuid, &result.stake_weight);
    Emission::insert(state, &netuid, &result.emission);
    Rank::insert(state, &netuid, &result.incentive);
    Trust::insert(state, &netuid, &result.consensus);
    PruningScores::insert(
        state,
        &netuid,
        &result
            .emission
            .iter()
            .map(|e| (*e).min(u16::MAX as u64) as u16)
            .collect::<Vec<_>>(),
    );
    for (uid, row) in result.bonds.iter().enumerate() {
        if row.is_empty() {
            Bonds::remove(state, &netuid, &(uid as u16));
        } else {
            Bonds::insert(state, &netuid, &(uid as u16), row);
        }
    }
    for (uid, hotkey) in hotkeys.iter().enumerate() {
        let miner = result.server_emission.get(uid).copied().unwrap_or(0);
        let dividend = result.validator_emission.get(uid).copied().unwrap_or(0);
        emit_to_hotkey(state, hotkey, netuid, miner.saturating_add(dividend));
        if dividend > 0 {
            AlphaDividendsPerSubnet::insert(state, &netuid, hotkey, &dividend);
        } else {
            AlphaDividendsPerSubnet::remove(state, &netuid, hotkey);
        }
    }
    if owner_cut > 0 && owner_hotkey != AccountId32::new([0; 32]) {
        emit_to_hotkey(state, &owner_hotkey, netuid, owner_cut);
    }
    LastMechansimStepBlock::insert(state, &netuid, &block);
    BlocksSinceLastStep::insert(state, &netuid, &0);
    exec.deposit(RuntimeEvent::SubtensorModule(
        SubtensorEvent::IncentiveAlphaEmittedToMiners {
            netuid,
            emissions: result.server_emission,
        },
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    const NETUID: u16 = 1;

    /// A subnet whose uid `i` registered at `registered[i]` and earned `emission[i]`; uid 0 is
    /// the owner's.
    fn subnet(registered: &[u64], emission: &[u64], immunity: u16) -> State {
        let mut state = State::default();
        let key = |uid: u16| AccountId32::new([uid as u8 + 1; 32]);
        SubnetworkN::insert(&mut state, &NETUID, &(registered.len() as u16));
        SubnetOwnerHotkey::insert(&mut state, &NETUID, &key(0));
        ImmunityPeriod::insert(&mut state, &NETUID, &immunity);
        Emission::insert(&mut state, &NETUID, &emission.to_vec());
        for (uid, block) in registered.iter().enumerate() {
            let uid = uid as u16;
            Keys::insert(&mut state, &NETUID, &uid, &key(uid));
            BlockAtRegistration::insert(&mut state, &NETUID, &uid, block);
        }
        state
    }

    #[test]
    fn a_full_subnet_gives_up_the_lowest_emission_among_the_non_immune() {
        // The lowest emission, not the lowest uid; the owner (earning nothing) never.
        let state = subnet(&[0, 10, 10, 10], &[0, 7, 2, 5], 100);
        assert_eq!(neuron_to_prune(&state, NETUID, 200), Some(2));
        // Ties go to the lowest uid.
        let state = subnet(&[0, 10, 10, 10], &[0, 4, 2, 2], 100);
        assert_eq!(neuron_to_prune(&state, NETUID, 200), Some(2));
        // Uid 2 is still immune at block 150 (registered at 60, immunity 100): uid 3 goes.
        let state = subnet(&[0, 10, 60, 10], &[0, 7, 2, 5], 100);
        assert_eq!(neuron_to_prune(&state, NETUID, 150), Some(3));
        // Immunity ends after exactly its length.
        assert_eq!(neuron_to_prune(&state, NETUID, 160), Some(2));
        // Every neuron but the owner's immune: none can go.
        let state = subnet(&[0, 90, 95, 99], &[0, 7, 2, 5], 100);
        assert_eq!(neuron_to_prune(&state, NETUID, 150), None);
    }
}
