//! The error every handler returns: an API error body with its status, internal detail kept
//! out of 5xx bodies and logged instead.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use iota_protocol::{ApiError, AuthError, ErrorCode};

use crate::domain::hops::HopRefusal;
use crate::replay::ReplayError;
use crate::signatures::VerifyError;
use crate::store::StoreError;

/// The body's message of every `internal` error; what failed is logged instead.
pub const INTERNAL_MESSAGE: &str = "internal error (the orchestrator's log has the detail)";

/// A handler error: an [`ApiError`] with its status.
#[derive(Debug)]
pub struct AppError(pub ApiError);

impl AppError {
    /// A new error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self(ApiError::new(code, message))
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        // A commit's check reads a whole object: seconds, not a moment.
        let retry_after = match self.0.code {
            ErrorCode::RateLimited => Some("1"),
            ErrorCode::InProgress => Some("5"),
            _ => None,
        };
        if status.is_server_error() && self.0.code != ErrorCode::InProgress {
            tracing::error!(code = self.0.code.as_str(), message = %self.0.message, "request failed");
        }
        let body = if self.0.code == ErrorCode::Internal {
            // The detail (a database's or a library's message) stays in the log: it can name
            // tables, files or endpoints, and tells the client nothing it can act on.
            ApiError::new(ErrorCode::Internal, INTERNAL_MESSAGE)
        } else {
            self.0
        };
        let mut resp = (status, axum::Json(body)).into_response();
        if let Some(secs) = retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static(secs));
        }
        resp
    }
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        // Text PostgreSQL cannot store (U+0000, from a query or path; JSON bodies are checked
        // before): the request's fault, and a retry would fail the same way.
        if let sqlx::Error::Database(db) = &e
            && matches!(db.code().as_deref(), Some("22021" | "22P05"))
        {
            return Self::new(ErrorCode::BadRequest, "text may not contain U+0000");
        }
        Self::new(ErrorCode::Internal, format!("database: {e}"))
    }
}

impl From<HopRefusal> for AppError {
    fn from(e: HopRefusal) -> Self {
        Self::new(e.code(), e.to_string())
    }
}

impl From<StoreError> for AppError {
    fn from(e: StoreError) -> Self {
        match e {
            // Not echoed: a local store names the object by its path on this machine.
            StoreError::NotFound(_) => Self::new(ErrorCode::NotFound, "no such object"),
            StoreError::BadKey(k) => Self::new(ErrorCode::BadRequest, format!("bad key {k:?}")),
            // Not echoed either: it may name the store's files, or its endpoint.
            StoreError::Backend(m) => {
                tracing::error!(error = %m, "the object store failed");
                Self::new(ErrorCode::Internal, "the object store failed")
            }
            e @ StoreError::TooLarge { .. } => Self::new(ErrorCode::InvalidTensor, e.to_string()),
        }
    }
}

impl From<ReplayError> for AppError {
    fn from(e: ReplayError) -> Self {
        Self::new(ErrorCode::Internal, e.to_string())
    }
}

impl From<VerifyError> for AppError {
    fn from(e: VerifyError) -> Self {
        match e {
            VerifyError::Auth(e) => e.into(),
            VerifyError::Stopped => Self::new(ErrorCode::Internal, e.to_string()),
        }
    }
}

impl From<AuthError> for AppError {
    fn from(e: AuthError) -> Self {
        let code = match e {
            AuthError::Stale { .. } | AuthError::Future { .. } => ErrorCode::ClockSkew,
            AuthError::Replayed(_) => ErrorCode::Replayed,
            AuthError::UnknownSession(_) => ErrorCode::UnknownSession,
            _ => ErrorCode::Unauthenticated,
        };
        Self::new(code, e.to_string())
    }
}

/// Handler result.
pub type ApiResult<T> = Result<T, AppError>;

/// The error of the run's transitions below the routes (the phase driver, a sample's moves, merge
/// settlement), its cause kept as its source. A route turns it into an [`AppError`]: a refusal
/// keeps its code and message; anything else is `internal`, its detail logged and never sent.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// PostgreSQL failed.
    #[error("database")]
    Database(#[from] sqlx::Error),
    /// The object store failed.
    #[error("object store")]
    Store(#[from] StoreError),
    /// A stored JSON value did not encode or decode.
    #[error("stored JSON")]
    Json(#[from] serde_json::Error),
    /// The database holds a value the run's rules do not know.
    #[error("stored state is invalid: {0}")]
    Invalid(String),
    /// The request cannot be done in the run's state (a wrong phase, an unknown partition, ...).
    #[error("{message}")]
    Refused {
        /// What the caller is told.
        code: ErrorCode,
        /// Why.
        message: String,
    },
}

impl RunError {
    /// A refusal with its code.
    pub fn refused(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::Refused {
            code,
            message: message.into(),
        }
    }

    /// The error and each of its causes, for the log.
    pub fn detail(&self) -> String {
        let mut detail = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(e) = cause {
            detail.push_str(": ");
            detail.push_str(&e.to_string());
            cause = e.source();
        }
        detail
    }
}

/// The result of a run transition.
pub type RunResult<T> = Result<T, RunError>;

impl From<RunError> for AppError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::Database(e) => e.into(),
            RunError::Store(e) => e.into(),
            RunError::Refused { code, message } => Self::new(code, message),
            e @ (RunError::Json(_) | RunError::Invalid(_)) => {
                Self::new(ErrorCode::Internal, e.detail())
            }
        }
    }
}

