//! `iota validator audit --validator HOTKEY --epoch N`: the audit anyone can run, with neither
//! the validator's database nor any hotkey.
//!
//! Everything comes from public records: the orchestrator's finished-epoch records and samples
//! (`GET /v1/epochs/{epoch}`, `…/samples`), what the validator published with each epoch it
//! scored (`…/scores`: its settings, every miner's score with its parts and CLASP effect, and
//! the weights once on chain; `…/spot-checks`: the checks its penalties come from) and the
//! chain (the metagraph and the validator's `Weights` row at the block the weights landed in).
//! The score window is the epochs of the window the validator published scores for; each is
//! recomputed with the settings published with it, the weights with the audited epoch's.
//!
//! Spot-check outcomes are taken as published, not re-run (a replay takes minutes and the
//! objects may be collected); a check the validator did not publish cannot be told apart from
//! one it did not make, and a penalty it applied without a published check shows as a
//! difference.

use std::collections::{BTreeMap, BTreeSet};

use iota_chain::Subtensor;
use iota_protocol::api::{MinerScore, ScoreRecord, SpotCheckReport};
use iota_protocol::client::ApiClient;

use super::{
    AuditReport, ChainCheck, EpochEvidence, Recomputed, SubmissionSummary, WeightAudit,
    compare_scores, miner_rows, recompute_epoch, recomputed_weights,
};
use crate::error::ValidatorError;
use crate::onchain::{at_number, weights_row};
use crate::published::{Settings, epoch_score, settings};
use crate::score::{CheckRow, EpochScore};
use crate::service::{MAX_SAMPLE_RECORDS, read_pages};

/// An auditor of any validator of one run and subnet.
pub struct PublicAudit {
    client: ApiClient,
    chain: Subtensor,
    netuid: u16,
}

impl PublicAudit {
    /// An auditor reading the orchestrator through `client` (no key needed:
    /// [`ApiClient::public`]) and the chain through `chain`.
    pub fn new(client: ApiClient, chain: Subtensor, netuid: u16) -> Self {
        Self {
            client,
            chain,
            netuid,
        }
    }

    /// The public records of a finished `epoch`.
    pub async fn evidence(&self, epoch: u64) -> Result<EpochEvidence, ValidatorError> {
        let record = self.client.finished_epoch(epoch).await?;
        let mut samples = Vec::new();
        let client = &self.client;
        read_pages(
            "sample records",
            MAX_SAMPLE_RECORDS,
            |after| async move {
                let page = client.finished_samples(epoch, after, 1000).await?;
                Ok((page.samples, page.next_after))
            },
            |s| samples.push(s),
        )
        .await?;
        Ok(EpochEvidence { record, samples })
    }

    /// What `validator` published for `epoch`, if anything.
    async fn publication(
        &self,
        validator: &str,
        epoch: u64,
    ) -> Result<Option<ScoreRecord>, ValidatorError> {
        Ok(self
            .client
            .epoch_scores(epoch)
            .await?
            .into_iter()
            .find(|r| r.validator == validator && r.epoch == epoch))
    }

    /// The spot checks `validator` published for `epoch`.
    async fn checks(
        &self,
        validator: &str,
        epoch: u64,
    ) -> Result<Option<SpotCheckReport>, ValidatorError> {
        Ok(self
            .client
            .reported_spot_checks(epoch)
            .await?
            .into_iter()
            .find(|r| r.validator == validator))
    }

    /// Audits what `validator` (SS58) published for `epoch`.
    pub async fn audit(&self, validator: &str, epoch: u64) -> Result<AuditReport, ValidatorError> {
        self.audit_with(validator, epoch, BTreeMap::new()).await
    }

