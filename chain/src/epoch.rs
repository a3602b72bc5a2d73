//! When subnets run their epochs, by the rule of the runtime the client is talking to.
//!
//! Up to spec 403 the schedule is arithmetic: subtensor's `blocks_until_next_epoch` is
//! `tempo - (block + netuid + 1) % (tempo + 1)` and the epoch runs in the block where it is zero.
//! Commit-reveal counts epochs with `get_epoch_index = (block + netuid + 1) / (tempo + 1)`, which
//! steps one block after that run. From spec 404 ("dynamic tempo") a runtime keeps epochs in
//! state (`SubnetEpochIndex`, `LastEpochBlock`, `PendingEpochAt`) and a subnet owner can trigger
//! or retime them, so a client must read the index instead of computing it. Which rule applies is
//! read from the node's metadata, not from its spec number.

use subxt::Metadata;

use crate::client::{AtBlock, Subtensor};
use crate::error::ChainError;
use crate::metagraph::epoch_index;

/// How a runtime schedules epochs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EpochRule {
    /// Spec ≤ 403: the modulo schedule above.
    Modulo,
    /// Spec ≥ 404: the epoch index and last epoch block live in storage.
    Stateful,
}

const STATEFUL_ITEMS: [&str; 2] = ["SubnetEpochIndex", "LastEpochBlock"];

/// The rule `metadata`'s runtime follows: stateful when `SubtensorModule` declares the epoch
/// storage items.
pub fn epoch_rule(metadata: &Metadata) -> EpochRule {
    let storage = metadata
        .pallet_by_name("SubtensorModule")
        .and_then(|p| p.storage());
    match storage {
        Some(s) if STATEFUL_ITEMS.iter().all(|i| s.entry_by_name(i).is_some()) => {
            EpochRule::Stateful
        }
        _ => EpochRule::Modulo,
    }
}

/// Subtensor's `blocks_until_next_epoch` (modulo rule): 0 in the block that runs the epoch;
/// `u64::MAX` for tempo 0, which never runs one.
pub fn blocks_until_next_epoch(netuid: u16, tempo: u16, block: u64) -> u64 {
    if tempo == 0 {
        return u64::MAX;
    }
    let remainder = block.wrapping_add(u64::from(netuid) + 1) % (u64::from(tempo) + 1);
    u64::from(tempo).saturating_sub(remainder)
}

/// The first block at or after `block` that runs the subnet's epoch (modulo rule).
pub fn next_epoch_block(netuid: u16, tempo: u16, block: u64) -> Option<u64> {
    (tempo != 0).then(|| block + blocks_until_next_epoch(netuid, tempo, block))
}

/// The first block of the epoch `reveal_period` epochs after the one a transaction landing in
/// `next_block` belongs to, under the stateful rule: the subnet's next epoch runs at
/// `pending_epoch_at` when an owner triggered one (non-zero), else `tempo` blocks after
/// `last_epoch_block`, and in the next block when that is already past (the chain has not run it
/// yet); later epochs run every `tempo` blocks from the last run. A run increments the index in
/// its own block, before its transactions. This is the simulation `bittensor-drand` 2.x makes in
/// `get_encrypted_commit_v2`. An owner's trigger after the commit moves the reveal earlier, which
/// the chain tolerates (it keeps a commit whose pulse is not out yet until its reveal epoch ends).
pub fn stateful_first_reveal_block(
    last_epoch_block: u64,
    pending_epoch_at: u64,
    tempo: u16,
    next_block: u64,
    reveal_period: u64,
) -> u64 {
    let tempo = u64::from(tempo.max(1));
    let scheduled = match pending_epoch_at {
        0 => last_epoch_block.saturating_add(tempo),
        at => at,
    };
    let first_run = scheduled.max(next_block);
    // A run in the commit's own block starts the commit's epoch; one after it, the next.
    let runs_before_reveal = match first_run == next_block {
        true => reveal_period,
        false => reveal_period.saturating_sub(1),
    };
    first_run.saturating_add(runs_before_reveal.saturating_mul(tempo))
}

