"""Fused elementwise chains (also the hybrid epilogue after a cuBLAS GEMM or cuDNN convolution).

One kernel per region: the output is seen as rows x cols; blocks run along a row's V-element vectors
(x) and over rows (y), grid-stride both ways. Each row has a scalar head up to the first V-aligned
element and a scalar tail, so any size takes the vector path for nearly all of it; the launcher falls
back to the V = 1 kernel only when a base pointer is not aligned. Row operands (a per-channel bias) are
read once per row, col operands (a per-feature bias) by the column index, full operands as vectors.
"""

from __future__ import annotations

from pipeline.generate.expert.layout import EwLayout
from pipeline.generate.expert.plan import RegionPlan
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code, chain_function, ctype, launch_bounds, torch_dtype


def render(region: Region, lay: EwLayout, rp: RegionPlan) -> Code:
    rid = region.rid
    inplace = dict(region.inplace)  # output -> input it overwrites
    target_of = {i: o for o, i in inplace.items()}
    ops_ = lay.operands
    outs = lay.outputs
    vecs = sorted({1, rp.vec})

    # ---- kernel parameters ----
    params, names = [], []
    for i, o in enumerate(ops_):
        const = "" if o.name in target_of else "const "
        params.append(f"{const}{ctype(o.dtype)}* __restrict__ p{i}")
        names.append(f"p{i}")
    store_ptr: list[str] = []
    for j, (out, dt) in enumerate(outs):
        if out in inplace:
            store_ptr.append(f"p{[o.name for o in ops_].index(inplace[out])}")
        else:
            params.append(f"{ctype(dt)}* __restrict__ q{j}")
            names.append(f"q{j}")
            store_ptr.append(f"q{j}")
    params += ["long long rows", "long long cols"]
    names += ["rows", "cols"]
    for i, o in enumerate(ops_):
        if o.cls in ("row", "col"):
            params += [f"long long in{i}", f"long long md{i}"]
            names += [f"in{i}", f"md{i}"]

    # ---- per-element operand expressions ----
    def operand(i: int, vector: bool) -> str:
        o = ops_[i]
        if o.cls in ("full", "dense"):
            return f"ld(x{i}[u].v[e])" if vector else f"ld(p{i}[rs + c])"
        if o.cls == "scalar":
            return f"s{i}"
        if o.cls == "row":
            return f"w{i}"
        return f"ld(p{i}[(in{i} == 1 && md{i} == cols) ? c : (c / in{i}) % md{i}])"

    def call(vector: bool) -> list[str]:
        outs_decl = ", ".join(f"o{j}" for j in range(len(outs)))
        args = ", ".join([operand(i, vector) for i in range(len(ops_))] + [f"o{j}" for j in range(len(outs))])
        return [f"float {outs_decl};", f"kp_{rid}_f({args});"]

    full = [i for i, o in enumerate(ops_) if o.cls in ("full", "dense")]
    body = [
        "template <int V>",
        f"__device__ __forceinline__ void kp_{rid}_body({', '.join(params)}) {{",
        f"    constexpr int U = {rp.unroll};  // vector accesses in flight per thread",
    ]
    body += [f"    const float s{i} = ld(p{i}[0]);" for i, o in enumerate(ops_) if o.cls == "scalar"]
    body += [
        "    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {",
        "        const long long rs = r * cols;",
    ]
    body += [
        f"        const float w{i} = ld(p{i}[(r / in{i}) % md{i}]);"
        for i, o in enumerate(ops_)
        if o.cls == "row"
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
            f"                {store_ptr[j]}[rs + c] = cv<{ctype(dt)}>(o{j});"
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
            f"                    x{i}[u] = vload<{ctype(ops_[i].dtype)}, V>(p{i} + rs + head + j * V);"
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
            f"                    vstore<{ctype(dt)}, V>({store_ptr[j]} + rs + head + j * V, y{j});"
            for j, (_, dt) in enumerate(outs)
        ],
        "                }",
        "            }",
        "        }",
        "    }",
        "}",
    ]
    kernels = [f"kp_{rid}_v{v}" for v in vecs]
    wrappers = [
        f'extern "C" __global__ void {launch_bounds(rp.threads, rp.min_blocks)}\n'
        f"kp_{rid}_v{v}({', '.join(params)}) {{\n    kp_{rid}_body<{v}>({', '.join(names)});\n}}"
        for v in vecs
    ]
    summary = ", ".join(n.op for n in region.nodes)
    cuda = "\n".join(
        [
            f"// region {rid}: fused elementwise ({summary}); "
            + ("one flat row" if lay.k == lay.ndim else f"rows x cols with cols the last {lay.k} dims"),
            "namespace {",
            chain_function(region, [o.name for o in ops_]),
            "",
            *body,
            "}  // namespace",
            "",
            "\n\n".join(wrappers),
        ]
    )
    return Code(cuda, _launcher(region, lay, rp, kernels), f"_r_{rid}", tuple(kernels), tuple(o.name for o in ops_),
                tuple(o for o, _ in outs))  # fmt: skip


