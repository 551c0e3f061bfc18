//! The CUDA backend (feature `cuda`): the same [`Backend`] ops on an NVIDIA GPU through cudarc.
//!
//! - The CUDA libraries (driver, NVRTC, cuBLAS) are loaded when a backend is created, not linked:
//!   a binary built with the feature starts on a machine without them, and
//!   [`CudaBackend::new`] says what is missing instead of panicking inside cudarc (which it would
//!   on the first driver call without a driver).
//! - Kernels (kernels.cu) are compiled by NVRTC at start, for the device's own architecture.
//! - Linear layers run on cuBLAS: f32 activations times weights held as f32 (exact f32 products,
//!   no TF32) or in 16 bits ([`GemmDtype::Bf16`]: bf16 or f16 tensor-core GEMM with f32
//!   accumulation, activations rounded to the weights' type first).
//! - All work is issued on one stream in call order, so ops need no events between them; a
//!   read back to the host waits for the stream.
//! - Sampling stays on the host: the engine reads the logits rows back.

pub mod plan;

use crate::half::HalfMatrix;
use crate::quant::QuantMatrix;
use crate::{check, AttnSeq, AttnShape, Backend, CacheDtype, KernelError, LinearInfo, Result};
use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig, PushKernelArg,
};
use plan::Geometry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The NVRTC source of every kernel.
pub const KERNELS_SOURCE: &str = include_str!("kernels.cu");

/// Every kernel the backend loads from [`KERNELS_SOURCE`].
pub const KERNEL_NAMES: &[&str] = &[
    "f32_to_f16_kernel",
    "f32_to_bf16_kernel",
    "add_bias",
    "add_assign",
    "silu_mul",
    "rms_norm",
    "softmax",
    "rope",
    "gather_f32",
    "gather_f16",
    "gather_bf16",
    "write_kv_f32",
    "write_kv_f16",
    "write_kv_bf16",
    "paged_attention_f32_g1",
    "paged_attention_f16_g1",
    "paged_attention_bf16_g1",
    "paged_attention_f32_g2",
    "paged_attention_f16_g2",
    "paged_attention_bf16_g2",
    "paged_attention_f32_g4",
    "paged_attention_f16_g4",
    "paged_attention_bf16_g4",
    "paged_attention_f32_g8",
    "paged_attention_f16_g8",
    "paged_attention_bf16_g8",
];

const NAME: &str = "cuda";

fn dev_err(e: impl std::fmt::Display) -> KernelError {
    KernelError::Device { backend: NAME, detail: e.to_string() }
}

fn driver_err(e: DriverError) -> KernelError {
    if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return KernelError::OutOfMemory { bytes: 0 };
    }
    dev_err(e)
}

/// What linear weights are held as on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmDtype {
    /// f32 weights, f32 GEMM (no TF32): products match the CPU's to rounding.
    F32,
    /// 16-bit weights (bf16, or f16 where the checkpoint is f16), tensor-core GEMM with f32
    /// accumulation: half the bytes, many times the FLOP rate; activations are rounded to the
    /// weights' type at each product.
    Bf16,
}

/// Whether the CUDA driver library can be loaded here: the check to make before creating a
/// context (cudarc panics on a driver call without one).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library's candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC can be loaded here.
pub fn nvrtc_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles [`KERNELS_SOURCE`] to PTX with NVRTC (no driver or device needed), for
/// `compute_capability` when given, with exact division and square root (RMSNorm's `1 / sqrt`
/// is compared with the CPU's). Returns the PTX text.
pub fn compile_kernels(compute_capability: Option<(i32, i32)>) -> Result<String> {
    if !nvrtc_present() {
        return Err(dev_err("NVRTC (libnvrtc.so) was not found: install the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel and put its lib folder on LD_LIBRARY_PATH"));
    }
    let mut opts = cudarc::nvrtc::CompileOptions {
        prec_div: Some(true),
        prec_sqrt: Some(true),
        name: Some("cleave_kernels.cu".into()),
        ..Default::default()
    };
    if let Some(arch) = plan::compile_arch(compute_capability) {
        opts.options.push(arch);
    }
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(KERNELS_SOURCE, opts).map_err(|e| dev_err(format!("NVRTC: {e:?}")))?;
    Ok(ptx.to_src())
}