/// Storage key of a `netuid`-keyed `SubtensorModule` item, hashed as `metadata` declares.
fn netuid_key(metadata: &Metadata, item: &str, netuid: u16) -> Result<Vec<u8>, ChainError> {
    use subxt::ext::frame_decode::storage::StorageHasher;
    let entry = metadata
        .pallet_by_name("SubtensorModule")
        .and_then(|p| p.storage())
        .and_then(|s| s.entry_by_name(item))
        .ok_or_else(|| ChainError::Rpc(format!("storage SubtensorModule.{item} not declared")))?;
    let hasher = entry
        .keys()
        .next()
        .map(|k| k.hasher)
        .ok_or_else(|| ChainError::Rpc(format!("SubtensorModule.{item} is not a map")))?;
    let mut key = sp_crypto_hashing::twox_128(b"SubtensorModule").to_vec();
    key.extend(sp_crypto_hashing::twox_128(item.as_bytes()));
    let encoded = netuid.to_le_bytes();
    match hasher {
        StorageHasher::Identity => {}
        StorageHasher::Twox64Concat => key.extend(sp_crypto_hashing::twox_64(&encoded)),
        StorageHasher::Blake2_128Concat => key.extend(sp_crypto_hashing::blake2_128(&encoded)),
        other => {
            return Err(ChainError::Rpc(format!(
                "SubtensorModule.{item} uses hasher {other:?}, which the client does not follow"
            )));
        }
    }
    key.extend(encoded);
    Ok(key)
}

impl Subtensor {
    /// The first block of the epoch in which a commit landing in `next_block` is revealed
    /// (`reveal_period` epochs on), by the rule of the runtime at `at`.
    ///
    /// # Errors
    ///
    /// Transport errors, or a stateful runtime whose storage cannot be read.
    pub async fn first_reveal_block_at(
        &self,
        at: &AtBlock,
        netuid: u16,
        tempo: u16,
        next_block: u64,
        reveal_period: u64,
    ) -> Result<u64, ChainError> {
        match self.epoch_rule_at(at) {
            EpochRule::Modulo => Ok(crate::timelock::first_reveal_block(
                netuid,
                tempo,
                next_block,
                reveal_period,
            )),
            EpochRule::Stateful => {
                let keys = [
                    netuid_key(at.metadata_ref(), "LastEpochBlock", netuid)?,
                    netuid_key(at.metadata_ref(), "PendingEpochAt", netuid)?,
                ];
                let values = self.fetch_raw_many(at.block_hash(), &keys).await?;
                let mut read = values.into_iter().map(|v| match v {
                    None => Ok(0),
                    Some(bytes) => read_u64(&bytes),
                });
                let last = read.next().unwrap_or(Ok(0))?;
                let pending = read.next().unwrap_or(Ok(0))?;
                Ok(stateful_first_reveal_block(
                    last,
                    pending,
                    tempo,
                    next_block,
                    reveal_period,
                ))
            }
        }
    }

    /// The epoch rule of the runtime at `at`.
    pub fn epoch_rule_at(&self, at: &AtBlock) -> EpochRule {
        epoch_rule(at.metadata_ref())
    }

    /// The commit-reveal epoch index of `netuid` as of block `block` (the block after `at` for
    /// a transaction about to be sent): computed under the modulo rule, read from
    /// `SubnetEpochIndex` at `at` under the stateful one.
    ///
    /// # Errors
    ///
    /// Transport errors, or a stateful runtime whose storage cannot be read.
    pub async fn epoch_index_at(
        &self,
        at: &AtBlock,
        netuid: u16,
        tempo: u16,
        block: u64,
    ) -> Result<u64, ChainError> {
        match self.epoch_rule_at(at) {
            EpochRule::Modulo => Ok(epoch_index(netuid, tempo, block)),
            EpochRule::Stateful => {
                let key = netuid_key(at.metadata_ref(), "SubnetEpochIndex", netuid)?;
                let value = self.fetch_raw_many(at.block_hash(), &[key]).await?;
                match value.into_iter().next().flatten() {
                    None => Ok(0),
                    Some(bytes) => read_u64(&bytes),
                }
            }
        }
    }
}

