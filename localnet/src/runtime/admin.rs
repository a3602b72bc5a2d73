//! `AdminUtils`: the hyperparameter setters local subnets need. Root (through `Sudo.sudo`) may set
//! all of them; a subnet's owner coldkey may set the ones subtensor lets owners set.

use super::call::AdminUtilsCall as C;
use super::error::AdminUtilsError;
use super::event::{AdminUtilsEvent, DispatchError, Pays, RuntimeEvent, SubtensorEvent as Ev};
use super::storage::subtensor::*;
use super::{ADMIN_UTILS_INDEX, DispatchResult, Exec, Origin, module_error};

impl From<AdminUtilsError> for DispatchError {
    fn from(e: AdminUtilsError) -> Self {
        module_error(ADMIN_UTILS_INDEX, e as u8)
    }
}

fn ensure_subnet(exec: &Exec<'_>, netuid: u16) -> Result<(), DispatchError> {
    if NetworksAdded::get(exec.state, &netuid) {
        Ok(())
    } else {
        Err(AdminUtilsError::SubnetDoesNotExist.into())
    }
}

fn ensure_owner_or_root(
    exec: &Exec<'_>,
    origin: &Origin,
    netuid: u16,
) -> Result<(), DispatchError> {
    ensure_subnet(exec, netuid)?;
    match origin {
        Origin::Root => Ok(()),
        Origin::Signed(who) if *who == SubnetOwner::get(exec.state, &netuid) => Ok(()),
        Origin::Signed(_) => Err(DispatchError::BadOrigin),
    }
}

fn ensure_root_on(exec: &Exec<'_>, origin: &Origin, netuid: u16) -> Result<(), DispatchError> {
    origin.ensure_root()?;
    ensure_subnet(exec, netuid)
}

