//! Keyfile encryption as `bittensor-wallet` does it.
//!
//! Current files are `$NACL ++ nonce(24) ++ secretbox`, i.e. XSalsa20-Poly1305 with the
//! 16-byte tag in front of the ciphertext, keyed by Argon2i v1.3 over the password with
//! libsodium's "sensitive" limits (8 passes, 512 MiB, one lane) and a salt fixed by the format.
//! Older files are Ansible Vault 1.1 (see [`super::vault`]), which can still be decrypted, and
//! Fernet, which cannot (btwallet itself has been unable to open it since its Rust rewrite).

use argon2::{Algorithm, Argon2, Params, Version};
use xsalsa20poly1305::aead::{Aead, KeyInit};
use xsalsa20poly1305::{Nonce, XSalsa20Poly1305};
use zeroize::Zeroizing;

use super::DecryptError;
use super::vault;

/// Prefix of NaCl-encrypted keyfiles.
pub const NACL_PREFIX: &[u8] = b"$NACL";
/// Prefix of Ansible-Vault-encrypted keyfiles.
pub const ANSIBLE_PREFIX: &[u8] = b"$ANSIBLE_VAULT";
/// Prefix of Fernet tokens (the oldest format).
pub const FERNET_PREFIX: &[u8] = b"gAAAAA";

/// The salt is part of the format: every NaCl keyfile uses these 16 bytes.
const NACL_SALT: [u8; 16] = *b"\x13q\x83\xdf\xf1Z\t\xbc\x9c\x90\xb5Q\x879\xe9\xb1";
/// libsodium `crypto_pwhash_argon2i_OPSLIMIT_SENSITIVE`.
const ARGON2_PASSES: u32 = 8;
/// libsodium `crypto_pwhash_argon2i_MEMLIMIT_SENSITIVE` (512 MiB) in KiB.
const ARGON2_MEMORY_KIB: u32 = 512 * 1024;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;

/// How a keyfile's bytes are protected, told apart by their prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyfileEncryption {
    /// Plain JSON.
    None,
    /// `$NACL` (current).
    Nacl,
    /// `$ANSIBLE_VAULT` (legacy, readable).
    AnsibleVault,
    /// Fernet `gAAAAA…` (oldest, not readable).
    Fernet,
}

impl KeyfileEncryption {
    /// Classifies keyfile bytes by prefix.
    #[must_use]
    pub fn detect(data: &[u8]) -> Self {
        if data.starts_with(NACL_PREFIX) {
            Self::Nacl
        } else if data.starts_with(ANSIBLE_PREFIX) {
            Self::AnsibleVault
        } else if data.starts_with(FERNET_PREFIX) {
            Self::Fernet
        } else {
            Self::None
        }
    }

    /// Whether a password is needed.
    #[must_use]
    pub const fn is_encrypted(self) -> bool {
        !matches!(self, Self::None)
    }

    /// Human-readable name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Nacl => "NaCl",
            Self::AnsibleVault => "Ansible Vault",
            Self::Fernet => "Fernet (legacy)",
        }
    }
}

/// Argon2i v1.3 with the sensitive limits; takes seconds and 512 MiB by design.
fn derive_key(password: &[u8]) -> Result<Zeroizing<[u8; 32]>, DecryptError> {
    let params = Params::new(ARGON2_MEMORY_KIB, ARGON2_PASSES, 1, Some(32))
        .map_err(|e| DecryptError::Kdf(e.to_string()))?;
    let argon = Argon2::new(Algorithm::Argon2i, Version::V0x13, params);
    let mut key = Zeroizing::new([0_u8; 32]);
    argon
        .hash_password_into(password, &NACL_SALT, key.as_mut_slice())
        .map_err(|e| DecryptError::Kdf(e.to_string()))?;
    Ok(key)
}

/// Encrypts keyfile JSON in the current `$NACL` format with a fresh random nonce.
///
/// # Errors
///
/// [`DecryptError::Kdf`] if Argon2 cannot run (for example its 512 MiB cannot be allocated).
pub fn encrypt_nacl(plaintext: &[u8], password: &str) -> Result<Vec<u8>, DecryptError> {
    let key = derive_key(password.as_bytes())?;
    let mut nonce = [0_u8; NONCE_LEN];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut nonce);
    seal_with_key(plaintext, &key, &nonce)
}

fn seal_with_key(
    plaintext: &[u8],
    key: &[u8; 32],
    nonce: &[u8; NONCE_LEN],
) -> Result<Vec<u8>, DecryptError> {
    let cipher = XSalsa20Poly1305::new(key.into());
    let sealed = cipher
        .encrypt(Nonce::from_slice(nonce), plaintext)
        .map_err(|_| DecryptError::Kdf("secretbox encryption failed".to_owned()))?;
    let mut out = Vec::with_capacity(NACL_PREFIX.len() + NONCE_LEN + sealed.len());
    out.extend_from_slice(NACL_PREFIX);
    out.extend_from_slice(nonce);
    out.extend_from_slice(&sealed);
    Ok(out)
}

