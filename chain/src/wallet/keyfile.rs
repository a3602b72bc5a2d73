//! One keyfile on disk: JSON key material, optionally encrypted.
//!
//! The JSON fields are those `bittensor-wallet` writes: `accountId` and `publicKey` (both the
//! `0x`-hex public key), `privateKey` (64-byte expanded secret), `secretPhrase`, `secretSeed`
//! (32-byte mini-secret) and `ss58Address`. When loading, the secret is taken from
//! `secretPhrase`, else `secretSeed`, else `privateKey`; a file with only public fields gives a
//! public key. `bittensor-wallet` 4.1 also writes `"cryptoType": 1`; it is accepted on read but
//! not written, because 4.0.x (the version the bittensor 10 SDK pins) fails to parse any
//! non-string field.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use zeroize::{Zeroize, Zeroizing};

use super::encryption::{self, KeyfileEncryption};
use super::keypair::decode_hex;
use super::{Keypair, PasswordSource, PublicKey, WalletError};

/// Keyfiles are a few hundred bytes; anything far larger is not a keyfile.
const MAX_KEYFILE_BYTES: u64 = 1 << 20;

/// The only `cryptoType` this crate reads: sr25519.
const CRYPTO_TYPE_SR25519: u64 = 1;

/// The JSON object inside a keyfile. Field order here is the order written.
#[derive(Default, Serialize, Deserialize)]
struct KeyfileJson {
    #[serde(rename = "accountId", default, skip_serializing_if = "Option::is_none")]
    account_id: Option<String>,
    #[serde(rename = "publicKey", default, skip_serializing_if = "Option::is_none")]
    public_key: Option<String>,
    #[serde(
        rename = "privateKey",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    private_key: Option<String>,
    #[serde(
        rename = "secretPhrase",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    secret_phrase: Option<String>,
    #[serde(
        rename = "secretSeed",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    secret_seed: Option<String>,
    #[serde(
        rename = "ss58Address",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    ss58_address: Option<String>,
    #[serde(rename = "cryptoType", default, skip_serializing)]
    crypto_type: Option<serde_json::Value>,
}

impl Drop for KeyfileJson {
    fn drop(&mut self) {
        self.private_key.zeroize();
        self.secret_phrase.zeroize();
        self.secret_seed.zeroize();
    }
}

impl KeyfileJson {
    fn public_fields(public: &PublicKey) -> Self {
        let mut json = Self::default();
        json.account_id = Some(public.to_hex());
        json.public_key = Some(public.to_hex());
        json.ss58_address = Some(public.ss58());
        json
    }

    fn from_keypair(keypair: &Keypair) -> Self {
        let mut json = Self::public_fields(&keypair.public());
        json.private_key = Some(format!(
            "0x{}",
            hex::encode(keypair.private_key().as_slice())
        ));
        json.secret_phrase = keypair.mnemonic().map(str::to_owned);
        json.secret_seed = keypair
            .seed()
            .map(|seed| format!("0x{}", hex::encode(seed)));
        json
    }

    /// The public key the file declares, if any field carries one.
    fn declared_public(&self) -> Result<Option<PublicKey>, String> {
        if let Some(address) = &self.ss58_address {
            return PublicKey::from_ss58(address)
                .map(Some)
                .map_err(|e| e.to_string());
        }
        let Some(hex) = self.public_key.as_ref().or(self.account_id.as_ref()) else {
            return Ok(None);
        };
        let bytes = decode_hex(hex).map_err(|e| format!("publicKey: {e}"))?;
        let bytes: [u8; 32] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| format!("publicKey must be 32 bytes, got {}", bytes.len()))?;
        Ok(Some(PublicKey::from_bytes(bytes)))
    }

    fn check_crypto_type(&self) -> Result<(), String> {
        match &self.crypto_type {
            None | Some(serde_json::Value::Null) => Ok(()),
            Some(serde_json::Value::Number(n)) if n.as_u64() == Some(CRYPTO_TYPE_SR25519) => Ok(()),
            Some(other) => Err(format!(
                "unsupported cryptoType {other} (only 1, sr25519, is)"
            )),
        }
    }

    fn secret(&self) -> Result<Option<Keypair>, String> {
        if let Some(phrase) = &self.secret_phrase {
            return Keypair::from_mnemonic(phrase)
                .map(Some)
                .map_err(|e| format!("secretPhrase: {e}"));
        }
        if let Some(seed) = &self.secret_seed {
            return Keypair::from_seed_hex(seed)
                .map(Some)
                .map_err(|e| format!("secretSeed: {e}"));
        }
        if let Some(private) = &self.private_key {
            let bytes =
                Zeroizing::new(decode_hex(private).map_err(|e| format!("privateKey: {e}"))?);
            return Keypair::from_private_key(&bytes)
                .map(Some)
                .map_err(|e| format!("privateKey: {e}"));
        }
        Ok(None)
    }
}

