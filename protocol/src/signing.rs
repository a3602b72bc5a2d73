//! Request signing: Epistula v2 headers, with the method and path bound into the signature.
//!
//! The signed message is the Epistula v2 string followed by the request line:
//!
//! ```text
//! {sha256(body) as 64 lowercase hex}.{uuid}.{timestamp_ms}.{signed_for}.{METHOD}.{path_and_query}
//! ```
//!
//! * `body`: the exact raw body bytes (empty for a GET).
//! * `uuid`: the `Epistula-Uuid` header, a hyphenated lowercase UUID.
//! * `timestamp_ms`: the `Epistula-Timestamp` header, milliseconds since the Unix epoch.
//! * `signed_for`: the receiver's SS58 address (the orchestrator's hotkey), never empty here.
//! * `METHOD`: upper-case HTTP method; `path_and_query`: the request target as sent, for example
//!   `/v1/miner/tasks/7/output?lease=…` (no scheme or host, so a proxy in front changes nothing).
//!
//! The signature is sr25519 with the `substrate` signing context (what a Bittensor hotkey signs
//! with), sent as `0x` + 128 hex digits in `Epistula-Request-Signature`. Without the request line a
//! signature captured on one route could be replayed against another with the same body (an
//! empty GET body is the same everywhere); binding it closes that. Replays of the same request are
//! stopped by the receiver's uuid cache, which must cover the whole accepted clock window.
//!
//! Beyond Epistula, [`sign_request`] also sends `Iota-Body-Sha256`: the message's first field,
//! the body's sha256 as 64 lowercase hex digits. With it a receiver can check the signature from
//! the headers alone, before it reads (and holds) the body, then check that the body has that
//! hash. The orchestrator requires it on uploads and on any body over 64 KiB, so that nobody it
//! has not authenticated can make it hold more than that.

use sha2::{Digest, Sha256};
use sp_core::crypto::Ss58Codec;
use sp_core::{Pair as _, sr25519};
use uuid::Uuid;

use crate::session::{ClientSession, HEADER_SESSION, HEADER_SESSION_MAC, MAX_TOKEN_LEN};

/// `Epistula-Version`; always `2`.
pub const HEADER_VERSION: &str = "epistula-version";
/// `Epistula-Timestamp`: milliseconds since the Unix epoch.
pub const HEADER_TIMESTAMP: &str = "epistula-timestamp";
/// `Epistula-Uuid`: a fresh UUID per request.
pub const HEADER_UUID: &str = "epistula-uuid";
/// `Epistula-Signed-By`: the sender's hotkey (SS58).
pub const HEADER_SIGNED_BY: &str = "epistula-signed-by";
/// `Epistula-Signed-For`: the receiver's hotkey (SS58).
pub const HEADER_SIGNED_FOR: &str = "epistula-signed-for";
/// `Epistula-Request-Signature`: `0x` + hex of the 64-byte sr25519 signature.
pub const HEADER_SIGNATURE: &str = "epistula-request-signature";
/// `Iota-Body-Sha256`: the body's sha256, 64 lowercase hex digits (what the message starts with).
pub const HEADER_BODY_SHA256: &str = "iota-body-sha256";

/// What signs requests: a hotkey.
pub trait RequestSigner: Send + Sync {
    /// The signer's SS58 address.
    fn ss58(&self) -> String;
    /// An sr25519 signature (context `substrate`) of `message`.
    fn sign(&self, message: &[u8]) -> [u8; 64];
}

impl RequestSigner for sr25519::Pair {
    fn ss58(&self) -> String {
        self.public().to_ss58check()
    }

    fn sign(&self, message: &[u8]) -> [u8; 64] {
        sp_core::Pair::sign(self, message).0
    }
}

/// The headers of one signed request, as name/value pairs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignedHeaders {
    /// Header names (lowercase) and values.
    pub headers: Vec<(&'static str, String)>,
    /// The uuid used.
    pub uuid: Uuid,
}

