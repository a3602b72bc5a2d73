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

/// The keys of the merges accepted in `epoch`.
pub async fn accepted_in<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT accepted->>'key' FROM partitions
         WHERE run_id = $1 AND epoch = $2 AND state = 'accepted'",
    )
    .bind(run)
    .bind(epoch)
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

/// New partitions of an epoch, column by column (one statement writes them all).
pub struct NewPartitions<'a> {
    /// Stages.
    pub stages: &'a [i32],
    /// Partitions.
    pub partitions: &'a [i32],
    /// States.
    pub states: &'a [&'static str],
    /// Contributions as JSON text.
    pub contributions: &'a [String],
    /// Why each is resolved already, if it is.
    pub resolved_by: &'a [Option<&'static str>],
}

/// Inserts partitions of `epoch` (an existing row is left as it is).
pub async fn insert<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    new: NewPartitions<'_>,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO partitions (run_id, epoch, stage, partition, state, contributions,
             resolved_by)
         SELECT $1, $2, s, p, st, c::jsonb, r
         FROM unnest($3::int4[], $4::int4[], $5::text[], $6::text[], $7::text[])
             AS t(s, p, st, c, r)
         ON CONFLICT DO NOTHING",
    )
    .bind(run)
    .bind(epoch)
    .bind(new.stages)
    .bind(new.partitions)
    .bind(new.states)
    .bind(new.contributions)
    .bind(new.resolved_by)
    .execute(db)
    .await?;
    Ok(())
}

/// Partitions of `epoch` still open (neither settled nor disputed), in order.
pub async fn open<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<Vec<(i32, i32)>> {
    sqlx::query_as(
        "SELECT stage, partition FROM partitions WHERE run_id = $1 AND epoch = $2
           AND state = 'open' ORDER BY stage, partition",
    )
    .bind(run)
    .bind(epoch)
    .fetch_all(db)
    .await
}

/// The open or disputed partitions of `epoch`, (stage, partition) in order.
pub async fn unsettled<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<Vec<(i32, i32)>> {
    sqlx::query_as(
        "SELECT stage, partition FROM partitions WHERE run_id = $1 AND epoch = $2
           AND state IN ('open', 'disputed') ORDER BY stage, partition",
    )
    .bind(run)
    .bind(epoch)
    .fetch_all(db)
    .await
}

/// How many partitions of `epoch` each owner owns.
pub async fn owned_counts<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
) -> sqlx::Result<Vec<(String, i64)>> {
    sqlx::query_as(
        "SELECT miner, count(*) FROM partition_owners WHERE run_id = $1 AND epoch = $2
         GROUP BY miner",
    )
    .bind(run)
    .bind(epoch)
    .fetch_all(db)
    .await
}

/// The owners of the partitions (`stages[i]`, `partitions[i]`) of `epoch`: (stage, partition,
/// miner).
pub async fn owners_of<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    (stages, partitions): (&[i32], &[i32]),
) -> sqlx::Result<Vec<(i32, i32, String)>> {
    sqlx::query_as(
        "SELECT o.stage, o.partition, o.miner FROM partition_owners o
         JOIN unnest($3::int4[], $4::int4[]) AS t(s, p) ON o.stage = t.s AND o.partition = t.p
         WHERE o.run_id = $1 AND o.epoch = $2",
    )
    .bind(run)
    .bind(epoch)
    .bind(stages)
    .bind(partitions)
    .fetch_all(db)
    .await
}

/// Records owners (`stages[i]`, `partitions[i]`, `miners[i]`) of `round`; an existing one is
/// left as it is.
pub async fn insert_owners<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    (stages, partitions, miners): (&[i32], &[i32], &[&str]),
    round: i32,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO partition_owners (run_id, epoch, stage, partition, miner, round)
         SELECT $1, $2, s, p, m, $6
         FROM unnest($3::int4[], $4::int4[], $5::text[]) AS t(s, p, m)
         ON CONFLICT DO NOTHING",
    )
    .bind(run)
    .bind(epoch)
    .bind(stages)
    .bind(partitions)
    .bind(miners)
    .bind(round)
    .execute(db)
    .await?;
    Ok(())
}

/// A partition of a run, by its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartitionKey {
    /// Its epoch.
    pub epoch: i64,
    /// Its stage.
    pub stage: i32,
    /// Its index in the stage.
    pub partition: i32,
}

impl PartitionKey {
    /// The key of partition `partition` of `stage` in `epoch`, as the database stores them
    /// (epochs within `i64` by the API's bounds).
    pub fn new(epoch: u64, stage: u32, partition: u32) -> Self {
        Self {
            epoch: epoch as i64,
            stage: stage as i32,
            partition: partition as i32,
        }
    }
}

