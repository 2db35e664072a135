"""The offline expert policy: deterministic, rule-based CUDA from the task's PyTorch reference.

First kernels: a plain plan and a tuned one. Children: one legal edit of the parent's plan (read back from
the first line of its CUDA source), the profiler's suggested edits first. Repairs: the changed regions go
back to the plainest parameters. Ops no template covers are left to PyTorch in the launcher (the
candidate is then hybrid, and the proposal's notes say so); a task with nothing we cover is UNSUPPORTED.
"""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path
from typing import Any

from pipeline.candidates import make_candidate
from pipeline.generate.base import Context, Outcome, Proposal, ProposalStatus
from pipeline.generate.expert import edits
from pipeline.generate.expert.families import FAMILIES, family_of
from pipeline.generate.expert.graph import CaptureError, Graph, capture, capture_source, decomposable
from pipeline.generate.expert.plan import Plan, plan_of
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.render import RenderError, nvcc_flags, prepare, render
from pipeline.static_check import check_launcher
from pipeline.types import Candidate, Task


class ExpertPolicy:
    name = "expert"

    def __init__(self, hunter: Any = None):
        self.hunter = hunter  # index.hunt.Hunter: finds the GEMM's atoms (the installed headers without it)

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        low, why = _lowered(ctx.task)
        if low is None:
            return [Proposal(ProposalStatus.UNSUPPORTED, reason=why)]
        notes = _notes(low, ctx.arch)
        parent_plan = plan_of(ctx.parent.source) if ctx.parent is not None else None
        parent_key = ctx.parent.key if ctx.parent is not None else ""  # the root's key in the search memory
        done = {t.edit for t in ctx.tried if t.parent == parent_key}
        energy = ctx.extra.get("objective") in ("energy", "edp")
        if ctx.parent is None or parent_plan is None:
            # First kernels: plain, tuned, then the tuned plan with one edit each (for a widening root); under
            # an energy objective the power edits come first among those, or a short run never makes them.
            tuned = edits.base_plan(low, True)
            start = [("expert: plain kernels", edits.base_plan(low, False)), ("expert: tuned kernels", tuned)]
            start += [
                (f"expert: tuned kernels, {label}", p)
                for label, p in edits.legal_edits(tuned, low, energy=energy)
            ]
            if ctx.parent is not None:  # a parent the expert did not write: offer its own first kernels
                start = [(f"{label} (rewrite of a foreign parent)", p) for label, p in start]
            start = [(label, p) for label, p in start if label not in done]
            return _proposals(
                ctx, start, n, notes, empty="no kernel could be written for this task", hunter=self.hunter
            )
        suggested = [e for f in ctx.findings for e in f.edits]
        seed = ctx.extra.get("blind_seed")  # no advice: the edits in an order drawn per run and parent
        blind = None if seed is None else random.Random(f"{seed}:{parent_key}")
        moves = [
            (label, p)
            for label, p in edits.legal_edits(parent_plan, low, suggested, blind, energy)
            if label not in done
        ]
        made = {label.split("(", 1)[0] for label, _ in moves}
        skipped = sorted({e for e in suggested if e in edits.NOT_APPLICABLE and e not in made})
        notes += tuple(f"{e} not applicable: {edits.NOT_APPLICABLE[e]}" for e in skipped)
        if not moves:
            return [
                Proposal(
                    ProposalStatus.NO_MOVE, reason="every legal edit of this plan was tried", notes=notes
                )
            ]
        return _proposals(
            ctx, moves, n, notes, empty="no edit of this plan renders a valid candidate", hunter=self.hunter
        )

    def repair(self, ctx: Context, failed: Candidate, outcome: Outcome) -> Proposal:
        low, why = _lowered(ctx.task)
        if low is None:
            return Proposal(ProposalStatus.UNSUPPORTED, reason=why)
        plan = plan_of(failed.source)
        if plan is None:
            return Proposal(
                ProposalStatus.NO_MOVE, reason="the failed candidate was not written by the expert"
            )
        parent_plan = plan_of(ctx.parent.source) if ctx.parent is not None else None
        safe = edits.safer(plan, parent_plan)
        if safe == plan:
            safe = edits.safer(plan, None)
        if safe == plan:
            return Proposal(
                ProposalStatus.NO_MOVE, reason=f"already the plainest plan; it failed with {outcome.status}"
            )
        # entries that changed, or went back to the library (which drops them)
        changed = [rp.rid for rp in plan.regions if safe.get(rp.rid) != rp]
        label = f"repair: plain parameters for {', '.join(changed)} after {outcome.status}"
        if safe == parent_plan:
            return Proposal(
                ProposalStatus.NO_MOVE,
                reason=f"the plainest form of this edit is the parent itself; it failed with {outcome.status}",
            )
        return _proposals(
            ctx,
            [(label, safe)],
            1,
            _notes(low, ctx.arch),
            empty="the repair plan does not render",
            hunter=self.hunter,
        )[0]


