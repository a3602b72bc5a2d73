//! The client against the localnet, end to end: wallets, funding, a subnet, registration, axons,
//! the metagraph, weights with rate limit and version key, commit-reveal, emission, dry runs,
//! reconnects, and each typed error produced by a real failing transaction.

use std::time::Duration;

use iota_chain::calls::{self, AxonEndpoint, Hyperparam, RAO_PER_TAO};
use iota_chain::commit::{CommitStore, JsonFileCommitStore, MemoryCommitStore};
use iota_chain::wallet::{Keypair, PasswordSource, PublicKey, Wallet};
use iota_chain::{
    ChainError, ConnectOptions, InvalidTransaction, Outcome, Subtensor, TxOptions, VersionKey,
    WeightOptions, WeightsOutcome,
};
use iota_localnet::{Localnet, LocalnetConfig};
use sp_core::Pair as _;

const TAO: u64 = RAO_PER_TAO;

fn dev(name: &str) -> Keypair {
    Keypair::from_private_key(&iota_localnet::dev_pair(name).to_raw_vec()).expect("dev key")
}

fn key(seed: u8) -> Keypair {
    Keypair::from_seed([seed; 32])
}

fn tx() -> TxOptions {
    TxOptions {
        timeout: Duration::from_secs(30),
        ..TxOptions::default()
    }
}

