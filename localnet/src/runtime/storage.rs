//! Storage items, declared once: the same declaration gives typed access for the pallets and the
//! metadata entry clients read. Values live SCALE-encoded under the real keys
//! (`twox128(pallet) ++ twox128(item) ++ hashed keys`), so reads by key and prefix iteration
//! behave as on a subtensor node.

use frame_metadata::v16::{
    ItemDeprecationInfo, StorageEntryMetadata, StorageEntryModifier, StorageEntryType,
    StorageHasher,
};
use parity_scale_codec::{Decode, Encode};
use scale_info::meta_type;

use super::types::{
    AccountId32, AccountInfo, AxonInfo, BeaconConfiguration, BoundedVec, FixedU128, H256, Pulse,
};
use crate::state::State;

/// How a storage key part is hashed into the final key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hasher {
    Identity,
    Blake2_128Concat,
    Twox64Concat,
}

impl Hasher {
    pub fn hash_into(self, encoded: &[u8], out: &mut Vec<u8>) {
        match self {
            Hasher::Identity => {}
            Hasher::Blake2_128Concat => {
                out.extend_from_slice(&sp_crypto_hashing::blake2_128(encoded))
            }
            Hasher::Twox64Concat => out.extend_from_slice(&sp_crypto_hashing::twox_64(encoded)),
        }
        out.extend_from_slice(encoded);
    }

    pub fn metadata(self) -> StorageHasher {
        match self {
            Hasher::Identity => StorageHasher::Identity,
            Hasher::Blake2_128Concat => StorageHasher::Blake2_128Concat,
            Hasher::Twox64Concat => StorageHasher::Twox64Concat,
        }
    }
}

pub fn item_prefix(pallet: &str, item: &str) -> Vec<u8> {
    let mut key = sp_crypto_hashing::twox_128(pallet.as_bytes()).to_vec();
    key.extend_from_slice(&sp_crypto_hashing::twox_128(item.as_bytes()));
    key
}

/// Decodes a stored value. The localnet wrote every value itself, so a failure means a bug;
/// it is logged and the query falls back to the item's default instead of taking the chain down.
fn decode_stored<V: Decode>(item: &str, bytes: &[u8]) -> Option<V> {
    match V::decode(&mut &bytes[..]) {
        Ok(v) => Some(v),
        Err(err) => {
            tracing::error!(item, %err, "stored value does not decode");
            None
        }
    }
}

