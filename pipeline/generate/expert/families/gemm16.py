"""16-bit GEMMs (linear layers, matmul, mm, addmm, bmm) on our own Hopper kernel: TMA loads into a ring of
shared-memory stages, WGMMA on two consumer warpgroups, the elementwise region after it fused on its
stores (templates/gemm.py). The plain plan leaves a GEMM to cuBLAS unless nothing else is ours; the
tuned plan takes it, and a failing one goes back to cuBLAS in a repair.

Edits: use_wgmma / use_tensor_cores / use_tma (from cuBLAS into our kernel), fuse_epilogue (the
elementwise region after it, on its stores), more_parallelism / reduce_registers / resize_grid (128 x 128
tiles: twice the blocks, half the accumulators), coarsen_threads / tile_shared_memory (128 x 256 tiles:
more reuse of each A tile), pipeline_loads (one more stage in the TMA ring, as many as fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert import atoms
from pipeline.generate.expert.families.base import Edit, Family, RenderError, change, changed, label
from pipeline.generate.expert.layout import Bcast, operand_class
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates import gemm
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.gemm import Form, GemmEpilogue

_OPS = ("gemm_linear", "gemm_mm", "gemm_bmm", "gemm_matmul")


@dataclass(frozen=True)
class GemmPlan(RegionPlan):
    TAG: ClassVar[str] = "wgmma"
    ABSORBS: ClassVar[tuple[str, ...]] = ("epilogue",)

    bn: int = 0  # tile width along N (the tile is 128 x bn x 64)
    stages: int = 0  # shared-memory stages in the TMA ring
    epilogue: str = ""  # rid of the ew region computed on the accumulators before the one store

    def describe(self) -> str:
        tail = f" epilogue={self.epilogue}" if self.epilogue else ""
        return f"wgmma tile=128x{self.bn}x64 stages={self.stages} (TMA, 2 consumer warpgroups){tail}"


def form(r: Region, low: Lowered) -> Form | str:
    """The operands' form when our WGMMA kernel can compute this library region, else why not."""
    n = r.node
    if r.kind is not RegionKind.LIBRARY or n.op not in _OPS:
        return "only matmul, mm, bmm and linear layers have a WGMMA template"
    if n.dtype not in gemm.CUTE_TYPES:
        return f"WGMMA templates take bf16 or fp16 operands, not {n.dtype}"
    a, b = (low.by_name.get(getattr(v, "name", "")) for v in n.args[:2])
    if a is None or b is None or not a.shape or not b.shape:
        return "the operands' shapes are unknown"
    if a.dtype != n.dtype or b.dtype != n.dtype:
        return "mixed operand dtypes"
    if n.op == "gemm_linear":
        f, k, cols = Form("K", False), b.shape[-1], b.shape[0]
        if len(b.shape) != 2 or a.shape[-1] != k:
            return "the weight is not (N, K)"
    else:
        if len(a.shape) < 2 or len(b.shape) < 2:
            return "a matrix-vector product has no WGMMA template"
        k, cols = b.shape[-2], b.shape[-1]
        if len(b.shape) == 2 and n.op != "gemm_bmm":
            f = Form("MN", False)
        elif len(a.shape) == len(b.shape) and a.shape[:-2] == b.shape[:-2]:
            f = Form("MN", True)
        else:
            return f"broadcast batch dims ({a.shape} @ {b.shape}) have no WGMMA template"
        if a.shape[-1] != k:
            return "the operands' inner dims differ"
        if cols % 8:
            return f"N = {cols} is not a multiple of 8 (TMA needs 16-byte rows of B)"
    if k % 8 or not k:
        return f"K = {k} is not a positive multiple of 8 (TMA needs 16-byte rows)"
    return f


def eligible(r: Region, low: Lowered) -> str:
    """ "" when our WGMMA kernel can compute this library region, else why not."""
    f = form(r, low)
    return f if isinstance(f, str) else ""


def claims(r: Region, low: Lowered) -> bool:
    return isinstance(form(r, low), Form)


def epilogue(host: Region, low: Lowered) -> GemmEpilogue | None:
    """The ew region that consumes the GEMM's output only, with operands the epilogue can index."""
    if host.kind is not RegionKind.LIBRARY or len(host.outputs) != 1:
        return None
    out = host.outputs[0]
    users = low.users.get(out, ())
    if not users or out in low.graph.output_names():
        return None
    e = low.region_of(users[0])
    if e is None or e.kind is not RegionKind.EW or len(e.outputs) != 1:  # in place or not: we write afresh
        return None
    if any(low.region_of(u) is not e for u in users) or low.by_name[out].shape != e.shape:
        return None
    position = {r.rid: i for i, r in enumerate(low.regions)}
    split = len(e.shape) - 1
    operands = []
    for i in e.inputs:
        if i == out:
            continue
        src = low.region_of(i)
        if src is not None and position[src.rid] >= position[host.rid]:
            return None  # computed after the GEMM: not ready when the epilogue runs
        node = low.by_name[i]
        cls = operand_class(node.shape or (), e.shape, split)
        if cls is Bcast.DENSE:
            return None
        operands.append((i, node.dtype or "float32", cls))
    out_dt = next(n.dtype for n in e.nodes if n.name == e.outputs[0]) or "float32"
    if out_dt not in ("float32", "float16", "bfloat16"):
        return None
    return GemmEpilogue(e, out, tuple(operands), e.outputs[0], out_dt)


