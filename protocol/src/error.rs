//! The one error body every endpoint returns, with a stable machine-readable `code`.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Stable error codes. Clients branch on these, never on messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed (bad JSON, bad query, bad path).
    BadRequest,
    /// Signature headers missing, malformed, or not verifying.
    Unauthenticated,
    /// The request uuid was used before.
    Replayed,
    /// The timestamp is outside the accepted clock window.
    ClockSkew,
    /// The request names a session the server does not hold (never opened, expired, or of
    /// another signer): open a new one (`POST /v1/sessions`).
    UnknownSession,
    /// The signer is not registered on the subnet.
    NotRegistered,
    /// The endpoint needs a validator permit.
    NotValidator,
    /// The caller has not joined the run as a miner (call `register` first).
    NotAMiner,
    /// The caller is not allowed to do this (for example, not an owner of this partition).
    Forbidden,
    /// No such resource.
    NotFound,
    /// The route exists but not for this method (the `Allow` header lists those it takes).
    MethodNotAllowed,
    /// The lease is not (or no longer) held by the caller; the work was re-routed.
    LeaseExpired,
    /// The epoch phase does not accept this request now.
    WrongPhase,
    /// The request conflicts with what was already accepted (for example, different bytes for
    /// an immutable upload).
    Conflict,
    /// The body did not arrive in time (the deadline grows with its declared length); send the
    /// request again.
    RequestTimeout,
    /// The body is larger than allowed.
    PayloadTooLarge,
    /// An uploaded tensor is not what this slot expects (size, dtype, shape, values, hash).
    InvalidTensor,
    /// Too many requests; retry after the `Retry-After` header.
    RateLimited,
    /// The chain could not be read; retry.
    ChainUnavailable,
    /// Another attempt of the same request is still being handled (a commit whose object an
    /// earlier attempt is checking); retry after the `Retry-After` header.
    InProgress,
    /// Something failed on the server; retry.
    Internal,
}

impl ErrorCode {
    /// The HTTP status that carries this code.
    pub fn status(self) -> u16 {
        match self {
            Self::BadRequest | Self::InvalidTensor => 400,
            Self::Unauthenticated | Self::Replayed | Self::ClockSkew | Self::UnknownSession => 401,
            Self::NotRegistered | Self::NotValidator | Self::NotAMiner | Self::Forbidden => 403,
            Self::NotFound => 404,
            Self::MethodNotAllowed => 405,
            Self::LeaseExpired | Self::WrongPhase | Self::Conflict => 409,
            Self::RequestTimeout => 408,
            Self::PayloadTooLarge => 413,
            Self::RateLimited => 429,
            Self::ChainUnavailable | Self::InProgress => 503,
            Self::Internal => 500,
        }
    }

    /// The code as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadRequest => "bad_request",
            Self::Unauthenticated => "unauthenticated",
            Self::Replayed => "replayed",
            Self::ClockSkew => "clock_skew",
            Self::UnknownSession => "unknown_session",
            Self::NotRegistered => "not_registered",
            Self::NotValidator => "not_validator",
            Self::NotAMiner => "not_a_miner",
            Self::Forbidden => "forbidden",
            Self::NotFound => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::LeaseExpired => "lease_expired",
            Self::WrongPhase => "wrong_phase",
            Self::Conflict => "conflict",
            Self::RequestTimeout => "request_timeout",
            Self::PayloadTooLarge => "payload_too_large",
            Self::InvalidTensor => "invalid_tensor",
            Self::RateLimited => "rate_limited",
            Self::ChainUnavailable => "chain_unavailable",
            Self::InProgress => "in_progress",
            Self::Internal => "internal",
        }
    }
}

/// The JSON body of every error response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ApiError {
    /// Stable code.
    pub code: ErrorCode,
    /// A sentence for people.
    pub message: String,
}

impl ApiError {
    /// A new error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_match_serde() {
        for code in [
            ErrorCode::BadRequest,
            ErrorCode::LeaseExpired,
            ErrorCode::InvalidTensor,
            ErrorCode::NotValidator,
            ErrorCode::MethodNotAllowed,
            ErrorCode::InProgress,
            ErrorCode::UnknownSession,
        ] {
            let json = serde_json::to_string(&code).expect("serialise");
            assert_eq!(json, format!("\"{}\"", code.as_str()));
        }
    }

    /// Clients retry by status (429, 5xx) and tell refusals apart by it: each code keeps its
    /// documented status.
    #[test]
    fn codes_travel_with_their_statuses() {
        for (code, status) in [
            (ErrorCode::BadRequest, 400),
            (ErrorCode::InvalidTensor, 400),
            (ErrorCode::Replayed, 401),
            (ErrorCode::UnknownSession, 401),
            (ErrorCode::NotRegistered, 403),
            (ErrorCode::NotFound, 404),
            (ErrorCode::RequestTimeout, 408),
            (ErrorCode::Conflict, 409),
            (ErrorCode::PayloadTooLarge, 413),
            (ErrorCode::RateLimited, 429),
            (ErrorCode::Internal, 500),
            (ErrorCode::InProgress, 503),
        ] {
            assert_eq!(code.status(), status, "{code:?}");
        }
    }
}
