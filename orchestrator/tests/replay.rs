//! Replayed signed requests against two orchestrators on one database (a real PostgreSQL and a
//! localnet): every process refuses a uuid it has seen, and a request that may change run state
//! is refused by every process once one has admitted it.

use crate::common;

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

/// A replay whose headers arrive inside the clock window and whose body comes slowly is refused
/// when the body has come, however long after the window that is. The headers pass the clock
/// check, but the uuid is recorded once the body is in (up to its deadline later); the shared
/// cache once dropped uuids as soon as the window had passed, so a replay sent to another
/// process (which never saw the uuid) and finished after the next prune was admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_body_comes_after_the_window_is_refused() {
    init_tracing();
    let chain = chain_with(&MINERS, &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("slow-replay");
    // The miner stays registered while the test waits without heartbeats.
    run.heartbeat_timeout_s = 60;
    let mut cfg = config(&chain, &db, store.path(), run);
    // A short window, so that it passes quickly.
    cfg.skew = iota_protocol::SkewWindow {
        max_age_ms: 2_000,
        max_future_ms: 1_000,
    };
    let a = start(cfg.clone()).await;
    let b = start(cfg).await;
    let seed = MINERS[0];
    registered_miner(&a.base, seed).await;

    let (path, body) = ("/v1/miner/heartbeat", b"{}");
    let (ts, uuid) = (now_ms(), Uuid::new_v4());
    let first = Raw::to(&a.base)
        .send(Call {
            ts,
            uuid,
            ..Call::new(&pair(seed), reqwest::Method::POST, path, body.to_vec())
        })
        .await;
    assert_eq!(first.0, 200, "{first:?}");

    // The same request to the other process, all but its last byte, inside the window.
    let replay = all_but_the_last_byte(&b.base, seed, path, body, ts, uuid).await;
    assert!(now_ms() < ts + 2_000, "the replay's headers were late");

    // Past the clock window (and the second the shared cache once kept beyond it), until the
    // leader's housekeeping has pruned the cache: a row older than anything else is gone.
    let pool = sqlx::PgPool::connect(&db).await.expect("db");
    tokio::time::sleep(std::time::Duration::from_millis(
        (ts + 4_500).saturating_sub(now_ms()),
    ))
    .await;
    until_pruned(&pool).await;

    let answer = the_last_byte(replay, body).await;
    assert!(
        answer.starts_with("HTTP/1.1 401") && answer.contains("\"replayed\""),
        "the slow replay was not refused as a replay: {answer}"
    );
    pool.close().await;
    a.stop().await;
    b.stop().await;
}

/// Replays of a hotkey's request are refused without spending its rate limit: someone who
/// captured one request could otherwise re-send it until the hotkey's own requests were refused
/// with `rate_limited`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_do_not_spend_the_signers_quota() {
    init_tracing();
    let chain = chain_with(&MINERS, &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&chain, &db, store.path(), run_config("quota"));
    cfg.limits.per_hotkey_rps = 1;
    cfg.limits.per_hotkey_burst = 4;
    let a = start(cfg).await;
    let seed = MINERS[1];
    // One request of the burst.
    registered_miner(&a.base, seed).await;
    let raw = Raw::to(&a.base);
    let signer = pair(seed);
    let heartbeat = |ts, uuid| Call {
        ts,
        uuid,
        ..Call::new(
            &signer,
            reqwest::Method::POST,
            "/v1/miner/heartbeat",
            b"{}".to_vec(),
        )
    };
    let (ts, uuid) = (now_ms(), Uuid::new_v4());
    let first = raw.send(heartbeat(ts, uuid)).await;
    assert_eq!(first.0, 200, "{first:?}");
    for _ in 0..10 {
        let again = raw.send(heartbeat(ts, uuid)).await;
        assert_eq!((again.0, code(&again)), (401, Some(ErrorCode::Replayed)));
    }
    let own = raw.send(heartbeat(now_ms(), Uuid::new_v4())).await;
    assert_eq!(
        own.0, 200,
        "the signer's own request after the replays: {own:?}"
    );
    a.stop().await;
}

