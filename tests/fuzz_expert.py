"""Random reference models through the expert, their kernels run by the CPU emulator: a hunt for the tasks
no suite holds (kernelpro is judged on operators, shapes and chains it has never seen).

Each case is a small model drawn from a seed: one to four steps over one or two inputs of an odd shape, in
fp32, fp16 or bf16 (element-wise maps, broadcasts against parameters and inputs, reductions and extrema over
any dim, softmax, the norms, scans, flips, pools, transposes and reshapes, concatenations, linear layers and
matmuls, convolutions and their transposes, masks, attention, losses). The expert says whether it writes
the task; where it does, its plain and tuned candidates, and a sample of the edits of the tuned one, run in
the emulator against PyTorch (WGMMA kernels are not emulated), compared as the harness compares. An outcome
is `refused` (one line why), `ok`, or a bug: `crash` (the expert raised), `parse` (a reason of more than
one line), `mismatch`, `emulator` (the generated CUDA did not build or run on the CPU); `unemulated` when
every candidate is a WGMMA kernel.

    python tests/fuzz_expert.py --seeds 1000:3000 --out DIR     # a JSON line a case; the bugs' files kept

`test_fuzz_expert.py` runs a few draws in CI; what the hunt found is tested in test_expert_decompose.py.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"
SIZES = (1, 2, 3, 5, 7, 8, 16, 17, 31, 33, 64, 65, 128, 129, 255, 300)
MAX_ELEMS = 24_000
TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 3e-2}


@dataclass
class Case:
    seed: int
    dtype: str
    shapes: list[tuple[int, ...]]  # of the inputs, in order
    inputs: list[str] = field(default_factory=list)  # their expressions
    init: list[str] = field(default_factory=list)  # __init__ lines
    body: list[str] = field(default_factory=list)  # forward lines, the value in `y`
    steps: list[str] = field(default_factory=list)

    def source(self) -> str:
        args = ", ".join(f"x{i}" for i in range(len(self.inputs)))
        init = "\n".join(["def __init__(self):", "    super().__init__()", *(f"    {s}" for s in self.init)])
        fwd = "\n".join(
            [f"def forward(self, {args}):", "    y = x0", *(f"    {s}" for s in self.body), "    return y"]
        )
        inputs = ", ".join(self.inputs)
        return (
            HEADER
            + f"# fuzz seed {self.seed}: {' -> '.join(self.steps)}\n"
            + "class Model(nn.Module):\n"
            + textwrap.indent(init + "\n\n" + fwd, "    ")
            + f"\n\n\ndef get_inputs():\n    return [{inputs}]\n\n\ndef get_init_inputs():\n    return []\n"
        )


def _shape(rng: random.Random) -> tuple[int, ...]:
    if rng.random() < 0.12:  # a long row: the split and cluster paths
        return (rng.choice((1, 2, 3)), rng.choice((4099, 6000, 8192)))
    rank = rng.choice((1, 2, 2, 3, 3, 4, 4, 5))
    while True:
        s = tuple(rng.choice(SIZES) for _ in range(rank))
        n = 1
        for v in s:
            n *= v
        if 8 <= n <= MAX_ELEMS:
            return s


UNARY = (
    "torch.relu(y)", "F.gelu(y)", "F.gelu(y, approximate='tanh')", "F.silu(y)", "torch.sigmoid(y)",
    "torch.tanh(y)", "y.abs()", "torch.exp(y * 0.25)", "F.softplus(y)", "F.elu(y)", "F.leaky_relu(y, 0.05)",
    "F.hardswish(y)", "F.mish(y)", "torch.clamp(y, -0.5, 0.75)", "y * 1.5 - 0.25", "y * y",
    "1.0 / (y.abs() + 1.0)", "torch.sqrt(y.abs() + 0.1)", "torch.log1p(y.abs())", "torch.erf(y)",
    "torch.where(y > 0, y, y * 0.3)", "F.selu(y)", "F.hardtanh(y, -1.0, 1.0)", "F.softsign(y)",
    "torch.maximum(y, torch.zeros_like(y))", "F.logsigmoid(y)", "torch.rsqrt(y * y + 1.0)", "-y",
    "y.pow(3) * 0.1", "F.relu6(y * 3.0)", "F.hardsigmoid(y)", "torch.clamp_min(y, -0.2)",
    "F.glu(torch.cat([y, y * 0.5], dim=-1), dim=-1)", "torch.logit(torch.sigmoid(y), eps=1e-6)",
    "torch.nan_to_num(torch.log(y))", "torch.hypot(y, y + 1.0)", "torch.logaddexp(y, y * 0.5)",
    "torch.zeros_like(y) + y * 2.0", "torch.copysign(y, y - 0.5)",
)  # fmt: skip
# From this seed on, the draws take the second set of steps too (views with offsets and strides of zero,
# tensor bounds, where, roll).
V2_SEEDS = 10_000
# ... and from this one the third (interpolation and adaptive pools, any/all, norms of other orders, masks
# combined with & | ^, batch statistics, vector-matrix products, mT and movedim).
V3_SEEDS = 20_000
# ... and from this one the fourth (constant padding, rolls of several dims, a chunk's halves combined,
# cross products): the one-launch placement kernel and strided views read in place.
V4_SEEDS = 22_000
REDUCE = ("sum", "mean", "amax", "amin", "var", "std", "logsumexp", "norm", "max", "min", "argmax", "argmin")


class Gen:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        dtype = self.rng.choices(("float32", "float16", "bfloat16"), (8, 1, 1))[0]
        self.case = Case(seed, dtype, [])
        self.s = _shape(self.rng)
        self.add_input(self.s)
        self.params = 0
        self.integer = False  # y holds indices: nothing but the return follows

    def add_input(self, shape: tuple[int, ...], expr: str = "") -> str:
        """An input of the model (random values of the case's dtype unless `expr` says otherwise), its name."""
        name = f"x{len(self.case.inputs)}"
        self.case.shapes.append(shape)
        self.case.inputs.append(
            expr or f"torch.randn({', '.join(map(str, shape))}, dtype=torch.{self.case.dtype})"
        )
        return name

    def param(self, shape: tuple[int, ...]) -> str:
        name = f"p{self.params}"
        self.params += 1
        dt = "" if self.case.dtype == "float32" else f", dtype=torch.{self.case.dtype}"
        self.case.init.append(f"self.{name} = nn.Parameter(torch.randn({', '.join(map(str, shape))}{dt}))")
        return f"self.{name}"

    def emit(self, step: str, *lines: str) -> None:
        self.case.steps.append(step)
        self.case.body.extend(lines)

    def dim(self) -> int:
        return self.rng.randrange(len(self.s))

    def step(self) -> None:
        r, s = self.rng, self.s
        opts = [
            "unary",
            "unary",
            "param",
            "input",
            "reduce",
            "softmax",
            "norm",
            "view",
            "scan",
            "flip",
            "cat",
        ]
        if 3 <= len(s) <= 5:
            opts += ["pool", "pool", "conv", "conv"]
        if s:
            opts += ["linear", "linear", "matmul"]
        if len(s) >= 2:
            opts += ["mask"]
        if len(s) == 4 and s[-1] <= 128:
            opts += ["attention"]
        if self.case.seed >= V2_SEEDS:  # steps added later: earlier seeds keep their draws
            opts += ["narrow", "select", "where", "clamp", "expand", "roll"]
        if self.case.seed >= V3_SEEDS:
            opts += ["anyall", "normp", "logic", "swap"]
            if s:
                opts += ["vecmat"]
            if 3 <= len(s) <= 5:
                opts += ["resample", "resample"]
            if len(s) >= 2 and s[1] > 1 and self.case.dtype == "float32":
                opts += ["batch_stats"]
        if self.case.seed >= V4_SEEDS:
            opts += ["pad", "pad", "rolls", "halves", "halves"]
            if len(s) >= 2:
                opts += ["cross"]
        kind = r.choice(opts)
        getattr(self, f"_{kind}")()

    def _unary(self) -> None:
        e = self.rng.choice(UNARY)
        self.emit(e.split("(")[0], f"y = {e}")

    def _bshape(self) -> tuple[int, ...]:
        """A shape that broadcasts against y: some dims kept, others 1, leading ones maybe dropped."""
        s = [v if self.rng.random() < 0.5 else 1 for v in self.s]
        drop = self.rng.randrange(len(s)) if self.rng.random() < 0.5 else 0
        return tuple(s[drop:]) or (1,)

    def _param(self) -> None:
        p = self.param(self._bshape())
        op = self.rng.choice(("+", "*", "-", "max", "min"))
        line = (
            f"y = torch.{'maximum' if op == 'max' else 'minimum'}(y, {p})"
            if op in ("max", "min")
            else f"y = y {op} {p}"
        )
        self.emit(f"param{op}", line)

    def _input(self) -> None:
        x = self.add_input(self.s if self.rng.random() < 0.5 else self._bshape())
        op = self.rng.choice(("+", "*", "-", "/"))
        rhs = f"({x}.abs() + 1.0)" if op == "/" else x
        self.emit(f"input{op}", f"y = y {op} {rhs}")

    def _reduce(self) -> None:
        op, d = self.rng.choice(REDUCE), self.dim()
        keep = self.rng.random() < 0.4
        k = ", keepdim=True" if keep else ""
        if op in ("max", "min"):
            line = f"y = torch.{op}(y, dim={d}{k})[0]"
        elif op in ("argmax", "argmin"):
            line, self.integer = f"y = torch.{op}(y, dim={d}{k})", True
        elif op == "norm":
            line = f"y = torch.linalg.vector_norm(y, ord={self.rng.choice((1, 2))}, dim={d}{k})"
        elif op in ("var", "std"):
            line = f"y = torch.{op}(y, dim={d}, unbiased={self.rng.random() < 0.5}{k})"
            if self.s[d] == 1:
                return self._unary()
        else:
            line = f"y = torch.{op}(y, dim={d}{k})"
        self.emit(f"{op}({d})", line)
        s = list(self.s)
        if keep:
            s[d] = 1
        else:
            s.pop(d)
        self.s = tuple(s) or ()
        if not self.s:  # a scalar: nothing but element-wise maps after it
            self.integer = True

    def _softmax(self) -> None:
        op, d = self.rng.choice(("softmax", "log_softmax")), self.dim()
        self.emit(f"{op}({d})", f"y = torch.{op}(y, dim={d})")

    def _norm(self) -> None:
        r, s = self.rng, self.s
        opts = ["layer_norm", "rms_norm", "normalize"]
        if len(s) >= 2 and s[1] > 1:
            opts += ["batch_norm"]
            if s[1] % 2 == 0 or s[1] % 3 == 0:
                opts += ["group_norm"]
        if 3 <= len(s) <= 5 and s[1] > 1:
            opts += ["instance_norm"]
        op = r.choice(opts)
        if op in ("layer_norm", "rms_norm"):
            k = r.randint(1, min(2, len(s)))
            norm = s[-k:]
            cls = "nn.LayerNorm" if op == "layer_norm" else "nn.RMSNorm"
            affine = r.random() < 0.7
            dt = "" if self.case.dtype == "float32" else f", dtype=torch.{self.case.dtype}"
            name = f"n{self.params}"
            self.params += 1
            self.case.init.append(f"self.{name} = {cls}({list(norm)}, elementwise_affine={affine}{dt})")
            self.emit(f"{op}{list(norm)}", f"y = self.{name}(y)")
        elif op == "normalize":
            d, p = self.dim(), r.choice((1, 2))
            self.emit(f"normalize({d},{p})", f"y = F.normalize(y, p={p}, dim={d})")
        elif op == "batch_norm":
            kind = {2: 1, 3: 1, 4: 2, 5: 3}.get(len(s))
            if kind is None:
                return self._unary()
            m = self._module(f"nn.BatchNorm{kind}d({s[1]}, affine={r.random() < 0.7}{self._dt()})")
            self.emit("batch_norm", f"y = {m}(y)")
        elif op == "group_norm":
            g = 2 if s[1] % 2 == 0 else 3
            self.emit(f"group_norm({g})", f"y = F.group_norm(y, {g})")
        else:
            self.emit("instance_norm", "y = F.instance_norm(y)")

    def _view(self) -> None:
        r, s = self.rng, self.s
        if len(s) >= 2 and r.random() < 0.6:
            a, b = r.sample(range(len(s)), 2)
            cont = ".contiguous()" if r.random() < 0.5 else ""
            self.emit(f"transpose({a},{b})", f"y = y.transpose({a}, {b}){cont}")
            t = list(s)
            t[a], t[b] = t[b], t[a]
            self.s = tuple(t)
        elif len(s) >= 2:
            i = r.randrange(len(s) - 1)
            t = (*s[:i], s[i] * s[i + 1], *s[i + 2 :])
            self.emit(f"merge({i})", f"y = y.reshape({', '.join(map(str, t))})")
            self.s = t
        else:
            self.emit("unsqueeze", "y = y.unsqueeze(0)")
            self.s = (1, *s)

    def _scan(self) -> None:
        d = self.dim()
        if self.rng.random() < 0.7:
            self.emit(f"cumsum({d})", f"y = torch.cumsum(y, dim={d})")
        else:
            self.emit(f"cumprod({d})", f"y = torch.cumprod(1.0 + 0.05 * torch.tanh(y), dim={d})")

    def _flip(self) -> None:
        d = self.dim()
        self.emit(f"flip({d})", f"y = torch.flip(y, dims=[{d}])")

    def _cat(self) -> None:
        d = self.dim()
        self.emit(f"cat({d})", f"y = torch.cat([y, torch.relu(y)], dim={d})")
        t = list(self.s)
        t[d] *= 2
        self.s = tuple(t)

    def _narrow(self) -> None:
        """A window of one dim: a view at an offset, its rows strided."""
        d = self.dim()
        size = self.s[d]
        if size < 3:
            return self._unary()
        start = self.rng.randrange(1, size - 1)
        length = self.rng.randrange(1, size - start + 1)
        self.emit(f"narrow({d},{start},{length})", f"y = y.narrow({d}, {start}, {length})")
        t = list(self.s)
        t[d] = length
        self.s = tuple(t)

    def _select(self) -> None:
        if len(self.s) < 2:
            return self._unary()
        d = self.dim()
        i = self.rng.randrange(self.s[d])
        self.emit(f"select({d},{i})", f"y = y.select({d}, {i})")
        self.s = self.s[:d] + self.s[d + 1 :]

    def _where(self) -> None:
        p = self.param(self._bshape())
        self.emit("where", f"y = torch.where(y > {p}, y, {p} * 0.5)")

    def _clamp(self) -> None:
        p = self.param(self._bshape())
        bound = self.rng.choice(("min", "max"))
        self.emit(f"clamp_{bound}", f"y = torch.clamp(y, {bound}={p})")

    def _expand(self) -> None:
        """A new dim of size k as a stride-0 view: the steps after it read each element k times."""
        d = self.rng.randrange(len(self.s) + 1)
        k = self.rng.choice((2, 3, 5))
        t = (*self.s[:d], k, *self.s[d:])
        if math.prod(t) > MAX_ELEMS:
            return self._unary()
        self.emit(f"expand({d},{k})", f"y = y.unsqueeze({d}).expand({', '.join(map(str, t))})")
        self.s = t

    def _roll(self) -> None:
        d = self.dim()
        shift = self.rng.choice((-2, -1, 1, 3))
        self.emit(f"roll({d},{shift})", f"y = torch.roll(y, {shift}, dims={d})")

    def _pad(self) -> None:
        """Constant padding of the last one to three dims, some sides negative (a crop), any fill."""
        r = self.rng
        k = r.randrange(1, min(3, len(self.s)) + 1)
        pads, t = [], list(self.s)
        for d in range(len(t) - 1, len(t) - 1 - k, -1):
            lo, hi = (r.choice((0, 1, 2, 3, -1)) for _ in range(2))
            if t[d] + min(lo, 0) + min(hi, 0) < 1:
                lo, hi = max(lo, 0), max(hi, 0)
            pads += [lo, hi]
            t[d] += lo + hi
        if math.prod(t) > MAX_ELEMS:
            return self._unary()
        value = r.choice(("", ", value=-1.5", ", value=2.0"))
        self.emit(f"pad{tuple(pads)}", f"y = F.pad(y, {tuple(pads)}{value})")
        self.s = tuple(t)

    def _rolls(self) -> None:
        """A roll of two dims at once (Swin's shifted windows), or of the flat tensor."""
        if len(self.s) < 2 or self.rng.random() < 0.25:
            self.emit("roll(flat)", f"y = torch.roll(y, {self.rng.choice((-5, 7))})")
            return
        a, b = self.rng.sample(range(len(self.s)), 2)
        sa, sb = self.rng.choice((-3, 2)), self.rng.choice((-1, 4))
        self.emit(f"roll(({a},{b}))", f"y = torch.roll(y, shifts=({sa}, {sb}), dims=({a}, {b}))")

    def _halves(self) -> None:
        """Two halves of one dim (a chunk) combined elementwise, as a gated unit: strided views of y."""
        d = self.dim()
        if self.s[d] < 2:
            return self._unary()
        gate = self.rng.choice(("torch.sigmoid(b)", "F.silu(b)", "b * 0.5"))
        self.emit(
            f"halves({d})",
            f"a, b = y.narrow({d}, 0, {self.s[d] // 2 * 2}).chunk(2, dim={d})",
            f"y = a * {gate}",
        )
        t = list(self.s)
        t[d] //= 2
        self.s = tuple(t)

    def _cross(self) -> None:
        """The cross product of two 3-long windows of a dim (torch.linalg.cross), the rest broadcast."""
        d = self.dim()
        if self.s[d] < 4:
            return self._unary()
        self.emit(f"cross({d})", f"y = torch.linalg.cross(y.narrow({d}, 0, 3), y.narrow({d}, 1, 3), dim={d})")
        t = list(self.s)
        t[d] = 3
        self.s = tuple(t)

    def _resample(self) -> None:
        """F.interpolate (a mode for the dims, a scale factor or a size) or an adaptive average pool."""
        r, s = self.rng, self.s
        dims = len(s) - 2
        mode = r.choice(
            ("nearest", "nearest-exact", ("linear", "bilinear", "trilinear")[dims - 1], "adaptive")
        )
        if mode == "adaptive" or r.random() < 0.4:
            out = tuple(max(1, min(v * 2, r.choice((1, 2, 3, 5, 7, v + 1, max(1, v // 2))))) for v in s[2:])
            how = f"size={out}"
        else:
            f = r.choice((2, 3, 1.5, 0.5, 0.7))
            out = tuple(math.floor(v * f) for v in s[2:])
            how = f"scale_factor={f}"
        t = (*s[:2], *out)
        if min(out) < 1 or math.prod(t) > MAX_ELEMS:
            return self._unary()
        if mode == "adaptive":
            self.emit(f"adaptive_avg{out}", f"y = F.adaptive_avg_pool{dims}d(y, {out})")
        else:
            align = f", align_corners={r.random() < 0.5}" if "linear" in mode else ""
            self.emit(f"{mode}({how})", f"y = F.interpolate(y, {how}, mode={mode!r}{align})")
        self.s = t

    def _anyall(self) -> None:
        d, op = self.dim(), self.rng.choice(("any", "all"))
        keep = self.rng.random() < 0.4
        self.emit(
            f"{op}({d})",
            f"y = (y > -0.5).{op}(dim={d}{', keepdim=True' if keep else ''}).to(y.dtype) + y.mean()",
        )
        s = list(self.s)
        if keep:
            s[d] = 1
        else:
            s.pop(d)
        self.s = tuple(s)
        if not self.s:
            self.integer = True

    def _normp(self) -> None:
        d, p = self.dim(), self.rng.choice((3, 0.5, 0, "float('-inf')", 4))
        self.emit(f"norm{p}({d})", f"y = torch.linalg.vector_norm(y, ord={p}, dim={d})")
        self.s = self.s[:d] + self.s[d + 1 :]
        if not self.s:
            self.integer = True

    def _logic(self) -> None:
        p = self.param(self._bshape())
        op = self.rng.choice(("&", "|", "^"))
        self.emit(f"mask{op}", f"y = torch.where((y > 0) {op} ~({p} < 0.3), y, -y * 0.5)")

    def _swap(self) -> None:
        if len(self.s) < 2:
            return self._unary()
        a, b = self.rng.sample(range(len(self.s)), 2)
        t = list(self.s)
        if self.rng.random() < 0.5:
            self.emit(f"swapaxes({a},{b})", f"y = y.swapaxes({a}, {b})")
            t[a], t[b] = t[b], t[a]
        else:
            self.emit(f"movedim({a},{b})", f"y = torch.movedim(y, {a}, {b})")
            t.insert(b, t.pop(a))
        self.s = tuple(t)

    def _vecmat(self) -> None:
        """A vector times the last two dims: (K,) @ (..., K, N) reduces dim -2."""
        if len(self.s) < 2:
            return self._unary()
        v = self.add_input((self.s[-2],))
        self.emit("vecmat", f"y = torch.matmul({v}, y)")
        self.s = (*self.s[:-2], self.s[-1])

    def _batch_stats(self) -> None:
        self.emit("batch_stats", "y = F.batch_norm(y, None, None, training=True, eps=1e-3)")

    def _pool(self) -> None:
        r, s = self.rng, self.s
        dims = len(s) - 2 if len(s) > 3 else 1
        sp = s[-dims:]
        if min(sp) < 2:
            return self._unary()
        k = r.randint(2, max(2, min(5, min(sp))))
        st = r.randint(1, k)
        pad = r.randint(0, k // 2)
        op = r.choice(("max", "avg"))
        extra = f", dilation={r.choice((1, 2))}" if op == "max" else f", count_include_pad={r.random() < 0.5}"
        if op == "max" and "dilation=2" in extra and (k - 1) * 2 + 1 > min(sp) + 2 * pad:
            extra = ", dilation=1"
        dil = 2 if "dilation=2" in extra else 1
        self.emit(f"{op}_pool{dims}d(k{k},s{st},p{pad})",
                  f"y = F.{op}_pool{dims}d(y, {k}, stride={st}, padding={pad}{extra})")  # fmt: skip
        out = [(v + 2 * pad - dil * (k - 1) - 1) // st + 1 for v in sp]
        self.s = (*s[:-dims], *out)

    def _fits(self, *shape: int) -> bool:
        n = 1
        for v in shape:
            n *= v
        return 1 <= n <= MAX_ELEMS

    def _dt(self) -> str:
        return "" if self.case.dtype == "float32" else f", dtype=torch.{self.case.dtype}"

    def _module(self, ctor: str) -> str:
        name = f"m{self.params}"
        self.params += 1
        self.case.init.append(f"self.{name} = {ctor}")
        return f"self.{name}"

    def _linear(self) -> None:
        r, s = self.rng, self.s
        k = s[-1]
        ns = [n for n in SIZES if n > 1 and self._fits(*s[:-1], n)]
        if k > 512 or not ns:
            return self._unary()
        n = r.choice(ns)
        m = self._module(f"nn.Linear({k}, {n}, bias={r.random() < 0.7}{self._dt()})")
        self.emit(f"linear({k}->{n})", f"y = {m}(y)")
        self.s = (*s[:-1], n)

    def _matmul(self) -> None:
        r, s = self.rng, self.s
        if len(s) >= 2 and r.random() < 0.4 and self._fits(*s[:-1], s[-2]) and s[-1] <= 512:
            self.emit("y@yT", "y = y @ y.transpose(-1, -2) * 0.1")
            self.s = (*s[:-1], s[-2])
            return
        ns = [n for n in SIZES if n > 1 and self._fits(*s[:-1], n)]
        if s[-1] > 512 or not ns:
            return self._unary()
        n = r.choice(ns)
        lead = s[-3:-2] if len(s) >= 3 and r.random() < 0.5 else ()
        x = self.add_input((*lead, s[-1], n))
        self.emit(f"matmul({s[-1]}->{n})", f"y = torch.matmul(y, {x})")
        self.s = (*s[:-1], n)

    def _conv(self) -> None:
        r, s = self.rng, self.s
        dims = len(s) - 2
        c, sp = s[1], s[2:]
        if c > 64 or min(sp) < 2:
            return self._unary()
        k = r.randint(1, min(4, min(sp)))
        st, pad, dil = r.choice((1, 1, 2)), r.randint(0, k // 2), r.choice((1, 1, 2))
        transposed = r.random() < 0.3
        groups = c if r.random() < 0.3 else 1
        cout = groups * r.choice((1, 2)) if groups > 1 else r.choice((1, 3, 8, 16))
        if transposed:
            out = [(v - 1) * st - 2 * pad + dil * (k - 1) + 1 for v in sp]
            ctor = f"nn.ConvTranspose{dims}d({c}, {cout}, {k}, stride={st}, padding={pad}, dilation={dil}, groups={groups}"
        else:
            out = [(v + 2 * pad - dil * (k - 1) - 1) // st + 1 for v in sp]
            ctor = f"nn.Conv{dims}d({c}, {cout}, {k}, stride={st}, padding={pad}, dilation={dil}, groups={groups}"
        if min(out) < 1 or not self._fits(s[0], cout, *out):
            return self._unary()
        m = self._module(f"{ctor}, bias={r.random() < 0.7}{self._dt()})")
        self.emit(
            f"{'convT' if transposed else 'conv'}{dims}d(c{c}->{cout},k{k},s{st},p{pad},d{dil},g{groups})",
            f"y = {m}(y)",
        )
        self.s = (s[0], cout, *out)

    def _mask(self) -> None:
        r = self.rng
        kind = r.choice(("tril", "triu", "masked_fill", "where"))
        if kind in ("tril", "triu"):
            d = r.randint(-2, 2)
            self.emit(f"{kind}({d})", f"y = torch.{kind}(y, diagonal={d})")
        elif kind == "masked_fill":
            self.emit("masked_fill", "y = y.masked_fill(y > 0.5, -1.0)")
        else:
            x = self.add_input(self._bshape(), "")
            self.case.inputs[-1] = f"torch.rand({', '.join(map(str, self.case.shapes[-1]))}) > 0.5"
            self.emit("where(mask)", f"y = torch.where({x}, y, y * 2.0)")

    def _attention(self) -> None:
        r = self.rng
        causal = r.random() < 0.5
        if r.random() < 0.5:
            self.emit(
                f"sdpa(causal={causal})",
                f"y = F.scaled_dot_product_attention(y, y * 0.5, y, is_causal={causal})",
            )
        else:
            d = self.s[-1]
            self.emit("attention(by hand)",
                      f"y = torch.softmax((y @ y.transpose(-2, -1)) * {d ** -0.5!r}, dim=-1) @ y")  # fmt: skip

    def _loss(self) -> None:
        r, s = self.rng, self.s
        opts = ["smooth_l1", "huber", "mse", "kl_div", "bce", "cosine"]
        if len(s) == 2:
            opts += ["cross_entropy", "cross_entropy", "triplet", "hinge"]
        kind = r.choice(opts)
        if kind == "cross_entropy":
            t = self.add_input((s[0],), f"torch.randint(0, {s[1]}, ({s[0]},))")
            self.emit("cross_entropy", f"y = F.cross_entropy(y, {t})")
        elif kind == "triplet":
            a, b = self.add_input(s), self.add_input(s)
            self.emit("triplet", f"y = F.triplet_margin_loss(y, {a}, {b}, margin=1.0)")
        elif kind == "hinge":
            t = self.add_input(s)
            self.emit("hinge", f"y = torch.mean(torch.clamp(1 - y * torch.sign({t}), min=0))")
        elif kind == "cosine":
            t, d = self.add_input(s), self.dim()
            self.emit(f"cosine({d})", f"y = torch.mean(1 - F.cosine_similarity(y, {t}, dim={d}))")
        elif kind == "kl_div":
            t, d = self.add_input(s), self.dim()
            self.emit(f"kl_div({d})", f"y = F.kl_div(torch.log_softmax(y, dim={d}), torch.softmax({t}, dim={d}), "
                      "reduction='batchmean')")  # fmt: skip
        elif kind == "bce":
            t = self.add_input(s, f"torch.rand({', '.join(map(str, s))}, dtype=torch.{self.case.dtype})")
            self.emit("bce_logits", f"y = F.binary_cross_entropy_with_logits(y, {t})")
        else:
            t = self.add_input(s)
            self.emit(kind, f"y = F.{kind}_loss(y, {t})")
        self.s, self.integer = (), True

    def build(self) -> Case:
        n = self.rng.choice((1, 2, 2, 3, 3, 4))
        for _ in range(n):
            if self.integer or not self.s or min(self.s) < 1:
                break
            self.step()
        if self.rng.random() < 0.2 and not self.integer and self.s:
            self._loss()
        if not self.case.body:
            self._unary()
        return self.case


def generate(seed: int) -> Case:
    return Gen(seed).build()


def run_case(seed: int, folder: Path, edits: int = 3) -> dict:
    """One drawn case through the expert and the emulator; the outcome as a JSON-able dict."""
    case = generate(seed)
    path = folder / f"fuzz_{seed}.py"
    path.write_text(case.source())
    out: dict = {"seed": seed, "steps": case.steps, "dtype": case.dtype, "shapes": case.shapes}
    return out | check_task(path, TOL[case.dtype], edits)


def check_task(path: Path, tol: float, edits: int = 3, inputs: list | None = None) -> dict:
    """A task file through the expert and the emulator: {"outcome": ..., and what it found}. `inputs` stand
    in for the task's own (values PyTorch's random draw never gives: NaN, infinities)."""
    import torch

    from pipeline.generate.base import Context
    from pipeline.generate.expert import ExpertPolicy, plan_of, supports
    from pipeline.generate.expert.render import uses_cute
    from pipeline.tasks import load_module, probe

    # the reference must run in PyTorch itself, else the case is the generator's mistake
    try:
        module = load_module(path)
        torch.manual_seed(0)
        with torch.no_grad():
            module.Model(*module.get_init_inputs())(*(inputs or module.get_inputs()))
    except Exception as e:
        return {"outcome": "invalid", "why": f"{type(e).__name__}: {e}"[:300]}
    t0 = time.monotonic()
    try:
        ok, why = supports(path)
    except Exception:
        return {"outcome": "crash", "why": traceback.format_exc()[-1500:]}
    if not why or "\n" in why:
        return {"outcome": "parse", "why": why}
    if not ok:
        return {"outcome": "refused", "why": why}
    try:
        task = probe(path)
        policy = ExpertPolicy()
        firsts = policy.propose(Context(task=task, reference=task.source, parent=None), 2)
        cands = [p.candidate for p in firsts if p.candidate is not None]
        if len(cands) == 2:
            kids = policy.propose(Context(task=task, reference=task.source, parent=cands[1]), 30)
            kids = [k.candidate for k in kids if k.candidate is not None]
            if kids and edits:
                cands += kids[:: -(-len(kids) // edits)][:edits]
    except Exception:
        return {"outcome": "crash", "why": traceback.format_exc()[-1500:]}
    cands = [c for c in cands if not uses_cute(plan_of(c.source))]
    out = {"why": why, "candidates": [c.edit or "first" for c in cands]}
    if not cands:  # every candidate is a WGMMA kernel: nothing the emulator runs
        return out | {"outcome": "unemulated"}
    bad = _emulate_all(path, cands, tol, inputs)
    out["seconds"] = round(time.monotonic() - t0, 1)
    if bad:
        kind = "emulator" if all(b.startswith("emulator") for b in bad) else "mismatch"
        return out | {"outcome": kind, "bugs": bad}
    return out | {"outcome": "ok"}


@dataclass
class Reference:
    """A task's reference model run once: what each emulated candidate is compared with."""

    module: Any
    state: dict  # its parameters and buffers, for the candidate's model
    inputs: list
    native: tuple  # its outputs in the task's dtypes
    exact: tuple  # the same in float64


def reference(path: Path, inputs: list | None = None) -> Reference:
    """The task's model with its parameters and running statistics moved off their constant initial values,
    run on its inputs (or `inputs`) natively and in float64."""
    import torch

    from pipeline.tasks import load_module

    module = load_module(path)
    torch.manual_seed(0)
    ref = module.Model(*module.get_init_inputs()).eval()
    with torch.no_grad():
        for t in [*ref.parameters(), *(b for b in ref.buffers() if b.is_floating_point())]:
            t.copy_(t + torch.rand_like(t) * 0.5)
    torch.manual_seed(1)
    inputs = inputs if inputs is not None else module.get_inputs()
    with torch.no_grad():
        native = as_tuple(ref(*inputs))
        state = ref.state_dict()  # taken before .double(): it keeps the task's dtypes
        exact = as_tuple(ref.double()(*[x.double() if x.is_floating_point() else x for x in inputs]))
    return Reference(module, state, inputs, native, exact)


def _emulate_all(path: Path, cands: list, tol: float, inputs: list | None = None) -> list[str]:
    import torch
    from cuda_emulator import build, load_model

    r = reference(path, inputs)
    module, state, inputs, native, exact = r.module, r.state, r.inputs, r.native, r.exact
    # 16-bit: the native result is the anchor of values; indices may be either's (as the harness takes them)
    # (and with NaN or infinities in the inputs: float64's nan_to_num writes float64's largest value)
    low = any(
        x.is_floating_point() and (x.dtype != torch.float32 or not bool(x.isfinite().all())) for x in inputs
    )
    expected = tuple(o.double() if o.is_floating_point() else o for o in native) if low else exact
    bad = []
    for cand in cands:
        label = cand.edit or "first"
        try:
            kernels = build(cand.source)
        except Exception as e:
            bad.append(f"emulator build {label}: {str(e)[-400:]}")
            continue
        try:
            model = load_model(cand.launcher, kernels, sms=8)(*module.get_init_inputs())
            model.load_state_dict(state, strict=False)
            with torch.no_grad():
                got = as_tuple(model(*inputs))
        except Exception as e:
            bad.append(f"run {label}: {type(e).__name__}: {str(e)[-400:]}")
            continue
        if len(got) != len(native):
            bad.append(f"{label}: {len(got)} outputs, not {len(native)}")
            continue
        for i, (o, n, e) in enumerate(zip(got, native, expected, strict=True)):
            if o.shape != n.shape or o.dtype != n.dtype:
                bad.append(f"{label}[{i}]: {tuple(o.shape)} {o.dtype}, not {tuple(n.shape)} {n.dtype}")
            elif not o.is_floating_point():
                wrong = (o != n) & (o != exact[i].to(o.dtype))
                if wrong.any():
                    bad.append(f"{label}[{i}]: indices differ at {int(wrong.sum())} places")
            else:
                if bool((e.abs() > torch.finfo(torch.float32).max).logical_and(e.isfinite()).any()):
                    e = n.double()  # a dtype's own extreme (nan_to_num's default: float64's max): eager's
                od, fin = o.double(), torch.isfinite(e)
                same = (od == e) | (od.isnan() & e.isnan())
                if not bool(same[~fin].all()):  # NaN and infinities where the reference has them, no others
                    bad.append(f"{label}[{i}]: {int((~same[~fin]).sum())} non-finite values differ")
                    continue
                od, e, nd = od[fin], e[fin], n.double()[fin]
                rel = ((od - e).norm() / e.norm().clamp_min(1e-30)).item()
                # anchored as the harness anchors it: eager's own error counts (float64's finfo eps in
                # RMSNorm's default differs from float32's, and eager follows its dtype's)
                own = ((nd - e).norm() / e.norm().clamp_min(1e-30)).item()
                if not rel < max(tol, 4 * own):
                    bad.append(f"{label}[{i}]: relative error {rel:.3g} (eager's {own:.3g})")
    return bad


def as_tuple(x):
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0:50", help="first:last (exclusive)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--edits", type=int, default=3, help="edits of the tuned candidate emulated a case")
    a = ap.parse_args(argv)
    lo, hi = (int(v) for v in a.seeds.split(":"))
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.out / "fuzz.jsonl"
    done = {json.loads(line)["seed"] for line in log.read_text().splitlines()} if log.is_file() else set()
    counts: dict[str, int] = {}
    for seed in range(lo, hi):
        if seed in done:
            continue
        res = run_case(seed, a.out)
        counts[res["outcome"]] = counts.get(res["outcome"], 0) + 1
        with log.open("a") as f:
            f.write(json.dumps(res) + "\n")
        if res["outcome"] in ("ok", "refused", "invalid"):
            (a.out / f"fuzz_{seed}.py").unlink(missing_ok=True)
        print(f"{seed}: {res['outcome']} {' -> '.join(res['steps'])}", flush=True)
    print(counts)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
