//! The first look of every work poll, answered from memory.
//!
//! Most polls find nothing to do, and reading the database for each was a poll's largest cost
//! after its signature. Each process keeps what that first look needs: every active miner's
//! stage and whether it has an open task (pending or leased), and the epoch status. Triggers
//! (migration `0002_poll_view`) notify every process on the database when one of these changes,
//! and the view reads again what changed.
//!
//! The view only ever shortens a poll to "nothing to do". A miner it does not know, or one with
//! an open task, takes the full poll, which reads the database and decides alone. So a view a
//! few milliseconds behind can delay a miner's next item by one poll, and can never lease
//! anything wrongly. It answers nothing until its listener is connected and a full read has
//! followed, nor after the connection is lost until the same has happened again; and it reads
//! everything again every [`RELOAD_EVERY`], which bounds the damage of a notification that
//! never came.
//!
//! A poll answered here marks its miner seen; the marks are written together every
//! [`TOUCH_EVERY`] (miners are released only after several seconds of silence).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::Duration;

use crate::clock::Clock;
use iota_protocol::api::EpochStatus;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, oneshot};

/// The notification channel of the triggers.
pub const CHANNEL: &str = "iota_poll_view";
/// Everything is read again this often, notified or not.
pub const RELOAD_EVERY: Duration = Duration::from_secs(10);
/// Miners seen by polls answered here are marked in the database this often.
pub const TOUCH_EVERY: Duration = Duration::from_secs(1);
/// Wait after a failed read or a lost listener before trying again.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// Shards of the set of miners seen.
const SEEN_SHARDS: usize = 8;
/// More changed miners than this between two reads are read all at once.
const MAX_DIRTY: usize = 10_000;

/// What a work poll needs to know first.
pub(crate) struct Glance {
    pub stage: u32,
    pub open_tasks: bool,
    pub status: EpochStatus,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct MinerView {
    stage: u32,
    open_tasks: bool,
}

#[derive(Default)]
struct Snapshot {
    ready: bool,
    /// Active miners of the run only.
    miners: HashMap<String, MinerView>,
    status: Option<EpochStatus>,
}

/// What to read again.
#[derive(Default)]
struct Dirty {
    all: bool,
    status: bool,
    miners: HashSet<String>,
}

struct Shared {
    db: PgPool,
    run: i64,
    clock: Arc<dyn Clock>,
    view: RwLock<Snapshot>,
    dirty: Mutex<Dirty>,
    wake: Notify,
    listening: AtomicBool,
    /// Counts the listener's connections: a full read makes the view ready only if no
    /// connection was lost or made while it ran.
    connections: AtomicU64,
    /// Miners seen since the last write, by a hash of the hotkey (so that polls on different
    /// threads rarely wait for each other).
    seen: [Mutex<HashSet<String>>; SEEN_SHARDS],
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn new(db: PgPool, run: i64, clock: Arc<dyn Clock>) -> Self {
        Self {
            db,
            run,
            clock,
            view: RwLock::default(),
            dirty: Mutex::default(),
            wake: Notify::new(),
            listening: AtomicBool::new(false),
            connections: AtomicU64::new(0),
            seen: std::array::from_fn(|_| Mutex::default()),
        }
    }

    fn view(&self) -> std::sync::RwLockReadGuard<'_, Snapshot> {
        self.view.read().unwrap_or_else(|e| e.into_inner())
    }

    fn view_mut(&self) -> std::sync::RwLockWriteGuard<'_, Snapshot> {
        self.view.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read_all_soon(&self) {
        lock(&self.dirty).all = true;
        self.wake.notify_one();
    }

    /// The listener is listening (again): nothing it missed can be trusted.
    fn connected(&self) {
        self.listening.store(true, Ordering::SeqCst);
        self.connections.fetch_add(1, Ordering::SeqCst);
        self.read_all_soon();
    }

    /// Whether a full read begun when the listener had counted `before` connections can be
    /// trusted: the listener listens and has neither lost nor made a connection since (what was
    /// notified meanwhile may be missing from the read).
    fn read_is_current(&self, before: u64) -> bool {
        self.listening.load(Ordering::SeqCst) && self.connections.load(Ordering::SeqCst) == before
    }

    /// The listener lost its connection: notifications may have been missed.
    fn lost(&self) {
        self.listening.store(false, Ordering::SeqCst);
        self.connections.fetch_add(1, Ordering::SeqCst);
        self.view_mut().ready = false;
        self.read_all_soon();
    }

