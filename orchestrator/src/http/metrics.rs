//! The process's Prometheus recorder and the per-request HTTP metrics.

use std::sync::OnceLock;
use std::time::Duration;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::app::App;

/// How often the recorder's histogram samples are folded into their summaries.
pub const METRICS_UPKEEP_EVERY: Duration = Duration::from_secs(1);

/// The process-wide Prometheus recorder (installed once; every orchestrator in the process
/// shares it).
///
/// A histogram keeps every sample recorded (one per request) until upkeep folds them into its
/// summary. Without upkeep that happens only when `/metrics` is scraped: memory grows with the
/// request rate for as long as nobody scrapes, and the scrape that finally comes folds them all
/// at once, on the runtime thread serving it (in the load benchmark's half-ceiling rounds, the
/// signed poll's p99 over the 750 ms after the bench's scrape was 57-93 ms in 3 of 6 rounds,
/// against 10-15 ms later in those rounds; with upkeep, 3-12 ms in all of 3).
/// A thread of its own runs upkeep every [`METRICS_UPKEEP_EVERY`], off the runtime's threads.
pub fn metrics_handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be installed (a host program's); ours still renders.
        let _ = metrics::set_global_recorder(recorder);
        let upkept = handle.clone();
        let started = std::thread::Builder::new()
            .name("metrics-upkeep".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(METRICS_UPKEEP_EVERY);
                    upkept.run_upkeep();
                }
            });
        if let Err(e) = started {
            tracing::warn!(error = %e, "no metrics upkeep thread: histograms fold only when scraped");
        }
        handle
    })
}

pub(super) async fn metrics_text(State(app): State<App>) -> Response {
    let (hotkeys, addresses) = app.limiter_keys();
    metrics::gauge!("iota_rate_limit_keys", "scope" => "hotkey").set(hotkeys as f64);
    metrics::gauge!("iota_rate_limit_keys", "scope" => "ip").set(addresses as f64);
    // Rendered on a blocking thread: it folds the samples since the last upkeep and formats every
    // series, which a runtime thread's queued requests should not wait for.
    match tokio::task::spawn_blocking(|| metrics_handle().render()).await {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4",
            )],
            text,
        )
            .into_response(),
        Err(e) => crate::error::AppError::new(
            iota_protocol::ErrorCode::Internal,
            format!("rendering the metrics: {e}"),
        )
        .into_response(),
    }
}

pub(super) async fn track(matched: Option<MatchedPath>, req: Request, next: Next) -> Response {
    let method = method_label(req.method());
    let start = std::time::Instant::now();
    let resp = next.run(req).await;
    let route = matched.as_ref().map_or("unmatched", |m| m.as_str());
    http_metrics().record(route, method, resp.status().as_u16(), start.elapsed());
    resp
}

/// A request method as a metric label: the standard ones by name, any other as `other`, so that
/// made-up methods cannot add series without bound.
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        _ => "other",
    }
}

/// The per-request HTTP metrics, with each series' handle looked up once: naming a series by
/// owned labels allocated several times per request; a lookup here allocates nothing once the
/// series exists.
#[derive(Default)]
struct HttpMetrics(std::sync::RwLock<std::collections::HashMap<String, RouteSeries>>);

/// One route's series: requests by method and status, latency by method.
#[derive(Default)]
struct RouteSeries {
    requests: Vec<(&'static str, u16, metrics::Counter)>,
    seconds: Vec<(&'static str, metrics::Histogram)>,
}

impl RouteSeries {
    fn counter(&self, method: &'static str, status: u16) -> Option<&metrics::Counter> {
        self.requests
            .iter()
            .find(|(m, s, _)| *m == method && *s == status)
            .map(|(_, _, c)| c)
    }

    fn histogram(&self, method: &'static str) -> Option<&metrics::Histogram> {
        self.seconds
            .iter()
            .find(|(m, _)| *m == method)
            .map(|(_, h)| h)
    }

    /// Records one request, or says that a series is missing.
    fn record(&self, method: &'static str, status: u16, elapsed: Duration) -> bool {
        let (Some(counter), Some(histogram)) =
            (self.counter(method, status), self.histogram(method))
        else {
            return false;
        };
        counter.increment(1);
        histogram.record(elapsed.as_secs_f64());
        true
    }
}

impl HttpMetrics {
    /// Counts a request to `route` (a route pattern or `unmatched`: a bounded set).
    fn record(&self, route: &str, method: &'static str, status: u16, elapsed: Duration) {
        let recorded = self
            .0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(route)
            .is_some_and(|series| series.record(method, status, elapsed));
        if recorded {
            return;
        }
        let mut routes = self.0.write().unwrap_or_else(|e| e.into_inner());
        let series = routes.entry(route.to_owned()).or_default();
        if series.counter(method, status).is_none() {
            let counter = metrics::counter!("iota_http_requests_total",
                "route" => route.to_owned(), "method" => method, "status" => status.to_string());
            series.requests.push((method, status, counter));
        }
        if series.histogram(method).is_none() {
            let histogram = metrics::histogram!("iota_http_request_seconds",
                "route" => route.to_owned(), "method" => method);
            series.seconds.push((method, histogram));
        }
        series.record(method, status, elapsed);
    }
}

fn http_metrics() -> &'static HttpMetrics {
    static METRICS: OnceLock<HttpMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        // Handles are bound to the recorder installed when they are made: install ours first.
        metrics_handle();
        HttpMetrics::default()
    })
}
