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

/// Settles results as they arrive: accepted when `required` results all agree, disputed as soon
/// as any two differ.
pub fn verdict(results: &[String], required: usize) -> Verdict {
    let Some(first) = results.first() else {
        return Verdict::Pending;
    };
    if results.iter().any(|r| r != first) {
        Verdict::Dispute
    } else if results.len() >= required.max(2) {
        Verdict::Accept {
            hash: first.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
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
