//! The public routes and those a validator calls.

use super::*;

impl ApiClient {
    // ---- public ----

    /// Where the run is.
    pub async fn status(&self) -> Result<EpochStatus, ClientError> {
        self.public_get("/v1/status").await
    }

    /// Merge status of every partition of `epoch`.
    pub async fn merge_status(&self, epoch: u64) -> Result<Vec<PartitionStatus>, ClientError> {
        self.public_get(&format!("/v1/epochs/{epoch}/merges")).await
    }

    /// Each validator's latest published scores and weights (`GET /v1/scores`).
    pub async fn scores(&self) -> Result<Vec<ScoreRecord>, ClientError> {
        self.public_get("/v1/scores").await
    }

    /// The latest merged weights of `stage`, with download URLs where the store presigns
    /// (signed: the public route gives no URLs).
    pub async fn stage_weights(&self, stage: u32) -> Result<StageWeights, ClientError> {
        self.signed_raw(
            Method::GET,
            &format!("/v1/miner/stages/{stage}/weights"),
            None,
        )
        .await
    }

    /// The weights `stage` started epoch `epoch` from (merges of earlier epochs only), as
    /// [`ApiClient::stage_weights`].
    pub async fn epoch_start_weights(
        &self,
        stage: u32,
        epoch: u64,
    ) -> Result<StageWeights, ClientError> {
        self.signed_raw(
            Method::GET,
            &format!("/v1/miner/stages/{stage}/weights?before={epoch}"),
            None,
        )
        .await
    }

    /// The record of a finished epoch (`GET /v1/epochs/{epoch}`), as anyone may read it.
    pub async fn finished_epoch(&self, epoch: u64) -> Result<EpochRecord, ClientError> {
        self.public_get(&format!("/v1/epochs/{epoch}")).await
    }

    /// A page of a finished epoch's samples (`GET /v1/epochs/{epoch}/samples`).
    pub async fn finished_samples(
        &self,
        epoch: u64,
        after: i64,
        limit: u32,
    ) -> Result<SamplePage, ClientError> {
        self.public_get(&format!(
            "/v1/epochs/{epoch}/samples?after={after}&limit={limit}"
        ))
        .await
    }

    /// Every validator's published scores for `epoch`.
    pub async fn epoch_scores(&self, epoch: u64) -> Result<Vec<ScoreRecord>, ClientError> {
        self.public_get(&format!("/v1/epochs/{epoch}/scores")).await
    }

    /// Every validator's published spot checks for `epoch`.
    pub async fn reported_spot_checks(
        &self,
        epoch: u64,
    ) -> Result<Vec<SpotCheckReport>, ClientError> {
        self.public_get(&format!("/v1/epochs/{epoch}/spot-checks"))
            .await
    }

    // ---- validators ----

    /// A page of hop records of `epoch`.
    pub async fn hops(&self, epoch: u64, after: i64, limit: u32) -> Result<HopPage, ClientError> {
        self.signed_raw(
            Method::GET,
            &format!("/v1/validator/epochs/{epoch}/hops?after={after}&limit={limit}"),
            None,
        )
        .await
    }

    /// A page of samples of `epoch`.
    pub async fn samples(
        &self,
        epoch: u64,
        after: i64,
        limit: u32,
    ) -> Result<SamplePage, ClientError> {
        self.signed_raw(
            Method::GET,
            &format!("/v1/validator/epochs/{epoch}/samples?after={after}&limit={limit}"),
            None,
        )
        .await
    }

    /// Everything checkable about `epoch`.
    pub async fn epoch_record(&self, epoch: u64) -> Result<EpochRecord, ClientError> {
        self.signed_raw(Method::GET, &format!("/v1/validator/epochs/{epoch}"), None)
            .await
    }

    /// Replayable work and reported spot checks of `epoch`: every page of miners.
    pub async fn spot_checks(&self, epoch: u64) -> Result<SpotCheckTasks, ClientError> {
        let path = format!("/v1/validator/epochs/{epoch}/spot-checks");
        let mut all: SpotCheckTasks = self.signed_raw(Method::GET, &path, None).await?;
        while let Some(after) = all.next_after.take() {
            // A hotkey (SS58: letters and digits) goes into the query as it is.
            if !after.chars().all(|c| c.is_ascii_alphanumeric()) {
                return Err(ClientError::Decode(format!(
                    "spot-check page cursor {after:?} is not a hotkey"
                )));
            }
            let page: SpotCheckTasks = self
                .signed_raw(Method::GET, &format!("{path}?after={after}"), None)
                .await?;
            // Each page must move on (hotkeys after the cursor, in order, the next cursor its
            // last), and all of them stay within what a run can hold: an answer that does not
            // would be asked for again and again, or without end.
            // (A full last page is followed by an empty one that ends it.)
            let ends = page.miners.is_empty() && page.next_after.is_none();
            let moves_on = page.miners.first().is_some_and(|m| m.hotkey > after)
                && page.miners.windows(2).all(|w| w[0].hotkey < w[1].hotkey)
                && page
                    .next_after
                    .as_ref()
                    .is_none_or(|next| page.miners.last().is_some_and(|m| &m.hotkey == next));
            let moves_on = ends || moves_on;
            if !moves_on || all.miners.len() + page.miners.len() > MAX_SPOT_CHECK_MINERS {
                return Err(ClientError::Decode(format!(
                    "spot-check page after {after} does not follow it"
                )));
            }
            all.miners.extend(page.miners);
            all.next_after = page.next_after;
        }
        Ok(all)
    }

    /// Publishes what this validator checked in `epoch`.
    pub async fn report_spot_checks(
        &self,
        epoch: u64,
        report: &SpotCheckReport,
    ) -> Result<SpotCheckReport, ClientError> {
        self.signed_json(
            Method::POST,
            &format!("/v1/validator/epochs/{epoch}/spot-checks"),
            report,
        )
        .await
    }

    /// Open disputes.
    pub async fn disputes(&self) -> Result<Vec<Dispute>, ClientError> {
        self.signed_raw(Method::GET, "/v1/validator/disputes", None)
            .await
    }

    /// Settles a dispute with the recomputed hash.
    pub async fn settle(&self, id: i64, blake3: &str) -> Result<PartitionStatus, ClientError> {
        self.signed_json(
            Method::POST,
            &format!("/v1/validator/disputes/{id}/settle"),
            &SettleRequest {
                blake3: blake3.to_owned(),
            },
        )
        .await
    }

    /// Uploads a merge as a validator (for partitions nobody merged).
    pub async fn validator_merge(
        &self,
        epoch: u64,
        stage: u32,
        partition: u32,
        bytes: Bytes,
    ) -> Result<UploadResponse, ClientError> {
        self.put_tensor(
            &format!("/v1/validator/epochs/{epoch}/merges/{stage}/{partition}"),
            bytes,
        )
        .await
    }

    /// Submits scores for `epoch` (idempotent per validator and epoch: a resubmission replaces).
    pub async fn submit_scores(
        &self,
        epoch: u64,
        submission: &ScoreSubmission,
    ) -> Result<ScoreRecord, ClientError> {
        self.signed_json(
            Method::POST,
            &format!("/v1/validator/epochs/{epoch}/scores"),
            submission,
        )
        .await
    }
}
