//! Signature verification of signed requests, in batches.
//!
//! sr25519 verification was the largest single cost of a signed request. Requests that arrive
//! together are verified with one batch equation (see `batch_holds`: random 128-bit odd
//! coefficients from the thread's CSPRNG), which costs about a third as much per signature as
//! verifying each. A batch holds iff every signature in it does (but for a chance of about
//! 2^-128), so the answer is the same as one verification each.
//!
//! A failed batch says only that some signature in it is bad; each is then verified alone. So that
//! forged signatures cannot make every batch pay twice, batching pauses for [`BATCH_PAUSE`] after a
//! failed batch: under such an attack the cost is one verification per request, as without
//! batching, plus one wasted batch per pause.
//!
//! Batches are checked in the batcher's own tasks, on the runtime's threads (see `Verify::flush`
//! for why not on blocking threads). A request that arrives alone (a fleet polling at an idle
//! pace) is checked at once in its own task; see [`SignatureVerifier::verify`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use curve25519_dalek::RistrettoPoint;
use curve25519_dalek::Scalar;
use curve25519_dalek::ristretto::CompressedRistretto;
use iota_chain::wallet::PublicKey;
use iota_protocol::AuthError;
use iota_protocol::signing::{SignedMessage, VerifiedRequest, decode_signer};

use crate::batch::{Batcher, Flush};

/// Most signatures in one batch. A batch is checked on one of the runtime's threads, which
/// serves nothing else meanwhile: 128 holds it for about 1.3 ms (about 3 ms when a failed batch
/// is checked one by one). Larger batches gained little per signature (curve25519-dalek 4's
/// AVX2 backend, one thread of this project's 2-core machine: alone 36 us, batches of 16-64
/// 15-16 us, 128 12.9 us, 256 12.1 us, 1,024 11.5 us), and checked at once as they are (after the
/// batcher's one yield, see `batch`), the load benchmark's batches at half the no-op ceiling
/// averaged 14-48 signatures.
const MAX_BATCH: usize = 128;
/// Batches being verified at once, each in its own task: this many, or one per worker thread of
/// the runtime where it has more. Measured on a 2-core machine (a runtime of two workers): with
/// one, the load benchmark served about 5% fewer signed polls although its batches were twice as
/// large (three alternating pairs: 44.0, 44.1 and 43.8% of the no-op against 46.1, 45.0 and
/// 47.4%, batches then on blocking threads); with four, batches shrank to about 35 and the share
/// fell to 45.7%. Two alone would cap a many-core orchestrator's signature checks at two cores.
const MAX_FLUSHES: usize = 2;
/// Signatures that must be waiting before a second batch starts beside one being verified. At a
/// steady pace (half the ceiling, polls spread evenly) the two slots otherwise split the arrivals
/// into smaller batches, each paying a product of a few points. A backlog this size (about
/// 0.3 ms of work) still brings in the second core when requests pile up, under load or when
/// forged signatures are each checked alone.
const PARALLEL_FROM: usize = 32;
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
struct KeyCache(Mutex<HashMap<[u8; 32], RistrettoPoint>>);

