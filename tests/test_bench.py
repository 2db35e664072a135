"""`kernelpro bench` on the CPU: real searches (the expert policy, MCTS, the run log) over a small suite, their
evaluations answered from the run logs recorded on the H200 (tests/fixtures/runs/), matched to the suite's
tasks by their source. One row per task, resume, failures as rows, list files, the reports and the CLI."""

from __future__ import annotations

import gzip
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline import bench, config
from pipeline.cli import app
from pipeline.runlog import read_events
from pipeline.runstate import fold

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "tests" / "fixtures" / "runs"
SOFTMAX = ROOT / "tasks" / "softmax.py"
EVALS = 3
SVD = (
    "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
    "    def forward(self, x):\n        return torch.linalg.svdvals(x)\n\n\n"
    "def get_inputs():\n    return [torch.randn(64, 64, dtype=torch.float64)]\n\n\n"
    "def get_init_inputs():\n    return []\n"
)


def make_suite(root: Path) -> Path:
    """Two tasks with recordings (the softmax task under two names), one without (its name has markup)."""
    level = root / "suite" / "level1"
    level.mkdir(parents=True)
    shutil.copy(SOFTMAX, level / "1_Softmax.py")
    shutil.copy(SOFTMAX, level / "2_SoftmaxAgain.py")
    shutil.copy(ROOT / "tasks" / "layernorm.py", level / "3_LayerNorm<b>.py")
    return root / "suite"


def start(root: Path, suite: Path, out: Path, resume: bool = False, match: str | None = None, **kw):
    s = bench.load_suite(suite, match)
    manifest = bench.open_bench(out, s, {"evals": EVALS, "policy": None, "search": None}, resume)
    cfg = config.load(home=root / "home")
    replay = kw.pop("replay", bench.ReplayIndex.scan(RECORDED))
    return bench.run_bench(out, s, cfg, manifest, replay=replay, **kw)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """One bench over the small suite, shared: tests that change it work on a copy."""
    root = tmp_path_factory.mktemp("bench")
    suite = make_suite(root)
    seen: list[tuple[int, int, str]] = []
    result = start(root, suite, root / "out", progress=lambda *a: seen.append(a))
    return root, suite, result, seen


def copy_bench(ran, tmp_path: Path) -> Path:
    _, _, result, _ = ran
    shutil.copytree(result.out, tmp_path / "out")
    return tmp_path / "out"


def store_rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / bench.STORE).read_text().splitlines()]


def test_each_task_is_one_run_and_one_row_with_its_status(ran):
    _, suite, result, seen = ran
    rows = {r["key"]: r for r in store_rows(result.out)}
    assert list(rows) == ["level1/1_Softmax", "level1/2_SoftmaxAgain", "level1/3_LayerNorm<b>"]
    assert result.ran == tuple(rows) and not result.skipped and not result.stopped
    assert [r["status"] for r in rows.values()] == ["ok", "ok", "no_recording"]
    assert seen[0] == (0, 3, "level1/1_Softmax") and seen[-1][:2] == (3, 3)
    for key in ("level1/1_Softmax", "level1/2_SoftmaxAgain"):
        r = rows[key]
        folder = result.out / bench.RUNS / r["run_id"]
        state = fold(read_events(folder / "log.jsonl"))
        assert state.finished and state.evaluations == r["evaluations"] == EVALS
        assert state.header.task_path == str(suite / f"{key}.py")
        # The row's best is the run's best evaluation, a real H200 result: its time and speedups.
        best = state.nodes[state.end.best_node]
        assert r["measured"] == "search" and r["ours_ms"] == best.time_ms
        assert math.isclose(r["speedup_eager"], best.speedup, rel_tol=1e-12) and r["speedup_eager"] > 1
        assert math.isclose(r["speedup_compile"], r["compile_ms"] / r["ours_ms"], rel_tol=1e-12)
        assert r["kind"] == "custom" and 0 < r["fraction_of_floor"] <= 1
    assert "no recorded run" in rows["level1/3_LayerNorm<b>"]["error"]
    assert "run_id" not in rows["level1/3_LayerNorm<b>"]


