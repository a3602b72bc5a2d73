//! Merge verdicts: partitions settled by agreement, at the last deadline, or by a validator's dispute.

use std::collections::HashMap;

use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use sqlx::{Postgres, Transaction};

use super::owners::PARTITIONS_PER_STATEMENT;
use crate::app::App;
use crate::db;
use crate::db::locks::phase_lock_shared;
use crate::db::merges::NewResult;
use crate::db::partitions::PartitionKey;
use crate::domain::merges::{
    Submitted, Verdict, quorum, results_required, unsettled_at_last_deadline, verdict,
};
use crate::error::{RunError, RunResult};
use crate::objects::{SealedIn, delete_unless_recorded};
use crate::samples::{RunNow, run_now};

/// Moves an open or disputed partition to `state`, with its accepted blob and who settled it.
async fn set_partition(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    key: PartitionKey,
    state: PartitionState,
    accepted: Option<serde_json::Value>,
    resolved_by: Option<&str>,
) -> RunResult<()> {
    let settled = (accepted, resolved_by);
    db::partitions::set_state(&mut **tx, app.run.id, key, state.as_str(), settled).await?;
    Ok(())
}

/// At the last merge deadline every partition still unsettled keeps its weights: `unmerged`
/// when nobody merged it, `unverified` when results came that nobody verified (a lone result, or
/// disagreeing ones no validator settled); see [`unsettled_at_last_deadline`]. Two reads (the
/// results counted, not fetched) and an update a chunk at a time, however many are open: this
/// holds the exclusive phase lock.
pub(crate) async fn settle_at_last_deadline(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    epoch: u64,
) -> RunResult<()> {
    let open = db::partitions::unsettled(&mut **tx, app.run.id, epoch as i64).await?;
    if open.is_empty() {
        return Ok(());
    }
    let results: HashMap<(i32, i32), usize> =
        db::merges::open_vote_counts(&mut **tx, app.run.id, epoch as i64)
            .await?
            .into_iter()
            .map(|(stage, partition, n)| ((stage, partition), n.max(0) as usize))
            .collect();
    let settled: Vec<(i32, i32, &'static str)> = open
        .into_iter()
        .map(|(stage, partition)| {
            let submitted = results.get(&(stage, partition)).copied().unwrap_or(0);
            (stage, partition, unsettled_at_last_deadline(submitted))
        })
        .collect();
    for chunk in settled.chunks(PARTITIONS_PER_STATEMENT) {
        let stages: Vec<i32> = chunk.iter().map(|(s, _, _)| *s).collect();
        let partitions: Vec<i32> = chunk.iter().map(|(_, p, _)| *p).collect();
        let states = vec![PartitionState::Unchanged.as_str(); chunk.len()];
        let accepted: Vec<Option<serde_json::Value>> = vec![None; chunk.len()];
        let how: Vec<&str> = chunk.iter().map(|(_, _, how)| *how).collect();
        let settlements = db::partitions::Settlements {
            stages: &stages,
            partitions: &partitions,
            states: &states,
            accepted: &accepted,
            how: &how,
        };
        db::partitions::settle_many(&mut **tx, app.run.id, epoch as i64, settlements).await?;
    }
    let first = |how: &str| -> Vec<(i32, i32)> {
        settled
            .iter()
            .filter(|(_, _, h)| *h == how)
            .map(|(s, p, _)| (*s, *p))
            .take(8)
            .collect()
    };
    for how in ["unmerged", "unverified"] {
        let count = settled.iter().filter(|(_, _, h)| *h == how).count();
        if count > 0 {
            tracing::error!(
                epoch,
                count,
                how,
                first = ?first(how),
                "partitions unsettled at the last deadline keep their weights (stage, partition)"
            );
        }
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
    let key = PartitionKey {
        epoch,
        stage,
        partition,
    };
    db::merges::has_stake(conn, run_id, hotkey, key).await
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
    let key = PartitionKey::new(epoch, stage, partition);
    let state = db::partitions::lock(&mut *tx, app.run.id, key)
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
    let result = NewResult {
        submitter,
        blob: &value,
        blake3: &blob.blake3,
        at: app.now(),
    };
    let stored = db::merges::record(&mut *tx, app.run.id, key, result).await?;
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
    let key = PartitionKey::new(epoch, stage, partition);
    let rows = db::merges::votes(&mut **tx, app.run.id, key).await?;
    let submitted: Vec<Submitted> = rows
        .iter()
        .map(|(_, _, hash, _, submitter)| Submitted {
            hash: hash.clone(),
            by_owner: !submitter.starts_with("validator:"),
        })
        .collect();
    let first_owners = db::partitions::first_round_owners(&mut **tx, app.run.id, key).await?;
    match verdict(&submitted, results_required(first_owners.max(0) as usize)) {
        Verdict::Pending => {}
        Verdict::Accept { hash } => {
            let blob = rows
                .into_iter()
                .find(|(_, _, h, _, _)| *h == hash)
                .map(|(_, _, _, b, _)| b);
            let how = Some("agreement");
            set_partition(tx, app, key, PartitionState::Accepted, blob, how).await?;
            db::disputes::settle_by_agreement(&mut **tx, app.run.id, key, &hash).await?;
            metrics::counter!("iota_partitions_accepted_total").increment(1);
        }
        Verdict::Dispute => {
            // No owner is added: whatever it submitted, a majority of owners proves nothing (two
            // colluders outvote the honest one). The validators recompute it.
            set_partition(tx, app, key, PartitionState::Disputed, None, None).await?;
            if db::disputes::open(&mut **tx, app.run.id, key).await? {
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

/// The subnet's validator permit holders and their stake, from the metagraph as last read.
fn permit_holders(app: &App) -> Vec<(String, u64)> {
    let index = app.metagraph.borrow();
    index
        .members()
        .iter()
        .filter(|m| m.validator_permit)
        .map(|m| (m.hotkey.ss58(), m.stake))
        .collect()
}

/// A validator's recomputed hash is its vote on a dispute; once the voters of one hash hold more
/// than half the stake of the subnet's permit holders ([`quorum`]), the submitted result that
/// matches it is accepted. A hash that matches no result settles nothing (the validator submits its own merge
/// first); neither does one that comes after the epoch's merges closed, when the dispute was
/// closed by the deadline.
pub async fn settle_dispute(app: &App, validator: &str, id: i64, hash: &str) -> RunResult<()> {
    let mut tx = app.db.begin().await?;
    phase_lock_shared(&mut tx, app.run.id).await?;
    // The partition's row first, then the dispute's: the order a merge submission takes them
    // (it settles the partition's dispute when owners agree), so the two never deadlock.
    db::disputes::lock_partition_of(&mut *tx, app.run.id, id).await?;
    let dispute = db::disputes::lock(&mut *tx, app.run.id, id)
        .await?
        .ok_or_else(|| RunError::refused(ErrorCode::NotFound, format!("no dispute {id}")))?;
    let key = dispute.key;
    let (epoch, stage, partition) = (key.epoch, key.stage, key.partition);
    if db::merges::has_stake(&mut *tx, app.run.id, validator, key).await? {
        return Err(interested_validator(stage, partition));
    }
    if dispute.settled_by.as_deref() == Some("deadline") {
        // Closed with the epoch, by nobody's settlement: a late one is told so, whatever its
        // hash (had it named the partition's result, a 200 would say it had settled it).
        return Err(RunError::refused(
            ErrorCode::WrongPhase,
            format!("epoch {epoch}'s merges are closed: dispute {id} closed with them"),
        ));
    }
    if dispute.state == "settled" {
        // A retry of the settlement is answered as the first was; another hash is not.
        return match dispute.settled_hash {
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
    let Some(blob) = db::merges::first_with_hash(&mut *tx, app.run.id, key, hash).await? else {
        return Err(RunError::refused(
            ErrorCode::Conflict,
            format!(
                "no merge of {stage}/{partition} has hash {hash}: submit it \
                 (PUT /v1/validator/epochs/{epoch}/merges/{stage}/{partition}) and settle again"
            ),
        ));
    };
    // A vote, weighed by the stake of the permit holders: the dispute settles once the
    // voters of one hash hold more than half of it.
    if let Some(earlier) = db::disputes::vote(&mut *tx, id, validator, hash, app.now()).await? {
        return Err(RunError::refused(
            ErrorCode::Conflict,
            format!("you voted {earlier} on dispute {id} already"),
        ));
    }
    let votes = db::disputes::votes(&mut *tx, id).await?;
    let holders = permit_holders(app);
    if quorum(&votes, &holders) != Some(hash) {
        tx.commit().await?;
        tracing::info!(dispute = id, %validator, %hash, votes = votes.len(),
            "dispute vote recorded; no stake majority yet");
        return Ok(());
    }
    let by = format!("validator:{validator}");
    db::disputes::settle(&mut *tx, id, &by, hash).await?;
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