impl KeyCache {
    /// The keys of `signers` in order, or `None` if one is not a valid point.
    fn get_all<'a>(
        &self,
        signers: impl ExactSizeIterator<Item = &'a [u8; 32]>,
    ) -> Option<Vec<RistrettoPoint>> {
        let mut keys = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::with_capacity(signers.len());
        for bytes in signers {
            let key = match keys.get(bytes) {
                Some(key) => *key,
                None => {
                    // What schnorrkel's `PublicKey::from_bytes` accepts: a canonical Ristretto
                    // encoding.
                    let key = CompressedRistretto(*bytes).decompress()?;
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
/// CSPRNG, which is what the equation needs: coefficients the sender cannot predict. The
/// transcript is schnorrkel's; the group arithmetic is curve25519-dalek 5's, whose multiscalar
/// product has an AVX-512 IFMA backend, chosen at run time where the processor has it (see
/// `.cargo/config.toml`): on this project's machine it took the product from about 8 to 3.4 us
/// per signature.
fn batch_holds(batch: &[SignedMessage], keys: &KeyCache) -> bool {
    use curve25519_dalek::constants::RISTRETTO_BASEPOINT_POINT;
    use curve25519_dalek::traits::{IsIdentity, VartimeMultiscalarMul};
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
        let (Some(r_point), Some(s)) = (
            CompressedRistretto(r).decompress(),
            Option::<Scalar>::from(Scalar::from_canonical_bytes(s)),
        ) else {
            return false;
        };
        // schnorrkel's verification transcript: `commit_point` commits the compressed bytes,
        // `challenge_scalar` reduces 64 challenge bytes.
        let mut t = context.bytes(m.message.as_bytes());
        t.proto_name(b"Schnorr-sig");
        SigningTranscript::commit_bytes(&mut t, b"sign:pk", &m.request.signer);
        SigningTranscript::commit_bytes(&mut t, b"sign:R", &r);
        let mut challenge = [0u8; 64];
        SigningTranscript::challenge_bytes(&mut t, b"sign:c", &mut challenge);
        let k = Scalar::from_bytes_mod_order_wide(&challenge);
        // Odd, so never zero: a zero coefficient would drop its signature from the equation.
        let z = Scalar::from(rng.r#gen::<u128>() | 1);
        basepoint -= z * s;
        scalars.push(z);
        points.push(r_point);
        scalars.push(z * k);
        points.push(*public);
    }
    scalars.push(basepoint);
    points.push(RISTRETTO_BASEPOINT_POINT);
    RistrettoPoint::vartime_multiscalar_mul(scalars, points).is_identity()
}

/// One signature's verdict: the equation with one term is its verification (what schnorrkel
/// checks, with the faster arithmetic), so the verdict is final.
fn alone(m: SignedMessage, keys: &KeyCache) -> Result<VerifiedRequest, VerifyError> {
    if batch_holds(std::slice::from_ref(&m), keys) {
        Ok(m.request)
    } else {
        Err(VerifyError::Auth(AuthError::BadSignature))
    }
}

impl Flush for Verify {
    type Item = SignedMessage;
    type Output = Result<VerifiedRequest, VerifyError>;

    async fn flush(&self, batch: Vec<SignedMessage>) -> Vec<Self::Output> {
        metrics::histogram!("iota_signature_batch_size").record(batch.len() as f64);
        // Checked here, in the flush's task, not on a blocking thread. A blocking thread put two
        // more thread hand-offs on every request's path, and with every core busy each could
        // wait for a scheduler time slice. In the load benchmark at half the no-op ceiling
        // (rounds alternating in one process, 13 each), the signed poll's p99 stayed under 50 ms
        // in 12 rounds checked here against 6 on a blocking thread (medians 19.3 and 51.3 ms),
        // with the machine as busy (1.64 and 1.62 of 2 cores on average) although batches were
        // 3-4 signatures against 12-20.
        let batching = batch.len() > 1 && self.batching();
        if batching && batch_holds(&batch, &self.keys) {
            return batch.into_iter().map(|m| Ok(m.request)).collect();
        }
        let verdicts = batch.into_iter().map(|m| alone(m, &self.keys)).collect();
        if batching {
            metrics::counter!("iota_signature_batches_failed_total").increment(1);
            self.pause_batching();
        }
        verdicts
    }
}

/// The signature verifier of every signed request.
pub struct SignatureVerifier {
    batcher: Batcher<Verify>,
    /// The verifier's keys (shared with the batches).
    keys: Arc<KeyCache>,
    /// Requests being verified now, alone or in the batcher.
    active: AtomicUsize,
}

impl Default for SignatureVerifier {
    fn default() -> Self {
        let keys = Arc::<KeyCache>::default();
        Self {
            batcher: Batcher::new(
                Verify {
                    started: Instant::now(),
                    paused_until_ms: AtomicU64::new(0),
                    keys: keys.clone(),
                },
                MAX_BATCH,
                MAX_FLUSHES,
            )
            .parallel_from(PARALLEL_FROM)
            .a_flush_per_worker(),
            keys,
            active: AtomicUsize::new(0),
        }
    }
}

/// Counts a request in [`SignatureVerifier::active`] until it is answered or dropped.
struct Active<'a>(&'a AtomicUsize);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl SignatureVerifier {
    /// Verifies `signed`'s signature (with whatever else is waiting).
    ///
    /// A request that finds no other being verified, and still none after letting the tasks
    /// that are ready run (they may carry requests too), has nothing to be batched with: it is
    /// checked in the caller's task, without the hand-offs to the batch writer and back.
    /// Otherwise it goes to the batcher, so requests that arrive together are batched as before.
    pub async fn verify(&self, signed: SignedMessage) -> Result<VerifiedRequest, VerifyError> {
        let first = self.active.fetch_add(1, Ordering::Relaxed) == 0;
        let _active = Active(&self.active);
        if first {
            tokio::task::yield_now().await;
            if self.active.load(Ordering::Relaxed) == 1 {
                return alone(signed, &self.keys);
            }
        }
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

    /// Spoils `m`'s signature but keeps it well-formed (`s`'s lowest bit flipped: still
    /// reduced, `R` untouched), so that only the equation can refuse it.
    fn forge(m: &mut SignedMessage) {
        m.signature[32] ^= 1;
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
        for m in &good {
            assert!(
                batch_holds(std::slice::from_ref(m), &keys),
                "a good signature failed as a batch of one"
            );
        }
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
            // Each spoiled signature also fails on its own, by schnorrkel and by the equation
            // with one term, so batching changes no verdict.
            assert!(
                batch[3].clone().verify().is_err(),
                "spoil {spoil} verifies alone"
            );
            assert!(
                !batch_holds(std::slice::from_ref(&batch[3]), &keys),
                "spoil {spoil} holds as a batch of one"
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
        // Below the bound, every key is kept (and answers the same again).
        let some = keys.get_all(signers[..10].iter()).expect("valid keys");
        assert_eq!(keys.0.lock().expect("lock").len(), 10);
        assert_eq!(keys.get_all(signers[..10].iter()), Some(some));
        let got = keys.get_all(signers.iter()).expect("valid keys");
        assert_eq!(got.len(), signers.len());
        assert_eq!(
            got[MAX_KEYS + 9].compress().to_bytes(),
            signers[MAX_KEYS + 9]
        );
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
    async fn a_lone_signature_gets_a_final_verdict_and_leaves_batching_on() {
        let verify = Verify {
            started: Instant::now(),
            paused_until_ms: AtomicU64::new(0),
            keys: Arc::default(),
        };
        let good = signed(1, b"{}");
        let mut forged = signed(2, b"{}");
        forged.signature[10] ^= 1;
        let mut wrong_key = signed(3, b"{}");
        wrong_key.request.signer = good.request.signer;
        for bad in [forged, wrong_key] {
            let verdict = verify.flush(vec![bad]).await;
            assert!(
                matches!(
                    verdict.as_slice(),
                    [Err(VerifyError::Auth(AuthError::BadSignature))]
                ),
                "a bad lone signature was not refused"
            );
        }
        assert!(verify.batching(), "a lone bad signature paused batching");
        let verdict = verify.flush(vec![good.clone()]).await;
        assert!(
            matches!(verdict.as_slice(), [Ok(r)] if r.signer == good.request.signer),
            "a good lone signature was refused"
        );
    }

    #[tokio::test]
    async fn a_failed_batch_gives_each_its_verdict_and_pauses_batching_for_a_while() {
        // Started a while ago, so that its clock reads far from zero.
        let verify = Verify {
            started: Instant::now()
                .checked_sub(Duration::from_secs(5))
                .expect("a clock 5 s past boot"),
            paused_until_ms: AtomicU64::new(0),
            keys: Arc::default(),
        };
        assert!(verify.now_ms() >= 5_000);
        assert!(verify.batching());
        let mut forged = signed(2, b"{}");
        forge(&mut forged);
        let batch = vec![signed(1, b"{}"), forged, signed(3, b"{}")];
        let verdicts = verify.flush(batch).await;
        assert!(
            matches!(
                verdicts.as_slice(),
                [
                    Ok(_),
                    Err(VerifyError::Auth(AuthError::BadSignature)),
                    Ok(_)
                ]
            ),
            "not one verdict each"
        );
        assert!(!verify.batching(), "a failed batch left batching on");
        let now = verify.now_ms();
        let until = verify.paused_until_ms.load(Ordering::Relaxed);
        assert!(
            (now + BATCH_PAUSE.as_millis() as u64 - 100..=now + BATCH_PAUSE.as_millis() as u64)
                .contains(&until),
            "paused until {until} ms at {now} ms"
        );
        // Once the pause is over, batching is back on.
        verify.paused_until_ms.store(now - 1, Ordering::Relaxed);
        assert!(verify.batching());
    }

    #[tokio::test]
    async fn a_request_alone_skips_the_batcher_and_requests_together_use_it() {
        let verifier = SignatureVerifier::default();
        for i in 1..=3 {
            assert!(verifier.verify(signed(i, b"{}")).await.is_ok());
        }
        let mut forged = signed(4, b"{}");
        forged.signature[10] ^= 1;
        assert!(matches!(
            verifier.verify(forged).await,
            Err(VerifyError::Auth(AuthError::BadSignature))
        ));
        assert!(
            !verifier.batcher.started(),
            "a request alone went through the batcher"
        );
        // Requests polled together on one thread: they see each other and are batched.
        let together = (1..=8).map(|i| verifier.verify(signed(i, b"{}")));
        let verdicts = futures::future::join_all(together).await;
        assert!(verdicts.iter().all(Result::is_ok));
        assert!(
            verifier.batcher.started(),
            "requests that arrived together were not batched"
        );
        assert_eq!(verifier.active.load(Ordering::Relaxed), 0);
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
