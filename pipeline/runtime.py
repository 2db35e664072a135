"""The small runtime a candidate's launcher uses: a cubin loaded through CuPy, launched on torch's stream.

This module imports only torch, numpy and cupy, because export.py copies its source verbatim into the
standalone file of the best candidate. A launcher sees a global `kernels` (a `Kernels`) and calls

    kernels.my_kernel(grid, block, (x, out, numpy.int32(n)), shared_mem=0)

Tensors become device pointers; scalars must carry their C type (numpy.int32, numpy.float32, ...), since a
bare Python int could be meant as int or long long and a wrong guess silently corrupts every later argument.
A TMA descriptor (`kernels.tensor_map(t, box_rows, box_cols)`) is passed by value to a kernel parameter
declared `const __grid_constant__ CUtensorMap`. `kernels.graphed(self, self._kp_forward, args)` runs a
forward through a CUDA graph (`Graphs`): one launch a call instead of one per kernel.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import weakref

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
        self._cluster: int | None = None  # its compile-time cluster width, read at the first launch
        self._room: dict[tuple, int] = {}

    def _prepare(self, shared_mem: int) -> None:
        """The opt-ins a launch needs: a dynamic shared-memory carve-out above 48 KB, and a cluster wider
        than the portable 8 blocks (`__cluster_dims__(16, 1, 1)`), which fails to launch without it."""
        if shared_mem > self._dynamic_smem_limit:
            _check(_libcuda().cuFuncSetAttribute(
                ctypes.c_void_p(self._function.ptr), _MAX_DYNAMIC_SHARED, ctypes.c_int(int(shared_mem))
            ), self.name, "the shared-memory carve-out")  # fmt: skip
            self._dynamic_smem_limit = int(shared_mem)
        if self._cluster is None:
            width = ctypes.c_int(0)
            lib = _libcuda()
            if lib.cuFuncGetAttribute(
                ctypes.byref(width), _CLUSTER_WIDTH, ctypes.c_void_p(self._function.ptr)
            ):
                width.value = 0  # a driver without clusters: none was compiled in
            if width.value > PORTABLE_CLUSTER:
                _check(lib.cuFuncSetAttribute(ctypes.c_void_p(self._function.ptr), _NON_PORTABLE_CLUSTER,
                                              ctypes.c_int(1)), self.name, "a non-portable cluster size")  # fmt: skip
            self._cluster = width.value

    def active_clusters(self, block, shared_mem: int = 0) -> int:
        """How many of this kernel's clusters the GPU can run at once with this block and shared memory: 0
        where none fits (a cluster of 16 needs 16 free SMs of one GPC; not every GPU's GPCs have them)."""
        key = ("clusters", _dims(block, "block"), int(shared_mem))
        if key not in self._room:
            self._prepare(int(shared_mem))
            config = _LaunchConfig(max(1, self._cluster or 1), 1, 1, *key[1], int(shared_mem))
            n = ctypes.c_int(0)
            err = _libcuda().cuOccupancyMaxActiveClusters(
                ctypes.byref(n), ctypes.c_void_p(self._function.ptr), ctypes.byref(config)
            )
            self._room[key] = 0 if err else n.value
        return self._room[key]

    def active_blocks(self, block, shared_mem: int = 0) -> int:
        """Blocks of this kernel one SM holds at once with this block and shared memory (its registers,
        shared memory and threads allow): a cooperative grid may have the SM count times as many."""
        key = ("blocks", _dims(block, "block"), int(shared_mem))
        if key not in self._room:
            self._prepare(int(shared_mem))
            n = ctypes.c_int(0)
            err = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(n), ctypes.c_void_p(self._function.ptr), ctypes.c_int(_threads(key[1])),
                ctypes.c_size_t(int(shared_mem)),
            )  # fmt: skip
            self._room[key] = 0 if err else n.value
        return self._room[key]

    def __call__(self, grid, block, args, shared_mem: int = 0, cooperative: bool = False) -> None:
        """Launch on torch's current stream. `cooperative`: every block of the grid resident at once, or the
        launch fails (a kernel whose blocks wait on each other through global memory would hang)."""
        import cupy

        if LAUNCHES is not None:
            LAUNCHES.note(args)
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        converted = tuple(_argument(a, i, self.name) for i, a in enumerate(args))
        self._prepare(int(shared_mem))
        if cooperative or any(isinstance(a, TensorMap) for a in converted):
            # CuPy has no by-value struct argument, nor a cooperative launch: the driver's take raw bytes.
            _launch_raw(self._function.ptr, grid, block, converted, int(shared_mem), self.name, cooperative)
            return
        self._function(grid, block, converted, shared_mem=int(shared_mem), stream=_current_stream(cupy))


