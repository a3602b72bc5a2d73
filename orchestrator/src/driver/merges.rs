//! Merge verdicts: partitions settled by agreement, at the last deadline, or by a validator's dispute.

use std::collections::HashMap;
use std::sync::LazyLock;

use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use sqlx::{Postgres, Row, Transaction};

use super::locks::phase_lock_shared;
use super::owners::PARTITIONS_PER_STATEMENT;
use super::owners::add_owner;
use crate::app::App;
use crate::domain::merges::{Verdict, final_pick, verdict};
use crate::error::{RunError, RunResult};
use crate::objects::{SealedIn, delete_unless_recorded};
use crate::samples::{RunNow, run_now};

/// A partition of the current run, by its key.
#[derive(Clone, Copy)]
struct PartitionKey {
    epoch: i64,
    stage: i32,
    partition: i32,
}

/// Moves an open or disputed partition to `state`, with its accepted blob and who settled it.
async fn set_partition(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    key: PartitionKey,
    state: PartitionState,
    accepted: Option<serde_json::Value>,
    resolved_by: Option<&str>,
) -> RunResult<()> {
    sqlx::query(
        "UPDATE partitions SET state = $5, accepted = coalesce($6, accepted),
             resolved_by = coalesce($7, resolved_by)
         WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4
           AND state IN ('open', 'disputed')",
    )
    .bind(app.run.id)
    .bind(key.epoch)
    .bind(key.stage)
    .bind(key.partition)
    .bind(state.as_str())
    .bind(accepted)
    .bind(resolved_by)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The results that count, by partition, in the order they came: one per hotkey, its first (a
/// hotkey that submitted both as an owner and through the validator route is one vote), of the
/// partitions of run `$1` and epoch `$2` that `partitions` picks (a condition on `merge_results
/// r` and `partitions p`). Rows: stage, partition, blake3, blob.
fn votes_sql(partitions: &str) -> String {
    let voter = "coalesce(substring(r.submitter FROM '^validator:(.*)$'), r.submitter)";
    format!(
        "SELECT stage, partition, blake3, blob FROM (
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

/// [`votes_sql`] for every partition still open or disputed.
static OPEN_VOTES_SQL: LazyLock<String> =
    LazyLock::new(|| votes_sql("p.state IN ('open', 'disputed')"));

/// At the last merge deadline every partition still unsettled takes its most-submitted result
/// (`single` or `plurality`), or keeps its weights when nobody merged it (`unmerged`). Two reads
/// and an update a chunk at a time, however many are open: this holds the exclusive phase lock.
pub(crate) async fn settle_at_last_deadline(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    epoch: u64,
) -> RunResult<()> {
    let open: Vec<(i32, i32)> = sqlx::query_as(
        "SELECT stage, partition FROM partitions WHERE run_id = $1 AND epoch = $2
           AND state IN ('open', 'disputed') ORDER BY stage, partition",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .fetch_all(&mut **tx)
    .await?;
    if open.is_empty() {
        return Ok(());
    }
    let mut votes: HashMap<(i32, i32), Vec<(String, serde_json::Value)>> = HashMap::new();
    let rows: Vec<(i32, i32, String, serde_json::Value)> = sqlx::query_as(OPEN_VOTES_SQL.as_str())
        .bind(app.run.id)
        .bind(epoch as i64)
        .fetch_all(&mut **tx)
        .await?;
    for (stage, partition, hash, blob) in rows {
        votes
            .entry((stage, partition))
            .or_default()
            .push((hash, blob));
    }
    let mut unmerged = Vec::new();
    let mut settled = Vec::with_capacity(open.len());
    for (stage, partition) in open {
        let results = votes.remove(&(stage, partition)).unwrap_or_default();
        let hashes: Vec<String> = results.iter().map(|(h, _)| h.clone()).collect();
        let outcome = match final_pick(&hashes) {
            Some(hash) => {
                let how = match results.len() {
                    1 => "single",
                    _ => "plurality",
                };
                let blob = results
                    .into_iter()
                    .find(|(h, _)| *h == hash)
                    .map(|(_, b)| b);
                (PartitionState::Accepted, blob, how)
            }
            None => {
                unmerged.push((stage, partition));
                (PartitionState::Unchanged, None, "unmerged")
            }
        };
        settled.push((stage, partition, outcome));
    }
    for chunk in settled.chunks(PARTITIONS_PER_STATEMENT) {
        let stages: Vec<i32> = chunk.iter().map(|(s, _, _)| *s).collect();
        let partitions: Vec<i32> = chunk.iter().map(|(_, p, _)| *p).collect();
        let states: Vec<&str> = chunk.iter().map(|(_, _, o)| o.0.as_str()).collect();
        let accepted: Vec<Option<serde_json::Value>> =
            chunk.iter().map(|(_, _, o)| o.1.clone()).collect();
        let how: Vec<&str> = chunk.iter().map(|(_, _, o)| o.2).collect();
        sqlx::query(
            "UPDATE partitions p SET state = t.state, accepted = coalesce(t.accepted, p.accepted),
                 resolved_by = coalesce(t.how, p.resolved_by)
             FROM unnest($3::int4[], $4::int4[], $5::text[], $6::jsonb[], $7::text[])
                 AS t(stage, partition, state, accepted, how)
             WHERE p.run_id = $1 AND p.epoch = $2 AND p.stage = t.stage
               AND p.partition = t.partition AND p.state IN ('open', 'disputed')",
        )
        .bind(app.run.id)
        .bind(epoch as i64)
        .bind(&stages)
        .bind(&partitions)
        .bind(&states)
        .bind(&accepted)
        .bind(&how)
        .execute(&mut **tx)
        .await?;
    }
    if !unmerged.is_empty() {
        tracing::error!(
            epoch,
            count = unmerged.len(),
            first = ?&unmerged[..unmerged.len().min(8)],
            "no merge result by the last deadline; weights unchanged (stage, partition)"
        );
    }
    Ok(())
}

/// Whether `hotkey` has a stake in a partition's outcome: it owns the partition, submitted a
/// result for it as a miner, or is an active miner of the run, of any stage: any miner may be made
/// an owner of any partition (a stage short of miners borrows them, and a reassignment takes
/// whoever has the fewest partitions), so one that could read a partition's results first could
/// then copy another owner's.
/// A hotkey with a validator permit may also have joined as a miner; with a stake it does not
/// judge the partition as a validator: it neither reads its results before it is settled, nor
/// merges it through the validator route, nor settles its dispute.
pub(crate) async fn has_stake(
    conn: impl sqlx::PgExecutor<'_>,
    run_id: i64,
    hotkey: &str,
    (epoch, stage, partition): (i64, i32, i32),
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM partition_owners WHERE run_id = $1 AND epoch = $2
                          AND stage = $3 AND partition = $4 AND miner = $5)
             OR EXISTS (SELECT 1 FROM merge_results WHERE run_id = $1 AND epoch = $2
                          AND stage = $3 AND partition = $4 AND submitter = $5)
             OR EXISTS (SELECT 1 FROM miners WHERE run_id = $1 AND hotkey = $5
                          AND status = 'active')",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(stage)
    .bind(partition)
    .bind(hotkey)
    .fetch_one(conn)
    .await
}

/// The refusal of a validator with a stake in the partition (see [`has_stake`]).
pub(crate) fn interested_validator(
    stage: impl std::fmt::Display,
    partition: impl std::fmt::Display,
) -> RunError {
    RunError::refused(
        ErrorCode::Forbidden,
        format!(
            "you own or merged partition {stage}/{partition}, or mine in this run (any miner \
             may be made an owner of any partition), so you cannot judge it as a validator"
        ),
    )
}

/// Records a merge result (an owner's or a validator's) and settles the partition when results
/// agree. Atomic with phase changes, like pseudo-gradient uploads.
pub async fn record_merge_result(
    app: &App,
    submitter: &str,
    epoch: u64,
    stage: u32,
    partition: u32,
    blob: BlobDescriptor,
) -> RunResult<UploadResponse> {
    let mut tx = app.db.begin().await?;
    phase_lock_shared(&mut tx, app.run.id).await?;
    let cur = run_now(&mut *tx, app.run.id).await?;
    if cur.epoch != epoch || cur.phase != Phase::Merging {
        drop(tx);
        delete_unless_recorded(app, SealedIn::MergeResults, &blob.key).await?;
        return Err(RunError::refused(
            ErrorCode::WrongPhase,
            "the merging phase ended while this result was in flight",
        ));
    }
    let state: String = sqlx::query_scalar(
        "SELECT state FROM partitions WHERE run_id = $1 AND epoch = $2 AND stage = $3
           AND partition = $4 FOR UPDATE",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(stage as i32)
    .bind(partition as i32)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| RunError::refused(ErrorCode::NotFound, "no such partition this epoch"))?;
    // Under the partition's lock, which owner changes take too.
    if let Some(validator) = submitter.strip_prefix("validator:") {
        let slot = (epoch as i64, stage as i32, partition as i32);
        if has_stake(&mut *tx, app.run.id, validator, slot).await? {
            drop(tx);
            delete_unless_recorded(app, SealedIn::MergeResults, &blob.key).await?;
            return Err(interested_validator(stage, partition));
        }
    }
    let value = serde_json::to_value(&blob)?;
    let stored: String = sqlx::query_scalar(
        "INSERT INTO merge_results (run_id, epoch, stage, partition, submitter, blob, blake3,
             submitted_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
         ON CONFLICT (run_id, epoch, stage, partition, submitter)
         DO UPDATE SET submitter = merge_results.submitter RETURNING blake3",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(stage as i32)
    .bind(partition as i32)
    .bind(submitter)
    .bind(&value)
    .bind(&blob.blake3)
    .bind(app.now())
    .fetch_one(&mut *tx)
    .await?;
    if stored != blob.blake3 {
        drop(tx);
        // Sealed under its own hash, so not the recorded result's key.
        app.store.delete(&blob.key).await?;
        return Err(RunError::refused(
            ErrorCode::Conflict,
            "you already submitted a different result for this partition",
        ));
    }
    if state == "open" || state == "disputed" {
        settle(&mut tx, app, &cur, stage, partition).await?;
    }
    tx.commit().await?;
    Ok(UploadResponse { blob })
}

async fn settle(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    cur: &RunNow,
    stage: u32,
    partition: u32,
) -> RunResult<()> {
    let epoch = cur.epoch;
    let key = PartitionKey {
        epoch: epoch as i64,
        stage: stage as i32,
        partition: partition as i32,
    };
    let rows: Vec<(i32, i32, String, serde_json::Value)> = sqlx::query_as(VOTES_SQL.as_str())
        .bind(app.run.id)
        .bind(epoch as i64)
        .bind(stage as i32)
        .bind(partition as i32)
        .fetch_all(&mut **tx)
        .await?;
    let results: Vec<(String, serde_json::Value)> =
        rows.into_iter().map(|(_, _, h, b)| (h, b)).collect();
    let hashes: Vec<String> = results.iter().map(|(h, _)| h.clone()).collect();
    match verdict(&hashes) {
        Verdict::Pending => {}
        Verdict::Accept { hash, unanimous } => {
            let blob = results
                .iter()
                .find(|(h, _)| *h == hash)
                .map(|(_, b)| b.clone());
            let how = if unanimous { "agreement" } else { "majority" };
            set_partition(tx, app, key, PartitionState::Accepted, blob, Some(how)).await?;
            sqlx::query(
                "UPDATE disputes SET state = 'settled', settled_by = 'majority', settled_hash = $5
                 WHERE run_id = $1 AND epoch = $2 AND stage = $3 AND partition = $4 AND state = 'open'",
            )
            .bind(app.run.id)
            .bind(epoch as i64)
            .bind(stage as i32)
            .bind(partition as i32)
            .bind(&hash)
            .execute(&mut **tx)
            .await?;
            metrics::counter!("iota_partitions_accepted_total").increment(1);
        }
        Verdict::Dispute => {
            set_partition(tx, app, key, PartitionState::Disputed, None, None).await?;
            let opened = sqlx::query(
                "INSERT INTO disputes (run_id, epoch, stage, partition, state)
                 VALUES ($1, $2, $3, $4, 'open') ON CONFLICT DO NOTHING",
            )
            .bind(app.run.id)
            .bind(epoch as i64)
            .bind(stage as i32)
            .bind(partition as i32)
            .execute(&mut **tx)
            .await?;
            // One tie-break owner per disagreement: an active owner with no result yet is
            // already working on it. Released owners do not count (one released and replaced
            // left more owners than results, and no tie-break until the deadline).
            let working: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM partition_owners o
                 JOIN miners m ON m.run_id = o.run_id AND m.hotkey = o.miner AND m.status = 'active'
                 WHERE o.run_id = $1 AND o.epoch = $2 AND o.stage = $3 AND o.partition = $4
                   AND NOT EXISTS (SELECT 1 FROM merge_results r WHERE r.run_id = o.run_id
                       AND r.epoch = o.epoch AND r.stage = o.stage AND r.partition = o.partition
                       AND r.submitter = o.miner)",
            )
            .bind(app.run.id)
            .bind(epoch as i64)
            .bind(stage as i32)
            .bind(partition as i32)
            .fetch_one(&mut **tx)
            .await?;
            if working == 0 {
                add_owner(tx, app, epoch, stage, partition, cur.merge_round).await?;
            }
            if opened.rows_affected() > 0 {
                metrics::counter!("iota_disputes_opened_total").increment(1);
                tracing::warn!(
                    epoch,
                    stage,
                    partition,
                    "merge results disagree; dispute opened"
                );
            }
        }
    }
    Ok(())
}

/// A validator's recomputed hash settles a dispute: the submitted result that matches it is
/// accepted. A hash that matches no result settles nothing (the validator submits its own merge
/// first); neither does one that comes after the epoch's merges closed, when the dispute was
/// closed by the deadline.
pub async fn settle_dispute(app: &App, validator: &str, id: i64, hash: &str) -> RunResult<()> {
    let mut tx = app.db.begin().await?;
    phase_lock_shared(&mut tx, app.run.id).await?;
    // The partition's row first, then the dispute's: the order a merge submission takes them
    // (it settles the partition's dispute when owners agree), so the two never deadlock.
    sqlx::query(
        "SELECT 1 FROM partitions p JOIN disputes d USING (run_id, epoch, stage, partition)
         WHERE d.id = $1 AND d.run_id = $2 FOR UPDATE OF p",
    )
    .bind(id)
    .bind(app.run.id)
    .execute(&mut *tx)
    .await?;
    let row = sqlx::query(
        "SELECT epoch, stage, partition, state, settled_hash, settled_by FROM disputes
         WHERE id = $1 AND run_id = $2 FOR UPDATE",
    )
    .bind(id)
    .bind(app.run.id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| RunError::refused(ErrorCode::NotFound, format!("no dispute {id}")))?;
    let epoch: i64 = row.try_get("epoch")?;
    let stage: i32 = row.try_get("stage")?;
    let partition: i32 = row.try_get("partition")?;
    let state: String = row.try_get("state")?;
    let settled_hash: Option<String> = row.try_get("settled_hash")?;
    if has_stake(&mut *tx, app.run.id, validator, (epoch, stage, partition)).await? {
        return Err(interested_validator(stage, partition));
    }
    let settled_by: Option<String> = row.try_get("settled_by")?;
    if settled_by.as_deref() == Some("deadline") {
        // Closed with the epoch, by nobody's settlement: a late one is told so, whatever its
        // hash (had it named the partition's result, a 200 would say it had settled it).
        return Err(RunError::refused(
            ErrorCode::WrongPhase,
            format!("epoch {epoch}'s merges are closed: dispute {id} closed with them"),
        ));
    }
    if state == "settled" {
        // A retry of the settlement is answered as the first was; another hash is not.
        return match settled_hash {
            Some(h) if h == hash => Ok(()),
            settled => Err(RunError::refused(
                ErrorCode::Conflict,
                format!(
                    "dispute {id} is already settled ({})",
                    settled.as_deref().unwrap_or("unmerged")
                ),
            )),
        };
    }
    let cur = run_now(&mut *tx, app.run.id).await?;
    if cur.epoch != epoch as u64 || cur.phase != Phase::Merging {
        return Err(RunError::refused(
            ErrorCode::WrongPhase,
            format!("epoch {epoch}'s merges are closed"),
        ));
    }
    let blob: Option<serde_json::Value> = sqlx::query_scalar(
        "SELECT blob FROM merge_results WHERE run_id = $1 AND epoch = $2 AND stage = $3
           AND partition = $4 AND blake3 = $5 ORDER BY submitted_at LIMIT 1",
    )
    .bind(app.run.id)
    .bind(epoch)
    .bind(stage)
    .bind(partition)
    .bind(hash)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(blob) = blob else {
        return Err(RunError::refused(
            ErrorCode::Conflict,
            format!(
                "no merge of {stage}/{partition} has hash {hash}: submit it \
                 (PUT /v1/validator/epochs/{epoch}/merges/{stage}/{partition}) and settle again"
            ),
        ));
    };
    let by = format!("validator:{validator}");
    sqlx::query(
        "UPDATE disputes SET state = 'settled', settled_by = $2, settled_hash = $3 WHERE id = $1",
    )
    .bind(id)
    .bind(&by)
    .bind(hash)
    .execute(&mut *tx)
    .await?;
    let key = PartitionKey {
        epoch,
        stage,
        partition,
    };
    set_partition(
        &mut tx,
        app,
        key,
        PartitionState::Accepted,
        Some(blob),
        Some(&by),
    )
    .await?;
    tx.commit().await?;
    tracing::info!(dispute = id, %validator, %hash, "dispute settled");
    Ok(())
}
