//! What the client reads from a server it does not control: a blob is never read past the size
//! its descriptor gives, a JSON answer never past `MAX_RESPONSE_BYTES`, and a run outside the
//! protocol's bounds is refused before anyone sizes anything from it.
//!
//! The servers are hand-written on a `TcpListener`, so a test controls every header and byte: the
//! endless bodies below would make a client that reads the whole body first hang until its
//! timeout (and then fail with a network error, not the refusal these tests expect). Their
//! clients sign each request with sr25519 (`with_sessions(false)`): these servers serve no
//! session route, and count or capture each request they see. Sessions are tested against the
//! orchestrator (`orchestrator/tests/sessions.rs`).

use std::sync::Arc;
use std::time::Duration;

use iota_protocol::api::{RunConfig, RunInfo};
use iota_protocol::blob::blake3_hex;
use iota_protocol::client::MAX_RESPONSE_BYTES;
use iota_protocol::{ApiClient, BlobDescriptor, BlobDtype, ClientError, ErrorCode, RetryPolicy};
use iota_protocol::{RequestSigner, WireEncoding};
use sp_core::Pair as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the server sends after the status line and headers.
#[derive(Clone)]
enum Body {
    /// These bytes, then the connection closes.
    Bytes(Vec<u8>),
    /// Zeros until the client hangs up.
    Endless,
    /// These bytes, 64 KiB at a time, one chunk per interval.
    Paced(Vec<u8>, Duration),
}

/// One canned answer: status, extra headers, body.
#[derive(Clone)]
struct Answer {
    status: &'static str,
    headers: Vec<String>,
    body: Body,
}

impl Answer {
    fn ok(headers: Vec<String>, body: Body) -> Self {
        Self {
            status: "200 OK",
            headers,
            body,
        }
    }

    /// 200 with these bytes, their length announced.
    fn sized(body: Vec<u8>) -> Self {
        Self::ok(
            vec![format!("Content-Length: {}", body.len())],
            Body::Bytes(body),
        )
    }
}

/// Serves `answer(path)` to every request on a fresh port; returns `http://127.0.0.1:port`.
async fn serve(answer: impl Fn(&str) -> Answer + Send + Sync + 'static) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answer = Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let _ = respond(conn, answer.as_ref()).await;
            });
        }
    });
    format!("http://{addr}")
}

async fn respond(
    mut conn: TcpStream,
    answer: &(dyn Fn(&str) -> Answer + Send + Sync),
) -> std::io::Result<()> {
    // The request head, up to the blank line (no request here has a body).
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte).await? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
    let a = answer(&path);
    let mut out = format!("HTTP/1.1 {}\r\nConnection: close\r\n", a.status);
    for h in &a.headers {
        out.push_str(h);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    conn.write_all(out.as_bytes()).await?;
    match a.body {
        Body::Bytes(b) => conn.write_all(&b).await?,
        Body::Endless => {
            let chunk = vec![0u8; 64 << 10];
            loop {
                conn.write_all(&chunk).await?;
            }
        }
        Body::Paced(bytes, interval) => {
            for chunk in bytes.chunks(64 << 10) {
                conn.write_all(chunk).await?;
                tokio::time::sleep(interval).await;
            }
        }
    }
    conn.shutdown().await
}

fn signer() -> Arc<dyn RequestSigner> {
    Arc::new(sp_core::sr25519::Pair::from_seed(&[7; 32]))
}

/// One attempt, and a timeout far above what a refusal takes: a client that kept reading an
/// endless body would fail with a network error instead.
fn retry() -> RetryPolicy {
    RetryPolicy {
        attempts: 1,
        base: Duration::from_millis(10),
        max: Duration::from_millis(10),
        timeout: Duration::from_secs(30),
    }
}

fn client(base: &str) -> ApiClient {
    ApiClient::new(base, signer(), "orchestrator", retry())
        .expect("client")
        .with_sessions(false)
}

/// A client that tries `attempts` times, with short waits between.
fn retrying(base: &str, attempts: u32) -> ApiClient {
    let policy = RetryPolicy {
        attempts,
        ..retry()
    };
    ApiClient::new(base, signer(), "orchestrator", policy)
        .expect("client")
        .with_sessions(false)
}