def _proposals(
    ctx: Context,
    plans: list[tuple[str, Plan]],
    n: int,
    notes: tuple[str, ...],
    empty: str,
    hunter: Any = None,
) -> list[Proposal]:
    low, _ = _lowered(ctx.task)
    assert low is not None
    out: list[Proposal] = []
    seen: set[str] = set(ctx.known)  # the search's candidates: rendered again, they are not counted
    errors: list[str] = []
    repeats = 0
    base = ctx.parent  # a repair is a sibling of what it repairs: the same parent
    for label, plan in plans:
        if len(out) >= n:
            break
        plan = edits.for_arch(plan, ctx.arch)  # e.g. WGMMA and TMA need Hopper: cuBLAS before it
        try:
            source, launcher = _render(ctx.task, low, plan, hunter)
        except RenderError as e:
            errors.append(f"{label}: {e}")
            continue
        report = check_launcher(launcher)
        if not report.ok:  # a template bug, never the user's: say so rather than hand the loop a reject
            errors.append(f"{label}: launcher fails the static check: {report.violations[0]}")
            continue
        flags = nvcc_flags(plan)
        used = tuple(dict.fromkeys(re.findall(r"^// building block: (\S+)", source, re.M)))
        cand = make_candidate(
            ctx.task.id, source, launcher, flags, parent=base.key if base else None, edit=label, blocks=used
        )
        if cand.key in seen:
            repeats += cand.key in ctx.known
            continue
        seen.add(cand.key)
        rationale = "; ".join(rp.describe() for rp in plan.regions if rp.rid not in plan.fused())
        out.append(Proposal(ProposalStatus.OK, cand, edit=label, reason=rationale, notes=notes))
    if not out:
        if repeats and not errors:
            empty = f"duplicate of an earlier candidate: each of its {repeats} moves gives one in the tree"
        return [Proposal(ProposalStatus.NO_MOVE, reason="; ".join([empty, *errors[:3]]), notes=notes)]
    return out


def _computed_by_us(r: Region, low: Lowered, arch: str | None = None) -> bool:
    """A region one of our templates computes (in some plan: a GEMM may stay in cuBLAS in the plain one),
    on `arch` when given (a WGMMA GEMM does not run before Hopper)."""
    family = family_of(r, low)
    return family is not None and (arch is None or family.runs_on(arch))


def _notes(low: Lowered, arch: str | None = None) -> tuple[str, ...]:
    notes = list(low.notes)
    for family in FAMILIES:
        if arch is not None and not family.runs_on(arch):
            continue
        claimed = [r for r in low.regions if family_of(r, low) is family]
        if claimed and (line := family.note(claimed, low)):
            notes.append(line)
    lib = [r for r in low.regions if r.kind is RegionKind.LIBRARY]
    kept = [r.node.target for r in lib if not _computed_by_us(r, low, arch)]
    if kept:
        notes.append(
            f"left to cuBLAS/cuDNN (hybrid): {', '.join(kept)}; everything after them runs in our kernels"
        )
    return tuple(dict.fromkeys(notes))


_LOWERED: dict[str, tuple[Lowered | None, str]] = {}
# The last plans rendered, by task and plan: the search renders a node's first moves before its profile and
# again after it (a level-3 plan takes seconds). Not with a source hunter: its picks may change the source.
_RENDERED: dict[tuple[str, str], tuple[str, str] | str] = {}
_RENDERED_MAX = 64


def _render(task: Task, low: Lowered, plan: Plan, hunter: Any) -> tuple[str, str]:
    """render(), remembered; raises RenderError as it does."""
    if hunter is not None:
        return render(low, plan, hunter)
    key = (task.source_hash or task.path, plan.to_json())
    hit = _RENDERED.get(key)
    if hit is None:
        try:
            hit = render(low, plan, hunter)
        except RenderError as e:
            hit = str(e)
        if len(_RENDERED) >= _RENDERED_MAX:
            del _RENDERED[next(iter(_RENDERED))]  # the oldest
        _RENDERED[key] = hit
    if isinstance(hit, str):
        raise RenderError(hit)
    return hit


def _lowered(task: Task) -> tuple[Lowered | None, str]:
    key = task.source_hash or task.path
    if key not in _LOWERED:
        _LOWERED[key] = _analyse(task.path, task.source, task.id)
    return _LOWERED[key]


def _capture(path: str, source: str, task_id: str, decompose: frozenset[str] = frozenset()) -> Graph:
    p = Path(path)
    if p.is_file() and p.read_text() == source:
        return capture(p, task_id, decompose)
    return capture_source(source, task_id, decompose)


def _left(low: Lowered) -> list[str]:
    """The ops of the regions left to PyTorch: no family of ours computes them, and no kernel of the tuned
    plan absorbs them (attention takes a dropout of p = 0 in training mode: nothing to decompose there)."""
    left = [r for r in low.regions if r.kind is RegionKind.TORCH and not _computed_by_us(r, low)]
    if not decomposable(r.node.target for r in left):  # the plan is built only when it can matter
        return [r.node.target for r in left]
    absorbed = edits.base_plan(low, True).fused()
    return [r.node.target for r in left if r.rid not in absorbed]


