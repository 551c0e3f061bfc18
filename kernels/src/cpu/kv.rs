//! The CPU's KV cache pools ([`KvPool`]: [`Pages`] of f32, f16 or bf16) and the element trait
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
    F32(Pages<f32>),
    F16(Pages<f16>),
    Bf16(Pages<bf16>),
}

/// A pool holding `v` (tests and tools; the engine's pools come from `Backend::alloc_kv`, which
/// reports a refused mapping as an error).
///
/// # Panics
/// If the OS refuses a mapping of `v`'s size.
impl From<Vec<f32>> for KvPool {
    fn from(v: Vec<f32>) -> Self {
        let mut pages = Pages::zeroed(v.len()).expect("a pool of the vector's size");
        pages.copy_from_slice(&v);
        KvPool::F32(pages)
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

    /// Bytes of the pool resident in memory now ([`Pages::resident_bytes`]).
    pub fn resident_bytes(&self) -> usize {
        match self {
            KvPool::F32(v) => v.resident_bytes(),
            KvPool::F16(v) => v.resident_bytes(),
            KvPool::Bf16(v) => v.resident_bytes(),
        }
    }

    /// Elements `off..off + len` widened to f32 (for tests and tools; attention reads in place).
    pub fn to_f32(&self, off: usize, len: usize) -> Result<Vec<f32>> {
        crate::check::range("kv_to_f32", "src", self.len(), off, len)?;
        let mut out = vec![0f32; len];
        match self {
            KvPool::F32(v) => out.copy_from_slice(&v[off..off + len]),
            KvPool::F16(v) => f16::decode(Isa::Portable, &v[off..off + len], &mut out),
            KvPool::Bf16(v) => bf16::decode(Isa::Portable, &v[off..off + len], &mut out),
        }
        Ok(out)
    }
}

/// Element types whose all-zero bits are a valid value (0.0), so that fresh zero pages hold
/// initialised elements.
///
/// # Safety
/// Implement only for plain-data types of which every bit pattern, zero included, is valid.
pub unsafe trait ZeroBits: Copy + 'static {}
// SAFETY: IEEE floats: every bit pattern is a value, zero is 0.0.
unsafe impl ZeroBits for f32 {}
// SAFETY: as f32.
unsafe impl ZeroBits for f16 {}
// SAFETY: as f32.
unsafe impl ZeroBits for bf16 {}

/// `len` elements in an anonymous private mapping of their own: zero pages that the kernel
/// provides when first touched, so a pool costs resident memory only for the blocks that have
/// been used (the engine's block pool hands out the lowest fresh blocks first and reuses freed
/// ones before them; with prefix caching, released blocks stay cached until the pool is full, so
/// a busy node does end up holding its whole reservation), whatever `--kv-cache-memory`
/// reserved. A `Vec` from the allocator did not guarantee that: after a
/// model load freed its temporaries, glibc served the pools from its heap and zeroed them
/// there, and `cleave generate` on SmolLM2 sat at 1.15 GB resident for a 1 GiB cache it used
/// a few blocks of.
pub struct Pages<T: ZeroBits> {
    /// `None` for an empty pool (a mapping cannot be empty).
    map: Option<memmap2::MmapMut>,
    len: usize,
    _elem: std::marker::PhantomData<T>,
}

impl<T: ZeroBits> Pages<T> {
    /// `len` zero elements.
    pub fn zeroed(len: usize) -> Result<Self> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or(KernelError::OutOfMemory { bytes: usize::MAX })?;
        let map = match bytes {
            0 => None,
            _ => Some(memmap2::MmapMut::map_anon(bytes).map_err(|_| KernelError::OutOfMemory { bytes })?),
        };
        Ok(Pages { map, len, _elem: std::marker::PhantomData })
    }

    /// Bytes of the pool that are resident in memory now (whole pages the kernel has backed:
    /// touched since the mapping was made). Where the OS cannot say, the pool's whole size.
    ///
    /// One `mincore` call over the mapping: a page-table walk and a byte of answer per 4 KiB page.
    /// Over SmolLM2's 60 pools of a 1 GiB cache, half written, it took 0.9 ms: too slow to run
    /// between engine steps for every load report of a large cache, so the engine counts the
    /// blocks it has used instead, and its tests check the count against this.
    pub fn resident_bytes(&self) -> usize {
        let Some(map) = &self.map else { return 0 };
        #[cfg(target_os = "linux")]
        {
            // SAFETY: sysconf has no preconditions.
            let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
            let mut vec = vec![0u8; map.len().div_ceil(page)];
            // SAFETY: the range is this mapping (page-aligned start, its own length), and `vec`
            // holds one byte per page of it, as mincore(2) requires.
            let rc = unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, map.len(), vec.as_mut_ptr()) };
            if rc == 0 {
                return (vec.iter().filter(|&&b| b & 1 != 0).count() * page).min(map.len());
            }
        }
        map.len()
    }
}

