"""What every GEMM family on our Hopper kernels shares: which library regions a template can take and how
their operands lie, the elementwise epilogue it fuses, its plan knobs (tile width, ring stages, the fused
region) and its edits. A GEMM family (gemm16.py, gemm_tf32.py) is a Spec: its operand dtypes, its
template, its tiles and ring depths; `family(spec)` makes the Family the registry finds. An implicit GEMM
(conv_tf32.py) is a Spec too, with its own form and epilogue functions.

Edits: use_wgmma / use_tensor_cores / use_tma (from cuBLAS into our kernel), fuse_epilogue (the
elementwise region after it, on its stores), more_parallelism / reduce_registers / resize_grid (the next
narrower tile: more blocks, fewer accumulators), coarsen_threads / tile_shared_memory (the next wider: more
reuse of each A tile), pipeline_loads (one more stage in the TMA ring, as many as fit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert import atoms, ops
from pipeline.generate.expert.families import common
from pipeline.generate.expert.families.base import Edit, Family, RenderError, change, changed, label
from pipeline.generate.expert.layout import Bcast, operand_class
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.gemm import Form, GemmEpilogue

OPS = ("gemm_linear", "gemm_mm", "gemm_bmm", "gemm_matmul")


@dataclass(frozen=True)
class GemmPlan(RegionPlan):
    TAG: ClassVar[str] = "wgmma"
    ABSORBS: ClassVar[tuple[str, ...]] = ("epilogue",)
    BK: ClassVar[int] = 64  # the template's k-tile, for describe

    bn: int = 0  # tile width along N (the tile is 128 x bn x BK)
    stages: int = 0  # shared-memory stages in the TMA ring
    epilogue: str = ""  # rid of the ew region computed on the accumulators before the one store

    def describe(self) -> str:
        tail = f" epilogue={self.epilogue}" if self.epilogue else ""
        return (
            f"{self.TAG} tile=128x{self.bn}x{self.BK} stages={self.stages} (TMA, 2 consumer warpgroups){tail}"
        )


@dataclass(frozen=True)
class Spec:
    """One GEMM family: what it takes, and its template's limits."""

    knobs: type[GemmPlan]
    dtypes: tuple[str, ...]  # operand dtypes its template takes
    what: str  # the dtypes in words, for the reason a region is not taken
    align: int  # elements per 16 bytes: TMA's row rule for K (and N of a row-major B)
    tiles: Callable[[Any], tuple[int, ...]]  # tile widths along N that fit (for a form), narrowest first
    max_stages: Callable[[int, Any], int]  # the deepest ring that fits a tile width
    render: Callable[[Region, Any, Any, Any, Any], Code]  # the template: region, form, plan, epilogue, hunter
    kernel: str  # how notes name the kernel
    order: int = 20
    # Another anchor than a GEMM (a convolution): its operand form (or why not) and its fusable epilogue;
    # form_of also for a GEMM family that leaves some GEMMs to another (3xTF32: few rows to gemm_skinny).
    form_of: Callable[[Region, Lowered], Any] | None = None
    epilogue_of: Callable[[Region, Lowered], Any] | None = None
    library: str = "cuBLAS"  # what computes the region in the plain plan
    # The grid's tiles for a region, its form and a tile width, where a narrower tile waits for a grid too
    # small to fill the GPU (FEW_TILES); None: narrower tiles are always offered.
    grid_tiles: Callable[[Region, Lowered, Any, int], int] | None = None
    # (wide, narrow): whether reduce_registers' narrower tile pays on a grid of many tiles too (a convolution:
    # when it brings a second gathering warpgroup); None: it does not, where grid_tiles counts the tiles.
    narrow_pays: Callable[[int, int], bool] | None = None
    # The plain plan of a task whose regions are all ours takes the narrowest tile, or the widest where the
    # narrow ones are only for grids of few tiles (3xTF32: 128 x 32 and 64 beside 128 x 128; convolutions:
    # the narrow plain kernel ran 1.2-1.8x slower than the tuned one on every level-1 convolution).
    plain_widest: bool = False
    # The template writes its one output into a cat's slice when handed one (render(..., sinkable=True):
    # out= at a batch stride, render.py's sinking).
    sinks: bool = False
    # The deepest ring that fits a plan, where its other knobs change a stage's bytes (the fp16x3
    # convolution's halves); max_stages of its tile width by default.
    plan_stages: Callable[[Any, Any], int] | None = None


