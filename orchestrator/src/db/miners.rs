//! The run's miners: who may take hops, liveness, release.

use chrono::{DateTime, Utc};

use sqlx::Row;

use super::Db;
use crate::domain::throughput::Measured;

/// The active miners of `stage` still training in `epoch` (not ended, see
/// `samples::close_epoch`), with their throughput by hotkey: measured from their completed hops
/// where it has been (`miner_throughput`), claimed until then.
pub async fn routable<'e>(
    db: impl Db<'e>,
    run: i64,
    stage: i32,
    epoch: i64,
) -> sqlx::Result<Vec<(String, f64)>> {
    sqlx::query_as(
        "SELECT m.hotkey, coalesce(t.tokens_per_s, m.tokens_per_s) FROM miners m
         LEFT JOIN miner_throughput t ON t.run_id = m.run_id AND t.miner = m.hotkey
         WHERE m.run_id = $1 AND m.stage = $2 AND m.status = 'active'
           AND m.ended_epoch IS DISTINCT FROM $3
         ORDER BY m.hotkey",
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

/// Locks `miner`'s row shared: the epoch it ended, if it is a miner of the run.
pub async fn lock_ended_epoch<'e>(
    db: impl Db<'e>,
    run: i64,
    miner: &str,
) -> sqlx::Result<Option<Option<i64>>> {
    sqlx::query_scalar("SELECT ended_epoch FROM miners WHERE run_id = $1 AND hotkey = $2 FOR SHARE")
        .bind(run)
        .bind(miner)
        .fetch_optional(db)
        .await
}

/// A miner of the run as joining reads it.
pub struct Member {
    /// Its stage.
    pub stage: i32,
    /// The epoch it ended its work in, if any.
    pub ended_epoch: Option<i64>,
    /// Whether it is active.
    pub active: bool,
    /// Whether it completed a hop in the epoch asked about.
    pub worked: bool,
}

/// `miner` as joining reads it, with whether it completed a hop in `epoch`.
pub async fn member<'e>(
    db: impl Db<'e>,
    run: i64,
    miner: &str,
    epoch: i64,
) -> sqlx::Result<Option<Member>> {
    let row = sqlx::query(
        "SELECT stage, ended_epoch, status = 'active' AS active,
            EXISTS (SELECT 1 FROM tasks WHERE run_id = $1 AND epoch = $3 AND miner = $2
                      AND status = 'done') AS worked
         FROM miners WHERE run_id = $1 AND hotkey = $2",
    )
    .bind(run)
    .bind(miner)
    .bind(epoch)
    .fetch_optional(db)
    .await?;
    row.map(|row| {
        Ok(Member {
            stage: row.try_get("stage")?,
            ended_epoch: row.try_get("ended_epoch")?,
            active: row.try_get("active")?,
            worked: row.try_get("worked")?,
        })
    })
    .transpose()
}

/// What a miner declares when it joins.
pub struct Joining<'a> {
    /// Its hotkey.
    pub hotkey: &'a str,
    /// Its uid on the subnet.
    pub uid: i32,
    /// The stage it takes.
    pub stage: i32,
    /// Its device.
    pub device: &'a str,
    /// Its memory.
    pub memory_bytes: i64,
    /// Its throughput.
    pub tokens_per_s: f64,
    /// When it joined.
    pub at: DateTime<Utc>,
}

/// Adds a miner to the run in `epoch`, active.
pub async fn insert<'e>(db: impl Db<'e>, run: i64, epoch: i64, m: Joining<'_>) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO miners (run_id, hotkey, uid, stage, status, device, memory_bytes,
         tokens_per_s, joined_epoch, registered_at, last_seen)
         VALUES ($1, $2, $3, $4, 'active', $5, $6, $7, $8, $9, $9)",
    )
    .bind(run)
    .bind(m.hotkey)
    .bind(m.uid)
    .bind(m.stage)
    .bind(m.device)
    .bind(m.memory_bytes)
    .bind(m.tokens_per_s)
    .bind(epoch)
    .bind(m.at)
    .execute(db)
    .await?;
    Ok(())
}

