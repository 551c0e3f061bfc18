//! The CUDA backend against the naive reference, op by op (feature `cuda`).
//!
//! - `kernels_compile_to_ptx` needs only NVRTC (no driver, no GPU): CI installs it from PyPI and
//!   sets CLEAVE_REQUIRE_NVRTC, so a kernel that does not compile fails CI.
//! - Every other test needs a GPU. Without one it says so and passes, unless
//!   CLEAVE_REQUIRE_GPU is set (scripts/gpu-check sets it), when it fails.
#![cfg(feature = "cuda")]

mod common;

use cleave_kernels::cuda::{self, CudaBackend, GemmDtype};
use cleave_kernels::{reference, AttnSeq, AttnShape, Backend, CacheDtype, HalfFormat, HalfMatrix, KernelError};
use common::{assert_close, Rng};

fn required(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| !v.is_empty() && v != "0")
}

fn gpu(gemm: GemmDtype) -> Option<CudaBackend> {
    match CudaBackend::new(0, gemm) {
        Ok(b) => Some(b),
        Err(e) if required("CLEAVE_REQUIRE_GPU") => {
            panic!("CLEAVE_REQUIRE_GPU is set but the CUDA backend failed: {e}")
        }
        Err(e) => {
            eprintln!("skipped: no usable GPU ({e})");
            None
        }
    }
}

#[test]
fn kernels_compile_to_ptx() {
    if !cuda::nvrtc_present() {
        assert!(!required("CLEAVE_REQUIRE_NVRTC"), "CLEAVE_REQUIRE_NVRTC is set but libnvrtc.so was not found");
        eprintln!("skipped: NVRTC not found (pip install nvidia-cuda-nvrtc; put its lib folder on LD_LIBRARY_PATH)");
        return;
    }
    // The default architecture, Ampere and Hopper (the H200s the device checks run on).
    for cc in [None, Some((8, 0)), Some((9, 0))] {
        let ptx = cuda::compile_kernels(cc).unwrap_or_else(|e| panic!("compiling for {cc:?}: {e}"));
        for name in cuda::KERNEL_NAMES {
            assert!(ptx.contains(&format!(".entry {name}(")), "{cc:?}: kernel {name} missing from the PTX");
        }
    }
}

#[test]
fn without_a_driver_the_backend_says_so_instead_of_panicking() {
    if cuda::driver_present() {
        return;
    }
    let err = CudaBackend::new(0, GemmDtype::F32).unwrap_err();
    assert!(matches!(err, KernelError::Device { .. }), "{err}");
    assert!(err.to_string().contains("no CUDA driver"), "{err}");
}

#[test]
fn buffers_round_trip_and_copy() {
    let Some(b) = gpu(GemmDtype::F32) else { return };
    let host: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let mut buf = b.upload(&host).unwrap();
    assert_eq!(b.len(&buf), 1000);
    assert_eq!(b.download(&buf).unwrap(), host);
    b.write(&mut buf, 10, &[-1.0, -2.0]).unwrap();
    assert_eq!(b.read(&buf, 9, 4).unwrap(), vec![4.5, -1.0, -2.0, 6.0]);
    let mut dst = b.alloc_zeros(20).unwrap();
    b.copy(&buf, 100, &mut dst, 5, 10).unwrap();
    let got = b.download(&dst).unwrap();
    assert_eq!(&got[5..15], &host[100..110]);
    assert!(got[..5].iter().chain(&got[15..]).all(|&v| v == 0.0));
    assert_eq!(b.len(&b.alloc_zeros(0).unwrap()), 0);
    assert!(matches!(b.read(&buf, 999, 2), Err(KernelError::Shape { .. })));
    assert!(matches!(b.copy(&buf, 0, &mut dst, 15, 6), Err(KernelError::Shape { .. })));
}

