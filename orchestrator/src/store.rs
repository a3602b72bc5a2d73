//! Blob storage through `object_store`: a local directory by default, any S3-compatible bucket by
//! configuration. With S3, miners get presigned URLs and bulk bytes bypass the orchestrator.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::chunked::ChunkedStore;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::signer::Signer;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload};

/// Where blobs live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreConfig {
    /// A directory on this machine, served by the orchestrator itself.
    Local(std::path::PathBuf),
    /// An S3-compatible bucket. Credentials come from the environment (`AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, …) unless given in the URL's query.
    S3 {
        /// Bucket.
        bucket: String,
        /// Endpoint URL for non-AWS stores (MinIO, R2, moto), e.g. `http://127.0.0.1:9000`.
        endpoint: Option<String>,
        /// Region.
        region: Option<String>,
        /// How long presigned URLs last ([`DEFAULT_PRESIGN_TTL`] unless the URL's
        /// `presign_ttl_s` says otherwise). Objects of an ended epoch are collected no sooner
        /// than this after it ended (see [`BlobStore::upload_grace`]).
        presign_ttl: Duration,
        /// Bytes per part of a presigned upload in parts ([`DEFAULT_PART_BYTES`] unless the
        /// URL's `part_mb` says otherwise): a larger object is uploaded in parts when the
        /// client can.
        part_bytes: u64,
    },
}

/// Bytes per part of a presigned upload in parts unless configured.
pub const DEFAULT_PART_BYTES: u64 = 64 << 20;
/// S3's bounds: no part but the last under 5 MiB, none over 5 GiB, at most 10,000 parts.
const MIN_PART_MB: u64 = 5;
const MAX_PART_MB: u64 = 5 << 10;
const MAX_PARTS: u64 = 10_000;

/// How long presigned URLs last unless configured.
pub const DEFAULT_PRESIGN_TTL: Duration = Duration::from_secs(900);
/// The longest presigned URL S3 signs (seven days).
const MAX_PRESIGN_TTL_S: u64 = 7 * 24 * 3600;

impl StoreConfig {
    /// Parses `file:///path`, a plain path, or
    /// `s3://bucket?endpoint=http://…&region=…&presign_ttl_s=…&part_mb=…`.
    pub fn parse(text: &str) -> Result<Self, String> {
        if let Some(rest) = text.strip_prefix("s3://") {
            let (bucket, query) = rest.split_once('?').unwrap_or((rest, ""));
            let bucket = bucket.trim_end_matches('/');
            if bucket.is_empty() {
                return Err(format!("{text:?} names no bucket"));
            }
            let mut endpoint = None;
            let mut region = None;
            let mut presign_ttl = DEFAULT_PRESIGN_TTL;
            let mut part_bytes = DEFAULT_PART_BYTES;
            for pair in url::form_urlencoded::parse(query.as_bytes()) {
                match pair.0.as_ref() {
                    "endpoint" => endpoint = Some(pair.1.into_owned()),
                    "region" => region = Some(pair.1.into_owned()),
                    "presign_ttl_s" => {
                        presign_ttl = match pair.1.parse::<u64>() {
                            Ok(s) if (1..=MAX_PRESIGN_TTL_S).contains(&s) => Duration::from_secs(s),
                            _ => {
                                return Err(format!(
                                    "presign_ttl_s in {text:?} must be whole seconds from 1 to \
                                     {MAX_PRESIGN_TTL_S}"
                                ));
                            }
                        }
                    }
                    "part_mb" => {
                        part_bytes = match pair.1.parse::<u64>() {
                            Ok(mb) if (MIN_PART_MB..=MAX_PART_MB).contains(&mb) => mb << 20,
                            _ => {
                                return Err(format!(
                                    "part_mb in {text:?} must be whole MiB from {MIN_PART_MB} to \
                                     {MAX_PART_MB}"
                                ));
                            }
                        }
                    }
                    other => return Err(format!("unknown store option {other:?} in {text:?}")),
                }
            }
            return Ok(Self::S3 {
                bucket: bucket.to_owned(),
                endpoint,
                region,
                presign_ttl,
                part_bytes,
            });
        }
        let path = text.strip_prefix("file://").unwrap_or(text);
        if path.is_empty() {
            return Err("empty store path".into());
        }
        Ok(Self::Local(path.into()))
    }
}

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The object does not exist.
    #[error("no object {0}")]
    NotFound(String),
    /// The key is not a valid object path.
    #[error("invalid object key {0:?}")]
    BadKey(String),
    /// The object is larger than the reader takes.
    #[error("{key} is {size} bytes, more than {max}")]
    TooLarge {
        /// The object.
        key: String,
        /// Its size.
        size: u64,
        /// The most the reader takes.
        max: u64,
    },
    /// The store failed.
    #[error("object store: {0}")]
    Backend(String),
}

