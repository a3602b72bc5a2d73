//! Primitive runtime types shared by calls, events and storage. Their SCALE layout and type shape
//! follow finney's runtime; the fidelity test checks that claim against real metadata.

use parity_scale_codec::{Compact, Decode, Encode, Error as CodecError, Input, Output};
use scale_info::TypeInfo;

pub use sp_core::H256;
pub use sp_core::crypto::AccountId32;

pub type Balance = u64;
pub type BlockNumber = u32;
pub type Nonce = u32;

/// `sp_runtime::MultiAddress<AccountId32, ()>`: only the `Id` form names an account here.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum MultiAddress {
    Id(AccountId32),
    Index(Compact<()>),
    Raw(Vec<u8>),
    Address32([u8; 32]),
    Address20([u8; 20]),
}

impl MultiAddress {
    pub fn account(&self) -> Option<AccountId32> {
        match self {
            MultiAddress::Id(id) => Some(id.clone()),
            MultiAddress::Address32(raw) => Some(AccountId32::new(*raw)),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum MultiSignature {
    Ed25519([u8; 64]),
    Sr25519([u8; 64]),
    Ecdsa([u8; 65]),
}

/// Transaction mortality, encoded as Substrate's `Era`: one zero byte for immortal, two bytes
/// (period exponent and quantised phase) otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Era {
    Immortal,
    Mortal { period: u64, phase: u64 },
}

impl Era {
    /// The block number the transaction's era started at, given the current block.
    pub fn birth(&self, current: u64) -> u64 {
        match *self {
            Era::Immortal => 0,
            Era::Mortal { period, phase } => {
                let base = current.saturating_sub(phase) / period * period;
                base + phase
            }
        }
    }

    /// The first block at which the transaction is no longer valid.
    pub fn death(&self, current: u64) -> u64 {
        match *self {
            Era::Immortal => u64::MAX,
            Era::Mortal { period, .. } => self.birth(current) + period,
        }
    }
}

impl Encode for Era {
    fn encode_to<T: Output + ?Sized>(&self, dest: &mut T) {
        match *self {
            Era::Immortal => dest.push_byte(0),
            Era::Mortal { period, phase } => {
                let quantize_factor = (period >> 12).max(1);
                let encoded = (period.trailing_zeros().saturating_sub(1).clamp(1, 15)) as u16
                    | (((phase / quantize_factor) << 4) as u16);
                encoded.encode_to(dest);
            }
        }
    }
}

impl Decode for Era {
    fn decode<I: Input>(input: &mut I) -> Result<Self, CodecError> {
        let first = input.read_byte()?;
        if first == 0 {
            return Ok(Era::Immortal);
        }
        let encoded = first as u64 + ((input.read_byte()? as u64) << 8);
        let period = 2 << (encoded % (1 << 4));
        let quantize_factor = (period >> 12).max(1);
        let phase = (encoded >> 4) * quantize_factor;
        if period >= 4 && phase < period {
            Ok(Era::Mortal { period, phase })
        } else {
            Err("invalid mortal era".into())
        }
    }
}

impl TypeInfo for Era {
    type Identity = Self;
    fn type_info() -> scale_info::Type {
        use scale_info::build::{Fields, Variants};
        let mut variants = Variants::new().variant("Immortal", |v| v.index(0));
        for i in 1u8..=255 {
            variants = variants.variant(format!("Mortal{i}").leak() as &'static str, |v| {
                v.index(i).fields(Fields::unnamed().field(|f| f.ty::<u8>()))
            });
        }
        scale_info::Type::builder()
            .path(scale_info::Path::new("Era", "sp_runtime::generic::era"))
            .variant(variants)
    }
}

/// Substrate block header; its blake2-256 hash is the block hash.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct Header {
    pub parent_hash: H256,
    #[codec(compact)]
    pub number: BlockNumber,
    pub state_root: H256,
    pub extrinsics_root: H256,
    pub digest: Digest,
}

