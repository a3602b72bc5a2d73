//! What validators read of an epoch and what they submit: work, pseudo-gradients, disputes,
//! scores, spot checks.

use chrono::{DateTime, Utc};
use iota_protocol::api::*;
use sqlx::Row;

use super::Db;
use super::partitions::PartitionKey;
use crate::error::RunResult;

/// Each miner's hops in `epoch`, with the stage it worked in.
pub async fn epoch_work<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<Vec<MinerWork>> {
    sqlx::query(
        // The stage a miner worked in that epoch, not the one it is in now (a miner moves to a
        // stage left empty): its pseudo-gradient's, else its last hop's.
        "SELECT t.miner,
            coalesce(
              (SELECT g.stage FROM pseudo_gradients g
                WHERE g.run_id = $1 AND g.epoch = $2 AND g.miner = t.miner LIMIT 1),
              (array_agg(t.stage ORDER BY t.completed_at DESC NULLS LAST, t.id DESC))[1]) AS stage,
            count(*) FILTER (WHERE t.direction = 'forward' AND t.status = 'done') AS fwd,
            count(*) FILTER (WHERE t.direction = 'backward' AND t.status = 'done') AS bwd,
            count(*) FILTER (WHERE t.status IN ('expired', 'failed')) AS failed
         FROM tasks t
         WHERE t.run_id = $1 AND t.epoch = $2 GROUP BY t.miner ORDER BY stage, t.miner",
    )
    .bind(run)
    .bind(epoch)
    .fetch_all(db)
    .await?
    .iter()
    .map(|r| {
        Ok(MinerWork {
            hotkey: r.try_get("miner")?,
            stage: r.try_get::<i32, _>("stage")? as u32,
            forward_done: r.try_get::<i64, _>("fwd")? as u64,
            backward_done: r.try_get::<i64, _>("bwd")? as u64,
            failed: r.try_get::<i64, _>("failed")? as u64,
        })
    })
    .collect()
}

/// The pseudo-gradients uploaded in `epoch`.
pub async fn epoch_pseudo_gradients<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
) -> RunResult<Vec<PseudoGradientRecord>> {
    sqlx::query(
        "SELECT stage, partition, miner, blob, weight FROM pseudo_gradients
         WHERE run_id = $1 AND epoch = $2 ORDER BY stage, partition, miner",
    )
    .bind(run)
    .bind(epoch)
    .fetch_all(db)
    .await?
    .iter()
    .map(|r| {
        Ok(PseudoGradientRecord {
            epoch: epoch as u64,
            stage: r.try_get::<i32, _>("stage")? as u32,
            partition: r.try_get::<i32, _>("partition")? as u32,
            hotkey: r.try_get("miner")?,
            blob: serde_json::from_value(r.try_get("blob")?)?,
            weight: r.try_get("weight")?,
        })
    })
    .collect()
}

/// An open dispute with its partition's contributions (as stored).
pub struct OpenDispute {
    /// Its id.
    pub id: i64,
    /// Its partition.
    pub key: PartitionKey,
    /// Its state.
    pub state: String,
    /// The partition's contributions.
    pub contributions: serde_json::Value,
}

/// The run's open disputes, by id.
pub async fn open_disputes<'e>(db: impl Db<'e>, run: i64) -> sqlx::Result<Vec<OpenDispute>> {
    let rows = sqlx::query(
        "SELECT d.id, d.epoch, d.stage, d.partition, d.state, p.contributions FROM disputes d
         JOIN partitions p USING (run_id, epoch, stage, partition)
         WHERE d.run_id = $1 AND d.state = 'open' ORDER BY d.id",
    )
    .bind(run)
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(OpenDispute {
                id: r.try_get("id")?,
                key: PartitionKey {
                    epoch: r.try_get("epoch")?,
                    stage: r.try_get("stage")?,
                    partition: r.try_get("partition")?,
                },
                state: r.try_get("state")?,
                contributions: r.try_get("contributions")?,
            })
        })
        .collect()
}

/// The partition of dispute `id`.
pub async fn dispute_partition<'e>(db: impl Db<'e>, id: i64) -> sqlx::Result<PartitionKey> {
    let (epoch, stage, partition): (i64, i32, i32) =
        sqlx::query_as("SELECT epoch, stage, partition FROM disputes WHERE id = $1")
            .bind(id)
            .fetch_one(db)
            .await?;
    Ok(PartitionKey {
        epoch,
        stage,
        partition,
    })
}

/// A validator's scores for an epoch, as JSON.
pub struct NewScores {
    /// The validator.
    pub validator: String,
    /// The epoch.
    pub epoch: i64,
    /// Its scores.
    pub scores: serde_json::Value,
    /// The weights they produced.
    pub weights: Option<serde_json::Value>,
    /// The settings they were scored with.
    pub params: Option<serde_json::Value>,
    /// When they came.
    pub at: DateTime<Utc>,
}

