//! Moving tensors and dataset files: uploads (presigned, in parts, or through the
//! orchestrator) and downloads checked against their descriptors while they stream.

use super::*;

impl ApiClient {
    /// PUTs tensor bytes to `path` with their BLAKE3 in the (signed) query, as every upload route
    /// expects.
    pub(super) async fn put_tensor(
        &self,
        path: &str,
        bytes: Bytes,
    ) -> Result<UploadResponse, ClientError> {
        let sep = if path.contains('?') { '&' } else { '?' };
        let path = format!("{path}{sep}blake3={}", blake3_hex(&bytes));
        self.signed_raw(Method::PUT, &path, Some(bytes)).await
    }

    /// Uploads a tensor to the slot at `route` (its query, such as a lease, in `query`): with
    /// direct uploads, PUT straight to the store through a presigned URL (`{route}/presign`) and
    /// have the orchestrator check and record it (`{route}/commit`); otherwise PUT to the
    /// orchestrator. A presigned PUT that fails is tried again under the client's retry policy
    /// (each try sends the whole object: it is one PUT).
    pub(super) async fn upload(
        &self,
        route: &str,
        query: &str,
        bytes: Bytes,
    ) -> Result<UploadResponse, ClientError> {
        if !self.direct_uploads {
            return self.put_tensor(&format!("{route}{query}"), bytes).await;
        }
        let blake3 = blake3_hex(&bytes);
        let size = bytes.len() as u64;
        let presigned = self
            .signed_json(
                Method::POST,
                &format!("{route}/presign{query}"),
                &PresignRequest {
                    size,
                    blake3: blake3.clone(),
                    multipart: true,
                },
            )
            .await;
        let target: PresignResponse = match presigned {
            Ok(target) => target,
            // The slot holds a recorded result already (an upload sent again after its answer
            // was lost): no URL is handed out for it, and the orchestrator's own route answers
            // the same bytes from the record and refuses others.
            Err(e)
                if matches!(
                    e.code(),
                    Some(ErrorCode::LeaseExpired | ErrorCode::Conflict)
                ) =>
            {
                return self.put_tensor(&format!("{route}{query}"), bytes).await;
            }
            Err(e) => return Err(e),
        };
        let multipart = match &target.multipart {
            None => {
                self.with_retries(|_| self.try_presigned_put(&target.url, &target.key, &bytes))
                    .await?;
                None
            }
            Some(parts) => Some(self.put_parts(parts, &target.key, &bytes).await?),
        };
        self.signed_json(
            Method::POST,
            &format!("{route}/commit{query}"),
            &CommitRequest {
                key: target.key,
                size,
                blake3,
                multipart,
            },
        )
        .await
    }