/// Splits a `$NACL` blob into nonce and box, checking lengths before any key derivation so
/// that a truncated file is reported as such without spending seconds on Argon2.
fn split_nacl(data: &[u8]) -> Result<(&[u8], &[u8]), DecryptError> {
    let body = data
        .strip_prefix(NACL_PREFIX)
        .ok_or_else(|| DecryptError::Malformed("missing $NACL prefix".to_owned()))?;
    if body.len() < NONCE_LEN + TAG_LEN {
        return Err(DecryptError::Malformed(format!(
            "truncated NaCl data: {} bytes after the prefix, at least {} needed",
            body.len(),
            NONCE_LEN + TAG_LEN
        )));
    }
    Ok(body.split_at(NONCE_LEN))
}

fn open_with_key(data: &[u8], key: &[u8; 32]) -> Result<Zeroizing<Vec<u8>>, DecryptError> {
    let (nonce, sealed) = split_nacl(data)?;
    let cipher = XSalsa20Poly1305::new(key.into());
    cipher
        .decrypt(Nonce::from_slice(nonce), sealed)
        .map(Zeroizing::new)
        .map_err(|_| DecryptError::WrongPassword)
}

/// Decrypts keyfile bytes in any readable format (`$NACL` or `$ANSIBLE_VAULT`).
///
/// # Errors
///
/// [`DecryptError::WrongPassword`] when authentication fails, [`DecryptError::Malformed`] for
/// truncated or garbled data, [`DecryptError::Unsupported`] for Fernet and
/// [`DecryptError::NotEncrypted`] for plain data.
pub fn decrypt_keyfile_data(
    data: &[u8],
    password: &str,
) -> Result<Zeroizing<Vec<u8>>, DecryptError> {
    match KeyfileEncryption::detect(data) {
        KeyfileEncryption::Nacl => {
            split_nacl(data)?;
            let key = derive_key(password.as_bytes())?;
            open_with_key(data, &key)
        }
        KeyfileEncryption::AnsibleVault => vault::decrypt(data, password.as_bytes()),
        KeyfileEncryption::Fernet => Err(DecryptError::Unsupported("Fernet (legacy)")),
        KeyfileEncryption::None => Err(DecryptError::NotEncrypted),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // These tests use a fixed key so they do not pay for Argon2; the integration tests
    // cover the key derivation against files written by btwallet.

    const KEY: [u8; 32] = [7; 32];

    #[test]
    fn layout_is_prefix_nonce_tag_ciphertext() {
        let nonce = [9_u8; NONCE_LEN];
        let sealed = seal_with_key(b"{}", &KEY, &nonce).unwrap();
        assert!(sealed.starts_with(NACL_PREFIX));
        assert_eq!(&sealed[5..29], &nonce);
        assert_eq!(sealed.len(), 5 + NONCE_LEN + TAG_LEN + 2);
        assert_eq!(open_with_key(&sealed, &KEY).unwrap().as_slice(), b"{}");
    }

    #[test]
    fn tampering_and_wrong_key_fail_authentication() {
        let sealed = seal_with_key(b"secret", &KEY, &[1; NONCE_LEN]).unwrap();
        assert_eq!(
            open_with_key(&sealed, &[8; 32]).unwrap_err(),
            DecryptError::WrongPassword
        );
        let mut flipped = sealed.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert_eq!(
            open_with_key(&flipped, &KEY).unwrap_err(),
            DecryptError::WrongPassword
        );
    }

    #[test]
    fn truncated_data_is_malformed_without_key_derivation() {
        let sealed = seal_with_key(b"secret", &KEY, &[1; NONCE_LEN]).unwrap();
        for len in [5, 20, 5 + NONCE_LEN + TAG_LEN - 1] {
            // decrypt_keyfile_data would run Argon2 after the length check; a quick failure
            // here shows the check comes first.
            assert!(matches!(
                decrypt_keyfile_data(&sealed[..len], "pw"),
                Err(DecryptError::Malformed(_))
            ));
        }
    }

    #[test]
    fn detection_by_prefix() {
        assert_eq!(
            KeyfileEncryption::detect(b"$NACLxyz"),
            KeyfileEncryption::Nacl
        );
        assert_eq!(
            KeyfileEncryption::detect(b"$ANSIBLE_VAULT;1.1;AES256\n"),
            KeyfileEncryption::AnsibleVault
        );
        assert_eq!(
            KeyfileEncryption::detect(b"gAAAAABk"),
            KeyfileEncryption::Fernet
        );
        assert_eq!(
            KeyfileEncryption::detect(b"{\"a\":1}"),
            KeyfileEncryption::None
        );
        assert_eq!(
            decrypt_keyfile_data(b"gAAAAABk", "pw").unwrap_err(),
            DecryptError::Unsupported("Fernet (legacy)")
        );
        assert_eq!(
            decrypt_keyfile_data(b"{}", "pw").unwrap_err(),
            DecryptError::NotEncrypted
        );
    }
}
