//! Decoding and checking signed transactions exactly as a subtensor node would: SCALE layout of a
//! v4 signed extrinsic, finney's transaction-extension list, and the signed payload's implicit
//! parts (spec and transaction version, genesis hash, mortality checkpoint, metadata hash).

use parity_scale_codec::{Compact, Decode, DecodeLimit, Encode, Input};
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

/// Substrate's `MAX_EXTRINSIC_DEPTH`: how deeply calls may nest inside one extrinsic.
pub const MAX_CALL_DEPTH: u32 = 256;

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
    let signature = MultiSignature::decode(input).map_err(|_| InvalidTransaction::Undecodable)?;
    let extra = Extra::decode(input).map_err(|_| InvalidTransaction::Undecodable)?;
    let call_bytes = input.to_vec();
    // Nested calls (`Sudo.sudo` in `Sudo.sudo` …) decode recursively: bound the depth as
    // Substrate does, before any signature check, so hostile nesting is refused, not a crash.
    let call = RuntimeCall::decode_with_depth_limit(MAX_CALL_DEPTH, &mut &call_bytes[..])
        .map_err(|_| InvalidTransaction::Undecodable)?;
    if call.encoded_size() != call_bytes.len() {
        return Err(InvalidTransaction::Undecodable);
    }
    let signer = address.account().ok_or(InvalidTransaction::BadProof)?;
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
        // An old transaction's era maps to a later birth block than it was signed at, so its
        // checkpoint hash (and with it the signature) no longer matches: mortality needs no more.
        let birth = self.extra.era.birth(ctx.next_block);
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

/// Builds and signs an immortal extrinsic with an sr25519 key. Used by the localnet's own tools,
/// benchmarks and tests; real clients use subxt.
pub fn sign(
    pair: &sr25519::Pair,
    call: &RuntimeCall,
    nonce: Nonce,
    ctx: &ChainContext<'_>,
) -> Vec<u8> {
    let signer = AccountId32::new(pair.public().0);
    sign_with(
        signer,
        |msg| MultiSignature::Sr25519(pair.sign(msg).0),
        call,
        nonce,
        ctx,
    )
}

