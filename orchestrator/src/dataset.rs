//! The run's prepared dataset in its store: published once at start from a local folder
//! (`--data`), listed for members by `GET /v1/dataset`, downloaded by them through presigned URLs
//! or `GET /v1/blobs/{key}`.
//!
//! The files live under [`dataset_prefix`] (`datasets/<manifest BLAKE3>/`), outside every run's
//! own prefix: runs on the same dataset share them, and epoch collection never touches them.

use std::path::{Path, PathBuf};

use axum::Json;
use axum::extract::State;
use iota_protocol::ErrorCode;
use iota_protocol::blob::blake3_hex;
use iota_protocol::dataset::{
    DatasetFile, DatasetFiles, MANIFEST_FILE, MAX_MANIFEST_BYTES, ManifestFiles, dataset_prefix,
};

use crate::app::App;
use crate::error::{ApiResult, AppError};
use crate::store::{BlobStore, StoreConfig, StoreError};
use bytes::Bytes;
use tokio::io::AsyncReadExt;

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
    /// The store failed (or has no such file).
    #[error(transparent)]
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

/// Where the run's prepared dataset comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DatasetSource {
    /// A folder on this machine (`iota data prepare`'s output).
    Dir(PathBuf),
    /// The same files under a prefix of an object store (`s3://bucket/prefix?endpoint=…`),
    /// copied into the run's store without touching this machine's disk.
    Store {
        /// The store holding them (credentials as for the run's store).
        store: StoreConfig,
        /// Their prefix in it: empty or ending in `/`.
        prefix: String,
    },
}

impl DatasetSource {
    /// `s3://bucket/prefix` with [`StoreConfig::parse`]'s options, else a folder (`file://`
    /// or a plain path).
    pub fn parse(text: &str) -> Result<Self, String> {
        let Some(rest) = text.strip_prefix("s3://") else {
            let dir = text.strip_prefix("file://").unwrap_or(text);
            if dir.is_empty() {
                return Err("empty dataset path".into());
            }
            return Ok(Self::Dir(dir.into()));
        };
        let (path, query) = rest
            .split_once('?')
            .map_or((rest, None), |(p, q)| (p, Some(q)));
        let (bucket, prefix) = path.split_once('/').unwrap_or((path, ""));
        let options = query.map(|q| format!("?{q}")).unwrap_or_default();
        let store = StoreConfig::parse(&format!("s3://{bucket}{options}"))?;
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|part| part == "..") {
            return Err(format!("{text:?}: a prefix may not climb out with `..`"));
        }
        Ok(Self::Store {
            store,
            prefix: if prefix.is_empty() {
                String::new()
            } else {
                format!("{prefix}/")
            },
        })
    }

    /// Opens the source for reading.
    pub fn open(&self) -> Result<OpenSource, PublishError> {
        Ok(match self {
            Self::Dir(dir) => OpenSource::Dir(dir.clone()),
            Self::Store { store, prefix } => OpenSource::Store {
                store: BlobStore::open(store)?,
                prefix: prefix.clone(),
            },
        })
    }
}

impl std::fmt::Display for DatasetSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dir(dir) => write!(f, "{}", dir.display()),
            Self::Store { store, prefix } => match store {
                StoreConfig::S3 { bucket, .. } => write!(f, "s3://{bucket}/{prefix}"),
                StoreConfig::Local(dir) => write!(f, "{}/{prefix}", dir.display()),
            },
        }
    }
}

/// A [`DatasetSource`] ready to read.
#[derive(Debug)]
pub enum OpenSource {
    /// A folder.
    Dir(PathBuf),
    /// A prefix of a store.
    Store {
        /// The store.
        store: BlobStore,
        /// The prefix.
        prefix: String,
    },
}

impl OpenSource {
    /// The manifest's bytes (at most [`MAX_MANIFEST_BYTES`]).
    pub async fn manifest(&self) -> Result<Bytes, PublishError> {
        match self {
            Self::Dir(dir) => {
                let path = dir.join(MANIFEST_FILE);
                let file = tokio::fs::File::open(&path).await.map_err(io(&path))?;
                let mut bytes = Vec::new();
                file.take(MAX_MANIFEST_BYTES + 1)
                    .read_to_end(&mut bytes)
                    .await
                    .map_err(io(&path))?;
                if bytes.len() as u64 > MAX_MANIFEST_BYTES {
                    return Err(PublishError::Refused(format!(
                        "{}: more than {MAX_MANIFEST_BYTES} bytes",
                        path.display()
                    )));
                }
                Ok(bytes.into())
            }
            Self::Store { store, prefix } => Ok(store
                .get_bounded(&format!("{prefix}{MANIFEST_FILE}"), MAX_MANIFEST_BYTES)
                .await?),
        }
    }

    /// The size of file `name`.
    async fn size_of(&self, name: &str) -> Result<u64, PublishError> {
        match self {
            Self::Dir(dir) => {
                let path = dir.join(name);
                Ok(tokio::fs::metadata(&path).await.map_err(io(&path))?.len())
            }
            Self::Store { store, prefix } => {
                let key = format!("{prefix}{name}");
                store
                    .size_of(&key)
                    .await?
                    .ok_or(PublishError::Store(StoreError::NotFound(key)))
            }
        }
    }

