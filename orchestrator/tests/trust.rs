//! Who may call what, and what an upload must be: against a real PostgreSQL and a localnet.

use crate::common;

use std::time::Duration;

use common::*;
use iota_protocol::api::*;
use iota_protocol::blob::blake3_hex;
use iota_protocol::signing::{RequestSigner, find_header, sign_request};
use iota_protocol::tensor::{encode_boundary_f32, encode_boundary_i8};
use iota_protocol::{ApiClient, ApiError, ErrorCode, RetryPolicy};
use uuid::Uuid;

const MINER: u8 = 1;
const OTHER_MINER: u8 = 2;
const VALIDATOR: u8 = 10;
const STRANGER: u8 = 99;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_are_checked_and_bad_uploads_leave_nothing() {
    init_tracing();
    let chain = chain_with(&[MINER, OTHER_MINER], &[VALIDATOR]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let run = run_config("trust");
    let mut cfg = config(&chain, &db, store.path(), run.clone());
    // Short, so that a body that never comes is answered within the test's patience.
    cfg.limits.body_timeout = Duration::from_secs(1);
    let orch = start(cfg).await;
    let raw = Raw {
        http: reqwest::Client::new(),
        base: orch.base.clone(),
        receiver: pair(200).ss58(),
    };
    let register_body = register_body();
    let post = reqwest::Method::POST;

    // A registered miner is accepted; an unregistered hotkey is refused.
    let ok = raw
        .signed(
            &pair(MINER),
            post.clone(),
            "/v1/miner/register",
            register_body.clone(),
        )
        .await;
    assert_eq!(ok.0, 200, "{ok:?}");
    // A throughput past the bound: two such miners on one stage once made routing's weight sum
    // infinite, and the draw over it panicked (in handlers and in the phase driver).
    for (path, body) in [
        (
            "/v1/miner/register",
            r#"{"capacity":{"device":"cpu","memory_bytes":1073741824,"tokens_per_s":1e308}}"#,
        ),
        ("/v1/miner/heartbeat", r#"{"tokens_per_s":1e308}"#),
        ("/v1/miner/heartbeat", r#"{"tokens_per_s":-1}"#),
    ] {
        let refused = raw
            .signed(&pair(MINER), post.clone(), path, body.as_bytes().to_vec())
            .await;
        assert_eq!(
            (refused.0, code(&refused)),
            (400, Some(ErrorCode::BadRequest)),
            "{path} {body}: {refused:?}"
        );
    }
    let heartbeat = raw
        .signed(
            &pair(MINER),
            post.clone(),
            "/v1/miner/heartbeat",
            br#"{"tokens_per_s":250.5}"#.to_vec(),
        )
        .await;
    assert_eq!(heartbeat.0, 200, "{heartbeat:?}");
    let stranger = raw
        .signed(
            &pair(STRANGER),
            post.clone(),
            "/v1/miner/register",
            register_body.clone(),
        )
        .await;
    assert_eq!(
        (stranger.0, code(&stranger)),
        (403, Some(ErrorCode::NotRegistered))
    );
    // The caller is checked before its body is read: a stranger announcing a large body and
    // sending none is answered at once, not held (with a buffer) until the body arrives. The
    // work poll checks its callers itself; the other routes through the signed gate.
    // (A poll's body is read before its signature is checked, so it may be at most 64 KiB.)
    for (path, len) in [("/v1/miner/work", 60_000), ("/v1/miner/heartbeat", 500_000)] {
        let answer = announced_body_never_sent(&orch.base, &raw.receiver, STRANGER, path, len)
            .await
            .unwrap_or_else(|| panic!("{path}: no answer while the announced body was not sent"));
        assert!(answer.starts_with("HTTP/1.1 403"), "{path}: {answer}");
    }
    // A registered miner whose body never comes is answered 408 once its time is up (the base
    // timeout plus a second per MiB declared), instead of holding the request for good.
    for path in ["/v1/miner/work", "/v1/miner/heartbeat"] {
        let answer = announced_body_never_sent(&orch.base, &raw.receiver, MINER, path, 1000)
            .await
            .unwrap_or_else(|| panic!("{path}: a body that never came held the request"));
        assert!(answer.starts_with("HTTP/1.1 408"), "{path}: {answer}");
        assert!(answer.contains("request_timeout"), "{path}: {answer}");
    }
    // A body that cannot be read (a malformed chunk) is a bad request, not one too large.
    let answer = malformed_chunked_body(&orch.base, &raw.receiver, MINER, "/v1/miner/heartbeat")
        .await
        .expect("an answer to a malformed body");
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("bad_request"), "{answer}");

    // A forged signature: signed by another key but claiming to be the miner.
    let forged = forged_heartbeat(&raw).await;
    assert_eq!(
        (forged.0, code(&forged)),
        (401, Some(ErrorCode::Unauthenticated))
    );

    // Stale and future timestamps.
    let hb = b"{}".to_vec();
    let stale = raw
        .send(Call {
            ts: now_ms() - 60_000,
            ..Call::new(
                &pair(MINER),
                post.clone(),
                "/v1/miner/heartbeat",
                hb.clone(),
            )
        })
        .await;
    assert_eq!((stale.0, code(&stale)), (401, Some(ErrorCode::ClockSkew)));
    let future = raw
        .send(Call {
            ts: now_ms() + 60_000,
            ..Call::new(
                &pair(MINER),
                post.clone(),
                "/v1/miner/heartbeat",
                hb.clone(),
            )
        })
        .await;
    assert_eq!((future.0, code(&future)), (401, Some(ErrorCode::ClockSkew)));

    // A replayed uuid: the first use passes, the identical second one is refused.
    let uuid = Uuid::new_v4();
    let ts = now_ms();
    let first = raw
        .send(Call {
            ts,
            uuid,
            ..Call::new(
                &pair(MINER),
                post.clone(),
                "/v1/miner/heartbeat",
                hb.clone(),
            )
        })
        .await;
    assert_eq!(first.0, 200, "{first:?}");
    let replay = raw
        .send(Call {
            ts,
            uuid,
            ..Call::new(
                &pair(MINER),
                post.clone(),
                "/v1/miner/heartbeat",
                hb.clone(),
            )
        })
        .await;
    assert_eq!((replay.0, code(&replay)), (401, Some(ErrorCode::Replayed)));

    // A signature for another path, and for another method.
    let other_path = raw
        .send(Call {
            signed_as: Some(("POST", "/v1/miner/heartbeat")),
            ..Call::new(&pair(MINER), post.clone(), "/v1/miner/work", hb.clone())
        })
        .await;
    assert_eq!(
        (other_path.0, code(&other_path)),
        (401, Some(ErrorCode::Unauthenticated))
    );
    let other_method = raw
        .send(Call {
            signed_as: Some(("POST", "/v1/miner/merges")),
            ..Call::new(
                &pair(MINER),
                reqwest::Method::GET,
                "/v1/miner/merges",
                Vec::new(),
            )
        })
        .await;
    assert_eq!(
        (other_method.0, code(&other_method)),
        (401, Some(ErrorCode::Unauthenticated))
    );

    // A miner calling a validator endpoint; the validator may.
    let as_miner = raw
        .signed(
            &pair(MINER),
            reqwest::Method::GET,
            "/v1/validator/disputes",
            Vec::new(),
        )
        .await;
    assert_eq!(
        (as_miner.0, code(&as_miner)),
        (403, Some(ErrorCode::NotValidator))
    );
    let as_validator = raw
        .signed(
            &pair(VALIDATOR),
            reqwest::Method::GET,
            "/v1/validator/disputes",
            Vec::new(),
        )
        .await;
    assert_eq!(as_validator.0, 200, "{as_validator:?}");

    // A validator's submissions are kept to what they can be: they are stored and served to
    // anyone (`GET /v1/scores`), and a draw must be redone from the block it names.
    let score = |hotkey: String| serde_json::json!({ "hotkey": hotkey, "score": 1.0 });
    let weights = |uids: Vec<u16>| {
        let n = uids.len();
        serde_json::json!({ "block": 1, "uids": uids, "weights": vec![1u16; n] })
    };
    let bounded = [
        (
            "/v1/validator/epochs/0/scores",
            serde_json::json!({ "scores": [score("x".repeat(65))] }),
        ),
        (
            "/v1/validator/epochs/0/scores",
            serde_json::json!({ "scores": [], "weights": weights((0..4097).collect()) }),
        ),
        (
            "/v1/validator/epochs/0/scores",
            serde_json::json!({ "scores": [], "weights": weights(vec![3, 3]) }),
        ),
        (
            "/v1/validator/epochs/0/spot-checks",
            serde_json::json!({ "seed": "00", "seed_block": u64::MAX, "checks": [] }),
        ),
    ];
    for (path, body) in bounded {
        let refused = raw
            .signed(
                &pair(VALIDATOR),
                post.clone(),
                path,
                serde_json::to_vec(&body).expect("json"),
            )
            .await;
        assert_eq!(
            (refused.0, code(&refused)),
            (400, Some(ErrorCode::BadRequest)),
            "{path} {body}: {refused:?}"
        );
    }
    let within = raw
        .signed(
            &pair(VALIDATOR),
            post.clone(),
            "/v1/validator/epochs/0/scores",
            serde_json::to_vec(&serde_json::json!({
                "scores": [score(pair(MINER).ss58())],
                "weights": weights((0..4096).collect()),
            }))
            .expect("json"),
        )
        .await;
    assert_eq!(within.0, 200, "{within:?}");
    // U+0000 in a query, which PostgreSQL cannot store: the caller's fault, not the server's.
    let nul = reqwest::get(format!("{}/v1/miners?after=a%00b", orch.base))
        .await
        .expect("miners");
    assert_eq!(nul.status().as_u16(), 400, "{:?}", nul.text().await);

    // A JSON body over the limit is refused on its declared length, before a byte of it is
    // read (spoken over a raw socket: an HTTP client would race the early answer with its
    // still-unsent body).
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = orch.base.trim_start_matches("http://");
        let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = format!(
            "POST /v1/miner/heartbeat HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            2 << 20
        );
        sock.write_all(head.as_bytes()).await.expect("write");
        let mut answer = vec![0u8; 4096];
        let n = sock.read(&mut answer).await.expect("read");
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("payload_too_large"), "{answer}");
    }

    // Uploads. Find the stage-0 miner and lease a forward hop.
    let client = |seed: u8| {
        ApiClient::new(
            orch.base.clone(),
            signer(seed),
            pair(200).ss58(),
            RetryPolicy::default(),
        )
        .expect("client")
    };
    let a = client(MINER);
    let b = client(OTHER_MINER);
    let sa = a
        .register(Capacity {
            device: "cpu".into(),
            memory_bytes: 1 << 30,
            tokens_per_s: 100.0,
        })
        .await
        .expect("a");
    let sb = b
        .register(Capacity {
            device: "cpu".into(),
            memory_bytes: 1 << 30,
            tokens_per_s: 100.0,
        })
        .await
        .expect("b");
    assert_ne!(sa.stage, sb.stage, "two miners spread over stages");
    let (stage0, other) = if sa.stage == 0 { (&a, &b) } else { (&b, &a) };
    let item = stage0
        .work(1)
        .await
        .expect("work")
        .items
        .pop()
        .expect("a new sample at stage 0");
    assert_eq!((item.stage, item.direction), (0, Direction::Forward));

    let shape = run.boundary_shape();
    let n = (shape[0] * shape[1] * shape[2]) as usize;
    let files_before = files_under(store.path());
    let rows = |sql: &'static str| {
        let db = db.clone();
        async move {
            let pool = sqlx::PgPool::connect(&db).await.expect("db");
            let n: i64 = sqlx::query_scalar(sql)
                .fetch_one(&pool)
                .await
                .expect("count");
            pool.close().await;
            n
        }
    };
    let staged_before = rows("SELECT count(*) FROM tasks WHERE staged_output IS NOT NULL").await;
    let upload = |bytes: Vec<u8>, declared: String| {
        let raw = &raw;
        let path = format!(
            "/v1/miner/tasks/{}/output?lease={}&blake3={declared}",
            item.task_id, item.lease
        );
        let who = if std::ptr::eq(stage0, &a) {
            MINER
        } else {
            OTHER_MINER
        };
        async move {
            raw.signed(&pair(who), reqwest::Method::PUT, &path, bytes)
                .await
        }
    };
    // Each bad in one way only, and refused for it: the message names what is wrong.
    type Case = (
        &'static str,
        Vec<u8>,
        Option<String>,
        u16,
        ErrorCode,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            "oversized",
            vec![0u8; (run.boundary_shape().iter().product::<u64>() * 4 + 8192) as usize],
            None,
            413,
            ErrorCode::PayloadTooLarge,
            "",
        ),
        (
            "wrong shape",
            encode_boundary_f32([shape[0], shape[1], shape[2] / 2], &vec![0.1; n / 2]),
            None,
            400,
            ErrorCode::InvalidTensor,
            "shape",
        ),
        (
            "wrong encoding",
            encode_boundary_i8(
                shape,
                &vec![1; n],
                &vec![0.1; (shape[0] * shape[1]) as usize],
            ),
            None,
            400,
            ErrorCode::InvalidTensor,
            "encoding",
        ),
        (
            "wrong dtype",
            boundary_of_dtype(shape, safetensors::Dtype::I32),
            None,
            400,
            ErrorCode::InvalidTensor,
            "dtype I32",
        ),
        (
            "NaN",
            {
                let mut v = vec![0.1f32; n];
                v[3] = f32::NAN;
                encode_boundary_f32(shape, &v)
            },
            None,
            400,
            ErrorCode::InvalidTensor,
            "non-finite",
        ),
        (
            "hash mismatch",
            encode_boundary_f32(shape, &vec![0.1; n]),
            Some(blake3_hex(b"something else")),
            400,
            ErrorCode::InvalidTensor,
            "BLAKE3",
        ),
        (
            "garbage",
            b"not a tensor at all".to_vec(),
            None,
            400,
            ErrorCode::InvalidTensor,
            "safetensors",
        ),
    ];
    for (what, bytes, declared, status, expect, why) in cases {
        let declared = declared.unwrap_or_else(|| blake3_hex(&bytes));
        let r = upload(bytes, declared).await;
        assert_eq!((r.0, code(&r)), (status, Some(expect)), "{what}: {r:?}");
        let message = r.1.as_ref().map(|e| e.message.as_str()).unwrap_or_default();
        assert!(
            message.contains(why),
            "{what}: refused for another reason: {message}"
        );
    }
    assert_eq!(
        files_under(store.path()),
        files_before,
        "refused uploads left files"
    );
    assert_eq!(
        rows("SELECT count(*) FROM tasks WHERE staged_output IS NOT NULL").await,
        staged_before
    );

    // Another miner cannot upload to this lease; the miner with a wrong lease neither.
    let good = encode_boundary_f32(shape, &vec![0.25; n]);
    let stolen = other
        .upload_output(item.task_id, item.lease, good.clone().into())
        .await;
    assert_eq!(
        stolen.err().and_then(|e| e.code()),
        Some(ErrorCode::Forbidden)
    );
    let wrong_lease = stage0
        .upload_output(item.task_id, Uuid::new_v4(), good.clone().into())
        .await;
    assert_eq!(
        wrong_lease.err().and_then(|e| e.code()),
        Some(ErrorCode::LeaseExpired)
    );
    assert_eq!(files_under(store.path()), files_before);

    // A good upload is stored and its descriptor checks out on download.
    let blob = stage0
        .upload_output(item.task_id, item.lease, good.clone().into())
        .await
        .expect("upload")
        .blob;
    assert_eq!(blob.size, good.len() as u64);
    assert_eq!(stage0.download(&blob).await.expect("download"), &good[..]);
    assert_eq!(files_under(store.path()).len(), files_before.len() + 1);

    // The hop completes and goes to the stage-1 miner. If the object goes bad in the store, the
    // consumer's download catches it, and its report fails the producer's hop.
    let done = stage0
        .complete(
            item.task_id,
            &CompleteRequest {
                lease: item.lease,
                output: Some(blob.clone()),
                inner_step: 0,
                weights_digest: "00".repeat(32),
                loss: None,
                sequence_losses: None,
                compute_ms: Some(3),
            },
        )
        .await
        .expect("complete");
    assert!(done.next_task_id.is_some() && !done.sample_done);
    let again = stage0
        .complete(
            item.task_id,
            &CompleteRequest {
                lease: item.lease,
                output: Some(blob.clone()),
                inner_step: 0,
                weights_digest: "00".repeat(32),
                loss: None,
                sequence_losses: None,
                compute_ms: Some(3),
            },
        )
        .await
        .expect("a retried completion is answered the same");
    assert_eq!(again, done);
    // Idle polls are answered from a view that trails the database by a few milliseconds: the
    // hop just routed can take a poll or two to show.
    let next = eventually(
        "the next hop is routed to the stage-1 miner",
        Duration::from_secs(5),
        || async {
            other
                .work(4)
                .await
                .expect("work")
                .items
                .into_iter()
                .find(|i| Some(i.task_id) == done.next_task_id)
        },
    )
    .await;
    let next = &next;
    let input = next.input.clone().expect("an input");
    assert_eq!(input.blake3, blob.blake3);
    let path = store.path().join(&input.key);
    // A missing object (as after its epoch is collected) is nobody's fault: a report of it fails
    // no hop.
    let aside = path.with_extension("aside");
    std::fs::rename(&path, &aside).expect("move the object aside");
    let verdict = other
        .report_bad_object(&input.key, "gone")
        .await
        .expect("report of a missing object");
    assert!(!verdict.confirmed, "{verdict:?}");
    let pool = sqlx::PgPool::connect(&db).await.expect("db");
    let task_status: String = sqlx::query_scalar("SELECT status FROM tasks WHERE id = $1")
        .bind(item.task_id)
        .fetch_one(&pool)
        .await
        .expect("row");
    assert_eq!(task_status, "done");
    pool.close().await;
    std::fs::rename(&aside, &path).expect("put the object back");
    corrupt_stored(&path);
    let bad = other.download(&input).await.expect_err("corrupt download");
    assert!(
        matches!(bad, iota_protocol::ClientError::BadObject(_)),
        "{bad}"
    );
    let verdict = other
        .report_bad_object(&input.key, &bad.to_string())
        .await
        .expect("report");
    assert!(verdict.confirmed, "{verdict:?}");
    // A retry (its first answer lost) is answered as the first was, though the object is gone.
    let again = other
        .report_bad_object(&input.key, &bad.to_string())
        .await
        .expect("the report retried");
    assert_eq!(
        (again.confirmed, &again.detail),
        (true, &verdict.detail),
        "{again:?}"
    );
    let pool = sqlx::PgPool::connect(&db).await.expect("db");
    let (task_status, sample_status): (String, String) = sqlx::query_as(
        "SELECT t.status, s.status FROM tasks t JOIN samples s ON s.id = t.sample_id WHERE t.id = $1",
    )
    .bind(item.task_id)
    .fetch_one(&pool)
    .await
    .expect("row");
    assert_eq!(
        (task_status.as_str(), sample_status.as_str()),
        ("failed", "abandoned")
    );
    assert!(!path.exists(), "the bad object is deleted");
    pool.close().await;

    // Public routes need no signature; the OpenAPI document and metrics are served.
    let http = reqwest::Client::new();
    let status: EpochStatus = http
        .get(format!("{}/v1/status", orch.base))
        .send()
        .await
        .expect("status")
        .json()
        .await
        .expect("json");
    assert_eq!(status.phase, Phase::Training);
    let metrics_text = || async {
        http.get(format!("{}/metrics", orch.base))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text")
    };
    let metrics = metrics_text().await;
    assert!(metrics.contains("iota_http_requests_total"), "{metrics}");
    let unknown = http
        .get(format!("{}/v1/nope", orch.base))
        .send()
        .await
        .expect("404");
    assert_eq!(unknown.status().as_u16(), 404);
    let body: ApiError = unknown.json().await.expect("error body");
    assert_eq!(body.code, ErrorCode::NotFound);

    // Requests are counted by route, method and status, each series once it exists; made-up
    // methods share one label, so they cannot add series without bound.
    let status_requests = |text: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with("iota_http_requests_total{"))
            .filter(|l| {
                l.contains(r#"route="/v1/status""#)
                    && l.contains(r#"method="GET""#)
                    && l.contains(r#"status="200""#)
            })
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    let before = status_requests(&metrics_text().await);
    for _ in 0..3 {
        let ok = http
            .get(format!("{}/v1/status", orch.base))
            .send()
            .await
            .expect("status");
        assert!(ok.status().is_success());
    }
    for i in 0..20 {
        let method = reqwest::Method::from_bytes(format!("FROB{i}").as_bytes()).expect("method");
        let resp = http
            .request(method, format!("{}/v1/status", orch.base))
            .send()
            .await
            .expect("made-up method");
        assert!(resp.status().is_client_error(), "{}", resp.status());
    }
    let after = metrics_text().await;
    assert!(
        status_requests(&after) >= before + 3,
        "GET /v1/status counted {} then {}",
        before,
        status_requests(&after)
    );
    assert!(!after.contains("FROB"), "a made-up method became a label");
    assert!(after.contains(r#"method="other""#), "{after}");
    tokio::time::sleep(Duration::from_millis(10)).await;
    orch.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_requests_are_rate_limited_per_hotkey() {
    init_tracing();
    let chain = chain_with(&[MINER, OTHER_MINER], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&chain, &db, store.path(), run_config("limits"));
    cfg.limits.per_hotkey_rps = 1;
    cfg.limits.per_hotkey_burst = 3;
    let orch = start(cfg).await;
    let no_retry = RetryPolicy {
        attempts: 1,
        ..RetryPolicy::default()
    };
    let a =
        ApiClient::new(orch.base.clone(), signer(MINER), pair(200).ss58(), no_retry).expect("a");
    let b = ApiClient::new(
        orch.base.clone(),
        signer(OTHER_MINER),
        pair(200).ss58(),
        no_retry,
    )
    .expect("b");
    let cap = Capacity {
        device: "cpu".into(),
        memory_bytes: 1 << 30,
        tokens_per_s: 1.0,
    };
    a.register(cap.clone()).await.expect("register");
    b.register(cap).await.expect("register");
    let mut limited = None;
    for _ in 0..10 {
        if let Err(e) = a.heartbeat(None).await {
            limited = Some(e);
            break;
        }
    }
    let limited = limited.expect("the burst runs out");
    assert_eq!(limited.code(), Some(ErrorCode::RateLimited));
    // Another hotkey is not affected.
    b.heartbeat(None).await.expect("other hotkey");
    // A retrying client waits and gets through.
    let patient = ApiClient::new(
        orch.base.clone(),
        signer(MINER),
        pair(200).ss58(),
        RetryPolicy::default(),
    )
    .expect("patient");
    patient.heartbeat(None).await.expect("after Retry-After");
    orch.stop().await;
}

/// Upload slots are taken before a body arrives: one address may hold only a few of them, so a
/// host that sends bodies slowly cannot keep every miner from uploading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holds_a_bounded_share_of_the_upload_slots() {
    init_tracing();
    let chain = chain_with(&[MINER, OTHER_MINER], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&chain, &db, store.path(), run_config("upload-slots"));
    cfg.limits.concurrent_uploads_per_ip = 2;
    let orch = start(cfg).await;
    let raw = Raw::to(&orch.base);
    let path = "/v1/miner/epochs/0/pseudo-gradients/0";
    // An upload that gets past the slots is judged on its merits (here: no declared hash, 400);
    // one that does not is 429.
    let upload = |raw: &Raw| not_a_tensor(raw.clone(), path);
    assert_eq!(upload(&raw).await.0, 400);

    // Two uploads of that miner whose bodies never come hold this address's two slots.
    let output = leased_output_path(&orch.base, OTHER_MINER).await;
    let stall =
        async || stalled_body(&orch.base, &raw.receiver, OTHER_MINER, "PUT", &output, 1000).await;
    let mut held = [stall().await, stall().await];
    let refused = refused_while_held(&mut held, stall, || upload(&raw)).await;
    assert_eq!(
        refused.1.as_ref().map(|e| e.code),
        Some(ErrorCode::RateLimited),
        "{refused:?}"
    );
    // Another address is not affected (the whole of 127/8 is this machine).
    let elsewhere = Raw {
        http: reqwest::Client::builder()
            .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
            .build()
            .expect("client"),
        ..raw.clone()
    };
    assert_eq!(upload(&elsewhere).await.0, 400);
    // Closing the stalled connections gives the slots back.
    drop(held);
    eventually("the slots given back", Duration::from_secs(10), || {
        let raw = &raw;
        async move { (upload(raw).await.0 == 400).then_some(()) }
    })
    .await;
    orch.stop().await;
}

/// Small bodies are read before their signature is checked, so one address may have only a few
/// of them still arriving at once: a host opening connections that announce a body and send it
/// slowly (or never) is refused at once past that, instead of having a buffer held for each
/// until the body deadline. A request sent whole takes no such slot, so it is served while the
/// address's slots are all held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_has_a_bounded_number_of_unchecked_bodies_arriving() {
    init_tracing();
    let chain = chain_with(&[MINER, OTHER_MINER], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&chain, &db, store.path(), run_config("unchecked-bodies"));
    cfg.limits.unchecked_bodies_per_ip = 2;
    // Long enough that no stalled body is cut off for its pace while the test runs.
    cfg.limits.body_timeout = Duration::from_secs(60);
    let orch = start(cfg).await;
    let raw = Raw::to(&orch.base);
    let register = register_body();
    let post = reqwest::Method::POST;
    let joined = raw
        .signed(&pair(MINER), post.clone(), "/v1/miner/register", register)
        .await;
    assert_eq!(joined.0, 200, "{joined:?}");
    // A request whose announced body never comes, from `from`: its status if it is answered
    // within a second (refused), `None` while it waits for its body.
    let stall_from = |from: [u8; 4], path: &'static str| {
        let raw = raw.clone();
        async move {
            let mut stream = stalled_body_from(
                from.into(),
                &raw.base,
                &raw.receiver,
                OTHER_MINER,
                "POST",
                path,
                1000,
            )
            .await;
            let answer = answer_within(&mut stream, Duration::from_secs(1)).await;
            (answer, stream)
        }
    };
    // The signed gate's routes and the work poll (which reads its body itself) both count.
    let mut held = [
        stalled_body(
            &orch.base,
            &raw.receiver,
            OTHER_MINER,
            "POST",
            "/v1/miner/heartbeat",
            1000,
        )
        .await,
        stalled_body(
            &orch.base,
            &raw.receiver,
            OTHER_MINER,
            "POST",
            "/v1/miner/work",
            1000,
        )
        .await,
    ];
    let stall = async || {
        stalled_body(
            &orch.base,
            &raw.receiver,
            OTHER_MINER,
            "POST",
            "/v1/miner/work",
            1000,
        )
        .await
    };
    let probe = || async {
        let (answer, _stream) = stall_from([127, 0, 0, 1], "/v1/miner/heartbeat").await;
        let answer = answer.unwrap_or_default();
        let status = answer.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
        let error = answer
            .split_once("\r\n\r\n")
            .and_then(|(_, body)| serde_json::from_str::<ApiError>(body).ok());
        (status, error)
    };
    let refused = refused_while_held(&mut held, stall, probe).await;
    assert_eq!(
        refused.1.as_ref().map(|e| e.code),
        Some(ErrorCode::RateLimited),
        "{refused:?}"
    );
    // Sent whole, the same address's requests are served meanwhile, the poll's included.
    let heartbeat = raw
        .signed(
            &pair(MINER),
            post.clone(),
            "/v1/miner/heartbeat",
            br#"{"tokens_per_s":120.0}"#.to_vec(),
        )
        .await;
    assert_eq!(heartbeat.0, 200, "{heartbeat:?}");
    let poll = raw
        .signed(
            &pair(MINER),
            post.clone(),
            "/v1/miner/work",
            br#"{"max_items":1}"#.to_vec(),
        )
        .await;
    assert_eq!(poll.0, 200, "{poll:?}");
    // Another address is not affected: its slow body waits (the whole of 127/8 is this machine).
    let (elsewhere, waiting) = stall_from([127, 0, 0, 2], "/v1/miner/work").await;
    assert_eq!(elsewhere, None, "another address's slow body was answered");
    // Closing the stalled connections gives the slots back.
    drop((held, waiting));
    eventually("the slots given back", Duration::from_secs(10), || async {
        let (answer, _stream) = stall_from([127, 0, 0, 1], "/v1/miner/heartbeat").await;
        answer.is_none().then_some(())
    })
    .await;
    orch.stop().await;
}

/// One hotkey may hold only a few upload slots, from however many addresses, and a signed JSON
/// body over 64 KiB holds them as an upload does (it too is read only once its signature
/// holds): a registered hotkey sending bodies slowly from a few hosts cannot keep every other
/// miner from uploading, however many requests its rate limit lets it start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hotkey_holds_a_bounded_share_of_the_upload_slots() {
    init_tracing();
    let chain = chain_with(&[MINER, OTHER_MINER], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&chain, &db, store.path(), run_config("hotkey-upload-slots"));
    // No per-address limit: only the hotkey's can refuse.
    cfg.limits.concurrent_uploads_per_ip = 0;
    cfg.limits.concurrent_uploads_per_hotkey = 2;
    let orch = start(cfg).await;
    let raw = Raw::to(&orch.base);
    let path = "/v1/miner/epochs/0/pseudo-gradients/0";
    // Past the slots, an upload is judged on its merits (here: no declared hash, 400).
    let upload = || not_a_tensor(raw.clone(), path);
    assert_eq!(upload().await.0, 400);

    let output = leased_output_path(&orch.base, OTHER_MINER).await;
    let from = std::sync::atomic::AtomicU8::new(2);
    // Uploads, then heartbeats announcing 100 KiB.
    for (method, route, len) in [
        ("PUT", output.as_str(), 1000),
        ("POST", "/v1/miner/heartbeat", 100 << 10),
    ] {
        // Two requests in that miner's name whose bodies never come, each from its own address.
        let stall = async || {
            let host = from.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let address = std::net::IpAddr::from([127, 0, 0, host]);
            stalled_body_from(
                address,
                &orch.base,
                &raw.receiver,
                OTHER_MINER,
                method,
                route,
                len,
            )
            .await
        };
        let mut held = [stall().await, stall().await];
        let refused = refused_while_held(&mut held, stall, upload).await;
        assert_eq!(
            code(&refused),
            Some(ErrorCode::RateLimited),
            "{route}: {refused:?}"
        );
        assert!(
            refused
                .1
                .as_ref()
                .is_some_and(|e| e.message.contains("hotkey")),
            "{route}: {refused:?}"
        );
        // Another hotkey, from the address of the refused upload, is not affected.
        let other = raw
            .signed(&pair(MINER), reqwest::Method::PUT, path, b"x".to_vec())
            .await;
        assert_eq!(other.0, 400, "{route}: {other:?}");
        // Closing the stalled connections gives the slots back.
        drop(held);
        eventually("the slots given back", Duration::from_secs(10), || async {
            (upload().await.0 == 400).then_some(())
        })
        .await;
    }
    orch.stop().await;
}

/// A blob key that names no object is the caller's mistake (404, or 400 for a name no object
/// may have), however the store fails to open it: a name too long for the file system, a path
/// through an object, a name the store keeps for itself. They were 500s whose message gave the
/// store's path on this machine, and the client retried each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_key_that_names_no_object_is_a_client_error() {
    init_tracing();
    let chain = chain_with(&[MINER], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let orch = start(config(&chain, &db, store.path(), run_config("blob-keys"))).await;
    let raw = Raw::to(&orch.base);
    let run: RunInfo = reqwest::get(format!("{}/v1/run", orch.base))
        .await
        .expect("run")
        .json()
        .await
        .expect("json");
    let dir = store.path().join(format!("runs/{}", run.id));
    std::fs::create_dir_all(&dir).expect("run dir");
    std::fs::write(dir.join("f"), b"an object").expect("an object");
    let get = |key: String| {
        let raw = raw.clone();
        async move {
            let path = format!("/v1/blobs/{key}");
            raw.signed(&pair(MINER), reqwest::Method::GET, &path, Vec::new())
                .await
        }
    };
    assert_eq!(get(format!("runs/{}/f", run.id)).await.0, 200);
    let store_dir = store.path().to_string_lossy().into_owned();
    for key in [
        format!("runs/{}/{}", run.id, "a".repeat(300)),
        format!("runs/{}/f/x", run.id),
        format!("runs/{}/x%231", run.id),
    ] {
        let answer = get(key.clone()).await;
        assert!(matches!(answer.0, 404 | 400), "{key}: {answer:?}");
        let message = answer.1.map(|e| e.message).unwrap_or_default();
        assert!(!message.contains(&store_dir), "{key}: {message}");
    }
    orch.stop().await;
}

/// An upload whose body stops coming is cut off once it falls behind the slowest pace taken,
/// not only when the time its declared length would allow is up, and an upload that finds every
/// slot busy is told to come back instead of waiting without an answer. Two stalled bodies
/// announcing 12 MB held both slots for 11 s more than the base timeout, and every other upload
/// waited for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_uploads_give_their_slots_back_and_nobody_waits_for_a_slot_unanswered() {
    init_tracing();
    let chain = chain_with(&[MINER, OTHER_MINER], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("stalled-uploads");
    // Hop outputs of 20 MB: the upload limit.
    run.boundary_dim = 312_500;
    let mut cfg = config(&chain, &db, store.path(), run);
    cfg.limits.concurrent_uploads = 2;
    cfg.limits.concurrent_uploads_per_ip = 0;
    cfg.limits.body_timeout = Duration::from_secs(2);
    cfg.limits.upload_slot_wait = Duration::from_millis(500);
    let orch = start(cfg).await;
    let raw = Raw::to(&orch.base);
    let path = "/v1/miner/epochs/0/pseudo-gradients/0";
    let upload = || not_a_tensor(raw.clone(), path);
    // Past the slots, an upload is judged on its merits (here: no declared hash, 400).
    assert_eq!(upload().await.0, 400);
    let output = leased_output_path(&orch.base, OTHER_MINER).await;
    // Within the limit (20 MB); at the old rule's second per MiB, 11.5 s on top of the base.
    let announced = 12_000_000;
    let started = tokio::time::Instant::now();
    let mut held = [
        stalled_body(
            &orch.base,
            &raw.receiver,
            OTHER_MINER,
            "PUT",
            &output,
            announced,
        )
        .await,
        stalled_body(
            &orch.base,
            &raw.receiver,
            OTHER_MINER,
            "PUT",
            &output,
            announced,
        )
        .await,
    ];
    // With both slots held, an upload is answered 429 after the slot wait.
    let busy = eventually(
        "an upload refused while the slots are held",
        Duration::from_secs(2),
        || async {
            let answer = upload().await;
            (answer.0 == 429).then_some(answer)
        },
    )
    .await;
    assert_eq!(code(&busy), Some(ErrorCode::RateLimited), "{busy:?}");
    // A request without a body (a download) takes no upload slot: it is answered (here 404, no
    // such object), not told to come back.
    let download = raw
        .signed(
            &pair(OTHER_MINER),
            reqwest::Method::GET,
            "/v1/blobs/runs/1/nothing",
            Vec::new(),
        )
        .await;
    assert_eq!(download.0, 404, "{download:?}");
    // The stalled bodies are cut off once they fall behind: at the base timeout, since nothing
    // came (the declared length would allow 13 s).
    for stream in &mut held {
        use tokio::io::AsyncReadExt;
        let mut answer = vec![0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(8), stream.read(&mut answer))
            .await
            .expect("a stalled upload is answered before its declared length's time")
            .expect("read");
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(upload().await.0, 400, "the slots are free again");
    orch.stop().await;
}

/// Behind a trusted proxy, each client counts against its own per-IP limit (the one its
/// `X-Forwarded-For` names); every client of the proxy once shared one. From any other peer the
/// header is ignored, so a client cannot take a fresh limit by naming another address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_behind_a_trusted_proxy_are_limited_one_by_one() {
    init_tracing();
    let chain = chain_with(&[], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&chain, &db, store.path(), run_config("proxied"));
    cfg.limits.per_ip_rps = 1;
    cfg.limits.per_ip_burst = 2;
    cfg.trusted_proxies = vec![std::net::IpAddr::from([127, 0, 0, 9])];
    let orch = start(cfg).await;
    let from = |last: u8| {
        reqwest::Client::builder()
            .local_address(std::net::IpAddr::from([127, 0, 0, last]))
            .build()
            .expect("client")
    };
    let status = |http: reqwest::Client, forwarded: &'static str| {
        let url = format!("{}/v1/status", orch.base);
        async move {
            http.get(url)
                .header("x-forwarded-for", forwarded)
                .send()
                .await
                .expect("status")
                .status()
                .as_u16()
        }
    };
    // Through the proxy: one client uses up its burst; another still gets in, as does one the
    // client itself named before the proxy (an untrusted entry further left is not read).
    let proxy = from(9);
    for _ in 0..2 {
        assert_eq!(status(proxy.clone(), "203.0.113.7").await, 200);
    }
    assert_eq!(status(proxy.clone(), "203.0.113.7").await, 429);
    assert_eq!(status(proxy.clone(), "203.0.113.8").await, 200);
    assert_eq!(
        status(proxy.clone(), "198.51.100.1, 203.0.113.7").await,
        429
    );
    // Directly, the header counts for nothing.
    let direct = from(10);
    assert_eq!(status(direct.clone(), "203.0.113.20").await, 200);
    assert_eq!(status(direct.clone(), "203.0.113.21").await, 200);
    assert_eq!(status(direct.clone(), "203.0.113.22").await, 429);
    orch.stop().await;
}