/// Counts the requests a server sees.
fn counter() -> Arc<std::sync::atomic::AtomicUsize> {
    Arc::new(std::sync::atomic::AtomicUsize::new(0))
}

fn seen(c: &std::sync::atomic::AtomicUsize) -> usize {
    c.load(std::sync::atomic::Ordering::SeqCst)
}

fn count(c: &std::sync::atomic::AtomicUsize) -> usize {
    c.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
}

/// A store that answers its first request 503 with `headers`, and every later one `content`;
/// `requests` counts them.
async fn unavailable_once(
    content: &[u8],
    headers: &[&str],
    requests: Arc<std::sync::atomic::AtomicUsize>,
) -> String {
    let body = content.to_vec();
    let mut refusal = vec!["Content-Length: 0".to_owned()];
    refusal.extend(headers.iter().map(|h| h.to_string()));
    serve(move |_| {
        if count(&requests) == 0 {
            Answer {
                status: "503 Service Unavailable",
                headers: refusal.clone(),
                body: Body::Bytes(Vec::new()),
            }
        } else {
            Answer::sized(body.clone())
        }
    })
    .await
}

/// A descriptor of `content`, served at `url` (presigned) or by the orchestrator (`None`).
fn blob(content: &[u8], url: Option<String>) -> BlobDescriptor {
    BlobDescriptor {
        key: "runs/1/epoch-0/samples/1/out".into(),
        size: content.len() as u64,
        dtype: BlobDtype::F32,
        shape: vec![content.len() as u64 / 4],
        blake3: blake3_hex(content),
        url,
    }
}

