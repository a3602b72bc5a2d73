//! Wallet keys as subxt signers, and conversions between wallet and subxt account types.

use subxt::PolkadotConfig;
use subxt::tx::Signer;
use subxt::utils::{AccountId32, MultiSignature};

use crate::wallet::{Keypair, PublicKey};

/// Wallet keys sign extrinsics directly (sr25519, `substrate` context), so keys loaded from a
/// `privateKey`-only keyfile work too.
impl Signer<PolkadotConfig> for Keypair {
    fn account_id(&self) -> AccountId32 {
        AccountId32(self.public().to_bytes())
    }

    fn sign(&self, signer_payload: &[u8]) -> MultiSignature {
        MultiSignature::Sr25519(Keypair::sign(self, signer_payload))
    }
}

/// The on-chain account of a wallet public key.
pub fn account(key: &PublicKey) -> AccountId32 {
    AccountId32(key.to_bytes())
}

/// The wallet public key of an on-chain account.
pub fn public(account: &AccountId32) -> PublicKey {
    PublicKey::from_bytes(account.0)
}
