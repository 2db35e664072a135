"""Reductions and softmax over a dimension that is not the last: the input seen as (outer, R, inner).

Threads run along the contiguous inner dimension (V elements each: 16-byte loads when inner allows) and,
for reductions, blockDim.y of them share a column, each taking every by-th row, merged by a shared-memory
tree; the reduced range may be split over gridDim.z blocks whose partial accumulators a second kernel
merges. Softmax keeps one thread per column (online max and sum, then the write pass); where a column's
rows fit a thread's registers (`regs`), it reads them once and writes them from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.generate.expert import ops
from pipeline.generate.expert.layout import RowLayout
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates import reduce_ops, shapes
from pipeline.generate.expert.templates.code import Code, ctype, launch_bounds, region_source
from pipeline.generate.expert.templates.fused import Fused, identity
from pipeline.generate.expert.templates.signature import Signature, Variant, i64, kernel, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.colwise import ColPlan

TWO_PASS = ("softmax", "log_softmax", "rms_col")


def _rms(lay: RowLayout, total: str) -> str:
    """rms_col's factor from the column's sum of squares: the root to divide by, or its reciprocal root."""
    mean = f"{total} / (float)R + {ops.lit(lay.eps)}"
    # rsqrt as ops.py writes it
    return f"(1.0f / sqrtf({mean}))" if lay.op_form == "mul" else f"sqrtf({mean})"


def render(region: Region, lay: RowLayout, rp: ColPlan, pre: Fused | None, post: Fused | None) -> Code:
    rid = region.rid
    kind = reduce_ops.KINDS[lay.op]
    # a write pass after the column's statistics (softmax's, or a sum of squares)
    softmax = lay.op in TWO_PASS
    x_dt = pre.main_dtype if pre else lay.in_dtype
    out_dt = post.out_dtype if post else lay.out_dtype
    indices_only = lay.op in ("argmax", "argmin")
    with_yi = lay.indices and not indices_only
    splits = not softmax and rp.splits > 0
    xt = ctype(x_dt)
    yt = "long long" if indices_only else ctype(out_dt)

    params = [ptr("x", xt), *(pre.params() if pre else []), ptr("y", yt, const=False)]
    if with_yi:
        params.append(ptr("yi", "long long", const=False))
    if splits:
        params.append(ptr("ws", "Acc", const=False))
    params += [i64("outer"), i64("R", "reduced"), i64("inner"), i64("rps")]
    sig = Signature((*params, *(post.params() if post else [])))

    lams = [pre.lam("pre") if pre else identity("pre"), post.lam("post") if post else identity("post")]
    if softmax:
        body = _softmax_body(rid, sig, lay, xt, yt, rp, lams)
    else:
        body = _reduce_body(rid, sig, lay, kind, xt, yt, rp, lams, splits, indices_only, with_yi)
    lb = launch_bounds(rp.threads, rp.min_blocks)
    variants = [Variant(f"kp_{rid}_v{v}", v) for v in sorted({1, rp.vec})]
    wrappers = [kernel(lb, k.name, sig, f"kp_{rid}_body<{k.vec}>") for k in variants]
    held = softmax and rp.regs > 0  # the columns' rows in registers (rp.regs of them), where R is that
    if held:
        body += _softmax_regs_body(rid, sig, lay, xt, yt, rp.regs, lams)
        regs_variants = [Variant(f"kp_{rid}_v{k.vec}_regs", k.vec, regs=True) for k in variants]
        wrappers += [kernel(lb, k.name, sig, f"kp_{rid}_regs_body<{k.vec}>") for k in regs_variants]
        variants += regs_variants
    combine, combine_sig = "", None
    if splits:
        combine, combine_sig = reduce_ops.combine_kernel(
            f"kp_{rid}_combine", lay.op, lay.correction, out_dt if not indices_only else "int64",
            with_yi, post.params() if post else [], lams[1], 256, "outer * inner", "reduced",
        )  # fmt: skip
    cuda = region_source(
        f"// region {rid}: {lay.op} over a strided dimension (threads along the contiguous inner one)",
        (pre, post), body, wrappers, combine,
    )  # fmt: skip
    inputs = [("x", pre.main if pre else region.node.args[0].name), *(pre.inputs() if pre else []),
              *(post.inputs() if post else [])]  # fmt: skip
    launcher = _launcher(region, lay, rp, pre, post, inputs, sig, variants, combine_sig, softmax, out_dt,
                         indices_only, with_yi)  # fmt: skip
    kernels = (*(k.name for k in variants), *([f"kp_{rid}_combine"] if splits else []))
    outs = post.region.outputs if post else region.outputs
    return Code(cuda, launcher, f"_r_{rid}", kernels, tuple(v for _, v in inputs), tuple(outs))


def _reduce_body(rid, sig, lay, kind, xt, yt, rp, lams, splits, indices_only, with_yi) -> list[str]:
    u = rp.unroll
    shift = kind.shift
    store = reduce_ops.store(lay.op, lay.correction, yt, "t")
    direct = ["const long long n = R;", "(void)n;", store, *(["yi[t] = acc.i;"] if with_yi else [])]
    if splits:
        finish = [
            "                if (gridDim.z > 1) {",
            "                    ws[blockIdx.z * outer * inner + t] = acc;",
            "                } else {",
            *(f"                    {s}" for s in direct),
            "                }",
        ]
    else:
        finish = [f"                {s}" for s in direct]

    def push(val: str, row: str, idx: str) -> list[str]:
        lines = [f"const float v_ = pre({val}, {idx});"]
        if shift:
            lines.append("const float K = Ks[e];")
        lines.append(kind.push("acc[e]", "v_", row))
        return lines

    return [
        "template <int V>",
        f"__device__ __forceinline__ void kp_{rid}_body({sig.decls()}) {{",
        "    extern __shared__ __align__(16) unsigned char kp_smem[];",
        "    Acc* part = reinterpret_cast<Acc*>(kp_smem);  // [blockDim.y][blockDim.x][V]",
        f"    constexpr int U = {u};  // rows loaded before any is merged",
        *lams,
        "    const long long col = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V;",
        "    const bool active = col < inner;",
        "    const long long ra = blockIdx.z * rps;",
        "    const long long rb = R < ra + rps ? R : ra + rps;",
        "    const int by = blockDim.y;",
        "    Acc* mine = part + (threadIdx.y * blockDim.x + threadIdx.x) * V;",
        "    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {  // block-uniform: barriers are safe",
        "        Acc acc[V];",
        "#pragma unroll",
        f"        for (int e = 0; e < V; ++e) acc[e] = {kind.init};",
        "        if (active) {",
        "            const long long base = o * R * inner + col;",
        *(
            [
                "            float Ks[V];  // shift: the column's first element",
                "#pragma unroll",
                "            for (int e = 0; e < V; ++e) Ks[e] = pre(ld(x[base + e]), base + e);",
            ]
            if shift
            else []
        ),
        "            long long r = ra + threadIdx.y;",
        "            for (; r + (U - 1) * by < rb; r += U * by) {",
        f"                Vec<{xt}, V> t[U];",
        "#pragma unroll",
        f"                for (int u = 0; u < U; ++u) t[u] = vload<{xt}, V>(x + base + (r + u * by) * inner);",
        "#pragma unroll",
        "                for (int u = 0; u < U; ++u) {",
        "#pragma unroll",
        "                    for (int e = 0; e < V; ++e) {",
        *(
            f"                        {s}"
            for s in push("ld(t[u].v[e])", "r + u * by", "base + (r + u * by) * inner + e")
        ),
        "                    }",
        "                }",
        "            }",
        "            for (; r < rb; r += by) {",
        f"                const Vec<{xt}, V> t = vload<{xt}, V>(x + base + r * inner);",
        "#pragma unroll",
        "                for (int e = 0; e < V; ++e) {",
        *(f"                    {s}" for s in push("ld(t.v[e])", "r", "base + r * inner + e")),
        "                }",
        "            }",
        "        }",
        "#pragma unroll",
        "        for (int e = 0; e < V; ++e) mine[e] = acc[e];",
        "        __syncthreads();",
        "        for (int s = by >> 1; s > 0; s >>= 1) {  // tree over threadIdx.y; row 0 ends with the result",
        "            if (threadIdx.y < s) {",
        "#pragma unroll",
        f"                for (int e = 0; e < V; ++e) mine[e] = {kind.op}()(mine[e], mine[e + s * blockDim.x * V]);",
        "            }",
        "            __syncthreads();",
        "        }",
        "        if (threadIdx.y == 0 && active) {",
        "#pragma unroll",
        "            for (int e = 0; e < V; ++e) {",
        "                const Acc acc = mine[e];",
        "                const long long t = o * inner + col + e;",
        *finish,
        "            }",
        "        }",
        "        __syncthreads();  // the next o rewrites part[]",
        "    }",
        "}",
    ]


def _softmax_body(rid, sig, lay, xt, yt, rp, lams) -> list[str]:
    rms = lay.op == "rms_col"
    f = {"softmax": "expf(v - M[e]) * inv[e]", "log_softmax": "v - M[e] - L[e]",
         "rms_col": f"v {'*' if lay.op_form == 'mul' else '/'} M[e]"}[lay.op]  # fmt: skip
    stats = {
        "softmax": "M[e] = acc[e].a; inv[e] = 1.0f / acc[e].b;",
        "log_softmax": "M[e] = acc[e].a; L[e] = logf(acc[e].b);",
        "rms_col": f"M[e] = {_rms(lay, 'acc[e].a')};",  # M: the root (or its reciprocal)
    }[lay.op]
    init = "{0.0f, 0.0f, 0}" if rms else "{-CUDART_INF_F, 0.0f, 0}"
    push = (
        "{ const float v = pre(ld(t.v[e]), base + r * inner + e); acc[e].a += v * v; }"
        if rms
        else "lse_push(acc[e], pre(ld(t.v[e]), base + r * inner + e));"
    )
    return [
        "template <int V>",
        f"__device__ __forceinline__ void kp_{rid}_body({sig.decls()}) {{",
        *lams,
        "    const long long col = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V;",
        "    if (col >= inner) return;  // no barriers below",
        "    (void)rps;",
        "    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {",
        "        const long long base = o * R * inner + col;",
        "        Acc acc[V];",
        "        float M[V], inv[V], L[V];",
        "        (void)inv;",
        "        (void)L;",
        "#pragma unroll",
        f"        for (int e = 0; e < V; ++e) acc[e] = {init};",
        f"#pragma unroll {rp.unroll}",
        "        for (long long r = 0; r < R; ++r) {",
        f"            const Vec<{xt}, V> t = vload<{xt}, V>(x + base + r * inner);",
        "#pragma unroll",
        f"            for (int e = 0; e < V; ++e) {push}",
        "        }",
        "#pragma unroll",
        f"        for (int e = 0; e < V; ++e) {{ {stats} }}",
        f"#pragma unroll {rp.unroll}",
        "        for (long long r = 0; r < R; ++r) {",
        f"            const Vec<{xt}, V> t = vload<{xt}, V>(x + base + r * inner);",
        f"            Vec<{yt}, V> out;",
        "#pragma unroll",
        "            for (int e = 0; e < V; ++e) {",
        "                const float v = pre(ld(t.v[e]), base + r * inner + e);",
        f"                out.v[e] = cv<{yt}>(post({f}, base + r * inner + e));",
        "            }",
        f"            vstore<{yt}, V>(y + base + r * inner, out);",
        "        }",
        "    }",
        "}",
    ]


def _softmax_regs_body(rid, sig, lay, xt, yt, rows, lams) -> list[str]:
    """The softmax of a column of `rows` (compile-time) held in registers: all its loads issued at once,
    the max, exp and sum over the registers (as the row-wise kernel's register form: NaN spreads, a column
    of -inf gives NaN, as eager), then written from them: one read and one write an element."""
    each = [
        "#pragma unroll",
        f"        for (int r = 0; r < {rows}; ++r)",
        "#pragma unroll",
        "            for (int e = 0; e < V; ++e) {",
    ]
    if lay.op == "rms_col":  # S: the sum of squares, then the root (or its reciprocal); M unused
        stats = [*each, "                S[e] += f[r][e] * f[r][e];", "            }",
                 "#pragma unroll", f"        for (int e = 0; e < V; ++e) S[e] = {_rms(lay, 'S[e]')};"]  # fmt: skip
        f = f"f[r][e] {'*' if lay.op_form == 'mul' else '/'} S[e]"
    elif lay.op == "softmax":
        stats = [
            *each,
            "                f[r][e] = expf(f[r][e] - M[e]);",
            "                S[e] += f[r][e];",
            "            }",
        ]
        f = "f[r][e] * (1.0f / S[e])"
    else:
        stats = [*each, "                S[e] += expf(f[r][e] - M[e]);", "            }",
                 "#pragma unroll", "        for (int e = 0; e < V; ++e) S[e] = logf(S[e]);"]  # fmt: skip
        f = "f[r][e] - M[e] - S[e]"
    return [
        "template <int V>",
        f"__device__ __forceinline__ void kp_{rid}_regs_body({sig.decls()}) {{",
        *lams,
        "    const long long col = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * V;",
        "    if (col >= inner) return;  // no barriers below",
        "    (void)rps;",
        "    (void)R;  // the launcher: R is the compiled rows",
        "    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {",
        f"        const long long base = o * (long long){rows} * inner + col;",
        f"        float f[{rows}][V], M[V], S[V];",
        "#pragma unroll",
        f"        for (int r = 0; r < {rows}; ++r) {{",
        f"            const Vec<{xt}, V> t = vload<{xt}, V>(x + base + r * inner);",
        "#pragma unroll",
        "            for (int e = 0; e < V; ++e) f[r][e] = pre(ld(t.v[e]), base + r * inner + e);",
        "        }",
        "#pragma unroll",
        "        for (int e = 0; e < V; ++e) {",
        "            M[e] = -CUDART_INF_F;",
        "            S[e] = 0.0f;",
        f"            for (int r = 0; r < {rows}; ++r) M[e] = kp_max_nan(M[e], f[r][e]);",
        "        }",
        *stats,
        "#pragma unroll",
        f"        for (int r = 0; r < {rows}; ++r) {{",
        f"            Vec<{yt}, V> out;",
        "#pragma unroll",
        f"            for (int e = 0; e < V; ++e) out.v[e] = cv<{yt}>(post({f}, base + r * inner + e));",
        f"            vstore<{yt}, V>(y + base + r * inner, out);",
        "        }",
        "    }",
        "}",
    ]


def _launcher(region, lay, rp, pre, post, inputs, sig, variants, combine, softmax, out_dt, indices_only,
              with_yi) -> str:  # fmt: skip
    rid = region.rid
    lines = [f"def _r_{rid}(sms, {', '.join(name for name, _ in inputs)}):"]
    if pre:
        lines += pre.prepare("x.shape")
    lines.append("    x = _contig(x)")
    lines += shapes.shape_lines(region, lay)
    lines += shapes.output_lines(
        out_dt, indices_only, with_yi, post, "y.numel() == 0 or reduced == 0", lay.pair
    )
    ret = shapes.returned(with_yi, lay.pair)
    v = rp.vec
    lines += [
        f"    vec = {v} if inner % {v} == 0 and _aligned((x, y), {v}) else 1" if v > 1 else "    vec = 1",
        "    width = -(-inner // vec)  # columns of `vec` elements",
        f"    bx = min({rp.threads if softmax else rp.bx}, 1 << (width - 1).bit_length())",
    ]
    if softmax:
        lines.append("    by = 1")
    else:
        # A short reduced dim shared by many threads leaves each a row or two and the block mostly barriers
        # (level-2 24: 22 rows over 8 threads, 4x eager's time): each thread keeps 2U rows at least, and the
        # threads so freed go along the inner dim.
        lines += [
            f"    by = max(1, {rp.threads} // bx)",
            f"    while by > 1 and reduced < by * {2 * rp.unroll}:",
            "        by //= 2",
            f"    bx = min(max(bx, {rp.threads} // by), 1 << (width - 1).bit_length())",
        ]
    lines += [
        "    gx, gy = -(-width // bx), min(outer, MAX_GRID_Y)",
        "    splits, rps = 1, reduced",
    ]
    if combine:
        lines += [
            f"    want = -(-sms * {rp.splits} // (gx * gy))",
            f"    if want > 1 and reduced >= 2 * by * {4 * rp.unroll}:",
            f"        rps = max(by * {4 * rp.unroll}, -(-reduced // want))",
            "        splits = min(-(-reduced // rps), MAX_GRID_Y)",
            "        rps = -(-reduced // splits)",
            "    ws = torch.empty((splits * outer * inner * 2,), dtype=torch.int64, device=x.device) if splits > 1 else y",
        ]
    lines.append(f"    args = ({sig.args()},)")
    lines.append("    grid, block = (gx, gy, splits), (bx, by)")
    smem = "0" if softmax else "bx * by * vec * 16"
    call = "kernels.{}(grid, block, args, shared_mem=" + smem + ")  # noqa: F821"

    def pick(scalar: Variant, vector: Variant, pad: str) -> list[str]:
        """The pair's vector kernel where `vec` (worked out above: the inner size and both tensors allow
        it) is over 1, else its scalar one."""
        if vector.vec == 1:
            return [pad + call.format(scalar.name)]
        return [f"{pad}if vec > 1:", f"{pad}    {call.format(vector.name)}", f"{pad}else:",
                f"{pad}    {call.format(scalar.name)}"]  # fmt: skip

    streamed = [k for k in variants if not k.regs]
    held = [k for k in variants if k.regs]
    if held:  # the columns' rows in registers, where R is the rows it was compiled for
        lines += [f"    if reduced == {rp.regs}:", *pick(held[0], held[-1], "        "), "    else:"]
    lines += pick(streamed[0], streamed[-1], "        " if held else "    ")
    if combine:
        lines.append("    if splits > 1:")
        lines.append(
            f"        kernels.kp_{rid}_combine((max(1, min(-(-(outer * inner) // 256), sms * 8)),), (256,), "
            f"({combine.args()},))  # noqa: F821"
        )
    lines.append(f"    return {ret}")
    return "\n".join(lines)
