//! Merged partitions: their owners' results and the collection of old ones.

use super::Db;

/// The key of each partition's latest accepted merge before `before`, not yet collected: what
/// the oldest kept epoch starts from.
pub async fn latest_accepted_before<'e>(
    db: impl Db<'e>,
    run: i64,
    before: i64,
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT DISTINCT ON (stage, partition) accepted->>'key' FROM partitions
         WHERE run_id = $1 AND state = 'accepted' AND NOT collected AND epoch < $2
         ORDER BY stage, partition, epoch DESC",
    )
    .bind(run)
    .bind(before)
    .fetch_all(db)
    .await
}

/// Accepted merges before `before`, not yet collected, whose key is not in `kept`: (epoch,
/// stage, partition, key).
pub async fn accepted_not_kept<'e>(
    db: impl Db<'e>,
    run: i64,
    before: i64,
    kept: &[String],
) -> sqlx::Result<Vec<(i64, i32, i32, String)>> {
    sqlx::query_as(
        "SELECT epoch, stage, partition, accepted->>'key' FROM partitions
         WHERE run_id = $1 AND state = 'accepted' AND NOT collected AND epoch < $2
           AND NOT (accepted->>'key' = ANY($3))",
    )
    .bind(run)
    .bind(before)
    .bind(kept)
    .fetch_all(db)
    .await
}

/// Marks a partition's accepted merge collected.
pub async fn mark_collected<'e>(
    db: impl Db<'e>,
    run: i64,
    (epoch, stage, partition): (i64, i32, i32),
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE partitions SET collected = true
         WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4",
    )
    .bind(run)
    .bind(epoch)
    .bind(stage)
    .bind(partition)
    .execute(db)
    .await?;
    Ok(())
}

/// The open or disputed partitions of `epoch` that one of `miners` owns and has not submitted a
/// result for: (stage, partition).
pub async fn unsubmitted_of<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    miners: &[String],
) -> sqlx::Result<Vec<(i32, i32)>> {
    sqlx::query_as(
        "SELECT o.stage, o.partition FROM partition_owners o
         JOIN partitions p USING (run_id, epoch, stage, partition)
         WHERE o.run_id = $1 AND o.epoch = $2 AND o.miner = ANY($3)
           AND p.state IN ('open', 'disputed')
           AND NOT EXISTS (SELECT 1 FROM merge_results r WHERE r.run_id = o.run_id
               AND r.epoch = o.epoch AND r.stage = o.stage AND r.partition = o.partition
               AND r.submitter = o.miner)",
    )
    .bind(run)
    .bind(epoch)
    .bind(miners)
    .fetch_all(db)
    .await
}