/// Builds an immortal extrinsic whose signature `sign` makes over the signed payload.
pub fn sign_with(
    signer: AccountId32,
    sign: impl Fn(&[u8]) -> MultiSignature,
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
        sign(&sp_crypto_hashing::blake2_256(&payload))
    } else {
        sign(&payload)
    };
    let mut body = vec![SIGNED_V4];
    MultiAddress::Id(signer).encode_to(&mut body);
    signature.encode_to(&mut body);
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

    /// The extensions' explicit data, nested as finney's runtime declares it.
    pub type TxExtension = (
        (
            CheckNonZeroSender,
            CheckSpecVersion,
            CheckTxVersion,
            CheckGenesis,
            CheckMortality,
            CheckNonce,
            CheckWeight,
        ),
        (
            ChargeTransactionPayment,
            SudoTransactionExtension,
            CheckShieldedTxValidity,
            SubtensorTransactionExtension,
            DrandPriority,
        ),
        CheckMetadataHash,
    );

    /// An extrinsic as runtime APIs take it: opaque bytes whose type parameters tell a client
    /// (V14 metadata has no other place for them) the address, call, signature and extensions.
    pub struct UncheckedExtrinsic;

    impl TypeInfo for UncheckedExtrinsic {
        type Identity = Self;
        fn type_info() -> scale_info::Type {
            use scale_info::{Path, TypeParameter, build::Fields, meta_type};
            scale_info::Type::builder()
                .path(Path::new(
                    "UncheckedExtrinsic",
                    "sp_runtime::generic::unchecked_extrinsic",
                ))
                .type_params(vec![
                    TypeParameter::new("Address", Some(meta_type::<MultiAddress>())),
                    TypeParameter::new("Call", Some(meta_type::<RuntimeCall>())),
                    TypeParameter::new("Signature", Some(meta_type::<MultiSignature>())),
                    TypeParameter::new("Extra", Some(meta_type::<TxExtension>())),
                ])
                .composite(Fields::unnamed().field(|f| f.ty::<Vec<u8>>()))
        }
    }

    /// `sp_runtime::transaction_validity::TransactionSource`.
    #[derive(TypeInfo, Encode, Decode, Clone, Copy, Debug, PartialEq, Eq)]
    pub enum TransactionSource {
        InBlock,
        Local,
        External,
    }

    #[derive(TypeInfo, Encode, Decode, Clone, Debug, PartialEq, Eq)]
    pub struct ValidTransaction {
        pub priority: u64,
        pub requires: Vec<Vec<u8>>,
        pub provides: Vec<Vec<u8>>,
        pub longevity: u64,
        pub propagate: bool,
    }

    /// `sp_runtime::transaction_validity::InvalidTransaction`, all of Substrate's variants.
    #[derive(TypeInfo, Encode, Decode, Clone, Copy, Debug, PartialEq, Eq)]
    pub enum InvalidTransactionKind {
        Call,
        Payment,
        Future,
        Stale,
        BadProof,
        AncientBirthBlock,
        ExhaustsResources,
        Custom(u8),
        BadMandatory,
        MandatoryValidation,
        BadSigner,
        IndeterminateImplicit,
        UnknownOrigin,
    }

    #[derive(TypeInfo, Encode, Decode, Clone, Copy, Debug, PartialEq, Eq)]
    pub enum UnknownTransaction {
        CannotLookup,
        NoUnsignedValidator,
        Custom(u8),
    }

    #[derive(TypeInfo, Encode, Decode, Clone, Copy, Debug, PartialEq, Eq)]
    pub enum TransactionValidityError {
        Invalid(InvalidTransactionKind),
        Unknown(UnknownTransaction),
    }

    pub type TransactionValidity = Result<ValidTransaction, TransactionValidityError>;

    impl From<super::InvalidTransaction> for TransactionValidityError {
        fn from(invalid: super::InvalidTransaction) -> Self {
            use super::InvalidTransaction as I;
            TransactionValidityError::Invalid(match invalid {
                I::Call | I::Undecodable => InvalidTransactionKind::Call,
                I::Payment => InvalidTransactionKind::Payment,
                I::Future => InvalidTransactionKind::Future,
                I::Stale => InvalidTransactionKind::Stale,
                I::BadProof => InvalidTransactionKind::BadProof,
                I::AncientBirthBlock => InvalidTransactionKind::AncientBirthBlock,
                I::ExhaustsResources => InvalidTransactionKind::ExhaustsResources,
                I::Custom(code) => InvalidTransactionKind::Custom(code),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::call::SystemCall;

    fn ctx(next_block: u64) -> (H256, u64) {
        (H256::repeat_byte(7), next_block)
    }

    fn check(bytes: &[u8], next_block: u64) -> Result<(), InvalidTransaction> {
        let (genesis_hash, next_block) = ctx(next_block);
        let lookup = |n: u64| (n <= next_block).then(|| H256::repeat_byte(n as u8));
        let ctx = ChainContext {
            genesis_hash,
            spec_version: 393,
            transaction_version: 1,
            next_block,
            block_hash: &lookup,
        };
        decode(bytes)?.verify(&ctx)
    }

    fn remark() -> RuntimeCall {
        RuntimeCall::System(SystemCall::remark {
            remark: vec![1, 2, 3],
        })
    }

    #[test]
    fn ed25519_and_sr25519_signatures_verify_and_forgeries_do_not() {
        let lookup = |_: u64| None;
        let c = ChainContext {
            genesis_hash: H256::repeat_byte(7),
            spec_version: 393,
            transaction_version: 1,
            next_block: 5,
            block_hash: &lookup,
        };
        let ed = ed25519::Pair::from_seed(&[3; 32]);
        let ed_signed = sign_with(
            AccountId32::new(ed.public().0),
            |m| MultiSignature::Ed25519(ed.sign(m).0),
            &remark(),
            0,
            &c,
        );
        assert_eq!(check(&ed_signed, 5), Ok(()));
        let sr = sr25519::Pair::from_seed(&[4; 32]);
        let sr_signed = sign(&sr, &remark(), 0, &c);
        assert_eq!(check(&sr_signed, 5), Ok(()));

        // A signature over another spec version (a transaction built for another runtime) fails.
        let other = ChainContext {
            spec_version: 392,
            ..c
        };
        assert_eq!(
            check(&sign(&sr, &remark(), 0, &other), 5),
            Err(InvalidTransaction::BadProof)
        );
        let mut tampered = sr_signed.clone();
        let last = tampered.len() - 1;
        tampered[last] ^= 1;
        assert!(check(&tampered, 5).is_err());
        assert_eq!(
            check(&sr_signed[..sr_signed.len() - 1], 5),
            Err(InvalidTransaction::Undecodable)
        );
    }

    #[test]
    fn mortal_transactions_expire() {
        let era = Era::Mortal {
            period: 8,
            phase: 3,
        };
        assert_eq!(era.birth(5), 3);
        assert_eq!(era.death(5), 11);
        // Born at block 3, valid until 10: at block 11 the era has moved on to the next period.
        assert!(era.birth(11) > 3);
    }
}
