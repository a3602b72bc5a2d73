//! Error types for wallets and keyfiles.

use std::path::PathBuf;

/// Everything that can go wrong loading, creating or unlocking a wallet.
///
/// Variants about a file carry its path, so a message always says which keyfile is at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WalletError {
    /// The keyfile does not exist.
    #[error("keyfile {} does not exist", path.display())]
    NotFound {
        /// The missing file.
        path: PathBuf,
    },
    /// The file system refused an operation.
    #[error("cannot access {}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Decryption failed authentication: the password is wrong, or the encrypted bytes were
    /// altered (the two cannot be told apart).
    #[error("wrong password for {} (or its encrypted contents are damaged)", path.display())]
    WrongPassword {
        /// The encrypted keyfile.
        path: PathBuf,
    },
    /// The keyfile is truncated, not JSON, or holds malformed key material.
    #[error("keyfile {} is corrupt: {reason}", path.display())]
    Corrupt {
        /// The damaged file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The keyfile uses an encryption scheme this crate cannot open.
    #[error(
        "keyfile {} uses {method} encryption, which is not supported; \
         regenerate the key from its mnemonic",
        path.display()
    )]
    UnsupportedEncryption {
        /// The keyfile.
        path: PathBuf,
        /// Name of the scheme.
        method: &'static str,
    },
    /// The keyfile only holds a public key, so it cannot sign.
    #[error("keyfile {} holds only a public key, no secret", path.display())]
    PublicOnly {
        /// The keyfile.
        path: PathBuf,
    },
    /// Writing would replace an existing file and overwriting was not requested.
    #[error("{} already exists; pass --overwrite to replace it", path.display())]
    AlreadyExists {
        /// The existing file.
        path: PathBuf,
    },
    /// The keyfile is encrypted and no password could be obtained.
    #[error(
        "no password for {}: set {env_var} (see `BT_PW_` in the docs) or run in a terminal ({reason})",
        path.display()
    )]
    PasswordUnavailable {
        /// The encrypted keyfile.
        path: PathBuf,
        /// The environment variable that would have supplied the password.
        env_var: String,
        /// Why no prompt was possible.
        reason: String,
    },
    /// A `BT_PW_…` variable is set but does not decode to a password.
    #[error("environment variable {var} does not hold an encoded password: {reason}")]
    PasswordEnv {
        /// The variable name.
        var: String,
        /// What failed.
        reason: String,
    },
    /// A new password was rejected (too short, or the confirmation differed).
    #[error("password rejected: {reason}")]
    PasswordRejected {
        /// Why.
        reason: String,
    },
    /// A wallet or hotkey name cannot be used as a file name.
    #[error("invalid wallet or hotkey name {name:?}: {reason}")]
    InvalidName {
        /// The rejected name.
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// A mnemonic given by the user is not a valid English BIP39 phrase.
    #[error("invalid mnemonic: {reason}")]
    InvalidMnemonic {
        /// Why it was rejected.
        reason: String,
    },
    /// A seed or private key given by the user has the wrong form.
    #[error("invalid secret key: {reason}")]
    InvalidSecret {
        /// Why it was rejected.
        reason: String,
    },
    /// An SS58 address does not decode.
    #[error("invalid SS58 address {address:?}: {reason}")]
    InvalidAddress {
        /// The rejected text.
        address: String,
        /// Why it was rejected.
        reason: String,
    },
    /// Mnemonics have 12, 15, 18, 21 or 24 words.
    #[error("unsupported mnemonic length {0}; use 12, 15, 18, 21 or 24 words")]
    InvalidWordCount(usize),
    /// Key derivation or encryption failed for a reason other than the password.
    #[error("encryption failed: {0}")]
    Crypto(String),
    /// Reading user input from the terminal failed.
    #[error("cannot read from the terminal: {0}")]
    Terminal(#[source] std::io::Error),
    /// Writing command output failed.
    #[error("cannot write output: {0}")]
    Output(#[source] std::io::Error),
}

/// Failure to decrypt keyfile bytes, before the file path is known.
///
/// [`Keyfile`](super::Keyfile) turns these into [`WalletError`]s naming the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecryptError {
    /// Authentication failed: wrong password or altered ciphertext.
    #[error("wrong password (or damaged ciphertext)")]
    WrongPassword,
    /// The bytes do not have the layout of the detected format.
    #[error("{0}")]
    Malformed(String),
    /// The data is in a scheme this crate cannot open.
    #[error("unsupported encryption: {0}")]
    Unsupported(&'static str),
    /// The data is not encrypted at all.
    #[error("data is not encrypted")]
    NotEncrypted,
    /// Key derivation failed (for example the 512 MiB Argon2 buffer could not be allocated).
    #[error("key derivation failed: {0}")]
    Kdf(String),
}

impl DecryptError {
    /// Attaches the keyfile path.
    pub(crate) fn at(self, path: PathBuf) -> WalletError {
        match self {
            Self::WrongPassword => WalletError::WrongPassword { path },
            Self::Malformed(reason) => WalletError::Corrupt { path, reason },
            Self::Unsupported(method) => WalletError::UnsupportedEncryption { path, method },
            Self::NotEncrypted => WalletError::Corrupt {
                path,
                reason: "expected encrypted data".to_owned(),
            },
            Self::Kdf(reason) => WalletError::Crypto(reason),
        }
    }
}