impl From<object_store::Error> for StoreError {
    fn from(e: object_store::Error) -> Self {
        match e {
            object_store::Error::NotFound { path, .. } => Self::NotFound(path),
            // A key the store cannot hold as a name names no object.
            object_store::Error::InvalidPath { .. } => Self::NotFound(String::new()),
            other if names_nothing(&other) => Self::NotFound(String::new()),
            other => Self::Backend(other.to_string()),
        }
    }
}

/// Whether a store's failure says the name cannot be an object's: too long for the file
/// system, or a path through an existing object (a local store reports neither as not found).
fn names_nothing(e: &object_store::Error) -> bool {
    use std::io::ErrorKind;
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                ErrorKind::NotFound | ErrorKind::NotADirectory | ErrorKind::InvalidFilename
            );
        }
        source = cause.source();
    }
    false
}

/// Bytes per chunk when an object from a local directory is streamed.
const STREAM_CHUNK_BYTES: usize = 1 << 20;
/// Bytes per part of a multipart upload of a file (S3's smallest part but the last is 5 MiB).
const UPLOAD_PART_BYTES: usize = 8 << 20;

/// The blob store.
#[derive(Clone, Debug)]
pub struct BlobStore {
    inner: Arc<dyn ObjectStore>,
    signer: Option<Arc<AmazonS3>>,
    presign_ttl: Duration,
    /// Bytes per part of a presigned upload in parts.
    presign_part_bytes: u64,
}

/// A presigned upload in parts ([`BlobStore::presign_parts`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PresignedParts {
    /// The store's id of the upload.
    pub upload_id: String,
    /// Bytes of every part but the last.
    pub part_bytes: u64,
    /// A PUT URL for each part, in order.
    pub urls: Vec<String>,
}

