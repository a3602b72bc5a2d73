//! A partition's merge owners: those a round adds, written in bounded statements.

use std::collections::HashMap;

use sqlx::{Postgres, Transaction};

use crate::app::App;
use crate::domain::placement::{OwnerCandidate, pick_added_owners};
use crate::error::RunResult;

/// Partitions written per statement when merging starts, or at an epoch's end.
pub(crate) const PARTITIONS_PER_STATEMENT: usize = 4096;

/// Adds one owner to a partition (see [`add_owners`]). Returns whether one was found.
pub async fn add_owner(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    epoch: u64,
    stage: u32,
    partition: u32,
    round: u32,
) -> RunResult<bool> {
    Ok(add_owners(tx, app, epoch, &[(stage, partition)], round).await? == 1)
}

/// Adds one owner to each of `partitions` (stage, partition), as [`pick_added_owners`] ranks
/// active miners, each pick counted before the next. Three reads and a chunked insert whatever
/// the number: a merging deadline can leave every partition of the epoch open, and this runs
/// under the exclusive phase lock. Returns how many were given one.
pub async fn add_owners(
    tx: &mut Transaction<'_, Postgres>,
    app: &App,
    epoch: u64,
    partitions: &[(u32, u32)],
    round: u32,
) -> RunResult<usize> {
    if partitions.is_empty() {
        return Ok(0);
    }
    let active: Vec<(String, i32)> =
        sqlx::query_as("SELECT hotkey, stage FROM miners WHERE run_id = $1 AND status = 'active'")
            .bind(app.run.id)
            .fetch_all(&mut **tx)
            .await?;
    let owned: HashMap<String, i64> = sqlx::query_as(
        "SELECT miner, count(*) FROM partition_owners WHERE run_id = $1 AND epoch = $2
         GROUP BY miner",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .fetch_all(&mut **tx)
    .await?
    .into_iter()
    .collect();
    let (stages, parts): (Vec<i32>, Vec<i32>) = partitions
        .iter()
        .map(|(s, p)| (*s as i32, *p as i32))
        .unzip();
    let mut owners: HashMap<(u32, u32), Vec<String>> = HashMap::new();
    let rows: Vec<(i32, i32, String)> = sqlx::query_as(
        "SELECT o.stage, o.partition, o.miner FROM partition_owners o
         JOIN unnest($3::int4[], $4::int4[]) AS t(s, p) ON o.stage = t.s AND o.partition = t.p
         WHERE o.run_id = $1 AND o.epoch = $2",
    )
    .bind(app.run.id)
    .bind(epoch as i64)
    .bind(&stages)
    .bind(&parts)
    .fetch_all(&mut **tx)
    .await?;
    for (stage, partition, miner) in rows {
        owners
            .entry((stage as u32, partition as u32))
            .or_default()
            .push(miner);
    }
    let mut candidates: Vec<OwnerCandidate> = active
        .into_iter()
        .map(|(hotkey, stage)| OwnerCandidate {
            owned: owned.get(&hotkey).copied().unwrap_or(0) as u64,
            hotkey,
            stage: stage as u32,
        })
        .collect();
    let picks = pick_added_owners(
        &mut candidates,
        partitions,
        &mut owners,
        &mut rand::thread_rng(),
    );
    let added: Vec<(u32, u32, String)> = partitions
        .iter()
        .zip(picks)
        .filter_map(|(&(stage, partition), pick)| {
            let miner = candidates[pick?].hotkey.clone();
            tracing::debug!(epoch, stage, partition, %miner, round, "partition given another owner");
            Some((stage, partition, miner))
        })
        .collect();
    insert_owners(tx, app.run.id, epoch, &added, round).await?;
    Ok(added.len())
}

/// Rows written per statement by [`insert_owners`].
const OWNERS_PER_STATEMENT: usize = 8192;

/// Records owners (stage, partition, miner) of `round`; an existing one is left as it is.
pub(crate) async fn insert_owners(
    tx: &mut Transaction<'_, Postgres>,
    run: i64,
    epoch: u64,
    owners: &[(u32, u32, String)],
    round: u32,
) -> RunResult<()> {
    for chunk in owners.chunks(OWNERS_PER_STATEMENT) {
        let stages: Vec<i32> = chunk.iter().map(|(s, _, _)| *s as i32).collect();
        let partitions: Vec<i32> = chunk.iter().map(|(_, p, _)| *p as i32).collect();
        let miners: Vec<&str> = chunk.iter().map(|(_, _, m)| m.as_str()).collect();
        sqlx::query(
            "INSERT INTO partition_owners (run_id, epoch, stage, partition, miner, round)
             SELECT $1, $2, s, p, m, $6
             FROM unnest($3::int4[], $4::int4[], $5::text[]) AS t(s, p, m)
             ON CONFLICT DO NOTHING",
        )
        .bind(run)
        .bind(epoch as i64)
        .bind(&stages)
        .bind(&partitions)
        .bind(&miners)
        .bind(round as i32)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}
