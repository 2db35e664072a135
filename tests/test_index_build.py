"""index/build.py end to end: real Chroma, real tree-sitter, the real packaged embedder, a small folder corpus."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import cutlass_library
import pytest
from typer.testing import CliRunner

import index.build as build_mod
from corpora import load_corpus
from index.build import build_index, collection_name, drop_index, embed_text, index_status
from index.chunk import chunk_file
from index.sidecar import load_sidecars, sidecar_dir, tokenize
from index.store import META_PATH, Embedder, StoreError, open_store
from pipeline.cli import app
from pipeline.config import Config, load

CUTE = Path(cutlass_library.__file__).parent / "source" / "include" / "cute"  # from the pinned wheel

KP_CUH = """\
#pragma once
#include <cuda_runtime.h>
namespace kp {

// Loads one tile of A into shared memory.
template <class T, int N>
struct TileLoader {
  __device__ void load(T const* src, T* smem) {
    for (int i = threadIdx.x; i < N; i += blockDim.x) smem[i] = src[i];
  }
};

template <class T>
__device__ T warp_reduce_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

}  // namespace kp
"""

EPILOGUE_HPP = """\
#pragma once
namespace kp::epilogue {

struct LinearCombinationRelu {
  float alpha, beta;
  __device__ float operator()(float acc, float c) const {
    float v = alpha * acc + beta * c;
    return v > 0.f ? v : 0.f;
  }
};

}  // namespace kp::epilogue
"""

MAIN_CU = """\
#include "kp.cuh"
extern "C" __global__ void scale_kernel(float* x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
}
"""


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    """Loaded once for the module; build.py keeps its own per-process copy too."""
    return Embedder()


@pytest.fixture
def src(tmp_path: Path) -> Path:
    d = tmp_path / "kernels"
    (d / "cute").mkdir(parents=True)
    (d / "kp.cuh").write_text(KP_CUH)
    (d / "epilogue.hpp").write_text(EPILOGUE_HPP)
    (d / "main.cu").write_text(MAIN_CU)
    for name in ("swizzle.hpp", "util/type_traits.hpp"):
        shutil.copy(CUTE / name, d / "cute" / Path(name).name)
    return d


@pytest.fixture
def kcfg(tmp_path: Path) -> Config:
    return load(home=tmp_path / "home", chroma_path=tmp_path / "home" / "chroma")


def _coll(cfg: Config, embedder: Embedder):
    name = collection_name(load_corpus("local"))
    return open_store(cfg).collection(name, model=embedder.name, dimension=embedder.dimension, create=False)


def _ids(coll, rel: str) -> set[str]:
    return set(coll.ids_where({META_PATH: rel}))


def _expected(src: Path, rel: str) -> set[str]:
    text = (src / rel).read_bytes().decode("utf-8", "replace")
    return {c.id for c in chunk_file(rel, text, "local", "local", "example")}


def _assert_complete(src: Path, coll) -> None:
    """The collection holds exactly the chunks of the files on disk, every file with its current hash."""
    rels = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    for rel in rels:
        assert _ids(coll, rel) == _expected(src, rel), rel
    assert None not in coll.file_hashes().values()
    assert coll.count() == sum(len(_expected(src, r)) for r in rels)


def test_tokenize_splits_identifiers() -> None:
    toks = tokenize("cute::SM90_TMA_LOAD make_tensor(GmmaDescriptor d)")
    for t in ("cute::sm90_tma_load", "sm90_tma_load", "sm90", "90", "tma", "load", "make_tensor", "make"):
        assert t in toks
    assert "gmmadescriptor" in toks and "gmma" in toks and "descriptor" in toks
    assert "d" not in toks  # single characters are noise


def test_embed_text_is_short() -> None:
    text = (
        "// local local kp.cuh :: kp::TileLoader\n#include <x.h>\n// doc\ntemplate <class T>\n" + "x;\n" * 200
    )
    short = embed_text(text, {"path": "kp.cuh", "symbol": "TileLoader", "namespace": "kp::"})
    assert "Tile Loader" in short and "template <class T>" in short and "kp" in short
    assert len(short) <= build_mod.EMBED_CHARS


def test_chunks_with_the_same_short_text_are_embedded_once_and_share_its_vector(
    tmp_path: Path, kcfg: Config, embedder: Embedder
) -> None:
    d = tmp_path / "kernels"
    d.mkdir()
    branch = "__device__ float kp_scale(float v, float s) {{\n    return v * s{};\n}}\n"
    (d / "scale.cuh").write_text(
        "#pragma once\n#if defined(KP_FAST)\n"
        + branch.format("")
        + "#else\n"
        + branch.format(" + 0.0f")
        + "#endif\n"
    )
    r = build_index("local", kcfg, folder=d)
    chunks = chunk_file("scale.cuh", (d / "scale.cuh").read_text(), "local", "local", "example")
    texts = [embed_text(c.text, c.metadata()) for c in chunks]
    assert r.chunks_added == len(chunks) and r.chunks_embedded == len(set(texts)) < len(chunks), texts
    raw = _coll(kcfg, embedder).chroma.get(ids=[c.id for c in chunks], include=["embeddings"])
    vec = {i: tuple(v) for i, v in zip(raw["ids"], raw["embeddings"], strict=True)}
    for a in chunks:
        for b in chunks:
            same = embed_text(a.text, a.metadata()) == embed_text(b.text, b.metadata())
            assert (vec[a.id] == vec[b.id]) == same


def test_build_incremental_edit_delete(src: Path, kcfg: Config, embedder: Embedder) -> None:
    stages: list[str] = []
    r1 = build_index("local", kcfg, progress=lambda s, d, t: stages.append(s), folder=src)
    assert r1.collection == "kp-local-local"
    assert r1.files_total == 5 and r1.files_changed == 5 and r1.chunks_added == r1.chunks_total > 10
    assert r1.index_bytes > 0 and "ingest files" in stages
    coll = _coll(kcfg, embedder)
    _assert_complete(src, coll)

    # Nothing changed: nothing written, sidecars untouched, fast.
    manifest = load_sidecars(kcfg, r1.collection).manifest
    t0 = time.monotonic()
    r2 = build_index("local", kcfg, folder=src)
    assert time.monotonic() - t0 < 5
    assert (r2.files_changed, r2.chunks_added, r2.chunks_deleted) == (0, 0, 0)
    assert r2.files_unchanged == 5 and r2.chunks_total == r1.chunks_total
    assert load_sidecars(kcfg, r1.collection).manifest == manifest

    # Edit one file: a renamed symbol plus shifted lines give new ids; the other files are untouched.
    before = {rel: _ids(coll, rel) for rel in ("kp.cuh", "epilogue.hpp", "main.cu", "cute/swizzle.hpp")}
    edited = "// a new comment\n\n" + KP_CUH.replace("warp_reduce_sum", "warp_shuffle_allreduce")
    (src / "kp.cuh").write_text(edited)
    r3 = build_index("local", kcfg, folder=src)
    assert r3.files_changed == 1 and r3.files_unchanged == 4
    new = _ids(coll, "kp.cuh")
    assert new == _expected(src, "kp.cuh")
    assert not (before["kp.cuh"] & new)  # every old id of the file is gone
    assert not coll.get(sorted(before["kp.cuh"]))
    for rel in ("epilogue.hpp", "main.cu", "cute/swizzle.hpp"):
        assert _ids(coll, rel) == before[rel]
    assert r3.chunks_deleted == len(before["kp.cuh"])

    # Sidecars follow: the edited symbol is found by name and by BM25.
    side = load_sidecars(kcfg, r3.collection)
    assert side.manifest["chunks"] == coll.count() == len(side.ids)
    hit = side.find("warp_shuffle_allreduce")
    assert hit and hit == side.find("kp::warp_shuffle_allreduce")
    assert not side.find("warp_reduce_sum")
    docs, _ = side.bm25.retrieve([tokenize("warp shuffle allreduce")], k=1, show_progress=False)
    assert side.ids[int(docs[0][0])] in hit

    # Delete a file: its chunks go, the others stay.
    (src / "epilogue.hpp").unlink()
    r4 = build_index("local", kcfg, folder=src)
    assert r4.files_removed == 1 and r4.chunks_deleted == len(before["epilogue.hpp"])
    assert not _ids(coll, "epilogue.hpp")
    assert not load_sidecars(kcfg, r4.collection).find("LinearCombinationRelu")
    _assert_complete(src, coll)


def test_interrupted_build_leaves_index_usable(
    src: Path, kcfg: Config, embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    build_index("local", kcfg, folder=src)
    coll = _coll(kcfg, embedder)
    count = coll.count()
    old_manifest = load_sidecars(kcfg, "kp-local-local").manifest

    # Change every file, then die after the first small batch has been written.
    for p in src.rglob("*"):
        if p.is_file():
            p.write_text("// edited\n" + p.read_text())
    monkeypatch.setattr(build_mod, "BATCH_CHUNKS", 5)

    def boom(stage: str, done: int, total: int) -> None:
        if stage == "ingest files" and done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_index("local", kcfg, progress=boom, folder=src)

    # The previous index is still whole and queryable; the old sidecars are still there.
    assert coll.count() >= count
    hits = coll.query(embedder.embed(["shared memory tile loader"])[0], 3)
    assert len(hits) == 3 and all(h.document for h in hits)
    side = load_sidecars(kcfg, "kp-local-local")
    assert side.manifest == old_manifest and side.bm25 is not None
    assert sum(v is None for v in coll.file_hashes().values()) <= 1  # at most the file in flight mixed

    # The next build completes it.
    r = build_index("local", kcfg, folder=src)
    assert r.files_changed >= 1
    _assert_complete(src, coll)
    assert load_sidecars(kcfg, "kp-local-local").manifest["chunks"] == coll.count()
    assert not (kcfg.home / "index" / "kp-local-local.pending.json").exists()


def test_build_killed_midway_leaves_index_usable(
    src: Path, kcfg: Config, embedder: Embedder, tmp_path: Path
) -> None:
    """kill -9 of a real build process after its first batch: the old index stays whole, the next build ends it."""
    build_index("local", kcfg, folder=src)
    coll = _coll(kcfg, embedder)
    count = coll.count()
    old_manifest = load_sidecars(kcfg, "kp-local-local").manifest
    for p in src.rglob("*"):
        if p.is_file():
            p.write_text("// edited again\n" + p.read_text())
    marker = tmp_path / "first-batch-written"
    script = f"""
