//! The replay caches of signed-request uuids: one in this process's memory, one in PostgreSQL.
//!
//! * [`SeenUuids`] (memory): every uuid this process admitted, kept until its timestamp leaves
//!   the clock window. A replay to the same process is refused here, with no database work.
//! * The shared cache (`request_uuids`, group-committed): every orchestrator process on the
//!   database refuses a uuid recorded there, before and after restarts. A request is recorded
//!   before it may change run state. One `INSERT` per request was the largest share of a work
//!   poll's cost, so requests that arrive together are recorded with one statement
//!   ([`crate::batch`]), and each is told whether its uuid was new. A request proceeds only after
//!   the statement that inserted its uuid has committed, and the table's primary key decides
//!   between processes.
//!
//! Every signed route records in both, except the work poll: most polls find nothing to do and
//! are answered from the poll view, which changes nothing but the caller's last-seen mark and
//! returns the epoch status that `GET /v1/status` gives anyone. Such a poll replayed to another
//! process (or after a restart) within the clock window can do no more than the signer's own poll
//! did, so its uuid stays in memory; a poll that goes on to the database records its uuid in the
//! shared cache before its statement runs (see `miner::work::work`).

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;

use iota_protocol::signing::SkewWindow;
use sqlx::PgPool;
use uuid::Uuid;

use crate::batch::{Batcher, Flush};

/// Most uuids in one statement.
const MAX_BATCH: usize = 1024;
/// Statements in flight at once. Two, not more: with four, batches under load averaged 19
/// uuids and PostgreSQL spent its time on statements; fewer statements carry more each.
const MAX_FLUSHES: usize = 2;
/// Most uuids held in memory. Beyond it every request is recorded in the shared cache (as
/// correct, only slower); the rate limits keep a subnet's traffic far below it.
const MAX_LOCAL: usize = 2_000_000;
/// Why a uuid could not be recorded (the request must not proceed).
#[derive(Clone, Debug, thiserror::Error)]
pub enum ReplayError {
    /// The insert failed.
    #[error("replay cache: {0}")]
    Database(String),
    /// The writer task is gone (the server is shutting down).
    #[error("replay cache writer stopped")]
    Stopped,
}

struct Insert {
    db: PgPool,
    /// How long each recorded uuid is kept (see `app::replay_retention`).
    keep_ms: i64,
}

impl Flush for Insert {
    type Item = Uuid;
    type Output = Result<bool, ReplayError>;

    async fn flush(&self, batch: Vec<Uuid>) -> Vec<Self::Output> {
        metrics::histogram!("iota_replay_batch_size").record(batch.len() as f64);
        // Sorted and unique: concurrent statements then take the key locks in one order (no
        // deadlock when a replayed uuid lands in two batches at once), and a uuid sent twice in
        // one batch is inserted once.
        let mut uuids = batch.clone();
        uuids.sort_unstable();
        uuids.dedup();
        let inserted = crate::db::requests::record(&self.db, &uuids, self.keep_ms).await;
        match inserted {
            Ok(inserted) => {
                // Each inserted uuid admits exactly one request: the first that carried it.
                let mut fresh: HashSet<Uuid> = inserted.into_iter().collect();
                batch.iter().map(|u| Ok(fresh.remove(u))).collect()
            }
            Err(e) => {
                tracing::error!(error = %e, uuids = uuids.len(), "replay cache insert failed");
                let e = ReplayError::Database(e.to_string());
                batch.iter().map(|_| Err(e.clone())).collect()
            }
        }
    }
}

/// What this process's memory says of a uuid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Local {
    /// First seen here (now remembered).
    Fresh,
    /// Admitted here before: a replay.
    Replayed,
    /// Memory is full: only the shared cache can tell.
    Full,
    /// The uuid's second was already forgotten here (other requests, whose headers came later,
    /// found it outside the window while this one's body was on its way): memory cannot tell.
    Forgotten,
}

/// The uuids this process admitted, by their request's timestamp (whole seconds): a replay
/// carries the signed timestamp of the original, so one second's set is all a lookup reads, and
/// a second is forgotten once every timestamp in it is older than the clock window accepts.
pub struct SeenUuids {
    max_age_ms: u64,
    /// Most uuids per shard.
    max_held: usize,
    /// By the uuid's first byte: requests on different threads rarely wait for each other (a
    /// thread preempted while holding the one lock held up every other request).
    shards: [Mutex<Shard>; SHARDS],
}

const SHARDS: usize = 16;

/// Uuids by their timestamp's second, how many, and the first second not yet forgotten.
type Shard = (BTreeMap<u64, HashSet<Uuid>>, usize, u64);

impl SeenUuids {
    /// Remembers uuids as long as `window` accepts their timestamps, at most [`MAX_LOCAL`].
    pub fn new(window: SkewWindow) -> Self {
        Self::with_limit(window, MAX_LOCAL)
    }

    /// [`SeenUuids::new`] holding at most about `max_held` uuids (the limit is per shard, so a
    /// shard can be full a little before all are).
    pub fn with_limit(window: SkewWindow, max_held: usize) -> Self {
        Self {
            max_age_ms: window.max_age_ms,
            max_held: max_held.div_ceil(SHARDS),
            shards: std::array::from_fn(|_| Mutex::default()),
        }
    }

