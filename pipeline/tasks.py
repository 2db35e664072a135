"""Load KernelBench-format task files and probe them without touching real data.

A task file defines `class Model(nn.Module)`, `get_inputs()` and `get_init_inputs()`; optionally `ATOL`,
`RTOL`, `NORM_TOL` (overrides of the per-dtype tolerances) and `get_alt_inputs()` (other shapes the same
model accepts, used to re-verify a suspiciously fast result). Probing builds the model and inputs on the
`meta` device, so absurd sizes cost nothing and FLOPs come from torch's flop counter without a GPU.
Probing imports torch, so the orchestrator runs it inside the worker process (see worker_jobs.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from pipeline.reasons import first_line
from pipeline.types import Task, TensorSpec

# Default tolerances per dtype: elementwise |out - ref| <= atol + rtol * |ref|, and a bound on the relative
# error norm. TF32 (10 mantissa bits) lands near 3e-4 in norm, so the fp32 bound of 1e-4 rejects it.
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float64": (1e-8, 1e-7, 1e-10),
    "float32": (1e-4, 1e-3, 1e-4),
    "bfloat16": (1e-2, 2e-2, 1e-2),
    "float16": (1e-3, 1e-2, 5e-3),
}
MAX_TASK_BYTES = 64 * 2**30  # inputs + parameters + outputs; beyond this a task cannot be run here


class TaskError(Exception):
    """A task file that cannot be used; the message is one line a user can act on."""


def load_module(path: str | Path) -> ModuleType:
    """Execute a task (or launcher) file as a fresh module of its own, isolated from other loads."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"task file not found: {path}")
    return _exec_module(path.read_text(), path)


def module_from_task(task: Task) -> ModuleType:
    """The task's module from the source recorded when it was probed: a confined worker need not be able to
    read the file (it may live in the user's home), and the source is exactly what was probed."""
    return _exec_module(task.source, Path(task.path))


def _exec_module(source: str, path: Path) -> ModuleType:
    name = "kernelpro_task_" + hashlib.sha256(str(path.resolve()).encode() + source.encode()).hexdigest()[:12]
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as e:
        raise TaskError(f"{path.name}: syntax error at line {e.lineno}: {e.msg}") from None
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    # Registered so that torch.compile and inspect can find the module's source and globals.
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except Exception as e:
        sys.modules.pop(name, None)
        raise TaskError(
            f"{path.name}: importing the task raised {type(e).__name__}: {first_line(e)}"
        ) from None
    for attr in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, attr):
            raise TaskError(
                f"{path.name}: missing `{attr}` (a task defines Model, get_inputs, get_init_inputs)"
            )
    return module


