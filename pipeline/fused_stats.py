"""The tolerance rule's figures for one chunk of a float output in a single pass on the GPU.

`tolerance.OutputStats.add` in torch launches about 30 float64 kernels and materialises float64 temporaries
of the chunk: about 10 ms a check of the built-in softmax's 64M-element output on the H200 (eager's call
included), 0.27 s a candidate over its ~27 checks. This kernel reads each operand once, accumulates the same 13
figures in float64 per thread and per block, and leaves per-block partials that torch sums (or maxes).
The figures equal the torch form's up to the order of float64 summation.

It is used for CUDA tensors of float32, float64, float16 and bfloat16 on both sides; anything else, or a
kernel that cannot be built here (no NVRTC), keeps the torch form: `figures` then returns None.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy
import torch

THREADS = 256
MAX_BLOCKS = 1024
COLUMNS = 13  # tolerance._SUMMED (11, "wrong" stays 0 for floats), then tolerance._MAXED (2)

_LOAD = {
    torch.float32: ("float", "(double)v"),
    torch.float64: ("double", "v"),
    torch.bfloat16: ("unsigned short", "(double)__uint_as_float(((unsigned)v) << 16)"),
    torch.float16: ("unsigned short", "half_bits(v)"),
}

_SOURCE = r"""
__device__ __forceinline__ double half_bits(unsigned short v) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return (double)f;
}
__device__ __forceinline__ double load_o(const TO* p, long long i) { TO v = p[i]; return LOAD_O; }
__device__ __forceinline__ double load_r(const TR* p, long long i) { TR v = p[i]; return LOAD_R; }

extern "C" __global__ void __launch_bounds__(256) kp_stats(
    const TO* __restrict__ o, const TR* __restrict__ r, long long n, double atol, double rtol,
    double* __restrict__ part) {
  double s[11] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  double max_excess = -1.0 / 0.0, max_abs = -1.0 / 0.0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    double od = load_o(o, i), rd = load_r(r, i);
    bool rfin = isfinite(rd), ofin = isfinite(od), both = rfin && ofin;
    double diff = both ? fabs(od - rd) : 0.0;
    double excess = diff - (atol + rtol * (both ? fabs(rd) : 0.0));
    double of = ofin ? od : 0.0, rf = rfin ? rd : 0.0;
    s[1] += (isnan(od) && rfin) ? 1.0 : 0.0;  // unwritten
    s[2] += (ofin != rfin) ? 1.0 : 0.0;       // bad_special
    s[3] += excess > 0.0 ? 1.0 : 0.0;         // over_base
    s[4] += diff * diff;
    s[5] += rf * rf;
    s[6] += ofin ? 1.0 : 0.0;
    s[7] += of;
    s[8] += of * of;
    s[9] += rfin ? 1.0 : 0.0;
    s[10] += rf;
    max_excess = fmax(max_excess, excess);
    max_abs = fmax(max_abs, diff);
  }
  __shared__ double red[8][13];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < 13; ++k) {
    double v = k < 11 ? s[k] : (k == 11 ? max_excess : max_abs);
    for (int off = 16; off > 0; off >>= 1) {
      double w = __shfl_down_sync(0xffffffffu, v, off);
      v = k < 11 ? v + w : fmax(v, w);
    }
    if (lane == 0) red[warp][k] = v;
  }
  __syncthreads();
  if (threadIdx.x < 13) {
    int k = threadIdx.x;
    double v = red[0][k];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) v = k < 11 ? v + red[w][k] : fmax(v, red[w][k]);
    part[blockIdx.x * 13 + k] = v;
  }
}
"""


def usable(o: torch.Tensor, r: torch.Tensor) -> bool:
    return (
        type(o) is torch.Tensor  # a subclass could answer data_ptr() with memory it does not own
        and type(r) is torch.Tensor
        and o.is_cuda
        and r.device == o.device
        and o.dtype in _LOAD
        and r.dtype in _LOAD
        and o.numel() == r.numel() > 0
        and o.is_contiguous()
        and r.is_contiguous()
    )


def source(o_dtype: torch.dtype, r_dtype: torch.dtype) -> str:
    """The kernel's CUDA source for a pair of dtypes (output's, reference's)."""
    (to, lo), (tr, lr) = _LOAD[o_dtype], _LOAD[r_dtype]
    return f"typedef {to} TO;\ntypedef {tr} TR;\n#define LOAD_O {lo}\n#define LOAD_R {lr}\n" + _SOURCE


@functools.cache
def _kernel(o_dtype: torch.dtype, r_dtype: torch.dtype):
    """The kernel for a pair of dtypes, or None when it cannot be built (said once on stderr)."""
    try:
        import cupy

        # The worker may not write CuPy's on-disk cache (its sandbox); 20 ms of NVRTC a worker is nothing.
        os.environ.setdefault("CUPY_CACHE_IN_MEMORY", "1")
        kernel = cupy.RawKernel(source(o_dtype, r_dtype), "kp_stats")
        kernel.compile()
        return kernel
    except Exception as e:  # no NVRTC, no CuPy: the torch form is the fallback, not an error
        if not _SAID:
            _SAID.append(str(e))
            print(f"kernelpro: the one-pass comparison kernel is not available ({e}); comparing in torch",
                  file=sys.stderr)  # fmt: skip
        return None


_SAID: list[str] = []  # the reason the kernel could not be built, said once a process


def warm() -> None:
    """Build the kernels for the pairs the harness compares (an output against eager's, of its own dtype, and
    against the float64 reference) before the worker's sandbox closes: NVRTC is loaded now, not later."""
    for d in _LOAD:
        _kernel(d, d)
        _kernel(d, torch.float64)


def figures(o: torch.Tensor, r: torch.Tensor, atol: float, rtol: float) -> torch.Tensor | None:
    """The 13 figures (float64, on the device) of `o` against `r`, or None where the torch form must do."""
    if not usable(o, r):
        return None
    kernel = _kernel(o.dtype, r.dtype)
    if kernel is None:
        return None
    import cupy

    from pipeline.runtime import _current_stream

    n = o.numel()
    blocks = max(1, min(MAX_BLOCKS, -(-n // THREADS)))
    part = torch.empty((blocks, COLUMNS), dtype=torch.float64, device=o.device)
    with cupy.cuda.Device(o.device.index), _current_stream(cupy):
        args = (numpy.uint64(o.data_ptr()), numpy.uint64(r.data_ptr()), numpy.int64(n), numpy.float64(atol),
                numpy.float64(rtol), numpy.uint64(part.data_ptr()))  # fmt: skip
        kernel((blocks,), (THREADS,), args)
    return torch.cat((part[:, :11].sum(0), part[:, 11:].amax(0)))