/// Takes a miner of the run back, active, with what it declares now.
pub async fn rejoin<'e>(db: impl Db<'e>, run: i64, m: Joining<'_>) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE miners SET status = 'active', uid = $3, device = $4, memory_bytes = $5,
         tokens_per_s = $6, last_seen = $8, stage = $7 WHERE run_id = $1 AND hotkey = $2",
    )
    .bind(run)
    .bind(m.hotkey)
    .bind(m.uid)
    .bind(m.device)
    .bind(m.memory_bytes)
    .bind(m.tokens_per_s)
    .bind(m.stage)
    .bind(m.at)
    .execute(db)
    .await?;
    Ok(())
}

/// Active miners per stage with their throughput summed, each counted up to `cap_over_median`
/// times the run's median: (stage, miners, tokens/s).
pub async fn capped_loads<'e>(
    db: impl Db<'e>,
    run: i64,
    cap_over_median: f64,
) -> sqlx::Result<Vec<(i32, i64, f64)>> {
    sqlx::query_as(
        "WITH active AS (SELECT stage, tokens_per_s FROM miners
                         WHERE run_id = $1 AND status = 'active'),
              cap AS (SELECT $2 * percentile_disc(0.5) WITHIN GROUP (ORDER BY tokens_per_s)
                        AS tps FROM active)
         SELECT stage, count(*) AS miners,
                coalesce(sum(LEAST(tokens_per_s, (SELECT tps FROM cap))), 0) AS tps
         FROM active GROUP BY stage",
    )
    .bind(run)
    .bind(cap_over_median)
    .fetch_all(db)
    .await
}

/// `miner`'s stage and status, if it joined the run.
pub async fn stage_and_status<'e>(
    db: impl Db<'e>,
    run: i64,
    miner: &str,
) -> sqlx::Result<Option<(i32, String)>> {
    sqlx::query_as("SELECT stage, status FROM miners WHERE run_id = $1 AND hotkey = $2")
        .bind(run)
        .bind(miner)
        .fetch_optional(db)
        .await
}

/// A heartbeat: `miner` seen at `now`, with its throughput if it sent one.
pub async fn heartbeat<'e>(
    db: impl Db<'e>,
    run: i64,
    miner: &str,
    tokens_per_s: Option<f64>,
    now: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE miners SET last_seen = $4, tokens_per_s = coalesce($3, tokens_per_s)
         WHERE run_id = $1 AND hotkey = $2",
    )
    .bind(run)
    .bind(miner)
    .bind(tokens_per_s)
    .bind(now)
    .execute(db)
    .await?;
    Ok(())
}

/// `miner`'s measured throughput, locked until the transaction ends.
pub async fn lock_measured<'e>(
    db: impl Db<'e>,
    run: i64,
    miner: &str,
) -> sqlx::Result<Option<Measured>> {
    let row: Option<(f64, DateTime<Utc>, i64)> = sqlx::query_as(
        "SELECT tokens_per_s, last_done_at, hops FROM miner_throughput
         WHERE run_id = $1 AND miner = $2 FOR UPDATE",
    )
    .bind(run)
    .bind(miner)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(tokens_per_s, last_done_at, hops)| Measured {
        tokens_per_s,
        last_done_at,
        hops: hops.max(0) as u64,
    }))
}

/// Stores `miner`'s measured throughput.
pub async fn set_measured<'e>(
    db: impl Db<'e>,
    run: i64,
    miner: &str,
    m: &Measured,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO miner_throughput (run_id, miner, tokens_per_s, last_done_at, hops)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (run_id, miner) DO UPDATE SET tokens_per_s = EXCLUDED.tokens_per_s,
           last_done_at = EXCLUDED.last_done_at, hops = EXCLUDED.hops",
    )
    .bind(run)
    .bind(miner)
    .bind(m.tokens_per_s)
    .bind(m.last_done_at)
    .bind(m.hops.min(i64::MAX as u64) as i64)
    .execute(db)
    .await?;
    Ok(())
}
