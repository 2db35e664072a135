"""The report of one run, from its log alone: Markdown and HTML with the best-so-far curve, the search
tree, the advice behind each improvement, the best kernel against the roofline floor, energy per call and
the environment. `kernelpro show <run-id>` rewrites it, so a report never disagrees with its log.
"""

from __future__ import annotations

import html
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class _Node:
    id: int
    parent: int | None
    edit: str
    key: str = ""
    status: str = "pending"
    speedup: float | None = None  # over eager, measured alongside
    time_ms: float | None = None
    reward: float | None = None
    children: list[int] = field(default_factory=list)
    bound: str = ""
    top_finding: str = ""
    kind: str = ""


@dataclass
class RunView:
    run_id: str
    header: dict[str, Any]
    nodes: dict[int, _Node]
    baselines: dict[str, Any]
    curve: list[tuple[int, float]]
    end: dict[str, Any] | None
    final: dict[str, Any] | None
    usage: dict[str, float]
    interrupted: int
    exported: bool = False


def load_view(folder: Path) -> RunView:
    from pipeline.runlog import read_events

    events = read_events(folder / "log.jsonl")
    header = events[0].data if events else {}
    nodes: dict[int, _Node] = {0: _Node(0, None, "reference (PyTorch eager)", status="ok", speedup=1.0)}
    baselines: dict[str, Any] = {}
    curve: list[tuple[int, float]] = []
    best = 0.0
    evaluations = 0
    end = final = None
    usage = {"tokens": 0.0, "cost_usd": 0.0, "calls": 0.0}
    interrupted = 0
    for e in events:
        d = e.data
        if e.type == "baselines":
            baselines = d
        elif e.type == "proposal":
            nodes[d["node"]] = _Node(d["node"], d["parent"], d["edit"], key=d["candidate"]["key"])
            nodes[d["parent"]].children.append(d["node"])
        elif e.type == "result":
            n = nodes[d["node"]]
            n.status = d["verdict"]["status"]
            n.reward = d.get("reward")
            n.kind = d["verdict"].get("kind") or ""
            m = d.get("measurement")
            if m and m.get("timing") and n.status == "ok":
                n.time_ms = m["timing"]["median_ms"]
                eager = (m.get("baselines") or {}).get("eager")
                n.speedup = eager["median_ms"] / n.time_ms if eager and n.time_ms else None
            evaluations += 1
            if n.speedup and n.speedup > best:
                best = n.speedup
            if best:
                curve.append((evaluations, best))
        elif e.type == "profile":
            n = nodes[d["node"]]
            n.bound = d.get("bound", "")
            if d.get("findings"):
                f = d["findings"][0]
                n.top_finding = f"[{f['tool']}] {f['diagnosis']}"
        elif e.type == "llm":
            usage["tokens"] += d.get("prompt_tokens", 0) + d.get("completion_tokens", 0)
            usage["cost_usd"] += d.get("cost_usd", 0.0)
            usage["calls"] += d.get("calls", 0)
        elif e.type == "final":
            final = d
        elif e.type == "end":
            end = d
        elif e.type == "interrupted":
            interrupted += 1
    run_id = folder.name
    exported = (folder / "best_model_new.py").is_file()
    return RunView(run_id, header, nodes, baselines, curve, end, final, usage, interrupted, exported)


def _best(view: RunView) -> _Node | None:
    ok = [n for n in view.nodes.values() if n.id and n.status == "ok" and n.speedup]
    return max(ok, key=lambda n: (n.speedup, -n.id), default=None)


def _improvements(view: RunView) -> list[tuple[_Node, _Node]]:
    """(parent, child) pairs where the child beat its parent: the advice and edit that paid off."""
    out = []
    for n in sorted(view.nodes.values(), key=lambda n: n.id):
        if not n.id or n.parent is None or n.status != "ok" or not n.speedup:
            continue
        p = view.nodes[n.parent]
        if p.speedup and n.speedup > p.speedup * 1.02:
            out.append((p, n))
    return out


def _tree_lines(view: RunView, nid: int = 0, depth: int = 0) -> list[str]:
    n = view.nodes[nid]
    sp = f"{n.speedup:.2f}x" if n.speedup else n.status
    lines = [f"{'  ' * depth}- #{n.id} {n.edit} — {sp}"]
    for c in n.children:
        lines += _tree_lines(view, c, depth + 1)
    return lines


def _ms(t: dict[str, Any] | None) -> str:
    return f"{t['median_ms']:.4f} ms" if t else "–"


