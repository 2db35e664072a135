"""CUDA shared by every generated kernel: storage conversions, vector accesses, math helpers and reductions.

All math is fp32; storage may be fp32, fp16, bf16, bool or integers. Helpers live in an anonymous
namespace so unused ones cost nothing; kernels are `extern "C"` so the runtime finds them by name.
"""

from __future__ import annotations

import re

# What in a kernel's source needs the fp16/bf16 types and the prelude's helpers for them (render.py).
HALF_TYPES = re.compile(
    r"__half|__nv_bfloat16|__float2half|__float2bfloat16|__bfloat162|__floats2|kp_round_(?:bf16|f16)|kp_gather_b?f16"
)
HALF_DEFINE = "#define KP_HALF_TYPES"

# Helpers written into a source after the prelude only when one of its kernels (or another such helper)
# calls them (render.on_use): the prelude's text is in every source, so a change there changes every
# candidate's key, and the run logs the replay tests answer from (recorded on the GPU) would no longer match.
ON_USE: dict[str, str] = {
    # several short rows a warp (templates/rowwise.py row_lanes): each group of L lanes merged by a butterfly
    # within it; every lane of the group ends with the whole row's (the same bits: the merges commute)
    "lanes_reduce": r"""template <class Op>
__device__ __forceinline__ Acc lanes_reduce(Acc v, Op op, int L) {
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) {
        Acc w;
        w.a = __shfl_xor_sync(0xffffffffu, v.a, o, L);
        w.b = __shfl_xor_sync(0xffffffffu, v.b, o, L);
        w.i = __shfl_xor_sync(0xffffffffu, v.i, o, L);
        v = op(v, w);
    }
    return v;
}""",
    # use_intrinsics (ops.FAST_CALL): the special-function unit's log2 and 2^x (subnormals kept: no .ftz),
    # what --use_fast_math makes of logf and expf; the CPU emulator computes them exactly. A callee comes
    # before its callers: render.on_use emits what the emitted helpers call
    "kp_log2_fast": r"""__device__ __forceinline__ float kp_log2_fast(float x) {
#ifdef KP_EMULATED
    return log2f(x);
#else
    float r;
    asm("lg2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#endif
}""",
    "kp_log_fast": r"""__device__ __forceinline__ float kp_log_fast(float x) {
    return kp_log2_fast(x) * 0.69314718055994531f;
}""",
    "kp_exp2_fast": r"""__device__ __forceinline__ float kp_exp2_fast(float x) {
#ifdef KP_EMULATED
    return exp2f(x);
#else
    float r;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#endif
}""",
    "kp_exp_fast": r"""__device__ __forceinline__ float kp_exp_fast(float x) {
    return kp_exp2_fast(x * 1.4426950408889634f);
}""",
    # mish: tanh(log1p(e)) = n / (n + 2) with n = e (e + 2), e = exp(x): one expf and a division where the
    # prelude's kp_mish makes three library calls (expf, log1pf, tanhf). Its error matches PyTorch's own
    # fp32 mish (3.5e-7 relative at worst over [-110, 45], against 2.6e-7; tests/test_expert.py).
    "kp_mish_exp": r"""__device__ __forceinline__ float kp_mish_exp(float x) {
    const float e = expf(x), n = e * (e + 2.0f);
    return x > 20.0f ? x : x * (n / (n + 2.0f));
}""",
    # digamma in fp32 as ATen computes it on the GPU: reflection below 0 (poles at the non-positive
    # integers, signed infinity at 0), the recurrence psi(x) = psi(x + 1) - 1/x up to 10, then the asymptotic
    # series ln x - 1/(2x) - sum B_2k / (2k x^2k), its seven terms the Bernoulli numbers' (1/12, -1/120, ...)
    "kp_digamma": r"""__device__ __forceinline__ float kp_digamma_pos(float x) {
    float acc = 0.0f;
    while (x < 10.0f) {
        acc -= 1.0f / x;
        x += 1.0f;
    }
    if (x == 10.0f) return acc + 2.25175258906672110764f;  // psi(10)
    const float z = 1.0f / (x * x);
    const float series = z * (8.33333333333333333333e-2f + z * (-8.33333333333333333333e-3f + z * (3.96825396825396825397e-3f
        + z * (-4.16666666666666666667e-3f + z * (7.57575757575757575758e-3f + z * (-2.10927960927960927961e-2f
        + z * 8.33333333333333333333e-2f))))));
    return acc + logf(x) - 0.5f / x - series;
}
__device__ __forceinline__ float kp_digamma(float x) {
    if (x == 0.0f) return copysignf(INFINITY, -x);
    if (x < 0.0f) {
        if (x == truncf(x)) return NAN;
        // pi cot(pi x) from sinpi / cospi: exact argument reduction, where tanf(pi * x) rounds pi * x first
        return kp_digamma_pos(1.0f - x) - 3.14159265358979323846f * cospif(x) / sinpif(x);
    }
    return kp_digamma_pos(x);
}""",
}

