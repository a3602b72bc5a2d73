//! Reading a request's body at a pace: bounded in size, cut off as soon as its sender falls
//! behind, its frames let go as they arrive.

use std::time::Duration;

use axum::body::{Body, Bytes};
use iota_protocol::ErrorCode;
use iota_protocol::signing::{BodySha256, HEADER_BODY_SHA256};

use crate::app::*;
use crate::error::*;

/// A signed request's body, at most `limit` bytes, arriving at no slower a pace than
/// [`MIN_BODY_BYTES_PER_S`] after `timeout`: at any time `t` after the headers, at least
/// `(t - timeout) × MIN_BODY_BYTES_PER_S` bytes must be in. So the whole body takes at most
/// `timeout` plus its length at that pace, and a sender that stops (or trickles) is cut off as
/// soon as it falls behind, not only at the end of the time its declared length would allow: an
/// upload slot held by a stalled body was held for all of that.
pub async fn read_body(body: Body, limit: usize, timeout: Duration) -> Result<Bytes, AppError> {
    read_body_then_wait(body, limit, timeout, || Ok(())).await
}

/// [`read_body`], calling `before_waiting` the first time the body is not all in (a frame that
/// is not there yet) and holding what it returns until the body is read; its error refuses the
/// request then. A body that came whole with its request's head never calls it.
pub(crate) async fn read_body_then_wait<G>(
    body: Body,
    limit: usize,
    timeout: Duration,
    before_waiting: impl FnOnce() -> Result<G, AppError>,
) -> Result<Bytes, AppError> {
    use axum::body::HttpBody;
    use futures::FutureExt;
    let mut before_waiting = Some(before_waiting);
    let mut _held = None;
    // The declared length (if any), within the limit: room for the whole body at once.
    let declared = body
        .size_hint()
        .exact()
        .map(|n| n.min(limit as u64) as usize);
    let mut paced = Paced::new(body, limit, timeout);
    let mut gathered = Gathered::default();
    loop {
        let ready = match before_waiting.is_some() {
            true => paced.next().now_or_never(),
            false => None,
        };
        let next = match ready {
            Some(next) => next,
            None => {
                if let Some(take) = before_waiting.take() {
                    _held = Some(take()?);
                }
                paced.next().await
            }
        };
        match next? {
            Some(data) => gathered.push(data, declared),
            None => return Ok(gathered.into_bytes()),
        }
    }
}

/// An upload's body as it arrives, for the handler to stream on: at the pace and within the
/// limit of [`read_body`], and its last frame an error unless its sha256 is `sha256` (64
/// lowercase hex digits, the hash the request's signature covers). A handler that streams it
/// into the store therefore never completes an object from a body that was not the one signed.
/// Read it with [`upload_chunks`], which gives the errors back as they were made.
///
/// The body is read by a task of its own, a chunk ahead of the handler. Once the handler lets
/// the body go unread (it refused the upload before reading it all, or answered from a record),
/// the task reads the rest and lets it go: await it before answering. A client still sending
/// when the answer comes and the connection closes sees a broken pipe, not the answer, and
/// retries what was refused.
pub(crate) fn verified_body(
    body: Body,
    limit: usize,
    timeout: Duration,
    sha256: String,
) -> (Body, tokio::task::JoinHandle<()>) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, BodyError>>(1);
    let reading = tokio::spawn(async move {
        let mut paced = Paced::new(body, limit, timeout);
        let mut hasher = BodySha256::default();
        let mut wanted = true;
        loop {
            let next = match paced.next().await {
                Ok(Some(data)) => {
                    hasher.update(&data);
                    Ok(data)
                }
                Ok(None) if hasher.clone().finish() == sha256.as_bytes() => return,
                Ok(None) => Err(AppError::new(
                    ErrorCode::BadRequest,
                    format!("the body's sha256 is not its {HEADER_BODY_SHA256} header"),
                )),
                Err(e) => Err(e),
            };
            match next {
                Ok(data) => wanted = wanted && tx.send(Ok(data)).await.is_ok(),
                Err(e) => {
                    if wanted {
                        let _ = tx.send(Err(BodyError(e))).await;
                    }
                    return;
                }
            }
        }
    });
    let chunks = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    });
    (Body::from_stream(chunks), reading)
}

