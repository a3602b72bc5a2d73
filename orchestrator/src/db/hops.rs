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

/// A new hop of `sample` at `stage`, routed to `miner`, to be leased before `pickup_by`.
pub struct NewHop<'a> {
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
pub async fn insert_forward<'e>(db: impl Db<'e>, hop: NewHop<'_>) -> sqlx::Result<i64> {
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

/// Every open hop in `status` (`leased`: its lease; `pending`: its pick-up time) lasts at least
/// until `until`.
pub async fn extend_open<'e>(
    db: impl Db<'e>,
    run: i64,
    status: &str,
    until: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE tasks SET leased_until = greatest(leased_until, $3)
         WHERE run_id = $1 AND status = $2",
    )
    .bind(run)
    .bind(status)
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

/// What a completed hop records.
pub struct Done<'a> {
    /// Its output blob.
    pub output: Option<&'a serde_json::Value>,
    /// The miner's inner step after it.
    pub inner_step: i64,
    /// The digest of the weights it ran with.
    pub weights_digest: &'a str,
    /// How long it took the miner.
    pub compute_ms: Option<i64>,
    /// When it completed.
    pub at: DateTime<Utc>,
}

/// Closes hop `id` as done.
pub async fn close_done<'e>(db: impl Db<'e>, id: i64, done: Done<'_>) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE tasks SET status = 'done', output = $2, inner_step = $3, weights_digest = $4,
             compute_ms = $5, completed_at = $6 WHERE id = $1",
    )
    .bind(id)
    .bind(done.output)
    .bind(done.inner_step)
    .bind(done.weights_digest)
    .bind(done.compute_ms)
    .bind(done.at)
    .execute(db)
    .await?;
    Ok(())
}

/// The miner that ran `sample`'s forward at `stage`, if it is still active and training in the
/// sample's epoch (it holds the activation cache the backward needs).
pub async fn forward_miner<'e>(
    db: impl Db<'e>,
    sample: i64,
    stage: i32,
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "SELECT t.miner FROM tasks t JOIN miners m ON m.run_id = t.run_id AND m.hotkey = t.miner
         WHERE t.sample_id = $1 AND t.stage = $2 AND t.direction = 'forward' AND t.status = 'done'
           AND m.status = 'active' AND m.ended_epoch IS DISTINCT FROM t.epoch",
    )
    .bind(sample)
    .bind(stage)
    .fetch_optional(db)
    .await
}

/// Routes the backward hop of a sample at a stage (the one of attempt 0; an existing one is
/// kept): its id (`attempt` is not read).
pub async fn insert_backward<'e>(db: impl Db<'e>, hop: NewHop<'_>) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, attempt, miner, status, input,
             leased_until)
         VALUES ($1, $2, $3, $4, 'backward', 0, $5, 'pending', $6, $7)
         ON CONFLICT (sample_id, stage, direction, attempt) DO UPDATE SET attempt = tasks.attempt
         RETURNING id",
    )
    .bind(hop.run)
    .bind(hop.epoch)
    .bind(hop.sample_id)
    .bind(hop.stage)
    .bind(hop.miner)
    .bind(hop.input)
    .bind(hop.pickup_by)
    .fetch_one(db)
    .await
}

/// A hop as a miner's upload or completion finds it, locked.
pub struct Locked {
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
    /// Its status, as stored.
    pub status: String,
    /// Its lease, if leased.
    pub lease: Option<uuid::Uuid>,
    /// The miner it is routed to.
    pub miner: String,
    /// The output staged for it.
    pub staged: Option<serde_json::Value>,
    /// Its output, once done.
    pub output: Option<serde_json::Value>,
    /// The sample's next hop, if routed.
    pub next_task_id: Option<i64>,
    /// When it was leased, if it was.
    pub leased_at: Option<DateTime<Utc>>,
}

/// Locks hop `id` of the run.
pub async fn lock<'e>(db: impl Db<'e>, run: i64, id: i64) -> sqlx::Result<Option<Locked>> {
    let row = sqlx::query(
        "SELECT epoch, sample_id, stage, direction, attempt, status, lease, miner, staged_output,
                output, leased_at,
                (SELECT min(n.id) FROM tasks n WHERE n.sample_id = t.sample_id AND n.id > t.id
                   AND n.attempt = 0) AS next_task_id
         FROM tasks t WHERE id = $1 AND run_id = $2 FOR UPDATE",
    )
    .bind(id)
    .bind(run)
    .fetch_optional(db)
    .await?;
    row.map(|row| {
        Ok(Locked {
            epoch: row.try_get("epoch")?,
            sample_id: row.try_get("sample_id")?,
            stage: row.try_get("stage")?,
            direction: row.try_get("direction")?,
            attempt: row.try_get("attempt")?,
            status: row.try_get("status")?,
            lease: row.try_get("lease")?,
            miner: row.try_get("miner")?,
            staged: row.try_get("staged_output")?,
            output: row.try_get("output")?,
            next_task_id: row.try_get("next_task_id")?,
            leased_at: row.try_get("leased_at")?,
        })
    })
    .transpose()
}

/// Stages `blob` as the output of hop `id` while `lease` holds it: whether it was staged.
pub async fn stage_output<'e>(
    db: impl Db<'e>,
    id: i64,
    lease: uuid::Uuid,
    blob: &serde_json::Value,
) -> sqlx::Result<bool> {
    let updated = sqlx::query(
        "UPDATE tasks SET staged_output = $3 WHERE id = $1 AND lease = $2 AND status = 'leased'",
    )
    .bind(id)
    .bind(lease)
    .bind(blob)
    .execute(db)
    .await?;
    Ok(updated.rows_affected() > 0)
}

/// The hash of hop `id`'s output if it completed under `lease` with the object `key`: `None`
/// if it did not, `Some(None)` if its output has no hash.
pub async fn output_hash<'e>(
    db: impl Db<'e>,
    id: i64,
    lease: uuid::Uuid,
    key: &str,
) -> sqlx::Result<Option<Option<String>>> {
    sqlx::query_scalar(
        "SELECT output->>'blake3' FROM tasks WHERE id = $1 AND lease = $2 AND status = 'done'
           AND output->>'key' = $3",
    )
    .bind(id)
    .bind(lease)
    .bind(key)
    .fetch_optional(db)
    .await
}

/// The hop whose output is object `key`: its id, its sample and its output.
pub async fn producer<'e>(
    db: impl Db<'e>,
    run: i64,
    key: &str,
) -> sqlx::Result<Option<(i64, i64, serde_json::Value)>> {
    sqlx::query_as(
        "SELECT id, sample_id, output FROM tasks WHERE run_id = $1 AND output->>'key' = $2",
    )
    .bind(run)
    .bind(key)
    .fetch_optional(db)
    .await
}

/// Fails hop `id` (its output was confirmed bad).
pub async fn fail<'e>(db: impl Db<'e>, id: i64) -> sqlx::Result<()> {
    sqlx::query("UPDATE tasks SET status = 'failed' WHERE id = $1")
        .bind(id)
        .execute(db)
        .await?;
    Ok(())
}
