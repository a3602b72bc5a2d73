//! [`Devnet`]: a localnet chain, an orchestrator, validators and miners in this process, started
//! together and shut down together (explicitly with [`Devnet::stop`], or on drop).

use std::sync::Arc;
use std::time::{Duration, Instant};

use iota_chain::wallet::{Keypair, PublicKey};
use iota_chain::{ConnectOptions, Subtensor, TxOptions};
use iota_localnet::{Localnet, LocalnetConfig};
use iota_miner::{Adversary, MinerConfig, MinerHandle};
use iota_protocol::client::{ApiClient, RetryPolicy};
use iota_validator::{Store, Validator, ValidatorConfig};
use tokio::sync::{oneshot, watch};

use crate::{DevnetError, PermitWait, SubnetPlan, bootstrap, step};

/// What a neuron does on the devnet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Validator,
    Miner,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Validator => "validator",
            Role::Miner => "miner",
        }
    }
}

/// One neuron: registered on the subnet, and run by the devnet.
#[derive(Clone)]
pub struct Neuron {
    pub name: String,
    pub key: Keypair,
    pub role: Role,
    /// A miner's cheating behaviour.
    pub adversary: Option<Adversary>,
}

/// Everything [`Devnet::start`] needs. The service configs are templates: the devnet fills in
/// what only it knows (databases, the chain's endpoint, the netuid, the orchestrator's URL, a
/// miner's seed and adversary).
pub struct DevnetConfig {
    pub chain: LocalnetConfig,
    /// Longest wait for the tempo after which the validators hold permits.
    pub permit_timeout: Duration,
    /// The subnet owner's hotkey, which the orchestrator signs as.
    pub owner: Keypair,
    /// Registered in this order (validators are staked); the first signs the devnet's client.
    pub neurons: Vec<Neuron>,
    /// A PostgreSQL server (any database on it) where this user may create databases.
    pub database_url: String,
    /// Prefix of the databases created for the orchestrator and each validator.
    pub database_prefix: String,
    pub orchestrator: iota_orchestrator::Config,
    pub validator: ValidatorConfig,
    pub miner: MinerConfig,
    /// Longest wait for one miner to be given a stage.
    pub miner_join_timeout: Duration,
    pub tx: TxOptions,
}

/// A running miner of the devnet.
pub struct DevnetMiner {
    pub neuron: Neuron,
    pub handle: MinerHandle,
}

/// A running validator's record, read through its own store.
pub struct DevnetValidator {
    pub neuron: Neuron,
    pub store: Store,
}

/// The orchestrator task and its stop signal.
struct Orchestrator {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), iota_orchestrator::OrchestratorError>>,
}

