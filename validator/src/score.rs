//! Scores: verified work times a quality factor from CLASP, zero for a failed check, decayed over
//! epochs.
//!
//! For miner `m` in epoch `e`:
//!
//! ```text
//! work[m,e]    = gradient hops completed (backward hops; forward hops on the last stage)
//! quality[m,e] = 0                                      if m failed a replay or merge check,
//!                                                       or CLASP flags it as harmful
//!              = 1 / (1 + max(0, effect[m,e]) / scale)  otherwise
//! score[m,e]   = work[m,e] * quality[m,e]
//! S[m]         = sum over e of score[m,e] * decay^(E - e)    (E: the latest epoch scored)
//! weight[m]    = S[m] / sum of S                       (after an optional burn share)
//! ```
//!
//! `effect` is the miner's CLASP effect on the loss (positive: samples through it end with a
//! higher loss than through an average peer of its stage) and `scale` the loss difference that
//! halves a miner's quality.

use std::collections::{BTreeMap, HashMap};

use iota_protocol::api::EpochRecord;

use crate::clasp::HotkeyEffects;

/// One check's outcome as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckRow {
    /// Miner checked.
    pub hotkey: String,
    /// `replay` or `merge`.
    pub kind: String,
    /// What was checked.
    pub target: String,
    /// Whether it passed.
    pub passed: bool,
    /// Measurements.
    pub detail: serde_json::Value,
}

/// Scoring settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreConfig {
    /// Loss difference (nats) at which quality halves.
    pub quality_scale: f64,
    /// Per-epoch decay of older scores, in (0, 1].
    pub decay: f64,
    /// Epochs of history that count.
    pub window: u64,
}

impl Default for ScoreConfig {
    fn default() -> Self {
        Self {
            quality_scale: 0.1,
            decay: 0.7,
            window: 10,
        }
    }
}

/// One miner's score for one epoch, with what went into it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EpochScore {
    /// Miner.
    pub hotkey: String,
    /// Epoch.
    pub epoch: u64,
    /// Gradient hops completed.
    pub work: f64,
    /// Quality factor in [0, 1].
    pub quality: f64,
    /// `work * quality`.
    pub score: f64,
    /// Why quality is zero, if it is.
    pub penalty: Option<String>,
}

/// The quality factor of a miner with CLASP `effect` (`None`: not enough samples to fit).
pub fn quality(
    effect: Option<f64>,
    flagged: bool,
    failed: Option<&str>,
    cfg: &ScoreConfig,
) -> (f64, Option<String>) {
    if let Some(why) = failed {
        return (0.0, Some(why.to_owned()));
    }
    if flagged {
        return (0.0, Some("CLASP: significantly harmful".into()));
    }
    let e = effect.unwrap_or(0.0).max(0.0);
    (1.0 / (1.0 + e / cfg.quality_scale), None)
}

/// Decayed totals per hotkey over `scores` (any epochs; only the `window` latest count).
pub fn decayed_totals(scores: &[EpochScore], cfg: &ScoreConfig) -> BTreeMap<String, f64> {
    let latest = scores.iter().map(|s| s.epoch).max().unwrap_or(0);
    let mut out = BTreeMap::new();
    for s in scores {
        let age = latest - s.epoch;
        if age >= cfg.window {
            continue;
        }
        *out.entry(s.hotkey.clone()).or_insert(0.0) += s.score * cfg.decay.powi(age as i32);
    }
    out
}

/// Normalised weights from totals, with `burn` (a share in [0, 1)) going to `burn_key`.
pub fn weights(totals: &BTreeMap<String, f64>, burn: Option<(&str, f64)>) -> BTreeMap<String, f64> {
    let sum: f64 = totals.values().filter(|v| v.is_finite() && **v > 0.0).sum();
    let keep = 1.0 - burn.map(|(_, b)| b.clamp(0.0, 1.0)).unwrap_or(0.0);
    let mut out: BTreeMap<String, f64> = totals
        .iter()
        .filter(|(_, v)| v.is_finite() && **v > 0.0)
        .map(|(k, v)| (k.clone(), keep * v / sum))
        .collect();
    if sum <= 0.0 {
        out.clear();
    }
    if let Some((key, b)) = burn
        && b > 0.0
    {
        let share = if sum > 0.0 { b.clamp(0.0, 1.0) } else { 1.0 };
        *out.entry(key.to_owned()).or_insert(0.0) += share;
    }
    out
}

