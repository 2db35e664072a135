"""cosine_similarity of two fp32 tensors over their last dim in one pass (families/cosine.py).

A warp a row: its lanes read both rows once (16 bytes at a time where D % 4 == 0 and both are 16-byte
aligned; the scalar kernel otherwise), each lane's loads issued before any is used, and sum x1 * x2, x1^2
and x2^2 together; the warp merges the three sums (a fixed butterfly), and lane 0 stores
dot / (max(|x1|, eps) * max(|x2|, eps)) as the decomposition does (ATen divides each operand by its
clamped norm before the sum: the same value up to rounding). Decomposed it was three row sums: four reads
of an operand's size for two.
"""

from __future__ import annotations

from pipeline.generate.expert import ops
from pipeline.generate.expert.fused_losses import Cosine
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.signature import (
    Signature,
    balanced_blocks,
    i64,
    ptr,
    row_kernels,
    row_launch,
)

U = 4  # 16-byte loads a lane has in flight per operand

_BODY = r"""namespace kp_{rid} {{
constexpr int D = {cols}, WARPS = {warps};
constexpr float EPS = {eps};
__device__ __forceinline__ float warp_sum(float v) {{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}}
}}  // namespace kp_{rid}
template <bool VEC>
__device__ __forceinline__ void kp_{rid}_rows_body({decls}) {{
    using namespace kp_{rid};
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (long long row = (long long)blockIdx.x * WARPS + warp; row < rows; row += (long long)gridDim.x * WARPS) {{
        const long long base = row * D;
        float d = 0.0f, s1 = 0.0f, s2 = 0.0f;
        if (VEC) {{  // D % 4 == 0 and 16-byte aligned rows
            constexpr int NV = D / 4;
            const float4* av = reinterpret_cast<const float4*>(x1 + base);
            const float4* bv = reinterpret_cast<const float4*>(x2 + base);
            for (int c0 = lane; c0 < NV; c0 += 32 * {u}) {{
                float4 ta[{u}], tb[{u}];
#pragma unroll
                for (int u = 0; u < {u}; ++u)
                    if (c0 + u * 32 < NV) {{
                        ta[u] = __ldg(av + c0 + u * 32);
                        tb[u] = __ldg(bv + c0 + u * 32);
                    }}
#pragma unroll
                for (int u = 0; u < {u}; ++u)
                    if (c0 + u * 32 < NV) {{
                        const float4 a = ta[u], b = tb[u];
                        d += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                        s1 += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
                        s2 += b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
                    }}
            }}
        }} else {{
#pragma unroll 4
            for (int c = lane; c < D; c += 32) {{
                const float a = x1[base + c], b = x2[base + c];
                d += a * b;
                s1 += a * a;
                s2 += b * b;
            }}
        }}
        d = warp_sum(d);
        s1 = warp_sum(s1);
        s2 = warp_sum(s2);
        if (lane == 0) out[row] = d / (fmaxf(sqrtf(s1), EPS) * fmaxf(sqrtf(s2), EPS));
    }}
}}
{wrappers}
"""


def render(r: Region, f: Cosine, threads: int, vec: bool) -> Code:
    rid = r.rid
    warps = threads // 32
    vec = vec and f.cols % 4 == 0
    sig = Signature((ptr("x1", "float", "a"), ptr("x2", "float", "b"), ptr("out", "float", "y", const=False),
                     i64("rows")))  # fmt: skip
    names, wrappers = row_kernels(rid, sig, threads, vec)
    cuda = _BODY.format(
        rid=rid, cols=f.cols, warps=warps, eps=ops.lit(f.eps), decls=sig.decls(), wrappers=wrappers, u=U
    )
    launch = row_launch(rid, sig, threads, vec, "_aligned((a, b), 4)", "    ")
    shape = f.shape
    launcher = "\n".join([
        f"def _cosine_{rid}(sms, a, b):",
        f'    """The cosine similarity over rows of {f.cols} in one pass, a warp a row ({threads} threads a block)."""',
        f"    if tuple(a.shape) != {shape} or tuple(b.shape) != {shape}:",
        f"        raise ValueError(f'kernelpro expert: two {shape} tensors expected, not {{tuple(a.shape)}} and "
        "{tuple(b.shape)}')",
        "    a, b = _contig(a), _contig(b)",
        f"    rows = {f.rows}",
        f"    y = torch.empty({shape[:-1]}, dtype=torch.float32, device=a.device)",
        f"    blocks = {balanced_blocks('rows', warps, threads)}",
        *launch,
        "    return y",
    ])  # fmt: skip
    return Code(
        cuda, launcher, f"_cosine_{rid}", tuple(names), tuple(x.name for x in r.node.args[:2]), r.outputs
    )


__all__ = ["render"]
