"""pipeline/memory.py and `kernelpro memory` against a real Chroma folder in tmp_path and the packaged model."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from index.store import Embedder, StoreError
from pipeline import memory as memory_mod
from pipeline.cli import app
from pipeline.config import load
from pipeline.generate.base import Lesson
from pipeline.memory import Memory, StoredLesson, lessons_from_result, task_features
from pipeline.tasks import probe
from pipeline.types import Finding, Status, Task

ROOT = Path(__file__).resolve().parent.parent

DRAM = Finding(
    tool="dram",
    severity=0.9,
    evidence={"dram_pct": 58.0},
    diagnosis="DRAM throughput at 58% of peak: the row is read three times (max, sum, write passes)",
    advice="keep the row in registers and read it once",
)
TENSOR_CORES = Finding(
    tool="tensor_cores",
    severity=0.8,
    evidence={"tensor_pct": 12.0},
    diagnosis="tensor pipes idle: the GEMM runs on FMA units",
    advice="use wgmma with a TMA-fed shared memory pipeline",
)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    # The process-wide instance, so CLI commands run in-process below reuse it instead of loading again.
    return memory_mod._shared_embedder(load())


@pytest.fixture(scope="module")
def tasks() -> dict[str, Task]:
    return {
        name: probe(ROOT / "tasks" / f"{name}.py") for name in ("softmax", "layernorm", "matmul_bias_gelu")
    }


@pytest.fixture
def mem(tmp_path: Path, embedder: Embedder) -> Memory:
    return Memory(load(home=tmp_path / "home"), embedder=embedder)


def _lesson(
    task: Task,
    edit: str,
    status: Status,
    speedup: float | None,
    finding: Finding | None = DRAM,
    run_id: str = "run-1",
    **kw,
):
    return lessons_from_result(
        task, run_id, "parent-key", edit, finding, status, speedup, bound="memory-bound: x", **kw
    )


def test_task_features_describe_the_task(tasks):
    soft = task_features(tasks["softmax"], "memory-bound: DRAM at 58%")
    assert soft.startswith("softmax (row reduction) over the last dim; ops softmax; float32; 16384x4096")
    assert "memory-heavy" in soft and soft.endswith("; memory-bound")  # the class, not the changing numbers
    assert task_features(tasks["softmax"], "memory-bound: DRAM at 58%") == soft  # deterministic
    norm = task_features(tasks["layernorm"])
    assert "normalization (row reduction) over the last dim" in norm and "LayerNorm" in norm
    gemm = task_features(tasks["matmul_bias_gelu"])
    assert "matrix multiply (GEMM)" in gemm and "bfloat16" in gemm and "compute-heavy" in gemm


def test_outcomes_from_results(tasks):
    t = tasks["softmax"]
    faster = _lesson(t, "single_pass_online_softmax", Status.OK, 1.8)
    assert faster.helpful and faster.gain == 1.8 and faster.outcome == "1.80x faster than its parent"
    assert faster.finding.startswith("dram: DRAM throughput at 58%")
    same = _lesson(t, "unroll(4)", Status.OK, 1.02)
    assert not same.helpful and same.outcome == "no change (1.02x)" and same.gain == 1.02
    assert _lesson(t, "unroll(8)", Status.OK, 0.97).outcome == "no change (0.97x)"  # bounds included
    assert not _lesson(t, "unroll(16)", Status.OK, 1.03).helpful
    slower = _lesson(t, "more_blocks", Status.OK, 0.8)
    assert not slower.helpful and slower.outcome == "slower than its parent (0.80x)"
    broken = _lesson(t, "warp_shuffle_reduce", Status.MISMATCH, 2.5, finding=None)
    assert broken.gain is None and broken.outcome == "failed: mismatch" and broken.finding == "no finding"
    assert broken.status == "mismatch" and type(broken.status) is str


def test_round_trip_add_list_search(mem, tasks):
    assert mem.list() == [] and mem.count() == 0 and mem.search("softmax") == []
    t = tasks["softmax"]
    old = _lesson(t, "vectorize_loads(width=4)", Status.OK, 1.3, created=1000.0)
    new = _lesson(t, "warp_shuffle_reduce", Status.MISMATCH, None, created=2000.0)
    assert mem.add([old, new]) == 2
    assert mem.count() == 2
    assert [s.edit for s in mem.list()] == ["warp_shuffle_reduce", "vectorize_loads(width=4)"]  # newest first
    assert mem.list(limit=1) == [new]  # every field survives the round trip, id included
    (got,) = mem.list(limit=1)
    assert isinstance(got, StoredLesson) and got.id.startswith("lesson-")
    assert (
        got.status == "mismatch" and got.gain is None and got.run_id == "run-1" and got.parent == "parent-key"
    )

    found = mem.search("vectorized 128-bit loads for a softmax", k=2)
    assert len(found) == 2 and all(isinstance(x, Lesson) for x in found)
    assert found[0].edit == "vectorize_loads(width=4)" and found[0].gain == 1.3
    assert 0.0 < found[1].similarity <= found[0].similarity <= 1.0
    helpful = mem.search("softmax", k=5, only_helpful=True)
    assert [x.edit for x in helpful] == ["vectorize_loads(width=4)"]


def test_softmax_lesson_helps_the_next_layernorm(mem, tasks):
    mem.add(
        [
            _lesson(
                tasks["matmul_bias_gelu"],
                "wgmma_tma_pipeline(stages=4)",
                Status.OK,
                3.1,
                finding=TENSOR_CORES,
            ),
            _lesson(tasks["softmax"], "single_pass_online_softmax", Status.OK, 1.8),
        ]
    )
    layernorm = tasks["layernorm"]
    hits = mem.search(task_features(layernorm, "memory-bound: DRAM at 55%"), k=2)
    assert [h.edit for h in hits] == ["single_pass_online_softmax", "wgmma_tma_pipeline(stages=4)"], hits
    assert hits[0].similarity > hits[1].similarity
    ctx = mem.for_context(layernorm, "memory-bound: DRAM at 55%", [DRAM], k=1)
    assert [c.edit for c in ctx] == ["single_pass_online_softmax"]


def test_re_adding_is_idempotent(mem, tasks):
    a = _lesson(tasks["softmax"], "vectorize_loads(width=4)", Status.OK, 1.3, created=1.0)
    assert mem.add([a, a]) == 1  # duplicates inside one call collapse
    assert mem.add([a]) == 1
    again = _lesson(
        tasks["softmax"], "vectorize_loads(width=4)", Status.OK, 1.3, created=2.0
    )  # after a resume
    assert again.id == a.id
    mem.add([again])
    assert mem.count() == 1
    other = _lesson(tasks["softmax"], "vectorize_loads(width=4)", Status.OK, 1.3, run_id="run-2")
    assert other.id != a.id  # another run's trial of the same edit is its own lesson
    mem.add([other])
    assert mem.count() == 2


def test_clear(mem, tasks, tmp_path):
    fresh = Memory(load(home=tmp_path / "never"), embedder=mem.embedder)
    assert fresh.clear() == 0 and fresh.count() == 0 and fresh.list() == []
    assert not (tmp_path / "never").exists()  # reading or clearing an empty memory creates nothing
    mem.add([_lesson(tasks["softmax"], f"unroll({n})", Status.OK, 1.1) for n in (2, 4, 8)])
    assert mem.clear() == 3
    assert mem.count() == 0 and mem.list() == [] and mem.search("unroll") == []
    mem.add([_lesson(tasks["softmax"], "unroll(2)", Status.OK, 1.1)])  # still usable afterwards
    assert mem.count() == 1


def test_for_context_ranks_helpful_first(mem, tasks):
    t = tasks["softmax"]
    mem.add(
        [
            _lesson(t, "warp_shuffle_reduce", Status.MISMATCH, None),
            _lesson(t, "more_blocks", Status.OK, 0.7),
            _lesson(t, "single_pass_online_softmax", Status.OK, 1.8),
            _lesson(t, "vectorize_loads(width=4)", Status.OK, 1.3),
            _lesson(t, "unroll(4)", Status.OK, 1.01),
            _lesson(t, "cache_row_in_smem", Status.OK, 1.2),
        ]
    )
    ctx = mem.for_context(t, "memory-bound: DRAM at 58%", [DRAM], k=5)
    assert len(ctx) == 5
    gains = [c.gain for c in ctx]
    n_help = sum(1 for c in ctx if c.gain is not None and c.gain > 1.03)
    assert n_help == 3 and all(g is not None and g > 1.03 for g in gains[:3])  # every helpful one, first
    assert {c.edit for c in ctx[3:]} <= {"warp_shuffle_reduce", "more_blocks", "unroll(4)"}  # then warnings
    assert all(c.similarity is not None for c in ctx)
    small = mem.for_context(t, "memory-bound", [DRAM], k=2)  # a place is kept for a warning
    assert small[0].gain is not None and small[0].gain > 1.03 and not (small[1].gain or 0) > 1.03
    assert mem.for_context(t, "memory-bound", [], k=0) == ()


def test_persists_across_memories(tmp_path, embedder, tasks):
    cfg = load(home=tmp_path / "home")
    Memory(cfg, embedder=embedder).add([_lesson(tasks["softmax"], "unroll(4)", Status.OK, 1.2)])
    again = Memory(cfg, embedder=embedder)
    assert again.count() == 1 and again.list()[0].edit == "unroll(4)"
    assert again.search("unroll the softmax loop")[0].edit == "unroll(4)"


def test_lazy_and_collection_name(tmp_path, tasks):
    m = Memory(load(home=tmp_path / "home"), collection="bad name!")
    assert m._embedder is None and m._coll is None  # nothing loaded or opened by the constructor
    with pytest.raises(StoreError, match="invalid collection name"):
        m.add([_lesson(tasks["softmax"], "unroll(4)", Status.OK, 1.2)])


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and text
    return text


def test_chroma_path_is_a_file(tmp_path, embedder, tasks):
    blocker = tmp_path / "chroma"
    blocker.write_text("not a folder")
    m = Memory(load(home=tmp_path / "home", chroma_path=blocker), embedder=embedder)
    for call in (m.list, m.count, lambda: m.add([_lesson(tasks["softmax"], "u", Status.OK, 1.2)])):
        with pytest.raises(StoreError) as e:
            call()
        assert "is a file, not a folder" in _one_line(e)


def test_corrupt_database(tmp_path, embedder):
    folder = tmp_path / "chroma"
    folder.mkdir()
    (folder / "chroma.sqlite3").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError) as e:
        Memory(load(home=tmp_path / "home", chroma_path=folder), embedder=embedder).search("softmax")
    assert "corrupt" in _one_line(e) or "unusable" in _one_line(e)


# --- the CLI ----------------------------------------------------------------------------------------


def _cli(*args: str, home: Path):
    return CliRunner().invoke(app, ["memory", *args, "--home", str(home)])


def test_cli_empty_memory(tmp_path, embedder):
    home = tmp_path / "home"
    for args in (("list",), ("search", "softmax"), ("clear",)):
        r = _cli(*args, home=home)
        assert r.exit_code == 0, (args, r.output)
        assert "empty" in r.stdout
    r = _cli("list", "--json", home=home)
    assert r.exit_code == 0 and json.loads(r.stdout) == []


def test_listing_and_counting_load_no_model_weights(tmp_path, embedder, tasks):
    home = tmp_path / "home"
    Memory(load(home=home), embedder=embedder).add([_lesson(tasks["softmax"], "unroll(4)", Status.OK, 1.2)])
    fresh = Embedder()  # what `kernelpro memory list` builds: name and dimension from the model's config
    reader = Memory(load(home=home), embedder=fresh)
    assert [s.edit for s in reader.list()] == ["unroll(4)"] and reader.count() == 1
    assert not fresh.loaded and fresh.dimension == embedder.dimension == 384
    assert reader.search("softmax unrolled", k=1)[0].edit == "unroll(4)"  # a search loads them
    assert fresh.loaded


def test_cli_list_search_clear(tmp_path, embedder, tasks):
    home = tmp_path / "home"
    Memory(load(home=home), embedder=embedder).add(
        [
            _lesson(tasks["softmax"], "single_pass_online_softmax", Status.OK, 1.8, created=time.time() - 60),
            _lesson(
                tasks["matmul_bias_gelu"],
                "wgmma_tma_pipeline",
                Status.COMPILE_ERROR,
                None,
                finding=TENSOR_CORES,
            ),
        ]
    )
    r = _cli("list", "--json", home=home)
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [x["edit"] for x in rows] == ["wgmma_tma_pipeline", "single_pass_online_softmax"]
    assert rows[0]["status"] == "compile_error" and rows[0]["gain"] is None and rows[1]["gain"] == 1.8
    assert len(json.loads(_cli("list", "--limit", "1", "--json", home=home).stdout)) == 1

    r = _cli("list", home=home)
    assert r.exit_code == 0 and "2 lessons" in r.stdout and "softmax" in r.stdout

    r = _cli("search", "layernorm row reduction, memory-bound", "-k", "1", "--json", home=home)
    assert r.exit_code == 0, r.output
    (hit,) = json.loads(r.stdout)
    assert hit["edit"] == "single_pass_online_softmax" and 0 < hit["similarity"] <= 1
    r = _cli("search", "layernorm", home=home)
    assert r.exit_code == 0 and "single_pass" in r.stdout

    r = _cli("clear", home=home)  # CliRunner's stdin is not a terminal: nobody to confirm
    assert r.exit_code == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "--yes" in lines[0], r.stderr
    assert Memory(load(home=home), embedder=embedder).count() == 2  # nothing deleted

    r = _cli("clear", "--yes", home=home)
    assert r.exit_code == 0 and "deleted 2 lessons" in r.stdout
    assert json.loads(_cli("list", "--json", home=home).stdout) == []


def test_cli_bad_input_is_one_line(tmp_path, embedder):
    home = tmp_path / "home"
    for args, needle in (
        (("search", "  "), "empty"),
        (("search", "x", "-k", "0"), "-k"),
        (("list", "-n", "0"), "--limit"),
    ):
        r = _cli(*args, home=home)
        assert r.exit_code == 2, (args, r.output)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], r.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = CliRunner().invoke(app, ["memory", "list"], env={"KERNELPRO_CHROMA_PATH": str(blocker)})
    assert r.exit_code == 2 and "is a file" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_cli_in_another_process(tmp_path, embedder, tasks):
    """The memory is on disk, not in this process; and a real `kernelpro memory clear` without --yes and
    without a terminal refuses in exactly one stderr line (no model-loading bar before it)."""
    home = tmp_path / "home"
    Memory(load(home=home), embedder=embedder).add([_lesson(tasks["softmax"], "unroll(4)", Status.OK, 1.2)])
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "memory", "clear", "--home", str(home)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == ["error: refusing to delete 1 lesson without confirmation; pass --yes"], r.stderr
    assert Memory(load(home=home), embedder=embedder).list()[0].edit == "unroll(4)"
