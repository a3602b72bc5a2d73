//! The dashboard and the public explorer API after a real epoch: simulated miners train, upload
//! and merge through one epoch against a localnet and PostgreSQL; then every public route's answer
//! is checked against the OpenAPI document, headless Chromium renders the dashboard (asserted on
//! and screenshotted to `target/dashboard.png`), and the per-IP limit answers 429.
//!
//! Chromium is Debian's `chromium` package (`scripts/test.sh` installs it); `IOTA_CHROMIUM` names
//! another binary. Without it this test fails: it never skips.

use crate::common;

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use iota_orchestrator::Limits;
use iota_protocol::api::*;
use iota_protocol::{ApiClient, ErrorCode, RetryPolicy};
use iota_testkit::sim::SimMiner;
use serde_json::Value;

const MINERS: [u8; 6] = [1, 2, 3, 4, 5, 6];
const VALIDATOR: u8 = 10;

/// The dashboard's `short()`: long hotkeys as the first six and last four characters.
fn short(key: &str) -> String {
    let chars: Vec<char> = key.chars().collect();
    if chars.len() > 14 {
        let head: String = chars[..6].iter().collect();
        let tail: String = chars[chars.len() - 4..].iter().collect();
        format!("{head}…{tail}")
    } else {
        key.to_owned()
    }
}

// ---------- OpenAPI shape checks ----------

/// Checks `value` against `schema` (the subset of JSON Schema utoipa emits), resolving refs in
/// `doc`. Fields the document does not declare are errors too: the document must be complete.
fn check_schema(doc: &Value, schema: &Value, value: &Value, at: &str, errs: &mut Vec<String>) {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r.trim_start_matches("#/components/schemas/");
        match doc["components"]["schemas"].get(name) {
            Some(s) => check_schema(doc, s, value, at, errs),
            None => errs.push(format!("{at}: unknown schema {r}")),
        }
        return;
    }
    if let Some(all) = schema.get("allOf").and_then(Value::as_array) {
        for s in all {
            check_schema(doc, s, value, at, errs);
        }
    }
    for key in ["oneOf", "anyOf"] {
        if let Some(alts) = schema.get(key).and_then(Value::as_array) {
            let fits = alts.iter().any(|s| {
                let mut e = Vec::new();
                check_schema(doc, s, value, at, &mut e);
                e.is_empty()
            });
            if !fits {
                errs.push(format!("{at}: {value} matches no alternative of {key}"));
            }
        }
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        errs.push(format!("{at}: {value} is not one of {allowed:?}"));
    }
    if let Some(ty) = schema.get("type") {
        let types: Vec<&str> = match ty {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let fits = types.iter().any(|t| match *t {
            "null" => value.is_null(),
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "boolean" => value.is_boolean(),
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            _ => false,
        });
        if !fits {
            errs.push(format!("{at}: {value} is not of type {types:?}"));
            return;
        }
    }
    if let (Some(min), Some(v)) = (
        schema.get("minimum").and_then(Value::as_f64),
        value.as_f64(),
    ) && v < min
    {
        errs.push(format!("{at}: {v} is below the minimum {min}"));
    }
    if let Some(obj) = value.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        if let Some(required) = schema.get("required").and_then(Value::as_array) {
            for r in required.iter().filter_map(Value::as_str) {
                if !obj.contains_key(r) {
                    errs.push(format!("{at}: required field {r} is missing"));
                }
            }
        }
        for (k, v) in obj {
            match props.and_then(|p| p.get(k)) {
                Some(s) => check_schema(doc, s, v, &format!("{at}.{k}"), errs),
                None => match schema.get("additionalProperties") {
                    Some(Value::Object(s)) => {
                        let s = Value::Object(s.clone());
                        check_schema(doc, &s, v, &format!("{at}.{k}"), errs)
                    }
                    Some(Value::Bool(true)) => {}
                    _ if props.is_some() => errs.push(format!("{at}: undocumented field {k}")),
                    _ => {}
                },
            }
        }
    }
    if let (Some(items), Some(values)) = (schema.get("items"), value.as_array()) {
        for (i, v) in values.iter().enumerate() {
            check_schema(doc, items, v, &format!("{at}[{i}]"), errs);
        }
    }
}

