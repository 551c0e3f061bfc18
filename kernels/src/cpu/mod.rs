//! The CPU backend: f32 `Vec` buffers (KV cache pools: [`Pages`] of f32, f16 or bf16, [`KvPool`]),
//! a private rayon pool, AVX-512/AVX2 inner loops chosen at runtime.
//!
//! Every method validates with the same `check` functions as [`crate::reference`], then runs a
//! parallel kernel. Element-wise ops go parallel only above `PAR_MIN_ELEMS`, where the fork/join
//! cost (a few microseconds) is repaid. Results match the reference to f32 rounding: the
//! element-wise ops and RoPE use the same formulas in the same order (bit-identical), reductions
//! differ only in summation order.

mod attention;
mod attention_tiled;
mod crew;
mod kv;
mod matmul;
mod packed;
pub mod quant;
pub mod simd;
mod simd_half;

/// The f32 value of a 16-bit element (`BF`: bf16, else f16), exactly as every kernel path widens it.
pub(crate) fn half_widen<const BF: bool>(h: u16) -> f32 {
    simd_half::portable::widen::<BF>(h)
}

/// `x` rounded to the 16-bit format (to nearest, ties to even), as every kernel path narrows it.
pub(crate) fn half_narrow<const BF: bool>(x: f32) -> u16 {
    simd_half::portable::narrow::<BF>(x)
}

use crate::quant::QuantMatrix;
use crate::HalfMatrix;
use crate::{check, AttnSeq, AttnShape, Backend, CacheDtype, KernelError, LinearInfo, Result, Rows};
pub use kv::{KvPool, Pages, ZeroBits};
pub use packed::{HalfPacked, PackedLinear, NR as PANEL_COLUMNS};
pub use quant::QuantIsa;
use rayon::prelude::*;
pub use simd::Isa;
use std::sync::Arc;

/// Element count below which element-wise ops stay on the calling thread.
const PAR_MIN_ELEMS: usize = 1 << 15;

/// The CPU backend. Cheap to clone (the pool is shared).
#[derive(Clone)]
pub struct CpuBackend {
    pool: Arc<rayon::ThreadPool>,
    isa: Isa,
    /// The quantized kernels' path, the best that `isa` allows.
    qisa: QuantIsa,
    /// Quantized `linear` calls with `m <= quant_max_m` use the integer kernels, larger ones
    /// dequantized f32 panels (default `None`: [`QuantIsa::max_m`] for the call's [`Rows`] and
    /// the weight's format; [`CpuBackend::with_quant_max_m`] sets one for every call).
    quant_max_m: Option<usize>,
    /// `linear` calls with `m <= skinny_max_m` use the weight-streaming kernel, larger ones gemm.
    skinny_max_m: usize,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads())
            .field("isa", &self.isa)
            .field("quant_isa", &self.qisa)
            .field("quant_max_m", &self.quant_max_m)
            .field("skinny_max_m", &self.skinny_max_m)
            .finish()
    }
}

impl Default for CpuBackend {
    /// One thread per available core.
    ///
    /// # Panics
    /// If the OS refuses to start the pool's threads; use [`CpuBackend::new`] to handle that.
    fn default() -> Self {
        CpuBackend::new(None).expect("failed to start the CPU backend's thread pool")
    }
}

impl CpuBackend {
    /// A backend with its own pool of `threads` threads (`None`: one per available core).
    pub fn new(threads: Option<usize>) -> Result<Self> {
        let threads = threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cleave-cpu-{i}"))
            .build()
            .map_err(|e| KernelError::Device { backend: "cpu", detail: format!("thread pool: {e}") })?;
        let isa = Isa::detect();
        Ok(CpuBackend {
            pool: Arc::new(pool),
            isa,
            qisa: QuantIsa::for_isa(isa),
            quant_max_m: None,
            skinny_max_m: matmul::SKINNY_MAX_M,
        })
    }

    /// The same backend restricted to a given instruction set (for tests and benchmarks of the
    /// fallbacks). An ISA the CPU lacks is replaced by the detected one.
    pub fn with_isa(mut self, isa: Isa) -> Self {
        let ok = match isa {
            Isa::Portable => true,
            Isa::Avx2Fma => self.isa != Isa::Portable,
            Isa::Avx512 => self.isa == Isa::Avx512,
        };
        if ok {
            self.isa = isa;
            self.qisa = QuantIsa::for_isa(isa);
        }
        self
    }

