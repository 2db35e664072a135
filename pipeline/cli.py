"""The `kernelpro` command."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline import config as config_mod
from pipeline.types import Status, to_dict

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Write, verify, time and profile CUDA kernels."
)
out = Console()
err = Console(stderr=True)

TaskOpt = Annotated[Path, typer.Option("--task", "-t", help="KernelBench-format task file")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON on stdout instead of tables")]
HomeOpt = Annotated[Path | None, typer.Option("--home", help="cache folder (default .kernelpro)")]


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Errors a user can act on become one line on stderr and exit code 2: no traceback spew."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from corpora import CorpusError
        from index.store import StoreError
        from pipeline.candidates import CandidateError
        from pipeline.compile import ToolchainError
        from pipeline.loop import NoGPUError
        from pipeline.tasks import TaskError

        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise  # click's Exit is a RuntimeError: let it through untouched
        except (
            TaskError,
            CandidateError,
            ToolchainError,
            NoGPUError,
            CorpusError,
            StoreError,
            ValueError,
            RuntimeError,
        ) as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def _progress(enabled: bool):
    if not enabled:
        return None, None
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )
    ids: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in ids:
            ids[stage] = bar.add_task(stage, total=total)
        bar.update(ids[stage], completed=done, total=total)

    return bar, update


@app.command("eval")
@_user_errors
def eval_cmd(
    task: TaskOpt,
    candidate: Annotated[
        list[Path],
        typer.Option("--candidate", "-c", help="candidate folder (kernel.cu + launcher.py); repeatable"),
    ],
    json_out: JsonOpt = False,
    energy: Annotated[
        bool, typer.Option("--energy/--no-energy", help="measure energy per call (NVML)")
    ] = True,
    baselines: Annotated[
        str, typer.Option(help="comma-separated: eager, compile, max-autotune-no-cudagraphs, or none")
    ] = "eager,compile,max-autotune-no-cudagraphs",
    trials: Annotated[int | None, typer.Option(help="verification trials")] = None,
    device: Annotated[str | None, typer.Option(help="cuda, or cpu for Python stand-ins")] = None,
    home: HomeOpt = None,
) -> None:
    """Verify and time candidates against a task and its eager / torch.compile baselines."""
    from pipeline.loop import evaluate_candidates

    cfg = config_mod.load(home=home, energy=energy, trials=trials, device=device, baselines=_modes(baselines))
    bar, update = _progress(not json_out and sys.stderr.isatty())
    if bar:
        with bar:
            results = evaluate_candidates(task, candidate, cfg, progress=update)
    else:
        results = evaluate_candidates(task, candidate, cfg)
    if json_out:
        print(json.dumps([_result_json(r) for r in results], indent=2))
    else:
        _print_results(results)
    if any(r.verdict.status != Status.OK for r in results):
        raise typer.Exit(1)


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip() and m.strip() != "none")
    unknown = set(modes) - {"eager", "compile", "max-autotune-no-cudagraphs"}
    if unknown:
        raise ValueError(f"unknown baseline mode(s): {', '.join(sorted(unknown))}")
    return modes


def _result_json(r) -> dict[str, Any]:
    m = r.measurement
    return {
        "candidate": r.candidate.key,
        "build": to_dict(r.build) if r.build else None,
        "verdict": to_dict(r.verdict),
        "measurement": to_dict(m) if m else None,
        "speedup_eager": m.speedup_eager if m else None,
        "speedup_compile": m.speedup_compile if m else None,
        "fraction_of_floor": m.fraction_of_floor if m else None,
    }


def _print_results(results) -> None:
    table = Table(title="kernelpro eval")
    for col in ("candidate", "status", "kind", "ms (median)", "vs eager", "vs compile", "of floor", "J/call"):
        table.add_column(col)
    for r in results:
        m = r.measurement
        t = m.timing if m else None
        table.add_row(
            r.candidate.key,
            r.verdict.status.value,
            r.verdict.kind.value if r.verdict.kind else "-",
            f"{t.median_ms:.4f} ±{100 * t.spread:.1f}%" if t else "-",
            _x(m.speedup_eager if m else None),
            _x(m.speedup_compile if m else None),
            f"{100 * m.fraction_of_floor:.0f}%" if m and m.fraction_of_floor else "-",
            f"{m.energy.joules_per_call:.4g}" if m and m.energy else "-",
        )
    out.print(table)
    for r in results:
        for reason in r.verdict.reasons:
            out.print(f"  {r.candidate.key}: {reason}", highlight=False, soft_wrap=True)
        if r.verdict.library_ops:
            out.print(f"  {r.candidate.key}: hybrid, left to libraries: {', '.join(r.verdict.library_ops)}")


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"


@app.command()
@_user_errors
def baseline(
    task: TaskOpt,
    json_out: JsonOpt = False,
    modes: Annotated[
        str, typer.Option(help="comma-separated baseline modes")
    ] = "eager,compile,max-autotune-no-cudagraphs",
    energy: Annotated[bool, typer.Option("--energy/--no-energy")] = True,
    home: HomeOpt = None,
) -> None:
    """Time the task's eager and torch.compile baselines (compile time reported apart)."""
    from pipeline.loop import run_baselines

    cfg = config_mod.load(home=home, baselines=_modes(modes), energy=energy)
    task_info, data = run_baselines(task, cfg)
    record = {
        "task": task_info.id,
        "flops": task_info.flops,
        "min_bytes": task_info.min_bytes,
        "floor_ms": data.get("floor_ms"),
        "timings": {k: to_dict(v) for k, v in data["timings"].items()},
        "compile_s": data.get("compile_s"),
        "energy_eager": data.get("energy_eager"),
        "notes": data.get("notes"),
        "environment": data.get("environment"),
    }
    path = cfg.home / "baselines" / f"{task_info.id}-{task_info.source_hash[:10]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    if json_out:
        print(json.dumps(record, indent=2))
        return
    table = Table(title=f"baselines: {task_info.id}")
    for col in ("mode", "ms (median)", "spread", "compile s", "of floor"):
        table.add_column(col)
    floor = data.get("floor_ms")
    for mode, t in data["timings"].items():
        table.add_row(
            mode,
            f"{t.median_ms:.4f}",
            f"{100 * t.spread:.1f}%",
            f"{data['compile_s'].get(mode, 0):.1f}",
            f"{100 * floor / t.median_ms:.0f}%" if floor else "-",
        )
    out.print(table)
    for note in data.get("notes") or []:
        out.print(f"  note: {note}", highlight=False)


