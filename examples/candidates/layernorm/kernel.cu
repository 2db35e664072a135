// Layer norm over the last dimension, fp32, with weight and bias; one block per row (grid-stride).
//
// layernorm_reg_*: the row is held in registers (N items of V floats per thread): read once, written once.
// Each thread computes exact two-pass statistics of its own items (count, mean, M2) from registers; the
// block merges them in one reduction with Chan's parallel formula, which stays accurate where the naive
// sum of squares would cancel.
// layernorm_long_*: rows too long for registers: a statistics pass, then a second pass that re-reads the
// row (mostly from L2) to normalise it.
// *_v4 need cols % 4 == 0 and 16-byte aligned x, y, weight and bias (the launcher checks).
#include <cstdint>

namespace {

struct Stats {
    float n;     // count
    float mean;  // mean
    float m2;    // sum of squared deviations from the mean
};

__device__ __forceinline__ Stats merge(Stats a, Stats b) {
    const float n = a.n + b.n;
    if (n == 0.0f) return a;
    const float d = b.mean - a.mean;
    const float fb = b.n / n;
    return {n, a.mean + d * fb, a.m2 + b.m2 + d * d * a.n * fb};
}

__device__ __forceinline__ Stats warp_reduce(Stats v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = merge(v, {__shfl_xor_sync(0xffffffffu, v.n, o), __shfl_xor_sync(0xffffffffu, v.mean, o),
                      __shfl_xor_sync(0xffffffffu, v.m2, o)});
    return v;
}

// blockDim.x must be a multiple of 32. red[32] holds the result, so the next row may reuse red[0..31]
// without another barrier: it writes them only after its first barrier, which all threads reach after
// reading red[32] here.
__device__ __forceinline__ Stats block_reduce(Stats v, Stats* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_reduce(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? red[lane] : Stats{0.0f, 0.0f, 0.0f};
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

// Streaming (evict-first) stores: the output is not re-read, so it should not push the input out of L2.
template <int V>
__device__ __forceinline__ void store(float* __restrict__ p, const float (&a)[V]) {
    if constexpr (V == 4)
        __stcs(reinterpret_cast<float4*>(p), make_float4(a[0], a[1], a[2], a[3]));
    else
        __stcs(p, a[0]);
}

// y = (x - mean) * rstd * w + b for V consecutive elements starting at column j.
template <int V>
__device__ __forceinline__ void normalise(float (&a)[V], const float* __restrict__ w, const float* __restrict__ b,
                                          int j, float mean, float rstd) {
    float wv[V], bv[V];
    load<V>(w + j, wv);  // weight and bias are shared by every row: they stay in L1/L2
    load<V>(b + j, bv);
#pragma unroll
    for (int v = 0; v < V; ++v) a[v] = (a[v] - mean) * rstd * wv[v] + bv[v];
}

// Row length up to N * V * blockDim.x; element (k, thread) sits at (k * blockDim.x + threadIdx.x) * V.
template <int V, int N>
__device__ __forceinline__ void layernorm_reg(const float* __restrict__ x, const float* __restrict__ w,
                                              const float* __restrict__ b, float* __restrict__ y,
                                              long long rows, int cols, float eps) {
    __shared__ Stats red[33];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* __restrict__ xr = x + r * cols;
        float* __restrict__ yr = y + r * cols;
        float a[N][V];
        float sum = 0.0f;
        int count = 0;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const int j = (k * blockDim.x + threadIdx.x) * V;
            if (j < cols) {
                load<V>(xr + j, a[k]);
                count += V;
#pragma unroll
                for (int v = 0; v < V; ++v) sum += a[k][v];
            }
        }
        const float mean = count > 0 ? sum / count : 0.0f;
        float m2 = 0.0f;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const int j = (k * blockDim.x + threadIdx.x) * V;
            if (j < cols) {
#pragma unroll
                for (int v = 0; v < V; ++v) m2 += (a[k][v] - mean) * (a[k][v] - mean);
            }
        }
        const Stats t = block_reduce({(float)count, mean, m2}, red);
        const float rstd = rsqrtf(t.m2 / cols + eps);  // biased variance, as nn.LayerNorm
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const int j = (k * blockDim.x + threadIdx.x) * V;
            if (j < cols) {
                normalise<V>(a[k], w, b, j, t.mean, rstd);
                store<V>(yr + j, a[k]);
            }
        }
    }
}

template <int V>
__device__ __forceinline__ void layernorm_long(const float* __restrict__ x, const float* __restrict__ w,
                                               const float* __restrict__ b, float* __restrict__ y,
                                               long long rows, int cols, float eps) {
    __shared__ Stats red[33];
    const int step = blockDim.x * V;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* __restrict__ xr = x + r * cols;
        float* __restrict__ yr = y + r * cols;
        Stats acc = {0.0f, 0.0f, 0.0f};
        for (int j = threadIdx.x * V; j < cols; j += step) {
            float a[V];
            load<V>(xr + j, a);
            float mean = a[0];
#pragma unroll
            for (int v = 1; v < V; ++v) mean += a[v];
            mean /= V;
            float m2 = 0.0f;
#pragma unroll
            for (int v = 0; v < V; ++v) m2 += (a[v] - mean) * (a[v] - mean);
            acc = merge(acc, {(float)V, mean, m2});
        }
        const Stats t = block_reduce(acc, red);
        const float rstd = rsqrtf(t.m2 / cols + eps);
        for (int j = threadIdx.x * V; j < cols; j += step) {
            float a[V];
            load<V>(xr + j, a);
            normalise<V>(a, w, b, j, t.mean, rstd);
            store<V>(yr + j, a);
        }
    }
}

}  // namespace

// Floats per thread (N * V): keep in step with the launcher's REG_ITEMS. The scalar form holds 16, not 32:
// with 32 it spills under the 64-register cap that 1024-thread blocks impose.
extern "C" __global__ void __launch_bounds__(1024)
layernorm_reg_v4(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                 float* __restrict__ y, long long rows, int cols, float eps) {
    layernorm_reg<4, 8>(x, w, b, y, rows, cols, eps);
}

extern "C" __global__ void __launch_bounds__(1024)
layernorm_reg_v1(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                 float* __restrict__ y, long long rows, int cols, float eps) {
    layernorm_reg<1, 16>(x, w, b, y, rows, cols, eps);
}

extern "C" __global__ void __launch_bounds__(1024)
layernorm_long_v4(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                  float* __restrict__ y, long long rows, int cols, float eps) {
    layernorm_long<4>(x, w, b, y, rows, cols, eps);
}

extern "C" __global__ void __launch_bounds__(1024)
layernorm_long_v1(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                  float* __restrict__ y, long long rows, int cols, float eps) {
    layernorm_long<1>(x, w, b, y, rows, cols, eps);
}
