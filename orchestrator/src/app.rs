//! Shared state of the handlers, the error type they return, and the request-signing gate.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
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
use iota_protocol::signing::{
    HEADER_BODY_SHA256, SkewWindow, ToVerify, body_sha256_hex, check_headers, is_sha256_hex,
};
use iota_protocol::{ApiError, AuthError, ErrorCode};
use sqlx::PgPool;
use tokio::sync::watch;

use crate::replay::{Local, ReplayCache, ReplayError};
use crate::signatures::{SignatureVerifier, Signers, VerifyError};
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
    /// Of those, most from one IP address (0: no limit). A slot is taken once the signature
    /// over the body's declared hash holds, before the body arrives: without this, one host
    /// sending bodies slowly could hold every slot until the body deadline.
    pub concurrent_uploads_per_ip: usize,
    /// Of those, most for one hotkey (0: no limit), from however many addresses: one
    /// registered hotkey sending slow bodies from a few hosts would otherwise hold every slot.
    pub concurrent_uploads_per_hotkey: usize,
    /// Bodies read before their signature is checked (at most [`MAX_UNCHECKED_BODY`] each)
    /// that one IP address may have arriving at once (0: no limit). Only a body that is not all
    /// in when its request's head is (a client that sends slowly, or not at all) takes one of
    /// these, so a request sent whole never touches the count: without it, one host opening
    /// connections that announce a body and trickle it would make the server hold a buffer
    /// for each, for up to [`Limits::body_timeout`], without ever proving it holds a hotkey.
    pub unchecked_bodies_per_ip: usize,
    /// How long any signed request's body may take to start arriving; after it, the body must
    /// keep the pace of [`MIN_BODY_BYTES_PER_S`] (see [`read_body`]): a client that stops
    /// sending (or vanishes without closing its connection) would otherwise hold its buffer,
    /// its connection and, on upload routes, one of the upload slots for good.
    pub body_timeout: Duration,
    /// How long an upload waits for one of the `concurrent_uploads` slots before it is told to
    /// come back (`rate_limited`), so that slots held by slow senders never leave a request
    /// waiting without an answer.
    pub upload_slot_wait: Duration,
    /// How long a session lasts from when it is opened.
    pub session_ttl: Duration,
}

/// A client address as the per-IP limits count it ([`address_key`]) and the signer its request
/// claims (its public key).
type Forger = (IpAddr, [u8; 32]);

/// Where a signed request came from, for the bad-signature lock-out: the pair it counts against,
/// and the client's own address, which may be exempt from that pair's lock-out.
#[derive(Clone, Copy, Debug)]
struct Sender {
    forger: Forger,
    address: IpAddr,
}

/// Bad signatures an address may send a second in one signer's name, and at once, before it is
/// refused in that name for [`FORGER_PAUSE`]: a signature is checked only after the body is read
/// and hashed, so forged requests in a registered hotkey's name (its address is public) would
/// otherwise cost that and one verification each without limit. An honest client sends none.
/// Keyed by the pair, not the address alone: a forger would otherwise shut out every honest
/// client that shares its address (a NAT, a proxy), and here it shuts out only the hotkey it
/// impersonates, and only from its own address. A trusted proxy's own address is never refused.
/// An IPv6 address counts by its /64, which a neighbour on a shared /64 may be in too: the exact
/// addresses that recently sent that hotkey's valid signatures ([`MAX_PROVEN_ADDRESSES`] per
/// hotkey) stay exempt, until a bad signature in its name comes from one of them.
const FORGERIES_PER_S: u32 = 5;
const FORGERIES_BURST: u32 = 20;
/// How long an address over that quota is refused (`rate_limited`), before its body is read.
pub const FORGER_PAUSE: Duration = Duration::from_secs(10);
/// Most addresses refused at once.
const MAX_FORGERS: usize = 4096;
/// Exact addresses remembered per hotkey as having sent its valid signatures, the latest first.
const MAX_PROVEN_ADDRESSES: usize = 4;
/// Most hotkeys whose addresses are remembered (the map is emptied when full); only hotkeys that
/// signed validly are, so members of the subnet.
const MAX_PROVEN_KEYS: usize = 4096;

/// The slowest body a signed request may send, beyond [`Limits::body_timeout`].
pub const MIN_BODY_BYTES_PER_S: u64 = 1 << 20;