import time
from pathlib import Path
import index.build as b
from pipeline.config import load
b.BATCH_CHUNKS = 5
cfg = load(home=Path({str(kcfg.home)!r}), chroma_path=Path({str(kcfg.chroma_path)!r}))
def progress(stage, done, total):
    if stage == "ingest files" and done > 0:
        Path({str(marker)!r}).write_text("x")
        time.sleep(120)  # held here until killed
b.build_index("local", cfg, progress=progress, folder=Path({str(src)!r}))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parent.parent)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert proc.poll() is None, "the build process ended before its first batch"
            assert time.monotonic() < deadline, "no batch written within 180 s"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    coll = _coll(kcfg, embedder)  # reopened, as a new process would
    assert coll.count() >= count
    hits = coll.query(embedder.embed(["shared memory tile loader"])[0], 3)
    assert len(hits) == 3 and all(h.document for h in hits)
    assert load_sidecars(kcfg, "kp-local-local").manifest == old_manifest
    r = build_index("local", kcfg, folder=src)
    assert r.files_changed >= 1
    _assert_complete(src, coll)
    assert not (kcfg.home / "index" / "kp-local-local.pending.json").exists()


def test_corrupt_chroma_folder_is_left_alone(src: Path, tmp_path: Path) -> None:
    chroma = tmp_path / "bad-chroma"
    chroma.mkdir()
    (chroma / "chroma.sqlite3").write_bytes(b"this is not a database" * 100)
    before = {p: p.read_bytes() for p in chroma.rglob("*") if p.is_file()}
    cfg = load(home=tmp_path / "h2", chroma_path=chroma)
    with pytest.raises(StoreError, match=r"corrupt|unusable"):
        build_index("local", cfg, folder=src)
    assert {p: p.read_bytes() for p in chroma.rglob("*") if p.is_file()} == before
    assert not sidecar_dir(cfg, "kp-local-local").exists()


