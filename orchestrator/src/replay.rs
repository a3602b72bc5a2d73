//! The replay cache of signed-request uuids, group-committed.
//!
//! Every signed request's uuid must be recorded in PostgreSQL (`request_uuids`, shared by every
//! orchestrator process on the database) before the request acts, and a uuid seen before must be
//! refused. One `INSERT` per request was the largest share of a work poll's cost, so requests
//! that arrive together are recorded with one statement ([`crate::batch`]), and each is told
//! whether its uuid was new.
//!
//! The guarantees are the single insert's: a request proceeds only after the statement that
//! inserted its uuid has committed, and the table's primary key decides between processes.

use std::collections::HashSet;

use sqlx::PgPool;
use uuid::Uuid;

use crate::batch::{Batcher, Flush};

/// Most uuids in one statement.
const MAX_BATCH: usize = 1024;
/// Statements in flight at once. Two, not more: with four, batches under load averaged 19
/// uuids and PostgreSQL spent its time on statements; fewer statements carry more each.
const MAX_FLUSHES: usize = 2;

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
        let inserted: Result<Vec<Uuid>, sqlx::Error> = sqlx::query_scalar(
            "INSERT INTO request_uuids (uuid, seen_at)
             SELECT u, now() FROM unnest($1::uuid[]) AS u ORDER BY u
             ON CONFLICT DO NOTHING RETURNING uuid",
        )
        .bind(&uuids)
        .fetch_all(&self.db)
        .await;
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

/// The shared replay cache; [`ReplayCache::record`] is all a request needs.
pub struct ReplayCache {
    batcher: Batcher<Insert>,
}

impl ReplayCache {
    /// A cache over `db`'s `request_uuids` table.
    pub fn new(db: PgPool) -> Self {
        Self {
            batcher: Batcher::new(Insert { db }, MAX_BATCH, MAX_FLUSHES),
        }
    }

    /// Records `uuid`: `Ok(true)` if it was new (committed, so every process now refuses it),
    /// `Ok(false)` if it was seen before (by any process, or earlier in the same batch).
    pub async fn record(&self, uuid: Uuid) -> Result<bool, ReplayError> {
        self.batcher
            .submit(uuid)
            .await
            .map_err(|_| ReplayError::Stopped)?
    }
}
