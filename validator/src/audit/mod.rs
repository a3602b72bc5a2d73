//! `iota validator audit --epoch N`: recompute, from the orchestrator's public epoch records,
//! the CLASP fit, the scores and the weights this validator set from epoch `N`, and compare them
//! with (a) what its database recorded and (b) what is on chain.
//!
//! * The fit and the scores of every scored epoch of the score window ending at `N` are
//!   recomputed from the epoch record (work per miner) and the sample records (pathways and
//!   losses), with the functions the service scores with ([`fit_epoch`],
//!   [`crate::score::epoch_scores`]).
//! * Spot-check outcomes are not re-run: they are the validator's own measurements and come from
//!   its `spot_checks` table (a replay takes minutes of compute and the hops it needs may have
//!   been pruned by the orchestrator). Penalties are re-derived from them
//!   ([`crate::score::failures`]).
//! * The weights are rebuilt with [`crate::score::weights_by_uid`] and converted for the chain
//!   with the chain client's own conversion, chosen as the service's submission chooses it,
//!   then compared with the `Weights` row of this
//!   validator's uid at the block they landed in (set or revealed), or, for a commit not yet
//!   revealed, by recomputing the commit hash with the salt kept in `pending_commits` and looking
//!   it up in the chain's `WeightCommits`.
//!
//! [`public`] does the same for anyone, without the validator's database or hotkey: from the
//! orchestrator's public records, what the validator published with each epoch (its settings,
//! spot checks, scores and the weights they produced) and the chain.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use iota_chain::timelocked::Fate;
use iota_chain::weights::commit_hash;
use iota_chain::{ChainError, Metagraph};
use iota_protocol::api::{EpochRecord, SampleRecord};
use serde::Serialize;

use crate::clasp::HotkeyEffects;
use crate::error::ValidatorError;
use crate::onchain::{at_number, commit_hashes, timelocked_commit_hashes, weights_row};
use crate::published::Settings;
use crate::score::CheckRow;
use crate::score::{EpochScore, epoch_scores, failures, weights_by_uid};
use crate::service::{PROCESS_WEIGHTS, Validator, chain_values, fit_epoch};
use crate::store::{EffectRow, SubmissionRow};

pub mod public;

/// The public records of one epoch an audit recomputes from.
#[derive(Clone, Debug)]
pub struct EpochEvidence {
    /// The epoch record (work per miner).
    pub record: EpochRecord,
    /// Every sample with its pathway and loss (CLASP's input).
    pub samples: Vec<SampleRecord>,
}

/// One miner's score in the audited epoch: recomputed and as stored.
#[derive(Clone, Debug, Serialize)]
pub struct MinerAudit {
    /// Miner.
    pub hotkey: String,
    /// Recomputed score.
    pub recomputed: EpochScore,
    /// Stored score, if there is one.
    pub stored: Option<EpochScore>,
    /// Recomputed CLASP effect and flag.
    pub effect: Option<(f64, bool)>,
    /// Stored CLASP effect and flag.
    pub stored_effect: Option<(f64, bool)>,
    /// Whether score and effect agree.
    pub matches: bool,
}

/// One uid's weight: recomputed, as recorded and as on chain.
#[derive(Clone, Debug, Serialize)]
pub struct WeightAudit {
    /// Uid.
    pub uid: u16,
    /// Its hotkey at the submission's block, if known.
    pub hotkey: Option<String>,
    /// Recomputed normalised weight (0 when the recomputation gives none).
    pub recomputed: f64,
    /// Recorded in the submission (None: not in it, or a public audit).
    pub stored: Option<f64>,
    /// The value the validator published as sent to the chain (public audit).
    pub published: Option<u16>,
    /// The recomputed weight as the chain takes it (`u16`, max-normalised).
    pub chain_expected: Option<u16>,
    /// The value on chain (set or revealed submissions).
    pub on_chain: Option<u16>,
    /// Whether everything that could be compared agrees.
    pub matches: bool,
}

