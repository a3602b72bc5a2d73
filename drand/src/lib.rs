//! Drand-timelocked weight commits (subtensor commit-reveal v3/v4), shared by the chain client,
//! which encrypts them, and the localnet, which runs a beacon of its own and reveals them.
//!
//! A validator on a subnet whose `CommitRevealWeightsVersion` is 3 or more does not commit a hash:
//! it encrypts its weights to a future round of drand's quicknet beacon and sends the ciphertext
//! with `commit_timelocked_(mechanism_)weights`. Once the chain has stored that round's pulse,
//! subtensor decrypts every commit for the round in `block_step` (`reveal_crv3_commits`) and sets
//! the weights as if they had been sent in the clear. Nobody (the committer included) can read a
//! commit before drand publishes the round's signature.
//!
//! What this module does, all of it pure (time, keys and randomness are passed in):
//!
//! * [`reveal_round`]: the quicknet round a commit made now must target, by the rule
//!   bittensor-drand (the Python SDK's encryption) uses: the first block of the reveal epoch,
//!   plus [`SECURITY_BLOCK_OFFSET`] blocks, converted to wall-clock time and rounded *down* to a
//!   round, so the pulse is never one the chain cannot have yet. [`first_reveal_block`] gives that
//!   block under the modulo epoch rule (spec ≤ 403; bittensor-drand 1.x `get_encrypted_commit`).
//!   Under the stateful rule (spec ≥ 404; bittensor-drand 2.x `get_encrypted_commit_v2`, which
//!   simulates the chain's `block_step` from `LastEpochBlock`, `PendingEpochAt`,
//!   `SubnetEpochIndex` and `BlocksSinceLastStep`) the caller predicts it from the chain's epoch
//!   state (`iota_chain::epoch::stateful_first_reveal_block`).
//! * [`WeightsTlockPayload`]: the SCALE struct subtensor decodes from the plaintext.
//! * [`encrypt_for_round`] / [`decrypt_with_signature`]: Boneh-Franklin IBE to the identity
//!   `sha256(round as big-endian u64)` under the beacon's G2 public key, with the message under
//!   AES-GCM, from ideal-lab5's `timelock` crate (the code subtensor and bittensor-drand link, as
//!   their `tle`). A round's drand signature (G1, scheme `bls-unchained-g1-rfc9380`) is the IBE
//!   secret key for that identity.
//!
//! ## The bytes on chain
//!
//! Subtensor and bittensor-drand pin `tle` at a 2024 revision, whose ciphertext serializes (arkworks
//! compressed) as: `U` (G2, 96 bytes), `V` and `W` as length-prefixed byte vectors (u64 LE length
//! 32, then 32 bytes each), the AES-GCM body as a length-prefixed vector (itself the serialized
//! `{ciphertext, nonce}`), and the cipher suite `AES_GCM_` as a length-prefixed vector. The
//! maintained `timelock` release keeps `V` and `W` as fixed 32-byte arrays, which serialize
//! without the length prefix: the cryptography is the same, the framing is not. [`encrypt_for_round`]
//! therefore writes (and [`decrypt_with_signature`] reads) the pinned revision's framing,
//! [`SubtensorCiphertext`], and hands the fields to the crate. The cross-check against the Python
//! `bittensor-drand` package (`chain/tests/drand_python.rs`) has each side open the other's
//! ciphertexts; the package refuses the maintained crate's own framing.

use ark_ec::PrimeGroup;
use ark_serialize::{CanonicalDeserialize, CanonicalSerialize};
use parity_scale_codec::{Decode, Encode};
use rand::{CryptoRng, RngCore};
use sha2::{Digest, Sha256};
use timelock::block_ciphers::{AESGCMBlockCipherProvider, BlockCipherProvider};
use timelock::engines::EngineBLS;
use timelock::engines::drand::TinyBLS381;
use timelock::ibe::fullident::{Ciphertext as IbeCiphertext, Identity};
use timelock::tlock::{self, TLECiphertext};

/// Drand quicknet's group public key (G2, compressed), as drand's `/info` publishes it.
pub const QUICKNET_PUBLIC_KEY_HEX: &str = "83cf0f2896adee7eb8b5f01fcad3912212c437e0073e911fb90022d3e760183c8c4b450b6a0a6c3ac6a5776a2d1064510d1fec758c921cc22b0e17e63aaf4bcb5ed66304de9cf809bd274ca73bab4af5a6e9c76a4bc09e76eae8991ef5ece45a";
/// Drand quicknet's chain hash.
pub const QUICKNET_CHAIN_HASH_HEX: &str =
    "52db9ba70e0cc0f6eaf7803dd07447a1f5477735fd3f661792ba94600c84e971";
