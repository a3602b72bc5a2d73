//! What a validator needs of a sparse run beyond a dense one: uploads read as values, and the
//! stage's weights folded on from the accepted merged updates.

use iota_protocol::api::RunConfig;
use iota_protocol::tensor::decode_partition;
use iota_trainer::sparse::SparseWeights;

use super::Validator;
use crate::error::ValidatorError;

/// A pseudo-gradient upload as values: the partition, or in a sparse run the decompressed
/// upload (which carries the miner's unsent remainder beside this epoch's training).
pub(super) fn claimed_values(
    run: &RunConfig,
    stage: u32,
    partition: u32,
    len: u64,
    bytes: &[u8],
) -> Result<Vec<f32>, String> {
    if run.sparse.is_none() {
        return decode_partition(bytes, len).map_err(|e| e.to_string());
    }
    let shape =
        iota_trainer::sparse::upload_shape(run, stage, partition).map_err(|e| e.to_string())?;
    iota_trainer::sparse::decode(bytes, shape)
        .and_then(|v| Ok(v.decompress()?))
        .map_err(|e| e.to_string())
}

impl Validator {
    /// A sparse run's weights of `stage` at the start of `epoch` (the initial weights with
    /// every earlier epoch's accepted updates applied), per partition, folded on from the
    /// latest this validator computed. `None` when an update it needs cannot be used: accepted
    /// updates are sealed under the hash both owners published, so one that does not decode is
    /// theirs, and a merge check of its epoch finds them.
    pub(super) async fn sparse_start(
        &self,
        stage: u32,
        epoch: u64,
    ) -> Result<Option<Vec<Option<Vec<f32>>>>, ValidatorError> {
        let o = self.online().await?;
        let mut cache = self.sparse_weights.lock().await;
        let mut w = match cache.get(&stage) {
            Some(w) if w.epoch <= epoch => w.clone(),
            _ => SparseWeights::initial(&o.run, stage)?,
        };
        while w.epoch < epoch {
            let sw = o.client.epoch_start_weights(stage, w.epoch + 1).await?;
            let mut updates = Vec::with_capacity(sw.partitions.len());
            for blob in &sw.partitions {
                updates.push(match blob {
                    Some(b) => match self.fetch(b).await? {
                        Ok(bytes) => Some(bytes),
                        Err(f) => {
                            tracing::warn!(stage, epoch = w.epoch, key = %b.key, fault = ?f,
                                "an accepted update cannot be read; replays of later epochs skipped");
                            return Ok(None);
                        }
                    },
                    None => None,
                });
            }
            let refs: Vec<Option<&[u8]>> = updates.iter().map(|u| u.as_deref()).collect();
            if let Err(e) = w.advance(&o.run, stage, &refs) {
                tracing::warn!(stage, epoch = w.epoch, error = %e,
                    "an accepted update cannot be applied; replays of later epochs skipped");
                return Ok(None);
            }
        }
        let per_partition = (0..o.run.partitions)
            .map(|j| {
                o.run.partition_range(stage, j).and_then(|r| {
                    w.weights
                        .get(r.start as usize..r.end as usize)
                        .map(<[f32]>::to_vec)
                })
            })
            .collect();
        cache.insert(stage, w);
        Ok(Some(per_partition))
    }
}