    fn shard(&self, uuid: &Uuid) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[usize::from(uuid.as_bytes()[0]) % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Admits `uuid` of a request stamped `timestamp_ms` (already inside the window at `now_ms`).
    pub fn admit(&self, uuid: Uuid, timestamp_ms: u64, now_ms: u64) -> Local {
        let mut guard = self.shard(&uuid);
        let (seconds, held, remembered_from) = &mut *guard;
        // Seconds whose last millisecond is older than the window: nothing stamped then passes
        // the clock check any more.
        while let Some(entry) = seconds.first_entry() {
            if (entry.key() + 1) * 1000 + self.max_age_ms >= now_ms {
                break;
            }
            *remembered_from = (*remembered_from).max(entry.key() + 1);
            *held -= entry.remove().len();
        }
        // `now_ms` is when this request's headers came; its body may have come long after,
        // when a later request has dropped the second a replay of it would be found in.
        if timestamp_ms / 1000 < *remembered_from {
            return Local::Forgotten;
        }
        let second = seconds.entry(timestamp_ms / 1000).or_default();
        if second.contains(&uuid) {
            return Local::Replayed;
        }
        if *held >= self.max_held {
            return Local::Full;
        }
        second.insert(uuid);
        *held += 1;
        Local::Fresh
    }

    /// How many uuids are held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).1)
            .sum()
    }
}

/// Both replay caches.
pub struct ReplayCache {
    /// This process's memory.
    pub local: SeenUuids,
    batcher: Batcher<Insert>,
}

impl ReplayCache {
    /// A cache over `db`'s `request_uuids` table, whose rows are kept for `keep`, and this
    /// process's memory for `window`.
    pub fn new(db: PgPool, window: SkewWindow, keep: std::time::Duration) -> Self {
        let keep_ms = keep.as_millis().min(i64::MAX as u128) as i64;
        Self {
            local: SeenUuids::new(window),
            batcher: Batcher::new(Insert { db, keep_ms }, MAX_BATCH, MAX_FLUSHES),
        }
    }

    /// Records `uuid` in the shared cache: `Ok(true)` if it was new (committed, so every process
    /// now refuses it), `Ok(false)` if it was seen before (by any process, or earlier in the same
    /// batch).
    pub async fn record(&self, uuid: Uuid) -> Result<bool, ReplayError> {
        self.batcher
            .submit(uuid)
            .await
            .map_err(|_| ReplayError::Stopped)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_is_admitted_once_and_forgotten_after_the_window() {
        let window = SkewWindow {
            max_age_ms: 10_000,
            max_future_ms: 5_000,
        };
        let seen = SeenUuids::new(window);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let ts = 1_000_000_500;
        assert_eq!(seen.admit(a, ts, ts), Local::Fresh);
        assert_eq!(seen.admit(a, ts, ts + 1), Local::Replayed);
        // Still refused at the last moment the clock check would let it through.
        assert_eq!(seen.admit(a, ts, ts + window.max_age_ms), Local::Replayed);
        assert_eq!(seen.admit(b, ts + 3_000, ts + 1), Local::Fresh);
        assert_eq!(seen.len(), 2);
        // Once no timestamp of its second can pass the clock check, the second is dropped (by
        // the next admission to its shard).
        let later = (ts / 1000 + 1) * 1000 + window.max_age_ms + 1;
        let mut same_shard = *Uuid::new_v4().as_bytes();
        same_shard[0] = a.as_bytes()[0];
        assert_eq!(
            seen.admit(Uuid::from_bytes(same_shard), later, later),
            Local::Fresh
        );
        assert_eq!(seen.len(), 2, "a's second was not forgotten");
        assert_eq!(seen.admit(b, ts + 3_000, later), Local::Replayed);
        // A replay of a whose headers came in time (its `now` is old) but which is admitted
        // only after the second was dropped: memory cannot say it is fresh.
        assert_eq!(seen.admit(a, ts, ts + 1), Local::Forgotten);
        let mut other = *Uuid::new_v4().as_bytes();
        other[0] = a.as_bytes()[0];
        assert_eq!(
            seen.admit(Uuid::from_bytes(other), ts, ts + 1),
            Local::Forgotten
        );
        // The first second still remembered is not forgotten: a request stamped then is judged.
        let mut first_kept = *Uuid::new_v4().as_bytes();
        first_kept[0] = a.as_bytes()[0];
        let first_kept = Uuid::from_bytes(first_kept);
        let stamp = (ts / 1000 + 1) * 1000;
        assert_eq!(seen.admit(first_kept, stamp, later), Local::Fresh);
        assert_eq!(seen.admit(first_kept, stamp, later), Local::Replayed);
        // Other shards forget on their own admissions.
        let mut elsewhere = *a.as_bytes();
        elsewhere[0] = a.as_bytes()[0].wrapping_add(1);
        assert_eq!(
            seen.admit(Uuid::from_bytes(elsewhere), ts, ts + 1),
            Local::Fresh
        );
    }

    #[test]
    fn a_full_memory_says_so_and_still_refuses_what_it_holds() {
        // Two per shard: three uuids of one shard fill it.
        let seen = SeenUuids::with_limit(SkewWindow::default(), 2 * SHARDS);
        let in_shard = |first: u8| {
            let mut bytes = *Uuid::new_v4().as_bytes();
            bytes[0] = first;
            Uuid::from_bytes(bytes)
        };
        let held = [in_shard(3), in_shard(3 + SHARDS as u8)];
        for u in held {
            assert_eq!(seen.admit(u, 5_000, 5_000), Local::Fresh);
        }
        assert_eq!(seen.admit(in_shard(3), 5_000, 5_000), Local::Full);
        assert_eq!(seen.admit(held[1], 5_000, 5_000), Local::Replayed);
        // Another shard still has room.
        assert_eq!(seen.admit(in_shard(4), 5_000, 5_000), Local::Fresh);
        assert_eq!(seen.len(), 3);
    }
}
