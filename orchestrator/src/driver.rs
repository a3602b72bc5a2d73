//! The phase driver: expires leases, releases silent miners, moves the epoch through its phases,
//! assigns merge owners, settles partitions, and collects old objects.
//!
//! It runs in every orchestrator process but acts only in the one holding a session-level
//! Postgres advisory lock, so several replicas on one database drive one run exactly once; if the
//! leader dies its connection closes, the lock is released, and another replica takes over at its
//! next tick. Every step is a transaction over database state alone, so a restart resumes where
//! the database is, with the phase's time left as it was (see [`forgive_gap`]). Phase changes
//! take an exclusive transaction-level lock that uploads take in shared mode, so an upload lands
//! wholly before a phase change or is refused after it; uploads reserved before the uploading
//! deadline hold that phase open for a bounded time (see `routing::next_step`).

use std::collections::HashMap;
use std::sync::LazyLock;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::Json;
use chrono::{DateTime, Utc};
use iota_protocol::ErrorCode;
use iota_protocol::api::*;
use iota_protocol::blob::BlobDescriptor;
use sqlx::pool::PoolConnection;
use sqlx::{Connection, Postgres, Row, Transaction};

use crate::app::App;
use crate::error::{ApiResult, AppError};
use crate::objects::{SealedIn, delete_unless_recorded};
use crate::routing::{
    OwnerCandidate, PhaseStep, PhaseView, Verdict, final_pick, initial_owners, next_step,
    pick_added_owners, verdict,
};
use crate::routing::{pickup_s, reservations_hold_until, secs};
use crate::samples::{RunNow, abandon_sample, reroute, run_now};

/// The leader lock's class; its other key is the run's id, so that each run on a database has
/// a driver of its own (one key for all let one run's driver leave every other run undriven).
const LEADER_LOCK_CLASS: i32 = 0x696f_7464; // "iotd"
/// The phase lock's class (its other key is the run's id): the driver holds it exclusively
/// while it changes the phase, and submissions that must land wholly before or after a phase
/// change hold it shared.
pub const PHASE_LOCK_CLASS: i32 = 0x696f_7461; // "iota"

/// Takes the phase lock in shared mode for the rest of the transaction (uploads).
pub async fn phase_lock_shared(tx: &mut Transaction<'_, Postgres>, run: i64) -> ApiResult<()> {
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1, $2::int)")
        .bind(PHASE_LOCK_CLASS)
        .bind(run as i32)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn phase_lock_exclusive(tx: &mut Transaction<'_, Postgres>, run: i64) -> ApiResult<()> {
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2::int)")
        .bind(PHASE_LOCK_CLASS)
        .bind(run as i32)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Runs the driver until `shutdown` resolves. `tick` is the time between steps.