/// A process that does not lead the run still forgets rate-limit keys back at full quota: each
/// public request from a new address adds one, and only the leader's housekeeping once removed
/// them, so a follower's tables grew with every address that ever reached it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_forgets_the_addresses_it_limited() {
    init_tracing();
    let chain = chain_with(&[], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    // The run's leader lock is held here, so the orchestrator never leads.
    let mut lock = <sqlx::PgConnection as sqlx::Connection>::connect(&db)
        .await
        .expect("db");
    let held: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2::int)")
        .bind(0x696f_7464i32)
        .bind(1i32)
        .fetch_one(&mut lock)
        .await
        .expect("lock");
    assert!(held);
    let mut cfg = config(&chain, &db, store.path(), run_config("follower"));
    // Eight requests from an address take its key 8 s to be back at full quota: no shrink can
    // forget it before the first look below.
    cfg.limits.per_ip_rps = 1;
    let a = start(cfg).await;
    for last in 2..10u8 {
        let from = reqwest::Client::builder()
            .local_address(std::net::IpAddr::from([127, 0, 0, last]))
            .build()
            .expect("client");
        for _ in 0..8 {
            let r = from
                .get(format!("{}/v1/status", a.base))
                .send()
                .await
                .expect("status");
            assert!(r.status().is_success());
        }
    }
    let addresses = || async {
        metrics_text(&a.base)
            .await
            .lines()
            .find_map(|l| l.strip_prefix("iota_rate_limit_keys{scope=\"ip\"} "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .expect("the gauge")
    };
    // The gauge is the process's, and the orchestrators of the tests running beside this one
    // set it too: read it until this one's count shows (well inside the 8 s above).
    eventually(
        "each address holds a key",
        std::time::Duration::from_secs(5),
        || async { (addresses().await >= 9.0).then_some(()) },
    )
    .await;
    eventually(
        "the follower forgets the addresses",
        std::time::Duration::from_secs(30),
        || async { (addresses().await <= 1.0).then_some(()) },
    )
    .await;
    let health: iota_protocol::api::Health = reqwest::get(format!("{}/healthz", a.base))
        .await
        .expect("health")
        .json()
        .await
        .expect("json");
    assert!(!health.leader, "the test held the lock");
    a.stop().await;
}

/// Runs on one database share the replay cache, and each run's driver prunes it: a uuid is kept
/// as long as the process that recorded it needs, whatever another run's process would keep
/// its own for. Each driver once pruned every row by its own run's retention, so a run with
/// small bodies and a short body timeout dropped the uuids of a run with large uploads while a
/// slow replay of one could still come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_runs_prune_keeps_a_uuid_for_as_long_as_its_own_run_needs() {
    init_tracing();
    let chain = chain_with(&MINERS, &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    // A run whose uuids need about 7 s (a short window and body timeout), and one whose need
    // more than 30 s.
    let mut quick = config(&chain, &db, store.path(), run_config("quick"));
    quick.skew = iota_protocol::SkewWindow {
        max_age_ms: 2_000,
        max_future_ms: 1_000,
    };
    quick.limits.body_timeout = std::time::Duration::from_secs(1);
    let mut slow_run = run_config("slow");
    slow_run.heartbeat_timeout_s = 600;
    let slow = config(&chain, &db, store.path(), slow_run);
    let a = start(quick).await;
    let b = start(slow).await;
    let seed = MINERS[2];
    registered_miner(&b.base, seed).await;
    let uuid = Uuid::new_v4();
    let recorded = Raw::to(&b.base)
        .send(Call {
            uuid,
            ..Call::new(
                &pair(seed),
                reqwest::Method::POST,
                "/v1/miner/heartbeat",
                b"{}".to_vec(),
            )
        })
        .await;
    assert_eq!(recorded.0, 200, "{recorded:?}");
    let pool = sqlx::PgPool::connect(&db).await.expect("db");
    // Past the quick run's retention, until both drivers have pruned.
    tokio::time::sleep(std::time::Duration::from_secs(8)).await;
    until_pruned(&pool).await;
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM request_uuids WHERE uuid = $1")
        .bind(uuid)
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(
        kept, 1,
        "the slow run's uuid was pruned by the quick run's rule"
    );
    pool.close().await;
    a.stop().await;
    b.stop().await;
}

/// Until a leader's housekeeping has pruned the replay cache after this call: a row expired
/// before anything else is gone.
async fn until_pruned(pool: &sqlx::PgPool) {
    let marker = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO request_uuids (uuid, seen_at, expires_at)
         VALUES ($1, now() - interval '1 hour', now() - interval '1 hour')",
    )
    .bind(marker)
    .execute(pool)
    .await
    .expect("marker");
    eventually(
        "the replay cache is pruned",
        std::time::Duration::from_secs(20),
        || async move {
            let left: i64 =
                sqlx::query_scalar("SELECT count(*) FROM request_uuids WHERE uuid = $1")
                    .bind(marker)
                    .fetch_one(pool)
                    .await
                    .expect("count");
            (left == 0).then_some(())
        },
    )
    .await;
}