async fn connect(net: &Localnet) -> Subtensor {
    let mut opts = ConnectOptions::new(net.ws_url());
    opts.connect_timeout = Duration::from_secs(20);
    Subtensor::connect(opts).await.expect("connects")
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// A subnet owned by Alice with `owner_hot` as uid 0, started, commit-reveal as given, and a short
/// weights rate limit. Returns its netuid.
async fn subnet(
    chain: &Subtensor,
    owner_hot: &PublicKey,
    commit_reveal: bool,
    rate_limit: u64,
) -> u16 {
    let alice = dev("Alice");
    let netuid = chain
        .register_network(&alice, owner_hot, &tx())
        .await
        .expect("register_network")
        .done()
        .expect("not a dry run");
    chain
        .start_call(&alice, netuid, &tx())
        .await
        .expect("start_call");
    chain
        .set_hyperparam(
            &alice,
            netuid,
            Hyperparam::CommitRevealWeightsEnabled(commit_reveal),
            false,
            &tx(),
        )
        .await
        .expect("owner sets commit-reveal");
    chain
        .set_hyperparam(
            &alice,
            netuid,
            Hyperparam::WeightsRateLimit(rate_limit),
            true,
            &tx(),
        )
        .await
        .expect("sudo sets the rate limit");
    netuid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wallets_to_emission_on_a_timed_chain() {
    init_tracing();
    // Blocks on a timer, so rate limits and epochs pass on their own while the client waits.
    let net = Localnet::spawn(LocalnetConfig::with_block_time(Duration::from_millis(100)))
        .await
        .expect("spawn");
    let chain = connect(&net).await;
    let alice = dev("Alice");

    // Wallets: an encrypted coldkey written by the client and read back, plain hotkeys.
    let dir = tempfile::tempdir().expect("tempdir");
    let password = PasswordSource::given("correct horse battery");
    let miner_wallet = Wallet::new(dir.path(), "miner", "m1").expect("wallet");
    let miner_cold = miner_wallet
        .create_coldkey(12, Some(&password), false)
        .expect("coldkey");
    let miner_hot = miner_wallet.create_hotkey(12, None, false).expect("hotkey");
    let miner_cold = {
        let reread = miner_wallet.coldkey(&password).expect("unlock coldkey");
        assert_eq!(reread.public(), miner_cold.public());
        reread
    };
    let miner_hot = {
        let reread = miner_wallet
            .hotkey(&PasswordSource::EnvOnly)
            .expect("hotkey");
        assert_eq!(reread.public(), miner_hot.public());
        reread
    };
    let val_wallet = Wallet::new(dir.path(), "validator", "v1").expect("wallet");
    let val_cold = val_wallet.create_coldkey(12, None, false).expect("coldkey");
    let val_hot = val_wallet.create_hotkey(12, None, false).expect("hotkey");

    // Fund.
    for cold in [&miner_cold, &val_cold] {
        chain
            .transfer(&alice, &cold.public(), 2_000 * TAO, true, &tx())
            .await
            .expect("transfer");
    }
    assert_eq!(
        chain
            .free_balance(&miner_cold.public())
            .await
            .expect("balance"),
        2_000 * TAO
    );

    // A subnet with Alice's hotkey as owner, weights rate limit 20 blocks.
    let owner_hot = key(1);
    let netuid = subnet(&chain, &owner_hot.public(), false, 20).await;
    assert_eq!(netuid, 1);

    // Register the miner, twice: the second is reported, not re-registered (nothing burned).
    let first = chain
        .register(&miner_cold, netuid, &miner_hot.public(), &tx())
        .await
        .expect("register")
        .done()
        .expect("done");
    assert!(!first.already_registered);
    assert_eq!(first.uid, 1);
    let balance = chain
        .free_balance(&miner_cold.public())
        .await
        .expect("balance");
    assert_eq!(balance, 2_000 * TAO - TAO, "the burn is 1 TAO");
    let again = chain
        .register(&miner_cold, netuid, &miner_hot.public(), &tx())
        .await
        .expect("register again")
        .done()
        .expect("done");
    assert!(again.already_registered);
    assert_eq!(again.uid, 1);
    assert_eq!(
        chain
            .free_balance(&miner_cold.public())
            .await
            .expect("balance"),
        balance
    );

    // The validator registers and stakes.
    let v = chain
        .register(&val_cold, netuid, &val_hot.public(), &tx())
        .await
        .expect("register validator")
        .done()
        .expect("done");
    assert_eq!(v.uid, 2);
    chain
        .add_stake(&val_cold, &val_hot.public(), netuid, 1_000 * TAO, &tx())
        .await
        .expect("add_stake");

    // No serving rate limit (the owner's hyperparameter), so each change below is served at once.
    chain
        .set_hyperparam(
            &alice,
            netuid,
            Hyperparam::ServingRateLimit(0),
            false,
            &tx(),
        )
        .await
        .expect("owner sets the serving rate limit");
    // The miner serves its axon.
    let axon = AxonEndpoint::new("10.1.2.3".parse().expect("ip"), 8091);
    chain
        .serve_axon(&miner_hot, netuid, &axon, &tx())
        .await
        .expect("serve_axon");
    // Serving the same axon again submits nothing; a changed one is submitted.
    assert!(
        chain
            .serve_axon_if_changed(&miner_hot, netuid, &axon, &tx())
            .await
            .expect("unchanged axon")
            .is_none()
    );
    assert_eq!(
        chain
            .axon_of(netuid, &miner_hot.public())
            .await
            .expect("axon")
            .map(|a| a.port),
        Some(8091)
    );
    // A new address alone, a new port alone, and back: each is submitted.
    for (ip, port) in [("10.1.2.4", 8091), ("10.1.2.4", 8092), ("10.1.2.3", 8091)] {
        let changed = AxonEndpoint::new(ip.parse().expect("ip"), port);
        let sent = chain
            .serve_axon_if_changed(&miner_hot, netuid, &changed, &tx())
            .await
            .expect("changed axon");
        assert!(sent.is_some(), "{changed} was not submitted");
        let now = chain
            .axon_of(netuid, &miner_hot.public())
            .await
            .expect("axon")
            .map(|a| (a.ip, a.port));
        assert_eq!(now, Some((changed.ip, changed.port)));
    }

    // The metagraph has them all.
    let mg = chain.metagraph(netuid).await.expect("metagraph");
    assert_eq!(mg.neurons.len(), 3);
    assert_eq!(mg.hyperparams.n, 3);
    assert_eq!(mg.hyperparams.tempo, 10);
    assert_eq!(mg.hyperparams.weights_rate_limit, 20);
    assert!(!mg.hyperparams.commit_reveal_enabled);
    assert_eq!(mg.hyperparams.burn, TAO);
    assert_eq!(mg.hyperparams.owner_coldkey, alice.public());
    assert!(mg.hyperparams.first_emission_block.is_some());
    let miner = &mg.neurons[1];
    assert_eq!(miner.hotkey, miner_hot.public());
    assert_eq!(miner.coldkey, Some(miner_cold.public()));
    let served = miner.axon.as_ref().expect("axon served");
    assert_eq!(served.address(), "10.1.2.3:8091");
    assert_eq!(served.protocol, 4);
    let validator = &mg.neurons[2];
    assert_eq!(validator.coldkey, Some(val_cold.public()));
    // At least the stake added: an epoch may already have paid dividends on the timed chain.
    assert!(validator.stake >= 1_000 * TAO, "stake {}", validator.stake);
    assert_eq!(mg.uid_of(&owner_hot.public()), Some(0));

    // Permits are handed out at the next epoch.
    let epoch_wait = Duration::from_secs(20);
    chain
        .wait_for_block(mg.block + 12, epoch_wait)
        .await
        .expect("an epoch passes");
    let at = chain.at_finalized().await.expect("finalized block");
    let mg = chain.metagraph_at(&at, netuid).await.expect("metagraph");
    assert!(mg.neurons[2].validator_permit, "validator has a permit");
    // The members (what a caller check reads at each block) are the metagraph's uids, hotkeys
    // and permits at the same block.
    let members = chain.members_at(&at, netuid).await.expect("members");
    assert_eq!(members, iota_chain::Members::from(&mg));
    assert_eq!(members.members.len(), 3);
    assert!(members.members[2].validator_permit);
    assert_eq!(members.members[1].hotkey, miner_hot.public());

    // Weights from float scores: the version key comes from chain and the rate limit (20
    // blocks from registration) is waited out rather than failing.
    let store = MemoryCommitStore::new();
    let opts = WeightOptions {
        rate_limit_timeout: Duration::from_secs(30),
        tx: tx(),
        ..WeightOptions::default()
    };
    let registered_at = mg.neurons[2].registered_at;
    let set = chain
        .set_weights(&val_hot, netuid, &[1, 2], &[0.75, 0.25], &store, &opts)
        .await
        .expect("set_weights");
    let WeightsOutcome::Set {
        block: first_block,
        uids,
        values,
        version_key,
    } = set
    else {
        panic!("commit-reveal is off: {set:?}");
    };
    assert!(first_block >= registered_at + 20, "rate limit respected");
    assert_eq!(
        (uids, values, version_key),
        (vec![1, 2], vec![65535, 21845], 0)
    );

    // Without waiting the chain refuses, by name.
    let no_wait = WeightOptions {
        wait_for_rate_limit: false,
        ..opts.clone()
    };
    let err = chain
        .set_weights(&val_hot, netuid, &[1], &[1.0], &store, &no_wait)
        .await
        .expect_err("too fast");
    assert!(matches!(err, ChainError::SettingWeightsTooFast), "{err}");

    // The owner raises the version key: the client follows it; an explicit lower key fails.
    chain
        .set_hyperparam(
            &alice,
            netuid,
            Hyperparam::WeightsVersionKey(7),
            false,
            &tx(),
        )
        .await
        .expect("version key");
    let err = chain
        .set_weights(
            &val_hot,
            netuid,
            &[1],
            &[1.0],
            &store,
            &WeightOptions {
                version_key: VersionKey::Exact(6),
                ..no_wait.clone()
            },
        )
        .await
        .expect_err("old version key");
    assert!(
        matches!(err, ChainError::IncorrectWeightVersionKey),
        "{err}"
    );
    let second = chain
        .set_weights(&val_hot, netuid, &[1], &[1.0], &store, &opts)
        .await
        .expect("second set_weights waits out the limit");
    let WeightsOutcome::Set {
        block, version_key, ..
    } = second
    else {
        panic!("{second:?}");
    };
    assert!(block >= first_block + 20, "{block} vs {first_block}");
    assert_eq!(version_key, 7);

    // After a tempo the weighted miner earns incentive and emission.
    let now = chain.best_block_number().await.expect("block");
    chain
        .wait_for_block(now + 12, epoch_wait)
        .await
        .expect("an epoch passes");
    let mg = chain.metagraph(netuid).await.expect("metagraph");
    let miner = &mg.neurons[1];
    assert!(miner.incentive > 0, "miner incentive {:?}", mg.neurons);
    assert!(miner.emission > 0, "miner emission");
    assert!(mg.neurons[2].dividends > 0, "validator dividends");
    assert!(mg.neurons[2].last_update >= block);
    net.stop().await;
}

/// An instant localnet with a hash commit-reveal subnet (`CommitRevealWeightsVersion` 2) whose
/// owner hotkey is `owner_hot` (it may set weights without a permit), weights rate limit
/// `rate_limit`, and `miners` (seeds) registered.
async fn commit_reveal_subnet(
    owner_hot: &Keypair,
    miners: [u8; 2],
    rate_limit: u64,
) -> (Localnet, Subtensor, u16) {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let chain = connect(&net).await;
    let netuid = subnet(&chain, &owner_hot.public(), true, rate_limit).await;
    chain
        .set_hyperparam(
            &dev("Alice"),
            netuid,
            Hyperparam::CommitRevealVersion(2),
            true,
            &tx(),
        )
        .await
        .expect("sudo sets hash commit-reveal");
    for seed in miners {
        chain
            .register(&dev("Alice"), netuid, &key(seed).public(), &tx())
            .await
            .expect("register miner");
    }
    (net, chain, netuid)
}

/// As subtensor's `do_commit_weights`: a commit counts as an update of the uid's weights and
/// shares their rate limit, so a second commit inside the limit is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_counts_against_the_weights_rate_limit() {
    init_tracing();
    let owner_hot = key(4);
    let limit = 10;
    let (net, chain, netuid) = commit_reveal_subnet(&owner_hot, [41, 42], limit).await;
    // Past the limit counted from the owner's registration.
    net.produce_blocks(limit as u32);
    let store = MemoryCommitStore::new();
    let no_wait = WeightOptions {
        tx: tx(),
        wait_for_rate_limit: false,
        ..WeightOptions::default()
    };
    let commit = || chain.set_weights(&owner_hot, netuid, &[1, 2], &[0.5, 0.5], &store, &no_wait);
    let WeightsOutcome::Committed { block, .. } = commit().await.expect("first commit") else {
        panic!("commit-reveal is on");
    };
    let mg = chain.metagraph(netuid).await.expect("metagraph");
    assert_eq!(mg.neurons[0].last_update, block, "a commit is an update");

    let e = commit().await.expect_err("inside the limit");
    assert!(matches!(e, ChainError::CommittingWeightsTooFast), "{e}");

    net.produce_blocks(limit as u32);
    let WeightsOutcome::Committed { block: again, .. } = commit().await.expect("past the limit")
    else {
        panic!("commit-reveal is on");
    };
    assert!(again >= block + limit, "{again} vs {block}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_reveal_cycle_survives_a_restart_of_the_store() {
    init_tracing();
    let owner_hot = key(3);
    let (net, chain, netuid) = commit_reveal_subnet(&owner_hot, [31, 32], 1).await;
    // Commit a few blocks into an epoch, so the reveal epoch is not the very next block.
    let hp = chain.hyperparams(netuid).await.expect("hyperparams");
    while hp.epoch_of(net.best_number() + 1) != hp.epoch_of(net.best_number() + 4) {
        net.produce_blocks(1);
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("commits.json");
    let opts = WeightOptions {
        tx: tx(),
        rate_limit_timeout: Duration::from_secs(20),
        ..WeightOptions::default()
    };
    let committed = {
        let store = JsonFileCommitStore::new(&path);
        chain
            .set_weights(&owner_hot, netuid, &[1, 2], &[0.2, 0.8], &store, &opts)
            .await
            .expect("commit")
    };
    let WeightsOutcome::Committed {
        block,
        hash,
        reveal_epoch,
        reveal_from_block,
        uids,
        values,
        ..
    } = committed
    else {
        panic!("commit-reveal is on: {committed:?}");
    };
    assert_eq!(uids, vec![1, 2]);
    assert_eq!(values, vec![16384, 65535]);
    let hp = chain.hyperparams(netuid).await.expect("hyperparams");
    assert_eq!(reveal_epoch, hp.epoch_of(block) + 1);
    assert_eq!(hp.epoch_of(reveal_from_block), reveal_epoch);
    assert_eq!(hp.epoch_of(reveal_from_block - 1), reveal_epoch - 1);
    let text = std::fs::read_to_string(&path).expect("commit file");
    assert!(
        text.contains(&hash),
        "the salt and values are on disk: {text}"
    );

    // A "restarted" validator: a new store over the same file.
    let store = JsonFileCommitStore::new(&path);
    let pending = store.pending(&owner_hot.public()).await.expect("pending");
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].commit_block, Some(block));

    // Too early: the client leaves it waiting; a reveal sent anyway is refused by name.
    let report = chain
        .reveal_pending(&owner_hot, &store, &tx())
        .await
        .expect("reveal_pending");
    assert_eq!(report.waiting, vec![(hash.clone(), reveal_from_block)]);
    let c = &pending[0];
    let early = calls::reveal_weights(
        netuid,
        c.uids.clone(),
        c.values.clone(),
        c.salt.clone(),
        c.version_key,
    );
    let e = chain
        .submit(&early, &owner_hot, &tx())
        .await
        .expect_err("too early");
    assert!(matches!(e, ChainError::RevealTooEarly), "{e}");

    // In the window: revealed, and gone from the store.
    let best = net.best_number();
    net.produce_blocks((reveal_from_block - 1 - best) as u32);
    let report = chain
        .reveal_pending(&owner_hot, &store, &tx())
        .await
        .expect("reveal");
    assert_eq!(report.revealed, vec![(hash.clone(), reveal_from_block)]);
    assert!(
        store
            .pending(&owner_hot.public())
            .await
            .expect("pending")
            .is_empty()
    );

    // The revealed weights are on chain as committed.
    let at = chain.at_finalized().await.expect("block");
    let row: Vec<(u16, u16)> = at
        .storage()
        .fetch(
            subxt::dynamic::storage::<(u16, u16), Vec<(u16, u16)>>("SubtensorModule", "Weights"),
            (netuid, 0u16),
        )
        .await
        .expect("fetch")
        .decode()
        .expect("decode");
    assert_eq!(row, vec![(1, 16384), (2, 65535)]);

    // A second cycle with blocks on a timer: `reveal_when_ready` waits for the window itself.
    let producer = {
        let shared = net.chain().clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                shared
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .produce_block();
            }
        })
    };
    let second = chain
        .set_weights(&owner_hot, netuid, &[2], &[1.0], &store, &opts)
        .await
        .expect("second commit");
    assert!(
        matches!(second, WeightsOutcome::Committed { .. }),
        "{second:?}"
    );
    let report = chain
        .reveal_when_ready(&owner_hot, &store, &tx(), Duration::from_secs(30))
        .await
        .expect("reveal when ready");
    assert_eq!(report.revealed.len(), 1, "{report:?}");
    producer.abort();

    // A commit whose window passes unrevealed is dropped, not retried forever.
    let third = chain
        .set_weights(&owner_hot, netuid, &[1], &[1.0], &store, &opts)
        .await
        .expect("third commit");
    let WeightsOutcome::Committed {
        reveal_from_block, ..
    } = third
    else {
        panic!("{third:?}");
    };
    let best = net.best_number();
    net.produce_blocks((reveal_from_block + 2 * u64::from(hp.tempo) + 2 - best) as u32);
    let report = chain
        .reveal_pending(&owner_hot, &store, &tx())
        .await
        .expect("reveal_pending");
    assert_eq!(report.dropped.len(), 1, "{report:?}");
    assert!(
        store
            .pending(&owner_hot.public())
            .await
            .expect("pending")
            .is_empty()
    );

    // set_weights itself is refused while commit-reveal is on.
    let err = chain
        .submit(
            &calls::set_weights(netuid, vec![1], vec![1], 0),
            &owner_hot,
            &tx(),
        )
        .await
        .expect_err("commit-reveal on");
    assert!(matches!(err, ChainError::CommitRevealEnabled), "{err}");
    net.stop().await;
}

