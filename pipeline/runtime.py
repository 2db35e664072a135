"""The small runtime a candidate's launcher uses: a cubin loaded through CuPy, launched on torch's stream.

This module imports only torch, numpy and cupy, because export.py copies its source verbatim into the
standalone file of the best candidate. A launcher sees a global `kernels` (a `Kernels`) and calls

    kernels.my_kernel(grid, block, (x, out, numpy.int32(n)), shared_mem=0)

Tensors become device pointers; scalars must carry their C type (numpy.int32, numpy.float32, ...), since a
bare Python int could be meant as int or long long and a wrong guess silently corrupts every later argument.
"""

from __future__ import annotations

import numpy
import torch

_SCALARS = (
    numpy.int8,
    numpy.int16,
    numpy.int32,
    numpy.int64,
    numpy.uint8,
    numpy.uint16,
    numpy.uint32,
    numpy.uint64,
    numpy.float16,
    numpy.float32,
    numpy.float64,
    numpy.bool_,
)


class KernelArgumentError(TypeError):
    pass


class Kernel:
    """One `extern "C" __global__` function of a loaded cubin."""

    def __init__(self, function, name: str):  # function: cupy.cuda.function.Function
        self._function = function
        self.name = name
        self._dynamic_smem_limit = 48 * 1024

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        import cupy

        grid, block = _dims(grid, "grid"), _dims(block, "block")
        converted = tuple(_argument(a, i, self.name) for i, a in enumerate(args))
        if shared_mem > self._dynamic_smem_limit:
            # Above 48 KB a kernel must opt in to a larger dynamic shared-memory carve-out.
            driver = cupy.cuda.driver
            driver.funcSetAttribute(
                self._function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(shared_mem)
            )
            self._dynamic_smem_limit = int(shared_mem)
        self._function(grid, block, converted, shared_mem=int(shared_mem), stream=_current_stream(cupy))


class Kernels:
    """The kernels of one cubin, reachable as attributes: `kernels.softmax_rows(...)`."""

    def __init__(self, cubin: bytes, names: tuple[str, ...] = ()):
        import cupy

        torch.cuda.init()  # make sure torch's primary context is current before CuPy loads into it
        with cupy.cuda.Device(torch.cuda.current_device()):
            self._module = cupy.cuda.function.Module()
            self._module.load(cubin)
        self._names = names
        self._kernels: dict[str, Kernel] = {}

    @classmethod
    def from_file(cls, path: str, names: tuple[str, ...] = ()) -> Kernels:
        with open(path, "rb") as f:
            return cls(f.read(), names)

    def __getattr__(self, name: str) -> Kernel:
        if name.startswith("_"):
            raise AttributeError(name)
        kernel = self._kernels.get(name)
        if kernel is None:
            try:
                kernel = Kernel(self._module.get_function(name), name)
            except Exception as e:  # CUDA_ERROR_NOT_FOUND from the driver
                known = f"; the cubin has: {', '.join(self._names)}" if self._names else ""
                raise AttributeError(
                    f'no kernel named {name!r} in the cubin (is it extern "C"?){known}'
                ) from e
            self._kernels[name] = kernel
        return kernel


_streams: dict[int, object] = {}


def _current_stream(cupy):
    """torch's current stream as a CuPy stream object, built once per stream (it costs microseconds)."""
    handle = torch.cuda.current_stream().cuda_stream
    stream = _streams.get(handle)
    if stream is None:
        stream = _streams[handle] = cupy.cuda.ExternalStream(handle)
    return stream


def _dims(value, what: str) -> tuple[int, int, int]:
    if isinstance(value, int):
        value = (value,)
    dims = tuple(int(v) for v in value)
    if not 1 <= len(dims) <= 3 or any(d < 1 for d in dims):
        raise KernelArgumentError(f"{what} must be 1 to 3 positive integers, got {value!r}")
    return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]


def _argument(a, index: int, kernel: str):
    if isinstance(a, torch.Tensor):
        if not a.is_cuda:
            raise KernelArgumentError(f"{kernel}: argument {index} is a tensor on {a.device}, not on the GPU")
        return numpy.uint64(a.data_ptr())
    if isinstance(a, _SCALARS):
        return a
    raise KernelArgumentError(
        f"{kernel}: argument {index} is {type(a).__name__}; pass tensors, or scalars with their C type "
        "(numpy.int32, numpy.int64, numpy.float32, ...)"
    )
