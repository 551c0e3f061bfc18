//! `cleave bench timeline`: several phased runs (`bench serve --phases`, one per cluster
//! configuration, on the same requests) judged under one SLO: attainment over time (table and
//! plot), per phase, recovery after each phase boundary, and goodput.
//!
//! Goodput here is what a changing load allows: requests that met every SLO per second of the
//! run (the runs send the same requests on the same schedule, so this ranks them exactly as
//! their attainment does). DistServe's goodput, the highest rate held at 90% attainment, needs
//! one load shape at many rates; a shifting load has no single rate to search.
//!
//! Pure functions of the result files' records (the caller reads the files), so a run can be
//! re-judged under any SLO without running it again.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::metrics::{RequestRecord, Slo};
use crate::plot::{lines, Series};
use crate::timeline::{timeline, Phase, Timeline};
use crate::{BenchError, Result};

/// One configuration's run.
#[derive(Debug, Clone)]
pub struct Run {
    pub name: String,
    pub records: Vec<RequestRecord>,
}

/// A run judged under the SLO.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Judged {
    pub name: String,
    pub requests: usize,
    pub met: usize,
    pub attainment: f64,
    /// Requests that met every SLO, per second of the phases' span.
    pub goodput: f64,
    /// Attainment of the requests sent in each phase (None: none sent).
    pub phases: Vec<Option<f64>>,
    /// p90 TTFT and TPOT (ms) of the successful requests sent in each phase.
    pub phase_p90_ms: Vec<(Option<f64>, Option<f64>)>,
    pub timeline: Timeline,
}

/// Judges each run under `slo` over `phases`, with attainment windows of `window_s`.
pub fn judge(runs: &[Run], slo: &Slo, phases: &[Phase], window_s: f64, target_share: f64) -> Result<Vec<Judged>> {
    if phases.is_empty() {
        return Err(BenchError::InvalidArg("no phases to judge the runs by".into()));
    }
    if !(window_s.is_finite() && window_s > 0.0) {
        return Err(BenchError::InvalidArg(format!("window {window_s} s must be a positive number of seconds")));
    }
    let span: f64 = phases.iter().map(|p| p.duration_s).sum();
    Ok(runs
        .iter()
        .map(|run| {
            let met = run.records.iter().filter(|r| slo.met_by(r)).count();
            let mut phase_att = Vec::with_capacity(phases.len());
            let mut phase_p90 = Vec::with_capacity(phases.len());
            let mut from = 0.0;
            for p in phases {
                let to = from + p.duration_s;
                let sent: Vec<&RequestRecord> =
                    run.records.iter().filter(|r| r.scheduled_s >= from && r.scheduled_s < to).collect();
                let ok = sent.iter().filter(|r| slo.met_by(r)).count();
                phase_att.push((!sent.is_empty()).then(|| ok as f64 / sent.len() as f64));
                let p90 = |f: fn(&RequestRecord) -> Option<f64>| {
                    let mut v: Vec<f64> = sent.iter().filter(|r| r.success).filter_map(|r| f(r)).collect();
                    v.sort_by(f64::total_cmp);
                    (!v.is_empty()).then(|| crate::metrics::percentile_sorted(&v, 90.0) * 1e3)
                };
                phase_p90.push((p90(|r| r.ttft_s), p90(|r| r.tpot_s)));
                from = to;
            }
            Judged {
                name: run.name.clone(),
                requests: run.records.len(),
                met,
                attainment: if run.records.is_empty() { 0.0 } else { met as f64 / run.records.len() as f64 },
                goodput: met as f64 / span,
                phases: phase_att,
                phase_p90_ms: phase_p90,
                timeline: timeline(&run.records, slo, phases, window_s, target_share),
            }
        })
        .collect())
}

