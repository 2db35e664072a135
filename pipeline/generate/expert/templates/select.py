"""Sorting and selection along one dim of rows up to 4096 long (families/select.py): sort, argsort, topk (a
router's top-k of its experts), median and kthvalue, fp32, fp16 and bf16.

A block sorts a row at a time in shared memory: each element becomes a 32-bit key whose unsigned order is
the float order (the sign bit flipped for positives, every bit for negatives; -0.0 taken as +0.0, every
NaN above +inf, as eager orders them; all bits inverted for a descending order) beside its index, the
row padded to a power of two with keys and indices above every real one, then a bitonic network of
compare-exchanges on (key, index) pairs, a barrier between its steps. Ties fall to the lower index, so the
order is the stable one. k of them are written from a start position (0, or the k-th value's, or the
median's (L - 1) / 2, or for a median of a row holding NaN its first NaN, as eager returns): the values
re-read from the row at their index (their exact bits, NaN payloads and signed zeros kept) and the
indices as int64. A dim other than the last is moved there by the launcher (a copy) and the results
viewed back.
"""

from __future__ import annotations

from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code, ctype, launch_bounds, torch_dtype
from pipeline.generate.expert.templates.signature import Signature, i64, ptr

MAX_ROW = 4096

_BODY = r"""namespace kp_{rid} {{
constexpr int L = {length}, P = {padded}, K = {k}, START = {start};
constexpr bool DESC = {desc}, MEDIAN = {median}, NAN_MEDIAN = {nanmedian};
// The unsigned order of the key is the float order; NaN above +inf; -0.0 equal to +0.0.
__device__ __forceinline__ unsigned int sort_key(float v) {{
    if (v != v) return DESC ? 0u : 0xffffffffu;
    if (v == 0.0f) v = 0.0f;
    const unsigned int u = __float_as_uint(v);
    const unsigned int key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return DESC ? ~key : key;
}}
}}  // namespace kp_{rid}
extern "C" __global__ void {bounds} kp_{rid}_select({decls}) {{
    using namespace kp_{rid};
    __shared__ unsigned int keys[P];
    __shared__ int ids[P];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {{
        const {t}* xr = x + row * L;
        for (int i = threadIdx.x; i < P; i += blockDim.x) {{
            keys[i] = i < L ? sort_key(ld(xr[i])) : 0xffffffffu;  // padding after every real element
            ids[i] = i < L ? i : 0x7fffffff;
        }}
        __syncthreads();
        for (int size = 2; size <= P; size <<= 1) {{
            for (int stride = size >> 1; stride > 0; stride >>= 1) {{
                for (int i = threadIdx.x; i < P / 2; i += blockDim.x) {{
                    const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                    const bool up = (lo & size) == 0;  // this pair's half of the bitonic merge ascends
                    const unsigned int ka = keys[lo], kb = keys[hi];
                    const int ia = ids[lo], ib = ids[hi];
                    const bool greater = ka > kb || (ka == kb && ia > ib);
                    if (greater == up) {{
                        keys[lo] = kb; keys[hi] = ka;
                        ids[lo] = ib; ids[hi] = ia;
                    }}
                }}
                __syncthreads();
            }}
        }}
        __shared__ int from;
        if (threadIdx.x == 0) from = START;
        __syncthreads();
        // A NaN in the row (NaN keys sort last, before the padding), at j: the median is that first NaN; the
        // nanmedian is the median of the j values before it ((j - 1) / 2, 0 for a row of NaN: a NaN)
        if (MEDIAN || NAN_MEDIAN)
            for (int j = threadIdx.x; j < L; j += blockDim.x)
                if (keys[j] == 0xffffffffu && ids[j] < L && (j == 0 || keys[j - 1] != 0xffffffffu))
                    from = NAN_MEDIAN ? (j - 1) / 2 : j;
        __syncthreads();
        for (int j = threadIdx.x; j < K; j += blockDim.x) {{
            const int src = ids[from + j];
{store}            idx[row * K + j] = src;
        }}
        __syncthreads();  // the next row overwrites keys and ids
    }}
}}
"""


def render(r: Region, op: str, dtype: str, length: int, k: int, dim: int, desc: bool, threads: int, start: int = 0,
           keep: bool = True) -> Code:  # fmt: skip
    """op: "topk", "sort", "median", "nanmedian" or "kthvalue" (values and indices), "argsort" (indices),
    "median_all" or "nanmedian_all" (the value of the flattened tensor's median). keep: the dim stays (its k elements), else it is dropped."""
    rid = r.rid
    t = ctype(dtype)
    padded = 1 << max(1, (length - 1).bit_length())
    values = op != "argsort"
    sig = Signature((
        ptr("x", t, "xr"), *([ptr("vals", t, const=False)] if values else []), ptr("idx", "long long", const=False),
        i64("rows"),
    ))  # fmt: skip
    threads = max(32, min(threads, padded // 2))
    store = "            vals[row * K + j] = xr[src];\n" if values else ""
    cuda = _BODY.format(rid=rid, length=length, padded=padded, k=k, desc="true" if desc else "false", t=t,
                        bounds=launch_bounds(threads, 0), decls=sig.decls(), store=store, start=start,
                        median="true" if op.startswith("median") else "false",
                        nanmedian="true" if op.startswith("nanmedian") else "false")  # fmt: skip
    x = r.node.args[0]
    flat = op.endswith("median_all")  # the whole tensor is the row
    if flat:
        ret = "vals.reshape(())"
    elif keep:
        ret = "vals.movedim(-1, d), idx.movedim(-1, d)" if values else "idx.movedim(-1, d)"
    else:
        ret = "vals.squeeze(-1), idx.squeeze(-1)"
    what = {"topk": f"the top {k}", "sort": "a sort", "argsort": "an argsort", "median": "the median",
            "median_all": "the median", "nanmedian": "the median of the numbers",
            "nanmedian_all": "the median of the numbers", "kthvalue": f"the value of rank {start + 1}"}[op]  # fmt: skip
    launcher = "\n".join([
        f"def _select_{rid}(sms, x):",
        f'    """{what} of rows of {length} ({"descending" if desc else "ascending"}) by a bitonic sort in '
        'shared memory, a block a row."""',
        f"    d = {dim} % max(1, x.dim())",
        f"    if {'x.numel()' if flat else '(x.shape[d] if x.dim() else 0)'} != {length}:",
        f"        raise ValueError(f'kernelpro expert: rows of {length} expected along dim {dim}, not {{tuple(x.shape)}}')",
        f"    xr = _contig({'x.reshape(1, -1)' if flat else 'x.movedim(d, -1)'})",
        "    rows = xr.numel() // max(1, xr.shape[-1])",
        *([f"    vals = torch.empty((*xr.shape[:-1], {k}), dtype={torch_dtype(dtype)}, device=x.device)"]
          if values else []),
        f"    idx = torch.empty((*xr.shape[:-1], {k}), dtype=torch.int64, device=x.device)",
        "    if rows:",
        f"        kernels.kp_{rid}_select((max(1, min(rows, sms * 16)),), ({threads},), ({sig.args()}))  # noqa: F821",
        f"    return {ret}",
    ])  # fmt: skip
    return Code(cuda, launcher, f"_select_{rid}", (f"kp_{rid}_select",), (x.name,), r.outputs)


__all__ = ["MAX_ROW", "render"]