/// Why each miner fails this epoch, from its checks: the first failed check of a miner, in the
/// order the checks ran, gives the penalty text. The service and the audit both derive penalties
/// here, the audit from the checks the database recorded.
pub fn failures(checks: &[CheckRow]) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for c in checks.iter().filter(|c| !c.passed) {
        let text = |key: &str| {
            c.detail
                .get(key)
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let why = match c.kind.as_str() {
            "replay" => format!("replay: {}", text("reason")),
            "merge" => format!("merge {} is not the average", c.target),
            "pseudo_gradient" => format!("bad pseudo-gradient: {}", text("error")),
            "object" => format!("bad object ({}): {}", c.target, text("error")),
            other => format!("{other} check failed"),
        };
        out.entry(c.hotkey.clone()).or_insert(why);
    }
    out
}

/// Every miner's score for one finished epoch: work from the epoch record, quality from the
/// CLASP fit (`None`: no fit) and the failed checks.
pub fn epoch_scores(
    record: &EpochRecord,
    stages: u32,
    fit: Option<&HotkeyEffects>,
    failed: &HashMap<String, String>,
    cfg: &ScoreConfig,
) -> Vec<EpochScore> {
    let last = stages.saturating_sub(1);
    let effects = fit.map(HotkeyEffects::by_hotkey).unwrap_or_default();
    record
        .miners
        .iter()
        .map(|m| {
            let work = m.backward_done as f64
                + if m.stage == last {
                    m.forward_done as f64
                } else {
                    0.0
                };
            let (effect, flagged) = effects
                .get(m.hotkey.as_str())
                .map(|(e, f)| (Some(*e), *f))
                .unwrap_or((None, false));
            let (q, penalty) = quality(
                effect,
                flagged,
                failed.get(&m.hotkey).map(String::as_str),
                cfg,
            );
            EpochScore {
                hotkey: m.hotkey.clone(),
                epoch: record.epoch,
                work,
                quality: q,
                score: work * q,
                penalty,
            }
        })
        .collect()
}

/// The weights a validator sets from `scores` (the stored scores of the window ending at the
/// latest epoch among them), by uid: decayed totals, normalised, the burn share to `burn`'s uid,
/// hotkeys not in `uid_of` dropped. `None` when nothing maps to a uid.
pub fn weights_by_uid(
    scores: &[EpochScore],
    cfg: &ScoreConfig,
    burn: Option<(u16, f64)>,
    uid_of: &BTreeMap<String, u16>,
) -> Option<(Vec<u16>, Vec<f64>)> {
    let totals = decayed_totals(scores, cfg);
    let burn_key = burn.map(|(uid, _)| format!("uid:{uid}"));
    let w = weights(
        &totals,
        burn.as_ref()
            .zip(burn_key.as_deref())
            .map(|((_, b), k)| (k, *b)),
    );
    let mut by_uid: BTreeMap<u16, f64> = BTreeMap::new();
    for (k, v) in w {
        let uid = match k.strip_prefix("uid:") {
            Some(u) => u.parse().ok(),
            None => uid_of.get(&k).copied(),
        };
        if let Some(uid) = uid {
            *by_uid.entry(uid).or_insert(0.0) += v;
        }
    }
    if by_uid.is_empty() {
        return None;
    }
    Some(by_uid.into_iter().unzip())
}

