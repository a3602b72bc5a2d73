//! The metagraph: every neuron of a subnet and the hyperparameters a client needs, read at one
//! block with three batched storage queries (whatever the number of neurons).
//!
//! 1. the subnet's settings and its per-uid vectors (`Incentive`, `Emission`, …);
//! 2. `Keys` and `BlockAtRegistration` for uids `0..n` (identity-hashed, so the keys are known
//!    without iterating);
//! 3. `Owner`, `TotalHotkeyAlpha` and `Axons` for every hotkey.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Serialize, Serializer};
use subxt::utils::AccountId32;

use crate::api;
use crate::client::{AtBlock, StorageBatch, Subtensor};
use crate::error::ChainError;
use crate::signer::public;
use crate::wallet::PublicKey;

fn ss58<S: Serializer>(key: &PublicKey, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&key.ss58())
}

fn ss58_opt<S: Serializer>(key: &Option<PublicKey>, s: S) -> Result<S::Ok, S::Error> {
    match key {
        Some(k) => s.serialize_str(&k.ss58()),
        None => s.serialize_none(),
    }
}

/// A subnet's settings, as a client needs them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Hyperparams {
    /// The subnet.
    pub netuid: u16,
    /// Block the values were read at.
    pub block: u64,
    /// Blocks between epochs (`Tempo`).
    pub tempo: u16,
    /// Blocks between two weight updates of a neuron (`WeightsSetRateLimit`).
    pub weights_rate_limit: u64,
    /// Blocks after its last weight update that a validator counts as active (`ActivityCutoff`):
    /// weights older than that are left out of Yuma's consensus.
    pub activity_cutoff: u16,
    /// Lowest accepted weights version key (`WeightsVersionKey`).
    pub weights_version_key: u64,
    /// Whether weights go through commit-reveal (`CommitRevealWeightsEnabled`).
    pub commit_reveal_enabled: bool,
    /// Epochs between commit and reveal (`RevealPeriodEpochs`).
    pub reveal_period_epochs: u64,
    /// Registration burn in rao (`Burn`).
    pub burn: u64,
    /// Neuron slots (`MaxAllowedUids`).
    pub max_uids: u16,
    /// Neurons registered (`SubnetworkN`).
    pub n: u16,
    /// Largest single weight, out of 65535 (`MaxWeightsLimit`).
    pub max_weights_limit: u16,
    /// Fewest weights a validator must set (`MinAllowedWeights`).
    pub min_allowed_weights: u16,
    /// Blocks a new neuron is protected from pruning (`ImmunityPeriod`).
    pub immunity_period: u16,
    /// Validator permits handed out (`MaxAllowedValidators`).
    pub max_validators: u16,
    /// Whether registration is open (`NetworkRegistrationAllowed`).
    pub registration_allowed: bool,
    /// Blocks between two `serve_axon` of a neuron (`ServingRateLimit`).
    pub serving_rate_limit: u64,
    /// Owner coldkey (`SubnetOwner`).
    #[serde(serialize_with = "ss58")]
    pub owner_coldkey: PublicKey,
    /// Owner hotkey (`SubnetOwnerHotkey`).
    #[serde(serialize_with = "ss58")]
    pub owner_hotkey: PublicKey,
    /// Block after `start_call`, when emission began (`FirstEmissionBlockNumber`).
    pub first_emission_block: Option<u64>,
}

impl Hyperparams {
    /// `MaxWeightsLimit` as the fraction the SDK's `normalize_max_weight` takes.
    pub fn max_weight_limit_fraction(&self) -> f64 {
        f64::from(self.max_weights_limit) / f64::from(u16::MAX)
    }

    /// Epoch index of `block` under spec 393's rule: `(block + netuid + 1) / (tempo + 1)`.
    pub fn epoch_of(&self, block: u64) -> u64 {
        epoch_index(self.netuid, self.tempo, block)
    }
}

/// Commit-reveal epoch index of `block` for `netuid` with `tempo` (spec ≤ 403 modulo rule,
/// subtensor's `get_epoch_index`). It steps in the block after the one that runs the epoch
/// (see [`crate::epoch::blocks_until_next_epoch`]); spec ≥ 404 keeps it in state
/// ([`Subtensor::epoch_index_at`]).
pub fn epoch_index(netuid: u16, tempo: u16, block: u64) -> u64 {
    (block + u64::from(netuid) + 1) / (u64::from(tempo) + 1)
}

