//! Sessions (see `iota_protocol::session`): a caller opens one with an sr25519-signed request
//! (`POST /v1/sessions`, [`open`]), and its requests after that carry a keyed-BLAKE3
//! MAC in place of a signature.
//!
//! A session's key is a keyed BLAKE3 hash of its token and the caller's public key under the
//! run's secret (`runs.session_secret`, drawn once per run). Every replica of the run computes
//! it again from the request's headers, so no process stores a session, looks one up, or has to
//! be told about one another opened; a token whose expiry has passed is refused by its text. A
//! session gives nothing beyond the signed requests it stands for: the signer must still be a
//! member of the subnet at each request, within the same clock window, with a fresh uuid and
//! under its hotkey's rate limit.

use axum::Json;
use axum::extract::{Extension, State};
use iota_protocol::ErrorCode;
use iota_protocol::api::{OpenSessionRequest, OpenSessionResponse};
use iota_protocol::session::{decode_public_hex, new_token, seal};

use crate::app::App;
use crate::auth::{Caller, now_ms};
use crate::error::{ApiResult, AppError};
use crate::http::extract::ApiJson;

/// `POST /v1/sessions`: opens a session for the caller (any registered hotkey). Needs an sr25519
/// signature: a session does not open another. Nothing is stored, so a retried request does
/// nothing twice; it opens a second session, and either one serves.
#[utoipa::path(post, path = "/v1/sessions", tag = "sessions",
    request_body = OpenSessionRequest,
    responses((status = 200, body = OpenSessionResponse), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn open(
    State(app): State<App>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<OpenSessionRequest>,
) -> ApiResult<Json<OpenSessionResponse>> {
    if caller.by_session {
        return Err(AppError::new(
            ErrorCode::Unauthenticated,
            "a session is opened by a request signed with sr25519, not from another session",
        ));
    }
    let bad = |e: iota_protocol::session::SessionError| {
        AppError::new(ErrorCode::BadRequest, format!("public_key: {e}"))
    };
    let public = decode_public_hex(&req.public_key).map_err(bad)?;
    let expires_at_ms = now_ms().saturating_add(app.limits.session_ttl.as_millis() as u64);
    let token = new_token(expires_at_ms);
    let caller_key = caller.key.to_bytes();
    let key = app.run.session_secret.key_for(&token, &caller_key);
    let (server_public, sealed) =
        seal(&key, &public, &token, &caller_key, &app.hotkey).map_err(bad)?;
    metrics::counter!("iota_sessions_opened_total").increment(1);
    Ok(Json(OpenSessionResponse {
        session: token,
        public_key: hex::encode(server_public),
        sealed_key: hex::encode(sealed),
        expires_at_ms,
    }))
}
