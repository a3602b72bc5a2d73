//! Merge results: what owners and validators submitted for each partition.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};

use super::Db;
use super::partitions::PartitionKey;

/// The results that count, by partition, in the order they came: one per hotkey, its first (a
/// hotkey that submitted both as an owner and through the validator route is one vote), of the
/// partitions of run `$1` and epoch `$2` that `partitions` picks (a condition on `merge_results
/// r` and `partitions p`). Rows: stage, partition, blake3, blob, submitter.
fn votes_sql(partitions: &str) -> String {
    let voter = "coalesce(substring(r.submitter FROM '^validator:(.*)$'), r.submitter)";
    format!(
        "SELECT stage, partition, blake3, blob, submitter FROM (
           SELECT DISTINCT ON (r.stage, r.partition, {voter})
             r.stage, r.partition, r.blake3, r.blob, r.submitted_at, r.submitter
           FROM merge_results r JOIN partitions p USING (run_id, epoch, stage, partition)
           WHERE r.run_id = $1 AND r.epoch = $2 AND {partitions}
           ORDER BY r.stage, r.partition, {voter}, r.submitted_at, r.submitter) votes
         ORDER BY stage, partition, submitted_at, submitter"
    )
}

/// [`votes_sql`] for one partition: stage `$3`, partition `$4`.
static VOTES_SQL: LazyLock<String> =
    LazyLock::new(|| votes_sql("r.stage = $3 AND r.partition = $4"));

/// [`votes_sql`] for every partition still open or disputed, counted by partition.
static OPEN_VOTE_COUNTS_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT stage, partition, count(*) FROM ({}) open GROUP BY stage, partition",
        votes_sql("p.state IN ('open', 'disputed')")
    )
});

/// A vote: (stage, partition, blake3, blob, submitter).
pub type Vote = (i32, i32, String, serde_json::Value, String);

/// The votes on one partition, in the order they came.
pub async fn votes<'e>(db: impl Db<'e>, run: i64, key: PartitionKey) -> sqlx::Result<Vec<Vote>> {
    sqlx::query_as(VOTES_SQL.as_str())
        .bind(run)
        .bind(key.epoch)
        .bind(key.stage)
        .bind(key.partition)
        .fetch_all(db)
        .await
}

/// How many votes each unsettled partition of `epoch` has: (stage, partition, votes), for the
/// partitions with any.
pub async fn open_vote_counts<'e>(
    db: impl Db<'e>,
    run: i64,
    epoch: i64,
) -> sqlx::Result<Vec<(i32, i32, i64)>> {
    sqlx::query_as(OPEN_VOTE_COUNTS_SQL.as_str())
        .bind(run)
        .bind(epoch)
        .fetch_all(db)
        .await
}

/// A merge result to record.
pub struct NewResult<'a> {
    /// Who submitted it (a hotkey, or `validator:<hotkey>`).
    pub submitter: &'a str,
    /// Its blob descriptor.
    pub blob: &'a serde_json::Value,
    /// Its hash.
    pub blake3: &'a str,
    /// When it came.
    pub at: DateTime<Utc>,
}

/// Records a result, or keeps the submitter's earlier one: the hash recorded.
pub async fn record<'e>(
    db: impl Db<'e>,
    run: i64,
    key: PartitionKey,
    result: NewResult<'_>,
) -> sqlx::Result<String> {
    sqlx::query_scalar(
        "INSERT INTO merge_results (run_id, epoch, stage, partition, submitter, blob, blake3,
             submitted_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
         ON CONFLICT (run_id, epoch, stage, partition, submitter)
         DO UPDATE SET submitter = merge_results.submitter RETURNING blake3",
    )
    .bind(run)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .bind(result.submitter)
    .bind(result.blob)
    .bind(result.blake3)
    .bind(result.at)
    .fetch_one(db)
    .await
}

/// The first submitted result of a partition with hash `blake3`: its blob.
pub async fn first_with_hash<'e>(
    db: impl Db<'e>,
    run: i64,
    key: PartitionKey,
    blake3: &str,
) -> sqlx::Result<Option<serde_json::Value>> {
    sqlx::query_scalar(
        "SELECT blob FROM merge_results WHERE run_id = $1 AND epoch = $2 AND stage = $3
           AND partition = $4 AND blake3 = $5 ORDER BY submitted_at LIMIT 1",
    )
    .bind(run)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .bind(blake3)
    .fetch_optional(db)
    .await
}

/// Whether `hotkey` has a stake in a partition's outcome: it owns the partition, submitted a
/// result for it as a miner, or is an active miner of the run (see `driver::has_stake`).
pub async fn has_stake<'e>(
    db: impl Db<'e>,
    run: i64,
    hotkey: &str,
    key: PartitionKey,
) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM partition_owners WHERE run_id = $1 AND epoch = $2
                          AND stage = $3 AND partition = $4 AND miner = $5)
             OR EXISTS (SELECT 1 FROM merge_results WHERE run_id = $1 AND epoch = $2
                          AND stage = $3 AND partition = $4 AND submitter = $5)
             OR EXISTS (SELECT 1 FROM miners WHERE run_id = $1 AND hotkey = $5
                          AND status = 'active')",
    )
    .bind(run)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .bind(hotkey)
    .fetch_one(db)
    .await
}
