//! The localnet runtime: what a subtensor node's runtime does for the calls, storage and events
//! the localnet implements, as plain Rust over [`State`].

pub mod admin;
pub mod balances;
pub mod call;
pub mod error;
pub mod event;
pub mod extrinsic;
pub mod rpc_info;
pub mod storage;
pub mod subtensor;
pub mod types;

use crate::state::State;
use call::{RuntimeCall, SudoCall, SystemCall};
use error::{SudoError, SystemError};
use event::{
    DispatchError, EventRecord, ModuleError, Pays, Phase, RuntimeEvent, SudoEvent, SystemEvent,
};
use storage::{balances as balances_storage, sudo as sudo_storage, system as system_storage};
use types::{AccountId32, AccountInfo, Balance, Cow, H256, RuntimeVersion};

/// The runtime interface the localnet mirrors: finney's spec 393.
pub const SPEC_NAME: &str = "node-subtensor";
pub const IMPL_NAME: &str = "iota-localnet";
pub const SPEC_VERSION: u32 = 393;
pub const TRANSACTION_VERSION: u32 = 1;
pub const SS58_PREFIX: u16 = 42;
/// Balances' existential deposit on finney, in rao.
pub const EXISTENTIAL_DEPOSIT: Balance = 500;
pub const TAO: u64 = 1_000_000_000;

/// Pallet indices (the same as finney's `construct_runtime!`).
pub const SYSTEM_INDEX: u8 = 0;
pub const BALANCES_INDEX: u8 = 5;
pub const SUBTENSOR_INDEX: u8 = 7;
pub const SUDO_INDEX: u8 = 12;
pub const ADMIN_UTILS_INDEX: u8 = 19;

/// Runtime API identifiers: blake2-64 of the trait name, with the versions finney advertises.
pub fn runtime_version() -> RuntimeVersion {
    let api = |name: &str, version: u32| (sp_crypto_hashing::blake2_64(name.as_bytes()), version);
    RuntimeVersion {
        spec_name: Cow(SPEC_NAME.into()),
        impl_name: Cow(IMPL_NAME.into()),
        authoring_version: 1,
        spec_version: SPEC_VERSION,
        impl_version: 1,
        apis: Cow(crate::metadata::RUNTIME_APIS
            .iter()
            .map(|(name, version)| api(name, *version))
            .collect()),
        transaction_version: TRANSACTION_VERSION,
        system_version: 1,
    }
}

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

/// Dispatches a call: the transaction's effect after its signature and nonce were accepted.
pub fn dispatch(exec: &mut Exec<'_>, origin: &Origin, call: &RuntimeCall) -> DispatchResult {
    match call {
        RuntimeCall::System(call) => {
            let who = origin.signed()?;
            match call {
                SystemCall::remark { .. } => {}
                SystemCall::remark_with_event { remark } => {
                    let hash = H256(sp_crypto_hashing::blake2_256(remark));
                    exec.deposit(RuntimeEvent::System(SystemEvent::Remarked {
                        sender: who.clone(),
                        hash,
                    }));
                }
            }
            Ok(Pays::Yes)
        }
        RuntimeCall::Balances(call) => balances::dispatch(exec, origin, call),
        RuntimeCall::SubtensorModule(call) => subtensor::dispatch(exec, origin, call),
        RuntimeCall::AdminUtils(call) => admin::dispatch(exec, origin, call),
        RuntimeCall::Sudo(SudoCall::sudo { call }) => {
            let who = origin.signed()?;
            if sudo_storage::Key::get(exec.state).as_ref() != Some(who) {
                return Err(SudoError::RequireSudo.into());
            }
            // As in pallet_sudo, the inner call's failure is reported in the event, not as the
            // failure of the sudo extrinsic itself.
            let inner = exec.transactional(|exec| dispatch(exec, &Origin::Root, call));
            exec.deposit(RuntimeEvent::Sudo(SudoEvent::Sudid {
                sudo_result: inner.map(|_| ()),
            }));
            Ok(Pays::No)
        }
    }
}

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

/// Genesis state: funded dev accounts, Alice as sudo, and the root network (netuid 0).
pub fn genesis_state(new_subnet_tempo: u16) -> State {
    let mut state = State::default();
    let mut issuance = 0u64;
    for name in DEV_ACCOUNTS {
        let account = dev_account(name);
        system_storage::Account::mutate(&mut state, &account, |info| {
            info.providers = 1;
            info.data.free = DEV_BALANCE;
        });
        issuance += DEV_BALANCE;
    }
    balances_storage::TotalIssuance::insert(&mut state, &issuance);
    sudo_storage::Key::insert(&mut state, &dev_account("Alice"));
    subtensor::init_root_network(&mut state);
    subtensor::set_default_new_subnet_tempo(&mut state, new_subnet_tempo);
    state
}

/// Work every block does before its transactions: subtensor's emission and epochs.
pub fn on_initialize(exec: &mut Exec<'_>) {
    system_storage::Number::insert(exec.state, &(exec.block as u32));
    subtensor::block_step(exec);
}

/// Reads an account's nonce, as the `AccountNonceApi` does.
pub fn account_nonce(state: &State, who: &AccountId32) -> u32 {
    system_storage::Account::get(state, who).nonce
}

pub fn account(state: &State, who: &AccountId32) -> AccountInfo {
    system_storage::Account::get(state, who)
}

/// Writes the block's events where clients read them.
pub fn store_events(state: &mut State, events: &[EventRecord]) {
    system_storage::Events::insert(state, &events.to_vec());
    system_storage::EventCount::insert(state, &(events.len() as u32));
}

#[cfg(test)]
mod tests {
    #[test]
    fn runtime_api_ids_are_substrates() {
        // Known identifiers of `Core` and `Metadata` on every Substrate chain.
        let apis = super::runtime_version().apis.0;
        assert_eq!(hex::encode(apis[0].0), "df6acb689907609b");
        assert_eq!(hex::encode(apis[1].0), "37e397fc7c91f5e4");
    }
}
