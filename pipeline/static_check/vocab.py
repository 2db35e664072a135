"""Word lists the resolver and the classification share: what is plumbing, what returns a tensor."""

from __future__ import annotations

import ast


def words(text: str) -> frozenset[str]:
    return frozenset(text.split())


Path = tuple[str, ...]
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)

# helpers of the runtime's `kernels`, not kernel names
RUNTIME_METHODS = frozenset({"tensor_map", "active_clusters", "active_blocks", "graphed"})
REFERENCE_MODULES = frozenset({"reference", "task", "tasks", "__main__"})
REFERENCE_NAMES = frozenset({"Model", "get_inputs", "get_init_inputs"})
MODULE_BASES = frozenset({("torch", "nn", "Module"), ("torch", "nn", "modules", "module", "Module")})

# torch functions that allocate, reshape or describe rather than compute
TORCH_PLUMBING = words(
    "empty empty_like empty_strided zeros zeros_like ones ones_like full full_like tensor as_tensor "
    "reshape flatten unflatten permute transpose t squeeze unsqueeze narrow select split chunk unbind "
    "movedim diagonal as_strided view_as_real view_as_complex Size finfo iinfo device dtype is_tensor "
    "is_floating_point is_complex numel get_default_dtype no_grad inference_mode enable_grad "
    "is_grad_enabled is_inference_mode_enabled broadcast_shapes result_type promote_types can_cast"
)
# torch functions whose result is not a tensor
TORCH_NON_TENSOR = words(
    "Size finfo iinfo device dtype is_tensor is_floating_point is_complex numel get_default_dtype "
    "no_grad inference_mode enable_grad is_grad_enabled is_inference_mode_enabled broadcast_shapes "
    "result_type promote_types can_cast"
)
# torch attributes that are values, not functions: dtypes, memory formats, numbers
TORCH_CONSTANTS = words(
    "float32 float float64 double float16 half bfloat16 int8 int16 short int32 int int64 long uint8 uint16 "
    "uint32 uint64 bool complex32 complex64 complex128 cfloat cdouble chalf float8_e4m3fn float8_e5m2 "
    "pi e inf nan newaxis strided sparse_coo contiguous_format channels_last channels_last_3d "
    "preserve_format"
)
NN_TENSOR_CTORS = frozenset({"Parameter", "Buffer", "UninitializedParameter", "UninitializedBuffer"})
# tensor methods that allocate, reshape or describe rather than compute
TENSOR_PLUMBING = words(
    "view view_as reshape reshape_as flatten unflatten unsqueeze squeeze permute transpose t expand "
    "expand_as contiguous as_strided narrow select split chunk unbind movedim diagonal new_empty new_zeros "
    "new_ones new_full new_empty_strided new_tensor zero_ fill_ detach requires_grad_"
)
# tensor methods whose result is a Python value
NON_TENSOR_METHODS = words(
    "size numel nelement dim ndimension stride storage_offset data_ptr element_size is_contiguous "
    "is_floating_point is_complex get_device item tolist dim_order"
)
FORWARD_SYNC = frozenset({"item", "tolist", "cpu", "numpy"})  # copy to the host: a hidden synchronisation
SYNC_METHODS = words("synchronize wait_stream record_stream record wait_event elapsed_time")
# methods of Python containers, strings, numpy scalars and autograd contexts
PY_METHODS = words(
    "append extend insert pop items keys values get format join index count update setdefault "
    "startswith endswith lower upper strip bit_length is_integer astype copy save_for_backward "
    "mark_dirty mark_non_differentiable set_materialize_grads"
)
MODULE_PLUMBING = words(
    "parameters named_parameters buffers named_buffers children named_children modules named_modules "
    "get_parameter get_buffer get_submodule extra_repr"
)
MODULE_COMPUTE = words("to cuda float half double bfloat16 type apply")
NON_TENSOR_ATTRS = words("shape dtype device ndim is_cuda requires_grad layout itemsize nbytes names")
TENSOR_ATTRS = words("T mT H mH data real imag grad")
MODULE_TENSORS = words("weight bias running_mean running_var in_proj_weight in_proj_bias")


def is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def display(path: Path) -> str:
    if path[:3] == ("torch", "nn", "functional"):
        return ".".join(("F", *path[3:]))
    if path[:2] == ("torch", "nn"):
        return ".".join(("nn", *path[2:]))
    return ".".join(path)


def short(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."