/// Blocks after the first block of the reveal epoch at which the pulse should be on chain
/// (bittensor-drand's margin: the chain stores a pulse a few blocks after drand emits it).
pub const SECURITY_BLOCK_OFFSET: u64 = 3;
/// Compressed size of a drand public key (G2).
pub const PUBLIC_KEY_LEN: usize = 96;
/// Compressed size of a round signature (G1).
pub const SIGNATURE_LEN: usize = 48;
/// Size of the IBE-encrypted parts `V` and `W` of a ciphertext.
const IBE_PART_LEN: usize = 32;

/// Everything that can go wrong encrypting or decrypting a timelocked commit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TimelockError {
    /// The beacon public key is not a compressed G2 point in the prime-order subgroup.
    #[error("invalid drand public key: {0}")]
    InvalidPublicKey(String),
    /// The round signature is not a compressed G1 point in the prime-order subgroup.
    #[error("invalid drand round signature: {0}")]
    InvalidSignature(String),
    /// The ciphertext does not parse as a timelock ciphertext in subtensor's layout.
    #[error("malformed timelock ciphertext: {0}")]
    MalformedCiphertext(String),
    /// The ciphertext names a symmetric cipher other than AES-GCM.
    #[error("timelock ciphertext uses cipher suite {0:?}; only AES_GCM_ is supported")]
    UnsupportedCipherSuite(String),
    /// The signature does not open the ciphertext: it is not the signature of the round (and
    /// beacon) the ciphertext was encrypted to, or the ciphertext's IBE header was altered.
    #[error(
        "the signature does not decrypt this ciphertext: it is not the drand signature of the round the ciphertext was encrypted to (or the ciphertext's header was altered)"
    )]
    WrongSignature,
    /// The key was recovered but the AES-GCM body does not authenticate (tampered body).
    #[error("the timelock ciphertext's body does not authenticate: it was altered")]
    CorruptBody,
    /// Encryption failed inside the cipher.
    #[error("timelock encryption failed: {0}")]
    Encryption(String),
    /// Block time or the clock is unusable (not finite, or not positive).
    #[error("invalid timing: {0}")]
    InvalidTiming(String),
}

/// What subtensor decodes from a decrypted commit (`WeightsTlockPayload` in
/// `pallets/subtensor/src/coinbase/reveal_commits.rs`), SCALE-encoded in this field order.
/// `hotkey` is the committing hotkey's 32-byte public key; commit-reveal v4 drops a commit whose
/// payload names another hotkey than the one that signed the commit.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct WeightsTlockPayload {
    /// The committing hotkey's public key bytes.
    pub hotkey: Vec<u8>,
    /// Destination uids.
    pub uids: Vec<u16>,
    /// Weights, one per uid (u16, max-upscaled on chain as with `set_weights`).
    pub values: Vec<u16>,
    /// The weights version key.
    pub version_key: u64,
}

/// A drand beacon's round schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrandSchedule {
    /// Unix time of round 1.
    pub genesis_time: u64,
    /// Seconds between rounds.
    pub period_secs: u64,
}

impl DrandSchedule {
    /// Drand quicknet: genesis 2023-08-23 15:09:27 UTC, a round every 3 seconds.
    pub const QUICKNET: DrandSchedule = DrandSchedule {
        genesis_time: 1_692_803_367,
        period_secs: 3,
    };

    /// The last round emitted at or before `unix_secs` by the `floor((t - genesis) / period)`
    /// count bittensor-drand uses; at least 1.
    ///
    /// # Errors
    ///
    /// [`TimelockError::InvalidTiming`] for a time that is not finite or a period of 0.
    pub fn round_at(&self, unix_secs: f64) -> Result<u64, TimelockError> {
        if !unix_secs.is_finite() {
            return Err(TimelockError::InvalidTiming(format!(
                "time {unix_secs} is not finite"
            )));
        }
        if self.period_secs == 0 {
            return Err(TimelockError::InvalidTiming(
                "drand period is 0 seconds".to_owned(),
            ));
        }
        #[allow(clippy::cast_precision_loss)]
        let rounds = ((unix_secs - self.genesis_time as f64) / self.period_secs as f64).floor();
        // Saturating float-to-int: a time before genesis gives 0 (then 1 below).
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let round = rounds as u64;
        Ok(round.max(1))
    }
}

/// The first block of the epoch in which a commit made at `current_block` is revealed, by the
/// modulo epoch rule (subtensor spec ≤ 403; `iota_chain::epoch`): the epoch index of
/// `current_block` plus `reveal_period_epochs`, at its first block. `netuid_index` is the
/// `NetUidStorageIndex` (`mecid * 4096 + netuid`; the netuid itself for the main mechanism),
/// which is what the SDK passes. Saturates instead of overflowing.
pub fn first_reveal_block(
    netuid_index: u16,
    tempo: u16,
    current_block: u64,
    reveal_period_epochs: u64,
) -> u64 {
    // `epoch_index`, saturating at the far end of the block range.
    let offset = u64::from(netuid_index) + 1;
    let epoch_len = u64::from(tempo) + 1;
    let reveal_epoch =
        (current_block.saturating_add(offset) / epoch_len).saturating_add(reveal_period_epochs);
    reveal_epoch
        .saturating_mul(epoch_len)
        .saturating_sub(offset)
}

