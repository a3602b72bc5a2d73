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

impl ValidatorError {
    /// Whether scoring an epoch again would fail the same way: the failure comes from the
    /// epoch's own records or objects (a replay or fit that errors on them, a malformed object or
    /// answer), not from something that comes back (the network, the orchestrator's or chain's
    /// availability, the database) or that the operator must fix (configuration, migrations,
    /// the dataset's files).
    pub fn repeats_on_retry(&self) -> bool {
        match self {
            Self::Model(_)
            | Self::Replay(_)
            | Self::Clasp(_)
            | Self::BadObject(_)
            | Self::BadAnswer(_) => true,
            Self::Api(_)
            | Self::Chain(_)
            | Self::Db(_)
            | Self::Migrate(_)
            | Self::EpochGone { .. }
            | Self::Dataset(_)
            | Self::Config(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_failures_of_the_epochs_own_data_repeat() {
        assert!(ValidatorError::BadObject("short".into()).repeats_on_retry());
        assert!(ValidatorError::BadAnswer("cursor".into()).repeats_on_retry());
        let fit = crate::clasp::ClaspError::TooFewSamples(1);
        assert!(ValidatorError::Clasp(fit).repeats_on_retry());
        let network = iota_protocol::ClientError::Network("reset".into());
        assert!(!ValidatorError::Api(network).repeats_on_retry());
        assert!(!ValidatorError::Db(sqlx::Error::PoolTimedOut).repeats_on_retry());
        assert!(!ValidatorError::Config("no hotkey".into()).repeats_on_retry());
    }
}