class LaunchLog:
    """What our kernels were handed while the harness watched: the bytes of the tensors passed to them (each
    tensor view once), i.e. the memory traffic the kernels claim. The profiler check compares their time with
    it, so a hybrid candidate's kernels are judged by their own work, not the whole task's."""

    def __init__(self) -> None:
        self.launches = 0
        self._views: set[tuple[int, int]] = set()

    def note(self, args) -> None:
        self.launches += 1
        for a in args:
            t = a.tensor if isinstance(a, TensorMap) else a
            if isinstance(t, torch.Tensor):
                self._views.add((t.data_ptr(), t.numel() * t.element_size()))

    @property
    def claimed_bytes(self) -> int:
        return sum(n for _, n in self._views)


LAUNCHES: LaunchLog | None = None  # set by the harness around a call it profiles; None otherwise


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
        self._maps: dict[tuple, ctypes.Array] = {}  # tensor maps this module's launcher had encoded

    @classmethod
    def from_file(cls, path: str, names: tuple[str, ...] = ()) -> Kernels:
        with open(path, "rb") as f:
            return cls(f.read(), names)

    def active_clusters(self, name: str, block, shared_mem: int = 0) -> int:
        """Clusters of kernel `name` the GPU holds at once (0: it cannot run one), for a launcher that has a
        way around a wide cluster."""
        return getattr(self, name).active_clusters(block, shared_mem)

    def active_blocks(self, name: str, block, shared_mem: int = 0) -> int:
        """Blocks of kernel `name` an SM holds at once (0: none), for a launcher sizing a cooperative grid."""
        return getattr(self, name).active_blocks(block, shared_mem)

    @staticmethod
    def graphed(owner: torch.nn.Module, forward, args: tuple):
        """forward(*args) replayed from a CUDA graph captured for these arguments' form (see `Graphs`)."""
        graphs = _GRAPHS.get(owner)
        if graphs is None:
            graphs = _GRAPHS[owner] = Graphs(owner)
        return graphs(forward, args)

    def tensor_map(self, t: torch.Tensor, box_rows: int, box_cols: int, swizzle: int = 128) -> TensorMap:
        """The TMA descriptor of a 2- to 5-D tensor, loaded in boxes of box_rows x box_cols over its last two
        dims (one element deep along the leading ones); encoded once per map_key for this module (a
        candidate's own cache: no other candidate's launcher reaches it)."""
        return TensorMap(t, box_rows, box_cols, swizzle, cache=self._maps)

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


class _Form:
    """One form of a forward's arguments: how often it was seen, then its graph and static tensors."""

    __slots__ = ("failed", "graph", "inputs", "outputs", "seen")

    def __init__(self) -> None:
        self.seen = 0
        self.graph = None
        self.inputs: list = []
        self.outputs = None
        self.failed: str | None = None


