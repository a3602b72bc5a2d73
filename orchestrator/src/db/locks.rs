//! The advisory locks: the leader's (one driver per run) and the phase lock uploads share and
//! phase changes take alone; giving a connection back with none held.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Connection, Postgres, Transaction};

/// The leader lock's class; its other key is the run's id, so that each run on a database has
/// a driver of its own (one key for all let one run's driver leave every other run undriven).
pub const LEADER_LOCK_CLASS: i32 = 0x696f_7464; // "iotd"
/// The phase lock's class (its other key is the run's id): the driver holds it exclusively
/// while it changes the phase, and submissions that must land wholly before or after a phase
/// change hold it shared.
pub const PHASE_LOCK_CLASS: i32 = 0x696f_7461; // "iota"

/// Takes the phase lock in shared mode for the rest of the transaction (uploads).
pub async fn phase_lock_shared(tx: &mut Transaction<'_, Postgres>, run: i64) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1, $2::int)")
        .bind(PHASE_LOCK_CLASS)
        .bind(run as i32)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Takes the phase lock alone for the rest of the transaction (phase changes).
pub async fn phase_lock_exclusive(
    tx: &mut Transaction<'_, Postgres>,
    run: i64,
) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2::int)")
        .bind(PHASE_LOCK_CLASS)
        .bind(run as i32)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Takes the run's leader lock on `conn` for its session, if no other session holds it.
pub async fn try_leader_lock(conn: &mut sqlx::PgConnection, run: i64) -> sqlx::Result<bool> {
    sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2::int)")
        .bind(LEADER_LOCK_CLASS)
        .bind(run as i32)
        .fetch_one(conn)
        .await
}

/// Gives the run's leader lock back on `conn`.
pub async fn leader_unlock(conn: &mut sqlx::PgConnection, run: i64) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_advisory_unlock($1, $2::int)")
        .bind(LEADER_LOCK_CLASS)
        .bind(run as i32)
        .execute(conn)
        .await?;
    Ok(())
}

/// Whether `conn` still answers.
pub async fn ping(conn: &mut sqlx::PgConnection) -> sqlx::Result<()> {
    sqlx::query("SELECT 1").execute(conn).await?;
    Ok(())
}

/// Closes a pooled connection that held (or may hold) a session-level lock (the leader's, or
/// the upgrade lock of [`crate::replicas`]), so that the lock goes with it rather than back into
/// the pool; the pool may open a replacement.
pub async fn release(conn: PoolConnection<Postgres>) {
    close_unlocked(conn.detach()).await;
}

/// Gives back every session-level advisory lock `conn` holds, answered, then closes it (within
/// 5 s). A close alone frees the locks only when the server's backend exits, after the client
/// has moved on: the next start-up could still find them held.
pub async fn close_unlocked(mut conn: sqlx::PgConnection) {
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

/// Serialises joins to run `run` for the rest of the transaction, so two replicas cannot both
/// fill the same emptiest stage.
pub async fn join_lock(tx: &mut Transaction<'_, Postgres>, run: i64) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('iota-join'), $1::int)")
        .bind(run as i32)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
