"""What the expert knows about each ATen op: elementwise ops as fp32 C expressions, reductions, norms,
scans, library anchors (GEMM, convolution) and views. Pure tables and small functions, no torch import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pipeline.generate.expert.graph import Node, Ref

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# Storage types our kernels read (converted to float) and write.
C_TYPES = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "bool": "bool",
    "int64": "long long",
    "int32": "int",
    "uint8": "unsigned char",
    "int8": "signed char",
}
ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "bool": 1,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "int8": 1,
}


def lit(v: Any) -> str:
    """A Python scalar as a C float expression rounded the way torch rounds a scalar to fp32."""
    if isinstance(v, bool):
        return "1.0f" if v else "0.0f"
    v = float(v)
    if math.isnan(v):
        return "CUDART_NAN_F"
    if math.isinf(v):
        return "CUDART_INF_F" if v > 0 else "(-CUDART_INF_F)"
    if v == 0 and math.copysign(1.0, v) < 0:
        return "(-0.0f)"  # its sign matters (1 / x, signbit, atan2): int(-0.0) would drop it
    if v == int(v) and abs(v) < 2**24:
        return f"{int(v)}.0f"
    return f"((float){v!r})"  # the double literal cast to float: torch's own double -> float rounding


# ---------------------------------------------------------------------------------------------------------
# Elementwise ops

_UNARY_CALL = {
    "abs": "fabsf({0})",
    "neg": "(-{0})",
    "exp": "expf({0})",
    "exp2": "exp2f({0})",
    "expm1": "expm1f({0})",
    "log": "logf({0})",
    "log2": "log2f({0})",
    "log10": "log10f({0})",
    "log1p": "log1pf({0})",
    "sqrt": "sqrtf({0})",
    "rsqrt": "(1.0f / sqrtf({0}))",
    "reciprocal": "(1.0f / ({0}))",
    "sin": "sinf({0})",
    "cos": "cosf({0})",
    "tan": "tanf({0})",
    "atan": "atanf({0})",
    "asin": "asinf({0})",
    "acos": "acosf({0})",
    "sinh": "sinhf({0})",
    "cosh": "coshf({0})",
    "tanh": "tanhf({0})",
    "erf": "erff({0})",
    "erfc": "erfcf({0})",
    "floor": "floorf({0})",
    "ceil": "ceilf({0})",
    "round": "rintf({0})",
    "trunc": "truncf({0})",
    "frac": "kp_frac({0})",
    "sign": "kp_sign({0})",
    "sgn": "kp_sign({0})",
    "square": "kp_sq({0})",
    "relu": "kp_relu({0})",
    "sigmoid": "kp_sigmoid({0})",
    "silu": "kp_silu({0})",
    "mish": "kp_mish_exp({0})",  # templates/common.py ON_USE
    "hardsigmoid": "kp_hardsigmoid({0})",
    "hardswish": "kp_hardswish({0})",
    "selu": "kp_elu({0}, 1.6732632423543772f, 1.0507009873554805f, 1.0f)",
    "log_sigmoid": "kp_log_sigmoid({0})",
    "logical_not": "(({0}) == 0.0f ? 1.0f : 0.0f)",
    "bitwise_not": "(({0}) == 0.0f ? 1.0f : 0.0f)",  # on bool only (BOOL_ONLY)
    "signbit": "(signbit({0}) ? 1.0f : 0.0f)",  # -0.0 and -NaN too
    "isnan": "(isnan({0}) ? 1.0f : 0.0f)",
    "isinf": "(isinf({0}) ? 1.0f : 0.0f)",
    "isposinf": "((isinf({0}) && ({0}) > 0.0f) ? 1.0f : 0.0f)",
    "isneginf": "((isinf({0}) && ({0}) < 0.0f) ? 1.0f : 0.0f)",
    "isfinite": "(isfinite({0}) ? 1.0f : 0.0f)",
    "asinh": "asinhf({0})",
    "acosh": "acoshf({0})",
    "atanh": "atanhf({0})",
    "lgamma": "lgammaf({0})",
    # special functions: CUDA's math library where it has them, ours (ON_USE) where it does not
    "digamma": "kp_digamma({0})",
    "special_digamma": "kp_digamma({0})",
    "special_psi": "kp_digamma({0})",
    "i0": "cyl_bessel_i0f({0})",
    "special_i0": "cyl_bessel_i0f({0})",
    "special_i1": "cyl_bessel_i1f({0})",
    "special_erfcx": "erfcxf({0})",
    "erfinv": "erfinvf({0})",
    "special_erfinv": "erfinvf({0})",
    "special_ndtr": "normcdff({0})",
    "special_ndtri": "normcdfinvf({0})",
}
# use_intrinsics: the special-function unit's approximations (templates/common.py ON_USE) where a plan asks:
# lg2.approx / ex2.approx and a multiply, ~6 instructions where logf's polynomial is ~30 (expf ~8). Their
# errors (2^-22 absolute in log2, 2 ulp in ex2, the exponent's product rounded) are far inside the fp32
# tolerance (rtol 1e-3, a norm of 1e-4) and near eager's own error against float64.
FAST_CALL = {
    "log": "kp_log_fast({0})",
    "log2": "kp_log2_fast({0})",
    "log10": "(kp_log2_fast({0}) * 0.30102999566398120f)",
    "exp": "kp_exp_fast({0})",
    "exp2": "kp_exp2_fast({0})",
    "sigmoid": "(1.0f / (1.0f + kp_exp_fast(-({0}))))",
    "silu": "(({0}) / (1.0f + kp_exp_fast(-({0}))))",
}


def has_fast(nodes) -> bool:
    """Whether any of the nodes computes what use_intrinsics would approximate."""
    return any(n.op in FAST_CALL for n in nodes)


_IDENTITY = {"alias", "clone", "detach", "lift_fresh_copy", "positive", "contiguous"}
IDENTITY = frozenset(_IDENTITY)  # ops that pass their one operand through unchanged
_COMPARE = {"gt": ">", "lt": "<", "ge": ">=", "le": "<=", "eq": "==", "ne": "!="}
_BINARY_CALL = {
    "maximum": "kp_max({0}, {1})",
    "minimum": "kp_min({0}, {1})",
    "fmax": "fmaxf({0}, {1})",
    "fmin": "fminf({0}, {1})",
    "remainder": "kp_remainder({0}, {1})",
    "fmod": "fmodf({0}, {1})",
    "atan2": "atan2f({0}, {1})",
    "hypot": "hypotf({0}, {1})",
    "copysign": "copysignf({0}, {1})",
    "logical_and": "((({0}) != 0.0f && ({1}) != 0.0f) ? 1.0f : 0.0f)",
    "logical_or": "((({0}) != 0.0f || ({1}) != 0.0f) ? 1.0f : 0.0f)",
    "logical_xor": "((({0}) != 0.0f) != (({1}) != 0.0f) ? 1.0f : 0.0f)",
    "heaviside": "(({0}) == 0.0f ? ({1}) : (({0}) > 0.0f ? 1.0f : 0.0f))",  # NaN: 0, as eager's x > 0
    "nextafter": "nextafterf({0}, {1})",
    # ATen's: NaN where y is NaN, 0 where x is 0, else x log(y)
    "xlogy": "(isnan({1}) ? CUDART_NAN_F : (({0}) == 0.0f ? 0.0f : ({0}) * logf({1})))",
    "special_xlogy": "(isnan({1}) ? CUDART_NAN_F : (({0}) == 0.0f ? 0.0f : ({0}) * logf({1})))",
}
# Bitwise ops are the logical ones on bool (masks combined with & | ^ ~); on integers they stay PyTorch's.
_BITWISE = {"and": "logical_and", "or": "logical_or", "xor": "logical_xor"}
for _name, _logical in _BITWISE.items():
    _BINARY_CALL[f"bitwise_{_name}"] = _BINARY_CALL[f"__{_name}__"] = _BINARY_CALL[_logical]
BOOL_ONLY = frozenset({"bitwise_not", *(f"bitwise_{k}" for k in _BITWISE), *(f"__{k}__" for k in _BITWISE)})
ELEMENTWISE = frozenset(
    {
        *_UNARY_CALL,
        *_IDENTITY,
        *_COMPARE,
        *_BINARY_CALL,
        "add",
        "sub",
        "rsub",
        "mul",
        "div",
        "true_divide",
        "max",
        "min",
        "pow",
        "clamp",
        "clamp_min",
        "clamp_max",
        "hardtanh",
        "relu6",
        "leaky_relu",
        "rrelu",
        "gelu",
        "elu",
        "celu",
        "softplus",
        "threshold",
        "hardshrink",
        "softshrink",
        "where",
        "masked_fill",
        "lerp",
        "addcmul",
        "addcdiv",
        "_to_copy",
        "to",
        "type_as",
        "dropout",
        "feature_dropout",
        "alpha_dropout",
        "triu",
        "tril",
        "zeros_like",
        "ones_like",
        "full_like",
        "one_hot_eq",  # the expert's own: one_hot's class index == its column (regions._one_hot)
    }
)
# Ops whose result jumps where an operand crosses a value. Eager rounds every 16-bit op's result as it
# stores it: a 16-bit chain computed in fp32 between its ops puts a value a hair from the step on its other
# side (bf16 `linear(x) > 0.5` with the bias added in fp32: found by the fuzz hunt, seed 10222).
STEPS = frozenset(
    {*_COMPARE, "floor", "ceil", "round", "trunc", "frac", "sign", "remainder", "fmod", "threshold", "hardshrink",
     "softshrink", "heaviside", "signbit", "nextafter"}
)  # fmt: skip
ROUNDED = {"bfloat16": "kp_round_bf16({0})", "float16": "kp_round_f16({0})"}  # a value as 16 bits store it
# Ops whose value depends on the element's position: they read its row `pr` and column `pc` within the last two
# dims, which a chain function that holds one takes as its first two parameters.
POSITIONAL = frozenset({"triu", "tril", "one_hot_eq"})


def positional(nodes: Iterable[Node]) -> bool:
    """Whether any of the nodes reads its element's position (its chain function then takes pr, pc)."""
    return any(n.op in POSITIONAL for n in nodes)


