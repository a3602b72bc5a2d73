//! Weights on chain: the SDK's conversion, the subnet's version key and rate limit, and
//! commit-reveal when the subnet has it on: hash commits (v2) this client reveals, or commits
//! sealed to a drand round ([`crate::timelocked`]) that the chain reveals.

use std::time::Duration;

use serde::Serialize;

use crate::calls;
use crate::client::{Subtensor, TxOptions, TxOutcome};
use crate::commit::{CommitStore, PendingCommit, by_netuid};
use crate::error::ChainError;
use crate::metagraph::{Hyperparams, SubnetRead};
use crate::timelocked::{Fate, Sealed, Sent};
use crate::wallet::{Keypair, PublicKey};
use crate::weights::{
    DEFAULT_SALT_LEN, commit_hash, convert_weights_and_uids_for_emit, generate_salt,
    process_weights,
};

/// Which version key to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum VersionKey {
    /// The subnet's current `WeightsVersionKey` (what the chain requires at least).
    #[default]
    FromChain,
    /// This exact value.
    Exact(u64),
}

/// How to set weights.
#[derive(Clone, Debug)]
pub struct WeightOptions {
    /// The version key to send.
    pub version_key: VersionKey,
    /// Wait until `WeightsSetRateLimit` blocks have passed since the last update instead of
    /// letting the chain refuse with `SettingWeightsTooFast`.
    pub wait_for_rate_limit: bool,
    /// Longest wait for the rate limit.
    pub rate_limit_timeout: Duration,
    /// Salt length for commits.
    pub salt_len: usize,
    /// Submission options (dry run, inclusion, timeout).
    pub tx: TxOptions,
    /// Run the validator's `process_weights` step first (lay scores out over the subnet, pad to
    /// `MinAllowedWeights`, clip at `MaxWeightsLimit`). Off: the given uids and scores are only
    /// converted, as the SDK's `set_weights` does.
    pub process_weights: bool,
}

impl Default for WeightOptions {
    fn default() -> Self {
        Self {
            version_key: VersionKey::FromChain,
            wait_for_rate_limit: true,
            rate_limit_timeout: Duration::from_secs(30 * 60),
            salt_len: DEFAULT_SALT_LEN,
            tx: TxOptions::default(),
            process_weights: false,
        }
    }
}

/// What `set_weights` did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum WeightsOutcome {
    /// `set_weights` was included (commit-reveal off).
    Set {
        /// Block it landed in.
        block: u64,
        /// Uids sent.
        uids: Vec<u16>,
        /// Values sent.
        values: Vec<u16>,
        /// Version key sent.
        version_key: u64,
    },
    /// `commit_weights` was included; reveal with [`Subtensor::reveal_pending`] in
    /// `reveal_epoch`.
    Committed {
        /// Block it landed in.
        block: u64,
        /// The committed hash, `0x…`.
        hash: String,
        /// Epoch in which it must be revealed.
        reveal_epoch: u64,
        /// First block of that epoch.
        reveal_from_block: u64,
        /// Uids committed.
        uids: Vec<u16>,
        /// Values committed.
        values: Vec<u16>,
        /// Version key committed.
        version_key: u64,
    },
    /// `commit_timelocked_weights` was included (commit-reveal v3/v4): the chain opens it
    /// itself once the beacon's pulse for `reveal_round` is stored, in the epoch beginning at
    /// `reveal_from_block`; [`Subtensor::reveal_pending`] reports when it did.
    TimelockCommitted {
        /// Block it landed in.
        block: u64,
        /// Blake2-256 of the ciphertext, `0x…` (as the chain's commit event names it).
        hash: String,
        /// The drand round it is sealed to.
        reveal_round: u64,
        /// First block of the reveal epoch (predicted).
        reveal_from_block: u64,
        /// Uids sealed.
        uids: Vec<u16>,
        /// Values sealed.
        values: Vec<u16>,
        /// Version key sealed.
        version_key: u64,
    },
    /// `--dry-run`: the call that would be sent.
    DryRun {
        /// SCALE-encoded call, `0x…`.
        call_hex: String,
        /// Uids.
        uids: Vec<u16>,
        /// Values.
        values: Vec<u16>,
        /// Version key.
        version_key: u64,
        /// Whether it is a commit (commit-reveal on).
        commit: bool,
    },
}

