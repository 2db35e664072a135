"""`kernelpro experiment` on the CPU: two cells (MCTS and greedy, the expert policy) run as benches over a small
suite, their evaluations answered from the run logs recorded on the H200 (tests/fixtures/runs/), as
tests/test_bench.py does; resume; the paired statistics on hand-made rows with known answers; the
evaluations-to-best curve from real run logs; the TOML's errors; and the command."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import wilcoxon
from typer.testing import CliRunner

from pipeline import bench, config
from pipeline import experiment as ex
from pipeline.cli import app
from pipeline.runlog import read_events
from pipeline.runstate import fold

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "tests" / "fixtures" / "runs"
SOFTMAX = ROOT / "tasks" / "softmax.py"
EVALS = 8

TOML = """
name = "ablation"
suite = "suite"
evals = {evals}
seeds = {seeds}
baseline = "search=mcts"

[fixed]
policy = "expert"

[matrix]
search = ["mcts", "greedy"]
"""


def make_experiment(root: Path, seeds: str = "[0]", evals: int = EVALS, tasks: int = 3) -> Path:
    """Two tasks with recordings (the softmax task under two names) and one without; two cells."""
    level = root / "suite" / "level1"
    level.mkdir(parents=True)
    shutil.copy(SOFTMAX, level / "1_Softmax.py")
    if tasks > 1:
        shutil.copy(SOFTMAX, level / "2_SoftmaxAgain.py")
        shutil.copy(ROOT / "tasks" / "layernorm.py", level / "3_LayerNorm.py")
    path = root / "ablation.toml"
    path.write_text(TOML.format(evals=evals, seeds=seeds))
    return path


def start(root: Path, toml: Path, out: Path, resume: bool = False, **kw):
    exp = ex.load_experiment(toml)
    suite = bench.load_suite(exp.suite)
    ex.open_experiment(out, exp, suite, resume)
    cfg = config.load(home=root / "home")
    return ex.run_experiment(out, exp, suite, cfg, replay=bench.ReplayIndex.scan(RECORDED), **kw)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("experiment")
    toml = make_experiment(root)
    seen: list[tuple[int, int, str]] = []
    result = start(root, toml, root / "out", progress=lambda *a: seen.append(a))
    return root, toml, result, seen


def rows_of(out: Path, cell: str, seed: int = 0) -> list[dict]:
    store = ex.cell_folder(out, cell, seed) / bench.STORE
    return [json.loads(x) for x in store.read_text().splitlines()]


def test_each_cell_and_seed_is_a_bench_with_its_own_settings(ran):
    _, _, result, seen = ran
    assert [(r.cell, r.seed, r.error) for r in result.runs] == [
        ("search=mcts", 0, None),
        ("search=greedy", 0, None),
    ]
    assert seen[0] == (0, 2, "search=mcts seed 0") and seen[-1][:2] == (2, 2)
    for cell, search in (("search=mcts", "mcts"), ("search=greedy", "greedy")):
        folder = ex.cell_folder(result.out, cell, 0)
        manifest = bench.read_manifest(folder)
        assert manifest["settings"] == {"evals": EVALS, "policy": "expert", "search": search, "seed": 0,
                                        "feedback": "advice", "objective": "time", "memory": False,
                                        "corpus": "cutlass"}  # fmt: skip
        rows = {r["key"]: r for r in rows_of(result.out, cell)}
        assert [r["status"] for r in rows.values()] == ["ok", "ok", "no_recording"]
        for key in ("level1/1_Softmax", "level1/2_SoftmaxAgain"):
            state = fold(read_events(folder / bench.RUNS / rows[key]["run_id"] / "log.jsonl"))
            assert state.header.search == search and state.evaluations == EVALS
            assert state.header.config["seed"] == "0" and state.header.config["memory"] == "False"


def test_the_comparison_pairs_the_tasks_both_cells_verified(ran):
    _, _, result, _ = ran
    data = json.loads((result.out / "summary.json").read_text())
    (c,) = data["comparisons"]
    assert (c["cell"], c["baseline"]) == ("search=greedy", "search=mcts")
    mcts = {r["key"]: r for r in rows_of(result.out, "search=mcts")}
    greedy = {r["key"]: r for r in rows_of(result.out, "search=greedy")}
    keys = ["level1/1_Softmax", "level1/2_SoftmaxAgain"]  # the LayerNorm task has no row to pair
    want = [greedy[k]["ours_ms"] / mcts[k]["ours_ms"] for k in keys]
    assert [t["key"] for t in c["tasks"]] == keys and c["paired"] == 2
    assert [t["ratio"] for t in c["tasks"]] == pytest.approx(want, rel=1e-12)
    assert c["geomean_ratio"] == pytest.approx(math.exp(sum(map(math.log, want)) / 2), rel=1e-12)
    # At this budget greedy and MCTS reach softmax kernels 0.4% apart (recorded on the H200): closer than
    # the 1% timing noise, so two ties, not losses; the signed-rank test still sees the sign of the
    # differences: with two tasks its exact p-value is 2/4 (both signs alike: 2 of the 4 patterns).
    assert all(1 < w < 1 + ex.TIE for w in want) and (c["wins"], c["losses"], c["ties"]) == (0, 0, 2)
    assert c["p_value"] == pytest.approx(wilcoxon(np.log(want)).pvalue) == 0.5
    assert c["test"].startswith("wilcoxon") and c["ci"] == pytest.approx([c["geomean_ratio"]] * 2)
    cells = data["cells"]
    assert cells["search=mcts"]["written"] == 3 and cells["search=mcts"]["verified"] == 2
    assert cells["search=greedy"]["factors"]["search"] == "greedy"


def test_the_curve_is_the_best_so_far_of_each_run_log_averaged(ran):
    _, _, result, _ = ran
    data = json.loads((result.out / "summary.json").read_text())
    for cell in ("search=mcts", "search=greedy"):
        curves = []
        for r in rows_of(result.out, cell):
            if not r.get("run_id"):
                continue
            state = fold(
                read_events(ex.cell_folder(result.out, cell, 0) / bench.RUNS / r["run_id"] / "log.jsonl")
            )
            # From the fold's own curve (evaluation, best so far), independently of best_so_far.
            curves.append([max([1.0, *(b for n, b in state.curve if n <= i)]) for i in range(1, EVALS + 1)])
        got = data["cells"][cell]
        assert got["curve_runs"] == 2
        want = [math.exp(sum(math.log(c[i]) for c in curves) / 2) for i in range(EVALS)]
        assert got["curve"] == pytest.approx(want, rel=1e-12)
        assert got["curve"][-1] == pytest.approx(
            max(r.get("speedup_eager") or 0 for r in rows_of(result.out, cell))
        )


def test_the_reports_hold_the_comparison_and_the_curve(ran):
    _, _, result, _ = ran
    data = json.loads((result.out / "summary.json").read_text())
    c = data["comparisons"][0]
    md = (result.out / "report.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| search=greedy | 2 |"))
    assert (
        f"| {c['geomean_ratio']:.3f} |" in line and f"| {c['wins']} | {c['losses']} | {c['ties']} |" in line
    )
    assert "| level1/1_Softmax | " in md and "- baseline: `search=mcts`" in md
    html = (result.out / "report.html").read_text()
    assert html.count("<svg") == 1 and 'id="evaluations-to-best"' in html
    assert 'id="curve-search=mcts"' in html and 'id="curve-search=greedy"' in html
    assert "- memory:" not in md and "- objective:" not in md
    from pipeline import suite_report

    data["cells"]["search=greedy"]["factors"].update(memory=True, objective="edp")
    md = suite_report.experiment_markdown(data)  # caveats said where a cell has them
    assert (
        "- memory: each cell with memory on learns in a lesson store of its own" in md
        and "- objective: a cell that minimises" in md
    )


def test_the_copy_beside_the_results_is_the_same_experiment(ran):
    _, toml, result, _ = ran
    copy = ex.load_experiment(result.out / ex.COPY)
    assert copy.definition() == ex.load_experiment(toml).definition()
    assert copy.suite.resolve() == (toml.parent / "suite").resolve()
    assert json.loads((result.out / ex.MANIFEST).read_text())["definition"] == copy.definition()


def test_resume_runs_only_what_has_no_row(ran, tmp_path):
    root, toml, result, _ = ran
    out = tmp_path / "out"
    shutil.copytree(result.out, out)
    store = ex.cell_folder(out, "search=greedy", 0) / bench.STORE
    rows = store.read_text().splitlines()
    store.write_text("\n".join(rows[:1]) + "\n")  # killed after its first task
    with pytest.raises(ex.ExperimentError, match="add --resume"):
        start(root, toml, out)
    again = start(root, toml, out, resume=True)
    assert [(r.cell, r.ran, len(r.skipped)) for r in again.runs] == [
        ("search=mcts", (), 3),
        ("search=greedy", ("level1/2_SoftmaxAgain", "level1/3_LayerNorm"), 1),
    ]
    before = json.loads((result.out / "summary.json").read_text())["comparisons"]
    assert (
        json.loads((out / "summary.json").read_text())["comparisons"] == before
    )  # replays are deterministic
    other = tmp_path / "other.toml"
    other.write_text(
        TOML.format(evals=EVALS + 1, seeds="[0]").replace('"suite"', json.dumps(str(toml.parent / "suite")))
    )
    with pytest.raises(ex.ExperimentError, match="holds another experiment"):
        start(root, other, out, resume=True)


def test_a_cell_that_cannot_start_is_a_status_and_the_next_cell_runs(tmp_path):
    toml = make_experiment(tmp_path, evals=2, tasks=1)
    out = tmp_path / "out"
    exp = ex.load_experiment(toml)
    ex.open_experiment(out, exp, bench.load_suite(exp.suite), resume=False)
    blocked = ex.cell_folder(out, "search=mcts", 0)
    blocked.parent.mkdir(parents=True)
    blocked.write_text("not a bench folder\n")  # a file where the cell's bench belongs
    result = start(tmp_path, toml, out, resume=True)
    (mcts, greedy) = result.runs
    assert mcts.error and "is a file, not a folder" in mcts.error and mcts.ran == ()
    assert greedy.error is None and greedy.ran == ("level1/1_Softmax",)
    data = json.loads((out / "summary.json").read_text())
    assert data["cells"]["search=mcts"]["written"] == 0 and data["cells"]["search=greedy"]["verified"] == 1
    assert data["comparisons"][0]["paired"] == 0 and data["comparisons"][0]["geomean_ratio"] is None


# -- statistics on hand-made rows --------------------------------------------------------------------------


def row(key: str, ms: float | None, status: str = "ok") -> dict:
    return {"key": key, "status": status, "ours_ms": ms} if ms else {"key": key, "status": status}


def test_pairs_are_tasks_both_verified_under_a_common_seed_averaged_over_seeds():
    base = {0: [row("a", 2.0), row("b", 1.0), row("c", 1.0), row("d", 1.0)], 1: [row("a", 2.0), row("b", 1.0)],
            2: [row("a", 1.0)]}  # fmt: skip
    cell = {0: [row("a", 1.0), row("b", None, "no_kernel"), row("c", 3.0)], 1: [row("a", 0.5), row("b", 2.0)],
            3: [row("a", 9.0)]}  # fmt: skip
    pairs = ex.paired_ratios(cell, base)
    # a: seeds 0 and 1 (ratios 1/2 and 1/4: geomean 1/sqrt(8)); b: seed 1 only; c: seed 0; d: the cell has none.
    assert [(p["key"], p["seeds"]) for p in pairs] == [("a", 2), ("b", 1), ("c", 1)]
    assert [p["ratio"] for p in pairs] == pytest.approx([1 / math.sqrt(8), 2.0, 3.0])


def test_the_bootstrap_interval_holds_the_true_geomean_and_is_seeded():
    rng = np.random.default_rng(7)
    true = 0.8  # the geomean of the law the ratios are drawn from (log-normal around log 0.8)
    # A 95% interval holds the true geomean in about 95% of samples: count it over many.
    hits = 0
    for _ in range(200):
        ratios = list(np.exp(rng.normal(math.log(true), 0.2, size=40)))
        lo, hi = ex.bootstrap_ci(ratios, resamples=2000, seed=0)
        assert lo < bench.geomean(ratios) < hi and hi / lo < 1.3  # 40 tasks, 20% spread: a few percent
        hits += lo < true < hi
    assert 0.88 <= hits / 200 <= 0.99, hits
    assert (
        ex.bootstrap_ci(ratios, seed=0) == ex.bootstrap_ci(ratios, seed=0) != ex.bootstrap_ci(ratios, seed=1)
    )
    assert ex.bootstrap_ci([0.5, 0.5, 0.5]) == pytest.approx((0.5, 0.5))
    assert ex.bootstrap_ci([0.5]) is None and ex.bootstrap_ci([]) is None


def test_the_signed_rank_test_is_scipys_and_exact_on_a_small_sample():
    # Five tasks all faster: of the 2**5 sign patterns, two are this extreme, so p = 2/32 exactly.
    p, test = ex.signed_rank([0.5, 0.6, 0.7, 0.8, 0.9])
    assert p == pytest.approx(2 / 32) and test.startswith("wilcoxon")
    # Hand-made rows of two cells over two seeds, paired, against scipy on the same pairs.
    times = {
        "a": (1.0, 1.3),
        "b": (2.0, 1.7),
        "c": (1.0, 0.5),
        "d": (4.0, 4.4),
        "e": (3.0, 2.0),
        "f": (1.0, 0.8),
    }
    base = {s: [row(k, t[0] * (1 + s)) for k, t in times.items()] for s in (0, 1)}
    cell = {s: [row(k, t[1] * (1 + s)) for k, t in times.items()] for s in (0, 1)}
    c = ex.compare(ex.paired_ratios(cell, base), resamples=2000)
    want = wilcoxon(np.log([t[1] for t in times.values()]), np.log([t[0] for t in times.values()])).pvalue
    assert c["paired"] == 6 and c["p_value"] == pytest.approx(want, rel=1e-12)
    assert c["geomean_ratio"] == pytest.approx(math.prod(t[1] / t[0] for t in times.values()) ** (1 / 6))
    assert (c["wins"], c["losses"], c["ties"]) == (4, 2, 0)  # b, c, e, f faster; a, d slower


def test_too_few_pairs_is_said_not_raised():
    for ratios in ([], [1.0, 1.0, 1.0], [0.9], [1.0, 1.0, 0.9]):
        c = ex.compare([{"key": str(i), "ratio": r, "seeds": 1} for i, r in enumerate(ratios)])
        assert c["p_value"] is None and c["test"].startswith("too few paired tasks")
        assert c["paired"] == len(ratios)
    empty = ex.compare([])
    assert empty["geomean_ratio"] is None and empty["ci"] is None and empty["wins"] == empty["ties"] == 0


def test_wins_losses_and_ties_within_one_percent():
    c = ex.compare(
        [{"key": str(i), "ratio": r, "seeds": 1} for i, r in enumerate((0.5, 0.995, 1.0, 1.005, 1.5))]
    )
    assert (c["wins"], c["losses"], c["ties"]) == (1, 1, 3)


def test_best_so_far_from_a_recorded_run_log():
    state = fold(read_events(RECORDED / "softmax" / "mcts" / "log.jsonl"))
    n = state.evaluations
    curve = ex.best_so_far(state.points, n + 5)
    assert len(curve) == n + 5 and curve[n:] == [curve[n - 1]] * 5  # a short run keeps its last best
    assert all(a <= b for a, b in itertools.pairwise(curve))
    for i, best in state.curve:  # the fold's own best-so-far wherever it has one
        assert curve[i - 1] == pytest.approx(max(best, 1.0))
    assert curve[-1] == pytest.approx(max(p.speedup or 0 for p in state.points))
    assert ex.mean_curve([[1.0, 2.0], [4.0, 8.0]]) == pytest.approx([2.0, 4.0]) and ex.mean_curve([]) == []


# -- the TOML's errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (('search = ["mcts", "greedy"]', 'search = ["mcts", "beam"]'), "search = 'beam' is not one of mcts, greedy"),
        (("[fixed]", "[fixed]\nsampler = 2"), "unknown factor 'sampler'; the factors are policy, search"),
        (("[fixed]", '[fixed]\nmemory = "yes"'), "memory = 'yes' is not one of false, true"),
        (("[fixed]", "[fixed]\nmemory = 1"), "memory = 1 is not one of false, true"),
        (("[fixed]", '[fixed]\npolicy2 = "x"'), "unknown factor 'policy2'"),
        (('policy = "expert"', 'policy = "auto"'), "policy = 'auto' is not one of llm, expert"),
        (('policy = "expert"', 'feedback = "loud"'), "feedback = 'loud' is not one of advice, json, raw, none"),
        (('policy = "expert"', 'objective = "power"'), "objective = 'power' is not one of time, energy, edp"),
        (('policy = "expert"', 'corpus = "nope"'), "corpus = 'nope' (unknown 'nope') is not 'none', a corpus or corpora joined by '+'"),
        (('policy = "expert"', 'corpus = "cutlass+nope"'), "the corpora are cccl, cutlass, cutlass_dsl, local"),
        (('policy = "expert"', 'corpus = "cutlass+cutlass"'), "corpus = 'cutlass+cutlass' (cutlass named twice)"),
        (('policy = "expert"', 'corpus = "none+cccl"'), "('none' joined with corpora)"),
        (('policy = "expert"', "corpus = true"), "corpus = True (not text)"),
        (('search = ["mcts", "greedy"]', 'corpus = ["cutlass", "cutlass+"]'), "corpus = 'cutlass+' (an empty name)"),
        (('name = "ablation"', 'name = "ablation"\nqueries = "missing.toml"'), "queries = 'missing.toml': cannot read"),
        (('name = "ablation"', 'name = "ablation"\nqueries = 3'), "queries = the path of a query set"),
        (('search = ["mcts", "greedy"]', 'search = ["mcts"]'), "give [matrix] a factor with two values"),
        (('search = ["mcts", "greedy"]', 'search = ["mcts", "mcts"]'), "names a value twice"),
        (('search = ["mcts", "greedy"]', 'search = "mcts"'), "search = a list of values"),
        (('policy = "expert"', 'search = "mcts"'), "search is both fixed and in the matrix"),
        (('baseline = "search=mcts"', 'baseline = "mcts"'), "baseline = 'mcts' is not a cell; the cells are search=mcts, search=greedy"),
        (('baseline = "search=mcts"', 'baseline = {search = "greedy"}'), None),
        (("evals = 8", "evals = 0"), "evals = 0"),
        (("seeds = [0]", "seeds = [1, 1]"), "distinct integers"),
        (("seeds = [0]", "seeds = []"), "distinct integers"),
        (('name = "ablation"', 'name = "ablation"\nbudget = 3'), "unknown key 'budget'"),
        (('suite = "suite"', 'suite = 3'), "suite = a folder"),
        (("[matrix]", "[matrix"), "not TOML"),
    ],
)  # fmt: skip
def test_a_bad_experiment_is_one_line_naming_what_is_allowed(tmp_path, change, needle):
    path = make_experiment(tmp_path, tasks=1)
    text = path.read_text()
    assert change[0] in text
    path.write_text(text.replace(change[0], change[1]))
    if needle is None:  # a baseline given by its factors
        assert ex.load_experiment(path).baseline == "search=greedy"
        return
    with pytest.raises(ex.ExperimentError) as e:
        ex.load_experiment(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


# -- the command -------------------------------------------------------------------------------------------


def cli(*args: str):
    return CliRunner().invoke(app, ["experiment", *args])


def one_line_error(res, needle: str) -> None:
    assert res.exit_code == 2, (res.stdout, res.stderr)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.stderr


def test_the_command_runs_resumes_and_renders_reports(tmp_path):
    toml = make_experiment(tmp_path, evals=2, tasks=1)
    out = tmp_path / "out"
    base = ["--out", str(out), "--home", str(tmp_path / "home"), "--replay", str(RECORDED)]
    res = cli(str(toml), *base, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(r["cell"], r["ran"]) for r in doc["runs"]] == [("search=mcts", ["level1/1_Softmax"]),
                                                            ("search=greedy", ["level1/1_Softmax"])]  # fmt: skip
    (c,) = doc["comparisons"]
    assert c["paired"] == 1 and c["p_value"] is None and c["test"].startswith("too few paired tasks")
    assert doc["reports"]["html"] == str(out / "report.html")
    res = cli(str(out / ex.COPY), *base, "--resume")  # from the copy beside the results
    assert res.exit_code == 0, res.output
    assert "2 rows were written already: skipped" in res.stdout and "search=greedy" in res.stdout
    (out / "report.md").unlink()
    res = cli("--report", str(out), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["comparisons"] == doc["comparisons"] and (out / "report.md").is_file()


def test_the_command_says_what_is_wrong_in_one_line(tmp_path):
    toml = make_experiment(tmp_path, tasks=1)
    out = tmp_path / "out"
    one_line_error(cli(str(tmp_path / "missing.toml"), "--out", str(out)), "experiment file not found")
    one_line_error(cli(str(toml)), "give the experiment's TOML file and --out")
    one_line_error(cli("--report", str(tmp_path)), "not an experiment folder")
    one_line_error(cli(str(toml), "--out", str(out), "--report", str(out)), "without the TOML file")
    bad = tmp_path / "bad.toml"
    bad.write_text(toml.read_text().replace('"greedy"', '"beam"'))
    one_line_error(cli(str(bad), "--out", str(out)), "search = 'beam' is not one of mcts, greedy")
    assert not out.exists()
    exp = ex.load_experiment(toml)
    ex.open_experiment(out, exp, bench.load_suite(exp.suite), resume=False)
    one_line_error(cli(str(toml), "--out", str(out)), "add --resume")


def test_ctrl_c_says_how_to_go_on(tmp_path, monkeypatch):
    import pipeline.loop

    def interrupted(path, cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.loop, "optimize", interrupted)
    toml = make_experiment(tmp_path, tasks=1)
    out = tmp_path / "out"
    res = cli(str(toml), "--out", str(out), "--home", str(tmp_path / "home"), "--replay", str(RECORDED))
    assert res.exit_code == 130, res.output
    assert f"--out {out} --resume --replay {RECORDED}" in res.stderr and "Traceback" not in res.output
    assert not (ex.cell_folder(out, "search=mcts", 0) / bench.STORE).exists()


def test_each_memory_cell_and_seed_learns_in_a_store_of_its_own(tmp_path):
    """Lessons of one cell or seed must not reach another: each memory run gets its own collection, empty at
    its start, and the machine's default one is left alone."""
    from pipeline.memory import Memory

    toml = make_experiment(tmp_path, seeds="[0, 1]", evals=16, tasks=1)
    toml.write_text(toml.read_text().replace('search = ["mcts", "greedy"]', "memory = [false, true]")
                    .replace('baseline = "search=mcts"', 'baseline = "memory=off"'))  # fmt: skip
    result = start(tmp_path, toml, tmp_path / "out")
    assert [r.error for r in result.runs] == [None] * 4
    names = []
    for seed in (0, 1):
        off = bench.read_manifest(ex.cell_folder(result.out, "memory=off", seed))["settings"]
        on = bench.read_manifest(ex.cell_folder(result.out, "memory=on", seed))["settings"]
        assert "memory_collection" not in off
        names.append(on["memory_collection"])
        folder = ex.cell_folder(result.out, "memory=on", seed)
        (row,) = rows_of(result.out, "memory=on", seed)
        state = fold(read_events(folder / bench.RUNS / row["run_id"] / "log.jsonl"))
        assert state.header.config["memory_collection"] == on["memory_collection"]
    assert len(set(names)) == 2 and "kernelpro-memory" not in names
    cfg = config.load(home=tmp_path / "home")
    assert all(Memory(cfg, name).list(100) for name in names)  # each run learned in its own store
    assert not Memory(cfg).list(100)  # and nothing in the default one


