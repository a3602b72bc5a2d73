//! The typed API client: signs every request, retries what is safe to retry.
//!
//! Every orchestrator handler is idempotent, so any request may be retried. A retry is signed
//! again (fresh uuid and timestamp), since the server refuses a uuid it has seen. Retries happen on
//! connection errors, timeouts, 429 and 5xx, with exponential backoff and full jitter, honouring
//! `Retry-After`. 4xx answers other than 429 are final and come back as [`ClientError::Api`].
//!
//! Signed requests go out in a session (see [`crate::session`]) unless
//! [`ApiClient::with_sessions`] turned that off: the client opens one with an sr25519-signed
//! handshake on its first signed request, renews it before it expires, opens a new one once when
//! a request in it is refused as `unknown_session` or `unauthenticated` (expired by the server's
//! clock, or a run made anew with another secret), and signs with sr25519 alone against a server
//! without the route (404 or 405 on `POST /v1/sessions`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rand::Rng;
use reqwest::{Method, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::api::*;
use crate::blob::{BlobDescriptor, blake3_hex};
use crate::dataset::{DatasetFile, DatasetFiles};
use crate::error::{ApiError, ErrorCode};
use crate::session::{ClientSession, Handshake, SESSIONS_PATH, decode_public_hex};
use crate::signing::{RequestSigner, authenticate_request, decode_signer};

mod miner;
mod transfer;
mod validator;

/// Retry schedule.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// Attempts in all (1 = no retry).
    pub attempts: u32,
    /// First backoff.
    pub base: Duration,
    /// Longest backoff.
    pub max: Duration,
    /// Per-request timeout.
    pub timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 6,
            base: Duration::from_millis(200),
            max: Duration::from_secs(10),
            timeout: Duration::from_secs(60),
        }
    }
}

/// The slowest transfer a request is given time for, in bytes per second: the pace the
/// orchestrator holds a request body to.
pub const MIN_TRANSFER_BYTES_PER_S: u64 = 1 << 20;

impl RetryPolicy {
    /// The time one attempt moving `bytes` (sent or read) is given: [`RetryPolicy::timeout`],
    /// and a second more per MiB. One fixed timeout for every request cut off any tensor larger
    /// than it could carry in that time, a merged partition of a large stage on any link.
    pub fn timeout_for(&self, bytes: u64) -> Duration {
        self.timeout + Duration::from_secs(bytes / MIN_TRANSFER_BYTES_PER_S)
    }

    /// Backoff before retry `n` (0-based): uniform in `[0, min(max, base·2^n)]` (full jitter),
    /// so many miners retrying at once spread out instead of arriving together.
    pub fn backoff(&self, n: u32, rng: &mut impl Rng) -> Duration {
        let cap = self
            .base
            .saturating_mul(1u32.checked_shl(n.min(20)).unwrap_or(u32::MAX))
            .min(self.max);
        cap.mul_f64(rng.gen_range(0.0..=1.0))
    }

    /// The wait before attempt `n`: none before the first (0); before a retry, the backoff for
    /// the retries before it, and at least the `Retry-After` the last answer gave (the least
    /// wait, not an extra one).
    fn wait_before(&self, n: u32, retry_after: Option<Duration>, rng: &mut impl Rng) -> Duration {
        match n {
            0 => Duration::ZERO,
            n => self
                .backoff(n - 1, rng)
                .max(retry_after.unwrap_or_default()),
        }
    }
}

/// Most miners a run's spot-check pages may list together (far more than a subnet's uids).
const MAX_SPOT_CHECK_MINERS: usize = 1 << 16;