/// A linear weight on the device, `[n, k]` row-major (Hugging Face's layout), which cuBLAS reads
/// as the column-major `[k, n]` it multiplies transposed.
#[derive(Debug)]
pub struct CudaLinear {
    n: usize,
    k: usize,
    data: Weights,
}

#[derive(Debug)]
enum Weights {
    F32(CudaSlice<f32>),
    F16(CudaSlice<u16>),
    Bf16(CudaSlice<u16>),
}

impl Weights {
    fn bytes(&self) -> usize {
        match self {
            Weights::F32(s) => s.len() * 4,
            Weights::F16(s) | Weights::Bf16(s) => s.len() * 2,
        }
    }
}

/// One layer's K or V pool in device memory: `len` elements of `dtype`.
#[derive(Debug)]
pub struct CudaKv {
    dtype: CacheDtype,
    len: usize,
    data: CudaSlice<u8>,
}

/// A GPU of this machine as a [`Backend`].
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
    gemm: GemmDtype,
    name: String,
    /// Per-op host arrays, kept on the device between ops ([`Reuse`]).
    reuse: Mutex<Reuse>,
}

/// What ops upload or stage, kept for the next op. The small arrays an op takes from the host
/// (RoPE's positions, the KV slots, token ids, attention's packed block tables) are the same for
/// every layer of a step, so the last upload of each kind is reused while its content is
/// unchanged: four uploads a step instead of a few per layer, each a synchronous copy from
/// pageable memory. The 16-bit staging of GEMM activations is one buffer, grown as needed.
/// Buffers replaced here are freed in stream order, after the kernels that read them. The lock is
/// held from lookup through launch, so two threads sharing a backend cannot free a buffer the
/// other is about to launch with; the engine drives a backend from one thread, so it is never
/// contended.
///
/// KV bytes cross to and from the host through one page-locked buffer (`pinned`): the DMA
/// engine copies it at full speed, where a copy to pageable memory goes through the driver's
/// own staging at a few GB/s (measured on the H200: BENCHMARKS.md, "The handoff's staging").
#[derive(Default)]
struct Reuse {
    uploads: [(Vec<u32>, Option<CudaSlice<u32>>); 4],
    stage: Option<CudaSlice<u16>>,
    pinned: Option<cudarc::driver::PinnedHostSlice<u8>>,
}

