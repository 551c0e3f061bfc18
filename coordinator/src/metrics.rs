//! Metric names (every one the coordinator records, in one place) and the Prometheus
//! recorder behind `GET /metrics`.
//!
//! The recorder is process-global (the `metrics` facade has one); [`prometheus_handle`]
//! installs it on first use and every server in the process renders the same registry.
//!
//! Invariant: a histogram's samples wait in an unbounded per-histogram buffer until the
//! recorder's upkeep folds them into its buckets. A scrape does that, but nothing says anyone
//! scrapes: [`prometheus_handle`] also starts a thread that runs the upkeep every
//! [`UPKEEP_EVERY`], so memory stays bounded with no Prometheus (every token's inter-token
//! latency is a sample: unscraped, a coordinator grew by about 1.5 MiB a minute at 6 req/s).

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// HTTP requests answered, labelled `endpoint` and `status`.
pub const HTTP_REQUESTS_TOTAL: &str = "cleave_http_requests_total";
/// Requests refused because the admission queue was full.
pub const ADMISSION_REJECTED_TOTAL: &str = "cleave_admission_rejected_total";
/// Requests (choices) that failed after admission, labelled `reason` and `path`.
pub const REQUEST_FAILURES_TOTAL: &str = "cleave_request_failures_total";
/// Prompt tokens admitted.
pub const PROMPT_TOKENS_TOTAL: &str = "cleave_prompt_tokens_total";
/// Tokens generated and received by the edge.
pub const GENERATION_TOKENS_TOTAL: &str = "cleave_generation_tokens_total";
/// Requests being generated now.
pub const REQUESTS_RUNNING: &str = "cleave_requests_running";
/// Dispatches waiting in the admission queue (sampled when a request is admitted).
pub const QUEUE_DEPTH: &str = "cleave_queue_depth_requests";
/// Admission to first token of a choice, labelled `pool` (whose node produced it: `prefill`,
/// `decode`, `colocated`), `path` (`remote`, `local`, `colocated`, `migrated`; see
/// [`crate::dispatch::Route`]) and `local_reason` (why a `local` request prefilled on its decode
/// node: `short_prompt`, `no_prefill_node`, `prefill_saturated`; else `none`). The other latency
/// histograms carry the same labels, `pool` being the decode node's.
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "cleave_time_to_first_token_seconds";
/// Between two consecutive tokens of a choice.
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "cleave_inter_token_latency_seconds";
/// Mean time per output token after the first, per choice.
pub const TIME_PER_OUTPUT_TOKEN_SECONDS: &str = "cleave_time_per_output_token_seconds";
/// Admission to the last event of a choice.
pub const E2E_LATENCY_SECONDS: &str = "cleave_e2e_request_latency_seconds";

/// Histogram buckets for every `*_seconds` metric: 1 ms to 5 min.
const SECONDS_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

/// Buckets of TPOT and inter-token latency: targets are set in tens of milliseconds (50, 70,
/// 100, 150 ms), so the buckets step by 10 ms up to 100 ms and by 25-50 ms to 300 ms.
const TOKEN_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0,
];

/// Buckets of TTFT and end-to-end latency: targets from a few hundred milliseconds to tens of
/// seconds.
const REQUEST_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0,
    300.0,
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// How often the recorder's upkeep runs without a scrape (see the module docs).
pub const UPKEEP_EVERY: Duration = Duration::from_secs(2);

/// The process's Prometheus handle, installing the recorder on first call. `None` when
/// another recorder was installed first (then /metrics is empty rather than wrong).
pub fn prometheus_handle() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            // Full-name matchers take precedence over the suffix one.
            let full = |n: &str| Matcher::Full(n.to_owned());
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), SECONDS_BUCKETS)
                .ok()?
                .set_buckets_for_metric(full(TIME_PER_OUTPUT_TOKEN_SECONDS), TOKEN_BUCKETS)
                .ok()?
                .set_buckets_for_metric(full(INTER_TOKEN_LATENCY_SECONDS), TOKEN_BUCKETS)
                .ok()?
                .set_buckets_for_metric(full(TIME_TO_FIRST_TOKEN_SECONDS), REQUEST_BUCKETS)
                .ok()?
                .set_buckets_for_metric(full(E2E_LATENCY_SECONDS), REQUEST_BUCKETS)
                .ok()?;
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            describe();
            zeroes();
            let upkeep = handle.clone();
            // A thread, not a task: the recorder is the process's, not one runtime's.
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || loop {
                    std::thread::sleep(UPKEEP_EVERY);
                    upkeep.run_upkeep();
                })
                .ok()?;
            Some(handle)
        })
        .clone()
}

/// Counters that may stay at zero for a long time are exported from the start: an absent
/// series cannot be told from a broken exporter, and a rate over it is no data, not 0.
fn zeroes() {
    use crate::cluster::metric;
    metrics::counter!(metric::HELD_FOR_SWITCH_TOTAL).increment(0);
    metrics::counter!(metric::HELD_FOR_DECODE_KV_TOTAL).increment(0);
    metrics::counter!(metric::HELD_FOR_SEAT_TOTAL).increment(0);
    metrics::counter!(metric::SHED_TOTAL).increment(0);
    for r in cleave_planner::Reason::ALL {
        metrics::counter!(metric::PLANNER_DECISIONS_TOTAL, "reason" => r.as_str()).increment(0);
    }
    metrics::counter!(ADMISSION_REJECTED_TOTAL).increment(0);
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(HTTP_REQUESTS_TOTAL, "HTTP requests answered by endpoint and status");
    describe_counter!(ADMISSION_REJECTED_TOTAL, "requests refused with 429 (admission queue full)");
    describe_counter!(REQUEST_FAILURES_TOTAL, "admitted choices that failed, by reason");
    describe_counter!(PROMPT_TOKENS_TOTAL, Unit::Count, "prompt tokens admitted");
    describe_counter!(GENERATION_TOKENS_TOTAL, Unit::Count, "tokens generated");
    describe_gauge!(REQUESTS_RUNNING, "requests being generated");
    describe_gauge!(QUEUE_DEPTH, "dispatches waiting for the router");
    describe_histogram!(TIME_TO_FIRST_TOKEN_SECONDS, Unit::Seconds, "time to first token");
    describe_histogram!(INTER_TOKEN_LATENCY_SECONDS, Unit::Seconds, "inter-token latency");
    describe_histogram!(TIME_PER_OUTPUT_TOKEN_SECONDS, Unit::Seconds, "time per output token after the first");
    describe_histogram!(E2E_LATENCY_SECONDS, Unit::Seconds, "end-to-end request latency");
}
