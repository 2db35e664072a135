"""What a template returns for one region, and the helpers every generated launcher carries."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.generate.expert import ops
from pipeline.generate.expert.graph import Ref
from pipeline.generate.expert.regions import Region

# nvcc flags a source that includes CuTe needs (its headers use constexpr functions from device code).
CUTE_FLAGS = ("--expt-relaxed-constexpr",)


@dataclass(frozen=True)
class Code:
    cuda: str  # kernels and helpers for this region
    launcher: str  # a Python function `def <fn>(sms, *args)` that launches them and returns the outputs
    fn: str
    kernels: tuple[str, ...]
    args: tuple[str, ...]  # the values forward passes to fn, in order
    outputs: tuple[str, ...]  # the values fn returns, in order
    at: str = ""  # the region whose place in forward the call takes (its last fused one); "": its own
    # A launcher that can write its one output into a given tensor (`out=`): that output's dtype, else "",
    # and its shape as a Python expression over the args ({0}, {1}...). A cat or stack launcher that takes
    # such outputs as _Slot stand-ins (render.py's sinking) names its inputs in the op's order (repeats
    # kept), and returns (result, the stand-ins' slices in that order).
    into: str = ""
    slot: str = ""
    sinks: tuple[str, ...] = ()


def ctype(dtype: str) -> str:
    return ops.C_TYPES[dtype]


def launch_bounds(threads: int, min_blocks: int) -> str:
    return f"__launch_bounds__({threads}, {min_blocks})" if min_blocks else f"__launch_bounds__({threads})"


def grid_sms(share: int) -> str:
    """The launcher's SM count for a persistent grid: `sms`, or a share of it in percent (lower_power)."""
    return f"max(1, sms * {share} // 100)" if share else "sms"


def torch_dtype(dtype: str) -> str:
    return f"torch.{dtype}"


def chain_function(region: Region, operands: list[str], mufu: bool = False, fast: bool = False) -> str:
    """The region's elementwise ops as one fp32 device function: operand values in, output values out
    (mufu: tanh by the approximate hardware instruction; fast: logs and exponentials by the special-function
    unit; see ops.ew_expr). A region with positional ops
    (ops.POSITIONAL) takes the element's row and column in its last two dims first."""
    names = {n.name for n in region.nodes}
    index = {name: i for i, name in enumerate(operands)}

    def val(a) -> str:
        if isinstance(a, Ref):
            return f"v_{a.name}" if a.name in names else f"a{index[a.name]}"
        return ops.lit(a)

    params = ["long long pr", "long long pc"] if ops.positional(region.nodes) else []
    params += [f"float a{i}" for i in range(len(operands))]
    params += [f"float& o{j}" for j in range(len(region.outputs))]
    lines = [f"__device__ __forceinline__ void kp_{region.rid}_f({', '.join(params)}) {{"]
    # a chain with a step (ops.STEPS) rounds each 16-bit value as eager stores it, so what the step compares
    # is eager's value; other chains keep fp32 between their ops
    stepped = any(n.op in ops.STEPS for n in region.nodes)
    for n in region.nodes:
        expr = ops.ew_expr(n, val, mufu, fast)
        if stepped and n.dtype in ops.ROUNDED:
            expr = ops.ROUNDED[n.dtype].format(expr)
        lines.append(f"    const float v_{n.name} = {expr};  // {n.target}")
    for j, out in enumerate(region.outputs):
        lines.append(f"    o{j} = v_{out};")
    lines.append("}")
    return "\n".join(lines)


