//! A profile scaled to the speed a measured run really had.
//!
//! A profile is measured once; the machine a run is replayed against drifts (a shared VM ran
//! the same static configuration at 57-82% attainment within one hour). Each node reports its
//! cumulative engine step timings (`steps` in `GET /admin/nodes`, saved beside each run by
//! `bench/planner/shift.sh` as `NAME.nodes.json`); from them, two factors:
//!
//! - decode: the nodes' mean decode-only step (seconds, batch, total context per step) over
//!   what the profile predicts for a step of that batch and context;
//! - prefill: the nodes' seconds per prompt token over prefill-only steps, over the profile's
//!   seconds per token for the run's own prompts (the sum of their prefill times over the sum of
//!   their tokens: short prompts cost more per token), in chunks of the step budget when one
//!   is given.
//!
//! Applied to the profile's points before the model is fitted: prefill points by the prefill
//! factor, decode points by the decode factor, mixed points (a chunk and decode rows in one
//! pass) by their geometric mean. A mean step at the mean batch is not the mean of the steps,
//! and a colocated node's prefill-only steps are chunks with a cached prefix: both make the
//! factors approximate; they correct drift (the same code running 10-30% slower), not the shape.

use std::path::Path;

use serde::Serialize;

use cleave_planner::{Profile, StepStats};

use super::cost::{CostModel, HandoffCost};
use super::workload::SimRequest;
use crate::error::{BenchError, Result};

/// What the nodes measured against what the profile predicts.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SpeedScale {
    /// Measured over profiled seconds per prompt token.
    pub prefill: f64,
    /// Measured over profiled seconds of a decode step.
    pub decode: f64,
    /// What the factors rest on.
    pub prefill_tokens: u64,
    pub decode_steps: u64,
}

/// Least evidence for a factor: fewer tokens or steps leave that factor at 1.
const MIN_TOKENS: u64 = 1024;
const MIN_STEPS: u64 = 100;

/// The nodes' step timings summed, from a saved `GET /admin/nodes` answer.
pub fn node_steps(path: &Path) -> Result<StepStats> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let bad = |why: &str| BenchError::InvalidArg(format!("--scale-to-nodes {}: {why}", path.display()));
    let nodes = v["nodes"].as_array().ok_or_else(|| bad("no `nodes` list (a saved GET /admin/nodes?)"))?;
    let mut sum = StepStats::default();
    let mut with_steps = 0;
    for n in nodes {
        let s = &n["steps"];
        if s.is_null() {
            continue;
        }
        let field = |k: &str| s[k].as_u64().ok_or_else(|| bad(&format!("steps.{k} is not a count")));
        sum = sum.plus(&StepStats {
            prefill_tokens: field("prefill_tokens")?,
            prefill_seconds: field("prefill_us")? as f64 / 1e6,
            decode_steps: field("decode_steps")?,
            decode_seqs: field("decode_seqs")?,
            decode_context_tokens: field("decode_context")?,
            decode_seconds: field("decode_us")? as f64 / 1e6,
        });
        with_steps += 1;
    }
    if with_steps == 0 {
        return Err(bad("no node reports `steps` (saved before the nodes reported step timings?)"));
    }
    Ok(sum)
}

/// The factors, from the nodes' timings and the requests the run served.
pub fn measure(
    profile: &Profile,
    handoff: HandoffCost,
    steps: &StepStats,
    requests: &[SimRequest],
    step_budget: Option<usize>,
) -> Result<SpeedScale> {
    let model = CostModel::from_profile(profile, handoff)?;
    // The run's prompts as the profile would prefill them: whole, or in chunks of the budget
    // (each chunk after the first over its cached prefix).
    let (mut tokens, mut seconds) = (0.0, 0.0);
    for r in requests {
        let chunk = step_budget.unwrap_or(usize::MAX).max(1);
        let mut done = 0;
        while done < r.input_len {
            let n = chunk.min(r.input_len - done);
            seconds += model.prefill_time(n, done);
            done += n;
        }
        tokens += r.input_len as f64;
    }
    let prefill = if steps.prefill_tokens >= MIN_TOKENS && steps.prefill_seconds > 0.0 && seconds > 0.0 {
        (steps.prefill_seconds / steps.prefill_tokens as f64) / (seconds / tokens)
    } else {
        1.0
    };
    let decode = if steps.decode_steps >= MIN_STEPS && steps.decode_seconds > 0.0 {
        let n = steps.decode_steps as f64;
        let batch = (steps.decode_seqs as f64 / n).round().max(1.0) as usize;
        let context = (steps.decode_context_tokens as f64 / n).round() as usize;
        (steps.decode_seconds / n) / model.decode_step_time(batch, context)
    } else {
        1.0
    };
    for (name, f) in [("prefill", prefill), ("decode", decode)] {
        if !(f.is_finite() && f > 0.0) {
            return Err(BenchError::Profile(format!("speed factor for {name} is {f}")));
        }
    }
    Ok(SpeedScale { prefill, decode, prefill_tokens: steps.prefill_tokens, decode_steps: steps.decode_steps })
}

