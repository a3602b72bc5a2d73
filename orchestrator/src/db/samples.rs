//! A sample's row.

use chrono::{DateTime, Utc};

use super::Db;

/// Ends a sample still in flight as abandoned at `now`: its run and epoch, or `None` if it had
/// already ended.
pub async fn abandon<'e>(
    db: impl Db<'e>,
    sample: i64,
    now: DateTime<Utc>,
) -> sqlx::Result<Option<(i64, i64)>> {
    sqlx::query_as(
        "UPDATE samples SET status = 'abandoned', completed_at = $2
         WHERE id = $1 AND status IN ('forward', 'backward') RETURNING run_id, epoch",
    )
    .bind(sample)
    .bind(now)
    .fetch_optional(db)
    .await
}

/// The samples of `epoch` still travelling.
pub async fn in_flight<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar(
        "SELECT id FROM samples WHERE run_id = $1 AND epoch = $2 AND status IN ('forward', 'backward')",
    )
    .bind(run)
    .bind(epoch)
    .fetch_all(db)
    .await
}