pub async fn run_driver(app: App, tick: Duration, shutdown: tokio::sync::watch::Receiver<bool>) {
    let mut leader_conn: Option<PoolConnection<Postgres>> = None;
    let mut n: u64 = 0;
    let mut shutdown = shutdown;
    // How long the leader's steps must fail without a break before it gives the run that time
    // back, as a new leader does (the database refused its writes, and miners' requests failed
    // with them). Counted from the end of the first failed step, so one slow statement is not a
    // gap, and a slow step that succeeds never is. Only the step's bookkeeping counts (its first
    // writes: leases and heartbeats): a phase change that fails while those succeed is no outage
    // of the miners', and forgiving it kept every silent miner and lapsed lease alive.
    let gap = tick.saturating_mul(20);
    let mut failing_since: Option<Instant> = None;
    // Takeovers given up in a row because the gap could not be forgiven.
    let mut unforgiven = 0u32;
    loop {
        if *shutdown.borrow() {
            break;
        }
        if leader_conn.is_none() {
            match try_lead(&app, unforgiven >= LEAD_UNFORGIVEN_AFTER).await {
                Lead::Leading(conn) => {
                    leader_conn = Some(conn);
                    failing_since = None;
                    unforgiven = 0;
                }
                Lead::Unforgiven => unforgiven += 1,
                Lead::Not => {}
            }
        }
        if let Some(conn) = &mut leader_conn {
            // Still holding the lock? A broken connection means another replica may lead now;
            // one that does not answer (a half-open socket) may be broken.
            let check = tokio::time::timeout(gap, sqlx::query("SELECT 1").execute(&mut **conn));
            if !matches!(check.await, Ok(Ok(_))) {
                tracing::warn!("lost the leader connection; stepping down");
                app.leader.store(false, Ordering::Relaxed);
                if let Some(conn) = leader_conn.take() {
                    release(conn).await;
                }
            } else {
                let mut stepping = true;
                if failing_since.is_some_and(|t| t.elapsed() >= gap) {
                    tracing::warn!("the run's steps failed for a while; giving that time back");
                    match forgive_gap(&app, Utc::now()).await {
                        // Another gap needs as long again.
                        Ok(()) => failing_since = Some(Instant::now()),
                        Err(e) => {
                            tracing::warn!(error = %e, "could not give the time back; not stepping");
                            stepping = false;
                        }
                    }
                }
                if stepping {
                    let now = Utc::now();
                    match keep_time(&app, now).await {
                        Ok(()) => {
                            failing_since = None;
                            if let Err(e) = advance(&app, now).await {
                                tracing::warn!(error = ?e.0, "phase step failed; retrying next tick");
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = ?e.0, "driver step failed; retrying next tick");
                            failing_since.get_or_insert_with(Instant::now);
                        }
                    }
                }
                if n.is_multiple_of(50) {
                    housekeeping(&app, Utc::now()).await;
                }
            }
        }
        // In every process, not only the leader: each keeps limiters of its own.
        if n.is_multiple_of(50) {
            app.shrink_limiters();
        }
        n += 1;
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = shutdown.changed() => {}
        }
    }
    if let Some(mut conn) = leader_conn {
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            sqlx::query("SELECT pg_advisory_unlock($1, $2::int)")
                .bind(LEADER_LOCK_CLASS)
                .bind(app.run.id as i32)
                .execute(&mut *conn),
        )
        .await;
        app.leader.store(false, Ordering::Relaxed);
        release(conn).await;
    }
}

/// Takeovers refused in a row (each a tick apart) because the gap could not be forgiven, after
/// which a process leads without forgiving it: miners silent in the gap are then released and
/// their leases re-routed, but the run advances, where otherwise no process would drive it.
const LEAD_UNFORGIVEN_AFTER: u32 = 10;

/// What a try to take the lead came to.
enum Lead {
    /// This process leads, on this connection (holding the session-level lock).
    Leading(PoolConnection<Postgres>),
    /// The lock was free, but the gap could not be forgiven: not leading yet.
    Unforgiven,
    /// Another process leads, or the database could not be asked.
    Not,
}

/// Closes a pooled connection that held (or may hold) a session-level lock (the leader's, or
/// the upgrade lock of [`crate::replicas`]), so that the lock goes with it rather than back into
/// the pool; the pool may open a replacement.
pub(crate) async fn release(conn: PoolConnection<Postgres>) {
    close_unlocked(conn.detach()).await;
}

/// Gives back every session-level advisory lock `conn` holds, answered, then closes it (within
/// 5 s). A close alone frees the locks only when the server's backend exits, after the client
/// has moved on: the next start-up could still find them held.
pub(crate) async fn close_unlocked(mut conn: sqlx::PgConnection) {
    let _ = tokio::time::timeout(Duration::from_secs(5), async move {
        if let Err(e) = sqlx::query("SELECT pg_advisory_unlock_all()")
            .execute(&mut conn)
            .await
        {
            tracing::warn!(error = %e, "could not give back advisory locks; closing the connection frees them");
        }
        conn.close().await
    })
    .await;
}

async fn try_lead(app: &App, unforgiven_anyway: bool) -> Lead {
    let Ok(mut conn) = app.db.acquire().await else {
        return Lead::Not;
    };
    let got: bool = match sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2::int)")
        .bind(LEADER_LOCK_CLASS)
        .bind(app.run.id as i32)
        .fetch_one(&mut *conn)
        .await
    {
        Ok(got) => got,
        Err(_) => {
            release(conn).await;
            return Lead::Not;
        }
    };
    if !got {
        return Lead::Not;
    }
    if let Err(e) = forgive_gap(app, Utc::now()).await {
        if unforgiven_anyway {
            tracing::error!(error = %e, "could not renew heartbeats and leases after the gap, again; leading anyway");
        } else {
            tracing::warn!(error = %e, "could not renew heartbeats and leases after the gap; not leading yet");
            release(conn).await;
            return Lead::Unforgiven;
        }
    }
    tracing::info!("this process now drives the epoch phases");
    app.leader.store(true, Ordering::Relaxed);
    // Keep this connection out of the pool for as long as we lead.
    Lead::Leading(conn)
}

