"""Data movement by strided copies: flip, roll, cat, stack, repeat (tile), Tensor.unfold, constant padding
and elements picked by an index tensor (families/movement.py).

Each op is a few pieces, each one copy of a strided block of the input into a strided block of the output:
  flip   one piece: the input read from its last element backwards along the flipped dims (the source
         strides negated, the base moved to the end of those dims);
  roll   no pieces: one kernel over the output (kp_*_place), each output coordinate reading the input at
         itself minus the shift, wrapped (rolled dims of whole rows move 16 bytes a unit);
  cat    a piece an input, written into its slice of the output along the dim (legacy empty 1-D inputs
         skipped, as torch does);
  stack  a piece an input, written into out.select(dim, i);
  repeat one piece: the output seen as (r0, s0, r1, s1, ...), the source read at stride 0 over the repeats;
  unfold one piece: the windows are a strided view of the input (the dim's stride times the step, then its
         own stride for the window's last dim);
  pad    constant: no pieces, one kernel over the output (kp_*_place: each output row the input's row or
         the fill, negative padding cropping); reflect, replicate and circular: 3 ranges a padded dim (the edges read
         backwards, at stride 0 or from the other end), a piece a choice of one range a dim;
  im2col F.unfold: a piece a kernel tap (i, j), the block of output positions whose tap reads inside the
         input (a rectangle), the rest of the zero-filled output its padding;
  take   embedding, index_select, x[:, i]: one piece whose coordinate along the indexed dim goes through
         the index; gather: one piece of the index's shape, the source coordinate along the dim read from
         the index at the element's own (contiguous) offset.
The launcher merges the dims a piece's source and destination both keep contiguous among themselves and
drops the unit ones, so most pieces are a few rows of one long contiguous run; the kernel takes the last
dim as that run (threads along it, rows over blockIdx.y and threadIdx.y) and works out each row's two
offsets once. The copy moves the elements' bytes, whatever the dtype, and 16 bytes at a time where the
run is contiguous on both sides and every row starts on a 16-byte boundary (`vec`).
"""

from __future__ import annotations

from pipeline.generate.expert.families.base import RenderError
from pipeline.generate.expert.graph import Node, Ref
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code, launch_bounds
from pipeline.generate.expert.templates.signature import Signature, i32, i64, ptr

TAKES = ("embedding", "index_select", "index", "gather")  # elements picked by an index tensor
SINKS = ("cat", "stack")  # ops whose inputs' producers may write straight into the output (`sink`)
OPS = ("flip", "roll", "cat", "stack", "repeat", "tile", "unfold", "pad", "constant_pad_nd", "im2col", *TAKES)
UNITS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
OUTER = 7  # dims of a piece besides its run (a tensor has at most 8)

