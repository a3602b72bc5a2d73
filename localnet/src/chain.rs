//! Blocks, the transaction pool and block production. Blocks are final as soon as they are made.

use std::collections::HashMap;
use std::time::Duration;

use parity_scale_codec::Encode;
use tokio::sync::{broadcast, mpsc};

use crate::runtime::event::{DispatchEventInfo, Pays, Phase, RuntimeEvent, SystemEvent};
use crate::runtime::extrinsic::{self, ChainContext, InvalidTransaction, SignedExtrinsic};
use crate::runtime::storage::system::{BlockHash, ParentHash};
use crate::runtime::types::{AccountId32, Digest, H256, Header};
use crate::runtime::{self, Exec, Origin};
use crate::state::State;

/// How many recent blocks keep their full state for reads "at" them.
const STATE_HISTORY: usize = 4_096;
/// Most extrinsics one block takes; the rest wait for the next.
const MAX_BLOCK_EXTRINSICS: usize = 8_192;
/// Most transactions the pool holds; more are refused until blocks drain it (a node's
/// `--pool-limit` is 8192 by default).
pub const MAX_POOL: usize = 8_192;

#[derive(Clone, Debug)]
pub struct ChainConfig {
    /// Make a block on a timer with this interval.
    pub block_time: Option<Duration>,
    /// Make a block as soon as a transaction arrives.
    pub instant: bool,
    /// Tempo given to newly registered subnets.
    pub new_subnet_tempo: u16,
}

impl Default for ChainConfig {
    fn default() -> Self {
        Self {
            block_time: Some(Duration::from_millis(250)),
            instant: false,
            new_subnet_tempo: 10,
        }
    }
}

pub struct Block {
    pub header: Header,
    pub hash: H256,
    pub extrinsics: Vec<Vec<u8>>,
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

pub struct Chain {
    config: ChainConfig,
    blocks: Vec<Block>,
    by_hash: HashMap<H256, usize>,
    pool: Vec<PoolTx>,
    heads: broadcast::Sender<Header>,
}

impl Chain {
    pub fn new(config: ChainConfig) -> Self {
        let mut state = runtime::genesis_state(config.new_subnet_tempo);
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
            extrinsics: vec![],
            state: Some(state),
        };
        Self {
            config,
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
        if xt.extra.nonce < runtime::account_nonce(self.best_state(), &xt.signer) {
            return Err(InvalidTransaction::Stale);
        }
        runtime::subtensor::pool_checks(
            self.best_state(),
            self.next_block(),
            &xt.signer,
            &xt.call,
        )?;
        Ok(xt)
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
        let hash = H256(sp_crypto_hashing::blake2_256(&bytes));
        if self.pool.iter().any(|tx| tx.hash == hash) {
            return Err(SubmitError::AlreadyImported);
        }
        let xt = self.check(&bytes)?;
        if self
            .pool
            .iter()
            .any(|tx| tx.xt.signer == xt.signer && tx.xt.extra.nonce == xt.extra.nonce)
        {
            return Err(SubmitError::TooLowPriority);
        }
        if self.pool.len() >= MAX_POOL {
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
        {
            let mut exec = Exec {
                state: &mut state,
                block: number as u64,
                phase: Phase::Initialization,
                events: &mut events,
            };
            runtime::on_initialize(&mut exec);
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
            extrinsics,
            state: Some(state),
        });
        if self.blocks.len() > STATE_HISTORY {
            let old = self.blocks.len() - STATE_HISTORY - 1;
            self.blocks[old].state = None;
        }
        let _ = self.heads.send(header);
        tracing::trace!(number, ?hash, "block produced");
        hash
    }
}