/// Before a process takes the lead, nobody drove the run (the last leader died or restarted):
/// miners could not reach it, so their silence and the leases they could not finish in that gap
/// are not held against them. Active miners and open leases get a fresh window from `now`;
/// a miner that really died is released one heartbeat timeout later. The current phase gets
/// back the time it had left at the last leader's last step (`runs.driven_at`), so that a
/// deadline that passed in the gap does not end it before miners can reach the new leader.
pub async fn forgive_gap(app: &App, now: DateTime<Utc>) -> Result<(), sqlx::Error> {
    let mut tx = app.db.begin().await?;
    // Past its deadline, an uploading phase may still be held open by reservations, for up to
    // `uploading_s` more: that time is given back too.
    sqlx::query(
        "UPDATE runs SET phase_deadline = $2 + (phase_deadline - driven_at)
         WHERE id = $1 AND driven_at < $2
           AND (phase_deadline > driven_at
                OR (phase = 'uploading' AND phase_deadline + $3 > driven_at))",
    )
    .bind(app.run.id)
    .bind(now)
    .bind(secs(app.config().uploading_s))
    .execute(&mut *tx)
    .await?;
    // Given back once: a second forgiveness before the next step gives back only what followed.
    sqlx::query("UPDATE runs SET driven_at = greatest(driven_at, $2) WHERE id = $1")
        .bind(app.run.id)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "UPDATE miners SET last_seen = greatest(last_seen, $2)
         WHERE run_id = $1 AND status = 'active'",
    )
    .bind(app.run.id)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE tasks SET leased_until = greatest(leased_until, $2)
         WHERE run_id = $1 AND status = 'leased'",
    )
    .bind(app.run.id)
    .bind(now + secs(app.config().lease_s))
    .execute(&mut *tx)
    .await?;
    // Routed hops waiting to be leased get their pick-up time again too.
    sqlx::query(
        "UPDATE tasks SET leased_until = greatest(leased_until, $2)
         WHERE run_id = $1 AND status = 'pending'",
    )
    .bind(app.run.id)
    .bind(now + secs(pickup_s(app.config())))
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

async fn housekeeping(app: &App, now: DateTime<Utc>) {
    match crate::auth::prune_replay_cache(&app.db).await {
        Ok(n) if n > 0 => tracing::debug!(pruned = n, "replay cache pruned"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "replay cache prune failed"),
    }
    if let Err(e) = collect_garbage(app, now).await {
        tracing::warn!(error = ?e.0, "garbage collection failed");
    }
}

/// One driver step at time `now`: leases, heartbeats, then at most one phase change.
pub async fn step(app: &App, now: DateTime<Utc>) -> ApiResult<()> {
    keep_time(app, now).await?;
    advance(app, now).await
}

/// A step's bookkeeping: the time driven, lapsed leases, silent miners.
async fn keep_time(app: &App, now: DateTime<Utc>) -> ApiResult<()> {
    sqlx::query("UPDATE runs SET driven_at = $2 WHERE id = $1")
        .bind(app.run.id)
        .bind(now)
        .execute(&app.db)
        .await?;
    expire_leases(app, now).await?;
    release_silent_miners(app, now).await
}

/// A step's phase change, if one is due.
async fn advance(app: &App, now: DateTime<Utc>) -> ApiResult<()> {
    let view = phase_view(app, &mut *app.db.acquire().await?).await?;
    let started = Instant::now();
    let step = next_step(&view, now, app.max_merge_rounds);
    let name = match step {
        PhaseStep::Wait => return Ok(()),
        PhaseStep::StartUploading => {
            start_uploading(app, now).await?;
            "start_uploading"
        }
        PhaseStep::StartMerging => {
            start_merging(app, now).await?;
            "start_merging"
        }
        PhaseStep::ReassignRound => {
            reassign_round(app, now).await?;
            "reassign_round"
        }
        PhaseStep::NextEpoch => {
            next_epoch(app, now).await?;
            "next_epoch"
        }
    };
    // A phase change holds the exclusive phase lock that work requests wait on: how long it
    // took is how long they may have waited.
    metrics::histogram!("iota_phase_change_seconds", "step" => name)
        .record(started.elapsed().as_secs_f64());
    Ok(())
}

