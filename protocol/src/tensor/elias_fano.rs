//! Elias-Fano coding of the offsets a sparse vector keeps in each chunk: `n` ascending offsets
//! below a chunk length `L` cost `n * l` low bits plus a bitmap of `n + ((L - 1) >> l)` bits for
//! the high parts, whatever the offsets are, so the size follows from the shape alone.
//!
//! Each offset `o` (the `i`-th of its chunk) puts its `l` low bits in `low_bits` and sets bit
//! `(o >> l) + i` of its chunk's region of `high_bits`. Both tensors are bit streams, least
//! significant bit first, chunk after chunk, with the bits after the last chunk 0: one encoding
//! per set of offsets, so equal vectors have equal bytes.

use super::TensorError;

/// The `l` that makes the code of `k` offsets in a chunk of `chunk` smallest:
/// `floor(log2(chunk / k))`.
pub(super) fn low_bit_count(chunk: u64, k: u64) -> u32 {
    (chunk / k.max(1)).max(1).ilog2()
}

/// Bits of a chunk's region of `high_bits`.
pub(super) fn high_region(chunk_len: u64, n: u64, l: u32) -> u64 {
    n + ((chunk_len.max(1) - 1) >> l)
}

/// Bits a chunk's offsets take, low and high.
pub(super) fn chunk_bits(chunk_len: u64, n: u64, l: u32) -> u64 {
    n * u64::from(l) + high_region(chunk_len, n, l)
}

/// Bits written least significant first.
#[derive(Default)]
struct BitWriter {
    bytes: Vec<u8>,
    acc: u64,
    filled: u32,
}

impl BitWriter {
    /// Appends the low `count` (at most 32) bits of `value`.
    fn put(&mut self, value: u64, count: u32) {
        self.acc |= (value & ((1u64 << count) - 1)) << self.filled;
        self.filled += count;
        while self.filled >= 8 {
            self.bytes.push(self.acc as u8);
            self.acc >>= 8;
            self.filled -= 8;
        }
    }

    fn zeros(&mut self, mut count: u64) {
        while count > 0 {
            let n = count.min(32) as u32;
            self.put(0, n);
            count -= u64::from(n);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        if self.filled > 0 {
            self.bytes.push(self.acc as u8);
        }
        self.bytes
    }
}

/// Bits read least significant first; reading past the end is an error.
struct BitReader<'a> {
    bytes: &'a [u8],
    at: u64,
}

impl BitReader<'_> {
    fn bit(&mut self) -> Result<bool, TensorError> {
        let byte = self
            .bytes
            .get((self.at / 8) as usize)
            .ok_or_else(|| TensorError::Layout("offset bits end early".into()))?;
        let bit = byte >> (self.at % 8) & 1 == 1;
        self.at += 1;
        Ok(bit)
    }

    fn get(&mut self, count: u32) -> Result<u64, TensorError> {
        let mut value = 0u64;
        for i in 0..count {
            value |= u64::from(self.bit()?) << i;
        }
        Ok(value)
    }

    /// The stream ends in the byte of its last bit read, whose bits after it are 0.
    fn ends_here(&self, what: &str) -> Result<(), TensorError> {
        let used = self.at.div_ceil(8) as usize;
        let padding = match (self.at % 8, used.checked_sub(1)) {
            (0, _) | (_, None) => 0,
            (bits, Some(last)) => self.bytes[last] >> bits,
        };
        if self.bytes.len() != used || padding != 0 {
            return Err(TensorError::Layout(format!(
                "{what}: {} bytes, expected {used} ending in zero bits",
                self.bytes.len()
            )));
        }
        Ok(())
    }
}

/// Encodes `offsets`, ascending in each chunk, the chunks given as (length, kept count).
/// Returns (`low_bits`, `high_bits`).
pub(super) fn encode(
    offsets: &[u16],
    chunks: impl Iterator<Item = (u64, u64)>,
    l: u32,
) -> (Vec<u8>, Vec<u8>) {
    let (mut low, mut high) = (BitWriter::default(), BitWriter::default());
    let mut at = 0usize;
    for (chunk_len, n) in chunks {
        let n = (n as usize).min(offsets.len() - at);
        let mut written = 0u64;
        let mut previous_high = 0u64;
        for &o in &offsets[at..at + n] {
            let o = u64::from(o);
            low.put(o, l);
            // Offsets out of order or past the chunk are a caller's bug; they give bytes the
            // decoder refuses, never a panic.
            let h = o >> l;
            high.zeros(h.saturating_sub(previous_high));
            high.put(1, 1);
            written += h.saturating_sub(previous_high) + 1;
            previous_high = previous_high.max(h);
        }
        high.zeros(high_region(chunk_len, n as u64, l).saturating_sub(written));
        at += n;
    }
    (low.finish(), high.finish())
}

