//! Shared state of the handlers, the error type they return, and the request-signing gate.

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use governor::clock::DefaultClock;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};
use iota_chain::MetagraphIndex;
use iota_chain::wallet::PublicKey;
use iota_protocol::api::RunConfig;
use iota_protocol::signing::{HEADER_SIGNED_BY, SkewWindow, check_request};
use iota_protocol::{ApiError, AuthError, ErrorCode};
use sqlx::PgPool;
use tokio::sync::watch;

use crate::replay::{ReplayCache, ReplayError};
use crate::signatures::{SignatureVerifier, VerifyError};
use crate::store::{BlobStore, StoreError};

/// Request rate and size limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Sustained signed requests per second per hotkey.
    pub per_hotkey_rps: u32,
    /// Burst of signed requests per hotkey.
    pub per_hotkey_burst: u32,
    /// Sustained public requests per second per IP.
    pub per_ip_rps: u32,
    /// Burst of public requests per IP.
    pub per_ip_burst: u32,
    /// Largest JSON body.
    pub json_body_bytes: usize,
    /// Uploads buffered at once (each up to the largest tensor slot).
    pub concurrent_uploads: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            per_hotkey_rps: 50,
            per_hotkey_burst: 200,
            per_ip_rps: 50,
            per_ip_burst: 200,
            json_body_bytes: 1 << 20,
            concurrent_uploads: 64,
        }
    }
}

type KeyedLimiter<K> = RateLimiter<K, DefaultKeyedStateStore<K>, DefaultClock>;

/// The run this process serves.
#[derive(Clone, Debug)]
pub struct RunRow {
    /// Run id.
    pub id: i64,
    /// Shapes and timing.
    pub config: RunConfig,
    /// Subnet.
    pub netuid: u16,
    /// Created.
    pub created_at: DateTime<Utc>,
}

/// Everything a handler needs. Holds no run state of its own: that is in Postgres and the store.
pub struct AppState {
    /// Database.
    pub db: PgPool,
    /// Blobs.
    pub store: BlobStore,
    /// The run.
    pub run: RunRow,
    /// The orchestrator's hotkey (what requests must be signed for).
    pub hotkey: String,
    /// Latest metagraph.
    pub metagraph: watch::Receiver<Arc<MetagraphIndex>>,
    /// Accepted clock window of signed requests.
    pub skew: SkewWindow,
    /// Limits.
    pub limits: Limits,
    /// Whether this process drives the phases now.
    pub leader: AtomicBool,
    /// Merge reassignment rounds before the last deadline.
    pub max_merge_rounds: u32,
    /// Signed-request uuids seen (group-committed to the database).
    pub replay: ReplayCache,
    /// Batched verification of request signatures.
    pub signatures: SignatureVerifier,
    /// Work polls' first look, from memory.
    pub poll_view: crate::poll_view::PollView,
    per_hotkey: KeyedLimiter<[u8; 32]>,
    per_ip: KeyedLimiter<IpAddr>,
}

fn quota(rps: u32, burst: u32) -> Quota {
    let rps = NonZeroU32::new(rps.max(1)).unwrap_or(NonZeroU32::MIN);
    let burst = NonZeroU32::new(burst.max(1)).unwrap_or(NonZeroU32::MIN);
    Quota::per_second(rps).allow_burst(burst)
}

impl AppState {
    /// Builds the state.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        db: PgPool,
        store: BlobStore,
        run: RunRow,
        hotkey: String,
        metagraph: watch::Receiver<Arc<MetagraphIndex>>,
        skew: SkewWindow,
        limits: Limits,
        max_merge_rounds: u32,
    ) -> Self {
        Self {
            replay: ReplayCache::new(db.clone()),
            signatures: SignatureVerifier::default(),
            poll_view: crate::poll_view::PollView::new(db.clone(), run.id),
            db,
            store,
            run,
            hotkey,
            metagraph,
            skew,
            limits,
            leader: AtomicBool::new(false),
            max_merge_rounds,
            per_hotkey: RateLimiter::keyed(quota(limits.per_hotkey_rps, limits.per_hotkey_burst)),
            per_ip: RateLimiter::keyed(quota(limits.per_ip_rps, limits.per_ip_burst)),
        }
    }

    /// The run's config.
    pub fn config(&self) -> &RunConfig {
        &self.run.config
    }

    /// Whether this process is the phase driver.
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::Relaxed)
    }

    /// Forgets rate-limit keys that are back at full quota (bounded memory under churn).
    pub fn shrink_limiters(&self) {
        self.per_hotkey.retain_recent();
        self.per_ip.retain_recent();
        self.per_hotkey.shrink_to_fit();
        self.per_ip.shrink_to_fit();
    }
}

/// Shared handle.
pub type App = Arc<AppState>;

/// A handler error: an [`ApiError`] with its status.
#[derive(Debug)]
pub struct AppError(pub ApiError);

