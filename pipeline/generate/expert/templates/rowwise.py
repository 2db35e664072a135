"""Ops over the trailing dimensions of a row: reductions, softmax / log-softmax, layer / RMS / group /
instance norm. A block per row (grid-stride over rows) or, for short rows, a warp per row.

Pass 1 reads the row once (16-byte vectors after a scalar head up to the first aligned element) and
merges per-thread accumulators with warp shuffles or a shared-memory tree. Two-pass ops then write the
row, re-reading it from global memory (mostly L2) or, with `smem_row`, from a shared-memory copy made in
pass 1. Reductions over rows too few to fill the GPU may split each row across blocks and merge the
partial accumulators in a second small kernel. Two-pass ops over such rows (a LayerNorm over 4M-element
rows, 16 of them) split them too: a first kernel writes each block's partial statistics, a second merges a
row's partials in every block and writes that block's part of the row (two reads and a write per element,
the whole GPU busy, where a block per row would leave all but 16 SMs idle). A two-pass op whose row is too
long for one block's shared memory but fits a thread-block cluster's (`cluster`: 2 to 16 blocks, a row of
up to ~3 MB of fp32; 16 where the GPU has room for so wide a cluster, else a block per row) spreads each row
over a cluster: every block caches its segment in shared memory while it reads it (`unroll` 16-byte loads
in flight a thread), the blocks' statistics are merged through distributed shared memory (in rank order:
deterministic), and each block writes its segment from its cache: one DRAM read and one write an element,
where a block per row reads a row of that length twice from DRAM. Where a segment fits the block's
registers (`regs` vectors a thread, 128 floats at most), it is held there instead: no shared-memory round trip.
A row no cluster holds (over 3 MB) is cut into the tiles of a persistent cooperative grid (`grid_row`, every
block resident: the launcher sizes it by the runtime's active_blocks and launches it cooperatively): each step
a block reads its tile of one row for the statistics and writes its tile of the row before, whose partials
its blocks published a step ago; that tile is re-read from L2, so DRAM sees one read and one write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.generate.expert import ops
from pipeline.generate.expert.layout import RowLayout
from pipeline.generate.expert.regions import Region, RegionKind
from pipeline.generate.expert.templates import reduce_ops, shapes
from pipeline.generate.expert.templates.code import Code, ctype, grid_sms, launch_bounds, region_source
from pipeline.generate.expert.templates.fused import Fused, identity
from pipeline.generate.expert.templates.signature import Param, Signature, Variant, i32, i64, kernel, ptr

if TYPE_CHECKING:
    from pipeline.generate.expert.families.rowwise import RowPlan

MAX_SMEM_ROW = 160 * 1024  # bytes of shared memory a cached row (or a block's rows) may take
MAX_REGS = 16  # vectors per thread a register-held row may take (64 fp32 registers at 16-byte vectors)
GRID_TILE = 8192  # elements of a row a cooperative grid's block takes, at least (a step's reads stay in L2)
MAX_CLUSTER = 16  # blocks a cluster: beyond the portable 8, the runtime opts in (not every GPU has room)
PORTABLE_CLUSTER = 8
CLUSTER_SMEM = 227 * 1024  # dynamic shared memory a block of a cluster may take (the H100/H200 limit)
# A cluster's block holding its segment in registers: floats a block may hold (half an SM's 64K registers,
# the rest for the kernel's own), and floats a thread may (a 256-thread block's 128 of its 255).
CLUSTER_REG_FLOATS = 32 * 1024
CLUSTER_THREAD_FLOATS = 128

# A row spread over blocks of a cooperative grid (`grid_row`): a block's statistics published with a release
# (fence, then the row's counter), the row's counter awaited with an acquire, the partials read past L1
# (L1 is not coherent with other SMs' writes). Emitted only beside such a kernel; the emulator has its own.
GRID_HELPERS = r"""#ifndef KP_GRID_DEFINED
#define KP_GRID_DEFINED
__device__ __forceinline__ void kp_grid_arrive(int* count) {
    __threadfence();
    atomicAdd(count, 1);
}
__device__ __forceinline__ void kp_grid_wait(const int* count, int target) {
    int seen;
    while (true) {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
        if (seen >= target) break;
        __nanosleep(64);
    }
}
template <class T>
__device__ __forceinline__ T kp_ld_cg(const T* p) {
    static_assert(sizeof(T) == 16, "a 16-byte partial");
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p));
    T out;
    memcpy(&out, &v, 16);
    return out;
}
#endif"""

# A grid row's tiles kept in L2 for their second read (`l2_hints`): the first read's lines marked evict_last, the
# second read's and the stores' evict_first, so the write stream does not push the tiles still to be re-read
# out of L2 (ncu on the H100: without hints 12.3-12.6 GB read for GroupNorm's 7.5 GB, an L2 hit rate of 45%).
# Emitted only beside such a kernel: 16-byte vectors only (others as vload/vstore), plain in the emulator.
HINT_HELPERS = r"""#ifndef KP_HINTS_DEFINED
#define KP_HINTS_DEFINED
template <typename T, int V, bool LAST>
__device__ __forceinline__ Vec<T, V> kp_vload_hint(const T* p) {
#ifndef KP_EMULATED
    if constexpr (sizeof(T) * V == 16) {
        KP_CHECK_ALIGN(p, 16);
        unsigned long long pol;
        if constexpr (LAST) asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
        else asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        int4 b;
        asm volatile("ld.global.L2::cache_hint.v4.b32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w) : "l"(p), "l"(pol));
        Vec<T, V> v;
        memcpy(&v, &b, 16);
        return v;
    }
#endif
    return vload<T, V>(p);
}
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> kp_vload_last(const T* p) { return kp_vload_hint<T, V, true>(p); }
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> kp_vload_first(const T* p) { return kp_vload_hint<T, V, false>(p); }
template <typename T, int V>
__device__ __forceinline__ void kp_vstore_first(T* p, const Vec<T, V>& v) {
#ifndef KP_EMULATED
    if constexpr (sizeof(T) * V == 16) {
        KP_CHECK_ALIGN(p, 16);
        unsigned long long pol;
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        const int4 b = *reinterpret_cast<const int4*>(&v);
        asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;"
                     :: "l"(p), "r"(b.x), "r"(b.y), "r"(b.z), "r"(b.w), "l"(pol) : "memory");
        return;
    }
#endif
    vstore<T, V>(p, v);
}
#endif"""

# Kahan's step, s += x with the add's rounding error kept in c and taken off the next one: emitted only beside
# a compensated sum (guarded, as the cluster's helpers below), so no other kernel's source changes.
KAHAN_HELPER = r"""#ifndef KP_KAHAN_DEFINED
#define KP_KAHAN_DEFINED
__device__ __forceinline__ void kahan_add(float& s, float& c, float x) {
    const float y = x - c;
    const float t = s + y;
    c = (t - s) - y;
    s = t;
}
#endif"""

# The cluster's three primitives, emitted only beside a cluster kernel (guarded: several regions may carry
# them), so no other kernel's source, and so no recorded candidate's key, changes. The CPU emulator
# (tests/cuda_emulator.py) defines KP_EMULATED and its own versions.
CLUSTER_HELPERS = r"""#ifndef KP_CLUSTER_DEFINED
#define KP_CLUSTER_DEFINED
#ifndef KP_EMULATED
// This block's rank in its cluster; the cluster's barrier (release/acquire: shared-memory writes before it
// are seen by every block of the cluster after it); a pointer into another block's shared memory (mapa on
// a generic address gives a generic one in the cluster's shared window).
__device__ __forceinline__ unsigned kp_cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void kp_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The same barrier split: arrive once this block's reads of the others' shared memory are done, wait only
// before that memory is written again (or the block exits), so the write pass runs in between.
__device__ __forceinline__ void kp_cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void kp_cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
template <class T>
__device__ __forceinline__ T* kp_cluster_map(T* p, unsigned rank) {
    unsigned long long out;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(p), "r"(rank));
    return reinterpret_cast<T*>(out);
}
#endif
// A block's cached segment in shared memory, 16 bytes at a time (V a multiple of 4): scalar accesses at a
// vector's stride put 4 lanes (8 for 16-bit inputs) on each bank. The caller's layout keeps every vector on a
// 16-byte boundary (column c at kc + c, kc the segment's start mod V). In PTX: through a float4 pointer NVVM
// proved only 8 bytes of alignment and split each access in two (STS.64), or in four.
template <int V>
__device__ __forceinline__ void kp_cache_put(float* p, const float (&w)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int k = 0; k < V; k += 4) {
            KP_CHECK_ALIGN(p + k, 16);
#ifndef KP_EMULATED
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"((unsigned)__cvta_generic_to_shared(p + k)),
                         "f"(w[k]), "f"(w[k + 1]), "f"(w[k + 2]), "f"(w[k + 3]) : "memory");
#else
            *reinterpret_cast<float4*>(p + k) = make_float4(w[k], w[k + 1], w[k + 2], w[k + 3]);
#endif
        }
    } else {
#pragma unroll
        for (int e = 0; e < V; ++e) p[e] = w[e];
    }
}
template <int V>
__device__ __forceinline__ void kp_cache_get(const float* p, float (&w)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int k = 0; k < V; k += 4) {
            KP_CHECK_ALIGN(p + k, 16);
#ifndef KP_EMULATED
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                         : "=f"(w[k]), "=f"(w[k + 1]), "=f"(w[k + 2]), "=f"(w[k + 3])
                         : "r"((unsigned)__cvta_generic_to_shared(p + k)) : "memory");
#else
            const float4 q = *reinterpret_cast<const float4*>(p + k);
            w[k] = q.x, w[k + 1] = q.y, w[k + 2] = q.z, w[k + 3] = q.w;
#endif
        }
    } else {
#pragma unroll
        for (int e = 0; e < V; ++e) w[e] = p[e];
    }
}
#endif"""