macro_rules! storage_items {
    (
        pallet = $pallet:literal;
        $( $name:ident : $query:ident [ $( $hasher:ident $key:ident : $kty:ty ),* ] => $vty:ty $( = $default:expr )? ; )*
    ) => {
        $(
            pub struct $name;

            impl $name {
                pub fn prefix() -> Vec<u8> {
                    $crate::runtime::storage::item_prefix($pallet, stringify!($name))
                }

                #[allow(clippy::too_many_arguments)]
                pub fn key($( $key: &$kty ),*) -> Vec<u8> {
                    #[allow(unused_mut)]
                    let mut key = Self::prefix();
                    $( $crate::runtime::storage::Hasher::$hasher.hash_into(&$key.encode(), &mut key); )*
                    key
                }

                pub fn insert(state: &mut State, $( $key: &$kty, )* value: &$vty) {
                    state.put(Self::key($( $key ),*), value.encode());
                }

                pub fn remove(state: &mut State, $( $key: &$kty ),*) {
                    state.delete(&Self::key($( $key ),*));
                }

                storage_items!(@get $query $name [ $( $key : $kty ),* ] $vty $( = $default )?);

                pub fn entry() -> StorageEntryMetadata {
                    StorageEntryMetadata {
                        name: stringify!($name),
                        modifier: storage_items!(@modifier $query),
                        ty: storage_items!(@ty [ $( $hasher $kty ),* ] $vty),
                        default: storage_items!(@default $query $vty $( = $default )?),
                        docs: vec![],
                        deprecation_info: ItemDeprecationInfo::NotDeprecated,
                    }
                }
            }
        )*

        /// Every storage entry of the pallet, for the metadata.
        pub fn entries() -> Vec<StorageEntryMetadata> {
            vec![$( $name::entry() ),*]
        }
    };

    (@get value $name:ident [ $( $key:ident : $kty:ty ),* ] $vty:ty $( = $default:expr )?) => {
        pub fn default_value() -> $vty {
            storage_items!(@default_expr $vty $( = $default )?)
        }

        pub fn get(state: &State, $( $key: &$kty ),*) -> $vty {
            state
                .get(&Self::key($( $key ),*))
                .and_then(|bytes| $crate::runtime::storage::decode_stored(stringify!($name), bytes))
                .unwrap_or_else(Self::default_value)
        }

        #[allow(clippy::too_many_arguments)]
        pub fn mutate<R>(state: &mut State, $( $key: &$kty, )* f: impl FnOnce(&mut $vty) -> R) -> R {
            let mut value = Self::get(state, $( $key ),*);
            let out = f(&mut value);
            Self::insert(state, $( $key, )* &value);
            out
        }
    };
    (@get option $name:ident [ $( $key:ident : $kty:ty ),* ] $vty:ty) => {
        pub fn get(state: &State, $( $key: &$kty ),*) -> Option<$vty> {
            state
                .get(&Self::key($( $key ),*))
                .and_then(|bytes| $crate::runtime::storage::decode_stored(stringify!($name), bytes))
        }

        pub fn contains(state: &State, $( $key: &$kty ),*) -> bool {
            state.get(&Self::key($( $key ),*)).is_some()
        }
    };

    (@modifier value) => { StorageEntryModifier::Default };
    (@modifier option) => { StorageEntryModifier::Optional };

    (@default option $vty:ty) => { vec![0u8] };
    (@default value $vty:ty $( = $default:expr )?) => {
        { let v: $vty = storage_items!(@default_expr $vty $( = $default )?); v.encode() }
    };
    (@default_expr $vty:ty = $default:expr) => { $default };
    (@default_expr $vty:ty) => { <$vty as Default>::default() };

    (@ty [] $vty:ty) => { StorageEntryType::Plain(meta_type::<$vty>()) };
    (@ty [ $hasher:ident $kty:ty ] $vty:ty) => {
        StorageEntryType::Map {
            hashers: vec![$crate::runtime::storage::Hasher::$hasher.metadata()],
            key: meta_type::<$kty>(),
            value: meta_type::<$vty>(),
        }
    };
    (@ty [ $( $hasher:ident $kty:ty ),+ ] $vty:ty) => {
        StorageEntryType::Map {
            hashers: vec![$( $crate::runtime::storage::Hasher::$hasher.metadata() ),+],
            key: meta_type::<( $( $kty ),+ )>(),
            value: meta_type::<$vty>(),
        }
    };
}

const TAO: u64 = 1_000_000_000;

pub mod system {
    use super::*;
    use crate::runtime::event::EventRecord;

    storage_items! {
        pallet = "System";
        Account: value [Blake2_128Concat who: AccountId32] => AccountInfo;
        BlockHash: value [Twox64Concat number: u32] => H256;
        Number: value [] => u32;
        ParentHash: value [] => H256;
        Events: value [] => Vec<EventRecord>;
        EventCount: value [] => u32;
    }
}

pub mod balances {
    use super::*;

    storage_items! {
        pallet = "Balances";
        TotalIssuance: value [] => u64;
    }
}

pub mod sudo {
    use super::*;

    storage_items! {
        pallet = "Sudo";
        Key: option [] => AccountId32;
    }
}

pub mod timestamp {
    use super::*;

    storage_items! {
        pallet = "Timestamp";
        Now: value [] => u64;
    }
}

pub mod drand {
    use super::*;

    storage_items! {
        pallet = "Drand";
        BeaconConfig: value [] => BeaconConfiguration = BeaconConfiguration::quicknet();
        Pulses: option [Blake2_128Concat round: u64] => Pulse;
        LastStoredRound: value [] => u64;
        OldestStoredRound: value [] => u64;
    }
}

pub mod subtensor {
    use super::*;

    fn zero_account() -> AccountId32 {
        AccountId32::new([0; 32])
    }