/// What was compared on chain.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ChainCheck {
    /// The `Weights` row of the validator's uid at the block the weights landed in.
    Weights {
        /// Block read.
        block: u64,
        /// Validator uid.
        uid: u16,
        /// Whether the row is exactly the recomputed one.
        matches: bool,
    },
    /// A commit not revealed yet: the hash recomputed with the stored salt.
    Commit {
        /// Hash recorded at submission.
        recorded: String,
        /// Hash of the recomputed weights with the stored salt and version key.
        recomputed: String,
        /// Whether the recorded hash is among the validator's commits on chain now.
        on_chain: bool,
        /// Recomputed equals recorded, and it is on chain.
        matches: bool,
    },
    /// A drand-timelocked commit not revealed yet. Nobody can read the ciphertext before its
    /// round, so what is checked is what the validator sealed (kept in its commit store) against
    /// the recomputed weights, and that the ciphertext is among its commits on chain; after the
    /// reveal the audit compares the chain's `Weights` row.
    Sealed {
        /// Blake2-256 of the ciphertext, as recorded at submission.
        recorded: String,
        /// The drand round that opens it.
        reveal_round: u64,
        /// The sealed uids and values equal the recomputed ones.
        sealed_matches: bool,
        /// The ciphertext is among the validator's timelocked commits on chain now.
        on_chain: bool,
        /// Both.
        matches: bool,
    },
    /// Nothing to compare: no weights reached the chain from this epoch.
    NotApplicable {
        /// Why.
        reason: String,
    },
    /// The chain could not be checked.
    Unavailable {
        /// Why.
        reason: String,
    },
}

impl ChainCheck {
    /// Whether the chain agrees (nothing to compare counts as agreeing; not being able to look
    /// does not).
    pub fn matches(&self) -> bool {
        match self {
            Self::Weights { matches, .. }
            | Self::Commit { matches, .. }
            | Self::Sealed { matches, .. } => *matches,
            Self::NotApplicable { .. } => true,
            Self::Unavailable { .. } => false,
        }
    }
}

/// The audit of one epoch.
#[derive(Clone, Debug, Serialize)]
pub struct AuditReport {
    /// Run.
    pub run_id: i64,
    /// Epoch audited.
    pub epoch: u64,
    /// Scored epochs recomputed (the score window ending at `epoch`).
    pub window: Vec<u64>,
    /// Samples fitted in `epoch`.
    pub samples: u64,
    /// Where the spot-check outcomes came from.
    pub checks_source: &'static str,
    /// What the recomputation is compared with.
    pub records: &'static str,
    /// Per miner of `epoch`.
    pub miners: Vec<MinerAudit>,
    /// The submission made from `epoch`'s scores, if any.
    pub submission: Option<SubmissionSummary>,
    /// Per uid of that submission.
    pub weights: Vec<WeightAudit>,
    /// The chain comparison.
    pub chain: ChainCheck,
    /// Every difference found, in words.
    pub mismatches: Vec<String>,
    /// The recomputation agrees with what the validator recorded (its database, or what it
    /// published).
    pub records_match: bool,
    /// The verdict: agrees with the database and the chain.
    pub matches: bool,
}

/// The recorded submission an audit compares with.
#[derive(Clone, Debug, Serialize)]
pub struct SubmissionSummary {
    /// Row id in the validator's database (none for a published one).
    pub id: Option<i64>,
    /// `set`, `committed`, `revealed` or `dry_run`.
    pub state: String,
    /// Block it landed in (the reveal's once revealed).
    pub block: Option<u64>,
}

/// Recomputes one scored epoch from its record, the samples its CLASP fit pools (its own and
/// those of the epochs before it in the fit's window: [`pooled`]), the checks its penalties come
/// from and the settings it was scored with: the fit and every miner's score, labelled with
/// `epoch` whatever the record says (a mislabelled record is reported by the caller).
pub fn recompute_epoch(
    epoch: u64,
    stages: u32,
    record: &EpochRecord,
    samples: &[SampleRecord],
    checks: &[CheckRow],
    settings: &Settings,
) -> (Option<HotkeyEffects>, Vec<EpochScore>) {
    let fit = fit_epoch(epoch, stages, samples, &settings.clasp);
    let mut scores = epoch_scores(
        record,
        stages,
        fit.as_ref(),
        &failures(checks),
        &settings.score,
    );
    for s in &mut scores {
        s.epoch = epoch;
    }
    (fit, scores)
}

