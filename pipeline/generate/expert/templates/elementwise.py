"""Fused elementwise chains (also the hybrid epilogue after a cuBLAS GEMM or cuDNN convolution).

One kernel per region: the output is seen as rows x cols; blocks run along a row's V-element vectors
(x) and over rows (y), grid-stride both ways. Each row has a scalar head up to the first V-aligned
element and a scalar tail, so any size takes the vector path for nearly all of it; the launcher falls
back to the V = 1 kernel only when a base pointer is not aligned. Row operands (a per-channel bias) are
read once per row, col operands (a per-feature bias) by the column index, full operands as vectors.

Fresh outputs are written at r * ldq + c: ldq is cols for an output of its own, and the row stride of
`out` when the launcher is handed one (a slice of a cat's or stack's output, render.py's sinking): the
region then writes its result where the consumer wants it, and the consumer's copy of it disappears.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.generate.expert import ops
from pipeline.generate.expert.layout import Bcast, EwLayout
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import (
    Code,
    chain_function,
    ctype,
    grid_sms,
    launch_bounds,
    torch_dtype,
)
from pipeline.generate.expert.templates.signature import Signature, Variant, i64, kernel, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.elementwise import EwPlan

_VECTOR = (Bcast.FULL, Bcast.DENSE)  # operands read as whole vectors
_INDEXED = (Bcast.ROW, Bcast.COL)  # operands indexed through (inner, mid) sizes


def render(region: Region, lay: EwLayout, rp: EwPlan, sinkable: bool = False, strided: bool = False) -> Code:
    """sinkable: the region's one output feeds a cat or stack, which may hand the launcher a slice to write
    into (out=); only then do the kernel and launcher take the output's row stride. strided: an operand is
    a view that may be rows of runs (a chunk, a slice, a head): the chain then reads each whole operand at
    its own row strides (lf<i>, le<i>, ld<i>: up to three runs of row dims)."""
    rid = region.rid
    into = _into(region, lay) if sinkable else ""
    inplace = dict(region.inplace)  # output -> input it overwrites
    target_of = {i: o for o, i in inplace.items()}
    ops_ = lay.operands
    outs = lay.outputs

    # ---- kernel parameters: the launcher's a<i> are the operands, q<j> the fresh outputs ----
    params = [
        ptr(f"p{i}", ctype(o.dtype), f"a{i}", const=o.name not in target_of) for i, o in enumerate(ops_)
    ]
    store_ptr: list[str] = []
    for j, (out, dt) in enumerate(outs):
        if out in inplace:
            store_ptr.append(f"p{[o.name for o in ops_].index(inplace[out])}")
        else:
            params.append(ptr(f"q{j}", ctype(dt), const=False))
            store_ptr.append(f"q{j}")
    params += [i64("rows"), i64("cols"), *([i64("ldq")] if into else [])]
    # A chain reads each whole operand at its own row strides: a strided view whose rows are contiguous
    # runs (a chunk, a selected component, a head of a permuted projection) is read in place, not gathered
    # into a copy first. A row starts at i0 * lf + i1 * le + i2 * ld, r = (i0 * rn1 + i1) * rn2 + i2.
    strided = strided and any(o.cls in _VECTOR for o in ops_)
    if strided:
        params += [i64("rn1"), i64("rn2")]
        params += [i64(f"{s}{i}") for i, o in enumerate(ops_) if o.cls in _VECTOR for s in ("lf", "le", "ld")]
    where = ops.positional(region.nodes)  # rows x N (layout.ew_layout): pr = r % M, pc = c
    if where:
        params.append(i64("pm", "shape[-2]"))
    for i, o in enumerate(ops_):
        if o.cls in _INDEXED:
            params += [i64(f"in{i}"), i64(f"md{i}")]
    sig = Signature(tuple(params))

    # ---- per-element operand expressions ----
    def start(i: int) -> str:
        """Where operand i's row starts."""
        return f"ra{i}" if strided and ops_[i].cls in _VECTOR else "rs"

    def operand(i: int, vector: bool) -> str:
        o = ops_[i]
        if o.cls in _VECTOR:
            return f"ld(x{i}[u].v[e])" if vector else f"ld(p{i}[{start(i)} + c])"
        if o.cls is Bcast.SCALAR:
            return f"s{i}"
        if o.cls is Bcast.ROW:
            return f"w{i}"
        return f"ld(p{i}[(in{i} == 1 && md{i} == cols) ? c : (c / in{i}) % md{i}])"

    def call(vector: bool) -> list[str]:
        outs_decl = ", ".join(f"o{j}" for j in range(len(outs)))
        args = ", ".join([*(["pr", "c"] if where else []), *(operand(i, vector) for i in range(len(ops_))),
                          *(f"o{j}" for j in range(len(outs)))])  # fmt: skip
        return [f"float {outs_decl};", f"kp_{rid}_f({args});"]

    full = [i for i, o in enumerate(ops_) if o.cls in _VECTOR]
    rowed = _rowed(lay, into, strided)
    # a fresh output's row: its own (rq) in a given tensor, else rs; one written in place: its operand's row
    row_of = [("rq" if into else "rs") if p.startswith("q") else start(int(p[1:])) for p in store_ptr]
    body = [
        "template <int V>",
        f"__device__ __forceinline__ void kp_{rid}_body({sig.decls()}) {{",
        f"    constexpr int U = {rp.unroll};  // vector accesses in flight per thread",
    ]
    body += [f"    const float s{i} = ld(p{i}[0]);" for i, o in enumerate(ops_) if o.cls is Bcast.SCALAR]
    body += [
        # rows given their own strides: a block may take several short rows (threadIdx.y), see _rows_grid
        "    for (long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y; r < rows;"
        " r += (long long)gridDim.y * blockDim.y) {"
        if rowed
        else "    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {",
        "        const long long rs = r * cols;",
        *(["        const long long rq = r * ldq;  // a fresh output's row start"] if into else []),
        *(
            ["        const long long i2 = r % rn2, i1 = (r / rn2) % rn1, i0 = r / rn2 / rn1;"]
            if strided
            else []
        ),
        *(
            [f"        const long long ra{i} = i0 * lf{i} + i1 * le{i} + i2 * ld{i};" for i in full]
            if strided
            else []
        ),
        *(["        const long long pr = r % pm;  // the row in its matrix"] if where else []),
    ]
    body += [
        f"        const float w{i} = ld(p{i}[(r / in{i}) % md{i}]);"
        for i, o in enumerate(ops_)
        if o.cls is Bcast.ROW
    ]
    body += [
        "        const long long head = head_of<V>(rs, cols);",
        "        const long long nv = (cols - head) / V;",
        "        const long long tail = head + nv * V;",
        "        if (V > 1 && blockIdx.x == 0 && threadIdx.x < 2 * V) {  // scalar head and tail (< V each)",
        "            const long long c = threadIdx.x < V ? (long long)threadIdx.x : tail + threadIdx.x - V;",
        "            if (threadIdx.x < V ? c < head : c < cols) {",
        *[f"                {s}" for s in call(False)],
        *[
            f"                {store_ptr[j]}[{row_of[j]} + c] = cv<{ctype(dt)}>(o{j});"
            for j, (_, dt) in enumerate(outs)
        ],
        "            }",
        "        }",
        "        const long long step = (long long)gridDim.x * blockDim.x * U;",
        "        for (long long j0 = (long long)blockIdx.x * blockDim.x * U + threadIdx.x; j0 < nv; j0 += step) {",
        *[f"            Vec<{ctype(ops_[i].dtype)}, V> x{i}[U];" for i in full],
        "#pragma unroll",
        "            for (int u = 0; u < U; ++u) {",
        "                const long long j = j0 + (long long)u * blockDim.x;",
        "                if (j < nv) {",
        *[
            f"                    x{i}[u] = vload<{ctype(ops_[i].dtype)}, V>(p{i} + {start(i)} + head + j * V);"
            for i in full
        ],
        "                }",
        "            }",
        "#pragma unroll",
        "            for (int u = 0; u < U; ++u) {",
        "                const long long j = j0 + (long long)u * blockDim.x;",
        "                if (j < nv) {",
        *[f"                    Vec<{ctype(dt)}, V> y{j};" for j, (_, dt) in enumerate(outs)],
        "#pragma unroll",
        "                    for (int e = 0; e < V; ++e) {",
        "                        const long long c = head + j * V + e;",
        "                        (void)c;",
        *[f"                        {s}" for s in call(True)],
        *[f"                        y{j}.v[e] = cv<{ctype(dt)}>(o{j});" for j, (_, dt) in enumerate(outs)],
        "                    }",
        *[
            f"                    vstore<{ctype(dt)}, V>({store_ptr[j]} + {row_of[j]} + head + j * V, y{j});"
            for j, (_, dt) in enumerate(outs)
        ],
        "                }",
        "            }",
        "        }",
        "    }",
        "}",
    ]
    variants = [Variant(f"kp_{rid}_v{v}", v) for v in sorted({1, rp.vec})]
    bounds = launch_bounds(rp.threads, rp.min_blocks)
    wrappers = [kernel(bounds, k.name, sig, f"kp_{rid}_body<{k.vec}>") for k in variants]
    summary = ", ".join(n.op for n in region.nodes)
    cuda = "\n".join(
        [
            f"// region {rid}: fused elementwise ({summary}); "
            + ("one flat row" if lay.k == lay.ndim else f"rows x cols with cols the last {lay.k} dims"),
            "namespace {",
            chain_function(region, [o.name for o in ops_], fast=rp.intrinsics),
            "",
            *body,
            "}  // namespace",
            "",
            "\n\n".join(wrappers),
        ]
    )
    return Code(cuda, _launcher(region, lay, rp, sig, variants, into, strided), f"_r_{rid}", tuple(k.name for k in variants),
                tuple(o.name for o in ops_), tuple(o for o, _ in outs), into=into,
                slot=f"torch.broadcast_shapes({', '.join(f'{{{i}}}.shape' for i in range(len(ops_)))})")  # fmt: skip


