"""The fp16x3 form of our fp32 implicit-GEMM convolution (templates/conv_tf32.py; plan knob `ConvPlan.f16`):
its three products on fp16 WGMMAs at twice tf32's rate, as accurate as 3xTF32 (templates/gemm_f16x3.py says
why: 11 + 11 significant bits in hi and lo, sums promoted to fp32 registers every 128 of K).

The GEMM's lines are scaled by powers of two so that fp16's range holds them:
- B (the weight, a row an output channel): our weight kernel finds each row's largest magnitude and
  writes the row's fp16 hi and lo planes (the GEMM's split, `kp_f16x3_cut`), and the row's power of two.
- A (the gathered input) has no lines in memory: a row is an output pixel's window. Its scale is its
  image's: a small kernel first takes each image's largest magnitude (one read of the input), and each
  gatherer scales its row's values by its image's power of two as it cuts them into hi and lo (one exact
  multiply). An element far below its image's largest (under 2^-28 of it) keeps fewer bits, an absolute
  error at most about 2^-40 of that largest.
- Exponents are held at -126 or above (`kp_conv_exp`), so each power of two and its inverse is a float: an
  image or weight row whose largest magnitude is under 2^-111 is scaled less than the GEMM's split would.
- The stores multiply each sum by its image's and its channel's powers of two before the fused epilogue.

Everything else is the 3xTF32 convolution's: its gathers (32 fp32 values of a row a k tile, the next
tile's loads in flight while this one is cut and stored), its phases, its weight order, its consumer loop
and its stores. A k tile stays 32 deep, so K, the phases' columns and the gathers are unchanged: its rows
are 64 bytes of fp16, in the 64-byte swizzle (16-byte chunk c of row t at c ^ ((t / 2) % 4)), and a stage
is half the 3xTF32 one's bytes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pipeline.generate.expert import atoms
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates import conv_tf32, gemm, gemm_f16x3, gemm_tf32
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.conv_tf32 import BK, ConvEpilogue, ConvForm
from pipeline.generate.expert.templates.gemm import BM, GROUP, SMEM_LIMIT
from pipeline.generate.expert.templates.signature import Signature, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.gemm_kit import GemmPlan

ALIGN = 8  # fp16 elements per 16 bytes: the weight planes' rows (TMA's rule)
_HALF = 2


def stage_bytes(bn: int) -> int:
    """A (gathered) and its lo, B and its lo, in fp16."""
    return 2 * (BM + bn) * BK * _HALF


def max_stages(bn: int) -> int:
    return min(conv_tf32.MAX_STAGES, (SMEM_LIMIT - 2048) // stage_bytes(bn))


def smem_bytes(bn: int, stages: int) -> int:
    return stage_bytes(bn) * stages + 1024 + 1024


def blocks(bn: int, hunter: Any = None) -> dict[str, atoms.Atom]:
    """The fp16x3 GEMM's, with 64-byte rows and the fence the gatherers' stores need."""
    return {
        **gemm_f16x3.blocks(bn, hunter),
        "smem": atoms.find(atoms.SW64_K, hunter),
        "fence": atoms.find(atoms.FENCE_ASYNC_SHARED, hunter),
    }


# 2^k as a float for k in [-126, 127]; eight values of a row scaled by sc (a power of two: exact) and
# cut into fp16 hi and lo, each rounded to nearest as the GEMM's split cuts them (kp_f16x3_cut), two at a
# time (plain C++ but for the intrinsics: tests run it on the CPU). Defined once in a source of several
# convolutions, after gemm_f16x3.CUT.
CUT8 = r"""#ifndef KP_CONV_CUT8
#define KP_CONV_CUT8
__device__ __forceinline__ float kp_pow2(int k) { return __int_as_float((k + 127) << 23); }
// A line's exponent (kp_f16x3_exp) held at -126 or above, so that 2^-e and 2^e are floats: a line of
// magnitudes under 2^-111 is scaled less than the GEMM's split would (its max under 2^15 all the same).
__device__ __forceinline__ int kp_conv_exp(float mx) { return max(kp_f16x3_exp(mx), -126); }
__device__ __forceinline__ void cut8(const float* v, float sc, uint4& h, uint4& l) {
    unsigned hw[4], lw[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float a = v[2 * i] * sc, b = v[2 * i + 1] * sc;
        const __half2 hh = __floats2half2_rn(a, b);
        const float2 back = __half22float2(hh);
        const __half2 ll = __floats2half2_rn(a - back.x, b - back.y);
        hw[i] = *reinterpret_cast<const unsigned*>(&hh);
        lw[i] = *reinterpret_cast<const unsigned*>(&ll);
    }
    h = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    l = make_uint4(lw[0], lw[1], lw[2], lw[3]);
}
#endif
"""
# A 16-byte shared store: the compiler splits what it cannot prove aligned.
STS16 = r"""__device__ __forceinline__ void sts16(void* p, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
                 :: "r"((unsigned)__cvta_generic_to_shared(p)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}"""

# A gatherer's scale: its row's image's power of two (rows past M: none).
ROW_SCALE = r"""        const long long pt = (long long)m_blk * BM + t;  // this row's pixel
        const float sc = kp_pow2(pt < M ? -kp_conv_exp(__uint_as_float(amax[pt / PIX])) : 0);
"""
STORE_F16 = r"""            T* ah = s.a + st * BM * BK + t * BK;
            T* al = s.alo + st * BM * BK + t * BK;
            #pragma unroll
            for (int c = 0; c < BK / 8; ++c) {
                uint4 h, l;
                cut8(v + 8 * c, sc, h, l);
                const int at = (c ^ ((t >> 1) % 4)) * 8;  // the 64-byte swizzle of a K-major row
                sts16(ah + at, h);
                sts16(al + at, l);
            }
"""
# The sums unscaled by their image's and channel's powers of two, two multiplies. A tile within one image (most
# of them) reads the image's once; one across images, each row's (a 64-bit division: the image of a pixel).
# A thread's rows change every other sum: recomputed as they came, with an ldexpf an output, its short-K
# tiles ran 1.5-2x longer than 3xTF32's (H100). The product is exact but where it leaves fp32's normal range:
# an output under about 2^-120 of scale then loses bits, one over 2^127 is inf as it would be.
UNSCALE = r"""
    if (m0 / PIX == (min(m0 + BM, (long long)M) - 1) / PIX) {  // the tile within one image
        const float rf = kp_pow2(kp_conv_exp(__uint_as_float(amax[m0 / PIX])));
        CUTE_UNROLL
        for (int i = 0; i < size(acc); ++i) {
            const int co = n0 + get<1>(tCcC(i));
            if (co < N) acc(i) *= rf * wf[co];
        }
    } else {
        CUTE_UNROLL
        for (int i = 0; i < size(acc); ++i) {
            const long long p = m0 + get<0>(tCcC(i));
            const int co = n0 + get<1>(tCcC(i));
            if (p < M && co < N) acc(i) *= kp_pow2(kp_conv_exp(__uint_as_float(amax[p / PIX]))) * wf[co];
        }
    }
"""


def weight_kernel(rid: str, f: ConvForm) -> str:
    """The weight as the GEMM's B in fp16 halves (plane 0 hi, plane 1 lo; rows of output channels, each K8
    long in the gather's K order, zero-padded to 16 bytes), and each row's power of two 2^e (its values
    were scaled by 2^-e): a block a row."""
    k8 = -(-conv_tf32.gemm_k(f) // ALIGN) * ALIGN
    table, inside, at = conv_tf32.weight_map(rid, f)
    value = f"{inside} ? src[{at}] : 0.f"
    return (
        table
        + f"""extern "C" __global__ void __launch_bounds__(256)
kp_{rid}_w(const float* __restrict__ src, __half* __restrict__ dst, float* __restrict__ pow2) {{
    __shared__ float part[8];
    for (long long row = blockIdx.x; row < {f.cout}; row += gridDim.x) {{
        float mx = 0.f;
        for (int col = threadIdx.x; col < {k8}; col += 256) mx = fmaxf(mx, fabsf({value}));
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = mx;
        __syncthreads();
        float m = part[0];
        for (int w = 1; w < 8; ++w) m = fmaxf(m, part[w]);
        const int e = kp_conv_exp(m);
        if (threadIdx.x == 0) pow2[row] = kp_pow2(e);
        for (int col = threadIdx.x; col < {k8}; col += 256) {{
            const float v = {value};
            kp_f16x3_cut(v, e, dst[row * {k8} + col], dst[{f.cout * k8}LL + row * {k8} + col]);
        }}
        __syncthreads();  // part is the next row's
    }}
}}"""
    )


def amax_kernel(rid: str) -> str:
    """Each image's largest magnitude, as its float's bits (ordered as unsigned ints: atomicMax), into a
    zeroed array; blocks along x share an image, along y walk the images."""
    return f"""extern "C" __global__ void __launch_bounds__(256)
kp_{rid}_amax(const float* __restrict__ x, unsigned* __restrict__ amax, long long images) {{
    using namespace kp_{rid};
    const bool vec = IMAGE % 4 == 0 && ((unsigned long long)x & 15) == 0;
    const long long step = (long long)gridDim.x * 256;
    for (long long img = blockIdx.y; img < images; img += gridDim.y) {{
        const float* p = x + img * IMAGE;
        float m = 0.f;
        if (vec) {{
            const float4* p4 = reinterpret_cast<const float4*>(p);
            for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < IMAGE / 4; i += step) {{
                const float4 v = p4[i];
                m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
            }}
        }} else {{
            for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < IMAGE; i += step) m = fmaxf(m, fabsf(p[i]));
        }}
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (threadIdx.x % 32 == 0 && m > 0.f) atomicMax(amax + img, __float_as_uint(m));
    }}
}}"""


def _smem(b: dict[str, atoms.Atom], smem: int) -> list[str]:
    return [
        *gemm_f16x3.stage_decls(b, ready=True),
        f'static_assert(sizeof(Smem) + 1024 <= {smem}, "the launcher\'s shared-memory size is too small");',
    ]


def _replace(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def render(
    r: Region, f: ConvForm, rp: GemmPlan, epi: ConvEpilogue | None, hunter: Any = None, sinkable: bool = False
) -> Code:
    """The kernels and the launcher of an fp32 convolution region in the fp16x3 form (conv_tf32.render's
    contract: sinkable, AtomNotFound)."""
    rid, bn = r.rid, rp.bn
    stages = max(2, min(rp.stages, max_stages(bn)))  # a 3xTF32 plan's ring was counted in fp32 tiles
    b = blocks(bn, hunter)
    smem = smem_bytes(bn, stages)
    out_dt = epi.out_dtype if epi else "float32"
    into = out_dt if sinkable and not conv_tf32.sinks_blocked(epi) else ""
    pix = "Q.pix" if conv_tf32.phased(f) else "P"
    lines = [
        *gemm.preamble(rid, b),
        "using T = cutlass::half_t;",
        f"constexpr int BM = {BM}, BN = {bn}, BK = {BK}, STAGES = {stages}, GROUP = {GROUP}, "
        f"PROMOTE = {gemm_tf32.PROMOTE}, GATHERERS = {conv_tf32.gatherers(bn)};",
        conv_tf32.geometry(f),
        *_smem(b, smem),
        STS16,
        f"}}  // namespace kp_{rid}",
        gemm_f16x3.CUT,
        CUT8,
        *gemm.epilogue_function(epi, out_dt),
        weight_kernel(rid, f),
        amax_kernel(rid),
    ]
    base = conv_tf32.signature(epi, out_dt, bool(into))
    sig = Signature((*base.params, ptr("amax", "unsigned"), ptr("wf", "float")))
    text = _replace(
        conv_tf32.body(f, STORE_F16, ROW_SCALE), "2 * BN * BK * sizeof(float)", "2 * BN * BK * sizeof(T)"
    )
    ring = dataclasses.replace(rp, stages=stages)  # the launcher's words name the ring it runs
    kernels = (f"kp_{rid}_conv", f"kp_{rid}_w", f"kp_{rid}_amax")
    return conv_tf32.region_code(r, f, ring, epi, b, lines, text, sig, smem, into, kernels,
                                 UNSCALE.replace("PIX", pix), prep(rid, f))  # fmt: skip


def prep(rid: str, f: ConvForm) -> conv_tf32.Prep:
    """The launcher's preparation: the weight's fp16 planes and rows' powers of two, each image's largest
    magnitude (its kernel launched first), and a tensor map of fp16 rows in the 64-byte swizzle."""
    k8 = -(-conv_tf32.gemm_k(f) // ALIGN) * ALIGN
    image = f.cin * f.size[0] * f.size[1] * f.size[2]
    return conv_tf32.Prep(
        "our fp16x3 WGMMA kernel (operands scaled and cut into fp16 halves; ",
        (
            f"    wk = torch.empty((2, n, {k8}), dtype=torch.float16, device=x.device)  # B's hi and lo planes",
            "    wf = torch.empty(n, dtype=torch.float32, device=x.device)  # each row's power of two",
            f"    kernels.kp_{rid}_w((max(1, min(n, MAX_GRID_Y * 32)),), (256,), (w, wk, wf))  # noqa: F821",
            "    amax = torch.zeros(nb, dtype=torch.int32, device=x.device)  # each image's largest |x|, its bits",
        ),
        (
            f"        blocks = max(1, min(-(-{image} // 8192), 256))",
            f"        kernels.kp_{rid}_amax((blocks, min(nb, 65535)), (256,), (x, amax, numpy.int64(nb)))  # noqa: F821",
        ),
        ", 64",
    )
