//! A synthetic language with structure worth learning and a known entropy.
//!
//! Sentences are `subject verb-phrase .`:
//!
//! * the subject is a determiner (which fixes grammatical number), up to two adjectives and a
//!   noun (animate or inanimate), optionally followed by a prepositional phrase whose own noun has
//!   an independent number — an "attractor" between the subject and its verb;
//! * the verb agrees in number with the subject noun (never with the attractor) and its class is
//!   selected by the subject's animacy; transitive verbs take an object noun phrase.
//!
//! The generator is a finite automaton in which every (state, token) pair has one successor, so
//! the state is a function of the prefix. The best possible predictor's cross-entropy at position
//! `t` is therefore `sum_s P(state_t = s) * H(next token | s)`, which [`GrammarCorpus::entropy_floor`]
//! computes exactly by propagating the state distribution. Agreement across the attractor costs
//! the model entropy until it learns it, so the floor is reachable only by attending back to the
//! subject.

use std::collections::HashMap;

use super::Dataset;
use crate::error::{ModelError, Result};
use crate::rng::SplitMix64;

const DET_SG: [&str; 4] = ["a", "this", "that", "every"];
const DET_PL: [&str; 4] = ["some", "these", "those", "many"];
const ADJ: [&str; 6] = ["big", "small", "red", "old", "happy", "quiet"];
const ANIMATE: [(&str, &str); 5] = [
    ("cat", "cats"),
    ("dog", "dogs"),
    ("bird", "birds"),
    ("child", "children"),
    ("teacher", "teachers"),
];
const INANIMATE: [(&str, &str); 4] = [
    ("box", "boxes"),
    ("stone", "stones"),
    ("book", "books"),
    ("tree", "trees"),
];
const PREP: [&str; 3] = ["near", "behind", "with"];
const V_INTRANS: [(&str, &str); 3] = [("sleeps", "sleep"), ("runs", "run"), ("sings", "sing")];
const V_TRANS: [(&str, &str); 3] = [("sees", "see"), ("likes", "like"), ("finds", "find")];
const V_INANIMATE: [(&str, &str); 2] = [("falls", "fall"), ("rests", "rest")];

const BOS: &str = "<bos>";
const END: &str = ".";

const P_SUBJ_ADJ: f64 = 0.35;
const P_PP: f64 = 0.3;
const P_OBJ_ADJ: f64 = 0.3;
const P_PP_ADJ: f64 = 0.25;
const P_TRANSITIVE: f64 = 0.5;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum State {
    SentenceStart,
    /// After the subject determiner and `adjs` adjectives.
    Subject {
        plural: bool,
        adjs: u8,
    },
    /// After the subject noun (`pp_done`: after the attractor phrase).
    Verb {
        plural: bool,
        animate: bool,
        pp_done: bool,
    },
    /// After the preposition.
    PpDet {
        plural: bool,
        animate: bool,
    },
    /// Inside the attractor phrase, whose own number is `pp_plural`.
    PpNoun {
        plural: bool,
        animate: bool,
        pp_plural: bool,
        adjs: u8,
    },
    ObjDet,
    ObjNoun {
        plural: bool,
        adjs: u8,
    },
    End,
}

/// The embedded default corpus: each sample id is an independent document of grammar sentences,
/// `<bos>` followed by `seq_len` tokens.
#[derive(Clone, Debug)]
pub struct GrammarCorpus {
    seed: u64,
    seq_len: usize,
    vocab: Vec<&'static str>,
    /// Per state: (token, probability, next state index).
    edges: Vec<Vec<(u32, f64, usize)>>,
    start: usize,
}

struct Builder {
    vocab: Vec<&'static str>,
    ids: HashMap<&'static str, u32>,
}

impl Builder {
    fn id(&mut self, w: &'static str) -> u32 {
        if let Some(i) = self.ids.get(w) {
            return *i;
        }
        let i = self.vocab.len() as u32;
        self.vocab.push(w);
        self.ids.insert(w, i);
        i
    }
}

