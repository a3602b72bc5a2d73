//! The checked-in `orchestrator/openapi.json` is the API's contract: it must equal what the code
//! generates, document every route the router serves, and reference only schemas it defines.
//!
//! To regenerate it after an API change: `IOTA_BLESS=1 cargo test -p iota-orchestrator --test integration openapi`.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;

/// Routes the router serves that are deliberately not part of the JSON API document.
const UNDOCUMENTED: &[(&str, &str, &str)] = &[
    ("get", "/", "the dashboard page (HTML)"),
    ("get", "/dashboard", "the dashboard page (HTML)"),
    ("get", "/openapi.json", "this document itself"),
    ("get", "/metrics", "Prometheus text exposition"),
    (
        "get",
        "/v1/noop",
        "the load benchmark's unsigned ceiling, same handler as /healthz",
    ),
];

fn checked_in_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("openapi.json")
}

fn generated() -> String {
    let mut doc = iota_orchestrator::openapi_json();
    doc.push('\n');
    doc
}

#[test]
fn checked_in_document_is_current() {
    let path = checked_in_path();
    let fresh = generated();
    if std::env::var_os("IOTA_BLESS").is_some_and(|v| v == "1") {
        // Rewriting in CI would pass a stale document.
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "IOTA_BLESS is set in CI"
        );
        std::fs::write(&path, &fresh).expect("write openapi.json");
        eprintln!("rewrote {}", path.display());
        return;
    }
    let stored = std::fs::read_to_string(&path).unwrap_or_default();
    if stored != fresh {
        let first_diff = stored
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| stored.lines().count().min(fresh.lines().count()));
        panic!(
            "{} is stale (first difference at line {}).\nRegenerate it with:\n    \
             IOTA_BLESS=1 cargo test -p iota-orchestrator --test integration openapi\nand commit the result.",
            path.display(),
            first_diff + 1
        );
    }
}

/// `(method, path)` of every `.route("path", method(handler))` in the router's source, with axum's
/// `{*rest}` written as OpenAPI's `{rest}`.
fn router_routes() -> BTreeSet<(String, String)> {
    let src_path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/http/mod.rs");
    let src = std::fs::read_to_string(&src_path).expect("read src/http/mod.rs");
    let body_start = src
        .find("pub fn router(")
        .expect("src/http/mod.rs defines `pub fn router(`");
    let body = &src[body_start..];
    let body = &body[..body.find("\n}\n").expect("end of router()")];
    let mut out = BTreeSet::new();
    for chunk in body.split(".route(").skip(1) {
        let chunk = chunk.trim_start();
        let rest = chunk
            .strip_prefix('"')
            .unwrap_or_else(|| panic!("route without a literal path: {chunk:.60}"));
        let end = rest.find('"').expect("closing quote");
        let path = rest[..end].replace("{*", "{");
        // The method router runs to the `)` closing `.route(`: `get(a)` or `get(a).post(b)`.
        let mut depth = 1usize;
        let args = &rest[end + 1..];
        let close = args
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                depth == 0
            })
            .map(|(i, _)| i)
            .expect("end of .route(");
        let methods = &args[..close];
        let mut found = 0;
        for method in ["get", "post", "put", "delete", "patch"] {
            for (i, _) in methods.match_indices(&format!("{method}(")) {
                let before = methods[..i].chars().next_back();
                if matches!(before, Some(',' | '.' | ' ' | '\n')) {
                    out.insert((method.to_owned(), path.clone()));
                    found += 1;
                }
            }
        }
        assert!(found > 0, "no method router for {path}: {methods:?}");
    }
    assert!(
        out.len() > 20,
        "found only {} routes in router()",
        out.len()
    );
    out
}

fn documented_routes(doc: &Value) -> BTreeSet<(String, String)> {
    let paths = doc["paths"].as_object().expect("paths object");
    let mut out = BTreeSet::new();
    for (path, item) in paths {
        for method in item.as_object().expect("path item").keys() {
            if ["get", "post", "put", "delete", "patch"].contains(&method.as_str()) {
                out.insert((method.clone(), path.clone()));
            }
        }
    }
    out
}