/// What [`Subtensor::reveal_pending`] did with each pending commit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RevealReport {
    /// Revealed now: (hash, block).
    pub revealed: Vec<(String, u64)>,
    /// Not yet revealable: (hash, first block of the reveal window).
    pub waiting: Vec<(String, u64)>,
    /// Dropped from the store: (hash, why).
    pub dropped: Vec<(String, String)>,
    /// Dry run: the reveal calls that would be sent.
    pub dry_run: Vec<String>,
}

/// What a weights submission needs to know about the subnet and the hotkey.
struct WeightsContext {
    best: u64,
    uid: u16,
    last_update: u64,
    hyperparams: Hyperparams,
}

/// First commit-reveal version that is drand-timelocked (CRv3; v4 is the current one).
pub const FIRST_TIMELOCKED_COMMIT_REVEAL_VERSION: u16 = 3;

/// The storage key and metadata default of `CommitRevealWeightsVersion`, when the runtime
/// declares it (a runtime without it has hash commit-reveal only).
pub fn commit_reveal_version_item(metadata: &subxt::Metadata) -> Option<(Vec<u8>, Option<u16>)> {
    let entry = metadata
        .pallet_by_name("SubtensorModule")?
        .storage()?
        .entry_by_name("CommitRevealWeightsVersion")?;
    let mut key = sp_crypto_hashing::twox_128(b"SubtensorModule").to_vec();
    key.extend(sp_crypto_hashing::twox_128(b"CommitRevealWeightsVersion"));
    let default = entry
        .default_value()
        .and_then(|bytes| bytes.get(..2))
        .map(|b| u16::from_le_bytes([b[0], b[1]]));
    Some((key, default))
}

/// First block whose epoch index is `epoch` (spec ≤ 403 rule).
pub fn first_block_of_epoch(netuid: u16, tempo: u16, epoch: u64) -> u64 {
    (epoch * (u64::from(tempo) + 1)).saturating_sub(u64::from(netuid) + 1)
}

/// Turns per-uid scores into the `(uids, values)` the SDK would send for this subnet: scores are
/// laid out by uid over the subnet's `n` neurons, processed like `process_weights` (min allowed
/// weights, `MaxWeightsLimit`), then converted like `convert_weights_and_uids_for_emit`.
///
/// # Errors
///
/// [`ChainError::Weights`] for NaN/negative scores or mismatched lengths, and
/// [`ChainError::InvalidArgument`] for a uid outside the subnet.
pub fn weights_for_chain(
    hyperparams: &Hyperparams,
    uids: &[u16],
    scores: &[f32],
) -> Result<(Vec<u16>, Vec<u16>), ChainError> {
    if uids.len() != scores.len() {
        return Err(crate::weights::WeightsError::LengthMismatch {
            uids: uids.len(),
            weights: scores.len(),
        }
        .into());
    }
    let n = usize::from(hyperparams.n);
    if n == 0 {
        return Err(ChainError::InvalidArgument(format!(
            "netuid {} has no neurons",
            hyperparams.netuid
        )));
    }
    let mut dense = vec![0.0_f32; n];
    for (&uid, &score) in uids.iter().zip(scores) {
        let slot = dense.get_mut(usize::from(uid)).ok_or_else(|| {
            ChainError::InvalidArgument(format!(
                "uid {uid} is not on netuid {} ({n} neurons)",
                hyperparams.netuid
            ))
        })?;
        *slot = score;
    }
    // `process_weights` indexes by position; laying scores out by uid makes position == uid.
    let all: Vec<u16> = (0..hyperparams.n).collect();
    let (kept_uids, kept) = process_weights(
        &all,
        &dense,
        n,
        usize::from(hyperparams.min_allowed_weights),
        hyperparams.max_weight_limit_fraction(),
        0,
    )?;
    Ok(convert_weights_and_uids_for_emit(&kept_uids, &kept)?)
}

