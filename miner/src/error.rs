//! The miner library's errors.

use iota_protocol::client::ClientError;
use iota_trainer::TrainerError;

/// What can stop a miner or drop a hop.
#[derive(Debug, thiserror::Error)]
pub enum MinerError {
    /// The orchestrator's API failed (after the client's retries).
    #[error("orchestrator: {0}")]
    Api(#[from] ClientError),
    /// The training core failed.
    #[error("model: {0}")]
    Model(#[from] iota_model::ModelError),
    /// The chain could not be read or written.
    #[error("chain: {0}")]
    Chain(#[from] iota_chain::ChainError),
    /// The run describes a model this miner cannot build.
    #[error("the run does not match its model: {0}")]
    RunMismatch(String),
    /// A peer's tensor is malformed (reported to the orchestrator as a bad object).
    #[error("bad input from a peer: {0}")]
    BadInput(String),
    /// A hop produced NaN or Inf; it was rolled back.
    #[error("non-finite values in {0}; rolled back")]
    NonFinite(String),
    /// The hotkey is not registered on the subnet.
    #[error(
        "hotkey {hotkey} is not registered on netuid {netuid}: run `iota chain register --netuid {netuid}` \
         (or start the miner with --register --max-burn <TAO>)"
    )]
    NotRegistered {
        /// SS58 of the hotkey.
        hotkey: String,
        /// Subnet.
        netuid: u16,
    },
    /// The run's dataset could not be fetched, or a file of it was refused.
    #[error("{0}")]
    Dataset(#[from] iota_protocol::dataset_cache::DatasetError),
    /// Bad configuration.
    #[error("configuration: {0}")]
    Config(String),
    /// A bug: a state the miner should never reach.
    #[error("internal: {0}")]
    Internal(String),
}

impl MinerError {
    /// Whether waiting may cure it: the orchestrator unreachable, overloaded or failing (a
    /// restart), as opposed to an answer that this miner cannot take part.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Api(ClientError::Network(_)) => true,
            Self::Api(ClientError::Api { status, .. }) => *status == 429 || *status >= 500,
            Self::Dataset(e) => e.is_transient(),
            _ => false,
        }
    }
}

impl From<TrainerError> for MinerError {
    fn from(e: TrainerError) -> Self {
        match e {
            TrainerError::Model(e) => Self::Model(e),
            TrainerError::RunMismatch(m) => Self::RunMismatch(m),
            TrainerError::BadInput(m) => Self::BadInput(m),
            TrainerError::NonFinite(m) => Self::NonFinite(m),
            TrainerError::Config(m) => Self::Config(m),
            TrainerError::Internal(m) => Self::Internal(m),
        }
    }
}

impl From<candle_core::Error> for MinerError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}