impl Default for Limits {
    fn default() -> Self {
        Self {
            per_hotkey_rps: 50,
            per_hotkey_burst: 200,
            per_ip_rps: 50,
            per_ip_burst: 200,
            json_body_bytes: 1 << 20,
            concurrent_uploads: 64,
            concurrent_uploads_per_ip: 16,
            concurrent_uploads_per_hotkey: 4,
            unchecked_bodies_per_ip: 64,
            body_timeout: Duration::from_secs(30),
            upload_slot_wait: Duration::from_secs(10),
            session_ttl: Duration::from_secs(3600),
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
    /// The run's secret for session keys (see [`crate::sessions`]).
    pub session_secret: crate::sessions::SessionSecret,
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
    /// Signed-request uuids seen (in memory, and group-committed to the database).
    pub replay: ReplayCache,
    /// Batched verification of request signatures.
    pub signatures: SignatureVerifier,
    /// The upload slots ([`Limits::concurrent_uploads`]): each whole object held in memory at
    /// once takes one, an upload's body as a re-read of a stored object (see [`object_slot`]).
    pub object_slots: Arc<tokio::sync::Semaphore>,
    /// Signers' keys by their address as sent.
    pub signers: Signers,
    /// Work polls' first look, from memory.
    pub poll_view: crate::poll_view::PollView,
    per_hotkey: KeyedLimiter<[u8; 32]>,
    per_ip: KeyedLimiter<IpAddr>,
    /// Upload slots held per peer address.
    uploads_by_ip: HeldSlots<IpAddr>,
    /// Upload slots held per hotkey.
    uploads_by_hotkey: HeldSlots<[u8; 32]>,
    /// Bodies still arriving before their signature is checked, per peer address.
    unchecked_bodies_by_ip: HeldSlots<IpAddr>,
    /// Reverse proxies whose `X-Forwarded-For` names the client (empty: none).
    pub trusted_proxies: Vec<IpAddr>,
    /// Bad signatures per address and claimed signer: past the quota, that address is refused
    /// in that signer's name for a while.
    forgeries: KeyedLimiter<Forger>,
    /// (Address, claimed signer) pairs refused until the time given, for bad signatures.
    forgers: Mutex<HashMap<Forger, std::time::Instant>>,
    /// Whether `forgers` may hold anyone (the signed routes' fast path skips its lock).
    any_forgers: AtomicBool,
    /// Exact addresses that recently sent each hotkey's valid signatures, exempt from a
    /// lock-out of their /64 in its name.
    proven: RwLock<HashMap<[u8; 32], Vec<IpAddr>>>,
    counters: std::sync::OnceLock<Counters>,
}

/// Counters of the hottest paths, registered once (`metrics::counter!` builds and looks up its
/// key on every call).
pub struct Counters {
    /// Work polls answered from the poll view.
    pub polls_from_view: metrics::Counter,
    /// Work polls that went on to the database.
    pub polls_from_database: metrics::Counter,
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
            replay: ReplayCache::new(
                db.clone(),
                skew,
                replay_retention(skew, &limits, &run.config),
            ),
            signatures: SignatureVerifier::default(),
            object_slots: Arc::new(tokio::sync::Semaphore::new(
                limits.concurrent_uploads.max(1),
            )),
            signers: Signers::default(),
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
            uploads_by_ip: HeldSlots::default(),
            uploads_by_hotkey: HeldSlots::default(),
            unchecked_bodies_by_ip: HeldSlots::default(),
            trusted_proxies: Vec::new(),
            forgeries: RateLimiter::keyed(quota(FORGERIES_PER_S, FORGERIES_BURST)),
            forgers: Mutex::default(),
            any_forgers: AtomicBool::new(false),
            proven: RwLock::default(),
            counters: std::sync::OnceLock::new(),
        }
    }

    /// The run's config.
    pub fn config(&self) -> &RunConfig {
        &self.run.config
    }

    /// The hot paths' counters (registered on first use, so after the recorder is installed).
    pub fn counters(&self) -> &Counters {
        self.counters.get_or_init(|| Counters {
            polls_from_view: metrics::counter!("iota_work_polls_total", "answered_from" => "view"),
            polls_from_database: metrics::counter!(
                "iota_work_polls_total",
                "answered_from" => "database"
            ),
        })
    }

    /// Whether this process is the phase driver.
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::Relaxed)
    }

    /// Keys the rate limiters hold: hotkeys, and peer addresses.
    pub fn limiter_keys(&self) -> (usize, usize) {
        (self.per_hotkey.len(), self.per_ip.len())
    }

    /// Whether requests from `sender`'s address in its signer's name are refused for now, for
    /// the bad signatures sent so.
    fn refuses_forger(&self, sender: Sender) -> bool {
        if !self.any_forgers.load(Ordering::Relaxed) {
            return false;
        }
        let who = sender.forger;
        let locked = {
            let mut forgers = self.forgers.lock().unwrap_or_else(|e| e.into_inner());
            match forgers.get(&who) {
                Some(until) if *until > std::time::Instant::now() => true,
                Some(_) => {
                    forgers.remove(&who);
                    false
                }
                None => false,
            }
        };
        locked && !self.has_proven(sender)
    }

    /// Whether `sender`'s exact address recently sent its signer's valid signatures.
    fn has_proven(&self, sender: Sender) -> bool {
        self.proven
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&sender.forger.1)
            .is_some_and(|addresses| addresses.contains(&sender.address))
    }

    /// Remembers that `sender`'s exact address sent its signer's valid signature.
    fn note_proven(&self, sender: Sender) {
        if self.has_proven(sender) {
            return;
        }
        let mut proven = self.proven.write().unwrap_or_else(|e| e.into_inner());
        if proven.len() >= MAX_PROVEN_KEYS && !proven.contains_key(&sender.forger.1) {
            proven.clear();
        }
        let addresses = proven.entry(sender.forger.1).or_default();
        if !addresses.contains(&sender.address) {
            addresses.insert(0, sender.address);
            addresses.truncate(MAX_PROVEN_ADDRESSES);
        }
    }

    /// Counts a bad signature from `sender`; past the quota, its address is refused in its
    /// signer's name for [`FORGER_PAUSE`]. Its exact address is no longer exempt: someone there
    /// forges in that name (clients behind one NAT).
    fn note_forgery(&self, sender: Sender) {
        if self.has_proven(sender) {
            let mut proven = self.proven.write().unwrap_or_else(|e| e.into_inner());
            if let Some(addresses) = proven.get_mut(&sender.forger.1) {
                addresses.retain(|a| *a != sender.address);
            }
        }
        let who = sender.forger;
        if self.forgeries.check_key(&who).is_ok() {
            return;
        }
        let mut forgers = self.forgers.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded: a flood from many addresses costs at most this much memory (and then each
        // address its own quota again).
        if forgers.len() >= MAX_FORGERS {
            forgers.clear();
        }
        forgers.insert(who, std::time::Instant::now() + FORGER_PAUSE);
        self.any_forgers.store(true, Ordering::Relaxed);
        metrics::counter!("iota_rate_limited_total", "scope" => "forgeries").increment(1);
    }

    /// Forgets rate-limit keys that are back at full quota (bounded memory under churn).
    pub fn shrink_limiters(&self) {
        self.per_hotkey.retain_recent();
        self.per_ip.retain_recent();
        self.forgeries.retain_recent();
        self.forgeries.shrink_to_fit();
        let mut forgers = self.forgers.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        forgers.retain(|_, until| *until > now);
        self.any_forgers
            .store(!forgers.is_empty(), Ordering::Relaxed);
        self.per_hotkey.shrink_to_fit();
        self.per_ip.shrink_to_fit();
    }
}

/// Shared handle.
pub type App = Arc<AppState>;

