//! Helpers shared by the kernel tests: a seeded generator and a tolerance check.
#![allow(dead_code)]

use cleave_kernels::cpu::Isa;
use cleave_kernels::CpuBackend;

/// SplitMix64: tiny, seeded, deterministic.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// Panics unless `|got - want| <= atol + rtol * |want|` everywhere (and lengths match).
pub fn assert_close(got: &[f32], want: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = atol + rtol * w.abs();
        assert!((g - w).abs() <= tol || (g.is_nan() && w.is_nan()), "{what}: index {i}: got {g}, want {w} (tol {tol})");
    }
}

/// Two-thread CPU backends, one per instruction set this machine supports.
pub fn backends() -> Vec<CpuBackend> {
    let base = CpuBackend::new(Some(2)).unwrap();
    let mut isas = vec![Isa::Portable, Isa::Avx2Fma, Isa::Avx512];
    isas.retain(|&i| base.clone().with_isa(i).isa() == i);
    isas.into_iter().map(|i| base.clone().with_isa(i)).collect()
}