def is_elementwise(n: Node) -> bool:
    """An op our fused elementwise kernels compute: float or bool result, no randomness, one tensor out."""
    if n.op not in ELEMENTWISE or n.shape is None or n.dtype not in (*FLOAT_DTYPES, "bool"):
        return False
    if n.op in POSITIONAL and len(n.shape) < 2:
        return False
    if n.op in BOOL_ONLY and n.dtype != "bool":
        return False
    if n.op in ("max", "min") and n.overload not in ("other",):
        return False  # max.dim and max.default are reductions
    if n.op == "rrelu":  # random slopes in training; in eval the mean slope, a leaky ReLU
        return _arg(n, 3, "training", False) is False
    if n.op in ("dropout", "feature_dropout", "alpha_dropout"):
        return (len(n.args) > 2 and n.args[2] is False) or n.kw("train") is False
    if n.op in ("_to_copy", "to") and _to_dtype(n) not in (*FLOAT_DTYPES, "bool", None):
        return False
    if n.op == "full_like" and not isinstance(_arg(n, 1, "fill_value", None), bool | int | float):
        return False
    return not (n.op == "div" and (n.kw("rounding_mode") not in (None, "trunc", "floor")))


def _to_dtype(n: Node) -> str | None:
    for a in (*n.args[1:], n.kw("dtype")):
        if isinstance(a, tuple) and len(a) == 2 and a[0] == "dtype":
            return a[1]
    return None


