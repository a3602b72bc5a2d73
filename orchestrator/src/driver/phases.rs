//! Phase changes: training to uploading to merging, the merge owners of each round, the next epoch.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use sqlx::{Postgres, Row, Transaction};

use super::locks::phase_lock_exclusive;
use super::merges::settle_at_last_deadline;
use super::owners::PARTITIONS_PER_STATEMENT;
use super::owners::add_owners;
use super::owners::insert_owners;
use crate::app::App;
use crate::domain::leases::secs;
use crate::domain::phases::{PhaseStep, PhaseView, next_step, reservations_hold_until};
use crate::domain::placement::initial_owners;
use crate::error::RunResult;
use crate::samples::{abandon_sample, run_now};

pub(crate) async fn phase_view(app: &App, db: &mut sqlx::PgConnection) -> RunResult<PhaseView> {
    let cfg = app.config();
    let now = run_now(&mut *db, app.run.id).await?;
    let row = sqlx::query(
        "WITH workers AS (
            SELECT DISTINCT t.miner FROM tasks t JOIN miners m
              ON m.run_id = t.run_id AND m.hotkey = t.miner AND m.status = 'active'
            WHERE t.run_id = $1 AND t.epoch = $2 AND t.status = 'done'
              AND (t.direction = 'backward' OR t.stage = $3)
              -- Not a miner that restarted after working: it will upload nothing.
              AND (m.ended_epoch IS DISTINCT FROM $2
                   OR EXISTS (SELECT 1 FROM pseudo_gradients g WHERE g.run_id = $1
                              AND g.epoch = $2 AND g.miner = m.hotkey)))
         SELECT e.samples_started,
            (SELECT count(*) FROM samples s WHERE s.run_id = $1 AND s.epoch = $2
               AND s.status IN ('forward', 'backward')) AS in_flight,
            (SELECT count(*) FROM workers) AS workers,
            -- The workers' uploads only: one whose gradient work was failed afterwards (a bad
            -- object it produced) is no longer expected, and its uploads must not stand in for
            -- a worker's that has not arrived.
            (SELECT count(*) FROM pseudo_gradients g
             WHERE g.run_id = $1 AND g.epoch = $2
               AND g.miner IN (SELECT miner FROM workers)) AS received,
            (SELECT count(*) FROM partitions p WHERE p.run_id = $1 AND p.epoch = $2
               AND p.state IN ('open', 'disputed')) AS open_partitions,
            -- Reserved uploads not yet complete, of miners still active.
            (SELECT count(*) FROM upload_reservations r JOIN miners m
               ON m.run_id = r.run_id AND m.hotkey = r.miner AND m.status = 'active'
             WHERE r.run_id = $1 AND r.epoch = $2
               AND (SELECT count(*) FROM pseudo_gradients g WHERE g.run_id = $1
                      AND g.epoch = $2 AND g.miner = r.miner) < $4
               -- Not a miner that restarted after working: its uploads are refused.
               AND (m.ended_epoch IS DISTINCT FROM $2
                    OR EXISTS (SELECT 1 FROM pseudo_gradients g WHERE g.run_id = $1
                               AND g.epoch = $2 AND g.miner = m.hotkey))) AS reserved
         FROM epochs e WHERE e.run_id = $1 AND e.epoch = $2",
    )
    .bind(app.run.id)
    .bind(now.epoch as i64)
    .bind(cfg.stages as i32 - 1)
    .bind(i64::from(cfg.partitions))
    .fetch_one(&mut *db)
    .await?;
    let workers: i64 = row.try_get("workers")?;
    Ok(PhaseView {
        phase: now.phase,
        deadline: now.phase_deadline,
        merge_round: now.merge_round,
        samples_started: row.try_get::<i64, _>("samples_started")? as u64,
        samples_target: cfg.samples_per_epoch,
        samples_in_flight: row.try_get::<i64, _>("in_flight")? as u64,
        uploads_expected: workers as u64 * u64::from(cfg.partitions),
        uploads_received: row.try_get::<i64, _>("received")? as u64,
        partitions_open: row.try_get::<i64, _>("open_partitions")? as u64,
        uploads_reserved: row.try_get::<i64, _>("reserved")? as u64,
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
    sqlx::query(
        "UPDATE runs SET phase = $2, phase_started = $3, phase_deadline = $4, merge_round = $5
         WHERE id = $1",
    )
    .bind(app.run.id)
    .bind(phase.as_str())
    .bind(now)
    .bind(deadline)
    .bind(merge_round as i32)
    .execute(&mut **tx)
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
    sqlx::query("UPDATE epochs SET training_ended_at = $3 WHERE run_id = $1 AND epoch = $2")
        .bind(app.run.id)
        .bind(cur.epoch as i64)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    tracing::info!(epoch = cur.epoch, "phase: uploading");
    Ok(())
}

/// Freezes each partition's contributions (in hotkey order, the fixed merge order) and assigns
/// two owners per partition from the stage's active miners.
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
    let all_active: Vec<(String, i32)> = sqlx::query_as(
        "SELECT hotkey, stage FROM miners WHERE run_id = $1 AND status = 'active' ORDER BY hotkey",
    )
    .bind(app.run.id)
    .fetch_all(&mut *tx)
    .await?;
    // Written a chunk of partitions per statement, not a few statements per partition: this
    // holds the exclusive phase lock, which every work request waits on.
    let mut chunk = NewPartitions::default();
    for stage in 0..cfg.stages {
        // The stage's own miners merge its partitions (they need the result anyway); a stage
        // with fewer than two borrows from the others so every partition has two owners.
        let mut candidates: Vec<String> = all_active
            .iter()
            .filter(|(_, s)| *s as u32 == stage)
            .map(|(k, _)| k.clone())
            .collect();
        if candidates.len() < 2 {
            candidates.extend(
                all_active
                    .iter()
                    .filter(|(_, s)| *s as u32 != stage)
                    .map(|(k, _)| k.clone())
                    .take(2 - candidates.len()),
            );
        }
        // The stage's contributions in one read (one stage's at a time in memory), in merge
        // order within each partition.
        let rows = sqlx::query(
            "SELECT partition, miner, weight, blob FROM pseudo_gradients
             WHERE run_id = $1 AND epoch = $2 AND stage = $3
             ORDER BY partition, miner COLLATE \"C\"",
        )
        .bind(app.run.id)
        .bind(epoch as i64)
        .bind(stage as i32)
        .fetch_all(&mut *tx)
        .await?;
        let mut contributed: HashMap<i32, Vec<MergeContribution>> = HashMap::new();
        for r in &rows {
            let blob: BlobDescriptor = serde_json::from_value(r.try_get("blob")?)?;
            contributed
                .entry(r.try_get("partition")?)
                .or_default()
                .push(MergeContribution {
                    hotkey: r.try_get("miner")?,
                    weight: r.try_get("weight")?,
                    blob,
                });
        }
        drop(rows);
        for partition in 0..cfg.partitions {
            let contributions = contributed.remove(&(partition as i32)).unwrap_or_default();
            let owners = match contributions.is_empty() {
                true => Vec::new(),
                false => initial_owners(&candidates, epoch, partition),
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
    sqlx::query("UPDATE epochs SET uploading_ended_at = $3 WHERE run_id = $1 AND epoch = $2")
        .bind(app.run.id)
        .bind(epoch as i64)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    tracing::info!(epoch, "phase: merging");
    Ok(())
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
            sqlx::query(
                "INSERT INTO partitions (run_id, epoch, stage, partition, state, contributions,
                     resolved_by)
                 SELECT $1, $2, s, p, st, c::jsonb, r
                 FROM unnest($3::int4[], $4::int4[], $5::text[], $6::text[], $7::text[])
                     AS t(s, p, st, c, r)
                 ON CONFLICT DO NOTHING",
            )
            .bind(run)
            .bind(epoch as i64)
            .bind(&chunk.stages)
            .bind(&chunk.partitions)
            .bind(&chunk.states)
            .bind(&chunk.contributions)
            .bind(&chunk.resolved_by)
            .execute(&mut **tx)
            .await?;
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
    let open: Vec<(i32, i32)> = sqlx::query_as(
        "SELECT stage, partition FROM partitions WHERE run_id = $1 AND epoch = $2
           AND state IN ('open', 'disputed') ORDER BY stage, partition",
    )
    .bind(app.run.id)
    .bind(cur.epoch as i64)
    .fetch_all(&mut *tx)
    .await?;
    let open: Vec<(u32, u32)> = open
        .into_iter()
        .map(|(s, p)| (s as u32, p as u32))
        .collect();
    let given = add_owners(&mut tx, app, cur.epoch, &open, round).await?;
    // Validators are asked too: a partition unsettled at a deadline (its owners vanished, or
    // only one submitted) is put to them as a dispute, which a validator settles with its own
    // merge, so it is merged even when no miner is left to do it. (A disputed partition has one
    // already; an owners' agreement settles it as usual.)
    let asked = sqlx::query(
        "INSERT INTO disputes (run_id, epoch, stage, partition, state)
         SELECT run_id, epoch, stage, partition, 'open' FROM partitions
         WHERE run_id = $1 AND epoch = $2 AND state = 'open'
         ON CONFLICT DO NOTHING",
    )
    .bind(app.run.id)
    .bind(cur.epoch as i64)
    .execute(&mut *tx)
    .await?
    .rows_affected();
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

/// Ends the epoch: partitions still unsettled take their most-submitted result (or keep their
/// weights when nobody merged them), travelling samples are closed, the next epoch starts.
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
    // The partition looked up by its key for each dispute: as a join, a plan made before the
    // tables had statistics compared every dispute with every partition (1.1 s at 3,000 each).
    sqlx::query(
        "UPDATE disputes d SET state = 'settled', settled_by = 'deadline',
             settled_hash = (SELECT p.accepted->>'blake3' FROM partitions p
                 WHERE p.run_id = d.run_id AND p.epoch = d.epoch AND p.stage = d.stage
                   AND p.partition = d.partition)
         WHERE d.run_id = $1 AND d.epoch = $2 AND d.state = 'open'",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .execute(&mut *tx)
    .await?;
    // Every open hop of the epoch before any sample or the epoch's row (see `abandon_sample`):
    // abandoning sample by sample took the epoch's row with the first, and then waited for a
    // later sample's hop that a completion held while it waited for that row.
    sqlx::query(
        "SELECT id FROM tasks WHERE run_id = $1 AND epoch = $2 AND status IN ('pending', 'leased')
         ORDER BY id FOR UPDATE",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .execute(&mut *tx)
    .await?;
    let leftover: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM samples WHERE run_id = $1 AND epoch = $2 AND status IN ('forward', 'backward')",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .fetch_all(&mut *tx)
    .await?;
    for id in leftover {
        abandon_sample(&mut tx, id, now, "epoch ended").await?;
    }
    // The epoch's samples are final now: its mean loss is stored once, for `GET /v1/loss`.
    sqlx::query(
        "UPDATE epochs e SET ended_at = $3, loss_samples = l.n, loss_mean = l.mean
         FROM (SELECT count(loss) AS n, avg(loss) AS mean FROM samples
               WHERE run_id = $1 AND epoch = $2 AND loss IS NOT NULL) l
         WHERE e.run_id = $1 AND e.epoch = $2",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    sqlx::query("UPDATE runs SET epoch = $2 WHERE id = $1")
        .bind(app.run.id)
        .bind(epoch as i64 + 1)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO epochs (run_id, epoch, started_at) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(app.run.id)
    .bind(epoch as i64 + 1)
    .bind(now)
    .execute(&mut *tx)
    .await?;
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
