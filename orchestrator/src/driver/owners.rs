//! A partition's merge owners: those a round adds, written in bounded statements.

use std::collections::HashMap;

use sqlx::{Postgres, Transaction};

use crate::app::App;
use crate::db;
use crate::domain::placement::{OwnerCandidate, pick_added_owners};
use crate::error::RunResult;

/// Partitions written per statement when merging starts, or at an epoch's end.
pub(crate) const PARTITIONS_PER_STATEMENT: usize = 4096;

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
    let active = db::miners::active_with_stage(&mut **tx, app.run.id).await?;
    let owned: HashMap<String, i64> =
        db::partitions::owned_counts(&mut **tx, app.run.id, epoch as i64)
            .await?
            .into_iter()
            .collect();
    let (stages, parts): (Vec<i32>, Vec<i32>) = partitions
        .iter()
        .map(|(s, p)| (*s as i32, *p as i32))
        .unzip();
    let mut owners: HashMap<(u32, u32), Vec<String>> = HashMap::new();
    let rows =
        db::partitions::owners_of(&mut **tx, app.run.id, epoch as i64, (&stages, &parts)).await?;
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
        let columns = (&stages[..], &partitions[..], &miners[..]);
        db::partitions::insert_owners(&mut **tx, run, epoch as i64, columns, round as i32).await?;
    }
    Ok(())
}