    storage_items! {
        pallet = "SubtensorModule";
        TotalNetworks: value [] => u16;
        NetworksAdded: value [Identity netuid: u16] => bool;
        NetworkRegisteredAt: value [Identity netuid: u16] => u64;
        NetworkRegistrationAllowed: value [Identity netuid: u16] => bool = true;
        NetworkMinLockCost: value [] => u64 = 1_000 * TAO;
        NetworkLastLockCost: value [] => u64 = 1_000 * TAO;
        NetworkRateLimit: value [] => u64 = 7_200;
        SubnetLocked: value [Identity netuid: u16] => u64;
        SubnetOwner: value [Identity netuid: u16] => AccountId32 = zero_account();
        SubnetOwnerHotkey: value [Identity netuid: u16] => AccountId32 = zero_account();
        SubnetMechanism: value [Identity netuid: u16] => u16;
        TokenSymbol: value [Identity netuid: u16] => Vec<u8> = "\u{1D70F}".as_bytes().to_vec();
        MechanismCountCurrent: value [Twox64Concat netuid: u16] => u8 = 1;
        FirstEmissionBlockNumber: option [Identity netuid: u16] => u64;
        SubtokenEnabled: value [Identity netuid: u16] => bool;
        SubnetworkN: value [Identity netuid: u16] => u16;
        Tempo: value [Identity netuid: u16] => u16 = 360;
        BlocksSinceLastStep: value [Identity netuid: u16] => u64;
        LastMechansimStepBlock: value [Identity netuid: u16] => u64;
        PendingServerEmission: value [Identity netuid: u16] => u64;
        PendingValidatorEmission: value [Identity netuid: u16] => u64;
        PendingOwnerCut: value [Identity netuid: u16] => u64;
        SubnetTAO: value [Identity netuid: u16] => u64;
        SubnetAlphaIn: value [Identity netuid: u16] => u64;
        SubnetAlphaOut: value [Identity netuid: u16] => u64;
        Uids: option [Identity netuid: u16, Blake2_128Concat hotkey: AccountId32] => u16;
        Keys: value [Identity netuid: u16, Identity uid: u16] => AccountId32 = zero_account();
        BlockAtRegistration: value [Identity netuid: u16, Identity uid: u16] => u64;
        Axons: option [Identity netuid: u16, Blake2_128Concat hotkey: AccountId32] => AxonInfo;
        Owner: value [Blake2_128Concat hotkey: AccountId32] => AccountId32 = zero_account();
        OwnedHotkeys: value [Blake2_128Concat coldkey: AccountId32] => Vec<AccountId32>;
        StakingHotkeys: value [Blake2_128Concat coldkey: AccountId32] => Vec<AccountId32>;
        Delegates: value [Blake2_128Concat hotkey: AccountId32] => u16 = 11_796;
        IsNetworkMember: value [Blake2_128Concat hotkey: AccountId32, Identity netuid: u16] => bool;
        TotalHotkeyAlpha: value [Blake2_128Concat hotkey: AccountId32, Identity netuid: u16] => u64;
        TotalHotkeyShares: value [Blake2_128Concat hotkey: AccountId32, Identity netuid: u16] => FixedU128;
        Alpha: value [Blake2_128Concat hotkey: AccountId32, Blake2_128Concat coldkey: AccountId32, Identity netuid: u16] => FixedU128;
        AlphaDividendsPerSubnet: value [Identity netuid: u16, Blake2_128Concat hotkey: AccountId32] => u64;
        TotalStake: value [] => u64;
        StakeThreshold: value [] => u64;
        Burn: value [Identity netuid: u16] => u64 = TAO / 10;
        MinBurn: value [Identity netuid: u16] => u64 = 500_000;
        MaxBurn: value [Identity netuid: u16] => u64 = 100 * TAO;
        RAORecycledForRegistration: value [Identity netuid: u16] => u64;
        RegistrationsThisBlock: value [Identity netuid: u16] => u16;
        MaxRegistrationsPerBlock: value [Identity netuid: u16] => u16 = 1;
        MaxAllowedUids: value [Identity netuid: u16] => u16 = 256;
        ImmunityPeriod: value [Identity netuid: u16] => u16 = 4_096;
        ActivityCutoff: value [Identity netuid: u16] => u16 = 5_000;
        Kappa: value [Identity netuid: u16] => u16 = 32_767;
        MaxWeightsLimit: value [Identity netuid: u16] => u16 = u16::MAX;
        MinAllowedWeights: value [Identity netuid: u16] => u16 = 1_024;
        MaxAllowedValidators: value [Identity netuid: u16] => u16 = 128;
        BondsMovingAverage: value [Identity netuid: u16] => u64 = 900_000;
        BondsPenalty: value [Identity netuid: u16] => u16 = u16::MAX;
        LiquidAlphaOn: value [Blake2_128Concat netuid: u16] => bool;
        Yuma3On: value [Blake2_128Concat netuid: u16] => bool;
        WeightsVersionKey: value [Identity netuid: u16] => u64;
        WeightsSetRateLimit: value [Identity netuid: u16] => u64 = 100;
        ServingRateLimit: value [Identity netuid: u16] => u64 = 50;
        TxRateLimit: value [] => u64 = 1_000;
        CommitRevealWeightsEnabled: value [Identity netuid: u16] => bool = true;
        RevealPeriodEpochs: value [Twox64Concat netuid: u16] => u64 = 1;
        WeightCommits: option [Twox64Concat netuid: u16, Twox64Concat who: AccountId32] => Vec<(H256, u64, u64, u64)>;
        CommitRevealWeightsVersion: value [] => u16 = 4;
        TimelockedWeightCommits: value [Twox64Concat netuid: u16, Twox64Concat epoch: u64] => Vec<(AccountId32, u64, BoundedVec<u8>, u64)>;
        LastUpdate: value [Identity netuid: u16] => Vec<u64>;
        Active: value [Identity netuid: u16] => Vec<bool>;
        Rank: value [Identity netuid: u16] => Vec<u16>;
        Trust: value [Identity netuid: u16] => Vec<u16>;
        Consensus: value [Identity netuid: u16] => Vec<u16>;
        Incentive: value [Identity netuid: u16] => Vec<u16>;
        Dividends: value [Identity netuid: u16] => Vec<u16>;
        Emission: value [Identity netuid: u16] => Vec<u64>;
        ValidatorTrust: value [Identity netuid: u16] => Vec<u16>;
        PruningScores: value [Identity netuid: u16] => Vec<u16>;
        ValidatorPermit: value [Identity netuid: u16] => Vec<bool>;
        StakeWeight: value [Identity netuid: u16] => Vec<u16>;
        Weights: value [Identity netuid: u16, Identity uid: u16] => Vec<(u16, u16)>;
        Bonds: value [Identity netuid: u16, Identity uid: u16] => Vec<(u16, u16)>;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_match_subtensor() {
        // Known twox128 prefixes of the live chain (reference values, not computed here).
        assert_eq!(
            hex::encode(&subtensor::Uids::prefix()[..16]),
            "658faa385070e074c85bf6b568cf0555"
        );
        assert_eq!(
            hex::encode(&subtensor::Uids::prefix()[16..]),
            "aab1b4e78e1ea8305462ee53b3686dc8"
        );
        assert_eq!(
            hex::encode(&subtensor::Tempo::prefix()[16..]),
            "7641384bb339f3758acddfd7053d3317"
        );
        assert_eq!(
            hex::encode(system::Events::key()),
            "26aa394eea5630e07c48ae0c9558cef780d41e5e16056765bc8461851072c9d7"
        );
    }

    #[test]
    fn typed_access_round_trips_with_defaults() {
        let mut state = State::default();
        assert_eq!(subtensor::Tempo::get(&state, &3), 360);
        subtensor::Tempo::insert(&mut state, &3, &10);
        assert_eq!(subtensor::Tempo::get(&state, &3), 10);
        let hot = AccountId32::new([7; 32]);
        assert_eq!(subtensor::Uids::get(&state, &1, &hot), None);
        subtensor::Uids::insert(&mut state, &1, &hot, &5);
        assert_eq!(subtensor::Uids::get(&state, &1, &hot), Some(5));
        // Identity-hashed netuid then blake2_128_concat hotkey.
        let key = subtensor::Uids::key(&1, &hot);
        assert_eq!(key.len(), 32 + 2 + 16 + 32);
    }
}
