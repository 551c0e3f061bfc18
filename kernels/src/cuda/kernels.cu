// The CUDA backend's kernels, compiled at start by NVRTC (cleave_kernels::cuda).
//
// No headers: NVRTC compiles this alone, so 16-bit conversions are written out (bf16 by bit
// manipulation, f16 through PTX's cvt). Every kernel checks its own bounds; the host has already
// validated sizes, ids and block tables against the buffers (kernels/src/check.rs), so a bound
// here only guards the grid's rounding up.
//
// Numerics follow the CPU backend where a test compares them: RMSNorm and softmax sum in double,
// RoPE rounds each product and sum separately (no FMA contraction), SiLU is x / (1 + exp(-x)).

typedef unsigned short u16;
typedef unsigned int u32;
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 0x40u);  // quiet NaN, sign kept
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (u16)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}

// Element access by storage type: 0 = f32, 1 = f16, 2 = bf16 (CacheDtype's order on the host).
template <int D> struct Elem;
template <> struct Elem<0> {
    typedef float T;
    static __device__ __forceinline__ float load(const float* p, long long i) { return p[i]; }
    static __device__ __forceinline__ void store(float* p, long long i, float v) { p[i] = v; }
};
template <> struct Elem<1> {
    typedef u16 T;
    static __device__ __forceinline__ float load(const u16* p, long long i) { return f16_to_f32(p[i]); }
    static __device__ __forceinline__ void store(u16* p, long long i, float v) { p[i] = f32_to_f16(v); }
};
template <> struct Elem<2> {
    typedef u16 T;
    static __device__ __forceinline__ float load(const u16* p, long long i) { return bf16_to_f32(p[i]); }
    static __device__ __forceinline__ void store(u16* p, long long i, float v) { p[i] = f32_to_bf16(v); }
};

#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); \
         i += (long long)blockDim.x * gridDim.x)

// ---- element-wise ----

template <int D>
__device__ void convert_from_f32(const float* x, typename Elem<D>::T* y, long long n) {
    GRID_STRIDE(i, n) { Elem<D>::store(y, i, x[i]); }
}
extern "C" __global__ void f32_to_f16_kernel(const float* x, u16* y, long long n) { convert_from_f32<1>(x, y, n); }
extern "C" __global__ void f32_to_bf16_kernel(const float* x, u16* y, long long n) { convert_from_f32<2>(x, y, n); }

extern "C" __global__ void add_bias(float* out, const float* bias, long long rows, int n) {
    GRID_STRIDE(i, rows * n) { out[i] += bias[i % n]; }
}

extern "C" __global__ void add_assign(float* x, const float* y, long long n) {
    GRID_STRIDE(i, n) { x[i] += y[i]; }
}

extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, long long n) {
    GRID_STRIDE(i, n) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// ---- row-wise: one block per row ----

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024). Every thread gets it.
__device__ double block_sum(double v, double* scratch) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ float block_max(float v, float* scratch) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -INFINITY;
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

extern "C" __global__ void rms_norm(const float* x, const float* weight, float eps, int dim, float* out) {
    __shared__ double scratch[32];
    const float* row = x + (long long)blockIdx.x * dim;
    float* o = out + (long long)blockIdx.x * dim;
    double ss = 0.0;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += (double)row[c] * (double)row[c];
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = weight[c] * (row[c] * inv);
}

extern "C" __global__ void softmax(float* x, int dim) {
    __shared__ double scratch[32];
    __shared__ float fscratch[32];
    float* row = x + (long long)blockIdx.x * dim;
    float m = -INFINITY;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) m = fmaxf(m, row[c]);
    m = block_max(m, fscratch);
    double s = 0.0;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float e = expf(row[c] - m);
        row[c] = e;
        s += e;
    }
    s = block_sum(s, scratch);
    float inv = (float)(1.0 / s);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) row[c] *= inv;
}

