//! Which node to talk to: Bittensor's network names or an explicit URL.

use std::time::Duration;

use crate::error::ChainError;

/// Public finney entrypoint.
pub const FINNEY_ENDPOINT: &str = "wss://entrypoint-finney.opentensor.ai:443";
/// Public testnet entrypoint.
pub const TEST_ENDPOINT: &str = "wss://test.finney.opentensor.ai:443";
/// Public finney archive node.
pub const ARCHIVE_ENDPOINT: &str = "wss://archive.chain.opentensor.ai:443";
/// A node (or `iota localnet`) on this machine.
pub const LOCAL_ENDPOINT: &str = "ws://127.0.0.1:9944";

/// Resolves `--subtensor.network` / `--subtensor.chain_endpoint` the way the Python SDK does:
/// an explicit endpoint wins; otherwise the network is a known name or itself a URL.
///
/// # Errors
///
/// [`ChainError::InvalidArgument`] for an unknown name that is not a `ws://`/`wss://` URL.
pub fn resolve_endpoint(network: &str, chain_endpoint: Option<&str>) -> Result<String, ChainError> {
    if let Some(url) = chain_endpoint.map(str::trim).filter(|u| !u.is_empty()) {
        return check_url(url);
    }
    let network = network.trim();
    match network.to_ascii_lowercase().as_str() {
        "finney" | "" => Ok(FINNEY_ENDPOINT.to_owned()),
        "test" | "testnet" => Ok(TEST_ENDPOINT.to_owned()),
        "archive" => Ok(ARCHIVE_ENDPOINT.to_owned()),
        "local" | "localnet" => Ok(LOCAL_ENDPOINT.to_owned()),
        _ if network.contains("://") => check_url(network),
        other => Err(ChainError::InvalidArgument(format!(
            "unknown network {other:?}: use finney, test, archive, local or a ws:// / wss:// URL"
        ))),
    }
}

fn check_url(url: &str) -> Result<String, ChainError> {
    if url.starts_with("ws://") || url.starts_with("wss://") {
        Ok(url.to_owned())
    } else {
        Err(ChainError::InvalidArgument(format!(
            "{url:?} is not a WebSocket URL (ws:// or wss://)"
        )))
    }
}

/// How the client handles what the node checks at connect time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ShapeCheck {
    /// Refuse to connect when a call or storage entry the client uses changed shape.
    #[default]
    Strict,
    /// Log the differences and carry on (calls that changed fail when used).
    Warn,
    /// Skip the check.
    Off,
}

/// Connection settings.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// `ws://` or `wss://` endpoint.
    pub url: String,
    /// Time allowed for the first connection and the initial handshake.
    pub connect_timeout: Duration,
    /// Time allowed for each JSON-RPC request.
    pub request_timeout: Duration,
    /// Longest pause between reconnection attempts after the connection drops.
    pub max_reconnect_delay: Duration,
    /// What to do when the runtime changed shape.
    pub shape_check: ShapeCheck,
}

impl ConnectOptions {
    /// Defaults for `url`: 30 s to connect, 30 s per request, reconnect backoff up to 10 s, strict
    /// shape check.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            connect_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(30),
            max_reconnect_delay: Duration::from_secs(10),
            shape_check: ShapeCheck::Strict,
        }
    }

    /// Options for a network name or URL (see [`resolve_endpoint`]).
    ///
    /// # Errors
    ///
    /// As [`resolve_endpoint`].
    pub fn for_network(network: &str, chain_endpoint: Option<&str>) -> Result<Self, ChainError> {
        Ok(Self::new(resolve_endpoint(network, chain_endpoint)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_urls_resolve() {
        assert_eq!(
            resolve_endpoint("finney", None).ok().as_deref(),
            Some(FINNEY_ENDPOINT)
        );
        assert_eq!(
            resolve_endpoint("Test", None).ok().as_deref(),
            Some(TEST_ENDPOINT)
        );
        assert_eq!(
            resolve_endpoint("local", None).ok().as_deref(),
            Some(LOCAL_ENDPOINT)
        );
        assert_eq!(
            resolve_endpoint("ws://10.0.0.1:9944", None).ok().as_deref(),
            Some("ws://10.0.0.1:9944")
        );
        assert_eq!(
            resolve_endpoint("finney", Some("ws://node:9944"))
                .ok()
                .as_deref(),
            Some("ws://node:9944")
        );
        assert!(resolve_endpoint("moon", None).is_err());
        assert!(resolve_endpoint("finney", Some("http://node")).is_err());
    }
}
