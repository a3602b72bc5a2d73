//! A miner's work poll: its leases, new leases of hops routed to it, new samples at stage 0.

use chrono::{DateTime, Utc};
use iota_protocol::api::EpochStatus;
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::Db;
use crate::error::RunResult;

/// The work poll as one statement: checks the caller (active miner of this run) and marks it seen
/// (at most once a second), returns the leases it still holds, leases pending hops routed to it
/// up to `$4` in all (none of an epoch the caller has ended, see `samples::close_epoch`), and reads the
/// epoch status. One row per item, or one row with null item
/// columns; no row when the caller is not an active miner (nothing is leased then).
pub const POLL_SQL: &str = "
WITH me AS (
    SELECT stage, ended_epoch FROM miners
    WHERE run_id = $1 AND hotkey = $2 AND status = 'active'
), touched AS (
    UPDATE miners SET last_seen = $5
    WHERE run_id = $1 AND hotkey = $2 AND status = 'active'
      AND last_seen < $5 - interval '1 second'
), held AS (
    SELECT id, lease, leased_until, epoch, sample_id, stage, direction, input FROM tasks
    WHERE run_id = $1 AND miner = $2 AND status = 'leased' AND leased_until > $5
      AND EXISTS (SELECT 1 FROM me)
    ORDER BY id LIMIT $4
), fresh AS (
    UPDATE tasks SET status = 'leased', lease = gen_random_uuid(), leased_at = $5,
        leased_until = $5 + make_interval(secs => $3)
    WHERE id IN (
        SELECT id FROM tasks WHERE run_id = $1 AND miner = $2 AND status = 'pending'
          AND EXISTS (SELECT 1 FROM me)
          AND tasks.epoch IS DISTINCT FROM (SELECT ended_epoch FROM me)
        ORDER BY (direction = 'backward') DESC, id
        LIMIT greatest($4 - (SELECT count(*) FROM held), 0)
        FOR UPDATE SKIP LOCKED)
    RETURNING id, lease, leased_until, epoch, sample_id, stage, direction, input
), items AS (
    SELECT 0 AS part, * FROM held UNION ALL SELECT 1 AS part, * FROM fresh
)
SELECT me.stage AS miner_stage, r.epoch AS status_epoch, r.phase AS status_phase,
       r.phase_started AS status_phase_started, r.phase_deadline AS status_phase_deadline,
       r.merge_round AS status_merge_round, e.samples_started AS status_samples_started,
       e.samples_completed AS status_samples_completed,
       e.samples_abandoned AS status_samples_abandoned,
       i.id, i.lease, i.leased_until, i.epoch, i.sample_id, i.stage, i.direction, i.input
FROM me CROSS JOIN runs r JOIN epochs e ON e.run_id = r.id AND e.epoch = r.epoch
LEFT JOIN items i ON true
WHERE r.id = $1
ORDER BY i.part, i.part = 1 AND i.direction = 'backward' DESC, i.id";

/// A leased hop as the poll hands it out.
pub struct Leased {
    /// The hop's id.
    pub id: i64,
    /// Its lease.
    pub lease: uuid::Uuid,
    /// When the lease ends.
    pub leased_until: DateTime<Utc>,
    /// Its epoch.
    pub epoch: i64,
    /// Its sample.
    pub sample_id: i64,
    /// Its stage.
    pub stage: i32,
    /// `forward` or `backward`, as stored.
    pub direction: String,
    /// Its input blob.
    pub input: Option<serde_json::Value>,
}

fn leased(row: &PgRow) -> sqlx::Result<Leased> {
    Ok(Leased {
        id: row.try_get("id")?,
        lease: row.try_get("lease")?,
        leased_until: row.try_get("leased_until")?,
        epoch: row.try_get("epoch")?,
        sample_id: row.try_get("sample_id")?,
        stage: row.try_get("stage")?,
        direction: row.try_get("direction")?,
        input: row.try_get("input")?,
    })
}

/// What a poll found: the miner's stage, the epoch status and its leases (held ones first).
pub struct Polled {
    /// The miner's stage.
    pub stage: i32,
    /// The epoch status.
    pub status: EpochStatus,
    /// Its leases.
    pub items: Vec<Leased>,
}

