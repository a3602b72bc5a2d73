//! Bittensor wallets, on disk exactly as `btcli` and the `bittensor-wallet` Python package
//! keep them, so either tool can use a wallet made by the other.
//!
//! # Layout
//!
//! ```text
//! <path>/<name>/coldkey                 secret coldkey, encrypted by default
//! <path>/<name>/coldkeypub.txt          coldkey public fields, plain
//! <path>/<name>/hotkeys/<hotkey>        secret hotkey, plain by default
//! <path>/<name>/hotkeys/<hotkey>pub.txt hotkey public fields, plain
//! ```
//!
//! `path` defaults to `~/.bittensor/wallets/`, `name` and `hotkey` to `default`; the
//! environment variables `BT_WALLET_PATH`, `BT_WALLET_NAME` and `BT_WALLET_HOTKEY` override
//! them. Files are written 0600 in 0700 directories, atomically, and never over an existing
//! file unless asked.
//!
//! # Modules
//!
//! * [`Keypair`] / [`PublicKey`]: sr25519 keys (sp-core), Substrate BIP39 mnemonics.
//! * [`Keyfile`]: one file; JSON fields and load priority in [`keyfile`].
//! * [`encryption`]: the `$NACL` format (Argon2i + XSalsa20-Poly1305) and legacy formats.
//! * [`password`]: passwords from callers, `BT_PW_…` variables, or a no-echo prompt.
//! * [`cli`]: clap subcommands (`new-coldkey`, `new-hotkey`, `regen-*`, `list`, `show`).

use std::path::{Path, PathBuf};

pub mod cli;
pub mod encryption;
mod error;
pub mod keyfile;
mod keypair;
pub mod password;
mod vault;

pub use encryption::KeyfileEncryption;
pub use error::{DecryptError, WalletError};
pub use keyfile::{Keyfile, KeyfileContents};
pub use keypair::{Keypair, MNEMONIC_WORD_COUNTS, PublicKey, SS58_FORMAT};
pub use password::PasswordSource;

/// Default wallet directory, before `~` expansion.
pub const DEFAULT_WALLET_PATH: &str = "~/.bittensor/wallets/";
/// Default wallet name.
pub const DEFAULT_WALLET_NAME: &str = "default";
/// Default hotkey name.
pub const DEFAULT_HOTKEY_NAME: &str = "default";
/// Default mnemonic length for new keys.
pub const DEFAULT_N_WORDS: usize = 12;

/// Replaces a leading `~` with `$HOME`, as btcli does for `--wallet.path`.
#[must_use]
pub fn expand_tilde(path: &Path) -> PathBuf {
    let Ok(rest) = path.strip_prefix("~") else {
        return path.to_path_buf();
    };
    match std::env::var_os("HOME") {
        Some(home) if !home.is_empty() => PathBuf::from(home).join(rest),
        _ => path.to_path_buf(),
    }
}

