"""The closed loop end to end on the GPU: `kernelpro optimize` with the offline expert policy, and with the
LLM policy against a loopback chat-completions server, each finding a correct kernel faster than eager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.runlog import read_events

ROOT = Path(__file__).resolve().parent.parent
_torch = pytest.importorskip("torch")
# Every test here needs a CUDA device: on a machine without one, `make test-gpu` skips them and says why.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _torch.cuda.is_available(), reason="no CUDA device visible"),
]


def _optimize(tmp_path: Path, *args: str) -> dict:
    runner = CliRunner()
    res = runner.invoke(
        app,
        ["optimize", "--runs-dir", str(tmp_path / "runs"), "--home", str(tmp_path / "home"), "--no-memory",
         "--json", *args],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _check_run(summary: dict) -> list:
    folder = Path(summary["folder"])
    events = read_events(folder / "log.jsonl")
    results = [e for e in events if e.type == "result"]
    assert results and any(e.data["verdict"]["status"] == "ok" for e in results)
    assert summary["best_key"] and summary["best_speedup_eager"] > 1.0, summary
    assert (folder / "best" / "kernel.cu").is_file() and (folder / "best" / "launcher.py").is_file()
    assert summary["exported"] and Path(summary["exported"]).is_file()
    assert (folder / "report.md").is_file() and (folder / "report.html").is_file()
    final = [e for e in events if e.type == "final"]
    assert final and final[0].data["verdict"]["status"] == "ok"  # the best re-measured, energy on
    return events


def test_optimize_expert_softmax(tmp_path):
    summary = _optimize(tmp_path, "--task", str(ROOT / "tasks" / "softmax.py"), "--policy", "expert",
                        "--max-evals", "10")  # fmt: skip
    events = _check_run(summary)
    profiles = [e.data for e in events if e.type == "profile"]
    assert any(p["ok"] for p in profiles), profiles  # the advice fed the expansion


def test_optimize_llm_policy_over_loopback(tmp_path, monkeypatch):
    from loopback_llm import LoopbackLLM, good

    with LoopbackLLM(default=good()) as server:
        monkeypatch.setenv("KERNELPRO_LLM_BASE_URL", server.url)
        monkeypatch.setenv("KERNELPRO_LLM_API_KEY", "sk-test-gpu-secret")
        summary = _optimize(tmp_path, "--task", str(ROOT / "tasks" / "softmax.py"), "--policy", "llm",
                            "--max-evals", "2")  # fmt: skip
        assert server.requests, "the policy never called the endpoint"
    _check_run(summary)
    raw = (Path(summary["folder"]) / "log.jsonl").read_text()
    assert "sk-test-gpu-secret" not in raw
