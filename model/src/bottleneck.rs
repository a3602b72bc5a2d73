//! Stage-boundary tensors and what they cost on the wire.
//!
//! The residual bottleneck itself (the `d -> b` encoder at the end of a sending stage and the
//! `b -> d` decoder at the start of a receiving one, with the first `b` residual channels carried
//! straight through) lives in the stage's block code; this module defines how the `[batch, seq, b]`
//! activation, and the gradient that comes back for it, travel between machines: as f32 or with
//! per-row (per-token) symmetric 8-bit quantisation with stochastic rounding, encoded as
//! safetensors (a fixed header of about 150 bytes per message on top of the payload), and
//! validated when
//! decoded so that a malformed or non-finite tensor from a peer is an error before it reaches the
//! model.

use candle_core::{DType, Device, Tensor};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::rng::SplitMix64;
use crate::st::{self, OwnedView};

/// Seed of the stochastic-rounding stream: a function of the tensor's values, so the same
/// tensor always encodes to the same bytes (a validator re-deriving a hop gets the same digest).
fn content_seed(data: &[f32]) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(b"iota-model/int8-rounding/v1");
    for chunk in data.chunks(4096) {
        h.update(&st::f32_to_le(chunk));
    }
    let mut first = [0u8; 8];
    first.copy_from_slice(&h.finalize().as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// How a boundary tensor's values are carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireEncoding {
    /// Raw little-endian f32, 4 bytes per value.
    F32,
    /// One i8 per value plus one f32 scale per row (the last dim): `x ~= q * scale` with
    /// `scale = max|x| / 127`. Rounding is stochastic (unbiased): round-to-nearest zeroes the
    /// small entries of a row in the same direction every time, and that bias, mostly in the
    /// gradients, cost 5% of loss at d/b = 64 where stochastic rounding cost nothing.
    Int8,
    /// Two values per byte (the even-indexed one in the low nibble), each `x / scale`
    /// stochastically rounded into `[-7, 7]` as a two's-complement nibble, plus one bf16 scale per
    /// row (`max|x| / 7`, rounded up to bf16). A row of odd width leaves the last high nibble 0.
    /// At a bottleneck of 4 channels that is 4 bytes per token, 256x less than an fp32 residual
    /// stream of 256 channels.
    Int4,
}

impl WireEncoding {
    /// Payload bytes for one row (token) of `width` values.
    pub fn bytes_per_row(self, width: usize) -> usize {
        match self {
            Self::F32 => 4 * width,
            Self::Int8 => width + 4,
            Self::Int4 => width.div_ceil(2) + 2,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Int8 => "int8",
            Self::Int4 => "int4",
        }
    }
}

/// The bf16 at or above a non-negative finite `x` (rounding up keeps `|x| / scale <= 7`).
fn bf16_bits_up(x: f32) -> u16 {
    let bits = x.to_bits();
    let up = match bits & 0xffff {
        0 => bits,
        _ => bits.saturating_add(0x1_0000),
    };
    (up >> 16) as u16
}

fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// A nibble's two's-complement value.
fn nibble(byte: u8, high: bool) -> i8 {
    let n = if high { byte >> 4 } else { byte & 0x0f };
    ((n << 4) as i8) >> 4
}

/// `v / scale` stochastically rounded to an integer in `[-limit, limit]` (0 for a zero scale).
fn stochastic(v: f32, inv_scale: f32, limit: f32, rng: &mut SplitMix64) -> i8 {
    if inv_scale == 0.0 {
        return 0;
    }
    (v * inv_scale + rng.next_f32())
        .floor()
        .clamp(-limit, limit) as i8
}

/// The values of a boundary tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    /// Full-precision values, row-major.
    F32(Vec<f32>),
    /// Quantised values, row-major, with one scale per row.
    Int8 {
        /// `x / scale` stochastically rounded, in `[-127, 127]`.
        values: Vec<i8>,
        /// Per-row `max|x| / 127` (0 for an all-zero row).
        scales: Vec<f32>,
    },
    /// 4-bit values packed two per byte, `ceil(width / 2)` bytes per row, with one bf16 scale
    /// per row.
    Int4 {
        /// Nibbles in `[-7, 7]`, low nibble first.
        packed: Vec<u8>,
        /// Per-row bf16 bits of `max|x| / 7`, rounded up.
        scales: Vec<u16>,
    },
}

