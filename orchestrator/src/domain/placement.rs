//! Where work goes: which stage a new miner takes, which miner gets the next hop, and who owns
//! which partition of a merge.

use std::collections::HashMap;

use iota_protocol::api::MAX_TOKENS_PER_S;
use rand::Rng;

use crate::domain::merges::OWNERS_PER_PARTITION;

/// Load of one stage as the assigner sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct StageLoad {
    /// Stage index.
    pub stage: u32,
    /// Bytes of memory a miner needs to train it ([`iota_protocol::api::RunConfig::memory_needed`]).
    pub memory_needed: u64,
    /// Active miners.
    pub miners: u32,
    /// Sum of their throughput (tokens/s).
    pub tokens_per_s: f64,
}

/// Picks the stage for a new miner: among stages it has the memory to train, the one with the
/// least total throughput (then fewest miners, then lowest index), so the slowest stage of the
/// pipeline gets help first. `None` when no stage fits.
pub fn choose_stage(loads: &[StageLoad], memory_bytes: u64) -> Option<u32> {
    loads
        .iter()
        .filter(|l| l.memory_needed <= memory_bytes)
        .min_by(|a, b| {
            a.tokens_per_s
                .total_cmp(&b.tokens_per_s)
                .then(a.miners.cmp(&b.miners))
                .then(a.stage.cmp(&b.stage))
        })
        .map(|l| l.stage)
}

/// [`choose_stage`], or why a miner with `memory_bytes` is refused: what it has and what the
/// stage that needs least would need.
pub fn admit(loads: &[StageLoad], memory_bytes: u64) -> Result<u32, String> {
    choose_stage(loads, memory_bytes).ok_or_else(|| {
        let gb = |b: u64| b as f64 / 1e9;
        match loads.iter().min_by_key(|l| l.memory_needed) {
            Some(l) => format!(
                "{:.2} GB of memory fit no stage of this run: the smallest, stage {}, needs {:.2} GB \
                 (weights, gradients, optimizer moments and the activations of one sample)",
                gb(memory_bytes),
                l.stage,
                gb(l.memory_needed)
            ),
            None => "the run has no stage".into(),
        }
    })
}

/// The stage of a miner joining again from `held`: a stage with no miner that it has the
/// memory for takes it, if `held` keeps other miners (`active`: whether it is counted in
/// `held`'s load now); otherwise it keeps `held`.
pub fn rejoin_stage(loads: &[StageLoad], held: u32, active: bool, memory_bytes: u64) -> u32 {
    let me = u32::from(active);
    let others_stay = loads.get(held as usize).is_some_and(|l| l.miners > me);
    let empty = loads
        .iter()
        .find(|l| l.miners == 0 && l.memory_needed <= memory_bytes)
        .map(|l| l.stage);
    match empty {
        Some(empty) if others_stay => empty,
        _ => held,
    }
}

/// What registering again does to a miner's work in the current epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restart {
    /// It goes on (it holds the state its hops left, or did none).
    Continues,
    /// It ended before (a pseudo-gradient, or an earlier restart).
    Ended,
    /// This registration ends it: a new process no longer holds the state its completed hops
    /// left, so it could neither upload a pseudo-gradient that matches them nor train on.
    EndsWork,
}

/// [`Restart`] for a miner whose work ended last in `ended`, in `epoch`, saying whether it
/// `holds_state` of the epoch and having completed hops of it (`worked`) or not.
pub fn restart_ends_work(
    ended: Option<u64>,
    epoch: u64,
    holds_state: bool,
    worked: bool,
) -> Restart {
    if ended == Some(epoch) {
        Restart::Ended
    } else if !holds_state && worked {
        Restart::EndsWork
    } else {
        Restart::Continues
    }
}

/// Floor on the routing weight, so a miner that reported no throughput still gets some work and
/// can prove itself.
const MIN_ROUTING_WEIGHT: f64 = 1.0;

/// Most a miner's routing weight may be, as a multiple of the median weight of the candidates:
/// throughput is what miners report of themselves, and one claiming a thousand times the others'
/// would otherwise take nearly every hop of its stage (pathways would stop mixing, and its
/// stage's other miners would get no work).
pub const MAX_WEIGHT_OVER_MEDIAN: f64 = 4.0;

