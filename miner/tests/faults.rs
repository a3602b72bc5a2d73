//! Faults during a real run: an orchestrator restarted mid-epoch, and a miner that crashes and
//! comes back. Needs `DATABASE_URL` (scripts/test.sh starts PostgreSQL).

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use iota_miner::spawn;
use iota_protocol::api::{PartitionState, Phase};
use support::*;

async fn done_tasks(db: &sqlx::PgPool) -> BTreeSet<i64> {
    sqlx::query_scalar::<_, i64>("SELECT id FROM tasks WHERE status = 'done'")
        .fetch_all(db)
        .await
        .expect("tasks")
        .into_iter()
        .collect()
}

async fn assert_all_accepted(client: &iota_protocol::client::ApiClient, epoch: u64, n: usize) {
    let parts = client.merge_status(epoch).await.expect("merge status");
    assert_eq!(parts.len(), n, "{parts:?}");
    for p in parts {
        assert_eq!(p.state, PartitionState::Accepted, "{p:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orchestrator_restart_mid_epoch_loses_no_submitted_work() {
    init_tracing();
    let seeds = [41u8, 42, 43, 44, 45, 46];
    let chain = chain_with(&seeds, &[]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let run = tiny_run("miners-restart", 40);
    let cfg = config(&chain, &db_url, store.path(), run.clone());
    let orch = start(cfg.clone()).await;
    let addr = orch.base.trim_start_matches("http://").to_owned();
    let client = explorer(&orch.base, seeds[0]).await;
    let miners: Vec<_> = seeds
        .iter()
        .map(|s| spawn(miner_config(&orch.base), signer(*s)))
        .collect();
    let db = sqlx::PgPool::connect(&db_url).await.expect("db");

    // Mid-epoch: training, some samples done, more to come.
    eventually("samples in flight", Duration::from_secs(120), || async {
        let st = client.status().await.ok()?;
        (st.epoch == 0 && st.phase == Phase::Training && st.samples_completed >= 4).then_some(())
    })
    .await;
    let before = done_tasks(&db).await;
    let hops_before: u64 = miners.iter().map(|m| m.status().hops).sum();
    orch.stop().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let orch = start_on(cfg, &addr).await;

    wait_epoch(&client, 2, Duration::from_secs(300)).await;
    let after = done_tasks(&db).await;
    let lost: Vec<_> = before.difference(&after).collect();
    assert!(
        lost.is_empty(),
        "completed hops lost across the restart: {lost:?}"
    );
    let hops_after: u64 = miners.iter().map(|m| m.status().hops).sum();
    assert!(
        hops_after > hops_before,
        "miners kept working after the restart"
    );
    let n = (run.stages * run.partitions) as usize;
    assert_all_accepted(&client, 0, n).await;
    assert_all_accepted(&client, 1, n).await;
    for m in miners {
        assert!(!m.is_finished(), "a miner exited on the restart");
        m.stop().await.expect("clean stop");
    }
    orch.stop().await;
}

/// A miner that vanishes mid-epoch (aborted: no goodbye, its leases lapse) does not stall the
/// run; restarted with the same hotkey it rejoins its stage and loads the current weights.
/// `cli/tests/miner_process.rs` does the same with a real SIGKILL of `iota miner`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_miner_does_not_stall_the_run_and_catches_up() {
    init_tracing();
    let seeds = [51u8, 52, 53, 54, 55, 56];
    let chain = chain_with(&seeds, &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let run = tiny_run("miners-crash", 32);
    let orch = start(config(&chain, &db, store.path(), run.clone())).await;
    let client = explorer(&orch.base, seeds[0]).await;
    let mut miners: Vec<_> = seeds
        .iter()
        .map(|s| spawn(miner_config(&orch.base), signer(*s)))
        .collect();
    eventually("victim at work", Duration::from_secs(120), || async {
        let s = miners[0].status();
        (s.hops >= 2).then_some(())
    })
    .await;
    let victim_stage = miners[0].status().stage.expect("stage");
    miners[0].abort();
    wait_epoch(&client, 1, Duration::from_secs(240)).await;
    assert_all_accepted(&client, 0, (run.stages * run.partitions) as usize).await;

    miners[0] = spawn(miner_config(&orch.base), signer(seeds[0]));
    let s = eventually("victim back at work", Duration::from_secs(240), || async {
        let s = miners[0].status();
        (s.hops > 0).then_some(s)
    })
    .await;
    assert_eq!(s.stage, Some(victim_stage), "rejoined its stage");
    let (epoch, digest) = s.weights_history.first().cloned().expect("loaded weights");
    let (_, merged) = epoch_start_stages(&client, &run, epoch).await;
    assert!(epoch >= 1, "rejoined in a later epoch");
    assert_eq!(
        digest, merged[victim_stage as usize],
        "caught up to the current weights"
    );
    for m in miners {
        m.stop().await.expect("clean stop");
    }
    orch.stop().await;
}

/// A TCP proxy to `upstream` that plays an orchestrator restart at the worst moment for a
/// joining miner: the first time a request to `/v1/miner/register` passes, it cuts every
/// connection and refuses new ones for `outage`, then forwards again.
async fn outage_on_register(upstream: String, outage: Duration) -> String {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("proxy");
    let addr = listener.local_addr().expect("addr");
    let down = Arc::new(AtomicBool::new(false));
    let tripped = Arc::new(AtomicBool::new(false));
    // Bumped at the outage: every connection opened before it ends.
    let (cut, _) = tokio::sync::broadcast::channel::<()>(1);
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            if down.load(Ordering::SeqCst) {
                drop(client);
                continue;
            }
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let (down, tripped, cut, mut cut_rx) =
                (down.clone(), tripped.clone(), cut.clone(), cut.subscribe());
            tokio::spawn(async move {
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = async {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let text = String::from_utf8_lossy(&buf[..n]);
                        if text.contains("/v1/miner/register")
                            && !tripped.swap(true, Ordering::SeqCst)
                        {
                            down.store(true, Ordering::SeqCst);
                            let _ = cut.send(());
                            let down = down.clone();
                            tokio::spawn(async move {
                                tokio::time::sleep(outage).await;
                                down.store(false, Ordering::SeqCst);
                            });
                            return;
                        }
                        if sw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                };
                let back = tokio::io::copy(&mut sr, &mut cw);
                tokio::select! {
                    _ = up => {}
                    _ = back => {}
                    _ = cut_rx.recv() => {}
                }
            });
        }
    });
    format!("http://{addr}")
}

