//! Signature verification of signed requests, in batches.
//!
//! sr25519 verification was the largest single cost of a signed request. Requests that arrive
//! together are verified with one batch equation (see `batch_holds`: random 128-bit
//! coefficients from the thread's CSPRNG), which costs about a third as much per signature as
//! verifying each. A batch holds iff every signature in it does (but for a chance of about
//! 2^-128), so the answer is the same as one verification each.
//!
//! A failed batch says only that some signature in it is bad; each is then verified alone. So that
//! forged signatures cannot make every batch pay twice, batching pauses for [`BATCH_PAUSE`] after a
//! failed batch: under such an attack the cost is one verification per request, as without
//! batching, plus one wasted batch per pause.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use iota_chain::wallet::PublicKey;
use iota_protocol::AuthError;
use iota_protocol::signing::{SignedMessage, VerifiedRequest, decode_signer};

use crate::batch::{Batcher, Flush};

/// Most signatures in one batch. Per signature (one thread of this project's 2-core machine):
/// alone 36 us, batches of 16-64 15-16 us, 128 12.9 us, 256 12.1 us, 1,024 11.5 us (the
/// multiscalar product switches to Pippenger's method above about 95 signatures).
const MAX_BATCH: usize = 1024;
/// Batches being verified at once (each on a blocking thread). Two: with one, the load benchmark
/// served about 5% fewer signed polls although its batches were twice as large (three alternating
/// pairs: 44.0, 44.1 and 43.8% of the no-op against 46.1, 45.0 and 47.4%); with four, batches
/// shrank to about 35 and the share fell to 45.7%.
const MAX_FLUSHES: usize = 2;
/// How long batching stays off after a batch failed.
const BATCH_PAUSE: Duration = Duration::from_secs(1);
/// Most decompressed keys kept (the cache is emptied when full, so a flood of new keys costs at
/// most this much memory); a subnet has far fewer hotkeys.
const MAX_KEYS: usize = 4096;

/// Why a signature could not be verified (the request must not proceed).
#[derive(Clone, Debug, thiserror::Error)]
pub enum VerifyError {
    /// The signature does not verify.
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// The verifier is gone (the server is shutting down).
    #[error("signature verifier stopped")]
    Stopped,
}

struct Verify {
    started: Instant,
    /// Milliseconds after `started` until which batching is off (0: on).
    paused_until_ms: AtomicU64,
    /// Public keys decompressed once: decompression was about a fifth of a batch's cost per
    /// signature, and the same few hotkeys sign every request. A pure function of the bytes, so
    /// a cached key answers exactly what decompressing again would.
    keys: Arc<KeyCache>,
}

/// Decompressed sr25519 public keys by their bytes, bounded by [`MAX_KEYS`].
#[derive(Default)]
struct KeyCache(Mutex<HashMap<[u8; 32], schnorrkel::PublicKey>>);

impl KeyCache {
    /// The keys of `signers` in order, or `None` if one is not a valid point.
    fn get_all<'a>(
        &self,
        signers: impl ExactSizeIterator<Item = &'a [u8; 32]>,
    ) -> Option<Vec<schnorrkel::PublicKey>> {
        let mut keys = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::with_capacity(signers.len());
        for bytes in signers {
            let key = match keys.get(bytes) {
                Some(key) => *key,
                None => {
                    let key = schnorrkel::PublicKey::from_bytes(bytes).ok()?;
                    if keys.len() >= MAX_KEYS {
                        keys.clear();
                    }
                    keys.insert(*bytes, key);
                    key
                }
            };
            out.push(key);
        }
        Some(out)
    }
}

/// A request's signer: its public key and canonical address (prefix 42, as the run's tables
/// name miners).
#[derive(Clone, Debug)]
pub struct Signer {
    /// Public key.
    pub key: PublicKey,
    /// SS58 address, prefix 42.
    pub ss58: Arc<str>,
}

/// Signers by their `Epistula-Signed-By` text, decoded once: an address costs a base-58 decode and
/// a BLAKE2b checksum to read and as much again to write canonically, on every request, for the
/// same few hotkeys. Only addresses that decode are kept, and at most [`MAX_KEYS`] of them (the
/// map is emptied when full).
#[derive(Default)]
pub struct Signers(RwLock<HashMap<String, Signer>>);