impl AppError {
    /// A new error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self(ApiError::new(code, message))
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status.is_server_error() {
            tracing::error!(code = self.0.code.as_str(), message = %self.0.message, "request failed");
        }
        let mut resp = (status, axum::Json(self.0)).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        Self::new(ErrorCode::Internal, format!("database: {e}"))
    }
}

impl From<StoreError> for AppError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(k) => Self::new(ErrorCode::NotFound, format!("no object {k}")),
            StoreError::BadKey(k) => Self::new(ErrorCode::BadRequest, format!("bad key {k:?}")),
            StoreError::Backend(m) => Self::new(ErrorCode::Internal, format!("store: {m}")),
        }
    }
}

impl From<ReplayError> for AppError {
    fn from(e: ReplayError) -> Self {
        Self::new(ErrorCode::Internal, e.to_string())
    }
}

impl From<VerifyError> for AppError {
    fn from(e: VerifyError) -> Self {
        match e {
            VerifyError::Auth(e) => e.into(),
            VerifyError::Stopped => Self::new(ErrorCode::Internal, e.to_string()),
        }
    }
}

impl From<AuthError> for AppError {
    fn from(e: AuthError) -> Self {
        let code = match e {
            AuthError::Stale { .. } | AuthError::Future { .. } => ErrorCode::ClockSkew,
            AuthError::Replayed(_) => ErrorCode::Replayed,
            _ => ErrorCode::Unauthenticated,
        };
        Self::new(code, e.to_string())
    }
}

/// Handler result.
pub type ApiResult<T> = Result<T, AppError>;

/// Who signed a request, after every check passed.
#[derive(Clone, Debug)]
pub struct Caller {
    /// Public key.
    pub key: PublicKey,
    /// SS58 address.
    pub ss58: String,
    /// Uid on the subnet.
    pub uid: u16,
    /// Validator permit.
    pub permit: bool,
}

/// Which callers a route group admits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Any hotkey registered on the subnet.
    Registered,
    /// Registered with a validator permit.
    Validator,
}

/// Milliseconds since the epoch, now.
pub fn now_ms() -> u64 {
    Utc::now().timestamp_millis().max(0) as u64
}

/// Signed-route middleware: buffers the body (bounded), verifies the Epistula signature against
/// method, path, query and body, checks the caller against the metagraph, rate-limits per
/// hotkey, and records the uuid in the shared replay cache. Cheap checks run first, so garbage
/// costs neither a signature check nor a database write.
pub async fn signed_gate(
    State((app, gate, body_limit)): State<(App, Gate, usize)>,
    req: Request,
    next: Next,
) -> Response {
    match check_signed(&app, gate, body_limit, req).await {
        Ok(req) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

async fn check_signed(
    app: &App,
    gate: Gate,
    body_limit: usize,
    req: Request,
) -> Result<Request, AppError> {
    let (mut parts, body) = req.into_parts();
    if let Some(len) = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > body_limit as u64
    {
        return Err(AppError::new(
            ErrorCode::PayloadTooLarge,
            format!("body of {len} bytes, this route takes at most {body_limit}"),
        ));
    }
    let bytes: Bytes = axum::body::to_bytes(body, body_limit).await.map_err(|_| {
        AppError::new(
            ErrorCode::PayloadTooLarge,
            format!("body larger than {body_limit} bytes"),
        )
    })?;
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    // Membership first (an O(1) lookup): a request in the name of a hotkey that is not on the
    // subnet costs no signature verification. The rate limit waits for the signature, so that
    // nobody can spend another hotkey's quota.
    if let Some(claimed) = parts
        .headers
        .get(HEADER_SIGNED_BY)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| PublicKey::from_ss58(v).ok().map(|k| (k, v)))
    {
        member(app, &claimed.0, claimed.1)?;
    }
    let signed = check_request(
        |name| parts.headers.get(name).and_then(|v| v.to_str().ok()),
        parts.method.as_str(),
        path_and_query,
        &bytes,
        &app.hotkey,
        now_ms(),
        app.skew,
    )?;
    let verified = app.signatures.verify(signed).await?;
    let key = PublicKey::from_bytes(verified.signer);
    let (uid, permit) = member(app, &key, &verified.signer_ss58)?;
    if gate == Gate::Validator && !permit {
        return Err(AppError::new(
            ErrorCode::NotValidator,
            format!("{} has no validator permit", verified.signer_ss58),
        ));
    }
    if app.per_hotkey.check_key(&verified.signer).is_err() {
        metrics::counter!("iota_rate_limited_total", "scope" => "hotkey").increment(1);
        return Err(AppError::new(
            ErrorCode::RateLimited,
            "too many requests from this hotkey",
        ));
    }
    // Committed before the request acts, so every process refuses the uuid from now on.
    if !app.replay.record(verified.uuid).await? {
        return Err(AuthError::Replayed(verified.uuid).into());
    }
    parts.extensions.insert(Caller {
        key,
        ss58: key.ss58(),
        uid,
        permit,
    });
    Ok(Request::from_parts(parts, Body::from(bytes)))
}

/// The uid and validator permit of `key` in the latest metagraph, or `not_registered`.
fn member(app: &App, key: &PublicKey, ss58: &str) -> Result<(u16, bool), AppError> {
    let index = app.metagraph.borrow();
    let neuron = index.neuron(key).ok_or_else(|| {
        AppError::new(
            ErrorCode::NotRegistered,
            format!(
                "{ss58} is not registered on subnet {} (metagraph at block {})",
                app.run.netuid,
                index.block()
            ),
        )
    })?;
    Ok((neuron.uid, neuron.validator_permit))
}

/// Public-route middleware: per-IP rate limit.
pub async fn public_gate(
    State(app): State<App>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    if app.per_ip.check_key(&peer.ip()).is_err() {
        metrics::counter!("iota_rate_limited_total", "scope" => "ip").increment(1);
        return AppError::new(
            ErrorCode::RateLimited,
            "too many requests from this address",
        )
        .into_response();
    }
    next.run(req).await
}

/// Deletes replay-cache entries older than the clock window allows (run by the phase driver).
pub async fn prune_replay_cache(db: &PgPool, window: SkewWindow) -> Result<u64, sqlx::Error> {
    let horizon = Duration::from_millis(window.replay_horizon_ms() + 1_000);
    let cutoff = Utc::now()
        - chrono::Duration::from_std(horizon).unwrap_or_else(|_| chrono::Duration::seconds(60));
    let r = sqlx::query("DELETE FROM request_uuids WHERE seen_at < $1")
        .bind(cutoff)
        .execute(db)
        .await?;
    Ok(r.rows_affected())
}

/// `axum::Json` whose rejections are the API's error body, and which refuses strings holding
/// U+0000: PostgreSQL stores that character in neither `text` nor `jsonb`, so such a body would
/// otherwise fail inside the handler as a database error (a 500) instead of a 400.
pub struct ApiJson<T>(pub T);

impl<T, S> axum::extract::FromRequest<S> for ApiJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let (parts, body) = req.into_parts();
        let bytes = Bytes::from_request(Request::from_parts(parts.clone(), body), state)
            .await
            .map_err(|e| AppError::new(ErrorCode::BadRequest, e.body_text()))?;
        if has_nul_escape(&bytes) {
            return Err(AppError::new(
                ErrorCode::BadRequest,
                "JSON strings may not contain U+0000",
            ));
        }
        let req = Request::from_parts(parts, Body::from(bytes));
        let axum::Json(value) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Self(value))
    }
}

