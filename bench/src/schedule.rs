//! Arrival schedules: when each request is sent, as offsets from the benchmark's start.
//!
//! Sans-IO: a schedule is a pure function of its [`Arrivals`] description (seed included), so the
//! same arguments give the identical schedule. Open-loop gaps are gamma-distributed with shape
//! `burstiness` and mean `1/rate` (shape 1 = Poisson), drawn from a ChaCha8 stream seeded by
//! `seed`, as in vLLM's `get_request`. A ramp changes the rate over the run: request `i` of `n`
//! uses `rate_i = start + (end - start) * i/(n-1)` (linear) or `start * (end/start)^(i/(n-1))`
//! (exponential); with `--duration` the progress is `t/duration` instead of `i/(n-1)`.
//!
//! Invariant: offsets are finite, non-negative and non-decreasing; indices are `0..len` in order.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Gamma};

use crate::{BenchError, Result};

/// One planned send.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    /// Seconds after the benchmark's start.
    pub offset_s: f64,
    /// Index into the dataset.
    pub index: usize,
}

/// How the rate changes over the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RampStrategy {
    Linear,
    Exponential,
}

/// A rate ramp from `start_rps` to `end_rps`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ramp {
    pub strategy: RampStrategy,
    pub start_rps: f64,
    pub end_rps: f64,
}

impl Ramp {
    /// The rate at `progress` in [0, 1].
    pub fn rate_at(&self, progress: f64) -> f64 {
        let p = progress.clamp(0.0, 1.0);
        match self.strategy {
            RampStrategy::Linear => self.start_rps + (self.end_rps - self.start_rps) * p,
            RampStrategy::Exponential => self.start_rps * (self.end_rps / self.start_rps).powf(p),
        }
    }
}

/// When to stop generating arrivals.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Length {
    /// Exactly this many requests.
    Count(usize),
    /// Every arrival with offset `< secs`. With an infinite rate this is not a finite set, so it
    /// needs `max_count` as a bound.
    Duration { secs: f64, max_count: usize },
}

/// An open-loop arrival process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrivals {
    /// Requests per second; `f64::INFINITY` sends everything at offset 0.
    pub rate: f64,
    /// Gamma shape; 1.0 is Poisson, below 1 is burstier, above 1 more regular.
    pub burstiness: f64,
    pub ramp: Option<Ramp>,
    pub seed: u64,
    pub length: Length,
}

fn invalid(msg: String) -> BenchError {
    BenchError::InvalidArg(msg)
}

impl Arrivals {
    /// Validates rates and shapes: rates > 0 (the base rate may be infinite), burstiness > 0.
    fn check(&self) -> Result<()> {
        if self.rate.is_nan() || self.rate <= 0.0 {
            return Err(invalid(format!("--request-rate must be > 0, got {}", self.rate)));
        }
        if !(self.burstiness > 0.0 && self.burstiness.is_finite()) {
            return Err(invalid(format!("--burstiness must be a positive number, got {}", self.burstiness)));
        }
        if let Some(r) = self.ramp {
            let ok = |x: f64| x > 0.0 && x.is_finite();
            if !ok(r.start_rps) || !ok(r.end_rps) {
                return Err(invalid(format!(
                    "ramp-up rates must be positive and finite, got {} → {}",
                    r.start_rps, r.end_rps
                )));
            }
        }
        if let Length::Duration { secs, .. } = self.length {
            if !(secs > 0.0 && secs.is_finite()) {
                return Err(invalid(format!("--duration must be positive, got {secs}")));
            }
        }
        Ok(())
    }
}

/// The schedule for `a` (see the module docs). Errors only on invalid arguments.
pub fn open_loop(a: &Arrivals) -> Result<Vec<Arrival>> {
    a.check()?;
    let mut rng = ChaCha8Rng::seed_from_u64(a.seed);
    let mut out = Vec::new();
    let mut t = 0.0f64;
    loop {
        let i = out.len();
        let progress = match a.length {
            Length::Count(n) if i >= n => break,
            Length::Count(n) => i as f64 / n.saturating_sub(1).max(1) as f64,
            Length::Duration { max_count, .. } if i >= max_count => break,
            Length::Duration { secs, .. } => t / secs,
        };
        let rate = a.ramp.map_or(a.rate, |r| r.rate_at(progress));
        if rate.is_finite() {
            // The first request goes at 0; then each gap is drawn before the next send.
            if i > 0 {
                let gamma = Gamma::new(a.burstiness, 1.0 / (rate * a.burstiness))
                    .map_err(|e| invalid(format!("gamma(shape {}, rate {rate}): {e}", a.burstiness)))?;
                t += gamma.sample(&mut rng);
            }
        }
        if let Length::Duration { secs, .. } = a.length {
            if t >= secs {
                break;
            }
        }
        out.push(Arrival { offset_s: t, index: i });
    }
    Ok(out)
}