impl Signers {
    /// The signer `signed_by` names, or why it names none.
    pub fn resolve(&self, signed_by: &str) -> Result<Signer, AuthError> {
        if let Some(signer) = self
            .0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(signed_by)
        {
            return Ok(signer.clone());
        }
        let key = PublicKey::from_bytes(decode_signer(signed_by)?);
        let signer = Signer {
            key,
            ss58: key.ss58().into(),
        };
        let mut signers = self.0.write().unwrap_or_else(|e| e.into_inner());
        if signers.len() >= MAX_KEYS {
            signers.clear();
        }
        signers.insert(signed_by.to_owned(), signer.clone());
        Ok(signer)
    }
}

impl Verify {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn batching(&self) -> bool {
        self.now_ms() >= self.paused_until_ms.load(Ordering::Relaxed)
    }

    fn pause_batching(&self) {
        let until = self.now_ms() + BATCH_PAUSE.as_millis() as u64;
        self.paused_until_ms.store(until, Ordering::Relaxed);
    }
}

/// Whether every signature of `batch` verifies, by one batch equation. sr25519 verification
/// checks `s·B = R + k·A` for each signature (`k` its challenge, from the transcript of context,
/// message, key and `R`); with independent random 128-bit `z`, the batch checks
/// `Σ z·R + Σ (z·k)·A − (Σ z·s)·B = 0`, which a bad signature passes with probability about
/// 2^-128. Malformed keys or signatures fail the batch.
///
/// schnorrkel's own batch check derives the `z` from a second transcript over every key,
/// signature and message (a third of its cost per signature here); these come from the thread's
/// CSPRNG, which is what the equation needs: coefficients the sender cannot predict.
fn batch_holds(batch: &[SignedMessage], keys: &KeyCache) -> bool {
    use curve25519_dalek::ristretto::CompressedRistretto;
    use curve25519_dalek::traits::{IsIdentity, VartimeMultiscalarMul};
    use curve25519_dalek::{RistrettoPoint, Scalar, constants::RISTRETTO_BASEPOINT_POINT};
    use rand::Rng;
    use schnorrkel::context::SigningTranscript;

    let Some(publics) = keys.get_all(batch.iter().map(|m| &m.request.signer)) else {
        return false;
    };
    let context = schnorrkel::signing_context(b"substrate");
    let mut rng = rand::thread_rng();
    let mut scalars = Vec::with_capacity(2 * batch.len() + 1);
    let mut points = Vec::with_capacity(2 * batch.len() + 1);
    let mut basepoint = Scalar::ZERO;
    for (m, public) in batch.iter().zip(&publics) {
        // What schnorrkel's parse accepts: the sr25519 marker bit set, and `s` (without it)
        // fully reduced.
        let mut r = [0u8; 32];
        let mut s = [0u8; 32];
        r.copy_from_slice(&m.signature[..32]);
        s.copy_from_slice(&m.signature[32..]);
        if s[31] & 0x80 == 0 {
            return false;
        }
        s[31] &= 0x7f;
        let r = CompressedRistretto(r);
        let (Some(r_point), Some(s)) = (
            r.decompress(),
            Option::<Scalar>::from(Scalar::from_canonical_bytes(s)),
        ) else {
            return false;
        };
        let mut t = context.bytes(m.message.as_bytes());
        t.proto_name(b"Schnorr-sig");
        t.commit_point(b"sign:pk", public.as_compressed());
        t.commit_point(b"sign:R", &r);
        let k = t.challenge_scalar(b"sign:c");
        let z = Scalar::from(rng.r#gen::<u128>());
        basepoint -= z * s;
        scalars.push(z);
        points.push(r_point);
        scalars.push(z * k);
        points.push(*public.as_point());
    }
    scalars.push(basepoint);
    points.push(RISTRETTO_BASEPOINT_POINT);
    RistrettoPoint::vartime_multiscalar_mul(scalars, points).is_identity()
}

impl Flush for Verify {
    type Item = SignedMessage;
    type Output = Result<VerifiedRequest, VerifyError>;

    async fn flush(&self, batch: Vec<SignedMessage>) -> Vec<Self::Output> {
        metrics::histogram!("iota_signature_batch_size").record(batch.len() as f64);
        let batching = batch.len() > 1 && self.batching();
        let keys = self.keys.clone();
        let verified = tokio::task::spawn_blocking(move || {
            if batching && batch_holds(&batch, &keys) {
                return (batch.into_iter().map(|m| Ok(m.request)).collect(), false);
            }
            (
                batch
                    .into_iter()
                    .map(|m| m.verify().map_err(VerifyError::from))
                    .collect::<Vec<_>>(),
                batching,
            )
        })
        .await;
        match verified {
            Ok((outputs, batch_failed)) => {
                if batch_failed {
                    metrics::counter!("iota_signature_batches_failed_total").increment(1);
                    self.pause_batching();
                }
                outputs
            }
            // The blocking pool is gone: shutting down.
            Err(_) => Vec::new(),
        }
    }
}

/// The signature verifier of every signed request.
pub struct SignatureVerifier {
    batcher: Batcher<Verify>,
}

impl Default for SignatureVerifier {
    fn default() -> Self {
        Self {
            batcher: Batcher::new(
                Verify {
                    started: Instant::now(),
                    paused_until_ms: AtomicU64::new(0),
                    keys: Arc::default(),
                },
                MAX_BATCH,
                MAX_FLUSHES,
            ),
        }
    }
}

impl SignatureVerifier {
    /// Verifies `signed`'s signature (with whatever else is waiting).
    pub async fn verify(&self, signed: SignedMessage) -> Result<VerifiedRequest, VerifyError> {
        self.batcher
            .submit(signed)
            .await
            .map_err(|_| VerifyError::Stopped)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iota_protocol::signing::{SkewWindow, check_request, find_header, sign_request};
    use sp_core::{Pair as _, sr25519};

    fn signed(seed: u8, body: &[u8]) -> SignedMessage {
        let pair = sr25519::Pair::from_seed(&[seed; 32]);
        let receiver = sr25519::Pair::from_seed(&[200; 32]).public().to_string();
        let headers = sign_request(
            &pair,
            &receiver,
            "POST",
            "/v1/miner/work",
            body,
            1_000,
            uuid::Uuid::new_v4(),
        )
        .headers;
        check_request(
            |name| find_header(&headers, name),
            "POST",
            "/v1/miner/work",
            body,
            &receiver,
            1_000,
            SkewWindow::default(),
        )
        .expect("well-formed")
    }

    #[test]
    fn a_batch_holds_only_if_every_signature_does() {
        let good: Vec<SignedMessage> = (1..=8).map(|i| signed(i, b"{}")).collect();
        // One cache throughout: the spoiled batches are judged with keys already decompressed.
        let keys = KeyCache::default();
        assert!(batch_holds(&good, &keys));
        assert!(
            batch_holds(&good, &keys),
            "cached keys refused a good batch"
        );
        // Each way of spoiling one member: another message, another key, another signature, the
        // sr25519 marker bit cleared (an ed25519-style signature), `s` not reduced (`s + l`
        // would pass an equation that reduces it), `R` not a point.
        for spoil in 0..6 {
            let mut batch = good.clone();
            match spoil {
                0 => batch[3].message.push('x'),
                1 => batch[3].request.signer = good[4].request.signer,
                2 => batch[3].signature = good[4].signature,
                3 => batch[3].signature[63] &= 0x7f,
                4 => {
                    // l, the group order, added to s (little-endian), marker kept.
                    const L: [u8; 32] = [
                        0xed, 0xd3, 0xf5, 0x5c, 0x1a, 0x63, 0x12, 0x58, 0xd6, 0x9c, 0xf7, 0xa2,
                        0xde, 0xf9, 0xde, 0x14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10,
                    ];
                    let sig = &mut batch[3].signature;
                    let marker = sig[63] & 0x80;
                    sig[63] &= 0x7f;
                    let mut carry = 0u16;
                    for (b, l) in sig[32..].iter_mut().zip(L) {
                        let sum = u16::from(*b) + u16::from(l) + carry;
                        *b = sum as u8;
                        carry = sum >> 8;
                    }
                    sig[63] |= marker;
                }
                _ => batch[3].signature[..32].fill(0xff),
            }
            assert!(!batch_holds(&batch, &keys), "spoiled member {spoil} passed");
            // Each spoiled signature also fails on its own, so batching changes no verdict.
            assert!(
                batch[3].clone().verify().is_err(),
                "spoil {spoil} verifies alone"
            );
        }
    }

    #[test]
    fn the_key_cache_is_bounded_and_refuses_invalid_points() {
        let keys = KeyCache::default();
        let signers: Vec<[u8; 32]> = (0..MAX_KEYS + 10)
            .map(|i| {
                let mut seed = [7u8; 32];
                seed[..8].copy_from_slice(&(i as u64).to_le_bytes());
                sr25519::Pair::from_seed(&seed).public().0
            })
            .collect();
        let got = keys.get_all(signers.iter()).expect("valid keys");
        assert_eq!(got.len(), signers.len());
        assert_eq!(got[MAX_KEYS + 9].to_bytes(), signers[MAX_KEYS + 9]);
        let held = keys.0.lock().expect("lock").len();
        assert!(held <= MAX_KEYS, "{held} keys held");
        // Not a point's encoding: refused, cached or not.
        let invalid = [0xffu8; 32];
        assert!(keys.get_all([&signers[0], &invalid].into_iter()).is_none());
        assert!(keys.get_all([&invalid].into_iter()).is_none());
    }

    #[test]
    fn signers_are_decoded_once_and_named_canonically() {
        use sp_core::crypto::{Ss58AddressFormat, Ss58Codec};
        let public = sr25519::Pair::from_seed(&[3; 32]).public();
        let generic = public.to_ss58check();
        let polkadot = public.to_ss58check_with_version(Ss58AddressFormat::custom(0));
        assert_ne!(generic, polkadot);
        let signers = Signers::default();
        for address in [&generic, &polkadot, &generic] {
            let signer = signers.resolve(address).expect("a valid address");
            assert_eq!(signer.key.to_bytes(), public.0);
            assert_eq!(
                &*signer.ss58,
                generic.as_str(),
                "not canonical for {address}"
            );
        }
        assert_eq!(signers.0.read().expect("lock").len(), 2);
        let mut corrupt = generic.clone();
        corrupt.pop();
        corrupt.push(if generic.ends_with('a') { 'b' } else { 'a' });
        for bad in ["", "not an address", corrupt.as_str()] {
            assert!(
                matches!(signers.resolve(bad), Err(AuthError::MalformedHeader { .. })),
                "{bad:?} resolved"
            );
        }
        // Bounded: a flood of valid addresses never holds more than MAX_KEYS.
        for i in 0..MAX_KEYS + 10 {
            let mut seed = [9u8; 32];
            seed[..8].copy_from_slice(&(i as u64).to_le_bytes());
            let address = sr25519::Pair::from_seed(&seed).public().to_ss58check();
            signers.resolve(&address).expect("valid");
        }
        assert!(signers.0.read().expect("lock").len() <= MAX_KEYS);
    }

    #[tokio::test]
    async fn concurrent_requests_get_their_own_verdicts() {
        let verifier = std::sync::Arc::new(SignatureVerifier::default());
        let mut tasks = Vec::new();
        for i in 0..40u8 {
            let mut m = signed(1 + i % 7, format!("{{\"n\":{i}}}").as_bytes());
            let forged = i % 5 == 0;
            if forged {
                m.signature[10] ^= 1;
            }
            let verifier = verifier.clone();
            tasks.push(tokio::spawn(
                async move { (forged, verifier.verify(m).await) },
            ));
        }
        let mut accepted = 0;
        for t in tasks {
            let (forged, verdict) = t.await.expect("task");
            match verdict {
                Ok(_) => {
                    assert!(!forged, "a forged signature was accepted");
                    accepted += 1;
                }
                Err(e) => {
                    assert!(forged, "a good signature was refused: {e}");
                    assert!(matches!(e, VerifyError::Auth(AuthError::BadSignature)));
                }
            }
        }
        assert_eq!(accepted, 32);
    }
}
