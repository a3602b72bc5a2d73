//! The chain client's drand timelock encryption against the Python `bittensor-drand` package
//! from PyPI (the encryption the Bittensor SDK uses for timelocked weight commits), both ways.
//!
//! The package encrypts only to drand quicknet's public key, which it has built in, and can decrypt
//! with any signature it is handed. So:
//!
//! * this client → Python: ciphertexts under a local beacon's key (and under quicknet's key) that
//!   Python opens with the round's signature;
//! * Python → this client: ciphertexts Python makes for quicknet round 1000, which this client opens
//!   with that round's published signature (no network here: the one quicknet signature the test
//!   has is a published constant). Python's weight commits (`get_encrypted_commit_v2`) target a
//!   round in the future, whose signature nobody has yet: for those the test checks the framing.
//!
//! The interpreter comes from `IOTA_PY_DRAND` (`scripts/drand-venv.sh` creates the venv and
//! `scripts/test.sh` sets it). Without it the tests say so and pass, except under `CI=true`.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use iota_chain::timelock::{
    DrandPublicKey, LocalBeacon, SubtensorCiphertext, TimelockError, WeightsTlockPayload,
    decrypt_with_signature, encrypt_for_round,
};
use parity_scale_codec::{Decode, Encode};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};

/// Quicknet round 1000's published signature.
const QUICKNET_ROUND_1000: &str = "b44679b9a59af2ec876b1a6b1ad52ea9b1615fc3982b19576350f93447cb1125e342b73a8dd2bacbe47e4b6b63ed5e39";

fn python() -> Option<PathBuf> {
    const VAR: &str = "IOTA_PY_DRAND";
    match std::env::var_os(VAR) {
        Some(p) if PathBuf::from(&p).exists() => Some(PathBuf::from(p)),
        other => {
            let why = match other {
                Some(p) => format!("{VAR}={} does not exist", PathBuf::from(p).display()),
                None => format!("{VAR} is not set"),
            };
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{why}: CI must run the bittensor-drand cross-check (scripts/test.sh creates the venv)"
            );
            println!("SKIPPED: {why} (run scripts/test.sh, or scripts/drand-venv.sh)");
            None
        }
    }
}

/// Runs `ops` through `tests/python/drand.py`; one result per operation.
fn run(python: &PathBuf, ops: &Value) -> Vec<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/drand.py");
    let mut child = Command::new(python)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python starts");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(ops.to_string().as_bytes())
        .expect("ops written");
    let output = child.wait_with_output().expect("python finished");
    assert!(
        output.status.success(),
        "{} failed ({}):\n{}",
        script.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("python's results are JSON")
}

fn ok(result: &Value) -> &Value {
    result
        .get("ok")
        .unwrap_or_else(|| panic!("bittensor_drand refused: {result}"))
}

fn hex_of(value: &Value) -> Vec<u8> {
    hex::decode(value.as_str().expect("a hex string")).expect("hex")
}

fn payload() -> WeightsTlockPayload {
    WeightsTlockPayload {
        hotkey: (0u8..32).collect(),
        uids: vec![0, 1, 5, 17],
        values: vec![65535, 30000, 12, 0],
        version_key: 10_005_000,
    }
}

/// bittensor-drand's `encrypt`/`encrypt_at_round` output: SCALE `(encrypted_data: Vec<u8>,
/// reveal_round: u64)`.
fn user_data(ciphertext: Vec<u8>, round: u64) -> String {
    hex::encode((ciphertext, round).encode())
}

#[test]
fn python_bittensor_drand_decrypts_this_clients_commits() {
    let Some(python) = python() else { return };
    let mut rng = StdRng::seed_from_u64(56);
    let beacon = LocalBeacon::generate(&mut rng);
    let plaintext = payload().encode();
    let round = 4242;
    let ours =
        encrypt_for_round(&plaintext, round, beacon.public_key(), &mut rng).expect("encrypts");
    let to_quicknet = encrypt_for_round(&plaintext, 1000, &DrandPublicKey::quicknet(), &mut rng)
        .expect("encrypts");
    let ops = json!([
        {"op": "decrypt_with_signature", "data": user_data(ours.clone(), round),
         "signature": hex::encode(beacon.sign(round))},
        {"op": "decrypt_with_signature", "data": user_data(ours, round),
         "signature": hex::encode(beacon.sign(round + 1))},
        {"op": "decrypt_with_signature", "data": user_data(to_quicknet, 1000),
         "signature": QUICKNET_ROUND_1000},
    ]);
    let results = run(&python, &ops);
    assert_eq!(results.len(), 3);
    let opened = hex_of(ok(&results[0]));
    assert_eq!(opened, plaintext);
    assert_eq!(
        WeightsTlockPayload::decode(&mut &opened[..]).expect("decodes"),
        payload()
    );
    assert!(
        results[1].get("error").is_some(),
        "another round's signature must not open it: {}",
        results[1]
    );
    assert_eq!(hex_of(ok(&results[2])), plaintext);
}

