//! `GET /v1/dataset`: the run's dataset as its members download it.

use axum::Json;
use axum::extract::State;
use iota_protocol::ErrorCode;
use iota_protocol::blob::blake3_hex;

use crate::app::App;
use crate::error::{ApiResult, AppError};
use crate::store::StoreError;
use iota_protocol::dataset::{
    DatasetFile, DatasetFiles, MANIFEST_FILE, MAX_MANIFEST_BYTES, ManifestFiles, dataset_prefix,
};

/// `GET /v1/dataset`: the files of the run's dataset in its store, with their sizes as stored,
/// the BLAKE3 each must have (the run's `dataset` for the manifest, the manifest's for the rest)
/// and download URLs where the store presigns. A member checks each against the manifest it
/// verified before downloading, and each download against its BLAKE3.
#[utoipa::path(get, path = "/v1/dataset", tag = "miner",
    responses((status = 200, body = DatasetFiles), (status = "4XX", body = iota_protocol::ApiError)),
    security(("epistula" = [])))]
pub async fn files(State(app): State<App>) -> ApiResult<Json<DatasetFiles>> {
    let Some(hash) = app.run.config.dataset.clone() else {
        return Err(AppError::new(
            ErrorCode::NotFound,
            "the run names no dataset (it trains on the embedded grammar corpus)",
        ));
    };
    let prefix = dataset_prefix(&hash);
    let manifest = stored_manifest(&app, &hash).await?;
    let expected = ManifestFiles::parse(&manifest)
        .and_then(|m| m.expected())
        .map_err(|e| AppError::new(ErrorCode::Internal, e))?;
    let mut files = Vec::with_capacity(expected.len() + 1);
    let mut push = |name: &str, size: u64, blake3: &str| {
        files.push(DatasetFile {
            name: name.to_owned(),
            key: format!("{prefix}{name}"),
            size,
            blake3: blake3.to_owned(),
            url: None,
        });
    };
    push(MANIFEST_FILE, manifest.len() as u64, &hash);
    for f in &expected {
        let key = format!("{prefix}{}", f.name);
        let Some(size) = app.store.size_of(&key).await? else {
            return Err(not_published(&hash));
        };
        push(&f.name, size, &f.blake3);
    }
    for f in &mut files {
        f.url = app.store.presign(http::Method::GET, &f.key).await?;
    }
    Ok(Json(DatasetFiles {
        dataset: hash,
        files,
    }))
}

fn not_published(hash: &str) -> AppError {
    AppError::new(
        ErrorCode::NotFound,
        format!(
            "dataset {hash} is not in the run's store: the orchestrator publishes it when started \
             with --data; meanwhile use a local copy (--data-dir)"
        ),
    )
}

/// The manifest of the run's dataset `hash` as stored, checked to be the run's.
async fn stored_manifest(app: &App, hash: &str) -> ApiResult<bytes::Bytes> {
    let key = format!("{}{MANIFEST_FILE}", dataset_prefix(hash));
    let manifest = match app.store.get_bounded(&key, MAX_MANIFEST_BYTES).await {
        Err(StoreError::NotFound(_)) => return Err(not_published(hash)),
        r => r?,
    };
    if blake3_hex(&manifest) != hash {
        tracing::error!(dataset = %hash, "the stored manifest has other bytes than the run's");
        return Err(AppError::new(
            ErrorCode::Internal,
            "the stored manifest is not the run's",
        ));
    }
    Ok(manifest)
}