/// An axon as served on chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Axon {
    /// IP address.
    pub ip: IpAddr,
    /// TCP port.
    pub port: u16,
    /// Axon version.
    pub version: u32,
    /// Protocol number.
    pub protocol: u8,
    /// Block it was served at.
    pub block: u64,
}

impl Axon {
    fn from_info(info: &api::runtime_types::pallet_subtensor::pallet::AxonInfo) -> Option<Self> {
        let ip = match info.ip_type {
            4 => IpAddr::V4(Ipv4Addr::from(u32::try_from(info.ip).ok()?)),
            6 => IpAddr::V6(Ipv6Addr::from(info.ip)),
            _ => return None,
        };
        Some(Self {
            ip,
            port: info.port,
            version: info.version,
            protocol: info.protocol,
            block: info.block,
        })
    }

    /// `ip:port` (`[ip]:port` for IPv6).
    pub fn address(&self) -> String {
        std::net::SocketAddr::new(self.ip, self.port).to_string()
    }
}

/// One neuron.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Neuron {
    /// Position in the subnet.
    pub uid: u16,
    /// Hotkey.
    #[serde(serialize_with = "ss58")]
    pub hotkey: PublicKey,
    /// Coldkey owning the hotkey.
    #[serde(serialize_with = "ss58_opt")]
    pub coldkey: Option<PublicKey>,
    /// Alpha staked on the hotkey on this subnet, in rao (`TotalHotkeyAlpha`).
    pub stake: u64,
    /// Holds a validator permit.
    pub validator_permit: bool,
    /// Share of miner emission, out of 65535.
    pub incentive: u16,
    /// Share of validator emission, out of 65535.
    pub dividends: u16,
    /// Emission in the last epoch, rao of alpha.
    pub emission: u64,
    /// Consensus weight, out of 65535.
    pub consensus: u16,
    /// Validator trust, out of 65535.
    pub validator_trust: u16,
    /// Active within the activity cutoff.
    pub active: bool,
    /// Block of its last weight update (its registration block if it never set weights).
    pub last_update: u64,
    /// Block it registered at.
    pub registered_at: u64,
    /// Its axon, if served.
    pub axon: Option<Axon>,
}

/// A subnet at one block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Metagraph {
    /// The subnet.
    pub netuid: u16,
    /// Block number read at.
    pub block: u64,
    /// Block hash read at (`0x…`).
    pub block_hash: String,
    /// Settings.
    pub hyperparams: Hyperparams,
    /// Neurons by uid.
    pub neurons: Vec<Neuron>,
}

impl Metagraph {
    /// The neuron with `hotkey`.
    pub fn neuron_by_hotkey(&self, hotkey: &PublicKey) -> Option<&Neuron> {
        self.neurons.iter().find(|n| &n.hotkey == hotkey)
    }

    /// The uid of `hotkey`.
    pub fn uid_of(&self, hotkey: &PublicKey) -> Option<u16> {
        self.neuron_by_hotkey(hotkey).map(|n| n.uid)
    }
}

/// A neuron as far as checking a caller goes: who holds the uid, and whether it may validate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Member {
    pub uid: u16,
    #[serde(serialize_with = "ss58")]
    pub hotkey: PublicKey,
    pub validator_permit: bool,
    /// Alpha staked on the hotkey on this subnet, in rao (`TotalHotkeyAlpha`), for a validator
    /// permit holder, whose vote it weighs; 0 for the others (not read).
    pub stake: u64,
}

/// Every uid's holder and validator permit on a subnet at one block, with permit holders' stake:
/// what a service that checks its callers against the chain needs, read with `n + p + 3` storage
/// keys for `p` permit holders where a [`Metagraph`] takes `5n + 26` (see
/// [`Subtensor::members_at`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Members {
    pub netuid: u16,
    pub block: u64,
    /// By uid.
    pub members: Vec<Member>,
}

impl From<&Metagraph> for Members {
    fn from(m: &Metagraph) -> Self {
        Self {
            netuid: m.netuid,
            block: m.block,
            members: m
                .neurons
                .iter()
                .map(|n| Member {
                    uid: n.uid,
                    hotkey: n.hotkey,
                    validator_permit: n.validator_permit,
                    stake: if n.validator_permit { n.stake } else { 0 },
                })
                .collect(),
        }
    }
}

fn at_index<T: Copy + Default>(v: &[T], i: usize) -> T {
    v.get(i).copied().unwrap_or_default()
}