def _flat(lay: EwLayout) -> bool:
    """A chain over the whole output whose operands are each whole or one element: its rows may split at
    any dim."""
    return lay.k == lay.ndim and all(o.cls in _VECTOR or o.cls is Bcast.SCALAR for o in lay.operands)


def _rowed(lay: EwLayout, into: str, strided: bool) -> bool:
    """Whether short rows share a block (the kernel's y, _rows_grid): rows of their own strides, or a
    layout split at a row operand, whose rows may be as short as a head's 32 elements (an F.normalize over
    heads, its norm read by broadcast: a block a row left 248 of 256 threads idle, SwinV2's 24 took 1.26 ms
    on the H100). Not for column operands alone: the layout keeps their rows long, and the 2-D loop around
    their 64-bit index division spilled (ptxas, an MoE block's router division)."""
    return bool(into) or strided or any(o.cls is Bcast.ROW for o in lay.operands)


def _into(region: Region, lay: EwLayout) -> str:
    """The dtype of the one fresh output when the launcher may write it into a given tensor (out=), else "":
    an output of the operands' broadcast shape (one_hot's widened compare is not), none written in place,
    and every operand whole or one element, so the rows may split anywhere: a slice of a cat along dim d is
    rows split at d, which the fixed split of row or column operands (a bias) could not write."""
    if (
        not _flat(lay)
        or len(lay.outputs) != 1
        or region.inplace
        or any(n.op == "one_hot_eq" for n in region.nodes)
    ):
        return ""
    return lay.outputs[0][1]


