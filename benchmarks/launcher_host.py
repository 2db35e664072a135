"""The host's share of a candidate's call: its launcher run with kernels that launch nothing (CPU only).

    python benchmarks/launcher_host.py TASK.py [TASK.py ...] [--calls 20] [--profile cumtime]

A launcher with hundreds of regions (level 3's SwinV2: 442 kernel launches a call) spends milliseconds in
Python before the GPU sees its kernels: a GPU faster than that waits on the host, and the harness's
events time the wait. This runs the expert's tuned launcher on the task's inputs on the CPU with a stand-in
`kernels` whose launches do nothing (cluster and residency queries answer 0, so the plainest paths run),
and prints the median host time of a call over `--calls` calls and the launches a call makes; with
`--profile`, cProfile's table of one call sorted by that column; with `--bytes`, each kernel's launches a
call and the megabytes of the tensors handed to it (read or written: a strided view's gathers show as
`kp_gather_*`; a GEMM's operands read through tensor maps are not counted). Timings are of this machine's
CPU: compare two forms on the same machine, in the same run or twice, before believing a difference. A
forward replayed from a CUDA graph (`kernels.graphed`) runs eagerly here: its launches are what is counted.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from expert_plans import tuned  # noqa: E402  (the tests' helper: the expert's tuned candidate)

from pipeline.tasks import load_module  # noqa: E402


class _NoLaunch:
    """A stand-in for the runtime's `kernels`: each launch counted, none made."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.launches = 0
        self.kinds: Counter[str] = Counter()  # kernel (its region's number dropped) -> launches
        self.bytes: Counter[str] = Counter()  # kernel -> bytes of the tensors handed to it

    def active_clusters(self, *args, **kwargs) -> int:
        return 0

    def active_blocks(self, *args, **kwargs) -> int:
        return 0

    def tensor_map(self, *args, **kwargs) -> None:
        return None

    def graphed(self, owner, forward, args):
        return forward(*args)

    def __getattr__(self, name: str):
        kind = re.sub(r"_\d+(?=_|$)", "", name)

        def launch(grid, block, args, shared_mem: int = 0, cooperative: bool = False) -> None:
            self.launches += 1
            self.kinds[kind] += 1
            self.bytes[kind] += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

        return launch


def host_ms(
    path: Path, calls: int, profile: str | None, kernels: _NoLaunch | None = None
) -> tuple[float, int]:
    """(the median host ms of a call, launches a call); `kernels` (a _NoLaunch) keeps the per-kernel counts of
    the timed calls."""
    cand = tuned(path)  # LookupError when the expert proposes none
    kernels = kernels or _NoLaunch()
    namespace = {"__name__": "kernelpro_host", "kernels": kernels}
    exec(compile(cand.launcher, "<launcher>", "exec"), namespace)
    module = load_module(path)
    torch.manual_seed(0)
    model = namespace["ModelNew"](*module.get_init_inputs())
    model.sms = 132
    inputs = module.get_inputs()
    times = []
    with torch.no_grad():
        model(*inputs)  # the first call's one-off work (the SM count, lazy state) kept out
        kernels.reset()
        for _ in range(calls):
            t = time.perf_counter()
            model(*inputs)
            times.append(time.perf_counter() - t)
        launches = kernels.launches // calls
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            model(*inputs)
            prof.disable()
            pstats.Stats(prof).sort_stats(profile).print_stats(25)
    return sorted(times)[calls // 2] * 1e3, launches


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tasks", type=Path, nargs="+")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--profile", default=None, help="a pstats sort key (cumtime, tottime) to print a profile")
    ap.add_argument("--bytes", action="store_true", help="each kernel's launches and tensor megabytes a call")
    args = ap.parse_args()
    for path in args.tasks:
        kernels = _NoLaunch()
        try:
            ms, launches = host_ms(path, args.calls, args.profile, kernels)
        except LookupError as e:
            print(f"{path.stem}: {e}", flush=True)
            continue
        print(f"{path.stem}: {ms:.2f} ms of host time a call, {launches} launches", flush=True)
        if args.bytes:
            for kind, b in kernels.bytes.most_common():
                print(f"  {b / args.calls / 1e6:9.1f} MB  {kernels.kinds[kind] // args.calls:4d}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
