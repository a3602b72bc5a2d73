//! A run's prepared dataset travels through its store: the orchestrator publishes it from
//! `--data`, a miner without `--data-dir` fetches exactly the manifest's files into its cache
//! (each checked against the run's manifest hash), refuses a tampered object naming the file,
//! and does not download again what its cache already holds.

use crate::support;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use iota_model::ModelConfig;
use iota_model::data::PreparedDataset;
use iota_model::data::prepare::{Manifest, PrepareOptions, prepare};
use iota_model::train_bpe_tokenizer;
use iota_orchestrator::dataset::DatasetSource;
use iota_protocol::dataset::{MANIFEST_FILE, TOKENIZER_FILE, dataset_prefix};
use iota_protocol::dataset_cache::{DatasetError, cache_dir, fetch_dataset};
use support::*;

/// A small prepared dataset in `dir/ds` (several train shards), and its manifest's hash.
fn dataset(dir: &Path) -> (Manifest, String) {
    let text = "The river ran quietly past the old mill, and the miller watched the water turn \
                the wheel. In the evening the children came down to the bank to throw stones.\n";
    let docs: String = (0..300)
        .map(|i| serde_json::json!({ "text": format!("{i}. {text}") }).to_string() + "\n")
        .collect();
    let raw = dir.join("raw.jsonl");
    std::fs::write(&raw, docs).expect("write");
    let tok = dir.join("tokenizer.json");
    train_bpe_tokenizer(std::slice::from_ref(&raw), 400, &tok).expect("tokenizer");
    let opts = PrepareOptions {
        held_out_ppm: 100_000,
        shard_tokens: 4096,
        ..PrepareOptions::default()
    };
    prepare(&[raw], &tok, &dir.join("ds"), &opts, &mut |_| {}).expect("prepare")
}

/// The names of the files a copy of `manifest` holds.
fn manifest_files(manifest: &Manifest) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = [MANIFEST_FILE, TOKENIZER_FILE]
        .into_iter()
        .map(String::from)
        .collect();
    for s in manifest
        .train
        .shards
        .iter()
        .chain(&manifest.held_out.shards)
    {
        names.insert(s.file.clone());
    }
    names
}

fn names_in(dir: &Path) -> BTreeSet<String> {
    files_under(dir)
        .iter()
        .map(|p| p.strip_prefix(dir).expect("under").display().to_string())
        .collect()
}

