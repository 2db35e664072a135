"""Run generated kernels on the CPU: a test aid for machines without a GPU.

The CUDA source is compiled with g++ against a small shim of the CUDA subset the templates use (thread
and block indices, __syncthreads, warp shuffles, dynamic shared memory, fp16/bf16 storage). Each launch
runs its blocks one after another. The CUDA threads of a block are fibers of one OS thread, each run until
it waits at a barrier (or a shuffle), then the next: barriers and shuffles behave as on the GPU, a missing
barrier shows up as a wrong result (a thread reads what later threads have not written yet), and a barrier
that some threads never reach stops the launch with an error. A kernel with `__cluster_dims__(C, 1, 1)`
runs its clusters one after another, the C blocks of each at once (C * blockDim fibers), each block
with its own shared memory and barriers, the cluster's barrier and the mapping of a block's shared memory
to another's (distributed shared memory) as the kp_cluster_* helpers of templates/rowwise.py define them
on the GPU. A static `__shared__` array is one for the whole cluster here: cluster kernels take dynamic
shared memory only. A cooperative launch (16 blocks at most) runs its whole grid as one cluster, so a block
spinning on a global counter (kp_grid_wait) yields to the blocks that will raise it.
`EmuKernels` stands in for the runtime's `Kernels`, so a generated launcher runs unchanged on CPU tensors.
Slow: keep shapes small.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import uuid
from pathlib import Path

import numpy

SHIM = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <limits.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <functional>
#include <vector>
#include <algorithm>
using std::max;  // CUDA's integer min and max
using std::min;

struct kp_dim3 { unsigned x = 0, y = 0, z = 0; };
// The running CUDA thread's own values: set by the scheduler each time it resumes that thread.
kp_dim3 threadIdx, blockIdx;
kp_dim3 blockDim, gridDim;
int kp_lane = 0, kp_warp = 0;
constexpr int KP_EMU_MAX_CLUSTER = 16;
alignas(16) static unsigned char kp_emu_smem[KP_EMU_MAX_CLUSTER][256 * 1024];
unsigned char* kp_emu_smem_base = kp_emu_smem[0];  // this thread's block's shared memory
unsigned kp_emu_rank = 0;  // this thread's block within its cluster

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define __constant__
#define __cluster_dims__(...)
template <class T> inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
// PTX prmt's default mode: result byte i is byte (s >> 4i) & 7 of the 8 bytes {y, x} (x the low four).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long b = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((b >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
#define CUDART_INF_F INFINITY
#define CUDART_NAN_F NAN
// CUDA math functions that C's math library lacks, computed in double and rounded once.
inline float cyl_bessel_i0f(float x) { return (float)std::cyl_bessel_i(0.0, std::fabs((double)x)); }
inline float cyl_bessel_i1f(float x) {
    const double v = std::cyl_bessel_i(1.0, std::fabs((double)x));
    return (float)(x < 0 ? -v : v);
}
inline float erfcxf(float x) {  // exp(x^2) erfc(x); its asymptotic series where erfc underflows
    const double d = x;
    if (d < 25.0) return (float)(std::exp(d * d) * std::erfc(d));
    const double r = 1.0 / (d * d);
    return (float)(1.0 / (d * std::sqrt(M_PI)) * (1.0 - 0.5 * r + 0.75 * r * r));
}
inline float erfinvf(float y) {  // Newton's steps on erf from a logarithmic first guess
    if (std::isnan(y) || std::fabs(y) > 1.0f) return NAN;
    if (std::fabs(y) == 1.0f) return std::copysign(INFINITY, y);
    const double t = std::log(1.0 - (double)y * y);
    double x = std::copysign(std::sqrt(std::sqrt(std::pow(4.3307 + t / 2, 2) - t / 0.147) - (4.3307 + t / 2)), (double)y);
    for (int i = 0; i < 4; ++i) x -= (std::erf(x) - y) / (2.0 / std::sqrt(M_PI) * std::exp(-x * x));
    return (float)x;
}
inline float sinpif(float x) { return (float)std::sin(M_PI * std::fmod((double)x, 2.0)); }
inline float cospif(float x) { return (float)std::cos(M_PI * std::fmod((double)x, 2.0)); }
inline float normcdff(float x) { return (float)(0.5 * std::erfc(-(double)x / std::sqrt(2.0))); }
inline float normcdfinvf(float p) { return (float)(std::sqrt(2.0) * (double)erfinvf(2.0f * p - 1.0f)); }
// Round-to-nearest arithmetic the templates spell out so nvcc neither fuses nor approximates it: IEEE ops here.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
// The emulated threads run one at a time and switch only at barriers and shuffles: a read-modify-write is
// atomic as it stands.
template <class T> inline T atomicAdd(T* p, T v) { const T old = *p; *p = old + v; return old; }
template <class T> inline T atomicMax(T* p, T v) { const T old = *p; if (v > old) *p = v; return old; }

// A GPU faults on a misaligned vector access; x86 does not, so the emulator counts them instead.
// kp_emu_error: 1 when threads wait at a barrier the others never reach, 2 when no stacks could be mapped.
extern "C" { int kp_emu_misaligned = 0, kp_emu_error = 0; }
#define KP_CHECK_ALIGN(p, bytes) \
    do { if (reinterpret_cast<uintptr_t>(p) % (bytes)) __atomic_store_n(&kp_emu_misaligned, 1, __ATOMIC_RELAXED); } while (0)

// Each CUDA thread is a fiber (ucontext) on one OS thread; a fiber runs until it waits at a barrier, then
// the next one runs. On two cores this ran test_expert's 20 emulated reduction candidates in 8.3 s, where
// a std::thread a CUDA thread meeting at std::barriers took 27.3 s.
struct kp_fiber {
    ucontext_t ctx;
    kp_dim3 tid, bid;
    int lane = 0, warp = 0;
    unsigned rank = 0, token = 0;  // token: the cluster barrier's phase it arrived in (split barrier)
    bool done = false;
};
struct kp_bar { unsigned expected = 0, arrived = 0, phase = 0; };
constexpr size_t KP_EMU_STACK = 256 * 1024;  // reserved, not committed: only the pages used are touched
static std::vector<kp_fiber> kp_fibers;
static ucontext_t kp_sched;
static kp_fiber* kp_cur = nullptr;
static const std::function<void()>* kp_body = nullptr;
static bool kp_moved = false;  // since the scheduler last resumed a fiber: a barrier was met or passed

inline void kp_yield() { swapcontext(&kp_cur->ctx, &kp_sched); }
inline unsigned kp_arrive(kp_bar& b) {
    const unsigned phase = b.phase;
    kp_moved = true;
    if (++b.arrived == b.expected) { b.arrived = 0; ++b.phase; }
    return phase;
}
inline void kp_wait(kp_bar& b, unsigned phase) {
    while (b.phase == phase) kp_yield();
    kp_moved = true;
}
inline void kp_sync(kp_bar& b) { kp_wait(b, kp_arrive(b)); }

static std::vector<kp_bar> kp_block_bar;  // one a block of the cluster
static kp_bar kp_cluster_bar;
static std::vector<kp_bar> kp_warp_bar;  // warps numbered across the cluster
static uint64_t kp_xchg[KP_EMU_MAX_CLUSTER * 32][32];

inline void __syncthreads() { kp_sync(kp_block_bar[kp_emu_rank]); }
inline unsigned kp_cluster_rank() { return kp_emu_rank; }
inline void kp_cluster_sync() { kp_sync(kp_cluster_bar); }
// The split barrier: arrive now, wait later (the phase a thread holds between them is its own).
inline void kp_cluster_arrive() { kp_cur->token = kp_arrive(kp_cluster_bar); }
inline void kp_cluster_wait() { kp_wait(kp_cluster_bar, kp_cur->token); }
template <class T> inline T* kp_cluster_map(T* p, unsigned rank) {
    return reinterpret_cast<T*>(kp_emu_smem[rank] + (reinterpret_cast<unsigned char*>(p) - kp_emu_smem_base));
}
// A cooperative grid's blocks run at once as one cluster does: one signals through a global counter, another
// spins on it (a fiber yielding until the count is reached: no progress while it waits).
#define KP_GRID_DEFINED 1
inline void kp_grid_arrive(int* count) { __atomic_fetch_add(count, 1, __ATOMIC_SEQ_CST); }
inline void kp_grid_wait(const int* count, int target) {
    while (__atomic_load_n(count, __ATOMIC_SEQ_CST) < target) kp_yield();
    kp_moved = true;
}
template <class T> inline T kp_ld_cg(const T* p) { return *p; }
inline void __syncwarp(unsigned = 0xffffffffu) { kp_sync(kp_warp_bar[kp_warp]); }

template <class T> inline T kp_shfl(T v, int src, bool valid) {
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    kp_xchg[kp_warp][kp_lane] = bits;
    kp_sync(kp_warp_bar[kp_warp]);
    uint64_t got = valid ? kp_xchg[kp_warp][src] : bits;
    kp_sync(kp_warp_bar[kp_warp]);
    T out;
    memcpy(&out, &got, sizeof(T));
    return out;
}
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return kp_shfl(v, src & 31, true); }
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d) { return kp_shfl(v, kp_lane + (int)d, kp_lane + (int)d < 32); }
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d) { return kp_shfl(v, kp_lane - (int)d, kp_lane - (int)d >= 0); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m) { return kp_shfl(v, kp_lane ^ m, true); }
// With a width: a lane that names one of a later segment's lanes gets its own value back (CUDA's rule).
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m, int width) {
    const int src = (kp_lane ^ m) & 31;
    return kp_shfl(v, src, src < (kp_lane / width + 1) * width);
}

struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.x << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (isnan(f)) return {0x7fc0};
    u += 0x7fffu + ((u >> 16) & 1u);
    return {(uint16_t)(u >> 16)};
}
inline float __half2float(__half h) { _Float16 v; memcpy(&v, &h.x, 2); return (float)v; }
inline __half __float2half_rn(float f) { _Float16 v = (_Float16)f; __half h; memcpy(&h.x, &v, 2); return h; }
struct alignas(4) __half2 { __half x, y; };
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }

struct alignas(8) float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// The warp MMA m16n8k8 on tf32 (fp32 accumulators), from PTX's fragment layouts: lane = 4 * g + t holds
// A(g, t), A(g + 8, t), A(g, t + 4), A(g + 8, t + 4); B(t, g), B(t + 4, g); C(g, 2t), C(g, 2t + 1),
// C(g + 8, 2t), C(g + 8, 2t + 1). A tf32 operand is its fp32 bits with the low 13 dropped (truncated).
#define KP_EMULATED 1
static uint32_t kp_mma_a[KP_EMU_MAX_CLUSTER * 32][32][4], kp_mma_b[KP_EMU_MAX_CLUSTER * 32][32][2];
inline float kp_emu_tf32_value(uint32_t u) { u &= 0xffffe000u; float f; memcpy(&f, &u, 4); return f; }
inline void kp_emu_mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    for (int i = 0; i < 4; ++i) kp_mma_a[kp_warp][kp_lane][i] = a[i];
    kp_mma_b[kp_warp][kp_lane][0] = b0;
    kp_mma_b[kp_warp][kp_lane][1] = b1;
    kp_sync(kp_warp_bar[kp_warp]);
    const int g = kp_lane >> 2, t = kp_lane & 3;
    for (int c = 0; c < 4; ++c) {
        const int row = g + (c >= 2 ? 8 : 0), col = 2 * t + (c & 1);
        float sum = 0.f;
        for (int kk = 0; kk < 8; ++kk) {
            const float av = kp_emu_tf32_value(kp_mma_a[kp_warp][4 * (row % 8) + kk % 4][(row >= 8) + 2 * (kk >= 4)]);
            const float bv = kp_emu_tf32_value(kp_mma_b[kp_warp][4 * col + kk % 4][kk >= 4]);
            sum += av * bv;
        }
        d[c] += sum;
    }
    kp_sync(kp_warp_bar[kp_warp]);
}

static void kp_fiber_main() {
    (*kp_body)();
    kp_cur->done = true;
    kp_moved = true;
}  // returns to the scheduler through uc_link

// Clusters (of `cluster` blocks along x; 1 without __cluster_dims__) run one after another, the cluster *
// nthreads CUDA threads of each as fibers resumed in turn. When a whole round of them makes no progress
// (each waits at a barrier that the others will never reach), the launch stops: kp_emu_error = 1.
inline void kp_emu_run(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       size_t smem, unsigned cluster, const std::function<void()>& body) {
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    kp_body = &body;
    const unsigned n = bx * by * bz, warps = (n + 31) / 32, total = cluster * n;
    if (kp_fibers.size() < total) kp_fibers.resize(total);
    // One mapping for all the stacks, unmapped when the launch ends: every kernel library has its own
    // emulator, and mappings kept per fiber would run into the process's limit on mappings.
    void* stacks = mmap(nullptr, total * KP_EMU_STACK, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) {
        kp_emu_error = 2;
        return;
    }
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x0 = 0; x0 < gx; x0 += cluster) {
                kp_block_bar.assign(cluster, kp_bar{n});
                kp_cluster_bar = kp_bar{total};
                kp_warp_bar.clear();
                for (unsigned c = 0; c < cluster; ++c)
                    for (unsigned w = 0; w < warps; ++w) kp_warp_bar.push_back(kp_bar{std::min(32u, n - 32 * w)});
                for (unsigned c = 0; c < cluster; ++c) memset(kp_emu_smem[c], 0xff, smem);  // garbage, as on the GPU
                for (unsigned g = 0; g < total; ++g) {
                    kp_fiber& f = kp_fibers[g];
                    const unsigned t = g % n;
                    f.rank = g / n;
                    f.tid = {t % bx, (t / bx) % by, t / (bx * by)};
                    f.bid = {x0 + f.rank, y, z};
                    f.lane = t % 32;
                    f.warp = f.rank * warps + t / 32;
                    f.done = false;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = static_cast<char*>(stacks) + g * KP_EMU_STACK;
                    f.ctx.uc_stack.ss_size = KP_EMU_STACK;
                    f.ctx.uc_link = &kp_sched;
                    makecontext(&f.ctx, kp_fiber_main, 0);
                }
                for (unsigned live = total; live;) {
                    bool moved = false;
                    for (unsigned g = 0; g < total; ++g) {
                        kp_fiber& f = kp_fibers[g];
                        if (f.done) continue;
                        kp_cur = &f;
                        threadIdx = f.tid;
                        blockIdx = f.bid;
                        kp_lane = f.lane;
                        kp_warp = f.warp;
                        kp_emu_rank = f.rank;
                        kp_emu_smem_base = kp_emu_smem[f.rank];
                        kp_moved = false;
                        swapcontext(&kp_sched, &f.ctx);
                        moved = moved || kp_moved;
                        live -= f.done;
                    }
                    if (!moved) {
                        kp_emu_error = 1;
                        munmap(stacks, total * KP_EMU_STACK);
                        return;
                    }
                }
            }
    munmap(stacks, total * KP_EMU_STACK);
}
"""

