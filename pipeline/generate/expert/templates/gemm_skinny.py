"""fp32 linear layers over few rows (a handful of tokens, a classifier head, a batch of 10) on the CUDA
cores, at fp32 accuracy without the 3xTF32 split (which family takes them: families/gemm_skinny.py).

A 128-row tensor-core tile over 20 rows computes 6x what is needed, and with a few output columns the grid
is one tile walking all of K. Here a block of 256 threads owns `cols` output columns: its 8 warps split K
(thread t reads elements 4t, 4t + 1024, ... of each weight row, 16 bytes at a time, so a block's loads of
a row are one contiguous run), each thread keeping `rows` x `cols` partial sums for a group of `rows`
rows of x. The sums meet by warp shuffles, then across the warps in shared memory, in a fixed order
(deterministic), and the fused epilogue runs on each total before the one store. The weight is read once
for each group of rows (the later groups find it in L2); x, small, is re-read by every block from L2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates import gemm
from pipeline.generate.expert.templates.code import Code, ctype, torch_dtype
from pipeline.generate.expert.templates.gemm import GemmEpilogue
from pipeline.generate.expert.templates.signature import Signature, i32, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.gemm_skinny import SkinnyPlan

THREADS = 256
WARPS = THREADS // 32


def signature(epi: GemmEpilogue | None, out_dt: str) -> Signature:
    ops_ = epi.operands if epi else ()
    return Signature((
        ptr("x", "float"), ptr("w", "float"), ptr("out", ctype(out_dt), const=False),
        *(ptr(f"e{k}", ctype(d)) for k, (_, d, _) in enumerate(ops_)),
        i32("M", "m"), i32("N", "n"), i32("K", "k"), i32("V", "vec"),
    ))  # fmt: skip


def kernel(rid: str, rp: SkinnyPlan, epi: GemmEpilogue | None, out_dt: str, sig: Signature) -> str:
    """The kernel: rows x cols sums a thread, reduced across the block, the epilogue on each total."""
    value = gemm.epilogue_call(epi, "a", "", "n", "v") if epi else "v = a"
    return f"""extern "C" __global__ void __launch_bounds__({THREADS})