/// What a decrypted keyfile holds.
#[derive(Debug, Clone)]
pub enum KeyfileContents {
    /// A secret key (hotkey or coldkey files).
    Keypair(Box<Keypair>),
    /// Only a public key (`coldkeypub.txt`, `<hotkey>pub.txt`).
    Public(PublicKey),
}

impl KeyfileContents {
    /// The public key in either case.
    #[must_use]
    pub fn public(&self) -> PublicKey {
        match self {
            Self::Keypair(keypair) => keypair.public(),
            Self::Public(public) => *public,
        }
    }
}

fn to_json(json: &KeyfileJson) -> Result<Vec<u8>, WalletError> {
    serde_json::to_vec(json).map_err(|e| WalletError::Crypto(format!("serialising keyfile: {e}")))
}

/// Serialises a keypair as keyfile JSON (unencrypted).
///
/// # Errors
///
/// [`WalletError::Crypto`] if serialisation fails (it does not for string fields, but an
/// empty keyfile must never be written by accident).
pub fn keypair_to_json(keypair: &Keypair) -> Result<Zeroizing<Vec<u8>>, WalletError> {
    to_json(&KeyfileJson::from_keypair(keypair)).map(Zeroizing::new)
}

/// Serialises a public key as the JSON of a `…pub.txt` file.
///
/// # Errors
///
/// As [`keypair_to_json`].
pub fn public_to_json(public: &PublicKey) -> Result<Vec<u8>, WalletError> {
    to_json(&KeyfileJson::public_fields(public))
}

/// Parses decrypted keyfile JSON.
///
/// # Errors
///
/// A description of the problem, for [`WalletError::Corrupt`].
pub fn parse_keyfile_json(data: &[u8]) -> Result<KeyfileContents, String> {
    let value: serde_json::Value =
        serde_json::from_slice(data).map_err(|e| format!("not valid keyfile JSON ({e})"))?;
    // serde would also accept a JSON array for a struct; keyfiles are always objects.
    if !value.is_object() {
        return Err("not valid keyfile JSON (expected an object)".to_owned());
    }
    let json: KeyfileJson =
        serde_json::from_value(value).map_err(|e| format!("not valid keyfile JSON ({e})"))?;
    json.check_crypto_type()?;
    let declared = json.declared_public()?;
    match json.secret()? {
        Some(keypair) => {
            if declared.is_some_and(|public| public != keypair.public()) {
                tracing::warn!(
                    ss58 = %keypair.ss58(),
                    "keyfile public fields disagree with its secret; using the secret"
                );
            }
            Ok(KeyfileContents::Keypair(Box::new(keypair)))
        }
        None => declared
            .map(KeyfileContents::Public)
            .ok_or_else(|| "no secret or public key fields".to_owned()),
    }
}

/// A keyfile at a path, read and written the way `bittensor-wallet` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyfile {
    path: PathBuf,
}

impl Keyfile {
    /// A keyfile at `path` (which need not exist yet).
    #[must_use]
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether something exists at the path.
    #[must_use]
    pub fn exists(&self) -> bool {
        self.path.exists()
    }

    /// The `BT_PW_…` variable btcli would read this keyfile's password from.
    #[must_use]
    pub fn env_var_name(&self) -> String {
        super::password::env_var_name(&self.path)
    }