# Module-level helpers of every generated launcher: plumbing only (views, shapes), so the static check
# counts none of it as library compute.
LAUNCHER_HELPERS = '''
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535


def _contig(t):
    """t as a contiguous tensor; a strided view (a transpose, a broadcast) is gathered by our own kernel."""
    if t.is_contiguous():
        return t
    if t.dim() > 8 or t.dtype not in _GATHERED:
        return t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    n = t.numel()
    if n == 0:
        return out
    sizes = [*t.shape, *[1] * (8 - t.dim())]
    strides = [*t.stride(), *[0] * (8 - t.dim())]
    args = (t, out, numpy.int64(n), numpy.int32(t.dim()), *(numpy.int64(v) for v in (*sizes, *strides)))
    grid = (max(1, min(-(-n // 256), MAX_GRID_Y * 32)),)
    if t.dtype == torch.float32:
        kernels.kp_gather_f32(grid, (256,), args)  # noqa: F821
    elif t.dtype == torch.float16:
        kernels.kp_gather_f16(grid, (256,), args)  # noqa: F821
    elif t.dtype == torch.bfloat16:
        kernels.kp_gather_bf16(grid, (256,), args)  # noqa: F821
    elif t.dtype == torch.bool:
        kernels.kp_gather_b8(grid, (256,), args)  # noqa: F821
    else:
        kernels.kp_gather_i64(grid, (256,), args)  # noqa: F821
    return out


def _full(t, shape):
    """t as a contiguous tensor of exactly `shape` (expanded first when it broadcasts)."""
    if tuple(t.shape) != tuple(shape):
        t = t.expand(shape)
    return _contig(t)


def _scalar(t):
    if t.numel() != 1:
        raise ValueError(f"kernelpro expert: expected a one-element operand, got shape {tuple(t.shape)}")
    return _contig(t)


def _bc(t, shape, split, row):
    """(t, inner, mid) for an operand that varies along one run of dims of `shape`: element index
    (i // inner) % mid, where i counts rows (row operands) or columns within a row (col operands)."""
    nd = len(shape)
    dims = (1,) * (nd - t.dim()) + tuple(t.shape)
    live = [i for i in range(nd) if dims[i] != 1]
    if not live:
        return _contig(t), 1, 1
    a, b = live[0], live[-1] + 1
    if any(dims[i] != shape[i] for i in range(a, b)) or (b > split if row else a < split):
        raise ValueError(
            f"kernelpro expert: an operand of shape {tuple(t.shape)} does not fit the kernel's layout of "
            f"{tuple(shape)} split after {split} dims"
        )
    return _contig(t), math.prod(shape[b : split if row else nd]), math.prod(shape[a:b])


def _aligned(tensors, vec):
    return all(t.data_ptr() % (vec * t.element_size()) == 0 for t in tensors)


def _grid(sms, rows, cols, vec, threads, unroll, persistent):
    """(x, y) blocks: x along a row's vectors, y over rows (the kernels loop over what the grid misses)."""
    per_row = max(1, -(-cols // (vec * threads * unroll)))
    gy = max(1, min(rows, MAX_GRID_Y))
    if persistent:
        total = max(1, sms * persistent)
        gy = min(gy, total)
        return (max(1, min(per_row, total // gy)), gy)
    return (min(per_row, MAX_GRID_X), gy)


def _split3(shape, d0, d1):
    """(outer, reduced, inner) sizes of `shape` around the dims [d0, d1)."""
    return math.prod(shape[:d0]), math.prod(shape[d0:d1]), math.prod(shape[d1:])
'''


# The launcher's reshape of a view (only in the launchers that reshape one: a helper every launcher
# carried would change every candidate's key).
RESHAPE_HELPERS = '''

def _viewable(t, shape):
    """Whether t.view(shape) exists: ATen's rule, each run of dims t keeps contiguous among themselves split
    or merged within itself (heads split off a projection's columns are a view, a transpose's rows not)."""
    size, stride = list(t.shape), list(t.stride())
    if t.numel() == 0 or not size:
        return True
    view_d, base, numel, view_numel = len(shape) - 1, stride[-1], 1, 1
    for d in range(len(size) - 1, -1, -1):
        numel *= size[d]
        if d == 0 or (size[d - 1] != 1 and stride[d - 1] != numel * base):
            while view_d >= 0 and (view_numel < numel or shape[view_d] == 1):
                view_numel *= shape[view_d]
                view_d -= 1
            if view_numel != numel:
                return False
            if d > 0:
                base, numel, view_numel = stride[d - 1], 1, 1
    return view_d == -1


def _reshape(t, shape):
    """t at `shape`: a view when one exists, else gathered by our own kernel (not torch) and reshaped."""
    return t.view(shape) if _viewable(t, shape) else _contig(t).reshape(shape)
'''


# A chain of views and copies composed into one gather that cuts its source as well (chains.py): the source's
# elements at the chain's sizes and strides, counted in elements of the source made contiguous.
STRIDED_HELPERS = '''

def _strided(t, size, stride, offset):
    """The elements of t (contiguous: gathered first if it is not) at `size` and `stride` from `offset`."""
    t = _contig(t)
    return t.as_strided(size, stride, t.storage_offset() + offset)
'''


