//! The tensor wire formats and their checks, independent of any tensor library.
//!
//! Every tensor travels as a safetensors file with one metadata entry `iota` holding a JSON object
//! whose `format` names the layout:
//!
//! * `iota-boundary/v1` (activations and activation gradients between stages, written by
//!   `iota-model`): tensor `values` of shape `[batch, seq, width]` (no dimension 0) with
//!   `"encoding": "f32"`, F32; or with `"encoding": "int8"`, I8 and a second tensor `scales`
//!   (F32, one per row, `batch·seq` of them); or with `"encoding": "int4"` and `"width": w`, U8
//!   of shape `[batch, seq, ceil(w / 2)]` holding two 4-bit values a byte (low nibble first, each
//!   in `[-7, 7]`, an odd row's last high nibble 0) and `scales` as BF16. The encoding is
//!   required: `iota-model`'s decoder refuses a tensor without it, and the check accepts nothing
//!   that decoder refuses.
//! * `iota-partition/v1` (pseudo-gradient partitions): one F32 tensor `values` of shape `[len]`.
//! * `iota-merged/v1` (merged partitions): the partition's new weights `values` and the outer
//!   optimizer's momentum `momentum`, both F32 `[len]`. Keeping the momentum beside the weights
//!   makes the outer step stateless: whoever merges next epoch reads both from the store.
//! * `iota-sparse/v3` (compressed pseudo-gradients and merged updates): see [`SparseShape`].
//!
//! [`check_tensor`] is what the orchestrator runs on every upload and what a consumer runs after
//! download: layout, dtype, exact shape, every value finite, int8 values in `[-127, 127]`.

use std::collections::HashMap;

use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::blob::BlobDtype;

mod elias_fano;
mod nibbles;
mod sparse;
mod stream;
pub use sparse::{
    MAX_SPARSE_CHUNK, SPARSE_FORMAT, SparseParts, SparseShape, check_sparse, decode_sparse,
    encode_sparse,
};
pub use stream::{MAX_STREAM_HEADER, StreamCheck};

/// Name of the safetensors metadata entry.
pub const META_KEY: &str = "iota";
/// Format name of boundary tensors.
pub const BOUNDARY_FORMAT: &str = "iota-boundary/v1";
/// Format name of pseudo-gradient partitions.
pub const PARTITION_FORMAT: &str = "iota-partition/v1";
/// Format name of merged partitions.
pub const MERGED_FORMAT: &str = "iota-merged/v1";

/// How boundary tensors are encoded on the wire in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum WireEncoding {
    /// Raw f32.
    F32,
    /// Per-row symmetric int8 with one f32 scale per row.
    Int8,
    /// Per-row symmetric int4, two values a byte, with one bf16 scale per row.
    Int4,
}

/// Largest magnitude of a pseudo-gradient value (a partition's change of weights over an epoch;
/// honest ones are far below 1). Finite values near `f32::MAX` overflowed the outer step that
/// averages them, which failed every merge of the partition, and every validator's recompute.
pub const MAX_PSEUDO_GRADIENT: f32 = 1e6;

/// What an upload slot expects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorSpec {
    /// A boundary tensor of exactly this shape and encoding.
    Boundary {
        /// `[batch, seq, width]`.
        shape: [u64; 3],
        /// Encoding.
        encoding: WireEncoding,
    },
    /// A flat f32 partition of exactly `len` values.
    Partition {
        /// Number of values.
        len: u64,
    },
    /// A merged partition: weights and momentum, `len` values each.
    Merged {
        /// Number of values.
        len: u64,
    },
    /// A compressed pseudo-gradient partition or merged update.
    Sparse(SparseShape),
}

