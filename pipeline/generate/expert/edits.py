"""The first plans of a task, and the profiling tools' edit vocabulary mapped to legal plan changes.

Every edit is an MCTS action: `legal_edits` returns (label, plan) pairs in a fixed priority order (edits
the findings suggest first, then PRIORITY), each changing one region's parameters, never a plan equal to
the parent's or to an earlier pair's. What an edit does to a region is its family's business (each
module in families/ lists its edits); across regions the heaviest goes first. Edits no family makes
(bank conflicts, power...) are never proposed; NOT_APPLICABLE says why.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from pipeline.generate.expert.families import FAMILIES, edit_names, family_of, owner
from pipeline.generate.expert.families.base import Edit
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind

# The order edits are tried in: fusions first (they remove whole kernels), then the access pattern, the
# grid, occupancy, and taking a GEMM from cuBLAS last. A family's edit not listed here comes after these.
PRIORITY = (
    "fuse_kernels",
    "fuse_epilogue",
    "vectorize_loads",
    "coarsen_threads",
    "more_parallelism",
    "tile_shared_memory",
    "remove_divergence",
    "persistent_grid",
    "pipeline_loads",
    "resize_grid",
    "increase_occupancy",
    "reduce_registers",
    "coalesce_accesses",
    "use_wgmma",
    "use_tensor_cores",
    "use_tma",
    "use_intrinsics",
    "capture_graph",
)
# Edits this policy never makes, with the reason a user sees when the profiler suggests them.
NOT_APPLICABLE = {
    "use_tensor_cores": "only GEMMs (linear, matmul, mm, bmm: 16-bit, or fp32 through 3xTF32) have our own "
    "tensor-core (WGMMA) kernel, and fused attention a tensor-core form beside its CUDA-core one; other GEMMs "
    "and convolutions stay in cuBLAS / cuDNN, which already use tensor cores",
    "use_wgmma": "only GEMMs (linear, matmul, mm, bmm; K, and N of a row-major B, 16-byte multiples) have a "
    "WGMMA template",
    "use_tma": "TMA is used by the WGMMA GEMM only; the memory-streaming kernels load with vector accesses",
    "fix_bank_conflicts": "shared memory is only used for reductions and row caches with unit-stride access",
    "avoid_local_arrays": "the templates keep their per-thread arrays in registers (fully unrolled)",
    "lower_power": "only the elementwise and row-wise kernels have a power edit (a persistent grid over part "
    "of the SMs), made under --objective energy or edp only",
}
# Edits that trade nothing for speed and aim at joules: made only when the objective counts energy, right
# after what the profile suggests (a kernel with speed left to gain gets that first).
ENERGY = ("lower_power",)


GRAPH_EDIT = "capture_graph"  # the whole forward, not a region: no family makes it
# Regions launched a call (ours and the library's) from which the tuned plan replays forward from a CUDA
# graph: each costs the host 5-30 us of Python and a launch, more than a small kernel runs on the GPU.
GRAPH_LAUNCHES = 16
GRAPH_OFFER = 4  # launched regions from which capture_graph is offered unasked (the profile may ask below)


def base_plan(low: Lowered, tuned: bool) -> Plan:
    """The plain plan (each family's plainest parameters, nothing fused beyond elementwise chains) or the
    tuned one (16-byte vectors, warp shuffles, several accesses in flight, neighbours fused, GEMMs ours)."""
    claimed = [(r, f) for r in low.regions if (f := family_of(r, low)) is not None]
    plan = Plan(tuple(rp for r, f in claimed if (rp := f.first(r, low, tuned)) is not None))
    for order in sorted({f.order for f in FAMILIES}):
        for r, f in claimed:
            if f.order == order and r.rid not in plan.fused():  # a fused region's host decides for it
                plan = f.settle(plan, r, low, tuned)
    return plan.with_graph(True) if tuned and launched(low, plan) >= GRAPH_LAUNCHES else plan


def launched(low: Lowered, plan: Plan) -> int:
    """Regions that launch work in a call of the plan's launcher (not views, not those fused into others)."""
    fused = plan.fused()
    return sum(1 for r in low.regions if r.kind is not RegionKind.VIEW and r.rid not in fused)


def for_arch(plan: Plan, arch: str) -> Plan:
    """The plan without the entries whose kernels do not run on `arch` (those regions go to the library)."""
    return Plan(tuple(rp for rp in plan.regions if owner(rp).runs_on(arch)), plan.version, plan.graph)


def _weight(r: Region, low: Lowered) -> int:
    """Elements a region moves (its biggest tensor), to try edits on the heaviest region first."""
    sizes = [low.by_name[v].numel for v in (*r.inputs, *r.outputs) if low.by_name[v].shape is not None]
    return max(sizes, default=0)


def legal_edits(
    plan: Plan,
    low: Lowered,
    suggested: Iterable[str] = (),
    blind: random.Random | None = None,
    energy: bool = False,
) -> list[tuple[str, Plan]]:
    """Every legal single edit of the plan, suggested edits first, each distinct plan once. Without
    suggestions (a plan not profiled), the edits that undo a region's bet (its family's `hedges`) come first.
    `blind`: no advice and no prior, the vocabulary in an order it draws (the no-feedback arm of an
    ablation). `energy`: the objective counts joules, so the ENERGY edits are made too, right after the
    suggested ones."""
    suggested = tuple(suggested)
    vocab = [e for e in (*edit_names(), GRAPH_EDIT) if energy or e not in ENERGY]
    if blind is not None:
        order = sorted(vocab)
        blind.shuffle(order)
    else:
        first = [e for e in suggested if e in vocab] + [e for e in ENERGY if e in vocab]
        order = list(dict.fromkeys(first + list(PRIORITY) + list(vocab)))
    wanted = set(suggested)
    fused = plan.fused()
    live: list[tuple[Region, RegionPlan | None, Mapping[str, Edit]]] = []
    hedged: list[tuple[Region, RegionPlan | None, Mapping[str, Edit], tuple[str, ...]]] = []
    for r in low.regions:
        f = family_of(r, low)
        rp = plan.get(r.rid)
        if f is None or r.rid in fused or not (isinstance(rp, f.knobs) or (rp is None and f.optional)):
            continue
        live.append((r, rp, f.edits))
        if rp is not None and (undo := f.hedges(rp)):
            hedged.append((r, rp, f.edits, undo))
    index = {r.rid: i for i, r in enumerate(low.regions)}
    live.sort(key=lambda x: (-_weight(x[0], low), index[x[0].rid]))
    # the heaviest region's bet first: a network of many (a CNN's fp16x3 convolutions) has its first batch
    # time the undoing that can move its time most, not the first layer's
    hedged.sort(key=lambda x: (-_weight(x[0], low), index[x[0].rid]))
    seen = {plan.to_json()}
    out: list[tuple[str, Plan]] = []
    # no advice: the bets a plan makes are timed against their undoing first
    if blind is None and not suggested:
        for r, rp, edits, undo in hedged:
            for edit in undo:
                for label, p in edits[edit](plan, rp, r, low) if edit in edits else ():
                    if (key := p.to_json()) not in seen:
                        seen.add(key)
                        out.append((label, p))
    for edit in order:
        if edit == GRAPH_EDIT:  # where the profile asks for it, or unasked where there are launches to save
            asked = edit in wanted or launched(low, plan) >= GRAPH_OFFER
            if asked and not plan.graph and (p := plan.with_graph(True)).to_json() not in seen:
                seen.add(p.to_json())
                out.append((edit, p))
            continue
        for r, rp, edits in live:
            if edit not in edits:
                continue
            for label, p in edits[edit](plan, rp, r, low):
                key = p.to_json()
                if key not in seen:
                    seen.add(key)
                    out.append((label, p))
    return out


def safer(plan: Plan, parent: Plan | None) -> Plan:
    """The repair plan: entries that differ from the parent's plan (all of them without one) go back to
    their family's plainest (scalar accesses, 256 threads, nothing fused; a GEMM back to cuBLAS)."""
    regions: list[RegionPlan] = []
    for rp in plan.regions:
        before = parent.get(rp.rid) if parent else None
        if before == rp:
            regions.append(rp)
        elif (plain := owner(rp).plainest(rp)) is not None:
            regions.append(plain)
    # the graph only where the parent replayed one too: the repair goes back to the parent's forward
    return Plan(tuple(regions), plan.version, plan.graph and parent is not None and parent.graph)