/// The kinds of [`Reuse::uploads`].
#[derive(Clone, Copy)]
enum Upload {
    Positions = 0,
    Slots = 1,
    Ids = 2,
    AttnMeta = 3,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("device", &self.name).field("gemm", &self.gemm).finish()
    }
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles the kernels for it and starts cuBLAS. Every missing piece
    /// (driver, device, NVRTC, cuBLAS) is an error that names it.
    pub fn new(ordinal: usize, gemm: GemmDtype) -> Result<Self> {
        if !driver_present() {
            return Err(dev_err(
                "no CUDA driver (libcuda.so) on this machine: it has no NVIDIA GPU, or its driver is not installed",
            ));
        }
        let count = CudaContext::device_count().map_err(driver_err)?;
        if ordinal >= count.max(0) as usize {
            return Err(dev_err(format!("GPU {ordinal} asked for, {count} present")));
        }
        if !nvrtc_present() {
            return Err(dev_err("NVRTC (libnvrtc.so) was not found: put the CUDA toolkit's lib64 on LD_LIBRARY_PATH"));
        }
        // SAFETY: only tries to dlopen the library's candidate names.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(dev_err(
                "cuBLAS (libcublas.so) was not found: put the CUDA toolkit's lib64 on LD_LIBRARY_PATH",
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err)?;
        // One stream carries every op in order, so cudarc's per-buffer events add nothing.
        // SAFETY: called before any buffer of this context exists.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let cc = ctx.compute_capability().map_err(driver_err)?;
        let ptx = compile_kernels(Some(cc))?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(driver_err)?;
        let mut funcs = HashMap::new();
        for &name in KERNEL_NAMES {
            funcs.insert(name, module.load_function(name).map_err(driver_err)?);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(dev_err)?;
        let name = format!("{} (sm_{}{})", ctx.name().map_err(driver_err)?, cc.0, cc.1);
        Ok(CudaBackend { ctx, stream, blas, _module: module, funcs, gemm, name, reuse: Mutex::default() })
    }

    /// The device's name and compute capability.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// Waits for every op issued so far (timings read the clock after this).
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err)
    }

    fn func(&self, name: &'static str) -> Result<&CudaFunction> {
        self.funcs.get(name).ok_or_else(|| dev_err(format!("kernel {name} not loaded")))
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    fn reuse(&self) -> MutexGuard<'_, Reuse> {
        self.reuse.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The page-locked buffer, at least `len` bytes (grown to a power of two).
    fn pinned<'r>(&self, reuse: &'r mut Reuse, len: usize) -> Result<&'r mut [u8]> {
        if reuse.pinned.as_ref().is_none_or(|p| p.len() < len) {
            // The old buffer is freed before the larger one is taken.
            reuse.pinned = None;
            // SAFETY: the buffer is only read after the copies into it have completed (each user
            // synchronizes the stream before reading or releasing the lock).
            reuse.pinned = Some(unsafe { self.ctx.alloc_pinned::<u8>(len.next_power_of_two()) }.map_err(driver_err)?);
        }
        match reuse.pinned.as_mut() {
            Some(p) => Ok(&mut p.as_mut_slice().map_err(driver_err)?[..len]),
            None => Err(dev_err("pinned buffer missing")),
        }
    }

    /// Runs `f` with a device copy of `host` (reused if the last upload of `kind` was the same),
    /// holding [`Reuse`]'s lock so the copy outlives the launch `f` makes.
    fn with_upload<R>(&self, kind: Upload, host: &[u32], f: impl FnOnce(u64) -> Result<R>) -> Result<R> {
        let mut reuse = self.reuse();
        let (kept, buf) = &mut reuse.uploads[kind as usize];
        if buf.is_none() || kept.as_slice() != host {
            *buf = Some(self.stream.clone_htod(host).map_err(driver_err)?);
            kept.clear();
            kept.extend_from_slice(host);
        }
        let ptr = buf.as_ref().map_or(0, |b| self.ptr(b));
        f(ptr)
    }

    fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(len.max(1)).map_err(|e| match driver_err(e) {
            KernelError::OutOfMemory { .. } => KernelError::OutOfMemory { bytes: len * std::mem::size_of::<T>() },
            other => other,
        })
    }

    /// Launches `name` with `g` over the (already bound) argument values.
    fn launch(&self, name: &'static str, g: Geometry, args: &[&dyn Arg]) -> Result<()> {
        let f = self.func(name)?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            a.push(&mut b);
        }
        let cfg = LaunchConfig { grid_dim: g.grid, block_dim: g.block, shared_mem_bytes: g.shared_bytes };
        // SAFETY: the argument list matches the kernel's signature in kernels.cu (each call site
        // below passes its parameters in order), and the buffers were size-checked against the
        // launch by `check` before it.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(driver_err)
    }

    /// A weight's device pointer and cuBLAS type.
    fn weight_ptr(&self, w: &CudaLinear) -> (u64, blas_sys::cudaDataType) {
        use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
        match &w.data {
            Weights::F32(s) => (self.ptr(s), CUDA_R_32F),
            Weights::F16(s) => (self.ptr(s), CUDA_R_16F),
            Weights::Bf16(s) => (self.ptr(s), CUDA_R_16BF),
        }
    }

    /// Rounds `len` f32 activations at `x` to the 16-bit type `ty` into the staging buffer;
    /// returns its pointer (valid while `reuse` is held).
    fn stage(&self, reuse: &mut Reuse, x: u64, ty: blas_sys::cudaDataType, len: usize) -> Result<u64> {
        if reuse.stage.as_ref().is_none_or(|b| b.len() < len) {
            reuse.stage = Some(self.alloc::<u16>(len.next_power_of_two())?);
        }
        let dst = reuse.stage.as_ref().map_or(0, |b| self.ptr(b));
        let n64 = len as i64;
        let name = if ty == blas_sys::cudaDataType::CUDA_R_16F { "f32_to_f16_kernel" } else { "f32_to_bf16_kernel" };
        if let Some(g) = plan::elementwise(len) {
            self.launch(name, g, &[&x, &dst, &n64])?;
        }
        Ok(dst)
    }

    /// `out[m, n] (f32) = x[m, k] · w[n, k]ᵀ`, `x` and `w` both of type `ty`.
    fn gemm_raw(
        &self,
        xptr: u64,
        wptr: u64,
        ty: blas_sys::cudaDataType,
        (m, k, n): (usize, usize, usize),
        out: u64,
    ) -> Result<()> {
        use blas_sys::cudaDataType::CUDA_R_32F;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let as_int = |v: usize| i32::try_from(v).map_err(|_| check::err("linear", format!("{v} exceeds cuBLAS's int")));
        let (mi, ni, ki) = (as_int(n)?, as_int(m)?, as_int(k)?);
        let (alpha, beta) = (1f32, 0f32);
        // Column-major view: out (n x m, ld n) = w (k x n, ld k)ᵀ · x (k x m, ld k).
        // SAFETY: pointers are live device buffers of at least these sizes (checked by callers);
        // the handle is bound to this backend's stream.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                mi,
                ni,
                ki,
                &alpha as *const f32 as *const _,
                wptr as *const _,
                ty,
                ki,
                xptr as *const _,
                ty,
                ki,
                &beta as *const f32 as *const _,
                out as *mut _,
                CUDA_R_32F,
                mi,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| dev_err(format!("cuBLAS GEMM {m}x{k}x{n}: {e:?}")))
    }

    /// Device-to-device copy bandwidth over `bytes`, counting bytes read and written (GB/s): the
    /// ceiling a memory-bound kernel is held against.
    pub fn copy_bandwidth_gbps(&self, bytes: usize) -> Result<f64> {
        let (src, dst) = (self.alloc::<u8>(bytes)?, self.alloc::<u8>(bytes)?);
        let (s, d) = (self.ptr(&src), self.ptr(&dst));
        let copy = || unsafe {
            // SAFETY: two live buffers of `bytes` each.
            cudarc::driver::result::memcpy_dtod_async(d, s, bytes, self.stream.cu_stream()).map_err(driver_err)
        };
        copy()?;
        self.synchronize()?;
        let reps = 10;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            copy()?;
        }
        self.synchronize()?;
        Ok(2.0 * (bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9)
    }

    /// cuBLAS's rate (GFLOP/s) on an `n x n x n` product in this backend's GEMM type, on data
    /// that is not zero (tensor cores run faster on zeros).
    pub fn gemm_peak_gflops(&self, n: usize) -> Result<f64> {
        use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
        let host: Vec<f32> = (0..n * n).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let (a, b) = (self.upload(&host)?, self.upload(&host)?);
        let out = self.alloc::<f32>(n * n)?;
        let (ty, a16, b16) = match self.gemm {
            GemmDtype::F32 => (CUDA_R_32F, None, None),
            GemmDtype::Bf16 => {
                let bits: Vec<u16> = host.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                let up = |v: &[u16]| self.stream.clone_htod(v).map_err(driver_err);
                (CUDA_R_16BF, Some(up(&bits)?), Some(up(&bits)?))
            }
        };
        let (ap, bp) = match (&a16, &b16) {
            (Some(x), Some(y)) => (self.ptr(x), self.ptr(y)),
            _ => (self.ptr(&a), self.ptr(&b)),
        };
        let op = self.ptr(&out);
        for _ in 0..3 {
            self.gemm_raw(ap, bp, ty, (n, n, n), op)?;
        }
        self.synchronize()?;
        let reps = 10;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            self.gemm_raw(ap, bp, ty, (n, n, n), op)?;
        }
        self.synchronize()?;
        Ok(2.0 * (n * n * n * reps) as f64 / t.elapsed().as_secs_f64() / 1e9)
    }

    fn add_bias(&self, out: u64, bias: &CudaSlice<f32>, m: usize, n: usize) -> Result<()> {
        let (b, rows, n32) = (self.ptr(bias), m as i64, n as i32);
        match plan::elementwise(m * n) {
            Some(g) => self.launch("add_bias", g, &[&out, &b, &rows, &n32]),
            None => Ok(()),
        }
    }

    fn write_kv_kernel(dtype: CacheDtype) -> &'static str {
        match dtype {
            CacheDtype::F32 => "write_kv_f32",
            CacheDtype::F16 => "write_kv_f16",
            CacheDtype::Bf16 => "write_kv_bf16",
        }
    }

    /// The attention kernel for a pool type and a tile of query heads ([`plan::attention_tile`]).
    fn attention_kernel(dtype: CacheDtype, tile: usize) -> &'static str {
        const NAMES: [[&str; 4]; 3] = [
            ["paged_attention_f32_g1", "paged_attention_f32_g2", "paged_attention_f32_g4", "paged_attention_f32_g8"],
            ["paged_attention_f16_g1", "paged_attention_f16_g2", "paged_attention_f16_g4", "paged_attention_f16_g8"],
            [
                "paged_attention_bf16_g1",
                "paged_attention_bf16_g2",
                "paged_attention_bf16_g4",
                "paged_attention_bf16_g8",
            ],
        ];
        let d = match dtype {
            CacheDtype::F32 => 0,
            CacheDtype::F16 => 1,
            CacheDtype::Bf16 => 2,
        };
        NAMES[d][tile.trailing_zeros().min(3) as usize]
    }

    fn same_dtype(op: &'static str, a: &CudaKv, b: &CudaKv) -> Result<()> {
        if a.dtype != b.dtype {
            return Err(check::err(op, format!("K pool is {:?}, V pool is {:?}", a.dtype, b.dtype)));
        }
        Ok(())
    }

    fn kv_range(op: &'static str, buf: &CudaKv, off: usize, len: usize) -> Result<(usize, usize)> {
        check::range(op, "pool", buf.len, off, len)?;
        let size = buf.dtype.size_bytes();
        Ok((off * size, len * size))
    }
}

