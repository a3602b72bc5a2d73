//! A validator for a test: its own fresh database, connected to the test's chain and orchestrator.

use iota_chain::wallet::Keypair;
use iota_chain::{ConnectOptions, Subtensor};
use iota_validator::{Store, Validator, ValidatorConfig};

/// A validator with hotkey seed `seed` for the orchestrator at `base` on subnet `netuid` of the
/// chain at `ws_url`, with `settings` applied to the defaults; and its database.
pub async fn validator(
    ws_url: String,
    base: &str,
    netuid: u16,
    seed: u8,
    settings: impl FnOnce(&mut ValidatorConfig),
) -> (Validator, Store) {
    let db = crate::support::fresh_db().await;
    let store = Store::connect(&db).await.expect("validator db");
    let chain = Subtensor::connect(ConnectOptions::new(ws_url))
        .await
        .expect("chain");
    let mut cfg = ValidatorConfig::new(base, netuid);
    cfg.tx = crate::support::tx();
    settings(&mut cfg);
    let v = Validator::connect(cfg, Keypair::from_seed([seed; 32]), chain, store.clone())
        .await
        .expect("validator");
    (v, store)
}
