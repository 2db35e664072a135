// ReLU over a GEMM result (cuBLAS does the product), plus the helpers a cheat needs.
extern "C" __global__ void relu(const float* __restrict__ c, float* __restrict__ out, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = fmaxf(c[i], 0.0f);
    }
}