    /// The same backend with the quantized kernels restricted to `qisa` (for tests and
    /// benchmarks of AVX-512BW on a VNNI machine, say). A path the CPU lacks, or one above what
    /// the backend's [`Isa`] allows, is ignored.
    pub fn with_quant_isa(mut self, qisa: QuantIsa) -> Self {
        let best = QuantIsa::for_isa(self.isa);
        let order = [QuantIsa::Portable, QuantIsa::Avx2, QuantIsa::Avx512Bw, QuantIsa::Avx512Vnni];
        let rank = |q: QuantIsa| order.iter().position(|&o| o == q).unwrap_or(0);
        if rank(qisa) <= rank(best) {
            self.qisa = qisa;
        }
        self
    }

    /// The same backend with another crossover between the weight-streaming kernel and gemm:
    /// `linear` with `m <= max_m` streams the weights (for tuning and benchmarks).
    pub fn with_skinny_max_m(mut self, max_m: usize) -> Self {
        self.skinny_max_m = max_m;
        self
    }

    /// The same backend with another crossover between the quantized integer kernels and f32
    /// panels: quantized `linear` with `m <= max_m` uses the integer kernels (for tuning and
    /// benchmarks).
    pub fn with_quant_max_m(mut self, max_m: usize) -> Self {
        self.quant_max_m = Some(max_m);
        self
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn quant_isa(&self) -> QuantIsa {
        self.qisa
    }

    /// Runs `f` inside this backend's pool (so rayon calls in `f` use its threads).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Runs `f(chunk)` over `chunk`-sized pieces of `x`, in parallel when `x` is large.
    fn for_chunks(&self, x: &mut [f32], chunk: usize, f: impl Fn(usize, &mut [f32]) + Send + Sync) {
        if chunk == 0 {
            return;
        }
        if x.len() < PAR_MIN_ELEMS {
            x.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
        } else {
            let per_task = chunk * (PAR_MIN_ELEMS / 4 / chunk).max(1);
            self.pool.install(|| {
                x.par_chunks_mut(per_task).enumerate().for_each(|(i, c)| {
                    let first = i * (per_task / chunk);
                    c.chunks_mut(chunk).enumerate().for_each(|(j, c)| f(first + j, c))
                })
            });
        }
    }
}

/// A linear weight as the CPU backend multiplies it: f32 packed into panels
/// ([`Backend::prepare_linear`]), or kept in its block-quantized format
/// ([`Backend::prepare_linear_quantized`]).
#[derive(Debug)]
pub enum CpuLinear {
    Packed(PackedLinear),
    Quantized(QuantMatrix),
    /// f16 or bf16 elements in f32's panel layout ([`Backend::prepare_linear_half`]).
    Half(HalfPacked),
}

impl CpuLinear {
    /// Output features.
    pub fn n(&self) -> usize {
        match self {
            CpuLinear::Packed(p) => p.n(),
            CpuLinear::Quantized(q) => q.n(),
            CpuLinear::Half(h) => h.n(),
        }
    }

    /// Input features.
    pub fn k(&self) -> usize {
        match self {
            CpuLinear::Packed(p) => p.k(),
            CpuLinear::Quantized(q) => q.k(),
            CpuLinear::Half(h) => h.k(),
        }
    }

    /// Bytes of the weight as held (what a multiply reads from memory): 4 per value for f32
    /// panels (padding columns aside), the blocks' bytes for a quantized weight.
    pub fn weight_bytes(&self) -> usize {
        match self {
            CpuLinear::Packed(p) => 4 * p.n() * p.k(),
            CpuLinear::Quantized(q) => q.bytes().len(),
            CpuLinear::Half(h) => 2 * h.n() * h.k(),
        }
    }

    /// "f32", or the quantized format's name.
    pub fn format_name(&self) -> &'static str {
        match self {
            CpuLinear::Packed(_) => "f32",
            CpuLinear::Quantized(q) => q.format().name(),
            CpuLinear::Half(h) => h.format().name(),
        }
    }

    /// Row `j` as f32 into `out[..k]`.
    fn row_into(&self, j: usize, out: &mut [f32]) {
        match self {
            CpuLinear::Packed(p) => p.row_into(j, out),
            CpuLinear::Quantized(q) => q.dequantize_row(j, out),
            CpuLinear::Half(h) => h.row_into(j, out),
        }
    }
}

