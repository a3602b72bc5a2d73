//! `iota localnet up` end to end: the binary runs a whole subnet (chain, orchestrator, 6 honest
//! miners and a cheating one, two validators) for 2 epochs of `tiny` and writes a report whose
//! numbers show training, agreement on every merge, weights on chain and the cheater paid least.
//! The cheater is `claim-speed` (claims ten times its throughput and idles after each hop): no
//! check catches it, so only routing and pay by measured work keep it from earning more (the
//! kinds a check catches are run in the validator's `catches_adversaries`). Needs `DATABASE_URL`
//! (scripts/test.sh starts PostgreSQL).

use crate::support;

use std::process::Command;
use std::time::Duration;

use support::wait_within;

#[test]
fn localnet_up_trains_merges_and_pays_honest_miners_more() {
    assert!(
        std::env::var("DATABASE_URL").is_ok(),
        "DATABASE_URL is not set: run the tests through scripts/test.sh, which starts PostgreSQL"
    );
    let dir = tempfile::tempdir().expect("run dir");
    let report_path = dir.path().join("out.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_iota"))
        .args([
            "localnet",
            "up",
            "--epochs",
            "2",
            "--adversary",
            "claim-speed",
        ])
        .arg("--dir")
        .arg(dir.path())
        .arg("--report")
        .arg(&report_path)
        .spawn()
        .expect("start iota localnet up");
    let status = wait_within(&mut child, Duration::from_secs(300), "iota localnet up");
    assert!(status.success(), "iota localnet up failed: {status}");

    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&report_path).expect("report written"))
            .expect("report is JSON");
    for key in [
        "epochs",
        "loss_per_epoch",
        "entropy_floor",
        "partitions",
        "tokens",
        "wire_bytes_per_token",
        "fp32_bytes_per_token",
        "weights_set",
        "neurons",
        "plot",
    ] {
        assert!(report.get(key).is_some(), "report lacks {key}: {report:#}");
    }
    assert_eq!(report["epochs"], 2);

    // The loss curve beside the report: a PNG of the default 640 x 400.
    let plot = std::path::PathBuf::from(report["plot"].as_str().expect("plot path"));
    assert_eq!(plot, dir.path().join("out.png"));
    let png = std::fs::read(&plot).expect("plot written");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert_eq!(&png[12..16], b"IHDR");
    assert_eq!(&png[16..24], &[0, 0, 2, 128, 0, 0, 1, 144], "PNG size");

    // Training: the held-out loss falls after every epoch.
    let mut prev = report["initial_loss"].as_f64().expect("initial loss");
    let losses = report["loss_per_epoch"].as_array().expect("losses");
    assert_eq!(losses.len(), 2, "{report:#}");
    for l in losses {
        let l = l.as_f64().expect("loss");
        assert!(l < prev, "loss did not fall: {losses:?} from {prev}");
        prev = l;
    }
    assert!(prev > report["entropy_floor"].as_f64().expect("floor") - 1e-3);

    // Every partition of both epochs merged, both owners agreeing.
    let p = &report["partitions"];
    let total = p["total"].as_u64().expect("total");
    assert_eq!(total, 2 * 3 * 2, "{p}");
    assert_eq!(p["merged"].as_u64(), Some(total), "{p}");
    assert_eq!(p["agreeing"].as_u64(), Some(total), "{p}");

    // The wire carries less than f32 would.
    assert!(report["tokens"].as_u64().expect("tokens") > 0);
    let wire = report["wire_bytes_per_token"].as_f64().expect("wire");
    let fp32 = report["fp32_bytes_per_token"].as_f64().expect("fp32");
    assert!(wire > 0.0 && wire < fp32, "wire {wire} vs fp32 {fp32}");

    // Both validators set weights on chain.
    let neurons = report["neurons"].as_array().expect("neurons");
    let validators: Vec<&str> = neurons
        .iter()
        .filter(|n| n["role"] == "validator")
        .map(|n| n["hotkey"].as_str().expect("hotkey"))
        .collect();
    assert_eq!(validators.len(), 2);
    let setters: Vec<&str> = report["weights_set"]
        .as_array()
        .expect("weights_set")
        .iter()
        .filter(|w| w["block"].as_u64().is_some())
        .map(|w| w["validator"].as_str().expect("validator"))
        .collect();
    for v in &validators {
        assert!(setters.contains(v), "{v} set no weights: {report:#}");
    }

    // Yuma pays every honest miner more than the cheater, which claimed to be the fastest.
    let incentive = |n: &serde_json::Value| n["incentive"].as_f64().expect("incentive");
    let miners: Vec<&serde_json::Value> = neurons.iter().filter(|n| n["role"] == "miner").collect();
    let cheat: Vec<f64> = miners
        .iter()
        .filter(|n| !n["adversary"].is_null())
        .map(|n| incentive(n))
        .collect();
    assert_eq!(cheat.len(), 1, "{report:#}");
    assert!(
        miners.iter().any(|n| n["adversary"] == "claim-speed"),
        "{report:#}"
    );
    let min_honest = miners
        .iter()
        .filter(|n| n["adversary"].is_null())
        .map(|n| incentive(n))
        .fold(f64::INFINITY, f64::min);
    assert_eq!(miners.len(), 7);
    assert!(
        min_honest > cheat[0],
        "incentive: honest min {min_honest}, cheater {}",
        cheat[0]
    );
}
