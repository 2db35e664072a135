"""Attention over few keys on the CUDA cores: one query row to a group of lanes, plain fp32 FMAs, no tf32
split (which attentions take it: families/attention.py).

The tensor-core kernel (attention.py) gives a block 64 query rows of one (batch, head) and walks keys in tiles
of 32 or 64. Over short sequences most of that is empty: level 3's ViT runs nn.TransformerEncoder without
batch_first, so its attention is over the 2 images of a batch, 1576 (token, head) pairs each 2 x 2, and the
tensor-core kernel spent 37 us a layer on 4 MB of operands. Here each row is LANES lanes (a float4 of the
head dim each, LANES the largest power of two up to 32 that divides D / 4 and DV / 4): the row's dot
product with each key is an FMA chain and a shuffle tree over the group, the softmax is online over the
keys one at a time (exp2 of the difference to the running maximum, as the tensor-core kernel), and P V is
added in fp32 FMAs. Rows of all (batch, head) pairs are numbered flat, so short sequences fill every
block. The score chain (scale, mask, the reference's own elementwise ops) and causality are the tensor-core
kernel's own (attention.score_lines); causal keys are masked, the walk over the keys the same for
every row, so that a warp's shuffles stay converged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates import attention
from pipeline.generate.expert.templates.attention import AttnForm
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.signature import i64

if TYPE_CHECKING:
    from pipeline.generate.expert.families.attention import AttnPlan

THREADS = 128


def lanes(f: AttnForm) -> int:
    """Lanes a query row: the largest power of two up to 32 whose float4 chunks tile both head dims."""
    n = 32
    while n > 1 and ((f.d // 4) % n or (f.dv // 4) % n):
        n //= 2
    return n


def render(r: Region, f: AttnForm, rp: AttnPlan) -> Code:
    rid, per_row = r.rid, lanes(f)
    extras = attention.extra_operands(f)
    sig = attention.signature(f, extras, i64("rows", "n * h * lq"))
    chain = attention.chain_functions(f)
    score = "\n".join(f"        {x}" for ln in attention.score_lines(f, 0, False) for x in ln.split("\n"))
    # Causal keys are masked, not skipped: every group of a warp walks all S keys, so the shuffles, which
    # name the whole warp, stay converged.
    causal = "\n        if (col > i) x = -CUDART_INF_F;" if f.causal else ""
    weigh = (
        """        // online softmax: the running maximum, the sum and the output rescaled by exp(old - new)
        const float mn = fmaxf(mx, x), base = mn == -CUDART_INF_F ? 0.f : mn;
        const float al = exp2f((mx - base) * LOG2E), p = exp2f((x - base) * LOG2E);
        sum = fmaf(sum, al, p);
        mx = mn;"""
        if f.softmax
        else "        const float al = 1.f, p = x;  // the chain's activation weighs V itself"
    )
    inv = "1.f / sum" if f.softmax else "1.f"
    q_norm, k_sum0, k_sum, k_norm = _norm_lines(f)
    cuda = f"""{chain}