fn assert_bad_object(r: Result<bytes::Bytes, ClientError>, what: &str) {
    match r {
        Err(ClientError::BadObject(m)) => assert!(m.contains("descriptor says"), "{what}: {m}"),
        other => panic!("{what}: expected a bad-object refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn a_blob_is_never_read_past_its_descriptor() {
    let content = vec![1u8; 64];
    let good = content.clone();
    let base = serve(move |path| match path {
        // Honest, with and without Content-Length.
        "/good" => Answer::sized(good.clone()),
        "/good-unsized" => Answer::ok(vec![], Body::Bytes(good.clone())),
        // Overwritten with an endless object, its length not announced.
        "/endless" => Answer::ok(vec![], Body::Endless),
        // Announces far more than the descriptor (and would send it).
        "/huge" => Answer::ok(
            vec![format!("Content-Length: {}", 1u64 << 40)],
            Body::Endless,
        ),
        // The described length, other bytes (a store whose object was overwritten).
        "/tampered" => Answer::ok(
            vec![format!("Content-Length: {}", good.len())],
            Body::Bytes(vec![2u8; 64]),
        ),
        // Announces less than the descriptor.
        "/short" => Answer::ok(vec!["Content-Length: 8".into()], Body::Bytes(vec![1u8; 8])),
        // More bytes than announced and described: a chunked body of twice the size.
        "/chunked" => {
            let mut body = format!("{:x}\r\n", 2 * 64).into_bytes();
            body.extend_from_slice(&[1u8; 128]);
            body.extend_from_slice(b"\r\n0\r\n\r\n");
            Answer::ok(vec!["Transfer-Encoding: chunked".into()], Body::Bytes(body))
        }
        "/gone" => Answer {
            status: "404 Not Found",
            headers: vec!["Content-Length: 0".into()],
            body: Body::Bytes(Vec::new()),
        },
        // The orchestrator's own blob route, endless.
        p if p.starts_with("/v1/blobs/") => Answer::ok(vec![], Body::Endless),
        _ => Answer {
            status: "500 Internal Server Error",
            headers: vec![],
            body: Body::Bytes(Vec::new()),
        },
    })
    .await;
    let c = client(&base);
    let at = |p: &str| Some(format!("{base}{p}"));

    for p in ["/good", "/good-unsized"] {
        let got = c.download(&blob(&content, at(p))).await.expect(p);
        assert_eq!(&got[..], &content[..], "{p}");
    }
    for p in ["/endless", "/huge", "/short", "/chunked", "/tampered"] {
        assert_bad_object(c.download(&blob(&content, at(p))).await, p);
    }
    // Refused on the announced length alone, without waiting for a body.
    for (p, announced) in [("/huge", 1u64 << 40), ("/short", 8)] {
        match c.download(&blob(&content, at(p))).await {
            Err(ClientError::BadObject(m)) => {
                assert!(
                    m.contains(&format!("Content-Length {announced},")),
                    "{p}: {m}"
                )
            }
            other => panic!("{p}: expected a bad-object refusal, got {other:?}"),
        }
    }
    // Through the orchestrator (no presigned URL), the same bound.
    assert_bad_object(c.download(&blob(&content, None)).await, "orchestrator");
    // An object the store does not have reads as the orchestrator's 404 does.
    match c.download(&blob(&content, at("/gone"))).await {
        Err(e @ ClientError::Api { status: 404, .. }) => {
            assert_eq!(e.code(), Some(ErrorCode::NotFound))
        }
        other => panic!("missing object: {other:?}"),
    }
}

#[tokio::test]
async fn a_json_answer_is_never_read_past_the_limit() {
    let base = serve(|path| match path {
        "/v1/status" => Answer::ok(vec![], Body::Endless),
        _ => Answer::ok(
            vec![
                format!("Content-Length: {}", MAX_RESPONSE_BYTES + 1),
                "Content-Type: application/json".into(),
            ],
            Body::Endless,
        ),
    })
    .await;
    let c = client(&base);
    for (what, r) in [
        ("unannounced", c.status().await.map(|_| ())),
        ("announced", c.merges().await.map(|_| ())),
    ] {
        match r {
            Err(ClientError::Decode(m)) => {
                assert!(m.contains(&MAX_RESPONSE_BYTES.to_string()), "{what}: {m}");
                // The announced one on its Content-Length, before reading.
                let on_length = format!("Content-Length {}", MAX_RESPONSE_BYTES + 1);
                assert_eq!(m.contains(&on_length), what == "announced", "{what}: {m}");
            }
            other => panic!("{what}: expected a refusal, got {other:?}"),
        }
    }
}

fn run() -> RunConfig {
    RunConfig {
        name: "t".into(),
        model: "tiny".into(),
        stages: 3,
        stage_params: vec![1000, 1000, 1000],
        partitions: 2,
        micro_batch: 4,
        seq_len: 64,
        boundary_dim: 8,
        wire: WireEncoding::Int8,
        samples_per_epoch: 48,
        max_in_flight: 4,
        training_s: 90,
        uploading_s: 30,
        merging_s: 30,
        merge_round_s: 10,
        lease_s: 10,
        heartbeat_timeout_s: 6,
        retention_epochs: 3,
        init_seed: 0,
        outer_lr: 0.7,
        outer_momentum: 0.9,
        inner_lr: 3e-3,
        inner_steps_every: 2,
        dataset: None,
        stage_memory: Vec::new(),
        sparse: None,
    }
}

#[tokio::test]
async fn a_run_outside_the_bounds_is_refused_on_connect() {
    let serve_run = |config: RunConfig| {
        let body = serde_json::to_vec(&RunInfo {
            id: 1,
            config,
            orchestrator_hotkey: "orchestrator".into(),
            netuid: 9,
            created_ms: 0,
            direct_uploads: false,
        })
        .expect("json");
        serve(move |_| {
            Answer::ok(
                vec![
                    format!("Content-Length: {}", body.len()),
                    "Content-Type: application/json".into(),
                ],
                Body::Bytes(body.clone()),
            )
        })
    };
    let base = serve_run(run()).await;
    ApiClient::connect(&base, signer(), retry())
        .await
        .expect("a valid run");
    let mut huge = run();
    huge.partitions = u32::MAX;
    huge.stage_params = vec![u64::from(u32::MAX); 3];
    let mut overflowing = run();
    overflowing.heartbeat_timeout_s = u64::MAX;
    for (what, bad) in [("partitions", huge), ("heartbeat_timeout_s", overflowing)] {
        let base = serve_run(bad).await;
        match ApiClient::connect(&base, signer(), retry()).await {
            Err(ClientError::InvalidRun(m)) => assert!(m.contains(what), "{m}"),
            Err(e) => panic!("{what}: {e}"),
            Ok(_) => panic!("{what}: accepted"),
        }
        let c = client(&base);
        assert!(matches!(
            c.run_info().await,
            Err(ClientError::InvalidRun(_))
        ));
    }
}

/// A store that answers 503 (S3's SlowDown) once is asked again: presigned downloads are retried
/// as API requests are. A single 503 failed the hop.
#[tokio::test]
async fn a_presigned_download_is_retried() {
    let content = vec![9u8; 64];
    let requests = counter();
    let base = unavailable_once(&content, &[], requests.clone()).await;
    let b = blob(&content, Some(format!("{base}/bucket/object")));
    let got = retrying(&base, 3).download(&b).await.expect("download");
    assert_eq!(&got[..], &content[..]);
    assert_eq!(seen(&requests), 2);
}

/// A store that asks for a pause (429 or 503 with Retry-After, as S3-compatible stores may) is
/// given it before the next attempt, as the orchestrator is; downloads once retried after only
/// the policy's backoff (10 ms here).
#[tokio::test]
async fn a_stores_retry_after_is_waited_for() {
    let content = vec![3u8; 64];
    let requests = counter();
    let base = unavailable_once(&content, &["Retry-After: 1"], requests.clone()).await;
    let b = blob(&content, Some(format!("{base}/bucket/object")));
    let started = std::time::Instant::now();
    let got = retrying(&base, 3).download(&b).await.expect("download");
    assert_eq!(&got[..], &content[..]);
    assert_eq!(seen(&requests), 2);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "tried again after {:?}",
        started.elapsed()
    );
}

/// An answer that is final stays final when its body is cut off: a 403 whose error body breaks
/// off is not sent again (it was, up to every attempt).
#[tokio::test]
async fn a_refusal_with_a_broken_body_is_not_retried() {
    let requests = counter();
    let n = requests.clone();
    let base = serve(move |_| {
        count(&n);
        Answer {
            status: "403 Forbidden",
            headers: vec!["Content-Length: 100".into()],
            body: Body::Bytes(b"{\"code\":".to_vec()),
        }
    })
    .await;
    let r: Result<serde_json::Value, _> = retrying(&base, 4)
        .signed_raw(reqwest::Method::GET, "/v1/miner/merges", None)
        .await;
    assert!(
        matches!(r, Err(ClientError::Api { status: 403, .. })),
        "{r:?}"
    );
    assert_eq!(seen(&requests), 1);
}

/// Retry-After is not waited out when no attempt follows.
#[tokio::test]
async fn retry_after_is_not_waited_after_the_last_attempt() {
    let base = serve(|_| Answer {
        status: "503 Service Unavailable",
        headers: vec!["Content-Length: 0".into(), "Retry-After: 30".into()],
        body: Body::Bytes(Vec::new()),
    })
    .await;
    let started = std::time::Instant::now();
    let r = client(&base).status().await;
    assert!(
        matches!(r, Err(ClientError::Api { status: 503, .. })),
        "{r:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited {:?}",
        started.elapsed()
    );
}

/// A path the URL parser would rewrite (here a space in the query) is refused before it is
/// sent: the signature covers the text as given, so the server would refuse it as a bad
/// signature with nothing to say why.
#[tokio::test]
async fn a_path_sent_otherwise_than_signed_is_refused_before_sending() {
    let requests = counter();
    let n = requests.clone();
    let base = serve(move |_| {
        count(&n);
        Answer::ok(
            vec!["Content-Length: 2".into()],
            Body::Bytes(b"{}".to_vec()),
        )
    })
    .await;
    for path in ["/v1/x?note=a b", "/v1/./x", "/v1/x#part", "/v1/é"] {
        let r: Result<serde_json::Value, _> = client(&base)
            .signed_raw(reqwest::Method::GET, path, None)
            .await;
        assert!(matches!(r, Err(ClientError::BadPath(_))), "{path}: {r:?}");
    }
    assert_eq!(seen(&requests), 0);
    let ok: serde_json::Value = client(&base)
        .signed_raw(reqwest::Method::GET, "/v1/x?note=a%20b", None)
        .await
        .expect("an encoded path");
    assert_eq!(ok, serde_json::json!({}));
}

/// Spot-check pages that do not move on end in an error, not a loop: an orchestrator that
/// answers every page with the same cursor was asked again for ever.
#[tokio::test]
async fn spot_check_pages_that_do_not_move_on_are_refused() {
    let requests = counter();
    let n = requests.clone();
    let base = serve(move |_| {
        count(&n);
        let body =
            br#"{"epoch":0,"miners":[],"next_after":"a","partitions":[],"reported":[]}"#.to_vec();
        Answer::sized(body)
    })
    .await;
    let r = tokio::time::timeout(Duration::from_secs(10), client(&base).spot_checks(0))
        .await
        .expect("an answer, not a loop");
    assert!(matches!(r, Err(ClientError::Decode(_))), "{r:?}");
    assert_eq!(seen(&requests), 2);
}

/// A large object on a slow link gets the time its size needs: a second more per MiB than the
/// policy's timeout. One fixed timeout for every request cut off any tensor larger than it
/// could carry in that time. Here 3 MiB at about 2 MiB/s (1.5 s) against a 1 s timeout.
#[tokio::test]
async fn a_large_download_gets_time_for_its_size() {
    let content: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
    let body = content.clone();
    let base = serve(move |_| {
        Answer::ok(
            vec![format!("Content-Length: {}", body.len())],
            Body::Paced(body.clone(), Duration::from_millis(31)),
        )
    })
    .await;
    let policy = RetryPolicy {
        timeout: Duration::from_secs(1),
        ..retry()
    };
    assert_eq!(policy.timeout_for(3 << 20), Duration::from_secs(4));
    let client = ApiClient::new(&base, signer(), "orchestrator", policy)
        .expect("client")
        .with_sessions(false);
    for url in [Some(format!("{base}/bucket/object")), None] {
        let presigned = url.is_some();
        let got = client
            .download(&blob(&content, url))
            .await
            .unwrap_or_else(|e| panic!("presigned {presigned}: {e}"));
        assert_eq!(got.len(), content.len());
    }
}

/// A connected client bounds every download by the run's largest object: a descriptor that
/// says more is refused before a byte is asked for, so an orchestrator cannot size a client's
/// download (and its memory) past what the run can hold.
#[tokio::test]
async fn a_descriptor_larger_than_any_object_of_the_run_is_refused_unread() {
    let body = serde_json::to_vec(&RunInfo {
        id: 1,
        config: run(),
        orchestrator_hotkey: "orchestrator".into(),
        netuid: 9,
        created_ms: 0,
        direct_uploads: false,
    })
    .expect("json");
    let content = vec![3u8; 64];
    let blobs = counter();
    let (served, asked) = (content.clone(), blobs.clone());
    let base = serve(move |path| {
        if path == "/v1/run" {
            return Answer::ok(
                vec![
                    format!("Content-Length: {}", body.len()),
                    "Content-Type: application/json".into(),
                ],
                Body::Bytes(body.clone()),
            );
        }
        count(&asked);
        if path == "/small" {
            Answer::sized(served.clone())
        } else if path == "/largest" {
            let largest = vec![4u8; run().max_object_bytes() as usize];
            Answer::sized(largest)
        } else {
            Answer::ok(Vec::new(), Body::Endless)
        }
    })
    .await;
    let c = ApiClient::connect(&base, signer(), retry())
        .await
        .expect("connect")
        .with_sessions(false);
    let max = run().max_object_bytes();
    let mut huge = blob(&content, Some(format!("{base}/huge")));
    huge.size = max + 1;
    match c.download(&huge).await {
        Err(ClientError::BadObject(m)) => {
            assert!(m.contains("more than any object of this run"), "{m}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(seen(&blobs), 0, "nothing was asked for");
    // An object within the bound downloads as before, one of exactly the bound too.
    let small = blob(&content, Some(format!("{base}/small")));
    assert_eq!(c.download(&small).await.expect("download"), content);
    assert_eq!(seen(&blobs), 1);
    let largest = vec![4u8; max as usize];
    let at_bound = blob(&largest, Some(format!("{base}/largest")));
    assert_eq!(c.download(&at_bound).await.expect("download"), largest);
}

/// Answers worth another attempt are tried again: 429 and 408 (a rate limit, a body too slow to
/// arrive), a 5xx whose body breaks off, and a success whose body breaks off (it was read as the
/// answer, cut short).
#[tokio::test]
async fn answers_worth_another_attempt_are_retried() {
    let cases: [(&str, &str, Vec<String>, &[u8]); 4] = [
        (
            "429",
            "429 Too Many Requests",
            vec!["Content-Length: 0".into()],
            b"",
        ),
        (
            "408",
            "408 Request Timeout",
            vec!["Content-Length: 0".into()],
            b"",
        ),
        (
            "503, cut off",
            "503 Service Unavailable",
            vec!["Content-Length: 100".into()],
            b"{\"code\":",
        ),
        (
            "200, cut off",
            "200 OK",
            vec!["Content-Length: 100".into()],
            b"{\"id\":",
        ),
    ];
    for (what, status, headers, first) in cases {
        let requests = counter();
        let n = requests.clone();
        let first = first.to_vec();
        let base = serve(move |_| {
            if count(&n) == 0 {
                Answer {
                    status,
                    headers: headers.clone(),
                    body: Body::Bytes(first.clone()),
                }
            } else {
                Answer::ok(
                    vec!["Content-Length: 8".into()],
                    Body::Bytes(b"{\"id\":1}".to_vec()),
                )
            }
        })
        .await;
        let got: Result<serde_json::Value, _> = retrying(&base, 3).public_get("/v1/x").await;
        assert_eq!(got.ok(), Some(serde_json::json!({"id": 1})), "{what}");
        assert_eq!(seen(&requests), 2, "{what}");
    }
}

/// An error answer keeps its status and code: a small JSON error body is read, a large one is
/// cut to a note instead of replacing the answer with a client-side refusal.
#[tokio::test]
async fn error_answers_keep_their_status_and_code() {
    let conflict = br#"{"code":"conflict","message":"other bytes"}"#.to_vec();
    let base = serve(move |path| match path {
        "/small" => Answer {
            status: "409 Conflict",
            headers: vec![format!("Content-Length: {}", conflict.len())],
            body: Body::Bytes(conflict.clone()),
        },
        _ => Answer {
            status: "403 Forbidden",
            headers: vec![format!("Content-Length: {}", 100 << 10)],
            body: Body::Bytes(vec![b' '; 100 << 10]),
        },
    })
    .await;
    let c = client(&base);
    match c.public_get::<serde_json::Value>("/small").await {
        Err(e @ ClientError::Api { status: 409, .. }) => {
            assert_eq!(e.code(), Some(ErrorCode::Conflict), "{e}")
        }
        other => panic!("small error body: {other:?}"),
    }
    match c.public_get::<serde_json::Value>("/large").await {
        Err(e @ ClientError::Api { status: 403, .. }) => {
            assert!(e.to_string().contains("error body over"), "{e}")
        }
        other => panic!("large error body: {other:?}"),
    }
}

/// A request as the client sends it passes the server's check: signed now, for the receiver,
/// over the method, path, query and body that went on the wire.
#[tokio::test]
async fn a_signed_request_verifies_as_sent() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.expect("accept");
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            conn.read_exact(&mut byte).await.expect("head");
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        let mut lines = head.split("\r\n");
        let request_line: Vec<String> = lines
            .next()
            .unwrap_or_default()
            .split(' ')
            .map(str::to_owned)
            .collect();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let len = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0usize);
        let mut body = vec![0u8; len];
        conn.read_exact(&mut body).await.expect("body");
        let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
        conn.write_all(answer).await.expect("answer");
        let _ = tx.send((request_line, headers, body));
    });
    let receiver = RequestSigner::ss58(&sp_core::sr25519::Pair::from_seed(&[9; 32]));
    let c = ApiClient::new(&base, signer(), &receiver, retry())
        .expect("client")
        .with_sessions(false);
    let sent: serde_json::Value = c
        .signed_json(
            reqwest::Method::POST,
            "/v1/miner/heartbeat?x=1",
            &serde_json::json!({"tokens_per_s": 12.5}),
        )
        .await
        .expect("answered");
    assert_eq!(sent, serde_json::json!({}));
    let (request_line, headers, body) = rx.await.expect("captured");
    let header = |name: &'static str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    let verified = iota_protocol::signing::verify_request(
        header,
        &request_line[0],
        &request_line[1],
        &body,
        &receiver,
        now,
        iota_protocol::signing::SkewWindow::default(),
    )
    .expect("the server's check passes");
    assert_eq!(
        verified.signer,
        sp_core::sr25519::Pair::from_seed(&[7; 32]).public().0
    );
    assert_eq!(request_line[1], "/v1/miner/heartbeat?x=1");
    assert_eq!(body, br#"{"tokens_per_s":12.5}"#);
}