_KERNEL = re.compile(
    r'extern "C" __global__ void(?:\s+__launch_bounds__\((\d+)[^)]*\))?(?:\s+__cluster_dims__\((\d+)[^)]*\))?'
    r"\s+(\w+)\(([^)]*)\)",
    re.S,
)


def _param_type(param: str) -> str:
    p = re.sub(r"__restrict__", "", param).strip()
    name = re.search(r"(\w+)\s*$", p)
    assert name is not None, param
    return p[: name.start()].strip()


def translate(source: str, shim: str = SHIM) -> tuple[str, list[str]]:
    """The C++ the shim compiles: includes dropped, dynamic shared memory mapped, a launcher per kernel."""
    src = re.sub(r"#include <(cuda_fp16|cuda_bf16|math_constants)\.h>\n", "", source)
    src = src.replace(
        "extern __shared__ __align__(16) unsigned char kp_smem[];",
        "unsigned char* kp_smem = kp_emu_smem_base;",
    )
    names = []
    wrappers = []
    for m in _KERNEL.finditer(src):
        name, params = m.group(3), [p for p in m.group(4).split(",") if p.strip()]
        cluster = int(m.group(2) or 1)
        names.append(f"{name}:{m.group(1) or 1024}:{cluster}")
        unpack = ", ".join(f"*({_param_type(p)}*)a[{i}]" for i, p in enumerate(params))
        wrappers.append(
            f'extern "C" void {name}__emu(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, '
            f"unsigned bz, size_t smem, unsigned coop, void** a) {{\n"
            f"    kp_emu_run(gx, gy, gz, bx, by, bz, smem, coop ? gx : {cluster}, [&]() {{ {name}({unpack}); }});\n}}"
        )
    return shim + src + "\n" + "\n".join(wrappers) + "\n", names