kp_{rid}_skinny({sig.decls()}) {{
    constexpr int ROWS = {rp.rows}, COLS = {rp.cols}, WARPS = {WARPS};
    __shared__ float part[WARPS][ROWS][COLS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long n0 = (long long)blockIdx.x * COLS;
    for (long long m0 = (long long)blockIdx.y * ROWS; m0 < M; m0 += (long long)gridDim.y * ROWS) {{
        float acc[ROWS][COLS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
        if (V == 4) {{  // K a multiple of 4 and both tensors 16-byte aligned: float4 loads
            for (long long k = 4LL * threadIdx.x; k < K; k += 4LL * {THREADS}) {{
                float4 wv[COLS];
#pragma unroll
                for (int c = 0; c < COLS; ++c)
                    wv[c] = n0 + c < N ? *reinterpret_cast<const float4*>(w + (n0 + c) * K + k)
                                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {{
                    if (m0 + r >= M) break;
                    const float4 xv = *reinterpret_cast<const float4*>(x + (m0 + r) * K + k);
#pragma unroll
                    for (int c = 0; c < COLS; ++c)
                        acc[r][c] += xv.x * wv[c].x + xv.y * wv[c].y + xv.z * wv[c].z + xv.w * wv[c].w;
                }}
            }}
        }} else {{
            for (long long k = threadIdx.x; k < K; k += {THREADS}) {{
                float wv[COLS];
#pragma unroll
                for (int c = 0; c < COLS; ++c) wv[c] = n0 + c < N ? w[(n0 + c) * K + k] : 0.0f;
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {{
                    if (m0 + r >= M) break;
                    const float xv = x[(m0 + r) * K + k];
#pragma unroll
                    for (int c = 0; c < COLS; ++c) acc[r][c] += xv * wv[c];
                }}
            }}
        }}
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int c = 0; c < COLS; ++c) {{
                float s = acc[r][c];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (lane == 0) part[warp][r][c] = s;
            }}
        __syncthreads();
        for (int t = threadIdx.x; t < ROWS * COLS; t += {THREADS}) {{
            const long long r = m0 + t / COLS, n = n0 + t % COLS;
            if (r < M && n < N) {{
                const long long m = r;  // a linear layer's rows: its matrix is the whole output
                (void)m;
                float a = 0.0f;
                for (int q = 0; q < WARPS; ++q) a += part[q][t / COLS][t % COLS];
                float v;
                {value};
                out[r * N + n] = kp::cv<{ctype(out_dt)}>(v);
            }}
        }}
        __syncthreads();  // the next group of rows rewrites part[]
    }}
}}
"""


def outer_kernel(rid: str, k: int, epi: GemmEpilogue | None, out_dt: str, sig: Signature) -> str:
    """A layer over a K of a few (TINY_K): one output column a thread, its weight row held in registers,
    the rows walked by the grid's y; K FMAs and the epilogue an output, the stores coalesced along n."""
    value = gemm.epilogue_call(epi, "a", "", "n", "v") if epi else "v = a"
    return f"""extern "C" __global__ void __launch_bounds__({THREADS})
kp_{rid}_outer({sig.decls()}) {{
    constexpr int TK = {k};
    const long long n = (long long)blockIdx.x * {THREADS} + threadIdx.x;
    if (n >= N || K != TK) return;
    float wk[TK];
#pragma unroll
    for (int j = 0; j < TK; ++j) wk[j] = w[n * TK + j];
    for (long long r = blockIdx.y; r < M; r += gridDim.y) {{
        float a = 0.0f;
#pragma unroll
        for (int j = 0; j < TK; ++j) a = fmaf(x[r * TK + j], wk[j], a);
        const long long m = r;  // a linear layer's rows: its matrix is the whole output
        (void)m;
        (void)V;
        float v;
        {value};
        out[r * N + n] = kp::cv<{ctype(out_dt)}>(v);
    }}
}}
"""


def render(r: Region, rp: SkinnyPlan, epi: GemmEpilogue | None, tiny_k: int = 0) -> Code:
    """The kernel and its launcher for an fp32 linear layer (x (..., K) by a weight (N, K)); tiny_k: the
    static K of a layer over a few of it, which takes outer_kernel."""
    rid = r.rid
    out_dt = epi.out_dtype if epi else "float32"
    sig = signature(epi, out_dt)
    ops_ = epi.operands if epi else ()
    names, values, outs = gemm.region_io(r, epi)
    if tiny_k:
        header = f"// region {rid}: x @ w^T over K = {tiny_k} on the CUDA cores (an output a thread)"
        body = outer_kernel(rid, tiny_k, epi, out_dt, sig)
    else:
        header = (
            f"// region {rid}: x @ w^T over few rows on the CUDA cores ({rp.rows} x {rp.cols} sums a thread)"
        )
        body = kernel(rid, rp, epi, out_dt, sig)
    cuda = "\n".join([header, *gemm.epilogue_function(epi, out_dt), body])
    lines = [
        f"def _skinny_{rid}(sms, {', '.join(names)}):",
        f'    """x @ w^T{" and the fused epilogue" if epi else ""}: '
        + (
            f"K = {tiny_k}, CUDA cores, an output a thread."
            if tiny_k
            else f"few rows, CUDA cores, {rp.cols} columns a block."
        )
        + '"""',
        "    k = x.shape[-1]",
        "    lead = tuple(x.shape[:-1])",
        "    n = w.shape[0]",
        "    m = math.prod(lead)",
        "    x, w = _contig(x), _contig(w)",
        f"    out = torch.empty((m, n), dtype={torch_dtype(out_dt)}, device=x.device)",
        *gemm.operand_lines(ops_, "*lead", "m"),
        "    if m and n:",
    ]
    if tiny_k:
        lines += [
            f"        if k != {tiny_k}:",
            f"            raise ValueError(f'kernelpro expert: compiled for K = {tiny_k}, got {{k}}')",
            "        vec = 1",
            f"        grid = (-(-n // {THREADS}), min(m, MAX_GRID_Y))",
            f"        kernels.kp_{rid}_outer(grid, ({THREADS},), ({sig.args()}))  # noqa: F821",
        ]
    else:
        lines += [
            "        vec = 4 if k % 4 == 0 and _aligned((x, w), 4) else 1",
            f"        grid = (-(-n // {rp.cols}), min(-(-m // {rp.rows}), MAX_GRID_Y))",
            f"        kernels.kp_{rid}_skinny(grid, ({THREADS},), ({sig.args()}))  # noqa: F821",
        ]
    lines.append("    return out.reshape(*lead, n)")
    return Code(
        cuda + "\n",
        "\n".join(lines),
        f"_skinny_{rid}",
        (f"kp_{rid}_outer" if tiny_k else f"kp_{rid}_skinny",),
        values,
        outs,
    )
