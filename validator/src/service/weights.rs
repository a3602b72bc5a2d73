//! Setting weights: from the stored scores, committed or set directly as the subnet requires,
//! revealed in time, or copied from the chain's consensus while the orchestrator is away.

use std::collections::BTreeMap;

use iota_chain::Metagraph;
use iota_chain::set_weights::{
    WeightOptions, WeightsOutcome, convert_as_given, weights_allowed_from, weights_for_chain,
};
use iota_protocol::api::ScoringParams;

use super::Validator;
use crate::error::ValidatorError;
use crate::fallback::{consensus_weights, stake_weighted_mean};
use crate::onchain::weight_rows;
use crate::owed::{OwedWeights, refresh_due};
use crate::published;
use crate::score::{chain_scores, weights_by_uid};
use crate::store::WeightSource;

impl Validator {
    /// The weights the stored scores give, by the uids of `meta` (hotkeys not on the subnet are
    /// dropped), with the latest scored epoch they come from.
    pub async fn weights_from_db(
        &self,
        meta: &Metagraph,
    ) -> Result<Option<(u64, Vec<u16>, Vec<f64>)>, ValidatorError> {
        let o = self.online().await?;
        let Some(latest) = self.store.latest_scored(o.run_id).await? else {
            return Ok(None);
        };
        let scores = self
            .store
            .recent_scores(o.run_id, self.cfg.score.window)
            .await?;
        let uid_of: BTreeMap<String, u16> = meta
            .neurons
            .iter()
            .map(|n| (n.hotkey.ss58(), n.uid))
            .collect();
        Ok(
            weights_by_uid(&scores, &self.cfg.score, self.cfg.burn, &uid_of)
                .map(|(uids, values)| (latest, uids, values)),
        )
    }

    /// Sets weights from the database, mapped to the uids of `meta`: the submission is recorded
    /// before it is sent and its outcome after.
    pub async fn submit_weights(
        &self,
        meta: &Metagraph,
    ) -> Result<Option<WeightsOutcome>, ValidatorError> {
        let o = self.online().await?;
        let Some((epoch, uids, values)) = self.weights_from_db(meta).await? else {
            return Ok(None);
        };
        self.send_weights(
            WeightSource::Scores,
            Some(o.run_id),
            Some(epoch),
            &uids,
            &values,
        )
        .await
        .map(Some)
    }

    /// The scoring settings as published with each epoch's scores.
    pub fn scoring_params(&self) -> ScoringParams {
        published::params(&self.cfg.clasp, &self.cfg.score, self.cfg.burn)
    }

    /// How weights are sent.
    pub(super) fn weight_options(&self) -> WeightOptions {
        WeightOptions {
            tx: self.cfg.tx.clone(),
            wait_for_rate_limit: false,
            process_weights: PROCESS_WEIGHTS,
            ..WeightOptions::default()
        }
    }

    /// Records, sends and records the outcome of one weight submission.
    pub(super) async fn send_weights(
        &self,
        source: WeightSource,
        run_id: Option<i64>,
        epoch: Option<u64>,
        uids: &[u16],
        values: &[f64],
    ) -> Result<WeightsOutcome, ValidatorError> {
        let id = self
            .store
            .begin_submission(run_id, epoch, self.cfg.netuid, uids, values, source)
            .await?;
        let opts = self.weight_options();
        match self
            .chain
            .set_weights(
                &self.hotkey,
                self.cfg.netuid,
                uids,
                &chain_scores(values),
                &self.store,
                &opts,
            )
            .await
        {
            Ok(outcome) => {
                let json = serde_json::to_value(&outcome).unwrap_or(serde_json::Value::Null);
                let (state, block, version, hash) = match &outcome {
                    WeightsOutcome::Set {
                        block, version_key, ..
                    } => ("set", Some(*block), Some(*version_key), None),
                    WeightsOutcome::Committed {
                        block,
                        version_key,
                        hash,
                        ..
                    }
                    | WeightsOutcome::TimelockCommitted {
                        block,
                        version_key,
                        hash,
                        ..
                    } => (
                        "committed",
                        Some(*block),
                        Some(*version_key),
                        Some(hash.as_str()),
                    ),
                    WeightsOutcome::DryRun { version_key, .. } => {
                        ("dry_run", None, Some(*version_key), None)
                    }
                };
                self.store
                    .finish_submission(id, state, block, version, hash, &json)
                    .await?;
                tracing::info!(?epoch, ?block, state, source = source.as_str(), uids = ?uids,
                    "weights submitted");
                Ok(outcome)
            }
            Err(e) => {
                self.store
                    .finish_submission(
                        id,
                        "failed",
                        None,
                        None,
                        None,
                        &serde_json::json!({"error": e.to_string()}),
                    )
                    .await?;
                Err(e.into())
            }
        }
    }

