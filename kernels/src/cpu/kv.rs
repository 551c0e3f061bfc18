//! The CPU's KV cache pools ([`KvPool`]: a `Vec` of f32, f16 or bf16) and the element trait
//! ([`KvElem`]) through which the attention kernels read any of them: the same kernel code runs
//! on every element type, with keys and values widened to f32 in registers as they are loaded
//! ([`super::simd_half`] for the 16-bit types).
//!
//! Invariant: `KvElem::encode` rounds to nearest, ties to even, exactly as
//! [`crate::reference::kv_round`] does, on every ISA.

use half::{bf16, f16};

use super::simd::{self, Isa};
use super::simd_half;
use crate::{check, CacheDtype, KernelError, Result};

/// One layer's K (or V) cache pool on the CPU.
#[derive(Debug, Clone, PartialEq)]
pub enum KvPool {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl From<Vec<f32>> for KvPool {
    fn from(v: Vec<f32>) -> Self {
        KvPool::F32(v)
    }
}

impl KvPool {
    pub fn dtype(&self) -> CacheDtype {
        match self {
            KvPool::F32(_) => CacheDtype::F32,
            KvPool::F16(_) => CacheDtype::F16,
            KvPool::Bf16(_) => CacheDtype::Bf16,
        }
    }

    /// Elements (not bytes).
    pub fn len(&self) -> usize {
        match self {
            KvPool::F32(v) => v.len(),
            KvPool::F16(v) => v.len(),
            KvPool::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `off..off + len` widened to f32 (for tests and tools; attention reads in place).
    pub fn to_f32(&self, off: usize, len: usize) -> Result<Vec<f32>> {
        super::range_check("kv_to_f32", "src", self.len(), off, len)?;
        let mut out = vec![0f32; len];
        match self {
            KvPool::F32(v) => out.copy_from_slice(&v[off..off + len]),
            KvPool::F16(v) => f16::decode(Isa::Portable, &v[off..off + len], &mut out),
            KvPool::Bf16(v) => bf16::decode(Isa::Portable, &v[off..off + len], &mut out),
        }
        Ok(out)
    }
}

/// A zeroed `Vec` of `len` elements from the allocator's zeroed pages (a cache of gigabytes costs
/// nothing until it is used).
///
/// # Safety
/// All-zero bits must be a valid `T` (true of f32, f16 and bf16: 0.0).
unsafe fn zeroed_vec<T>(len: usize) -> Result<Vec<T>> {
    let oom = || KernelError::OutOfMemory { bytes: len.saturating_mul(std::mem::size_of::<T>()) };
    if len == 0 || std::mem::size_of::<T>() == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(len).map_err(|_| oom())?;
    // SAFETY: `layout` has non-zero size; a null return is handled; the caller vouches that zero
    // bits are a valid `T`, so the `len` elements are initialised; the pointer comes from the
    // global allocator with exactly this layout, as `Vec::from_raw_parts` requires.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut T;
        if ptr.is_null() {
            return Err(oom());
        }
        Ok(Vec::from_raw_parts(ptr, len, len))
    }
}

pub(super) fn alloc(dtype: CacheDtype, len: usize) -> Result<KvPool> {
    // SAFETY: zero bits are 0.0 in each of the three types.
    unsafe {
        Ok(match dtype {
            CacheDtype::F32 => KvPool::F32(zeroed_vec(len)?),
            CacheDtype::F16 => KvPool::F16(zeroed_vec(len)?),
            CacheDtype::Bf16 => KvPool::Bf16(zeroed_vec(len)?),
        })
    }
}

/// An element type of a KV pool, as the kernels see it.
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
    /// `dst[i] = round(src[i])` (to nearest, ties to even; exact for f32).
    fn encode(isa: Isa, src: &[f32], dst: &mut [Self]);
    /// `dst[i] = src[i]` as f32 (exact).
    fn decode(isa: Isa, src: &[Self], dst: &mut [f32]);
    /// `out[j] = q · keys[j]`.
    fn dot_keys(isa: Isa, q: &[f32], keys: &[&[Self]], out: &mut [f32]);
    /// `out[r] += Σ_j p[r, j] · vals[j]` (see [`simd::accumulate_rows`]).
    fn accumulate_rows(isa: Isa, p: &[f32], p_stride: usize, rows: usize, vals: &[&[Self]], out: &mut [f32], d: usize);
    /// Little-endian bytes of `src`, appended to `out`.
    fn put_bytes(src: &[Self], out: &mut Vec<u8>);
    /// `dst[i]` from little-endian bytes (`bytes.len() == dst.len() * size`).
    fn get_bytes(bytes: &[u8], dst: &mut [Self]);
}

impl KvElem for f32 {
    fn encode(_: Isa, src: &[f32], dst: &mut [f32]) {
        dst[..src.len()].copy_from_slice(src);
    }
    fn decode(_: Isa, src: &[f32], dst: &mut [f32]) {
        dst[..src.len()].copy_from_slice(src);
    }
    fn dot_keys(isa: Isa, q: &[f32], keys: &[&[f32]], out: &mut [f32]) {
        simd::dot_keys(isa, q, keys, out)
    }
    fn accumulate_rows(isa: Isa, p: &[f32], p_stride: usize, rows: usize, vals: &[&[f32]], out: &mut [f32], d: usize) {
        simd::accumulate_rows(isa, p, p_stride, rows, vals, out, d)
    }
    fn put_bytes(src: &[f32], out: &mut Vec<u8>) {
        out.reserve(src.len() * 4);
        src.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
    }
    fn get_bytes(bytes: &[u8], dst: &mut [f32]) {
        for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
            *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
}

/// The raw bits of a 16-bit slice. `f16` and `bf16` are `#[repr(transparent)]` over `u16`.
fn bits<T: half::slice::HalfFloatSliceExt + ?Sized>(s: &T) -> &[u16] {
    s.reinterpret_cast()
}

fn bits_mut<T: half::slice::HalfFloatSliceExt + ?Sized>(s: &mut T) -> &mut [u16] {
    s.reinterpret_cast_mut()
}

/// The raw bits of each of a list of 16-bit slices (attention's keys or values).
fn bits_list<'a, T>(s: &[&'a [T]]) -> Vec<&'a [u16]>
where
    [T]: half::slice::HalfFloatSliceExt,
{
    s.iter().map(|x| bits(*x)).collect()
}