impl<T: ZeroBits> std::ops::Deref for Pages<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.map {
            // SAFETY: the map holds `len * size_of::<T>()` bytes, page-aligned (so aligned for
            // `T`), initialised (zero pages or values written through `deref_mut`), and every
            // bit pattern is a valid `T` (`ZeroBits`); the borrow ties the slice to `self`.
            Some(m) => unsafe { std::slice::from_raw_parts(m.as_ptr() as *const T, self.len) },
            None => &[],
        }
    }
}

impl<T: ZeroBits> std::ops::DerefMut for Pages<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.map {
            // SAFETY: as in `deref`, with the unique borrow of `self`.
            Some(m) => unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr() as *mut T, self.len) },
            None => &mut [],
        }
    }
}

/// # Panics
/// If the OS refuses a mapping for the copy (nothing in the engine clones a pool).
impl<T: ZeroBits> Clone for Pages<T> {
    fn clone(&self) -> Self {
        let mut copy = Pages::zeroed(self.len).expect("memory for a copy of a KV pool");
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: ZeroBits + PartialEq> PartialEq for Pages<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: ZeroBits> std::fmt::Debug for Pages<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pages").field("len", &self.len).finish()
    }
}

pub(super) fn alloc(dtype: CacheDtype, len: usize) -> Result<KvPool> {
    Ok(match dtype {
        CacheDtype::F32 => KvPool::F32(Pages::zeroed(len)?),
        CacheDtype::F16 => KvPool::F16(Pages::zeroed(len)?),
        CacheDtype::Bf16 => KvPool::Bf16(Pages::zeroed(len)?),
    })
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
    crate::check::range("read_kv_bytes", "src", src.len(), off, len)?;
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
    crate::check::range("write_kv_bytes", "dst", dst.len(), off, n)?;
    with_pool!(dst, v => KvElem::get_bytes(bytes, &mut v[off..off + n]));
    Ok(())
}

pub(super) fn copy_within(buf: &mut KvPool, src_off: usize, dst_off: usize, len: usize) -> Result<()> {
    const OP: &str = "copy_kv";
    crate::check::range(OP, "src", buf.len(), src_off, len)?;
    crate::check::range(OP, "dst", buf.len(), dst_off, len)?;
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

#[cfg(test)]
mod pages_tests {
    use super::*;

    /// Resident bytes of this process (Linux: `/proc/self/statm`, in pages).
    #[cfg(target_os = "linux")]
    fn resident() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        statm.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * 4096
    }

    /// A reserved pool is not resident until its elements are written: 768 MiB reserved in
    /// pools of a layer's size (16 MiB) and one large one costs (far) less than 64 MiB, and
    /// writing 8 MiB makes those pages resident. Other tests
    /// of this process allocate at the same time, hence the wide margins; a pool zeroed through
    /// the heap would add what the heap served of it.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_reserved_pool_costs_nothing_until_used() {
        // As after a model load: a large buffer freed raises glibc's threshold for serving
        // allocations from its own heap, where zeroed memory is written.
        let temp = vec![1u8; 40 << 20];
        drop(std::hint::black_box(temp));
        let before = resident();
        let layers: Vec<KvPool> = (0..16).map(|_| alloc(CacheDtype::F32, 4 << 20).unwrap()).collect();
        let mut pool = alloc(CacheDtype::F32, 128 << 20).unwrap();
        let reserved = resident();
        assert_eq!(pool.resident_bytes(), 0, "nothing of a fresh pool is resident");
        assert!(reserved < before + (64 << 20), "reserving 768 MiB made {} MiB resident", (reserved - before) >> 20);
        drop(layers);
        let KvPool::F32(v) = &mut pool else { panic!("an f32 pool") };
        assert!(v[..1 << 20].iter().all(|&x| x == 0.0) && v.len() == 128 << 20);
        v[..2 << 20].fill(1.5);
        assert!(resident() >= reserved + (6 << 20), "8 MiB written: resident {} MiB", resident() >> 20);
        // Written pages, plus the zero pages the read above mapped (and a huge page's rounding
        // where the kernel backs the map with them).
        let said = pool.resident_bytes();
        assert!((8 << 20..=16 << 20).contains(&said), "8 MiB written: the pool says {said} bytes are resident");
        assert_eq!(pool.to_f32(0, 3).unwrap(), vec![1.5; 3]);
        assert_eq!(pool.clone(), pool, "a clone holds the same elements");
        assert!(alloc(CacheDtype::Bf16, 0).unwrap().is_empty());
    }
}