/// The epochs whose samples a CLASP fit of `epoch` over `window` epochs pools.
fn clasp_epochs(epoch: u64, window: u64) -> std::ops::RangeInclusive<u64> {
    (epoch + 1).saturating_sub(window.max(1))..=epoch
}

/// The samples a CLASP fit of `epoch` over `window` epochs pools, from `records` (which must
/// hold every epoch of [`clasp_epochs`]).
fn pooled(records: &BTreeMap<u64, EpochEvidence>, epoch: u64, window: u64) -> Vec<SampleRecord> {
    clasp_epochs(epoch, window)
        .filter_map(|e| records.get(&e))
        .flat_map(|ev| ev.samples.iter().cloned())
        .collect()
}

/// Fetches into `records` each epoch of `epochs` it does not hold yet.
async fn fill<F, Fut>(
    records: &mut BTreeMap<u64, EpochEvidence>,
    epochs: BTreeSet<u64>,
    mut fetch: F,
) -> Result<(), ValidatorError>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = Result<EpochEvidence, ValidatorError>>,
{
    for e in epochs {
        if let std::collections::btree_map::Entry::Vacant(slot) = records.entry(e) {
            slot.insert(fetch(e).await?);
        }
    }
    Ok(())
}

/// Weights rebuilt from scores, for the neurons of a metagraph.
struct Recomputed {
    /// Each uid's hotkey.
    hotkey_of: BTreeMap<u16, String>,
    /// Normalised weight by uid.
    mine: BTreeMap<u16, f64>,
    /// The same as the chain takes them (`u16`, max-normalised), as the validator sends them.
    expected: BTreeMap<u16, u16>,
}

/// The weights `scores` give `meta`'s neurons under `score` and `burn`.
fn recomputed_weights(
    meta: &Metagraph,
    scores: &[EpochScore],
    score: &crate::score::ScoreConfig,
    burn: Option<(u16, f64)>,
) -> Result<Recomputed, ChainError> {
    let uid_of: BTreeMap<String, u16> = meta
        .neurons
        .iter()
        .map(|n| (n.hotkey.ss58(), n.uid))
        .collect();
    let hotkey_of = uid_of.iter().map(|(h, u)| (*u, h.clone())).collect();
    let (uids, values) = weights_by_uid(scores, score, burn, &uid_of).unwrap_or_default();
    let expected = if uids.is_empty() {
        BTreeMap::new()
    } else {
        let (u, v) = chain_values(PROCESS_WEIGHTS, &meta.hyperparams, &uids, &values)?;
        u.into_iter().zip(v).collect()
    };
    Ok(Recomputed {
        hotkey_of,
        mine: uids.into_iter().zip(values).collect(),
        expected,
    })
}

/// Relative tolerance of float comparisons: the recomputation runs the same code on the same
/// inputs in the same order, so any real difference is far above it.
const TOLERANCE: f64 = 1e-9;

fn close(a: f64, b: f64) -> bool {
    // Equal infinities, or both NaN (a degenerate standard error), are the same result.
    a == b
        || (a.is_nan() && b.is_nan())
        || (a - b).abs() <= TOLERANCE * a.abs().max(b.abs()).max(1.0)
}

fn same_score(a: &EpochScore, b: &EpochScore) -> bool {
    a.hotkey == b.hotkey
        && a.epoch == b.epoch
        && close(a.work, b.work)
        && close(a.quality, b.quality)
        && close(a.score, b.score)
        && a.penalty == b.penalty
}

