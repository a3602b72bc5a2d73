//! The driver's loop: who leads, the time a restart forgives, and each step's order.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::Postgres;
use sqlx::pool::PoolConnection;

use super::gc::collect_garbage;
use super::leases::expire_leases;
use super::leases::release_silent_miners;
use super::phases::next_epoch;
use super::phases::phase_view;
use super::phases::reassign_round;
use super::phases::start_merging;
use super::phases::start_uploading;
use crate::app::App;
use crate::db;
use crate::db::locks::release;
use crate::domain::leases::{pickup_s, secs};
use crate::domain::phases::{PhaseStep, next_step};
use crate::error::RunResult;

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
            let check = tokio::time::timeout(gap, db::locks::ping(conn));
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
                    match forgive_gap(&app, app.now()).await {
                        // Another gap needs as long again.
                        Ok(()) => failing_since = Some(Instant::now()),
                        Err(e) => {
                            tracing::warn!(error = %e, "could not give the time back; not stepping");
                            stepping = false;
                        }
                    }
                }
                if stepping {
                    let now = app.now();
                    match keep_time(&app, now).await {
                        Ok(()) => {
                            failing_since = None;
                            if let Err(e) = advance(&app, now).await {
                                tracing::warn!(error = %e.detail(), "phase step failed; retrying next tick");
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e.detail(), "driver step failed; retrying next tick");
                            failing_since.get_or_insert_with(Instant::now);
                        }
                    }
                }
                if n.is_multiple_of(50) {
                    housekeeping(&app, app.now()).await;
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
            db::locks::leader_unlock(&mut conn, app.run.id),
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

async fn try_lead(app: &App, unforgiven_anyway: bool) -> Lead {
    let Ok(mut conn) = app.db.acquire().await else {
        return Lead::Not;
    };
    let got = match db::locks::try_leader_lock(&mut conn, app.run.id).await {
        Ok(got) => got,
        Err(_) => {
            release(conn).await;
            return Lead::Not;
        }
    };
    if !got {
        return Lead::Not;
    }
    if let Err(e) = forgive_gap(app, app.now()).await {
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
    let (run, cfg) = (app.run.id, app.config());
    let mut tx = app.db.begin().await?;
    // Past its deadline, an uploading phase may still be held open by reservations, for up to
    // `uploading_s` more: that time is given back too.
    db::runs::give_back_phase_time(&mut *tx, run, now, secs(cfg.uploading_s)).await?;
    // Given back once: a second forgiveness before the next step gives back only what followed.
    db::runs::advance_driven_at(&mut *tx, run, now).await?;
    db::miners::seen_by(&mut *tx, run, now).await?;
    db::hops::extend_open(&mut *tx, run, "leased", now + secs(cfg.lease_s)).await?;
    // Routed hops waiting to be leased get their pick-up time again too.
    db::hops::extend_open(&mut *tx, run, "pending", now + secs(pickup_s(cfg))).await?;
    tx.commit().await
}

async fn housekeeping(app: &App, now: DateTime<Utc>) {
    match crate::auth::prune_replay_cache(&app.db).await {
        Ok(n) if n > 0 => tracing::debug!(pruned = n, "replay cache pruned"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "replay cache prune failed"),
    }
    if let Err(e) = collect_garbage(app, now).await {
        tracing::warn!(error = %e.detail(), "garbage collection failed");
    }
}

/// One driver step at time `now`: leases, heartbeats, then at most one phase change.
pub async fn step(app: &App, now: DateTime<Utc>) -> RunResult<()> {
    keep_time(app, now).await?;
    advance(app, now).await
}

/// A step's bookkeeping: the time driven, lapsed leases, silent miners.
async fn keep_time(app: &App, now: DateTime<Utc>) -> RunResult<()> {
    db::runs::set_driven_at(&app.db, app.run.id, now).await?;
    expire_leases(app, now).await?;
    release_silent_miners(app, now).await
}

/// A step's phase change, if one is due.
async fn advance(app: &App, now: DateTime<Utc>) -> RunResult<()> {
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