    /// Notes one notification's payload.
    fn note(&self, payload: &str) {
        let mut parts = payload.splitn(3, ' ');
        if parts.next().and_then(|r| r.parse::<i64>().ok()) != Some(self.run) {
            return;
        }
        let mut dirty = lock(&self.dirty);
        match (parts.next(), parts.next()) {
            (Some("m"), Some(hotkey)) if dirty.miners.len() < MAX_DIRTY => {
                dirty.miners.insert(hotkey.to_owned());
            }
            (Some("s"), None) => dirty.status = true,
            _ => {
                dirty.all = true;
                dirty.miners.clear();
            }
        }
        drop(dirty);
        self.wake.notify_one();
    }
}

/// The view of one process; its tasks stop when it is dropped.
pub struct PollView {
    shared: Arc<Shared>,
    stop: OnceLock<oneshot::Sender<()>>,
}

impl PollView {
    /// A view of `run` over `db`; it starts on [`PollView::start`] or on the first glance.
    pub fn new(db: PgPool, run: i64, clock: Arc<dyn Clock>) -> Self {
        Self {
            shared: Arc::new(Shared::new(db, run, clock)),
            stop: OnceLock::new(),
        }
    }

    /// Starts listening and reading (inside a Tokio runtime; once).
    pub fn start(&self) {
        self.stop.get_or_init(|| {
            let (tx, rx) = oneshot::channel();
            tokio::spawn(maintain(self.shared.clone(), rx));
            tx
        });
    }

    /// What the view knows of a poll by `hotkey`, or `None` when the poll must read the database
    /// (the view is not ready, or `hotkey` is not an active miner that it knows).
    pub(crate) fn glance(&self, hotkey: &str) -> Option<Glance> {
        self.start();
        let view = self.shared.view();
        if !view.ready {
            return None;
        }
        let miner = view.miners.get(hotkey)?;
        let mut status = view.status.clone()?;
        status.server_time_ms = self.shared.clock.now().timestamp_millis();
        Some(Glance {
            stage: miner.stage,
            open_tasks: miner.open_tasks,
            status,
        })
    }

    /// Marks `hotkey` (an active miner the view knows) seen, written within [`TOUCH_EVERY`].
    pub(crate) fn seen(&self, hotkey: &str) {
        let shard = hotkey
            .bytes()
            .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b.into()));
        let mut seen = lock(&self.shared.seen[shard % SEEN_SHARDS]);
        if !seen.contains(hotkey) {
            seen.insert(hotkey.to_owned());
        }
    }
}

async fn maintain(shared: Arc<Shared>, mut stop: oneshot::Receiver<()>) {
    let listener = tokio::spawn(listen(shared.clone()));
    let mut reload = tokio::time::interval(RELOAD_EVERY);
    let mut touch = tokio::time::interval(TOUCH_EVERY);
    reload.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    touch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            () = shared.wake.notified() => {}
            _ = reload.tick() => lock(&shared.dirty).all = true,
            _ = touch.tick() => {
                touch_seen(&shared).await;
                continue;
            }
        }
        if let Err(e) = refresh(&shared).await {
            tracing::warn!(error = %e, "poll view: read failed; polls read the database until it works");
            shared.view_mut().ready = false;
            lock(&shared.dirty).all = true;
            tokio::select! {
                _ = &mut stop => break,
                () = tokio::time::sleep(RETRY_AFTER) => shared.wake.notify_one(),
            }
        }
    }
    listener.abort();
    touch_seen(&shared).await;
}

/// Keeps a listener on [`CHANNEL`] and notes what it hears.
async fn listen(shared: Arc<Shared>) {
    while !shared.db.is_closed() {
        match listen_once(&shared).await {
            Ok(()) => {}
            Err(e) => tracing::warn!(error = %e, "poll view: listener failed; reconnecting"),
        }
        if shared.listening.load(Ordering::SeqCst) {
            shared.lost();
        }
        tokio::time::sleep(RETRY_AFTER).await;
    }
}

async fn listen_once(shared: &Shared) -> Result<(), sqlx::Error> {
    let mut listener = PgListener::connect_with(&shared.db).await?;
    listener.listen(CHANNEL).await?;
    shared.connected();
    loop {
        match listener.try_recv().await? {
            Some(notification) => shared.note(notification.payload()),
            // The connection was lost and made again (listening again): what was sent in
            // between is gone.
            None => {
                shared.lost();
                shared.connected();
            }
        }
    }
}