/// What can go wrong calling the API.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error body.
    #[error("HTTP {status}: {error}")]
    Api {
        /// HTTP status.
        status: u16,
        /// The error body.
        error: ApiError,
    },
    /// The network failed on every attempt.
    #[error("network: {0}")]
    Network(String),
    /// The answer could not be understood.
    #[error("unexpected answer: {0}")]
    Decode(String),
    /// A downloaded object failed its size or hash check.
    #[error("bad object: {0}")]
    BadObject(String),
    /// The orchestrator describes a run no client should take part in (see
    /// [`RunConfig::validate`]).
    #[error("the orchestrator's run is invalid: {0}")]
    InvalidRun(String),
    /// A request path that would not be sent as given (see `ApiClient::url_of`).
    #[error("request path: {0}")]
    BadPath(String),
    /// A local file could not be written (a download to disk).
    #[error("file: {0}")]
    Io(String),
}

impl ClientError {
    /// The API error code, when the server gave one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Api { error, .. } => Some(error.code),
            _ => None,
        }
    }
}

/// A client for one orchestrator, signing as one hotkey.
#[derive(Clone)]
pub struct ApiClient {
    http: reqwest::Client,
    base: String,
    signer: Arc<dyn RequestSigner>,
    orchestrator: String,
    retry: RetryPolicy,
    /// The largest object [`ApiClient::download`] reads: the run's largest
    /// ([`RunConfig::max_object_bytes`]) once connected, so that a descriptor from a
    /// misbehaving orchestrator cannot size a download past what the run can hold.
    max_object_bytes: u64,
    /// Whether uploads go straight to the store through presigned URLs
    /// ([`RunInfo::direct_uploads`] once connected, unless turned off).
    direct_uploads: bool,
    /// The session signed requests go out in (shared by the client's clones).
    sessions: Arc<Sessions>,
}

/// A client's session, opened when first needed.
#[derive(Default)]
struct Sessions {
    /// Off: every request is signed with sr25519 (set by [`ApiClient::with_sessions`], or when
    /// the server has no session route).
    off: std::sync::atomic::AtomicBool,
    current: std::sync::Mutex<Option<ClientSession>>,
    /// Held while a session is opened, so that concurrent requests open one, not one each.
    opening: tokio::sync::Mutex<()>,
}

impl Sessions {
    fn usable(&self, now_ms: u64) -> Option<ClientSession> {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        current
            .as_ref()
            .filter(|s| !s.needs_renewal(now_ms))
            .cloned()
    }