/// The value of header `name` (lowercase) among `(name, value)` pairs, as [`SignedHeaders`]
/// holds them; the lookup [`verify_request`] needs for headers kept that way.
pub fn find_header<'a>(headers: &'a [(&'static str, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.as_str())
}

/// The body's sha256 as 64 lowercase hex digits: the message's first field, and the
/// `Iota-Body-Sha256` header.
pub fn body_sha256_hex(body: &[u8]) -> [u8; 64] {
    let mut hasher = BodySha256::default();
    hasher.update(body);
    hasher.finish()
}

/// [`body_sha256_hex`] of a body that arrives in pieces.
#[derive(Clone, Default)]
pub struct BodySha256(Sha256);

impl BodySha256 {
    /// The body's next bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The sha256 of every byte given, as 64 lowercase hex digits.
    pub fn finish(self) -> [u8; 64] {
        let mut hex = [0u8; 64];
        // A 32-byte digest always fits 64 hex digits.
        let _ = const_hex::encode_to_slice(self.0.finalize(), &mut hex);
        hex
    }
}

/// Whether `text` is a sha256 as `Iota-Body-Sha256` carries it: 64 lowercase hex digits.
pub fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The exact byte string that is signed. See the module docs.
pub fn signing_message(
    body: &[u8],
    uuid: &Uuid,
    timestamp_ms: u64,
    signed_for: &str,
    method: &str,
    path_and_query: &str,
) -> String {
    let body_hash = body_sha256_hex(body);
    message_for_body_hash(
        std::str::from_utf8(&body_hash).unwrap_or_default(),
        uuid,
        timestamp_ms,
        signed_for,
        method,
        path_and_query,
    )
}

/// [`signing_message`] for a body known by its sha256 (64 lowercase hex digits) alone.
pub fn message_for_body_hash(
    body_hash: &str,
    uuid: &Uuid,
    timestamp_ms: u64,
    signed_for: &str,
    method: &str,
    path_and_query: &str,
) -> String {
    // Written piece by piece into one buffer: this runs on every signed request a server takes.
    let mut uuid_text = Uuid::encode_buffer();
    let uuid_text = uuid.hyphenated().encode_lower(&mut uuid_text);
    let mut message = String::with_capacity(
        64 + uuid_text.len() + 20 + signed_for.len() + method.len() + path_and_query.len() + 5,
    );
    message.push_str(body_hash);
    message.push('.');
    message.push_str(uuid_text);
    message.push('.');
    let _ = std::fmt::Write::write_fmt(&mut message, format_args!("{timestamp_ms}"));
    message.push('.');
    message.push_str(signed_for);
    message.push('.');
    let start = message.len();
    message.push_str(method);
    message[start..].make_ascii_uppercase();
    message.push('.');
    message.push_str(path_and_query);
    message
}

/// Signs a request and returns the headers to send.
pub fn sign_request(
    signer: &dyn RequestSigner,
    signed_for: &str,
    method: &str,
    path_and_query: &str,
    body: &[u8],
    timestamp_ms: u64,
    uuid: Uuid,
) -> SignedHeaders {
    authenticate_request(
        signer,
        None,
        signed_for,
        method,
        path_and_query,
        body,
        timestamp_ms,
        uuid,
    )
}

/// The headers of a request from `signer`: signed with sr25519, or in `session` (the Epistula
/// headers but the signature, with `Iota-Session` and `Iota-Session-Mac` in its place; see
/// [`crate::session`]). Either way with `Iota-Body-Sha256`.
#[allow(clippy::too_many_arguments)]
pub fn authenticate_request(
    signer: &dyn RequestSigner,
    session: Option<&ClientSession>,
    signed_for: &str,
    method: &str,
    path_and_query: &str,
    body: &[u8],
    timestamp_ms: u64,
    uuid: Uuid,
) -> SignedHeaders {
    let body_hash = body_sha256_hex(body);
    let body_hash = std::str::from_utf8(&body_hash).unwrap_or_default();
    let message = message_for_body_hash(
        body_hash,
        &uuid,
        timestamp_ms,
        signed_for,
        method,
        path_and_query,
    );
    let mut headers = vec![
        (HEADER_VERSION, "2".to_owned()),
        (HEADER_TIMESTAMP, timestamp_ms.to_string()),
        (HEADER_UUID, uuid.hyphenated().to_string()),
        (HEADER_SIGNED_BY, signer.ss58()),
        (HEADER_SIGNED_FOR, signed_for.to_owned()),
    ];
    match session {
        None => {
            let signature = signer.sign(message.as_bytes());
            headers.push((HEADER_SIGNATURE, format!("0x{}", hex::encode(signature))));
        }
        Some(session) => {
            let mac = session.key.mac(message.as_bytes());
            headers.push((HEADER_SESSION, session.token.clone()));
            headers.push((HEADER_SESSION_MAC, const_hex::encode(mac)));
        }
    }
    headers.push((HEADER_BODY_SHA256, body_hash.to_owned()));
    SignedHeaders { headers, uuid }
}

/// How far a request's timestamp may lie from the receiver's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkewWindow {
    /// Oldest accepted age, in milliseconds.
    pub max_age_ms: u64,
    /// Furthest accepted future, in milliseconds (clocks drift both ways).
    pub max_future_ms: u64,
}

