//! `iota-sparse/v2`: a compressed pseudo-gradient or merged update (`iota_model::sparse`).
//!
//! A vector of `len` values cut into chunks of `chunk`; each chunk keeps `min(k, its length)`
//! entries, each a value of `bits` bits (8 or 4) times its chunk's scale. Tensors:
//! * the kept offsets, as whichever of two codings the shape makes smaller: `indices` (U16, the
//!   offsets within their chunk, strictly ascending in each chunk), or, when an eighth of a
//!   chunk is less than two bytes per kept entry, `mask` (U8, one bit per value, least
//!   significant first, `ceil(chunk length / 8)` bytes a chunk, exactly the chunk's kept count of
//!   bits set and none past its end);
//! * `values`: with 8 bits, I8 in `[-127, 127]`, one per entry; with 4 bits, U8 holding two
//!   entries a byte (low nibble first, each in `[-7, 7]`, an odd count's last high nibble 0);
//! * `scales` (F32, finite and non-negative, one per chunk).
//!
//! Entry `i` of chunk `c` stands for `values[i] * scales[c]`. The metadata names `len`, `chunk`,
//! `k` and `bits`, which must be the run's.

use std::collections::HashMap;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use super::{
    META_KEY, TensorError, check_f32_finite, expect_dtype, expect_names, expect_shape, f32_le,
    f32_values, iota_meta, nibbles, raw_view, read_header,
};

/// Format name of compressed vectors.
pub const SPARSE_FORMAT: &str = "iota-sparse/v2";

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
    /// Bits of a kept value: 8 or 4.
    pub bits: u8,
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

    /// Whether the offsets travel as a bitmap: an eighth of a chunk is less than two bytes per
    /// kept entry.
    pub fn offsets_as_mask(&self) -> bool {
        u64::from(self.chunk).div_ceil(8) < 2 * u64::from(self.k)
    }

    /// Bytes of the bitmap: `ceil(length / 8)` per chunk.
    fn mask_bytes(&self) -> u64 {
        let chunk = u64::from(self.chunk.max(1));
        let full = self.len / chunk;
        full.saturating_mul(chunk.div_ceil(8)) + (self.len % chunk).div_ceil(8)
    }

    /// Bytes of the offsets, in the coding the shape picks.
    fn offset_bytes(&self) -> u64 {
        if self.offsets_as_mask() {
            self.mask_bytes()
        } else {
            self.kept().saturating_mul(2)
        }
    }

    /// Bytes of the values: one an entry with 8 bits, one per two with 4.
    fn value_bytes(&self) -> u64 {
        if self.bits == 4 {
            self.kept().div_ceil(2)
        } else {
            self.kept()
        }
    }

    /// Bytes of the tensors: offsets, values and four per scale.
    pub fn payload_bytes(&self) -> u64 {
        self.offset_bytes()
            .saturating_add(self.value_bytes())
            .saturating_add(self.chunks().saturating_mul(4))
    }

    /// Largest magnitude of a value.
    fn q_max(&self) -> i8 {
        if self.bits == 4 { 7 } else { 127 }
    }

    /// Checks the encoding: 1 to `chunk` kept of every chunk of 1 to [`MAX_SPARSE_CHUNK`]
    /// values, each of 8 or 4 bits.
    pub fn validate(&self) -> Result<(), TensorError> {
        if self.chunk == 0 || self.chunk > MAX_SPARSE_CHUNK || self.k == 0 || self.k > self.chunk {
            return Err(TensorError::Layout(format!(
                "a sparse vector keeps 1 to chunk of every chunk of 1 to {MAX_SPARSE_CHUNK} values, not {} of {}",
                self.k, self.chunk
            )));
        }
        if !matches!(self.bits, 4 | 8) {
            return Err(TensorError::Layout(format!(
                "sparse values have 8 or 4 bits, not {}",
                self.bits
            )));
        }
        Ok(())
    }

    /// Each chunk's length, in order.
    fn chunk_lens(&self) -> impl Iterator<Item = u64> + '_ {
        let chunk = u64::from(self.chunk.max(1));
        (0..self.chunks()).map(move |c| chunk.min(self.len - c * chunk))
    }
}

