//! The validator library's errors.

/// What can go wrong while validating.
#[derive(Debug, thiserror::Error)]
pub enum ValidatorError {
    /// The orchestrator's API failed (after the client's retries).
    #[error("orchestrator: {0}")]
    Api(#[from] iota_protocol::ClientError),
    /// The chain could not be read or written.
    #[error("chain: {0}")]
    Chain(#[from] iota_chain::ChainError),
    /// The database failed.
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    /// Migrations failed.
    #[error("migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The training core failed.
    #[error("model: {0}")]
    Model(#[from] iota_model::ModelError),
    /// The trainer the replay runs (an honest miner's) failed.
    #[error("replay: {0}")]
    Replay(#[from] iota_trainer::TrainerError),
    /// CLASP could not be fitted.
    #[error("clasp: {0}")]
    Clasp(#[from] crate::clasp::ClaspError),
    /// An object from the orchestrator is malformed.
    #[error("bad object: {0}")]
    BadObject(String),
    /// The orchestrator answered outside the protocol (a page cursor that does not advance,
    /// more records than an epoch can have).
    #[error("orchestrator answer refused: {0}")]
    BadAnswer(String),
    /// The epoch can no longer be checked: its objects (or records) are gone, collected while
    /// this validator lagged behind the run. The service skips it.
    #[error("epoch {epoch} cannot be scored any more: {reason}")]
    EpochGone {
        /// The epoch.
        epoch: u64,
        /// What is gone.
        reason: String,
    },
    /// The run's dataset could not be fetched, or a file of it was refused.
    #[error("{0}")]
    Dataset(#[from] iota_protocol::dataset_cache::DatasetError),
    /// Bad configuration.
    #[error("configuration: {0}")]
    Config(String),
}
