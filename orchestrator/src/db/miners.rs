//! The run's miners: who may take hops, liveness, release.

use chrono::{DateTime, Utc};

use super::Db;

/// The active miners of `stage` still training in `epoch` (not ended, see
/// `samples::close_epoch`), with their throughput, by hotkey.
pub async fn routable<'e>(
    db: impl Db<'e>,
    run: i64,
    stage: i32,
    epoch: i64,
) -> sqlx::Result<Vec<(String, f64)>> {
    sqlx::query_as(
        "SELECT hotkey, tokens_per_s FROM miners
         WHERE run_id = $1 AND stage = $2 AND status = 'active'
           AND ended_epoch IS DISTINCT FROM $3
         ORDER BY hotkey",
    )
    .bind(run)
    .bind(stage)
    .bind(epoch)
    .fetch_all(db)
    .await
}

/// Records that `miner`'s work in `epoch` ended (never moves back).
pub async fn end_epoch<'e>(db: impl Db<'e>, run: i64, miner: &str, epoch: i64) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE miners SET ended_epoch = $3
         WHERE run_id = $1 AND hotkey = $2 AND (ended_epoch IS NULL OR ended_epoch < $3)",
    )
    .bind(run)
    .bind(miner)
    .bind(epoch)
    .execute(db)
    .await?;
    Ok(())
}

/// Releases the active miners not seen since `cutoff`: their hotkeys.
pub async fn release_silent<'e>(
    db: impl Db<'e>,
    run: i64,
    cutoff: DateTime<Utc>,
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "UPDATE miners SET status = 'released'
         WHERE run_id = $1 AND status = 'active' AND last_seen < $2 RETURNING hotkey",
    )
    .bind(run)
    .bind(cutoff)
    .fetch_all(db)
    .await
}

/// Releases `miner` if it is active: its hotkey then.
pub async fn release<'e>(db: impl Db<'e>, run: i64, miner: &str) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "UPDATE miners SET status = 'released' WHERE run_id = $1 AND hotkey = $2
           AND status = 'active'
         RETURNING hotkey",
    )
    .bind(run)
    .bind(miner)
    .fetch_optional(db)
    .await
}

/// Active miners per stage (stages without one are absent).
pub async fn active_per_stage<'e>(db: impl Db<'e>, run: i64) -> sqlx::Result<Vec<(i32, i64)>> {
    sqlx::query_as(
        "SELECT stage, count(*) FROM miners WHERE run_id = $1 AND status = 'active'
         GROUP BY stage",
    )
    .bind(run)
    .fetch_all(db)
    .await
}

/// Whether a released miner was seen since `cutoff` (released alive: it may join again).
pub async fn released_seen_since<'e>(
    db: impl Db<'e>,
    run: i64,
    cutoff: DateTime<Utc>,
) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM miners WHERE run_id = $1 AND status = 'released'
                          AND last_seen >= $2)",
    )
    .bind(run)
    .bind(cutoff)
    .fetch_one(db)
    .await
}

/// The slowest active miner of `stage` with at least `memory_bytes`.
pub async fn slowest_holding<'e>(
    db: impl Db<'e>,
    run: i64,
    stage: i32,
    memory_bytes: i64,
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "SELECT hotkey FROM miners WHERE run_id = $1 AND status = 'active' AND stage = $2
           AND memory_bytes >= $3
         ORDER BY tokens_per_s, hotkey LIMIT 1",
    )
    .bind(run)
    .bind(stage)
    .bind(memory_bytes)
    .fetch_optional(db)
    .await
}

/// Every active miner counts as seen at `now` at the latest.
pub async fn seen_by<'e>(db: impl Db<'e>, run: i64, now: DateTime<Utc>) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE miners SET last_seen = greatest(last_seen, $2)
         WHERE run_id = $1 AND status = 'active'",
    )
    .bind(run)
    .bind(now)
    .execute(db)
    .await?;
    Ok(())
}

/// Marks the active miners `hotkeys` seen at `now`, those not marked in the last second only,
/// skipping rows another statement holds.
pub async fn mark_seen<'e>(
    db: impl Db<'e>,
    run: i64,
    hotkeys: &[String],
    now: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE miners SET last_seen = $3
         WHERE ctid = ANY(ARRAY(
             SELECT ctid FROM miners
             WHERE run_id = $1 AND hotkey = ANY($2) AND status = 'active'
               AND last_seen < $3 - interval '1 second'
             ORDER BY hotkey
             FOR UPDATE SKIP LOCKED))",
    )
    .bind(run)
    .bind(hotkeys)
    .bind(now)
    .execute(db)
    .await?;
    Ok(())
}

/// The active miners and their stages, by hotkey.
pub async fn active_with_stage<'e>(db: impl Db<'e>, run: i64) -> sqlx::Result<Vec<(String, i32)>> {
    sqlx::query_as(
        "SELECT hotkey, stage FROM miners WHERE run_id = $1 AND status = 'active' ORDER BY hotkey",
    )
    .bind(run)
    .fetch_all(db)
    .await
}

/// The active miners (only those of `hotkeys` if given): (hotkey, stage, whether it has open
/// hops).
pub async fn active_with_open_hops<'e>(
    db: impl Db<'e>,
    run: i64,
    hotkeys: Option<&[String]>,
) -> sqlx::Result<Vec<(String, i32, bool)>> {
    sqlx::query_as(
        "SELECT m.hotkey, m.stage,
                EXISTS (SELECT 1 FROM tasks t WHERE t.run_id = m.run_id AND t.miner = m.hotkey
                        AND t.status IN ('pending', 'leased')) AS open_tasks
         FROM miners m
         WHERE m.run_id = $1 AND m.status = 'active' AND ($2::text[] IS NULL OR m.hotkey = ANY($2))",
    )
    .bind(run)
    .bind(hotkeys)
    .fetch_all(db)
    .await
}
