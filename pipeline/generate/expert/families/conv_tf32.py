"""fp32 convolutions (conv1d/2d/3d and their transposes; groups 1) on the tensor cores at fp32 accuracy: an
implicit GEMM on our 3xTF32 WGMMA kernel (templates/conv_tf32.py), with the elementwise region after it (the
conv's own bias among it) fused on its stores. Left to cuDNN, an fp32 convolution runs on the CUDA cores (about 38
TFLOP/s measured on the H200, docs/benchmarks.md). The plain plan keeps cuDNN, the tuned one takes our
kernel, a failing one goes back to cuDNN in a repair (gemm_kit.py: the same plans and edits as a GEMM).

The GEMM: rows are output pixels (batch and spatial dims), columns are output channels, K is the input
channels times the kernel's taps. The tile along the channels is sized to them (a multiple of 8, at most
128), so a 16-channel convolution does not compute 112 channels of zeros.

Where K is long (F16_MIN_K) the tuned plan takes the fp16x3 form (`f16`: templates/conv_f16x3.py): the
input scaled by a power of two an image and the weight one a row, each cut into fp16 hi and lo, three fp16
products at twice tf32's rate, as accurate as 3xTF32, its ring twice as deep in the same shared memory.
use_tensor_cores moves between the two forms, and the first batch times 3xTF32 beside it (the hedge).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert import ops
from pipeline.generate.expert.families import gemm_kit
from pipeline.generate.expert.families.base import change
from pipeline.generate.expert.families.gemm_kit import GemmPlan
from pipeline.generate.expert.graph import Ref
from pipeline.generate.expert.layout import Bcast
from pipeline.generate.expert.plan import Plan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates import conv_f16x3, conv_tf32
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.conv_tf32 import ConvEpilogue, ConvForm

# The tuned plan takes the fp16x3 form (templates/conv_f16x3.py) where K is at least this long, hedged by
# 3xTF32 in the first batch: the form's MMAs take half the time, its image pass (a read of the input) and
# cut are paid at any K. On the H100 (2026-12-07, docs/benchmarks.md), against 3xTF32 at the same tile:
# 1.20-1.24x faster at K of 1296 to 1440, 8% at 576, 2-3% at 363 and 384, level at 192.
F16_MIN_K = 512
CONV_OPS = {"conv1d": 1, "conv2d": 2, "conv3d": 3}
TRANSPOSED_OPS = {"conv_transpose1d": 1, "conv_transpose2d": 2, "conv_transpose3d": 3}


@dataclass(frozen=True)
class ConvPlan(GemmPlan):
    TAG: ClassVar[str] = "wgmma_conv_3xtf32"
    BK: ClassVar[int] = conv_tf32.BK

    # three fp16 products of operands scaled by powers of two (an image of the input, a row of the weight)
    # in place of three tf32 ones (templates/conv_f16x3.py): twice the MMA rate at the same accuracy
    f16: bool = False

    def describe(self) -> str:
        return super().describe() + (" fp16x3" if self.f16 else "")


def _triple(v: object, dims: int, default: int) -> tuple[int, ...] | None:
    """A stride / padding / dilation argument as (depth, height, width): 1-D and 2-D convolutions are 3-D ones
    with unit extents in front."""
    if v is None:
        v = default
    if isinstance(v, int) and not isinstance(v, bool):
        t = (v,) * dims
    elif isinstance(v, list | tuple) and len(v) in (1, dims) and all(isinstance(x, int) for x in v):
        t = tuple(v) * (dims // len(v))
    else:
        return None
    return (1 if default == 1 else 0,) * (3 - dims) + t


def parse(
    r: Region, low: Lowered, dtypes: tuple[str, ...] = ("float32",), what: str = "fp32"
) -> ConvForm | str:
    """A library region's convolution geometry (any groups), or why it is not one we can read."""
    n = r.node
    transposed = n.op in TRANSPOSED_OPS
    dims = TRANSPOSED_OPS.get(n.op) or CONV_OPS.get(n.op)
    if r.kind is not RegionKind.LIBRARY or dims is None:
        return "only convolutions (conv1d/2d/3d, transposed or not) have a template"
    if n.overload not in ("default", "input"):  # aten.conv2d.padding takes padding='same' / 'valid'
        return f"padding given as {n.overload!r} has no template yet"
    if n.dtype not in dtypes:
        return f"the template takes {what} operands, not {n.dtype}"
    a = list(n.args) + [None] * (8 - len(n.args))
    x, w = (low.by_name.get(v.name) if isinstance(v, Ref) else None for v in a[:2])
    if x is None or w is None or not x.shape or not w.shape or not n.shape:
        return "the operands' shapes are unknown"
    if x.dtype != n.dtype or w.dtype != n.dtype:
        return "mixed operand dtypes"
    # conv: (x, w, bias, stride, padding, dilation, groups); transposed: (..., padding, output_padding,
    # groups, dilation), its weight (C_in, C_out / groups, *kernel)
    groups = a[6] if a[6] is not None else n.kw("groups", 1)
    if not isinstance(groups, int) or groups < 1:
        return f"groups = {groups!r} is not a positive int"
    cin, cout = (w.shape[0], w.shape[1] * groups) if transposed else (w.shape[1] * groups, w.shape[0])
    if len(x.shape) != dims + 2 or len(w.shape) != dims + 2 or x.shape[1] != cin:
        return "the input is not (N, C, *spatial) with the weight's channels"
    dil_arg, out_pad_arg = (a[7], a[5]) if transposed else (a[5], None)
    stride, pad, dil, out_pad = (
        _triple(v, dims, d) for v, d in ((a[3], 1), (a[4], 0), (dil_arg, 1), (out_pad_arg, 0))
    )
    if stride is None or pad is None or dil is None or out_pad is None:
        return "stride, padding, dilation or output padding is not a list of ints"
    one3 = (1,) * (3 - dims)
    f = ConvForm(
        dims=dims,
        cin=cin,
        cout=cout,
        size=one3 + tuple(x.shape[2:]),
        kernel=one3 + tuple(w.shape[2:]),
        stride=stride,
        pad=pad,
        dil=dil,
        out=one3 + tuple(n.shape[2:]),
        transposed=transposed,
        out_pad=out_pad,
        groups=groups,
    )
    if any(o <= 0 for o in f.out) or math.prod(n.shape) == 0:
        return "an empty output"
    if n.shape[1] != f.cout or tuple(f.out) != tuple(conv_tf32.out_size(f)):
        return "the output shape does not follow from the geometry"
    return f