# -fno-gnu-unique: a static inside a template or inline function (__shared__ is `static` here) would be a
# GNU unique symbol, bound process-wide to the first library that defines it: a later candidate's
# `__shared__ float part[16]` then wrote into an earlier one's `part[8]` (a 512-thread kernel after a
# 256-thread one, fuzz seed 21487). Each library keeps its own with this flag.
_FLAGS = ["g++", "-std=c++20", "-O0", "-fPIC", "-pthread", "-w", "-fno-gnu-unique"]


def _shim_header(folder: Path) -> str:
    """The shim as a precompiled header (parsing <barrier>, <thread>... is most of a build's time)."""
    digest = hashlib.sha256((SHIM + " ".join(_FLAGS)).encode()).hexdigest()[:12]
    header = folder / f"kp_emu_shim_{digest}.h"
    if not Path(str(header) + ".gch").is_file():
        tmp = folder / f".{header.name}.{uuid.uuid4().hex}"
        tmp.with_suffix(".h").write_text(SHIM)
        subprocess.run([*_FLAGS, "-x", "c++-header", str(tmp.with_suffix(".h")), "-o", str(tmp) + ".gch"],
                       capture_output=True, check=False)  # fmt: skip
        header.write_text(SHIM)
        if Path(str(tmp) + ".gch").is_file():
            os.replace(str(tmp) + ".gch", str(header) + ".gch")
        tmp.with_suffix(".h").unlink(missing_ok=True)
    return f'#include "{header.name}"\n'


