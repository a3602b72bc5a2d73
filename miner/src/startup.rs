//! Start-up against the chain: load the wallet, check (or make) the registration, publish the
//! axon only when it changed. Returns the hotkey that signs every request.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::Arc;

use iota_chain::calls::{self, AxonEndpoint};
use iota_chain::wallet::PasswordSource;
use iota_chain::{Subtensor, TxOptions};
use iota_protocol::signing::RequestSigner;

use crate::config::MinerArgs;
use crate::error::MinerError;

/// What start-up found.
pub struct Ready {
    /// The hotkey's signer.
    pub signer: Arc<dyn RequestSigner>,
    /// Uid on the subnet.
    pub uid: u16,
}

fn confirm(args: &MinerArgs, prompt: &str) -> Result<(), MinerError> {
    if args.yes {
        println!("{prompt}");
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(MinerError::Config(format!(
            "{prompt} Pass --yes (or IOTA_YES=1) to confirm without a terminal."
        )));
    }
    print!("{prompt} Continue? [y/N] ");
    let _ = std::io::stdout().flush();
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .map_err(|e| MinerError::Config(e.to_string()))?;
    if matches!(answer.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(MinerError::Config("registration declined".into()))
    }
}

/// Loads the wallet and makes sure its hotkey is registered on the subnet (registering it by
/// burn with `--register`, within `--max-burn`), then serves the axon if one is configured and
/// it changed.
pub async fn prepare(args: &MinerArgs, password: &PasswordSource) -> Result<Ready, MinerError> {
    let wallet = args
        .wallet
        .wallet()
        .map_err(|e| MinerError::Config(e.to_string()))?;
    let hotkey = wallet.hotkey(password).map_err(|e| {
        MinerError::Config(format!(
            "hotkey {:?} of wallet {:?}: {e} (create it with `iota wallet new-hotkey`)",
            args.wallet.hotkey, args.wallet.name
        ))
    })?;
    let opts = args.subtensor.connect_options()?;
    let chain = Subtensor::connect(opts).await?;
    let tx = TxOptions::default();
    let netuid = args.netuid;
    let uid = match chain.uid_of(netuid, &hotkey.public()).await? {
        Some(uid) => uid,
        None if args.register => {
            let burn = chain.registration_burn(netuid, args.max_burn).await?;
            confirm(
                args,
                &format!(
                    "Registering {} on netuid {netuid} burns {} TAO from the coldkey.",
                    hotkey.ss58(),
                    calls::format_tao(burn)
                ),
            )?;
            let coldkey = wallet
                .coldkey(password)
                .map_err(|e| MinerError::Config(format!("coldkey: {e}")))?;
            let reg = chain
                .register(&coldkey, netuid, &hotkey.public(), &tx)
                .await?
                .done()
                .ok_or_else(|| MinerError::Internal("registration was a dry run".into()))?;
            tracing::info!(uid = reg.uid, netuid, "registered");
            reg.uid
        }
        None => {
            return Err(MinerError::NotRegistered {
                hotkey: hotkey.ss58(),
                netuid,
            });
        }
    };
    if let Some(ip) = args.axon_ip {
        let axon = AxonEndpoint::new(ip, args.axon_port);
        match chain
            .serve_axon_if_changed(&hotkey, netuid, &axon, &tx)
            .await?
        {
            Some(_) => tracing::info!(%axon, "axon served"),
            None => tracing::info!(%axon, "axon unchanged; nothing submitted"),
        }
    }
    Ok(Ready {
        signer: Arc::new(hotkey.as_pair().clone()),
        uid,
    })
}
