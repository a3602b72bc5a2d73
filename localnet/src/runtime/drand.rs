//! `Timestamp` and `Drand`: the chain's clock and the pulses of the localnet's own beacon.
//!
//! On finney an offchain worker fetches drand quicknet's pulses over HTTP and writes them with an
//! unsigned `write_pulse`; subtensor opens timelocked weight commits with them. The localnet
//! cannot reach drand, so it runs a beacon of its own ([`Beacon`]): it writes each round's pulse
//! in the first block whose time is at or past the round, and declares the beacon's public key,
//! genesis and period in `Drand.BeaconConfig`, where a client reads what to encrypt to.
//!
//! The clock is the chain's own: `Timestamp.Now` advances by one slot (`Aura.SlotDuration`) per
//! block from the genesis time, so rounds follow blocks at whatever pace blocks are made, and a
//! test that makes blocks by hand sees the same rounds as a chain on its timer.

use iota_drand::LocalBeacon;
use rand::SeedableRng;
use sha2::{Digest, Sha256};

use super::event::{DrandEvent, RuntimeEvent};
use super::exec::Exec;
use super::storage::drand::{LastStoredRound, OldestStoredRound, Pulses};
use super::storage::timestamp::Now;
use super::types::{BeaconConfiguration, BeaconMetadata, BoundedVec, Pulse};

/// Pulses kept on chain; the oldest go as new ones arrive.
pub const KEPT_PULSES: u64 = 4_096;
/// Most pulses one block writes.
pub const MAX_PULSES_PER_BLOCK: u64 = 16;

/// The localnet's beacon: a BLS key standing in for drand's, signing rounds on drand's schedule.
pub struct Beacon {
    key: LocalBeacon,
    config: BeaconConfiguration,
}

impl Beacon {
    /// A beacon whose key is derived from `seed`, with round 1 at `genesis_time` (Unix seconds)
    /// and a round every `period` seconds (at least 1).
    pub fn new(seed: [u8; 32], genesis_time: u32, period: u32) -> Self {
        let key = LocalBeacon::generate(&mut rand::rngs::StdRng::from_seed(seed));
        let public_key = key.public_key().to_bytes();
        let hash = Sha256::digest(&public_key).to_vec();
        let config = BeaconConfiguration {
            public_key: BoundedVec(public_key),
            period: period.max(1),
            genesis_time,
            hash: BoundedVec(hash.clone()),
            group_hash: BoundedVec(hash),
            scheme_id: BoundedVec(b"bls-unchained-g1-rfc9380".to_vec()),
            metadata: BeaconMetadata {
                beacon_id: BoundedVec(b"iota-localnet".to_vec()),
            },
        };
        Self { key, config }
    }

    pub fn config(&self) -> &BeaconConfiguration {
        &self.config
    }

    /// The latest round out at `now_ms` (drand's count: round 1 at genesis), 0 before genesis.
    pub fn round_at(&self, now_ms: u64) -> u64 {
        let genesis_ms = u64::from(self.config.genesis_time) * 1_000;
        match now_ms.checked_sub(genesis_ms) {
            Some(since) => since / (u64::from(self.config.period) * 1_000) + 1,
            None => 0,
        }
    }

    /// The round's pulse: the beacon's signature on it and drand's randomness, its sha256.
    pub fn pulse(&self, round: u64) -> Pulse {
        let signature = self.key.sign(round);
        Pulse {
            round,
            randomness: BoundedVec(Sha256::digest(&signature).to_vec()),
            signature: BoundedVec(signature),
        }
    }
}