@app.command()
@_user_errors
def calibrate(
    json_out: JsonOpt = False,
    force: Annotated[bool, typer.Option("--force", help="measure again even if cached")] = False,
    home: HomeOpt = None,
) -> None:
    """Measure this GPU's ceilings (copy bandwidth; fp32, tf32, bf16 matmul rates) once and cache them."""
    from pipeline.loop import ceilings, open_pool

    cfg = config_mod.load(home=home)
    with open_pool(cfg) as pool:
        c = ceilings(pool, cfg, force=force)
    assert c is not None
    if json_out:
        print(json.dumps(c.__dict__, indent=2))
        return
    table = Table(title=f"ceilings: {c.gpu}")
    table.add_column("ceiling")
    table.add_column("value")
    table.add_row("copy bandwidth (read + write)", f"{c.copy_bytes_per_s / 1e12:.2f} TB/s")
    table.add_row("fp32 matmul (TF32 off)", f"{c.fp32_flops / 1e12:.1f} TFLOP/s")
    table.add_row("tf32 matmul", f"{c.tf32_flops / 1e12:.1f} TFLOP/s")
    table.add_row("bf16 matmul", f"{c.bf16_flops / 1e12:.1f} TFLOP/s")
    out.print(table)


@app.command()
@_user_errors
def export(
    task: TaskOpt,
    candidate: Annotated[Path, typer.Option("--candidate", "-c", help="candidate folder")],
    output: Annotated[Path, typer.Option("--output", "-o", help="the standalone .py file to write")],
    home: HomeOpt = None,
) -> None:
    """Compile a candidate and write it as one standalone file (needs only torch, numpy and cupy)."""
    from pipeline.candidates import export_standalone, load_candidate
    from pipeline.compile import compile_candidates

    if not task.is_file():
        raise ValueError(f"task file not found: {task}")
    cfg = config_mod.load(home=home)
    cand = load_candidate(candidate, task.stem)
    (build,) = compile_candidates([cand], cfg)
    if build.status != Status.OK:
        raise RuntimeError(f"compile failed ({build.status.value}):\n{build.log}")
    path = export_standalone(cand, build, output)
    out.print(f"wrote {path} ({path.stat().st_size} bytes, {build.arch})")


