"""Our own Hopper convolution for fp32 operands at fp32 accuracy: an implicit GEMM on the 3xTF32 WGMMA kernel
of templates/gemm_tf32.py (which convolutions it takes, and its plans: families/conv_tf32.py).

out[n, co, z, y, x] = sum over (ci, kz, ky, kx) of in[n, ci, z*s - p + kz*d, ...] * w[co, ci, kz, ky, kx]: a
GEMM whose rows are output pixels (M = batch x output volume), whose columns are output channels (N), and
whose K runs over input channels and taps (the weight, (N, K) with K contiguous, is laid out in the
gather's K order by our own small kernel and read by TMA). 1-D and 2-D convolutions are 3-D ones with unit
extents in front; the geometry is compiled in, the batch size is not.

A transposed convolution is the same GEMM with the adjoint gather: output z takes input i where
i*s = z + p - k*d, for the taps whose stride divides it, and its (C_in, C_out, taps) weight is transposed
to (C_out, K) rows. At stride 1 that is a direct gather with the taps' offsets negated. At a larger stride
the output pixels split into phases (coordinates with the same remainders mod the stride): every pixel of
a phase takes the same taps, at input index = its index within the phase + a constant per tap, so each
phase is a direct-like implicit GEMM over its own taps only (the other taps would multiply zeros: s^2 as
many as products in 2-D). The grid runs the phases' tiles one phase after another, and the weight kernel
lays out each phase's taps as its own run of whole k tiles.

384 threads (512 for tiles of 64 channels or fewer: two gathering warpgroups taking alternate k tiles).
Warpgroup 0 gathers: thread t owns row t of each 128 x 32 tile of A (one output pixel), reads its elements
straight from the NCDHW input (zero in the padding and past K; consecutive threads read consecutive
pixels, so a warp's loads coalesce at stride 1; no im2col copy in memory), and writes them, and their low
parts, in the 128-byte swizzled K-major layout the WGMMAs read (16-byte chunk c of row t at chunk
c ^ (t % 8)). Its thread 0 also issues the TMA loads of the weight tile and of its low part, which the
weight kernel writes beside it (so nobody splits B in the loop). A gatherer loads its next k tile into
registers before it stores this one, and the consumers wait for the weight's TMA themselves, so no
latency sits in the gatherers' loop but the stage ring's. The two consumer warpgroups are the 3xTF32
GEMM's (three passes, sums promoted to the CUDA cores every 128 of K). No register reallocation: at tiles
up to 128 channels every warpgroup fits in the launch's 168 registers (128 at 512 threads, tiles of 64
channels or fewer).

Three gathers, by geometry (`cin_pad`, `phased`):
- channel-inner (most convolutions): K runs over taps, then input channels padded to CINP (4, 8, 16 or a
  multiple of 16), and the weight is reordered to match. Each k tile then holds whole taps (or 32 channels
  of one, or two 16-channel halves each of one tap: 48 channels take 48 columns a tap, not 64), so a
  thread tests a tap's validity once, from a bit mask of its window's valid taps built at the start, and
  reads the tap's channels at a compile-time stride from one base address: a load and two arithmetic
  instructions per element. On the H200 the tap-wise gather below spent about 37 instructions
  per element (constant divisions, 64-bit address arithmetic), and the convolution was gather-bound
  (docs/benchmarks.md). It needs at most 64 taps (per phase, for phases).
- by phases: the channel-inner gather over each phase's taps (their offsets and bounds in tables).
- tap-wise (the rest: more than 64 taps, or padding that would more than double the k tiles): K in the
  weight's own order (channels, then taps), each element's tap decoded; zero taps of a strided transposed
  convolution multiplied.

The stores write NCDHW: accumulator (pixel, channel) goes to n * N * P + co * P + pixel-in-image, with the
fused elementwise chain (per-channel, scalar or full-size operands) applied first.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.generate.expert.layout import Bcast
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates import gemm, gemm_tf32
from pipeline.generate.expert.templates.code import Code, ctype, torch_dtype
from pipeline.generate.expert.templates.fused import prepare_lines
from pipeline.generate.expert.templates.gemm import BM, GROUP, SMEM_LIMIT
from pipeline.generate.expert.templates.signature import Param, Signature, i32, i64, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert import atoms
    from pipeline.generate.expert.families.gemm_kit import GemmPlan

BK = gemm_tf32.BK
MAX_TILE_N = 128  # the promoted sums double the accumulators: 128 columns is the widest without spills
# Tiles this narrow or narrower get a second gathering warpgroup (512 threads, 128 registers each): their
# MMAs take a fraction of a k tile's gather (a 128 x 32 k tile is 4096 loads an SM against 384 cycles of
# MMA at 32 channels). Measured on the H100 (benchmarks/conv_variants.py): 9% faster on level 1's 68, 2% on
# 70, 0.6% slower on 61: the gather is part of what bounds them, not all of it.
TWO_GATHERERS_N = 64


def gatherers(bn: int) -> int:
    """Warpgroups that gather A for a tile of bn output channels: they take alternate k tiles."""
    return 2 if bn <= TWO_GATHERERS_N else 1


def threads(bn: int) -> int:
    """The block: the gathering warpgroups, then the two consumer warpgroups."""
    return 128 * (gatherers(bn) + 2)


TILE_WIDTHS = (8, 16, 32, 64, 96, 128)
MAX_STAGES = 8


SPARSE_PRODUCTS = 64  # products an output below which a strided transposed convolution is the direct kernel's
# An ungrouped convolution this narrow (output channels, or products an output) goes to the direct kernel:
# the GEMM's N too small for a gathered tile to feed many MMAs, or its K one k-block, nothing to pipeline.
# Measured on the H200 (benchmarks/conv_routes.py, docs/benchmarks.md): 16 output channels from 3, 8 and 32
# inputs (K 81 to 3360) ran 1.3-2.5x faster direct; 64 from 3 with K 27, 1.35x; with several taps, K 72 and
# 81 (24 to 64 output channels, 2-D and 3-D) 1.2-1.7x, but 64 channels x K 81 (3-D) 1.14x slower direct, and
# K 216 (8 to 32, 3-D) 1.13x: the direct kernel's work an output grows with channels x K, the gather's with K.
# A one-tap (pointwise) convolution's gather is a plain strided copy: only the tighter K applies to it.
NARROW_COUT = 16
NARROW_K = 32
NARROW_K_TAPS = 96
NARROW_PRODUCTS = 4800  # output channels x K, with NARROW_K_TAPS


@dataclass(frozen=True)
class ConvForm:
    """A convolution's geometry, as (depth, height, width) triples (unit extents in front below 3-D)."""

    dims: int  # 1, 2 or 3: the convolution's own spatial dims
    cin: int
    cout: int
    size: tuple[int, ...]  # the input's spatial extents
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    pad: tuple[int, ...]
    dil: tuple[int, ...]
    out: tuple[int, ...]  # the output's spatial extents
    transposed: bool = False  # a transposed convolution: its weight is (C_in, C_out, *kernel)
    out_pad: tuple[int, ...] = (0, 0, 0)  # a transposed convolution's output padding
    groups: int = 1  # input and output channels in this many independent groups

    @property
    def k(self) -> int:
        return self.cin * math.prod(self.kernel)

    @property
    def sparse(self) -> bool:
        """A transposed convolution whose stride along the row scatters an implicit GEMM's phases over the
        output and leaves each output few products (C_in x about kernel / stride taps a dim): the direct
        kernel's, coalesced, not a GEMM's (KernelBench's stride-5 and stride-2 ones ran at 0.35x and 0.95x
        of cuDNN as implicit GEMMs, the tensor cores idle)."""
        taps = math.prod(k / s for k, s in zip(self.kernel, self.stride, strict=True))
        return self.transposed and self.stride[-1] > 1 and self.cin // self.groups * taps <= SPARSE_PRODUCTS

    @property
    def narrow(self) -> bool:
        """An ungrouped convolution with few output channels (the GEMM's N) or few products an output (its
        K; a pointwise one's bound is the tighter): each gathered tile of the implicit GEMM feeds too few MMAs."""
        taps = (
            math.prod(self.kernel) > 1 and self.k <= NARROW_K_TAPS and self.cout * self.k <= NARROW_PRODUCTS
        )
        return self.groups == 1 and (self.cout <= NARROW_COUT or self.k <= NARROW_K or taps)

    @property
    def direct(self) -> bool:
        """The direct kernel's rather than the implicit GEMM's."""
        return self.groups != 1 or self.sparse or self.narrow


