//! Bad input against every documented endpoint, from the committed `openapi.json`: for each
//! operation, requests with malformed and hostile path parameters, query strings, bodies, content
//! types and signatures (none, garbage, stale, forged, from an unregistered hotkey, and correctly
//! signed by a registered miner or validator). No answer may be a 5xx, no connection may drop, and
//! the orchestrator must still be healthy afterwards.
//!
//! Deterministic per seed: `IOTA_FUZZ_SEED` (default [`DEFAULT_SEED`]) and
//! `IOTA_FUZZ_REQUESTS_PER_OP` (default [`DEFAULT_PER_OP`]). The totals are printed; run with
//! `--nocapture` to see them.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use iota_orchestrator::StoreConfig;
use iota_protocol::api::{WorkRequest, WorkResponse};
use iota_protocol::blob::blake3_hex;
use iota_protocol::signing::{
    HEADER_SIGNATURE, HEADER_SIGNED_BY, HEADER_SIGNED_FOR, HEADER_TIMESTAMP, HEADER_UUID,
    HEADER_VERSION, RequestSigner, sign_request,
};
use iota_protocol::tensor::{encode_boundary_f32, encode_merged, encode_partition};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use uuid::Uuid;

const HEADERS: [&str; 6] = [
    HEADER_VERSION,
    HEADER_TIMESTAMP,
    HEADER_UUID,
    HEADER_SIGNED_BY,
    HEADER_SIGNED_FOR,
    HEADER_SIGNATURE,
];

const MINER: u8 = 1;
const VALIDATOR: u8 = 10;
const STRANGER: u8 = 99;
const ORCHESTRATOR: u8 = 200;

const DEFAULT_SEED: u64 = 0x10_7a_f0_22;
const DEFAULT_PER_OP: usize = 150;
/// Requests in flight at once.
const CONCURRENCY: usize = 8;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Where a parameter goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum In {
    Path,
    Query,
}

#[derive(Clone, Debug)]
struct Param {
    name: String,
    location: In,
    schema: Value,
    required: bool,
}

#[derive(Clone, Debug)]
enum BodyKind {
    None,
    Json(Value),
    Octet,
}

/// One documented operation.
#[derive(Clone, Debug)]
struct Op {
    method: reqwest::Method,
    path: String,
    params: Vec<Param>,
    body: BodyKind,
    signed: bool,
}

fn load_ops(doc: &Value) -> Vec<Op> {
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("path item") {
            let method: reqwest::Method = method.to_uppercase().parse().expect("method");
            let params = op["parameters"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .map(|p| Param {
                            name: p["name"].as_str().expect("name").to_owned(),
                            location: match p["in"].as_str() {
                                Some("path") => In::Path,
                                Some("query") => In::Query,
                                other => panic!("{method} {path}: parameter in {other:?}"),
                            },
                            schema: p["schema"].clone(),
                            required: p["required"].as_bool().unwrap_or(false),
                        })
                        .collect()
                })
                .unwrap_or_default();
            let content = &op["requestBody"]["content"];
            let body = if let Some(schema) = content.get("application/json") {
                BodyKind::Json(schema["schema"].clone())
            } else if content.get("application/octet-stream").is_some() {
                BodyKind::Octet
            } else {
                BodyKind::None
            };
            let signed = op["security"].as_array().is_some_and(|s| !s.is_empty());
            ops.push(Op {
                method,
                path: path.clone(),
                params,
                body,
                signed,
            });
        }
    }
    ops
}

/// Real identifiers of the running orchestrator, so some requests get past "not found".
#[derive(Clone, Debug, Default)]
struct Known {
    task_ids: Vec<i64>,
    leases: Vec<Uuid>,
    boundary_shape: [u64; 3],
}

/// Integers around every width a handler or column might use, and text that is no integer.
const EVIL_INTEGERS: &[&str] = &[
    "-1",
    "-0",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "-9223372036854775809",
    "99999999999999999999999999999",
    "1e3",
    "1.5",
    "0x10",
    "+7",
    " 1",
    "",
    "abc",
    "%00",
    "%FF%FE",
    "null",
    "NaN",
    "%E2%82%AC",
    "..",
];

const EVIL_STRINGS: &[&str] = &[
    "",
    "..",
    "../../etc/passwd",
    "%2e%2e/%2e%2e/x",
    "a//b",
    "%00",
    "%ZZ",
    "ü€😀",
    "runs/1/epochs/0",
    "' OR 1=1 --",
    "\\",
    "0000000000000000000000000000000000000000000000000000000000000000",
];

