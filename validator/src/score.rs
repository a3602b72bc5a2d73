//! Scores: verified work times a quality factor from CLASP, zero for a failed check, decayed over
//! epochs.
//!
//! For miner `m` in epoch `e`:
//!
//! ```text
//! work[m,e]    = hops[m,e] * merged[m,e]
//! hops[m,e]    = gradient hops completed (backward hops; forward hops on the last stage)
//! merged[m,e]  = share of its stage's partitions whose accepted merge holds m's pseudo-gradient
//! quality[m,e] = 0                                      if m failed a replay or merge check,
//!                                                       or CLASP flags it as harmful
//!              = 1 / (1 + max(0, effect[m,e] - stage median) / scale)  otherwise
//! score[m,e]   = work[m,e] * quality[m,e]
//! S[m]         = 0 if m failed a check in any epoch of the window,
//!              = sum over e of score[m,e] * decay^(E - e)    (E: the latest epoch scored) otherwise
//! weight[m]    = S[m] / sum of S                       (after an optional burn share)
//! ```
//!
//! A failed check costs the whole window, not only its epoch: a miner that cheats in some epochs
//! and works honestly in others (stale weights are honest in a miner's first epoch; a cheater
//! that is drawn for a replay only now and then) would otherwise keep its honest epochs' pay and
//! come out ahead of honest miners. A CLASP flag, which is statistical, costs only its epoch.
//!
//! Only work that reaches the model is paid: a miner that withholds its pseudo-gradient, or whose
//! partitions keep their old weights because no merge of them was verified, earns nothing for
//! the hops those partitions stand for.
//!
//! `effect` is the miner's CLASP effect on the loss (positive: samples through it end with a
//! higher loss than through an average peer of its stage) and `scale` the loss difference that
//! halves a miner's quality.

use std::collections::{BTreeMap, HashMap};

use iota_protocol::api::{EpochRecord, PartitionState};

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
    /// Gradient hops completed, times the share of the miner's pseudo-gradient merged.
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
        return (0.0, Some(CLASP_PENALTY.into()));
    }
    let e = effect.unwrap_or(0.0).max(0.0);
    (1.0 / (1.0 + e / cfg.quality_scale), None)
}

/// The penalty of a miner CLASP flags as harmful.
pub const CLASP_PENALTY: &str = "CLASP: significantly harmful";