/// Replays recorded timestamps (seconds, any origin): the first request goes at 0 and the rest
/// keep their spacing divided by `time_scale` (2.0 replays twice as fast). Requests are sent in
/// timestamp order; `index` still names the dataset entry.
pub fn from_timestamps(timestamps_s: &[f64], time_scale: f64) -> Result<Vec<Arrival>> {
    if !(time_scale > 0.0 && time_scale.is_finite()) {
        return Err(invalid(format!("--trace-time-scale must be positive, got {time_scale}")));
    }
    if let Some(bad) = timestamps_s.iter().find(|t| !t.is_finite()) {
        return Err(invalid(format!("trace timestamp {bad} is not finite")));
    }
    let origin = timestamps_s.iter().copied().fold(f64::INFINITY, f64::min);
    let mut out: Vec<Arrival> = timestamps_s
        .iter()
        .enumerate()
        .map(|(index, &ts)| Arrival { offset_s: (ts - origin) / time_scale, index })
        .collect();
    out.sort_by(|a, b| a.offset_s.total_cmp(&b.offset_s).then(a.index.cmp(&b.index)));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poisson(rate: f64, n: usize, seed: u64) -> Arrivals {
        Arrivals { rate, burstiness: 1.0, ramp: None, seed, length: Length::Count(n) }
    }

    #[test]
    fn same_seed_same_schedule_other_seed_differs() {
        let a = open_loop(&poisson(5.0, 50, 1)).unwrap();
        assert_eq!(a, open_loop(&poisson(5.0, 50, 1)).unwrap());
        assert_ne!(a, open_loop(&poisson(5.0, 50, 2)).unwrap());
        assert!(a.windows(2).all(|w| w[0].offset_s <= w[1].offset_s));
        assert_eq!(a.iter().map(|x| x.index).collect::<Vec<_>>(), (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn gamma_gaps_have_mean_one_over_rate() {
        for burstiness in [0.5, 1.0, 4.0] {
            let n = 20_000;
            let s = open_loop(&Arrivals { burstiness, ..poisson(8.0, n, 3) }).unwrap();
            let mean_gap = s.last().unwrap().offset_s / (n - 1) as f64;
            // Std of the mean of 20k gamma gaps is (1/8)/sqrt(20k*shape) ≤ 1.3%; allow 5%.
            assert!((mean_gap - 0.125).abs() < 0.125 * 0.05, "burstiness {burstiness}: mean gap {mean_gap}");
        }
    }

    #[test]
    fn infinite_rate_sends_everything_at_zero() {
        let s = open_loop(&poisson(f64::INFINITY, 4, 0)).unwrap();
        assert!(s.iter().all(|a| a.offset_s == 0.0));
        assert_eq!(s.len(), 4);
    }

    #[test]
    fn ramp_rates_are_monotone_and_hit_the_ends() {
        for strategy in [RampStrategy::Linear, RampStrategy::Exponential] {
            let r = Ramp { strategy, start_rps: 1.0, end_rps: 16.0 };
            let rates: Vec<f64> = (0..=10).map(|i| r.rate_at(i as f64 / 10.0)).collect();
            assert!(rates.windows(2).all(|w| w[0] < w[1]), "{strategy:?}: {rates:?}");
            assert!((rates[0] - 1.0).abs() < 1e-12 && (rates[10] - 16.0).abs() < 1e-9);
        }
        assert!(
            (Ramp { strategy: RampStrategy::Exponential, start_rps: 1.0, end_rps: 16.0 }.rate_at(0.5) - 4.0).abs()
                < 1e-12
        );
        // Gaps shrink as the rate ramps up: the last quarter's mean gap is below the first's.
        let ramp = Some(Ramp { strategy: RampStrategy::Linear, start_rps: 1.0, end_rps: 20.0 });
        let s = open_loop(&Arrivals { ramp, ..poisson(1.0, 4000, 9) }).unwrap();
        let span = |a: &[Arrival]| a.last().unwrap().offset_s - a[0].offset_s;
        assert!(span(&s[3000..]) < span(&s[..1000]) / 3.0);
    }

    #[test]
    fn duration_stops_before_the_end() {
        let s = open_loop(&Arrivals {
            length: Length::Duration { secs: 10.0, max_count: 1_000_000 },
            ..poisson(20.0, 0, 4)
        })
        .unwrap();
        assert!(s.iter().all(|a| a.offset_s < 10.0));
        // About 200 arrivals; 6 sigma of Poisson(200) is ±85.
        assert!((115..=285).contains(&s.len()), "{}", s.len());
        let inf = Arrivals { length: Length::Duration { secs: 1.0, max_count: 7 }, ..poisson(f64::INFINITY, 0, 0) };
        assert_eq!(open_loop(&inf).unwrap().len(), 7);
    }

    #[test]
    fn trace_replay_keeps_scaled_timestamps() {
        let s = from_timestamps(&[10.0, 10.3, 10.6, 10.1], 2.0).unwrap();
        let got: Vec<(usize, f64)> = s.iter().map(|a| (a.index, a.offset_s)).collect();
        let want = [(0, 0.0), (3, 0.05), (1, 0.15), (2, 0.3)];
        for ((gi, go), (wi, wo)) in got.iter().zip(want) {
            assert_eq!(*gi, wi);
            assert!((go - wo).abs() < 1e-9, "{got:?}");
        }
        assert!(from_timestamps(&[0.0], 0.0).is_err());
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(open_loop(&poisson(0.0, 3, 0)).is_err());
        assert!(open_loop(&Arrivals { burstiness: 0.0, ..poisson(1.0, 3, 0) }).is_err());
    }
}