#[test]
fn linear_matches_reference_in_f32_and_within_bf16_rounding() {
    for gemm in [GemmDtype::F32, GemmDtype::Bf16] {
        let Some(b) = gpu(gemm) else { return };
        let mut rng = Rng::new(1);
        for (m, k, n) in [(1, 64, 32), (3, 576, 1536), (17, 200, 3), (70, 1536, 576), (256, 64, 172)] {
            let (x, w, bias) = (rng.vec(m * k), rng.vec(n * k), rng.vec(n));
            let mut want = vec![0f32; m * n];
            reference::linear(&x, &w, Some(&bias), m, k, n, &mut want).unwrap();
            let lin = b.prepare_linear(&w, n, k).unwrap();
            let (xb, bb) = (b.upload(&x).unwrap(), b.upload(&bias).unwrap());
            let mut out = b.alloc_zeros(m * n + 7).unwrap();
            b.linear_prepared(&xb, &lin, Some(&bb), m, &mut out).unwrap();
            let got = b.read(&out, 0, m * n).unwrap();
            // bf16 keeps 8 bits of mantissa of each factor: a sum of k products of [-1, 1]
            // values is off by about sqrt(k) * 2^-8.
            let tol = match gemm {
                GemmDtype::F32 => 1e-4 * (k as f32).sqrt(),
                GemmDtype::Bf16 => 8e-3 * (k as f32).sqrt(),
            };
            assert_close(&got, &want, tol, 1e-3, &format!("{gemm:?} linear {m}x{k}x{n}"));
            assert!(b.download(&out).unwrap()[m * n..].iter().all(|&v| v == 0.0), "wrote past m*n");
            // The unprepared path, and several weights on one x.
            let mut out2 = b.alloc_zeros(m * n).unwrap();
            let wb = b.upload(&w).unwrap();
            b.linear(&xb, &wb, Some(&bb), m, k, n, &mut out2).unwrap();
            assert_close(&b.download(&out2).unwrap(), &want, 1e-4 * (k as f32).sqrt(), 1e-3, "unprepared linear");
        }
        // 16-bit weights: the products of the widened weights.
        let (m, k, n) = (5, 128, 96);
        for format in [HalfFormat::Bf16, HalfFormat::F16] {
            let (x, w) = (rng.vec(m * k), rng.vec(n * k));
            let hm = HalfMatrix::from_f32(format, &w, n, k).unwrap();
            let mut want = vec![0f32; m * n];
            reference::linear(&x, &hm.to_f32(), None, m, k, n, &mut want).unwrap();
            let info = b.linear_info(&b.prepare_linear_half(hm.clone()).unwrap());
            assert_eq!((info.n, info.k), (n, k));
            let lin = b.prepare_linear_half(hm).unwrap();
            let xb = b.upload(&x).unwrap();
            let mut out = b.alloc_zeros(m * n).unwrap();
            b.linear_prepared(&xb, &lin, None, m, &mut out).unwrap();
            let tol = if gemm == GemmDtype::F32 { 1e-4 } else { 8e-3 } * (k as f32).sqrt();
            assert_close(&b.download(&out).unwrap(), &want, tol, 1e-3, &format!("{gemm:?} {format:?} weights"));
        }
    }
}

#[test]
fn row_and_elementwise_ops_match_reference() {
    let Some(b) = gpu(GemmDtype::F32) else { return };
    let mut rng = Rng::new(2);
    for (rows, dim) in [(1, 64), (7, 576), (3, 1), (33, 4097)] {
        let (x, w) = (rng.vec(rows * dim), rng.vec(dim));
        let mut want = vec![0f32; rows * dim];
        reference::rms_norm(&x, &w, 1e-5, rows, dim, &mut want).unwrap();
        let (xb, wb) = (b.upload(&x).unwrap(), b.upload(&w).unwrap());
        let mut out = b.alloc_zeros(rows * dim).unwrap();
        b.rms_norm(&xb, &wb, 1e-5, rows, dim, &mut out).unwrap();
        assert_close(&b.download(&out).unwrap(), &want, 1e-6, 1e-5, &format!("rms_norm {rows}x{dim}"));

        let mut want = x.iter().map(|v| v * 8.0).collect::<Vec<_>>();
        let mut xb = b.upload(&want).unwrap();
        reference::softmax(&mut want, rows, dim).unwrap();
        b.softmax(&mut xb, rows, dim).unwrap();
        assert_close(&b.download(&xb).unwrap(), &want, 1e-7, 1e-5, &format!("softmax {rows}x{dim}"));
    }
    let n = 100_003;
    let (g, u, y) = (rng.vec(n).iter().map(|v| v * 12.0).collect::<Vec<_>>(), rng.vec(n), rng.vec(n));
    let mut want = vec![0f32; n];
    reference::silu_mul(&g, &u, n, &mut want).unwrap();
    let (gb, ub) = (b.upload(&g).unwrap(), b.upload(&u).unwrap());
    let mut out = b.alloc_zeros(n).unwrap();
    b.silu_mul(&gb, &ub, n, &mut out).unwrap();
    assert_close(&b.download(&out).unwrap(), &want, 1e-6, 1e-5, "silu_mul");
    let mut sum = g.clone();
    reference::add_assign(&mut sum, &y, n - 3).unwrap();
    let mut gb = b.upload(&g).unwrap();
    b.add_assign(&mut gb, &b.upload(&y).unwrap(), n - 3).unwrap();
    assert_eq!(b.download(&gb).unwrap(), sum, "add_assign is exact and stops at len");
}