impl Default for SkewWindow {
    fn default() -> Self {
        Self {
            max_age_ms: 10_000,
            max_future_ms: 5_000,
        }
    }
}

impl SkewWindow {
    /// How long a uuid must be remembered to stop every replay inside the window.
    pub fn replay_horizon_ms(&self) -> u64 {
        self.max_age_ms + self.max_future_ms
    }
}

/// Why a signed request was refused. Each maps to one stable error code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// A required header is absent.
    #[error("missing header {0}")]
    MissingHeader(&'static str),
    /// A header is present but unusable.
    #[error("malformed header {header}: {reason}")]
    MalformedHeader {
        /// Which header.
        header: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The request was signed for another receiver.
    #[error("request signed for {got}, this service is {expected}")]
    WrongReceiver {
        /// The receiver named in the request.
        got: String,
        /// This service's address.
        expected: String,
    },
    /// The timestamp is too old.
    #[error("timestamp {timestamp_ms} is {age_ms} ms old, more than {max_ms} ms")]
    Stale {
        /// The request's timestamp.
        timestamp_ms: u64,
        /// How old it is.
        age_ms: u64,
        /// The limit.
        max_ms: u64,
    },
    /// The timestamp is in the future by more than the allowed skew.
    #[error("timestamp {timestamp_ms} is {ahead_ms} ms in the future, more than {max_ms} ms")]
    Future {
        /// The request's timestamp.
        timestamp_ms: u64,
        /// How far ahead.
        ahead_ms: u64,
        /// The limit.
        max_ms: u64,
    },
    /// The signature does not verify for this body, method, path and headers.
    #[error("signature does not match the request")]
    BadSignature,
    /// The uuid was seen before inside the window.
    #[error("request uuid {0} was already used")]
    Replayed(Uuid),
    /// The session the request names is not one the receiver takes (expired, or malformed):
    /// open a new one.
    #[error("unknown session: {0}; open a new one (POST /v1/sessions)")]
    UnknownSession(String),
}

/// A request whose headers and signature checked out (replay is the caller's check).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifiedRequest {
    /// The sender's public key.
    pub signer: [u8; 32],
    /// The sender's SS58 address as sent.
    pub signer_ss58: String,
    /// The request's uuid.
    pub uuid: Uuid,
    /// The request's timestamp.
    pub timestamp_ms: u64,
}

/// What authenticates a request: an sr25519 signature, or a session's MAC
/// (see [`crate::session`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Proof {
    /// `Epistula-Request-Signature`, decoded.
    Signature([u8; 64]),
    /// `Iota-Session` and `Iota-Session-Mac`, decoded.
    Session {
        /// The session's token.
        token: String,
        /// The keyed BLAKE3 of the message.
        mac: [u8; 32],
    },
}