/// The chunks of a body made by [`verified_body`], with its errors as they were made (any
/// other failure to read it is a bad request).
pub(crate) fn upload_chunks(
    body: Body,
) -> impl futures::Stream<Item = Result<Bytes, AppError>> + Send + 'static {
    use futures::TryStreamExt;
    body.into_data_stream().map_err(|e| {
        let message = e.to_string();
        // The body wraps its stream's error, and is itself wrapped as it is read.
        let mut inner = e.into_inner();
        loop {
            inner = match inner.downcast::<BodyError>() {
                Ok(made) => return made.0,
                Err(other) => match other.downcast::<axum::Error>() {
                    Ok(wrapped) => wrapped.into_inner(),
                    Err(_) => {
                        return AppError::new(
                            ErrorCode::BadRequest,
                            format!("the body could not be read: {message}"),
                        );
                    }
                },
            };
        }
    })
}

/// An error of [`verified_body`], carried through the body to the handler.
#[derive(Debug)]
struct BodyError(AppError);

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.0.message)
    }
}

impl std::error::Error for BodyError {}

/// A body read frame by frame at a pace: at any time `t` after the start, at least
/// `(t - timeout) × MIN_BODY_BYTES_PER_S` bytes in, and never more than `limit`.
struct Paced {
    body: http_body_util::Limited<Body>,
    start: tokio::time::Instant,
    timeout: Duration,
    limit: usize,
    received: u64,
}

impl Paced {
    fn new(body: Body, limit: usize, timeout: Duration) -> Self {
        Self {
            body: http_body_util::Limited::new(body, limit),
            start: tokio::time::Instant::now(),
            timeout,
            limit,
            received: 0,
        }
    }

    /// The next data frame; `None` once the body has ended.
    async fn next(&mut self) -> Result<Option<Bytes>, AppError> {
        use http_body_util::BodyExt;
        loop {
            let due = self.start + body_deadline(self.timeout, self.received);
            match tokio::time::timeout_at(due, self.body.frame()).await {
                Ok(None) => return Ok(None),
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        self.received += data.len() as u64;
                        return Ok(Some(data));
                    }
                }
                Ok(Some(Err(e))) if e.is::<http_body_util::LengthLimitError>() => {
                    return Err(AppError::new(
                        ErrorCode::PayloadTooLarge,
                        format!("body larger than {} bytes", self.limit),
                    ));
                }
                Ok(Some(Err(e))) => {
                    return Err(AppError::new(
                        ErrorCode::BadRequest,
                        format!("the body could not be read: {e}"),
                    ));
                }
                Err(_) => {
                    return Err(AppError::new(
                        ErrorCode::RequestTimeout,
                        format!(
                            "the body fell behind the slowest pace taken: {} bytes in {} s \
                             (allowed: {} s, then {MIN_BODY_BYTES_PER_S} bytes a second)",
                            self.received,
                            self.start.elapsed().as_secs(),
                            self.timeout.as_secs()
                        ),
                    ));
                }
            }
        }
    }
}

/// A body's bytes as they arrive. The first frame is kept as it is (most bodies are one frame,
/// and cost no copy); from the second on, frames are copied into one buffer and let go. Frames
/// kept until the end cost a stored frame per chunk and held on to the connection's read
/// buffers: a body sent a byte per chunk held some 40 times its size.
#[derive(Default)]
enum Gathered {
    #[default]
    Empty,
    One(Bytes),
    Many(Vec<u8>),
}