impl TensorSpec {
    /// An upper bound on the encoded size: payload plus a generous header allowance. Saturates
    /// rather than overflows, so an absurd spec yields a limit no real body reaches.
    pub fn max_bytes(&self) -> u64 {
        const HEADER_ALLOWANCE: u64 = 4096;
        let payload = match self {
            Self::Boundary { shape, encoding } => {
                let n = shape.iter().fold(1u64, |a, d| a.saturating_mul(*d));
                let rows = shape[0].saturating_mul(shape[1]);
                match encoding {
                    WireEncoding::F32 => n.saturating_mul(4),
                    WireEncoding::Int8 => n.saturating_add(rows.saturating_mul(4)),
                    WireEncoding::Int4 => rows
                        .saturating_mul(shape[2].div_ceil(2))
                        .saturating_add(rows.saturating_mul(2)),
                }
            }
            Self::Partition { len } => len.saturating_mul(4),
            Self::Merged { len } => len.saturating_mul(8),
            Self::Sparse(s) => s.payload_bytes(),
        };
        payload.saturating_add(HEADER_ALLOWANCE)
    }

    /// The dtype and shape a descriptor of a valid tensor reports.
    pub fn dtype_and_shape(&self) -> (BlobDtype, Vec<u64>) {
        match self {
            Self::Boundary { shape, encoding } => (
                match encoding {
                    WireEncoding::F32 => BlobDtype::F32,
                    WireEncoding::Int8 => BlobDtype::I8,
                    WireEncoding::Int4 => BlobDtype::I4,
                },
                shape.to_vec(),
            ),
            Self::Partition { len } | Self::Merged { len } => (BlobDtype::F32, vec![*len]),
            Self::Sparse(s) => (
                if s.bits == 4 {
                    BlobDtype::I4
                } else {
                    BlobDtype::I8
                },
                vec![s.kept()],
            ),
        }
    }
}

/// Why a tensor was refused. The message names the first problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// Larger than the slot allows.
    #[error("{got} bytes, more than the {max} this slot allows")]
    TooLarge {
        /// Actual size.
        got: u64,
        /// Limit.
        max: u64,
    },
    /// Not a safetensors file.
    #[error("not a safetensors file: {0}")]
    Unreadable(String),
    /// The layout (format, tensor names) is wrong.
    #[error("wrong layout: {0}")]
    Layout(String),
    /// The main tensor's dtype is wrong.
    #[error("dtype {got}, expected {expected}")]
    Dtype {
        /// Actual.
        got: String,
        /// Expected.
        expected: String,
    },
    /// The shape is wrong.
    #[error("shape {got:?}, expected {expected:?}")]
    Shape {
        /// Actual.
        got: Vec<u64>,
        /// Expected.
        expected: Vec<u64>,
    },
    /// A value is NaN or infinite (or an int8 value or scale is out of range).
    #[error("non-finite or out-of-range value in {0}")]
    NonFinite(String),
}

#[derive(Deserialize)]
struct Meta {
    format: String,
    /// Required for boundary tensors (`iota-model`'s decoder refuses them without it, so the
    /// orchestrator must not store one); ignored by the other formats.
    encoding: Option<WireEncoding>,
    /// The row width of an int4 boundary tensor, whose `values` hold half a byte per value.
    width: Option<u64>,
}

/// Whether every tensor's data offsets in the safetensors header lie inside the buffer. Checked
/// before the `safetensors` crate reads the header: it adds the last offset to the header's
/// length unchecked, which for offsets near 2^64 (tensors whose sizes sum to just under it, each
/// size itself valid) overflows, and panics where overflow checks are on.
fn offsets_fit(bytes: &[u8]) -> Result<(), TensorError> {
    let unreadable = |why: &str| TensorError::Unreadable(why.to_owned());
    let header_len = bytes
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| unreadable("shorter than a header length"))?;
    let data_len = (bytes.len() as u64 - 8)
        .checked_sub(header_len)
        .ok_or_else(|| unreadable("header longer than the buffer"))?;
    header_offsets_fit(&bytes[8..8 + header_len as usize], data_len)
}