    /// Copies file `name` to `key` of `to`; its size and BLAKE3 as copied.
    async fn copy(
        &self,
        name: &str,
        to: &BlobStore,
        key: &str,
    ) -> Result<(u64, String), StoreError> {
        match self {
            Self::Dir(dir) => to.put_file(key, &dir.join(name)).await,
            Self::Store { store, prefix } => {
                let (_, chunks) = store.get_stream(&format!("{prefix}{name}")).await?;
                to.put_stream(key, chunks).await
            }
        }
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> PublishError + use<> {
    let path = path.display().to_string();
    move |source| PublishError::Io {
        path: path.clone(),
        source,
    }
}

/// Copies the prepared dataset at `source`, whose manifest must hash to `manifest_blake3`, into
/// `store` under [`dataset_prefix`]: every file the manifest lists, the tokenizer and the
/// manifest last (so a listing that finds the manifest finds the rest). A file already stored
/// at its size is kept. Each file is hashed on the way and refused if it is not the manifest's.
pub async fn publish(
    store: &BlobStore,
    source: &DatasetSource,
    manifest_blake3: &str,
) -> Result<Published, PublishError> {
    let from = source.open()?;
    let manifest = from.manifest().await?;
    let hash = blake3_hex(&manifest);
    if hash != manifest_blake3 {
        return Err(PublishError::Refused(format!(
            "{source}: manifest BLAKE3 {hash}, the run names dataset {manifest_blake3}"
        )));
    }
    let expected = ManifestFiles::parse(&manifest)
        .and_then(|m| m.expected())
        .map_err(PublishError::Refused)?;
    let prefix = dataset_prefix(manifest_blake3);
    let mut done = Published::default();
    for f in &expected {
        let size = from.size_of(&f.name).await?;
        if let Some(want) = f.size
            && want != size
        {
            return Err(PublishError::Refused(format!(
                "{source}: {} is {size} bytes, the manifest says {want}",
                f.name
            )));
        }
        let key = format!("{prefix}{}", f.name);
        if store.size_of(&key).await? == Some(size) {
            done.kept.push(f.name.clone());
            continue;
        }
        let (_, got) = from.copy(&f.name, store, &key).await?;
        if got != f.blake3 {
            // Not left behind for members to download and refuse.
            store.delete(&key).await?;
            return Err(PublishError::Refused(format!(
                "{source}: {} has BLAKE3 {got}, the manifest says {}",
                f.name, f.blake3
            )));
        }
        tracing::info!(file = %f.name, bytes = size, "dataset file published");
        done.uploaded.push(f.name.clone());
    }
    let key = format!("{prefix}{MANIFEST_FILE}");
    if store.size_of(&key).await? == Some(manifest.len() as u64) {
        done.kept.push(MANIFEST_FILE.to_owned());
    } else {
        store.put(&key, manifest).await?;
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
    let manifest = stored_manifest(&app, &hash).await?;
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
        let Some(size) = app.store.size_of(&key).await? else {
            return Err(not_published(&hash));
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

fn not_published(hash: &str) -> AppError {
    AppError::new(
        ErrorCode::NotFound,
        format!(
            "dataset {hash} is not in the run's store: the orchestrator publishes it when started \
             with --data; meanwhile use a local copy (--data-dir)"
        ),
    )
}

/// The manifest of the run's dataset `hash` as stored, checked to be the run's.
async fn stored_manifest(app: &App, hash: &str) -> ApiResult<bytes::Bytes> {
    let key = format!("{}{MANIFEST_FILE}", dataset_prefix(hash));
    let manifest = match app.store.get_bounded(&key, MAX_MANIFEST_BYTES).await {
        Err(StoreError::NotFound(_)) => return Err(not_published(hash)),
        r => r?,
    };
    if blake3_hex(&manifest) != hash {
        tracing::error!(dataset = %hash, "the stored manifest has other bytes than the run's");
        return Err(AppError::new(
            ErrorCode::Internal,
            "the stored manifest is not the run's",
        ));
    }
    Ok(manifest)
}

/// Whether `key` is a file of the run's dataset (readable by every member through
/// `GET /v1/blobs/{key}`).
pub fn is_run_dataset_key(app: &App, key: &str) -> bool {
    app.run.config.dataset.as_deref().is_some_and(|hash| {
        key.strip_prefix(&dataset_prefix(hash))
            .is_some_and(|name| !name.is_empty() && !name.contains('/'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse() {
        assert_eq!(
            DatasetSource::parse("./ds").unwrap(),
            DatasetSource::Dir("./ds".into())
        );
        assert_eq!(
            DatasetSource::parse("file:///srv/ds").unwrap(),
            DatasetSource::Dir("/srv/ds".into())
        );
        let DatasetSource::Store { store, prefix } =
            DatasetSource::parse("s3://b/fineweb/v1/?endpoint=http://127.0.0.1:5000&region=x")
                .unwrap()
        else {
            panic!("not a store");
        };
        assert_eq!(prefix, "fineweb/v1/");
        assert!(
            matches!(store, StoreConfig::S3 { bucket, endpoint: Some(e), region: Some(r), .. }
            if bucket == "b" && e == "http://127.0.0.1:5000" && r == "x")
        );
        let DatasetSource::Store { prefix, .. } = DatasetSource::parse("s3://b").unwrap() else {
            panic!("not a store");
        };
        assert_eq!(prefix, "");
        assert!(DatasetSource::parse("").is_err());
        assert!(DatasetSource::parse("s3:///ds").is_err());
        assert!(DatasetSource::parse("s3://b/../other").is_err());
        assert!(DatasetSource::parse("s3://b/ds?colour=red").is_err());
    }
}
