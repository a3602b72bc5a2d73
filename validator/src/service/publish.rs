//! Publishing an epoch's spot checks and scores to the orchestrator, and republishing those
//! that did not arrive.

use iota_protocol::api::{ScoreSubmission, SpotCheckReport, SpotCheckResult};

use super::{PUBLISH_PER_PASS, Validator};
use crate::error::ValidatorError;
use crate::published;

impl Validator {
    /// Sends `epoch`'s spot checks and scores to the orchestrator and records that both arrived;
    /// whether they did (a failure is logged and left to [`Validator::publish_pending`]).
    pub(super) async fn publish(
        &self,
        run_id: i64,
        epoch: u64,
        report: &SpotCheckReport,
        scores: &ScoreSubmission,
    ) -> Result<bool, ValidatorError> {
        let o = self.online().await?;
        if let Err(e) = o.client.report_spot_checks(epoch, report).await {
            tracing::warn!(epoch, error = %e, "could not publish the spot checks; will retry");
            return Ok(false);
        }
        if let Err(e) = o.client.submit_scores(epoch, scores).await {
            tracing::warn!(epoch, error = %e, "could not publish the scores; will retry");
            return Ok(false);
        }
        self.store.set_published(run_id, epoch).await?;
        Ok(true)
    }

    /// Publishes the scored epochs whose publication has not arrived, oldest first, rebuilt from
    /// the rows stored with them; stops at the first failure (the orchestrator is likely away)
    /// and leaves the rest to a later pass. How many were published.
    pub async fn publish_pending(&self) -> Result<usize, ValidatorError> {
        let o = self.online().await?;
        let mut published = 0;
        for epoch in self.store.unpublished(o.run_id, PUBLISH_PER_PASS).await? {
            let Some((seed, seed_block)) = self.store.seed(o.run_id, epoch).await? else {
                continue;
            };
            let checks = self
                .store
                .checks(o.run_id, epoch)
                .await?
                .into_iter()
                .map(SpotCheckResult::from)
                .collect();
            let report = SpotCheckReport {
                validator: String::new(),
                seed,
                seed_block,
                checks,
            };
            let scores = self.store.scores_between(o.run_id, epoch, epoch).await?;
            let effects = self.store.effects(o.run_id, epoch).await?;
            let effects = effects
                .iter()
                .map(|e| (e.hotkey.as_str(), (e.effect, e.flagged)))
                .collect();
            let params = match self.store.params(o.run_id, epoch).await? {
                Some(p) => p,
                None => self.scoring_params(),
            };
            let weights = self.store.weights_on_chain(o.run_id, epoch).await?;
            let submission = published::submission(&scores, &effects, params, weights);
            if !self.publish(o.run_id, epoch, &report, &submission).await? {
                break;
            }
            published += 1;
        }
        Ok(published)
    }
}
