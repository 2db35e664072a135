"""What the harness's L2 flush costs the call it precedes (pipeline/timing.py L2Flusher).

A flush that fills a buffer of twice the L2 size leaves an L2 of dirty lines; the timed call's own reads
evict them, so its DRAM traffic is its bytes plus up to an L2 written back. A flush that reads the buffer
leaves clean lines only. Both must still empty L2 of the call's data: the third mode, no flush at all,
shows what a call that finds its operand cached would get.

For fp32 matrices from one that fits in L2 to 268 MB, each read once by cuBLAS's GEMV (`torch.mv`) and by
a full reduction (`a.sum()`), timed by the harness's own loop (CUDA events, fresh inputs, median of many)
under each flush mode, the whole set twice.

    python3 benchmarks/l2_flush.py [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline import timing

SHAPES = ((2048, 2048), (256, 131072), (8192, 8192))
OPS = {"mv": lambda a, v: torch.mv(a, v), "sum": lambda a, v: a.sum()}


class NoFlush:
    mode = "none"

    def __call__(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    flushers = [NoFlush(), timing.L2Flusher(dev, "writes"), timing.L2Flusher(dev, "clean")]
    print(
        f"{torch.cuda.get_device_name(dev)}, L2 {timing.l2_bytes(dev) / 2**20:.0f} MiB, torch {torch.__version__}"
    )
    rows = []
    for rep in range(args.repeat):
        for m, k in SHAPES:
            pool = [(torch.rand(m, k, device=dev) - 0.5, torch.rand(k, device=dev)) for _ in range(2)]
            nbytes = 4 * (m * k + k + m)
            for op, fn in OPS.items():
                for fl in flushers:
                    t = timing.time_cuda(
                        fn,
                        lambda call, p=pool: list(p[call % 2]),
                        trials=100,
                        budget_s=2.0,
                        warmup=5,
                        flusher=fl,
                    )
                    row = dict(repeat=rep, shape=f"{m}x{k}", op=op, flush=fl.mode, median_ms=t.median_ms,
                               tb_s=nbytes / (t.median_ms * 1e-3) / 1e12)  # fmt: skip
                    rows.append(row)
                    print(
                        f"{rep} {m}x{k:<7} {op:4} {fl.mode:7} {t.median_ms:.4f} ms  {row['tb_s']:.2f} TB/s",
                        flush=True,
                    )
            del pool
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
