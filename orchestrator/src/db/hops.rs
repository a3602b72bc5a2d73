//! A sample's hops (`tasks`): one per stage and direction, attempts numbered. A hop is `pending`
//! (routed to a miner, waiting to be leased by `leased_until`), `leased`, `done`, `expired`
//! (moved on), `abandoned` (its sample ended) or `failed`.

use chrono::{DateTime, Utc};
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::Db;

/// A hop taken off its miner, with what moving it needs.
pub struct MovedHop {
    /// The hop's id.
    pub id: i64,
    /// Its epoch.
    pub epoch: i64,
    /// Its sample.
    pub sample_id: i64,
    /// Its stage.
    pub stage: i32,
    /// `forward` or `backward`, as stored.
    pub direction: String,
    /// Its attempt.
    pub attempt: i32,
    /// The miner it was routed to.
    pub miner: String,
    /// Its input blob, if any.
    pub input: Option<serde_json::Value>,
}

fn moved(row: &PgRow) -> sqlx::Result<MovedHop> {
    Ok(MovedHop {
        id: row.try_get("id")?,
        epoch: row.try_get("epoch")?,
        sample_id: row.try_get("sample_id")?,
        stage: row.try_get("stage")?,
        direction: row.try_get("direction")?,
        attempt: row.try_get("attempt")?,
        miner: row.try_get("miner")?,
        input: row.try_get("input")?,
    })
}

/// A new forward hop of `sample` at `stage`, routed to `miner`, to be leased before `pickup_by`.
pub struct NewForward<'a> {
    /// The run.
    pub run: i64,
    /// The epoch.
    pub epoch: i64,
    /// The sample.
    pub sample_id: i64,
    /// The stage.
    pub stage: i32,
    /// The attempt.
    pub attempt: i32,
    /// The miner it goes to.
    pub miner: &'a str,
    /// Its input blob (none at stage 0).
    pub input: Option<serde_json::Value>,
    /// When it stops waiting to be leased.
    pub pickup_by: DateTime<Utc>,
}

/// Routes a forward hop: its id.
pub async fn insert_forward<'e>(db: impl Db<'e>, hop: NewForward<'_>) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, attempt, miner, status, input,
             leased_until)
         VALUES ($1, $2, $3, $4, 'forward', $5, $6, 'pending', $7, $8)
         RETURNING id",
    )
    .bind(hop.run)
    .bind(hop.epoch)
    .bind(hop.sample_id)
    .bind(hop.stage)
    .bind(hop.attempt)
    .bind(hop.miner)
    .bind(hop.input)
    .bind(hop.pickup_by)
    .fetch_one(db)
    .await
}

/// Takes `miner`'s open hops of `epoch` off it.
pub async fn expire_of_miner_in<'e>(
    db: impl Db<'e>,
    run: i64,
    miner: &str,
    epoch: i64,
) -> sqlx::Result<Vec<MovedHop>> {
    let rows = sqlx::query(
        "UPDATE tasks SET status = 'expired'
         WHERE run_id = $1 AND miner = $2 AND epoch = $3 AND status IN ('pending', 'leased')
         RETURNING id, epoch, sample_id, stage, direction, attempt, miner, input",
    )
    .bind(run)
    .bind(miner)
    .bind(epoch)
    .fetch_all(db)
    .await?;
    rows.iter().map(moved).collect()
}

/// Takes the hops `ids` off their miners.
pub async fn expire<'e>(db: impl Db<'e>, ids: &[i64]) -> sqlx::Result<Vec<MovedHop>> {
    let rows = sqlx::query(
        "UPDATE tasks SET status = 'expired' WHERE id = ANY($1)
         RETURNING id, epoch, sample_id, stage, direction, attempt, miner, input",
    )
    .bind(ids)
    .fetch_all(db)
    .await?;
    rows.iter().map(moved).collect()
}

/// Takes every open hop of a released miner off it (not only of those released now: a
/// completion that raced with an earlier release may have routed one to a leaving miner).
pub async fn expire_of_released<'e>(db: impl Db<'e>, run: i64) -> sqlx::Result<Vec<MovedHop>> {
    let rows = sqlx::query(
        "UPDATE tasks t SET status = 'expired' FROM miners m
         WHERE t.run_id = $1 AND m.run_id = t.run_id AND m.hotkey = t.miner
           AND m.status = 'released' AND t.status IN ('pending', 'leased')
         RETURNING t.id, t.epoch, t.sample_id, t.stage, t.direction, t.attempt, t.miner, t.input",
    )
    .bind(run)
    .fetch_all(db)
    .await?;
    rows.iter().map(moved).collect()
}

/// Closes the hops `ids` (their epoch ended).
pub async fn abandon<'e>(db: impl Db<'e>, ids: &[i64]) -> sqlx::Result<()> {
    sqlx::query("UPDATE tasks SET status = 'abandoned' WHERE id = ANY($1)")
        .bind(ids)
        .execute(db)
        .await?;
    Ok(())
}

