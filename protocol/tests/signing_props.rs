//! Property tests of Epistula request verification: arbitrary header values never panic and never
//! verify; a correctly signed request verifies, and changing any signed part of it (body, path,
//! query, method, timestamp, uuid, signer, receiver, or any bit of the signature) is refused.
//!
//! Cases per property: `PROPTEST_CASES`, default [`DEFAULT_CASES`]. Run with `--nocapture` to see
//! the count each property ran.

use iota_protocol::AuthError;
use iota_protocol::signing::{
    HEADER_SIGNATURE, HEADER_SIGNED_BY, HEADER_SIGNED_FOR, HEADER_TIMESTAMP, HEADER_UUID,
    HEADER_VERSION, RequestSigner, SkewWindow, VerifiedRequest, find_header, sign_request,
    verify_request,
};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use sp_core::Pair as _;
use sp_core::sr25519;
use uuid::Uuid;

/// Each case signs and verifies once or twice (about 1 ms in a debug build).
const DEFAULT_CASES: u32 = 1024;

const HEADERS: [&str; 6] = [
    HEADER_VERSION,
    HEADER_TIMESTAMP,
    HEADER_UUID,
    HEADER_SIGNED_BY,
    HEADER_SIGNED_FOR,
    HEADER_SIGNATURE,
];

const NOW: u64 = 1_700_000_000_000;

fn config(name: &str) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    eprintln!("{name}: {cases} cases");
    ProptestConfig {
        cases,
        // Shrunk failures are saved beside this file, to be committed as regressions.
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    }
}

fn pair(seed: u8) -> sr25519::Pair {
    sr25519::Pair::from_seed(&[seed; 32])
}

fn receiver() -> String {
    pair(200).ss58()
}

