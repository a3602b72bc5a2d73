//! Disputes: partitions put to the validators.

use sqlx::Row;

use super::Db;
use super::partitions::PartitionKey;

/// Opens a dispute for every open partition of `epoch` without one: how many were opened.
pub async fn open_for_unsettled<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<u64> {
    Ok(sqlx::query(
        "INSERT INTO disputes (run_id, epoch, stage, partition, state)
         SELECT run_id, epoch, stage, partition, 'open' FROM partitions
         WHERE run_id = $1 AND epoch = $2 AND state = 'open'
         ON CONFLICT DO NOTHING",
    )
    .bind(run)
    .bind(epoch)
    .execute(db)
    .await?
    .rows_affected())
}

/// Closes `epoch`'s open disputes with whatever their partition ended with.
pub async fn close_at_deadline<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<()> {
    // The partition looked up by its key for each dispute: as a join, a plan made before the
    // tables had statistics compared every dispute with every partition (1.1 s at 3,000 each).
    sqlx::query(
        "UPDATE disputes d SET state = 'settled', settled_by = 'deadline',
             settled_hash = (SELECT p.accepted->>'blake3' FROM partitions p
                 WHERE p.run_id = d.run_id AND p.epoch = d.epoch AND p.stage = d.stage
                   AND p.partition = d.partition)
         WHERE d.run_id = $1 AND d.epoch = $2 AND d.state = 'open'",
    )
    .bind(run)
    .bind(epoch)
    .execute(db)
    .await?;
    Ok(())
}

/// Settles a partition's open dispute (opened when a round's deadline found it unsettled) by its
/// owners' agreement on `hash`.
pub async fn settle_by_agreement<'e>(
    db: impl Db<'e>,
    run: i64,
    key: PartitionKey,
    hash: &str,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE disputes SET state = 'settled', settled_by = 'agreement', settled_hash = $5
         WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4 AND state = 'open'",
    )
    .bind(run)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .bind(hash)
    .execute(db)
    .await?;
    Ok(())
}

/// Opens a dispute on a partition unless it has one: whether it was opened.
pub async fn open<'e>(db: impl Db<'e>, run: i64, key: PartitionKey) -> sqlx::Result<bool> {
    let opened = sqlx::query(
        "INSERT INTO disputes (run_id, epoch, stage, partition, state)
         VALUES ($1, $2, $3, $4, 'open') ON CONFLICT DO NOTHING",
    )
    .bind(run)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .execute(db)
    .await?;
    Ok(opened.rows_affected() > 0)
}

/// Locks the partition of dispute `id` (before the dispute's row: the order a merge submission
/// takes them in).
pub async fn lock_partition_of<'e>(db: impl Db<'e>, run: i64, id: i64) -> sqlx::Result<()> {
    sqlx::query(
        "SELECT 1 FROM partitions p JOIN disputes d USING (run_id, epoch, stage, partition)
         WHERE d.id = $1 AND d.run_id = $2 FOR UPDATE OF p",
    )
    .bind(id)
    .bind(run)
    .execute(db)
    .await?;
    Ok(())
}

/// A dispute as stored.
pub struct Dispute {
    /// Its partition.
    pub key: PartitionKey,
    /// `open` or `settled`.
    pub state: String,
    /// The hash it was settled with.
    pub settled_hash: Option<String>,
    /// Who settled it (`agreement`, `deadline`, `validator:<hotkey>`).
    pub settled_by: Option<String>,
}

/// Locks dispute `id` of the run: the dispute, if it exists.
pub async fn lock<'e>(db: impl Db<'e>, run: i64, id: i64) -> sqlx::Result<Option<Dispute>> {
    let row = sqlx::query(
        "SELECT epoch, stage, partition, state, settled_hash, settled_by FROM disputes
         WHERE id = $1 AND run_id = $2 FOR UPDATE",
    )
    .bind(id)
    .bind(run)
    .fetch_optional(db)
    .await?;
    row.map(|row| {
        Ok(Dispute {
            key: PartitionKey {
                epoch: row.try_get("epoch")?,
                stage: row.try_get("stage")?,
                partition: row.try_get("partition")?,
            },
            state: row.try_get("state")?,
            settled_hash: row.try_get("settled_hash")?,
            settled_by: row.try_get("settled_by")?,
        })
    })
    .transpose()
}

/// Settles dispute `id` with `hash`, by `by`.
pub async fn settle<'e>(db: impl Db<'e>, id: i64, by: &str, hash: &str) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE disputes SET state = 'settled', settled_by = $2, settled_hash = $3 WHERE id = $1",
    )
    .bind(id)
    .bind(by)
    .bind(hash)
    .execute(db)
    .await?;
    Ok(())
}

/// Records `validator`'s vote of `hash` on dispute `id` (a retry of the same vote changes
/// nothing): the hash it had voted before, if another.
pub async fn vote<'e>(
    db: impl Db<'e>,
    id: i64,
    validator: &str,
    hash: &str,
    at: chrono::DateTime<chrono::Utc>,
) -> sqlx::Result<Option<String>> {
    let stored: String = sqlx::query_scalar(
        "INSERT INTO dispute_votes (dispute_id, validator, blake3, voted_at)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (dispute_id, validator) DO UPDATE SET blake3 = dispute_votes.blake3
         RETURNING blake3",
    )
    .bind(id)
    .bind(validator)
    .bind(hash)
    .bind(at)
    .fetch_one(db)
    .await?;
    Ok((stored != hash).then_some(stored))
}

/// Every vote on dispute `id`: (validator, hash), in the order they came.
pub async fn votes<'e>(db: impl Db<'e>, id: i64) -> sqlx::Result<Vec<(String, String)>> {
    sqlx::query_as(
        "SELECT validator, blake3 FROM dispute_votes WHERE dispute_id = $1
         ORDER BY voted_at, validator",
    )
    .bind(id)
    .fetch_all(db)
    .await
}