/// Compares a recomputed fit with the stored effects; differences go to `out`.
fn compare_effects(
    epoch: u64,
    fit: Option<&HotkeyEffects>,
    stored: &[EffectRow],
    out: &mut Vec<String>,
) {
    let stored: BTreeMap<&str, &EffectRow> =
        stored.iter().map(|r| (r.hotkey.as_str(), r)).collect();
    let mine: BTreeMap<&str, _> = fit
        .map(|f| {
            f.fit
                .effects
                .iter()
                .filter_map(|e| f.hotkeys.get(e.miner as usize).map(|h| (h.as_str(), e)))
                .collect()
        })
        .unwrap_or_default();
    let keys: BTreeSet<&str> = stored.keys().chain(mine.keys()).copied().collect();
    for k in keys {
        match (mine.get(k), stored.get(k)) {
            (Some(m), Some(s)) => {
                let z = if m.z.is_finite() { m.z } else { 0.0 };
                if !(close(m.effect, s.effect)
                    && close(m.std_error, s.std_error)
                    && close(z, s.z)
                    && m.samples == s.samples
                    && m.flagged == s.flagged
                    && m.stage == s.stage)
                {
                    out.push(format!(
                        "epoch {epoch}: CLASP effect of {k}: recomputed {:.6} (z {:.2}, {} samples{}), stored {:.6} (z {:.2}, {} samples{})",
                        m.effect,
                        z,
                        m.samples,
                        if m.flagged { ", flagged" } else { "" },
                        s.effect,
                        s.z,
                        s.samples,
                        if s.flagged { ", flagged" } else { "" },
                    ));
                }
            }
            (Some(_), None) => out.push(format!(
                "epoch {epoch}: CLASP effect of {k} recomputed but not stored"
            )),
            (None, Some(_)) => out.push(format!(
                "epoch {epoch}: CLASP effect of {k} stored but not recomputed"
            )),
            (None, None) => {}
        }
    }
}

/// Compares recomputed scores with stored ones; differences go to `out`.
fn compare_scores(epoch: u64, mine: &[EpochScore], stored: &[EpochScore], out: &mut Vec<String>) {
    let stored: BTreeMap<&str, &EpochScore> =
        stored.iter().map(|s| (s.hotkey.as_str(), s)).collect();
    let mine_by: BTreeMap<&str, &EpochScore> =
        mine.iter().map(|s| (s.hotkey.as_str(), s)).collect();
    let keys: BTreeSet<&str> = stored.keys().chain(mine_by.keys()).copied().collect();
    for k in keys {
        match (mine_by.get(k), stored.get(k)) {
            (Some(m), Some(s)) if same_score(m, s) => {}
            (Some(m), Some(s)) => out.push(format!(
                "epoch {epoch}: score of {k}: recomputed work {} quality {:.6} score {:.6} penalty {:?}, stored work {} quality {:.6} score {:.6} penalty {:?}",
                m.work, m.quality, m.score, m.penalty, s.work, s.quality, s.score, s.penalty
            )),
            (Some(_), None) => out.push(format!("epoch {epoch}: score of {k} recomputed but not stored")),
            (None, Some(_)) => out.push(format!("epoch {epoch}: score of {k} stored but not recomputed")),
            (None, None) => {}
        }
    }
}

/// The per-miner rows of the audited epoch: each recomputed score and CLASP effect beside the
/// recorded one.
fn miner_rows(
    recomputed: &[EpochScore],
    recorded: &[EpochScore],
    effects: &BTreeMap<&str, (f64, bool)>,
    recorded_effects: &BTreeMap<String, (f64, bool)>,
) -> Vec<MinerAudit> {
    let recorded: HashMap<&str, &EpochScore> =
        recorded.iter().map(|s| (s.hotkey.as_str(), s)).collect();
    recomputed
        .iter()
        .map(|s| {
            let stored = recorded.get(s.hotkey.as_str()).map(|x| (*x).clone());
            let effect = effects.get(s.hotkey.as_str()).copied();
            let stored_effect = recorded_effects.get(&s.hotkey).copied();
            let effect_ok = match (effect, stored_effect) {
                (Some(a), Some(b)) => close(a.0, b.0) && a.1 == b.1,
                (None, None) => true,
                _ => false,
            };
            MinerAudit {
                hotkey: s.hotkey.clone(),
                matches: stored.as_ref().is_some_and(|x| same_score(s, x)) && effect_ok,
                recomputed: s.clone(),
                stored,
                effect,
                stored_effect,
            }
        })
        .collect()
}

impl Validator {
    /// The public records of `epoch`, from the orchestrator's validator routes.
    pub async fn fetch_evidence(&self, epoch: u64) -> Result<EpochEvidence, ValidatorError> {
        let record = self.client().await?.epoch_record(epoch).await?;
        if record.phase.is_some() {
            return Err(ValidatorError::Config(format!(
                "epoch {epoch} has not finished"
            )));
        }
        let samples = self.all_samples(epoch).await?;
        Ok(EpochEvidence { record, samples })
    }