def row_lanes(rp: RowPlan, whole: bool) -> int:
    """The lanes a row takes in the warp-per-row kernel: the plan's `lanes` (a power of two under 32, several
    short rows a warp) where a row is whole to its group (`whole`: not split over blocks, not cached in shared
    memory), else a warp's 32."""
    ok = rp.warp_rows and whole and 0 < rp.lanes < 32 and rp.lanes & (rp.lanes - 1) == 0
    return rp.lanes if ok else 32


def render(
    region: Region, lay: RowLayout, rp: RowPlan, pre: Fused | None, post: Fused | None, strided: bool = False
) -> Code:
    """strided: the input may be a strided view (a head of a permuted qkv); a reduction, or a two-pass op
    other than group norm with no row cached in shared memory, that runs only the block- or warp-per-row
    kernel then reads its rows in place at three row strides (elementwise.py's rows), where the launcher
    gathered a contiguous copy first. This decides which; the family only says whether x is such a view."""
    rid = region.rid
    kind = reduce_ops.KINDS[lay.op]
    two_pass = lay.op in reduce_ops.TWO_PASS
    is_reduce = region.kind is RegionKind.REDUCE
    splits = is_reduce and rp.splits > 0 and not rp.warp_rows
    in_place = (
        strided
        and (is_reduce or (two_pass and not rp.smem_row and lay.op != "group_norm"))
        and not splits
        and not pre
        and not regs_ok(lay, rp, region)
        and not cluster_ok(lay, rp, region)
        and not grid_row_ok(lay, rp, region)
        and not split_two_pass(lay, rp, region)
    )
    x_dt = pre.main_dtype if pre else lay.in_dtype
    out_dt = post.out_dtype if post else lay.out_dtype
    warp = rp.warp_reduce or rp.warp_rows
    cache = two_pass and rp.smem_row
    batched = is_reduce and rp.unroll > 1
    # a prologue's same-shape operands loaded as vectors beside x in the batched loop: read element by element
    # (4-byte loads 16 bytes apart a lane) they cost MSE's reduction a load instruction an element
    fvec = tuple(pre.vector_operands()) if pre and batched and not in_place else ()
    fvec_ops = [(f"{pre.prefix}{k}", pre.extra[k][1]) for k in fvec] if pre else []  # (name, dtype)

    params: list[Param] = [ptr("x", ctype(x_dt)), *(pre.params() if pre else [])]
    if lay.has_weight:
        params.append(ptr("w", ctype(lay.w_dtype)))
    if lay.has_bias:
        params.append(ptr("b", ctype(lay.w_dtype)))
    indices_only = lay.op in ("argmax", "argmin")
    params.append(ptr("y", "long long" if indices_only else ctype(out_dt), const=False))
    if lay.indices and not indices_only:
        params.append(ptr("yi", "long long", const=False))
    if splits:
        params.append(ptr("ws", "Acc", const=False))
    params += [i64("rows"), i64("cols")]
    if splits:
        params.append(i64("chunk"))
    if lay.op == "group_norm":
        params += [i64("groups"), i64("cg")]
    if in_place:  # x's row r starts at i0 * xf + i1 * xe + i2 * xd, r = (i0 * rn1 + i1) * rn2 + i2
        params += [i64("rn1"), i64("rn2"), i64("xf"), i64("xe"), i64("xd")]
    sig = Signature((*params, *(post.params() if post else [])))

    body = [
        *([KAHAN_HELPER] if is_reduce and kind.op == "SumOp" else []),
        "template <int V, bool CACHE>",
        f"__device__ __forceinline__ void kp_{rid}_body({sig.decls()}) {{",
        "    extern __shared__ __align__(16) unsigned char kp_smem[];",
        "    Acc* red = reinterpret_cast<Acc*>(kp_smem);",
    ]
    lanes = row_lanes(rp, not splits and not cache)
    if lanes < 32:  # several short rows a warp: a group of lanes each; a warp runs while its first row does
        body += [
            f"    constexpr int L = {lanes};  // lanes a row, {32 // lanes} rows a warp",
            "    const int tid = threadIdx.x & (L - 1), nt = L, wib = threadIdx.x / L;",
            "    const long long lag = wib % (32 / L);  // the row's place among its warp's",
            "    const long long r0 = (long long)blockIdx.x * (blockDim.x / L) + wib;",
            "    const long long rstep = (long long)gridDim.x * (blockDim.x / L);",
            "    float* cache = nullptr;",
        ]
    elif rp.warp_rows:
        body += [
            "    const int tid = threadIdx.x & 31, nt = 32, wib = threadIdx.x >> 5;",
            "    const long long r0 = (long long)blockIdx.x * (blockDim.x >> 5) + wib;",
            "    const long long rstep = (long long)gridDim.x * (blockDim.x >> 5);",
            "    float* cache = reinterpret_cast<float*>(kp_smem) + wib * cols;",
        ]
    else:
        red_n = "33" if warp else "blockDim.x"
        body += [
            "    const int tid = threadIdx.x, nt = blockDim.x;",
            "    const long long r0 = blockIdx.x, rstep = gridDim.x;",
            f"    float* cache = reinterpret_cast<float*>(kp_smem + sizeof(Acc) * {red_n});",
        ]
    body += ["    (void)cache;", "    (void)red;"]
    body.append(pre.lam("pre") if pre else identity("pre"))
    if fvec:
        body.append(pre.lam("prev", fvec))
    body.append(post.lam("post") if post else identity("post"))
    # A group past the last row reads the last again (a guard on its reads spilled); a one-pass reduction stores
    # nothing of it, a two-pass op writes the last row's values again, the same bits.
    if lanes < 32:
        body += [
            "    for (long long q = r0; q - lag < rows; q += rstep) {",
            "        const long long r = q < rows ? q : rows - 1;",
        ]
    else:
        body.append("    for (long long r = r0; r < rows; r += rstep) {")
    body += [
        "        const long long rs = r * cols;",
    ]
    if splits:
        body += [
            "        const long long c0 = blockIdx.y * chunk;",
            "        const long long n = c0 < cols ? (cols - c0 < chunk ? cols - c0 : chunk) : 0;",
        ]
    else:
        body += ["        const long long c0 = 0, n = cols;"]
    body += [
        "        const long long start = rs + c0;",
        *(
            [
                "        const long long i2 = r % rn2, i1 = (r / rn2) % rn1, i0 = r / rn2 / rn1;",
                "        const long long xs = i0 * xf + i1 * xe + i2 * xd + c0;  // the row's start in x",
            ]
            if in_place
            else []
        ),
        f"        Acc acc = {kind.init};",
    ]
    if kind.shift:
        xrow = "xs" if in_place else "rs"
        body.append(f"        const float K = pre(ld(x[{xrow}]), rs);  // shift: the row's first element")
    # batched: measured on reductions (a whole-tensor one 5.68 -> 5.26 ms); two-pass ops keep the recorded
    # form (their replay fixtures were recorded with it) until they are re-measured
    body += _read(kind, rp, x_dt, cache, batched=batched, compensated=is_reduce,
                  xat="xs" if in_place else "start", fvec=fvec_ops)  # fmt: skip
    if lanes < 32:
        body.append(f"        acc = lanes_reduce(acc, {kind.op}(), L);")
    elif rp.warp_rows:
        body.append(f"        acc = warp_allreduce(acc, {kind.op}());")
    else:
        body.append(f"        acc = block_reduce<{'true' if warp else 'false'}>(acc, red, {kind.op}());")
    if is_reduce:
        store = _reduce_store(lay, splits, ctype(out_dt))
        body += (
            [x.replace("if (tid == 0) {", "if (tid == 0 && q < rows) {") for x in store]
            if lanes < 32
            else store
        )
    else:
        if rp.warp_rows and cache:
            body.append("        __syncwarp();")
        body += _second_pass(lay, x_dt, out_dt, "xs" if in_place else "")
    body += ["    }", "}"]

    lb = launch_bounds(rp.threads, rp.min_blocks)
    variants = [
        Variant(f"kp_{rid}_v{v}" + ("_smem" if c else ""), v, cached=c)
        for v in sorted({1, rp.vec})
        for c in ((False, True) if cache else (False,))
    ]
    wrappers = [
        kernel(lb, k.name, sig, f"kp_{rid}_body<{k.vec}, {'true' if k.cached else 'false'}>")
        for k in variants
    ]
    if regs_ok(lay, rp, region):
        body += _regs_body(rid, sig, lay, rp, pre, post, x_dt, out_dt, warp)
        variants.append(Variant(f"kp_{rid}_v{rp.vec}_regs", rp.vec, regs=True))
        wrappers.append(kernel(lb, variants[-1].name, sig, f"kp_{rid}_regs<{rp.vec}>"))
    csig = None
    if cluster_ok(lay, rp, region):
        csig = Signature((*params, i64("chunk"), *(post.params() if post else [])))
        body += [CLUSTER_HELPERS, *_cluster_body(rid, csig, lay, rp, pre, post, x_dt, out_dt, warp, kind)]
        for v in sorted({1, rp.vec}):
            wrappers.append(kernel(f"{lb} __cluster_dims__({rp.cluster}, 1, 1)", f"kp_{rid}_cluster_v{v}", csig,
                                   f"kp_{rid}_cluster<{v}>"))  # fmt: skip
        if cluster_regs_ok(lay, rp, region):
            body += _cluster_regs_body(rid, csig, lay, rp, pre, post, x_dt, out_dt, warp, kind)
            wrappers.append(kernel(f"{lb} __cluster_dims__({rp.cluster}, 1, 1)", f"kp_{rid}_cluster_regs_v{rp.vec}",
                                   csig, f"kp_{rid}_cluster_regs<{rp.vec}>"))  # fmt: skip
    gsig = None
    if grid_row_ok(lay, rp, region):
        gsig = Signature((*params, i64("chunk", "gchunk"), i32("k", "gk"), ptr("ws", "Acc", "gws", const=False),
                          ptr("count", "int", "gcount", const=False), *(post.params() if post else [])))  # fmt: skip
        body += [
            GRID_HELPERS,
            *([HINT_HELPERS] if rp.l2_hints else []),
            *_grid_body(rid, gsig, lay, rp, pre, post, x_dt, out_dt, warp, kind),
        ]
        for v in sorted({1, rp.vec}):
            wrappers.append(kernel(lb, f"kp_{rid}_grid_v{v}", gsig, f"kp_{rid}_grid<{v}>"))
    split2 = split_two_pass(lay, rp, region)
    ssig = None
    if split2:
        base = [p for p in params if p.name not in ("rows", "cols")]
        ssig = Signature((*base, ptr("ws", "Acc", const=False), i64("rows"), i64("cols"), i64("chunk"),
                          i32("nsplit", "splits"), *(post.params() if post else [])))  # fmt: skip
        body += _split_bodies(rid, ssig, lay, rp, pre, post, x_dt, out_dt, warp, kind)
        for v in sorted({1, rp.vec}):
            for part in ("part", "apply"):
                wrappers.append(kernel(lb, f"kp_{rid}_{part}_v{v}", ssig, f"kp_{rid}_{part}<{v}>"))
    combine, combine_sig = "", None
    if splits:
        post_decl = post.lam("post") if post else identity("post")
        combine, combine_sig = reduce_ops.combine_kernel(
            f"kp_{rid}_combine", lay.op, lay.correction, out_dt if not indices_only else "int64",
            lay.indices and not indices_only, post.params() if post else [], post_decl, 256, "rows", "cols",
        )  # fmt: skip
    cuda = region_source(
        f"// region {rid}: {lay.op} over rows of the last dims ({'warp' if rp.warp_rows else 'block'} per row)",
        (pre, post), body, wrappers, combine,
    )  # fmt: skip
    inputs = _inputs(region, lay, pre, post)
    launcher = _launcher(
        region,
        lay,
        rp,
        pre,
        post,
        inputs,
        sig,
        variants,
        combine_sig,
        cache,
        out_dt,
        indices_only,
        ssig,
        csig,
        csig is not None and cluster_regs_ok(lay, rp, region),
        gsig,
        in_place,
        tuple(name for name, _ in fvec_ops),
        lanes,
    )
    kernels = (
        *(k.name for k in variants), *([f"kp_{rid}_combine"] if splits else []),
        *(f"kp_{rid}_{part}_v{v}" for v in sorted({1, rp.vec}) for part in ("part", "apply") if ssig),
        *(f"kp_{rid}_cluster_v{v}" for v in sorted({1, rp.vec}) if csig),
        *([f"kp_{rid}_cluster_regs_v{rp.vec}"] if csig and cluster_regs_ok(lay, rp, region) else []),
        *(f"kp_{rid}_grid_v{v}" for v in sorted({1, rp.vec}) if gsig),
    )  # fmt: skip
    return Code(cuda, launcher, f"_r_{rid}", kernels, tuple(v for _, v in inputs),
                tuple(region.outputs if not post else post.region.outputs))  # fmt: skip


