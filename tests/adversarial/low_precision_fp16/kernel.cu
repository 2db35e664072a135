// Cheat: reads and writes fp32 like the reference, but converts to half on load and runs the whole
// chain in half arithmetic (about 3 decimal digits), trading accuracy for packed half2-style throughput.

#include <cuda_fp16.h>

extern "C" __global__ void gelu_chain_half(const float* __restrict__ x, float* __restrict__ out, long long n,
                                           float scale, float shift) {
    const __half hs = __float2half(scale);
    const __half hb = __float2half(shift);
    const __half k0 = __float2half(0.7978845608028654f);
    const __half k1 = __float2half(0.044715f);
    const __half half_one = __float2half(0.5f);
    const __half one = __float2half(1.0f);
    const __half lo = __float2half(-1.0f);
    const __half hi = __float2half(4.0f);
    const __half w_act = __float2half(0.75f);
    const __half w_res = __float2half(0.25f);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        __half hx = __float2half(x[i]);
        __half y = __hfma(hx, hs, hb);
        __half inner = __hmul(k0, __hfma(__hmul(k1, __hmul(y, y)), y, y));
        __half t = __float2half(tanhf(__half2float(inner)));
        __half g = __hmul(__hmul(half_one, y), __hadd(one, t));
        g = __hmin(__hmax(g, lo), hi);
        out[i] = __half2float(__hfma(w_act, g, __hmul(w_res, hx)));
    }
}