def form(r: Region, low: Lowered) -> ConvForm | str:
    """The convolution's geometry when our implicit-GEMM kernel can compute this library region, else why not."""
    f = parse(r, low)
    if isinstance(f, str):
        return f
    if f.groups != 1:
        return f"groups = {f.groups}: grouped and depthwise convolutions have no implicit-GEMM template yet"
    return f


def _gemm_form(r: Region, low: Lowered) -> ConvForm | str:
    """form(), less the strided transposed convolutions with few products an output (the template computes
    them, but it scatters each phase's tile over the output, the tensor cores idle) and the narrow ones:
    the direct kernel's."""
    f = form(r, low)
    if not isinstance(f, str) and f.sparse:
        return "a strided transposed convolution with few products an output is the direct kernel's"
    if not isinstance(f, str) and f.narrow:
        return "a convolution with few output channels or products an output is the direct kernel's"
    return f


def _operand(name: str, low: Lowered, out_shape: tuple[int, ...]) -> tuple[str, Bcast] | None:
    """(the value the launcher passes, how it broadcasts over the output) for one epilogue operand: per
    channel (COL: the GEMM's columns are the channels), one scalar, or the output's own shape."""
    node = low.by_name[name]
    value = name
    src = node.args[0] if node.op in ("reshape", "view") and node.args else None
    if isinstance(src, Ref) and low.region_of(src.name) is None:
        value = src.name  # a reshaped parameter (the conv's bias as (C, 1, 1)): the same memory, in order
    shape = node.shape or ()
    nd = len(out_shape)
    if len(shape) > nd:
        return None
    dims = (1,) * (nd - len(shape)) + tuple(shape)
    if all(d == 1 for d in dims):
        return value, Bcast.SCALAR
    if dims[1] == out_shape[1] and all(d == 1 for i, d in enumerate(dims) if i != 1):
        return value, Bcast.COL
    if dims == tuple(out_shape):
        return name, Bcast.FULL
    return None


