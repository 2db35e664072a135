"""Binning (families/bins.py): torch.histc's counts over a fixed range, and bucketize / searchsorted's
positions of values among sorted boundaries.

histc: a grid-stride stream over the flattened input (16-byte loads where it is aligned); each element's bin
is eager's CUDA rule, (v - min) * bins / (max - min) truncated in fp32 ops that nothing contracts or
approximates, the value max in the last bin, NaN and what lies outside [min, max] dropped. A block counts
into its own histogram in shared memory (`copies` of it, one per group of warps, so warps that hit the same
busy bins queue less on its atomics), then adds each non-zero total to the output once: one global atomic
per bin a block, not one per element. The counts are exact in the fp32 output up to 2^24 a bin, as eager's.
Without the shared copy (`private` off) each element adds to the output directly.

bucketize / searchsorted: each element's binary search among the boundaries, eager's own search (the same
midpoints and tests, so NaN lands past the end and unsorted boundaries give eager's answer), the 1-D
boundaries staged once a block in shared memory where they fit. A searchsorted of N-D boundaries searches
the row of them that matches the value's row.
"""

from __future__ import annotations

from pipeline.generate.expert import ops
from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code, ctype, launch_bounds
from pipeline.generate.expert.templates.signature import Signature, i64, ptr

SHARED_BYTES = 48 * 1024  # static shared memory a block may hold without opting in
MAX_PRIVATE_BINS = SHARED_BYTES // 4  # unsigned counts
MAX_STAGED = SHARED_BYTES // 4  # boundaries kept as floats

_HISTC = r"""namespace kp_{rid} {{
constexpr int B = {bins}, COPIES = {copies};
constexpr bool PRIVATE = {private};
// eager's bin of v, or -1 for NaN and values outside [LO, HI]; the _rn ops keep nvcc from fusing or
// approximating the arithmetic, so a value on a bin's edge falls where eager puts it
__device__ __forceinline__ int bin_of(float v) {{
    const float lo = {lo}, hi = {hi};
    if (!(v >= lo && v <= hi)) return -1;
    const int b = (int)__fdiv_rn(__fmul_rn(__fsub_rn(v, lo), (float)B), __fsub_rn(hi, lo));
    return b == B ? B - 1 : b;
}}
__device__ __forceinline__ void count(unsigned int* hist, float* out, float v) {{
    const int b = bin_of(v);
    if (b < 0) return;
    if (PRIVATE) atomicAdd(&hist[b], 1u);
    else atomicAdd(&out[b], 1.0f);
}}
}}  // namespace kp_{rid}
template <int VEC>
__device__ __forceinline__ void kp_{rid}_histc_body(const {t}* __restrict__ x, float* __restrict__ out, long long n) {{
    using namespace kp_{rid};
    __shared__ unsigned int hist[PRIVATE ? B * COPIES : 1];
    if (PRIVATE) {{
        for (int i = threadIdx.x; i < B * COPIES; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
    }}
    // this thread's copy: warps split evenly among the copies
    unsigned int* mine = hist + (PRIVATE ? ((threadIdx.x >> 5) % COPIES) * B : 0);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long vecs = n / VEC;
    for (long long i = first; i < vecs; i += stride) {{
        const kp::Vec<{t}, VEC> v = kp::vload<{t}, VEC>(x + i * VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) count(mine, out, ld(v.v[j]));
    }}
    for (long long i = vecs * VEC + first; i < n; i += stride) count(mine, out, ld(x[i]));
    if (PRIVATE) {{
        __syncthreads();
        for (int b = threadIdx.x; b < B; b += blockDim.x) {{
            unsigned int total = 0u;
#pragma unroll
            for (int c = 0; c < COPIES; ++c) total += hist[c * B + b];
            if (total) atomicAdd(&out[b], (float)total);
        }}
    }}
}}
"""

_SEARCH = r"""namespace kp_{rid} {{
constexpr bool RIGHT = {right}, STAGED = {staged};
// eager's search over [0, len): the first boundary >= v (> v to the right); NaN compares false: past the end
__device__ __forceinline__ long long search(const {b}* __restrict__ seq, const float* staged, long long len, float v) {{
    long long lo = 0, hi = len;
    while (lo < hi) {{
        const long long mid = lo + ((hi - lo) >> 1);
        const float m = STAGED ? staged[mid] : ld(seq[mid]);
        if (RIGHT ? !(m > v) : !(m >= v)) lo = mid + 1;
        else hi = mid;
    }}
    return lo;
}}
}}  // namespace kp_{rid}
extern "C" __global__ void {bounds} kp_{rid}_search({decls}) {{
    using namespace kp_{rid};
    __shared__ float staged[STAGED ? {length} : 1];
    if (STAGED) {{
        for (long long i = threadIdx.x; i < len; i += blockDim.x) staged[i] = ld(seq[i]);
        __syncthreads();
    }}
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {{
        // the row of boundaries this value searches: the same leading index (0 for 1-D boundaries)
        const {b}* row = seq + (per_row ? (i / per_row) * len : 0);
        out[i] = ({o})search(row, staged, len, ld(x[i]));
    }}
}}
"""