/// An address that keeps sending bad signatures in a registered hotkey's name (its address is
/// public) is refused in that name for a while, before its bodies are read and its signatures
/// checked; each forged request once cost a body hash and a verification, without limit. Other
/// hotkeys from the same address (clients behind one NAT or proxy) and other addresses are not
/// affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_sending_bad_signatures_is_refused_for_a_while() {
    init_tracing();
    let chain = chain_with(&[MINER, OTHER_MINER], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let orch = start(config(&chain, &db, store.path(), run_config("forgeries"))).await;
    let from = |last: u8| Raw {
        http: reqwest::Client::builder()
            .local_address(std::net::IpAddr::from([127, 0, 0, last]))
            .build()
            .expect("client"),
        ..Raw::to(&orch.base)
    };
    forge_until_refused(&from(5)).await;
    // Requests in that hotkey's name from that address wait too; another hotkey's from the same
    // address (clients behind one NAT), and that hotkey's from another address, do not: they
    // join.
    let join = |client: Raw, seed: u8| async move {
        let body = register_body();
        client
            .signed(
                &pair(seed),
                reqwest::Method::POST,
                "/v1/miner/register",
                body,
            )
            .await
    };
    let locked_at = tokio::time::Instant::now();
    let own = join(from(5), MINER).await;
    assert_eq!((own.0, code(&own)), (429, Some(ErrorCode::RateLimited)));
    let neighbour = join(from(5), OTHER_MINER).await;
    assert_eq!(neighbour.0, 200, "{neighbour:?}");
    let elsewhere = join(from(6), MINER).await;
    assert_eq!(elsewhere.0, 200, "{elsewhere:?}");
    // For a while only: once the pause is over, that address may act in that name again.
    let own = eventually(
        "the pause over",
        iota_orchestrator::app::FORGER_PAUSE + Duration::from_secs(10),
        || async {
            let own = join(from(5), MINER).await;
            (own.0 != 429).then_some(own)
        },
    )
    .await;
    assert_eq!(own.0, 200, "{own:?}");
    assert!(locked_at.elapsed() > iota_orchestrator::app::FORGER_PAUSE / 2);
    orch.stop().await;
}

