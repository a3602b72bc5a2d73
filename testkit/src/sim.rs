//! Simulated miners: the real API client and wire formats, random tensors of the right shapes
//! instead of a model. For integration tests, load benchmarks and trying an orchestrator out.
//!
//! A simulated miner follows the protocol exactly (leases, uploads, completions, pseudo-gradient
//! partitions, merges with deterministic arithmetic so honest owners agree) but computes nothing
//! meaningful. `wrong_merge` makes it publish a corrupted merge, to exercise disputes.

use std::sync::Arc;

use bytes::Bytes;
use iota_protocol::api::*;
use iota_protocol::client::{ApiClient, ClientError, RetryPolicy};
use iota_protocol::signing::RequestSigner;
use iota_protocol::tensor::{
    WireEncoding, decode_partition, encode_boundary_f32, encode_boundary_i4, encode_boundary_i8,
    encode_merged, encode_partition,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What one simulated miner did in one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Hops completed.
    pub hops: u32,
    /// Pseudo-gradient partitions uploaded.
    pub pseudo_gradients: u32,
    /// Merges uploaded.
    pub merges: u32,
    /// Requests refused because a lease lapsed (work re-routed elsewhere).
    pub lease_lost: u32,
}

/// A miner that speaks the protocol with random tensors.
pub struct SimMiner {
    client: ApiClient,
    /// Assigned stage.
    pub stage: u32,
    /// The run.
    pub config: RunConfig,
    rng: StdRng,
    epoch: u64,
    backward_done: u64,
    uploaded_epoch: Option<u64>,
    inner_step: u64,
    /// Publish corrupted merges.
    pub wrong_merge: bool,
    /// Upload pseudo-gradients in the uploading phase (off: whoever drives the miner uploads).
    pub uploads_pseudo_gradients: bool,
}

impl SimMiner {
    /// Joins the run at `base` as `signer`.
    pub async fn join(
        base: &str,
        signer: Arc<dyn RequestSigner>,
        tokens_per_s: f64,
        seed: u64,
    ) -> Result<Self, ClientError> {
        let client = ApiClient::connect(
            base,
            signer,
            RetryPolicy {
                attempts: 4,
                base: std::time::Duration::from_millis(50),
                max: std::time::Duration::from_millis(500),
                timeout: std::time::Duration::from_secs(20),
            },
        )
        .await?;
        let joined = client
            .register(Capacity {
                device: "sim".into(),
                memory_bytes: 64 << 30,
                tokens_per_s,
            })
            .await?;
        Ok(Self {
            client,
            stage: joined.stage,
            config: joined.run.config,
            rng: StdRng::seed_from_u64(seed),
            epoch: joined.status.epoch,
            backward_done: 0,
            uploaded_epoch: None,
            inner_step: 0,
            wrong_merge: false,
            uploads_pseudo_gradients: true,
        })
    }

    /// The client (to make other calls as this miner).
    pub fn client(&self) -> &ApiClient {
        &self.client
    }

    fn boundary(&mut self) -> Bytes {
        let shape = self.config.boundary_shape();
        let n = (shape[0] * shape[1] * shape[2]) as usize;
        match self.config.wire {
            WireEncoding::F32 => {
                let v: Vec<f32> = (0..n).map(|_| self.rng.gen_range(-1.0..1.0)).collect();
                Bytes::from(encode_boundary_f32(shape, &v))
            }
            WireEncoding::Int8 => {
                let v: Vec<i8> = (0..n).map(|_| self.rng.gen_range(-127..=127)).collect();
                let rows = (shape[0] * shape[1]) as usize;
                let s: Vec<f32> = (0..rows).map(|_| self.rng.gen_range(0.001..0.01)).collect();
                Bytes::from(encode_boundary_i8(shape, &v, &s))
            }
            WireEncoding::Int4 => {
                let v: Vec<i8> = (0..n).map(|_| self.rng.gen_range(-7..=7)).collect();
                let rows = (shape[0] * shape[1]) as usize;
                // bf16 0.001..0.01: 0x3a83 is 0.001, 0x3c23 is 0.00995.
                let s: Vec<u16> = (0..rows)
                    .map(|_| self.rng.gen_range(0x3a83..0x3c23))
                    .collect();
                Bytes::from(encode_boundary_i4(shape, &v, &s))
            }
        }
    }

    /// One round: heartbeat, leased work, and whatever the phase asks for.
    pub async fn step(&mut self) -> Result<StepReport, ClientError> {
        let mut report = StepReport::default();
        let beat = self.client.heartbeat(None).await?;
        if beat.status.epoch != self.epoch {
            self.epoch = beat.status.epoch;
            self.backward_done = 0;
            self.inner_step = 0;
        }
        let work = self.client.work(4).await?;
        for item in work.items {
            match self.run_item(&item).await {
                Ok(()) => {
                    report.hops += 1;
                    let last = item.stage + 1 == self.config.stages;
                    if item.direction == Direction::Backward || last {
                        self.backward_done += 1;
                    }
                }
                Err(e) if e.code() == Some(iota_protocol::ErrorCode::LeaseExpired) => {
                    report.lease_lost += 1;
                }
                Err(e) => return Err(e),
            }
        }
        match work.status.phase {
            Phase::Uploading
                if self.uploads_pseudo_gradients
                    && self.uploaded_epoch != Some(work.status.epoch)
                    && self.backward_done > 0 =>
            {
                report.pseudo_gradients = self.upload_pseudo_gradients(work.status.epoch).await?;
                self.uploaded_epoch = Some(work.status.epoch);
            }
            Phase::Merging => report.merges = self.merge().await?,
            _ => {}
        }
        Ok(report)
    }