/// The profile with its step times scaled (see the module docs).
pub fn apply(profile: &Profile, s: &SpeedScale) -> Profile {
    let mut p = profile.clone();
    let mixed = (s.prefill * s.decode).sqrt();
    p.prefill.iter_mut().for_each(|x| x.seconds *= s.prefill);
    p.decode.iter_mut().for_each(|x| x.seconds *= s.decode);
    p.mixed.iter_mut().for_each(|x| x.seconds *= mixed);
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_planner::{DecodePoint, MixedPoint, PrefillPoint};

    fn profile() -> Profile {
        let mut decode = Vec::new();
        for batch in [1, 2, 4] {
            for context in [64, 512] {
                decode.push(DecodePoint { batch, context, seconds: 0.05 + 0.01 * batch as f64 });
            }
        }
        Profile {
            version: cleave_planner::PROFILE_VERSION,
            model: "m".into(),
            date: String::new(),
            threads: 1,
            block_size: 16,
            max_num_batched_tokens: 2048,
            max_num_seqs: 16,
            kv_bytes_per_token: 1000,
            kv_capacity_tokens: 10_000,
            prefill: [16, 64, 256, 1024]
                .iter()
                .map(|&t| PrefillPoint { tokens: t, cached_prefix: 0, seconds: 0.01 + 0.002 * t as f64 })
                .collect(),
            decode,
            mixed: vec![MixedPoint { prefill_tokens: 256, decode_batch: 4, context: 128, seconds: 0.6 }],
        }
    }

    #[test]
    fn a_run_half_again_slower_scales_the_profile_by_half_again() {
        let p = profile();
        let handoff = HandoffCost { bandwidth_bytes_per_s: 1e9, latency_s: 0.0 };
        let model = CostModel::from_profile(&p, handoff).unwrap();
        let requests: Vec<SimRequest> =
            (0..10).map(|i| SimRequest { arrival_s: f64::from(i), input_len: 256, output_len: 32 }).collect();
        // Nodes that ran 1.5x the profile's prefill and 1.2x its decode steps.
        let steps = StepStats {
            prefill_tokens: 2560,
            prefill_seconds: 1.5 * 10.0 * model.prefill_time(256, 0),
            decode_steps: 200,
            decode_seqs: 400,
            decode_context_tokens: 200 * 2 * 300,
            decode_seconds: 1.2 * 200.0 * model.decode_step_time(2, 600),
        };
        let s = measure(&p, handoff, &steps, &requests, None).unwrap();
        assert!((s.prefill - 1.5).abs() < 1e-9 && (s.decode - 1.2).abs() < 1e-9, "{s:?}");
        let scaled = CostModel::from_profile(&apply(&p, &s), handoff).unwrap();
        assert!((scaled.prefill_time(256, 0) / model.prefill_time(256, 0) - 1.5).abs() < 1e-6);
        assert!((scaled.decode_step_time(2, 600) / model.decode_step_time(2, 600) - 1.2).abs() < 1e-6);
        // Too little evidence leaves a factor alone.
        let few = StepStats { decode_steps: 10, ..steps };
        assert_eq!(measure(&p, handoff, &few, &requests, None).unwrap().decode, 1.0);
    }

    #[test]
    fn a_saved_nodes_answer_is_summed_and_a_bad_one_named() {
        let dir = std::env::temp_dir().join(format!("cleave-speed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("nodes.json");
        let step = |t: u64| {
            serde_json::json!({"prefill_tokens": t, "prefill_us": 1000 * t, "decode_steps": 10, "decode_seqs": 20,
                               "decode_context": 500, "decode_us": 600_000})
        };
        let v = serde_json::json!({"nodes": [{"id": 1, "steps": step(100)}, {"id": 2, "steps": step(300)}]});
        std::fs::write(&good, v.to_string()).unwrap();
        let s = node_steps(&good).unwrap();
        assert_eq!((s.prefill_tokens, s.decode_steps, s.decode_seqs), (400, 20, 40));
        assert!((s.prefill_seconds - 0.4).abs() < 1e-9 && (s.decode_seconds - 1.2).abs() < 1e-9);
        let old = dir.join("old.json");
        std::fs::write(&old, r#"{"nodes": [{"id": 1}]}"#).unwrap();
        assert!(node_steps(&old).unwrap_err().to_string().contains("no node reports `steps`"));
        let junk = dir.join("junk.json");
        std::fs::write(&junk, r#"{"nodes": [{"steps": {"prefill_tokens": -1}}]}"#).unwrap();
        assert!(node_steps(&junk).unwrap_err().to_string().contains("steps.prefill_tokens"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