_BODY = """namespace kp_{rid} {{
// The source index of coordinate i along the indexed dim: idx[i], negative ones counted from the end as
// PyTorch does. One out of range is a device fault, as in eager (the emulator clamps it instead).
__device__ __forceinline__ long long taken(const long long* __restrict__ idx, long long i, long long limit) {{
    long long j = idx[i];
    j += j < 0 ? limit : 0;
#ifdef KP_EMULATED
    j = j < 0 ? 0 : j >= limit ? limit - 1 : j;
#else
    if (j < 0 || j >= limit) __trap();
#endif
    return j;
}}
// A unit's lanes of element type E in reverse order: a 16-byte unit read backwards along a flip (bytes
// permuted within each word, the words reversed); any other unit is one lane, unchanged.
template <typename E, typename U>
__device__ __forceinline__ U reversed(U v) {{
    return v;
}}
template <typename E>
__device__ __forceinline__ float4 reversed(float4 v) {{
    if (sizeof(E) == 8) return make_float4(v.z, v.w, v.x, v.y);
    constexpr unsigned SEL = sizeof(E) == 4 ? 0x3210u : sizeof(E) == 2 ? 0x1032u : 0x0123u;
    const auto flip = [](float f) {{ return __uint_as_float(__byte_perm(__float_as_uint(f), 0u, SEL)); }};
    return make_float4(flip(v.w), flip(v.z), flip(v.y), flip(v.x));
}}
// A thread's rows are r, r + step, ...: their coordinates are divided out once, for the first row and for
// the step, then each next row adds the step's digits with a carry (a division a row was most of a
// short-rowed copy's instructions).
__device__ __forceinline__ void digits(long long r, long long step, int nd, const long long (&size)[{outer}],
                                       long long (&at)[{outer}], int (&by)[{outer}]) {{
    long long rest = r, st = step;
#pragma unroll
    for (int d = {outer} - 1; d >= 0; --d) {{
        at[d] = 0;
        by[d] = 0;
        if (d < nd) {{
            const long long q = rest / size[d], qs = st / size[d];
            at[d] = rest - q * size[d];
            by[d] = (int)(st - qs * size[d]);
            rest = q;
            st = qs;
        }}
    }}
}}
// The next row of a thread: the step's digits added, last dim first.
__device__ __forceinline__ void advance(int nd, const long long (&size)[{outer}], long long (&at)[{outer}],
                                        const int (&by)[{outer}]) {{
    long long carry = 0;
#pragma unroll
    for (int d = {outer} - 1; d >= 0; --d) {{
        if (d < nd) {{
            const long long v = at[d] + by[d] + carry;
            carry = v >= size[d];
            at[d] = carry ? v - size[d] : v;
        }}
    }}
}}
// MODE 1 (take): the coordinate along dim kd of the piece (kd == {outer}: the run) goes through idx, at
// that coordinate. MODE 2 (gather): it goes through idx at the element's destination offset (idx has the
// output's contiguous layout), kstr the source's stride along kd. REV (plain moves): each unit's lanes of E
// reversed, a run read backwards 16 bytes at a time.
template <typename U, int MODE, typename E, bool REV>
__device__ __forceinline__ void move(const U* __restrict__ src, U* __restrict__ dst, long long rows,
                                     long long inner, long long s0, long long d0, long long si, long long di,
                                     int nd, const long long (&size)[{outer}], const long long (&sstr)[{outer}],
                                     const long long (&dstr)[{outer}], const long long* __restrict__ idx,
                                     long long limit, int kd, long long kstr) {{
    constexpr bool TAKE = MODE == 1, GATHER = MODE == 2;
    long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y;
    if (r >= rows) return;
    const long long step = (long long)gridDim.y * blockDim.y;
    long long at[{outer}];  // the row's coordinates
    int by[{outer}];  // the step's digits (the step, a grid's rows, is under 2^31)
    digits(r, step, nd, size, at, by);
    for (; r < rows; r += step) {{
        long long so = s0, dof = d0;  // the row's first element on each side
#pragma unroll
        for (int d = 0; d < {outer}; ++d) {{
            if (d < nd) {{
                so += (TAKE && d == kd ? taken(idx, at[d], limit) : GATHER && d == kd ? 0 : at[d]) * sstr[d];
                dof += at[d] * dstr[d];
            }}
        }}
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < inner;
             i += (long long)gridDim.x * blockDim.x)
            if (GATHER && kd == {outer})
                dst[dof + i * di] = src[so + taken(idx, dof + i * di, limit) * si];
            else if (GATHER)
                dst[dof + i * di] = src[so + i * si + taken(idx, dof + i * di, limit) * kstr];
            else if (REV)
                dst[dof + i * di] = reversed<E>(src[so + i * si]);
            else
                dst[dof + i * di] = src[so + (TAKE && kd == {outer} ? taken(idx, i, limit) : i) * si];
        advance(nd, size, at, by);
    }}
}}
// Written from the output's side (constant padding, roll): each output row (coordinates `at` over the
// merged outer dims) reads the input at coordinate c = at - mid along each dim, and along the run at
// i - lo. Padding (WRAP false): where some c falls outside [0, kept) the row, or element, is the fill.
// Roll (WRAP true): c wraps into [0, size). Each output element stored once, each input element read
// once, one launch (padding was a copy of the middle plus a band a side, 9 launches and rows of 3; a
// roll a launch a block of the 2^k it moves). A thread takes ILP units of a row before storing any.
template <typename U>
__device__ __forceinline__ U splat(unsigned long long bits) {{
    return (U)bits;
}}
template <>
__device__ __forceinline__ float4 splat<float4>(unsigned long long bits) {{  // the element's bits, repeated
    const float lo = __uint_as_float((unsigned)bits), hi = __uint_as_float((unsigned)(bits >> 32));
    return make_float4(lo, hi, lo, hi);
}}
template <typename U, bool WRAP, int ILP>
__device__ __forceinline__ void place(const U* __restrict__ src, U* __restrict__ dst, unsigned long long bits,
                                      long long rows, long long inner, long long lo, long long keep, long long si,
                                      long long s0, int nd, const long long (&size)[{outer}],
                                      const long long (&mid)[{outer}], const long long (&kept)[{outer}],
                                      const long long (&sstr)[{outer}]) {{
    long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y;
    if (r >= rows) return;
    const U fill = splat<U>(bits);
    const long long step = (long long)gridDim.y * blockDim.y;
    long long at[{outer}];
    int by[{outer}];
    digits(r, step, nd, size, at, by);
    const long long across = (long long)gridDim.x * blockDim.x;
    for (; r < rows; r += step) {{
        bool in = true;
        long long so = s0;
#pragma unroll
        for (int d = 0; d < {outer}; ++d) {{
            if (d < nd) {{
                long long c = at[d] - mid[d];
                if (WRAP) c += c < 0 ? size[d] : 0;
                in = in && (unsigned long long)c < (unsigned long long)kept[d];
                so += c * sstr[d];
            }}
        }}
        U* row = dst + r * inner;
        for (long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x; i0 < inner; i0 += ILP * across) {{
            U v[ILP];
#pragma unroll
            for (int k = 0; k < ILP; ++k) {{
                const long long i = i0 + k * across;
                long long c = i - lo;
                if (WRAP) c += c < 0 ? inner : 0;
                v[k] = in && i < inner && (unsigned long long)c < (unsigned long long)keep ? src[so + c * si] : fill;
            }}
#pragma unroll
            for (int k = 0; k < ILP; ++k)
                if (i0 + k * across < inner) row[i0 + k * across] = v[k];
        }}
        advance(nd, size, at, by);
    }}
}}
}}  // namespace kp_{rid}
"""


def _signature(unit: str, take: bool) -> Signature:
    extra = (ptr("idx", "long long"), i64("limit"), i32("kd", "kin"), i64("kstr")) if take else ()
    return Signature(
        (
            ptr("src", unit),
            ptr("dst", unit, const=False),
            i64("rows"),
            i64("inner"),
            i64("s0"),
            i64("d0"),
            i64("si"),
            i64("di"),
            i32("nd"),
            *(i64(f"z{d}", f"z[{d}]") for d in range(OUTER)),
            *(i64(f"a{d}", f"a[{d}]") for d in range(OUTER)),
            *(i64(f"b{d}", f"b[{d}]") for d in range(OUTER)),
            *extra,
        )
    )


def _dim_arrays(pairs: tuple[tuple[str, str], ...]) -> str:
    """A kernel's per-dim arrays gathered from its scalar parameters: array `arr` from p0 .. p6, a pair each."""
    return "\n".join(
        f"    const long long {arr}[{OUTER}] = {{{', '.join(f'{p}{d}' for d in range(OUTER))}}};"
        for arr, p in pairs
    )


