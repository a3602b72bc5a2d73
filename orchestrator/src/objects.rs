//! Objects sealed in the store before the database records them: a submission that lost its
//! race to be recorded leaves one behind, which is deleted unless a row records its key.

use crate::app::App;
use crate::error::RunResult;

/// Which table records a sealed object.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SealedIn {
    PseudoGradients,
    MergeResults,
}

/// Deletes a sealed object that lost its race to be recorded, unless a row records that very
/// key: a retry of an accepted submission seals to the same key as the accepted one.
pub(crate) async fn delete_unless_recorded(app: &App, table: SealedIn, key: &str) -> RunResult<()> {
    let sql = match table {
        SealedIn::PseudoGradients => {
            "SELECT 1 FROM pseudo_gradients WHERE run_id = $1 AND blob->>'key' = $2 LIMIT 1"
        }
        SealedIn::MergeResults => {
            "SELECT 1 FROM merge_results WHERE run_id = $1 AND blob->>'key' = $2 LIMIT 1"
        }
    };
    let recorded: Option<i32> = sqlx::query_scalar(sql)
        .bind(app.run.id)
        .bind(key)
        .fetch_optional(&app.db)
        .await?;
    if recorded.is_none() {
        app.store.delete(key).await?;
    }
    Ok(())
}
