//! Replayed signed requests against two orchestrators on one database (a real PostgreSQL and a
//! localnet): every process refuses a uuid it has seen, and a request that may change run state
//! is refused by every process once one has admitted it.

mod common;

use common::*;
use iota_protocol::ErrorCode;
use iota_protocol::api::{WorkRequest, WorkResponse};
use iota_protocol::signing::RequestSigner;
use uuid::Uuid;

const MINERS: [u8; 3] = [1, 2, 3];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_are_refused_wherever_they_could_act() {
    init_tracing();
    let chain = chain_with(&MINERS, &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let run = run_config("replay");
    let a = start(config(&chain, &db, store.path(), run.clone())).await;
    let b = start(config(&chain, &db, store.path(), run.clone())).await;
    let (to_a, to_b) = (Raw::to(&a.base), Raw::to(&b.base));

    // One miner per stage.
    let mut by_stage = [0u8; 3];
    for seed in MINERS {
        let (_, joined) = registered_miner(&a.base, seed).await;
        by_stage[joined.stage as usize] = seed;
    }
    assert!(by_stage.iter().all(|s| *s != 0), "stages {by_stage:?}");

    let post = reqwest::Method::POST;
    let poll_body = serde_json::to_vec(&WorkRequest { max_items: 1 }).expect("json");
    let poll = |raw: &Raw, seed: u8, ts: u64, uuid: Uuid| {
        let raw = Raw::to(&raw.base);
        let body = poll_body.clone();
        async move {
            raw.send_bytes(Call {
                ts,
                uuid,
                ..Call::new(&pair(seed), reqwest::Method::POST, "/v1/miner/work", body)
            })
            .await
        }
    };
    let refused_as_replay = |(status, bytes): (u16, Vec<u8>)| {
        let err: Option<iota_protocol::ApiError> = serde_json::from_slice(&bytes).ok();
        (status, err.map(|e| e.code)) == (401, Some(ErrorCode::Replayed))
    };
    let leased = || {
        let db = db.clone();
        async move {
            let pool = sqlx::PgPool::connect(&db).await.expect("db");
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tasks WHERE status = 'leased'")
                .fetch_one(&pool)
                .await
                .expect("count");
            pool.close().await;
            n
        }
    };

    // A stage-0 poll that starts a sample goes past the poll view to the database, and records
    // its uuid in the shared cache first: replayed to either process, it is refused and leases
    // nothing more.
    let (ts, uuid) = (now_ms(), Uuid::new_v4());
    let (status, bytes) = poll(&to_a, by_stage[0], ts, uuid).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let work: WorkResponse = serde_json::from_slice(&bytes).expect("work response");
    assert_eq!(work.items.len(), 1, "a new sample at stage 0");
    assert_eq!(leased().await, 1);
    for raw in [&to_b, &to_a] {
        assert!(
            refused_as_replay(poll(raw, by_stage[0], ts, uuid).await),
            "a replayed poll that leased work was admitted by {}",
            raw.base
        );
    }
    assert_eq!(leased().await, 1, "a replay leased work");

    // A last-stage poll finds nothing to do (it is answered from the view once the view is
    // ready). The process that answered refuses it again.
    let (ts, uuid) = (now_ms(), Uuid::new_v4());
    let (status, bytes) = poll(&to_b, by_stage[2], ts, uuid).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let idle: WorkResponse = serde_json::from_slice(&bytes).expect("work response");
    assert!(idle.items.is_empty());
    assert!(refused_as_replay(poll(&to_b, by_stage[2], ts, uuid).await));

    // Every other signed route records its uuid in the shared cache before it acts.
    let (ts, uuid) = (now_ms(), Uuid::new_v4());
    let heartbeat = |raw: &Raw| {
        let raw = Raw::to(&raw.base);
        async move {
            raw.send(Call {
                ts,
                uuid,
                ..Call::new(
                    &pair(by_stage[1]),
                    reqwest::Method::POST,
                    "/v1/miner/heartbeat",
                    b"{}".to_vec(),
                )
            })
            .await
        }
    };
    let first = heartbeat(&to_a).await;
    assert_eq!(first.0, 200, "{first:?}");
    for raw in [&to_b, &to_a] {
        let again = heartbeat(raw).await;
        assert_eq!((again.0, code(&again)), (401, Some(ErrorCode::Replayed)));
    }

    // A poll with a body that is not JSON, by a forged signature, is refused for the signature
    // (the body is read before the signature is checked, but judged after).
    let forged = {
        let mut headers = iota_protocol::signing::sign_request(
            &pair(99),
            &to_a.receiver,
            "POST",
            "/v1/miner/work",
            b"not json",
            now_ms(),
            Uuid::new_v4(),
        )
        .headers;
        for h in &mut headers {
            if h.0 == "epistula-signed-by" {
                h.1 = pair(by_stage[1]).ss58();
            }
        }
        let mut req = to_a
            .http
            .request(post, format!("{}/v1/miner/work", to_a.base));
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let resp = req
            .header("content-type", "application/json")
            .body("not json")
            .send()
            .await
            .expect("send");
        let status = resp.status().as_u16();
        let err: iota_protocol::ApiError = resp.json().await.expect("error body");
        (status, err.code)
    };
    assert_eq!(forged, (401, ErrorCode::Unauthenticated));

    a.stop().await;
    b.stop().await;
}