/// [`offsets_fit`] of a header read on its own, the data after it `data_len` bytes long.
fn header_offsets_fit(header: &[u8], data_len: u64) -> Result<(), TensorError> {
    let unreadable = |why: &str| TensorError::Unreadable(why.to_owned());
    let entries: HashMap<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| unreadable(&format!("header: {e}")))?;
    for (name, entry) in &entries {
        if name == "__metadata__" {
            continue;
        }
        let offsets: Option<Vec<u64>> = entry
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .map(|o| o.iter().filter_map(|v| v.as_u64()).collect());
        match offsets.as_deref() {
            Some(&[start, end]) if start <= end && end <= data_len => {}
            _ => {
                return Err(unreadable(&format!(
                    "tensor {name:?}: data offsets outside the buffer"
                )));
            }
        }
    }
    Ok(())
}

/// The `iota` entry of a safetensors header's metadata.
fn iota_meta(metadata: &safetensors::tensor::Metadata) -> Result<Meta, TensorError> {
    metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .ok_or_else(|| TensorError::Layout(format!("missing {META_KEY:?} metadata entry")))
        .and_then(|m| {
            serde_json::from_str(m).map_err(|e| TensorError::Layout(format!("bad metadata: {e}")))
        })
}

/// The size limit of `spec`, then the header of `bytes`: offsets inside the buffer and the
/// metadata readable.
fn read_header(
    bytes: &[u8],
    spec: &TensorSpec,
) -> Result<safetensors::tensor::Metadata, TensorError> {
    let max = spec.max_bytes();
    if bytes.len() as u64 > max {
        return Err(TensorError::TooLarge {
            got: bytes.len() as u64,
            max,
        });
    }
    offsets_fit(bytes)?;
    let (_, metadata) =
        SafeTensors::read_metadata(bytes).map_err(|e| TensorError::Unreadable(e.to_string()))?;
    Ok(metadata)
}

