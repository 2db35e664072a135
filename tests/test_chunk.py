"""Real tree-sitter chunking of real CUTLASS 4.2.0.0 files from the installed nvidia-cutlass wheel."""

from __future__ import annotations

import importlib.metadata as md
import itertools
import time
from pathlib import Path

import pytest

from index.chunk import MAX_LINES, Chunk, arch_tags, chunk_file

DIST = md.distribution("nvidia-cutlass")
PKG = Path(str(DIST.locate_file("cutlass_library")))
SRC = PKG / "source"


def chunks_of(rel: str, kind: str = "header") -> list[Chunk]:
    return chunk_file(rel, (SRC / rel).read_text(), "cutlass", DIST.version, kind)


def by_symbol(chunks: list[Chunk], symbol: str) -> list[Chunk]:
    return [c for c in chunks if c.symbol == symbol]


def test_gmma_traits_specialisations() -> None:
    rel = "include/cute/atom/mma_traits_sm90_gmma.hpp"
    chunks = chunks_of(rel)
    lines = (SRC / rel).read_text().splitlines()
    sym = "MMA_Traits<SM90_64x128x16_F32BF16BF16_SS<tnspA, tnspB, scaleA, scaleB>>"
    [c] = by_symbol(chunks, sym)
    assert c.namespace == "cute::"
    assert c.kind == "header" and c.arch == ("sm90",) and c.path == rel
    # The chunk opens on the template header and closes on the struct's `};`.
    assert lines[c.start_line - 1].startswith("template <GMMA::Major tnspA")
    assert lines[c.start_line].startswith(f"struct {sym}")
    assert lines[c.end_line - 1] == "};"
    assert "using Shape_MNK = Shape<_64,_128,_16>;" in c.text
    # The file's includes are recorded and prefixed to the text.
    assert "cute/arch/mma_sm90_gmma.hpp" in c.includes
    assert "#include <cute/arch/mma_sm90_gmma.hpp>" in c.text
    # The RS variant is a separate chunk; nested namespaces are joined.
    assert by_symbol(chunks, sym.replace("_SS<", "_RS<"))
    [desc] = by_symbol(chunks, "make_gmma_desc")  # its return type sits after a CUTE_HOST_DEVICE macro
    assert desc.namespace == "cute::SM90::GMMA::"
    # A lone alias between two specialisations is named by the alias.
    assert by_symbol(chunks, "SM90_64x128x16_F32BF16BF16_RS")


def test_make_tma_copy_overloads() -> None:
    rel = "include/cute/atom/copy_traits_sm90_tma.hpp"
    chunks = chunks_of(rel)
    lines = (SRC / rel).read_text().splitlines()
    copies = by_symbol(chunks, "make_tma_copy")
    assert len(copies) == 3
    for c in copies:
        assert c.namespace == "cute::" and c.arch == ("sm90",)
        assert "make_tma_copy(" in "\n".join(lines[c.start_line - 1 : c.end_line])
    first = copies[0]
    assert lines[first.start_line - 1].startswith("template <class TmaInternalType = void,")
    [helper] = by_symbol(chunks, "make_tma_copy_desc")[:1]
    assert helper.namespace == "cute::detail::"
    assert by_symbol(chunks, "Copy_Traits<SM90_TMA_LOAD, NumBitsPerTMA, AuxParams_>")
    # Chunks do not overlap and come in line order.
    for a, b in itertools.pairwise(chunks):
        assert a.end_line < b.start_line


def test_hopper_example_is_an_example_with_its_parts() -> None:
    rel = "examples/48_hopper_warp_specialized_gemm/48_hopper_warp_specialized_gemm.cu"
    chunks = chunks_of(rel, "example")
    symbols = {c.symbol for c in chunks}
    assert {"Options", "run", "main", "args_from_options"} <= symbols
    assert all(c.kind == "example" and "sm90" in c.arch for c in chunks)
    # The GEMM configuration (file-scope `using`s) is kept in a file-level chunk.
    config = [c for c in chunks if c.symbol == "48_hopper_warp_specialized_gemm"]
    assert any("CollectiveMainloop" in c.text for c in config)


def test_cuda_kernel_launch_syntax() -> None:
    rel = "examples/cute/tutorial/sgemm_1.cu"
    chunks = chunks_of(rel, "example")
    lines = (SRC / rel).read_text().splitlines()
    kernel = by_symbol(chunks, "gemm_device")
    assert len(kernel) == 2  # a long __global__ kernel split into windows that keep its name
    assert lines[kernel[0].start_line - 1].startswith(
        "template <class ProblemShape"
    )  # before __launch_bounds__
    assert kernel[0].end_line + 1 == kernel[1].start_line
    nt = by_symbol(chunks, "gemm_nt")[0]
    assert "gemm_device<<<dimGrid, dimBlock, 0, stream>>>" in nt.text
    assert by_symbol(chunks, "main")


