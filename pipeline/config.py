"""One frozen configuration. The only module that reads environment variables; the CLI overrides fields."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "KERNELPRO_"
SANDBOX_LAYERS = ("userns", "netns", "landlock", "seccomp")


@dataclass(frozen=True)
class Config:
    home: Path = Path(".kernelpro")  # caches, calibration, baselines
    nvcc: str | None = None  # None: PATH, then /usr/local/cuda, then the nvidia-cuda-nvcc wheel
    arch: str = "auto"  # "auto": from the GPU (nvidia-smi), sm_90a when there is none
    nvcc_flags: tuple[str, ...] = ("-O3", "-std=c++17", "-lineinfo")
    compile_timeout_s: float = 180.0
    compile_jobs: int = max(1, os.cpu_count() or 1)
    # the search builds the expert's next candidates in the background while the GPU profiles and times
    # (on a GPU machine only; pipeline/compile.py prefetch)
    prefetch: bool = True
    # A profiling target started ahead brings CUDA up before its job, between profiles (1.0-1.4 s of a
    # profile, benchmarks/ncu_parts.py). Off until a context being made beside the harness's timing is
    # measured to leave it alone (an idle one does)
    ncu_cuda_ahead: bool = False
    # Ray (pipeline/cluster.py): "" keeps everything on this machine and never imports Ray; "local" starts
    # Ray here, "auto" or an address joins a cluster (GPU actors for evaluations, CPU tasks for nvcc)
    ray: str = ""
    # isolated GPU worker
    device: str = "cuda"  # "cpu" runs the protocol on the CPU (tests with Python stand-ins)
    job_timeout_s: float = 300.0  # wall time for one job in the worker
    job_cpu_s: float = 600.0  # CPU seconds (all threads) for one job
    worker_memory_mb: int = 32 * 1024  # resident host memory of the worker
    worker_max_modules: int = 4096  # cubins a worker loads before it is recycled (modules are never unloaded)
    # OS confinement of every process that runs candidate code (pipeline/sandbox.py)
    sandbox: bool = True  # off: scrubbed environment and limits only (tests and `doctor` show what it adds)
    sandbox_layers: tuple[str, ...] = SANDBOX_LAYERS  # the worker's, each applied where the kernel has it
    sandbox_ncu_layers: tuple[str, ...] = SANDBOX_LAYERS  # the ncu tree's: namespaces may cost it counters
    sandbox_read: tuple[str, ...] = ()  # more read-only paths inside a home (a task folder, say)
    sandbox_file_mb: int = 16384  # the largest file a confined process may write
    # verification
    trials: int = 3  # fresh random inputs each; trial 1 uses a second weight initialisation
    seed: int = 0
    # timing
    timing_trials: int = 100
    timing_budget_s: float = 2.0
    warmup: int = 5
    # How L2 is emptied before each timed call (pipeline/timing.py L2Flusher): "clean" reads twice its size,
    # so a call starts with nothing of its own cached and nothing dirty to write back; "writes" fills a
    # buffer instead (Triton's do_bench convention), which leaves an L2 of dirty lines that the call's own
    # reads write back (cuBLAS's GEMV over 134 MB timed 12% slower under it on the H100)
    l2_flush: str = "clean"
    # Share of the timed calls whose outputs are checked against eager (each decided at random after the call
    # returns; the five synchronised calls always are). A candidate that cheats on enough calls to move the
    # median (50 of 100) escapes a quarter-share check with odds 0.75**50, below one in a million; checking
    # every call made eager's rerun and the comparison most of an evaluation's time.
    check_fraction: float = 0.25
    energy: bool = True
    energy_window_s: float = 1.5
    energy_repeats: int = 3  # NVML windows at least; more until the spread is under energy_spread
    energy_max_repeats: int = 8  # windows at most: the budget when the spread stays above energy_spread
    energy_spread: float = 0.01  # target relative standard error of the energy per call over the windows
    baselines: tuple[str, ...] = ("eager", "compile", "max-autotune-no-cudagraphs")
    baseline_cache: bool = True  # optimize reuses a task's baselines measured on this GPU and software before
    suspicious_speedup: float = 10.0
    # Chroma index: embedded in a folder, or a server when chroma_host is set
    chroma_path: Path = Path(".kernelpro/chroma")
    chroma_host: str | None = None
    chroma_port: int = 8000
    embed_model: str | None = None  # None: the packaged all-MiniLM-L6-v2; else a local folder or cached name
    # search (kernelpro optimize)
    runs_dir: Path = Path("runs")
    policy: str = "auto"  # auto (llm when an endpoint is configured, else expert) | llm | expert
    search: str = "mcts"  # mcts | greedy
    objective: str = "time"  # time | energy (joules per call) | edp (energy-delay product)
    speed_tolerance: float = 0.02  # energy, edp: no energy credit this fraction slower than the fastest
    max_evals: int = 40  # candidates evaluated on the GPU
    max_wall_s: float = 3600.0
    max_tokens: int = 2_000_000  # LLM tokens, prompt + completion
    max_cost_usd: float = 20.0
    children_per_expand: int = 4  # candidates proposed per expansion, evaluated in parallel
    widen_c: float = 2.0  # progressive widening: at most widen_c * visits**widen_alpha children
    widen_alpha: float = 0.5
    prune_after: int = 3  # a subtree whose last k expansions all failed or did not improve is closed
    repair_rounds: int = 2  # per failed child: compile errors and mismatches handed back with the errors
    feedback: str = "advice"  # advice | json | raw | none: what the policy sees of the profile (ablations)
    # Under the time objective a node this close to its roofline floor by its own timing is not profiled:
    # the counters could find at most this share, and a profile costs as much GPU time as 5-10 small
    # candidates (~3.5 s on the H200). 0 profiles every node the search expands.
    profile_headroom: float = 0.10
    memory: bool = True  # lessons across runs, in Chroma
    memory_collection: str = "kernelpro-memory"  # an experiment gives each cell and seed its own
    # where building blocks come from: a corpus (corpora/*.toml), corpora joined by "+" (cutlass+cccl), or
    # "none"; each one's index is built by `kernelpro index build --corpus NAME`
    corpus: str = "cutlass"
    # LLM endpoint (any OpenAI-compatible server); the key never reaches a worker or a log
    llm_base_url: str | None = None
    llm_api_key: str | None = None
    llm_model: str = "gpt-4.1"
    llm_temperature: float = 0.7
    llm_max_output_tokens: int = 8192
    llm_timeout_s: float = 120.0
    llm_retries: int = 4
    llm_backoff_s: float = 1.0  # first retry delay; doubles per retry (a 429's Retry-After wins)
    llm_concurrency: int = 4
    llm_tool_calls: int = 6  # tool calls the model may make per proposal (source hunt, profiling tools)
    llm_usd_per_mtok_in: float = 0.0  # prices for cost accounting; 0 when unknown (local servers)
    llm_usd_per_mtok_out: float = 0.0

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    def public(self) -> dict[str, str]:
        """Every field as text, secrets masked: what a run log or report may record."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            secret = f.name in _SECRET_FIELDS
            out[f.name] = ("***" if value else "") if secret else str(value)
        return out

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def load(**overrides) -> Config:
    """Defaults, then KERNELPRO_* environment variables, then explicit overrides (the CLI's options)."""
    values: dict = {}
    for f in dataclasses.fields(Config):
        raw = os.environ.get(ENV_PREFIX + f.name.upper())
        if raw is None:
            continue
        values[f.name] = _parse(f.name, f.type, raw)
    # The usual variables of OpenAI-compatible clients, when ours are not set.
    for ours, theirs in (("llm_api_key", "OPENAI_API_KEY"), ("llm_base_url", "OPENAI_BASE_URL")):
        if ours not in values and os.environ.get(theirs):
            values[ours] = os.environ[theirs]
    cfg = Config(**values).replace(**overrides)
    if "chroma_path" not in values and overrides.get("chroma_path") is None:
        # The index lives with the rest of a home unless placed elsewhere on purpose.
        cfg = cfg.replace(chroma_path=cfg.home / "chroma")
    return validate(cfg)


