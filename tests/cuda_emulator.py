"""Run generated kernels on the CPU: a test aid for machines without a GPU.

The CUDA source is compiled with g++ against a small shim of the CUDA subset the templates use (thread
and block indices, __syncthreads, warp shuffles, dynamic shared memory, fp16/bf16 storage). Each launch
runs its blocks one after another on blockDim real threads, so barriers and shuffles behave as on the
GPU; races and divergent barriers show up as wrong results or hangs. A kernel with `__cluster_dims__(C, 1,
1)` runs its clusters one after another, the C blocks of each at once (C * blockDim threads), each block
with its own shared memory and barriers, the cluster's barrier and the mapping of a block's shared memory
to another's (distributed shared memory) as the kp_cluster_* helpers of templates/rowwise.py define them
on the GPU. A static `__shared__` array is one for the whole cluster here: cluster kernels take dynamic
shared memory only.
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
#include <barrier>
#include <functional>
#include <memory>
#include <thread>
#include <optional>
#include <vector>
#include <algorithm>
using std::max;  // CUDA's integer min and max
using std::min;

struct kp_dim3 { unsigned x = 0, y = 0, z = 0; };
thread_local kp_dim3 threadIdx, blockIdx;
kp_dim3 blockDim, gridDim;
thread_local int kp_lane = 0, kp_warp = 0;
constexpr int KP_EMU_MAX_CLUSTER = 8;
alignas(16) static unsigned char kp_emu_smem[KP_EMU_MAX_CLUSTER][256 * 1024];
thread_local unsigned char* kp_emu_smem_base = kp_emu_smem[0];  // this thread's block's shared memory
thread_local unsigned kp_emu_rank = 0;  // this thread's block within its cluster

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
#define CUDART_INF_F INFINITY
#define CUDART_NAN_F NAN

// A GPU faults on a misaligned vector access; x86 does not, so the emulator counts them instead.
extern "C" { int kp_emu_misaligned = 0; }
#define KP_CHECK_ALIGN(p, bytes) \
    do { if (reinterpret_cast<uintptr_t>(p) % (bytes)) __atomic_store_n(&kp_emu_misaligned, 1, __ATOMIC_RELAXED); } while (0)

static std::vector<std::unique_ptr<std::barrier<>>> kp_block_bar;  // one a block of the cluster
static std::unique_ptr<std::barrier<>> kp_cluster_bar;
static std::vector<std::unique_ptr<std::barrier<>>> kp_warp_bar;  // warps numbered across the cluster
static uint64_t kp_xchg[KP_EMU_MAX_CLUSTER * 32][32];

inline void __syncthreads() { kp_block_bar[kp_emu_rank]->arrive_and_wait(); }
inline unsigned kp_cluster_rank() { return kp_emu_rank; }
inline void kp_cluster_sync() { kp_cluster_bar->arrive_and_wait(); }
// The split barrier: arrive now, wait later (the token a thread holds between them is its own).
thread_local std::optional<std::barrier<>::arrival_token> kp_emu_token;
inline void kp_cluster_arrive() { kp_emu_token.emplace(kp_cluster_bar->arrive()); }
inline void kp_cluster_wait() { kp_cluster_bar->wait(std::move(*kp_emu_token)); kp_emu_token.reset(); }
template <class T> inline T* kp_cluster_map(T* p, unsigned rank) {
    return reinterpret_cast<T*>(kp_emu_smem[rank] + (reinterpret_cast<unsigned char*>(p) - kp_emu_smem_base));
}
inline void __syncwarp(unsigned = 0xffffffffu) { kp_warp_bar[kp_warp]->arrive_and_wait(); }

template <class T> inline T kp_shfl(T v, int src, bool valid) {
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    kp_xchg[kp_warp][kp_lane] = bits;
    kp_warp_bar[kp_warp]->arrive_and_wait();
    uint64_t got = valid ? kp_xchg[kp_warp][src] : bits;
    kp_warp_bar[kp_warp]->arrive_and_wait();
    T out;
    memcpy(&out, &got, sizeof(T));
    return out;
}
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return kp_shfl(v, src & 31, true); }
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d) { return kp_shfl(v, kp_lane + (int)d, kp_lane + (int)d < 32); }
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d) { return kp_shfl(v, kp_lane - (int)d, kp_lane - (int)d >= 0); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m) { return kp_shfl(v, kp_lane ^ m, true); }

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

struct alignas(8) float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
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
    kp_warp_bar[kp_warp]->arrive_and_wait();
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
    kp_warp_bar[kp_warp]->arrive_and_wait();
}

// Clusters (of `cluster` blocks along x; 1 without __cluster_dims__) run one after another on
// cluster * nthreads std::threads; every thread takes part in every cluster, as one thread of one block.
inline void kp_emu_run(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       size_t smem, unsigned cluster, const std::function<void()>& body) {
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    const unsigned n = bx * by * bz, warps = (n + 31) / 32;
    kp_block_bar.clear();
    for (unsigned c = 0; c < cluster; ++c) kp_block_bar.push_back(std::make_unique<std::barrier<>>(n));
    kp_cluster_bar = std::make_unique<std::barrier<>>(cluster * n);
    kp_warp_bar.clear();
    for (unsigned c = 0; c < cluster; ++c)
        for (unsigned w = 0; w < warps; ++w)
            kp_warp_bar.push_back(std::make_unique<std::barrier<>>(std::min(32u, n - 32 * w)));
    std::barrier<> step(cluster * n);
    std::vector<std::thread> pool;
    for (unsigned g = 0; g < cluster * n; ++g) {
        pool.emplace_back([&, g]() {
            const unsigned rank = g / n, t = g % n;
            threadIdx = {t % bx, (t / bx) % by, t / (bx * by)};
            kp_lane = t % 32;
            kp_warp = rank * warps + t / 32;
            kp_emu_rank = rank;
            kp_emu_smem_base = kp_emu_smem[rank];
            for (unsigned z = 0; z < gz; ++z)
                for (unsigned y = 0; y < gy; ++y)
                    for (unsigned x = rank; x < gx; x += cluster) {
                        if (t == 0) memset(kp_emu_smem_base, 0xff, smem);  // garbage, as on the GPU
                        step.arrive_and_wait();
                        blockIdx = {x, y, z};
                        body();
                        step.arrive_and_wait();
                    }
        });
    }
    for (auto& th : pool) th.join();
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
            f"unsigned bz, size_t smem, void** a) {{\n"
            f"    kp_emu_run(gx, gy, gz, bx, by, bz, smem, {cluster}, [&]() {{ {name}({unpack}); }});\n}}"
        )
    return shim + src + "\n" + "\n".join(wrappers) + "\n", names


_FLAGS = ["g++", "-std=c++20", "-O1", "-fPIC", "-pthread", "-w"]


def _shim_header(folder: Path) -> str:
    """The shim as a precompiled header (parsing <barrier>, <thread>... is most of a build's time)."""
    digest = hashlib.sha256(SHIM.encode()).hexdigest()[:12]
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
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
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

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        import torch

        grid = tuple(grid) + (1,) * (3 - len(tuple(grid)))
        block = tuple(block) + (1,) * (3 - len(tuple(block)))
        # the limits the GPU enforces (a launch beyond them fails there)
        bad = (
            any(int(g) < 1 for g in grid) or any(int(b) < 1 for b in block) or grid[0] > 2**31 - 1
            or grid[1] > 65535 or grid[2] > 65535 or block[2] > 64 or shared_mem > 227 * 1024
        )  # fmt: skip
        cluster = self.owner._cluster[self.name]
        bad = bad or grid[0] % cluster != 0 or cluster > 8  # a grid of whole clusters, 8 blocks at most
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
        flag.value = 0
        fn(*(ctypes.c_uint(int(v)) for v in (*grid, *block)), ctypes.c_size_t(int(shared_mem)), ptrs)
        if flag.value:
            raise RuntimeError(f"{self.name}: misaligned vector access (a GPU would fault)")
        self.owner.launches.append((self.name, grid, block, int(shared_mem)))


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