/// The body's message of every `internal` error; what failed is logged instead.
pub const INTERNAL_MESSAGE: &str = "internal error (the orchestrator's log has the detail)";

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
        // A commit's check reads a whole object: seconds, not a moment.
        let retry_after = match self.0.code {
            ErrorCode::RateLimited => Some("1"),
            ErrorCode::InProgress => Some("5"),
            _ => None,
        };
        if status.is_server_error() && self.0.code != ErrorCode::InProgress {
            tracing::error!(code = self.0.code.as_str(), message = %self.0.message, "request failed");
        }
        let body = if self.0.code == ErrorCode::Internal {
            // The detail (a database's or a library's message) stays in the log: it can name
            // tables, files or endpoints, and tells the client nothing it can act on.
            ApiError::new(ErrorCode::Internal, INTERNAL_MESSAGE)
        } else {
            self.0
        };
        let mut resp = (status, axum::Json(body)).into_response();
        if let Some(secs) = retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static(secs));
        }
        resp
    }
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        // Text PostgreSQL cannot store (U+0000, from a query or path; JSON bodies are checked
        // before): the request's fault, and a retry would fail the same way.
        if let sqlx::Error::Database(db) = &e
            && matches!(db.code().as_deref(), Some("22021" | "22P05"))
        {
            return Self::new(ErrorCode::BadRequest, "text may not contain U+0000");
        }
        Self::new(ErrorCode::Internal, format!("database: {e}"))
    }
}

