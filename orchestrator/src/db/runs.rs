//! The run's row: where the run is and when it was last driven.

use chrono::{DateTime, Utc};
use sqlx::Row;

use super::Db;

/// The run's row as stored.
pub struct RunRow {
    /// The current epoch.
    pub epoch: i64,
    /// The phase, as stored.
    pub phase: String,
    /// When the phase started.
    pub phase_started: DateTime<Utc>,
    /// When the phase ends.
    pub phase_deadline: DateTime<Utc>,
    /// The merge round.
    pub merge_round: i32,
}

/// The run's current epoch and phase.
pub async fn current<'e>(db: impl Db<'e>, run: i64) -> sqlx::Result<RunRow> {
    let row = sqlx::query(
        "SELECT epoch, phase, phase_started, phase_deadline, merge_round FROM runs WHERE id = $1",
    )
    .bind(run)
    .fetch_one(db)
    .await?;
    Ok(RunRow {
        epoch: row.try_get("epoch")?,
        phase: row.try_get("phase")?,
        phase_started: row.try_get("phase_started")?,
        phase_deadline: row.try_get("phase_deadline")?,
        merge_round: row.try_get("merge_round")?,
    })
}

/// Records that the driver stepped at `now`.
pub async fn set_driven_at<'e>(db: impl Db<'e>, run: i64, now: DateTime<Utc>) -> sqlx::Result<()> {
    sqlx::query("UPDATE runs SET driven_at = $2 WHERE id = $1")
        .bind(run)
        .bind(now)
        .execute(db)
        .await?;
    Ok(())
}

/// Gives the phase back the time it had left at the last step (`driven_at`), from `now`; an
/// uploading phase past its deadline but held open by reservations (up to `uploading` more) too.
pub async fn give_back_phase_time<'e>(
    db: impl Db<'e>,
    run: i64,
    now: DateTime<Utc>,
    uploading: chrono::Duration,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE runs SET phase_deadline = $2 + (phase_deadline - driven_at)
         WHERE id = $1 AND driven_at < $2
           AND (phase_deadline > driven_at
                OR (phase = 'uploading' AND phase_deadline + $3 > driven_at))",
    )
    .bind(run)
    .bind(now)
    .bind(uploading)
    .execute(db)
    .await?;
    Ok(())
}

/// Moves `driven_at` forward to `now` (never back).
pub async fn advance_driven_at<'e>(
    db: impl Db<'e>,
    run: i64,
    now: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query("UPDATE runs SET driven_at = greatest(driven_at, $2) WHERE id = $1")
        .bind(run)
        .bind(now)
        .execute(db)
        .await?;
    Ok(())
}

/// Sets the run's phase, when it started and ends, and its merge round.
pub async fn set_phase<'e>(
    db: impl Db<'e>,
    run: i64,
    phase: &str,
    (started, deadline): (DateTime<Utc>, DateTime<Utc>),
    merge_round: i32,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE runs SET phase = $2, phase_started = $3, phase_deadline = $4, merge_round = $5
         WHERE id = $1",
    )
    .bind(run)
    .bind(phase)
    .bind(started)
    .bind(deadline)
    .bind(merge_round)
    .execute(db)
    .await?;
    Ok(())
}

/// Sets the run's epoch.
pub async fn set_epoch<'e>(db: impl Db<'e>, run: i64, epoch: i64) -> sqlx::Result<()> {
    sqlx::query("UPDATE runs SET epoch = $2 WHERE id = $1")
        .bind(run)
        .bind(epoch)
        .execute(db)
        .await?;
    Ok(())
}

/// A run to create.
pub struct NewRun<'a> {
    /// Its name.
    pub name: &'a str,
    /// Its config, as JSON.
    pub config: &'a serde_json::Value,
    /// Its subnet.
    pub netuid: i32,
    /// The orchestrator's hotkey.
    pub orchestrator: &'a str,
    /// When it is created.
    pub at: DateTime<Utc>,
    /// When its first training phase ends.
    pub training_until: DateTime<Utc>,
}

/// Creates the run unless one of that name exists.
pub async fn create<'e>(db: impl Db<'e>, run: NewRun<'_>) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO runs (name, config, netuid, orchestrator, created_at, phase_started,
             phase_deadline)
         VALUES ($1, $2, $3, $4, $5, $5, $6)
         ON CONFLICT (name) DO NOTHING",
    )
    .bind(run.name)
    .bind(run.config)
    .bind(run.netuid)
    .bind(run.orchestrator)
    .bind(run.at)
    .bind(run.training_until)
    .execute(db)
    .await?;
    Ok(())
}

/// A run as stored.
pub struct Stored {
    /// Its id.
    pub id: i64,
    /// Its config, as JSON.
    pub config: serde_json::Value,
    /// Its subnet.
    pub netuid: i32,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// Its secret for session keys.
    pub session_secret: Vec<u8>,
}

/// The run named `name`.
pub async fn by_name<'e>(db: impl Db<'e>, name: &str) -> sqlx::Result<Stored> {
    let row = sqlx::query(
        "SELECT id, config, netuid, created_at, session_secret FROM runs WHERE name = $1",
    )
    .bind(name)
    .fetch_one(db)
    .await?;
    Ok(Stored {
        id: row.try_get("id")?,
        config: row.try_get("config")?,
        netuid: row.try_get("netuid")?,
        created_at: row.try_get("created_at")?,
        session_secret: row.try_get("session_secret")?,
    })
}
