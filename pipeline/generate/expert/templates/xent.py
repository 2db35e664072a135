"""Cross-entropy and NLL over (N, C) fp32 rows and int64 targets in one pass (families/xent.py).

A warp a row: its lanes walk the row's C values (16 bytes at a time where the plan asks, C % 4 == 0 and x is
16-byte aligned; the scalar kernel otherwise) with online
softmax statistics (a running max and the sum of exp(x - max)), merge them across the warp, and the loss
is logsumexp - x[t] (cross-entropy) or -x[t] (NLL: log-probabilities given), 0 for a target equal to
ignore_index; with label smoothing e, logsumexp - (1 - e) x[t] - (e / C) sum(x) (PyTorch's (1 - e) NLL +
(e / C) times the negated sum of the log-probabilities: the lanes add the row's sum beside its statistics); a target outside [0, C) faults the kernel, as eager's device assert does. Without a
reduction each row's loss is stored. With one, each block adds its rows' losses and kept targets (in a
fixed order) into one partial, and a second one-block kernel adds the partials in order: the sum, or
the sum over the kept count (NaN when every target is ignored, as eager). The logits are read once, where
eager writes the log-softmax and reads it again.
"""

from __future__ import annotations

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

_BODY = r"""namespace kp_{rid} {{
constexpr int C = {classes}, WARPS = {warps};
constexpr long long IGN = {ignore}LL;
constexpr bool NLL = {nll}, REDUCE = {reduce}, SMOOTH = {smooth}, WEIGHTED = {weighted};
constexpr float EPS = {eps};  // label smoothing
}}  // namespace kp_{rid}
template <bool VEC>
__device__ __forceinline__ void kp_{rid}_rows_body({decls}) {{
    using namespace kp_{rid};
    __shared__ float bsum[WARPS], bcnt[WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float wsum = 0.0f, wcnt = 0.0f;  // this warp's rows, in order (lane 0's)
    for (long long row = (long long)blockIdx.x * WARPS + warp; row < rows; row += (long long)gridDim.x * WARPS) {{
        const float* xr = x + row * C;
        Acc s{{-CUDART_INF_F, 0.0f, 0}};
        float sx = 0.0f;  // the row's sum (label smoothing only)
        if (!NLL) {{
            if (VEC) {{  // C % 4 == 0 and 16-byte rows: float4 loads
                const float4* xv = reinterpret_cast<const float4*>(xr);
#pragma unroll 4
                for (int c = lane; c < C / 4; c += 32) {{
                    const float4 v = xv[c];
                    lse_push(s, v.x); lse_push(s, v.y); lse_push(s, v.z); lse_push(s, v.w);
                    if (SMOOTH) sx += (v.x + v.y) + (v.z + v.w);
                }}
            }} else {{
#pragma unroll 4
                for (int c = lane; c < C; c += 32) {{
                    lse_push(s, xr[c]);
                    if (SMOOTH) sx += xr[c];
                }}
            }}
            s = warp_allreduce(s, LseOp());
            if (SMOOTH)
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) sx += __shfl_xor_sync(0xffffffffu, sx, o);
        }}
        const long long t = tgt[row];
        if (lane == 0) {{
            float loss = 0.0f, kept = 0.0f;
            if (t != IGN) {{
#ifdef KP_EMULATED
                const long long tc = t < 0 ? 0 : t >= C ? C - 1 : t;
#else
                if (t < 0 || t >= C) __trap();
                const long long tc = t;
#endif
                const float lse = s.a == -CUDART_INF_F ? -CUDART_INF_F : s.a + logf(s.b);
                loss = SMOOTH ? lse - (1.0f - EPS) * xr[tc] - (EPS / C) * sx : (NLL ? 0.0f : lse) - xr[tc];
                kept = WEIGHTED ? w[tc] : 1.0f;  // a weighted mean divides by the kept targets' weights
                if (WEIGHTED) loss *= kept;
            }}
            if (REDUCE) {{
                wsum += loss;
                wcnt += kept;
            }} else {{
                out[row] = loss;
            }}
        }}
    }}
    if (!REDUCE) return;
    if (lane == 0) {{
        bsum[warp] = wsum;
        bcnt[warp] = wcnt;
    }}
    __syncthreads();
    if (threadIdx.x == 0) {{
        float a = 0.0f, b = 0.0f;
        for (int w = 0; w < WARPS; ++w) {{
            a += bsum[w];
            b += bcnt[w];
        }}
        part[2 * blockIdx.x] = a;
        part[2 * blockIdx.x + 1] = b;
    }}
}}
// (N, C, d...) scores, (N, d...) targets: a thread a position, its C values S apart (adjacent threads read
// adjacent positions: coalesced), the same loss; the block's losses added in a fixed tree.
__device__ __forceinline__ void kp_{rid}_cols_body({decls}) {{
    using namespace kp_{rid};
    __shared__ float ta[{threads}], tb[{threads}];
    float wsum = 0.0f, wcnt = 0.0f;
    for (long long pos = (long long)blockIdx.x * blockDim.x + threadIdx.x; pos < rows;
         pos += (long long)gridDim.x * blockDim.x) {{
        const float* xp = x + (pos / S) * C * S + pos % S;
        Acc s{{-CUDART_INF_F, 0.0f, 0}};
        float sx = 0.0f;
        if (!NLL)
#pragma unroll 4
            for (int c = 0; c < C; ++c) {{
                const float v = xp[(long long)c * S];
                lse_push(s, v);
                if (SMOOTH) sx += v;
            }}
        const long long t = tgt[pos];
        float loss = 0.0f, kept = 0.0f;
        if (t != IGN) {{
#ifdef KP_EMULATED
            const long long tc = t < 0 ? 0 : t >= C ? C - 1 : t;
#else
            if (t < 0 || t >= C) __trap();
            const long long tc = t;
#endif
            const float xt = xp[tc * S];
            const float lse = s.a == -CUDART_INF_F ? -CUDART_INF_F : s.a + logf(s.b);
            loss = SMOOTH ? lse - (1.0f - EPS) * xt - (EPS / C) * sx : (NLL ? 0.0f : lse) - xt;
            kept = WEIGHTED ? w[tc] : 1.0f;
            if (WEIGHTED) loss *= kept;
        }}
        if (REDUCE) {{
            wsum += loss;
            wcnt += kept;
        }} else {{
            out[pos] = loss;
        }}
    }}
    if (!REDUCE) return;
    ta[threadIdx.x] = wsum;
    tb[threadIdx.x] = wcnt;
    __syncthreads();
    for (int h = {threads} / 2; h > 0; h >>= 1) {{
        if ((int)threadIdx.x < h) {{
            ta[threadIdx.x] += ta[threadIdx.x + h];
            tb[threadIdx.x] += tb[threadIdx.x + h];
        }}
        __syncthreads();
    }}
    if (threadIdx.x == 0) {{
        part[2 * blockIdx.x] = ta[0];
        part[2 * blockIdx.x + 1] = tb[0];
    }}
}}
extern "C" __global__ void __launch_bounds__({threads}) kp_{rid}_cols({decls}) {{
    kp_{rid}_cols_body({names});
}}
{wrappers}
// The partials in a fixed order (a tree over 1024 threads): the result does not depend on timing.
extern "C" __global__ void __launch_bounds__(1024) kp_{rid}_total(const float* __restrict__ part,
                                                                  float* __restrict__ total, int blocks) {{
    __shared__ float a[1024], b[1024];
    float sa = 0.0f, sb = 0.0f;
    for (int i = threadIdx.x; i < blocks; i += 1024) {{
        sa += part[2 * i];
        sb += part[2 * i + 1];
    }}
    a[threadIdx.x] = sa;
    b[threadIdx.x] = sb;
    __syncthreads();
    for (int w = 512; w > 0; w >>= 1) {{
        if ((int)threadIdx.x < w) {{
            a[threadIdx.x] += a[threadIdx.x + w];
            b[threadIdx.x] += b[threadIdx.x + w];
        }}
        __syncthreads();
    }}
    if (threadIdx.x == 0) total[0] = {mean} ? a[0] / b[0] : a[0];
}}
"""