@app.command()
@_user_errors
def profile(
    task: TaskOpt,
    candidate: Annotated[Path, typer.Option("--candidate", "-c", help="candidate folder")],
    feedback: Annotated[
        str, typer.Option(help="advice (for prompts), json, raw (metrics only) or none")
    ] = "advice",
    all_tools: Annotated[
        bool, typer.Option("--all-tools", help="run every tool, not only those for the class")
    ] = False,
    home: HomeOpt = None,
) -> None:
    """Verify a candidate, collect counters (ncu), SASS and a system profile, and print the tools' advice."""
    from pipeline.loop import profile_candidate
    from pipeline.profile.advice import Feedback, advice_block, analyze, as_json, raw_block

    mode = Feedback(feedback) if feedback in {f.value for f in Feedback} else None
    if mode is None:
        raise ValueError(f"unknown feedback {feedback!r}: use advice, json, raw or none")
    cfg = config_mod.load(home=home, baselines=("eager",))
    pr = profile_candidate(task, candidate, cfg)
    for note in pr.notes:
        err.print(f"note: {note}", highlight=False)
    if pr.evidence is None:
        _print_results([pr.result])
        raise typer.Exit(1)
    if mode == Feedback.NONE:
        return
    if mode == Feedback.RAW:
        print(raw_block(pr.evidence))
        return
    cls, findings = analyze(pr.evidence, every_class=all_tools)
    if mode == Feedback.JSON:
        print(json.dumps(as_json(cls, findings), indent=2))
    else:
        out.print(advice_block(cls, findings), highlight=False, soft_wrap=True)


# --- index: build, status, query, drop --------------------------------------------------------------

