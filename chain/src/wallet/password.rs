//! Where keyfile passwords come from: the caller, the `BT_PW_…` environment variable, or a
//! no-echo terminal prompt.
//!
//! btcli can store a password in the environment under a name derived from the keyfile path:
//! `BT_PW_` followed by the path with `/` and `.` replaced by `_`, upper-cased. The value is
//! the password XOR-ed with the bytes of that name (repeated), then base64-encoded. This is
//! obfuscation, not protection; it only keeps the plain password out of casual view.

use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use zeroize::Zeroizing;

use super::WalletError;

/// Passwords shorter than this are refused for new keys (btwallet's minimum).
pub const MIN_PASSWORD_LEN: usize = 6;

/// How to obtain the password of an encrypted keyfile.
#[derive(Clone)]
pub enum PasswordSource {
    /// Use this password.
    Given(Zeroizing<String>),
    /// The keyfile's `BT_PW_…` variable if set, otherwise a no-echo prompt on the terminal.
    EnvOrPrompt,
    /// Only the `BT_PW_…` variable; never prompt (services without a terminal).
    EnvOnly,
}

impl PasswordSource {
    /// A caller-supplied password.
    #[must_use]
    pub fn given(password: impl Into<String>) -> Self {
        Self::Given(Zeroizing::new(password.into()))
    }

    /// Returns the password to unlock the keyfile at `path`.
    ///
    /// # Errors
    ///
    /// [`WalletError::PasswordEnv`] for an undecodable variable and
    /// [`WalletError::PasswordUnavailable`] when no variable is set and prompting is not
    /// allowed or not possible.
    pub fn unlock_password(&self, path: &Path) -> Result<Zeroizing<String>, WalletError> {
        match self {
            Self::Given(password) => Ok(password.clone()),
            Self::EnvOrPrompt | Self::EnvOnly => {
                let var = env_var_name(path);
                if let Some(password) = password_from_env(&var)? {
                    tracing::debug!(var = %var, "using keyfile password from the environment");
                    return Ok(password);
                }
                if matches!(self, Self::EnvOnly) {
                    return Err(WalletError::PasswordUnavailable {
                        path: path.to_path_buf(),
                        env_var: var,
                        reason: "prompting is disabled".to_owned(),
                    });
                }
                prompt_password(&format!("Enter password to unlock {}: ", path.display())).map_err(
                    |reason| WalletError::PasswordUnavailable {
                        path: path.to_path_buf(),
                        env_var: var,
                        reason,
                    },
                )
            }
        }
    }

    /// Returns the password to encrypt a new keyfile at `path`.
    ///
    /// A given password is used as is. Otherwise the `BT_PW_…` variable is used if set, or
    /// the user is prompted twice; prompted passwords must match, and passwords from the
    /// variable or the prompt must have at least [`MIN_PASSWORD_LEN`] characters.
    ///
    /// # Errors
    ///
    /// As [`unlock_password`](Self::unlock_password), plus
    /// [`WalletError::PasswordRejected`].
    pub fn new_password(&self, path: &Path) -> Result<Zeroizing<String>, WalletError> {
        match self {
            Self::Given(password) => Ok(password.clone()),
            Self::EnvOrPrompt | Self::EnvOnly => {
                let var = env_var_name(path);
                if let Some(password) = password_from_env(&var)? {
                    // The same rules as a typed password.
                    check_new_password(&password)?;
                    return Ok(password);
                }
                let unavailable = |reason: String| WalletError::PasswordUnavailable {
                    path: path.to_path_buf(),
                    env_var: var.clone(),
                    reason,
                };
                if matches!(self, Self::EnvOnly) {
                    return Err(unavailable("prompting is disabled".to_owned()));
                }
                let first = prompt_password(&format!(
                    "Choose a password to encrypt {}: ",
                    path.display()
                ))
                .map_err(unavailable)?;
                check_new_password(&first)?;
                let second = prompt_password("Retype the password: ").map_err(unavailable)?;
                if first != second {
                    return Err(WalletError::PasswordRejected {
                        reason: "the passwords do not match".to_owned(),
                    });
                }
                Ok(first)
            }
        }
    }
}

impl std::fmt::Debug for PasswordSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Given(_) => f.write_str("Given(<redacted>)"),
            Self::EnvOrPrompt => f.write_str("EnvOrPrompt"),
            Self::EnvOnly => f.write_str("EnvOnly"),
        }
    }
}

/// Rejects passwords too short to be worth Argon2's cost.
///
/// # Errors
///
/// [`WalletError::PasswordRejected`] when shorter than [`MIN_PASSWORD_LEN`] characters.
pub fn check_new_password(password: &str) -> Result<(), WalletError> {
    if password.chars().count() < MIN_PASSWORD_LEN {
        return Err(WalletError::PasswordRejected {
            reason: format!("use at least {MIN_PASSWORD_LEN} characters"),
        });
    }
    Ok(())
}

/// The environment variable btcli uses for the password of the keyfile at `path`.
///
/// The path is used as written (after `~` expansion), so `/a/b` and `/a//b` give different
/// names, exactly as in btcli.
#[must_use]
pub fn env_var_name(path: &Path) -> String {
    let text = path.to_string_lossy();
    let flat = text.replace([std::path::MAIN_SEPARATOR, '.'], "_");
    format!("BT_PW_{}", flat.to_uppercase())
}