impl Subtensor {
    /// The TAO (in rao) that registering on `netuid` burns now, refused when above `max_tao`.
    ///
    /// # Errors
    ///
    /// [`ChainError::InvalidArgument`] when the burn exceeds `max_tao`; transport errors.
    pub async fn registration_burn(
        &self,
        netuid: u16,
        max_tao: Option<f64>,
    ) -> Result<u64, ChainError> {
        let burn = self.hyperparams(netuid).await?.burn;
        if let Some(max) = max_tao {
            let max_rao = crate::calls::tao_to_rao(max)?;
            if burn > max_rao {
                return Err(ChainError::InvalidArgument(format!(
                    "registering on netuid {netuid} burns {} TAO, more than --max-burn {}",
                    crate::calls::format_tao(burn),
                    crate::calls::format_tao(max_rao)
                )));
            }
        }
        Ok(burn)
    }

    /// The subnet's hyperparameters at the best block.
    ///
    /// # Errors
    ///
    /// [`ChainError::NoSuchSubnet`], [`ChainError::Rpc`], [`ChainError::Decode`].
    pub async fn hyperparams(&self, netuid: u16) -> Result<Hyperparams, ChainError> {
        let at = self.at_best().await?;
        self.hyperparams_at(&at, netuid).await
    }

    /// The subnet's hyperparameters at `at`.
    ///
    /// # Errors
    ///
    /// As [`Subtensor::hyperparams`].
    pub async fn hyperparams_at(
        &self,
        at: &AtBlock,
        netuid: u16,
    ) -> Result<Hyperparams, ChainError> {
        let read = self.read_subnet(at, netuid, &SubnetRead::default()).await?;
        Ok(read.hyperparams)
    }

    /// Every neuron of `netuid` with the subnet's hyperparameters, at the latest finalized block.
    ///
    /// # Errors
    ///
    /// [`ChainError::NoSuchSubnet`], [`ChainError::Rpc`], [`ChainError::Decode`].
    pub async fn metagraph(&self, netuid: u16) -> Result<Metagraph, ChainError> {
        let at = self.at_finalized().await?;
        self.metagraph_at(&at, netuid).await
    }

