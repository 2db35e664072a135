"""The first plans of a task, and the profiling tools' edit vocabulary mapped to legal plan changes.

Every edit is an MCTS action: `legal_edits` returns (label, plan) pairs in a fixed priority order
(edits the findings suggest first), each changing one region's parameters, never a plan equal to the
parent's or to an earlier pair's. What each edit does:

  fuse_kernels / fuse_epilogue   an ew neighbour computed inside a reduction/softmax/norm/scan kernel
                                 (prologue on its loads, epilogue on its stores)
  vectorize_loads                vec x2 (up to 16 bytes per access)
  coarsen_threads, pipeline_loads  unroll x2 (accesses in flight; scan: items per thread x2); coarsen_threads
                                 first holds a softmax / norm row in registers (regs) when it fits
  more_parallelism               split a reduction over more blocks; a warp per short row; smaller ew blocks
  tile_shared_memory             two-pass row ops keep the row in shared memory between passes
  remove_divergence              warp shuffles instead of a shared-memory tree; a warp per short row
  persistent_grid                a grid of 2048/threads blocks per SM, grid-stride over the work
  resize_grid                    threads x2 and /2
  increase_occupancy             __launch_bounds__ minimum blocks per SM (caps registers)
  reduce_registers               regs off, else unroll /2 (else items /2, else the occupancy bound)
  coalesce_accesses              strided reductions: more threads along the contiguous dimension

A 16-bit GEMM (templates/gemm.py: linear layers, matmul, mm, addmm, bmm) starts in cuBLAS in the plain plan
and in our WGMMA kernel in the tuned one; its edits:

  use_wgmma / use_tensor_cores / use_tma   take it from cuBLAS into our TMA + WGMMA kernel
  fuse_epilogue                  the elementwise region after it computed on its stores
  more_parallelism, reduce_registers, resize_grid   128 x 128 tiles (twice the blocks, half the accumulators)
  coarsen_threads, tile_shared_memory              128 x 256 tiles (more reuse of each A tile)
  pipeline_loads                 one more shared-memory stage in the TMA ring (as many as fit)

Edits that do not apply (tensor cores, TMA, bank conflicts...) are never proposed; NOT_APPLICABLE says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

from pipeline.generate.expert import fusion, ops
from pipeline.generate.expert.layout import ew_layout, row_layout
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.render import family
from pipeline.generate.expert.templates import gemm, rowwise

MAX_UNROLL = 8
MAX_ITEMS = 16
MAX_SPLITS = 8
SHORT_ROW = 1024  # a warp per row below this many elements
# Edits this policy never makes, with the reason a user sees when the profiler suggests them.
NOT_APPLICABLE = {
    "use_tensor_cores": "only 16-bit GEMMs (linear, matmul, mm, bmm) have our own tensor-core (WGMMA) kernel; "
    "other GEMMs and convolutions stay in cuBLAS / cuDNN, which already use tensor cores",
    "use_wgmma": "only 16-bit GEMMs (linear, matmul, mm, bmm; K, and N of a row-major B, multiples of 8) have a "
    "WGMMA template",
    "use_tma": "TMA is used by the WGMMA GEMM only; the memory-streaming kernels load with vector accesses",
    "fix_bank_conflicts": "shared memory is only used for reductions and row caches with unit-stride access",
    "avoid_local_arrays": "the templates keep their per-thread arrays in registers (fully unrolled)",
    "lower_power": "the expert has no power-capping edit",
}


def _vmax(itemsize: int) -> int:
    return max(1, min(8, 16 // itemsize))


def _ours(low: Lowered) -> list[Region]:
    return [r for r in low.regions if r.ours]


def base_plan(low: Lowered, tuned: bool) -> Plan:
    """The plain plan (scalar accesses, shared-memory trees, nothing fused beyond elementwise chains) or
    the tuned one (16-byte vectors, warp shuffles, several accesses in flight, neighbours fused)."""
    regions: list[RegionPlan] = []
    for r in _ours(low):
        fam = family(r, low)
        if fam is None:
            continue
        rp = RegionPlan(r.rid, fam)
        if fam == "ew":
            lay = ew_layout(r, low)
            if tuned:
                rp = dataclasses.replace(rp, vec=_vmax(lay.max_itemsize), unroll=4)
        elif fam == "scan":
            rp = dataclasses.replace(rp, items=8 if tuned else 1)
        else:
            lay = row_layout(r, low)
            assert lay is not None
            vmax = _vmax(ops.ITEMSIZE.get(lay.in_dtype, 4))
            if fam == "row" and tuned:
                short = lay.reduced <= SHORT_ROW and lay.op not in ("group_norm",)
                threads = 256 if short else max(128, min(1024, _pow2(-(-lay.reduced // (vmax * 4)))))
                rp = dataclasses.replace(
                    rp, vec=vmax, threads=threads, warp_reduce=True, warp_rows=short,
                    splits=1 if r.kind == "reduce" and not short else 0,
                )  # fmt: skip
                # One read of a row that fits in registers, with 256 threads a block: the best of 128 to
                # 1024 for softmax (4096 columns) and layer norm (8192) on the H200.
                if regs := _regs_for(rp, r, low, 256):
                    rp = dataclasses.replace(rp, threads=256, regs=regs)
            elif fam == "col" and tuned:
                vec = vmax if lay.inner % vmax == 0 else 1
                rp = dataclasses.replace(rp, vec=vec, unroll=4, splits=1 if r.kind == "reduce" else 0)
        regions.append(rp)
    plan = Plan(tuple(regions))
    if not tuned and not regions:  # a GEMM alone: the plain plan is our kernel with 128 x 128 tiles
        for r in _gemms(low):
            for _, p in _take_gemm(plan, r, low):
                plan = p.replace(dataclasses.replace(p.get(r.rid), bn=128, stages=4))
    if tuned:
        for r in _ours(low):
            for edit in ("fuse_kernels", "fuse_epilogue"):
                for _, p in _fuse(plan, r, low, epilogue_first=edit == "fuse_epilogue"):
                    plan = p
                    break
        for r in _gemms(low):  # our WGMMA kernel with everything after it fused on its stores
            for _, p in _take_gemm(plan, r, low):
                plan = p
            for _, p in _gemm_epilogue(plan, r, low):
                plan = p
    return plan


def _gemms(low: Lowered) -> list[Region]:
    """Library regions our WGMMA template can compute."""
    return [r for r in low.regions if r.kind == "library" and not gemm.eligible(r, low)]


def _take_gemm(plan: Plan, r: Region, low: Lowered, edit: str = "use_wgmma") -> Iterator[tuple[str, Plan]]:
    if plan.get(r.rid) is None and not gemm.eligible(r, low):
        rp = gemm.with_defaults(RegionPlan(r.rid, "wgmma"))
        yield _label(edit, r.rid, bn=rp.bn, stages=rp.stages), plan.add(rp)


def _gemm_epilogue(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    epi = gemm.epilogue(r, low)
    if rp is None or rp.epilogue or epi is None:
        return
    rid = epi.region.rid
    if rid not in plan.fused() and plan.get(rid) is not None:
        yield _label("fuse_epilogue", r.rid, epilogue=rid), _set(plan, rp, epilogue=rid)


def _gemm_tile(edit: str, bn: int) -> Edit:
    def apply(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
        rp = plan.get(r.rid)
        if rp is not None and rp.bn != bn:
            stages = min(rp.stages, gemm.max_stages(bn)) if rp.bn > bn else gemm.max_stages(bn)
            yield from _one(edit, plan, rp, bn=bn, stages=stages)

    return apply


def _gemm_stages(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is not None and rp.stages < gemm.max_stages(rp.bn):
        yield from _one("pipeline_loads", plan, rp, stages=rp.stages + 1)
    elif rp is not None and rp.stages > 3:  # at the limit: a shorter ring is the only other way to go
        yield from _one("pipeline_loads", plan, rp, stages=rp.stages - 1)


GEMM_EDITS: dict[str, Edit] = {
    "use_wgmma": _take_gemm,
    "use_tensor_cores": lambda p, r, low: _take_gemm(p, r, low, "use_tensor_cores"),
    "use_tma": lambda p, r, low: _take_gemm(p, r, low, "use_tma"),
    "fuse_epilogue": _gemm_epilogue,
    "more_parallelism": _gemm_tile("more_parallelism", 128),
    "reduce_registers": _gemm_tile("reduce_registers", 128),
    "resize_grid": _gemm_tile("resize_grid", 128),
    "coarsen_threads": _gemm_tile("coarsen_threads", 256),
    "tile_shared_memory": _gemm_tile("tile_shared_memory", 256),
    "pipeline_loads": _gemm_stages,
}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---------------------------------------------------------------------------------------------------------
# Edits

Edit = Callable[[Plan, Region, Lowered], Iterable[tuple[str, Plan]]]


def _set(plan: Plan, rp: RegionPlan, **changes) -> Plan:
    return plan.replace(dataclasses.replace(rp, **changes))


def _label(edit: str, rid: str, **changes) -> str:
    return f"{edit}({rid}: {', '.join(f'{k}={v}' for k, v in changes.items())})"


def _one(edit: str, plan: Plan, rp: RegionPlan, **changes) -> Iterator[tuple[str, Plan]]:
    yield _label(edit, rp.rid, **changes), _set(plan, rp, **changes)


def _itemsize(r: Region, low: Lowered, fam: str) -> int:
    if fam == "ew":
        return ew_layout(r, low).max_itemsize
    lay = row_layout(r, low)
    return ops.ITEMSIZE.get(lay.in_dtype, 4) if lay else 4


def _vectorize(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is None or rp.family == "scan":
        return
    vec = rp.vec * 2
    if vec * _itemsize(r, low, rp.family) > 16:
        return
    if rp.family == "col":
        lay = row_layout(r, low)
        if lay is None or lay.inner % vec:
            return
    yield from _one("vectorize_loads", plan, rp, vec=vec)


def _coarsen(edit: str) -> Edit:
    def apply(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
        rp = plan.get(r.rid)
        if rp is None:
            return
        if rp.family == "scan":
            if edit == "coarsen_threads" and rp.items * 2 <= MAX_ITEMS:
                yield from _one(edit, plan, rp, items=rp.items * 2)
            return
        if edit == "coarsen_threads" and not rp.regs and (regs := _regs_for(rp, r, low)):
            # each thread holds its part of the row (instead of a shared-memory copy, if it had one)
            yield from _one(edit, plan, rp, regs=regs, **({"smem_row": False} if rp.smem_row else {}))
        if rp.unroll * 2 <= MAX_UNROLL:
            yield from _one(edit, plan, rp, unroll=rp.unroll * 2)

    return apply


def _regs_for(rp: RegionPlan, r: Region, low: Lowered, threads: int = 0) -> int:
    """Vectors per thread that hold a whole row in registers, 0 when the op or the row does not allow it."""
    lay = row_layout(r, low) if rp.family == "row" else None
    if lay is None:
        return 0
    regs = -(-lay.reduced // (rp.vec * (threads or rp.threads)))
    return regs if rowwise.regs_ok(lay, dataclasses.replace(rp, regs=regs, smem_row=False), r) else 0


def _occupancy(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is not None and not rp.min_blocks:
        yield from _one("increase_occupancy", plan, rp, min_blocks=max(1, 2048 // rp.threads))


def _registers(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is None:
        return
    if rp.regs:
        yield from _one("reduce_registers", plan, rp, regs=0)
    elif rp.unroll > 1:
        yield from _one("reduce_registers", plan, rp, unroll=rp.unroll // 2)
    elif rp.family == "scan" and rp.items > 1:
        yield from _one("reduce_registers", plan, rp, items=rp.items // 2)
    elif not rp.min_blocks:
        yield from _one("reduce_registers", plan, rp, min_blocks=max(1, 2048 // rp.threads))


def _persistent(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is None or rp.family == "col":
        return
    if not rp.persistent:
        yield from _one("persistent_grid", plan, rp, persistent=max(1, 2048 // rp.threads))


def _threads(
    plan: Plan, rp: RegionPlan, edit: str, threads: int, r: Region, low: Lowered
) -> Iterator[tuple[str, Plan]]:
    """A new block size; an occupancy bound set earlier follows it (threads x blocks stays 2048 per SM), and
    a register-held row is re-divided over the new block (or dropped when it no longer fits)."""
    changes: dict = {"threads": threads}
    if rp.regs:
        changes["regs"] = _regs_for(rp, r, low, threads)
    if rp.min_blocks:
        changes["min_blocks"] = max(1, 2048 // threads)
    yield from _one(edit, plan, rp, **changes)


def _resize(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is None:
        return
    for threads in (rp.threads * 2, rp.threads // 2):
        if 64 <= threads <= 1024:
            yield from _threads(plan, rp, "resize_grid", threads, r, low)


def _parallelism(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is None:
        return
    if r.kind == "reduce" and not rp.warp_rows and (rp.splits * 2 or 1) <= MAX_SPLITS:
        yield from _one("more_parallelism", plan, rp, splits=rp.splits * 2 or 1)
    elif rp.family == "row" and not rp.warp_rows and _short(r, low):
        yield from _one("more_parallelism", plan, rp, warp_rows=True, splits=0)
    elif rp.family == "ew" and rp.threads > 64:
        yield from _threads(plan, rp, "more_parallelism", rp.threads // 2, r, low)


def _short(r: Region, low: Lowered) -> bool:
    lay = row_layout(r, low)
    return lay is not None and lay.reduced <= SHORT_ROW and lay.op != "group_norm"


def _tile(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is None or rp.family != "row" or rp.smem_row or r.kind not in ("softmax", "norm"):
        return
    yield from _one("tile_shared_memory", plan, rp, smem_row=True, **({"regs": 0} if rp.regs else {}))


def _divergence(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is None or rp.family != "row":
        return
    if not rp.warp_reduce:
        yield from _one("remove_divergence", plan, rp, warp_reduce=True)
    elif not rp.warp_rows and _short(r, low):
        yield from _one("remove_divergence", plan, rp, warp_rows=True, splits=0)


def _coalesce(plan: Plan, r: Region, low: Lowered) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is None or rp.family != "col" or r.kind != "reduce":
        return
    lay = row_layout(r, low)
    if lay and rp.bx * 2 <= min(rp.threads, 256) and lay.inner >= rp.bx * 2 * rp.vec:
        yield from _one("coalesce_accesses", plan, rp, bx=rp.bx * 2)


def _fuse(plan: Plan, r: Region, low: Lowered, epilogue_first: bool = False) -> Iterator[tuple[str, Plan]]:
    rp = plan.get(r.rid)
    if rp is None or r.kind not in fusion.HOSTS:
        return
    pre, post = fusion.options(low).get(r.rid, (None, None))
    taken = plan.fused()
    tries = (
        [("epilogue", post), ("prologue", pre)] if epilogue_first else [("prologue", pre), ("epilogue", post)]
    )
    for side, f in tries:
        if f is None or getattr(rp, side) or f.region.rid in taken or plan.get(f.region.rid) is None:
            continue
        name = "fuse_epilogue" if side == "epilogue" else "fuse_kernels"
        yield _label(name, rp.rid, **{side: f.region.rid}), _set(plan, rp, **{side: f.region.rid})


EDITS: dict[str, Edit] = {
    "fuse_kernels": _fuse,
    "fuse_epilogue": lambda p, r, low: _fuse(p, r, low, epilogue_first=True),
    "vectorize_loads": _vectorize,
    "coarsen_threads": _coarsen("coarsen_threads"),
    "more_parallelism": _parallelism,
    "tile_shared_memory": _tile,
    "remove_divergence": _divergence,
    "persistent_grid": _persistent,
    "pipeline_loads": _coarsen("pipeline_loads"),
    "resize_grid": _resize,
    "increase_occupancy": _occupancy,
    "reduce_registers": _registers,
    "coalesce_accesses": _coalesce,
}
PRIORITY = tuple(EDITS)


def _weight(r: Region, low: Lowered) -> int:
    """Elements a region moves (its biggest tensor), to try edits on the heaviest region first."""
    sizes = [low.by_name[v].numel for v in (*r.inputs, *r.outputs) if low.by_name[v].shape is not None]
    return max(sizes, default=0)


def legal_edits(plan: Plan, low: Lowered, suggested: Iterable[str] = ()) -> list[tuple[str, Plan]]:
    """Every legal single edit of the plan, suggested edits first, each distinct plan once."""
    order = list(dict.fromkeys([e for e in suggested if e in EDITS or e in GEMM_EDITS] + list(PRIORITY)))
    order += [e for e in GEMM_EDITS if e not in order]
    live = [r for r in _ours(low) if plan.get(r.rid) is not None and r.rid not in plan.fused()]
    live += _gemms(low)
    index = {r.rid: i for i, r in enumerate(low.regions)}
    live.sort(key=lambda r: (-_weight(r, low), index[r.rid]))
    seen = {plan.to_json()}
    out: list[tuple[str, Plan]] = []
    for edit in order:
        for r in live:
            table = GEMM_EDITS if r.kind == "library" else EDITS
            if edit not in table:
                continue
            for label, p in table[edit](plan, r, low):
                key = p.to_json()
                if key not in seen:
                    seen.add(key)
                    out.append((label, p))
    return out


def safer(plan: Plan, parent: Plan | None) -> Plan:
    """The repair plan: regions that differ from the parent's plan (all of them without one) go back to
    the plainest parameters: scalar accesses, 256 threads, nothing fused, no splits or caches."""
    regions = []
    for rp in plan.regions:
        before = parent.get(rp.rid) if parent else None
        if before == rp:
            regions.append(rp)
        elif rp.family != "wgmma":  # a changed GEMM goes back to cuBLAS
            regions.append(RegionPlan(rp.rid, rp.family))
    return Plan(tuple(regions), plan.version)
