//! One error type for everything the chain client does.
//!
//! Dispatch errors (a transaction that made it into a block but failed) are decoded by *name*
//! from the node's metadata: error indices move between runtime versions (`SettingWeightsTooFast`
//! is 28 in spec 393 and 29 in spec 425), names do not. Transactions the node refuses before they
//! reach a block come back as JSON-RPC error 1010 and are parsed into [`InvalidTransaction`];
//! subtensor's own pool checks (`Custom error: N`) are reported under the pallet error's name
//! when the code and call identify it (a serving rate limit is `ServingRateLimitExceeded` whether
//! the pool or the block refused it).

use std::time::Duration;

use crate::wallet::WalletError;
use crate::weights::WeightsError;

/// Declares the dispatch errors the client names, and the name → variant mapping, in one place.
macro_rules! named_dispatch_errors {
    ($( $(#[$doc:meta])* $name:ident => $msg:literal, )*) => {
        /// Everything that can go wrong talking to subtensor.
        #[derive(Debug, thiserror::Error)]
        #[non_exhaustive]
        pub enum ChainError {
            $(
                $(#[$doc])*
                #[error("{}: {}", stringify!($name), $msg)]
                $name,
            )*
            /// A module error the client has no variant for, by pallet and error name.
            #[error("{pallet}.{name}: the transaction failed on chain")]
            Module {
                /// Pallet name from the node's metadata.
                pallet: String,
                /// Error variant name from the node's metadata.
                name: String,
            },
            /// A dispatch error that is not a module error (`BadOrigin`, `Token(FundsUnavailable)`,
            /// …), by name.
            #[error("dispatch error: {0}")]
            Other(String),
            /// The node refused the transaction before it reached a block (JSON-RPC error 1010).
            #[error("the node rejected the transaction: {0}")]
            InvalidTransaction(InvalidTransaction),
            /// The transaction pool refused it for another reason (1012 usurped, 1013 already
            /// imported, 1014 priority too low, …).
            #[error("the transaction pool refused the transaction ({code}): {message}")]
            PoolRejected {
                /// JSON-RPC error code.
                code: i32,
                /// The node's message and data.
                message: String,
            },
            /// The node's runtime changed the shape of calls or storage this client uses.
            #[error("the node's runtime differs from the one this client was built for:\n  {}", .0.join("\n  "))]
            ShapeMismatch(Vec<String>),
            /// Could not connect to the node.
            #[error("cannot connect to {url}: {reason}")]
            Connect {
                /// The endpoint.
                url: String,
                /// What failed.
                reason: String,
            },
            /// A JSON-RPC or transport error.
            #[error("RPC error: {0}")]
            Rpc(String),
            /// Something took longer than allowed.
            #[error("timed out after {after:?} waiting for {what}")]
            Timeout {
                /// What was awaited.
                what: String,
                /// The limit that passed.
                after: Duration,
            },
            /// The transaction was dropped or declared invalid while waiting for a block.
            #[error("transaction {status} while waiting for inclusion: {message}")]
            TransactionStatus {
                /// `invalid`, `dropped` or `error`.
                status: &'static str,
                /// The node's message.
                message: String,
            },
            /// A value read from chain did not decode as the metadata says it should.
            #[error("cannot decode {what}: {reason}")]
            Decode {
                /// What was decoded.
                what: String,
                /// Why it failed.
                reason: String,
            },
            /// A wallet problem (missing keyfile, wrong password, …).
            #[error(transparent)]
            Wallet(#[from] WalletError),
            /// A weight vector was rejected before anything was sent.
            #[error(transparent)]
            Weights(#[from] WeightsError),
            /// The hotkey is not registered on the subnet, so there is no uid to act for.
            #[error("hotkey {hotkey} is not registered on netuid {netuid}")]
            NotRegistered {
                /// SS58 address of the hotkey.
                hotkey: String,
                /// The subnet.
                netuid: u16,
            },
            /// The subnet does not exist.
            #[error("netuid {0} does not exist")]
            NoSuchSubnet(u16),
            /// Saving or loading weight commits failed.
            #[error("commit store {path}: {reason}")]
            CommitStore {
                /// Where the store lives.
                path: String,
                /// What failed.
                reason: String,
            },
            /// Timelock encryption or decryption of a weight commit failed.
            #[error(transparent)]
            Timelock(#[from] crate::timelock::TimelockError),
            /// A caller-supplied argument is unusable.
            #[error("invalid argument: {0}")]
            InvalidArgument(String),
            /// Writing command output failed.
            #[error("cannot write output: {0}")]
            Output(#[source] std::io::Error),
        }

        impl ChainError {
            /// Maps a module error's metadata names to a variant.
            pub fn from_module(pallet: &str, name: &str) -> Self {
                match name {
                    $( stringify!($name) => ChainError::$name, )*
                    _ => ChainError::Module { pallet: pallet.to_owned(), name: name.to_owned() },
                }
            }

            /// The metadata name of a dispatch error, when this is one.
            pub fn dispatch_error_name(&self) -> Option<&str> {
                match self {
                    $( ChainError::$name => Some(stringify!($name)), )*
                    ChainError::Module { name, .. } => Some(name),
                    ChainError::Other(name) => Some(name),
                    _ => None,
                }
            }
        }
    };
}

named_dispatch_errors! {
    /// `set_weights` came before `WeightsSetRateLimit` blocks had passed since the last update.
    SettingWeightsTooFast => "weights were set again before the subnet's rate limit passed",
    /// The version key is below the subnet's `WeightsVersionKey`.
    IncorrectWeightVersionKey => "the weights version key is below the subnet's WeightsVersionKey",
    /// `burned_register` for a hotkey that already has a uid on the subnet.
    HotKeyAlreadyRegisteredInSubNet => "the hotkey is already registered on this subnet",
    /// The coldkey cannot pay the burn or the stake.
    NotEnoughBalanceToStake => "the coldkey's free balance is too low",
    /// The hotkey has no uid on the subnet.
    HotKeyNotRegisteredInSubNet => "the hotkey is not registered on this subnet",
    /// The hotkey has no uid on the subnet (serving).
    HotKeyNotRegisteredInNetwork => "the hotkey is not registered on this subnet",
    /// The hotkey belongs to another coldkey.
    NonAssociatedColdKey => "the hotkey is owned by a different coldkey",
    /// Stake is below `StakeThreshold`.
    NotEnoughStakeToSetWeights => "the hotkey's stake is below the subnet's threshold",
    /// The hotkey has no validator permit (permits are handed out by stake at each epoch).
    NeuronNoValidatorPermit => "the hotkey has no validator permit",
    /// `set_weights` on a subnet with commit-reveal on.
    CommitRevealEnabled => "commit-reveal is on for this subnet; commit and reveal instead",
    /// `commit_weights`/`reveal_weights` on a subnet with commit-reveal off.
    CommitRevealDisabled => "commit-reveal is off for this subnet; use set_weights",
    /// A reveal with no matching commit.
    NoWeightsCommitFound => "no weight commit found for this hotkey",
    /// The revealed values do not hash to a stored commit.
    InvalidRevealCommitHashNotMatch => "the revealed weights do not match the commit hash",
    /// The reveal epoch has not started.
    RevealTooEarly => "the reveal window has not opened yet",
    /// The reveal window has passed.
    ExpiredWeightCommit => "the reveal window for this commit has passed",
    /// A commit came before `WeightsSetRateLimit` blocks had passed.
    CommittingWeightsTooFast => "weights were committed again before the subnet's rate limit passed",
    /// Too many commits are waiting for their reveal.
    TooManyUnrevealedCommits => "too many unrevealed weight commits",
    /// The subnet's registrations for this block are used up.
    TooManyRegistrationsThisBlock => "the subnet's registrations for this block are used up",
    /// Registration is switched off for the subnet.
    SubNetRegistrationDisabled => "registration is disabled on this subnet",
    /// The subnet does not exist.
    SubnetNotExists => "the subnet does not exist",
    /// `serve_axon` again before `ServingRateLimit` blocks passed.
    ServingRateLimitExceeded => "the axon was served again too soon",
    /// An axon IP that cannot be served.
    InvalidIpAddress => "the axon IP address is invalid",
    /// An axon IP type other than 4 or 6.
    InvalidIpType => "the axon IP type must be 4 or 6",
    /// Port 0.
    InvalidPort => "the axon port is invalid",
    /// Fewer weights than `MinAllowedWeights`.
    WeightVecLengthIsLow => "fewer weights than the subnet's MinAllowedWeights",
    /// A uid appears twice.
    DuplicateUids => "a uid appears more than once",
    /// A uid is not on the subnet.
    UidVecContainInvalidOne => "a uid is not on the subnet",
    /// A weight is above `MaxWeightsLimit`.
    MaxWeightExceeded => "a weight is above the subnet's MaxWeightsLimit",
    /// More uids than the subnet has.
    UidsLengthExceedUidsInSubNet => "more uids than the subnet has neurons",
    /// The stake amount is below the minimum.
    AmountTooLow => "the amount is below the minimum stake",
    /// The hotkey has no owner yet.
    HotKeyAccountNotExists => "the hotkey account does not exist",
    /// Only the subnet owner may do this.
    NotSubnetOwner => "only the subnet owner may do this",
    /// The subnet's emission has not been started.
    SubtokenDisabled => "the subnet has not been started (start_call)",
    /// `start_call` already ran for the subnet.
    FirstEmissionBlockNumberAlreadySet => "the subnet was already started",
    /// `start_call` before the waiting period.
    NeedWaitingMoreBlocksToStarCall => "start_call is not allowed yet",
    /// The coldkey cannot afford the subnet lock cost.
    CannotAffordLockCost => "the coldkey cannot afford the subnet lock cost",
    /// `Sudo.sudo` from an account that is not the sudo key.
    RequireSudo => "the signer is not the sudo key",
    /// Balances: the account cannot pay.
    InsufficientBalance => "the account's balance is too low",
    /// Balances: the transfer would leave less than the existential deposit.
    ExistentialDeposit => "the transfer would leave less than the existential deposit",
    /// Balances: keep-alive transfer would kill the sender.
    Expendability => "the transfer would reap the sending account",
    /// The call needs another origin (root, the subnet owner, …).
    BadOrigin => "the signer may not make this call",
}

impl ChainError {
    pub(crate) fn rpc(e: impl std::fmt::Display) -> Self {
        ChainError::Rpc(e.to_string())
    }

    pub(crate) fn decode(what: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        ChainError::Decode {
            what: what.into(),
            reason: reason.to_string(),
        }
    }

    /// True for dispatch errors (the transaction reached a block and failed there).
    pub fn is_dispatch_error(&self) -> bool {
        self.dispatch_error_name().is_some()
    }
}

/// Why the node refused a transaction at submission (Substrate's `InvalidTransaction`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidTransaction {
    /// The nonce was already used ("Transaction is outdated").
    #[error("stale: the nonce was already used")]
    Stale,
    /// The nonce is in the future.
    #[error("future: the nonce is ahead of the account's")]
    Future,
    /// The signature does not verify.
    #[error("bad signature")]
    BadProof,
    /// The account cannot pay the fee.
    #[error("cannot pay the transaction fee")]
    Payment,
    /// The mortal era's birth block is unknown or too old.
    #[error("ancient birth block")]
    AncientBirthBlock,
    /// The block cannot hold it.
    #[error("would exhaust block resources")]
    ExhaustsResources,
    /// The call is not allowed in a transaction.
    #[error("call not expected")]
    Call,
    /// The bytes do not decode.
    #[error("could not be decoded")]
    Undecodable,
    /// A subtensor transaction-extension check (`SubtensorTransactionExtension`), by code.
    #[error("custom error {code}: {meaning}")]
    Custom {
        /// The `InvalidTransaction::Custom` code.
        code: u8,
        /// What subtensor means by it.
        meaning: &'static str,
    },
    /// Anything else, as the node worded it.
    #[error("{0}")]
    Other(String),
}

/// What subtensor's transaction extension means by each custom code
/// (subtensor `common/src/transaction_error.rs`). These are stable protocol codes, not metadata
/// error indices.
pub fn custom_code_meaning(code: u8) -> &'static str {
    match code {
        1 => "StakeAmountTooLow (NotEnoughStakeToSetWeights or AmountTooLow)",
        2 => "BalanceTooLow (NotEnoughBalanceToStake)",
        3 => "SubnetNotExists",
        6 => "RateLimitExceeded",
        10 => "HotKeyNotRegisteredInNetwork",
        11 => "InvalidIpAddress",
        12 => "ServingRateLimitExceeded",
        13 => "InvalidPort",
        15 => "InvalidRevealRound",
        16 => "NoWeightsCommitFound",
        17 => "RevealTooEarly",
        18 => "InputLengthsUnequal",
        19 => "UidNotFound (HotKeyNotRegisteredInSubNet)",
        255 => "BadRequest",
        _ => "a code this client does not know",
    }
}

impl InvalidTransaction {
    /// Parses the data of a 1010 error ("Transaction is outdated", "Custom error: 6", …).
    pub fn parse(data: &str) -> Self {
        let text = data.trim().trim_matches('"');
        let lower = text.to_ascii_lowercase();
        if let Some(rest) = lower.split("custom error:").nth(1) {
            let digits: String = rest
                .trim()
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            if let Ok(code) = digits.parse::<u8>() {
                return InvalidTransaction::Custom {
                    code,
                    meaning: custom_code_meaning(code),
                };
            }
        }
        if lower.contains("outdated") || lower.contains("stale") {
            InvalidTransaction::Stale
        } else if lower.contains("in the future") || lower.contains("future") {
            InvalidTransaction::Future
        } else if lower.contains("bad signature") || lower.contains("badproof") {
            InvalidTransaction::BadProof
        } else if lower.contains("inability to pay") || lower.contains("payment") {
            InvalidTransaction::Payment
        } else if lower.contains("ancient birth block") {
            InvalidTransaction::AncientBirthBlock
        } else if lower.contains("exhaust") {
            InvalidTransaction::ExhaustsResources
        } else if lower.contains("could not be decoded") || lower.contains("undecodable") {
            InvalidTransaction::Undecodable
        } else if lower.contains("call is not expected") {
            InvalidTransaction::Call
        } else {
            InvalidTransaction::Other(text.to_owned())
        }
    }
}

/// Maps a JSON-RPC error from submission to a typed error: 1010 is `InvalidTransaction`, the
/// other pool codes are `PoolRejected`.
pub(crate) fn from_rpc_error(err: &subxt::rpcs::Error) -> ChainError {
    match err {
        subxt::rpcs::Error::User(user) => {
            let data = user
                .data
                .as_ref()
                .map(|d| {
                    serde_json::from_str::<String>(d.get()).unwrap_or_else(|_| d.get().to_owned())
                })
                .unwrap_or_default();
            match user.code {
                1010 => {
                    ChainError::InvalidTransaction(InvalidTransaction::parse(if data.is_empty() {
                        &user.message
                    } else {
                        &data
                    }))
                }
                1011..=1019 => ChainError::PoolRejected {
                    code: user.code,
                    message: if data.is_empty() {
                        user.message.clone()
                    } else {
                        format!("{}: {data}", user.message)
                    },
                },
                _ => ChainError::Rpc(format!("{} ({}) {data}", user.message, user.code)),
            }
        }
        other => ChainError::rpc(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_variants_and_back() {
        let e = ChainError::from_module("SubtensorModule", "SettingWeightsTooFast");
        assert!(matches!(e, ChainError::SettingWeightsTooFast));
        assert_eq!(e.dispatch_error_name(), Some("SettingWeightsTooFast"));
        let e = ChainError::from_module("SubtensorModule", "SomethingNew");
        assert!(
            matches!(&e, ChainError::Module { pallet, name } if pallet == "SubtensorModule" && name == "SomethingNew")
        );
        assert!(e.is_dispatch_error());
        assert!(!ChainError::Rpc("x".into()).is_dispatch_error());
    }

    #[test]
    fn invalid_transaction_reasons_parse() {
        assert_eq!(
            InvalidTransaction::parse("Transaction is outdated"),
            InvalidTransaction::Stale
        );
        assert_eq!(
            InvalidTransaction::parse("\"Transaction has a bad signature\""),
            InvalidTransaction::BadProof
        );
        assert_eq!(
            InvalidTransaction::parse("Custom error: 6"),
            InvalidTransaction::Custom {
                code: 6,
                meaning: "RateLimitExceeded"
            }
        );
        assert_eq!(
            InvalidTransaction::parse("Transaction will be valid in the future"),
            InvalidTransaction::Future
        );
        assert!(matches!(
            InvalidTransaction::parse("something new"),
            InvalidTransaction::Other(_)
        ));
    }
}
