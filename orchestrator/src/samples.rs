//! A sample's transitions outside a miner's own completion: routing a forward hop (a new sample,
//! or the next attempt of one whose hop expired), ending a miner's epoch, re-routing an expired
//! hop, abandoning a sample. Shared by the miners' routes and the phase driver.

use chrono::{DateTime, Utc};
use iota_protocol::api::{Direction, Phase};
use sqlx::{Postgres, Transaction};

use crate::app::App;
use crate::db;
use crate::db::hops::{MovedHop, NewHop};
use crate::domain::leases::{self, Reroute, pickup_s, secs};
use crate::domain::placement::weighted_pick;
use crate::error::{RunError, RunResult};

/// The current epoch row of the run.
pub(crate) struct RunNow {
    pub epoch: u64,
    pub phase: Phase,
    pub phase_started: DateTime<Utc>,
    pub phase_deadline: DateTime<Utc>,
    pub merge_round: u32,
}

pub(crate) async fn run_now<'e, E: sqlx::PgExecutor<'e>>(db: E, run: i64) -> RunResult<RunNow> {
    let row = db::runs::current(db, run).await?;
    Ok(RunNow {
        epoch: row.epoch as u64,
        phase: Phase::parse(&row.phase)
            .ok_or_else(|| RunError::Invalid(format!("bad phase {}", row.phase)))?,
        phase_started: row.phase_started,
        phase_deadline: row.phase_deadline,
        merge_round: row.merge_round as u32,
    })
}

#[allow(clippy::too_many_arguments)]
pub(crate) async fn route_forward_sample(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    epoch: u64,
    sample_id: i64,
    stage: u32,
    attempt: i32,
    input: Option<serde_json::Value>,
    exclude: Option<&str>,
) -> RunResult<Option<i64>> {
    // Not to a miner whose work in the epoch has ended (see `close_epoch`).
    let all = db::miners::routable(&mut **tx, app.run.id, stage as i32, epoch as i64).await?;
    let preferred: Vec<(String, f64)> = all
        .iter()
        .filter(|(k, _)| Some(k.as_str()) != exclude)
        .cloned()
        .collect();
    let pool = if preferred.is_empty() {
        &all
    } else {
        &preferred
    };
    let picked = weighted_pick(pool, &mut rand::thread_rng()).map(str::to_owned);
    let Some(miner) = picked else {
        abandon_sample(
            tx,
            sample_id,
            app.now(),
            "no miner of the next stage is active and still training this epoch",
        )
        .await?;
        return Ok(None);
    };
    let hop = NewHop {
        run: app.run.id,
        epoch: epoch as i64,
        sample_id,
        stage: stage as i32,
        attempt,
        miner: &miner,
        input,
        pickup_by: app.now() + secs(pickup_s(app.config())),
    };
    Ok(Some(db::hops::insert_forward(&mut **tx, hop).await?))
}

/// Ends `miner`'s work in `epoch`: when it uploads a pseudo-gradient, or registers from a new
/// process after completing hops of the epoch (it no longer holds the state they left, so it
/// could neither upload a pseudo-gradient that matches them nor train on consistently).
/// Validators replay every hop it completed in the epoch and compare the result with its
/// pseudo-gradient, and its merge weight counts those hops, so no hop of the epoch may complete
/// after this: its open hops move as lapsed ones do (forward hops to another miner of the stage,
/// backward hops' samples end), and routing and leasing pass it over for the rest of the epoch.
/// An honest miner uploads only once a poll finds it nothing to do, so that takes nothing from
/// it.
///
/// A hop routed to the miner by a completion that raced with this is moved by the phase
/// driver's next step (`driver::expire_leases`); polls never lease it meanwhile.
pub(crate) async fn close_epoch(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    miner: &str,
    epoch: u64,
) -> RunResult<()> {
    // Tasks before the miner's row: a poll locks its tasks, then the row (`POLL_SQL`).
    let moved = db::hops::expire_of_miner_in(&mut **tx, app.run.id, miner, epoch as i64).await?;
    db::miners::end_epoch(&mut **tx, app.run.id, miner, epoch as i64).await?;
    for hop in &moved {
        reroute(tx, app, hop, "its miner ended its epoch").await?;
    }
    Ok(())
}

/// Moves an expired hop: a forward hop to another miner of its stage as the next attempt; a
/// backward hop cannot move (only its miner holds the activation cache), so its sample is
/// abandoned.
pub(crate) async fn reroute(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    hop: &MovedHop,
    why: &str,
) -> RunResult<()> {
    let direction = Direction::parse(&hop.direction)
        .ok_or_else(|| RunError::Invalid(format!("bad direction {}", hop.direction)))?;
    match leases::reroute(direction, hop.stage as u32, hop.attempt) {
        Reroute::Forward { stage, attempt } => {
            route_forward_sample(
                tx,
                app,
                hop.epoch as u64,
                hop.sample_id,
                stage,
                attempt,
                hop.input.clone(),
                Some(&hop.miner),
            )
            .await?;
        }
        Reroute::AbandonSample => abandon_sample(tx, hop.sample_id, app.now(), why).await?,
    }
    Ok(())
}

/// Gives up on a sample: its open hops are closed and it no longer counts as in flight.
pub(crate) async fn abandon_sample(
    tx: &mut Transaction<'_, Postgres>,
    sample_id: i64,
    now: DateTime<Utc>,
    why: &str,
) -> RunResult<()> {
    // Its open hops first, then the sample and the epoch's row: the order a completion takes
    // them in (its hop, its sample, the epoch's counters), so the two wait for each other
    // instead of deadlocking.
    db::hops::abandon_of_sample(&mut **tx, sample_id).await?;
    if let Some((run, epoch)) = db::samples::abandon(&mut **tx, sample_id, now).await? {
        db::epochs::count_abandoned(&mut **tx, run, epoch).await?;
    }
    metrics::counter!("iota_samples_abandoned_total").increment(1);
    tracing::debug!(sample_id, why, "sample abandoned");
    Ok(())
}
