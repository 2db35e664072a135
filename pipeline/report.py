"""The report of one run, from its log alone: Markdown (for the terminal and the run folder) and HTML with
plots: every evaluation against the baselines and the roofline floor, the candidates against the measured
ceilings, time against energy per call (the Pareto front and the saving at matched speed), the search tree
coloured by status, energy per call and the environment. `kernelpro show <run-id>`
renders it in memory (`render`), so a report never disagrees with its log and reading one writes nothing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.calibrate import Ceilings
from pipeline.runlog import RunLogError, read_events
from pipeline.runstate import ROOT, MalformedEvent, NodeState, NotOneTree, Point, RunState, fold
from pipeline.search import matched
from pipeline.search.reward import Objective
from pipeline.types import Baselines, Status, Timing, speedup

TEMPLATES = Path(__file__).resolve().parent / "templates"
PENDING = "pending"  # a node proposed and not evaluated (yet)
# One colour per status, shared by the plots and the HTML (every Status has one, and "pending").
COLOURS = {
    Status.OK.value: "#2e7d32",
    Status.MISMATCH.value: "#ef6c00",
    Status.SUSPICIOUS.value: "#c0a000",
    Status.COMPILE_ERROR.value: "#c62828",
    Status.COMPILE_TIMEOUT.value: "#8d4a2a",
    Status.LAUNCH_ERROR.value: "#ad1457",
    Status.CRASH.value: "#6a1b9a",
    Status.TIMEOUT.value: "#4527a0",
    Status.REJECTED.value: "#616161",
    PENDING: "#9e9e9e",
}


@dataclass(frozen=True)
class RunView:
    run_id: str
    state: RunState
    exported: bool = False  # a standalone best_model_new.py beside the log

    @property
    def baselines(self) -> Baselines:
        return self.state.baselines or Baselines({})


@dataclass(frozen=True)
class Report:
    markdown: str
    html: str


def load_view(folder: Path) -> RunView:
    """The run's state, from the one fold of its events; a log that does not fold is a RunLogError in one
    line."""
    folder = Path(folder)
    try:
        state = fold(read_events(folder / "log.jsonl"))
    except NotOneTree as e:
        raise RunLogError(f"run {folder.name}: its log does not make one search tree: {e}") from None
    except MalformedEvent as e:
        raise RunLogError(
            f"run {folder.name}: an event in its log lacks what the report needs ({e})"
        ) from None
    return RunView(folder.name, state, (folder / "best_model_new.py").is_file())


def _status(n: NodeState) -> str:
    return n.status.value if n.status else PENDING


def _edit(n: NodeState) -> str:
    return "reference (PyTorch eager)" if n.id == ROOT else n.edit


def _kind(n: NodeState) -> str:
    kind = n.evaluation.verdict.kind if n.evaluation else None
    return kind.value if kind else ""


def _bound(n: NodeState) -> str:
    return n.profile.bound if n.profile else ""


def _best(view: RunView) -> NodeState | None:
    """The fastest over eager; under energy and edp the run's choice at matched speed."""
    chosen = _chosen(view)
    if chosen is not None and _objective(view) is not Objective.TIME:
        return view.state.nodes[chosen.node]
    ok = [n for n in view.state.nodes.values() if n.id and n.status == Status.OK and n.speedup]
    return max(ok, key=lambda n: (n.speedup, -n.id), default=None)


def _objective(view: RunView) -> Objective:
    try:
        return Objective(view.state.header.config.get("objective") or "time")
    except ValueError:
        return Objective.TIME


def _tolerance(view: RunView) -> float:
    """The run's --speed-tolerance; the default for logs written before it existed."""
    try:
        return float(view.state.header.config.get("speed_tolerance") or matched.DEFAULT_TOLERANCE)
    except ValueError:
        return matched.DEFAULT_TOLERANCE


def _eager_ms(view: RunView) -> float | None:
    eager = view.baselines.timings.get("eager")
    return eager.median_ms if eager else None


def _chosen(view: RunView) -> matched.Candidate | None:
    """The run's chosen candidate: the node its end names, else the choice the loop would make now (under
    energy and edp the lowest at matched speed, under time the fastest)."""
    cands = {c.node: c for c in view.state.at_speed()}
    end = view.state.end or view.state.last_end
    if end is not None and end.best_node in cands:
        return cands[end.best_node]
    pick = matched.choose(list(cands.values()), _objective(view), _eager_ms(view), _tolerance(view))
    return pick or matched.choose(list(cands.values()), Objective.TIME)