/// A request whose headers checked out, with the message its proof must cover.
#[derive(Clone, Debug)]
pub struct Authenticated {
    /// The proof as sent.
    pub proof: Proof,
    /// The message it must cover (see the module documentation).
    pub message: String,
    /// The request, once the proof holds.
    pub request: VerifiedRequest,
}

/// What remains to check of an [`Authenticated`] request, by its kind of proof.
#[derive(Clone, Debug)]
pub enum ToVerify {
    /// An sr25519 signature: [`SignedMessage::verify`], or a batch of them.
    Signature(SignedMessage),
    /// A session's MAC: [`Authenticated::verify_session`] with the session's key.
    Session(Authenticated),
}

impl Authenticated {
    /// The signed message, if the proof is a signature; otherwise the request as it is.
    pub fn into_verifiable(self) -> ToVerify {
        match self.proof {
            Proof::Signature(signature) => ToVerify::Signature(SignedMessage {
                signature,
                message: self.message,
                request: self.request,
            }),
            Proof::Session { .. } => ToVerify::Session(self),
        }
    }

    /// Checks a session's MAC with `key`, the key of the session the proof names (the caller
    /// looked it up, and checked that the session belongs to `request.signer`).
    pub fn verify_session(
        self,
        key: &crate::session::SessionKey,
    ) -> Result<VerifiedRequest, AuthError> {
        match self.proof {
            Proof::Session { mac, .. } if key.verify(self.message.as_bytes(), &mac) => {
                Ok(self.request)
            }
            _ => Err(AuthError::BadSignature),
        }
    }
}

/// A request whose headers checked out, with what its signature must sign: everything
/// [`verify_request`] does except the signature verification itself, so a server can verify
/// many requests' signatures at once (see [`SignedMessage::verify`] for one).
#[derive(Clone, Debug)]
pub struct SignedMessage {
    /// The signature as sent, by `request.signer`.
    pub signature: [u8; 64],
    /// The message it must sign (see the module documentation).
    pub message: String,
    /// The request, once the signature verifies.
    pub request: VerifiedRequest,
}

impl SignedMessage {
    /// Verifies the signature on its own.
    pub fn verify(self) -> Result<VerifiedRequest, AuthError> {
        let ok = sr25519::Pair::verify(
            &sr25519::Signature::from_raw(self.signature),
            self.message.as_bytes(),
            &sr25519::Public::from_raw(self.request.signer),
        );
        if ok {
            Ok(self.request)
        } else {
            Err(AuthError::BadSignature)
        }
    }
}

/// Verifies the Epistula headers of a request against its method, target and raw body.
///
/// `header` looks a header up by lowercase name. The order of checks puts the cheap ones first so
/// that garbage costs no signature verification.
pub fn verify_request<'a>(
    header: impl Fn(&'static str) -> Option<&'a str>,
    method: &str,
    path_and_query: &str,
    body: &[u8],
    receiver_ss58: &str,
    now_ms: u64,
    window: SkewWindow,
) -> Result<VerifiedRequest, AuthError> {
    check_request(
        header,
        method,
        path_and_query,
        body,
        receiver_ss58,
        now_ms,
        window,
    )?
    .verify()
}

/// Checks everything about a request's Epistula headers but the signature: version, clock
/// window, uuid, receiver, signer address and signature format. Returns what remains to verify.
/// A session-signed request is refused here (it needs the session's key: see
/// [`CheckedHeaders::message`]).
pub fn check_request<'a>(
    header: impl Fn(&'static str) -> Option<&'a str>,
    method: &str,
    path_and_query: &str,
    body: &[u8],
    receiver_ss58: &str,
    now_ms: u64,
    window: SkewWindow,
) -> Result<SignedMessage, AuthError> {
    let headers = check_headers(header, receiver_ss58, now_ms, window)?;
    let signer = decode_signer(headers.signed_by)?;
    match headers
        .message(signer, method, path_and_query, body)
        .into_verifiable()
    {
        ToVerify::Signature(signed) => Ok(signed),
        ToVerify::Session(_) => Err(AuthError::MissingHeader(HEADER_SIGNATURE)),
    }
}