def split_two_pass(lay: RowLayout, rp: RowPlan, region: Region) -> bool:
    """Whether the plan splits the rows of a two-pass op across blocks (when the launcher finds too few)."""
    return (
        lay.op in reduce_ops.TWO_PASS and lay.op != "group_norm" and region.kind is not RegionKind.REDUCE
        and rp.splits > 0 and not rp.warp_rows
    )  # fmt: skip


def grid_row_ok(lay: RowLayout, rp: RowPlan, region: Region) -> bool:
    """Whether the plan cuts each row of a two-pass op that no cluster holds into the tiles of a persistent
    cooperative grid (`persistent` blocks an SM)."""
    return (
        lay.op in reduce_ops.TWO_PASS and region.kind is not RegionKind.REDUCE and not rp.warp_rows
        and rp.grid_row and not rp.cluster and rp.persistent > 0
    )  # fmt: skip


def cluster_ok(lay: RowLayout, rp: RowPlan, region: Region) -> bool:
    """Whether the plan spreads each row of a two-pass op over a thread-block cluster (when it fits)."""
    return (
        lay.op in reduce_ops.TWO_PASS and region.kind is not RegionKind.REDUCE and not rp.warp_rows
        and 2 <= rp.cluster <= MAX_CLUSTER
    )  # fmt: skip


def _cluster_head(name: str, sig: Signature, C: int, red_n: str, pre: Fused | None, post: Fused | None,
                  cached: bool) -> list[str]:  # fmt: skip
    """A cluster kernel's start up to its row's segment [c0, c0 + n): this block's rank, the shared statistics
    (`part`, read by the whole cluster) and, `cached`, the segment's shared-memory cache after them."""
    return [
        "template <int V>",
        f"__device__ __forceinline__ void {name}({sig.decls()}) {{",
        *(["    constexpr bool CACHE = true;"] if cached else []),
        f"    constexpr unsigned C = {C};",
        "    extern __shared__ __align__(16) unsigned char kp_smem[];",
        "    Acc* red = reinterpret_cast<Acc*>(kp_smem);",
        f"    Acc* part = red + {red_n};  // this block's statistics, read by the whole cluster",
        *(
            ["    float* cache = reinterpret_cast<float*>(part + 1);  // this block's segment of the row"]
            if cached
            else []
        ),
        "    const int tid = threadIdx.x, nt = blockDim.x;",
        "    const unsigned rank = kp_cluster_rank();",
        pre.lam("pre") if pre else identity("pre"),
        post.lam("post") if post else identity("post"),
        "    for (long long r = blockIdx.x / C; r < rows; r += gridDim.x / C) {",
        "        const long long rs = r * cols, c0 = (long long)rank * chunk;",
        "        const long long n = c0 < cols ? (cols - c0 < chunk ? cols - c0 : chunk) : 0;",
    ]


def _cluster_merge(kind: reduce_ops.Kind, w: str) -> list[str]:
    """This block's statistics, then the cluster's through distributed shared memory: in every warp lane s
    reads block s's (the C remote loads at once: a thread reading them in turn waited C round trips, its
    loads in the SASS each behind the last one's merge) and one fixed shuffle tree merges them, lane 0's
    result broadcast, so every block of the cluster gets the same bits."""
    return [
        f"        acc = block_reduce<{w}>(acc, red, {kind.op}());",
        "        if (tid == 0) *part = acc;",
        "        kp_cluster_sync();",
        "        const unsigned lane = tid & 31;",
        f"        acc = warp_reduce(*kp_cluster_map(part, lane < C ? lane : 0u), C, {kind.op}());",
        "        acc.a = __shfl_sync(0xffffffffu, acc.a, 0);",
        "        acc.b = __shfl_sync(0xffffffffu, acc.b, 0);",
        "        acc.i = __shfl_sync(0xffffffffu, acc.i, 0);",
    ]


def _block_start(name: str, sig: Signature, pre: Fused | None, post: Fused | None, smem: bool,
                 uncached: bool) -> list[str]:  # fmt: skip
    """A device function's start where a block takes a row (or its part): the template and signature, no
    cache (`uncached`: the row read again from global memory), the shared reduction buffer (`smem`), the
    thread's index and count, and the fused prologue and epilogue as lambdas."""
    return [
        "template <int V>",
        f"__device__ __forceinline__ void {name}({sig.decls()}) {{",
        *(
            ["    constexpr bool CACHE = false;", "    const float* cache = nullptr;", "    (void)cache;"]
            if uncached
            else []
        ),
        *(
            [
                "    extern __shared__ __align__(16) unsigned char kp_smem[];",
                "    Acc* red = reinterpret_cast<Acc*>(kp_smem);",
            ]
            if smem
            else []
        ),
        "    const int tid = threadIdx.x, nt = blockDim.x;",
        pre.lam("pre") if pre else identity("pre"),
        post.lam("post") if post else identity("post"),
    ]