/// Weights as the chain client takes them (`f32` scores).
pub fn chain_scores(weights: &[f64]) -> Vec<f32> {
    weights.iter().map(|v| *v as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(h: &str, epoch: u64, score: f64) -> EpochScore {
        EpochScore {
            hotkey: h.into(),
            epoch,
            work: score,
            quality: 1.0,
            score,
            penalty: None,
        }
    }

    #[test]
    fn quality_falls_with_harm_and_zeroes_on_failure() {
        let cfg = ScoreConfig::default();
        assert_eq!(quality(Some(-0.3), false, None, &cfg).0, 1.0);
        assert!((quality(Some(0.1), false, None, &cfg).0 - 0.5).abs() < 1e-12);
        assert_eq!(quality(Some(0.0), true, None, &cfg).0, 0.0);
        assert_eq!(quality(Some(0.0), false, Some("replay"), &cfg).0, 0.0);
    }

    #[test]
    fn older_epochs_count_less_and_fall_out_of_the_window() {
        let cfg = ScoreConfig {
            decay: 0.5,
            window: 2,
            ..ScoreConfig::default()
        };
        let t = decayed_totals(
            &[
                s("a", 5, 10.0),
                s("a", 4, 10.0),
                s("a", 3, 10.0),
                s("b", 5, 10.0),
            ],
            &cfg,
        );
        assert_eq!(t["a"], 15.0);
        assert_eq!(t["b"], 10.0);
    }

    #[test]
    fn the_first_failed_check_gives_the_penalty() {
        let row = |h: &str, kind: &str, passed: bool, detail: serde_json::Value| CheckRow {
            hotkey: h.into(),
            kind: kind.into(),
            target: "1/0".into(),
            passed,
            detail,
        };
        let checks = vec![
            row("a", "replay", true, serde_json::json!({"reason": null})),
            row(
                "b",
                "pseudo_gradient",
                false,
                serde_json::json!({"error": "short"}),
            ),
            row(
                "b",
                "replay",
                false,
                serde_json::json!({"reason": "task 3"}),
            ),
            row(
                "c",
                "replay",
                false,
                serde_json::json!({"reason": "task 9"}),
            ),
            row("d", "merge", false, serde_json::json!({})),
        ];
        let f = failures(&checks);
        assert_eq!(f.len(), 3, "{f:?}");
        assert_eq!(f["b"], "bad pseudo-gradient: short");
        assert_eq!(f["c"], "replay: task 9");
        assert_eq!(f["d"], "merge 1/0 is not the average");
    }

    #[test]
    fn weights_map_to_uids_with_the_burn_uid() {
        let cfg = ScoreConfig::default();
        let uid_of: BTreeMap<String, u16> = [("a".to_string(), 3), ("b".to_string(), 1)].into();
        let scores = [s("a", 2, 3.0), s("b", 2, 1.0), s("gone", 2, 4.0)];
        let (uids, w) = weights_by_uid(&scores, &cfg, Some((0, 0.5)), &uid_of).expect("weights");
        assert_eq!(uids, vec![0, 1, 3]);
        // "gone" has no uid: its share is dropped, not handed to others.
        assert!((w[0] - 0.5).abs() < 1e-12);
        assert!((w[1] - 0.0625).abs() < 1e-12 && (w[2] - 0.1875).abs() < 1e-12);
        assert_eq!(weights_by_uid(&scores, &cfg, None, &BTreeMap::new()), None);
    }

    #[test]
    fn weights_sum_to_one_with_the_burn() {
        let t: BTreeMap<String, f64> = [
            ("a".to_string(), 3.0),
            ("b".to_string(), 1.0),
            ("c".to_string(), 0.0),
        ]
        .into();
        let w = weights(&t, Some(("owner", 0.2)));
        assert!((w.values().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((w["a"] - 0.6).abs() < 1e-12 && (w["owner"] - 0.2).abs() < 1e-12);
        assert!(!w.contains_key("c"));
        let none = weights(&BTreeMap::new(), Some(("owner", 0.2)));
        assert_eq!(none["owner"], 1.0, "nothing earned: everything to the burn");
    }
}