def test_the_summary_counts_coverage_and_geomeans_from_the_rows(ran):
    _, _, result, _ = ran
    rows = store_rows(result.out)
    s = json.loads((result.out / "summary.json").read_text())
    assert s["rows"] == rows and s["settings"] == {"evals": EVALS, "policy": "expert", "search": "mcts"}
    got = s["summary"]
    assert (got["tasks"], got["suite_tasks"], got["verified"]) == (3, 3, 2)
    assert got["statuses"] == {"no_recording": 1, "ok": 2} and got["errors"] == 1
    # each row names the card its recording ran on, and the summary and report count them
    assert [r.get("gpu") for r in rows if r["status"] == "ok"] == ["NVIDIA H200"] * 2
    assert got["gpus"] == {"NVIDIA H200": 2}
    assert "- measured on: NVIDIA H200 (2 tasks)\n" in (result.out / "report.md").read_text()
    timed = [r for r in rows if r["status"] == "ok"]
    want = math.exp(sum(math.log(r["speedup_eager"]) for r in timed) / 2)
    assert math.isclose(got["ours_over_eager"], want, rel_tol=1e-12)
    assert math.isclose(
        got["by_kind"]["custom"]["ours_over_compile"], got["ours_over_compile"], rel_tol=1e-12
    )
    assert got["by_kind"]["hybrid"] == {"timed": 0, "ours_over_eager": None, "compile_over_eager": None,
                                        "ours_over_compile": None}  # fmt: skip
    assert got["energy_tasks"] == 0 and got["energy_saving_over_eager"] is None  # replays measure no energy


def test_custom_and_hybrid_are_counted_apart_and_old_rows_get_a_status():
    rows = [
        {"key": "a", "speedup_eager": 2.0, "speedup_compile": 1.0, "eager_alongside_ms": 2.0,
         "compile_alongside_ms": 1.0, "kind": "custom", "fraction_of_floor": 0.5, "ours_ms": 1.0,
         "energy_mj": 1.0, "eager_energy_mj": 4.0},
        {"key": "b", "speedup_eager": 8.0, "speedup_compile": 4.0, "eager_alongside_ms": 8.0,
         "compile_alongside_ms": 4.0, "kind": "hybrid", "fraction_of_floor": 0.125, "ours_ms": 1.0},
        {"key": "c", "error": "the expert policy cannot write kernels for c.py"},  # written before statuses
        {"key": "d", "evaluations": 12, "stop": "evaluation budget spent (12)"},
    ]  # fmt: skip
    s = bench.summary(rows, 10)
    assert s["ours_over_eager"] == pytest.approx(4.0) and s["ours_over_compile"] == pytest.approx(2.0)
    assert s["by_kind"]["custom"]["ours_over_eager"] == pytest.approx(2.0)
    assert s["by_kind"]["hybrid"]["ours_over_compile"] == pytest.approx(4.0)
    assert s["fraction_of_floor"] == pytest.approx(0.25) and s["floor_tasks"] == 2
    assert s["energy_tasks"] == 1 and s["energy_saving_over_eager"] == pytest.approx(4.0)
    assert s["statuses"] == {"error": 1, "no_kernel": 1, "ok": 2} and s["verified"] == 2


