//! Decoding and checking signed transactions exactly as a subtensor node would: SCALE layout of a
//! v4 signed extrinsic, finney's transaction-extension list, and the signed payload's implicit
//! parts (spec and transaction version, genesis hash, mortality checkpoint, metadata hash).

use parity_scale_codec::{Compact, Decode, Encode, Input};
use scale_info::TypeInfo;
use sp_core::{Pair as _, ed25519, sr25519};

use super::call::RuntimeCall;
use super::types::{AccountId32, Balance, Era, H256, MultiAddress, MultiSignature, Nonce};

/// Why a transaction is refused at submission: Substrate's `InvalidTransaction`, which a node
/// reports as JSON-RPC error 1010.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidTransaction {
    #[error("Transaction call is not expected")]
    Call,
    #[error("Inability to pay some fees (e.g. account balance too low)")]
    Payment,
    #[error("Transaction will be valid in the future")]
    Future,
    #[error("Transaction is outdated")]
    Stale,
    #[error("Transaction has a bad signature")]
    BadProof,
    #[error("Transaction has an ancient birth block")]
    AncientBirthBlock,
    #[error("Transaction would exhaust the block limits")]
    ExhaustsResources,
    #[error("Custom error: {0}")]
    Custom(u8),
    #[error("Transaction could not be decoded")]
    Undecodable,
}

/// The data that travels in a signed extrinsic beside the call, in extension order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extra {
    pub era: Era,
    pub nonce: Nonce,
    pub tip: Balance,
    pub metadata_hash_mode: u8,
}

impl Encode for Extra {
    fn encode_to<T: parity_scale_codec::Output + ?Sized>(&self, dest: &mut T) {
        self.era.encode_to(dest);
        Compact(self.nonce).encode_to(dest);
        Compact(self.tip).encode_to(dest);
        self.metadata_hash_mode.encode_to(dest);
    }
}

impl Decode for Extra {
    fn decode<I: Input>(input: &mut I) -> Result<Self, parity_scale_codec::Error> {
        let era = Era::decode(input)?;
        let nonce = Compact::<Nonce>::decode(input)?.0;
        let tip = Compact::<Balance>::decode(input)?.0;
        let metadata_hash_mode = u8::decode(input)?;
        if metadata_hash_mode > 1 {
            return Err("invalid CheckMetadataHash mode".into());
        }
        Ok(Extra {
            era,
            nonce,
            tip,
            metadata_hash_mode,
        })
    }
}

/// A decoded signed extrinsic whose signature has not been checked yet.
#[derive(Clone, Debug)]
pub struct SignedExtrinsic {
    pub signer: AccountId32,
    pub signature: MultiSignature,
    pub extra: Extra,
    pub call: RuntimeCall,
    /// The call exactly as it was encoded by the sender (what the signature covers).
    pub call_bytes: Vec<u8>,
}

pub struct ChainContext<'a> {
    pub genesis_hash: H256,
    pub spec_version: u32,
    pub transaction_version: u32,
    /// The number of the block the transaction would go into.
    pub next_block: u64,
    pub block_hash: &'a dyn Fn(u64) -> Option<H256>,
}

const SIGNED_V4: u8 = 0b1000_0000 | 4;

/// Decodes an extrinsic as it travels (with its compact length prefix).
pub fn decode(bytes: &[u8]) -> Result<SignedExtrinsic, InvalidTransaction> {
    let input = &mut &bytes[..];
    let len = Compact::<u32>::decode(input)
        .map_err(|_| InvalidTransaction::Undecodable)?
        .0;
    if len as usize != input.len() {
        return Err(InvalidTransaction::Undecodable);
    }
    let version = input
        .read_byte()
        .map_err(|_| InvalidTransaction::Undecodable)?;
    if version != SIGNED_V4 {
        // Unsigned extrinsics and v5 general transactions carry no calls the localnet accepts.
        return Err(InvalidTransaction::Call);
    }
    let address = MultiAddress::decode(input).map_err(|_| InvalidTransaction::Undecodable)?;
    let signer = address.account().ok_or(InvalidTransaction::BadProof)?;
    let signature = MultiSignature::decode(input).map_err(|_| InvalidTransaction::Undecodable)?;
    let extra = Extra::decode(input).map_err(|_| InvalidTransaction::Undecodable)?;
    let call_bytes = input.to_vec();
    let call = RuntimeCall::decode(&mut &call_bytes[..]).map_err(|_| InvalidTransaction::Call)?;
    if call.encoded_size() != call_bytes.len() {
        return Err(InvalidTransaction::Undecodable);
    }
    Ok(SignedExtrinsic {
        signer,
        signature,
        extra,
        call,
        call_bytes,
    })
}