/// Encodes a sparse vector of `shape` (its `kept()` offsets, ascending in each chunk, values in
/// range and one scale per chunk, as [`decode_sparse`] checks). Deterministic, so owners of a
/// merge compare digests.
pub fn encode_sparse(
    shape: SparseShape,
    indices: &[u16],
    values: &[i8],
    scales: &[f32],
) -> Vec<u8> {
    let offsets = if shape.offsets_as_mask() {
        let mut mask = Vec::with_capacity(shape.mask_bytes() as usize);
        let mut at = 0usize;
        for chunk_len in shape.chunk_lens() {
            let base = mask.len();
            mask.resize(base + chunk_len.div_ceil(8) as usize, 0u8);
            let n = (u64::from(shape.k).min(chunk_len) as usize).min(indices.len() - at);
            for &o in &indices[at..at + n] {
                // An offset past the chunk is a caller's bug; it lands in the next chunk's
                // bytes or nowhere, and the decoder's counts refuse the result.
                if let Some(byte) = mask.get_mut(base + usize::from(o) / 8) {
                    *byte |= 1 << (o % 8);
                }
            }
            at += n;
        }
        (
            "mask".to_owned(),
            raw_view(Dtype::U8, &[mask.len() as u64], mask),
        )
    } else {
        (
            "indices".to_owned(),
            raw_view(
                Dtype::U16,
                &[indices.len() as u64],
                indices.iter().flat_map(|i| i.to_le_bytes()).collect(),
            ),
        )
    };
    let values = if shape.bits == 4 {
        let packed: Vec<u8> = nibbles::pack(values).collect();
        raw_view(Dtype::U8, &[packed.len() as u64], packed)
    } else {
        raw_view(
            Dtype::I8,
            &[values.len() as u64],
            values.iter().map(|v| v.to_le_bytes()[0]).collect(),
        )
    };
    let tensors = vec![
        offsets,
        (
            "scales".to_owned(),
            raw_view(Dtype::F32, &[scales.len() as u64], f32_le(scales)),
        ),
        ("values".to_owned(), values),
    ];
    let meta = serde_json::json!({
        "format": SPARSE_FORMAT,
        "len": shape.len,
        "chunk": shape.chunk,
        "k": shape.k,
        "bits": shape.bits,
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
    want.validate()?;
    let metadata = read_header(bytes, &super::TensorSpec::Sparse(want))?;
    super::expect_format(&iota_meta(&metadata)?, SPARSE_FORMAT)?;
    let claimed: SparseShape = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .and_then(|m| serde_json::from_str(m).ok())
        .ok_or_else(|| {
            TensorError::Layout("sparse metadata names no len, chunk, k and bits".into())
        })?;
    if claimed != want {
        return Err(TensorError::Layout(format!(
            "{claimed:?}, this run expects {want:?}"
        )));
    }
    let st = SafeTensors::deserialize(bytes).map_err(|e| TensorError::Unreadable(e.to_string()))?;
    let offsets_name = if want.offsets_as_mask() {
        "mask"
    } else {
        "indices"
    };
    let mut names = [offsets_name, "scales", "values"];
    names.sort_unstable();
    expect_names(&st, &names)?;
    let tensor = |name: &str, dtype: Dtype, len: u64| {
        let t = st
            .tensor(name)
            .map_err(|_| TensorError::Layout(format!("no tensor named {name:?}")))?;
        expect_dtype(t.dtype(), dtype)?;
        let shape: Vec<u64> = t.shape().iter().map(|d| *d as u64).collect();
        expect_shape(&shape, &[len])?;
        Ok::<_, TensorError>(t)
    };
    let scales = tensor("scales", Dtype::F32, want.chunks())?;
    check_f32_finite(scales.data(), "scales")?;
    if f32_values(scales.data()).any(|s| s < 0.0) {
        return Err(TensorError::NonFinite("scales (negative)".into()));
    }
    let values = decode_values(&tensor, want)?;
    let indices = if want.offsets_as_mask() {
        offsets_of_mask(tensor("mask", Dtype::U8, want.mask_bytes())?.data(), want)?
    } else {
        let raw = tensor("indices", Dtype::U16, want.kept())?;
        let offsets: Vec<u16> = raw
            .data()
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        check_offsets(&offsets, want)?;
        offsets
    };
    Ok(SparseParts {
        indices,
        values,
        scales: f32_values(scales.data()).collect(),
    })
}

/// The values, unpacked and checked against the shape's range.
fn decode_values<'a>(
    tensor: &impl Fn(&str, Dtype, u64) -> Result<safetensors::tensor::TensorView<'a>, TensorError>,
    want: SparseShape,
) -> Result<Vec<i8>, TensorError> {
    let q = want.q_max();
    let values: Vec<i8> = if want.bits == 4 {
        let raw = tensor("values", Dtype::U8, want.value_bytes())?;
        nibbles::unpack(raw.data(), want.kept() as usize)?
    } else {
        let raw = tensor("values", Dtype::I8, want.kept())?;
        raw.data().iter().map(|b| *b as i8).collect()
    };
    if let Some(v) = values.iter().find(|v| !(-q..=q).contains(*v)) {
        return Err(TensorError::NonFinite(format!(
            "values ({v} is outside [-{q}, {q}])"
        )));
    }
    Ok(values)
}

/// Offsets are strictly ascending inside each chunk.
fn check_offsets(offsets: &[u16], want: SparseShape) -> Result<(), TensorError> {
    let mut at = 0usize;
    for (c, chunk_len) in want.chunk_lens().enumerate() {
        let n = u64::from(want.k).min(chunk_len) as usize;
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
    Ok(())
}

/// The offsets a bitmap of `want`'s shape marks, each chunk marking exactly its kept count.
fn offsets_of_mask(mask: &[u8], want: SparseShape) -> Result<Vec<u16>, TensorError> {
    let mut offsets = Vec::with_capacity(want.kept() as usize);
    let mut base = 0usize;
    for (c, chunk_len) in want.chunk_lens().enumerate() {
        let bytes = &mask[base..base + chunk_len.div_ceil(8) as usize];
        let before = offsets.len();
        for (b, byte) in bytes.iter().enumerate() {
            let mut bits = *byte;
            while bits != 0 {
                let o = b * 8 + bits.trailing_zeros() as usize;
                if o as u64 >= chunk_len {
                    return Err(TensorError::Layout(format!(
                        "chunk {c}: the mask marks offset {o}, past the chunk's {chunk_len} values"
                    )));
                }
                offsets.push(o as u16);
                bits &= bits - 1;
            }
        }
        let (marked, n) = (offsets.len() - before, u64::from(want.k).min(chunk_len));
        if marked as u64 != n {
            return Err(TensorError::Layout(format!(
                "chunk {c}: the mask marks {marked} values, not {n}"
            )));
        }
        base += bytes.len();
    }
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(len: u64, chunk: u32, k: u32) -> SparseShape {
        SparseShape {
            len,
            chunk,
            k,
            bits: 8,
        }
    }

    /// Chunks of 32 keeping 2 (offsets as a list), 70 values: chunks of 32, 32 and 6.
    fn good() -> (SparseShape, Vec<u16>, Vec<i8>, Vec<f32>) {
        (
            shape(70, 32, 2),
            vec![0, 31, 1, 2, 0, 5],
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
            shape(71, 32, 2),
            shape(70, 33, 2),
            shape(70, 32, 3),
            shape(70, 32, 0),
            SparseShape { bits: 4, ..s },
            SparseShape { bits: 2, ..s },
        ] {
            assert!(check_sparse(&bytes, other).is_err(), "{other:?}");
        }
        assert!(check_sparse(&bytes, shape(70, MAX_SPARSE_CHUNK + 1, 2)).is_err());
        let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
        let mut swapped = i.clone();
        swapped.swap(0, 1);
        cases.push(("descending offsets", encode_sparse(s, &swapped, &v, &sc)));
        let mut repeated = i.clone();
        repeated[3] = 1;
        cases.push(("repeated offset", encode_sparse(s, &repeated, &v, &sc)));
        let mut outside = i.clone();
        outside[5] = 6; // the last chunk holds 6 values
        cases.push(("offset past the chunk", encode_sparse(s, &outside, &v, &sc)));
        let mut low = v.clone();
        low[2] = i8::MIN;
        cases.push(("value -128", encode_sparse(s, &i, &low, &sc)));
        cases.push((
            "4-bit values",
            encode_sparse(SparseShape { bits: 4, ..s }, &i, &v, &sc),
        ));
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
            "claims 72 values",
            encode_sparse(shape(72, 32, 2), &i, &v, &sc),
        ));
        cases.push(("not safetensors", b"\x08\0\0\0\0\0\0\0{}".to_vec()));
        cases.push(("truncated", bytes[..bytes.len() - 1].to_vec()));
        for (what, b) in cases {
            assert!(check_sparse(&b, s).is_err(), "{what}");
        }
        // A partition in another format.
        let dense = super::super::encode_partition(&[0.0; 70]);
        assert!(check_sparse(&dense, s).is_err());
    }

    /// Chunks of 16 keeping 3 (an eighth of 16 is 2 bytes, under 2 per entry): a bitmap of 2
    /// bytes a chunk; 37 values, so the last chunk has 5 values in 1 byte.
    fn masked() -> (SparseShape, Vec<u16>, Vec<i8>, Vec<f32>) {
        (
            shape(37, 16, 3),
            vec![0, 9, 15, 1, 2, 14, 0, 3, 4],
            vec![1, -2, 3, 4, 5, 6, 7, -7, 0],
            vec![0.5, 1.0, 2.0],
        )
    }

    #[test]
    fn a_dense_enough_vector_sends_its_offsets_as_a_bitmap() {
        assert!(!shape(4096, 4096, 128).offsets_as_mask());
        assert!(!shape(4096, 4096, 256).offsets_as_mask());
        assert!(shape(4096, 4096, 257).offsets_as_mask());
        let (s, i, v, sc) = masked();
        assert!(s.offsets_as_mask());
        // 2 + 2 + 1 mask bytes, 9 values, 3 scales.
        assert_eq!(s.payload_bytes(), 5 + 9 + 12);
        let bytes = encode_sparse(s, &i, &v, &sc);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            st.tensor("mask").unwrap().data(),
            &[0x01, 0x82, 0x06, 0x40, 0x19]
        );
        let parts = decode_sparse(&bytes, s).unwrap();
        assert_eq!(
            (parts.indices, parts.values, parts.scales),
            (i.clone(), v.clone(), sc.clone())
        );
        // The denser coding is the smaller: 4096 in chunks of 4096 keeping 2048, 512 bytes of
        // mask instead of 4096 of offsets.
        let dense = shape(4096, 4096, 2048);
        assert_eq!(dense.payload_bytes(), 512 + 2048 + 4);
        // A mask that marks too few or too many in a chunk, or past the last chunk's end.
        let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
        let mut few = i.clone();
        few[1] = 0; // chunk 0 marks 0 twice: 2 bits set
        cases.push(("two marks in chunk 0", encode_sparse(s, &few, &v, &sc)));
        let mut past = i.clone();
        past[8] = 5; // the last chunk has 5 values
        cases.push(("past the last chunk", encode_sparse(s, &past, &v, &sc)));
        for (what, b) in cases {
            assert!(check_sparse(&b, s).is_err(), "{what}");
        }
        // The same vector with u16 offsets, as a shape with fewer kept values would send them.
        let as_list = {
            let tensors = vec![
                (
                    "indices".to_owned(),
                    raw_view(
                        Dtype::U16,
                        &[9],
                        i.iter().flat_map(|o| o.to_le_bytes()).collect(),
                    ),
                ),
                ("scales".to_owned(), raw_view(Dtype::F32, &[3], f32_le(&sc))),
                (
                    "values".to_owned(),
                    raw_view(Dtype::I8, &[9], v.iter().map(|x| *x as u8).collect()),
                ),
            ];
            let meta = serde_json::json!({"format": SPARSE_FORMAT, "len": 37, "chunk": 16, "k": 3, "bits": 8});
            let info = HashMap::from([(META_KEY.to_owned(), meta.to_string())]);
            safetensors::serialize(tensors, Some(info)).unwrap()
        };
        assert!(check_sparse(&as_list, s).is_err());
    }

    #[test]
    fn four_bit_values_pack_two_a_byte() {
        let (s, i, _, sc) = good();
        let s4 = SparseShape { bits: 4, ..s };
        let v4 = vec![7, -5, 0, 7, -7, 3];
        assert_eq!(s4.payload_bytes(), 12 + 3 + 12);
        let bytes = encode_sparse(s4, &i, &v4, &sc);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("values").unwrap().data(), &[0xb7, 0x70, 0x39]);
        let parts = decode_sparse(&bytes, s4).unwrap();
        assert_eq!(parts.values, v4);
        // An odd count: the last high nibble is padding and must be 0.
        let odd = shape(5, 4, 2); // chunks of 4 and 1: 3 values
        let odd4 = SparseShape { bits: 4, ..odd };
        let bytes = encode_sparse(odd4, &[1, 2, 0], &[-1, 2, -7], &[1.0, 1.0]);
        assert_eq!(decode_sparse(&bytes, odd4).unwrap().values, vec![-1, 2, -7]);
        let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
        // -8 fits a nibble but is outside [-7, 7].
        cases.push((
            "value -8",
            encode_sparse(odd4, &[1, 2, 0], &[-1, 2, -8], &[1.0, 1.0]),
        ));
        let bad_pad = {
            let mut b = bytes.clone();
            let at = b.len() - 1; // values sort last; their last byte is the file's last
            b[at] |= 0x10;
            b
        };
        cases.push(("padding nibble", bad_pad));
        cases.push((
            "8-bit values",
            encode_sparse(odd, &[1, 2, 0], &[-1, 2, -7], &[1.0, 1.0]),
        ));
        for (what, b) in cases {
            assert!(check_sparse(&b, odd4).is_err(), "{what}");
        }
    }
}