/// GETs `path` (an instance of `template`) and checks status and body against the document's
/// response for that status. Returns the body.
async fn get_documented(
    http: &reqwest::Client,
    base: &str,
    doc: &Value,
    template: &str,
    path: &str,
    want_status: u16,
) -> Value {
    let resp = http
        .get(format!("{base}{path}"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = resp.status().as_u16();
    let body: Value = resp
        .json()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: body is not JSON: {e}"));
    assert_eq!(status, want_status, "GET {path}: {body}");
    let op = &doc["paths"][template]["get"];
    assert!(op.is_object(), "{template} is not documented");
    let schema = &op["responses"][status.to_string()]["content"]["application/json"]["schema"];
    assert!(
        schema.is_object(),
        "GET {template}: no documented JSON body for status {status}"
    );
    let mut errs = Vec::new();
    check_schema(doc, schema, &body, path, &mut errs);
    assert!(
        errs.is_empty(),
        "GET {path} does not match its documented shape:\n{}",
        errs.join("\n")
    );
    body
}

#[test]
fn shape_checker_rejects_what_the_document_does_not_allow() {
    let doc: Value = serde_json::from_str(&iota_orchestrator::openapi_json()).expect("doc");
    let schema = serde_json::json!({ "$ref": "#/components/schemas/LossPoint" });
    let good = serde_json::json!({ "epoch": 0, "samples": 3, "mean_loss": 2.5 });
    let mut errs = Vec::new();
    check_schema(&doc, &schema, &good, "good", &mut errs);
    assert!(errs.is_empty(), "{errs:?}");
    for bad in [
        serde_json::json!({ "epoch": 0, "samples": 3 }),
        serde_json::json!({ "epoch": "0", "samples": 3, "mean_loss": 2.5 }),
        serde_json::json!({ "epoch": 0, "samples": 3, "mean_loss": 2.5, "extra": 1 }),
        serde_json::json!({ "epoch": -1, "samples": 3, "mean_loss": 2.5 }),
    ] {
        let mut errs = Vec::new();
        check_schema(&doc, &schema, &bad, "bad", &mut errs);
        assert!(!errs.is_empty(), "{bad} passed");
    }
}

// ---------- headless Chromium ----------

fn chromium_binary() -> PathBuf {
    let path = std::env::var_os("IOTA_CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    assert!(
        path.is_file(),
        "headless Chromium not found at {} (set IOTA_CHROMIUM to another binary). Run the tests \
         through scripts/test.sh, which installs Debian's `chromium` package \
         (apt-get install -y chromium).",
        path.display()
    );
    path
}

/// Runs headless Chromium on `url` with `extra` flags; returns stdout.
async fn chromium(url: &str, extra: &[String]) -> String {
    let profile = tempfile::tempdir().expect("profile dir");
    let mut cmd = tokio::process::Command::new(chromium_binary());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        // Let fetches finish and JS run before dumping or capturing.
        "--virtual-time-budget=6000",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .args(extra)
    .arg(url)
    .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("chromium did not finish within 120 s")
        .expect("start chromium");
    assert!(
        out.status.success(),
        "chromium failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("chromium output is UTF-8")
}

/// The inner HTML of the first element whose start tag contains `marker` (no nesting of the same
/// tag inside, which holds for the page's tables and spans).
fn element<'a>(dom: &'a str, tag: &str, marker: &str) -> &'a str {
    let open = format!("<{tag} ");
    let start = dom
        .match_indices(&open)
        .map(|(i, _)| i)
        .find(|&i| {
            dom[i..]
                .split('>')
                .next()
                .is_some_and(|t| t.contains(marker))
        })
        .unwrap_or_else(|| panic!("no <{tag} {marker}> in the rendered page"));
    let inner = start + dom[start..].find('>').expect("tag end") + 1;
    let end = inner
        + dom[inner..]
            .find(&format!("</{tag}>"))
            .expect("closing tag");
    &dom[inner..end]
}

/// Text cells of a table's body rows.
fn table_rows(dom: &str, id: &str) -> Vec<Vec<String>> {
    let table = element(dom, "table", &format!("id=\"{id}\""));
    let body = table.split("<tbody>").nth(1).expect("tbody");
    body.split("<tr>")
        .skip(1)
        .map(|row| {
            row.split("<td")
                .skip(1)
                .map(|cell| {
                    let text = &cell[cell.find('>').expect("td end") + 1..];
                    text[..text.find("</td>").expect("td close")].to_owned()
                })
                .collect()
        })
        .collect()
}

fn workspace_target_dir() -> PathBuf {
    // target/tmp is Cargo's scratch directory for integration tests; its parent is target/.
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target dir")
        .to_path_buf()
}

/// `GET /v1/loss`.
async fn loss_curve(http: &reqwest::Client, base: &str) -> Vec<LossPoint> {
    http.get(format!("{base}/v1/loss"))
        .send()
        .await
        .expect("loss")
        .json()
        .await
        .expect("loss json")
}

/// Rows that the plan's nodes on `relation` read (kept or removed by a filter, times loops),
/// over the whole plan tree of an `EXPLAIN (ANALYZE, FORMAT JSON)`.
/// The executed plan of `sql` (one parameter: the run) with sequential scans off: a table this
/// small may be scanned whole by whichever statement (a fresh machine's planner did so once),
/// and with them off the plan reads what the statement's conditions allow, which is what the
/// tests look at.
async fn plan_of(pool: &sqlx::PgPool, sql: &str, binds: &[i64]) -> Value {
    let mut conn = pool.acquire().await.expect("connection");
    sqlx::query("SET enable_seqscan = off")
        .execute(&mut *conn)
        .await
        .expect("planner setting");
    let mut query = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) {sql}"
    )));
    for &value in binds {
        query = query.bind(value);
    }
    let plan = query.fetch_one(&mut *conn).await.expect("plan");
    // Closed, not returned to the pool with the setting.
    let _ = conn.close().await;
    plan
}

