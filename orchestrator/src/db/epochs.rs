//! Each epoch's row: its counters and whether its objects were collected.

use chrono::{DateTime, Utc};

use super::Db;

/// Counts one more abandoned sample in `epoch`.
pub async fn count_abandoned<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE epochs SET samples_abandoned = samples_abandoned + 1
         WHERE run_id = $1 AND epoch = $2",
    )
    .bind(run)
    .bind(epoch)
    .execute(db)
    .await?;
    Ok(())
}

/// Epochs before `before` whose objects are not collected yet and that ended by `ended_by`,
/// oldest first.
pub async fn uncollected<'e>(
    db: impl Db<'e>,
    run: i64,
    before: i64,
    ended_by: DateTime<Utc>,
) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar(
        "SELECT epoch FROM epochs WHERE run_id = $1 AND epoch < $2 AND NOT gc_done
           AND (ended_at IS NULL OR ended_at <= $3)
         ORDER BY epoch",
    )
    .bind(run)
    .bind(before)
    .bind(ended_by)
    .fetch_all(db)
    .await
}

/// Marks `epoch`'s objects collected.
pub async fn mark_collected<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<()> {
    sqlx::query("UPDATE epochs SET gc_done = true WHERE run_id = $1 AND epoch = $2")
        .bind(run)
        .bind(epoch)
        .execute(db)
        .await?;
    Ok(())
}