/// Rejects names that would escape the wallet directory or are not file names.
fn check_name(name: &str) -> Result<(), WalletError> {
    let reason = if name.is_empty() {
        Some("must not be empty")
    } else if name == "." || name == ".." {
        Some("must not be . or ..")
    } else if name.contains('/') || name.contains('\\') {
        Some("must not contain path separators")
    } else if name.contains('\0') {
        Some("must not contain NUL")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(WalletError::InvalidName {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// A wallet: a coldkey and one selected hotkey under `<path>/<name>/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wallet {
    path: PathBuf,
    name: String,
    hotkey: String,
}

impl Wallet {
    /// A wallet named `name` under `path` (`~` is expanded), using hotkey `hotkey`.
    ///
    /// Nothing is read or created yet.
    ///
    /// # Errors
    ///
    /// [`WalletError::InvalidName`] for names that are not plain file names.
    pub fn new(
        path: impl AsRef<Path>,
        name: impl Into<String>,
        hotkey: impl Into<String>,
    ) -> Result<Self, WalletError> {
        let (name, hotkey) = (name.into(), hotkey.into());
        check_name(&name)?;
        check_name(&hotkey)?;
        Ok(Self {
            path: expand_tilde(path.as_ref()),
            name,
            hotkey,
        })
    }

    /// The wallet selected by `BT_WALLET_PATH`, `BT_WALLET_NAME` and `BT_WALLET_HOTKEY`, with
    /// btcli's defaults for unset variables.
    ///
    /// # Errors
    ///
    /// As [`Wallet::new`].
    pub fn from_env() -> Result<Self, WalletError> {
        let var =
            |key: &str, default: &str| std::env::var(key).unwrap_or_else(|_| default.to_owned());
        Self::new(
            var("BT_WALLET_PATH", DEFAULT_WALLET_PATH),
            var("BT_WALLET_NAME", DEFAULT_WALLET_NAME),
            var("BT_WALLET_HOTKEY", DEFAULT_HOTKEY_NAME),
        )
    }

    /// The same wallet with another hotkey selected.
    ///
    /// # Errors
    ///
    /// [`WalletError::InvalidName`].
    pub fn with_hotkey(&self, hotkey: impl Into<String>) -> Result<Self, WalletError> {
        Self::new(&self.path, self.name.clone(), hotkey)
    }

    /// Directory holding all wallets.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.path
    }

    /// Wallet name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Selected hotkey name.
    #[must_use]
    pub fn hotkey_name(&self) -> &str {
        &self.hotkey
    }

    /// This wallet's directory, `<path>/<name>`.
    #[must_use]
    pub fn dir(&self) -> PathBuf {
        self.path.join(&self.name)
    }

    /// `<path>/<name>/coldkey`.
    #[must_use]
    pub fn coldkey_file(&self) -> Keyfile {
        Keyfile::new(self.dir().join("coldkey"))
    }

    /// `<path>/<name>/coldkeypub.txt`.
    #[must_use]
    pub fn coldkeypub_file(&self) -> Keyfile {
        Keyfile::new(self.dir().join("coldkeypub.txt"))
    }

    /// `<path>/<name>/hotkeys/<hotkey>`.
    #[must_use]
    pub fn hotkey_file(&self) -> Keyfile {
        Keyfile::new(self.dir().join("hotkeys").join(&self.hotkey))
    }

    /// `<path>/<name>/hotkeys/<hotkey>pub.txt`.
    #[must_use]
    pub fn hotkeypub_file(&self) -> Keyfile {
        Keyfile::new(
            self.dir()
                .join("hotkeys")
                .join(format!("{}pub.txt", self.hotkey)),
        )
    }

    /// Unlocks the coldkey.
    ///
    /// # Errors
    ///
    /// See [`Keyfile::keypair`].
    pub fn coldkey(&self, password: &PasswordSource) -> Result<Keypair, WalletError> {
        self.coldkey_file().keypair(password)
    }

    /// The coldkey's public key from `coldkeypub.txt` (no password needed).
    ///
    /// # Errors
    ///
    /// See [`Keyfile::public_key`].
    pub fn coldkeypub(&self) -> Result<PublicKey, WalletError> {
        self.coldkeypub_file().public_key()
    }

    /// Loads the hotkey, asking `password` only if the file is encrypted.
    ///
    /// # Errors
    ///
    /// See [`Keyfile::keypair`].
    pub fn hotkey(&self, password: &PasswordSource) -> Result<Keypair, WalletError> {
        self.hotkey_file().keypair(password)
    }

    /// The hotkey's public key: from `<hotkey>pub.txt` if present (older wallets lack it),
    /// else from an unencrypted hotkey file.
    ///
    /// # Errors
    ///
    /// See [`Keyfile::public_key`].
    pub fn hotkeypub(&self) -> Result<PublicKey, WalletError> {
        let pub_file = self.hotkeypub_file();
        if pub_file.exists() {
            pub_file.public_key()
        } else {
            self.hotkey_file().public_key()
        }
    }

    /// Generates a coldkey from a new `n_words` mnemonic and writes `coldkey` and
    /// `coldkeypub.txt`. `password: None` leaves the coldkey unencrypted.
    ///
    /// # Errors
    ///
    /// See [`Wallet::set_coldkey`]; [`WalletError::InvalidWordCount`].
    pub fn create_coldkey(
        &self,
        n_words: usize,
        password: Option<&PasswordSource>,
        overwrite: bool,
    ) -> Result<Keypair, WalletError> {
        // Refuse before generating, so a refused run leaves nothing behind.
        self.coldkey_file().check_writable(overwrite)?;
        self.coldkeypub_file().check_writable(overwrite)?;
        let keypair = Keypair::generate(n_words)?;
        self.set_coldkey(&keypair, password, overwrite)?;
        Ok(keypair)
    }

    /// Generates a hotkey from a new `n_words` mnemonic and writes `hotkeys/<hotkey>` and its
    /// `pub.txt`. Hotkeys are normally unencrypted (`password: None`), since miners and
    /// validators load them unattended.
    ///
    /// # Errors
    ///
    /// See [`Wallet::set_hotkey`]; [`WalletError::InvalidWordCount`].
    pub fn create_hotkey(
        &self,
        n_words: usize,
        password: Option<&PasswordSource>,
        overwrite: bool,
    ) -> Result<Keypair, WalletError> {
        self.hotkey_file().check_writable(overwrite)?;
        self.hotkeypub_file().check_writable(overwrite)?;
        let keypair = Keypair::generate(n_words)?;
        self.set_hotkey(&keypair, password, overwrite)?;
        Ok(keypair)
    }

    /// Writes `keypair` as this wallet's coldkey plus `coldkeypub.txt`.
    ///
    /// # Errors
    ///
    /// [`WalletError::AlreadyExists`] (checked for both files before anything is written)
    /// unless `overwrite`; I/O, password and encryption errors.
    pub fn set_coldkey(
        &self,
        keypair: &Keypair,
        password: Option<&PasswordSource>,
        overwrite: bool,
    ) -> Result<(), WalletError> {
        let (secret, public) = (self.coldkey_file(), self.coldkeypub_file());
        secret.check_writable(overwrite)?;
        public.check_writable(overwrite)?;
        secret.write_keypair(keypair, password, overwrite)?;
        public.write_public(&keypair.public(), overwrite)?;
        tracing::info!(wallet = %self.name, ss58 = %keypair.ss58(), "coldkey written");
        Ok(())
    }

    /// Writes `keypair` as the selected hotkey plus its `pub.txt`.
    ///
    /// # Errors
    ///
    /// As [`Wallet::set_coldkey`].
    pub fn set_hotkey(
        &self,
        keypair: &Keypair,
        password: Option<&PasswordSource>,
        overwrite: bool,
    ) -> Result<(), WalletError> {
        let (secret, public) = (self.hotkey_file(), self.hotkeypub_file());
        secret.check_writable(overwrite)?;
        public.check_writable(overwrite)?;
        secret.write_keypair(keypair, password, overwrite)?;
        public.write_public(&keypair.public(), overwrite)?;
        tracing::info!(
            wallet = %self.name, hotkey = %self.hotkey, ss58 = %keypair.ss58(), "hotkey written"
        );
        Ok(())
    }

    /// Names of the hotkeys in `hotkeys/`, sorted (public-key files are left out).
    ///
    /// # Errors
    ///
    /// [`WalletError::Io`] if the directory exists but cannot be read.
    pub fn hotkey_names(&self) -> Result<Vec<String>, WalletError> {
        let dir = self.dir().join("hotkeys");
        let mut names = list_files(&dir)?;
        names.retain(|n| !n.ends_with("pub.txt") && !n.starts_with('.'));
        Ok(names)
    }
}

/// Names of the wallets under `root` (directories, sorted).
///
/// # Errors
///
/// [`WalletError::Io`] if `root` exists but cannot be read.
pub fn list_wallets(root: &Path) -> Result<Vec<String>, WalletError> {
    let root = expand_tilde(root);
    let entries = match std::fs::read_dir(&root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(WalletError::Io { path: root, source }),
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    Ok(names)
}

fn list_files(dir: &Path) -> Result<Vec<String>, WalletError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(WalletError::Io {
                path: dir.to_path_buf(),
                source,
            });
        }
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_follow_btwallet_layout() {
        let wallet = Wallet::new("/w/", "alice", "hk").unwrap();
        assert_eq!(wallet.coldkey_file().path(), Path::new("/w/alice/coldkey"));
        assert_eq!(
            wallet.coldkeypub_file().path(),
            Path::new("/w/alice/coldkeypub.txt")
        );
        assert_eq!(
            wallet.hotkey_file().path(),
            Path::new("/w/alice/hotkeys/hk")
        );
        assert_eq!(
            wallet.hotkeypub_file().path(),
            Path::new("/w/alice/hotkeys/hkpub.txt")
        );
        assert_eq!(
            wallet.coldkey_file().env_var_name(),
            "BT_PW__W_ALICE_COLDKEY"
        );
    }

    #[test]
    fn tilde_expands_to_home() {
        let Some(home) = std::env::var_os("HOME") else {
            return;
        };
        let wallet = Wallet::new("~/.bittensor/wallets/", "default", "default").unwrap();
        assert_eq!(
            wallet.root(),
            PathBuf::from(home).join(".bittensor/wallets/")
        );
        assert_eq!(expand_tilde(Path::new("/abs")), Path::new("/abs"));
        assert_eq!(expand_tilde(Path::new("~user/x")), Path::new("~user/x"));
    }

    #[test]
    fn names_that_escape_the_directory_are_rejected() {
        for bad in ["", ".", "..", "a/b", "../x", "a\\b"] {
            assert!(
                matches!(
                    Wallet::new("/w", bad, "default"),
                    Err(WalletError::InvalidName { .. })
                ),
                "{bad:?}"
            );
            assert!(Wallet::new("/w", "default", bad).is_err(), "{bad:?}");
        }
        assert!(Wallet::new("/w", "my.wallet-1", "hot_key").is_ok());
    }
}
