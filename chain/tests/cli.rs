//! `iota chain …` driven as an operator would, against the localnet.

use clap::Parser;
use iota_chain::cli::{ChainArgs, run_with_password};
use iota_chain::wallet::{Keypair, PasswordSource, Wallet};
use iota_localnet::{Localnet, LocalnetConfig};
use sp_core::Pair as _;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    chain: ChainArgs,
}

async fn iota_chain(net: &Localnet, wallets: &std::path::Path, args: &[&str]) -> String {
    let path = wallets.display().to_string();
    let mut argv = vec![
        "iota-chain",
        "--subtensor.network",
        "local",
        "--subtensor.chain_endpoint",
    ];
    let url = net.ws_url();
    argv.push(&url);
    argv.extend_from_slice(args);
    if matches!(
        args.first(),
        Some(&("register" | "transfer" | "stake" | "unstake"))
    ) {
        argv.push("--yes");
    }
    // Read-only commands take no wallet flags.
    if !matches!(args.first(), Some(&("metagraph" | "hyperparams" | "check"))) {
        argv.extend_from_slice(&["--wallet.path", &path, "--wallet.name", "owner"]);
    }
    let cli = Cli::try_parse_from(&argv).expect("arguments parse");
    let mut out = Vec::new();
    run_with_password(&cli.chain, &mut out, &PasswordSource::EnvOnly)
        .await
        .unwrap_or_else(|e| panic!("{args:?} failed: {e}"));
    String::from_utf8(out).expect("utf-8 output")
}

#[tokio::test]
async fn operator_commands_against_the_localnet() {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let dir = tempfile::tempdir().expect("tempdir");
    // Alice's key as the owner coldkey (unencrypted, this is a test), two hotkeys.
    let alice =
        Keypair::from_private_key(&iota_localnet::dev_pair("Alice").to_raw_vec()).expect("alice");
    let owner = Wallet::new(dir.path(), "owner", "default").expect("wallet");
    owner.set_coldkey(&alice, None, false).expect("coldkey");
    owner.create_hotkey(12, None, false).expect("hotkey");
    let miner = owner.with_hotkey("miner").expect("wallet");
    let miner_hot = miner.create_hotkey(12, None, false).expect("hotkey");

    let out = iota_chain(&net, dir.path(), &["register-subnet"]).await;
    assert!(out.contains("registered subnet 1"), "{out}");
    iota_chain(&net, dir.path(), &["start-call", "--netuid", "1"]).await;
    let out = iota_chain(
        &net,
        dir.path(),
        &[
            "hyperparam",
            "--netuid",
            "1",
            "--name",
            "commit_reveal_weights_enabled",
            "--value",
            "false",
        ],
    )
    .await;
    assert!(
        out.contains("commit_reveal_weights_enabled set to false"),
        "{out}"
    );

    // A burn above --max-burn is refused before anything is asked or spent.
    let url = net.ws_url();
    let path = dir.path().display().to_string();
    let capped = Cli::try_parse_from([
        "iota-chain",
        "--subtensor.chain_endpoint",
        url.as_str(),
        "register",
        "--netuid",
        "1",
        "--max-burn",
        "0.5",
        "--wallet.path",
        path.as_str(),
        "--wallet.name",
        "owner",
        "--wallet.hotkey",
        "miner",
    ])
    .expect("arguments parse");
    let mut sink = Vec::new();
    let refused = run_with_password(&capped.chain, &mut sink, &PasswordSource::EnvOnly)
        .await
        .expect_err("burn above the cap");
    assert!(refused.to_string().contains("--max-burn"), "{refused}");
    let out = iota_chain(
        &net,
        dir.path(),
        &["register", "--netuid", "1", "--wallet.hotkey", "miner"],
    )
    .await;
    assert!(out.contains("as uid 1"), "{out}");
    let out = iota_chain(
        &net,
        dir.path(),
        &["register", "--netuid", "1", "--wallet.hotkey", "miner"],
    )
    .await;
    assert!(out.contains("already registered"), "{out}");
    iota_chain(
        &net,
        dir.path(),
        &[
            "serve-axon",
            "--netuid",
            "1",
            "--axon.ip",
            "10.0.0.2",
            "--axon.port",
            "9000",
            "--wallet.hotkey",
            "miner",
        ],
    )
    .await;

    let out = iota_chain(&net, dir.path(), &["metagraph", "--netuid", "1", "--json"]).await;
    let mg: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(mg["neurons"].as_array().map(Vec::len), Some(2));
    assert_eq!(mg["neurons"][1]["hotkey"], miner_hot.ss58());
    assert_eq!(mg["neurons"][1]["coldkey"], alice.ss58());
    assert_eq!(mg["neurons"][1]["axon"]["ip"], "10.0.0.2");
    assert_eq!(mg["hyperparams"]["commit_reveal_enabled"], false);
    let out = iota_chain(&net, dir.path(), &["metagraph", "--netuid", "1"]).await;
    assert!(
        out.contains("UID") && out.contains("10.0.0.2:9000"),
        "{out}"
    );
    let out = iota_chain(
        &net,
        dir.path(),
        &["hyperparams", "--netuid", "1", "--json"],
    )
    .await;
    assert!(out.contains("\"tempo\": 10"), "{out}");

    // Dry runs print the call and change nothing.
    let before = net.best_number();
    let out = iota_chain(
        &net,
        dir.path(),
        &[
            "transfer",
            "--dest",
            &miner_hot.ss58(),
            "--amount",
            "1.5",
            "--dry-run",
        ],
    )
    .await;
    assert!(out.starts_with("dry run, not submitted: 0x0503"), "{out}");
    let out = iota_chain(
        &net,
        dir.path(),
        &[
            "set-weights",
            "--netuid",
            "1",
            "--uids",
            "0,1",
            "--weights",
            "1,3",
            "--dry-run",
        ],
    )
    .await;
    assert!(out.contains("dry run (set_weights): 0x0700"), "{out}");
    assert!(out.contains("values [21845, 65535]"), "{out}");
    assert_eq!(net.best_number(), before);

    let out = iota_chain(&net, dir.path(), &["check", "--json"]).await;
    assert!(out.contains("\"compatible\": true"), "{out}");
    let out = iota_chain(&net, dir.path(), &["balance"]).await;
    assert!(out.contains(&alice.ss58()), "{out}");
    net.stop().await;
}
