//! What explorers and validators read: the run's records as the API answers with them.

use chrono::{DateTime, Utc};
use iota_protocol::api::*;
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::Db;
use crate::error::{RunError, RunResult};

/// Each partition of `stage` (0 to `count - 1`) with an accepted merge from an epoch before
/// `before`: (partition, epoch, accepted blob) of the latest. One index probe per partition
/// (`partitions_accepted_latest`), not a read of every epoch's partitions.
pub async fn latest_accepted<'e>(
    db: impl Db<'e>,
    run: i64,
    (stage, count): (i32, i32),
    before: i64,
) -> sqlx::Result<Vec<(i32, i64, serde_json::Value)>> {
    sqlx::query_as(
        "SELECT p.partition, x.epoch, x.accepted
         FROM generate_series(0, $3 - 1) AS p(partition)
         CROSS JOIN LATERAL (
             SELECT epoch, accepted FROM partitions
             WHERE run_id = $1 AND stage = $2 AND partition = p.partition
               AND state = 'accepted' AND epoch < $4
             ORDER BY epoch DESC LIMIT 1) x",
    )
    .bind(run)
    .bind(stage)
    .bind(count)
    .bind(before)
    .fetch_all(db)
    .await
}

/// Active miners and their summed throughput per stage (measured where it has been, claimed
/// otherwise): (stage, miners, tokens/s).
pub async fn stage_loads<'e>(db: impl Db<'e>, run: i64) -> sqlx::Result<Vec<(i32, i64, f64)>> {
    sqlx::query_as(
        "SELECT m.stage, count(*) AS n,
                coalesce(sum(coalesce(t.tokens_per_s, m.tokens_per_s)), 0) AS tps
         FROM miners m
         LEFT JOIN miner_throughput t ON t.run_id = m.run_id AND t.miner = m.hotkey
         WHERE m.run_id = $1 AND m.status = 'active' GROUP BY m.stage",
    )
    .bind(run)
    .fetch_all(db)
    .await
}

/// A page of the run's miners by hotkey, after `after`, in `status` if given, with their hops
/// done in `epoch`.
pub async fn miners_page<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    (after, status): (Option<&str>, Option<&str>),
    limit: i64,
) -> RunResult<Vec<MinerInfo>> {
    let rows = sqlx::query(
        "SELECT m.hotkey, m.uid, m.stage, m.status, m.device, m.memory_bytes, m.tokens_per_s,
                m.last_seen, m.joined_epoch, mt.tokens_per_s AS measured,
                (SELECT count(*) FROM tasks t WHERE t.run_id = m.run_id AND t.miner = m.hotkey
                   AND t.epoch = $2 AND t.status = 'done') AS hops
         FROM miners m
         LEFT JOIN miner_throughput mt ON mt.run_id = m.run_id AND mt.miner = m.hotkey
         WHERE m.run_id = $1 AND ($3::text IS NULL OR m.hotkey > $3)
           AND ($4::text IS NULL OR m.status = $4)
         ORDER BY m.hotkey LIMIT $5",
    )
    .bind(run)
    .bind(epoch)
    .bind(after)
    .bind(status)
    .bind(limit)
    .fetch_all(db)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let last_seen: DateTime<Utc> = r.try_get("last_seen")?;
        out.push(MinerInfo {
            hotkey: r.try_get("hotkey")?,
            uid: r.try_get::<i32, _>("uid")? as u16,
            stage: r.try_get::<i32, _>("stage")? as u32,
            status: r.try_get("status")?,
            capacity: Capacity {
                device: r.try_get("device")?,
                memory_bytes: r.try_get::<i64, _>("memory_bytes")? as u64,
                tokens_per_s: r.try_get("tokens_per_s")?,
            },
            last_seen_ms: last_seen.timestamp_millis(),
            joined_epoch: r.try_get::<i64, _>("joined_epoch")? as u64,
            hops_this_epoch: r.try_get::<i64, _>("hops")? as u64,
            measured_tokens_per_s: r.try_get("measured")?,
        });
    }
    Ok(out)
}

