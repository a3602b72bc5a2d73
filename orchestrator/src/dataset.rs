//! The run's prepared dataset in its store: published once at start from a local folder
//! (`--data`), listed for members by `GET /v1/dataset`, downloaded by them through presigned URLs
//! or `GET /v1/blobs/{key}`.
//!
//! The files live under [`dataset_prefix`] (`datasets/<manifest BLAKE3>/`), outside every run's
//! own prefix: runs on the same dataset share them, and epoch collection never touches them.

use std::path::Path;

use axum::Json;
use axum::extract::State;
use iota_protocol::ErrorCode;
use iota_protocol::blob::blake3_hex;
use iota_protocol::dataset::{
    DatasetFile, DatasetFiles, MANIFEST_FILE, MAX_MANIFEST_BYTES, ManifestFiles, dataset_prefix,
};

use crate::app::{ApiResult, App, AppError};
use crate::store::{BlobStore, StoreError};

/// Why a dataset could not be published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// A file of the folder could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// The folder is not the run's dataset, or not a prepared dataset.
    #[error("{0}")]
    Refused(String),
    /// The store failed.
    #[error("object store: {0}")]
    Store(#[from] StoreError),
}

/// What [`publish`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Published {
    /// Files uploaded.
    pub uploaded: Vec<String>,
    /// Files already in the store at their size.
    pub kept: Vec<String>,
}

/// Uploads the prepared dataset in `dir`, which must be the one whose manifest hashes to
/// `manifest_blake3`, under [`dataset_prefix`]: every file the manifest lists, the tokenizer and
/// the manifest last (so a listing that finds the manifest finds the rest). A file already
/// stored at its size is kept. Each file is hashed on the way up and refused if it is not the
/// manifest's.
pub async fn publish(
    store: &BlobStore,
    dir: &Path,
    manifest_blake3: &str,
) -> Result<Published, PublishError> {
    let mpath = dir.join(MANIFEST_FILE);
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| PublishError::Io { path, source }
    };
    let manifest = tokio::fs::read(&mpath).await.map_err(io(&mpath))?;
    let hash = blake3_hex(&manifest);
    if hash != manifest_blake3 {
        return Err(PublishError::Refused(format!(
            "{}: BLAKE3 {hash}, the run names dataset {manifest_blake3}",
            mpath.display()
        )));
    }
    let expected = ManifestFiles::parse(&manifest)
        .and_then(|m| m.expected())
        .map_err(PublishError::Refused)?;
    let prefix = dataset_prefix(manifest_blake3);
    let mut done = Published::default();
    for f in &expected {
        let path = dir.join(&f.name);
        let meta = tokio::fs::metadata(&path).await.map_err(io(&path))?;
        if let Some(size) = f.size
            && size != meta.len()
        {
            return Err(PublishError::Refused(format!(
                "{}: {} bytes, the manifest says {size}",
                path.display(),
                meta.len()
            )));
        }
        let key = format!("{prefix}{}", f.name);
        if store.size_of(&key).await? == Some(meta.len()) {
            done.kept.push(f.name.clone());
            continue;
        }
        let (_, got) = store.put_file(&key, &path).await?;
        if got != f.blake3 {
            // Not left behind for members to download and refuse.
            store.delete(&key).await?;
            return Err(PublishError::Refused(format!(
                "{}: BLAKE3 {got}, the manifest says {}",
                path.display(),
                f.blake3
            )));
        }
        tracing::info!(file = %f.name, bytes = meta.len(), "dataset file uploaded");
        done.uploaded.push(f.name.clone());
    }
    let key = format!("{prefix}{MANIFEST_FILE}");
    if store.size_of(&key).await? == Some(manifest.len() as u64) {
        done.kept.push(MANIFEST_FILE.to_owned());
    } else {
        store.put(&key, manifest.into()).await?;
        done.uploaded.push(MANIFEST_FILE.to_owned());
    }
    Ok(done)
}

/// `GET /v1/dataset`: the files of the run's dataset in its store, with their sizes as stored,
/// the BLAKE3 each must have (the run's `dataset` for the manifest, the manifest's for the rest)
/// and download URLs where the store presigns. A member checks each against the manifest it
/// verified before downloading, and each download against its BLAKE3.
#[utoipa::path(get, path = "/v1/dataset", tag = "miner",
    responses((status = 200, body = DatasetFiles), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn files(State(app): State<App>) -> ApiResult<Json<DatasetFiles>> {
    let Some(hash) = app.run.config.dataset.clone() else {
        return Err(AppError::new(
            ErrorCode::NotFound,
            "the run names no dataset (it trains on the embedded grammar corpus)",
        ));
    };
    let prefix = dataset_prefix(&hash);
    let not_published = |_| {
        AppError::new(
            ErrorCode::NotFound,
            format!(
                "dataset {hash} is not in the run's store: the orchestrator publishes it when \
                 started with --data; meanwhile use a local copy (--data-dir)"
            ),
        )
    };
    let manifest = match app
        .store
        .get_bounded(&format!("{prefix}{MANIFEST_FILE}"), MAX_MANIFEST_BYTES)
        .await
    {
        Err(StoreError::NotFound(k)) => return Err(not_published(k)),
        r => r?,
    };
    if blake3_hex(&manifest) != hash {
        tracing::error!(dataset = %hash, "the stored manifest has other bytes than the run's");
        return Err(AppError::new(
            ErrorCode::Internal,
            "the stored manifest is not the run's",
        ));
    }
    let expected = ManifestFiles::parse(&manifest)
        .and_then(|m| m.expected())
        .map_err(|e| AppError::new(ErrorCode::Internal, e))?;
    let mut files = Vec::with_capacity(expected.len() + 1);
    let mut push = |name: &str, size: u64, blake3: &str| {
        files.push(DatasetFile {
            name: name.to_owned(),
            key: format!("{prefix}{name}"),
            size,
            blake3: blake3.to_owned(),
            url: None,
        });
    };
    push(MANIFEST_FILE, manifest.len() as u64, &hash);
    for f in &expected {
        let key = format!("{prefix}{}", f.name);
        let size = match app.store.size_of(&key).await? {
            Some(s) => s,
            None => return Err(not_published(key)),
        };
        push(&f.name, size, &f.blake3);
    }
    for f in &mut files {
        f.url = app.store.presign(http::Method::GET, &f.key).await?;
    }
    Ok(Json(DatasetFiles {
        dataset: hash,
        files,
    }))
}

/// Whether `key` is a file of the run's dataset (readable by every member through
/// `GET /v1/blobs/{key}`).
pub fn is_run_dataset_key(app: &App, key: &str) -> bool {
    app.run.config.dataset.as_deref().is_some_and(|hash| {
        key.strip_prefix(&dataset_prefix(hash))
            .is_some_and(|name| !name.is_empty() && !name.contains('/'))
    })
}
