//! Leases that lapsed, hops not picked up in time, miners gone silent, and stages left empty.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use iota_protocol::api::*;
use sqlx::{Postgres, Row, Transaction};

use super::owners::add_owners;
use crate::app::App;
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
        sqlx::query("UPDATE tasks SET status = 'abandoned' WHERE id = ANY($1)")
            .bind(&closed)
            .execute(&mut *tx)
            .await?;
        tracing::warn!(
            count = closed.len(),
            "open hops of an ended epoch were closed"
        );
    }
    let ids: Vec<i64> = moved.keys().copied().collect();
    let rows = sqlx::query(
        "UPDATE tasks SET status = 'expired' WHERE id = ANY($1)
         RETURNING id, epoch, sample_id, stage, direction, attempt, miner, input",
    )
    .bind(&ids)
    .fetch_all(&mut *tx)
    .await?;
    for row in &rows {
        let why = moved.get(&row.try_get::<i64, _>("id")?).copied();
        reroute(&mut tx, app, row, why.map_or("", Lapse::reason)).await?;
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
    let rows = sqlx::query(
        "SELECT t.id, t.status, t.epoch, t.leased_until, r.epoch AS current_epoch,
                m.ended_epoch,
                EXISTS (SELECT 1 FROM tasks l
                        WHERE l.run_id = t.run_id AND l.miner = t.miner
                          AND l.status = 'leased' AND l.leased_until >= $2) AS miner_working
         FROM tasks t
         JOIN runs r ON r.id = t.run_id
         LEFT JOIN miners m ON m.run_id = t.run_id AND m.hotkey = t.miner
         WHERE t.run_id = $1 AND t.status IN ('pending', 'leased')
           AND (t.epoch < r.epoch OR t.leased_until < $2 OR m.ended_epoch = t.epoch)
         FOR UPDATE OF t SKIP LOCKED",
    )
    .bind(run)
    .bind(now)
    .fetch_all(&mut **tx)
    .await?;
    rows.iter()
        .map(|row| {
            let status: String = row.try_get("status")?;
            let hop = OpenHop {
                status: HopStatus::parse(&status)
                    .ok_or_else(|| RunError::Invalid(format!("bad task status {status}")))?,
                epoch: row.try_get::<i64, _>("epoch")? as u64,
                leased_until: row.try_get("leased_until")?,
                miner_working: row.try_get("miner_working")?,
                miner_ended_epoch: row
                    .try_get::<Option<i64>, _>("ended_epoch")?
                    .map(|e| e as u64),
            };
            Ok((
                row.try_get("id")?,
                row.try_get::<i64, _>("current_epoch")? as u64,
                hop,
            ))
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
    sqlx::query(
        "SELECT t.id FROM tasks t JOIN miners m ON m.run_id = t.run_id AND m.hotkey = t.miner
         WHERE t.run_id = $1 AND m.status = 'active' AND m.last_seen < $2
           AND t.status IN ('pending', 'leased')
         ORDER BY t.id FOR UPDATE OF t",
    )
    .bind(app.run.id)
    .bind(cutoff)
    .execute(&mut *tx)
    .await?;
    let mut released: Vec<String> = sqlx::query_scalar(
        "UPDATE miners SET status = 'released'
         WHERE run_id = $1 AND status = 'active' AND last_seen < $2 RETURNING hotkey",
    )
    .bind(app.run.id)
    .bind(cutoff)
    .fetch_all(&mut *tx)
    .await?;
    if let Some(moving) = release_for_an_empty_stage(&mut tx, app, cutoff).await? {
        released.push(moving);
    }
    // Open hops of every released miner, not only the ones released now: a completion that
    // raced with an earlier release may have routed a hop to a miner that was just leaving.
    let rows = sqlx::query(
        "UPDATE tasks t SET status = 'expired' FROM miners m
         WHERE t.run_id = $1 AND m.run_id = t.run_id AND m.hotkey = t.miner
           AND m.status = 'released' AND t.status IN ('pending', 'leased')
         RETURNING t.epoch, t.sample_id, t.stage, t.direction, t.attempt, t.miner, t.input",
    )
    .bind(app.run.id)
    .fetch_all(&mut *tx)
    .await?;
    if released.is_empty() && rows.is_empty() {
        return Ok(());
    }
    for row in &rows {
        reroute(&mut tx, app, row, "miner released").await?;
    }
    let now_run = run_now(&mut *tx, app.run.id).await?;
    if now_run.phase == Phase::Merging {
        let orphaned = sqlx::query(
            "SELECT o.stage, o.partition FROM partition_owners o
             JOIN partitions p USING (run_id, epoch, stage, partition)
             WHERE o.run_id = $1 AND o.epoch = $2 AND o.miner = ANY($3)
               AND p.state IN ('open', 'disputed')
               AND NOT EXISTS (SELECT 1 FROM merge_results r WHERE r.run_id = o.run_id
                   AND r.epoch = o.epoch AND r.stage = o.stage AND r.partition = o.partition
                   AND r.submitter = o.miner)",
        )
        .bind(app.run.id)
        .bind(now_run.epoch as i64)
        .bind(&released)
        .fetch_all(&mut *tx)
        .await?;
        let orphaned = orphaned
            .iter()
            .map(|row| {
                Ok((
                    row.try_get::<i32, _>("stage")? as u32,
                    row.try_get::<i32, _>("partition")? as u32,
                ))
            })
            .collect::<RunResult<Vec<_>>>()?;
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
    let counts: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT stage, count(*) FROM miners WHERE run_id = $1 AND status = 'active'
         GROUP BY stage",
    )
    .bind(app.run.id)
    .fetch_all(&mut **tx)
    .await?;
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
    let coming: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM miners WHERE run_id = $1 AND status = 'released'
                          AND last_seen >= $2)",
    )
    .bind(app.run.id)
    .bind(cutoff)
    .fetch_one(&mut **tx)
    .await?;
    if coming {
        return Ok(None);
    }
    let needs = cfg.memory_needed(empty).unwrap_or(0).min(i64::MAX as u64) as i64;
    let Some(candidate): Option<String> = sqlx::query_scalar(
        "SELECT hotkey FROM miners WHERE run_id = $1 AND status = 'active' AND stage = $2
           AND memory_bytes >= $3
         ORDER BY tokens_per_s, hotkey LIMIT 1",
    )
    .bind(app.run.id)
    .bind(fullest as i32)
    .bind(needs)
    .fetch_optional(&mut **tx)
    .await?
    else {
        return Ok(None);
    };
    // Its open hops before its row, as for silent miners.
    sqlx::query(
        "SELECT id FROM tasks WHERE run_id = $1 AND miner = $2 AND status IN ('pending', 'leased')
         ORDER BY id FOR UPDATE",
    )
    .bind(app.run.id)
    .bind(&candidate)
    .execute(&mut **tx)
    .await?;
    let moving: Option<String> = sqlx::query_scalar(
        "UPDATE miners SET status = 'released' WHERE run_id = $1 AND hotkey = $2
           AND status = 'active'
         RETURNING hotkey",
    )
    .bind(app.run.id)
    .bind(&candidate)
    .fetch_optional(&mut **tx)
    .await?;
    if let Some(miner) = &moving {
        // Self-healing, and what every departure from a thin stage leads to: not a warning.
        tracing::info!(%miner, from = fullest, to = empty, "stage {empty} has no miner: released one of stage {fullest} to take it");
    }
    Ok(moving)
}
