//! The Substrate JSON-RPC surface (legacy `chain_*`, `state_*`, `author_*`, `system_*`) over the
//! chain, as a node serves it, plus `dev_newBlock` for tests that need blocks on demand.

use std::sync::{Arc, Mutex, MutexGuard};

use jsonrpsee::core::RpcResult;
use jsonrpsee::types::{ErrorObject, ErrorObjectOwned, Params};
use jsonrpsee::{PendingSubscriptionSink, RpcModule};
use parity_scale_codec::{Decode, Encode};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::chain::{Chain, SubmitError, TxStatus, verify_unlocked};
use crate::metadata::{METADATA_VERSIONS, metadata_bytes_at};
use crate::runtime::extrinsic::InvalidTransaction;
use crate::runtime::extrinsic::extension_types::{
    TransactionSource, TransactionValidity, TransactionValidityError, ValidTransaction,
};
use crate::runtime::types::{AccountId32, H256, Header};
use crate::runtime::{self, runtime_version};

pub type SharedChain = Arc<Mutex<Chain>>;

const INVALID_PARAMS: i32 = -32602;
/// Substrate's "client error" code for state queries it cannot answer.
const CLIENT_ERROR: i32 = 4003;
/// Substrate's "verification error": the transaction could not even be decoded.
const VERIFICATION_ERROR: i32 = 1002;
const POOL_INVALID_TX: i32 = 1010;
const POOL_ALREADY_IMPORTED: i32 = 1013;
const POOL_TOO_LOW_PRIORITY: i32 = 1014;
const POOL_IMMEDIATELY_DROPPED: i32 = 1016;
/// Most keys `state_getKeys` returns in one answer (the paged form has no such limit).
const MAX_KEYS: usize = 10_000;

fn invalid_params(msg: impl Into<String>) -> ErrorObjectOwned {
    ErrorObject::owned(INVALID_PARAMS, msg.into(), None::<()>)
}

fn client_error(msg: impl Into<String>) -> ErrorObjectOwned {
    ErrorObject::owned(CLIENT_ERROR, msg.into(), None::<()>)
}

fn submit_error(err: SubmitError) -> ErrorObjectOwned {
    match err {
        SubmitError::Invalid(InvalidTransaction::Undecodable) => ErrorObject::owned(
            VERIFICATION_ERROR,
            "Verification Error: Runtime error: Could not decode the extrinsic",
            None::<()>,
        ),
        SubmitError::Invalid(invalid) => ErrorObject::owned(
            POOL_INVALID_TX,
            "Invalid Transaction",
            Some(invalid.to_string()),
        ),
        SubmitError::AlreadyImported => ErrorObject::owned(
            POOL_ALREADY_IMPORTED,
            "Transaction Already Imported",
            None::<()>,
        ),
        SubmitError::TooLowPriority => ErrorObject::owned(
            POOL_TOO_LOW_PRIORITY,
            "Priority is too low: (0 vs 0)",
            Some(
                "The transaction has too low priority to replace another transaction already in the pool.",
            ),
        ),
        SubmitError::PoolFull => ErrorObject::owned(
            POOL_IMMEDIATELY_DROPPED,
            "Immediately Dropped",
            Some("The transaction couldn't enter the pool because of the limit"),
        ),
    }
}

fn lock(chain: &SharedChain) -> MutexGuard<'_, Chain> {
    // A panic while holding the lock is a bug elsewhere; the chain data itself stays usable.
    chain
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Positional parameters; a missing or `null` one reads as `Value::Null`.
fn positional(params: &Params<'_>) -> Result<Vec<Value>, ErrorObjectOwned> {
    if params.as_str().is_none() {
        return Ok(vec![]);
    }
    match params.parse::<Value>() {
        Ok(Value::Array(values)) => Ok(values),
        Ok(Value::Null) => Ok(vec![]),
        Ok(other) => Ok(vec![other]),
        Err(e) => Err(invalid_params(e.to_string())),
    }
}

fn arg(args: &[Value], i: usize) -> &Value {
    args.get(i).unwrap_or(&Value::Null)
}