def render(r: Region, classes: int, ignore: int, nll: bool, reduction: int, threads: int, vec: bool,
           smoothing: float = 0.0, weighted: bool = False, spatial: bool = False) -> Code:  # fmt: skip
    """reduction: 0 none, 1 mean, 2 sum (ATen's numbering); smoothing: cross-entropy's label smoothing;
    weighted: class weights (a third operand); spatial: (N, C, d...) scores and (N, d...) targets."""
    rid = r.rid
    warps = threads // 32
    vec = vec and classes % 4 == 0 and not spatial
    sig = Signature((ptr("x", "float"), ptr("tgt", "long long", "t"), ptr("w", "float", "w" if weighted else "x"),
                     ptr("out", "float", "loss", const=False), ptr("part", "float", const=False), i64("rows"),
                     i64("S")))  # fmt: skip
    # the float4 kernel where the plan asks for it and C allows it; the scalar one always (a misaligned x)
    names, wrappers = row_kernels(rid, sig, threads, vec)
    if spatial:
        names = [f"kp_{rid}_cols"]
    cuda = _BODY.format(
        rid=rid, classes=classes, warps=warps, ignore=ignore, nll="true" if nll else "false",
        reduce="true" if reduction else "false", decls=sig.decls(), wrappers=wrappers,
        smooth="true" if smoothing else "false", eps=f"{float(smoothing)!r}f",
        mean="true" if reduction == 1 else "false", weighted="true" if weighted else "false",
        threads=threads, names=sig.names(),
    )  # fmt: skip
    total = Signature((ptr("part", "float"), ptr("total", "float", "loss", const=False), i32("blocks")))
    x, t = r.node.args[:2]
    w = r.node.args[2] if len(r.node.args) > 2 and r.node.args[2] is not None else r.node.kw("weight", None)
    what = "NLL" if nll else f"cross-entropy{f' (label smoothing {smoothing:g})' if smoothing else ''}"
    what += " with class weights" if weighted else ""

    def launch(pad: str) -> list[str]:  # the float4 kernel where x is 16-byte aligned
        if spatial:
            return [f"{pad}kernels.kp_{rid}_cols((blocks,), ({threads},), ({sig.args()}))  # noqa: F821"]
        return row_launch(rid, sig, threads, vec, "x.data_ptr() % 16 == 0", pad)

    if spatial:
        head = [
            f"    if x.dim() < 3 or x.shape[1] != {classes} or t.shape != x.shape[:1] + x.shape[2:]:",
            f"        raise ValueError(f'kernelpro expert: (N, {classes}, d...) scores and (N, d...) targets "
            "expected, not {tuple(x.shape)} and {tuple(t.shape)}')",
            "    x, t = _contig(x), _contig(t)",
            "    S = t[0].numel() if t.dim() else 1",
            "    rows = t.numel()",
            f"    blocks = {balanced_blocks('rows', threads, threads)}",
        ]
        shape = "t.shape"
    else:
        head = [
            f"    if x.dim() != 2 or x.shape[1] != {classes} or t.shape != x.shape[:1]:",
            f"        raise ValueError(f'kernelpro expert: (N, {classes}) logits and (N,) targets expected, not "
            "{tuple(x.shape)} and {tuple(t.shape)}')",
            "    x, t = _contig(x), _contig(t)",
            "    rows, S = x.shape[0], 1",
            f"    blocks = {balanced_blocks('rows', warps, threads)}",
        ]
        shape = "(rows,)"
    launcher = "\n".join([
        f"def _xent_{rid}(sms, x, t{', w' if weighted else ''}):",
        f'    """{what} over {"positions" if spatial else "rows"} of {classes} classes in one pass, a '
        f'{"thread a position" if spatial else "warp a row"} ({threads} threads a block)."""',
        *head,
        *(["    w = _contig(w)"] if weighted else []),
        *([f"    loss = torch.empty({shape}, dtype=torch.float32, device=x.device)",
           "    part = loss",
           "    if rows:",
           *launch("        ")]
          if reduction == 0 else
          ["    loss = torch.empty((), dtype=torch.float32, device=x.device)",
           "    part = torch.empty((blocks, 2), dtype=torch.float32, device=x.device)",
           *launch("    "),
           f"    kernels.kp_{rid}_total((1,), (1024,), ({total.args()}))  # noqa: F821"]),
        "    return loss",
    ])  # fmt: skip
    kernel_names = tuple(names) + (() if reduction == 0 else (f"kp_{rid}_total",))
    args = (x.name, t.name, *([w.name] if weighted else []))
    return Code(cuda, launcher, f"_xent_{rid}", kernel_names, args, r.outputs)


__all__ = ["render"]
