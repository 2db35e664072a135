"""Does moving a stream through TMA bulk copies draw less power than loads and stores by every thread?

Issue 19 asks for candidates that use less energy at matched speed. On bandwidth-bound kernels the H200
draws 630-715 W whatever the SM count (docs/benchmarks.md), so energy follows time. This probe measures,
on one 1 GiB stream (y = a * x + b, fp32), the time, power and energy per call of:

- `lsu`: a grid-stride loop, 16-byte loads and stores by every thread (the expert's element-wise shape);
- `lsu_half`: the same on half the SMs;
- `tma_copy` / `tma_axpb`: one thread per block moves chunks through shared memory with
  `cp.async.bulk` (global -> shared on an mbarrier, shared -> global as a bulk group); in `tma_axpb` the
  block's threads apply a * x + b to the chunk in shared memory between the two;
- `eager_2kernels`: `torch.mul(x, a, out=y)` then `y.add_(b)` (two passes, for scale).

Time from CUDA events (median of 30, after warm-up); energy from NVML's total-energy counter over windows
of about 2 s (pipeline/energy.py's method, here without its candidate checks: every variant's output is
checked once against torch). Usage: python3 benchmarks/power_probe.py OUT.json [VARIANT ...] (all by default)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import cupy as cp
import pynvml
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from event_timing import event_median_ms  # benchmarks/, this script's folder

from pipeline.energy import nvml_handle

SRC = r"""
typedef unsigned int uint32_t;
__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

extern "C" __global__ void lsu(const float4* __restrict__ x, float4* __restrict__ y, long long n4,
                               float a, float b) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4;
       i += (long long)gridDim.x * blockDim.x) {
    float4 v = x[i];
    y[i] = make_float4(a * v.x + b, a * v.y + b, a * v.z + b, a * v.w + b);
  }
}

