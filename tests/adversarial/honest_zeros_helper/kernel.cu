// Honest control: the output starts as zeros (torch.zeros) and two kernels accumulate into it:
// first the residual term 0.25 * x, then the activation term 0.75 * clamp(gelu(x * scale + shift)).
// Each element is owned by one thread, so plain `+=` is race-free; fp32 addition is commutative, so
// (0 + 0.25x) + 0.75g rounds exactly like the reference's 0.75g + 0.25x.

extern "C" __global__ void accumulate_residual(const float* __restrict__ x, float* __restrict__ acc,
                                               long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        acc[i] += 0.25f * x[i];
    }
}

extern "C" __global__ void accumulate_activation(const float* __restrict__ x, float* __restrict__ acc,
                                                 long long n, float scale, float shift) {
    const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    const float k1 = 0.044715f;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float y = x[i] * scale + shift;
        float g = 0.5f * y * (1.0f + tanhf(k0 * (y + k1 * y * y * y)));
        g = fminf(fmaxf(g, -1.0f), 4.0f);
        acc[i] += 0.75f * g;
    }
}