#[test]
fn rope_is_bit_identical_to_reference() {
    let Some(b) = gpu(GemmDtype::F32) else { return };
    let mut rng = Rng::new(3);
    let (heads, hd, max_pos) = (9, 64, 300);
    let inv = cleave_kernels::rope_inv_freq(hd, 10000.0, &cleave_kernels::RopeScaling::None);
    let table = cleave_kernels::rope_table(&inv, max_pos);
    let positions: Vec<u32> = vec![0, 1, 299, 17, 17, 128];
    let x = rng.vec(positions.len() * heads * hd);
    let mut want = x.clone();
    reference::rope(&mut want, &positions, heads, hd, &table).unwrap();
    let (mut xb, tb) = (b.upload(&x).unwrap(), b.upload(&table).unwrap());
    b.rope(&mut xb, &positions, heads, hd, &tb).unwrap();
    assert_eq!(b.download(&xb).unwrap(), want);
    assert!(matches!(b.rope(&mut xb, &[300], heads, hd, &tb), Err(KernelError::Shape { .. })));
}

#[test]
fn gathers_and_prepared_embeddings_match_reference() {
    for gemm in [GemmDtype::F32, GemmDtype::Bf16] {
        let Some(b) = gpu(gemm) else { return };
        let mut rng = Rng::new(4);
        let (vocab, dim) = (1000, 576);
        let table = rng.vec(vocab * dim);
        let ids = [5u32, 999, 0, 5, 123];
        let mut want = vec![0f32; ids.len() * dim];
        reference::embedding(&table, &ids, vocab, dim, &mut want).unwrap();
        let tb = b.upload(&table).unwrap();
        let mut out = b.alloc_zeros(ids.len() * dim).unwrap();
        b.embedding(&tb, &ids, vocab, dim, &mut out).unwrap();
        assert_eq!(b.download(&out).unwrap(), want, "embedding");
        b.gather_rows(&tb, &ids, dim, &mut out).unwrap();
        assert_eq!(b.download(&out).unwrap(), want, "gather_rows");
        let lin = b.prepare_linear(&table, vocab, dim).unwrap();
        b.embedding_prepared(&lin, &ids, &mut out).unwrap();
        let tol = if gemm == GemmDtype::F32 { 0.0 } else { 4e-3 };
        assert_close(&b.download(&out).unwrap(), &want, 0.0, tol, &format!("{gemm:?} prepared embedding"));
        assert!(matches!(b.embedding(&tb, &[1000], vocab, dim, &mut out), Err(KernelError::Shape { .. })));
    }
}

const DTYPES: [CacheDtype; 3] = [CacheDtype::F32, CacheDtype::F16, CacheDtype::Bf16];

#[test]
fn kv_writes_bytes_and_copies_match_reference() {
    let Some(b) = gpu(GemmDtype::F32) else { return };
    let mut rng = Rng::new(5);
    let (kv_width, slots_total) = (3 * 64, 64);
    for dtype in DTYPES {
        let tokens = 9;
        let (k, v) = (rng.vec(tokens * kv_width), rng.vec(tokens * kv_width));
        let slots: Vec<u32> = (0..tokens as u32).map(|t| (t * 7 + 3) % slots_total as u32).collect();
        let (mut wk, mut wv) = (vec![0f32; slots_total * kv_width], vec![0f32; slots_total * kv_width]);
        reference::write_kv(&k, &v, &slots, kv_width, &mut wk, &mut wv).unwrap();
        let mut kc = b.alloc_kv(dtype, slots_total * kv_width).unwrap();
        let mut vc = b.alloc_kv(dtype, slots_total * kv_width).unwrap();
        assert_eq!(b.kv_info(&kc), (dtype, slots_total * kv_width));
        b.write_kv(&b.upload(&k).unwrap(), &b.upload(&v).unwrap(), &slots, kv_width, &mut kc, &mut vc).unwrap();
        let mut bytes = vec![1, 2, 3];
        b.read_kv_bytes(&kc, 0, slots_total * kv_width, &mut bytes).unwrap();
        assert_eq!(&bytes[..3], &[1, 2, 3], "read_kv_bytes appends");
        let want: Vec<f32> = wk.iter().map(|&x| reference::kv_round(dtype, x)).collect();
        assert_eq!(reference::kv_decode(dtype, &bytes[3..]), want, "{dtype:?} write_kv rounds like the reference");
        // Bytes in, bytes out; a block copied within the pool.
        let block = rng.vec(16 * kv_width);
        b.write_kv_bytes(&mut vc, 0, &reference::kv_encode(dtype, &block)).unwrap();
        b.copy_kv(&mut vc, 0, 32 * kv_width, 16 * kv_width).unwrap();
        let mut got = Vec::new();
        b.read_kv_bytes(&vc, 32 * kv_width, 16 * kv_width, &mut got).unwrap();
        assert_eq!(got, reference::kv_encode(dtype, &block), "{dtype:?} copy_kv");
        assert!(matches!(b.copy_kv(&mut vc, 0, 8 * kv_width, 16 * kv_width), Err(KernelError::Shape { .. })));
        assert!(matches!(b.write_kv_bytes(&mut vc, 0, &[0u8; 3]), Err(KernelError::Shape { .. })));
        assert_eq!(b.kv_resident_bytes(&kc), 0, "device pools cost no host memory");
    }
}