/// JSON text that no well-typed field accepts, or only just does.
const EVIL_JSON: &[&str] = &[
    "null",
    "true",
    "-1",
    "0",
    "1.5",
    "-0",
    "1e400",
    "-1e400",
    "1e-400",
    "4294967296",
    "9223372036854775808",
    "18446744073709551616",
    "-9223372036854775809",
    "123456789012345678901234567890",
    "\"\"",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "\"not-a-uuid\"",
    "\"00000000-0000-0000-0000-000000000000\"",
    "[]",
    "[1,2,3]",
    "{}",
    "{\"a\":{\"b\":[]}}",
];

struct Gen<'a> {
    rng: StdRng,
    doc: &'a Value,
    known: &'a Known,
}

impl Gen<'_> {
    fn chance(&mut self, p: f64) -> bool {
        self.rng.gen_bool(p)
    }

    fn pick<'b, T>(&mut self, items: &'b [T]) -> &'b T {
        items.choose(&mut self.rng).expect("non-empty")
    }

    fn integer(&mut self, schema: &Value) -> String {
        match self.rng.gen_range(0..10) {
            0..=3 => self.rng.gen_range(0..6).to_string(),
            4 | 5 if !self.known.task_ids.is_empty() => {
                self.pick(&self.known.task_ids.clone()).to_string()
            }
            6 if schema["minimum"].is_number() => "-1".into(),
            _ => (*self.pick(EVIL_INTEGERS)).to_owned(),
        }
    }

    fn string(&mut self, schema: &Value) -> String {
        if schema["format"] == "uuid" {
            return match self.rng.gen_range(0..4) {
                0 if !self.known.leases.is_empty() => {
                    self.pick(&self.known.leases.clone()).to_string()
                }
                1 => Uuid::from_u128(self.rng.r#gen()).to_string(),
                2 => Uuid::from_u128(self.rng.r#gen()).simple().to_string(),
                _ => (*self.pick(EVIL_STRINGS)).to_owned(),
            };
        }
        match self.rng.gen_range(0..5) {
            0 => hex::encode(self.rng.r#gen::<[u8; 32]>()),
            1 => (*self.pick(EVIL_STRINGS)).to_owned(),
            2 => "x".repeat(self.rng.gen_range(1000..5000)),
            _ => {
                let n = self.rng.gen_range(0..12);
                (0..n)
                    .map(|_| *self.pick(&['a', 'Z', '0', '/', '-', '_', '.', ' ', 'é']))
                    .collect()
            }
        }
    }

    /// A value for a parameter, as text before URL encoding.
    fn param(&mut self, schema: &Value) -> String {
        let ty = schema_type(schema);
        if self.chance(0.1) {
            return (*self.pick(EVIL_INTEGERS)).to_owned();
        }
        match ty.as_deref() {
            Some("integer") => self.integer(schema),
            _ => self.string(schema),
        }
    }

    /// A JSON instance of `schema`, mostly well-formed.
    fn instance(&mut self, schema: &Value, depth: usize) -> Value {
        if let Some(r) = schema["$ref"].as_str() {
            let name = r.trim_start_matches("#/components/schemas/");
            let target = self.doc["components"]["schemas"][name].clone();
            return self.instance(&target, depth + 1);
        }
        for key in ["oneOf", "anyOf"] {
            if let Some(options) = schema[key].as_array() {
                let choice = self.pick(options).clone();
                return self.instance(&choice, depth + 1);
            }
        }
        if let Some(parts) = schema["allOf"].as_array() {
            let mut merged = serde_json::Map::new();
            for p in parts.clone() {
                if let Value::Object(m) = self.instance(&p, depth + 1) {
                    merged.extend(m);
                }
            }
            return Value::Object(merged);
        }
        if let Some(values) = schema["enum"].as_array() {
            return self.pick(values).clone();
        }
        if depth > 8 {
            return Value::Null;
        }
        match schema_type(schema).as_deref() {
            Some("object") => {
                let required: Vec<&str> = schema["required"]
                    .as_array()
                    .map(|r| r.iter().filter_map(|v| v.as_str()).collect())
                    .unwrap_or_default();
                let mut out = serde_json::Map::new();
                if let Some(props) = schema["properties"].as_object() {
                    for (k, s) in props {
                        if required.contains(&k.as_str()) || self.chance(0.5) {
                            let v = self.instance(s, depth + 1);
                            out.insert(k.clone(), v);
                        }
                    }
                }
                Value::Object(out)
            }
            Some("array") => {
                let n = self.rng.gen_range(0..4);
                Value::Array(
                    (0..n)
                        .map(|_| self.instance(&schema["items"], depth + 1))
                        .collect(),
                )
            }
            Some("integer") => {
                let text = self.integer(schema);
                serde_json::from_str(&text).unwrap_or(json!(1))
            }
            Some("number") => json!(self.rng.gen_range(-1e3..1e3)),
            Some("boolean") => json!(self.chance(0.5)),
            Some("null") => Value::Null,
            _ => json!(self.string(schema)),
        }
    }

    /// Breaks a well-formed instance in one place: a value of the wrong type or range, a
    /// missing field, an extra one.
    fn mutate(&mut self, v: &mut Value, marker: &str) {
        let target = pick_node(v, &mut self.rng);
        match self.rng.gen_range(0..3) {
            0 => *target = Value::String(marker.to_owned()),
            1 => {
                if let Value::Object(m) = target {
                    let keys: Vec<String> = m.keys().cloned().collect();
                    if let Some(k) = keys.choose(&mut self.rng) {
                        m.remove(k);
                    }
                } else {
                    *target = Value::String(marker.to_owned());
                }
            }
            _ => {
                if let Value::Object(m) = target {
                    m.insert("unexpected".into(), json!([1, "two", null]));
                } else {
                    *target = Value::String(marker.to_owned());
                }
            }
        }
    }

    fn json_body(&mut self, schema: &Value) -> Vec<u8> {
        const MARKER: &str = "__fuzz_evil__";
        match self.rng.gen_range(0..21) {
            // Well-formed, but every string holds U+0000 (which PostgreSQL cannot store).
            20 => {
                let mut v = self.instance(schema, 0);
                nul_strings(&mut v);
                serde_json::to_vec(&v).expect("json")
            }
            // Well-formed per the document.
            0..=5 => serde_json::to_vec(&self.instance(schema, 0)).expect("json"),
            // One thing wrong, possibly a number no Rust integer holds.
            6..=12 => {
                let mut v = self.instance(schema, 0);
                self.mutate(&mut v, MARKER);
                let text = serde_json::to_string(&v).expect("json");
                let evil = *self.pick(EVIL_JSON);
                text.replacen(&format!("\"{MARKER}\""), evil, 1)
                    .into_bytes()
            }
            13 => Vec::new(),
            14 => (*self.pick(&[
                "{",
                "[",
                "nul",
                "{\"a\":}",
                "\u{feff}{}",
                "{}{}",
                "\"",
                "1 2",
            ]))
            .as_bytes()
            .to_vec(),
            15 => (0..self.rng.gen_range(1..256))
                .map(|_| self.rng.r#gen())
                .collect(),
            // Nesting far beyond any parser's recursion limit.
            16 => {
                let n = self.rng.gen_range(200..20_000);
                format!("{}{}", "[".repeat(n), "]".repeat(n)).into_bytes()
            }
            17 => (*self.pick(EVIL_JSON)).as_bytes().to_vec(),
            // Wide: many keys.
            18 => {
                let n = self.rng.gen_range(1000..20_000);
                let mut m = serde_json::Map::new();
                for i in 0..n {
                    m.insert(format!("k{i}"), json!(i));
                }
                serde_json::to_vec(&m).expect("json")
            }
            // Just over the JSON body limit (1 MiB by default).
            _ => {
                if self.chance(0.3) {
                    let mut b = b"{\"x\":\"".to_vec();
                    b.resize((1 << 20) + 100, b'a');
                    b.extend_from_slice(b"\"}");
                    b
                } else {
                    serde_json::to_vec(&self.instance(schema, 0)).expect("json")
                }
            }
        }
    }

    fn octet_body(&mut self) -> Vec<u8> {
        let shape = self.known.boundary_shape;
        let n = shape.iter().product::<u64>() as usize;
        match self.rng.gen_range(0..10) {
            0 => Vec::new(),
            1 | 2 => (0..self.rng.gen_range(1..512))
                .map(|_| self.rng.r#gen())
                .collect(),
            3 | 4 => {
                // A valid boundary tensor, possibly damaged.
                let v: Vec<f32> = (0..n).map(|_| self.rng.gen_range(-1.0..1.0)).collect();
                let mut b = encode_boundary_f32(shape, &v);
                if self.chance(0.5) {
                    let at = self.rng.gen_range(0..b.len());
                    b[at] ^= self.rng.gen_range(1..=255u8);
                }
                b
            }
            5 => {
                let mut v: Vec<f32> = vec![0.5; n];
                v[0] = f32::NAN;
                encode_boundary_f32(shape, &v)
            }
            6 => encode_partition(&vec![0.25; self.rng.gen_range(0..64)]),
            7 => {
                let len = self.rng.gen_range(0..64);
                encode_merged(&vec![0.5; len], &vec![0.0; len])
            }
            8 => {
                // A header that claims a tensor far larger than the body.
                let text = json!({
                    "__metadata__": {"iota": "{\"format\":\"iota-boundary/v1\"}"},
                    "values": {"dtype": "F32", "shape": [u64::MAX, 2], "data_offsets": [0, u64::MAX]}
                })
                .to_string();
                let mut b = (text.len() as u64).to_le_bytes().to_vec();
                b.extend_from_slice(text.as_bytes());
                b
            }
            _ => {
                let mut b = u64::MAX.to_le_bytes().to_vec();
                b.extend_from_slice(b"{}");
                b
            }
        }
    }
}

fn nul_strings(v: &mut Value) {
    match v {
        Value::String(s) => *s = format!("{s}\u{0}x"),
        Value::Object(m) => m.values_mut().for_each(nul_strings),
        Value::Array(a) => a.iter_mut().for_each(nul_strings),
        _ => {}
    }
}

fn schema_type(schema: &Value) -> Option<String> {
    match &schema["type"] {
        Value::String(s) => Some(s.clone()),
        // `["string", "null"]`: the non-null one.
        Value::Array(a) => a
            .iter()
            .filter_map(|t| t.as_str())
            .find(|t| *t != "null")
            .map(str::to_owned),
        _ => None,
    }
}

/// A uniformly chosen node of `v` (containers included).
fn pick_node<'v>(v: &'v mut Value, rng: &mut StdRng) -> &'v mut Value {
    let count = count_nodes(v);
    let mut target = rng.gen_range(0..count);
    nth_node(v, &mut target).expect("node in range")
}

fn count_nodes(v: &Value) -> usize {
    1 + match v {
        Value::Object(m) => m.values().map(count_nodes).sum(),
        Value::Array(a) => a.iter().map(count_nodes).sum(),
        _ => 0,
    }
}

fn nth_node<'v>(v: &'v mut Value, n: &mut usize) -> Option<&'v mut Value> {
    if *n == 0 {
        return Some(v);
    }
    *n -= 1;
    match v {
        Value::Object(m) => m.values_mut().find_map(|c| nth_node(c, n)),
        Value::Array(a) => a.iter_mut().find_map(|c| nth_node(c, n)),
        _ => None,
    }
}