/// Start-up errors, each saying what to fix.
#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    /// The run config is inconsistent.
    #[error("invalid run config: {0}")]
    Config(String),
    /// PostgreSQL is unreachable or refused.
    #[error(
        "cannot use the database ({0}); check --database-url / DATABASE_URL and that PostgreSQL is running"
    )]
    Database(String),
    /// A migration failed.
    #[error("database migration failed: {0}")]
    Migrate(String),
    /// A newer orchestrator has migrated the database past this binary's schema.
    #[error(
        "the database's schema is at migration {applied}, newer than this orchestrator's {known}: a newer version has migrated it; run that version on every replica"
    )]
    SchemaNewer {
        /// The newest migration applied.
        applied: i64,
        /// The newest this binary carries.
        known: i64,
    },
    /// Replicas built for an older schema still serve the database.
    #[error(
        "replicas of an older version still serve this database ({replicas}); stop every one before starting this version (schema {known}), or wait {wait_s} s after the last one stopped; a connection left by a machine that is gone can be ended with pg_terminate_backend(pid)"
    )]
    OlderReplicas {
        /// Each one, as it recorded itself.
        replicas: String,
        /// The schema this binary is built for.
        known: i64,
        /// How long a stopped replica still counts as serving.
        wait_s: u64,
    },
    /// The stored run differs from the configured one.
    #[error(
        "run {name:?} already exists in this database with a different config; pick another --run-name or the same settings ({detail})"
    )]
    RunMismatch {
        /// Run name.
        name: String,
        /// First difference.
        detail: String,
    },
    /// The chain did not answer.
    #[error(
        "cannot read subnet {netuid} from the chain at {url}: {reason}; check --subtensor.network / --subtensor.chain_endpoint and --netuid"
    )]
    Chain {
        /// Endpoint.
        url: String,
        /// Subnet.
        netuid: u16,
        /// What failed.
        reason: String,
    },
    /// The object store could not be opened.
    #[error("cannot open the object store: {0}; check --store")]
    Store(String),
    /// The dataset folder could not be published in the store.
    #[error("cannot publish the dataset: {0}")]
    Dataset(String),
    /// Serving failed.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_of(e: AppError) -> (StatusCode, ApiError) {
        let resp = e.into_response();
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .expect("body");
        (status, serde_json::from_slice(&bytes).expect("an ApiError"))
    }

    /// A database's message never reaches the client in a 500; a 4xx keeps its message, since
    /// it tells the client what to fix.
    #[tokio::test]
    async fn an_internal_error_sends_a_generic_body() {
        let leak = "relation \"secret_table\" does not exist";
        let (status, body) = body_of(sqlx::Error::Protocol(leak.into()).into()).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body.code, ErrorCode::Internal);
        assert_eq!(body.message, INTERNAL_MESSAGE);
        let (status, body) = body_of(AppError::new(
            ErrorCode::BadRequest,
            "epoch must be a number",
        ))
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body.message, "epoch must be a number");
    }

    /// A run transition's refusal reaches the client with its code and reason; its failures
    /// reach the log with every cause and the client as a generic 500.
    #[tokio::test]
    async fn a_run_error_keeps_refusals_and_hides_failures() {
        let refused = RunError::refused(ErrorCode::WrongPhase, "the merging phase ended");
        let (status, body) = body_of(refused.into()).await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(body.code, ErrorCode::WrongPhase);
        assert_eq!(body.message, "the merging phase ended");

        let cause = serde_json::from_str::<u8>("\"secret_table\"").expect_err("not a number");
        let failed = RunError::from(cause);
        assert!(
            failed.detail().starts_with("stored JSON: invalid type"),
            "{}",
            failed.detail()
        );
        let (status, body) = body_of(failed.into()).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body.message, INTERNAL_MESSAGE);
        let (_, body) = body_of(RunError::Invalid("bad phase secret".into()).into()).await;
        assert_eq!(body.message, INTERNAL_MESSAGE);
    }
}