def _arg(n: Node, i: int, key: str, default: Any) -> Any:
    if len(n.args) > i:
        return n.args[i]
    return n.kw(key, default)


def ew_expr(n: Node, val: Callable[[Any], str], mufu: bool = False, fast: bool = False) -> str:
    """The fp32 C expression computing node n; `val` maps a Ref or a Python scalar to a C expression.

    mufu: tanh (and the tanh GELU) by the hardware's approximate tanh (kp_tanh_mufu, kp_gelu_tanh_mufu, which
    the caller defines), for results rounded to 16 bits anyway: its error, about 2^-11, is below their
    precision. fast: logs and exponentials by the special-function unit (FAST_CALL)."""
    op, a = n.op, n.args
    if fast and op in FAST_CALL:
        return FAST_CALL[op].format(val(a[0]))
    if mufu and op == "tanh":
        return f"kp_tanh_mufu({val(a[0])})"
    if mufu and op == "gelu" and _arg(n, 1, "approximate", "none") == "tanh":
        return f"kp_gelu_tanh_mufu({val(a[0])})"
    if op == "one_hot_eq":  # the class index (exact in fp32: below the class count) against the column
        return f"((float)pc == ({val(a[0])}) ? 1.0f : 0.0f)"
    if op in POSITIONAL:  # triu keeps the diagonal and above (column - row >= k), tril the rest
        k = int(_arg(n, 1, "diagonal", 0))
        return f"((pc - pr) {'>=' if op == 'triu' else '<='} {k}LL ? ({val(a[0])}) : 0.0f)"
    if op in _IDENTITY or op in ("dropout", "feature_dropout", "alpha_dropout"):
        return val(a[0])
    if op in ("zeros_like", "ones_like", "full_like"):  # a constant of its operand's shape: its values unread
        return lit({"zeros_like": 0.0, "ones_like": 1.0}.get(op, _arg(n, 1, "fill_value", None)))
    if op in _UNARY_CALL:
        return _UNARY_CALL[op].format(val(a[0]))
    if op in _COMPARE:
        return f"(({val(a[0])}) {_COMPARE[op]} ({val(a[1])}) ? 1.0f : 0.0f)"
    if op in _BINARY_CALL:
        return _BINARY_CALL[op].format(val(a[0]), val(a[1]))
    if op in ("max", "min"):
        return ("kp_max({0}, {1})" if op == "max" else "kp_min({0}, {1})").format(val(a[0]), val(a[1]))
    if op in ("add", "sub"):
        alpha = _arg(n, 2, "alpha", 1)
        other = val(a[1]) if alpha == 1 else f"({lit(alpha)} * ({val(a[1])}))"
        return f"(({val(a[0])}) {'+' if op == 'add' else '-'} {other})"
    if op == "rsub":
        alpha = _arg(n, 2, "alpha", 1)
        mine = val(a[0]) if alpha == 1 else f"({lit(alpha)} * ({val(a[0])}))"
        return f"(({val(a[1])}) - {mine})"
    if op == "mul":
        return f"(({val(a[0])}) * ({val(a[1])}))"
    if op in ("div", "true_divide"):
        q = f"(({val(a[0])}) / ({val(a[1])}))"
        mode = _arg(n, 2, "rounding_mode", None)
        return {"trunc": f"truncf{q}", "floor": f"floorf{q}"}.get(mode, q)
    if op == "pow":
        if n.overload == "Scalar":  # scalar ** tensor
            return f"powf({val(a[0])}, {val(a[1])})"
        e = a[1]
        if isinstance(e, Ref):
            return f"powf({val(a[0])}, {val(e)})"
        x = val(a[0])
        special = {
            0: "1.0f",
            1: x,
            2: f"kp_sq({x})",
            3: f"kp_cube({x})",
            0.5: f"sqrtf({x})",
            -0.5: f"(1.0f / sqrtf({x}))",
            -1: f"(1.0f / ({x}))",
            -2: f"(1.0f / kp_sq({x}))",
        }
        return special.get(float(e), f"powf({x}, {lit(e)})")
    if op in ("clamp", "hardtanh"):
        lo_default, hi_default = (None, None) if op == "clamp" else (-1.0, 1.0)
        lo = _arg(n, 1, "min" if op == "clamp" else "min_val", lo_default)
        hi = _arg(n, 2, "max" if op == "clamp" else "max_val", hi_default)
        x = val(a[0])
        if lo is not None:
            x = f"kp_max_nan({x}, {val(lo)})"
        if hi is not None:
            x = f"kp_min_nan({x}, {val(hi)})"
        return x
    if op == "relu6":
        return f"kp_min_nan(kp_max_nan({val(a[0])}, 0.0f), 6.0f)"
    if op == "clamp_min":
        return f"kp_max_nan({val(a[0])}, {val(a[1])})"
    if op == "clamp_max":
        return f"kp_min_nan({val(a[0])}, {val(a[1])})"
    if op == "leaky_relu":
        return f"kp_leaky_relu({val(a[0])}, {lit(_arg(n, 1, 'negative_slope', 0.01))})"
    if op == "rrelu":  # eager passes the mean slope, (lower + upper) / 2 in double, to leaky_relu
        slope = (float(_arg(n, 1, "lower", 1 / 8)) + float(_arg(n, 2, "upper", 1 / 3))) / 2
        return f"kp_leaky_relu({val(a[0])}, {lit(slope)})"
    if op == "gelu":
        approx = _arg(n, 1, "approximate", "none")
        return f"kp_gelu_{'tanh' if approx == 'tanh' else 'erf'}({val(a[0])})"
    if op == "elu":
        alpha, scale, iscale = (
            _arg(n, i, k, 1.0) for i, k in ((1, "alpha"), (2, "scale"), (3, "input_scale"))
        )
        return f"kp_elu({val(a[0])}, {lit(alpha)}, {lit(scale)}, {lit(iscale)})"
    if op == "celu":
        return f"kp_celu({val(a[0])}, {lit(_arg(n, 1, 'alpha', 1.0))})"
    if op == "softplus":
        beta, threshold = _arg(n, 1, "beta", 1.0), _arg(n, 2, "threshold", 20.0)
        return f"kp_softplus({val(a[0])}, {lit(beta)}, {lit(threshold)})"
    if op == "threshold":
        return f"(({val(a[0])}) <= {lit(a[1])} ? {lit(a[2])} : ({val(a[0])}))"
    if op == "hardshrink":
        lam = lit(_arg(n, 1, "lambd", 0.5))
        return f"kp_hardshrink({val(a[0])}, {lam})"
    if op == "softshrink":
        lam = lit(_arg(n, 1, "lambd", 0.5))
        return f"kp_softshrink({val(a[0])}, {lam})"
    if op == "where":
        return f"(({val(a[0])}) != 0.0f ? ({val(a[1])}) : ({val(a[2])}))"
    if op == "masked_fill":
        return f"(({val(a[1])}) != 0.0f ? ({val(a[2])}) : ({val(a[0])}))"
    if op == "lerp":
        x, y = val(a[0]), val(a[1])
        return f"(({x}) + ({val(a[2])}) * (({y}) - ({x})))"
    if op in ("addcmul", "addcdiv"):
        value = _arg(n, 3, "value", 1)
        sym = "*" if op == "addcmul" else "/"
        return f"(({val(a[0])}) + {lit(value)} * (({val(a[1])}) {sym} ({val(a[2])})))"
    if op in ("_to_copy", "to", "type_as"):
        target = n.dtype or ""
        x = val(a[0])
        if target in ROUNDED:
            return ROUNDED[target].format(x)
        return f"(({x}) != 0.0f ? 1.0f : 0.0f)" if target == "bool" else x
    raise KeyError(f"no elementwise formula for {n.target}")