/// An IPv6 address counts by its /64, so a forger on a miner's /64 (a cloud subnet, a shared
/// host) once locked that miner out by forging in its name. Now the exact address a hotkey
/// signed from stays exempt; any other address of that /64 stays locked, and the exemption ends
/// once a bad signature comes from the exempt address itself (a forger behind the same NAT).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forger_on_a_miners_network_does_not_lock_the_miner_out() {
    init_tracing();
    let chain = chain_with(&[MINER], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&chain, &db, store.path(), run_config("neighbours"));
    cfg.trusted_proxies = vec![std::net::IpAddr::from([127, 0, 0, 9])];
    let orch = start(cfg).await;
    // Each client is named by the trusted proxy's X-Forwarded-For; all are in 2001:db8:0:7::/64.
    let via = |client: &str| {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            "x-forwarded-for",
            reqwest::header::HeaderValue::from_str(client).expect("header"),
        );
        Raw {
            http: reqwest::Client::builder()
                .local_address(std::net::IpAddr::from([127, 0, 0, 9]))
                .default_headers(headers)
                .build()
                .expect("client"),
            ..Raw::to(&orch.base)
        }
    };
    let heartbeat = |raw: Raw| async move {
        raw.signed(
            &pair(MINER),
            reqwest::Method::POST,
            "/v1/miner/heartbeat",
            b"{}".to_vec(),
        )
        .await
    };
    let miner = "2001:db8:0:7::10";
    let first = heartbeat(via(miner)).await;
    assert!(![401, 429].contains(&first.0), "{first:?}");
    forge_until_refused(&via("2001:db8:0:7::66")).await;
    let again = heartbeat(via(miner)).await;
    assert!(
        ![401, 429].contains(&again.0),
        "the miner was locked out by its neighbour: {again:?}"
    );
    // Another address on that /64, which never signed in the miner's name, is still refused.
    let unproven = heartbeat(via("2001:db8:0:7::11")).await;
    assert_eq!(
        (unproven.0, code(&unproven)),
        (429, Some(ErrorCode::RateLimited))
    );
    // A bad signature from the miner's own address ends its exemption.
    assert_eq!(forged_heartbeat(&via(miner)).await.0, 401);
    let shared = heartbeat(via(miner)).await;
    assert_eq!(
        (shared.0, code(&shared)),
        (429, Some(ErrorCode::RateLimited))
    );
    orch.stop().await;
}

