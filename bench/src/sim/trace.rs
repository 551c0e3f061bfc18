//! Workloads whose rate and mix change over time: a piecewise schedule of [`Phase`]s (duration,
//! request rate, prompt and output length ranges), drawn with one seed.
//!
//! Presets ([`Preset`]) give each phase a share of a peak *load* rather than a rate, and
//! [`Preset::build`] turns loads into rates with the cost model, so that one preset fits any
//! profile and node budget: a phase at load `x` asks for `x · nodes` node-seconds of work per
//! second, a request costing [`work_per_request`] node-seconds.
//!
//! - `day`: 48 half-hour phases (scaled to the chosen duration) with a diurnal rate (lowest at
//!   03:00, highest at 15:00, 15% of the peak at night) and a mix that moves from prefill-heavy
//!   (long prompts, short answers) at night to decode-heavy (short prompts, long answers) in
//!   the working day and back in the evening.
//! - `shift`: prefill-heavy, decode-heavy, prefill-heavy, each at 60% of the peak load, then a
//!   rate step to the peak with the prefill-heavy mix; four equal phases (150 s each by
//!   default: a ten-minute live experiment on two nodes).
//!
//! Arrivals within a phase are a gamma renewal process at the phase's rate (Poisson at
//! burstiness 1); a gap that crosses into the next phase is dropped and drawn again there
//! (exact for Poisson, which is memoryless). Lengths are uniform in the phase's ranges.
//!
//! Dependencies: the cost model, for presets only. Invariant: `generate` returns requests in
//! arrival order, every one inside its phase and within its phase's ranges.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Gamma};
use serde::{Deserialize, Serialize};

use super::cost::CostModel;
use super::workload::SimRequest;
use crate::error::{BenchError, Result};

/// One stretch of constant rate and mix.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    pub duration_s: f64,
    /// Requests per second (0: idle).
    pub rate: f64,
    /// Inclusive range of prompt lengths.
    pub input_len: (usize, usize),
    /// Inclusive range of output lengths, the first token included (≥ 1).
    pub output_len: (usize, usize),
}

/// A mix: inclusive ranges of prompt and output lengths.
pub type Mix = ((usize, usize), (usize, usize));

/// Long prompts, short answers.
pub const PREFILL_HEAVY: Mix = ((512, 1024), (8, 32));
/// Short prompts, long answers.
pub const DECODE_HEAVY: Mix = ((32, 128), (128, 256));

/// A schedule of phases, back to back from time 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    pub name: String,
    pub phases: Vec<Phase>,
}

/// The built-in traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    Day,
    Shift,
}

impl Preset {
    /// `day` or `shift`; `None` for anything else (a file name).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "day" => Some(Preset::Day),
            "shift" => Some(Preset::Shift),
            _ => None,
        }
    }

    /// The preset's length when none is given, seconds.
    pub fn default_duration_s(self) -> f64 {
        match self {
            Preset::Day => 86_400.0,
            Preset::Shift => 600.0,
        }
    }

    /// Phases as (duration, load share of the peak, mix): loads in (0, 1].
    fn shape(self, duration_s: f64) -> Vec<(f64, f64, Mix)> {
        match self {
            Preset::Day => {
                let n = 48;
                (0..n)
                    .map(|i| {
                        let hour = (i as f64 + 0.5) * 24.0 / n as f64;
                        let rate = 0.15 + 0.85 * 0.5 * (1.0 + (std::f64::consts::TAU * (hour - 15.0) / 24.0).cos());
                        // Decode-heaviness: 0 at night, 1 from 10:00 to 16:00, linear ramps between.
                        let w = ((hour - 6.0) / 4.0).clamp(0.0, 1.0).min(((20.0 - hour) / 4.0).clamp(0.0, 1.0));
                        (duration_s / n as f64, rate, mix_between(PREFILL_HEAVY, DECODE_HEAVY, w))
                    })
                    .collect()
            }
            Preset::Shift => {
                let d = duration_s / 4.0;
                vec![(d, 0.6, PREFILL_HEAVY), (d, 0.6, DECODE_HEAVY), (d, 0.6, PREFILL_HEAVY), (d, 1.0, PREFILL_HEAVY)]
            }
        }
    }

    /// The trace at `peak_load` (share of `nodes` nodes' capacity at the busiest phase),
    /// `duration_s` long, rates from the cost model.
    pub fn build(self, cost: &CostModel, nodes: usize, peak_load: f64, duration_s: f64) -> Result<Trace> {
        if !(peak_load > 0.0 && peak_load.is_finite() && duration_s > 0.0 && duration_s.is_finite() && nodes > 0) {
            return Err(BenchError::InvalidArg(format!(
                "trace: load {peak_load}, duration {duration_s} s and {nodes} nodes must be positive"
            )));
        }
        let shape = self.shape(duration_s);
        let top = shape.iter().map(|s| s.1).fold(0.0, f64::max);
        let phases = shape
            .into_iter()
            .map(|(d, load, (input_len, output_len))| {
                let mut p = Phase { duration_s: d, rate: 0.0, input_len, output_len };
                p.rate = load / top * peak_load * nodes as f64 / work_per_request(cost, &p);
                p
            })
            .collect();
        let name = match self {
            Preset::Day => "day",
            Preset::Shift => "shift",
        };
        let t = Trace { name: name.into(), phases };
        t.validate()?;
        Ok(t)
    }
}