    /// Audits `epoch`, taking the records of the epochs in `evidence` as given (the others are
    /// fetched).
    pub async fn audit_with(
        &self,
        validator: &str,
        epoch: u64,
        mut evidence: BTreeMap<u64, EpochEvidence>,
    ) -> Result<AuditReport, ValidatorError> {
        let run = self.client.run_info().await?;
        let stages = run.config.stages;
        let published = self.publication(validator, epoch).await?.ok_or_else(|| {
            ValidatorError::Config(format!(
                "{validator} published no scores for epoch {epoch} of run {}",
                run.id
            ))
        })?;
        let Some(params) = published.params.clone() else {
            return Err(ValidatorError::Config(format!(
                "{validator} published epoch {epoch}'s scores without the settings they were \
                 scored with: they cannot be recomputed"
            )));
        };
        // Bounds what the audit fetches and holds, whatever the orchestrator passed on.
        if !params.is_valid() {
            return Err(ValidatorError::BadAnswer(format!(
                "{validator}'s published settings for epoch {epoch} are out of bounds: {params:?}"
            )));
        }
        let audited = settings(&params);
        let from = (epoch + 1).saturating_sub(params.window);
        let mut mismatches = Vec::new();

        // The window: the epochs of it the validator published scores for.
        let mut window = Vec::new();
        let mut publications = Vec::new();
        for e in from..epoch {
            if let Some(p) = self.publication(validator, e).await? {
                window.push(e);
                publications.push(p);
            }
        }
        window.push(epoch);
        publications.push(published.clone());

        // Each epoch is recomputed with the settings published with it; the records its CLASP
        // window needs are fetched once.
        let settings_of: Vec<Settings> = publications
            .iter()
            .map(|p| match &p.params {
                Some(p) if p.is_valid() => settings(p),
                _ => audited.clone(),
            })
            .collect();
        let needed = window
            .iter()
            .zip(&settings_of)
            .flat_map(|(e, s)| super::clasp_epochs(*e, s.clasp.window))
            .collect();
        super::fill(&mut evidence, needed, |e| self.evidence(e)).await?;

        let mut recomputed: Vec<EpochScore> = Vec::new();
        let mut audited_rows = Vec::new();
        let mut samples_fitted = 0;
        for ((&e, publication), settings) in window.iter().zip(&publications).zip(&settings_of) {
            let Some(ev) = evidence.get(&e) else {
                continue;
            };
            if ev.record.epoch != e {
                mismatches.push(format!(
                    "epoch {e}: the record given is epoch {}'s",
                    ev.record.epoch
                ));
            }
            let checks: Vec<CheckRow> = match self.checks(validator, e).await? {
                Some(report) => report.checks.iter().map(CheckRow::from).collect(),
                None => {
                    mismatches.push(format!("epoch {e}: no spot checks published"));
                    Vec::new()
                }
            };
            if publication.params.as_ref().is_none_or(|p| !p.is_valid()) {
                mismatches.push(format!(
                    "epoch {e}: published without valid settings (recomputed with epoch {epoch}'s)"
                ));
            }
            let samples = super::pooled(&evidence, e, settings.clasp.window);
            let (fit, scores) = recompute_epoch(e, stages, &ev.record, &samples, &checks, settings);
            let (recorded, recorded_effects) = recorded(e, &publication.scores, &mut mismatches);
            compare_scores(e, &scores, &recorded, &mut mismatches);
            let effects = fit
                .as_ref()
                .map(crate::clasp::HotkeyEffects::by_hotkey)
                .unwrap_or_default();
            compare_effects(e, &effects, &recorded_effects, &mut mismatches);
            if e == epoch {
                samples_fitted = fit.as_ref().map(|f| f.fit.samples).unwrap_or(0);
                audited_rows = miner_rows(&scores, &recorded, &effects, &recorded_effects);
            }
            recomputed.extend(scores);
        }
        let records_match = mismatches.is_empty();

        // The weights, against what was published and what is on chain.
        let (weights, chain, submission) = match &published.weights {
            None => (
                Vec::new(),
                ChainCheck::NotApplicable {
                    reason: format!(
                        "{validator} published no weights from epoch {epoch} (none reached the \
                         chain, or not yet)"
                    ),
                },
                None,
            ),
            Some(sent) => {
                let (rows, chain) = self
                    .audit_weights(validator, sent, &recomputed, &audited, &mut mismatches)
                    .await?;
                let summary = SubmissionSummary {
                    id: None,
                    state: "on chain".into(),
                    block: Some(sent.block),
                };
                (rows, chain, Some(summary))
            }
        };
        if let ChainCheck::Unavailable { reason } = &chain {
            mismatches.push(format!("chain not verified: {reason}"));
        }
        let matches = mismatches.is_empty() && chain.matches();
        Ok(AuditReport {
            run_id: run.id,
            epoch,
            window,
            samples: samples_fitted,
            checks_source: "the spot checks the validator published",
            records: "published scores and weights",
            miners: audited_rows,
            submission,
            weights,
            chain,
            mismatches,
            records_match,
            matches,
        })
    }

