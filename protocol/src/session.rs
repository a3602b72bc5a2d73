//! Session-signed requests: one sr25519-signed handshake, then a keyed-BLAKE3 MAC per request.
//!
//! An sr25519 signature check costs a server about as much CPU as the rest of a small request
//! together (see the orchestrator's load benchmark), and a miner polls for work in a loop. So a
//! caller may open a session with one signed request and authenticate the requests after it with
//! a MAC under the session's key. Everything else about a request stays as [`crate::signing`]
//! has it: the same Epistula headers (version, timestamp, uuid, signed-by, signed-for), the same
//! clock window and uuid replay check, the same signer membership check, and a MAC over the same
//! message string, so body, method, path and query stay bound.
//!
//! ## Opening a session (`POST /v1/sessions`, signed with sr25519)
//!
//! 1. The caller draws a secret scalar `a` and sends `A = a·G` on the Ristretto group
//!    ([`Handshake::public_hex`]).
//! 2. The server picks the session's token, `{expires_at_ms}.{32 hex digits of a random nonce}`,
//!    and its key `K`, which the server can compute again from the token and the caller's public
//!    key alone (the orchestrator keys a BLAKE3 hash with a per-run secret): no replica needs to
//!    look a session up. It draws `b` and answers the token, `B = b·G` and `K ⊕ pad`, where
//!    `pad = BLAKE3-derive-key(SESSION_KEY_CONTEXT, b·A ‖ A ‖ B ‖ token ‖ caller's public key ‖
//!    server's SS58 address)` ([`seal`]).
//! 3. The caller computes the same pad from `a·B` and so `K` ([`Handshake::finish`]). `K` never
//!    travels in the clear.
//!
//! `A` is covered by the request's sr25519 signature, so nobody can open a session in another's
//! name. The answer is not signed: a party that rewrites it gives the caller a key the server
//! does not hold, so the MACs the caller makes are refused; it can only deny service, as it
//! could by dropping the answer.
//!
//! ## A session-signed request
//!
//! In place of `Epistula-Request-Signature` it carries `Iota-Session` (the token) and
//! `Iota-Session-Mac`: 64 lowercase hex digits of `BLAKE3-keyed(K, message)`, where `message` is
//! exactly what [`crate::signing::signing_message`] builds
//! ([`crate::signing::authenticate_request`] makes such headers). The server refuses an expired or
//! malformed token with `unknown_session` (401), and the caller opens a new session.
//!
//! A MAC proves the request to the server alone (the server holds the key too), which is all a
//! request to it needs: nothing a caller sends is kept as evidence against it for third parties.

use curve25519_dalek::ristretto::{CompressedRistretto, RistrettoPoint};
use curve25519_dalek::scalar::Scalar;
use curve25519_dalek::traits::IsIdentity;
use rand::RngCore;
use zeroize::Zeroize;

/// The route that opens a session.
pub const SESSIONS_PATH: &str = "/v1/sessions";
/// `Iota-Session`: the session id, a hyphenated lowercase UUID.
pub const HEADER_SESSION: &str = "iota-session";
/// `Iota-Session-Mac`: 64 lowercase hex digits of the keyed BLAKE3 of the signing message.
pub const HEADER_SESSION_MAC: &str = "iota-session-mac";
/// The BLAKE3 key-derivation context of session keys (fixed for all time: changing it changes
/// every key).
pub const SESSION_KEY_CONTEXT: &str = "iota-rs 2026-12-01 session key from Ristretto DH";

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// The other side's public half is not 32 bytes of hex.
    #[error("the session public key is not 64 hex digits")]
    NotHex,
    /// The other side's public half is no canonical Ristretto point, or is the identity.
    #[error("the session public key is not a valid Ristretto point")]
    BadPoint,
}

/// A session's 32-byte key. Wiped when dropped; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKey([u8; 32]);

impl SessionKey {
    /// A key from its bytes (as a server derives it).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The MAC of `message` under this key.
    pub fn mac(&self, message: &[u8]) -> [u8; 32] {
        *blake3::keyed_hash(&self.0, message).as_bytes()
    }

    /// Whether `mac` is the MAC of `message` (in constant time).
    pub fn verify(&self, message: &[u8], mac: &[u8; 32]) -> bool {
        blake3::keyed_hash(&self.0, message) == blake3::Hash::from_bytes(*mac)
    }
}

