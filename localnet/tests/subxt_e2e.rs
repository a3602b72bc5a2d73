//! The localnet driven by an unmodified subxt client, as any Bittensor tool would drive a node.

use std::time::Duration;

use iota_localnet::{Localnet, LocalnetConfig};
use subxt::dynamic::{self, Value};
use subxt::error::{DispatchError, TransactionEventsError, TransactionFinalizedSuccessError};
use subxt::utils::AccountId32;
use subxt::{OnlineClient, PolkadotConfig};
use subxt_signer::sr25519::{Keypair, dev};

type Client = OnlineClient<PolkadotConfig>;
const TAO: u64 = 1_000_000_000;

fn account(k: &Keypair) -> AccountId32 {
    AccountId32(k.public_key().0)
}

fn key(seed: u8) -> Keypair {
    Keypair::from_secret_key([seed; 32]).expect("valid seed")
}

async fn connect(net: &Localnet) -> Client {
    tokio::time::timeout(
        Duration::from_secs(20),
        Client::from_insecure_url(net.ws_url()),
    )
    .await
    .expect("connect in time")
    .expect("subxt connects")
}

/// Signs, submits and waits for the block; `Err` carries the dispatch error's name.
async fn submit(
    client: &Client,
    pallet: &str,
    call: &str,
    args: Vec<Value>,
    signer: &Keypair,
) -> Result<subxt::extrinsics::ExtrinsicEvents<PolkadotConfig>, String> {
    let payload = dynamic::tx(pallet, call, args);
    let at = client.at_current_block().await.map_err(|e| e.to_string())?;
    let progress = at
        .transactions()
        .sign_and_submit_then_watch_default(&payload, signer)
        .await
        .map_err(|e| format!("submit: {e:?}"))?;
    let result = tokio::time::timeout(
        Duration::from_secs(20),
        progress.wait_for_finalized_success(),
    )
    .await
    .map_err(|_| "timed out".to_string())?;
    match result {
        Ok(events) => Ok(events),
        Err(TransactionFinalizedSuccessError::SuccessError(
            TransactionEventsError::ExtrinsicFailed(DispatchError::Module(m)),
        )) => Err(m
            .details()
            .map(|d| d.variant.name.clone())
            .unwrap_or_else(|e| e.to_string())),
        Err(other) => Err(format!("{other}")),
    }
}

fn sudo_call(call: &str, fields: Vec<(&str, Value)>) -> Vec<Value> {
    let inner = Value::unnamed_variant(
        "AdminUtils",
        [Value::named_variant(
            call,
            fields.into_iter().map(|(k, v)| (k.to_string(), v)),
        )],
    );
    vec![inner]
}

async fn storage_u16s(client: &Client, item: &str, netuid: u16) -> Vec<u16> {
    let at = client.at_current_block().await.expect("block");
    let addr = dynamic::storage::<(u16,), Vec<u16>>("SubtensorModule", item);
    at.storage()
        .fetch(addr, (netuid,))
        .await
        .expect("fetch")
        .decode()
        .expect("decode")
}

async fn free_balance(client: &Client, who: &AccountId32) -> u64 {
    #[derive(scale_decode::DecodeAsType)]
    struct Info {
        data: Data,
    }
    #[derive(scale_decode::DecodeAsType)]
    struct Data {
        free: u64,
    }
    let at = client.at_current_block().await.expect("block");
    let addr = dynamic::storage::<([u8; 32],), Info>("System", "Account");
    at.storage()
        .fetch(addr, (who.0,))
        .await
        .expect("fetch")
        .decode()
        .expect("decode")
        .data
        .free
}

fn acc(a: &AccountId32) -> Value {
    Value::from_bytes(a.0)
}

