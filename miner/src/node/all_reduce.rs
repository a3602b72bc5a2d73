//! The all-reduce side of the miner loop: loading an epoch's start weights (or, in a sparse
//! run, applying the accepted updates), uploading pseudo-gradients and merging the partitions
//! this miner owns.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use iota_model::ModelError;
use iota_protocol::BlobDescriptor;
use iota_protocol::ErrorCode;
use iota_protocol::api::MergeAssignment;
use iota_protocol::tensor::{decode_merged, decode_partition, encode_partition};
use iota_trainer::{initial_range, run_model};

use super::{Node, blocking, build_trainer};
use crate::adversary::Adversary;
use crate::error::MinerError;
use crate::status::AllReduceBytes;

impl Node {
    /// Downloads the stage's merged weights (checking every hash) and starts epoch `epoch`
    /// from them, one partition at a time.
    pub(super) async fn load_weights(&mut self, epoch: u64) -> Result<(), MinerError> {
        if self.run.sparse.is_some() {
            return self.apply_updates(epoch).await;
        }
        let weights = self.client.epoch_start_weights(self.stage, epoch).await?;
        let mut loaded = Vec::with_capacity(weights.partitions.len());
        for (j, blob) in weights.partitions.iter().enumerate() {
            let j = j as u32;
            let values = match blob {
                Some(b) => {
                    let len = self
                        .run
                        .partition_range(self.stage, j)
                        .map(|r| r.end - r.start)
                        .ok_or_else(|| MinerError::RunMismatch(format!("no partition {j}")))?;
                    let bytes = self.merged(b, |r| &mut r.weights_received).await?;
                    let (values, _momentum) = decode_merged(&bytes, len)
                        .map_err(|e| MinerError::BadInput(format!("merged partition {j}: {e}")))?;
                    loaded.push((b.blake3.clone(), bytes));
                    Some(values)
                }
                None => None,
            };
            blocking(&self.trainer, move |t| {
                t.load_partition(j, values.as_deref())
            })
            .await?;
        }
        // What was just loaded is the next merge's bases; nothing older is needed.
        self.merged_blobs.hold_only(loaded);
        blocking(&self.trainer, move |t| t.begin_epoch(epoch)).await?;
        self.started(epoch).await
    }

    /// A sparse run's epoch start: every epoch's merged updates since the one the trainer
    /// holds the start of (the initial weights for a new trainer) applied in turn, as every
    /// miner of the stage applies them. An epoch's updates are all downloaded and checked
    /// before any is applied, so a bad one leaves the trainer as it was.
    pub(super) async fn apply_updates(&mut self, epoch: u64) -> Result<(), MinerError> {
        let held = blocking(&self.trainer, |t| Ok(t.epoch())).await?;
        let from = match held {
            // Back to this epoch's start: its training is dropped.
            Some(e) if e == epoch => epoch,
            Some(e) if e < epoch => e,
            // A trainer ahead of the run (it restarted): start again from the initial weights.
            Some(_) => {
                let (trainer, _) =
                    build_trainer(&self.cfg, &self.run, self.stage, self.memory_bytes).await?;
                self.trainer = Arc::new(Mutex::new(trainer));
                0
            }
            None => 0,
        };
        // Each step applies one epoch's merged updates (`None`: back to this epoch's start).
        let steps: Vec<Option<u64>> = match from == epoch {
            true => vec![None],
            false => (from..epoch).map(Some).collect(),
        };
        let mut loaded = Vec::new();
        for step in steps {
            let (updates, next) = match step {
                Some(k) => {
                    let w = self.client.epoch_start_weights(self.stage, k + 1).await?;
                    (w.partitions, k + 1)
                }
                None => (vec![None; self.run.partitions as usize], epoch),
            };
            loaded.clear();
            let mut bytes = Vec::with_capacity(updates.len());
            for (j, blob) in updates.iter().enumerate() {
                let Some(b) = blob else {
                    bytes.push(None);
                    continue;
                };
                let shape = iota_trainer::sparse::merged_shape(&self.run, self.stage, j as u32)?;
                let got = self.merged(b, |r| &mut r.weights_received).await?;
                iota_trainer::sparse::decode(&got, shape)
                    .map_err(|e| MinerError::BadInput(format!("merged update {j}: {e}")))?;
                loaded.push((b.blake3.clone(), got.clone()));
                bytes.push(Some(got));
            }
            blocking(&self.trainer, move |t| {
                for (j, b) in bytes.iter().enumerate() {
                    t.apply_update(j as u32, b.as_deref())?;
                }
                t.begin_epoch(next)
            })
            .await?;
        }
        self.merged_blobs.hold_only(loaded);
        self.started(epoch).await
    }