    /// Forgets the session `token` names (the server no longer takes it), unless another
    /// replaced it.
    fn forget(&self, token: &str) {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_some_and(|s| s.token == token) {
            *current = None;
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn is_retryable_status(status: StatusCode) -> bool {
    // 408: the body was too slow to arrive (a network hiccup); the request is sent again whole.
    status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::REQUEST_TIMEOUT
        || status.is_server_error()
}

/// The largest JSON answer read from the orchestrator. Its biggest answers are pages of hop
/// records (a few hundred bytes each, 500 to a page) and an epoch record (a blob descriptor per
/// pseudo-gradient and partition); 64 MiB is orders of magnitude above them and still a bound a
/// misbehaving server cannot push a client's memory past.
pub const MAX_RESPONSE_BYTES: u64 = 64 << 20;

/// The most of an error body read: only its start is shown.
const MAX_ERROR_BODY_BYTES: u64 = 64 << 10;

/// How much of a response body may be read.
#[derive(Clone, Copy, Debug)]
enum BodyLimit {
    /// A JSON answer: at most [`MAX_RESPONSE_BYTES`].
    Json,
    /// An error answer: at most [`MAX_ERROR_BODY_BYTES`].
    ErrorBody,
    /// An object whose descriptor gives its size: exactly this many bytes.
    Exact(u64),
}

impl BodyLimit {
    fn max(self) -> u64 {
        match self {
            Self::Json => MAX_RESPONSE_BYTES,
            Self::ErrorBody => MAX_ERROR_BODY_BYTES,
            Self::Exact(n) => n,
        }
    }

    /// The error for a body over the limit (`declared`: its Content-Length, if that said so).
    fn refusal(self, what: &str, declared: Option<u64>) -> ClientError {
        let got = match declared {
            Some(n) => format!("Content-Length {n}"),
            None => "a longer body".to_owned(),
        };
        match self {
            Self::Json | Self::ErrorBody => ClientError::Decode(format!(
                "{what}: {got}, more than the {} bytes an answer may have",
                self.max()
            )),
            Self::Exact(n) => {
                ClientError::BadObject(format!("{what}: {got}, the descriptor says {n} bytes"))
            }
        }
    }
}

/// Why a body was not read.
enum BodyError {
    /// Over the limit (or, for an exact one, announced at another length): refused without
    /// reading the rest. The Content-Length, when that is what refused it.
    Refused(Option<u64>),
    /// The connection failed while reading.
    Network(String),
}

/// Reads `resp`'s body as a stream, refusing it as soon as it would exceed `limit` (and before
/// reading anything when its Content-Length says it will, or for an exact limit, that it will
/// not be exactly that long): a server or store cannot make the client hold more than the limit.
async fn read_body(resp: &mut reqwest::Response, limit: BodyLimit) -> Result<Bytes, BodyError> {
    let max = limit.max();
    let declared = resp.content_length();
    match (declared, limit) {
        (Some(n), BodyLimit::Exact(want)) if n != want => return Err(BodyError::Refused(Some(n))),
        (Some(n), _) if n > max => return Err(BodyError::Refused(Some(n))),
        _ => {}
    }
    // Never reserve more than a modest amount up front on a peer's say-so; the buffer grows.
    let reserve = declared.unwrap_or(0).min(max).min(16 << 20) as usize;
    let mut buf = bytes::BytesMut::with_capacity(reserve);
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| BodyError::Network(e.to_string()))?
    {
        if (buf.len() as u64).saturating_add(chunk.len() as u64) > max {
            return Err(BodyError::Refused(None));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// A request to the orchestrator, as each of its attempts sends it.
struct Request<'a> {
    method: &'a Method,
    url: &'a reqwest::Url,
    /// As signed: the URL's path and query, as the caller gave them.
    path_and_query: &'a str,
    body: Option<&'a Bytes>,
    signed: bool,
    content_type: &'static str,
    limit: BodyLimit,
}

/// What one attempt of a request came to.
enum Attempt {
    /// The answer, or a refusal the same request would meet again.
    Final(Result<Bytes, ClientError>),
    /// A failure worth another attempt, no sooner than `retry_after` if the server gave one.
    Again {
        error: ClientError,
        retry_after: Option<Duration>,
    },
}

impl Attempt {
    fn network(error: String) -> Self {
        Self::Again {
            error: ClientError::Network(error),
            retry_after: None,
        }
    }
}

/// An answer's `Retry-After` in seconds (at most 30 are honoured).
fn retry_after(resp: &reqwest::Response) -> Option<Duration> {
    resp.headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(|secs| Duration::from_secs(secs.min(30)))
}

/// The signer of a client without a key ([`ApiClient::public`]): what it signs no orchestrator
/// accepts.
struct Anonymous;

impl RequestSigner for Anonymous {
    fn ss58(&self) -> String {
        String::new()
    }

    fn sign(&self, _message: &[u8]) -> [u8; 64] {
        [0; 64]
    }
}

impl ApiClient {
    /// A client for the orchestrator at `base` (`http://host:port`) whose hotkey is
    /// `orchestrator_ss58`.
    pub fn new(
        base: impl Into<String>,
        signer: Arc<dyn RequestSigner>,
        orchestrator_ss58: impl Into<String>,
        retry: RetryPolicy,
    ) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder()
            .timeout(retry.timeout)
            .pool_max_idle_per_host(64)
            .build()
            .map_err(|e| ClientError::Network(e.to_string()))?;
        Ok(Self {
            http,
            base: base.into().trim_end_matches('/').to_owned(),
            signer,
            orchestrator: orchestrator_ss58.into(),
            retry,
            max_object_bytes: u64::MAX,
            direct_uploads: false,
            sessions: Arc::default(),
        })
    }

    /// A client for the public routes only: it holds no key, and a signed route answers it as
    /// an unsigned caller (refused).
    pub fn public(base: impl Into<String>, retry: RetryPolicy) -> Result<Self, ClientError> {
        Ok(Self::new(base, Arc::new(Anonymous), String::new(), retry)?.with_sessions(false))
    }

    /// Whether uploads go straight to the store through presigned URLs (where the run's store
    /// presigns: [`RunInfo::direct_uploads`]) or through the orchestrator.
    pub fn with_direct_uploads(mut self, on: bool) -> Self {
        self.direct_uploads = on;
        self
    }

    /// Whether uploads go straight to the store.
    pub fn direct_uploads(&self) -> bool {
        self.direct_uploads
    }

    /// Whether signed requests go out in a session (the default) or each with its own sr25519
    /// signature. The client then holds a session of its own, not its original's.
    pub fn with_sessions(mut self, on: bool) -> Self {
        self.sessions = Arc::new(Sessions {
            off: (!on).into(),
            ..Sessions::default()
        });
        self
    }

    /// The session signed requests use now, opened if there is none or it is about to expire;
    /// `None` when sessions are off or could not be opened (the request is then signed with
    /// sr25519, and meets whatever refused the session on its own).
    async fn session(&self) -> Option<ClientSession> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.sessions.off.load(Relaxed) {
            return None;
        }
        if let Some(session) = self.sessions.usable(now_ms()) {
            return Some(session);
        }
        let _opening = self.sessions.opening.lock().await;
        if let Some(session) = self.sessions.usable(now_ms()) {
            return Some(session);
        }
        match self.open_session().await {
            Ok(session) => {
                *self
                    .sessions
                    .current
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(session.clone());
                Some(session)
            }
            Err(e) => {
                // A server without the route: sign every request, as before sessions.
                if matches!(
                    e.code(),
                    Some(ErrorCode::NotFound | ErrorCode::MethodNotAllowed)
                ) {
                    self.sessions.off.store(true, Relaxed);
                }
                tracing::debug!(error = %e, "no session; signing with sr25519");
                None
            }
        }
    }

    /// `POST /v1/sessions`, signed with sr25519: a new session and its key.
    pub async fn open_session(&self) -> Result<ClientSession, ClientError> {
        let opened_at_ms = now_ms();
        let handshake = Handshake::new();
        let body = Bytes::from(
            serde_json::to_vec(&OpenSessionRequest {
                public_key: handshake.public_hex(),
            })
            .map_err(|e| ClientError::Decode(e.to_string()))?,
        );
        let url = self.url_of(SESSIONS_PATH)?;
        let request = Request {
            method: &Method::POST,
            url: &url,
            path_and_query: SESSIONS_PATH,
            body: Some(&body),
            signed: true,
            content_type: "application/json",
            limit: BodyLimit::Json,
        };
        let bytes = self
            .with_retries(|attempt| self.try_request(&request, None, attempt))
            .await?;
        let answer: OpenSessionResponse =
            serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode(e.to_string()))?;
        let bad = |e: String| ClientError::Decode(format!("open session: {e}"));
        let server_public =
            decode_public_hex(&answer.public_key).map_err(|e| bad(e.to_string()))?;
        let sealed = decode_public_hex(&answer.sealed_key).map_err(|e| bad(e.to_string()))?;
        let caller_key = decode_signer(&self.signer.ss58()).map_err(|e| bad(e.to_string()))?;
        let key = handshake
            .finish(
                &server_public,
                &sealed,
                &answer.session,
                &caller_key,
                &self.orchestrator,
            )
            .map_err(|e| bad(e.to_string()))?;
        Ok(ClientSession {
            token: answer.session,
            key,
            opened_at_ms,
            expires_at_ms: answer.expires_at_ms,
        })
    }

    /// Connects to `base`, learning the orchestrator's hotkey from `GET /v1/run`.
    pub async fn connect(
        base: impl Into<String>,
        signer: Arc<dyn RequestSigner>,
        retry: RetryPolicy,
    ) -> Result<Self, ClientError> {
        let mut client = Self::new(base, signer, String::new(), retry)?;
        let run = client.run_info().await?;
        client.orchestrator = run.orchestrator_hotkey;
        client.max_object_bytes = run.config.max_object_bytes();
        client.direct_uploads = run.direct_uploads;
        Ok(client)
    }

    /// `GET /v1/run`, checked with [`RunConfig::validate`]: the run is unsigned and sizes what
    /// miners and validators allocate, so one outside the protocol's bounds is refused here,
    /// before anything is built from it.
    pub async fn run_info(&self) -> Result<RunInfo, ClientError> {
        let run: RunInfo = self.public_get("/v1/run").await?;
        run.config.validate().map_err(ClientError::InvalidRun)?;
        Ok(run)
    }

    /// The signer's address.
    pub fn hotkey(&self) -> String {
        self.signer.ss58()
    }

    /// The orchestrator's base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// An unsigned GET of a public route.
    pub async fn public_get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        self.request(Method::GET, path, None, false).await
    }