/// What `GET /v1/loss` runs: finished epochs' stored means, and the running epoch's from its
/// own samples (so a request reads one row per epoch and one epoch's samples, however long the
/// run), the latest `$3` epochs before `$2`. Epochs without a loss are left out.
pub const LOSS_SQL: &str = "SELECT epoch, n, mean FROM (
       SELECT epoch, loss_samples AS n, loss_mean AS mean FROM epochs
       WHERE run_id = $1 AND epoch < $2 AND ended_at IS NOT NULL AND loss_samples > 0
       UNION ALL
       SELECT epoch, count(loss), avg(loss) FROM samples
       WHERE run_id = $1 AND epoch = (SELECT epoch FROM runs WHERE id = $1) AND epoch < $2
         AND loss IS NOT NULL
       GROUP BY epoch
       ORDER BY epoch DESC LIMIT $3) latest
     ORDER BY epoch";

/// The mean loss of the latest `limit` epochs before `before`: (epoch, samples, mean).
pub async fn losses<'e>(
    db: impl Db<'e>,
    run: i64,
    before: i64,
    limit: i64,
) -> sqlx::Result<Vec<(i64, i64, f64)>> {
    sqlx::query_as(LOSS_SQL)
        .bind(run)
        .bind(before)
        .bind(limit)
        .fetch_all(db)
        .await
}

/// The latest `limit` epochs before `before`, oldest first: (epoch, samples completed, wire
/// bytes, seconds of training, the running one's until `now`).
pub async fn throughput<'e>(
    db: impl Db<'e>,
    run: i64,
    (before, limit): (i64, i64),
    now: DateTime<Utc>,
) -> sqlx::Result<Vec<(i64, i64, i64, f64)>> {
    sqlx::query_as(
        "SELECT * FROM (
           SELECT epoch, samples_completed, wire_bytes,
             extract(epoch FROM coalesce(training_ended_at, $4) - started_at)::float8 AS secs
           FROM epochs WHERE run_id = $1 AND epoch < $2 ORDER BY epoch DESC LIMIT $3) latest
         ORDER BY epoch",
    )
    .bind(run)
    .bind(before)
    .bind(limit)
    .bind(now)
    .fetch_all(db)
    .await
}

fn sample_from_row(r: &PgRow) -> sqlx::Result<SampleRecord> {
    Ok(SampleRecord {
        sample_id: r.try_get("id")?,
        epoch: r.try_get::<i64, _>("epoch")? as u64,
        status: r.try_get("status")?,
        pathway: r.try_get("pathway")?,
        loss: r.try_get("loss")?,
        sequence_losses: r.try_get("sequence_losses")?,
    })
}

/// A sample of the run with its pathway and loss.
pub async fn sample<'e>(db: impl Db<'e>, run: i64, id: i64) -> sqlx::Result<Option<SampleRecord>> {
    let row = sqlx::query(
        "SELECT s.id, s.epoch, s.status, s.loss, s.sequence_losses,
            coalesce((SELECT array_agg(t.miner ORDER BY t.stage) FROM tasks t
              WHERE t.sample_id = s.id AND t.direction = 'forward' AND t.status = 'done'),
              '{}') AS pathway
         FROM samples s WHERE s.run_id = $1 AND s.id = $2",
    )
    .bind(run)
    .bind(id)
    .fetch_optional(db)
    .await?;
    row.map(|r| sample_from_row(&r)).transpose()
}

/// A page of `epoch`'s samples by id, after `after`.
pub async fn samples_page<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    (after, limit): (i64, i64),
) -> sqlx::Result<Vec<SampleRecord>> {
    let rows = sqlx::query(
        "SELECT s.id, s.epoch, s.status, s.loss, s.sequence_losses,
            coalesce((SELECT array_agg(t.miner ORDER BY t.stage) FROM tasks t
              WHERE t.sample_id = s.id AND t.direction = 'forward' AND t.status = 'done'),
              '{}') AS pathway
         FROM samples s WHERE s.run_id = $1 AND s.epoch = $2 AND s.id > $3 ORDER BY s.id LIMIT $4",
    )
    .bind(run)
    .bind(epoch)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await?;
    rows.iter().map(sample_from_row).collect()
}