def _decompose(path: str, source: str, task_id: str, low: Lowered) -> Lowered:
    """The task with each op no template covers replaced by PyTorch's own decomposition of it (glu, logit,
    nan_to_num, outer, pixel_shuffle, the margin losses, ...), where that leaves fewer regions to PyTorch:
    the parts are ops our kernels compute. A decomposition into ops we lack is not taken, unless those
    decompose in turn (pairwise_distance into a norm, the norm into ours)."""
    done: frozenset[str] = frozenset()
    notes: list[str] = []
    left = _left(low)
    best, best_left = low, len(left)
    cur = low
    for _ in range(4):  # a decomposition may bring ops that decompose further
        more = decomposable(left) - done
        if not more:
            break
        try:
            other = prepare(_capture(path, source, task_id, done | more))
            left_other = _left(other)
            worse = len(left_other) > len(left) or (
                len(left_other) == len(left) and not decomposable(left_other) - done - more
            )
            if not worse and len(left_other) < best_left:  # a part PyTorch keeps must still be writable
                worse = not check_launcher(render(other, edits.base_plan(other, False))[1]).ok
        except Exception:  # an optional step: whatever fails in it, the task stays as it was read
            break
        if worse:
            break
        done |= more
        notes.append(
            f"{', '.join(sorted(more))} decomposed by PyTorch's own rule into ops our kernels compute"
        )
        cur, left = dataclasses.replace(other, notes=(*other.notes, *notes)), left_other
        if len(left) < best_left:
            best, best_left = cur, len(left)
    return best


def analyse(path: str | Path) -> tuple[Lowered | None, str]:
    """The task file as the policy lowers it (decompositions included), or None and why not: what a caller
    rendering the policy's plans itself must render them against."""
    p = Path(path)
    return _analyse(str(p), p.read_text(), p.stem)


def _analyse(path: str, source: str, task_id: str) -> tuple[Lowered | None, str]:
    try:
        graph = _capture(path, source, task_id)
    except CaptureError as e:
        return None, f"the expert cannot read this reference: {e}"
    low = _decompose(path, source, task_id, prepare(graph))
    ours = [r for r in low.regions if _computed_by_us(r, low)]
    if not ours:
        lib = [f"{r.node.target} stays in the library: {_why_library(r, low)}" for r in low.regions
               if r.kind is RegionKind.LIBRARY]  # fmt: skip
        why = [*low.notes, *lib] or ["the reference is only views"]
        return None, f"nothing for our kernels to compute: {'; '.join(why)}"
    return low, ""


def _why_library(r: Region, low: Lowered) -> str:
    """Why no template of ours takes a library region: the reason of the product family its op belongs to."""
    from pipeline.generate.expert.families import gemm16, gemm_kit, gemm_tf32, grouped_gemm

    none = "no template of ours computes it (cuBLAS/cuDNN do)"
    if r.node.op == "gemm_grouped":
        family: Any = grouped_gemm
    elif r.node.op in gemm_kit.OPS:
        family = gemm16 if r.node.dtype in ("bfloat16", "float16") else gemm_tf32
    else:
        return none
    why = family.form(r, low)
    return why if isinstance(why, str) else none


def supports(task_path: str | Path) -> tuple[bool, str]:
    """Whether the expert can write kernels for a task, and a one-line reason or summary."""
    path = Path(task_path)
    try:
        source = path.read_text()
    except OSError as e:
        return False, f"cannot read the task: {e}"
    low, why = _analyse(str(path), source, path.stem)
    if low is None:
        return False, why
    try:
        _, launcher = render(low, edits.base_plan(low, False))
    except RenderError as e:
        return False, f"the expert cannot write a launcher for it: {e}"
    report = check_launcher(launcher)
    if not report.ok:
        return False, f"the expert's launcher fails the static check: {report.violations[0]}"
    # a region PyTorch would compute that a family of ours takes (a pool, a copy) is named by its family
    kinds = [str(r.kind) if r.kind is not RegionKind.TORCH else family_of(r, low).tag  # type: ignore[union-attr]
             for r in low.regions if _computed_by_us(r, low)]  # fmt: skip
    summary = f"{len(kinds)} region(s) in our kernels ({', '.join(dict.fromkeys(kinds))})"
    extra = [n for n in _notes(low)]
    # The tuned plan is the search's other start: a launcher of it that does not pass is an expert bug,
    # said here (the plain plan still writes the task).
    try:
        tuned = check_launcher(render(low, edits.base_plan(low, True))[1])
        if not tuned.ok:
            extra.append(f"{TUNED_BROKEN}: its launcher fails the static check: {tuned.violations[0]}")
    except RenderError as e:
        extra.append(f"{TUNED_BROKEN}: it cannot be written: {e}")
    return True, "; ".join([summary, *extra])


TUNED_BROKEN = "the tuned plan is broken"