def test_drop_and_status(src: Path, kcfg: Config) -> None:
    build_index("local", kcfg, folder=src)
    rows = index_status(kcfg)
    assert [r["collection"] for r in rows] == ["kp-local-local"]
    assert rows[0]["chunks"] > 0 and rows[0]["files"] == 5 and rows[0]["bytes"] > 0
    assert drop_index("local", kcfg) == "kp-local-local"
    assert index_status(kcfg) == [] and not sidecar_dir(kcfg, "kp-local-local").exists()
    with pytest.raises(StoreError, match="nothing to drop"):
        drop_index("local", kcfg)


def test_cli(src: Path, kcfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELPRO_CHROMA_PATH", str(kcfg.chroma_path))
    runner = CliRunner()
    home = ["--home", str(kcfg.home)]

    res = runner.invoke(app, ["index", "build", "--corpus", "no-such-corpus", *home])
    assert res.exit_code == 2
    assert "unknown corpus 'no-such-corpus'" in res.output and len(res.output.strip().splitlines()) == 1

    res = runner.invoke(app, ["index", "build", "--corpus", "local", "--folder", str(src), *home])
    assert res.exit_code == 0, res.output
    assert "kp-local-local" in res.output and "MB" in res.output

    res = runner.invoke(app, ["index", "status", "--json", *home])
    assert res.exit_code == 0 and "kp-local-local" in res.output

    res = runner.invoke(app, ["index", "query", "  ", "--corpus", "local", *home])
    assert res.exit_code == 2 and "empty" in res.output

    res = runner.invoke(app, ["index", "drop", "--corpus", "no-such-corpus", *home])
    assert res.exit_code == 2 and "unknown corpus" in res.output