/// Sends forged heartbeats through `raw` until they are refused before their signature is
/// checked, and checks that the refusal then holds. The quota refills with time, so how many
/// forgeries that takes depends on the machine's speed; only an upper bound is certain.
async fn forge_until_refused(raw: &Raw) {
    let mut answers = vec![forged_heartbeat(raw).await.0];
    assert_eq!(answers[0], 401, "a bad signature is refused as such");
    while answers.last() != Some(&429) {
        assert!(
            answers.len() < 500,
            "the forger was not refused after its bad signatures: {answers:?}"
        );
        answers.push(forged_heartbeat(raw).await.0);
    }
    assert!(
        answers[..answers.len() - 1].iter().all(|a| *a == 401),
        "{answers:?}"
    );
    for _ in 0..5 {
        answers.push(forged_heartbeat(raw).await.0);
    }
    assert!(
        answers.iter().rev().take(6).all(|a| *a == 429),
        "a refused forger was let through again at once: {answers:?}"
    );
}

/// A heartbeat in `MINER`'s name signed by `STRANGER`, sent through `raw`: its status and
/// error.
async fn forged_heartbeat(raw: &Raw) -> (u16, Option<ApiError>) {
    let mut headers = sign_request(
        &pair(STRANGER),
        &raw.receiver,
        "POST",
        "/v1/miner/heartbeat",
        b"{}",
        now_ms(),
        Uuid::new_v4(),
    )
    .headers;
    for h in &mut headers {
        if h.0 == "epistula-signed-by" {
            h.1 = pair(MINER).ss58();
        }
    }
    let mut req = raw.http.post(format!("{}/v1/miner/heartbeat", raw.base));
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let resp = req
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .expect("send");
    let status = resp.status().as_u16();
    (status, resp.json().await.ok())
}