/// Whether JSON text spells U+0000 in a string. Valid JSON can only write it as the escape
/// `\u0000` (a raw control byte is a syntax error); an escaped backslash before `u0000` is
/// skipped, so `"\\u0000"` (a backslash, then the letters) is not a match.
fn has_nul_escape(json: &[u8]) -> bool {
    let mut i = 0;
    while i < json.len() {
        if json[i] == b'\\' {
            if json.get(i + 1..i + 6) == Some(&b"u0000"[..]) {
                return true;
            }
            i += 2;
        } else {
            i += 1;
        }
    }
    false
}

/// `axum::extract::Path` whose rejections are the API's error body.
#[derive(axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(AppError))]
pub struct ApiPath<T>(pub T);

/// `axum::extract::Query` whose rejections are the API's error body.
#[derive(axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(AppError))]
pub struct ApiQuery<T>(pub T);

impl From<axum::extract::rejection::JsonRejection> for AppError {
    fn from(e: axum::extract::rejection::JsonRejection) -> Self {
        Self::new(ErrorCode::BadRequest, e.body_text())
    }
}

impl From<axum::extract::rejection::PathRejection> for AppError {
    fn from(e: axum::extract::rejection::PathRejection) -> Self {
        Self::new(ErrorCode::BadRequest, e.body_text())
    }
}

impl From<axum::extract::rejection::QueryRejection> for AppError {
    fn from(e: axum::extract::rejection::QueryRejection) -> Self {
        Self::new(ErrorCode::BadRequest, e.body_text())
    }
}

#[cfg(test)]
mod tests {
    use super::has_nul_escape;

    #[test]
    fn nul_escapes_are_found_and_escaped_backslashes_are_not() {
        assert!(has_nul_escape(br#"{"device":"\u0000"}"#));
        assert!(has_nul_escape(br#"["a\u0000b"]"#));
        assert!(has_nul_escape(br#"["\\\u0000"]"#));
        assert!(!has_nul_escape(br#"["\\u0000"]"#));
        assert!(!has_nul_escape(br#"{"a":"\u0001","b":"u0000"}"#));
        assert!(!has_nul_escape(b""));
        assert!(!has_nul_escape(b"\\"));
    }
}