fn verify(
    headers: &[(&'static str, String)],
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<VerifiedRequest, AuthError> {
    verify_request(
        |name| find_header(headers, name),
        method,
        path,
        body,
        &receiver(),
        NOW,
        SkewWindow::default(),
    )
}

/// A header value: mostly plausible shapes of each header, sometimes anything at all.
fn header_value() -> impl Strategy<Value = String> {
    prop_oneof![
        ".*",
        "[0-9]{0,25}",
        "-?[0-9]{1,20}",
        "0x[0-9a-fA-F]{0,130}",
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
        "5[1-9A-HJ-NP-Za-km-z]{0,60}",
        Just("2".to_owned()),
        Just(receiver()),
        Just(pair(1).ss58()),
        Just(NOW.to_string()),
    ]
}

/// A request target as axum would see it.
fn path_and_query() -> impl Strategy<Value = String> {
    ("/v1/[a-z/{}]{0,30}", prop::option::of("[a-z0-9=&%.]{0,20}")).prop_map(|(p, q)| match q {
        Some(q) => format!("{p}?{q}"),
        None => p,
    })
}

fn method() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("GET"), Just("POST"), Just("PUT"), Just("DELETE")]
}

#[test]
fn arbitrary_headers_never_panic_and_never_verify() {
    let headers = prop::collection::vec(prop::option::of(header_value()), 6);
    proptest!(config("arbitrary_headers_never_panic_and_never_verify"), |(
        values in headers,
        method in method(),
        path in path_and_query(),
        body in prop::collection::vec(any::<u8>(), 0..64),
    )| {
        let headers: Vec<(&'static str, String)> = HEADERS
            .iter()
            .zip(values)
            .filter_map(|(n, v)| v.map(|v| (*n, v)))
            .collect();
        // Nobody but the holder of a key can produce a verifying signature: random values never
        // verify (the odds of a random 64-byte string verifying are nil).
        prop_assert!(verify(&headers, method, &path, &body).is_err());
    });
}

/// A signed request and the parts it was signed over.
#[derive(Clone, Debug)]
struct Signed {
    headers: Vec<(&'static str, String)>,
    method: &'static str,
    path: String,
    body: Vec<u8>,
    ts: u64,
    uuid: Uuid,
}

fn signed() -> impl Strategy<Value = Signed> {
    (
        method(),
        path_and_query(),
        prop::collection::vec(any::<u8>(), 0..64),
        // Anywhere inside the accepted window.
        (NOW - 10_000)..=(NOW + 5_000),
        any::<u128>(),
        1u8..5,
    )
        .prop_map(|(method, path, body, ts, uuid, seed)| {
            let uuid = Uuid::from_u128(uuid);
            let s = sign_request(&pair(seed), &receiver(), method, &path, &body, ts, uuid);
            Signed {
                headers: s.headers,
                method,
                path,
                body,
                ts,
                uuid,
            }
        })
}

fn set(headers: &mut [(&'static str, String)], name: &str, value: String) {
    for h in headers.iter_mut() {
        if h.0 == name {
            h.1 = value.clone();
        }
    }
}

#[test]
fn signed_requests_verify() {
    proptest!(config("signed_requests_verify"), |(s in signed())| {
        match verify(&s.headers, s.method, &s.path, &s.body) {
            Ok(v) => {
                prop_assert_eq!(v.uuid, s.uuid);
                prop_assert_eq!(v.timestamp_ms, s.ts);
            }
            Err(e) => prop_assert!(false, "{:?} refused: {}", s, e),
        }
    });
}

/// One change to one signed part of a request.
#[derive(Clone, Debug)]
enum Mutation {
    /// Replace the body.
    Body(Vec<u8>),
    /// Flip one bit of the body.
    BodyBit(prop::sample::Index, u8),
    /// Change one character of the path (or query).
    PathChar(prop::sample::Index, char),
    /// Add or change a query string.
    Query(String),
    /// Another method.
    Method(&'static str),
    /// Another timestamp (in or out of the window).
    Timestamp(u64),
    /// Another uuid.
    Uuid(u128),
    /// Flip one bit of the signature.
    SignatureBit(prop::sample::Index, u8),
    /// Claim another signer.
    SignedBy(u8),
    /// Name another receiver.
    SignedFor(u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64).prop_map(Mutation::Body),
        (any::<prop::sample::Index>(), 0u8..8).prop_map(|(i, b)| Mutation::BodyBit(i, b)),
        (any::<prop::sample::Index>(), any::<char>()).prop_map(|(i, c)| Mutation::PathChar(i, c)),
        "[a-z0-9=&]{1,12}".prop_map(Mutation::Query),
        method().prop_map(Mutation::Method),
        prop_oneof![(NOW - 20_000)..(NOW + 20_000), any::<u64>()].prop_map(Mutation::Timestamp),
        any::<u128>().prop_map(Mutation::Uuid),
        (any::<prop::sample::Index>(), 0u8..8).prop_map(|(i, b)| Mutation::SignatureBit(i, b)),
        (5u8..10).prop_map(Mutation::SignedBy),
        (201u8..210).prop_map(Mutation::SignedFor),
    ]
}

#[test]
fn every_mutation_of_a_signed_request_is_refused() {
    proptest!(config("every_mutation_of_a_signed_request_is_refused"), |(
        s in signed(),
        m in mutation(),
    )| {
        let mut headers = s.headers.clone();
        let mut method = s.method;
        let mut path = s.path.clone();
        let mut body = s.body.clone();
        match &m {
            Mutation::Body(b) => {
                prop_assume!(*b != s.body);
                body = b.clone();
            }
            Mutation::BodyBit(i, bit) => {
                prop_assume!(!body.is_empty());
                let at = i.index(body.len());
                body[at] ^= 1 << bit;
            }
            Mutation::PathChar(i, c) => {
                let chars: Vec<char> = path.chars().collect();
                let at = i.index(chars.len());
                prop_assume!(chars[at] != *c);
                path = chars
                    .iter()
                    .enumerate()
                    .map(|(k, x)| if k == at { *c } else { *x })
                    .collect();
            }
            Mutation::Query(q) => {
                path = match path.split_once('?') {
                    Some((p, old)) => {
                        prop_assume!(old != q);
                        format!("{p}?{q}")
                    }
                    None => format!("{path}?{q}"),
                };
            }
            Mutation::Method(other) => {
                prop_assume!(*other != s.method);
                method = other;
            }
            Mutation::Timestamp(t) => {
                prop_assume!(*t != s.ts);
                set(&mut headers, HEADER_TIMESTAMP, t.to_string());
            }
            Mutation::Uuid(u) => {
                let u = Uuid::from_u128(*u);
                prop_assume!(u != s.uuid);
                set(&mut headers, HEADER_UUID, u.hyphenated().to_string());
            }
            Mutation::SignatureBit(i, bit) => {
                let sig = headers
                    .iter()
                    .find(|h| h.0 == HEADER_SIGNATURE)
                    .map(|h| h.1.clone())
                    .unwrap_or_default();
                let mut raw = hex::decode(sig.trim_start_matches("0x")).unwrap_or_default();
                prop_assert_eq!(raw.len(), 64);
                let at = i.index(raw.len());
                raw[at] ^= 1 << bit;
                set(&mut headers, HEADER_SIGNATURE, format!("0x{}", hex::encode(raw)));
            }
            Mutation::SignedBy(seed) => {
                set(&mut headers, HEADER_SIGNED_BY, pair(*seed).ss58());
            }
            Mutation::SignedFor(seed) => {
                set(&mut headers, HEADER_SIGNED_FOR, pair(*seed).ss58());
            }
        }
        let verdict = verify(&headers, method, &path, &body);
        prop_assert!(verdict.is_err(), "{:?} was accepted after {:?}", s, m);
    });
}
