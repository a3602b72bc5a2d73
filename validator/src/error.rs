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
    /// The miner code the replay runs failed.
    #[error("replay: {0}")]
    Replay(#[from] iota_miner::MinerError),
    /// CLASP could not be fitted.
    #[error("clasp: {0}")]
    Clasp(#[from] crate::clasp::ClaspError),
    /// An object from the orchestrator is malformed.
    #[error("bad object: {0}")]
    BadObject(String),
    /// Bad configuration.
    #[error("configuration: {0}")]
    Config(String),
}