pub fn dispatch(exec: &mut Exec<'_>, origin: &Origin, call: &C) -> DispatchResult {
    let event = match *call {
        C::sudo_set_serving_rate_limit {
            netuid,
            serving_rate_limit,
        } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            ServingRateLimit::insert(exec.state, &netuid, &serving_rate_limit);
            Ev::ServingRateLimitSet(netuid, serving_rate_limit)
        }
        C::sudo_set_weights_version_key {
            netuid,
            weights_version_key,
        } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            WeightsVersionKey::insert(exec.state, &netuid, &weights_version_key);
            Ev::WeightsVersionKeySet(netuid, weights_version_key)
        }
        C::sudo_set_weights_set_rate_limit {
            netuid,
            weights_set_rate_limit,
        } => {
            ensure_root_on(exec, origin, netuid)?;
            WeightsSetRateLimit::insert(exec.state, &netuid, &weights_set_rate_limit);
            Ev::WeightsSetRateLimitSet(netuid, weights_set_rate_limit)
        }
        C::sudo_set_immunity_period {
            netuid,
            immunity_period,
        } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            ImmunityPeriod::insert(exec.state, &netuid, &immunity_period);
            Ev::ImmunityPeriodSet(netuid, immunity_period)
        }
        C::sudo_set_min_allowed_weights {
            netuid,
            min_allowed_weights,
        } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            MinAllowedWeights::insert(exec.state, &netuid, &min_allowed_weights);
            Ev::MinAllowedWeightSet(netuid, min_allowed_weights)
        }
        C::sudo_set_max_allowed_uids {
            netuid,
            max_allowed_uids,
        } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            if max_allowed_uids < SubnetworkN::get(exec.state, &netuid) {
                return Err(AdminUtilsError::MaxAllowedUIdsLessThanCurrentUIds.into());
            }
            if max_allowed_uids < MaxAllowedValidators::get(exec.state, &netuid) {
                MaxAllowedValidators::insert(exec.state, &netuid, &max_allowed_uids);
            }
            MaxAllowedUids::insert(exec.state, &netuid, &max_allowed_uids);
            Ev::MaxAllowedUidsSet(netuid, max_allowed_uids)
        }
        C::sudo_set_kappa { netuid, kappa } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            Kappa::insert(exec.state, &netuid, &kappa);
            Ev::KappaSet(netuid, kappa)
        }
        C::sudo_set_activity_cutoff {
            netuid,
            activity_cutoff,
        } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            ActivityCutoff::insert(exec.state, &netuid, &activity_cutoff);
            Ev::ActivityCutoffSet(netuid, activity_cutoff)
        }
        C::sudo_set_network_registration_allowed {
            netuid,
            registration_allowed,
        } => {
            ensure_root_on(exec, origin, netuid)?;
            NetworkRegistrationAllowed::insert(exec.state, &netuid, &registration_allowed);
            Ev::RegistrationAllowed(netuid, registration_allowed)
        }
        C::sudo_set_min_burn { netuid, min_burn } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            if min_burn > MaxBurn::get(exec.state, &netuid) {
                return Err(AdminUtilsError::ValueNotInBounds.into());
            }
            MinBurn::insert(exec.state, &netuid, &min_burn);
            Burn::mutate(exec.state, &netuid, |b| *b = (*b).max(min_burn));
            Ev::MinBurnSet(netuid, min_burn)
        }
        C::sudo_set_max_burn { netuid, max_burn } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            if max_burn < MinBurn::get(exec.state, &netuid) {
                return Err(AdminUtilsError::ValueNotInBounds.into());
            }
            MaxBurn::insert(exec.state, &netuid, &max_burn);
            Burn::mutate(exec.state, &netuid, |b| *b = (*b).min(max_burn));
            Ev::MaxBurnSet(netuid, max_burn)
        }
        C::sudo_set_max_allowed_validators {
            netuid,
            max_allowed_validators,
        } => {
            ensure_root_on(exec, origin, netuid)?;
            if max_allowed_validators > MaxAllowedUids::get(exec.state, &netuid) {
                return Err(AdminUtilsError::MaxValidatorsLargerThanMaxUIds.into());
            }
            MaxAllowedValidators::insert(exec.state, &netuid, &max_allowed_validators);
            Ev::MaxAllowedValidatorsSet(netuid, max_allowed_validators)
        }
        C::sudo_set_bonds_moving_average {
            netuid,
            bonds_moving_average,
        } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            if bonds_moving_average > 1_000_000 {
                return Err(AdminUtilsError::BondsMovingAverageMaxReached.into());
            }
            BondsMovingAverage::insert(exec.state, &netuid, &bonds_moving_average);
            Ev::BondsMovingAverageSet(netuid, bonds_moving_average)
        }
        C::sudo_set_max_registrations_per_block {
            netuid,
            max_registrations_per_block,
        } => {
            ensure_root_on(exec, origin, netuid)?;
            MaxRegistrationsPerBlock::insert(exec.state, &netuid, &max_registrations_per_block);
            Ev::MaxRegistrationsPerBlockSet(netuid, max_registrations_per_block)
        }
        C::sudo_set_network_rate_limit { rate_limit } => {
            origin.ensure_root()?;
            NetworkRateLimit::insert(exec.state, &rate_limit);
            Ev::NetworkRateLimitSet(rate_limit)
        }
        C::sudo_set_tempo { netuid, tempo } => {
            ensure_root_on(exec, origin, netuid)?;
            Tempo::insert(exec.state, &netuid, &tempo);
            Ev::TempoSet(netuid, tempo)
        }
        C::sudo_set_network_min_lock_cost { lock_cost } => {
            origin.ensure_root()?;
            NetworkMinLockCost::insert(exec.state, &lock_cost);
            NetworkLastLockCost::insert(exec.state, &lock_cost);
            Ev::NetworkMinLockCostSet(lock_cost)
        }
        C::sudo_set_stake_threshold { min_stake } => {
            origin.ensure_root()?;
            StakeThreshold::insert(exec.state, &min_stake);
            Ev::StakeThresholdSet(min_stake)
        }
        C::sudo_set_commit_reveal_weights_enabled { netuid, enabled } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            CommitRevealWeightsEnabled::insert(exec.state, &netuid, &enabled);
            Ev::CommitRevealEnabled(netuid, enabled)
        }
        C::sudo_set_commit_reveal_weights_interval { netuid, interval } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            if interval == 0 {
                return Err(super::error::SubtensorError::RevealPeriodTooSmall.into());
            }
            RevealPeriodEpochs::insert(exec.state, &netuid, &interval);
            Ev::CommitRevealPeriodsSet(netuid, interval)
        }
        C::sudo_set_commit_reveal_version { version } => {
            origin.ensure_root()?;
            CommitRevealWeightsVersion::insert(exec.state, &version);
            Ev::CommitRevealVersionSet(version)
        }
        C::sudo_set_yuma3_enabled { netuid, enabled } => {
            ensure_owner_or_root(exec, origin, netuid)?;
            Yuma3On::insert(exec.state, &netuid, &enabled);
            exec.deposit(RuntimeEvent::AdminUtils(
                AdminUtilsEvent::Yuma3EnableToggled { netuid, enabled },
            ));
            return Ok(Pays::No);
        }
    };
    exec.deposit(RuntimeEvent::SubtensorModule(event));
    Ok(Pays::No)
}
