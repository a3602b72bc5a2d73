//! The calls the localnet dispatches. Pallet and call indices, argument names and argument types are
//! finney's (spec 393); calls finney has and the localnet does not implement are simply absent, so a
//! client sees a clean "unknown call" rather than a call that silently does nothing.
#![allow(non_camel_case_types)]

use parity_scale_codec::{Decode, Encode};
use scale_info::TypeInfo;

use super::types::{AccountId32, Balance, BoundedVec, H256, MultiAddress};

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum RuntimeCall {
    #[codec(index = 0)]
    System(SystemCall),
    #[codec(index = 5)]
    Balances(BalancesCall),
    #[codec(index = 7)]
    SubtensorModule(SubtensorCall),
    #[codec(index = 12)]
    Sudo(SudoCall),
    #[codec(index = 19)]
    AdminUtils(AdminUtilsCall),
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum SystemCall {
    #[codec(index = 0)]
    remark { remark: Vec<u8> },
    #[codec(index = 7)]
    remark_with_event { remark: Vec<u8> },
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum BalancesCall {
    #[codec(index = 0)]
    transfer_allow_death {
        dest: MultiAddress,
        #[codec(compact)]
        value: Balance,
    },
    #[codec(index = 2)]
    force_transfer {
        source: MultiAddress,
        dest: MultiAddress,
        #[codec(compact)]
        value: Balance,
    },
    #[codec(index = 3)]
    transfer_keep_alive {
        dest: MultiAddress,
        #[codec(compact)]
        value: Balance,
    },
    #[codec(index = 4)]
    transfer_all {
        dest: MultiAddress,
        keep_alive: bool,
    },
    #[codec(index = 8)]
    force_set_balance {
        who: MultiAddress,
        #[codec(compact)]
        new_free: Balance,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum SubtensorCall {
    #[codec(index = 0)]
    set_weights {
        netuid: u16,
        dests: Vec<u16>,
        weights: Vec<u16>,
        version_key: u64,
    },
    #[codec(index = 2)]
    add_stake {
        hotkey: AccountId32,
        netuid: u16,
        amount_staked: u64,
    },
    #[codec(index = 3)]
    remove_stake {
        hotkey: AccountId32,
        netuid: u16,
        amount_unstaked: u64,
    },
    #[codec(index = 4)]
    serve_axon {
        netuid: u16,
        version: u32,
        ip: u128,
        port: u16,
        ip_type: u8,
        protocol: u8,
        placeholder1: u8,
        placeholder2: u8,
    },
    #[codec(index = 7)]
    burned_register { netuid: u16, hotkey: AccountId32 },
    #[codec(index = 59)]
    register_network { hotkey: AccountId32 },
    #[codec(index = 92)]
    start_call { netuid: u16 },
    #[codec(index = 96)]
    commit_weights { netuid: u16, commit_hash: H256 },
    #[codec(index = 97)]
    reveal_weights {
        netuid: u16,
        uids: Vec<u16>,
        values: Vec<u16>,
        salt: Vec<u16>,
        version_key: u64,
    },
    #[codec(index = 113)]
    commit_timelocked_weights {
        netuid: u16,
        commit: BoundedVec<u8>,
        reveal_round: u64,
        commit_reveal_version: u16,
    },
    #[codec(index = 118)]
    commit_timelocked_mechanism_weights {
        netuid: u16,
        mecid: u8,
        commit: BoundedVec<u8>,
        reveal_round: u64,
        commit_reveal_version: u16,
    },
    #[codec(index = 119)]
    set_mechanism_weights {
        netuid: u16,
        mecid: u8,
        dests: Vec<u16>,
        weights: Vec<u16>,
        version_key: u64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum SudoCall {
    #[codec(index = 0)]
    sudo { call: Box<RuntimeCall> },
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum AdminUtilsCall {
    #[codec(index = 3)]
    sudo_set_serving_rate_limit {
        netuid: u16,
        serving_rate_limit: u64,
    },
    #[codec(index = 6)]
    sudo_set_weights_version_key {
        netuid: u16,
        weights_version_key: u64,
    },
    #[codec(index = 7)]
    sudo_set_weights_set_rate_limit {
        netuid: u16,
        weights_set_rate_limit: u64,
    },
    #[codec(index = 13)]
    sudo_set_immunity_period { netuid: u16, immunity_period: u16 },
    #[codec(index = 14)]
    sudo_set_min_allowed_weights {
        netuid: u16,
        min_allowed_weights: u16,
    },
    #[codec(index = 15)]
    sudo_set_max_allowed_uids { netuid: u16, max_allowed_uids: u16 },
    #[codec(index = 16)]
    sudo_set_kappa { netuid: u16, kappa: u16 },
    #[codec(index = 18)]
    sudo_set_activity_cutoff { netuid: u16, activity_cutoff: u16 },
    #[codec(index = 19)]
    sudo_set_network_registration_allowed {
        netuid: u16,
        registration_allowed: bool,
    },
    #[codec(index = 22)]
    sudo_set_min_burn { netuid: u16, min_burn: u64 },
    #[codec(index = 23)]
    sudo_set_max_burn { netuid: u16, max_burn: u64 },
    #[codec(index = 25)]
    sudo_set_max_allowed_validators {
        netuid: u16,
        max_allowed_validators: u16,
    },
    #[codec(index = 26)]
    sudo_set_bonds_moving_average {
        netuid: u16,
        bonds_moving_average: u64,
    },
    #[codec(index = 27)]
    sudo_set_max_registrations_per_block {
        netuid: u16,
        max_registrations_per_block: u16,
    },
    #[codec(index = 29)]
    sudo_set_network_rate_limit { rate_limit: u64 },
    #[codec(index = 30)]
    sudo_set_tempo { netuid: u16, tempo: u16 },
    #[codec(index = 36)]
    sudo_set_network_min_lock_cost { lock_cost: u64 },
    #[codec(index = 42)]
    sudo_set_stake_threshold { min_stake: u64 },
    #[codec(index = 49)]
    sudo_set_commit_reveal_weights_enabled { netuid: u16, enabled: bool },
    #[codec(index = 57)]
    sudo_set_commit_reveal_weights_interval { netuid: u16, interval: u64 },
    #[codec(index = 69)]
    sudo_set_yuma3_enabled { netuid: u16, enabled: bool },
    #[codec(index = 71)]
    sudo_set_commit_reveal_version { version: u16 },
}
