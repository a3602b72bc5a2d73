//! Blocks, the transaction pool and block production. Blocks are final as soon as they are made.

use std::collections::HashMap;
use std::time::Duration;

use parity_scale_codec::Encode;
use tokio::sync::{broadcast, mpsc};

use crate::runtime::SLOT_DURATION_MS;
use crate::runtime::drand::Beacon;
use crate::runtime::event::{DispatchEventInfo, Pays, Phase, RuntimeEvent, SystemEvent};
use crate::runtime::extrinsic::{self, ChainContext, InvalidTransaction, SignedExtrinsic};
use crate::runtime::storage::subtensor::CommitRevealWeightsVersion;
use crate::runtime::storage::system::{BlockHash, ParentHash};
use crate::runtime::types::{AccountId32, Digest, H256, Header};
use crate::runtime::{self, Exec, Origin};
use crate::state::State;

/// How many recent blocks keep their full state for reads "at" them.
const STATE_HISTORY: usize = 4_096;
/// `System.BlockHashCount`: how many recent blocks keep their hash in `System.BlockHash` and
/// their body; older ones keep only the header, as on a pruned node.
pub const BLOCK_HASH_COUNT: u64 = 2_400;
/// Most extrinsics one block takes; the rest wait for the next.
const MAX_BLOCK_EXTRINSICS: usize = 8_192;
/// Default for the most transactions the pool holds; more are refused until blocks drain it (a
/// node's `--pool-limit` is 8192 by default).
pub const MAX_POOL: usize = 8_192;

#[derive(Clone, Debug)]
pub struct ChainConfig {
    /// Make a block on a timer with this interval.
    pub block_time: Option<Duration>,
    /// Make a block as soon as a transaction arrives.
    pub instant: bool,
    /// Tempo given to newly registered subnets.
    pub new_subnet_tempo: u16,
    /// Most transactions the pool holds ([`MAX_POOL`] by default).
    pub pool_limit: usize,
    /// `CommitRevealWeightsVersion` at genesis: 4 (drand-timelocked, finney's) or below 3 for
    /// hash commits. Sudo changes it with `AdminUtils.sudo_set_commit_reveal_version`.
    pub commit_reveal_version: u16,
    /// Seed of the beacon's key (a test that knows it can open what was sealed to a round).
    pub drand_seed: [u8; 32],
    /// Seconds between the beacon's rounds.
    pub drand_period_secs: u32,
    /// Unix time of the genesis block in milliseconds; now when `None`. The chain's clock
    /// advances one slot (`Aura.SlotDuration`) per block from it.
    pub genesis_unix_ms: Option<u64>,
}

/// The localnet's genesis `CommitRevealWeightsVersion` unless configured: drand-timelocked
/// commits, as on finney. The chain client reads the version and follows either kind.
pub const DEFAULT_COMMIT_REVEAL_VERSION: u16 = 4;

impl Default for ChainConfig {
    fn default() -> Self {
        Self {
            block_time: Some(Duration::from_millis(250)),
            instant: false,
            new_subnet_tempo: 10,
            pool_limit: MAX_POOL,
            commit_reveal_version: DEFAULT_COMMIT_REVEAL_VERSION,
            drand_seed: sp_crypto_hashing::blake2_256(b"iota-localnet drand beacon"),
            drand_period_secs: 1,
            genesis_unix_ms: None,
        }
    }
}

pub struct Block {
    pub header: Header,
    pub hash: H256,
    /// The body; `None` once the block is older than [`BLOCK_HASH_COUNT`].
    pub extrinsics: Option<Vec<Vec<u8>>>,
    /// Post-state; dropped for blocks older than [`STATE_HISTORY`].
    pub state: Option<State>,
}

/// What a watched transaction goes through, as `author_extrinsicUpdate` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxStatus {
    Ready,
    Future,
    InBlock(H256),
    Finalized(H256),
    Invalid,
}

struct PoolTx {
    bytes: Vec<u8>,
    hash: H256,
    /// First block the transaction may no longer enter (end of its mortality period).
    valid_till: u64,
    xt: SignedExtrinsic,
    watcher: Option<mpsc::UnboundedSender<TxStatus>>,
}

/// Why a submission was refused, mapped to a node's RPC error codes by the RPC layer.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("Invalid Transaction: {0}")]
    Invalid(#[from] InvalidTransaction),
    #[error("Transaction Already Imported")]
    AlreadyImported,
    /// Another pool transaction from the same signer already uses this nonce.
    #[error("Priority is too low: a transaction with the same nonce is already in the pool")]
    TooLowPriority,
    #[error("Immediately Dropped: the pool is full")]
    PoolFull,
}