/// A partition of an epoch as stored, with its owners and its results' submitters and hashes.
pub struct PartitionRow {
    /// Its stage.
    pub stage: i32,
    /// Its index.
    pub partition: i32,
    /// Its state, as stored.
    pub state: String,
    /// The accepted blob.
    pub accepted: Option<serde_json::Value>,
    /// How it was settled.
    pub resolved_by: Option<String>,
    /// Its owners, by round.
    pub owners: Vec<String>,
    /// Its results (`[{hotkey, blake3}]`), as they came.
    pub results: serde_json::Value,
}

/// Every partition of `epoch`, by stage and partition.
pub async fn partitions<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
) -> sqlx::Result<Vec<PartitionRow>> {
    let rows = sqlx::query(
        "SELECT p.stage, p.partition, p.state, p.accepted, p.resolved_by,
            coalesce((SELECT array_agg(o.miner ORDER BY o.round, o.assigned_at, o.miner)
              FROM partition_owners o WHERE o.run_id = p.run_id AND o.epoch = p.epoch
              AND o.stage = p.stage AND o.partition = p.partition), '{}') AS owners,
            coalesce((SELECT jsonb_agg(jsonb_build_object('hotkey', r.submitter, 'blake3', r.blake3)
              ORDER BY r.submitted_at, r.submitter)
              FROM merge_results r WHERE r.run_id = p.run_id AND r.epoch = p.epoch
              AND r.stage = p.stage AND r.partition = p.partition), '[]'::jsonb) AS results
         FROM partitions p WHERE p.run_id = $1 AND p.epoch = $2 ORDER BY p.stage, p.partition",
    )
    .bind(run)
    .bind(epoch)
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(PartitionRow {
                stage: r.try_get("stage")?,
                partition: r.try_get("partition")?,
                state: r.try_get("state")?,
                accepted: r.try_get("accepted")?,
                resolved_by: r.try_get("resolved_by")?,
                owners: r.try_get("owners")?,
                results: r.try_get("results")?,
            })
        })
        .collect()
}

/// Whether `hotkey` is an active miner of the run.
pub async fn is_active_miner<'e>(db: impl Db<'e>, run: i64, hotkey: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM miners WHERE run_id = $1 AND hotkey = $2
                      AND status = 'active')",
    )
    .bind(run)
    .bind(hotkey)
    .fetch_one(db)
    .await
}

/// Each validator's latest score submission (`$1`: the run), reading one row per validator: the
/// validators one after another from the index (a skip scan), and each one's latest epoch. A
/// `DISTINCT ON` over the table read and sorted every submission of the run, on every request
/// (the dashboard asks every 2 s), and validators can submit for any past epoch.
pub const SCORES_SQL: &str = "WITH RECURSIVE validators AS (
        (SELECT validator FROM validator_scores WHERE run_id = $1 ORDER BY validator LIMIT 1)
        UNION ALL
        SELECT (SELECT s.validator FROM validator_scores s
                WHERE s.run_id = $1 AND s.validator > v.validator
                ORDER BY s.validator LIMIT 1)
        FROM validators v WHERE v.validator IS NOT NULL
    )
    SELECT l.validator, l.epoch, l.scores, l.weights, l.params, l.submitted_at
    FROM validators v CROSS JOIN LATERAL (
        SELECT s.validator, s.epoch, s.scores, s.weights, s.params, s.submitted_at
        FROM validator_scores s
        WHERE s.run_id = $1 AND s.validator = v.validator
        ORDER BY s.epoch DESC LIMIT 1
    ) l
    WHERE v.validator IS NOT NULL
    ORDER BY l.validator";