PRELUDE = r"""#ifdef KP_HALF_TYPES  // defined only for sources that use fp16/bf16: the headers are most of a small build
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif
#include <math_constants.h>
#include <climits>
#include <cstdint>

namespace kp {  // named, so helpers a kernel does not use draw no "never referenced" warning

// V elements of T in one access (16 bytes for 4 floats or 8 halves), aligned to its size.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
    T v[V];
};

__device__ __forceinline__ float ld(float x) { return x; }
#ifdef KP_HALF_TYPES
__device__ __forceinline__ float ld(__half x) { return __half2float(x); }
__device__ __forceinline__ float ld(__nv_bfloat16 x) { return __bfloat162float(x); }
#endif
__device__ __forceinline__ float ld(bool x) { return x ? 1.0f : 0.0f; }
__device__ __forceinline__ float ld(long long x) { return (float)x; }
__device__ __forceinline__ float ld(int x) { return (float)x; }
__device__ __forceinline__ float ld(unsigned char x) { return (float)x; }
__device__ __forceinline__ float ld(signed char x) { return (float)x; }

template <typename T> __device__ __forceinline__ T cv(float x);
template <> __device__ __forceinline__ float cv<float>(float x) { return x; }
#ifdef KP_HALF_TYPES
template <> __device__ __forceinline__ __half cv<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 cv<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
#endif
template <> __device__ __forceinline__ bool cv<bool>(float x) { return x != 0.0f; }
template <> __device__ __forceinline__ long long cv<long long>(float x) { return (long long)x; }
template <> __device__ __forceinline__ int cv<int>(float x) { return (int)x; }

#ifndef KP_CHECK_ALIGN  // the CPU emulator defines it to catch a misaligned vector access
#define KP_CHECK_ALIGN(p, bytes)
#endif
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> vload(const T* p) {
    KP_CHECK_ALIGN(p, sizeof(T) * V);
    return *reinterpret_cast<const Vec<T, V>*>(p);
}
// One 16- or 8-byte store per vector, in PTX: as a struct copy NVVM splits it into 4-, 4- and 8-byte stores
// (it trusts alignas for loads, not for stores), issued apart in time and leaving partial sectors in L2.
template <typename T, int V>
__device__ __forceinline__ void vstore(T* p, const Vec<T, V>& v) {
    KP_CHECK_ALIGN(p, sizeof(T) * V);
#ifndef KP_EMULATED
    if constexpr (sizeof(T) * V == 16) {
        const int4 b = *reinterpret_cast<const int4*>(&v);
        asm("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(b.x), "r"(b.y), "r"(b.z), "r"(b.w) : "memory");
        return;
    } else if constexpr (sizeof(T) * V == 8) {
        const int2 b = *reinterpret_cast<const int2*>(&v);
        asm("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(b.x), "r"(b.y) : "memory");
        return;
    }
#endif
    *reinterpret_cast<Vec<T, V>*>(p) = v;
}

// Elements before the first V-aligned one of a row that starts `start` elements into an aligned buffer.
template <int V>
__device__ __forceinline__ long long head_of(long long start, long long n) {
    if constexpr (V == 1) return 0;
    const long long h = (V - start % V) % V;
    return h < n ? h : n;
}

// ---- math: NaN-propagating like torch, precise libm calls (no fast-math) ----
__device__ __forceinline__ float kp_sq(float x) { return x * x; }
__device__ __forceinline__ float kp_cube(float x) { return x * x * x; }
__device__ __forceinline__ float kp_relu(float x) { return x < 0.0f ? 0.0f : x; }
__device__ __forceinline__ float kp_max_nan(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
__device__ __forceinline__ float kp_min_nan(float a, float b) { return (a != a || b != b) ? a + b : fminf(a, b); }
__device__ __forceinline__ float kp_max(float a, float b) { return kp_max_nan(a, b); }
__device__ __forceinline__ float kp_min(float a, float b) { return kp_min_nan(a, b); }
__device__ __forceinline__ float kp_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float kp_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float kp_softplus(float x, float beta, float threshold) {
    return x * beta > threshold ? x : log1pf(expf(x * beta)) / beta;
}
__device__ __forceinline__ float kp_mish(float x) { return x * tanhf(kp_softplus(x, 1.0f, 20.0f)); }
__device__ __forceinline__ float kp_gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); }
__device__ __forceinline__ float kp_gelu_tanh(float x) {
    const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(k0 * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float kp_elu(float x, float alpha, float scale, float input_scale) {
    return x > 0.0f ? x * scale : expm1f(x * input_scale) * alpha * scale;
}
__device__ __forceinline__ float kp_celu(float x, float alpha) { return x > 0.0f ? x : alpha * expm1f(x / alpha); }
__device__ __forceinline__ float kp_leaky_relu(float x, float slope) { return x > 0.0f ? x : x * slope; }
__device__ __forceinline__ float kp_hardsigmoid(float x) { return kp_min_nan(kp_max_nan(x + 3.0f, 0.0f), 6.0f) / 6.0f; }
__device__ __forceinline__ float kp_hardswish(float x) { return x * kp_min_nan(kp_max_nan(x + 3.0f, 0.0f), 6.0f) / 6.0f; }
__device__ __forceinline__ float kp_log_sigmoid(float x) { return fminf(x, 0.0f) - log1pf(expf(-fabsf(x))); }
__device__ __forceinline__ float kp_hardshrink(float x, float l) { return (x >= -l && x <= l) ? 0.0f : x; }
__device__ __forceinline__ float kp_softshrink(float x, float l) { return x > l ? x - l : (x < -l ? x + l : 0.0f); }
__device__ __forceinline__ float kp_sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }
__device__ __forceinline__ float kp_frac(float x) { return x - truncf(x); }
__device__ __forceinline__ float kp_remainder(float a, float b) {
    const float r = fmodf(a, b);
    return (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) ? r + b : r;
}
#ifdef KP_HALF_TYPES
__device__ __forceinline__ float kp_round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float kp_round_f16(float x) { return __half2float(__float2half_rn(x)); }
#endif

// ---- reductions: one accumulator type for every kind (unused fields are optimised away) ----
struct Acc {
    float a;      // sum, max, running max, shifted sum
    float b;      // running sum of exp, shifted sum of squares
    long long i;  // index of the extremum (arg* and max/min over a dim)
};

__device__ __forceinline__ Acc shfl_down(Acc v, int o) {
    v.a = __shfl_down_sync(0xffffffffu, v.a, o);
    v.b = __shfl_down_sync(0xffffffffu, v.b, o);
    v.i = __shfl_down_sync(0xffffffffu, v.i, o);
    return v;
}

// The first n lanes of a warp merged into lane 0 (n <= 32).
template <class Op>
__device__ __forceinline__ Acc warp_reduce(Acc v, int n, Op op) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const Acc w = shfl_down(v, o);
        if (lane + o < n) v = op(v, w);
    }
    return v;
}

// Whole-block merge; every thread gets the result. WARP: shuffles then one shared-memory round
// (red holds 33 Accs); otherwise a shared-memory tree (red holds blockDim.x Accs, a power of two).
template <bool WARP, class Op>
__device__ __forceinline__ Acc block_reduce(Acc v, Acc* red, Op op) {
    const int tid = threadIdx.x, nt = blockDim.x;
    __syncthreads();  // red may still be read from the previous call
    if constexpr (WARP) {
        const int lane = tid & 31, warp = tid >> 5, warps = (nt + 31) >> 5;
        v = warp_reduce(v, 32, op);
        if (lane == 0) red[warp] = v;
        __syncthreads();
        if (warp == 0) {
            v = red[lane < warps ? lane : 0];
            v = warp_reduce(v, warps, op);
            if (lane == 0) red[32] = v;
        }
        __syncthreads();
        return red[32];
    }
    red[tid] = v;
    __syncthreads();
    for (int s = nt >> 1; s > 0; s >>= 1) {
        if (tid < s) red[tid] = op(red[tid], red[tid + s]);
        __syncthreads();
    }
    return red[0];
}

// One warp's merge, broadcast to every lane of it.
template <class Op>
__device__ __forceinline__ Acc warp_allreduce(Acc v, Op op) {
    v = warp_reduce(v, 32, op);
    v.a = __shfl_sync(0xffffffffu, v.a, 0);
    v.b = __shfl_sync(0xffffffffu, v.b, 0);
    v.i = __shfl_sync(0xffffffffu, v.i, 0);
    return v;
}

// Online softmax statistics: a = running max, b = sum of exp(x - a).
__device__ __forceinline__ void lse_push(Acc& s, float x) {
    if (x > s.a) {
        s.b = s.b * expf(s.a - x) + 1.0f;
        s.a = x;
    } else if (x != -CUDART_INF_F) {
        s.b += expf(x - s.a);
    }
}
struct LseOp {
    __device__ __forceinline__ Acc operator()(Acc x, Acc y) const {
        const float m = fmaxf(x.a, y.a);
        const float sx = x.a == m ? x.b : x.b * expf(x.a - m);
        const float sy = y.a == m ? y.b : y.b * expf(y.a - m);
        return {m, sx + sy, 0};
    }
};
struct SumOp {  // a and b both summed (sums, shifted moments)
    __device__ __forceinline__ Acc operator()(Acc x, Acc y) const { return {x.a + y.a, x.b + y.b, 0}; }
};
struct ProdOp {
    __device__ __forceinline__ Acc operator()(Acc x, Acc y) const { return {x.a * y.a, 0.0f, 0}; }
};
struct MaxOp {
    __device__ __forceinline__ Acc operator()(Acc x, Acc y) const { return {kp_max_nan(x.a, y.a), 0.0f, 0}; }
};
struct MinOp {
    __device__ __forceinline__ Acc operator()(Acc x, Acc y) const { return {kp_min_nan(x.a, y.a), 0.0f, 0}; }
};
// Extremum with its index: NaN wins (as in torch), ties go to the smaller index.
template <bool MAX>
struct ArgOp {
    __device__ __forceinline__ Acc operator()(Acc x, Acc y) const {
        const bool xn = x.a != x.a, yn = y.a != y.a;
        if (xn || yn) return (xn && yn) ? (x.i <= y.i ? x : y) : (xn ? x : y);
        if (MAX ? x.a > y.a : x.a < y.a) return x;
        if (MAX ? y.a > x.a : y.a < x.a) return y;
        return x.i <= y.i ? x : y;
    }
};

}  // namespace kp
using namespace kp;
"""