#[tokio::test]
async fn subnet_lifecycle_through_plain_subxt() {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let client = connect(&net).await;
    let (alice, bob, charlie) = (dev::alice(), dev::bob(), dev::charlie());

    // Transfer.
    let before = free_balance(&client, &account(&bob)).await;
    let events = submit(
        &client,
        "Balances",
        "transfer_keep_alive",
        vec![
            Value::unnamed_variant("Id", [acc(&account(&bob))]),
            Value::u128(10 * TAO as u128),
        ],
        &alice,
    )
    .await
    .expect("transfer");
    assert!(
        events
            .iter()
            .any(|e| e.map(|e| e.event_name() == "Transfer").unwrap_or(false))
    );
    assert_eq!(
        free_balance(&client, &account(&bob)).await,
        before + 10 * TAO
    );

    // Subnet owned by Alice, with her hotkey as uid 0.
    let owner_hot = key(1);
    let events = submit(
        &client,
        "SubtensorModule",
        "register_network",
        vec![acc(&account(&owner_hot))],
        &alice,
    )
    .await
    .expect("register_network");
    assert!(
        events
            .iter()
            .any(|e| e.map(|e| e.event_name() == "NetworkAdded").unwrap_or(false))
    );
    let netuid = 1u16;
    submit(
        &client,
        "SubtensorModule",
        "start_call",
        vec![Value::u128(1)],
        &alice,
    )
    .await
    .expect("start_call");
    submit(
        &client,
        "AdminUtils",
        "sudo_set_commit_reveal_weights_enabled",
        vec![Value::u128(1), Value::bool(false)],
        &alice,
    )
    .await
    .expect("owner turns commit-reveal off");
    submit(
        &client,
        "Sudo",
        "sudo",
        sudo_call(
            "sudo_set_tempo",
            vec![("netuid", Value::u128(1)), ("tempo", Value::u128(10))],
        ),
        &alice,
    )
    .await
    .expect("sudo set tempo");
    submit(
        &client,
        "Sudo",
        "sudo",
        sudo_call(
            "sudo_set_weights_set_rate_limit",
            vec![
                ("netuid", Value::u128(1)),
                ("weights_set_rate_limit", Value::u128(10)),
            ],
        ),
        &alice,
    )
    .await
    .expect("sudo set weights rate limit");

    // Three miners from Bob's coldkey, a validator from Charlie's.
    let miners = [key(11), key(12), key(13)];
    for m in &miners {
        let events = submit(
            &client,
            "SubtensorModule",
            "burned_register",
            vec![Value::u128(netuid as u128), acc(&account(m))],
            &bob,
        )
        .await
        .expect("burned_register");
        assert!(events.iter().any(|e| {
            e.map(|e| e.event_name() == "NeuronRegistered")
                .unwrap_or(false)
        }));
    }
    let again = submit(
        &client,
        "SubtensorModule",
        "burned_register",
        vec![Value::u128(netuid as u128), acc(&account(&miners[0]))],
        &bob,
    )
    .await;
    assert_eq!(
        again.err().as_deref(),
        Some("HotKeyAlreadyRegisteredInSubNet")
    );

    let validator = key(21);
    submit(
        &client,
        "SubtensorModule",
        "burned_register",
        vec![Value::u128(1), acc(&account(&validator))],
        &charlie,
    )
    .await
    .expect("validator registers");
    submit(
        &client,
        "SubtensorModule",
        "add_stake",
        vec![
            acc(&account(&validator)),
            Value::u128(1),
            Value::u128(1_000 * TAO as u128),
        ],
        &charlie,
    )
    .await
    .expect("add_stake");

    // A miner serves its axon (signed by the hotkey).
    submit(
        &client,
        "SubtensorModule",
        "serve_axon",
        vec![
            Value::u128(1),
            Value::u128(1),
            Value::u128(u32::from_be_bytes([127, 0, 0, 1]) as u128),
            Value::u128(8091),
            Value::u128(4),
            Value::u128(4),
            Value::u128(0),
            Value::u128(0),
        ],
        &miners[0],
    )
    .await
    .expect("serve_axon");

    // The next epoch hands out validator permits by stake.
    net.produce_blocks(12);
    let permits = {
        let at = client.at_current_block().await.expect("block");
        let addr = dynamic::storage::<(u16,), Vec<bool>>("SubtensorModule", "ValidatorPermit");
        at.storage()
            .fetch(addr, (netuid,))
            .await
            .expect("fetch")
            .decode()
            .expect("decode")
    };
    assert_eq!(
        permits.get(4),
        Some(&true),
        "validator uid 4 has a permit: {permits:?}"
    );

    // Weights on miners 1 and 2 (uids 1, 2), none on uid 3.
    let weights = |version: u64| {
        vec![
            Value::u128(1),
            Value::unnamed_composite([Value::u128(1), Value::u128(2)]),
            Value::unnamed_composite([Value::u128(1), Value::u128(3)]),
            Value::u128(version as u128),
        ]
    };
    submit(
        &client,
        "SubtensorModule",
        "set_weights",
        weights(0),
        &validator,
    )
    .await
    .expect("set_weights");
    let too_fast = submit(
        &client,
        "SubtensorModule",
        "set_weights",
        weights(0),
        &validator,
    )
    .await;
    assert_eq!(too_fast.err().as_deref(), Some("SettingWeightsTooFast"));
    submit(
        &client,
        "AdminUtils",
        "sudo_set_weights_version_key",
        vec![Value::u128(1), Value::u128(5)],
        &alice,
    )
    .await
    .expect("owner sets version key");
    let bad_version = submit(
        &client,
        "SubtensorModule",
        "set_weights",
        weights(4),
        &validator,
    )
    .await;
    assert_eq!(
        bad_version.err().as_deref(),
        Some("IncorrectWeightVersionKey")
    );

    // One tempo later the weighted miners earn incentive.
    net.produce_blocks(12);
    let incentive = storage_u16s(&client, "Incentive", netuid).await;
    assert!(
        incentive[1] > 0 && incentive[2] > 0,
        "incentive {incentive:?}"
    );
    assert!(
        incentive[2] > incentive[1],
        "3:1 weights give more to uid 2: {incentive:?}"
    );
    assert_eq!(incentive[3], 0);
    let emission = {
        let at = client.at_current_block().await.expect("block");
        let addr = dynamic::storage::<(u16,), Vec<u64>>("SubtensorModule", "Emission");
        at.storage()
            .fetch(addr, (netuid,))
            .await
            .expect("fetch")
            .decode()
            .expect("decode")
    };
    assert!(
        emission[1] > 0 && emission[4] > 0,
        "miner and validator emission {emission:?}"
    );

    net.stop().await;
}

