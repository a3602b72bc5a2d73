//! `iota-sparse/v1`: a compressed pseudo-gradient or merged update (`iota_model::sparse`).
//!
//! A vector of `len` values cut into chunks of `chunk`; each chunk keeps `min(k, its length)`
//! entries. Tensors: `indices` (U16, the offsets within their chunk, strictly ascending in each
//! chunk), `values` (I8 in `[-127, 127]`, one per index) and `scales` (F32, finite and
//! non-negative, one per chunk); entry `i` of chunk `c` stands for `values[i] * scales[c]`. The
//! metadata names `len`, `chunk` and `k`, which must be the run's.

use std::collections::HashMap;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use super::{
    META_KEY, TensorError, check_f32_finite, expect_dtype, expect_names, expect_shape, f32_le,
    f32_values, iota_meta, raw_view, read_header,
};

/// Format name of compressed vectors.
pub const SPARSE_FORMAT: &str = "iota-sparse/v1";

/// Largest chunk: offsets are `u16`.
pub const MAX_SPARSE_CHUNK: u32 = 1 << 16;

/// The shape of a sparse vector: what a run fixes and a check expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
pub struct SparseShape {
    /// Values of the dense vector.
    pub len: u64,
    /// Values per chunk, 1 to [`MAX_SPARSE_CHUNK`].
    pub chunk: u32,
    /// Entries kept per full chunk, 1 to `chunk`.
    pub k: u32,
}

impl SparseShape {
    /// Chunks of the vector.
    pub fn chunks(&self) -> u64 {
        self.len.div_ceil(u64::from(self.chunk.max(1)))
    }

    /// Entries kept: `k` per full chunk, `min(k, rest)` of the last.
    pub fn kept(&self) -> u64 {
        let (chunk, k) = (u64::from(self.chunk.max(1)), u64::from(self.k));
        let full = self.len / chunk;
        full.saturating_mul(k) + (self.len % chunk).min(k)
    }

    /// Bytes of the tensors: two for an index and one for a value per entry, four per scale.
    pub fn payload_bytes(&self) -> u64 {
        self.kept()
            .saturating_mul(3)
            .saturating_add(self.chunks().saturating_mul(4))
    }

    fn valid(&self) -> Result<(), TensorError> {
        if self.chunk == 0 || self.chunk > MAX_SPARSE_CHUNK || self.k == 0 || self.k > self.chunk {
            return Err(TensorError::Layout(format!(
                "a sparse vector keeps 1 to chunk of every chunk of 1 to {MAX_SPARSE_CHUNK} values, not {} of {}",
                self.k, self.chunk
            )));
        }
        Ok(())
    }
}

/// Encodes a sparse vector. Deterministic, so owners of a merge compare digests.
pub fn encode_sparse(
    shape: SparseShape,
    indices: &[u16],
    values: &[i8],
    scales: &[f32],
) -> Vec<u8> {
    let tensors = vec![
        (
            "indices".to_owned(),
            raw_view(
                Dtype::U16,
                &[indices.len() as u64],
                indices.iter().flat_map(|i| i.to_le_bytes()).collect(),
            ),
        ),
        (
            "scales".to_owned(),
            raw_view(Dtype::F32, &[scales.len() as u64], f32_le(scales)),
        ),
        (
            "values".to_owned(),
            raw_view(
                Dtype::I8,
                &[values.len() as u64],
                values.iter().map(|v| v.to_le_bytes()[0]).collect(),
            ),
        ),
    ];
    let meta = serde_json::json!({
        "format": SPARSE_FORMAT,
        "len": shape.len,
        "chunk": shape.chunk,
        "k": shape.k,
    });
    let info = HashMap::from([(META_KEY.to_owned(), meta.to_string())]);
    safetensors::serialize(tensors, Some(info)).unwrap_or_default()
}

/// The parts of a checked sparse vector.
#[derive(Clone, Debug, PartialEq)]
pub struct SparseParts {
    /// Offsets within their chunk.
    pub indices: Vec<u16>,
    /// Quantised values.
    pub values: Vec<i8>,
    /// One scale per chunk.
    pub scales: Vec<f32>,
}

/// Checks `bytes` as a sparse vector of exactly `want`'s shape.
pub fn check_sparse(bytes: &[u8], want: SparseShape) -> Result<(), TensorError> {
    decode_sparse(bytes, want).map(|_| ())
}