async fn last_stored_round(chain: &Subtensor) -> u64 {
    let at = chain.at_best().await.expect("block");
    at.storage()
        .fetch(
            subxt::dynamic::storage::<(), u64>("Drand", "LastStoredRound"),
            (),
        )
        .await
        .expect("fetch")
        .decode()
        .expect("decode")
}

async fn weights_row(chain: &Subtensor, netuid: u16, uid: u16) -> Vec<(u16, u16)> {
    let at = chain.at_best().await.expect("block");
    at.storage()
        .fetch(
            subxt::dynamic::storage::<(u16, u16), Vec<(u16, u16)>>("SubtensorModule", "Weights"),
            (netuid, uid),
        )
        .await
        .expect("fetch")
        .decode()
        .expect("decode")
}

/// Commit-reveal v4 on the localnet's drand beacon: the client seals the weights to the round out
/// when the reveal epoch begins and commits them; nothing opens them before that round's pulse;
/// the chain reveals them itself and `reveal_pending` reports the block, after which the store
/// holds nothing. Hash commits go on working when the version is set back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timelocked_commits_are_revealed_by_the_chain() {
    init_tracing();
    let owner_hot = key(5);
    let (net, chain, netuid) = commit_reveal_subnet(&owner_hot, [51, 52], 1).await;
    let alice = dev("Alice");
    chain
        .set_hyperparam(
            &alice,
            netuid,
            Hyperparam::CommitRevealVersion(4),
            true,
            &tx(),
        )
        .await
        .expect("sudo sets commit-reveal v4");
    assert_eq!(
        chain.commit_reveal_version().await.expect("version"),
        Some(4)
    );
    net.produce_blocks(2);
    let store = MemoryCommitStore::new();
    let opts = WeightOptions {
        tx: tx(),
        ..WeightOptions::default()
    };
    let committed = chain
        .set_weights(&owner_hot, netuid, &[1, 2], &[0.2, 0.8], &store, &opts)
        .await
        .expect("timelocked commit");
    let WeightsOutcome::TimelockCommitted {
        block,
        hash,
        reveal_round,
        reveal_from_block,
        values,
        ..
    } = committed
    else {
        panic!("commit-reveal v4 is on: {committed:?}");
    };
    assert_eq!(values, vec![16384, 65535]);
    let hp = chain.hyperparams(netuid).await.expect("hyperparams");
    assert_eq!(hp.epoch_of(reveal_from_block), hp.epoch_of(block) + 1);
    assert!(
        last_stored_round(&chain).await < reveal_round,
        "sealed to a round not out yet"
    );

    let mut revealed = None;
    for _ in 0..3 * (u32::from(hp.tempo) + 1) {
        let report = chain
            .reveal_pending(&owner_hot, &store, &tx())
            .await
            .expect("reveal_pending");
        assert!(report.dropped.is_empty(), "{report:?}");
        if let Some(r) = report.revealed.first() {
            revealed = Some(r.clone());
            break;
        }
        assert_eq!(report.waiting.len(), 1, "{report:?}");
        assert!(
            weights_row(&chain, netuid, 0).await.is_empty(),
            "no weights before the reveal"
        );
        net.produce_blocks(1);
    }
    let (revealed_hash, revealed_at) = revealed.expect("the chain revealed the commit");
    assert_eq!(revealed_hash, hash);
    assert!(
        revealed_at >= reveal_from_block,
        "{revealed_at} < {reveal_from_block}"
    );
    assert!(last_stored_round(&chain).await >= reveal_round);
    assert_eq!(
        weights_row(&chain, netuid, 0).await,
        vec![(1, 16384), (2, 65535)]
    );
    assert!(
        store
            .pending(&owner_hot.public())
            .await
            .expect("pending")
            .is_empty()
    );

    // Back to hash commits: the client follows the chain's version.
    chain
        .set_hyperparam(
            &alice,
            netuid,
            Hyperparam::CommitRevealVersion(2),
            true,
            &tx(),
        )
        .await
        .expect("sudo sets hash commit-reveal");
    net.produce_blocks(2);
    let hashed = chain
        .set_weights(&owner_hot, netuid, &[1], &[1.0], &store, &opts)
        .await
        .expect("hash commit");
    assert!(
        matches!(hashed, WeightsOutcome::Committed { .. }),
        "{hashed:?}"
    );
    net.stop().await;
}

