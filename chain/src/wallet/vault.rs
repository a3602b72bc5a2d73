//! Ansible Vault 1.1 / 1.2 (`AES256`) decryption, the legacy keyfile format.
//!
//! Layout: a header line `$ANSIBLE_VAULT;1.1;AES256` (1.2 appends a vault id), then lines of
//! hex that decode to three hex strings separated by newlines: salt, HMAC and ciphertext.
//! PBKDF2-HMAC-SHA256 (10 000 rounds) turns password and salt into 80 bytes: the AES-256 key,
//! the HMAC-SHA256 key and the initial CTR counter block. The plaintext is PKCS#7-padded to
//! 16 bytes. Implemented here because the `ansible-vault` crate pins long-superseded
//! RustCrypto versions.

use aes::Aes256;
use ctr::cipher::{KeyIvInit, StreamCipher};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use zeroize::Zeroizing;

use super::DecryptError;

type Aes256Ctr = ctr::Ctr128BE<Aes256>;
type HmacSha256 = Hmac<Sha256>;

const PBKDF2_ROUNDS: u32 = 10_000;
const BLOCK: usize = 16;

struct Derived {
    material: Zeroizing<[u8; 80]>,
}

impl Derived {
    fn new(password: &[u8], salt: &[u8]) -> Self {
        let mut material = Zeroizing::new([0_u8; 80]);
        pbkdf2::pbkdf2_hmac::<Sha256>(password, salt, PBKDF2_ROUNDS, material.as_mut_slice());
        Self { material }
    }
    fn cipher_key(&self) -> &[u8] {
        &self.material[..32]
    }
    fn mac_key(&self) -> &[u8] {
        &self.material[32..64]
    }
    fn counter(&self) -> &[u8] {
        &self.material[64..]
    }
}

fn malformed(reason: &str) -> DecryptError {
    DecryptError::Malformed(format!("Ansible Vault data: {reason}"))
}

/// Decrypts an `$ANSIBLE_VAULT` blob.
///
/// # Errors
///
/// [`DecryptError::WrongPassword`] when the HMAC does not match, [`DecryptError::Malformed`]
/// for anything that does not parse, [`DecryptError::Unsupported`] for other ciphers.
pub(crate) fn decrypt(data: &[u8], password: &[u8]) -> Result<Zeroizing<Vec<u8>>, DecryptError> {
    let text = std::str::from_utf8(data).map_err(|_| malformed("not ASCII"))?;
    let mut lines = text.lines();
    let header = lines.next().ok_or_else(|| malformed("empty"))?;
    let fields: Vec<&str> = header.trim().split(';').collect();
    match fields.as_slice() {
        ["$ANSIBLE_VAULT", "1.1" | "1.2", cipher, ..] if cipher.trim() == "AES256" => {}
        ["$ANSIBLE_VAULT", _, _, ..] => {
            return Err(DecryptError::Unsupported("Ansible Vault version or cipher"));
        }
        _ => return Err(malformed("bad header line")),
    }
    let body: String = lines
        .flat_map(|l| l.chars().filter(|c| !c.is_whitespace()))
        .collect();
    let inner = hex::decode(body).map_err(|_| malformed("body is not hex"))?;
    let inner = std::str::from_utf8(&inner).map_err(|_| malformed("inner data is not ASCII"))?;
    let mut parts = inner.split('\n');
    let (Some(salt), Some(mac), Some(ciphertext)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(malformed("expected salt, HMAC and ciphertext"));
    };
    let salt = hex::decode(salt.trim()).map_err(|_| malformed("salt is not hex"))?;
    let mac = hex::decode(mac.trim()).map_err(|_| malformed("HMAC is not hex"))?;
    let ciphertext =
        hex::decode(ciphertext.trim()).map_err(|_| malformed("ciphertext is not hex"))?;
    if ciphertext.is_empty() || ciphertext.len() % BLOCK != 0 {
        return Err(malformed("ciphertext is not a whole number of AES blocks"));
    }

    let keys = Derived::new(password, &salt);
    let mut verifier =
        <HmacSha256 as Mac>::new_from_slice(keys.mac_key()).map_err(|_| malformed("HMAC key"))?;
    verifier.update(&ciphertext);
    // Constant-time comparison; a mismatch is what a wrong password looks like.
    verifier
        .verify_slice(&mac)
        .map_err(|_| DecryptError::WrongPassword)?;

    let mut plain = Zeroizing::new(ciphertext);
    let mut cipher = Aes256Ctr::new_from_slices(keys.cipher_key(), keys.counter())
        .map_err(|_| malformed("AES key"))?;
    cipher.apply_keystream(&mut plain);

    let pad = usize::from(*plain.last().ok_or_else(|| malformed("empty plaintext"))?);
    let valid = (1..=BLOCK).contains(&pad)
        && plain.len() >= pad
        && plain[plain.len() - pad..]
            .iter()
            .all(|&b| usize::from(b) == pad);
    if !valid {
        return Err(malformed("bad PKCS#7 padding"));
    }
    let keep = plain.len() - pad;
    plain.truncate(keep);
    Ok(plain)
}

