//! A miner takes the run from the orchestrator's unsigned `GET /v1/run` and sizes everything
//! from it: one outside the protocol's bounds is refused at once, with the reason, and the
//! model a run names is read bounded. No database or chain: the orchestrator here is a socket
//! that answers every request with one canned run.

use std::sync::Arc;
use std::time::Duration;

use iota_miner::{MinerConfig, MinerError, MinerStatus};
use iota_protocol::ClientError;
use iota_protocol::api::{RunConfig, RunInfo};
use iota_protocol::signing::RequestSigner;
use sp_core::Pair as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Answers every request with `run` as `RunInfo`; returns the base URL.
async fn orchestrator_serving(run: RunConfig) -> String {
    let body = serde_json::to_vec(&RunInfo {
        id: 1,
        config: run,
        orchestrator_hotkey: "orchestrator".into(),
        netuid: 9,
        created_ms: 0,
        direct_uploads: false,
    })
    .expect("json");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match conn.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let head = format!(
                    "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(&body).await;
            });
        }
    });
    format!("http://{addr}")
}

fn tiny() -> RunConfig {
    iota_trainer::local_tiny_run("bounds", 8).expect("tiny run")
}

/// Runs a miner against `run` until it gives up (a bounded wait: a miner that kept retrying a
/// run it cannot train would never return).
async fn join(run: RunConfig) -> Result<MinerStatus, MinerError> {
    let base = orchestrator_serving(run).await;
    let mut cfg = MinerConfig::new(&base);
    cfg.tokens_per_s = Some(1000.0);
    let signer: Arc<dyn RequestSigner> = Arc::new(sp_core::sr25519::Pair::from_seed(&[3; 32]));
    let (status, _) = tokio::sync::watch::channel(MinerStatus::default());
    tokio::time::timeout(
        Duration::from_secs(120),
        iota_miner::run(cfg, signer, std::future::pending(), status),
    )
    .await
    .expect("the miner gave up on the run instead of retrying it")
}

#[tokio::test]
async fn a_run_outside_the_bounds_is_refused_at_once() {
    let mut partitions = tiny();
    partitions.partitions = u32::MAX;
    partitions.stage_params = vec![u64::from(u32::MAX); 3];
    let mut heartbeat = tiny();
    heartbeat.heartbeat_timeout_s = u64::MAX;
    let mut in_flight = tiny();
    in_flight.max_in_flight = u32::MAX;
    for (what, run) in [
        ("partitions", partitions),
        ("heartbeat_timeout_s", heartbeat),
        ("max_in_flight", in_flight),
    ] {
        match join(run).await {
            Err(MinerError::Api(ClientError::InvalidRun(m))) => {
                assert!(m.contains(what), "{what}: {m}")
            }
            other => panic!("{what}: expected the run refused, got {other:?}"),
        }
    }
}

#[cfg(unix)]
#[test]
fn a_run_naming_a_device_as_its_model_is_refused() {
    // `/dev/zero` never ends: reading it whole would fill the miner's memory.
    let mut run = tiny();
    run.model = "/dev/zero".into();
    match iota_trainer::run_model(&run) {
        Err(iota_trainer::TrainerError::Model(e)) => {
            assert!(e.to_string().contains("not a regular file"), "{e}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // A preset name is what a run normally names.
    assert!(iota_trainer::run_model(&tiny()).is_ok());
}
