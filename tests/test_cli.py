"""The `kernelpro` command on bad input: one clear line on stderr, a non-zero exit, nothing half-written."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.candidates import load_export

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "candidates" / "elementwise_chain"


def kp(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=300,
    )


def assert_one_line_error(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:") and needle in lines[0], lines
    assert "Traceback" not in r.stderr


def test_missing_task_file(tmp_path):
    r = kp(
        "eval",
        "--task",
        str(tmp_path / "nope.py"),
        "--candidate",
        str(EXAMPLE),
        "--device",
        "cpu",
        "--home",
        str(tmp_path / "h"),
    )
    assert_one_line_error(r, "task file not found")


@pytest.mark.slow
def test_task_with_syntax_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("class Model(:\n")
    r = kp(
        "eval",
        "--task",
        str(bad),
        "--candidate",
        str(EXAMPLE),
        "--device",
        "cpu",
        "--home",
        str(tmp_path / "h"),
    )
    assert_one_line_error(r, "broken.py: syntax error at line 1")


def test_missing_candidate_folder(tmp_path):
    task = ROOT / "tasks" / "elementwise_chain.py"
    r = kp(
        "export",
        "--task",
        str(task),
        "--candidate",
        str(tmp_path / "none"),
        "-o",
        str(tmp_path / "x.py"),
        "--home",
        str(tmp_path / "h"),
    )
    assert_one_line_error(r, "candidate folder not found")
    assert not (tmp_path / "x.py").exists()


def test_no_gpu_is_a_clear_error(tmp_path):
    # An empty PATH hides nvidia-smi, as on a machine without a GPU driver.
    r = kp("calibrate", "--home", str(tmp_path / "h"), env={"PATH": str(tmp_path)})
    assert_one_line_error(r, "no NVIDIA GPU found")


def test_missing_toolchain_is_a_clear_error(tmp_path):
    task = ROOT / "tasks" / "elementwise_chain.py"
    r = kp(
        "export",
        "--task",
        str(task),
        "--candidate",
        str(EXAMPLE),
        "-o",
        str(tmp_path / "x.py"),
        "--home",
        str(tmp_path / "h"),
        env={"KERNELPRO_NVCC": str(tmp_path / "no-nvcc")},
    )
    assert_one_line_error(r, "nvcc")
    assert not (tmp_path / "x.py").exists()


def test_bad_config_value_is_a_clear_error(tmp_path):
    r = kp("calibrate", "--home", str(tmp_path / "h"), env={"KERNELPRO_TRIALS": "three"})
    assert_one_line_error(r, "KERNELPRO_TRIALS='three' is not a valid int")


def test_unknown_baseline_mode(tmp_path):
    r = kp(
        "baseline",
        "--task",
        str(ROOT / "tasks" / "softmax.py"),
        "--modes",
        "eager,turbo",
        "--home",
        str(tmp_path / "h"),
    )
    assert_one_line_error(r, "unknown baseline mode(s): turbo")


@pytest.mark.slow
def test_export_writes_a_standalone_file(tmp_path):
    out = tmp_path / "model_new.py"
    r = kp(
        "export",
        "--task",
        str(ROOT / "tasks" / "elementwise_chain.py"),
        "--candidate",
        str(EXAMPLE),
        "-o",
        str(out),
        "--home",
        str(tmp_path / "h"),
    )
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    compile(text, str(out), "exec")  # valid Python as a whole
    assert "class ModelNew" in text and "_CUBIN" in text and "CUDA_SOURCE" in text
    assert "import pipeline" not in text and "from pipeline" not in text
    # importing it needs no GPU (the cubin loads on first use) and nothing of kernelpro
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import importlib.util as u; s = u.spec_from_file_location('m', 'model_new.py'); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); print(len(m._CUBIN), m.ModelNew.__name__)"
    )
    r2 = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r2.returncode == 0, r2.stderr
    size, name = r2.stdout.split()
    assert int(size) > 1000 and name == "ModelNew"
    assert r2.stdout and not (tmp_path / "pipeline").exists()
    # the in-process loader the benchmark tools use takes it (a task loader would want the task's Model)
    assert load_export(out).ModelNew.__name__ == "ModelNew"


@pytest.mark.slow
def test_eval_json_on_cpu_standin(tmp_path):
    """The whole eval path on the CPU: a Python stand-in is statically rejected (no kernel), as JSON."""
    cand = tmp_path / "cand"
    cand.mkdir()
    (cand / "kernel.cu").write_text('extern "C" __global__ void noop() {}\n')
    (cand / "launcher.py").write_text(
        "import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n"
        "    def __init__(self, scale, shift):\n        super().__init__()\n"
        "    def forward(self, x):\n        return torch.tanh(x)\n"
    )
    r = kp(
        "eval",
        "--task",
        str(ROOT / "tasks" / "elementwise_chain.py"),
        "--candidate",
        str(cand),
        "--json",
        "--device",
        "cpu",
        "--home",
        str(tmp_path / "h"),
    )
    assert r.returncode == 1, r.stderr
    (result,) = json.loads(r.stdout)
    assert result["verdict"]["status"] == "rejected"
    assert any(x.startswith("static:no_kernel_launch") for x in result["verdict"]["reasons"])


# -- the rough edges a new user hits ------------------------------------------------------------------------
# CliRunner runs the real command in-process (stdout and stderr captured apart, neither a terminal); `kp`
# runs it as a separate process where a real pipe or signal matters.

RUNS = ROOT / "tests" / "fixtures" / "runs" / "softmax"
SOFTMAX = ROOT / "tasks" / "softmax.py"
REPLAY = [a for p in sorted(RUNS.glob("*/log.jsonl")) for a in ("--replay", str(p))]


def cli(*args: str, env: dict | None = None):
    from typer.testing import CliRunner

    from pipeline.cli import app

    return CliRunner().invoke(app, list(args), env=env)


def assert_cli_one_line_error(res, needle: str) -> str:
    assert res.exit_code == 2, (res.stdout, res.stderr)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception  # no traceback
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.stderr
    return lines[0]


def replay_run(tmp: Path, evals: int, **kw) -> Path:
    """A real search over the H200 recordings (no GPU): the run folder."""
    from pipeline import config
    from pipeline.loop import optimize

    cfg = config.load(
        runs_dir=tmp / "runs", home=tmp / "home", memory=False, policy="expert", max_evals=evals
    )
    return optimize(SOFTMAX, cfg, replay=sorted(RUNS.glob("*/log.jsonl")), **kw).folder


def events_of(folder: Path) -> list:
    from pipeline.runlog import read_events

    return read_events(folder / "log.jsonl")


def opt(tmp: Path, *args: str, env: dict | None = None):
    base = ["optimize", "--policy", "expert", "--no-memory", "--runs-dir", str(tmp / "runs")]
    return cli(*base, "--home", str(tmp / "home"), *args, env=env)


# 1. one clear line, exit code 2, instead of a traceback


def test_replay_of_a_missing_log_is_one_line(tmp_path):
    res = opt(tmp_path, "--task", str(SOFTMAX), "--replay", str(tmp_path / "nonexistent"))
    assert_cli_one_line_error(res, "no run log there")
    assert not (tmp_path / "runs").exists()


def test_home_or_runs_dir_that_is_a_file(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    res = cli("eval", "--task", str(SOFTMAX), "-c", str(EXAMPLE), "--device", "cpu", "--home", str(blocker))
    assert_cli_one_line_error(res, f"home {blocker} is a file, not a folder")
    res = cli("export", "--task", str(SOFTMAX), "-c", str(EXAMPLE), "-o", str(tmp_path / "x.py"),
              "--home", str(blocker))  # fmt: skip
    assert_cli_one_line_error(res, "is a file, not a folder")
    res = cli(
        "optimize", "--task", str(SOFTMAX), "--runs-dir", str(blocker), "--home", str(tmp_path / "h"), *REPLAY
    )
    assert_cli_one_line_error(res, f"runs_dir {blocker} is a file, not a folder")


def test_export_onto_a_folder_is_refused_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    res = cli(
        "export", "--task", str(SOFTMAX), "-c", str(EXAMPLE), "-o", str(target), "--home", str(tmp_path / "h")
    )
    assert_cli_one_line_error(res, "is a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no out.tmp, no home
    assert not any(target.iterdir())


def test_index_eval_names_a_case_without_expect(tmp_path):
    cases = tmp_path / "cases.toml"
    cases.write_text('[[case]]\nquery = "tma copy"\nexpect = "a.h"\n\n[[case]]\nquery = "stream-K"\n')
    res = cli("index", "eval", "--cases", str(cases), "--home", str(tmp_path / "h"))
    assert_cli_one_line_error(res, "case 2 ('stream-K') has no `expect`")


def broken_run(tmp_path: Path, finished: bool) -> Path:
    """A copy of a recorded run whose first result names a node no proposal made."""
    src = (RUNS / "mcts" / "log.jsonl").read_text().splitlines()
    lines = [json.loads(x) for x in src]
    first = next(e for e in lines if e["type"] == "result")
    first["data"]["node"] = 99
    if not finished:
        lines = [e for e in lines if e["type"] not in ("final", "end")]
    folder = tmp_path / "runs" / "broken"
    folder.mkdir(parents=True)
    (folder / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return folder


def test_a_log_that_names_a_missing_node(tmp_path):
    folder = broken_run(tmp_path, finished=True)
    before = (folder / "log.jsonl").read_bytes()
    res = opt(tmp_path, "--resume", "broken", *REPLAY)
    assert_cli_one_line_error(res, "names node 99, which no proposal made")
    res = cli("show", "broken", "--runs-dir", str(tmp_path / "runs"))
    assert_cli_one_line_error(res, "names node 99")
    res = cli("show", "--runs-dir", str(tmp_path / "runs"), "--json")
    assert res.exit_code == 0 and [r["status"] for r in json.loads(res.stdout)] == ["corrupt"]
    assert (folder / "log.jsonl").read_bytes() == before  # nothing appended by the refused resume
    assert sorted(p.name for p in folder.iterdir()) == ["lock", "log.jsonl"]


# 2. Rich markup in data is shown as text


def test_markup_in_paths_and_messages_is_shown_literally(tmp_path):
    for name in ("[/x]t.py", "[red]x.py"):
        res = cli("eval", "--task", str(tmp_path / name), "-c", str(EXAMPLE), "--home", str(tmp_path / "h"))
        assert_cli_one_line_error(res, f"task file not found: {tmp_path / name}")
    corpus = tmp_path / "nosource.toml"
    corpus.write_text('name = "x"\n')
    res = cli("index", "build", "--corpus", str(corpus), "--home", str(tmp_path / "h"))
    assert_cli_one_line_error(res, "missing [source] table")


# 3. budgets and limits that mean nothing are refused before anything is written


def test_meaningless_budgets_are_refused_by_the_cli(tmp_path):
    for args, option in ((("--max-evals", "0"), "--max-evals"), (("--max-evals", "-5"), "--max-evals"),
                         (("--max-wall", "-1"), "--max-wall"), (("--children", "0"), "--children"),
                         (("--search", "beam"), "--search"), (("--objective", "speed"), "--objective"),
                         (("--feedback", "loud"), "--feedback")):  # fmt: skip
        res = opt(tmp_path, "--task", str(SOFTMAX), *args, *REPLAY)
        assert res.exit_code == 2 and option in res.stderr, (args, res.stderr)
    assert not (tmp_path / "runs").exists()


def test_meaningless_config_values_are_named_with_their_range(tmp_path):
    for var, value, needle in (
        ("KERNELPRO_TRIALS", "-1", "trials = -1 (KERNELPRO_TRIALS or its option) is out of range: it must be at least 1"),
        ("KERNELPRO_COMPILE_JOBS", "0", "compile_jobs = 0"),
        ("KERNELPRO_MAX_EVALS", "0", "max_evals = 0"),
        ("KERNELPRO_MAX_WALL_S", "0", "max_wall_s = 0.0 (KERNELPRO_MAX_WALL_S or its option) is out of range: it must be more than 0"),
        ("KERNELPRO_LLM_TEMPERATURE", "3", "llm_temperature = 3.0"),
        ("KERNELPRO_CHECK_FRACTION", "0", "check_fraction = 0.0 (KERNELPRO_CHECK_FRACTION or its option) is out of range: it must be between 0 and 1 (more than 0)"),
        ("KERNELPRO_CHECK_FRACTION", "1.5", "check_fraction = 1.5"),
        ("KERNELPRO_SEARCH", "beam", "search = 'beam' is not one of mcts, greedy"),
        ("KERNELPRO_BASELINES", "eager,turbo", "baselines = 'turbo' is not one of"),
        ("KERNELPRO_L2_FLUSH", "dirty", "l2_flush = 'dirty' is not one of clean, writes"),
    ):  # fmt: skip
        res = opt(tmp_path, "--task", str(SOFTMAX), *REPLAY, env={var: value})
        assert_cli_one_line_error(res, needle)
    assert not (tmp_path / "runs").exists()


def test_the_corpus_setting_is_none_a_corpus_or_corpora_joined_by_plus(tmp_path, monkeypatch):
    from pipeline import config

    assert config.Config().corpus == "cutlass"  # today's behaviour unless said otherwise
    for value, names in (("none", ()), ("cutlass", ("cutlass",)), ("cutlass+cccl", ("cutlass", "cccl")),
                         ("local+cutlass+cutlass_dsl", ("local", "cutlass", "cutlass_dsl"))):  # fmt: skip
        assert config.corpus_names(value) == names
        assert config.validate(config.Config(corpus=value)).corpus == value
    for value, why in (("cutlas", "(unknown 'cutlas')"), ("cutlass+cutlass", "(cutlass named twice)"),
                       ("none+cccl", "('none' joined with corpora)"), ("cutlass+", "(an empty name)"),
                       ("", "(an empty name)"), ("cutlass cccl", "(unknown 'cutlass cccl')"),
                       (None, "(not text)")):  # fmt: skip
        with pytest.raises(ValueError) as e:
            config.validate(config.Config(corpus=value))  # type: ignore[arg-type]
        msg = str(e.value)
        assert f"corpus = {value!r} {why} is not 'none', a corpus or corpora joined by '+'" in msg, msg
        assert msg.endswith("the corpora are cccl, cutlass, cutlass_dsl, local") and "\n" not in msg
    monkeypatch.setenv("KERNELPRO_CORPUS", "cutlass+local")
    assert config.load(home=tmp_path / "h").corpus == "cutlass+local"
    assert config.load(home=tmp_path / "h", corpus="none").corpus == "none"  # the option wins


def test_a_bad_corpus_is_one_line_from_the_environment_and_the_options(tmp_path):
    needle = "corpus = 'cccl+nope' (unknown 'nope') is not 'none'"
    assert_cli_one_line_error(opt(tmp_path, "--task", str(SOFTMAX), *REPLAY, env={"KERNELPRO_CORPUS": "cccl+nope"}),
                              needle)  # fmt: skip
    assert_cli_one_line_error(opt(tmp_path, "--task", str(SOFTMAX), "--corpus", "cccl+nope", *REPLAY), needle)
    res = cli("bench", str(ROOT / "tasks"), "--out", str(tmp_path / "b"), "--corpus", "cccl+nope")
    assert_cli_one_line_error(res, needle)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "b").exists()


def test_every_numeric_config_field_has_a_range():
    import dataclasses

    from pipeline import config

    numeric = {f.name for f in dataclasses.fields(config.Config) if f.type in ("int", "float")}
    assert numeric and numeric <= set(config._RANGES), sorted(numeric - set(config._RANGES))
    assert set(config._RANGES) <= numeric  # no range for a field that is gone
    config.validate(config.Config())  # the defaults are in range


def test_an_energy_objective_without_energy_measured_is_refused():
    from pipeline import config

    for objective in ("energy", "edp"):
        with pytest.raises(
            ValueError, match=f"objective = '{objective}' counts joules: it needs energy measured"
        ):
            config.validate(config.Config(objective=objective, energy=False))
    assert not config.validate(config.Config(energy=False)).energy  # time alone needs none


def test_cli_choices_are_the_configs():
    from pipeline import cli as cli_mod
    from pipeline import config

    for enum, field in ((cli_mod.Policy, "policy"), (cli_mod.Search, "search"),
                        (cli_mod.Objective, "objective"), (cli_mod.FeedbackMode, "feedback")):  # fmt: skip
        assert tuple(m.value for m in enum) == config.CHOICES[field]


# 4. resume keeps the recorded budget; a finished run stays finished unless --more asks


def test_resume_keeps_the_recorded_budget(tmp_path):
    folder = replay_run(tmp_path, evals=3)
    log = folder / "log.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    cut = next(i for i, x in enumerate(lines) if json.loads(x)["type"] in ("final", "end"))
    log.write_text("".join(lines[:cut]))  # as if killed before the end
    res = opt(tmp_path, "--resume", folder.name, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["evaluations"] == 3  # not the default 40
    events = events_of(folder)
    assert events[-1].type == "end" and events[-1].data["reason"] == "evaluation budget spent (3)"


def test_a_finished_run_is_not_reopened_unless_more_is_asked(tmp_path):
    folder = replay_run(tmp_path, evals=3)
    before = (folder / "log.jsonl").read_bytes()
    res = opt(tmp_path, "--resume", folder.name)
    assert res.exit_code == 0, res.output
    lines = [x for x in res.stdout.splitlines() if x.strip()]
    assert len(lines) == 1 and f"run {folder.name} is finished" in lines[0] and "--more" in lines[0]
    assert (folder / "log.jsonl").read_bytes() == before  # no event after `end`
    res = opt(tmp_path, "--resume", folder.name, "--more", "2", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["evaluations"] == 5
    events = events_of(folder)
    assert [e.type for e in events].count("end") == 2 and events[-1].type == "end"
    assert sum(e.type == "result" for e in events) == 5
    res = cli("show", "--runs-dir", str(tmp_path / "runs"), "--json")
    assert json.loads(res.stdout)[0]["status"] == "finished"
    res = opt(tmp_path, "--resume", folder.name, "--more", "1", "--max-evals", "9")
    assert_cli_one_line_error(res, "not both")


# 5. interruptions: an unreachable endpoint, Ctrl-C


def test_an_unreachable_llm_endpoint_is_named_and_leaves_no_run(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    env = {"KERNELPRO_LLM_BASE_URL": url, "KERNELPRO_LLM_API_KEY": "sk-x"}
    res = cli("optimize", "--task", str(SOFTMAX), "--policy", "llm", "--no-memory", "--runs-dir",
              str(tmp_path / "runs"), "--home", str(tmp_path / "h"), *REPLAY, env=env)  # fmt: skip
    assert_cli_one_line_error(res, f"the LLM endpoint {url} cannot be reached")
    assert not (tmp_path / "runs").exists()


def test_ctrl_c_names_the_run_and_the_command_that_resumes_it(tmp_path):
    import os
    import signal
    import time

    for attempt in range(3):  # a replayed run takes a second or two: on a busy machine it may end first
        runs = tmp_path / f"runs{attempt}"
        args = [sys.executable, "-m", "pipeline.cli", "optimize", "--task", str(SOFTMAX), "--policy", "expert",
                "--no-memory", "--runs-dir", str(runs), "--home", str(tmp_path / "h"), "--max-evals", "40", *REPLAY]  # fmt: skip
        # As from a terminal: a test run started in the background (a CI shell's `&`) passes SIGINT on ignored,
        # and Python then leaves it ignored
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            logs = list(runs.glob("*/log.jsonl"))
            if logs and sum(1 for _ in logs[0].open()) >= 4:  # started, baselines in, searching
                break
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.kill(
                proc.pid, signal.SIGSTOP
            )  # held still, so the interrupt lands while it runs, or not at all
        if proc.poll() is None:
            break
        proc.communicate(timeout=60)
    else:
        pytest.fail("the run ended before it could be interrupted, three times")
    proc.send_signal(signal.SIGINT)
    os.kill(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=60)
    run_id = next(runs.iterdir()).name
    assert proc.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert run_id in last and f"kernelpro optimize --resume {run_id} --runs-dir {runs}" in last, stderr
    assert "Traceback" not in stderr
    assert events_of(runs / run_id)[-1].type == "interrupted"


# 6. output without a terminal


def test_piped_output_is_not_cut_at_80_columns_and_progress_shows(tmp_path):
    folder = replay_run(tmp_path, evals=2)
    r = kp("show", "--runs-dir", str(tmp_path / "runs"))  # stdout is a pipe
    assert r.returncode == 0, r.stderr
    (row,) = [x for x in r.stdout.splitlines() if folder.name in x]  # the whole id, on one line
    assert "finished" in row and "…" not in r.stdout
    r = kp("optimize", "--task", str(SOFTMAX), "--policy", "expert", "--no-memory", "--runs-dir",
           str(tmp_path / "runs2"), "--home", str(tmp_path / "h"), "--max-evals", "2", *REPLAY)  # fmt: skip
    assert r.returncode == 0, r.stderr
    progress = [x for x in r.stderr.splitlines() if x.startswith("run ") and "evaluations" in x]
    assert len(progress) >= 3 and any("2/2 evaluations" in x for x in progress), r.stderr


@pytest.mark.slow
def test_eval_names_candidates_by_folder(tmp_path):
    cand = tmp_path / "my_candidate"
    cand.mkdir()
    (cand / "kernel.cu").write_text('extern "C" __global__ void noop() {}\n')
    (cand / "launcher.py").write_text(
        "import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n"
        "    def __init__(self, scale, shift):\n        super().__init__()\n"
        "    def forward(self, x):\n        return torch.tanh(x)\n"
    )
    task = str(ROOT / "tasks" / "elementwise_chain.py")
    r = kp("eval", "--task", task, "--candidate", str(cand), "--device", "cpu", "--home", str(tmp_path / "h"))
    assert r.returncode == 1, r.stderr
    (row,) = [x for x in r.stdout.splitlines() if "rejected" in x]
    assert "my_candidate" in row  # the folder, beside its key
    assert "my_candidate: static:no_kernel_launch" in r.stdout


# 8. make install and friends (dry runs: nothing is installed)


def make_n(tmp_path: Path, *args: str, gpu: bool) -> str:
    import shutil

    fake = tmp_path / ("gpu" if gpu else "nogpu")
    fake.mkdir(exist_ok=True)
    if gpu:
        (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
        (fake / "nvidia-smi").chmod(0o755)
    make = shutil.which("make")
    assert make, "make is not installed"
    r = subprocess.run([make, "-n", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60,
                       env={"PATH": str(fake), "HOME": str(tmp_path)})  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def pip_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if "pip install" in x and "--upgrade pip" not in x]


def test_make_install_takes_torch_by_machine_and_index(tmp_path):
    nogpu = pip_lines(make_n(tmp_path, "install", "CUDA_HOME=/nonexistent", gpu=False))
    assert "torch==2.13.0" in nogpu[0] and "--index-url" not in nogpu[0]
    gpu = pip_lines(make_n(tmp_path, "install", "CUDA_HOME=/nonexistent", gpu=True))
    assert "'torch>=2.8,<2.15'" in gpu[0] and "torch==" not in gpu[0]
    cpu_index = "file:///wheels/cpu"
    for has_gpu in (False, True):
        lines = pip_lines(make_n(tmp_path, "install", f"TORCH_INDEX_URL={cpu_index}", gpu=has_gpu))
        assert f'--index-url "{cpu_index}"' in lines[0]
        assert all("--index-url" not in x for x in lines[1:])  # the project's own deps: pip's usual index
    # No nvcc anywhere: NVIDIA's nvcc wheels go into the venv; with one, nothing extra.
    assert any("nvidia-cuda-nvcc" in x for x in nogpu)
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    assert not any(
        "nvidia-cuda-nvcc" in x
        for x in pip_lines(make_n(tmp_path, "install", f"CUDA_HOME={cuda}", gpu=False))
    )


def test_make_index_passes_a_folder(tmp_path):
    out = make_n(tmp_path, "index", "CORPUS=local", "FOLDER=my sources", gpu=False)
    assert '--corpus local --folder "my sources"' in out
    assert "--folder" not in make_n(tmp_path, "index", gpu=False)


@pytest.mark.slow
def test_make_test_gpu_skips_without_a_cuda_device_and_its_workers_keep_each_file_together():
    """With no CUDA device visible every GPU test is skipped with its reason; none fails. GPU_WORKERS=2: each
    file's GPU tests run on one worker (their module fixtures, e.g. test_sandbox's fixed escape folder, must
    not be built twice at once), and test_gpu_expert's cases are units of their own."""
    import shutil

    from conftest import xdist_scope

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTEST_ADDOPTS": "-vv"}
    r = subprocess.run([shutil.which("make") or "make", "-C", str(ROOT), "test-gpu", "GPU_WORKERS=2"],
                       capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    assert not re.search(r"\d+ (failed|errors?)\b", r.stdout), r.stdout[-3000:]
    assert "skipped" in r.stdout and "no CUDA device" in r.stdout
    workers: dict[str, set[str]] = {}
    for m in re.finditer(r"^\[(gw\d+)\].*? (?:SKIPPED|PASSED) (tests/\w+\.py)::", r.stdout, re.M):
        workers.setdefault(m[2], set()).add(m[1])
    assert {"tests/test_sandbox.py", "tests/test_adversarial.py", "tests/test_gpu_harness.py"} <= set(workers)
    assert all(len(w) == 1 for f, w in workers.items() if f != "tests/test_gpu_expert.py"), workers
    case = "tests/test_gpu_expert.py::test_family_candidates_verify_on_awkward_shapes[chain-(7,)]"
    assert xdist_scope(case) == case
    assert xdist_scope("tests/test_sandbox.py::test_gpu_payloads") == "tests/test_sandbox.py"


_SHARED_GPU_CASES = """import os

import pytest


@pytest.mark.gpu
def test_tripped_by_the_other_workers():  # fails on its first run only, as hidden_work under sharing did
    flag = os.path.join(os.path.dirname(__file__), "ran")
    if not os.path.exists(flag):
        open(flag, "w").close()
        raise AssertionError("hidden_work: host time against events (another process time-slicing the GPU)")


@pytest.mark.gpu
def test_broken():
    assert os.environ.get("KP_BROKEN") != "1"
"""


@pytest.mark.parametrize("broken", [False, True])
def test_make_test_gpu_runs_the_failures_of_its_workers_again_alone_and_that_run_decides(tmp_path, broken):
    """GPU_WORKERS=2: a case that failed while the workers shared the GPU passes alone and the suite passes;
    a case that fails both times fails it."""
    import shutil

    (tmp_path / "test_shared.py").write_text(_SHARED_GPU_CASES)
    env = {**os.environ, "KP_BROKEN": "1" if broken else "0"}
    args = [
        "test-gpu",
        "GPU_WORKERS=2",
        f"GPU_FILES={tmp_path / 'test_shared.py'}",
        f"GPU_CACHE={tmp_path / 'c'}",
    ]
    r = subprocess.run([shutil.which("make") or "make", "-C", str(ROOT), *args],
                       capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert "once more alone in one process" in r.stdout, r.stdout[-3000:]
    assert (r.returncode != 0) == broken, r.stdout[-3000:]
    alone = r.stdout.rsplit("once more alone in one process", 1)[1]  # after the echo, not the command
    (summary,) = re.findall(r"^.*\d+ passed.*$", alone, re.M)
    assert summary.startswith("1 failed, 1 passed" if broken else "1 passed"), summary


def test_an_append_cut_short_by_ctrl_c_is_resynced_before_the_interrupted_mark(tmp_path):
    """Ctrl-C between an append's write and its bookkeeping: the file has the line, the RunLog does not."""
    from pipeline.runlog import RunLog, read_events

    with RunLog.create(tmp_path, "r1", {"task": {"id": "t"}}, fsync=False) as log:
        log.append("iteration", {"iteration": 1, "node": 0})
        with log.path.open("a") as f:  # what the interrupted append had already written
            f.write(
                json.dumps({"seq": 2, "type": "iteration", "t": 0.0, "data": {"iteration": 2, "node": 0}})
                + "\n"
            )
        log.resync()
        log.append("interrupted", {"evaluations": 0})
    events = read_events(tmp_path / "r1")
    assert [(e.seq, e.type) for e in events] == [
        (0, "start"),
        (1, "iteration"),
        (2, "iteration"),
        (3, "interrupted"),
    ]