macro_rules! half_elem {
    ($t:ty, $bf:literal) => {
        impl KvElem for $t {
            fn encode(isa: Isa, src: &[f32], dst: &mut [$t]) {
                simd_half::from_f32::<$bf>(isa, src, bits_mut(dst))
            }
            fn decode(isa: Isa, src: &[$t], dst: &mut [f32]) {
                simd_half::to_f32::<$bf>(isa, bits(src), dst)
            }
            fn dot_keys(isa: Isa, q: &[f32], keys: &[&[$t]], out: &mut [f32]) {
                simd_half::dot_keys::<$bf>(isa, q, &bits_list(keys), out)
            }
            fn accumulate_rows(
                isa: Isa,
                p: &[f32],
                p_stride: usize,
                rows: usize,
                vals: &[&[$t]],
                out: &mut [f32],
                d: usize,
            ) {
                simd_half::accumulate_rows::<$bf>(isa, p, p_stride, rows, &bits_list(vals), out, d)
            }
            fn put_bytes(src: &[$t], out: &mut Vec<u8>) {
                out.reserve(src.len() * 2);
                bits(src).iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
            }
            fn get_bytes(bytes: &[u8], dst: &mut [$t]) {
                for (d, b) in bits_mut(dst).iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = u16::from_le_bytes([b[0], b[1]]);
                }
            }
        }
    };
}

half_elem!(f16, false);
half_elem!(bf16, true);

/// Runs `$body` with `$v` bound to the pool's slice, whatever its element type.
macro_rules! with_pool {
    ($pool:expr, $v:ident => $body:expr) => {
        match $pool {
            KvPool::F32($v) => $body,
            KvPool::F16($v) => $body,
            KvPool::Bf16($v) => $body,
        }
    };
}

pub(super) fn read_bytes(src: &KvPool, off: usize, len: usize, out: &mut Vec<u8>) -> Result<()> {
    super::range_check("read_kv_bytes", "src", src.len(), off, len)?;
    with_pool!(src, v => KvElem::put_bytes(&v[off..off + len], out));
    Ok(())
}

pub(super) fn write_bytes(dst: &mut KvPool, off: usize, bytes: &[u8]) -> Result<()> {
    let size = dst.dtype().size_bytes();
    if !bytes.len().is_multiple_of(size) {
        return Err(check::err(
            "write_kv_bytes",
            format!("{} bytes are not a whole number of {} elements", bytes.len(), dst.dtype().name()),
        ));
    }
    let n = bytes.len() / size;
    super::range_check("write_kv_bytes", "dst", dst.len(), off, n)?;
    with_pool!(dst, v => KvElem::get_bytes(bytes, &mut v[off..off + n]));
    Ok(())
}

pub(super) fn copy_within(buf: &mut KvPool, src_off: usize, dst_off: usize, len: usize) -> Result<()> {
    const OP: &str = "copy_kv";
    super::range_check(OP, "src", buf.len(), src_off, len)?;
    super::range_check(OP, "dst", buf.len(), dst_off, len)?;
    if src_off < dst_off + len && dst_off < src_off + len && len > 0 {
        return Err(check::err(OP, format!("ranges {src_off}+{len} and {dst_off}+{len} overlap")));
    }
    with_pool!(buf, v => v.copy_within(src_off..src_off + len, dst_off));
    Ok(())
}

/// Both pools' element type, or a shape error when they differ.
pub(super) fn same_dtype(op: &'static str, k: &KvPool, v: &KvPool) -> Result<CacheDtype> {
    if k.dtype() != v.dtype() {
        return Err(check::err(op, format!("k pool is {}, v pool is {}", k.dtype().name(), v.dtype().name())));
    }
    Ok(k.dtype())
}

/// [`crate::Backend::write_kv`] after validation: token `t`'s rows encoded into slot `slots[t]`.
pub(super) fn write_rows<E: KvElem>(
    isa: Isa,
    (k, v): (&[f32], &[f32]),
    slots: &[u32],
    kv_width: usize,
    k_cache: &mut [E],
    v_cache: &mut [E],
) {
    // Scattered writes of a few KiB per token: serial, memory-bound already.
    for (t, &s) in slots.iter().enumerate() {
        let (src, dst) = (t * kv_width..(t + 1) * kv_width, s as usize * kv_width..(s as usize + 1) * kv_width);
        E::encode(isa, &k[src.clone()], &mut k_cache[dst.clone()]);
        E::encode(isa, &v[src], &mut v_cache[dst]);
    }
}
