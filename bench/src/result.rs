//! The run's outputs: vLLM's summary table (stdout) and a result file with vLLM's
//! `benchmark_serving` field names plus cleave's extras (slo, slo_attainment, start_times,
//! scheduled_offsets, errors_by_kind, seed).

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::metrics::{LatencyStats, RequestRecord, Slo, Summary};
use crate::outcome::Outcome;
use crate::{BenchError, Result};

/// Facts about the run that are not in the records.
#[derive(Debug, Clone, Serialize)]
pub struct RunInfo {
    pub date: String,
    pub backend: String,
    pub model_id: String,
    pub tokenizer_id: String,
    pub num_prompts: usize,
    /// `"inf"` or a number, as vLLM writes it.
    pub request_rate: Value,
    pub burstiness: f64,
    pub max_concurrency: Option<usize>,
    pub ramp_up_strategy: Option<crate::schedule::RampStrategy>,
    pub ramp_up_start_rps: Option<f64>,
    pub ramp_up_end_rps: Option<f64>,
    pub seed: u64,
    pub slo: Slo,
}

/// vLLM's percentile key: `p99`, `p99.9`.
fn p_word(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{}", p as i64)
    } else {
        format!("{p}")
    }
}

fn put_stats(m: &mut Map<String, Value>, name: &str, s: &LatencyStats) {
    m.insert(format!("mean_{name}_ms"), s.mean_ms.into());
    m.insert(format!("median_{name}_ms"), s.median_ms.into());
    m.insert(format!("std_{name}_ms"), s.std_ms.into());
    for (p, v) in &s.percentiles_ms {
        m.insert(format!("p{}_{name}_ms", p_word(*p)), (*v).into());
    }
}

/// The result file's JSON object. Per-request arrays are in dataset order.
pub fn result_json(info: &RunInfo, summary: &Summary, records: &[RequestRecord]) -> Result<Value> {
    let Value::Object(mut m) = serde_json::to_value(info)? else {
        return Err(BenchError::InvalidArg("run info is not a JSON object".into()));
    };
    let s = summary;
    let rate = |v: Option<f64>| v.map_or(Value::Null, Value::from);
    let count_map = |v: &[(String, usize)]| v.iter().map(|(k, n)| (k.clone(), Value::from(*n))).collect::<Map<_, _>>();
    let fields: [(&str, Value); 14] = [
        ("duration", s.duration_s.into()),
        ("completed", s.completed.into()),
        ("failed", s.failed.into()),
        ("total_input_tokens", s.total_input_tokens.into()),
        ("total_output_tokens", s.total_output_tokens.into()),
        ("request_throughput", s.request_throughput.into()),
        ("request_goodput", rate(s.request_goodput)),
        ("output_throughput", s.output_throughput.into()),
        ("total_token_throughput", s.total_token_throughput.into()),
        ("slo_attainment", rate(s.slo_attainment)),
        (
            "errors_by_kind",
            s.errors_by_kind
                .iter()
                .map(|(k, n)| (k.as_str().to_string(), Value::from(*n)))
                .collect::<Map<_, _>>()
                .into(),
        ),
        ("disconnected", s.disconnected.into()),
        ("outcomes_by_kind", count_map(&s.outcomes).into()),
        ("undocumented", s.undocumented.map_or(Value::Null, Value::from)),
    ];
    m.extend(fields.into_iter().map(|(k, v)| (k.to_string(), v)));
    let col = |f: &dyn Fn(&RequestRecord) -> Value| Value::Array(records.iter().map(f).collect());
    m.insert("input_lens".into(), col(&|r| r.prompt_len.into()));
    m.insert("output_lens".into(), col(&|r| if r.success { r.output_tokens.into() } else { 0.into() }));
    m.insert("ttfts".into(), col(&|r| r.ttft_s.unwrap_or(0.0).into()));
    m.insert("tpots".into(), col(&|r| r.tpot_s.unwrap_or(0.0).into()));
    m.insert("e2els".into(), col(&|r| r.e2el_s.unwrap_or(0.0).into()));
    m.insert("itls".into(), col(&|r| r.itls_s.clone().into()));
    m.insert("generated_texts".into(), col(&|r| r.generated_text.clone().into()));
    m.insert("errors".into(), col(&|r| r.error.as_ref().map_or(String::new(), |e| e.1.clone()).into()));
    m.insert("error_kinds".into(), col(&|r| r.error.as_ref().map_or(Value::Null, |e| e.0.as_str().into())));
    m.insert("start_times".into(), col(&|r| r.start_s.into()));
    m.insert("end_times".into(), col(&|r| r.end_s.into()));
    m.insert("outcomes".into(), col(&|r| r.outcome.label().into()));
    m.insert("shapes".into(), col(&|r| r.shape.map_or(Value::Null, |k| k.as_str().into())));
    m.insert("documented".into(), col(&|r| r.documented.map_or(Value::Null, Value::from)));
    m.insert("scheduled_offsets".into(), col(&|r| r.scheduled_s.into()));
    for (name, st) in [("ttft", &s.ttft), ("tpot", &s.tpot), ("itl", &s.itl), ("e2el", &s.e2el)] {
        put_stats(&mut m, name, st);
    }
    Ok(Value::Object(m))
}

