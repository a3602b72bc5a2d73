//! Events and dispatch errors, with finney's pallet and variant indices so that a client decoding
//! `System.Events` by name from metadata, or by index from finney's, reads the same thing.

use parity_scale_codec::{Decode, Encode};
use scale_info::TypeInfo;

use super::types::{AccountId32, Balance, H256};

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct EventRecord {
    pub phase: Phase,
    pub event: RuntimeEvent,
    pub topics: Vec<H256>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum Phase {
    ApplyExtrinsic(u32),
    Finalization,
    Initialization,
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum RuntimeEvent {
    #[codec(index = 0)]
    System(SystemEvent),
    #[codec(index = 5)]
    Balances(BalancesEvent),
    #[codec(index = 7)]
    SubtensorModule(SubtensorEvent),
    #[codec(index = 12)]
    Sudo(SudoEvent),
    #[codec(index = 19)]
    AdminUtils(AdminUtilsEvent),
    #[codec(index = 26)]
    Drand(DrandEvent),
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum SystemEvent {
    #[codec(index = 0)]
    ExtrinsicSuccess { dispatch_info: DispatchEventInfo },
    #[codec(index = 1)]
    ExtrinsicFailed {
        dispatch_error: DispatchError,
        dispatch_info: DispatchEventInfo,
    },
    #[codec(index = 3)]
    NewAccount { account: AccountId32 },
    #[codec(index = 5)]
    Remarked { sender: AccountId32, hash: H256 },
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum BalancesEvent {
    #[codec(index = 0)]
    Endowed {
        account: AccountId32,
        free_balance: Balance,
    },
    #[codec(index = 2)]
    Transfer {
        from: AccountId32,
        to: AccountId32,
        amount: Balance,
    },
    #[codec(index = 3)]
    BalanceSet { who: AccountId32, free: Balance },
    #[codec(index = 8)]
    Withdraw { who: AccountId32, amount: Balance },
}

/// SubtensorModule's events are positional, as in the pallet.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum SubtensorEvent {
    /// (netuid, modality)
    #[codec(index = 0)]
    NetworkAdded(u16, u16),
    /// (coldkey, hotkey, tao, alpha, netuid, fee)
    #[codec(index = 2)]
    StakeAdded(AccountId32, AccountId32, u64, u64, u16, u64),
    #[codec(index = 3)]
    StakeRemoved(AccountId32, AccountId32, u64, u64, u16, u64),
    /// (netuid storage index, uid)
    #[codec(index = 5)]
    WeightsSet(u16, u16),
    /// (netuid, uid, hotkey)
    #[codec(index = 6)]
    NeuronRegistered(u16, u16, AccountId32),
    #[codec(index = 9)]
    MaxAllowedUidsSet(u16, u16),
    #[codec(index = 15)]
    ActivityCutoffSet(u16, u16),
    #[codec(index = 18)]
    KappaSet(u16, u16),
    #[codec(index = 19)]
    MinAllowedWeightSet(u16, u16),
    #[codec(index = 22)]
    WeightsSetRateLimitSet(u16, u64),
    #[codec(index = 23)]
    ImmunityPeriodSet(u16, u16),
    #[codec(index = 24)]
    BondsMovingAverageSet(u16, u64),
    #[codec(index = 27)]
    MaxAllowedValidatorsSet(u16, u16),
    #[codec(index = 14)]
    MaxRegistrationsPerBlockSet(u16, u16),
    #[codec(index = 28)]
    AxonServed(u16, AccountId32),
    #[codec(index = 32)]
    WeightsVersionKeySet(u16, u64),
    #[codec(index = 35)]
    ServingRateLimitSet(u16, u64),
    #[codec(index = 37)]
    MaxBurnSet(u16, u64),
    #[codec(index = 38)]
    MinBurnSet(u16, u64),
    #[codec(index = 48)]
    RegistrationAllowed(u16, bool),
    #[codec(index = 50)]
    TempoSet(u16, u16),
    #[codec(index = 52)]
    StakeThresholdSet(u64),
    #[codec(index = 56)]
    NetworkRateLimitSet(u64),
    #[codec(index = 59)]
    NetworkMinLockCostSet(u64),
    #[codec(index = 83)]
    WeightsCommitted(AccountId32, u16, H256),
    #[codec(index = 84)]
    WeightsRevealed(AccountId32, u16, H256),
    #[codec(index = 92)]
    SubnetOwnerHotkeySet(u16, AccountId32),
    #[codec(index = 93)]
    FirstEmissionBlockNumberSet(u16, u64),
    #[codec(index = 98)]
    CommitRevealPeriodsSet(u16, u64),
    #[codec(index = 99)]
    CommitRevealEnabled(u16, bool),
    #[codec(index = 104)]
    CommitRevealVersionSet(u16),
    /// (hotkey, netuid storage index, blake2-256 of the ciphertext, reveal round)
    #[codec(index = 105)]
    TimelockedWeightsCommitted(AccountId32, u16, H256, u64),
    /// (netuid storage index, hotkey)
    #[codec(index = 106)]
    TimelockedWeightsRevealed(u16, AccountId32),
    #[codec(index = 108)]
    IncentiveAlphaEmittedToMiners { netuid: u16, emissions: Vec<u64> },
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum DrandEvent {
    /// Pulses stored in this block.
    #[codec(index = 1)]
    NewPulse { rounds: Vec<u64> },
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum SudoEvent {
    #[codec(index = 0)]
    Sudid {
        sudo_result: Result<(), DispatchError>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum AdminUtilsEvent {
    #[codec(index = 1)]
    Yuma3EnableToggled { netuid: u16, enabled: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct Weight {
    #[codec(compact)]
    pub ref_time: u64,
    #[codec(compact)]
    pub proof_size: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum DispatchClass {
    Normal,
    Operational,
    Mandatory,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum Pays {
    Yes,
    No,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct DispatchEventInfo {
    pub weight: Weight,
    pub class: DispatchClass,
    pub pays_fee: Pays,
}

impl DispatchEventInfo {
    pub fn normal(pays_fee: Pays) -> Self {
        Self {
            weight: Weight {
                ref_time: 100_000_000,
                proof_size: 0,
            },
            class: DispatchClass::Normal,
            pays_fee,
        }
    }
}

/// `sp_runtime::DispatchError` (its metadata path is fixed up to that name: subxt looks it up).
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum DispatchError {
    Other,
    CannotLookup,
    BadOrigin,
    Module(ModuleError),
    ConsumerRemaining,
    NoProviders,
    TooManyConsumers,
    Token(TokenError),
    Arithmetic(ArithmeticError),
    Transactional(TransactionalError),
    Exhausted,
    Corruption,
    Unavailable,
    RootNotAllowed,
    Trie(TrieError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct ModuleError {
    pub index: u8,
    pub error: [u8; 4],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum TokenError {
    FundsUnavailable,
    OnlyProvider,
    BelowMinimum,
    CannotCreate,
    UnknownAsset,
    Frozen,
    Unsupported,
    CannotCreateHold,
    NotExpendable,
    Blocked,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum ArithmeticError {
    Underflow,
    Overflow,
    DivisionByZero,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum TransactionalError {
    LimitReached,
    NoLayer,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum TrieError {
    InvalidStateRoot,
    IncompleteDatabase,
    ValueAtIncompleteKey,
    DecoderError,
    InvalidHash,
    DuplicateKey,
    ExtraneousNode,
    ExtraneousValue,
    ExtraneousHashReference,
    InvalidChildReference,
    ValueMismatch,
    IncompleteProof,
    RootMismatch,
    DecodeError,
}