/// What a signature check needs from the chain (see [`Chain::signature_context`]).
#[derive(Clone, Copy, Debug)]
pub struct SignatureContext {
    pub genesis_hash: H256,
    pub next_block: u64,
    pub birth: u64,
    pub birth_hash: Option<H256>,
}

/// Decodes `bytes` and checks the signature while holding the chain's lock only to copy the
/// context: the expensive cryptography runs while other requests use the chain.
pub fn verify_unlocked(
    chain: &std::sync::Mutex<Chain>,
    bytes: &[u8],
) -> Result<SignedExtrinsic, InvalidTransaction> {
    let xt = extrinsic::decode(bytes)?;
    let ctx = chain
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .signature_context(&xt);
    let lookup = |n: u64| (n == ctx.birth).then_some(ctx.birth_hash).flatten();
    xt.verify(&ChainContext {
        genesis_hash: ctx.genesis_hash,
        spec_version: runtime::SPEC_VERSION,
        transaction_version: runtime::TRANSACTION_VERSION,
        next_block: ctx.next_block,
        block_hash: &lookup,
    })?;
    Ok(xt)
}

pub struct Chain {
    config: ChainConfig,
    beacon: Beacon,
    genesis_ms: u64,
    blocks: Vec<Block>,
    by_hash: HashMap<H256, usize>,
    pool: Vec<PoolTx>,
    heads: broadcast::Sender<Header>,
}