#[tokio::test]
async fn every_typed_error_comes_from_a_real_transaction() {
    init_tracing();
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let chain = connect(&net).await;
    let (alice, bob) = (dev("Alice"), dev("Bob"));
    let owner_hot = key(5);
    let netuid = subnet(&chain, &owner_hot.public(), false, 100).await;
    let cr_netuid = subnet(&chain, &key(6).public(), true, 100).await;
    let miner_hot = key(51);
    chain
        .register(&bob, netuid, &miner_hot.public(), &tx())
        .await
        .expect("register");

    let expect = |r: Result<iota_chain::TxOutcome, ChainError>, what: &str| -> ChainError {
        let e = r.expect_err(what);
        println!("{what}: {e}");
        e
    };

    // HotKeyAlreadyRegisteredInSubNet: the raw call, bypassing the idempotent check.
    let e = expect(
        chain
            .submit(
                &calls::burned_register(netuid, &miner_hot.public()),
                &bob,
                &tx(),
            )
            .await,
        "register twice",
    );
    assert!(matches!(e, ChainError::HotKeyAlreadyRegisteredInSubNet));

    // NotEnoughBalanceToStake: a coldkey with less than the burn, and a stake above the balance.
    let poor = key(60);
    chain
        .transfer(&alice, &poor.public(), TAO / 2, true, &tx())
        .await
        .expect("fund");
    let e = chain
        .register(&poor, netuid, &key(61).public(), &tx())
        .await
        .expect_err("too poor");
    assert!(matches!(e, ChainError::NotEnoughBalanceToStake), "{e}");
    let e = expect(
        chain
            .submit(
                &calls::add_stake(&miner_hot.public(), netuid, 5_000_000 * TAO),
                &bob,
                &tx(),
            )
            .await,
        "stake more than the balance",
    );
    assert!(matches!(e, ChainError::NotEnoughBalanceToStake));

    // SettingWeightsTooFast: the miner's first set_weights is within 100 blocks of registration.
    let e = expect(
        chain
            .submit(
                &calls::set_weights(netuid, vec![1], vec![1], 0),
                &miner_hot,
                &tx(),
            )
            .await,
        "weights too fast",
    );
    assert!(matches!(e, ChainError::SettingWeightsTooFast), "{e}");

    // IncorrectWeightVersionKey (checked before the rate limit).
    chain
        .set_hyperparam(
            &alice,
            netuid,
            Hyperparam::WeightsVersionKey(3),
            false,
            &tx(),
        )
        .await
        .expect("version key");
    let e = expect(
        chain
            .submit(
                &calls::set_weights(netuid, vec![1], vec![1], 2),
                &miner_hot,
                &tx(),
            )
            .await,
        "old version key",
    );
    assert!(matches!(e, ChainError::IncorrectWeightVersionKey), "{e}");

    // NeuronNoValidatorPermit: the miner weights someone else once the limit has passed.
    net.produce_blocks(101);
    let e = expect(
        chain
            .submit(
                &calls::set_weights(netuid, vec![0], vec![1], 3),
                &miner_hot,
                &tx(),
            )
            .await,
        "no permit",
    );
    assert!(matches!(e, ChainError::NeuronNoValidatorPermit), "{e}");

    // CommitRevealEnabled / CommitRevealDisabled / NoWeightsCommitFound.
    chain
        .register(&alice, cr_netuid, &key(52).public(), &tx())
        .await
        .expect("register on the commit-reveal subnet");
    let e = expect(
        chain
            .submit(
                &calls::set_weights(cr_netuid, vec![0], vec![1], 0),
                &key(6),
                &tx(),
            )
            .await,
        "set_weights with commit-reveal on",
    );
    assert!(matches!(e, ChainError::CommitRevealEnabled), "{e}");
    let e = expect(
        chain
            .submit(&calls::commit_weights(netuid, [1; 32]), &miner_hot, &tx())
            .await,
        "commit with commit-reveal off",
    );
    assert!(matches!(e, ChainError::CommitRevealDisabled), "{e}");
    let e = expect(
        chain
            .submit(
                &calls::reveal_weights(cr_netuid, vec![0], vec![1], vec![1], 0),
                &key(6),
                &tx(),
            )
            .await,
        "reveal without commit",
    );
    assert!(matches!(e, ChainError::NoWeightsCommitFound), "{e}");

    // ServingRateLimitExceeded and HotKeyNotRegisteredInNetwork.
    let axon = AxonEndpoint::new("127.0.0.1".parse().expect("ip"), 9000);
    chain
        .serve_axon(&miner_hot, netuid, &axon, &tx())
        .await
        .expect("serve");
    let e = chain
        .serve_axon(&miner_hot, netuid, &axon, &tx())
        .await
        .expect_err("serve again");
    assert!(matches!(e, ChainError::ServingRateLimitExceeded), "{e}");
    let e = chain
        .serve_axon(&key(99), netuid, &axon, &tx())
        .await
        .expect_err("unregistered");
    assert!(matches!(e, ChainError::HotKeyNotRegisteredInNetwork), "{e}");

    // InvalidIpAddress / InvalidPort: refused by the pool with codes 11 / 13, named the same.
    let e = chain
        .serve_axon(
            &miner_hot,
            netuid,
            &AxonEndpoint::new("0.0.0.0".parse().expect("ip"), 9000),
            &tx(),
        )
        .await
        .expect_err("ip 0");
    assert!(matches!(e, ChainError::InvalidIpAddress), "{e}");
    let e = chain
        .serve_axon(
            &miner_hot,
            netuid,
            &AxonEndpoint::new("10.0.0.1".parse().expect("ip"), 0),
            &tx(),
        )
        .await
        .expect_err("port 0");
    assert!(matches!(e, ChainError::InvalidPort), "{e}");

    // NotEnoughStakeToSetWeights: a chain-wide stake threshold above the miner's stake.
    chain
        .set_hyperparam(
            &alice,
            0,
            Hyperparam::StakeThreshold(1_000 * TAO),
            true,
            &tx(),
        )
        .await
        .expect("sudo sets the stake threshold");
    let e = expect(
        chain
            .submit(
                &calls::set_weights(netuid, vec![1], vec![1], 3),
                &miner_hot,
                &tx(),
            )
            .await,
        "stake below threshold",
    );
    assert!(matches!(e, ChainError::NotEnoughStakeToSetWeights), "{e}");

    // BadOrigin: Bob is not the owner; RequireSudo: Bob is not sudo; a failing call inside
    // Alice's sudo is named from the `Sudid` event.
    let e = chain
        .set_hyperparam(&bob, netuid, Hyperparam::MinAllowedWeights(2), false, &tx())
        .await
        .expect_err("not the owner");
    assert!(matches!(e, ChainError::BadOrigin), "{e}");
    let e = chain
        .set_hyperparam(&bob, netuid, Hyperparam::Tempo(20), true, &tx())
        .await
        .expect_err("not sudo");
    assert!(matches!(e, ChainError::RequireSudo), "{e}");
    let e = chain
        .set_hyperparam(&alice, 77, Hyperparam::Tempo(20), true, &tx())
        .await
        .expect_err("no such subnet");
    assert!(
        matches!(&e, ChainError::Module { pallet, name } if pallet == "AdminUtils" && name == "SubnetDoesNotExist"),
        "{e}"
    );

    // SubnetNotExists.
    let e = expect(
        chain
            .submit(&calls::burned_register(99, &key(70).public()), &bob, &tx())
            .await,
        "register on a missing subnet",
    );
    assert!(matches!(e, ChainError::SubnetNotExists), "{e}");

    // 1010 rejections: a reused nonce is "outdated".
    let e = chain
        .submit(
            &calls::transfer(&bob.public(), TAO, true),
            &alice,
            &TxOptions {
                nonce: Some(0),
                ..tx()
            },
        )
        .await
        .expect_err("stale nonce");
    assert!(
        matches!(e, ChainError::InvalidTransaction(InvalidTransaction::Stale)),
        "{e}"
    );
    // A nonce far ahead is "future": the pool holds it, so give up waiting quickly.
    let e = chain
        .submit(
            &calls::transfer(&bob.public(), TAO, true),
            &alice,
            &TxOptions {
                nonce: Some(1_000_000),
                timeout: Duration::from_millis(500),
                ..tx()
            },
        )
        .await
        .expect_err("future nonce");
    assert!(
        matches!(
            e,
            ChainError::InvalidTransaction(InvalidTransaction::Future) | ChainError::Timeout { .. }
        ),
        "{e}"
    );
    net.stop().await;
}