/// How a request is signed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Auth {
    /// No Epistula headers.
    None,
    /// Header values that are not what they should be.
    Garbage,
    /// Correctly signed by a hotkey that is not on the subnet.
    Unregistered,
    /// Signed by the miner, then one signed part changed.
    Tampered,
    /// Outside the clock window.
    Stale,
    /// Correctly signed by the registered miner.
    Miner,
    /// Correctly signed by the validator (with a permit).
    Validator,
}

/// A request ready to send.
#[derive(Debug)]
struct Planned {
    op: usize,
    method: reqwest::Method,
    url: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    auth: Auth,
}

/// Encodes a parameter value for a path segment or query component, leaving some `%` escapes
/// raw so that malformed escapes reach the server.
fn encode_component(text: &str, raw: bool) -> String {
    if raw {
        return text
            .chars()
            .map(|c| match c {
                ' ' => "%20".to_owned(),
                '#' => "%23".to_owned(),
                '?' => "%3F".to_owned(),
                c => c.to_string(),
            })
            .collect();
    }
    url::form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

fn plan(
    g: &mut Gen<'_>,
    op_index: usize,
    op: &Op,
    base: &str,
    receiver: &str,
    signers: &BTreeMap<u8, Arc<dyn RequestSigner>>,
) -> Planned {
    // Often, a task's real id and lease with a correct digest and signature, so that only the body
    // is wrong and the request reaches the upload's tensor checks.
    let coherent = (op.params.iter().any(|p| p.name == "task_id")
        && !g.known.task_ids.is_empty()
        && g.chance(0.5))
    .then(|| g.rng.gen_range(0..g.known.task_ids.len()));
    // Path.
    let mut path = op.path.clone();
    for p in op.params.iter().filter(|p| p.location == In::Path) {
        let value = match coherent {
            Some(k) if p.name == "task_id" => g.known.task_ids[k].to_string(),
            _ => g.param(&p.schema),
        };
        let raw = g.chance(0.3);
        path = path.replace(&format!("{{{}}}", p.name), &encode_component(&value, raw));
    }
    // Body (before the query: an upload's `blake3` may be the body's real digest).
    let body = match &op.body {
        BodyKind::None => {
            if g.chance(0.1) {
                b"{\"unexpected\":true}".to_vec()
            } else {
                Vec::new()
            }
        }
        BodyKind::Json(schema) => g.json_body(schema),
        BodyKind::Octet => g.octet_body(),
    };
    // Query.
    let mut pairs: Vec<String> = Vec::new();
    for p in op.params.iter().filter(|p| p.location == In::Query) {
        if coherent.is_none() && ((!p.required && g.chance(0.3)) || g.chance(0.1)) {
            continue;
        }
        let value = match (p.name.as_str(), coherent) {
            ("lease", Some(k)) => g.known.leases[k].to_string(),
            ("blake3", Some(_)) => blake3_hex(&body),
            ("blake3", None) if g.chance(0.6) => blake3_hex(&body),
            _ => g.param(&p.schema),
        };
        let raw = coherent.is_none() && g.chance(0.2);
        pairs.push(format!("{}={}", p.name, encode_component(&value, raw)));
        if g.chance(0.05) {
            pairs.push(format!("{}={}", p.name, g.param(&p.schema)));
        }
    }
    if g.chance(0.15) {
        let extra = *g.pick(&[
            "x=1",
            "%zz=%zz",
            "a",
            "=",
            "&&&",
            "after=-5&after=7",
            "limit=0",
            "limit=99999999999",
            "lease=",
            "blake3",
        ]);
        pairs.push(extra.to_owned());
    }
    if g.chance(0.02) {
        pairs.push(format!("long={}", "q".repeat(8000)));
    }
    let mut target = path;
    if !pairs.is_empty() {
        pairs.shuffle(&mut g.rng);
        target = format!("{target}?{}", pairs.join("&"));
    }
    // What will actually go on the wire: the client parses and normalises the URL, and the
    // signature must cover exactly that.
    let url = url::Url::parse(&format!("{base}{target}"))
        .unwrap_or_else(|_| url::Url::parse(&format!("{base}/")).expect("base url"));
    let mut path_and_query = url.path().to_owned();
    if let Some(q) = url.query() {
        path_and_query = format!("{path_and_query}?{q}");
    }

    let mut headers: Vec<(String, Vec<u8>)> = Vec::new();
    let content_type = match op.body {
        BodyKind::Json(_) => "application/json",
        BodyKind::Octet => "application/octet-stream",
        BodyKind::None => "",
    };
    if g.chance(0.85) {
        if !content_type.is_empty() {
            headers.push(("content-type".into(), content_type.into()));
        }
    } else {
        let ct = *g.pick(&[
            "text/plain",
            "application/json; charset=utf-16",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/json",
            "*/*",
            "",
        ]);
        if !ct.is_empty() {
            headers.push(("content-type".into(), ct.into()));
        }
    }

    let auth = if coherent.is_some() {
        Auth::Miner
    } else if op.signed {
        match g.rng.gen_range(0..20) {
            0 | 1 => Auth::None,
            2 | 3 => Auth::Garbage,
            4 => Auth::Unregistered,
            5 | 6 => Auth::Tampered,
            7 => Auth::Stale,
            8..=13 => Auth::Miner,
            _ => Auth::Validator,
        }
    } else if g.chance(0.1) {
        Auth::Garbage
    } else {
        Auth::None
    };
    // Sometimes a method the route does not serve (signed for that method, so only the route
    // can refuse it).
    let method = if g.chance(0.03) {
        (*g.pick(&["DELETE", "PATCH", "OPTIONS", "HEAD", "FUZZ"])).to_owned()
    } else {
        op.method.as_str().to_owned()
    };
    let sign = |seed: u8, ts: u64| {
        sign_request(
            signers[&seed].as_ref(),
            receiver,
            &method,
            &path_and_query,
            &body,
            ts,
            Uuid::new_v4(),
        )
        .headers
    };
    let signed: Vec<(&'static str, String)> = match auth {
        Auth::None => Vec::new(),
        Auth::Garbage => {
            let mut h = sign(MINER, now_ms());
            for (_, v) in h.iter_mut() {
                if g.chance(0.5) {
                    *v = (*g.pick(&[
                        "",
                        "2",
                        "3",
                        "-1",
                        "18446744073709551616",
                        "0x",
                        "0xzz",
                        "not-a-uuid",
                        "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY",
                        "garbage",
                    ]))
                    .to_owned();
                }
            }
            h.retain(|_| g.chance(0.8));
            h
        }
        Auth::Unregistered => sign(STRANGER, now_ms()),
        Auth::Tampered => {
            let mut h = sign(MINER, now_ms());
            let which = *g.pick(&[
                HEADER_SIGNATURE,
                HEADER_UUID,
                HEADER_TIMESTAMP,
                HEADER_SIGNED_BY,
                HEADER_SIGNED_FOR,
                HEADER_VERSION,
            ]);
            for (name, v) in h.iter_mut() {
                if *name == which {
                    *v = match which {
                        HEADER_SIGNATURE => format!("0x{}", hex::encode([7u8; 64])),
                        HEADER_UUID => Uuid::new_v4().to_string(),
                        HEADER_TIMESTAMP => v
                            .parse::<u64>()
                            .map(|t| (t - 1).to_string())
                            .unwrap_or_default(),
                        HEADER_SIGNED_BY => pair(VALIDATOR).ss58(),
                        HEADER_SIGNED_FOR => pair(MINER).ss58(),
                        _ => "1".into(),
                    };
                }
            }
            h
        }
        Auth::Stale => sign(MINER, now_ms() - 3_600_000),
        Auth::Miner => sign(MINER, now_ms()),
        Auth::Validator => sign(VALIDATOR, now_ms()),
    };
    headers.extend(
        signed
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.into_bytes())),
    );
    if auth == Auth::Garbage && g.chance(0.2) {
        // Bytes that are no UTF-8 (obs-text): a header the server cannot read as a string.
        let name = *g.pick(&HEADERS);
        headers.retain(|(k, _)| k != name);
        headers.push((name.to_owned(), vec![0xff, 0xfe, b'2', 0x80]));
    }
    Planned {
        op: op_index,
        method: method.parse().expect("method token"),
        url: url.to_string(),
        headers,
        body,
        auth,
    }
}