# ---------------------------------------------------------------------------------------------------------
# Reductions, softmax, norms, scans


@dataclass(frozen=True)
class Reduction:
    kind: str  # sum mean amax amin max min argmax argmin prod var std logsumexp norm1 norm2 norminf
    dims: tuple[int, ...] | None  # as written (negative allowed); None: every dimension
    keepdim: bool
    correction: float = 1.0  # var / std
    indices: bool = False  # max.dim / min.dim: (values, indices)


def reduction_of(n: Node) -> Reduction | None:
    """The reduction a node performs, by op and overload (None for anything else)."""
    op, a, ov = n.op, n.args, n.overload
    if op in ("sum", "mean") and n.kw("dtype") is not None and n.kw("dtype")[1] != n.dtype:
        return None
    if op in ("sum", "mean"):
        if ov == "default":
            return Reduction(op, None, False)
        return Reduction(op, _dims(_arg(n, 1, "dim", None)) or None, bool(_arg(n, 2, "keepdim", False)))
    if op == "prod":
        if ov == "default":
            return Reduction(op, None, False)
        return Reduction(op, _dims(_arg(n, 1, "dim", None)), bool(_arg(n, 2, "keepdim", False)))
    if op in ("amax", "amin", "logsumexp"):
        return Reduction(op, _dims(_arg(n, 1, "dim", None)) or None, bool(_arg(n, 2, "keepdim", False)))
    if op in ("max", "min") and ov == "dim":
        return Reduction(op, (int(a[1]),), bool(_arg(n, 2, "keepdim", False)), indices=True)
    if op in ("max", "min") and ov == "default":
        return Reduction("amax" if op == "max" else "amin", None, False)
    if op in ("argmax", "argmin"):
        d = _arg(n, 1, "dim", None)
        return Reduction(op, None if d is None else (int(d),), bool(_arg(n, 2, "keepdim", False)))
    if op in ("var", "std"):
        if ov in ("correction", "correction_names"):
            c = n.kw("correction", None)
            dims, correction, keep = (
                _arg(n, 1, "dim", None),
                1.0 if c is None else float(c),
                n.kw("keepdim", False),
            )
        elif ov == "dim":
            dims, keep = _arg(n, 1, "dim", None), _arg(n, 3, "keepdim", False)
            correction = 1.0 if _arg(n, 2, "unbiased", True) else 0.0
        else:  # var.default(x, unbiased)
            dims, keep, correction = None, False, 1.0 if _arg(n, 1, "unbiased", True) else 0.0
        return Reduction(op, _dims(dims) or None, bool(keep), correction)
    if op == "linalg_vector_norm":
        order = float(_arg(n, 1, "ord", 2))
        kind = {1.0: "norm1", 2.0: "norm2", math.inf: "norminf"}.get(order)
        if kind is None or n.kw("dtype") is not None:
            return None
        return Reduction(kind, _dims(_arg(n, 2, "dim", None)) or None, bool(_arg(n, 3, "keepdim", False)))
    return None