/// The tiny run, with a vocabulary that holds the 400-token tokenizer, on dataset `hash`.
fn run_on(dir: &Path, hash: &str) -> iota_protocol::api::RunConfig {
    let mut model = ModelConfig::tiny();
    model.vocab_size = 512;
    let model_file = dir.join("model.json");
    std::fs::write(&model_file, model.to_json().expect("json")).expect("write");
    let mut run = tiny_run("dataset-store", 8);
    run.model = model_file.display().to_string();
    run.stage_params = (0..model.num_stages())
        .map(|k| model.stage_param_count(k).expect("params") as u64)
        .collect();
    run.dataset = Some(hash.to_owned());
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_run_dataset_is_fetched_from_its_store_and_checked() {
    init_tracing();
    let tmp = tempfile::tempdir().expect("tmp");
    let (manifest, hash) = dataset(tmp.path());
    let ds_dir = tmp.path().join("ds");
    let files = manifest_files(&manifest);
    assert!(
        manifest.train.shards.len() >= 2,
        "the test wants several shards: {manifest:?}"
    );

    let run = run_on(tmp.path(), &hash);

    let chain = chain_with(&[1, 2], &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let mut cfg = config(&chain, &db, store.path(), run.clone());
    cfg.dataset = Some(DatasetSource::Dir(ds_dir.clone()));
    let orch = start(cfg).await;

    // Published: exactly the manifest's files, byte for byte.
    let stored = store.path().join(dataset_prefix(&hash));
    assert_eq!(names_in(&stored), files);
    for name in &files {
        assert_eq!(
            std::fs::read(stored.join(name)).expect("stored"),
            std::fs::read(ds_dir.join(name)).expect("local"),
            "{name}"
        );
    }
    // Publishing again uploads nothing.
    let blobs = iota_orchestrator::BlobStore::open(&iota_orchestrator::StoreConfig::Local(
        store.path().into(),
    ))
    .expect("store");
    let again =
        iota_orchestrator::dataset::publish(&blobs, &DatasetSource::Dir(ds_dir.clone()), &hash)
            .await
            .expect("publish again");
    assert!(again.uploaded.is_empty(), "{again:?}");
    assert_eq!(again.kept.len(), files.len());
    // A folder that is not the run's dataset is refused.
    let err = iota_orchestrator::dataset::publish(
        &blobs,
        &DatasetSource::Dir(ds_dir.clone()),
        &"ab".repeat(32),
    )
    .await
    .expect_err("another dataset");
    assert!(err.to_string().contains(&hash), "{err}");

    // A member fetches exactly the manifest's files, and the cache opens as the run's dataset.
    let client = explorer(&orch.base, 1).await;
    let cache_root = tmp.path().join("cache");
    let cache = cache_dir(&cache_root, &hash);
    let got = fetch_dataset(&client, &hash, &cache).await.expect("fetch");
    assert_eq!(
        got.downloaded.iter().cloned().collect::<BTreeSet<_>>(),
        files
    );
    assert_eq!(got.downloaded.len(), files.len(), "{got:?}");
    assert!(got.kept.is_empty(), "{got:?}");
    assert_eq!(names_in(&cache), files);
    PreparedDataset::open(&cache, Some(&hash), 32, run.init_seed)
        .expect("the cache is the run's dataset")
        .verify_all()
        .expect("every shard hashes right");

    // A second fetch downloads nothing.
    let again = fetch_dataset(&client, &hash, &cache).await.expect("again");
    assert!(again.downloaded.is_empty(), "{again:?}");
    assert_eq!(again.kept.len(), files.len());

    // A cached file that no longer hashes right is fetched again, and only it.
    let shard = manifest.train.shards[1].file.clone();
    corrupt_stored(&cache.join(&shard));
    let again = fetch_dataset(&client, &hash, &cache).await.expect("repair");
    assert_eq!(again.downloaded, vec![shard.clone()]);
    PreparedDataset::open(&cache, Some(&hash), 32, run.init_seed)
        .expect("open")
        .verify_all()
        .expect("repaired");

    // A tampered object in the store is refused, naming the file, and nothing of it is kept.
    corrupt_stored(&stored.join(&shard));
    let fresh = tmp.path().join("fresh");
    let err = fetch_dataset(&client, &hash, &fresh)
        .await
        .expect_err("tampered shard");
    assert!(
        matches!(&err, DatasetError::Download { file, .. } if *file == shard),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains(&shard) && text.contains("BLAKE3"), "{text}");
    assert!(
        !names_in(&fresh).iter().any(|n| n.starts_with(&shard)),
        "{:?}",
        names_in(&fresh)
    );
    // Put back for the miner below.
    std::fs::write(
        stored.join(&shard),
        std::fs::read(ds_dir.join(&shard)).expect("shard"),
    )
    .expect("restore");

    // A miner started without --data-dir fetches the dataset into its cache and trains on it.
    let mut mcfg = miner_config(&orch.base);
    mcfg.tokens_per_s = Some(1000.0);
    let miner_cache = tmp.path().join("miner-cache");
    mcfg.data_cache = miner_cache.clone();
    let m = iota_miner::spawn(mcfg, signer(2));
    eventually("joined", Duration::from_secs(120), || async {
        m.status().stage.map(|_| ())
    })
    .await;
    assert_eq!(names_in(&cache_dir(&miner_cache, &hash)), files);
    let _ = m.stop().await;
    orch.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_an_s3_store_the_dataset_comes_through_presigned_urls() {
    init_tracing();
    let tmp = tempfile::tempdir().expect("tmp");
    let (manifest, hash) = dataset(tmp.path());
    let files = manifest_files(&manifest);
    let run = run_on(tmp.path(), &hash);
    let chain = chain_with(&[1], &[]).await;
    let db = fresh_db().await;
    let local = tempfile::tempdir().expect("unused");
    let mut cfg = config(&chain, &db, local.path(), run.clone());
    cfg.store = s3_store();
    cfg.dataset = Some(DatasetSource::Dir(tmp.path().join("ds")));
    let orch = start(cfg).await;

    let client = explorer(&orch.base, 1).await;
    let listing = client.dataset_files().await.expect("listing");
    assert_eq!(listing.dataset, hash);
    assert_eq!(
        listing
            .files
            .iter()
            .map(|f| f.name.clone())
            .collect::<BTreeSet<_>>(),
        files
    );
    assert!(listing.files.iter().all(|f| f.url.is_some()), "{listing:?}");
    let cache = tmp.path().join("cache");
    let got = fetch_dataset(&client, &hash, &cache).await.expect("fetch");
    assert_eq!(got.downloaded.len(), files.len(), "{got:?}");
    assert_eq!(names_in(&cache), files);
    PreparedDataset::open(&cache, Some(&hash), 32, run.init_seed)
        .expect("the cache is the run's dataset")
        .verify_all()
        .expect("every shard hashes right");
    let again = fetch_dataset(&client, &hash, &cache).await.expect("again");
    assert!(again.downloaded.is_empty(), "{again:?}");
    orch.stop().await;
}

/// `--data s3://bucket/prefix`: the prepared files under a prefix of a bucket (as `aws s3 cp
/// --recursive` leaves them) are copied into the run's store, each checked against the manifest
/// on the way, without a local copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dataset_under_an_s3_prefix_is_copied_into_the_run_store_and_checked() {
    use iota_orchestrator::dataset::publish;
    use iota_orchestrator::{BlobStore, StoreConfig};
    init_tracing();
    let tmp = tempfile::tempdir().expect("tmp");
    let (manifest, hash) = dataset(tmp.path());
    let ds_dir = tmp.path().join("ds");
    let files = manifest_files(&manifest);
    let s3 = s3_store();
    let bucket = BlobStore::open(&s3).expect("s3");
    let prefix = format!("prepared/{}", uuid::Uuid::new_v4().simple());
    for name in &files {
        bucket
            .put_file(&format!("{prefix}/{name}"), &ds_dir.join(name))
            .await
            .expect("upload");
    }
    let StoreConfig::S3 {
        bucket: name,
        endpoint: Some(endpoint),
        region: Some(region),
        ..
    } = &s3
    else {
        panic!("the test store is S3 with an endpoint and a region: {s3:?}");
    };
    let url = format!("s3://{name}/{prefix}/?endpoint={endpoint}&region={region}");
    let source = DatasetSource::parse(&url).expect("source");

    let run_dir = tempfile::tempdir().expect("run store");
    let run_store = BlobStore::open(&StoreConfig::Local(run_dir.path().into())).expect("store");
    let done = publish(&run_store, &source, &hash).await.expect("publish");
    assert_eq!(
        done.uploaded.iter().cloned().collect::<BTreeSet<_>>(),
        files
    );
    let stored = run_dir.path().join(dataset_prefix(&hash));
    assert_eq!(names_in(&stored), files);
    for name in &files {
        assert_eq!(
            std::fs::read(stored.join(name)).expect("stored"),
            std::fs::read(ds_dir.join(name)).expect("prepared"),
            "{name}"
        );
    }
    let again = publish(&run_store, &source, &hash).await.expect("again");
    assert!(again.uploaded.is_empty(), "{again:?}");

    // Another dataset's hash is refused, naming the manifest's.
    let err = publish(&run_store, &source, &"ab".repeat(32))
        .await
        .expect_err("another dataset");
    assert!(err.to_string().contains(&hash), "{err}");

    // A shard whose bytes are not the manifest's (same size) is refused and not left behind.
    let shard = &manifest.train.shards[0].file;
    let mut bad = std::fs::read(ds_dir.join(shard)).expect("shard");
    bad[0] ^= 0xff;
    bucket
        .put(&format!("{prefix}/{shard}"), bad.into())
        .await
        .expect("replace");
    let fresh_dir = tempfile::tempdir().expect("fresh store");
    let fresh = BlobStore::open(&StoreConfig::Local(fresh_dir.path().into())).expect("store");
    let err = publish(&fresh, &source, &hash)
        .await
        .expect_err("a corrupt shard");
    assert!(err.to_string().contains(shard.as_str()), "{err}");
    let fresh_stored = fresh_dir.path().join(dataset_prefix(&hash));
    assert!(!fresh_stored.join(shard).exists());
    assert!(!fresh_stored.join(MANIFEST_FILE).exists());
}
