//! The poll view: polls that find nothing to do are answered from memory, new work still reaches
//! a miner within a poll or two, such polls keep their miner alive, and a lost listener is
//! replaced. One test, so that no other test moves the process-wide poll counters it reads.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use iota_protocol::ApiClient;
use sqlx::PgPool;

const MINERS: [u8; 3] = [1, 2, 3];

/// Work polls answered from the view so far (in this process).
async fn answered_from_view(base: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .filter(|l| l.starts_with("iota_work_polls_total{") && l.contains("answered_from=\"view\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls until the view answers one of `miner`'s polls.
async fn until_the_view_answers(base: &str, miner: &ApiClient, within: Duration) {
    let before = answered_from_view(base).await;
    eventually("a poll answered from the view", within, || async {
        let polled = miner.work(1).await.expect("poll");
        assert!(polled.items.is_empty(), "unexpected work: {polled:?}");
        (answered_from_view(base).await > before).then_some(())
    })
    .await;
}

/// A pending forward hop for `miner` at `stage`, written straight into the run state (as the
/// orchestrator does when the previous stage hands a sample on). Returns the task id.
async fn pending_task(db: &PgPool, run: &str, miner: &str, stage: u32) -> i64 {
    let (run_id, epoch, sample): (i64, i64, i64) = sqlx::query_as(
        "INSERT INTO samples (run_id, epoch, status)
         SELECT id, epoch, 'forward' FROM runs WHERE name = $1 RETURNING run_id, epoch, id",
    )
    .bind(run)
    .fetch_one(db)
    .await
    .expect("sample");
    sqlx::query_scalar(
        "INSERT INTO tasks (run_id, epoch, sample_id, stage, direction, miner, status)
         VALUES ($1, $2, $3, $4, 'forward', $5, 'pending') RETURNING id",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(sample)
    .bind(stage as i32)
    .bind(miner)
    .fetch_one(db)
    .await
    .expect("task")
}

/// Polls until `task` is leased to `miner`; panics after `within`.
async fn leased_within(miner: &ApiClient, task: i64, within: Duration) -> Duration {
    let started = Instant::now();
    eventually("the new task in a poll", within, || async {
        let polled = miner.work(1).await.expect("poll");
        polled.items.iter().any(|i| i.task_id == task).then_some(())
    })
    .await;
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_poll_view_answers_idle_polls_and_follows_the_database() {
    init_tracing();
    let chain = chain_with(&MINERS, &[]).await;
    let db_url = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let run = run_config("poll-view");
    let heartbeat = Duration::from_secs(run.heartbeat_timeout_s);
    let orch = start(config(&chain, &db_url, store.path(), run.clone())).await;
    let db = PgPool::connect(&db_url).await.expect("db");

    // A miner of a later stage: its idle polls never start samples, so the view may answer them.
    let mut later = None;
    for seed in MINERS {
        let (client, joined) = registered_miner(&orch.base, seed).await;
        if joined.stage > 0 {
            later = Some((client, joined.stage, public(&pair(seed)).ss58()));
        }
    }
    let (miner, stage, hotkey) = later.expect("a miner beyond stage 0");
    until_the_view_answers(&orch.base, &miner, Duration::from_secs(10)).await;

    // New work reaches the miner at once, and once it is done the view answers again. Three
    // rounds, each within a second: the view also reads everything every 10 s, which alone
    // would pass one such round in ten, and all three in a thousand.
    for round in 0..3 {
        let task = pending_task(&db, &run.name, &hotkey, stage).await;
        let took = leased_within(&miner, task, Duration::from_secs(1)).await;
        eprintln!("round {round}: leased after {took:?}");
        sqlx::query("UPDATE tasks SET status = 'done', completed_at = now() WHERE id = $1")
            .bind(task)
            .execute(&db)
            .await
            .expect("done");
        until_the_view_answers(&orch.base, &miner, Duration::from_secs(2)).await;
    }

    // Polls answered from memory keep their miner alive past the heartbeat timeout.
    let before = answered_from_view(&orch.base).await;
    let until = Instant::now() + heartbeat + Duration::from_secs(2);
    while Instant::now() < until {
        let polled = miner.work(1).await.expect("poll while idle");
        assert!(polled.items.is_empty());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let answered = answered_from_view(&orch.base).await - before;
    assert!(
        answered >= 10.0,
        "only {answered} polls answered from the view"
    );
    let status: String =
        sqlx::query_scalar("SELECT status FROM miners WHERE hotkey = $1 AND run_id = (SELECT id FROM runs WHERE name = $2)")
            .bind(&hotkey)
            .bind(&run.name)
            .fetch_one(&db)
            .await
            .expect("miner row");
    assert_eq!(status, "active", "a miner that kept polling was released");

    // A lost listener connection: the view stops answering, listens again, reads everything,
    // and follows the database as before.
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_all(&db)
    .await
    .expect("terminate the listener");
    assert_eq!(killed, vec![true], "exactly one listening connection");
    until_the_view_answers(&orch.base, &miner, Duration::from_secs(5)).await;
    let task = pending_task(&db, &run.name, &hotkey, stage).await;
    leased_within(&miner, task, Duration::from_secs(1)).await;

    db.close().await;
    orch.stop().await;
}