/// The public key an `Epistula-Signed-By` address names.
pub fn decode_signer(signed_by: &str) -> Result<[u8; 32], AuthError> {
    sr25519::Public::from_ss58check(signed_by)
        .map(|p| p.0)
        .map_err(|e| AuthError::MalformedHeader {
            header: HEADER_SIGNED_BY,
            reason: format!("not an SS58 address: {e:?}"),
        })
}

/// A request's Epistula headers once [`check_headers`] passed them: all but the signer's address
/// (`signed_by`, still text) and the signature itself are checked.
#[derive(Clone, Debug)]
pub struct CheckedHeaders<'a> {
    /// `Epistula-Timestamp`, inside the clock window.
    pub timestamp_ms: u64,
    /// `Epistula-Uuid`.
    pub uuid: Uuid,
    /// `Epistula-Signed-For`, equal to the receiver's address.
    pub signed_for: &'a str,
    /// `Epistula-Signed-By` as sent.
    pub signed_by: &'a str,
    /// The signature, or the session and its MAC.
    pub proof: Proof,
}

/// The cheap checks of [`check_request`], without decoding the signer's address (a server that
/// sees the same few signers may look them up instead) or hashing the body.
pub fn check_headers<'a>(
    header: impl Fn(&'static str) -> Option<&'a str>,
    receiver_ss58: &str,
    now_ms: u64,
    window: SkewWindow,
) -> Result<CheckedHeaders<'a>, AuthError> {
    let get = |name: &'static str| header(name).ok_or(AuthError::MissingHeader(name));
    let version = get(HEADER_VERSION)?;
    if version.trim() != "2" {
        return Err(AuthError::MalformedHeader {
            header: HEADER_VERSION,
            reason: format!("version {version:?} is not 2"),
        });
    }
    let timestamp_ms: u64 =
        get(HEADER_TIMESTAMP)?
            .trim()
            .parse()
            .map_err(|_| AuthError::MalformedHeader {
                header: HEADER_TIMESTAMP,
                reason: "not an integer number of milliseconds".into(),
            })?;
    if timestamp_ms > now_ms {
        let ahead_ms = timestamp_ms - now_ms;
        if ahead_ms > window.max_future_ms {
            return Err(AuthError::Future {
                timestamp_ms,
                ahead_ms,
                max_ms: window.max_future_ms,
            });
        }
    } else {
        let age_ms = now_ms - timestamp_ms;
        if age_ms > window.max_age_ms {
            return Err(AuthError::Stale {
                timestamp_ms,
                age_ms,
                max_ms: window.max_age_ms,
            });
        }
    }
    let uuid_text = get(HEADER_UUID)?;
    let uuid = Uuid::parse_str(uuid_text.trim()).map_err(|e| AuthError::MalformedHeader {
        header: HEADER_UUID,
        reason: e.to_string(),
    })?;
    let signed_for = get(HEADER_SIGNED_FOR)?;
    if signed_for != receiver_ss58 {
        return Err(AuthError::WrongReceiver {
            got: signed_for.to_owned(),
            expected: receiver_ss58.to_owned(),
        });
    }
    let signed_by = get(HEADER_SIGNED_BY)?;
    let proof = match header(HEADER_SESSION) {
        Some(token) if token.len() > MAX_TOKEN_LEN => {
            return Err(AuthError::MalformedHeader {
                header: HEADER_SESSION,
                reason: format!("longer than {MAX_TOKEN_LEN} bytes"),
            });
        }
        Some(token) => Proof::Session {
            token: token.to_owned(),
            mac: parse_mac(get(HEADER_SESSION_MAC)?)?,
        },
        None => Proof::Signature(parse_signature(get(HEADER_SIGNATURE)?)?.0),
    };
    Ok(CheckedHeaders {
        timestamp_ms,
        uuid,
        signed_for,
        signed_by,
        proof,
    })
}

