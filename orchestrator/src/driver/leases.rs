//! Leases that lapsed, hops not picked up in time, miners gone silent, and stages left empty.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use iota_protocol::api::*;
use sqlx::{Postgres, Transaction};

use super::owners::add_owners;
use crate::app::App;
use crate::db;
use crate::domain::hops::HopStatus;
use crate::domain::leases::{self, Lapse, OpenHop, secs};
use crate::error::{RunError, RunResult};
use crate::samples::{reroute, run_now};

/// Open hops that stop waiting for their miner ([`leases::lapse`]): hops of an ended epoch close
/// (`next_epoch` closes them all; one routed by a statement that raced with it would otherwise
/// go on being leased and re-routed for good); lapsed leases, hops their miner did not lease in
/// time, and hops routed to a miner that had already ended its epoch (a completion that raced
/// with its pseudo-gradient, see `samples::close_epoch`) move ([`leases::reroute`]). The old
/// attempt's late result is refused with `lease_expired`.
pub(crate) async fn expire_leases(app: &App, now: DateTime<Utc>) -> RunResult<()> {
    let mut tx = app.db.begin().await?;
    let mut closed = Vec::new();
    let mut moved = HashMap::new();
    for (id, current_epoch, hop) in hops_that_may_lapse(&mut tx, app.run.id, now).await? {
        match leases::lapse(&hop, current_epoch, now) {
            Some(Lapse::EpochOver) => closed.push(id),
            Some(why) => {
                moved.insert(id, why);
            }
            None => {}
        }
    }
    if !closed.is_empty() {
        db::hops::abandon(&mut *tx, &closed).await?;
        tracing::warn!(
            count = closed.len(),
            "open hops of an ended epoch were closed"
        );
    }
    let ids: Vec<i64> = moved.keys().copied().collect();
    for hop in db::hops::expire(&mut *tx, &ids).await? {
        let why = moved.get(&hop.id).copied();
        reroute(&mut tx, app, &hop, why.map_or("", Lapse::reason)).await?;
    }
    tx.commit().await?;
    let lapsed = moved.values().filter(|&&w| w == Lapse::LeaseLapsed).count();
    if lapsed > 0 {
        metrics::counter!("iota_leases_expired_total").increment(lapsed as u64);
        tracing::info!(count = lapsed, "leases lapsed and were re-routed");
    }
    if moved.len() > lapsed {
        tracing::info!(
            count = moved.len() - lapsed,
            "hops routed to miners that had ended their epoch were re-routed"
        );
    }
    Ok(())
}

/// Open hops of the run that [`leases::lapse`] may end at `now`, locked (skipping those a
/// completion holds): its id, the run's epoch, and what the rule reads.
async fn hops_that_may_lapse(
    tx: &mut Transaction<'_, Postgres>,
    run: i64,
    now: DateTime<Utc>,
) -> RunResult<Vec<(i64, u64, OpenHop)>> {
    db::hops::may_lapse(&mut **tx, run, now)
        .await?
        .into_iter()
        .map(|c| {
            let hop = OpenHop {
                status: HopStatus::parse(&c.status)
                    .ok_or_else(|| RunError::Invalid(format!("bad task status {}", c.status)))?,
                epoch: c.epoch as u64,
                leased_until: c.leased_until,
                miner_working: c.miner_working,
                miner_ended_epoch: c.miner_ended_epoch.map(|e| e as u64),
            };
            Ok((c.id, c.current_epoch as u64, hop))
        })
        .collect()
}