    /// The metagraph at `at`.
    ///
    /// # Errors
    ///
    /// As [`Subtensor::metagraph`].
    pub async fn metagraph_at(&self, at: &AtBlock, netuid: u16) -> Result<Metagraph, ChainError> {
        let started = std::time::Instant::now();
        let read = self
            .read_subnet(
                at,
                netuid,
                &SubnetRead {
                    vectors: true,
                    ..SubnetRead::default()
                },
            )
            .await?;
        let (hyperparams, vectors) = (read.hyperparams, read.vectors);
        let n = usize::from(hyperparams.n);
        let st = || api::storage().subtensor_module();

        // Round 2: who holds each uid, and since when.
        let mut batch = StorageBatch::new(at);
        let uids = || (0..hyperparams.n).map(|uid| (netuid, uid));
        let key_slots = batch.add_all(st().keys(), uids())?;
        let reg_slots = batch.add_all(st().block_at_registration(), uids())?;
        let fetched = batch.fetch(self).await?;
        let mut hotkeys: Vec<AccountId32> = Vec::with_capacity(n);
        let mut registered = Vec::with_capacity(n);
        for (k, r) in key_slots.iter().zip(&reg_slots) {
            hotkeys.push(fetched.value(k)?);
            registered.push(fetched.value(r)?);
        }

        // Round 3: per-hotkey coldkey, stake and axon.
        let mut batch = StorageBatch::new(at);
        let owners = batch.add_all(st().owner(), hotkeys.iter().map(|h| (*h,)))?;
        let stakes = batch.add_all(
            st().total_hotkey_alpha(),
            hotkeys.iter().map(|h| (*h, netuid)),
        )?;
        let axons = batch.add_all(st().axons(), hotkeys.iter().map(|h| (netuid, *h)))?;
        let fetched = batch.fetch(self).await?;

        let mut neurons = Vec::with_capacity(n);
        let per_hotkey = owners.iter().zip(&stakes).zip(&axons);
        for (uid, (hotkey, ((owner, stake), axon))) in hotkeys.iter().zip(per_hotkey).enumerate() {
            let owner: AccountId32 = fetched.value(owner)?;
            let axon = fetched.optional(axon)?;
            neurons.push(Neuron {
                uid: u16::try_from(uid).map_err(|_| ChainError::decode("uid", "above u16"))?,
                hotkey: public(hotkey),
                coldkey: (owner.0 != [0; 32]).then(|| public(&owner)),
                stake: fetched.value(stake)?,
                validator_permit: at_index(&vectors.validator_permit, uid),
                incentive: at_index(&vectors.incentive, uid),
                dividends: at_index(&vectors.dividends, uid),
                emission: at_index(&vectors.emission, uid),
                consensus: at_index(&vectors.consensus, uid),
                validator_trust: at_index(&vectors.validator_trust, uid),
                active: at_index(&vectors.active, uid),
                last_update: at_index(&vectors.last_update, uid),
                registered_at: registered[uid],
                axon: axon.as_ref().and_then(Axon::from_info),
            });
        }
        tracing::debug!(
            netuid,
            n,
            block = at.block_number(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "metagraph read"
        );
        Ok(Metagraph {
            netuid,
            block: at.block_number(),
            block_hash: format!("{:?}", at.block_hash()),
            hyperparams,
            neurons,
        })
    }

    /// Who holds each uid of `netuid` at `at`, and which hold a validator permit: the part of
    /// [`Subtensor::metagraph_at`] that a caller check needs, in two batched queries (the
    /// subnet's size and permits, then `Keys` for uids `0..n`). A metagraph watcher reads this
    /// at every block: for 1,000 uids the orchestrator's load benchmark measured 3-5 ms of the
    /// reader's CPU and 1.2-1.8 ms of the node's, against 12-18 ms and 7-11 ms for the full
    /// metagraph.
    ///
    /// # Errors
    ///
    /// [`ChainError::NoSuchSubnet`], or the reads' errors.
    pub async fn members_at(&self, at: &AtBlock, netuid: u16) -> Result<Members, ChainError> {
        let st = || api::storage().subtensor_module();
        let mut b = StorageBatch::new(at);
        let added = b.add(st().networks_added(), (netuid,))?;
        let n = b.add(st().subnetwork_n(), (netuid,))?;
        let permits = b.add(st().validator_permit(), (netuid,))?;
        let f = b.fetch(self).await?;
        if !f.value(&added)? {
            return Err(ChainError::NoSuchSubnet(netuid));
        }
        let n: u16 = f.value(&n)?;
        let permits: Vec<bool> = f.value(&permits)?;
        let mut b = StorageBatch::new(at);
        let keys = b.add_all(st().keys(), (0..n).map(|uid| (netuid, uid)))?;
        let f = b.fetch(self).await?;
        let mut members = (0..n)
            .zip(&keys)
            .map(|(uid, key)| {
                Ok(Member {
                    uid,
                    hotkey: public(&f.value(key)?),
                    validator_permit: at_index(&permits, usize::from(uid)),
                    stake: 0,
                })
            })
            .collect::<Result<Vec<_>, ChainError>>()?;
        // The stake of permit holders only (a few dozen at most): what weighs their votes.
        let holders: Vec<usize> = (0..members.len())
            .filter(|i| members[*i].validator_permit)
            .collect();
        if !holders.is_empty() {
            let mut b = StorageBatch::new(at);
            let stakes = b.add_all(
                st().total_hotkey_alpha(),
                holders
                    .iter()
                    .map(|i| (crate::signer::account(&members[*i].hotkey), netuid)),
            )?;
            let f = b.fetch(self).await?;
            for (i, slot) in holders.iter().zip(&stakes) {
                members[*i].stake = f.value(slot)?;
            }
        }
        Ok(Members {
            netuid,
            block: at.block_number(),
            members,
        })
    }

    /// Round 1 of the metagraph: settings, plus what `want` asks for, in one batch.
    pub(crate) async fn read_subnet(
        &self,
        at: &AtBlock,
        netuid: u16,
        want: &SubnetRead,
    ) -> Result<SubnetState, ChainError> {
        let st = || api::storage().subtensor_module();
        let mut b = StorageBatch::new(at);
        let added = b.add(st().networks_added(), (netuid,))?;
        let n = b.add(st().subnetwork_n(), (netuid,))?;
        let tempo = b.add(st().tempo(), (netuid,))?;
        let rate = b.add(st().weights_set_rate_limit(), (netuid,))?;
        let cutoff = b.add(st().activity_cutoff(), (netuid,))?;
        let version = b.add(st().weights_version_key(), (netuid,))?;
        let cr = b.add(st().commit_reveal_weights_enabled(), (netuid,))?;
        let reveal = b.add(st().reveal_period_epochs(), (netuid,))?;
        let burn = b.add(st().burn(), (netuid,))?;
        let max_uids = b.add(st().max_allowed_uids(), (netuid,))?;
        let max_w = b.add(st().max_weights_limit(), (netuid,))?;
        let min_w = b.add(st().min_allowed_weights(), (netuid,))?;
        let immunity = b.add(st().immunity_period(), (netuid,))?;
        let max_val = b.add(st().max_allowed_validators(), (netuid,))?;
        let reg = b.add(st().network_registration_allowed(), (netuid,))?;
        let serving = b.add(st().serving_rate_limit(), (netuid,))?;
        let owner = b.add(st().subnet_owner(), (netuid,))?;
        let owner_hot = b.add(st().subnet_owner_hotkey(), (netuid,))?;
        let first = b.add(st().first_emission_block_number(), (netuid,))?;
        let uid_slot = match &want.uid_of {
            Some(hotkey) => Some(b.add(st().uids(), (netuid, crate::signer::account(hotkey)))?),
            None => None,
        };
        let last_update_slot = if want.last_update && !want.vectors {
            Some(b.add(st().last_update(), (netuid,))?)
        } else {
            None
        };
        let vector_slots = if want.vectors {
            Some((
                b.add(st().incentive(), (netuid,))?,
                b.add(st().dividends(), (netuid,))?,
                b.add(st().emission(), (netuid,))?,
                b.add(st().consensus(), (netuid,))?,
                b.add(st().validator_trust(), (netuid,))?,
                b.add(st().validator_permit(), (netuid,))?,
                b.add(st().active(), (netuid,))?,
                b.add(st().last_update(), (netuid,))?,
            ))
        } else {
            None
        };
        let f = b.fetch(self).await?;
        if !f.value(&added)? {
            return Err(ChainError::NoSuchSubnet(netuid));
        }
        let hyperparams = Hyperparams {
            netuid,
            block: at.block_number(),
            tempo: f.value(&tempo)?,
            weights_rate_limit: f.value(&rate)?,
            activity_cutoff: f.value(&cutoff)?,
            weights_version_key: f.value(&version)?,
            commit_reveal_enabled: f.value(&cr)?,
            reveal_period_epochs: f.value(&reveal)?,
            burn: f.value(&burn)?,
            max_uids: f.value(&max_uids)?,
            n: f.value(&n)?,
            max_weights_limit: f.value(&max_w)?,
            min_allowed_weights: f.value(&min_w)?,
            immunity_period: f.value(&immunity)?,
            max_validators: f.value(&max_val)?,
            registration_allowed: f.value(&reg)?,
            serving_rate_limit: f.value(&serving)?,
            owner_coldkey: public(&f.value(&owner)?),
            owner_hotkey: public(&f.value(&owner_hot)?),
            first_emission_block: f.optional(&first)?,
        };
        let mut vectors = match vector_slots {
            Some((inc, div, em, cons, vt, vp, act, lu)) => Vectors {
                incentive: f.value(&inc)?,
                dividends: f.value(&div)?,
                emission: f.value(&em)?,
                consensus: f.value(&cons)?,
                validator_trust: f.value(&vt)?,
                validator_permit: f.value(&vp)?,
                active: f.value(&act)?,
                last_update: f.value(&lu)?,
            },
            None => Vectors::default(),
        };
        if let Some(slot) = &last_update_slot {
            vectors.last_update = f.value(slot)?;
        }
        let uid = match &uid_slot {
            Some(slot) => f.optional(slot)?,
            None => None,
        };
        Ok(SubnetState {
            hyperparams,
            vectors,
            uid,
        })
    }

    /// The axon `hotkey` serves on `netuid`, if any.
    ///
    /// # Errors
    ///
    /// [`ChainError`] when the chain cannot be read.
    pub async fn axon_of(
        &self,
        netuid: u16,
        hotkey: &PublicKey,
    ) -> Result<Option<Axon>, ChainError> {
        let at = self.at_best().await?;
        let mut b = StorageBatch::new(&at);
        let slot = b.add(
            api::storage().subtensor_module().axons(),
            (netuid, crate::signer::account(hotkey)),
        )?;
        let info: Option<api::runtime_types::pallet_subtensor::pallet::AxonInfo> =
            b.fetch(self).await?.optional(&slot)?;
        Ok(info.as_ref().and_then(Axon::from_info))
    }

    /// The uid of `hotkey` on `netuid`, if registered.
    ///
    /// # Errors
    ///
    /// [`ChainError`] when the chain cannot be read.
    pub async fn uid_of(&self, netuid: u16, hotkey: &PublicKey) -> Result<Option<u16>, ChainError> {
        let at = self.at_best().await?;
        let mut b = StorageBatch::new(&at);
        let slot = b.add(
            api::storage().subtensor_module().uids(),
            (netuid, crate::signer::account(hotkey)),
        )?;
        b.fetch(self).await?.optional(&slot)
    }

    /// Alpha staked on `hotkey` on `netuid`, in rao, at the best block.
    ///
    /// # Errors
    ///
    /// [`ChainError::Rpc`], [`ChainError::Decode`].
    pub async fn stake_of(&self, netuid: u16, hotkey: &PublicKey) -> Result<u64, ChainError> {
        let at = self.at_best().await?;
        let mut b = StorageBatch::new(&at);
        let slot = b.add(
            api::storage().subtensor_module().total_hotkey_alpha(),
            (crate::signer::account(hotkey), netuid),
        )?;
        b.fetch(self).await?.value(&slot)
    }
}

/// What [`Subtensor::read_subnet`] reads besides the settings.
#[derive(Default)]
pub(crate) struct SubnetRead {
    /// All per-uid vectors (the metagraph).
    pub vectors: bool,
    /// Only `LastUpdate`.
    pub last_update: bool,
    /// The uid of this hotkey.
    pub uid_of: Option<PublicKey>,
}

/// The result of [`Subtensor::read_subnet`].
pub(crate) struct SubnetState {
    pub hyperparams: Hyperparams,
    pub vectors: Vectors,
    pub uid: Option<u16>,
}

impl SubnetState {
    /// `LastUpdate` of `uid` (0 when never set or not read).
    pub fn last_update_of(&self, uid: u16) -> u64 {
        at_index(&self.vectors.last_update, usize::from(uid))
    }
}

#[derive(Default)]
pub(crate) struct Vectors {
    incentive: Vec<u16>,
    dividends: Vec<u16>,
    emission: Vec<u64>,
    consensus: Vec<u16>,
    validator_trust: Vec<u16>,
    validator_permit: Vec<bool>,
    active: Vec<bool>,
    last_update: Vec<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_follow_the_modulo_rule() {
        // netuid 1, tempo 10: epoch boundaries where (block + 2) % 11 == 0.
        assert_eq!(epoch_index(1, 10, 8), 0);
        assert_eq!(epoch_index(1, 10, 9), 1);
        assert_eq!(epoch_index(1, 10, 19), 1);
        assert_eq!(epoch_index(1, 10, 20), 2);
    }