/// Signs a `method` to `path` over `len` bytes as `seed` and sends its head announcing them, but
/// no body; the open connection.
async fn stalled_body(
    base: &str,
    receiver: &str,
    seed: u8,
    method: &str,
    path: &str,
    len: usize,
) -> tokio::net::TcpStream {
    stalled_body_from(
        [127, 0, 0, 1].into(),
        base,
        receiver,
        seed,
        method,
        path,
        len,
    )
    .await
}

/// [`stalled_body`], sent from the local address `from`.
async fn stalled_body_from(
    from: std::net::IpAddr,
    base: &str,
    receiver: &str,
    seed: u8,
    method: &str,
    path: &str,
    len: usize,
) -> tokio::net::TcpStream {
    let headers = sign_request(
        &pair(seed),
        receiver,
        method,
        path,
        &vec![b' '; len],
        now_ms(),
        Uuid::new_v4(),
    )
    .headers;
    raw_request_from(from, base, method, path, len, &headers, b"").await
}

/// Signs a POST to `path` over `len` bytes as `seed`, sends its head announcing them, sends no
/// body, and returns the start of the answer; `None` if none comes within 10 s.
async fn announced_body_never_sent(
    base: &str,
    receiver: &str,
    seed: u8,
    path: &str,
    len: usize,
) -> Option<String> {
    let mut stream = stalled_body(base, receiver, seed, "POST", path, len).await;
    answer_within(&mut stream, Duration::from_secs(10)).await
}

