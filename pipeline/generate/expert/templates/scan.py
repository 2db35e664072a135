"""Scans (cumsum, cumprod, logcumsumexp) along one dimension: inclusive or exclusive, from either end (scans.py folds
the reference's flips and concatenations into these); cummax and cummin, their values or their indices.

Along the last dimension: a block per row walks it in chunks of blockDim.x * ITEMS; each thread scans
its ITEMS consecutive elements in registers, a warp-shuffle scan and one shared-memory round over the
warps give each thread its prefix, and a running carry links the chunks. With several items a thread and
`stage`, a chunk is loaded and stored through shared memory, so that global accesses stay coalesced.
With `vec_rows` (fp32 rows whose length is a multiple of 4, 16-byte aligned, as long as the output), a warp
per row instead: each lane loads `vec_rows` 16-byte vectors before it scans any (the block per row kept
one 4-byte load a thread in flight and met two barriers a chunk), scans each vector in registers, and U
independent shuffle scans over the lanes give each vector its prefix; no barrier at all.
Along any other dimension: a thread per column walks down it, so every warp access is one contiguous run.

cummax / cummin scan 64-bit keys instead of floats (ops.KEYED_SCANS): the running max of (the value's
order, its position), so the later of equal values wins and a NaN wins from where it appears (PyTorch's
rule); the store decodes the value or the position. Block per row and column walk only.

Both walk the scan's own order, position c of Lo outputs: an exclusive scan takes input c - 1 there (the
identity at 0), a reverse one reads and writes from the far end (L - 1 - k, Lo - 1 - c). Only the
indices change: the carries, the shuffles and the compensated sums are the inclusive scan's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pipeline.generate.expert import ops
from pipeline.generate.expert.layout import RowLayout
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates import shapes
from pipeline.generate.expert.templates.code import Code, ctype, launch_bounds, region_source, torch_dtype
from pipeline.generate.expert.templates.fused import Fused, identity
from pipeline.generate.expert.templates.signature import Signature, i64, kernel, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.scan import ScanPlan


# The scan's operator: (identity, its two-operand expression); {rid} names the region's own log-add-exp.
_COMBINE = {
    "cumsum": ("0.0f", "{} + {}"),
    "cumprod": ("1.0f", "{} * {}"),
    "logcumsumexp": ("-INFINITY", "kp_{rid}_lae({}, {})"),
}


_KEYED = ("0ull", "kp_{rid}_kmax({}, {})")


def combine(op: str, rid: str) -> tuple[str, Callable[[str, str], str]]:
    ident, form = _KEYED if op in ops.KEYED_SCANS else _COMBINE[op]
    form = form.replace("{rid}", rid)
    return ident, lambda a, b: form.format(a, b)


def _lae(rid: str) -> list[str]:
    """log(exp(a) + exp(b)) without overflow, NaN kept; equal operands (both infinite too) give a + log 2,
    where the general form would take inf - inf."""
    return [
        f"__device__ __forceinline__ float kp_{rid}_lae(float a, float b) {{",
        "    if (a != a || b != b) return a + b;  // NaN",
        "    if (a == b) return a + 0.69314718055994531f;",
        "    const float m = fmaxf(a, b);",
        "    return m + log1pf(expf(-fabsf(a - b)));",
        "}",
    ]


def _keys(rid: str, op: str) -> list[str]:
    """A value's key (its order in the high word, min scans inverted, a NaN above everything, both zeros
    equal; position k in the low word), the larger of two keys, and a key's value back."""
    low = ops.KEYED_SCANS[op][0] == "cummin"
    return [
        f"__device__ __forceinline__ unsigned long long kp_{rid}_key(float f, long long k) {{",
        "    unsigned u = __float_as_uint(f == 0.0f ? 0.0f : f);",
        "    u ^= (u >> 31) ? 0xffffffffu : 0x80000000u;  // unsigned order = float order",
        f"    u = f != f ? 0xffffffffu : {'~u' if low else 'u'};",
        "    return ((unsigned long long)u << 32) | (unsigned long long)k;",
        "}",
        f"__device__ __forceinline__ unsigned long long kp_{rid}_kmax(unsigned long long a, unsigned long long b) {{",
        "    return a > b ? a : b;",
        "}",
        f"__device__ __forceinline__ float kp_{rid}_kval(unsigned long long key) {{",
        "    unsigned u = (unsigned)(key >> 32);",
        "    if (u == 0xffffffffu) return __uint_as_float(0x7fc00000u);",
        *(["    u = ~u;"] if low else []),
        "    return __uint_as_float(u ^ ((u >> 31) ? 0x80000000u : 0xffffffffu));",
        "}",
    ]


