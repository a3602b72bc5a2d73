//! Registration, axons, stake, transfers and subnet administration.

use serde::Serialize;

use crate::api;
use crate::calls::{self, AxonEndpoint, Hyperparam, SetterOrigin};
use crate::client::{Subtensor, TxOptions, TxOutcome};
use crate::error::ChainError;
use crate::wallet::{Keypair, PublicKey};

/// Either what a call achieved, or its encoding when it was a dry run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome<T> {
    /// The call ran (or nothing needed to run).
    Done(T),
    /// `--dry-run`: the SCALE-encoded call, `0x…`, not submitted.
    DryRun {
        /// The call as hex.
        call_hex: String,
    },
}

impl<T> Outcome<T> {
    /// The result, unless this was a dry run.
    pub fn done(self) -> Option<T> {
        match self {
            Outcome::Done(t) => Some(t),
            Outcome::DryRun { .. } => None,
        }
    }

    fn dry(outcome: &TxOutcome) -> Option<Self> {
        outcome
            .dry_run_hex()
            .map(|call_hex| Outcome::DryRun { call_hex })
    }
}

/// Where a hotkey stands on a subnet after `register`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Registration {
    /// Its uid.
    pub uid: u16,
    /// It was registered before this call, so nothing was submitted (or burned).
    pub already_registered: bool,
    /// Block of the registration made by this call.
    pub block: Option<u64>,
}

/// A block a transaction landed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Included {
    /// The block number.
    pub block: u64,
}

fn included(outcome: TxOutcome) -> Outcome<Included> {
    match outcome {
        TxOutcome::Included(r) => Outcome::Done(Included {
            block: r.block_number,
        }),
        TxOutcome::DryRun { call_data } => Outcome::DryRun {
            call_hex: format!("0x{}", hex::encode(call_data)),
        },
    }
}