def _improvements(view: RunView) -> list[tuple[NodeState, NodeState]]:
    """(parent, child) pairs where the child beat its parent: the advice and edit that paid off."""
    out = []
    for n in sorted(view.state.nodes.values(), key=lambda n: n.id):
        if not n.id or n.parent is None or n.status != Status.OK or not n.speedup:
            continue
        p = view.state.nodes[n.parent]
        if p.speedup and n.speedup > p.speedup * 1.02:
            out.append((p, n))
    return out


def _tree_lines(view: RunView, nid: int = ROOT, depth: int = 0) -> list[str]:
    n = view.state.nodes[nid]
    sp = f"{n.speedup:.2f}x" if n.speedup else _status(n)
    lines = [f"{'  ' * depth}- #{n.id} {_edit(n)} — {sp}"]
    for c in n.children:
        lines += _tree_lines(view, c, depth + 1)
    return lines


def _ms(t: Timing | None) -> str:
    return f"{t.median_ms:.4f} ms" if t else "–"


def markdown(view: RunView) -> str:
    h, state = view.state.header, view.state
    timings = view.baselines.timings
    best = _best(view)
    lines = [f"# kernelpro run {view.run_id}", ""]
    lines.append(f"- task: `{h.task.get('id', '?')}` ({h.task_path})")
    lines.append(f"- policy: {h.policy}, search: {h.search}, objective: {h.config.get('objective')}")
    if h.replay:
        lines.append(f"- evaluations replayed from recordings: {', '.join(f'`{r}`' for r in h.replay)}")
    lines.append(f"- eager: {_ms(timings.get('eager'))}; torch.compile: {_ms(timings.get('compile'))}")
    if state.end:
        lines.append(f"- stopped: {state.end.reason}; {state.end.evaluations} evaluations")
    else:
        lines.append("- the run has not finished (interrupted or still running): resume it with `--resume`")
    u = state.usage
    if u.calls:
        lines.append(f"- LLM: {u.tokens:.0f} tokens, ${u.cost_usd:.2f}, {u.calls:.0f} requests")
    lines += ["", "## Best candidate", ""]
    if best is None or best.speedup is None or best.time_ms is None:
        lines.append("No correct candidate was faster than nothing: see the tree for the statuses.")
    else:
        comp = timings.get("compile")
        vs_comp = speedup(comp.median_ms if comp else None, best.time_ms)
        lines.append(f"- node #{best.id} `{best.key}` ({_kind(best) or 'custom'}): {best.time_ms:.4f} ms, "
                     f"{best.speedup:.2f}x over eager, {f'{vs_comp:.2f}x' if vs_comp else '–'} over torch.compile")  # fmt: skip
        floor = view.baselines.floor_ms
        if floor and best.time_ms:
            lines.append(
                f"- roofline: floor {floor:.4f} ms, the best kernel at {100 * floor / best.time_ms:.0f}% of it"
            )
        if _bound(best):
            lines.append(f"- stage-1 class: {_bound(best)}")
        m = state.final.evaluation.measurement if state.final else None
        if m:
            lines.append(
                f"- re-measured at the end: {m.timing.median_ms if m.timing else float('nan'):.4f} ms"
            )
            if m.energy:
                e = m.energy
                windows = f" ({_pct(e.spread)} over {e.repeats} windows)" if e.spread is not None else ""
                lines.append(
                    f"- energy: {1e3 * e.joules_per_call:.2f} mJ per call at {e.avg_power_w:.0f} W{windows}"
                )
        bm = best.evaluation.measurement if best.evaluation else None
        ran = (m.kernels if m and m.kernels else None) or (bm.kernels if bm else None)
        if ran:  # which of the launcher's paths ran on this card
            lines.append(f"- kernels in a call: {kernels_text(ran)}")
        files = ["`best/kernel.cu`", "`best/launcher.py`"]
        if view.exported:
            files.append("`best_model_new.py` (standalone drop-in `ModelNew`)")
        lines.append(f"- files: {', '.join(files)}")
    lines += ["", "## Energy at matched speed", "", *_matched_lines(view)]
    lines += ["", "## Best speedup over eager, by evaluation", ""]
    lines.append(" → ".join(f"{i}: {s:.2f}x" for i, s in _thin(state.curve)) or "no correct candidate yet")
    lines += ["", "## What paid off", ""]
    imps = _improvements(view)
    if not imps:
        lines.append("No child beat its parent.")
    for p, c in imps:
        why = p.top_finding or ("first kernels from the reference" if p.id == 0 else "no profile")
        lines.append(
            f"- #{p.id} → #{c.id}: `{c.edit}` ({p.speedup or 1:.2f}x → {c.speedup:.2f}x). Advice: {why}"
        )
    lines += ["", "## Search tree", "", *_tree_lines(view)]
    final_m = state.final.evaluation.measurement if state.final else None
    env = (final_m.environment if final_m else None) or view.baselines.environment
    if env:
        lines += ["", "## Environment", ""] + [f"- {k}: {v}" for k, v in sorted(env.items())]
    return "\n".join(lines) + "\n"