/// Draws one candidate with probability proportional to its throughput, capped at
/// [`MAX_WEIGHT_OVER_MEDIAN`] times the candidates' median. Never deterministic: CLASP can only
/// tell miners apart if pathways mix them.
pub fn weighted_pick<'a, R: Rng + ?Sized>(
    candidates: &'a [(String, f64)],
    rng: &mut R,
) -> Option<&'a str> {
    // Bounded, so the total stays finite whatever the table holds: `gen_range` panics on an
    // infinite range.
    let bounded = |t: f64| {
        if t.is_finite() {
            t.clamp(MIN_ROUTING_WEIGHT, MAX_TOKENS_PER_S)
        } else {
            MIN_ROUTING_WEIGHT
        }
    };
    let mut sorted: Vec<f64> = candidates.iter().map(|(_, t)| bounded(*t)).collect();
    sorted.sort_by(f64::total_cmp);
    let cap = sorted
        .get(sorted.len().saturating_sub(1) / 2)
        .map_or(MAX_TOKENS_PER_S, |median| median * MAX_WEIGHT_OVER_MEDIAN);
    let weight = |t: f64| bounded(t).min(cap);
    // Each weight is at least the floor and at most the bound: only an empty list has no total.
    let total: f64 = candidates.iter().map(|(_, t)| weight(*t)).sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let mut x = rng.gen_range(0.0..total);
    for (key, t) in candidates {
        let w = weight(*t);
        if x < w {
            return Some(key);
        }
        x -= w;
    }
    candidates.last().map(|(k, _)| k.as_str())
}

