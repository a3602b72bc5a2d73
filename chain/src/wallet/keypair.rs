//! sr25519 keys as Bittensor wallets hold them.

use sp_core::crypto::{Ss58AddressFormat, Ss58Codec};
use sp_core::{Pair as _, sr25519};
use zeroize::Zeroizing;

use super::WalletError;

/// SS58 address prefix of Bittensor accounts (the generic Substrate prefix).
pub const SS58_FORMAT: u16 = 42;

/// Word counts a new mnemonic may have.
pub const MNEMONIC_WORD_COUNTS: [usize; 5] = [12, 15, 18, 21, 24];

/// A 32-byte sr25519 public key (an `AccountId32` on chain).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PublicKey([u8; 32]);

impl PublicKey {
    /// Wraps raw public key bytes.
    #[must_use]
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Parses an SS58 address with Bittensor's prefix (42). An address of another network (a
    /// Polkadot `1…` or Kusama address of the same key) is refused: sending to it is almost
    /// always a mistake of network, not of key.
    ///
    /// # Errors
    ///
    /// [`WalletError::InvalidAddress`] when the checksum or length is wrong or the prefix is not
    /// 42.
    pub fn from_ss58(address: &str) -> Result<Self, WalletError> {
        let (public, format) =
            sr25519::Public::from_ss58check_with_version(address).map_err(|e| {
                WalletError::InvalidAddress {
                    address: address.to_owned(),
                    reason: e.to_string(),
                }
            })?;
        if u16::from(format) != SS58_FORMAT {
            return Err(WalletError::InvalidAddress {
                address: address.to_owned(),
                reason: format!(
                    "SS58 prefix {} belongs to another network; Bittensor addresses use {SS58_FORMAT}",
                    u16::from(format)
                ),
            });
        }
        Ok(Self(public.0))
    }

    /// The raw bytes.
    #[must_use]
    pub const fn to_bytes(&self) -> [u8; 32] {
        self.0
    }

    /// The raw bytes, borrowed.
    #[must_use]
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The SS58 address with Bittensor's prefix 42.
    #[must_use]
    pub fn ss58(&self) -> String {
        sr25519::Public::from_raw(self.0)
            .to_ss58check_with_version(Ss58AddressFormat::custom(SS58_FORMAT))
    }

    /// `0x`-prefixed lowercase hex, as keyfiles store it.
    #[must_use]
    pub fn to_hex(&self) -> String {
        format!("0x{}", hex::encode(self.0))
    }

    /// Checks an sr25519 signature (signing context `substrate`) by this key.
    #[must_use]
    pub fn verify(&self, message: &[u8], signature: &[u8; 64]) -> bool {
        let signature = sr25519::Signature::from_raw(*signature);
        sr25519::Pair::verify(&signature, message, &sr25519::Public::from_raw(self.0))
    }
}

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PublicKey").field(&self.ss58()).finish()
    }
}

impl std::fmt::Display for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.ss58())
    }
}

impl From<PublicKey> for [u8; 32] {
    fn from(key: PublicKey) -> Self {
        key.0
    }
}

/// An sr25519 keypair, with the mnemonic and mini-secret seed it came from when known.
///
/// Signing uses the `substrate` context, so signatures verify on chain and in the Python SDK.
/// A key loaded from a `privateKey`-only keyfile has neither mnemonic nor seed but can still
/// sign. `Debug` shows only the address; secrets are wiped from memory on drop.
#[derive(Clone)]
pub struct Keypair {
    pair: sr25519::Pair,
    seed: Option<Zeroizing<[u8; 32]>>,
    mnemonic: Option<Zeroizing<String>>,
}