def _kernel(
    rid: str, name: str, unit: str, threads: int, mode: int, lane: str = "", rev: bool = False
) -> str:
    """A copy kernel moving units of `unit`; rev: each unit's `lane`-typed lanes reversed (a flip's run)."""
    sig = _signature(unit, mode > 0)
    arrays = _dim_arrays((("size", "z"), ("sstr", "a"), ("dstr", "b")))
    bounds = _bounds(threads) if rev else f"{launch_bounds(threads, 0)}\n"
    return (
        f'extern "C" __global__ void {bounds}{name}({sig.decls()}) {{\n{arrays}\n'
        f"    kp_{rid}::move<{unit}, {mode}, {lane or unit}, {'true' if rev else 'false'}>(src, dst, rows, inner, s0, d0, si, di, nd, size, "
        f"sstr, dstr, {'idx, limit, kd, kstr' if mode else 'nullptr, 0, -1, 0'});\n}}\n"
    )


def _bounds(threads: int) -> str:
    """A kernel of 64 to 80 registers left unbounded up to 512 threads a block (held to what
    __launch_bounds__(256) gives, 64, the reversing copy spilled), bounded beyond, where it would not launch."""
    return "" if threads <= 512 else f"{launch_bounds(threads, 0)}\n"


def _place_kernel(rid: str, name: str, unit: str, wrap: bool, threads: int) -> str:
    """kp_{rid}::place over units of `unit`: the fill passed as its element's bits repeated to 64."""
    arrays = _dim_arrays((("size", "z"), ("mid", "m"), ("kept", "k"), ("sstr", "a")))
    per_dim = ", ".join(f"long long {p}{d}" for p in "zmka" for d in range(OUTER))
    ilp = 4 if unit == "float4" else 8
    return (
        f'extern "C" __global__ void {_bounds(threads)}'
        f"{name}(const {unit}* __restrict__ src, {unit}* __restrict__ dst, unsigned long long fill, "
        f"long long rows, long long inner, long long lo, long long keep, long long si, long long s0, int nd, "
        f"{per_dim}) {{\n{arrays}\n"
        f"    kp_{rid}::place<{unit}, {'true' if wrap else 'false'}, {ilp}>(src, dst, fill, rows, inner, lo, keep, "
        "si, s0, nd, size, mid, kept, sstr);\n}\n"
    )


def _place_launcher(rid: str, threads: int, lanes: int, fill: int) -> str:
    wide = (
        f"""        wide = (inner % {lanes} == 0 and lo % {lanes} == 0 and kp % {lanes} == 0 and si == 1 and s0 % {lanes} == 0
                and all(v[3] % {lanes} == 0 for v in outer) and x.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0)
        if wide:  # 16 bytes a unit: the run's numbers and the source's strides in units
            inner, lo, kp, s0 = inner // {lanes}, lo // {lanes}, kp // {lanes}, s0 // {lanes}
            outer = [(z, m, k, a // {lanes}) for z, m, k, a in outer]
"""
        if lanes > 1
        else "        wide = False\n"
    )
    return f'''_places_{rid} = {{}}  # a placement's launch by its geometry


def _place_{rid}(sms, x, s0, mid, keep, out):
    """out (contiguous) = x's part `keep` long from s0 (element offset) placed at `mid` along each dim, the
    fill (bits {fill:#x}) elsewhere (a roll: mid its shift, the part wrapping round): one launch. Dims
    left whole merge into the one before where the input is contiguous across them; unit dims the input
    keeps are dropped."""
    if not out.numel():
        return
    key = (tuple(out.shape), tuple(x.stride()), s0, tuple(mid), tuple(keep), x.data_ptr() % 16 == 0,
           out.data_ptr() % 16 == 0, sms)
    plan = _places_{rid}.get(key)
    if plan is None:
        if len(_places_{rid}) >= 4096:
            _places_{rid}.clear()
        merged = []
        for size, m, k, a in zip(out.shape, mid, keep, x.stride()):
            if size == 1 and k == 1:
                continue
            if merged and m == 0 and k == size and merged[-1][3] == a * size:
                ps, pm, pk, _ = merged[-1]
                merged[-1] = (ps * size, pm * size, pk * size, a)
            else:
                merged.append((size, m, k, a))
        (inner, lo, kp, si), outer = (merged or [(1, 0, 1, 1)])[-1], merged[:-1]
{wide}        rows, nd = math.prod(v[0] for v in outer), len(outer)
        per_dim = [v[j] for j in range(4) for v in outer + [(1, 0, 1, 0)] * ({OUTER} - nd)]
        ilp = 4 if wide else 8
        tx = min({threads}, 1 << max(0, (-(-inner // ilp) - 1).bit_length()))
        ty = {threads} // tx
        gx = max(1, min(-(-inner // (tx * ilp)), 4096))
        gy = max(1, min(-(-rows // ty), MAX_GRID_Y, sms * {2048 // threads} * 4 // gx))
        ints = (*(numpy.int64(v) for v in (rows, inner, lo, kp, si, s0)), numpy.int32(nd),
                *(numpy.int64(v) for v in per_dim))
        plan = _places_{rid}[key] = (wide, (gx, gy), (tx, ty), ints)
    wide, grid, block, ints = plan
    if wide:
        kernels.kp_{rid}_place16(grid, block, (x, out, numpy.uint64({fill}), *ints))  # noqa: F821
    else:
        kernels.kp_{rid}_place(grid, block, (x, out, numpy.uint64({fill}), *ints))  # noqa: F821


'''