@dataclass(frozen=True)
class ConvEpilogue:
    region: Region
    main: str  # the convolution's output, bound to the chain's operand
    operands: tuple[tuple[str, str, str, Bcast], ...]  # (chain input, launcher value, dtype, COL/SCALAR/FULL)
    out: str
    out_dtype: str


def out_size(f: ConvForm) -> tuple[int, ...]:
    """PyTorch's output extents for the geometry."""
    if f.transposed:
        return tuple(
            (i - 1) * s - 2 * p + d * (k - 1) + op + 1
            for i, k, s, p, d, op in zip(f.size, f.kernel, f.stride, f.pad, f.dil, f.out_pad, strict=True)
        )
    return tuple(
        (i + 2 * p - d * (k - 1) - 1) // s + 1
        for i, k, s, p, d in zip(f.size, f.kernel, f.stride, f.pad, f.dil, strict=True)
    )


def tile_n(cout: int) -> int:
    """The channel tile: as few tiles of at most 128 as cover the channels, each the narrowest MMA width
    that covers its share (the widths CuTe's main GMMA header has; the others need its extension headers)."""
    tiles = -(-cout // MAX_TILE_N)
    per_tile = -(-cout // tiles)
    return next(n for n in TILE_WIDTHS if n >= per_tile)


def tiles(cout: int) -> tuple[int, ...]:
    """The channel tiles a plan may take, narrowest first: the one sized to the channels, and one about half
    as wide (twice the blocks, for convolutions with few output pixels)."""
    return tuple(sorted({tile_n(-(-cout // 2)), tile_n(cout)}))


MAX_TAPS = 64  # one bit a tap in the channel-inner gather's window mask
_C = 512  # a phase's tap offsets are packed 10 bits a dim, biased by this


@dataclass(frozen=True)
class Phase:
    """The output pixels of a strided transposed convolution whose coordinates have the same remainders
    mod the stride: each takes the same taps, and its input index is the pixel's index within the phase
    plus a constant per tap (so it gathers like a direct convolution)."""

    first: tuple[int, int, int]  # its first output coordinate (the remainders)
    dims: tuple[int, int, int]  # its output extents (every stride-th pixel from `first`)
    taps: tuple[tuple[int, tuple[int, int, int]], ...]  # (the weight's tap index, its input offset per dim)


def strided_transpose(f: ConvForm) -> bool:
    return f.transposed and any(s != 1 for s in f.stride)


@functools.cache  # asked for by every step of a render (the gather, the weight kernel, K, the grid)
def phases(f: ConvForm) -> tuple[Phase, ...]:
    """A strided transposed convolution's phases with output pixels: output z takes input i where i*s = z +
    p - k*d, so in phase q (z = q + s*j) tap k is used when s divides q + p - k*d, at i = j + (q + p - k*d)/s."""
    out = []
    for first in itertools.product(*(range(s) for s in f.stride)):
        dims = tuple(-(-(o - q) // s) for o, q, s in zip(f.out, first, f.stride, strict=True))
        if min(dims) <= 0:
            continue
        per_dim = [
            [(k, (q + p - k * d) // s) for k in range(kk) if (q + p - k * d) % s == 0]
            for q, p, d, s, kk in zip(first, f.pad, f.dil, f.stride, f.kernel, strict=True)
        ]
        _, kh, kw = f.kernel
        taps = tuple(
            ((kz * kh + ky) * kw + kx, (cz, cy, cx))
            for kz, cz in per_dim[0]
            for ky, cy in per_dim[1]
            for kx, cx in per_dim[2]
        )
        out.append(Phase(first, dims, taps))  # type: ignore[arg-type]
    return tuple(out)


def cin_pad(f: ConvForm) -> int:
    """The channel-inner gather's padded input channels (whole taps, or whole 16-channel halves of k tiles), or
    0 where it does not apply (the tap-wise gather then) or would more than double the k tiles."""
    small = next((c for c in (4, 8, 16) if f.cin <= c), 0)
    if strided_transpose(f):  # each phase's k tiles whole multiples of CINP: the weight kernel's tap table
        cinp = small or -(-f.cin // BK) * BK
        ph = phases(f)
        fits = all(abs(c) < _C for q in ph for _, cs in q.taps for c in cs)
        return cinp if fits and max(len(q.taps) for q in ph) <= MAX_TAPS else 0
    # past 16 channels, whole 16-channel halves of a k tile: 48 channels take 48 columns a tap, not 64
    cinp = small or -(-f.cin // 16) * 16
    taps = math.prod(f.kernel)
    if taps > MAX_TAPS or -(-taps * cinp // BK) > 2 * -(-f.k // BK):
        return 0
    return cinp


def phased(f: ConvForm) -> bool:
    """Gathered by phases: a strided transposed convolution the channel-inner gather takes."""
    return strided_transpose(f) and cin_pad(f) > 0


def phase_k(f: ConvForm) -> list[int]:
    """Each phase's columns of the weight (its taps x CINP, padded to whole k tiles)."""
    cinp = cin_pad(f)
    return [-(-len(q.taps) * cinp // BK) * BK for q in phases(f)]


def gemm_k(f: ConvForm) -> int:
    """The implicit GEMM's K (the weight's columns): channels x taps; taps x padded channels for the
    channel-inner gather; every phase's taps x padded channels, each phase in whole k tiles, for phases."""
    if phased(f):
        return sum(phase_k(f))
    cinp = cin_pad(f)
    return math.prod(f.kernel) * cinp if cinp else f.k


def grid_tiles(batch: int, f: ConvForm, bn: int) -> int:
    """The implicit GEMM's BM x bn tiles: output pixels (batch x output volume) by output channels."""
    return -(-batch * math.prod(f.out) // BM) * -(-f.cout // bn)


def stage_bytes(bn: int) -> int:
    """A (gathered) and its lo, B (the weight tile) and its lo."""
    return (2 * BM + 2 * bn) * BK * 4


def max_stages(bn: int) -> int:
    return min(MAX_STAGES, (SMEM_LIMIT - 2048) // stage_bytes(bn))


def smem_bytes(bn: int, stages: int) -> int:
    return stage_bytes(bn) * stages + 1024 + 1024


def render(
    r: Region, f: ConvForm, rp: GemmPlan, epi: ConvEpilogue | None, hunter: Any = None, sinkable: bool = False
) -> Code:
    """The kernel and its launcher for an fp32 convolution region; raises atoms.AtomNotFound. sinkable: its
    one output feeds a cat or stack, which may hand the launcher a slice to write into (out=, each image one
    block at a batch stride `ldo`), unless a fused operand is read at the output's own offsets."""
    rid = r.rid
    bn, stages = rp.bn, rp.stages
    b = gemm_tf32.blocks(rp, hunter)
    smem = smem_bytes(bn, stages)
    out_dt = epi.out_dtype if epi else "float32"
    into = out_dt if sinkable and not sinks_blocked(epi) else ""
    lines = [
        *gemm.preamble(rid, b),
        "using T = cutlass::tfloat32_t;  // the MMA's operand type; the gatherers move the raw fp32 bits",
        f"constexpr int BM = {BM}, BN = {bn}, BK = {BK}, STAGES = {stages}, GROUP = {GROUP}, "
        f"SPLITTERS = 128, PROMOTE = {gemm_tf32.PROMOTE}, GATHERERS = {gatherers(bn)};",
        geometry(f),
        *gemm_tf32.split_stages(b, smem),
        _STS4,
        f"}}  // namespace kp_{rid}",
        *gemm.epilogue_function(epi, out_dt),
        weight_kernel(rid, f),
    ]
    sig = signature(epi, out_dt, bool(into))
    return region_code(r, f, rp, epi, b, lines, body(f), sig, smem, into, (f"kp_{rid}_conv", f"kp_{rid}_w"))


def region_code(r: Region, f: ConvForm, rp: GemmPlan, epi: ConvEpilogue | None, b: dict[str, atoms.Atom],
                lines: list[str], text: str, sig: Signature, smem: int, into: str, kernels: tuple[str, ...],
                unscale: str = "", prep: Prep | None = None) -> Code:  # fmt: skip
    """A form's Code: its source `lines`, then the convolution kernel (the body `text`, then `unscale` and
    the stores), and the launcher that feeds it x, w and the epilogue's operands (`prep`: the form's)."""
    rid, out_dt = r.rid, epi.out_dtype if epi else "float32"
    text = text.replace("TMA_COPY", b["tma"].name).replace("FENCE", b["fence"].name)
    at = "out_at_phase(Q, p, co, N)" if phased(f) else "out_at(p, co, N)"
    if into:  # the image's block moved from n * N * P to n * ldo
        at += f" + p / {'Q.pix' if phased(f) else 'P'} * (ldo - (long long)N * P)"
    lines = [
        *lines,
        f'extern "C" __global__ void __launch_bounds__({threads(rp.bn)}, 1) kp_{rid}_conv({sig.decls()}) {{',
        f"    using namespace kp_{rid};",
        f"    using Full = {b['full'].name};",
        f"    using Barrier = {b['empty'].name};",
        text,
        *([unscale] if unscale else []),
        *store(epi, out_dt, at),
        "}",
    ]
    ops_ = epi.operands if epi else ()
    x, w = r.node.args[:2]
    inputs = [("x", x.name), ("w", w.name), *((f"e{j}", v) for j, (_, v, _, _) in enumerate(ops_))]
    src = launcher(rid, f, epi, rp, smem, out_dt, [n for n, _ in inputs], sig, bool(into), prep)
    outs = (epi.out,) if epi else r.outputs
    slot = f"({{0}}.shape[0], {f.cout}, {', '.join(str(o) for o in f.out[3 - f.dims :])})" if into else ""
    return Code("\n".join(lines) + "\n", src, f"_conv_{rid}", kernels, tuple(v for _, v in inputs), outs,
                into=into, slot=slot)  # fmt: skip


def sinks_blocked(epi: ConvEpilogue | None) -> bool:
    """A fused operand read at the output element's own offset (a residual): written at a batch stride, the
    output's offsets are no longer the operand's."""
    return epi is not None and any(cls is Bcast.FULL for *_, cls in epi.operands)


def signature(epi: ConvEpilogue | None, out_dt: str, into: bool = False) -> Signature:
    ops_ = epi.operands if epi else ()
    return Signature((
        Param("tma_w", "const __grid_constant__ CUtensorMap", "tw"), ptr("x", "float"),
        ptr("out", ctype(out_dt), const=False),
        *(ptr(f"e{j}", ctype(d)) for j, (_, _, d, _) in enumerate(ops_)), i32("M", "m"), i32("N", "n"), i32("K", "k"),
        *([i64("ldo")] if into else []),
    ))  # fmt: skip


def geometry(f: ConvForm) -> str:
    """The convolution's geometry as compile-time constants, and the three index maps of the kernel: an output
    pixel's input window, one tap of it, and where an output element lies (plain C++: tests run it on the
    CPU against PyTorch's convolution)."""
    (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = f.kernel, f.stride, f.pad, f.dil
    words = _TRANSPOSED if f.transposed else _DIRECT
    taps = (  # the phases carry their taps in tables
        [f"constexpr int SD = {sd}, SH = {sh}, SW = {sw};"]
        if phased(f)
        else [
            f"constexpr int KD = {kd}, KH = {kh}, KW = {kw}, SD = {sd}, SH = {sh}, SW = {sw};",
            f"constexpr int PD = {pd}, PH = {ph}, PW = {pw}, DD = {dd}, DH = {dh}, DW = {dw};",
        ]
    )
    return "\n".join([
        f"constexpr int CIN = {f.cin}, ID = {f.size[0]}, IH = {f.size[1]}, IW = {f.size[2]};",
        *taps,
        f"constexpr int OD = {f.out[0]}, OH = {f.out[1]}, OW = {f.out[2]};",
        "constexpr long long P = (long long)OD * OH * OW, IMAGE = (long long)CIN * ID * IH * IW;",
        *(_phases(f) if phased(f) else _channel_inner(f, words) if cin_pad(f)
          else (_fill(_WINDOW, words), _fill(_TAP, words))),
        _OUT_AT,
    ])  # fmt: skip


# A transposed convolution the channel-inner gather takes is one of stride 1 (strided ones gather by phases):
# its stride is otherwise unused (nvcc warns of it).
_STRIDE_ONE = (
    'static_assert(SD == 1 && SH == 1 && SW == 1, "strided transposed convolutions gather by phases");'
)


def _channel_inner(f: ConvForm, words: dict[str, str]) -> tuple[str, ...]:
    """The channel-inner gather's constants (its taps' offsets from a window's corner among them) and code."""
    (_, kh, kw), (dd, dh, dw), (_, ih, iw) = f.kernel, f.dil, f.size
    sign = -1 if f.transposed else 1
    offs = [
        sign * ((r // (kh * kw)) * dd * ih * iw + ((r // kw) % kh) * dh * iw + (r % kw) * dw)
        for r in range(math.prod(f.kernel))
    ]
    return (
        *([_STRIDE_ONE] if f.transposed else []),
        f"constexpr int TAPS = KD * KH * KW, CINP = {cin_pad(f)};  // K: taps, then channels padded to CINP",
        "constexpr long long CHW = (long long)ID * IH * IW;  // one input channel",
        f"__constant__ int TAPOFF[TAPS] = {{{', '.join(map(str, offs))}}};  // tap r's offset from a window's corner",
        _GATHER_STRUCT,
        _fill(_GATHER_OF, words),
        _TILE,
    )


def _phases(f: ConvForm) -> tuple[str, ...]:
    """The phases' table (where each one's pixels, taps and weight columns are) and their taps' offsets."""
    _, ih, iw = f.size
    rows, offs, packed = [], [], []
    kcol = 0
    for q, k in zip(phases(f), phase_k(f), strict=True):
        pix = math.prod(q.dims)
        rows.append(f"{{{pix}, {q.dims[1]}, {q.dims[2]}, {', '.join(map(str, q.first))}, {len(offs)}, "
                    f"{len(q.taps)}, {kcol}, {k // BK}}}")  # fmt: skip
        for _, (cz, cy, cx) in q.taps:
            offs.append((cz * ih + cy) * iw + cx)
            packed.append(((cz + _C) << 20) | ((cy + _C) << 10) | (cx + _C))
        kcol += k
    return (
        f"constexpr int PHASES = {len(rows)}, CINP = {cin_pad(f)};  // K per phase: its taps, then padded channels",
        "constexpr long long CHW = (long long)ID * IH * IW;  // one input channel",
        f"constexpr int TAPC_BIAS = {_C};  // TAPC: each dim's offset + this, 10 bits",
        "struct Phase { int pix, h, w, fz, fy, fx, tap0, taps, kcol, ktiles; };",
        f"__constant__ Phase PHASE_OF[PHASES] = {{{', '.join(rows)}}};",
        f"__constant__ int TAPOFF[{max(1, len(offs))}] = {{{', '.join(map(str, offs or [0]))}}};  // input offset",
        f"__constant__ int TAPC[{max(1, len(offs))}] = {{{', '.join(map(str, packed or [0]))}}};  // per dim, packed",
        _GATHER_STRUCT,
        _PHASED,
        _TILE,
    )


def _fill(text: str, words: dict[str, str]) -> str:
    for k, v in words.items():
        text = text.replace(k, v)
    return text


_WINDOW = r"""// Output pixel p's window: its image's first input element, and where its taps start.
struct Window {
    long long base;
    int z0, y0, x0;
    bool row;  // p is a pixel (the last tile's rows past M gather zeros)
};
__device__ __forceinline__ Window window(long long p, long long M) {
    const long long img = p / P;
    const int q = (int)(p - img * P);
    const int oz = q / (OH * OW), oy = (q / OW) % OH, ox = q % OW;
    return {img * IMAGE, CZ, CY, CX, p < M};
}"""
# Tap k of a window (k runs over input channels, then the kernel's depth, rows and columns, as the weight
# lies): the input element under it, or 0 in the padding and past K. A convolution reads input z*s - p + k*d;
# a transposed one is its adjoint: output z gathers input i where i*s = z + p - k*d, when s divides it.
_TAP = r"""__device__ __forceinline__ float tap(const float* __restrict__ x, const Window& w, int k, int K) {
    const int ci = k / (KD * KH * KW), r = k % (KD * KH * KW);
    const int z = w.z0 SIGN (r / (KH * KW)) * DD, y = w.y0 SIGN ((r / KW) % KH) * DH, xx = w.x0 SIGN (r % KW) * DW;
    const bool in = w.row && k < K && INSIDE;
    return in ? x[w.base + (((long long)ci * ID + AT_Z) * IH + AT_Y) * IW + AT_X] : 0.f;
}"""
_DIRECT = {
    "CZ": "oz * SD - PD",
    "CY": "oy * SH - PH",
    "CX": "ox * SW - PW",
    "SIGN": "+",
    "INSIDE": "(unsigned)z < (unsigned)ID && (unsigned)y < (unsigned)IH && (unsigned)xx < (unsigned)IW",
    "AT_Z": "z",
    "AT_Y": "y",
    "AT_X": "xx",
}
_TRANSPOSED = {
    "CZ": "oz + PD",
    "CY": "oy + PH",
    "CX": "ox + PW",
    "SIGN": "-",
    "INSIDE": "z >= 0 && y >= 0 && xx >= 0 && z % SD == 0 && y % SH == 0 && xx % SW == 0\n"
    "                    && z / SD < ID && y / SH < IH && xx / SW < IW",
    "AT_Z": "z / SD",
    "AT_Y": "y / SH",
    "AT_X": "xx / SW",
}
# The channel-inner gather: a window's corner and the mask of its taps inside the input, built once per
# thread, and one k tile of its row of A (whole taps of CINP channels, or 32 channels of one tap).
_GATHER_STRUCT = r"""struct Gather {
    const float* row;  // the window's corner in channel 0 (it may lie in the padding: read through valid taps)
    unsigned long long mask;  // bit r: tap r lies inside the input (no bits for rows past M)
};"""
_GATHER_OF = r"""__device__ __forceinline__ Gather gather_of(const float* x, long long p, long long M) {
    const long long img = p / P;
    const int q = (int)(p - img * P);
    const int oz = q / (OH * OW), oy = (q / OW) % OH, ox = q % OW;
    const int z0 = CZ, y0 = CY, x0 = CX;
    unsigned long long mask = 0;
    if (p < M) {
        #pragma unroll
        for (int r = 0; r < TAPS; ++r) {
            const int z = z0 SIGN (r / (KH * KW)) * DD, y = y0 SIGN ((r / KW) % KH) * DH, xx = x0 SIGN (r % KW) * DW;
            if ((unsigned)z < (unsigned)ID && (unsigned)y < (unsigned)IH && (unsigned)xx < (unsigned)IW)
                mask |= 1ull << r;
        }
    }
    return {x + img * IMAGE + ((long long)z0 * IH + y0) * IW + x0, mask};
}"""
# One register for a tile's base address: left to itself the compiler rebuilds all 64 bits of every load's
# address from x (five instructions a load); through this, each load is the base plus an immediate.
_TILE = r"""__device__ __forceinline__ const float* opaque(const float* p) {
    asm("" : "+l"(p));
    return p;
}
// k tile kt of a window's row of A: whole taps of CINP channels, 32 channels of one tap, or (CINP an odd
// multiple of 16) two 16-channel halves, each of one tap (taps tap0...)
__device__ __forceinline__ void gather_tile(const Gather& g, int kt, float (&v)[32], int taps, int tap0) {
    if constexpr (CINP > 16 && CINP % 32 == 16) {
        constexpr int H = CINP >= 16 ? CINP / 16 : 1;  // halves per tap (the branch not taken is compiled too)
        #pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int h = kt * 2 + u, r = h / H, c0 = (h % H) * 16;
            const bool on = r < taps && ((g.mask >> r) & 1);
            const float* src = opaque(g.row + TAPOFF[tap0 + (r < taps ? r : 0)] + c0 * CHW);
            #pragma unroll
            for (int j = 0; j < 16; ++j) v[u * 16 + j] = on && (CIN % 16 == 0 || c0 + j < CIN) ? __ldg(src + j * CHW) : 0.f;
        }
    } else if constexpr (CINP >= 32) {
        constexpr int G = CINP >= 32 ? CINP / 32 : 1;  // k tiles per tap (the branch not taken is compiled too)
        const int r = kt / G, c0 = (kt % G) * 32;
        const bool on = r < taps && ((g.mask >> r) & 1);
        const float* src = opaque(g.row + TAPOFF[tap0 + (r < taps ? r : 0)] + c0 * CHW);
        #pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = on && (CIN % 32 == 0 || c0 + j < CIN) ? __ldg(src + j * CHW) : 0.f;
    } else {
        constexpr int PER = CINP < 32 ? 32 / CINP : 1;  // taps per k tile
        #pragma unroll
        for (int u = 0; u < PER; ++u) {
            const int r = kt * PER + u;
            const bool on = r < taps && ((g.mask >> r) & 1);
            const float* src = opaque(g.row + TAPOFF[tap0 + (r < taps ? r : 0)]);
            #pragma unroll
            for (int c = 0; c < CINP; ++c) v[u * CINP + c] = on && c < CIN ? __ldg(src + c * CHW) : 0.f;
        }
    }
}"""
# A strided transposed convolution by phases: pixel p of phase Q (its images' pixels in order), its window's
# corner and valid taps, and where its output lies.
_PHASED = r"""__device__ __forceinline__ Gather gather_of_phase(const float* x, const Phase& Q, long long p, long long M) {
    const long long img = p / Q.pix;
    const int q = (int)(p - img * Q.pix);
    const int i = q / (Q.h * Q.w), j = (q / Q.w) % Q.h, k = q % Q.w;
    unsigned long long mask = 0;
    if (p < M)
        for (int r = 0; r < Q.taps; ++r) {
            const int c = TAPC[Q.tap0 + r];
            const int z = i + (c >> 20) - TAPC_BIAS, y = j + ((c >> 10) & 1023) - TAPC_BIAS;
            const int xx = k + (c & 1023) - TAPC_BIAS;
            if ((unsigned)z < (unsigned)ID && (unsigned)y < (unsigned)IH && (unsigned)xx < (unsigned)IW)
                mask |= 1ull << r;
        }
    return {x + img * IMAGE + ((long long)i * IH + j) * IW + k, mask};
}
__device__ __forceinline__ long long out_at_phase(const Phase& Q, long long p, int co, int N) {
    const long long img = p / Q.pix;
    const int q = (int)(p - img * Q.pix);
    const int oz = Q.fz + SD * (q / (Q.h * Q.w)), oy = Q.fy + SH * ((q / Q.w) % Q.h), ox = Q.fx + SW * (q % Q.w);
    return (img * N + co) * P + ((long long)oz * OH + oy) * OW + ox;
}"""
_OUT_AT = r"""// Where output element (pixel p, channel co) lies in the NCDHW output of N channels.
__device__ __forceinline__ long long out_at(long long p, int co, int N) {
    const long long img = p / P;
    return (img * N + co) * P + (p - img * P);
}"""


def weight_kernel(rid: str, f: ConvForm) -> str:
    """The weight as the GEMM's B, and its low part (tf32's dropped bits) as a second plane beside it: rows of
    output channels, each K4 long (K in the gather's order, zero-padded to a multiple of 4, TMA's row rule).
    A transposed convolution's (C_in, C_out, taps) weight is transposed here. Named for its region: a
    graph may hold several convolutions."""
    k4 = -(-gemm_k(f) // 4) * 4
    table, inside, at = weight_map(rid, f)
    return (
        table
        + f"""extern "C" __global__ void __launch_bounds__(256)
kp_{rid}_w(const float* __restrict__ src, float* __restrict__ dst) {{
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < {f.cout * k4}LL; i += (long long)gridDim.x * blockDim.x) {{
        const long long row = i / {k4};
        const int col = (int)(i - row * {k4});
        const float v = {inside} ? src[{at}] : 0.f;
        dst[i] = v;
        dst[i + {f.cout * k4}LL] = v - __uint_as_float(__float_as_uint(v) & 0xffffe000u);  // lo(v)
    }}
}}"""
    )


def weight_map(rid: str, f: ConvForm) -> tuple[str, str, str]:
    """Where column `col` of the GEMM's B row `row` (an output channel) lies in the convolution's weight:
    (a table it needs, the condition that it lies inside K, its C index expression)."""
    k = gemm_k(f)
    taps, cinp = math.prod(f.kernel), cin_pad(f)
    table = ""
    if phased(f):  # each phase's columns: its taps (WTAP: the tap of each CINP columns, -1 past them) x CINP
        wtap = []
        for q, kq in zip(phases(f), phase_k(f), strict=True):
            wtap += [r for r, _ in q.taps] + [-1] * (kq // cinp - len(q.taps))
        table = f"__constant__ int kp_{rid}_wtap[{len(wtap)}] = {{{', '.join(map(str, wtap))}}};\n"
        ci, r = f"(col % {cinp})", f"kp_{rid}_wtap[col / {cinp}]"
        inside = f"col % {cinp} < {f.cin} && {r} >= 0"
    elif cinp:  # column = tap * CINP + channel
        ci, r, inside = f"(col % {cinp})", f"(col / {cinp})", f"col % {cinp} < {f.cin} && col < {k}"
    else:  # column = channel * taps + tap
        ci, r, inside = f"(col / {taps})", f"(col % {taps})", f"col < {k}"
    at = (
        f"({ci} * {f.cout} + row) * {taps} + {r}"
        if f.transposed
        else f"(row * {f.cin} + {ci}) * {taps} + {r}"
    )
    return table, inside, at


# Each gather: what a gatherer sets up once for its row (one output pixel), and the loads of k tile KT into
# registers DST.
_GATHER_TAPWISE = (
    "        const Window win = window((long long)m_blk * BM + t, M);  // row t of every A tile: one output pixel\n",
    "#pragma unroll\n            for (int j = 0; j < BK; ++j) DST[j] = tap(x, win, (KT) * BK + j, K);",
)
_GATHER_CHANNELS = (
    "        const Gather g = gather_of(x, (long long)m_blk * BM + t, M);  // row t of every A tile: one output pixel\n",
    "gather_tile(g, KT, DST, TAPS, 0);",
)
_GATHER_PHASED = (
    "        const Gather g = gather_of_phase(x, Q, (long long)m_blk * BM + t, M);  // row t: one pixel of the phase\n",
    "gather_tile(g, KT, DST, Q.taps, Q.tap0);",
)
# Which phase this block computes (the grid runs the phases' tiles one phase after another), its rows
# (M becomes the phase's pixels) and its k tiles.
_PHASE_PROLOGUE = r"""    (void)GROUP;  // one phase's tiles in order: no grouped rasterisation
    const int nb = (int)(M / P), nt = (N + BN - 1) / BN;
    int bid = blockIdx.x, ph = 0;
    for (; ph < PHASES - 1; ++ph) {
        const int tiles = (int)(((long long)nb * PHASE_OF[ph].pix + BM - 1) / BM) * nt;
        if (bid < tiles) break;
        bid -= tiles;
    }
    const Phase Q = PHASE_OF[ph];
    M = nb * Q.pix;  // the phase's rows (under 2^31: the launcher checks all of them)
    const int ktiles = Q.ktiles;
    const int mt = (int)((M + BM - 1) / BM);
    const int m_blk = bid % mt, n_blk = bid / mt;
"""


# Left to itself the compiler splits the gatherers' 16-byte stores into four (it cannot prove them aligned).
_STS4 = r"""__device__ __forceinline__ void sts4(float* p, float4 v) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "r"((unsigned)__cvta_generic_to_shared(p)), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}"""


# A gatherer's k tile into its stage: the fp32 bits (tf32's hi) and their lo, in A's 128-byte swizzle.
STORE_TF32 = r"""            float* ah = s.a + st * BM * BK + t * BK;
            float* al = s.alo + st * BM * BK + t * BK;
            #pragma unroll
            for (int c = 0; c < BK / 4; ++c) {
                const float4 q = make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
                const int at = (c ^ (t % 8)) * 4;  // the 128-byte swizzle of a K-major row
                sts4(ah + at, q);
                sts4(al + at, lo4(q));
            }
"""


def body(f: ConvForm, store_tile: str = STORE_TF32, row_setup: str = "") -> str:
    """The kernel's body up to its stores, with the gather the geometry takes; store_tile: how a gatherer
    writes its k tile v into stage st (the fp16x3 form's halves); row_setup: what else a gatherer sets up
    once for its row t (PIX: an image's pixels, of the phase where the gather is by phases)."""
    if phased(f):
        head, gather, k0 = gemm.SMEM + _PHASE_PROLOGUE, _GATHER_PHASED, "Q.kcol + "
    else:
        head = (
            gemm.PROLOGUE
            + "    (void)batch;  // one GEMM: the TMA's third coordinate picks the weight's plane\n"
        )
        gather, k0 = (_GATHER_CHANNELS if cin_pad(f) else _GATHER_TAPWISE), ""
    setup, load = gather
    return (
        head
        + r"""    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; ++i) {
            Full::init(&s.full[i], 1);
            Barrier::init(&s.ready[i], 128);  // every gatherer arrives once its writes are fenced
            Barrier::init(&s.empty[i], 2);  // one arrive per consumer warpgroup
        }
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();
    if (wg < GATHERERS) {  // gatherer warpgroup wg takes k tiles wg, wg + GATHERERS, ...
        const int t = threadIdx.x % 128;
"""
        + setup
        + row_setup.replace("PIX", "Q.pix" if phased(f) else "P")
        + "        float v[BK];\n"
        + f"        if (wg < ktiles) {{\n            {load.replace('KT', 'wg').replace('DST', 'v')}\n        }}\n"
        + r"""        for (int kt = wg; kt < ktiles; kt += GATHERERS) {
            // The next tile's loads go out before this one's stores (and the wait for its stage): a
            // gatherer that loaded and stored one tile at a time waited a load's latency every tile, and
            // that bounded the 64-channel convolutions (level 2's per-kernel times, docs/benchmarks.md).
            float vn[BK];
            if (kt + GATHERERS < ktiles) {
                """
        + load.replace("KT", "kt + GATHERERS").replace("DST", "vn")
        + r"""
            }
            const int st = kt % STAGES;
            if (kt >= STAGES) Barrier::wait(&s.empty[st], ((kt / STAGES) - 1) & 1);
            if (t == 0) {  // the weight tile and its low part (planes 0 and 1 of the weight kernel's output)
                Full::arrive_and_expect_tx(&s.full[st], 2 * BN * BK * sizeof(float));
                TMA_COPY::copy(&tma_w, &s.full[st], 0, s.b + st * BN * BK, K0kt * BK, n_blk * BN, 0);
                TMA_COPY::copy(&tma_w, &s.full[st], 0, s.blo + st * BN * BK, K0kt * BK, n_blk * BN, 1);
            }
STORE_TILE            FENCE();  // our writes, visible to the WGMMAs' async proxy
            Barrier::arrive(&s.ready[st]);  // B's TMA is the consumers' own wait: no round trip here
            #pragma unroll
            for (int j = 0; j < BK; ++j) v[j] = vn[j];
        }
        return;
    }
""".replace("K0kt", k0 + "kt").replace("STORE_TILE", store_tile)
        + gemm_tf32.consumers(wait_full=True).replace("threadIdx.x - 128)", "threadIdx.x - 128 * GATHERERS)")
        + r"""    Tensor tCcC = thr.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
    const long long m0 = (long long)m_blk * BM;
    const int n0 = n_blk * BN;"""
    )


def chain_value(epi: ConvEpilogue | None, acc: str) -> str:
    """The statement that sets float v for the output element at o (channel co) from its sum `acc`: the
    fused chain, its operands indexed per channel (COL), once (SCALAR) or like the output (FULL)."""
    if epi is None:
        return f"v = {acc}"
    args = []
    for name in epi.region.inputs:
        if name == epi.main:
            args.append(acc)
            continue
        j = next(j for j, op in enumerate(epi.operands) if op[0] == name)
        idx = {Bcast.FULL: "o", Bcast.COL: "co", Bcast.SCALAR: "0"}[epi.operands[j][3]]
        args.append(f"kp::ld(e{j}[{idx}])")
    return f"kp_{epi.region.rid}_f({', '.join([*args, 'v'])})"


def prepare_operands(epi: ConvEpilogue | None) -> list[str]:
    """Launcher lines that make the chain's operands e<j> what the stores index: the output's shape,
    one value per channel, or a scalar."""
    return prepare_lines(
        [(f"e{j}", cls) for j, (_, _, _, cls) in enumerate(epi.operands if epi else ())], "out.shape"
    )


def store(epi: ConvEpilogue | None, out_dt: str, at: str) -> list[str]:
    """One store per accumulator: NCDHW output, the fused chain applied first."""
    ot = ctype(out_dt)
    value = chain_value(epi, "acc(i)")
    return [
        "    CUTE_UNROLL",
        "    for (int i = 0; i < size(acc); ++i) {",
        "        const long long p = m0 + get<0>(tCcC(i));",
        "        const int co = n0 + get<1>(tCcC(i));",
        "        if (p >= M || co >= N) continue;",
        f"        const long long o = {at};",
        "        float v;",
        f"        {value};",
        f"        out[o] = kp::cv<{ot}>(v);",
        "    }",
    ]


@dataclass(frozen=True)
class Prep:
    """What a form of the kernel has its launcher do first: its words, the weight's layout as B (lines after
    w is contiguous), lines before the launch, and the tensor map's swizzle."""

    words: str
    weights: tuple[str, ...]
    before: tuple[str, ...] = ()
    swizzle: str = ""  # the tensor map's extra argument; "" for the 128-byte default


def tf32_prep(rid: str, f: ConvForm) -> Prep:
    """The 3xTF32 form's: B and its low part in fp32 rows of K4."""
    k4 = -(-gemm_k(f) // 4) * 4
    return Prep("our 3xTF32 WGMMA kernel (", (
        f"    wk = torch.empty((2, n, {k4}), dtype=torch.float32, device=x.device)  # B and its low part",
        f"    kernels.kp_{rid}_w((max(1, min(-(-n * {k4} // 256), MAX_GRID_Y * 32)),), (256,), (w, wk))"
        "  # noqa: F821",
    ))  # fmt: skip


def launcher(rid: str, f: ConvForm, epi: ConvEpilogue | None, rp: GemmPlan, smem: int, out_dt: str,
             names: list[str], sig: Signature, into: bool = False, prep: Prep | None = None) -> str:  # fmt: skip
    prep = prep or tf32_prep(rid, f)
    dims = f.dims
    in_shape = (f.cin, *f.size[3 - dims :])
    w_shape = (
        (f.cin, f.cout, *f.kernel[3 - dims :]) if f.transposed else (f.cout, f.cin, *f.kernel[3 - dims :])
    )
    k = gemm_k(f)
    lines = [
        f"def _conv_{rid}(sms, {', '.join(names)}{', out=None' if into else ''}):",
        f'    """The convolution as an implicit GEMM: {prep.words}128 pixels x {rp.bn} channels, '
        f'{rp.stages} stages){" and the fused epilogue" if epi else ""}."""',
        f"    if tuple(x.shape[1:]) != {in_shape} or tuple(w.shape) != {w_shape}:",
        "        raise ValueError(f'kernelpro expert: the convolution was compiled for inputs (N, "
        f"{', '.join(map(str, in_shape))}) and a weight {w_shape}, not {{tuple(x.shape)}} and "
        "{tuple(w.shape)}')",
        "    x = _contig(x)",
        "    nb = x.shape[0]",
        f"    m, n, k = nb * {math.prod(f.out)}, {f.cout}, {k}",
        "    if m >= 2**31:",
        "        raise ValueError('kernelpro expert: more than 2^31 output pixels for one convolution')",
        "    w = _contig(w)",
        *prep.weights,
    ]
    out_shape = f"(nb, n, {', '.join(str(o) for o in f.out[3 - dims :])})"
    fresh = f"torch.empty({out_shape}, dtype={torch_dtype(out_dt)}, device=x.device)"
    if into:  # a slice of a cat's output, each image one block at its batch stride
        lines += ["    if out is None:", f"        out = {fresh}",
                  f"    ldo = _batch_stride(out, {out_shape}, {torch_dtype(out_dt)})"]  # fmt: skip
    else:
        lines.append(f"    out = {fresh}")
    lines += prepare_operands(epi)
    lines += [
        "    if m:",
        *prep.before,
        f"        tw = kernels.tensor_map(wk, {rp.bn}, {BK}{prep.swizzle})  # noqa: F821",
        (
            f"        grid = sum(-(-nb * q // {BM}) for q in {tuple(math.prod(q.dims) for q in phases(f))})"
            f" * (-(-n // {rp.bn}))  # the phases' tiles, one phase after another"
            if phased(f)
            else f"        grid = (-(-m // {BM})) * (-(-n // {rp.bn}))"
        ),
        f"        kernels.kp_{rid}_conv((grid,), ({threads(rp.bn)},), ({sig.args()}), shared_mem={smem})  # noqa: F821",
        "    return out",
    ]
    return "\n".join(lines)
