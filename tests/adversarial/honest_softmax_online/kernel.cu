// Honest control: softmax over the last dimension, one row per block. Each thread keeps an online
// (running max, running sum of exp) pair over its strided elements; pairs are merged with warp shuffles
// and then across warps through shared memory; a second pass writes exp(x - max) / sum.

#include <math.h>

struct MaxSum {
    float m;
    float s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
    float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {m, 0.0f};
    float s = (a.m == -INFINITY ? 0.0f : a.s * expf(a.m - m)) + (b.m == -INFINITY ? 0.0f : b.s * expf(b.m - m));
    return {m, s};
}

__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        MaxSum other;
        other.m = __shfl_xor_sync(0xffffffffu, v.m, offset);
        other.s = __shfl_xor_sync(0xffffffffu, v.s, offset);
        v = merge(v, other);
    }
    return v;
}

// blockDim.x must be a multiple of 32 and at most 1024.
extern "C" __global__ void softmax_rows_online(const float* __restrict__ x, float* __restrict__ out,
                                               long long rows, long long cols) {
    __shared__ float warp_m[32];
    __shared__ float warp_s[32];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const float* __restrict__ xr = x + row * cols;
    float* __restrict__ orow = out + row * cols;

    MaxSum acc = {-INFINITY, 0.0f};
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = xr[j];
        if (v > acc.m) {
            acc.s = (acc.m == -INFINITY ? 0.0f : acc.s * expf(acc.m - v)) + 1.0f;
            acc.m = v;
        } else {
            acc.s += expf(v - acc.m);
        }
    }
    acc = warp_merge(acc);

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    if (lane == 0) {
        warp_m[warp] = acc.m;
        warp_s[warp] = acc.s;
    }
    __syncthreads();
    if (warp == 0) {
        MaxSum w = lane < warps ? MaxSum{warp_m[lane], warp_s[lane]} : MaxSum{-INFINITY, 0.0f};
        w = warp_merge(w);
        if (lane == 0) {
            warp_m[0] = w.m;
            warp_s[0] = w.s;
        }
    }
    __syncthreads();
    const float m = warp_m[0];
    const float inv = 1.0f / warp_s[0];
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
        orow[j] = expf(xr[j] - m) * inv;
    }
}
