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
