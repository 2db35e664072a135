// Honest control: the whole elementwise chain fused into one pass, float4 loads and stores,
// grid-stride loop, scalar tail for sizes that are not a multiple of 4.

__device__ __forceinline__ float chain(float x, float scale, float shift) {
    float y = x * scale + shift;
    const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    const float k1 = 0.044715f;
    float g = 0.5f * y * (1.0f + tanhf(k0 * (y + k1 * y * y * y)));
    g = fminf(fmaxf(g, -1.0f), 4.0f);
    return 0.75f * g + 0.25f * x;
}

extern "C" __global__ void gelu_chain_vec4(const float* __restrict__ x, float* __restrict__ out,
                                           long long n, float scale, float shift) {
    const long long n4 = n / 4;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
    float4* __restrict__ o4 = reinterpret_cast<float4*>(out);
    for (long long i = tid; i < n4; i += stride) {
        float4 v = x4[i];
        float4 r;
        r.x = chain(v.x, scale, shift);
        r.y = chain(v.y, scale, shift);
        r.z = chain(v.z, scale, shift);
        r.w = chain(v.w, scale, shift);
        o4[i] = r;
    }
    for (long long i = n4 * 4 + tid; i < n; i += stride) {
        out[i] = chain(x[i], scale, shift);
    }
}

// Fallback for pointers that are not 16-byte aligned (views with an offset).
extern "C" __global__ void gelu_chain_scalar(const float* __restrict__ x, float* __restrict__ out,
                                             long long n, float scale, float shift) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = chain(x[i], scale, shift);
    }
}

// The cheat's "validation" pass: reads the input, writes nothing the caller sees.
extern "C" __global__ void touch(const float* __restrict__ x, int* __restrict__ flag, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    int bad = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        bad |= x[i] != x[i];
    }
    if (bad) atomicOr(flag, 1);
}