/// Outgoing (word, probability, next state) of a state.
fn transitions(s: State) -> Vec<(&'static str, f64, State)> {
    let mut out = Vec::new();
    let dets = |out: &mut Vec<_>, next: &dyn Fn(bool) -> State| {
        for (plural, words) in [(false, DET_SG), (true, DET_PL)] {
            for w in words {
                out.push((w, 1.0 / 8.0, next(plural)));
            }
        }
    };
    let adjs = |out: &mut Vec<_>, p: f64, next: State| {
        for w in ADJ {
            out.push((w, p / ADJ.len() as f64, next));
        }
    };
    let nouns = |out: &mut Vec<_>, p: f64, plural: bool, next: &dyn Fn(bool) -> State| {
        let n = (ANIMATE.len() + INANIMATE.len()) as f64;
        for (animate, list) in [(true, &ANIMATE[..]), (false, &INANIMATE[..])] {
            for (sg, pl) in list {
                out.push((if plural { *pl } else { *sg }, p / n, next(animate)));
            }
        }
    };
    match s {
        State::SentenceStart => dets(&mut out, &|plural| State::Subject { plural, adjs: 0 }),
        State::Subject { plural, adjs: a } => {
            let p_adj = if a < 2 { P_SUBJ_ADJ } else { 0.0 };
            if p_adj > 0.0 {
                adjs(
                    &mut out,
                    p_adj,
                    State::Subject {
                        plural,
                        adjs: a + 1,
                    },
                );
            }
            nouns(&mut out, 1.0 - p_adj, plural, &|animate| State::Verb {
                plural,
                animate,
                pp_done: false,
            });
        }
        State::Verb {
            plural,
            animate,
            pp_done,
        } => {
            let p_pp = if pp_done { 0.0 } else { P_PP };
            for w in PREP {
                if p_pp > 0.0 {
                    out.push((
                        w,
                        p_pp / PREP.len() as f64,
                        State::PpDet { plural, animate },
                    ));
                }
            }
            let form = |(sg, pl): (&'static str, &'static str)| if plural { pl } else { sg };
            let p_verb = 1.0 - p_pp;
            if animate {
                for v in V_INTRANS {
                    out.push((form(v), p_verb * (1.0 - P_TRANSITIVE) / 3.0, State::End));
                }
                for v in V_TRANS {
                    out.push((form(v), p_verb * P_TRANSITIVE / 3.0, State::ObjDet));
                }
            } else {
                for v in V_INANIMATE {
                    out.push((form(v), p_verb / 2.0, State::End));
                }
            }
        }
        State::PpDet { plural, animate } => dets(&mut out, &|pp_plural| State::PpNoun {
            plural,
            animate,
            pp_plural,
            adjs: 0,
        }),
        State::PpNoun {
            plural,
            animate,
            pp_plural,
            adjs: a,
        } => {
            let p_adj = if a < 1 { P_PP_ADJ } else { 0.0 };
            if p_adj > 0.0 {
                adjs(
                    &mut out,
                    p_adj,
                    State::PpNoun {
                        plural,
                        animate,
                        pp_plural,
                        adjs: a + 1,
                    },
                );
            }
            nouns(&mut out, 1.0 - p_adj, pp_plural, &|_| State::Verb {
                plural,
                animate,
                pp_done: true,
            });
        }
        State::ObjDet => dets(&mut out, &|plural| State::ObjNoun { plural, adjs: 0 }),
        State::ObjNoun { plural, adjs: a } => {
            let p_adj = if a < 1 { P_OBJ_ADJ } else { 0.0 };
            if p_adj > 0.0 {
                adjs(
                    &mut out,
                    p_adj,
                    State::ObjNoun {
                        plural,
                        adjs: a + 1,
                    },
                );
            }
            nouns(&mut out, 1.0 - p_adj, plural, &|_| State::End);
        }
        State::End => out.push((END, 1.0, State::SentenceStart)),
    }
    out
}

