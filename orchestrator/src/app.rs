//! Shared state of the handlers: the run, the database and store, limits and their counters.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use governor::clock::DefaultClock;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};
use iota_chain::MetagraphIndex;
use iota_protocol::api::RunConfig;
use iota_protocol::signing::SkewWindow;
use sqlx::PgPool;
use tokio::sync::watch;

use crate::clock::{Clock, SystemClock};
use crate::replay::ReplayCache;
use crate::signatures::{SignatureVerifier, Signers};
use crate::store::BlobStore;

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
    /// Uploads arriving at once. A pseudo-gradient or a merge streams into the store through a
    /// part's worth of memory; a hop's output is read whole (at most its slot's size).
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
    /// keep the pace of [`MIN_BODY_BYTES_PER_S`] (see [`crate::body::read_body`]): a client that stops
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
pub(crate) type Forger = (IpAddr, [u8; 32]);

/// Where a signed request came from, for the bad-signature lock-out: the pair it counts against,
/// and the client's own address, which may be exempt from that pair's lock-out.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sender {
    pub(crate) forger: Forger,
    pub(crate) address: IpAddr,
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
    /// The run's secret for session keys (see [`crate::http::sessions`]).
    pub session_secret: crate::session_secret::SessionSecret,
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
    /// The upload slots ([`Limits::concurrent_uploads`]): each upload arriving takes one, and
    /// so does each check of a stored object (see [`object_slot`]).
    pub object_slots: Arc<tokio::sync::Semaphore>,
    /// Signers' keys by their address as sent.
    pub signers: Signers,
    /// Work polls' first look, from memory.
    pub poll_view: crate::poll_view::PollView,
    /// The run's clock (see [`crate::clock`]): handlers and the driver read time only here.
    clock: Arc<dyn Clock>,
    pub(crate) per_hotkey: KeyedLimiter<[u8; 32]>,
    pub(crate) per_ip: KeyedLimiter<IpAddr>,
    /// Upload slots held per peer address.
    pub(crate) uploads_by_ip: HeldSlots<IpAddr>,
    /// Upload slots held per hotkey.
    pub(crate) uploads_by_hotkey: HeldSlots<[u8; 32]>,
    /// Bodies still arriving before their signature is checked, per peer address.
    pub(crate) unchecked_bodies_by_ip: HeldSlots<IpAddr>,
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
            poll_view: crate::poll_view::PollView::new(db.clone(), run.id, Arc::new(SystemClock)),
            clock: Arc::new(SystemClock),
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

    /// The same state on another clock (the handlers', the driver's and the poll view's).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.poll_view =
            crate::poll_view::PollView::new(self.db.clone(), self.run.id, clock.clone());
        self.clock = clock;
        self
    }

    /// Now, by the run's clock.
    pub fn now(&self) -> DateTime<Utc> {
        self.clock.now()
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
    pub(crate) fn refuses_forger(&self, sender: Sender) -> bool {
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
    pub(crate) fn has_proven(&self, sender: Sender) -> bool {
        self.proven
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&sender.forger.1)
            .is_some_and(|addresses| addresses.contains(&sender.address))
    }

    /// Remembers that `sender`'s exact address sent its signer's valid signature.
    pub(crate) fn note_proven(&self, sender: Sender) {
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
    pub(crate) fn note_forgery(&self, sender: Sender) {
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

/// How long the shared replay cache keeps a uuid. A request's clock check is passed when its
/// headers arrive, but its uuid is recorded once its body has (up to [`crate::body::read_body`]'s deadline
/// later): a replay whose headers arrive at the end of the clock window and whose body comes
/// slowly must still find the original's uuid. So the clock window, the longest body
/// deadline of any signed route, and 2 s for clocks of processes and database that differ.
fn replay_retention(skew: SkewWindow, limits: &Limits, run: &RunConfig) -> Duration {
    let longest = limits.json_body_bytes.max(max_upload_bytes(run)) as u64;
    Duration::from_millis(skew.replay_horizon_ms())
        + body_deadline(limits.body_timeout, longest)
        + Duration::from_secs(2)
}

/// How long a body of `bytes` may take: `timeout`, plus its length at [`MIN_BODY_BYTES_PER_S`].
pub(crate) fn body_deadline(timeout: Duration, bytes: u64) -> Duration {
    timeout + Duration::from_secs_f64(bytes as f64 / MIN_BODY_BYTES_PER_S as f64)
}

/// How many upload slots each key (a peer address, a hotkey) holds.
pub(crate) struct HeldSlots<K>(Arc<Mutex<HashMap<K, usize>>>);

impl<K> Default for HeldSlots<K> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<K: std::hash::Hash + Eq + Copy> HeldSlots<K> {
    /// One more slot for `key`, unless it holds `max` already.
    pub(crate) fn take(&self, key: K, max: usize) -> Option<HeldSlot<K>> {
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
pub(crate) struct HeldSlot<K: std::hash::Hash + Eq> {
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

/// Largest body a signed upload route accepts: the biggest tensor slot of this run.
pub fn max_upload_bytes(cfg: &RunConfig) -> usize {
    cfg.max_object_bytes().min(usize::MAX as u64) as usize
}
