// Epilogue after a cuDNN convolution (no bias): y = relu(y + conv_bias[c] + bias[c]) * scale, in place on the
// fp32 NCHW convolution output. Memory-bound: one read and one write of y.
//
// One block per (n, c) plane (grid-stride over planes), so the channel and its summed bias are worked out
// once per plane rather than per element. Within a plane: a scalar head up to the first 16-byte boundary,
// 16-byte accesses for the body, a scalar tail, so any H * W (odd planes start misaligned) takes the
// vector path for nearly all of it.
#include <cstdint>

namespace {

constexpr int kUnroll = 4;  // float4s per thread per step: their loads are all issued before use

// A comparison, not fmaxf, so that a NaN passes through as it does in torch.relu.
__device__ __forceinline__ float relu_scale(float v, float b, float scale) {
    v += b;
    return (v < 0.0f ? 0.0f : v) * scale;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256)
bias_relu_scale(float* __restrict__ y, const float* __restrict__ conv_bias, const float* __restrict__ bias,
                long long planes, int channels, long long hw, float scale) {
    for (long long p = blockIdx.x; p < planes; p += gridDim.x) {
        const int c = (int)(p % channels);
        const float b = __ldg(conv_bias + c) + __ldg(bias + c);
        float* __restrict__ plane = y + p * hw;

        // Elements before the first 16-byte boundary (y is at least 4-byte aligned).
        const long long head = min(hw, (long long)(((16 - (reinterpret_cast<uintptr_t>(plane) & 15)) & 15) / 4));
        const long long body = (hw - head) / 4;  // float4s
        if (threadIdx.x < head) plane[threadIdx.x] = relu_scale(plane[threadIdx.x], b, scale);

        float4* __restrict__ p4 = reinterpret_cast<float4*>(plane + head);
        for (long long base = threadIdx.x; base < body; base += (long long)blockDim.x * kUnroll) {
            float4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const long long i = base + (long long)u * blockDim.x;
                if (i < body) v[u] = p4[i];
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const long long i = base + (long long)u * blockDim.x;
                if (i < body) {
                    v[u].x = relu_scale(v[u].x, b, scale);
                    v[u].y = relu_scale(v[u].y, b, scale);
                    v[u].z = relu_scale(v[u].z, b, scale);
                    v[u].w = relu_scale(v[u].w, b, scale);
                    p4[i] = v[u];
                }
            }
        }

        for (long long i = head + body * 4 + threadIdx.x; i < hw; i += blockDim.x)
            plane[i] = relu_scale(plane[i], b, scale);
    }
}