def with_defaults(rp: GemmPlan) -> GemmPlan:
    """A plan entry with its tile and stages filled in (the largest ring that fits)."""
    bn = rp.bn or gemm.TILE_N[-1]
    return GemmPlan(rp.rid, bn, min(rp.stages or gemm.max_stages(bn), gemm.max_stages(bn)), rp.epilogue)


def first(r: Region, low: Lowered, tuned: bool) -> None:
    return None  # cuBLAS until settle (or an edit) takes it


def render(r: Region, rp: GemmPlan, low: Lowered, hunter: Any) -> Code:
    f = form(r, low)
    if not isinstance(f, Form):
        raise RenderError(f"region {r.rid} cannot be our GEMM: {f}")
    epi = epilogue(r, low) if rp.epilogue else None
    if rp.epilogue and (epi is None or epi.region.rid != rp.epilogue):
        raise RenderError(f"region {r.rid}: the plan's fusion no longer applies")
    if not 2 <= rp.stages <= gemm.max_stages(rp.bn) or rp.bn not in gemm.TILE_N:
        raise RenderError(f"region {r.rid}: tile 128x{rp.bn} with {rp.stages} stages does not fit")
    try:
        return gemm.render(r, f, rp, epi, hunter)
    except atoms.AtomNotFound as e:
        raise RenderError(str(e)) from None


def _take(edit: str) -> Edit:
    """From cuBLAS into our kernel (use_wgmma, use_tensor_cores, use_tma)."""

    def apply(plan: Plan, rp: GemmPlan | None, r: Region, low: Lowered) -> Any:
        if rp is None:
            rp = with_defaults(GemmPlan(r.rid))
            yield label(edit, r.rid, bn=rp.bn, stages=rp.stages), plan.add(rp)

    return apply


def _epilogue(plan: Plan, rp: GemmPlan | None, r: Region, low: Lowered) -> Any:
    epi = epilogue(r, low)
    if rp is None or rp.epilogue or epi is None:
        return
    rid = epi.region.rid
    if rid not in plan.fused() and plan.get(rid) is not None:
        yield label("fuse_epilogue", r.rid, epilogue=rid), changed(plan, rp, epilogue=rid)


def _tile(edit: str, bn: int) -> Edit:
    def apply(plan: Plan, rp: GemmPlan | None, r: Region, low: Lowered) -> Any:
        if rp is not None and rp.bn != bn:
            stages = min(rp.stages, gemm.max_stages(bn)) if rp.bn > bn else gemm.max_stages(bn)
            yield from change(edit, plan, rp, bn=bn, stages=stages)

    return apply


def _stages(plan: Plan, rp: GemmPlan | None, r: Region, low: Lowered) -> Any:
    if rp is not None and rp.stages < gemm.max_stages(rp.bn):
        yield from change("pipeline_loads", plan, rp, stages=rp.stages + 1)
    elif rp is not None and rp.stages > 3:  # at the limit: a shorter ring is the only other way to go
        yield from change("pipeline_loads", plan, rp, stages=rp.stages - 1)


def settle(plan: Plan, r: Region, low: Lowered, tuned: bool) -> Plan:
    """Tuned: our kernel with everything after it fused on its stores. Plain: cuBLAS, unless no other
    region is ours (then our kernel with 128 x 128 tiles, nothing fused)."""
    if tuned:
        for _, p in _take("use_wgmma")(plan, plan.get(r.rid), r, low):
            plan = p
        for _, p in _epilogue(plan, plan.get(r.rid), r, low):
            plan = p
    elif all(isinstance(rp, GemmPlan) for rp in plan.regions):
        for _, p in _take("use_wgmma")(plan, plan.get(r.rid), r, low):
            plan = changed(p, p.get(r.rid), bn=128, stages=4)
    return plan


def note(regions: list[Region], low: Lowered) -> str:
    targets = ", ".join(r.node.target for r in regions)
    return f"our WGMMA kernel (TMA, tensor cores) for {targets} in the tuned plans, cuBLAS in the plain one (hybrid)"


def _hopper(arch: str) -> bool:
    return arch.startswith("sm_90")  # WGMMA and TMA


FAMILY = Family(
    knobs=GemmPlan,
    claims=claims,
    first=first,
    render=render,
    edits={
        "use_wgmma": _take("use_wgmma"),
        "use_tensor_cores": _take("use_tensor_cores"),
        "use_tma": _take("use_tma"),
        "fuse_epilogue": _epilogue,
        "more_parallelism": _tile("more_parallelism", 128),
        "reduce_registers": _tile("reduce_registers", 128),
        "resize_grid": _tile("resize_grid", 128),
        "coarsen_threads": _tile("coarsen_threads", 256),
        "tile_shared_memory": _tile("tile_shared_memory", 256),
        "pipeline_loads": _stages,
    },
    order=20,
    settle=settle,
    plainest=lambda rp: None,
    note=note,
    cute=True,
    runs_on=_hopper,
    optional=True,
)
