//! The shared replay cache: signed requests' uuids, each kept until its recording process said.
//! By the database's clock, which every replica reads alike (see [`crate::clock`]).

use uuid::Uuid;

use super::Db;

/// Records `uuids` (sorted and unique, so that concurrent statements take the key locks in one
/// order), each kept for `keep_ms`: the ones not seen before.
pub async fn record<'e>(db: impl Db<'e>, uuids: &[Uuid], keep_ms: i64) -> sqlx::Result<Vec<Uuid>> {
    sqlx::query_scalar(
        "INSERT INTO request_uuids (uuid, seen_at, expires_at)
         SELECT u, now(), now() + $2 * interval '1 millisecond'
         FROM unnest($1::uuid[]) AS u ORDER BY u
         ON CONFLICT DO NOTHING RETURNING uuid",
    )
    .bind(uuids)
    .bind(keep_ms)
    .fetch_all(db)
    .await
}

/// Deletes the uuids past their time: how many.
pub async fn prune<'e>(db: impl Db<'e>) -> sqlx::Result<u64> {
    let r = sqlx::query("DELETE FROM request_uuids WHERE expires_at < now()")
        .execute(db)
        .await?;
    Ok(r.rows_affected())
}
