"""pipeline/compile.py against the real nvcc (no mocks): builds, ptxas report, cache, timeouts, logs."""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path

import pytest

from pipeline import compile as compile_module
from pipeline.compile import (
    ToolchainError,
    cancel_prefetch,
    compile_candidates,
    find_nvcc,
    parse_ptxas,
    prefetch,
    resolve_arch,
    toolkit_version,
    trim_log,
)
from pipeline.config import Config
from pipeline.types import Candidate, Status

KERNELS = Path(__file__).parent / "fixtures" / "kernels"

try:
    NVCC: str | None = find_nvcc(Config())
except ToolchainError:
    NVCC = None
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc (CUDA toolkit) on this machine")


def candidate(name: str, key: str | None = None, flags: tuple[str, ...] = ()) -> Candidate:
    return Candidate(
        key=key or name, task_id="t", source=(KERNELS / f"{name}.cu").read_text(), launcher="", flags=flags
    )


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    # Work directories go under tmp_path so a test can check that none is left behind.
    work = tmp_path / "tmp"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    return Config(home=tmp_path / "home", arch="sm_90a")


def cache_files(cfg: Config) -> list[Path]:
    d = cfg.cache_dir / "cubin"
    return sorted(d.iterdir()) if d.is_dir() else []


def by_name(build, name):
    return next(r for r in build.resources if r.name == name)


# --------------------------------------------------------------------------------------------- compiling


@needs_nvcc
def test_good_kernel_compiles_to_cubin_with_resources(cfg: Config) -> None:
    (b,) = compile_candidates([candidate("good")], cfg)
    assert b.status is Status.OK, b.log
    assert b.candidate_key == "good" and b.arch == "sm_90a" and not b.cached
    assert b.cubin_path and Path(b.cubin_path).read_bytes()[:4] == b"\x7fELF"
    assert Path(b.cubin_path).parent == cfg.cache_dir.resolve() / "cubin"
    assert {r.name for r in b.resources} == {"add_vectors", "block_sum"}
    add, red = by_name(b, "add_vectors"), by_name(b, "block_sum")
    assert 0 < add.registers <= 64 and add.spill_stores == 0 and add.stack_frame == 0
    assert red.shared_mem == 1024 and red.barriers == 1
    assert "ptxas info" not in b.log and b.seconds > 0
    assert not list((Path(tempfile.gettempdir())).iterdir()), "work directory left behind"


@needs_nvcc
def test_spilling_kernel_reports_spills(cfg: Config) -> None:
    (b,) = compile_candidates([candidate("spill")], cfg)
    assert b.status is Status.OK, b.log
    r = by_name(b, "spill")
    assert r.spill_stores > 0 and r.spill_loads > 0 and r.stack_frame > 0


@needs_nvcc
def test_local_array_has_stack_but_no_spills(cfg: Config) -> None:
    (b,) = compile_candidates([candidate("local_array")], cfg)
    assert b.status is Status.OK, b.log
    r = by_name(b, "local_array")
    assert r.stack_frame >= 1024 and r.spill_stores == 0 and r.spill_loads == 0


@needs_nvcc
def test_syntax_error_gives_short_named_log(cfg: Config) -> None:
    (b,) = compile_candidates([candidate("syntax_error")], cfg)
    assert b.status is Status.COMPILE_ERROR and b.cubin_path is None
    assert 'identifier "scale" is undefined' in b.log
    assert "kernel.cu(4): error" in b.log  # the temp directory is gone from the path
    assert "^" in b.log  # caret under the offending token
    assert tempfile.gettempdir() not in b.log and len(b.log.splitlines()) <= 12


@needs_nvcc
def test_template_error_keeps_a_short_instantiation_chain(cfg: Config) -> None:
    (b,) = compile_candidates([candidate("template_error")], cfg)
    assert b.status is Status.COMPILE_ERROR
    assert 'class "NoValue" has no member "value"' in b.log
    chain = [line for line in b.log.splitlines() if "instantiation of" in line]
    assert 2 <= len(chain) <= 5  # the compiler printed 8
    assert "more instantiations" in b.log
    assert "at line 21" in b.log  # the outermost one: the call in the kernel