def markdown(view: RunView) -> str:
    h = view.header
    task = h.get("task", {})
    timings = view.baselines.get("timings", {})
    best = _best(view)
    lines = [f"# kernelpro run {view.run_id}", ""]
    lines.append(f"- task: `{task.get('id', '?')}` ({h.get('task_path', '')})")
    lines.append(
        f"- policy: {h.get('policy')}, search: {h.get('search')}, objective: {h.get('config', {}).get('objective')}"
    )
    if h.get("replay"):
        lines.append(f"- evaluations replayed from recordings: {', '.join(f'`{r}`' for r in h['replay'])}")
    lines.append(f"- eager: {_ms(timings.get('eager'))}; torch.compile: {_ms(timings.get('compile'))}")
    if view.end:
        lines.append(f"- stopped: {view.end.get('reason')}; {view.end.get('evaluations')} evaluations")
    else:
        lines.append("- the run has not finished (interrupted or still running): resume it with `--resume`")
    if view.usage["calls"]:
        lines.append(
            f"- LLM: {view.usage['tokens']:.0f} tokens, ${view.usage['cost_usd']:.2f}, {view.usage['calls']:.0f} requests"
        )
    lines += ["", "## Best candidate", ""]
    if best is None:
        lines.append("No correct candidate was faster than nothing: see the tree for the statuses.")
    else:
        comp = timings.get("compile")
        vs_comp = f"{comp['median_ms'] / best.time_ms:.2f}x" if comp and best.time_ms else "–"
        lines.append(f"- node #{best.id} `{best.key}` ({best.kind or 'custom'}): {best.time_ms:.4f} ms, "
                     f"{best.speedup:.2f}x over eager, {vs_comp} over torch.compile")  # fmt: skip
        floor = view.baselines.get("floor_ms")
        if floor and best.time_ms:
            lines.append(
                f"- roofline: floor {floor:.4f} ms, the best kernel at {100 * floor / best.time_ms:.0f}% of it"
            )
        if best.bound:
            lines.append(f"- stage-1 class: {best.bound}")
        if view.final and view.final.get("measurement"):
            m = view.final["measurement"]
            t = m.get("timing") or {}
            lines.append(f"- re-measured at the end: {t.get('median_ms', float('nan')):.4f} ms")
            if m.get("energy"):
                lines.append(
                    f"- energy: {1e3 * m['energy']['joules_per_call']:.2f} mJ per call at {m['energy']['avg_power_w']:.0f} W"
                )
        files = ["`best/kernel.cu`", "`best/launcher.py`"]
        if view.exported:
            files.append("`best_model_new.py` (standalone drop-in `ModelNew`)")
        lines.append(f"- files: {', '.join(files)}")
    lines += ["", "## Best speedup over eager, by evaluation", ""]
    lines.append(" → ".join(f"{i}: {s:.2f}x" for i, s in _thin(view.curve)) or "no correct candidate yet")
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
    env = (view.final or {}).get("measurement", {}) or {}
    env = env.get("environment") or view.baselines.get("environment") or {}
    if env:
        lines += ["", "## Environment", ""] + [f"- {k}: {v}" for k, v in sorted(env.items())]
    return "\n".join(lines) + "\n"


def _thin(curve: list[tuple[int, float]], keep: int = 12) -> list[tuple[int, float]]:
    changes = [pt for i, pt in enumerate(curve) if i == 0 or pt[1] != curve[i - 1][1]]
    if curve and (not changes or changes[-1] != curve[-1]):
        changes.append(curve[-1])
    return changes[-keep:]


def curve_svg(view: RunView) -> str:
    if not view.curve:
        return ""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    xs, ys = zip(*view.curve, strict=True)
    ax.step(xs, ys, where="post")
    comp = view.baselines.get("timings", {}).get("compile")
    eager = view.baselines.get("timings", {}).get("eager")
    if comp and eager:
        ax.axhline(
            eager["median_ms"] / comp["median_ms"], linestyle="--", color="gray", label="torch.compile"
        )
        ax.legend()
    ax.set_xlabel("evaluations")
    ax.set_ylabel("best speedup over eager")
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def html_report(view: RunView, md: str) -> str:
    body = []
    in_list = False
    for line in md.splitlines():
        if line.startswith("#"):
            if in_list:
                body.append("</ul>")
                in_list = False
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
            if line.startswith("## Best speedup"):
                body.append(curve_svg(view))
        elif line.lstrip().startswith("- "):
            if not in_list:
                body.append("<ul class='tree'>")
                in_list = True
            indent = (len(line) - len(line.lstrip())) // 2
            body.append(f"<li style='margin-left:{1.2 * indent}em'>{html.escape(line.strip()[2:])}</li>")
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    if in_list:
        body.append("</ul>")
    style = "body{font-family:sans-serif;max-width:60em;margin:2em auto}ul.tree{list-style:square}"
    return f"<!doctype html><html><head><meta charset='utf-8'><title>kernelpro {html.escape(view.run_id)}</title><style>{style}</style></head><body>{''.join(body)}</body></html>\n"


def write_report(folder: Path) -> Path:
    view = load_view(folder)
    md = markdown(view)
    (folder / "report.md").write_text(md)
    (folder / "report.html").write_text(html_report(view, md))
    return folder / "report.md"