/// Checks `bytes` against `spec`. Runs in one pass over the values; allocates nothing per value.
pub fn check_tensor(bytes: &[u8], spec: &TensorSpec) -> Result<(), TensorError> {
    let metadata = read_header(bytes, spec)?;
    let meta = iota_meta(&metadata)?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| TensorError::Unreadable(e.to_string()))?;
    let values = st
        .tensor("values")
        .map_err(|_| TensorError::Layout("no tensor named \"values\"".into()))?;
    let shape: Vec<u64> = values.shape().iter().map(|d| *d as u64).collect();
    match spec {
        TensorSpec::Sparse(want) => check_sparse(bytes, *want),
        TensorSpec::Partition { len } => {
            expect_format(&meta, PARTITION_FORMAT)?;
            expect_names(&st, &["values"])?;
            expect_dtype(values.dtype(), Dtype::F32)?;
            expect_shape(&shape, &[*len])?;
            check_f32_finite(values.data(), "values")?;
            if f32_values(values.data()).any(|v| v.abs() > MAX_PSEUDO_GRADIENT) {
                return Err(TensorError::NonFinite(format!(
                    "values (beyond ±{MAX_PSEUDO_GRADIENT:e})"
                )));
            }
            Ok(())
        }
        TensorSpec::Merged { len } => {
            expect_format(&meta, MERGED_FORMAT)?;
            expect_names(&st, &["momentum", "values"])?;
            let momentum = st
                .tensor("momentum")
                .map_err(|_| TensorError::Layout("no tensor named \"momentum\"".into()))?;
            for (name, t) in [("values", &values), ("momentum", &momentum)] {
                expect_dtype(t.dtype(), Dtype::F32)?;
                let shape: Vec<u64> = t.shape().iter().map(|d| *d as u64).collect();
                expect_shape(&shape, &[*len])?;
                check_f32_finite(t.data(), name)?;
            }
            Ok(())
        }
        TensorSpec::Boundary {
            shape: want,
            encoding,
        } => {
            expect_format(&meta, BOUNDARY_FORMAT)?;
            // What `iota_model::BoundaryTensor::from_bytes` accepts, no more: every consumer
            // decodes with it, so a tensor this passes and it refuses would fail every hop
            // downstream (and a validator's replay) instead of the upload.
            let Some(got_encoding) = meta.encoding else {
                return Err(TensorError::Layout(
                    "boundary metadata names no \"encoding\"".into(),
                ));
            };
            if want.contains(&0) {
                return Err(TensorError::Shape {
                    got: shape,
                    expected: want.to_vec(),
                });
            }
            if got_encoding != *encoding {
                return Err(TensorError::Layout(format!(
                    "encoding {got_encoding:?}, this run uses {encoding:?}"
                )));
            }
            if *encoding == WireEncoding::Int4 {
                return check_int4(&st, &values, &meta, want);
            }
            expect_shape(&shape, want)?;
            match encoding {
                WireEncoding::F32 => {
                    expect_names(&st, &["values"])?;
                    expect_dtype(values.dtype(), Dtype::F32)?;
                    check_f32_finite(values.data(), "values")
                }
                WireEncoding::Int8 => {
                    expect_names(&st, &["scales", "values"])?;
                    expect_dtype(values.dtype(), Dtype::I8)?;
                    if values.data().contains(&0x80) {
                        return Err(TensorError::NonFinite("values (-128)".into()));
                    }
                    let scales = st
                        .tensor("scales")
                        .map_err(|_| TensorError::Layout("no tensor named \"scales\"".into()))?;
                    expect_dtype(scales.dtype(), Dtype::F32)?;
                    let rows = want[0].saturating_mul(want[1]);
                    let scale_shape: Vec<u64> = scales.shape().iter().map(|d| *d as u64).collect();
                    expect_shape(&scale_shape, &[rows])?;
                    check_f32_finite(scales.data(), "scales")?;
                    if f32_values(scales.data()).any(|s| s < 0.0) {
                        return Err(TensorError::NonFinite("scales (negative)".into()));
                    }
                    Ok(())
                }
                WireEncoding::Int4 => unreachable!("checked above"),
            }
        }
    }
}

/// The f32 a bf16 stands for (its bits are the top half of the f32's).
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// An int4 boundary tensor of logical shape `want` (`[batch, seq, width]`).
fn check_int4(
    st: &SafeTensors<'_>,
    values: &safetensors::tensor::TensorView<'_>,
    meta: &Meta,
    want: &[u64; 3],
) -> Result<(), TensorError> {
    if meta.width != Some(want[2]) {
        return Err(TensorError::Layout(format!(
            "int4 width {:?}, expected {}",
            meta.width, want[2]
        )));
    }
    expect_names(st, &["scales", "values"])?;
    expect_dtype(values.dtype(), Dtype::U8)?;
    let row_bytes = want[2].div_ceil(2);
    let shape: Vec<u64> = values.shape().iter().map(|d| *d as u64).collect();
    expect_shape(&shape, &[want[0], want[1], row_bytes])?;
    for row in values.data().chunks_exact(row_bytes as usize) {
        nibbles::check(row, want[2] as usize)?;
    }
    let scales = st
        .tensor("scales")
        .map_err(|_| TensorError::Layout("no tensor named \"scales\"".into()))?;
    expect_dtype(scales.dtype(), Dtype::BF16)?;
    let scale_shape: Vec<u64> = scales.shape().iter().map(|d| *d as u64).collect();
    expect_shape(&scale_shape, &[want[0].saturating_mul(want[1])])?;
    for pair in scales.data().chunks_exact(2) {
        let s = bf16_to_f32(u16::from_le_bytes([pair[0], pair[1]]));
        if !s.is_finite() {
            return Err(TensorError::NonFinite("scales".into()));
        }
        if s < 0.0 {
            return Err(TensorError::NonFinite("scales (negative)".into()));
        }
    }
    Ok(())
}