impl Gathered {
    /// Adds `data`; `declared`, the body's declared length, sizes the buffer once.
    fn push(&mut self, data: Bytes, declared: Option<usize>) {
        *self = match std::mem::take(self) {
            Self::Empty => Self::One(data),
            Self::One(first) => {
                let room = declared.unwrap_or(0).max(first.len() + data.len());
                let mut buf = Vec::with_capacity(room);
                buf.extend_from_slice(&first);
                buf.extend_from_slice(&data);
                Self::Many(buf)
            }
            Self::Many(mut buf) => {
                buf.extend_from_slice(&data);
                Self::Many(buf)
            }
        };
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Self::Empty => Bytes::new(),
            Self::One(data) => data,
            Self::Many(mut buf) => {
                // A body of undeclared length grew the buffer by doubling: the handler holds it
                // for its whole run, so not with up to half of it unused.
                if buf.capacity() > buf.len() + buf.len() / 8 {
                    buf.shrink_to_fit();
                }
                Bytes::from(buf)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    /// A chunk whose release is counted.
    struct Chunk(Vec<u8>, Arc<std::sync::atomic::AtomicUsize>);

    impl AsRef<[u8]> for Chunk {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }

    impl Drop for Chunk {
        fn drop(&mut self) {
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A body sent in many small chunks holds its bytes, not every chunk until it ends (each
    /// chunk a stored frame pointing into the connection's read buffers).
    #[tokio::test]
    async fn a_body_read_in_small_chunks_lets_each_chunk_go() {
        let released = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        let chunks = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|chunk| (chunk, rx))
        });
        let reading = tokio::spawn(read_body(
            Body::from_stream(chunks),
            1 << 20,
            Duration::from_secs(10),
        ));
        for i in 0..100u8 {
            let chunk = Bytes::from_owner(Chunk(vec![i], released.clone()));
            tx.send(Ok(chunk)).await.expect("the reader is there");
        }
        // With a channel of one, at least 98 chunks have been read by now.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while released.load(Ordering::SeqCst) < 98 {
            assert!(
                std::time::Instant::now() < deadline,
                "chunks still held while the body is read: {} of 100 let go",
                released.load(Ordering::SeqCst)
            );
            tokio::task::yield_now().await;
        }
        drop(tx);
        let body = reading.await.expect("join").expect("read");
        assert_eq!(body, (0..100u8).collect::<Vec<_>>());
        // One chunk alone is the body itself, not a copy.
        let one = Bytes::from(vec![7u8; 64]);
        let read = read_body(Body::from(one.clone()), 1 << 20, Duration::from_secs(1))
            .await
            .expect("read");
        assert_eq!(read.as_ptr(), one.as_ptr());
    }

    /// An upload's body reaches the handler chunk by chunk, and ends in an error unless it is
    /// the body its signature covers; errors keep their codes through the body.
    #[tokio::test]
    async fn an_upload_body_is_streamed_and_checked_against_its_signed_hash() {
        use futures::TryStreamExt;
        let chunks = |parts: Vec<&'static [u8]>| {
            Body::from_stream(futures::stream::iter(
                parts
                    .into_iter()
                    .map(|p| Ok::<_, std::io::Error>(Bytes::from_static(p))),
            ))
        };
        let signed = String::from_utf8(iota_protocol::signing::body_sha256_hex(b"abcdef").to_vec())
            .expect("hex");
        let read = |body: Body, limit: usize| {
            let (body, _reading) =
                verified_body(body, limit, Duration::from_secs(5), signed.clone());
            upload_chunks(body).try_collect::<Vec<Bytes>>()
        };
        let good = read(chunks(vec![b"abc", b"def"]), 16).await.expect("good");
        assert_eq!(
            good,
            vec![Bytes::from_static(b"abc"), Bytes::from_static(b"def")]
        );
        let other = read(chunks(vec![b"abc", b"deg"]), 16)
            .await
            .expect_err("other");
        assert_eq!(other.0.code, ErrorCode::BadRequest, "{:?}", other.0);
        assert!(other.0.message.contains("sha256"), "{:?}", other.0);
        let short = read(chunks(vec![b"abc"]), 16).await.expect_err("short");
        assert_eq!(short.0.code, ErrorCode::BadRequest);
        let large = read(chunks(vec![b"abc", b"def"]), 4)
            .await
            .expect_err("large");
        assert_eq!(large.0.code, ErrorCode::PayloadTooLarge, "{:?}", large.0);
    }
}