fn xor_with_name(data: &[u8], var_name: &str) -> Zeroizing<Vec<u8>> {
    let key = var_name.as_bytes();
    Zeroizing::new(
        data.iter()
            .zip(key.iter().cycle())
            .map(|(d, k)| d ^ k)
            .collect(),
    )
}

/// Encodes `password` for the variable `var_name` the way btcli does, so it can be exported.
#[must_use]
pub fn encode_env_password(var_name: &str, password: &str) -> String {
    BASE64.encode(xor_with_name(password.as_bytes(), var_name).as_slice())
}

/// Decodes a `BT_PW_…` value.
///
/// # Errors
///
/// [`WalletError::PasswordEnv`] if the value is not base64 or does not decode to UTF-8.
pub fn decode_env_password(var_name: &str, value: &str) -> Result<Zeroizing<String>, WalletError> {
    let env_error = |reason: &str| WalletError::PasswordEnv {
        var: var_name.to_owned(),
        reason: reason.to_owned(),
    };
    let raw = Zeroizing::new(
        BASE64
            .decode(value.trim())
            .map_err(|_| env_error("not base64"))?,
    );
    let plain = xor_with_name(&raw, var_name);
    let text = std::str::from_utf8(&plain).map_err(|_| env_error("does not decode to UTF-8"))?;
    if text.is_empty() {
        // As at the prompt: an empty password protects nothing.
        return Err(env_error("decodes to an empty password"));
    }
    Ok(Zeroizing::new(text.to_owned()))
}

/// Reads and decodes the variable if it is set.
fn password_from_env(var_name: &str) -> Result<Option<Zeroizing<String>>, WalletError> {
    match std::env::var(var_name).map(Zeroizing::new) {
        Ok(value) => decode_env_password(var_name, &value).map(Some),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(WalletError::PasswordEnv {
            var: var_name.to_owned(),
            reason: "not valid Unicode".to_owned(),
        }),
    }
}

/// Reads a line without echo from the controlling terminal (`/dev/tty`), so it works even
/// when stdin is redirected, and fails cleanly when there is no terminal at all.
fn prompt_password(prompt: &str) -> Result<Zeroizing<String>, String> {
    rpassword::prompt_password(prompt)
        .map(Zeroizing::new)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_var_name_follows_btcli() {
        // Names printed by bittensor-wallet 4.1.1 `Keyfile.env_var_name()`.
        assert_eq!(
            env_var_name(Path::new("/root/.bittensor/wallets/a/coldkey")),
            "BT_PW__ROOT__BITTENSOR_WALLETS_A_COLDKEY"
        );
        assert_eq!(
            env_var_name(Path::new("/tmp/xw/my.wallet/coldkey")),
            "BT_PW__TMP_XW_MY_WALLET_COLDKEY"
        );
        assert_eq!(
            env_var_name(Path::new("rel/dir/a/coldkey")),
            "BT_PW_REL_DIR_A_COLDKEY"
        );
    }

    #[test]
    fn decodes_values_written_by_btwallet() {
        // `Keyfile("/tmp/xw/coldkey").save_password_to_env(...)` in bittensor-wallet 4.1.1.
        let var = "BT_PW__TMP_XW_COLDKEY";
        assert_eq!(
            decode_env_password(var, "ITstIjI8K3QlPy0rMg==")
                .unwrap()
                .as_str(),
            "correct horse"
        );
        assert_eq!(
            decode_env_password(var, "Mpf7IyQonOI/NL3a+w==")
                .unwrap()
                .as_str(),
            "pässwörd€"
        );
        assert_eq!(
            encode_env_password(var, "correct horse"),
            "ITstIjI8K3QlPy0rMg=="
        );
    }

    #[test]
    fn long_passwords_repeat_the_key() {
        let var = "BT_PW_X";
        let password = "a password much longer than the variable name";
        let encoded = encode_env_password(var, password);
        // btcli's XOR cycles the variable's name over the whole password: past the name's
        // length too (a round trip alone would pass with the tail left in clear).
        let raw = BASE64.decode(&encoded).unwrap();
        let expected: Vec<u8> = password
            .bytes()
            .enumerate()
            .map(|(i, p)| p ^ var.as_bytes()[i % var.len()])
            .collect();
        assert_eq!(raw, expected);
        assert_eq!(
            decode_env_password(var, &encoded).unwrap().as_str(),
            password
        );
    }

    #[test]
    fn bad_values_are_typed_errors() {
        let err = decode_env_password("BT_PW_X", "***").unwrap_err();
        assert!(matches!(err, WalletError::PasswordEnv { ref var, .. } if var == "BT_PW_X"));
        // Valid base64 whose XOR is not UTF-8.
        let err = decode_env_password("BT_PW_X", &BASE64.encode([0xff_u8 ^ b'B'])).unwrap_err();
        assert!(matches!(err, WalletError::PasswordEnv { .. }));
    }

    #[test]
    fn short_new_passwords_are_rejected() {
        assert!(check_new_password("12345").is_err());
        assert!(check_new_password("123456").is_ok());
    }

    #[test]
    fn given_passwords_are_redacted_in_debug() {
        let source = PasswordSource::given("hunter2");
        assert!(!format!("{source:?}").contains("hunter2"));
    }

    #[test]
    fn environment_passwords_obey_the_typed_rules() {
        let var = "BT_PW_IOTA_TEST_EMPTY";
        let empty = encode_env_password(var, "");
        let err = decode_env_password(var, &empty).unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");
    }
}