/// Closes the open hops of `sample` (it ended).
pub async fn abandon_of_sample<'e>(db: impl Db<'e>, sample: i64) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE tasks SET status = 'abandoned' WHERE sample_id = $1 AND status IN ('pending', 'leased')",
    )
    .bind(sample)
    .execute(db)
    .await?;
    Ok(())
}

/// An open hop that may stop waiting for its miner at `now`, as the lapse rule reads it.
pub struct LapseCandidate {
    /// The hop's id.
    pub id: i64,
    /// `pending` or `leased`, as stored.
    pub status: String,
    /// Its epoch.
    pub epoch: i64,
    /// Its lease's (or pick-up's) end.
    pub leased_until: Option<DateTime<Utc>>,
    /// The run's current epoch.
    pub current_epoch: i64,
    /// The epoch its miner ended, if any.
    pub miner_ended_epoch: Option<i64>,
    /// Whether its miner holds a live lease.
    pub miner_working: bool,
}

/// Open hops that may lapse at `now` (of an ended epoch, past their lease or pick-up time, or
/// of a miner that ended their epoch), locked, skipping those a completion holds.
pub async fn may_lapse<'e>(
    db: impl Db<'e>,
    run: i64,
    now: DateTime<Utc>,
) -> sqlx::Result<Vec<LapseCandidate>> {
    let rows = sqlx::query(
        "SELECT t.id, t.status, t.epoch, t.leased_until, r.epoch AS current_epoch,
                m.ended_epoch,
                EXISTS (SELECT 1 FROM tasks l
                        WHERE l.run_id = t.run_id AND l.miner = t.miner
                          AND l.status = 'leased' AND l.leased_until >= $2) AS miner_working
         FROM tasks t
         JOIN runs r ON r.id = t.run_id
         LEFT JOIN miners m ON m.run_id = t.run_id AND m.hotkey = t.miner
         WHERE t.run_id = $1 AND t.status IN ('pending', 'leased')
           AND (t.epoch < r.epoch OR t.leased_until < $2 OR m.ended_epoch = t.epoch)
         FOR UPDATE OF t SKIP LOCKED",
    )
    .bind(run)
    .bind(now)
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(LapseCandidate {
                id: row.try_get("id")?,
                status: row.try_get("status")?,
                epoch: row.try_get("epoch")?,
                leased_until: row.try_get("leased_until")?,
                current_epoch: row.try_get("current_epoch")?,
                miner_ended_epoch: row.try_get("ended_epoch")?,
                miner_working: row.try_get("miner_working")?,
            })
        })
        .collect()
}

/// Locks the open hops of active miners silent since `cutoff` (before their rows: the order a
/// completion takes them in).
pub async fn lock_open_of_silent<'e>(
    db: impl Db<'e>,
    run: i64,
    cutoff: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "SELECT t.id FROM tasks t JOIN miners m ON m.run_id = t.run_id AND m.hotkey = t.miner
         WHERE t.run_id = $1 AND m.status = 'active' AND m.last_seen < $2
           AND t.status IN ('pending', 'leased')
         ORDER BY t.id FOR UPDATE OF t",
    )
    .bind(run)
    .bind(cutoff)
    .execute(db)
    .await?;
    Ok(())
}

/// Locks `miner`'s open hops (before its row).
pub async fn lock_open_of_miner<'e>(db: impl Db<'e>, run: i64, miner: &str) -> sqlx::Result<()> {
    sqlx::query(
        "SELECT id FROM tasks WHERE run_id = $1 AND miner = $2 AND status IN ('pending', 'leased')
         ORDER BY id FOR UPDATE",
    )
    .bind(run)
    .bind(miner)
    .execute(db)
    .await?;
    Ok(())
}

/// Every live lease lasts at least until `until`.
pub async fn extend_leases<'e>(
    db: impl Db<'e>,
    run: i64,
    until: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE tasks SET leased_until = greatest(leased_until, $2)
         WHERE run_id = $1 AND status = 'leased'",
    )
    .bind(run)
    .bind(until)
    .execute(db)
    .await?;
    Ok(())
}

/// Every routed hop waiting to be leased waits at least until `until`.
pub async fn extend_pickups<'e>(
    db: impl Db<'e>,
    run: i64,
    until: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE tasks SET leased_until = greatest(leased_until, $2)
         WHERE run_id = $1 AND status = 'pending'",
    )
    .bind(run)
    .bind(until)
    .execute(db)
    .await?;
    Ok(())
}

/// Locks the open hops of `epoch`.
pub async fn lock_open_of_epoch<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<()> {
    sqlx::query(
        "SELECT id FROM tasks WHERE run_id = $1 AND epoch = $2 AND status IN ('pending', 'leased')
         ORDER BY id FOR UPDATE",
    )
    .bind(run)
    .bind(epoch)
    .execute(db)
    .await?;
    Ok(())
}
