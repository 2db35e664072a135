"""Grouped GEMMs for MoE experts (torch._grouped_mm, or a loop over experts that grouped.py captured as one) on
our persistent Hopper kernel (templates/grouped_gemm.py): every expert's rows times its weight in one launch,
groups read on the device from the routing as it comes (counts or offsets: no cumsum or int32 copy apart),
the elementwise region after it fused on its stores. The plain plan leaves the grouped GEMM to
torch._grouped_mm; the tuned one takes it (gemm_kit.py: the same plans and edits as a GEMM: tile width,
ring stages, the fused epilogue).

A gated epilogue is fused too: the output split in two halves along N, an elementwise chain of both
(SwiGLU: silu(gate) * up, GeGLU...). Each tile then computes the gate and the up columns of the same
outputs, so the (M, 2I) product is never written: the kernel writes the (M, I) result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert import ops
from pipeline.generate.expert.families import gemm_kit
from pipeline.generate.expert.families.base import Edit, change
from pipeline.generate.expert.families.gemm_kit import GemmPlan
from pipeline.generate.expert.graph import Node, Ref
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates import grouped_gemm
from pipeline.generate.expert.templates.gemm import GemmEpilogue
from pipeline.generate.expert.templates.grouped_gemm import GroupedForm, Groups


@dataclass(frozen=True)
class GroupedPlan(GemmPlan):
    TAG: ClassVar[str] = "wgmma_grouped"

    cluster: int = 1  # blocks of a cluster sharing each weight tile by TMA multicast (1 or 2)
    # stores through shared memory in 16-byte rows (templates/gemm.py: staged_store): on the H200, 12% off
    # qwen3_fc2 (K = 768, where direct stores were a third of the kernel's time), even elsewhere
    staged: bool = True
    pingpong: bool = False  # a consumer warpgroup a tile, one storing while the other's MMAs run

    def describe(self) -> str:
        return (
            super().describe()
            + (f" cluster={self.cluster} (weight tiles multicast)" if self.cluster > 1 else "")
            + ("" if self.staged else " stores direct from the accumulators")
            + (" ping-pong consumers (a warpgroup a tile)" if self.pingpong else "")
        )


def form(r: Region, low: Lowered) -> GroupedForm | str:
    """How the grouped GEMM's operands lie, or why our kernel cannot take it."""
    n = r.node
    if r.kind is not RegionKind.LIBRARY or n.op != "gemm_grouped":
        return "only grouped GEMMs (torch._grouped_mm) have a grouped template"
    a, w, offs = (low.by_name.get(v.name) if isinstance(v, Ref) else None for v in n.args[:3])
    if a is None or w is None or offs is None or not a.shape or not w.shape or not offs.shape:
        return "the operands' shapes are unknown"
    if len(a.shape) == 2 and len(w.shape) == 2:
        return (
            "a grouped GEMM whose groups split K (a weight gradient, x[rows of e]^T @ dy[rows of e]) has no "
            "template of ours yet: torch._grouped_mm computes it"
        )
    if {a.dtype, w.dtype, n.dtype} != {"bfloat16"}:
        return f"the grouped template takes bf16 operands, not {a.dtype} x {w.dtype}"
    if len(a.shape) != 2 or len(w.shape) != 3 or offs.shape != (w.shape[0],):
        return "only (M, K) rows grouped by one offset per expert times (E, K, N) weights"
    experts, k, cols = w.shape
    if a.shape[1] != k:
        return "the operands' inner dims differ"
    if k % 8 or cols % 8:
        return f"K = {k} and N = {cols} must be multiples of 8 (TMA needs 16-byte rows)"
    # a transposed (E, N, K) stack is read K-major as it lies; anything else is read as (E, K, N) rows
    src = low.by_name.get(w.args[0].name) if w.op == "transpose" and isinstance(w.args[0], Ref) else None
    k_major = src is not None and sorted(a % 3 for a in w.args[1:3]) == [1, 2]
    return GroupedForm("K" if k_major else "MN", experts, groups(offs, low))


_INTS = ("int32", "int64")


def groups(offs: Node, low: Lowered) -> Groups:
    """The routing the offsets were made from, read by the kernel instead: int32 ends of `counts.cumsum(0)`
    (or of offsets, with or without a leading zero) are the counts (the offsets) themselves."""
    n = offs
    if n.op in ("_to_copy", "to") and set(dict(n.kwargs)) <= {"dtype"} and isinstance(n.args[0], Ref):
        src = low.by_name[n.args[0].name]
        if src.dtype in _INTS and src.shape == n.shape:
            n = src
    c = low.by_name[n.args[0].name] if n.args and isinstance(n.args[0], Ref) else None
    if c is not None and c.dtype in _INTS and len(c.shape or ()) == 1:
        if n.op == "cumsum" and n.args[1:2] in ((0,), (-1,)) and n.kw("dtype") is None and c.shape == n.shape:
            return Groups(c.name, c.dtype, counts=True)
        end = n.args[3] if len(n.args) > 3 else None
        whole = (end is None or end >= c.shape[0]) and c.shape[0] == (n.shape or (0,))[0] + 1
        if n.op == "slice" and n.args[1:3] in ((0, 1), (-1, 1)) and n.args[4:] in ((), (1,)) and whole:
            return Groups(c.name, c.dtype, skip=1)
    return Groups(n.name, n.dtype or "int32") if n.dtype in _INTS else Groups(offs.name, "int32")


