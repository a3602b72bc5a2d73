//! The run's epoch status as stored: what heartbeats, work polls and the explorer answer with.

use chrono::{DateTime, Utc};
use iota_protocol::api::{EpochStatus, Phase};
use sqlx::Row;

use crate::error::{RunError, RunResult};

/// Where `run` is now, read from `db`.
pub async fn read_epoch_status(
    db: &sqlx::PgPool,
    run: i64,
    now: DateTime<Utc>,
) -> RunResult<EpochStatus> {
    // One round trip: every heartbeat answers with this (work polls read it in their statement).
    let row = sqlx::query(
        "SELECT r.epoch AS status_epoch, r.phase AS status_phase,
                r.phase_started AS status_phase_started, r.phase_deadline AS status_phase_deadline,
                r.merge_round AS status_merge_round, e.samples_started AS status_samples_started,
                e.samples_completed AS status_samples_completed,
                e.samples_abandoned AS status_samples_abandoned
         FROM runs r JOIN epochs e ON e.run_id = r.id AND e.epoch = r.epoch WHERE r.id = $1",
    )
    .bind(run)
    .fetch_one(db)
    .await?;
    status_from_row(&row, now)
}

/// The epoch status from a row with the `status_*` columns of [`read_epoch_status`]'s query, as
/// answered at `now`.
pub fn status_from_row(row: &sqlx::postgres::PgRow, now: DateTime<Utc>) -> RunResult<EpochStatus> {
    let phase: String = row.try_get("status_phase")?;
    let phase_started: DateTime<Utc> = row.try_get("status_phase_started")?;
    let phase_deadline: DateTime<Utc> = row.try_get("status_phase_deadline")?;
    Ok(EpochStatus {
        epoch: row.try_get::<i64, _>("status_epoch")? as u64,
        phase: Phase::parse(&phase)
            .ok_or_else(|| RunError::Invalid(format!("bad phase {phase}")))?,
        phase_started_ms: phase_started.timestamp_millis(),
        phase_deadline_ms: phase_deadline.timestamp_millis(),
        merge_round: row.try_get::<i32, _>("status_merge_round")? as u32,
        samples_started: row.try_get::<i64, _>("status_samples_started")? as u64,
        samples_completed: row.try_get::<i64, _>("status_samples_completed")? as u64,
        samples_abandoned: row.try_get::<i64, _>("status_samples_abandoned")? as u64,
        server_time_ms: now.timestamp_millis(),
    })
}
