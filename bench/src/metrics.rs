//! Per-request records and the run's summary: TTFT, TPOT, ITL, E2EL statistics, throughput and
//! goodput under SLOs. Pure functions of the records; no clock, no IO.
//!
//! Definitions (as in vLLM's `benchmark_serving` and DistServe):
//! - TTFT: request sent → first chunk carrying text. E2EL: request sent → stream end.
//! - TPOT = (E2EL − TTFT) / (output_tokens − 1), defined only when output_tokens > 1.
//! - ITL: the gaps between consecutive text-carrying chunks (all requests' gaps pooled).
//! - Goodput: completed requests that meet *every* given SLO, per second of benchmark duration.
//! - SLO attainment: those requests over all requests sent (failed ones count as misses).
//!
//! Statistics over an empty set are 0 (vLLM's convention), so a summary always prints.

use serde::Serialize;

use crate::mix::Shape;
use crate::outcome::Outcome;
use crate::{BenchError, Result};

/// Why a request failed. Errors never abort a run; they are counted by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The server answered 4xx.
    Http4xx,
    /// The server answered 5xx (or another non-2xx status).
    Http5xx,
    /// `--request-timeout` passed before the stream ended.
    Timeout,
    /// Connecting or sending failed, or the connection broke mid-stream.
    Connection,
    /// The stream carried an `error` event.
    StreamError,
    /// The stream ended without `data: [DONE]` or a finish reason.
    Truncated,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 6] = [
        ErrorKind::Http4xx,
        ErrorKind::Http5xx,
        ErrorKind::Timeout,
        ErrorKind::Connection,
        ErrorKind::StreamError,
        ErrorKind::Truncated,
    ];

    /// The coarse kind of an error outcome (`None` for a complete answer or a disconnect by
    /// design).
    pub fn of(outcome: &Outcome) -> Option<ErrorKind> {
        Some(match outcome {
            Outcome::Ok | Outcome::Disconnected => return None,
            Outcome::Http { status, .. } if (400..500).contains(status) => ErrorKind::Http4xx,
            Outcome::Http { .. } => ErrorKind::Http5xx,
            Outcome::StreamError { .. } => ErrorKind::StreamError,
            Outcome::Timeout => ErrorKind::Timeout,
            Outcome::Transport => ErrorKind::Connection,
            Outcome::Truncated => ErrorKind::Truncated,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Http4xx => "http_4xx",
            ErrorKind::Http5xx => "http_5xx",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Connection => "connection",
            ErrorKind::StreamError => "stream_error",
            ErrorKind::Truncated => "truncated",
        }
    }
}

/// One request's outcome. Times are seconds; `start_s` is measured from the benchmark's start.
///
/// Invariant: `success` implies `error.is_none()`, `ttft_s` and `e2el_s` are `Some` (when any
/// text arrived) and `ttft_s <= e2el_s`; `tpot_s` is `Some` iff `success && output_tokens > 1`.
/// `success` iff `outcome` is [`Outcome::Ok`]; `error` is `Some` iff `outcome.is_error()` (a
/// disconnect by design is neither a success nor an error).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Index of the request in the dataset.
    pub index: usize,
    pub success: bool,
    pub error: Option<(ErrorKind, String)>,
    /// Prompt tokens as measured offline with the model's tokenizer.
    pub prompt_len: usize,
    /// Output tokens: the server's usage count when it sent one, else the text-carrying chunks.
    pub output_tokens: usize,
    /// The offset the schedule planned for this request.
    pub scheduled_s: f64,
    /// When the request was actually sent (after waiting for a concurrency slot).
    pub start_s: f64,
    pub ttft_s: Option<f64>,
    pub tpot_s: Option<f64>,
    pub e2el_s: Option<f64>,
    pub itls_s: Vec<f64>,
    pub generated_text: String,
    /// How the request ended, in detail.
    pub outcome: Outcome,
    /// The shape of a `--mix` load (`None` without one).
    pub shape: Option<Shape>,
    /// When the request ended (answer complete, failed or dropped), from the benchmark's start.
    pub end_s: f64,
    /// Whether the server's OpenAPI document allows the outcome (`None`: not checked).
    pub documented: Option<bool>,
}

/// TPOT from the request's own timings (see the module docs).
pub fn tpot(ttft_s: f64, e2el_s: f64, output_tokens: usize) -> Option<f64> {
    (output_tokens > 1).then(|| (e2el_s - ttft_s) / (output_tokens - 1) as f64)
}

