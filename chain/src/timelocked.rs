//! Drand-timelocked weight commits (commit-reveal v3/v4), as a client makes them: seal the
//! weights to the round the chain's beacon publishes when the reveal epoch begins, commit the
//! ciphertext, then watch the chain reveal it. The cryptography is `iota_drand`'s
//! ([`crate::timelock`]); [`crate::set_weights`] decides which kind of commit a subnet takes.

use crate::api;
use crate::calls;
use crate::client::{AtBlock, StorageBatch, Subtensor, TxOptions};
use crate::commit::{CommitStore, PendingCommit, TimelockedCommit};
use crate::error::ChainError;
use crate::metagraph::{Hyperparams, SubnetRead};
use crate::timelock;
use crate::wallet::Keypair;

/// What became of a timelocked commit ([`Subtensor::reveal_pending`],
/// [`Subtensor::timelocked_commit_fate`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Still on chain, waiting for its epoch or its round's pulse.
    Waiting,
    /// Opened by the chain, which set its weights in this block.
    Revealed(u64),
    /// Removed without setting weights, for this reason.
    Dropped(String),
}

/// What a timelocked commit did: the call it would send (a dry run), or where it landed.
pub(crate) enum Sent {
    DryRun(Vec<u8>),
    Committed {
        block: u64,
        hash: String,
        reveal_round: u64,
        reveal_from_block: u64,
    },
}

/// Weights to seal in a timelocked commit, and the commit-reveal version to send.
#[derive(Clone)]
pub(crate) struct Sealed {
    pub(crate) uids: Vec<u16>,
    pub(crate) values: Vec<u16>,
    pub(crate) version_key: u64,
    pub(crate) version: u16,
}

/// What a timelocked commit is sealed against, read from the chain.
struct ChainBeacon {
    public_key: timelock::DrandPublicKey,
    schedule: timelock::DrandSchedule,
    last_stored_round: u64,
    now_ms: u64,
}

/// Seconds per block: the runtime's `Aura.SlotDuration`, or finney's 12 s when it declares none.
pub fn block_time_secs(metadata: &subxt::Metadata) -> f64 {
    const FINNEY_BLOCK_SECS: f64 = 12.0;
    metadata
        .pallet_by_name("Aura")
        .and_then(|p| p.constant_by_name("SlotDuration"))
        .and_then(|c| <u64 as parity_scale_codec::Decode>::decode(&mut c.value()).ok())
        .filter(|ms| *ms > 0)
        .map_or(FINNEY_BLOCK_SECS, |ms| ms as f64 / 1_000.0)
}

impl Subtensor {
    /// Seals the weights to the drand round out when the reveal epoch begins and commits the
    /// ciphertext with `commit_timelocked_weights`; the chain opens it itself with that round's
    /// pulse. The beacon (key, genesis, period) is the one the chain's Drand pallet follows, the
    /// time is the chain's own (`Timestamp.Now`) and the block time its `Aura.SlotDuration`.
    pub(crate) async fn commit_timelocked<S: CommitStore>(
        &self,
        hotkey: &Keypair,
        hp: &Hyperparams,
        weights: Sealed,
        store: &S,
        tx: &TxOptions,
    ) -> Result<Sent, ChainError> {
        let netuid = hp.netuid;
        let at = self.at_best().await?;
        let beacon = self.beacon_at(&at).await?;
        let best = at.block_number();
        let next = best + 1;
        let reveal_from_block = self
            .first_reveal_block_at(&at, netuid, hp.tempo, next, hp.reveal_period_epochs)
            .await?;
        let timing = timelock::CommitTiming {
            current_block: best,
            first_reveal_block: reveal_from_block,
            block_time_secs: block_time_secs(at.metadata_ref()),
            now_unix_secs: beacon.now_ms as f64 / 1_000.0,
        };
        // Never a round already on chain: its pulse would open the commit at once (and the pool
        // refuses older ones). On a chain whose epochs are short against the beacon's period the
        // prediction can land there; the next round delays the reveal by at most one period.
        let reveal_round =
            timelock::reveal_round(&timing, &beacon.schedule)?.max(beacon.last_stored_round + 1);
        let public = hotkey.public();
        let payload = timelock::WeightsTlockPayload {
            hotkey: public.to_bytes().to_vec(),
            uids: weights.uids.clone(),
            values: weights.values.clone(),
            version_key: weights.version_key,
        };
        let sealed = timelock::encrypt_for_round(
            &parity_scale_codec::Encode::encode(&payload),
            reveal_round,
            &beacon.public_key,
            &mut rand::rngs::OsRng,
        )?;
        let hash = sp_crypto_hashing::blake2_256(&sealed);
        let call = calls::commit_timelocked_weights(netuid, sealed, reveal_round, weights.version);
        if tx.dry_run {
            return Ok(Sent::DryRun(self.encode_call(&call).await?));
        }
        let commit_epoch = self.epoch_index_at(&at, netuid, hp.tempo, next).await?;
        let mut pending = PendingCommit {
            hotkey: public,
            netuid,
            uids: weights.uids,
            values: weights.values,
            salt: vec![],
            version_key: weights.version_key,
            hash,
            submitted_block: best,
            commit_block: None,
            reveal_epoch: commit_epoch + hp.reveal_period_epochs,
            timelock: Some(TimelockedCommit {
                reveal_round,
                commit_epoch,
                reveal_from_block,
            }),
        };
        let block = self
            .send_commit(&call, hotkey, hp, &mut pending, store, tx)
            .await?;
        tracing::info!(
            netuid,
            block,
            hash = %pending.hash_hex(),
            reveal_round,
            reveal_from_block,
            "weights committed, timelocked"
        );
        Ok(Sent::Committed {
            block,
            hash: pending.hash_hex(),
            reveal_round,
            reveal_from_block,
        })
    }