    /// Audits `epoch` from the orchestrator's records.
    pub async fn audit(&self, epoch: u64) -> Result<AuditReport, ValidatorError> {
        self.audit_with(epoch, BTreeMap::new()).await
    }

    /// Audits `epoch`, taking the records of the epochs in `evidence` as given (the others are
    /// fetched): what a third party holding its own copy of the records would do.
    pub async fn audit_with(
        &self,
        epoch: u64,
        mut evidence: BTreeMap<u64, EpochEvidence>,
    ) -> Result<AuditReport, ValidatorError> {
        let (run_id, run) = self.run_info().await?;
        let stages = run.stages;
        let cfg = self.config().clone();
        if !self.store().is_scored(run_id, epoch).await? {
            return Err(ValidatorError::Config(format!(
                "epoch {epoch} of run {run_id} was not scored by this validator"
            )));
        }
        let from = (epoch + 1).saturating_sub(cfg.score.window);
        let window = self.store().scored_between(run_id, from, epoch).await?;
        let mut mismatches = Vec::new();

        // Each epoch's settings as it was scored, and the records they need.
        let mut settings = BTreeMap::new();
        for &e in &window {
            let s = match self.store().params(run_id, e).await? {
                Some(p) => crate::published::settings(&p),
                None => Settings {
                    clasp: cfg.clasp,
                    score: cfg.score,
                    burn: cfg.burn,
                },
            };
            settings.insert(e, s);
        }
        let needed = settings
            .iter()
            .flat_map(|(e, s)| clasp_epochs(*e, s.clasp.window))
            .collect();
        fill(&mut evidence, needed, |e| self.fetch_evidence(e)).await?;

        // Fit and scores of every epoch of the window, each compared with the database.
        let mut recomputed: Vec<EpochScore> = Vec::new();
        let mut audited_fit = None;
        let mut audited_scores = Vec::new();
        let mut audited_stored = Vec::new();
        let mut samples_fitted = 0;
        for (&e, settings) in &settings {
            let Some(ev) = evidence.get(&e) else {
                continue;
            };
            if ev.record.epoch != e {
                mismatches.push(format!(
                    "epoch {e}: the record given is epoch {}'s",
                    ev.record.epoch
                ));
            }
            let checks = self.store().checks(run_id, e).await?;
            let samples = pooled(&evidence, e, settings.clasp.window);
            let (fit, scores) = recompute_epoch(e, stages, &ev.record, &samples, &checks, settings);
            let stored = self.store().scores_between(run_id, e, e).await?;
            compare_effects(
                e,
                fit.as_ref(),
                &self.store().effects(run_id, e).await?,
                &mut mismatches,
            );
            compare_scores(e, &scores, &stored, &mut mismatches);
            if e == epoch {
                samples_fitted = fit.as_ref().map(|f| f.fit.samples).unwrap_or(0);
                audited_fit = fit;
                audited_scores = scores.clone();
                audited_stored = stored;
            }
            recomputed.extend(scores);
        }
        let db_scores_match = mismatches.is_empty();

        // Per-miner rows of the audited epoch.
        let effects = audited_fit
            .as_ref()
            .map(HotkeyEffects::by_hotkey)
            .unwrap_or_default();
        let stored_effects: BTreeMap<String, (f64, bool)> = self
            .store()
            .effects(run_id, epoch)
            .await?
            .into_iter()
            .map(|r| (r.hotkey, (r.effect, r.flagged)))
            .collect();
        let miners = miner_rows(&audited_scores, &audited_stored, &effects, &stored_effects);

        // The weights set from this epoch.
        let submission = self.store().submission_for_epoch(run_id, epoch).await?;
        let (weights, chain) = match &submission {
            None => (
                Vec::new(),
                ChainCheck::NotApplicable {
                    reason: format!(
                        "no weights were set from epoch {epoch} (a later epoch's submission covers its scores)"
                    ),
                },
            ),
            Some(sub) => {
                self.audit_weights(sub, &recomputed, &mut mismatches)
                    .await?
            }
        };
        let records_match = db_scores_match
            && weights
                .iter()
                .all(|w| w.stored.is_some_and(|s| close(s, w.recomputed)));
        if let ChainCheck::Unavailable { reason } = &chain {
            mismatches.push(format!("chain not verified: {reason}"));
        }
        let matches = mismatches.is_empty() && records_match && chain.matches();
        Ok(AuditReport {
            run_id,
            epoch,
            window,
            samples: samples_fitted,
            checks_source: "the validator's database (its own replay and merge measurements)",
            records: "database",
            miners,
            submission: submission.map(|s| SubmissionSummary {
                id: Some(s.id),
                state: s.state,
                block: s.block,
            }),
            weights,
            chain,
            mismatches,
            records_match,
            matches,
        })
    }

