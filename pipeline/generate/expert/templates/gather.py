"""A faster gather of strided fp32 views (a permuted window partition, a transposed head split) for the
launchers of tasks whose graphs make such views; every other launcher keeps the generic gather of
templates/code.py (`_contig`), so its source, and its candidates' keys, stay as they were.

The generic kernel decodes each element's source offset with a 64-bit division and remainder per
dimension, up to eight. Here the launcher first drops unit dims and merges dims that step as one (an outer
dim whose stride is the inner one's extent), then, where the element count and every offset fit 31 bits,
divides with 32-bit magic multipliers computed on the host (Granlund and Montgomery's division by
invariant integers: a multiply-high, an add and a shift a dimension), and moves 16 bytes a thread where
the innermost dim is contiguous in the source and every offset a whole number of vectors.

Not measured on a GPU yet. An earlier rewrite (merged dims, 16-byte vectors, 64-bit divisions) measured
no change on SwinV2 (docs/benchmarks.md); SwinMLP gathers 670 MB a call in 51 copies at about 580 GB/s.
"""

from __future__ import annotations

from pipeline.generate.expert.regions import Lowered

MAX_DIMS = 6  # dims the fast kernel decodes (after merging); a view with more takes the generic gather

# Views after which the launcher may hold a tensor that is not contiguous (a plain reshape never is one).
STRIDED_VIEWS = frozenset(
    {"permute", "transpose", "t", "numpy_T", "mT", "mH", "T", "H", "adjoint", "swapaxes", "swapdims", "movedim",
     "moveaxis", "expand", "expand_as", "select", "slice", "narrow", "getitem", "split", "split_with_sizes",
     "chunk", "unbind", "diagonal", "as_strided", "unfold"}
)  # fmt: skip


def wanted(low: Lowered) -> bool:
    """Whether the task's graph makes views the launcher may gather."""
    return any(n.op in STRIDED_VIEWS for n in low.graph.nodes)


_NAMES = [f"{p}{d}" for p in "smlt" for d in range(MAX_DIMS)]
_ARGS = ", ".join(f"unsigned {v}" for v in _NAMES)
_ARRAYS = "\n".join(
    f"    const unsigned {name}[{MAX_DIMS}] = {{{', '.join(f'{p}{d}' for d in range(MAX_DIMS))}}};"
    for name, p in (("size", "s"), ("magic", "m"), ("shift", "l"), ("stride", "t"))
)

# Element (or vector) i of the output: its source offset, the innermost dim last. A dim's quotient is
# (umulhi(rest, magic) + rest) >> shift: exact for rest < 2^31 (the launcher's bound).
FAST_GATHER = f"""
template <int V>
__device__ __forceinline__ void kp_gather_fast(const float* __restrict__ src, float* __restrict__ dst,
                                               unsigned n, int nd, {_ARGS}) {{
{_ARRAYS}
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {{
        unsigned rest = i, off = 0;
#pragma unroll
        for (int d = {MAX_DIMS - 1}; d >= 0; --d) {{
            if (d < nd) {{
                const unsigned q = (__umulhi(rest, magic[d]) + rest) >> shift[d];
                off += (rest - q * size[d]) * stride[d];
                rest = q;
            }}
        }}
        if constexpr (V == 1) {{
            dst[i] = src[off];
        }} else {{
            vstore<float, V>(dst + (size_t)i * V, vload<float, V>(src + off));
        }}
    }}
}}
extern "C" __global__ void __launch_bounds__(256)
kp_gather_fast_f32(const float* __restrict__ src, float* __restrict__ dst, unsigned n, int nd, {_ARGS}) {{
    kp_gather_fast<1>(src, dst, n, nd, {", ".join(_NAMES)});
}}
extern "C" __global__ void __launch_bounds__(256)
kp_gather_fast_f32x4(const float* __restrict__ src, float* __restrict__ dst, unsigned n, int nd, {_ARGS}) {{
    kp_gather_fast<4>(src, dst, n, nd, {", ".join(_NAMES)});
}}
"""

# The launcher's `_contig` for fp32 views, defined after the generic one (which it falls back to).
FAST_CONTIG = f'''
_contig_any = _contig
_GATHER_PLANS = {{}}


def _divider(d):
    """(magic, shift) with q = (umulhi(x, magic) + x) >> shift == x // d for 0 <= x < 2**31."""
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def _gather_plan(shape, stride):
    """(vector width, the kernel's constant arguments) of an fp32 view; None: the generic gather."""
    dims = []  # (size, stride), outermost first
    for size, step in zip(shape, stride):
        if size == 1:
            continue
        if dims and dims[-1][1] == step * size:  # the outer dim steps over exactly this one: one dim
            dims[-1] = (dims[-1][0] * size, step)
        else:
            dims.append((size, step))
    if not dims or len(dims) > {MAX_DIMS} or math.prod(shape) >= 2**31 or any(step < 0 for _, step in dims):
        return None
    if sum((size - 1) * step for size, step in dims) >= 2**31:
        return None
    inner, step = dims[-1]
    vec = 4 if step == 1 and inner % 4 == 0 and all(s % 4 == 0 for _, s in dims[:-1]) else 1
    if vec > 1:
        dims[-1] = (inner // vec, vec)  # vector j of the innermost dim starts at its element 4 j
    nd = len(dims)
    dims += [(1, 0)] * ({MAX_DIMS} - nd)
    divs = [_divider(size) for size, _ in dims]
    consts = (numpy.int32(nd), *(numpy.uint32(size) for size, _ in dims), *(numpy.uint32(m) for m, _ in divs),
              *(numpy.uint32(s) for _, s in divs), *(numpy.uint32(step) for _, step in dims))
    return vec, consts


def _contig(t):
    """t as a contiguous tensor; an fp32 strided view by the fast gather where it fits (templates/gather.py)."""
    if t.is_contiguous() or t.dtype != torch.float32 or t.numel() == 0:
        return _contig_any(t)
    key = (tuple(t.shape), tuple(t.stride()))
    if key not in _GATHER_PLANS:
        if len(_GATHER_PLANS) >= 4096:  # shapes that never repeat: start again rather than grow
            _GATHER_PLANS.clear()
        _GATHER_PLANS[key] = _gather_plan(*key)
    plan = _GATHER_PLANS[key]
    if plan is None or (plan[0] > 1 and t.data_ptr() % 16):
        return _contig_any(t)
    vec, consts = plan
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    n = t.numel() // vec
    grid = (max(1, min(-(-n // 256), MAX_GRID_Y * 32)),)
    args = (t, out, numpy.uint32(n), *consts)
    if vec > 1:
        kernels.kp_gather_fast_f32x4(grid, (256,), args)  # noqa: F821
    else:
        kernels.kp_gather_fast_f32(grid, (256,), args)  # noqa: F821
    return out
'''