impl Keypair {
    /// Creates a key from a fresh mnemonic of `n_words` words (12, 15, 18, 21 or 24), using the
    /// OS random generator.
    ///
    /// # Errors
    ///
    /// [`WalletError::InvalidWordCount`] for other word counts.
    pub fn generate(n_words: usize) -> Result<Self, WalletError> {
        if !MNEMONIC_WORD_COUNTS.contains(&n_words) {
            return Err(WalletError::InvalidWordCount(n_words));
        }
        // Each 3 words carry 32 bits of entropy (plus checksum bits).
        let mut entropy = Zeroizing::new([0_u8; 32]);
        let len = n_words / 3 * 4;
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut entropy[..len]);
        let mnemonic = bip39::Mnemonic::from_entropy(&entropy[..len])
            .map_err(|e| WalletError::Crypto(format!("mnemonic generation failed: {e}")))?;
        let phrase = Zeroizing::new(mnemonic.to_string());
        Self::from_mnemonic(&phrase)
    }

    /// Derives the key from an English BIP39 phrase the Substrate way (PBKDF2 over the
    /// entropy, no password), as `btcli` and `bittensor-wallet` do.
    ///
    /// Case and extra whitespace are normalised; the stored phrase uses single spaces.
    ///
    /// # Errors
    ///
    /// [`WalletError::InvalidMnemonic`] for unknown words, a bad checksum or a bad length.
    pub fn from_mnemonic(phrase: &str) -> Result<Self, WalletError> {
        let normalized = Zeroizing::new(
            phrase
                .split_whitespace()
                .map(str::to_lowercase)
                .collect::<Vec<_>>()
                .join(" "),
        );
        bip39::Mnemonic::parse_in_normalized(bip39::Language::English, &normalized).map_err(
            |e| WalletError::InvalidMnemonic {
                reason: e.to_string(),
            },
        )?;
        let (pair, seed) = sr25519::Pair::from_phrase(&normalized, None).map_err(|e| {
            WalletError::InvalidMnemonic {
                reason: format!("{e:?}"),
            }
        })?;
        Ok(Self {
            pair,
            seed: Some(Zeroizing::new(seed)),
            mnemonic: Some(normalized),
        })
    }

    /// Builds the key from a 32-byte mini-secret seed (`secretSeed` in keyfiles).
    #[must_use]
    pub fn from_seed(seed: [u8; 32]) -> Self {
        let pair = sr25519::Pair::from_seed(&seed);
        Self {
            pair,
            seed: Some(Zeroizing::new(seed)),
            mnemonic: None,
        }
    }

    /// Parses a seed written as hex, with or without `0x`.
    ///
    /// # Errors
    ///
    /// [`WalletError::InvalidSecret`] unless the text is 32 bytes of hex.
    pub fn from_seed_hex(seed: &str) -> Result<Self, WalletError> {
        let bytes = decode_hex(seed).map_err(|reason| WalletError::InvalidSecret {
            reason: format!("seed: {reason}"),
        })?;
        let seed: [u8; 32] =
            bytes
                .as_slice()
                .try_into()
                .map_err(|_| WalletError::InvalidSecret {
                    reason: format!("seed must be 32 bytes, got {}", bytes.len()),
                })?;
        Ok(Self::from_seed(seed))
    }

    /// Builds the key from the 64-byte sr25519 secret (32-byte scalar, then 32-byte nonce),
    /// the `privateKey` keyfile field.
    ///
    /// # Errors
    ///
    /// [`WalletError::InvalidSecret`] for the wrong length or a non-canonical scalar.
    pub fn from_private_key(secret: &[u8]) -> Result<Self, WalletError> {
        if secret.len() != 64 {
            return Err(WalletError::InvalidSecret {
                reason: format!("private key must be 64 bytes, got {}", secret.len()),
            });
        }
        let pair =
            sr25519::Pair::from_seed_slice(secret).map_err(|e| WalletError::InvalidSecret {
                reason: format!("private key rejected: {e:?}"),
            })?;
        Ok(Self {
            pair,
            seed: None,
            mnemonic: None,
        })
    }

    /// The key as sp-core's pair: what signs the orchestrator's requests (`iota-protocol`
    /// implements its `RequestSigner` for it).
    pub fn as_pair(&self) -> &sr25519::Pair {
        &self.pair
    }

    /// The public key.
    #[must_use]
    pub fn public(&self) -> PublicKey {
        PublicKey(self.pair.public().0)
    }

    /// The SS58 address (prefix 42).
    #[must_use]
    pub fn ss58(&self) -> String {
        self.public().ss58()
    }

    /// Signs `message` with the `substrate` signing context.
    #[must_use]
    pub fn sign(&self, message: &[u8]) -> [u8; 64] {
        self.pair.sign(message).0
    }

    /// The 32-byte mini-secret seed, when the key came from a mnemonic or seed.
    ///
    /// `subxt_signer::sr25519::Keypair::from_secret_key(seed)` builds the same key.
    #[must_use]
    pub fn seed(&self) -> Option<[u8; 32]> {
        self.seed.as_deref().copied()
    }

    /// The mnemonic, when the key came from one.
    #[must_use]
    pub fn mnemonic(&self) -> Option<&str> {
        self.mnemonic.as_deref().map(String::as_str)
    }

    /// The 64-byte expanded secret (scalar then nonce), as the `privateKey` field stores it.
    #[must_use]
    pub fn private_key(&self) -> Zeroizing<Vec<u8>> {
        Zeroizing::new(self.pair.to_raw_vec())
    }

    /// The underlying `sp-core` pair.
    #[must_use]
    pub const fn pair(&self) -> &sr25519::Pair {
        &self.pair
    }

    /// A subxt signer for the same key, when the seed is known.
    ///
    /// Keys loaded from a `privateKey`-only keyfile return `None`: subxt-signer can only be
    /// built from a seed. Such keys can still [`sign`](Self::sign).
    #[must_use]
    pub fn subxt_signer(&self) -> Option<subxt_signer::sr25519::Keypair> {
        let seed = self.seed.as_deref()?;
        subxt_signer::sr25519::Keypair::from_secret_key(*seed).ok()
    }
}

