//! Signature verification of signed requests, in batches.
//!
//! sr25519 verification was the largest single cost of a signed request. Requests that arrive
//! together are verified with one batch equation ([`schnorrkel::verify_batch_rng`], random
//! coefficients from the operating system's generator), which costs about half as much per
//! signature as verifying each. A batch holds iff every signature in it does, so the answer is
//! the same as one verification each.
//!
//! A failed batch says only that some signature in it is bad; each is then verified alone. So that
//! forged signatures cannot make every batch pay twice, batching pauses for [`BATCH_PAUSE`] after a
//! failed batch: under such an attack the cost is one verification per request, as without
//! batching, plus one wasted batch per pause.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use iota_protocol::AuthError;
use iota_protocol::signing::{SignedMessage, VerifiedRequest};

use crate::batch::{Batcher, Flush};

/// Most signatures in one batch (beyond a few dozen a batch saves no more per signature).
const MAX_BATCH: usize = 64;
/// Batches being verified at once (each on a blocking thread).
const MAX_FLUSHES: usize = 4;
/// How long batching stays off after a batch failed.
const BATCH_PAUSE: Duration = Duration::from_secs(1);

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

/// Whether every signature of `batch` verifies, by one batch equation. Malformed keys or
/// signatures fail the batch.
fn batch_holds(batch: &[SignedMessage]) -> bool {
    let mut publics = Vec::with_capacity(batch.len());
    let mut signatures = Vec::with_capacity(batch.len());
    for m in batch {
        match (
            schnorrkel::PublicKey::from_bytes(&m.request.signer),
            schnorrkel::Signature::from_bytes(&m.signature),
        ) {
            (Ok(p), Ok(s)) => {
                publics.push(p);
                signatures.push(s);
            }
            _ => return false,
        }
    }
    let context = schnorrkel::signing_context(b"substrate");
    let transcripts = batch.iter().map(|m| context.bytes(m.message.as_bytes()));
    schnorrkel::verify_batch_rng(transcripts, &signatures, &publics, false, rand::rngs::OsRng)
        .is_ok()
}

impl Flush for Verify {
    type Item = SignedMessage;
    type Output = Result<VerifiedRequest, VerifyError>;

    async fn flush(&self, batch: Vec<SignedMessage>) -> Vec<Self::Output> {
        metrics::histogram!("iota_signature_batch_size").record(batch.len() as f64);
        let batching = batch.len() > 1 && self.batching();
        let verified = tokio::task::spawn_blocking(move || {
            if batching && batch_holds(&batch) {
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
        assert!(batch_holds(&good));
        // Each way of spoiling one member: another message, another key, another signature.
        for spoil in 0..3 {
            let mut batch = good.clone();
            match spoil {
                0 => batch[3].message.push('x'),
                1 => batch[3].request.signer = good[4].request.signer,
                _ => batch[3].signature = good[4].signature,
            }
            assert!(!batch_holds(&batch), "spoiled member {spoil} passed");
        }
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
