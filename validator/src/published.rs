//! What a validator publishes with each scored epoch, so that anyone can recompute its scores
//! and weights from public records alone: the settings it scored with and, per miner, what went
//! into the score. Both directions live here, the validator's and the auditor's.

use std::collections::BTreeMap;

use iota_protocol::api::{MinerScore, ScoreSubmission, ScoringParams, SpotCheckResult, WeightsSet};

use crate::clasp::ClaspConfig;
use crate::score::{CheckRow, EpochScore, ScoreConfig};

/// The settings as published.
pub fn params(clasp: &ClaspConfig, score: &ScoreConfig, burn: Option<(u16, f64)>) -> ScoringParams {
    ScoringParams {
        clasp_ridge: clasp.ridge,
        clasp_z_threshold: clasp.z_threshold,
        clasp_min_effect: clasp.min_effect,
        clasp_min_samples: clasp.min_samples,
        clasp_window: clasp.window,
        clasp_median_of_seen: clasp.median_of_seen,
        quality_scale: score.quality_scale,
        decay: score.decay,
        window: score.window,
        burn_uid: burn.map(|(uid, _)| uid),
        burn_share: burn.map_or(0.0, |(_, share)| share),
    }
}

/// The settings a publication names, as the scoring code takes them.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// CLASP's.
    pub clasp: ClaspConfig,
    /// The score's.
    pub score: ScoreConfig,
    /// The burn uid and its share.
    pub burn: Option<(u16, f64)>,
}

/// Reads published settings back.
pub fn settings(p: &ScoringParams) -> Settings {
    Settings {
        clasp: ClaspConfig {
            ridge: p.clasp_ridge,
            z_threshold: p.clasp_z_threshold,
            min_effect: p.clasp_min_effect,
            min_samples: p.clasp_min_samples,
            window: p.clasp_window,
            median_of_seen: p.clasp_median_of_seen,
        },
        score: ScoreConfig {
            quality_scale: p.quality_scale,
            decay: p.decay,
            window: p.window,
        },
        burn: p
            .burn_uid
            .filter(|_| p.burn_share > 0.0)
            .map(|uid| (uid, p.burn_share)),
    }
}

/// An epoch's publication: every miner's score with its work, quality, penalty and CLASP
/// effect and flag (`effects`, by hotkey), the settings, and the weights once on chain.
pub fn submission(
    scores: &[EpochScore],
    effects: &BTreeMap<&str, (f64, bool)>,
    params: ScoringParams,
    weights: Option<WeightsSet>,
) -> ScoreSubmission {
    ScoreSubmission {
        scores: scores
            .iter()
            .map(|s| {
                let effect = effects.get(s.hotkey.as_str());
                MinerScore {
                    hotkey: s.hotkey.clone(),
                    score: s.score,
                    work: Some(s.work),
                    quality: Some(s.quality),
                    penalty: s.penalty.clone(),
                    effect: effect.map(|e| e.0),
                    flagged: effect.map(|e| e.1),
                }
            })
            .collect(),
        weights,
        params: Some(params),
    }
}

/// A published score as the scoring code writes it (`None`: published without its parts).
pub fn epoch_score(epoch: u64, s: &MinerScore) -> Option<EpochScore> {
    Some(EpochScore {
        hotkey: s.hotkey.clone(),
        epoch,
        work: s.work?,
        quality: s.quality?,
        score: s.score,
        penalty: s.penalty.clone(),
    })
}

impl From<&SpotCheckResult> for CheckRow {
    /// A check as published, as the scoring code reads it (its detail is JSON text; anything
    /// else reads as no detail, as when it was scored).
    fn from(c: &SpotCheckResult) -> Self {
        Self {
            hotkey: c.hotkey.clone(),
            kind: c.kind.clone(),
            target: c.target.clone(),
            passed: c.passed,
            detail: serde_json::from_str(&c.detail).unwrap_or(serde_json::Value::Null),
        }
    }
}

impl From<CheckRow> for SpotCheckResult {
    fn from(c: CheckRow) -> Self {
        Self {
            hotkey: c.hotkey,
            kind: c.kind,
            target: c.target,
            passed: c.passed,
            detail: c.detail.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_read_back_as_published() {
        let clasp = ClaspConfig {
            ridge: 2.5,
            z_threshold: 4.0,
            min_effect: 0.03,
            min_samples: 12,
            window: 3,
            median_of_seen: false,
        };
        let score = ScoreConfig {
            quality_scale: 0.2,
            decay: 0.5,
            window: 7,
        };
        for burn in [None, Some((3, 0.25))] {
            let back = settings(&params(&clasp, &score, burn));
            assert_eq!(back, Settings { clasp, score, burn });
        }
    }

    /// A publication from before the median rule was a setting is recomputed under the rule
    /// it was scored with: the median of every miner.
    #[test]
    fn settings_published_before_the_median_rule_read_as_the_old_rule() {
        let now = params(&ClaspConfig::default(), &ScoreConfig::default(), None);
        assert!(settings(&now).clasp.median_of_seen);
        let mut json = serde_json::to_value(&now).expect("json");
        let removed = json
            .as_object_mut()
            .and_then(|o| o.remove("clasp_median_of_seen"));
        assert_eq!(removed, Some(serde_json::Value::Bool(true)));
        let old: ScoringParams = serde_json::from_value(json).expect("an older publication");
        assert!(!settings(&old).clasp.median_of_seen);
    }

    #[test]
    fn a_score_reads_back_with_its_parts_and_not_without() {
        let s = EpochScore {
            hotkey: "5miner".into(),
            epoch: 4,
            work: 12.0,
            quality: 0.5,
            score: 6.0,
            penalty: Some("replay: loss differs".into()),
        };
        let effects = BTreeMap::from([("5miner", (0.3, true))]);
        let sub = submission(
            std::slice::from_ref(&s),
            &effects,
            params(&ClaspConfig::default(), &ScoreConfig::default(), None),
            None,
        );
        assert_eq!(sub.scores[0].effect, Some(0.3));
        assert_eq!(sub.scores[0].flagged, Some(true));
        assert_eq!(epoch_score(4, &sub.scores[0]), Some(s));
        let bare = MinerScore {
            hotkey: "5miner".into(),
            score: 6.0,
            ..MinerScore::default()
        };
        assert_eq!(epoch_score(4, &bare), None);
    }
}
