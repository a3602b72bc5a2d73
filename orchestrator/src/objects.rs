//! Objects sealed in the store before the database records them: a submission that lost its
//! race to be recorded leaves one behind, which is deleted unless a row records its key.

use crate::app::App;
use crate::db;
pub(crate) use crate::db::objects::SealedIn;
use crate::error::RunResult;

/// Deletes a sealed object that lost its race to be recorded, unless a row records that very
/// key: a retry of an accepted submission seals to the same key as the accepted one.
pub(crate) async fn delete_unless_recorded(app: &App, table: SealedIn, key: &str) -> RunResult<()> {
    if !db::objects::is_recorded(&app.db, app.run.id, table, key).await? {
        app.store.delete(key).await?;
    }
    Ok(())
}