# In launchers that see tensors as rows of evenly spaced contiguous runs: a sinking one (render.py), or
# an elementwise chain reading strided views in place.
ROWS_HELPERS = '''

def _row_run(t, split):
    """The length of t's rows seen as (prod(shape[:split]), prod(shape[split:])) when each is one
    contiguous run, else None."""
    run = 1
    for d in range(t.dim() - 1, split - 1, -1):
        if t.shape[d] != 1 and t.stride(d) != run:
            return None
        run *= t.shape[d]
    return run


def _row_stride(t, split):
    """The stride between the rows of t seen as (prod(shape[:split]), prod(shape[split:])) when every row
    is one contiguous run and the rows are evenly spaced, else None."""
    size, stride = list(t.shape), list(t.stride())
    run = _row_run(t, split)
    if run is None:
        return None
    ldq = step = None
    for d in range(split - 1, -1, -1):
        if size[d] == 1:
            continue
        if ldq is None:
            ldq, step = stride[d], stride[d] * size[d]
        elif stride[d] != step:
            return None
        else:
            step *= size[d]
    return run if ldq is None else ldq


def _row_groups(ts, shape, split):
    """(rn1, rn2, [(lf, le, ld) of each t]) when every t of ts, seen at `shape` as rows x cols split at
    `split`, has each row one contiguous run and its row starts at i0 * lf + i1 * le + i2 * ld for the one
    split of the row index r = (i0 * rn1 + i1) * rn2 + i2 all of them share, else None: the row dims merged
    where every t's strides allow, at most three runs of them left (q of a permuted qkv: batch, head, token)."""
    if 0 in shape:  # nothing to read (no launch follows); an empty tensor's strides need not be runs
        return 1, 1, [(0, 0, 0)] * len(ts)
    ts = [t if tuple(t.shape) == tuple(shape) else t.expand(shape) for t in ts]
    if any(_row_run(t, split) is None for t in ts):
        return None
    groups = []  # [size, strides of each t], outermost first
    for d in range(split):
        if shape[d] == 1:
            continue
        st = [t.stride(d) for t in ts]
        if groups and all(g == x * shape[d] for g, x in zip(groups[-1][1], st)):
            groups[-1] = [groups[-1][0] * shape[d], st]
        else:
            groups.append([shape[d], st])
    if len(groups) > 3:
        return None
    groups = [[1, [0] * len(ts)]] * (3 - len(groups)) + groups
    return groups[1][0], groups[2][0], [tuple(g[1][k] for g in groups) for k in range(len(ts))]


def _rows_in_place(ts, shape, split):
    """(ts, rn1, rn2, their row strides) as _row_groups gives them: each t read in place where its rows are
    runs, else gathered into a contiguous copy (and all of them gathered when together they need more than
    three runs of row dims)."""
    ts = [t if tuple(t.shape) == tuple(shape) else t.expand(shape) for t in ts]
    ts = [t if _row_groups((t,), shape, split) else _contig(t) for t in ts]
    g = _row_groups(ts, shape, split)
    if g is None:
        ts = [_contig(t) for t in ts]
        g = _row_groups(ts, shape, split)
    return (tuple(ts), *g)


def _rows_grid(sms, rows, cols, vec, threads, unroll, persistent):
    """(grid, block) of an elementwise kernel over rows x cols whose rows have their own strides: a block's
    threads along a row's vectors (x) and over rows (y), so that rows shorter than a block share one (a
    block a row of 16 vectors left 15 of 16 threads idle). At least 2 vec threads along a row: they take a
    row's scalar head and tail."""
    per = max(1, -(-cols // (vec * unroll)))  # a row's vector steps
    tx = min(threads, max(2 * vec, 8, 1 << (per - 1).bit_length()))
    ty = threads // tx
    gx = max(1, min(-(-per // tx), MAX_GRID_X))
    gy = max(1, min(-(-rows // ty), MAX_GRID_Y))
    if persistent:
        total = max(1, sms * persistent)
        gy = min(gy, total)
        gx = max(1, min(gx, total // gy))
    return (gx, gy), (tx, ty)


def _run_split(ts, shape, least):
    """The first split at which the tensors of ts (seen at `shape`) are rows of contiguous runs of at least
    `least` elements that _row_groups reaches, or 0 (the strided ones gathered, one flat row)."""
    ts = [t if tuple(t.shape) == tuple(shape) else t.expand(shape) for t in ts]
    if all(t.is_contiguous() for t in ts):
        return 0
    for s in range(len(shape) + 1):
        if math.prod(shape[s:]) < least:
            break
        if _row_groups(ts, shape, s) is not None:
            return s
    return 0
'''