def _launcher(region: Region, lay: EwLayout, rp: RegionPlan, kernels: list[str]) -> str:
    rid = region.rid
    ops_ = lay.operands
    inplace = dict(region.inplace)
    a = [f"a{i}" for i in range(len(ops_))]
    lines = [f"def _r_{rid}(sms, {', '.join(a)}):"]
    lines.append(f"    shape = torch.broadcast_shapes({', '.join(f'{x}.shape' for x in a)})")
    lines += [
        "    nd = len(shape)",
        "    split = 0" if lay.k == lay.ndim else f"    split = max(0, nd - {lay.k})",
        "    rows, cols = math.prod(shape[:split]), math.prod(shape[split:])",
    ]
    extra: list[str] = []
    for i, o in enumerate(ops_):
        if o.cls in ("full", "dense"):
            lines.append(f"    a{i} = _full(a{i}, shape)")
        elif o.cls == "scalar":
            lines.append(f"    a{i} = _scalar(a{i})")
        else:
            lines.append(f"    a{i}, in{i}, md{i} = _bc(a{i}, shape, split, {o.cls == 'row'})")
            extra += [f"numpy.int64(in{i})", f"numpy.int64(md{i})"]
    outs, ptrs = [], [f"a{i}" for i in range(len(ops_))]
    for j, (out, dt) in enumerate(lay.outputs):
        if out in inplace:
            outs.append(f"a{[o.name for o in ops_].index(inplace[out])}")
        else:
            lines.append(f"    q{j} = torch.empty(shape, dtype={torch_dtype(dt)}, device=a0.device)")
            outs.append(f"q{j}")
            ptrs.append(f"q{j}")
    ret = ", ".join(outs)
    lines.append(f"    if rows * cols == 0:\n        return {ret}")
    args = ", ".join([*ptrs, "numpy.int64(rows)", "numpy.int64(cols)", *extra])
    lines.append(f"    args = ({args},)")
    lines.append(f"    grid = _grid(sms, rows, cols, {rp.vec}, {rp.threads}, {rp.unroll}, {rp.persistent})")
    vec_tensors = [f"a{i}" for i, o in enumerate(ops_) if o.cls in ("full", "dense")] + [
        f"q{j}" for j, (out, _) in enumerate(lay.outputs) if out not in inplace
    ]
    if rp.vec > 1:
        lines.append(f"    if _aligned(({', '.join(vec_tensors)},), {rp.vec}):")
        lines.append(f"        kernels.{kernels[-1]}(grid, ({rp.threads},), args)  # noqa: F821")
        lines.append("    else:")
        lines.append(f"        kernels.{kernels[0]}(grid, ({rp.threads},), args)  # noqa: F821")
    else:
        lines.append(f"    kernels.{kernels[0]}(grid, ({rp.threads},), args)  # noqa: F821")
    lines.append(f"    return {ret}")
    return "\n".join(lines)
