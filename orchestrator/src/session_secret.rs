//! A run's secret (`runs.session_secret`, drawn once per run): every replica derives a session's
//! key from it and the request alone (see [`crate::http::sessions`]), and the seed of each
//! epoch's draw of merge owners from it and the frozen contributions (see
//! [`SessionSecret::owner_draw_seed`]).

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

/// What the owners of a stage's merge are drawn from: every partition's frozen contributions, in
/// merge order.
pub struct FrozenContributions<'a> {
    /// The epoch.
    pub epoch: u64,
    /// The stage.
    pub stage: u32,
    /// Per partition in order, its contributions' (hotkey, BLAKE3) in merge order.
    pub partitions: Vec<Vec<(&'a str, &'a str)>>,
}

impl SessionSecret {
    /// The seed of a stage's owner draw: the run's secret (so no miner can compute it) keyed over
    /// the contributions frozen when merging starts (so nobody, the operator included, knows it
    /// before uploads are frozen). A key derived for this use alone: no session key can equal it.
    pub fn owner_draw_seed(&self, frozen: &FrozenContributions<'_>) -> [u8; 32] {
        let mut key_material = blake3::Hasher::new_derive_key("iota orchestrator merge owners v1");
        key_material.update(&self.0);
        let key = *key_material.finalize().as_bytes();
        let mut h = blake3::Hasher::new_keyed(&key);
        h.update(&frozen.epoch.to_le_bytes());
        h.update(&frozen.stage.to_le_bytes());
        for contributions in &frozen.partitions {
            h.update(&(contributions.len() as u64).to_le_bytes());
            for (hotkey, hash) in contributions {
                // Length-prefixed, so that no two lists hash alike.
                for field in [hotkey, hash] {
                    h.update(&(field.len() as u64).to_le_bytes());
                    h.update(field.as_bytes());
                }
            }
        }
        *h.finalize().as_bytes()
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

    #[test]
    fn the_owner_seed_depends_on_the_secret_and_every_frozen_contribution() {
        let secret = SessionSecret([7; 32]);
        let frozen = |epoch: u64, hash: &'static str| FrozenContributions {
            epoch,
            stage: 1,
            partitions: vec![vec![("a", "01"), ("b", hash)], vec![("a", "03")]],
        };
        let seed = secret.owner_draw_seed(&frozen(4, "02"));
        assert_eq!(
            seed,
            secret.owner_draw_seed(&frozen(4, "02")),
            "a pure function"
        );
        assert_ne!(
            seed,
            secret.owner_draw_seed(&frozen(4, "0f")),
            "one upload changed"
        );
        assert_ne!(
            seed,
            secret.owner_draw_seed(&frozen(5, "02")),
            "another epoch"
        );
        assert_ne!(
            seed,
            SessionSecret([8; 32]).owner_draw_seed(&frozen(4, "02")),
            "another run's secret"
        );
        // A contribution moved to the next partition is another freeze.
        let moved = FrozenContributions {
            epoch: 4,
            stage: 1,
            partitions: vec![vec![("a", "01")], vec![("b", "02"), ("a", "03")]],
        };
        assert_ne!(seed, secret.owner_draw_seed(&moved));
    }
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
