//! Checking a partition or a merged tensor as its bytes stream in, with bounded memory.

use safetensors::Dtype;

use super::{
    MAX_PSEUDO_GRADIENT, MERGED_FORMAT, PARTITION_FORMAT, TensorError, TensorSpec, expect_dtype,
    expect_format, expect_shape, f32_values, header_offsets_fit, iota_meta,
};

/// The longest header [`StreamCheck`] holds: a partition's or a merge's is a few hundred bytes.
pub const MAX_STREAM_HEADER: u64 = 64 * 1024;

/// Checks a partition or a merged tensor as its bytes arrive, in order and in chunks of any
/// size: what [`check_tensor`] accepts, it accepts, and nothing else. The header is checked as
/// soon as it is complete, each value as it arrives, and the whole is hashed on the way, so what
/// it holds is the header (at most [`MAX_STREAM_HEADER`]) and the bytes of one value split
/// between chunks, whatever the object's size.
pub struct StreamCheck {
    spec: TensorSpec,
    /// The object's size, as the store reports it.
    size: u64,
    hasher: blake3::Hasher,
    /// Bytes fed so far.
    fed: u64,
    /// The length prefix and header, until the header is complete.
    head: Vec<u8>,
    /// Once the header is checked: each tensor's bytes in the object.
    layout: Option<Vec<Region>>,
    /// A value's first bytes, when a chunk ended inside it.
    carry: Vec<u8>,
}

/// One tensor's bytes in an object [`StreamCheck`] reads.
struct Region {
    name: String,
    bytes: std::ops::Range<u64>,
    /// Whether its values are bounded by [`MAX_PSEUDO_GRADIENT`].
    bounded: bool,
}

impl StreamCheck {
    /// A check of an object of `size` bytes against `spec` (a partition or a merge).
    pub fn new(spec: &TensorSpec, size: u64) -> Result<Self, TensorError> {
        if !matches!(
            spec,
            TensorSpec::Partition { .. } | TensorSpec::Merged { .. }
        ) {
            return Err(TensorError::Layout(
                "only partitions and merges are checked as a stream".into(),
            ));
        }
        let max = spec.max_bytes();
        if size > max {
            return Err(TensorError::TooLarge { got: size, max });
        }
        Ok(Self {
            spec: spec.clone(),
            size,
            hasher: blake3::Hasher::new(),
            fed: 0,
            head: Vec::new(),
            layout: None,
            carry: Vec::new(),
        })
    }