/// Spot-check pages are followed to the end and joined; a page that does not follow its cursor
/// (a miner not after it, miners out of order, a next cursor that is not its last miner) is
/// refused rather than joined or followed.
#[tokio::test]
async fn spot_check_pages_are_joined_in_order_or_refused() {
    let page = |miners: &[&str], next| spot_check_page(miners, next);
    // What the page after `b` is, and the miners the whole list then holds (`None`: refused).
    type Case = (&'static str, Vec<u8>, Option<&'static [&'static str]>);
    let cases: Vec<Case> = vec![
        (
            "in order",
            page(&["c", "d"], None),
            Some(&["a", "b", "c", "d"]),
        ),
        ("a full last page", page(&["c"], Some("c")), None),
        ("not after the cursor", page(&["b", "c"], None), None),
        ("out of order", page(&["d", "c"], None), None),
        ("a cursor not its last", page(&["c", "d"], Some("c")), None),
        ("a miner twice", page(&["c", "c"], None), None),
    ];
    for (what, second, joined) in cases {
        let first = page(&["a", "b"], Some("b"));
        let end = page(&[], None);
        let base = serve(move |path| {
            let body = if path.ends_with("?after=b") {
                second.clone()
            } else if path.contains("?after=") {
                end.clone()
            } else {
                first.clone()
            };
            Answer::sized(body)
        })
        .await;
        let got = client(&base).spot_checks(0).await;
        match joined {
            Some(hotkeys) => {
                let got = got.unwrap_or_else(|e| panic!("{what}: {e}"));
                let miners: Vec<&str> = got.miners.iter().map(|m| m.hotkey.as_str()).collect();
                assert_eq!(miners, hotkeys, "{what}");
                assert_eq!(got.next_after, None, "{what}");
            }
            // A full last page is followed by an empty one, which ends the list.
            None if what == "a full last page" => {
                let got = got.unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(got.miners.len(), 3, "{what}");
            }
            None => assert!(
                matches!(got, Err(ClientError::Decode(_))),
                "{what}: {got:?}"
            ),
        }
    }
}

/// The joined pages hold at most 65,536 miners (far more than a subnet's uids): a server that
/// lists more is refused, not followed.
#[tokio::test]
async fn spot_check_pages_hold_a_bounded_number_of_miners() {
    const MAX: usize = 1 << 16;
    for (second, ok) in [(MAX - 2, true), (MAX - 1, false)] {
        let first = spot_check_page(&["a", "b"], Some("b"));
        let names: Vec<String> = (0..second).map(|i| format!("c{i:06}")).collect();
        let rest = spot_check_page(&names, None);
        let base = serve(move |path| {
            let body = if path.contains("?after=") {
                rest.clone()
            } else {
                first.clone()
            };
            Answer::sized(body)
        })
        .await;
        let got = client(&base).spot_checks(0).await;
        match ok {
            true => assert_eq!(got.map(|t| t.miners.len()).ok(), Some(MAX)),
            false => assert!(matches!(got, Err(ClientError::Decode(_))), "{got:?}"),
        }
    }
}

/// A spot-check page listing `miners` (no hops, partitions or reports), then `next`.
fn spot_check_page(miners: &[impl AsRef<str>], next: Option<&str>) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "epoch": 0,
        "miners": miners.iter().map(|m| serde_json::json!({
            "hotkey": m.as_ref(), "stage": 0, "hop_task_ids": [], "pseudo_gradient_partitions": [],
        })).collect::<Vec<_>>(),
        "next_after": next,
        "partitions": [],
        "reported": [],
    }))
    .expect("json")
}