/// When a commit is made and when it must be revealed, in blocks and wall-clock time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CommitTiming {
    /// The chain's current block (the one the commit is built on).
    pub current_block: u64,
    /// The first block of the reveal epoch ([`first_reveal_block`] under the modulo rule; under
    /// the stateful rule, the block the chain's epoch state predicts).
    pub first_reveal_block: u64,
    /// Seconds per block (12 on finney).
    pub block_time_secs: f64,
    /// Unix time now, in seconds (passed in, not read from the clock).
    pub now_unix_secs: f64,
}

/// The drand round a commit must be encrypted to: the round out by the time of block
/// `first_reveal_block + SECURITY_BLOCK_OFFSET`, extrapolated from `now` at `block_time_secs` per
/// block and rounded down (bittensor-drand's `generate_commit`); at least 1.
///
/// # Errors
///
/// [`TimelockError::InvalidTiming`] for a block time that is not a positive finite number or a
/// clock that is not finite.
pub fn reveal_round(timing: &CommitTiming, drand: &DrandSchedule) -> Result<u64, TimelockError> {
    if !(timing.block_time_secs.is_finite() && timing.block_time_secs > 0.0) {
        return Err(TimelockError::InvalidTiming(format!(
            "block time {} s is not a positive number",
            timing.block_time_secs
        )));
    }
    let target_block = timing
        .first_reveal_block
        .saturating_add(SECURITY_BLOCK_OFFSET);
    let blocks_ahead = target_block.saturating_sub(timing.current_block);
    #[allow(clippy::cast_precision_loss)]
    let secs_ahead = blocks_ahead as f64 * timing.block_time_secs;
    drand.round_at(timing.now_unix_secs + secs_ahead)
}

/// A drand beacon's group public key (a G2 point).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrandPublicKey(<TinyBLS381 as EngineBLS>::PublicKeyGroup);

impl DrandPublicKey {
    /// Quicknet's public key.
    pub fn quicknet() -> Self {
        hex::decode(QUICKNET_PUBLIC_KEY_HEX)
            .ok()
            .and_then(|bytes| Self::from_bytes(&bytes).ok())
            .expect("the quicknet public key constant is a valid G2 point")
    }

    /// Parses a compressed G2 point (96 bytes), checking that it is on the curve and in the
    /// prime-order subgroup.
    ///
    /// # Errors
    ///
    /// [`TimelockError::InvalidPublicKey`] for anything else.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, TimelockError> {
        if bytes.len() != PUBLIC_KEY_LEN {
            return Err(TimelockError::InvalidPublicKey(format!(
                "{} bytes, expected {PUBLIC_KEY_LEN}",
                bytes.len()
            )));
        }
        let point = <TinyBLS381 as EngineBLS>::PublicKeyGroup::deserialize_compressed(bytes)
            .map_err(|e| TimelockError::InvalidPublicKey(e.to_string()))?;
        Ok(Self(point))
    }

    /// The compressed point (96 bytes).
    pub fn to_bytes(&self) -> Vec<u8> {
        compressed(&self.0)
    }
}

/// The identity a round's ciphertexts are encrypted to: what drand signs for the round.
fn round_identity(round: u64) -> Identity {
    let digest = Sha256::digest(round.to_be_bytes());
    Identity::new(b"", &digest)
}

/// Timelock-encrypts `plaintext` (for a weight commit: a SCALE [`WeightsTlockPayload`]) to drand
/// round `round` of the beacon with public key `public_key`, in the byte layout subtensor
/// decrypts. The AES key and the IBE randomness come from `rng`.
///
/// # Errors
///
/// [`TimelockError::Encryption`] if the cipher fails (it does not for any input length a commit
/// can have).
pub fn encrypt_for_round<R: RngCore + CryptoRng>(
    plaintext: &[u8],
    round: u64,
    public_key: &DrandPublicKey,
    rng: &mut R,
) -> Result<Vec<u8>, TimelockError> {
    let mut key = [0u8; 32];
    rng.fill_bytes(&mut key);
    let ct = tlock::tle::<TinyBLS381, AESGCMBlockCipherProvider, _>(
        public_key.0,
        key,
        plaintext,
        round_identity(round),
        rng,
    )
    .map_err(|e| TimelockError::Encryption(format!("{e:?}")))?;
    let wire = SubtensorCiphertext {
        u: ct.header.u,
        v: ct.header.v.to_vec(),
        w: ct.header.w.to_vec(),
        body: ct.body,
        cipher_suite: ct.cipher_suite,
    };
    Ok(compressed(&wire))
}