namespace kp_{rid} {{
constexpr int D = {f.d}, DV = {f.dv}, LANES = {per_row}, THREADS = {THREADS};
constexpr int QC = D / (4 * LANES), VC = DV / (4 * LANES);  // float4 chunks a lane
constexpr float LOG2E = 1.4426950408889634f;{attention.eps_constants(f)}
}}  // namespace kp_{rid}
extern "C" __global__ void __launch_bounds__({THREADS}) kp_{rid}_attn({sig.decls()}) {{
    using namespace kp_{rid};
    const int sub = threadIdx.x % LANES;
    const long long mine = (long long)blockIdx.x * (THREADS / LANES) + threadIdx.x / LANES;
    // Past the last row a group computes the last row again and stores nothing: every lane stays for the
    // shuffles.
    const bool live = mine < rows;
    const long long row = live ? mine : rows - 1;
    const long long i = row % L, bh = row / L, b = bh / heads, h = bh - b * heads, hk = h / hg;
    const long long r0 = i;
    (void)r0;
    {attention.row_offsets(extras, (0,), f.split)}
    const float* qr = q + b * qs0 + h * qs1 + i * qs2;
    const float* kb = k + b * ks0 + hk * ks1;
    const float* vb = v + b * vs0 + hk * vs1;
    float4 qv[QC], o[VC];
    #pragma unroll
    for (int c = 0; c < QC; ++c) qv[c] = *reinterpret_cast<const float4*>(qr + (c * LANES + sub) * 4);
{q_norm}    #pragma unroll
    for (int c = 0; c < VC; ++c) o[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    float mx = -CUDART_INF_F, sum = 0.f;  // the running maximum and sum (m names the mask)
    (void)mx;
    (void)sum;
    for (long long col = 0; col < S; ++col) {{
        const float* kr = kb + col * ks2;
        float x = 0.f{k_sum0};
        #pragma unroll
        for (int c = 0; c < QC; ++c) {{
            const float4 kv = *reinterpret_cast<const float4*>(kr + (c * LANES + sub) * 4);
            x = fmaf(qv[c].x, kv.x, fmaf(qv[c].y, kv.y, fmaf(qv[c].z, kv.z, fmaf(qv[c].w, kv.w, x))));{k_sum}
        }}
        #pragma unroll
        for (int off = LANES / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off, LANES);
{k_norm}{score}{causal}
{weigh}
        const float* vr = vb + col * vs2;
        #pragma unroll
        for (int c = 0; c < VC; ++c) {{
            const float4 vv = *reinterpret_cast<const float4*>(vr + (c * LANES + sub) * 4);
            o[c] = make_float4(fmaf(p, vv.x, o[c].x * al), fmaf(p, vv.y, o[c].y * al),
                               fmaf(p, vv.z, o[c].z * al), fmaf(p, vv.w, o[c].w * al));
        }}
    }}
    if (!live) return;
    const float inv = {inv};
    float* orow = out + b * outs0 + h * outs1 + i * outs2;
    #pragma unroll
    for (int c = 0; c < VC; ++c)
        *reinterpret_cast<float4*>(orow + (c * LANES + sub) * 4) =
            make_float4(o[c].x * inv, o[c].y * inv, o[c].z * inv, o[c].w * inv);
}}
"""
    groups = THREADS // per_row
    call = (
        f"kernels.kp_{rid}_attn((-(-(n * h * lq) // {groups}),), ({THREADS},), ({sig.args()}))  # noqa: F821"
    )
    how = f"on the CUDA cores in fp32: a query row to {per_row} lanes, {groups} rows a block"
    launcher = attention.launcher(rid, f, sig, extras, how, call)
    return Code(cuda, launcher, f"_attn_{rid}", (f"kp_{rid}_attn",), attention.args(f), (f.out,), at=rp.pv)


# x / max(||x||, eps), as F.normalize: a NaN norm stays NaN (clamp_min keeps it)
_CLAMP = "n = n < EPS_{t} ? EPS_{t} : n;"


def _norm_lines(f: AttnForm) -> tuple[str, str, str, str]:
    """F.normalize over the head dim, fused: Q's row scaled once loaded; each key's dot product divided by the
    key row's norm, summed beside it over the same chunks and lanes. Empty where no norm is fused."""
    q_norm = k_sum0 = k_sum = k_norm = ""
    if f.norm_q is not None:
        q_norm = (
            "    {  // F.normalize of the query row\n"
            "        float ss = 0.f;\n"
            "        #pragma unroll\n"
            "        for (int c = 0; c < QC; ++c) ss += qv[c].x * qv[c].x + qv[c].y * qv[c].y + qv[c].z * qv[c].z + qv[c].w * qv[c].w;\n"
            "        #pragma unroll\n"
            "        for (int off = LANES / 2; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off, LANES);\n"
            f"        float n = sqrtf(ss);\n        {_CLAMP.format(t='Q')}\n"
            "        #pragma unroll\n"
            "        for (int c = 0; c < QC; ++c) qv[c] = make_float4(qv[c].x / n, qv[c].y / n, qv[c].z / n, qv[c].w / n);\n"
            "    }\n"
        )
    if f.norm_k is not None:
        k_sum0 = ", kk = 0.f"
        k_sum = (
            "\n            kk = fmaf(kv.x, kv.x, fmaf(kv.y, kv.y, fmaf(kv.z, kv.z, fmaf(kv.w, kv.w, kk))));"
        )
        k_norm = (
            "        #pragma unroll\n"
            "        for (int off = LANES / 2; off > 0; off >>= 1) kk += __shfl_xor_sync(0xffffffffu, kk, off, LANES);\n"
            f"        {{  // the key row's F.normalize: its dot product over the row's norm\n"
            f"            float n = sqrtf(kk);\n            {_CLAMP.format(t='K')}\n            x /= n;\n        }}\n"
        )
    return q_norm, k_sum0, k_sum, k_norm