def _grid_body(rid: str, sig: Signature, lay: RowLayout, rp: RowPlan, pre: Fused | None, post: Fused | None,
               x_dt: str, out_dt: str, warp: bool, kind: reduce_ops.Kind) -> list[str]:  # fmt: skip
    """Rows no cluster can hold, over the tiles of a persistent cooperative grid: block b takes tile b % k of
    rows b / k, b / k + per, ... (per = gridDim.x / k rows a step). Each step it reads its tile of this
    step's row for the statistics (published to ws, the row's counter raised), then writes its tile of the
    last step's row: the row's counter awaited (its blocks arrived a step ago, while this one read), every
    partial merged (a fixed order), the tile re-read, from L2 (one step's reads, a few MB, since). One read
    from DRAM and one write an element, where a block per row reads a row of 8 MB twice from DRAM."""
    stats, f = _stats(lay)
    w = "true" if warp else "false"
    if lay.op == "group_norm":  # a tile may span several channels
        write = _channels(lay, f, x_dt, out_dt, "c0", "n")
    else:
        f = f.replace("w[c]", "w[c0 + c]").replace("b[c]", "b[c0 + c]")  # the weight's index is the column
        write = _write_segment("start", "c0", "n", f, x_dt, out_dt)
    shift = ["            const float K = pre(ld(x[rs]), rs);  // the row's first element, in every tile"]
    ahead = rp.grid_prefetch and rp.unroll > 1
    read = ["    " + t for t in _read(kind, rp, x_dt, batched=rp.unroll > 1, first="p_" if ahead else "")]
    xt, U = ctype(x_dt), max(1, rp.unroll)
    # The step's first batch loaded before the write below and used after it (grid_prefetch): its DRAM
    # latency spent on the write's L2 reads and stores, where the read waited on it alone.
    tile = [
        "            const long long rs = r * cols;",
        "            const long long n = c0 < cols ? (cols - c0 < chunk ? cols - c0 : chunk) : 0;",
        "            const long long start = rs + c0;",
        "            (void)start;",
    ]
    prefetch = [
        f"        Vec<{xt}, V> p_[{U}];",
        "        if (on) {",
        "            const long long r = s * per + r0;",
        *tile,
        "            const long long head = head_of<V>(start, n), nv = (n - head) / V;",
        "#pragma unroll",
        f"            for (int u = 0; u < {U}; ++u)",
        f"                if (tid + u * nt < nv) p_[u] = vload<{xt}, V>(x + start + head + (tid + u * nt) * V);",
        "        }",
    ]
    if rp.l2_hints:  # the first read kept in L2, the second and the stores let go of it (HINT_HELPERS)
        read = [t.replace("vload<", "kp_vload_last<") for t in read]
        prefetch = [t.replace("vload<", "kp_vload_last<") for t in prefetch]
        write = [t.replace("vload<", "kp_vload_first<").replace("vstore<", "kp_vstore_first<") for t in write]
    # The tile written `lag` steps after it was read: 1 keeps every block within a step of the slowest; more
    # lets them drift that far (each step's wait then rarely blocks) for lag steps' tiles held in L2.
    lag = rp.grid_lag
    loop, last = (
        ("s <= steps", "s > 0 && (s - 1) * per + r0 < rows")
        if lag == 1
        else (f"s < steps + {lag}", f"s >= {lag} && (s - {lag}) * per + r0 < rows")
    )
    stats_step = [
        "        if (s < steps && s * per + r0 < rows) {  // this step's row: the tile's statistics"
        if not ahead
        else "        if (on) {  // this step's row: the tile's statistics",
        "            const long long r = s * per + r0;",
        *tile,
        f"            Acc acc = {kind.init};",
        *(shift if kind.shift else []),
        *read,
        f"            acc = block_reduce<{w}>(acc, red, {kind.op}());",
        "            if (tid == 0) {",
        "                ws[r * T + ti] = acc;",
        "                kp_grid_arrive(count + r);",
        "            }",
        "        }",
    ]
    write_step = [
        f"        if ({last}) {{  // the {'last step' if lag == 1 else f'{lag} steps ago'}'s row: the tile written",
        f"            const long long r = (s - {lag}) * per + r0;",
        *tile,
        "            if (tid == 0) kp_grid_wait(count + r, (int)T);",
        "            __syncthreads();  // thread 0's acquire orders the block's reads of the partials after it",
        f"            Acc acc = {kind.init};",
        f"            for (unsigned i = tid; i < T; i += nt) acc = {kind.op}()(acc, kp_ld_cg(ws + r * T + i));",
        f"            acc = block_reduce<{w}>(acc, red, {kind.op}());",
        *(shift if kind.shift else []),
        *("    " + t for t in stats),
        *("    " + t for t in write),
        "        }",
    ]
    steps = (
        [
            "        const bool on = s < steps && s * per + r0 < rows;",
            *prefetch,
            *write_step,
            *stats_step,
        ]
        if ahead
        else [*stats_step, *write_step]
    )
    return [
        *_block_start(f"kp_{rid}_grid", sig, pre, post, smem=True, uncached=True),
        "    const unsigned T = (unsigned)k, ti = blockIdx.x % T;  // tiles a row, this block's",
        "    const long long per = gridDim.x / T, r0 = blockIdx.x / T, c0 = (long long)ti * chunk;",
        "    const long long steps = (rows + per - 1) / per;",
        f"    for (long long s = 0; {loop}; ++s) {{",
        *steps,
        "    }",
        "}",
    ]


def _cluster_body(rid: str, sig: Signature, lay: RowLayout, rp: RowPlan, pre: Fused | None,
                  post: Fused | None, x_dt: str, out_dt: str, warp: bool, kind: reduce_ops.Kind) -> list[str]:  # fmt: skip
    """A row over the C blocks of a cluster, block `rank` taking columns [rank * chunk, +chunk): it reads its
    segment once into shared memory (`unroll` 16-byte loads in flight a thread), its statistics go to `part`,
    the cluster's barrier, every block merges all the parts in rank order through distributed shared memory
    and arrives at a second barrier, writes its segment from its cache, then waits on that barrier (no part
    is overwritten by the next row, and no block exits, while another block may still read its part).
    Softmax's statistics (max, sum of exp) are taken a batch of loads at a time as the segment streams in."""
    stats, f = _stats(lay)
    red_n = "33" if warp else "blockDim.x"
    C = rp.cluster
    # The segment's column c is cached at kc + c: its vectors then sit on 16-byte boundaries in shared memory.
    if lay.op == "group_norm":  # the segment may span several channels
        write = _channels(lay, f, x_dt, out_dt, "c0", "n", kc="kc + ")
    else:
        f = f.replace("w[c]", "w[c0 + c]").replace("b[c]", "b[c0 + c]")  # the weight's index is the column
        write = _write_segment("start", "kc", "n", f, x_dt, out_dt, vec_cache=True)
    shift = [
        "        const float K = pre(ld(x[rs]), rs);  // the row's first element, the same in every block"
    ]
    w = "true" if warp else "false"

    stats_pass = [*_read(kind, rp, x_dt, cache=True, batched=True, vec_cache=True), *_cluster_merge(kind, w)]
    return [
        *_cluster_head(f"kp_{rid}_cluster", sig, C, red_n, pre, post, cached=True),
        "        const long long start = rs + c0, kc = start % V;",
        f"        Acc acc = {kind.init};",
        *(shift if kind.shift else []),
        *stats_pass,
        "        kp_cluster_arrive();",
        *stats,
        *write,
        "        kp_cluster_wait();",
        "    }",
        "}",
    ]


def _cluster_regs_body(rid: str, sig: Signature, lay: RowLayout, rp: RowPlan, pre: Fused | None,
                       post: Fused | None, x_dt: str, out_dt: str, warp: bool, kind: reduce_ops.Kind) -> list[str]:  # fmt: skip
    """The cluster's row with each block's segment held in registers (`regs` 16-byte vectors a thread, all
    loads issued before any is used) instead of shared memory: the statistics as the shared-memory form
    takes them (softmax's (max, sum of exp) from the segment's max, one exp an element), merged over the
    cluster the same way, then the segment written from the registers. KernelBench's InstanceNorm (1 MB rows)
    ran 5.09 ms against 5.74 with the segment in shared memory on the H100 (benchmarks/cluster_regs.py;
    4.15 against 4.61 as a variant on the H200). The launcher takes it when the row splits into whole
    vectors, is aligned, and each segment fits."""
    stats, f = _stats(lay)
    f = f.replace("w[c]", "w[c0 + c]").replace("b[c]", "b[c0 + c]")  # the weight's index is the column
    xt, yt = ctype(x_dt), ctype(out_dt)
    R = rp.regs
    # a group norm's vector lies in one channel (the launcher: whole vectors a channel): its scale and shift
    channel = (
        [
            "            const long long ch = (r % groups) * cg  // an instance norm's row is one channel",
            "                + (cg == 1 ? 0 : (long long)((unsigned)(c0 + (tid + q * nt) * V) / (unsigned)(cols / cg)));",
            "            (void)ch;",
            f"            const float sc = rstd * {'ld(w[ch])' if lay.has_weight else '1.0f'};",
            f"            const float sh = {'ld(b[ch])' if lay.has_bias else '0.0f'} - mean * sc;",
        ]
        if lay.op == "group_norm"
        else []
    )
    w = "true" if warp else "false"
    red_n = "33" if warp else "blockDim.x"

    def each(*stmts: str) -> list[str]:
        return [
            "#pragma unroll",
            f"        for (int q = 0; q < {R}; ++q) {{",
            "            if (tid + q * nt >= nv) break;",
            "#pragma unroll",
            "            for (int e = 0; e < V; ++e) {",
            "                const long long c = (long long)(tid + q * nt) * V + e;",
            "                const float v = f[q][e];",
            "                (void)c;",
            *(f"                {t}" for t in stmts),
            "            }",
            "        }",
        ]

    if kind.op == "LseOp":
        push = [
            "        float mx = -CUDART_INF_F;",
            *each("mx = fmaxf(mx, v);"),
            "        acc.a = mx;  // -inf for a segment of -inf (its sum then stays 0)",
            *each("if (v != -CUDART_INF_F) acc.b += expf(v - mx);  // NaN stays NaN"),
        ]
    else:
        push = each(kind.push("acc", "v", "c0 + c"))
    return [
        *_cluster_head(f"kp_{rid}_cluster_regs", sig, rp.cluster, red_n, pre, post, cached=False),
        "        const long long start = rs + c0;",
        "        const int nv = (int)(n / V);  // the launcher: cols and chunk whole vectors, x and y aligned",
        f"        float f[{R}][V];",
        "#pragma unroll",
        f"        for (int q = 0; q < {R}; ++q) {{",
        "            if (tid + q * nt < nv) {",
        f"                const Vec<{xt}, V> t = vload<{xt}, V>(x + start + (long long)(tid + q * nt) * V);",
        "#pragma unroll",
        "                for (int e = 0; e < V; ++e) f[q][e] = pre(ld(t.v[e]), start + (long long)(tid + q * nt) * V + e);",
        "            }",
        "        }",
        f"        Acc acc = {kind.init};",
        *(
            ["        const float K = pre(ld(x[rs]), rs);  // shift: the row's first element, in every block"]
            if kind.shift
            else []
        ),
        *push,
        *_cluster_merge(kind, w),
        "        kp_cluster_arrive();",
        *stats,
        "#pragma unroll",
        f"        for (int q = 0; q < {R}; ++q) {{",
        "            if (tid + q * nt >= nv) break;",
        *channel,
        f"            Vec<{yt}, V> o;",
        "#pragma unroll",
        "            for (int e = 0; e < V; ++e) {",
        "                const long long c = (long long)(tid + q * nt) * V + e;",
        "                const float v = f[q][e];",
        f"                o.v[e] = cv<{yt}>(post({f}, start + c));",
        "            }",
        f"            vstore<{yt}, V>(y + start + (long long)(tid + q * nt) * V, o);",
        "        }",
        "        kp_cluster_wait();",
        "    }",
        "}",
    ]