/// Decrypts a timelocked ciphertext with the drand signature of the round it was encrypted to
/// (48 bytes, compressed G1, as drand publishes it and subtensor's Drand pallet stores it).
///
/// # Errors
///
/// [`TimelockError::MalformedCiphertext`] or [`TimelockError::UnsupportedCipherSuite`] for bytes
/// that are not a ciphertext, [`TimelockError::InvalidSignature`] for bytes that are not a G1
/// point, [`TimelockError::WrongSignature`] for another round's (or beacon's) signature,
/// [`TimelockError::CorruptBody`] for a ciphertext whose body was altered.
pub fn decrypt_with_signature(
    ciphertext: &[u8],
    round_signature: &[u8],
) -> Result<Vec<u8>, TimelockError> {
    let wire = SubtensorCiphertext::parse(ciphertext)?;
    let signature = parse_signature(round_signature)?;
    let ct = wire.into_tle()?;
    tlock::tld::<TinyBLS381, AESGCMBlockCipherProvider>(ct, signature).map_err(|e| match e {
        tlock::Error::InvalidSignature | tlock::Error::InvalidSecretKey => {
            TimelockError::WrongSignature
        }
        tlock::Error::DeserializationError => {
            TimelockError::MalformedCiphertext("the AES-GCM body does not parse".to_owned())
        }
        _ => TimelockError::CorruptBody,
    })
}

/// A beacon of one's own: a BLS secret key whose public key stands in for drand's and whose
/// signatures on rounds are made the way quicknet makes them (`bls-unchained-g1-rfc9380`: a G1
/// signature on `sha256(round as big-endian u64)`). For tests and local chains, which cannot reach
/// drand; it opens nothing encrypted to quicknet.
pub struct LocalBeacon {
    secret: <TinyBLS381 as EngineBLS>::Scalar,
    public: DrandPublicKey,
}

impl LocalBeacon {
    /// A new beacon with a secret key drawn from `rng`.
    pub fn generate<R: RngCore + CryptoRng>(rng: &mut R) -> Self {
        let secret = TinyBLS381::generate(rng);
        let public =
            DrandPublicKey(<TinyBLS381 as EngineBLS>::PublicKeyGroup::generator() * secret);
        Self { secret, public }
    }

    /// The beacon's public key (what ciphertexts are encrypted under).
    pub fn public_key(&self) -> &DrandPublicKey {
        &self.public
    }

    /// The beacon's signature on `round` (48 bytes, compressed G1): the key that opens every
    /// ciphertext encrypted to that round under [`LocalBeacon::public_key`].
    pub fn sign(&self, round: u64) -> Vec<u8> {
        compressed(&round_identity(round).extract::<TinyBLS381>(self.secret).0)
    }
}

impl std::fmt::Debug for LocalBeacon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBeacon")
            .field("public", &hex::encode(self.public.to_bytes()))
            .finish_non_exhaustive()
    }
}

/// Whether `signature` is the beacon's BLS signature on `round` (drand's unchained G1 scheme:
/// `e(signature, g2) == e(H(sha256(round)), public_key)`).
///
/// # Errors
///
/// [`TimelockError::InvalidSignature`] for bytes that are not a G1 point.
pub fn verify_round_signature(
    public_key: &DrandPublicKey,
    round: u64,
    signature: &[u8],
) -> Result<bool, TimelockError> {
    let signature = parse_signature(signature)?;
    let generator = <TinyBLS381 as EngineBLS>::PublicKeyGroup::generator();
    let message = round_identity(round).public::<TinyBLS381>();
    Ok(TinyBLS381::pairing(generator, signature) == TinyBLS381::pairing(public_key.0, message))
}

fn parse_signature(
    bytes: &[u8],
) -> Result<<TinyBLS381 as EngineBLS>::SignatureGroup, TimelockError> {
    if bytes.len() != SIGNATURE_LEN {
        return Err(TimelockError::InvalidSignature(format!(
            "{} bytes, expected {SIGNATURE_LEN}",
            bytes.len()
        )));
    }
    <TinyBLS381 as EngineBLS>::SignatureGroup::deserialize_compressed(bytes)
        .map_err(|e| TimelockError::InvalidSignature(e.to_string()))
}

/// Reads arkworks-framed bytes with every length bounded by what is left.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], TimelockError> {
        if n > self.0.len() {
            return Err(TimelockError::MalformedCiphertext(format!(
                "{what}: truncated ({n} bytes needed, {} left)",
                self.0.len()
            )));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    /// A vector: u64 little-endian length, then that many bytes.
    fn vec(&mut self, what: &str) -> Result<&'a [u8], TimelockError> {
        let prefix = self.take(8, what)?;
        let mut len = [0u8; 8];
        len.copy_from_slice(prefix);
        let len = u64::from_le_bytes(len);
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        self.take(len, what)
    }

    fn finish(&self, what: &str) -> Result<(), TimelockError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(TimelockError::MalformedCiphertext(format!(
                "{} bytes after the end of {what}",
                self.0.len()
            )))
        }
    }
}

