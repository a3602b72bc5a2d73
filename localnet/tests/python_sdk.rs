//! Clients nobody here wrote: the Python `bittensor` SDK from PyPI drives a subnet's life on a
//! localnet spawned in this process (scripts in `tests/python/`).
//!
//! The interpreters come from `IOTA_PY_SDK11` (a venv with `bittensor` 11.x) and
//! `IOTA_PY_SDK10` (a venv with `bittensor` 10.x on `async-substrate-interface`);
//! `scripts/python-sdk-venvs.sh` creates both and `scripts/test.sh` sets the variables. Without
//! them the tests say so and pass, except under `CI=true`, where a missing client is a failure.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use iota_localnet::{Localnet, LocalnetConfig};

fn python(var: &str) -> Option<PathBuf> {
    match std::env::var_os(var) {
        Some(p) if PathBuf::from(&p).exists() => Some(PathBuf::from(p)),
        other => {
            let why = match other {
                Some(p) => format!("{var}={} does not exist", PathBuf::from(p).display()),
                None => format!("{var} is not set"),
            };
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{why}: CI must run the Python SDK tests (scripts/test.sh creates the venvs)"
            );
            println!("SKIPPED: {why} (run scripts/test.sh, or scripts/python-sdk-venvs.sh)");
            None
        }
    }
}

async fn run_flow(var: &str, script: &str, passed: &str) {
    let Some(python) = python(var) else { return };
    let net = Localnet::spawn(LocalnetConfig::with_block_time(Duration::from_millis(100)))
        .await
        .expect("localnet starts");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    // The SDKs cache metadata by genesis hash, which is the same for every localnet run.
    let cache = std::env::temp_dir().join(format!("iota-sdk-cache-{}-{var}", std::process::id()));
    let url = net.ws_url();
    let shown = script.display().to_string();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(&python)
            .arg(&script)
            .arg(&url)
            .env("BITTENSOR_RUNTIME_CACHE_DIR", &cache)
            .env("HOME", &cache)
            .output()
            .expect("python runs")
    })
    .await
    .expect("python finished");
    net.stop().await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    assert!(
        output.status.success() && stdout.contains(passed),
        "{shown} failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bittensor_11_runs_a_subnet_on_the_localnet() {
    run_flow("IOTA_PY_SDK11", "sdk11_flow.py", "SDK11 FLOW PASSED").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bittensor_10_on_async_substrate_interface_runs_a_subnet_on_the_localnet() {
    run_flow("IOTA_PY_SDK10", "sdk10_flow.py", "SDK10 FLOW PASSED").await;
}
