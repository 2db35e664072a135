"""The source hunter on real CUTLASS 4.2.0.0 sources: a small index of a few headers (fast), and the whole
corpus against the evaluation set (slow: builds the full index, minutes on two cores)."""

from __future__ import annotations

import importlib.metadata as md
import shutil
from pathlib import Path

import pytest

from corpora import load_corpus
from index.build import build_index
from index.hunt import Block, Hunter, evaluate, hunt, include_line, load_cases
from index.store import StoreError
from pipeline.config import Config, load

SRC = Path(str(md.distribution("nvidia-cutlass").locate_file("cutlass_library"))) / "source"
EVAL = Path(__file__).parent / "fixtures" / "hunt_eval.toml"
MINI_FILES = (
    "include/cute/swizzle.hpp",
    "include/cute/arch/util.hpp",
    "include/cute/arch/copy.hpp",
    "include/cute/arch/copy_sm80.hpp",
    "include/cute/arch/copy_sm90.hpp",
    "include/cute/arch/copy_sm90_tma.hpp",
    "examples/cute/tutorial/sgemm_sm80.cu",
)
MINI_TOML = """
name = "mini"
[source]
kind = "folder"
path = "{root}"
version = "t1"
[files]
include = ["**/*.hpp", "**/*.cu"]
[kinds]
default = "header"
"examples/" = "example"
"""


@pytest.fixture(scope="module")
def mini(tmp_path_factory: pytest.TempPathFactory) -> tuple[Config, Hunter]:
    """A few real headers (an sm80 file, sm90 TMA files and what they include) as a folder corpus."""
    base = tmp_path_factory.mktemp("hunt")
    root = base / "src"
    for rel in MINI_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SRC / rel, root / rel)
    toml = base / "mini.toml"
    toml.write_text(MINI_TOML.format(root=root.as_posix()))
    cfg = load(home=base / "home", chroma_path=base / "home" / "chroma")
    corpus = load_corpus(toml)
    build_index(corpus, cfg)
    return cfg, Hunter(cfg, corpus)


def test_exact_symbol_first(mini: tuple[Config, Hunter]) -> None:
    _, h = mini
    for sym, path in (
        ("SM90_TMA_LOAD_2D", "include/cute/arch/copy_sm90_tma.hpp"),
        ("SM80_CP_ASYNC_CACHEALWAYS", "include/cute/arch/copy_sm80.hpp"),
        ("cast_smem_ptr_to_uint", "include/cute/arch/util.hpp"),
    ):
        [top, *_] = h.hunt(sym, k=5)
        assert (top.path, top.symbol) == (path, sym), (sym, top)
        assert "exact" in top.sources and top.snippet and sym in top.snippet


def test_nl_query_finds_file(mini: tuple[Config, Hunter]) -> None:
    _, h = mini
    paths = [b.path for b in h.hunt("xor swizzle functor for shared memory bank conflicts", k=5)]
    assert "include/cute/swizzle.hpp" in paths[:3], paths
    paths = [b.path for b in h.hunt("bulk tensor copy from global to shared memory with TMA", k=5)]
    assert "include/cute/arch/copy_sm90_tma.hpp" in paths, paths


def test_arch_filter(mini: tuple[Config, Hunter]) -> None:
    _, h = mini
    unfiltered = h.hunt("SM80_CP_ASYNC_CACHEALWAYS", k=10)
    assert any("sm80" in b.arch for b in unfiltered)
    for arch in ("sm90", "sm_90a", "90"):
        got = h.hunt("SM80_CP_ASYNC_CACHEALWAYS", k=10, arch=arch)
        assert got, arch
        # Only chunks tagged sm90, or untagged ones, pass.
        assert all(not b.arch or "sm90" in b.arch for b in got), [(b.path, b.arch) for b in got]
    with pytest.raises(ValueError, match="unknown arch"):
        h.hunt("copy", arch="hopper!")


def test_kinds_filter(mini: tuple[Config, Hunter]) -> None:
    _, h = mini
    got = h.hunt("gemm with cp.async tiled copy", k=5, kinds=["example"])
    assert got and all(b.kind == "example" and b.include_line is None for b in got)


def test_include_line() -> None:
    assert include_line("include/cute/atom/mma_traits_sm90_gmma.hpp", "header") == (
        "#include <cute/atom/mma_traits_sm90_gmma.hpp>"
    )
    assert include_line("include/cutlass/arch/barrier.h", "header") == "#include <cutlass/arch/barrier.h>"
    assert include_line("tools/util/include/cutlass/util/packed_stride.hpp", "tool") == (
        "#include <cutlass/util/packed_stride.hpp>"
    )
    assert include_line("examples/48_hopper_warp_specialized_gemm/x.cu", "example") is None
    assert include_line("mykernels/common.cuh", "header") == '#include "mykernels/common.cuh"'


