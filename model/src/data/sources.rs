//! Raw text inputs for `data prepare`, read as a stream of documents in a fixed order.
//!
//! Supported: `.txt` (the whole file is one document), `.jsonl`, `.jsonl.gz`, `.jsonl.zst` (one
//! JSON object per line, the text in a configurable string field) and `.parquet` (a string
//! column, the way FineWeb ships its shards), given as files or as folders searched recursively.
//! Memory stays bounded by the largest document allowed: a `.txt` file is read in pieces, a JSON
//! line or a parquet value longer than the limit is an error that names the file and the line or
//! row, never an allocation the size of the input.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{ModelError, Result};

/// How a file's documents are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// Plain UTF-8 text, one document per file.
    Text,
    /// JSON lines, uncompressed.
    Jsonl,
    /// JSON lines, gzip.
    JsonlGz,
    /// JSON lines, zstd.
    JsonlZst,
    /// Apache Parquet with a string column.
    Parquet,
}

impl SourceKind {
    /// The kind a file name says, if it is a supported one.
    pub fn of(path: &Path) -> Option<Self> {
        let name = path.file_name()?.to_str()?.to_ascii_lowercase();
        [
            (".jsonl.gz", Self::JsonlGz),
            (".jsonl.zst", Self::JsonlZst),
            (".jsonl", Self::Jsonl),
            (".parquet", Self::Parquet),
            (".txt", Self::Text),
        ]
        .into_iter()
        .find_map(|(ext, kind)| name.ends_with(ext).then_some(kind))
    }
}

/// The input files named by `inputs` (files, or folders searched recursively for supported
/// files), sorted by path so the result never depends on the order they were given in.
pub fn list_inputs(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    if inputs.is_empty() {
        return Err(ModelError::Data("no input files".into()));
    }
    let mut files = Vec::new();
    for input in inputs {
        let meta = std::fs::metadata(input).map_err(|e| ModelError::io(input, e))?;
        if meta.is_dir() {
            let before = files.len();
            walk(input, &mut files)?;
            if files.len() == before {
                return Err(ModelError::Data(format!(
                    "{}: no .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files in this folder",
                    input.display()
                )));
            }
        } else if SourceKind::of(input).is_some() {
            files.push(input.clone());
        } else {
            return Err(ModelError::Data(format!(
                "{}: unsupported file type (expected .txt, .jsonl, .jsonl.gz, .jsonl.zst or \
                 .parquet)",
                input.display()
            )));
        }
    }
    files.sort();
    files.dedup();
    Ok(files)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| ModelError::io(dir, e))?.path();
        let meta = std::fs::metadata(&path).map_err(|e| ModelError::io(&path, e))?;
        if meta.is_dir() {
            walk(&path, out)?;
        } else if SourceKind::of(&path).is_some() {
            out.push(path);
        }
    }
    Ok(())
}

/// How documents are read.
#[derive(Debug, Clone)]
pub struct SourceOptions {
    /// The JSON field (jsonl) or column (parquet) that holds the text.
    pub text_field: String,
    /// The longest document accepted from a JSON line or a parquet value, in bytes.
    pub max_document_bytes: usize,
    /// Size of the pieces a `.txt` document is read in (cut before a space that ends a word).
    pub text_piece_bytes: usize,
}

impl Default for SourceOptions {
    fn default() -> Self {
        Self {
            text_field: "text".into(),
            max_document_bytes: 64 << 20,
            text_piece_bytes: 1 << 20,
        }
    }
}

/// One piece of a document, in reading order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The text.
    pub text: String,
    /// Whether the document ends with this piece.
    pub last: bool,
    /// BLAKE3 of the whole document's text (which decides its split).
    pub doc_hash: [u8; 32],
}

