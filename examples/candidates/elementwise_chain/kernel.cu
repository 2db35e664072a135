// Elementwise chain fused into one pass: y = 0.75 * clamp(gelu_tanh(x * scale + shift), -1, 4) + 0.25 * x.
// Memory-bound: each element is read once and written once. 16-byte accesses when both pointers are
// 16-byte aligned, a scalar path for the tail (and for everything when they are not).
#include <cstdint>

namespace {

constexpr int kUnroll = 4;  // float4s per thread per iteration: their loads are all issued before use

__device__ __forceinline__ float chain(float x, float scale, float shift) {
    const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    const float k1 = 0.044715f;
    float v = x * scale + shift;
    float g = 0.5f * v * (1.0f + tanhf(k0 * (v + k1 * v * v * v)));
    // Comparisons, not fminf/fmaxf, so that a NaN passes through as it does in torch.clamp.
    g = g < -1.0f ? -1.0f : (g > 4.0f ? 4.0f : g);
    return 0.75f * g + 0.25f * x;
}

}  // namespace

// Any n; launch with a 1-d grid of any size (grid-stride), blockDim.x a multiple of 32.
extern "C" __global__ void __launch_bounds__(256)
elementwise_chain(const float* __restrict__ x, float* __restrict__ y, long long n, float scale, float shift) {
    const bool aligned = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y)) & 15) == 0;
    const long long n4 = aligned ? n / 4 : 0;
    const long long threads = (long long)gridDim.x * blockDim.x;

    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
    float4* __restrict__ y4 = reinterpret_cast<float4*>(y);
    // Block b owns kUnroll consecutive block-widths per step, so each of the kUnroll accesses is coalesced.
    for (long long base = (long long)blockIdx.x * blockDim.x * kUnroll + threadIdx.x; base < n4;
         base += threads * kUnroll) {
        float4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const long long i = base + (long long)u * blockDim.x;
            if (i < n4) v[u] = __ldg(x4 + i);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const long long i = base + (long long)u * blockDim.x;
            if (i < n4) {
                float4 r;
                r.x = chain(v[u].x, scale, shift);
                r.y = chain(v[u].y, scale, shift);
                r.z = chain(v[u].z, scale, shift);
                r.w = chain(v[u].w, scale, shift);
                y4[i] = r;
            }
        }
    }
    // Scalar remainder: the last n % 4 elements, or all of them when a pointer is misaligned.
    for (long long i = n4 * 4 + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += threads)
        y[i] = chain(__ldg(x + i), scale, shift);
}