    /// A signed request with a JSON body.
    pub async fn signed_json<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path_and_query: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        let bytes =
            Bytes::from(serde_json::to_vec(body).map_err(|e| ClientError::Decode(e.to_string()))?);
        self.request(method, path_and_query, Some(bytes), true)
            .await
    }

    /// A signed request with a raw body (uploads) or none.
    pub async fn signed_raw<T: DeserializeOwned>(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<Bytes>,
    ) -> Result<T, ClientError> {
        let bytes = self
            .request_bytes(
                method,
                path_and_query,
                body,
                true,
                "application/octet-stream",
                BodyLimit::Json,
            )
            .await?;
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode(e.to_string()))
    }

    async fn request<T: DeserializeOwned>(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<Bytes>,
        signed: bool,
    ) -> Result<T, ClientError> {
        let bytes = self
            .request_bytes(
                method,
                path_and_query,
                body,
                signed,
                "application/json",
                BodyLimit::Json,
            )
            .await?;
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode(e.to_string()))
    }

    async fn request_bytes(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<Bytes>,
        signed: bool,
        content_type: &'static str,
        limit: BodyLimit,
    ) -> Result<Bytes, ClientError> {
        let url = self.url_of(path_and_query)?;
        let request = Request {
            method: &method,
            url: &url,
            path_and_query,
            body: body.as_ref(),
            signed,
            content_type,
            limit,
        };
        let session = match signed {
            true => self.session().await,
            false => None,
        };
        let result = self
            .with_retries(|attempt| self.try_request(&request, session.as_ref(), attempt))
            .await;
        match (session, &result) {
            // The server no longer takes the session (expired by its clock, or its key is not
            // the server's: a run made anew under the same name): once more in a new one.
            (Some(old), Err(e))
                if matches!(
                    e.code(),
                    Some(ErrorCode::UnknownSession | ErrorCode::Unauthenticated)
                ) =>
            {
                self.sessions.forget(&old.token);
                let session = self.session().await;
                self.with_retries(|attempt| self.try_request(&request, session.as_ref(), attempt))
                    .await
            }
            _ => result,
        }
    }

    /// Makes `attempt` until one is final, at most [`RetryPolicy::attempts`] times, waiting the
    /// policy's backoff between them (and at least the `Retry-After` the last answer gave).
    async fn with_retries<F, Fut>(&self, mut attempt: F) -> Result<Bytes, ClientError>
    where
        F: FnMut(u32) -> Fut,
        Fut: std::future::Future<Output = Attempt>,
    {
        let mut last_error = ClientError::Network("no attempt made".into());
        let mut retry_after = None;
        for n in 0..self.retry.attempts.max(1) {
            // Apart: the thread's RNG must not be held across the wait.
            let wait = self
                .retry
                .wait_before(n, retry_after.take(), &mut rand::thread_rng());
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            match attempt(n).await {
                Attempt::Final(result) => return result,
                Attempt::Again {
                    error,
                    retry_after: wait,
                } => {
                    last_error = error;
                    retry_after = wait;
                }
            }
        }
        Err(last_error)
    }

    /// One attempt of a request to the orchestrator, signed afresh (with `session`'s key, if
    /// given).
    async fn try_request(
        &self,
        request: &Request<'_>,
        session: Option<&ClientSession>,
        attempt: u32,
    ) -> Attempt {
        let path_and_query = request.path_and_query;
        let limit = request.limit;
        let raw = request.body.cloned().unwrap_or_default();
        let moved = match limit {
            BodyLimit::Exact(n) => n,
            _ => 0,
        };
        let mut req = self
            .http
            .request(request.method.clone(), request.url.clone())
            .timeout(self.retry.timeout_for(moved.max(raw.len() as u64)));
        if request.signed {
            let headers = authenticate_request(
                self.signer.as_ref(),
                session,
                &self.orchestrator,
                request.method.as_str(),
                path_and_query,
                &raw,
                now_ms(),
                Uuid::new_v4(),
            );
            for (name, value) in headers.headers {
                req = req.header(name, value);
            }
        }
        if request.body.is_some() {
            req = req
                .header(reqwest::header::CONTENT_TYPE, request.content_type)
                .body(raw);
        }
        let mut resp = match req.send().await {
            Ok(resp) => resp,
            Err(e) => {
                tracing::debug!(error = %e, attempt, path = path_and_query, "network error, retrying");
                return Attempt::network(e.to_string());
            }
        };
        let status = resp.status();
        let retry_after = retry_after(&resp);
        let limit = if status.is_success() {
            limit
        } else {
            BodyLimit::ErrorBody
        };
        // Whether to try again is the status's to say: an answer that is final stays final
        // when its body is cut off.
        let final_answer = status.is_success() || !is_retryable_status(status);
        let bytes = match read_body(&mut resp, limit).await {
            Ok(b) => b,
            Err(BodyError::Network(e)) if final_answer && !status.is_success() => {
                Bytes::from(format!("(the error body was cut off: {e})"))
            }
            Err(BodyError::Network(e)) => {
                return Attempt::Again {
                    error: ClientError::Network(e),
                    retry_after,
                };
            }
            // Only its start is shown, so an error body's size does not matter.
            Err(BodyError::Refused(_)) if !status.is_success() => {
                Bytes::from(format!("(an error body over {MAX_ERROR_BODY_BYTES} bytes)"))
            }
            // Not a transient failure: the same answer would come again.
            Err(BodyError::Refused(declared)) => {
                return Attempt::Final(Err(limit.refusal(path_and_query, declared)));
            }
        };
        if status.is_success() {
            return Attempt::Final(Ok(bytes));
        }
        let error = serde_json::from_slice::<ApiError>(&bytes).unwrap_or_else(|_| {
            ApiError::new(
                ErrorCode::Internal,
                String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned(),
            )
        });
        let error = ClientError::Api {
            status: status.as_u16(),
            error,
        };
        if final_answer {
            return Attempt::Final(Err(error));
        }
        tracing::debug!(%status, attempt, path = path_and_query, "retrying");
        Attempt::Again { error, retry_after }
    }

    /// The URL of `path_and_query` on the orchestrator. It must be in the form the URL parser
    /// keeps (percent-encoded, no `.` segments, no fragment): the signature covers the text the
    /// caller gave and the server checks it against what arrives, so a path the parser rewrote
    /// would be refused as a bad signature, with nothing to say why.
    fn url_of(&self, path_and_query: &str) -> Result<reqwest::Url, ClientError> {
        let text = format!("{}{}", self.base, path_and_query);
        let url = reqwest::Url::parse(&text)
            .map_err(|e| ClientError::BadPath(format!("{path_and_query}: {e}")))?;
        let sent = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        if url.fragment().is_some() || !sent.ends_with(path_and_query) {
            return Err(ClientError::BadPath(format!(
                "{path_and_query} would be sent as {sent}: percent-encode it"
            )));
        }
        Ok(url)
    }
}

#[cfg(test)]
mod tests;