/// Miners silent for longer than the heartbeat timeout are released: their open hops move (or
/// their samples end) and, while merging, their unsubmitted partitions get a new owner.
pub(crate) async fn release_silent_miners(app: &App, now: DateTime<Utc>) -> RunResult<()> {
    let cutoff = now - secs(app.config().heartbeat_timeout_s);
    let mut tx = app.db.begin().await?;
    // Their open hops first, then their rows: the order a completion takes them in (the hop,
    // then its miner's row), so the two wait for each other instead of deadlocking.
    db::hops::lock_open_of_silent(&mut *tx, app.run.id, cutoff).await?;
    let mut released = db::miners::release_silent(&mut *tx, app.run.id, cutoff).await?;
    if let Some(moving) = release_for_an_empty_stage(&mut tx, app, cutoff).await? {
        released.push(moving);
    }
    // Open hops of every released miner, not only the ones released now: a completion that
    // raced with an earlier release may have routed a hop to a miner that was just leaving.
    let rows = db::hops::expire_of_released(&mut *tx, app.run.id).await?;
    if released.is_empty() && rows.is_empty() {
        return Ok(());
    }
    for hop in &rows {
        reroute(&mut tx, app, hop, "miner released").await?;
    }
    let now_run = run_now(&mut *tx, app.run.id).await?;
    if now_run.phase == Phase::Merging {
        let orphaned: Vec<(u32, u32)> =
            db::partitions::unsubmitted_of(&mut *tx, app.run.id, now_run.epoch as i64, &released)
                .await?
                .into_iter()
                .map(|(stage, partition)| (stage as u32, partition as u32))
                .collect();
        add_owners(&mut tx, app, now_run.epoch, &orphaned, now_run.merge_round).await?;
    }
    tx.commit().await?;
    metrics::counter!("iota_miners_released_total").increment(released.len() as u64);
    // Routine in a permissionless subnet (a miner left, crashed or lost its network) and fully
    // handled here, so not a warning; `iota_miners_released_total` counts them.
    tracing::info!(miners = ?released, rerouted = rows.len(), "released miners that stopped heartbeating");
    Ok(())
}

/// With a stage that has no active miner (its last one left) and another with two or more, the
/// slowest miner of the fullest stage that can hold the empty one is released: when it joins again
/// it is given the empty stage (see `miner::join::register`). A stage is never emptied so. Without it an
/// empty stage stayed empty for good (a miner keeps its stage when it joins again, and only new
/// hotkeys chose one), and the run trained nothing: no sample passes a stage with no miner. The
/// released miner's work of the epoch was lost anyway, since none of its samples can finish.
/// One at a time: while a miner released alive (seen since `cutoff`) has not joined again, none
/// more is (it takes a poll or two to notice; the driver steps every tick).
async fn release_for_an_empty_stage(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    cutoff: DateTime<Utc>,
) -> RunResult<Option<String>> {
    let cfg = app.config();
    let counts = db::miners::active_per_stage(&mut **tx, app.run.id).await?;
    let active = |stage: u32| {
        counts
            .iter()
            .find(|(s, _)| *s == stage as i32)
            .map_or(0, |(_, n)| *n)
    };
    let Some(empty) = (0..cfg.stages).find(|s| active(*s) == 0) else {
        return Ok(None);
    };
    let Some(fullest) = (0..cfg.stages).max_by_key(|s| (active(*s), std::cmp::Reverse(*s))) else {
        return Ok(None);
    };
    if active(fullest) < 2 {
        return Ok(None);
    }
    // Asked only once a stage is empty: this runs at every tick.
    if db::miners::released_seen_since(&mut **tx, app.run.id, cutoff).await? {
        return Ok(None);
    }
    let needs = cfg.memory_needed(empty).unwrap_or(0).min(i64::MAX as u64) as i64;
    let slowest = db::miners::slowest_holding(&mut **tx, app.run.id, fullest as i32, needs);
    let Some(candidate) = slowest.await? else {
        return Ok(None);
    };
    // Its open hops before its row, as for silent miners.
    db::hops::lock_open_of_miner(&mut **tx, app.run.id, &candidate).await?;
    let moving = db::miners::release(&mut **tx, app.run.id, &candidate).await?;
    if let Some(miner) = &moving {
        // Self-healing, and what every departure from a thin stage leads to: not a warning.
        tracing::info!(%miner, from = fullest, to = empty, "stage {empty} has no miner: released one of stage {fullest} to take it");
    }
    Ok(moving)
}
