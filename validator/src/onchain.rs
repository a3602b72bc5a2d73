//! Reads of the chain's weight storage that the chain client has no call for: a validator's
//! `Weights` row and its pending `WeightCommits`, at any block the node still has state for.

use iota_chain::client::{AtBlock, StorageBatch};
use iota_chain::wallet::PublicKey;
use iota_chain::{ChainError, Metagraph, Subtensor, api};

/// The chain at block `number` (the node must still keep that block's state).
pub async fn at_number(chain: &Subtensor, number: u64) -> Result<AtBlock, ChainError> {
    let hash = chain
        .rpc()
        .chain_get_block_hash(Some(number.into()))
        .await
        .map_err(|e| ChainError::Rpc(e.to_string()))?
        .ok_or_else(|| ChainError::Rpc(format!("no block {number}")))?;
    chain
        .subxt()
        .at_block(hash)
        .await
        .map_err(|e| ChainError::Rpc(e.to_string()))
}

/// `Weights[netuid][uid]` at `at`: `(uid, value)` pairs as the chain stores them (max-upscaled
/// to 65535).
pub async fn weights_row(
    chain: &Subtensor,
    at: &AtBlock,
    netuid: u16,
    uid: u16,
) -> Result<Vec<(u16, u16)>, ChainError> {
    let mut b = StorageBatch::new(at);
    let slot = b.add(api::storage().subtensor_module().weights(), (netuid, uid))?;
    let f = b.fetch(chain).await?;
    f.value(&slot)
}

/// The `Weights` row of every neuron of `meta` holding a validator permit, at `meta`'s block:
/// `(uid, row)`.
pub async fn weight_rows(
    chain: &Subtensor,
    meta: &Metagraph,
) -> Result<Vec<(u16, Vec<(u16, u16)>)>, ChainError> {
    let at = at_number(chain, meta.block).await?;
    let validators: Vec<u16> = meta
        .neurons
        .iter()
        .filter(|n| n.validator_permit)
        .map(|n| n.uid)
        .collect();
    let mut b = StorageBatch::new(&at);
    let slots = b.add_all(
        api::storage().subtensor_module().weights(),
        validators.iter().map(|uid| (meta.netuid, *uid)),
    )?;
    let f = b.fetch(chain).await?;
    validators
        .iter()
        .zip(&slots)
        .map(|(uid, slot)| Ok((*uid, f.value(slot)?)))
        .collect()
}

/// The blake2-256 hashes of `hotkey`'s drand-timelocked commits made in `epoch` on `netuid` and
/// not revealed yet, at `at`.
pub async fn timelocked_commit_hashes(
    chain: &Subtensor,
    at: &AtBlock,
    netuid: u16,
    epoch: u64,
    hotkey: &PublicKey,
) -> Result<Vec<[u8; 32]>, ChainError> {
    let mut b = StorageBatch::new(at);
    let slot = b.add(
        api::storage()
            .subtensor_module()
            .timelocked_weight_commits(),
        (netuid, epoch),
    )?;
    let who = iota_chain::signer::account(hotkey);
    Ok(b.fetch(chain)
        .await?
        .value(&slot)?
        .into_iter()
        .filter(|(account, ..)| *account == who)
        .map(|(_, _, bytes, _)| sp_crypto_hashing::blake2_256(&bytes.0))
        .collect())
}

/// The hashes of `hotkey`'s unrevealed commits on `netuid` at `at`.
pub async fn commit_hashes(
    chain: &Subtensor,
    at: &AtBlock,
    netuid: u16,
    hotkey: &PublicKey,
) -> Result<Vec<[u8; 32]>, ChainError> {
    let mut b = StorageBatch::new(at);
    let slot = b.add(
        api::storage().subtensor_module().weight_commits(),
        (netuid, iota_chain::signer::account(hotkey)),
    )?;
    let f = b.fetch(chain).await?;
    Ok(f.optional(&slot)?
        .unwrap_or_default()
        .into_iter()
        .map(|(hash, ..)| hash.0)
        .collect())
}
