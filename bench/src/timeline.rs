//! Phased load and SLO attainment over time, for runs whose load changes while they run (the
//! planner's experiments: a mix that shifts from prefill-heavy to decode-heavy and back, a rate
//! step).
//!
//! - [`Phase`]: `DURATION_S:RATE:INPUT_LEN:OUTPUT_LEN`, run one after another (`--phases`).
//! - [`timeline`]: requests bucketed by when they were sent, each window's SLO attainment,
//!   and, after each phase boundary, how long until a window's attainment is back at the
//!   target share ([`Recovery`]).
//!
//! Pure functions of the records: no clock, no I/O.

use serde::{Deserialize, Serialize};

use crate::metrics::{RequestRecord, Slo};
use crate::{BenchError, Result};

/// One stretch of constant load.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    pub duration_s: f64,
    /// Requests per second (Poisson, or the run's burstiness).
    pub rate: f64,
    pub input_len: usize,
    pub output_len: usize,
}

/// The phases of a run, in order (one flag value).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Phases(pub Vec<Phase>);

/// `--phases`' parser (see [`parse_phases`]).
pub fn phases_arg(s: &str) -> Result<Phases> {
    parse_phases(s).map(Phases)
}

/// Parses `D:R:IN:OUT[,D:R:IN:OUT...]`; every field positive.
pub fn parse_phases(s: &str) -> Result<Vec<Phase>> {
    let bad = |p: &str, why: &str| {
        BenchError::InvalidArg(format!("--phases `{p}`: {why} (want DURATION_S:RATE:INPUT_LEN:OUTPUT_LEN)"))
    };
    let mut out = Vec::new();
    for p in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let f: Vec<&str> = p.split(':').collect();
        if f.len() != 4 {
            return Err(bad(p, "four fields"));
        }
        let num = |x: &str| x.parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0);
        let int = |x: &str| x.parse::<usize>().ok().filter(|v| *v > 0);
        out.push(Phase {
            duration_s: num(f[0]).ok_or_else(|| bad(p, "the duration must be a positive number of seconds"))?,
            rate: num(f[1]).ok_or_else(|| bad(p, "the rate must be a positive number of requests per second"))?,
            input_len: int(f[2]).ok_or_else(|| bad(p, "the input length must be a positive integer"))?,
            output_len: int(f[3]).ok_or_else(|| bad(p, "the output length must be a positive integer"))?,
        });
    }
    if out.is_empty() {
        return Err(BenchError::InvalidArg("--phases names no phase".into()));
    }
    Ok(out)
}

/// One window of the run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Window {
    pub start_s: f64,
    pub requests: usize,
    /// Share of the window's requests that succeeded within every SLO (None: no request).
    pub attainment: Option<f64>,
}

/// After a phase boundary: when attainment was back at the target share.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Recovery {
    pub phase: usize,
    pub boundary_s: f64,
    /// Seconds from the boundary to the end of the first window of the phase at or above the
    /// target share that follows its first window below it (0: no window of the phase fell
    /// below; None: never back within the phase). Windows without requests are skipped.
    pub recovered_after_s: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    pub window_s: f64,
    pub target_share: f64,
    pub windows: Vec<Window>,
    pub recoveries: Vec<Recovery>,
}

/// Attainment per `window_s` of send time, and the recovery after each boundary of `phases`.
pub fn timeline(records: &[RequestRecord], slo: &Slo, phases: &[Phase], window_s: f64, target_share: f64) -> Timeline {
    let end = records.iter().map(|r| r.start_s).fold(0.0, f64::max);
    let n = ((end / window_s).floor() as usize) + 1;
    let mut met = vec![0usize; n];
    let mut all = vec![0usize; n];
    for r in records {
        let w = ((r.start_s / window_s).floor() as usize).min(n - 1);
        all[w] += 1;
        if r.success && slo.met_by(r) {
            met[w] += 1;
        }
    }
    let windows: Vec<Window> = (0..n)
        .map(|i| Window {
            start_s: i as f64 * window_s,
            requests: all[i],
            attainment: (all[i] > 0).then(|| met[i] as f64 / all[i] as f64),
        })
        .collect();
    let mut recoveries = Vec::new();
    let mut at = 0.0;
    for (i, p) in phases.iter().enumerate() {
        let (from, to) = (at, at + p.duration_s);
        at = to;
        if i == 0 {
            continue;
        }
        // The phase's windows with requests: recovered at the end of the first one at the
        // target after the first one below it (a shift whose first windows were still served
        // well, then fell, has not recovered until it is back).
        let inside: Vec<&Window> =
            windows.iter().filter(|w| w.start_s >= from - 1e-9 && w.start_s < to && w.attainment.is_some()).collect();
        let ok = |w: &Window| w.attainment.is_some_and(|a| a >= target_share);
        let recovered_after_s = match inside.iter().position(|w| !ok(w)) {
            None => Some(0.0),
            Some(drop) => inside[drop..].iter().find(|w| ok(w)).map(|w| (w.start_s + window_s - from).max(0.0)),
        };
        recoveries.push(Recovery { phase: i, boundary_s: from, recovered_after_s });
    }
    Timeline { window_s, target_share, windows, recoveries }
}