def kernels_text(us: dict[str, float], top: int = 3) -> str:
    """A call's longest kernels by their share of its GPU time (Measurement.kernels), the rest counted."""
    total = sum(us.values()) or 1.0
    longest = sorted(us.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"`{k}` {100 * v / total:.0f}% ({v / 1e3:.3g} ms)" for k, v in longest[:top])
    return text + (f", and {len(longest) - top} more" if len(longest) > top else "")


def _pct(spread: float | None) -> str:
    return f"± {100 * spread:.1f}%" if spread is not None else "(spread unknown)"


def _saving_text(what: str, base_j: float, base_spread: float | None, c: matched.Candidate) -> str:
    assert c.joules is not None
    s = matched.saving(base_j, base_spread, c.joules, c.spread)
    verdict = "beyond noise" if s.beyond_noise else "within noise: not claimed"
    return f"- saving against {what}: {s.ratio:.3f}x {_pct(s.spread)} ({verdict})"


def _matched_lines(view: RunView) -> list[str]:
    """The chosen candidate's energy against eager and against the fastest candidate, at matched speed,
    each with its spread, and the Pareto front; one line when the candidates have no energy readings."""
    cands = view.state.at_speed()
    read = [c for c in cands if c.joules is not None]
    if not read:
        return [NO_ENERGY]
    tol, eager_ms = _tolerance(view), _eager_ms(view)
    top = matched.fastest(cands, eager_ms)
    fast = min(cands, key=lambda c: (c.time_ms, c.node))
    lines = [f"- objective: {_objective(view).value}; at matched speed: within {100 * tol:g}% of the fastest "
             f"({top:.4f} ms{', eager' if top == eager_ms else f', node #{fast.node}'})"]  # fmt: skip
    chosen = _chosen(view)
    if chosen is None or chosen.joules is None:
        lines.append("- the chosen candidate has no energy reading: no saving to report")
    else:
        slower = 100 * (chosen.time_ms / top - 1) if top else 0.0
        pace = "at speed" if matched.at_speed(chosen.time_ms, top, tol) else "NOT at matched speed"
        lines.append(f"- chosen: node #{chosen.node} `{view.state.nodes[chosen.node].key}`: "
                     f"{1e3 * chosen.joules:.4g} mJ per call {_pct(chosen.spread)}, {chosen.time_ms:.4f} ms "
                     f"({slower:+.1f}% against the fastest, {pace})")  # fmt: skip
        eager_j = view.baselines.energy_eager_j
        eager_e = view.baselines.energy_eager
        if eager_j:
            lines.append(_saving_text("eager", eager_j, eager_e.spread if eager_e else None, chosen))
        else:
            lines.append("- saving against eager: eager's energy was not measured")
        if fast.node == chosen.node:
            lines.append("- saving against the fastest candidate: the chosen one is the fastest")
        elif fast.joules is not None:
            lines.append(
                _saving_text(f"the fastest candidate (node #{fast.node})", fast.joules, fast.spread, chosen)
            )
        else:
            lines.append(
                f"- saving against the fastest candidate (node #{fast.node}): it has no energy reading"
            )
    front = matched.pareto_front(cands)
    lines.append("- Pareto front (time, energy): " + ", ".join(
        f"#{c.node} ({c.time_ms:.4f} ms, {1e3 * (c.joules or 0):.4g} mJ)" for c in front))  # fmt: skip
    lines.append(f"- noise: energies closer than {matched.Z:g} standard errors (each at least "
                 f"{100 * matched.NOISE_FLOOR:g}%) are not ranked; the faster one wins")  # fmt: skip
    return lines