def build(source: str, workdir: str | Path | None = None) -> EmuKernels:
    folder = Path(workdir or tempfile.gettempdir()) / "kernelpro-emu"
    folder.mkdir(parents=True, exist_ok=True)
    text, names = translate(source, _shim_header(folder))
    digest = hashlib.sha256((text + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    lib = folder / f"{digest}.so"
    if not lib.is_file():
        cpp = folder / f"{digest}.cpp"
        cpp.write_text(text)
        tmp = folder / f".{digest}.{uuid.uuid4().hex}.so"
        out = subprocess.run([*_FLAGS, "-shared", "-I", str(folder), "-o", str(tmp), str(cpp)],
                             capture_output=True, text=True)  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"emulator build failed:\n{out.stderr[-4000:]}")
        os.replace(tmp, lib)
    return EmuKernels(str(lib), {n.split(":")[0]: n.split(":", 1)[1] for n in names})


class EmuKernels:
    def __init__(self, path: str, bounds: dict[str, str]):
        self._lib = ctypes.CDLL(path)
        self._bounds = {k: int(v.split(":")[0]) for k, v in bounds.items()}  # kernel -> __launch_bounds__
        self._cluster = {k: int(v.split(":")[1]) for k, v in bounds.items()}  # kernel -> blocks a cluster
        self._names = tuple(self._bounds)
        self.launches: list[tuple[str, tuple, tuple, int]] = []
        self.gpcs = 4  # GPCs of 16 SMs each (0: none, where a cluster of 16 cannot run; see active_clusters)
        self.blocks_per_sm = 2  # active_blocks' answer for any kernel
        self.asked: list[str] = []  # the kernels active_clusters or active_blocks was asked about
        self.cooperative: list[str] = []  # the kernels launched cooperatively
        self.graph_calls = 0  # forwards run through `graphed`

    def active_clusters(self, name: str, block, shared_mem: int = 0) -> int:
        """The runtime's query, as a GPU of `gpcs` GPCs of 16 SMs, a block an SM, would answer it."""
        if name not in self._names:
            raise AttributeError(name)
        self.asked.append(name)
        return self.gpcs * (16 // self._cluster[name])

    def active_blocks(self, name: str, block, shared_mem: int = 0) -> int:
        if name not in self._names:
            raise AttributeError(name)
        self.asked.append(name)
        return self.blocks_per_sm

    def graphed(self, owner, forward, args):
        """The runtime's CUDA-graph replay has no CPU form: the forward runs as written (and is counted)."""
        self.graph_calls += 1
        return forward(*args)

    def __getattr__(self, name: str) -> EmuKernel:
        if name.startswith("_") or name not in self._names:
            raise AttributeError(name)
        return EmuKernel(self, name)


_C = {
    numpy.int64: ctypes.c_int64,
    numpy.int32: ctypes.c_int32,
    numpy.uint64: ctypes.c_uint64,
    numpy.uint32: ctypes.c_uint32,
    numpy.float32: ctypes.c_float,
    numpy.float64: ctypes.c_double,
}


class EmuKernel:
    def __init__(self, owner: EmuKernels, name: str):
        self.owner, self.name = owner, name

    def __call__(self, grid, block, args, shared_mem: int = 0, cooperative: bool = False) -> None:
        import torch

        grid = tuple(grid) + (1,) * (3 - len(tuple(grid)))
        block = tuple(block) + (1,) * (3 - len(tuple(block)))
        # the limits the GPU enforces (a launch beyond them fails there)
        bad = (
            any(int(g) < 1 for g in grid) or any(int(b) < 1 for b in block) or grid[0] > 2**31 - 1
            or grid[1] > 65535 or grid[2] > 65535 or block[2] > 64 or shared_mem > 227 * 1024
        )  # fmt: skip
        cluster = self.owner._cluster[self.name]
        bad = bad or grid[0] % cluster != 0 or cluster > 16  # a grid of whole clusters, 16 blocks at most
        # a cooperative grid runs as one cluster: 16 blocks at most here, and the GPU's residency on it
        bad = bad or (cooperative and (grid[0] > 16 or grid[1] * grid[2] > 1 or cluster > 1))
        if bad:
            raise ValueError(f"{self.name}: bad launch {grid} {block} smem={shared_mem}")
        threads = block[0] * block[1] * block[2]
        if threads > self.owner._bounds[self.name]:
            raise ValueError(
                f"{self.name}: {block} exceeds __launch_bounds__({self.owner._bounds[self.name]})"
            )
        keep = []
        for a in args:
            if isinstance(a, torch.Tensor):
                keep.append(ctypes.c_void_p(a.data_ptr()))
            else:
                keep.append(_C[type(a)](a))
        ptrs = (ctypes.c_void_p * max(1, len(keep)))(
            *[ctypes.cast(ctypes.pointer(k), ctypes.c_void_p) for k in keep]
        )
        fn = getattr(self.owner._lib, f"{self.name}__emu")
        fn.restype = None
        flag = ctypes.c_int.in_dll(self.owner._lib, "kp_emu_misaligned")
        error = ctypes.c_int.in_dll(self.owner._lib, "kp_emu_error")
        flag.value = error.value = 0
        fn(*(ctypes.c_uint(int(v)) for v in (*grid, *block)), ctypes.c_size_t(int(shared_mem)),
           ctypes.c_uint(int(cooperative)), ptrs)  # fmt: skip
        if flag.value:
            raise RuntimeError(f"{self.name}: misaligned vector access (a GPU would fault)")
        if error.value == 1:
            raise RuntimeError(
                f"{self.name}: threads wait at a barrier the others never reach (a GPU would hang)"
            )
        if error.value:
            raise RuntimeError(f"{self.name}: the emulator could not map stacks for {grid} x {block}")
        self.owner.launches.append((self.name, grid, block, int(shared_mem)))
        if cooperative:
            self.owner.cooperative.append(self.name)


def load_model(launcher: str, kernels: EmuKernels, sms: int = 4):
    """ModelNew of a generated launcher, wired to the emulator (its SM count preset: no CUDA needed)."""
    namespace: dict = {"__name__": "kernelpro_emulated", "kernels": kernels}
    exec(compile(launcher, "<launcher>", "exec"), namespace)
    cls = namespace["ModelNew"]

    def factory(*args, **kwargs):
        m = cls(*args, **kwargs)
        m.sms = sms
        return m

    return factory