fn read_u64(bytes: &[u8]) -> Result<u64, ChainError> {
    let raw: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| ChainError::decode("an epoch item", "not a u64"))?;
    Ok(u64::from_le_bytes(raw))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stateful_reveal_epoch_starts_at_the_runs_ahead() {
        // Last run at 100, tempo 10: the next at 110; a commit landing in 105 is in the epoch
        // that began at 100 and reveals from 110 (period 1) or 120 (period 2).
        assert_eq!(stateful_first_reveal_block(100, 0, 10, 105, 1), 110);
        assert_eq!(stateful_first_reveal_block(100, 0, 10, 105, 2), 120);
        // Landing in a run's own block: that run has begun the commit's epoch.
        assert_eq!(stateful_first_reveal_block(100, 0, 10, 110, 1), 120);
        // A run overdue (not recorded yet) runs in the next block; the schedule counts from it.
        assert_eq!(stateful_first_reveal_block(100, 0, 10, 131, 1), 141);
        // An owner's trigger sets the next run.
        assert_eq!(stateful_first_reveal_block(100, 103, 10, 101, 1), 103);
        assert_eq!(stateful_first_reveal_block(100, 103, 10, 101, 3), 123);
        // Tempo 0 is treated as 1 rather than dividing by zero.
        assert_eq!(stateful_first_reveal_block(5, 0, 0, 5, 1), 6);
    }

    /// Subtensor's documented examples for `blocks_until_next_epoch` (its emission tests:
    /// zero tempo, regular case, boundaries, overflow, alignment, netuids, large tempo,
    /// wrap-around), as (netuid, tempo, block, expected).
    #[test]
    fn blocks_until_next_epoch_matches_subtensor() {
        let max = u16::MAX;
        let cases: &[(u16, u16, u64, u64)] = &[
            (1, 0, 100, u64::MAX),
            (1, 10, 5, 3),
            (2, 20, 15, 2),
            (3, 30, 25, 1),
            (max, max, u64::MAX, 0),
            (max, max, 0, u64::from(max)),
            (max, max, u64::MAX - 1, 1),
            (1, 10, 9, 10),
            (2, 20, 21, 17),
            (2, 10, 5, 2),
            (3, 10, 5, 1),
            (1, max - 1, 100, u64::from(max) - 103),
            (1, 10, u64::MAX, 9),
            (1, 10, u64::MAX - 1, 10),
        ];
        for &(netuid, tempo, block, expected) in cases {
            assert_eq!(
                blocks_until_next_epoch(netuid, tempo, block),
                expected,
                "netuid {netuid} tempo {tempo} block {block}"
            );
        }
    }

    #[test]
    fn epoch_runs_where_the_formula_says_and_the_index_steps_right_after() {
        for netuid in [0u16, 1, 3, 17] {
            for tempo in [1u16, 10, 99, 360] {
                let mut runs = 0;
                for block in 0..3_000u64 {
                    let runs_here = (block + u64::from(netuid) + 1) % (u64::from(tempo) + 1)
                        == u64::from(tempo);
                    assert_eq!(
                        blocks_until_next_epoch(netuid, tempo, block) == 0,
                        runs_here
                    );
                    if runs_here {
                        runs += 1;
                        assert_eq!(next_epoch_block(netuid, tempo, block), Some(block));
                        // Commit-reveal's index counts the epoch from the next block on.
                        assert_eq!(
                            epoch_index(netuid, tempo, block + 1),
                            epoch_index(netuid, tempo, block) + 1
                        );
                    }
                }
                assert!(runs >= 3_000 / (u64::from(tempo) + 1), "{runs} epochs");
            }
        }
        assert_eq!(next_epoch_block(0, 0, 5), None);
    }
}