/// Stores a validator's scores for an epoch, replacing an earlier submission: the record.
pub async fn store_scores<'e>(db: impl Db<'e>, run: i64, new: NewScores) -> RunResult<ScoreRecord> {
    let row = sqlx::query(
        "INSERT INTO validator_scores
             (run_id, epoch, validator, scores, weights, params, submitted_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (run_id, epoch, validator)
         DO UPDATE SET scores = EXCLUDED.scores, weights = EXCLUDED.weights,
           params = EXCLUDED.params, submitted_at = EXCLUDED.submitted_at
         RETURNING validator, epoch, scores, weights, params, submitted_at",
    )
    .bind(run)
    .bind(new.epoch)
    .bind(&new.validator)
    .bind(&new.scores)
    .bind(&new.weights)
    .bind(&new.params)
    .bind(new.at)
    .fetch_one(db)
    .await?;
    super::views::score_from_row(&row)
}

/// The miners with work in `epoch` (from its hops and pseudo-gradients, not every miner that
/// ever joined), a page of them by hotkey after `after`.
pub async fn workers_page<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    (after, limit): (Option<&str>, i64),
) -> sqlx::Result<Vec<SpotCheckCandidate>> {
    let rows = sqlx::query(
        "WITH workers AS (
             SELECT miner FROM tasks WHERE run_id = $1 AND epoch = $2 AND status = 'done'
               AND ($3::text IS NULL OR miner > $3)
             UNION
             SELECT miner FROM pseudo_gradients WHERE run_id = $1 AND epoch = $2
               AND ($3::text IS NULL OR miner > $3)
         ), page AS (SELECT miner FROM workers ORDER BY miner LIMIT $4)
         SELECT p.miner AS hotkey, w.stage,
            -- Its hops of that stage only: a miner moved mid-epoch started the new stage
            -- afresh, and a replay of both stages' hops on one would fail it.
            coalesce((SELECT array_agg(t.id ORDER BY t.completed_at, t.id) FROM tasks t
              WHERE t.run_id = $1 AND t.epoch = $2 AND t.miner = p.miner
                AND t.status = 'done' AND t.stage = w.stage), '{}') AS hops,
            coalesce((SELECT array_agg(g.partition ORDER BY g.partition) FROM pseudo_gradients g
              WHERE g.run_id = $1 AND g.epoch = $2 AND g.miner = p.miner), '{}') AS pgs
         FROM page p
         -- The stage it worked in that epoch, not the one it is in now (a miner moves to a
         -- stage left empty): its pseudo-gradient's, else its last hop's.
         CROSS JOIN LATERAL (SELECT coalesce(
              (SELECT g.stage FROM pseudo_gradients g
                WHERE g.run_id = $1 AND g.epoch = $2 AND g.miner = p.miner LIMIT 1),
              (SELECT t.stage FROM tasks t
                WHERE t.run_id = $1 AND t.epoch = $2 AND t.miner = p.miner AND t.status = 'done'
                ORDER BY t.completed_at DESC, t.id DESC LIMIT 1)) AS stage) w
         ORDER BY p.miner",
    )
    .bind(run)
    .bind(epoch)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|r| {
            let pgs: Vec<i32> = r.try_get("pgs")?;
            Ok(SpotCheckCandidate {
                hotkey: r.try_get("hotkey")?,
                stage: r.try_get::<i32, _>("stage")? as u32,
                hop_task_ids: r.try_get("hops")?,
                pseudo_gradient_partitions: pgs.into_iter().map(|p| p as u32).collect(),
            })
        })
        .collect()
}

/// What validators reported checking in `epoch`.
pub async fn reported_checks<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
) -> RunResult<Vec<SpotCheckReport>> {
    sqlx::query(
        "SELECT validator, seed, seed_block, checks FROM spot_checks
         WHERE run_id = $1 AND epoch = $2 ORDER BY validator",
    )
    .bind(run)
    .bind(epoch)
    .fetch_all(db)
    .await?
    .iter()
    .map(|r| {
        Ok(SpotCheckReport {
            validator: r.try_get("validator")?,
            seed: r.try_get("seed")?,
            seed_block: r.try_get::<i64, _>("seed_block")? as u64,
            checks: serde_json::from_value(r.try_get("checks")?)?,
        })
    })
    .collect()
}

/// Stores a validator's spot-check report for `epoch` (its checks as JSON), replacing an
/// earlier one.
pub async fn store_spot_checks<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    report: &SpotCheckReport,
    (checks, at): (serde_json::Value, DateTime<Utc>),
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO spot_checks (run_id, epoch, validator, seed, seed_block, checks, submitted_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (run_id, epoch, validator) DO UPDATE SET seed = EXCLUDED.seed,
           seed_block = EXCLUDED.seed_block, checks = EXCLUDED.checks,
           submitted_at = EXCLUDED.submitted_at",
    )
    .bind(run)
    .bind(epoch)
    .bind(&report.validator)
    .bind(&report.seed)
    .bind(report.seed_block as i64)
    .bind(checks)
    .bind(at)
    .execute(db)
    .await?;
    Ok(())
}