def fill_bits(value: float | int | bool, dtype: str) -> int:
    """The fill's bits in the dtype, as the tensor would hold them (bf16 rounded as torch rounds), repeated
    to fill 64 bits."""
    import torch

    try:
        t = torch.tensor([value], dtype=getattr(torch, dtype))
    except (RuntimeError, OverflowError, TypeError) as e:  # as eager's fill would fail (300 into uint8)
        raise RenderError(f"a pad value {value!r} that {dtype} cannot hold: {e}") from None
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    size = t.element_size()
    bits = int(t.view(as_int).item()) & ((1 << 8 * size) - 1)
    return sum(bits << (8 * size * k) for k in range(8 // size))  # repeated to 64 bits: any unit's lanes


JOIN = 16  # inputs one launch of a cat's joined copy takes


def _join_kernel(rid: str, name: str, unit: str, threads: int) -> str:
    """A cat's contiguous inputs copied by one launch: blockIdx.y picks the input (JOIN at most), whose rows
    of w units go to columns [lo, lo + w) of the output's rows of `cols` units; rows over blockIdx.z."""
    ps = ", ".join(f"const {unit}* __restrict__ p{j}" for j in range(JOIN))
    los = ", ".join(f"long long l{j}" for j in range(JOIN))
    ws = ", ".join(f"long long w{j}" for j in range(JOIN))
    pick = "\n".join(f"    if (j == {j}) {{ s = p{j}; lo = l{j}; w = w{j}; }}" for j in range(1, JOIN))
    return f"""extern "C" __global__ void {launch_bounds(threads, 0)}
{name}({unit}* __restrict__ dst, {ps}, {los}, {ws}, long long rows, long long cols) {{
    const unsigned j = blockIdx.y;  // the same input for the whole block
    const {unit}* s = p0;
    long long lo = l0, w = w0;
{pick}
    for (long long r = blockIdx.z; r < rows; r += gridDim.z) {{
        const {unit}* sr = s + r * w;
        {unit}* dr = dst + r * cols + lo;
        for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < w; c += (long long)gridDim.x * blockDim.x)
            dr[c] = sr[c];
    }}
}}
"""


def _join_launcher(rid: str, lanes: int, threads: int) -> str:
    """The launcher of a cat's joined copy: its contiguous inputs, JOIN a launch, 16 bytes a thread where
    every input's run, its place in the output's rows, and both tensors' starts allow."""
    k16 = (
        f"""        wide = ({lanes} > 1 and cols % {lanes} == 0 and out.data_ptr() % 16 == 0
                and all(v % {lanes} == 0 for v in ws + los) and all(t.data_ptr() % 16 == 0 for t, _ in group))
        if wide:
            ws, los, cols = [v // {lanes} for v in ws], [v // {lanes} for v in los], cols // {lanes}
"""
        if lanes > 1
        else "        wide = False\n"
    )
    call = (
        f"((gx, k, gz), ({threads},), (out, *srcs, *(numpy.int64(v) for v in los), "
        "*(numpy.int64(v) for v in ws), numpy.int64(rows), numpy.int64(cols)))"
    )
    return f'''def _join_{rid}(sms, out, d, joined):
    """Contiguous inputs of the cat (t, its first index along d) into `out`, up to {JOIN} a launch: one
    launch, not one a piece (a DenseNet's joins have dozens of inputs)."""
    inner = math.prod(out.shape[d + 1 :])
    rows = math.prod(out.shape[:d])
    for g in range(0, len(joined), {JOIN}):
        group = [(t, at) for t, at in joined[g : g + {JOIN}] if t.numel()]
        if not group or not rows:
            continue
        cols = out.shape[d] * inner
        ws = [t.shape[d] * inner for t, _ in group]
        los = [at * inner for _, at in group]
{k16}        k = len(group)
        srcs = [t for t, _ in group] + [out] * ({JOIN} - k)  # unused: no block reads past input k - 1
        los, ws = los + [0] * ({JOIN} - k), ws + [0] * ({JOIN} - k)
        gx = max(1, min(-(-max(ws) // ({threads} * 8)), 4096))
        gz = max(1, min(rows, MAX_GRID_Y, sms * {2048 // threads} * 4 // (gx * k)))
        if wide:
            kernels.kp_{rid}_join16{call}  # noqa: F821
        else:
            kernels.kp_{rid}_join{call}  # noqa: F821


'''


def pad_value(n: Node) -> float | int | bool:
    """A constant pad's fill: pad(x, p, mode, value) or constant_pad_nd(x, p, value); None is 0."""
    a = n.args
    value = (
        (a[3] if len(a) > 3 else n.kw("value"))
        if n.op == "pad"
        else (a[2] if len(a) > 2 else n.kw("value", 0))
    )
    return 0 if value is None else value


def pad_mode(n: Node) -> str:
    return (n.args[2] if len(n.args) > 2 else n.kw("mode", "constant")) if n.op == "pad" else "constant"


def take_position(n: Node) -> int:
    """index.Tensor: the position of its one index tensor among the Nones (-1 for any other form)."""
    given = [k for k, v in enumerate(n.args[1]) if v is not None] if len(n.args) > 1 else []
    return given[0] if len(given) == 1 and isinstance(n.args[1][given[0]], Ref) else -1


def _taken_pieces(r: Region, names: dict[str, str]) -> list[str]:
    """One piece reading whole rows of the source at an index tensor's positions (its own shape put in the
    indexed dim's place in the output)."""
    n = r.node
    if n.op == "embedding":
        w, i = names[n.args[0].name], names[n.args[1].name]
        return [
            f"    idx = _contig({i}).reshape(-1)",
            f"    out = torch.empty([*{i}.shape, {w}.shape[1]], dtype={w}.dtype, device={w}.device)",
            f"    pieces = [({w}, 0, [idx.numel(), {w}.shape[1]], list({w}.stride()), 0, [{w}.shape[1], 1], idx, 0,"
            f" {w}.shape[0])]",
            "    result = out",
        ]
    x = names[n.args[0].name]
    if n.op == "gather":  # out[..., j, ...] = x[..., idx[..., j, ...], ...] along dim; out has idx's shape
        dim, i = n.args[1], names[n.args[2].name]
        return [
            f"    d = {dim} % max(1, {x}.dim())",
            f"    idx = _contig({i})",
            f"    if idx.dim() != {x}.dim() or any(a > b for e, (a, b) in enumerate(zip(idx.shape, {x}.shape)) if e != d):",
            f"        raise ValueError(f'kernelpro expert: gather of an index {{tuple(idx.shape)}} from {{tuple({x}.shape)}}')",
            f"    out = torch.empty(idx.shape, dtype={x}.dtype, device={x}.device)",
            f"    pieces = [({x}, 0, list(idx.shape), list({x}.stride()), 0, list(out.stride()), idx, d,"
            f" {x}.shape[d] if {x}.dim() else 1)]",
            "    result = out",
        ]
    if n.op == "index_select":
        dim, i = n.args[1], names[n.args[2].name]
        return [
            f"    d = {dim} % {x}.dim()",
            f"    idx = _contig({i}).reshape(-1)",
            f"    sizes = list({x}.shape)",
            "    sizes[d] = idx.numel()",
            f"    out = torch.empty(sizes, dtype={x}.dtype, device={x}.device)",
            f"    pieces = [({x}, 0, sizes, list({x}.stride()), 0, list(out.stride()), idx, d, {x}.shape[d])]",
            "    result = out",
        ]
    k = take_position(n)
    i = names[n.args[1][k].name]
    return [
        f"    idx = _contig({i}).reshape(-1)",
        f"    sizes = [*{x}.shape[:{k}], idx.numel(), *{x}.shape[{k + 1}:]]",
        f"    out = torch.empty([*{x}.shape[:{k}], *{i}.shape, *{x}.shape[{k + 1}:]], dtype={x}.dtype, device={x}.device)",
        f"    pieces = [({x}, 0, sizes, list({x}.stride()), 0, list(out.view(sizes).stride()), idx, {k}, {x}.shape[{k}])]",
        "    result = out",
    ]


def _im2col_pieces(x: str, kernel: tuple, dilation: tuple, padding: tuple, stride: tuple) -> list[str]:
    """F.unfold: out[n, (c * KH + i) * KW + j, oh * OW + ow] = x[n, c, oh * sh + i * dh - ph, ow * sw + j * dw - pw]
    (0 outside x). A tap's outputs that read inside x are a rectangle of (oh, ow): one strided piece each."""
    return [
        f"    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = {kernel!r}, {dilation!r}, {padding!r}, {stride!r}",
        f"    xs = {x} if {x}.dim() == 4 else {x}.unsqueeze(0)",
        "    if xs.dim() != 4:",
        f"        raise ValueError(f'kernelpro expert: im2col of a tensor {{tuple({x}.shape)}}')",
        "    bn, c, h, w = xs.shape",
        "    oh, ow = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1",
        "    if oh < 1 or ow < 1:",
        f"        raise ValueError(f'kernelpro expert: no window of {{(kh, kw)}} fits {{tuple({x}.shape)}}')",
        "    taps, npos = kh * kw, oh * ow",
        "    if ph or pw:  # the taps that read the padding leave their zeros",
        "        out = torch.zeros((bn, c * taps, npos), dtype=xs.dtype, device=xs.device)",
        "    else:",
        "        out = torch.empty((bn, c * taps, npos), dtype=xs.dtype, device=xs.device)",
        "    st = list(xs.stride())",
        "    pieces = []",
        "    for i in range(kh):",
        "        for j in range(kw):",
        "            # the output rows and columns whose tap (i, j) reads inside x",
        "            r0, r1 = max(0, -(-(ph - i * dh) // sh)), min(oh, (h - 1 + ph - i * dh) // sh + 1)",
        "            c0, c1 = max(0, -(-(pw - j * dw) // sw)), min(ow, (w - 1 + pw - j * dw) // sw + 1)",
        "            if r1 <= r0 or c1 <= c0:",
        "                continue",
        "            s0 = (r0 * sh + i * dh - ph) * st[2] + (c0 * sw + j * dw - pw) * st[3]",
        "            d0 = (i * kw + j) * npos + r0 * ow + c0",
        "            pieces.append((xs, s0, [bn, c, r1 - r0, c1 - c0], [st[0], st[1], sh * st[2], sw * st[3]], d0,"
        " [c * taps * npos, taps * npos, ow, 1]))",
        f"    result = out if {x}.dim() == 4 else out.squeeze(0)",
    ]


def _edge_pieces(x: str, pad: tuple[int, ...], mode: str) -> list[str]:
    """reflect, replicate and circular padding: along each padded dim the output is three ranges, the middle
    the input itself and each side a block of it read backwards from one element in (reflect), one edge
    element at stride 0 (replicate) or the other end (circular); a piece for each choice of a range a dim."""
    side = {
        "reflect": "[(lo, -1, 0, lo), (0, 1, lo, n), (n - 2, -1, lo + n, hi)]",
        "replicate": "[(0, 0, 0, lo), (0, 1, lo, n), (n - 1, 0, lo + n, hi)]",
        "circular": "[(n - lo, 1, 0, lo), (0, 1, lo, n), (0, 1, lo + n, hi)]",
    }[mode]
    limit = {"reflect": "n - 1", "replicate": "math.inf", "circular": "n"}[mode]  # a pad's largest, per dim
    return [
        f"    pad, nd = {pad!r}, {x}.dim()",
        "    lo, hi = [0] * nd, [0] * nd",
        "    for i in range(len(pad) // 2):  # (left, right) pairs from the last dim back",
        "        lo[nd - 1 - i], hi[nd - 1 - i] = pad[2 * i], pad[2 * i + 1]",
        f"    for n, a, b in zip({x}.shape, lo, hi):",
        f"        if a < 0 or b < 0 or ((a or b) and max(a, b) > {limit}) or ((a or b) and n == 0):",
        f"            raise ValueError(f'kernelpro expert: {mode} padding {{pad}} of a tensor {{tuple({x}.shape)}}')",
        f"    out = torch.empty([s + a + b for s, a, b in zip({x}.shape, lo, hi)], dtype={x}.dtype, device={x}.device)",
        "    # per dim: (source start, source step, destination start, length) of each range",
        f"    ranges = [{side} for n, lo, hi in zip({x}.shape, lo, hi)]",
        "    pieces, combos = [], [[]]",
        "    for rs in ranges:",
        "        combos = [c + [q] for c in combos for q in rs]",
        f"    st, ost = list({x}.stride()), list(out.stride())",
        "    for parts in combos:",
        "        if all(m for *_, m in parts):",
        "            s0 = sum(a * t for (a, _, _, _), t in zip(parts, st))",
        "            d0 = sum(c * t for (_, _, c, _), t in zip(parts, ost))",
        f"            pieces.append(({x}, s0, [m for *_, m in parts], [b * t for (_, b, _, _), t in zip(parts, st)],"
        " d0, ost))",
        "    result = out",
    ]


def _pieces(r: Region, names: dict[str, str], sink: bool = False) -> list[str]:
    """The launcher lines that set `out`, `pieces` ((source, its base, sizes, source strides, the
    destination's base, its strides), in elements) and `result` (out, or a view of it)."""
    n = r.node
    op = n.op
    if op == "flip":
        x = names[n.args[0].name]
        return [
            f"    dims = sorted({{d % {x}.dim() for d in {tuple(n.args[1])!r}}})",
            f"    out = torch.empty({x}.shape, dtype={x}.dtype, device={x}.device)",
            f"    st = list({x}.stride())",
            f"    base = sum(({x}.shape[d] - 1) * st[d] for d in dims if {x}.shape[d] > 0)",
            "    for d in dims:",
            "        st[d] = -st[d]",
            f"    pieces = [({x}, base, list({x}.shape), st, 0, list(out.stride()))]",
            "    result = out",
        ]
    if op == "roll":
        x = names[n.args[0].name]
        shifts = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        dims = tuple(n.args[2]) if len(n.args) > 2 and n.args[2] is not None else ()
        lines = (
            [f"    src = {x}"] if dims else [f"    src = _contig({x}).view(-1)"]
        )  # no dims: the flat tensor
        lines += [
            "    out = torch.empty(src.shape, dtype=src.dtype, device=src.device)",
            "    shift = [0] * src.dim()",
            f"    for s, d in zip({shifts!r}, {dims or (0,)!r}):",
            "        shift[d % src.dim()] += s",
            "    # out[j] = src[(j - shift) mod n] along each dim: one launch over the output",
            "    _place_"
            + r.rid
            + "(sms, src, 0, [s % n if n else 0 for n, s in zip(src.shape, shift)], list(src.shape), out)",
            "    pieces = []",
            f"    result = out{'' if dims else f'.view({x}.shape)'}",
        ]
        return lines
    if op in ("repeat", "tile"):
        x, reps = names[n.args[0].name], tuple(n.args[1])
        return [
            f"    reps = list({reps!r})",
            *([f"    reps = [1] * ({x}.dim() - len(reps)) + reps"] if op == "tile" else []),
            f"    lead = len(reps) - {x}.dim()",
            "    if lead < 0:",
            "        raise ValueError(f'kernelpro expert: {len(reps)} repeats for a tensor of {x.dim()} dims')",
            f"    xs, xst = [1] * lead + list({x}.shape), [0] * lead + list({x}.stride())",
            f"    out = torch.empty([r * s for r, s in zip(reps, xs)], dtype={x}.dtype, device={x}.device)",
            "    # out seen as (r0, s0, r1, s1, ...): the copies' index runs over the repeats at source stride 0",
            "    sizes = [v for r, s in zip(reps, xs) for v in (r, s)]",
            "    sstr = [v for t in xst for v in (0, t)]",
            "    dstr = [v for s, t in zip(xs, out.stride()) for v in (s * t, t)]",
            f"    pieces = [({x}, 0, sizes, sstr, 0, dstr)]",
            "    result = out",
        ]
    if op == "unfold":
        x, dim, size, step = names[n.args[0].name], *n.args[1:4]
        return [
            f"    d = {dim} % max(1, {x}.dim())",
            f"    if {x}.dim() == 0 or {x}.shape[d] < {size}:",
            f"        raise ValueError(f'kernelpro expert: windows of {size} along a dim of {{tuple({x}.shape)}}')",
            f"    sizes, st = list({x}.shape), list({x}.stride())",
            f"    sizes[d] = ({x}.shape[d] - {size}) // {step} + 1",
            "    sstr = list(st)",
            f"    sstr[d] = st[d] * {step}",
            f"    out = torch.empty([*sizes, {size}], dtype={x}.dtype, device={x}.device)",
            f"    pieces = [({x}, 0, [*sizes, {size}], [*sstr, st[d]], 0, list(out.stride()))]",
            "    result = out",
        ]
    if op == "im2col":
        return _im2col_pieces(names[n.args[0].name], *(tuple(v) for v in n.args[1:5]))
    if op == "pad" and pad_mode(n) != "constant":
        return _edge_pieces(names[n.args[0].name], tuple(n.args[1]), pad_mode(n))
    if op in ("pad", "constant_pad_nd"):
        x, pad = names[n.args[0].name], tuple(n.args[1])
        return [
            f"    pad, nd = {pad!r}, {x}.dim()",
            "    lo, hi = [0] * nd, [0] * nd",
            "    for i in range(len(pad) // 2):  # (left, right) pairs from the last dim back",
            "        lo[nd - 1 - i], hi[nd - 1 - i] = pad[2 * i], pad[2 * i + 1]",
            f"    shape = [s + a + b for s, a, b in zip({x}.shape, lo, hi)]",
            "    if min(shape, default=0) < 0:",
            f"        raise ValueError(f'kernelpro expert: padding {{pad}} of a tensor {{tuple({x}.shape)}}')",
            f"    out = torch.empty(shape, dtype={x}.dtype, device={x}.device)",
            "    # the input's part that survives negative padding goes to the middle, the fill around it",
            f"    keep = [max(0, s - max(0, -a) - max(0, -b)) for s, a, b in zip({x}.shape, lo, hi)]",
            f"    s0 = sum(max(0, -a) * t for a, t in zip(lo, {x}.stride()))",
            f"    _place_{r.rid}(sms, {x}, s0, [max(0, a) for a in lo], keep, out)",
            "    pieces = []",
            "    result = out",
        ]
    if op in TAKES:
        return _taken_pieces(r, names)
    xs = "[" + ", ".join(names[a.name] for a in n.args[0]) + "]"
    dim = n.args[1] if len(n.args) > 1 else n.kw("dim", 0)
    if op == "cat":
        return [
            f"    xs = [t for t in {xs} if not (t.dim() == 1 and t.shape[0] == 0)]  # torch skips these",
            f"    first = xs[0] if xs else {xs}[0]",
            f"    d = {dim} % max(1, first.dim())",
            "    for t in xs:",
            "        if t.dim() != first.dim() or t.shape[:d] != first.shape[:d] or t.shape[d + 1:] != first.shape[d + 1:]:",
            "            raise ValueError(f'kernelpro expert: cat of shapes {[tuple(u.shape) for u in xs]} along {d}')",
            "    shape = list(first.shape)",
            "    if xs:",
            "        shape[d] = sum(t.shape[d] for t in xs)",
            "    out = torch.empty(shape, dtype=first.dtype, device=first.device)",
            *(["    pieces, at, slots, joined = [], 0, [], []",
               f"    for t in {xs}:  # in the cat's order, a stand-in's slot in it too",
               "        if t.dim() == 1 and t.shape[0] == 0:  # skipped as torch does; a stand-in gets an empty slot",
               "            if isinstance(t, _Slot):",
               "                slots.append(torch.empty(t.shape, dtype=t.dtype, device=out.device))",
               "            continue",
               "        if isinstance(t, _Slot):  # its producer writes there itself",
               "            slots.append(out.narrow(d, at, t.shape[d]))",
               "        elif t.is_contiguous():  # copied with the others by one launch",
               "            joined.append((t, at))",
               "        else:",
               "            pieces.append((t, 0, list(t.shape), list(t.stride()), at * out.stride(d), list(out.stride())))"]
              if sink else
              ["    pieces, at = [], 0",
               "    for t in xs:",
               "        pieces.append((t, 0, list(t.shape), list(t.stride()), at * out.stride(d), list(out.stride())))"]),
            "        at += t.shape[d]",
            "    result = out",
        ]  # fmt: skip
    # stack
    return [
        f"    xs = {xs}",
        f"    d = {dim} % (xs[0].dim() + 1)",
        "    for t in xs:",
        "        if t.shape != xs[0].shape:",
        "            raise ValueError(f'kernelpro expert: stack of shapes {[tuple(u.shape) for u in xs]}')",
        "    shape = list(xs[0].shape)",
        "    out = torch.empty([*shape[:d], len(xs), *shape[d:]], dtype=xs[0].dtype, device=xs[0].device)",
        "    ost = list(out.stride())",
        "    pieces = [(t, 0, list(t.shape), list(t.stride()), i * ost[d], ost[:d] + ost[d + 1:])",
        f"              for i, t in enumerate(xs){' if not isinstance(t, _Slot)' if sink else ''}]",
        *(["    slots = [out.select(d, i) for i, t in enumerate(xs) if isinstance(t, _Slot)]"] if sink else []),
        "    result = out",
    ]  # fmt: skip


def render(r: Region, dtype: str, threads: int, vec: bool, sink: bool = False) -> Code:
    """sink (cat and stack): inputs may be _Slot stand-ins of elementwise outputs, which are given their
    slices of the output to write into (render.py's sinking); the launcher then returns (result, slots)."""
    rid, n = r.rid, r.node
    sink = sink and n.op in SINKS
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "bool": 1, "int64": 8, "int32": 4, "uint8": 1,
                "int8": 1}[dtype]  # fmt: skip
    unit = UNITS[itemsize]
    lanes = 16 // itemsize
    vec = vec and lanes > 1
    take = n.op in TAKES
    mode = 2 if n.op == "gather" else 1 if take else 0
    vec = vec and mode != 2  # a gather reads its index at element offsets, not at 16-byte units
    names = {v: f"x{i}" for i, v in enumerate(r.inputs)}
    verb = "gather" if mode == 2 else "take" if take else "move"
    back = vec and mode == 0  # a run read backwards (a flip's last dim) also moves 16 bytes a thread
    kernels = (
        [f"kp_{rid}_{verb}"]
        + ([f"kp_{rid}_{verb}16"] if vec else [])
        + ([f"kp_{rid}_{verb}16r"] if back else [])
    )
    cuda = _BODY.format(rid=rid, outer=OUTER) + _kernel(rid, kernels[0], unit, threads, mode)
    if vec:
        cuda += _kernel(rid, kernels[1], "float4", threads, mode)  # 16 bytes, moved as bits
    if back:
        cuda += _kernel(rid, kernels[2], "float4", threads, mode, lane=unit, rev=True)
    placed = n.op in ("pad", "constant_pad_nd", "roll") and pad_mode(n) == "constant"
    fill = fill_bits(pad_value(n), dtype) if placed and n.op != "roll" else 0
    if placed:  # written from the output's side, by elements, and 16 bytes a unit where it aligns (vec)
        kernels += [f"kp_{rid}_place"] + ([f"kp_{rid}_place16"] if vec else [])
        cuda += _place_kernel(rid, f"kp_{rid}_place", unit, n.op == "roll", threads)
        if vec:
            cuda += _place_kernel(rid, f"kp_{rid}_place16", "float4", n.op == "roll", threads)
    join = sink and n.op == "cat"  # its contiguous inputs copied by one launch a JOIN of them
    if join:
        kernels += [f"kp_{rid}_join"] + ([f"kp_{rid}_join16"] if lanes > 1 else [])
        cuda += _join_kernel(rid, f"kp_{rid}_join", unit, threads)
        if lanes > 1:
            cuda += _join_kernel(rid, f"kp_{rid}_join16", "float4", threads)
    sig = _signature(unit, take)
    params = ", ".join(names[v] for v in r.inputs)
    # 16 bytes a thread where every row of the run starts on a 16-byte boundary on both sides: read forwards,
    # or (a flip's last dim) backwards, unit i of a row then being source unit s0 - i with its lanes reversed
    wide = (
        f"    fits = (di == 1 and kin != {OUTER} and inner % {lanes} == 0 and d0 % {lanes} == 0\n"
        f"            and all(v % {lanes} == 0 for v in a + b) and src16 and dst16)\n"
        f"    wide = fits and si == 1 and s0 % {lanes} == 0\n"
        + (f"    back = fits and si == -1 and (s0 + 1) % {lanes} == 0\n" if back else "")
        + f"    if wide{' or back' if back else ''}:\n"
        + (f"        s0 = s0 // {lanes} if wide else (s0 + 1) // {lanes} - 1\n" if back else f"        s0 = s0 // {lanes}\n")
        + f"        inner, d0 = inner // {lanes}, d0 // {lanes}\n"
        f"        a, b = [v // {lanes} for v in a], [v // {lanes} for v in b]\n"
        if vec
        else ""
    )  # fmt: skip
    ints = [p.arg for p in sig.params if p.name not in ("src", "dst", "idx")]
    cut = len(ints) - (3 if take else 0)  # a take's limit, kd and kstr follow its index tensor
    tail = "idx, *extra" if take else ""
    call_args = f"(src, dst, *ints{', ' + tail if tail else ''})"

    def call(k: int) -> str:
        return f"kernels.{kernels[k]}(grid, block, {call_args})  # noqa: F821"

    launch = call(0)
    if vec:
        launch = (
            f"if which == 1:\n        {call(1)}\n"
            + (f"    elif which == 2:\n        {call(2)}\n" if back else "")
            + f"    else:\n        {launch}"
        )  # fmt: skip
    which = "1 if wide else " + ("2 if back else " if back else "") + "0" if vec else "0"
    sunk_doc = (
        "; the slices of _Slot inputs, in the op's order, returned for their producers to fill"
        if sink
        else ""
    )
    ret = "return result, slots" if sink else "return result"
    launcher = f'''_plans_{rid} = {{}}  # a piece's launch by its geometry: dims merged and grid sized once a shape


def _plan_{rid}(sms, s0, sizes, sstr, d0, dstr, kd, limit, src16, dst16):
    """One piece's launch: (which kernel, grid, block, its integer arguments before and after the index),
    or None for a piece of no elements. src16, dst16: whether the tensors start on 16-byte boundaries."""
    if not all(sizes):
        return None
    # unit dims dropped; a dim merged into the one before where both sides stay contiguous (never the indexed)
    merged, kpos = [], -1
    for d, (size, a, b) in enumerate(zip(sizes, sstr, dstr)):
        if d == kd:
            merged.append((size, a, b))
            kpos = len(merged) - 1
        elif size != 1:
            if merged and kpos != len(merged) - 1 and merged[-1][1] == a * size and merged[-1][2] == b * size:
                merged[-1] = (merged[-1][0] * size, a, b)
            else:
                merged.append((size, a, b))
    (inner, si, di), outer = (merged or [(1, 1, 1)])[-1], merged[:-1]
    kin = {OUTER} if merged and kpos == len(merged) - 1 else kpos  # the indexed dim: the run's, or an outer one
    kstr = merged[kpos][1] if kpos >= 0 else 0  # the source's stride along it (a gather steps by it)
    rows = math.prod(size for size, _, _ in outer)
    nd = len(outer)
    z = [size for size, _, _ in outer] + [1] * ({OUTER} - nd)
    a = [v for _, v, _ in outer] + [0] * ({OUTER} - nd)
    b = [v for _, _, v in outer] + [0] * ({OUTER} - nd)
{wide}    tx = min({threads}, 1 << max(0, (inner - 1).bit_length()))  # threads along the run, the rest over rows
    ty = {threads} // tx
    # about 8 units a thread along the run, and no more blocks than 4 waves: a thread's rows then pay
    # their offsets' divisions once (the kernel steps from row to row with carries)
    gx = max(1, min(-(-inner // (tx * 8)), 4096))
    grid = (gx, max(1, min(-(-rows // ty), MAX_GRID_Y, sms * {2048 // threads} * 4 // gx)))
    args = ({", ".join(ints)},)
    return {which}, grid, (tx, ty), args[:{cut}], args[{cut}:]


def _copy_{rid}(sms, src, s0, sizes, sstr, dst, d0, dstr, idx=None, kd=-1, limit=0):
    """One piece: dst[d0 + i . dstr] = src[s0 + i . sstr] over the index space `sizes` (element offsets);
    with `idx`, coordinate i along dim kd reads the source at idx[i] of `limit`. Its launch is planned once
    a geometry (a cat's pieces are the same call after call) and kept."""
    key = (s0, tuple(sizes), tuple(sstr), d0, tuple(dstr), kd, limit, src.data_ptr() % 16 == 0,
           dst.data_ptr() % 16 == 0, sms)
    plan = _plans_{rid}.get(key)
    if plan is None:
        if len(_plans_{rid}) >= 4096:  # shapes that never repeat: start again rather than grow
            _plans_{rid}.clear()
        plan = _plans_{rid}[key] = _plan_{rid}(sms, *key[:9]) or (-1,)
    if plan[0] < 0:
        return
    which, grid, block, ints, extra = plan
    {launch}


{_join_launcher(rid, lanes, threads) if join else ""}{_place_launcher(rid, threads, lanes if vec else 1, fill) if placed else ""}def _move_{rid}(sms, {params}):
    """{n.op} by our strided copies ({threads} threads a block{", 16 bytes a thread where rows align" if vec else ""}){sunk_doc}."""
{chr(10).join(_pieces(r, names, sink))}
    for src, s0, sizes, sstr, d0, dstr, *taken in pieces:
        _copy_{rid}(sms, src, s0, sizes, sstr, out, d0, dstr, *taken)
{"    _join_" + rid + "(sms, out, d, joined)" + chr(10) if join else ""}    {ret}
'''
    return Code(
        cuda=cuda,
        launcher=launcher,
        fn=f"_move_{rid}",
        kernels=tuple(kernels),
        args=tuple(r.inputs),
        outputs=(n.name,),
        sinks=tuple(a.name for a in n.args[0]) if sink else (),  # the cat's order, repeats kept
    )


__all__ = ["OPS", "TAKES", "pad_mode", "pad_value", "render", "take_position"]