fn parse_hex(value: &Value, what: &str) -> Result<Vec<u8>, ErrorObjectOwned> {
    let s = value
        .as_str()
        .ok_or_else(|| invalid_params(format!("{what}: expected a hex string")))?;
    hex::decode(s.trim_start_matches("0x")).map_err(|e| invalid_params(format!("{what}: {e}")))
}

fn parse_hash(value: &Value) -> Result<Option<H256>, ErrorObjectOwned> {
    if value.is_null() {
        return Ok(None);
    }
    let bytes = parse_hex(value, "block hash")?;
    if bytes.len() != 32 {
        return Err(invalid_params("block hash: expected 32 bytes"));
    }
    Ok(Some(H256::from_slice(&bytes)))
}

fn parse_number(value: &Value) -> Result<Option<u64>, ErrorObjectOwned> {
    match value {
        Value::Null => Ok(None),
        Value::Number(n) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| invalid_params("block number")),
        Value::String(s) => {
            let parsed = match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            };
            parsed
                .map(Some)
                .map_err(|e| invalid_params(format!("block number: {e}")))
        }
        _ => Err(invalid_params("block number: expected a number")),
    }
}

fn hex0x(bytes: impl AsRef<[u8]>) -> String {
    format!("0x{}", hex::encode(bytes))
}

fn header_json(header: &Header) -> Value {
    json!({
        "parentHash": hex0x(header.parent_hash),
        "number": format!("0x{:x}", header.number),
        "stateRoot": hex0x(header.state_root),
        "extrinsicsRoot": hex0x(header.extrinsics_root),
        "digest": { "logs": header.digest.logs.iter().map(|l| hex0x(l.encode())).collect::<Vec<_>>() },
    })
}

fn runtime_version_json() -> Value {
    let v = runtime_version();
    json!({
        "specName": v.spec_name.0,
        "implName": v.impl_name.0,
        "authoringVersion": v.authoring_version,
        "specVersion": v.spec_version,
        "implVersion": v.impl_version,
        "apis": v.apis.0.iter().map(|(id, ver)| json!([hex0x(id), ver])).collect::<Vec<_>>(),
        "transactionVersion": v.transaction_version,
        "systemVersion": v.system_version,
        "stateVersion": 1,
    })
}

fn status_json(status: &TxStatus) -> Value {
    match status {
        TxStatus::Ready => json!("ready"),
        TxStatus::Future => json!("future"),
        TxStatus::InBlock(h) => json!({ "inBlock": hex0x(h) }),
        TxStatus::Finalized(h) => json!({ "finalized": hex0x(h) }),
        TxStatus::Invalid => json!("invalid"),
    }
}

fn decode_arg<T: Decode>(input: &mut &[u8], what: &str) -> Result<T, ErrorObjectOwned> {
    T::decode(input).map_err(|e| invalid_params(format!("{what}: {e}")))
}

