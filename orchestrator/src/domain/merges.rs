//! How a partition's merge results settle.

/// Owners a partition is given when merging starts (fewer only when the run has fewer miners).
/// A wrong merge is adopted only if every one of them publishes it, so a colluding pair never
/// suffices: the third owner, placed by a draw nobody can predict, recomputes it.
pub const OWNERS_PER_PARTITION: usize = 3;

/// How many agreeing results accept a partition whose first round had `first_owners` owners:
/// all of them, and never fewer than two (a lone result is nobody's check).
pub fn results_required(first_owners: usize) -> usize {
    first_owners.clamp(2, OWNERS_PER_PARTITION)
}

/// How a partition's submitted results settle. `results` are hashes in submission order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not enough results yet.
    Pending,
    /// `required` results, all with this hash.
    Accept {
        /// The agreed hash.
        hash: String,
    },
    /// Results disagree: the partition is put to the validators, who recompute it. A majority
    /// of owners settles nothing, since two colluders outvote the honest third.
    Dispute,
}

/// One submitted result: its hash, and whether an owner submitted it (rather than a validator).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Submitted {
    /// BLAKE3 of the result.
    pub hash: String,
    /// Submitted by one of the partition's owners.
    pub by_owner: bool,
}

/// Settles results as they arrive: accepted when `required` owners' results and every other
/// result agree, disputed as soon as any two differ. A validator's result can dispute a
/// partition but never completes an agreement: one validator siding with a colluding pair whose
/// third owner vanished would otherwise make it unanimous.
pub fn verdict(results: &[Submitted], required: usize) -> Verdict {
    let Some(first) = results.first() else {
        return Verdict::Pending;
    };
    let owners = results.iter().filter(|r| r.by_owner).count();
    if results.iter().any(|r| r.hash != first.hash) {
        Verdict::Dispute
    } else if owners >= required.max(2) {
        Verdict::Accept {
            hash: first.hash.clone(),
        }
    } else {
        Verdict::Pending
    }
}

/// How a partition still unsettled at the last deadline is recorded: it keeps its weights
/// either way, `unmerged` when nobody submitted a result, `unverified` when results came but
/// not enough agreed and no validator settled it. Adopting a lone result, or the most-submitted
/// of disagreeing ones, let the fastest wrong owner set everyone's weights.
pub fn unsettled_at_last_deadline(results: usize) -> &'static str {
    if results == 0 {
        "unmerged"
    } else {
        "unverified"
    }
}

/// The hash a dispute settles on: the one whose voters hold more than half the stake of the
/// subnet's validator permit holders (`holders`, hotkey and stake; a voter that no longer holds
/// a permit weighs nothing). Where the holders have no stake at all (a test chain), each holder
/// weighs one. `None` while no hash has that: a single validator, however small, settled
/// disputes, and so chose which merge became everyone's weights.
pub fn quorum<'a>(votes: &'a [(String, String)], holders: &[(String, u64)]) -> Option<&'a str> {
    let staked = holders.iter().any(|(_, s)| *s > 0);
    let weight = |voter: &str| -> u128 {
        holders
            .iter()
            .find(|(h, _)| h == voter)
            .map_or(0, |(_, s)| if staked { u128::from(*s) } else { 1 })
    };
    let total: u128 = holders
        .iter()
        .map(|(_, s)| if staked { u128::from(*s) } else { 1 })
        .sum();
    let mut tally: Vec<(&str, u128)> = Vec::new();
    for (voter, hash) in votes {
        let w = weight(voter);
        match tally.iter_mut().find(|(h, _)| h == hash) {
            Some((_, t)) => *t += w,
            None => tally.push((hash, w)),
        }
    }
    tally
        .into_iter()
        .find(|(_, t)| total > 0 && 2 * *t > total)
        .map(|(h, _)| h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dispute_settles_on_a_majority_of_the_permit_holders_stake() {
        let v = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        let holders: Vec<(String, u64)> = [("big", 60), ("mid", 30), ("small", 10)]
            .iter()
            .map(|(h, s)| (h.to_string(), *s))
            .collect();
        // A small validator alone settles nothing, nor do two that hold half exactly.
        assert_eq!(quorum(&v(&[("small", "x")]), &holders), None);
        assert_eq!(quorum(&v(&[("mid", "x"), ("small", "x")]), &holders), None);
        assert_eq!(quorum(&v(&[("big", "a")]), &holders), Some("a"));
        assert_eq!(
            quorum(&v(&[("small", "x"), ("mid", "a"), ("big", "a")]), &holders),
            Some("a")
        );
        // A voter without a permit weighs nothing.
        assert_eq!(quorum(&v(&[("gone", "x"), ("mid", "x")]), &holders), None);
        // No stake anywhere: one holder, one vote.
        let unstaked: Vec<(String, u64)> = vec![("a".into(), 0), ("b".into(), 0), ("c".into(), 0)];
        assert_eq!(quorum(&v(&[("a", "h")]), &unstaked), None);
        assert_eq!(quorum(&v(&[("a", "h"), ("b", "h")]), &unstaked), Some("h"));
        assert_eq!(quorum(&v(&[("a", "h")]), &[]), None);
    }

    fn s(v: &[&str]) -> Vec<Submitted> {
        v.iter()
            .map(|x| Submitted {
                hash: x.to_string(),
                by_owner: true,
            })
            .collect()
    }

    #[test]
    fn every_required_result_must_agree() {
        let accept = |h: &str| Verdict::Accept { hash: h.into() };
        assert_eq!(verdict(&[], 3), Verdict::Pending);
        assert_eq!(verdict(&s(&["a"]), 3), Verdict::Pending);
        assert_eq!(verdict(&s(&["a", "a"]), 3), Verdict::Pending);
        assert_eq!(verdict(&s(&["a", "a", "a"]), 3), accept("a"));
        // Two colluders agreeing first are not accepted over the third owner's result.
        assert_eq!(verdict(&s(&["x", "x", "a"]), 3), Verdict::Dispute);
        assert_eq!(verdict(&s(&["a", "x", "x"]), 3), Verdict::Dispute);
        assert_eq!(verdict(&s(&["a", "b"]), 3), Verdict::Dispute);
        // A run of two miners accepts their agreement; a lone result never settles.
        assert_eq!(verdict(&s(&["a", "a"]), 2), accept("a"));
        assert_eq!(verdict(&s(&["a"]), 1), Verdict::Pending);
        // A validator's result agreeing with two owners does not make three.
        let mut pair_and_validator = s(&["x", "x", "x"]);
        pair_and_validator[2].by_owner = false;
        assert_eq!(verdict(&pair_and_validator, 3), Verdict::Pending);
        pair_and_validator[2].hash = "a".into();
        assert_eq!(verdict(&pair_and_validator, 3), Verdict::Dispute);
        assert_eq!(results_required(0), 2);
        assert_eq!(results_required(1), 2);
        assert_eq!(results_required(2), 2);
        assert_eq!(results_required(3), 3);
        assert_eq!(results_required(5), 3);
        assert_eq!(unsettled_at_last_deadline(0), "unmerged");
        assert_eq!(unsettled_at_last_deadline(1), "unverified");
        assert_eq!(unsettled_at_last_deadline(2), "unverified");
    }
}
