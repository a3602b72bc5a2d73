//! `data prepare` and `PreparedDataset`: every input format, determinism, integrity, splits.

#![allow(clippy::unwrap_used)] // test setup: a failed step is a failed test

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use iota_model::data::prepare::{Manifest, PrepareOptions, is_held_out, prepare};
use iota_model::data::{Dataset, HELD_OUT_BASE, PreparedDataset, train_bpe_tokenizer};

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("iota-prep-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Seeded pseudo-words: no two documents share a long run of tokens.
fn document(i: u64) -> String {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5bd1_e995;
    let mut words = Vec::new();
    for _ in 0..(40 + i % 30) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = 2 + (x % 6) as usize;
        let w: String = (0..len)
            .map(|k| (b'a' + ((x >> (5 * k)) % 26) as u8) as char)
            .collect();
        words.push(w);
    }
    format!("{}.\n", words.join(" "))
}

fn jsonl(docs: impl Iterator<Item = u64>) -> String {
    docs.map(|i| serde_json::json!({ "text": document(i), "id": i }).to_string() + "\n")
        .collect()
}

fn write_parquet(path: &Path, docs: &[Option<String>]) {
    use parquet::basic::Compression;
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    let schema = Arc::new(
        parse_message_type("message doc { REQUIRED INT64 id; OPTIONAL BYTE_ARRAY text (UTF8); }")
            .unwrap(),
    );
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_max_row_group_row_count(Some(7))
            .build(),
    );
    let f = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(f, schema, props).unwrap();
    for chunk in docs.chunks(7) {
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let ids: Vec<i64> = (0..chunk.len() as i64).collect();
        col.typed::<Int64Type>()
            .write_batch(&ids, None, None)
            .unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let defs: Vec<i16> = chunk.iter().map(|d| i16::from(d.is_some())).collect();
        let vals: Vec<ByteArray> = chunk
            .iter()
            .flatten()
            .map(|d| ByteArray::from(d.as_str()))
            .collect();
        col.typed::<ByteArrayType>()
            .write_batch(&vals, Some(&defs), None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

/// A corpus in every supported format, and a tokenizer trained on it.
fn corpus(dir: &Path) -> (Vec<PathBuf>, PathBuf) {
    let raw = dir.join("raw");
    std::fs::create_dir_all(raw.join("nested")).unwrap();
    std::fs::write(raw.join("a.txt"), (0..20).map(document).collect::<String>()).unwrap();
    std::fs::write(raw.join("empty.txt"), "").unwrap();
    std::fs::write(raw.join("b.jsonl"), jsonl(20..120)).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, jsonl(120..220).as_bytes()).unwrap();
    std::fs::write(raw.join("nested/c.jsonl.gz"), gz.finish().unwrap()).unwrap();
    // Two zstd frames back to back, as pzstd writes them.
    let mut zst = ruzstd::encoding::compress_to_vec(
        jsonl(220..270).as_bytes(),
        ruzstd::encoding::CompressionLevel::Fastest,
    );
    zst.extend(ruzstd::encoding::compress_to_vec(
        jsonl(270..320).as_bytes(),
        ruzstd::encoding::CompressionLevel::Fastest,
    ));
    std::fs::write(raw.join("nested/d.jsonl.zst"), zst).unwrap();
    let mut pq: Vec<Option<String>> = (320..400).map(|i| Some(document(i))).collect();
    pq[3] = None;
    pq[9] = Some(String::new());
    write_parquet(&raw.join("e.parquet"), &pq);
    std::fs::write(raw.join("ignored.csv"), "a,b\n").unwrap();
    let tok = dir.join("tokenizer.json");
    train_bpe_tokenizer(&[raw.join("b.jsonl")], 600, &tok).unwrap();
    (vec![raw], tok)
}

fn small_opts() -> PrepareOptions {
    PrepareOptions {
        shard_tokens: 1000,
        held_out_ppm: 100_000,
        batch_bytes: 3000,
        ..PrepareOptions::default()
    }
}

fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn every_format_is_read_and_preparation_is_byte_identical() {
    let dir = tmp("formats");
    let (inputs, tok) = corpus(&dir);
    let mut last = None;
    let (m, hash) = prepare(&inputs, &tok, &dir.join("out1"), &small_opts(), &mut |p| {
        last = Some(*p)
    })
    .unwrap();
    // 20 txt pieces are one document; 300 jsonl documents; 78 non-empty parquet rows.
    assert_eq!(m.train.documents + m.held_out.documents, 1 + 300 + 78);
    // The empty file, the null and the empty parquet value.
    assert_eq!(m.skipped_empty, 3);
    assert!(
        m.held_out.documents > 10 && m.held_out.documents < 80,
        "{m:?}"
    );
    assert_eq!(m.token_bytes, 2);
    assert!(m.eos_token.is_some());
    assert!(m.train.shards.len() > 2);
    assert!(
        m.train.shards[..m.train.shards.len() - 1]
            .iter()
            .all(|s| s.tokens == 1000)
    );
    let last = last.unwrap();
    assert_eq!(last.tokens, m.total_tokens());
    assert_eq!(last.bytes_read, last.bytes_total);

    // Same input, other batch sizes (other parallel batches), input named differently: the
    // same bytes.
    let opts = PrepareOptions {
        batch_bytes: 1 << 20,
        ..small_opts()
    };
    let inputs2 = vec![
        dir.join("raw/nested"),
        dir.join("raw/e.parquet"),
        dir.join("raw/b.jsonl"),
        dir.join("raw/a.txt"),
        dir.join("raw/empty.txt"),
    ];
    let (m2, hash2) = prepare(&inputs2, &tok, &dir.join("out2"), &opts, &mut |_| {}).unwrap();
    assert_eq!(m, m2);
    assert_eq!(hash, hash2);
    assert_eq!(files_of(&dir.join("out1")), files_of(&dir.join("out2")));
    assert_eq!(
        blake3::hash(&std::fs::read(dir.join("out1/manifest.json")).unwrap())
            .to_hex()
            .to_string(),
        hash
    );

    // The txt document comes first and is whole: its tokens are the tokenizer's encoding.
    let t = tokenizers::Tokenizer::from_file(&tok).unwrap();
    let a_txt = std::fs::read_to_string(dir.join("raw/a.txt")).unwrap();
    let want = t.encode(a_txt.as_str(), false).unwrap().get_ids().to_vec();
    let split = if is_held_out(blake3::hash(a_txt.as_bytes()).as_bytes(), 100_000) {
        &m.held_out
    } else {
        &m.train
    };
    let stream: Vec<u8> = split
        .shards
        .iter()
        .flat_map(|s| std::fs::read(dir.join("out1").join(&s.file)).unwrap())
        .collect();
    let got: Vec<u32> = stream
        .chunks_exact(2)
        .take(want.len() + 1)
        .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    assert_eq!(&got[..want.len()], &want[..]);
    assert_eq!(got[want.len()], m.eos_token.unwrap());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_text_file_read_in_pieces_tokenizes_like_the_whole() {
    let dir = tmp("pieces");
    let raw = dir.join("a.txt");
    std::fs::write(&raw, (0..30).map(document).collect::<String>()).unwrap();
    let tok = dir.join("tok.json");
    train_bpe_tokenizer(std::slice::from_ref(&raw), 500, &tok).unwrap();
    let whole = prepare(
        std::slice::from_ref(&raw),
        &tok,
        &dir.join("whole"),
        &PrepareOptions {
            held_out_ppm: 0,
            ..PrepareOptions::default()
        },
        &mut |_| {},
    )
    .unwrap();
    let mut opts = PrepareOptions {
        held_out_ppm: 0,
        ..PrepareOptions::default()
    };
    opts.source.text_piece_bytes = 301;
    let pieces = prepare(&[raw], &tok, &dir.join("pieces"), &opts, &mut |_| {}).unwrap();
    assert_eq!(whole.0.train.tokens, pieces.0.train.tokens);
    assert_eq!(whole.1, pieces.1);
    std::fs::remove_dir_all(&dir).ok();
}

fn prepared(tag: &str) -> (PathBuf, Manifest, String) {
    let dir = tmp(tag);
    let (inputs, tok) = corpus(&dir);
    let (m, h) = prepare(&inputs, &tok, &dir.join("ds"), &small_opts(), &mut |_| {}).unwrap();
    (dir, m, h)
}

#[test]
fn windows_permute_by_pass_and_the_splits_are_disjoint() {
    let (dir, _, hash) = prepared("windows");
    let ds = PreparedDataset::open(&dir.join("ds"), Some(&hash), 16, 7).unwrap();
    let n = ds.train_windows();
    assert!(n > 100, "{n}");
    // One pass visits every training window exactly once.
    let pass0: Vec<u64> = (0..n).map(|i| ds.locate(i).unwrap().1).collect();
    let set: HashSet<u64> = pass0.iter().copied().collect();
    assert_eq!(set.len() as u64, n);
    assert!(set.iter().all(|w| *w < n));
    assert_ne!(pass0, (0..n).collect::<Vec<_>>(), "not shuffled");
    // The next pass is another permutation of the same windows, and says it is.
    let pass1: Vec<u64> = (n..2 * n).map(|i| ds.locate(i).unwrap().1).collect();
    assert_ne!(pass0, pass1);
    assert_eq!(pass1.iter().copied().collect::<HashSet<_>>(), set);
    assert_eq!((ds.pass_of(n - 1), ds.pass_of(n)), (0, 1));
    // Another seed, another order.
    let other = PreparedDataset::open(&dir.join("ds"), Some(&hash), 16, 8).unwrap();
    assert_ne!(other.locate(0).unwrap(), ds.locate(0).unwrap());
    assert_ne!(other.fingerprint(), ds.fingerprint());

    let train: HashSet<Vec<u32>> = (0..n).map(|i| ds.window(i).unwrap()).collect();
    let held = ds.held_out_windows().unwrap();
    assert!(held >= 10, "{held}");
    let held_set: HashSet<Vec<u32>> = (0..held)
        .map(|i| ds.window(HELD_OUT_BASE + i).unwrap())
        .collect();
    assert!(train.iter().all(|w| w.len() == 17));
    assert!(train.is_disjoint(&held_set));
    // Held-out ids stop at the split's end rather than wrap.
    let err = ds.window(HELD_OUT_BASE + held).unwrap_err().to_string();
    assert!(err.contains("held-out window"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn held_out_is_by_content_not_position() {
    let a = *blake3::hash(b"some document").as_bytes();
    let hits = (0u64..10_000)
        .filter(|i| is_held_out(blake3::hash(&i.to_le_bytes()).as_bytes(), 50_000))
        .count();
    assert!((400..600).contains(&hits), "{hits}");
    assert!(!is_held_out(&a, 0));
    assert!(is_held_out(&a, 999_999));
    assert_eq!(is_held_out(&a, 50_000), is_held_out(&a, 50_000));
}

#[test]
fn a_tampered_or_missing_file_is_refused() {
    let (dir, m, hash) = prepared("tamper");
    let ds_dir = dir.join("ds");
    // Another manifest hash than the run's.
    let err = PreparedDataset::open(&ds_dir, Some(&"0".repeat(64)), 16, 0).unwrap_err();
    assert!(err.to_string().contains("manifest.json"), "{err}");
    // A manifest edited by hand no longer has the run's hash.
    let mpath = ds_dir.join("manifest.json");
    let orig = std::fs::read(&mpath).unwrap();
    let edited = String::from_utf8(orig.clone()).unwrap().replacen(
        "\"held_out_ppm\": 100000",
        "\"held_out_ppm\": 100001",
        1,
    );
    std::fs::write(&mpath, &edited).unwrap();
    assert!(PreparedDataset::open(&ds_dir, Some(&hash), 16, 0).is_err());
    std::fs::write(&mpath, &orig).unwrap();

    // One flipped byte in a shard: windows of that shard are refused, naming it.
    let shard = ds_dir.join(&m.train.shards[1].file);
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[10] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    let ds = PreparedDataset::open(&ds_dir, Some(&hash), 16, 0).unwrap();
    let err = ds.verify_all().unwrap_err().to_string();
    assert!(
        err.contains(&m.train.shards[1].file) && err.contains("BLAKE3"),
        "{err}"
    );
    let bad = (0..ds.train_windows())
        .filter(|i| ds.window(*i).is_err())
        .count() as u64;
    let per_shard = 999 / 16;
    assert_eq!(bad, per_shard);
    bytes[10] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();

    // A truncated shard, a missing shard, a replaced tokenizer.
    std::fs::write(&shard, &bytes[..bytes.len() - 2]).unwrap();
    let err = PreparedDataset::open(&ds_dir, Some(&hash), 16, 0).unwrap_err();
    assert!(err.to_string().contains(&m.train.shards[1].file), "{err}");
    std::fs::remove_file(&shard).unwrap();
    let err = PreparedDataset::open(&ds_dir, Some(&hash), 16, 0).unwrap_err();
    assert!(err.to_string().contains(&m.train.shards[1].file), "{err}");
    std::fs::write(&shard, &bytes).unwrap();
    let tpath = ds_dir.join("tokenizer.json");
    let tok = std::fs::read(&tpath).unwrap();
    std::fs::write(&tpath, [&tok[..], b" "].concat()).unwrap();
    let err = PreparedDataset::open(&ds_dir, Some(&hash), 16, 0).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_inputs_are_named_and_leave_nothing_behind() {
    let dir = tmp("bad");
    let tok_src = dir.join("t.txt");
    std::fs::write(&tok_src, (0..10).map(document).collect::<String>()).unwrap();
    let tok = dir.join("tok.json");
    train_bpe_tokenizer(std::slice::from_ref(&tok_src), 300, &tok).unwrap();
    let out = dir.join("out");
    let run = |input: &Path, opts: &PrepareOptions| {
        prepare(&[input.to_path_buf()], &tok, &out, opts, &mut |_| {})
            .unwrap_err()
            .to_string()
    };
    let opts = PrepareOptions::default();

    let p = dir.join("nocol.parquet");
    write_parquet(&p, &[Some("x".into())]);
    let mut o = opts.clone();
    o.source.text_field = "content".into();
    let e = run(&p, &o);
    assert!(e.contains("nocol.parquet") && e.contains("content"), "{e}");

    let p = dir.join("utf8.txt");
    std::fs::write(&p, b"fine text\n\xff\xfe broken").unwrap();
    let e = run(&p, &opts);
    assert!(e.contains("utf8.txt") && e.contains("UTF-8"), "{e}");

    let p = dir.join("long.jsonl");
    let long = serde_json::json!({ "text": "y".repeat(5000) }).to_string();
    std::fs::write(&p, format!("{}{long}\n", jsonl(0..2))).unwrap();
    let mut o = opts.clone();
    o.source.max_document_bytes = 1000;
    let e = run(&p, &o);
    assert!(e.contains("long.jsonl:3"), "{e}");

    let p = dir.join("field.jsonl");
    std::fs::write(&p, "{\"body\": \"x\"}\n").unwrap();
    let e = run(&p, &opts);
    assert!(e.contains("field.jsonl:1"), "{e}");

    let p = dir.join("notgz.jsonl.gz");
    std::fs::write(&p, "plain").unwrap();
    let e = run(&p, &opts);
    assert!(e.contains("notgz.jsonl.gz"), "{e}");

    let p = dir.join("only-empty.txt");
    std::fs::write(&p, "").unwrap();
    let e = run(&p, &opts);
    assert!(e.contains("no text"), "{e}");

    let empty_dir = dir.join("nothing");
    std::fs::create_dir_all(&empty_dir).unwrap();
    let e = run(&empty_dir, &opts);
    assert!(e.contains("nothing"), "{e}");

    // Nothing half-written: no output, no staging folder.
    assert!(!out.exists());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // An output folder that already holds something is never overwritten.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("keep"), "x").unwrap();
    let e = run(&tok_src, &opts);
    assert!(e.contains("not empty"), "{e}");
    assert!(out.join("keep").exists());
    std::fs::remove_dir_all(&dir).ok();
}

const CHILD_ENV: &str = "IOTA_TEST_PREPARED_CHILD";

/// The child half of `two_processes_read_the_same_windows` (does nothing on its own).
#[test]
fn two_processes_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (dir, hash) = spec.split_once('|').unwrap();
    let ds = PreparedDataset::open(Path::new(dir), Some(hash), 16, 11).unwrap();
    let ids = ids_for(&ds);
    let windows: Vec<Vec<u32>> = ids.iter().map(|i| ds.window(*i).unwrap()).collect();
    println!("WINDOWS {}", serde_json::to_string(&windows).unwrap());
}

fn ids_for(ds: &PreparedDataset) -> Vec<u64> {
    let n = ds.train_windows();
    vec![
        0,
        1,
        5,
        n - 1,
        n,
        3 * n + 2,
        HELD_OUT_BASE,
        HELD_OUT_BASE + 3,
    ]
}

#[test]
fn two_processes_read_the_same_windows() {
    let (dir, _, hash) = prepared("procs");
    let ds_dir = dir.join("ds");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "prepared_data::two_processes_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, format!("{}|{hash}", ds_dir.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("WINDOWS ").map(|(_, w)| w))
        .unwrap_or_else(|| panic!("the child printed no windows: {stdout}"));
    let theirs: Vec<Vec<u32>> = serde_json::from_str(line).unwrap();
    let ds = PreparedDataset::open(&ds_dir, Some(&hash), 16, 11).unwrap();
    let ours: Vec<Vec<u32>> = ids_for(&ds)
        .iter()
        .map(|i| ds.window(*i).unwrap())
        .collect();
    assert_eq!(ours.len(), 8);
    assert_eq!(ours, theirs);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn held_out_base_is_the_protocols() {
    assert_eq!(HELD_OUT_BASE, iota_protocol::api::HELD_OUT_BASE);
}

/// One step from raw text to a dataset: the tokenizer is trained on the corpus itself, of the
/// size asked for, and the dataset opens under the name returned, with documents held out.
#[test]
fn a_corpus_prepares_with_a_tokenizer_trained_on_it() {
    let dir = tmp("new-tokenizer");
    let raw = dir.join("raw");
    std::fs::create_dir_all(&raw).unwrap();
    std::fs::write(raw.join("a.jsonl"), jsonl(0..300)).unwrap();
    let (data, name) =
        iota_model::data::prepare::prepare_with_new_tokenizer(&raw, 400, &dir, 100_000).unwrap();
    assert_eq!(data, dir.join("data"));
    let ds = PreparedDataset::open(&data, Some(&name), 16, 0).unwrap();
    assert_eq!(ds.manifest().vocab_size, 400);
    assert!(ds.held_out_count() > 0 && ds.train_windows() > 100);
    assert!(dir.join("tokenizer.json").is_file());
    // A missing corpus is an error, not an empty dataset.
    assert!(
        iota_model::data::prepare::prepare_with_new_tokenizer(&dir.join("none"), 400, &dir, 0)
            .is_err()
    );
    std::fs::remove_dir_all(&dir).ok();
}