/// Lapsed leases, and routed hops their miner did not lease in time (see `routing::pickup_s`): a
/// forward hop is re-routed to another miner of its stage as a new attempt; a backward hop cannot
/// move (only its miner holds the activation cache), so its sample is abandoned. The old attempt's late result is refused with `lease_expired`. Hops routed to a
/// miner that had already ended its epoch (a completion that raced with its pseudo-gradient, see
/// `samples::close_epoch`) move the same way.
async fn expire_leases(app: &App, now: DateTime<Utc>) -> ApiResult<()> {
    let mut tx = app.db.begin().await?;
    // Open hops of an epoch that has ended (`next_epoch` closes them all; one routed by a
    // statement that raced with it would otherwise go on being leased and re-routed for good).
    // First, so that the sweeps below re-route none of them.
    let stale = sqlx::query(
        "UPDATE tasks SET status = 'abandoned' WHERE id IN (
             SELECT id FROM tasks
             WHERE run_id = $1 AND status IN ('pending', 'leased')
               AND epoch < (SELECT epoch FROM runs WHERE id = $1)
             FOR UPDATE SKIP LOCKED)",
    )
    .bind(app.run.id)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if stale > 0 {
        tracing::warn!(count = stale, "open hops of an ended epoch were closed");
    }
    // A routed hop waits past its pick-up time only while its miner works (holds a live
    // lease): a slow miner with a backlog leases it in turn, and moving its backward hops would
    // end their samples. One that holds none (its loop hung, or it never polls) gives it up.
    let rows = sqlx::query(
        "UPDATE tasks SET status = 'expired' WHERE id IN (
             SELECT t.id FROM tasks t
             WHERE t.run_id = $1 AND t.status IN ('pending', 'leased') AND t.leased_until < $2
               AND t.epoch = (SELECT epoch FROM runs WHERE id = $1)
               AND (t.status = 'leased'
                    OR NOT EXISTS (SELECT 1 FROM tasks l
                                   WHERE l.run_id = t.run_id AND l.miner = t.miner
                                     AND l.status = 'leased' AND l.leased_until >= $2))
             FOR UPDATE SKIP LOCKED)
         RETURNING epoch, sample_id, stage, direction, attempt, miner, input",
    )
    .bind(app.run.id)
    .bind(now)
    .fetch_all(&mut *tx)
    .await?;
    for row in &rows {
        reroute(&mut tx, app, row, "lease lapsed").await?;
    }
    let stray = sqlx::query(
        "UPDATE tasks SET status = 'expired' WHERE id IN (
             SELECT t.id FROM tasks t
             WHERE t.run_id = $1 AND t.status IN ('pending', 'leased')
               AND t.epoch = (SELECT epoch FROM runs WHERE id = $1)
               AND EXISTS (SELECT 1 FROM miners m
                           WHERE m.run_id = t.run_id AND m.hotkey = t.miner
                             AND m.ended_epoch = t.epoch)
             FOR UPDATE SKIP LOCKED)
         RETURNING epoch, sample_id, stage, direction, attempt, miner, input",
    )
    .bind(app.run.id)
    .fetch_all(&mut *tx)
    .await?;
    for row in &stray {
        reroute(&mut tx, app, row, "its miner ended its epoch").await?;
    }
    tx.commit().await?;
    if !rows.is_empty() {
        metrics::counter!("iota_leases_expired_total").increment(rows.len() as u64);
        tracing::info!(count = rows.len(), "leases lapsed and were re-routed");
    }
    if !stray.is_empty() {
        tracing::info!(
            count = stray.len(),
            "hops routed to miners that had ended their epoch were re-routed"
        );
    }
    Ok(())
}