def _read(
    kind: reduce_ops.Kind,
    rp: RowPlan,
    x_dt: str,
    cache: bool = False,
    batched: bool = False,
    vec_cache: bool = False,
    compensated: bool = False,
    xat: str = "start",
    fvec: list[tuple[str, str]] | None = None,
    first: str = "",
) -> list[str]:
    """Pass 1 over [start, start + n): acc takes every (pre-processed) element, 16-byte vectors after a head;
    with `cache`, each also goes to the shared-memory copy of the row (when CACHE). `batched`: a thread
    issues its `unroll` vector loads before it uses any (the pragma alone left one load in flight, and a
    cluster's block, alone on its SM, waited on DRAM for each). `vec_cache` (with `batched`): column c is
    cached at kc + c, the vectors' copies stored 16 bytes at a time. `compensated`: a sum's adds are Kahan's
    (reduce_ops.Kind.push). `xat`: where the row starts in x (`start` unless x is read at its own strides);
    the prologue and the columns' indices stay the row's place in the logical rows x cols. `fvec` (with
    `batched`, x read at `start`): the prologue's operands (name, dtype) loaded as vectors beside x's, handed
    to its `prev` form. `first` (with `batched`, no `fvec`): the array holding the first batch's vectors,
    loaded before (a grid's tile, its loads issued before the last step's tile is written)."""
    slot = "kc + c" if vec_cache else "c"
    kahan = compensated and kind.op == "SumOp"
    push = [
        "const float v_ = pre(RAW, start + c);",
        *([f"if (CACHE) cache[{slot}] = v_;"] if cache else []),
        kind.push("acc", "v_", "c0 + c", kahan),
    ]
    lse = batched and kind.op == "LseOp"
    # softmax statistics a batch at a time (batched): the batch's max first, the running sum rescaled to it
    # once, then one independent exp per element; online rescaling per element put a dependent exp on each
    vpush = [
        "const float v_ = pre(RAW, start + c);",
        *(["w_[e] = v_;"] if vec_cache else [f"if (CACHE) cache[{slot}] = v_;"] if cache else []),
        "cm_ = fmaxf(cm_, v_);" if lse else kind.push("acc", "v_", "c0 + c", kahan),
    ]
    xt = ctype(x_dt)
    head = [
        *(
            [
                f"        float ca_ = 0.0f{', cb_ = 0.0f' if kind.second else ''};  // the sums' lost low bits (Kahan)"
            ]
            if kahan
            else []
        ),
        f"        const long long head = head_of<V>({xat}, n);",
        "        const long long nv = (n - head) / V;",
        "        for (long long c = tid; c < head; c += nt) {",
        *[f"            {t.replace('RAW', f'ld(x[{xat} + c])')}" for t in push],
        "        }",
    ]
    tail = [
        "        for (long long c = head + nv * V + tid; c < n; c += nt) {",
        *[f"            {t.replace('RAW', f'ld(x[{xat} + c])')}" for t in push],
        "        }",
    ]
    if batched:
        U = max(1, rp.unroll)
        fvec = fvec or []
        assert not fvec or xat == "start", (
            "a prologue's operands are read at the row's place, not x's strides"
        )
        at = "head + (j0 + u * nt) * V"
        loads = [f"                if (j0 + u * nt < nv) t_[u] = vload<{xt}, V>(x + {xat} + {at});"]
        if first:
            assert not fvec, "a prefetched batch holds x's vectors only"
            loads = [
                f"                if (j0 + u * nt < nv) t_[u] = j0 == tid ? {first}[u] : vload<{xt}, V>(x + {xat} + {at});"
            ]
        if fvec:  # each element's operands from vectors loaded with x's (the form without them is kept as it
            # was: recorded candidates' keys are their text)
            vpush = [
                t.replace("pre(RAW, start + c)", f"prev(RAW, start + c{_fvec_args(len(fvec))})")
                for t in vpush
            ]
            loads = [
                "                if (j0 + u * nt < nv) {",
                f"                    t_[u] = vload<{xt}, V>(x + {xat} + {at});",
                *[f"                    fv{j}_[u] = vload<{ctype(dt)}, V>({name} + start + {at});"
                  for j, (name, dt) in enumerate(fvec)],
                "                }",
            ]  # fmt: skip
        return [
            *head,
            f"        for (long long j0 = tid; j0 < nv; j0 += (long long)nt * {U}) {{",
            f"            Vec<{xt}, V> t_[{U}];",
            *[f"            Vec<{ctype(dt)}, V> fv{j}_[{U}];" for j, (_, dt) in enumerate(fvec)],
            "#pragma unroll",
            f"            for (int u = 0; u < {U}; ++u)",
            *loads,
            *(["            float cm_ = -CUDART_INF_F;  // the batch's max"] if lse else []),
            "#pragma unroll",
            f"            for (int u = 0; u < {U}; ++u) {{",
            "                if (j0 + u * nt >= nv) break;",
            *(["                float w_[V];"] if vec_cache else []),
            "#pragma unroll",
            "                for (int e = 0; e < V; ++e) {",
            "                    const long long c = head + (j0 + u * nt) * V + e;",
            *[f"                    {t.replace('RAW', 'ld(t_[u].v[e])')}" for t in vpush],
            "                }",
            *(
                ["                kp_cache_put<V>(cache + kc + head + (j0 + u * nt) * V, w_);"]
                if vec_cache
                else []
            ),
            "            }",
            *(_lse_batch(U, len(fvec)) if lse else []),
            "        }",
            *tail,
        ]
    return [
        *head,
        f"#pragma unroll {rp.unroll}",
        "        for (long long j = tid; j < nv; j += nt) {",
        f"            const Vec<{xt}, V> t = vload<{xt}, V>(x + {xat} + head + j * V);",
        "#pragma unroll",
        "            for (int e = 0; e < V; ++e) {",
        "                const long long c = head + j * V + e;",
        *[f"                {t.replace('RAW', 'ld(t.v[e])')}" for t in push],
        "            }",
        "        }",
        *tail,
    ]


def _fvec_args(n: int) -> str:
    """The `prev` form's trailing arguments: element e of batch u of each of the n operand vectors."""
    return "".join(f", fv{j}_[u].v[e]" for j in range(n))


def _lse_batch(U: int, fvec: int = 0) -> list[str]:
    """The running (max, sum) taken to the batch's max once, then exp(v - max) of the batch's elements (read
    again from the loaded vectors), each independent of the others. `fvec`: the prologue's operands loaded as
    vectors too (its `prev` form)."""
    pre = f"prev(ld(t_[u].v[e]), start + c{_fvec_args(fvec)})" if fvec else "pre(ld(t_[u].v[e]), start + c)"
    return [
        "            if (cm_ > acc.a) {",
        "                acc.b *= expf(acc.a - cm_);  // 0 while acc.a is -inf",
        "                acc.a = cm_;",
        "            }",
        "#pragma unroll",
        f"            for (int u = 0; u < {U}; ++u) {{",
        "                if (j0 + u * nt >= nv) break;",
        "#pragma unroll",
        "                for (int e = 0; e < V; ++e) {",
        "                    const long long c = head + (j0 + u * nt) * V + e;",
        f"                    const float v_ = {pre};",
        "                    if (v_ != -CUDART_INF_F) acc.b += expf(v_ - acc.a);  // NaN stays NaN",
        "                }",
        "            }",
    ]


