//! The crate's error type.

use std::path::PathBuf;

use candle_core::DType;

/// Everything that can go wrong in the training core.
///
/// Caller mistakes (bad shapes, dtypes, token ids, non-finite values, malformed bytes) get their
/// own variants so that a miner or validator can tell a peer's bad input from a local fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A model, optimizer or data configuration is inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A tensor or slice has the wrong shape.
    #[error("shape mismatch for {what}: expected {expected:?}, got {got:?}")]
    Shape {
        /// What was being checked.
        what: String,
        /// The expected dimensions.
        expected: Vec<usize>,
        /// The dimensions that were given.
        got: Vec<usize>,
    },
    /// A tensor has the wrong element type.
    #[error("dtype mismatch for {what}: expected {expected:?}, got {got:?}")]
    DType {
        /// What was being checked.
        what: String,
        /// The expected dtype.
        expected: DType,
        /// The dtype that was given.
        got: DType,
    },
    /// NaN or infinity where only finite values are allowed.
    #[error("{0} contains NaN or infinite values")]
    NonFinite(String),
    /// A token id does not fit the vocabulary.
    #[error("token id {id} is out of range for a vocabulary of {vocab_size}")]
    TokenOutOfRange {
        /// The offending id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// Any other invalid argument.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A boundary tensor or partition could not be decoded.
    #[error("malformed wire data: {0}")]
    Wire(String),
    /// A checkpoint does not match the stage or optimizer it is loaded into.
    #[error("checkpoint mismatch: {0}")]
    Checkpoint(String),
    /// Dataset construction or lookup failed.
    #[error("data: {0}")]
    Data(String),
    /// The tokenizer library reported an error.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A file could not be read or written.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// candle reported an error (device, kernel, or an internal shape check).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// safetensors could not parse or write a buffer.
    #[error("safetensors: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),
    /// A JSON document (config, tokenizer) could not be parsed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

/// Result alias used throughout the crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn shape(what: impl Into<String>, expected: &[usize], got: &[usize]) -> Self {
        Self::Shape {
            what: what.into(),
            expected: expected.to_vec(),
            got: got.to_vec(),
        }
    }
}