class Graphs:
    """A module's forward replayed from CUDA graphs: the host then issues one launch a call, where a launcher
    of hundreds of small kernels spends longer issuing them than the GPU running them.

    A graph holds pointers, not values, so each form of the arguments (every tensor's shape, strides, dtype
    and device; every other argument's value) has its own, captured on the form's second call (the first
    runs eagerly: it loads the kernels and creates the libraries' handles, none of which a capture may do).
    A call copies its tensors into the form's static inputs, replays, and returns copies of the outputs, so
    no result is overwritten by the next call. The module's parameters and buffers are read in place: their
    values may change between calls; a storage that moved, or a tensor replaced by another (and freed),
    drops every graph.

    Forward runs eagerly, never captured, while gradients are on, while the harness logs launches (its
    profile check reads each launch's arguments), for arguments that are not all CUDA tensors and plain
    values, and for a form whose capture failed (`failed` says why: a synchronising call, a launch a graph
    cannot hold). Forward must not write into its inputs: the graph would write into the static copies."""

    FORMS = 4  # graphs kept a module: each holds its intermediates' memory

    def __init__(self, owner: torch.nn.Module) -> None:
        self._owner = weakref.ref(owner)
        self.forms: dict[tuple, _Form] = {}
        self._state: list[tuple[weakref.ref, int]] | None = None
        self._stream = None

    def __call__(self, forward, args: tuple):
        key = None if LAUNCHES is not None or torch.is_grad_enabled() else _form_key(args)
        if key is None:
            return forward(*args)
        if self._state_moved():
            self.forms.clear()
        form = self.forms.get(key)
        if form is None:
            while len(self.forms) >= self.FORMS:
                self.forms.pop(next(iter(self.forms)))
            form = self.forms[key] = _Form()
        form.seen += 1
        if form.failed is not None or form.seen < 2:
            return forward(*args)
        if form.graph is None:
            self._capture(form, forward, args)
            if form.failed is not None:
                return forward(*args)
        for static, a in zip(form.inputs, args, strict=True):
            if static is not None:
                static.copy_(a)
        form.graph.replay()
        return _copies(form.outputs)

    def _state_moved(self) -> bool:
        """Whether a parameter or buffer is no longer where the graphs read it: its storage moved, or the
        tensor was replaced and freed (held by weak references, so a replaced one is not kept alive)."""
        owner = self._owner()
        if owner is None:
            return False
        if self._state is not None and all(
            (t := ref()) is not None and t.data_ptr() == ptr for ref, ptr in self._state
        ):
            return False
        moved = self._state is not None
        tensors = itertools.chain(owner.parameters(), owner.buffers())
        self._state = [(weakref.ref(t), t.data_ptr()) for t in tensors]
        return moved

    def _capture(self, form: _Form, forward, args: tuple) -> None:
        form.inputs = [torch.empty_like(a) if isinstance(a, torch.Tensor) else None for a in args]
        static = [a if s is None else s.copy_(a) for s, a in zip(form.inputs, args, strict=True)]
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        # A capture that fails ends before PyTorch takes its CUDA generator out of capture mode: every later
        # random op in this process would then raise. Its state as it was goes back in on a failure.
        rng = torch.cuda.default_generators[torch.cuda.current_device()]
        before = rng.clone_state() if hasattr(rng, "clone_state") else None
        try:
            # warmed on the capture's stream first: its library handles and workspaces exist before capture
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                forward(*static)
            torch.cuda.current_stream().wait_stream(self._stream)
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                form.outputs = forward(*static)
        except Exception as e:  # the form runs eagerly from now on; the reason stays for whoever asks
            form.failed = f"{type(e).__name__}: {str(e)[:300]}"
            form.inputs, form.outputs = [], None
            if before is not None:
                rng.graphsafe_set_state(before)
            torch.cuda.synchronize()
            return
        form.graph = graph


def graph_notes(owner) -> list[str]:
    """What became of a module's graphs, for a report: replayed, or why a form ran eagerly."""
    graphs = _GRAPHS.get(owner) if isinstance(owner, torch.nn.Module) else None
    if graphs is None:
        return []
    replayed = sum(f.graph is not None for f in graphs.forms.values())
    notes = [f"forward replayed from a CUDA graph ({replayed} argument form(s))"] if replayed else []
    return notes + [f"a CUDA graph capture failed, forward ran eagerly: {f.failed}"
                    for f in graphs.forms.values() if f.failed]  # fmt: skip


def _form_key(args: tuple) -> tuple | None:
    """What a graph is specific to in the arguments, or None where no graph applies."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_cuda or a.requires_grad:
                return None
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device.index))
        elif a is None or isinstance(a, (bool, int, float, str)):
            key.append((type(a), a))
        else:
            return None
    return tuple(key)


def _copies(out):
    """The graph's outputs as new tensors (the next replay overwrites the static ones)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_copies(o) for o in out)
    return out