/// Moves an open or disputed partition to `state`, with its accepted blob and who settled it
/// (each kept as it was where `None`).
pub async fn set_state<'e>(
    db: impl Db<'e>,
    run: i64,
    key: PartitionKey,
    state: &str,
    (accepted, resolved_by): (Option<serde_json::Value>, Option<&str>),
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE partitions SET state = $5, accepted = coalesce($6, accepted),
             resolved_by = coalesce($7, resolved_by)
         WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4
           AND state IN ('open', 'disputed')",
    )
    .bind(run)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .bind(state)
    .bind(accepted)
    .bind(resolved_by)
    .execute(db)
    .await?;
    Ok(())
}

/// Settlements of unsettled partitions of one epoch, column by column.
pub struct Settlements<'a> {
    /// Stages.
    pub stages: &'a [i32],
    /// Partitions.
    pub partitions: &'a [i32],
    /// New states.
    pub states: &'a [&'a str],
    /// Accepted blobs (kept as they were where `None`).
    pub accepted: &'a [Option<serde_json::Value>],
    /// How each was settled.
    pub how: &'a [&'a str],
}

/// Settles partitions of `epoch` still open or disputed, in one statement.
pub async fn settle_many<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    s: Settlements<'_>,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE partitions p SET state = t.state, accepted = coalesce(t.accepted, p.accepted),
             resolved_by = coalesce(t.how, p.resolved_by)
         FROM unnest($3::int4[], $4::int4[], $5::text[], $6::jsonb[], $7::text[])
             AS t(stage, partition, state, accepted, how)
         WHERE p.run_id = $1 AND p.epoch = $2 AND p.stage = t.stage
           AND p.partition = t.partition AND p.state IN ('open', 'disputed')",
    )
    .bind(run)
    .bind(epoch)
    .bind(s.stages)
    .bind(s.partitions)
    .bind(s.states)
    .bind(s.accepted)
    .bind(s.how)
    .execute(db)
    .await?;
    Ok(())
}

/// Locks a partition's row: its state, if it exists.
pub async fn lock<'e>(
    db: impl Db<'e>,
    run: i64,
    key: PartitionKey,
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "SELECT state FROM partitions WHERE run_id = $1 AND epoch = $2 AND stage = $3
           AND partition = $4 FOR UPDATE",
    )
    .bind(run)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .fetch_optional(db)
    .await
}

/// How many owners a partition was given when merging started (round 0): every one of them
/// must agree for it to be accepted.
pub async fn first_round_owners<'e>(
    db: impl Db<'e>,
    run: i64,
    key: PartitionKey,
) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM partition_owners
         WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4 AND round = 0",
    )
    .bind(run)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .fetch_one(db)
    .await
}

/// A partition's state, if it exists.
pub async fn state<'e>(
    db: impl Db<'e>,
    run: i64,
    key: PartitionKey,
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "SELECT state FROM partitions
         WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4",
    )
    .bind(run)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .fetch_optional(db)
    .await
}

/// The partitions of `epoch` that `miner` owns, unsettled and without a result of its own:
/// (stage, partition, contributions as stored).
pub async fn owned_unmerged<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
    miner: &str,
) -> sqlx::Result<Vec<(i32, i32, serde_json::Value)>> {
    sqlx::query_as(
        "SELECT p.stage, p.partition, p.contributions FROM partition_owners o
         JOIN partitions p ON p.run_id = o.run_id AND p.epoch = o.epoch AND p.stage = o.stage
              AND p.partition = o.partition
         WHERE o.run_id = $1 AND o.epoch = $2 AND o.miner = $3
           AND p.state IN ('open', 'disputed')
           AND NOT EXISTS (SELECT 1 FROM merge_results r WHERE r.run_id = o.run_id
               AND r.epoch = o.epoch AND r.stage = o.stage AND r.partition = o.partition
               AND r.submitter = o.miner)
         ORDER BY p.stage, p.partition",
    )
    .bind(run)
    .bind(epoch)
    .bind(miner)
    .fetch_all(db)
    .await
}

/// The latest accepted merge of a partition (of stage `key.stage`, index `key.partition`) from
/// an epoch before `key.epoch`: what a merge of that epoch starts from.
pub async fn base<'e>(
    db: impl Db<'e>,
    run: i64,
    key: PartitionKey,
) -> sqlx::Result<Option<serde_json::Value>> {
    sqlx::query_scalar(
        "SELECT accepted FROM partitions
         WHERE run_id = $1 AND stage = $2 AND partition = $3 AND epoch < $4 AND state = 'accepted'
         ORDER BY epoch DESC LIMIT 1",
    )
    .bind(run)
    .bind(key.stage)
    .bind(key.partition)
    .bind(key.epoch)
    .fetch_optional(db)
    .await
}

/// Whether `miner` owns a partition.
pub async fn is_owner<'e>(
    db: impl Db<'e>,
    run: i64,
    key: PartitionKey,
    miner: &str,
) -> sqlx::Result<bool> {
    let round: Option<i32> = sqlx::query_scalar(
        "SELECT round FROM partition_owners WHERE run_id = $1 AND epoch = $2 AND stage = $3
           AND partition = $4 AND miner = $5",
    )
    .bind(run)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .bind(miner)
    .fetch_optional(db)
    .await?;
    Ok(round.is_some())
}
