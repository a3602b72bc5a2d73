//! Phase changes: training to uploading to merging, the merge owners of each round, the next epoch.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use sqlx::{Postgres, Transaction};

use super::merges::settle_at_last_deadline;
use super::owners::PARTITIONS_PER_STATEMENT;
use super::owners::add_owners;
use super::owners::insert_owners;
use crate::app::App;
use crate::db;
use crate::db::locks::phase_lock_exclusive;
use crate::domain::leases::secs;
use crate::domain::merges::OWNERS_PER_PARTITION;
use crate::domain::phases::{PhaseStep, PhaseView, next_step, reservations_hold_until};
use crate::domain::placement::{initial_owners, owner_order};
use crate::error::RunResult;
use crate::samples::{abandon_sample, run_now};
use crate::session_secret::FrozenContributions;

pub(crate) async fn phase_view(app: &App, db: &mut sqlx::PgConnection) -> RunResult<PhaseView> {
    let cfg = app.config();
    let now = run_now(&mut *db, app.run.id).await?;
    let counts = db::epochs::phase_counts(
        &mut *db,
        app.run.id,
        now.epoch as i64,
        cfg.stages as i32 - 1,
        i64::from(cfg.partitions),
    )
    .await?;
    Ok(PhaseView {
        phase: now.phase,
        deadline: now.phase_deadline,
        merge_round: now.merge_round,
        samples_started: counts.samples_started as u64,
        samples_target: cfg.samples_per_epoch,
        samples_in_flight: counts.in_flight as u64,
        uploads_expected: counts.workers as u64 * u64::from(cfg.partitions),
        uploads_received: counts.received as u64,
        partitions_open: counts.open_partitions as u64,
        uploads_reserved: counts.reserved as u64,
        reserved_until: reservations_hold_until(cfg, now.phase_deadline),
    })
}

async fn set_phase(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    phase: Phase,
    now: DateTime<Utc>,
    deadline: DateTime<Utc>,
    merge_round: u32,
) -> RunResult<()> {
    let times = (now, deadline);
    db::runs::set_phase(
        &mut **tx,
        app.run.id,
        phase.as_str(),
        times,
        merge_round as i32,
    )
    .await?;
    Ok(())
}

/// Whether `step` is still the run's next step, decided again under the exclusive phase lock:
/// the view that chose it was read before the lock, and another process (a second leader, for
/// the moment it takes to notice a lost lock connection) may have taken the step meanwhile.
async fn still_next(
    app: &App,
    tx: &mut Transaction<'_, Postgres>,
    now: DateTime<Utc>,
    step: PhaseStep,
) -> RunResult<bool> {
    let view = phase_view(app, tx).await?;
    Ok(next_step(&view, now, app.max_merge_rounds) == step)
}

pub(crate) async fn start_uploading(app: &App, now: DateTime<Utc>) -> RunResult<()> {
    let mut tx = app.db.begin().await?;
    phase_lock_exclusive(&mut tx, app.run.id).await?;
    if !still_next(app, &mut tx, now, PhaseStep::StartUploading).await? {
        return Ok(());
    }
    let cur = run_now(&mut *tx, app.run.id).await?;
    set_phase(
        &mut tx,
        app,
        Phase::Uploading,
        now,
        now + secs(app.config().uploading_s),
        0,
    )
    .await?;
    db::epochs::set_training_ended(&mut *tx, app.run.id, cur.epoch as i64, now).await?;
    tx.commit().await?;
    tracing::info!(epoch = cur.epoch, "phase: uploading");
    Ok(())
}

