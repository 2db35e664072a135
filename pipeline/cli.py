"""The `kernelpro` command."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from collections.abc import Callable
from enum import Enum
from functools import wraps
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline import config as config_mod
from pipeline import reasons
from pipeline.types import Evaluation, Status, to_dict

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Write, verify, time and profile CUDA kernels."
)
# Without a terminal (a pipe, a file, CI) Rich would cut tables at 80 columns, and with them the run ids a
# user copies for --resume: give captured output room instead.
PIPE_WIDTH = 200
out = Console(width=None if sys.stdout.isatty() else PIPE_WIDTH)
err = Console(stderr=True, width=None if sys.stderr.isatty() else PIPE_WIDTH)


def _choices(field: str) -> Any:
    """An Enum of a config field's allowed values, so typer lists them and refuses others."""
    return Enum(field.capitalize(), {v: v for v in config_mod.CHOICES[field]}, type=str)


Policy, Search, Objective, FeedbackMode = (_choices(f) for f in ("policy", "search", "objective", "feedback"))

TaskOpt = Annotated[Path, typer.Option("--task", "-t", help="KernelBench-format task file")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON on stdout instead of tables")]
HomeOpt = Annotated[Path | None, typer.Option("--home", help="cache folder (default .kernelpro)")]


def _value(choice: Any) -> str | None:
    return choice.value if choice is not None else None


def _message(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename:  # e.g. "Not a directory: 'x/cache'"
        where = f"{e.filename} -> {e.filename2}" if e.filename2 else str(e.filename)
        return f"{e.strerror}: {where}"
    return str(e)


def _resume_hint(e: BaseException) -> str:
    run_id, runs_dir = getattr(e, "run_id", None), getattr(e, "runs_dir", None)
    if not run_id:
        return "interrupted"
    cmd = f"kernelpro optimize --resume {shlex.quote(run_id)}"
    if runs_dir is not None and Path(runs_dir) != config_mod.Config.runs_dir:
        cmd += f" --runs-dir {shlex.quote(str(runs_dir))}"
    return f"interrupted: run {run_id} is saved; continue it with: {cmd}"


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Errors a user can act on become one line on stderr and exit code 2: no traceback spew."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from corpora import CorpusError
        from pipeline.candidates import CandidateError
        from pipeline.compile import ToolchainError
        from pipeline.loop import OptimizeError
        from pipeline.runlog import RunLogError
        from pipeline.stages import NoGPUError
        from pipeline.tasks import TaskError

        # index.store.StoreError is a RuntimeError: caught below without importing chromadb for every command.
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise  # click's Exit is a RuntimeError: let it through untouched
        except (
            TaskError,
            CandidateError,
            ToolchainError,
            NoGPUError,
            OptimizeError,
            RunLogError,
            CorpusError,
            ValueError,
            RuntimeError,
            OSError,  # a path that is a file where a folder belongs, a full disk: the user's to fix
        ) as e:
            # Messages carry paths, TOML errors and model text: never let Rich read them as markup.
            err.print(f"[bold red]error:[/] {escape(_message(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt as e:
            err.print(escape(_resume_hint(e)), highlight=False, soft_wrap=True)
            raise typer.Exit(130) from None

    return wrapper


def _say(text: str, console: Console | None = None) -> None:
    """A plain line of data: no markup, no highlighting, never wrapped."""
    (console or out).print(text, markup=False, highlight=False, soft_wrap=True)


def _progress(json_out: bool) -> tuple[Any, Callable[[str, int, int], None] | None]:
    """A bar on a terminal; without one (CI, a pipe) plain lines on stderr, about one per tenth of each
    stage; nothing with --json."""
    if json_out:
        return None, None
    if not sys.stderr.isatty():
        shown: set[tuple[str, int]] = set()

        def line(stage: str, done: int, total: int) -> None:
            step = (stage, 10 * done // total if total else 10)
            if step not in shown:
                shown.add(step)
                _say(f"{stage} {done}/{total}", err)

        return None, line
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
        str,
        typer.Option(
            help="comma-separated: eager, compile, max-autotune-no-cudagraphs, reduce-overhead, or none"
        ),
    ] = "eager,compile,max-autotune-no-cudagraphs",
    trials: Annotated[int | None, typer.Option(min=1, help="verification trials")] = None,
    device: Annotated[str | None, typer.Option(help="cuda, or cpu for Python stand-ins")] = None,
    home: HomeOpt = None,
) -> None:
    """Verify and time candidates against a task and its eager / torch.compile baselines."""
    from pipeline.stages import evaluate_candidates

    cfg = config_mod.load(home=home, energy=energy, trials=trials, device=device, baselines=_modes(baselines))
    bar, update = _progress(json_out)
    with bar or contextlib.nullcontext():
        results = evaluate_candidates(task, candidate, cfg, progress=update)
    names = [_folder_name(c) for c in candidate]
    if json_out:
        print(json.dumps([_result_json(r, n) for r, n in zip(results, names, strict=True)], indent=2))
    else:
        _print_results(results, names)
    if any(r.verdict.status != Status.OK for r in results):
        raise typer.Exit(1)


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip() and m.strip() != "none")
    unknown = set(modes) - set(config_mod.CHOICES["baselines"])
    if unknown:
        raise ValueError(f"unknown baseline mode(s): {', '.join(sorted(unknown))}")
    return modes


def _folder_name(path: Path) -> str:
    return Path(path).resolve().name or str(path)


def _result_json(r: Evaluation, folder: str) -> dict[str, Any]:
    m = r.measurement
    return {
        "candidate": r.key,
        "folder": folder,
        "build": to_dict(r.build) if r.build else None,
        "verdict": to_dict(r.verdict),
        "measurement": to_dict(m) if m else None,
        "speedup_eager": m.speedup_eager if m else None,
        "speedup_compile": m.speedup_compile if m else None,
        "fraction_of_floor": m.fraction_of_floor if m else None,
    }


def _print_results(results: list[Evaluation], names: list[str]) -> None:
    table = Table(title="kernelpro eval")
    cols = ("candidate", "key", "status", "kind", "ms (median)", "calls checked", "vs eager", "vs compile")
    for col in (*cols, "of floor", "J/call"):
        table.add_column(col)
    for r, name in zip(results, names, strict=True):
        m = r.measurement
        t = m.timing if m else None
        table.add_row(
            escape(name),
            r.key,
            r.verdict.status.value,
            r.verdict.kind.value if r.verdict.kind else "-",
            f"{t.median_ms:.4f} ±{100 * t.spread:.1f}%" if t else "-",
            str(t.checked_calls) if t else "-",  # measured calls whose outputs matched the reference
            _x(m.speedup_eager if m else None),
            _x(m.speedup_compile if m else None),
            f"{100 * m.fraction_of_floor:.0f}%" if m and m.fraction_of_floor else "-",
            f"{m.energy.joules_per_call:.4g}" if m and m.energy else "-",
        )
    out.print(table)
    for r, name in zip(results, names, strict=True):
        for reason in r.verdict.reasons:
            _say(f"  {name}: {reason}")
        if r.verdict.library_ops:
            _say(f"  {name}: hybrid, left to libraries: {', '.join(r.verdict.library_ops)}")


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
    from pipeline.stages import run_baselines

    cfg = config_mod.load(home=home, baselines=_modes(modes), energy=energy)
    task_info, base = run_baselines(task, cfg)
    record = {
        "task": task_info.id,
        "flops": task_info.flops,
        "min_bytes": task_info.min_bytes,
        **to_dict(base),
    }
    path = cfg.home / "baselines" / f"{task_info.id}-{task_info.source_hash[:10]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    if json_out:
        print(json.dumps(record, indent=2))
        return
    table = Table(title=f"baselines: {escape(task_info.id)}")
    for col in ("mode", "ms (median)", "spread", "compile s", "of floor"):
        table.add_column(col)
    floor = base.floor_ms
    for mode, t in base.timings.items():
        table.add_row(
            escape(mode),
            f"{t.median_ms:.4f}",
            f"{100 * t.spread:.1f}%",
            f"{base.compile_s.get(mode, 0):.1f}",
            f"{100 * floor / t.median_ms:.0f}%" if floor else "-",
        )
    out.print(table)
    for note in base.notes:
        _say(f"  {reasons.as_note(note)}")


@app.command()
@_user_errors
def calibrate(
    json_out: JsonOpt = False,
    force: Annotated[bool, typer.Option("--force", help="measure again even if cached")] = False,
    home: HomeOpt = None,
) -> None:
    """Measure this GPU's ceilings (copy bandwidth; fp32, tf32, bf16 matmul rates) once and cache them."""
    from pipeline.stages import REFUSED, ceilings, open_pool

    cfg = config_mod.load(home=home)
    if cfg.device != "cuda":
        raise ValueError(f"calibrate measures a GPU: device must be cuda, not {cfg.device}")
    with open_pool(cfg) as pool:
        c = ceilings(pool, cfg, force=force)
    if c is None:
        refused = [why for why, _ in REFUSED.values()]
        raise RuntimeError(refused[-1] if refused else "calibration gave no ceilings")
    if json_out:
        print(json.dumps(c.__dict__, indent=2))
        return
    table = Table(title=f"ceilings: {escape(c.gpu)}")
    table.add_column("ceiling")
    table.add_column("value")
    table.add_row("copy bandwidth (read + write)", f"{c.copy_bytes_per_s / 1e12:.2f} TB/s")
    table.add_row("fp32 matmul (TF32 off)", f"{c.fp32_flops / 1e12:.1f} TFLOP/s")
    table.add_row("tf32 matmul", f"{c.tf32_flops / 1e12:.1f} TFLOP/s")
    table.add_row("bf16 matmul", f"{c.bf16_flops / 1e12:.1f} TFLOP/s")
    if c.busy_percent is not None:
        table.add_row("other processes' use of the GPU while measured", f"{c.busy_percent:.0f}%")
    out.print(table)


@app.command()
@_user_errors
def doctor(home: HomeOpt = None, json_out: JsonOpt = False) -> None:
    """What this machine offers: GPU, driver, nvcc, ncu, cuobjdump, NVML energy, each sandbox layer, the
    CUTLASS headers and the index. Exit 1 when something a GPU run needs is missing."""
    from pipeline import doctor as doctor_mod

    checks = doctor_mod.gather(config_mod.load(home=home))
    if json_out:
        print(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        out.print(doctor_mod.render(checks))
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


@app.command()
@_user_errors
def selfcheck(
    suite: Annotated[list[Path], typer.Argument(help="task folders (searched recursively) or task files")],
    store: Annotated[Path, typer.Option(help="JSON-lines results, one per task; reused to resume")],
    budget_s: Annotated[
        float | None, typer.Option(min=1, help="stop cleanly before this many seconds")
    ] = None,
    levels: Annotated[list[str] | None, typer.Option(help="only these sub-folders, e.g. level1")] = None,
    markdown: Annotated[Path | None, typer.Option(help="write the summary as Markdown here")] = None,
    home: HomeOpt = None,
) -> None:
    """The harness's self-consistency check: each task's own reference, submitted as a hybrid candidate
    (its PyTorch ops plus a byte-copy kernel of ours), must verify OK wherever eager runs."""
    from pipeline import selfcheck as selfcheck_mod

    paths = selfcheck_mod.task_files(suite, levels)
    if not paths:
        raise ValueError(f"no task files under {', '.join(str(p) for p in suite)}")
    cfg = selfcheck_mod.sweep_config(config_mod.load(home=home))

    def on_row(row: dict[str, Any]) -> None:
        first = next((r for r in row["reasons"] if not reasons.is_note(r)), "")
        _say(f"{row['key']}: {row['status']} in {row['seconds']:.1f} s {first[:120]}".rstrip(), err)

    result = selfcheck_mod.run_suite(paths, cfg, store, budget_s=budget_s, on_row=on_row)
    if result.stopped:
        _say(f"stopped: {result.stopped}; {len(result.remaining)} tasks left: run the same command again")
    text = selfcheck_mod.markdown(result.rows)
    if markdown:
        markdown.write_text(text)
    from rich.markdown import Markdown

    out.print(Markdown(text))
    if result.summary()["failures"]:
        raise typer.Exit(1)


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
    if output.is_dir():
        raise ValueError(f"-o {output} is a folder; give the path of the .py file to write")
    if not output.parent.is_dir():
        raise ValueError(f"-o {output}: the folder {output.parent} does not exist")
    cfg = config_mod.load(home=home)
    cand = load_candidate(candidate, task.stem)
    (build,) = compile_candidates([cand], cfg)
    if build.status != Status.OK:
        raise RuntimeError(f"compile failed ({build.status.value}):\n{build.log}")
    path = export_standalone(cand, build, output)
    _say(f"wrote {path} ({path.stat().st_size} bytes, {build.arch})")


@app.command()
@_user_errors
def profile(
    task: TaskOpt,
    candidate: Annotated[Path, typer.Option("--candidate", "-c", help="candidate folder")],
    feedback: Annotated[
        FeedbackMode, typer.Option(help="advice (for prompts), json, raw (metrics only) or none")
    ] = FeedbackMode.advice,
    all_tools: Annotated[
        bool, typer.Option("--all-tools", help="run every tool, not only those for the class")
    ] = False,
    home: HomeOpt = None,
) -> None:
    """Verify a candidate, collect counters (ncu), SASS and a system profile, and print the tools' advice."""
    from pipeline.profile.advice import Feedback, advice_block, analyze, as_json, raw_block
    from pipeline.stages import profile_candidate

    mode = Feedback(_value(feedback))
    cfg = config_mod.load(home=home, baselines=("eager",))
    pr = profile_candidate(task, candidate, cfg)
    for note in pr.notes:
        _say(f"note: {note}", err)
    if pr.evidence is None:
        _print_results([pr.evaluation], [_folder_name(candidate)])
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
        _say(advice_block(cls, findings))


# --- index: build, status, query, drop --------------------------------------------------------------

# --- optimize and show ------------------------------------------------------------------------------------


def _live_table(live: Any) -> Table:
    t = Table(title=f"kernelpro optimize · run {escape(live.run_id)}", show_header=False, box=None)
    t.add_row(
        "task", escape(f"{live.task_id}  ({live.policy} policy, {live.search}, objective {live.objective})")
    )
    t.add_row("iteration", f"{live.iteration}   evaluations {live.evaluations}/{live.max_evals}")
    t.add_row("best over eager", _x(live.best_speedup_eager))
    t.add_row("best over torch.compile", _x(live.best_speedup_compile))
    t.add_row("statuses", escape(", ".join(f"{k} {v}" for k, v in sorted(live.statuses.items())) or "-"))
    if live.tokens:
        t.add_row("LLM", f"{live.tokens} tokens, ${live.cost_usd:.2f}")
    t.add_row("now", escape(live.step))
    return t


def _live_lines() -> Callable[[Any], None]:
    """Without a terminal: one plain line on stderr per step of the run (a CI log shows it is alive)."""
    last: list[str] = [""]

    def show(live: Any) -> None:
        line = f"run {live.run_id}: {live.evaluations}/{live.max_evals} evaluations"
        if live.best_speedup_eager:
            line += f", best {_x(live.best_speedup_eager)} over eager"
        line += f"; {live.step}"
        if line != last[0]:
            last[0] = line
            _say(line, err)

    return show


def _check_replay(paths: list[Path]) -> None:
    for p in paths:
        if not (p / "log.jsonl" if p.is_dir() else p).is_file():
            raise ValueError(
                f"--replay {p}: no run log there (give a log.jsonl, or a run folder holding one)"
            )


RunCorpusOpt = Annotated[
    str | None,
    typer.Option(
        "--corpus",
        help="building blocks from: a corpus (corpora/*.toml), corpora joined by '+' (cutlass+cccl), or none",
    ),
]


RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        help="evaluate on a Ray cluster: local (start one on this machine's GPUs), auto (the cluster this "
        "machine is in) or its ADDRESS; one actor per GPU, nvcc as CPU tasks",
    ),
]


