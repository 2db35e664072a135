"""Can fp32 GEMMs run as three fp16 products at fp32 accuracy (issue 14)? A probe with library GEMMs.

Each fp32 operand is scaled by a power of two per row of A and per column of B (exact; the largest
magnitude of each lands in [2^14, 2^15), inside fp16's range), then cut into hi = fp16(x) and
lo = fp16(x - hi): 11 + 11 significant bits, as tf32's hi and lo, but each fp16 MMA runs at twice tf32's rate. The product
a_hi.b_hi + a_hi.b_lo + a_lo.b_hi is one fp16 GEMM over K' = 3K ([A_hi | A_hi | A_lo] against
[B_hi; B_lo; B_hi]), accumulated in fp32 and unscaled by 2^(e_row + f_col): 1.5 tf32 passes of tensor-core
work where 3xTF32 takes 3.

cuBLAS's fp16 GEMM with fp32 output stands in for our kernel here, in two forms:
- whole: one GEMM over all of K' (the tensor cores' accumulator holds every product);
- promoted: K cut in chunks of 128, one fp32 result a chunk (a batched GEMM), summed in fp32: what a
  kernel that adds its accumulator to fp32 registers every 128 of K gets (the 3xTF32 kernel's promotion).

Each is judged by the harness's anchored fp32 rule against float64, beside cuBLAS fp32 (eager) and timed
with CUDA events (L2 flushed, median of 20) at 4096^3: the GEMM alone and with the split done by PyTorch.

    python3 benchmarks/fp16x3_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline import tolerance
from pipeline.tasks import TOLERANCES

CHUNK = 128


def scale_exp(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Per row (dim=1) or column (dim=0): e with max|t| * 2^-e in [2^14, 2^15) (0 for a zero line)."""
    m = t.abs().amax(dim=dim, keepdim=True)
    _, e = torch.frexp(m)  # m = f * 2^e, f in [0.5, 1)
    return torch.where(m > 0, e - 15, torch.zeros_like(e)).to(torch.float32)


def cut(t: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = t * torch.exp2(-e)
    hi = s.half()
    return hi, (s - hi.float()).half()


def mm16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp16 inputs, fp32 accumulation and output (cuBLAS)."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except TypeError:  # an older torch: the batched form has it or neither does
        return torch.bmm(a[None], b[None], out_dtype=torch.float32)[0]


def bmm16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b, out_dtype=torch.float32)


def fp16x3(a: torch.Tensor, b: torch.Tensor, promoted: bool) -> torch.Tensor:
    ea, eb = scale_exp(a, 1), scale_exp(b, 0)
    (ah, al), (bh, bl) = cut(a, ea), cut(b, eb)
    if not promoted:
        acc = mm16(torch.cat([ah, ah, al], 1), torch.cat([bh, bl, bh], 0))
    else:
        m, k = a.shape
        n = b.shape[1]
        pad = -k % CHUNK
        if pad:
            ah, al = (torch.nn.functional.pad(t, (0, pad)) for t in (ah, al))
            bh, bl = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (bh, bl))
        c = (k + pad) // CHUNK

        def chunks_a(t: torch.Tensor) -> torch.Tensor:
            return t.view(m, c, CHUNK).transpose(0, 1)

        def chunks_b(t: torch.Tensor) -> torch.Tensor:
            return t.view(c, CHUNK, n)

        a3 = torch.cat([chunks_a(ah), chunks_a(ah), chunks_a(al)], 2)
        b3 = torch.cat([chunks_b(bh), chunks_b(bl), chunks_b(bh)], 1)
        acc = bmm16(a3, b3).sum(0)  # fp32 sums of the chunks, as a promoting kernel adds them
    return acc * torch.exp2(ea) * torch.exp2(eb)


def cases(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s: int) -> torch.Tensor:
        return torch.rand(*s, generator=g, device="cuda")

    def rn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g, device="cuda")

    w = (r(1024, 8192) * 2 - 1) / 8192**0.5
    outlier = rn(1024, 4096)
    outlier[::97, ::89] *= 1e4  # a few large entries a row: the per-row scale must not drown the rest
    return {
        "rand 1024x4096x1024": (r(1024, 4096), r(4096, 1024)),
        "randn 512x4096x512": (rn(512, 4096), rn(4096, 512)),
        "randn 256x16384x256": (rn(256, 16384), rn(16384, 256)),
        "linear 1024x8192x1024": (r(1024, 8192), w.t().contiguous()),
        "randn, outliers 1e4, 1024x4096x1024": (outlier, rn(4096, 1024)),
        "randn 2048x65536x256 (long K)": (rn(2048, 65536), rn(65536, 256)),
    }


def timed(fn, flush: torch.Tensor, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    atol, rtol, norm_tol = TOLERANCES["float32"]
    rows: list[dict] = []
    for case, (a, b) in cases(0).items():
        ref = a.double() @ b.double()
        eager = a @ b
        anchor = tolerance.reference_error(eager, ref)
        for form, out in (("eager fp32", eager), ("fp16x3 whole", fp16x3(a, b, False)),
                          ("fp16x3 promoted", fp16x3(a, b, True))):  # fmt: skip
            stats = tolerance.compare_output(out, ref, atol, rtol)
            why = stats.reasons(0, atol, rtol, norm_tol, anchor, tolerance.REF_ERROR_MULTIPLE)
            rows.append({"case": case, "form": form, "max_abs": stats.max_abs, "rel_norm": stats.rel_error,
                         "eager_max_abs": anchor.abs_max, "passes": not why, "why": why[:1]})  # fmt: skip
            print(f"{case:36s} {form:16s} max abs {stats.max_abs:9.3g} (eager {anchor.abs_max:9.3g}) rel norm"
                  f" {stats.rel_error:9.3g}  {'OK' if not why else 'FAIL: ' + why[0][:80]}", flush=True)  # fmt: skip
        del ref
    n = 4096
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    ea, eb = scale_exp(a, 1), scale_exp(b, 0)
    (ah, al), (bh, bl) = cut(a, ea), cut(b, eb)
    a3, b3 = torch.cat([ah, ah, al], 1), torch.cat([bh, bl, bh], 0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    times = {
        "cuBLAS fp32 4096^3": timed(lambda: a @ b, flush),
        "cuBLAS fp16 4096x12288x4096, fp32 out (the three products)": timed(lambda: mm16(a3, b3), flush),
        "the same with the split in PyTorch ops": timed(lambda: fp16x3(a, b, False), flush),
        "cuBLAS fp16 4096^3, fp32 out": timed(lambda: mm16(ah, bh), flush),
    }
    for k, v in times.items():
        print(f"{k:62s} {v:.4f} ms", flush=True)
    print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "rows": rows, "times_ms": times}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