/// A batch of sequences `(q_len, context_len)` over shuffled blocks, against the reference.
fn attention_case(b: &CudaBackend, seed: u64, shape: AttnShape, lens: &[(usize, usize)]) {
    let mut rng = Rng::new(seed);
    let bs = shape.block_size;
    let kv_width = shape.num_kv_heads * shape.head_dim;
    let q_width = shape.num_heads * shape.head_dim;
    let total_blocks: usize = lens.iter().map(|&(_, c)| c.div_ceil(bs)).sum::<usize>() + 2;
    let mut ids: Vec<u32> = (0..total_blocks as u32).collect();
    rng.shuffle(&mut ids);
    let (kc, vc) = (rng.vec(total_blocks * bs * kv_width), rng.vec(total_blocks * bs * kv_width));
    let mut tables = Vec::new();
    let (mut next, mut row, mut starts) = (0, 0, Vec::new());
    for &(q_len, ctx) in lens {
        let n = ctx.div_ceil(bs);
        tables.push(ids[next..next + n].to_vec());
        next += n;
        row += rng.below(2); // a gap of unowned rows, sometimes
        starts.push(row);
        row += q_len;
    }
    let q: Vec<f32> = rng.vec(row * q_width).iter().map(|v| v * 4.0).collect();
    let seqs: Vec<AttnSeq<'_>> = lens
        .iter()
        .zip(&tables)
        .zip(&starts)
        .map(|((&(q_len, context_len), t), &q_start)| AttnSeq { q_start, q_len, context_len, block_table: t })
        .collect();
    for dtype in DTYPES {
        let round = |x: &[f32]| x.iter().map(|&v| reference::kv_round(dtype, v)).collect::<Vec<_>>();
        let mut want = vec![0f32; q.len()];
        reference::paged_attention(&q, &round(&kc), &round(&vc), &seqs, shape, &mut want).unwrap();
        let mut kp = b.alloc_kv(dtype, kc.len()).unwrap();
        let mut vp = b.alloc_kv(dtype, vc.len()).unwrap();
        b.write_kv_bytes(&mut kp, 0, &reference::kv_encode(dtype, &kc)).unwrap();
        b.write_kv_bytes(&mut vp, 0, &reference::kv_encode(dtype, &vc)).unwrap();
        let mut out = b.upload(&vec![0f32; q.len()]).unwrap();
        b.paged_attention(&b.upload(&q).unwrap(), &kp, &vp, &seqs, shape, &mut out).unwrap();
        let got = b.download(&out).unwrap();
        // Rows no sequence owns stay as they were (zero).
        assert_close(&got, &want, 2e-5, 2e-4, &format!("{dtype:?} attention {shape:?} {lens:?}"));
    }
}

#[test]
fn paged_attention_matches_reference_over_shapes_and_batches() {
    let Some(b) = gpu(GemmDtype::F32) else { return };
    let shapes = [
        (4, 2, 16, 16),   // the tiny test model
        (9, 3, 64, 16),   // SmolLM2-135M
        (32, 8, 128, 16), // Llama 3 8B
        (16, 1, 80, 8),   // multi-query, a head_dim that is not a power of two, 16 heads per KV head
        (8, 8, 256, 32),  // no GQA, the largest head_dim
        (6, 2, 36, 16),   // a head_dim that is not a multiple of 8: no vector loads
    ];
    for (i, &(nh, nkv, hd, bs)) in shapes.iter().enumerate() {
        let shape = AttnShape {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            block_size: bs,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        // Decode tokens, prefill chunks over cached prefixes, a whole prompt, a zero-length query.
        attention_case(&b, i as u64, shape, &[(1, 1), (1, 37), (5, 5), (3, 100), (0, 9), (1, 300)]);
        attention_case(&b, 100 + i as u64, shape, &[(200, 200)]);
        attention_case(&b, 200 + i as u64, shape, &[]);
    }
    let shape = AttnShape { num_heads: 2, num_kv_heads: 1, head_dim: 512, block_size: 16, scale: 0.1 };
    let (q, mut out) = (b.alloc_zeros(1024).unwrap(), b.alloc_zeros(1024).unwrap());
    let (kc, vc) = (b.alloc_kv(CacheDtype::F32, 16 * 512).unwrap(), b.alloc_kv(CacheDtype::F32, 16 * 512).unwrap());
    let t = [0u32];
    let seqs = [AttnSeq { q_start: 0, q_len: 1, context_len: 1, block_table: &t }];
    assert!(matches!(b.paged_attention(&q, &kc, &vc, &seqs, shape, &mut out), Err(KernelError::Shape { .. })));
}