def _parse(name: str, type_: str, raw: str):
    try:
        if type_ == "Path":
            return Path(raw)
        if type_ == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if type_ == "int":
            return int(raw)
        if type_ == "float":
            return float(raw)
        if type_.startswith("tuple"):
            return tuple(s for s in raw.replace(",", " ").split() if s)
        return raw
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {type_}") from None


PROJECT_ROOT = Path(__file__).resolve().parent.parent


def candidate_environ() -> dict[str, str]:
    """The environment of a process that runs candidate code: no secrets, and this project importable."""
    env = secret_free_environ()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    return env


def secret_free_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for processes that run candidate code: anything that looks like a secret removed."""
    env = dict(os.environ if environ is None else environ)
    return {k: v for k, v in env.items() if not any(s in k.upper() for s in _SECRET_WORDS)}


_SECRET_FIELDS = frozenset({"llm_api_key"})  # Config fields that hold credentials (not "max_tokens")
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")


# -- validation: every number in a range, every choice known, every folder a folder ------------------------
# (low, high, low is exclusive); None: unbounded. A numeric field missing here fails tests/test_cli.py.
_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "compile_timeout_s": (0, None, True),
    "compile_jobs": (1, None, False),
    "job_timeout_s": (0, None, True),
    "job_cpu_s": (0, None, True),
    "worker_memory_mb": (256, None, False),
    "worker_max_modules": (1, None, False),
    "sandbox_file_mb": (1, None, False),
    "trials": (1, None, False),
    "seed": (0, 2**32 - 1, False),
    "timing_trials": (1, None, False),
    "timing_budget_s": (0, None, True),
    "warmup": (0, None, False),
    "check_fraction": (0, 1, True),
    "energy_window_s": (0, None, True),
    "energy_repeats": (1, None, False),
    "energy_max_repeats": (1, None, False),
    "energy_spread": (0, None, True),
    "speed_tolerance": (0, None, False),
    "profile_headroom": (0, 1, False),
    "suspicious_speedup": (1, None, True),
    "chroma_port": (1, 65535, False),
    "max_evals": (1, None, False),
    "max_wall_s": (0, None, True),
    "max_tokens": (1, None, False),
    "max_cost_usd": (0, None, True),
    "children_per_expand": (1, None, False),
    "widen_c": (0, None, True),
    "widen_alpha": (0, 1, True),
    "prune_after": (1, None, False),
    "repair_rounds": (0, None, False),
    "llm_temperature": (0, 2, False),
    "llm_max_output_tokens": (1, None, False),
    "llm_timeout_s": (0, None, True),
    "llm_retries": (0, None, False),
    "llm_backoff_s": (0, None, False),
    "llm_concurrency": (1, None, False),
    "llm_tool_calls": (0, None, False),
    "llm_usd_per_mtok_in": (0, None, False),
    "llm_usd_per_mtok_out": (0, None, False),
}
CHOICES: dict[str, tuple[str, ...]] = {
    "policy": ("auto", "llm", "expert"),
    "search": ("mcts", "greedy"),
    "objective": ("time", "energy", "edp"),
    "feedback": ("advice", "json", "raw", "none"),
    "device": ("cuda", "cpu"),
    "l2_flush": ("clean", "writes"),
    # each element of the tuple; reduce-overhead (torch.compile with CUDA graphs) is the anchor for a candidate
    # that replays its own graph (plan.graph), and not a default: it compiles once more
    "baselines": ("eager", "compile", "max-autotune-no-cudagraphs", "reduce-overhead"),
    "sandbox_layers": SANDBOX_LAYERS,
    "sandbox_ncu_layers": SANDBOX_LAYERS,
}
NO_CORPUS = "none"
_COLLECTION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")  # what Chroma accepts
_FOLDERS = ("home", "runs_dir")  # chroma_path: index/store.py says it, as a StoreError, where it is opened


def corpus_names(value: object) -> tuple[str, ...]:
    """The corpora a `corpus` setting names, in its order; () for "none". A ValueError of one line says what
    is allowed: "none", one corpus of corpora/*.toml, or several of them joined by "+" (each once)."""
    from corpora import list_corpora

    known = list_corpora()
    if value == NO_CORPUS:
        return ()
    parts = str(value).split("+") if isinstance(value, str) else []
    unknown = [p for p in parts if p not in known]
    twice = sorted({p for p in parts if parts.count(p) > 1})
    if parts and not unknown and not twice:
        return tuple(parts)
    if not parts:
        why = "not text"
    elif NO_CORPUS in parts:
        why = f"{NO_CORPUS!r} joined with corpora"
    elif "" in parts:
        why = "an empty name"
    else:
        why = f"unknown {unknown[0]!r}" if unknown else f"{twice[0]} named twice"
    raise ValueError(
        f"corpus = {value!r} ({why}) is not {NO_CORPUS!r}, a corpus or corpora joined by '+' (e.g. "
        f"cutlass+cccl); the corpora are {', '.join(known)}"
    )


def _range_text(low: float | None, high: float | None, open_low: bool) -> str:
    if low is not None and high is not None:
        return f"between {low} and {high}" + (f" (more than {low})" if open_low else "")
    if low is not None:
        return f"more than {low}" if open_low else f"at least {low}"
    return f"at most {high}"


def validate(cfg: Config) -> Config:
    """The config if every field makes sense; else one ValueError naming each bad field, its value and what
    is allowed (a zero budget or a negative trial count would otherwise give an empty "finished" run)."""
    problems = []
    for name, (low, high, open_low) in _RANGES.items():
        if not hasattr(cfg, name):
            continue
        value = getattr(cfg, name)
        too_low = low is not None and (value <= low if open_low else value < low)
        if too_low or (high is not None and value > high):
            where = f"{ENV_PREFIX}{name.upper()} or its option"
            problems.append(
                f"{name} = {value} ({where}) is out of range: it must be {_range_text(low, high, open_low)}"
            )
    for name, allowed in CHOICES.items():
        value = getattr(cfg, name, None)
        bad = [v for v in (value if isinstance(value, tuple) else (value,)) if v not in allowed]
        if bad:
            problems.append(f"{name} = {bad[0]!r} is not one of {', '.join(allowed)}")
    if not _COLLECTION.fullmatch(cfg.memory_collection):
        problems.append(
            f"memory_collection = {cfg.memory_collection!r} is not a collection name: 3 to 63 letters, digits, "
            "'.', '_' or '-', starting and ending with a letter or digit"
        )
    if cfg.objective != "time" and not cfg.energy:
        problems.append(
            f"objective = {cfg.objective!r} counts joules: it needs energy measured (energy = True)"
        )
    try:
        corpus_names(cfg.corpus)
    except ValueError as e:
        problems.append(str(e))
    for name in _FOLDERS:
        path = Path(getattr(cfg, name))
        if path.exists() and not path.is_dir():
            problems.append(f"{name} {path} is a file, not a folder")
    if problems:
        raise ValueError("bad configuration: " + "; ".join(problems))
    return cfg