/// Signs a POST to `path` as `seed`, sends its head with a chunked body whose first chunk size
/// is not hexadecimal, and returns the start of the answer; `None` if none comes within 10 s.
async fn malformed_chunked_body(
    base: &str,
    receiver: &str,
    seed: u8,
    path: &str,
) -> Option<String> {
    use tokio::io::AsyncWriteExt;
    let headers = sign_request(
        &pair(seed),
        receiver,
        "POST",
        path,
        b"{}",
        now_ms(),
        Uuid::new_v4(),
    )
    .headers;
    let addr = base.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
    );
    for (name, value) in &headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\nzz\r\n{}\r\n0\r\n\r\n");
    stream.write_all(head.as_bytes()).await.expect("write");
    answer_within(&mut stream, Duration::from_secs(10)).await
}

/// A boundary tensor that is right in every way (format, encoding `f32`, name, shape, size) but
/// its values' dtype: zeros of `dtype`, which must take four bytes an element as f32 does.
fn boundary_of_dtype(shape: [u64; 3], dtype: safetensors::Dtype) -> Vec<u8> {
    use iota_protocol::tensor::{BOUNDARY_FORMAT, META_KEY};
    let dims: Vec<usize> = shape.iter().map(|d| *d as usize).collect();
    let data = vec![0u8; dims.iter().product::<usize>() * 4];
    let view = safetensors::tensor::TensorView::new(dtype, dims, &data).expect("a view");
    let meta = serde_json::json!({ "format": BOUNDARY_FORMAT, "encoding": "f32" }).to_string();
    safetensors::serialize(
        [("values", view)],
        Some(std::collections::HashMap::from([(
            META_KEY.to_owned(),
            meta,
        )])),
    )
    .expect("serialize")
}