impl Drop for SessionKey {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

/// A caller's half of a handshake: its secret scalar and public point.
pub struct Handshake {
    secret: Scalar,
    public: [u8; 32],
}

fn random_scalar() -> Scalar {
    let mut wide = [0u8; 64];
    rand::thread_rng().fill_bytes(&mut wide);
    let scalar = Scalar::from_bytes_mod_order_wide(&wide);
    wide.zeroize();
    scalar
}

/// The point a peer sent, refused unless canonical and not the identity.
fn decode_point(public: &[u8; 32]) -> Result<RistrettoPoint, SessionError> {
    let point = CompressedRistretto(*public)
        .decompress()
        .ok_or(SessionError::BadPoint)?;
    if point.is_identity() {
        return Err(SessionError::BadPoint);
    }
    Ok(point)
}

/// A public half as sent: 64 hex digits.
pub fn decode_public_hex(text: &str) -> Result<[u8; 32], SessionError> {
    let mut out = [0u8; 32];
    const_hex::decode_to_slice(text, &mut out).map_err(|_| SessionError::NotHex)?;
    Ok(out)
}

/// The pad that seals a session key in the open-session answer.
fn pad(
    shared: &RistrettoPoint,
    caller_public: &[u8; 32],
    server_public: &[u8; 32],
    token: &str,
    caller_key: &[u8; 32],
    server_ss58: &str,
) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new_derive_key(SESSION_KEY_CONTEXT);
    hasher.update(shared.compress().as_bytes());
    hasher.update(caller_public);
    hasher.update(server_public);
    hasher.update(token.as_bytes());
    hasher.update(caller_key);
    hasher.update(server_ss58.as_bytes());
    *hasher.finalize().as_bytes()
}

fn xor(a: &[u8; 32], b: &[u8; 32]) -> [u8; 32] {
    std::array::from_fn(|i| a[i] ^ b[i])
}

/// Longest token a request may name (a token is at most 20 digits, a dot and 32 hex digits).
pub const MAX_TOKEN_LEN: usize = 64;

/// A session token: its expiry and a random nonce.
pub fn new_token(expires_at_ms: u64) -> String {
    let mut nonce = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut nonce);
    format!("{expires_at_ms}.{}", const_hex::encode(nonce))
}

/// A token's expiry (milliseconds since the Unix epoch), if it has the form [`new_token`] gives.
pub fn token_expiry(token: &str) -> Option<u64> {
    let (expiry, nonce) = token.split_once('.')?;
    let well_formed = token.len() <= MAX_TOKEN_LEN
        && nonce.len() == 32
        && nonce
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        && !expiry.is_empty()
        && expiry.bytes().all(|b| b.is_ascii_digit());
    well_formed.then(|| expiry.parse().ok()).flatten()
}

impl Handshake {
    /// A fresh secret and its public point.
    pub fn new() -> Self {
        let secret = random_scalar();
        let public = RistrettoPoint::mul_base(&secret).compress().to_bytes();
        Self { secret, public }
    }

    /// The public point as the open-session request carries it: 64 lowercase hex digits.
    pub fn public_hex(&self) -> String {
        const_hex::encode(self.public)
    }

    /// The session key, from the server's answer (its point and the sealed key). `caller_key`
    /// is the caller's sr25519 public key, `server_ss58` the address the request was signed for.
    pub fn finish(
        self,
        server_public: &[u8; 32],
        sealed_key: &[u8; 32],
        token: &str,
        caller_key: &[u8; 32],
        server_ss58: &str,
    ) -> Result<SessionKey, SessionError> {
        let shared = self.secret * decode_point(server_public)?;
        let pad = pad(
            &shared,
            &self.public,
            server_public,
            token,
            caller_key,
            server_ss58,
        );
        Ok(SessionKey(xor(sealed_key, &pad)))
    }
}

impl Default for Handshake {
    fn default() -> Self {
        Self::new()
    }
}

/// The server's side of a handshake: its public point and `key` sealed for the caller whose
/// point is `caller_public`.
pub fn seal(
    key: &SessionKey,
    caller_public: &[u8; 32],
    token: &str,
    caller_key: &[u8; 32],
    server_ss58: &str,
) -> Result<([u8; 32], [u8; 32]), SessionError> {
    let caller_point = decode_point(caller_public)?;
    let secret = random_scalar();
    let public = RistrettoPoint::mul_base(&secret).compress().to_bytes();
    let pad = pad(
        &(secret * caller_point),
        caller_public,
        &public,
        token,
        caller_key,
        server_ss58,
    );
    Ok((public, xor(&key.0, &pad)))
}

/// An open session as a caller holds it.
#[derive(Clone, Debug)]
pub struct ClientSession {
    /// The session's token.
    pub token: String,
    /// Its key.
    pub key: SessionKey,
    /// When it was opened, by the caller's clock (milliseconds since the Unix epoch).
    pub opened_at_ms: u64,
    /// When the server stops taking it (milliseconds since the Unix epoch).
    pub expires_at_ms: u64,
}

impl ClientSession {
    /// Whether to open a new session before signing at `now_ms`: within a minute of the expiry,
    /// or a quarter of the session's life for shorter ones, so that no request is signed with a
    /// session that lapses on the way.
    pub fn needs_renewal(&self, now_ms: u64) -> bool {
        let life = self.expires_at_ms.saturating_sub(self.opened_at_ms);
        let margin = RENEW_BEFORE_MS.min(life / 4);
        now_ms.saturating_add(margin) >= self.expires_at_ms
    }
}

