"""Measured ceilings of this GPU (copy bandwidth; fp32, tf32 and bf16 matmul rates) and roofline floors.

The worker measures (`measure_ceilings`); the orchestrator caches the result per GPU under
`<home>/calibration/` and derives each task's floor from it (`floor_ms`), with no GPU needed.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.types import Task


@dataclass(frozen=True)
class Ceilings:
    gpu: str
    copy_bytes_per_s: float  # device-to-device copy, bytes read + bytes written
    fp32_flops: float  # matmul with TF32 off
    tf32_flops: float
    bf16_flops: float
    environment: dict[str, str]

    def peak_flops(self, dtype: str) -> float:
        # The fastest honest route for the dtype: fp32 work may use 3xTF32 on tensor cores and stay accurate,
        # so its floor uses the TF32 rate (a floor must never exceed what a kernel can reach).
        if dtype in ("bfloat16", "float16"):
            return self.bf16_flops
        if dtype == "float32":
            return max(self.tf32_flops, self.fp32_flops)
        return self.fp32_flops


def floor_ms(task: Task, ceilings: Ceilings) -> float:
    compute = task.flops / ceilings.peak_flops(task.dtype)
    memory = task.min_bytes / ceilings.copy_bytes_per_s
    return max(compute, memory) * 1e3


def cache_path(home: Path, gpu_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", gpu_name).strip("-") or "gpu"
    return home / "calibration" / f"{slug}.json"


def load_cached(home: Path, gpu_name: str) -> Ceilings | None:
    path = cache_path(home, gpu_name)
    if not path.is_file():
        return None
    try:
        return Ceilings(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None  # an unreadable cache is measured again, not trusted


def save(home: Path, ceilings: Ceilings) -> Path:
    path = cache_path(home, ceilings.gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(ceilings), indent=2))
    tmp.replace(path)
    return path


def measure_ceilings(environment: dict[str, str]) -> Ceilings:
    """Run in the worker: a 2 GiB copy, and 8192^3 matmuls in fp32, tf32 and bf16, each a median of many."""
    import torch

    from pipeline.timing import time_cuda

    dev = torch.device("cuda", torch.cuda.current_device())
    n = 2**29  # 2 GiB of fp32
    src = torch.rand(n, device=dev)
    dst = torch.empty_like(src)
    t = time_cuda(lambda d=dst, s=src: d.copy_(s), _no_inputs, trials=30, budget_s=2.0, warmup=3)
    copy_bps = 2 * src.numel() * src.element_size() / (t.median_ms * 1e-3)
    del src, dst
    size = 8192
    rates = {}
    for name, dtype, tf32 in (
        ("fp32", torch.float32, False),
        ("tf32", torch.float32, True),
        ("bf16", torch.bfloat16, False),
    ):
        a = torch.randn(size, size, device=dev, dtype=dtype)
        b = torch.randn(size, size, device=dev, dtype=dtype)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            t = time_cuda(lambda a=a, b=b: a @ b, _no_inputs, trials=20, budget_s=3.0, warmup=3)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        rates[name] = 2 * size**3 / (t.median_ms * 1e-3)
        del a, b
    return Ceilings(
        gpu=torch.cuda.get_device_name(dev),
        copy_bytes_per_s=copy_bps,
        fp32_flops=rates["fp32"],
        tf32_flops=rates["tf32"],
        bf16_flops=rates["bf16"],
        environment=environment,
    )


def _no_inputs(_: int) -> list:
    return []