fn rows_read(plan: &Value, relation: &str) -> f64 {
    match plan {
        Value::Array(items) => items.iter().map(|v| rows_read(v, relation)).sum(),
        Value::Object(map) => {
            let own = if map.get("Relation Name").and_then(Value::as_str) == Some(relation) {
                let get = |k: &str| map.get(k).and_then(Value::as_f64).unwrap_or(0.0);
                let loops = map
                    .get("Actual Loops")
                    .and_then(Value::as_f64)
                    .unwrap_or(1.0);
                (get("Actual Rows") + get("Rows Removed by Filter")) * loops
            } else {
                0.0
            };
            own + map.values().map(|v| rows_read(v, relation)).sum::<f64>()
        }
        _ => 0.0,
    }
}

// ---------- the test ----------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dashboard_and_explorer_api_show_a_finished_epoch() {
    init_tracing();
    chromium_binary(); // fail fast, before the chain starts
    let chain = chain_with(&MINERS, &[VALIDATOR]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("dashboard");
    // Phases end by quorum here; the deadlines only bound a stuck test, and must outlast the
    // rendering so the page and the API agree on where the run is.
    run.training_s = 90;
    run.uploading_s = 30;
    run.merging_s = 30;
    run.merge_round_s = 15;
    run.lease_s = 10;
    run.heartbeat_timeout_s = 120;
    let orch = start(config(&chain, &db, store.path(), run.clone())).await;
    let base = orch.base.clone();

    let mut miners = Vec::new();
    for (i, seed) in MINERS.iter().enumerate() {
        let m = SimMiner::join(
            &base,
            signer(*seed),
            100.0 + 10.0 * i as f64,
            u64::from(*seed),
        )
        .await
        .expect("sim miner joins");
        miners.push(m);
    }
    let hotkeys: Vec<String> = miners.iter().map(|m| m.client().hotkey()).collect();
    let stages: std::collections::BTreeSet<u32> = miners.iter().map(|m| m.stage).collect();
    assert_eq!(stages.len(), run.stages as usize, "every stage has a miner");

    // Step the miners until epoch 0 has merged and epoch 1 has some losses, then stop so the
    // run rests in epoch 1's training phase while it is rendered.
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    let mut step_errors = Vec::new();
    loop {
        let results =
            futures::future::join_all(miners.iter_mut().map(|m| async move { m.step().await }))
                .await;
        step_errors.extend(
            results
                .into_iter()
                .filter_map(Result::err)
                .map(|e| e.to_string()),
        );
        assert!(
            step_errors.len() < 10,
            "simulated miners keep failing: {step_errors:?}"
        );
        let loss = loss_curve(&http, &base).await;
        if loss.iter().any(|p| p.epoch >= 1) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "epoch 1 saw no loss within 180 s; losses so far {loss:?}"
        );
    }

    // `GET /v1/loss` is the mean of each epoch's sample losses (epoch 0's stored when it ended,
    // epoch 1's live), and reads only the running epoch's samples: before, every request
    // aggregated every sample of the run.
    let pool = sqlx::PgPool::connect(&db).await.expect("db");
    let run_id: i64 = sqlx::query_scalar("SELECT id FROM runs")
        .fetch_one(&pool)
        .await
        .expect("run");
    let direct: Vec<(i64, i64, f64)> = sqlx::query_as(
        "SELECT epoch, count(loss), avg(loss) FROM samples
         WHERE run_id = $1 AND loss IS NOT NULL GROUP BY epoch ORDER BY epoch",
    )
    .bind(run_id)
    .fetch_all(&pool)
    .await
    .expect("losses");
    let served = loss_curve(&http, &base).await;
    assert_eq!(served.len(), direct.len(), "{served:?} against {direct:?}");
    for (p, (epoch, n, mean)) in served.iter().zip(&direct) {
        assert_eq!(
            (p.epoch, p.samples),
            (*epoch as u64, *n as u64),
            "{served:?}"
        );
        assert!(
            (p.mean_loss - mean).abs() < 1e-9,
            "{served:?} against {direct:?}"
        );
    }
    assert!(
        direct.iter().any(|d| d.0 == 0),
        "epoch 0 has losses: {direct:?}"
    );
    // The route's own statement, constant text.
    let plan = plan_of(
        &pool,
        iota_orchestrator::db::views::LOSS_SQL,
        &[run_id, i64::MAX, 1000],
    )
    .await;
    let read = rows_read(&plan, "samples");
    let running: i64 = sqlx::query_scalar("SELECT count(*) FROM samples WHERE epoch = 1")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert!(
        read <= running as f64,
        "read {read} sample rows for the loss curve; the running epoch has {running}: {plan}"
    );

    // A validator's scores, so the scores table has rows.
    let validator = ApiClient::connect(&base, signer(VALIDATOR), RetryPolicy::default())
        .await
        .expect("validator client");
    let submission = ScoreSubmission {
        scores: hotkeys
            .iter()
            .enumerate()
            .map(|(i, h)| MinerScore {
                hotkey: h.clone(),
                score: 0.1 * (i + 1) as f64,
                ..MinerScore::default()
            })
            .collect(),
        weights: None,
        params: None,
    };
    validator
        .submit_scores(0, &submission)
        .await
        .expect("submit scores");

    // ----- the explorer API answers in its documented shapes -----
    let doc_text = http
        .get(format!("{base}/openapi.json"))
        .send()
        .await
        .expect("openapi")
        .text()
        .await
        .expect("openapi text");
    assert_eq!(
        doc_text,
        iota_orchestrator::openapi_json(),
        "served /openapi.json differs from openapi_json()"
    );
    let doc: Value = serde_json::from_str(&doc_text).expect("document JSON");
    let get = |template: &'static str, path: String, status: u16| {
        let (http, base, doc) = (&http, &base, &doc);
        async move { get_documented(http, base, doc, template, &path, status).await }
    };

    let run_info: RunInfo =
        serde_json::from_value(get("/v1/run", "/v1/run".into(), 200).await).expect("RunInfo");
    assert_eq!(run_info.config, run);
    assert_eq!(run_info.netuid, chain.netuid);
    let status: EpochStatus =
        serde_json::from_value(get("/v1/status", "/v1/status".into(), 200).await)
            .expect("EpochStatus");
    assert_eq!((status.epoch, status.phase), (1, Phase::Training));
    assert!(status.phase_deadline_ms > status.phase_started_ms);
    let stage_infos: Vec<StageInfo> =
        serde_json::from_value(get("/v1/stages", "/v1/stages".into(), 200).await).expect("stages");
    assert_eq!(stage_infos.len(), run.stages as usize);
    assert_eq!(
        stage_infos.iter().map(|s| s.active_miners).sum::<u32>(),
        MINERS.len() as u32
    );
    let miner_infos: Vec<MinerInfo> =
        serde_json::from_value(get("/v1/miners", "/v1/miners".into(), 200).await).expect("miners");
    let mut listed: Vec<&str> = miner_infos.iter().map(|m| m.hotkey.as_str()).collect();
    let mut joined: Vec<&str> = hotkeys.iter().map(String::as_str).collect();
    listed.sort_unstable();
    joined.sort_unstable();
    assert_eq!(listed, joined);
    assert!(miner_infos.iter().all(|m| m.status == "active"));
    // Throughput as measured from each miner's completed hops, beside the one it claimed.
    for m in &miner_infos {
        let measured = m
            .measured_tokens_per_s
            .unwrap_or_else(|| panic!("{}: no measured throughput after its hops", m.hotkey));
        assert!(measured.is_finite() && measured > 0.0, "{m:?}");
    }
    let loss: Vec<LossPoint> =
        serde_json::from_value(get("/v1/loss", "/v1/loss".into(), 200).await).expect("loss");
    assert_eq!(
        loss.iter().map(|p| p.epoch).collect::<Vec<_>>(),
        vec![0, 1],
        "{loss:?}"
    );
    assert_eq!(loss[0].samples, run.samples_per_epoch);
    assert!(loss.iter().all(|p| (2.0..3.0).contains(&p.mean_loss)));
    let throughput: Vec<ThroughputPoint> =
        serde_json::from_value(get("/v1/throughput", "/v1/throughput".into(), 200).await)
            .expect("throughput");
    assert_eq!(throughput[0].samples, run.samples_per_epoch);
    assert_eq!(
        throughput[0].tokens,
        run.samples_per_epoch * u64::from(run.micro_batch) * u64::from(run.seq_len)
    );
    assert!(throughput[0].wire_bytes > 0);

    // Paging: the series give the latest epochs first (`limit`), then those `before` a page's
    // first; the miners come by hotkey, after a page's last.
    let epochs_of = |v: Value| -> Vec<u64> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|p| p["epoch"].as_u64().expect("epoch"))
            .collect()
    };
    for (template, route) in [("/v1/loss", "loss"), ("/v1/throughput", "throughput")] {
        let all = epochs_of(get(template, template.into(), 200).await);
        assert_eq!(&all[..2], &[0, 1], "{route}: {all:?}");
        let latest = epochs_of(get(template, format!("{template}?limit=1"), 200).await);
        assert_eq!(latest, vec![*all.last().expect("an epoch")], "{route}");
        let before = epochs_of(get(template, format!("{template}?before=1&limit=5"), 200).await);
        assert_eq!(before, vec![0], "{route}");
        get(template, format!("{template}?limit=lots"), 400).await;
    }
    let mut by_hotkey = joined.clone();
    by_hotkey.sort_unstable();
    let mut paged = Vec::new();
    let mut after = String::new();
    loop {
        let query = if after.is_empty() {
            "/v1/miners?limit=2".to_owned()
        } else {
            format!("/v1/miners?limit=2&after={after}")
        };
        let page: Vec<MinerInfo> =
            serde_json::from_value(get("/v1/miners", query, 200).await).expect("miners page");
        assert!(page.len() <= 2);
        let Some(last) = page.last() else { break };
        after = last.hotkey.clone();
        paged.extend(page.into_iter().map(|m| m.hotkey));
    }
    assert_eq!(paged, by_hotkey, "pages of two, in hotkey order");
    let released: Vec<MinerInfo> =
        serde_json::from_value(get("/v1/miners", "/v1/miners?status=released".into(), 200).await)
            .expect("released");
    assert!(released.is_empty(), "{released:?}");
    get("/v1/miners", "/v1/miners?status=gone".into(), 400).await;
    get("/v1/samples/{id}", "/v1/samples/first".into(), 400).await;
    get(
        "/v1/epochs/{epoch}/merges",
        "/v1/epochs/last/merges".into(),
        400,
    )
    .await;

    // Every integer parameter of the explorer's routes takes what the document declares and
    // refuses (with a 400 the document lists) one past it.
    let mut bounded = 0;
    for (template, item) in doc["paths"].as_object().expect("paths") {
        let op = &item["get"];
        if !op.is_object() || op.get("security").is_some() {
            continue;
        }
        let params = op["parameters"].as_array().cloned().unwrap_or_default();
        for p in &params {
            let schema = &p["schema"];
            if schema["type"] != "integer" {
                continue;
            }
            let name = p["name"].as_str().expect("name");
            let url = |value: &str| {
                let mut path = template.clone();
                for q in &params {
                    let n = q["name"].as_str().expect("name");
                    if q["in"] == "path" {
                        let v = if n == name { value } else { "0" };
                        path = path.replace(&format!("{{{n}}}"), v);
                    }
                }
                if p["in"] == "query" {
                    path = format!("{path}?{name}={value}");
                }
                path
            };
            let template: &'static str = template.clone().leak();
            // Without a declared bound, the format's.
            let (low, high) = match schema["format"].as_str() {
                Some("int32") => (i128::from(i32::MIN), i128::from(i32::MAX)),
                _ => (i128::from(i64::MIN), i128::from(i64::MAX)),
            };
            let min = schema["minimum"].as_i64().map_or(low, i128::from);
            let max = schema["maximum"].as_u64().map_or(high, i128::from);
            get(template, url(&(max + 1).to_string()), 400).await;
            get(template, url(&(min - 1).to_string()), 400).await;
            let at = http
                .get(format!("{base}{}", url(&max.to_string())))
                .send()
                .await
                .expect("request")
                .status()
                .as_u16();
            assert!(
                at != 400 && op["responses"].get(at.to_string()).is_some(),
                "{template}: {name}={max} (the declared maximum) answered {at}"
            );
            bounded += 1;
        }
    }
    assert!(bounded >= 6, "only {bounded} bounded parameters checked");
    let merges: Vec<PartitionStatus> = serde_json::from_value(
        get(
            "/v1/epochs/{epoch}/merges",
            "/v1/epochs/0/merges".into(),
            200,
        )
        .await,
    )
    .expect("merges");
    assert_eq!(merges.len(), (run.stages * run.partitions) as usize);
    assert!(
        merges.iter().all(|p| p.state == PartitionState::Accepted
            && p.accepted.is_some()
            && p.owners.len() >= 2),
        "every partition of epoch 0 merged by agreeing owners: {merges:?}"
    );
    let scores: Vec<ScoreRecord> =
        serde_json::from_value(get("/v1/scores", "/v1/scores".into(), 200).await).expect("scores");
    assert_eq!(scores.len(), 1);
    assert_eq!(scores[0].scores, submission.scores);
    for stage in 0..run.stages {
        let w: StageWeights = serde_json::from_value(
            get(
                "/v1/stages/{stage}/weights",
                format!("/v1/stages/{stage}/weights"),
                200,
            )
            .await,
        )
        .expect("weights");
        assert_eq!(w.epoch, Some(0));
        assert!(w.partitions.iter().all(Option::is_some), "{w:?}");
    }
    let samples = validator.samples(0, 0, 100).await.expect("samples").samples;
    assert_eq!(samples.len() as u64, run.samples_per_epoch);
    let sample: SampleRecord = serde_json::from_value(
        get(
            "/v1/samples/{id}",
            format!("/v1/samples/{}", samples[0].sample_id),
            200,
        )
        .await,
    )
    .expect("sample");
    assert_eq!(sample.pathway.len(), run.stages as usize);
    assert!(sample.pathway.iter().all(|h| hotkeys.contains(h)));
    let missing = get("/v1/samples/{id}", format!("/v1/samples/{}", i64::MAX), 404).await;
    assert_eq!(missing["code"], "not_found");
    get(
        "/v1/stages/{stage}/weights",
        "/v1/stages/99/weights".into(),
        404,
    )
    .await;

    // ----- the dashboard, rendered by headless Chromium -----
    let page_url = format!("{base}/dashboard");
    let dom = chromium(&page_url, &["--dump-dom".into()]).await;
    let after: EpochStatus = http
        .get(format!("{base}/v1/status"))
        .send()
        .await
        .expect("status")
        .json()
        .await
        .expect("status json");
    assert_eq!(
        (after.epoch, after.phase),
        (status.epoch, status.phase),
        "the run moved while the page rendered"
    );
    assert_eq!(
        element(&dom, "div", "id=\"error\""),
        "",
        "the page shows an error"
    );
    assert!(
        dom.contains("<body data-loaded=\"true\">"),
        "the page's refresh did not complete"
    );
    assert_eq!(
        element(&dom, "span", "id=\"run-name\""),
        format!("dashboard · sim · netuid {}", chain.netuid)
    );
    assert_eq!(element(&dom, "b", "id=\"epoch\""), "1");
    assert_eq!(element(&dom, "span", "id=\"phase\""), "training");
    let samples_text = element(&dom, "b", "id=\"samples\"");
    assert!(
        samples_text.ends_with(&format!(" / {}", run.samples_per_epoch)),
        "{samples_text}"
    );
    assert_eq!(
        element(&dom, "b", "id=\"samples-started\""),
        status.samples_started.to_string()
    );
    let deadline_text = element(&dom, "b", "id=\"deadline\"");
    assert!(
        deadline_text.ends_with(" s") && deadline_text != "– s",
        "deadline countdown: {deadline_text}"
    );

    // Miners: one row per miner, hotkeys abbreviated as the page does, stages as assigned.
    let miner_rows = table_rows(&dom, "miners");
    assert_eq!(miner_rows.len(), MINERS.len(), "{miner_rows:?}");
    for m in &miners {
        let key = short(&m.client().hotkey());
        let row = miner_rows
            .iter()
            .find(|r| r.get(1) == Some(&key))
            .unwrap_or_else(|| panic!("miner {key} not in the table: {miner_rows:?}"));
        assert_eq!(row[2], m.stage.to_string());
        assert_eq!(row[3], "active");
        // Measured throughput, then the claimed one.
        let info = miner_infos
            .iter()
            .find(|i| i.hotkey == m.client().hotkey())
            .expect("listed");
        let shown = |i: usize| row[i].parse::<f64>().unwrap_or(f64::NAN);
        let measured = info.measured_tokens_per_s.expect("measured");
        assert!((shown(5) - measured).abs() <= 1.0, "{row:?} vs {info:?}");
        assert!(
            (shown(6) - info.capacity.tokens_per_s).abs() <= 1.0,
            "{row:?}"
        );
    }
    let stage_rows = table_rows(&dom, "stages");
    assert_eq!(stage_rows.len(), run.stages as usize);
    assert_eq!(
        stage_rows
            .iter()
            .map(|r| r[2].parse::<u32>().expect("miner count"))
            .sum::<u32>(),
        MINERS.len() as u32
    );

    // Loss chart: a line through one point per epoch with losses.
    let chart = element(&dom, "svg", "id=\"loss-chart\"");
    let line = chart
        .split("<polyline")
        .nth(1)
        .expect("the loss chart has a polyline");
    let points = line
        .split("points=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .expect("polyline points");
    let coords: Vec<(f64, f64)> = points
        .split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').expect("x,y");
            (x.parse().expect("x"), y.parse().expect("y"))
        })
        .collect();
    assert_eq!(coords.len(), loss.len(), "{points}");
    assert!(
        coords
            .iter()
            .all(|(x, y)| (0.0..=480.0).contains(x) && (0.0..=220.0).contains(y)),
        "points inside the chart: {coords:?}"
    );
    assert!(coords[0].0 < coords[1].0, "epochs run left to right");
    assert_eq!(chart.matches("class=\"loss-point\"").count(), loss.len());
    assert!(chart.contains(">epoch 0</text>") && chart.contains(">epoch 1</text>"));

    // Merge status of the finished epoch: every partition, in the API's states.
    assert_eq!(element(&dom, "span", "id=\"merge-epoch\""), "0");
    assert_eq!(
        element(&dom, "p", "id=\"merge-summary\""),
        format!("{n} partitions: {n} accepted", n = merges.len())
    );
    let merge_rows = table_rows(&dom, "merges");
    assert_eq!(merge_rows.len(), merges.len(), "{merge_rows:?}");
    for (row, p) in merge_rows.iter().zip(&merges) {
        assert_eq!(row[0], p.stage.to_string());
        assert_eq!(row[1], p.partition.to_string());
        assert_eq!(row[2], p.state.as_str());
        let owners: Vec<String> = p.owners.iter().map(|o| short(o)).collect();
        assert_eq!(row[3], owners.join(", "));
    }
    assert!(
        element(&dom, "table", "id=\"merges\"").contains("class=\"state-accepted\""),
        "accepted partitions are styled"
    );

    // Scores: one row per scored miner.
    let score_rows = table_rows(&dom, "scores");
    assert_eq!(score_rows.len(), submission.scores.len());
    for (row, s) in score_rows.iter().zip(&submission.scores) {
        assert_eq!(row[0], short(&validator.hotkey()));
        assert_eq!(row[1], "0");
        assert_eq!(row[2], short(&s.hotkey));
        assert_eq!(row[3], format!("{:.4}", s.score));
    }

    // A screenshot for people to look at.
    let shot = workspace_target_dir().join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    chromium(
        &page_url,
        &[
            format!("--screenshot={}", shot.display()),
            "--window-size=1400,1000".into(),
        ],
    )
    .await;
    let png = std::fs::read(&shot).expect("chromium wrote the screenshot");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(png.len() > 10_000, "screenshot is suspiciously small");
    eprintln!("dashboard screenshot: {}", shot.display());

    // ----- per-IP limit on public routes -----
    // A second orchestrator on the same database with a tiny per-IP budget.
    let mut strict = config(&chain, &db, store.path(), run.clone());
    strict.limits = Limits {
        per_ip_rps: 1,
        per_ip_burst: 3,
        ..strict.limits
    };
    let limited = start(strict).await;
    let mut statuses = Vec::new();
    let mut limited_resp = None;
    for _ in 0..10 {
        let r = http
            .get(format!("{}/v1/status", limited.base))
            .send()
            .await
            .expect("status");
        statuses.push(r.status().as_u16());
        if r.status() == reqwest::StatusCode::TOO_MANY_REQUESTS && limited_resp.is_none() {
            limited_resp = Some(r);
        }
    }
    assert_eq!(statuses[0], 200, "{statuses:?}");
    assert!(
        statuses.iter().filter(|s| **s == 200).count() <= 4,
        "the per-IP burst of 3 was not enforced: {statuses:?}"
    );
    let resp = limited_resp.unwrap_or_else(|| panic!("no 429 among {statuses:?}"));
    let retry_after: u64 = resp
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .expect("429 carries Retry-After")
        .to_str()
        .expect("ascii")
        .parse()
        .expect("Retry-After in seconds");
    assert!(retry_after >= 1);
    let body: iota_protocol::ApiError = resp.json().await.expect("error body");
    assert_eq!(body.code, ErrorCode::RateLimited);
    // Another address is not affected (all of 127.0.0.0/8 is loopback on Linux).
    let other_ip = reqwest::Client::builder()
        .local_address(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)))
        .build()
        .expect("client");
    let r = other_ip
        .get(format!("{}/v1/status", limited.base))
        .send()
        .await
        .expect("status from 127.0.0.2");
    assert_eq!(r.status(), 200, "the limit is per address");
    // And the first address recovers once Retry-After has passed.
    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    let r = http
        .get(format!("{}/v1/status", limited.base))
        .send()
        .await
        .expect("status");
    assert_eq!(r.status(), 200, "the limit refills");

    limited.stop().await;
    orch.stop().await;
}