/// Writes `json` to `path`, creating its folder.
pub fn save(path: &Path, json: &Value) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
    }
    let text = serde_json::to_string_pretty(json)?;
    std::fs::write(path, text).map_err(|e| BenchError::io(path, e))
}

/// vLLM's summary table.
pub fn table(info: &RunInfo, s: &Summary) -> String {
    let mut t = String::new();
    let mut row = |k: &str, v: String| {
        let _ = writeln!(t, "{k:<40}{v:<10}");
    };
    let head = |title: &str| format!("{title:-^50}");
    row(&format!("{:=^50}", " Serving Benchmark Result "), String::new());
    row("Successful requests:", s.completed.to_string());
    row("Failed requests:", s.failed.to_string());
    for (k, n) in &s.errors_by_kind {
        row(&format!("  {}:", k.as_str()), n.to_string());
    }
    if s.disconnected > 0 {
        row("Disconnected by the client (by design):", s.disconnected.to_string());
    }
    if s.outcomes.iter().any(|(label, _)| label != "ok") {
        row("Outcomes:", String::new());
        for (label, n) in &s.outcomes {
            row(&format!("  {label}:"), n.to_string());
        }
    }
    if let Some(n) = s.undocumented {
        row("Errors the server does not document:", n.to_string());
    }
    if let Some(c) = info.max_concurrency {
        row("Maximum request concurrency:", c.to_string());
    }
    row("Benchmark duration (s):", format!("{:.2}", s.duration_s));
    row("Total input tokens:", s.total_input_tokens.to_string());
    row("Total generated tokens:", s.total_output_tokens.to_string());
    row("Request throughput (req/s):", format!("{:.2}", s.request_throughput));
    if let Some(g) = s.request_goodput {
        row("Request goodput (req/s):", format!("{g:.2}"));
    }
    if let Some(a) = s.slo_attainment {
        row("SLO attainment:", format!("{:.1}%", a * 100.0));
    }
    row("Output token throughput (tok/s):", format!("{:.2}", s.output_throughput));
    row("Total Token throughput (tok/s):", format!("{:.2}", s.total_token_throughput));
    for (name, title, st) in [
        ("TTFT", "Time to First Token", &s.ttft),
        ("TPOT", "Time per Output Token (excl. 1st token)", &s.tpot),
        ("ITL", "Inter-token Latency", &s.itl),
        ("E2EL", "End-to-end Latency", &s.e2el),
    ] {
        row(&head(title), String::new());
        row(&format!("Mean {name} (ms):"), format!("{:.2}", st.mean_ms));
        row(&format!("Median {name} (ms):"), format!("{:.2}", st.median_ms));
        row(&format!("Std {name} (ms):"), format!("{:.2}", st.std_ms));
        for (p, v) in &st.percentiles_ms {
            row(&format!("P{} {name} (ms):", p_word(*p)), format!("{v:.2}"));
        }
    }
    let _ = writeln!(t, "{}", "=".repeat(50));
    t
}