#[tokio::test]
async fn dry_runs_encode_without_submitting() {
    init_tracing();
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let chain = connect(&net).await;
    let alice = dev("Alice");
    let before = net.best_number();
    let dry = TxOptions::dry_run();

    let out = chain
        .transfer(&alice, &key(9).public(), 5 * TAO, true, &dry)
        .await
        .expect("dry transfer");
    let Outcome::DryRun { call_hex } = out else {
        panic!("{out:?}");
    };
    let bytes = hex::decode(call_hex.trim_start_matches("0x")).expect("hex");
    let md = chain.at_finalized().await.expect("block").metadata();
    assert_eq!(
        iota_chain::client::decode_call(&md, &bytes).expect("decodes"),
        calls::transfer(&key(9).public(), 5 * TAO, true)
    );
    // Balances pallet 5, transfer_keep_alive 3.
    assert_eq!(&bytes[..2], &[5, 3]);

    let netuid_dry = chain
        .register_network(&alice, &key(8).public(), &dry)
        .await
        .expect("dry register_network");
    assert!(matches!(netuid_dry, Outcome::DryRun { .. }));
    let reg = chain
        .register(&alice, 1, &key(8).public(), &dry)
        .await
        .expect("dry register");
    assert!(matches!(reg, Outcome::DryRun { .. }));
    let hp = chain
        .set_hyperparam(&alice, 1, Hyperparam::Tempo(5), true, &dry)
        .await
        .expect("dry sudo");
    let Outcome::DryRun { call_hex } = hp else {
        panic!("{hp:?}");
    };
    // Sudo pallet 12, sudo 0, AdminUtils 19, sudo_set_tempo 30, netuid 1, tempo 5.
    assert_eq!(call_hex, "0x0c00131e01000500");

    assert_eq!(net.best_number(), before, "nothing was submitted");
    assert_eq!(
        chain.free_balance(&key(9).public()).await.expect("balance"),
        0
    );
    net.stop().await;
}