/// Miners silent for longer than the heartbeat timeout are released: their open hops move (or
/// their samples end) and, while merging, their unsubmitted partitions get a new owner.
async fn release_silent_miners(app: &App, now: DateTime<Utc>) -> ApiResult<()> {
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
            .collect::<ApiResult<Vec<_>>>()?;
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
) -> ApiResult<Option<String>> {
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

async fn phase_view(app: &App, db: &mut sqlx::PgConnection) -> ApiResult<PhaseView> {
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
) -> ApiResult<()> {
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
) -> ApiResult<bool> {
    let view = phase_view(app, tx).await?;
    Ok(next_step(&view, now, app.max_merge_rounds) == step)
}

async fn start_uploading(app: &App, now: DateTime<Utc>) -> ApiResult<()> {
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
async fn start_merging(app: &App, now: DateTime<Utc>) -> ApiResult<()> {
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
            let blob: BlobDescriptor = serde_json::from_value(r.try_get("blob")?)
                .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
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

/// Partitions written per statement when merging starts, or at an epoch's end.
const PARTITIONS_PER_STATEMENT: usize = 4096;
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
    ) -> ApiResult<()> {
        let state = match contributions.is_empty() {
            true => PartitionState::Unchanged,
            false => PartitionState::Open,
        };
        self.stages.push(stage as i32);
        self.partitions.push(partition as i32);
        self.states.push(state.as_str());
        let json = serde_json::to_string(contributions)
            .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
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
    ) -> ApiResult<()> {
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

/// Adds one owner to a partition (see [`add_owners`]). Returns whether one was found.
pub async fn add_owner(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    epoch: u64,
    stage: u32,
    partition: u32,
    round: u32,
) -> ApiResult<bool> {
    Ok(add_owners(tx, app, epoch, &[(stage, partition)], round).await? == 1)
}

/// Adds one owner to each of `partitions` (stage, partition), as [`pick_added_owners`] ranks
/// active miners, each pick counted before the next. Three reads and a chunked insert whatever
/// the number: a merging deadline can leave every partition of the epoch open, and this runs
/// under the exclusive phase lock. Returns how many were given one.
pub async fn add_owners(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    epoch: u64,
    partitions: &[(u32, u32)],
    round: u32,
) -> ApiResult<usize> {
    if partitions.is_empty() {
        return Ok(0);
    }
    let active: Vec<(String, i32)> =
        sqlx::query_as("SELECT hotkey, stage FROM miners WHERE run_id = $1 AND status = 'active'")
            .bind(app.run.id)
            .fetch_all(&mut **tx)
            .await?;
    let owned: HashMap<String, i64> = sqlx::query_as(
        "SELECT miner, count(*) FROM partition_owners WHERE run_id = $1 AND epoch = $2
         GROUP BY miner",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .fetch_all(&mut **tx)
    .await?
    .into_iter()
    .collect();
    let (stages, parts): (Vec<i32>, Vec<i32>) = partitions
        .iter()
        .map(|(s, p)| (*s as i32, *p as i32))
        .unzip();
    let mut owners: HashMap<(u32, u32), Vec<String>> = HashMap::new();
    let rows: Vec<(i32, i32, String)> = sqlx::query_as(
        "SELECT o.stage, o.partition, o.miner FROM partition_owners o
         JOIN unnest($3::int4[], $4::int4[]) AS t(s, p) ON o.stage = t.s AND o.partition = t.p
         WHERE o.run_id = $1 AND o.epoch = $2",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(&stages)
    .bind(&parts)
    .fetch_all(&mut **tx)
    .await?;
    for (stage, partition, miner) in rows {
        owners
            .entry((stage as u32, partition as u32))
            .or_default()
            .push(miner);
    }
    let mut candidates: Vec<OwnerCandidate> = active
        .into_iter()
        .map(|(hotkey, stage)| OwnerCandidate {
            owned: owned.get(&hotkey).copied().unwrap_or(0) as u64,
            hotkey,
            stage: stage as u32,
        })
        .collect();
    let picks = pick_added_owners(
        &mut candidates,
        partitions,
        &mut owners,
        &mut rand::thread_rng(),
    );
    let added: Vec<(u32, u32, String)> = partitions
        .iter()
        .zip(picks)
        .filter_map(|(&(stage, partition), pick)| {
            let miner = candidates[pick?].hotkey.clone();
            tracing::debug!(epoch, stage, partition, %miner, round, "partition given another owner");
            Some((stage, partition, miner))
        })
        .collect();
    insert_owners(tx, app.run.id, epoch, &added, round).await?;
    Ok(added.len())
}

/// Rows written per statement by [`insert_owners`].
const OWNERS_PER_STATEMENT: usize = 8192;

/// Records owners (stage, partition, miner) of `round`; an existing one is left as it is.
async fn insert_owners(
    tx: &mut Transaction<'_, Postgres>,
    run: i64,
    epoch: u64,
    owners: &[(u32, u32, String)],
    round: u32,
) -> ApiResult<()> {
    for chunk in owners.chunks(OWNERS_PER_STATEMENT) {
        let stages: Vec<i32> = chunk.iter().map(|(s, _, _)| *s as i32).collect();
        let partitions: Vec<i32> = chunk.iter().map(|(_, p, _)| *p as i32).collect();
        let miners: Vec<&str> = chunk.iter().map(|(_, _, m)| m.as_str()).collect();
        sqlx::query(
            "INSERT INTO partition_owners (run_id, epoch, stage, partition, miner, round)
             SELECT $1, $2, s, p, m, $6
             FROM unnest($3::int4[], $4::int4[], $5::text[]) AS t(s, p, m)
             ON CONFLICT DO NOTHING",
        )
        .bind(run)
        .bind(epoch as i64)
        .bind(&stages)
        .bind(&partitions)
        .bind(&miners)
        .bind(round as i32)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

async fn reassign_round(app: &App, now: DateTime<Utc>) -> ApiResult<()> {
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
async fn next_epoch(app: &App, now: DateTime<Utc>) -> ApiResult<()> {
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
        abandon_sample(&mut tx, id, "epoch ended").await?;
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
) -> ApiResult<()> {
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
async fn settle_at_last_deadline(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    epoch: u64,
) -> ApiResult<()> {
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
) -> AppError {
    AppError::new(
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
) -> ApiResult<Json<UploadResponse>> {
    let mut tx = app.db.begin().await?;
    phase_lock_shared(&mut tx, app.run.id).await?;
    let cur = run_now(&mut *tx, app.run.id).await?;
    if cur.epoch != epoch || cur.phase != Phase::Merging {
        drop(tx);
        delete_unless_recorded(app, SealedIn::MergeResults, &blob.key).await?;
        return Err(AppError::new(
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
    .ok_or_else(|| AppError::new(ErrorCode::NotFound, "no such partition this epoch"))?;
    // Under the partition's lock, which owner changes take too.
    if let Some(validator) = submitter.strip_prefix("validator:") {
        let slot = (epoch as i64, stage as i32, partition as i32);
        if has_stake(&mut *tx, app.run.id, validator, slot).await? {
            drop(tx);
            delete_unless_recorded(app, SealedIn::MergeResults, &blob.key).await?;
            return Err(interested_validator(stage, partition));
        }
    }
    let value = serde_json::to_value(&blob)
        .map_err(|e| AppError::new(ErrorCode::Internal, e.to_string()))?;
    let stored: String = sqlx::query_scalar(
        "INSERT INTO merge_results (run_id, epoch, stage, partition, submitter, blob, blake3)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
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
    .fetch_one(&mut *tx)
    .await?;
    if stored != blob.blake3 {
        drop(tx);
        // Sealed under its own hash, so not the recorded result's key.
        app.store.delete(&blob.key).await?;
        return Err(AppError::new(
            ErrorCode::Conflict,
            "you already submitted a different result for this partition",
        ));
    }
    if state == "open" || state == "disputed" {
        settle(&mut tx, app, &cur, stage, partition).await?;
    }
    tx.commit().await?;
    Ok(Json(UploadResponse { blob }))
}

async fn settle(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    cur: &RunNow,
    stage: u32,
    partition: u32,
) -> ApiResult<()> {
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
pub async fn settle_dispute(app: &App, validator: &str, id: i64, hash: &str) -> ApiResult<()> {
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
    .ok_or_else(|| AppError::new(ErrorCode::NotFound, format!("no dispute {id}")))?;
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
        return Err(AppError::new(
            ErrorCode::WrongPhase,
            format!("epoch {epoch}'s merges are closed: dispute {id} closed with them"),
        ));
    }
    if state == "settled" {
        // A retry of the settlement is answered as the first was; another hash is not.
        return match settled_hash {
            Some(h) if h == hash => Ok(()),
            settled => Err(AppError::new(
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
        return Err(AppError::new(
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
        return Err(AppError::new(
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

/// Deletes the objects of epochs older than the retention window, keeping the merged partitions
/// that an epoch still kept starts from (for each partition, the latest accepted before the
/// oldest kept epoch: those are also the latest weights of a partition not merged since).
///
/// An epoch is collected only once no presigned URL for its keys can still be used (they are
/// handed out only while it runs, see [`crate::BlobStore::upload_grace`]): a PUT landing after
/// its collection would stay in the bucket for good.
pub async fn collect_garbage(app: &App, now: DateTime<Utc>) -> ApiResult<()> {
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