@app.command()
@_user_errors
def optimize(
    task: Annotated[Path | None, typer.Option("--task", "-t", help="KernelBench-format task file")] = None,
    policy: Annotated[
        Policy | None, typer.Option(help="llm, expert, or auto (llm when an endpoint is set)")
    ] = None,
    search: Annotated[Search | None, typer.Option(help="mcts or greedy")] = None,
    objective: Annotated[Objective | None, typer.Option(help="time, energy (J per call) or edp")] = None,
    speed_tolerance: Annotated[
        float | None,
        typer.Option(
            min=0, help="energy, edp: no energy credit this fraction slower than the fastest (0.02)"
        ),
    ] = None,
    max_evals: Annotated[int | None, typer.Option(min=1, help="candidates evaluated on the GPU")] = None,
    max_wall: Annotated[
        float | None, typer.Option(min=1, help="wall-time budget in seconds, across resumes")
    ] = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="LLM token budget")] = None,
    max_cost: Annotated[float | None, typer.Option(min=0.01, help="LLM cost budget in USD")] = None,
    children: Annotated[
        int | None, typer.Option(min=1, help="candidates per expansion, evaluated in parallel")
    ] = None,
    feedback: Annotated[
        FeedbackMode | None, typer.Option(help="advice, json, raw or none (ablations)")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(min=0, help="seed of the search and the verification inputs")
    ] = None,
    memory: Annotated[bool | None, typer.Option("--memory/--no-memory", help="lessons across runs")] = None,
    corpus: RunCorpusOpt = None,
    ray: RayOpt = None,
    resume: Annotated[
        str | None, typer.Option(help="continue the run with this id (its recorded settings and budgets)")
    ] = None,
    more: Annotated[
        int | None, typer.Option(min=1, help="with --resume: this many more evaluations, a finished run too")
    ] = None,
    replay: Annotated[
        list[Path] | None,
        typer.Option(help="answer evaluations from run logs recorded on a GPU (no GPU needed); repeatable"),
    ] = None,
    runs_dir: Annotated[Path | None, typer.Option(help="where runs are written (default runs/)")] = None,
    json_out: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Search for the fastest correct kernel for a task: generate, compile, verify, time, profile, repeat."""
    from rich.live import Live as RichLive

    from pipeline.loop import optimize as run_optimize

    if task is None and resume is None:
        raise ValueError("give --task, or --resume RUN_ID")
    if more is not None and resume is None:
        raise ValueError("--more continues a run: give it with --resume RUN_ID")
    if more is not None and max_evals is not None:
        raise ValueError(
            "give --more (evaluations on top of those done) or --max-evals (the total), not both"
        )
    _check_replay(replay or [])
    cfg = config_mod.load(
        home=home, policy=_value(policy), search=_value(search), objective=_value(objective),
        speed_tolerance=speed_tolerance, max_evals=max_evals, max_wall_s=max_wall, max_tokens=max_tokens,
        max_cost_usd=max_cost,
        children_per_expand=children, feedback=_value(feedback), seed=seed, memory=memory, runs_dir=runs_dir,
        corpus=corpus, ray=ray,
    )  # fmt: skip
    given = {k for k, v in (("max_evals", max_evals), ("max_wall_s", max_wall), ("max_tokens", max_tokens),
                            ("max_cost_usd", max_cost)) if v is not None}  # fmt: skip
    kw: dict[str, Any] = {"resume": resume, "replay": replay or None, "more": more, "budgets_given": given}
    if not json_out and sys.stderr.isatty():
        with RichLive(console=err, refresh_per_second=4, transient=False) as view:
            result = run_optimize(
                task or Path(""), cfg, progress=lambda live: view.update(_live_table(live)), **kw
            )
    else:
        result = run_optimize(task or Path(""), cfg, progress=None if json_out else _live_lines(), **kw)
    summary = {
        "run_id": result.run_id, "folder": str(result.folder), "stop_reason": result.stop_reason,
        "best_key": result.best_key, "best_speedup_eager": result.best_speedup_eager,
        "best_speedup_compile": result.best_speedup_compile, "evaluations": result.evaluations,
        "report": str(result.report) if result.report else None,
        "exported": str(result.exported) if result.exported else None, "notes": list(result.notes),
        "finished_before": result.finished_before,
    }  # fmt: skip
    if json_out:
        print(json.dumps(summary, indent=2))
        return
    if result.finished_before:
        _say(f"run {result.run_id} is finished ({result.stop_reason}; {result.evaluations} evaluations); "
             f"nothing to resume: add --more N for N more evaluations")  # fmt: skip
        return
    _say(f"run {result.run_id}: {result.stop_reason}; {result.evaluations} evaluations")
    if result.best_key:
        _say(f"best {result.best_key}: {_x(result.best_speedup_eager)} over eager, "
             f"{_x(result.best_speedup_compile)} over torch.compile")  # fmt: skip
    else:
        _say("no correct candidate beat the search's start; see the report for every status")
    for note in result.notes:
        _say(f"note: {note}")
    _say(f"report: {result.report}")


@app.command()
@_user_errors
def show(
    run_id: Annotated[str | None, typer.Argument(help="a run id; none lists the runs")] = None,
    runs_dir: Annotated[Path | None, typer.Option(help="where runs are written (default runs/)")] = None,
    json_out: JsonOpt = False,
) -> None:
    """List runs, or print one run's report (rendered from its log; the run folder is not touched)."""
    from rich.markdown import Markdown

    from pipeline import events, report, runstate

    cfg = config_mod.load(runs_dir=runs_dir)
    if run_id is None:
        runs = runstate.list_runs(cfg.runs_dir)
        if json_out:
            print(json.dumps([to_dict(r) for r in runs], indent=2))
            return
        if not runs:
            _say(f"no runs under {cfg.runs_dir}; start one with `kernelpro optimize --task T`")
            return
        table = Table("run", "task", "status", "evaluations", "best over eager")
        for r in runs:
            table.add_row(
                escape(r.run_id), escape(r.task_id), r.status, str(r.evaluations), _x(r.best_speedup)
            )
        out.print(table)
        return
    folder = cfg.runs_dir / run_id
    if not (folder / "log.jsonl").is_file():
        raise ValueError(f"no run {run_id} under {cfg.runs_dir}")
    if json_out:
        state = report.load_view(folder).state
        end = events.encode(state.end)[1] if state.end else None
        usage = {"tokens": state.usage.tokens, "cost_usd": state.usage.cost_usd, "calls": state.usage.calls}
        print(json.dumps({"run_id": run_id, "end": end, "usage": usage, "curve": state.curve}, indent=2))
        return
    md = Markdown(report.render(folder).markdown)
    if out.is_terminal:
        out.print(md)
        return
    with out.capture() as captured:  # piped: a readable width, and no padding to it at each line's end
        out.print(md, width=110)
    print("\n".join(line.rstrip() for line in captured.get().splitlines()))