index_app = typer.Typer(
    no_args_is_help=True, help="Build and query the Chroma index of CUDA building blocks."
)
app.add_typer(index_app, name="index")
CorpusOpt = Annotated[str, typer.Option("--corpus", help="corpus name (corpora/*.toml) or a TOML path")]


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@index_app.command("build")
@_user_errors
def index_build(
    corpus: CorpusOpt = "cutlass",
    folder: Annotated[
        Path | None, typer.Option("--folder", help="the folder of a folder corpus (e.g. local)")
    ] = None,
    json_out: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Index a corpus incrementally: unchanged files are skipped, changed ones replaced atomically."""
    from index.build import build_index

    cfg = config_mod.load(home=home)
    bar, update = _progress(not json_out and sys.stderr.isatty())
    if bar:
        with bar:
            r = build_index(corpus, cfg, progress=update, folder=folder)
    else:
        r = build_index(corpus, cfg, folder=folder)
    if json_out:
        print(json.dumps(r.__dict__, indent=2))
        return
    table = Table(title=f"index {r.collection}")
    for col in ("files", "changed", "unchanged", "removed", "chunks", "added", "deleted", "seconds", "size"):
        table.add_column(col)
    table.add_row(
        str(r.files_total),
        str(r.files_changed),
        str(r.files_unchanged),
        str(r.files_removed),
        str(r.chunks_total),
        str(r.chunks_added),
        str(r.chunks_deleted),
        f"{r.seconds:.1f}",
        _size(r.index_bytes),
    )
    out.print(table)


@index_app.command("status")
@_user_errors
def index_status_cmd(json_out: JsonOpt = False, home: HomeOpt = None) -> None:
    """List the indexed corpora: chunks, files, model, size."""
    from index.build import index_status

    rows = index_status(config_mod.load(home=home))
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        out.print("no index yet; build one with `kernelpro index build`")
        return
    table = Table(title="kernelpro index")
    for col in ("collection", "corpus", "version", "chunks", "files", "model", "built", "sidecars", "chroma"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["collection"],
            str(r["corpus"]),
            str(r["version"]),
            str(r["chunks"] if r["chunks"] is not None else "?"),
            str(r["files"] if r["files"] is not None else "?"),
            str(r["model"]),
            str(r["built_at"] or "-"),
            _size(r["bytes"]),
            _size(r["chroma_bytes"]),
        )
    out.print(table)


@index_app.command("drop")
@_user_errors
def index_drop(corpus: CorpusOpt, home: HomeOpt = None) -> None:
    """Delete a corpus's collection and its sidecar files."""
    from index.build import drop_index

    name = drop_index(corpus, config_mod.load(home=home))
    out.print(f"dropped {name}")


@index_app.command("query")
@_user_errors
def index_query(
    text: Annotated[str, typer.Argument(help="what to look for: a symbol, or words")],
    corpus: CorpusOpt = "cutlass",
    k: Annotated[int, typer.Option("-k", help="how many building blocks")] = 5,
    arch: Annotated[str | None, typer.Option("--arch", help="only blocks for this arch, e.g. sm90")] = None,
    json_out: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Hunt the index for building blocks (exact symbol + BM25 + dense, fused)."""
    if not text.strip():
        raise ValueError("the query is empty; give a symbol or some words")
    if k < 1:
        raise ValueError(f"-k must be at least 1, got {k}")
    try:
        from index import hunt as hunt_mod
    except ImportError as e:
        raise RuntimeError(f"index query is not available yet (index.hunt: {e})") from None
    cfg = config_mod.load(home=home)
    blocks = hunt_mod.hunt(text, cfg=cfg, corpus=corpus, k=k, arch=arch)
    rows = [_block_json(b) for b in blocks]
    if json_out:
        print(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        out.print("no building blocks found")
        return
    for i, b in enumerate(rows, 1):
        where = b.get("path", "?")
        if b.get("start_line"):
            where += f":{b['start_line']}-{b.get('end_line', '')}"
        score = b.get("score")
        head = f"[bold]{i}. {b.get('symbol', '')}[/]  {where}"
        out.print(head + (f"  (score {score:.3f})" if isinstance(score, float) else ""), highlight=False)


def _block_json(b: Any) -> dict[str, Any]:
    """A hunt result as a plain dict, whatever its type (dataclass, dict, object with attributes)."""
    import dataclasses

    if dataclasses.is_dataclass(b) and not isinstance(b, type):
        return dataclasses.asdict(b)
    if isinstance(b, dict):
        return b
    return dict(vars(b))


@index_app.command("eval")
@_user_errors
def index_eval(
    cases: Annotated[
        Path | None, typer.Option("--cases", help="evaluation TOML (default tests/fixtures/hunt_eval.toml)")
    ] = None,
    corpus: CorpusOpt = "cutlass",
    json_out: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Score the source hunter on an evaluation set: recall@5, MRR, query p50."""
    from index.hunt import evaluate, get_hunter, load_cases

    path = cases or Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hunt_eval.toml"
    if not path.is_file():
        raise ValueError(f"evaluation cases not found: {path}; pass --cases FILE")
    report = evaluate(get_hunter(config_mod.load(home=home), corpus), load_cases(path))
    misses = [r for r in report.per_case if r.rank is None or r.rank > 5]
    if json_out:
        summary = {"recall_at_5": report.recall_at_5, "mrr": report.mrr, "p50_ms": report.p50_ms}
        summary["cases"] = [
            {"query": r.case.query, "rank": r.rank, "top": list(r.top_paths[:5])} for r in report.per_case
        ]
        print(json.dumps(summary, indent=2))
        return
    table = Table(title=f"hunt eval: {len(misses)} of {len(report.per_case)} missed in the top 5")
    for col in ("query", "rank", "first result"):
        table.add_column(col)
    for r in misses:
        table.add_row(r.case.query, str(r.rank or "-"), r.top_paths[0] if r.top_paths else "-")
    if misses:
        out.print(table)
    out.print(f"recall@5 {report.recall_at_5:.3f}  MRR {report.mrr:.3f}  p50 {report.p50_ms:.1f} ms")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