/// Regression: a miner whose orchestrator went away between its first request and its
/// registration (a restart) ended with a network error instead of waiting, as it does once
/// joined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn miner_waits_out_an_orchestrator_outage_while_joining() {
    init_tracing();
    let seeds = [47u8];
    let chain = chain_with(&seeds, &[]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let run = tiny_run("join-outage", 8);
    let orch = start(config(&chain, &db_url, store.path(), run)).await;
    let upstream = orch.base.trim_start_matches("http://").to_owned();
    let proxy = outage_on_register(upstream, Duration::from_secs(3)).await;
    let mut cfg = miner_config(&proxy);
    cfg.tokens_per_s = Some(1000.0);
    let h = spawn(cfg, signer(47));
    let stage = eventually("the miner joined", Duration::from_secs(60), || async {
        assert!(
            !h.is_finished(),
            "the miner ended during the outage: {:?}",
            h.status()
        );
        h.status().stage
    })
    .await;
    assert_eq!(stage, 0);
    h.stop().await.expect("clean stop");
    orch.stop().await;
}

/// A hop's input that is not what its producer committed (the object was replaced in the
/// store) is reported and the hop skipped: the producer's hop fails, and the miner goes on. The
/// download's error failed the miner's whole round instead, on every poll until the lease
/// lapsed, and nobody reported the object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_input_is_reported_and_skipped() {
    use iota_protocol::api::{CompleteRequest, Direction};
    init_tracing();
    let (producer_seed, miner_seed) = (71u8, 72u8);
    let run = tiny_run("bad-input", 8);
    let chain = chain_with(&[producer_seed, miner_seed], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let orch = start(config(&chain, &db, store.path(), run.clone())).await;
    // A scripted producer at stage 0, and the miner under test after it (at stage 1).
    let (producer, joined) = registered_miner(&orch.base, producer_seed).await;
    assert_eq!(joined.stage, 0);
    let mut cfg = miner_config(&orch.base);
    cfg.tokens_per_s = Some(1000.0);
    let miner = spawn(cfg, signer(miner_seed));
    eventually(
        "the miner joins stage 1",
        Duration::from_secs(60),
        || async { (miner.status().stage == Some(1)).then_some(()) },
    )
    .await;

    let item = producer
        .work(1)
        .await
        .expect("poll")
        .items
        .pop()
        .expect("a sample");
    assert_eq!((item.stage, item.direction), (0, Direction::Forward));
    let shape = run.boundary_shape();
    let n = (shape[0] * shape[1] * shape[2]) as usize;
    let rows = (shape[0] * shape[1]) as usize;
    let bytes = iota_protocol::tensor::encode_boundary_i8(shape, &vec![1; n], &vec![0.01; rows]);
    let blob = producer
        .upload_output(item.task_id, item.lease, bytes::Bytes::from(bytes))
        .await
        .expect("upload")
        .blob;
    // Replaced in the store after the checks on upload.
    corrupt_stored(&store.path().join(&blob.key));
    producer
        .complete(
            item.task_id,
            &CompleteRequest {
                lease: item.lease,
                output: Some(blob.clone()),
                inner_step: 0,
                weights_digest: "0".repeat(64),
                loss: None,
                sequence_losses: None,
                compute_ms: Some(1),
            },
        )
        .await
        .expect("complete");

    let pool = sqlx::PgPool::connect(&db).await.expect("db");
    let reporter: String = eventually(
        "the bad input reported",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar("SELECT reporter FROM bad_objects WHERE key = $1")
                .bind(&blob.key)
                .fetch_optional(&pool)
                .await
                .expect("bad objects")
        },
    )
    .await;
    assert_eq!(reporter, signer(miner_seed).ss58());
    let producer_hop: String = sqlx::query_scalar("SELECT status FROM tasks WHERE id = $1")
        .bind(item.task_id)
        .fetch_one(&pool)
        .await
        .expect("the producer's hop");
    assert_eq!(producer_hop, "failed");
    assert!(!miner.is_finished(), "the miner went on");
    miner.stop().await.expect("the miner stops cleanly");
}