impl Backend for CpuBackend {
    /// `f` on one of the pool's threads, every other worker spinning for the whole of it and
    /// taking the linear kernels' tasks as they come ([`crew`]: a decode step's ~150 short
    /// parallel regions otherwise cost a futex sleep and wake each).
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.pool.current_num_threads() < 2 {
            return self.pool.install(f);
        }
        self.pool.install(|| crew::Crew::pass(f))
    }

    type Buf = Vec<f32>;
    type Linear = CpuLinear;
    type KvBuf = KvPool;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc_zeros(&self, len: usize) -> Result<Vec<f32>> {
        // Zeroed pages from the allocator (calloc/mmap) rather than writing zeros: a KV cache of
        // gigabytes then costs nothing until it is used.
        let oom = || KernelError::OutOfMemory { bytes: len.saturating_mul(std::mem::size_of::<f32>()) };
        if len == 0 {
            return Ok(Vec::new());
        }
        let layout = std::alloc::Layout::array::<f32>(len).map_err(|_| oom())?;
        // SAFETY: `layout` has non-zero size; a null return is handled; all-zero bits are a valid
        // f32 (0.0), so the `len` elements are initialised; the pointer comes from the global
        // allocator with exactly this layout, as `Vec::from_raw_parts` requires.
        unsafe {
            let ptr = std::alloc::alloc_zeroed(layout) as *mut f32;
            if ptr.is_null() {
                return Err(oom());
            }
            Ok(Vec::from_raw_parts(ptr, len, len))
        }
    }

    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        let mut v = self.alloc_zeros(0)?;
        v.try_reserve_exact(host.len())
            .map_err(|_| KernelError::OutOfMemory { bytes: host.len().saturating_mul(std::mem::size_of::<f32>()) })?;
        v.extend_from_slice(host);
        Ok(v)
    }

    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        self.upload(buf)
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn copy(&self, src: &Vec<f32>, src_off: usize, dst: &mut Vec<f32>, dst_off: usize, len: usize) -> Result<()> {
        check::range("copy", "src", src.len(), src_off, len)?;
        check::range("copy", "dst", dst.len(), dst_off, len)?;
        dst[dst_off..dst_off + len].copy_from_slice(&src[src_off..src_off + len]);
        Ok(())
    }

    fn write(&self, dst: &mut Vec<f32>, dst_off: usize, host: &[f32]) -> Result<()> {
        check::range("write", "dst", dst.len(), dst_off, host.len())?;
        dst[dst_off..dst_off + host.len()].copy_from_slice(host);
        Ok(())
    }

    fn read(&self, src: &Vec<f32>, src_off: usize, len: usize) -> Result<Vec<f32>> {
        check::range("read", "src", src.len(), src_off, len)?;
        self.upload(&src[src_off..src_off + len])
    }

    fn linear(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        m: usize,
        k: usize,
        n: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        check::linear(x.len(), w.len(), bias.map(Vec::len), (m, k, n), out.len())?;
        let bias = bias.map(|b| &b[..n]);
        matmul::linear(
            &self.pool,
            self.isa,
            self.skinny_max_m,
            &x[..m * k],
            &w[..n * k],
            bias,
            (m, k, n),
            &mut out[..m * n],
        );
        Ok(())
    }

    fn prepare_linear(&self, w: &[f32], n: usize, k: usize) -> Result<CpuLinear> {
        PackedLinear::pack(&self.pool, self.isa, w, n, k).map(CpuLinear::Packed)
    }

    fn prepare_linear_quantized(&self, w: QuantMatrix) -> Result<CpuLinear> {
        Ok(CpuLinear::Quantized(w))
    }

    fn prepare_linear_half(&self, w: HalfMatrix) -> Result<CpuLinear> {
        HalfPacked::pack(&self.pool, &w).map(CpuLinear::Half)
    }

    fn linear_info(&self, w: &CpuLinear) -> LinearInfo {
        LinearInfo { n: w.n(), k: w.k(), bytes: w.weight_bytes(), format: w.format_name() }
    }

    fn linear_prepared(
        &self,
        x: &Vec<f32>,
        w: &CpuLinear,
        bias: Option<&Vec<f32>>,
        m: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.linear_prepared_many(x, &[(w, bias)], m, &mut [out])
    }

    fn linear_prepared_many(
        &self,
        x: &Vec<f32>,
        ws: &[(&CpuLinear, Option<&Vec<f32>>)],
        m: usize,
        outs: &mut [&mut Vec<f32>],
    ) -> Result<()> {
        self.linear_prepared_rows(x, ws, Rows::Prompt, m, outs)
    }

    fn linear_prepared_rows(
        &self,
        x: &Vec<f32>,
        ws: &[(&CpuLinear, Option<&Vec<f32>>)],
        rows: Rows,
        m: usize,
        outs: &mut [&mut Vec<f32>],
    ) -> Result<()> {
        let shapes = ws.iter().map(|(w, bias)| ((w.n(), w.k()), bias.map(|b| b.len())));
        let Some(k) = check::linear_many(x.len(), shapes, m, outs.iter().map(|o| o.len()))? else { return Ok(()) };
        let x = &x[..m * k];
        let mut f32s = Vec::new();
        let mut quants = Vec::new();
        for ((w, bias), out) in ws.iter().zip(outs.iter_mut()) {
            let (bias, out) = (bias.map(|b| &b[..w.n()]), &mut out[..m * w.n()]);
            match w {
                CpuLinear::Packed(w) => f32s.push(packed::Product { w, bias, out, ld: w.n() }),
                CpuLinear::Half(w) => f32s.push(packed::Product { w, bias, out, ld: w.n() }),
                CpuLinear::Quantized(w) => quants.push(quant::Product { w, bias, out }),
            }
        }
        if !f32s.is_empty() {
            packed::linear_many(&self.pool, self.isa, x, m, &mut f32s);
        }
        // Integer kernels or f32 panels, by format: products of one format (q/k/v, gate/up) share
        // a parallel region.
        let integer = |p: &quant::Product<'_>| m <= self.quant_max_m.unwrap_or(self.qisa.max_m(rows, p.w.format()));
        let (ints, wides): (Vec<_>, Vec<_>) = quants.into_iter().partition(integer);
        for (mut products, max_m) in [(ints, usize::MAX), (wides, 0)] {
            if !products.is_empty() {
                let kernels = quant::Kernels { isa: self.isa, qisa: self.qisa, max_m };
                quant::linear_many(&self.pool, kernels, x, m, &mut products);
            }
        }
        Ok(())
    }

    fn embedding_prepared(&self, w: &CpuLinear, ids: &[u32], out: &mut Vec<f32>) -> Result<()> {
        let (n, k) = (w.n(), w.k());
        check::embedding(n * k, ids, n, k, out.len())?;
        self.for_chunks(&mut out[..ids.len() * k], k, |t, o| w.row_into(ids[t] as usize, o));
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        check::rms_norm(x.len(), weight.len(), rows, dim, out.len())?;
        let weight = &weight[..dim];
        self.for_chunks(&mut out[..rows * dim], dim, |r, o| {
            let row = &x[r * dim..(r + 1) * dim];
            let mean_sq = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
            let inv = 1.0 / (mean_sq as f32 + eps).sqrt();
            for ((o, &v), &g) in o.iter_mut().zip(row).zip(weight) {
                *o = g * (v * inv);
            }
        });
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        positions: &[u32],
        num_heads: usize,
        head_dim: usize,
        cos_sin: &Vec<f32>,
    ) -> Result<()> {
        check::rope(x.len(), positions, num_heads, head_dim, cos_sin.len())?;
        let half = head_dim / 2;
        let width = num_heads * head_dim;
        self.for_chunks(&mut x[..positions.len() * width], width, |t, tok| {
            let p = positions[t] as usize;
            let (cos, sin) = cos_sin[p * head_dim..(p + 1) * head_dim].split_at(half);
            for v in tok.chunks_exact_mut(head_dim) {
                let (lo, hi) = v.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (lo[i], hi[i]);
                    lo[i] = a * cos[i] + -b * sin[i];
                    hi[i] = b * cos[i] + a * sin[i];
                }
            }
        });
        Ok(())
    }

    fn silu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) -> Result<()> {
        check::silu_mul(gate.len(), up.len(), len, out.len())?;
        const CHUNK: usize = 4096;
        let isa = self.isa;
        self.for_chunks(&mut out[..len], CHUNK, |c, o| {
            let base = c * CHUNK;
            simd::silu_mul(isa, &gate[base..], &up[base..], o);
        });
        Ok(())
    }

    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) -> Result<()> {
        check::add_assign(x.len(), y.len(), len)?;
        const CHUNK: usize = 4096;
        self.for_chunks(&mut x[..len], CHUNK, |c, xs| {
            xs.iter_mut().zip(&y[c * CHUNK..]).for_each(|(x, y)| *x += y);
        });
        Ok(())
    }

    fn softmax(&self, x: &mut Vec<f32>, rows: usize, dim: usize) -> Result<()> {
        check::softmax(x.len(), rows, dim)?;
        self.for_chunks(&mut x[..rows * dim], dim, |_, row| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f64;
            for v in row.iter_mut() {
                *v = (*v - max).exp();
                sum += *v as f64;
            }
            let inv = (1.0 / sum) as f32;
            row.iter_mut().for_each(|v| *v *= inv);
        });
        Ok(())
    }

    fn embedding(&self, table: &Vec<f32>, ids: &[u32], vocab: usize, dim: usize, out: &mut Vec<f32>) -> Result<()> {
        check::embedding(table.len(), ids, vocab, dim, out.len())?;
        self.for_chunks(&mut out[..ids.len() * dim], dim, |t, o| {
            let id = ids[t] as usize;
            o.copy_from_slice(&table[id * dim..(id + 1) * dim]);
        });
        Ok(())
    }

    fn gather_rows(&self, x: &Vec<f32>, rows: &[u32], dim: usize, out: &mut Vec<f32>) -> Result<()> {
        check::gather_rows(x.len(), rows, dim, out.len())?;
        self.for_chunks(&mut out[..rows.len() * dim], dim, |i, o| {
            let r = rows[i] as usize;
            o.copy_from_slice(&x[r * dim..(r + 1) * dim]);
        });
        Ok(())
    }

    fn alloc_kv(&self, dtype: CacheDtype, len: usize) -> Result<KvPool> {
        kv::alloc(dtype, len)
    }

    fn kv_info(&self, buf: &KvPool) -> (CacheDtype, usize) {
        (buf.dtype(), buf.len())
    }

    fn kv_resident_bytes(&self, buf: &KvPool) -> usize {
        buf.resident_bytes()
    }

    fn read_kv_bytes(&self, src: &KvPool, off: usize, len: usize, out: &mut Vec<u8>) -> Result<()> {
        kv::read_bytes(src, off, len, out)
    }

    fn write_kv_bytes(&self, dst: &mut KvPool, off: usize, bytes: &[u8]) -> Result<()> {
        kv::write_bytes(dst, off, bytes)
    }

    fn copy_kv(&self, buf: &mut KvPool, src_off: usize, dst_off: usize, len: usize) -> Result<()> {
        kv::copy_within(buf, src_off, dst_off, len)
    }

    fn write_kv(
        &self,
        k: &Vec<f32>,
        v: &Vec<f32>,
        slots: &[u32],
        kv_width: usize,
        k_cache: &mut KvPool,
        v_cache: &mut KvPool,
    ) -> Result<()> {
        const OP: &str = "write_kv";
        kv::same_dtype(OP, k_cache, v_cache)?;
        check::write_kv(k.len(), v.len(), slots, kv_width, k_cache.len(), v_cache.len())?;
        let (isa, kv) = (self.isa, (k.as_slice(), v.as_slice()));
        match (k_cache, v_cache) {
            (KvPool::F32(kc), KvPool::F32(vc)) => kv::write_rows(isa, kv, slots, kv_width, kc, vc),
            (KvPool::F16(kc), KvPool::F16(vc)) => kv::write_rows(isa, kv, slots, kv_width, kc, vc),
            (KvPool::Bf16(kc), KvPool::Bf16(vc)) => kv::write_rows(isa, kv, slots, kv_width, kc, vc),
            (kc, vc) => return kv::same_dtype(OP, kc, vc).map(|_| ()),
        }
        Ok(())
    }

    fn paged_attention(
        &self,
        q: &Vec<f32>,
        k_cache: &KvPool,
        v_cache: &KvPool,
        seqs: &[AttnSeq<'_>],
        shape: AttnShape,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        const OP: &str = "paged_attention";
        kv::same_dtype(OP, k_cache, v_cache)?;
        let dims = check::paged_attention(q.len(), k_cache.len(), v_cache.len(), seqs, &shape, out.len())?;
        let (pool, isa) = (&self.pool, self.isa);
        match (k_cache, v_cache) {
            (KvPool::F32(kc), KvPool::F32(vc)) => {
                attention::paged_attention(pool, isa, q, kc, vc, seqs, &shape, dims, out)
            }
            (KvPool::F16(kc), KvPool::F16(vc)) => {
                attention::paged_attention(pool, isa, q, kc, vc, seqs, &shape, dims, out)
            }
            (KvPool::Bf16(kc), KvPool::Bf16(vc)) => {
                attention::paged_attention(pool, isa, q, kc, vc, seqs, &shape, dims, out)
            }
            (kc, vc) => return kv::same_dtype(OP, kc, vc).map(|_| ()),
        }
        Ok(())
    }
}
