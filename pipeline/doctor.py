"""`kernelpro doctor`: what this machine offers kernelpro, one check a line.

GPU and driver, nvcc, Nsight Compute, cuobjdump, NVML's energy counter, each confinement layer of the sandbox,
the CUTLASS headers and the source index. Nothing heavy is loaded here: NVML is read in a child process and
the index from its sidecar manifests, so the orchestrator imports neither pynvml nor chromadb.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import sandbox
from pipeline.config import SANDBOX_LAYERS, Config

INDEX_MANIFEST = "manifest.json"  # index/sidecar.py's MANIFEST_FILE (that module imports chromadb)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def gather(cfg: Config) -> list[Check]:
    return [
        gpu(),
        nvcc(cfg),
        ncu(),
        cuobjdump(),
        nvml_energy(),
        *confinement(cfg),
        cutlass(),
        index(cfg),
    ]


def render(checks: list[Check]) -> Any:
    """A rich Table (the CLI prints it)."""
    from rich.table import Table

    table = Table(title="kernelpro doctor")
    for col in ("check", "", "detail"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.name, "[green]ok[/green]" if c.ok else "[red]no[/red]", c.detail)
    return table


def _run(argv: list[str], timeout_s: float = 60) -> tuple[int, str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, f"{type(e).__name__}: {e}"
    return out.returncode, (out.stdout if out.returncode == 0 else out.stderr or out.stdout).strip()


def gpu() -> Check:
    code, text = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if code != 0 or not text:
        return Check("GPU and driver", False, f"nvidia-smi: {text or f'exit {code}'}"[:200])
    rows = [r.strip() for r in text.splitlines() if r.strip()]
    return Check("GPU and driver", True, f"{len(rows)} GPU(s): " + "; ".join(rows))


def nvcc(cfg: Config) -> Check:
    from pipeline.compile import ToolchainError, find_nvcc, toolkit_version

    try:
        path = find_nvcc(cfg)
        return Check("nvcc", True, f"{toolkit_version(path)} at {path}")
    except ToolchainError as e:
        return Check("nvcc", False, str(e))


def ncu() -> Check:
    from pipeline.profile.collect import find_ncu

    path = find_ncu()
    if path is None:
        return Check("Nsight Compute (ncu)", False, "not found: no hardware counters for the profiling tools")
    code, text = _run([path, "--version"])
    version = text.splitlines()[-1] if code == 0 and text else f"does not run ({text[:120]})"
    return Check("Nsight Compute (ncu)", code == 0, f"{version} at {path}")


def cuobjdump() -> Check:
    from pipeline.profile.collect import find_cuobjdump

    path = find_cuobjdump()
    return Check("cuobjdump", path is not None, path or "not found: no SASS statistics")


_ENERGY_PROBE = """
import json, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({"gpu": pynvml.nvmlDeviceGetName(h), "mj": pynvml.nvmlDeviceGetTotalEnergyConsumption(h)}))
"""


def nvml_energy() -> Check:
    """Whether NVML's total-energy counter reads (in a child: this process never loads NVML)."""
    code, text = _run([sys.executable, "-c", _ENERGY_PROBE])
    if code != 0:
        return Check("NVML energy counter", False, (text.splitlines() or ["no output"])[-1][:200])
    try:
        got = json.loads(text.splitlines()[-1])
    except (ValueError, IndexError):
        return Check("NVML energy counter", False, f"unreadable answer: {text[:120]}")
    return Check(
        "NVML energy counter", True, f"{got['gpu']}: {got['mj'] / 1e3:.0f} J since the driver loaded"
    )


def confinement(cfg: Config) -> list[Check]:
    """Each layer as the probe found it; a layer the configuration leaves out is said so."""
    found = sandbox.probe()
    abi = sandbox.landlock_abi()
    out = []
    for layer in ("rlimits", *SANDBOX_LAYERS):
        state = found.get(layer, "unavailable: not probed")
        ok = state == sandbox.APPLIED
        detail = "available" if ok else state
        if layer == "landlock" and abi:
            detail += (
                f" (ABI {abi}"
                + (", no TCP rules" if abi < 4 else "")
                + (", no signal scope)" if abi < 6 else ")")
            )
        if layer in SANDBOX_LAYERS and (not cfg.sandbox or layer not in cfg.sandbox_layers):
            detail += "; off in this configuration"
        if layer in SANDBOX_LAYERS and cfg.sandbox and layer not in cfg.sandbox_ncu_layers:
            detail += "; not applied to ncu"
        out.append(Check(f"sandbox: {layer}", ok, detail))
    return out


def cutlass() -> Check:
    from pipeline.compile import _cutlass

    dirs, version = _cutlass()
    if not dirs:
        return Check(
            "CUTLASS headers", False, "the nvidia-cutlass wheel is not installed: no CuTe or CUTLASS"
        )
    return Check("CUTLASS headers", True, f"nvidia-cutlass {version}: {dirs[0]}")


def index(cfg: Config) -> Check:
    """The indexed corpora, from their sidecar manifests (chromadb is not imported)."""
    manifests = sorted(Path(cfg.home, "index").glob(f"*/{INDEX_MANIFEST}"))
    rows = []
    for path in manifests:
        try:
            m = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            rows.append(f"{path.parent.name} (unreadable manifest)")
            continue
        rows.append(
            f"{m.get('corpus', path.parent.name)} {m.get('version', '?')}: {m.get('chunks', '?')} chunks"
        )
    where = f"server {cfg.chroma_host}:{cfg.chroma_port}" if cfg.chroma_host else str(cfg.chroma_path)
    if not rows:
        return Check(
            "source index", False, f"no corpus indexed in {where}; build one with `kernelpro index build`"
        )
    present = cfg.chroma_host or Path(cfg.chroma_path).is_dir()
    detail = "; ".join(rows) + f" ({where}" + ("" if present else ": folder missing") + ")"
    return Check("source index", bool(present), detail)