    /// PUTs `bytes` in the parts `target` names, each under the retry policy on its own: a part
    /// whose connection drops is sent again, and the parts already in the store stay.
    pub(super) async fn put_parts(
        &self,
        target: &MultipartTarget,
        key: &str,
        bytes: &Bytes,
    ) -> Result<MultipartCommit, ClientError> {
        let part = usize::try_from(target.part_bytes)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| ClientError::BadObject("a part size of 0".into()))?;
        let parts = bytes.len().div_ceil(part).max(1);
        if parts != target.part_urls.len() {
            return Err(ClientError::BadObject(format!(
                "{} bytes make {parts} parts of {part}, the store named {}",
                bytes.len(),
                target.part_urls.len()
            )));
        }
        let mut etags = Vec::with_capacity(parts);
        for (i, url) in target.part_urls.iter().enumerate() {
            let piece = bytes.slice(i * part..((i + 1) * part).min(bytes.len()));
            let etag = self
                .with_retries(|_| self.try_presigned_put(url, key, &piece))
                .await?;
            etags.push(String::from_utf8_lossy(&etag).into_owned());
        }
        Ok(MultipartCommit {
            upload_id: target.upload_id.clone(),
            etags,
        })
    }

    /// One attempt of a presigned PUT of `bytes` to `url` (for the object `key`): the `ETag`
    /// the store answered.
    pub(super) async fn try_presigned_put(&self, url: &str, key: &str, bytes: &Bytes) -> Attempt {
        let put = self
            .http
            .put(url)
            .timeout(self.retry.timeout_for(bytes.len() as u64))
            .body(bytes.clone());
        let resp = match put.send().await {
            Ok(resp) => resp,
            Err(e) => return Attempt::network(e.to_string()),
        };
        let status = resp.status();
        if status.is_success() {
            let etag = resp
                .headers()
                .get(reqwest::header::ETAG)
                .map(|v| Bytes::copy_from_slice(v.as_bytes()))
                .unwrap_or_default();
            return Attempt::Final(Ok(etag));
        }
        let error = ClientError::Network(format!("store answered {status} to the upload of {key}"));
        match is_retryable_status(status) {
            true => Attempt::Again {
                error,
                retry_after: retry_after(&resp),
            },
            false => Attempt::Final(Err(error)),
        }
    }

    /// Downloads a blob (presigned URL or the orchestrator) and checks its size and hash. The
    /// body is read as a stream and refused as soon as it is longer than the descriptor's size
    /// (or its Content-Length says it is not that size): whoever can write the object cannot
    /// make a consumer hold more than the descriptor promised. An object the store does not
    /// have is [`ClientError::Api`] with status 404 and [`ErrorCode::NotFound`], however it is
    /// served.
    pub async fn download(&self, blob: &BlobDescriptor) -> Result<Bytes, ClientError> {
        if blob.size > self.max_object_bytes {
            return Err(ClientError::BadObject(format!(
                "{}: the descriptor says {} bytes, more than any object of this run ({})",
                blob.key, blob.size, self.max_object_bytes
            )));
        }
        let limit = BodyLimit::Exact(blob.size);
        let bytes = match &blob.url {
            Some(url) => self.presigned_get(url, blob, limit).await?,
            None => {
                self.request_bytes(
                    Method::GET,
                    &format!("/v1/blobs/{}", blob.key),
                    None,
                    true,
                    "application/octet-stream",
                    limit,
                )
                .await?
            }
        };
        blob.check_bytes(&bytes).map_err(ClientError::BadObject)?;
        Ok(bytes)
    }

    /// A download straight from the store, retried as API requests are (network errors, 408,
    /// 429, 5xx such as S3's 503 SlowDown); a 404 or another refusal is final.
    pub(super) async fn presigned_get(
        &self,
        url: &str,
        blob: &BlobDescriptor,
        limit: BodyLimit,
    ) -> Result<Bytes, ClientError> {
        self.with_retries(|_| self.try_presigned_get(url, blob, limit))
            .await
    }

    /// One attempt of [`ApiClient::presigned_get`].
    pub(super) async fn try_presigned_get(
        &self,
        url: &str,
        blob: &BlobDescriptor,
        limit: BodyLimit,
    ) -> Attempt {
        let get = self
            .http
            .get(url)
            .timeout(self.retry.timeout_for(blob.size));
        let mut resp = match get.send().await {
            Ok(resp) => resp,
            Err(e) => return Attempt::network(e.to_string()),
        };
        let status = resp.status();
        if status == StatusCode::NOT_FOUND {
            return Attempt::Final(Err(ClientError::Api {
                status: status.as_u16(),
                error: ApiError::new(
                    ErrorCode::NotFound,
                    format!("the store has no object {}", blob.key),
                ),
            }));
        }
        if !status.is_success() {
            let error = ClientError::Network(format!("store answered {status} for {}", blob.key));
            return match is_retryable_status(status) {
                true => Attempt::Again {
                    error,
                    retry_after: retry_after(&resp),
                },
                false => Attempt::Final(Err(error)),
            };
        }
        match read_body(&mut resp, limit).await {
            Ok(b) => Attempt::Final(Ok(b)),
            Err(BodyError::Network(e)) => Attempt::network(e),
            Err(BodyError::Refused(declared)) => {
                Attempt::Final(Err(limit.refusal(&blob.key, declared)))
            }
        }
    }

    /// The files of the run's prepared dataset in its store, with download URLs where the store
    /// presigns (`GET /v1/dataset`).
    pub async fn dataset_files(&self) -> Result<DatasetFiles, ClientError> {
        self.signed_raw(Method::GET, "/v1/dataset", None).await
    }

    /// Downloads a dataset file (presigned URL or the orchestrator) into `dest`, streamed: the
    /// bytes go to a temporary sibling (`dest` with `.part` appended) while they are hashed,
    /// and it is renamed to `dest` only once its size and BLAKE3 are the descriptor's. Memory
    /// stays a chunk's whatever the size, and a body longer than the descriptor's size is cut
    /// off. The caller checks the descriptor itself (its size and hash against the manifest)
    /// first: this is how a shard, larger than any object of the run, is fetched.
    pub async fn download_file(
        &self,
        file: &DatasetFile,
        dest: &std::path::Path,
    ) -> Result<(), ClientError> {
        let mut part = dest.as_os_str().to_owned();
        part.push(".part");
        let part = std::path::PathBuf::from(part);
        let session = match &file.url {
            None => self.session().await,
            Some(_) => None,
        };
        let mut result = self
            .with_retries(|_| self.try_download_file(file, session.as_ref(), &part))
            .await;
        if let (Some(old), Err(e)) = (&session, &result)
            && matches!(
                e.code(),
                Some(ErrorCode::UnknownSession | ErrorCode::Unauthenticated)
            )
        {
            self.sessions.forget(&old.token);
            let session = self.session().await;
            result = self
                .with_retries(|_| self.try_download_file(file, session.as_ref(), &part))
                .await;
        }
        if let Err(e) = result {
            let _ = tokio::fs::remove_file(&part).await;
            return Err(e);
        }
        tokio::fs::rename(&part, dest)
            .await
            .map_err(|e| ClientError::Io(format!("{} -> {}: {e}", part.display(), dest.display())))
    }

    /// One attempt of [`ApiClient::download_file`]: the whole file again, into `part`.
    pub(super) async fn try_download_file(
        &self,
        file: &DatasetFile,
        session: Option<&ClientSession>,
        part: &std::path::Path,
    ) -> Attempt {
        use tokio::io::AsyncWriteExt;
        let timeout = self.retry.timeout_for(file.size);
        let path_and_query = format!("/v1/blobs/{}", file.key);
        let req = match &file.url {
            Some(url) => self.http.get(url).timeout(timeout),
            None => {
                let url = match self.url_of(&path_and_query) {
                    Ok(u) => u,
                    Err(e) => return Attempt::Final(Err(e)),
                };
                let headers = authenticate_request(
                    self.signer.as_ref(),
                    session,
                    &self.orchestrator,
                    "GET",
                    &path_and_query,
                    &[],
                    now_ms(),
                    Uuid::new_v4(),
                );
                let mut req = self.http.get(url).timeout(timeout);
                for (name, value) in headers.headers {
                    req = req.header(name, value);
                }
                req
            }
        };
        let mut resp = match req.send().await {
            Ok(resp) => resp,
            Err(e) => return Attempt::network(e.to_string()),
        };
        let status = resp.status();
        if !status.is_success() {
            let retry_after = retry_after(&resp);
            let body = read_body(&mut resp, BodyLimit::ErrorBody)
                .await
                .unwrap_or_default();
            let error = serde_json::from_slice::<ApiError>(&body).unwrap_or_else(|_| {
                let code = match status {
                    StatusCode::NOT_FOUND => ErrorCode::NotFound,
                    _ => ErrorCode::Internal,
                };
                ApiError::new(
                    code,
                    format!("the store answered {status} for {}", file.key),
                )
            });
            let error = ClientError::Api {
                status: status.as_u16(),
                error,
            };
            return match is_retryable_status(status) {
                true => Attempt::Again { error, retry_after },
                false => Attempt::Final(Err(error)),
            };
        }
        if let Some(n) = resp.content_length()
            && n != file.size
        {
            return Attempt::Final(Err(BodyLimit::Exact(file.size).refusal(&file.key, Some(n))));
        }
        let io = |e: std::io::Error| {
            Attempt::Final(Err(ClientError::Io(format!("{}: {e}", part.display()))))
        };
        let mut out = match tokio::fs::File::create(part).await {
            Ok(f) => f,
            Err(e) => return io(e),
        };
        let mut hasher = blake3::Hasher::new();
        let mut got = 0u64;
        loop {
            let chunk = match resp.chunk().await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => return Attempt::network(e.to_string()),
            };
            got = got.saturating_add(chunk.len() as u64);
            if got > file.size {
                return Attempt::Final(Err(BodyLimit::Exact(file.size).refusal(&file.key, None)));
            }
            hasher.update(&chunk);
            if let Err(e) = out.write_all(&chunk).await {
                return io(e);
            }
        }
        if let Err(e) = out.flush().await {
            return io(e);
        }
        if let Err(e) = out.sync_all().await {
            return io(e);
        }
        if got != file.size {
            // A body cut short: the connection failed, worth another attempt.
            return Attempt::network(format!(
                "{}: {got} bytes arrived, the descriptor says {}",
                file.key, file.size
            ));
        }
        let hash = hasher.finalize().to_hex();
        if hash.as_str() != file.blake3 {
            return Attempt::Final(Err(ClientError::BadObject(format!(
                "{}: BLAKE3 {hash}, expected {}",
                file.key, file.blake3
            ))));
        }
        Attempt::Final(Ok(Bytes::new()))
    }
}
