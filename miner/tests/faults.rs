//! Faults during a real run: an orchestrator restarted mid-epoch, and a miner that crashes and
//! comes back. Needs `DATABASE_URL` (scripts/test.sh starts PostgreSQL).

mod support;

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