fn mix_between(a: Mix, b: Mix, w: f64) -> Mix {
    let lerp = |x: usize, y: usize| (x as f64 + w * (y as f64 - x as f64)).round() as usize;
    ((lerp(a.0 .0, b.0 .0), lerp(a.0 .1, b.0 .1)), (lerp(a.1 .0, b.1 .0), lerp(a.1 .1, b.1 .1)))
}

/// Node-seconds one request of the phase's mix costs, roughly: its prompt's prefill alone on a
/// node, and its share of decode steps at the largest batch the node's seats and KV allow
/// (mean lengths). Used to turn loads into rates, nothing else.
pub fn work_per_request(cost: &CostModel, p: &Phase) -> f64 {
    let input = (p.input_len.0 + p.input_len.1) as f64 / 2.0;
    let output = (p.output_len.0 + p.output_len.1) as f64 / 2.0;
    let per_seq = input + output;
    let by_kv = (cost.kv_capacity_tokens as f64 / per_seq).floor().max(1.0);
    let batch = (cost.max_num_seqs as f64).min(by_kv).max(1.0) as usize;
    let ctx = (batch as f64 * (input + output / 2.0)) as usize;
    let step = cost.decode_step_time(batch, ctx);
    cost.prefill_time(input.round() as usize, 0) + (output - 1.0).max(0.0) * step / batch as f64
}