/// Sets the block's time and writes the pulses of the rounds out since the last block (the
/// current one alone on the first block). After a gap of more than [`MAX_PULSES_PER_BLOCK`]
/// rounds only the newest are written, and the older window is dropped, as a node that was
/// offline fetches only recent pulses.
pub fn on_initialize(exec: &mut Exec<'_>, now_ms: u64, beacon: &Beacon) {
    Now::insert(exec.state, &now_ms);
    let current = beacon.round_at(now_ms);
    let last = LastStoredRound::get(exec.state);
    if current == 0 || current <= last {
        return;
    }
    let first = match last {
        0 => current,
        _ => (last + 1).max(current.saturating_sub(MAX_PULSES_PER_BLOCK - 1)),
    };
    let mut oldest = match OldestStoredRound::get(exec.state) {
        0 => first,
        oldest => oldest,
    };
    if last != 0 && first > last + 1 {
        for round in oldest..=last {
            Pulses::remove(exec.state, &round);
        }
        oldest = first;
    }
    let rounds: Vec<u64> = (first..=current).collect();
    for &round in &rounds {
        Pulses::insert(exec.state, &round, &beacon.pulse(round));
    }
    LastStoredRound::insert(exec.state, &current);
    let keep_from = current.saturating_sub(KEPT_PULSES - 1).max(oldest);
    for round in oldest..keep_from {
        Pulses::remove(exec.state, &round);
    }
    OldestStoredRound::insert(exec.state, &keep_from);
    exec.deposit(RuntimeEvent::Drand(DrandEvent::NewPulse { rounds }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::event::Phase;
    use crate::state::State;

    #[test]
    fn rounds_follow_drands_count_and_pulses_open_what_was_sealed_to_them() {
        let beacon = Beacon::new([3; 32], 1_000, 2);
        assert_eq!(beacon.round_at(999_999), 0);
        assert_eq!(beacon.round_at(1_000_000), 1);
        assert_eq!(beacon.round_at(1_001_999), 1);
        assert_eq!(beacon.round_at(1_002_000), 2);

        let public = iota_drand::DrandPublicKey::from_bytes(&beacon.config().public_key.0)
            .expect("a G2 point");
        let sealed = iota_drand::encrypt_for_round(
            b"weights",
            7,
            &public,
            &mut rand::rngs::StdRng::from_seed([9; 32]),
        )
        .expect("encrypt");
        let pulse = beacon.pulse(7);
        assert_eq!(
            iota_drand::decrypt_with_signature(&sealed, &pulse.signature.0).as_deref(),
            Ok(&b"weights"[..])
        );
        assert!(iota_drand::decrypt_with_signature(&sealed, &beacon.pulse(6).signature.0).is_err());
        assert_eq!(
            pulse.randomness.0,
            Sha256::digest(&pulse.signature.0).to_vec()
        );
    }

    #[test]
    fn each_block_stores_the_rounds_out_since_the_last_and_old_ones_go() {
        let beacon = Beacon::new([3; 32], 0, 1);
        let mut state = State::default();
        let mut events = vec![];
        let at = |state: &mut State, now_ms: u64, events: &mut Vec<_>| {
            let mut exec = Exec {
                state,
                block: 1,
                phase: Phase::Initialization,
                events,
            };
            on_initialize(&mut exec, now_ms, &beacon);
        };
        // The first block stores only the current round.
        at(&mut state, 10_500, &mut events);
        assert_eq!(LastStoredRound::get(&state), 11);
        assert!(Pulses::contains(&state, &11) && !Pulses::contains(&state, &10));
        // Within the same round nothing new; then every round up to now.
        at(&mut state, 10_900, &mut events);
        at(&mut state, 13_000, &mut events);
        assert_eq!(LastStoredRound::get(&state), 14);
        assert!((11..=14).all(|r| Pulses::contains(&state, &r)));
        let rounds: Vec<Vec<u64>> = events
            .iter()
            .map(|e| match &e.event {
                RuntimeEvent::Drand(DrandEvent::NewPulse { rounds }) => rounds.clone(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(rounds, vec![vec![11], vec![12, 13, 14]]);
        assert_eq!(Now::get(&state), 13_000);
        // After a long gap only the newest rounds are written and the old window goes.
        at(&mut state, 1_000_000, &mut events);
        let last = LastStoredRound::get(&state);
        let oldest = OldestStoredRound::get(&state);
        assert_eq!((last, last - oldest + 1), (1_001, MAX_PULSES_PER_BLOCK));
        assert!((oldest..=last).all(|r| Pulses::contains(&state, &r)));
        assert!((11..=14).all(|r| !Pulses::contains(&state, &r)));
        assert!(!Pulses::contains(&state, &(oldest - 1)));
    }
}
