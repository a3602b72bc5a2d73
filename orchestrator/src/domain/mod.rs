//! The run's rules as pure functions over plain data: no database, no HTTP, time and randomness
//! passed in. The driver and the handlers read a snapshot, ask these what to do, and apply the
//! answer in one transaction.
//!
//! - [`phases`]: when a phase ends.
//! - [`placement`]: which stage a miner takes, which miner gets a hop, who merges what.
//! - [`hops`]: a hop's life and what its completion does to its sample.
//! - [`leases`]: when an open hop stops waiting for its miner, and where it goes.
//! - [`merges`]: how a partition's merge results settle.
//! - [`throughput`]: a miner's throughput, measured from the hops it completes.

pub mod hops;
pub mod leases;
pub mod merges;
pub mod phases;
pub mod placement;
pub mod throughput;