# --- bench: a suite, one budget ---------------------------------------------------------------------------


@app.command()
@_user_errors
def bench(
    suite: Annotated[
        Path | None,
        typer.Argument(
            help="a folder of KernelBench-format task files, or a list file (one task path a line)"
        ),
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="the bench folder: runs, one row per task, reports")
    ] = None,
    evals: Annotated[int | None, typer.Option(min=1, help="evaluations per task (default 12)")] = None,
    budget_s: Annotated[
        float | None, typer.Option(min=1, help="start no task the slowest so far would not finish in")
    ] = None,
    policy: Annotated[Policy | None, typer.Option(help="expert (default), llm or auto")] = None,
    search: Annotated[Search | None, typer.Option(help="mcts (default) or greedy")] = None,
    corpus: RunCorpusOpt = None,
    ray: RayOpt = None,
    energy: Annotated[
        bool | None,
        typer.Option(
            "--energy/--no-energy",
            help="measure energy per call (eager's, and the best's in its final re-measure); --no-energy "
            "saves 10-30 s a task under --objective time (default: the config's, on)",
        ),
    ] = None,
    match: Annotated[
        str | None, typer.Option(help="only tasks whose key (folder/name) this regex finds")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="continue the bench in --out: skip tasks done")
    ] = False,
    retry: Annotated[
        str | None,
        typer.Option(
            help="with --resume: run again the tasks whose rows have these statuses, comma-separated "
            "(e.g. unsupported,crash; with --match, only those tasks: --retry ok --match NAME re-runs one "
            "after a fix); an old row moves to results.retried.jsonl when its task's new row lands"
        ),
    ] = None,
    replay: Annotated[
        Path | None,
        typer.Option(help="answer evaluations from run logs recorded on a GPU under this folder (no GPU)"),
    ] = None,
    report_dir: Annotated[
        Path | None, typer.Option("--report", help="re-render the reports of this bench folder; run nothing")
    ] = None,
    json_out: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Optimize every task of a suite with one budget: one run and one row per task, resumable, then a
    summary and reports (JSON, Markdown, HTML with plots) in the bench folder."""
    from pipeline import bench as bench_mod

    if report_dir is not None:
        if suite is not None or out_dir is not None:
            raise ValueError("--report re-renders a bench folder: give it without SUITE and --out")
        reports = bench_mod.write_reports(report_dir)
        manifest, rows = bench_mod.load_rows(report_dir)
        _bench_output(report_dir, manifest, rows, reports, None, json_out)
        return
    if suite is None or out_dir is None:
        raise ValueError(
            "give a SUITE (a folder of task files or a list file) and --out DIR, or --report DIR"
        )
    retry_statuses = tuple(dict.fromkeys(x.strip() for x in (retry or "").split(",") if x.strip()))
    if retry_statuses and not resume:
        raise ValueError("--retry re-runs tasks of a bench that exists: add --resume")
    tasks = bench_mod.load_suite(suite, match)
    index = bench_mod.ReplayIndex.scan(replay) if replay is not None else None
    if corpus is not None:
        config_mod.corpus_names(corpus)  # a bad value is one line before the bench folder is made
    settings = {"evals": evals, "policy": _value(policy), "search": _value(search), "corpus": corpus,
                "energy": energy}  # fmt: skip
    manifest = bench_mod.open_bench(out_dir, tasks, settings, resume)
    cfg = config_mod.load(home=home, ray=ray)
    bar, update = _progress(json_out)

    def progress(done: int, total: int, key: str) -> None:
        if update:
            update("tasks", done, total)

    def on_row(row: dict[str, Any]) -> None:
        if json_out:
            return
        what = (
            _x(row.get("speedup_eager")) + " over eager" if row.get("speedup_eager") else row.get("error", "")
        )
        _say(f"{row['key']}: {row['status']} in {row['wall_s']:.1f} s; {what}"[:200], err)

    try:
        with bar or contextlib.nullcontext():
            result = bench_mod.run_bench(
                out_dir,
                tasks,
                cfg,
                manifest,
                budget_s=budget_s,
                replay=index,
                progress=progress,
                on_row=on_row,
                retry=retry_statuses,
            )
    except KeyboardInterrupt:
        # Not optimize's hint: the bench resumes the task in flight from its run log by itself.
        cmd = shlex.join(["kernelpro", "bench", str(suite), "--out", str(out_dir), "--resume"])
        _say(f"interrupted: the rows written are kept; continue the bench with: {cmd}", err)
        raise typer.Exit(130) from None
    _bench_output(out_dir, manifest, list(result.rows), result.reports, result, json_out)


def _n(tasks: int) -> str:
    return f"{tasks} task" if tasks == 1 else f"{tasks} tasks"


def _bench_output(folder: Path, manifest: dict[str, Any], rows: list[dict[str, Any]], reports: dict[str, Path],
                  result: Any, json_out: bool) -> None:  # fmt: skip
    from pipeline import bench as bench_mod

    s = bench_mod.summary(rows, manifest.get("tasks"))
    if json_out:
        doc: dict[str, Any] = {
            "bench": str(folder),
            "suite": manifest["suite"],
            "settings": manifest["settings"],
        }
        if result is not None:
            doc.update(ran=list(result.ran), skipped=list(result.skipped), remaining=list(result.remaining),
                       stopped=result.stopped)  # fmt: skip
        doc.update(summary=s, reports={k: str(v) for k, v in reports.items()})
        print(json.dumps(doc, indent=2, default=str))
        return
    table = Table(title=f"kernelpro bench: {escape(str(folder))}")
    for col in (
        "candidates",
        "tasks",
        "ours over eager",
        "torch.compile over eager",
        "ours over torch.compile",
    ):
        table.add_column(col)
    for name, g in (("all", s), *s["by_kind"].items()):
        table.add_row(name, str(g["timed"]), _x(g["ours_over_eager"]), _x(g["compile_over_eager"]),
                      _x(g["ours_over_compile"]))  # fmt: skip
    out.print(table)
    statuses = ", ".join(f"{k} {n}" for k, n in s["statuses"].items()) or "none yet"
    _say(f"{s['tasks']} of {manifest.get('tasks', '?')} tasks written, {s['verified']} verified ({statuses})")
    if s["fraction_of_floor"]:
        _say(
            f"roofline: {100 * s['fraction_of_floor']:.1f}% of the floor (geomean over {_n(s['floor_tasks'])})"
        )
    if result is not None and result.skipped:
        _say(f"{_n(len(result.skipped))} had a row already: skipped")
    if result is not None and result.stopped:
        _say(f"stopped: {result.stopped}; {_n(len(result.remaining))} left: run it again with --resume")
    _say(f"report: {reports['html']}")


# --- experiment: cells of settings over one suite, compared with a baseline cell -----------------------------


@app.command()
@_user_errors
def experiment(
    file: Annotated[
        Path | None,
        typer.Argument(
            metavar="EXPERIMENT.toml",
            help="the experiment: suite, evals, seeds, fixed and matrix factors, baseline",
        ),
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="the experiment folder: a bench per cell and seed, reports")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="continue the experiment in --out: skip cells and tasks done")
    ] = False,
    replay: Annotated[
        Path | None,
        typer.Option(help="answer evaluations from run logs recorded on a GPU under this folder (no GPU)"),
    ] = None,
    report_dir: Annotated[
        Path | None,
        typer.Option("--report", help="re-render the reports of this experiment folder; run nothing"),
    ] = None,
    ray: RayOpt = None,
    json_out: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Run every cell of an experiment (each a bench of the suite, once per seed), resumably, then compare
    each cell with the baseline cell task by task: geomean ratio, bootstrap interval, Wilcoxon test, wins and
    losses, and the evaluations-to-best curves (JSON, Markdown, HTML)."""
    from pipeline import bench as bench_mod
    from pipeline import experiment as exp_mod

    if report_dir is not None:
        if file is not None or out_dir is not None:
            raise ValueError(
                "--report re-renders an experiment folder: give it without the TOML file and --out"
            )
        reports = exp_mod.write_reports(report_dir)
        _experiment_output(report_dir, reports, None, json_out)
        return
    if file is None or out_dir is None:
        raise ValueError("give the experiment's TOML file and --out DIR, or --report DIR")
    exp = exp_mod.load_experiment(file)
    suite = bench_mod.load_suite(exp.suite)
    index = bench_mod.ReplayIndex.scan(replay) if replay is not None else None
    exp_mod.open_experiment(out_dir, exp, suite, resume)
    cfg = config_mod.load(home=home, ray=ray)
    bar, update = _progress(json_out)

    def cells(done: int, total: int, label: str) -> None:
        if update:
            update("cells", done, total)

    def tasks(done: int, total: int, key: str) -> None:
        if update:
            update("tasks of the cell", done, total)

    def on_row(cell: str, seed: int, row: dict[str, Any]) -> None:
        if json_out:
            return
        what = (
            _x(row.get("speedup_eager")) + " over eager" if row.get("speedup_eager") else row.get("error", "")
        )
        _say(f"{cell} seed {seed}: {row['key']}: {row['status']} in {row['wall_s']:.1f} s; {what}"[:200], err)

    try:
        with bar or contextlib.nullcontext():
            result = exp_mod.run_experiment(out_dir, exp, suite, cfg, replay=index, progress=cells,
                                            task_progress=tasks, on_row=on_row)  # fmt: skip
    except KeyboardInterrupt:
        cmd = shlex.join(["kernelpro", "experiment", str(file), "--out", str(out_dir), "--resume"])
        if replay is not None:
            cmd += " " + shlex.join(["--replay", str(replay)])
        _say(f"interrupted: the rows written are kept; continue the experiment with: {cmd}", err)
        raise typer.Exit(130) from None
    _experiment_output(out_dir, result.reports, result, json_out)