    /// The next bytes of the object.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Result<(), TensorError> {
        let end = self.fed.saturating_add(chunk.len() as u64);
        if end > self.size {
            return Err(TensorError::Unreadable(format!(
                "more than the {} bytes the object was said to have",
                self.size
            )));
        }
        self.hasher.update(chunk);
        if self.layout.is_none() {
            let taken = self.take_head(chunk)?;
            self.fed += taken as u64;
            chunk = &chunk[taken..];
        }
        if !chunk.is_empty() {
            self.check_values(chunk)?;
            self.fed += chunk.len() as u64;
        }
        Ok(())
    }

    /// The BLAKE3 of the whole object (hex), once every byte has been fed and checked.
    pub fn finish(self) -> Result<String, TensorError> {
        if self.fed != self.size || self.layout.is_none() || !self.carry.is_empty() {
            return Err(TensorError::Unreadable(format!(
                "{} of the {} bytes the object was said to have",
                self.fed, self.size
            )));
        }
        Ok(self.hasher.finalize().to_hex().to_string())
    }

    /// Takes header bytes from `chunk` until the header is complete, then checks it; how many
    /// bytes of `chunk` were header.
    fn take_head(&mut self, chunk: &[u8]) -> Result<usize, TensorError> {
        let unreadable = |why: String| TensorError::Unreadable(why);
        let want = if self.head.len() < 8 {
            8
        } else {
            let n = u64::from_le_bytes(self.head[..8].try_into().unwrap_or([0; 8]));
            if n > MAX_STREAM_HEADER {
                return Err(unreadable(format!(
                    "a header of {n} bytes (at most {MAX_STREAM_HEADER})"
                )));
            }
            8 + n as usize
        };
        let taken = (want - self.head.len()).min(chunk.len());
        self.head.extend_from_slice(&chunk[..taken]);
        if self.head.len() < want {
            return Ok(taken);
        }
        if want == 8 {
            // The length is in: take the header itself from what is left.
            return Ok(taken + self.take_head(&chunk[taken..])?);
        }
        self.layout = Some(self.check_header()?);
        Ok(taken)
    }

    /// The header's checks of [`check_tensor`], on the header alone.
    fn check_header(&self) -> Result<Vec<Region>, TensorError> {
        let unreadable = |why: String| TensorError::Unreadable(why);
        let header = &self.head[8..];
        let start = self.head.len() as u64;
        let data_len = self
            .size
            .checked_sub(start)
            .ok_or_else(|| unreadable("header longer than the object".into()))?;
        header_offsets_fit(header, data_len)?;
        let text = std::str::from_utf8(header).map_err(|e| unreadable(e.to_string()))?;
        let metadata: safetensors::tensor::Metadata =
            serde_json::from_str(text).map_err(|e| unreadable(e.to_string()))?;
        if metadata.data_len() as u64 != data_len {
            return Err(unreadable(
                "incomplete metadata, file not fully covered".into(),
            ));
        }
        let meta = iota_meta(&metadata)?;
        let tensors = metadata.tensors();
        let mut names: Vec<&str> = tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        let (format, want, len, bounded): (&str, &[&str], u64, bool) = match self.spec {
            TensorSpec::Partition { len } => (PARTITION_FORMAT, &["values"], len, true),
            TensorSpec::Merged { len } => (MERGED_FORMAT, &["momentum", "values"], len, false),
            // Refused by `new`.
            TensorSpec::Boundary { .. } | TensorSpec::Sparse(_) => {
                return Err(TensorError::Layout("not a dense partition or merge".into()));
            }
        };
        if !names.contains(&"values") {
            return Err(TensorError::Layout("no tensor named \"values\"".into()));
        }
        expect_format(&meta, format)?;
        if names != want {
            return Err(TensorError::Layout(format!(
                "tensors {names:?}, expected {want:?}"
            )));
        }
        // In the order `check_tensor` checks them.
        let mut regions = Vec::new();
        for name in want.iter().rev() {
            let info = tensors[*name];
            expect_dtype(info.dtype, Dtype::F32)?;
            let shape: Vec<u64> = info.shape.iter().map(|d| *d as u64).collect();
            expect_shape(&shape, &[len])?;
            let (a, b) = info.data_offsets;
            regions.push(Region {
                name: (*name).to_owned(),
                bytes: start + a as u64..start + b as u64,
                bounded,
            });
        }
        Ok(regions)
    }

    /// Checks the values in `chunk`, the bytes of the object from `self.fed` on.
    fn check_values(&mut self, chunk: &[u8]) -> Result<(), TensorError> {
        let Some(regions) = &self.layout else {
            return Err(TensorError::Unreadable("data before the header".into()));
        };
        let mut at = self.fed;
        let mut rest = chunk;
        while !rest.is_empty() {
            // Values are 4 bytes from each region's start; the regions cover the data exactly.
            let Some(region) = regions.iter().find(|r| r.bytes.contains(&at)) else {
                return Err(TensorError::Unreadable("bytes outside every tensor".into()));
            };
            let in_region = (region.bytes.end - at).min(rest.len() as u64) as usize;
            let (mine, next) = rest.split_at(in_region);
            let mut bytes = std::mem::take(&mut self.carry);
            bytes.extend_from_slice(mine);
            let whole = bytes.len() / 4 * 4;
            for v in f32_values(&bytes[..whole]) {
                if !v.is_finite() {
                    return Err(TensorError::NonFinite(region.name.clone()));
                }
                if region.bounded && v.abs() > MAX_PSEUDO_GRADIENT {
                    return Err(TensorError::NonFinite(format!(
                        "values (beyond ±{MAX_PSEUDO_GRADIENT:e})"
                    )));
                }
            }
            self.carry = bytes[whole..].to_vec();
            at += in_region as u64;
            rest = next;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{
        check_tensor, encode_merged, encode_partition, f32_le, raw_view, serialize,
    };

    fn streamed(bytes: &[u8], spec: &TensorSpec, chunk: usize) -> Result<String, TensorError> {
        let mut check = StreamCheck::new(spec, bytes.len() as u64)?;
        for part in bytes.chunks(chunk.max(1)) {
            check.feed(part)?;
        }
        check.finish()
    }

    /// What the stream check accepts is exactly what `check_tensor` accepts, however the bytes
    /// are cut into chunks, and its hash is the whole object's.
    #[test]
    fn a_streamed_check_accepts_exactly_what_the_whole_check_accepts() {
        let len = 37usize;
        let values: Vec<f32> = (0..len).map(|i| i as f32 * 0.25 - 3.0).collect();
        let mut corpus: Vec<(&str, Vec<u8>)> = vec![
            ("partition", encode_partition(&values)),
            ("merged", encode_merged(&values, &values)),
            ("short partition", encode_partition(&values[1..])),
            ("empty", Vec::new()),
            ("a length only", 40u64.to_le_bytes().to_vec()),
            ("seven bytes", vec![1; 7]),
        ];
        for (name, at, value) in [
            ("NaN first", 0, f32::NAN),
            ("NaN last", len - 1, f32::NAN),
            ("infinity", 17, f32::INFINITY),
            ("beyond the bound", 5, 2.0 * MAX_PSEUDO_GRADIENT),
        ] {
            let mut v = values.clone();
            v[at] = value;
            corpus.push((name, encode_partition(&v)));
            corpus.push((name, encode_merged(&values, &v)));
            corpus.push((name, encode_merged(&v, &values)));
        }
        corpus.push((
            "f16",
            serialize(
                vec![(
                    "values".into(),
                    raw_view(Dtype::F16, &[len as u64 * 2], f32_le(&values)),
                )],
                PARTITION_FORMAT,
                None,
            ),
        ));
        let good = encode_partition(&values);
        let mut truncated = good.clone();
        truncated.pop();
        corpus.push(("truncated", truncated));
        let mut longer = good.clone();
        longer.extend_from_slice(&[0; 4]);
        corpus.push(("longer", longer));
        for at in [8, 12, 20, 40] {
            let mut header = good.clone();
            header[at] ^= 0x5a;
            corpus.push(("header byte", header));
        }
        let mut huge = good.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        corpus.push(("huge header length", huge));

        let specs = [
            TensorSpec::Partition { len: len as u64 },
            TensorSpec::Merged { len: len as u64 },
        ];
        let (mut accepted, mut refused) = (0, 0);
        for (name, bytes) in &corpus {
            for spec in &specs {
                let whole = check_tensor(bytes, spec);
                for chunk in [1, 3, 4, 5, 7, 64, 4096] {
                    let stream = streamed(bytes, spec, chunk);
                    assert_eq!(
                        stream.is_ok(),
                        whole.is_ok(),
                        "{name} as {spec:?} in chunks of {chunk}: stream {stream:?}, whole {whole:?}"
                    );
                    if let Ok(hash) = stream {
                        assert_eq!(hash, blake3::hash(bytes).to_hex().to_string());
                    }
                }
                if whole.is_ok() {
                    accepted += 1;
                } else {
                    refused += 1;
                }
            }
        }
        // Both kinds are exercised: the two good objects and the merges with an out-of-bound
        // value (unbounded there), against the rest.
        assert_eq!(accepted, 4, "accepted");
        assert!(refused > 30, "refused {refused}");
        // An object that says it is longer than it turns out to be, or shorter, is refused.
        let mut check = StreamCheck::new(&specs[0], good.len() as u64 + 1).expect("check");
        assert!(check.feed(&good).and_then(|()| check.finish()).is_err());
        let mut check = StreamCheck::new(&specs[0], good.len() as u64 - 1).expect("check");
        assert!(check.feed(&good).is_err());
    }
}