def _dims(d: Any) -> tuple[int, ...] | None:
    if d is None:
        return None
    if isinstance(d, int):
        return (d,)
    if not isinstance(d, tuple) or not all(isinstance(x, int) for x in d):
        return None
    return tuple(d)


# rms_col: x / sqrt(mean(x^2, dim, keepdim) + eps) over one dim that is not the last (regions._rms_norm_by_hand):
# a two-pass op over one dim like softmax, taken by the column family
SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "rms_col"})
NORMS = frozenset(
    {"layer_norm", "rms_norm", "group_norm", "instance_norm", "batch_norm", "l1_norm", "l2_normalize"}
)
# Scans the flips and concatenations around them fold into (scans.py): reverse and exclusive forms.
FOLDABLE_SCANS = frozenset({"cumsum", "cumprod", "logcumsumexp"})
# cummax / cummin's (values, indices), taken apart by their getitems into a scan each (regions.py): the
# running max / min of 64-bit keys, the value's order in the high word and its position in the low, so that
# a tie goes to the later position and a NaN wins from where it appears, as PyTorch's do.
KEYED_SCANS = {"cummax": ("cummax", 0), "cummin": ("cummin", 0), "cummax_index": ("cummax", 1),
               "cummin_index": ("cummin", 1)}  # fmt: skip
SCANS = FOLDABLE_SCANS | frozenset(KEYED_SCANS)
# Library anchors: the GEMM or convolution stays in cuBLAS / cuDNN, everything after it is ours.
GEMMS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm"})
CONVS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
# Views and layout changes, done in the launcher with torch's own (plumbing) tensor methods.
VIEWS = frozenset(
    {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "permute", "transpose", "t", "numpy_T", "unsqueeze",
     "squeeze", "expand", "select", "slice", "narrow", "getitem", "split", "split_with_sizes", "chunk", "unbind",
     "diagonal", "as_strided"}
)  # fmt: skip