impl SignedExtrinsic {
    /// Checks mortality and the signature over the payload the sender must have signed.
    pub fn verify(&self, ctx: &ChainContext<'_>) -> Result<(), InvalidTransaction> {
        if self.signer == AccountId32::new([0; 32]) {
            // CheckNonZeroSender
            return Err(InvalidTransaction::BadProof);
        }
        let birth = self.extra.era.birth(ctx.next_block);
        if ctx.next_block >= self.extra.era.death(ctx.next_block) {
            return Err(InvalidTransaction::Stale);
        }
        let checkpoint = match self.extra.era {
            Era::Immortal => ctx.genesis_hash,
            Era::Mortal { .. } => {
                (ctx.block_hash)(birth).ok_or(InvalidTransaction::AncientBirthBlock)?
            }
        };
        if self.extra.metadata_hash_mode != 0 {
            // The localnet does not commit to a metadata hash, so no signature made with one can match.
            return Err(InvalidTransaction::BadProof);
        }
        let mut payload = self.call_bytes.clone();
        self.extra.encode_to(&mut payload);
        ctx.spec_version.encode_to(&mut payload);
        ctx.transaction_version.encode_to(&mut payload);
        ctx.genesis_hash.encode_to(&mut payload);
        checkpoint.encode_to(&mut payload);
        Option::<[u8; 32]>::None.encode_to(&mut payload);
        let message: Vec<u8> = if payload.len() > 256 {
            sp_crypto_hashing::blake2_256(&payload).to_vec()
        } else {
            payload
        };
        let public: &[u8; 32] = self.signer.as_ref();
        let valid = match &self.signature {
            MultiSignature::Sr25519(sig) => sr25519::Pair::verify(
                &sr25519::Signature::from_raw(*sig),
                &message,
                &sr25519::Public::from_raw(*public),
            ),
            MultiSignature::Ed25519(sig) => ed25519::Pair::verify(
                &ed25519::Signature::from_raw(*sig),
                &message,
                &ed25519::Public::from_raw(*public),
            ),
            MultiSignature::Ecdsa(_) => false,
        };
        if valid {
            Ok(())
        } else {
            Err(InvalidTransaction::BadProof)
        }
    }
}

/// Builds and signs an extrinsic. Used by the localnet's own tools and tests; real clients use subxt.
pub fn sign(
    pair: &sr25519::Pair,
    call: &RuntimeCall,
    nonce: Nonce,
    ctx: &ChainContext<'_>,
) -> Vec<u8> {
    let extra = Extra {
        era: Era::Immortal,
        nonce,
        tip: 0,
        metadata_hash_mode: 0,
    };
    let call_bytes = call.encode();
    let mut payload = call_bytes.clone();
    extra.encode_to(&mut payload);
    ctx.spec_version.encode_to(&mut payload);
    ctx.transaction_version.encode_to(&mut payload);
    ctx.genesis_hash.encode_to(&mut payload);
    ctx.genesis_hash.encode_to(&mut payload);
    Option::<[u8; 32]>::None.encode_to(&mut payload);
    let signature = if payload.len() > 256 {
        pair.sign(&sp_crypto_hashing::blake2_256(&payload))
    } else {
        pair.sign(&payload)
    };
    let mut body = vec![SIGNED_V4];
    MultiAddress::Id(AccountId32::new(pair.public().0)).encode_to(&mut body);
    MultiSignature::Sr25519(signature.0).encode_to(&mut body);
    extra.encode_to(&mut body);
    body.extend_from_slice(&call_bytes);
    let mut out = Compact(body.len() as u32).encode();
    out.extend_from_slice(&body);
    out
}

/// Types of finney's transaction extensions, for the metadata. Only their shape matters: the
/// encoding is done by [`Extra`].
pub mod extension_types {
    use super::*;

    #[derive(TypeInfo)]
    pub struct CheckNonZeroSender;
    #[derive(TypeInfo)]
    pub struct CheckSpecVersion;
    #[derive(TypeInfo)]
    pub struct CheckTxVersion;
    #[derive(TypeInfo)]
    pub struct CheckGenesis;
    #[derive(TypeInfo)]
    pub struct CheckMortality(pub Era);
    #[derive(TypeInfo)]
    pub struct CheckNonce(#[codec(compact)] pub Nonce);
    #[derive(TypeInfo)]
    pub struct CheckWeight;
    #[derive(TypeInfo)]
    pub struct ChargeTransactionPayment(#[codec(compact)] pub Balance);
    #[derive(TypeInfo)]
    pub struct SudoTransactionExtension;
    #[derive(TypeInfo)]
    pub struct CheckShieldedTxValidity;
    #[derive(TypeInfo)]
    pub struct SubtensorTransactionExtension;
    #[derive(TypeInfo)]
    pub struct DrandPriority;
    #[derive(TypeInfo)]
    pub struct CheckMetadataHash {
        pub mode: Mode,
    }
    #[derive(TypeInfo)]
    pub enum Mode {
        Disabled,
        Enabled,
    }
}
