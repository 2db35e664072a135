// Row softmax over the last dimension, fp32, one block per row (grid-stride over rows).
//
// softmax_reg_*: the row is held in registers (N items of V floats per thread), so it is read from memory
// once and written once. Each thread reduces its own items to an online pair (max m, sum of exp(x - m)),
// the block merges the pairs in one reduction, and the stored exponentials are rescaled by
// exp(m - M) / S: one expf per element.
// softmax_long_*: rows too long for registers: an online (max, sum) pass, then a second pass that
// re-reads the row (mostly from L2) and writes exp(x - M) / S.
// *_v4 need cols % 4 == 0 and 16-byte aligned pointers (the launcher checks); *_v1 take anything.
#include <cstdint>
#include <math_constants.h>

namespace {

struct MaxSum {
    float m;  // running maximum
    float s;  // sum of exp(x - m)
};

// Merge two partial softmax statistics. A side whose max equals the merged max keeps its sum as is, so
// empty sides (-inf, 0) never produce exp(-inf - -inf) = NaN.
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
    const float m = fmaxf(a.m, b.m);
    const float sa = a.m == m ? a.s : a.s * expf(a.m - m);
    const float sb = b.m == m ? b.s : b.s * expf(b.m - m);
    return {m, sa + sb};
}

__device__ __forceinline__ MaxSum warp_reduce(MaxSum v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
    return v;
}

// blockDim.x must be a multiple of 32. red[32] holds the result, so red[0..31] can be reused by the next
// call without an extra barrier (see the note in the loop below).
__device__ __forceinline__ MaxSum block_reduce(MaxSum v, MaxSum* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_reduce(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? red[lane] : MaxSum{-CUDART_INF_F, 0.0f};
        v = warp_reduce(v);
        if (lane == 0) red[32] = v;
    }
    __syncthreads();
    return red[32];
}

template <int V>
__device__ __forceinline__ void load(const float* __restrict__ p, float (&a)[V]) {
    if constexpr (V == 4) {
        const float4 t = __ldg(reinterpret_cast<const float4*>(p));
        a[0] = t.x, a[1] = t.y, a[2] = t.z, a[3] = t.w;
    } else {
        a[0] = __ldg(p);
    }
}

template <int V>
__device__ __forceinline__ void store(float* __restrict__ p, const float (&a)[V]) {
    // Streaming (evict-first) stores: the output is not re-read, so it should not push the input out of L2.
    if constexpr (V == 4)
        __stcs(reinterpret_cast<float4*>(p), make_float4(a[0], a[1], a[2], a[3]));
    else
        __stcs(p, a[0]);
}

// Row length up to N * V * blockDim.x; element (k, thread) sits at (k * blockDim.x + threadIdx.x) * V,
// so every one of the N accesses is coalesced across the block.
template <int V, int N>
__device__ __forceinline__ void softmax_reg(const float* __restrict__ x, float* __restrict__ y, long long rows,
                                            int cols) {
    __shared__ MaxSum red[33];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* __restrict__ xr = x + r * cols;
        float* __restrict__ yr = y + r * cols;
        float a[N][V];
        float m = -CUDART_INF_F;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const int j = (k * blockDim.x + threadIdx.x) * V;
            if (j < cols) {
                load<V>(xr + j, a[k]);
#pragma unroll
                for (int v = 0; v < V; ++v) m = fmaxf(m, a[k][v]);
            }
        }
        // A thread whose items are all -inf (or that has none) uses 0 as its reference: exp(-inf) = 0.
        const float ref = m == -CUDART_INF_F ? 0.0f : m;
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const int j = (k * blockDim.x + threadIdx.x) * V;
            if (j < cols) {
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    a[k][v] = expf(a[k][v] - ref);
                    s += a[k][v];
                }
            }
        }
        // red[0..31] is rewritten by the next row only after that row's first barrier, which every thread
        // reaches after reading red[32] here; red[32] is rewritten only after it. So no extra barrier.
        const MaxSum t = block_reduce({m, s}, red);
        // 0 * (1 / S) keeps torch's NaN for a row that is entirely -inf (S = 0).
        const float f = m == -CUDART_INF_F ? 0.0f * (1.0f / t.s) : expf(m - t.m) / t.s;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const int j = (k * blockDim.x + threadIdx.x) * V;
            if (j < cols) {
#pragma unroll
                for (int v = 0; v < V; ++v) a[k][v] *= f;
                store<V>(yr + j, a[k]);
            }
        }
    }
}

template <int V>
__device__ __forceinline__ void softmax_long(const float* __restrict__ x, float* __restrict__ y, long long rows,
                                             int cols) {
    __shared__ MaxSum red[33];
    const int step = blockDim.x * V;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* __restrict__ xr = x + r * cols;
        float* __restrict__ yr = y + r * cols;
        MaxSum acc = {-CUDART_INF_F, 0.0f};
        for (int j = threadIdx.x * V; j < cols; j += step) {
            float a[V];
            load<V>(xr + j, a);
            float m = a[0];
#pragma unroll
            for (int v = 1; v < V; ++v) m = fmaxf(m, a[v]);
            const float ref = m == -CUDART_INF_F ? 0.0f : m;
            float s = 0.0f;
#pragma unroll
            for (int v = 0; v < V; ++v) s += expf(a[v] - ref);
            acc = merge(acc, {m, s});
        }
        const MaxSum t = block_reduce(acc, red);
        const float inv = 1.0f / t.s;
        for (int j = threadIdx.x * V; j < cols; j += step) {
            float a[V];
            load<V>(xr + j, a);
#pragma unroll
            for (int v = 0; v < V; ++v) a[v] = expf(a[v] - t.m) * inv;
            store<V>(yr + j, a);
        }
    }
}

}  // namespace

// Items per thread: keep in step with the launcher (REG_ITEMS). 16 floats per thread either way.
extern "C" __global__ void __launch_bounds__(1024)
softmax_reg_v4(const float* __restrict__ x, float* __restrict__ y, long long rows, int cols) {
    softmax_reg<4, 4>(x, y, rows, cols);
}

extern "C" __global__ void __launch_bounds__(1024)
softmax_reg_v1(const float* __restrict__ x, float* __restrict__ y, long long rows, int cols) {
    softmax_reg<1, 16>(x, y, rows, cols);
}

extern "C" __global__ void __launch_bounds__(1024)
softmax_long_v4(const float* __restrict__ x, float* __restrict__ y, long long rows, int cols) {
    softmax_long<4>(x, y, rows, cols);
}

extern "C" __global__ void __launch_bounds__(1024)
softmax_long_v1(const float* __restrict__ x, float* __restrict__ y, long long rows, int cols) {
    softmax_long<1>(x, y, rows, cols);
}
