// Causal grouped-query attention for the training core on CUDA: the same recurrence as
// `tiled_attention.rs` on the CPU (FlashAttention's online softmax, keeping each row's
// log-sum-exp and recomputing the probabilities in the backward), so no [t, t] score matrix ever
// exists in device memory.
//
// Layouts (contiguous): q, out, d_out, d_q are [batch, heads, t, hd]; k, v, d_k, d_v are
// [batch, kv_heads, t, hd]; lse and delta are [batch, heads, t] in f32. Query head h reads key /
// value head h / (heads / kv_heads). hd <= HD_MAX. All arithmetic is f32 whatever the storage
// type, and every sum runs in a fixed order with no atomics, so results are bit-identical from
// run to run.
//
// One warp owns one row (a query row in the forward and dQ kernels, a key row in the dK/dV
// kernel); a block of WARPS rows shares tiles of TILE rows of the other side in shared memory.
// Within a tile, lane j computes the score of the tile's row j, and the rows' contributions are
// then broadcast from lane to lane to the accumulators, of which each lane holds the dimensions
// lane, lane + 32, ...
#include <cuda_bf16.h>
#include <stdint.h>

#define WARPS 8
#define TILE 32
#define HD_MAX 128
#define PER_LANE (HD_MAX / 32)
#define FULL 0xffffffffu

__device__ __forceinline__ float load(const float *p, size_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16 *p, size_t i) {
    return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float *p, size_t i, float x) { p[i] = x; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, size_t i, float x) {
    p[i] = __float2bfloat16(x);
}

// Butterfly reductions: every lane ends with the same bits (each step adds the same two values,
// in either order).
__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL, x, o));
    return x;
}

// Output and log-sum-exp of each query row. Grid: (ceil(t / WARPS), heads, batch).
template <typename T>
__device__ void forward(const T *q, const T *k, const T *v, T *out, float *lse, int heads,
                        int kv_heads, int t, int hd, float scale) {
    __shared__ float ks[TILE][HD_MAX + 1];
    __shared__ float vs[TILE][HD_MAX];
    __shared__ float qs[WARPS][HD_MAX];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (heads / kv_heads);
    const int r0 = blockIdx.x * WARPS, row = r0 + warp;
    const bool live = row < t;
    const size_t rows = (size_t)(b * heads + h) * t;
    const size_t keys = (size_t)(b * kv_heads + g) * t;
    if (live)
        for (int d = lane; d < hd; d += 32) qs[warp][d] = load(q, (rows + row) * hd + d);
    float m = -INFINITY, l = 0.f, acc[PER_LANE];
#pragma unroll
    for (int c = 0; c < PER_LANE; ++c) acc[c] = 0.f;
    // The block's last row: no row of the block sees a key after it.
    const int last = min(r0 + WARPS, t) - 1;
    for (int t0 = 0; t0 <= last; t0 += TILE) {
        __syncthreads();
        const int n = min(TILE, last + 1 - t0);
        for (int e = threadIdx.x; e < n * hd; e += WARPS * 32) {
            const int j = e / hd, d = e % hd;
            const size_t at = (keys + t0 + j) * hd + d;
            ks[j][d] = load(k, at);
            vs[j][d] = load(v, at);
        }
        __syncthreads();
        if (!live || t0 > row) continue;
        const bool seen = t0 + lane <= row;
        float s = -INFINITY;
        if (seen) {
            float dot = 0.f;
            for (int d = 0; d < hd; ++d) dot += qs[warp][d] * ks[lane][d];
            s = dot * scale;
        }
        const float m_new = fmaxf(m, warp_max(s));
        const float p = seen ? expf(s - m_new) : 0.f;
        const float rescale = expf(m - m_new);
        l = l * rescale + warp_sum(p);
#pragma unroll
        for (int c = 0; c < PER_LANE; ++c) acc[c] *= rescale;
        const int cols = min(TILE, row - t0 + 1);
        for (int j = 0; j < cols; ++j) {
            const float pj = __shfl_sync(FULL, p, j);
#pragma unroll
            for (int c = 0; c < PER_LANE; ++c) {
                const int d = lane + 32 * c;
                if (d < hd) acc[c] += pj * vs[j][d];
            }
        }
        m = m_new;
    }
    if (!live) return;
    const float inv = 1.f / l;
#pragma unroll
    for (int c = 0; c < PER_LANE; ++c) {
        const int d = lane + 32 * c;
        if (d < hd) store(out, (rows + row) * hd + d, acc[c] * inv);
    }
    if (lane == 0) lse[rows + row] = m + logf(l);
}