impl From<StoreError> for AppError {
    fn from(e: StoreError) -> Self {
        match e {
            // Not echoed: a local store names the object by its path on this machine.
            StoreError::NotFound(_) => Self::new(ErrorCode::NotFound, "no such object"),
            StoreError::BadKey(k) => Self::new(ErrorCode::BadRequest, format!("bad key {k:?}")),
            // Not echoed either: it may name the store's files, or its endpoint.
            StoreError::Backend(m) => {
                tracing::error!(error = %m, "the object store failed");
                Self::new(ErrorCode::Internal, "the object store failed")
            }
            e @ StoreError::TooLarge { .. } => Self::new(ErrorCode::InvalidTensor, e.to_string()),
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
            AuthError::UnknownSession(_) => ErrorCode::UnknownSession,
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
    /// Whether the request carried a session's MAC rather than an sr25519 signature.
    pub by_session: bool,
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

/// When a signed route group records request uuids in the shared replay cache (PostgreSQL).
/// Every signed request is first admitted by this process's memory, which refuses a uuid it has
/// seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedReplay {
    /// Before the handler runs.
    Before,
    /// Left to the handler ([`PendingUuid`]), which records it before it changes run state: for
    /// the work poll, whose answer from the poll view changes nothing (see [`crate::replay`]).
    ByHandler,
}

/// How a signed route group checks its callers.
#[derive(Clone, Copy, Debug)]
pub struct SignedRoutes {
    /// Who may call.
    pub gate: Gate,
    /// Largest body.
    pub body_limit: usize,
    /// When the uuid reaches the shared replay cache.
    pub shared_replay: SharedReplay,
    /// Whether the route takes uploads: its signature is always checked before the body is
    /// read. Such a body, and any body over [`MAX_UNCHECKED_BODY`], holds upload slots (see
    /// [`UploadSlots`]) while it is read and handled.
    pub uploads: bool,
}

/// Largest body a signed request may have that is read before its signature is checked (the
/// signature covers the body's hash). A larger one, and any upload, must carry
/// `Iota-Body-Sha256`: the signature is then checked over that hash before the body is read, so
/// a peer that has not proven it holds a registered hotkey makes the server hold at most this.
pub const MAX_UNCHECKED_BODY: usize = 64 * 1024;

/// A request's uuid that the gate left for its handler to record in the shared replay cache
/// ([`SharedReplay::ByHandler`]); `None` when the gate recorded it already.
#[derive(Clone, Copy, Debug)]
pub struct PendingUuid(pub Option<uuid::Uuid>);

impl PendingUuid {
    /// Records the uuid in the shared cache (once per request): from then on every process
    /// refuses it. A uuid that another process recorded first is a replay.
    pub async fn record(&mut self, app: &AppState) -> Result<(), AppError> {
        if let Some(uuid) = self.0.take()
            && !app.replay.record(uuid).await?
        {
            return Err(AuthError::Replayed(uuid).into());
        }
        Ok(())
    }
}

/// Signed-route middleware: buffers the body (bounded), checks the Epistula headers, checks the
/// claimed signer against the metagraph, verifies the signature against method, path, query and
/// body, rate-limits per hotkey, and admits the uuid (this process's memory, then the shared
/// replay cache or the handler's [`PendingUuid`]). Cheap checks run first, so garbage costs
/// neither a signature check nor a database write.
pub async fn signed_gate(
    State((app, routes)): State<(App, SignedRoutes)>,
    req: Request,
    next: Next,
) -> Response {
    match check_signed(&app, routes, req).await {
        Ok((req, slots)) => {
            let response = next.run(req).await;
            drop(slots);
            response
        }
        Err(e) => e.into_response(),
    }
}

async fn check_signed(
    app: &App,
    routes: SignedRoutes,
    req: Request,
) -> Result<(Request, Option<UploadSlots>), AppError> {
    let (mut parts, body) = req.into_parts();
    // The header and membership checks first: a caller that fails them never gets a body
    // buffered (up to the route's limit) on its behalf.
    let declared = check_content_length(&parts, routes.body_limit)?;
    let checked = check_caller(app, &parts)?;
    let body_hash = body_sha256_header(&parts)?;
    let small = declared.is_some_and(|n| n <= MAX_UNCHECKED_BODY as u64);
    let (caller, pending, bytes, slots) = if routes.uploads || (!small && body_hash.is_some()) {
        // The signature over the body's hash first, then (for uploads) a slot, then the body.
        let Some(body_hash) = body_hash else {
            return Err(match routes.uploads {
                true => AppError::new(
                    ErrorCode::BadRequest,
                    format!(
                        "an upload needs the {HEADER_BODY_SHA256} header (the body's sha256, \
                         which the signature covers)"
                    ),
                ),
                false => needs_body_hash(),
            });
        };
        let (caller, pending) = checked
            .with_body_hash(&parts, &body_hash)
            .finish(app, routes)
            .await?;
        // Any body read after its signature holds takes the slots, an upload's or a large JSON
        // one's: otherwise one registered hotkey could have as many large bodies arriving at
        // once as its rate limit lets it start while earlier ones still come. A request with no
        // body (a download's GET) takes none: it would wait for uploads to finish.
        let bodiless = axum::body::HttpBody::size_hint(&body).exact() == Some(0);
        let slots = match routes.uploads || !bodiless {
            true => Some(upload_slots(app, &parts, &caller).await?),
            false => None,
        };
        let bytes = read_body(body, routes.body_limit, app.limits.body_timeout).await?;
        if body_sha256_hex(&bytes) != body_hash.as_bytes() {
            return Err(AppError::new(
                ErrorCode::BadRequest,
                format!("the body's sha256 is not its {HEADER_BODY_SHA256} header"),
            ));
        }
        (caller, pending, bytes, slots)
    } else {
        // A small body is read first and its hash computed, as Epistula has it.
        let limit = routes.body_limit.min(MAX_UNCHECKED_BODY);
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(needs_body_hash());
        }
        let bytes = checked
            .read_unchecked_body(app, body, limit)
            .await
            .map_err(|e| match e.0.code {
                ErrorCode::PayloadTooLarge => needs_body_hash(),
                _ => e,
            })?;
        let (caller, pending) = checked
            .with_body(&parts, &bytes)
            .finish(app, routes)
            .await?;
        (caller, pending, bytes, None)
    };
    parts.extensions.insert(pending);
    parts.extensions.insert(caller);
    Ok((Request::from_parts(parts, Body::from(bytes)), slots))
}

/// A body too large to be read before its signature is checked, without the hash to check it by.
fn needs_body_hash() -> AppError {
    AppError::new(
        ErrorCode::PayloadTooLarge,
        format!(
            "a body over {MAX_UNCHECKED_BODY} bytes needs the {HEADER_BODY_SHA256} header (the \
             body's sha256, which the signature covers)"
        ),
    )
}

/// The request's `Iota-Body-Sha256`, if it has one; a malformed one is refused.
fn body_sha256_header(parts: &axum::http::request::Parts) -> Result<Option<String>, AppError> {
    match parts.headers.get(HEADER_BODY_SHA256) {
        None => Ok(None),
        Some(v) => match v.to_str() {
            Ok(text) if is_sha256_hex(text) => Ok(Some(text.to_owned())),
            _ => Err(AuthError::MalformedHeader {
                header: HEADER_BODY_SHA256,
                reason: "expected 64 lowercase hex digits".into(),
            }
            .into()),
        },
    }
}

/// A signed request's body, at most `limit` bytes, arriving at no slower a pace than
/// [`MIN_BODY_BYTES_PER_S`] after `timeout`: at any time `t` after the headers, at least
/// `(t - timeout) × MIN_BODY_BYTES_PER_S` bytes must be in. So the whole body takes at most
/// `timeout` plus its length at that pace, and a sender that stops (or trickles) is cut off as
/// soon as it falls behind, not only at the end of the time its declared length would allow: an
/// upload slot held by a stalled body was held for all of that.
pub async fn read_body(body: Body, limit: usize, timeout: Duration) -> Result<Bytes, AppError> {
    read_body_then_wait(body, limit, timeout, || Ok(())).await
}

/// [`read_body`], calling `before_waiting` the first time the body is not all in (a frame that
/// is not there yet) and holding what it returns until the body is read; its error refuses the
/// request then. A body that came whole with its request's head never calls it.
async fn read_body_then_wait<G>(
    body: Body,
    limit: usize,
    timeout: Duration,
    before_waiting: impl FnOnce() -> Result<G, AppError>,
) -> Result<Bytes, AppError> {
    use axum::body::HttpBody;
    use futures::FutureExt;
    use http_body_util::BodyExt;
    let start = tokio::time::Instant::now();
    let mut before_waiting = Some(before_waiting);
    let mut _held = None;
    // The declared length (if any), within the limit: room for the whole body at once.
    let declared = body
        .size_hint()
        .exact()
        .map(|n| n.min(limit as u64) as usize);
    let mut body = http_body_util::Limited::new(body, limit);
    let mut gathered = Gathered::default();
    let mut received = 0u64;
    loop {
        let due = start + body_deadline(timeout, received);
        let ready = match before_waiting.is_some() {
            true => body.frame().now_or_never(),
            false => None,
        };
        let next = match ready {
            Some(frame) => Ok(frame),
            None => {
                if let Some(take) = before_waiting.take() {
                    _held = Some(take()?);
                }
                tokio::time::timeout_at(due, body.frame()).await
            }
        };
        match next {
            Ok(None) => return Ok(gathered.into_bytes()),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    received += data.len() as u64;
                    gathered.push(data, declared);
                }
            }
            Ok(Some(Err(e))) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(AppError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("body larger than {limit} bytes"),
                ));
            }
            Ok(Some(Err(e))) => {
                return Err(AppError::new(
                    ErrorCode::BadRequest,
                    format!("the body could not be read: {e}"),
                ));
            }
            Err(_) => {
                return Err(AppError::new(
                    ErrorCode::RequestTimeout,
                    format!(
                        "the body fell behind the slowest pace taken: {received} bytes in {} s \
                         (allowed: {} s, then {MIN_BODY_BYTES_PER_S} bytes a second)",
                        start.elapsed().as_secs(),
                        timeout.as_secs()
                    ),
                ));
            }
        }
    }
}

/// A body's bytes as they arrive. The first frame is kept as it is (most bodies are one frame,
/// and cost no copy); from the second on, frames are copied into one buffer and let go. Frames
/// kept until the end cost a stored frame per chunk and held on to the connection's read
/// buffers: a body sent a byte per chunk held some 40 times its size.
#[derive(Default)]
enum Gathered {
    #[default]
    Empty,
    One(Bytes),
    Many(Vec<u8>),
}

