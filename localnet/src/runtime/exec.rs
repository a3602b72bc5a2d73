//! What every pallet's calls run with: the origin, the block's execution context, pallet
//! indices and errors, the dev accounts.

use super::error::{SudoError, SystemError};
use super::event::{DispatchError, EventRecord, ModuleError, Pays, Phase, RuntimeEvent};
use super::types::{AccountId32, Balance};
use crate::state::State;

/// Balances' existential deposit on finney, in rao.
pub const EXISTENTIAL_DEPOSIT: Balance = 500;
pub const TAO: u64 = 1_000_000_000;

/// Pallet indices (the same as finney's `construct_runtime!`).
pub const SYSTEM_INDEX: u8 = 0;
pub const BALANCES_INDEX: u8 = 5;
pub const SUBTENSOR_INDEX: u8 = 7;
pub const SUDO_INDEX: u8 = 12;
pub const ADMIN_UTILS_INDEX: u8 = 19;

/// Who a call is dispatched as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    Signed(AccountId32),
    Root,
}

impl Origin {
    pub fn signed(&self) -> Result<&AccountId32, DispatchError> {
        match self {
            Origin::Signed(who) => Ok(who),
            Origin::Root => Err(DispatchError::BadOrigin),
        }
    }

    pub fn ensure_root(&self) -> Result<(), DispatchError> {
        match self {
            Origin::Root => Ok(()),
            Origin::Signed(_) => Err(DispatchError::BadOrigin),
        }
    }
}

/// A pallet error as the dispatch error clients see: `Module { index, error: [variant, 0, 0, 0] }`.
pub fn module_error(pallet: u8, variant: u8) -> DispatchError {
    DispatchError::Module(ModuleError {
        index: pallet,
        error: [variant, 0, 0, 0],
    })
}

impl From<SystemError> for DispatchError {
    fn from(e: SystemError) -> Self {
        module_error(SYSTEM_INDEX, e as u8)
    }
}

impl From<SudoError> for DispatchError {
    fn from(e: SudoError) -> Self {
        module_error(SUDO_INDEX, e as u8)
    }
}

/// Execution context of one block: its state, number, current phase and the events so far.
pub struct Exec<'a> {
    pub state: &'a mut State,
    pub block: u64,
    pub phase: Phase,
    pub events: &'a mut Vec<EventRecord>,
}

impl Exec<'_> {
    pub fn deposit(&mut self, event: RuntimeEvent) {
        self.events.push(EventRecord {
            phase: self.phase,
            event,
            topics: vec![],
        });
    }

    /// Runs `f` as a storage transaction: on error every state change it made is undone.
    pub fn transactional<T>(
        &mut self,
        f: impl FnOnce(&mut Exec<'_>) -> Result<T, DispatchError>,
    ) -> Result<T, DispatchError> {
        let snapshot = self.state.clone();
        let events_before = self.events.len();
        let result = f(self);
        if result.is_err() {
            *self.state = snapshot;
            self.events.truncate(events_before);
        }
        result
    }
}

pub type DispatchResult = Result<Pays, DispatchError>;

/// Accounts funded at genesis, by their Substrate dev-seed names.
pub const DEV_ACCOUNTS: [&str; 6] = ["Alice", "Bob", "Charlie", "Dave", "Eve", "Ferdie"];
/// Genesis balance of each dev account, like subtensor's localnet.
pub const DEV_BALANCE: Balance = 1_000_000 * TAO;

pub fn dev_pair(name: &str) -> sp_core::sr25519::Pair {
    use sp_core::Pair as _;
    sp_core::sr25519::Pair::from_string(&format!("//{name}"), None)
        .unwrap_or_else(|_| unreachable!("dev seeds are valid derivation paths"))
}

pub fn dev_account(name: &str) -> AccountId32 {
    use sp_core::Pair as _;
    AccountId32::new(dev_pair(name).public().0)
}
