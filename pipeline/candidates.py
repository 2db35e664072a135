"""Candidates on disk (a folder with kernel.cu and launcher.py) and the standalone export of one."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
from pathlib import Path
from types import ModuleType

from pipeline.types import Build, Candidate, Status

SOURCE_FILE = "kernel.cu"
LAUNCHER_FILE = "launcher.py"
RUNTIME_SOURCE = Path(__file__).with_name("runtime.py")  # read, not imported: it would pull in torch
FLAGS_FILE = "flags.txt"  # optional: extra nvcc flags, whitespace separated


class CandidateError(Exception):
    """A candidate folder that cannot be read; one line a user can act on."""


def candidate_key(source: str, launcher: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (source, launcher, "\0".join(flags)):
        h.update(part.encode())
        h.update(b"\x00\x01")
    return h.hexdigest()[:16]


def make_candidate(
    task_id: str, source: str, launcher: str, flags: tuple[str, ...] = (), **extra
) -> Candidate:
    return Candidate(
        key=candidate_key(source, launcher, flags),
        task_id=task_id,
        source=source,
        launcher=launcher,
        flags=flags,
        **extra,
    )


def load_candidate(folder: str | Path, task_id: str) -> Candidate:
    folder = Path(folder)
    if not folder.is_dir():
        raise CandidateError(f"candidate folder not found: {folder}")
    missing = [f for f in (SOURCE_FILE, LAUNCHER_FILE) if not (folder / f).is_file()]
    if missing:
        raise CandidateError(
            f"{folder}: missing {', '.join(missing)} (a candidate is kernel.cu + launcher.py)"
        )
    flags_file = folder / FLAGS_FILE
    flags = tuple(flags_file.read_text().split()) if flags_file.is_file() else ()
    return make_candidate(
        task_id, (folder / SOURCE_FILE).read_text(), (folder / LAUNCHER_FILE).read_text(), flags
    )


def save_candidate(candidate: Candidate, folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SOURCE_FILE).write_text(candidate.source)
    (folder / LAUNCHER_FILE).write_text(candidate.launcher)
    if candidate.flags:
        (folder / FLAGS_FILE).write_text(" ".join(candidate.flags) + "\n")
    return folder


def export_standalone(candidate: Candidate, build: Build, out_path: str | Path) -> Path:
    """One Python file that needs only torch, numpy and cupy: the runtime, the cubin inlined, the launcher."""
    if build.status != Status.OK or not build.cubin_path:
        raise CandidateError(f"candidate {candidate.key} has no successful build to export")
    cubin = Path(build.cubin_path).read_bytes()
    names = tuple(r.name for r in build.resources)
    runtime_src = _strip_future(RUNTIME_SOURCE.read_text())
    launcher_src = _strip_future(candidate.launcher)
    encoded = base64.b64encode(cubin).decode()
    wrapped = "\n".join(encoded[i : i + 100] for i in range(0, len(encoded), 100))
    text = f'''"""kernelpro export: candidate {candidate.key} for task {candidate.task_id} (arch {build.arch}).

Drop-in `ModelNew` with the same constructor and forward as the task's `Model`. Needs torch, numpy, cupy.
The CUDA source it was built from follows the launcher, as `CUDA_SOURCE`.
"""

from __future__ import annotations

# ---- runtime (pipeline/runtime.py) ----
{runtime_src}

# ---- compiled kernels ({len(cubin)} bytes of cubin for {build.arch}) ----
import base64 as _base64

_CUBIN = _base64.b64decode(
    """
{wrapped}
""".replace("\\n", "")
)
_kernels = None


def _load_kernels():
    global _kernels
    if _kernels is None:
        _kernels = Kernels(_CUBIN, {names!r})
    return _kernels


class _LazyKernels:
    """Loads the cubin on first use, so importing this file needs no GPU."""

    def __getattr__(self, name):
        return getattr(_load_kernels(), name)


kernels = _LazyKernels()

# ---- launcher ----
{launcher_src}

CUDA_SOURCE = {candidate.source!r}
'''
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(out_path)
    return out_path


def _strip_future(src: str) -> str:
    # __future__ imports are legal only at the top of a file; the export puts one there for all parts.
    return "\n".join(line for line in src.splitlines() if not line.startswith("from __future__ import"))


def load_export(path: str | Path, name: str = "kernelpro_export") -> ModuleType:
    """Import an exported file (it defines ModelNew, not a task's Model): for tools that run it in process."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise CandidateError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
