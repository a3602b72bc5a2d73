//! One upload/download scenario, run against a local directory and against an S3-compatible
//! store (`scripts/s3.sh` starts moto; `scripts/test.sh` exports `IOTA_TEST_S3_ENDPOINT`, and the
//! test fails without it):
//! direct uploads through the orchestrator, presigned uploads with their commit checks, downloads
//! through presigned URLs or the orchestrator, refused uploads that leave nothing in the store,
//! and the retention of old epochs' objects.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use iota_orchestrator::{BlobStore, StoreConfig};
use iota_protocol::api::*;
use iota_protocol::blob::blake3_hex;
use iota_protocol::tensor::encode_boundary_f32;
use iota_protocol::{ApiClient, ClientError, ErrorCode};
use reqwest::Method;

const MINERS: [u8; 3] = [1, 2, 3];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_directory_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    upload_download_scenario(StoreConfig::Local(dir.path().into())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_with_presigned_urls() {
    let store = s3_store();
    upload_download_scenario(store.clone()).await;
    // After the scenario, not beside it: both use the one bucket, and the scenario checks all
    // that is in it.
    a_late_copy_of_an_upload_keeps_the_hops_output(store).await;
}

fn err_code<T: std::fmt::Debug>(r: Result<T, ClientError>) -> Option<ErrorCode> {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.code(),
    }
}

async fn keys(store: &BlobStore, prefix: &str) -> Vec<String> {
    let mut k = store.list(prefix).await.expect("list store");
    k.sort();
    k
}

fn tensor(run: &RunConfig, fill: f32) -> Vec<u8> {
    let shape = run.boundary_shape();
    encode_boundary_f32(shape, &vec![fill; shape.iter().product::<u64>() as usize])
}