/// The order a stage's merge draws its owners from: a permutation of `candidates` uniform over
/// all orders, drawn from `seed` (Fisher–Yates over a keyed BLAKE3 stream). Neighbours in this
/// order own partitions together, so with a seed no miner can compute (see
/// [`crate::session_secret::SessionSecret::owner_draw_seed`]) a hotkey's place in the sorted list,
/// which anyone can grind, says nothing about whom it merges with.
pub fn owner_order(candidates: &[String], seed: &[u8; 32]) -> Vec<String> {
    let mut order = candidates.to_vec();
    let mut stream = blake3::Hasher::new_keyed(seed).finalize_xof();
    let mut draw = |bound: u64| -> u64 {
        // Uniform in 0..bound by rejection: no value is more likely than another.
        let zone = u64::MAX - u64::MAX % bound;
        loop {
            let mut bytes = [0u8; 8];
            stream.fill(&mut bytes);
            let v = u64::from_le_bytes(bytes);
            if v < zone {
                return v % bound;
            }
        }
    };
    for i in (1..order.len()).rev() {
        let j = draw(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// The first-round owners of `partition`: [`OWNERS_PER_PARTITION`] consecutive miners of the
/// stage's owner order ([`owner_order`]), or all of them when there are fewer, rotated by
/// partition so that each miner owns as many as any other.
pub fn initial_owners(order: &[String], partition: u32) -> Vec<String> {
    let n = order.len();
    if n == 0 {
        return Vec::new();
    }
    let first = partition as usize % n;
    (0..n.min(OWNERS_PER_PARTITION))
        .map(|i| order[(first + i) % n].clone())
        .collect()
}

/// An active miner that may be given a partition to merge.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnerCandidate {
    /// Hotkey.
    pub hotkey: String,
    /// Its stage.
    pub stage: u32,
    /// Partitions it owns this epoch, every round counted.
    pub owned: u64,
}

/// Another owner for a partition of `stage` whose owners are `owners`: a candidate that does not
/// own it yet, one of the stage's own miners if any can (they need the result anyway), then one
/// with the fewest partitions, and among equals one at random (by hotkey, a miner could know it
/// would be the tie-break owner of a dispute, and choose a hotkey to be). Returns its index; the
/// caller counts the partition in its `owned` before the next pick.
pub fn pick_added_owner(
    candidates: &[OwnerCandidate],
    stage: u32,
    owners: &[&str],
    rng: &mut impl Rng,
) -> Option<usize> {
    let mut best: Option<((bool, u64), usize)> = None;
    let mut ties = 0u32;
    for (i, c) in candidates.iter().enumerate() {
        if owners.contains(&c.hotkey.as_str()) {
            continue;
        }
        let rank = (c.stage != stage, c.owned);
        match best {
            Some((b, _)) if rank > b => {}
            Some((b, _)) if rank == b => {
                // Each of the equals so far is kept with the same chance.
                ties += 1;
                if rng.gen_range(0..ties) == 0 {
                    best = Some((rank, i));
                }
            }
            _ => {
                best = Some((rank, i));
                ties = 1;
            }
        }
    }
    best.map(|(_, i)| i)
}

/// Another owner for each of `partitions` (stage, partition), picked one after the other by
/// [`pick_added_owner`] from their current `owners`, each pick counted in its miner's `owned` and
/// added to `owners` before the next (so a round of many spreads them, and a partition named
/// twice gets two). The index of each pick, `None` where nobody could take it.
pub fn pick_added_owners(
    candidates: &mut [OwnerCandidate],
    partitions: &[(u32, u32)],
    owners: &mut HashMap<(u32, u32), Vec<String>>,
    rng: &mut impl Rng,
) -> Vec<Option<usize>> {
    partitions
        .iter()
        .map(|&(stage, partition)| {
            let current = owners.entry((stage, partition)).or_default();
            let names: Vec<&str> = current.iter().map(String::as_str).collect();
            let pick = pick_added_owner(candidates, stage, &names, rng);
            if let Some(i) = pick {
                candidates[i].owned += 1;
                current.push(candidates[i].hotkey.clone());
            }
            pick
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn candidate(hotkey: &str, stage: u32, owned: u64) -> OwnerCandidate {
        OwnerCandidate {
            hotkey: hotkey.into(),
            stage,
            owned,
        }
    }

    #[test]
    fn an_added_owner_is_of_the_stage_then_least_loaded_then_random() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let pool = [
            candidate("a", 0, 0),
            candidate("b", 1, 5),
            candidate("c", 1, 2),
            candidate("d", 1, 2),
            candidate("e", 1, 3),
        ];
        // The stage's own miners first, however loaded; owners never.
        assert_eq!(pick_added_owner(&pool, 1, &["c", "d"], &mut rng), Some(4));
        assert_eq!(pick_added_owner(&pool, 0, &[], &mut rng), Some(0));
        // Another stage's least loaded when the stage has nobody left.
        let borrowed = pick_added_owner(&pool, 0, &["a"], &mut rng);
        assert!(matches!(borrowed, Some(2 | 3)), "{borrowed:?}");
        let picks: std::collections::HashSet<usize> = (0..64)
            .map(|_| pick_added_owner(&pool, 1, &[], &mut rng).expect("a pick"))
            .collect();
        assert_eq!(picks, [2, 3].into(), "both equals are drawn, nobody else");
        // Three equals, each about a third of the time.
        let equals = [
            candidate("x", 2, 1),
            candidate("y", 2, 1),
            candidate("z", 2, 1),
        ];
        let mut counts = [0u32; 3];
        for _ in 0..3000 {
            counts[pick_added_owner(&equals, 2, &[], &mut rng).expect("a pick")] += 1;
        }
        assert!(counts.iter().all(|n| (900..1100).contains(n)), "{counts:?}");
        let everyone: Vec<&str> = pool.iter().map(|c| c.hotkey.as_str()).collect();
        assert_eq!(pick_added_owner(&pool, 1, &everyone, &mut rng), None);
    }

    #[test]
    fn a_round_of_added_owners_spreads_them() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let mut pool: Vec<OwnerCandidate> = ["a", "b", "c", "d"]
            .iter()
            .map(|h| candidate(h, 2, 0))
            .collect();
        let partitions: Vec<(u32, u32)> = (0..8).map(|p| (2, p)).collect();
        let mut owners = HashMap::new();
        let picks = pick_added_owners(&mut pool, &partitions, &mut owners, &mut rng);
        let mut per_miner = [0; 4];
        for pick in picks {
            per_miner[pick.expect("a pick")] += 1;
        }
        assert_eq!(per_miner, [2; 4]);
        assert!(pool.iter().all(|c| c.owned == 2));
        // A partition named twice (two of its owners left) gets two new owners, not one twice.
        let twice = pick_added_owners(&mut pool, &[(2, 9), (2, 9)], &mut owners, &mut rng);
        assert!(twice.iter().all(Option::is_some));
        assert_ne!(twice[0], twice[1]);
        assert_eq!(owners[&(2, 9)].len(), 2);
    }

    fn load(stage: u32, memory_needed: u64, miners: u32, tps: f64) -> StageLoad {
        StageLoad {
            stage,
            memory_needed,
            miners,
            tokens_per_s: tps,
        }
    }

    #[test]
    fn stage_choice_balances_throughput_and_respects_memory() {
        let loads = [
            load(0, 20_000, 2, 500.0),
            load(1, 20_000, 1, 100.0),
            load(2, 200_000, 0, 0.0),
        ];
        // Stage 2 is empty but too big for 50 kB.
        assert_eq!(choose_stage(&loads, 50_000), Some(1));
        assert_eq!(choose_stage(&loads, 200_000), Some(2));
        assert_eq!(choose_stage(&loads, 199_999), Some(1));
        assert_eq!(choose_stage(&loads, 100), None);
        // Ties go to fewer miners, then the lower index.
        let tie = [load(0, 1, 2, 0.0), load(1, 1, 1, 0.0), load(2, 1, 1, 0.0)];
        assert_eq!(choose_stage(&tie, 1 << 30), Some(1));
    }

    /// Needs of the kind the model's memory equation gives (iota-1.5b at 4x800 with
    /// checkpointing is 14.3-14.7 GB a stage): a card is admitted to the slowest stage it can
    /// hold, and one too small is refused with what it would need.
    #[test]
    fn a_card_too_small_is_refused_with_what_it_needs() {
        let gb = |g: f64| (g * 1e9) as u64;
        let loads = [
            load(0, gb(15.3), 1, 900.0),
            load(1, gb(13.7), 3, 800.0),
            load(2, gb(15.1), 1, 700.0),
        ];
        assert_eq!(admit(&loads, gb(16.0)), Ok(2), "the slowest stage it fits");
        assert_eq!(admit(&loads, gb(14.0)), Ok(1), "the only stage it fits");
        let refused = admit(&loads, gb(12.0)).unwrap_err();
        assert!(
            refused.contains("12.00 GB") && refused.contains("stage 1, needs 13.70 GB"),
            "{refused}"
        );
        assert_eq!(admit(&[], gb(80.0)).unwrap_err(), "the run has no stage");
    }

    #[test]
    fn weighted_pick_follows_throughput_and_is_random() {
        let c = vec![("a".to_owned(), 300.0), ("b".to_owned(), 100.0)];
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut a = 0;
        for _ in 0..4000 {
            if weighted_pick(&c, &mut rng) == Some("a") {
                a += 1;
            }
        }
        // Expect 3000 ± a few sigma (sigma ≈ 27).
        assert!((2850..3150).contains(&a), "{a}");
        assert_eq!(weighted_pick(&[], &mut rng), None);
        // Throughputs whose sum overflows (the table predates the bound, or a bug let one in):
        // still a random pick, not a panic.
        let huge = vec![("a".to_owned(), f64::MAX), ("b".to_owned(), f64::MAX)];
        let picks: Vec<&str> = (0..200)
            .filter_map(|_| weighted_pick(&huge, &mut rng))
            .collect();
        assert_eq!(picks.len(), 200);
        assert!(picks.contains(&"a") && picks.contains(&"b"));
        // Zero or broken throughput still gets picked sometimes.
        let z = vec![("x".to_owned(), 0.0), ("y".to_owned(), f64::NAN)];
        let picks: std::collections::HashSet<_> = (0..100)
            .filter_map(|_| weighted_pick(&z, &mut rng))
            .collect();
        assert_eq!(picks.len(), 2);
    }

    #[test]
    fn a_miner_claiming_a_huge_throughput_does_not_take_its_stage() {
        // A throughput of a million times the others' took about all of the hops: the others
        // about one in a million each.
        let c = vec![
            ("liar".to_owned(), 1e9),
            ("a".to_owned(), 1000.0),
            ("b".to_owned(), 1000.0),
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let mut honest = 0;
        for _ in 0..3000 {
            if weighted_pick(&c, &mut rng) != Some("liar") {
                honest += 1;
            }
        }
        // Capped at 4 times the median (1000): the others take 2 in 6, 1000 ± a few sigma.
        assert!((850..1150).contains(&honest), "{honest}");
        // Of five, the median is the middle one (100, so a cap of 400), not the least.
        let c = vec![
            ("slow".to_owned(), 1.0),
            ("a".to_owned(), 100.0),
            ("liar".to_owned(), 1e9),
            ("b".to_owned(), 100.0),
            ("c".to_owned(), 100.0),
        ];
        let liar = (0..4000)
            .filter(|_| weighted_pick(&c, &mut rng) == Some("liar"))
            .count();
        // 400 of 701: 2282 ± a few sigma (sigma ≈ 31).
        assert!((2150..2420).contains(&liar), "{liar}");
    }

    #[test]
    fn weighted_pick_draws_every_position_in_proportion() {
        // Equal weights: the first, a middle and the last candidate each about a third.
        let c: Vec<(String, f64)> = ["a", "b", "c"]
            .iter()
            .map(|k| ((*k).to_owned(), 100.0))
            .collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let mut counts = HashMap::new();
        for _ in 0..3000 {
            *counts
                .entry(weighted_pick(&c, &mut rng).expect("a pick"))
                .or_insert(0) += 1;
        }
        for key in ["a", "b", "c"] {
            // 1000 ± a few sigma (sigma ≈ 26).
            let n = counts.get(key).copied().unwrap_or(0);
            assert!((900..1100).contains(&n), "{key}: {n}");
        }
    }

    #[test]
    fn owners_rotate_over_the_order_and_are_distinct() {
        let m: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
        assert_eq!(initial_owners(&m, 0), vec!["a", "b", "c"]);
        assert_eq!(initial_owners(&m, 2), vec!["c", "d", "a"]);
        assert_eq!(initial_owners(&m, 5), vec!["b", "c", "d"]);
        assert_eq!(initial_owners(&m[..2], 3), vec!["b", "a"]);
        assert_eq!(initial_owners(&m[..1], 3), vec!["a"]);
        assert!(initial_owners(&[], 0).is_empty());
    }

    #[test]
    fn grinding_a_hotkey_next_to_a_partner_gains_nothing() {
        // Six miners: "b" and "c" sit next to each other in sorted order, "a" and "d" do not.
        let m: Vec<String> = ["a", "b", "c", "d", "e", "f"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let pair_owns = |owners: &[String], x: &str, y: &str| {
            owners.iter().any(|o| o == x) && owners.iter().any(|o| o == y)
        };
        let (mut adjacent, mut apart, mut trio) = (0u32, 0u32, 0u32);
        let draws = 30_000u32;
        for i in 0..draws {
            let seed = *blake3::hash(&i.to_le_bytes()).as_bytes();
            let order = owner_order(&m, &seed);
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, m, "a permutation");
            let owners = initial_owners(&order, 0);
            adjacent += u32::from(pair_owns(&owners, "b", "c"));
            apart += u32::from(pair_owns(&owners, "a", "d"));
            assert_eq!(owners.len(), 3, "three distinct owners: {owners:?}");
            let colluders = ["a", "b", "c"];
            trio += u32::from(owners.iter().all(|o| colluders.contains(&o.as_str())));
        }
        // Any pair is among a given partition's three owners with probability
        // C(4,1)/C(6,3) = 1/5 (6,000 of 30,000, sigma about 69), sorted neighbours or not. A
        // pair is never all three, so its agreeing wrong merge always meets an honest owner's
        // result; three colluders of six own a partition alone with probability 1/C(6,3).
        for (what, n) in [("adjacent", adjacent), ("apart", apart)] {
            assert!((5_750..6_250).contains(&n), "{what}: {n} of {draws}");
        }
        assert!(
            (1_350..1_650).contains(&trio),
            "three colluders: {trio} of {draws}"
        );
        // Each miner still owns the same number of partitions.
        let order = owner_order(&m, &[3; 32]);
        let mut owned: HashMap<String, u32> = HashMap::new();
        for p in 0..12 {
            for o in initial_owners(&order, p) {
                *owned.entry(o).or_default() += 1;
            }
        }
        assert!(owned.values().all(|n| *n == 6), "{owned:?}");
    }

    #[test]
    fn a_miner_joining_again_fills_an_empty_stage_only_if_its_own_keeps_others() {
        let loads = vec![
            load(0, 10, 2, 5.0),
            load(1, 10, 0, 0.0),
            load(2, 99, 0, 0.0),
        ];
        assert_eq!(rejoin_stage(&loads, 0, true, 10), 1);
        assert_eq!(rejoin_stage(&loads, 0, false, 10), 1);
        let alone = vec![load(0, 10, 1, 5.0), load(1, 10, 0, 0.0)];
        assert_eq!(
            rejoin_stage(&alone, 0, true, 10),
            0,
            "its stage would empty"
        );
        assert_eq!(
            rejoin_stage(&alone, 0, false, 10),
            1,
            "it was not counted there"
        );
        let big = vec![load(0, 10, 2, 5.0), load(1, 99, 0, 0.0)];
        assert_eq!(
            rejoin_stage(&big, 0, true, 10),
            0,
            "no memory for the empty one"
        );
    }

    #[test]
    fn a_restart_without_the_epochs_state_ends_the_work_it_did() {
        assert_eq!(restart_ends_work(None, 4, false, true), Restart::EndsWork);
        assert_eq!(
            restart_ends_work(Some(3), 4, false, true),
            Restart::EndsWork
        );
        assert_eq!(restart_ends_work(None, 4, true, true), Restart::Continues);
        assert_eq!(restart_ends_work(None, 4, false, false), Restart::Continues);
        assert_eq!(restart_ends_work(Some(4), 4, false, true), Restart::Ended);
    }
}
