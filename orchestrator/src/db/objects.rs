//! Whether a row records a sealed object's key.

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