# -- the corpus factor: runs, retrieval and use ----------------------------------------------------------------

CORPUS_TOML = """
name = "corpora"
suite = "suite"
evals = 2
seeds = [0]
baseline = {{corpus = "cutlass"}}
{queries}
[fixed]
policy = "expert"

[matrix]
corpus = {corpora}
"""


def corpus_experiment(root: Path, corpora: list[str], queries: str = "") -> Path:
    make_experiment(root, evals=2, tasks=1)
    path = root / "corpora.toml"
    path.write_text(CORPUS_TOML.format(corpora=json.dumps(corpora), queries=queries))
    return path


def test_corpus_cells_run_with_their_corpus_and_say_which_index_is_missing(tmp_path):
    toml = corpus_experiment(tmp_path, ["cutlass", "none", "cutlass+local"])
    result = start(tmp_path, toml, tmp_path / "out")  # a home with no index at all
    assert [(r.cell, r.error) for r in result.runs] == [
        ("corpus=cutlass", None), ("corpus=none", None), ("corpus=cutlass+local", None)]  # fmt: skip
    missing = {
        "corpus=cutlass": {"cutlass": 1},
        "corpus=none": {},
        "corpus=cutlass+local": {"cutlass": 1, "local": 1},
    }
    data = json.loads((result.out / "summary.json").read_text())
    for corpus in ("cutlass", "none", "cutlass+local"):
        cell = f"corpus={corpus}"
        folder = ex.cell_folder(result.out, cell, 0)
        assert bench.read_manifest(folder)["settings"]["corpus"] == corpus
        (row,) = rows_of(result.out, cell)
        assert row["status"] == "ok"
        state = fold(read_events(folder / bench.RUNS / row["run_id"] / "log.jsonl"))
        assert state.header.config["corpus"] == corpus
        use = data["cells"][cell]["use"]
        assert use["runs"] == 1 and use["candidates"] == len(state.nodes) - 1 > 0
        assert use["with_blocks"] == 0 and use["by_corpus"] == {}  # the expert's softmax takes no atom
        assert use["missing_index"] == missing[cell]
    (row,) = rows_of(result.out, "corpus=cutlass+local")
    assert any("of corpus local (no index for corpus local: run `make index CORPUS=local FOLDER=DIR` "
               "(kernelpro index build --corpus local --folder DIR))" in n for n in row["notes"])  # fmt: skip
    # Outcome: without building blocks to take, the corpus changes nothing: every paired task is a tie.
    assert [(c["cell"], c["paired"], c["ties"]) for c in data["comparisons"]] == [
        ("corpus=none", 1, 1), ("corpus=cutlass+local", 1, 1)]  # fmt: skip
    assert data["retrieval"] is None and not (result.out / ex.RETRIEVAL).exists()
    md = (result.out / "report.md").read_text()
    assert "## Corpora" in md and "### Retrieval" in md and "### Use" in md and "### Outcome" in md
    assert "Not measured: the experiment names no query set" in md
    assert "| corpus=cutlass+local | 1 | " in md
    assert ("- `corpus=cutlass+local`: 1 run had no index of local, so no building blocks from it "
            "(`kernelpro index build --corpus local --folder DIR`)") in md  # fmt: skip
    assert "<h2>Corpora</h2>" in (result.out / "report.html").read_text()