    /// The recomputed weights converted as the chain takes them, beside the published values
    /// and the validator's `Weights` row at the block they landed in.
    async fn audit_weights(
        &self,
        validator: &str,
        sent: &iota_protocol::api::WeightsSet,
        recomputed: &[EpochScore],
        audited: &Settings,
        mismatches: &mut Vec<String>,
    ) -> Result<(Vec<WeightAudit>, ChainCheck), ValidatorError> {
        let at = at_number(&self.chain, sent.block).await?;
        let meta = self.chain.metagraph_at(&at, self.netuid).await?;
        let Recomputed {
            hotkey_of,
            mine,
            expected,
        } = recomputed_weights(&meta, recomputed, &audited.score, audited.burn)?;
        let published: BTreeMap<u16, u16> = sent
            .uids
            .iter()
            .copied()
            .zip(sent.weights.iter().copied())
            .collect();
        let validator_uid = meta
            .neurons
            .iter()
            .find(|n| n.hotkey.ss58() == validator)
            .map(|n| n.uid);
        let (chain, on_chain) = match validator_uid {
            None => (
                ChainCheck::Unavailable {
                    reason: format!("{validator} has no uid at block {}", sent.block),
                },
                None,
            ),
            Some(uid) => match weights_row(&self.chain, &at, self.netuid, uid).await {
                Ok(row) => {
                    let row: BTreeMap<u16, u16> = row.into_iter().collect();
                    let check = ChainCheck::Weights {
                        block: sent.block,
                        uid,
                        matches: row == expected,
                    };
                    (check, Some(row))
                }
                Err(e) => (
                    ChainCheck::Unavailable {
                        reason: format!(
                            "the Weights row at block {} cannot be read ({e}); an archive node can",
                            sent.block
                        ),
                    },
                    None,
                ),
            },
        };
        let all: BTreeSet<u16> = expected
            .keys()
            .chain(published.keys())
            .chain(on_chain.iter().flat_map(|m| m.keys()))
            .copied()
            .collect();
        let rows = all
            .into_iter()
            .map(|uid| {
                let chain_expected = expected.get(&uid).copied();
                let sent_value = published.get(&uid).copied();
                let chain_value = on_chain.as_ref().map(|m| m.get(&uid).copied());
                let published_ok = sent_value == chain_expected;
                let chain_ok = chain_value.is_none_or(|v| v == chain_expected);
                if !published_ok {
                    mismatches.push(format!(
                        "weight of uid {uid}: recomputed {}, published {}",
                        super::opt(chain_expected),
                        super::opt(sent_value)
                    ));
                }
                if !chain_ok {
                    mismatches.push(format!(
                        "weight of uid {uid}: recomputed {} on chain, the chain has {}",
                        super::opt(chain_expected),
                        super::opt(chain_value.flatten())
                    ));
                }
                WeightAudit {
                    uid,
                    hotkey: hotkey_of.get(&uid).cloned(),
                    recomputed: mine.get(&uid).copied().unwrap_or(0.0),
                    stored: None,
                    published: sent_value,
                    chain_expected,
                    on_chain: chain_value.flatten(),
                    matches: published_ok && chain_ok,
                }
            })
            .collect();
        Ok((rows, chain))
    }
}

/// The published scores of `epoch` as the scoring code writes them, and the published CLASP
/// effects by hotkey; a score published without its parts is a difference.
fn recorded(
    epoch: u64,
    published: &[MinerScore],
    mismatches: &mut Vec<String>,
) -> (Vec<EpochScore>, BTreeMap<String, (f64, bool)>) {
    let mut scores = Vec::new();
    let mut effects = BTreeMap::new();
    for s in published {
        match epoch_score(epoch, s) {
            Some(score) => scores.push(score),
            None => mismatches.push(format!(
                "epoch {epoch}: the score of {} was published without its work and quality",
                s.hotkey
            )),
        }
        if let Some(effect) = s.effect {
            effects.insert(s.hotkey.clone(), (effect, s.flagged.unwrap_or(false)));
        }
    }
    (scores, effects)
}

/// Compares recomputed CLASP effects and flags with the published ones.
fn compare_effects(
    epoch: u64,
    mine: &BTreeMap<&str, (f64, bool)>,
    published: &BTreeMap<String, (f64, bool)>,
    out: &mut Vec<String>,
) {
    let keys: BTreeSet<&str> = mine
        .keys()
        .copied()
        .chain(published.keys().map(String::as_str))
        .collect();
    for k in keys {
        match (mine.get(k), published.get(k)) {
            (Some(a), Some(b)) if super::close(a.0, b.0) && a.1 == b.1 => {}
            (a, b) => out.push(format!(
                "epoch {epoch}: CLASP effect of {k}: recomputed {}, published {}",
                describe(a),
                describe(b)
            )),
        }
    }
}

fn describe(e: Option<&(f64, bool)>) -> String {
    e.map_or_else(
        || "none".into(),
        |(v, flagged)| format!("{v:.6}{}", if *flagged { " (flagged)" } else { "" }),
    )
}
