//! The IOTA miner: trains one pipeline stage for an orchestrator.
//!
//! A miner joins a run (`POST /v1/miner/register` with its measured capacity), loads its
//! stage's merged weights (every hash checked), then loops: poll for leased work, run forward and
//! backward hops with the training core, upload outputs in the wire format, take local optimizer
//! steps at the run's cadence; when the epoch's training ends, upload its pseudo-gradient
//! partition by partition; while merging, average the partitions it owns (fixed contributor
//! order, outer Nesterov step) and publish them; then load the next epoch's weights.
//!
//! * [`run`] / [`spawn`]: the loop, as a library (several miners can share a process).
//! * [`MinerTrainer`]: the compute half, blocking: `iota-trainer`'s honest stage trainer (what
//!   validators replay) with the `--adversary` behaviours wrapped around it.
//! * [`startup::prepare`]: wallet, registration and axon for the `iota miner` command.
//! * [`Adversary`]: dishonest behaviours for testing validators, off by default.
//!
//! The orchestrator's API is described in `orchestrator/API.md`.

pub mod adversary;
mod blobs;
pub mod capacity;
pub mod config;
mod error;
pub mod eval;
mod node;
pub mod progress;
mod pulse;
pub mod startup;
mod status;
pub mod trainer;

pub use adversary::Adversary;
pub use config::{DeviceSpec, MinerArgs, MinerConfig, ProgressMode};
pub use error::MinerError;
pub use node::{MinerHandle, run, spawn};
pub use status::{AllReduceBytes, MinerStatus};
pub use trainer::MinerTrainer;