NO_ENERGY = (
    "No energy readings for the candidates (a run under `--objective time`, `--no-energy`, or no NVML): "
    "nothing to compare at matched speed."
)


def _thin(curve: list[tuple[int, float]], keep: int = 12) -> list[tuple[int, float]]:
    changes = [pt for i, pt in enumerate(curve) if i == 0 or pt[1] != curve[i - 1][1]]
    if curve and (not changes or changes[-1] != curve[-1]):
        changes.append(curve[-1])
    return changes[-keep:]


# -- plots (matplotlib, SVG inlined in the HTML) ----------------------------------------------------------


def svg(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})  # no timestamp: the same log, the same report
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


RC = {"svg.fonttype": "none", "svg.hashsalt": "kernelpro"}  # text stays text; ids are stable


def _baseline_speedups(view: RunView) -> dict[str, float]:
    """Speedups over eager of the fixed references: eager itself, torch.compile and the roofline floor."""
    timings = view.baselines.timings
    eager, comp = timings.get("eager"), timings.get("compile")
    out = {"eager": 1.0}
    vs_comp = speedup(eager.median_ms if eager else None, comp.median_ms if comp else None)
    if vs_comp:
        out["torch.compile"] = vs_comp
    vs_floor = speedup(eager.median_ms if eager else None, view.baselines.floor_ms)
    if vs_floor:
        out["roofline floor"] = vs_floor
    return out


def progress_svg(view: RunView) -> str:
    """Every evaluation as a point coloured by status, the best so far as a step, the references as lines."""
    if not view.state.points:
        return ""
    plt = pyplot()
    with plt.rc_context(RC):
        fig, ax = plt.subplots(figsize=(7, 3.4))
        seen: set[str] = set()
        for e in view.state.points:
            first = e.status not in seen
            seen.add(e.status)
            ax.scatter(
                [e.n],
                [e.speedup or 0.0],
                s=22,
                color=COLOURS.get(e.status, COLOURS["pending"]),
                zorder=3,
                clip_on=False,  # a failed evaluation sits on the axis, not half under it
                gid=f"eval-{e.n}",
                label=e.status if first else None,
            )
        if view.state.curve:
            xs, ys = zip(*view.state.curve, strict=True)
            ax.step(xs, ys, where="post", color="#1565c0", label="best so far", zorder=2)
        styles = {"eager": ("-", "#444"), "torch.compile": ("--", "#777"), "roofline floor": (":", "#b71c1c")}
        for name, y in _baseline_speedups(view).items():
            ls, colour = styles[name]
            ax.axhline(
                y, linestyle=ls, color=colour, linewidth=1, label=f"{name} ({y:.2f}x)", gid=f"line-{name}"
            )
        ax.set_xlabel("evaluation")
        ax.set_ylabel("speedup over eager")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        return svg(fig)


def roofline(view: RunView) -> tuple[str, str]:
    """(SVG, caption): the candidates' achieved rate against the task's arithmetic intensity and the GPU's
    measured ceilings when the run logged them; a bandwidth chart for a task that does no arithmetic."""
    task = view.state.header.task
    flops, nbytes = float(task.get("flops") or 0), float(task.get("min_bytes") or 0)
    timed = [e for e in view.state.points if e.status == Status.OK and e.time_ms]
    if not nbytes or not timed:
        why = "no correct, timed candidate" if nbytes else "the task gives no minimal byte count"
        return "", f"No roofline plot: {why}."
    timings = view.baselines.timings
    refs = {name: t.median_ms for name, t in (("eager", timings.get("eager")),
                                              ("torch.compile", timings.get("compile"))) if t}  # fmt: skip
    ceil = view.state.ceilings
    plt = pyplot()
    with plt.rc_context(RC):
        fig, ax = plt.subplots(figsize=(7, 3.6))
        draw = _flop_roofline if flops > 0 else _bandwidth_chart
        caption = draw(ax, view, timed, refs, ceil, flops, nbytes, task.get("dtype", "float32"))
        if ceil is None:
            caption += (
                " The run's log holds no measured ceilings (`kernelpro calibrate` on the GPU records them)."
            )
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        return svg(fig), caption


_REF_COLOURS = {"eager": "#444", "torch.compile": "#777"}


