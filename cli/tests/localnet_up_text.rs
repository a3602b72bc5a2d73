//! `iota localnet up --data` on real English text, end to end: the binary trains a tokenizer and
//! prepares the corpus, runs the subnet for 3 epochs, and reports held-out loss falling, its
//! perplexity and a generation; then `iota model eval` and `iota model generate` work on the
//! weights it exported. Needs `DATABASE_URL` (scripts/test.sh starts PostgreSQL) and the
//! corpus: the Python documentation's sources as Debian's `python3-doc` ships them (about 500
//! English documents, 12 MB), or another folder in `IOTA_TEST_TEXT_CORPUS`.

use crate::support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::wait_within;

const DEBIAN_CORPUS: &str = "/usr/share/doc/python3-doc/html/_sources";

fn corpus() -> Option<PathBuf> {
    let path = std::env::var_os("IOTA_TEST_TEXT_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEBIAN_CORPUS));
    if path.is_dir() {
        return Some(path);
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{} is missing: CI trains on real text (apt-get install python3-doc)",
        path.display()
    );
    eprintln!(
        "skipping: no English corpus at {} (apt-get install python3-doc)",
        path.display()
    );
    None
}

fn iota(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_iota"))
        .args(args)
        .output()
        .expect("run iota");
    assert!(
        out.status.success(),
        "iota {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn localnet_up_trains_real_text_and_its_weights_generate() {
    let Some(corpus) = corpus() else { return };
    assert!(
        std::env::var("DATABASE_URL").is_ok(),
        "DATABASE_URL is not set: run the tests through scripts/test.sh, which starts PostgreSQL"
    );
    let dir = tempfile::tempdir().expect("run dir");
    let report_path = dir.path().join("report.json");
    let stderr_path = dir.path().join("stderr.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_iota"))
        .args(["localnet", "up", "--epochs", "3", "--data"])
        .arg(&corpus)
        .arg("--dir")
        .arg(dir.path())
        .arg("--report")
        .arg(&report_path)
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).expect("stderr file"))
        .spawn()
        .expect("start iota localnet up");
    let status = wait_within(
        &mut child,
        Duration::from_secs(420),
        "iota localnet up --data",
    );
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert!(
        status.success(),
        "iota localnet up failed: {status}\n{stderr}"
    );
    // Expected events (miners leaving at the end, reveals the short tempo let expire) are not
    // warnings: a successful run ends without any.
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains(" WARN ")).collect();
    assert!(
        warnings.is_empty(),
        "warnings in a good run:\n{}",
        warnings.join("\n")
    );

    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&report_path).expect("report written"))
            .expect("report is JSON");
    assert_eq!(report["epochs"], 3);
    assert!(
        report["entropy_floor"].is_null(),
        "real text has no known floor"
    );
    let dataset = report["dataset"]
        .as_str()
        .expect("the dataset's manifest hash");
    assert_eq!(dataset.len(), 64);

    // Held-out loss falls (by then the small model nears the corpus's unigram entropy, and an
    // epoch may gain little or give back a few hundredths: one run went 5.903 then 5.936; a
    // diverging run rises by far more), and perplexity is its exponential.
    let initial = report["initial_loss"].as_f64().expect("initial loss");
    let losses: Vec<f64> = report["loss_per_epoch"]
        .as_array()
        .expect("losses")
        .iter()
        .map(|l| l.as_f64().expect("loss"))
        .collect();
    let ppl = report["perplexity_per_epoch"]
        .as_array()
        .expect("perplexities");
    assert_eq!((losses.len(), ppl.len()), (3, 3), "{report:#}");
    assert!(
        losses[0] < initial - 0.2 && losses[2] < losses[0] - 0.2,
        "held-out loss did not fall: {initial} then {losses:?}"
    );
    assert!(
        losses.windows(2).all(|w| w[1] < w[0] + 0.05),
        "held-out loss rose: {initial} then {losses:?}"
    );
    for (&l, p) in losses.iter().zip(ppl) {
        let p = p.as_f64().expect("perplexity");
        assert!(
            (p - l.exp()).abs() < 1e-3 * p,
            "perplexity {p} for loss {l}"
        );
    }
    let last = losses[2];
    // Every partition merged by agreement.
    let p = &report["partitions"];
    assert_eq!(p["merged"], p["total"], "{p}");

    let generation = &report["generation"];
    assert_eq!(generation["epoch"], 3);
    assert!(
        !generation["text"].as_str().expect("text").trim().is_empty(),
        "{generation}"
    );

    // The exported weights: the same held-out loss through `iota model eval`, and text.
    let export = report["export"].as_str().expect("export folder");
    let data = dir.path().join("data");
    let out = iota(&[
        "model",
        "eval",
        "--checkpoint",
        export,
        "--data",
        data.to_str().expect("utf-8"),
        "--seq-len",
        "32",
        "--windows",
        "32",
    ]);
    let loss: f64 = out
        .split_whitespace()
        .nth(2)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no loss in {out:?}"));
    assert!(
        (loss - last).abs() < 1e-3,
        "eval says {loss}, the run's last held-out loss was {last}"
    );
    let generate = |seed: &str| {
        iota(&[
            "model",
            "generate",
            "--checkpoint",
            export,
            "--prompt",
            "The module",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0.8",
            "--top-p",
            "0.95",
            "--seed",
            seed,
        ])
    };
    let text = generate("7");
    assert!(
        text.starts_with("The module") && text.trim().len() > "The module".len(),
        "{text:?}"
    );
    assert_eq!(text, generate("7"), "a seeded sample repeats");
}
