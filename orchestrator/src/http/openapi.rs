//! The OpenAPI document: the routes' operations, the signing schemes and the integers' ranges.

use std::sync::OnceLock;

use axum::response::IntoResponse;
use utoipa::OpenApi;

use super::{dataset, miner, sessions, validator, views};

/// The OpenAPI document.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "IOTA orchestrator API",
        description = "Signed routes carry Epistula v2 headers with the method and path bound into the signature (see API.md)."
    ),
    paths(
        miner::join::register, miner::join::heartbeat, miner::work::work, miner::uploads::upload_output, miner::uploads::presign_output,
        miner::uploads::commit_output, miner::complete::complete, miner::pseudo_gradients::reserve_pg, miner::pseudo_gradients::upload_pg, miner::pseudo_gradients::presign_pg, miner::pseudo_gradients::commit_pg,
        miner::merges::merges, miner::merges::weights, miner::merges::upload_merge, miner::merges::presign_merge, miner::merges::commit_merge, miner::blobs::blob,
        miner::blobs::report_bad_object, dataset::files, sessions::open,
        validator::hops, validator::samples, validator::epoch, validator::disputes,
        validator::settle, validator::upload_merge, validator::scores,
        validator::spot_checks, validator::report_spot_checks,
        views::get_run, views::get_status, views::get_stages, views::get_stage_weights,
        views::get_miners, views::get_loss, views::get_throughput, views::get_sample,
        views::get_merges, views::get_scores, views::get_epoch, views::get_epoch_samples,
        views::get_epoch_scores, views::get_epoch_spot_checks, views::health,
    ),
    modifiers(&EpistulaScheme, &UnsignedRanges),
)]
pub struct ApiDoc;

struct EpistulaScheme;

impl utoipa::Modify for EpistulaScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{ApiKey, ApiKeyValue, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "epistula",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "epistula-request-signature",
                "sr25519 signature over sha256(body).uuid.timestamp.signed_for.METHOD.path_and_query, with the other Epistula-* headers and Iota-Body-Sha256 (required on uploads and bodies over 64 KiB)",
            ))),
        );
        components.add_security_scheme(
            "session",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "iota-session-mac",
                "keyed BLAKE3 (the session's key) over the same message as an epistula signature, with Iota-Session naming the session (POST /v1/sessions) and the other Epistula-* headers but Epistula-Request-Signature",
            ))),
        );
        // Every signed route takes a session's MAC too, but the route that opens a session.
        let epistula =
            utoipa::openapi::security::SecurityRequirement::new("epistula", Vec::<String>::new());
        let session =
            utoipa::openapi::security::SecurityRequirement::new("session", Vec::<String>::new());
        for (path, item) in openapi.paths.paths.iter_mut() {
            if path == iota_protocol::session::SESSIONS_PATH {
                continue;
            }
            for operation in [&mut item.get, &mut item.post, &mut item.put]
                .into_iter()
                .flatten()
            {
                if let Some(security) = &mut operation.security
                    && security.contains(&epistula)
                {
                    security.push(session.clone());
                }
            }
        }
    }
}

/// Declares the range the server takes for unsigned path and query integers. utoipa writes a
/// `u64` as `int64` from 0 and a `u32` as `int32` from 0; the server parses a `u64` parameter as an
/// [`super::extract::Bigint`] (at most `i64::MAX`, the database's `bigint`) and a `u32` up to
/// `u32::MAX`, which `int32` would not allow. So a client (or a fuzzer) reading the document
/// knows exactly which values are refused.
struct UnsignedRanges;

impl utoipa::Modify for UnsignedRanges {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::Number;
        use utoipa::openapi::RefOr;
        use utoipa::openapi::schema::{KnownFormat, Schema, SchemaFormat};
        for item in openapi.paths.paths.values_mut() {
            let operations = [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.delete,
            ];
            for op in operations.into_iter().flatten() {
                for param in op.parameters.iter_mut().flatten() {
                    let RefOr::T(param) = param else { continue };
                    let Some(RefOr::T(Schema::Object(o))) = param.schema.as_mut() else {
                        continue;
                    };
                    let from_zero = match o.minimum {
                        Some(Number::UInt(n)) => n == 0,
                        Some(Number::Int(n)) => n == 0,
                        Some(Number::Float(n)) => n == 0.0,
                        None => false,
                    };
                    if !from_zero || o.maximum.is_some() {
                        continue;
                    }
                    match &o.format {
                        Some(SchemaFormat::KnownFormat(KnownFormat::Int64)) => {
                            o.maximum = Some(Number::UInt(i64::MAX as usize));
                        }
                        Some(SchemaFormat::KnownFormat(KnownFormat::Int32)) => {
                            o.format = Some(SchemaFormat::KnownFormat(KnownFormat::Int64));
                            o.maximum = Some(Number::UInt(u32::MAX as usize));
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

/// The OpenAPI document as pretty JSON (what `orchestrator/openapi.json` holds).
pub fn openapi_json() -> String {
    ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

pub(super) async fn openapi_route() -> impl IntoResponse {
    // Built once: a public route, and the document does not change while the process runs.
    static DOC: OnceLock<bytes::Bytes> = OnceLock::new();
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        DOC.get_or_init(|| bytes::Bytes::from(openapi_json()))
            .clone(),
    )
}

/// Re-exported for the CLI's `openapi` command and tests.
pub fn openapi() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}
