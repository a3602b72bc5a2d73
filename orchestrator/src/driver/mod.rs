//! The phase driver: expires leases, releases silent miners, moves the epoch through its phases,
//! assigns merge owners, settles partitions, and collects old objects.
//!
//! It runs in every orchestrator process but acts only in the one holding a session-level
//! Postgres advisory lock, so several replicas on one database drive one run exactly once; if the
//! leader dies its connection closes, the lock is released, and another replica takes over at its
//! next tick. Every step is a transaction over database state alone, so a restart resumes where
//! the database is, with the phase's time left as it was (see [`forgive_gap`]). Phase changes
//! take an exclusive transaction-level lock that uploads take in shared mode, so an upload lands
//! wholly before a phase change or is refused after it; uploads reserved before the uploading
//! deadline hold that phase open for a bounded time (see `domain::phases::next_step`).

mod gc;
mod leases;
mod merges;
mod owners;
mod phases;
mod run;

pub use crate::db::locks::{PHASE_LOCK_CLASS, phase_lock_shared};
pub use gc::collect_garbage;
pub(crate) use merges::{has_stake, interested_validator};
pub use merges::{record_merge_result, settle_dispute};
pub use owners::add_owners;
pub use run::{forgive_gap, run_driver, step};