/// `GET /v1/scores` reads one submission per validator (its latest), however many epochs they
/// scored: it once read and sorted every submission of the run on every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latest_scores_read_one_row_per_validator() {
    init_tracing();
    let db = fresh_db().await;
    let pool = iota_orchestrator::connect_db(&db, 4).await.expect("db");
    let hotkey = iota_protocol::signing::RequestSigner::ss58(&pair(200));
    let run =
        iota_orchestrator::ensure_run(&pool, &run_config("scores"), 7, &hotkey, chrono::Utc::now())
            .await
            .expect("run");
    const VALIDATORS: i64 = 8;
    const EPOCHS: i64 = 60;
    // Validator v scored epochs 0..EPOCHS - v; its latest is EPOCHS - v - 1.
    sqlx::query(
        "INSERT INTO validator_scores (run_id, epoch, validator, scores)
         SELECT $1, e, 'validator-' || v, jsonb_build_array(e)
         FROM generate_series(0, $2 - 1) v, generate_series(0, $3 - 1) e WHERE e < $3 - v",
    )
    .bind(run.id)
    .bind(VALIDATORS)
    .bind(EPOCHS)
    .execute(&pool)
    .await
    .expect("scores");
    sqlx::query("ANALYZE validator_scores")
        .execute(&pool)
        .await
        .expect("analyze");
    let latest: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT validator, epoch FROM ({}) t",
        iota_orchestrator::db::views::SCORES_SQL
    )))
    .bind(run.id)
    .fetch_all(&pool)
    .await
    .expect("latest");
    let expected: Vec<(String, i64)> = (0..VALIDATORS)
        .map(|v| (format!("validator-{v}"), EPOCHS - v - 1))
        .collect();
    assert_eq!(latest, expected);
    let plan = plan_of(&pool, iota_orchestrator::db::views::SCORES_SQL, &[run.id]).await;
    let read = rows_read(&plan, "validator_scores");
    assert!(
        read <= (3 * VALIDATORS) as f64,
        "read {read} score rows for {VALIDATORS} validators: {plan}"
    );
}