impl Gathered {
    /// Adds `data`; `declared`, the body's declared length, sizes the buffer once.
    fn push(&mut self, data: Bytes, declared: Option<usize>) {
        *self = match std::mem::take(self) {
            Self::Empty => Self::One(data),
            Self::One(first) => {
                let room = declared.unwrap_or(0).max(first.len() + data.len());
                let mut buf = Vec::with_capacity(room);
                buf.extend_from_slice(&first);
                buf.extend_from_slice(&data);
                Self::Many(buf)
            }
            Self::Many(mut buf) => {
                buf.extend_from_slice(&data);
                Self::Many(buf)
            }
        };
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Self::Empty => Bytes::new(),
            Self::One(data) => data,
            Self::Many(mut buf) => {
                // A body of undeclared length grew the buffer by doubling: the handler holds it
                // for its whole run, so not with up to half of it unused.
                if buf.capacity() > buf.len() + buf.len() / 8 {
                    buf.shrink_to_fit();
                }
                Bytes::from(buf)
            }
        }
    }
}

/// How long the shared replay cache keeps a uuid. A request's clock check is passed when its
/// headers arrive, but its uuid is recorded once its body has (up to [`read_body`]'s deadline
/// later): a replay whose headers arrive at the end of the clock window and whose body comes
/// slowly must still find the original's uuid. So the clock window, the longest body
/// deadline of any signed route, and 2 s for clocks of processes and database that differ.
fn replay_retention(skew: SkewWindow, limits: &Limits, run: &RunConfig) -> Duration {
    let longest = limits.json_body_bytes.max(crate::max_upload_bytes(run)) as u64;
    Duration::from_millis(skew.replay_horizon_ms())
        + body_deadline(limits.body_timeout, longest)
        + Duration::from_secs(2)
}

/// How long a body of `bytes` may take: `timeout`, plus its length at [`MIN_BODY_BYTES_PER_S`].
fn body_deadline(timeout: Duration, bytes: u64) -> Duration {
    timeout + Duration::from_secs_f64(bytes as f64 / MIN_BODY_BYTES_PER_S as f64)
}

/// Refuses a request whose declared body is larger than `limit`: the cheapest check of all.
/// Returns the declared length, if any.
pub fn check_content_length(
    parts: &axum::http::request::Parts,
    limit: usize,
) -> Result<Option<u64>, AppError> {
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared
        && len > limit as u64
    {
        return Err(AppError::new(
            ErrorCode::PayloadTooLarge,
            format!("body of {len} bytes, this route takes at most {limit}"),
        ));
    }
    Ok(declared)
}

/// The checks of a signed request that need no waiting and no body: the Epistula headers, and
/// the claimed signer's membership before the body is read and hashed and the signature
/// verified (a request in the name of a hotkey that is not on the subnet costs none of these).
/// [`CheckedCaller::with_body`] and [`Authenticating::finish`] do the rest.
pub fn check_caller<'a>(
    app: &App,
    parts: &'a axum::http::request::Parts,
) -> Result<CheckedCaller<'a>, AppError> {
    let now = now_ms();
    let headers = check_headers(
        |name| parts.headers.get(name).and_then(|v| v.to_str().ok()),
        &app.hotkey,
        now,
        app.skew,
    )?;
    let signer = app.signers.resolve(headers.signed_by)?;
    // A trusted proxy's own address (no client named) is everyone's behind it: never refused.
    let sender = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|peer| client_address(&app.trusted_proxies, peer.ip(), &parts.headers))
        .filter(|ip| !app.trusted_proxies.contains(ip))
        .map(|ip| Sender {
            forger: (address_key(ip), signer.key.to_bytes()),
            address: unmapped(ip),
        });
    if let Some(sender) = sender
        && app.refuses_forger(sender)
    {
        return Err(AppError::new(
            ErrorCode::RateLimited,
            "too many bad signatures from this address in this signer's name: wait",
        ));
    }
    let (uid, permit) = member(app, &signer.key, headers.signed_by)?;
    Ok(CheckedCaller {
        headers,
        signer,
        uid,
        permit,
        now,
        sender,
    })
}

/// A signed request whose headers and signer passed [`check_caller`], before its body is read.
pub struct CheckedCaller<'a> {
    headers: iota_protocol::signing::CheckedHeaders<'a>,
    signer: crate::signatures::Signer,
    uid: u16,
    permit: bool,
    now: u64,
    /// The address the request counts against and its claimed signer, for bad signatures
    /// (`None`: the peer is unknown, or a trusted proxy's own).
    sender: Option<Sender>,
}

impl CheckedCaller<'_> {
    /// The message the signature must cover, with the body's sha256 (64 lowercase hex digits)
    /// in place of the body.
    pub fn with_body_hash(
        self,
        parts: &axum::http::request::Parts,
        body_hash: &str,
    ) -> Authenticating {
        let path_and_query = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        let signed = self.headers.message_for_body_hash(
            self.signer.key.to_bytes(),
            parts.method.as_str(),
            path_and_query,
            body_hash,
        );
        Authenticating {
            signed,
            signer: self.signer,
            uid: self.uid,
            permit: self.permit,
            now: self.now,
            sender: self.sender,
        }
    }

    /// The request's body, read before its signature is checked (so at most `limit`, itself at
    /// most [`MAX_UNCHECKED_BODY`]): while it is not all in, it holds one of its address's
    /// [`Limits::unchecked_bodies_per_ip`], and beyond them it is refused at once (429).
    pub async fn read_unchecked_body(
        &self,
        app: &AppState,
        body: Body,
        limit: usize,
    ) -> Result<Bytes, AppError> {
        let limit = limit.min(MAX_UNCHECKED_BODY);
        let max = app.limits.unchecked_bodies_per_ip;
        let address = self.sender.map(|s| s.forger.0).filter(|_| max > 0);
        read_body_then_wait(body, limit, app.limits.body_timeout, || match address {
            None => Ok(None),
            Some(ip) => match app.unchecked_bodies_by_ip.take(ip, max) {
                Some(slot) => Ok(Some(slot)),
                None => {
                    metrics::counter!("iota_rate_limited_total", "scope" => "unchecked_bodies_per_ip")
                        .increment(1);
                    Err(AppError::new(
                        ErrorCode::RateLimited,
                        format!(
                            "{max} request bodies from this address are still arriving: send \
                             each request whole, or wait"
                        ),
                    ))
                }
            },
        })
        .await
    }

    /// The message the signature must cover, with the body.
    pub fn with_body(self, parts: &axum::http::request::Parts, body: &[u8]) -> Authenticating {
        let body_hash = body_sha256_hex(body);
        self.with_body_hash(parts, std::str::from_utf8(&body_hash).unwrap_or_default())
    }
}