/// Service-level objectives in milliseconds; any subset may be given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2el_ms: Option<f64>,
}

impl Slo {
    /// Parses `--goodput` tokens such as `ttft:500 tpot:50` (also `ttft=500`). Unknown metrics,
    /// duplicates, and negative or non-numeric values are errors.
    pub fn parse(tokens: &[String]) -> Result<Slo> {
        let mut slo = Slo::default();
        for tok in tokens.iter().flat_map(|t| t.split([',', ' '])).filter(|t| !t.is_empty()) {
            let bad = || {
                BenchError::InvalidArg(format!(
                    "--goodput {tok:?}: expected METRIC:MS with METRIC one of ttft, tpot, e2el"
                ))
            };
            let (name, value) = tok.split_once([':', '=']).ok_or_else(bad)?;
            let ms: f64 = value.trim().parse().map_err(|_| bad())?;
            if !ms.is_finite() || ms < 0.0 {
                return Err(bad());
            }
            let slot = match name.trim().to_ascii_lowercase().as_str() {
                "ttft" => &mut slo.ttft_ms,
                "tpot" => &mut slo.tpot_ms,
                "e2el" => &mut slo.e2el_ms,
                _ => return Err(bad()),
            };
            if slot.replace(ms).is_some() {
                return Err(BenchError::InvalidArg(format!("--goodput gives {name} twice")));
            }
        }
        Ok(slo)
    }

    pub fn is_empty(&self) -> bool {
        self.ttft_ms.is_none() && self.tpot_ms.is_none() && self.e2el_ms.is_none()
    }

    /// Whether a request meets every given SLO. A failed request never does; a request without
    /// a TPOT (one output token) meets a TPOT SLO vacuously, as in vLLM (its TPOT counts as 0).
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        let within = |slo: Option<f64>, v: Option<f64>| match slo {
            None => true,
            Some(limit_ms) => v.unwrap_or(0.0) * 1e3 <= limit_ms,
        };
        r.success && within(self.ttft_ms, r.ttft_s) && within(self.tpot_ms, r.tpot_s) && within(self.e2el_ms, r.e2el_s)
    }
}

/// Mean, median, standard deviation and chosen percentiles of one latency, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LatencyStats {
    pub mean_ms: f64,
    pub median_ms: f64,
    /// Population standard deviation (numpy's default).
    pub std_ms: f64,
    /// `(percentile, value_ms)` in the order requested.
    pub percentiles_ms: Vec<(f64, f64)>,
}

impl LatencyStats {
    /// Statistics of `values_s` (seconds), reported in ms. Empty input gives all zeros.
    pub fn of(values_s: &[f64], percentiles: &[f64]) -> LatencyStats {
        let mut ms: Vec<f64> = values_s.iter().map(|v| v * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        if ms.is_empty() {
            return LatencyStats {
                percentiles_ms: percentiles.iter().map(|&p| (p, 0.0)).collect(),
                ..Default::default()
            };
        }
        let n = ms.len() as f64;
        let mean = ms.iter().sum::<f64>() / n;
        let var = ms.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        LatencyStats {
            mean_ms: mean,
            median_ms: percentile_sorted(&ms, 50.0),
            std_ms: var.sqrt(),
            percentiles_ms: percentiles.iter().map(|&p| (p, percentile_sorted(&ms, p))).collect(),
        }
    }
}

/// numpy's default ("linear") percentile of sorted, non-empty data; `p` in [0, 100].
pub fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// The run's summary. Token counts are over completed requests only.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    pub completed: usize,
    /// Requests that ended in an error (a disconnect by design is not one).
    pub failed: usize,
    /// Streams the client dropped on purpose (`--mix disconnect`).
    pub disconnected: usize,
    /// `(kind, count)` sorted by kind; only kinds that occurred.
    pub errors_by_kind: Vec<(ErrorKind, usize)>,
    /// `(outcome label, count)` sorted by label, every outcome that occurred (`ok` included).
    pub outcomes: Vec<(String, usize)>,
    /// Errors the server's OpenAPI document does not list (`None`: not checked).
    pub undocumented: Option<usize>,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub input_throughput: f64,
    pub total_token_throughput: f64,
    /// Requests meeting every SLO per second; `None` when no SLO was given.
    pub request_goodput: Option<f64>,
    /// Requests meeting every SLO over all requests; `None` when no SLO was given.
    pub slo_attainment: Option<f64>,
    pub ttft: LatencyStats,
    pub tpot: LatencyStats,
    pub itl: LatencyStats,
    pub e2el: LatencyStats,
}