/// Raw JSON-RPC access, for what subxt refuses to send.
async fn raw_submit(net: &Localnet, bytes: &[u8]) -> Result<String, jsonrpsee::core::ClientError> {
    use jsonrpsee::core::client::ClientT;
    let client = jsonrpsee::ws_client::WsClientBuilder::default()
        .build(net.ws_url())
        .await?;
    client
        .request(
            "author_submitExtrinsic",
            jsonrpsee::rpc_params![format!("0x{}", hex::encode(bytes))],
        )
        .await
}

#[tokio::test]
async fn bad_signature_and_stale_nonce_are_rejected_at_submission() {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let client = connect(&net).await;
    let alice = dev::alice();
    let payload = dynamic::tx("System", "remark", vec![Value::from_bytes(b"hello")]);
    let at = client.at_current_block().await.expect("block");

    let signed = at
        .transactions()
        .create_signed(&payload, &alice, Default::default())
        .await
        .expect("sign");
    let mut forged = signed.encoded().to_vec();
    // Flip a bit inside the signature (after length prefix, version byte and 33-byte address).
    forged[1 + 1 + 33 + 10] ^= 0x01;
    let err = raw_submit(&net, &forged)
        .await
        .expect_err("forged signature is refused");
    let text = err.to_string();
    assert!(
        text.contains("1010") && text.contains("bad signature"),
        "{text}"
    );

    // The genuine one goes in; replaying its nonce afterwards is stale.
    raw_submit(&net, signed.encoded())
        .await
        .expect("genuine accepted");
    let again = raw_submit(&net, signed.encoded())
        .await
        .expect_err("replay refused");
    assert!(
        again.to_string().contains("1010") && again.to_string().contains("outdated"),
        "{again}"
    );

    let garbage = raw_submit(&net, &[0x10, 0x84, 1, 2, 3])
        .await
        .expect_err("garbage refused");
    assert!(garbage.to_string().contains("1002"), "{garbage}");

    // subxt's own pre-flight check goes through the runtime API and agrees.
    let fresh = at
        .transactions()
        .create_signed(&payload, &dev::bob(), Default::default())
        .await
        .expect("sign");
    assert!(fresh.validate().await.expect("validate").is_valid());
    net.stop().await;
}