/// A signed request between [`CheckedCaller::with_body`] and [`Authenticating::finish`].
pub struct Authenticating {
    signed: iota_protocol::signing::Authenticated,
    signer: crate::signatures::Signer,
    uid: u16,
    permit: bool,
    now: u64,
    sender: Option<Sender>,
}

impl Authenticating {
    /// Verifies the signature (batched with whatever else is waiting) or the session's MAC
    /// (see [`crate::sessions`]), then the validator
    /// permit, the uuid in this process's memory, the per-hotkey rate limit (after the
    /// signature and that replay check, so that nobody can spend another hotkey's quota, not
    /// even by replaying its requests), and the uuid in the shared cache where the route
    /// records it first.
    pub async fn finish(
        self,
        app: &App,
        routes: SignedRoutes,
    ) -> Result<(Caller, PendingUuid), AppError> {
        let (verified, by_session) = match self.signed.into_verifiable() {
            ToVerify::Signature(signed) => (app.signatures.verify(signed).await, false),
            ToVerify::Session(auth) => {
                let verified =
                    app.run
                        .session_secret
                        .verify(auth, &self.signer.key.to_bytes(), self.now);
                (verified.map_err(VerifyError::Auth), true)
            }
        };
        let verified = match verified {
            Ok(verified) => verified,
            Err(e) => {
                if let (VerifyError::Auth(AuthError::BadSignature), Some(sender)) =
                    (&e, self.sender)
                {
                    app.note_forgery(sender);
                }
                return Err(e.into());
            }
        };
        if routes.gate == Gate::Validator && !self.permit {
            return Err(AppError::new(
                ErrorCode::NotValidator,
                format!("{} has no validator permit", verified.signer_ss58),
            ));
        }
        let uuid = verified.uuid;
        let in_memory = app
            .replay
            .local
            .admit(uuid, verified.timestamp_ms, self.now);
        if in_memory == Local::Replayed {
            return Err(AuthError::Replayed(uuid).into());
        }
        // Only a signature that is no replay of another's proves where its signer is.
        if let Some(sender) = self.sender {
            app.note_proven(sender);
        }
        if app.per_hotkey.check_key(&verified.signer).is_err() {
            metrics::counter!("iota_rate_limited_total", "scope" => "hotkey").increment(1);
            return Err(AppError::new(
                ErrorCode::RateLimited,
                "too many requests from this hotkey",
            ));
        }
        let mut pending = PendingUuid(Some(uuid));
        if in_memory == Local::Forgotten && routes.shared_replay == SharedReplay::ByHandler {
            // The original of a replay of such a route may be in this memory only (a work poll
            // answered from the poll view), and memory has forgotten it: too old to tell.
            let age_ms = now_ms().saturating_sub(verified.timestamp_ms);
            return Err(AuthError::Stale {
                timestamp_ms: verified.timestamp_ms,
                age_ms,
                max_ms: app.skew.max_age_ms,
            }
            .into());
        }
        // With memory full or forgetful, only the shared cache can tell: record now whatever the
        // route (the others' originals were recorded there, and kept past their body deadline).
        if routes.shared_replay == SharedReplay::Before || in_memory != Local::Fresh {
            pending.record(app).await?;
        }
        let caller = Caller {
            key: self.signer.key,
            ss58: self.signer.ss58.as_ref().to_owned(),
            uid: self.uid,
            permit: self.permit,
            by_session,
        };
        Ok((caller, pending))
    }
}

/// The uid and validator permit of `key` among the subnet's latest members, or `not_registered`.
fn member(app: &App, key: &PublicKey, ss58: &str) -> Result<(u16, bool), AppError> {
    let index = app.metagraph.borrow();
    let member = index.member(key).ok_or_else(|| {
        AppError::new(
            ErrorCode::NotRegistered,
            format!(
                "{ss58} is not registered on subnet {} (metagraph at block {})",
                app.run.netuid,
                index.block()
            ),
        )
    })?;
    Ok((member.uid, member.validator_permit))
}

/// The address a per-IP limit counts a peer under: an IPv4 address as itself (also when it
/// arrives IPv4-mapped on an IPv6 socket), an IPv6 address by its /64 network, since one host
/// is commonly given a whole /64 and could otherwise take a new address for every request.
pub fn address_key(ip: IpAddr) -> IpAddr {
    match unmapped(ip) {
        IpAddr::V6(v6) => {
            let network = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(network.into())
        }
        v4 => v4,
    }
}