async fn upload_download_scenario(store: StoreConfig) {
    init_tracing();
    let presigned = matches!(store, StoreConfig::S3 { .. });
    let chain = chain_with(&MINERS, &[]).await;
    let db = fresh_db().await;
    let unused = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("storage");
    run.samples_per_epoch = 4;
    // Room for the hop-by-hop part below (about a second); epoch 0 then waits this out, since the
    // simulated miners that take over restart the same hotkeys and sit out the rest of it.
    run.training_s = 15;
    run.uploading_s = 3;
    run.merging_s = 3;
    run.merge_round_s = 1;
    run.lease_s = 60;
    run.heartbeat_timeout_s = 60;
    run.retention_epochs = 2;
    let mut config = config(&chain, &db, unused.path(), run.clone());
    config.store = store.clone();
    config.tick = Duration::from_millis(50);
    config.max_merge_rounds = 1;

    // The test's own handle on the same store, to see what is (and is not) in it. The bucket is
    // reused between runs of this test: start from an empty one.
    let blobs = BlobStore::open(&store).expect("open store");
    blobs.delete_prefix("runs").await.expect("empty the store");
    let orch = start(config).await;
    let http = reqwest::Client::new();

    let mut by_stage: Vec<Option<ApiClient>> = vec![None, None, None];
    for seed in MINERS {
        let (client, joined) = registered_miner(&orch.base, seed).await;
        by_stage[joined.stage as usize] = Some(client);
    }
    let stages: [Option<ApiClient>; 3] = by_stage.try_into().unwrap_or_else(|_| unreachable!());
    let [Some(s0), Some(s1), Some(s2)] = stages else {
        panic!("three miners should spread over the three stages");
    };
    let run_id = s0.public_get::<RunInfo>("/v1/run").await.expect("run").id;
    let all = || keys(&blobs, "runs");

    // A sample starts at stage 0.
    let item = s0
        .work(1)
        .await
        .expect("work")
        .items
        .pop()
        .expect("a sample");
    assert_eq!((item.stage, item.direction), (0, Direction::Forward));
    let output_path = |what: &str, blake3: &str| {
        format!(
            "/v1/miner/tasks/{}/output{what}?lease={}&blake3={blake3}",
            item.task_id, item.lease
        )
    };

    // Bad direct uploads are refused and leave nothing in the store.
    let before = all().await;
    let good = tensor(&run, 0.25);
    let mut nan = tensor(&run, 0.5);
    let n = nan.len();
    nan[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
    let oversized = vec![7u8; iota_orchestrator::max_upload_bytes(&run) + 1];
    let bad: [(&str, Vec<u8>, String, ErrorCode); 3] = [
        (
            "NaN",
            nan.clone(),
            blake3_hex(&nan),
            ErrorCode::InvalidTensor,
        ),
        (
            "hash mismatch",
            good.clone(),
            blake3_hex(b"other bytes"),
            ErrorCode::InvalidTensor,
        ),
        (
            "oversized",
            oversized.clone(),
            blake3_hex(&oversized),
            ErrorCode::PayloadTooLarge,
        ),
    ];
    for (what, bytes, declared, expect) in bad {
        let r = s0
            .signed_raw::<UploadResponse>(
                Method::PUT,
                &output_path("", &declared),
                Some(bytes.into()),
            )
            .await;
        assert_eq!(err_code(r), Some(expect), "{what}");
    }
    assert_eq!(all().await, before, "refused direct uploads left objects");

    let presign = |size: u64, blake3: String| {
        let path = output_path("/presign", &blake3);
        let s0 = &s0;
        async move {
            s0.signed_json::<_, PresignResponse>(
                Method::POST,
                &path,
                &PresignRequest {
                    size,
                    blake3,
                    multipart: false,
                },
            )
            .await
        }
    };
    let commit = |key: String, size: u64, blake3: String| {
        let path = output_path("/commit", &blake3);
        let s0 = &s0;
        async move {
            s0.signed_json::<_, UploadResponse>(
                Method::POST,
                &path,
                &CommitRequest {
                    key,
                    size,
                    blake3,
                    multipart: None,
                },
            )
            .await
        }
    };
    let put_presigned = |url: String, bytes: Vec<u8>| {
        let http = http.clone();
        async move {
            let resp = http
                .put(url)
                .body(bytes)
                .send()
                .await
                .expect("PUT to the store");
            assert!(
                resp.status().is_success(),
                "store refused a presigned PUT: {}",
                resp.status()
            );
        }
    };

    let first_output = if presigned {
        let StoreConfig::S3 {
            endpoint: Some(endpoint),
            ..
        } = &store
        else {
            unreachable!("S3 config has an endpoint")
        };
        // Bytes that fail the tensor checks reach the store (the URL cannot check them) but are
        // refused at commit and deleted.
        let target = presign(nan.len() as u64, blake3_hex(&nan))
            .await
            .expect("presign");
        assert!(target.url.starts_with(endpoint.as_str()), "{}", target.url);
        put_presigned(target.url.clone(), nan.clone()).await;
        assert!(
            all().await.contains(&target.key),
            "the presigned PUT landed"
        );
        let r = commit(target.key.clone(), nan.len() as u64, blake3_hex(&nan)).await;
        assert_eq!(err_code(r), Some(ErrorCode::InvalidTensor));
        assert_eq!(all().await, before, "a refused commit left its object");

        // A presigned URL does not bind the size: more bytes than the slot takes are refused
        // at commit and deleted, whatever the commit declares.
        put_presigned(target.url.clone(), oversized.clone()).await;
        let r = commit(
            target.key.clone(),
            oversized.len() as u64,
            blake3_hex(&oversized),
        )
        .await;
        // Refused by the size bound before the object is read whole, not only by the tensor
        // checks that any garbage fails after it was.
        let e = r.expect_err("an oversized presigned upload was committed");
        assert_eq!(e.code(), Some(ErrorCode::InvalidTensor), "{e}");
        let bound = format!("{} is {} bytes, more than", target.key, oversized.len());
        assert!(
            e.to_string().contains(&bound),
            "not refused by the store's size bound: {e}"
        );
        assert_eq!(
            all().await,
            before,
            "an oversized presigned upload was kept"
        );

        // The commit must declare the stored size and hash.
        put_presigned(target.url.clone(), good.clone()).await;
        let r = commit(target.key.clone(), good.len() as u64 + 1, blake3_hex(&good)).await;
        assert_eq!(err_code(r), Some(ErrorCode::InvalidTensor));
        assert_eq!(all().await, before);
        put_presigned(target.url.clone(), good.clone()).await;
        let r = commit(target.key.clone(), good.len() as u64, blake3_hex(b"other")).await;
        assert_eq!(err_code(r), Some(ErrorCode::InvalidTensor));
        assert_eq!(all().await, before);

        // Nothing uploaded yet: nothing to commit. Another slot's key is refused.
        let r = commit(target.key.clone(), good.len() as u64, blake3_hex(&good)).await;
        assert_eq!(err_code(r), Some(ErrorCode::InvalidTensor));
        let r = commit(
            format!("runs/{run_id}/elsewhere"),
            good.len() as u64,
            blake3_hex(&good),
        )
        .await;
        assert_eq!(err_code(r), Some(ErrorCode::BadRequest));

        // A slot-sized presign only: asking for more is refused before any URL is handed out.
        let r = presign(oversized.len() as u64, blake3_hex(&oversized)).await;
        assert_eq!(err_code(r), Some(ErrorCode::PayloadTooLarge));

        // The good bytes: presign, PUT, commit (twice: a retried commit changes nothing).
        let target = presign(good.len() as u64, blake3_hex(&good))
            .await
            .expect("presign");
        put_presigned(target.url.clone(), good.clone()).await;
        let blob = commit(target.key.clone(), good.len() as u64, blake3_hex(&good))
            .await
            .expect("commit")
            .blob;
        let again = commit(target.key.clone(), good.len() as u64, blake3_hex(&good))
            .await
            .expect("retried commit")
            .blob;
        assert_eq!(blob, again);
        blob
    } else {
        // A local store presigns nothing: the bytes go through the orchestrator.
        let r = presign(good.len() as u64, blake3_hex(&good)).await;
        assert_eq!(err_code(r), Some(ErrorCode::BadRequest));
        s0.upload_output(item.task_id, item.lease, good.clone().into())
            .await
            .expect("direct upload")
            .blob
    };
    assert_eq!(
        (first_output.size, blake3_hex(&good)),
        (good.len() as u64, first_output.blake3.clone())
    );
    let mut expected = before.clone();
    expected.push(first_output.key.clone());
    expected.sort();
    assert_eq!(
        all().await,
        expected,
        "exactly the accepted object is stored"
    );
    let done = s0
        .complete(
            item.task_id,
            &CompleteRequest {
                lease: item.lease,
                output: Some(first_output.clone()),
                inner_step: 0,
                weights_digest: "0".repeat(64),
                loss: None,
                sequence_losses: None,
                compute_ms: Some(1),
            },
        )
        .await
        .expect("complete");
    assert!(done.next_task_id.is_some(), "routed on to stage 1");
    if presigned {
        // A commit retried after the completion answers from the record and keeps the object.
        let again = commit(
            first_output.key.clone(),
            good.len() as u64,
            blake3_hex(&good),
        )
        .await
        .expect("commit retried after completion");
        assert_eq!(again.blob, first_output);
        assert!(all().await.contains(&first_output.key));
    }

    // Stage 1 downloads it: straight from the store through a presigned URL, or from the
    // orchestrator. A descriptor that does not match the bytes is caught on download.
    let hop1 = next_hop(&s1, "the hop at stage 1").await;
    let input = hop1.input.clone().expect("stage 1 has an input");
    assert_eq!(
        (input.key.as_str(), input.size),
        (first_output.key.as_str(), first_output.size)
    );
    assert_eq!(
        input.url.is_some(),
        presigned,
        "presigned download URL: {:?}",
        input.url
    );
    assert_eq!(s1.download(&input).await.expect("download"), &good[..]);
    let mut forged = input.clone();
    forged.blake3 = blake3_hex(b"something else");
    assert!(matches!(
        s1.download(&forged).await,
        Err(ClientError::BadObject(_))
    ));

    // Stage 1 and 2 upload through the orchestrator (into whichever store it has).
    let mut hop = hop1;
    for (client, fill, next_stage) in [(&s1, 0.5f32, Some(&s2)), (&s2, 0.75, None)] {
        let bytes = tensor(&run, fill);
        let blob = client
            .upload_output(hop.task_id, hop.lease, Bytes::from(bytes.clone()))
            .await
            .expect("direct upload")
            .blob;
        assert!(all().await.contains(&blob.key));
        let last = next_stage.is_none();
        client
            .complete(
                hop.task_id,
                &CompleteRequest {
                    lease: hop.lease,
                    output: Some(blob.clone()),
                    inner_step: 0,
                    weights_digest: "0".repeat(64),
                    loss: last.then_some(2.5),
                    sequence_losses: last.then(|| vec![2.5; run.micro_batch as usize]),
                    compute_ms: Some(1),
                },
            )
            .await
            .expect("complete");
        // The same output sent again (its answer lost) is answered from the record; other
        // bytes are not taken.
        let again = client
            .upload_output(hop.task_id, hop.lease, Bytes::from(bytes.clone()))
            .await
            .expect("the output again after the completion");
        assert_eq!(again.blob, blob);
        let other = client
            .upload_output(
                hop.task_id,
                hop.lease,
                Bytes::from(tensor(&run, fill + 1.0)),
            )
            .await;
        assert_eq!(err_code(other), Some(ErrorCode::Conflict));
        assert_eq!(
            blobs.get(&blob.key).await.expect("the output"),
            &bytes[..],
            "the recorded output was rewritten"
        );
        if let Some(next) = next_stage {
            hop = next_hop(next, "the next hop").await;
            let input = hop.input.clone().expect("input");
            assert_eq!(input.url.is_some(), presigned);
            assert_eq!(next.download(&input).await.expect("download"), &bytes[..]);
        }
    }

    // Retention (two epochs, the fewest a run may keep): simulated miners take over and the epochs
    // advance; once epoch 3 runs, epoch 0's hop outputs and pseudo-gradients are gone, and the
    // current weights remain downloadable. On a loaded machine a merge can miss its 3 s phase, so
    // the miners run on until every partition has been merged in some epoch.
    let epoch0 = format!("runs/{run_id}/epoch-0");
    let hop_outputs = keys(&blobs, &format!("{epoch0}/samples")).await;
    assert!(hop_outputs.contains(&first_output.key), "{hop_outputs:?}");
    let stop = Arc::new(AtomicBool::new(false));
    let sims = simulated_miners(&orch.base, &stop);
    let status_client = &s0;
    let stages = run.stages;
    eventually(
        "epoch 3, epoch 0's objects collected and every partition merged",
        Duration::from_secs(150),
        || {
            let blobs = &blobs;
            let epoch0 = &epoch0;
            async move {
                let status = status_client.status().await.ok()?;
                let left = keys(blobs, &format!("{epoch0}/samples")).await.len()
                    + keys(blobs, &format!("{epoch0}/pseudo-gradients"))
                        .await
                        .len();
                let mut merged = true;
                for stage in 0..stages {
                    let weights = status_client.stage_weights(stage).await.ok()?;
                    merged &= weights.partitions.iter().all(Option::is_some);
                }
                (status.epoch >= 3 && left == 0 && merged).then_some(())
            }
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for sim in sims {
        let _ = sim.await;
    }
    for stage in 0..run.stages {
        let weights = s0.stage_weights(stage).await.expect("weights");
        // Every partition was merged (with an S3 store, through presigned uploads and commits):
        // none may be missing, or the checks below would pass over nothing.
        assert!(
            weights.partitions.iter().all(Option::is_some),
            "stage {stage} has unmerged partitions: {:?}",
            weights.partitions
        );
        // Anyone sees the weights' keys, sizes and hashes, but never a URL that downloads them
        // from the bucket; a hotkey that is not on the subnet gets none signed either.
        let public: StageWeights = http
            .get(format!("{}/v1/stages/{stage}/weights", orch.base))
            .send()
            .await
            .expect("public weights")
            .json()
            .await
            .expect("json");
        let mut unsigned = weights.clone();
        unsigned
            .partitions
            .iter_mut()
            .flatten()
            .for_each(|b| b.url = None);
        assert_eq!(public, unsigned, "stage {stage}");
        let stranger = ApiClient::new(
            orch.base.clone(),
            signer(99),
            iota_protocol::signing::RequestSigner::ss58(&pair(200)),
            iota_protocol::RetryPolicy::default(),
        )
        .expect("client");
        assert_eq!(
            err_code(stranger.stage_weights(stage).await),
            Some(ErrorCode::NotRegistered)
        );
        for blob in weights.partitions.iter().flatten() {
            assert_eq!(blob.url.is_some(), presigned);
            s0.download(blob)
                .await
                .expect("current weights survive retention");
            // Accepted merges are sealed under their hash, away from the slot that uploads
            // (and presigned PUTs, valid for minutes) write to: a late write to the slot leaves
            // the accepted bytes as they were.
            let slot = blob.key.replace(&format!(".{}", blob.blake3), "");
            assert_ne!(slot, blob.key, "not sealed: {}", blob.key);
            blobs
                .put(&slot, Bytes::from_static(b"not the accepted weights"))
                .await
                .expect("write to the slot");
            s0.download(blob)
                .await
                .expect("accepted weights unchanged by a write to their slot");
        }
    }
    orch.stop().await;
}

/// The next item a poll gives `miner`. A hop just routed to it can take a poll or two to show:
/// idle polls are answered from a view that trails the database by a few milliseconds.
async fn next_hop(miner: &ApiClient, what: &str) -> WorkItem {
    eventually(what, Duration::from_secs(5), || async {
        miner.work(1).await.expect("work").items.pop()
    })
    .await
}

/// One simulated miner per seed of [`MINERS`], stepping until `stop`.
fn simulated_miners(base: &str, stop: &Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<()>> {
    MINERS
        .into_iter()
        .enumerate()
        .map(|(i, seed)| {
            let base = base.to_owned();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut miner =
                    iota_testkit::sim::SimMiner::join(&base, signer(seed), 100.0, i as u64)
                        .await
                        .expect("sim join");
                while !stop.load(Ordering::Relaxed) {
                    if let Err(e) = miner.step().await {
                        tracing::warn!(error = %e, "simulated miner step failed");
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        })
        .collect()
}

/// The epoch a run object's key names (`runs/{run}/epoch-{e}/…`).
fn epoch_of(key: &str) -> Option<u64> {
    key.split('/')
        .find_map(|part| part.strip_prefix("epoch-"))
        .and_then(|e| e.parse().ok())
}

/// Garbage collection keeps each partition's latest accepted merge, however old its epoch: once
/// the miners stop, later epochs merge nothing, and the weights of the last merged epoch must
/// outlive that epoch's collection (everything else of it goes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_latest_weights_outlive_their_epoch() {
    init_tracing();
    let chain = chain_with(&MINERS, &[]).await;
    let db = fresh_db().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = StoreConfig::Local(dir.path().into());
    let mut run = run_config("gc-latest");
    run.samples_per_epoch = 4;
    run.training_s = 3;
    run.uploading_s = 2;
    run.merging_s = 2;
    run.merge_round_s = 1;
    run.retention_epochs = 2;
    let mut config = config(&chain, &db, dir.path(), run.clone());
    config.store = store.clone();
    config.tick = Duration::from_millis(50);
    config.max_merge_rounds = 1;
    let blobs = BlobStore::open(&store).expect("open store");
    let orch = start(config).await;

    // Simulated miners train and merge until every stage has merged weights.
    let stop = Arc::new(AtomicBool::new(false));
    let sims = simulated_miners(&orch.base, &stop);
    let reader = ApiClient::new(
        orch.base.clone(),
        signer(MINERS[0]),
        iota_protocol::signing::RequestSigner::ss58(&pair(200)),
        iota_protocol::RetryPolicy::default(),
    )
    .expect("client");
    let merged = |reader: &ApiClient| {
        let reader = reader.clone();
        let stages = run.stages;
        async move {
            let mut all = Vec::new();
            for stage in 0..stages {
                let weights = reader.stage_weights(stage).await.ok()?;
                if weights.partitions.iter().any(Option::is_none) {
                    return None;
                }
                all.extend(weights.partitions.into_iter().flatten());
            }
            Some(all)
        }
    };
    eventually("every partition merged", Duration::from_secs(120), || {
        merged(&reader)
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for sim in sims {
        let _ = sim.await;
    }
    // The miners are gone; what is accepted now stays the latest.
    let latest = merged(&reader).await.expect("weights");
    let last_merged = latest
        .iter()
        .filter_map(|b| epoch_of(&b.key))
        .max()
        .expect("weights name their epoch");
    let last_prefix = format!("epoch-{last_merged}/");
    eventually(
        "the last merged epoch collected",
        Duration::from_secs(120),
        || {
            let blobs = &blobs;
            let last_prefix = &last_prefix;
            async move {
                let left = blobs.list("runs").await.ok()?;
                let samples_left = left
                    .iter()
                    .any(|k| k.contains(last_prefix.as_str()) && k.contains("/samples/"));
                (!samples_left).then_some(())
            }
        },
    )
    .await;
    let status = reader.status().await.expect("status");
    assert!(
        status.epoch >= last_merged + 3,
        "collected at epoch {}",
        status.epoch
    );
    let now = merged(&reader).await.expect("weights");
    assert_eq!(
        now.iter().map(|b| &b.key).collect::<Vec<_>>(),
        latest.iter().map(|b| &b.key).collect::<Vec<_>>(),
        "nothing was merged after the miners stopped"
    );
    for blob in &now {
        reader
            .download(blob)
            .await
            .unwrap_or_else(|e| panic!("{} was collected with its epoch: {e}", blob.key));
    }
    // The rest of that epoch's merged objects went (none but the latest are kept).
    let merged_left: Vec<String> = blobs
        .list("runs")
        .await
        .expect("list")
        .into_iter()
        .filter(|k| k.contains(&last_prefix) && k.contains("/merged/"))
        .collect();
    for key in &merged_left {
        assert!(
            now.iter().any(|b| &b.key == key),
            "{key} outlived its epoch but is not a latest weight"
        );
    }

    // The miners come back and merge every partition again, in a later epoch.
    let stop = Arc::new(AtomicBool::new(false));
    let sims = simulated_miners(&orch.base, &stop);
    let newer = eventually(
        "every partition merged again",
        Duration::from_secs(120),
        || {
            let reader = &reader;
            let now = &now;
            async move {
                let again = merged(reader).await?;
                again
                    .iter()
                    .all(|b| !now.iter().any(|old| old.key == b.key))
                    .then_some(again)
            }
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for sim in sims {
        let _ = sim.await;
    }
    let remerged = newer
        .iter()
        .filter_map(|b| epoch_of(&b.key))
        .max()
        .expect("weights name their epoch");
    // Until the epoch they were merged in leaves the kept window, the old weights are what
    // that epoch started from: they stay. Epochs without miners take about 7 s here, so this
    // runs well inside the window; an epoch to spare, so that no collection races the check.
    let status = reader.status().await.expect("status");
    assert!(
        status.epoch < remerged + 2,
        "epoch {} already, merged again in {remerged}: too late to check what stays",
        status.epoch
    );
    for blob in &now {
        assert!(
            dir.path().join(&blob.key).exists(),
            "{} collected at epoch {}",
            blob.key,
            status.epoch
        );
    }
    // Then nothing kept starts from them, and they go (before, a merge kept past its epoch's
    // collection was never deleted).
    eventually(
        "the superseded weights collected",
        Duration::from_secs(120),
        || async {
            now.iter()
                .all(|b| !dir.path().join(&b.key).exists())
                .then_some(())
        },
    )
    .await;
    let status = reader.status().await.expect("status");
    assert!(
        status.epoch >= remerged + 3,
        "superseded weights collected at epoch {} (merged again in {remerged})",
        status.epoch
    );
    for blob in merged(&reader).await.expect("weights") {
        reader
            .download(&blob)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", blob.key));
    }
    orch.stop().await;
}

/// An upload whose store write is slow, retried meanwhile by its client: the retry is staged and
/// the hop completed before the first attempt's write ends. That attempt then finds the hop done
/// with the very object it wrote, which is the hop's output and must stay (it once deleted it, as
/// it does the object of an upload whose lease lapsed).
async fn a_late_copy_of_an_upload_keeps_the_hops_output(store: StoreConfig) {
    let slow = slow_store(&store).await;
    let chain = chain_with(&MINERS, &[]).await;
    let db = fresh_db().await;
    let unused = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("late-copy");
    run.samples_per_epoch = 4;
    run.training_s = 60;
    run.lease_s = 60;
    run.heartbeat_timeout_s = 60;
    let mut config = config(&chain, &db, unused.path(), run.clone());
    config.store = slow.store.clone();
    let blobs = BlobStore::open(&store).expect("open store");
    let orch = start(config).await;
    let mut first_stage = None;
    for seed in MINERS {
        let (client, joined) = registered_miner(&orch.base, seed).await;
        if joined.stage == 0 {
            first_stage = Some(client);
        }
    }
    let s0 = first_stage.expect("a miner on stage 0");
    let item = next_hop(&s0, "a sample for stage 0").await;
    *slow.marker.lock().expect("marker") = Some(("PUT", format!("-t{}.safetensors", item.task_id)));
    let good = tensor(&run, 0.25);

    let first = tokio::spawn({
        let (s0, bytes) = (s0.clone(), Bytes::from(good.clone()));
        async move { s0.upload_output(item.task_id, item.lease, bytes).await }
    });
    tokio::time::timeout(Duration::from_secs(20), slow.held.notified())
        .await
        .expect("the first attempt reached the store");
    let output = s0
        .upload_output(item.task_id, item.lease, good.clone().into())
        .await
        .expect("the retry is accepted")
        .blob;
    s0.complete(
        item.task_id,
        &CompleteRequest {
            lease: item.lease,
            output: Some(output.clone()),
            inner_step: 0,
            weights_digest: "0".repeat(64),
            loss: None,
            sequence_losses: None,
            compute_ms: Some(1),
        },
    )
    .await
    .expect("complete with the retry's output");
    slow.release.notify_one();
    let late = first
        .await
        .expect("join")
        .expect("the late attempt answers from the record")
        .blob;
    assert_eq!(
        (late.key.as_str(), late.blake3.as_str()),
        (output.key.as_str(), output.blake3.as_str())
    );
    let stored = blobs
        .get(&output.key)
        .await
        .expect("the hop's output is still in the store");
    assert_eq!(stored.as_ref(), good.as_slice());
    orch.stop().await;
}