/// Decodes and checks the offsets of chunks given as (length, kept count): each chunk's region
/// marks exactly its count, offsets strictly ascending and inside the chunk.
pub(super) fn decode(
    low_bits: &[u8],
    high_bits: &[u8],
    chunks: impl Iterator<Item = (u64, u64)>,
    l: u32,
    kept: usize,
) -> Result<Vec<u16>, TensorError> {
    let mut offsets = Vec::with_capacity(kept);
    let (mut low, mut high) = (
        BitReader {
            bytes: low_bits,
            at: 0,
        },
        BitReader {
            bytes: high_bits,
            at: 0,
        },
    );
    for (c, (chunk_len, n)) in chunks.enumerate() {
        let start = offsets.len();
        let mut marked = 0u64;
        for position in 0..high_region(chunk_len, n, l) {
            if !high.bit()? {
                continue;
            }
            if marked == n {
                return Err(TensorError::Layout(format!(
                    "chunk {c}: the high bits mark more than {n} offsets"
                )));
            }
            let o = ((position - marked) << l) | low.get(l)?;
            if o >= chunk_len || offsets[start..].last().is_some_and(|&p| u64::from(p) >= o) {
                return Err(TensorError::Layout(format!(
                    "chunk {c}: offsets are not ascending inside the chunk's {chunk_len} values"
                )));
            }
            offsets.push(o as u16);
            marked += 1;
        }
        if marked != n {
            return Err(TensorError::Layout(format!(
                "chunk {c}: the high bits mark {marked} offsets, not {n}"
            )));
        }
    }
    low.ends_here("low_bits")?;
    high.ends_here("high_bits")?;
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks of 32 and 6 keeping 2 each, `l` = 4: offsets 3 and 30, then 0 and 5.
    #[test]
    fn offsets_code_to_the_bits_the_format_names() {
        let chunks = || [(32, 2), (6, 2)].into_iter();
        let offsets = [3, 30, 0, 5];
        let (low, high) = encode(&offsets, chunks(), 4);
        // Low bits 3, 14, 0, 5 at 4 bits each.
        assert_eq!(low, [0xe3, 0x50]);
        // Chunk 0 (region 2 + 1 bits): highs 0, 1 set bits 0 and 2: 101. Chunk 1 (region 2 +
        // 0): highs 0, 0 set bits 0 and 1: 11. Together 10111, least significant first.
        assert_eq!(high, [0b11101]);
        assert_eq!(decode(&low, &high, chunks(), 4, 4).unwrap(), offsets);
        assert_eq!((chunk_bits(32, 2, 4), chunk_bits(6, 2, 4)), (11, 10));
        assert_eq!(
            (low_bit_count(4096, 256), low_bit_count(4096, 4096)),
            (4, 0)
        );
    }

    #[test]
    fn bits_that_mean_no_valid_offsets_are_refused() {
        let chunks = || [(32, 2), (6, 2)].into_iter();
        let (low, high) = encode(&[3, 30, 0, 5], chunks(), 4);
        let cases: [(&str, Vec<u8>, Vec<u8>); 7] = [
            ("a mark too few", low.clone(), vec![0b11001]),
            ("a mark too many", low.clone(), vec![0b11111]),
            ("past the last chunk", low.clone(), vec![0b111101]),
            ("low padding", vec![0xe3, 0xf0], high.clone()),
            ("a byte too few", vec![0xe3], high.clone()),
            ("an extra zero byte", low.clone(), vec![0b11101, 0]),
            // Chunk 1 (6 values): offset 0b0111 = 7 is past it.
            ("past the chunk", vec![0xe3, 0x57], high.clone()),
        ];
        for (what, low, high) in cases {
            assert!(decode(&low, &high, chunks(), 4, 4).is_err(), "{what}");
        }
        // Equal offsets: low bits 5 and 5 under the same high part.
        let (low, high) = encode(&[5, 5], [(32, 2)].into_iter(), 4);
        assert!(decode(&low, &high, [(32, 2)].into_iter(), 4, 2).is_err());
    }
}