def _flop_roofline(ax: Any, view: RunView, timed: list[Point], refs: dict[str, float], ceil: Ceilings | None,
                   flops: float, nbytes: float, dtype: str) -> str:  # fmt: skip
    import numpy as np

    ai = flops / nbytes
    for e in timed:
        ax.scatter(
            [ai], [flops / (e.time_ms * 1e-3)], s=22, color=COLOURS[Status.OK], gid=f"roof-{e.n}", zorder=3
        )
    for name, ms in refs.items():
        ax.scatter(
            [ai], [flops / (ms * 1e-3)], marker="s", s=30, color=_REF_COLOURS[name], label=name, zorder=3
        )
    floor = view.baselines.floor_ms
    if floor:
        ax.axhline(flops / (floor * 1e-3), linestyle=":", color="#b71c1c", label="roofline floor")
    if ceil:
        xs = np.logspace(np.log10(ai / 100), np.log10(ai * 100), 200)
        roof = np.minimum(ceil.peak_flops(dtype), ceil.copy_bytes_per_s * xs)
        ax.plot(xs, roof, color="#1565c0", label=f"ceilings of {ceil.gpu}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (task FLOPs / minimal bytes)")
    ax.set_ylabel("achieved FLOP/s")
    return (
        f"The task does {flops:.3g} FLOPs on at least {nbytes:.3g} bytes ({ai:.3g} FLOP/byte); each green "
        "point is a correct candidate at its measured time."
    )


def _bandwidth_chart(ax: Any, view: RunView, timed: list[Point], refs: dict[str, float], ceil: Ceilings | None,
                     flops: float, nbytes: float, dtype: str) -> str:  # fmt: skip
    def tbs(ms: float) -> float:
        return nbytes / (ms * 1e-3) / 1e12

    for e in timed:
        ax.scatter(
            [e.n], [tbs(e.time_ms or 0.0)], s=22, color=COLOURS[Status.OK], gid=f"roof-{e.n}", zorder=3
        )
    for name, ms in refs.items():
        ax.axhline(tbs(ms), linestyle="--", linewidth=1, label=name, color=_REF_COLOURS[name])
    floor = view.baselines.floor_ms
    if floor:
        ax.axhline(tbs(floor), linestyle=":", color="#b71c1c", label="roofline floor")
    if ceil:
        ax.axhline(ceil.copy_bytes_per_s / 1e12, color="#1565c0", label=f"copy ceiling of {ceil.gpu}")
    ax.set_xlabel("evaluation")
    ax.set_ylabel("achieved bandwidth (TB/s)")
    ax.set_ylim(bottom=0)
    return (
        "The task does no arithmetic (0 FLOP/byte): its roofline is the memory ceiling. Each green point "
        f"is a correct candidate's bandwidth on the task's {nbytes / 1e6:.0f} MB minimum."
    )