/// Sends `method path` announcing `len` bytes with `headers`, and `body` (all or part of them);
/// the open connection.
async fn raw_request(
    base: &str,
    method: &str,
    path: &str,
    len: usize,
    headers: &[(&str, String)],
    body: &[u8],
) -> tokio::net::TcpStream {
    raw_request_from(
        [127, 0, 0, 1].into(),
        base,
        method,
        path,
        len,
        headers,
        body,
    )
    .await
}

/// [`raw_request`], sent from the local address `from`.
async fn raw_request_from(
    from: std::net::IpAddr,
    base: &str,
    method: &str,
    path: &str,
    len: usize,
    headers: &[(&str, String)],
    body: &[u8],
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let addr = base.trim_start_matches("http://").trim_end_matches('/');
    let server: std::net::SocketAddr = addr.parse().expect("the server's address");
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind((from, 0).into()).expect("bind");
    let mut stream = socket.connect(server).await.expect("connect");
    let content_type = if method == "PUT" {
        "application/octet-stream"
    } else {
        "application/json"
    };
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: {content_type}\r\ncontent-length: {len}\r\n"
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.expect("write head");
    stream.write_all(body).await.expect("write body");
    stream
}

/// Probes with `probe` until it is refused 429 while the stalled uploads `held` wait for their
/// bodies. A stalled head written just before a probe may reach the server after it, and then be
/// the one refused: such a connection is replaced by `stall()`, so that a refusal only counts
/// once every stalled upload holds its slot.
async fn refused_while_held<P: Future<Output = (u16, Option<ApiError>)>>(
    held: &mut [tokio::net::TcpStream],
    stall: impl AsyncFn() -> tokio::net::TcpStream,
    probe: impl Fn() -> P,
) -> (u16, Option<ApiError>) {
    use tokio::io::AsyncReadExt;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        for stream in held.iter_mut() {
            let mut buf = [0u8; 64];
            if let Ok(answered) =
                tokio::time::timeout(Duration::from_millis(1), stream.read(&mut buf)).await
            {
                tracing::info!(?answered, "a stalled upload was answered; replacing it");
                *stream = stall().await;
            }
        }
        let answer = probe().await;
        if answer.0 == 429 {
            return answer;
        }
        if tokio::time::Instant::now() > deadline {
            // What the stalled requests were answered, if anything (they should still wait).
            let mut stalled = Vec::new();
            for stream in held.iter_mut() {
                let mut buf = vec![0u8; 512];
                let read =
                    tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buf)).await;
                stalled.push(match read {
                    Ok(Ok(n)) => String::from_utf8_lossy(&buf[..n]).into_owned(),
                    Ok(Err(e)) => format!("read error: {e}"),
                    Err(_) => "still waiting".into(),
                });
            }
            panic!("no 429 while uploads stall; last answer {answer:?}; stalled: {stalled:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The start of the answer on `stream`, if one comes within `wait`.
async fn answer_within(stream: &mut tokio::net::TcpStream, wait: Duration) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut answer = vec![0u8; 1024];
    let n = tokio::time::timeout(wait, stream.read(&mut answer))
        .await
        .ok()?
        .expect("read answer");
    Some(String::from_utf8_lossy(&answer[..n]).into_owned())
}