def stages(threads: int, items: int) -> bool:
    """Whether a chunk can go through shared memory: several items a thread, static shared memory < 48 KB."""
    return items > 1 and threads * items <= 8192


def render(region: Region, lay: RowLayout, rp: ScanPlan, pre: Fused | None, post: Fused | None) -> Code:
    rid = region.rid
    prod = lay.op != "cumsum"  # no compensated carry: products, log-sum-exp, keys
    keyed = lay.op in ops.KEYED_SCANS
    st = "unsigned long long" if keyed else "float"  # the scan's state
    ident, comb = combine(lay.op, rid)
    xt = ctype(pre.main_dtype if pre else lay.in_dtype)
    out_dt = post.out_dtype if post else lay.out_dtype
    yt = ctype(out_dt)
    sig = Signature((ptr("x", xt), *(pre.params() if pre else []), ptr("y", yt, const=False), i64("outer"),
                     i64("L", "reduced"), i64("Lo"), i64("inner"), *(post.params() if post else [])))  # fmt: skip
    shift = "1" if lay.exclusive else "0"
    src = "(L - 1 - k)" if lay.reverse else "k"  # input element k of the scan order, in memory
    dst = "(Lo - 1 - c)" if lay.reverse else "c"  # output position c of the scan order, in memory
    valid = "c < Lo && k >= 0 && k < L" if lay.exclusive else "c < L"
    lams = [pre.lam("pre") if pre else identity("pre"), post.lam("post") if post else identity("post")]
    load = f"{valid} ? pre(ld(x[rs + {src}]), rs + {src}) : {ident}"
    store = f"y[ro + {dst}] = cv<{yt}>(post({{}}, ro + {dst}));"
    if keyed:  # no reverse, no exclusive form: k is the position along the dim; no epilogue (the family)
        load = f"{valid} ? kp_{rid}_key(pre(ld(x[rs + {src}]), rs + {src}), {src}) : {ident}"
        store = (
            f"y[ro + {dst}] = (long long)(({{}}) & 0xffffffffull);"
            if ops.KEYED_SCANS[lay.op][1]
            else f"y[ro + {dst}] = cv<{yt}>(kp_{rid}_kval({{}}));"
        )
    direct_load = [
        "#pragma unroll",
        "            for (int i = 0; i < ITEMS; ++i) {",
        f"                const long long c = base + i, k = c - {shift};",
        f"                v[i] = {load};",
        "            }",
    ]
    direct_store = [
        "#pragma unroll",
        "            for (int i = 0; i < ITEMS; ++i) {",
        "                const long long c = base + i;",
        f"                if (c < Lo) {store.format(comb('prefix', 'v[i]'))}",
        "            }",
    ]
    # Several items a thread: the chunk goes through shared memory both ways, so that each warp access is one
    # contiguous run (thread t takes element t + i * THREADS) while each thread scans consecutive items.
    # One padding word every 32 keeps the per-thread reads (stride ITEMS) off one bank.
    staged = rp.stage and stages(rp.threads, rp.items)
    staged_load = [
        "#pragma unroll",
        "            for (int i = 0; i < ITEMS; ++i) {",
        "                const int j = tid + i * THREADS;",
        f"                const long long c = c0 + j, k = c - {shift};",
        f"                stage[j + (j >> 5)] = {load};",
        "            }",
        "            __syncthreads();",
        "#pragma unroll",
        "            for (int i = 0; i < ITEMS; ++i) {",
        "                const int j = tid * ITEMS + i;",
        "                v[i] = stage[j + (j >> 5)];",
        "            }",
    ]
    staged_store = [  # stage was last read before the warp totals' barriers: safe to overwrite
        "#pragma unroll",
        "            for (int i = 0; i < ITEMS; ++i) {",
        "                const int j = tid * ITEMS + i;",
        f"                stage[j + (j >> 5)] = {comb('prefix', 'v[i]')};",
        "            }",
        "            __syncthreads();",
        "#pragma unroll",
        "            for (int i = 0; i < ITEMS; ++i) {",
        "                const int j = tid + i * THREADS;",
        "                const long long c = c0 + j;",
        f"                if (c < Lo) {store.format('stage[j + (j >> 5)]')}",
        "            }",
    ]
    row = [
        *(_lae(rid) if lay.op == "logcumsumexp" else []),
        *(_keys(rid, lay.op) if keyed else []),
        f"__device__ __forceinline__ void kp_{rid}_row_body({sig.decls()}) {{",
        f"    constexpr int ITEMS = {rp.items};",
        f"    __shared__ {st} warp_tot[32];",
        *(
            [
                f"    constexpr int THREADS = {rp.threads};",
                f"    __shared__ {st} stage[THREADS * ITEMS + THREADS * ITEMS / 32];",
            ]
            if staged
            else []
        ),
        *lams,
        "    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;",
        "    (void)inner;",
        "    for (long long r = blockIdx.x; r < outer; r += gridDim.x) {  // block-uniform",
        "        const long long rs = r * L, ro = r * Lo;",
        f"        {st} carry = {ident};",
        *([] if prod else ["        float carry_c = 0.0f;  // the running sum's lost low bits"]),
        "        for (long long c0 = 0; c0 < Lo; c0 += (long long)blockDim.x * ITEMS) {",
        "            const long long base = c0 + (long long)tid * ITEMS;",
        f"            {st} v[ITEMS];",
        *(staged_load if staged else direct_load),
        "#pragma unroll",
        f"            for (int i = 1; i < ITEMS; ++i) v[i] = {comb('v[i - 1]', 'v[i]')};",
        f"            {st} t = v[ITEMS - 1];  // inclusive scan of the thread totals across the warp",
        "#pragma unroll",
        "            for (int o = 1; o < 32; o <<= 1) {",
        f"                const {st} n = __shfl_up_sync(0xffffffffu, t, o);",
        f"                if (lane >= o) t = {comb('t', 'n')};",
        "            }",
        "            if (lane == 31) warp_tot[warp] = t;",
        "            __syncthreads();",
        "            if (warp == 0) {  // inclusive scan of the warp totals",
        f"                {st} w = lane < warps ? warp_tot[lane] : {ident};",
        "#pragma unroll",
        "                for (int o = 1; o < 32; o <<= 1) {",
        f"                    const {st} n = __shfl_up_sync(0xffffffffu, w, o);",
        f"                    if (lane >= o) w = {comb('w', 'n')};",
        "                }",
        "                warp_tot[lane] = w;",
        "            }",
        "            __syncthreads();",
        f"            {st} e = __shfl_up_sync(0xffffffffu, t, 1);  // exclusive within the warp",
        f"            if (lane == 0) e = {ident};",
        f"            const {st} prefix = {comb(comb('carry', f'(warp > 0 ? warp_tot[warp - 1] : {ident})'), 'e')};",
        *(staged_store if staged else direct_store),
        *(
            [f"            carry = {comb('carry', 'warp_tot[warps - 1]')};"]
            if prod
            else [
                "            {  // compensated (Kahan) addition: a long row's carry stays accurate",
                "                const float y_ = warp_tot[warps - 1] - carry_c, t_ = carry + y_;",
                "                carry_c = (t_ - carry) - y_;",
                "                carry = t_;",
                "            }",
            ]
        ),
        "            __syncthreads();  // warp_tot is rewritten by the next chunk",
        "        }",
        "    }",
        "}",
    ]
    col = [
        f"__device__ __forceinline__ void kp_{rid}_col_body({sig.decls()}) {{",
        *lams,
        "    const long long col = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
        "    if (col >= inner) return;",
        "    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {",
        "        const long long base = o * L * inner + col, obase = o * Lo * inner + col;",
        f"        {st} acc = {ident};",
        *([] if prod else ["        float comp = 0.0f;  // the column sum's lost low bits"]),
        "#pragma unroll 1",  # each step needs the last: unrolling the walk buys nothing
        "        for (long long c = 0; c < Lo; ++c) {",
        f"            const long long k = c - {shift};",
        "            if (k >= 0 && k < L) {" if lay.exclusive else "            {",
        f"                const long long i = base + {src} * inner;",
        *(
            [f"                acc = {comb('acc', f'kp_{rid}_key(pre(ld(x[i]), i), {src})')};"]
            if keyed
            else [f"                acc = {comb('acc', 'pre(ld(x[i]), i)')};"]
            if prod
            else [  # compensated (Kahan) summation down the column
                "                const float y_ = pre(ld(x[i]), i) - comp, t_ = acc + y_;",
                "                comp = (t_ - acc) - y_;",
                "                acc = t_;",
            ]
        ),
        "            }",
        f"            const long long j = obase + {dst} * inner;",
        f"            {store.replace(f'ro + {dst}', 'j').format('acc')}"
        if keyed
        else f"            y[j] = cv<{yt}>(post(acc, j));",
        "        }",
        "    }",
        "}",
    ]
    vec_rows = rp.vec_rows > 0 and xt == "float" and yt == "float" and not keyed
    if vec_rows:
        row += _warp_rows(rid, sig, lay, rp.vec_rows, lams, prod)
    lb = launch_bounds(rp.threads, rp.min_blocks)
    kernels = (f"kp_{rid}_row", f"kp_{rid}_col", *([f"kp_{rid}_wrow"] if vec_rows else []))
    wrappers = [kernel(lb, k, sig, f"{k}_body") for k in kernels]
    cuda = region_source(
        f"// region {rid}: {lay.op} (a block per row along the last dim, a thread per column otherwise)",
        (pre, post), [*row, *col], wrappers,
    )  # fmt: skip
    inputs = [("x", pre.main if pre else region.node.args[0].name), *(pre.inputs() if pre else []),
              *(post.inputs() if post else [])]  # fmt: skip
    persist = f", sms * {rp.persistent}" if rp.persistent else ""
    lines = [f"def _r_{rid}(sms, {', '.join(name for name, _ in inputs)}):"]
    if pre:
        lines += pre.prepare("x.shape")
    lines.append("    x = _contig(x)")
    lines += shapes.shape_lines(region, lay)
    if lay.grow:  # an exclusive scan's output differs in length along its dim
        lines += [f"    Lo = reduced + {lay.grow}", "    out_shape = shape[:d] + (Lo,) + shape[d + 1:]"]
    else:
        lines.append("    Lo = reduced")
    lines.append(f"    y = torch.empty(out_shape, dtype={torch_dtype(out_dt)}, device=x.device)")
    if post:
        lines += post.prepare("out_shape")
    lines += [
        "    if y.numel() == 0:",
        "        return y",
        f"    args = ({sig.args()},)",
        *(
            [
                "    if inner == 1 and Lo == reduced and reduced % 4 == 0 and _aligned((x, y), 4):",
                f"        blocks = max(1, min(-(-outer // {rp.threads // 32}), MAX_GRID_X{persist}))",
                f"        kernels.kp_{rid}_wrow((blocks,), ({rp.threads},), args)  # noqa: F821",
                "        return y",
            ]
            if vec_rows
            else []
        ),
        "    if inner == 1:",
        f"        blocks = max(1, min(outer, MAX_GRID_X{persist}))",
        f"        kernels.kp_{rid}_row((blocks,), ({rp.threads},), args)  # noqa: F821",
        "    else:",
        f"        grid = (-(-inner // {rp.threads}), min(outer, MAX_GRID_Y))",
        f"        kernels.kp_{rid}_col(grid, ({rp.threads},), args)  # noqa: F821",
        "    return y",
    ]
    outs = post.region.outputs if post else region.outputs
    return Code(cuda, "\n".join(lines), f"_r_{rid}", kernels, tuple(v for _, v in inputs), tuple(outs))