fn compressed<T: CanonicalSerialize>(value: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.compressed_size());
    // Writing into a Vec cannot fail.
    if value.serialize_compressed(&mut out).is_err() {
        out.clear();
    }
    out
}

/// A timelock ciphertext in the framing subtensor deserializes (the pinned `tle` revision's
/// `TLECiphertext`, its IBE header inlined): arkworks compressed serialization, vectors with a
/// u64 little-endian length prefix.
///
/// Parsing is by hand, not arkworks' `CanonicalDeserialize`: that reserves whatever a length
/// prefix claims before reading, so eight altered bytes would make it allocate exabytes and
/// abort the process. Here every length is checked against the bytes that are left, the AES-GCM
/// body's inner framing included (the crate deserializes it the arkworks way).
#[derive(Clone, Debug, PartialEq, Eq, CanonicalSerialize)]
pub struct SubtensorCiphertext {
    /// IBE `U = rP` (G2).
    pub u: <TinyBLS381 as EngineBLS>::PublicKeyGroup,
    /// IBE `V = sigma xor H2(e(Q_id, P_pub)^r)` (32 bytes).
    pub v: Vec<u8>,
    /// IBE `W = key xor H4(sigma)` (32 bytes).
    pub w: Vec<u8>,
    /// The message under AES-GCM: the serialized `{ciphertext, nonce}`.
    pub body: Vec<u8>,
    /// The symmetric cipher's name, `AES_GCM_`.
    pub cipher_suite: Vec<u8>,
}

impl SubtensorCiphertext {
    /// Parses `bytes` completely (trailing bytes are refused), checking `U` is a valid G2 point.
    ///
    /// # Errors
    ///
    /// [`TimelockError::MalformedCiphertext`].
    pub fn parse(bytes: &[u8]) -> Result<Self, TimelockError> {
        let mut reader = Reader(bytes);
        let u_bytes = reader.take(PUBLIC_KEY_LEN, "U")?;
        let u = <TinyBLS381 as EngineBLS>::PublicKeyGroup::deserialize_compressed(u_bytes)
            .map_err(|e| TimelockError::MalformedCiphertext(format!("U: {e}")))?;
        let v = reader.vec("V")?.to_vec();
        let w = reader.vec("W")?.to_vec();
        let body = reader.vec("body")?.to_vec();
        let cipher_suite = reader.vec("cipher suite")?.to_vec();
        reader.finish("the ciphertext")?;
        // The body is the AES-GCM output {ciphertext, nonce}, two more vectors.
        let mut inner = Reader(&body);
        inner.vec("the AES ciphertext")?;
        inner.vec("the AES nonce")?;
        inner.finish("the body")?;
        Ok(Self {
            u,
            v,
            w,
            body,
            cipher_suite,
        })
    }