/// A replay of a work poll to the process that answered the original, whose headers come inside
/// the clock window and whose body comes after a later request has made that process forget the
/// original's second: memory cannot tell it from a fresh poll, and the original (answered from
/// the poll view) is in memory only, so the replay is refused as too old. It was admitted as
/// fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_replay_of_a_poll_to_the_same_process_is_refused() {
    init_tracing();
    let chain = chain_with(&MINERS, &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("slow-poll-replay");
    run.heartbeat_timeout_s = 60;
    let mut cfg = config(&chain, &db, store.path(), run);
    cfg.skew = iota_protocol::SkewWindow {
        max_age_ms: 2_000,
        max_future_ms: 1_000,
    };
    let a = start(cfg).await;
    // A miner of the last stage: it never starts samples, so its polls are answered from the
    // poll view and never reach the database.
    let mut seed = None;
    for s in MINERS {
        let (_, joined) = registered_miner(&a.base, s).await;
        if joined.stage == 2 {
            seed = Some(s);
        }
    }
    let seed = seed.expect("a miner of the last stage");
    let path = "/v1/miner/work";
    let body = serde_json::to_vec(&WorkRequest { max_items: 1 }).expect("json");
    let (ts, uuid) = (now_ms(), Uuid::new_v4());
    let first = Raw::to(&a.base)
        .send(Call {
            ts,
            uuid,
            ..Call::new(&pair(seed), reqwest::Method::POST, path, body.clone())
        })
        .await;
    assert_eq!(first.0, 200, "{first:?}");

    let replay = all_but_the_last_byte(&a.base, seed, path, &body, ts, uuid).await;
    assert!(now_ms() < ts + 2_000, "the replay's headers were late");

    // Past the window of the original's second, a poll with a uuid of the same memory shard
    // makes the process forget that second.
    tokio::time::sleep(std::time::Duration::from_millis(
        ((ts / 1000 + 1) * 1000 + 2_500).saturating_sub(now_ms()),
    ))
    .await;
    let mut later = *Uuid::new_v4().as_bytes();
    later[0] = uuid.as_bytes()[0];
    let next = Raw::to(&a.base)
        .send(Call {
            ts: now_ms(),
            uuid: Uuid::from_bytes(later),
            ..Call::new(&pair(seed), reqwest::Method::POST, path, body.clone())
        })
        .await;
    assert_eq!(next.0, 200, "{next:?}");

    let answer = the_last_byte(replay, &body).await;
    assert!(
        answer.starts_with("HTTP/1.1 401") && answer.contains("\"clock_skew\""),
        "the slow replay of a poll was not refused: {answer}"
    );
    a.stop().await;
}

/// Sends `POST path` with `body` signed by `seed` at `ts` with `uuid`, all but the body's last
/// byte; the open connection (the rest is the caller's to send).
async fn all_but_the_last_byte(
    base: &str,
    seed: u8,
    path: &str,
    body: &[u8],
    ts: u64,
    uuid: Uuid,
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let signed = iota_protocol::signing::sign_request(
        &pair(seed),
        &pair(200).ss58(),
        "POST",
        path,
        body,
        ts,
        uuid,
    );
    let addr = base.trim_start_matches("http://");
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (name, value) in signed.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(head.as_bytes()).await.expect("head");
    stream
        .write_all(&body[..body.len() - 1])
        .await
        .expect("all but the last byte");
    stream
}

/// Sends the last byte of `body` on `stream` (see [`all_but_the_last_byte`]) and reads the
/// answer.
async fn the_last_byte(mut stream: tokio::net::TcpStream, body: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(&body[body.len() - 1..])
        .await
        .expect("last byte");
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        stream.read_to_end(&mut answer),
    )
    .await
    .expect("an answer")
    .expect("read");
    String::from_utf8_lossy(&answer).into_owned()
}