#[tokio::test]
async fn connects_by_url_times_out_and_reconnects() {
    init_tracing();
    // Nothing listens: a clear error within the connect timeout.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let dead = format!("ws://{}", listener.local_addr().expect("addr"));
    drop(listener);
    let mut opts = ConnectOptions::for_network("finney", Some(&dead)).expect("url");
    opts.connect_timeout = Duration::from_secs(1);
    let started = std::time::Instant::now();
    let err = Subtensor::connect(opts).await.expect_err("nothing there");
    assert!(
        matches!(err, ChainError::Timeout { .. } | ChainError::Connect { .. }),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    // A node that goes away and comes back on the same address: the client re-dials.
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let addr = net.addr();
    let mut opts = ConnectOptions::for_network(&net.ws_url(), None).expect("url");
    opts.request_timeout = Duration::from_secs(5);
    opts.max_reconnect_delay = Duration::from_millis(200);
    let chain = Subtensor::connect(opts).await.expect("connect");
    net.produce_blocks(3);
    assert_eq!(chain.best_block_number().await.expect("block"), 3);
    net.stop().await;
    let config = LocalnetConfig {
        addr,
        ..LocalnetConfig::instant()
    };
    let mut restarted = None;
    for _ in 0..50 {
        match Localnet::spawn(config.clone()).await {
            Ok(n) => {
                restarted = Some(n);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let net = restarted.expect("the port frees up");
    net.produce_blocks(5);
    let mut seen = None;
    for _ in 0..50 {
        match chain.best_block_number().await {
            Ok(n) => {
                seen = Some(n);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert_eq!(seen, Some(5), "reads work again after the reconnect");
    let mg = chain.hyperparams(0).await;
    assert!(mg.is_ok(), "storage reads work too: {mg:?}");
    net.stop().await;
}

/// The weight-vector checks of `set_weights`, each from a real transaction of the subnet owner's
/// hotkey (which needs no validator permit), and two registrations racing for one block's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_vector_and_registration_slot_errors_come_from_real_transactions() {
    init_tracing();
    let net = Localnet::spawn(LocalnetConfig::with_block_time(Duration::from_millis(300)))
        .await
        .expect("spawn");
    let chain = connect(&net).await;
    let (alice, bob, charlie) = (dev("Alice"), dev("Bob"), dev("Charlie"));
    let owner_hot = key(7);
    let netuid = subnet(&chain, &owner_hot.public(), false, 0).await;
    chain
        .register(&bob, netuid, &key(71).public(), &tx())
        .await
        .expect("register a miner");

    let weights = |uids: Vec<u16>, values: Vec<u16>| calls::set_weights(netuid, uids, values, 0);
    let e = chain
        .submit(&weights(vec![1, 1], vec![1, 2]), &owner_hot, &tx())
        .await
        .expect_err("duplicate uids");
    assert!(matches!(e, ChainError::DuplicateUids), "{e}");
    let e = chain
        .submit(&weights(vec![1, 9], vec![1, 2]), &owner_hot, &tx())
        .await
        .expect_err("unknown uid");
    assert!(matches!(e, ChainError::UidVecContainInvalidOne), "{e}");
    chain
        .set_hyperparam(
            &alice,
            netuid,
            Hyperparam::MinAllowedWeights(2),
            false,
            &tx(),
        )
        .await
        .expect("owner raises min allowed weights");
    let e = chain
        .submit(&weights(vec![1], vec![1]), &owner_hot, &tx())
        .await
        .expect_err("too few weights");
    assert!(matches!(e, ChainError::WeightVecLengthIsLow), "{e}");
    chain
        .submit(&weights(vec![0, 1], vec![1, 1]), &owner_hot, &tx())
        .await
        .expect("a valid vector goes in");

    // One registration per block (the subnet default): two coldkeys racing for the same block.
    let (first, second) = (
        calls::burned_register(netuid, &key(72).public()),
        calls::burned_register(netuid, &key(73).public()),
    );
    let options = tx();
    let (a, b) = tokio::join!(
        chain.submit(&first, &bob, &options),
        chain.submit(&second, &charlie, &options),
    );
    let failures: Vec<ChainError> = [a, b].into_iter().filter_map(Result::err).collect();
    assert_eq!(
        failures.len(),
        1,
        "exactly one of the two fits the block: {failures:?}"
    );
    assert!(
        matches!(failures[0], ChainError::TooManyRegistrationsThisBlock),
        "{}",
        failures[0]
    );
    net.stop().await;
}

/// The watcher reads the metagraph again only when the finalized block is new: between blocks
/// each refresh asks for the head's hash, confirms the index it has and publishes nothing; a new
/// block (here, a registration) is read and published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_reads_only_new_blocks() {
    init_tracing();
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let chain = connect(&net).await;
    let netuid = subnet(&chain, &key(1).public(), false, 20).await;
    let every = Duration::from_millis(50);
    let watcher = iota_chain::MetagraphWatcher::spawn(
        chain.clone(),
        netuid,
        iota_chain::WatchOptions {
            every,
            ..iota_chain::WatchOptions::default()
        },
    )
    .await
    .expect("first read");
    let mut rx = watcher.subscribe();
    let first = rx.borrow_and_update().clone();
    assert_eq!(first.members().len(), 1);
    let spawned = std::time::Instant::now();

    // Refreshes that found the same block: the index's age restarts, nothing is published.
    let deadline = spawned + Duration::from_secs(10);
    while first.age() + 4 * every > spawned.elapsed() {
        assert!(
            std::time::Instant::now() < deadline,
            "no refresh confirmed the index"
        );
        tokio::time::sleep(every / 2).await;
    }
    assert!(
        !rx.has_changed().expect("watcher alive"),
        "an unchanged block was read and published again"
    );
    assert!(std::sync::Arc::ptr_eq(&first, &watcher.latest()));

    chain
        .register(&dev("Alice"), netuid, &key(2).public(), &tx())
        .await
        .expect("register");
    let fresh = tokio::time::timeout(
        Duration::from_secs(10),
        rx.wait_for(|m| m.members().len() == 2),
    )
    .await
    .expect("the new block is read")
    .expect("watcher alive")
    .clone();
    assert!(fresh.block() > first.block());
    assert_eq!(fresh.uid_of(&key(2).public()), Some(1));
    drop(watcher);
    net.stop().await;
}