QUERIES = """
[[case]]
query = "SM90_TMA_LOAD_2D"
expect = "include/cute/arch/copy_sm90_tma.hpp"

[[case]]
query = "Swizzle"
expect = "cutlass:include/cute/swizzle.hpp"

[[case]]
query = "block_reduce_sum"
expect = "local:kp/block_reduce.cuh"

[[case]]
query = "warp inclusive scan with shuffles"
expect = ["kp/block_scan.cuh"]
"""


def test_the_retrieval_of_each_corpus_cell_on_the_query_set(tmp_path, small_corpora):
    """Two small real indexes (cutlass, local): each corpus cell's hunter on a query set beside the experiment;
    a cell whose index is not built, and the cell without a corpus, say why they have no figures."""
    indexed, _, _ = small_corpora
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "queries.toml").write_text(QUERIES)
    toml = corpus_experiment(
        tmp_path, ["cutlass", "cutlass+local", "cccl", "none"], 'queries = "q/queries.toml"'
    )
    exp = ex.load_experiment(toml)
    assert exp.queries == tmp_path / "q" / "queries.toml"
    suite = bench.load_suite(exp.suite)
    out = tmp_path / "out"
    ex.open_experiment(out, exp, suite, resume=False)
    cfg = config.load(home=indexed.home)
    result = ex.run_experiment(out, exp, suite, cfg, replay=bench.ReplayIndex.scan(RECORDED))
    assert [r.error for r in result.runs] == [None] * 4
    r = json.loads((out / ex.RETRIEVAL).read_text())
    assert r["queries"] == str(tmp_path / "q" / "queries.toml") and r["cases"] == 4 and r["k"] == 5
    got = r["corpora"]
    assert list(got) == ["cutlass", "cutlass+local", "cccl", "none"]
    # cutlass alone finds its two files first and cannot answer for the user's kernels.
    assert [c["rank"] for c in got["cutlass"]["per_case"]] == [1, 1, None, None]
    assert (got["cutlass"]["recall"], got["cutlass"]["mrr"]) == (0.5, 0.5)
    both = got["cutlass+local"]
    assert both["recall"] == 1.0 and [c["rank"] for c in both["per_case"]][:3] == [1, 1, 1]
    assert both["cells"] == ["corpus=cutlass+local"] and both["p50_ms"] > 0
    assert got["cccl"]["error"] == ("not measured: cccl: no index for corpus cccl: run `make index CORPUS=cccl` "
                                    "(kernelpro index build --corpus cccl)")  # fmt: skip
    assert got["none"]["error"] == "no corpus: the runs retrieve nothing"
    data = json.loads((out / "summary.json").read_text())
    assert data["retrieval"] == r
    assert data["cells"]["corpus=cutlass+local"]["use"]["missing_index"] == {}  # both indexes opened
    assert data["cells"]["corpus=cccl"]["use"]["missing_index"] == {"cccl": 1}
    md = (out / "report.md").read_text()
    assert f"Query set `{tmp_path / 'q' / 'queries.toml'}` (4 cases)" in md
    assert "| cutlass | `corpus=cutlass` | 0.500 | 0.500 |" in md
    assert f"| cutlass+local | `corpus=cutlass+local` | 1.000 | {both['mrr']:.3f} |" in md
    assert "| cccl | `corpus=cccl` | – | – | – | not measured: cccl: no index for corpus cccl" in md
    # The copy beside the results names the same query set; the reports re-render without the indexes.
    assert ex.load_experiment(out / ex.COPY).queries == exp.queries
    (out / "report.md").unlink()
    ex.write_reports(out)
    assert "| cutlass | `corpus=cutlass` | 0.500 | 0.500 |" in (out / "report.md").read_text()
    res = cli("--report", str(out))
    assert res.exit_code == 0, res.output
    assert "retrieval of cutlass on 4 queries: recall@5 0.500, MRR 0.500" in res.stdout
    assert "retrieval of none on 4 queries: no corpus: the runs retrieve nothing" in res.stdout


