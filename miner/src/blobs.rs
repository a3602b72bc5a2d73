//! The merged partitions a miner already holds, by BLAKE3.
//!
//! Every merged partition a miner needs next is one it has seen: at an epoch's start it loads the
//! stage's merged partitions, and those are the bases of the next epoch's merge; a partition it
//! merged itself is one of the partitions it loads. Keeping them means an owner downloads no
//! merge base and nobody downloads a result it uploaded, so a miner's all-reduce traffic stays
//! the same size however many miners share its stage. The cost is host memory: the stage's
//! weights and momentum in fp32, twice its fp32 size.

use std::collections::HashMap;

use bytes::Bytes;
use iota_protocol::BlobDescriptor;
use iota_protocol::blob::blake3_hex;

/// Merged-partition bytes by their BLAKE3 hex.
#[derive(Default)]
pub(crate) struct MergedBlobs {
    by_hash: HashMap<String, Bytes>,
}

impl MergedBlobs {
    /// The bytes `blob` names, if held. The key is the hash of the bytes, so a hit is exactly
    /// what a download that passes its hash check would return.
    pub(crate) fn get(&self, blob: &BlobDescriptor) -> Option<Bytes> {
        self.by_hash
            .get(&blob.blake3)
            .filter(|b| b.len() as u64 == blob.size)
            .cloned()
    }

    /// Keeps `bytes` (hashed here, so a wrong key cannot be stored).
    pub(crate) fn insert(&mut self, bytes: Bytes) {
        self.by_hash.insert(blake3_hex(&bytes), bytes);
    }

    /// Holds exactly `blobs` from now on: at an epoch's start, the partitions just loaded, by
    /// the BLAKE3 their download was checked against (or the key they were held under).
    pub(crate) fn hold_only(&mut self, blobs: Vec<(String, Bytes)>) {
        self.by_hash = blobs.into_iter().collect();
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.by_hash.values().map(Bytes::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iota_protocol::blob::BlobDtype;

    fn descriptor(bytes: &[u8]) -> BlobDescriptor {
        BlobDescriptor {
            key: "k".into(),
            size: bytes.len() as u64,
            dtype: BlobDtype::F32,
            shape: vec![bytes.len() as u64 / 4],
            blake3: blake3_hex(bytes),
            url: None,
        }
    }

    #[test]
    fn serves_only_the_bytes_a_descriptor_names() {
        let mut held = MergedBlobs::default();
        let a = Bytes::from_static(&[1, 2, 3, 4]);
        let b = Bytes::from_static(&[5, 6, 7, 8]);
        held.insert(a.clone());
        assert_eq!(held.get(&descriptor(&a)), Some(a.clone()));
        assert_eq!(held.get(&descriptor(&b)), None);
        // Same hash, wrong size: not served.
        let mut wrong = descriptor(&a);
        wrong.size = 8;
        assert_eq!(held.get(&wrong), None);
        // The epoch start holds what it loaded, downloaded or not, and nothing else.
        held.hold_only(vec![(blake3_hex(&b), b.clone())]);
        assert_eq!(held.get(&descriptor(&a)), None);
        assert_eq!(held.get(&descriptor(&b)), Some(b));
        assert_eq!(held.bytes(), 4);
    }
}