# Only in launchers whose elementwise output feeds a cat or stack (render.py's sinking).
SINK_HELPERS = '''

class _Slot:
    """Stands for a region's output (its shape, dtype and device) until the cat or stack that reads it has
    allocated its own output: the region then writes straight into its slice of it, never copied."""

    def __init__(self, dtype, shape, device):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, device

    def dim(self):
        return len(self.shape)


def _check_out(out, shape, dtype):
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"kernelpro expert: out= of {tuple(out.shape)} {out.dtype}, not {tuple(shape)} {dtype}")


def _out_rows(out, shape, dtype):
    """(split, row stride) at which a flat elementwise kernel writes into `out`: the first split whose rows
    `out` holds as evenly spaced contiguous runs (a slice of a cat along dim d: d)."""
    _check_out(out, shape, dtype)
    for s in range(len(shape) + 1):
        ldq = _row_stride(out, s)
        if ldq is not None:
            return s, ldq
    raise ValueError(f"kernelpro expert: out= with strides {out.stride()} is not rows of contiguous runs")


def _batch_stride(out, shape, dtype):
    """The stride between the images of `out` (a slice of a concatenation along the channels), each of
    which a convolution writes as one contiguous block."""
    _check_out(out, shape, dtype)
    ldo = _row_stride(out, 1)
    if ldo is None:
        raise ValueError(f"kernelpro expert: out= with strides {out.stride()} is not one block an image")
    return ldo
'''


def _gather_kernels(*types: tuple[str, str]) -> str:
    """Our own kernels for making strided views contiguous (see _contig), one per (tag, C type)."""
    return "\n".join(
        f"""extern "C" __global__ void __launch_bounds__(256)
kp_gather_{tag}(const {ct}* __restrict__ src, {ct}* __restrict__ dst, long long n, int nd,
{" ".join(f"long long s{d}," for d in range(8))}
{" ".join(f"long long t{d}," for d in range(8)).rstrip(",")}) {{
    const long long size[8] = {{{", ".join(f"s{d}" for d in range(8))}}};
    const long long stride[8] = {{{", ".join(f"t{d}" for d in range(8))}}};
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{
        long long rest = i, off = 0;
#pragma unroll
        for (int d = 7; d >= 0; --d) {{
            if (d < nd) {{
                const long long q = rest / size[d];
                off += (rest - q * size[d]) * stride[d];
                rest = q;
            }}
        }}
        dst[i] = src[off];
    }}
}}
"""
        for tag, ct in types
    )


GATHER = _gather_kernels(("f32", "float"), ("b8", "bool"), ("i64", "long long"))  # in every generated source
GATHER_HALF = _gather_kernels(("f16", "__half"), ("bf16", "__nv_bfloat16"))  # in sources that use fp16/bf16


def gathered(half: bool) -> str:
    """The launcher's line naming the dtypes its source has a gather kernel for (_contig)."""
    halves = " torch.float16, torch.bfloat16," if half else ""
    return f"_GATHERED = (torch.float32,{halves} torch.bool, torch.int64)"


def region_source(header: str, fused_from: tuple, body: list[str], wrappers: list[str], *tail: str) -> str:
    """One region's CUDA: a header comment naming the fused neighbours, their chains and the kernel bodies in
    an anonymous namespace, then the extern "C" wrappers (and any extra kernels, e.g. a split combine)."""
    parts = [f for f in fused_from if f]
    fused = [f.region.rid for f in parts]
    return "\n".join(
        [
            header + (f"; fused: {', '.join(fused)}" if fused else ""),
            "namespace {",
            *[f.chain() for f in parts],
            *body,
            "}  // namespace",
            "",
            "\n\n".join(wrappers),
            *tail,
        ]
    )