    async fn run_item(&mut self, item: &WorkItem) -> Result<(), ClientError> {
        if let Some(input) = &item.input {
            self.client.download(input).await?;
        }
        let output = if item.expects_output {
            let bytes = self.boundary();
            Some(
                self.client
                    .upload_output(item.task_id, item.lease, bytes)
                    .await?
                    .blob,
            )
        } else {
            None
        };
        let last_forward =
            item.direction == Direction::Forward && item.stage + 1 == self.config.stages;
        self.inner_step += u64::from(item.direction == Direction::Backward);
        // The last forward reports each sequence's loss; the sample's is their mean.
        let sequence_losses: Option<Vec<f64>> = last_forward.then(|| {
            (0..self.config.micro_batch)
                .map(|_| self.rng.gen_range(2.0..3.0))
                .collect()
        });
        let loss = sequence_losses
            .as_ref()
            .map(|v| v.iter().sum::<f64>() / v.len().max(1) as f64);
        self.client
            .complete(
                item.task_id,
                &CompleteRequest {
                    lease: item.lease,
                    output,
                    inner_step: self.inner_step,
                    weights_digest: format!("{:064x}", self.inner_step),
                    loss,
                    sequence_losses,
                    compute_ms: Some(1),
                },
            )
            .await?;
        Ok(())
    }

    async fn upload_pseudo_gradients(&mut self, epoch: u64) -> Result<u32, ClientError> {
        let mut n = 0;
        for p in 0..self.config.partitions {
            let Some(range) = self.config.partition_range(self.stage, p) else {
                continue;
            };
            let values: Vec<f32> = (range.start..range.end)
                .map(|_| self.rng.gen_range(-0.01..0.01))
                .collect();
            let bytes = Bytes::from(encode_partition(&values));
            let path = format!("/v1/miner/epochs/{epoch}/pseudo-gradients/{p}");
            let uploaded = match self.presigned_upload(&path, bytes.clone()).await {
                Some(result) => result,
                None => self.client.upload_pseudo_gradient(epoch, p, bytes).await,
            };
            match uploaded {
                Ok(_) => n += 1,
                Err(e) if e.code() == Some(iota_protocol::ErrorCode::WrongPhase) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    }

    /// Uploads `bytes` to the slot at `path` straight to the store, when the orchestrator's store
    /// presigns: presign, PUT, commit (as a miner with an S3 store may). `None` when it does not
    /// presign (the bytes then go through the orchestrator).
    async fn presigned_upload(
        &self,
        path: &str,
        bytes: Bytes,
    ) -> Option<Result<UploadResponse, ClientError>> {
        let blake3 = blake3::hash(&bytes).to_hex().to_string();
        let request = PresignRequest {
            size: bytes.len() as u64,
            blake3: blake3.clone(),
            multipart: false,
        };
        let target: PresignResponse = match self
            .client
            .signed_json(reqwest::Method::POST, &format!("{path}/presign"), &request)
            .await
        {
            Ok(target) => target,
            Err(e) if e.code() == Some(iota_protocol::ErrorCode::BadRequest) => return None,
            Err(e) => return Some(Err(e)),
        };
        let put = reqwest::Client::new()
            .put(&target.url)
            .body(bytes.clone())
            .send()
            .await
            .and_then(|r| r.error_for_status());
        if let Err(e) = put {
            return Some(Err(ClientError::Network(e.to_string())));
        }
        let commit = CommitRequest {
            key: target.key,
            size: bytes.len() as u64,
            blake3,
            multipart: None,
        };
        Some(
            self.client
                .signed_json(reqwest::Method::POST, &format!("{path}/commit"), &commit)
                .await,
        )
    }

    async fn merge(&mut self) -> Result<u32, ClientError> {
        let assignments = self.client.merges().await?.assignments;
        let mut n = 0;
        for a in assignments {
            let len = a.end - a.start;
            let mut parts = Vec::with_capacity(a.contributions.len());
            for c in &a.contributions {
                let bytes = self.client.download(&c.blob).await?;
                let values = decode_partition(&bytes, len)
                    .map_err(|e| ClientError::BadObject(e.to_string()))?;
                parts.push((c.weight, values));
            }
            let mut merged = average(&parts, len as usize);
            if self.wrong_merge
                && let Some(first) = merged.first_mut()
            {
                *first += 1.0;
            }
            let momentum = vec![0.0f32; len as usize];
            let bytes = Bytes::from(encode_merged(&merged, &momentum));
            let path = format!(
                "/v1/miner/epochs/{}/merges/{}/{}",
                a.epoch, a.stage, a.partition
            );
            let uploaded = match self.presigned_upload(&path, bytes.clone()).await {
                Some(result) => result,
                None => {
                    self.client
                        .upload_merge(a.epoch, a.stage, a.partition, bytes)
                        .await
                }
            };
            match uploaded {
                Ok(_) => n += 1,
                Err(e) if e.code() == Some(iota_protocol::ErrorCode::WrongPhase) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    }
}

/// Deterministic weighted average in contributor order (the same bits on every machine).
pub fn average(parts: &[(f64, Vec<f32>)], len: usize) -> Vec<f32> {
    let total: f64 = parts.iter().map(|(w, _)| *w).sum();
    let mut out = vec![0.0f32; len];
    if total <= 0.0 {
        return out;
    }
    for (w, values) in parts {
        let scale = (*w / total) as f32;
        for (o, v) in out.iter_mut().zip(values) {
            *o += scale * v;
        }
    }
    out
}
