//! The run state's queries, one function per statement, grouped by what they read and write.
//! Each takes any executor (the pool, a connection, or a transaction the caller holds) and
//! returns plain values; the caller decides what they mean (with the rules of
//! [`crate::domain`]) and which transaction they share.
//!
//! - [`runs`]: the run's row (epoch, phase, deadlines, the time driven).
//! - [`epochs`]: each epoch's counters and collection.
//! - [`samples`]: a sample's status.
//! - [`status`]: the epoch status heartbeats, polls and explorers answer with.
//! - [`hops`]: a sample's hops (`tasks`): routing, leases, moves.
//! - [`miners`]: the run's miners: liveness, release, stage counts.
//! - [`partitions`]: an epoch's partitions, their owners and their collection.
//! - [`objects`]: which sealed object a row records.
//! - [`uploads`]: pseudo-gradient uploads.
//! - [`merges`]: merge results, votes, stakes.
//! - [`disputes`]: partitions put to the validators.
//! - [`requests`]: the shared replay cache of signed requests' uuids.
//! - [`locks`]: the leader's and the phase's advisory locks.
//! - [`validators`]: what validators read of an epoch and submit.
//! - [`work`]: a miner's work poll and the samples it starts.
//! - [`views`]: the records explorers and validators read, as the API answers with them.

pub mod disputes;
pub mod epochs;
pub mod hops;
pub mod locks;
pub mod merges;
pub mod miners;
pub mod objects;
pub mod partitions;
pub mod requests;
pub mod runs;
pub mod samples;
pub mod status;
pub mod uploads;
pub mod validators;
pub mod views;
pub mod work;

/// An executor of one statement: `&PgPool`, `&mut PgConnection` or `&mut *tx`.
pub trait Db<'e>: sqlx::PgExecutor<'e> {}

impl<'e, E: sqlx::PgExecutor<'e>> Db<'e> for E {}
