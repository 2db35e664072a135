"""Edits shared by the families of our memory-streaming kernels, and the fusing of elementwise neighbours
into the kernels that host them (row-wise, strided and scan kernels: a prologue on their loads, an
epilogue on their stores). Knobs are read by name: a family uses the helpers whose knobs it has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert import fusion, ops
from pipeline.generate.expert.families.base import Edit, Family, RenderError, change, changed, label
from pipeline.generate.expert.graph import Node, Ref
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates.code import Code
from pipeline.generate.expert.templates.fused import Fused

MAX_UNROLL = 8
SM_THREADS = 2048  # resident threads per SM that the occupancy knobs aim for
SMS = 132  # SMs of an H100 or H200: the waves and rows-an-SM rules count them

Moves = Iterator[tuple[str, Plan]]


# Views whose result may be rows of contiguous runs of their source, not one contiguous block (a getitem
# is looked through: of a split it is one of its parts, of a tuple-valued op a fresh tensor)
STRIDED_VIEWS = frozenset(
    {
        "select",
        "slice",
        "narrow",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "permute",
        "transpose",
        "as_strided",
    }
)


def strided_view(name: str, low: Lowered) -> bool:
    """Whether a value is a strided view of another (through any views on the way), not a fresh tensor."""
    seen = 0
    node = low.by_name.get(name)
    while node is not None and node.op in ops.VIEWS and seen < 64:
        if node.op in STRIDED_VIEWS:
            return True
        src = node.args[0] if node.args else None
        node = low.by_name.get(src.name) if isinstance(src, Ref) else None
        seen += 1
    return False


def vec_max(itemsize: int) -> int:
    """Elements of one 16-byte access."""
    return max(1, min(8, 16 // itemsize))


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def blocks_per_sm(threads: int) -> int:
    return max(1, SM_THREADS // threads)


def resized(edit: str, plan: Plan, rp: Any, threads: int, regs: int | None = None) -> Moves:
    """A new block size; an occupancy bound set earlier follows it (threads x blocks stays 2048 per SM), and
    a register-held row (`regs`, re-divided by the caller) with it."""
    changes: dict[str, object] = {"threads": threads}
    if regs is not None:
        changes["regs"] = regs
    if getattr(rp, "min_blocks", 0):  # plans without the knob (the copy and resample kernels) skip it
        changes["min_blocks"] = blocks_per_sm(threads)
    yield from change(edit, plan, rp, **changes)


def resize_grid(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
    for threads in (rp.threads * 2, rp.threads // 2):
        if 64 <= threads <= 1024:
            yield from resized("resize_grid", plan, rp, threads)


def vectorize_flag(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
    """vectorize_loads for a plan whose 16-byte path is one switch (`vec`): turn it on."""
    if not rp.vec:
        yield from change("vectorize_loads", plan, rp, vec=True)


@dataclass(frozen=True)
class WarpRowPlan(RegionPlan):
    """The knobs of a kernel that computes a region PyTorch would (a loss, a similarity) a warp a row: its
    block, and the 16-byte path (the tuned plan's)."""

    SHOWN: ClassVar[tuple[str, ...]] = ("threads",)

    threads: int = 256
    vec: bool = False  # float4 loads of the rows where their length allows


def warp_row_family(
    knobs: type[WarpRowPlan], ops: Container[str], form: Callable[[Any, Lowered], Any],
    render_form: Callable[[Region, Any, int, bool], Code], what: str,
) -> Family:  # fmt: skip
    """A family for `ops`' torch-kind regions whose `form` (geometry, or why not) our kernel takes, rendered
    by `render_form(region, form, threads, vec)`. Both plans take our kernel (no library anchor). Edits:
    vectorize_loads, resize_grid (threads x2 and /2)."""
    _, claims, declines = torch_region_rules(form, ops)

    def first(r: Region, low: Lowered, tuned: bool) -> WarpRowPlan:
        return knobs(r.rid, vec=tuned)

    def render(r: Region, rp: WarpRowPlan, low: Lowered, hunter: Any) -> Code:
        f = form(r.node, low)
        if isinstance(f, str):
            raise RenderError(f"region {r.rid} cannot be our {what} kernel: {f}")
        return render_form(r, f, rp.threads, rp.vec)

    return Family(
        knobs=knobs,
        claims=claims,
        first=first,
        render=render,
        declines=declines,
        edits={"vectorize_loads": vectorize_flag, "resize_grid": resize_grid},
        order=11,
    )


def feeds_copy(value: str, low: Lowered, max_dim: int | None = None) -> bool:
    """Whether a value is read by nothing but one cat or stack, which may sink its producer (render.py);
    with max_dim, only one along a dim of at most that (a convolution writes whole images: its slice must
    be one block an image, a join along the channels or the batch)."""
    if value in low.graph.output_names():
        return False
    users = [low.by_name[u] for u in low.users.get(value, ())]
    if len(users) != 1 or users[0].op not in ("cat", "stack"):
        return False
    if max_dim is None:
        return True
    n = users[0]
    dim = n.args[1] if len(n.args) > 1 else n.kw("dim", 0)
    rank = len(n.shape or ())
    return isinstance(dim, int) and rank > 0 and dim % rank <= max_dim


def output_feeds_copy(r: Region, epi: Any, low: Lowered, max_dim: int | None = None) -> bool:
    """feeds_copy for the one output a region's launcher returns: its fused chain's (epi), else the region's
    own; False for a launcher of several outputs."""
    out = epi.out if epi is not None else r.outputs[0] if len(r.outputs) == 1 else ""
    return bool(out) and feeds_copy(out, low, max_dim)


def torch_region_rules(
    form: Callable[[Any, Lowered], Any], ops: Container[str]
) -> tuple[
    Callable[[Region, Lowered], str], Callable[[Region, Lowered], bool], Callable[[Region, Lowered], str]
]:
    """why_not, claims and declines of a family that computes regions PyTorch would (torch-kind ones) from
    a `form` of the node: its geometry, or a string saying why not. declines speaks for `ops` only."""

    def why_not(r: Region, low: Lowered) -> str:
        if r.kind is not RegionKind.TORCH:
            return "not a region PyTorch would compute"
        f = form(r.node, low)
        return f if isinstance(f, str) else ""

    def claims(r: Region, low: Lowered) -> bool:
        return not why_not(r, low)

    def declines(r: Region, low: Lowered) -> str:
        return why_not(r, low) if r.kind is RegionKind.TORCH and r.node.op in ops else ""

    return why_not, claims, declines


def torch_family(
    knobs: type[RegionPlan],
    ops_: Container[str],
    form: Callable[[Any, Lowered], Any],
    emit: Callable[[Region, Any, Any, Lowered], Code],
    what: str,
    edits: Mapping[str, Edit] | None = None,
    order: int = 16,
    first: Callable[[Region, Lowered, bool], RegionPlan] | None = None,
) -> Family:
    """A family of one kernel for regions PyTorch would compute (torch_region_rules): both plans take the
    knobs' defaults (or `first`'s entry), `emit(region, entry, form, lowered)` writes the code of a node
    whose `form` is not a reason, and resize_grid is its edit unless `edits` names others. `what` names the
    kernel in errors."""
    _, claims, declines = torch_region_rules(form, ops_)

    def defaults(r: Region, low: Lowered, tuned: bool) -> RegionPlan:
        return knobs(r.rid)

    def render(r: Region, rp: Any, low: Lowered, hunter: Any) -> Code:
        f = form(r.node, low)
        if isinstance(f, str):
            raise RenderError(f"region {r.rid} cannot be our {what}: {f}")
        return emit(r, rp, f, low)

    return Family(knobs=knobs, claims=claims, first=first or defaults, render=render, declines=declines,
                  edits=edits if edits is not None else {"resize_grid": resize_grid}, order=order)  # fmt: skip


def operand(ref: Any, low: Lowered) -> Node | None:
    """The node a node's argument names, or None for a constant or an unknown value."""
    return low.by_name.get(ref.name) if isinstance(ref, Ref) else None


def persistent_grid(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
    if not rp.persistent:
        yield from change("persistent_grid", plan, rp, persistent=blocks_per_sm(rp.threads))


SM_SHARES = (75, 50)  # percent of the SMs: HBM saturates before every SM streams; idle SMs draw less


def fewer_sms(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
    """An energy edit (objective energy or edp): the same work on a persistent grid over part of the SMs.
    A bandwidth-bound kernel keeps its speed while fewer SMs issue; the harness's matched-speed rule keeps
    it only where it does."""
    if not rp.sm_share:
        for share in SM_SHARES:
            yield from change("lower_power", plan, rp, persistent=rp.persistent or blocks_per_sm(rp.threads),
                              sm_share=share)  # fmt: skip


def increase_occupancy(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
    if not rp.min_blocks:
        yield from change("increase_occupancy", plan, rp, min_blocks=blocks_per_sm(rp.threads))


def unroll(edit: str) -> Edit:
    """More accesses (or loop iterations) in flight per thread."""

    def apply(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
        if rp.unroll * 2 <= MAX_UNROLL:
            yield from change(edit, plan, rp, unroll=rp.unroll * 2)

    return apply


def fewer_registers(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
    """Half the accesses in flight, else an occupancy bound (which caps the registers)."""
    if rp.unroll > 1:
        yield from change("reduce_registers", plan, rp, unroll=rp.unroll // 2)
    elif not rp.min_blocks:
        yield from change("reduce_registers", plan, rp, min_blocks=blocks_per_sm(rp.threads))


def output_edits(max_outs: int) -> dict[str, Edit]:
    """The edits of a kernel whose thread computes `outs` outputs of one row (knobs `outs`, `threads`: the
    direct convolution, pooling): coarsen_threads (outputs a thread x2, up to max_outs), more_parallelism
    (/2), resize_grid (threads x2 and /2). None for a region an optional family left to the library."""

    def coarsen(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
        if rp is not None and rp.outs * 2 <= max_outs:
            yield from change("coarsen_threads", plan, rp, outs=rp.outs * 2)

    def parallelism(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
        if rp is not None and rp.outs > 1:
            yield from change("more_parallelism", plan, rp, outs=rp.outs // 2)

    def resize(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
        if rp is None:
            return
        for threads in (rp.threads * 2, rp.threads // 2):
            if 64 <= threads <= 1024:
                yield from change("resize_grid", plan, rp, threads=threads)

    return {"coarsen_threads": coarsen, "more_parallelism": parallelism, "resize_grid": resize}


# ---------------------------------------------------------------------------------------------------------
# Hosting elementwise neighbours (knobs `prologue` and `epilogue`: the rids of the fused regions)


def fuse(epilogue_first: bool) -> Edit:
    """fuse_kernels (a prologue first) or fuse_epilogue (an epilogue first): each neighbour that is free."""

    def apply(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
        pre, post = fusion.neighbours(r, low)
        taken = plan.fused()
        sides = [("epilogue", post), ("prologue", pre)]
        for side, f in sides if epilogue_first else sides[::-1]:
            if f is None or getattr(rp, side) or f.region.rid in taken or plan.get(f.region.rid) is None:
                continue
            name = "fuse_epilogue" if side == "epilogue" else "fuse_kernels"
            yield label(name, rp.rid, **{side: f.region.rid}), changed(plan, rp, **{side: f.region.rid})

    return apply


FUSE_EDITS: dict[str, Edit] = {"fuse_kernels": fuse(False), "fuse_epilogue": fuse(True)}


def settling(edits: Mapping[str, Edit]) -> Callable[[Plan, Region, Lowered, bool], Plan]:
    """A settle function: the tuned plan takes the first free prologue, then the first free epilogue, that
    `edits` (a family's fusions) offer."""

    def settle(plan: Plan, r: Region, low: Lowered, tuned: bool) -> Plan:
        rp = plan.get(r.rid)
        if not tuned or rp is None:
            return plan
        for apply in edits.values():
            for _, p in apply(plan, plan.get(r.rid), r, low):
                plan = p
                break
        return plan

    return settle


settle_fusions = settling(FUSE_EDITS)


def fused_neighbours(r: Region, rp: Any, low: Lowered) -> tuple[Fused | None, Fused | None]:
    """The prologue and epilogue the entry asks for (their logs and exponentials by the special-function unit
    where it asks for intrinsics); RenderError when the graph no longer offers them."""
    pre, post = fusion.neighbours(r, low)
    pre = pre if rp.prologue else None
    post = post if rp.epilogue else None
    if (rp.prologue and (pre is None or pre.region.rid != rp.prologue)) or (
        rp.epilogue and (post is None or post.region.rid != rp.epilogue)
    ):
        raise RenderError(f"region {r.rid}: the plan's fusion no longer applies")
    if getattr(rp, "intrinsics", False):
        pre, post = (dataclasses.replace(f, fast=True) if f else None for f in (pre, post))
    return pre, post


def use_intrinsics(plan: Plan, rp: Any, r: Region, low: Lowered) -> Moves:
    """The logs and exponentials the region's kernel computes (its own elementwise ops, or its fused
    neighbours') by the special-function unit: where an fp32 polynomial per element makes the kernel issue
    as many instructions as it moves bytes (KL divergence's two logf an element: ~45 instructions)."""
    if getattr(rp, "intrinsics", True) or r.rid in plan.fused():  # a fused region: its host decides
        return
    absorbed = set(rp.absorbed())
    nodes = [
        n for x in low.regions if x.rid in absorbed or (x is r and r.kind is RegionKind.EW) for n in x.nodes
    ]
    if ops.has_fast(nodes):
        yield from change("use_intrinsics", plan, rp, intrinsics=True)


def hosted_render(
    layout: Callable[[Region, Lowered], Any], template: Callable[..., Code]
) -> Callable[[Region, Any, Lowered, object], Code]:
    """The render function of a family whose kernel hosts fused neighbours: the region's row layout, the
    prologue and epilogue its entry asks for, then the template."""

    def render(r: Region, rp: Any, low: Lowered, hunter: object) -> Code:
        lay = layout(r, low)
        if lay is None:
            raise RenderError(f"region {r.rid} has no row layout")
        pre, post = fused_neighbours(r, rp, low)
        return template(r, lay, rp, pre, post)

    return render
