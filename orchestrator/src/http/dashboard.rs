//! The dashboard: one self-contained HTML page (no build step) that reads the public API.

use axum::response::Html;

const PAGE: &str = include_str!("../../assets/dashboard.html");

/// `GET /` and `GET /dashboard`.
pub async fn page() -> Html<&'static str> {
    Html(PAGE)
}