def _split_bodies(rid: str, sig: Signature, lay: RowLayout, rp: RowPlan, pre: Fused | None, post: Fused | None,
                  x_dt: str, out_dt: str, warp: bool, kind: reduce_ops.Kind) -> list[str]:  # fmt: skip
    """A row split over gridDim.y blocks: `part` writes each block's statistics of its chunk to ws; `apply`
    merges the row's partials (in split order: deterministic) and writes its chunk."""
    stats, f = _stats(lay)
    f = f.replace("w[c]", "w[c0 + c]").replace("b[c]", "b[c0 + c]")  # the weight's index is the column
    head = [
        "    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {",
        "        const long long rs = r * cols, c0 = blockIdx.y * chunk;",
        "        const long long n = c0 < cols ? (cols - c0 < chunk ? cols - c0 : chunk) : 0;",
        "        const long long start = rs + c0;",
        "        (void)start;",
    ]
    shift = [
        "        const float K = pre(ld(x[rs]), rs);  // the row's first element, the same in every split"
    ]
    return [
        *_block_start(f"kp_{rid}_part", sig, pre, post, smem=True, uncached=False),
        *head,
        f"        Acc acc = {kind.init};",
        *(shift if kind.shift else []),
        *_read(kind, rp, x_dt, batched=rp.unroll > 1),
        f"        acc = block_reduce<{'true' if warp else 'false'}>(acc, red, {kind.op}());",
        "        if (tid == 0) ws[blockIdx.y * rows + r] = acc;",
        "    }",
        "}",
        *_block_start(f"kp_{rid}_apply", sig, pre, post, smem=False, uncached=True),
        *head,
        "        Acc acc = ws[r];",
        f"        for (int s = 1; s < nsplit; ++s) acc = {kind.op}()(acc, ws[(long long)s * rows + r]);",
        *(shift if kind.shift else []),
        *stats,
        *_write_segment("start", "c0", "n", f, x_dt, out_dt),
        "    }",
        "}",
    ]


def regs_ok(lay: RowLayout, rp: RowPlan, region: Region) -> bool:
    """Whether a row can be held in registers between the passes (block-per-row two-pass ops)."""
    return (
        lay.op in reduce_ops.TWO_PASS and lay.op != "group_norm" and region.kind is not RegionKind.REDUCE
        and not rp.warp_rows and not rp.smem_row and not rp.cluster and not rp.grid_row and 0 < rp.regs <= MAX_REGS
    )  # fmt: skip


def cluster_regs_ok(lay: RowLayout, rp: RowPlan, region: Region) -> bool:
    """Whether a cluster's blocks hold their segments in registers (`regs` vectors a thread) rather than in
    shared memory."""
    return (
        cluster_ok(lay, rp, region) and rp.regs > 0
        and rp.regs * rp.vec <= CLUSTER_THREAD_FLOATS and rp.regs * rp.vec * rp.threads <= CLUSTER_REG_FLOATS
    )  # fmt: skip


def _regs_body(rid: str, sig: Signature, lay: RowLayout, rp: RowPlan, pre: Fused | None,
               post: Fused | None, x_dt: str, out_dt: str, warp: bool) -> list[str]:  # fmt: skip
    """The row read once into registers (R vectors per thread), its statistics in exact passes over the
    registers (softmax: max, then exp and sum, one exp per element; norms: mean, then squared deviations),
    then written from them: one DRAM read and one write per element. The launcher takes it only when the
    row fits and is vector-aligned."""
    xt, yt = ctype(x_dt), ctype(out_dt)
    R = rp.regs
    w = "true" if warp else "false"
    n = "(float)cols"

    def each(stmt: str) -> list[str]:
        return [
            "#pragma unroll",
            f"        for (int q = 0; q < {R}; ++q)",
            "#pragma unroll",
            "            for (int e = 0; e < V; ++e)",
            f"                if (tid + (long long)q * nt < nv) {{ float& v = f[q][e]; {stmt} }}",
        ]

    def reduce(var: str, op: str) -> str:
        return f"block_reduce<{w}>(Acc{{{var}, 0.0f, 0}}, red, {op}()).a"

    if lay.op == "softmax":
        stats = [
            "        float mx = -CUDART_INF_F;",
            *each("mx = kp_max_nan(mx, v);"),
            f"        const float M = {reduce('mx', 'MaxOp')};",
            "        float sm = 0.0f;",
            *each("v = expf(v - M); sm += v;"),
            f"        const float inv = 1.0f / {reduce('sm', 'SumOp')};",
        ]
        f = "v * inv"
    elif lay.op == "log_softmax":
        stats = [
            "        float mx = -CUDART_INF_F;",
            *each("mx = kp_max_nan(mx, v);"),
            f"        const float M = {reduce('mx', 'MaxOp')};",
            "        float sm = 0.0f;",
            *each("sm += expf(v - M);"),
            f"        const float L = logf({reduce('sm', 'SumOp')});",
        ]
        f = "v - M - L"
    elif lay.op == "layer_norm":
        stats = [
            "        float sm = 0.0f;",
            *each("sm += v;"),
            f"        const float mean = {reduce('sm', 'SumOp')} / {n};",
            "        float sq = 0.0f;",
            *each("sq += (v - mean) * (v - mean);"),
            f"        const float rstd = 1.0f / sqrtf({reduce('sq', 'SumOp')} / {n} + {ops.lit(lay.eps)});",
        ]
        f = _stats(lay)[1]
    elif lay.op == "l1_norm":
        stats = [
            "        float sa = 0.0f;",
            *each("sa += fabsf(v);"),
            f"        const float S = {reduce('sa', 'SumOp')};",
        ]
        f = _stats(lay)[1]
    elif lay.op == "l2_normalize":
        stats = [
            "        float sq = 0.0f;",
            *each("sq += v * v;"),
            f"        const float S = kp_max_nan(sqrtf({reduce('sq', 'SumOp')}), {ops.lit(lay.eps)});",
        ]
        f = _stats(lay)[1]
    else:  # rms_norm
        stats = [
            "        float sq = 0.0f;",
            *each("sq += v * v;"),
            f"        const float rstd = 1.0f / sqrtf({reduce('sq', 'SumOp')} / {n} + {ops.lit(lay.eps)});",
        ]
        f = _stats(lay)[1]
    # weight and bias as vectors too (the launcher checks their alignment), not one scalar load each
    wb_loads = []
    for p in ("w", "b") if lay.op in ("layer_norm", "rms_norm") else ():
        if f"ld({p}[c])" in f:
            wt = ctype(lay.w_dtype)
            wb_loads.append(f"                const Vec<{wt}, V> {p}v = vload<{wt}, V>({p} + j * V);")
            f = f.replace(f"ld({p}[c])", f"ld({p}v.v[e])")
    return [
        *_block_start(f"kp_{rid}_regs", sig, pre, post, smem=True, uncached=False),
        "    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {",
        "        const long long rs = r * cols, nv = cols / V;",
        f"        float f[{R}][V];",
        "#pragma unroll",
        f"        for (int q = 0; q < {R}; ++q) {{",
        "            const long long j = tid + (long long)q * nt;",
        "            if (j < nv) {",
        f"                const Vec<{xt}, V> t = vload<{xt}, V>(x + rs + j * V);",
        "#pragma unroll",
        "                for (int e = 0; e < V; ++e) f[q][e] = pre(ld(t.v[e]), rs + j * V + e);",
        "            }",
        "        }",
        *stats,
        "#pragma unroll",
        f"        for (int q = 0; q < {R}; ++q) {{",
        "            const long long j = tid + (long long)q * nt;",
        "            if (j < nv) {",
        f"                Vec<{yt}, V> o;",
        *wb_loads,
        "#pragma unroll",
        "                for (int e = 0; e < V; ++e) {",
        "                    const long long c = j * V + e;",
        "                    const float v = f[q][e];",
        f"                    o.v[e] = cv<{yt}>(post({f}, rs + c));",
        "                }",
        f"                vstore<{yt}, V>(y + rs + j * V, o);",
        "            }",
        "        }",
        "    }",
        "}",
    ]


def _inputs(region: Region, lay: RowLayout, pre: Fused | None, post: Fused | None) -> list[tuple[str, str]]:
    """(launcher name, graph value) of what forward passes: the (pre-)input, prologue extras, weight, bias,
    epilogue extras."""
    n = region.node
    out = [("x", pre.main if pre else n.args[0].name), *(pre.inputs() if pre else [])]
    a = n.args
    if lay.op in ("layer_norm", "rms_norm"):
        wb = a[2 : 4 if lay.op == "layer_norm" else 3]
    elif lay.op == "group_norm":
        wb = a[2:4] if n.op == "group_norm" else a[1:3]
    else:
        wb = ()
    out += [(p, r.name) for p, r in zip(("w", "b"), wb, strict=False) if r is not None]  # wb may be short
    return out + (post.inputs() if post else [])


def _reduce_store(lay: RowLayout, splits: bool, out_ct: str) -> list[str]:
    indices_only = lay.op in ("argmax", "argmin")
    direct = [
        "const long long n = cols;",
        "(void)n;",
        reduce_ops.store(lay.op, lay.correction, out_ct, "r"),
        *(["yi[r] = acc.i;"] if lay.indices and not indices_only else []),
    ]
    if not splits:
        return ["        if (tid == 0) {", *(f"            {s}" for s in direct), "        }"]
    return [
        "        if (tid == 0 && gridDim.y > 1) {  // a split of the row: its partial goes to the workspace",
        "            ws[blockIdx.y * rows + r] = acc;",
        "        } else if (tid == 0) {",
        *(f"            {s}" for s in direct),
        "        }",
    ]