#[test]
fn every_route_is_documented_and_every_documented_route_exists() {
    let doc: Value = serde_json::from_str(&generated()).expect("document is JSON");
    let served = router_routes();
    let documented = documented_routes(&doc);
    let exempt: BTreeSet<(String, String)> = UNDOCUMENTED
        .iter()
        .map(|(m, p, _)| (m.to_string(), p.to_string()))
        .collect();
    let missing: Vec<_> = served
        .iter()
        .filter(|r| !documented.contains(*r) && !exempt.contains(*r))
        .collect();
    assert!(
        missing.is_empty(),
        "routes served but not in the OpenAPI document (add #[utoipa::path] and list them in ApiDoc): {missing:?}"
    );
    let phantom: Vec<_> = documented.difference(&served).collect();
    assert!(
        phantom.is_empty(),
        "routes documented but not served by router(): {phantom:?}"
    );
    let stale_exemptions: Vec<_> = exempt.difference(&served).collect();
    assert!(
        stale_exemptions.is_empty(),
        "UNDOCUMENTED lists routes the router no longer serves: {stale_exemptions:?}"
    );
}

fn collect_refs(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                if k == "$ref"
                    && let Some(r) = v.as_str()
                {
                    out.insert(r.to_owned());
                }
                collect_refs(v, out);
            }
        }
        Value::Array(items) => items.iter().for_each(|i| collect_refs(i, out)),
        _ => {}
    }
}

#[test]
fn referenced_schemas_exist_and_operations_are_complete() {
    let doc: Value = serde_json::from_str(&generated()).expect("document is JSON");
    let schemas = doc["components"]["schemas"]
        .as_object()
        .expect("components.schemas");
    let mut refs = BTreeSet::new();
    collect_refs(&doc, &mut refs);
    assert!(!refs.is_empty(), "the document references no schemas");
    for r in &refs {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("reference outside components.schemas: {r}"));
        assert!(
            schemas.contains_key(name),
            "schema {name} is referenced but not defined"
        );
    }
    let security = doc["components"]["securitySchemes"]
        .as_object()
        .expect("securitySchemes");
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("path item") {
            let responses = op["responses"]
                .as_object()
                .unwrap_or_else(|| panic!("{method} {path} has no responses"));
            assert!(
                responses.keys().any(|s| s.starts_with('2')),
                "{method} {path} documents no success response"
            );
            // Every `{param}` in the path is declared.
            let declared: BTreeSet<&str> = op["parameters"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .filter(|p| p["in"] == "path")
                        .filter_map(|p| p["name"].as_str())
                        .collect()
                })
                .unwrap_or_default();
            let in_template: BTreeSet<&str> = path
                .split('/')
                .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
                .collect();
            for name in &in_template {
                assert!(
                    declared.contains(name),
                    "{method} {path}: path parameter {name} is not declared"
                );
            }
            // And nothing else is declared "in: path" (a query struct needs
            // `#[into_params(parameter_in = Query)]`, or generated clients put it in the path).
            for name in &declared {
                assert!(
                    in_template.contains(name),
                    "{method} {path}: {name} is declared in: path but is not in the path"
                );
            }
            // Signed routes name a security scheme the document defines.
            if let Some(reqs) = op["security"].as_array() {
                for req in reqs {
                    for scheme in req.as_object().expect("requirement").keys() {
                        assert!(
                            security.contains_key(scheme),
                            "{method} {path}: unknown security scheme {scheme}"
                        );
                    }
                }
            }
            let signed = path.starts_with("/v1/miner/")
                || path.starts_with("/v1/validator/")
                || path.starts_with("/v1/blobs/");
            if signed {
                assert!(
                    op["security"].as_array().is_some_and(|r| !r.is_empty()),
                    "{method} {path} is signed but documents no security requirement"
                );
            }
        }
    }
}
