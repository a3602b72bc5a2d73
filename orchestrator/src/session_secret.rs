//! A run's secret for session keys (`runs.session_secret`, drawn once per run): every replica
//! derives a session's key from it and the request alone (see [`crate::http::sessions`]).

use iota_protocol::AuthError;
use iota_protocol::session::{SessionKey, token_expiry};
use iota_protocol::signing::{Authenticated, Proof, VerifiedRequest};

/// A run's secret for session keys. Never printed.
#[derive(Clone)]
pub struct SessionSecret([u8; 32]);

impl SessionSecret {
    /// The secret from its stored bytes; `None` unless there are 32.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// The key of the session `token` names, for the caller whose public key is `caller`.
    pub fn key_for(&self, token: &str, caller: &[u8; 32]) -> SessionKey {
        let mut hasher = blake3::Hasher::new_keyed(&self.0);
        hasher.update(caller);
        hasher.update(token.as_bytes());
        SessionKey::from_bytes(*hasher.finalize().as_bytes())
    }

    /// Checks a session-signed request by `signer` at `now_ms`: the token's expiry, then its MAC.
    pub fn verify(
        &self,
        auth: Authenticated,
        signer: &[u8; 32],
        now_ms: u64,
    ) -> Result<VerifiedRequest, AuthError> {
        let Proof::Session { token, .. } = &auth.proof else {
            return Err(AuthError::BadSignature);
        };
        match token_expiry(token) {
            None => Err(AuthError::UnknownSession("the token is malformed".into())),
            Some(expiry) if expiry <= now_ms => Err(AuthError::UnknownSession(format!(
                "the session expired {} s ago",
                (now_ms - expiry) / 1000
            ))),
            Some(_) => {
                let key = self.key_for(token, signer);
                auth.verify_session(&key)
            }
        }
    }
}

impl std::fmt::Debug for SessionSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionSecret(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session_secret::SessionSecret;
    use iota_protocol::session::ClientSession;
    use iota_protocol::session::SessionKey;
    use iota_protocol::session::new_token;
    use iota_protocol::signing::{SkewWindow, authenticate_request, check_headers, find_header};
    use sp_core::Pair as _;

    fn request(
        secret: &SessionSecret,
        token: &str,
        caller: &[u8; 32],
        key: Option<SessionKey>,
    ) -> Authenticated {
        let session = ClientSession {
            token: token.to_owned(),
            key: key.unwrap_or_else(|| secret.key_for(token, caller)),
            opened_at_ms: 0,
            expires_at_ms: 0,
        };
        let signer = sp_core::sr25519::Pair::from_seed(&[1; 32]);
        let sent = authenticate_request(
            &signer,
            Some(&session),
            "5Server",
            "POST",
            "/v1/miner/work",
            b"{}",
            1_000,
            uuid::Uuid::new_v4(),
        );
        check_headers(
            |n| find_header(&sent.headers, n),
            "5Server",
            1_000,
            SkewWindow::default(),
        )
        .expect("headers")
        .message(*caller, "POST", "/v1/miner/work", b"{}")
    }

    #[test]
    fn a_session_holds_for_its_signer_and_secret_until_it_expires() {
        let secret = SessionSecret([1; 32]);
        let caller = [2u8; 32];
        let token = new_token(10_000);
        let ok = |auth, signer: &[u8; 32], now| secret.verify(auth, signer, now);
        assert!(ok(request(&secret, &token, &caller, None), &caller, 9_999).is_ok());
        // Expired: refused by its text, as unknown (the caller opens another).
        assert!(matches!(
            ok(request(&secret, &token, &caller, None), &caller, 10_000),
            Err(AuthError::UnknownSession(_))
        ));
        // Another signer's request with this token: the key is the caller's.
        assert_eq!(
            ok(request(&secret, &token, &caller, None), &[3; 32], 9_999),
            Err(AuthError::BadSignature)
        );
        // Another run's secret, or a token whose expiry was rewritten.
        let other = SessionSecret([4; 32]);
        assert_eq!(
            other.verify(request(&secret, &token, &caller, None), &caller, 9_999),
            Err(AuthError::BadSignature)
        );
        let (_, nonce) = token.split_once('.').expect("token");
        let later = format!("20000.{nonce}");
        let key = secret.key_for(&token, &caller);
        assert_eq!(
            ok(
                request(&secret, &later, &caller, Some(key)),
                &caller,
                15_000
            ),
            Err(AuthError::BadSignature)
        );
        assert!(matches!(
            ok(request(&secret, "not-a-token", &caller, None), &caller, 0),
            Err(AuthError::UnknownSession(_))
        ));
        assert_eq!(format!("{secret:?}"), "SessionSecret(..)");
        assert!(SessionSecret::from_slice(&[0; 31]).is_none());
        assert!(SessionSecret::from_slice(&[0; 32]).is_some());
    }
}