impl CheckedHeaders<'_> {
    /// What the signature must sign, with `signer` the public key `signed_by` names (the caller
    /// decoded it, or looked it up by the address's text).
    pub fn message(
        self,
        signer: [u8; 32],
        method: &str,
        path_and_query: &str,
        body: &[u8],
    ) -> Authenticated {
        let body_hash = body_sha256_hex(body);
        self.message_for_body_hash(
            signer,
            method,
            path_and_query,
            std::str::from_utf8(&body_hash).unwrap_or_default(),
        )
    }

    /// [`CheckedHeaders::message`] for a body known by its sha256 (64 lowercase hex digits, as
    /// `Iota-Body-Sha256` carries it) before the body itself is read.
    pub fn message_for_body_hash(
        self,
        signer: [u8; 32],
        method: &str,
        path_and_query: &str,
        body_hash: &str,
    ) -> Authenticated {
        let message = message_for_body_hash(
            body_hash,
            &self.uuid,
            self.timestamp_ms,
            self.signed_for,
            method,
            path_and_query,
        );
        Authenticated {
            proof: self.proof,
            message,
            request: VerifiedRequest {
                signer,
                signer_ss58: self.signed_by.to_owned(),
                uuid: self.uuid,
                timestamp_ms: self.timestamp_ms,
            },
        }
    }
}

fn parse_mac(text: &str) -> Result<[u8; 32], AuthError> {
    let text = text.trim();
    let mut raw = [0u8; 32];
    if text.len() != 64 || const_hex::decode_to_slice(text, &mut raw).is_err() {
        return Err(AuthError::MalformedHeader {
            header: HEADER_SESSION_MAC,
            reason: "expected 64 hex digits (32 bytes)".into(),
        });
    }
    Ok(raw)
}

