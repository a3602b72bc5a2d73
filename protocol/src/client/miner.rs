//! The routes a miner calls.

use super::*;

impl ApiClient {
    /// Joins the run from a process that starts (idempotent: a second call returns the same
    /// stage; see [`RegisterRequest::holds_epoch_state`] for what a restart mid-epoch does).
    pub async fn register(&self, capacity: Capacity) -> Result<RegisterResponse, ClientError> {
        self.signed_json(
            Method::POST,
            "/v1/miner/register",
            &RegisterRequest {
                capacity,
                holds_epoch_state: false,
            },
        )
        .await
    }

    /// Registers again from the same process, which still holds its work of the running epoch
    /// (after the orchestrator released it for silence).
    pub async fn rejoin(&self, capacity: Capacity) -> Result<RegisterResponse, ClientError> {
        self.signed_json(
            Method::POST,
            "/v1/miner/register",
            &RegisterRequest {
                capacity,
                holds_epoch_state: true,
            },
        )
        .await
    }

    /// Says the miner is alive.
    pub async fn heartbeat(
        &self,
        tokens_per_s: Option<f64>,
    ) -> Result<HeartbeatResponse, ClientError> {
        self.signed_json(
            Method::POST,
            "/v1/miner/heartbeat",
            &HeartbeatRequest { tokens_per_s },
        )
        .await
    }

    /// Asks for up to `max_items` leased work items.
    pub async fn work(&self, max_items: u32) -> Result<WorkResponse, ClientError> {
        self.signed_json(Method::POST, "/v1/miner/work", &WorkRequest { max_items })
            .await
    }

    /// Uploads a task's output tensor through the orchestrator.
    pub async fn upload_output(
        &self,
        task_id: i64,
        lease: Uuid,
        bytes: Bytes,
    ) -> Result<UploadResponse, ClientError> {
        self.upload(
            &format!("/v1/miner/tasks/{task_id}/output"),
            &format!("?lease={lease}"),
            bytes,
        )
        .await
    }

    /// Completes a task.
    pub async fn complete(
        &self,
        task_id: i64,
        req: &CompleteRequest,
    ) -> Result<CompleteResponse, ClientError> {
        self.signed_json(
            Method::POST,
            &format!("/v1/miner/tasks/{task_id}/complete"),
            req,
        )
        .await
    }

    /// Reserves this miner's pseudo-gradient upload of `epoch` before the uploading phase's
    /// deadline: the phase then stays open until every partition of it is in (bounded, see
    /// [`ReservationResponse::holds_until_ms`]).
    pub async fn reserve_pseudo_gradients(
        &self,
        epoch: u64,
    ) -> Result<ReservationResponse, ClientError> {
        self.signed_json(
            Method::POST,
            &format!("/v1/miner/epochs/{epoch}/pseudo-gradients/reserve"),
            &serde_json::json!({}),
        )
        .await
    }

    /// Uploads one pseudo-gradient partition.
    pub async fn upload_pseudo_gradient(
        &self,
        epoch: u64,
        partition: u32,
        bytes: Bytes,
    ) -> Result<UploadResponse, ClientError> {
        self.upload(
            &format!("/v1/miner/epochs/{epoch}/pseudo-gradients/{partition}"),
            "",
            bytes,
        )
        .await
    }

    /// The partitions this miner must merge now.
    pub async fn merges(&self) -> Result<MergeAssignments, ClientError> {
        self.signed_raw(Method::GET, "/v1/miner/merges", None).await
    }

    /// Uploads a merged partition.
    pub async fn upload_merge(
        &self,
        epoch: u64,
        stage: u32,
        partition: u32,
        bytes: Bytes,
    ) -> Result<UploadResponse, ClientError> {
        self.upload(
            &format!("/v1/miner/epochs/{epoch}/merges/{stage}/{partition}"),
            "",
            bytes,
        )
        .await
    }

    /// Reports an object that failed its checks after download.
    pub async fn report_bad_object(
        &self,
        key: &str,
        reason: &str,
    ) -> Result<BadObjectVerdict, ClientError> {
        self.signed_json(
            Method::POST,
            "/v1/miner/reports/bad-object",
            &BadObjectReport {
                key: key.to_owned(),
                reason: reason.to_owned(),
            },
        )
        .await
    }
}