/// Runtime API calls answered by `state_call`, each one a method the metadata declares.
fn runtime_call(
    chain: &Chain,
    method: &str,
    data: &[u8],
    at: Option<&H256>,
) -> Result<Vec<u8>, ErrorObjectOwned> {
    use crate::runtime::rpc_info as info;
    let state = chain.state_at(at).map_err(client_error)?;
    let block = match at {
        Some(h) => chain.block_by_hash(h).map(|b| b.header.number as u64),
        None => Some(chain.best().header.number as u64),
    }
    .unwrap_or_default();
    let input = &mut &data[..];
    let out = match method {
        "Core_version" => runtime_version().encode(),
        "Metadata_metadata" => {
            info::OpaqueMetadata(metadata_bytes_at(14).unwrap_or_default().to_vec()).encode()
        }
        "Metadata_metadata_versions" => METADATA_VERSIONS.to_vec().encode(),
        "Metadata_metadata_at_version" => {
            let version: u32 = decode_arg(input, "version")?;
            metadata_bytes_at(version)
                .map(|b| info::OpaqueMetadata(b.to_vec()))
                .encode()
        }
        "AccountNonceApi_account_nonce" => {
            let who: AccountId32 = decode_arg(input, "account")?;
            runtime::account_nonce(state, &who).encode()
        }
        "TaggedTransactionQueue_validate_transaction" => {
            let _source: TransactionSource = decode_arg(input, "source")?;
            let tx: Vec<u8> = decode_arg(input, "tx")?;
            let mut framed = parity_scale_codec::Compact(tx.len() as u32).encode();
            framed.extend_from_slice(&tx);
            let validity: TransactionValidity = chain
                .validate(&framed)
                .map(|()| ValidTransaction {
                    priority: 0,
                    requires: vec![],
                    provides: vec![],
                    longevity: u64::MAX,
                    propagate: true,
                })
                .map_err(TransactionValidityError::from);
            validity.encode()
        }
        "TransactionPaymentApi_query_info" => {
            let _uxt: Vec<u8> = decode_arg(input, "uxt")?;
            let len: u32 = decode_arg(input, "len")?;
            info::query_info(len).encode()
        }
        "NeuronInfoRuntimeApi_get_neurons" => {
            info::neurons(state, decode_arg(input, "netuid")?).encode()
        }
        "NeuronInfoRuntimeApi_get_neurons_lite" => {
            info::neurons_lite(state, decode_arg(input, "netuid")?).encode()
        }
        "NeuronInfoRuntimeApi_get_neuron" => {
            let netuid: u16 = decode_arg(input, "netuid")?;
            info::neuron(state, netuid, decode_arg(input, "uid")?).encode()
        }
        "NeuronInfoRuntimeApi_get_neuron_lite" => {
            let netuid: u16 = decode_arg(input, "netuid")?;
            info::neuron_lite_at(state, netuid, decode_arg(input, "uid")?).encode()
        }
        "SubnetInfoRuntimeApi_get_metagraph" => {
            info::metagraph(state, decode_arg(input, "netuid")?, block).encode()
        }
        "SubnetInfoRuntimeApi_get_selective_metagraph" => {
            let netuid: u16 = decode_arg(input, "netuid")?;
            let indexes: Vec<u16> = decode_arg(input, "metagraph_indexes")?;
            info::metagraph(state, netuid, block)
                .map(|m| info::SelectiveMetagraph::select(m, &indexes))
                .encode()
        }
        "SubnetInfoRuntimeApi_get_selective_mechagraph" => {
            let netuid: u16 = decode_arg(input, "netuid")?;
            let subid: u8 = decode_arg(input, "subid")?;
            let indexes: Vec<u16> = decode_arg(input, "metagraph_indexes")?;
            // One mechanism per subnet on the localnet: mechanism 0 is the subnet.
            (subid == 0)
                .then(|| info::metagraph(state, netuid, block))
                .flatten()
                .map(|m| info::SelectiveMetagraph::select(m, &indexes))
                .encode()
        }
        "SubnetInfoRuntimeApi_get_subnet_state" => {
            info::subnet_state(state, decode_arg(input, "netuid")?).encode()
        }
        "SubnetInfoRuntimeApi_get_subnet_hyperparams_v2" => {
            info::hyperparams_v2(state, decode_arg(input, "netuid")?).encode()
        }
        "StakeInfoRuntimeApi_get_stake_info_for_coldkey" => {
            info::stake_info_for_coldkey(state, &decode_arg(input, "coldkey_account")?).encode()
        }
        "StakeInfoRuntimeApi_get_stake_info_for_hotkey_coldkey_netuid" => {
            let hotkey: AccountId32 = decode_arg(input, "hotkey_account")?;
            let coldkey: AccountId32 = decode_arg(input, "coldkey_account")?;
            info::stake_info(state, &hotkey, &coldkey, decode_arg(input, "netuid")?).encode()
        }
        "SwapRuntimeApi_current_alpha_price" => {
            let _netuid: u16 = decode_arg(input, "netuid")?;
            info::ALPHA_PRICE.encode()
        }
        "SwapRuntimeApi_sim_swap_tao_for_alpha" | "SwapRuntimeApi_sim_swap_alpha_for_tao" => {
            let _netuid: u16 = decode_arg(input, "netuid")?;
            info::sim_swap(decode_arg(input, "amount")?).encode()
        }
        "SubnetRegistrationRuntimeApi_get_network_registration_cost" => {
            info::network_registration_cost(state).encode()
        }
        other => {
            return Err(client_error(format!(
                "Execution failed: Exported method {other} is not found"
            )));
        }
    };
    Ok(out)
}

