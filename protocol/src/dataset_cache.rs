//! Fetching the run's prepared dataset from its store into a local cache folder, for miners and
//! validators started without a local copy (`--data-dir`).
//!
//! Trust runs from the run's public config down: the manifest must hash to the run's `dataset`,
//! and the tokenizer and every shard to the manifest's BLAKE3 (a shard's size also to its token
//! count). The orchestrator's listing only says where the bytes are; a descriptor that
//! disagrees with the manifest is refused before anything is downloaded, and every download is
//! hashed while it streams to disk and kept only if it matches. Files already in the cache that
//! hash right are not downloaded again.

use std::path::{Path, PathBuf};

use crate::blob::is_blake3_hex;
use crate::client::{ApiClient, ClientError};
use crate::dataset::{
    DatasetFile, MANIFEST_FILE, MAX_MANIFEST_BYTES, MAX_TOKENIZER_BYTES, ManifestFiles,
};

/// The default cache root (`--data-cache`): a dataset goes to `<root>/<manifest BLAKE3>/`.
pub const DEFAULT_DATA_CACHE: &str = "iota-data";

/// Why the run's dataset could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The orchestrator did not list the dataset's files.
    #[error("listing the run's dataset: {0}")]
    Listing(ClientError),
    /// A file's description or bytes are not what the run's dataset says.
    #[error("dataset file {file} refused: {reason}")]
    Refused {
        /// The file's name in the dataset folder.
        file: String,
        /// Why.
        reason: String,
    },
    /// A download failed (a file whose bytes hash otherwise is refused this way too).
    #[error("dataset file {file}: {source}")]
    Download {
        /// The file's name in the dataset folder.
        file: String,
        /// What failed.
        source: ClientError,
    },
    /// The cache folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
}

impl DatasetError {
    /// Whether waiting may cure it (the orchestrator or the store unreachable or failing).
    pub fn is_transient(&self) -> bool {
        let transient = |e: &ClientError| match e {
            ClientError::Network(_) => true,
            ClientError::Api { status, .. } => *status == 429 || *status >= 500,
            _ => false,
        };
        match self {
            Self::Listing(e) | Self::Download { source: e, .. } => transient(e),
            _ => false,
        }
    }
}

/// What [`fetch_dataset`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fetched {
    /// Files downloaded, in order.
    pub downloaded: Vec<String>,
    /// Files found in the cache with the right BLAKE3.
    pub kept: Vec<String>,
}

/// The cache folder of dataset `manifest_blake3` under `root`.
pub fn cache_dir(root: &Path, manifest_blake3: &str) -> PathBuf {
    root.join(manifest_blake3)
}

/// Fetches the run's dataset, whose manifest hashes to `manifest_blake3`, into `dir`: the
/// manifest, the tokenizer and every shard the manifest lists, each verified (see the module's
/// documentation). Returns which files were downloaded and which were already there.
pub async fn fetch_dataset(
    client: &ApiClient,
    manifest_blake3: &str,
    dir: &Path,
) -> Result<Fetched, DatasetError> {
    let refused = |file: &str, reason: String| DatasetError::Refused {
        file: file.to_owned(),
        reason,
    };
    if !is_blake3_hex(manifest_blake3) {
        return Err(refused(
            MANIFEST_FILE,
            format!("the run's dataset {manifest_blake3:?} is not a BLAKE3 digest"),
        ));
    }
    tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
    let listing = client
        .dataset_files()
        .await
        .map_err(DatasetError::Listing)?;
    if listing.dataset != manifest_blake3 {
        return Err(refused(
            MANIFEST_FILE,
            format!(
                "the orchestrator lists dataset {}, the run names {manifest_blake3}",
                listing.dataset
            ),
        ));
    }
    let find = |name: &str| {
        listing
            .files
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| refused(name, "not in the orchestrator's listing".into()))
    };
    let mut done = Fetched::default();

    let manifest = find(MANIFEST_FILE)?;
    if manifest.blake3 != manifest_blake3 {
        return Err(refused(
            MANIFEST_FILE,
            format!(
                "listed with BLAKE3 {}, the run names {manifest_blake3}",
                manifest.blake3
            ),
        ));
    }
    if manifest.size > MAX_MANIFEST_BYTES {
        return Err(refused(
            MANIFEST_FILE,
            format!("{} bytes, more than {MAX_MANIFEST_BYTES}", manifest.size),
        ));
    }
    get(client, manifest, dir, &mut done).await?;
    let mpath = dir.join(MANIFEST_FILE);
    let bytes = tokio::fs::read(&mpath).await.map_err(io(&mpath))?;
    // Checked again as read: the cache may have changed since it was verified.
    if crate::blob::blake3_hex(&bytes) != manifest_blake3 {
        return Err(refused(
            MANIFEST_FILE,
            "changed in the cache while it was fetched".into(),
        ));
    }
    let expected = ManifestFiles::parse(&bytes)
        .and_then(|m| m.expected())
        .map_err(|e| refused(MANIFEST_FILE, e))?;
    for want in &expected {
        let file = find(&want.name)?;
        if file.blake3 != want.blake3 {
            return Err(refused(
                &want.name,
                format!(
                    "listed with BLAKE3 {}, the manifest says {}",
                    file.blake3, want.blake3
                ),
            ));
        }
        let max = want.size.unwrap_or(MAX_TOKENIZER_BYTES);
        if want.size.is_some_and(|s| s != file.size) || file.size > max {
            return Err(refused(
                &want.name,
                format!(
                    "the stored object is {} bytes, the manifest says {}",
                    file.size,
                    want.size
                        .map_or(format!("at most {max}"), |s| s.to_string())
                ),
            ));
        }
        get(client, file, dir, &mut done).await?;
    }
    Ok(done)
}

/// Keeps `file` if the cache has it with the right size and BLAKE3, downloads it otherwise.
async fn get(
    client: &ApiClient,
    file: &DatasetFile,
    dir: &Path,
    done: &mut Fetched,
) -> Result<(), DatasetError> {
    let path = dir.join(&file.name);
    if cached(&path, file.size, &file.blake3).await? {
        done.kept.push(file.name.clone());
        return Ok(());
    }
    tracing::info!(file = %file.name, bytes = file.size, presigned = file.url.is_some(),
        "downloading a dataset file");
    client
        .download_file(file, &path)
        .await
        .map_err(|source| DatasetError::Download {
            file: file.name.clone(),
            source,
        })?;
    done.downloaded.push(file.name.clone());
    Ok(())
}

/// Whether `path` holds `size` bytes hashing to `blake3` (hashed off the async threads, a
/// megabyte at a time).
async fn cached(path: &Path, size: u64, blake3: &str) -> Result<bool, DatasetError> {
    match tokio::fs::metadata(path).await {
        Ok(m) if m.is_file() && m.len() == size => {}
        Ok(_) => return Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io(path)(e)),
    }
    let owned = path.to_path_buf();
    let hash = tokio::task::spawn_blocking(move || -> std::io::Result<String> {
        let mut hasher = blake3::Hasher::new();
        let mut f = std::fs::File::open(&owned)?;
        std::io::copy(&mut f, &mut hasher)?;
        Ok(hasher.finalize().to_hex().to_string())
    })
    .await
    .map_err(|e| io(path)(std::io::Error::other(e.to_string())))?
    .map_err(io(path))?;
    if hash != blake3 {
        tracing::warn!(file = %path.display(), "a cached dataset file hashes otherwise; fetching it again");
    }
    Ok(hash == blake3)
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> DatasetError + use<> {
    let path = path.display().to_string();
    move |source| DatasetError::Io {
        path: path.clone(),
        source,
    }
}