/// The SDK's `set_weights` conversion of exactly what the caller gave: max-normalise, round,
/// ×65535, drop zeros (`convert_weights_and_uids_for_emit`), after checking every uid is on the
/// subnet.
///
/// # Errors
///
/// As [`weights_for_chain`].
pub fn convert_as_given(
    hyperparams: &Hyperparams,
    uids: &[u16],
    scores: &[f32],
) -> Result<(Vec<u16>, Vec<u16>), ChainError> {
    if let Some(uid) = uids.iter().find(|&&u| u >= hyperparams.n) {
        return Err(ChainError::InvalidArgument(format!(
            "uid {uid} is not on netuid {} ({} neurons)",
            hyperparams.netuid, hyperparams.n
        )));
    }
    Ok(convert_weights_and_uids_for_emit(uids, scores)?)
}

impl Subtensor {
    /// `CommitRevealWeightsVersion` at the best block, or `None` when the runtime has no such
    /// item (hash commit-reveal only).
    ///
    /// # Errors
    ///
    /// Transport errors.
    pub async fn commit_reveal_version(&self) -> Result<Option<u16>, ChainError> {
        let at = self.at_best().await?;
        let Some((key, default)) = commit_reveal_version_item(at.metadata_ref()) else {
            return Ok(None);
        };
        let stored = self.fetch_raw_many(at.block_hash(), &[key]).await?;
        Ok(match stored.into_iter().next().flatten() {
            Some(bytes) if bytes.len() >= 2 => Some(u16::from_le_bytes([bytes[0], bytes[1]])),
            _ => default,
        })
    }
}

impl Subtensor {
    /// Sets `hotkey`'s weights on `netuid` from float scores, as the Python SDK would.
    ///
    /// Reads the subnet at the best block, converts the scores ([`weights_for_chain`]), picks the
    /// version key, waits out the rate limit, then sends `set_weights`, or `commit_weights` when
    /// commit-reveal is on (the reveal data go to `store` first).
    ///
    /// # Errors
    ///
    /// [`ChainError::NotRegistered`], conversion errors, dispatch errors by name
    /// ([`ChainError::IncorrectWeightVersionKey`], …), [`ChainError::Timeout`].
    pub async fn set_weights<S: CommitStore>(
        &self,
        hotkey: &Keypair,
        netuid: u16,
        uids: &[u16],
        scores: &[f32],
        store: &S,
        opts: &WeightOptions,
    ) -> Result<WeightsOutcome, ChainError> {
        let ctx = self.weights_context(hotkey, netuid).await?;
        let (uids, values) = if opts.process_weights {
            weights_for_chain(&ctx.hyperparams, uids, scores)?
        } else {
            convert_as_given(&ctx.hyperparams, uids, scores)?
        };
        self.send_weights(hotkey, ctx, uids, values, store, opts)
            .await
    }

    /// As [`Subtensor::set_weights`] with values already in chain form (`u16`, any scale: the
    /// chain max-upscales them).
    ///
    /// # Errors
    ///
    /// As [`Subtensor::set_weights`].
    pub async fn set_weights_u16<S: CommitStore>(
        &self,
        hotkey: &Keypair,
        netuid: u16,
        uids: Vec<u16>,
        values: Vec<u16>,
        store: &S,
        opts: &WeightOptions,
    ) -> Result<WeightsOutcome, ChainError> {
        let ctx = self.weights_context(hotkey, netuid).await?;
        self.send_weights(hotkey, ctx, uids, values, store, opts)
            .await
    }