_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

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


PORTABLE_CLUSTER = 8  # blocks a cluster may take without opting in
# CUfunction_attribute values (cuda.h)
_MAX_DYNAMIC_SHARED, _CLUSTER_WIDTH, _NON_PORTABLE_CLUSTER = 8, 11, 14


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig, no attributes: the cluster is the kernel's own
    _fields_ = [(f, ctypes.c_uint) for f in ("gx", "gy", "gz", "bx", "by", "bz", "smem")] + [
        ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("nattrs", ctypes.c_uint)
    ]  # fmt: skip


def _check(err: int, name: str, what: str) -> None:
    if err:
        raise RuntimeError(f"{name}: the driver refused {what} (CUresult {err})")


_TMA_DTYPES = {torch.uint8: 0, torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}  # CUtensorMapDataType
_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # bytes -> CUtensorMapSwizzle


@functools.lru_cache(maxsize=1)
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
    lib.cuLaunchKernel.restype = ctypes.c_int
    for f in ("cuFuncGetAttribute", "cuFuncSetAttribute", "cuOccupancyMaxActiveClusters",
              "cuOccupancyMaxActiveBlocksPerMultiprocessor", "cuLaunchCooperativeKernel"):  # fmt: skip
        getattr(lib, f).restype = ctypes.c_int
    return lib


# A descriptor is a function of the address, the geometry and the box alone, so one encoded for a tensor
# serves every later tensor with the same (a weight every call; an activation the caching allocator hands the
# same block). Encoding is ~7 us of ctypes and a driver call on the host, paid before the kernel's launch
# (and so inside its events' time) on every call otherwise.
MAPS_MAX = 512  # a cache is emptied when full: a cache, not a record