def probe(path: str | Path) -> Task:
    """Describe a task: shapes, dtypes, FLOPs, minimal bytes and tolerances, computed on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pipeline.forced_reads import ForcedReads

    path = Path(path)
    module = load_module(path)
    source = path.read_text()
    try:
        with torch.device("meta"):
            init_args = list(module.get_init_inputs())
    except Exception as e:
        raise TaskError(
            f"{path.name}: building the init inputs raised {type(e).__name__}: {first_line(e)}"
        ) from None
    try:
        inputs = meta_inputs(module)
    except Exception as e:
        raise TaskError(
            f"{path.name}: building the inputs raised {type(e).__name__}: {first_line(e)}"
        ) from None
    try:
        model = model_on_meta(module, init_args)
    except Exception as e:
        raise TaskError(
            f"{path.name}: building the model raised {type(e).__name__}: {first_line(e)}"
        ) from None
    if not inputs:
        raise TaskError(f"{path.name}: get_inputs() returned no inputs")
    in_specs = tuple(_spec(x) for x in inputs if isinstance(x, torch.Tensor))
    if not in_specs:
        raise TaskError(f"{path.name}: get_inputs() returned no tensors")
    param_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    in_bytes = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
    if in_bytes + param_bytes > MAX_TASK_BYTES:
        raise TaskError(
            f"{path.name}: inputs and parameters need {(in_bytes + param_bytes) / 2**30:.1f} GiB, "
            f"more than the {MAX_TASK_BYTES / 2**30:.0f} GiB a task may use"
        )
    counter = FlopCounterMode(display=False)
    reads = ForcedReads(inputs)  # on the meta run alone: the fallbacks below count one read of each input
    try:
        with counter, reads, torch.no_grad():
            out = model(*inputs)
        forced = reads.bytes
    except Exception as e:
        forced = 0
        # A forward that reads values (an MoE layer's tokens per expert) cannot run on meta inputs alone:
        # once more with its integer inputs real, on the CPU (they are small; the rest stays on meta).
        try:
            counter = FlopCounterMode(display=False)
            with counter, torch.no_grad():
                out = model(*valued_inputs(module))
        except Exception:
            # values computed from floating inputs (an MoE block's routing): only real data gives them, on a
            # GPU, or on the CPU with the large parameters' work skipped (cheap_values.py)
            counter = FlopCounterMode(display=False)
            out = _probe_on_gpu(module, init_args, counter)
            if out is None:
                counter = FlopCounterMode(display=False)
                out = _probe_cheap(module, init_args, counter)
            if out is None:
                raise TaskError(
                    f"{path.name}: the reference forward raised {type(e).__name__}: {first_line(e)}"
                    + (
                        ""
                        if torch.cuda.is_available()
                        else " (on the meta device, and on the CPU with its large parameters on meta; a GPU "
                        "would run it for real)"
                    )
                ) from None
    outs = out if isinstance(out, list | tuple) else (out,)
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise TaskError(f"{path.name}: forward must return a tensor or a tuple of tensors")
    out_specs = tuple(_spec(o) for o in outs)
    out_bytes = sum(o.numel() * o.element_size() for o in outs)
    floating = [s.dtype for s in in_specs if s.dtype in TOLERANCES] or [s.dtype for s in out_specs]
    dtype = floating[0] if floating else "float32"
    atol, rtol, norm_tol = TOLERANCES.get(dtype, TOLERANCES["float32"])
    return Task(
        id=path.stem,
        path=str(path.resolve()),
        source=source,
        source_hash=hashlib.sha256(source.encode()).hexdigest(),
        dtype=dtype,
        atol=float(getattr(module, "ATOL", atol)),
        rtol=float(getattr(module, "RTOL", rtol)),
        norm_tol=float(getattr(module, "NORM_TOL", norm_tol)),
        inputs=in_specs,
        outputs=out_specs,
        init_args=repr(init_args),
        flops=float(counter.get_total_flops()),
        min_bytes=int(in_bytes + param_bytes + out_bytes + forced),
        param_bytes=int(param_bytes),
    )


def _probe_cheap(module: ModuleType, init_args: list, counter: object) -> object | None:
    """The reference run on the CPU with real inputs and its large parameters on meta (FLOPs counted), or
    None if it cannot run so (a value it reads comes from a large parameter)."""
    import torch

    from pipeline import cheap_values

    try:
        with torch.random.fork_rng(devices=[]):
            model = cheap_values.model(module, init_args)
            inputs = cheap_values.inputs(module)
            with counter, torch.no_grad(), cheap_values.mode():  # type: ignore[attr-defined]
                out = model(*inputs)
    except Exception:
        return None
    outs = out if isinstance(out, list | tuple) else (out,)
    if not all(isinstance(o, torch.Tensor) for o in outs):
        return None
    return type(out)(o.to("meta") for o in outs) if isinstance(out, list | tuple) else out.to("meta")


def _probe_on_gpu(module: ModuleType, init_args: list, counter: object) -> object | None:
    """The reference run for real on the GPU (FLOPs counted), or None without a GPU or if it fails there."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        with torch.device("cuda"):
            model = module.Model(*init_args)
            inputs = list(module.get_inputs())
        with counter, torch.no_grad():  # type: ignore[attr-defined]
            out = model(*inputs)
        outs = out if isinstance(out, list | tuple) else (out,)
        return type(out)(o.to("meta") for o in outs) if isinstance(out, list | tuple) else out.to("meta")
    except Exception:
        return None
    finally:
        torch.cuda.empty_cache()


def meta_inputs(module: ModuleType) -> list:
    """get_inputs() on the meta device; inputs built from values (a sum of counts as a size) are built
    with their integer tensors real instead."""
    import torch

    try:
        with torch.device("meta"):
            return list(module.get_inputs())
    except Exception:
        return valued_inputs(module)


def valued_inputs(module: ModuleType) -> list:
    """get_inputs() with its integer and bool tensors real, on the CPU, and its floating tensors on meta:
    what a forward that reads values (routing, counts, indices) needs to run without the data's cost."""
    import torch

    with torch.device("cpu"):
        inputs = list(module.get_inputs())
    return [
        x.to("meta") if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) else x
        for x in inputs
    ]


def model_on_meta(module: ModuleType, init_args: list):
    """The model with meta parameters. A constructor that reads values (Swin's `x.item()` over a linspace)
    cannot run on meta: such a model is built on the CPU, its parameters real but small, and then moved."""
    import torch

    try:
        with torch.device("meta"):
            return module.Model(*init_args)
    except (RuntimeError, NotImplementedError):
        with torch.device("cpu"):
            return module.Model(*init_args).to("meta")


def _spec(t) -> TensorSpec:
    return TensorSpec(shape=tuple(int(s) for s in t.shape), dtype=str(t.dtype).removeprefix("torch."))
