//! One schema at a time on a database. Replicas built for one schema share a database freely;
//! across an upgrade the schema changes under the older code, which would go on serving with
//! queries written for the schema before. So:
//!
//! * [`migrate`] refuses a database that a newer version has already migrated, and refuses to
//!   start (and so to migrate) while a replica built for an older schema was seen within
//!   [`LIVE_WITHIN`], or still holds a connection (each connection carries its schema in its
//!   `application_name`, see [`application_name`]: a replica that stalls past the live window
//!   keeps its connections);
//! * [`Replica::join`] records this process, and [`Replica::keep_alive`] records it again every
//!   [`BEAT`] and reports when a newer version has migrated the database, upon which `run` stops
//!   serving with [`OrchestratorError::SchemaNewer`].
//!
//! The check and the migration, and the check and the join, each hold one advisory lock, so two
//! versions starting at once are ordered: the older finds the newer schema, or the newer finds
//! the older replica.

use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool, Row};
use tokio::sync::watch;

use crate::db::locks::{close_unlocked, release};
use crate::error::OrchestratorError;

static MIGRATOR: Migrator = sqlx::migrate!("../migrations/orchestrator");

/// How often a serving replica records that it is alive, and looks at the schema.
pub const BEAT: Duration = Duration::from_secs(5);

/// A replica seen this recently counts as serving. Four beats: a replica that has just stopped
/// (or was killed) blocks an upgrade for at most this long.
pub const LIVE_WITHIN: Duration = Duration::from_secs(20);

/// Rows of replicas gone this long are removed when another joins.
const FORGET_AFTER_HOURS: i32 = 24;

/// The upgrade lock's class (a session-level advisory lock with the key 0).
pub const UPGRADE_LOCK_CLASS: i32 = 0x7570_6772; // "upgr"

/// The newest migration this binary carries: the schema it was built for.
pub fn schema_version() -> i64 {
    MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
}

/// What every connection of this binary is called in `pg_stat_activity`: its version and schema
/// (at most 63 bytes, PostgreSQL's limit).
pub fn application_name() -> String {
    format!(
        "iota-orchestrator {} schema {}",
        env!("CARGO_PKG_VERSION"),
        schema_version()
    )
}

fn dberr(e: sqlx::Error) -> OrchestratorError {
    OrchestratorError::Database(e.to_string())
}

/// Applies the migrations, unless the database is newer than this binary or a replica built for
/// an older schema still serves it.
pub(crate) async fn migrate(
    options: &PgConnectOptions,
    db: &PgPool,
) -> Result<(), OrchestratorError> {
    // The lock is held on a connection of its own, outside the pool, which the migrator uses:
    // a pool of one connection could not give it a second.
    let mut conn = PgConnection::connect_with(options).await.map_err(dberr)?;
    let out = migrate_locked(&mut conn, db).await;
    close_unlocked(conn).await;
    out
}

async fn migrate_locked(conn: &mut PgConnection, db: &PgPool) -> Result<(), OrchestratorError> {
    lock(conn).await?;
    refuse_newer_schema(conn).await?;
    refuse_older_replicas(conn).await?;
    MIGRATOR
        .run(db)
        .await
        .map_err(|e| OrchestratorError::Migrate(e.to_string()))
}

/// Takes the upgrade lock for the rest of the connection's session.
async fn lock(conn: &mut PgConnection) -> Result<(), OrchestratorError> {
    sqlx::query("SELECT pg_advisory_lock($1, 0)")
        .bind(UPGRADE_LOCK_CLASS)
        .execute(conn)
        .await
        .map_err(dberr)?;
    Ok(())
}

/// The newest migration applied to the database; none before the first start.
async fn applied_schema(conn: &mut PgConnection) -> Result<Option<i64>, sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(None);
    }
    sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
        .fetch_one(&mut *conn)
        .await
}

async fn refuse_newer_schema(conn: &mut PgConnection) -> Result<(), OrchestratorError> {
    let known = schema_version();
    match applied_schema(conn).await.map_err(dberr)? {
        Some(applied) if applied > known => Err(OrchestratorError::SchemaNewer { applied, known }),
        _ => Ok(()),
    }
}

async fn refuse_older_replicas(conn: &mut PgConnection) -> Result<(), OrchestratorError> {
    let mut seen = recorded_older_replicas(conn).await.map_err(dberr)?;
    seen.extend(older_connections(conn).await.map_err(dberr)?);
    if seen.is_empty() {
        return Ok(());
    }
    Err(OrchestratorError::OlderReplicas {
        replicas: seen.join("; "),
        known: schema_version(),
        wait_s: LIVE_WITHIN.as_secs(),
    })
}

/// Replicas built for an older schema that recorded themselves within [`LIVE_WITHIN`].
async fn recorded_older_replicas(conn: &mut PgConnection) -> Result<Vec<String>, sqlx::Error> {
    let exists: bool =
        sqlx::query_scalar("SELECT to_regclass('orchestrator_replicas') IS NOT NULL")
            .fetch_one(&mut *conn)
            .await?;
    if !exists {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "SELECT host, address, pid, version, schema_version,
                extract(epoch FROM now() - last_seen)::float8 AS ago
         FROM orchestrator_replicas
         WHERE schema_version < $1 AND last_seen > now() - make_interval(secs => $2)
         ORDER BY last_seen DESC",
    )
    .bind(schema_version())
    .bind(LIVE_WITHIN.as_secs_f64())
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|row| {
            let host: String = row.try_get("host")?;
            let address: String = row.try_get("address")?;
            let pid: i64 = row.try_get("pid")?;
            let version: String = row.try_get("version")?;
            let schema: i64 = row.try_get("schema_version")?;
            let ago: f64 = row.try_get("ago")?;
            Ok(format!(
                "{host} {address} pid {pid}, iota {version}, schema {schema}, seen {ago:.0} s ago"
            ))
        })
        .collect()
}