def map_key(t: torch.Tensor, box_rows: int, box_cols: int, swizzle: int) -> tuple:
    """Everything a tensor map encodes of `t` and its box (the device too: one address, two devices)."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), box_rows, box_cols, swizzle)


class TensorMap:
    """A CUtensorMap (128 bytes) for a 2- to 5-D tensor with unit stride along its last dim, encoded by the driver.

    The box is box_rows x box_cols over the last two dims and 1 along the leading (batch) dims. TMA needs a
    16-byte aligned base and strides; a box is at most 256 x 256 elements and, with a swizzle, its rows at
    most the swizzle's width in bytes. Reads outside the tensor come back as zeros. With a `cache`, encoded
    once per map_key: `raw` is then shared, and never written after its encoding.
    """

    def __init__(
        self, t: torch.Tensor, box_rows: int, box_cols: int, swizzle: int = 128, cache: dict | None = None
    ):
        self.tensor = t  # kept alive as long as the descriptor that points into it
        if cache is None:
            self.raw = self._encode(t, box_rows, box_cols, swizzle)
            return
        key = map_key(t, box_rows, box_cols, swizzle)
        raw = cache.get(key)
        if raw is None:
            raw = self._encode(t, box_rows, box_cols, swizzle)  # raises before anything is kept
            if len(cache) >= MAPS_MAX:
                cache.clear()
            cache[key] = raw
        self.raw = raw

    @staticmethod
    def _encode(t: torch.Tensor, box_rows: int, box_cols: int, swizzle: int) -> ctypes.Array:
        if not 2 <= t.dim() <= 5 or not t.is_cuda or t.stride(-1) != 1:
            raise KernelArgumentError(
                "tensor_map: a 2- to 5-D GPU tensor with unit stride along its rows is needed"
            )
        if t.dtype not in _TMA_DTYPES or swizzle not in _SWIZZLE:
            raise KernelArgumentError(f"tensor_map: {t.dtype} or a {swizzle}-byte swizzle is not supported")
        item = t.element_size()
        rank = t.dim()
        strides = [t.stride(d) * item for d in range(rank - 2, -1, -1)]  # bytes, innermost first, dim 0 last
        if (
            t.data_ptr() % 16
            or any(s % 16 for s in strides)
            or not (1 <= box_rows <= 256 and 1 <= box_cols <= 256)
        ):
            raise KernelArgumentError(
                f"tensor_map: base and strides must be 16-byte aligned (strides {strides} B) and the box "
                f"{box_rows} x {box_cols} within 256 x 256"
            )
        if swizzle and box_cols * item > swizzle:
            raise KernelArgumentError(f"tensor_map: a box row of {box_cols * item} B exceeds the swizzle")
        raw = (ctypes.c_uint64 * 16)()
        dims = [max(1, t.shape[d]) for d in range(rank - 1, -1, -1)]
        box = [box_cols, box_rows] + [1] * (rank - 2)
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        err = _libcuda().cuTensorMapEncodeTiled(
            ctypes.byref(raw), ctypes.c_int(_TMA_DTYPES[t.dtype]), u32(rank), ctypes.c_void_p(t.data_ptr()),
            (u64 * rank)(*dims), (u64 * (rank - 1))(*strides), (u32 * rank)(*box), (u32 * rank)(*[1] * rank),
            ctypes.c_int(0), ctypes.c_int(_SWIZZLE[swizzle]),
            ctypes.c_int(3), ctypes.c_int(0),  # 256-byte L2 promotion, zero fill out of bounds
        )  # fmt: skip
        if err:
            raise KernelArgumentError(f"tensor_map: cuTensorMapEncodeTiled failed with CUresult {err}")
        return raw


_C_OF = {numpy.dtype(k): v for k, v in (
    (numpy.int8, ctypes.c_int8), (numpy.int16, ctypes.c_int16), (numpy.int32, ctypes.c_int32),
    (numpy.int64, ctypes.c_int64), (numpy.uint8, ctypes.c_uint8), (numpy.uint16, ctypes.c_uint16),
    (numpy.uint32, ctypes.c_uint32), (numpy.uint64, ctypes.c_uint64), (numpy.float32, ctypes.c_float),
    (numpy.float64, ctypes.c_double), (numpy.bool_, ctypes.c_bool), (numpy.float16, ctypes.c_uint16),
)}  # fmt: skip


def _threads(block: tuple[int, int, int]) -> int:
    return block[0] * block[1] * block[2]


_F16 = numpy.dtype(numpy.float16)


def c_value(a):
    """A numpy scalar as the C value of its bytes: the ctypes constructor (exact for every type but half,
    whose bits go as a uint16), cheaper than a copy through tobytes on every TMA launch's arguments (six
    arguments and their pointer array: 12.8 -> 7.7 us on a 2-core CPU)."""
    if a.dtype == _F16:
        return ctypes.c_uint16(int(a.view(numpy.uint16)))
    return _C_OF[a.dtype](a)


def _launch_raw(
    function: int, grid, block, args, shared_mem: int, name: str, cooperative: bool = False
) -> None:
    """cuLaunchKernel (cuLaunchCooperativeKernel) on torch's current stream with each argument's bytes
    (structs by value)."""
    holders = [a.raw if isinstance(a, TensorMap) else c_value(a) for a in args]
    params = (ctypes.c_void_p * len(holders))(*(ctypes.addressof(h) for h in holders))
    launch = _libcuda().cuLaunchCooperativeKernel if cooperative else _libcuda().cuLaunchKernel
    dims = (ctypes.c_uint(v) for v in (*grid, *block, shared_mem))
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    err = launch(ctypes.c_void_p(function), *dims, stream, params, *([] if cooperative else [None]))
    if err:
        how = "cuLaunchCooperativeKernel" if cooperative else "cuLaunchKernel"
        raise RuntimeError(f"{name}: {how} failed with CUresult {err}")


def _argument(a, index: int, kernel: str):
    if isinstance(a, torch.Tensor):
        if not a.is_cuda:
            raise KernelArgumentError(f"{kernel}: argument {index} is a tensor on {a.device}, not on the GPU")
        return numpy.uint64(a.data_ptr())
    if isinstance(a, (_SCALARS, TensorMap)):
        return a
    raise KernelArgumentError(
        f"{kernel}: argument {index} is {type(a).__name__}; pass tensors, or scalars with their C type "
        "(numpy.int32, numpy.int64, numpy.float32, ...)"
    )