impl Subtensor {
    /// Registers `hotkey` on `netuid` by burning the subnet's registration cost from `coldkey`.
    ///
    /// Idempotent: a hotkey that already has a uid is reported with `already_registered` and
    /// nothing is submitted, so nothing is burned twice.
    ///
    /// # Errors
    ///
    /// Dispatch errors by name ([`ChainError::NotEnoughBalanceToStake`],
    /// [`ChainError::TooManyRegistrationsThisBlock`], …) and transport errors.
    pub async fn register(
        &self,
        coldkey: &Keypair,
        netuid: u16,
        hotkey: &PublicKey,
        opts: &TxOptions,
    ) -> Result<Outcome<Registration>, ChainError> {
        if let Some(uid) = self.uid_of(netuid, hotkey).await? {
            tracing::info!(netuid, uid, hotkey = %hotkey, "hotkey already registered");
            return Ok(Outcome::Done(Registration {
                uid,
                already_registered: true,
                block: None,
            }));
        }
        let call = calls::burned_register(netuid, hotkey);
        match self.submit(&call, coldkey, opts).await {
            Ok(outcome) => {
                if let Some(dry) = Outcome::dry(&outcome) {
                    return Ok(dry);
                }
                let TxOutcome::Included(receipt) = outcome else {
                    return Err(ChainError::Rpc("no receipt".into()));
                };
                let uid = receipt
                    .events
                    .find::<api::subtensor_module::events::NeuronRegistered>()
                    .filter_map(Result::ok)
                    .find(|e| e.0 == netuid && e.2.0 == hotkey.to_bytes())
                    .map(|e| e.1);
                let uid = match uid {
                    Some(uid) => uid,
                    None => self.uid_of(netuid, hotkey).await?.ok_or_else(|| {
                        ChainError::NotRegistered {
                            hotkey: hotkey.ss58(),
                            netuid,
                        }
                    })?,
                };
                tracing::info!(netuid, uid, hotkey = %hotkey, block = receipt.block_number, "registered");
                Ok(Outcome::Done(Registration {
                    uid,
                    already_registered: false,
                    block: Some(receipt.block_number),
                }))
            }
            // Someone registered it between our check and the block: still idempotent.
            Err(ChainError::HotKeyAlreadyRegisteredInSubNet) => {
                match self.uid_of(netuid, hotkey).await? {
                    Some(uid) => Ok(Outcome::Done(Registration {
                        uid,
                        already_registered: true,
                        block: None,
                    })),
                    None => Err(ChainError::HotKeyAlreadyRegisteredInSubNet),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Publishes where `hotkey`'s axon listens on `netuid` (signed by the hotkey), only when it
    /// differs from what the chain holds: `None` means unchanged and nothing was submitted (no
    /// fee, no `ServingRateLimit` spent).
    ///
    /// # Errors
    ///
    /// [`ChainError::ServingRateLimitExceeded`], [`ChainError::HotKeyNotRegisteredInNetwork`],
    /// [`ChainError::InvalidIpAddress`], … and transport errors.
    pub async fn serve_axon_if_changed(
        &self,
        hotkey: &Keypair,
        netuid: u16,
        axon: &AxonEndpoint,
        opts: &TxOptions,
    ) -> Result<Option<Outcome<Included>>, ChainError> {
        if let Some(current) = self.axon_of(netuid, &hotkey.public()).await?
            && current.ip == axon.ip
            && current.port == axon.port
            && current.version == axon.version
            && current.protocol == axon.protocol
        {
            tracing::info!(netuid, axon = %axon, "axon unchanged; nothing submitted");
            return Ok(None);
        }
        self.serve_axon(hotkey, netuid, axon, opts).await.map(Some)
    }

    /// Serves an axon unconditionally (`serve_axon`; rate-limited by `ServingRateLimit`).
    ///
    /// # Errors
    ///
    /// [`ChainError`] from the submission.
    pub async fn serve_axon(
        &self,
        hotkey: &Keypair,
        netuid: u16,
        axon: &AxonEndpoint,
        opts: &TxOptions,
    ) -> Result<Outcome<Included>, ChainError> {
        let outcome = self
            .submit(&calls::serve_axon(netuid, axon), hotkey, opts)
            .await?;
        tracing::info!(netuid, axon = %axon, hotkey = %hotkey.public(), "axon served");
        Ok(included(outcome))
    }

    /// Stakes `amount_rao` TAO from `coldkey` onto `hotkey` on `netuid`.
    ///
    /// # Errors
    ///
    /// [`ChainError::NotEnoughBalanceToStake`], [`ChainError::AmountTooLow`], … and transport
    /// errors.
    pub async fn add_stake(
        &self,
        coldkey: &Keypair,
        hotkey: &PublicKey,
        netuid: u16,
        amount_rao: u64,
        opts: &TxOptions,
    ) -> Result<Outcome<Included>, ChainError> {
        let outcome = self
            .submit(&calls::add_stake(hotkey, netuid, amount_rao), coldkey, opts)
            .await?;
        Ok(included(outcome))
    }

    /// Unstakes `amount_alpha` (rao of alpha) of `coldkey`'s stake on `hotkey`.
    ///
    /// # Errors
    ///
    /// Dispatch errors by name and transport errors.
    pub async fn remove_stake(
        &self,
        coldkey: &Keypair,
        hotkey: &PublicKey,
        netuid: u16,
        amount_alpha: u64,
        opts: &TxOptions,
    ) -> Result<Outcome<Included>, ChainError> {
        let outcome = self
            .submit(
                &calls::remove_stake(hotkey, netuid, amount_alpha),
                coldkey,
                opts,
            )
            .await?;
        Ok(included(outcome))
    }

    /// Sends `amount_rao` TAO from `from` to `dest`; `keep_alive` refuses to empty the sender.
    ///
    /// # Errors
    ///
    /// Balances errors by name ([`ChainError::InsufficientBalance`], …) and transport errors.
    pub async fn transfer(
        &self,
        from: &Keypair,
        dest: &PublicKey,
        amount_rao: u64,
        keep_alive: bool,
        opts: &TxOptions,
    ) -> Result<Outcome<Included>, ChainError> {
        let outcome = self
            .submit(&calls::transfer(dest, amount_rao, keep_alive), from, opts)
            .await?;
        Ok(included(outcome))
    }

    /// Creates a subnet owned by `coldkey` with `hotkey` as uid 0; returns its netuid.
    ///
    /// # Errors
    ///
    /// [`ChainError::CannotAffordLockCost`], … and transport errors.
    pub async fn register_network(
        &self,
        coldkey: &Keypair,
        hotkey: &PublicKey,
        opts: &TxOptions,
    ) -> Result<Outcome<u16>, ChainError> {
        let outcome = self
            .submit(&calls::register_network(hotkey), coldkey, opts)
            .await?;
        if let Some(dry) = Outcome::dry(&outcome) {
            return Ok(dry);
        }
        let TxOutcome::Included(receipt) = outcome else {
            return Err(ChainError::Rpc("no receipt".into()));
        };
        let netuid = receipt
            .events
            .find_first::<api::subtensor_module::events::NetworkAdded>()
            .ok_or_else(|| ChainError::decode("register_network events", "no NetworkAdded"))?
            .map_err(|e| ChainError::decode("NetworkAdded", e))?
            .0;
        tracing::info!(netuid, owner = %coldkey.public(), "subnet registered");
        Ok(Outcome::Done(netuid))
    }

    /// Starts emission on `netuid` (subnet owner only).
    ///
    /// # Errors
    ///
    /// [`ChainError::FirstEmissionBlockNumberAlreadySet`], [`ChainError::BadOrigin`], … and
    /// transport errors.
    pub async fn start_call(
        &self,
        coldkey: &Keypair,
        netuid: u16,
        opts: &TxOptions,
    ) -> Result<Outcome<Included>, ChainError> {
        let outcome = self
            .submit(&calls::start_call(netuid), coldkey, opts)
            .await?;
        Ok(included(outcome))
    }

    /// Changes a subnet setting through `AdminUtils`. `sudo` wraps the call in `Sudo.sudo`
    /// (needed for root-only settings; the localnet's sudo key is Alice); otherwise it is signed
    /// as the subnet owner.
    ///
    /// # Errors
    ///
    /// [`ChainError::BadOrigin`] when the signer may not change it, the inner error of a sudo
    /// call by name, and transport errors.
    pub async fn set_hyperparam(
        &self,
        signer: &Keypair,
        netuid: u16,
        setting: Hyperparam,
        sudo: bool,
        opts: &TxOptions,
    ) -> Result<Outcome<Included>, ChainError> {
        if setting.origin() == SetterOrigin::Root && !sudo {
            tracing::warn!(
                setting = setting.name(),
                "this setting is root-only; without sudo the chain will answer BadOrigin"
            );
        }
        let call = setting.call(netuid);
        let call = if sudo { calls::sudo(call) } else { call };
        let outcome = self.submit(&call, signer, opts).await?;
        tracing::info!(netuid, setting = ?setting, sudo, "hyperparameter set");
        Ok(included(outcome))
    }
}
