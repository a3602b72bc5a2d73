//! Garbage collection: objects of epochs past the run's retention, keeping what a kept epoch starts from.

use chrono::{DateTime, Utc};

use crate::app::App;
use crate::error::RunResult;
use crate::samples::run_now;

/// Deletes the objects of epochs older than the retention window, keeping the merged partitions
/// that an epoch still kept starts from (for each partition, the latest accepted before the
/// oldest kept epoch: those are also the latest weights of a partition not merged since).
///
/// An epoch is collected only once no presigned URL for its keys can still be used (they are
/// handed out only while it runs, see [`crate::BlobStore::upload_grace`]): a PUT landing after
/// its collection would stay in the bucket for good.
pub async fn collect_garbage(app: &App, now: DateTime<Utc>) -> RunResult<()> {
    let cur = run_now(&app.db, app.run.id).await?;
    let keep = app.config().retention_epochs.max(1);
    if cur.epoch < keep {
        return Ok(());
    }
    let oldest_kept = (cur.epoch - keep) as i64;
    let grace = chrono::Duration::from_std(app.store.upload_grace())
        .unwrap_or_else(|_| chrono::Duration::days(7));
    let old: Vec<i64> = sqlx::query_scalar(
        "SELECT epoch FROM epochs WHERE run_id = $1 AND epoch < $2 AND NOT gc_done
           AND (ended_at IS NULL OR ended_at <= $3)
         ORDER BY epoch",
    )
    .bind(app.run.id)
    .bind(oldest_kept)
    .bind(now - grace)
    .fetch_all(&app.db)
    .await?;
    // The kept epochs move on only as the run does, which leaves an epoch to collect.
    if old.is_empty() {
        return Ok(());
    }
    // A partition's latest merge before the oldest kept epoch is never marked collected.
    let bases: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT ON (stage, partition) accepted->>'key' FROM partitions
         WHERE run_id = $1 AND state = 'accepted' AND NOT collected AND epoch < $2
         ORDER BY stage, partition, epoch DESC",
    )
    .bind(app.run.id)
    .bind(oldest_kept)
    .fetch_all(&app.db)
    .await?;
    let kept: std::collections::HashSet<&String> = bases.iter().collect();
    for epoch in old {
        let base = format!("runs/{}/epoch-{epoch}", app.run.id);
        let mut removed = 0;
        removed += app.store.delete_prefix(&format!("{base}/samples")).await?;
        removed += app
            .store
            .delete_prefix(&format!("{base}/pseudo-gradients"))
            .await?;
        for key in app.store.list(&format!("{base}/merged")).await? {
            if !kept.contains(&key) {
                app.store.delete(&key).await?;
                removed += 1;
            }
        }
        sqlx::query("UPDATE epochs SET gc_done = true WHERE run_id = $1 AND epoch = $2")
            .bind(app.run.id)
            .bind(epoch)
            .execute(&app.db)
            .await?;
        tracing::info!(epoch, removed, "objects of an old epoch collected");
    }
    // Accepted merges of collected epochs that were kept as a base and are one no longer (the
    // partition was merged again since): their epoch's collection passed them by.
    let superseded: Vec<(i64, i32, i32, String)> = sqlx::query_as(
        "SELECT epoch, stage, partition, accepted->>'key' FROM partitions
         WHERE run_id = $1 AND state = 'accepted' AND NOT collected AND epoch < $2
           AND NOT (accepted->>'key' = ANY($3))",
    )
    .bind(app.run.id)
    .bind(oldest_kept)
    .bind(&bases)
    .fetch_all(&app.db)
    .await?;
    for (epoch, stage, partition, key) in superseded {
        app.store.delete(&key).await?;
        sqlx::query(
            "UPDATE partitions SET collected = true
             WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4",
        )
        .bind(app.run.id)
        .bind(epoch)
        .bind(stage)
        .bind(partition)
        .execute(&app.db)
        .await?;
    }
    Ok(())
}