    /// Settings, the hotkey's uid and `LastUpdate`, in one batched read at the best block.
    async fn weights_context(
        &self,
        hotkey: &Keypair,
        netuid: u16,
    ) -> Result<WeightsContext, ChainError> {
        let public = hotkey.public();
        let at = self.at_best().await?;
        let read = self
            .read_subnet(
                &at,
                netuid,
                &SubnetRead {
                    last_update: true,
                    uid_of: Some(public),
                    ..SubnetRead::default()
                },
            )
            .await?;
        let uid = read.uid.ok_or_else(|| ChainError::NotRegistered {
            hotkey: public.ss58(),
            netuid,
        })?;
        Ok(WeightsContext {
            best: at.block_number(),
            uid,
            last_update: read.last_update_of(uid),
            hyperparams: read.hyperparams,
        })
    }

    async fn send_weights<S: CommitStore>(
        &self,
        hotkey: &Keypair,
        ctx: WeightsContext,
        uids: Vec<u16>,
        values: Vec<u16>,
        store: &S,
        opts: &WeightOptions,
    ) -> Result<WeightsOutcome, ChainError> {
        let hp = &ctx.hyperparams;
        let netuid = hp.netuid;
        let version_key = match opts.version_key {
            VersionKey::FromChain => hp.weights_version_key,
            VersionKey::Exact(k) => k,
        };
        if !opts.tx.dry_run && opts.wait_for_rate_limit {
            self.wait_out_rate_limit(&ctx, opts.rate_limit_timeout)
                .await?;
        }
        if hp.commit_reveal_enabled {
            return self
                .commit(hotkey, hp, uids, values, version_key, store, opts)
                .await;
        }
        let call = calls::set_weights(netuid, uids.clone(), values.clone(), version_key);
        match self.submit(&call, hotkey, &opts.tx).await? {
            TxOutcome::DryRun { call_data } => Ok(WeightsOutcome::DryRun {
                call_hex: format!("0x{}", hex::encode(call_data)),
                uids,
                values,
                version_key,
                commit: false,
            }),
            TxOutcome::Included(r) => {
                tracing::info!(
                    netuid,
                    uid = ctx.uid,
                    block = r.block_number,
                    n = uids.len(),
                    version_key,
                    "weights set"
                );
                Ok(WeightsOutcome::Set {
                    block: r.block_number,
                    uids,
                    values,
                    version_key,
                })
            }
        }
    }