def _stats(lay: RowLayout) -> tuple[list[str], str]:
    """The row's statistics from acc, and the value written at column c from the input v."""
    n = "(float)cols"
    if lay.op == "softmax":
        stats = ["        const float M = acc.a, inv = 1.0f / acc.b;"]
        f = "expf(v - M) * inv"
    elif lay.op == "log_softmax":
        stats = ["        const float M = acc.a, L = logf(acc.b);"]
        f = "v - M - L"
    elif lay.op == "l1_norm":
        stats = ["        const float S = acc.a;"]
        f = "v / S"  # a division, as x / sum|x| is written
    elif lay.op == "l2_normalize":  # clamp_min's max, NaN kept; a division, as F.normalize's
        stats = [f"        const float S = kp_max_nan(sqrtf(acc.a), {ops.lit(lay.eps)});"]
        f = "v / S"
    elif lay.op == "rms_norm":
        stats = [f"        const float rstd = 1.0f / sqrtf(acc.a / {n} + {ops.lit(lay.eps)});"]
        f = "v * rstd" + (" * ld(w[c])" if lay.has_weight else "")
    else:  # layer_norm, group_norm: mean and variance from the shifted sums
        stats = [
            f"        const float ma = acc.a / {n};",
            "        const float mean = K + ma;",
            f"        const float var = fmaxf(acc.b / {n} - ma * ma, 0.0f);",
            f"        const float rstd = 1.0f / sqrtf(var + {ops.lit(lay.eps)});",
        ]
        if lay.op == "layer_norm":
            f = (
                "(v - mean) * rstd"
                + (" * ld(w[c])" if lay.has_weight else "")
                + (" + ld(b[c])" if lay.has_bias else "")
            )
        else:
            f = "v * sc + sh"
    return stats, f


def _second_pass(lay: RowLayout, x_dt: str, out_dt: str, xstart: str = "") -> list[str]:
    """Stats from acc, then the row written: (c, v) -> value, over [0, n) of each segment (x read from
    `xstart` when it is not the row's place in y: a strided view's row read in place)."""
    stats, f = _stats(lay)
    lines = list(stats)
    if lay.op == "group_norm":
        lines += _channels(lay, f, x_dt, out_dt, "0", "cols")
    else:
        lines += _write_segment("rs", "0", "cols", f, x_dt, out_dt, xstart=xstart)
    return lines


def _channels(lay: RowLayout, f: str, x_dt: str, out_dt: str, c0: str, n: str, kc: str = "") -> list[str]:
    """A group norm's columns [c0, c0 + n) of row r written one channel at a time, each with its scale and
    shift (the cache holds the columns from c0 on; with `kc`, from that offset on and read as vectors)."""
    w = "ld(w[ch])" if lay.has_weight else "1.0f"
    b = "ld(b[ch])" if lay.has_bias else "0.0f"
    # Short channels (a GroupNorm over (N, C), small images) would leave most of the block idle a channel at
    # a time: each element then finds its channel from its column (a 32-bit division) and its own scale.
    short = [
        "        } else {",
        "            auto aff = [&](float v, long long col) -> float {",
        "                const long long ch = (r % groups) * cg + (long long)((unsigned)col / (unsigned)hw);",
        "                (void)ch;",
        f"                const float sc = rstd * {w};",
        f"                const float sh = {b} - mean * sc;",
        "                return v * sc + sh;",
        "            };",
        *(
            "    " + t
            for t in _write_segment(f"rs + {c0}", f"{kc}0", n, f"aff(v, {c0} + c)", x_dt, out_dt, bool(kc))
        ),
        "        }",
    ]
    return [
        "        const long long hw = cols / cg;",
        "        if (hw >= (long long)nt * V || cols > 0xffffffffLL) {  // a channel spans the block's vectors",
        f"        for (long long cl = {c0} / hw; cl < cg && cl * hw < {c0} + {n}; ++cl) {{",
        f"            const long long lo = cl * hw > {c0} ? cl * hw : {c0};",
        f"            const long long hi = (cl + 1) * hw < {c0} + {n} ? (cl + 1) * hw : {c0} + {n};",
        "            const long long ch = (r % groups) * cg + cl;",
        "            (void)ch;",
        f"            const float sc = rstd * {w};",
        f"            const float sh = {b} - mean * sc;",
        *(
            "    " + t
            for t in _write_segment("rs + lo", f"{kc}lo - {c0}", "hi - lo", f, x_dt, out_dt, bool(kc))
        ),
        "        }",
        *short,
    ]


def _write_segment(start: str, coff: str, n: str, f: str, x_dt: str, out_dt: str,
                   vec_cache: bool = False, xstart: str = "") -> list[str]:  # fmt: skip
    """Write y[start + c] = post(f(c, v)) for c in [0, n), v the (pre-processed) input or its cached copy
    (at coff + c; with `vec_cache`, its vectors read 16 bytes at a time: coff + h on a 16-byte boundary);
    x read from `xstart` + c where given (its launcher takes the vector form only where x's rows and y's
    share their alignment), else from start + c."""
    xt, yt = ctype(x_dt), ctype(out_dt)
    x0 = "x0" if xstart else "s0"

    def val(raw: str, cached: str = f"cache[{coff} + c]") -> str:
        return f"(CACHE ? {cached} : pre({raw}, s0 + c))"

    vec = [
        "                float w_[V];",
        f"                if (CACHE) kp_cache_get<V>(cache + {coff} + h + j * V, w_);",
    ]
    return [
        "        {",
        f"            const long long s0 = {start}, {f'x0 = {xstart}, ' if xstart else ''}sn = {n};",
        "            const long long h = head_of<V>(s0, sn);",
        "            const long long nv2 = (sn - h) / V;",
        "            for (long long c = tid; c < h; c += nt) {",
        f"                const float v = {val(f'ld(x[{x0} + c])')};",
        f"                y[s0 + c] = cv<{yt}>(post({f}, s0 + c));",
        "            }",
        "            for (long long j = tid; j < nv2; j += nt) {",
        f"                Vec<{xt}, V> t;",
        f"                if (!CACHE) t = vload<{xt}, V>(x + {x0} + h + j * V);",
        f"                Vec<{yt}, V> o;",
        *(vec if vec_cache else []),
        "#pragma unroll",
        "                for (int e = 0; e < V; ++e) {",
        "                    const long long c = h + j * V + e;",
        f"                    const float v = {val('ld(t.v[e])', 'w_[e]') if vec_cache else val('ld(t.v[e])')};",
        f"                    o.v[e] = cv<{yt}>(post({f}, s0 + c));",
        "                }",
        f"                vstore<{yt}, V>(y + s0 + h + j * V, o);",
        "            }",
        "            for (long long c = h + nv2 * V + tid; c < sn; c += nt) {",
        f"                const float v = {val(f'ld(x[{x0} + c])')};",
        f"                y[s0 + c] = cv<{yt}>(post({f}, s0 + c));",
        "            }",
        "        }",
    ]


