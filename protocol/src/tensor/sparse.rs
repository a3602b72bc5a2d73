//! `iota-sparse/v3`: a compressed pseudo-gradient or merged update (`iota_model::sparse`).
//!
//! A vector of `len` values cut into chunks of `chunk`; each chunk keeps `n = min(k, its
//! length)` entries, each a value of `bits` bits (8 or 4) times its chunk's scale. Tensors:
//! * the kept offsets within their chunk (strictly ascending), as whichever of two codings is
//!   smaller for a full chunk: Elias-Fano, with `l = floor(log2(chunk / k))`: `low_bits` (U8,
//!   each offset's `l` low bits) and `high_bits` (U8; per chunk a region of
//!   `n + ((length - 1) >> l)` bits where the `i`-th offset `o` sets bit `(o >> l) + i`), both
//!   bit streams least significant bit first, chunk after chunk, the bits after the last chunk
//!   0 (see `elias_fano.rs`); or, where that is no smaller than one bit per value, `mask` (U8,
//!   one bit per value, least significant first, `ceil(chunk length / 8)` bytes a chunk,
//!   exactly `n` bits set and none past its end);
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
    META_KEY, TensorError, check_f32_finite, elias_fano, expect_dtype, expect_names, expect_shape,
    f32_le, f32_values, iota_meta, nibbles, raw_view, read_header,
};

