// Mean over one dimension of a contiguous fp32 tensor seen as (outer, reduced, inner).
//
// Threads run along the contiguous inner dimension (V floats each: 16-byte loads when V = 4) and down the
// reduced one, so every warp load is a contiguous run; blockDim.y threads share each column and the
// reduced range is cut into gridDim.z splits, so that enough loads are in flight to saturate HBM even
// when outer * inner is small. Each block writes scale * (its partial sum); with one split that is the
// mean itself, otherwise sum_splits adds the splits' partial means.
//
// mean_partial_v4 needs inner % 4 == 0 and a 16-byte aligned x (the launcher checks). blockDim.y must be
// a power of two; dynamic shared memory: blockDim.x * blockDim.y * V floats.
#include <cstdint>

namespace {

constexpr int kUnroll = 4;  // rows loaded before any is added: independent loads in flight

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
    if constexpr (V == 4)
        *reinterpret_cast<float4*>(p) = make_float4(a[0], a[1], a[2], a[3]);
    else
        p[0] = a[0];
}

template <int V>
__device__ __forceinline__ void mean_partial(const float* __restrict__ x, float* __restrict__ out,
                                             long long outer, long long reduced, long long inner,
                                             long long rows_per_split, float scale) {
    extern __shared__ __align__(16) float partial[];  // [blockDim.y][blockDim.x][V]
    const long long col = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V;  // first inner index
    const bool active = col < inner;
    const long long r0 = blockIdx.z * rows_per_split;
    const long long r1 = min(reduced, r0 + rows_per_split);
    const int by = blockDim.y;
    float* mine = partial + (threadIdx.y * blockDim.x + threadIdx.x) * V;

    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {  // block-uniform: barriers are safe
        float acc[V] = {};
        if (active) {
            const float* __restrict__ base = x + o * reduced * inner + col;
            long long r = r0 + threadIdx.y;
            for (; r + (kUnroll - 1) * by < r1; r += kUnroll * by) {
                float a[kUnroll][V];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) load<V>(base + (r + u * by) * inner, a[u]);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                    for (int v = 0; v < V; ++v) acc[v] += a[u][v];
            }
            for (; r < r1; r += by) {
                float a[V];
                load<V>(base + r * inner, a);
#pragma unroll
                for (int v = 0; v < V; ++v) acc[v] += a[v];
            }
        }
#pragma unroll
        for (int v = 0; v < V; ++v) mine[v] = acc[v];
        __syncthreads();
        // Tree over threadIdx.y; row 0 ends up holding the block's sums.
        for (int s = by >> 1; s > 0; s >>= 1) {
            if (threadIdx.y < s) {
                const float* other = mine + s * blockDim.x * V;
#pragma unroll
                for (int v = 0; v < V; ++v) mine[v] += other[v];
            }
            __syncthreads();
        }
        if (threadIdx.y == 0 && active) {
#pragma unroll
            for (int v = 0; v < V; ++v) acc[v] = mine[v] * scale;
            store<V>(out + (blockIdx.z * outer + o) * inner + col, acc);
        }
        __syncthreads();  // the next o rewrites partial[]
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256)
mean_partial_v4(const float* __restrict__ x, float* __restrict__ out, long long outer, long long reduced,
                long long inner, long long rows_per_split, float scale) {
    mean_partial<4>(x, out, outer, reduced, inner, rows_per_split, scale);
}

extern "C" __global__ void __launch_bounds__(256)
mean_partial_v1(const float* __restrict__ x, float* __restrict__ out, long long outer, long long reduced,
                long long inner, long long rows_per_split, float scale) {
    mean_partial<1>(x, out, outer, reduced, inner, rows_per_split, scale);
}

// out[i] = sum over s of partials[s * n + i]; 1-d grid of any size (grid-stride).
extern "C" __global__ void __launch_bounds__(256)
sum_splits(const float* __restrict__ partials, float* __restrict__ out, int splits, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int k = 0; k < splits; ++k) s += __ldg(partials + k * n + i);
        out[i] = s;
    }
}
