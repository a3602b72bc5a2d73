//! Each epoch's row: its counters and whether its objects were collected.

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::Db;

/// Counts one more abandoned sample in `epoch`.
pub async fn count_abandoned<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE epochs SET samples_abandoned = samples_abandoned + 1
         WHERE run_id = $1 AND epoch = $2",
    )
    .bind(run)
    .bind(epoch)
    .execute(db)
    .await?;
    Ok(())
}

/// Epochs before `before` whose objects are not collected yet and that ended by `ended_by`,
/// oldest first.
pub async fn uncollected<'e>(
    db: impl Db<'e>,
    run: i64,
    before: i64,
    ended_by: DateTime<Utc>,
) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar(
        "SELECT epoch FROM epochs WHERE run_id = $1 AND epoch < $2 AND NOT gc_done
           AND (ended_at IS NULL OR ended_at <= $3)
         ORDER BY epoch",
    )
    .bind(run)
    .bind(before)
    .bind(ended_by)
    .fetch_all(db)
    .await
}

/// Marks `epoch`'s objects collected.
pub async fn mark_collected<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<()> {
    sqlx::query("UPDATE epochs SET gc_done = true WHERE run_id = $1 AND epoch = $2")
        .bind(run)
        .bind(epoch)
        .execute(db)
        .await?;
    Ok(())
}

/// What the phase rule counts in `epoch` (see [`crate::domain::phases::PhaseView`]).
pub struct PhaseCounts {
    /// Samples started.
    pub samples_started: i64,
    /// Samples still travelling.
    pub in_flight: i64,
    /// Active miners that did gradient work (and did not restart after it).
    pub workers: i64,
    /// Their pseudo-gradient partitions received.
    pub received: i64,
    /// Partitions not settled.
    pub open_partitions: i64,
    /// Upload reservations of active miners not yet complete.
    pub reserved: i64,
}

/// The phase rule's counts in `epoch`, with the last stage `last_stage` (whose forwards are
/// gradient work) and `partitions` uploads a complete worker makes.
pub async fn phase_counts<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    last_stage: i32,
    partitions: i64,
) -> sqlx::Result<PhaseCounts> {
    let row = sqlx::query(
        "WITH workers AS (
            SELECT DISTINCT t.miner FROM tasks t JOIN miners m
              ON m.run_id = t.run_id AND m.hotkey = t.miner AND m.status = 'active'
            WHERE t.run_id = $1 AND t.epoch = $2 AND t.status = 'done'
              AND (t.direction = 'backward' OR t.stage = $3)
              -- Not a miner that restarted after working: it will upload nothing.
              AND (m.ended_epoch IS DISTINCT FROM $2
                   OR EXISTS (SELECT 1 FROM pseudo_gradients g WHERE g.run_id = $1
                              AND g.epoch = $2 AND g.miner = m.hotkey)))
         SELECT e.samples_started,
            (SELECT count(*) FROM samples s WHERE s.run_id = $1 AND s.epoch = $2
               AND s.status IN ('forward', 'backward')) AS in_flight,
            (SELECT count(*) FROM workers) AS workers,
            -- The workers' uploads only: one whose gradient work was failed afterwards (a bad
            -- object it produced) is no longer expected, and its uploads must not stand in for
            -- a worker's that has not arrived.
            (SELECT count(*) FROM pseudo_gradients g
             WHERE g.run_id = $1 AND g.epoch = $2
               AND g.miner IN (SELECT miner FROM workers)) AS received,
            (SELECT count(*) FROM partitions p WHERE p.run_id = $1 AND p.epoch = $2
               AND p.state IN ('open', 'disputed')) AS open_partitions,
            -- Reserved uploads not yet complete, of miners still active.
            (SELECT count(*) FROM upload_reservations r JOIN miners m
               ON m.run_id = r.run_id AND m.hotkey = r.miner AND m.status = 'active'
             WHERE r.run_id = $1 AND r.epoch = $2
               AND (SELECT count(*) FROM pseudo_gradients g WHERE g.run_id = $1
                      AND g.epoch = $2 AND g.miner = r.miner) < $4
               -- Not a miner that restarted after working: its uploads are refused.
               AND (m.ended_epoch IS DISTINCT FROM $2
                    OR EXISTS (SELECT 1 FROM pseudo_gradients g WHERE g.run_id = $1
                               AND g.epoch = $2 AND g.miner = m.hotkey))) AS reserved
         FROM epochs e WHERE e.run_id = $1 AND e.epoch = $2",
    )
    .bind(run)
    .bind(epoch)
    .bind(last_stage)
    .bind(partitions)
    .fetch_one(db)
    .await?;
    Ok(PhaseCounts {
        samples_started: row.try_get("samples_started")?,
        in_flight: row.try_get("in_flight")?,
        workers: row.try_get("workers")?,
        received: row.try_get("received")?,
        open_partitions: row.try_get("open_partitions")?,
        reserved: row.try_get("reserved")?,
    })
}

/// Records when `epoch`'s training phase ended.
pub async fn set_training_ended<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    at: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query("UPDATE epochs SET training_ended_at = $3 WHERE run_id = $1 AND epoch = $2")
        .bind(run)
        .bind(epoch)
        .bind(at)
        .execute(db)
        .await?;
    Ok(())
}

/// Records when `epoch`'s uploading phase ended.
pub async fn set_uploading_ended<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    at: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query("UPDATE epochs SET uploading_ended_at = $3 WHERE run_id = $1 AND epoch = $2")
        .bind(run)
        .bind(epoch)
        .bind(at)
        .execute(db)
        .await?;
    Ok(())
}

/// Ends `epoch` at `at`, storing its samples' mean loss once (they are final now).
pub async fn end<'e>(db: impl Db<'e>, run: i64, epoch: i64, at: DateTime<Utc>) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE epochs e SET ended_at = $3, loss_samples = l.n, loss_mean = l.mean
         FROM (SELECT count(loss) AS n, avg(loss) AS mean FROM samples
               WHERE run_id = $1 AND epoch = $2 AND loss IS NOT NULL) l
         WHERE e.run_id = $1 AND e.epoch = $2",
    )
    .bind(run)
    .bind(epoch)
    .bind(at)
    .execute(db)
    .await?;
    Ok(())
}

/// Starts `epoch` at `at` (an existing row is left as it is).
pub async fn start<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    at: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO epochs (run_id, epoch, started_at) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(run)
    .bind(epoch)
    .bind(at)
    .execute(db)
    .await?;
    Ok(())
}

/// Adds `bytes` to the bytes `epoch`'s hops put on the wire.
pub async fn add_wire_bytes<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    bytes: i64,
) -> sqlx::Result<()> {
    sqlx::query("UPDATE epochs SET wire_bytes = wire_bytes + $3 WHERE run_id = $1 AND epoch = $2")
        .bind(run)
        .bind(epoch)
        .bind(bytes)
        .execute(db)
        .await?;
    Ok(())
}

/// Counts one more completed sample in `epoch`.
pub async fn count_completed<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE epochs SET samples_completed = samples_completed + 1 WHERE run_id = $1 AND epoch = $2",
    )
    .bind(run)
    .bind(epoch)
    .execute(db)
    .await?;
    Ok(())
}
