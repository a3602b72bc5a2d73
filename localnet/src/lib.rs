//! A subtensor-compatible local chain: Substrate's JSON-RPC over WebSocket and HTTP, a runtime
//! whose metadata mirrors finney's `System`, `Balances`, `SubtensorModule`, `Sudo` and
//! `AdminUtils`, and Yuma consensus every tempo. One process, no node binary, starts in
//! milliseconds; what Anvil is for Ethereum.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let net = iota_localnet::Localnet::spawn(iota_localnet::LocalnetConfig::instant()).await?;
//! let client = subxt::OnlineClient::<subxt::PolkadotConfig>::from_insecure_url(net.ws_url()).await?;
//! # drop(client); net.stop().await; Ok(()) }
//! ```

pub mod chain;
pub mod cli;
pub mod metadata;
pub mod rpc;
pub mod runtime;
pub mod state;
pub mod yuma;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jsonrpsee::server::{Server, ServerConfig, ServerHandle};
use tokio::net::TcpListener;

pub use chain::ChainConfig;
pub use runtime::{DEV_ACCOUNTS, dev_account, dev_pair};

#[derive(Debug, thiserror::Error)]
pub enum LocalnetError {
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("RPC server: {0}")]
    Server(String),
}

/// How to run a localnet.
#[derive(Clone, Debug)]
pub struct LocalnetConfig {
    /// Where to listen; port 0 picks a free one.
    pub addr: SocketAddr,
    pub chain: ChainConfig,
}

impl Default for LocalnetConfig {
    fn default() -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            chain: ChainConfig::default(),
        }
    }
}

impl LocalnetConfig {
    /// A block for every transaction and no timer: deterministic, for tests. Further blocks come
    /// from [`Localnet::produce_blocks`] or the `dev_newBlock` RPC.
    pub fn instant() -> Self {
        Self {
            chain: ChainConfig {
                block_time: None,
                instant: true,
                ..ChainConfig::default()
            },
            ..Self::default()
        }
    }

    /// Blocks on a timer (and none per transaction), like a real node with a fast block time.
    pub fn with_block_time(block_time: Duration) -> Self {
        Self {
            chain: ChainConfig {
                block_time: Some(block_time),
                instant: false,
                ..ChainConfig::default()
            },
            ..Self::default()
        }
    }
}

/// A running localnet; dropping it without [`Localnet::stop`] also shuts it down.
pub struct Localnet {
    addr: SocketAddr,
    chain: rpc::SharedChain,
    server: ServerHandle,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

impl Localnet {
    /// Starts the chain and its RPC server on `config.addr`.
    pub async fn spawn(config: LocalnetConfig) -> Result<Self, LocalnetError> {
        let listener =
            TcpListener::bind(config.addr)
                .await
                .map_err(|source| LocalnetError::Listen {
                    addr: config.addr.to_string(),
                    source,
                })?;
        Self::spawn_on(listener, config.chain).await
    }

    /// Starts the chain on an already bound listener.
    pub async fn spawn_on(
        listener: TcpListener,
        chain_config: ChainConfig,
    ) -> Result<Self, LocalnetError> {
        let addr = listener
            .local_addr()
            .map_err(|e| LocalnetError::Server(e.to_string()))?;
        let block_time = chain_config.block_time;
        let chain = Arc::new(Mutex::new(chain::Chain::new(chain_config)));
        let module =
            rpc::module(chain.clone()).map_err(|e| LocalnetError::Server(e.to_string()))?;
        let server = Server::builder()
            .set_config(
                ServerConfig::builder()
                    .max_response_body_size(64 * 1024 * 1024)
                    .max_connections(1_024)
                    .build(),
            )
            .build_from_tcp(
                listener
                    .into_std()
                    .map_err(|e| LocalnetError::Server(e.to_string()))?,
            )
            .map_err(|e| LocalnetError::Server(e.to_string()))?;
        let server = server.start(module);
        let ticker = block_time.map(|interval| {
            let chain = chain.clone();
            tokio::spawn(async move {
                let mut ticks = tokio::time::interval(interval);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticks.tick().await;
                loop {
                    ticks.tick().await;
                    chain
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .produce_block();
                }
            })
        });
        tracing::info!(%addr, "localnet listening");
        Ok(Self {
            addr,
            chain,
            server,
            ticker,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn ws_url(&self) -> String {
        format!("ws://{}", self.addr)
    }

    pub fn http_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Makes `n` blocks now and returns the number of the last one.
    pub fn produce_blocks(&self, n: u32) -> u64 {
        let mut chain = self.chain.lock().unwrap_or_else(|p| p.into_inner());
        for _ in 0..n {
            chain.produce_block();
        }
        chain.best().header.number as u64
    }

    pub fn best_number(&self) -> u64 {
        self.chain
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .best()
            .header
            .number as u64
    }

    /// Direct access to the chain, for tests and tools in the same process.
    pub fn chain(&self) -> &rpc::SharedChain {
        &self.chain
    }

    /// Stops the server and block production and waits for the server to finish.
    pub async fn stop(mut self) {
        if let Some(t) = self.ticker.take() {
            t.abort();
        }
        let _ = self.server.stop();
        self.server.clone().stopped().await;
    }

    /// Runs until the server stops (for the command-line chain).
    pub async fn stopped(&self) {
        self.server.clone().stopped().await;
    }
}

impl Drop for Localnet {
    fn drop(&mut self) {
        if let Some(t) = self.ticker.take() {
            t.abort();
        }
        let _ = self.server.stop();
    }
}