impl Chain {
    pub fn new(config: ChainConfig) -> Self {
        let genesis_ms = config.genesis_unix_ms.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64)
        });
        let beacon = Beacon::new(
            config.drand_seed,
            (genesis_ms / 1_000) as u32,
            config.drand_period_secs,
        );
        let mut state = runtime::genesis_state(config.new_subnet_tempo, &beacon, genesis_ms);
        CommitRevealWeightsVersion::insert(&mut state, &config.commit_reveal_version);
        let header = Header {
            parent_hash: H256::zero(),
            number: 0,
            state_root: H256(sp_crypto_hashing::blake2_256(b"iota-localnet genesis")),
            extrinsics_root: H256(sp_crypto_hashing::blake2_256(
                &Vec::<Vec<u8>>::new().encode(),
            )),
            digest: Digest::default(),
        };
        let hash = header.hash();
        BlockHash::insert(&mut state, &0, &hash);
        let (heads, _) = broadcast::channel(1_024);
        let genesis = Block {
            header,
            hash,
            extrinsics: Some(vec![]),
            state: Some(state),
        };
        Self {
            config,
            beacon,
            genesis_ms,
            blocks: vec![genesis],
            by_hash: HashMap::from([(hash, 0)]),
            pool: vec![],
            heads,
        }
    }

    pub fn config(&self) -> &ChainConfig {
        &self.config
    }

    pub fn genesis_hash(&self) -> H256 {
        self.blocks[0].hash
    }

    pub fn best(&self) -> &Block {
        // The genesis block is never removed, so there is always a last block.
        &self.blocks[self.blocks.len() - 1]
    }

    pub fn best_state(&self) -> &State {
        // The best block always keeps its state.
        self.best()
            .state
            .as_ref()
            .unwrap_or_else(|| unreachable!("best block state is kept"))
    }

    pub fn block_by_number(&self, number: u64) -> Option<&Block> {
        self.blocks.get(usize::try_from(number).ok()?)
    }

    pub fn block_by_hash(&self, hash: &H256) -> Option<&Block> {
        self.by_hash.get(hash).map(|i| &self.blocks[*i])
    }

    /// The state at `hash`, or at the best block when `None`.
    pub fn state_at(&self, hash: Option<&H256>) -> Result<&State, String> {
        match hash {
            None => Ok(self.best_state()),
            Some(hash) => {
                let block = self
                    .block_by_hash(hash)
                    .ok_or_else(|| format!("Unknown block {hash:?}"))?;
                block
                    .state
                    .as_ref()
                    .ok_or_else(|| format!("State of block {hash:?} has been pruned"))
            }
        }
    }

    /// Transactions waiting in the pool, as submitted.
    pub fn pending(&self) -> impl Iterator<Item = &Vec<u8>> {
        self.pool.iter().map(|tx| &tx.bytes)
    }

    pub fn subscribe_heads(&self) -> broadcast::Receiver<Header> {
        self.heads.subscribe()
    }

    fn next_block(&self) -> u64 {
        self.best().header.number as u64 + 1
    }

    fn tx_context<'a>(&self, block_hash: &'a dyn Fn(u64) -> Option<H256>) -> ChainContext<'a> {
        ChainContext {
            genesis_hash: self.genesis_hash(),
            spec_version: runtime::SPEC_VERSION,
            transaction_version: runtime::TRANSACTION_VERSION,
            next_block: self.next_block(),
            block_hash,
        }
    }

    /// The checks a transaction passes before it enters the pool: decoding, signature over the
    /// chain's context, not-yet-used nonce, and subtensor's own pool checks.
    fn check(&self, bytes: &[u8]) -> Result<SignedExtrinsic, InvalidTransaction> {
        let xt = extrinsic::decode(bytes)?;
        let lookup = |n: u64| self.block_by_number(n).map(|b| b.hash);
        xt.verify(&self.tx_context(&lookup))?;
        self.check_state(&xt)?;
        Ok(xt)
    }

    /// The checks that need the chain's state (run under its lock; the signature is not one).
    fn check_state(&self, xt: &SignedExtrinsic) -> Result<(), InvalidTransaction> {
        if xt.extra.nonce < runtime::account_nonce(self.best_state(), &xt.signer) {
            return Err(InvalidTransaction::Stale);
        }
        runtime::subtensor::pool_checks(self.best_state(), self.next_block(), &xt.signer, &xt.call)
    }

    /// What checking `xt`'s signature needs from the chain, copied out so the check can run
    /// without the chain's lock: genesis hash, the next block's number, and the hash of the
    /// block the transaction's era points at.
    pub fn signature_context(&self, xt: &SignedExtrinsic) -> SignatureContext {
        let next_block = self.next_block();
        let birth = xt.extra.era.birth(next_block);
        SignatureContext {
            genesis_hash: self.genesis_hash(),
            next_block,
            birth,
            birth_hash: self.block_by_number(birth).map(|b| b.hash),
        }
    }

    /// What `TaggedTransactionQueue_validate_transaction` answers: [`Chain::submit`]'s checks
    /// without queueing.
    pub fn validate(&self, bytes: &[u8]) -> Result<(), InvalidTransaction> {
        self.check(bytes).map(|_| ())
    }

    /// Checks a transaction against the best block and queues it.
    pub fn submit(
        &mut self,
        bytes: Vec<u8>,
        watcher: Option<mpsc::UnboundedSender<TxStatus>>,
    ) -> Result<H256, SubmitError> {
        let xt = extrinsic::decode(&bytes)?;
        let lookup = |n: u64| self.block_by_number(n).map(|b| b.hash);
        xt.verify(&self.tx_context(&lookup))?;
        self.submit_verified(bytes, xt, watcher)
    }

    /// Queues a transaction whose signature was already checked (see [`verify_unlocked`]); the
    /// checks that need state run here.
    pub fn submit_verified(
        &mut self,
        bytes: Vec<u8>,
        xt: SignedExtrinsic,
        watcher: Option<mpsc::UnboundedSender<TxStatus>>,
    ) -> Result<H256, SubmitError> {
        let hash = H256(sp_crypto_hashing::blake2_256(&bytes));
        if self.pool.iter().any(|tx| tx.hash == hash) {
            return Err(SubmitError::AlreadyImported);
        }
        self.check_state(&xt)?;
        if self
            .pool
            .iter()
            .any(|tx| tx.xt.signer == xt.signer && tx.xt.extra.nonce == xt.extra.nonce)
        {
            return Err(SubmitError::TooLowPriority);
        }
        if self.pool.len() >= self.config.pool_limit {
            return Err(SubmitError::PoolFull);
        }
        let status = if xt.extra.nonce <= self.next_index(&xt.signer) {
            TxStatus::Ready
        } else {
            TxStatus::Future
        };
        if let Some(w) = &watcher {
            let _ = w.send(status);
        }
        let valid_till = xt.extra.era.death(self.next_block());
        self.pool.push(PoolTx {
            bytes,
            hash,
            valid_till,
            xt,
            watcher,
        });
        if self.config.instant {
            self.produce_block();
        }
        Ok(hash)
    }

    /// Signs `call` with `pair` at the next free nonce and submits it: for in-process tools,
    /// seeding and benchmarks (clients go through RPC).
    pub fn sign_and_submit(
        &mut self,
        pair: &sp_core::sr25519::Pair,
        call: &crate::runtime::call::RuntimeCall,
    ) -> Result<H256, SubmitError> {
        use sp_core::Pair as _;
        let signer = AccountId32::new(pair.public().0);
        let nonce = self.next_index(&signer);
        let no_lookup = |_: u64| None;
        let bytes = extrinsic::sign(pair, call, nonce, &self.tx_context(&no_lookup));
        self.submit(bytes, None)
    }

    /// The nonce `who`'s next transaction should carry: the account's nonce advanced past the
    /// pool transactions that are ready to follow it, as `system_accountNextIndex` on a node.
    pub fn next_index(&self, who: &AccountId32) -> u32 {
        let mut pending: Vec<u32> = self
            .pool
            .iter()
            .filter(|tx| &tx.xt.signer == who)
            .map(|tx| tx.xt.extra.nonce)
            .collect();
        pending.sort_unstable();
        let mut next = runtime::account_nonce(self.best_state(), who);
        for nonce in pending {
            if nonce == next {
                next += 1;
            } else if nonce > next {
                break;
            }
        }
        next
    }

    /// Picks the transactions that are valid now, in arrival order and per-signer nonce order.
    fn take_ready(&mut self, state: &State, next_block: u64) -> Vec<PoolTx> {
        let mut nonces: HashMap<AccountId32, u32> = HashMap::new();
        let mut ready = Vec::new();
        loop {
            let mut progressed = false;
            let mut i = 0;
            while i < self.pool.len() && ready.len() < MAX_BLOCK_EXTRINSICS {
                let tx = &self.pool[i];
                let expected = *nonces
                    .entry(tx.xt.signer.clone())
                    .or_insert_with(|| runtime::account_nonce(state, &tx.xt.signer));
                let expired = next_block >= tx.valid_till;
                if tx.xt.extra.nonce < expected || expired {
                    let tx = self.pool.remove(i);
                    if let Some(w) = tx.watcher {
                        let _ = w.send(TxStatus::Invalid);
                    }
                } else if tx.xt.extra.nonce == expected {
                    nonces.insert(tx.xt.signer.clone(), expected + 1);
                    ready.push(self.pool.remove(i));
                    progressed = true;
                } else {
                    i += 1;
                }
            }
            if !progressed || ready.len() >= MAX_BLOCK_EXTRINSICS {
                return ready;
            }
        }
    }

    /// Makes the next block from the pool and announces it.
    pub fn produce_block(&mut self) -> H256 {
        let parent = self.best();
        let parent_hash = parent.hash;
        let parent_state_root = parent.header.state_root;
        let number = parent.header.number + 1;
        let mut state = self.best_state().clone();
        let mut events = Vec::new();
        ParentHash::insert(&mut state, &parent_hash);
        BlockHash::insert(&mut state, &(number - 1), &parent_hash);
        // As frame_system: keep the last `BlockHashCount` hashes, and genesis's for ever.
        if let Some(expired) = number.checked_sub(BLOCK_HASH_COUNT as u32 + 1)
            && expired > 0
        {
            BlockHash::remove(&mut state, &expired);
        }
        {
            let mut exec = Exec {
                state: &mut state,
                block: number as u64,
                phase: Phase::Initialization,
                events: &mut events,
            };
            let now_ms = self.genesis_ms + u64::from(number) * SLOT_DURATION_MS;
            runtime::on_initialize(&mut exec, now_ms, &self.beacon);
        }
        let included = self.take_ready(&state, number as u64);
        let mut extrinsics = Vec::with_capacity(included.len());
        for (index, tx) in included.iter().enumerate() {
            let mut exec = Exec {
                state: &mut state,
                block: number as u64,
                phase: Phase::ApplyExtrinsic(index as u32),
                events: &mut events,
            };
            runtime::storage::system::Account::mutate(exec.state, &tx.xt.signer, |info| {
                info.nonce += 1
            });
            let origin = Origin::Signed(tx.xt.signer.clone());
            let result = exec.transactional(|exec| runtime::dispatch(exec, &origin, &tx.xt.call));
            let event = match result {
                Ok(pays) => SystemEvent::ExtrinsicSuccess {
                    dispatch_info: DispatchEventInfo::normal(pays),
                },
                Err(dispatch_error) => {
                    tracing::debug!(?dispatch_error, "extrinsic failed");
                    SystemEvent::ExtrinsicFailed {
                        dispatch_error,
                        dispatch_info: DispatchEventInfo::normal(Pays::Yes),
                    }
                }
            };
            exec.deposit(RuntimeEvent::System(event));
            extrinsics.push(tx.bytes.clone());
        }
        runtime::store_events(&mut state, &events);

        let extrinsics_root = H256(sp_crypto_hashing::blake2_256(&extrinsics.encode()));
        // Not a trie root: a chained digest of what changed, unique per block and cheap to compute.
        let state_root = H256(sp_crypto_hashing::blake2_256(
            &(parent_state_root, extrinsics_root, events.encode()).encode(),
        ));
        let header = Header {
            parent_hash,
            number,
            state_root,
            extrinsics_root,
            digest: Digest::default(),
        };
        let hash = header.hash();
        for tx in included {
            if let Some(w) = tx.watcher {
                let _ = w.send(TxStatus::InBlock(hash));
                let _ = w.send(TxStatus::Finalized(hash));
            }
        }
        self.by_hash.insert(hash, self.blocks.len());
        self.blocks.push(Block {
            header: header.clone(),
            hash,
            extrinsics: Some(extrinsics),
            state: Some(state),
        });
        if self.blocks.len() > STATE_HISTORY {
            let old = self.blocks.len() - STATE_HISTORY - 1;
            self.blocks[old].state = None;
        }
        if let Some(old) = (number as u64).checked_sub(BLOCK_HASH_COUNT + 1)
            && old > 0
        {
            self.blocks[old as usize].extrinsics = None;
        }
        let _ = self.heads.send(header);
        tracing::trace!(number, ?hash, "block produced");
        hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::call::BalancesCall;
    use crate::runtime::call::{AdminUtilsCall, RuntimeCall, SubtensorCall, SudoCall, SystemCall};
    use crate::runtime::event::SubtensorEvent;
    use crate::runtime::storage::drand::{BeaconConfig, LastStoredRound, Pulses};
    use crate::runtime::storage::subtensor::{
        LastMechansimStepBlock, SubnetworkN, Tempo, TimelockedWeightCommits, Weights,
    };
    use crate::runtime::storage::timestamp::Now;
    use crate::runtime::types::{BoundedVec, MultiAddress};
    use crate::runtime::{dev_account, dev_pair};

    fn chain() -> Chain {
        Chain::new(ChainConfig {
            block_time: None,
            instant: false,
            new_subnet_tempo: 10,
            pool_limit: 64,
            ..ChainConfig::default()
        })
    }

    fn submit_and_block(chain: &mut Chain, who: &str, call: RuntimeCall) {
        chain
            .sign_and_submit(&dev_pair(who), &call)
            .expect("accepted");
        chain.produce_block();
    }

    /// A started subnet on a fresh chain; returns its netuid.
    fn started_subnet(chain: &mut Chain) -> u16 {
        let hotkey = dev_account("Alice//hot");
        submit_and_block(
            chain,
            "Alice",
            RuntimeCall::SubtensorModule(SubtensorCall::register_network { hotkey }),
        );
        let netuid = 1;
        assert_eq!(SubnetworkN::get(chain.best_state(), &netuid), 1);
        submit_and_block(
            chain,
            "Alice",
            RuntimeCall::SubtensorModule(SubtensorCall::start_call { netuid }),
        );
        netuid
    }

    #[test]
    fn epochs_run_where_subtensor_runs_them() {
        let mut chain = chain();
        let netuid = started_subnet(&mut chain);
        let tempo = u64::from(Tempo::get(chain.best_state(), &netuid));
        let mut epoch_blocks = vec![];
        for _ in 0..40 {
            chain.produce_block();
            let number = chain.best().header.number as u64;
            if LastMechansimStepBlock::get(chain.best_state(), &netuid) == number {
                epoch_blocks.push(number);
            }
        }
        assert!(epoch_blocks.len() >= 3, "{epoch_blocks:?}");
        for b in epoch_blocks {
            assert_eq!(
                (b + u64::from(netuid) + 1) % (tempo + 1),
                tempo,
                "block {b}"
            );
        }
    }

    /// Encrypts `payload` to `round` of the chain's beacon, as a validator does.
    fn seal(chain: &Chain, payload: &iota_drand::WeightsTlockPayload, round: u64) -> Vec<u8> {
        use rand::SeedableRng;
        let config = BeaconConfig::get(chain.best_state());
        let public = iota_drand::DrandPublicKey::from_bytes(&config.public_key.0).expect("key");
        iota_drand::encrypt_for_round(
            &payload.encode(),
            round,
            &public,
            &mut rand::rngs::StdRng::from_seed([5; 32]),
        )
        .expect("encrypt")
    }

    fn commit_call(netuid: u16, commit: Vec<u8>, round: u64, version: u16) -> RuntimeCall {
        RuntimeCall::SubtensorModule(SubtensorCall::commit_timelocked_weights {
            netuid,
            commit: BoundedVec(commit),
            reveal_round: round,
            commit_reveal_version: version,
        })
    }

    /// Commit-reveal v4 as finney runs it: the ciphertext sits on chain, unreadable, until the
    /// beacon's pulse for its round is stored and the reveal epoch comes; then the chain opens it
    /// and sets the weights. A commit of the wrong version, one to a round already out, and one
    /// whose payload names another hotkey than its sender's never become weights.
    #[test]
    fn timelocked_commits_are_opened_by_the_chain_in_their_reveal_epoch() {
        let mut chain = Chain::new(ChainConfig {
            block_time: None,
            commit_reveal_version: 4,
            genesis_unix_ms: Some(1_800_000_000_000),
            drand_period_secs: 1,
            ..ChainConfig::default()
        });
        let netuid = started_subnet(&mut chain);
        let owner = dev_account("Alice//hot");
        let miner = dev_account("Bob//hot");
        for (who, call) in [
            (
                "Bob",
                RuntimeCall::SubtensorModule(SubtensorCall::burned_register {
                    netuid,
                    hotkey: miner.clone(),
                }),
            ),
            (
                "Alice",
                RuntimeCall::Sudo(SudoCall::sudo {
                    call: Box::new(RuntimeCall::AdminUtils(
                        AdminUtilsCall::sudo_set_weights_set_rate_limit {
                            netuid,
                            weights_set_rate_limit: 0,
                        },
                    )),
                }),
            ),
            (
                "Alice",
                RuntimeCall::Balances(BalancesCall::transfer_keep_alive {
                    dest: MultiAddress::Id(owner.clone()),
                    value: 10 * crate::runtime::TAO,
                }),
            ),
        ] {
            submit_and_block(&mut chain, who, call);
        }
        let payload = |hotkey: &AccountId32| iota_drand::WeightsTlockPayload {
            hotkey: AsRef::<[u8]>::as_ref(hotkey).to_vec(),
            uids: vec![0, 1],
            values: vec![1, 3],
            version_key: 0,
        };
        let tempo = Tempo::get(chain.best_state(), &netuid);
        let committed_at = chain.next_block();
        let config = BeaconConfig::get(chain.best_state());
        let round = iota_drand::reveal_round(
            &iota_drand::CommitTiming {
                current_block: committed_at - 1,
                first_reveal_block: iota_drand::first_reveal_block(netuid, tempo, committed_at, 1),
                block_time_secs: SLOT_DURATION_MS as f64 / 1_000.0,
                now_unix_secs: Now::get(chain.best_state()) as f64 / 1_000.0,
            },
            &iota_drand::DrandSchedule {
                genesis_time: u64::from(config.genesis_time),
                period_secs: u64::from(config.period),
            },
        )
        .expect("round");
        assert!(
            round > LastStoredRound::get(chain.best_state()),
            "the round is still ahead"
        );

        // A round already out is refused at the pool: anyone could open it now.
        let out = LastStoredRound::get(chain.best_state()) - 1;
        let early = commit_call(netuid, seal(&chain, &payload(&owner), out), out, 4);
        assert!(matches!(
            chain.sign_and_submit(&dev_pair("Alice//hot"), &early),
            Err(SubmitError::Invalid(InvalidTransaction::Custom(15)))
        ));
        // Version 3 on a version-4 chain, then a payload naming the miner: neither is kept as
        // weights; the honest commit is.
        let wrong_version = commit_call(netuid, seal(&chain, &payload(&owner), round), round, 3);
        submit_and_block(&mut chain, "Alice//hot", wrong_version);
        let epoch =
            crate::runtime::subtensor::epoch_index(chain.best_state(), netuid, committed_at);
        assert!(TimelockedWeightCommits::get(chain.best_state(), &netuid, &epoch).is_empty());
        let forged = commit_call(netuid, seal(&chain, &payload(&miner), round), round, 4);
        let honest = commit_call(netuid, seal(&chain, &payload(&owner), round), round, 4);
        chain
            .sign_and_submit(&dev_pair("Alice//hot"), &forged)
            .expect("accepted");
        submit_and_block(&mut chain, "Alice//hot", honest);
        assert_eq!(
            TimelockedWeightCommits::get(chain.best_state(), &netuid, &epoch).len(),
            2
        );

        let mut revealed_at = None;
        for _ in 0..4 * (tempo + 1) {
            assert!(
                Weights::get(chain.best_state(), &netuid, &0).is_empty() || revealed_at.is_some()
            );
            chain.produce_block();
            let state = chain.best_state();
            if revealed_at.is_none() && !Weights::get(state, &netuid, &0).is_empty() {
                revealed_at = Some(chain.best().header.number as u64);
                assert!(Pulses::contains(state, &round));
                let reveals: Vec<_> = runtime::storage::system::Events::get(state)
                    .into_iter()
                    .filter_map(|e| match e.event {
                        RuntimeEvent::SubtensorModule(
                            SubtensorEvent::TimelockedWeightsRevealed(n, who),
                        ) => Some((n, who)),
                        _ => None,
                    })
                    .collect();
                assert_eq!(
                    reveals,
                    vec![(netuid, owner.clone())],
                    "the forged commit is dropped"
                );
            }
        }
        let revealed_at = revealed_at.expect("the chain revealed the commit");
        let reveal_epoch =
            crate::runtime::subtensor::epoch_index(chain.best_state(), netuid, revealed_at);
        assert_eq!(
            reveal_epoch,
            epoch + 1,
            "revealed in the epoch after the commit"
        );
        assert_eq!(
            Weights::get(chain.best_state(), &netuid, &0),
            vec![(0, 21_845), (1, 65_535)]
        );
        assert!(TimelockedWeightCommits::get(chain.best_state(), &netuid, &epoch).is_empty());
    }

    #[test]
    fn a_second_transaction_with_a_pending_nonce_is_refused_and_next_index_counts_the_pool() {
        let mut chain = chain();
        let alice = dev_account("Alice");
        let remark = |n: u8| RuntimeCall::System(SystemCall::remark { remark: vec![n] });
        let no_lookup = |_: u64| None;
        let ctx = chain.tx_context(&no_lookup);
        let first = extrinsic::sign(&dev_pair("Alice"), &remark(1), 0, &ctx);
        let same_nonce = extrinsic::sign(&dev_pair("Alice"), &remark(2), 0, &ctx);
        let next = extrinsic::sign(&dev_pair("Alice"), &remark(3), 1, &ctx);
        let gap = extrinsic::sign(&dev_pair("Alice"), &remark(4), 5, &ctx);
        assert_eq!(chain.next_index(&alice), 0);
        chain.submit(first, None).expect("first");
        assert_eq!(chain.next_index(&alice), 1, "counts the ready transaction");
        assert!(matches!(
            chain.submit(same_nonce, None),
            Err(SubmitError::TooLowPriority)
        ));
        chain.submit(gap, None).expect("a future nonce waits");
        assert_eq!(chain.next_index(&alice), 1, "a gap is not ready");
        chain.submit(next, None).expect("next");
        assert_eq!(chain.next_index(&alice), 2);
        chain.produce_block();
        assert_eq!(runtime::account_nonce(chain.best_state(), &alice), 2);
        assert_eq!(chain.pending().count(), 1, "the future one still waits");
    }

    #[test]
    fn the_pool_is_bounded() {
        let mut chain = chain();
        let no_lookup = |_: u64| None;
        let call = RuntimeCall::System(SystemCall::remark { remark: vec![] });
        // Future nonces never leave the pool by themselves: the cap is what stops them.
        let limit = chain.config().pool_limit as u32;
        for nonce in 1..=limit {
            let ctx = chain.tx_context(&no_lookup);
            let bytes = extrinsic::sign(&dev_pair("Bob"), &call, nonce, &ctx);
            chain.submit(bytes, None).expect("room in the pool");
        }
        let ctx = chain.tx_context(&no_lookup);
        let one_more = extrinsic::sign(&dev_pair("Bob"), &call, limit + 1, &ctx);
        assert!(matches!(
            chain.submit(one_more, None),
            Err(SubmitError::PoolFull)
        ));
    }

    fn nested_sudo(depth: usize) -> RuntimeCall {
        let mut call = RuntimeCall::System(SystemCall::remark { remark: vec![] });
        for _ in 0..depth {
            call = RuntimeCall::Sudo(SudoCall::sudo {
                call: Box::new(call),
            });
        }
        call
    }

    #[test]
    fn deeply_nested_calls_are_refused_before_the_signature_is_checked() {
        let chain = chain();
        let no_lookup = |_: u64| None;
        let ctx = chain.tx_context(&no_lookup);
        let shallow = extrinsic::sign(&dev_pair("Alice"), &nested_sudo(10), 0, &ctx);
        assert_eq!(chain.validate(&shallow), Ok(()));
        // Far deeper than the limit, as raw bytes (0x0c00 is `Sudo.sudo`), with a junk
        // signature: the decoder must stop at the depth limit, not recurse or verify.
        let mut deep = extrinsic::sign(&dev_pair("Alice"), &nested_sudo(0), 0, &ctx);
        let body_start = deep.len() - nested_sudo(0).encode().len();
        let mut body = deep.split_off(body_start);
        let mut nested = Vec::new();
        for _ in 0..100_000 {
            nested.extend([12u8, 0]);
        }
        nested.append(&mut body);
        let mut unframed = deep;
        // Drop the old length prefix and frame again.
        let old_len = <parity_scale_codec::Compact<u32> as parity_scale_codec::Decode>::decode(
            &mut &unframed[..],
        )
        .expect("len");
        let prefix = parity_scale_codec::Compact(old_len.0).encode().len();
        let mut inner = unframed.split_off(prefix);
        inner.extend(nested);
        let mut framed = parity_scale_codec::Compact(inner.len() as u32).encode();
        framed.extend(inner);
        assert_eq!(
            chain.validate(&framed),
            Err(InvalidTransaction::Undecodable)
        );
        let at_limit = extrinsic::sign(&dev_pair("Alice"), &nested_sudo(300), 0, &ctx);
        assert_eq!(
            chain.validate(&at_limit),
            Err(InvalidTransaction::Undecodable)
        );
    }

    #[test]
    fn extreme_owner_hyperparameters_do_not_panic_block_production() {
        let mut chain = chain();
        let netuid = started_subnet(&mut chain);
        let sudo = |call: AdminUtilsCall| {
            RuntimeCall::Sudo(SudoCall::sudo {
                call: Box::new(RuntimeCall::AdminUtils(call)),
            })
        };
        for call in [
            AdminUtilsCall::sudo_set_tempo { netuid, tempo: 1 },
            AdminUtilsCall::sudo_set_kappa {
                netuid,
                kappa: u16::MAX,
            },
            AdminUtilsCall::sudo_set_activity_cutoff {
                netuid,
                activity_cutoff: 0,
            },
            AdminUtilsCall::sudo_set_bonds_moving_average {
                netuid,
                bonds_moving_average: u64::MAX,
            },
            AdminUtilsCall::sudo_set_max_allowed_validators {
                netuid,
                max_allowed_validators: 0,
            },
            AdminUtilsCall::sudo_set_immunity_period {
                netuid,
                immunity_period: u16::MAX,
            },
            AdminUtilsCall::sudo_set_min_allowed_weights {
                netuid,
                min_allowed_weights: u16::MAX,
            },
            AdminUtilsCall::sudo_set_max_burn {
                netuid,
                max_burn: u64::MAX,
            },
            AdminUtilsCall::sudo_set_min_burn {
                netuid,
                min_burn: u64::MAX,
            },
        ] {
            submit_and_block(&mut chain, "Alice", sudo(call));
        }
        for _ in 0..5 {
            chain.produce_block();
        }
        submit_and_block(
            &mut chain,
            "Alice",
            sudo(AdminUtilsCall::sudo_set_tempo {
                netuid,
                tempo: u16::MAX,
            }),
        );
        for _ in 0..5 {
            chain.produce_block();
        }
        assert!(chain.best().header.number > 10);
    }

    #[test]
    fn old_block_hashes_and_bodies_are_pruned() {
        let mut chain = chain();
        let total = BLOCK_HASH_COUNT + 10;
        for _ in 0..total {
            chain.produce_block();
        }
        let state = chain.best_state();
        assert!(
            state.get(&BlockHash::key(&0)).is_some(),
            "genesis's hash is kept"
        );
        for n in 1..=9u32 {
            assert!(
                state.get(&BlockHash::key(&n)).is_none(),
                "block {n}'s hash is pruned"
            );
            assert!(
                chain
                    .block_by_number(u64::from(n))
                    .expect("header")
                    .extrinsics
                    .is_none()
            );
        }
        let recent = (total - BLOCK_HASH_COUNT) as u32;
        assert!(state.get(&BlockHash::key(&recent)).is_some());
        assert!(
            chain
                .block_by_number(u64::from(recent))
                .expect("header")
                .extrinsics
                .is_some()
        );
        let hashes = state.keys_with_prefix(&BlockHash::prefix(), None).count() as u64;
        assert_eq!(
            hashes,
            BLOCK_HASH_COUNT + 1,
            "the last BlockHashCount hashes and genesis"
        );
    }
}