def histc(
    r: Region, dtype: str, bins: int, lo: float, hi: float, threads: int, private: bool, copies: int
) -> Code:
    """The histc kernel of a region whose input has `dtype` (the output: fp32 counts)."""
    rid, t = r.rid, ctype(dtype)
    copies = copies if private else 1
    cuda = _HISTC.format(rid=rid, t=t, bins=bins, copies=copies, private="true" if private else "false",
                         lo=ops.lit(lo), hi=ops.lit(hi))  # fmt: skip
    sig = Signature((ptr("x", t, "xf"), ptr("out", "float", const=False), i64("n")))
    names = (f"kp_{rid}_histc", f"kp_{rid}_histc4")
    for name, vec in zip(names, (1, 4), strict=True):
        cuda += (f'extern "C" __global__ void {launch_bounds(threads, 0)} {name}({sig.decls()}) {{\n'
                 f"    kp_{rid}_histc_body<{vec}>({sig.names()});\n}}\n")  # fmt: skip
    how = f"a histogram in shared memory{f' ({copies} copies)' if copies > 1 else ''} a block" if private else \
        "global atomics"  # fmt: skip
    call = f"((blocks,), ({threads},), ({sig.args()}))  # noqa: F821"
    x = r.node.args[0]
    launcher = "\n".join([
        f"def _histc_{rid}(sms, x):",
        f'    """{bins} bins over [{lo!r}, {hi!r}] of every element, by {how}."""',
        "    xf = _contig(x).reshape(-1)",
        "    n = xf.numel()",
        f"    out = torch.zeros(({bins},), dtype=torch.float32, device=x.device)",
        "    if n:",
        f"        blocks = max(1, min(-(-n // ({threads} * 4)), sms * {max(1, 2048 // threads)}))",
        "        if xf.data_ptr() % 16 == 0:",
        f"            kernels.{names[1]}{call}",
        "        else:",
        f"            kernels.{names[0]}{call}",
        "    return out",
    ])  # fmt: skip
    return Code(cuda, launcher, f"_histc_{rid}", names, (x.name,), r.outputs)


def search(r: Region, dtype: str, seq_dtype: str, length: int, per_row: bool, right: bool, out_dtype: str,
           threads: int, staged: bool) -> Code:  # fmt: skip
    """The bucketize / searchsorted kernel: values of `dtype` among `length` boundaries of `seq_dtype` (a
    1-D tensor, or rows of one matching the values' rows where per_row); int64 or int32 positions."""
    rid, t, b = r.rid, ctype(dtype), ctype(seq_dtype)
    staged = staged and not per_row and length <= MAX_STAGED
    o = ctype(out_dtype)
    sig = Signature((ptr("x", t, "xf"), ptr("seq", b, "sf"), ptr("out", o, const=False), i64("n"),
                     i64("len", str(max(1, length))), i64("per_row")))  # fmt: skip
    cuda = _SEARCH.format(rid=rid, b=b, o=o, right="true" if right else "false",
                          staged="true" if staged else "false", length=max(1, length),
                          bounds=launch_bounds(threads, 0), decls=sig.decls())  # fmt: skip
    node = r.node
    seq_ref, x_ref = (
        (node.args[0], node.args[1]) if node.op == "searchsorted" else (node.args[1], node.args[0])
    )
    shared = " staged in shared memory" if staged else ""
    launcher = "\n".join([
        f"def _search_{rid}(sms, x, s):",
        f'    """each value\'s place among {length} sorted boundaries{shared}, by binary search."""',
        f"    if s.shape[-1] != {length}:",
        f"        raise ValueError(f'kernelpro expert: {length} boundaries expected, not {{tuple(s.shape)}}')",
        "    xf, sf = _contig(x), _contig(s)",
        "    n = xf.numel()",
        f"    out = torch.empty(x.shape, dtype=torch.{out_dtype}, device=x.device)",
        f"    per_row = {'x.shape[-1] if x.dim() else 1' if per_row else '0'}",
        "    if n:",
        f"        blocks = max(1, min(-(-n // {threads}), sms * {max(1, 2048 // threads)}))",
        f"        kernels.kp_{rid}_search((blocks,), ({threads},), ({sig.args()}))  # noqa: F821",
        "    return out",
    ])  # fmt: skip
    return Code(
        cuda, launcher, f"_search_{rid}", (f"kp_{rid}_search",), (x_ref.name, seq_ref.name), r.outputs
    )


__all__ = ["MAX_PRIVATE_BINS", "MAX_STAGED", "histc", "search"]
