//! `iota-sparse/v3` at real size: encoding and checked decoding of a compressed pseudo-gradient
//! partition of 131,072,000 values (524 MB in fp32, the partition of the `uploads` benchmark),
//! in the encodings a run ships: uploads of top-128 and top-256 of 4096 and the merged updates
//! of four of them (top-512 and top-1024), with 4-bit and 8-bit values.
//!
//! `cargo bench -p iota-protocol --bench sparse_codec` prints, per encoding, the bytes, the
//! median of 3 timed encodes and of 3 timed decodes, and the decode rate in kept values and in
//! the fp32 size it stands for. One thread, as a merger decodes each contribution on one.

use std::time::{Duration, Instant};

use iota_protocol::tensor::{SparseShape, decode_sparse, encode_sparse};
use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};

const LEN: u64 = 131_072_000;
const CHUNK: u32 = 4096;
const ROUNDS: usize = 3;

/// Random offsets (`k` of each chunk, ascending), values in range and unit scales.
fn vector(shape: SparseShape, seed: u64) -> (Vec<u16>, Vec<i8>, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let chunks = shape.chunks();
    let mut indices = Vec::with_capacity(shape.kept() as usize);
    for c in 0..chunks {
        let len = u64::from(shape.chunk).min(shape.len - c * u64::from(shape.chunk)) as usize;
        let mut picked: Vec<u16> = sample(&mut rng, len, (shape.k as usize).min(len))
            .into_iter()
            .map(|o| o as u16)
            .collect();
        picked.sort_unstable();
        indices.extend(picked);
    }
    let q: i8 = if shape.bits == 4 { 7 } else { 127 };
    let values = (0..indices.len()).map(|_| rng.gen_range(-q..=q)).collect();
    (indices, values, vec![1.0; chunks as usize])
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "{LEN} values ({:.0} MB in fp32), chunks of {CHUNK}, median of {ROUNDS} rounds, one thread; load average before: {}",
        LEN as f64 * 4.0 / 1e6,
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!();
    println!(
        "| kept of {CHUNK} | value bits | offsets as | bytes | vs fp32 | encode | decode (checked) | decode, kept values/s | decode, fp32 GB/s |"
    );
    println!("|---:|---:|---|---:|---:|---:|---:|---:|---:|");
    for (k, bits) in [(128, 4), (256, 4), (512, 4), (1024, 4), (128, 8), (512, 8)] {
        let shape = SparseShape {
            len: LEN,
            chunk: CHUNK,
            k,
            bits,
        };
        let (indices, values, scales) = vector(shape, u64::from(k) * 16 + u64::from(bits));
        let (mut encodes, mut decodes) = (Vec::new(), Vec::new());
        let mut bytes = Vec::new();
        for _ in 0..ROUNDS {
            let start = Instant::now();
            bytes = encode_sparse(shape, &indices, &values, &scales);
            encodes.push(start.elapsed());
            let start = Instant::now();
            let parts = match decode_sparse(&bytes, shape) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("top-{k} at {bits} bits does not decode: {e}");
                    std::process::exit(1);
                }
            };
            decodes.push(start.elapsed());
            if parts.indices != indices || parts.values != values {
                eprintln!("top-{k} at {bits} bits decodes to another vector");
                std::process::exit(1);
            }
        }
        let (encode, decode) = (median(encodes), median(decodes));
        println!(
            "| {k} | {bits} | {} | {} | {:.4}x | {:.3} s | {:.3} s | {:.0} M | {:.2} |",
            if shape.offsets_as_mask() {
                "bitmap"
            } else {
                "Elias-Fano"
            },
            bytes.len(),
            bytes.len() as f64 / (LEN as f64 * 4.0),
            encode.as_secs_f64(),
            decode.as_secs_f64(),
            shape.kept() as f64 / decode.as_secs_f64() / 1e6,
            LEN as f64 * 4.0 / decode.as_secs_f64() / 1e9,
        );
    }
}
