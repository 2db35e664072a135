"""The reference-anchored tolerance rule, applied chunk by chunk (docs/harness.md, "Tolerance").

A candidate is compared with the float64 reference. Fixed tolerances alone are wrong in both directions: an
fp32 GEMM with K = 4096 is off by ~1e-3 in eager itself (the reference would fail its own check), while
a loose bound would let TF32 through. So the rule is anchored on how far eager, in the task's dtype, is from
float64 on the same inputs (E = max |eager - ref64|, e = ||eager - ref64|| / ||ref64||):

    elementwise  |out - ref64| <= atol + rtol * |ref64| + K * E
    norm         ||out - ref64|| <= max(norm_tol, K * e) * ||ref64|| + atol * sqrt(min(n, 16))

with K = REF_ERROR_MULTIPLE. Eager passes by construction; a different honest summation order lands within a
small multiple of eager's error; TF32 (10 mantissa bits) or fp16 stand-ins for fp32 are orders of magnitude
further off and fail.

Everything is accumulated over chunks of at most CHUNK elements, so comparing a 7.5 GB output never
materialises float64 copies of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from pipeline import fused_stats

REF_ERROR_MULTIPLE = 4.0
NEAR_CONSTANT = 1e-3  # output spread below this fraction of the reference's spread is "near-constant"
NORM_FLOOR_ELEMENTS = 16  # the norm rule allows this many elements' worth of atol (a near-zero output)
CHUNK = 1 << 24  # elements per comparison step: 128 MB per float64 temporary


@dataclass
class RefError:
    """How far eager (the task's dtype) is from the float64 reference, for one output."""

    abs_max: float = 0.0
    rel_norm: float = 0.0


def _std(n: float, total: float, total_sq: float) -> float:
    if n < 2:
        return 0.0
    mean = total / n
    return math.sqrt(max(total_sq / n - mean * mean, 0.0) * n / (n - 1))


# Per-chunk figures, kept on the device and combined once at the end (a host sync per chunk would make a
# multi-GB comparison launch-bound): summed columns, then the columns combined by max.
_SUMMED = ("wrong", "unwritten", "bad_special", "over_base", "diff_sq", "ref_sq", "out_n", "out_sum",
           "out_sq", "ref_n", "ref_sum")  # fmt: skip
_MAXED = ("max_excess", "max_abs")


@dataclass
class OutputStats:
    """A candidate output against a reference, accumulated over chunks."""

    numel: int = 0
    integer: bool = False
    _chunks: list[torch.Tensor] = field(default_factory=list)
    _totals: dict[str, float] | None = None

    def add(
        self, o: torch.Tensor, r: torch.Tensor, atol: float, rtol: float, alt: torch.Tensor | None = None
    ) -> None:
        """One chunk: `o` the candidate's, `r` the reference's, `alt` another acceptable reference for integer
        outputs (eager's own, where float64 may break a near-tie differently)."""
        self.numel += o.numel()
        self._totals = None
        if o.is_cuda and (one_pass := fused_stats.figures(o, r, atol, rtol)) is not None:
            self._chunks.append(one_pass)  # the same figures in one kernel (fused_stats.py says why)
            return
        zero = torch.zeros((), dtype=torch.float64, device=r.device)
        if not o.is_floating_point():
            self.integer = True
            wrong = o != r.to(o.dtype)
            if alt is not None:
                wrong &= o != alt.to(o.dtype)
            col = {"wrong": wrong.sum(dtype=torch.float64)}
        else:
            od, rd = o.double(), r.double()
            ref_finite = torch.isfinite(rd)
            out_finite = torch.isfinite(od)
            both = ref_finite & out_finite
            diff = torch.where(both, (od - rd).abs(), 0.0)
            excess = diff - (atol + rtol * torch.where(both, rd.abs(), 0.0))
            of = torch.where(out_finite, od, 0.0)
            rf = torch.where(ref_finite, rd, 0.0)
            col = {
                "unwritten": (torch.isnan(od) & ref_finite).sum(dtype=torch.float64),
                "bad_special": (out_finite != ref_finite).sum(dtype=torch.float64),
                "over_base": (excess > 0).sum(dtype=torch.float64),
                "diff_sq": (diff * diff).sum(),
                "ref_sq": (rf * rf).sum(),
                "out_n": out_finite.sum(dtype=torch.float64),
                "out_sum": of.sum(),
                "out_sq": (of * of).sum(),
                "ref_n": ref_finite.sum(dtype=torch.float64),
                "ref_sum": rf.sum(),
                "max_excess": excess.max() if excess.numel() else zero,
                "max_abs": diff.max() if diff.numel() else zero,
            }
        self._chunks.append(torch.stack([col.get(k, zero) for k in (*_SUMMED, *_MAXED)]))

    def _settle(self) -> dict[str, float]:
        if self._totals is None:
            if self._chunks:
                stacked = torch.stack([c.to(self._chunks[0].device) for c in self._chunks])
                summed = stacked[:, : len(_SUMMED)].sum(0).tolist()
                maxed = stacked[:, len(_SUMMED) :].amax(0).tolist()
                self._chunks = [torch.tensor(summed + maxed, dtype=torch.float64)]
            else:
                summed, maxed = [0.0] * len(_SUMMED), [0.0] * len(_MAXED)
            self._totals = dict(zip((*_SUMMED, *_MAXED), (*summed, *maxed), strict=True))
        return self._totals

    @property
    def wrong(self) -> int:  # integer outputs: elements equal to neither reference
        return int(self._settle()["wrong"])

    @property
    def unwritten(self) -> int:  # NaN where the reference is finite: the poison survived
        return int(self._settle()["unwritten"])

    @property
    def bad_special(self) -> int:  # finite where the reference is not, or the other way round
        return int(self._settle()["bad_special"])

    @property
    def over_base(self) -> int:  # elements outside atol + rtol * |ref|
        return int(self._settle()["over_base"])

    @property
    def max_excess(self) -> float:  # the most an element exceeds atol + rtol * |ref| by
        return self._settle()["max_excess"]

    @property
    def max_abs(self) -> float:
        return self._settle()["max_abs"]

    @property
    def out_std(self) -> float:
        t = self._settle()
        return _std(t["out_n"], t["out_sum"], t["out_sq"])

    @property
    def ref_std(self) -> float:
        t = self._settle()
        return _std(t["ref_n"], t["ref_sum"], t["ref_sq"])

    @property
    def rel_error(self) -> float:
        t = self._settle()
        if t["ref_sq"] > 0:
            return math.sqrt(t["diff_sq"] / t["ref_sq"])
        return 0.0 if self.max_abs == 0 else math.inf

    def reasons(
        self, j: int, atol: float, rtol: float, norm_tol: float, anchor: RefError, multiple: float
    ) -> list[str]:
        """Why this output fails the anchored rule (empty when it passes)."""
        if self.integer:
            return (
                [f"mismatch: output {j} differs in {self.wrong} of {self.numel} elements"]
                if self.wrong
                else []
            )
        if self.unwritten:
            return [
                f"unwritten_output: output {j} has {self.unwritten} of {self.numel} elements never written "
                "(NaN poison)"
            ]
        reasons = []
        if self.numel > 16:
            ref_spread, out_spread = self.ref_std, self.out_std
            if ref_spread > 0 and out_spread < NEAR_CONSTANT * ref_spread:
                reasons.append(
                    f"near_constant: output {j} spread {out_spread:.3g} against the reference's {ref_spread:.3g}"
                )
        slack = multiple * anchor.abs_max
        if self.bad_special or self.max_excess > slack:
            beyond = f" beyond {multiple:g}x eager's own error of {anchor.abs_max:.3g}" if slack else ""
            reasons.append(
                f"mismatch: output {j}: {self.over_base + self.bad_special} of {self.numel} elements outside "
                f"atol={atol:g} rtol={rtol:g} (max abs error {self.max_abs:.3g}, worst excess "
                f"{max(self.max_excess, 0.0):.3g}{beyond})"
            )
        bound = max(norm_tol, multiple * anchor.rel_norm)
        t = self._settle()
        # A few elements' worth of atol in the norm: an output of a handful of values can be near zero
        # all at once (a sum that cancels, drawn afresh for a timed call), and an honest error then makes a
        # large ratio. For a large output it is nothing beside bound * ||ref||.
        floor = atol * math.sqrt(min(self.numel, NORM_FLOOR_ELEMENTS))
        if math.sqrt(t["diff_sq"]) > bound * math.sqrt(t["ref_sq"]) + floor:
            reasons.append(
                f"mismatch: output {j}: relative error norm {self.rel_error:.3g} above {bound:.3g} "
                f"(plus {floor:.3g})"
            )
        return reasons


def chunks(t: torch.Tensor) -> Iterator[tuple[int, int]]:
    n = t.numel()
    for start in range(0, n, CHUNK):
        yield start, min(start + CHUNK, n)


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def structure_reasons(outputs: list, expected: list) -> list[str]:
    """Number, type, shape, dtype and device of the outputs against the reference's."""
    reasons = []
    if len(outputs) != len(expected):
        reasons.append(f"shape_mismatch: {len(outputs)} outputs, the reference returns {len(expected)}")
    for j, (o, e) in enumerate(zip(outputs, expected, strict=False)):
        if not isinstance(o, torch.Tensor):
            reasons.append(f"shape_mismatch: output {j} is a {type(o).__name__}, not a tensor")
        elif o.shape != e.shape:
            reasons.append(
                f"shape_mismatch: output {j} has shape {tuple(o.shape)}, expected {tuple(e.shape)}"
            )
        elif o.dtype != e.dtype:
            reasons.append(f"dtype_mismatch: output {j} is {o.dtype}, expected {e.dtype}")
        elif o.device != e.device:
            reasons.append(f"device_mismatch: output {j} is on {o.device}, expected {e.device}")
    return reasons


def reference_error(native: torch.Tensor, ref: torch.Tensor) -> RefError:
    """E and e of the rule above, for one output (zero for integer outputs)."""
    if not native.is_floating_point():
        return RefError()
    stats = OutputStats()
    n, r = flat(native), flat(ref)
    for a, b in chunks(n):
        stats.add(n[a:b], r[a:b], 0.0, 0.0)
    return RefError(abs_max=stats.max_abs, rel_norm=stats.rel_error)


def compare_output(o: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, alt=None) -> OutputStats:
    """A whole output against a whole reference (both resident), chunk by chunk."""
    stats = OutputStats()
    of, rf = flat(o), flat(ref)
    af = flat(alt) if alt is not None else None
    for a, b in chunks(of):
        stats.add(of[a:b], rf[a:b], atol, rtol, af[a:b] if af is not None else None)
    return stats
