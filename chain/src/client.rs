//! The connection to a subtensor node: connect (with reconnects and timeouts), check the runtime's
//! shape, read storage in batches, and submit calls with typed errors.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use subxt::client::OnlineClientAtBlock;
use subxt::config::{DefaultExtrinsicParamsBuilder, RpcConfigFor};
use subxt::error::{
    DispatchError, ExtrinsicError, TransactionEventsError, TransactionProgressError,
    TransactionStatusError,
};
use subxt::ext::scale_decode::DecodeAsType;
use subxt::ext::scale_encode::EncodeAsType;
use subxt::extrinsics::ExtrinsicEvents;
use subxt::metadata::Metadata;
use subxt::rpcs::client::RpcClient;
use subxt::rpcs::client::reconnecting_rpc_client::{ExponentialBackoff, RpcClient as Reconnecting};
use subxt::rpcs::methods::LegacyRpcMethods;
use subxt::storage::Address;
use subxt::transactions::TransactionStatus;
use subxt::utils::{AccountId32, H256};
use subxt::{OnlineClient, PolkadotConfig};

use crate::api;
use crate::calls::{self, Call};
use crate::error::{ChainError, InvalidTransaction, from_rpc_error};
use crate::network::{ConnectOptions, ShapeCheck};
use crate::shape;
use crate::wallet::{Keypair, PublicKey};

/// A client view of the chain at one block.
pub type AtBlock = OnlineClientAtBlock<PolkadotConfig>;

/// Keys per `state_queryStorageAt` request; nodes cap request sizes, so big batches are split.
const QUERY_CHUNK: usize = 512;

/// When a submitted transaction counts as done.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WaitFor {
    /// Included in a best block (what the Python SDK waits for by default).
    #[default]
    InBlock,
    /// Included in a finalized block.
    Finalized,
}

/// How to submit a transaction.
#[derive(Clone, Debug)]
pub struct TxOptions {
    /// When to consider the transaction done.
    pub wait_for: WaitFor,
    /// Longest wait from submission to inclusion.
    pub timeout: Duration,
    /// Encode the call and return it instead of submitting.
    pub dry_run: bool,
    /// Use this nonce instead of the account's next one (to replace a stuck transaction).
    pub nonce: Option<u64>,
}

impl Default for TxOptions {
    fn default() -> Self {
        Self {
            wait_for: WaitFor::InBlock,
            timeout: Duration::from_secs(120),
            dry_run: false,
            nonce: None,
        }
    }
}

impl TxOptions {
    /// Default options with `dry_run` set.
    pub fn dry_run() -> Self {
        Self {
            dry_run: true,
            ..Self::default()
        }
    }
}

/// A transaction that made it into a block and succeeded.
#[derive(Debug)]
pub struct Receipt {
    /// Block that includes it.
    pub block_hash: H256,
    /// That block's number.
    pub block_number: u64,
    /// Hash of the extrinsic.
    pub extrinsic_hash: H256,
    /// The events it emitted.
    pub events: ExtrinsicEvents<PolkadotConfig>,
}

/// What a call did: ran on chain, or was only encoded (`--dry-run`).
#[derive(Debug)]
pub enum TxOutcome {
    /// Encoded call data (pallet index, call index, arguments), not submitted.
    DryRun {
        /// SCALE-encoded call.
        call_data: Vec<u8>,
    },
    /// Included in a block and succeeded.
    Included(Receipt),
}

impl TxOutcome {
    /// The call as `0x…` hex when this was a dry run.
    pub fn dry_run_hex(&self) -> Option<String> {
        match self {
            TxOutcome::DryRun { call_data } => Some(format!("0x{}", hex::encode(call_data))),
            TxOutcome::Included(_) => None,
        }
    }

    /// The receipt when the call was submitted.
    pub fn receipt(&self) -> Option<&Receipt> {
        match self {
            TxOutcome::Included(r) => Some(r),
            TxOutcome::DryRun { .. } => None,
        }
    }
}