def _copy_only(region: Region, lay: EwLayout) -> bool:
    """A region that only copies its one operand, dtype and shape kept (clone, contiguous, alias): where the
    operand is a strided view, the launcher's gather into a fresh tensor is the whole result, not a copy
    followed by a second one."""
    return (
        len(lay.operands) == 1
        and len(lay.outputs) == 1
        and not region.inplace
        and all(n.op in ops.IDENTITY and n.dtype == region.nodes[0].dtype for n in region.nodes)
        and lay.operands[0].cls in _VECTOR
    )


def _launcher(
    region: Region,
    lay: EwLayout,
    rp: EwPlan,
    sig: Signature,
    variants: list[Variant],
    into: str,
    strided: bool,
) -> str:
    rid = region.rid
    ops_ = lay.operands
    inplace = dict(region.inplace)
    a = [f"a{i}" for i in range(len(ops_))]
    lines = [f"def _r_{rid}(sms, {', '.join(a)}{', out=None' if into else ''}):"]
    if _copy_only(region, lay):  # a strided view's copy (x.permute(...).contiguous()): the gather is the copy
        lines += [
            f"    if not a0.is_contiguous(){' and out is None' if into else ''}:",
            "        return _contig(a0)",
        ]
    # one_hot's compare widens its (..., 1) index to the class count: the one dim no operand has
    widened = [f"({n.shape[-1]},)" for n in region.nodes if n.op == "one_hot_eq" and n.shape][:1]
    shapes = ", ".join([*(f"{x}.shape" for x in a), *widened])
    if len(a) > 1 and not widened:  # torch.broadcast_shapes costs 12-25 us of host time a call: skipped
        same = " and ".join(f"{x}.shape == a0.shape" for x in a[1:])  # where the operands agree
        lines.append(f"    shape = a0.shape if {same} else torch.broadcast_shapes({shapes})")
    else:
        lines.append(f"    shape = torch.broadcast_shapes({shapes})")
    lines += [
        "    nd = len(shape)",
        "    split = 0" if lay.k == lay.ndim else f"    split = max(0, nd - {lay.k})",
    ]
    if into:  # written into `out` (a flat chain): rows split where `out` holds them as contiguous runs
        lines += ["    ldq = None", "    if out is not None:",
                  f"        split, ldq = _out_rows(out, shape, torch.{into})"]  # fmt: skip
    full = [f"a{i}" for i, o in enumerate(ops_) if o.cls in _VECTOR]
    if strided and lay.k == lay.ndim:  # a flat chain's rows: where every strided operand's are runs of at
        # least two sectors (short rows share a block; shorter runs are gathered into one flat row)
        pick = f"split = _run_split(({', '.join(full)},), shape, {max(16, 4 * rp.vec)})"
        lines += ["    if ldq is None:", f"        {pick}"] if into else [f"    {pick}"]
    lines.append("    rows, cols = math.prod(shape[:split]), math.prod(shape[split:])")
    if into:
        lines.append("    ldq = cols if ldq is None else ldq")
    if strided:  # each read in place where its rows are runs, else gathered
        strides = ", ".join(f"(lf{i}, le{i}, ld{i})" for i, o in enumerate(ops_) if o.cls in _VECTOR)
        lines.append(
            f"    ({', '.join(full)},), rn1, rn2, ({strides},) = _rows_in_place(({', '.join(full)},), shape, split)"
        )
    for i, o in enumerate(ops_):
        if o.cls in _VECTOR:
            if not strided:
                lines.append(f"    a{i} = _full(a{i}, shape)")
        elif o.cls is Bcast.SCALAR:
            lines.append(f"    a{i} = _scalar(a{i})")
        else:
            lines.append(f"    a{i}, in{i}, md{i} = _bc(a{i}, shape, split, {o.cls is Bcast.ROW})")
    outs = []
    for j, (out, dt) in enumerate(lay.outputs):
        if out in inplace:
            outs.append(f"a{[o.name for o in ops_].index(inplace[out])}")
        else:
            fresh = f"torch.empty(shape, dtype={torch_dtype(dt)}, device=a0.device)"
            lines.append(f"    q{j} = {fresh if not into else f'out if out is not None else {fresh}'}")
            outs.append(f"q{j}")
    ret = ", ".join(outs)
    lines.append(f"    if rows * cols == 0:\n        return {ret}")
    lines.append(f"    args = ({sig.args()},)")
    rowed = _rowed(lay, into, strided)
    grid_args = f"{grid_sms(rp.sm_share)}, rows, cols, {rp.vec}, {rp.threads}, {rp.unroll}, {rp.persistent}"
    lines.append(f"    grid, block = _rows_grid({grid_args})" if rowed else f"    grid = _grid({grid_args})")
    vec_tensors = [f"a{i}" for i, o in enumerate(ops_) if o.cls in _VECTOR] + [
        f"q{j}" for j, (out, _) in enumerate(lay.outputs) if out not in inplace
    ]
    call = "kernels.{}(grid, " + ("block" if rowed else f"({rp.threads},)") + ", args)  # noqa: F821"
    scalar, vector = variants[0], variants[-1]
    if vector.vec > 1:  # the vector kernel when every vector-read tensor is aligned, else the scalar one
        # (with rows of their own strides: every row of every tensor starting on a vector)
        lds = [
            *(["ldq"] if into else []),
            *(
                f"{s}{i}"
                for i, o in enumerate(ops_)
                if o.cls in _VECTOR and strided
                for s in ("lf", "le", "ld")
            ),
        ]
        rows_align = (
            f" and (rows == 1 or (cols % {vector.vec} == 0 and all(v % {vector.vec} == 0 for v in ({', '.join(lds)},))))"
            if lds
            else ""
        )
        lines.append(f"    if _aligned(({', '.join(vec_tensors)},), {vector.vec}){rows_align}:")
        lines.append("        " + call.format(vector.name))
        lines.append("    else:")
        lines.append("        " + call.format(scalar.name))
    else:
        lines.append("    " + call.format(scalar.name))
    lines.append(f"    return {ret}")
    return "\n".join(lines)