/// Freezes each partition's contributions (in hotkey order, the fixed merge order) and assigns
/// [`OWNERS_PER_PARTITION`] owners per partition from the stage's active miners, neighbours in an
/// order drawn from the run's secret and the frozen contributions.
pub(crate) async fn start_merging(app: &App, now: DateTime<Utc>) -> RunResult<()> {
    let cfg = app.config().clone();
    let mut tx = app.db.begin().await?;
    phase_lock_exclusive(&mut tx, app.run.id).await?;
    // Decided again under the lock: a reservation taken just before it holds the phase.
    if !still_next(app, &mut tx, now, PhaseStep::StartMerging).await? {
        return Ok(());
    }
    let cur = run_now(&mut *tx, app.run.id).await?;
    let epoch = cur.epoch;
    let all_active = db::miners::active_with_stage(&mut *tx, app.run.id).await?;
    // Written a chunk of partitions per statement, not a few statements per partition: this
    // holds the exclusive phase lock, which every work request waits on.
    let mut chunk = NewPartitions::default();
    for stage in 0..cfg.stages {
        // The stage's contributions in one read (one stage's at a time in memory), in merge
        // order within each partition.
        let rows =
            db::uploads::contributions_of_stage(&mut *tx, app.run.id, epoch as i64, stage as i32);
        let mut contributed: HashMap<i32, Vec<MergeContribution>> = HashMap::new();
        for (partition, hotkey, weight, blob) in rows.await? {
            let blob: BlobDescriptor = serde_json::from_value(blob)?;
            contributed
                .entry(partition)
                .or_default()
                .push(MergeContribution {
                    hotkey,
                    weight,
                    blob,
                });
        }
        // Owners are neighbours in an order drawn from a seed of the run's secret and these
        // frozen contributions: nobody could know it before now, and no miner can compute it.
        let seed = {
            let partitions = (0..cfg.partitions as i32)
                .map(|p| {
                    contributed.get(&p).map_or_else(Vec::new, |c| {
                        c.iter()
                            .map(|c| (c.hotkey.as_str(), c.blob.blake3.as_str()))
                            .collect()
                    })
                })
                .collect();
            let frozen = FrozenContributions {
                epoch,
                stage,
                partitions,
            };
            app.run.session_secret.owner_draw_seed(&frozen)
        };
        // The stage's own miners merge its partitions (they need the result anyway); a stage
        // with too few borrows from the others, drawn by the same seed, so every partition
        // has as many owners as the run can give it.
        let (own, others): (Vec<_>, Vec<_>) = all_active
            .iter()
            .map(|(k, s)| (k.clone(), *s as u32))
            .partition(|(_, s)| *s == stage);
        let mut candidates: Vec<String> = own.into_iter().map(|(k, _)| k).collect();
        let missing = OWNERS_PER_PARTITION.saturating_sub(candidates.len());
        if missing > 0 {
            let others: Vec<String> = others.into_iter().map(|(k, _)| k).collect();
            let borrowed = owner_order(&others, &borrow_seed(&seed));
            candidates.extend(borrowed.into_iter().take(missing));
        }
        let order = owner_order(&candidates, &seed);
        for partition in 0..cfg.partitions {
            let contributions = contributed.remove(&(partition as i32)).unwrap_or_default();
            let owners = match contributions.is_empty() {
                true => Vec::new(),
                false => initial_owners(&order, partition),
            };
            chunk.push(stage, partition, &contributions, owners)?;
            if chunk.stages.len() >= PARTITIONS_PER_STATEMENT
                || chunk.contribution_bytes >= CONTRIBUTION_BYTES_PER_STATEMENT
            {
                chunk.insert(&mut tx, app.run.id, epoch).await?;
            }
        }
    }
    chunk.insert(&mut tx, app.run.id, epoch).await?;
    set_phase(
        &mut tx,
        app,
        Phase::Merging,
        now,
        now + secs(cfg.merging_s),
        0,
    )
    .await?;
    db::epochs::set_uploading_ended(&mut *tx, app.run.id, epoch as i64, now).await?;
    tx.commit().await?;
    tracing::info!(epoch, "phase: merging");
    Ok(())
}

/// The seed that draws a short stage's borrowed owners: another stream than its owner order's.
fn borrow_seed(seed: &[u8; 32]) -> [u8; 32] {
    *blake3::keyed_hash(seed, b"borrowed owners").as_bytes()
}

/// Bytes of contribution lists gathered before they are written (a partition's list grows with
/// its stage's miners: a statement stays a few MB however many there are).
const CONTRIBUTION_BYTES_PER_STATEMENT: usize = 8 << 20;

/// The partitions of an epoch's merge and their first-round owners, gathered to be inserted a
/// chunk at a time (see `start_merging`).
#[derive(Default)]
struct NewPartitions {
    stages: Vec<i32>,
    partitions: Vec<i32>,
    states: Vec<&'static str>,
    /// JSON text, cast to `jsonb` by the statement.
    contributions: Vec<String>,
    contribution_bytes: usize,
    resolved_by: Vec<Option<&'static str>>,
    owners: Vec<(u32, u32, String)>,
}

impl NewPartitions {
    /// Adds a partition: open with its owners when it has contributions, else unchanged.
    fn push(
        &mut self,
        stage: u32,
        partition: u32,
        contributions: &[MergeContribution],
        owners: Vec<String>,
    ) -> RunResult<()> {
        let state = match contributions.is_empty() {
            true => PartitionState::Unchanged,
            false => PartitionState::Open,
        };
        self.stages.push(stage as i32);
        self.partitions.push(partition as i32);
        self.states.push(state.as_str());
        let json = serde_json::to_string(contributions)?;
        self.contribution_bytes += json.len();
        self.contributions.push(json);
        self.resolved_by
            .push((state == PartitionState::Unchanged).then_some("no contributions"));
        self.owners
            .extend(owners.into_iter().map(|owner| (stage, partition, owner)));
        Ok(())
    }

