//! Sessions: a MAC under a session's key stands in for an sr25519 signature, and for nothing
//! more. Against a real PostgreSQL and a localnet. One test, so that the process-wide metrics it
//! reads count only its own requests.

use crate::common;

use std::time::Duration;

use common::*;
use iota_protocol::api::{OpenSessionRequest, OpenSessionResponse, WorkRequest};
use iota_protocol::session::{
    ClientSession, Handshake, SESSIONS_PATH, SessionKey, decode_public_hex,
};
use iota_protocol::signing::RequestSigner;
use iota_protocol::{ApiClient, ErrorCode, RetryPolicy};
use sp_core::Pair as _;
use uuid::Uuid;

const MINER: u8 = 1;
const OTHER_MINER: u8 = 2;
const VALIDATOR: u8 = 10;
const STRANGER: u8 = 99;

/// Opens a session for `seed` by hand: the status, and the session when it opened.
async fn open(raw: &Raw, seed: u8) -> (u16, Option<ClientSession>) {
    let handshake = Handshake::new();
    let body = serde_json::to_vec(&OpenSessionRequest {
        public_key: handshake.public_hex(),
    })
    .expect("json");
    let opened_at_ms = now_ms();
    let (status, bytes) = raw
        .send_bytes(Call::new(
            &pair(seed),
            reqwest::Method::POST,
            SESSIONS_PATH,
            body,
        ))
        .await;
    if status != 200 {
        return (status, None);
    }
    let answer: OpenSessionResponse = serde_json::from_slice(&bytes).expect("answer");
    let key = handshake
        .finish(
            &decode_public_hex(&answer.public_key).expect("point"),
            &decode_public_hex(&answer.sealed_key).expect("sealed key"),
            &answer.session,
            &pair(seed).public().0,
            &raw.receiver,
        )
        .expect("key");
    let session = ClientSession {
        token: answer.session,
        key,
        opened_at_ms,
        expires_at_ms: answer.expires_at_ms,
    };
    (status, Some(session))
}

/// A request of `seed`'s made with `session`'s key.
fn in_session<'a>(
    seed: &'a sp_core::sr25519::Pair,
    session: &'a ClientSession,
    method: reqwest::Method,
    path: &'a str,
    body: &[u8],
) -> Call<'a> {
    Call {
        session: Some(session),
        ..Call::new(seed, method, path, body.to_vec())
    }
}