/// A score submission from a row with `validator`, `epoch`, `scores`, `weights`, `params` and
/// `submitted_at`.
pub fn score_from_row(r: &PgRow) -> RunResult<ScoreRecord> {
    let submitted: DateTime<Utc> = r.try_get("submitted_at")?;
    let weights: Option<serde_json::Value> = r.try_get("weights")?;
    let params: Option<serde_json::Value> = r.try_get("params")?;
    Ok(ScoreRecord {
        validator: r.try_get("validator")?,
        epoch: r.try_get::<i64, _>("epoch")? as u64,
        scores: serde_json::from_value(r.try_get("scores")?)?,
        weights: weights.map(serde_json::from_value).transpose()?,
        params: params.map(serde_json::from_value).transpose()?,
        submitted_ms: submitted.timestamp_millis(),
    })
}

/// Every validator's score submission for `epoch`, by validator.
pub async fn epoch_scores<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
) -> RunResult<Vec<ScoreRecord>> {
    let rows = sqlx::query(
        "SELECT validator, epoch, scores, weights, params, submitted_at FROM validator_scores
         WHERE run_id = $1 AND epoch = $2 ORDER BY validator",
    )
    .bind(run)
    .bind(epoch)
    .fetch_all(db)
    .await?;
    rows.iter().map(score_from_row).collect()
}

/// The latest score submission of every validator.
pub async fn latest_scores<'e>(db: impl Db<'e>, run: i64) -> RunResult<Vec<ScoreRecord>> {
    let rows = sqlx::query(SCORES_SQL).bind(run).fetch_all(db).await?;
    rows.iter().map(score_from_row).collect()
}

/// A page of `epoch`'s hops by id, after `after`.
pub async fn hops_page<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    (after, limit): (i64, i64),
) -> RunResult<Vec<HopRecord>> {
    let rows = sqlx::query(
        "SELECT id, epoch, sample_id, stage, direction, attempt, miner, status, input, output,
                inner_step, weights_digest, created_at, leased_at, completed_at, compute_ms
         FROM tasks WHERE run_id = $1 AND epoch = $2 AND id > $3 ORDER BY id LIMIT $4",
    )
    .bind(run)
    .bind(epoch)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await?;
    let mut hops = Vec::with_capacity(rows.len());
    for r in &rows {
        let direction: String = r.try_get("direction")?;
        let input: Option<serde_json::Value> = r.try_get("input")?;
        let output: Option<serde_json::Value> = r.try_get("output")?;
        let created: DateTime<Utc> = r.try_get("created_at")?;
        let leased: Option<DateTime<Utc>> = r.try_get("leased_at")?;
        let completed: Option<DateTime<Utc>> = r.try_get("completed_at")?;
        hops.push(HopRecord {
            task_id: r.try_get("id")?,
            epoch: r.try_get::<i64, _>("epoch")? as u64,
            sample_id: r.try_get("sample_id")?,
            stage: r.try_get::<i32, _>("stage")? as u32,
            direction: Direction::parse(&direction)
                .ok_or_else(|| RunError::Invalid(format!("bad direction {direction}")))?,
            attempt: r.try_get::<i32, _>("attempt")? as u32,
            miner: r.try_get("miner")?,
            status: r.try_get("status")?,
            input: input.map(serde_json::from_value).transpose()?,
            output: output.map(serde_json::from_value).transpose()?,
            inner_step: r.try_get::<Option<i64>, _>("inner_step")?.map(|v| v as u64),
            weights_digest: r.try_get("weights_digest")?,
            created_ms: created.timestamp_millis(),
            leased_ms: leased.map(|t| t.timestamp_millis()),
            completed_ms: completed.map(|t| t.timestamp_millis()),
            compute_ms: r.try_get::<Option<i64>, _>("compute_ms")?.map(|v| v as u64),
        });
    }
    Ok(hops)
}