struct Inner {
    client: OnlineClient<PolkadotConfig>,
    rpc: LegacyRpcMethods<RpcConfigFor<PolkadotConfig>>,
    url: String,
    shape_differences: Vec<shape::Difference>,
    shape_check: ShapeCheck,
    /// Latest runtime spec version seen.
    spec_version: AtomicU32,
    /// Breaking differences per spec version already checked (runtimes upgrade under a running
    /// client; each new spec is checked once).
    checked_specs: std::sync::Mutex<HashMap<u32, Vec<String>>>,
    /// One submission at a time per client, so two tasks never take the same nonce.
    submit_lock: tokio::sync::Mutex<()>,
}

/// A connection to a subtensor node. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct Subtensor {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Subtensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subtensor")
            .field("url", &self.inner.url)
            .field("spec_version", &self.spec_version())
            .finish_non_exhaustive()
    }
}

impl Subtensor {
    /// Connects to `opts.url`, reads the runtime's metadata and checks that every call and storage
    /// entry this client uses still has the shape it was built for.
    ///
    /// The connection re-dials with exponential backoff when it drops; reads in flight are
    /// retried by subxt's backend once it is back.
    ///
    /// # Errors
    ///
    /// [`ChainError::Connect`] / [`ChainError::Timeout`] when the node cannot be reached, and
    /// [`ChainError::ShapeMismatch`] (with [`ShapeCheck::Strict`]) naming what changed.
    pub async fn connect(opts: ConnectOptions) -> Result<Self, ChainError> {
        let started = Instant::now();
        let url = opts.url.clone();
        let connect_err = |reason: String| ChainError::Connect {
            url: url.clone(),
            reason,
        };
        let connecting = async {
            let transport = Reconnecting::builder()
                .retry_policy(
                    ExponentialBackoff::from_millis(2)
                        .factor(50)
                        .max_delay(opts.max_reconnect_delay),
                )
                .request_timeout(opts.request_timeout)
                .connection_timeout(opts.connect_timeout)
                .build(&opts.url)
                .await
                .map_err(|e| connect_err(e.to_string()))?;
            let rpc = RpcClient::new(transport);
            // Finney is not Polkadot: no historic Polkadot types, everything comes from metadata.
            let config = PolkadotConfig::builder().use_historic_types(false).build();
            let client = OnlineClient::from_rpc_client_with_config(config, rpc.clone())
                .await
                .map_err(|e| connect_err(e.to_string()))?;
            let at = client
                .at_current_block()
                .await
                .map_err(|e| connect_err(e.to_string()))?;
            Ok::<_, ChainError>((client, rpc, at))
        };
        let (client, rpc, at) = tokio::time::timeout(opts.connect_timeout, connecting)
            .await
            .map_err(|_| ChainError::Timeout {
                what: format!("a connection to {url}"),
                after: opts.connect_timeout,
            })??;

        let shape_differences = evaluate_shape(&url, opts.shape_check, at.metadata_ref())?;
        let breaking = shape_differences
            .iter()
            .filter(|d| d.breaking)
            .map(|d| d.description.clone())
            .collect();
        tracing::info!(
            url = %url,
            spec_version = at.spec_version(),
            block = at.block_number(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "connected to subtensor"
        );
        Ok(Self {
            inner: Arc::new(Inner {
                rpc: LegacyRpcMethods::new(rpc),
                client,
                url,
                shape_differences,
                shape_check: opts.shape_check,
                spec_version: AtomicU32::new(at.spec_version()),
                checked_specs: std::sync::Mutex::new(HashMap::from([(
                    at.spec_version(),
                    breaking,
                )])),
                submit_lock: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// Connects with default options.
    ///
    /// # Errors
    ///
    /// As [`Subtensor::connect`].
    pub async fn connect_url(url: impl Into<String>) -> Result<Self, ChainError> {
        Self::connect(ConnectOptions::new(url)).await
    }

    /// The endpoint.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// The runtime's spec version (the latest one seen).
    pub fn spec_version(&self) -> u32 {
        self.inner.spec_version.load(Ordering::Relaxed)
    }

    /// Re-runs the shape check when `at` runs a runtime this client has not checked yet (an
    /// upgrade since connecting), and refuses to work with it when it broke something.
    fn guard_runtime(&self, at: &AtBlock) -> Result<(), ChainError> {
        if self.inner.shape_check == ShapeCheck::Off {
            return Ok(());
        }
        let spec = at.spec_version();
        let mut checked = self
            .inner
            .checked_specs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let breaking = match checked.get(&spec) {
            Some(b) => b.clone(),
            None => {
                let previous = self.inner.spec_version.swap(spec, Ordering::Relaxed);
                tracing::warn!(url = %self.inner.url, from = previous, to = spec, "runtime upgraded; re-checking its shape");
                let breaking: Vec<String> =
                    evaluate_shape(&self.inner.url, ShapeCheck::Warn, at.metadata_ref())?
                        .into_iter()
                        .filter(|d| d.breaking)
                        .map(|d| d.description)
                        .collect();
                checked.insert(spec, breaking.clone());
                breaking
            }
        };
        if self.inner.shape_check == ShapeCheck::Strict && !breaking.is_empty() {
            return Err(ChainError::ShapeMismatch(breaking));
        }
        Ok(())
    }

    /// Differences found by the shape check at connect: non-breaking ones, plus breaking ones when
    /// it ran in `Warn` mode.
    pub fn shape_differences(&self) -> &[shape::Difference] {
        &self.inner.shape_differences
    }

    /// The underlying subxt client, for anything this crate does not wrap.
    pub fn subxt(&self) -> &OnlineClient<PolkadotConfig> {
        &self.inner.client
    }

    /// The legacy JSON-RPC methods on the same connection.
    pub fn rpc(&self) -> &LegacyRpcMethods<RpcConfigFor<PolkadotConfig>> {
        &self.inner.rpc
    }

    /// The chain at the latest finalized block.
    ///
    /// # Errors
    ///
    /// [`ChainError::Rpc`].
    pub async fn at_finalized(&self) -> Result<AtBlock, ChainError> {
        let at = self
            .inner
            .client
            .at_current_block()
            .await
            .map_err(ChainError::rpc)?;
        self.guard_runtime(&at)?;
        Ok(at)
    }

    /// Hash of the latest finalized block: one small request, to tell whether anything can
    /// have changed since a read.
    ///
    /// # Errors
    ///
    /// [`ChainError::Rpc`].
    pub async fn finalized_hash(&self) -> Result<H256, ChainError> {
        self.inner
            .rpc
            .chain_get_finalized_head()
            .await
            .map_err(ChainError::rpc)
    }

    /// The chain at the block with `hash`.
    ///
    /// # Errors
    ///
    /// [`ChainError::Rpc`]; [`ChainError::ShapeMismatch`] when that block's runtime differs from
    /// the compiled one in a breaking way.
    pub async fn at_hash(&self, hash: H256) -> Result<AtBlock, ChainError> {
        let at = self
            .inner
            .client
            .at_block(hash)
            .await
            .map_err(ChainError::rpc)?;
        self.guard_runtime(&at)?;
        Ok(at)
    }

    /// The chain at the best block: what the next transaction is checked against, so reads that
    /// decide whether a transaction may go now (rate limits, commit windows) use it.
    ///
    /// # Errors
    ///
    /// [`ChainError::Rpc`].
    pub async fn at_best(&self) -> Result<AtBlock, ChainError> {
        let hash = self
            .inner
            .rpc
            .chain_get_block_hash(None)
            .await
            .map_err(ChainError::rpc)?
            .ok_or_else(|| ChainError::Rpc("the node reported no best block".into()))?;
        self.at_hash(hash).await
    }

    /// Number of the best block.
    ///
    /// # Errors
    ///
    /// [`ChainError::Rpc`].
    pub async fn best_block_number(&self) -> Result<u64, ChainError> {
        let header = self
            .inner
            .rpc
            .chain_get_header(None)
            .await
            .map_err(ChainError::rpc)?
            .ok_or_else(|| ChainError::Rpc("the node returned no header".into()))?;
        Ok(header.number)
    }

    /// Waits until the best block is at least `target`, following new heads; returns the block
    /// number reached.
    ///
    /// # Errors
    ///
    /// [`ChainError::Timeout`] when `timeout` passes first.
    pub async fn wait_for_block(&self, target: u64, timeout: Duration) -> Result<u64, ChainError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let timeout_err = || ChainError::Timeout {
            what: format!("block {target}"),
            after: timeout,
        };
        loop {
            let now = self.best_block_number().await?;
            if now >= target {
                return Ok(now);
            }
            tracing::debug!(now, target, "waiting for blocks");
            let mut heads = match self.inner.client.stream_best_blocks().await {
                Ok(s) => s,
                Err(e) => {
                    // The connection may be re-dialling; try again shortly.
                    tracing::debug!(error = %e, "block subscription failed");
                    tokio::time::sleep_until(
                        (tokio::time::Instant::now() + Duration::from_millis(500)).min(deadline),
                    )
                    .await;
                    if tokio::time::Instant::now() >= deadline {
                        return Err(timeout_err());
                    }
                    continue;
                }
            };
            loop {
                match tokio::time::timeout_at(deadline, heads.next()).await {
                    Err(_) => return Err(timeout_err()),
                    Ok(Some(Ok(block))) if block.number() >= target => return Ok(block.number()),
                    Ok(Some(Ok(_))) => {}
                    // Stream ended or broke (reconnect): re-check and resubscribe.
                    Ok(Some(Err(_)) | None) => break,
                }
            }
        }
    }

    /// Encodes `call` against the node's current metadata: the bytes a dry run prints.
    ///
    /// # Errors
    ///
    /// [`ChainError::ShapeMismatch`] when the call does not fit the node's runtime.
    pub async fn encode_call(&self, call: &Call) -> Result<Vec<u8>, ChainError> {
        let at = self.at_finalized().await?;
        encode_call(at.metadata_ref(), call)
    }

    /// Free balance of `account`, in rao.
    ///
    /// # Errors
    ///
    /// [`ChainError::Rpc`] / [`ChainError::Decode`].
    pub async fn free_balance(&self, account: &PublicKey) -> Result<u64, ChainError> {
        let at = self.at_best().await?;
        let mut batch = StorageBatch::new(&at);
        let slot = batch.add(
            api::storage().system().account(),
            (crate::signer::account(account),),
        )?;
        let fetched = batch.fetch(self).await?;
        Ok(fetched.value(&slot)?.data.free)
    }

    /// Signs `call` with `signer`, submits it and waits as `opts` says, or only encodes it when
    /// `opts.dry_run` is set.
    ///
    /// Dispatch errors come back by name ([`ChainError::SettingWeightsTooFast`], …), including
    /// the inner error of a `Sudo.sudo` call; node rejections as
    /// [`ChainError::InvalidTransaction`].
    ///
    /// # Errors
    ///
    /// As described, plus [`ChainError::Timeout`] and [`ChainError::Rpc`].
    pub async fn submit(
        &self,
        call: &Call,
        signer: &Keypair,
        opts: &TxOptions,
    ) -> Result<TxOutcome, ChainError> {
        let at = self.at_best().await?;
        let call_data = encode_call(at.metadata_ref(), call)?;
        let what = calls::describe(call);
        if opts.dry_run {
            tracing::info!(call = %what, bytes = call_data.len(), "dry run: not submitted");
            return Ok(TxOutcome::DryRun { call_data });
        }
        let started = Instant::now();
        let guard = self.inner.submit_lock.lock().await;
        let payload = at
            .transactions()
            .from_call_data_bytes(&call_data)
            .map_err(|e| ChainError::ShapeMismatch(vec![format!("{what}: {e}")]))?;
        let who = AccountId32(signer.public().to_bytes());
        // The pool-aware nonce counts transactions still waiting in the pool or in unfinalized
        // blocks, so back-to-back submissions do not collide.
        let nonce = match opts.nonce {
            Some(n) => n,
            None => self
                .inner
                .rpc
                .system_account_next_index(&who)
                .await
                .map_err(ChainError::rpc)?,
        };
        let params = DefaultExtrinsicParamsBuilder::<PolkadotConfig>::new()
            .nonce(nonce)
            .build();
        let signed = at
            .transactions()
            .create_signed(&payload, signer, params)
            .await
            .map_err(map_extrinsic_error)?;
        let progress = signed
            .submit_and_watch()
            .await
            .map_err(|e| name_pool_rejection(map_extrinsic_error(e), call))?;
        // Once the node accepted it, the next submission may take the next nonce.
        drop(guard);
        let extrinsic_hash = progress.extrinsic_hash();
        tracing::debug!(call = %what, nonce, tx = ?extrinsic_hash, "submitted");

        let in_block = tokio::time::timeout(opts.timeout, async {
            let mut progress = progress;
            while let Some(status) = progress.next().await {
                match status.map_err(map_progress_error)? {
                    TransactionStatus::InBestBlock(b) if opts.wait_for == WaitFor::InBlock => {
                        return Ok(b);
                    }
                    TransactionStatus::InFinalizedBlock(b) => return Ok(b),
                    TransactionStatus::Invalid { message } => {
                        return Err(ChainError::TransactionStatus {
                            status: "invalid",
                            message,
                        });
                    }
                    TransactionStatus::Dropped { message } => {
                        return Err(ChainError::TransactionStatus {
                            status: "dropped",
                            message,
                        });
                    }
                    TransactionStatus::Error { message } => {
                        return Err(ChainError::TransactionStatus {
                            status: "error",
                            message,
                        });
                    }
                    _ => {}
                }
            }
            Err(ChainError::TransactionStatus {
                status: "dropped",
                message: "the node closed the status stream".into(),
            })
        })
        .await
        .map_err(|_| ChainError::Timeout {
            what: format!("{what} to be included"),
            after: opts.timeout,
        })??;

        let events = in_block
            .wait_for_success()
            .await
            .map_err(map_events_error)?;
        let block_hash = in_block.block_hash();
        // `Sudo.sudo` succeeds even when the call it wraps fails; the verdict is in `Sudid`.
        if let Some(sudid) = events.find_first::<api::sudo::events::Sudid>() {
            let sudid = sudid.map_err(|e| ChainError::decode("Sudo.Sudid", e))?;
            if let Err(e) = sudid.sudo_result {
                return Err(runtime_dispatch_error(at.metadata_ref(), &e));
            }
        }
        let block_number = self
            .inner
            .rpc
            .chain_get_header(Some(block_hash))
            .await
            .map_err(ChainError::rpc)?
            .map(|h| h.number)
            .ok_or_else(|| ChainError::Rpc(format!("no header for block {block_hash:?}")))?;
        tracing::info!(
            call = %what,
            block = block_number,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "included"
        );
        Ok(TxOutcome::Included(Receipt {
            block_hash,
            block_number,
            extrinsic_hash,
            events,
        }))
    }

    /// Fetches many storage values at `at` with as few requests as possible
    /// (`state_queryStorageAt`, split into chunks of 512 keys sent concurrently).
    ///
    /// # Errors
    ///
    /// [`ChainError::Rpc`].
    pub async fn fetch_raw_many(
        &self,
        at: H256,
        keys: &[Vec<u8>],
    ) -> Result<Vec<Option<Vec<u8>>>, ChainError> {
        let rpc = &self.inner.rpc;
        let requests = keys.chunks(QUERY_CHUNK).map(|chunk| async move {
            // A dropped connection is re-dialled by the transport; retry the read a few times.
            let mut attempt = 0;
            loop {
                match rpc
                    .state_query_storage_at(chunk.iter().map(Vec::as_slice), Some(at))
                    .await
                {
                    Ok(sets) => return Ok(sets),
                    Err(subxt::rpcs::Error::DisconnectedWillReconnect(reason)) if attempt < 5 => {
                        attempt += 1;
                        tracing::debug!(%reason, attempt, "connection lost; retrying read");
                        tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
                    }
                    Err(e) => return Err(ChainError::rpc(e)),
                }
            }
        });
        let mut values: HashMap<Vec<u8>, Option<Vec<u8>>> = HashMap::with_capacity(keys.len());
        for sets in futures::future::try_join_all(requests).await? {
            for set in sets {
                for (key, value) in set.changes {
                    values.insert(key.0, value.map(|v| v.0));
                }
            }
        }
        Ok(keys
            .iter()
            .map(|k| values.get(k).cloned().flatten())
            .collect())
    }
}

/// Compares `node` with the compiled metadata; fails on breaking differences in `Strict` mode and
/// logs them otherwise.
fn evaluate_shape(
    url: &str,
    check: ShapeCheck,
    node: &Metadata,
) -> Result<Vec<shape::Difference>, ChainError> {
    if check == ShapeCheck::Off {
        return Ok(Vec::new());
    }
    let diffs = shape::differences(shape::compiled_metadata()?, node);
    let breaking: Vec<String> = diffs
        .iter()
        .filter(|d| d.breaking)
        .map(|d| d.description.clone())
        .collect();
    if check == ShapeCheck::Strict && !breaking.is_empty() {
        return Err(ChainError::ShapeMismatch(breaking));
    }
    for d in &diffs {
        if d.breaking {
            tracing::warn!(url = %url, difference = %d, "runtime shape differs");
        } else {
            tracing::info!(url = %url, difference = %d, "runtime differs harmlessly");
        }
    }
    Ok(diffs)
}

/// Encodes `call` for the runtime described by `metadata` (by pallet, call and field name, so a
/// moved index is followed and a changed shape is an error).
///
/// # Errors
///
/// [`ChainError::ShapeMismatch`].
pub fn encode_call(metadata: &Metadata, call: &Call) -> Result<Vec<u8>, ChainError> {
    call.encode_as_type(metadata.outer_enums().call_enum_ty(), metadata.types())
        .map_err(|e| {
            ChainError::ShapeMismatch(vec![format!(
                "{} does not encode for this runtime: {e}",
                calls::describe(call)
            )])
        })
}

/// Decodes call bytes back into the runtime call enum, using `metadata`'s types.
///
/// # Errors
///
/// [`ChainError::Decode`].
pub fn decode_call(metadata: &Metadata, mut bytes: &[u8]) -> Result<Call, ChainError> {
    let call = Call::decode_as_type(
        &mut bytes,
        metadata.outer_enums().call_enum_ty(),
        metadata.types(),
    )
    .map_err(|e| ChainError::decode("call data", e))?;
    if !bytes.is_empty() {
        return Err(ChainError::decode(
            "call data",
            format!("{} bytes left over", bytes.len()),
        ));
    }
    Ok(call)
}

fn map_extrinsic_error(e: ExtrinsicError) -> ChainError {
    match &e {
        ExtrinsicError::ErrorSubmittingTransaction(backend)
        | ExtrinsicError::TransactionStatusStreamError(backend) => map_backend_error(backend),
        ExtrinsicError::IncompatibleCodegen => ChainError::ShapeMismatch(vec![e.to_string()]),
        ExtrinsicError::TransactionStatusError(TransactionStatusError::Invalid(message)) => {
            ChainError::TransactionStatus {
                status: "invalid",
                message: message.clone(),
            }
        }
        _ => ChainError::rpc(e),
    }
}

/// Subtensor's transaction extension refuses some calls at submission with a numeric code
/// (`Custom error: N`) instead of a dispatch error. Where the code and the call identify the
/// pallet error unambiguously, it is reported under the same name a dispatch error would have.
fn name_pool_rejection(e: ChainError, call: &Call) -> ChainError {
    use crate::api::runtime_types::pallet_subtensor::pallet::Call as S;
    let ChainError::InvalidTransaction(InvalidTransaction::Custom { code, .. }) = &e else {
        return e;
    };
    let code = *code;
    let sub = match call {
        Call::SubtensorModule(c) => Some(c),
        _ => None,
    };
    let named = match (code, sub) {
        (1, Some(S::set_weights { .. } | S::commit_weights { .. } | S::reveal_weights { .. })) => {
            Some(ChainError::NotEnoughStakeToSetWeights)
        }
        (1, Some(S::add_stake { .. } | S::remove_stake { .. })) => Some(ChainError::AmountTooLow),
        (2, _) => Some(ChainError::NotEnoughBalanceToStake),
        (3, _) => Some(ChainError::SubnetNotExists),
        (6, Some(S::set_weights { .. })) => Some(ChainError::SettingWeightsTooFast),
        (6, Some(S::commit_weights { .. })) => Some(ChainError::CommittingWeightsTooFast),
        (6, Some(S::serve_axon { .. })) | (12, _) => Some(ChainError::ServingRateLimitExceeded),
        (10, _) => Some(ChainError::HotKeyNotRegisteredInNetwork),
        (11, _) => Some(ChainError::InvalidIpAddress),
        (13, _) => Some(ChainError::InvalidPort),
        (16, _) => Some(ChainError::NoWeightsCommitFound),
        (17, _) => Some(ChainError::RevealTooEarly),
        (19, _) => Some(ChainError::HotKeyNotRegisteredInSubNet),
        _ => None,
    };
    match named {
        Some(n) => {
            tracing::debug!(code, call = %calls::describe(call), error = %n, "refused at submission");
            n
        }
        None => e,
    }
}

fn map_backend_error(e: &subxt::error::BackendError) -> ChainError {
    match e {
        subxt::error::BackendError::Rpc(subxt::error::RpcError::ClientError(rpc)) => {
            from_rpc_error(rpc)
        }
        other => ChainError::rpc(other),
    }
}

fn map_progress_error(e: TransactionProgressError) -> ChainError {
    match e {
        TransactionProgressError::CannotGetNextProgressUpdate(b) => map_backend_error(&b),
        other => ChainError::rpc(other),
    }
}

fn map_events_error(e: TransactionEventsError) -> ChainError {
    match e {
        TransactionEventsError::ExtrinsicFailed(d) => dispatch_error(&d),
        other => ChainError::rpc(other),
    }
}

/// Names a subxt dispatch error (it carries the metadata it was decoded with).
fn dispatch_error(e: &DispatchError) -> ChainError {
    match e {
        DispatchError::Module(m) => match m.details() {
            Ok(d) => ChainError::from_module(d.pallet.name(), &d.variant.name),
            Err(_) => ChainError::Other(m.details_string()),
        },
        DispatchError::BadOrigin => ChainError::BadOrigin,
        other => ChainError::Other(format!("{other:?}")),
    }
}

/// Names a dispatch error carried inside an event (`Sudo.Sudid`), looking the pallet and error up
/// by index in the node's metadata.
fn runtime_dispatch_error(
    metadata: &Metadata,
    e: &api::runtime_types::sp_runtime::DispatchError,
) -> ChainError {
    use api::runtime_types::sp_runtime::DispatchError as D;
    match e {
        D::Module(m) => {
            let pallet = metadata.pallet_by_error_index(m.index);
            let variant = pallet.and_then(|p| p.error_variant_by_index(m.error[0]));
            match (pallet, variant) {
                (Some(p), Some(v)) => ChainError::from_module(p.name(), &v.name),
                _ => ChainError::Other(format!("unknown module error {m:?}")),
            }
        }
        D::BadOrigin => ChainError::BadOrigin,
        other => ChainError::Other(format!("{other:?}")),
    }
}

/// A handle to one value in a [`StorageBatch`].
pub struct Slot<V> {
    index: usize,
    /// Pallet and entry names, shared by every slot of one entry.
    names: Arc<(String, String)>,
    marker: PhantomData<V>,
}

impl<V> Slot<V> {
    fn pallet(&self) -> &str {
        &self.names.0
    }

    fn entry(&self) -> &str {
        &self.names.1
    }
}

/// Collects storage keys (built from static addresses, so their shape is checked) and fetches
/// them in one go.
pub struct StorageBatch<'a> {
    at: &'a AtBlock,
    keys: Vec<Vec<u8>>,
}

impl<'a> StorageBatch<'a> {
    /// An empty batch at `at`.
    pub fn new(at: &'a AtBlock) -> Self {
        Self {
            at,
            keys: Vec::new(),
        }
    }

    /// Number of keys queued.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is queued.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Queues the value at `addr` / `parts`.
    ///
    /// # Errors
    ///
    /// [`ChainError::ShapeMismatch`] when the node's entry differs from the compiled one.
    pub fn add<Addr>(
        &mut self,
        addr: Addr,
        parts: Addr::KeyParts,
    ) -> Result<Slot<Addr::Value>, ChainError>
    where
        Addr: Address,
    {
        let mut slots = self.add_all(addr, [parts])?;
        slots
            .pop()
            .ok_or_else(|| ChainError::Other("a storage batch lost a key".into()))
    }

    /// Queues the value at `addr` for each of `parts`, in order.
    ///
    /// Prefer this to [`StorageBatch::add`] in a loop: checking an address against the node's
    /// metadata hashes the entry's whole type tree, and this does it once for all the keys (it
    /// was most of the CPU time of reading a 1,000-uid metagraph).
    ///
    /// # Errors
    ///
    /// [`ChainError::ShapeMismatch`] when the node's entry differs from the compiled one.
    pub fn add_all<Addr, I>(
        &mut self,
        addr: Addr,
        parts: I,
    ) -> Result<Vec<Slot<Addr::Value>>, ChainError>
    where
        Addr: Address,
        I: IntoIterator<Item = Addr::KeyParts>,
    {
        let names = Arc::new((addr.pallet_name().to_owned(), addr.entry_name().to_owned()));
        let mismatch = |e: subxt::error::StorageError| {
            ChainError::ShapeMismatch(vec![format!("storage {}.{}: {e}", names.0, names.1)])
        };
        let at = self.at;
        let entry = at.storage().entry(addr).map_err(mismatch)?;
        parts
            .into_iter()
            .map(|parts| {
                self.keys.push(entry.fetch_key(parts).map_err(mismatch)?);
                Ok(Slot {
                    index: self.keys.len() - 1,
                    names: names.clone(),
                    marker: PhantomData,
                })
            })
            .collect()
    }

    /// Fetches every queued key.
    ///
    /// # Errors
    ///
    /// [`ChainError::Rpc`].
    pub async fn fetch(self, chain: &Subtensor) -> Result<Fetched<'a>, ChainError> {
        let values = chain
            .fetch_raw_many(self.at.block_hash(), &self.keys)
            .await?;
        Ok(Fetched {
            metadata: self.at.metadata_ref(),
            values,
        })
    }
}

/// Values fetched by a [`StorageBatch`].
pub struct Fetched<'a> {
    metadata: &'a Metadata,
    values: Vec<Option<Vec<u8>>>,
}

impl Fetched<'_> {
    fn entry_info(&self, pallet: &str, entry: &str) -> Result<(u32, Option<&[u8]>), ChainError> {
        let e = self
            .metadata
            .pallet_by_name(pallet)
            .and_then(|p| p.storage())
            .and_then(|s| s.entry_by_name(entry))
            .ok_or_else(|| {
                ChainError::ShapeMismatch(vec![format!("storage {pallet}.{entry} is missing")])
            })?;
        Ok((e.value_ty(), e.default_value()))
    }

    /// The value, or the entry's default when the key is absent.
    ///
    /// # Errors
    ///
    /// [`ChainError::Decode`] when neither decodes.
    pub fn value<V: DecodeAsType>(&self, slot: &Slot<V>) -> Result<V, ChainError> {
        let (ty, default) = self.entry_info(slot.pallet(), slot.entry())?;
        let bytes = self
            .values
            .get(slot.index)
            .and_then(|v| v.as_deref())
            .or(default)
            .ok_or_else(|| {
                ChainError::decode(format!("{}.{}", slot.pallet(), slot.entry()), "no value")
            })?;
        self.decode(slot, ty, bytes)
    }

    /// The value if the key is present (for `OptionQuery` entries such as `Axons`).
    ///
    /// # Errors
    ///
    /// [`ChainError::Decode`].
    pub fn optional<V: DecodeAsType>(&self, slot: &Slot<V>) -> Result<Option<V>, ChainError> {
        let (ty, _) = self.entry_info(slot.pallet(), slot.entry())?;
        match self.values.get(slot.index).and_then(|v| v.as_deref()) {
            Some(bytes) => self.decode(slot, ty, bytes).map(Some),
            None => Ok(None),
        }
    }

    fn decode<V: DecodeAsType>(
        &self,
        slot: &Slot<V>,
        ty: u32,
        mut bytes: &[u8],
    ) -> Result<V, ChainError> {
        V::decode_as_type(&mut bytes, ty, self.metadata.types())
            .map_err(|e| ChainError::decode(format!("{}.{}", slot.pallet(), slot.entry()), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}

    fn send<T: Send>(_: T) {}

    /// Never run: it only has to compile, proving that validator loops can `tokio::spawn` these.
    #[allow(dead_code)]
    fn futures_are_send(
        chain: &Subtensor,
        key: &Keypair,
        store: &crate::commit::JsonFileCommitStore,
    ) {
        let tx = TxOptions::default();
        send(chain.metagraph(1));
        send(chain.set_weights(key, 1, &[0], &[1.0], store, &Default::default()));
        send(chain.reveal_pending(key, store, &tx));
        send(chain.register(key, 1, &key.public(), &tx));
        send(chain.submit(&calls::start_call(1), key, &tx));
        send(chain.wait_for_block(1, Duration::from_secs(1)));
    }

    #[test]
    fn handles_are_send_and_sync() {
        send_sync::<Subtensor>();
        send_sync::<ChainError>();
        send_sync::<Receipt>();
    }
}