#[tokio::test]
async fn full_subnet_prunes_the_lowest_non_immune_uid() {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let client = connect(&net).await;
    let alice = dev::alice();
    submit(
        &client,
        "SubtensorModule",
        "register_network",
        vec![acc(&account(&key(1)))],
        &alice,
    )
    .await
    .expect("register_network");
    submit(
        &client,
        "AdminUtils",
        "sudo_set_max_allowed_uids",
        vec![Value::u128(1), Value::u128(3)],
        &alice,
    )
    .await
    .expect("max uids");
    submit(
        &client,
        "AdminUtils",
        "sudo_set_immunity_period",
        vec![Value::u128(1), Value::u128(0)],
        &alice,
    )
    .await
    .expect("immunity");
    for seed in [2u8, 3] {
        submit(
            &client,
            "SubtensorModule",
            "burned_register",
            vec![Value::u128(1), acc(&account(&key(seed)))],
            &alice,
        )
        .await
        .expect("register");
    }
    let newcomer = key(4);
    submit(
        &client,
        "SubtensorModule",
        "burned_register",
        vec![Value::u128(1), acc(&account(&newcomer))],
        &alice,
    )
    .await
    .expect("register into a full subnet");
    let at = client.at_current_block().await.expect("block");
    let n: u16 = at
        .storage()
        .fetch(
            dynamic::storage::<(u16,), u16>("SubtensorModule", "SubnetworkN"),
            (1u16,),
        )
        .await
        .expect("fetch")
        .decode()
        .expect("decode");
    assert_eq!(n, 3, "the subnet stays at its maximum");
    let uid: u16 = at
        .storage()
        .fetch(
            dynamic::storage::<(u16, [u8; 32]), u16>("SubtensorModule", "Uids"),
            (1u16, account(&newcomer).0),
        )
        .await
        .expect("fetch")
        .decode()
        .expect("decode");
    assert_eq!(uid, 1, "the lowest-scoring non-owner uid is replaced");
    net.stop().await;
}

#[tokio::test]
async fn subtensor_pool_checks_answer_with_custom_codes() {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let client = connect(&net).await;
    submit(
        &client,
        "SubtensorModule",
        "register_network",
        vec![acc(&account(&key(1)))],
        &dev::alice(),
    )
    .await
    .expect("register_network");
    // An unregistered hotkey cannot serve an axon: refused before it reaches a block.
    let axon = |port: u128| {
        vec![
            Value::u128(1),
            Value::u128(1),
            Value::u128(u32::from_be_bytes([10, 0, 0, 1]) as u128),
            Value::u128(port),
            Value::u128(4),
            Value::u128(4),
            Value::u128(0),
            Value::u128(0),
        ]
    };
    let err = submit(
        &client,
        "SubtensorModule",
        "serve_axon",
        axon(8091),
        &key(50),
    )
    .await
    .expect_err("refused");
    assert!(err.contains("Custom error: 10"), "{err}");
    // The owner hotkey (uid 0) can; a second serve inside ServingRateLimit is refused with code 12.
    submit(
        &client,
        "SubtensorModule",
        "serve_axon",
        axon(8091),
        &key(1),
    )
    .await
    .expect("serve");
    let err = submit(
        &client,
        "SubtensorModule",
        "serve_axon",
        axon(8092),
        &key(1),
    )
    .await
    .expect_err("rate limited");
    assert!(err.contains("Custom error: 12"), "{err}");
    net.stop().await;
}

#[tokio::test]
async fn http_json_rpc_is_served_on_the_same_port() {
    use jsonrpsee::core::client::ClientT;
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let http = jsonrpsee::http_client::HttpClientBuilder::default()
        .build(net.http_url())
        .expect("http client");
    let props: serde_json::Value = http
        .request("system_properties", jsonrpsee::rpc_params![])
        .await
        .expect("rpc");
    assert_eq!(props["ss58Format"], 42);
    assert_eq!(props["tokenSymbol"], "TAO");
    assert_eq!(props["tokenDecimals"], 9);
    let chain: String = http
        .request("system_chain", jsonrpsee::rpc_params![])
        .await
        .expect("rpc");
    assert_eq!(chain, "IOTA Localnet");
    net.stop().await;
}
