//! Objects the database records: sealed objects' keys, and objects reported bad.

use super::Db;

/// Which table records a sealed object.
#[derive(Clone, Copy, Debug)]
pub enum SealedIn {
    /// `pseudo_gradients`.
    PseudoGradients,
    /// `merge_results`.
    MergeResults,
}

/// Whether a row of `table` records the object `key`.
pub async fn is_recorded<'e>(
    db: impl Db<'e>,
    run: i64,
    table: SealedIn,
    key: &str,
) -> sqlx::Result<bool> {
    let sql = match table {
        SealedIn::PseudoGradients => {
            "SELECT 1 FROM pseudo_gradients WHERE run_id = $1 AND blob->>'key' = $2 LIMIT 1"
        }
        SealedIn::MergeResults => {
            "SELECT 1 FROM merge_results WHERE run_id = $1 AND blob->>'key' = $2 LIMIT 1"
        }
    };
    let recorded: Option<i32> = sqlx::query_scalar(sql)
        .bind(run)
        .bind(key)
        .fetch_optional(db)
        .await?;
    Ok(recorded.is_some())
}

/// Why a confirmed report named object `key` bad, if one did.
pub async fn bad_reason<'e>(db: impl Db<'e>, run: i64, key: &str) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT reason FROM bad_objects WHERE run_id = $1 AND key = $2")
        .bind(run)
        .bind(key)
        .fetch_optional(db)
        .await
}

/// Records a confirmed report that `key` is bad (the first one stays).
pub async fn record_bad<'e>(
    db: impl Db<'e>,
    run: i64,
    key: &str,
    reporter: &str,
    reason: &str,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO bad_objects (run_id, key, reporter, reason) VALUES ($1, $2, $3, $4)
         ON CONFLICT DO NOTHING",
    )
    .bind(run)
    .bind(key)
    .bind(reporter)
    .bind(reason)
    .execute(db)
    .await?;
    Ok(())
}