    /// Steps the remaining gradients and uploads the pseudo-gradient partition by partition.
    pub(super) async fn upload_pseudo_gradients(&mut self, epoch: u64) -> Result<bool, MinerError> {
        let hops = blocking(&self.trainer, |t| Ok(t.gradient_hops())).await?;
        if hops == 0 {
            // Nothing to contribute yet; a backward of a sample it forwarded may still come.
            return Ok(false);
        }
        // Before the deadline, this holds the phase open until every partition is in.
        match self.client.reserve_pseudo_gradients(epoch).await {
            Ok(r) => tracing::debug!(epoch, holds_until_ms = r.holds_until_ms, "upload reserved"),
            // Past the deadline, the uploads still land until the phase changes.
            Err(e) => tracing::warn!(epoch, error = %e, "could not reserve the upload"),
        }
        if self.cfg.adversary == Some(Adversary::Withhold) {
            self.ended = Some(epoch);
            tracing::info!(epoch, hops, "pseudo-gradient withheld (adversary)");
            return Ok(true);
        }
        blocking(&self.trainer, |t| t.finish_training()).await?;
        let inner_steps = blocking(&self.trainer, |t| Ok(t.inner_steps())).await?;
        let mut sum_sq = 0.0f64;
        let sparse = self.run.sparse.is_some();
        for j in 0..self.run.partitions {
            let (bytes, sq) = blocking(&self.trainer, move |t| {
                let values = t.pseudo_gradient(j)?;
                let sq = values.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>();
                let bytes = match sparse {
                    true => t.sparse_pseudo_gradient(j)?,
                    false => encode_partition(&values),
                };
                Ok((bytes, sq))
            })
            .await?;
            sum_sq += sq;
            let size = bytes.len() as u64;
            match self
                .client
                .upload_pseudo_gradient(epoch, j, Bytes::from(bytes))
                .await
            {
                Ok(_) => {
                    self.status.send_modify(|s| {
                        s.pseudo_gradients += 1;
                        s.bytes_uploaded += size;
                        s.all_reduce.pseudo_gradients_sent += size;
                    });
                    metrics::counter!("iota_miner_pseudo_gradients_total").increment(1);
                }
                Err(e) if e.code() == Some(ErrorCode::WrongPhase) => {
                    tracing::warn!(epoch, partition = j, "the upload phase ended first");
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.ended = Some(epoch);
        tracing::info!(
            epoch,
            stage = self.stage,
            hops,
            inner_steps,
            norm = sum_sq.sqrt(),
            "pseudo-gradient uploaded"
        );
        Ok(true)
    }

    /// Merges every partition this miner owns in the current round.
    pub(super) async fn merge(&mut self) -> Result<bool, MinerError> {
        let assignments = self.client.merges().await?.assignments;
        let mut any = false;
        for a in assignments {
            let key = (a.epoch, a.stage, a.partition);
            if self.merged.contains(&key) {
                continue;
            }
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            if crate::adversary::holds_merge_back(self.cfg.adversary, now_ms, a.deadline_ms) {
                continue;
            }
            let bytes = match self.merge_one(&a).await {
                Ok(b) => b,
                // A peer's bad contribution, or an outer step that is not finite: this
                // partition cannot be merged here, the others still can (returning the error
                // failed every merge round on the same assignment).
                Err(
                    e @ (MinerError::BadInput(_) | MinerError::Model(ModelError::NonFinite(_))),
                ) => {
                    tracing::warn!(
                        epoch = a.epoch,
                        stage = a.stage,
                        partition = a.partition,
                        error = %e,
                        "cannot merge"
                    );
                    self.merged.insert(key);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let size = bytes.len() as u64;
            let bytes = Bytes::from(bytes);
            if a.stage == self.stage {
                // If the partition's accepted result is this one, the epoch start loads it from here.
                self.merged_blobs.insert(bytes.clone());
            }
            match self
                .client
                .upload_merge(a.epoch, a.stage, a.partition, bytes)
                .await
            {
                Ok(r) => {
                    tracing::info!(epoch = a.epoch, stage = a.stage, partition = a.partition, blake3 = %r.blob.blake3, "merged");
                    self.status.send_modify(|s| {
                        s.merges += 1;
                        s.bytes_uploaded += size;
                        s.all_reduce.merged_sent += size;
                    });
                    metrics::counter!("iota_miner_merges_total").increment(1);
                }
                Err(e) if e.code() == Some(ErrorCode::WrongPhase) => {}
                Err(e) => return Err(e.into()),
            }
            self.merged.insert(key);
            any = true;
        }
        Ok(any)
    }

    /// A contribution to merge, downloaded (and counted) and decoded; one that does not decode
    /// is reported to the orchestrator and fails this merge.
    pub(super) async fn contribution<T>(
        &self,
        c: &iota_protocol::api::MergeContribution,
        decode: impl Fn(&[u8]) -> Result<T, String>,
    ) -> Result<T, MinerError> {
        let bytes = self.client.download(&c.blob).await?;
        self.received(bytes.len(), |r| &mut r.contributions_received);
        match decode(&bytes) {
            Ok(v) => Ok(v),
            Err(e) => {
                let _ = self.client.report_bad_object(&c.blob.key, &e).await;
                Err(MinerError::BadInput(format!(
                    "contribution of {}: {e}",
                    c.hotkey
                )))
            }
        }
    }

    /// A sparse run's merged update: the compressed contributions averaged in the given order
    /// and compressed again. No base weights: every miner applies the update itself.
    pub(super) async fn merge_sparse(&self, a: &MergeAssignment) -> Result<Vec<u8>, MinerError> {
        let shape = iota_trainer::sparse::upload_shape(&self.run, a.stage, a.partition)?;
        let mut parts = Vec::with_capacity(a.contributions.len());
        for c in &a.contributions {
            let upload = self
                .contribution(c, |b| {
                    iota_trainer::sparse::decode(b, shape).map_err(|e| e.to_string())
                })
                .await?;
            parts.push((c.weight, upload));
        }
        let hotkey = self.status.borrow().hotkey.clone();
        let (run, adversary) = (self.run.clone(), self.cfg.adversary);
        let (stage, partition) = (a.stage, a.partition);
        tokio::task::spawn_blocking(move || {
            crate::adversary::merged_update(&run, stage, partition, &parts, adversary, &hotkey)
        })
        .await
        .map_err(|e| MinerError::Internal(e.to_string()))?
    }

    /// Counts bytes the all-reduce downloaded.
    pub(super) fn received(&self, size: usize, kind: fn(&mut AllReduceBytes) -> &mut u64) {
        self.status
            .send_modify(|s| *kind(&mut s.all_reduce) += size as u64);
        metrics::counter!("iota_miner_reduce_download_bytes_total").increment(size as u64);
    }

    /// A merged partition: held already, or downloaded (and counted under `kind`).
    pub(super) async fn merged(
        &self,
        blob: &BlobDescriptor,
        kind: fn(&mut AllReduceBytes) -> &mut u64,
    ) -> Result<Bytes, MinerError> {
        if let Some(held) = self.merged_blobs.get(blob) {
            return Ok(held);
        }
        let bytes = self.client.download(blob).await?;
        self.received(bytes.len(), kind);
        Ok(bytes)
    }

    /// The merged partition: the contributions' weighted average in the given order, then the
    /// outer Nesterov step from the partition's base weights and momentum. One partition's
    /// contributions are in memory at a time.
    pub(super) async fn merge_one(&self, a: &MergeAssignment) -> Result<Vec<u8>, MinerError> {
        if self.run.sparse.is_some() {
            return self.merge_sparse(a).await;
        }
        let len = a.end.saturating_sub(a.start);
        let mut parts = Vec::with_capacity(a.contributions.len());
        for c in &a.contributions {
            let v = self
                .contribution(c, |b| decode_partition(b, len).map_err(|e| e.to_string()))
                .await?;
            parts.push((c.weight, v));
        }
        let (weights, momentum) = match &a.base {
            Some(b) => {
                let bytes = self.merged(b, |r| &mut r.bases_received).await?;
                decode_merged(&bytes, len)
                    .map_err(|e| MinerError::BadInput(format!("merge base: {e}")))?
            }
            None => {
                let (run, stage, range) =
                    (self.run.clone(), a.stage, a.start as usize..a.end as usize);
                let own = stage == self.stage;
                let trainer = self.trainer.clone();
                let init = tokio::task::spawn_blocking(move || -> Result<Vec<f32>, MinerError> {
                    let model = if own {
                        trainer
                            .lock()
                            .map_err(|_| MinerError::Internal("trainer lock poisoned".into()))?
                            .model()
                            .clone()
                    } else {
                        run_model(&run)?
                    };
                    Ok(initial_range(&model, stage, range)?)
                })
                .await
                .map_err(|e| MinerError::Internal(e.to_string()))??;
                (init, vec![0.0; len as usize])
            }
        };
        let hotkey = self.status.borrow().hotkey.clone();
        let start = (weights, momentum);
        crate::adversary::merged_partition(&self.run, &parts, start, self.cfg.adversary, &hotkey)
    }
}