impl BlobStore {
    /// Opens the store (creating a local directory if needed).
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        match config {
            StoreConfig::Local(dir) => {
                std::fs::create_dir_all(dir).map_err(|e| {
                    StoreError::Backend(format!("cannot create {}: {e}", dir.display()))
                })?;
                let fs = LocalFileSystem::new_with_prefix(dir)?;
                Ok(Self {
                    inner: Arc::new(fs),
                    signer: None,
                    presign_ttl: Duration::ZERO,
                    presign_part_bytes: 0,
                })
            }
            StoreConfig::S3 {
                bucket,
                endpoint,
                region,
                presign_ttl,
                part_bytes,
            } => {
                let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
                if let Some(ep) = endpoint {
                    b = b
                        .with_endpoint(ep)
                        .with_allow_http(ep.starts_with("http://"))
                        .with_virtual_hosted_style_request(false);
                }
                if let Some(r) = region {
                    b = b.with_region(r);
                }
                let s3 = Arc::new(b.build()?);
                Ok(Self {
                    inner: s3.clone(),
                    signer: Some(s3),
                    presign_ttl: *presign_ttl,
                    presign_part_bytes: *part_bytes,
                })
            }
        }
    }

    /// Whether uploads and downloads go straight to the store through presigned URLs.
    pub fn presigns(&self) -> bool {
        self.signer.is_some()
    }

    fn path(key: &str) -> Result<Path, StoreError> {
        // `#` ends the names a local store keeps for its own parts of an upload in progress;
        // no key this service makes has one.
        if key.is_empty() || key.contains("..") || key.starts_with('/') || key.contains('#') {
            return Err(StoreError::BadKey(key.to_owned()));
        }
        Path::parse(key).map_err(|_| StoreError::BadKey(key.to_owned()))
    }

    /// Writes an object (atomically: readers see all of it or none).
    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<(), StoreError> {
        self.inner
            .put(&Self::path(key)?, PutPayload::from_bytes(bytes))
            .await?;
        Ok(())
    }

    /// Writes the file at `file` to `key`, streamed in parts (a multipart upload on S3), so a
    /// file of any size passes through a part's worth of memory; readers see all of it or none.
    /// Returns its size and BLAKE3 (hex), computed on the way.
    pub async fn put_file(
        &self,
        key: &str,
        file: &std::path::Path,
    ) -> Result<(u64, String), StoreError> {
        use tokio::io::AsyncReadExt;
        let io = |e: std::io::Error| StoreError::Backend(format!("{}: {e}", file.display()));
        let input = tokio::fs::File::open(file).await.map_err(io)?;
        let chunks = futures::stream::try_unfold(input, move |mut input| async move {
            let mut buf = vec![0u8; STREAM_CHUNK_BYTES];
            let n = input.read(&mut buf).await.map_err(io)?;
            buf.truncate(n);
            Ok((n > 0).then(|| (Bytes::from(buf), input)))
        });
        self.put_stream(key, chunks).await
    }

    /// Writes the chunks of `chunks` to `key` as [`BlobStore::put_file`] writes a file: in
    /// parts, at most two in flight, all or nothing. Returns the size and BLAKE3 (hex).
    pub async fn put_stream(
        &self,
        key: &str,
        chunks: impl futures::Stream<Item = Result<Bytes, StoreError>>,
    ) -> Result<(u64, String), StoreError> {
        let mut hasher = blake3::Hasher::new();
        let hash = |chunk: Option<&[u8]>| {
            if let Some(chunk) = chunk {
                hasher.update(chunk);
            }
            Ok(())
        };
        let size = self.put_checked(key, chunks, hash).await?;
        Ok((size, hasher.finalize().to_hex().to_string()))
    }

    /// [`BlobStore::put_stream`], showing each chunk to `check` as it passes and then `None`
    /// before the object is completed: an error from it (or from `chunks`) abandons the upload,
    /// and nothing appears at `key`. Returns the size; a hash the caller wants, its check
    /// computes, so the bytes are gone over once.
    pub async fn put_checked<E: From<StoreError>>(
        &self,
        key: &str,
        chunks: impl futures::Stream<Item = Result<Bytes, E>>,
        mut check: impl FnMut(Option<&[u8]>) -> Result<(), E>,
    ) -> Result<u64, E> {
        let path = Self::path(key)?;
        let upload = self
            .inner
            .put_multipart(&path)
            .await
            .map_err(StoreError::from)?;
        let mut writer =
            object_store::WriteMultipart::new_with_chunk_size(upload, self.part_bytes());
        let mut size = 0u64;
        let mut chunks = std::pin::pin!(chunks);
        loop {
            let chunk = match chunks.next().await {
                Some(Ok(chunk)) => check(Some(&chunk)).map(|()| Some(chunk)),
                Some(Err(e)) => Err(e),
                None => check(None).map(|()| None),
            };
            let chunk = match chunk {
                Ok(Some(chunk)) => chunk,
                Ok(None) => break,
                Err(e) => {
                    let _ = writer.abort().await;
                    return Err(e);
                }
            };
            size += chunk.len() as u64;
            // Memory stays bounded whatever the object's size.
            if let Err(e) = writer.wait_for_capacity(2).await {
                let _ = writer.abort().await;
                return Err(StoreError::from(e).into());
            }
            writer.write(&chunk);
        }
        writer.finish().await.map_err(StoreError::from)?;
        Ok(size)
    }

    /// Bytes per part of a multipart upload: S3 takes no smaller part but the last than 5 MiB;
    /// a local file's parts are written where they go, so smaller ones hold less memory.
    fn part_bytes(&self) -> usize {
        match self.signer {
            Some(_) => UPLOAD_PART_BYTES,
            None => STREAM_CHUNK_BYTES,
        }
    }

    /// The size of an object, `None` when there is none.
    pub async fn size_of(&self, key: &str) -> Result<Option<u64>, StoreError> {
        match self.inner.head(&Self::path(key)?).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads an object.
    pub async fn get(&self, key: &str) -> Result<Bytes, StoreError> {
        Ok(self.inner.get(&Self::path(key)?).await?.bytes().await?)
    }

    /// Reads an object as a stream of chunks, with its size: memory stays a chunk's, whatever
    /// the object's size.
    pub async fn get_stream(
        &self,
        key: &str,
    ) -> Result<(u64, BoxStream<'static, Result<Bytes, StoreError>>), StoreError> {
        let path = Self::path(key)?;
        let result = if self.signer.is_none() {
            // A local file streams in 8 KiB reads by default, each a blocking task: that cut
            // the load benchmark's activation downloads from about 1,400 to 575 MB/s.
            ChunkedStore::new(self.inner.clone(), STREAM_CHUNK_BYTES)
                .get(&path)
                .await?
        } else {
            self.inner.get(&path).await?
        };
        let size = result.meta.size;
        Ok((size, result.into_stream().map_err(StoreError::from).boxed()))
    }

    /// Reads at most `max` bytes of an object; a larger one is [`StoreError::TooLarge`]. The
    /// read itself asks for at most `max + 1` bytes, so an object replaced by a larger one
    /// between the size check and the read (a presigned PUT can land at any time) is still
    /// refused without being read whole.
    pub async fn get_bounded(&self, key: &str, max: u64) -> Result<Bytes, StoreError> {
        let path = Self::path(key)?;
        let too_large = |size| StoreError::TooLarge {
            key: key.to_owned(),
            size,
            max,
        };
        let meta = self.inner.head(&path).await?;
        if meta.size > max {
            return Err(too_large(meta.size));
        }
        if meta.size == 0 {
            return Ok(Bytes::new());
        }
        let options = GetOptions {
            range: Some(GetRange::Bounded(0..max.saturating_add(1))),
            ..GetOptions::default()
        };
        let result = self.inner.get_opts(&path, options).await?;
        let size = result.meta.size;
        if size > max {
            return Err(too_large(size));
        }
        let bytes = result.bytes().await?;
        if bytes.len() as u64 > max {
            return Err(too_large(bytes.len() as u64));
        }
        Ok(bytes)
    }

    /// Moves an object to another key, replacing what is there (on S3: a copy in the store,
    /// then a delete; no bytes pass through here).
    pub async fn rename(&self, from: &str, to: &str) -> Result<(), StoreError> {
        self.inner
            .rename(&Self::path(from)?, &Self::path(to)?)
            .await?;
        Ok(())
    }

    /// Deletes an object; a missing one is fine.
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        match self.inner.delete(&Self::path(key)?).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes every object under `prefix`, returning how many.
    pub async fn delete_prefix(&self, prefix: &str) -> Result<usize, StoreError> {
        let prefix = Self::path(prefix)?;
        let keys: Vec<Path> = self
            .inner
            .list(Some(&prefix))
            .map_ok(|m| m.location)
            .try_collect()
            .await?;
        let n = keys.len();
        let results: Vec<_> = self
            .inner
            .delete_stream(futures::stream::iter(keys.into_iter().map(Ok)).boxed())
            .collect()
            .await;
        for r in results {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(n)
    }

    /// Lists keys under `prefix`.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let prefix = Self::path(prefix)?;
        Ok(self
            .inner
            .list(Some(&prefix))
            .map_ok(|m| m.location.to_string())
            .try_collect()
            .await?)
    }

    /// Lists keys under `prefix` with their sizes in bytes.
    pub async fn list_sizes(&self, prefix: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let prefix = Self::path(prefix)?;
        Ok(self
            .inner
            .list(Some(&prefix))
            .map_ok(|m| (m.location.to_string(), m.size))
            .try_collect()
            .await?)
    }

    /// A presigned URL for `method` on `key`, when the store presigns.
    pub async fn presign(
        &self,
        method: http::Method,
        key: &str,
    ) -> Result<Option<String>, StoreError> {
        let Some(signer) = &self.signer else {
            return Ok(None);
        };
        let url = signer
            .signed_url(method, &Self::path(key)?, self.presign_ttl)
            .await?;
        Ok(Some(url.to_string()))
    }

    /// A presigned upload of `size` bytes to `key` in parts, when the store presigns and the
    /// object is larger than a part (`None` otherwise: one PUT takes it). The object appears at
    /// `key` only once [`BlobStore::complete_parts`] completes it.
    pub async fn presign_parts(
        &self,
        key: &str,
        size: u64,
    ) -> Result<Option<PresignedParts>, StoreError> {
        use object_store::multipart::MultipartStore;
        use object_store::signer::SignedUrlOptions;
        let Some(signer) = &self.signer else {
            return Ok(None);
        };
        if size <= self.presign_part_bytes {
            return Ok(None);
        }
        // Within S3's count of parts, whatever the object's size.
        let part_bytes = self.presign_part_bytes.max(size.div_ceil(MAX_PARTS));
        let path = Self::path(key)?;
        let upload_id = signer.create_multipart(&path).await?;
        let mut urls = Vec::new();
        for number in 1..=size.div_ceil(part_bytes) {
            let options = SignedUrlOptions::default().with_query([
                ("partNumber", number.to_string()),
                ("uploadId", upload_id.clone()),
            ]);
            let url = signer
                .signed_url_opts(http::Method::PUT, &path, self.presign_ttl, &options)
                .await?;
            urls.push(url.to_string());
        }
        Ok(Some(PresignedParts {
            upload_id,
            part_bytes,
            urls,
        }))
    }

    /// Completes the upload in parts `upload_id` of `key` from its parts' `ETag`s, in order:
    /// the object appears at `key`.
    pub async fn complete_parts(
        &self,
        key: &str,
        upload_id: &str,
        etags: &[String],
    ) -> Result<(), StoreError> {
        use object_store::multipart::{MultipartStore, PartId};
        let Some(signer) = &self.signer else {
            return Err(StoreError::Backend(
                "this store takes no uploads in parts".into(),
            ));
        };
        if etags.len() as u64 > MAX_PARTS {
            return Err(StoreError::Backend(format!(
                "{} parts, more than an upload has",
                etags.len()
            )));
        }
        let parts = etags
            .iter()
            .map(|etag| PartId {
                content_id: etag.clone(),
            })
            .collect();
        signer
            .complete_multipart(&Self::path(key)?, &upload_id.to_owned(), parts)
            .await?;
        Ok(())
    }

    /// How long presigned URLs last (zero for a store that does not presign).
    pub fn presign_ttl(&self) -> Duration {
        self.presign_ttl
    }

    /// How long after the last presigned URL for a key was handed out a PUT to it may still
    /// land: the URL's lifetime, and as long again (up to a minute) for a store whose clock runs
    /// behind ours. Zero for a store that does not presign.
    pub fn upload_grace(&self) -> Duration {
        self.presign_ttl + self.presign_ttl.min(Duration::from_secs(60))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_store_urls() {
        assert_eq!(
            StoreConfig::parse("/tmp/x"),
            Ok(StoreConfig::Local("/tmp/x".into()))
        );
        assert_eq!(
            StoreConfig::parse("file:///tmp/x"),
            Ok(StoreConfig::Local("/tmp/x".into()))
        );
        assert_eq!(
            StoreConfig::parse("s3://b?endpoint=http://127.0.0.1:5000&region=us-east-1"),
            Ok(StoreConfig::S3 {
                bucket: "b".into(),
                endpoint: Some("http://127.0.0.1:5000".into()),
                region: Some("us-east-1".into()),
                presign_ttl: DEFAULT_PRESIGN_TTL,
                part_bytes: DEFAULT_PART_BYTES,
            })
        );
        assert_eq!(
            StoreConfig::parse("s3://b?presign_ttl_s=30&part_mb=5"),
            Ok(StoreConfig::S3 {
                bucket: "b".into(),
                endpoint: None,
                region: None,
                presign_ttl: Duration::from_secs(30),
                part_bytes: 5 << 20,
            })
        );
        for bad in ["0", "4", "5121", "big"] {
            let e = StoreConfig::parse(&format!("s3://b?part_mb={bad}")).unwrap_err();
            assert!(e.contains("part_mb"), "{bad}: {e}");
        }
        for bad in ["0", "-1", "1.5", "604801", "soon"] {
            let e = StoreConfig::parse(&format!("s3://b?presign_ttl_s={bad}")).unwrap_err();
            assert!(e.contains("presign_ttl_s"), "{bad}: {e}");
        }
        assert!(StoreConfig::parse("s3://").is_err());
        assert!(StoreConfig::parse("s3://b?colour=red").is_err());
    }

    #[tokio::test]
    async fn local_round_trip_and_key_checks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = BlobStore::open(&StoreConfig::Local(dir.path().into())).expect("open");
        store
            .put("runs/1/a.bin", Bytes::from_static(b"abc"))
            .await
            .expect("put");
        assert_eq!(store.get("runs/1/a.bin").await.expect("get"), &b"abc"[..]);
        assert!(matches!(
            store.get_bounded("runs/1/a.bin", 2).await,
            Err(StoreError::TooLarge {
                size: 3,
                max: 2,
                ..
            })
        ));
        assert_eq!(
            store.get_bounded("runs/1/a.bin", 3).await.expect("fits"),
            &b"abc"[..]
        );
        let (size, chunks) = store.get_stream("runs/1/a.bin").await.expect("stream");
        let streamed: Vec<Bytes> = chunks.try_collect().await.expect("chunks");
        assert_eq!((size, streamed.concat()), (3, b"abc".to_vec()));
        assert!(matches!(
            store.get("runs/1/missing").await,
            Err(StoreError::NotFound(_))
        ));
        assert!(matches!(
            store.get("../etc/passwd").await,
            Err(StoreError::BadKey(_))
        ));
        assert_eq!(store.delete_prefix("runs/1").await.expect("gc"), 1);
        assert!(store.list("runs").await.expect("list").is_empty());
        assert_eq!(
            store.presign(http::Method::GET, "x").await.expect("p"),
            None
        );
    }

    /// A checked write that the check refuses, mid-way or at the end, leaves nothing behind: no
    /// object and no part of one. A write it accepts is whole.
    #[tokio::test]
    async fn a_refused_checked_write_leaves_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = BlobStore::open(&StoreConfig::Local(dir.path().into())).expect("open");
        let chunks = || {
            futures::stream::iter(
                (0..5u8).map(|i| Ok::<_, StoreError>(Bytes::from(vec![i; STREAM_CHUNK_BYTES]))),
            )
        };
        let refuse_at = |at: usize| {
            let mut seen = 0;
            move |chunk: Option<&[u8]>| {
                seen += 1;
                match (seen == at, chunk) {
                    (true, _) => Err(StoreError::Backend("refused".into())),
                    (false, _) => Ok(()),
                }
            }
        };
        for at in [1, 3, 6] {
            let r = store.put_checked("runs/1/x", chunks(), refuse_at(at)).await;
            assert!(matches!(r, Err(StoreError::Backend(_))), "{at}: {r:?}");
            let left: Vec<_> = walk(dir.path());
            assert!(left.is_empty(), "refused at {at}, left {left:?}");
        }
        let size = store
            .put_checked("runs/1/x", chunks(), refuse_at(7))
            .await
            .expect("accepted");
        let whole = store.get("runs/1/x").await.expect("get");
        assert_eq!(size, 5 * STREAM_CHUNK_BYTES as u64);
        assert_eq!(whole.len() as u64, size);
        let (size, hash) = store
            .put_stream("runs/1/y", futures::stream::iter([Ok(whole.clone())]))
            .await
            .expect("put_stream");
        assert_eq!(size, whole.len() as u64);
        assert_eq!(hash, blake3::hash(&whole).to_hex().to_string());
    }

    /// Every file under `dir`, parts of uploads in progress included.
    fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).expect("read dir").flatten() {
            let path = entry.path();
            match path.is_dir() {
                true => files.extend(walk(&path)),
                false => files.push(path),
            }
        }
        files
    }
}