__device__ __forceinline__ float4 ld_stream(const float4* p) {
  float4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_stream(float4* p, float4 v) {
  asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

// Streaming cache hints; U vectors loaded before any is stored.
template <int U>
__device__ void lsu_hinted(const float4* __restrict__ x, float4* __restrict__ y, long long n4, float a, float b) {
  const long long step = (long long)gridDim.x * blockDim.x;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  for (; i + (U - 1) * step < n4; i += U * step) {
    float4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld_stream(x + i + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u)
      st_stream(y + i + u * step, make_float4(a * v[u].x + b, a * v[u].y + b, a * v[u].z + b, a * v[u].w + b));
  }
  for (; i < n4; i += step) {
    float4 v = ld_stream(x + i);
    st_stream(y + i, make_float4(a * v.x + b, a * v.y + b, a * v.z + b, a * v.w + b));
  }
}
extern "C" __global__ void lsu_cs(const float4* x, float4* y, long long n4, float a, float b) {
  lsu_hinted<1>(x, y, n4, a, b);
}
extern "C" __global__ void lsu_cs_u4(const float4* x, float4* y, long long n4, float a, float b) {
  lsu_hinted<4>(x, y, n4, a, b);
}

// Chunks of CH bytes, S stages; chunk k of the stream goes to block k % gridDim.x. MODE 0: copy, one
// thread; 1: the block applies a * x + b in shared memory, then a bulk store; 2: the block reads the chunk
// from shared memory and stores a * x + b itself (16-byte streaming stores).
template <int CH, int S, int MODE>
__device__ void tma_stream(const char* x, char* y, long long chunks, float a, float b) {
  extern __shared__ __align__(128) unsigned char buf[];
  __shared__ __align__(8) unsigned long long bar[S];
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;");
    asm volatile("fence.proxy.async.shared::cta;");
  }
  __syncthreads();
  auto load = [&](int s, long long k) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(&bar[s])), "r"(CH));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(sa(buf + s * CH)), "l"(x + k * CH), "r"(CH), "r"(sa(&bar[s])) : "memory");
  };
  const long long G = gridDim.x;
  if (tid == 0)
    for (int s = 0; s < S; ++s) {
      long long k = blockIdx.x + s * G;
      if (k < chunks) load(s, k);
    }
  for (long long it = 0;; ++it) {
    long long k = blockIdx.x + it * G;
    if (k >= chunks) break;
    int s = (int)(it % S);
    uint32_t phase = (uint32_t)((it / S) & 1);
    if (MODE > 0 || tid == 0) {
      asm volatile("{ .reg .pred p; W%=: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W%=; }"
                   :: "r"(sa(&bar[s])), "r"(phase) : "memory");
    }
    if (MODE == 2) {
      const float4* v = reinterpret_cast<const float4*>(buf + s * CH);
      float4* out = reinterpret_cast<float4*>(y + k * CH);
      for (int i = tid; i < CH / 16; i += blockDim.x) {
        float4 t = v[i];
        st_stream(out + i, make_float4(a * t.x + b, a * t.y + b, a * t.z + b, a * t.w + b));
      }
      __syncthreads();
      long long kn = k + S * G;
      if (tid == 0 && kn < chunks) load(s, kn);
      continue;
    }
    if (MODE == 1) {
      float4* v = reinterpret_cast<float4*>(buf + s * CH);
      for (int i = tid; i < CH / 16; i += blockDim.x) {
        float4 t = v[i];
        v[i] = make_float4(a * t.x + b, a * t.y + b, a * t.z + b, a * t.w + b);
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
    }
    if (tid == 0) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(y + k * CH), "r"(sa(buf + s * CH)), "r"(CH) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      // Refill the previous iteration's stage once its store has read shared memory.
      if (it > 0) {
        long long kn = blockIdx.x + (it - 1 + S) * G;
        if (kn < chunks) {
          asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
          load((int)((it - 1) % S), kn);
        }
      }
    }
  }
  if (MODE != 2 && tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

extern "C" __global__ void tma_copy(const char* x, char* y, long long chunks, float a, float b) {
  tma_stream<16384, 4, 0>(x, y, chunks, a, b);
}
extern "C" __global__ void tma_copy_big(const char* x, char* y, long long chunks, float a, float b) {
  tma_stream<32768, 6, 0>(x, y, chunks, a, b);
}
extern "C" __global__ void tma_axpb(const char* x, char* y, long long chunks, float a, float b) {
  tma_stream<16384, 4, 1>(x, y, chunks, a, b);
}
extern "C" __global__ void tma_in(const char* x, char* y, long long chunks, float a, float b) {
  tma_stream<16384, 4, 2>(x, y, chunks, a, b);
}
"""

CH, STAGES = 16384, 4


def energy(fn, handle, per_call_ms: float, windows: int = 3, seconds: float = 2.0) -> dict:
    calls = max(1, int(seconds * 1e3 / per_call_ms))
    jpc, watts = [], []
    for _ in range(windows):
        torch.cuda.synchronize()
        e0, t0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        e1, t1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter()
        jpc.append((e1 - e0) / 1e3 / calls)
        watts.append((e1 - e0) / 1e3 / (t1 - t0))
    mean = statistics.mean(jpc)
    spread = statistics.stdev(jpc) / mean / len(jpc) ** 0.5 if len(jpc) > 1 else None
    return {"mj_per_call": statistics.median(jpc) * 1e3, "watts": statistics.median(watts), "spread": spread}


def main(out: str, only: list[str]) -> None:
    torch.manual_seed(0)
    n = 1 << 28
    x = torch.rand(n, device="cuda") * 2 - 1
    y = torch.empty_like(x)
    a, b = 1.5, 0.25
    mod = cp.RawModule(code=SRC, options=("-std=c++17", "--gpu-architecture=sm_90"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    xp, yp = cp.asarray(x), cp.asarray(y)
    chunks = n * 4 // CH
    smem = CH * STAGES
    variants = {}

    def launcher(name: str, grid: int, threads: int, count: int, smem: int = 0):
        f = mod.get_function(name)
        if smem:
            f.max_dynamic_shared_size_bytes = smem
        args = (xp, yp, cp.int64(count), cp.float32(a), cp.float32(b))
        return lambda: f((grid,), (threads,), args, shared_mem=smem)

    variants["lsu"] = launcher("lsu", sms * 4, 256, n // 4)
    variants["lsu_half"] = launcher("lsu", sms * 2, 256, n // 4)
    variants["lsu_cs"] = launcher("lsu_cs", sms * 4, 256, n // 4)
    variants["lsu_cs_u4"] = launcher("lsu_cs_u4", sms * 4, 256, n // 4)
    for name, threads, per_sm in (
        ("tma_copy", 32, 1),
        ("tma_copy", 32, 3),
        ("tma_axpb", 128, 1),
        ("tma_axpb", 128, 3),
        ("tma_in", 128, 1),
        ("tma_in", 128, 3),
        ("tma_in", 256, 3),
    ):
        variants[f"{name}_t{threads}_x{per_sm}"] = launcher(name, sms * per_sm, threads, chunks, smem)
    variants["tma_copy_big_x1"] = launcher("tma_copy_big", sms, 32, n * 4 // 32768, 32768 * 6)

    def eager() -> None:
        torch.mul(x, a, out=y)
        y.add_(b)

    variants["eager_2kernels"] = eager
    handle = nvml_handle(torch.device("cuda"))
    want = x * a + b
    rows = []
    for name, fn in variants.items():
        if only and name not in only:
            continue
        y.zero_()
        fn()
        torch.cuda.synchronize()
        copy_only = name.startswith("tma_copy")
        err = float((y - (x if copy_only else want)).abs().max())
        ms = event_median_ms(fn, 30, 5)
        ms2 = event_median_ms(fn, 30, 5)
        e = energy(fn, handle, ms)
        row = {"variant": name, "ms": ms, "ms_again": ms2, "tb_s": 2 * n * 4 / ms / 1e9, "max_err": err, **e}
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