# Tiles from which a narrower tile buys no parallelism: four waves on a 132-SM H200, whose last wave's tail
# is then under a quarter of the time. Every implicit-GEMM convolution of KernelBench level 2 measured so
# far (2, 3, 4, 5, 7, 16, 19, 20: thousands of tiles each) and three level-1 shapes ran slower with half the
# channel tile, 4-46% (docs/benchmarks.md): each gathered A tile then feeds half the MMAs. In the benches'
# logs to 2026-12-06, a narrower tile on such grids lost 36 of 38 times on convolutions (the two wins: 128
# channels to 64, which adds a gathering warpgroup) and 30 of 30 on level 1's 3xTF32 GEMMs.
FEW_TILES = 4 * common.SMS


def form(r: Region, low: Lowered, spec: Spec) -> Form | str:
    """The operands' form when the family's template can compute this library region, else why not."""
    n = r.node
    if r.kind is not RegionKind.LIBRARY or n.op not in OPS:
        return "only matmul, mm, bmm and linear layers have a WGMMA template"
    if n.dtype not in spec.dtypes:
        return f"this WGMMA template takes {spec.what} operands, not {n.dtype}"
    a, b = (low.by_name.get(getattr(v, "name", "")) for v in n.args[:2])
    if a is None or b is None or not a.shape or not b.shape:
        return "the operands' shapes are unknown"
    if a.dtype != n.dtype or b.dtype != n.dtype:
        return "mixed operand dtypes"
    q = spec.align
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
    if not k:
        return "K = 0: nothing to multiply"
    # TMA reads rows 16 bytes apart: other widths are copied into wider rows first (its zero fill past the
    # width covers the tail), one pass over the operand, a few percent of the product's time
    pad = bool(k % q or (f.b_major == "MN" and cols % q))
    f = dataclasses.replace(f, pad_rows=pad)
    if not spec.tiles(f):
        return "no tile of this template fits shared memory for this operand form"
    return f


def consumer(host: Region, low: Lowered) -> Region | None:
    """The ew region that alone reads a library region's one output (its epilogue, when its operands allow)."""
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
    return e


def ready_before(value: str, host: Region, low: Lowered) -> bool:
    """Whether a value is computed before the host region runs (an input, or an earlier region's output)."""
    src = low.region_of(value)
    position = {r.rid: i for i, r in enumerate(low.regions)}
    return src is None or position[src.rid] < position[host.rid]


def epilogue(host: Region, low: Lowered) -> GemmEpilogue | None:
    """The ew region that consumes the GEMM's output only, with operands the epilogue can index."""
    e = consumer(host, low)
    if e is None or (ops.positional(e.nodes) and not _per_matrix(host, low)):
        return None
    out = host.outputs[0]
    return epilogue_on(e, host, low, out)


def epilogue_on(e: Region, host: Region, low: Lowered, main: str, up: str = "") -> GemmEpilogue | None:
    """The GemmEpilogue of ew region e reading the GEMM's accumulators as `main` (and `up`, gated), when
    its other operands are ready before the GEMM and indexable by row, column or element."""
    split = len(e.shape) - 1
    operands = []
    for i in e.inputs:
        if i in (main, up):
            continue
        if not ready_before(i, host, low):
            return None  # computed after the GEMM: not ready when the epilogue runs
        node = low.by_name[i]
        cls = operand_class(node.shape or (), e.shape, split)
        if cls is Bcast.DENSE:
            return None
        operands.append((i, node.dtype or "float32", cls))
    out_dt = next(n.dtype for n in e.nodes if n.name == e.outputs[0]) or "float32"
    if out_dt not in ("float32", "float16", "bfloat16"):
        return None
    return GemmEpilogue(e, main, tuple(operands), e.outputs[0], out_dt, up)