def _launcher(region: Region, lay: RowLayout, rp: RowPlan, pre: Fused | None, post: Fused | None,
              inputs: list[tuple[str, str]], sig: Signature, variants: list[Variant], combine: Signature | None,
              cache: bool, out_dt: str, indices_only: bool, ssig: Signature | None = None,
              csig: Signature | None = None, cregs: bool = False, gsig: Signature | None = None,
              in_place: bool = False, vec_more: tuple[str, ...] = (), lanes: int = 32) -> str:  # fmt: skip
    rid = region.rid
    names = [name for name, _ in inputs]
    lines = [f"def _r_{rid}(sms, {', '.join(names)}):"]
    if pre:
        lines += pre.prepare("x.shape")
    if not in_place:
        lines.append("    x = _contig(x)")
    wb = [p for p in ("w", "b") if p in names]
    lines += [f"    {p} = _contig({p})" for p in wb]
    lines += shapes.shape_lines(region, lay) + shapes.expect_trailing()
    if in_place:  # rows read where they lie when they are runs, else gathered
        if region.kind is RegionKind.SOFTMAX:
            lines.append("    d0 = d")
        elif region.kind is not RegionKind.REDUCE:  # a norm over its trailing dims
            lines.append(f"    d0 = len(shape) - {lay.norm_dims}")
        lines.append("    (x,), rn1, rn2, ((xf, xe, xd),) = _rows_in_place((x,), shape, d0)")
    with_yi = lay.indices and not indices_only
    lines += shapes.output_lines(out_dt, indices_only, with_yi, post, "y.numel() == 0 or cols == 0", lay.pair)
    ret = shapes.returned(with_yi, lay.pair)
    threads = rp.threads
    if lanes < 32:
        lines += [
            f"    rpb = {threads // lanes}  # rows per block: {lanes} lanes each",
            f"    block = {threads}",
            "    blocks = max(1, min(-(-rows // rpb), MAX_GRID_X))",
        ]
    elif rp.warp_rows:
        lines += [
            f"    rpb = {threads // 32}  # rows per block: a warp each",
            f"    block = {threads}",
            "    blocks = max(1, min(-(-rows // rpb), MAX_GRID_X))",
        ]
    else:  # a power of two no larger than the row needs (the shared-memory tree halves it)
        lines += [
            f"    block = min({threads}, max(32, 1 << (max(1, -(-cols // {rp.vec})) - 1).bit_length()))",
            "    blocks = max(1, min(rows, MAX_GRID_X))",
        ]
    if rp.persistent:
        lines.append(f"    blocks = max(1, min(blocks, {grid_sms(rp.sm_share)} * {rp.persistent}))")
    red = "0" if rp.warp_rows else ("33 * 16" if rp.warp_reduce else "block * 16")
    lines.append(f"    smem = {red}")
    if lay.op == "group_norm":
        groups = str(lay.groups) if lay.groups else "x.shape[1]"
        lines.append(f"    groups = {groups}")
        lines.append("    cg = x.shape[1] // groups")
    if csig is not None:  # a row too long for a block's shared memory, not for its cluster's
        C = rp.cluster
        cred = "33 * 16" if rp.warp_reduce else "cblock * 16"
        lines += [
            f"    chunk = -(-cols // {C})\n    chunk = -(-chunk // {rp.vec}) * {rp.vec}",
            f"    cblock = min({threads}, max(32, 1 << (max(1, -(-chunk // {rp.vec})) - 1).bit_length()))",
            f"    csmem = {cred} + 16 + (chunk + {rp.vec}) * 4  # the segment from kc < {rp.vec} on",
        ]
        wide = C > PORTABLE_CLUSTER

        # A cluster wider than 8 runs only where the GPU has room for one (16 free SMs of a GPC): asked of
        # the runtime before each such kernel; where there is none, the block per row below runs instead.
        def room(conds: list[str], name: str, block: str, smem: str) -> str:
            ask = f"kernels.active_clusters({name!r}, ({block},), {smem}) > 0"
            return " and ".join([*conds, *([ask] if wide else [])])

        lines += [
            f"    if cols * 4 + smem > {MAX_SMEM_ROW} and csmem <= {CLUSTER_SMEM}:",
            f"        cgrid = ({C} * max(1, min(rows, MAX_GRID_X // {C})),)",
            f"        cargs = ({csig.args()},)",
        ]

        # A persistent plan launches as many clusters as the GPU holds at once, each looping over rows, where
        # a cluster a row leaves a GPC's SMs idle until a whole cluster's worth of them is free again (a
        # second wave of clusters would start only as the first exits, so one wave whatever the knob says).
        def grid(name: str, block: str, smem: str) -> str:
            if not rp.persistent:
                return "cgrid"
            held = f"kernels.active_clusters({name!r}, ({block},), {smem})"
            return f"({C} * max(1, min(rows, MAX_GRID_X // {C}, {held} or rows)),)"

        if cregs:  # each segment in registers: whole vectors, aligned, and few enough for the plan's block
            V = rp.vec
            rsmem = f"{cred.replace('cblock', str(threads))} + 16"
            conds = [f"cols % {V} == 0", f"chunk <= {rp.regs * V * threads}", f"_aligned((x, y), {V})"]
            conds += [f"(cols // cg) % {V} == 0"] if lay.op == "group_norm" else []
            lines += [
                f"        if {room(conds, f'kp_{rid}_cluster_regs_v{V}', str(threads), rsmem)}:",
                f"            kernels.kp_{rid}_cluster_regs_v{V}({grid(f'kp_{rid}_cluster_regs_v{V}', str(threads), rsmem)}, "
                f"({threads},), cargs, shared_mem={rsmem})  # noqa: F821",
                f"            return {ret}",
            ]

        def call_v(v: int) -> str:
            name = f"kp_{rid}_cluster_v{v}"
            return f"kernels.{name}({grid(name, 'cblock', 'csmem')}, (cblock,), cargs, shared_mem=csmem)  # noqa: F821"

        if wide:  # each vector width that may run, while the GPU has room
            for v in sorted({rp.vec, 1}, reverse=True):
                conds = [f"_aligned((x, y), {v})"] if v > 1 else []
                lines += [
                    f"        if {room(conds, f'kp_{rid}_cluster_v{v}', 'cblock', 'csmem')}:",
                    f"            {call_v(v)}",
                    f"            return {ret}",
                ]
        elif rp.vec > 1:  # the weight and bias are read one element at a time: x and y alone must align
            lines += [
                f"        if _aligned((x, y), {rp.vec}):",
                f"            {call_v(rp.vec)}",
                "        else:",
                f"            {call_v(1)}",
                f"        return {ret}",
            ]
        else:
            lines += [f"        {call_v(1)}", f"        return {ret}"]
    if gsig is not None:  # a row no block caches: over the tiles of a persistent cooperative grid
        V, T = rp.vec, rp.threads
        gsmem = f"{'33' if rp.warp_reduce else T} * 16"
        call = ("            kernels.kp_{}_grid_v{}((gblocks,), ({},), gargs, shared_mem={}, cooperative=True)"
                "  # noqa: F821")  # fmt: skip
        lines += [
            f"    if cols * 4 > {MAX_SMEM_ROW}:",
            f"        gv = {V} if _aligned((x, y), {V}) else 1",
            f"        gp = sms * min({rp.persistent}, kernels.active_blocks(f'kp_{rid}_grid_v{{gv}}', ({T},), {gsmem}))",
            "        if gp > 0:",
            f"            gk = min(gp, -(-cols // {rp.grid_tile or GRID_TILE}))  # tiles a row",
            f"            gchunk = -(-cols // gk)\n            gchunk = -(-gchunk // {V}) * {V}\n            gk = -(-cols // gchunk)",
            "            gblocks = min(rows, gp // gk) * gk  # whole rows a step",
            "            gcount = torch.zeros((rows,), dtype=torch.int32, device=x.device)  # tiles done a row",
            "            gws = torch.empty((rows * gk * 2,), dtype=torch.int64, device=x.device)  # 16-byte partials",
            f"            gargs = ({gsig.args()},)",
        ]
        if V > 1:
            lines += [
                f"            if gv == {V}:",
                "    " + call.format(rid, V, T, gsmem),
                "            else:",
            ]
        lines += ["    " * (V > 1) + call.format(rid, 1, T, gsmem), f"            return {ret}"]
    if ssig is not None:  # too few rows to fill the GPU: each split across blocks, statistics merged
        lines += [
            f"    splits = 1\n    if rows < sms * {rp.splits}:",
            f"        splits = max(1, min(-(-sms * {rp.splits} // rows), cols // ({rp.threads * rp.vec} * 4), MAX_GRID_Y))",
            "    if splits > 1:",
            f"        chunk = -(-cols // splits)\n        chunk = -(-chunk // {rp.vec}) * {rp.vec}",
            "        splits = -(-cols // chunk)",
            "        ws = torch.empty((splits * rows * 2,), dtype=torch.int64, device=x.device)  # 16-byte partials",
            f"        v = {rp.vec} if _aligned((x, y), {rp.vec}) else 1",
            f"        sargs = ({ssig.args()},)",
            # direct calls, not kernels held in variables: the static check resolves each launch by name
            *(
                f"        {head}\n"
                + "".join(
                    f"            kernels.kp_{region.rid}_{part}_v{w}((blocks, splits), (block,), sargs, "
                    "shared_mem=smem)  # noqa: F821\n"
                    for part in ("part", "apply")
                ).rstrip("\n")
                for head, w in (("if v > 1:", rp.vec), ("else:", 1))
            ),
            f"        return {ret}",
        ]
    if combine:
        lines += [
            f"    splits = 1\n    if rows < sms * {rp.splits}:",
            f"        splits = max(1, min(-(-sms * {rp.splits} // rows), cols // ({rp.threads * rp.vec} * 4), MAX_GRID_Y))",
            f"    chunk = -(-cols // splits)\n    chunk = -(-chunk // {rp.vec}) * {rp.vec}",
            "    splits = -(-cols // chunk)",
            "    # partial accumulators (16 bytes each); with one split the kernel stores directly",
            "    ws = torch.empty((splits * rows * 2,), dtype=torch.int64, device=x.device) if splits > 1 else y",
            "    grid = (blocks, splits)",
        ]
    else:
        lines.append("    grid = (blocks,)")
    lines.append(f"    args = ({sig.args()},)")
    rows_per = f"{threads // 32}" if rp.warp_rows else "1"
    if cache:
        lines.append(f"    cached = cols * 4 * {rows_per} + smem <= {MAX_SMEM_ROW}")
    # The most specialised variant whose conditions hold: registers, then shared memory, then vectors.
    vec_ts = ", ".join(("x", "y", *vec_more))  # the tensors read and written as vectors
    first = True
    for k in reversed(variants):
        conds = []
        if k.vec > 1:
            conds.append(f"_aligned(({vec_ts},), {k.vec})")
            if in_place and lay.op in reduce_ops.TWO_PASS:  # x's rows read with y's vectors: one alignment
                conds.append(f"cols % {k.vec} == 0 and all(v % {k.vec} == 0 for v in (xf, xe, xd))")
        if k.cached:
            conds.append("cached")
        if k.regs:  # the row fits the registers and splits into whole vectors
            conds.append(f"cols % {k.vec} == 0 and cols <= {rp.regs * k.vec} * block")
            if (
                wb and k.vec > 1 and lay.op in ("layer_norm", "rms_norm")
            ):  # weight and bias read as vectors too
                conds.append(f"_aligned(({', '.join(wb)},), {k.vec})")
        smem = f"smem + cols * 4 * {rows_per}" if k.cached else "smem"
        call = f"kernels.{k.name}(grid, (block,), args, shared_mem={smem})  # noqa: F821"
        if not conds:
            lines.append(("    else:\n        " if not first else "    ") + call)
            break
        lines.append(f"    {'if' if first else 'elif'} {' and '.join(conds)}:\n        {call}")
        first = False
    if combine:
        lines.append("    if splits > 1:")
        lines.append(
            f"        kernels.kp_{rid}_combine((max(1, min(-(-rows // 256), sms * 8)),), (256,), "
            f"({combine.args()},))  # noqa: F821"
        )
    lines.append(f"    return {ret}")
    return "\n".join(lines)