/// A kernel argument: a value the launch builder copies the address of (so it must outlive the
/// launch call, which the slices passed to [`CudaBackend::launch`] do).
trait Arg {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}

macro_rules! impl_arg {
    ($($t:ty),*) => {$(
        impl Arg for $t {
            fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
                b.arg(self);
            }
        }
    )*};
}
impl_arg!(u64, i64, i32, f32);

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    type Linear = CudaLinear;
    type KvBuf = CudaKv;

    fn name(&self) -> &'static str {
        NAME
    }

    fn alloc_zeros(&self, len: usize) -> Result<CudaSlice<f32>> {
        if len == 0 {
            return self.stream.null::<f32>().map_err(driver_err);
        }
        self.alloc(len)
    }

    fn upload(&self, host: &[f32]) -> Result<CudaSlice<f32>> {
        self.stream.clone_htod(host).map_err(driver_err)
    }

    fn download(&self, buf: &CudaSlice<f32>) -> Result<Vec<f32>> {
        let v = self.stream.clone_dtoh(buf).map_err(driver_err)?;
        self.synchronize()?;
        Ok(v)
    }

    fn len(&self, buf: &CudaSlice<f32>) -> usize {
        buf.len()
    }

    fn copy(
        &self,
        src: &CudaSlice<f32>,
        src_off: usize,
        dst: &mut CudaSlice<f32>,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        check::range("copy", "src", src.len(), src_off, len)?;
        check::range("copy", "dst", dst.len(), dst_off, len)?;
        if len == 0 {
            return Ok(());
        }
        let (s, d) = (self.ptr(src) + 4 * src_off as u64, self.ptr(dst) + 4 * dst_off as u64);
        // SAFETY: both ranges were checked against their buffers above.
        unsafe { cudarc::driver::result::memcpy_dtod_async(d, s, 4 * len, self.stream.cu_stream()) }.map_err(driver_err)
    }

    fn write(&self, dst: &mut CudaSlice<f32>, dst_off: usize, host: &[f32]) -> Result<()> {
        check::range("write", "dst", dst.len(), dst_off, host.len())?;
        if host.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut(dst_off..dst_off + host.len());
        self.stream.memcpy_htod(host, &mut view).map_err(driver_err)
    }

    /// A plain copy into pageable memory. Reading through the page-locked buffer (as KV bytes
    /// do) was tried for the logits a decode step reads back, and was slower end to end: decode
    /// at batch 128 went from 18961 to 17593 tokens/s and at batch 1 from 359 to 297 (gpu-check
    /// runs 7 and 9, BENCHMARKS.md).
    fn read(&self, src: &CudaSlice<f32>, src_off: usize, len: usize) -> Result<Vec<f32>> {
        check::range("read", "src", src.len(), src_off, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let v = self.stream.clone_dtoh(&src.slice(src_off..src_off + len)).map_err(driver_err)?;
        self.synchronize()?;
        Ok(v)
    }

    fn linear(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        m: usize,
        k: usize,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check::linear(x.len(), w.len(), bias.map(|b| b.len()), (m, k, n), out.len())?;
        // An unprepared weight is multiplied in f32 whatever the backend's GEMM type: it is
        // read where it is, not converted (only tests and tools call this).
        let (xp, wp, op) = (self.ptr(x), self.ptr(w), self.ptr(out));
        self.gemm_raw(xp, wp, blas_sys::cudaDataType::CUDA_R_32F, (m, k, n), op)?;
        if let Some(b) = bias {
            self.add_bias(op, b, m, n)?;
        }
        Ok(())
    }

    fn prepare_linear(&self, w: &[f32], n: usize, k: usize) -> Result<CudaLinear> {
        check::at_least("prepare_linear", "w", w.len(), check::mul("prepare_linear", n, k)?)?;
        let w = &w[..n * k];
        let data = match self.gemm {
            GemmDtype::F32 => Weights::F32(self.stream.clone_htod(w).map_err(driver_err)?),
            GemmDtype::Bf16 => {
                let bits: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                Weights::Bf16(self.stream.clone_htod(&bits).map_err(driver_err)?)
            }
        };
        Ok(CudaLinear { n, k, data })
    }

    fn prepare_linear_quantized(&self, w: QuantMatrix) -> Result<CudaLinear> {
        // Dequantized on the host to the backend's GEMM type: the device multiplies 16-bit or
        // f32 weights (quantized GPU kernels are future work).
        self.prepare_linear(&w.to_f32(), w.n(), w.k())
    }

    fn prepare_linear_half(&self, w: HalfMatrix) -> Result<CudaLinear> {
        use crate::half::HalfFormat;
        let (n, k) = (w.n(), w.k());
        let data = match (self.gemm, w.format()) {
            (GemmDtype::F32, _) => Weights::F32(self.stream.clone_htod(&w.to_f32()).map_err(driver_err)?),
            (GemmDtype::Bf16, HalfFormat::Bf16) => Weights::Bf16(self.stream.clone_htod(w.data()).map_err(driver_err)?),
            (GemmDtype::Bf16, HalfFormat::F16) => Weights::F16(self.stream.clone_htod(w.data()).map_err(driver_err)?),
        };
        Ok(CudaLinear { n, k, data })
    }

    fn linear_info(&self, w: &CudaLinear) -> LinearInfo {
        let format = match &w.data {
            Weights::F32(_) => "f32",
            Weights::F16(_) => "f16",
            Weights::Bf16(_) => "bf16",
        };
        LinearInfo { n: w.n, k: w.k, bytes: w.data.bytes(), format }
    }

    fn linear_prepared(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaLinear,
        bias: Option<&CudaSlice<f32>>,
        m: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.linear_prepared_many(x, &[(w, bias)], m, &mut [out])
    }

    /// One staging of `x` to 16 bits serves every weight of that type (q/k/v, gate/up).
    fn linear_prepared_many(
        &self,
        x: &CudaSlice<f32>,
        ws: &[(&CudaLinear, Option<&CudaSlice<f32>>)],
        m: usize,
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<()> {
        let shapes = ws.iter().map(|(w, bias)| ((w.n, w.k), bias.map(|b| b.len())));
        let Some(k) = check::linear_many(x.len(), shapes, m, outs.iter().map(|o| o.len()))? else { return Ok(()) };
        if m == 0 {
            return Ok(());
        }
        let xp = self.ptr(x);
        let mut reuse = self.reuse();
        let mut staged = None;
        for ((w, bias), out) in ws.iter().zip(outs.iter_mut()) {
            let (wp, ty) = self.weight_ptr(w);
            let xin = match staged {
                _ if ty == blas_sys::cudaDataType::CUDA_R_32F => xp,
                Some((t, p)) if t == ty => p,
                _ => {
                    let p = self.stage(&mut reuse, xp, ty, m * k)?;
                    staged = Some((ty, p));
                    p
                }
            };
            let op = self.ptr(out);
            self.gemm_raw(xin, wp, ty, (m, k, w.n), op)?;
            if let Some(b) = bias {
                self.add_bias(op, b, m, w.n)?;
            }
        }
        Ok(())
    }

    fn embedding_prepared(&self, w: &CudaLinear, ids: &[u32], out: &mut CudaSlice<f32>) -> Result<()> {
        let (n, k) = (w.n, w.k);
        check::embedding(n * k, ids, n, k, out.len())?;
        let Some(g) = plan::per_row(ids.len(), k)? else { return Ok(()) };
        let (name, table) = match &w.data {
            Weights::F32(s) => ("gather_f32", self.ptr(s)),
            Weights::F16(s) => ("gather_f16", self.ptr(s)),
            Weights::Bf16(s) => ("gather_bf16", self.ptr(s)),
        };
        let (dim, op) = (k as i32, self.ptr(out));
        self.with_upload(Upload::Ids, ids, |idp| self.launch(name, g, &[&table, &idp, &dim, &op]))
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check::rms_norm(x.len(), weight.len(), rows, dim, out.len())?;
        let Some(g) = plan::per_row(rows, dim)? else { return Ok(()) };
        let (xp, wp, d, op) = (self.ptr(x), self.ptr(weight), dim as i32, self.ptr(out));
        self.launch("rms_norm", g, &[&xp, &wp, &eps, &d, &op])
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[u32],
        num_heads: usize,
        head_dim: usize,
        cos_sin: &CudaSlice<f32>,
    ) -> Result<()> {
        check::rope(x.len(), positions, num_heads, head_dim, cos_sin.len())?;
        let Some(g) = plan::per_row(positions.len(), num_heads * head_dim / 2)? else { return Ok(()) };
        let (xp, nh, hd, cs) = (self.ptr(x), num_heads as i32, head_dim as i32, self.ptr(cos_sin));
        self.with_upload(Upload::Positions, positions, |pp| self.launch("rope", g, &[&xp, &pp, &nh, &hd, &cs]))
    }

    fn silu_mul(&self, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, len: usize, out: &mut CudaSlice<f32>) -> Result<()> {
        check::silu_mul(gate.len(), up.len(), len, out.len())?;
        let Some(g) = plan::elementwise(len) else { return Ok(()) };
        let (gp, up, op, n) = (self.ptr(gate), self.ptr(up), self.ptr(out), len as i64);
        self.launch("silu_mul", g, &[&gp, &up, &op, &n])
    }

    fn add_assign(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, len: usize) -> Result<()> {
        check::add_assign(x.len(), y.len(), len)?;
        let Some(g) = plan::elementwise(len) else { return Ok(()) };
        let (xp, yp, n) = (self.ptr(x), self.ptr(y), len as i64);
        self.launch("add_assign", g, &[&xp, &yp, &n])
    }

    fn softmax(&self, x: &mut CudaSlice<f32>, rows: usize, dim: usize) -> Result<()> {
        check::softmax(x.len(), rows, dim)?;
        let Some(g) = plan::per_row(rows, dim)? else { return Ok(()) };
        let (xp, d) = (self.ptr(x), dim as i32);
        self.launch("softmax", g, &[&xp, &d])
    }

    fn embedding(
        &self,
        table: &CudaSlice<f32>,
        ids: &[u32],
        vocab: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check::embedding(table.len(), ids, vocab, dim, out.len())?;
        let Some(g) = plan::per_row(ids.len(), dim)? else { return Ok(()) };
        let (tp, d, op) = (self.ptr(table), dim as i32, self.ptr(out));
        self.with_upload(Upload::Ids, ids, |ip| self.launch("gather_f32", g, &[&tp, &ip, &d, &op]))
    }

    fn gather_rows(&self, x: &CudaSlice<f32>, rows: &[u32], dim: usize, out: &mut CudaSlice<f32>) -> Result<()> {
        check::gather_rows(x.len(), rows, dim, out.len())?;
        let Some(g) = plan::per_row(rows.len(), dim)? else { return Ok(()) };
        let (tp, d, op) = (self.ptr(x), dim as i32, self.ptr(out));
        self.with_upload(Upload::Ids, rows, |ip| self.launch("gather_f32", g, &[&tp, &ip, &d, &op]))
    }

    fn alloc_kv(&self, dtype: CacheDtype, len: usize) -> Result<CudaKv> {
        let bytes = check::mul("alloc_kv", len, dtype.size_bytes())?;
        let data = self.alloc::<u8>(bytes)?;
        Ok(CudaKv { dtype, len, data })
    }

    fn kv_info(&self, buf: &CudaKv) -> (CacheDtype, usize) {
        (buf.dtype, buf.len)
    }

    /// Device memory holds the pools: none of it is host memory.
    fn kv_resident_bytes(&self, _buf: &CudaKv) -> usize {
        0
    }

    fn read_kv_bytes(&self, src: &CudaKv, off: usize, len: usize, out: &mut Vec<u8>) -> Result<()> {
        let (start, bytes) = Self::kv_range("read_kv_bytes", src, off, len)?;
        if bytes == 0 {
            return Ok(());
        }
        let mut reuse = self.reuse();
        let staging = self.pinned(&mut reuse, bytes)?;
        self.stream.memcpy_dtoh(&src.data.slice(start..start + bytes), staging).map_err(driver_err)?;
        self.synchronize()?;
        out.extend_from_slice(staging);
        Ok(())
    }

    fn write_kv_bytes(&self, dst: &mut CudaKv, off: usize, bytes: &[u8]) -> Result<()> {
        let size = dst.dtype.size_bytes();
        if !bytes.len().is_multiple_of(size) {
            return Err(check::err(
                "write_kv_bytes",
                format!("{} bytes is not a whole number of {size}-byte elements", bytes.len()),
            ));
        }
        let (start, n) = Self::kv_range("write_kv_bytes", dst, off, bytes.len() / size)?;
        if n == 0 {
            return Ok(());
        }
        let mut reuse = self.reuse();
        let staging = self.pinned(&mut reuse, n)?;
        staging.copy_from_slice(bytes);
        let mut view = dst.data.slice_mut(start..start + n);
        self.stream.memcpy_htod(&*staging, &mut view).map_err(driver_err)?;
        // The copy from page-locked memory is asynchronous: the buffer is not reused before it
        // has landed.
        self.synchronize()
    }

    fn copy_kv(&self, buf: &mut CudaKv, src_off: usize, dst_off: usize, len: usize) -> Result<()> {
        let (s, n) = Self::kv_range("copy_kv", buf, src_off, len)?;
        let (d, _) = Self::kv_range("copy_kv", buf, dst_off, len)?;
        if s < d + n && d < s + n && n > 0 {
            return Err(check::err("copy_kv", format!("ranges at {src_off} and {dst_off} of {len} overlap")));
        }
        if n == 0 {
            return Ok(());
        }
        let base = self.ptr(&buf.data);
        // SAFETY: both ranges lie inside the pool (checked above) and do not overlap.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(base + d as u64, base + s as u64, n, self.stream.cu_stream())
        }
        .map_err(driver_err)
    }

    fn write_kv(
        &self,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &[u32],
        kv_width: usize,
        k_cache: &mut CudaKv,
        v_cache: &mut CudaKv,
    ) -> Result<()> {
        const OP: &str = "write_kv";
        Self::same_dtype(OP, k_cache, v_cache)?;
        check::write_kv(k.len(), v.len(), slots, kv_width, k_cache.len, v_cache.len)?;
        let Some(g) = plan::per_row(slots.len(), kv_width)? else { return Ok(()) };
        let (kp, vp, w) = (self.ptr(k), self.ptr(v), kv_width as i32);
        let (kc, vc) = (self.ptr(&k_cache.data), self.ptr(&v_cache.data));
        let name = Self::write_kv_kernel(k_cache.dtype);
        self.with_upload(Upload::Slots, slots, |sp| self.launch(name, g, &[&kp, &vp, &sp, &w, &kc, &vc]))
    }

    fn paged_attention(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaKv,
        v_cache: &CudaKv,
        seqs: &[AttnSeq<'_>],
        shape: AttnShape,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        const OP: &str = "paged_attention";
        Self::same_dtype(OP, k_cache, v_cache)?;
        check::paged_attention(q.len(), k_cache.len, v_cache.len, seqs, &shape, out.len())?;
        let (meta, num_tokens) = plan::pack_attention(seqs, shape.block_size);
        let Some(g) = plan::attention(num_tokens, &shape)? else { return Ok(()) };
        let (qp, kc, vc, op) = (self.ptr(q), self.ptr(&k_cache.data), self.ptr(&v_cache.data), self.ptr(out));
        let (nt, nh, nkv, hd, bs) = (
            num_tokens as i32,
            shape.num_heads as i32,
            shape.num_kv_heads as i32,
            shape.head_dim as i32,
            shape.block_size as i32,
        );
        let scale = shape.scale;
        let tile = plan::attention_tile(shape.num_heads / shape.num_kv_heads);
        let name = Self::attention_kernel(k_cache.dtype, tile);
        self.with_upload(Upload::AttnMeta, &meta, |mp| {
            self.launch(name, g, &[&qp, &kc, &vc, &mp, &nt, &nh, &nkv, &hd, &bs, &scale, &op])
        })
    }
}