/// Runs [`POLL_SQL`] for `miner` at `now`, leasing for `lease_s` seconds, at most `max` items:
/// `None` when `miner` is not an active miner of the run.
pub async fn poll<'e>(
    db: impl Db<'e>,
    run: i64,
    miner: &str,
    (lease_s, max): (f64, i64),
    now: DateTime<Utc>,
) -> RunResult<Option<Polled>> {
    let rows = sqlx::query(POLL_SQL)
        .bind(run)
        .bind(miner)
        .bind(lease_s)
        .bind(max)
        .bind(now)
        .fetch_all(db)
        .await?;
    let Some(first) = rows.first() else {
        return Ok(None);
    };
    let mut items = Vec::with_capacity(rows.len());
    for row in &rows {
        if row.try_get::<Option<i64>, _>("id")?.is_some() {
            items.push(leased(row)?);
        }
    }
    Ok(Some(Polled {
        stage: first.try_get("miner_stage")?,
        status: super::status::status_from_row(first, now)?,
        items,
    }))
}

/// Whether the run is training `epoch`.
pub async fn is_training<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM runs WHERE id = $1 AND epoch = $2 AND phase = 'training')",
    )
    .bind(run)
    .bind(epoch)
    .fetch_one(db)
    .await
}

/// Locks an active `miner`'s row (so two polls of one miner count its samples one after the
/// other): the epoch it ended its work in, if it is an active miner.
pub async fn lock_active_miner<'e>(
    db: impl Db<'e>,
    run: i64,
    miner: &str,
) -> sqlx::Result<Option<Option<i64>>> {
    sqlx::query_scalar(
        "SELECT ended_epoch FROM miners WHERE run_id = $1 AND hotkey = $2 AND status = 'active'
         FOR NO KEY UPDATE",
    )
    .bind(run)
    .bind(miner)
    .fetch_optional(db)
    .await
}

/// Samples of `epoch` in flight that `miner` started at stage 0.
pub async fn started_in_flight<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    miner: &str,
) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM samples s JOIN tasks t
           ON t.sample_id = s.id AND t.stage = 0 AND t.direction = 'forward'
              AND t.status IN ('pending', 'leased', 'done')
         WHERE s.run_id = $1 AND s.epoch = $2 AND s.status IN ('forward', 'backward')
           AND t.miner = $3",
    )
    .bind(run)
    .bind(epoch)
    .bind(miner)
    .fetch_one(db)
    .await
}

/// Takes up to `want` samples of `epoch`'s budget of `budget`: how many were granted.
pub async fn grant_samples<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    (want, budget): (i64, i64),
) -> sqlx::Result<i64> {
    let granted: Option<i64> = sqlx::query_scalar(
        "WITH cur AS (SELECT samples_started FROM epochs WHERE run_id = $1 AND epoch = $2 FOR UPDATE)
         UPDATE epochs e SET samples_started = LEAST(cur.samples_started + $3, $4)
         FROM cur WHERE e.run_id = $1 AND e.epoch = $2
         RETURNING e.samples_started - cur.samples_started",
    )
    .bind(run)
    .bind(epoch)
    .bind(want)
    .bind(budget)
    .fetch_optional(db)
    .await?;
    Ok(granted.unwrap_or(0))
}

/// Starts a sample in `epoch`: its id.
pub async fn start_sample<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "INSERT INTO samples (run_id, epoch, status) VALUES ($1, $2, 'forward') RETURNING id",
    )
    .bind(run)
    .bind(epoch)
    .fetch_one(db)
    .await
}

/// Leases the first hop of a new sample to `miner` at `now` for `lease_s` seconds.
pub async fn lease_first_hop<'e>(
    db: impl Db<'e>,
    run: i64,
    (epoch, sample): (i64, i64),
    miner: &str,
    (lease_s, now): (f64, DateTime<Utc>),
) -> sqlx::Result<Leased> {
    let row = sqlx::query(
        "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, miner, status, lease,
             leased_at, leased_until)
         VALUES ($1, $2, $3, 0, 'forward', $4, 'leased', gen_random_uuid(), $6,
             $6 + make_interval(secs => $5))
         RETURNING id, lease, leased_until, epoch, sample_id, stage, direction, input",
    )
    .bind(run)
    .bind(epoch)
    .bind(sample)
    .bind(miner)
    .bind(lease_s)
    .bind(now)
    .fetch_one(db)
    .await?;
    leased(&row)
}