const METHODS: &[&str] = &[
    "account_nextIndex",
    "author_pendingExtrinsics",
    "author_submitAndWatchExtrinsic",
    "author_submitExtrinsic",
    "author_unwatchExtrinsic",
    "chain_getBlock",
    "chain_getBlockHash",
    "chain_getFinalisedHead",
    "chain_getFinalizedHead",
    "chain_getHead",
    "chain_getHeader",
    "chain_getRuntimeVersion",
    "chain_subscribeAllHeads",
    "chain_subscribeFinalizedHeads",
    "chain_subscribeNewHeads",
    "chain_unsubscribeAllHeads",
    "chain_unsubscribeFinalizedHeads",
    "chain_unsubscribeNewHeads",
    "dev_newBlock",
    "payment_queryInfo",
    "rpc_methods",
    "state_call",
    "state_getKeys",
    "state_getKeysPaged",
    "state_getMetadata",
    "state_getRuntimeVersion",
    "state_getStorage",
    "state_getStorageAt",
    "state_queryStorageAt",
    "state_subscribeRuntimeVersion",
    "state_subscribeStorage",
    "state_unsubscribeRuntimeVersion",
    "state_unsubscribeStorage",
    "system_accountNextIndex",
    "system_chain",
    "system_health",
    "system_name",
    "system_properties",
    "system_version",
];