    /// Inserts what was gathered (an existing row is left as it is) and starts afresh.
    async fn insert(
        &mut self,
        tx: &mut Transaction<'_, Postgres>,
        run: i64,
        epoch: u64,
    ) -> RunResult<()> {
        let chunk = std::mem::take(self);
        if !chunk.stages.is_empty() {
            let new = db::partitions::NewPartitions {
                stages: &chunk.stages,
                partitions: &chunk.partitions,
                states: &chunk.states,
                contributions: &chunk.contributions,
                resolved_by: &chunk.resolved_by,
            };
            db::partitions::insert(&mut **tx, run, epoch as i64, new).await?;
        }
        insert_owners(tx, run, epoch, &chunk.owners, 0).await?;
        Ok(())
    }
}

pub(crate) async fn reassign_round(app: &App, now: DateTime<Utc>) -> RunResult<()> {
    let mut tx = app.db.begin().await?;
    phase_lock_exclusive(&mut tx, app.run.id).await?;
    if !still_next(app, &mut tx, now, PhaseStep::ReassignRound).await? {
        return Ok(());
    }
    let cur = run_now(&mut *tx, app.run.id).await?;
    let round = cur.merge_round + 1;
    // An open partition is short of results (an owner vanished): another owner can complete
    // them. A disputed one is not: more owners' results cannot outvote a wrong agreement.
    let open = db::partitions::open(&mut *tx, app.run.id, cur.epoch as i64).await?;
    let open: Vec<(u32, u32)> = open
        .into_iter()
        .map(|(s, p)| (s as u32, p as u32))
        .collect();
    let given = add_owners(&mut tx, app, cur.epoch, &open, round).await?;
    // Validators are asked too: a partition unsettled at a deadline (its owners vanished, or
    // only one submitted) is put to them as a dispute, which a validator settles with its own
    // merge, so it is merged even when no miner is left to do it. (A disputed partition has one
    // already; an owners' agreement settles it as usual.)
    let asked = db::disputes::open_for_unsettled(&mut *tx, app.run.id, cur.epoch as i64).await?;
    if asked > 0 {
        metrics::counter!("iota_disputes_opened_total").increment(asked);
    }
    set_phase(
        &mut tx,
        app,
        Phase::Merging,
        cur.phase_started,
        now + secs(app.config().merge_round_s),
        round,
    )
    .await?;
    tx.commit().await?;
    tracing::warn!(
        epoch = cur.epoch,
        round,
        open = open.len(),
        given_another_owner = given,
        "merge deadline passed; partitions reassigned"
    );
    Ok(())
}

/// Ends the epoch: partitions still unsettled keep their weights (nothing unverified is
/// adopted), travelling samples are closed, the next epoch starts.
pub(crate) async fn next_epoch(app: &App, now: DateTime<Utc>) -> RunResult<()> {
    let mut tx = app.db.begin().await?;
    phase_lock_exclusive(&mut tx, app.run.id).await?;
    if !still_next(app, &mut tx, now, PhaseStep::NextEpoch).await? {
        return Ok(());
    }
    let cur = run_now(&mut *tx, app.run.id).await?;
    let epoch = cur.epoch;
    settle_at_last_deadline(&mut tx, app, epoch).await?;
    // Disputes still open are closed with whatever the partition ended with, so that they leave
    // the validators' list and a late settlement is refused rather than recorded against weights
    // the next epoch did not start from.
    db::disputes::close_at_deadline(&mut *tx, app.run.id, epoch as i64).await?;
    // Every open hop of the epoch before any sample or the epoch's row (see `abandon_sample`):
    // abandoning sample by sample took the epoch's row with the first, and then waited for a
    // later sample's hop that a completion held while it waited for that row.
    db::hops::lock_open_of_epoch(&mut *tx, app.run.id, epoch as i64).await?;
    let leftover = db::samples::in_flight(&mut *tx, app.run.id, epoch as i64).await?;
    for id in leftover {
        abandon_sample(&mut tx, id, now, "epoch ended").await?;
    }
    // The epoch's samples are final now: its mean loss is stored once, for `GET /v1/loss`.
    db::epochs::end(&mut *tx, app.run.id, epoch as i64, now).await?;
    db::runs::set_epoch(&mut *tx, app.run.id, epoch as i64 + 1).await?;
    db::epochs::start(&mut *tx, app.run.id, epoch as i64 + 1, now).await?;
    set_phase(
        &mut tx,
        app,
        Phase::Training,
        now,
        now + secs(app.config().training_s),
        0,
    )
    .await?;
    tx.commit().await?;
    metrics::counter!("iota_epochs_completed_total").increment(1);
    tracing::info!(epoch = epoch + 1, "phase: training (new epoch)");
    Ok(())
}
