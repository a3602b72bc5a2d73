//! Weights to set while the orchestrator cannot be reached: without its records nothing can be
//! verified, so the validator follows the other validators rather than stop setting weights
//! (a validator that stops loses its validator trust and dividends).
//!
//! The first choice is the chain's own Yuma `Consensus` vector of the metagraph: per miner, the
//! stake-weighted median of the validators' weights. Until a Yuma epoch has produced one (a
//! new subnet, every consensus zero), the stake-weighted mean of the other permitted
//! validators' `Weights` rows, each normalised to sum to one, is used instead. The validator's
//! own uid never receives weight, and its own row never counts.

use std::collections::BTreeMap;

use iota_chain::Metagraph;

/// The metagraph's consensus weights by uid, normalised to sum to one, without `own_uid`.
/// `None` when every consensus is zero.
pub fn consensus_weights(meta: &Metagraph, own_uid: u16) -> Option<(Vec<u16>, Vec<f64>)> {
    let kept: Vec<(u16, f64)> = meta
        .neurons
        .iter()
        .filter(|n| n.uid != own_uid && n.consensus > 0)
        .map(|n| (n.uid, f64::from(n.consensus)))
        .collect();
    normalised(kept)
}

/// The stake-weighted mean of the validators' weight rows `(validator uid, row)`: each row is
/// normalised to sum to one and weighted by its validator's stake; `own_uid`'s row and rows of
/// validators without stake are left out, and so is weight on `own_uid`. `None` when nothing is
/// left.
pub fn stake_weighted_mean(
    meta: &Metagraph,
    rows: &[(u16, Vec<(u16, u16)>)],
    own_uid: u16,
) -> Option<(Vec<u16>, Vec<f64>)> {
    let stake: BTreeMap<u16, f64> = meta
        .neurons
        .iter()
        .map(|n| (n.uid, n.stake as f64))
        .collect();
    let mut acc: BTreeMap<u16, f64> = BTreeMap::new();
    for (validator, row) in rows {
        let s = stake.get(validator).copied().unwrap_or(0.0);
        let sum: f64 = row.iter().map(|(_, w)| f64::from(*w)).sum();
        if *validator == own_uid || s <= 0.0 || sum <= 0.0 {
            continue;
        }
        for (uid, w) in row {
            if *uid != own_uid && stake.contains_key(uid) {
                *acc.entry(*uid).or_insert(0.0) += s * f64::from(*w) / sum;
            }
        }
    }
    normalised(acc.into_iter().filter(|(_, w)| *w > 0.0).collect())
}

fn normalised(kept: Vec<(u16, f64)>) -> Option<(Vec<u16>, Vec<f64>)> {
    let total: f64 = kept.iter().map(|(_, w)| w).sum();
    if kept.is_empty() || total.is_nan() || total <= 0.0 {
        return None;
    }
    Some(kept.into_iter().map(|(u, w)| (u, w / total)).unzip())
}

#[cfg(test)]
mod tests {
    use super::*;
    use iota_chain::wallet::PublicKey;
    use iota_chain::{Hyperparams, Neuron};

    fn neuron(uid: u16, stake: u64, consensus: u16) -> Neuron {
        Neuron {
            uid,
            hotkey: PublicKey::from_bytes([uid as u8; 32]),
            coldkey: None,
            stake,
            validator_permit: stake > 0,
            incentive: 0,
            dividends: 0,
            emission: 0,
            consensus,
            validator_trust: 0,
            active: true,
            last_update: 0,
            registered_at: 0,
            axon: None,
        }
    }

    fn meta(neurons: Vec<Neuron>) -> Metagraph {
        Metagraph {
            netuid: 1,
            block: 100,
            block_hash: String::new(),
            hyperparams: Hyperparams {
                netuid: 1,
                block: 100,
                tempo: 10,
                weights_rate_limit: 0,
                activity_cutoff: 5000,
                weights_version_key: 0,
                commit_reveal_enabled: false,
                reveal_period_epochs: 1,
                burn: 0,
                max_uids: 16,
                n: neurons.len() as u16,
                max_weights_limit: u16::MAX,
                min_allowed_weights: 1,
                immunity_period: 0,
                max_validators: 16,
                registration_allowed: true,
                serving_rate_limit: 0,
                owner_coldkey: PublicKey::from_bytes([0; 32]),
                owner_hotkey: PublicKey::from_bytes([0; 32]),
                first_emission_block: None,
            },
            neurons,
        }
    }

    #[test]
    fn consensus_is_normalised_without_the_own_uid() {
        let m = meta(vec![
            neuron(0, 10, 0),
            neuron(1, 0, 30_000),
            neuron(2, 0, 10_000),
            neuron(3, 5, 5_000),
        ]);
        let (uids, w) = consensus_weights(&m, 3).expect("consensus");
        assert_eq!(uids, vec![1, 2]);
        assert!((w[0] - 0.75).abs() < 1e-12 && (w[1] - 0.25).abs() < 1e-12);
        let none = meta(vec![neuron(0, 10, 0), neuron(1, 0, 0)]);
        assert_eq!(consensus_weights(&none, 0), None);
    }

    #[test]
    fn mean_weights_rows_by_stake_and_skips_own_row() {
        // Validators 0 (stake 3) and 1 (stake 1); 4 is us.
        let m = meta(vec![
            neuron(0, 3, 0),
            neuron(1, 1, 0),
            neuron(2, 0, 0),
            neuron(3, 0, 0),
            neuron(4, 100, 0),
        ]);
        let rows = vec![
            (0, vec![(2, 65_535)]),
            (1, vec![(3, 65_535)]),
            (4, vec![(2, 1), (3, 65_535)]),
        ];
        let (uids, w) = stake_weighted_mean(&m, &rows, 4).expect("mean");
        assert_eq!(uids, vec![2, 3]);
        assert!((w[0] - 0.75).abs() < 1e-12 && (w[1] - 0.25).abs() < 1e-12);
        assert_eq!(stake_weighted_mean(&m, &rows[2..], 4), None);
        // Another validator's weight on us, and on a uid the metagraph does not hold, is
        // dropped: a third of validator 0's row each, leaving it a third on uid 2.
        let rows = vec![
            (0, vec![(2, 65_535), (4, 65_535), (9, 65_535)]),
            (1, vec![(3, 65_535)]),
        ];
        let (uids, w) = stake_weighted_mean(&m, &rows, 4).expect("mean");
        assert_eq!(uids, vec![2, 3]);
        assert!(
            (w[0] - 0.5).abs() < 1e-12 && (w[1] - 0.5).abs() < 1e-12,
            "{w:?}"
        );
    }
}