/// Counts the raw (compressed) bytes read from a file, for progress.
struct Counting<R> {
    inner: R,
    read: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

fn open_counting(path: &Path, read: &Arc<AtomicU64>) -> Result<Counting<File>> {
    Ok(Counting {
        inner: File::open(path).map_err(|e| ModelError::io(path, e))?,
        read: read.clone(),
    })
}

/// Streams the documents of `path` to `emit`, piece by piece; empty documents are skipped and
/// counted in the return value. `read` counts raw bytes consumed.
pub fn read_file(
    path: &Path,
    opts: &SourceOptions,
    read: &Arc<AtomicU64>,
    emit: &mut dyn FnMut(Piece) -> Result<()>,
) -> Result<u64> {
    let kind = SourceKind::of(path)
        .ok_or_else(|| ModelError::Data(format!("{}: unsupported file type", path.display())))?;
    match kind {
        SourceKind::Text => read_text(path, opts, read, emit),
        SourceKind::Jsonl => {
            let r = BufReader::new(open_counting(path, read)?);
            read_jsonl(path, r, opts, emit)
        }
        SourceKind::JsonlGz => {
            let gz = flate2::read::MultiGzDecoder::new(open_counting(path, read)?);
            read_jsonl(path, BufReader::new(gz), opts, emit)
        }
        SourceKind::JsonlZst => {
            let r = BufReader::new(ZstdFrames::new(path, open_counting(path, read)?));
            read_jsonl(path, r, opts, emit)
        }
        SourceKind::Parquet => read_parquet(path, opts, read, emit),
    }
}

/// A whole-document piece.
fn whole(text: String) -> Piece {
    Piece {
        doc_hash: *blake3::hash(text.as_bytes()).as_bytes(),
        text,
        last: true,
    }
}

/// A `.txt` file: hashed in a first pass (its hash decides the split before any piece is
/// emitted), then read in pieces.
fn read_text(
    path: &Path,
    opts: &SourceOptions,
    read: &Arc<AtomicU64>,
    emit: &mut dyn FnMut(Piece) -> Result<()>,
) -> Result<u64> {
    let mut hasher = blake3::Hasher::new();
    let mut f = File::open(path).map_err(|e| ModelError::io(path, e))?;
    let len = std::io::copy(&mut f, &mut hasher).map_err(|e| ModelError::io(path, e))?;
    if len == 0 {
        return Ok(1);
    }
    let doc_hash = *hasher.finalize().as_bytes();
    let mut r = open_counting(path, read)?;
    let piece = opts.text_piece_bytes.max(4);
    let mut buf: Vec<u8> = Vec::with_capacity(piece);
    let mut offset = 0u64;
    let mut eof = false;
    while !eof || !buf.is_empty() {
        // Fill up to one piece.
        while !eof && buf.len() < piece {
            let start = buf.len();
            buf.resize(piece, 0);
            let n = r
                .read(&mut buf[start..])
                .map_err(|e| ModelError::io(path, e))?;
            buf.truncate(start + n);
            eof = n == 0;
        }
        let cut = if eof {
            buf.len()
        } else {
            // Before a space that follows a non-space: a word boundary for byte-level and
            // metaspace tokenizers, which tokenize the pieces exactly as the whole text.
            match (1..buf.len())
                .rev()
                .find(|i| buf[*i] == b' ' && !buf[*i - 1].is_ascii_whitespace())
            {
                Some(i) => i,
                // No such space: cut before a UTF-8 lead byte, never inside a character.
                None => (1..buf.len())
                    .rev()
                    .find(|i| buf[*i] & 0xC0 != 0x80)
                    .unwrap_or(buf.len()),
            }
        };
        let rest = buf.split_off(cut);
        let text = String::from_utf8(std::mem::replace(&mut buf, rest)).map_err(|e| {
            ModelError::Data(format!(
                "{}: invalid UTF-8 at byte {}",
                path.display(),
                offset + e.utf8_error().valid_up_to() as u64
            ))
        })?;
        offset += text.len() as u64;
        let last = eof && buf.is_empty();
        emit(Piece {
            text,
            last,
            doc_hash,
        })?;
    }
    Ok(0)
}

fn read_jsonl(
    path: &Path,
    mut r: impl BufRead,
    opts: &SourceOptions,
    emit: &mut dyn FnMut(Piece) -> Result<()>,
) -> Result<u64> {
    let mut empty = 0;
    let mut line = Vec::new();
    let limit = opts.max_document_bytes as u64 + 1024;
    for n in 1u64.. {
        line.clear();
        // Bounded: a line longer than the limit is refused before it is held whole.
        let got = (&mut r)
            .take(limit + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| ModelError::io(path, e))?;
        if got == 0 {
            break;
        }
        if got as u64 > limit && line.last() != Some(&b'\n') {
            return Err(ModelError::Data(format!(
                "{}:{n}: line longer than {} bytes (raise --max-document-bytes)",
                path.display(),
                limit
            )));
        }
        if line.iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&line)
            .map_err(|e| ModelError::Data(format!("{}:{n}: invalid JSON: {e}", path.display())))?;
        let text = match v.get(&opts.text_field) {
            Some(serde_json::Value::String(s)) => s,
            _ => {
                return Err(ModelError::Data(format!(
                    "{}:{n}: no string {:?} field",
                    path.display(),
                    opts.text_field
                )));
            }
        };
        if text.len() > opts.max_document_bytes {
            return Err(ModelError::Data(format!(
                "{}:{n}: a document of {} bytes is over the {}-byte limit",
                path.display(),
                text.len(),
                opts.max_document_bytes
            )));
        }
        if text.is_empty() {
            empty += 1;
            continue;
        }
        emit(whole(text.clone()))?;
    }
    Ok(empty)
}

