"""Resampling (templates/resample.py), where it was left to PyTorch: F.interpolate and nn.Upsample in nearest,
nearest-exact, linear, bilinear, trilinear and bicubic modes, adaptive average pooling to sizes that do not
divide the input's (the others are lowered to a mean or an average pool) and adaptive max pooling (values
and indices), 1-D to 3-D, fp32, fp16 and bf16, on the CUDA cores. Antialiased modes stay PyTorch's. Both
plans take our kernel (no library anchor to keep); the tuned one computes the most consecutive outputs a
thread that one 16-byte store holds and the last dim splits into (`vec`). Edits: resize_grid (threads x2
and /2), vectorize_loads (the plain plan's one output a thread to the tuned plan's group).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert.families import common
from pipeline.generate.expert.families.base import Family, RenderError, change
from pipeline.generate.expert.graph import Node, Ref
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import resample
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.resample import Resample

# op -> (mode, spatial dims)
OPS = {
    **{f"upsample_nearest{d}d": ("nearest", d) for d in (1, 2, 3)},
    **{f"_upsample_nearest_exact{d}d": ("nearest-exact", d) for d in (1, 2, 3)},
    "upsample_linear1d": ("linear", 1),
    "upsample_bilinear2d": ("linear", 2),
    "upsample_trilinear3d": ("linear", 3),
    "upsample_bicubic2d": ("cubic", 2),
    **{f"adaptive_avg_pool{d}d": ("adaptive_avg", d) for d in (1, 2, 3)},
    **{f"_adaptive_avg_pool{d}d": ("adaptive_avg", d) for d in (1, 2, 3)},
    **{f"adaptive_max_pool{d}d": ("adaptive_max", d) for d in (1, 2, 3)},
}
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ResamplePlan(RegionPlan):
    TAG: ClassVar[str] = "resample"
    SHOWN: ClassVar[tuple[str, ...]] = ("threads", "vec")

    threads: int = 256
    vec: int = 1  # consecutive outputs along the last dim a thread computes and stores as one access


def form(n: Node, low: Lowered) -> Resample | str:
    """The interpolation our kernel computes for this node, else why not."""
    if n.op not in OPS:
        return "not an interpolation our kernel computes"
    mode, dims = OPS[n.op]
    a = n.args
    x = low.by_name.get(a[0].name) if a and isinstance(a[0], Ref) else None
    if x is None or not x.shape or len(x.shape) < dims + 1:
        return "the input's shape is unknown or not (N, C, spatial...)"
    if x.dtype not in DTYPES or (n.dtype or x.dtype) != x.dtype:  # a max pool's (values, indices): no dtype
        return f"a {x.dtype} interpolation"
    if mode in resample.POOLS:  # the output size is the node's own (a max pool's: its values')
        shape = n.shape
        if mode == "adaptive_max":
            shape = next((low.by_name[u].shape for u in low.users.get(n.name, ())), None)  # a getitem's
            if shape is None:
                return "the pooled values are not used"
        return _sized(mode, dims, x.shape, shape, False, (None,) * dims)
    linear = mode in ("linear", "cubic")  # both take align_corners
    align = bool(a[2]) if linear and len(a) > 2 else False
    given = a[3 if linear else 2] if len(a) > (3 if linear else 2) else None
    if n.overload == "vec":
        scales = tuple(given) if isinstance(given, tuple | list) else (None,) * dims
    else:  # .default: the per-dim scales follow the output size (and align_corners)
        scales = tuple(
            a[(3 if linear else 2) + d] if len(a) > (3 if linear else 2) + d else None for d in range(dims)
        )
    if len(scales) != dims or not all(s is None or isinstance(s, int | float) for s in scales):
        return "the scale factors are not constants"
    return _sized(mode, dims, x.shape, n.shape, align, tuple(None if s is None else float(s) for s in scales))


why_not, claims, declines = common.torch_region_rules(form, OPS)


def _sized(
    mode: str, dims: int, shape: tuple, out_shape: tuple, align: bool, scales: tuple
) -> Resample | str:
    size, out = tuple(shape[-dims:]), tuple(out_shape[-dims:])
    if shape[:-dims] != out_shape[:-dims] or min(size) < 1 or min(out) < 1:
        return "an empty resampling, or one that changes the leading dims"
    return Resample(mode, align, size, out, scales)


def _widest(r: Region, low: Lowered) -> int:
    """The most outputs one 16-byte store holds that the region's last output dim splits into."""
    f = form(r.node, low)
    if isinstance(f, str):
        return 1
    dtype = low.by_name[r.node.args[0].name].dtype or "float32"
    vec = common.vec_max(2 if dtype in ("float16", "bfloat16") else 4)
    while vec > 1 and not resample.vec_ok(f, vec):
        vec //= 2
    return vec


def first(r: Region, low: Lowered, tuned: bool) -> ResamplePlan:
    return ResamplePlan(r.rid, vec=_widest(r, low) if tuned else 1)


def vectorize(plan: Plan, rp: ResamplePlan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    vec = _widest(r, low)
    if rp.vec < vec:
        yield from change("vectorize_loads", plan, rp, vec=vec)


def render(r: Region, rp: ResamplePlan, low: Lowered, hunter: Any) -> Code:
    f = form(r.node, low)
    if isinstance(f, str):
        raise RenderError(f"region {r.rid} cannot be our interpolation: {f}")
    return resample.render(r, f, low.by_name[r.node.args[0].name].dtype or "float32", rp.threads, rp.vec)


FAMILY = Family(
    knobs=ResamplePlan,
    claims=claims,
    first=first,
    render=render,
    declines=declines,
    edits={"resize_grid": common.resize_grid, "vectorize_loads": vectorize},
    order=15,
)