def energy_svg(view: RunView) -> str:
    """Time against energy per call of every verified candidate with a reading (error bars: one standard
    error), the Pareto front as a step, eager as a square, the speed bound as a line, the choice ringed."""
    cands = view.state.at_speed()
    read = [c for c in cands if c.joules is not None]
    if not read:
        return ""
    tol, eager_ms = _tolerance(view), _eager_ms(view)
    top = matched.fastest(cands, eager_ms)
    chosen = _chosen(view)
    plt = pyplot()
    with plt.rc_context(RC):
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for i, c in enumerate(read):
            j = 1e3 * (c.joules or 0.0)
            ax.errorbar([c.time_ms], [j], yerr=[j * (c.spread or 0.0)], fmt="o", markersize=4,
                        color=COLOURS[Status.OK], zorder=3, gid=f"te-{c.node}",
                        label=None if i else "verified candidates")  # fmt: skip
        front = matched.pareto_front(cands)
        ax.step([c.time_ms for c in front], [1e3 * (c.joules or 0.0) for c in front], where="post",
                color="#1565c0", label="Pareto front", gid="pareto", zorder=2)  # fmt: skip
        if eager_ms and view.baselines.energy_eager_j:
            ax.scatter([eager_ms], [1e3 * view.baselines.energy_eager_j], marker="s", s=30, color="#444",
                       label="eager", zorder=3, gid="te-eager")  # fmt: skip
        if top:
            ax.axvline((1 + tol) * top, linestyle=":", color="#b71c1c", linewidth=1,
                       label=f"matched speed (+{100 * tol:g}%)", gid="speed-bound")  # fmt: skip
        if chosen is not None and chosen.joules is not None:
            ax.scatter([chosen.time_ms], [1e3 * chosen.joules], s=120, facecolors="none", edgecolors="#000",
                       label=f"chosen (#{chosen.node})", zorder=4, gid="chosen")  # fmt: skip
        ax.set_xlabel("median time per call (ms)")
        ax.set_ylabel("energy per call (mJ)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        return svg(fig)


# -- HTML -----------------------------------------------------------------------------------------------

_SECTIONS = {
    "Best candidate": "best",
    "Energy at matched speed": "matched",
    "Best speedup over eager, by evaluation": "curve",
    "What paid off": "paid_off",
    "Search tree": "tree",
    "Environment": "environment",
}


def _md_sections(md: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The Markdown body split at its `## ` headings and rendered to HTML, known sections by name, any others
    in order. Raw HTML in it is escaped: edits and notes may come from an LLM."""
    from markdown_it import MarkdownIt

    mdit = MarkdownIt("commonmark", {"html": False})
    parts: list[tuple[str, list[str]]] = [("summary", [])]
    for line in md.splitlines():
        if line.startswith("## "):
            parts.append((line[3:].strip(), []))
        elif not line.startswith("# "):
            parts[-1][1].append(line)
    known: dict[str, str] = {}
    extra: list[tuple[str, str]] = []
    for title, lines in parts:
        html = mdit.render("\n".join(lines))
        if title == "summary" or title in _SECTIONS:
            known[_SECTIONS.get(title, title)] = html
        else:
            extra.append((title, html))
    return known, extra


def _tree(view: RunView, nid: int = ROOT) -> dict[str, Any]:
    n = view.state.nodes[nid]
    return {
        "id": n.id,
        "edit": _edit(n),
        "status": _status(n),
        "speedup": n.speedup,
        "children": [_tree(view, c) for c in n.children],
    }


def _energy_rows(view: RunView) -> list[dict[str, Any]]:
    eager = view.baselines.energy_eager_j
    rows = []
    if eager:
        rows.append({"what": "eager PyTorch", "joules": eager, "watts": None, "saving": None})
    measured = [e for e in view.state.points if e.energy_j]
    if measured:
        low = min(measured, key=lambda e: e.energy_j or 0.0)
        rows.append(
            {
                "what": f"lowest of the search (evaluation {low.n}, node #{low.node})",
                "joules": low.energy_j,
                "watts": None,
                "saving": eager / low.energy_j if eager and low.energy_j else None,
            }
        )
    final = view.state.final
    m = final.evaluation.measurement if final else None
    if final and m and m.energy:
        j = m.energy.joules_per_call
        rows.append(
            {
                "what": f"best candidate, re-measured (node #{final.node})",
                "joules": j,
                "watts": m.energy.avg_power_w,
                "saving": eager / j if eager and j else None,
            }
        )
    return rows


def template(name: str) -> Any:
    """One of the reports' HTML templates (templates/): values escaped, every one required."""
    from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(default=True),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)  # fmt: skip
    return env.get_template(name)


def html_report(view: RunView, md: str) -> str:
    from markupsafe import Markup

    known, extra = _md_sections(md)
    sections = {k: Markup(known.get(k, "")) for k in ("summary", *_SECTIONS.values())}
    roof_svg, roof_note = roofline(view)
    statuses = {e.status.value for e in view.state.points} | {_status(n) for n in view.state.nodes.values()}
    return template("report.html.j2").render(
        run_id=view.run_id,
        sections=sections,
        extra_sections=[(t, Markup(h)) for t, h in extra],
        progress_svg=Markup(progress_svg(view)),
        has_floor="roofline floor" in _baseline_speedups(view),
        evaluations=view.state.points,
        roofline_svg=Markup(roof_svg),
        roofline_note=roof_note,
        energy_svg=Markup(energy_svg(view)),
        energy=_energy_rows(view),
        tree=_tree(view),
        colours=COLOURS,
        statuses=statuses,
    )


def render(folder: Path) -> Report:
    """The report in memory: what `show` prints and what `write_report` puts in the run folder."""
    view = load_view(folder)
    md = markdown(view)
    return Report(md, html_report(view, md))


def write_report(folder: Path) -> Path:
    rep = render(folder)
    (folder / "report.md").write_text(rep.markdown)
    (folder / "report.html").write_text(rep.html)
    return folder / "report.md"