def test_python_file() -> None:
    text = (PKG / "sm90_utils.py").read_text()
    chunks = chunk_file("cutlass_library/sm90_utils.py", text, "cutlass", "4.2.0.0", "tool")
    [fn] = by_symbol(chunks, "generate_tf32_math_instruction_shapes_sm90")
    assert fn.namespace == "" and fn.arch == ("sm90",) and fn.kind == "tool"
    assert text.splitlines()[fn.start_line - 1].startswith("def generate_tf32_math_instruction_shapes_sm90(")
    assert "itertools" in fn.includes


def test_ids_are_stable_and_unique() -> None:
    rel = "include/cute/atom/copy_traits_sm90_tma.hpp"
    first, second = chunks_of(rel), chunks_of(rel)
    assert [c.id for c in first] == [c.id for c in second]
    assert len({c.id for c in first}) == len(first)
    # Another corpus name gives other ids; the file hash is the content's.
    other = chunk_file(rel, (SRC / rel).read_text(), "mine", "1", "header")
    assert not {c.id for c in other} & {c.id for c in first}
    assert first[0].file_hash == other[0].file_hash


def test_large_definitions_are_windowed() -> None:
    body = "\n".join(f"  x += {i};" for i in range(400))
    text = f"namespace cutlass::gemm::collective {{\n__device__ void big(int x) {{\n{body}\n}}\n}}\n"
    chunks = chunk_file("big_sm80.cuh", text, "t", "1", "header")
    assert len(chunks) == 3
    assert all(c.symbol == "big" and c.namespace == "cutlass::gemm::collective::" for c in chunks)
    assert all(c.end_line - c.start_line + 1 <= MAX_LINES for c in chunks)
    assert (chunks[0].start_line, chunks[-1].end_line) == (2, 403)
    assert chunks[0].arch == ("sm80",)


@pytest.mark.parametrize(
    "text",
    [
        "#include <cuda.h>\ntemplate <class T struct Broken { int x\n__global__ void k(float* p) { p[0] = 1; }}}}\n"
        "int main( { k<<<1, 32>>>(nullptr);\n",
        "))))(((( <<<>>> template template struct {{{{",
        "\x00\xff garbage \ufffd\n" * 3,
    ],
)
def test_bad_code_never_raises(text: str) -> None:
    chunks = chunk_file("broken.cu", text, "t", "1", "example")
    assert chunks  # something is always kept
    assert all(1 <= c.start_line <= c.end_line <= len(text.splitlines()) for c in chunks)


def test_tiny_file_is_one_chunk_and_empty_file_none() -> None:
    [c] = chunk_file("dir/tiny.h", "#pragma once\n#include <x.h>\n", "t", "1", "header")
    assert (c.symbol, c.start_line, c.end_line, c.includes) == ("tiny", 1, 2, ("x.h",))
    assert chunk_file("empty.h", "", "t", "1", "header") == []


def test_arch_tags() -> None:
    assert arch_tags("include/cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized.hpp") == ("sm90",)
    assert arch_tags("examples/70_blackwell_gemm/x.cu") == ("sm100",)
    assert arch_tags("examples/18_ampere_fp64_tensorop_affine2_gemm") == ("sm80",)
    assert arch_tags("KernelTmaWarpSpecializedSm90", "SM80_CP_ASYNC", "sm_90a") == ("sm80", "sm90", "sm90a")
    assert arch_tags("SM120_x", "sm900", "cutlass_3_sm75") == ("sm75", "sm120")
    assert arch_tags("include/cute/layout.hpp") == ()


def test_metadata_is_flat() -> None:
    c = chunks_of("include/cute/atom/copy_traits_sm90_tma.hpp")[0]
    meta = c.metadata()
    assert all(isinstance(v, str | int) for v in meta.values())
    assert meta["arch"] == "sm90" and meta["corpus"] == "cutlass" and meta["version"] == "4.2.0.0"


@pytest.mark.slow
def test_whole_cutlass_tree_is_fast() -> None:
    from corpora import iter_files, load_corpus

    corpus = load_corpus("cutlass")
    t0 = time.perf_counter()
    n_files = n_chunks = 0
    for f in iter_files(corpus, SRC):
        rel = f.relative_to(SRC).as_posix()
        n_chunks += len(
            chunk_file(rel, f.read_text(errors="replace"), "cutlass", "4.2.0.0", corpus.kind_of(rel))
        )
        n_files += 1
    elapsed = time.perf_counter() - t0
    assert n_files > 1000 and n_chunks > 10 * n_files
    assert elapsed < 60, f"chunking {n_files} files took {elapsed:.1f}s"
