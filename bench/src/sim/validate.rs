//! Predicted against measured: each point of a `bench sweep` (its real arrivals and lengths)
//! replayed through the simulator with the same topology, both sides judged by the same SLOs.
//!
//! A sweep's configuration names are read as topologies (`1p1d`, `2c`); points whose name is not
//! one are skipped with a note, since their shape is unknown to the simulator.

use std::path::Path;

use serde::Serialize;

use super::cluster::{ClusterConfig, NodeLimits, Topology};
use super::cost::CostModel;
use super::engine::SimRecord;
use super::search::{compare, Comparison, Slo};
use crate::error::{BenchError, Result};
use crate::result::records_from_json;

/// One sweep point, predicted and measured.
#[derive(Debug, Clone, Serialize)]
pub struct PointComparison {
    pub config: String,
    pub request_rate: f64,
    /// Requests that failed in the real run (they count as missing every SLO there).
    pub failed: usize,
    pub comparison: Comparison,
}

/// A real run's records as simulator records: arrival = the planned send offset, lengths as
/// measured. A failed request has infinite latencies (it met no SLO).
fn measured_records(v: &serde_json::Value) -> Result<(Vec<SimRecord>, usize)> {
    let records = records_from_json(v)?;
    let failed = records.iter().filter(|r| !r.success).count();
    let out = records
        .iter()
        .enumerate()
        .map(|(id, r)| SimRecord {
            id,
            arrival_s: r.scheduled_s,
            input_len: r.prompt_len.max(1),
            output_len: r.output_tokens.max(1),
            ttft_s: r.ttft_s.unwrap_or(f64::INFINITY),
            tpot_s: if r.success { r.tpot_s.unwrap_or(0.0) } else { f64::INFINITY },
            e2el_s: r.e2el_s.unwrap_or(f64::INFINITY),
            prefill_node: None,
            decode_node: 0,
            shed: false,
        })
        .collect();
    Ok((out, failed))
}

/// Every point of the sweep in `dir` (its `sweep.json` and result files).
pub fn compare_sweep(dir: &Path, cost: &CostModel, limits: NodeLimits, slo: &Slo) -> Result<Vec<PointComparison>> {
    let path = dir.join("sweep.json");
    let text = std::fs::read_to_string(&path).map_err(|e| BenchError::io(&path, e))?;
    let sweep: serde_json::Value = serde_json::from_str(&text)?;
    let points =
        sweep["points"].as_array().ok_or_else(|| BenchError::InvalidArg(format!("{}: no points", path.display())))?;
    let mut out = Vec::new();
    for p in points {
        let name = p["config"].as_str().unwrap_or_default();
        let Ok(topology) = name.parse::<Topology>() else {
            eprintln!("skipping {name}: not a topology name (XpYd or Kc)");
            continue;
        };
        let file = std::path::PathBuf::from(p["result_file"].as_str().unwrap_or_default());
        let file = if file.exists() { file } else { dir.join(file.file_name().unwrap_or_default()) };
        let text = std::fs::read_to_string(&file).map_err(|e| BenchError::io(&file, e))?;
        let (measured, failed) = measured_records(&serde_json::from_str(&text)?)?;
        let cfg = ClusterConfig::new(topology, limits);
        out.push(PointComparison {
            config: name.to_string(),
            request_rate: p["request_rate"].as_f64().unwrap_or(0.0),
            failed,
            comparison: compare(&cfg, cost, &measured, Some(slo))?,
        });
    }
    Ok(out)
}

/// The predicted-against-measured table.
pub fn table(rows: &[PointComparison]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<8} {:>6} | {:>15} | {:>17} | {:>17} | {:>15} | {:>15}",
        "config", "rate", "attain m / p", "p50 TTFT m / p", "p90 TTFT m / p", "p50 TPOT m / p", "p90 TPOT m / p"
    );
    for r in rows {
        let (m, p) = (&r.comparison.measured, &r.comparison.predicted);
        let _ = writeln!(
            s,
            "{:<8} {:>6} | {:>6.2} / {:>6.2} | {:>7.0} / {:>7.0} | {:>7.0} / {:>7.0} | {:>6.1} / {:>6.1} | {:>6.1} / {:>6.1}",
            r.config,
            format!("{}", r.request_rate),
            m.attainment,
            p.attainment,
            m.ttft.median * 1e3,
            p.ttft.median * 1e3,
            m.ttft.p90 * 1e3,
            p.ttft.p90 * 1e3,
            m.tpot.median * 1e3,
            p.tpot.median * 1e3,
            m.tpot.p90 * 1e3,
            p.tpot.p90 * 1e3,
        );
    }
    let _ = writeln!(s, "(m: measured, p: predicted by replaying the measured arrivals; ms)");
    s
}