    fn corrupt(&self, reason: impl Into<String>) -> WalletError {
        WalletError::Corrupt {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    fn io_error(&self, source: std::io::Error) -> WalletError {
        if source.kind() == std::io::ErrorKind::NotFound {
            WalletError::NotFound {
                path: self.path.clone(),
            }
        } else {
            WalletError::Io {
                path: self.path.clone(),
                source,
            }
        }
    }

    /// The raw bytes of the file.
    ///
    /// # Errors
    ///
    /// [`WalletError::NotFound`], [`WalletError::Io`], or [`WalletError::Corrupt`] for empty
    /// or implausibly large files.
    pub fn read_bytes(&self) -> Result<Vec<u8>, WalletError> {
        let meta = fs::metadata(&self.path).map_err(|e| self.io_error(e))?;
        if !meta.is_file() {
            return Err(self.corrupt("not a regular file"));
        }
        if meta.len() > MAX_KEYFILE_BYTES {
            return Err(self.corrupt(format!("{} bytes is too large for a keyfile", meta.len())));
        }
        let data = fs::read(&self.path).map_err(|e| self.io_error(e))?;
        if data.is_empty() {
            return Err(self.corrupt("file is empty"));
        }
        Ok(data)
    }

    /// How the file is protected.
    ///
    /// # Errors
    ///
    /// As [`read_bytes`](Self::read_bytes).
    pub fn encryption(&self) -> Result<KeyfileEncryption, WalletError> {
        Ok(KeyfileEncryption::detect(&self.read_bytes()?))
    }

    /// Whether the file is encrypted.
    ///
    /// # Errors
    ///
    /// As [`read_bytes`](Self::read_bytes).
    pub fn is_encrypted(&self) -> Result<bool, WalletError> {
        Ok(self.encryption()?.is_encrypted())
    }

    /// Reads, decrypts if needed (asking `password` only then) and parses the file.
    ///
    /// # Errors
    ///
    /// [`WalletError::NotFound`], [`WalletError::WrongPassword`], [`WalletError::Corrupt`],
    /// [`WalletError::UnsupportedEncryption`], password errors, all naming this file.
    pub fn contents(&self, password: &PasswordSource) -> Result<KeyfileContents, WalletError> {
        let data = self.read_bytes()?;
        let encryption = KeyfileEncryption::detect(&data);
        let plain = match encryption {
            KeyfileEncryption::None => Zeroizing::new(data),
            KeyfileEncryption::Fernet => {
                return Err(WalletError::UnsupportedEncryption {
                    path: self.path.clone(),
                    method: encryption.name(),
                });
            }
            KeyfileEncryption::Nacl | KeyfileEncryption::AnsibleVault => {
                let password = password.unlock_password(&self.path)?;
                tracing::debug!(path = %self.path.display(), method = encryption.name(), "decrypting keyfile");
                encryption::decrypt_keyfile_data(&data, &password)
                    .map_err(|e| e.at(self.path.clone()))?
            }
        };
        let contents = parse_keyfile_json(&plain).map_err(|reason| self.corrupt(reason))?;
        if matches!(contents, KeyfileContents::Keypair(_)) && !encryption.is_encrypted() {
            self.warn_if_readable_by_others();
        }
        Ok(contents)
    }

    /// The secret key in the file.
    ///
    /// # Errors
    ///
    /// As [`contents`](Self::contents), plus [`WalletError::PublicOnly`].
    pub fn keypair(&self, password: &PasswordSource) -> Result<Keypair, WalletError> {
        match self.contents(password)? {
            KeyfileContents::Keypair(keypair) => Ok(*keypair),
            KeyfileContents::Public(_) => Err(WalletError::PublicOnly {
                path: self.path.clone(),
            }),
        }
    }

    /// The public key of an unencrypted file, without asking for any password.
    ///
    /// # Errors
    ///
    /// As [`contents`](Self::contents); an encrypted file gives
    /// [`WalletError::PasswordUnavailable`].
    pub fn public_key(&self) -> Result<PublicKey, WalletError> {
        let data = self.read_bytes()?;
        if KeyfileEncryption::detect(&data).is_encrypted() {
            return Err(WalletError::PasswordUnavailable {
                path: self.path.clone(),
                env_var: self.env_var_name(),
                reason: "the file is encrypted; read its public key file instead".to_owned(),
            });
        }
        parse_keyfile_json(&data)
            .map(|c| c.public())
            .map_err(|reason| self.corrupt(reason))
    }

    /// Writes `keypair`, encrypted with a password from `password` unless it is `None`.
    ///
    /// The password is only asked for once it is clear the write may proceed.
    ///
    /// # Errors
    ///
    /// [`WalletError::AlreadyExists`] when the file exists and `overwrite` is false; I/O,
    /// password and encryption errors.
    pub fn write_keypair(
        &self,
        keypair: &Keypair,
        password: Option<&PasswordSource>,
        overwrite: bool,
    ) -> Result<(), WalletError> {
        self.check_writable(overwrite)?;
        let json = keypair_to_json(keypair)?;
        let data = match password {
            None => json,
            Some(source) => {
                let password = source.new_password(&self.path)?;
                tracing::info!(path = %self.path.display(), "encrypting keyfile");
                Zeroizing::new(
                    encryption::encrypt_nacl(&json, &password)
                        .map_err(|e| e.at(self.path.clone()))?,
                )
            }
        };
        write_atomic(&self.path, &data, overwrite)
    }

    /// Writes a public-key-only file (`coldkeypub.txt`, `<hotkey>pub.txt`).
    ///
    /// # Errors
    ///
    /// [`WalletError::AlreadyExists`] when the file exists and `overwrite` is false; I/O errors.
    pub fn write_public(&self, public: &PublicKey, overwrite: bool) -> Result<(), WalletError> {
        self.check_writable(overwrite)?;
        write_atomic(&self.path, &public_to_json(public)?, overwrite)
    }

    /// Fails early, before prompting or deriving keys, if the file may not be replaced.
    ///
    /// # Errors
    ///
    /// [`WalletError::AlreadyExists`].
    pub fn check_writable(&self, overwrite: bool) -> Result<(), WalletError> {
        // symlink_metadata: a dangling symlink is still something we would replace.
        if !overwrite && fs::symlink_metadata(&self.path).is_ok() {
            return Err(WalletError::AlreadyExists {
                path: self.path.clone(),
            });
        }
        Ok(())
    }

    #[cfg(unix)]
    fn warn_if_readable_by_others(&self) {
        use std::os::unix::fs::PermissionsExt as _;
        if let Ok(meta) = fs::metadata(&self.path) {
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                tracing::warn!(
                    path = %self.path.display(),
                    mode = format!("{mode:o}"),
                    "unencrypted keyfile is readable by other users; chmod 600 it"
                );
            }
        }
    }

    #[cfg(not(unix))]
    fn warn_if_readable_by_others(&self) {}
}

/// Creates `dir` and missing parents, owner-only (0700) where created.
pub(crate) fn create_private_dir_all(dir: &Path) -> Result<(), WalletError> {
    let mut builder = fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir).map_err(|source| WalletError::Io {
        path: dir.to_path_buf(),
        source,
    })
}

