"""The triplet margin loss over three fp32 (N, D) tensors in one pass (families/triplet.py).

A warp a row: its lanes read the anchor, positive and negative rows once (16 bytes at a time where D % 4 ==
0 and the three are 16-byte aligned; the scalar kernel otherwise), each thread's loads of all three issued
before any is used, and sum |a - p + eps|^k and |a - n + eps|^k (k = 2, or 1 for p = 1) together. The
warp merges the two sums, and lane 0 takes max(margin + d(a, p) - d(a, n), 0) (NaN kept), with d the sum's
square root for p = 2. Without a reduction each row's loss is stored; with one, each block adds its rows'
losses in a fixed order into a partial and a one-block kernel adds the partials in order (over N for the
mean). Decomposed, the loss is two row reductions that each read the anchor: four streams for three.
"""

from __future__ import annotations

from pipeline.generate.expert import ops
from pipeline.generate.expert.fused_losses import Triplet
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.signature import (
    Signature,
    balanced_blocks,
    i32,
    i64,
    ptr,
    row_kernels,
    row_launch,
)

U = 4  # 16-byte loads a lane has in flight per operand (12 in all)

_BODY = r"""namespace kp_{rid} {{
constexpr int D = {cols}, WARPS = {warps};
constexpr float MARGIN = {margin}, EPS = {eps};
constexpr bool P1 = {p1}, REDUCE = {reduce};
__device__ __forceinline__ float term(float d) {{ return P1 ? fabsf(d) : d * d; }}
__device__ __forceinline__ float terms(float4 a, float4 b) {{
    return term(a.x - b.x + EPS) + term(a.y - b.y + EPS) + term(a.z - b.z + EPS) + term(a.w - b.w + EPS);
}}
}}  // namespace kp_{rid}
template <bool VEC>
__device__ __forceinline__ void kp_{rid}_rows_body({decls}) {{
    using namespace kp_{rid};
    __shared__ float bsum[WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float wsum = 0.0f;  // this warp's rows, in order (lane 0's)
    for (long long row = (long long)blockIdx.x * WARPS + warp; row < rows; row += (long long)gridDim.x * WARPS) {{
        const long long base = row * D;
        float sp = 0.0f, sn = 0.0f;
        if (VEC) {{  // D % 4 == 0 and 16-byte aligned rows
            constexpr int NV = D / 4;
            const float4* av = reinterpret_cast<const float4*>(xa + base);
            const float4* pv = reinterpret_cast<const float4*>(xp + base);
            const float4* nv = reinterpret_cast<const float4*>(xn + base);
            for (int c0 = lane; c0 < NV; c0 += 32 * {u}) {{
                float4 ta[{u}], tp[{u}], tn[{u}];
#pragma unroll
                for (int u = 0; u < {u}; ++u)
                    if (c0 + u * 32 < NV) {{
                        ta[u] = __ldg(av + c0 + u * 32);
                        tp[u] = __ldg(pv + c0 + u * 32);
                        tn[u] = __ldg(nv + c0 + u * 32);
                    }}
#pragma unroll
                for (int u = 0; u < {u}; ++u)
                    if (c0 + u * 32 < NV) {{
                        sp += terms(ta[u], tp[u]);
                        sn += terms(ta[u], tn[u]);
                    }}
            }}
        }} else {{
#pragma unroll 4
            for (int c = lane; c < D; c += 32) {{
                const float x = xa[base + c];
                sp += term(x - xp[base + c] + EPS);
                sn += term(x - xn[base + c] + EPS);
            }}
        }}
        const Acc s = warp_allreduce(Acc{{sp, sn, 0}}, SumOp());
        if (lane == 0) {{
            const float v = MARGIN + (P1 ? s.a : sqrtf(s.a)) - (P1 ? s.b : sqrtf(s.b));
            const float loss = v < 0.0f ? 0.0f : v;  // clamp_min: NaN stays NaN
            if (REDUCE) {{
                wsum += loss;
            }} else {{
                out[row] = loss;
            }}
        }}
    }}
    if (!REDUCE) return;
    if (lane == 0) bsum[warp] = wsum;
    __syncthreads();
    if (threadIdx.x == 0) {{
        float a = 0.0f;
        for (int w = 0; w < WARPS; ++w) a += bsum[w];
        part[blockIdx.x] = a;
    }}
}}
{wrappers}
// The partials in a fixed order (a tree over 1024 threads): the result does not depend on timing.
extern "C" __global__ void __launch_bounds__(1024) kp_{rid}_total(const float* __restrict__ part,
                                                                  float* __restrict__ total, int blocks, long long rows) {{
    __shared__ float a[1024];
    float s = 0.0f;
    for (int i = threadIdx.x; i < blocks; i += 1024) s += part[i];
    a[threadIdx.x] = s;
    __syncthreads();
    for (int w = 512; w > 0; w >>= 1) {{
        if ((int)threadIdx.x < w) a[threadIdx.x] += a[threadIdx.x + w];
        __syncthreads();
    }}
    if (threadIdx.x == 0) total[0] = {mean} ? a[0] / (float)rows : a[0];
}}
"""


