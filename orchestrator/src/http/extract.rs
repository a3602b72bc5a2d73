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
    // Read through a tree, where every struct must be an object (`json_objects`); axum's parse
    // records the path of every key as it goes (an allocation per key), which only an error
    // message needs, so it runs only for one.
    let Ok(mut tree) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Err(refusal::<T>(body, None));
    };
    let first = match crate::json_objects::from_value(&tree) {
        Ok(value) => return Ok(value),
        Err(e) => e,
    };
    // JSON Schema counts `2.0` as the integer 2, and so does the document: read whole numbers
    // written with a fraction as integers, then try again (only here, off the usual path).
    if whole_floats_as_integers(&mut tree)
        && let Ok(value) = crate::json_objects::from_value(&tree)
    {
        return Ok(value);
    }
    Err(refusal::<T>(body, Some(first)))
}

/// Why a body that did not read as `T` is refused: axum's message, which names the field, or,
/// where serde_json alone reads the body (a struct written as an array), what `json_objects`
/// found.
fn refusal<T: serde::de::DeserializeOwned>(
    body: &[u8],
    strict: Option<serde_json::Error>,
) -> AppError {
    match (axum::Json::<T>::from_bytes(body), strict) {
        (Err(rejection), _) => rejection.into(),
        (Ok(_), Some(e)) => AppError::new(
            ErrorCode::BadRequest,
            format!("the body's objects must be written as JSON objects: {e}"),
        ),
        (Ok(_), None) => AppError::new(ErrorCode::BadRequest, "the body could not be read"),
    }
}

/// Rewrites every number with a zero fraction that a float holds exactly (within 2^53) as an
/// integer; whether it changed any.
fn whole_floats_as_integers(value: &mut serde_json::Value) -> bool {
    const EXACT: f64 = 9_007_199_254_740_992.0;
    match value {
        serde_json::Value::Number(n) => {
            let Some(f) = n.as_f64().filter(|_| n.is_f64()) else {
                return false;
            };
            if f.fract() != 0.0 || f.abs() > EXACT {
                return false;
            }
            *n = if f >= 0.0 {
                serde_json::Number::from(f as u64)
            } else {
                serde_json::Number::from(f as i64)
            };
            true
        }
        serde_json::Value::Array(items) => items
            .iter_mut()
            .fold(false, |changed, v| whole_floats_as_integers(v) | changed),
        serde_json::Value::Object(fields) => fields
            .values_mut()
            .fold(false, |changed, v| whole_floats_as_integers(v) | changed),
        _ => false,
    }
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

    #[test]
    fn integers_written_with_a_zero_fraction_are_integers() {
        #[derive(serde::Deserialize, Debug, PartialEq)]
        struct Body {
            count: u64,
            offset: i32,
            loss: f64,
            items: Vec<u32>,
        }
        let body = br#"{"count": 3.0, "offset": -2.0, "loss": 2.0, "items": [1.0, 2]}"#;
        let parsed: Body = parse_json(body).expect("whole floats are integers");
        assert_eq!(
            parsed,
            Body {
                count: 3,
                offset: -2,
                loss: 2.0,
                items: vec![1, 2]
            }
        );
        for refused in [
            &br#"{"count": 3.5, "offset": 0, "loss": 1, "items": []}"#[..],
            br#"{"count": 1e300, "offset": 0, "loss": 1, "items": []}"#,
            br#"{"count": -1.0, "offset": 0, "loss": 1, "items": []}"#,
        ] {
            let err = parse_json::<Body>(refused).expect_err("not a u64");
            assert_eq!(err.0.code, ErrorCode::BadRequest, "{err:?}");
        }
    }
}
