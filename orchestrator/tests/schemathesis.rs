//! The API keeps its own document: schemathesis (from PyPI; `scripts/schemathesis-venv.sh`
//! installs it, `scripts/test.sh` runs that) generates requests for every operation of the served
//! `openapi.json`, within the document and outside it, runs every check on the answers, and any
//! finding fails this test. Requests are signed by a registered validator's hotkey through
//! `tests/schemathesis/hooks.py`, which also lets the `ignored_auth` check send them unsigned.
//! Strings are generated without U+0000, which PostgreSQL's text cannot hold and every route
//! refuses (`API.md`). `tests/schemathesis/schemathesis.toml` lists the few rules the document
//! cannot state (each with its reason); nothing else is exempt.

use std::path::PathBuf;
use std::time::Duration;

use sp_core::Pair as _;
use sp_core::crypto::Ss58Codec as _;

use crate::common::*;

/// The hotkey the hook signs with: registered, staked, a validator.
const SIGNER: u8 = 41;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace")
        .to_path_buf()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schemathesis_finds_no_disagreement_with_the_document() {
    init_tracing();
    let bin = workspace().join("target/python/schemathesis/bin/schemathesis");
    assert!(
        bin.exists(),
        "{} is missing: run scripts/schemathesis-venv.sh (scripts/test.sh runs it)",
        bin.display()
    );
    let chain = chain_with(&[42], &[SIGNER]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let cfg = config(&chain, &db, store.path(), run_config("schemathesis"));
    let signed_for = cfg.hotkey.clone();
    let orch = start(cfg).await;
    let hooks = workspace().join("orchestrator/tests/schemathesis");
    let report = tempfile::tempdir().expect("report dir");
    let run = tokio::process::Command::new(&bin)
        .arg("--config-file")
        .arg(hooks.join("schemathesis.toml"))
        .args([
            "run",
            &format!("{}/openapi.json", orch.base),
            "--generation-allow-x00",
            "false",
            "--checks",
            "all",
            // One worker: Hypothesis parses lambdas' source with `ast`, and CPython 3.11's AST
            // conversion keeps its recursion depth in state shared across threads, so two workers
            // fail at random with "AST constructor recursion depth mismatch" (CPython gh-106905).
            "--workers",
            "1",
            "--seed",
            "1",
            "--max-examples",
            "40",
            "--request-timeout",
            "20",
            "--report-dir",
        ])
        .arg(report.path())
        // Its cache of past failures, replayed first, stays out of the source tree.
        .current_dir(report.path())
        .env("SCHEMATHESIS_HOOKS", "hooks")
        .env("PYTHONPATH", &hooks)
        .env("IOTA_ST_SEED", hex::encode([SIGNER; 32]))
        .env("IOTA_ST_SIGNED_BY", pair(SIGNER).public().to_ss58check())
        .env("IOTA_ST_SIGNED_FOR", &signed_for)
        .env("NO_COLOR", "1")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(900), run)
        .await
        .expect("schemathesis within 15 minutes")
        .expect("start schemathesis");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "schemathesis found disagreements with the document:\n{text}"
    );
    eprintln!("{text}");
}
