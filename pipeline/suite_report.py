"""The reports of a suite and of an experiment, from their rows alone (pipeline/bench.py, pipeline/experiment.py):
Markdown tables and HTML with plots (speedup per task against torch.compile, the distribution, the
evaluations-to-best curve of each cell). The plots share the run report's SVG rendering (report.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corpora import index_commands
from pipeline.report import RC, kernels_text, pyplot, svg, template

KIND_COLOURS = {"custom": "#1565c0", "hybrid": "#ef6c00"}


def _fx(v: float | None) -> str:
    return f"{v:.2f}x" if v else "–"


def _f(v: float | None, fmt: str = ".4f") -> str:
    return format(v, fmt) if v is not None else "–"


def _cell(text: Any) -> str:
    """Table cells hold task names and error messages: no pipe may split the row, no newline end it."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def bench_markdown(manifest: dict[str, Any], rows: list[dict[str, Any]], s: dict[str, Any]) -> str:
    from pipeline.bench import row_status

    st = manifest["settings"]
    lines = [f"# kernelpro bench: {Path(manifest['suite']).name or manifest['suite']}", ""]
    lines.append(f"- suite: `{manifest['suite']}` ({manifest.get('tasks', '?')} tasks)")
    lines.append(f"- every task: {st['policy']} policy, {st['search']} search, {st['evals']} evaluations")
    lines.append(f"- coverage: {s['tasks']} of {manifest.get('tasks', '?')} tasks written, {s['verified']} "
                 f"with a verified candidate")  # fmt: skip
    lines.append(f"- statuses: {', '.join(f'{k} {n}' for k, n in s['statuses'].items()) or 'none yet'}")
    gpus = s.get("gpus") or {}
    if gpus:
        mixed = " (rows from different cards: each row's eager is timed beside ours on its card)"
        lines.append(f"- measured on: {', '.join(f'{g} ({n} tasks)' for g, n in gpus.items())}"
                     f"{mixed if len(gpus) > 1 else ''}")  # fmt: skip
    lines += ["", "## Speedups", ""]
    lines.append(
        "Geomeans over the tasks whose best candidate was verified and timed, measured alongside eager."
    )
    lines += ["", "| candidates | tasks | ours over eager | torch.compile over eager | ours over torch.compile |",
              "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, g in (("all", s), *s["by_kind"].items()):
        lines.append(f"| {name} | {g['timed']} | {_fx(g['ours_over_eager'])} | {_fx(g['compile_over_eager'])} | "
                     f"{_fx(g['ours_over_compile'])} |")  # fmt: skip
    lines.append("")
    if s["fraction_of_floor"]:
        lines.append(f"- roofline: the best kernels at {100 * s['fraction_of_floor']:.1f}% of the floor "
                     f"(geomean over {s['floor_tasks']} tasks)")  # fmt: skip
    if s["energy_tasks"]:
        lines.append(f"- energy per call measured on {s['energy_tasks']} tasks; geomean saving over eager "
                     f"{_fx(s['energy_saving_over_eager'])}")  # fmt: skip
    else:
        lines.append("- energy per call: not measured (a replayed run, or no NVML)")
    if s["slower_than_eager"]:
        lines.append(f"- slower than eager: {', '.join(f'`{k}`' for k in s['slower_than_eager'])}")
    lines += ["", "## Tasks", ""]
    lines += ["| task | status | kind | eager ms | torch.compile ms | ours ms | over eager | over torch.compile "
              "| of floor | mJ per call | evaluations | seconds |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        floor = f"{100 * r['fraction_of_floor']:.1f}%" if r.get("fraction_of_floor") else "–"
        lines.append(
            f"| {_cell(r['key'])} | {row_status(r)} | {r.get('kind') or '–'} | {_f(r.get('eager_ms'))} | "
            f"{_f(r.get('compile_ms'))} | {_f(r.get('ours_ms'))} | {_fx(r.get('speedup_eager'))} | "
            f"{_fx(r.get('speedup_compile'))} | {floor} | {_f(r.get('energy_mj'), '.4g')} | "
            f"{r.get('evaluations') if r.get('evaluations') is not None else '–'} | {_f(r.get('wall_s'), '.1f')} |"
        )
    ran = [r for r in rows if r.get("kernels")]
    if ran:
        lines += ["", "## Kernels", ""]
        lines.append("The best candidate's kernels in the call the harness watched under the profiler (its three "
                     "longest, by share of their GPU time): which of a launcher's paths ran on the card.")  # fmt: skip
        lines.append("")
        lines += [f"- `{r['key']}`: {kernels_text(r['kernels'])}" for r in ran]
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", "## Failures", ""]
        lines += [f"- `{r['key']}` ({row_status(r)}): {_cell(r['error'])}" for r in failed]
    return "\n".join(lines) + "\n"


def _log_x(ax: Any) -> None:
    """A log x axis whose ticks read as speedups (0.5x, 1x, 2x), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def bench_speedup_svg(rows: list[dict[str, Any]]) -> str:
    """Each task's best against torch.compile (1 = as fast), one bar per task coloured by kind, log scale."""
    timed = sorted((r for r in rows if r.get("speedup_compile")), key=lambda r: r["speedup_compile"])
    if not timed:
        return ""
    plt = pyplot()
    with plt.rc_context(RC):
        fig, ax = plt.subplots(figsize=(7, min(40.0, 1.2 + 0.28 * len(timed))))
        seen: set[str] = set()
        for i, r in enumerate(timed):
            kind = r.get("kind") or "custom"
            # From 1 (as fast as torch.compile): right when faster, left when slower.
            ax.barh([i], [r["speedup_compile"] - 1.0], left=1.0, color=KIND_COLOURS.get(kind, "#616161"),
                    gid=f"task-{r['key']}", label=kind if kind not in seen else None)  # fmt: skip
            seen.add(kind)
        ax.axvline(1.0, color="#444", linestyle="--", linewidth=1, label="torch.compile")
        _log_x(ax)
        ax.set_yticks(range(len(timed)), [r["key"] for r in timed], fontsize=7)
        ax.set_xlabel("speedup over torch.compile (log scale)")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        return svg(fig)


def bench_distribution_svg(rows: list[dict[str, Any]]) -> str:
    """How the tasks' speedups spread: over eager and over torch.compile, log-spaced bins."""
    import numpy as np

    series = {
        "over eager": [r["speedup_eager"] for r in rows if r.get("speedup_eager")],
        "over torch.compile": [r["speedup_compile"] for r in rows if r.get("speedup_compile")],
    }
    values = [v for vs in series.values() for v in vs]
    if not values:
        return ""
    lo, hi = min(min(values), 0.9), max(max(values), 1.1)
    bins = np.geomspace(lo, hi, 16)
    plt = pyplot()
    with plt.rc_context(RC):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for (name, vs), colour in zip(series.items(), ("#2e7d32", "#1565c0"), strict=True):
            if vs:
                ax.hist(vs, bins=bins, histtype="step", linewidth=1.5, color=colour, label=f"{name} ({len(vs)})",
                        gid=f"hist-{name.split()[-1]}")  # fmt: skip
        ax.axvline(1.0, color="#444", linestyle="--", linewidth=1)
        _log_x(ax)
        ax.set_xlabel("speedup (log scale)")
        ax.set_ylabel("tasks")
        ax.legend(fontsize=7)
        fig.tight_layout()
        return svg(fig)


def bench_html(manifest: dict[str, Any], rows: list[dict[str, Any]], s: dict[str, Any]) -> str:
    """The Markdown report as HTML (task names and errors escaped) with the two plots."""
    from markdown_it import MarkdownIt
    from markupsafe import Markup

    md = bench_markdown(manifest, rows, s)
    head, _, rest = md.partition("\n## Tasks\n")
    mdit = MarkdownIt("commonmark", {"html": False}).enable("table")
    return template("bench.html.j2").render(
        title=f"kernelpro bench: {Path(manifest['suite']).name or manifest['suite']}",
        summary=Markup(mdit.render("\n".join(head.splitlines()[1:]))),  # the title is the page's
        tasks=Markup(mdit.render("## Tasks\n" + rest)),
        speedup_svg=Markup(bench_speedup_svg(rows)),
        distribution_svg=Markup(bench_distribution_svg(rows)),
    )


# -- experiments (pipeline/experiment.py) ------------------------------------------------------------------


def _ci(c: dict[str, Any]) -> str:
    return f"{c['ci'][0]:.3f} – {c['ci'][1]:.3f}" if c.get("ci") else "–"


def _p(c: dict[str, Any]) -> str:
    return f"{c['p_value']:.3g}" if c.get("p_value") is not None else "–"


def experiment_markdown(data: dict[str, Any]) -> str:
    d = data["definition"]
    lines = [f"# kernelpro experiment: {data['name']}", ""]
    if data.get("description"):
        lines += [data["description"], ""]
    lines.append(f"- suite: `{data['suite']}` ({data.get('tasks', '?')} tasks)")
    lines.append(f"- every run: {d['evals']} evaluations; seeds {', '.join(map(str, d['seeds']))}")
    lines.append(f"- baseline: `{d['baseline']}`")
    factors = [c["factors"] for c in data["cells"].values()]
    if any(f["memory"] for f in factors):
        lines.append("- memory: each cell with memory on learns in a lesson store of its own for each seed, empty "
                     "when its run starts, so no cell reads another's lessons")  # fmt: skip
    if any(f["objective"] != "time" for f in factors):
        lines.append("- objective: a cell that minimises energy or edp is compared on the time of the best "
                     "candidate by its own objective")  # fmt: skip
    lines += ["", "## Cells", ""]
    lines += ["| cell | policy | search | feedback | corpus | memory | objective | rows | verified | ours over eager "
              "| best after the budget |",
              "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, c in data["cells"].items():
        f = c["factors"]
        end = f"{c['curve'][-1]:.2f}x ({c['curve_runs']} runs)" if c["curve"] else "–"
        lines.append(f"| {_cell(name)} | {f['policy']} | {f['search']} | {f['feedback']} | {f['corpus']} | "
                     f"{'on' if f['memory'] else 'off'} | {f['objective']} | {c['written']} | {c['verified']} | "
                     f"{_fx(c['ours_over_eager'])} | {end} |")  # fmt: skip
    lines += ["", "## Against the baseline", ""]
    lines.append(
        f"Per task both verified (under a common seed): the best time of the cell over the baseline's (below 1: "
        f"the cell is faster), the geometric mean over the seeds. Over tasks: the geomean ratio, its "
        f"{100 * (data['comparisons'][0]['level'] if data['comparisons'] else 0.95):.0f}% bootstrap interval "
        f"({d['resamples']} resamples of the tasks), Wilcoxon's signed-rank test on the log ratios, and the tasks "
        f"won, lost and tied (within {100 * data['tie']:.0f}%)."
    )
    lines += ["", "| cell | paired tasks | geomean ratio | interval | p-value | wins | losses | ties | test |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for c in data["comparisons"]:
        g = f"{c['geomean_ratio']:.3f}" if c["geomean_ratio"] else "–"
        lines.append(f"| {_cell(c['cell'])} | {c['paired']} | {g} | {_ci(c)} | {_p(c)} | {c['wins']} | "
                     f"{c['losses']} | {c['ties']} | {c['test']} |")  # fmt: skip
    for c in data["comparisons"]:
        lines += ["", f"### {c['cell']} over {c['baseline']}", ""]
        if not c["tasks"]:
            lines.append("No task verified by both cells yet.")
            continue
        lines += ["| task | ratio | seeds |", "| --- | ---: | ---: |"]
        lines += [f"| {_cell(t['key'])} | {t['ratio']:.3f} | {t['seeds']} |" for t in c["tasks"]]
    corpora = {c["factors"]["corpus"] for c in data["cells"].values()}
    if data.get("retrieval") is not None or corpora != {"cutlass"}:
        lines += corpus_markdown(data)
    return "\n".join(lines) + "\n"


def corpus_markdown(data: dict[str, Any]) -> list[str]:
    """The corpora of the cells, three ways: retrieval on the query set, use in the runs, and the outcome."""
    lines = ["", "## Corpora", ""]
    lines.append("Where the building blocks come from, measured three ways: retrieval (the cell's index finds "
                 "what the query set expects), use (the building blocks its runs' candidates took from each "
                 "corpus) and outcome (the paired comparison with the baseline, above).")  # fmt: skip
    lines += ["", "### Retrieval", ""]
    r = data.get("retrieval")
    if r is None:
        lines.append('Not measured: the experiment names no query set (`queries = "file.toml"`: `[[case]]` '
                     "tables of query and expect, beside the experiment file).")  # fmt: skip
    elif r.get("error"):
        lines.append(
            f"Not measured: the query set `{r['queries']}` could not be evaluated ({_cell(r['error'])})."
        )
    else:
        k = r["k"]
        lines.append(f"Query set `{r['queries']}` ({r['cases']} cases), evaluated when the experiment last ran: "
                     f"recall@{k} (an expected file among the first {k} blocks) and the mean reciprocal rank "
                     "over the first 10, on each cell's corpora together.")  # fmt: skip
        lines += ["", f"| corpus | cells | recall@{k} | MRR | query p50 ms | note |",
                  "| --- | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
        for corpus, e in r["corpora"].items():
            cells = ", ".join(f"`{_cell(c)}`" for c in e["cells"])
            if "recall" in e:
                lines.append(
                    f"| {corpus} | {cells} | {e['recall']:.3f} | {e['mrr']:.3f} | {e['p50_ms']:.1f} | |"
                )
            else:
                lines.append(f"| {corpus} | {cells} | – | – | – | {_cell(e.get('error', ''))} |")
    lines += ["", "### Use", ""]
    lines.append("From the run logs: the candidates proposed, those that record a building block, and per corpus "
                 "the candidates and the runs' best candidates that use one of its blocks. An LLM candidate "
                 "records the blocks shown to it that its source names (an include line or the symbol); the "
                 "expert's GEMM atoms (its `// building block:` lines) are CUTLASS symbols checked against the "
                 "installed CUTLASS headers, so they count for cutlass whatever the corpus.")  # fmt: skip
    lines += ["", "| cell | runs | candidates | with a block | corpus | its candidates | best candidates | "
              "blocks | most used |", "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    notes = []
    for name, c in data["cells"].items():
        u = c.get("use") or {}
        head = f"| {_cell(name)} | {u.get('runs', 0)} | {u.get('candidates', 0)} | {u.get('with_blocks', 0)}"
        by = u.get("by_corpus") or {}
        if not by:
            lines.append(f"{head} | – | 0 | 0 | 0 | – |")
        for corpus, e in by.items():
            top = ", ".join(f"`{_cell(b)}` ({n})" for b, n in list(e["blocks"].items())[:3])
            lines.append(
                f"{head} | {corpus} | {e['candidates']} | {e['best']} | {len(e['blocks'])} | {top} |"
            )
        for corpus, n in (u.get("missing_index") or {}).items():
            notes.append(f"- `{_cell(name)}`: {n} run{'s' if n != 1 else ''} had no index of {corpus}, so no "
                         f"building blocks from it (`{index_commands(corpus)[1]}`)")  # fmt: skip
    if notes:
        lines += ["", *notes]
    lines += ["", "### Outcome", ""]
    lines.append(
        "The paired per-task comparison of each cell with the baseline cell: see *Against the baseline*."
    )
    return lines


def experiment_curve_svg(data: dict[str, Any]) -> str:
    """Each cell's best-so-far speedup over eager after each evaluation, the geomean across its runs."""
    cells = {name: c for name, c in data["cells"].items() if c["curve"]}
    if not cells:
        return ""
    plt = pyplot()
    with plt.rc_context(RC):
        fig, ax = plt.subplots(figsize=(7, 3.4))
        for name, c in cells.items():
            xs = range(1, len(c["curve"]) + 1)
            base = name == data["definition"]["baseline"]
            ax.step(xs, c["curve"], where="post", linewidth=2 if base else 1.4, linestyle="--" if base else "-",
                    label=f"{name} ({c['curve_runs']} runs)", gid=f"curve-{name}")  # fmt: skip
        ax.set_xlabel("evaluation")
        ax.set_ylabel("best speedup over eager so far (geomean)")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        return svg(fig)


def experiment_html(data: dict[str, Any]) -> str:
    """The Markdown report as HTML (names escaped) with the evaluations-to-best plot."""
    from markdown_it import MarkdownIt
    from markupsafe import Markup

    md = experiment_markdown(data)
    mdit = MarkdownIt("commonmark", {"html": False}).enable("table")
    return template("experiment.html.j2").render(
        title=f"kernelpro experiment: {data['name']}",
        body=Markup(mdit.render("\n".join(md.splitlines()[1:]))),  # the title is the page's
        curve_svg=Markup(experiment_curve_svg(data)),
    )