/// The small wrappers each ask their own route and return what came back; the getters give what
/// the client was made with.
#[tokio::test]
async fn wrappers_ask_their_routes_and_getters_return_the_setup() {
    use iota_protocol::api::{Dispute, PartitionState, PartitionStatus};
    let partition = PartitionStatus {
        epoch: 7,
        stage: 1,
        partition: 2,
        state: PartitionState::Accepted,
        owners: vec!["owner".into()],
        results: Vec::new(),
        accepted: None,
        resolved_by: Some("agreement".into()),
    };
    let dispute = Dispute {
        id: 3,
        partition: partition.clone(),
        contributions: Vec::new(),
        state: "open".into(),
    };
    let merges = serde_json::to_vec(&[&partition]).expect("json");
    let disputes = serde_json::to_vec(&[&dispute]).expect("json");
    let base = serve(move |path| {
        let body = match path {
            "/v1/epochs/7/merges" => merges.clone(),
            "/v1/validator/disputes" => disputes.clone(),
            _ => {
                return Answer {
                    status: "404 Not Found",
                    headers: vec!["Content-Length: 0".into()],
                    body: Body::Bytes(Vec::new()),
                };
            }
        };
        Answer::sized(body)
    })
    .await;
    let c = client(&format!("{base}/"));
    assert_eq!(c.base(), base, "the base URL, without its trailing slash");
    assert_eq!(c.hotkey(), signer().ss58());
    assert_eq!(c.merge_status(7).await.expect("merges"), vec![partition]);
    assert_eq!(c.disputes().await.expect("disputes"), vec![dispute]);
}