/// Connections of orchestrators built for an older schema, by their [`application_name`] and
/// client address, with their server processes' pids: a connection left open by a machine that
/// is gone lasts until TCP keepalive notices (hours by default), and `pg_terminate_backend(pid)`
/// ends it sooner. A replica that stalls longer than [`LIVE_WITHIN`] stops beating but keeps its
/// connections (its pool, the poll view's `LISTEN`, the run's leader lock), so it is still found.
async fn older_connections(conn: &mut PgConnection) -> Result<Vec<String>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT application_name, count(*) AS n,
                coalesce('from ' || host(client_addr), 'over a local socket') AS client,
                string_agg(pid::text, ', ' ORDER BY pid) AS pids
         FROM (SELECT application_name, client_addr, pid,
                      substring(application_name FROM ' schema ([0-9]{1,18})$')::int8 AS schema
               FROM pg_stat_activity
               WHERE datname = current_database() AND pid <> pg_backend_pid()
                 AND application_name LIKE 'iota-orchestrator %') AS orchestrators
         WHERE schema < $1
         GROUP BY application_name, client_addr
         ORDER BY application_name, client",
    )
    .bind(schema_version())
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|row| {
            let name: String = row.try_get("application_name")?;
            let n: i64 = row.try_get("n")?;
            let client: String = row.try_get("client")?;
            let pids: String = row.try_get("pids")?;
            let plural = if n == 1 { "" } else { "s" };
            Ok(format!(
                "{n} connection{plural} {client} ({name}), server pid{plural} {pids}"
            ))
        })
        .collect()
}

/// This process, as other replicas see it.
#[derive(Debug, Clone)]
pub struct Replica {
    id: uuid::Uuid,
    host: String,
    address: String,
}

impl Replica {
    /// Records this process as serving at `address`, unless a newer version has migrated the
    /// database since it was opened.
    pub async fn join(db: &PgPool, address: String) -> Result<Self, OrchestratorError> {
        let replica = Self {
            id: uuid::Uuid::new_v4(),
            host: host_name(),
            address,
        };
        let mut conn = db.acquire().await.map_err(dberr)?;
        let out = replica.join_locked(&mut conn).await;
        release(conn).await;
        out.map(|()| replica)
    }

    async fn join_locked(&self, conn: &mut PgConnection) -> Result<(), OrchestratorError> {
        lock(conn).await?;
        refuse_newer_schema(conn).await?;
        sqlx::query(
            "DELETE FROM orchestrator_replicas
             WHERE last_seen < now() - make_interval(hours => $1)",
        )
        .bind(FORGET_AFTER_HOURS)
        .execute(&mut *conn)
        .await
        .map_err(dberr)?;
        self.record(conn).await.map_err(dberr)
    }

    /// Inserts or refreshes this process's row (again after a long stall removed it).
    async fn record(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO orchestrator_replicas (id, host, address, pid, version, schema_version)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (id) DO UPDATE SET last_seen = now()",
        )
        .bind(self.id)
        .bind(&self.host)
        .bind(&self.address)
        .bind(i64::from(std::process::id()))
        .bind(env!("CARGO_PKG_VERSION"))
        .bind(schema_version())
        .execute(conn)
        .await?;
        Ok(())
    }

    /// One beat: the schema a newer version has migrated the database to, if it has.
    async fn beat(&self, db: &PgPool) -> Result<Option<i64>, sqlx::Error> {
        let mut conn = db.acquire().await?;
        if let Some(applied) = applied_schema(&mut conn).await?
            && applied > schema_version()
        {
            return Ok(Some(applied));
        }
        self.record(&mut conn).await?;
        Ok(None)
    }

    /// Beats every [`BEAT`] until `stop`, then removes this process's row. Sets `upgraded` to
    /// the newer schema and returns when a newer version has migrated the database. A database
    /// that does not answer is logged and tried again at the next beat.
    pub async fn keep_alive(
        self,
        db: PgPool,
        upgraded: watch::Sender<Option<i64>>,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(BEAT) => {}
                _ = stop.changed() => break,
            }
            // Bounded, so that a database that hangs cannot hold up the shutdown.
            match tokio::time::timeout(BEAT, self.beat(&db)).await {
                Ok(Ok(Some(applied))) => {
                    tracing::error!(
                        applied,
                        known = schema_version(),
                        "a newer orchestrator has migrated the database: this replica stops serving"
                    );
                    let _ = upgraded.send(Some(applied));
                    break;
                }
                Ok(Ok(None)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "could not record this replica as alive"),
                Err(_) => tracing::warn!("the database did not answer this replica's beat"),
            }
        }
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            sqlx::query("DELETE FROM orchestrator_replicas WHERE id = $1")
                .bind(self.id)
                .execute(&db),
        )
        .await;
    }
}

/// This machine's name, for the message that tells an operator which replica to stop.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown host".to_owned())
}
