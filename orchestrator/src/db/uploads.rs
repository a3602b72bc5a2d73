//! Pseudo-gradient uploads and their reservations.

use super::Db;

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