/// The address a request counts against in the per-IP limits: its peer's, or, when the peer is
/// one of the trusted proxies, the last address in `X-Forwarded-For` that is not one (each proxy
/// appends the address it heard from). A malformed entry counts the request against the proxy.
pub fn client_address(trusted: &[IpAddr], peer: IpAddr, headers: &axum::http::HeaderMap) -> IpAddr {
    let peer = unmapped(peer);
    if !trusted.contains(&peer) {
        return peer;
    }
    // Read as bytes: a client's own entry with bytes that are not text must not make the
    // whole line unreadable, and with it the entry the proxy appended.
    let hops: Vec<String> = headers
        .get_all("x-forwarded-for")
        .iter()
        .flat_map(|v| {
            String::from_utf8_lossy(v.as_bytes())
                .split(',')
                .map(|hop| hop.trim().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    for hop in hops.iter().rev() {
        match hop.parse::<IpAddr>().map(unmapped) {
            Ok(ip) if trusted.contains(&ip) => {}
            Ok(ip) => return ip,
            Err(_) => return peer,
        }
    }
    peer
}

/// `ip`, an IPv4-mapped IPv6 address as the IPv4 one (how an IPv4 peer reaches a dual-stack
/// listener).
pub fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Public-route middleware: per-IP rate limit.
pub async fn public_gate(
    State(app): State<App>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    let client = client_address(&app.trusted_proxies, peer.ip(), req.headers());
    if app.per_ip.check_key(&address_key(client)).is_err() {
        metrics::counter!("iota_rate_limited_total", "scope" => "ip").increment(1);
        return AppError::new(
            ErrorCode::RateLimited,
            "too many requests from this address",
        )
        .into_response();
    }
    next.run(req).await
}

/// How many upload slots each key (a peer address, a hotkey) holds.
struct HeldSlots<K>(Arc<Mutex<HashMap<K, usize>>>);

impl<K> Default for HeldSlots<K> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<K: std::hash::Hash + Eq + Copy> HeldSlots<K> {
    /// One more slot for `key`, unless it holds `max` already.
    fn take(&self, key: K, max: usize) -> Option<HeldSlot<K>> {
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = held.entry(key).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(HeldSlot {
            counts: self.0.clone(),
            key,
        })
    }
}

/// An upload slot held by a key, given back on drop.
struct HeldSlot<K: std::hash::Hash + Eq> {
    counts: Arc<Mutex<HashMap<K, usize>>>,
    key: K,
}

impl<K: std::hash::Hash + Eq> Drop for HeldSlot<K> {
    fn drop(&mut self) {
        let mut held = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

/// One of the upload slots, for a handler that reads a whole stored object into memory (a
/// commit's check of a presigned upload, a bad-object report), waited for at most
/// [`Limits::upload_slot_wait`]: such reads are bounded as upload bodies are.
pub async fn object_slot(app: &AppState) -> Result<tokio::sync::OwnedSemaphorePermit, AppError> {
    match tokio::time::timeout(
        app.limits.upload_slot_wait,
        app.object_slots.clone().acquire_owned(),
    )
    .await
    {
        Ok(Ok(slot)) => Ok(slot),
        _ => {
            metrics::counter!("iota_rate_limited_total", "scope" => "upload_slots").increment(1);
            Err(AppError::new(
                ErrorCode::RateLimited,
                "every upload slot is busy: try again",
            ))
        }
    }
}

/// The upload slots a request whose body is read after its signature holds (an upload, or any
/// body over [`MAX_UNCHECKED_BODY`]) holds while that body is read and handled: one of its address's
/// ([`Limits::concurrent_uploads_per_ip`]) and one of its hotkey's
/// ([`Limits::concurrent_uploads_per_hotkey`]), beyond either 429 at once, so that neither one
/// host nor one hotkey can queue for every slot; then one of all ([`Limits::concurrent_uploads`],
/// waited for at most [`Limits::upload_slot_wait`]).
pub struct UploadSlots {
    _by_ip: Option<HeldSlot<IpAddr>>,
    _by_hotkey: Option<HeldSlot<[u8; 32]>>,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

async fn upload_slots(
    app: &App,
    parts: &axum::http::request::Parts,
    caller: &Caller,
) -> Result<UploadSlots, AppError> {
    let busy = |scope: &'static str, what: String| {
        metrics::counter!("iota_rate_limited_total", "scope" => scope).increment(1);
        AppError::new(ErrorCode::RateLimited, what)
    };
    let max = app.limits.concurrent_uploads_per_ip;
    let peer = parts.extensions.get::<ConnectInfo<SocketAddr>>();
    let by_ip = match peer {
        Some(ConnectInfo(peer)) if max > 0 => {
            let ip = address_key(client_address(
                &app.trusted_proxies,
                peer.ip(),
                &parts.headers,
            ));
            let slot = app.uploads_by_ip.take(ip, max).ok_or_else(|| {
                busy(
                    "uploads_per_ip",
                    format!("{max} uploads from this address are in progress"),
                )
            })?;
            Some(slot)
        }
        _ => None,
    };
    let max = app.limits.concurrent_uploads_per_hotkey;
    let by_hotkey = match max {
        0 => None,
        _ => Some(
            app.uploads_by_hotkey
                .take(caller.key.to_bytes(), max)
                .ok_or_else(|| {
                    busy(
                        "uploads_per_hotkey",
                        format!("{max} uploads of this hotkey are in progress"),
                    )
                })?,
        ),
    };
    let slot = object_slot(app).await?;
    Ok(UploadSlots {
        _by_ip: by_ip,
        _by_hotkey: by_hotkey,
        _slot: slot,
    })
}

/// Deletes replay-cache entries past the time their recording process said to keep them until
/// (its [`replay_retention`]; run by each run's phase driver, and runs on one database
/// share the table). By the database's clock, which stamped them: the driver's may differ.
pub async fn prune_replay_cache(db: &PgPool) -> Result<u64, sqlx::Error> {
    let r = sqlx::query("DELETE FROM request_uuids WHERE expires_at < now()")
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
        if !json_content_type(req.headers()) {
            return Err(not_json());
        }
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| AppError::new(ErrorCode::BadRequest, e.body_text()))?;
        parse_json(&bytes).map(Self)
    }
}

fn not_json() -> AppError {
    AppError::new(
        ErrorCode::BadRequest,
        "Expected request with `Content-Type: application/json`",
    )
}

/// A JSON body as [`ApiJson`] reads it, from a request's headers and its buffered body.
pub fn json_body<T: serde::de::DeserializeOwned>(
    headers: &axum::http::HeaderMap,
    body: &[u8],
) -> Result<T, AppError> {
    if !json_content_type(headers) {
        return Err(not_json());
    }
    parse_json(body)
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, AppError> {
    if has_nul_escape(body) {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            "JSON strings may not contain U+0000",
        ));
    }
    // serde_json alone first: axum's parse records the path of every key as it goes (an
    // allocation per key), which only an error message needs.
    if let Ok(value) = serde_json::from_slice(body) {
        return Ok(value);
    }
    let axum::Json(value) = axum::Json::<T>::from_bytes(body)?;
    Ok(value)
}

/// Whether the request says its body is JSON (`application/json` or `application/…+json`), as
/// `axum::Json` requires.
fn json_content_type(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json")
            || subtype
                .rsplit_once('+')
                .is_some_and(|(_, suffix)| suffix.eq_ignore_ascii_case("json")))
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
    use super::*;

    async fn body_of(e: AppError) -> (StatusCode, ApiError) {
        let resp = e.into_response();
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .expect("body");
        (status, serde_json::from_slice(&bytes).expect("an ApiError"))
    }

    /// A database's message never reaches the client in a 500; a 4xx keeps its message, since
    /// it tells the client what to fix.
    #[tokio::test]
    async fn an_internal_error_sends_a_generic_body() {
        let leak = "relation \"secret_table\" does not exist";
        let (status, body) = body_of(sqlx::Error::Protocol(leak.into()).into()).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body.code, ErrorCode::Internal);
        assert_eq!(body.message, INTERNAL_MESSAGE);
        let (status, body) = body_of(AppError::new(
            ErrorCode::BadRequest,
            "epoch must be a number",
        ))
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body.message, "epoch must be a number");
    }

    /// A chunk whose release is counted.
    struct Chunk(Vec<u8>, Arc<std::sync::atomic::AtomicUsize>);

    impl AsRef<[u8]> for Chunk {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }

    impl Drop for Chunk {
        fn drop(&mut self) {
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A body sent in many small chunks holds its bytes, not every chunk until it ends (each
    /// chunk a stored frame pointing into the connection's read buffers).
    #[tokio::test]
    async fn a_body_read_in_small_chunks_lets_each_chunk_go() {
        let released = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        let chunks = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|chunk| (chunk, rx))
        });
        let reading = tokio::spawn(read_body(
            Body::from_stream(chunks),
            1 << 20,
            Duration::from_secs(10),
        ));
        for i in 0..100u8 {
            let chunk = Bytes::from_owner(Chunk(vec![i], released.clone()));
            tx.send(Ok(chunk)).await.expect("the reader is there");
        }
        // With a channel of one, at least 98 chunks have been read by now.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while released.load(Ordering::SeqCst) < 98 {
            assert!(
                std::time::Instant::now() < deadline,
                "chunks still held while the body is read: {} of 100 let go",
                released.load(Ordering::SeqCst)
            );
            tokio::task::yield_now().await;
        }
        drop(tx);
        let body = reading.await.expect("join").expect("read");
        assert_eq!(body, (0..100u8).collect::<Vec<_>>());
        // One chunk alone is the body itself, not a copy.
        let one = Bytes::from(vec![7u8; 64]);
        let read = read_body(Body::from(one.clone()), 1 << 20, Duration::from_secs(1))
            .await
            .expect("read");
        assert_eq!(read.as_ptr(), one.as_ptr());
    }

    #[test]
    fn limits_count_a_host_once() {
        let key = |s: &str| address_key(s.parse().expect("address"));
        // An IPv4 address is its own key: no mask.
        let v4: IpAddr = "203.0.113.7".parse().expect("address");
        assert_eq!(key("203.0.113.7"), v4);
        assert_ne!(key("203.0.113.7"), key("203.0.113.8"));
        // IPv4 arriving on an IPv6 socket is the same host.
        assert_eq!(key("::ffff:203.0.113.7"), key("203.0.113.7"));
        // Addresses of one /64 are one host; the next /64 is another.
        assert_eq!(
            key("2001:db8:1:2::1"),
            key("2001:db8:1:2:ffff:ffff:ffff:ffff")
        );
        assert_eq!(key("2001:db8:1:2:abcd::9"), key("2001:db8:1:2::"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db9:1:2::1"));
    }

    #[test]
    fn a_trusted_proxy_names_its_client_and_nobody_else_does() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("address");
        let trusted = [ip("10.0.0.5"), ip("10.0.0.6")];
        let with = |values: &[&[u8]]| {
            let mut h = axum::http::HeaderMap::new();
            for v in values {
                h.append(
                    "x-forwarded-for",
                    HeaderValue::from_bytes(v).expect("header"),
                );
            }
            h
        };
        let client =
            |peer: &str, values: &[&[u8]]| client_address(&trusted, ip(peer), &with(values));
        // From a proxy: the last entry that is not a proxy, across lines.
        assert_eq!(
            client("10.0.0.5", &[b"198.51.100.1, 203.0.113.7"]),
            ip("203.0.113.7")
        );
        assert_eq!(
            client("10.0.0.5", &[b"203.0.113.7", b"10.0.0.6"]),
            ip("203.0.113.7")
        );
        // An IPv4 proxy on a dual-stack listener arrives IPv4-mapped.
        assert_eq!(
            client("::ffff:10.0.0.5", &[b"203.0.113.7"]),
            ip("203.0.113.7")
        );
        // A client's own entry that is not text does not hide the one the proxy appended.
        assert_eq!(
            client("10.0.0.5", &[b"\xff, 203.0.113.7"]),
            ip("203.0.113.7")
        );
        // Nothing readable on the right: the proxy itself.
        assert_eq!(
            client("10.0.0.5", &[b"203.0.113.7, nonsense"]),
            ip("10.0.0.5")
        );
        assert_eq!(client("10.0.0.5", &[]), ip("10.0.0.5"));
        // From anyone else the header counts for nothing.
        assert_eq!(client("203.0.113.9", &[b"198.51.100.1"]), ip("203.0.113.9"));
    }

    #[test]
    fn json_content_types_are_recognised() {
        let with = |v: &'static str| {
            let mut h = axum::http::HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(v));
            json_content_type(&h)
        };
        for yes in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/problem+json",
        ] {
            assert!(with(yes), "{yes} refused");
        }
        for no in [
            "text/plain",
            "application/jsonx",
            "json",
            "application/",
            "text/json",
        ] {
            assert!(!with(no), "{no} accepted");
        }
        assert!(!json_content_type(&axum::http::HeaderMap::new()));
    }

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