/// Summarizes a run (see the module docs for the definitions). `duration_s` is the benchmark's
/// wall time; a non-positive duration gives zero rates rather than infinities.
pub fn summarize(records: &[RequestRecord], duration_s: f64, slo: &Slo, percentiles: &[f64]) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let per_s = |x: f64| if duration_s > 0.0 { x / duration_s } else { 0.0 };
    let mut errors_by_kind: Vec<(ErrorKind, usize)> = Vec::new();
    let mut kinds: Vec<ErrorKind> = records.iter().filter_map(|r| r.error.as_ref().map(|e| e.0)).collect();
    kinds.sort();
    for k in kinds {
        match errors_by_kind.last_mut() {
            Some((last, n)) if *last == k => *n += 1,
            _ => errors_by_kind.push((k, 1)),
        }
    }
    let total_input_tokens: usize = ok.iter().map(|r| r.prompt_len).sum();
    let total_output_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
    let mut outcomes: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for r in records {
        *outcomes.entry(r.outcome.label()).or_default() += 1;
    }
    let checked = records.iter().any(|r| r.documented.is_some());
    let undocumented = checked.then(|| records.iter().filter(|r| r.documented == Some(false)).count());
    let collect = |f: fn(&RequestRecord) -> Option<f64>| ok.iter().filter_map(|r| f(r)).collect::<Vec<f64>>();
    let itls: Vec<f64> = ok.iter().flat_map(|r| r.itls_s.iter().copied()).collect();
    let good = (!slo.is_empty()).then(|| records.iter().filter(|r| slo.met_by(r)).count());
    Summary {
        completed: ok.len(),
        failed: records.iter().filter(|r| r.error.is_some()).count(),
        disconnected: records.iter().filter(|r| r.outcome == Outcome::Disconnected).count(),
        errors_by_kind,
        outcomes: outcomes.into_iter().collect(),
        undocumented,
        duration_s,
        total_input_tokens,
        total_output_tokens,
        request_throughput: per_s(ok.len() as f64),
        output_throughput: per_s(total_output_tokens as f64),
        input_throughput: per_s(total_input_tokens as f64),
        total_token_throughput: per_s((total_input_tokens + total_output_tokens) as f64),
        request_goodput: good.map(|g| per_s(g as f64)),
        slo_attainment: good.map(|g| if records.is_empty() { 0.0 } else { g as f64 / records.len() as f64 }),
        ttft: LatencyStats::of(&collect(|r| r.ttft_s), percentiles),
        tpot: LatencyStats::of(&collect(|r| r.tpot_s), percentiles),
        itl: LatencyStats::of(&itls, percentiles),
        e2el: LatencyStats::of(&collect(|r| r.e2el_s), percentiles),
    }
}