#[test]
fn this_client_decrypts_python_bittensor_drands_ciphertexts() {
    let Some(python) = python() else { return };
    let plaintext = payload().encode();
    let ops = json!([
        {"op": "encrypt_at_round", "plaintext": hex::encode(&plaintext), "round": 1000},
        {"op": "get_encrypted_commit_v2", "uids": payload().uids, "weights": payload().values,
         "version_key": payload().version_key, "last_epoch_block": 7200, "pending_epoch_at": 0,
         "subnet_epoch_index": 20, "tempo": 360, "blocks_since_last_step": 10,
         "current_block": 7210, "subnet_reveal_period_epochs": 1, "block_time": 12.0,
         "hotkey": hex::encode(&payload().hotkey)},
    ]);
    let results = run(&python, &ops);
    assert_eq!(results.len(), 2);

    let encrypted = ok(&results[0]);
    assert_eq!(encrypted["round"], 1000);
    let (ciphertext, round) =
        <(Vec<u8>, u64)>::decode(&mut &hex_of(&encrypted["data"])[..]).expect("user data");
    assert_eq!(round, 1000);
    let signature = hex::decode(QUICKNET_ROUND_1000).expect("hex");
    assert_eq!(
        decrypt_with_signature(&ciphertext, &signature).expect("opens"),
        plaintext
    );
    let mut rng = StdRng::seed_from_u64(57);
    assert_eq!(
        decrypt_with_signature(&ciphertext, &LocalBeacon::generate(&mut rng).sign(1000)),
        Err(TimelockError::WrongSignature)
    );

    // The SDK's weight commit: the payload under quicknet's key for a round to come, in the
    // framing this client reads (and writes: same length for the same payload).
    let commit = ok(&results[1]);
    let commit_bytes = hex_of(&commit["commit"]);
    let parsed = SubtensorCiphertext::parse(&commit_bytes).expect("Python's commit parses");
    assert_eq!((parsed.v.len(), parsed.w.len()), (32, 32));
    assert_eq!(parsed.cipher_suite, b"AES_GCM_");
    let ours =
        encrypt_for_round(&plaintext, 1, &DrandPublicKey::quicknet(), &mut rng).expect("encrypts");
    assert_eq!(commit_bytes.len(), ours.len());
    assert!(commit["round"].as_u64().expect("a round") > 1000);
}

/// The reveal round for a stateful (spec ≥ 404) runtime: `bittensor-drand` 2.x's
/// `get_encrypted_commit_v2` simulates the chain's epoch runs from `LastEpochBlock` and
/// `PendingEpochAt`; this client predicts the reveal block with `stateful_first_reveal_block` and
/// converts it with `reveal_round`. Python reads the clock itself, so the test brackets its run and
/// requires Python's round between this client's rounds for the two ends. A prediction one block
/// off moves the round by four (12 s blocks, 3 s rounds), outside the bracket.
#[test]
fn the_stateful_reveal_round_is_the_one_bittensor_drand_picks() {
    use iota_chain::epoch::stateful_first_reveal_block;
    use iota_chain::timelock::{CommitTiming, DrandSchedule, reveal_round};
    let Some(python) = python() else { return };
    // (last_epoch_block, pending_epoch_at, tempo, current_block, reveal period)
    let cases: [(u64, u64, u16, u64, u64); 9] = [
        (7200, 0, 360, 7210, 1),
        (7200, 0, 360, 7210, 2),
        (7200, 0, 360, 7559, 1),
        (7200, 0, 360, 7560, 1),
        (7200, 0, 360, 7600, 1),
        (7200, 7300, 360, 7210, 1),
        (7200, 7300, 360, 7210, 3),
        (7205, 0, 10, 7210, 1),
        (7205, 0, 10, 7214, 1),
    ];
    let ops: Vec<Value> = cases
        .iter()
        .map(|&(last, pending, tempo, current, period)| {
            json!({"op": "get_encrypted_commit_v2", "uids": [1], "weights": [1],
                   "version_key": 0, "last_epoch_block": last, "pending_epoch_at": pending,
                   "subnet_epoch_index": 20, "tempo": tempo, "blocks_since_last_step": 5,
                   "current_block": current, "subnet_reveal_period_epochs": period,
                   "block_time": 12.0, "hotkey": hex::encode([0u8; 32])})
        })
        .collect();
    let clock = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs_f64()
    };
    let before = clock();
    let results = run(&python, &Value::Array(ops));
    let after = clock();
    assert_eq!(results.len(), cases.len());
    for (&(last, pending, tempo, current, period), result) in cases.iter().zip(&results) {
        let theirs = ok(result)["round"].as_u64().expect("a round");
        let first_reveal_block =
            stateful_first_reveal_block(last, pending, tempo, current + 1, period);
        let ours = |now_unix_secs: f64| {
            reveal_round(
                &CommitTiming {
                    current_block: current,
                    first_reveal_block,
                    block_time_secs: 12.0,
                    now_unix_secs,
                },
                &DrandSchedule::QUICKNET,
            )
            .expect("round")
        };
        assert!(
            (ours(before)..=ours(after)).contains(&theirs),
            "last {last} pending {pending} tempo {tempo} at {current}, period {period}: \
             bittensor-drand picks round {theirs}, this client {}..={} (reveal block {first_reveal_block})",
            ours(before),
            ours(after)
        );
    }
}