fn expect_format(meta: &Meta, want: &str) -> Result<(), TensorError> {
    if meta.format == want {
        Ok(())
    } else {
        Err(TensorError::Layout(format!(
            "format {:?}, expected {want:?}",
            meta.format
        )))
    }
}

fn expect_names(st: &SafeTensors<'_>, want: &[&str]) -> Result<(), TensorError> {
    let mut names: Vec<&str> = st.names().into_iter().collect();
    names.sort_unstable();
    if names == want {
        Ok(())
    } else {
        Err(TensorError::Layout(format!(
            "tensors {names:?}, expected {want:?}"
        )))
    }
}

fn expect_dtype(got: Dtype, want: Dtype) -> Result<(), TensorError> {
    if got == want {
        Ok(())
    } else {
        Err(TensorError::Dtype {
            got: format!("{got:?}"),
            expected: format!("{want:?}"),
        })
    }
}

fn expect_shape(got: &[u64], want: &[u64]) -> Result<(), TensorError> {
    if got == want {
        Ok(())
    } else {
        Err(TensorError::Shape {
            got: got.to_vec(),
            expected: want.to_vec(),
        })
    }
}

fn f32_values(data: &[u8]) -> impl Iterator<Item = f32> + '_ {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

fn check_f32_finite(data: &[u8], what: &str) -> Result<(), TensorError> {
    if f32_values(data).all(f32::is_finite) {
        Ok(())
    } else {
        Err(TensorError::NonFinite(what.to_owned()))
    }
}

/// Encodes a flat f32 partition (`iota-partition/v1`). Deterministic: the same values give the
/// same bytes, so owners of a merge can compare BLAKE3 digests.
pub fn encode_partition(values: &[f32]) -> Vec<u8> {
    encode_f32(PARTITION_FORMAT, None, &[values.len() as u64], values)
}

/// Encodes a merged partition (`iota-merged/v1`): new weights and outer momentum, same length.
/// Deterministic, so independent owners of a merge produce identical bytes and digests.
pub fn encode_merged(values: &[f32], momentum: &[f32]) -> Vec<u8> {
    let len = [values.len() as u64];
    let mlen = [momentum.len() as u64];
    serialize(
        vec![
            (
                "momentum".to_owned(),
                raw_view(Dtype::F32, &mlen, f32_le(momentum)),
            ),
            (
                "values".to_owned(),
                raw_view(Dtype::F32, &len, f32_le(values)),
            ),
        ],
        MERGED_FORMAT,
        None,
    )
}

/// Decodes a checked merged partition into `(values, momentum)`.
pub fn decode_merged(bytes: &[u8], len: u64) -> Result<(Vec<f32>, Vec<f32>), TensorError> {
    check_tensor(bytes, &TensorSpec::Merged { len })?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| TensorError::Unreadable(e.to_string()))?;
    let read = |name: &str| -> Result<Vec<f32>, TensorError> {
        let t = st
            .tensor(name)
            .map_err(|_| TensorError::Layout(format!("no tensor named {name:?}")))?;
        Ok(f32_values(t.data()).collect())
    };
    Ok((read("values")?, read("momentum")?))
}

/// Encodes an f32 boundary tensor (`iota-boundary/v1`) of `shape`. `iota-model` writes the same
/// layout; this is for tools and simulations that do not run the model.
pub fn encode_boundary_f32(shape: [u64; 3], values: &[f32]) -> Vec<u8> {
    encode_f32(BOUNDARY_FORMAT, Some(WireEncoding::F32), &shape, values)
}

