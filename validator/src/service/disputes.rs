//! Merge disputes: a partition's honest merge recomputed from its contributions, and the
//! orchestrator's open disputes settled with it.

use std::collections::HashMap;

use iota_protocol::api::{EpochRecord, PartitionState};
use iota_protocol::tensor::decode_partition;

use super::{Fault, Objects, Validator};
use crate::error::ValidatorError;
use crate::merges::{recompute_merge, recompute_sparse_merge};

impl Validator {
    /// The honest merge of a partition of a finished or merging epoch, its bytes and hash;
    /// `None` when an object it needs cannot be used (noted in `objects`, a contribution blamed
    /// on its miner).
    pub(super) async fn recompute(
        &self,
        record: &EpochRecord,
        stage: u32,
        partition: u32,
        objects: &mut Objects,
    ) -> Result<Option<(Vec<u8>, String)>, ValidatorError> {
        let o = self.online().await?;
        let len = o
            .run
            .partition_range(stage, partition)
            .map(|r| r.end - r.start)
            .unwrap_or(0);
        let sparse = match o.run.sparse {
            Some(_) => Some(iota_trainer::sparse::upload_shape(
                &o.run, stage, partition,
            )?),
            None => None,
        };
        let mut contributions = Vec::new();
        let mut compressed = Vec::new();
        let mut complete = true;
        for pg in record
            .pseudo_gradients
            .iter()
            .filter(|p| p.stage == stage && p.partition == partition)
        {
            let who = (pg.hotkey.clone(), pg.weight);
            let decoded = self.fetch(&pg.blob).await?.and_then(|bytes| match sparse {
                Some(shape) => iota_trainer::sparse::decode(&bytes, shape)
                    .map(|v| compressed.push((who.0, who.1, v)))
                    .map_err(|e| Fault::Bad(e.to_string())),
                None => decode_partition(&bytes, len)
                    .map(|v| contributions.push((who.0, who.1, v)))
                    .map_err(|e| Fault::Bad(e.to_string())),
            });
            if let Err(f) = decoded {
                objects.blame(
                    Some(&pg.hotkey),
                    "pseudo_gradient",
                    format!("{stage}/{partition}"),
                    &pg.blob,
                    &f,
                );
                complete = false;
            }
        }
        if sparse.is_some() {
            if !complete {
                return Ok(None);
            }
            let run = o.run.clone();
            let merged = tokio::task::spawn_blocking(move || {
                recompute_sparse_merge(&run, stage, partition, compressed)
            })
            .await
            .map_err(|e| ValidatorError::Config(format!("merge task: {e}")))??;
            return Ok(Some(merged));
        }
        let Some(start) = self.start_weights(record, stage, objects).await? else {
            return Ok(None);
        };
        if !complete {
            return Ok(None);
        }
        let base = start.into_iter().nth(partition as usize).flatten();
        let run = o.run.clone();
        let merged = tokio::task::spawn_blocking(move || {
            recompute_merge(&run, stage, partition, contributions, base)
        })
        .await
        .map_err(|e| ValidatorError::Config(format!("merge task: {e}")))??;
        Ok(Some(merged))
    }

    /// Settles the orchestrator's open disputes with recomputed hashes.
    pub async fn settle_disputes(&self) -> Result<usize, ValidatorError> {
        let o = self.online().await?;
        let mut settled = 0;
        // Disputes of one epoch share its record: fetched once.
        let mut records: HashMap<u64, EpochRecord> = HashMap::new();
        for d in o.client.disputes().await? {
            if d.state != "open" {
                continue;
            }
            let epoch = d.partition.epoch;
            let record = match records.entry(epoch) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(o.client.epoch_record(epoch).await?)
                }
            };
            let (stage, partition) = (d.partition.stage, d.partition.partition);
            // One dispute that cannot be recomputed leaves the others to settle.
            let (bytes, hash) = match self
                .recompute(record, stage, partition, &mut Objects::default())
                .await
            {
                Ok(Some(merged)) => merged,
                Ok(None) => {
                    tracing::warn!(
                        dispute = d.id,
                        epoch,
                        "cannot recompute: an object it needs cannot be used"
                    );
                    continue;
                }
                Err(e) => {
                    tracing::warn!(dispute = d.id, epoch, error = %e, "cannot recompute");
                    continue;
                }
            };
            // A dispute is settled by naming a submitted result. When no owner submitted the
            // honest merge, this validator submits it first (the orchestrator refuses a hash
            // that names no result).
            if !d
                .partition
                .results
                .iter()
                .any(|r| r.blake3.as_deref() == Some(hash.as_str()))
            {
                if let Err(e) = o
                    .client
                    .validator_merge(epoch, stage, partition, bytes.into())
                    .await
                {
                    tracing::warn!(dispute = d.id, error = %e, "could not submit the honest merge");
                    continue;
                }
                tracing::info!(dispute = d.id, epoch, blake3 = %hash,
                    "no owner submitted the honest merge; submitted it");
            }
            match o.client.settle(d.id, &hash).await {
                Ok(p) if p.state == PartitionState::Accepted => {
                    settled += 1;
                    tracing::info!(dispute = d.id, epoch, blake3 = %hash, "dispute settled");
                }
                // Weighed with the other validators' votes: settled once those of one hash hold
                // more than half the permit holders' stake.
                Ok(_) => tracing::info!(dispute = d.id, epoch, blake3 = %hash,
                    "dispute vote recorded; waiting for a stake majority"),
                Err(e) => tracing::warn!(dispute = d.id, error = %e, "could not settle"),
            }
        }
        Ok(settled)
    }
}