/// Builds the RPC module over a shared chain.
pub fn module(
    chain: SharedChain,
) -> Result<RpcModule<SharedChain>, jsonrpsee::core::RegisterMethodError> {
    let mut m = RpcModule::new(chain);

    m.register_method(
        "rpc_methods",
        |_, _, _| json!({ "version": 1, "methods": METHODS }),
    )?;
    m.register_method("system_chain", |_, _, _| "IOTA Localnet")?;
    m.register_method("system_name", |_, _, _| "iota-localnet")?;
    m.register_method("system_version", |_, _, _| env!("CARGO_PKG_VERSION"))?;
    m.register_method(
        "system_health",
        |_, _, _| json!({ "peers": 0, "isSyncing": false, "shouldHavePeers": false }),
    )?;
    m.register_method("system_properties", |_, _, _| {
        json!({ "ss58Format": runtime::SS58_PREFIX, "tokenDecimals": 9, "tokenSymbol": "TAO" })
    })?;
    m.register_method("system_accountNextIndex", |p, chain, _| -> RpcResult<u32> {
        let args = positional(&p)?;
        let who = arg(&args, 0)
            .as_str()
            .ok_or_else(|| invalid_params("account: expected SS58"))?;
        let who: AccountId32 = sp_core::crypto::Ss58Codec::from_ss58check(who)
            .map_err(|e| invalid_params(format!("account: {e:?}")))?;
        Ok(lock(chain).next_index(&who))
    })?;
    m.register_alias("account_nextIndex", "system_accountNextIndex")?;

    m.register_method(
        "chain_getBlockHash",
        |p, chain, _| -> RpcResult<Option<String>> {
            let args = positional(&p)?;
            let chain = lock(chain);
            Ok(match parse_number(arg(&args, 0))? {
                None => Some(hex0x(chain.best().hash)),
                Some(n) => chain.block_by_number(n).map(|b| hex0x(b.hash)),
            })
        },
    )?;
    for name in ["chain_getFinalizedHead", "chain_getHead"] {
        m.register_method(name, |_, chain, _| hex0x(lock(chain).best().hash))?;
    }
    m.register_method(
        "chain_getHeader",
        |p, chain, _| -> RpcResult<Option<Value>> {
            let args = positional(&p)?;
            let chain = lock(chain);
            Ok(match parse_hash(arg(&args, 0))? {
                None => Some(header_json(&chain.best().header)),
                Some(h) => chain.block_by_hash(&h).map(|b| header_json(&b.header)),
            })
        },
    )?;
    m.register_method(
        "chain_getBlock",
        |p, chain, _| -> RpcResult<Option<Value>> {
            let args = positional(&p)?;
            let chain = lock(chain);
            let block = match parse_hash(arg(&args, 0))? {
                None => Some(chain.best()),
                Some(h) => chain.block_by_hash(&h),
            };
            // A pruned body reads as an unknown block, as on a pruned node.
            Ok(block.and_then(|b| {
                let extrinsics = b.extrinsics.as_ref()?;
                Some(json!({
                    "block": {
                        "header": header_json(&b.header),
                        "extrinsics": extrinsics.iter().map(hex0x).collect::<Vec<_>>(),
                    },
                    "justifications": null,
                }))
            }))
        },
    )?;
    for (sub, notif, unsub) in [
        (
            "chain_subscribeNewHeads",
            "chain_newHead",
            "chain_unsubscribeNewHeads",
        ),
        (
            "chain_subscribeFinalizedHeads",
            "chain_finalizedHead",
            "chain_unsubscribeFinalizedHeads",
        ),
        (
            "chain_subscribeAllHeads",
            "chain_allHead",
            "chain_unsubscribeAllHeads",
        ),
    ] {
        m.register_subscription(sub, notif, unsub, |_, pending, chain, _| async move {
            let (current, mut heads) = {
                let chain = lock(&chain);
                (chain.best().header.clone(), chain.subscribe_heads())
            };
            stream_heads(pending, current, &mut heads).await;
        })?;
    }

    m.register_method("state_getRuntimeVersion", |_, _, _| runtime_version_json())?;
    m.register_subscription(
        "state_subscribeRuntimeVersion",
        "state_runtimeVersion",
        "state_unsubscribeRuntimeVersion",
        |_, pending, _, _| async move {
            if let Ok(sink) = pending.accept().await
                && let Ok(msg) = serde_json::value::to_raw_value(&runtime_version_json())
            {
                let _ = sink.send(msg).await;
                // The runtime never upgrades; keep the subscription open until the client leaves.
                sink.closed().await;
            }
        },
    )?;
    m.register_method("state_getMetadata", |_, _, _| {
        hex0x(metadata_bytes_at(14).unwrap_or_default())
    })?;
    m.register_method("state_call", |p, chain, _| -> RpcResult<String> {
        let args = positional(&p)?;
        let method = arg(&args, 0)
            .as_str()
            .ok_or_else(|| invalid_params("method: expected a string"))?;
        let data = match arg(&args, 1) {
            Value::Null => vec![],
            v => parse_hex(v, "call data")?,
        };
        let at = parse_hash(arg(&args, 2))?;
        let chain = lock(chain);
        runtime_call(&chain, method, &data, at.as_ref()).map(hex0x)
    })?;
    m.register_method(
        "state_getStorage",
        |p, chain, _| -> RpcResult<Option<String>> {
            let args = positional(&p)?;
            let key = parse_hex(arg(&args, 0), "storage key")?;
            let at = parse_hash(arg(&args, 1))?;
            let chain = lock(chain);
            let state = chain.state_at(at.as_ref()).map_err(client_error)?;
            Ok(state.get(&key).map(hex0x))
        },
    )?;
    m.register_method(
        "state_getKeysPaged",
        |p, chain, _| -> RpcResult<Vec<String>> {
            let args = positional(&p)?;
            let prefix = match arg(&args, 0) {
                Value::Null => vec![],
                v => parse_hex(v, "prefix")?,
            };
            let count = arg(&args, 1)
                .as_u64()
                .ok_or_else(|| invalid_params("count: expected a number"))?;
            if count > 1_000 {
                return Err(invalid_params("count exceeds maximum value of 1000"));
            }
            let start = match arg(&args, 2) {
                Value::Null => None,
                v => Some(parse_hex(v, "start key")?),
            };
            let at = parse_hash(arg(&args, 3))?;
            let chain = lock(chain);
            let state = chain.state_at(at.as_ref()).map_err(client_error)?;
            Ok(state
                .keys_with_prefix(&prefix, start.as_deref())
                .take(count as usize)
                .map(hex0x)
                .collect())
        },
    )?;
    m.register_method("state_queryStorageAt", |p, chain, _| -> RpcResult<Value> {
        let args = positional(&p)?;
        let keys = arg(&args, 0)
            .as_array()
            .ok_or_else(|| invalid_params("keys: expected an array"))?;
        let keys = keys
            .iter()
            .map(|k| parse_hex(k, "storage key"))
            .collect::<Result<Vec<_>, _>>()?;
        let at = parse_hash(arg(&args, 1))?;
        let chain = lock(chain);
        let block_hash = at.unwrap_or(chain.best().hash);
        let state = chain.state_at(Some(&block_hash)).map_err(client_error)?;
        let changes: Vec<Value> = keys
            .iter()
            .map(|k| json!([hex0x(k), state.get(k).map(hex0x)]))
            .collect();
        Ok(json!([{ "block": hex0x(block_hash), "changes": changes }]))
    })?;

    m.register_alias("state_getStorageAt", "state_getStorage")?;
    m.register_alias("chain_getRuntimeVersion", "state_getRuntimeVersion")?;
    m.register_alias("chain_getFinalisedHead", "chain_getFinalizedHead")?;
    m.register_method("state_getKeys", |p, chain, _| -> RpcResult<Vec<String>> {
        let args = positional(&p)?;
        let prefix = parse_hex(arg(&args, 0), "prefix")?;
        let at = parse_hash(arg(&args, 1))?;
        let chain = lock(chain);
        let state = chain.state_at(at.as_ref()).map_err(client_error)?;
        let keys: Vec<String> = state
            .keys_with_prefix(&prefix, None)
            .take(MAX_KEYS + 1)
            .map(hex0x)
            .collect();
        if keys.len() > MAX_KEYS {
            return Err(client_error(format!(
                "more than {MAX_KEYS} keys under this prefix: use state_getKeysPaged"
            )));
        }
        Ok(keys)
    })?;
    m.register_method("payment_queryInfo", |p, _, _| -> RpcResult<Value> {
        let args = positional(&p)?;
        let bytes = parse_hex(arg(&args, 0), "extrinsic")?;
        let info = crate::runtime::rpc_info::query_info(bytes.len() as u32);
        Ok(json!({
            "weight": { "ref_time": info.weight.ref_time, "proof_size": info.weight.proof_size },
            "class": "normal",
            "partialFee": info.partial_fee.to_string(),
        }))
    })?;
    m.register_subscription(
        "state_subscribeStorage",
        "state_storage",
        "state_unsubscribeStorage",
        |p, pending, chain, _| async move {
            let keys = match positional(&p).and_then(|args| match arg(&args, 0) {
                Value::Array(keys) => keys
                    .iter()
                    .map(|k| parse_hex(k, "storage key"))
                    .collect::<Result<Vec<_>, _>>(),
                Value::Null => Err(invalid_params(
                    "keys: subscribing to every key is not supported",
                )),
                _ => Err(invalid_params("keys: expected an array")),
            }) {
                Ok(keys) if keys.len() <= MAX_KEYS => keys,
                Ok(_) => return pending.reject(invalid_params("too many keys")).await,
                Err(e) => return pending.reject(e).await,
            };
            let mut heads = lock(&chain).subscribe_heads();
            stream_storage(pending, (*chain).clone(), keys, &mut heads).await;
        },
    )?;

    m.register_method("author_pendingExtrinsics", |_, chain, _| -> Vec<String> {
        lock(chain).pending().map(hex0x).collect()
    })?;
    m.register_method(
        "author_submitExtrinsic",
        |p, chain, _| -> RpcResult<String> {
            let args = positional(&p)?;
            let bytes = parse_hex(arg(&args, 0), "extrinsic")?;
            let xt = verify_unlocked(chain, &bytes).map_err(|e| submit_error(e.into()))?;
            lock(chain)
                .submit_verified(bytes, xt, None)
                .map(hex0x)
                .map_err(submit_error)
        },
    )?;
    m.register_subscription(
        "author_submitAndWatchExtrinsic",
        "author_extrinsicUpdate",
        "author_unwatchExtrinsic",
        |p, pending, chain, _| async move {
            let bytes = match positional(&p).and_then(|args| parse_hex(arg(&args, 0), "extrinsic"))
            {
                Ok(b) => b,
                Err(e) => return pending.reject(e).await,
            };
            let xt = match verify_unlocked(&chain, &bytes) {
                Ok(xt) => xt,
                Err(e) => return pending.reject(submit_error(e.into())).await,
            };
            let (tx, rx) = mpsc::unbounded_channel();
            let submitted = lock(&chain).submit_verified(bytes, xt, Some(tx));
            if let Err(e) = submitted {
                return pending.reject(submit_error(e)).await;
            }
            stream_statuses(pending, rx).await;
        },
    )?;

    m.register_method("dev_newBlock", |p, chain, _| -> RpcResult<String> {
        let args = positional(&p)?;
        let count = match arg(&args, 0) {
            Value::Null => 1,
            Value::Object(o) => o.get("count").and_then(Value::as_u64).unwrap_or(1),
            v => v
                .as_u64()
                .ok_or_else(|| invalid_params("count: expected a number"))?,
        };
        let mut chain = lock(chain);
        let mut hash = chain.best().hash;
        for _ in 0..count.min(100_000) {
            hash = chain.produce_block();
        }
        Ok(hex0x(hash))
    })?;
    Ok(m)
}