def _per_matrix(host: Region, low: Lowered) -> bool:
    """Whether the kernel's rows are each matrix's rows (A is 2-D, or batched like B), so that a positional
    epilogue's row is the kernel's m; leading dims folded into rows would need m modulo the matrix's rows."""
    n = host.node
    a, b = (low.by_name[v.name].shape or () for v in n.args[:2])
    return len(a) == 2 or (n.op != "gemm_linear" and len(a) == len(b))


def planned_epilogue(rp: Any, r: Region, low: Lowered, epilogue_of: Callable[[Region, Lowered], Any]) -> Any:
    """The epilogue a library region's entry fused (None where it fused none); RenderError where the graph no
    longer offers that fusion."""
    epi = epilogue_of(r, low) if rp.epilogue else None
    if rp.epilogue and (epi is None or epi.region.rid != rp.epilogue):
        raise RenderError(f"region {r.rid}: the plan's fusion no longer applies")
    return epi


def fuse_edit(epilogue_of: Callable[[Region, Lowered], Any]) -> Edit:
    """fuse_epilogue for a library region's entry with an `epilogue` knob: the ew region after it (which
    `epilogue_of` finds, or None) computed on its stores, once that region has an entry of its own."""

    def fuse(plan: Plan, rp: Any, r: Region, low: Lowered) -> Any:
        epi = epilogue_of(r, low)
        if rp is None or rp.epilogue or epi is None:
            return
        rid = epi.region.rid
        if rid not in plan.fused() and plan.get(rid) is not None:
            yield label("fuse_epilogue", r.rid, epilogue=rid), changed(plan, rp, epilogue=rid)

    return fuse