/// Encodes an int8 boundary tensor with its per-row scales.
pub fn encode_boundary_i8(shape: [u64; 3], values: &[i8], scales: &[f32]) -> Vec<u8> {
    let data: Vec<u8> = values.iter().map(|v| v.to_le_bytes()[0]).collect();
    let rows = shape[0] * shape[1];
    let mut tensors = vec![
        ("values".to_owned(), raw_view(Dtype::I8, &shape, data)),
        (
            "scales".to_owned(),
            raw_view(Dtype::F32, &[rows], f32_le(scales)),
        ),
    ];
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    serialize(tensors, BOUNDARY_FORMAT, Some(WireEncoding::Int8))
}

/// Encodes an int4 boundary tensor: `values` one nibble per value in `[-7, 7]` (row-major,
/// `shape` elements), packed two a byte, and one bf16 scale per row (its bits).
pub fn encode_boundary_i4(shape: [u64; 3], values: &[i8], scales: &[u16]) -> Vec<u8> {
    let width = shape[2] as usize;
    let packed: Vec<u8> = values
        .chunks(width.max(1))
        .flat_map(nibbles::pack)
        .collect();
    let rows = shape[0] * shape[1];
    let mut tensors = vec![
        (
            "values".to_owned(),
            raw_view(
                Dtype::U8,
                &[shape[0], shape[1], shape[2].div_ceil(2)],
                packed,
            ),
        ),
        (
            "scales".to_owned(),
            raw_view(
                Dtype::BF16,
                &[rows],
                scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            ),
        ),
    ];
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let meta = serde_json::json!({
        "format": BOUNDARY_FORMAT,
        "encoding": WireEncoding::Int4,
        "width": shape[2],
    });
    let info = HashMap::from([(META_KEY.to_owned(), meta.to_string())]);
    safetensors::serialize(tensors, Some(info)).unwrap_or_default()
}

/// Decodes the values of a checked partition.
pub fn decode_partition(bytes: &[u8], len: u64) -> Result<Vec<f32>, TensorError> {
    check_tensor(bytes, &TensorSpec::Partition { len })?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| TensorError::Unreadable(e.to_string()))?;
    let values = st
        .tensor("values")
        .map_err(|_| TensorError::Layout("no tensor named \"values\"".into()))?;
    Ok(f32_values(values.data()).collect())
}