/// Reads what changed, or everything.
async fn refresh(shared: &Shared) -> Result<(), String> {
    let dirty = std::mem::take(&mut *lock(&shared.dirty));
    if dirty.all {
        let connections = shared.connections.load(Ordering::SeqCst);
        let miners = read_miners(shared, None).await?;
        let status = read_status(shared).await?;
        let mut view = shared.view_mut();
        view.miners = miners;
        view.status = Some(status);
        view.ready = shared.read_is_current(connections);
        return Ok(());
    }
    if !dirty.miners.is_empty() {
        let keys: Vec<String> = dirty.miners.into_iter().collect();
        let mut fresh = read_miners(shared, Some(&keys)).await?;
        let mut view = shared.view_mut();
        for key in keys {
            match fresh.remove(&key) {
                Some(miner) => view.miners.insert(key, miner),
                None => view.miners.remove(&key),
            };
        }
    }
    if dirty.status {
        let status = read_status(shared).await?;
        shared.view_mut().status = Some(status);
    }
    Ok(())
}

/// Active miners of the run (only those of `hotkeys` if given).
async fn read_miners(
    shared: &Shared,
    hotkeys: Option<&[String]>,
) -> Result<HashMap<String, MinerView>, String> {
    let rows = crate::db::miners::active_with_open_hops(&shared.db, shared.run, hotkeys)
        .await
        .map_err(|e| e.to_string())?;
    let mut miners = HashMap::with_capacity(rows.len());
    for (hotkey, stage, open_tasks) in rows {
        miners.insert(
            hotkey,
            MinerView {
                stage: stage.max(0) as u32,
                open_tasks,
            },
        );
    }
    Ok(miners)
}

async fn read_status(shared: &Shared) -> Result<EpochStatus, String> {
    crate::db::status::read_epoch_status(&shared.db, shared.run, shared.clock.now())
        .await
        .map_err(|e| e.detail())
}

/// Marks the miners seen by polls answered here (rows another statement holds are skipped:
/// their miners poll again within a second).
async fn touch_seen(shared: &Shared) {
    let hotkeys: Vec<String> = shared
        .seen
        .iter()
        .flat_map(|shard| lock(shard).drain().collect::<Vec<_>>())
        .collect();
    if hotkeys.is_empty() {
        return;
    }
    let touched =
        crate::db::miners::mark_seen(&shared.db, shared.run, &hotkeys, shared.clock.now()).await;
    if let Err(e) = touched {
        tracing::warn!(error = %e, miners = hotkeys.len(), "poll view: could not mark miners seen");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> Shared {
        let db = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .expect("lazy pool");
        Shared::new(db, 7, Arc::new(crate::clock::SystemClock))
    }

    #[tokio::test]
    async fn notifications_mark_what_to_read_again() {
        let s = shared();
        s.note("7 m 5Abc");
        s.note("7 s");
        s.note("8 m 5Other");
        s.note("70 s");
        let dirty = std::mem::take(&mut *lock(&s.dirty));
        assert!(!dirty.all);
        assert!(dirty.status);
        assert_eq!(
            dirty.miners.into_iter().collect::<Vec<_>>(),
            vec!["5Abc".to_string()]
        );
        // Anything it does not understand reads everything.
        s.note("7 x");
        assert!(lock(&s.dirty).all);
    }

    #[tokio::test]
    async fn a_lost_listener_stops_the_answers_until_a_full_read() {
        let s = shared();
        s.connected();
        s.view_mut().ready = true;
        s.lost();
        assert!(!s.view().ready);
        assert!(!s.listening.load(Ordering::SeqCst));
        assert!(lock(&s.dirty).all);
    }

    #[tokio::test]
    async fn a_full_read_is_trusted_only_if_the_listener_stayed_connected() {
        let s = shared();
        let before = s.connections.load(Ordering::SeqCst);
        assert!(!s.read_is_current(before), "trusted before listening");
        s.connected();
        let before = s.connections.load(Ordering::SeqCst);
        assert!(s.read_is_current(before));
        // Lost during the read, then connected again: neither state can trust it.
        s.lost();
        assert!(!s.read_is_current(before), "trusted while not listening");
        s.connected();
        assert!(!s.read_is_current(before), "trusted across a reconnection");
    }

    #[tokio::test]
    async fn too_many_changed_miners_read_everything() {
        let s = shared();
        for i in 0..=MAX_DIRTY {
            s.note(&format!("7 m key{i}"));
        }
        let dirty = lock(&s.dirty);
        assert!(dirty.all);
        assert!(dirty.miners.len() <= MAX_DIRTY);
    }
}
