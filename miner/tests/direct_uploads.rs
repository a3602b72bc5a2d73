//! On an S3-compatible store the miners upload straight to the bucket: every activation,
//! gradient, pseudo-gradient and merge goes up through a presigned URL and is checked by the
//! orchestrator at its commit, and none passes through the orchestrator's own upload routes.
//! Needs `DATABASE_URL` and `IOTA_TEST_S3_ENDPOINT` (scripts/test.sh starts both).

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use iota_miner::spawn;
use support::*;

/// Requests the orchestrator counted, by `(method, route)`, summed over statuses of `status`.
async fn requests(base: &str, status: &str) -> BTreeMap<(String, String), f64> {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("iota_http_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        if label("status") != status {
            continue;
        }
        *out.entry((label("method"), label("route"))).or_default() +=
            value.trim().parse::<f64>().unwrap_or(0.0);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn miners_upload_straight_to_the_bucket() {
    init_tracing();
    let seeds = [51u8, 52, 53, 54, 55, 56];
    let chain = chain_with(&seeds, &[]).await;
    let db = fresh_db().await;
    // Keys in the shared bucket start with the run's id: one of this test's own, not the 1
    // every fresh database gives.
    let pool = iota_orchestrator::connect_db(&db, 2).await.expect("db");
    sqlx::query("SELECT setval(pg_get_serial_sequence('runs', 'id'), $1)")
        .bind(51_000_000 + i64::from(std::process::id() % 1_000_000))
        .execute(&pool)
        .await
        .expect("run id");
    let unused = tempfile::tempdir().expect("dir");
    let run = tiny_run("direct-uploads", 24);
    let mut cfg = config(&chain, &db, unused.path(), run.clone());
    cfg.store = s3_store();
    let orch = start(cfg).await;
    let client = explorer(&orch.base, seeds[0]).await;
    assert!(client.direct_uploads(), "the run says its store presigns");

    let miners: Vec<_> = seeds
        .iter()
        .map(|s| {
            let mut cfg = miner_config(&orch.base);
            cfg.seed = u64::from(*s);
            cfg.tokens_per_s = Some(1000.0);
            spawn(cfg, signer(*s))
        })
        .collect();
    wait_epoch(&client, 1, Duration::from_secs(240)).await;
    assert_all_agreed(&client, &run, 0).await;

    let ok = requests(&orch.base, "200").await;
    let count = |method: &str, route: &str| {
        ok.get(&(method.to_owned(), route.to_owned()))
            .copied()
            .unwrap_or(0.0)
    };
    for slot in [
        "/v1/miner/tasks/{task_id}/output",
        "/v1/miner/epochs/{epoch}/pseudo-gradients/{partition}",
        "/v1/miner/epochs/{epoch}/merges/{stage}/{partition}",
    ] {
        let (presigned, committed) = (
            count("POST", &format!("{slot}/presign")),
            count("POST", &format!("{slot}/commit")),
        );
        eprintln!("{slot}: {presigned} presigned, {committed} committed");
        assert!(committed >= 1.0, "nothing committed to {slot}: {ok:?}");
        assert!(presigned >= committed, "{slot}: {ok:?}");
        assert_eq!(
            count("PUT", slot),
            0.0,
            "an upload went through the orchestrator: {ok:?}"
        );
    }
    for m in miners {
        let _ = m.stop().await;
    }
    orch.stop().await;
}