/// Format name of compressed vectors.
pub const SPARSE_FORMAT: &str = "iota-sparse/v3";

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

    /// Whether the offsets travel as a bitmap: for a full chunk, one bit per value is no more
    /// than their Elias-Fano code.
    pub fn offsets_as_mask(&self) -> bool {
        let (chunk, k) = (u64::from(self.chunk), u64::from(self.k));
        chunk <= elias_fano::chunk_bits(chunk, k, self.low_bit_count())
    }

    /// Low bits of an offset in the Elias-Fano coding.
    fn low_bit_count(&self) -> u32 {
        elias_fano::low_bit_count(u64::from(self.chunk), u64::from(self.k))
    }

    /// Each chunk's length and kept count, in order.
    fn chunk_counts(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.chunk_lens()
            .map(|len| (len, u64::from(self.k).min(len)))
    }

    /// Bytes of `low_bits` and of `high_bits`.
    fn elias_fano_bytes(&self) -> (u64, u64) {
        let l = self.low_bit_count();
        let chunk = u64::from(self.chunk.max(1));
        let (full, rest) = (self.len / chunk, self.len % chunk);
        let k = u64::from(self.k);
        let mut high = full.saturating_mul(elias_fano::high_region(chunk, k.min(chunk), l));
        if rest > 0 {
            high = high.saturating_add(elias_fano::high_region(rest, k.min(rest), l));
        }
        (
            self.kept().saturating_mul(u64::from(l)).div_ceil(8),
            high.div_ceil(8),
        )
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
            let (low, high) = self.elias_fano_bytes();
            low.saturating_add(high)
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
        vec![(
            "mask".to_owned(),
            raw_view(Dtype::U8, &[mask.len() as u64], mask),
        )]
    } else {
        let (low, high) = elias_fano::encode(indices, shape.chunk_counts(), shape.low_bit_count());
        vec![
            (
                "high_bits".to_owned(),
                raw_view(Dtype::U8, &[high.len() as u64], high),
            ),
            (
                "low_bits".to_owned(),
                raw_view(Dtype::U8, &[low.len() as u64], low),
            ),
        ]
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
    let mut tensors = offsets;
    tensors.push((
        "scales".to_owned(),
        raw_view(Dtype::F32, &[scales.len() as u64], f32_le(scales)),
    ));
    tensors.push(("values".to_owned(), values));
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
    let names: &[&str] = if want.offsets_as_mask() {
        &["mask", "scales", "values"]
    } else {
        &["high_bits", "low_bits", "scales", "values"]
    };
    expect_names(&st, names)?;
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
        let (low, high) = want.elias_fano_bytes();
        elias_fano::decode(
            tensor("low_bits", Dtype::U8, low)?.data(),
            tensor("high_bits", Dtype::U8, high)?.data(),
            want.chunk_counts(),
            want.low_bit_count(),
            want.kept() as usize,
        )?
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

    /// Chunks of 32 keeping 2 (offsets in Elias-Fano code, 4 low bits each), 70 values: chunks
    /// of 32, 32 and 6.
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

    /// Chunks of 16 keeping 8, where one bit per value (16 a chunk) is less than the
    /// Elias-Fano code (8 low bits, 8 + 7 high): a bitmap of 2 bytes a chunk; 37 values, so the
    /// last chunk has 5 values in 1 byte, all kept.
    fn masked() -> (SparseShape, Vec<u16>, Vec<i8>, Vec<f32>) {
        (
            shape(37, 16, 8),
            vec![
                0, 1, 2, 3, 9, 10, 14, 15, 0, 2, 4, 6, 8, 10, 12, 14, 0, 1, 2, 3, 4,
            ],
            (0..21).map(|x| x - 10).collect(),
            vec![0.5, 1.0, 2.0],
        )
    }

    #[test]
    fn a_dense_enough_vector_sends_its_offsets_as_a_bitmap() {
        // In chunks of 4096, Elias-Fano up to 1024 kept (4095 bits), a bitmap from 1025.
        for (k, mask) in [
            (128, false),
            (256, false),
            (1024, false),
            (1025, true),
            (2048, true),
        ] {
            assert_eq!(shape(4096, 4096, k).offsets_as_mask(), mask, "{k}");
        }
        // 256 of 4096: 128 bytes of low bits, ceil(511 / 8) of high bits, against 512 of u16.
        assert_eq!(shape(4096, 4096, 256).payload_bytes(), 128 + 64 + 256 + 4);
        let (s, i, v, sc) = masked();
        assert!(s.offsets_as_mask());
        // 2 + 2 + 1 mask bytes, 21 values, 3 scales.
        assert_eq!(s.payload_bytes(), 5 + 21 + 12);
        let bytes = encode_sparse(s, &i, &v, &sc);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            st.tensor("mask").unwrap().data(),
            &[0x0f, 0xc6, 0x55, 0x55, 0x1f]
        );
        let parts = decode_sparse(&bytes, s).unwrap();
        assert_eq!(
            (parts.indices, parts.values, parts.scales),
            (i.clone(), v.clone(), sc.clone())
        );
        // 2048 of 4096: 512 bytes of mask.
        let dense = shape(4096, 4096, 2048);
        assert_eq!(dense.payload_bytes(), 512 + 2048 + 4);
        // A mask that marks too few in a chunk, or past the last chunk's end.
        let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
        let mut few = i.clone();
        few[1] = 0; // chunk 0 marks 0 twice: 7 bits set
        cases.push(("7 marks in chunk 0", encode_sparse(s, &few, &v, &sc)));
        let mut past = i.clone();
        past[20] = 5; // the last chunk has 5 values
        cases.push(("past the last chunk", encode_sparse(s, &past, &v, &sc)));
        for (what, b) in cases {
            assert!(check_sparse(&b, s).is_err(), "{what}");
        }
        // The same vector in the other coding, where the shape calls for a mask.
        let as_elias_fano = {
            let (low, high) = elias_fano::encode(&i, s.chunk_counts(), s.low_bit_count());
            let tensors = vec![
                (
                    "high_bits".to_owned(),
                    raw_view(Dtype::U8, &[high.len() as u64], high),
                ),
                (
                    "low_bits".to_owned(),
                    raw_view(Dtype::U8, &[low.len() as u64], low),
                ),
                ("scales".to_owned(), raw_view(Dtype::F32, &[3], f32_le(&sc))),
                (
                    "values".to_owned(),
                    raw_view(Dtype::I8, &[21], v.iter().map(|x| *x as u8).collect()),
                ),
            ];
            let meta = serde_json::json!({"format": SPARSE_FORMAT, "len": 37, "chunk": 16, "k": 8, "bits": 8});
            let info = HashMap::from([(META_KEY.to_owned(), meta.to_string())]);
            safetensors::serialize(tensors, Some(info)).unwrap()
        };
        assert!(check_sparse(&as_elias_fano, s).is_err());
    }

    #[test]
    fn four_bit_values_pack_two_a_byte() {
        let (s, i, _, sc) = good();
        let s4 = SparseShape { bits: 4, ..s };
        let v4 = vec![7, -5, 0, 7, -7, 3];
        // 3 bytes of low bits (4 an offset), 1 of high bits (3 + 3 + 2), 3 of values, 3 scales.
        assert_eq!(s4.payload_bytes(), 4 + 3 + 12);
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
