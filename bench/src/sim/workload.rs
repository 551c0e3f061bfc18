//! Simulated requests: arrival times from a seeded Poisson or gamma process, prompt and output
//! lengths uniform in ranges. Arrivals are drawn at unit rate and scaled by `1 / rate`, so one
//! seed gives the same requests at every rate (common random numbers: attainment against rate is
//! then a smooth curve and bisection over rate is sound).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Gamma};
use serde::{Deserialize, Serialize};

use crate::error::{BenchError, Result};

/// One request as the simulator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SimRequest {
    /// Seconds since the start.
    pub arrival_s: f64,
    pub input_len: usize,
    /// Output tokens, the first included (≥ 1).
    pub output_len: usize,
}

/// How to draw requests.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WorkloadSpec {
    pub num_requests: usize,
    /// Inclusive range of prompt lengths.
    pub input_len: (usize, usize),
    /// Inclusive range of output lengths (≥ 1).
    pub output_len: (usize, usize),
    /// Gamma shape of the inter-arrival times: 1 is Poisson, below 1 burstier.
    pub burstiness: f64,
    pub seed: u64,
}

impl WorkloadSpec {
    /// The requests at `rate` per second (infinite: all at time 0).
    pub fn generate(&self, rate: f64) -> Result<Vec<SimRequest>> {
        let (i0, i1) = self.input_len;
        let (o0, o1) = self.output_len;
        if i0 == 0 || i0 > i1 || o0 == 0 || o0 > o1 {
            return Err(BenchError::InvalidArg(format!(
                "length ranges must be non-empty and positive: input {i0}..={i1}, output {o0}..={o1}"
            )));
        }
        // NaN fails both checks; an infinite rate puts every arrival at 0.
        let burst_ok = self.burstiness.is_finite() && self.burstiness > 0.0;
        if !burst_ok || rate.is_nan() || rate <= 0.0 {
            return Err(BenchError::InvalidArg(format!(
                "burstiness {} and rate {rate} must be positive",
                self.burstiness
            )));
        }
        // Mean 1: shape k, scale 1/k.
        let gamma = Gamma::new(self.burstiness, 1.0 / self.burstiness)
            .map_err(|e| BenchError::InvalidArg(format!("burstiness {}: {e}", self.burstiness)))?;
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut t = 0.0f64;
        let mut out = Vec::with_capacity(self.num_requests);
        for _ in 0..self.num_requests {
            let gap: f64 = gamma.sample(&mut rng);
            let input_len = rng.random_range(i0..=i1);
            let output_len = rng.random_range(o0..=o1);
            let arrival_s = if rate.is_finite() { t / rate } else { 0.0 };
            out.push(SimRequest { arrival_s, input_len, output_len });
            t += gap;
        }
        Ok(out)
    }
}
