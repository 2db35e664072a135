"""nvcc -> cubin for the target arch, the ptxas resource report, and a content-addressed cache.

A bad candidate is a value (Status.COMPILE_ERROR / COMPILE_TIMEOUT), never an exception; the only exception
raised here is ToolchainError, for a missing or unusable nvcc.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config import Config
from pipeline.types import Build, Candidate, KernelResources, Status, from_dict, to_dict

if TYPE_CHECKING:
    from pipeline.cluster import Compiled  # only for the type: importing it imports Ray

# Bump when the cached JSON or the way a Build is derived from nvcc's output changes.
_CACHE_FORMAT = 1
_DEFAULT_ARCH = "sm_90a"
_WORKDIR_PREFIX = "kernelpro-cc-"  # recognisable, so trim_log can strip these paths from messages
_SOURCE_NAME = "kernel.cu"
_CUBIN_NAME = "kernel.cubin"

Progress = Callable[[int, int], None]


class ToolchainError(RuntimeError):
    """nvcc is missing or does not run; the CLI prints the message as a one-line error."""


# ---------------------------------------------------------------------------------------------------------
# Toolchain discovery


def find_nvcc(cfg: Config) -> str:
    """cfg.nvcc, else PATH, else /usr/local/cuda/bin/nvcc, else the nvidia-cuda-nvcc wheel."""
    if cfg.nvcc:
        found = shutil.which(cfg.nvcc)  # accepts a path to an executable file or a bare name on PATH
        if found:
            return found
        raise ToolchainError(
            f"nvcc not found: the configured nvcc {cfg.nvcc!r} is not an executable file; set KERNELPRO_NVCC "
            "(or the nvcc option) to the path of nvcc, or leave it unset to search PATH and /usr/local/cuda"
        )
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", _wheel_nvcc()):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise ToolchainError(
        "nvcc not found: not on PATH, not in /usr/local/cuda/bin and no nvidia-cuda-nvcc wheel installed; "
        "install the CUDA toolkit (or `pip install nvidia-cuda-nvcc`), or set KERNELPRO_NVCC to its path"
    )


def _wheel_nvcc() -> str | None:
    # The wheel installs into the `nvidia` namespace package, outside PATH (nvidia/cu13/bin/nvcc).
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cu12", "cuda_nvcc"):
            path = os.path.join(root, sub, "bin", "nvcc")
            if os.path.isfile(path):
                return path
    return None


@functools.lru_cache(maxsize=8)
def toolkit_version(nvcc: str) -> str:
    """The toolkit version from `nvcc --version`, e.g. "13.0.88" (cached per path)."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"nvcc at {nvcc} does not run ({e}); reinstall the CUDA toolkit") from None
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise ToolchainError(f"nvcc at {nvcc} does not run: `nvcc --version` exited with {out.returncode}")
    m = re.search(r"\bV(\d+\.\d+\.\d+)", text) or re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else text.strip().splitlines()[-1] if text.strip() else "unknown"


@functools.lru_cache(maxsize=1)
def _cutlass() -> tuple[tuple[str, ...], str | None]:
    """(include dirs, version) of the pinned nvidia-cutlass wheel; ((), None) when it is not installed."""
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return (), None
    root = Path(next(iter(spec.submodule_search_locations))) / "source"
    dirs = tuple(str(d) for d in (root / "include", root / "tools" / "util" / "include") if d.is_dir())
    try:
        version = importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return dirs, version


def resolve_arch(cfg: Config) -> str:
    """cfg.arch unless "auto"; else the first GPU's compute capability; sm_90a without a GPU."""
    if cfg.arch != "auto":
        return _normalise_arch(cfg.arch)
    return _gpu_arch()


def _normalise_arch(arch: str) -> str:
    m = re.fullmatch(r"(?:sm_|compute_)?(\d+[a-z]?)", arch.strip())
    return f"sm_{m.group(1)}" if m else arch  # anything else goes to nvcc, which reports it