/// The comparison as text: one row per run (attainment, goodput, each phase, recovery after
/// each boundary), then attainment per window side by side.
pub fn table(judged: &[Judged], phases: &[Phase]) -> String {
    let mut s = String::new();
    let phase_cols: String = (0..phases.len()).map(|i| format!("{:>8}", format!("ph{}", i + 1))).collect();
    let rec_cols: String = (1..phases.len()).map(|i| format!("{:>8}", format!("rec{}", i + 1))).collect();
    s.push_str(&format!("{:<12} {:>7} {:>9}{phase_cols}{rec_cols}\n", "config", "attain", "goodput"));
    for j in judged {
        let ph: String = j.phases.iter().map(|a| format!("{:>8}", a.map_or("-".into(), pct))).collect();
        let rec: String = j
            .timeline
            .recoveries
            .iter()
            .map(|r| format!("{:>8}", r.recovered_after_s.map_or("never".into(), |x| format!("{x:.0}s"))))
            .collect();
        s.push_str(&format!("{:<12} {:>7} {:>9.3}{ph}{rec}\n", j.name, pct(j.attainment), j.goodput));
    }
    s.push_str(&format!(
        "(attainment: share of requests meeting every SLO; goodput: those per second; phN: requests sent in phase N; \
         recN: seconds from phase N's start to the end of the first {:.0}-s window back at {:.0}%)\n",
        judged.first().map_or(0.0, |j| j.timeline.window_s),
        judged.first().map_or(0.0, |j| j.timeline.target_share * 100.0)
    ));
    s.push_str(&format!("{:<12}", "p90 ms"));
    for i in 0..phases.len() {
        s.push_str(&format!("{:>16}", format!("ph{} TTFT/TPOT", i + 1)));
    }
    s.push('\n');
    for j in judged {
        s.push_str(&format!("{:<12}", j.name));
        for (t, p) in &j.phase_p90_ms {
            let f = |x: &Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.0}"));
            s.push_str(&format!("{:>16}", format!("{}/{}", f(t), f(p))));
        }
        s.push('\n');
    }
    let rows = judged.iter().map(|j| j.timeline.windows.len()).max().unwrap_or(0);
    s.push_str(&format!("{:>8}", "from_s"));
    for j in judged {
        s.push_str(&format!("{:>12}", j.name));
    }
    s.push('\n');
    for i in 0..rows {
        let start = judged.iter().find_map(|j| j.timeline.windows.get(i)).map_or(0.0, |w| w.start_s);
        s.push_str(&format!("{start:>8.0}"));
        for j in judged {
            let cell = j.timeline.windows.get(i).and_then(|w| w.attainment).map_or("-".into(), pct);
            s.push_str(&format!("{cell:>12}"));
        }
        s.push('\n');
    }
    s
}

fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

/// Plots attainment over time, one line per run, with the target share dashed. Writes
/// `STEM.png` and `STEM.svg`.
pub fn plot(stem: &Path, title: &str, judged: &[Judged]) -> Result<Vec<PathBuf>> {
    let series: Vec<Series> = judged
        .iter()
        .map(|j| Series {
            label: j.name.clone(),
            points: j
                .timeline
                .windows
                .iter()
                .filter_map(|w| w.attainment.map(|a| (w.start_s + j.timeline.window_s / 2.0, a)))
                .collect(),
        })
        .collect();
    let target = judged.first().map_or(0.9, |j| j.timeline.target_share);
    lines(stem, title, "seconds into the run (window midpoints)", "SLO attainment", &series, Some((target, "target")))
}

/// `cleave bench timeline` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct TimelineArgs {
    /// Result files of `bench serve --phases` runs on the same requests, `NAME=PATH` or `PATH`
    /// (named by its file stem). The phases are the first file's.
    #[arg(required = true)]
    pub results: Vec<String>,
    /// SLOs to judge by, e.g. `--goodput ttft:3000 tpot:100` (ms).
    #[arg(long, num_args = 1.., required = true)]
    pub goodput: Vec<String>,
    /// Seconds per attainment window.
    #[arg(long, default_value_t = 10.0)]
    pub window: f64,
    /// Share of a window's requests that must meet the SLOs for it to count as recovered.
    #[arg(long, default_value_t = 0.9)]
    pub target: f64,
    /// Plot attainment over time to STEM.png and STEM.svg.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Write the judged runs as JSON here.
    #[arg(long)]
    pub output: Option<PathBuf>,
}

