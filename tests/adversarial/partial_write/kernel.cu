// Cheat: a correct fused chain over float4 vectors; the launcher sizes the grid as if each thread
// handled 8 floats, and there is no grid-stride loop, so only the first half of the output is written.

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
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long base = i * 4;
    if (base + 3 < n) {
        float4 v = reinterpret_cast<const float4*>(x)[i];
        float4 r;
        r.x = chain(v.x, scale, shift);
        r.y = chain(v.y, scale, shift);
        r.z = chain(v.z, scale, shift);
        r.w = chain(v.w, scale, shift);
        reinterpret_cast<float4*>(out)[i] = r;
    } else {
        for (long long k = base; k < n; ++k) out[k] = chain(x[k], scale, shift);
    }
}
