"""Corpus TOMLs, root resolution (installed wheel, pip fetch, folder) and file selection, for real."""

from __future__ import annotations

import importlib.metadata as md
import time
from pathlib import Path

import pytest

from corpora import Corpus, CorpusError, iter_files, list_corpora, load_corpus, resolve_root

DIST = md.distribution("nvidia-cutlass")
SRC = Path(str(DIST.locate_file("cutlass_library"))) / "source"


def test_every_toml_loads() -> None:
    names = list_corpora()
    assert {"cutlass", "cccl", "cutlass_dsl", "local"} <= set(names)
    for name in names:
        c = load_corpus(name)
        assert isinstance(c, Corpus) and c.name == name and c.include
        if c.source == "pypi":
            assert c.distribution and c.version[0].isdigit()
    cutlass = load_corpus("cutlass")
    assert (cutlass.distribution, cutlass.version, cutlass.root) == (
        "nvidia-cutlass",
        "4.2.0.0",
        "cutlass_library/source",
    )
    assert load_corpus("cccl").distribution == "nvidia-cuda-cccl"
    assert load_corpus("cutlass_dsl").distribution == "nvidia-cutlass-dsl"
    local = load_corpus("local")
    assert local.source == "folder" and "~" not in local.root  # expanded at load time


def test_unknown_corpus_lists_known_ones() -> None:
    with pytest.raises(CorpusError) as e:
        load_corpus("nope")
    msg = str(e.value)
    assert "nope" in msg
    for name in list_corpora():
        assert name in msg


def test_bad_toml_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[source]\nkind = "git"\n[files]\ninclude = ["*.cu"]\n')
    with pytest.raises(CorpusError, match="'pypi' or 'folder'"):
        load_corpus(bad)
    bad.write_text('[source]\nkind = "pypi"\ndistribution = "x"\n[files]\ninclude = ["*.cu"]\n')
    with pytest.raises(CorpusError, match="pinned `version`"):
        load_corpus(bad)
    bad.write_text("[source\n")
    with pytest.raises(CorpusError, match="invalid TOML"):
        load_corpus(bad)
    with pytest.raises(CorpusError, match="not found"):
        load_corpus(tmp_path / "missing.toml")


def test_cutlass_resolves_to_installed_wheel(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    corpus = load_corpus("cutlass")
    root = resolve_root(corpus, cache)
    assert root == SRC and (root / "include/cute/tensor.hpp").is_file()
    assert not cache.exists()  # nothing fetched, nothing written

    files = [f.relative_to(root).as_posix() for f in iter_files(corpus, root)]
    assert files == sorted(files)
    assert "include/cute/atom/mma_traits_sm90_gmma.hpp" in files
    assert "include/cute/atom/copy_traits_sm90_tma.hpp" in files
    assert "examples/48_hopper_warp_specialized_gemm/48_hopper_warp_specialized_gemm.cu" in files
    assert any(f.startswith("tools/util/include/") for f in files)
    # What the globs leave out: build files, notebooks, the profiler, the deprecated Python interface.
    assert (root / "tools/profiler").is_dir() and not any(f.startswith("tools/profiler/") for f in files)
    assert (root / "examples/python/deprecated").is_dir()
    assert not any(f.startswith("examples/python/deprecated/") for f in files)
    assert not any(f.endswith(("CMakeLists.txt", ".ipynb", ".md")) for f in files)
    # Kinds by path prefix.
    assert corpus.kind_of("include/cute/tensor.hpp") == "header"
    assert corpus.kind_of("examples/48_hopper_warp_specialized_gemm/x.cu") == "example"
    assert corpus.kind_of("tools/util/include/cutlass/util/device_memory.h") == "tool"
    # Deterministic.
    assert files == [f.relative_to(root).as_posix() for f in iter_files(corpus, root)]


def test_local_folder_corpus(tmp_path: Path) -> None:
    kernels = tmp_path / "kernels"
    (kernels / "gemm").mkdir(parents=True)
    (kernels / "gemm" / "wgmma_sm90.cu").write_text("__global__ void k() {}\n")
    (kernels / "gemm" / "notes.md").write_text("no\n")
    (kernels / "build").mkdir()
    (kernels / "build" / "gen.cu").write_text("__global__ void gen() {}\n")
    (kernels / "launch.py").write_text("def launch():\n    pass\n")

    corpus = load_corpus("local", folder=kernels)
    root = resolve_root(corpus, tmp_path / "cache")
    assert root == kernels
    assert [f.relative_to(root).as_posix() for f in iter_files(corpus, root)] == [
        "gemm/wgmma_sm90.cu",
        "launch.py",
    ]
    assert corpus.kind_of("launch.py") == "example"

    # A copied TOML with its own path works the same.
    toml = tmp_path / "mine.toml"
    toml.write_text(
        (Path(load_corpus("local").toml_path or "")).read_text().replace('"~/kernels"', f'"{kernels}"')
    )
    assert load_corpus(toml).root == str(kernels)

    with pytest.raises(CorpusError, match="does not exist"):
        resolve_root(load_corpus("local", folder=tmp_path / "absent"), tmp_path / "cache")


def test_missing_version_is_a_clear_error(tmp_path: Path) -> None:
    # Asks pip (about 1.5 s here), which answers at once that no such version exists.
    toml = tmp_path / "old.toml"
    toml.write_text(
        'name = "old"\n[source]\nkind = "pypi"\ndistribution = "nvidia-cutlass"\nversion = "0.0.1"\n'
        'root = "cutlass_library/source"\n[files]\ninclude = ["include/**/*.hpp"]\n'
    )
    corpus = load_corpus(toml)
    cache = tmp_path / "cache"
    with pytest.raises(CorpusError, match=r"nvidia-cutlass==0\.0\.1 \(version 0\.0\.1\)"):
        resolve_root(corpus, cache)
    assert not (cache / "corpora" / "old-0.0.1").exists()
    assert md.version("nvidia-cutlass") == "4.2.0.0"  # the environment is untouched


@pytest.mark.slow
def test_cccl_is_fetched_into_the_cache(tmp_path: Path) -> None:
    corpus = load_corpus("cccl")
    try:
        installed = md.version("nvidia-cuda-cccl")
    except md.PackageNotFoundError:
        installed = None
    if installed == corpus.version:
        pytest.skip("nvidia-cuda-cccl is installed at the pinned version; nothing to fetch")
    root = resolve_root(corpus, tmp_path)
    assert root == tmp_path / "corpora" / f"cccl-{corpus.version}" / corpus.root
    files = [f.relative_to(root).as_posix() for f in iter_files(corpus, root)]
    assert "cub/block/block_reduce.cuh" in files
    assert not any(f.startswith("cuda/std/") for f in files)
    t0 = time.perf_counter()
    assert resolve_root(corpus, tmp_path) == root  # the second time comes from the cache
    assert time.perf_counter() - t0 < 1