    /// The fallback while the orchestrator cannot be reached: once per cadence (the subnet's
    /// tempo, or its weights rate limit if longer) since this validator last set weights, set
    /// the chain's stake-weighted consensus weights ([`crate::fallback`]). Returns `None` when
    /// it is not time yet or there is nothing to copy.
    pub async fn copy_consensus_weights(&self) -> Result<Option<WeightsOutcome>, ValidatorError> {
        let meta = self.chain.metagraph(self.cfg.netuid).await?;
        let public = self.hotkey.public();
        let me = meta.neuron_by_hotkey(&public).ok_or_else(|| {
            iota_chain::ChainError::NotRegistered {
                hotkey: public.ss58(),
                netuid: self.cfg.netuid,
            }
        })?;
        let hp = &meta.hyperparams;
        let cadence = (u64::from(hp.tempo) + 1).max(hp.weights_rate_limit);
        // A commit only moves LastUpdate when revealed: count our own recorded sends too.
        let last = me
            .last_update
            .max(self.store.last_submission_block().await?.unwrap_or(0));
        if last > 0 && meta.block < last + cadence {
            tracing::debug!(
                block = meta.block,
                last,
                cadence,
                "consensus weights: not due yet"
            );
            return Ok(None);
        }
        let copied = match consensus_weights(&meta, me.uid) {
            Some(w) => Some((w, "consensus")),
            None => {
                let rows = weight_rows(&self.chain, &meta).await?;
                stake_weighted_mean(&meta, &rows, me.uid).map(|w| (w, "stake-weighted mean"))
            }
        };
        let Some(((uids, values), how)) = copied else {
            tracing::warn!(block = meta.block, "no consensus weights on chain to copy");
            return Ok(None);
        };
        let run_id = self.online.get().map(|o| o.run_id);
        tracing::warn!(block = meta.block, how, uids = ?uids,
            "orchestrator unreachable: copying the chain's consensus weights");
        self.send_weights(WeightSource::Consensus, run_id, None, &uids, &values)
            .await
            .map(Some)
    }

    /// Reveals pending commits whose window opened (also those made before a restart).
    pub async fn reveal(&self) -> Result<usize, ValidatorError> {
        let _one_at_a_time = self.revealing.lock().await;
        let report = self
            .chain
            .reveal_pending(&self.hotkey, &self.store, &self.cfg.tx)
            .await?;
        for (hash, block) in &report.revealed {
            self.store.mark_revealed(hash, *block).await?;
        }
        for (hash, why) in &report.dropped {
            self.store.mark_dropped(hash, why).await?;
        }
        Ok(report.revealed.len())
    }

    /// The epoch whose weights to send now, and the metagraph read: the latest scored epoch's
    /// have not reached the chain (the pass that scored it could not send them, or a send
    /// failed), or reached it half the activity cutoff ago with no newer epoch scored (a stalled
    /// run: without a refresh the validator would drop out of consensus), and the subnet's rate
    /// limit lets this validator set weights at the next block.
    /// Without the first check, weights that failed once waited for the next epoch to be scored,
    /// which a stalled run may never bring; without the second, a pass would send into the rate
    /// limit and fail. Between passes, [`OwedWeights`] keeps the rate limit as last read and the
    /// back-off after failed sends, so that a pass reads one block number, not the metagraph,
    /// until a try is due.
    pub(super) async fn weights_owed(
        &self,
        run_id: i64,
    ) -> Result<Option<(u64, Metagraph)>, ValidatorError> {
        let Some(latest) = self.store.latest_scored(run_id).await? else {
            return Ok(None);
        };
        let sent = self.store.submission_for_epoch(run_id, latest).await?;
        // Committed weights wait for their reveal, and a dry run sends nothing to refresh.
        if sent
            .as_ref()
            .is_some_and(|s| s.state == "committed" || s.state == "dry_run")
        {
            return Ok(None);
        }
        let best = self.chain.best_block_number().await?;
        if sent.is_some() && !self.owed().may_check_refresh(best) {
            return Ok(None);
        }
        if !self.owed().may_try(latest, best) {
            return Ok(None);
        }
        let meta = self.chain.metagraph(self.cfg.netuid).await?;
        let public = self.hotkey.public();
        let Some(me) = meta.neuron_by_hotkey(&public) else {
            // Not read again at every pass while this hotkey has no uid.
            self.owed().failed(meta.block);
            return Err(iota_chain::ChainError::NotRegistered {
                hotkey: public.ss58(),
                netuid: self.cfg.netuid,
            }
            .into());
        };
        if sent.is_some() {
            let cutoff = meta.hyperparams.activity_cutoff;
            if !refresh_due(me.last_update, meta.block, cutoff) {
                self.owed().refreshed_at(me.last_update, cutoff);
                return Ok(None);
            }
            tracing::info!(
                epoch = latest,
                last_update = me.last_update,
                block = meta.block,
                activity_cutoff = cutoff,
                "no newer epoch scored: sending the weights again before the activity cutoff"
            );
        }
        let allowed_from =
            weights_allowed_from(me.last_update, meta.hyperparams.weights_rate_limit);
        let mut owed = self.owed();
        owed.rate_limited_until(allowed_from);
        if !owed.may_try(latest, meta.block) {
            tracing::debug!(
                epoch = latest,
                block = meta.block,
                allowed_from,
                "weights owed: waiting out the rate limit"
            );
            return Ok(None);
        }
        Ok(Some((latest, meta)))
    }

    pub(super) fn owed(&self) -> std::sync::MutexGuard<'_, OwedWeights> {
        self.owed.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The `(uids, values)` the chain client sends for `weights`, with or without its
/// `process_weights` step.
pub(crate) fn chain_values(
    process_weights: bool,
    hyperparams: &iota_chain::Hyperparams,
    uids: &[u16],
    weights: &[f64],
) -> Result<(Vec<u16>, Vec<u16>), iota_chain::ChainError> {
    let scores = chain_scores(weights);
    if process_weights {
        weights_for_chain(hyperparams, uids, &scores)
    } else {
        convert_as_given(hyperparams, uids, &scores)
    }
}

/// Whether this validator's weights go through the chain client's `process_weights` step (the
/// public audit converts as it does).
pub(crate) const PROCESS_WEIGHTS: bool = false;