def test_the_reports_hold_the_rows_numbers_and_the_plots(ran):
    _, _, result, _ = ran
    rows = {r["key"]: r for r in store_rows(result.out)}
    md = (result.out / "report.md").read_text()
    s = bench.summary(list(rows.values()), 3)
    assert f"| all | 2 | {s['ours_over_eager']:.2f}x | {s['compile_over_eager']:.2f}x | " in md
    assert "- coverage: 3 of 3 tasks written, 2 with a verified candidate" in md
    for key in ("level1/1_Softmax", "level1/2_SoftmaxAgain"):
        r = rows[key]
        line = next(x for x in md.splitlines() if x.startswith(f"| {key} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:3] == [key, "ok", "custom"]
        assert cells[3:9] == [f"{r['eager_ms']:.4f}", f"{r['compile_ms']:.4f}", f"{r['ours_ms']:.4f}",
                              f"{r['speedup_eager']:.2f}x", f"{r['speedup_compile']:.2f}x",
                              f"{100 * r['fraction_of_floor']:.1f}%"]  # fmt: skip
        assert cells[10] == str(EVALS)
    assert "## Failures" in md and "`level1/3_LayerNorm<b>` (no_recording)" in md
    html = (result.out / "report.html").read_text()
    assert html.count("<svg") == 2 and 'id="speedup-per-task"' in html and 'id="speedup-distribution"' in html
    for key in ("level1/1_Softmax", "level1/2_SoftmaxAgain"):
        assert f'id="task-{key}"' in html  # one bar per timed task
    assert html.count("<table>") == 2 and "<td>level1/1_Softmax</td>" in html
    assert "LayerNorm&lt;b&gt;" in html and "LayerNorm<b>" not in html  # a task's name is text, not markup


def test_resume_skips_finished_tasks_and_renders_the_reports_again(ran, tmp_path):
    root, suite, _, _ = ran
    out = copy_bench(ran, tmp_path)
    before = (out / bench.STORE).read_bytes()
    for name in bench.REPORTS.values():
        (out / name).unlink()
    with pytest.raises(bench.BenchError, match="add --resume"):
        start(root, suite, out)
    again = start(root, suite, out, resume=True)
    assert (
        again.ran == () and again.skipped == tuple(r["key"] for r in again.rows) and len(again.skipped) == 3
    )
    assert (out / bench.STORE).read_bytes() == before  # nothing run, nothing appended
    assert all((out / name).is_file() for name in bench.REPORTS.values())
    assert len(list((out / bench.RUNS).iterdir())) == 2


def test_retry_runs_the_tasks_of_the_statuses_named_again_and_keeps_their_old_rows(ran, tmp_path):
    root, suite, _, _ = ran
    out = copy_bench(ran, tmp_path)
    old = store_rows(out)
    with pytest.raises(bench.BenchError, match="--retry unsupportd: not a task status"):
        start(root, suite, out, resume=True, retry=("unsupportd",))
    assert store_rows(out) == old and not (out / bench.RETRIED).exists()  # a typo changes nothing
    again = start(root, suite, out, resume=True, retry=("no_recording",))
    assert again.ran == ("level1/3_LayerNorm<b>",) and len(again.skipped) == 2
    new = store_rows(out)
    assert new[:2] == old[:2] and [r["key"] for r in new] == [r["key"] for r in old]
    assert [json.loads(x) for x in (out / bench.RETRIED).read_text().splitlines()] == [old[2]]
    # With --match, only the matched tasks' rows: one task re-run after a fix, the others kept.
    again = start(root, suite, out, resume=True, retry=("ok",), match="2_Softmax")
    assert again.ran == ("level1/2_SoftmaxAgain",) and len(store_rows(out)) == 3
    assert [r["key"] for r in store_rows(out)][-1] == "level1/2_SoftmaxAgain"
    retried = [json.loads(x)["key"] for x in (out / bench.RETRIED).read_text().splitlines()]
    assert retried == ["level1/3_LayerNorm<b>", "level1/2_SoftmaxAgain"]
    r = CliRunner().invoke(app, ["bench", str(suite), "--out", str(out), "--retry", "crash"])
    assert r.exit_code != 0 and "add --resume" in r.output


def test_a_row_to_retry_stays_until_its_tasks_new_row_lands(ran, tmp_path):
    """A budget that stops a --retry bench after its first task leaves the other tasks' old rows in place."""
    root, suite, _, _ = ran
    out = copy_bench(ran, tmp_path)
    old = {r["key"]: r for r in store_rows(out)}
    again = start(root, suite, out, resume=True, retry=("ok", "no_recording"), budget_s=1e-3)
    assert len(again.ran) == 1 and len(again.remaining) == 2 and again.stopped
    rows = {r["key"]: r for r in store_rows(out)}
    assert set(rows) == set(old)  # every task still has one row
    (first,) = again.ran
    assert rows[first] != old[first] and all(rows[k] == old[k] for k in again.remaining)
    assert [json.loads(x) for x in (out / bench.RETRIED).read_text().splitlines()] == [old[first]]


def test_a_task_killed_in_flight_is_resumed_from_its_run_log(ran, tmp_path):
    root, suite, _, _ = ran
    out = copy_bench(ran, tmp_path)
    rows = store_rows(out)
    victim = rows[1]
    (out / bench.STORE).write_text("".join(json.dumps(r) + "\n" for r in rows if r is not victim))
    log = out / bench.RUNS / victim["run_id"] / "log.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    results = [i for i, x in enumerate(lines) if json.loads(x)["type"] == "result"]
    log.write_text("".join(lines[: results[1] + 1]))  # killed after its second evaluation
    again = start(root, suite, out, resume=True)
    assert again.ran == (victim["key"],)
    row = store_rows(out)[-1]
    assert row["key"] == victim["key"] and row["resumed"] == row["run_id"] == victim["run_id"]
    assert row["status"] == "ok" and row["speedup_eager"] == victim["speedup_eager"]
    events = read_events(log)
    assert sum(e.type == "result" for e in events) == EVALS  # the two done were not evaluated again
    assert any(e.type == "resume" for e in events)


def unsupported_recording(root: Path, task: Path) -> Path:
    """The softmax recording relabelled as the SVD task's: the real loop reaches the policy, which refuses."""
    import hashlib

    folder = root / "recorded" / "svd" / "run"
    folder.mkdir(parents=True)
    lines = [json.loads(x) for x in (RECORDED / "softmax" / "mcts" / "log.jsonl").read_text().splitlines()]
    source = task.read_text()
    lines[0]["data"]["task"].update(source=source, source_hash=hashlib.sha256(source.encode()).hexdigest())
    (folder / "log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root / "recorded"


def test_a_failing_task_is_a_status_row_and_the_suite_goes_on(tmp_path, monkeypatch):
    import pipeline.loop

    suite = tmp_path / "suite" / "level1"
    suite.mkdir(parents=True)
    shutil.copy(SOFTMAX, suite / "1_Softmax.py")
    (suite / "2_Svd.py").write_text(SVD)
    shutil.copy(SOFTMAX, suite / "3_SoftmaxCrashes.py")
    shutil.copy(SOFTMAX, suite / "4_Softmax.py")
    shutil.copytree(RECORDED, tmp_path / "recorded")
    unsupported_recording(tmp_path, suite / "2_Svd.py")
    real = pipeline.loop.optimize

    def optimize(path, cfg, **kw):
        if Path(path).stem == "3_SoftmaxCrashes":
            raise RuntimeError("the worker pool fell over\nsecond line")
        return real(path, cfg, **kw)

    monkeypatch.setattr(pipeline.loop, "optimize", optimize)
    result = start(
        tmp_path, tmp_path / "suite", tmp_path / "out", replay=bench.ReplayIndex.scan(tmp_path / "recorded")
    )
    got = {r["key"]: (r["status"], r.get("error")) for r in result.rows}
    assert got["level1/1_Softmax"] == ("ok", None) and got["level1/4_Softmax"] == ("ok", None)
    assert got["level1/2_Svd"][0] == "unsupported" and "expert policy cannot write" in got["level1/2_Svd"][1]
    assert got["level1/3_SoftmaxCrashes"] == ("crash", "RuntimeError: the worker pool fell over")
    assert len(store_rows(tmp_path / "out")) == 4
    assert "level1/3_SoftmaxCrashes` (crash): RuntimeError" in (tmp_path / "out" / "report.md").read_text()


class Clock:
    """Each reading 10 s after the last: a task takes 10 s, whatever this machine's speed."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        self.t += 10.0
        return self.t


def test_a_budget_runs_the_suite_in_parts(ran, tmp_path, monkeypatch):
    root, suite, _, _ = ran
    clock = Clock()
    monkeypatch.setattr(bench, "time", clock)
    first = start(root, suite, tmp_path / "out", budget_s=25)
    assert first.ran == ("level1/1_Softmax",) and first.remaining == (
        "level1/2_SoftmaxAgain",
        "level1/3_LayerNorm<b>",
    )
    assert first.stopped and "budget of 25 s" in first.stopped
    assert [r["key"] for r in store_rows(tmp_path / "out")] == ["level1/1_Softmax"]
    rest = start(root, suite, tmp_path / "out", resume=True)
    assert rest.skipped == ("level1/1_Softmax",) and len(rest.ran) == 2 and not rest.remaining
    assert len(rest.rows) == 3


def test_a_list_file_suite_and_its_errors(tmp_path):
    make_suite(tmp_path)
    listed = tmp_path / "suite.txt"
    listed.write_text(f"# two tasks\nsuite/level1/2_SoftmaxAgain.py  # relative to this file\n\n{SOFTMAX}\n")
    s = bench.load_suite(listed)
    assert list(s.tasks) == ["level1/2_SoftmaxAgain", "tasks/softmax"] and s.size == 2
    assert bench.load_suite(listed, match="^tasks/").tasks == {"tasks/softmax": SOFTMAX}
    # The same tasks elsewhere are the same suite; other contents are not.
    shutil.copytree(tmp_path / "suite", tmp_path / "moved")
    assert (
        bench.load_suite(tmp_path / "moved").fingerprint == bench.load_suite(tmp_path / "suite").fingerprint
    )
    (tmp_path / "moved" / "level1" / "1_Softmax.py").write_text(SVD)
    assert (
        bench.load_suite(tmp_path / "moved").fingerprint != bench.load_suite(tmp_path / "suite").fingerprint
    )
    listed.write_text("suite/level1/1_Softmax.py\nsuite/level1/nope.py\n")
    with pytest.raises(bench.BenchError, match=r"suite.txt:2: task file not found: suite/level1/nope.py"):
        bench.load_suite(listed)
    listed.write_text("# nothing yet\n")
    with pytest.raises(bench.BenchError, match="is empty"):
        bench.load_suite(listed)
    with pytest.raises(bench.BenchError, match="not a regular expression"):
        bench.load_suite(tmp_path / "suite", match="(")


# -- the command -------------------------------------------------------------------------------------------


def cli(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def one_line_error(res, needle: str) -> None:
    assert res.exit_code == 2, (res.stdout, res.stderr)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.stderr


def test_the_command_runs_a_list_file_resumes_and_renders_reports(tmp_path):
    make_suite(tmp_path)
    listed = tmp_path / "suite.txt"
    listed.write_text("suite/level1/1_Softmax.py\nsuite/level1/3_LayerNorm<b>.py\n")
    out, home = tmp_path / "out", tmp_path / "home"
    base = ["--out", str(out), "--home", str(home), "--replay", str(RECORDED)]
    res = cli(str(listed), *base, "--evals", str(EVALS), "--search", "greedy", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["ran"] == ["level1/1_Softmax", "level1/3_LayerNorm<b>"] and doc["stopped"] is None
    assert doc["settings"] == {"evals": EVALS, "policy": "expert", "search": "greedy"}
    assert doc["summary"]["verified"] == 1 and doc["reports"]["html"] == str(out / "report.html")
    (run,) = (out / bench.RUNS).iterdir()
    assert fold(read_events(run / "log.jsonl")).header.search == "greedy"
    res = cli(str(listed), *base, "--resume")  # the bench's own settings, nothing left to run
    assert res.exit_code == 0, res.output
    assert "2 tasks had a row already: skipped" in res.stdout and "1 of 2 tasks written" not in res.stdout
    assert "2 of 2 tasks written, 1 verified (no_recording 1, ok 1)" in res.stdout
    (out / "report.md").unlink()
    res = cli("--report", str(out), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["summary"] == doc["summary"] and (out / "report.md").is_file()


def test_the_command_says_what_is_wrong_in_one_line(tmp_path):
    make_suite(tmp_path)
    suite, out = tmp_path / "suite", tmp_path / "out"
    one_line_error(cli(str(tmp_path / "missing"), "--out", str(out)), "suite not found")
    (tmp_path / "empty").mkdir()
    one_line_error(cli(str(tmp_path / "empty"), "--out", str(out)), "is empty")
    one_line_error(cli(str(suite), "--out", str(out), "--match", "Conv"), "no task of the suite")
    one_line_error(cli("--out", str(out)), "give a SUITE")
    one_line_error(cli(str(suite)), "give a SUITE")
    one_line_error(cli("--report", str(tmp_path)), "not a bench folder")
    one_line_error(
        cli(str(suite), "--out", str(out), "--replay", str(tmp_path / "empty")), "no recorded run logs"
    )
    assert not out.exists()  # nothing written for a command refused
    # A bench of one suite is not continued with another suite, or with another budget.
    s = bench.load_suite(suite, match="LayerNorm")
    bench.open_bench(out, s, {"evals": 2, "policy": None, "search": None}, resume=False)
    one_line_error(cli(str(suite), "--out", str(out)), "add --resume")
    one_line_error(cli(str(ROOT / "tasks"), "--out", str(out), "--resume"), "written by another suite")
    one_line_error(cli(str(suite), "--out", str(out), "--resume", "--evals", "5"), "--evals 2, not 5")
    one_line_error(cli(str(suite), "--out", str(out), "--report", str(out)), "without SUITE")
    res = CliRunner().invoke(app, ["bench", str(suite), "--out", str(out), "--search", "beam"])
    assert res.exit_code == 2 and "--search" in res.stderr


def test_ctrl_c_writes_no_row_and_says_how_to_go_on(tmp_path, monkeypatch):
    import pipeline.loop

    def interrupted(path, cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.loop, "optimize", interrupted)
    make_suite(tmp_path)
    out = tmp_path / "out"
    res = cli(
        str(tmp_path / "suite"),
        "--out",
        str(out),
        "--home",
        str(tmp_path / "home"),
        "--replay",
        str(RECORDED),
    )
    assert res.exit_code == 130, res.output
    assert f"--out {out} --resume" in res.stderr and "Traceback" not in res.output
    assert not (out / bench.STORE).exists()  # the task in flight has no row: it runs again next time


def test_rows_of_two_machines_merged_into_one_folder_count_once(ran, tmp_path):
    out = copy_bench(ran, tmp_path)
    rows = store_rows(out)
    again = {**rows[0], "wall_s": 99.0}  # the same task, run on another machine too
    with (out / bench.STORE).open("a") as f:
        f.write(json.dumps(again) + "\n")
    res = cli("--report", str(out), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["summary"]["tasks"] == 3
    md = (out / "report.md").read_text()
    assert sum(x.startswith(f"| {rows[0]['key']} |") for x in md.splitlines()) == 1
    assert next(x for x in md.splitlines() if x.startswith(f"| {rows[0]['key']} |")).endswith("| 99.0 |")


def test_a_bench_with_a_corpus_runs_every_task_with_it(tmp_path):
    """corpus is a bench setting when given: in the manifest, the config of every run (its header), and kept
    on resume; a bench made without it runs with the config's corpus (cutlass unless KERNELPRO_CORPUS)."""
    make_suite(tmp_path)
    out, home = tmp_path / "out", tmp_path / "home"
    base = ["--out", str(out), "--home", str(home), "--replay", str(RECORDED), "--match", "1_Softmax"]
    res = cli(str(tmp_path / "suite"), *base, "--evals", "2", "--corpus", "cutlass+local", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["settings"] == {"evals": 2, "policy": "expert", "search": "mcts", "corpus": "cutlass+local"}
    (row,) = store_rows(out)
    state = fold(read_events(out / bench.RUNS / row["run_id"] / "log.jsonl"))
    assert state.header.config["corpus"] == "cutlass+local"
    # No index in this home: each corpus says so, with the command that builds it.
    assert [n for n in row["notes"] if "building blocks" in n] == [
        "no building blocks from the source index of corpus cutlass (no index for corpus cutlass: run "
        "`make index` (kernelpro index build --corpus cutlass))",
        "no building blocks from the source index of corpus local (no index for corpus local: run "
        "`make index CORPUS=local FOLDER=DIR` (kernelpro index build --corpus local --folder DIR))",
    ]
    one_line_error(cli(str(tmp_path / "suite"), *base, "--resume", "--corpus", "none"),
                   "runs every task with --corpus cutlass+local, not none")  # fmt: skip
    cfg = bench.bench_config(config.load(home=home, corpus="cccl"), out, bench.read_manifest(out))
    assert cfg.corpus == "cutlass+local"  # the bench's own
    quiet = tmp_path / "quiet"  # --no-energy: a setting of the bench, in every run's config
    res = cli(
        str(tmp_path / "suite"), *base[2:], "--out", str(quiet), "--evals", "2", "--no-energy", "--json"
    )
    assert res.exit_code == 0 and json.loads(res.stdout)["settings"]["energy"] is False, res.output
    (row,) = store_rows(quiet)
    assert (
        fold(read_events(quiet / bench.RUNS / row["run_id"] / "log.jsonl")).header.config["energy"] == "False"
    )
    one_line_error(cli(str(tmp_path / "suite"), *base[2:], "--out", str(quiet), "--resume", "--energy"),
                   "runs every task with --energy False, not True")  # fmt: skip
    bare = tmp_path / "bare"  # made without --corpus: a corpus given on resume would be ignored, so refused
    assert cli(str(tmp_path / "suite"), *base[2:], "--out", str(bare), "--evals", "2").exit_code == 0
    one_line_error(cli(str(tmp_path / "suite"), *base[2:], "--out", str(bare), "--resume", "--corpus", "none"),
                   "was made without --corpus")  # fmt: skip
    plain = {"suite": "s", "fingerprint": "f", "settings": {"evals": 2, "policy": "expert", "search": "mcts"}}
    assert bench.bench_config(config.load(home=home, corpus="cccl"), out, plain).corpus == "cccl"
    broken = {
        **plain,
        "settings": {**plain["settings"], "corpus": "cutlass+nope"},
    }  # a manifest edited by hand
    with pytest.raises(bench.BenchError, match=r"bench.json: bad configuration: corpus = 'cutlass\+nope'"):
        bench.bench_config(config.load(home=home), out, broken)


def test_the_device_sweep_script_resumes_a_copy_and_brings_back_its_rows_and_logs(tmp_path):
    """benchmarks/device_sweep.sh, as a GPU call runs it, here with evaluations replayed: the bench folder
    is resumed in a copy under /tmp, and $OUT gets one tar: the rows, the reports, the output and the new
    run logs."""
    import os
    import subprocess
    import tarfile

    suite = make_suite(tmp_path)
    kept = tmp_path / "kept"
    first = cli(str(suite), "--out", str(kept), "--evals", str(EVALS), "--replay", str(RECORDED),
                "--match", "1_Softmax", "--home", str(tmp_path / "home"))  # fmt: skip
    assert first.exit_code == 0, first.output
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "KERNELPRO_HOME": str(tmp_path / "home")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # python3: this venv's
    r = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_sweep.sh"), str(suite), str(kept), "600", "--replay",
         str(RECORDED)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out.iterdir()] == ["sweep-kept.tgz"]  # one file: the device returns a few
    with tarfile.open(out / "sweep-kept.tgz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    back = tmp_path / "back"
    rows = [json.loads(x) for x in (back / bench.STORE).read_text().splitlines()]
    assert [x["key"] for x in rows] == ["level1/1_Softmax", "level1/2_SoftmaxAgain", "level1/3_LayerNorm<b>"]
    assert len(store_rows(kept)) == 1  # the repository's copy is left as it was
    logs = list((back / "runs").glob("*/log.jsonl"))
    assert len(logs) == 1  # the one new run with a recording
    assert (back / "summary.json").is_file() and "rc=0" in (back / "bench.out").read_text()
    assert (
        (back / "doctor.txt").is_file()
        and (back / "report.md").is_file()
        and (back / "report.html").is_file()
    )
    # merge_sweep.sh brings it into the kept folder: the rows, the reports and the run log, compressed
    m = subprocess.run(["bash", str(ROOT / "benchmarks" / "merge_sweep.sh"), str(out / "sweep-kept.tgz"), str(kept)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert m.returncode == 0, m.stderr
    assert [x["key"] for x in store_rows(kept)] == [x["key"] for x in rows]
    (gz,) = (kept / "logs").glob("*.jsonl.gz")
    assert gz.name == logs[0].parent.name + ".jsonl.gz"
    assert gzip.decompress(gz.read_bytes()) == logs[0].read_bytes()
    assert "took 1 run log(s)" in m.stdout
    bad = subprocess.run(["bash", str(ROOT / "benchmarks" / "merge_sweep.sh"), str(out / "sweep-kept.tgz"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "not a bench folder" in bad.stderr
    fresh = tmp_path / "new-bench"  # a bench begun on the device: its kept folder not made yet
    m = subprocess.run(["bash", str(ROOT / "benchmarks" / "merge_sweep.sh"), str(out / "sweep-kept.tgz"), str(fresh)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert m.returncode == 0 and len(store_rows(fresh)) == len(rows), m.stderr
    assert bench.read_manifest(fresh) == bench.read_manifest(kept)  # the manifest comes too: resumable here
    empty = tmp_path / f"{tmp_path.name}-empty"  # a new bench: its folder made empty in the repository
    empty.mkdir()
    out2 = tmp_path / "out2"
    out2.mkdir()
    r = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_sweep.sh"), str(suite), str(empty), "600", "--replay",
         str(RECORDED), "--evals", str(EVALS), "--match", "1_Softmax"],
        cwd=ROOT, env={**env, "OUT": str(out2)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0 and "rc=0" in r.stdout, r.stdout + r.stderr
    with tarfile.open(out2 / f"sweep-{empty.name}.tgz") as tar:
        names = tar.getnames()
        assert {"bench.json", "results.jsonl", "doctor.txt", "bench.out"} <= set(names), names
        assert len(tar.extractfile("results.jsonl").read().splitlines()) == 1
    # HARD_S: a bench still running then is interrupted, and what there is still comes back in the tar
    out3 = tmp_path / "out3"
    out3.mkdir()
    r = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_sweep.sh"), str(suite), str(kept), "600", "--replay",
         str(RECORDED)],
        cwd=ROOT, env={**env, "OUT": str(out3), "HARD_S": "0.2"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    with tarfile.open(out3 / "sweep-kept.tgz") as tar:
        assert "rc=124" in tar.extractfile("bench.out").read().decode()
        assert {"bench.json", "results.jsonl", "doctor.txt"} <= set(tar.getnames())


def test_a_bench_keeps_one_set_of_workers_for_its_tasks_and_closes_it_whatever_happens(tmp_path):
    """The tasks run here share one worker pool (a confined worker takes ~11 s to start on the H200): a
    task's evaluator leaves it open, the bench closes it at the end, also when a task raised."""
    from pipeline import jobs
    from pipeline.evaluators import GpuEvaluator

    cfg = config.load(home=tmp_path / "home", device="cpu", job_timeout_s=60, worker_memory_mb=4096)
    with bench._shared_pool(cfg, False) as none:
        assert none is None  # replayed, or nothing to run: no worker started
    with pytest.raises(RuntimeError, match="a stage failed"), bench._shared_pool(cfg, True) as pool:
        assert pool is not None
        worker = pool.first
        assert isinstance(worker.request(jobs.Ping()).answer, jobs.Pong)
        GpuEvaluator(SOFTMAX, cfg, pool=pool).close()  # one task's run ends
        assert worker.alive()  # still there for the next task
        assert isinstance(worker.request(jobs.Ping()).answer, jobs.Pong)
        raise RuntimeError("a stage failed")
    assert not worker.alive()


def test_kernel_times_takes_a_bench_logs_candidates_whole():
    """benchmarks/kernel_times.py reads a kept bench's gzipped run log through read_events: the best candidate
    (the run's end names it) or every verified one in run order, each rebuilt byte for byte (its key
    recomputed)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_times

    from pipeline.candidates import candidate_key

    kept = ROOT / "benchmarks" / "results" / "bench-level2"
    rows = [json.loads(line) for line in (kept / "results.jsonl").read_text().splitlines()]
    (run_id,) = [r["run_id"] for r in rows if r["task"] == "19_ConvTranspose2d_GELU_GroupNorm"]
    log = kept / "logs" / f"{run_id}.jsonl.gz"  # the row's run (a retried row's older run is kept beside it)
    events = read_events(log)  # the kept copy, gzipped
    end = next(e.data for e in events if e.type == "end")
    task, best = kernel_times.recorded(events, "best")
    assert task == "19_ConvTranspose2d_GELU_GroupNorm" and [c.key for _, c in best] == [end["best_key"]]
    _, every = kernel_times.recorded(events, "all")
    ok = [e.data["key"] for e in events if e.type == "result" and e.data["verdict"]["status"] == "ok"]
    assert [c.key for _, c in every] == ok and len(ok) == end["evaluations"]
    for edit, c in every:
        assert c.key == candidate_key(c.source, c.launcher, c.flags) and c.edit == edit


def test_precompile_builds_a_tasks_first_kernels_into_a_cache_another_machine_unpacks(tmp_path):
    """benchmarks/precompile.py: the expert's first kernels of each task compiled here and tarred; unpacked
    into another home's cache, compiling the same candidates there is all cache hits (no nvcc)."""
    import subprocess
    import tarfile

    from pipeline.compile import ToolchainError, compile_candidates, find_nvcc

    try:
        find_nvcc(config.Config())
    except ToolchainError:
        pytest.skip("no nvcc")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import precompile

    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(SOFTMAX, suite / "softmax.py")
    out = tmp_path / "cubins.tgz"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "precompile.py"), str(suite), "--evals", "2", "--out", str(out),
         "--home", str(tmp_path / "here")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "softmax: 2 of 2 built" in r.stdout and "2 builds in" in r.stdout, r.stdout
    there = tmp_path / "there"
    (there / "cache").mkdir(parents=True)
    with tarfile.open(out) as tar:
        tar.extractall(there / "cache", filter="data")
    cands = precompile.first_kernels(suite / "softmax.py", 2)
    assert isinstance(cands, list) and len(cands) == 2
    builds = compile_candidates(cands, config.Config(home=there, arch="sm_90a"))
    assert all(b.status.value == "ok" and b.cached for b in builds), builds


def test_a_bench_resumed_on_another_card_says_which_rows_are_whose(ran, tmp_path):
    """Rows from two cards (a sweep resumed on another machine): the summary counts each card's timed rows,
    older rows without a card are 'not recorded', and the report says the geomeans mix cards."""
    from pipeline import suite_report

    out = copy_bench(ran, tmp_path)
    manifest, rows = bench.load_rows(out)
    timed = [r for r in rows if r["status"] == "ok"]
    timed[0]["gpu"] = "NVIDIA H100 80GB HBM3"
    older = {**timed[1], "key": "older", "gpu": None}
    s = bench.summary([*rows, older], manifest.get("tasks"))
    assert s["gpus"] == {"NVIDIA H100 80GB HBM3": 1, "NVIDIA H200": 1, "not recorded": 1}
    md = suite_report.bench_markdown(manifest, [*rows, older], s)
    assert (
        "- measured on: NVIDIA H100 80GB HBM3 (1 tasks), NVIDIA H200 (1 tasks), not recorded (1 tasks) (rows"
        in md
    )


def test_the_report_names_each_best_candidates_longest_kernels(ran, tmp_path):
    """Rows with the best candidate's kernels (Measurement.kernels): a Kernels section, one line a task with its
    three longest by share; a row without them (an older log, a failure) has no line."""
    from pipeline import suite_report

    out = copy_bench(ran, tmp_path)
    manifest, rows = bench.load_rows(out)
    timed = [r for r in rows if r["status"] == "ok"]
    timed[0]["kernels"] = {"kp_log_softmax_v4": 8400.0, "kp_gather_f32": 100.0}
    md = suite_report.bench_markdown(manifest, rows, bench.summary(rows, manifest.get("tasks")))
    section = md.split("## Kernels\n")[1].split("\n## ")[0]
    lines = [x for x in section.splitlines() if x.startswith("- ")]
    assert lines == [f"- `{timed[0]['key']}`: `kp_log_softmax_v4` 99% (8.4 ms), `kp_gather_f32` 1% (0.1 ms)"]
    del timed[0]["kernels"]
    assert "## Kernels" not in suite_report.bench_markdown(
        manifest, rows, bench.summary(rows, manifest.get("tasks"))
    )
