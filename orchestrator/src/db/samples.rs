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

/// Locks sample `id`: its status, if it exists.
pub async fn lock<'e>(db: impl Db<'e>, id: i64) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT status FROM samples WHERE id = $1 FOR UPDATE")
        .bind(id)
        .fetch_optional(db)
        .await
}

/// Records the last stage's loss of sample `id` (the token mean and each sequence's), which
/// turns it backward.
pub async fn record_loss<'e>(
    db: impl Db<'e>,
    id: i64,
    loss: Option<f64>,
    sequence_losses: Option<&[f64]>,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE samples SET loss = $2, sequence_losses = $3, status = 'backward' WHERE id = $1",
    )
    .bind(id)
    .bind(loss)
    .bind(sequence_losses)
    .execute(db)
    .await?;
    Ok(())
}

/// Turns sample `id` backward.
pub async fn set_backward<'e>(db: impl Db<'e>, id: i64) -> sqlx::Result<()> {
    sqlx::query("UPDATE samples SET status = 'backward' WHERE id = $1")
        .bind(id)
        .execute(db)
        .await?;
    Ok(())
}

/// Ends sample `id` as done at `at`.
pub async fn finish<'e>(db: impl Db<'e>, id: i64, at: DateTime<Utc>) -> sqlx::Result<()> {
    sqlx::query("UPDATE samples SET status = 'done', completed_at = $2 WHERE id = $1")
        .bind(id)
        .bind(at)
        .execute(db)
        .await?;
    Ok(())
}