    /// The metagraph at `block`, or the current one (with a note) when the node no longer has
    /// that block's state.
    async fn metagraph_near(
        &self,
        block: Option<u64>,
        notes: &mut Vec<String>,
    ) -> Result<Metagraph, ValidatorError> {
        let netuid = self.config().netuid;
        if let Some(b) = block {
            match at_number(self.chain(), b).await {
                Ok(at) => return Ok(self.chain().metagraph_at(&at, netuid).await?),
                Err(e) => notes.push(format!(
                    "uids read at the current block: state of block {b} unavailable ({e})"
                )),
            }
        }
        Ok(self.chain().metagraph(netuid).await?)
    }

    async fn audit_weights(
        &self,
        sub: &SubmissionRow,
        recomputed: &[EpochScore],
        mismatches: &mut Vec<String>,
    ) -> Result<(Vec<WeightAudit>, ChainCheck), ValidatorError> {
        let cfg = self.config();
        let mut notes = Vec::new();
        let meta = self.metagraph_near(sub.block, &mut notes).await?;
        for n in notes {
            tracing::info!(note = %n, "audit");
        }
        let Recomputed {
            hotkey_of,
            mine,
            expected,
        } = recomputed_weights(&meta, recomputed, &cfg.score, cfg.burn)?;
        let stored: BTreeMap<u16, f64> = sub
            .uids
            .iter()
            .copied()
            .zip(sub.weights.iter().copied())
            .collect();

        // The chain.
        let public = self.hotkey().public();
        let (chain, on_chain): (ChainCheck, Option<BTreeMap<u16, u16>>) = match sub.state.as_str() {
            "set" | "revealed" => match (sub.block, meta.uid_of(&public)) {
                (Some(block), Some(uid)) => self.weights_check(block, uid, &expected).await,
                _ => (
                    ChainCheck::Unavailable {
                        reason: "no block recorded, or the validator has no uid".into(),
                    },
                    None,
                ),
            },
            "committed" => self.audit_commit(sub, &meta, &expected).await?,
            other => (
                ChainCheck::NotApplicable {
                    reason: format!("the submission was a {other}: nothing was sent"),
                },
                None,
            ),
        };

        let all: BTreeSet<u16> = mine
            .keys()
            .chain(stored.keys())
            .chain(on_chain.iter().flat_map(|m| m.keys()))
            .copied()
            .collect();
        let rows: Vec<WeightAudit> = all
            .into_iter()
            .map(|uid| {
                let recomputed = mine.get(&uid).copied().unwrap_or(0.0);
                let stored_w = stored.get(&uid).copied();
                let chain_expected = expected.get(&uid).copied();
                let chain_value = on_chain.as_ref().map(|m| m.get(&uid).copied());
                let db_ok = match stored_w {
                    Some(s) => close(s, recomputed),
                    None => recomputed == 0.0,
                };
                let chain_ok = chain_value.is_none_or(|v| v == chain_expected);
                if !db_ok {
                    mismatches.push(format!(
                        "weight of uid {uid}: recomputed {recomputed:.6}, recorded {}",
                        stored_w.map_or("none".into(), |s| format!("{s:.6}"))
                    ));
                }
                if !chain_ok {
                    mismatches.push(format!(
                        "weight of uid {uid}: recomputed {} on chain, the chain has {}",
                        chain_expected.map_or("none".into(), |v| v.to_string()),
                        chain_value
                            .flatten()
                            .map_or("none".into(), |v| v.to_string())
                    ));
                }
                WeightAudit {
                    uid,
                    hotkey: hotkey_of.get(&uid).cloned(),
                    recomputed,
                    stored: stored_w,
                    published: None,
                    chain_expected,
                    on_chain: chain_value.flatten(),
                    matches: db_ok && chain_ok,
                }
            })
            .collect();
        match &chain {
            ChainCheck::Commit {
                recorded,
                recomputed,
                on_chain,
                matches: false,
            } => mismatches.push(format!(
                "commit: recorded {recorded}, recomputed {recomputed}, on chain: {on_chain}"
            )),
            ChainCheck::Sealed {
                recorded,
                sealed_matches,
                on_chain,
                matches: false,
                ..
            } => mismatches.push(format!(
                "timelocked commit {recorded}: sealed weights equal the recomputed ones: {sealed_matches}, on chain: {on_chain}"
            )),
            _ => {}
        }
        Ok((rows, chain))
    }

