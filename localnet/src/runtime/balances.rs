//! `Balances`: free balances in `System.Account`, transfers with the existential deposit, and the
//! withdraw/deposit helpers other pallets use for burns, locks and stake.

use super::call::BalancesCall;
use super::error::BalancesError;
use super::event::{BalancesEvent, DispatchError, Pays, RuntimeEvent, SystemEvent, TokenError};
use super::storage::{balances::TotalIssuance, system::Account};
use super::types::{AccountId32, Balance, MultiAddress};
use super::{BALANCES_INDEX, DispatchResult, EXISTENTIAL_DEPOSIT, Exec, Origin, module_error};

impl From<BalancesError> for DispatchError {
    fn from(e: BalancesError) -> Self {
        module_error(BALANCES_INDEX, e as u8)
    }
}

fn lookup(address: &MultiAddress) -> Result<AccountId32, DispatchError> {
    address.account().ok_or(DispatchError::CannotLookup)
}

pub fn free_balance(exec: &Exec<'_>, who: &AccountId32) -> Balance {
    Account::get(exec.state, who).data.free
}

/// Takes `amount` out of circulation from `who` (burns, locks, stake).
pub fn withdraw(
    exec: &mut Exec<'_>,
    who: &AccountId32,
    amount: Balance,
) -> Result<(), DispatchError> {
    let mut info = Account::get(exec.state, who);
    info.data.free = info
        .data
        .free
        .checked_sub(amount)
        .ok_or(DispatchError::Token(TokenError::FundsUnavailable))?;
    Account::insert(exec.state, who, &info);
    TotalIssuance::mutate(exec.state, |i| *i = i.saturating_sub(amount));
    Ok(())
}

/// Puts `amount` into `who`'s free balance (unstaking, unlocking), creating the account if needed.
pub fn deposit(exec: &mut Exec<'_>, who: &AccountId32, amount: Balance) {
    credit(exec, who, amount);
    TotalIssuance::mutate(exec.state, |i| *i = i.saturating_add(amount));
}

fn credit(exec: &mut Exec<'_>, who: &AccountId32, amount: Balance) {
    let mut info = Account::get(exec.state, who);
    let is_new = info.providers == 0;
    info.data.free = info.data.free.saturating_add(amount);
    if is_new {
        info.providers = 1;
    }
    Account::insert(exec.state, who, &info);
    if is_new {
        exec.deposit(RuntimeEvent::System(SystemEvent::NewAccount {
            account: who.clone(),
        }));
        exec.deposit(RuntimeEvent::Balances(BalancesEvent::Endowed {
            account: who.clone(),
            free_balance: amount,
        }));
    }
}

fn transfer(
    exec: &mut Exec<'_>,
    from: &AccountId32,
    to: &AccountId32,
    value: Balance,
    keep_alive: bool,
) -> Result<(), DispatchError> {
    let sender = Account::get(exec.state, from);
    let remaining = sender
        .data
        .free
        .checked_sub(value)
        .ok_or(DispatchError::Token(TokenError::FundsUnavailable))?;
    if keep_alive && remaining < EXISTENTIAL_DEPOSIT {
        return Err(DispatchError::Token(TokenError::NotExpendable));
    }
    let receiver = Account::get(exec.state, to);
    if receiver.providers == 0 && value < EXISTENTIAL_DEPOSIT {
        return Err(DispatchError::Token(TokenError::BelowMinimum));
    }
    if from == to {
        return Ok(());
    }
    let mut sender = sender;
    sender.data.free = remaining;
    Account::insert(exec.state, from, &sender);
    credit(exec, to, value);
    exec.deposit(RuntimeEvent::Balances(BalancesEvent::Transfer {
        from: from.clone(),
        to: to.clone(),
        amount: value,
    }));
    Ok(())
}

pub fn dispatch(exec: &mut Exec<'_>, origin: &Origin, call: &BalancesCall) -> DispatchResult {
    match call {
        BalancesCall::transfer_allow_death { dest, value } => {
            let from = origin.signed()?.clone();
            transfer(exec, &from, &lookup(dest)?, *value, false)?;
        }
        BalancesCall::transfer_keep_alive { dest, value } => {
            let from = origin.signed()?.clone();
            transfer(exec, &from, &lookup(dest)?, *value, true)?;
        }
        BalancesCall::transfer_all { dest, keep_alive } => {
            let from = origin.signed()?.clone();
            let free = free_balance(exec, &from);
            let value = if *keep_alive {
                free.saturating_sub(EXISTENTIAL_DEPOSIT)
            } else {
                free
            };
            transfer(exec, &from, &lookup(dest)?, value, *keep_alive)?;
        }
        BalancesCall::force_transfer {
            source,
            dest,
            value,
        } => {
            origin.ensure_root()?;
            transfer(exec, &lookup(source)?, &lookup(dest)?, *value, false)?;
        }
        BalancesCall::force_set_balance { who, new_free } => {
            origin.ensure_root()?;
            let who = lookup(who)?;
            let old = free_balance(exec, &who);
            if *new_free >= old {
                deposit(exec, &who, new_free - old);
            } else {
                withdraw(exec, &who, old - new_free)?;
            }
            exec.deposit(RuntimeEvent::Balances(BalancesEvent::BalanceSet {
                who,
                free: *new_free,
            }));
        }
    }
    Ok(Pays::Yes)
}