/// Encrypts in the vault 1.1 format; only tests need this, as new keyfiles use NaCl.
#[cfg(test)]
pub(crate) fn encrypt(plaintext: &[u8], password: &[u8], salt: &[u8; 32]) -> Vec<u8> {
    let keys = Derived::new(password, salt);
    let pad = BLOCK - plaintext.len() % BLOCK;
    let mut data = plaintext.to_vec();
    data.extend(std::iter::repeat_n(u8::try_from(pad).unwrap_or(16), pad));
    let mut cipher = Aes256Ctr::new_from_slices(keys.cipher_key(), keys.counter()).unwrap();
    cipher.apply_keystream(&mut data);
    let mut mac = <HmacSha256 as Mac>::new_from_slice(keys.mac_key()).unwrap();
    mac.update(&data);
    let tag = mac.finalize().into_bytes();
    let inner = format!(
        "{}\n{}\n{}",
        hex::encode(salt),
        hex::encode(tag),
        hex::encode(&data)
    );
    let body = hex::encode(inner);
    let mut out = String::from("$ANSIBLE_VAULT;1.1;AES256\n");
    for chunk in body.as_bytes().chunks(80) {
        out.push_str(std::str::from_utf8(chunk).unwrap());
        out.push('\n');
    }
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_wrong_password() {
        let sealed = encrypt(b"{\"secretSeed\":\"0x00\"}", b"hunter2", &[3; 32]);
        assert_eq!(
            decrypt(&sealed, b"hunter2").unwrap().as_slice(),
            b"{\"secretSeed\":\"0x00\"}"
        );
        assert_eq!(
            decrypt(&sealed, b"hunter3").unwrap_err(),
            DecryptError::WrongPassword
        );
    }

    #[test]
    fn block_aligned_plaintext_gets_a_full_pad_block() {
        let sealed = encrypt(&[b'x'; 32], b"pw", &[1; 32]);
        assert_eq!(decrypt(&sealed, b"pw").unwrap().as_slice(), &[b'x'; 32]);
    }

    #[test]
    fn garbage_is_malformed() {
        for data in [
            &b"$ANSIBLE_VAULT;1.1;AES256\nzz\n"[..],
            b"$ANSIBLE_VAULT;1.1;AES256\n",
            b"$ANSIBLE_VAULT\n00\n",
            b"$ANSIBLE_VAULT;1.1;AES256\n3031\n",
        ] {
            assert!(
                matches!(decrypt(data, b"pw"), Err(DecryptError::Malformed(_))),
                "{data:?}"
            );
        }
        assert!(matches!(
            decrypt(b"$ANSIBLE_VAULT;1.0;AES\n00\n", b"pw"),
            Err(DecryptError::Unsupported(_))
        ));
        // Truncating the body breaks the hex framing or the HMAC, never silently succeeds.
        let sealed = encrypt(b"{}", b"pw", &[1; 32]);
        let cut = &sealed[..sealed.len() - 40];
        assert!(decrypt(cut, b"pw").is_err());
    }
}