// dQ of each query row, and delta = rowsum(dO * O), which the dK/dV kernel reads.
// Grid: (ceil(t / WARPS), heads, batch).
template <typename T>
__device__ void backward_q(const T *q, const T *k, const T *v, const T *out, const T *d_out,
                           const float *lse, float *delta, T *d_q, int heads, int kv_heads,
                           int t, int hd, float scale) {
    __shared__ float ks[TILE][HD_MAX + 1];
    __shared__ float vs[TILE][HD_MAX + 1];
    __shared__ float qs[WARPS][HD_MAX];
    __shared__ float dos[WARPS][HD_MAX];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y, b = blockIdx.z, g = h / (heads / kv_heads);
    const int r0 = blockIdx.x * WARPS, row = r0 + warp;
    const bool live = row < t;
    const size_t rows = (size_t)(b * heads + h) * t;
    const size_t keys = (size_t)(b * kv_heads + g) * t;
    float dot_o = 0.f;
    if (live)
        for (int d = lane; d < hd; d += 32) {
            const size_t at = (rows + row) * hd + d;
            qs[warp][d] = load(q, at);
            dos[warp][d] = load(d_out, at);
            dot_o += dos[warp][d] * load(out, at);
        }
    const float row_delta = warp_sum(dot_o);
    const float row_lse = live ? lse[rows + row] : 0.f;
    if (live && lane == 0) delta[rows + row] = row_delta;
    float dq[PER_LANE];
#pragma unroll
    for (int c = 0; c < PER_LANE; ++c) dq[c] = 0.f;
    const int last = min(r0 + WARPS, t) - 1;
    for (int t0 = 0; t0 <= last; t0 += TILE) {
        __syncthreads();
        const int n = min(TILE, last + 1 - t0);
        for (int e = threadIdx.x; e < n * hd; e += WARPS * 32) {
            const int j = e / hd, d = e % hd;
            const size_t at = (keys + t0 + j) * hd + d;
            ks[j][d] = load(k, at);
            vs[j][d] = load(v, at);
        }
        __syncthreads();
        if (!live || t0 > row) continue;
        float ds = 0.f;
        if (t0 + lane <= row) {
            float s = 0.f, dp = 0.f;
            for (int d = 0; d < hd; ++d) {
                s += qs[warp][d] * ks[lane][d];
                dp += dos[warp][d] * vs[lane][d];
            }
            const float p = expf(s * scale - row_lse);
            ds = p * (dp - row_delta) * scale;
        }
        const int cols = min(TILE, row - t0 + 1);
        for (int j = 0; j < cols; ++j) {
            const float dsj = __shfl_sync(FULL, ds, j);
#pragma unroll
            for (int c = 0; c < PER_LANE; ++c) {
                const int d = lane + 32 * c;
                if (d < hd) dq[c] += dsj * ks[j][d];
            }
        }
    }
    if (!live) return;
#pragma unroll
    for (int c = 0; c < PER_LANE; ++c) {
        const int d = lane + 32 * c;
        if (d < hd) store(d_q, (rows + row) * hd + d, dq[c]);
    }
}