def test_block_include_line(mini: tuple[Config, Hunter]) -> None:
    _, h = mini
    [b, *_] = h.hunt("Swizzle", k=3)
    assert isinstance(b, Block) and b.path == "include/cute/swizzle.hpp"
    assert b.include_line == "#include <cute/swizzle.hpp>"
    assert b.corpus == "mini" and b.kind == "header" and b.score > 0


def test_follow_includes(mini: tuple[Config, Hunter]) -> None:
    _, h = mini
    [b, *_] = h.hunt("SM90_TMA_LOAD_2D", k=1)
    deps = h.follow_includes(b, budget_tokens=1500)
    # copy_sm90_tma.hpp -> cute/arch/copy.hpp -> cute/arch/util.hpp defines cast_smem_ptr_to_uint.
    assert any(
        d.symbol == "cast_smem_ptr_to_uint" and d.path == "include/cute/arch/util.hpp" for d in deps
    ), [(d.path, d.symbol) for d in deps]
    assert sum(-(-len(d.snippet) // 4) for d in deps) <= 1500
    assert all(d.sources == ("include",) and d.id != b.id for d in deps)
    assert h.follow_includes(b, budget_tokens=0) == []
    small = h.follow_includes(b, budget_tokens=60)
    assert sum(-(-len(d.snippet) // 4) for d in small) <= 60


def test_empty_query(mini: tuple[Config, Hunter]) -> None:
    cfg, h = mini
    for q in ("", "   \n"):
        with pytest.raises(ValueError, match="empty query"):
            h.hunt(q)
        with pytest.raises(ValueError, match="empty query"):
            hunt(q, cfg, corpus="cutlass")


def test_missing_index(tmp_path: Path) -> None:
    cfg = load(home=tmp_path / "home", chroma_path=tmp_path / "home" / "chroma")
    with pytest.raises(StoreError, match=r"no index for corpus cutlass: run `make index`"):
        Hunter(cfg, "cutlass")
    with pytest.raises(StoreError, match="no index for corpus cutlass"):
        hunt("make_tma_copy", cfg)


def test_eval_set_is_sound() -> None:
    cases = load_cases(EVAL)
    assert len(cases) >= 40
    styles = [c.style for c in cases]
    assert styles.count("nl") >= 20 and styles.count("symbol") >= 20
    for c in cases:
        for e in c.expected:
            p = SRC / e
            assert p.is_dir() if e.endswith("/") else p.is_file(), e


# --- several corpora at once (config `corpus = "cutlass+local"`) -----------------------------------------


def test_several_corpora_are_hunted_as_one_merged_by_score(small_corpora) -> None:
    from index.hunt import Hunters, open_corpora

    cfg, _, _ = small_corpora
    both, missing = open_corpora(cfg, ["cutlass", "local"])
    assert isinstance(both, Hunters) and missing == {} and both.corpus == "cutlass+local"
    cut, loc = both.member("cutlass"), both.member("local")
    # An identifier answers from the corpus that defines it, first, whichever corpus is named first.
    [top, *_] = both.hunt("block_reduce_sum", k=4)
    assert (top.corpus, top.path, top.symbol) == ("local", "kp/block_reduce.cuh", "block_reduce_sum")
    [top, *_] = both.hunt("SM90_TMA_LOAD_2D", k=4)
    assert (top.corpus, top.path) == ("cutlass", "include/cute/arch/copy_sm90_tma.hpp")
    for query in ("warp inclusive scan with shuffles", "swizzle", "shared memory copy"):
        got = both.hunt(query, k=6)
        # The k best of the two corpora's own answers, by their fused scores, best first.
        own = sorted([*cut.hunt(query, k=6), *loc.hunt(query, k=6)], key=lambda b: -b.score)[:6]
        assert [(b.corpus, b.path, b.symbol) for b in got] == [(b.corpus, b.path, b.symbol) for b in own]
        assert [b.score for b in got] == sorted((b.score for b in got), reverse=True)
    assert {b.corpus for b in both.hunt("warp shuffle sum copy swizzle", k=8)} == {"cutlass", "local"}
    # Dependencies are followed in the block's own corpus.
    [scan] = [b for b in both.hunt("warp_inclusive_scan", k=3) if b.symbol == "warp_inclusive_scan"]
    assert any(d.symbol == "warp_reduce_sum" and d.corpus == "local" for d in both.follow_includes(scan))


def test_a_corpus_without_an_index_is_left_out_and_said(small_corpora) -> None:
    from index.hunt import open_corpora

    cfg, _, _ = small_corpora
    hunter, missing = open_corpora(cfg, ["cutlass", "cccl"])
    assert hunter is not None and hunter.corpus == "cutlass"  # the one built, alone
    assert missing == {"cccl": "no index for corpus cccl: run `make index CORPUS=cccl` "
                               "(kernelpro index build --corpus cccl)"}  # fmt: skip
    assert open_corpora(cfg, ["cutlass_dsl"])[0] is None


def test_the_loop_opens_the_configured_corpora(small_corpora) -> None:
    from index.hunt import Hunter, Hunters
    from pipeline.loop import _open_hunter

    cfg, _, _ = small_corpora
    hunter, notes = _open_hunter(cfg)  # the default: cutlass
    assert isinstance(hunter, Hunter) and hunter.corpus == "cutlass" and notes == []
    hunter, notes = _open_hunter(cfg.replace(corpus="local+cutlass"))
    assert isinstance(hunter, Hunters) and [h.corpus for h in hunter.hunters] == ["local", "cutlass"]
    hunter, notes = _open_hunter(cfg.replace(corpus="cutlass+local+cccl"))
    assert hunter.corpus == "cutlass+local"
    assert notes == ["no building blocks from the source index of corpus cccl (no index for corpus cccl: run "
                     "`make index CORPUS=cccl` (kernelpro index build --corpus cccl))"]  # fmt: skip
    hunter, notes = _open_hunter(cfg.replace(corpus="none"))
    assert hunter is None and notes == ["corpus none: no building blocks from a source index"]
    hunter, notes = _open_hunter(cfg.replace(corpus="gone"))  # a resumed run's corpus this checkout lacks
    assert hunter is None and notes[0].startswith("no building blocks: corpus = 'gone' (unknown 'gone')")
    # The user's folder corpus is named with the folder its index needs.
    _, notes = _open_hunter(cfg.replace(home=cfg.home.parent / "empty", corpus="local"))
    assert "corpus local" in notes[0] and "kernelpro index build --corpus local --folder DIR" in notes[0]


def test_the_expert_and_the_tools_work_over_several_corpora(small_corpora) -> None:
    from index.hunt import open_corpora
    from pipeline.generate.expert import atoms
    from pipeline.generate.toolbox import LocalToolBox

    cfg, _, kernels = small_corpora
    both, _ = open_corpora(cfg, ["local", "cutlass"])
    # The GEMM's TMA atom: the index (the cutlass corpus among the two) answers, the headers confirm.
    found = atoms.find(atoms.TMA_LOAD_3D, both)
    assert found.via == "index" and found.header == "cute/arch/copy_sm90_tma.hpp"
    box = LocalToolBox(both)
    text = box.search_sources("block_reduce_sum", k=2)
    assert "### local:kp/block_reduce.cuh" in text
    # Each file is read from its own corpus's folder (the local one where its index was built from).
    assert "block_reduce_sum" in box.open_source("local:kp/block_reduce.cuh")
    assert "cutlass:include/cute/swizzle.hpp lines 1-" in box.open_source("include/cute/swizzle.hpp")
    assert "kp/block_reduce.cuh" in box.follow_includes("kp/block_scan.cuh")
    refused = box.open_source("cutlass:kp/block_reduce.cuh")  # not a file of that corpus
    assert refused.startswith("refused") and "corpora 'local', 'cutlass'" in refused
    assert (kernels / "kp" / "block_reduce.cuh").is_file()


def test_evaluate_over_several_corpora_names_the_corpus_when_asked(small_corpora) -> None:
    from index.hunt import open_corpora

    cfg, _, _ = small_corpora
    both, _ = open_corpora(cfg, ["cutlass", "local"])
    report = evaluate(both, [("block_reduce_sum", "kp/block_reduce.cuh"),
                             ("block_reduce_sum", "local:kp/block_reduce.cuh"),
                             ("block_reduce_sum", "cutlass:kp/block_reduce.cuh"),
                             ("SM90_TMA_LOAD_2D", "cutlass:include/cute/arch/copy_sm90_tma.hpp")])  # fmt: skip
    assert [r.rank for r in report.per_case] == [1, 1, None, 1]
    assert report.recall_at_5 == 0.75 and report.mrr == 0.75