impl Header {
    pub fn hash(&self) -> H256 {
        H256(sp_crypto_hashing::blake2_256(&self.encode()))
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct Digest {
    pub logs: Vec<DigestItem>,
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub enum DigestItem {
    #[codec(index = 6)]
    PreRuntime([u8; 4], Vec<u8>),
    #[codec(index = 4)]
    Consensus([u8; 4], Vec<u8>),
    #[codec(index = 5)]
    Seal([u8; 4], Vec<u8>),
    #[codec(index = 0)]
    Other(Vec<u8>),
    #[codec(index = 8)]
    RuntimeEnvironmentUpdated,
}

/// `frame_system::AccountInfo` with `pallet_balances::AccountData<u64>`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct AccountInfo {
    pub nonce: Nonce,
    pub consumers: u32,
    pub providers: u32,
    pub sufficients: u32,
    pub data: AccountData,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct AccountData {
    pub free: Balance,
    pub reserved: Balance,
    pub frozen: Balance,
    pub flags: ExtraFlags,
}

/// Balances' account flags; the top bit marks the "new logic" accounts every modern chain has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct ExtraFlags(pub u128);

impl Default for ExtraFlags {
    fn default() -> Self {
        ExtraFlags(1u128 << 127)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct AxonInfo {
    pub block: u64,
    pub version: u32,
    pub ip: u128,
    pub port: u16,
    pub ip_type: u8,
    pub protocol: u8,
    pub placeholder1: u8,
    pub placeholder2: u8,
}

/// Subtensor stores share balances as `substrate_fixed::FixedU128` (U64F64), SCALE as raw bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct FixedU128 {
    pub bits: u128,
}

impl FixedU128 {
    pub fn from_int(v: u64) -> Self {
        Self {
            bits: (v as u128) << 64,
        }
    }
}

/// `Cow` as runtime metadata shows it: a transparent wrapper, encoded as its content.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct Cow<T>(pub T);

/// `bounded_collections::BoundedVec<T, S>` as finney's metadata declares it: a vector whose bound
/// is a type parameter the metadata omits. The bound is checked where the value is used.
#[derive(Clone, Debug, Default, PartialEq, Eq, Encode, Decode)]
pub struct BoundedVec<T>(pub Vec<T>);

impl<T: TypeInfo + 'static> TypeInfo for BoundedVec<T> {
    type Identity = Self;

    fn type_info() -> scale_info::Type {
        scale_info::Type::builder()
            .path(scale_info::Path::from_segments_unchecked([
                "bounded_collections",
                "bounded_vec",
                "BoundedVec",
            ]))
            .type_params(vec![
                scale_info::TypeParameter::new("T", Some(scale_info::meta_type::<T>())),
                scale_info::TypeParameter::new("S", None),
            ])
            .composite(
                scale_info::build::Fields::unnamed()
                    .field(|f| f.ty::<Vec<T>>().type_name("Vec<T>")),
            )
    }
}

/// One drand round as the Drand pallet stores it (`pallet_drand::types::Pulse`).
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct Pulse {
    pub round: u64,
    /// `sha256(signature)`, as drand derives a round's randomness.
    pub randomness: BoundedVec<u8>,
    /// The beacon's signature on the round: the key to every ciphertext timelocked to it.
    pub signature: BoundedVec<u8>,
}

/// Which beacon the Drand pallet follows (`pallet_drand::types::BeaconConfiguration`).
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct BeaconConfiguration {
    pub public_key: BoundedVec<u8>,
    /// Seconds between rounds.
    pub period: u32,
    /// Unix time of round 1, in seconds.
    pub genesis_time: u32,
    pub hash: BoundedVec<u8>,
    pub group_hash: BoundedVec<u8>,
    pub scheme_id: BoundedVec<u8>,
    pub metadata: BeaconMetadata,
}

/// `pallet_drand::types::Metadata`.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct BeaconMetadata {
    pub beacon_id: BoundedVec<u8>,
}

impl BeaconConfiguration {
    /// Drand quicknet, the Drand pallet's default (what finney follows).
    pub fn quicknet() -> Self {
        let bytes = |h: &str| BoundedVec(hex::decode(h).unwrap_or_default());
        Self {
            public_key: bytes(iota_drand::QUICKNET_PUBLIC_KEY_HEX),
            period: 3,
            genesis_time: 1_692_803_367,
            hash: bytes(iota_drand::QUICKNET_CHAIN_HASH_HEX),
            group_hash: bytes("f477d5c89f21a17c863a7f937c6a6d15859414d2be09cd448d4279af331c5d3e"),
            scheme_id: BoundedVec(b"bls-unchained-g1-rfc9380".to_vec()),
            metadata: BeaconMetadata {
                beacon_id: BoundedVec(b"quicknet".to_vec()),
            },
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, TypeInfo)]
pub struct RuntimeVersion {
    pub spec_name: Cow<String>,
    pub impl_name: Cow<String>,
    pub authoring_version: u32,
    pub spec_version: u32,
    pub impl_version: u32,
    pub apis: Cow<Vec<([u8; 8], u32)>>,
    pub transaction_version: u32,
    pub system_version: u8,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn era_round_trips_like_substrate() {
        // 64-block mortality born at block 1000, the subxt default shape.
        let era = Era::Mortal {
            period: 64,
            phase: 1000 % 64,
        };
        let bytes = era.encode();
        assert_eq!(bytes.len(), 2);
        assert_eq!(Era::decode(&mut &bytes[..]).unwrap(), era);
        assert_eq!(era.birth(1010), 1000);
        assert_eq!(era.death(1010), 1064);
        assert_eq!(Era::decode(&mut &[0u8][..]).unwrap(), Era::Immortal);
    }

    #[test]
    fn header_hash_is_blake2_of_substrates_layout() {
        let h = Header {
            parent_hash: H256::repeat_byte(1),
            number: 300,
            state_root: H256::repeat_byte(2),
            extrinsics_root: H256::repeat_byte(3),
            digest: Digest {
                logs: vec![DigestItem::PreRuntime(*b"aura", vec![9, 9])],
            },
        };
        // Substrate's layout written out by hand: the number is compact (300 -> 0xb1 0x04), the
        // digest a vector of enum items (PreRuntime = 6, engine id, bytes).
        let mut expected = vec![1u8; 32];
        expected.extend([0xb1, 0x04]);
        expected.extend([2u8; 32]);
        expected.extend([3u8; 32]);
        expected.extend([4, 6, b'a', b'u', b'r', b'a', 8, 9, 9]);
        assert_eq!(h.encode(), expected);
        assert_eq!(h.hash(), H256(sp_crypto_hashing::blake2_256(&expected)));
    }
}