    async fn weights_at(&self, block: u64, uid: u16) -> Result<Vec<(u16, u16)>, ChainError> {
        let at = at_number(self.chain(), block).await?;
        weights_row(self.chain(), &at, self.config().netuid, uid).await
    }

    /// The `Weights` row of `uid` at `block` against the recomputed weights, and the row read.
    async fn weights_check(
        &self,
        block: u64,
        uid: u16,
        expected: &BTreeMap<u16, u16>,
    ) -> (ChainCheck, Option<BTreeMap<u16, u16>>) {
        match self.weights_at(block, uid).await {
            Ok(row) => {
                let row: BTreeMap<u16, u16> = row.into_iter().collect();
                (
                    ChainCheck::Weights {
                        block,
                        uid,
                        matches: row == *expected,
                    },
                    Some(row),
                )
            }
            Err(e) => (
                ChainCheck::Unavailable {
                    reason: format!(
                        "the Weights row at block {block} cannot be read ({e}); an archive node can"
                    ),
                },
                None,
            ),
        }
    }

    /// A commit the validator has not seen revealed: its hash recomputed from the recomputed
    /// weights with the stored salt and version key, and looked up among the validator's commits
    /// on chain. A timelocked commit the chain has opened already is checked by the `Weights` row
    /// it set, and the row is returned.
    async fn audit_commit(
        &self,
        sub: &SubmissionRow,
        meta: &Metagraph,
        expected: &BTreeMap<u16, u16>,
    ) -> Result<(ChainCheck, Option<BTreeMap<u16, u16>>), ValidatorError> {
        let Some(recorded) = sub.commit_hash.clone() else {
            return Ok((
                ChainCheck::Unavailable {
                    reason: "the submission has no commit hash".into(),
                },
                None,
            ));
        };
        let Some(pending) = self.store().pending_commit(&recorded).await? else {
            return Ok((
                ChainCheck::Unavailable {
                    reason: format!(
                        "the reveal data of commit {recorded} are gone (revealed or expired since): run the audit again once the reveal is recorded"
                    ),
                },
                None,
            ));
        };
        let public = self.hotkey().public();
        if let Some(sealed) = pending.timelock {
            let at = self.chain().at_best().await?;
            let on_chain = timelocked_commit_hashes(
                self.chain(),
                &at,
                meta.netuid,
                sealed.commit_epoch,
                &public,
            )
            .await?
            .iter()
            .any(|h| format!("0x{}", hex::encode(h)) == recorded);
            if !on_chain
                && let Fate::Revealed(block) = self
                    .chain()
                    .timelocked_commit_fate(&pending, sealed)
                    .await?
                && let Some(uid) = meta.uid_of(&public)
            {
                // Opened by the chain before this validator's reveal pass noticed.
                return Ok(self.weights_check(block, uid, expected).await);
            }
            // `expected` is what the client sends (a hash commit hashes it as it is).
            let weights: BTreeMap<u16, u16> = pending
                .uids
                .iter()
                .copied()
                .zip(pending.values.iter().copied())
                .collect();
            let sealed_matches = weights == *expected;
            return Ok((
                ChainCheck::Sealed {
                    matches: sealed_matches && on_chain,
                    recorded,
                    reveal_round: sealed.reveal_round,
                    sealed_matches,
                    on_chain,
                },
                None,
            ));
        }
        let (uids, values): (Vec<u16>, Vec<u16>) = expected.iter().map(|(u, v)| (*u, *v)).unzip();
        let hash = commit_hash(
            public.to_bytes(),
            meta.netuid,
            &uids,
            &values,
            &pending.salt,
            pending.version_key,
        );
        let recomputed = format!("0x{}", hex::encode(hash));
        let at = self.chain().at_best().await?;
        let on_chain = commit_hashes(self.chain(), &at, meta.netuid, &public)
            .await?
            .iter()
            .any(|h| format!("0x{}", hex::encode(h)) == recorded);
        Ok((
            ChainCheck::Commit {
                matches: recomputed == recorded && on_chain,
                recorded,
                recomputed,
                on_chain,
            },
            None,
        ))
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn mark(ok: bool) -> &'static str {
    if ok { "ok" } else { "DIFFERS" }
}

impl std::fmt::Display for AuditReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "audit of epoch {} (run {}): {} samples fitted; score window {:?}",
            self.epoch, self.run_id, self.samples, self.window
        )?;
        writeln!(f, "spot-check outcomes: from {}", self.checks_source)?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<50} {:>7} {:>8} {:>10} {:>10} {:>10} {:>10}  {:<8} penalty",
            "miner", "work", "quality", "score", "stored", "effect", "stored", "check"
        )?;
        for m in &self.miners {
            let effect = |e: Option<(f64, bool)>| {
                e.map_or_else(
                    || "-".into(),
                    |(v, flagged)| format!("{v:.4}{}", if flagged { "!" } else { "" }),
                )
            };
            writeln!(
                f,
                "{:<50} {:>7.0} {:>8.4} {:>10.2} {:>10} {:>10} {:>10}  {:<8} {}",
                m.hotkey,
                m.recomputed.work,
                m.recomputed.quality,
                m.recomputed.score,
                opt(m.stored.as_ref().map(|s| format!("{:.2}", s.score))),
                effect(m.effect),
                effect(m.stored_effect),
                mark(m.matches),
                m.recomputed.penalty.as_deref().unwrap_or("")
            )?;
        }
        writeln!(f)?;
        match &self.submission {
            Some(s) => writeln!(
                f,
                "weights set from epoch {}: submission {} ({}, block {})",
                self.epoch,
                opt(s.id.map(|id| format!("#{id}"))),
                s.state,
                opt(s.block)
            )?,
            None => writeln!(f, "no weight submission from epoch {}", self.epoch)?,
        }
        if !self.weights.is_empty() {
            writeln!(
                f,
                "{:>5} {:<50} {:>10} {:>10} {:>8} {:>9} {:>8}  check",
                "uid", "hotkey", "weight", "recorded", "u16", "published", "chain"
            )?;
            for w in &self.weights {
                writeln!(
                    f,
                    "{:>5} {:<50} {:>10.6} {:>10} {:>8} {:>9} {:>8}  {}",
                    w.uid,
                    w.hotkey.as_deref().unwrap_or("(burn or unknown)"),
                    w.recomputed,
                    opt(w.stored.map(|s| format!("{s:.6}"))),
                    opt(w.chain_expected),
                    opt(w.published),
                    opt(w.on_chain),
                    mark(w.matches)
                )?;
            }
        }
        let chain = match &self.chain {
            ChainCheck::Weights {
                block,
                uid,
                matches,
            } => format!("Weights of uid {uid} at block {block}: {}", mark(*matches)),
            ChainCheck::Commit {
                recorded,
                recomputed,
                on_chain,
                matches,
            } => format!(
                "commit {recorded} (recomputed {recomputed}, on chain: {on_chain}): {}",
                mark(*matches)
            ),
            ChainCheck::Sealed {
                recorded,
                reveal_round,
                sealed_matches,
                on_chain,
                matches,
            } => format!(
                "timelocked commit {recorded} to drand round {reveal_round} (sealed weights as recomputed: {sealed_matches}, on chain: {on_chain}; readable after the round): {}",
                mark(*matches)
            ),
            ChainCheck::NotApplicable { reason } => format!("not applicable: {reason}"),
            ChainCheck::Unavailable { reason } => format!("NOT VERIFIED: {reason}"),
        };
        writeln!(f, "chain: {chain}")?;
        writeln!(f, "{}: {}", self.records, mark(self.records_match))?;
        for m in &self.mismatches {
            writeln!(f, "  - {m}")?;
        }
        writeln!(
            f,
            "verdict: {}",
            if self.matches { "MATCH" } else { "MISMATCH" }
        )
    }
}