/// An activation or activation-gradient crossing a stage boundary.
#[derive(Clone, Debug, PartialEq)]
pub struct BoundaryTensor {
    shape: Vec<usize>,
    payload: Payload,
}

const FORMAT: &str = "iota-boundary/v1";

#[derive(Serialize, Deserialize)]
struct Meta {
    format: String,
    encoding: WireEncoding,
    /// The row width of an int4 tensor, whose `values` hold half as many bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    width: Option<usize>,
}

impl BoundaryTensor {
    /// Encode row-major `data` of `shape` (last dim = row width).
    pub fn from_f32(shape: &[usize], data: &[f32], encoding: WireEncoding) -> Result<Self> {
        let n = shape
            .iter()
            .try_fold(1usize, |a, d| a.checked_mul(*d))
            .unwrap_or(0);
        if shape.is_empty() || n == 0 {
            return Err(ModelError::InvalidInput(format!(
                "boundary tensor needs a non-empty shape of addressable size, got {shape:?}"
            )));
        }
        if data.len() != n {
            return Err(ModelError::shape(
                "boundary tensor data",
                &[n],
                &[data.len()],
            ));
        }
        if data.iter().any(|v| !v.is_finite()) {
            return Err(ModelError::NonFinite("boundary tensor".into()));
        }
        let payload = match encoding {
            WireEncoding::F32 => Payload::F32(data.to_vec()),
            WireEncoding::Int8 => {
                let width = shape[shape.len() - 1];
                let mut rng = SplitMix64::new(content_seed(data));
                let mut values = Vec::with_capacity(n);
                let mut scales = Vec::with_capacity(n / width);
                for row in data.chunks_exact(width) {
                    let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let scale = amax / 127.0;
                    scales.push(scale);
                    if scale == 0.0 {
                        values.extend(std::iter::repeat_n(0i8, width));
                    } else {
                        let inv = 1.0 / scale;
                        // |v * inv| <= 127 up to rounding; the clamp guards that last ulp.
                        values.extend(row.iter().map(|v| {
                            (v * inv + rng.next_f32()).floor().clamp(-127.0, 127.0) as i8
                        }));
                    }
                }
                Payload::Int8 { values, scales }
            }
            WireEncoding::Int4 => {
                let width = shape[shape.len() - 1];
                let mut rng = SplitMix64::new(content_seed(data));
                let mut packed = Vec::with_capacity(n / width * width.div_ceil(2));
                let mut scales = Vec::with_capacity(n / width);
                for row in data.chunks_exact(width) {
                    let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let bits = bf16_bits_up(amax / 7.0);
                    scales.push(bits);
                    let scale = bf16_to_f32(bits);
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    for pair in row.chunks(2) {
                        let lo = stochastic(pair[0], inv, 7.0, &mut rng);
                        let hi = pair
                            .get(1)
                            .map_or(0, |v| stochastic(*v, inv, 7.0, &mut rng));
                        packed.push((lo as u8 & 0x0f) | ((hi as u8 & 0x0f) << 4));
                    }
                }
                Payload::Int4 { packed, scales }
            }
        };
        Ok(Self {
            shape: shape.to_vec(),
            payload,
        })
    }

    /// Encode a candle tensor (any float dtype, any device).
    pub fn from_tensor(t: &Tensor, encoding: WireEncoding) -> Result<Self> {
        if !t.dtype().is_float() {
            return Err(ModelError::DType {
                what: "boundary tensor".into(),
                expected: DType::F32,
                got: t.dtype(),
            });
        }
        let data = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        Self::from_f32(t.dims(), &data, encoding)
    }

    /// Dimensions, e.g. `[batch, seq, b]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The encoding of the payload.
    pub fn encoding(&self) -> WireEncoding {
        match self.payload {
            Payload::F32(_) => WireEncoding::F32,
            Payload::Int8 { .. } => WireEncoding::Int8,
            Payload::Int4 { .. } => WireEncoding::Int4,
        }
    }

    /// The raw payload.
    pub fn payload(&self) -> &Payload {
        &self.payload
    }

    /// Number of rows (tokens).
    pub fn rows(&self) -> usize {
        self.shape[..self.shape.len() - 1].iter().product()
    }