    #[test]
    fn axon_ips_decode() {
        use api::runtime_types::pallet_subtensor::pallet::AxonInfo;
        let info = AxonInfo {
            block: 3,
            version: 1,
            ip: u128::from(u32::from(Ipv4Addr::new(10, 0, 0, 7))),
            port: 8091,
            ip_type: 4,
            protocol: 4,
            placeholder1: 0,
            placeholder2: 0,
        };
        let axon = Axon::from_info(&info).expect("v4");
        assert_eq!(axon.address(), "10.0.0.7:8091");
        assert!(Axon::from_info(&AxonInfo { ip_type: 5, ..info }).is_none());
    }
}

/// Subnets a chain can hold at most; per-mechanism storage is offset by this much per mechanism.
pub const GLOBAL_MAX_SUBNET_COUNT: u16 = 4096;

/// The `NetUidStorageIndex` under which mechanism `mechanism` of `netuid` keeps its per-mechanism
/// values (`LastUpdate`, `Incentive`, `Weights`, commits): `netuid + mechanism · 4096`, so the
/// main mechanism (0) reads at the netuid itself. This client reads and sets weights for the
/// main mechanism only; `None` when the index does not fit.
pub fn storage_index(netuid: u16, mechanism: u8) -> Option<u16> {
    u16::from(mechanism)
        .checked_mul(GLOBAL_MAX_SUBNET_COUNT)?
        .checked_add(netuid)
}

#[cfg(test)]
mod storage_index_tests {
    use super::*;

    #[test]
    fn main_mechanism_is_the_netuid_and_others_are_offset() {
        assert_eq!(storage_index(9, 0), Some(9));
        assert_eq!(storage_index(9, 1), Some(4105));
        assert_eq!(storage_index(4095, 14), Some(61_439));
        assert_eq!(storage_index(1, 16), None);
    }
}
