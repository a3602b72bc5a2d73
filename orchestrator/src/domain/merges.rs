//! How a partition's merge results settle.

/// How a partition's submitted results settle. `results` are hashes in submission order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not enough results yet.
    Pending,
    /// Two or more results agree on this hash (`unanimous` when nothing disagreed).
    Accept {
        /// The agreed hash.
        hash: String,
        /// Whether every result agreed.
        unanimous: bool,
    },
    /// Results disagree with no majority: open a dispute and add a tie-break owner.
    Dispute,
}

/// Settles results as they arrive: the first hash reached by two results wins.
pub fn verdict(results: &[String]) -> Verdict {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for r in results {
        match counts.iter_mut().find(|(h, _)| *h == r) {
            Some((_, c)) => *c += 1,
            None => counts.push((r, 1)),
        }
    }
    if let Some((hash, _)) = counts.iter().find(|(_, c)| *c >= 2) {
        return Verdict::Accept {
            hash: (*hash).to_owned(),
            unanimous: counts.len() == 1,
        };
    }
    if counts.len() >= 2 {
        Verdict::Dispute
    } else {
        Verdict::Pending
    }
}

/// How a partition still unsettled at the last deadline is recorded: it keeps its weights
/// either way, `unmerged` when nobody submitted a result, `unverified` when results came but no
/// two agreed and no validator settled it. Adopting a lone result, or the most-submitted of
/// disagreeing ones, let the fastest wrong owner set everyone's weights.
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

    #[test]
    fn verdicts() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(verdict(&s(&["a"])), Verdict::Pending);
        assert_eq!(
            verdict(&s(&["a", "a"])),
            Verdict::Accept {
                hash: "a".into(),
                unanimous: true
            }
        );
        assert_eq!(verdict(&s(&["a", "b"])), Verdict::Dispute);
        assert_eq!(
            verdict(&s(&["a", "b", "b"])),
            Verdict::Accept {
                hash: "b".into(),
                unanimous: false
            }
        );
        assert_eq!(unsettled_at_last_deadline(0), "unmerged");
        assert_eq!(unsettled_at_last_deadline(1), "unverified");
        assert_eq!(unsettled_at_last_deadline(2), "unverified");
    }
}
