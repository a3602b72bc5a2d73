//! IOTA's wire protocol, shared by the orchestrator, miners, validators and explorers.
//!
//! * [`api`]: request and response types of the orchestrator's HTTP API and the run config.
//! * [`signing`]: Epistula v2 request signing with the method and path bound in.
//! * [`session`]: sessions opened by a signed handshake, whose requests carry a MAC instead.
//! * [`error`]: the one JSON error body with a stable `code`.
//! * [`blob`]: blob descriptors (key, size, dtype, shape, BLAKE3).
//! * [`dataset`]: a run's prepared dataset in its store (file list, keys, size bounds).
//! * [`dataset_cache`] (feature `client`): fetching that dataset into a local cache, every file
//!   checked against the run's manifest hash.
//! * [`tensor`]: the safetensors layouts on the wire and the checks every upload passes.
//! * [`client`] (feature `client`, on by default): the typed reqwest client with retries.
//!
//! Depends on no server framework, database or tensor library.

pub mod api;
pub mod blob;
#[cfg(feature = "client")]
pub mod client;
pub mod dataset;
#[cfg(feature = "client")]
pub mod dataset_cache;
pub mod error;
pub mod session;
pub mod signing;
pub mod tensor;

pub use blob::{BlobDescriptor, BlobDtype};
#[cfg(feature = "client")]
pub use client::{ApiClient, ClientError, RetryPolicy};
pub use error::{ApiError, ErrorCode};
pub use signing::{AuthError, RequestSigner, SkewWindow, VerifiedRequest};
pub use tensor::{TensorError, TensorSpec, WireEncoding};
