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
        if self.filled >= 32 {
            self.bytes
                .extend_from_slice(&(self.acc as u32).to_le_bytes());
            self.acc >>= 32;
            self.filled -= 32;
        }
    }

    fn finish(mut self) -> Vec<u8> {
        while self.filled > 0 {
            self.bytes.push(self.acc as u8);
            self.acc >>= 8;
            self.filled = self.filled.saturating_sub(8);
        }
        self.bytes
    }
}

/// Bits read least significant first, up to 57 at a time; reading past the end is an error.
struct BitReader<'a> {
    bytes: &'a [u8],
    at: u64,
}

impl BitReader<'_> {
    /// The `count` (at most 57) bits from bit `at` on, without moving.
    fn peek(&self, at: u64, count: u32) -> Result<u64, TensorError> {
        debug_assert!(count <= 57);
        if at + u64::from(count) > self.bytes.len() as u64 * 8 {
            return Err(TensorError::Layout("offset bits end early".into()));
        }
        let first = (at / 8) as usize;
        // Eight bytes from the one holding bit `at` hold it and the 56 after it.
        let word = match self.bytes.get(first..first + 8) {
            Some(eight) => u64::from_le_bytes(<[u8; 8]>::try_from(eight).unwrap_or_default()),
            None => {
                let mut eight = [0u8; 8];
                let rest = &self.bytes[first.min(self.bytes.len())..];
                eight[..rest.len()].copy_from_slice(rest);
                u64::from_le_bytes(eight)
            }
        };
        Ok((word >> (at % 8)) & ((1u64 << count) - 1))
    }

    /// The next `count` (at most 57) bits.
    fn get(&mut self, count: u32) -> Result<u64, TensorError> {
        let value = self.peek(self.at, count)?;
        self.at += u64::from(count);
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
    let mut low = BitWriter::default();
    let mut high: Vec<u8> = Vec::new();
    let mut region_start = 0u64;
    let mut at = 0usize;
    for (chunk_len, n) in chunks {
        let n = (n as usize).min(offsets.len() - at);
        let region_end = region_start + high_region(chunk_len, n as u64, l);
        high.resize(region_end.div_ceil(8) as usize, 0);
        for (i, &o) in offsets[at..at + n].iter().enumerate() {
            let o = u64::from(o);
            low.put(o, l);
            // Offsets out of order or past the chunk are a caller's bug: they give other bytes
            // (a bit past the last region is dropped), never a panic.
            let bit = region_start + (o >> l) + i as u64;
            if let Some(byte) = high.get_mut((bit / 8) as usize) {
                *byte |= 1 << (bit % 8);
            }
        }
        region_start = region_end;
        at += n;
    }
    (low.finish(), high)
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
        let region = high_region(chunk_len, n, l);
        let mut marked = 0u64;
        // The region's set bits, 56 at a time: the `marked`-th at `position` is the offset
        // whose high part is `position - marked`.
        let mut base = 0u64;
        while base < region {
            let count = (region - base).min(56) as u32;
            let mut word = high.peek(high.at + base, count)?;
            while word != 0 {
                let position = base + u64::from(word.trailing_zeros());
                word &= word - 1;
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
            base += u64::from(count);
        }
        high.at += region;
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

    /// The format read one bit at a time, as its definition says: what the word-wise decoder
    /// must agree with, on good streams and bad.
    fn decode_bit_by_bit(
        low_bits: &[u8],
        high_bits: &[u8],
        chunks: &[(u64, u64)],
        l: u32,
    ) -> Option<Vec<u16>> {
        let bit = |bytes: &[u8], at: u64| bytes.get((at / 8) as usize).map(|b| b >> (at % 8) & 1);
        let (mut low_at, mut high_at) = (0u64, 0u64);
        let mut offsets: Vec<u16> = Vec::new();
        for &(chunk_len, n) in chunks {
            let start = offsets.len();
            let mut marked = 0;
            for position in 0..high_region(chunk_len, n, l) {
                let set = bit(high_bits, high_at)?;
                high_at += 1;
                if set == 0 {
                    continue;
                }
                if marked == n {
                    return None;
                }
                let mut low = 0u64;
                for i in 0..l {
                    low |= u64::from(bit(low_bits, low_at)?) << i;
                    low_at += 1;
                }
                let o = ((position - marked) << l) | low;
                if o >= chunk_len || offsets[start..].last().is_some_and(|&p| u64::from(p) >= o) {
                    return None;
                }
                offsets.push(o as u16);
                marked += 1;
            }
            if marked != n {
                return None;
            }
        }
        let ends = |bytes: &[u8], at: u64| {
            bytes.len() as u64 == at.div_ceil(8)
                && (at.is_multiple_of(8) || bytes[bytes.len() - 1] >> (at % 8) == 0)
        };
        (ends(low_bits, low_at) && ends(high_bits, high_at)).then_some(offsets)
    }

    /// Random shapes (regions across word boundaries, `l` from 0 to 16), their encodings, and
    /// the same with a bit flipped, a byte added or a byte dropped: the decoder accepts exactly
    /// what the bit-by-bit reading accepts, with the same offsets.
    #[test]
    fn word_wise_decoding_agrees_with_the_definition() {
        use rand::rngs::StdRng;
        use rand::seq::index::sample;
        use rand::{Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(7);
        let (mut accepted, mut refused) = (0, 0);
        for _ in 0..400 {
            let chunk = *[1u64, 7, 64, 100, 4096, 65536]
                .get(rng.gen_range(0..6))
                .unwrap_or(&64);
            let k = rng.gen_range(1..=chunk.min(300));
            let len = rng.gen_range(1..=3 * chunk);
            let l = low_bit_count(chunk, k);
            let chunks: Vec<(u64, u64)> = (0..len.div_ceil(chunk))
                .map(|c| {
                    let n = chunk.min(len - c * chunk);
                    (n, k.min(n))
                })
                .collect();
            let mut offsets: Vec<u16> = Vec::new();
            for &(n, kept) in &chunks {
                let mut picked: Vec<u16> = sample(&mut rng, n as usize, kept as usize)
                    .into_iter()
                    .map(|o| o as u16)
                    .collect();
                picked.sort_unstable();
                offsets.extend(picked);
            }
            let (low, high) = encode(&offsets, chunks.iter().copied(), l);
            assert_eq!(
                decode_bit_by_bit(&low, &high, &chunks, l).as_ref(),
                Some(&offsets),
                "chunk {chunk}, k {k}, len {len}"
            );
            let mut streams = vec![(low.clone(), high.clone())];
            for _ in 0..6 {
                let (mut low, mut high) = (low.clone(), high.clone());
                let target = if rng.gen_bool(0.5) || low.is_empty() {
                    &mut high
                } else {
                    &mut low
                };
                match rng.gen_range(0..3) {
                    0 if !target.is_empty() => {
                        let at = rng.gen_range(0..target.len() * 8);
                        target[at / 8] ^= 1 << (at % 8);
                    }
                    1 => target.push(rng.r#gen()),
                    _ => {
                        target.pop();
                    }
                }
                streams.push((low, high));
            }
            for (low, high) in streams {
                let want = decode_bit_by_bit(&low, &high, &chunks, l);
                let got = decode(&low, &high, chunks.iter().copied(), l, offsets.len()).ok();
                assert_eq!(got, want, "chunk {chunk}, k {k}, len {len}");
                if want.is_some() {
                    accepted += 1;
                } else {
                    refused += 1;
                }
            }
        }
        // Both sides of the comparison were exercised.
        assert!(
            accepted > 400 && refused > 400,
            "{accepted} accepted, {refused} refused"
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
