//! Garbage collection: objects of epochs past the run's retention, keeping what a kept epoch starts from.

use chrono::{DateTime, Utc};

use crate::app::App;
use crate::db;
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
    let old = db::epochs::uncollected(&app.db, app.run.id, oldest_kept, now - grace).await?;
    // The kept epochs move on only as the run does, which leaves an epoch to collect.
    if old.is_empty() {
        return Ok(());
    }
    // A sparse run's weights are every accepted update applied in turn: its accepted merges
    // are the run's history, small, and never collected (the other owners' copies are).
    let sparse = app.run.config.sparse.is_some();
    // A partition's latest merge before the oldest kept epoch is never marked collected.
    let bases = db::partitions::latest_accepted_before(&app.db, app.run.id, oldest_kept).await?;
    let kept: std::collections::HashSet<&String> = bases.iter().collect();
    for epoch in old {
        let base = format!("runs/{}/epoch-{epoch}", app.run.id);
        let mut removed = 0;
        removed += app.store.delete_prefix(&format!("{base}/samples")).await?;
        removed += app
            .store
            .delete_prefix(&format!("{base}/pseudo-gradients"))
            .await?;
        let accepted = if sparse {
            db::partitions::accepted_in(&app.db, app.run.id, epoch).await?
        } else {
            Vec::new()
        };
        let kept_here = |key: &String| {
            if sparse {
                accepted.contains(key)
            } else {
                kept.contains(&key)
            }
        };
        for key in app.store.list(&format!("{base}/merged")).await? {
            if !kept_here(&key) {
                app.store.delete(&key).await?;
                removed += 1;
            }
        }
        db::epochs::mark_collected(&app.db, app.run.id, epoch).await?;
        tracing::info!(epoch, removed, "objects of an old epoch collected");
    }
    // Accepted merges of collected epochs that were kept as a base and are one no longer (the
    // partition was merged again since): their epoch's collection passed them by.
    if sparse {
        return Ok(());
    }
    let superseded =
        db::partitions::accepted_not_kept(&app.db, app.run.id, oldest_kept, &bases).await?;
    for (epoch, stage, partition, key) in superseded {
        app.store.delete(&key).await?;
        db::partitions::mark_collected(&app.db, app.run.id, (epoch, stage, partition)).await?;
    }
    Ok(())
}