/// Writes `data` to `path` through a temporary file in the same directory, so the file is
/// either the old or the new content, never a torn mixture. The temporary file is created
/// 0600, so secrets are never briefly world-readable.
///
/// Without `overwrite` the final step is a hard link, which fails atomically if `path` appeared
/// in the meantime; filesystems without hard links fall back to check-then-rename.
fn write_atomic(path: &Path, data: &[u8], overwrite: bool) -> Result<(), WalletError> {
    let io_err = |p: &Path, source| WalletError::Io {
        path: p.to_path_buf(),
        source,
    };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    create_private_dir_all(&dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        ".{name}.tmp-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));

    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let written = options.open(&tmp).and_then(|mut file| {
        file.write_all(data)?;
        file.sync_all()
    });
    if let Err(source) = written {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(&tmp, source));
    }

    let placed = if overwrite {
        fs::rename(&tmp, path)
    } else {
        match fs::hard_link(&tmp, path) {
            Ok(()) => fs::remove_file(&tmp),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let _ = fs::remove_file(&tmp);
                return Err(WalletError::AlreadyExists {
                    path: path.to_path_buf(),
                });
            }
            Err(e) => {
                tracing::debug!(error = %e, "hard link unavailable; falling back to rename");
                if fs::symlink_metadata(path).is_ok() {
                    let _ = fs::remove_file(&tmp);
                    return Err(WalletError::AlreadyExists {
                        path: path.to_path_buf(),
                    });
                }
                fs::rename(&tmp, path)
            }
        }
    };
    if let Err(source) = placed {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(path, source));
    }
    // Persist the directory entry too; failure here does not undo the write.
    if let Err(e) = fs::File::open(&dir).and_then(|d| d.sync_all()) {
        tracing::debug!(dir = %dir.display(), error = %e, "could not sync directory");
    }
    tracing::debug!(path = %path.display(), "wrote keyfile");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PHRASE: &str =
        "yellow cloth trumpet lecture noodle pig throw galaxy smooth armor cross tissue";

    #[test]
    fn json_has_btwallet_fields_in_a_stable_order() {
        let keypair = Keypair::from_mnemonic(PHRASE).unwrap();
        let json = keypair_to_json(&keypair).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&json).unwrap();
        let keys: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            [
                "accountId",
                "privateKey",
                "publicKey",
                "secretPhrase",
                "secretSeed",
                "ss58Address"
            ]
        );
        assert!(
            std::str::from_utf8(&json)
                .unwrap()
                .starts_with("{\"accountId\":\"0x")
        );
        assert_eq!(value["secretPhrase"], PHRASE);
        assert_eq!(
            value["ss58Address"],
            "5C5N259oJuH7ysNPn3EM12DtWtwsb2L6vB1E8dof5EhiyV6b"
        );

        let public = public_to_json(&keypair.public()).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&public).unwrap();
        assert_eq!(value.as_object().unwrap().len(), 3);
        assert!(value.get("privateKey").is_none());
    }

    #[test]
    fn load_priority_is_phrase_then_seed_then_private_key() {
        let by_phrase = Keypair::from_mnemonic(PHRASE).unwrap();
        let by_seed = Keypair::from_seed([1; 32]);
        let by_private = Keypair::from_seed([2; 32]);
        let private_hex = format!("0x{}", hex::encode(by_private.private_key().as_slice()));
        let seed_hex = format!("0x{}", hex::encode([1_u8; 32]));

        let all = serde_json::json!({
            "secretPhrase": PHRASE, "secretSeed": seed_hex, "privateKey": private_hex,
        });
        let no_phrase = serde_json::json!({ "secretSeed": seed_hex, "privateKey": private_hex });
        let only_private = serde_json::json!({ "privateKey": private_hex, "secretPhrase": null });
        for (json, expected) in [
            (all, &by_phrase),
            (no_phrase, &by_seed),
            (only_private, &by_private),
        ] {
            let contents = parse_keyfile_json(json.to_string().as_bytes()).unwrap();
            assert_eq!(contents.public(), expected.public(), "{json}");
            assert!(matches!(contents, KeyfileContents::Keypair(_)));
        }

        let public_only = serde_json::json!({ "ss58Address": by_seed.ss58() });
        let contents = parse_keyfile_json(public_only.to_string().as_bytes()).unwrap();
        assert!(matches!(contents, KeyfileContents::Public(p) if p == by_seed.public()));
    }

    #[test]
    fn crypto_type_one_is_accepted_others_rejected() {
        let ok = format!("{{\"secretPhrase\":\"{PHRASE}\",\"cryptoType\":1}}");
        assert!(parse_keyfile_json(ok.as_bytes()).is_ok());
        let ed25519 = format!("{{\"secretPhrase\":\"{PHRASE}\",\"cryptoType\":0}}");
        assert!(
            parse_keyfile_json(ed25519.as_bytes())
                .unwrap_err()
                .contains("cryptoType")
        );
    }

    #[test]
    fn malformed_json_is_described() {
        for (data, needle) in [
            (&b"{\"secretPhrase\": \"yellow"[..], "JSON"),
            (b"[]", "JSON"),
            (b"{}", "no secret"),
            (b"{\"secretSeed\": \"0x12\"}", "secretSeed"),
            (b"{\"privateKey\": \"nothex\"}", "privateKey"),
            (
                b"{\"secretPhrase\": \"not a real mnemonic\"}",
                "secretPhrase",
            ),
            (b"{\"ss58Address\": \"5abc\"}", "SS58"),
        ] {
            let err = parse_keyfile_json(data).unwrap_err();
            assert!(err.contains(needle), "{err} should mention {needle}");
        }
    }
}