impl Trace {
    /// Reads a JSON list of phases (`[{"duration_s": 60, "rate": 2, "input_len": [512, 1024],
    /// "output_len": [16, 32]}, ...]`).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
        let phases: Vec<Phase> = serde_json::from_str(&text)?;
        let name = path.file_stem().map_or_else(|| "trace".into(), |s| s.to_string_lossy().into_owned());
        let t = Trace { name, phases };
        t.validate()?;
        Ok(t)
    }

    pub fn duration_s(&self) -> f64 {
        self.phases.iter().map(|p| p.duration_s).sum()
    }

    /// Requests the trace expects (rate × duration summed).
    pub fn expected_requests(&self) -> f64 {
        self.phases.iter().map(|p| p.rate * p.duration_s).sum()
    }

    /// The index of the phase that holds time `t` (the last one past the end).
    pub fn phase_at(&self, t: f64) -> usize {
        let mut end = 0.0;
        for (i, p) in self.phases.iter().enumerate() {
            end += p.duration_s;
            if t < end {
                return i;
            }
        }
        self.phases.len().saturating_sub(1)
    }

    pub fn validate(&self) -> Result<()> {
        if self.phases.is_empty() {
            return Err(BenchError::InvalidArg(format!("trace {}: no phases", self.name)));
        }
        for (i, p) in self.phases.iter().enumerate() {
            let (i0, i1) = p.input_len;
            let (o0, o1) = p.output_len;
            let lengths_ok = i0 > 0 && i0 <= i1 && o0 > 0 && o0 <= o1;
            let times_ok = p.duration_s.is_finite() && p.duration_s > 0.0 && p.rate.is_finite() && p.rate >= 0.0;
            if !lengths_ok || !times_ok {
                return Err(BenchError::InvalidArg(format!(
                    "trace {} phase {i}: needs a positive duration, a finite rate ≥ 0 and non-empty positive \
                     length ranges (got {p:?})",
                    self.name
                )));
            }
        }
        Ok(())
    }

    /// The requests, in arrival order.
    pub fn generate(&self, burstiness: f64, seed: u64) -> Result<Vec<SimRequest>> {
        self.validate()?;
        if !(burstiness.is_finite() && burstiness > 0.0) {
            return Err(BenchError::InvalidArg(format!("burstiness {burstiness} must be positive")));
        }
        let gamma = Gamma::new(burstiness, 1.0 / burstiness)
            .map_err(|e| BenchError::InvalidArg(format!("burstiness {burstiness}: {e}")))?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut out = Vec::with_capacity(self.expected_requests().ceil() as usize + 16);
        let mut start = 0.0f64;
        for p in &self.phases {
            let end = start + p.duration_s;
            if p.rate > 0.0 {
                let mut t = start;
                loop {
                    let gap: f64 = gamma.sample(&mut rng);
                    t += gap / p.rate;
                    if t >= end {
                        break;
                    }
                    let input_len = rng.random_range(p.input_len.0..=p.input_len.1);
                    let output_len = rng.random_range(p.output_len.0..=p.output_len.1);
                    out.push(SimRequest { arrival_s: t, input_len, output_len });
                }
            }
            start = end;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost() -> CostModel {
        CostModel::from_profile(&cleave_planner::Profile::synthetic(), Default::default()).unwrap()
    }

    #[test]
    fn presets_put_their_peak_at_the_requested_load() {
        let c = cost();
        for preset in [Preset::Day, Preset::Shift] {
            let t = preset.build(&c, 10, 0.5, preset.default_duration_s()).unwrap();
            assert!((t.duration_s() - preset.default_duration_s()).abs() < 1e-6);
            let peak = t.phases.iter().map(|p| p.rate * work_per_request(&c, p) / 10.0).fold(0.0, f64::max);
            assert!((peak - 0.5).abs() < 1e-9, "{preset:?}: {peak}");
        }
        let day = Preset::Day.build(&c, 10, 0.5, 86_400.0).unwrap();
        // Night is prefill-heavy, the afternoon decode-heavy, the evening prefill-heavy again.
        let at = |h: f64| day.phases[day.phase_at(h * 3600.0)];
        assert_eq!(
            (at(2.0).input_len, at(13.0).input_len, at(22.0).input_len),
            (PREFILL_HEAVY.0, DECODE_HEAVY.0, PREFILL_HEAVY.0)
        );
        assert!(at(15.0).rate * work_per_request(&c, &at(15.0)) > 5.0 * at(3.0).rate * work_per_request(&c, &at(3.0)));
    }

    #[test]
    fn arrivals_follow_the_phases() {
        let t = Trace {
            name: "t".into(),
            phases: vec![
                Phase { duration_s: 100.0, rate: 10.0, input_len: (5, 9), output_len: (1, 1) },
                Phase { duration_s: 50.0, rate: 0.0, input_len: (1, 1), output_len: (1, 1) },
                Phase { duration_s: 100.0, rate: 40.0, input_len: (100, 200), output_len: (3, 4) },
            ],
        };
        let r = t.generate(1.0, 3).unwrap();
        assert_eq!(r, t.generate(1.0, 3).unwrap(), "seeded");
        assert!(r.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        let first: Vec<_> = r.iter().filter(|x| x.arrival_s < 100.0).collect();
        let idle = r.iter().filter(|x| (100.0..150.0).contains(&x.arrival_s)).count();
        let last: Vec<_> = r.iter().filter(|x| x.arrival_s >= 150.0).collect();
        assert_eq!(idle, 0);
        assert!((first.len() as f64 - 1000.0).abs() < 120.0, "{}", first.len());
        assert!((last.len() as f64 - 4000.0).abs() < 250.0, "{}", last.len());
        assert!(first.iter().all(|x| (5..=9).contains(&x.input_len) && x.output_len == 1));
        assert!(last.iter().all(|x| (100..=200).contains(&x.input_len) && x.arrival_s < 250.0));
        assert_eq!(t.phase_at(120.0), 1);
        assert_eq!(t.phase_at(1e9), 2);
    }

    #[test]
    fn a_phase_list_loads_from_json() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("steps.json");
        std::fs::write(&path, r#"[{"duration_s": 60, "rate": 2, "input_len": [512, 1024], "output_len": [16, 32]}]"#)
            .unwrap();
        let t = Trace::load(&path).unwrap();
        assert_eq!((t.name.as_str(), t.phases[0].input_len, t.duration_s()), ("steps", (512, 1024), 60.0));
        std::fs::write(&path, r#"[{"duration_s": 60, "rate": 2, "input_len": [0, 1], "output_len": [1, 1]}]"#).unwrap();
        assert!(Trace::load(&path).is_err());
    }
}