def _experiment_output(folder: Path, reports: dict[str, Path], result: Any, json_out: bool) -> None:
    data = json.loads(reports["json"].read_text())
    if json_out:
        doc: dict[str, Any] = {"experiment": str(folder), "name": data["name"], "suite": data["suite"],
                               "definition": data["definition"]}  # fmt: skip
        if result is not None:
            doc["runs"] = [{"cell": r.cell, "seed": r.seed, "ran": list(r.ran), "skipped": list(r.skipped),
                            "error": r.error} for r in result.runs]  # fmt: skip
        doc.update(cells=data["cells"], comparisons=data["comparisons"], retrieval=data.get("retrieval"),
                   reports={k: str(v) for k, v in reports.items()})  # fmt: skip
        print(json.dumps(doc, indent=2, default=str))
        return
    table = Table(
        title=f"kernelpro experiment {escape(data['name'])}: against {escape(data['definition']['baseline'])}"
    )
    for col in ("cell", "paired tasks", "geomean ratio", "interval", "p-value", "wins/losses/ties"):
        table.add_column(col)
    for c in data["comparisons"]:
        ci = f"{c['ci'][0]:.3f}-{c['ci'][1]:.3f}" if c["ci"] else "-"
        p = f"{c['p_value']:.3g}" if c["p_value"] is not None else c["test"]
        g = f"{c['geomean_ratio']:.3f}" if c["geomean_ratio"] else "-"
        table.add_row(
            escape(c["cell"]), str(c["paired"]), g, ci, escape(p), f"{c['wins']}/{c['losses']}/{c['ties']}"
        )
    out.print(table)
    for name, c in data["cells"].items():
        _say(f"{name}: {c['written']} rows, {c['verified']} verified, {_x(c['ours_over_eager'])} over eager")
    retrieval = data.get("retrieval") or {}
    if retrieval.get("error"):
        _say(f"retrieval not measured: {retrieval['error']}")
    for corpus, r in retrieval.get("corpora", {}).items():
        k = retrieval["k"]
        got = f"recall@{k} {r['recall']:.3f}, MRR {r['mrr']:.3f}" if "recall" in r else r.get("error", "")
        _say(f"retrieval of {corpus} on {retrieval['cases']} queries: {got}")
    if result is not None:
        done = sum(len(r.skipped) for r in result.runs)
        if done:
            _say(f"{done} rows were written already: skipped")
        for r in result.runs:
            if r.error:
                _say(f"{r.cell} seed {r.seed}: could not run: {r.error}")
    _say(f"report: {reports['html']}")


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
    bar, update = _progress(json_out)
    with bar or contextlib.nullcontext():
        r = build_index(corpus, cfg, progress=update, folder=folder)
    if json_out:
        print(json.dumps(r.__dict__, indent=2))
        return
    table = Table(title=f"index {escape(r.collection)}")
    for col in (
        "files",
        "changed",
        "unchanged",
        "removed",
        "chunks",
        "added",
        "embedded",
        "deleted",
        "seconds",
        "size",
    ):
        table.add_column(col)
    table.add_row(
        str(r.files_total),
        str(r.files_changed),
        str(r.files_unchanged),
        str(r.files_removed),
        str(r.chunks_total),
        str(r.chunks_added),
        str(r.chunks_embedded),
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
        _say("no index yet; build one with `kernelpro index build`")
        return
    table = Table(title="kernelpro index")
    for col in ("collection", "corpus", "version", "chunks", "files", "model", "built", "sidecars", "chroma"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            escape(r["collection"]),
            escape(str(r["corpus"])),
            escape(str(r["version"])),
            str(r["chunks"] if r["chunks"] is not None else "?"),
            str(r["files"] if r["files"] is not None else "?"),
            escape(str(r["model"])),
            escape(str(r["built_at"] or "-")),
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
    _say(f"dropped {name}")


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
        _say("no building blocks found")
        return
    for i, b in enumerate(rows, 1):
        where = b.get("path", "?")
        if b.get("start_line"):
            where += f":{b['start_line']}-{b.get('end_line', '')}"
        score = b.get("score")
        head = f"[bold]{i}. {escape(str(b.get('symbol', '')))}[/]  {escape(str(where))}"
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
    from index.hunt import evaluate, get_hunter

    path = cases or Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hunt_eval.toml"
    if not path.is_file():
        raise ValueError(f"evaluation cases not found: {path}; pass --cases FILE")
    loaded = _load_cases(path)  # a bad case is named before the index is opened (seconds, a model load)
    report = evaluate(get_hunter(config_mod.load(home=home), corpus), loaded)
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
        table.add_row(
            escape(r.case.query), str(r.rank or "-"), escape(r.top_paths[0] if r.top_paths else "-")
        )
    if misses:
        out.print(table)
    _say(f"recall@5 {report.recall_at_5:.3f}  MRR {report.mrr:.3f}  p50 {report.p50_ms:.1f} ms")


def _load_cases(path: Path) -> list[Any]:
    """The evaluation cases, each checked for its query and its expected files first."""
    import tomllib

    from index.hunt import load_cases

    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None
    raw = data.get("case")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: no [[case]] tables")
    for i, c in enumerate(raw, 1):
        missing = [k for k in ("query", "expect") if not c.get(k)]
        if missing:
            what = f"{c['query']!r}" if c.get("query") else "no query"
            raise ValueError(f"{path}: case {i} ({what}) has no `{'` and no `'.join(missing)}`")
    return load_cases(path)


# --- memory: list, search, clear --------------------------------------------------------------------

memory_app = typer.Typer(
    no_args_is_help=True, help="Lessons the search keeps across runs (Chroma, next to the index)."
)
app.add_typer(memory_app, name="memory")
_EMPTY_MEMORY = "the memory is empty; `kernelpro optimize` records lessons as it runs"


def _lessons(n: int) -> str:
    return f"{n} lesson" if n == 1 else f"{n} lessons"


def _when(created: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M") if created else "-"


@memory_app.command("list")
@_user_errors
def memory_list(
    limit: Annotated[int | None, typer.Option("--limit", "-n", help="only the newest N lessons")] = None,
    json_out: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """List stored lessons, newest first."""
    from pipeline.memory import Memory, as_dict

    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    lessons = Memory(config_mod.load(home=home)).list(limit)
    if json_out:
        print(json.dumps([as_dict(s) for s in lessons], indent=2))
        return
    if not lessons:
        _say(_EMPTY_MEMORY)
        return
    table = Table(title=f"kernelpro memory: {_lessons(len(lessons))}")
    for col in ("created", "task", "edit", "outcome", "finding", "run"):
        table.add_column(col)
    for s in lessons:
        table.add_row(
            *(escape(x) for x in (_when(s.created), s.task_id, s.edit, s.outcome, s.finding, s.run_id or "-"))
        )
    out.print(table)


@memory_app.command("search")
@_user_errors
def memory_search(
    query: Annotated[str, typer.Argument(help="a task or a problem in words, e.g. 'layernorm memory-bound'")],
    k: Annotated[int, typer.Option("-k", help="how many lessons")] = 5,
    helpful: Annotated[bool, typer.Option("--helpful", help="only edits that made a kernel faster")] = False,
    json_out: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Find the lessons nearest to a description (cosine similarity of embeddings)."""
    from pipeline.memory import Memory, as_dict

    if not query.strip():
        raise ValueError("the query is empty; describe a task or a problem")
    if k < 1:
        raise ValueError(f"-k must be at least 1, got {k}")
    hits = Memory(config_mod.load(home=home)).hits(query, k=k, only_helpful=helpful)
    if json_out:
        print(json.dumps([{**as_dict(s), "similarity": sim} for s, sim in hits], indent=2))
        return
    if not hits:
        _say(_EMPTY_MEMORY if not helpful else "no helpful lessons stored yet")
        return
    table = Table(title=f"memory: {escape(query)}")
    for col in ("sim", "task", "edit", "outcome", "finding", "features"):
        table.add_column(col)
    for s, sim in hits:
        table.add_row(
            f"{sim:.2f}", *(escape(x) for x in (s.task_id, s.edit, s.outcome, s.finding, s.task_features))
        )
    out.print(table)


@memory_app.command("clear")
@_user_errors
def memory_clear(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
    home: HomeOpt = None,
) -> None:
    """Delete every stored lesson (the source index is not touched)."""
    from pipeline.memory import Memory

    mem = Memory(config_mod.load(home=home))
    n = mem.count()
    if n == 0:
        _say("the memory is already empty")
        return
    if not yes:
        if not sys.stdin.isatty():
            # Nobody can answer a prompt here (a script, CI): refuse rather than hang or guess.
            raise ValueError(f"refusing to delete {_lessons(n)} without confirmation; pass --yes")
        if not typer.confirm(f"Delete {_lessons(n)} from {mem.where}?", default=False):
            _say("kept the memory")
            raise typer.Exit(1)
    _say(f"deleted {_lessons(mem.clear())}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