/// A body is held only for a caller whose signature holds: uploads, and bodies over 64 KiB, carry
/// `Iota-Body-Sha256`, and their signature is checked over it before the body is read. A forged
/// upload that sent no body held one of the upload slots until the body timeout (four addresses
/// held every slot), and a forged JSON request announcing a large body was held, with its buffer,
/// as long. The body must then have that hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_is_held_only_for_a_caller_whose_signature_holds() {
    use iota_protocol::signing::{HEADER_BODY_SHA256, HEADER_SIGNATURE};
    init_tracing();
    let chain = chain_with(&[MINER, OTHER_MINER], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&chain, &db, store.path(), run_config("signed-before-body"));
    cfg.limits.concurrent_uploads = 1;
    cfg.limits.concurrent_uploads_per_ip = 0;
    cfg.limits.body_timeout = Duration::from_secs(30);
    cfg.limits.upload_slot_wait = Duration::from_millis(500);
    let orch = start(cfg).await;
    let raw = Raw::to(&orch.base);
    let upload_path = "/v1/miner/epochs/0/pseudo-gradients/0";
    let upload = || not_a_tensor(raw.clone(), upload_path);
    // Past the slot, an upload is judged on its merits (here: no declared hash, 400).
    assert_eq!(upload().await.0, 400);
    // Headers signed in the miner's name by another key, over a body never sent.
    let forged = |method: &str, path: &str, len: usize| {
        let body = vec![b' '; len];
        let mut headers = sign_request(
            &pair(OTHER_MINER),
            &raw.receiver,
            method,
            path,
            &body,
            now_ms(),
            Uuid::new_v4(),
        )
        .headers;
        let by_another = sign_request(
            &pair(STRANGER),
            &raw.receiver,
            method,
            path,
            &body,
            now_ms(),
            Uuid::new_v4(),
        );
        for (name, value) in &mut headers {
            if *name == HEADER_SIGNATURE {
                *value = find_header(&by_another.headers, HEADER_SIGNATURE)
                    .expect("a signature")
                    .to_owned();
            }
        }
        headers
    };
    // Answered at once, and the forged upload, its connection still open, holds no slot; the
    // same for a JSON route and a body over 64 KiB.
    let json_path = "/v1/miner/heartbeat";
    let mut open = Vec::new();
    for (method, path, len) in [("PUT", upload_path, 1000), ("POST", json_path, 500_000)] {
        let mut stalled = raw_request(
            &orch.base,
            method,
            path,
            len,
            &forged(method, path, len),
            b"",
        )
        .await;
        let answer = answer_within(&mut stalled, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("{method}: a forged request held until its body"));
        assert!(answer.starts_with("HTTP/1.1 401"), "{method}: {answer}");
        open.push(stalled);
    }
    assert_eq!(upload().await.0, 400, "the forged upload held the slot");
    // Without the hash, such a body is not read at all; nor is an upload.
    for (method, path, len) in [("POST", json_path, 500_000), ("PUT", upload_path, 1000)] {
        let headers: Vec<(&str, String)> = sign_request(
            &pair(OTHER_MINER),
            &raw.receiver,
            method,
            path,
            &vec![b' '; len],
            now_ms(),
            Uuid::new_v4(),
        )
        .headers
        .into_iter()
        .filter(|(name, _)| *name != HEADER_BODY_SHA256)
        .collect();
        let mut unhashed = raw_request(&orch.base, method, path, len, &headers, b"").await;
        let answer = answer_within(&mut unhashed, Duration::from_secs(10))
            .await
            .expect("a body without its hash answered at once");
        let status = if method == "PUT" { "400" } else { "413" };
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{method}: {answer}"
        );
    }
    // A poll is read before its signature is checked: one announcing more than 64 KiB is
    // refused at once.
    let answer =
        announced_body_never_sent(&orch.base, &raw.receiver, MINER, "/v1/miner/work", 500_000)
            .await
            .expect("a large poll answered at once");
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // A body other than the one whose hash was signed is refused (where its handler reads it).
    let output = leased_output_path(&orch.base, OTHER_MINER).await;
    let signed_body = vec![b' '; 1000];
    let headers = sign_request(
        &pair(OTHER_MINER),
        &raw.receiver,
        "PUT",
        &output,
        &signed_body,
        now_ms(),
        Uuid::new_v4(),
    )
    .headers;
    let mut other_body = raw_request(
        &orch.base,
        "PUT",
        &output,
        1000,
        &headers,
        &vec![b'!'; 1000],
    )
    .await;
    let answer = answer_within(&mut other_body, Duration::from_secs(10))
        .await
        .expect("an answer");
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains(HEADER_BODY_SHA256), "{answer}");
    orch.stop().await;
}

/// A path to upload a hop's output to, under a lease of `seed`'s: the miner registers (before
/// any other, so at stage 0) and is leased a new sample's first hop, so an upload sent there is
/// judged on its body, not refused at once for its path.
async fn leased_output_path(base: &str, seed: u8) -> String {
    let (miner, joined) = registered_miner(base, seed).await;
    assert_eq!(joined.stage, 0, "the first miner to join is at stage 0");
    let item = eventually("a hop leased", Duration::from_secs(10), || async {
        miner.work(1).await.expect("work").items.pop()
    })
    .await;
    assert!(item.expects_output, "{item:?}");
    format!(
        "/v1/miner/tasks/{}/output?lease={}&blake3={}",
        item.task_id,
        item.lease,
        "0".repeat(64)
    )
}

/// An upload of a byte to `path` by the other miner: past the upload slots it is judged on its
/// merits (400: the tests' paths declare no hash).
async fn not_a_tensor(raw: Raw, path: &str) -> (u16, Option<ApiError>) {
    raw.signed(
        &pair(OTHER_MINER),
        reqwest::Method::PUT,
        path,
        b"x".to_vec(),
    )
    .await
}