#[tokio::test]
async fn a_dataset_file_is_streamed_to_disk_and_never_past_its_descriptor() {
    use iota_protocol::dataset::DatasetFile;
    let content = vec![7u8; 3 << 20];
    let good = content.clone();
    let base = serve(move |path| match path {
        "/good" => Answer::sized(good.clone()),
        "/endless" => Answer::ok(vec![], Body::Endless),
        "/huge" => Answer::ok(
            vec![format!("Content-Length: {}", 1u64 << 40)],
            Body::Endless,
        ),
        "/tampered" => {
            let mut bad = good.clone();
            bad[100] ^= 1;
            Answer::sized(bad)
        }
        _ => Answer::sized(Vec::new()),
    })
    .await;
    let c = client(&base);
    let dir = std::env::temp_dir().join(format!("iota-dataset-file-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).expect("dir");
    let file = |path: &str| DatasetFile {
        name: "train-00000.tok".into(),
        key: "datasets/x/train-00000.tok".into(),
        size: content.len() as u64,
        blake3: blake3_hex(&content),
        url: Some(format!("{base}{path}")),
    };
    let dest = dir.join("train-00000.tok");
    let part = dir.join("train-00000.tok.part");
    for (path, what) in [
        ("/endless", "descriptor says"),
        ("/huge", "descriptor says"),
        ("/tampered", "BLAKE3"),
    ] {
        match c.download_file(&file(path), &dest).await {
            Err(ClientError::BadObject(m)) => assert!(m.contains(what), "{path}: {m}"),
            other => panic!("{path}: expected a bad-object refusal, got {other:?}"),
        }
        assert!(!dest.exists() && !part.exists(), "{path} left a file");
    }
    c.download_file(&file("/good"), &dest).await.expect("good");
    assert_eq!(std::fs::read(&dest).expect("written"), content);
    assert!(!part.exists());
    std::fs::remove_dir_all(&dir).ok();
}