@needs_nvcc
def test_mixed_batch_returns_builds_in_order(cfg: Config) -> None:
    batch = [
        candidate("good", "a"),
        candidate("syntax_error", "b"),
        candidate("local_array", "c"),
        candidate("good", "d"),  # same source and flags as "a": compiled once, reported twice
        candidate("good", "e", flags=("-ccbin=/bin/sh",)),  # refused, never handed to nvcc
    ]
    calls: list[tuple[int, int]] = []
    builds = compile_candidates(batch, cfg, progress=lambda done, total: calls.append((done, total)))
    assert [b.candidate_key for b in builds] == ["a", "b", "c", "d", "e"]
    ok, err = Status.OK, Status.COMPILE_ERROR
    assert [b.status for b in builds] == [ok, err, ok, ok, err]
    assert builds[0].cubin_path == builds[3].cubin_path
    assert "-ccbin" in builds[4].log
    assert calls[-1] == (5, 5) and all(t == 5 for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


@needs_nvcc
def test_second_compile_is_a_cache_hit(cfg: Config) -> None:
    (first,) = compile_candidates([candidate("spill")], cfg)
    start = time.perf_counter()
    (second,) = compile_candidates([candidate("spill", key="other")], cfg)
    elapsed = time.perf_counter() - start
    assert not first.cached and second.cached
    assert second.candidate_key == "other" and second.status is Status.OK
    assert second.cubin_path == first.cubin_path and Path(second.cubin_path).is_file()
    assert second.resources == first.resources
    assert second.seconds < first.seconds / 10 and elapsed < first.seconds
    files = {p.suffix for p in cache_files(cfg)}
    assert files == {".cubin", ".json"}
    record = json.loads(next(p for p in cache_files(cfg) if p.suffix == ".json").read_text())
    assert record["status"] == "ok" and record["resources"][0]["name"] == "spill"


def nothing_in_flight() -> bool:
    """No build registered as under way, once the builds' done callbacks ran (their threads call them)."""
    deadline = time.monotonic() + 10
    while compile_module._flying and time.monotonic() < deadline:
        time.sleep(0.01)
    return not compile_module._flying


def counted_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The cache keys nvcc is run for, in order (the real builds still run)."""
    keys: list[str] = []
    real = compile_module._compile_one

    def counting(c, key, *args):
        keys.append(key)
        return real(c, key, *args)

    monkeypatch.setattr(compile_module, "_compile_one", counting)
    return keys


def test_prefetch_builds_ahead_and_a_batch_waits_for_it(cfg: Config, monkeypatch) -> None:
    keys = counted_builds(monkeypatch)
    try:
        assert prefetch([candidate("spill"), candidate("local_array")], cfg) == 2
        # At once, while those build: the batch takes them (cached or under way), nvcc runs for the new one only.
        builds = compile_candidates(
            [candidate("local_array", "x"), candidate("good", "y"), candidate("spill", "z")], cfg
        )
        assert [b.candidate_key for b in builds] == ["x", "y", "z"]
        assert all(b.status is Status.OK and Path(b.cubin_path).is_file() for b in builds)
        assert len(keys) == len(set(keys)) == 3  # each source built once
        assert prefetch([candidate("good", "again")], cfg) == 0  # cached: nothing to build
    finally:
        cancel_prefetch()
    assert nothing_in_flight()


def test_cancelled_prefetches_are_built_by_the_batch(cfg: Config, monkeypatch) -> None:
    keys = counted_builds(monkeypatch)
    one_ahead = Config(home=cfg.home, arch=cfg.arch, compile_jobs=2)  # one build ahead at a time
    cancel_prefetch()  # a fresh pool of that size
    names = ("good", "spill", "local_array")
    assert prefetch([candidate(n) for n in names], one_ahead) == 3
    cancel_prefetch()  # the first is running, the two queued are dropped
    builds = compile_candidates([candidate(n) for n in names], cfg)
    assert [b.status for b in builds] == [Status.OK] * 3
    assert len(set(keys)) == 3 and len(keys) == 3  # none twice, none lost
    assert nothing_in_flight()


@needs_nvcc
def test_failed_compiles_are_cached(cfg: Config) -> None:
    (first,) = compile_candidates([candidate("syntax_error")], cfg)
    (second,) = compile_candidates([candidate("syntax_error")], cfg)
    assert not first.cached and second.cached
    assert second.status is Status.COMPILE_ERROR and second.log == first.log


@needs_nvcc
def test_changed_flags_miss_the_cache(cfg: Config) -> None:
    compile_candidates([candidate("good")], cfg)
    (flagged,) = compile_candidates([candidate("good", flags=("-DVARIANT=1",))], cfg)
    (other_cfg,) = compile_candidates([candidate("good")], cfg.replace(nvcc_flags=("-O2", "-std=c++17")))
    assert flagged.status is Status.OK and not flagged.cached
    assert other_cfg.status is Status.OK and not other_cfg.cached
    assert len([p for p in cache_files(cfg) if p.suffix == ".json"]) == 3


@needs_nvcc
def test_timeout_is_reported_and_not_cached(cfg: Config) -> None:
    # The CuTe kernel takes seconds to compile: returning well before that shows nvcc was killed.
    start = time.perf_counter()
    (b,) = compile_candidates([candidate("cute_copy")], cfg.replace(compile_timeout_s=0.05))
    assert time.perf_counter() - start < 2.0
    assert b.status is Status.COMPILE_TIMEOUT and b.cubin_path is None
    assert "timed out" in b.log
    assert cache_files(cfg) == []
    assert not list(Path(tempfile.gettempdir()).iterdir())


@needs_nvcc
@pytest.mark.slow
def test_cute_kernel_compiles_for_sm90a(cfg: Config) -> None:
    (b,) = compile_candidates([candidate("cute_copy")], cfg)
    assert b.status is Status.OK, b.log
    assert Path(b.cubin_path).read_bytes()[:4] == b"\x7fELF"
    assert by_name(b, "cute_copy").registers > 0


# --------------------------------------------------------------------------------------------- toolchain


def test_resolve_arch_explicit() -> None:
    assert resolve_arch(Config(arch="sm_80")) == "sm_80"
    assert resolve_arch(Config(arch="90a")) == "sm_90a"
    assert resolve_arch(Config(arch="compute_100a")) == "sm_100a"
    assert re.fullmatch(r"sm_\d+a?", resolve_arch(Config(arch="auto")))


def test_find_nvcc_with_bogus_path_raises(tmp_path: Path) -> None:
    bogus = str(tmp_path / "no" / "nvcc")
    with pytest.raises(ToolchainError, match="nvcc not found") as err:
        find_nvcc(Config(nvcc=bogus))
    assert bogus in str(err.value) and "KERNELPRO_NVCC" in str(err.value)
    with pytest.raises(ToolchainError):
        compile_candidates([candidate("good")], Config(home=tmp_path, nvcc=bogus))


@needs_nvcc
def test_toolkit_version() -> None:
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", toolkit_version(NVCC))


# --------------------------------------------------------------------------------------------- parsing

# The literal sample from shared/reference/profiling.md, section 4.
PROFILING_SAMPLE = """\
ptxas info    : Compiling entry function '_Z5spillPKfPf' for 'sm_90a'
ptxas info    : Function properties for _Z5spillPKfPf
    3592 bytes stack frame, 3592 bytes spill stores, 10464 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 3592 bytes cumulative stack size
ptxas info    : Used 10 registers, used 1 barriers, 4104 bytes smem
"""


def test_parse_ptxas_profiling_sample() -> None:
    spill, second = parse_ptxas(PROFILING_SAMPLE)
    assert spill.name == "_Z5spillPKfPf"
    assert (spill.registers, spill.barriers, spill.cumulative_stack) == (40, 0, 3592)
    assert (spill.stack_frame, spill.spill_stores, spill.spill_loads) == (3592, 3592, 10464)
    assert spill.shared_mem == 0
    # The second "Used" line has no entry header: a separate, unnamed kernel, not an overwrite.
    assert (second.name, second.registers, second.barriers, second.shared_mem) == ("", 10, 1, 4104)


def test_parse_ptxas_ignores_callees_and_reads_old_fields() -> None:
    text = """\
ptxas info    : 0 bytes gmem, 4096 bytes cmem[3]
ptxas info    : Compiling entry function 'caller' for 'sm_80'
ptxas info    : Function properties for caller
    256 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, 360 bytes cmem[0]
ptxas info    : Compile time = 11.588 ms
ptxas info    : Function properties for _Z6helperPfi
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'bare' for 'sm_80'
"""
    caller, bare = parse_ptxas(text)
    assert (caller.name, caller.registers, caller.stack_frame, caller.spill_stores) == ("caller", 32, 256, 0)
    assert caller.constant_mem == 360 and caller.barriers == 0
    assert (bare.name, bare.registers) == ("bare", 0)
    assert parse_ptxas("") == ()


# ptxas 13.0's lines for sm_90a kernels whose warpgroup MMAs it had to wait for itself (the 3xTF32 templates
# without their wait after the k loop, tests/test_conv.py builds them); the order is ptxas's.
WGMMA_SAMPLE = """\
ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program \
dependence on compiler-inserted WG.DP in divergent path in the function 'kp_conv2d_conv'
ptxas info    : Compiling entry function 'kp_conv2d_conv' for 'sm_90a'
ptxas info    : Function properties for kp_conv2d_conv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 158 registers, used 1 barriers
ptxas info    : (C7517) warpgroup.wait is injected in around line 3259 by compiler to allow use of registers \
defined by GMMA in function 'kp_linear_gemm'
ptxas info    : Compiling entry function 'kp_linear_gemm' for 'sm_90a'
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function 'kp_pad' for 'sm_90a'
ptxas info    : Used 30 registers, used 0 barriers
"""


def test_parse_ptxas_reads_which_kernels_mmas_ptxas_serialized_or_waited_for() -> None:
    conv, gemm, pad = parse_ptxas(WGMMA_SAMPLE)
    assert conv.wgmma_serialized == "program dependence on compiler-inserted WG.DP in divergent path"
    assert (conv.wgmma_waits_injected, conv.registers) == (0, 158)
    assert (gemm.wgmma_serialized, gemm.wgmma_waits_injected, gemm.registers) == ("", 1, 168)
    assert (pad.wgmma_serialized, pad.wgmma_waits_injected) == ("", 0)


@needs_nvcc
def test_parse_ptxas_on_real_output(tmp_path: Path) -> None:
    import subprocess

    cubin, source = str(tmp_path / "good.cubin"), str(KERNELS / "good.cu")
    out = subprocess.run(
        [NVCC, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-o", cubin, source],
        capture_output=True,
        text=True,
        check=True,
    )
    res = {r.name: r for r in parse_ptxas(out.stdout + out.stderr)}
    assert set(res) == {"add_vectors", "block_sum"}
    assert res["block_sum"].shared_mem == 1024 and res["block_sum"].barriers == 1


# --------------------------------------------------------------------------------------------- logs


def test_trim_log_drops_warnings_and_info_when_there_are_errors() -> None:
    text = """\
/tmp/kernelpro-cc-x1y2/kernel.cu(2): warning #177-D: variable "unused" was declared but never referenced
      int unused = 3;
          ^

Remark: The warnings can be suppressed with "-diag-suppress <warning-number>"

/tmp/kernelpro-cc-x1y2/kernel.cu(4): error: identifier "scale" is undefined
      if (i < n) out[i] = x[i] * scale;
                                 ^

ptxas info    : 0 bytes gmem
1 error detected in the compilation of "/tmp/kernelpro-cc-x1y2/kernel.cu".
"""
    log = trim_log(text)
    assert log.splitlines() == [
        'kernel.cu(4): error: identifier "scale" is undefined',
        "      if (i < n) out[i] = x[i] * scale;",
        "                                 ^",
        '1 error detected in the compilation of "kernel.cu".',
    ]


def test_trim_log_success_keeps_only_real_warnings() -> None:
    text = """\
kernel.cu(2): warning #177-D: variable "unused" was declared but never referenced
      int unused = 3;
          ^

Remark: The warnings can be suppressed with "-diag-suppress <warning-number>"

ptxas warning : Registers are spilled to local memory in function 'spill', 8 bytes spill stores
ptxas info    : Compiling entry function 'w' for 'sm_90a'
ptxas info    : Function properties for w
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 4 registers, used 0 barriers
"""
    log = trim_log(text)
    assert "warning #177-D" in log and "int unused = 3;" in log and "ptxas warning" in log
    assert "ptxas info" not in log and "stack frame" not in log and "Remark" not in log
    assert trim_log(PROFILING_SAMPLE) == ""


def test_trim_log_caps_length_and_shortens_cutlass_paths() -> None:
    header = "/x/site-packages/cutlass_library/source/include/cute/layout.hpp({n}): error: bad thing {n}"
    text = "\n".join(f"{header.format(n=n)}\n  code\n  ^\n" for n in range(30))
    log = trim_log(text, max_lines=10)
    lines = log.splitlines()
    assert len(lines) == 10 and lines[-1] == "... 81 more lines"
    assert lines[0] == "cute/layout.hpp(0): error: bad thing 0"


def test_trim_log_keeps_unrecognised_failure_output() -> None:
    assert trim_log("ptxas info    : 0 bytes gmem\nsomething odd happened\n") == "something odd happened"


@needs_nvcc
def test_the_one_pass_comparison_kernel_compiles_for_sm_90a_for_every_dtype_pair(cfg):
    """pipeline/fused_stats.py's kernel (built by NVRTC in the worker) through real nvcc: every pair of
    output and reference dtypes it takes, without spills (its figures against the torch form: the GPU test)."""
    import torch

    from pipeline import fused_stats

    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    pairs = [(o, r) for o in dtypes for r in dtypes]
    cands = [Candidate(key=f"stats-{o}-{r}", task_id="t", source=fused_stats.source(o, r), launcher="")
             for o, r in pairs]  # fmt: skip
    builds = compile_candidates(cands, cfg)
    for (o, r), b in zip(pairs, builds, strict=True):
        assert b.status == Status.OK, (o, r, b.log)
        (k,) = b.resources
        assert k.name == "kp_stats" and k.spill_stores == 0, (o, r, k)