def family(spec: Spec) -> Family:
    """The Family of a GEMM spec: cuBLAS in the plain plan, our kernel with its epilogue in the tuned one."""

    def form_or_why(r: Region, low: Lowered) -> Any:
        return spec.form_of(r, low) if spec.form_of else form(r, low, spec)

    def epilogue_any(r: Region, low: Lowered) -> Any:
        return spec.epilogue_of(r, low) if spec.epilogue_of else epilogue(r, low)

    def form_of(r: Region, low: Lowered) -> Any:
        f = form_or_why(r, low)
        if isinstance(f, str):
            raise RenderError(f"region {r.rid} cannot be our {spec.kernel}: {f}")
        return f

    def with_defaults(rp: GemmPlan, f: Any) -> GemmPlan:
        """A plan entry with its tile and stages filled in (the widest tile, the largest ring that fits)."""
        bn = rp.bn or spec.tiles(f)[-1]
        top = spec.max_stages(bn, f)
        return spec.knobs(rp.rid, bn, min(rp.stages or top, top), rp.epilogue)

    def ring(rp: GemmPlan, f: Any) -> int:
        """The deepest ring that fits the plan."""
        return spec.plan_stages(rp, f) if spec.plan_stages else spec.max_stages(rp.bn, f)

    def claims(r: Region, low: Lowered) -> bool:
        return not isinstance(form_or_why(r, low), str)

    def first(r: Region, low: Lowered, tuned: bool) -> None:
        return None  # the library until settle (or an edit) takes it

    def render(r: Region, rp: GemmPlan, low: Lowered, hunter: Any) -> Code:
        f = form_of(r, low)
        epi = planned_epilogue(rp, r, low, epilogue_any)
        if rp.bn not in spec.tiles(f) or not 2 <= rp.stages <= ring(rp, f):
            raise RenderError(f"region {r.rid}: tile 128x{rp.bn} with {rp.stages} stages does not fit")
        try:
            if spec.sinks:  # a convolution: whole images a slice (a join along the batch or channels)
                sinkable = common.output_feeds_copy(r, epi, low, max_dim=1)
                return spec.render(r, f, rp, epi, hunter, sinkable=sinkable)
            return spec.render(r, f, rp, epi, hunter)
        except atoms.AtomNotFound as e:
            raise RenderError(str(e)) from None

    def take(edit: str) -> Edit:
        """From the library into our kernel (use_wgmma, use_tensor_cores, use_tma)."""

        def apply(plan: Plan, rp: GemmPlan | None, r: Region, low: Lowered) -> Any:
            if rp is None:
                rp = with_defaults(spec.knobs(r.rid), form_of(r, low))
                yield label(edit, r.rid, bn=rp.bn, stages=rp.stages), plan.add(rp)

        return apply

    fuse = fuse_edit(epilogue_any)

    def tile(edit: str, widest: bool) -> Edit:
        def apply(plan: Plan, rp: GemmPlan | None, r: Region, low: Lowered) -> Any:
            if rp is None:
                return
            f = form_of(r, low)
            tiles = spec.tiles(f)
            # the next tile wider (or narrower) than the plan's, else the widest (narrowest)
            wider, narrower = [t for t in tiles if t > rp.bn], [t for t in tiles if t < rp.bn]
            bn = (wider or tiles[-1:])[0] if widest else (narrower or tiles[:1])[-1]
            # more_parallelism and resize_grid narrow the tile for more blocks, reduce_registers for fewer
            # registers: on a grid of many tiles only where the family says that pays (each gathered or
            # loaded A tile then feeds half the MMAs)
            grid = edit in ("more_parallelism", "resize_grid")
            many = spec.grid_tiles is not None and spec.grid_tiles(r, low, f, rp.bn) >= FEW_TILES
            pays = not grid and spec.narrow_pays is not None and spec.narrow_pays(rp.bn, bn)
            if not widest and many and not pays:
                return  # enough tiles already
            if rp.bn != bn:
                top = ring(dataclasses.replace(rp, bn=bn), f)
                yield from change(edit, plan, rp, bn=bn, stages=min(rp.stages, top) if rp.bn > bn else top)

        return apply

    def stages(plan: Plan, rp: GemmPlan | None, r: Region, low: Lowered) -> Any:
        if rp is None:
            return
        top = ring(rp, form_of(r, low))
        if rp.stages < top:
            yield from change("pipeline_loads", plan, rp, stages=rp.stages + 1)
        elif rp.stages > 3:  # at the limit: a shorter ring is the only other way to go
            yield from change("pipeline_loads", plan, rp, stages=rp.stages - 1)

    def settle(plan: Plan, r: Region, low: Lowered, tuned: bool) -> Plan:
        """Tuned: our kernel with everything after it fused on its stores. Plain: the library, unless no
        other region is ours (then our kernel with the narrowest tiles, nothing fused)."""
        if tuned:
            for _, p in take("use_wgmma")(plan, plan.get(r.rid), r, low):
                plan = p
            for _, p in fuse(plan, plan.get(r.rid), r, low):
                plan = p
        elif all(isinstance(rp, GemmPlan) for rp in plan.regions):
            for _, p in take("use_wgmma")(plan, plan.get(r.rid), r, low):
                f = form_of(r, low)
                bn = spec.tiles(f)[-1 if spec.plain_widest else 0]
                plan = changed(p, p.get(r.rid), bn=bn, stages=min(4, spec.max_stages(bn, f)))
        return plan

    def note(regions: list[Region], low: Lowered) -> str:
        targets = ", ".join(r.node.target for r in regions)
        return f"our {spec.kernel} for {targets} in the tuned plans, {spec.library} in the plain one (hybrid)"

    return Family(
        knobs=spec.knobs,
        claims=claims,
        first=first,
        render=render,
        edits={
            "use_wgmma": take("use_wgmma"),
            "use_tensor_cores": take("use_tensor_cores"),
            "use_tma": take("use_tma"),
            "fuse_epilogue": fuse,
            "more_parallelism": tile("more_parallelism", False),
            "reduce_registers": tile("reduce_registers", False),
            "resize_grid": tile("resize_grid", False),
            "coarsen_threads": tile("coarsen_threads", True),
            "tile_shared_memory": tile("tile_shared_memory", True),
            "pipeline_loads": stages,
        },
        order=spec.order,
        settle=settle,
        plainest=lambda rp: None,
        note=note,
        cute=True,
        runs_on=lambda arch: arch.startswith("sm_90"),  # WGMMA and TMA
        optional=True,
    )