fn f32_le(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

struct RawView {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for RawView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn raw_view(dtype: Dtype, shape: &[u64], data: Vec<u8>) -> RawView {
    RawView {
        dtype,
        shape: shape.iter().map(|d| *d as usize).collect(),
        data,
    }
}

fn encode_f32(
    format: &str,
    encoding: Option<WireEncoding>,
    shape: &[u64],
    values: &[f32],
) -> Vec<u8> {
    serialize(
        vec![(
            "values".to_owned(),
            raw_view(Dtype::F32, shape, f32_le(values)),
        )],
        format,
        encoding,
    )
}

fn serialize(
    tensors: Vec<(String, RawView)>,
    format: &str,
    encoding: Option<WireEncoding>,
) -> Vec<u8> {
    let meta = match encoding {
        Some(e) => serde_json::json!({ "format": format, "encoding": e }),
        None => serde_json::json!({ "format": format }),
    };
    let mut info = HashMap::new();
    info.insert(META_KEY.to_owned(), meta.to_string());
    // Serialising owned, well-formed views cannot fail: shapes and byte lengths agree by
    // construction. An empty buffer would fail every later check rather than pass one.
    safetensors::serialize(tensors, Some(info)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tensors whose sizes are each valid but sum to just under 2^64: the `safetensors` crate
    /// adds the last offset to the header's length unchecked, and panicked on this (where
    /// overflow checks are on, as in tests); it is a refusal.
    #[test]
    fn offsets_near_the_top_of_u64_are_refused_not_a_panic() {
        let n: u64 = (1 << 61) - 1;
        let mut header = serde_json::Map::new();
        header.insert(
            "__metadata__".into(),
            serde_json::json!({ META_KEY: r#"{"format":"iota-partition"}"# }),
        );
        for i in 0..8u64 {
            header.insert(
                format!("t{i}"),
                serde_json::json!({ "dtype": "U8", "shape": [n], "data_offsets": [i * n, (i + 1) * n] }),
            );
        }
        let header = serde_json::to_vec(&header).expect("json");
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&header);
        let spec = TensorSpec::Partition { len: 1000 };
        let checked = std::panic::catch_unwind(|| check_tensor(&bytes, &spec));
        assert!(
            matches!(checked, Ok(Err(TensorError::Unreadable(_)))),
            "{checked:?}"
        );
    }

    #[test]
    fn partition_round_trip_and_checks() {
        let bytes = encode_partition(&[1.0, 2.0, 3.0]);
        assert_eq!(
            check_tensor(&bytes, &TensorSpec::Partition { len: 3 }),
            Ok(())
        );
        assert!(matches!(
            check_tensor(&bytes, &TensorSpec::Partition { len: 4 }),
            Err(TensorError::Shape { .. })
        ));
        assert_eq!(decode_partition(&bytes, 3), Ok(vec![1.0, 2.0, 3.0]));
        let nan = encode_partition(&[1.0, f32::NAN, 3.0]);
        assert!(matches!(
            check_tensor(&nan, &TensorSpec::Partition { len: 3 }),
            Err(TensorError::NonFinite(_))
        ));
        // Finite, but a change no epoch makes: its average would overflow the outer step.
        let huge = encode_partition(&[1.0, -3e38, 3.0]);
        assert!(matches!(
            decode_partition(&huge, 3),
            Err(TensorError::NonFinite(_))
        ));
        let edge = encode_partition(&[MAX_PSEUDO_GRADIENT, -MAX_PSEUDO_GRADIENT]);
        assert_eq!(
            check_tensor(&edge, &TensorSpec::Partition { len: 2 }),
            Ok(())
        );
        assert_eq!(encode_partition(&[1.0, 2.0]), encode_partition(&[1.0, 2.0]));
        // A pseudo-gradient is not a merged partition, and the other way round.
        assert!(check_tensor(&bytes, &TensorSpec::Merged { len: 3 }).is_err());
        let merged = encode_merged(&[1.0, 2.0, 3.0], &[0.0, 0.5, 0.0]);
        assert_eq!(
            check_tensor(&merged, &TensorSpec::Merged { len: 3 }),
            Ok(())
        );
        assert!(check_tensor(&merged, &TensorSpec::Partition { len: 3 }).is_err());
        assert_eq!(
            decode_merged(&merged, 3),
            Ok((vec![1.0, 2.0, 3.0], vec![0.0, 0.5, 0.0]))
        );
        let short_momentum = encode_merged(&[1.0, 2.0, 3.0], &[0.0, 0.5]);
        assert!(check_tensor(&short_momentum, &TensorSpec::Merged { len: 3 }).is_err());
    }

    #[test]
    fn boundary_checks() {
        let spec = TensorSpec::Boundary {
            shape: [2, 3, 4],
            encoding: WireEncoding::F32,
        };
        let ok = encode_boundary_f32([2, 3, 4], &[0.5; 24]);
        assert_eq!(check_tensor(&ok, &spec), Ok(()));
        let wrong_shape = encode_boundary_f32([2, 4, 3], &[0.5; 24]);
        assert!(matches!(
            check_tensor(&wrong_shape, &spec),
            Err(TensorError::Shape { .. })
        ));
        let mut inf = vec![0.5; 24];
        inf[7] = f32::INFINITY;
        assert!(matches!(
            check_tensor(&encode_boundary_f32([2, 3, 4], &inf), &spec),
            Err(TensorError::NonFinite(_))
        ));
        // An int8 tensor where f32 is expected is a layout error, not accepted.
        let q = encode_boundary_i8([2, 3, 4], &[1; 24], &[0.1; 6]);
        assert!(matches!(
            check_tensor(&q, &spec),
            Err(TensorError::Layout(_))
        ));
        // Values of another 4-byte dtype under f32 metadata: right in all but the dtype.
        let i32_values = serialize(
            vec![(
                "values".to_owned(),
                raw_view(Dtype::I32, &[2, 3, 4], vec![0; 96]),
            )],
            BOUNDARY_FORMAT,
            Some(WireEncoding::F32),
        );
        assert!(matches!(
            check_tensor(&i32_values, &spec),
            Err(TensorError::Dtype { .. })
        ));
        let spec8 = TensorSpec::Boundary {
            shape: [2, 3, 4],
            encoding: WireEncoding::Int8,
        };
        assert_eq!(check_tensor(&q, &spec8), Ok(()));
        let bad_q = encode_boundary_i8([2, 3, 4], &[-128; 24], &[0.1; 6]);
        assert!(check_tensor(&bad_q, &spec8).is_err());
        let bad_scale = encode_boundary_i8([2, 3, 4], &[1; 24], &[-0.1; 6]);
        assert!(check_tensor(&bad_scale, &spec8).is_err());
        // A row of zeros quantises with a scale of zero: valid.
        let mut zero_row = vec![1i8; 24];
        zero_row[..4].fill(0);
        let mut scales = [0.1f32; 6];
        scales[0] = 0.0;
        let zero_scale = encode_boundary_i8([2, 3, 4], &zero_row, &scales);
        assert_eq!(check_tensor(&zero_scale, &spec8), Ok(()));
        // A tensor besides the ones the format names is refused, not ignored.
        let extra = serialize(
            vec![
                (
                    "values".to_owned(),
                    raw_view(Dtype::F32, &[2, 3, 4], f32_le(&[0.5; 24])),
                ),
                ("extra".to_owned(), raw_view(Dtype::U8, &[1], vec![0])),
            ],
            BOUNDARY_FORMAT,
            Some(WireEncoding::F32),
        );
        assert!(matches!(
            check_tensor(&extra, &spec),
            Err(TensorError::Layout(_))
        ));
        // `iota-model` refuses a boundary tensor that names no encoding, and an empty one, so
        // the check does too.
        let unnamed = encode_f32(BOUNDARY_FORMAT, None, &[2, 3, 4], &[0.5; 24]);
        assert!(matches!(
            check_tensor(&unnamed, &spec),
            Err(TensorError::Layout(_))
        ));
        let empty = TensorSpec::Boundary {
            shape: [2, 0, 4],
            encoding: WireEncoding::F32,
        };
        assert!(check_tensor(&encode_boundary_f32([2, 0, 4], &[]), &empty).is_err());
        // Garbage and oversize: the size limit is the slot's largest tensor, inclusive.
        assert!(matches!(
            check_tensor(b"not a tensor", &spec),
            Err(TensorError::Unreadable(_))
        ));
        let max = spec.max_bytes() as usize;
        assert!(matches!(
            check_tensor(&vec![0u8; max], &spec),
            Err(TensorError::Unreadable(_))
        ));
        assert!(matches!(
            check_tensor(&vec![0u8; max + 1], &spec),
            Err(TensorError::TooLarge { .. })
        ));
        // An absurd slot saturates its limit instead of overflowing (found by tests/tensor_props.rs).
        for absurd in [
            TensorSpec::Partition { len: u64::MAX / 2 },
            TensorSpec::Merged { len: u64::MAX },
            TensorSpec::Boundary {
                shape: [u64::MAX, u64::MAX, 2],
                encoding: WireEncoding::Int8,
            },
        ] {
            assert_eq!(absurd.max_bytes(), u64::MAX);
            assert!(check_tensor(b"", &absurd).is_err());
        }
        let huge = vec![0u8; spec.max_bytes() as usize + 1];
        assert!(matches!(
            check_tensor(&huge, &spec),
            Err(TensorError::TooLarge { .. })
        ));
    }
}