@functools.lru_cache(maxsize=1)
def _gpu_arch() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return _DEFAULT_ARCH
    try:
        out = subprocess.run(
            [smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return _DEFAULT_ARCH
    m = re.match(r"\s*(\d+)\.(\d+)", out.stdout) if out.returncode == 0 else None
    if not m:
        return _DEFAULT_ARCH
    major, minor = int(m.group(1)), int(m.group(2))
    # From Hopper on, wgmma/TMA/tcgen05 exist only in the arch-specific ("a") targets.
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def _gencode(arch: str) -> str:
    return f"-gencode=arch={arch.replace('sm_', 'compute_', 1)},code={arch}"


# ---------------------------------------------------------------------------------------------------------
# Candidate flags: they come from a generator (possibly an LLM) and run in this process's nvcc, so only
# flags that change code generation are allowed; -ccbin, -run, -o, --options-file, -I and friends could run
# programs, write files or read arbitrary files into the log.

_ALLOWED_FLAG = re.compile(
    r"-(?:O[0-3]?|G|lineinfo|-generate-line-info|w|-?use_fast_math|-?restrict|-?expt-relaxed-constexpr"
    r"|-?expt-extended-lambda|-?extended-lambda|-?extra-device-vectorization|-?res-usage|-?resource-usage"
    r"|-?std=c\+\+\d\d|-?(?:ftz|prec-div|prec-sqrt|fmad)=(?:true|false)|-?maxrregcount=\d+"
    r"|-?dopt=\w+|-?diag-suppress=[\w,]+|-?Werror=[\w,-]+|-?default-stream=\w+"
    r"|[DU][A-Za-z_]\w*(?:=[\w.+-]*)?)"
)
_ALLOWED_PTXAS = re.compile(
    r"-(?:v|-verbose|O[0-3]|-opt-level=[0-3]|-?warn-(?:on-)?(?:spills|lmem-usage|local-memory-usage)"
    r"|-?allow-expensive-optimizations(?:=(?:true|false))?|-?maxrregcount=\d+|-?dlcm=\w+|-?dscm=\w+"
    r"|-?def-(?:load|store)-cache=\w+|-?disable-optimizer-constants|-?suppress-stack-size-warning"
    r"|-?fmad=(?:true|false)|-?Werror|-?disable-warnings|-?w)"
)


def _flag_problem(flags: Sequence[str]) -> str | None:
    """Why the candidate's flags are refused, or None."""
    i = 0
    while i < len(flags):
        flag = flags[i]
        if flag in ("-Xptxas", "--ptxas-options") and i + 1 < len(flags):
            values, i = flags[i + 1], i + 2
        elif flag.startswith(("-Xptxas=", "--ptxas-options=")):
            values, i = flag.split("=", 1)[1], i + 1
        elif flag in ("-maxrregcount", "--maxrregcount") and i + 1 < len(flags) and flags[i + 1].isdigit():
            i += 2
            continue
        elif _ALLOWED_FLAG.fullmatch(flag):
            i += 1
            continue
        else:
            return f"flag not allowed for candidates: {flag!r}"
        bad = [v for v in values.split(",") if not _ALLOWED_PTXAS.fullmatch(v)]
        if bad:
            return f"ptxas option not allowed for candidates: {bad[0]!r}"
    return None


# ---------------------------------------------------------------------------------------------------------
# The ptxas report

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'(?: for '([^']+)')?")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_STACK_RE = re.compile(r"(\d+) bytes stack frame")
_NUMBERS = {
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}
_USED = {
    "registers": re.compile(r"Used (\d+) registers"),
    "barriers": re.compile(r"used (\d+) barriers"),
    "cumulative_stack": re.compile(r"(\d+) bytes cumulative stack size"),
    "shared_mem": re.compile(r"(\d+) bytes smem"),
    "constant_mem": re.compile(r"(\d+) bytes cmem\[0\]"),
}


# sm_90a's warpgroup-MMA diagnostics (ptxas info lines, so trim_log drops them), each naming its function:
# "(C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to <reason> in the
# function 'k'" and "(C7517) warpgroup.wait is injected in around line N by compiler to allow use of
# registers defined by GMMA in function 'k'".
_WGMMA_SERIALIZED_RE = re.compile(
    r"wgmma\.mma_async instructions are serialized due to (.+?) in (?:the )?function '([^']+)'"
)
_WGMMA_INJECTED_RE = re.compile(r"warpgroup\.wait is injected\b.*? in (?:the )?function '([^']+)'")


def _wgmma_diagnostics(text: str) -> dict[str, dict]:
    """Per function: why ptxas serialized its warpgroup MMAs (the first reason) and the waits it injected."""
    found: dict[str, dict] = {}
    for line in text.splitlines():
        if m := _WGMMA_SERIALIZED_RE.search(line):
            found.setdefault(m.group(2), {}).setdefault("wgmma_serialized", m.group(1).strip())
        elif m := _WGMMA_INJECTED_RE.search(line):
            d = found.setdefault(m.group(1), {})
            d["wgmma_waits_injected"] = d.get("wgmma_waits_injected", 0) + 1
    return found


def parse_ptxas(text: str) -> tuple[KernelResources, ...]:
    """One KernelResources per entry function in a `-Xptxas -v` report, in report order.

    Properties of non-entry functions (non-inlined callees) are ignored. A `Used ...` line that does not
    follow an entry header gets the name "" rather than being merged into the previous entry.
    """
    entries: list[dict] = []  # {"name", "used": bool, ...fields}
    props: dict[str, dict[str, int]] = {}
    wgmma = _wgmma_diagnostics(text)
    current: dict | None = None
    props_for: str | None = None
    for line in text.splitlines():
        if m := _ENTRY_RE.search(line):
            current = {"name": m.group(1), "used": False}
            entries.append(current)
            props_for = None
        elif m := _PROPS_RE.search(line):
            props_for = m.group(1)
        elif props_for is not None and _STACK_RE.search(line):
            props[props_for] = {
                k: int(r.group(1)) for k, r in ((k, p.search(line)) for k, p in _NUMBERS.items()) if r
            }
            props_for = None
        elif m := _USED["registers"].search(line):
            if current is None or current["used"]:
                current = {"name": "", "used": False}
                entries.append(current)
            current["used"] = True
            for key, pattern in _USED.items():
                if r := pattern.search(line):
                    current[key] = int(r.group(1))
            props_for = None
    result = []
    for e in entries:
        fields = {k: v for k, v in e.items() if k not in ("name", "used")}
        fields.setdefault("registers", 0)
        extra = {**props.get(e["name"], {}), **wgmma.get(e["name"], {})}
        result.append(KernelResources(name=e["name"], **{**extra, **fields}))
    return tuple(result)


# ---------------------------------------------------------------------------------------------------------
# Log trimming

# A message header: EDG `file(12): error: ...`, gcc `file:1:10: fatal error: ...`, or `ptxas error   : ...`.
_HEADER_RE = re.compile(
    r"^(?:\S[^:]*?(?:\(\d+\)|:\d+(?::\d+)?):\s+(?P<kind>catastrophic error|fatal error|error|warning)\b"
    r"|(?:ptxas|nvcc|nvlink|fatbinary|cicc|cudafe\+\+|cc1plus|gcc|g\+\+)\s*:?\s*"
    r"(?P<tool_kind>fatal error|fatal|error|warning)\s*:)"
)
_INFO_RE = re.compile(r"^(?:ptxas info\b|Remark: The warnings can be suppressed|\s+\d+ bytes stack frame)")
_SUMMARY_RE = re.compile(r"^\d+ errors? detected in the compilation of")
_INSTANTIATION_RE = re.compile(
    r"^\s+(?:detected during|instantiation of|In file included from|required from)"
)
_PATH_SUBS = (
    # Our per-compile work directories and nvcc's own temp files: only the base name helps a reader.
    (re.compile(r"(?:[^\s\"'(]*/)?" + _WORKDIR_PREFIX + r"[^/\s\"']*/"), ""),
    (re.compile(r"(?:[^\s\"'(]*/)?tmpxft_[0-9a-f]+_\d+-\d+_"), ""),
    # CUTLASS headers by their include-relative name (cute/tensor.hpp), not a site-packages path.
    (re.compile(r"[^\s\"'(]*/cutlass_library/source/(?:tools/util/)?include/"), ""),
)
_KEEP_INSTANTIATIONS = 3
_KEEP_CONTEXT = 6  # source line, caret, "argument types are: ..." and the like
_MAX_LINE = 400


def trim_log(text: str, max_lines: int = 40) -> str:
    """Compiler output cut to what a generator needs to fix the code.

    With errors: each distinct error with its source line and caret, the first few instantiation lines and
    the outermost one (the call site in the candidate), warnings dropped. Without errors: only real warnings.
    If the output has errors but none in a known format, every line except ptxas info is kept.
    """
    lines = [_clean(line) for line in text.splitlines()]
    blocks: list[tuple[str, list[str]]] = []  # (kind, lines)
    stray: list[str] = []
    summary: list[str] = []
    block: list[str] | None = None
    for line in lines:
        if m := _HEADER_RE.match(line):
            kind = m.group("kind") or m.group("tool_kind")
            block = [line]
            blocks.append(("warning" if kind == "warning" else "error", block))
        elif _INFO_RE.match(line):
            block = None
        elif _SUMMARY_RE.match(line):
            summary.append(line)
            block = None
        elif not line.strip():
            block = None
        elif block is not None and (line[0].isspace() or re.match(r"^\S+:\d+:\d+:\s+note:", line)):
            block.append(line)  # continuation: source, caret, instantiation chain, gcc notes
        else:
            stray.append(line)
            block = None

    errors = [b for kind, b in blocks if kind == "error"]
    if errors:
        chosen, seen = [], set()
        for b in errors:
            if b[0] not in seen:  # template errors repeat verbatim once per instantiation
                seen.add(b[0])
                chosen.append(_shorten_block(b))
        out = [line for b in chosen for line in b] + summary
    elif blocks:
        out = [line for _, b in blocks for line in _shorten_block(b)]
    else:
        out = [line for line in stray if line.strip()]
    return _cap(out, max_lines)


def _clean(line: str) -> str:
    line = line.rstrip()
    for pattern, repl in _PATH_SUBS:
        line = pattern.sub(repl, line)
    return line if len(line) <= _MAX_LINE else line[: _MAX_LINE - 3] + "..."


def _shorten_block(block: list[str]) -> list[str]:
    context = [line for line in block[1:] if not _INSTANTIATION_RE.match(line)]
    chain = [line for line in block[1:] if _INSTANTIATION_RE.match(line)]
    out = [block[0], *context[:_KEEP_CONTEXT]]
    if len(context) > _KEEP_CONTEXT:
        out.append(f"    ... {len(context) - _KEEP_CONTEXT} more lines")
    # "detected during:" plus the innermost few; the outermost usually points into the candidate's code.
    keep = (
        _KEEP_INSTANTIATIONS + 1 if chain and chain[0].strip() == "detected during:" else _KEEP_INSTANTIATIONS
    )
    if len(chain) > keep + 1:
        out += [*chain[:keep], f"            ... {len(chain) - keep - 1} more instantiations", chain[-1]]
    else:
        out += chain
    return out


def _cap(lines: list[str], max_lines: int) -> str:
    if len(lines) > max_lines:
        keep = max(max_lines - 1, 0)
        lines = [*lines[:keep], f"... {len(lines) - keep} more lines"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Compilation


def compile_candidates(
    candidates: list[Candidate], cfg: Config, progress: Progress | None = None
) -> list[Build]:
    """One Build per candidate, in order. Compiles in parallel; identical sources and flags compile once."""
    total = len(candidates)
    if total == 0:
        return []
    tc = _Toolchain.of(cfg)
    cache = tc.cache
    keys = [tc.key(c, cfg) for c in candidates]
    by_key: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)

    results: list[Build | None] = [None] * total
    done = 0

    def finish(key: str, build: Build) -> None:
        nonlocal done
        for i in by_key[key]:
            results[i] = _for_candidate(build, candidates[i].key)
        done += len(by_key[key])
        if progress is not None:
            progress(done, total)

    todo = []
    for key, indices in by_key.items():
        start = time.perf_counter()
        hit = _load_cached(cache, key)
        if hit is not None:
            finish(key, _for_candidate(hit, "", seconds=time.perf_counter() - start, cached=True))
        else:
            todo.append((key, candidates[indices[0]]))

    if todo and cfg.ray:  # Ray tasks on the cluster's CPU nodes; the head's cache keeps what they built
        from pipeline.cluster import compile_remote

        for done_ in compile_remote(todo, cfg, tc.version):
            finish(done_.key, _keep_remote(cache, done_))
    elif todo:
        jobs = max(1, min(cfg.compile_jobs, len(todo)))
        with concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="nvcc") as pool:
            # Threads suffice: each one only waits on its nvcc process. A build already under way (started
            # ahead by prefetch, or by another caller) is waited for, not run twice.
            futures = {
                _in_flight(key, lambda c=c, key=key: pool.submit(tc.build, c, key, cfg)): key
                for key, c in todo
            }
            for future in concurrent.futures.as_completed(futures):
                key = futures[future]
                if future.cancelled():  # a build started ahead, dropped before it began (cancel_prefetch)
                    finish(key, tc.build(candidates[by_key[key][0]], key, cfg))
                else:
                    finish(key, future.result())
    return [b for b in results if b is not None]


@dataclasses.dataclass(frozen=True)
class _Toolchain:
    """What a build is made with, looked up once for a batch (or a prefetch): nvcc, the arch, the toolkit
    and CUTLASS versions (part of the cache key), the include dirs and the cache folder."""

    nvcc: str
    arch: str
    version: str
    includes: tuple[str, ...]
    cutlass_version: str | None
    cache: Path

    @classmethod
    def of(cls, cfg: Config) -> _Toolchain:
        """Raises ToolchainError without nvcc."""
        nvcc = find_nvcc(cfg)
        includes, cutlass_version = _cutlass()
        cache = cfg.cache_dir / "cubin"
        cache.mkdir(parents=True, exist_ok=True)
        return cls(nvcc, resolve_arch(cfg), toolkit_version(nvcc), tuple(includes), cutlass_version, cache)

    def key(self, c: Candidate, cfg: Config) -> str:
        return _cache_key(c, cfg, self.arch, self.version, self.cutlass_version)

    def build(self, c: Candidate, key: str, cfg: Config) -> Build:
        return _compile_one(c, key, cfg, self.nvcc, self.arch, self.includes, self.cache)


# Builds under way, by cache key: what compile_candidates and prefetch look at before they start nvcc.
_flying: dict[str, concurrent.futures.Future[Build]] = {}
_flying_lock = threading.Lock()
_ahead_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _in_flight(
    key: str, submit: Callable[[], concurrent.futures.Future[Build]]
) -> concurrent.futures.Future[Build]:
    """The build of `key` under way, or the one `submit` starts now, registered until it is done."""
    with _flying_lock:
        found = _flying.get(key)
        if found is not None:
            return found
        future = submit()
        _flying[key] = future

    def done(_: concurrent.futures.Future[Build]) -> None:
        with _flying_lock:
            if _flying.get(key) is future:
                del _flying[key]

    future.add_done_callback(done)
    return future


def prefetch(candidates: Sequence[Candidate], cfg: Config) -> int:
    """Start building, in the background, the candidates that are not cached; returns how many are being
    built (started now, or already under way). For a search whose next candidates are known before they
    are evaluated (the expert's other moves, made while the GPU profiles or times): compile_candidates later
    finds them cached or waits for them. At most half the compile jobs run ahead, so the builds a batch is
    waiting for keep the rest.
    Never raises: a candidate that cannot be keyed or built here is left for compile_candidates to report."""
    global _ahead_pool
    if not candidates or cfg.ray:
        return 0
    try:
        tc = _Toolchain.of(cfg)
    except Exception:  # no toolkit: the foreground build says so
        return 0
    with _flying_lock:
        if _ahead_pool is None:
            _ahead_pool = concurrent.futures.ThreadPoolExecutor(
                max(1, cfg.compile_jobs // 2), thread_name_prefix="nvcc-ahead"
            )
        pool = _ahead_pool
    started = 0
    for c in candidates:
        key = tc.key(c, cfg)
        if (tc.cache / f"{key}.json").is_file():
            continue
        _in_flight(key, lambda c=c, key=key: pool.submit(tc.build, c, key, cfg))
        started += 1
    return started


def cancel_prefetch() -> None:
    """Drop the builds started ahead that have not begun (a search that ends); the running ones finish."""
    global _ahead_pool
    with _flying_lock:
        pool, _ahead_pool = _ahead_pool, None
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


def _keep_remote(cache: Path, done: Compiled) -> Build:
    """A build made on another node (pipeline/cluster.py), with its cubin stored in this cache. One the node
    did not cache (a timeout, a lost task, another toolkit) has no cubin and is not kept here either."""
    if not done.cacheable:
        return done.build
    with tempfile.TemporaryDirectory(prefix=_WORKDIR_PREFIX) as work:
        cubin = None
        if done.cubin is not None:
            cubin = Path(work, _CUBIN_NAME)
            cubin.write_bytes(done.cubin)
        return _store(cache, done.key, done.build, cubin)


def _for_candidate(build: Build, candidate_key: str, **changes) -> Build:
    return dataclasses.replace(build, candidate_key=candidate_key, **changes)


def _cache_key(c: Candidate, cfg: Config, arch: str, version: str, cutlass_version: str | None) -> str:
    material = {
        "format": _CACHE_FORMAT,
        "source": c.source,
        "flags": [*cfg.nvcc_flags, *c.flags],
        "arch": arch,
        "toolkit": version,
        "cutlass": cutlass_version,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _compile_one(
    c: Candidate,
    key: str,
    cfg: Config,
    nvcc: str,
    arch: str,
    includes: Sequence[str],
    cache: Path,
) -> Build:
    """Compile one candidate; every failure becomes a Build, never an exception."""
    start = time.perf_counter()
    try:
        problem = _flag_problem(c.flags)
        if problem:
            build = Build(c.key, Status.COMPILE_ERROR, None, log=problem, arch=arch)
            return _store(cache, key, build, None)
        with tempfile.TemporaryDirectory(prefix=_WORKDIR_PREFIX) as work:
            Path(work, _SOURCE_NAME).write_text(c.source)
            cmd = [
                nvcc,
                "-cubin",
                _gencode(arch),
                "-Xptxas",
                "-v",
                *cfg.nvcc_flags,
                *c.flags,
                *(f"-I{d}" for d in includes),
                "-o",
                _CUBIN_NAME,
                _SOURCE_NAME,
            ]
            rc, output, timed_out = _run(cmd, work, cfg.compile_timeout_s)
            seconds = time.perf_counter() - start
            if timed_out:
                partial = trim_log(output, max_lines=20)
                log = "\n".join(
                    filter(None, [f"compile timed out after {cfg.compile_timeout_s:g} s", partial])
                )
                # Not cached: a loaded machine may finish the same compile next time.
                return Build(c.key, Status.COMPILE_TIMEOUT, None, log=log, seconds=seconds, arch=arch)
            cubin = Path(work, _CUBIN_NAME)
            ok = rc == 0 and cubin.is_file() and cubin.stat().st_size > 0
            log = trim_log(output)
            if not ok and not log:
                log = f"nvcc exited with code {rc} and produced no cubin"
            build = Build(
                c.key,
                Status.OK if ok else Status.COMPILE_ERROR,
                None,
                resources=parse_ptxas(output),
                log=log,
                seconds=seconds,
                arch=arch,
            )
            # Store while the work directory still exists: the cubin moves from it into the cache.
            return _store(cache, key, build, cubin if ok else None)
    except Exception as e:  # an unexpected OS failure must not take down the batch
        return Build(
            c.key,
            Status.COMPILE_ERROR,
            None,
            log=f"internal compile error: {type(e).__name__}: {e}",
            seconds=time.perf_counter() - start,
            arch=arch,
        )


def _run(cmd: list[str], cwd: str, timeout: float) -> tuple[int, str, bool]:
    """(returncode, stdout+stderr, timed_out). On timeout the whole process group (cicc, ptxas) is killed."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream keeps messages in the order nvcc's tools wrote them
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a child left the group and holds the pipe: give up on output
            proc.kill()
            out = ""
        return proc.returncode, out or "", True


def _store(cache: Path, key: str, build: Build, cubin: Path | None) -> Build:
    """Write the cubin, then the JSON that makes the entry visible; both atomically."""
    cubin_path = None
    if cubin is not None:
        target = cache / f"{key}.cubin"
        tmp = cache / f".{key}.cubin.{os.getpid()}.{os.urandom(4).hex()}"
        try:
            os.replace(cubin, tmp)  # a rename when the work directory is on the cache's file system
        except OSError:
            shutil.copyfile(cubin, tmp)
        os.replace(tmp, target)
        cubin_path = str(target.resolve())
    record = {
        "format": _CACHE_FORMAT,
        "status": build.status.value,
        "resources": to_dict(build.resources),
        "log": build.log,
        "seconds": build.seconds,
        "arch": build.arch,
    }
    _atomic_write(cache / f"{key}.json", json.dumps(record, indent=1))
    return _for_candidate(build, build.candidate_key, cubin_path=cubin_path)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _load_cached(cache: Path, key: str) -> Build | None:
    """The cached Build, or None on a miss or an unreadable entry (which is then simply recompiled)."""
    meta = cache / f"{key}.json"
    try:
        record = json.loads(meta.read_text())
        status = Status(record["status"])
        resources = tuple(from_dict(KernelResources, r) for r in record.get("resources", []))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.get("format") != _CACHE_FORMAT:
        return None
    cubin_path = None
    if status is Status.OK:
        cubin = cache / f"{key}.cubin"
        if not cubin.is_file():
            return None
        cubin_path = str(cubin.resolve())
    return Build(
        candidate_key="",
        status=status,
        cubin_path=cubin_path,
        resources=resources,
        log=str(record.get("log", "")),
        arch=str(record.get("arch", "")),
    )