impl std::fmt::Debug for Keypair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keypair")
            .field("ss58", &self.ss58())
            .finish_non_exhaustive()
    }
}

/// Decodes hex with an optional `0x` prefix.
/// Decodes hex that may hold a secret; the bytes are wiped when dropped.
pub(crate) fn decode_hex(text: &str) -> Result<Zeroizing<Vec<u8>>, String> {
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    hex::decode(digits)
        .map(Zeroizing::new)
        .map_err(|e| format!("not valid hex ({e})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    // A throwaway key generated by `bittensor-wallet` 4.1.1 (Python): mnemonic, and the
    // secretSeed / privateKey / publicKey it wrote for it.
    const PHRASE: &str =
        "yellow cloth trumpet lecture noodle pig throw galaxy smooth armor cross tissue";
    const SEED: &str = "0x38bebb3edb3791c60e6337a6f2b3c15bd4f974ffeebf91be8029ab1f76e64ee4";
    const PRIVATE: &str = "0xa187a27a700b729adf2eeb7dca00f092d53c2d24de3d634f468d92481a00ed0d\
                           7e3d9508202c269171b44ae89d90649e259203e7ec84c44c5866d74e3905281b";
    const PUBLIC: &str = "0x0080771682c452f1b6cff97a736c549029f6eeb0402f7374ea9f450bde815e27";
    const SS58: &str = "5C5N259oJuH7ysNPn3EM12DtWtwsb2L6vB1E8dof5EhiyV6b";

    #[test]
    fn addresses_of_other_networks_are_refused() {
        let key = PublicKey::from_ss58(SS58).unwrap();
        assert_eq!(key.to_hex(), PUBLIC);
        for prefix in [0u16, 2, 1284] {
            let other = sr25519::Public::from_raw(key.to_bytes())
                .to_ss58check_with_version(Ss58AddressFormat::custom(prefix));
            let err = PublicKey::from_ss58(&other).unwrap_err().to_string();
            assert!(err.contains(&format!("prefix {prefix}")), "{err}");
        }
    }

    #[test]
    fn phrase_seed_and_private_key_agree_with_btwallet() {
        let from_phrase = Keypair::from_mnemonic(PHRASE).unwrap();
        assert_eq!(from_phrase.public().to_hex(), PUBLIC);
        assert_eq!(from_phrase.ss58(), SS58);
        assert_eq!(
            format!("0x{}", hex::encode(from_phrase.seed().unwrap())),
            SEED
        );
        assert_eq!(
            format!("0x{}", hex::encode(from_phrase.private_key())),
            PRIVATE
        );

        let from_seed = Keypair::from_seed_hex(SEED).unwrap();
        assert_eq!(from_seed.ss58(), SS58);

        let from_private = Keypair::from_private_key(&decode_hex(PRIVATE).unwrap()).unwrap();
        assert_eq!(from_private.ss58(), SS58);
        assert!(from_private.seed().is_none());
        assert!(from_private.subxt_signer().is_none());
    }

    #[test]
    fn signatures_verify_and_match_subxt_signer() {
        let key = Keypair::from_mnemonic(PHRASE).unwrap();
        let sig = key.sign(b"hello");
        assert!(key.public().verify(b"hello", &sig));
        assert!(!key.public().verify(b"hellO", &sig));

        let subxt = key.subxt_signer().unwrap();
        assert_eq!(subxt.public_key().0, key.public().to_bytes());
        let subxt_sig = subxt.sign(b"hello");
        assert!(key.public().verify(b"hello", &subxt_sig.0));
    }

    #[test]
    fn mnemonic_is_normalised() {
        let messy = format!("  {}  ", PHRASE.to_uppercase().replace(' ', "   "));
        let key = Keypair::from_mnemonic(&messy).unwrap();
        assert_eq!(key.mnemonic(), Some(PHRASE));
        assert_eq!(key.ss58(), SS58);
    }

    #[test]
    fn generate_honours_word_count() {
        for n in MNEMONIC_WORD_COUNTS {
            let key = Keypair::generate(n).unwrap();
            let phrase = key.mnemonic().unwrap();
            assert_eq!(phrase.split(' ').count(), n);
            assert_eq!(
                Keypair::from_mnemonic(phrase).unwrap().public(),
                key.public()
            );
        }
        assert!(matches!(
            Keypair::generate(13),
            Err(WalletError::InvalidWordCount(13))
        ));
    }

    #[test]
    fn bad_secrets_are_rejected() {
        assert!(matches!(
            Keypair::from_mnemonic("yellow cloth trumpet"),
            Err(WalletError::InvalidMnemonic { .. })
        ));
        // Valid words, wrong checksum.
        let bad_checksum = PHRASE.replace("tissue", "yellow");
        assert!(matches!(
            Keypair::from_mnemonic(&bad_checksum),
            Err(WalletError::InvalidMnemonic { .. })
        ));
        assert!(matches!(
            Keypair::from_seed_hex("0x1234"),
            Err(WalletError::InvalidSecret { .. })
        ));
        assert!(matches!(
            Keypair::from_seed_hex("zz"),
            Err(WalletError::InvalidSecret { .. })
        ));
        assert!(matches!(
            Keypair::from_private_key(&[0_u8; 63]),
            Err(WalletError::InvalidSecret { .. })
        ));
        // A scalar >= the group order is not canonical.
        assert!(matches!(
            Keypair::from_private_key(&[0xff_u8; 64]),
            Err(WalletError::InvalidSecret { .. })
        ));
    }

    #[test]
    fn ss58_round_trips() {
        let key = PublicKey::from_ss58(SS58).unwrap();
        assert_eq!(key.to_hex(), PUBLIC);
        assert_eq!(key.to_string(), SS58);
        assert!(PublicKey::from_ss58("5C5N259oJuH7ysNPn3EM12DtWtwsb2L6vB1E8dof5EhiyV6c").is_err());
    }
}