/// How long before its expiry a caller renews a session (see [`ClientSession::needs_renewal`]).
pub const RENEW_BEFORE_MS: u64 = 60_000;

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(h: &Handshake) -> Handshake {
        Handshake {
            secret: h.secret,
            public: h.public,
        }
    }

    #[test]
    fn the_caller_unseals_the_servers_key_only_with_every_input_right() {
        let caller = [7u8; 32];
        let token = new_token(1_000);
        let key = SessionKey::from_bytes([9; 32]);
        let handshake = Handshake::new();
        let public = decode_public_hex(&handshake.public_hex()).expect("hex");
        let (server_public, sealed) =
            seal(&key, &public, &token, &caller, "5Server").expect("seal");
        assert_ne!(
            SessionKey::from_bytes(sealed),
            key,
            "the key travels sealed"
        );
        let unsealed = copy(&handshake)
            .finish(&server_public, &sealed, &token, &caller, "5Server")
            .expect("finish");
        assert_eq!(unsealed, key);
        // Each bound input changes what the caller unseals.
        let another_server = seal(&key, &public, &token, &caller, "5Server")
            .expect("seal")
            .0;
        let other_token = new_token(1_000);
        for (what, got) in [
            (
                "server point",
                copy(&handshake).finish(&another_server, &sealed, &token, &caller, "5Server"),
            ),
            (
                "token",
                copy(&handshake).finish(&server_public, &sealed, &other_token, &caller, "5Server"),
            ),
            (
                "caller key",
                copy(&handshake).finish(&server_public, &sealed, &token, &[8; 32], "5Server"),
            ),
            (
                "server address",
                copy(&handshake).finish(&server_public, &sealed, &token, &caller, "5Serves"),
            ),
            (
                "another handshake",
                Handshake::new().finish(&server_public, &sealed, &token, &caller, "5Server"),
            ),
        ] {
            assert_ne!(got.expect("valid point"), key, "{what}");
        }
    }

    #[test]
    fn bad_points_are_refused() {
        let key = SessionKey::from_bytes([1; 32]);
        // The identity encodes as 32 zero bytes; 0xff.. is no canonical encoding.
        for bad in [[0u8; 32], [0xff; 32]] {
            assert_eq!(
                seal(&key, &bad, "1.0", &[1; 32], "s").map(|_| ()),
                Err(SessionError::BadPoint)
            );
            assert_eq!(
                Handshake::new()
                    .finish(&bad, &[0; 32], "1.0", &[1; 32], "s")
                    .map(|_| ()),
                Err(SessionError::BadPoint)
            );
        }
        assert_eq!(decode_public_hex("abcd"), Err(SessionError::NotHex));
        assert_eq!(
            decode_public_hex(&"zz".repeat(32)),
            Err(SessionError::NotHex)
        );
    }

    #[test]
    fn tokens_carry_their_expiry_and_nothing_else_parses() {
        let token = new_token(1_733_000_000_123);
        assert_eq!(token_expiry(&token), Some(1_733_000_000_123));
        assert_ne!(new_token(5), new_token(5), "each token has its own nonce");
        let nonce = "0123456789abcdef".repeat(2);
        assert_eq!(token_expiry(&format!("7.{nonce}")), Some(7));
        for bad in [
            String::new(),
            nonce.clone(),
            format!(".{nonce}"),
            format!("7.{}", &nonce[..31]),
            format!("7.{nonce}0"),
            format!("7.{}", nonce.to_uppercase()),
            format!("+7.{nonce}"),
            format!("7 .{nonce}"),
            format!("99999999999999999999999.{nonce}"),
            format!("{}.{nonce}", "0".repeat(40)),
        ] {
            assert_eq!(token_expiry(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_session_is_renewed_a_minute_or_a_quarter_of_its_life_before_it_expires() {
        let session = |opened_at_ms, expires_at_ms| ClientSession {
            token: new_token(expires_at_ms),
            key: SessionKey::from_bytes([0; 32]),
            opened_at_ms,
            expires_at_ms,
        };
        let hour = session(0, 3_600_000);
        assert!(!hour.needs_renewal(3_539_999));
        assert!(hour.needs_renewal(3_540_000));
        let short = session(1_000, 5_000);
        assert!(!short.needs_renewal(3_999));
        assert!(short.needs_renewal(4_000));
        // A clock that moved back before the opening, or an answer already expired.
        assert!(!short.needs_renewal(0));
        assert!(session(5_000, 5_000).needs_renewal(5_000));
    }

    #[test]
    fn a_mac_holds_for_its_message_and_key_only() {
        let key = SessionKey::from_bytes([3; 32]);
        let mac = key.mac(b"message");
        assert!(key.verify(b"message", &mac));
        assert!(!key.verify(b"messagf", &mac));
        assert!(!SessionKey::from_bytes([4; 32]).verify(b"message", &mac));
        let mut bad = mac;
        bad[31] ^= 1;
        assert!(!key.verify(b"message", &bad));
        assert_eq!(format!("{key:?}"), "SessionKey(..)");
    }
}
