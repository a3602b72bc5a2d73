//! What the runtime does with a call and a block: dispatch to the pallets, genesis, the work
//! before a block's transactions, its events.

use super::call::{RuntimeCall, SudoCall, SystemCall};
use super::error::SudoError;
use super::event::{EventRecord, Pays, RuntimeEvent, SudoEvent, SystemEvent};
use super::exec::{DEV_ACCOUNTS, DEV_BALANCE, DispatchResult, Exec, Origin, dev_account};
use super::storage::{
    balances as balances_storage, sudo as sudo_storage, system as system_storage,
};
use super::types::{AccountId32, AccountInfo, H256};
use super::{admin, balances, drand, subtensor};
use crate::state::State;

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

/// Genesis state: funded dev accounts, Alice as sudo, the root network (netuid 0), and the
/// beacon the Drand pallet follows.
pub fn genesis_state(new_subnet_tempo: u16, beacon: &drand::Beacon, now_ms: u64) -> State {
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
    super::storage::drand::BeaconConfig::insert(&mut state, beacon.config());
    super::storage::timestamp::Now::insert(&mut state, &now_ms);
    state
}

/// Work every block does before its transactions: the block's time and the beacon's new
/// pulses, then subtensor's emission, timelocked reveals and epochs.
pub fn on_initialize(exec: &mut Exec<'_>, now_ms: u64, beacon: &drand::Beacon) {
    system_storage::Number::insert(exec.state, &(exec.block as u32));
    drand::on_initialize(exec, now_ms, beacon);
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