/// Checks and decodes a sparse vector of exactly `want`'s shape.
pub fn decode_sparse(bytes: &[u8], want: SparseShape) -> Result<SparseParts, TensorError> {
    want.valid()?;
    let metadata = read_header(bytes, &super::TensorSpec::Sparse(want))?;
    super::expect_format(&iota_meta(&metadata)?, SPARSE_FORMAT)?;
    let claimed: SparseShape = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .and_then(|m| serde_json::from_str(m).ok())
        .ok_or_else(|| TensorError::Layout("sparse metadata names no len, chunk and k".into()))?;
    if claimed != want {
        return Err(TensorError::Layout(format!(
            "{claimed:?}, this run expects {want:?}"
        )));
    }
    let st = SafeTensors::deserialize(bytes).map_err(|e| TensorError::Unreadable(e.to_string()))?;
    expect_names(&st, &["indices", "scales", "values"])?;
    let tensor = |name: &str, dtype: Dtype, len: u64| {
        let t = st
            .tensor(name)
            .map_err(|_| TensorError::Layout(format!("no tensor named {name:?}")))?;
        expect_dtype(t.dtype(), dtype)?;
        let shape: Vec<u64> = t.shape().iter().map(|d| *d as u64).collect();
        expect_shape(&shape, &[len])?;
        Ok::<_, TensorError>(t)
    };
    let indices = tensor("indices", Dtype::U16, want.kept())?;
    let values = tensor("values", Dtype::I8, want.kept())?;
    let scales = tensor("scales", Dtype::F32, want.chunks())?;
    check_f32_finite(scales.data(), "scales")?;
    if f32_values(scales.data()).any(|s| s < 0.0) {
        return Err(TensorError::NonFinite("scales (negative)".into()));
    }
    if values.data().contains(&0x80) {
        return Err(TensorError::NonFinite("values (-128)".into()));
    }
    let offsets: Vec<u16> = indices
        .data()
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let (chunk, k) = (u64::from(want.chunk), u64::from(want.k));
    let mut at = 0usize;
    for c in 0..want.chunks() {
        let chunk_len = chunk.min(want.len - c * chunk);
        let n = k.min(chunk_len) as usize;
        let mine = &offsets[at..at + n];
        if mine.windows(2).any(|w| w[0] >= w[1])
            || mine.last().is_some_and(|&o| u64::from(o) >= chunk_len)
        {
            return Err(TensorError::Layout(format!(
                "chunk {c}: offsets are not ascending inside the chunk's {chunk_len} values"
            )));
        }
        at += n;
    }
    Ok(SparseParts {
        indices: offsets,
        values: values.data().iter().map(|b| *b as i8).collect(),
        scales: f32_values(scales.data()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(len: u64, chunk: u32, k: u32) -> SparseShape {
        SparseShape { len, chunk, k }
    }

    /// Chunks of 4 keeping 2, 10 values: chunks of 4, 4 and 2.
    fn good() -> (SparseShape, Vec<u16>, Vec<i8>, Vec<f32>) {
        (
            shape(10, 4, 2),
            vec![0, 3, 1, 2, 0, 1],
            vec![127, -5, 0, 127, -127, 3],
            vec![0.5, 0.0, 2.0],
        )
    }

    #[test]
    fn round_trip_and_sizes() {
        let (s, i, v, sc) = good();
        assert_eq!((s.chunks(), s.kept()), (3, 6));
        assert_eq!(shape(9, 4, 2).kept(), 5);
        assert_eq!(shape(0, 4, 2).kept(), 0);
        let bytes = encode_sparse(s, &i, &v, &sc);
        assert_eq!(encode_sparse(s, &i, &v, &sc), bytes, "deterministic");
        assert!(bytes.len() as u64 <= super::super::TensorSpec::Sparse(s).max_bytes());
        let parts = decode_sparse(&bytes, s).unwrap();
        assert_eq!((parts.indices, parts.values, parts.scales), (i, v, sc));
    }

    #[test]
    fn anything_off_the_expected_shape_is_refused() {
        let (s, i, v, sc) = good();
        let bytes = encode_sparse(s, &i, &v, &sc);
        // Another run's shape, or an invalid one.
        for other in [
            shape(11, 4, 2),
            shape(10, 5, 2),
            shape(10, 4, 3),
            shape(10, 4, 0),
        ] {
            assert!(check_sparse(&bytes, other).is_err(), "{other:?}");
        }
        assert!(check_sparse(&bytes, shape(10, MAX_SPARSE_CHUNK + 1, 2)).is_err());
        let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
        let mut swapped = i.clone();
        swapped.swap(0, 1);
        cases.push(("descending offsets", encode_sparse(s, &swapped, &v, &sc)));
        let mut repeated = i.clone();
        repeated[3] = 1;
        cases.push(("repeated offset", encode_sparse(s, &repeated, &v, &sc)));
        let mut outside = i.clone();
        outside[5] = 2; // the last chunk holds 2 values
        cases.push(("offset past the chunk", encode_sparse(s, &outside, &v, &sc)));
        let mut low = v.clone();
        low[2] = i8::MIN;
        cases.push(("value -128", encode_sparse(s, &i, &low, &sc)));
        let mut nan = sc.clone();
        nan[1] = f32::NAN;
        cases.push(("NaN scale", encode_sparse(s, &i, &v, &nan)));
        let mut neg = sc.clone();
        neg[1] = -1.0;
        cases.push(("negative scale", encode_sparse(s, &i, &v, &neg)));
        cases.push(("short values", encode_sparse(s, &i, &v[..5], &sc)));
        cases.push((
            "extra scale",
            encode_sparse(s, &i, &v, &[1.0, 1.0, 1.0, 1.0]),
        ));
        // Metadata that claims another shape than the tensors have.
        cases.push((
            "claims 12 values",
            encode_sparse(shape(12, 4, 2), &i, &v, &sc),
        ));
        cases.push(("not safetensors", b"\x08\0\0\0\0\0\0\0{}".to_vec()));
        cases.push(("truncated", bytes[..bytes.len() - 1].to_vec()));
        for (what, b) in cases {
            assert!(check_sparse(&b, s).is_err(), "{what}");
        }
        // A partition in another format.
        let dense = super::super::encode_partition(&[0.0; 10]);
        assert!(check_sparse(&dense, s).is_err());
    }
}