/// At most 300 characters of `text`, for the log.
fn short(text: &str) -> String {
    text.chars().take(300).collect()
}

/// What came back.
#[derive(Debug)]
enum Outcome {
    Status(u16, String),
    Transport(String),
}

async fn send(http: &reqwest::Client, p: &Planned) -> Outcome {
    let mut req = http.request(p.method.clone(), &p.url);
    for (k, v) in &p.headers {
        let value = reqwest::header::HeaderValue::from_bytes(v).expect("header value");
        req = req.header(k, value);
    }
    match req.body(p.body.clone()).send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let text = resp.text().await.unwrap_or_default();
            Outcome::Status(status, text)
        }
        Err(e) => Outcome::Transport(format!("{e:?}")),
    }
}

/// A correctly signed `POST`: status and body text.
async fn post_signed(
    http: &reqwest::Client,
    base: &str,
    signer: &dyn RequestSigner,
    path: &str,
    body: Vec<u8>,
) -> (u16, String) {
    let raw = Raw {
        http: http.clone(),
        base: base.to_owned(),
        receiver: pair(ORCHESTRATOR).ss58(),
    };
    let (status, bytes) = raw
        .send_bytes(Call::new(signer, reqwest::Method::POST, path, body))
        .await;
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// A signed request that must succeed (set-up, not fuzzing).
async fn signed_ok(
    http: &reqwest::Client,
    base: &str,
    signer: &dyn RequestSigner,
    path: &str,
    body: Vec<u8>,
) -> Vec<u8> {
    let (status, text) = post_signed(http, base, signer, path, body).await;
    assert!((200..300).contains(&status), "{path}: {status} {text}");
    text.into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_never_gets_a_5xx() {
    init_tracing();
    let seed: u64 = env_or("IOTA_FUZZ_SEED", DEFAULT_SEED);
    let per_op: usize = env_or("IOTA_FUZZ_REQUESTS_PER_OP", DEFAULT_PER_OP);
    let doc_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi.json");
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(&doc_path).expect("read openapi.json"))
            .expect("openapi.json is JSON");
    let ops = load_ops(&doc);
    assert!(ops.len() > 20, "only {} operations", ops.len());

    let chain = chain_with(&[MINER], &[VALIDATOR]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("tempdir");
    let mut run = run_config("fuzz");
    // Leases and the miner's membership outlast the run of this test, so uploads with the real
    // task, lease and digest get as far as the tensor checks.
    run.lease_s = 600;
    run.heartbeat_timeout_s = 600;
    run.training_s = 600;
    let mut cfg = config(&chain, &db, store.path(), run.clone());
    // On the S3-protocol server scripts/test.sh starts, the presign and commit routes are live
    // (a local directory store refuses them up front).
    cfg.store = s3_store();
    let store_kind = match cfg.store {
        StoreConfig::S3 { .. } => "s3",
        StoreConfig::Local(_) => "local directory",
    };
    // Rate limits are tested elsewhere; here they would only turn requests into 429s.
    cfg.limits.per_hotkey_rps = 1_000_000;
    cfg.limits.per_hotkey_burst = 1_000_000;
    cfg.limits.per_ip_rps = 1_000_000;
    cfg.limits.per_ip_burst = 1_000_000;
    let orch = start(cfg).await;
    // A connection per request: the server closes a connection whose request body it did not
    // read (an early 413 or 401), and a pooled client could race that close with its next request
    // and see a dropped connection that is no server fault. Fresh connections make every transport
    // error a real one.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");

    // A miner that has joined and holds leased work, so ids and leases in the requests can be
    // real and handlers get past "not found".
    let register = register_body();
    signed_ok(
        &http,
        &orch.base,
        &pair(MINER),
        "/v1/miner/register",
        register,
    )
    .await;
    let work = signed_ok(
        &http,
        &orch.base,
        &pair(MINER),
        "/v1/miner/work",
        serde_json::to_vec(&WorkRequest { max_items: 4 }).expect("json"),
    )
    .await;
    let work: WorkResponse = serde_json::from_slice(&work).expect("work response");
    // Regression (found by this test): a JSON string holding U+0000 reached PostgreSQL, which
    // refused it, and the request failed with a 500.
    let nul = post_signed(
        &http,
        &orch.base,
        &pair(MINER),
        "/v1/miner/register",
        br#"{"capacity":{"device":"cpu\u0000","memory_bytes":1073741824,"tokens_per_s":1.0}}"#
            .to_vec(),
    )
    .await;
    assert_eq!(nul.0, 400, "{nul:?}");
    assert!(nul.1.contains("bad_request"), "{nul:?}");
    // A known path with the wrong method: 405 with the error body and the methods it takes.
    let wrong = http
        .delete(format!("{}/v1/miner/work", orch.base))
        .send()
        .await
        .expect("DELETE /v1/miner/work");
    assert_eq!(wrong.status().as_u16(), 405);
    let allow = wrong
        .headers()
        .get(reqwest::header::ALLOW)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(allow.contains("POST"), "Allow: {allow:?}");
    let body: iota_protocol::ApiError = wrong.json().await.expect("a JSON error body");
    assert_eq!(body.code, iota_protocol::ErrorCode::MethodNotAllowed);
    let known = Known {
        task_ids: work.items.iter().map(|i| i.task_id).collect(),
        leases: work.items.iter().map(|i| i.lease).collect(),
        boundary_shape: [
            u64::from(run.micro_batch),
            u64::from(run.seq_len),
            u64::from(run.boundary_dim),
        ],
    };
    eprintln!(
        "fuzz: seed {seed:#x}, {per_op} requests per operation, {} operations, {} leased tasks, \
         {store_kind} store",
        ops.len(),
        known.task_ids.len()
    );

    let signers: BTreeMap<u8, Arc<dyn RequestSigner>> = [MINER, VALIDATOR, STRANGER]
        .into_iter()
        .map(|s| (s, signer(s)))
        .collect();
    let receiver = pair(ORCHESTRATOR).ss58();
    let mut g = Gen {
        rng: StdRng::seed_from_u64(seed),
        doc: &doc,
        known: &known,
    };
    // One round is one request to every operation, interleaved so state changes made by one (a
    // completed upload, a registration) meet requests to the others. Rounds are signed just
    // before they are sent, so that timestamps stay inside the clock window.
    let started = std::time::Instant::now();
    let mut results: Vec<(Planned, Outcome)> = Vec::with_capacity(ops.len() * per_op);
    for _ in 0..per_op {
        let round: Vec<Planned> = ops
            .iter()
            .enumerate()
            .map(|(i, op)| plan(&mut g, i, op, &orch.base, &receiver, &signers))
            .collect();
        let answered: Vec<(Planned, Outcome)> = futures::stream::iter(round)
            .map(|p| {
                let http = http.clone();
                async move {
                    let o = send(&http, &p).await;
                    (p, o)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        results.extend(answered);
    }
    let elapsed = started.elapsed();

    let mut by_class: BTreeMap<String, u64> = BTreeMap::new();
    let mut by_auth: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let mut by_op: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let mut failures = Vec::new();
    // Correctly signed requests refused at the gate: only a harness that signs something other
    // than what went on the wire would produce these.
    let mut refused_signed = Vec::new();
    let mut by_code: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut by_status: BTreeMap<u16, u64> = BTreeMap::new();
    // Refusals without the API's JSON error body (the router's own 405, for one).
    let mut bare = Vec::new();
    for (p, o) in &results {
        let class = match o {
            Outcome::Status(s, _) => format!("{}xx", s / 100),
            Outcome::Transport(_) => "transport error".to_owned(),
        };
        *by_class.entry(class.clone()).or_default() += 1;
        *by_auth
            .entry(format!("{:?}", p.auth))
            .or_default()
            .entry(class.clone())
            .or_default() += 1;
        let op = &ops[p.op];
        *by_op
            .entry(format!("{} {}", op.method, op.path))
            .or_default()
            .entry(class)
            .or_default() += 1;
        if let Outcome::Status(status, _) = o {
            *by_status.entry(*status).or_default() += 1;
        }
        if let Outcome::Status(status, text) = o {
            match serde_json::from_str::<iota_protocol::ApiError>(text) {
                Ok(e) => *by_code.entry(e.code.as_str()).or_default() += 1,
                Err(_) if *status >= 400 && p.method != reqwest::Method::HEAD => {
                    bare.push((p, *status, text.clone()))
                }
                Err(_) => {}
            }
        }
        if matches!(p.auth, Auth::Miner | Auth::Validator)
            && let Outcome::Status(401, text) = o
        {
            refused_signed.push((p, text.clone()));
        }
        let bad = match o {
            Outcome::Status(s, _) => *s >= 500,
            Outcome::Transport(_) => true,
        };
        if bad {
            failures.push((p, o));
        }
    }
    eprintln!(
        "fuzz: {} requests in {:.1} s; by status class: {by_class:?}",
        results.len(),
        elapsed.as_secs_f64()
    );
    eprintln!("fuzz: by status: {by_status:?}");
    eprintln!("fuzz: error codes: {by_code:?}");
    eprintln!("fuzz: refusals without an error body: {}", bare.len());
    for (p, status, text) in bare.iter().take(5) {
        eprintln!(
            "fuzz:   {status} for {} {}: {:?}",
            p.method,
            short(&p.url),
            short(text)
        );
    }
    eprintln!(
        "fuzz: correctly signed requests refused with 401: {}",
        refused_signed.len()
    );
    for (p, text) in refused_signed.iter().take(5) {
        eprintln!("fuzz:   401 for {} {}: {text}", p.method, short(&p.url));
    }
    for (auth, classes) in &by_auth {
        eprintln!("fuzz:   auth {auth}: {classes:?}");
    }
    for (op, classes) in &by_op {
        eprintln!("fuzz:   {op}: {classes:?}");
    }

    assert!(
        bare.is_empty(),
        "{} refusals came without the JSON error body (first ones above)",
        bare.len()
    );
    // Signed requests must reach the handlers, or the fuzzing of their bodies tests only the
    // gate: none refused as unauthenticated, and some of each signer's answered with success.
    assert!(
        refused_signed.is_empty(),
        "{} correctly signed requests were refused with 401 (first ones above)",
        refused_signed.len()
    );
    for auth in ["Miner", "Validator"] {
        let succeeded = by_auth
            .get(auth)
            .and_then(|classes| classes.get("2xx"))
            .copied()
            .unwrap_or(0);
        assert!(succeeded > 0, "no {auth}-signed request succeeded");
    }

    // The coherent uploads (real task, lease and digest) got past the lease gate to the tensor
    // checks, and the presign route is live on the S3 store (so its bodies were fuzzed, not
    // refused up front).
    assert!(
        by_code.get("invalid_tensor").copied().unwrap_or(0) > 0,
        "no upload reached the tensor checks"
    );
    let presigned = by_op
        .get("POST /v1/miner/tasks/{task_id}/output/presign")
        .and_then(|classes| classes.get("2xx"))
        .copied()
        .unwrap_or(0);
    assert!(presigned > 0, "no output presign succeeded on the S3 store");

    // Still serving.
    let health = http
        .get(format!("{}/healthz", orch.base))
        .send()
        .await
        .expect("healthz after fuzzing");
    assert!(health.status().is_success(), "healthz: {}", health.status());

    for (p, o) in failures.iter().take(20) {
        let answer = match o {
            Outcome::Status(s, body) => format!("{s} {}", short(body)),
            Outcome::Transport(e) => format!("transport error: {e}"),
        };
        eprintln!(
            "FAIL {} {} auth={:?} headers={:?} body={:?} -> {answer}",
            p.method,
            short(&p.url),
            p.auth,
            p.headers
                .iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(v)))
                .collect::<Vec<_>>(),
            String::from_utf8_lossy(&p.body[..p.body.len().min(200)])
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} requests got a 5xx or lost their connection (first ones above)",
        failures.len(),
        results.len()
    );
    orch.stop().await;
}