def _warp_rows(rid: str, sig: Signature, lay: RowLayout, U: int, lams: list[str], prod: bool) -> list[str]:
    """A warp per row (fp32, Lo == L, L % 4 == 0, 16-byte aligned rows: the launcher checks). Lane l takes
    vectors q0 + u * 32 + l of the scan order (u < U), all U loaded before any is used; scan position k is
    memory element k, or L - 1 - k reversed (then a vector's elements run backwards too). Each vector is
    scanned in registers, the U vector totals are scanned over the lanes side by side, and the running
    carry (compensated for sums) links the steps."""
    ident, comb = combine(lay.op, rid)
    rev = lay.reverse
    memv = "(nv - 1 - q)" if rev else "q"  # a scan-order vector's place in memory
    el = "(3 - e)" if rev else "e"  # element e of a scan-order vector within its memory vector
    mem = "(L - 1 - (q * 4 + e))" if rev else "(q * 4 + e)"
    out = f"(e == 0 ? p : {comb('p', 'v[u][e - 1]')})" if lay.exclusive else comb("p", "v[u][e]")
    carry = (
        [f"                carry = {comb('carry', 'st')};"]
        if prod
        else [
            "                {  // compensated (Kahan) addition, as in the block per row",
            "                    const float y_ = st - carry_c, t_ = carry + y_;",
            "                    carry_c = (t_ - carry) - y_;",
            "                    carry = t_;",
            "                }",
        ]
    )
    return [
        f"__device__ __forceinline__ void kp_{rid}_wrow_body({sig.decls()}) {{",
        f"    constexpr int U = {U};",
        *lams,
        "    const int lane = threadIdx.x & 31;",
        "    const long long w0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;",
        "    const long long wstep = ((long long)gridDim.x * blockDim.x) >> 5;",
        "    (void)inner;",
        "    for (long long r = w0; r < outer; r += wstep) {  // warp-uniform",
        "        const long long rs = r * L, ro = r * Lo, nv = L >> 2;",
        f"        float carry = {ident};",
        *([] if prod else ["        float carry_c = 0.0f;"]),
        "        for (long long q0 = 0; q0 < nv; q0 += 32 * U) {",
        "            Vec<float, 4> t[U];",
        "#pragma unroll",
        "            for (int u = 0; u < U; ++u) {",
        "                const long long q = q0 + u * 32 + lane;",
        f"                if (q < nv) t[u] = vload<float, 4>(x + rs + {memv} * 4);",
        "            }",
        "            float v[U][4], tot[U];",
        "#pragma unroll",
        "            for (int u = 0; u < U; ++u) {",
        "                const long long q = q0 + u * 32 + lane;",
        "#pragma unroll",
        "                for (int e = 0; e < 4; ++e)",
        f"                    v[u][e] = q < nv ? pre(ld(t[u].v[{el}]), rs + {mem}) : {ident};",
        "#pragma unroll",
        f"                for (int e = 1; e < 4; ++e) v[u][e] = {comb('v[u][e - 1]', 'v[u][e]')};",
        "                tot[u] = v[u][3];",
        "            }",
        "#pragma unroll",
        "            for (int o = 1; o < 32; o <<= 1) {  // U independent scans over the lanes",
        "#pragma unroll",
        "                for (int u = 0; u < U; ++u) {",
        "                    const float n = __shfl_up_sync(0xffffffffu, tot[u], o);",
        f"                    if (lane >= o) tot[u] = {comb('tot[u]', 'n')};",
        "                }",
        "            }",
        "#pragma unroll",
        "            for (int u = 0; u < U; ++u) {",
        "                const long long q = q0 + u * 32 + lane;",
        "                float ex = __shfl_up_sync(0xffffffffu, tot[u], 1);",
        f"                if (lane == 0) ex = {ident};",
        f"                const float p = {comb('carry', 'ex')}, st = __shfl_sync(0xffffffffu, tot[u], 31);",
        "                if (q < nv) {",
        "                    Vec<float, 4> o_;",
        "#pragma unroll",
        "                    for (int e = 0; e < 4; ++e)",
        f"                        o_.v[{el}] = cv<float>(post({out}, ro + {mem}));",
        f"                    vstore<float, 4>(y + ro + {memv} * 4, o_);",
        "                }",
        *carry,
        "            }",
        "        }",
        "    }",
        "}",
    ]