fn parse_signature(text: &str) -> Result<sr25519::Signature, AuthError> {
    let malformed = |reason: &str| AuthError::MalformedHeader {
        header: HEADER_SIGNATURE,
        reason: reason.to_owned(),
    };
    let hex_part = text
        .trim()
        .strip_prefix("0x")
        .ok_or_else(|| malformed("missing 0x prefix"))?;
    if hex_part.len() != 128 {
        return Err(malformed("expected 128 hex digits (64 bytes)"));
    }
    let mut raw = [0u8; 64];
    const_hex::decode_to_slice(hex_part, &mut raw).map_err(|_| malformed("not hex"))?;
    Ok(sr25519::Signature::from_raw(raw))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(seed: u8) -> sr25519::Pair {
        sr25519::Pair::from_seed(&[seed; 32])
    }

    struct Req {
        headers: Vec<(&'static str, String)>,
        receiver: String,
    }

    fn signed(method: &str, path: &str, body: &[u8], ts: u64) -> Req {
        let receiver = pair(9).ss58();
        let s = sign_request(&pair(1), &receiver, method, path, body, ts, Uuid::new_v4());
        Req {
            headers: s.headers,
            receiver,
        }
    }

    fn verify(
        r: &Req,
        method: &str,
        path: &str,
        body: &[u8],
        now: u64,
    ) -> Result<VerifiedRequest, AuthError> {
        verify_request(
            |name| find_header(&r.headers, name),
            method,
            path,
            body,
            &r.receiver,
            now,
            SkewWindow::default(),
        )
    }

    /// A request signed as `POST /v1/miner/work?x=1` with body `{}`, each bound part changed.
    const TAMPERED: [(&str, &str, &[u8]); 4] = [
        ("GET", "/v1/miner/work?x=1", b"{}"),
        ("POST", "/v1/miner/work?x=2", b"{}"),
        ("POST", "/v1/miner/heartbeat?x=1", b"{}"),
        ("POST", "/v1/miner/work?x=1", b"{ }"),
    ];

    #[test]
    fn round_trip_and_bindings() {
        let r = signed("POST", "/v1/miner/work?x=1", b"{}", 1_000_000);
        let ok = verify(&r, "post", "/v1/miner/work?x=1", b"{}", 1_000_500).expect("valid");
        assert_eq!(ok.signer, pair(1).public().0);
        // Every signed part changes the verdict.
        for (m, p, b) in TAMPERED {
            assert_eq!(
                verify(&r, m, p, b, 1_000_500),
                Err(AuthError::BadSignature),
                "{m} {p}"
            );
        }
    }

    #[test]
    fn clock_window_both_ways() {
        let r = signed("GET", "/v1/x", b"", 1_000_000);
        assert!(matches!(
            verify(&r, "GET", "/v1/x", b"", 1_010_001),
            Err(AuthError::Stale { .. })
        ));
        assert!(verify(&r, "GET", "/v1/x", b"", 1_010_000).is_ok());
        assert!(matches!(
            verify(&r, "GET", "/v1/x", b"", 994_999),
            Err(AuthError::Future { .. })
        ));
        assert!(verify(&r, "GET", "/v1/x", b"", 995_000).is_ok());
    }

    /// Every instant at which a request is accepted lies within the replay horizon of every
    /// other: the first and last accepted instants of one request are the horizon apart.
    #[test]
    fn the_replay_horizon_spans_the_whole_window() {
        let window = SkewWindow {
            max_age_ms: 7_000,
            max_future_ms: 3_000,
        };
        let ts = 1_000_000;
        let r = signed("GET", "/v1/x", b"", ts);
        let accepted = |now: u64| {
            verify_request(
                |name| find_header(&r.headers, name),
                "GET",
                "/v1/x",
                b"",
                &r.receiver,
                now,
                window,
            )
            .is_ok()
        };
        let first = (ts - 10_000..=ts)
            .find(|&now| accepted(now))
            .expect("accepted");
        let last = (ts..=ts + 10_000)
            .rev()
            .find(|&now| accepted(now))
            .expect("accepted");
        assert_eq!((first, last), (ts - 3_000, ts + 7_000));
        assert_eq!(window.replay_horizon_ms(), last - first);
    }

    #[test]
    fn a_body_hash_header_is_64_lowercase_hex_digits() {
        let hex = body_sha256_hex(b"{}");
        let text = std::str::from_utf8(&hex).expect("ascii");
        assert!(is_sha256_hex(text));
        assert!(is_sha256_hex(&"0123456789abcdef".repeat(4)));
        for bad in [
            &text[..63],
            &format!("{text}0"),
            &text.to_uppercase(),
            &format!("{}g", &text[..63]),
            &format!("{} ", &text[..63]),
            "",
        ] {
            assert!(!is_sha256_hex(bad), "{bad:?}");
        }
    }

    #[test]
    fn wrong_receiver_and_forged_signer() {
        let mut r = signed("GET", "/v1/x", b"", 1_000);
        r.receiver = pair(8).ss58();
        assert!(matches!(
            verify(&r, "GET", "/v1/x", b"", 1_000),
            Err(AuthError::WrongReceiver { .. })
        ));
        let mut r = signed("GET", "/v1/x", b"", 1_000);
        for h in &mut r.headers {
            if h.0 == HEADER_SIGNED_BY {
                h.1 = pair(2).ss58();
            }
        }
        assert_eq!(
            verify(&r, "GET", "/v1/x", b"", 1_000),
            Err(AuthError::BadSignature)
        );
    }

    #[test]
    fn malformed_headers_are_named() {
        let mut r = signed("GET", "/v1/x", b"", 1_000);
        r.headers.retain(|h| h.0 != HEADER_UUID);
        assert_eq!(
            verify(&r, "GET", "/v1/x", b"", 1_000),
            Err(AuthError::MissingHeader(HEADER_UUID))
        );
        let mut r = signed("GET", "/v1/x", b"", 1_000);
        for h in &mut r.headers {
            if h.0 == HEADER_SIGNATURE {
                h.1 = "0xabc".into();
            }
        }
        assert!(matches!(
            verify(&r, "GET", "/v1/x", b"", 1_000),
            Err(AuthError::MalformedHeader {
                header: HEADER_SIGNATURE,
                ..
            })
        ));
    }

    /// A session's MAC binds what a signature binds, under the session's key alone, and a
    /// receiver that takes signatures only is not fooled into taking it as one.
    #[test]
    fn a_session_request_is_bound_like_a_signed_one() {
        use crate::session::{SessionKey, new_token};
        let session = ClientSession {
            token: new_token(2_000_000),
            key: SessionKey::from_bytes([5; 32]),
            opened_at_ms: 0,
            expires_at_ms: 2_000_000,
        };
        let receiver = pair(9).ss58();
        let sent = authenticate_request(
            &pair(1),
            Some(&session),
            &receiver,
            "POST",
            "/v1/miner/work?x=1",
            b"{}",
            1_000_000,
            Uuid::new_v4(),
        );
        let check = |method: &str, path: &str, body: &[u8], key: &SessionKey| {
            let headers = check_headers(
                |name| find_header(&sent.headers, name),
                &receiver,
                1_000_500,
                SkewWindow::default(),
            )?;
            assert_eq!(
                headers.proof,
                Proof::Session {
                    token: session.token.clone(),
                    mac: match &headers.proof {
                        Proof::Session { mac, .. } => *mac,
                        Proof::Signature(_) => [0; 32],
                    },
                }
            );
            headers
                .message(pair(1).public().0, method, path, body)
                .verify_session(key)
        };
        let ok = check("POST", "/v1/miner/work?x=1", b"{}", &session.key).expect("valid");
        assert_eq!(ok.signer, pair(1).public().0);
        for (m, p, b) in TAMPERED {
            assert_eq!(
                check(m, p, b, &session.key),
                Err(AuthError::BadSignature),
                "{m} {p}"
            );
        }
        assert_eq!(
            check(
                "POST",
                "/v1/miner/work?x=1",
                b"{}",
                &SessionKey::from_bytes([6; 32])
            ),
            Err(AuthError::BadSignature)
        );
        // A signature-only receiver refuses it by the missing signature.
        assert_eq!(
            verify_request(
                |name| find_header(&sent.headers, name),
                "POST",
                "/v1/miner/work?x=1",
                b"{}",
                &receiver,
                1_000_500,
                SkewWindow::default(),
            ),
            Err(AuthError::MissingHeader(HEADER_SIGNATURE))
        );
        // A signature is no session proof.
        let signed = signed("POST", "/v1/miner/work", b"{}", 1_000_000);
        let headers = check_headers(
            |name| find_header(&signed.headers, name),
            &signed.receiver,
            1_000_000,
            SkewWindow::default(),
        )
        .expect("headers");
        assert_eq!(
            headers
                .message(pair(1).public().0, "POST", "/v1/miner/work", b"{}")
                .verify_session(&session.key),
            Err(AuthError::BadSignature)
        );
        // A malformed MAC or an oversized token is named.
        for (name, value) in [
            (HEADER_SESSION_MAC, "00".repeat(31)),
            (HEADER_SESSION, "1".repeat(MAX_TOKEN_LEN + 1)),
        ] {
            let mut headers = sent.headers.clone();
            for h in &mut headers {
                if h.0 == name {
                    h.1 = value.clone();
                }
            }
            let got = check_headers(
                |n| find_header(&headers, n),
                &receiver,
                1_000_000,
                SkewWindow::default(),
            )
            .map(|_| ());
            assert!(
                matches!(got, Err(AuthError::MalformedHeader { header, .. }) if header == name),
                "{name}: {got:?}"
            );
        }
    }

    #[test]
    fn message_format_is_documented_string() {
        let uuid = Uuid::from_u128(1);
        let m = signing_message(b"", &uuid, 5, "5Grw", "get", "/v1/a?b=c");
        assert_eq!(
            m,
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855.\
             00000000-0000-0000-0000-000000000001.5.5Grw.GET./v1/a?b=c"
        );
    }
}