def epilogue(host: Region, low: Lowered) -> GemmEpilogue | None:
    """The ew region after the grouped GEMM: reading its output, or its two halves (gated). Not a positional
    one (triu...): the kernel's rows are a group's, not the output's."""
    epi = gemm_kit.epilogue(host, low) or gated(host, low)
    return None if epi is None or ops.positional(epi.region.nodes) else epi


def gated(host: Region, low: Lowered) -> GemmEpilogue | None:
    """An ew region that alone reads both halves (along N) of the GEMM's one output, and nothing else does."""
    if len(host.outputs) != 1 or host.outputs[0] in low.graph.output_names():
        return None
    out = low.by_name[host.outputs[0]]
    users = low.users.get(out.name, ())
    if not out.shape or out.shape[-1] % 2 or len(users) != 1:
        return None
    sp, half, last = low.by_name[users[0]], out.shape[-1] // 2, len(out.shape) - 1
    if not (
        (sp.op == "split" and sp.args[1:] in ((half, -1), (half, last)))
        or (sp.op == "chunk" and sp.args[1:] in ((2, -1), (2, last)))
    ):
        return None
    parts = {low.by_name[u].args[1]: u for u in low.users.get(sp.name, ()) if low.by_name[u].op == "getitem"}
    if sorted(parts) != [0, 1] or len(low.users.get(sp.name, ())) != 2:
        return None
    if set(parts.values()) & set(low.graph.output_names()):
        return None  # a half that forward returns must be written as it is
    readers = {r for p in parts.values() for r in low.users.get(p, ())}
    regions = {low.region_of(r) for r in readers}
    if len(regions) != 1:
        return None
    (e,) = regions
    if e is None or e.kind is not RegionKind.EW or len(e.outputs) != 1 or e.shape != (*out.shape[:-1], half):
        return None
    return gemm_kit.epilogue_on(e, host, low, parts[0], parts[1])


SPEC = gemm_kit.Spec(
    knobs=GroupedPlan,
    dtypes=grouped_gemm.DTYPES,
    what="bf16",
    align=8,
    tiles=lambda f: grouped_gemm.TILE_N,
    max_stages=lambda bn, f: grouped_gemm.max_stages(bn, f.experts),
    render=grouped_gemm.render,
    kernel="persistent grouped WGMMA kernel (TMA, tensor cores)",
    form_of=form,
    epilogue_of=epilogue,
    library="torch._grouped_mm",
)


def multicast(plan: Plan, rp: GroupedPlan | None, r: Region, low: Lowered) -> Any:
    """multicast_loads: a cluster of two blocks shares each weight tile (half the weight's loads from L2), or
    back to one block a tile."""
    if isinstance(rp, GroupedPlan):
        yield from change("multicast_loads", plan, rp, cluster=1 if rp.cluster > 1 else 2)


def coalesce(plan: Plan, rp: GroupedPlan | None, r: Region, low: Lowered) -> Any:
    """coalesce_accesses: the tile's stores staged in shared memory and written in whole 16-byte rows (the
    default), or stores from the accumulators (two columns of eight rows a warp store)."""
    if isinstance(rp, GroupedPlan):
        yield from change("coalesce_accesses", plan, rp, staged=not rp.staged)


def overlap(plan: Plan, rp: GroupedPlan | None, r: Region, low: Lowered) -> Any:
    """overlap_epilogue: ping-pong consumers, each warpgroup on its own 128 x 128 tile, so one's stores run
    under the other's MMAs (at K = 768 the stores were a third of the kernel's time), or back to both
    warpgroups on one tile. Its accumulators take a warpgroup's registers at 128 columns (gated: 64 gate and
    64 up columns, 64 outputs): 256-wide plans narrow to it; clusters and direct stores keep the cooperative
    consumers."""
    if not isinstance(rp, GroupedPlan) or rp.cluster > 1 or not rp.staged:
        return
    f = form(r, low)
    if isinstance(f, str):
        return
    if rp.pingpong:
        yield from change("overlap_epilogue", plan, rp, pingpong=False)
    else:
        top = grouped_gemm.max_stages(128, f.experts)
        yield from change(
            "overlap_epilogue", plan, rp, pingpong=True, bn=128, stages=min(max(rp.stages, 4), top)
        )


def _fits(edit: Edit) -> Edit:
    """The edit's plans that the template takes: ping-pong consumers keep 128 x 128 tiles, one block a tile
    and staged stores, so a wider tile, a cluster or direct stores are proposed from the cooperative plan."""

    def fitting(plan: Plan, rp: RegionPlan | None, r: Region, low: Lowered) -> Any:
        for label, p in edit(plan, rp, r, low):
            if not grouped_gemm.misfit(p.get(r.rid)):
                yield label, p

    return fitting


_FAMILY = gemm_kit.family(SPEC)
_EDITS = {
    **_FAMILY.edits,
    "multicast_loads": multicast,
    "coalesce_accesses": coalesce,
    "overlap_epilogue": overlap,
}
FAMILY = dataclasses.replace(_FAMILY, edits={name: _fits(e) for name, e in _EDITS.items()})
