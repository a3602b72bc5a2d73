//! The run's prepared dataset in its store: published once at start from a local folder
//! (`--data`), listed for members by `GET /v1/dataset`, downloaded by them through presigned URLs
//! or `GET /v1/blobs/{key}`.
//!
//! The files live under [`dataset_prefix`] (`datasets/<manifest BLAKE3>/`), outside every run's
//! own prefix: runs on the same dataset share them, and epoch collection never touches them.

use std::path::{Path, PathBuf};

use iota_protocol::blob::blake3_hex;
use iota_protocol::dataset::{MANIFEST_FILE, MAX_MANIFEST_BYTES, ManifestFiles, dataset_prefix};

use crate::app::App;
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
