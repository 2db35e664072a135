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

# Bumped when the measurement changes, so a cache written by an older one is measured again. 2: the copy
# ceiling is the best of a memcpy and a vectorised kernel at two sizes, after the clocks are up (version 1
# timed one cold memcpy first thing and read 3.8 TB/s, below what eager's own elementwise kernels reach).
# 3: a third route, a plain 16-byte-a-thread stream, which moved 4.32 TB/s where torch's kernels moved
# 4.20-4.27 (the expert's element-wise kernels measured 100.5% of the version-2 floor). 4: each call timed
# after the clean L2 flush (timing.L2Flusher), which no longer leaves dirty lines for the copy to write back.
VERSION = 4

# One 16-byte vector a thread, a block per 256 of them: the fastest form of a stream measured on the H200
# (benchmarks/ew_variants.py), ahead of more vectors in flight a thread and of persistent grids.
_STREAM = r"""extern "C" __global__ void kp_stream(const float4* __restrict__ x, float4* __restrict__ y, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}"""


@dataclass(frozen=True)
class Ceilings:
    gpu: str
    copy_bytes_per_s: float  # device-to-device copy, bytes read + bytes written
    fp32_flops: float  # matmul with TF32 off
    tf32_flops: float
    bf16_flops: float
    environment: dict[str, str]
    version: int = 0  # the measurement's VERSION; 0: written before versions existed
    # NVML's utilization of the GPU (percent) while this process sat idle just before and after the
    # measurement: another process's work. None: not read (no NVML, or written before it was).
    busy_percent: float | None = None

    def peak_flops(self, dtype: str) -> float:
        # The fastest honest route for the dtype: fp32 work may use 3xTF32 on tensor cores and stay accurate,
        # so its floor uses the TF32 rate (a floor must never exceed what a kernel can reach).
        if dtype in ("bfloat16", "float16"):
            return self.bf16_flops
        if dtype == "float32":
            return max(self.tf32_flops, self.fp32_flops)
        return self.fp32_flops


# Another process's utilization above which a calibration is not believed: its rates would be low, every floor
# derived from them high, and honest kernels would read as faster than their floor (too_fast). A whole GPU
# suite on 12 pytest workers sharing one H100 did exactly that (docs/benchmarks.md, 2026-12-06).
BUSY_LIMIT = 5.0


def untrusted(c: Ceilings) -> str | None:
    """Why these ceilings must not be cached or used for floors, or None."""
    if c.busy_percent is not None and c.busy_percent > BUSY_LIMIT:
        return (
            f"calibration not kept: the GPU was {c.busy_percent:.0f}% busy with another process's work while "
            f"it was measured (above {BUSY_LIMIT:g}%), so its ceilings read low and every roofline floor high; "
            "no floor until a calibration on a free GPU (`kernelpro calibrate`)"
        )
    return None


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
        cached = Ceilings(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None  # an unreadable cache is measured again, not trusted
    return cached if cached.version == VERSION else None


def save(home: Path, ceilings: Ceilings) -> Path:
    path = cache_path(home, ceilings.gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(ceilings), indent=2))
    tmp.replace(path)
    return path


def measure_ceilings(environment: dict[str, str]) -> Ceilings:
    """Run in the worker: 8192^3 matmuls in fp32, tf32 and bf16, then the copy bandwidth, each a median of
    many. The matmuls go first: they bring the clocks up, and a copy timed on a cold GPU reads ~10% low."""
    import torch

    from pipeline.timing import time_cuda

    dev = torch.device("cuda", torch.cuda.current_device())
    busy = [_others_busy(dev)]
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
    copy = _copy_bandwidth(dev)
    busy.append(_others_busy(dev))
    known = [b for b in busy if b is not None]
    return Ceilings(
        gpu=torch.cuda.get_device_name(dev),
        copy_bytes_per_s=copy,
        fp32_flops=rates["fp32"],
        tf32_flops=rates["tf32"],
        bf16_flops=rates["bf16"],
        environment=environment,
        version=VERSION,
        busy_percent=max(known) if known else None,
    )


def _others_busy(dev) -> float | None:
    """NVML's GPU utilization after this process has been idle for longer than NVML's sample period (at most
    a second): what other processes run. None where NVML cannot say."""
    import time

    import torch

    torch.cuda.synchronize(dev)
    time.sleep(1.2)
    try:
        import pynvml

        from pipeline.energy import EnergyUnavailable, nvml_handle
    except ImportError:
        return None
    try:
        return float(pynvml.nvmlDeviceGetUtilizationRates(nvml_handle(dev)).gpu)
    except (EnergyUnavailable, pynvml.NVMLError):
        return None


def _copy_bandwidth(dev) -> float:
    """Bytes read + written per second: the best of a memcpy and a vectorised elementwise kernel (which
    moves more than the copy engine path on Hopper), over 1 GiB and 4 GiB buffers as memory allows. A floor
    must never sit above what a kernel reaches, so the best route sets it."""
    import torch

    from pipeline.timing import time_cuda

    free, _ = torch.cuda.mem_get_info(dev)
    fits = int(0.8 * free) // 8  # fp32 elements a buffer when source and copy fit in 80% of what is free
    # 1 GiB and 4 GiB a buffer; on a GPU with less free, the largest whole MiB that fits (never none)
    sizes = [n for n in (2**28, 2**30) if n <= fits] or [max(2**18, fits // 2**18 * 2**18)]
    best = 0.0
    for n in sizes:
        src = torch.rand(n, device=dev)
        dst = torch.empty_like(src)
        routes = [lambda d=dst, s=src: d.copy_(s), lambda d=dst, s=src: torch.mul(s, 1.0, out=d)]
        if stream := _stream_copy(n):
            routes.append(lambda d=dst, s=src: stream(d, s))
        for fn in routes:
            t = time_cuda(fn, _no_inputs, trials=20, budget_s=2.0, warmup=3)
            best = max(best, 2 * 4 * n / (t.median_ms * 1e-3))
        del src, dst
    return best


def _stream_copy(n: int):
    """`run(dst, src)` copying n floats (a multiple of 4) by the _STREAM kernel, or None without CuPy."""
    try:
        import cupy
    except ImportError:
        return None
    kernel = cupy.RawKernel(_STREAM, "kp_stream")
    vecs = n // 4

    def run(dst, src) -> None:  # CuPy launches on the legacy default stream, the one torch times on
        kernel(
            ((vecs + 255) // 256,),
            (256,),
            (cupy.uint64(src.data_ptr()), cupy.uint64(dst.data_ptr()), cupy.int64(vecs)),
        )

    return run


def _no_inputs(_: int) -> list:
    return []