/// Decayed totals per hotkey over `scores` (any epochs; only the `window` latest count), zero
/// for a miner that failed a check (any penalty but a CLASP flag) in an epoch of the window.
pub fn decayed_totals(scores: &[EpochScore], cfg: &ScoreConfig) -> BTreeMap<String, f64> {
    let latest = scores.iter().map(|s| s.epoch).max().unwrap_or(0);
    let in_window = |s: &&EpochScore| latest - s.epoch < cfg.window;
    let caught: std::collections::BTreeSet<&str> = scores
        .iter()
        .filter(in_window)
        .filter(|s| s.penalty.as_deref().is_some_and(|p| p != CLASP_PENALTY))
        .map(|s| s.hotkey.as_str())
        .collect();
    let mut out = BTreeMap::new();
    for s in scores.iter().filter(in_window) {
        let age = latest - s.epoch;
        let score = match caught.contains(s.hotkey.as_str()) {
            true => 0.0,
            false => s.score * cfg.decay.powi(age as i32),
        };
        *out.entry(s.hotkey.clone()).or_insert(0.0) += score;
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

/// Each miner's share of its stage's partitions whose accepted merge holds its pseudo-gradient
/// (contributions are frozen when merging starts, so an accepted partition holds every one
/// uploaded for it). Miners that uploaded nothing are absent: their share is zero.
pub fn merged_shares(record: &EpochRecord) -> HashMap<&str, f64> {
    let mut partitions: HashMap<u32, usize> = HashMap::new();
    let mut accepted: std::collections::HashSet<(u32, u32)> = std::collections::HashSet::new();
    for p in &record.partitions {
        *partitions.entry(p.stage).or_default() += 1;
        if p.state == PartitionState::Accepted {
            accepted.insert((p.stage, p.partition));
        }
    }
    let mut merged: HashMap<&str, std::collections::BTreeSet<(u32, u32)>> = HashMap::new();
    for pg in &record.pseudo_gradients {
        if pg.epoch == record.epoch && accepted.contains(&(pg.stage, pg.partition)) {
            merged
                .entry(pg.hotkey.as_str())
                .or_default()
                .insert((pg.stage, pg.partition));
        }
    }
    record
        .miners
        .iter()
        .filter_map(|m| {
            let total = *partitions.get(&m.stage)?;
            let mine = merged.get(m.hotkey.as_str())?;
            let count = mine.iter().filter(|(stage, _)| *stage == m.stage).count();
            Some((m.hotkey.as_str(), count as f64 / total.max(1) as f64))
        })
        .collect()
}

/// Every miner's score for one finished epoch: work from the epoch record (hops times the
/// merged share of its pseudo-gradient), quality from the CLASP fit (`None`: no fit) and the
/// failed checks.
pub fn epoch_scores(
    record: &EpochRecord,
    stages: u32,
    fit: Option<&HotkeyEffects>,
    failed: &HashMap<String, String>,
    cfg: &ScoreConfig,
) -> Vec<EpochScore> {
    let last = stages.saturating_sub(1);
    let effects = fit
        .map(HotkeyEffects::over_median_by_hotkey)
        .unwrap_or_default();
    let merged = merged_shares(record);
    record
        .miners
        .iter()
        .map(|m| {
            let hops = m.backward_done as f64
                + if m.stage == last {
                    m.forward_done as f64
                } else {
                    0.0
                };
            let work = hops * merged.get(m.hotkey.as_str()).copied().unwrap_or(0.0);
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
    fn a_failed_check_costs_the_window_and_a_clasp_flag_its_epoch() {
        let cfg = ScoreConfig {
            decay: 0.5,
            window: 3,
            ..ScoreConfig::default()
        };
        let caught = |h: &str, epoch: u64, why: &str| EpochScore {
            quality: 0.0,
            score: 0.0,
            penalty: Some(why.into()),
            ..s(h, epoch, 10.0)
        };
        let t = decayed_totals(
            &[
                // Honest in epochs 3 and 5, caught by a replay in 4.
                s("a", 5, 10.0),
                caught("a", 4, "replay: task 9"),
                s("a", 3, 10.0),
                // Flagged by CLASP in 4: only that epoch is lost.
                s("b", 5, 10.0),
                caught("b", 4, CLASP_PENALTY),
                s("b", 3, 10.0),
                // Caught in 2, which has left the window: paid again.
                s("c", 5, 10.0),
                caught("c", 2, "merge 1/0 is not the average"),
            ],
            &cfg,
        );
        assert_eq!(t["a"], 0.0);
        assert_eq!(t["b"], 12.5);
        assert_eq!(t["c"], 10.0);
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

    /// An epoch of one stage with two partitions: `a` merged in both, `b` in one (the other
    /// kept its weights), `c` uploaded nothing, `d` uploaded to the accepted partition only.
    fn record() -> EpochRecord {
        use iota_protocol::api::{MinerWork, PartitionStatus, PseudoGradientRecord};
        let work = |h: &str, backward: u64| MinerWork {
            hotkey: h.into(),
            stage: 0,
            forward_done: backward,
            backward_done: backward,
            failed: 0,
        };
        let partition = |p: u32, state: PartitionState| PartitionStatus {
            epoch: 4,
            stage: 0,
            partition: p,
            state,
            owners: Vec::new(),
            results: Vec::new(),
            accepted: None,
            resolved_by: None,
        };
        let pg = |h: &str, p: u32| PseudoGradientRecord {
            epoch: 4,
            stage: 0,
            partition: p,
            hotkey: h.into(),
            blob: iota_protocol::blob::BlobDescriptor {
                key: format!("{h}/{p}"),
                size: 4,
                dtype: iota_protocol::blob::BlobDtype::F32,
                shape: vec![1],
                blake3: "00".into(),
                url: None,
            },
            weight: 1.0,
        };
        EpochRecord {
            epoch: 4,
            phase: None,
            miners: vec![work("a", 10), work("b", 10), work("c", 10), work("d", 10)],
            pseudo_gradients: vec![pg("a", 0), pg("a", 1), pg("b", 0), pg("d", 0)],
            partitions: vec![
                partition(0, PartitionState::Accepted),
                partition(1, PartitionState::Unchanged),
            ],
            start_weights: Vec::new(),
        }
    }

    #[test]
    fn only_hops_whose_pseudo_gradient_was_merged_are_paid() {
        let mut rec = record();
        rec.partitions[1].state = PartitionState::Accepted;
        let cfg = ScoreConfig::default();
        let work = |rec: &EpochRecord| -> BTreeMap<String, f64> {
            epoch_scores(rec, 2, None, &HashMap::new(), &cfg)
                .into_iter()
                .map(|s| (s.hotkey, s.work))
                .collect()
        };
        // Both partitions merged: a miner that withheld gets nothing, a partial upload half.
        let w = work(&rec);
        assert_eq!((w["a"], w["b"], w["c"], w["d"]), (10.0, 5.0, 0.0, 5.0));
        // Partition 1 kept its weights: nobody is paid for the hops it stands for.
        let w = work(&record());
        assert_eq!((w["a"], w["b"], w["c"], w["d"]), (5.0, 5.0, 0.0, 5.0));
        // A pseudo-gradient of another stage counts for nothing in this one.
        let mut rec = record();
        rec.pseudo_gradients.iter_mut().for_each(|p| p.stage = 1);
        assert!(work(&rec).values().all(|w| *w == 0.0));
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