/// `iota_sessions_opened_total` on the orchestrator at `base` (0 before the first).
async fn sessions_opened(base: &str) -> u64 {
    metrics_text(base)
        .await
        .lines()
        .find_map(|l| l.strip_prefix("iota_sessions_opened_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_stands_in_for_signatures_and_for_nothing_more() {
    init_tracing();
    let chain = chain_with(&[MINER, OTHER_MINER], &[VALIDATOR]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let cfg = config(&chain, &db, store.path(), run_config("sessions"));
    let first = start(cfg.clone()).await;
    let raw = Raw::to(&first.base);
    let post = reqwest::Method::POST;
    let get = reqwest::Method::GET;
    let registered = raw
        .signed(
            &pair(MINER),
            post.clone(),
            "/v1/miner/register",
            register_body(),
        )
        .await;
    assert_eq!(registered.0, 200, "{registered:?}");

    let (status, session) = open(&raw, MINER).await;
    assert_eq!(status, 200);
    let session = session.expect("a session");
    let miner = pair(MINER);
    let poll = serde_json::to_vec(&WorkRequest { max_items: 1 }).expect("json");

    // Requests in the session pass, on the work poll's own gate and the signed routes' one.
    for (path, body) in [
        ("/v1/miner/heartbeat", &b"{}"[..]),
        ("/v1/miner/work", &poll),
    ] {
        let ok = raw
            .send(in_session(&miner, &session, post.clone(), path, body))
            .await;
        assert_eq!(ok.0, 200, "{path}: {ok:?}");
    }

    // Refused as a forged signature would be: a MAC under another key, a MAC for another path,
    // and the session named by another signer (its key is its opener's).
    let wrong_key = ClientSession {
        key: SessionKey::from_bytes([7; 32]),
        ..session.clone()
    };
    let forged = raw
        .send(in_session(
            &miner,
            &wrong_key,
            post.clone(),
            "/v1/miner/heartbeat",
            b"{}",
        ))
        .await;
    assert_eq!(
        (forged.0, code(&forged)),
        (401, Some(ErrorCode::Unauthenticated))
    );
    let other_path = raw
        .send(Call {
            signed_as: Some(("POST", "/v1/miner/register")),
            ..in_session(&miner, &session, post.clone(), "/v1/miner/heartbeat", b"{}")
        })
        .await;
    assert_eq!(
        (other_path.0, code(&other_path)),
        (401, Some(ErrorCode::Unauthenticated))
    );
    let other_method = raw
        .send(Call {
            signed_as: Some(("GET", "/v1/miner/heartbeat")),
            ..in_session(&miner, &session, post.clone(), "/v1/miner/heartbeat", b"{}")
        })
        .await;
    assert_eq!(
        (other_method.0, code(&other_method)),
        (401, Some(ErrorCode::Unauthenticated))
    );
    let other_miner = pair(OTHER_MINER);
    let borrowed = raw
        .send(in_session(
            &other_miner,
            &session,
            post.clone(),
            "/v1/miner/heartbeat",
            b"{}",
        ))
        .await;
    assert_eq!(
        (borrowed.0, code(&borrowed)),
        (401, Some(ErrorCode::Unauthenticated))
    );

    // The clock window and the replay check hold as for signatures.
    for ts in [now_ms() - 60_000, now_ms() + 60_000] {
        let skewed = raw
            .send(Call {
                ts,
                ..in_session(&miner, &session, post.clone(), "/v1/miner/heartbeat", b"{}")
            })
            .await;
        assert_eq!((skewed.0, code(&skewed)), (401, Some(ErrorCode::ClockSkew)));
    }
    for path in ["/v1/miner/heartbeat", "/v1/miner/work"] {
        let uuid = Uuid::new_v4();
        let body: &[u8] = if path.ends_with("work") { &poll } else { b"{}" };
        let call = || Call {
            uuid,
            ..in_session(&miner, &session, post.clone(), path, body)
        };
        let once = raw.send(call()).await;
        assert_eq!(once.0, 200, "{path}: {once:?}");
        let again = raw.send(call()).await;
        assert_eq!(
            (again.0, code(&again)),
            (401, Some(ErrorCode::Replayed)),
            "{path}"
        );
    }

    // A session gives no permit: the miner's is refused on a validator route, a validator's
    // passes.
    let refused = raw
        .send(in_session(
            &miner,
            &session,
            get.clone(),
            "/v1/validator/disputes",
            b"",
        ))
        .await;
    assert_eq!(
        (refused.0, code(&refused)),
        (403, Some(ErrorCode::NotValidator))
    );
    let (status, validator_session) = open(&raw, VALIDATOR).await;
    assert_eq!(status, 200);
    let validator = pair(VALIDATOR);
    let disputes = raw
        .send(in_session(
            &validator,
            &validator_session.expect("a validator's session"),
            get.clone(),
            "/v1/validator/disputes",
            b"",
        ))
        .await;
    assert_eq!(disputes.0, 200, "{disputes:?}");

    // Only a member opens one, only with a signature, and only with a valid point.
    assert_eq!(open(&raw, STRANGER).await.0, 403);
    let from_session = raw
        .send(in_session(
            &miner,
            &session,
            post.clone(),
            SESSIONS_PATH,
            &serde_json::to_vec(&OpenSessionRequest {
                public_key: Handshake::new().public_hex(),
            })
            .expect("json"),
        ))
        .await;
    assert_eq!(
        (from_session.0, code(&from_session)),
        (401, Some(ErrorCode::Unauthenticated))
    );
    for public_key in ["00".repeat(32), "ff".repeat(32), "abc".into()] {
        let bad = raw
            .signed(
                &miner,
                post.clone(),
                SESSIONS_PATH,
                serde_json::to_vec(&OpenSessionRequest { public_key }).expect("json"),
            )
            .await;
        assert_eq!((bad.0, code(&bad)), (400, Some(ErrorCode::BadRequest)));
    }

    // A second replica of the run takes the first's session (nothing to look up), and refuses
    // its own short ones once they expire, as unknown: the caller opens another.
    let mut brief = cfg.clone();
    brief.limits.session_ttl = Duration::from_secs(1);
    let second = start(brief).await;
    let raw_second = Raw::to(&second.base);
    let elsewhere = raw_second
        .send(in_session(
            &miner,
            &session,
            post.clone(),
            "/v1/miner/heartbeat",
            b"{}",
        ))
        .await;
    assert_eq!(elsewhere.0, 200, "{elsewhere:?}");
    let (status, short) = open(&raw_second, MINER).await;
    assert_eq!(status, 200);
    let short = short.expect("a short session");
    assert!(short.expires_at_ms <= now_ms() + 1_000);
    eventually(
        "the short session to expire",
        Duration::from_secs(10),
        || {
            let raw = raw_second.clone();
            let (miner, short, post) = (pair(MINER), short.clone(), post.clone());
            async move {
                let answer = raw
                    .send(in_session(
                        &miner,
                        &short,
                        post,
                        "/v1/miner/heartbeat",
                        b"{}",
                    ))
                    .await;
                (code(&answer) == Some(ErrorCode::UnknownSession)).then_some(answer.0)
            }
        },
    )
    .await;
    second.stop().await;

    // The API client opens one session for all its signed requests...
    let before = sessions_opened(&first.base).await;
    let client = ApiClient::connect(&first.base, signer(OTHER_MINER), RetryPolicy::default())
        .await
        .expect("connect");
    client.register(cpu_capacity()).await.expect("register");
    for _ in 0..3 {
        client.heartbeat(None).await.expect("heartbeat");
    }
    client.work(1).await.expect("work");
    assert_eq!(sessions_opened(&first.base).await - before, 1);
    // ...opens another when the server does not take its session (the run made anew under the
    // same name, with a new secret), and goes on...
    let address = first.base.trim_start_matches("http://").to_owned();
    first.stop().await;
    let pool = iota_orchestrator::connect_db(&db, 2).await.expect("db");
    sqlx::query("UPDATE runs SET session_secret = decode(repeat('ab', 32), 'hex')")
        .execute(&pool)
        .await
        .expect("new secret");
    let restarted = start_on(cfg.clone(), &address).await;
    client
        .heartbeat(None)
        .await
        .expect("heartbeat in a new session");
    assert_eq!(sessions_opened(&restarted.base).await - before, 2);
    // ...and signs each request itself when told to.
    let signing = client.clone().with_sessions(false);
    signing.heartbeat(None).await.expect("signed heartbeat");
    assert_eq!(sessions_opened(&restarted.base).await - before, 2);
    assert_eq!(signing.hotkey(), pair(OTHER_MINER).ss58());
    // A refusal that is not about the session (a validator is no miner) opens no other.
    let outsider = ApiClient::connect(&restarted.base, signer(VALIDATOR), RetryPolicy::default())
        .await
        .expect("connect");
    let refused = outsider.heartbeat(None).await.expect_err("not a miner");
    assert_eq!(refused.code(), Some(ErrorCode::NotAMiner));
    assert_eq!(sessions_opened(&restarted.base).await - before, 3);
    restarted.stop().await;
}