/// The validators' thread and its stop signal. The validators' loops run on a runtime of their
/// own: their futures are not `Send`-general enough for `tokio::spawn`.
struct Validators {
    stop: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A subnet running in this process.
pub struct Devnet {
    /// The chain. `None` only once stopped.
    net: Option<Localnet>,
    pub chain: Subtensor,
    pub netuid: u16,
    /// The orchestrator's base URL.
    pub base: String,
    /// A client of the orchestrator, signed by the first neuron.
    pub client: ApiClient,
    /// Every neuron, in registration order.
    pub neurons: Vec<Neuron>,
    pub validators: Vec<DevnetValidator>,
    pub miners: Vec<DevnetMiner>,
    orchestrator: Option<Orchestrator>,
    validator_loops: Option<Validators>,
}

impl Devnet {
    /// Starts the chain, bootstraps the subnet, starts the orchestrator, then the validators,
    /// then the miners one at a time (each given its stage before the next joins, so that
    /// stages fill round robin). Whatever started is stopped again if a later step fails.
    pub async fn start(config: DevnetConfig) -> Result<Self, DevnetError> {
        let net = Localnet::spawn(config.chain.clone()).await?;
        let mut opts = ConnectOptions::new(net.ws_url());
        opts.connect_timeout = Duration::from_secs(20);
        let chain = Subtensor::connect(opts).await.map_err(step("connect"))?;
        let sudo = Keypair::from_private_key(&sp_core::Pair::to_raw_vec(
            &iota_localnet::dev_pair("Alice"),
        ))?;
        let neurons: Vec<PublicKey> = config.neurons.iter().map(|n| n.key.public()).collect();
        let validators: Vec<PublicKey> = config
            .neurons
            .iter()
            .filter(|n| n.role == Role::Validator)
            .map(|n| n.key.public())
            .collect();
        tracing::info!(neurons = neurons.len(), "registering the subnet");
        let netuid = bootstrap(
            &chain,
            &SubnetPlan {
                sudo: &sudo,
                owner: &config.owner.public(),
                max_uids: 1024,
                settings: &[],
                neurons: &neurons,
                validators: &validators,
                permits: PermitWait::Await(config.permit_timeout),
                tx: &config.tx,
            },
        )
        .await?;

        let mut orchestrator = config.orchestrator.clone();
        orchestrator.database_url = create_database(
            &config.database_url,
            &format!("{}_orchestrator", config.database_prefix),
        )
        .await?;
        orchestrator.chain_endpoint = net.ws_url();
        orchestrator.netuid = netuid;
        orchestrator.hotkey = config.owner.ss58();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let (stop, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(iota_orchestrator::run(orchestrator, listener, async {
            let _ = stop_rx.await;
        }));
        let first = config.neurons.first().ok_or(DevnetError::NoNeurons)?;
        let client = match await_orchestrator(&base, &first.key).await {
            Ok(c) => c,
            Err(e) => {
                task.abort();
                return Err(e);
            }
        };
        tracing::info!(%base, netuid, "orchestrator up");
        let mut devnet = Devnet {
            net: Some(net),
            chain,
            netuid,
            base,
            client,
            neurons: config.neurons.clone(),
            validators: Vec::new(),
            miners: Vec::new(),
            orchestrator: Some(Orchestrator {
                stop: Some(stop),
                task,
            }),
            validator_loops: None,
        };
        // On an error below, dropping `devnet` stops what has started.
        devnet.start_validators(&config).await?;
        devnet.start_miners(&config).await?;
        Ok(devnet)
    }

    /// The chain's WebSocket endpoint.
    pub fn ws_url(&self) -> Option<String> {
        self.net.as_ref().map(Localnet::ws_url)
    }

    async fn start_validators(&mut self, config: &DevnetConfig) -> Result<(), DevnetError> {
        let mut plans = Vec::new();
        for (i, neuron) in config
            .neurons
            .iter()
            .filter(|n| n.role == Role::Validator)
            .enumerate()
        {
            let url = create_database(
                &config.database_url,
                &format!("{}_validator{i}", config.database_prefix),
            )
            .await?;
            // The devnet's own connection to the validator's record, for its readers.
            self.validators.push(DevnetValidator {
                neuron: neuron.clone(),
                store: Store::connect(&url).await?,
            });
            let mut cfg = config.validator.clone();
            cfg.orchestrator_url = self.base.clone();
            cfg.netuid = self.netuid;
            plans.push((cfg, neuron.key.clone(), url));
        }
        let ws_url = self.ws_url().ok_or(DevnetError::Stopped)?;
        let (stop, stop_rx) = watch::channel(false);
        let (ready, ready_rx) = oneshot::channel::<Result<(), DevnetError>>();
        let thread = std::thread::Builder::new()
            .name("devnet-validators".into())
            .spawn(move || run_validators(plans, ws_url, ready, stop_rx))?;
        self.validator_loops = Some(Validators {
            stop,
            thread: Some(thread),
        });
        ready_rx.await.map_err(|_| DevnetError::ValidatorThread)?
    }

    async fn start_miners(&mut self, config: &DevnetConfig) -> Result<(), DevnetError> {
        let miners = config.neurons.iter().filter(|n| n.role == Role::Miner);
        for (i, neuron) in miners.enumerate() {
            let mut cfg = config.miner.clone();
            cfg.orchestrator_url = self.base.clone();
            cfg.adversary = neuron.adversary;
            cfg.seed = i as u64 + 1;
            let handle = iota_miner::spawn(cfg, Arc::new(neuron.key.as_pair().clone()));
            let deadline = Instant::now() + config.miner_join_timeout;
            while handle.status().stage.is_none() {
                if handle.is_finished() {
                    // Its error says what is wrong (a device without its feature, a refusal).
                    let why = handle.stop().await.err().map(|e| e.to_string());
                    return Err(DevnetError::MinerStopped {
                        name: neuron.name.clone(),
                        why: why.unwrap_or_default(),
                    });
                }
                if Instant::now() >= deadline {
                    return Err(DevnetError::MinerDidNotJoin(neuron.name.clone()));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tracing::info!(miner = %neuron.name, "joined");
            self.miners.push(DevnetMiner {
                neuron: neuron.clone(),
                handle,
            });
        }
        Ok(())
    }

    /// Stops the miners (each finishes its hop); a miner that ended in an error is logged.
    pub async fn stop_miners(&mut self) {
        for m in self.miners.drain(..) {
            if let Err(e) = m.handle.stop().await {
                tracing::warn!(miner = %m.neuron.name, error = %e, "miner stopped with an error");
            }
        }
    }

    /// Stops everything and waits for it: miners, validators, the orchestrator, the chain.
    pub async fn stop(mut self) {
        self.stop_miners().await;
        if let Some(mut v) = self.validator_loops.take() {
            let _ = v.stop.send(true);
            if let Some(thread) = v.thread.take() {
                let joined = tokio::task::spawn_blocking(move || thread.join()).await;
                if !matches!(joined, Ok(Ok(()))) {
                    tracing::warn!("the validators' thread panicked");
                }
            }
        }
        if let Some(mut o) = self.orchestrator.take() {
            if let Some(stop) = o.stop.take() {
                let _ = stop.send(());
            }
            match (&mut o.task).await {
                Ok(Err(e)) => tracing::warn!(error = %e, "orchestrator"),
                Err(e) => tracing::warn!(error = %e, "orchestrator task"),
                Ok(Ok(())) => {}
            }
        }
        if let Some(net) = self.net.take() {
            net.stop().await;
        }
    }
}

impl Drop for Devnet {
    /// Without [`Devnet::stop`]: signals everything to stop and aborts the orchestrator; the
    /// miners stop when their handles drop, the chain when the localnet drops.
    fn drop(&mut self) {
        if let Some(v) = self.validator_loops.take() {
            let _ = v.stop.send(true);
        }
        if let Some(mut o) = self.orchestrator.take() {
            if let Some(stop) = o.stop.take() {
                let _ = stop.send(());
            }
            o.task.abort();
        }
        for m in &self.miners {
            m.handle.abort();
        }
    }
}

/// The validators' thread: connects each, reports readiness, runs their loops until `stop`.
fn run_validators(
    plans: Vec<(ValidatorConfig, Keypair, String)>,
    ws_url: String,
    ready: oneshot::Sender<Result<(), DevnetError>>,
    stop: watch::Receiver<bool>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    runtime.block_on(async move {
        let mut validators = Vec::new();
        for (cfg, key, url) in plans {
            let connected = async {
                let store = Store::connect(&url).await?;
                let chain = Subtensor::connect(ConnectOptions::new(&ws_url))
                    .await
                    .map_err(step("validator connect"))?;
                Ok::<_, DevnetError>(Validator::connect(cfg, key, chain, store).await?)
            };
            match connected.await {
                Ok(v) => validators.push(v),
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            }
        }
        let _ = ready.send(Ok(()));
        futures::future::join_all(validators.into_iter().map(|v| {
            let mut stop = stop.clone();
            iota_validator::run(v, async move {
                // Stops on the signal, or when the devnet is gone.
                let _ = stop.wait_for(|stopped| *stopped).await;
            })
        }))
        .await;
    });
}

/// Polls until the orchestrator's public API answers.
async fn await_orchestrator(base: &str, key: &Keypair) -> Result<ApiClient, DevnetError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(c) = ApiClient::connect(
            base,
            Arc::new(key.as_pair().clone()),
            RetryPolicy::default(),
        )
        .await
            && c.status().await.is_ok()
        {
            return Ok(c);
        }
        if Instant::now() >= deadline {
            return Err(DevnetError::OrchestratorDidNotStart);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Creates database `name` on the server of `server_url`; returns its URL.
pub async fn create_database(server_url: &str, name: &str) -> Result<String, DevnetError> {
    let admin = sqlx::PgPool::connect(server_url).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await?;
    admin.close().await;
    let (prefix, _) = server_url
        .rsplit_once('/')
        .ok_or(DevnetError::DatabaseUrl)?;
    Ok(format!("{prefix}/{name}"))
}
