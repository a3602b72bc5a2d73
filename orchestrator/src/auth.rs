//! The request-signing gate: Epistula signatures, sessions, the replay cache, rate limits and
//! upload slots, and who the caller is once every check passed.

use std::net::{IpAddr, SocketAddr};

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use iota_chain::wallet::PublicKey;
use iota_protocol::signing::{
    HEADER_BODY_SHA256, ToVerify, body_sha256_hex, check_headers, is_sha256_hex,
};
use iota_protocol::{AuthError, ErrorCode};
use sqlx::PgPool;

use crate::replay::Local;
use crate::signatures::VerifyError;

use crate::app::*;
use crate::body::{read_body, read_body_then_wait, verified_body};
use crate::error::*;

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
    /// read, and the body reaches the handler as it arrives ([`crate::body::verified_body`]).
    /// Such a body, and any body over [`MAX_UNCHECKED_BODY`], holds upload slots (see
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
        Ok((req, slots, reading)) => {
            let response = next.run(req).await;
            // The rest of an upload's body the handler left unread, read before the answer
            // (see `verified_body`), with the upload's slots still held.
            if let Some(reading) = reading {
                let _ = reading.await;
            }
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
) -> Result<
    (
        Request,
        Option<UploadSlots>,
        Option<tokio::task::JoinHandle<()>>,
    ),
    AppError,
> {
    let (mut parts, body) = req.into_parts();
    // The header and membership checks first: a caller that fails them never gets a body
    // buffered (up to the route's limit) on its behalf.
    let declared = check_content_length(&parts, routes.body_limit)?;
    let checked = check_caller(app, &parts)?;
    let body_hash = body_sha256_header(&parts)?;
    let small = declared.is_some_and(|n| n <= MAX_UNCHECKED_BODY as u64);
    let mut reading = None;
    let (caller, pending, body, slots) = if routes.uploads || (!small && body_hash.is_some()) {
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
        let body = match routes.uploads {
            // Streamed on to the handler, which stores it as it comes (its slots held until the
            // handler answers): an upload is as large as a stage's partition.
            true => {
                let (body, read) =
                    verified_body(body, routes.body_limit, app.limits.body_timeout, body_hash);
                reading = Some(read);
                body
            }
            false => {
                let bytes = read_body(body, routes.body_limit, app.limits.body_timeout).await?;
                if body_sha256_hex(&bytes) != body_hash.as_bytes() {
                    return Err(AppError::new(
                        ErrorCode::BadRequest,
                        format!("the body's sha256 is not its {HEADER_BODY_SHA256} header"),
                    ));
                }
                Body::from(bytes)
            }
        };
        (caller, pending, body, slots)
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
        (caller, pending, Body::from(bytes), None)
    };
    parts.extensions.insert(pending);
    parts.extensions.insert(caller);
    Ok((Request::from_parts(parts, body), slots, reading))
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
    /// (see [`crate::http::sessions`]), then the validator
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
    crate::db::requests::prune(db).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

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
}