/// Reads the result files, judges them, prints the table, and writes the plot and JSON asked for.
pub fn run(args: &TimelineArgs) -> Result<Vec<Judged>> {
    if !(args.target > 0.0 && args.target <= 1.0) {
        return Err(BenchError::InvalidArg(format!("--target {} must be in (0, 1]", args.target)));
    }
    let slo = Slo::parse(&args.goodput)?;
    let mut runs = Vec::new();
    let mut phases: Option<Vec<Phase>> = None;
    for r in &args.results {
        let (name, path) = match r.split_once('=') {
            Some((n, p)) => (n.to_string(), PathBuf::from(p)),
            None => {
                let p = PathBuf::from(r);
                (p.file_stem().map_or_else(|| r.clone(), |s| s.to_string_lossy().into_owned()), p)
            }
        };
        let text = std::fs::read_to_string(&path).map_err(|e| BenchError::io(&path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)?;
        if phases.is_none() {
            let p: Vec<Phase> = serde_json::from_value(v["phases"].clone()).map_err(|e| {
                BenchError::InvalidArg(format!("{}: no phases (a `bench serve --phases` result?): {e}", path.display()))
            })?;
            phases = Some(p);
        }
        let records = crate::result::records_from_json(&v)
            .map_err(|e| BenchError::InvalidArg(format!("{}: {e}", path.display())))?;
        runs.push(Run { name, records });
    }
    let phases = phases.unwrap_or_default();
    let judged = judge(&runs, &slo, &phases, args.window, args.target)?;
    print!("{}", table(&judged, &phases));
    if let Some(stem) = &args.plot {
        let title = format!("SLO attainment over time ({})", crate::sweep::describe(&slo));
        for f in plot(stem, &title, &judged)? {
            println!("plot written to {}", f.display());
        }
    }
    if let Some(out) = &args.output {
        let json = serde_json::json!({ "slo": slo, "phases": phases, "runs": judged });
        crate::result::save(out, &json)?;
    }
    Ok(judged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(at: f64, ttft_s: f64) -> RequestRecord {
        RequestRecord {
            index: 0,
            success: true,
            error: None,
            prompt_len: 1,
            output_tokens: 2,
            scheduled_s: at,
            start_s: at,
            ttft_s: Some(ttft_s),
            tpot_s: Some(0.05),
            e2el_s: Some(ttft_s + 0.05),
            itls_s: vec![0.05],
            generated_text: String::new(),
            ..Default::default()
        }
    }

    #[test]
    fn judges_phases_recovery_and_goodput() {
        let phases = vec![
            Phase { duration_s: 20.0, rate: 1.0, input_len: 8, output_len: 2 },
            Phase { duration_s: 20.0, rate: 1.0, input_len: 8, output_len: 2 },
        ];
        // Slow for the first 10 s of phase 2, then fine.
        let records: Vec<RequestRecord> =
            (0..40).map(|i| rec(f64::from(i), if (20..30).contains(&i) { 5.0 } else { 0.1 })).collect();
        let slo = Slo { ttft_ms: Some(1000.0), tpot_ms: None, e2el_ms: None };
        let j = judge(&[Run { name: "a".into(), records }], &slo, &phases, 10.0, 0.9).unwrap();
        let a = &j[0];
        assert_eq!((a.requests, a.met), (40, 30));
        assert!((a.goodput - 30.0 / 40.0).abs() < 1e-12);
        assert_eq!(a.phases, vec![Some(1.0), Some(0.5)]);
        assert_eq!(a.timeline.recoveries[0].recovered_after_s, Some(20.0));
        let t = table(&j, &phases);
        assert!(t.contains("75%") && t.contains("20s"), "{t}");
        assert!(judge(&[], &slo, &[], 10.0, 0.9).is_err());
    }
}