def render(r: Region, f: Triplet, threads: int, vec: bool) -> Code:
    rid = r.rid
    warps = threads // 32
    vec = vec and f.cols % 4 == 0
    sig = Signature((ptr("xa", "float", "a"), ptr("xp", "float", "p"), ptr("xn", "float", "n"),
                     ptr("out", "float", "loss", const=False), ptr("part", "float", const=False), i64("rows")))  # fmt: skip
    names, wrappers = row_kernels(rid, sig, threads, vec)
    cuda = _BODY.format(
        rid=rid, cols=f.cols, warps=warps, margin=ops.lit(f.margin), eps=ops.lit(f.eps),
        p1="true" if f.p == 1.0 else "false", reduce="true" if f.reduction else "false", decls=sig.decls(),
        wrappers=wrappers, mean="true" if f.reduction == 1 else "false", u=U,
    )  # fmt: skip
    total = Signature((ptr("part", "float"), ptr("total", "float", "loss", const=False), i32("blocks"),
                       i64("rows")))  # fmt: skip

    def launch(pad: str) -> list[str]:  # the float4 kernel where the three inputs are 16-byte aligned
        return row_launch(rid, sig, threads, vec, "_aligned((a, p, n), 4)", pad)

    shape = (f.rows, f.cols)
    launcher = "\n".join([
        f"def _triplet_{rid}(sms, a, p, n):",
        f'    """The triplet margin loss over rows of {f.cols} in one pass, a warp a row ({threads} threads a block)."""',
        f"    if tuple(a.shape) != {shape} or tuple(p.shape) != {shape} or tuple(n.shape) != {shape}:",
        f"        raise ValueError(f'kernelpro expert: three {shape} tensors expected, not "
        "{tuple(a.shape)}, {tuple(p.shape)} and {tuple(n.shape)}')",
        "    a, p, n = _contig(a), _contig(p), _contig(n)",
        "    rows = a.shape[0]",
        f"    blocks = {balanced_blocks('rows', warps, threads)}",
        *(["    loss = torch.empty((rows,), dtype=torch.float32, device=a.device)",
           "    part = loss",
           *launch("    ")]
          if f.reduction == 0 else
          ["    loss = torch.empty((), dtype=torch.float32, device=a.device)",
           "    part = torch.empty((blocks,), dtype=torch.float32, device=a.device)",
           *launch("    "),
           f"    kernels.kp_{rid}_total((1,), (1024,), ({total.args()}))  # noqa: F821"]),
        "    return loss",
    ])  # fmt: skip
    kernel_names = tuple(names) + (() if f.reduction == 0 else (f"kp_{rid}_total",))
    return Code(
        cuda, launcher, f"_triplet_{rid}", kernel_names, tuple(x.name for x in r.node.args[:3]), r.outputs
    )


__all__ = ["render"]
