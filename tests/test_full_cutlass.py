"""The whole CUTLASS corpus indexed once (the session fixture `full_cutlass`, minutes on two cores) and what
is checked on it: the build itself, the hunter's retrieval on the evaluation set, and the expert's GEMM atoms
found through the index. One file, so that `make test`'s workers (a file each) build it once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from index.build import build_index
from index.hunt import Hunter, evaluate, load_cases

EVAL = Path(__file__).parent / "fixtures" / "hunt_eval.toml"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_full_cutlass_build(full_cutlass) -> None:
    cfg, r, full = full_cutlass
    assert r.files_total > 1000 and r.chunks_total > 10000
    # overloads and #if branches share their short text: about a tenth of the chunks need no model call
    assert 0.8 * r.chunks_added < r.chunks_embedded < 0.95 * r.chunks_added, (
        r.chunks_embedded,
        r.chunks_added,
    )
    t0 = time.monotonic()
    again = build_index("cutlass", cfg)
    print(
        f"full CUTLASS build {full:.0f} s, {r.chunks_total} chunks ({r.chunks_embedded} texts embedded), "
        f"{r.index_bytes / 2**20:.0f} MiB; "
        f"unchanged rebuild {time.monotonic() - t0:.1f} s"
    )
    assert again.files_changed == 0 and again.chunks_total == r.chunks_total


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_full_cutlass_eval(full_cutlass) -> None:
    cfg, _, _ = full_cutlass
    report = evaluate(Hunter(cfg, "cutlass"), load_cases(EVAL))
    misses = [(r.case.query, r.top_paths[:5]) for r in report.per_case if r.rank is None or r.rank > 5]
    print(f"\nrecall@5 {report.recall_at_5:.3f}  MRR {report.mrr:.3f}  p50 {report.p50_ms:.1f} ms")
    for q, top in misses:
        print("miss:", q, top)
    assert report.recall_at_5 >= 0.8


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_gemm_building_blocks_are_found_through_the_index(full_cutlass) -> None:
    """The expert's WGMMA GEMM asks the hunter for its atoms; each answer is the symbol the headers define."""
    import dataclasses

    from pipeline.generate.expert import atoms

    cfg, _, _ = full_cutlass
    hunter = Hunter(cfg, "cutlass")
    needs = [atoms.gmma(n, dt) for n in (128, 256) for dt in ("bfloat16", "float16")]
    needs += [atoms.TMA_LOAD_3D, atoms.TX_BARRIER, atoms.ARRIVE_BARRIER, atoms.SW128_K, atoms.SW128_MN]
    for need in needs:
        found = atoms.find(need, hunter)
        assert found.via == "index", (need.what, found)
        assert found == dataclasses.replace(atoms.find(need), via="index"), need.what