// Rotate-half RoPE in place; block = one token, threads over (head, i < head_dim / 2).
extern "C" __global__ void rope(float* x, const u32* positions, int num_heads, int head_dim, const float* cos_sin) {
    int half = head_dim / 2;
    long long t = blockIdx.x;
    const float* cs = cos_sin + (long long)positions[t] * head_dim;
    for (int j = threadIdx.x; j < num_heads * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        float* v = x + (t * num_heads + h) * head_dim;
        float a = v[i], b = v[i + half], c = cs[i], s = cs[half + i];
        v[i] = __fadd_rn(__fmul_rn(a, c), __fmul_rn(-b, s));
        v[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
}

// ---- gathers: block = one output row ----

template <int D>
__device__ void gather(const typename Elem<D>::T* table, const u32* ids, int dim, float* out) {
    long long src = (long long)ids[blockIdx.x] * dim, dst = (long long)blockIdx.x * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) out[dst + c] = Elem<D>::load(table, src + c);
}
extern "C" __global__ void gather_f32(const float* t, const u32* ids, int dim, float* out) { gather<0>(t, ids, dim, out); }
extern "C" __global__ void gather_f16(const u16* t, const u32* ids, int dim, float* out) { gather<1>(t, ids, dim, out); }
extern "C" __global__ void gather_bf16(const u16* t, const u32* ids, int dim, float* out) { gather<2>(t, ids, dim, out); }

// ---- KV cache ----

// Token blockIdx.x of k, v: [tokens, kv_width] to slot slots[t] of the pools, rounded to D.
template <int D>
__device__ void write_kv(const float* k, const float* v, const u32* slots, int kv_width, typename Elem<D>::T* kc,
                         typename Elem<D>::T* vc) {
    long long src = (long long)blockIdx.x * kv_width, dst = (long long)slots[blockIdx.x] * kv_width;
    for (int c = threadIdx.x; c < kv_width; c += blockDim.x) {
        Elem<D>::store(kc, dst + c, k[src + c]);
        Elem<D>::store(vc, dst + c, v[src + c]);
    }
}
extern "C" __global__ void write_kv_f32(const float* k, const float* v, const u32* s, int w, float* kc, float* vc) {
    write_kv<0>(k, v, s, w, kc, vc);
}
extern "C" __global__ void write_kv_f16(const float* k, const float* v, const u32* s, int w, u16* kc, u16* vc) {
    write_kv<1>(k, v, s, w, kc, vc);
}
extern "C" __global__ void write_kv_bf16(const float* k, const float* v, const u32* s, int w, u16* kc, u16* vc) {
    write_kv<2>(k, v, s, w, kc, vc);
}

// ---- paged attention ----
//
// One block of ATTN_THREADS threads per (query token, KV head, tile of up to G query heads
// sharing it), so each key and value row is read once for all the query heads of its tile
// (GQA); G is 1, 2, 4 or 8, the smallest that holds the group (or 8). Keys go by in tiles of
// ATTN_THREADS: (1) each thread scores one key against every head, reading the key row as 8- or
// 16-byte vectors and q from shared memory; (2) the block reduces the tile's max and sum per head
// and rescales its running state once per tile; (3) each thread takes 8 consecutive dims of the
// value rows of a subset of the tile's keys (one vector load per row) and accumulates them for
// every head; the subsets' partial sums are merged at the end. No shuffles or exponentials per
// key beyond one exp per (key, head).
//
// `meta` (packed by the host, cuda/plan.rs): [tok_seq: num_tokens] then per sequence
// [q_start, q_len, context_len, table_off], with each block table at meta[table_off ..].
// tok_seq[t] == 0xffffffff marks a row no sequence owns: left untouched.
#define MAXD 8
#define ATTN_THREADS 128

// Loads dims d0 .. d0 + n (n <= MAXD, zero beyond) of row `base` as f32.
template <int D>
__device__ __forceinline__ void load_dims(const typename Elem<D>::T* p, long long base, int d0, int n, float* r) {
    long long at = base + d0;
    if (D == 0 && n == MAXD && (at & 3) == 0) {
        const float4* v = reinterpret_cast<const float4*>(p + at);
        float4 a = v[0], b = v[1];
        r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w; r[4] = b.x; r[5] = b.y; r[6] = b.z; r[7] = b.w;
        return;
    }
    if (D != 0 && n == MAXD && (at & 7) == 0) {
        uint4 v = *reinterpret_cast<const uint4*>(p + at);
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            r[2 * i] = D == 1 ? f16_to_f32((u16)(w[i] & 0xffffu)) : bf16_to_f32((u16)(w[i] & 0xffffu));
            r[2 * i + 1] = D == 1 ? f16_to_f32((u16)(w[i] >> 16)) : bf16_to_f32((u16)(w[i] >> 16));
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < MAXD; i++) r[i] = i < n ? Elem<D>::load(p, at + i) : 0.0f;
}

template <int D, int G>
__device__ void paged_attention(const float* q, const typename Elem<D>::T* kc, const typename Elem<D>::T* vc,
                                const u32* meta, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                                int block_size, float scale, float* out) {
    // Shared memory (sized by plan.rs): row offsets of the tile's keys, each head's rescale
    // factor and final sum, then q (scaled), the tile's probabilities and per-warp maxima and
    // sums; after the last tile the partial sums of the merge take the place of the latter.
    extern __shared__ long long smem_rows[];
    const int T = ATTN_THREADS;
    float* cs = reinterpret_cast<float*>(smem_rows + T);
    float* ls = cs + G;
    float* qs = cs + ((2 * G + 3) & ~3);  // 16-byte aligned, for float4 reads
    float* ps = qs + G * head_dim;
    float* red_max = ps + G * T;
    float* red_sum = red_max + G * (T / 32);

    int t = blockIdx.x, kvh = blockIdx.y, h0 = blockIdx.z * G;
    int group = num_heads / num_kv_heads;
    int ng = min(G, group - h0);
    u32 s = meta[t];
    if (s == 0xffffffffu) return;
    const u32* si = meta + num_tokens + 4ll * s;
    int q_start = (int)si[0], q_len = (int)si[1], ctx = (int)si[2];
    const u32* table = meta + si[3];
    int nkeys = ctx - q_len + (t - q_start) + 1;  // causal: keys 0 ..= this query's position
    int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    long long kv_width = (long long)num_kv_heads * head_dim;

    for (int i = tid; i < G * head_dim; i += T) {
        int g = i / head_dim;
        qs[i] = g < ng ? q[((long long)t * num_heads + kvh * group + h0 + g) * head_dim + i % head_dim] * scale : 0.0f;
    }
    float m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    // Phase 3's share of the outputs: 8 consecutive dims (chunk `ch`) of every head of the tile,
    // over the keys jj = sub, sub + nsub, ... of each tile.
    int nch = (head_dim + MAXD - 1) / MAXD, nsub = T / nch;
    int ch = tid % nch, sub = tid / nch;
    int dbase = ch * MAXD, dn = min(MAXD, head_dim - dbase);
    float acc[G][MAXD];
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int i = 0; i < MAXD; i++) acc[g][i] = 0.0f;
    }
    __syncthreads();

    for (int j0 = 0; j0 < nkeys; j0 += T) {
        // 1. Each thread scores one key against every head of the tile.
        int j = j0 + tid;
        bool valid = j < nkeys;
        float sc[G];
#pragma unroll
        for (int g = 0; g < G; g++) sc[g] = 0.0f;
        if (valid) {
            long long base =
                ((long long)table[j / block_size] * block_size + j % block_size) * kv_width + (long long)kvh * head_dim;
            smem_rows[tid] = base;
            if ((head_dim & (MAXD - 1)) == 0) {
                // Whole chunks: q read from shared memory four floats at a time.
#pragma unroll 4
                for (int c = 0; c < head_dim; c += MAXD) {
                    float kr[MAXD];
                    load_dims<D>(kc, base, c, MAXD, kr);
#pragma unroll
                    for (int g = 0; g < G; g++) {
                        const float4* q4 = reinterpret_cast<const float4*>(qs + g * head_dim + c);
                        float4 a = q4[0], b = q4[1];
                        sc[g] += a.x * kr[0] + a.y * kr[1] + a.z * kr[2] + a.w * kr[3] + b.x * kr[4] + b.y * kr[5] +
                                 b.z * kr[6] + b.w * kr[7];
                    }
                }
            } else {
                for (int c = 0; c < head_dim; c += MAXD) {
                    float kr[MAXD];
                    load_dims<D>(kc, base, c, min(MAXD, head_dim - c), kr);
#pragma unroll
                    for (int g = 0; g < G; g++) {
#pragma unroll
                        for (int i = 0; i < MAXD; i++) {
                            if (c + i < head_dim) sc[g] += qs[g * head_dim + c + i] * kr[i];
                        }
                    }
                }
            }
        }
        // 2. The tile's max and sum per head; running max, rescale and sum.
#pragma unroll
        for (int g = 0; g < G; g++) {
            float v = valid ? sc[g] : -INFINITY;
            for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
            if (lane == 0) red_max[g * (T / 32) + warp] = v;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < G; g++) {
            float tmax = -INFINITY;
            for (int w = 0; w < T / 32; w++) tmax = fmaxf(tmax, red_max[g * (T / 32) + w]);
            float mnew = fmaxf(m[g], tmax);  // finite: key j0 is always valid
            float c = expf(m[g] - mnew);      // 0 on the first tile
            float p = valid ? expf(sc[g] - mnew) : 0.0f;
            ps[g * T + tid] = p;
            for (int off = 16; off > 0; off >>= 1) p += __shfl_xor_sync(0xffffffffu, p, off);
            if (lane == 0) red_sum[g * (T / 32) + warp] = p;
            if (tid == 0) cs[g] = c;
            m[g] = mnew;
            l[g] *= c;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < G; g++) {
            float tsum = 0.0f;
            for (int w = 0; w < T / 32; w++) tsum += red_sum[g * (T / 32) + w];
            l[g] += tsum;
        }
        // 3. Weighted values: each value row's chunk is read once (a vector load) for every head.
        int tile_n = min(T, nkeys - j0);
#pragma unroll
        for (int g = 0; g < G; g++) {
            float c = cs[g];
#pragma unroll
            for (int i = 0; i < MAXD; i++) acc[g][i] *= c;
        }
        if (sub < nsub) {
#pragma unroll 4
            for (int jj = sub; jj < tile_n; jj += nsub) {
                float vr[MAXD];
                load_dims<D>(vc, smem_rows[jj], dbase, dn, vr);
#pragma unroll
                for (int g = 0; g < G; g++) {
                    float p = ps[g * T + jj];
#pragma unroll
                    for (int i = 0; i < MAXD; i++) acc[g][i] += p * vr[i];
                }
            }
        }
        __syncthreads();
    }
    // Merge the key subsets' partial sums (the tile's buffers are free now: reuse from qs on).
    float* merge = qs;
    if (sub < nsub) {
#pragma unroll
        for (int g = 0; g < G; g++) {
#pragma unroll
            for (int i = 0; i < MAXD; i++) {
                if (i < dn) merge[((long long)sub * G + g) * head_dim + dbase + i] = acc[g][i];
            }
        }
    }
    if (tid == 0) {
#pragma unroll
        for (int g = 0; g < G; g++) ls[g] = l[g];
    }
    __syncthreads();
    for (int o = tid; o < ng * head_dim; o += T) {
        int g = o / head_dim, d = o % head_dim;
        float sum = 0.0f;
        for (int u = 0; u < nsub; u++) sum += merge[((long long)u * G + g) * head_dim + d];
        out[((long long)t * num_heads + kvh * group + h0 + g) * head_dim + d] = sum / ls[g];
    }
}

#define ATTN_ARGS(T)                                                                                          \
    const float *q, const T *kc, const T *vc, const u32 *meta, int num_tokens, int num_heads, int num_kv_heads, \
        int head_dim, int block_size, float scale, float *out
#define ATTN_PASS q, kc, vc, meta, num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale, out
#define ATTN_KERNELS(G)                                                                                              \
    extern "C" __global__ void paged_attention_f32_g##G(ATTN_ARGS(float)) { paged_attention<0, G>(ATTN_PASS); }  \
    extern "C" __global__ void paged_attention_f16_g##G(ATTN_ARGS(u16)) { paged_attention<1, G>(ATTN_PASS); }    \
    extern "C" __global__ void paged_attention_bf16_g##G(ATTN_ARGS(u16)) { paged_attention<2, G>(ATTN_PASS); }
ATTN_KERNELS(1)
ATTN_KERNELS(2)
ATTN_KERNELS(4)
ATTN_KERNELS(8)