// dK and dV of each key row, summed over the query heads that share its key/value head in a
// fixed order. Grid: (ceil(t / WARPS), kv_heads, batch).
template <typename T>
__device__ void backward_kv(const T *q, const T *k, const T *v, const T *d_out, const float *lse,
                            const float *delta, T *d_k, T *d_v, int heads, int kv_heads, int t,
                            int hd, float scale) {
    __shared__ float qs[TILE][HD_MAX + 1];
    __shared__ float dos[TILE][HD_MAX + 1];
    __shared__ float lses[TILE];
    __shared__ float deltas[TILE];
    __shared__ float ks[WARPS][HD_MAX];
    __shared__ float vs[WARPS][HD_MAX];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = blockIdx.y, b = blockIdx.z, group = heads / kv_heads;
    const int j0 = blockIdx.x * WARPS, key = j0 + warp;
    const bool live = key < t;
    const size_t keys = (size_t)(b * kv_heads + g) * t;
    if (live)
        for (int d = lane; d < hd; d += 32) {
            ks[warp][d] = load(k, (keys + key) * hd + d);
            vs[warp][d] = load(v, (keys + key) * hd + d);
        }
    float dk[PER_LANE], dv[PER_LANE];
#pragma unroll
    for (int c = 0; c < PER_LANE; ++c) dk[c] = dv[c] = 0.f;
    // The first tile holding a row that sees one of the block's keys.
    const int first = (j0 / TILE) * TILE;
    for (int r = 0; r < group; ++r) {
        const int h = g * group + r;
        const size_t rows = (size_t)(b * heads + h) * t;
        for (int t0 = first; t0 < t; t0 += TILE) {
            __syncthreads();
            const int n = min(TILE, t - t0);
            for (int e = threadIdx.x; e < n * hd; e += WARPS * 32) {
                const int i = e / hd, d = e % hd;
                const size_t at = (rows + t0 + i) * hd + d;
                qs[i][d] = load(q, at);
                dos[i][d] = load(d_out, at);
            }
            if (threadIdx.x < n) {
                lses[threadIdx.x] = lse[rows + t0 + threadIdx.x];
                deltas[threadIdx.x] = delta[rows + t0 + threadIdx.x];
            }
            __syncthreads();
            if (!live || t0 + n - 1 < key) continue;
            const int i = t0 + lane;
            float p = 0.f, ds = 0.f;
            if (lane < n && i >= key) {
                float s = 0.f, dp = 0.f;
                for (int d = 0; d < hd; ++d) {
                    s += qs[lane][d] * ks[warp][d];
                    dp += dos[lane][d] * vs[warp][d];
                }
                p = expf(s * scale - lses[lane]);
                ds = p * (dp - deltas[lane]) * scale;
            }
            for (int ii = max(0, key - t0); ii < n; ++ii) {
                const float pi = __shfl_sync(FULL, p, ii);
                const float dsi = __shfl_sync(FULL, ds, ii);
#pragma unroll
                for (int c = 0; c < PER_LANE; ++c) {
                    const int d = lane + 32 * c;
                    if (d < hd) {
                        dv[c] += pi * dos[ii][d];
                        dk[c] += dsi * qs[ii][d];
                    }
                }
            }
        }
    }
    if (!live) return;
#pragma unroll
    for (int c = 0; c < PER_LANE; ++c) {
        const int d = lane + 32 * c;
        if (d < hd) {
            store(d_k, (keys + key) * hd + d, dk[c]);
            store(d_v, (keys + key) * hd + d, dv[c]);
        }
    }
}

#define KERNELS(NAME, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                    \
        attention_forward_##NAME(const T *q, const T *k, const T *v, T *out, float *lse,        \
                                 int heads, int kv_heads, int t, int hd, float scale) {         \
        forward<T>(q, k, v, out, lse, heads, kv_heads, t, hd, scale);                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) attention_backward_q_##NAME(      \
        const T *q, const T *k, const T *v, const T *out, const T *d_out, const float *lse,    \
        float *delta, T *d_q, int heads, int kv_heads, int t, int hd, float scale) {           \
        backward_q<T>(q, k, v, out, d_out, lse, delta, d_q, heads, kv_heads, t, hd, scale);     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) attention_backward_kv_##NAME(     \
        const T *q, const T *k, const T *v, const T *d_out, const float *lse,                  \
        const float *delta, T *d_k, T *d_v, int heads, int kv_heads, int t, int hd,            \
        float scale) {                                                                          \
        backward_kv<T>(q, k, v, d_out, lse, delta, d_k, d_v, heads, kv_heads, t, hd, scale);    \
    }

KERNELS(f32, float)
KERNELS(bf16, __nv_bfloat16)
