//! Pseudo-gradient uploads, their reservations and merge weights, and recorded objects.

use chrono::{DateTime, Utc};

use super::Db;
use super::partitions::PartitionKey;

/// One stored pseudo-gradient partition: (partition, miner, weight, blob as stored).
pub type Contribution = (i32, String, f64, serde_json::Value);

/// The pseudo-gradients of `stage` in `epoch`, in merge order within each partition (the
/// miners' hotkeys in byte order).
pub async fn contributions_of_stage<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    stage: i32,
) -> sqlx::Result<Vec<Contribution>> {
    sqlx::query_as(
        "SELECT partition, miner, weight, blob FROM pseudo_gradients
         WHERE run_id = $1 AND epoch = $2 AND stage = $3
         ORDER BY partition, miner COLLATE \"C\"",
    )
    .bind(run)
    .bind(epoch)
    .bind(stage)
    .fetch_all(db)
    .await
}

/// `miner`'s completed hops of `epoch` that updated its gradients: every backward hop, and the
/// last stage's (`last_stage`) forward hops.
pub async fn backward_work<'e>(
    db: impl Db<'e>,
    run: i64,
    (epoch, last_stage): (i64, i32),
    miner: &str,
) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM tasks WHERE run_id = $1 AND epoch = $2 AND miner = $3
           AND status = 'done' AND (direction = 'backward' OR stage = $4)",
    )
    .bind(run)
    .bind(epoch)
    .bind(miner)
    .bind(last_stage)
    .fetch_one(db)
    .await
}

/// Whether `miner` ended its work in `epoch` without uploading a pseudo-gradient (it registered
/// from a new process).
pub async fn ended_without_upload<'e>(
    db: impl Db<'e>,
    run: i64,
    miner: &str,
    epoch: i64,
) -> sqlx::Result<bool> {
    let ended: Option<bool> = sqlx::query_scalar(
        "SELECT m.ended_epoch IS NOT DISTINCT FROM $3
             AND NOT EXISTS (SELECT 1 FROM pseudo_gradients g WHERE g.run_id = m.run_id
                               AND g.epoch = $3 AND g.miner = m.hotkey)
         FROM miners m WHERE m.run_id = $1 AND m.hotkey = $2",
    )
    .bind(run)
    .bind(miner)
    .bind(epoch)
    .fetch_optional(db)
    .await?;
    Ok(ended.unwrap_or(false))
}

/// Reserves `miner`'s upload of `epoch` at `at` (an existing reservation is kept).
pub async fn reserve<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    miner: &str,
    at: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO upload_reservations (run_id, epoch, miner, reserved_at)
         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    )
    .bind(run)
    .bind(epoch)
    .bind(miner)
    .bind(at)
    .execute(db)
    .await?;
    Ok(())
}

/// Whether `miner` reserved its upload of `epoch`.
pub async fn is_reserved<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    miner: &str,
) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM upload_reservations
                        WHERE run_id = $1 AND epoch = $2 AND miner = $3)",
    )
    .bind(run)
    .bind(epoch)
    .bind(miner)
    .fetch_one(db)
    .await
}

/// The latest epoch before `epoch` in which `miner` reserved its upload and then uploaded no
/// partition of it, unless it has uploaded a pseudo-gradient since.
pub async fn unused_reservation_before<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    miner: &str,
) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar(
        "SELECT r.epoch FROM upload_reservations r
         WHERE r.run_id = $1 AND r.miner = $3 AND r.epoch < $2
           AND NOT EXISTS (SELECT 1 FROM pseudo_gradients g
                           WHERE g.run_id = $1 AND g.miner = $3
                             AND g.epoch >= r.epoch AND g.epoch < $2)
         ORDER BY r.epoch DESC LIMIT 1",
    )
    .bind(run)
    .bind(epoch)
    .bind(miner)
    .fetch_optional(db)
    .await
}

/// A pseudo-gradient partition to record.
pub struct NewPseudoGradient<'a> {
    /// Its partition.
    pub key: PartitionKey,
    /// Its miner.
    pub miner: &'a str,
    /// Its blob descriptor.
    pub blob: &'a serde_json::Value,
    /// Its hash.
    pub blake3: &'a str,
    /// Its merge weight.
    pub weight: f64,
}

/// Records a pseudo-gradient partition, or keeps the one recorded: the hash recorded.
pub async fn record<'e>(
    db: impl Db<'e>,
    run: i64,
    pg: NewPseudoGradient<'_>,
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "INSERT INTO pseudo_gradients (run_id, epoch, stage, partition, miner, blob, blake3, weight)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
         ON CONFLICT (run_id, epoch, stage, partition, miner) DO UPDATE SET weight = pseudo_gradients.weight
         RETURNING blake3",
    )
    .bind(run)
    .bind(pg.key.epoch)
    .bind(pg.key.stage)
    .bind(pg.key.partition)
    .bind(pg.miner)
    .bind(pg.blob)
    .bind(pg.blake3)
    .bind(pg.weight)
    .fetch_optional(db)
    .await
}

/// The recorded object of `who` for a partition in `table` (a pseudo-gradient by its miner, a
/// merge result by its submitter): its blob and hash.
pub async fn recorded<'e>(
    db: impl Db<'e>,
    run: i64,
    table: super::objects::SealedIn,
    key: PartitionKey,
    who: &str,
) -> sqlx::Result<Option<(serde_json::Value, String)>> {
    let sql = match table {
        super::objects::SealedIn::PseudoGradients => {
            "SELECT blob, blake3 FROM pseudo_gradients
             WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4 AND miner = $5"
        }
        super::objects::SealedIn::MergeResults => {
            "SELECT blob, blake3 FROM merge_results
             WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4 AND submitter = $5"
        }
    };
    sqlx::query_as(sql)
        .bind(run)
        .bind(key.epoch)
        .bind(key.stage)
        .bind(key.partition)
        .bind(who)
        .fetch_optional(db)
        .await
}