async fn stream_heads(
    pending: PendingSubscriptionSink,
    current: Header,
    heads: &mut tokio::sync::broadcast::Receiver<Header>,
) {
    let Ok(sink) = pending.accept().await else {
        return;
    };
    let mut next = Some(current);
    loop {
        if let Some(header) = next.take() {
            let Ok(msg) = serde_json::value::to_raw_value(&header_json(&header)) else {
                return;
            };
            if sink.send(msg).await.is_err() {
                return;
            }
        }
        tokio::select! {
            _ = sink.closed() => return,
            received = heads.recv() => match received {
                Ok(header) => next = Some(header),
                // A slow subscriber skips heads rather than holding the chain back.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

/// `state_storage` notifications: the watched keys' values now, then each block's changes.
async fn stream_storage(
    pending: PendingSubscriptionSink,
    chain: SharedChain,
    keys: Vec<Vec<u8>>,
    heads: &mut tokio::sync::broadcast::Receiver<Header>,
) {
    let Ok(sink) = pending.accept().await else {
        return;
    };
    let mut last: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
    let mut first = true;
    loop {
        let (hash, values) = {
            let chain = lock(&chain);
            let state = chain.best_state();
            let values: Vec<Option<Vec<u8>>> = keys.iter().map(|k| state.get(k).cloned()).collect();
            (chain.best().hash, values)
        };
        let changes: Vec<Value> = keys
            .iter()
            .zip(values.iter().zip(&last))
            .filter(|(_, (now, before))| first || now != before)
            .map(|(k, (now, _))| json!([hex0x(k), now.as_ref().map(hex0x)]))
            .collect();
        if !changes.is_empty() {
            let msg = json!({ "block": hex0x(hash), "changes": changes });
            let Ok(msg) = serde_json::value::to_raw_value(&msg) else {
                return;
            };
            if sink.send(msg).await.is_err() {
                return;
            }
        }
        first = false;
        last = values;
        tokio::select! {
            _ = sink.closed() => return,
            received = heads.recv() => match received {
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

async fn stream_statuses(
    pending: PendingSubscriptionSink,
    mut rx: mpsc::UnboundedReceiver<TxStatus>,
) {
    let Ok(sink) = pending.accept().await else {
        return;
    };
    loop {
        tokio::select! {
            _ = sink.closed() => return,
            status = rx.recv() => {
                let Some(status) = status else { return };
                let Ok(msg) = serde_json::value::to_raw_value(&status_json(&status)) else { return };
                if sink.send(msg).await.is_err() {
                    return;
                }
                if matches!(status, TxStatus::Finalized(_) | TxStatus::Invalid) {
                    return;
                }
            }
        }
    }
}
