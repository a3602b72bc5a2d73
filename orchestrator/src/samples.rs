//! A sample's transitions outside a miner's own completion: routing a forward hop (a new sample,
//! or the next attempt of one whose hop expired), ending a miner's epoch, re-routing an expired
//! hop, abandoning a sample. Shared by the miners' routes and the phase driver.

use chrono::{DateTime, Utc};
use iota_protocol::api::{Direction, Phase};
use sqlx::{Postgres, Row, Transaction};

use crate::app::App;
use crate::domain::leases::{self, Reroute, pickup_s};
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
    let row = sqlx::query(
        "SELECT epoch, phase, phase_started, phase_deadline, merge_round FROM runs WHERE id = $1",
    )
    .bind(run)
    .fetch_one(db)
    .await?;
    let phase: String = row.try_get("phase")?;
    Ok(RunNow {
        epoch: row.try_get::<i64, _>("epoch")? as u64,
        phase: Phase::parse(&phase)
            .ok_or_else(|| RunError::Invalid(format!("bad phase {phase}")))?,
        phase_started: row.try_get("phase_started")?,
        phase_deadline: row.try_get("phase_deadline")?,
        merge_round: row.try_get::<i32, _>("merge_round")? as u32,
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
    let rows = sqlx::query(
        "SELECT hotkey, tokens_per_s FROM miners
         WHERE run_id = $1 AND stage = $2 AND status = 'active'
           AND ended_epoch IS DISTINCT FROM $3
         ORDER BY hotkey",
    )
    .bind(app.run.id)
    .bind(stage as i32)
    .bind(epoch as i64)
    .fetch_all(&mut **tx)
    .await?;
    let all: Vec<(String, f64)> = rows
        .iter()
        .map(|r| Ok((r.try_get("hotkey")?, r.try_get("tokens_per_s")?)))
        .collect::<Result<_, sqlx::Error>>()?;
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
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, attempt, miner, status, input,
             leased_until)
         VALUES ($1, $2, $3, $4, 'forward', $5, $6, 'pending', $7, $8 + make_interval(secs => $9))
         RETURNING id",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(sample_id)
    .bind(stage as i32)
    .bind(attempt)
    .bind(&miner)
    .bind(input)
    .bind(app.now())
    .bind(pickup_s(app.config()) as f64)
    .fetch_one(&mut **tx)
    .await?;
    Ok(Some(id))
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
    let rows = sqlx::query(
        "UPDATE tasks SET status = 'expired'
         WHERE run_id = $1 AND miner = $2 AND epoch = $3 AND status IN ('pending', 'leased')
         RETURNING epoch, sample_id, stage, direction, attempt, miner, input",
    )
    .bind(app.run.id)
    .bind(miner)
    .bind(epoch as i64)
    .fetch_all(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE miners SET ended_epoch = $3
         WHERE run_id = $1 AND hotkey = $2 AND (ended_epoch IS NULL OR ended_epoch < $3)",
    )
    .bind(app.run.id)
    .bind(miner)
    .bind(epoch as i64)
    .execute(&mut **tx)
    .await?;
    for row in &rows {
        reroute(tx, app, row, "its miner ended its epoch").await?;
    }
    Ok(())
}

/// Moves an expired hop (`row`: its epoch, sample, stage, direction, attempt, miner and input):
/// a forward hop to another miner of its stage as the next attempt; a backward hop cannot move
/// (only its miner holds the activation cache), so its sample is abandoned.
pub(crate) async fn reroute(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    row: &sqlx::postgres::PgRow,
    why: &str,
) -> RunResult<()> {
    let direction: String = row.try_get("direction")?;
    let direction = Direction::parse(&direction)
        .ok_or_else(|| RunError::Invalid(format!("bad direction {direction}")))?;
    let sample_id: i64 = row.try_get("sample_id")?;
    let stage = row.try_get::<i32, _>("stage")? as u32;
    match leases::reroute(direction, stage, row.try_get("attempt")?) {
        Reroute::Forward { stage, attempt } => {
            let miner: String = row.try_get("miner")?;
            let epoch = row.try_get::<i64, _>("epoch")? as u64;
            let input = row.try_get("input")?;
            route_forward_sample(
                tx,
                app,
                epoch,
                sample_id,
                stage,
                attempt,
                input,
                Some(&miner),
            )
            .await?;
        }
        Reroute::AbandonSample => abandon_sample(tx, sample_id, app.now(), why).await?,
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
    sqlx::query("UPDATE tasks SET status = 'abandoned' WHERE sample_id = $1 AND status IN ('pending', 'leased')")
        .bind(sample_id)
        .execute(&mut **tx)
        .await?;
    let ended: Option<(i64, i64)> = sqlx::query_as(
        "UPDATE samples SET status = 'abandoned', completed_at = $2
         WHERE id = $1 AND status IN ('forward', 'backward') RETURNING run_id, epoch",
    )
    .bind(sample_id)
    .bind(now)
    .fetch_optional(&mut **tx)
    .await?;
    if let Some((run, epoch)) = ended {
        sqlx::query(
            "UPDATE epochs SET samples_abandoned = samples_abandoned + 1
             WHERE run_id = $1 AND epoch = $2",
        )
        .bind(run)
        .bind(epoch)
        .execute(&mut **tx)
        .await?;
    }
    metrics::counter!("iota_samples_abandoned_total").increment(1);
    tracing::debug!(sample_id, why, "sample abandoned");
    Ok(())
}
