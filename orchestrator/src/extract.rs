//! Extractors whose rejections are the API's error body.

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::header;
use iota_protocol::ErrorCode;

use crate::error::*;

/// `axum::Json` whose rejections are the API's error body, and which refuses strings holding
/// U+0000: PostgreSQL stores that character in neither `text` nor `jsonb`, so such a body would
/// otherwise fail inside the handler as a database error (a 500) instead of a 400.
pub struct ApiJson<T>(pub T);

impl<T, S> axum::extract::FromRequest<S> for ApiJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if !json_content_type(req.headers()) {
            return Err(not_json());
        }
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| AppError::new(ErrorCode::BadRequest, e.body_text()))?;
        parse_json(&bytes).map(Self)
    }
}

fn not_json() -> AppError {
    AppError::new(
        ErrorCode::BadRequest,
        "Expected request with `Content-Type: application/json`",
    )
}

/// A JSON body as [`ApiJson`] reads it, from a request's headers and its buffered body.
pub fn json_body<T: serde::de::DeserializeOwned>(
    headers: &axum::http::HeaderMap,
    body: &[u8],
) -> Result<T, AppError> {
    if !json_content_type(headers) {
        return Err(not_json());
    }
    parse_json(body)
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, AppError> {
    if has_nul_escape(body) {
        return Err(AppError::new(
            ErrorCode::BadRequest,
            "JSON strings may not contain U+0000",
        ));
    }
    // serde_json alone first: axum's parse records the path of every key as it goes (an
    // allocation per key), which only an error message needs.
    if let Ok(value) = serde_json::from_slice(body) {
        return Ok(value);
    }
    let axum::Json(value) = axum::Json::<T>::from_bytes(body)?;
    Ok(value)
}

/// Whether the request says its body is JSON (`application/json` or `application/…+json`), as
/// `axum::Json` requires.
fn json_content_type(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json")
            || subtype
                .rsplit_once('+')
                .is_some_and(|(_, suffix)| suffix.eq_ignore_ascii_case("json")))
}

/// Whether JSON text spells U+0000 in a string. Valid JSON can only write it as the escape
/// `\u0000` (a raw control byte is a syntax error); an escaped backslash before `u0000` is
/// skipped, so `"\\u0000"` (a backslash, then the letters) is not a match.
fn has_nul_escape(json: &[u8]) -> bool {
    let mut i = 0;
    while i < json.len() {
        if json[i] == b'\\' {
            if json.get(i + 1..i + 6) == Some(&b"u0000"[..]) {
                return true;
            }
            i += 2;
        } else {
            i += 1;
        }
    }
    false
}

/// `axum::extract::Path` whose rejections are the API's error body.
#[derive(axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(AppError))]
pub struct ApiPath<T>(pub T);

/// `axum::extract::Query` whose rejections are the API's error body.
#[derive(axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(AppError))]
pub struct ApiQuery<T>(pub T);

impl From<axum::extract::rejection::JsonRejection> for AppError {
    fn from(e: axum::extract::rejection::JsonRejection) -> Self {
        Self::new(ErrorCode::BadRequest, e.body_text())
    }
}

impl From<axum::extract::rejection::PathRejection> for AppError {
    fn from(e: axum::extract::rejection::PathRejection) -> Self {
        Self::new(ErrorCode::BadRequest, e.body_text())
    }
}

impl From<axum::extract::rejection::QueryRejection> for AppError {
    fn from(e: axum::extract::rejection::QueryRejection) -> Self {
        Self::new(ErrorCode::BadRequest, e.body_text())
    }
}

/// An epoch, id or bound from a path or query: a non-negative integer that fits the database's
/// `bigint`. The document declares that range for every unsigned 64-bit parameter, so a value
/// above it is refused here (400) as the document says, never wrapped into a negative one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "u64")]
pub struct Bigint(pub u64);

impl TryFrom<u64> for Bigint {
    type Error = String;

    fn try_from(v: u64) -> Result<Self, String> {
        if v > i64::MAX as u64 {
            Err(format!(
                "{v} is above {}, the largest this API takes",
                i64::MAX
            ))
        } else {
            Ok(Self(v))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn json_content_types_are_recognised() {
        let with = |v: &'static str| {
            let mut h = axum::http::HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(v));
            json_content_type(&h)
        };
        for yes in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/problem+json",
        ] {
            assert!(with(yes), "{yes} refused");
        }
        for no in [
            "text/plain",
            "application/jsonx",
            "json",
            "application/",
            "text/json",
        ] {
            assert!(!with(no), "{no} accepted");
        }
        assert!(!json_content_type(&axum::http::HeaderMap::new()));
    }

    #[test]
    fn nul_escapes_are_found_and_escaped_backslashes_are_not() {
        assert!(has_nul_escape(br#"{"device":"\u0000"}"#));
        assert!(has_nul_escape(br#"["a\u0000b"]"#));
        assert!(has_nul_escape(br#"["\\\u0000"]"#));
        assert!(!has_nul_escape(br#"["\\u0000"]"#));
        assert!(!has_nul_escape(br#"{"a":"\u0001","b":"u0000"}"#));
        assert!(!has_nul_escape(b""));
        assert!(!has_nul_escape(b"\\"));
    }

    /// A value above the database's range is refused, and the largest one is taken.
    #[test]
    fn a_bigint_above_the_database_range_is_refused() {
        let parse = |text: &str| serde_json::from_str::<Bigint>(text);
        assert_eq!(
            parse("9223372036854775807").ok(),
            Some(Bigint(i64::MAX as u64))
        );
        assert!(parse("9223372036854775808").is_err());
        assert!(parse("18446744073709551615").is_err());
        assert!(parse("-1").is_err());
    }
}