    /// Payload bytes (values plus scales), excluding the fixed safetensors header.
    pub fn payload_bytes(&self) -> usize {
        self.rows()
            * self
                .encoding()
                .bytes_per_row(self.shape[self.shape.len() - 1])
    }

    /// Dequantised values, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.payload {
            Payload::F32(v) => v.clone(),
            Payload::Int8 { values, scales } => {
                let width = self.shape[self.shape.len() - 1];
                values
                    .chunks_exact(width)
                    .zip(scales)
                    .flat_map(|(row, s)| row.iter().map(move |q| f32::from(*q) * s))
                    .collect()
            }
            Payload::Int4 { packed, scales } => {
                let width = self.shape[self.shape.len() - 1];
                packed
                    .chunks_exact(width.div_ceil(2))
                    .zip(scales)
                    .flat_map(|(row, bits)| {
                        let s = bf16_to_f32(*bits);
                        (0..width).map(move |i| f32::from(nibble(row[i / 2], i % 2 == 1)) * s)
                    })
                    .collect()
            }
        }
    }

    /// Dequantised f32 tensor on `device`.
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_vec(self.to_f32(), self.shape.clone(), device)?)
    }

    /// Error unless the shape is exactly `expected`.
    pub fn expect_shape(&self, expected: &[usize]) -> Result<()> {
        if self.shape != expected {
            return Err(ModelError::shape("boundary tensor", expected, &self.shape));
        }
        Ok(())
    }

    /// safetensors bytes: `values` (F32 or I8, the tensor's shape), `scales` (F32, one per row)
    /// for int8, and a metadata entry naming the format.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let width = self.shape[self.shape.len() - 1];
        let meta = serde_json::to_string(&Meta {
            format: FORMAT.into(),
            encoding: self.encoding(),
            width: (self.encoding() == WireEncoding::Int4).then_some(width),
        })?;
        let mut tensors = Vec::new();
        match &self.payload {
            Payload::F32(v) => {
                tensors.push(("values".to_string(), st::f32_view(self.shape.clone(), v)))
            }
            Payload::Int8 { values, scales } => {
                tensors.push((
                    "values".to_string(),
                    OwnedView {
                        dtype: Dtype::I8,
                        shape: self.shape.clone(),
                        data: values.iter().map(|q| q.to_le_bytes()[0]).collect(),
                    },
                ));
                tensors.push((
                    "scales".to_string(),
                    st::f32_view(vec![self.rows()], scales),
                ));
            }
            Payload::Int4 { packed, scales } => {
                let mut shape = self.shape.clone();
                let last = shape.len() - 1;
                shape[last] = width.div_ceil(2);
                tensors.push((
                    "values".to_string(),
                    OwnedView {
                        dtype: Dtype::U8,
                        shape,
                        data: packed.clone(),
                    },
                ));
                tensors.push((
                    "scales".to_string(),
                    OwnedView {
                        dtype: Dtype::BF16,
                        shape: vec![self.rows()],
                        data: scales.iter().flat_map(|b| b.to_le_bytes()).collect(),
                    },
                ));
            }
        }
        st::encode(tensors, &meta)
    }

    /// Decode and validate bytes from a peer. `expected_shape`, when given, must match exactly.
    pub fn from_bytes(bytes: &[u8], expected_shape: Option<&[usize]>) -> Result<Self> {
        let (tensors, meta) = st::decode(bytes)?;
        let meta: Meta = serde_json::from_str(&meta)
            .map_err(|e| ModelError::Wire(format!("bad boundary metadata: {e}")))?;
        if meta.format != FORMAT {
            return Err(ModelError::Wire(format!(
                "unknown format {:?}",
                meta.format
            )));
        }
        let values = tensors
            .tensor("values")
            .map_err(|_| ModelError::Wire("missing tensor \"values\"".into()))?;
        let mut shape = values.shape().to_vec();
        // An int4 tensor stores half a byte per value: its width is in the metadata.
        if meta.encoding == WireEncoding::Int4 {
            let (Some(width), Some(last)) = (meta.width, shape.last_mut()) else {
                return Err(ModelError::Wire(
                    "int4 boundary tensor without a width".into(),
                ));
            };
            if width == 0 || width.div_ceil(2) != *last {
                return Err(ModelError::Wire(format!(
                    "int4 width {width} does not fit {last} bytes per row"
                )));
            }
            *last = width;
        }
        if let Some(exp) = expected_shape
            && shape != exp
        {
            return Err(ModelError::shape("boundary tensor", exp, &shape));
        }
        let n: usize = shape.iter().product();
        if shape.is_empty() || n == 0 {
            return Err(ModelError::Wire(format!("empty boundary tensor {shape:?}")));
        }
        let rows = n / shape[shape.len() - 1];
        let expected_names = match meta.encoding {
            WireEncoding::F32 => 1,
            WireEncoding::Int8 | WireEncoding::Int4 => 2,
        };
        if tensors.len() != expected_names {
            return Err(ModelError::Wire(format!(
                "{} tensors for encoding {}, expected {expected_names}",
                tensors.len(),
                meta.encoding.as_str()
            )));
        }
        let payload = match meta.encoding {
            WireEncoding::F32 => {
                let (_, v) = st::read_f32(&tensors, "values", Some(&shape))?;
                if v.iter().any(|x| !x.is_finite()) {
                    return Err(ModelError::NonFinite("decoded boundary tensor".into()));
                }
                Payload::F32(v)
            }
            WireEncoding::Int8 => {
                if values.dtype() != Dtype::I8 {
                    return Err(ModelError::Wire(format!(
                        "int8 payload has dtype {:?}",
                        values.dtype()
                    )));
                }
                let q: Vec<i8> = values
                    .data()
                    .iter()
                    .map(|b| i8::from_le_bytes([*b]))
                    .collect();
                if q.contains(&i8::MIN) {
                    return Err(ModelError::Wire(
                        "int8 value -128 is outside [-127, 127]".into(),
                    ));
                }
                let (_, scales) = st::read_f32(&tensors, "scales", Some(&[rows]))?;
                if scales.iter().any(|s| !(s.is_finite() && *s >= 0.0)) {
                    return Err(ModelError::NonFinite(
                        "int8 scales (or negative scale)".into(),
                    ));
                }
                Payload::Int8 { values: q, scales }
            }
            WireEncoding::Int4 => {
                if values.dtype() != Dtype::U8 {
                    return Err(ModelError::Wire(format!(
                        "int4 payload has dtype {:?}",
                        values.dtype()
                    )));
                }
                let width = shape[shape.len() - 1];
                let packed = values.data().to_vec();
                for row in packed.chunks_exact(width.div_ceil(2)) {
                    for i in 0..width {
                        if nibble(row[i / 2], i % 2 == 1) == -8 {
                            return Err(ModelError::Wire(
                                "int4 value -8 is outside [-7, 7]".into(),
                            ));
                        }
                    }
                    if width % 2 == 1 && row[width / 2] >> 4 != 0 {
                        return Err(ModelError::Wire("int4 padding nibble is not zero".into()));
                    }
                }
                let scales_view = tensors
                    .tensor("scales")
                    .map_err(|_| ModelError::Wire("missing tensor \"scales\"".into()))?;
                if scales_view.dtype() != Dtype::BF16 || scales_view.shape() != [rows] {
                    return Err(ModelError::Wire(format!(
                        "int4 scales are {:?} {:?}, expected BF16 [{rows}]",
                        scales_view.dtype(),
                        scales_view.shape()
                    )));
                }
                let scales: Vec<u16> = scales_view
                    .data()
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
                if scales.iter().any(|b| {
                    let s = bf16_to_f32(*b);
                    !(s.is_finite() && s >= 0.0)
                }) {
                    return Err(ModelError::NonFinite(
                        "int4 scales (or negative scale)".into(),
                    ));
                }
                Payload::Int4 { packed, scales }
            }
        };
        Ok(Self { shape, payload })
    }

    /// BLAKE3 of the encoded bytes, as recorded with every hop.
    pub fn digest(&self) -> Result<blake3::Hash> {
        Ok(blake3::hash(&self.to_bytes()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (Vec<usize>, Vec<f32>) {
        let shape = vec![2, 3, 4];
        let data: Vec<f32> = (0..24)
            .map(|i| ((i as f32) * 0.37).sin() * (1 + i % 5) as f32)
            .collect();
        (shape, data)
    }

    #[test]
    fn f32_round_trip_is_exact() {
        let (shape, data) = sample();
        let t = BoundaryTensor::from_f32(&shape, &data, WireEncoding::F32).unwrap();
        let bytes = t.to_bytes().unwrap();
        let back = BoundaryTensor::from_bytes(&bytes, Some(&shape)).unwrap();
        assert_eq!(back.to_f32(), data);
        assert_eq!(back.payload_bytes(), 24 * 4);
        assert_eq!(t.digest().unwrap(), back.digest().unwrap());
    }

    #[test]
    fn int8_error_is_bounded_per_row() {
        let (shape, data) = sample();
        let t = BoundaryTensor::from_f32(&shape, &data, WireEncoding::Int8).unwrap();
        assert_eq!(t.payload_bytes(), 6 * (4 + 4));
        let back = BoundaryTensor::from_bytes(&t.to_bytes().unwrap(), None).unwrap();
        assert_eq!(back, t);
        let deq = back.to_f32();
        for (row, qrow) in data.chunks(4).zip(deq.chunks(4)) {
            let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (a, b) in row.iter().zip(qrow) {
                assert!((a - b).abs() <= amax / 127.0 + 1e-6);
            }
        }
        // Same values, same bytes.
        let again = BoundaryTensor::from_f32(&shape, &data, WireEncoding::Int8).unwrap();
        assert_eq!(again.to_bytes().unwrap(), t.to_bytes().unwrap());
    }

    #[test]
    fn int8_rounding_is_unbiased() {
        // 0.25 sits at 31.75 quanta: it must round up 3 times in 4, not always.
        let rows = 20_000;
        let data: Vec<f32> = (0..rows).flat_map(|_| [1.0f32, 0.25]).collect();
        let t = BoundaryTensor::from_f32(&[rows, 2], &data, WireEncoding::Int8).unwrap();
        let deq = t.to_f32();
        let mean = deq
            .iter()
            .skip(1)
            .step_by(2)
            .map(|v| f64::from(*v))
            .sum::<f64>()
            / rows as f64;
        assert!((mean - 0.25).abs() < 2e-4, "mean {mean}");
        assert!(deq.iter().step_by(2).all(|v| *v == 1.0));
    }

    #[test]
    fn zero_rows_quantise_to_zero() {
        let t =
            BoundaryTensor::from_f32(&[2, 2], &[0.0, 0.0, 1.0, -1.0], WireEncoding::Int8).unwrap();
        assert_eq!(t.to_f32(), vec![0.0, 0.0, 1.0, -1.0]);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(
            BoundaryTensor::from_f32(&[2, 2], &[1.0, f32::NAN, 0.0, 0.0], WireEncoding::F32)
                .is_err()
        );
        assert!(BoundaryTensor::from_f32(&[2, 2], &[1.0], WireEncoding::F32).is_err());
        assert!(BoundaryTensor::from_f32(&[], &[], WireEncoding::F32).is_err());
        assert!(BoundaryTensor::from_f32(&[usize::MAX, 3], &[1.0], WireEncoding::Int8).is_err());
        let (shape, data) = sample();
        let bytes = BoundaryTensor::from_f32(&shape, &data, WireEncoding::F32)
            .unwrap()
            .to_bytes()
            .unwrap();
        assert!(BoundaryTensor::from_bytes(&bytes, Some(&[2, 3, 5])).is_err());
        assert!(BoundaryTensor::from_bytes(&bytes[..bytes.len() - 3], None).is_err());
        assert!(BoundaryTensor::from_bytes(b"garbage", None).is_err());
        // A NaN smuggled into the bytes is caught on decode.
        let mut bad = bytes.clone();
        let n = bad.len();
        bad[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(matches!(
            BoundaryTensor::from_bytes(&bad, None),
            Err(ModelError::NonFinite(_))
        ));
        let int = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
        assert!(BoundaryTensor::from_tensor(&int, WireEncoding::F32).is_err());
    }

    #[test]
    fn bytes_per_row() {
        assert_eq!(WireEncoding::F32.bytes_per_row(32), 128);
        assert_eq!(WireEncoding::Int8.bytes_per_row(32), 36);
        assert_eq!(WireEncoding::Int4.bytes_per_row(4), 4);
        assert_eq!(WireEncoding::Int4.bytes_per_row(5), 5);
    }

    #[test]
    fn int4_round_trips_within_half_a_step_of_seven_per_row() {
        // Odd and even widths: the odd one pads its last byte.
        for shape in [vec![2, 3, 4], vec![3, 5]] {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n)
                .map(|i| ((i as f32) * 0.37).sin() * (1 + i % 5) as f32 * 1e-3)
                .collect();
            let t = BoundaryTensor::from_f32(&shape, &data, WireEncoding::Int4).unwrap();
            let width = shape[shape.len() - 1];
            assert_eq!(t.payload_bytes(), n / width * (width.div_ceil(2) + 2));
            let bytes = t.to_bytes().unwrap();
            let back = BoundaryTensor::from_bytes(&bytes, Some(&shape)).unwrap();
            assert_eq!(back, t);
            assert_eq!(back.shape(), &shape[..]);
            for (row, qrow) in data.chunks(width).zip(back.to_f32().chunks(width)) {
                let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                // One quantum (stochastic rounding) of a scale at most 1/128 above amax / 7.
                let step = amax / 7.0 * (1.0 + 1.0 / 128.0);
                for (a, b) in row.iter().zip(qrow) {
                    assert!((a - b).abs() <= step * 1.0001, "{a} vs {b}, step {step}");
                }
            }
            // Same values, same bytes.
            let again = BoundaryTensor::from_f32(&shape, &data, WireEncoding::Int4).unwrap();
            assert_eq!(again.to_bytes().unwrap(), bytes);
        }
    }

    #[test]
    fn int4_rounding_is_unbiased_and_tiny_gradients_keep_their_scale() {
        // 1e-9 is far below f16's range: a bf16 scale keeps it.
        let rows = 20_000;
        let data: Vec<f32> = (0..rows).flat_map(|_| [7e-9f32, 1e-9]).collect();
        let t = BoundaryTensor::from_f32(&[rows, 2], &data, WireEncoding::Int4).unwrap();
        let deq = t.to_f32();
        let mean = |k: usize| {
            deq.iter()
                .skip(k)
                .step_by(2)
                .map(|v| f64::from(*v))
                .sum::<f64>()
                / rows as f64
        };
        assert!((mean(0) - 7e-9).abs() < 7e-11, "{}", mean(0));
        assert!((mean(1) - 1e-9).abs() < 2e-11, "{}", mean(1));
    }

    #[test]
    fn int4_bytes_from_a_peer_are_checked() {
        let shape = [1, 2, 3];
        let data = [0.5f32, -0.25, 1.0, 0.0, 0.0, 0.0];
        let good = BoundaryTensor::from_f32(&shape, &data, WireEncoding::Int4).unwrap();
        assert!(BoundaryTensor::from_bytes(&good.to_bytes().unwrap(), Some(&shape)).is_ok());
        // Bytes a peer could send: each tampered payload encoded as the wire carries it.
        let Payload::Int4 { packed, scales } = good.payload().clone() else {
            unreachable!("int4")
        };
        let tampered = |packed: Vec<u8>, scales: Vec<u16>| {
            let t = BoundaryTensor {
                shape: shape.to_vec(),
                payload: Payload::Int4 { packed, scales },
            };
            BoundaryTensor::from_bytes(&t.to_bytes().unwrap(), Some(&shape))
        };
        let mut minus_eight = packed.clone();
        minus_eight[0] = (minus_eight[0] & 0xf0) | 0x08;
        assert!(tampered(minus_eight, scales.clone()).is_err());
        let mut padding = packed.clone();
        padding[1] |= 0x10;
        assert!(tampered(padding, scales.clone()).is_err());
        let mut nan_scale = scales.clone();
        nan_scale[1] = 0x7fc0;
        assert!(matches!(
            tampered(packed.clone(), nan_scale),
            Err(ModelError::NonFinite(_))
        ));
        let mut negative = scales.clone();
        negative[0] = 0xbf80;
        assert!(tampered(packed.clone(), negative).is_err());
        assert!(tampered(packed, scales).is_ok());
        assert!(BoundaryTensor::from_bytes(&good.to_bytes().unwrap(), Some(&[1, 2, 4])).is_err());
    }
}