    fn into_tle(self) -> Result<TLECiphertext<TinyBLS381>, TimelockError> {
        if self.cipher_suite != AESGCMBlockCipherProvider::CIPHER_SUITE {
            return Err(TimelockError::UnsupportedCipherSuite(
                String::from_utf8_lossy(&self.cipher_suite).into_owned(),
            ));
        }
        let part = |name: &str, bytes: Vec<u8>| -> Result<[u8; IBE_PART_LEN], TimelockError> {
            let len = bytes.len();
            bytes.try_into().map_err(|_| {
                TimelockError::MalformedCiphertext(format!(
                    "IBE part {name} has {len} bytes, expected {IBE_PART_LEN}"
                ))
            })
        };
        Ok(TLECiphertext {
            header: IbeCiphertext {
                u: self.u,
                v: part("V", self.v)?,
                w: part("W", self.w)?,
            },
            body: self.body,
            cipher_suite: self.cipher_suite,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    /// A published quicknet pulse: round 1000's signature (drand's `/public/1000` for the
    /// quicknet chain hash).
    const QUICKNET_ROUND_1000_SIGNATURE: &str = "b44679b9a59af2ec876b1a6b1ad52ea9b1615fc3982b19576350f93447cb1125e342b73a8dd2bacbe47e4b6b63ed5e39";

    struct TestBeacon {
        beacon: LocalBeacon,
        public: DrandPublicKey,
    }

    impl TestBeacon {
        fn new(seed: u64) -> Self {
            let beacon = LocalBeacon::generate(&mut StdRng::seed_from_u64(seed));
            let public = beacon.public_key().clone();
            Self { beacon, public }
        }

        fn sign(&self, round: u64) -> Vec<u8> {
            self.beacon.sign(round)
        }
    }

    /// Subtensor's commit-reveal epoch index under the modulo rule.
    fn epoch_index(netuid: u16, tempo: u16, block: u64) -> u64 {
        (block + u64::from(netuid) + 1) / (u64::from(tempo) + 1)
    }

    fn payload() -> WeightsTlockPayload {
        WeightsTlockPayload {
            hotkey: vec![7; 32],
            uids: vec![0, 3, 9],
            values: vec![65535, 1200, 7],
            version_key: 10_005_000,
        }
    }

    #[test]
    fn payload_encodes_in_subtensors_field_order() {
        let p = WeightsTlockPayload {
            hotkey: vec![1, 2, 3],
            uids: vec![1, 2],
            values: vec![65535, 7],
            version_key: 42,
        };
        let expected = hex::decode(concat!(
            "0c010203",         // hotkey: compact length 3, bytes
            "0801000200",       // uids: compact length 2, u16 LE
            "08ffff0700",       // values
            "2a00000000000000", // version_key: u64 LE
        ))
        .expect("hex");
        assert_eq!(p.encode(), expected);
        assert_eq!(WeightsTlockPayload::decode(&mut &expected[..]), Ok(p));
    }

    #[test]
    fn first_reveal_block_is_the_first_block_of_the_reveal_epoch() {
        // Hand-checked: netuid 1, tempo 360, block 1000: epoch (1000+2)/361 = 2, reveal epoch 3,
        // whose first block is 3*361 - 2 = 1081.
        assert_eq!(first_reveal_block(1, 360, 1000, 1), 1081);
        // netuid 0, tempo 10: block 10 is in epoch 11/11 = 1, block 9 in epoch 0.
        assert_eq!(first_reveal_block(0, 10, 10, 2), 32);
        assert_eq!(first_reveal_block(0, 10, 9, 2), 21);
        // Against the chain's epoch index, across the schedule.
        for netuid in [0u16, 1, 9, 4097] {
            for tempo in [1u16, 10, 360] {
                for period in [1u64, 2, 5] {
                    for block in 0..1_500u64 {
                        let first = first_reveal_block(netuid, tempo, block, period);
                        let epoch = epoch_index(netuid, tempo, block);
                        assert_eq!(epoch_index(netuid, tempo, first), epoch + period);
                        if first > 0 {
                            assert_eq!(epoch_index(netuid, tempo, first - 1), epoch + period - 1);
                        }
                    }
                }
            }
        }
        assert_eq!(first_reveal_block(1, 360, u64::MAX, u64::MAX), u64::MAX - 2);
    }

    #[test]
    fn reveal_round_matches_hand_checked_values() {
        let genesis = 1_692_803_367.0;
        // 84 blocks (to 1081 + 3) of 12 s after genesis + 3000 s: (3000 + 1008) / 3 = 1336.
        let timing = CommitTiming {
            current_block: 1000,
            first_reveal_block: first_reveal_block(1, 360, 1000, 1),
            block_time_secs: 12.0,
            now_unix_secs: genesis + 3000.0,
        };
        assert_eq!(reveal_round(&timing, &DrandSchedule::QUICKNET), Ok(1336));
        // Rounded down: 25 blocks of 0.25 s after genesis + 100.5 s is 106.75 s: round 35.
        let timing = CommitTiming {
            current_block: 10,
            first_reveal_block: first_reveal_block(0, 10, 10, 2),
            block_time_secs: 0.25,
            now_unix_secs: genesis + 100.5,
        };
        assert_eq!(reveal_round(&timing, &DrandSchedule::QUICKNET), Ok(35));
        // One block earlier the reveal epoch is one earlier: 15 blocks, 104.25 s, round 34.
        let timing = CommitTiming {
            current_block: 9,
            first_reveal_block: first_reveal_block(0, 10, 9, 2),
            ..timing
        };
        assert_eq!(reveal_round(&timing, &DrandSchedule::QUICKNET), Ok(34));
        // A finney-sized case: 2024-12-01 00:00:00 UTC, 300 blocks of 12 s ahead.
        let timing = CommitTiming {
            current_block: 4_000_000,
            first_reveal_block: 4_000_297,
            block_time_secs: 12.0,
            now_unix_secs: 1_733_011_200.0,
        };
        // (1733011200 - 1692803367 + 3600) / 3 = 13_403_811.
        assert_eq!(
            reveal_round(&timing, &DrandSchedule::QUICKNET),
            Ok(13_403_811)
        );
        // A reveal block already passed targets the current round; before genesis, round 1.
        let timing = CommitTiming {
            current_block: 5_000,
            first_reveal_block: 10,
            block_time_secs: 12.0,
            now_unix_secs: genesis + 30.0,
        };
        assert_eq!(reveal_round(&timing, &DrandSchedule::QUICKNET), Ok(10));
        let timing = CommitTiming {
            now_unix_secs: 0.0,
            ..timing
        };
        assert_eq!(reveal_round(&timing, &DrandSchedule::QUICKNET), Ok(1));
    }

    #[test]
    fn unusable_timing_is_refused() {
        let good = CommitTiming {
            current_block: 1,
            first_reveal_block: 2,
            block_time_secs: 12.0,
            now_unix_secs: 1_700_000_000.0,
        };
        for timing in [
            CommitTiming {
                block_time_secs: 0.0,
                ..good
            },
            CommitTiming {
                block_time_secs: -1.0,
                ..good
            },
            CommitTiming {
                block_time_secs: f64::NAN,
                ..good
            },
            CommitTiming {
                now_unix_secs: f64::INFINITY,
                ..good
            },
        ] {
            assert!(matches!(
                reveal_round(&timing, &DrandSchedule::QUICKNET),
                Err(TimelockError::InvalidTiming(_))
            ));
        }
        let stopped = DrandSchedule {
            genesis_time: 0,
            period_secs: 0,
        };
        assert!(matches!(
            reveal_round(&good, &stopped),
            Err(TimelockError::InvalidTiming(_))
        ));
    }

    #[test]
    fn the_quicknet_key_parses_and_verifies_a_published_round() {
        let key = DrandPublicKey::quicknet();
        assert_eq!(hex::encode(key.to_bytes()), QUICKNET_PUBLIC_KEY_HEX);
        let signature = hex::decode(QUICKNET_ROUND_1000_SIGNATURE).expect("hex");
        assert_eq!(verify_round_signature(&key, 1000, &signature), Ok(true));
        assert_eq!(verify_round_signature(&key, 1001, &signature), Ok(false));
    }

    #[test]
    fn a_test_beacon_signs_rounds_as_quicknet_does() {
        let beacon = TestBeacon::new(1);
        let signature = beacon.sign(77);
        assert_eq!(signature.len(), SIGNATURE_LEN);
        assert_eq!(
            verify_round_signature(&beacon.public, 77, &signature),
            Ok(true)
        );
        assert_eq!(
            verify_round_signature(&beacon.public, 78, &signature),
            Ok(false)
        );
        assert_eq!(
            verify_round_signature(&TestBeacon::new(2).public, 77, &signature),
            Ok(false)
        );
    }

    #[test]
    fn encrypt_then_decrypt_with_the_rounds_signature_round_trips() {
        let beacon = TestBeacon::new(3);
        let plaintext = payload().encode();
        let mut rng = StdRng::seed_from_u64(4);
        let ct = encrypt_for_round(&plaintext, 1234, &beacon.public, &mut rng).expect("encrypts");
        let opened = decrypt_with_signature(&ct, &beacon.sign(1234)).expect("decrypts");
        assert_eq!(opened, plaintext);
        assert_eq!(WeightsTlockPayload::decode(&mut &opened[..]), Ok(payload()));
        // Fresh randomness each time: two encryptions of the same payload differ.
        let again =
            encrypt_for_round(&plaintext, 1234, &beacon.public, &mut rng).expect("encrypts");
        assert_ne!(ct, again);
        // Empty plaintext too.
        let empty = encrypt_for_round(&[], 5, &beacon.public, &mut rng).expect("encrypts");
        assert_eq!(decrypt_with_signature(&empty, &beacon.sign(5)), Ok(vec![]));
    }

    #[test]
    fn a_ciphertext_to_quicknet_opens_with_the_published_signature() {
        let plaintext = payload().encode();
        let ct = encrypt_for_round(
            &plaintext,
            1000,
            &DrandPublicKey::quicknet(),
            &mut StdRng::seed_from_u64(5),
        )
        .expect("encrypts");
        let signature = hex::decode(QUICKNET_ROUND_1000_SIGNATURE).expect("hex");
        assert_eq!(decrypt_with_signature(&ct, &signature), Ok(plaintext));
    }

    /// The layout subtensor's `tle` deserializes: U (96), then V, W, body and cipher suite, each
    /// with a u64 little-endian length. The maintained crate's own serialization drops the
    /// prefixes of V and W; this pins that the client does not send that.
    #[test]
    fn ciphertexts_are_framed_as_subtensor_reads_them() {
        let beacon = TestBeacon::new(6);
        let plaintext = b"seventeen bytes!!";
        let ct = encrypt_for_round(plaintext, 9, &beacon.public, &mut StdRng::seed_from_u64(7))
            .expect("encrypts");
        let len_at = |at: usize| u64::from_le_bytes(ct[at..at + 8].try_into().expect("8 bytes"));
        assert_eq!(len_at(96), 32, "V's length prefix");
        assert_eq!(len_at(136), 32, "W's length prefix");
        // Body: the serialized AES-GCM output, {ciphertext + 16-byte tag, 12-byte nonce}.
        let body_len = plaintext.len() + 16 + 8 + 12 + 8;
        assert_eq!(len_at(176), body_len as u64, "body's length prefix");
        let suite_at = 184 + body_len;
        assert_eq!(len_at(suite_at), 8, "cipher suite's length prefix");
        assert_eq!(&ct[suite_at + 8..], b"AES_GCM_");
        assert_eq!(ct.len(), plaintext.len() + 244);
    }

    #[test]
    fn another_rounds_or_beacons_signature_is_refused() {
        let beacon = TestBeacon::new(8);
        let ct = encrypt_for_round(
            b"weights",
            500,
            &beacon.public,
            &mut StdRng::seed_from_u64(9),
        )
        .expect("encrypts");
        assert_eq!(
            decrypt_with_signature(&ct, &beacon.sign(499)),
            Err(TimelockError::WrongSignature)
        );
        assert_eq!(
            decrypt_with_signature(&ct, &TestBeacon::new(10).sign(500)),
            Err(TimelockError::WrongSignature)
        );
        let message = TimelockError::WrongSignature.to_string();
        assert!(
            message.contains("not the drand signature of the round"),
            "{message}"
        );
        // Bytes that are not a signature at all.
        assert!(matches!(
            decrypt_with_signature(&ct, &[0u8; 47]),
            Err(TimelockError::InvalidSignature(_))
        ));
        assert!(matches!(
            decrypt_with_signature(&ct, &[0xffu8; 48]),
            Err(TimelockError::InvalidSignature(_))
        ));
    }

    #[test]
    fn corrupt_ciphertexts_are_refused() {
        let beacon = TestBeacon::new(11);
        let signature = beacon.sign(42);
        let ct = encrypt_for_round(
            b"weights",
            42,
            &beacon.public,
            &mut StdRng::seed_from_u64(12),
        )
        .expect("encrypts");
        assert!(decrypt_with_signature(&ct, &signature).is_ok());

        let malformed = |bytes: &[u8]| {
            matches!(
                decrypt_with_signature(bytes, &signature),
                Err(TimelockError::MalformedCiphertext(_))
            )
        };
        assert!(malformed(&[]));
        assert!(malformed(&ct[..ct.len() - 1]), "truncated");
        assert!(malformed(&[ct.as_slice(), &[0]].concat()), "trailing byte");
        assert!(malformed(&ct[..100]), "header only");
        let mut bad_point = ct.clone();
        bad_point[..96].fill(0xff);
        assert!(malformed(&bad_point), "U not a point");

        // An altered W: the IBE consistency check fails.
        let mut bad_header = ct.clone();
        bad_header[150] ^= 1;
        assert_eq!(
            decrypt_with_signature(&bad_header, &signature),
            Err(TimelockError::WrongSignature)
        );
        // An altered AES ciphertext: the key is right, the tag does not verify.
        let mut bad_body = ct.clone();
        bad_body[192] ^= 1;
        assert_eq!(
            decrypt_with_signature(&bad_body, &signature),
            Err(TimelockError::CorruptBody)
        );

        // Length prefixes claiming more than there is (V's, and the body's inner AES ciphertext's)
        // are refused before anything is allocated for them.
        for at in [96, 184] {
            let mut huge = ct.clone();
            huge[at..at + 8].copy_from_slice(&(u64::MAX / 3).to_le_bytes());
            assert!(malformed(&huge), "length prefix at {at}");
        }
        let mut wire = SubtensorCiphertext::parse(&ct).expect("parses");
        wire.body.push(0);
        assert!(
            malformed(&compressed(&wire)),
            "a byte after the body's framing"
        );

        // Well-framed but wrong contents.
        let mut wire = SubtensorCiphertext::parse(&ct).expect("parses");
        wire.cipher_suite = b"CHACHA20".to_vec();
        assert!(matches!(
            decrypt_with_signature(&compressed(&wire), &signature),
            Err(TimelockError::UnsupportedCipherSuite(s)) if s == "CHACHA20"
        ));
        let mut wire = SubtensorCiphertext::parse(&ct).expect("parses");
        wire.v.pop();
        assert!(matches!(
            decrypt_with_signature(&compressed(&wire), &signature),
            Err(TimelockError::MalformedCiphertext(m)) if m.contains("V has 31 bytes")
        ));
        let mut wire = SubtensorCiphertext::parse(&ct).expect("parses");
        wire.body.truncate(3);
        assert!(matches!(
            decrypt_with_signature(&compressed(&wire), &signature),
            Err(TimelockError::MalformedCiphertext(_))
        ));
    }

    #[test]
    fn public_keys_are_checked() {
        assert!(matches!(
            DrandPublicKey::from_bytes(&[0u8; 95]),
            Err(TimelockError::InvalidPublicKey(_))
        ));
        assert!(matches!(
            DrandPublicKey::from_bytes(&[0xffu8; 96]),
            Err(TimelockError::InvalidPublicKey(_))
        ));
        let beacon = TestBeacon::new(13);
        assert_eq!(
            DrandPublicKey::from_bytes(&beacon.public.to_bytes()),
            Ok(beacon.public.clone())
        );
    }
}