/// Every zstd frame of a file in turn (`pzstd` and concatenated files have several).
struct ZstdFrames<R: Read> {
    path: PathBuf,
    state: Option<Frames<R>>,
}

enum Frames<R: Read> {
    Between(BufReader<R>),
    // Boxed: the decoder's state is large and lives as long as a frame.
    In(Box<ruzstd::decoding::StreamingDecoder<BufReader<R>, ruzstd::decoding::FrameDecoder>>),
}

impl<R: Read> ZstdFrames<R> {
    fn new(path: &Path, r: R) -> Self {
        Self {
            path: path.to_path_buf(),
            state: Some(Frames::Between(BufReader::new(r))),
        }
    }
}

impl<R: Read> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::io::{Error, ErrorKind};
        loop {
            match self.state.take() {
                None => return Ok(0),
                Some(Frames::In(mut dec)) => {
                    let n = dec.read(buf)?;
                    if n > 0 || buf.is_empty() {
                        self.state = Some(Frames::In(dec));
                        return Ok(n);
                    }
                    self.state = Some(Frames::Between(dec.into_inner()));
                }
                Some(Frames::Between(mut input)) => {
                    if input.fill_buf()?.is_empty() {
                        return Ok(0);
                    }
                    let dec = ruzstd::decoding::StreamingDecoder::new(input).map_err(|e| {
                        Error::new(
                            ErrorKind::InvalidData,
                            format!("{}: not zstd: {e}", self.path.display()),
                        )
                    })?;
                    self.state = Some(Frames::In(Box::new(dec)));
                }
            }
        }
    }
}

fn read_parquet(
    path: &Path,
    opts: &SourceOptions,
    read: &Arc<AtomicU64>,
    emit: &mut dyn FnMut(Piece) -> Result<()>,
) -> Result<u64> {
    use parquet::column::reader::ColumnReader;
    use parquet::file::reader::{FileReader, SerializedFileReader};

    let perr = |e: parquet::errors::ParquetError| {
        ModelError::Data(format!("{}: parquet: {e}", path.display()))
    };
    let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    let size = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
    let reader = SerializedFileReader::new(file).map_err(perr)?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let column = schema
        .columns()
        .iter()
        .position(|c| c.path().string() == opts.text_field)
        .ok_or_else(|| {
            let names: Vec<String> = schema.columns().iter().map(|c| c.path().string()).collect();
            ModelError::Data(format!(
                "{}: no column {:?} (columns: {})",
                path.display(),
                opts.text_field,
                names.join(", ")
            ))
        })?;
    let groups = reader.num_row_groups();
    let mut empty = 0;
    let mut row = 0u64;
    for g in 0..groups {
        let group = reader.get_row_group(g).map_err(perr)?;
        let ColumnReader::ByteArrayColumnReader(mut col) =
            group.get_column_reader(column).map_err(perr)?
        else {
            return Err(ModelError::Data(format!(
                "{}: column {:?} does not hold strings",
                path.display(),
                opts.text_field
            )));
        };
        let mut values = Vec::new();
        let mut defs = Vec::new();
        loop {
            values.clear();
            defs.clear();
            let (records, _, _) = col
                .read_records(256, Some(&mut defs), None, &mut values)
                .map_err(perr)?;
            if records == 0 {
                break;
            }
            // Nulls have no value: they count as empty documents.
            empty += records.saturating_sub(values.len()) as u64;
            for v in &values {
                row += 1;
                let bytes = v.data();
                if bytes.len() > opts.max_document_bytes {
                    return Err(ModelError::Data(format!(
                        "{}: row {row}: a document of {} bytes is over the {}-byte limit",
                        path.display(),
                        bytes.len(),
                        opts.max_document_bytes
                    )));
                }
                let text = std::str::from_utf8(bytes).map_err(|e| {
                    ModelError::Data(format!(
                        "{}: row {row}: invalid UTF-8 at byte {}",
                        path.display(),
                        e.valid_up_to()
                    ))
                })?;
                if text.is_empty() {
                    empty += 1;
                    continue;
                }
                emit(whole(text.to_string()))?;
            }
        }
        // Progress for parquet moves by row group (pages are read through the reader's own
        // file handle).
        read.fetch_add(size / groups.max(1) as u64, Ordering::Relaxed);
    }
    Ok(empty)
}