/// The per-request records back from a result file written by [`result_json`] (for re-analysing a
/// run under other SLOs). A request with an error kind is a failure; missing arrays are an error.
pub fn records_from_json(v: &Value) -> Result<Vec<RequestRecord>> {
    let bad = |what: &str| BenchError::InvalidArg(format!("result file: {what}"));
    let arr = |k: &str| v[k].as_array().ok_or_else(|| bad(&format!("no array {k:?}")));
    let f = |k: &str, i: usize| -> Result<f64> { arr(k)?.get(i).and_then(Value::as_f64).ok_or_else(|| bad(k)) };
    let n = arr("ttfts")?.len();
    let kinds = arr("error_kinds")?;
    let errors = arr("errors")?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let kind = match kinds.get(i).and_then(Value::as_str) {
            None => None,
            Some(s) => Some(
                crate::metrics::ErrorKind::ALL
                    .into_iter()
                    .find(|k| k.as_str() == s)
                    .ok_or_else(|| bad(&format!("unknown error kind {s:?}")))?,
            ),
        };
        // Files written before outcomes were recorded: a success, or an error of unknown detail.
        let outcome = match v["outcomes"].get(i).and_then(Value::as_str) {
            Some(label) => Outcome::from_label(label).ok_or_else(|| bad(&format!("unknown outcome {label:?}")))?,
            None if kind.is_none() => Outcome::Ok,
            None => Outcome::Truncated,
        };
        let success = outcome == Outcome::Ok;
        let output_tokens = f("output_lens", i)? as usize;
        let (ttft, e2el) = (f("ttfts", i)?, f("e2els", i)?);
        out.push(RequestRecord {
            index: i,
            success,
            error: kind.map(|k| (k, errors.get(i).and_then(Value::as_str).unwrap_or_default().to_string())),
            prompt_len: f("input_lens", i)? as usize,
            output_tokens,
            scheduled_s: f("scheduled_offsets", i)?,
            start_s: f("start_times", i)?,
            ttft_s: success.then_some(ttft),
            tpot_s: if success { crate::metrics::tpot(ttft, e2el, output_tokens) } else { None },
            e2el_s: success.then_some(e2el),
            itls_s: arr("itls")?
                .get(i)
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_f64).collect())
                .unwrap_or_default(),
            generated_text: String::new(),
            outcome,
            shape: v["shapes"].get(i).and_then(Value::as_str).and_then(|k| k.parse().ok()),
            end_s: v["end_times"].get(i).and_then(Value::as_f64).unwrap_or_default(),
            documented: v["documented"].get(i).and_then(Value::as_bool),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{summarize, ErrorKind};

    #[test]
    fn result_json_has_vllm_names() {
        let recs = vec![
            RequestRecord {
                success: true,
                prompt_len: 4,
                output_tokens: 3,
                ttft_s: Some(0.1),
                e2el_s: Some(0.3),
                tpot_s: Some(0.1),
                itls_s: vec![0.1, 0.1],
                ..Default::default()
            },
            RequestRecord {
                error: Some((ErrorKind::Timeout, "slow".into())),
                outcome: Outcome::Timeout,
                prompt_len: 5,
                documented: Some(false),
                ..Default::default()
            },
        ];
        let slo = Slo { ttft_ms: Some(200.0), ..Default::default() };
        let s = summarize(&recs, 1.0, &slo, &[99.0, 99.9]);
        let info = RunInfo {
            date: "20260101-000000".into(),
            backend: "openai".into(),
            model_id: "m".into(),
            tokenizer_id: "t".into(),
            num_prompts: 2,
            request_rate: "inf".into(),
            burstiness: 1.0,
            max_concurrency: None,
            ramp_up_strategy: None,
            ramp_up_start_rps: None,
            ramp_up_end_rps: None,
            seed: 0,
            slo,
        };
        let j = result_json(&info, &s, &recs).unwrap();
        for k in [
            "p99_ttft_ms",
            "p99.9_itl_ms",
            "mean_tpot_ms",
            "median_e2el_ms",
            "std_ttft_ms",
            "request_goodput",
            "itls",
            "ttfts",
            "generated_texts",
        ] {
            assert!(j.get(k).is_some(), "{k} missing");
        }
        assert_eq!(j["completed"], 1);
        assert_eq!(j["errors_by_kind"]["timeout"], 1);
        assert_eq!(j["request_goodput"], 1.0);
        assert_eq!(j["errors"][1], "slow");
        assert_eq!((j["outcomes"][1].as_str(), j["outcomes_by_kind"]["timeout"].as_u64()), (Some("timeout"), Some(1)));
        assert_eq!((j["documented"][1].as_bool(), j["undocumented"].as_u64()), (Some(false), Some(1)));
        let t = table(&info, &s);
        assert!(
            t.contains("Serving Benchmark Result")
                && t.contains("Request goodput (req/s):")
                && t.contains("P99.9 ITL (ms):")
        );

        // The records come back from the file: re-analysis under another SLO sees the same run.
        let back = records_from_json(&j).unwrap();
        assert_eq!(back.len(), 2);
        assert!(back[0].success && !back[1].success);
        assert_eq!(back[1].error, Some((ErrorKind::Timeout, "slow".into())));
        assert_eq!((back[1].outcome.clone(), back[1].documented), (Outcome::Timeout, Some(false)));
        assert_eq!((back[0].ttft_s, back[0].e2el_s, back[0].itls_s.clone()), (Some(0.1), Some(0.3), vec![0.1, 0.1]));
        assert!((back[0].tpot_s.unwrap() - 0.1).abs() < 1e-12);
        let again = summarize(&back, 1.0, &slo, &[99.0, 99.9]);
        assert_eq!(again.request_goodput, s.request_goodput);
        assert_eq!(again.ttft, s.ttft);
        let tighter = summarize(&back, 1.0, &Slo { ttft_ms: Some(50.0), ..Default::default() }, &[99.0]);
        assert_eq!(tighter.request_goodput, Some(0.0));
    }
}