def test_a_bad_query_set_is_one_line(tmp_path):
    (tmp_path / "q.toml").write_text('[[case]]\nquery = "x"\n')
    toml = corpus_experiment(tmp_path, ["cutlass", "none"], 'queries = "q.toml"')
    with pytest.raises(
        ex.ExperimentError, match=r"queries = 'q.toml': case 1 of .*q.toml needs query = words"
    ):
        ex.load_experiment(toml)
    (tmp_path / "q.toml").write_text("[nothing]\n")
    with pytest.raises(ex.ExperimentError, match="has no \\[\\[case\\]\\] tables"):
        ex.load_experiment(toml)
    (tmp_path / "q.toml").write_text("[[case]\n")
    with pytest.raises(ex.ExperimentError, match="is not TOML"):
        ex.load_experiment(toml)


LLM_REPLY = (
    '```cuda\n#include "kp/block_reduce.cuh"\nextern "C" __global__ void k(float* x) { x[0] = 1; }\n```\n'
    "```python\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n"
    "        kernels.k((1,), (1,), (x,))\n        return x\n```\n"
)


def test_use_is_counted_from_a_recorded_run_log(tmp_path):
    """A run over cutlass+local written with the real run log: an expert GEMM candidate (its CUTLASS atoms), an
    LLM candidate that used a local block (recorded as local:path), one that records a bare path (a log of
    before the corpus was recorded: which corpus is not known), one with no block; the LLM one is the best."""
    from pipeline import events as ev
    from pipeline import suite_report
    from pipeline.generate.base import Context
    from pipeline.generate.expert import ExpertPolicy
    from pipeline.generate.parse import to_candidate
    from pipeline.runlog import RunLog
    from pipeline.tasks import probe

    gemm = tmp_path / "gemm.py"
    gemm.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.linear = nn.Linear(1024, 1000, bias=False, dtype=torch.float16)\n\n"
        "    def forward(self, x):\n        return self.linear(x)\n\n\n"
        "def get_inputs():\n    return [torch.randn(77, 1024, dtype=torch.float16)]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    t = probe(gemm)
    [expert] = [
        p.candidate for p in ExpertPolicy().propose(Context(task=t, reference=t.source, parent=None), 1)
    ]
    assert expert is not None and expert.blocks
    shown = (("kp/block_reduce.cuh", "block_reduce_sum", "local"),)
    llm, _ = to_candidate(LLM_REPLY, "gemm", None, "llm: block reduce", shown)
    bare, _ = to_candidate(
        LLM_REPLY.replace("x[0] = 1", "x[0] = 2"), "gemm", None, "llm: old", (shown[0][:2],)
    )
    plain, _ = to_candidate(
        LLM_REPLY.replace('#include "kp/block_reduce.cuh"\n', ""), "gemm", None, "llm: plain"
    )
    assert (llm.blocks, bare.blocks, plain.blocks) == (
        ("local:kp/block_reduce.cuh",),
        ("kp/block_reduce.cuh",),
        (),
    )

    cell, run_id = "corpus=cutlass+local", "20990101-000000-gemm-0001"
    runs = ex.cell_folder(tmp_path, cell, 0) / bench.RUNS
    start_ev = ev.Start(
        run_id, {"id": "gemm"}, str(gemm), {"corpus": "cutlass+local"}, "llm", "mcts", "replay"
    )
    log = RunLog.create(runs, run_id, ev.encode(start_ev)[1])
    for node, cand in enumerate((expert, llm, bare, plain), 1):
        log.append(*ev.encode(ev.Proposal(node=node, parent=0, edit=cand.edit or "", candidate=cand)))
    log.append(*ev.encode(ev.End(reason="evaluation budget spent (4)", best_node=2, evaluations=4)))
    log.close()
    note = "no building blocks from the source index of corpus local (no index for corpus local: ...)"
    use = ex.corpus_use(tmp_path, cell, {0: [{"key": "gemm", "run_id": run_id, "notes": [note]}]})
    atoms = dict.fromkeys(expert.blocks, 1)
    assert use == {
        "runs": 1, "candidates": 4, "with_blocks": 3,
        "by_corpus": {
            "cutlass": {"candidates": 1, "best": 0, "blocks": dict(sorted(atoms.items()))},
            "local": {"candidates": 1, "best": 1, "blocks": {"kp/block_reduce.cuh": 1}},
            "unattributed": {"candidates": 1, "best": 0, "blocks": {"kp/block_reduce.cuh": 1}},
        },
        "missing_index": {"local": 1},
    }  # fmt: skip
    assert any("MMA_64x" in a for a in atoms) and any("TMA_LOAD" in a for a in atoms)
    # Under one corpus a bare path is that corpus's.
    assert ex.block_corpus("kp/block_reduce.cuh", "", ("local",), ("cutlass", "local")) == (
        "local",
        "kp/block_reduce.cuh",
    )
    md = "\n".join(suite_report.corpus_markdown({"retrieval": None, "cells": {cell: {"use": use}}}))
    assert "| corpus=cutlass+local | 1 | 4 | 3 | local | 1 | 1 | 1 | `kp/block_reduce.cuh` (1) |" in md
    assert "| corpus=cutlass+local | 1 | 4 | 3 | cutlass | 1 | 0 | " in md


def test_the_cccl_example_is_a_corpus_experiment_with_its_query_set():
    """examples/experiments/cccl_scan_reduce.toml (docs/corpus-experiment.md) loads: two corpus cells over the
    KernelBench level 1 scans and reductions its list file names, and a query set of CCCL files."""
    from index.hunt import load_cases

    folder = ROOT / "examples" / "experiments"
    exp = ex.load_experiment(folder / "cccl_scan_reduce.toml")
    assert [c.name for c in exp.cells] == ["corpus=cutlass", "corpus=cutlass+cccl"]
    assert exp.baseline == "corpus=cutlass" and exp.cells[1].factors["policy"] == "llm"
    assert exp.suite == folder / "cccl_scan_reduce.txt" and exp.queries == folder / "cccl_queries.toml"
    tasks = [x for x in exp.suite.read_text().splitlines() if x and not x.startswith("#")]
    assert len(tasks) == 11 and all(t.startswith("kernelbench/level1/") for t in tasks)
    assert any("cumsum" in t for t in tasks) and any("reduction_over_a_dimension" in t for t in tasks)
    cases = load_cases(exp.queries)
    assert len(cases) == 17 and all(e.startswith("cccl:cub/") for c in cases for e in c.expected)
