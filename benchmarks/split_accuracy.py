"""Which operand split reaches fp32 accuracy on the tensor cores (issue 14: 3xTF32 against bf16x3 / bf16x6)?

Each split is emulated exactly: the operands are cut as the hardware reads them (tf32: the low 13 mantissa
bits ignored; bf16: rounded to nearest), the partial products are formed and summed in float64, and only the
result is rounded to fp32. That is the best any kernel with the split can do (a real one also rounds its
accumulator), so a split that fails here fails on the GPU too. Each result goes through the harness's own
anchored rule (pipeline/tolerance.py) against a float64 reference, anchored on eager fp32 on this machine.

The cost column counts tensor-core passes in tf32 units (a bf16 WGMMA runs at twice the tf32 rate).

    python3 benchmarks/split_accuracy.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline import tolerance
from pipeline.tasks import TOLERANCES

Parts = list[torch.Tensor]


def tf32(x: torch.Tensor) -> torch.Tensor:
    """What a tf32 MMA reads of an fp32 value: its low 13 mantissa bits cleared."""
    return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def fp16_pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x and y as fp16 MMA operands of one product: x scaled by 2^-e and y by 2^e (the product unchanged, so
    it shares the fp32 accumulator), e balancing their largest magnitudes inside fp16's narrow range, then
    rounded to nearest (subnormals as the hardware keeps them)."""
    mx, my = x.abs().max().item(), y.abs().max().item()
    e = round((math.log2(mx) - math.log2(my)) / 2) if mx > 0 and my > 0 else 0
    return (x * 2.0**-e).half().float() * 2.0**e, (y * 2.0**e).half().float() * 2.0**-e


def cut(x: torch.Tensor, read: Callable[[torch.Tensor], torch.Tensor], n: int) -> Parts:
    """x as n parts, each what the MMA reads of the remainder so far (remainders are exact in fp32)."""
    parts, rest = [], x
    for _ in range(n):
        p = read(rest)
        parts.append(p)
        rest = rest - p
    return parts


# name -> (how an operand is read, parts per operand, the (i, j) products summed, cost in tf32 passes)
SPLITS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int, list[tuple[int, int]], float]] = {
    "tf32 (1 pass)": (tf32, 1, [(0, 0)], 1.0),
    "3xTF32": (tf32, 2, [(0, 0), (0, 1), (1, 0)], 3.0),
    "bf16x3": (bf16, 2, [(0, 0), (0, 1), (1, 0)], 1.5),
    "bf16x6": (bf16, 3, [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0)], 3.0),
}
# tf32's hi.hi product, and the two cross products on 16-bit MMAs at twice the rate (1 + 2 x 0.5 passes): the
# cross products are 2^-11 of the result, so a 16-bit operand's rounding there costs what tf32's cut of lo does
MIXED: dict[str, tuple[str, float]] = {"tf32 + bf16 cross": ("bf16", 2.0), "tf32 + fp16 cross": ("fp16", 2.0)}


def emulate(a: torch.Tensor, b: torch.Tensor, split: str) -> torch.Tensor:
    if split in MIXED:
        (ah, al), (bh, bl) = cut(a, tf32, 2), cut(b, tf32, 2)
        acc = ah.double() @ bh.double()
        for x, y in ((ah, bl), (al, bh)):
            x, y = fp16_pair(x, y) if MIXED[split][0] == "fp16" else (bf16(x), bf16(y))
            acc += x.double() @ y.double()
        return acc.float()
    read, n, pairs, _ = SPLITS[split]
    pa, pb = cut(a, read, n), cut(b, read, n)
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    for i, j in pairs:
        acc += pa[i].double() @ pb[j].double()
    return acc.float()


def cases(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Operands of the kinds KernelBench's GEMM tasks draw: rand @ rand (all positive: no cancellation),
    randn @ randn, and a linear layer (rand inputs, nn.Linear's uniform +-1/sqrt(K) weights)."""
    g = torch.Generator().manual_seed(seed)

    def lin(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = (torch.rand(n, k, generator=g) * 2 - 1) / k**0.5
        return torch.rand(m, k, generator=g), w.t().contiguous()

    return {
        "rand 1024x4096x1024": (torch.rand(1024, 4096, generator=g), torch.rand(4096, 1024, generator=g)),
        "randn 512x4096x512": (torch.randn(512, 4096, generator=g), torch.randn(4096, 512, generator=g)),
        "randn 256x16384x256": (torch.randn(256, 16384, generator=g), torch.randn(16384, 256, generator=g)),
        "linear 1024x8192x1024": lin(1024, 8192, 1024),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the rows as JSON here too")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    atol, rtol, norm_tol = TOLERANCES["float32"]
    rows = []
    for case, (a, b) in cases(args.seed).items():
        ref = a.double() @ b.double()
        anchor = tolerance.reference_error(a @ b, ref)
        for split in [*SPLITS, *MIXED]:
            cost = SPLITS[split][3] if split in SPLITS else MIXED[split][1]
            stats = tolerance.compare_output(emulate(a, b, split), ref, atol, rtol)
            why = stats.reasons(0, atol, rtol, norm_tol, anchor, tolerance.REF_ERROR_MULTIPLE)
            row = {
                "case": case, "split": split, "cost_tf32_passes": cost,
                "max_abs": stats.max_abs, "rel_norm": stats.rel_error, "eager_max_abs": anchor.abs_max,
                "eager_rel_norm": anchor.rel_norm, "elements_outside_base": stats.over_base,
                "passes": not why, "why": why,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{case:24s} {split:14s} cost {row['cost_tf32_passes']:3.1f}  max abs {stats.max_abs:9.3g}"
                f" (eager {anchor.abs_max:9.3g})  rel norm {stats.rel_error:9.3g}"
                f" (eager {anchor.rel_norm:9.3g})  {'OK' if not why else 'FAIL: ' + why[0][:90]}",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
