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

/// At the last deadline: the hash with the most results (earliest on a tie), if any.
pub fn final_pick(results: &[String]) -> Option<String> {
    let mut best: Option<(&str, usize)> = None;
    for r in results {
        let c = results.iter().filter(|x| *x == r).count();
        if best.is_none_or(|(_, bc)| c > bc) {
            best = Some((r, c));
        }
    }
    best.map(|(h, _)| h.to_owned())
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
        assert_eq!(final_pick(&s(&["a", "b", "b"])), Some("b".into()));
        assert_eq!(final_pick(&s(&["a", "b"])), Some("a".into()));
        assert_eq!(final_pick(&[]), None);
    }
}