impl GrammarCorpus {
    /// Corpus with sampling seed `seed` and windows of `seq_len` predicted tokens.
    pub fn new(seed: u64, seq_len: usize) -> Result<Self> {
        if seq_len == 0 {
            return Err(ModelError::Data("seq_len must be positive".into()));
        }
        let mut b = Builder {
            vocab: Vec::new(),
            ids: HashMap::new(),
        };
        // Fixed token order: <bos>, ".", then words as the automaton first meets them.
        b.id(BOS);
        b.id(END);
        let mut index: HashMap<State, usize> = HashMap::new();
        let mut order = vec![State::SentenceStart];
        index.insert(State::SentenceStart, 0);
        let mut edges = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let mut out = Vec::new();
            for (w, p, next) in transitions(order[i]) {
                let j = match index.get(&next) {
                    Some(j) => *j,
                    None => {
                        order.push(next);
                        index.insert(next, order.len() - 1);
                        order.len() - 1
                    }
                };
                out.push((b.id(w), p, j));
            }
            edges.push(out);
            i += 1;
        }
        Ok(Self {
            seed,
            seq_len,
            vocab: b.vocab,
            edges,
            start: 0,
        })
    }

    /// The words, indexed by token id (`0` is `<bos>`).
    pub fn vocab(&self) -> &[&'static str] {
        &self.vocab
    }

    /// Number of automaton states.
    pub fn num_states(&self) -> usize {
        self.edges.len()
    }

    /// The `<bos>` token id.
    pub fn bos_id(&self) -> u32 {
        0
    }

    fn entropy_of(&self, s: usize) -> f64 {
        self.edges[s]
            .iter()
            .filter(|(_, p, _)| *p > 0.0)
            .map(|(_, p, _)| -p * p.ln())
            .sum()
    }

    fn propagate(&self, dist: &[f64]) -> Vec<f64> {
        let mut next = vec![0.0; dist.len()];
        for (s, ps) in dist.iter().enumerate() {
            for (_, p, j) in &self.edges[s] {
                next[*j] += ps * p;
            }
        }
        next
    }

    /// Best achievable mean cross-entropy (nats per token) over the `seq_len` predicted
    /// positions of a window: what a model that knows the grammar exactly would score.
    pub fn entropy_floor(&self) -> f64 {
        let h: Vec<f64> = (0..self.num_states()).map(|s| self.entropy_of(s)).collect();
        let mut dist = vec![0.0; self.num_states()];
        dist[self.start] = 1.0;
        let mut total = 0.0;
        for _ in 0..self.seq_len {
            total += dist.iter().zip(&h).map(|(p, h)| p * h).sum::<f64>();
            dist = self.propagate(&dist);
        }
        total / self.seq_len as f64
    }

    /// Entropy rate of the stationary process (long-window limit of the floor).
    pub fn entropy_rate(&self) -> f64 {
        let n = self.num_states();
        let mut dist = vec![1.0 / n as f64; n];
        // The sentence loop has period issues only in lockstep; averaging iterates converges.
        let mut avg = vec![0.0; n];
        let iters = 5000;
        for _ in 0..iters {
            dist = self.propagate(&dist);
            for (a, d) in avg.iter_mut().zip(&dist) {
                *a += d / iters as f64;
            }
        }
        (0..n).map(|s| avg[s] * self.entropy_of(s)).sum()
    }

    /// Cross-entropy (nats/token) of the best predictor that ignores context: the unigram
    /// distribution of the windows. A model below this has learned structure.
    pub fn unigram_entropy(&self) -> f64 {
        let mut freq = vec![0.0; self.vocab.len()];
        let mut dist = vec![0.0; self.num_states()];
        dist[self.start] = 1.0;
        for _ in 0..self.seq_len {
            for (s, ps) in dist.iter().enumerate() {
                for (tok, p, _) in &self.edges[s] {
                    freq[*tok as usize] += ps * p;
                }
            }
            dist = self.propagate(&dist);
        }
        let total: f64 = freq.iter().sum();
        freq.iter()
            .filter(|f| **f > 0.0)
            .map(|f| -(f / total) * (f / total).ln())
            .sum()
    }

    /// Cross-entropy (nats/token, over the `seq_len` predicted positions) of the best predictor
    /// that sees only the previous token. A model below this uses longer context.
    pub fn bigram_entropy(&self) -> f64 {
        let (n_s, n_v) = (self.num_states(), self.vocab.len());
        // Joint distribution of (state, previous token), starting after <bos>.
        let mut joint = vec![0.0; n_s * n_v];
        joint[self.start * n_v + self.bos_id() as usize] = 1.0;
        let mut total = 0.0;
        for _ in 0..self.seq_len {
            // Next-token distribution given each previous token.
            let mut cond = vec![0.0; n_v * n_v];
            let mut next = vec![0.0; n_s * n_v];
            for s in 0..n_s {
                for prev in 0..n_v {
                    let p = joint[s * n_v + prev];
                    if p == 0.0 {
                        continue;
                    }
                    for (tok, q, j) in &self.edges[s] {
                        cond[prev * n_v + *tok as usize] += p * q;
                        next[*j * n_v + *tok as usize] += p * q;
                    }
                }
            }
            for prev in 0..n_v {
                let row = &cond[prev * n_v..(prev + 1) * n_v];
                let mass: f64 = row.iter().sum();
                total += row
                    .iter()
                    .filter(|p| **p > 0.0)
                    .map(|p| -p * (p / mass).ln())
                    .sum::<f64>();
            }
            joint = next;
        }
        total / self.seq_len as f64
    }

    /// Mean surprisal (nats/token) of a window's predicted tokens under the grammar itself: the
    /// floor measured on exactly these tokens, to compare with a model's loss on them without
    /// sampling noise. Errors if the window could not have been generated.
    pub fn surprisal(&self, window: &[u32]) -> Result<f64> {
        if window.len() < 2 || window[0] != self.bos_id() {
            return Err(ModelError::Data(
                "window must start with <bos> and predict a token".into(),
            ));
        }
        let mut s = self.start;
        let mut total = 0.0;
        for tok in &window[1..] {
            let (_, p, next) = self.edges[s]
                .iter()
                .find(|e| e.0 == *tok)
                .copied()
                .ok_or_else(|| ModelError::Data(format!("token {tok} cannot follow here")))?;
            total -= p.ln();
            s = next;
        }
        Ok(total / (window.len() - 1) as f64)
    }

    /// The words of sample `id` (without `<bos>`), space separated: raw text for tokenizer
    /// experiments.
    pub fn text(&self, id: u64) -> Result<String> {
        let w = self.window(id)?;
        Ok(w[1..]
            .iter()
            .map(|t| self.vocab[*t as usize])
            .collect::<Vec<_>>()
            .join(" "))
    }
}

