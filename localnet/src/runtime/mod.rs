//! The localnet runtime: what a subtensor node's runtime does for the calls, storage and events
//! the localnet implements, as plain Rust over [`State`].

pub mod admin;
pub mod balances;
pub mod call;
mod dispatch;
pub mod drand;
pub mod error;
pub mod event;
mod exec;
pub mod extrinsic;
pub mod rpc_info;
pub mod storage;
pub mod subtensor;
pub mod types;
mod version;

pub use dispatch::{account, account_nonce, dispatch, genesis_state, on_initialize, store_events};
pub use exec::{
    ADMIN_UTILS_INDEX, BALANCES_INDEX, DEV_ACCOUNTS, DEV_BALANCE, DispatchResult,
    EXISTENTIAL_DEPOSIT, Exec, Origin, SUBTENSOR_INDEX, SUDO_INDEX, SYSTEM_INDEX, TAO, dev_account,
    dev_pair, module_error,
};
pub use version::{
    IMPL_NAME, RUNTIME_APIS, SLOT_DURATION_MS, SPEC_NAME, SPEC_VERSION, SS58_PREFIX,
    TRANSACTION_VERSION, runtime_version,
};