    /// Waits until the uid may update its weights again (`LastUpdate + WeightsSetRateLimit`),
    /// counting from the block the transaction will land in.
    async fn wait_out_rate_limit(
        &self,
        ctx: &WeightsContext,
        timeout: Duration,
    ) -> Result<(), ChainError> {
        let (last, limit) = (ctx.last_update, ctx.hyperparams.weights_rate_limit);
        let allowed_from = weights_allowed_from(last, limit);
        // The chain checks `now - last >= limit` with `now` the inclusion block, the next one.
        let next = ctx.best + 1;
        if next >= allowed_from {
            return Ok(());
        }
        tracing::info!(
            netuid = ctx.hyperparams.netuid,
            uid = ctx.uid,
            last_update = last,
            rate_limit = limit,
            wait_blocks = allowed_from - next,
            "waiting out the weights rate limit"
        );
        self.wait_for_block(allowed_from - 1, timeout).await?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn commit<S: CommitStore>(
        &self,
        hotkey: &Keypair,
        hp: &Hyperparams,
        uids: Vec<u16>,
        values: Vec<u16>,
        version_key: u64,
        store: &S,
        opts: &WeightOptions,
    ) -> Result<WeightsOutcome, ChainError> {
        let netuid = hp.netuid;
        if let Some(version) = self.commit_reveal_version().await?
            && version >= FIRST_TIMELOCKED_COMMIT_REVEAL_VERSION
        {
            let weights = Sealed {
                uids,
                values,
                version_key,
                version,
            };
            return Ok(
                match self
                    .commit_timelocked(hotkey, hp, weights.clone(), store, &opts.tx)
                    .await?
                {
                    Sent::DryRun(call_data) => WeightsOutcome::DryRun {
                        call_hex: format!("0x{}", hex::encode(call_data)),
                        uids: weights.uids,
                        values: weights.values,
                        version_key: weights.version_key,
                        commit: true,
                    },
                    Sent::Committed {
                        block,
                        hash,
                        reveal_round,
                        reveal_from_block,
                    } => WeightsOutcome::TimelockCommitted {
                        block,
                        hash,
                        reveal_round,
                        reveal_from_block,
                        uids: weights.uids,
                        values: weights.values,
                        version_key: weights.version_key,
                    },
                },
            );
        }
        let public = hotkey.public();
        let salt = generate_salt(opts.salt_len);
        let hash = commit_hash(
            public.to_bytes(),
            netuid,
            &uids,
            &values,
            &salt,
            version_key,
        );
        let call = calls::commit_weights(netuid, hash);
        if opts.tx.dry_run {
            let call_data = self.encode_call(&call).await?;
            return Ok(WeightsOutcome::DryRun {
                call_hex: format!("0x{}", hex::encode(call_data)),
                uids,
                values,
                version_key,
                commit: true,
            });
        }
        let submitted_block = self.best_block_number().await?;
        let mut pending = PendingCommit {
            hotkey: public,
            netuid,
            uids: uids.clone(),
            values: values.clone(),
            salt,
            version_key,
            hash,
            submitted_block,
            commit_block: None,
            reveal_epoch: hp.epoch_of(submitted_block + 1) + hp.reveal_period_epochs,
            timelock: None,
        };
        let block = self
            .send_commit(&call, hotkey, hp, &mut pending, store, &opts.tx)
            .await?;
        let reveal_from_block = first_block_of_epoch(netuid, hp.tempo, pending.reveal_epoch);
        tracing::info!(
            netuid,
            block,
            hash = %pending.hash_hex(),
            reveal_epoch = pending.reveal_epoch,
            reveal_from_block,
            "weights committed"
        );
        Ok(WeightsOutcome::Committed {
            block,
            hash: pending.hash_hex(),
            reveal_epoch: pending.reveal_epoch,
            reveal_from_block,
            uids,
            values,
            version_key,
        })
    }

    /// Reveals every pending commit of `hotkey` whose reveal window is open now (the next block
    /// falls in its reveal epoch). Commits past their window are dropped from the store; ones not
    /// yet due are left. A validator calls this every block or so.
    ///
    /// # Errors
    ///
    /// Store and transport errors; a reveal the chain refuses is reported in `dropped`.
    pub async fn reveal_pending<S: CommitStore>(
        &self,
        hotkey: &Keypair,
        store: &S,
        tx: &TxOptions,
    ) -> Result<RevealReport, ChainError> {
        let mut report = RevealReport::default();
        let pending = store.pending(&hotkey.public()).await?;
        if pending.is_empty() {
            return Ok(report);
        }
        let at = self.at_best().await?;
        let next = at.block_number() + 1;
        for (netuid, commits) in by_netuid(pending) {
            let hp = match self.hyperparams_at(&at, netuid).await {
                Ok(hp) => hp,
                Err(ChainError::NoSuchSubnet(_)) => {
                    for c in commits {
                        store.remove(&c.hash).await?;
                        report
                            .dropped
                            .push((c.hash_hex(), format!("netuid {netuid} is gone")));
                    }
                    continue;
                }
                Err(e) => return Err(e),
            };
            let epoch = self.epoch_index_at(&at, netuid, hp.tempo, next).await?;
            for c in commits {
                if let Some(sealed) = c.timelock {
                    match self.timelocked_fate(&at, &c, sealed, epoch).await? {
                        // Asked again from the next block: the pulse may come after the epoch.
                        Fate::Waiting => report
                            .waiting
                            .push((c.hash_hex(), sealed.reveal_from_block.max(next + 1))),
                        Fate::Revealed(block) => {
                            store.remove(&c.hash).await?;
                            tracing::info!(netuid, hash = %c.hash_hex(), block, "timelocked weights revealed by the chain");
                            report.revealed.push((c.hash_hex(), block));
                        }
                        Fate::Dropped(why) => {
                            store.remove(&c.hash).await?;
                            tracing::warn!(netuid, hash = %c.hash_hex(), why, "timelocked commit not revealed");
                            report.dropped.push((c.hash_hex(), why));
                        }
                    }
                    continue;
                }
                let opens = first_block_of_epoch(netuid, hp.tempo, c.reveal_epoch);
                if epoch < c.reveal_epoch {
                    report.waiting.push((c.hash_hex(), opens));
                    continue;
                }
                // A window that looks passed by our count is still tried: only the chain's
                // answer (a refused reveal) removes the salt, never a local estimate.
                if epoch > c.reveal_epoch {
                    tracing::warn!(netuid, hash = %c.hash_hex(), reveal_epoch = c.reveal_epoch, epoch, "reveal window looks passed; asking the chain");
                }
                let call = calls::reveal_weights(
                    netuid,
                    c.uids.clone(),
                    c.values.clone(),
                    c.salt.clone(),
                    c.version_key,
                );
                match self.submit(&call, hotkey, tx).await {
                    Ok(TxOutcome::DryRun { call_data }) => {
                        report.dry_run.push(format!("0x{}", hex::encode(call_data)))
                    }
                    Ok(TxOutcome::Included(r)) => {
                        store.remove(&c.hash).await?;
                        tracing::info!(netuid, hash = %c.hash_hex(), block = r.block_number, "weights revealed");
                        report.revealed.push((c.hash_hex(), r.block_number));
                    }
                    Err(ChainError::RevealTooEarly) => {
                        report.waiting.push((c.hash_hex(), opens));
                    }
                    Err(e) if e.is_dispatch_error() => {
                        tracing::warn!(netuid, hash = %c.hash_hex(), error = %e, "reveal refused; dropping commit");
                        store.remove(&c.hash).await?;
                        report.dropped.push((c.hash_hex(), e.to_string()));
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(report)
    }

    /// Waits for the reveal window of `hotkey`'s pending commits and reveals them; returns when
    /// none is left waiting.
    ///
    /// # Errors
    ///
    /// As [`Subtensor::reveal_pending`], plus [`ChainError::Timeout`].
    pub async fn reveal_when_ready<S: CommitStore>(
        &self,
        hotkey: &Keypair,
        store: &S,
        tx: &TxOptions,
        timeout: Duration,
    ) -> Result<RevealReport, ChainError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut total = RevealReport::default();
        loop {
            let report = self.reveal_pending(hotkey, store, tx).await?;
            total.revealed.extend(report.revealed);
            total.dropped.extend(report.dropped);
            total.dry_run.extend(report.dry_run);
            let Some(next_open) = report.waiting.iter().map(|(_, b)| *b).min() else {
                return Ok(total);
            };
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                total.waiting = report.waiting;
                return Err(ChainError::Timeout {
                    what: "the reveal window".into(),
                    after: timeout,
                });
            }
            // Submit while the best block is just before the window: the reveal lands in it.
            self.wait_for_block(next_open.saturating_sub(1).max(1), left)
                .await?;
        }
    }

    /// Pending commits of `hotkey` in `store` (for status displays).
    ///
    /// # Errors
    ///
    /// Store errors.
    pub async fn pending_commits<S: CommitStore>(
        &self,
        hotkey: &PublicKey,
        store: &S,
    ) -> Result<Vec<PendingCommit>, ChainError> {
        store.pending(hotkey).await
    }
}

/// The first block a transaction from a uid whose `LastUpdate` is `last_update` may land in and
/// set weights under `WeightsSetRateLimit` = `rate_limit` (0: at once; a uid that never set
/// weights is not limited).
pub fn weights_allowed_from(last_update: u64, rate_limit: u64) -> u64 {
    match last_update {
        0 => 0,
        last => last.saturating_add(rate_limit),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metagraph::epoch_index;

    #[test]
    fn the_rate_limit_counts_from_the_last_update() {
        // A uid that never set weights may at once, whatever the limit.
        assert_eq!(weights_allowed_from(0, 100), 0);
        assert_eq!(weights_allowed_from(50, 100), 150);
        assert_eq!(weights_allowed_from(50, 0), 50);
        assert_eq!(weights_allowed_from(u64::MAX - 1, 100), u64::MAX);
    }

    fn hp(n: u16, min_allowed: u16, max_limit: u16) -> Hyperparams {
        Hyperparams {
            netuid: 1,
            block: 0,
            tempo: 10,
            weights_rate_limit: 100,
            activity_cutoff: 5000,
            weights_version_key: 0,
            commit_reveal_enabled: false,
            reveal_period_epochs: 1,
            burn: 0,
            max_uids: 256,
            n,
            max_weights_limit: max_limit,
            min_allowed_weights: min_allowed,
            immunity_period: 0,
            max_validators: 64,
            registration_allowed: true,
            serving_rate_limit: 50,
            owner_coldkey: PublicKey::from_bytes([0; 32]),
            owner_hotkey: PublicKey::from_bytes([0; 32]),
            first_emission_block: None,
        }
    }

    #[test]
    fn scores_become_sdk_values() {
        let (uids, values) =
            weights_for_chain(&hp(4, 1, u16::MAX), &[1, 2], &[1.0, 3.0]).expect("convert");
        assert_eq!(uids, vec![1, 2]);
        assert_eq!(values, vec![21845, 65535]);
    }

    #[test]
    fn uid_outside_the_subnet_is_refused() {
        assert!(matches!(
            weights_for_chain(&hp(2, 1, u16::MAX), &[5], &[1.0]),
            Err(ChainError::InvalidArgument(_))
        ));
        assert!(matches!(
            weights_for_chain(&hp(2, 1, u16::MAX), &[0], &[f32::NAN]),
            Err(ChainError::Weights(_))
        ));
    }

    #[test]
    fn max_weight_limit_is_respected() {
        // A limit of half: no single value may exceed half of the total after max-upscaling.
        let (_, values) = weights_for_chain(
            &hp(4, 1, u16::MAX / 2),
            &[0, 1, 2, 3],
            &[10.0, 1.0, 1.0, 1.0],
        )
        .expect("convert");
        let sum: u64 = values.iter().map(|&v| u64::from(v)).sum();
        let max = u64::from(*values.iter().max().expect("max"));
        assert!(max * 2 <= sum + 2, "{values:?}");
    }

    #[test]
    fn weights_are_sent_as_given_unless_processing_is_asked_for() {
        // 8 neurons, MinAllowedWeights 4, MaxWeightsLimit 50%: the validator's step pads and clips.
        let params = hp(8, 4, u16::MAX / 2);
        let (uids, values) = convert_as_given(&params, &[1, 2], &[1.0, 3.0]).expect("given");
        assert_eq!(uids, vec![1, 2]);
        assert_eq!(values, vec![21845, 65535]);
        let (processed_uids, _) =
            weights_for_chain(&params, &[1, 2], &[1.0, 3.0]).expect("processed");
        assert!(processed_uids.len() >= 4, "{processed_uids:?}");
        assert!(convert_as_given(&params, &[8], &[1.0]).is_err());
    }

    #[test]
    fn epoch_windows_round_trip() {
        for netuid in [1u16, 3, 9] {
            for epoch in 1..5 {
                let first = first_block_of_epoch(netuid, 10, epoch);
                assert_eq!(epoch_index(netuid, 10, first), epoch);
                assert_eq!(epoch_index(netuid, 10, first - 1), epoch - 1);
            }
        }
    }
}