impl Dataset for GrammarCorpus {
    fn seq_len(&self) -> usize {
        self.seq_len
    }

    fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    fn window(&self, id: u64) -> Result<Vec<u32>> {
        let mut rng = SplitMix64::derived(self.seed, &format!("grammar-sample/{id}"));
        let mut out = Vec::with_capacity(self.seq_len + 1);
        out.push(self.bos_id());
        let mut s = self.start;
        let mut weights = Vec::new();
        for _ in 0..self.seq_len {
            let edges = &self.edges[s];
            weights.clear();
            weights.extend(edges.iter().map(|(_, p, _)| *p));
            let (tok, _, next) = edges[rng.pick(&weights)];
            out.push(tok);
            s = next;
        }
        Ok(out)
    }

    fn fingerprint(&self) -> blake3::Hash {
        let mut h = blake3::Hasher::new();
        h.update(b"iota-model/grammar/v1");
        h.update(&self.seed.to_le_bytes());
        h.update(&(self.seq_len as u64).to_le_bytes());
        h.finalize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn automaton_is_unifilar_and_normalised() {
        let g = GrammarCorpus::new(0, 32).unwrap();
        for (s, edges) in g.edges.iter().enumerate() {
            let total: f64 = edges.iter().map(|e| e.1).sum();
            assert!((total - 1.0).abs() < 1e-12, "state {s} sums to {total}");
            let mut toks: Vec<u32> = edges.iter().map(|e| e.0).collect();
            toks.sort_unstable();
            toks.dedup();
            assert_eq!(toks.len(), edges.len(), "state {s} has a repeated token");
        }
        assert_eq!(g.vocab_size(), 53);
        assert!(g.vocab_size() <= crate::config::ModelConfig::tiny().vocab_size);
    }

    #[test]
    fn windows_are_deterministic_and_distinct() {
        let g = GrammarCorpus::new(7, 40).unwrap();
        let a = g.window(123).unwrap();
        assert_eq!(a, GrammarCorpus::new(7, 40).unwrap().window(123).unwrap());
        assert_ne!(a, g.window(124).unwrap());
        assert_ne!(a, GrammarCorpus::new(8, 40).unwrap().window(123).unwrap());
        assert_eq!(a.len(), 41);
        assert_eq!(a[0], 0);
        assert_ne!(
            g.fingerprint(),
            GrammarCorpus::new(7, 41).unwrap().fingerprint()
        );
    }

    #[test]
    fn verbs_agree_with_subject_not_attractor() {
        let g = GrammarCorpus::new(1, 64).unwrap();
        let mut checked = 0;
        for id in 0..50 {
            let text = g.text(id).unwrap();
            let sentences: Vec<&str> = text.split(" . ").collect();
            // The last piece may be cut off by the window.
            for sentence in &sentences[..sentences.len() - 1] {
                let words: Vec<&str> = sentence.split(' ').collect();
                let plural = DET_PL.contains(&words[0]);
                let verb = words.iter().find(|w| {
                    V_INTRANS
                        .iter()
                        .chain(&V_TRANS)
                        .chain(&V_INANIMATE)
                        .any(|(s, p)| s == *w || p == *w)
                });
                if let Some(v) = verb {
                    let is_pl = V_INTRANS
                        .iter()
                        .chain(&V_TRANS)
                        .chain(&V_INANIMATE)
                        .any(|(_, p)| p == v);
                    assert_eq!(plural, is_pl, "{sentence}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 100);
    }

    #[test]
    fn empirical_surprisal_matches_floor() {
        // The log-probability of sampled windows under the automaton averages to the floor.
        let g = GrammarCorpus::new(3, 48).unwrap();
        let n = 3000;
        let total: f64 = (0..n)
            .map(|id| g.surprisal(&g.window(id).unwrap()).unwrap())
            .sum();
        let mean = total / n as f64;
        let floor = g.entropy_floor();
        assert!(
            (mean - floor).abs() < 0.02,
            "empirical {mean} vs floor {floor}"
        );
        assert!(floor < g.bigram_entropy());
        assert!(g.bigram_entropy() < g.unigram_entropy());
        assert!(g.surprisal(&[0, 1]).is_err());
        assert!(g.surprisal(&[1, 1]).is_err());
        assert!(g.unigram_entropy() < (g.vocab_size() as f64).ln());
        assert!((g.entropy_rate() - floor).abs() < 0.1);
    }
}