/// The timeline as a table (one row per window, then the recoveries).
pub fn table(t: &Timeline) -> String {
    let mut s =
        format!("{:=^50}\n{:>10} {:>10} {:>12}\n", " SLO attainment over time ", "from (s)", "requests", "attainment");
    for w in &t.windows {
        let a = w.attainment.map_or("-".to_string(), |a| format!("{:.0}%", a * 100.0));
        s.push_str(&format!("{:>10.0} {:>10} {:>12}\n", w.start_s, w.requests, a));
    }
    for r in &t.recoveries {
        let after = r.recovered_after_s.map_or("never".to_string(), |x| format!("{x:.0} s"));
        s.push_str(&format!(
            "phase {} at {:.0} s: back to {:.0}% after {after}\n",
            r.phase,
            r.boundary_s,
            t.target_share * 100.0
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(start_s: f64, ttft_s: f64) -> RequestRecord {
        RequestRecord {
            index: 0,
            success: true,
            error: None,
            prompt_len: 1,
            output_tokens: 1,
            scheduled_s: start_s,
            start_s,
            ttft_s: Some(ttft_s),
            tpot_s: None,
            e2el_s: Some(ttft_s),
            itls_s: vec![],
            generated_text: String::new(),
            ..Default::default()
        }
    }

    #[test]
    fn phases_parse_and_refuse_bad_fields() {
        let p = parse_phases("60:0.5:1024:16, 30:2:64:256").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[1], Phase { duration_s: 30.0, rate: 2.0, input_len: 64, output_len: 256 });
        for bad in ["", "60:0.5:1024", "60:0:1024:16", "x:1:1:1", "60:1:0:1", "60:1:1:-3"] {
            assert!(parse_phases(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn windows_and_recovery_after_a_boundary() {
        let slo = Slo { ttft_ms: Some(1000.0), ..Default::default() };
        // Phase 0: 0..20 s, all good. Phase 1 from 20 s: bad for two windows, then good.
        let mut r: Vec<RequestRecord> = (0..20).map(|i| rec(i as f64, 0.1)).collect();
        r.extend((20..40).map(|i| rec(i as f64, 5.0)));
        r.extend((40..60).map(|i| rec(i as f64, 0.2)));
        let phases = [
            Phase { duration_s: 20.0, rate: 1.0, input_len: 1, output_len: 1 },
            Phase { duration_s: 40.0, rate: 1.0, input_len: 1, output_len: 1 },
        ];
        let t = timeline(&r, &slo, &phases, 10.0, 0.9);
        let a: Vec<Option<f64>> = t.windows.iter().map(|w| w.attainment).collect();
        assert_eq!(a, vec![Some(1.0), Some(1.0), Some(0.0), Some(0.0), Some(1.0), Some(1.0)]);
        assert_eq!(t.recoveries.len(), 1);
        assert_eq!(t.recoveries[0].recovered_after_s, Some(30.0), "the window 40..50 s ends 30 s after the boundary");
        // Never recovering says so.
        let t = timeline(&r[..40], &slo, &phases, 10.0, 0.9);
        assert_eq!(t.recoveries[0].recovered_after_s, None);
        assert!(table(&t).contains("never"));
        // A phase whose first window is still served well and then falls has recovered only
        // when it is back: 20..30 good, 30..40 bad, 40..50 good -> 30 s.
        let mut r: Vec<RequestRecord> = (0..30).map(|i| rec(i as f64, 0.1)).collect();
        r.extend((30..40).map(|i| rec(i as f64, 5.0)));
        r.extend((40..60).map(|i| rec(i as f64, 0.2)));
        assert_eq!(timeline(&r, &slo, &phases, 10.0, 0.9).recoveries[0].recovered_after_s, Some(30.0));
        // Never below target: 0.
        let good: Vec<RequestRecord> = (0..60).map(|i| rec(i as f64, 0.1)).collect();
        assert_eq!(timeline(&good, &slo, &phases, 10.0, 0.9).recoveries[0].recovered_after_s, Some(0.0));
    }
}
