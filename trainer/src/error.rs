//! Why a stage could not be built, a hop run or a merge computed.

/// What can stop a trainer or drop a hop.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// The training core failed.
    #[error("model: {0}")]
    Model(#[from] iota_model::ModelError),
    /// The run describes a model or data this trainer cannot build.
    #[error("the run does not match its model: {0}")]
    RunMismatch(String),
    /// A peer's tensor is malformed.
    #[error("bad input from a peer: {0}")]
    BadInput(String),
    /// A hop produced NaN or Inf; it was rolled back.
    #[error("non-finite values in {0}; rolled back")]
    NonFinite(String),
    /// The run needs something the caller did not give (its dataset's folder).
    #[error("configuration: {0}")]
    Config(String),
    /// A bug: a state the trainer should never reach.
    #[error("internal: {0}")]
    Internal(String),
}

impl From<candle_core::Error> for TrainerError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}