    /// What became of timelocked commit `c` (sealed as `sealed`) as of the best block. The chain
    /// opens these itself, so a client may learn of a reveal only when it asks.
    ///
    /// # Errors
    ///
    /// Transport errors and a subnet that is gone.
    pub async fn timelocked_commit_fate(
        &self,
        c: &PendingCommit,
        sealed: TimelockedCommit,
    ) -> Result<Fate, ChainError> {
        let at = self.at_best().await?;
        let hp = self.hyperparams_at(&at, c.netuid).await?;
        let epoch = self
            .epoch_index_at(&at, c.netuid, hp.tempo, at.block_number() + 1)
            .await?;
        self.timelocked_fate(&at, c, sealed, epoch).await
    }

    /// What became of a timelocked commit: still on chain (waiting for its pulse or epoch), or
    /// removed by the chain's reveal pass, which either set its weights (the uid's `LastUpdate`
    /// moved past the commit's block) or dropped it.
    pub(crate) async fn timelocked_fate(
        &self,
        at: &AtBlock,
        c: &PendingCommit,
        sealed: TimelockedCommit,
        epoch: u64,
    ) -> Result<Fate, ChainError> {
        let mut batch = StorageBatch::new(at);
        let kept = batch.add(
            api::storage()
                .subtensor_module()
                .timelocked_weight_commits(),
            (c.netuid, sealed.commit_epoch),
        )?;
        let kept = batch.fetch(self).await?.value(&kept)?;
        let who = crate::signer::account(&c.hotkey);
        let on_chain = kept.iter().any(|(account, _, bytes, _)| {
            *account == who && sp_crypto_hashing::blake2_256(&bytes.0) == c.hash
        });
        if on_chain {
            return Ok(Fate::Waiting);
        }
        let read = self
            .read_subnet(
                at,
                c.netuid,
                &SubnetRead {
                    last_update: true,
                    uid_of: Some(c.hotkey),
                    ..SubnetRead::default()
                },
            )
            .await?;
        let last_update = read.uid.map(|uid| read.last_update_of(uid));
        Ok(match (c.commit_block, last_update) {
            (Some(block), Some(last)) if last > block => Fate::Revealed(last),
            (Some(_), _) => Fate::Dropped(
                "the chain removed the commit without setting its weights: it did not open with its round's pulse, named another hotkey, or its weights were refused".to_owned(),
            ),
            (None, _) if epoch <= c.reveal_epoch => Fate::Waiting,
            (None, _) => Fate::Dropped(
                "the commit is not on chain and its reveal epoch has passed: it never landed, or its outcome was lost".to_owned(),
            ),
        })
    }

    /// The beacon the chain's Drand pallet follows, its latest stored round and the chain's
    /// time, at `at`.
    async fn beacon_at(&self, at: &AtBlock) -> Result<ChainBeacon, ChainError> {
        let mut batch = StorageBatch::new(at);
        let config = batch.add(api::storage().drand().beacon_config(), ())?;
        let last = batch.add(api::storage().drand().last_stored_round(), ())?;
        let now = batch.add(api::storage().timestamp().now(), ())?;
        let fetched = batch.fetch(self).await?;
        let config = fetched.value(&config)?;
        Ok(ChainBeacon {
            public_key: timelock::DrandPublicKey::from_bytes(&config.public_key.0)?,
            schedule: timelock::DrandSchedule {
                genesis_time: u64::from(config.genesis_time),
                period_secs: u64::from(config.period),
            },
            last_stored_round: fetched.value(&last)?,
            now_ms: fetched.value(&now)?,
        })
    }
}
