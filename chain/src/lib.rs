//! Bittensor chain client for IOTA: wallets, the metagraph, registration, axons, stake and
//! weights (with commit-reveal) against any subtensor node, through subxt.
//!
//! * [`wallet`]: btcli-compatible keyfiles under `~/.bittensor/wallets/` and a clap CLI.
//! * [`weights`]: SDK-exact weight conversion and the commit-reveal v2 hash.
//! * [`Subtensor`] ([`client`]): connection with reconnects and timeouts, runtime shape check
//!   ([`shape`]), batched storage reads, signed submission with typed errors ([`ChainError`]).
//! * [`epoch`]: when epochs run, by the modulo rule (spec ≤ 403) or from state (spec ≥ 404).
//! * [`metagraph`]: every neuron of a subnet plus its hyperparameters in three batched reads.
//! * [`ops`]: register (idempotent), serve axon, stake, transfer, subnets, `AdminUtils` setters.
//! * [`set_weights`]: float scores to chain weights, version key, rate limit, commit-reveal with a
//!   durable [`commit::CommitStore`].
//! * [`calls`]: the call builders (what `--dry-run` encodes); [`api`]: code generated from
//!   `metadata/localnet.scale`.
//! * [`timelocked`]: commits sealed to a drand round, which the chain reveals itself.
//! * [`timelock`]: drand-timelocked weight commits (commit-reveal v3/v4): the reveal round, the
//!   payload subtensor decodes, encryption to a round and decryption with its signature.
//! * [`cli`]: `iota chain …` with Bittensor's flag names.

pub mod api;
pub mod calls;
pub mod cli;
pub mod client;
pub mod commit;
pub mod epoch;
pub mod error;
pub mod metagraph;
pub mod network;
pub mod ops;
pub mod set_weights;
pub mod shape;
pub mod signer;
pub mod timelocked;
pub mod wallet;
pub mod watcher;
pub mod weights;

/// Drand-timelocked commits: the reveal round, the payload, encryption and decryption.
pub use iota_drand as timelock;

pub use client::{Receipt, Subtensor, TxOptions, TxOutcome, WaitFor};
pub use error::{ChainError, InvalidTransaction};
pub use metagraph::{Axon, Hyperparams, Member, Members, Metagraph, Neuron};
pub use network::{ConnectOptions, ShapeCheck};
pub use ops::{Outcome, Registration};
pub use set_weights::{VersionKey, WeightOptions, WeightsOutcome};
pub use watcher::{MetagraphIndex, MetagraphWatcher, WatchOptions};