def epilogue(host: Region, low: Lowered) -> ConvEpilogue | None:
    """The ew region that consumes the convolution's output only, with operands the stores can index."""
    e = gemm_kit.consumer(host, low)
    if e is None or ops.positional(
        e.nodes
    ):  # its stores index (n, c, spatial), not a matrix's row and column
        return None
    out = host.outputs[0]
    operands = []
    for i in e.inputs:
        if i == out:
            continue
        got = _operand(i, low, e.shape)
        if got is None:
            return None
        value, cls = got
        if not gemm_kit.ready_before(value, host, low):
            return None  # computed after the convolution: not ready when its stores run
        operands.append((i, value, low.by_name[i].dtype or "float32", cls))
    out_dt = next(n.dtype for n in e.nodes if n.name == e.outputs[0]) or "float32"
    if out_dt not in ("float32", "float16", "bfloat16"):
        return None
    return ConvEpilogue(e, out, tuple(operands), e.outputs[0], out_dt)


def _render(r: Region, f: ConvForm, rp: ConvPlan, epi: ConvEpilogue | None, hunter: Any = None,
            sinkable: bool = False) -> Code:  # fmt: skip
    template = conv_f16x3 if rp.f16 else conv_tf32
    return template.render(r, f, rp, epi, hunter, sinkable=sinkable)


def _ring(rp: ConvPlan, f: ConvForm) -> int:
    """The deepest ring that fits: an fp16x3 stage is half a 3xTF32 one's bytes."""
    return conv_f16x3.max_stages(rp.bn) if rp.f16 else conv_tf32.max_stages(rp.bn)


SPEC = gemm_kit.Spec(
    knobs=ConvPlan,
    dtypes=("float32",),
    what="fp32",
    align=4,
    tiles=lambda f: conv_tf32.tiles(f.cout),
    max_stages=lambda bn, f: conv_tf32.max_stages(bn),
    plan_stages=_ring,
    render=_render,
    kernel="implicit-GEMM convolution (3xTF32, or three fp16 products where K is long: fp32 accuracy on the tensor cores)",
    order=22,
    form_of=_gemm_form,
    epilogue_of=epilogue,
    library="cuDNN",
    grid_tiles=lambda r, low, f, bn: conv_tf32.grid_tiles(r.node.shape[0], f, bn),
    narrow_pays=lambda wide, narrow: conv_tf32.gatherers(narrow) > conv_tf32.gatherers(wide),
    plain_widest=True,
    sinks=True,
)


def _f16_edit(plan: Plan, rp: ConvPlan | None, r: Region, low: Lowered) -> Any:
    """use_tensor_cores on our kernel: its three products in fp16, the deepest ring that fits; or back to
    tf32's, the ring cut to what fits."""
    if rp is None:
        return
    f16 = not rp.f16
    top = conv_f16x3.max_stages(rp.bn) if f16 else min(rp.stages, conv_tf32.max_stages(rp.bn))
    yield from change("use_tensor_cores", plan, rp, f16=f16, stages=top)


def _family() -> Any:
    base = gemm_kit.family(SPEC)

    def settle(plan: Plan, r: Region, low: Lowered, tuned: bool) -> Plan:
        plan = base.settle(plan, r, low, tuned)
        rp = plan.get(r.rid)
        if not tuned or not isinstance(rp, ConvPlan):
            return plan
        f = form(r, low)
        if not isinstance(f, str) and conv_tf32.gemm_k(f) >= F16_MIN_K:
            plan = plan.replace(dataclasses.replace(rp, f16=True, stages=conv_f16x3.max_stages(rp.bn)))
        return plan

    take = base.edits["use_tensor_cores"]

    def tensor_cores(plan: Plan, rp: Any, r: Region, low: Lowered) -> Any:
        yield from take(plan, rp, r, low)
        yield from _f16_edit(plan, rp, r, low)

    def hedges(rp: Any) -> tuple[str, ...]:  # the first batch times 3xTF32 beside the fp16x3 form
        return ("use_tensor_cores",) if isinstance(rp, ConvPlan) and rp.f16 else ()

    edits = {**base.edits, "use_tensor_cores": tensor_cores}
    return dataclasses.replace(base, edits=edits, settle=settle, hedges=hedges)


FAMILY = _family()

__all__ = ["FAMILY", "SPEC", "ConvPlan", "epilogue", "form"]