/// Parses `--metric-percentiles 50,90,99` into numbers in [0, 100].
pub fn parse_percentiles(s: &str) -> Result<Vec<f64>> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| match t.parse::<f64>() {
            Ok(p) if (0.0..=100.0).contains(&p) => Ok(p),
            _ => Err(BenchError::InvalidArg(format!("--metric-percentiles: {t:?} is not a number in [0, 100]"))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(success: bool, ttft: f64, e2el: f64, out: usize, itls: Vec<f64>) -> RequestRecord {
        RequestRecord {
            success,
            prompt_len: 10,
            output_tokens: out,
            ttft_s: success.then_some(ttft),
            e2el_s: success.then_some(e2el),
            tpot_s: if success { tpot(ttft, e2el, out) } else { None },
            itls_s: itls,
            error: (!success).then(|| (ErrorKind::Http5xx, "boom".into())),
            outcome: if success {
                Outcome::Ok
            } else {
                Outcome::Http { status: 500, error_type: Some("server_error".into()) }
            },
            ..Default::default()
        }
    }

    #[test]
    fn outcomes_disconnects_and_undocumented_errors_are_counted() {
        let mut records = vec![rec(true, 0.1, 1.0, 10, vec![]), rec(false, 0.0, 0.0, 0, vec![])];
        records.push(RequestRecord { outcome: Outcome::Disconnected, output_tokens: 3, ..Default::default() });
        let s = summarize(&records, 1.0, &Slo::default(), &[99.0]);
        assert_eq!((s.completed, s.failed, s.disconnected), (1, 1, 1));
        assert_eq!(s.outcomes, vec![("disconnected".into(), 1), ("http_500_server_error".into(), 1), ("ok".into(), 1)]);
        assert_eq!(s.undocumented, None, "nothing was checked");
        records[0].documented = Some(true);
        records[1].documented = Some(false);
        assert_eq!(summarize(&records, 1.0, &Slo::default(), &[99.0]).undocumented, Some(1));
        assert_eq!(ErrorKind::of(&records[1].outcome), Some(ErrorKind::Http5xx));
        assert_eq!(ErrorKind::of(&Outcome::Http { status: 429, error_type: None }), Some(ErrorKind::Http4xx));
        assert_eq!(ErrorKind::of(&Outcome::Disconnected), None);
    }

    #[test]
    fn summary_matches_hand_computation() {
        // TPOTs: (1.0-0.1)/9 = 0.1, (2.2-0.2)/4 = 0.5, (0.4-0.3)/1 = 0.1.
        let records = vec![
            rec(true, 0.1, 1.0, 10, vec![0.1, 0.1]),
            rec(true, 0.2, 2.2, 5, vec![0.5]),
            rec(true, 0.3, 0.4, 2, vec![0.1]),
            rec(false, 0.0, 0.0, 0, vec![]),
        ];
        let slo = Slo::parse(&["ttft:250".into(), "tpot:200".into()]).unwrap();
        let s = summarize(&records, 2.0, &slo, &[50.0, 90.0]);
        assert_eq!((s.completed, s.failed), (3, 1));
        assert_eq!(s.errors_by_kind, vec![(ErrorKind::Http5xx, 1)]);
        assert_eq!((s.total_input_tokens, s.total_output_tokens), (30, 17));
        assert!((s.request_throughput - 1.5).abs() < 1e-12);
        assert!((s.output_throughput - 8.5).abs() < 1e-12);
        assert!((s.total_token_throughput - 23.5).abs() < 1e-12);
        // Only the first request meets both (the second's TPOT, the third's TTFT miss).
        assert_eq!(s.request_goodput, Some(0.5));
        assert_eq!(s.slo_attainment, Some(0.25));
        // TTFT ms: 100, 200, 300 → mean 200, median 200, std sqrt(20000/3), p90 = 280.
        assert!((s.ttft.mean_ms - 200.0).abs() < 1e-9);
        assert!((s.ttft.median_ms - 200.0).abs() < 1e-9);
        assert!((s.ttft.std_ms - (20000.0f64 / 3.0).sqrt()).abs() < 1e-9);
        assert!((s.ttft.percentiles_ms[1].1 - 280.0).abs() < 1e-9);
        // TPOT ms: 100, 500, 100 → mean 233.33, median 100.
        assert!((s.tpot.mean_ms - 700.0 / 3.0).abs() < 1e-9);
        assert!((s.tpot.median_ms - 100.0).abs() < 1e-9);
        // ITL pooled: 100, 100, 500, 100 ms.
        assert!((s.itl.mean_ms - 200.0).abs() < 1e-9);
        assert!((s.itl.median_ms - 100.0).abs() < 1e-9);
        assert!((s.e2el.mean_ms - 1200.0).abs() < 1e-9);
    }

    #[test]
    fn goodput_is_none_without_slo_and_empty_stats_are_zero() {
        let s = summarize(&[], 0.0, &Slo::default(), &[99.0]);
        assert_eq!(s.request_goodput, None);
        assert_eq!(s.ttft.percentiles_ms, vec![(99.0, 0.0)]);
        assert_eq!(s.request_throughput, 0.0);
    }

    #[test]
    fn slo_parse_accepts_subsets_and_rejects_junk() {
        let s = Slo::parse(&["e2el:1000".into()]).unwrap();
        assert_eq!(s, Slo { ttft_ms: None, tpot_ms: None, e2el_ms: Some(1000.0) });
        assert!(Slo::parse(&["itl:5".into()]).is_err());
        assert!(Slo::parse(&["ttft:-1".into()]).is_err());
        assert!(Slo::parse(&["ttft:1".into(), "ttft:2".into()]).is_err());
        assert!(Slo::parse(&["ttft".into()]).is_err());
    }

    #[test]
    fn percentile_is_numpy_linear() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile_sorted(&v, 50.0), 2.5);
        assert!((percentile_sorted(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile_sorted(&v, 100.0), 4.0);
        assert_eq!(parse_percentiles("50, 99.9").unwrap(), vec![50.0, 99.9]);
        assert!(parse_percentiles("101").is_err());
    }
}
