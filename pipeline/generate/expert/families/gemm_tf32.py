"""fp32 GEMMs (linear layers, matmul, mm, addmm, bmm) on the tensor cores at fp32 accuracy: our 3xTF32 WGMMA
kernel (templates/gemm_tf32.py), with the elementwise region after it fused on its stores. Left to
cuBLAS's fp32 path they run on the CUDA cores (about 50 TFLOP/s on the H200). The plain plan keeps
cuBLAS, the tuned one takes our kernel, a failing one goes back to cuBLAS in a repair. Knobs and edits:
gemm_kit.py (tiles 128 x 128, 64 and 32, 32 deep; templates/gemm_tf32.py says why not 256). A row-major
B is made K-major by a tiled transpose before the kernel (tf32 WGMMA reads K-major operands only).

Grids of few tiles: K may be split over `splits` blocks a tile, each summing its share into an fp32
workspace slice; one small kernel then adds the slices in order and computes the fused epilogue on the
total (ViT's bias adds, a residual). The tuned plan takes the tile width (128, 64 or 32) and the split
that a cost model puts first: waves of blocks (one block an SM) x k tiles a block x the time of a k tile
at that width, measured on an H100 (KTILE_US; docs/benchmarks.md). Four times the width costs a k tile
twice the time (A's loads and split, the barriers and three short MMA chains are paid at any width), so
wide tiles win wherever there are tiles to fill the GPU, and narrower ones where a wide grid would leave
SMs idle (level 3's ViT, 394 rows: 128 x 64 for its 1536- and 2048-wide layers). The more_parallelism /
resize_grid edits offer half and twice the split and the next narrower tile, on grids of few tiles
(gemm_kit.FEW_TILES: on level 1's large GEMMs they lost every time); coarsen_threads the next wider.

A grid of more than a wave of tiles, K whole, is walked by a persistent grid in the tuned plan (one
block an SM, the ring running on across its tiles: templates/gemm_tf32.py), its ring a stage under the
deepest: hedged all the same (the first batch times a block a tile beside it); persistent_grid toggles it.

Where K is whole and at least F16_MIN_K, the tuned plan takes the fp16x3 form instead (`f16`:
templates/gemm_f16x3.py): the operands scaled by powers of two a row (A) and a column (B), split into
fp16 halves by our kernel, three fp16 products at twice tf32's rate, as accurate as 3xTF32; a block a
tile. use_tensor_cores toggles it (back to 3xTF32 as the tuned plan sets it), and the first batch times
that hedge. A split plan keeps its split in the form (reached by that edit only: not timed yet);
persistent_grid walks an fp16x3 grid of more than a wave persistently (written 2026-12-07, not yet timed: the
tuned plan keeps a block a tile, and a short K keeps 3xTF32's persistent grid).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert.families import common, gemm_kit, gemm_skinny
from pipeline.generate.expert.families.base import change
from pipeline.generate.expert.families.gemm_kit import GemmPlan
from pipeline.generate.expert.plan import Plan
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates import gemm, gemm_f16x3, gemm_tf32
from pipeline.generate.expert.templates.gemm import Form


@dataclass(frozen=True)
class Tf32Plan(GemmPlan):
    TAG: ClassVar[str] = "wgmma_3xtf32"
    BK: ClassVar[int] = gemm_tf32.BK

    splits: int = 1  # K split across this many blocks a tile (split-K), their partials summed after
    persistent: bool = False  # one block an SM walking its tiles, the ring running on across them
    staged: bool = False  # stores through shared memory in whole 16-byte row pieces (gemm.staged_store)
    # three fp16 products of operands scaled by powers of two and split by our kernel first, in place of
    # three tf32 ones (templates/gemm_f16x3.py): twice the MMA rate at the same accuracy; a block a tile
    # (its split of K kept) or persistent, unstaged stores
    f16: bool = False

    def describe(self) -> str:
        split = f" split-K={self.splits}" if self.splits > 1 else ""
        base = super().describe()
        if self.f16:  # its k tiles are 64 fp16 deep
            base = base.replace(f"x{self.BK} ", f"x{gemm_f16x3.BK} ", 1)
        return (
            base
            + split
            + (" persistent" if self.persistent else "")
            + (" staged stores" if self.staged else "")
            + (" fp16x3" if self.f16 else "")
        )


def _form(r: Region, low: Lowered) -> Form | str:
    """The operands' form, else why not: a linear layer over few rows is the CUDA cores' (gemm_skinny.py)."""
    f = gemm_kit.form(r, low, SPEC)
    if not isinstance(f, str) and not isinstance(rows := gemm_skinny.form(r, low), str):
        return f"{rows} rows: the CUDA cores' (families/gemm_skinny.py)"
    return f


SPEC = gemm_kit.Spec(
    knobs=Tf32Plan,
    dtypes=("float32",),
    what="fp32",
    align=4,
    tiles=lambda f: gemm_tf32.TILE_N,
    max_stages=lambda bn, f: gemm_tf32.max_stages(bn),
    render=gemm_tf32.render,
    kernel="3xTF32 WGMMA kernel (fp32 accuracy on the tensor cores)",
    plain_widest=True,
    form_of=_form,
    order=21,
    grid_tiles=lambda r, low, f, bn: tk[0] if (tk := _tiles_and_ktiles(r, low, bn)) else 0,
)
WAVE = common.SMS  # one block an SM (384 threads and ~200 KB of shared memory a block)
MIN_SHARE = 4 * gemm_tf32.PROMOTE  # k tiles a split keeps at least (512 of K), so its ring fills
# A block's time a k tile (32 of K) at each tile width, microseconds, measured on an H100: ViT's
# (394, 512) x (512, 1536) and (2048, 512) layers, one block an SM, A split in registers (docs/benchmarks.md,
# 2026-12-06 afternoon); the block's fixed costs (launch, the ring's first fill, the stores) are in it. A
# split adds its sum kernel: a short launch, and the partials written and read again (8 bytes an output
# element a split) at about 3 TB/s.
KTILE_US = {32: 0.94, 64: 1.33, 128: 1.85}
SUM_US, SPLIT_BYTES_PER_US = 3.0, 3.0e6
# The persistent grid measured on the H200 against a block a tile, same runs (docs/benchmarks.md, 2026-12-07):
# level 1's small-K product (32768 x 64 x 32768) 2.07 against 3.35 ms, its other 3xTF32 products 2-4% faster,
# Swin's layers 2-11%; and with a ring of 4 stages (128 x 128) in place of 5, 2-4% faster again on all seven
# shapes timed both ways (a stage less leaves the SM more L1 beside shared memory): its ring's stages under
# the deepest.
PERSIST_SHALLOWER = 1
# K from which the tuned plan takes the fp16x3 form (8 of its 64-deep k tiles). Measured on the H200
# (docs/benchmarks.md, 2026-12-07): 4096^3 1.18 -> 0.74 ms (linear) and 1.22 -> 0.87 ms (mm, B split and
# transposed), 8192^3 10.1 -> 5.6 ms, level 1's batched product (K = 1024) 3.12 -> 2.88 ms.
F16_MIN_K = 512


def _tiles_and_ktiles(r: Region, low: Lowered, bn: int = gemm_tf32.TILE_N[-1]) -> tuple[int, int, int] | None:
    """Output tiles (128 x bn), k tiles and output elements of the region's GEMM, from the graph's static
    shapes."""
    a, b = (low.by_name.get(getattr(v, "name", "")) for v in r.node.args[:2])
    if a is None or b is None or not a.shape or not b.shape:
        return None
    f = gemm_kit.form(r, low, SPEC)
    if isinstance(f, str):
        return None
    k = a.shape[-1]
    n = b.shape[0] if f.b_major == "K" else b.shape[-1]
    batch, m = (math.prod(a.shape[:-2]), a.shape[-2]) if f.batched else (1, math.prod(a.shape[:-1]))
    bm = gemm_tf32.BM
    return batch * -(-m // bm) * -(-n // bn), -(-k // gemm_tf32.BK), batch * m * n


def _splits(ktiles: int) -> list[int]:
    """The powers of two K may be split into, each split keeping MIN_SHARE k tiles."""
    out, s = [1], 2
    while s <= gemm_tf32.MAX_SPLITS and ktiles // s >= MIN_SHARE:
        out.append(s)
        s *= 2
    return out


def cost_us(tk: tuple[int, int, int], bn: int, splits: int) -> float:
    """The model's time of a GEMM of (tiles of 128 x bn, k tiles, output elements), K split `splits` ways."""
    tiles, ktiles, outputs = tk
    waves = -(-tiles * splits // WAVE)
    mma = waves * -(-ktiles // splits) * KTILE_US[bn]
    return mma + (SUM_US + 8 * splits * outputs / SPLIT_BYTES_PER_US if splits > 1 else 0.0)


def _best_split(tk: tuple[int, int, int], bn: int) -> tuple[float, int]:
    """(the model's time, the split) of the fastest split at this tile width; ties to the smaller split."""
    return min((cost_us(tk, bn, s), s) for s in _splits(tk[1]))


def wave_plan(r: Region, low: Lowered) -> tuple[int, int]:
    """(tile width, split) the cost model puts first; the widest tile, unsplit, when shapes are unknown.
    Ties go to the wider tile and the smaller split."""
    best: tuple[float, int, int] | None = None
    for bn in reversed(gemm_tf32.TILE_N):
        tk = _tiles_and_ktiles(r, low, bn)
        if tk is None:
            return gemm_tf32.TILE_N[-1], 1
        t, s = _best_split(tk, bn)
        if best is None or t < best[0] - 1e-9:
            best = (t, bn, s)
    assert best is not None
    return best[1], best[2]


def wave_split(r: Region, low: Lowered, bn: int = gemm_tf32.TILE_N[-1]) -> int:
    """The split the cost model puts first at this tile width."""
    tk = _tiles_and_ktiles(r, low, bn)
    return 1 if tk is None else _best_split(tk, bn)[1]


def _split_edit(edit: str) -> Any:
    def apply(plan: Plan, rp: Tf32Plan | None, r: Region, low: Lowered) -> Any:
        if rp is None:
            return
        tk = _tiles_and_ktiles(r, low, rp.bn)
        if tk and tk[0] >= gemm_kit.FEW_TILES and rp.splits == 1:
            return  # a grid of many tiles: a split only adds its partials' traffic and the sum kernel
        best, ktiles = wave_split(r, low, rp.bn), tk[1] if tk else 0
        for s in dict.fromkeys((best, best // 2, best * 2, 1)):
            if s != rp.splits and 1 <= s <= gemm_tf32.MAX_SPLITS and (s == 1 or ktiles // s >= MIN_SHARE):
                off = {"persistent": False} if rp.persistent and s > 1 else {}  # a split keeps K apart
                yield from change(edit, plan, rp, splits=s, **off)

    return apply


def persistent_pays(r: Region, low: Lowered, bn: int, splits: int) -> bool:
    """The tuned plan's bet: a grid of more than a wave of tiles, K whole, walked by one block an SM. Some
    block then has a second tile, whose loads run under the first one's stores, and its launch, barrier
    set-up and first fill are not paid again (Swin's fc2, 245 tiles: 5% faster so, H200, two passes)."""
    tk = _tiles_and_ktiles(r, low, bn)
    return splits == 1 and tk is not None and tk[0] > WAVE


def _persistent_edit(plan: Plan, rp: Tf32Plan | None, r: Region, low: Lowered) -> Any:
    """persistent_grid: one block an SM walking its tiles (K whole), or back to a block a tile."""
    if rp is not None and (rp.persistent or persistent_pays(r, low, rp.bn, rp.splits)):
        yield from change("persistent_grid", plan, rp, persistent=not rp.persistent)


STAGED_DT = "float32"  # the staging's size taken at fp32 outputs' (a 16-bit output's is half): it fits either


def _unstageable(rp: Tf32Plan) -> str:
    """Why the family does not stage this plan's stores, or "": the template's reasons, and a persistent
    grid with a fused epilogue (Swin's fc1 with its GELU spilled 12 bytes at 168 registers: the next
    tile's zeroed accumulators stay live beside the sums and the staging)."""
    if rp.persistent and rp.epilogue:
        return "a persistent grid's staged stores with a fused epilogue spill"
    return gemm_tf32.why_unstaged(rp, STAGED_DT)


def _stores_edit(plan: Plan, rp: Tf32Plan | None, r: Region, low: Lowered) -> Any:
    """coalesce_accesses: the stores through shared memory in whole 16-byte row pieces, or back to each
    thread's own pairs; the ring a stage shallower where the staging would not fit beside it. The
    accumulators' layout puts 8 bytes of 8 rows in a warp's store; a K of 64 or 96 (level 1's small-K
    product, Swin's stage-1 layers) leaves a tile's stores about as long as its MMAs."""
    if rp is None:
        return
    if rp.staged:
        yield from change("coalesce_accesses", plan, rp, staged=False)
        return
    top = gemm_tf32.max_stages(rp.bn, gemm.staging_bytes(STAGED_DT))
    staged = dataclasses.replace(rp, staged=True, stages=min(rp.stages, top))
    if staged.stages >= 2 and not _unstageable(staged):
        yield from change("coalesce_accesses", plan, rp, staged=True, stages=staged.stages)


def f16_pays(r: Region, low: Lowered, splits: int) -> bool:
    """The tuned plan's bet on the fp16x3 form: K whole and long enough (F16_MIN_K) that a tile's set-up and
    stores are a small part of it. Where the cost model splits K over few tiles, or K is short and a
    persistent grid pays (level 1's K = 64 product: 2.07 against 3.35 ms a block a tile), 3xTF32 stays."""
    tk = _tiles_and_ktiles(r, low)
    return splits == 1 and tk is not None and tk[1] * gemm_tf32.BK >= F16_MIN_K


def _tf32_tuned(r: Region, low: Lowered, rp: Tf32Plan) -> dict[str, Any]:
    """The knobs the tuned plan gives 3xTF32 at this tile width: the cost model's split, a persistent grid
    where it pays, its ring (the deepest; a persistent grid's one stage under it: 2-4% faster on seven
    shapes, H200)."""
    splits = wave_split(r, low, rp.bn)
    persistent = persistent_pays(r, low, rp.bn, splits)
    top = gemm_tf32.max_stages(rp.bn)
    return {"splits": splits, "persistent": persistent,
            "stages": max(2, top - PERSIST_SHALLOWER) if persistent else top}  # fmt: skip


def _f16_edit(plan: Plan, rp: Tf32Plan | None, r: Region, low: Lowered) -> Any:
    """use_tensor_cores on our kernel: its three products in fp16 at twice tf32's rate (a block a tile, its
    split kept, unstaged stores; persistent_grid walks its tiles from there), or back to tf32's as the tuned
    plan sets it."""
    if rp is None:
        return
    if rp.f16:
        yield from change("use_tensor_cores", plan, rp, f16=False, **_tf32_tuned(r, low, rp))
    else:
        stages = min(rp.stages, gemm_f16x3.max_stages(rp.bn))
        yield from change(
            "use_tensor_cores", plan, rp, f16=True, persistent=False, staged=False, stages=stages
        )


def _unusable(q: Tf32Plan) -> bool:
    """A plan no template renders: staged stores it cannot take; an fp16x3 plan with staged stores."""
    if q.staged and _unstageable(q):
        return True
    return q.f16 and q.staged


def _staging_kept(edit: Any) -> Any:
    """An edit's moves less those whose plan no template renders (_unusable); an fp16x3 plan's ring no
    deeper than its stages fit (a wider tile's move keeps the 3xTF32 ring's depth)."""

    def moves(plan: Plan, rp: Tf32Plan | None, r: Region, low: Lowered) -> Any:
        for name, p in edit(plan, rp, r, low):
            q = p.get(r.rid)
            if isinstance(q, Tf32Plan) and _unusable(q):
                continue
            if isinstance(q, Tf32Plan) and q.f16 and q.stages > (top := gemm_f16x3.max_stages(q.bn)):
                p = p.replace(dataclasses.replace(q, stages=top))
                if p == plan:
                    continue
            yield name, p

    return moves


def _family() -> Any:
    base = gemm_kit.family(SPEC)

    def settle(plan: Plan, r: Region, low: Lowered, tuned: bool) -> Plan:
        plan = base.settle(plan, r, low, tuned)
        rp = plan.get(r.rid)
        if tuned and isinstance(rp, Tf32Plan):
            bn, splits = wave_plan(r, low)
            rp = dataclasses.replace(rp, bn=bn)
            if f16_pays(r, low, splits):
                f16 = dataclasses.replace(rp, f16=True, splits=1, persistent=False)
                return plan.replace(dataclasses.replace(f16, stages=gemm_f16x3.max_stages(bn)))
            plan = plan.replace(dataclasses.replace(rp, **_tf32_tuned(r, low, rp)))
        return plan

    edits = dict(base.edits)
    for name in ("more_parallelism", "resize_grid"):
        tile, split = base.edits[name], _split_edit(name)

        def both(plan: Plan, rp: Any, r: Region, low: Lowered, tile: Any = tile, split: Any = split) -> Any:
            yield from tile(plan, rp, r, low)
            yield from split(plan, rp, r, low)

        edits[name] = both
    edits["persistent_grid"] = _persistent_edit
    take = base.edits["use_tensor_cores"]

    def tensor_cores(plan: Plan, rp: Any, r: Region, low: Lowered) -> Any:
        yield from take(plan, rp, r, low)
        yield from _f16_edit(plan, rp, r, low)

    edits["use_tensor_cores"] = tensor_cores
    edits["coalesce_accesses"] = _stores_edit
    edits = {name: _staging_kept(edit) for name, edit in edits.items()}

    # the persistent grid won wherever it was timed (H200), on few shapes yet: the first batch times its
    # undoing; likewise 3xTF32 beside the fp16x3 form
    def hedges(rp: Any) -> tuple[str, ...]:
        if not isinstance(rp, Tf32Plan):
            return ()
        return ("persistent_grid",) if rp.persistent else ("use_tensor_cores",) if rp.f16 else ()

    return dataclasses.replace(base, edits=edits, settle=settle, hedges=hedges)


FAMILY = _family()


def form(r: Region, low: Lowered) -> Form | str:
    """The operands' form when our 3xTF32 kernel can compute this library region, else why not."""
    return _form(r, low)


__all__ = ["FAMILY", "SPEC", "Tf32Plan", "form"]
