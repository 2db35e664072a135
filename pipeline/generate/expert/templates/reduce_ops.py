"""Each reduction kind as pieces of CUDA over the shared `Acc`: its start value, the merge functor, how an
element enters (`v` its value, `c` its index along the reduced dims, `K` a shift), and the final value
(`n` the reduced count). Variance uses sums shifted by the row's first element, which keeps the
cancellation of the plain two-moment formula away at no extra pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.generate.expert import ops
from pipeline.generate.expert.templates.signature import Param, Signature, i32, i64, ptr


@dataclass(frozen=True)
class Kind:
    init: str
    op: str
    elem: str  # an Acc built from v (and c, K); "lse" pushes online instead
    final: str  # a float from acc and n
    shift: bool = False  # needs K, the first element of the row
    second: bool = False  # sums a second moment in acc.b (else acc.b stays 0)

    def push(self, acc: str, v: str, c: str, compensated: bool = False) -> str:
        """`compensated` (sums only): Kahan's, the low bits each add loses kept in ca_ / cb_ and put back
        into the next (a thread summing 8K of 1G elements sequentially drifts by up to n * 2^-24)."""
        if self.op == "LseOp":
            return f"lse_push({acc}, {v});"
        if compensated and self.op == "SumOp":
            # acc.b's compensation only where b is summed: the compiler cannot drop a Kahan add of 0.0f (the
            # sign of a zero sum), and on a 1G-element mean it was a quarter of the loop's instructions
            second = f" kahan_add({acc}.b, cb_, e_.b);" if self.second else ""
            return (
                f"{{ const Acc e_ = {self.elem.format(v=v, c=c)}; kahan_add({acc}.a, ca_, e_.a);{second} }}"
            )
        return f"{acc} = {self.op}()({acc}, {self.elem.format(v=v, c=c)});"


_INF = "CUDART_INF_F"
KINDS: dict[str, Kind] = {
    "sum": Kind("{0.0f, 0.0f, 0}", "SumOp", "Acc{{{v}, 0.0f, 0}}", "acc.a"),
    "mean": Kind("{0.0f, 0.0f, 0}", "SumOp", "Acc{{{v}, 0.0f, 0}}", "acc.a / (float)n"),
    "prod": Kind("{1.0f, 0.0f, 0}", "ProdOp", "Acc{{{v}, 0.0f, 0}}", "acc.a"),
    "amax": Kind(f"{{-{_INF}, 0.0f, 0}}", "MaxOp", "Acc{{{v}, 0.0f, 0}}", "acc.a"),
    "amin": Kind(f"{{{_INF}, 0.0f, 0}}", "MinOp", "Acc{{{v}, 0.0f, 0}}", "acc.a"),
    "max": Kind(f"{{-{_INF}, 0.0f, LLONG_MAX}}", "ArgOp<true>", "Acc{{{v}, 0.0f, {c}}}", "acc.a"),
    "min": Kind(f"{{{_INF}, 0.0f, LLONG_MAX}}", "ArgOp<false>", "Acc{{{v}, 0.0f, {c}}}", "acc.a"),
    "argmax": Kind(f"{{-{_INF}, 0.0f, LLONG_MAX}}", "ArgOp<true>", "Acc{{{v}, 0.0f, {c}}}", "(float)acc.i"),
    "argmin": Kind(f"{{{_INF}, 0.0f, LLONG_MAX}}", "ArgOp<false>", "Acc{{{v}, 0.0f, {c}}}", "(float)acc.i"),
    "var": Kind(
        "{0.0f, 0.0f, 0}",
        "SumOp",
        "Acc{{{v} - K, ({v} - K) * ({v} - K), 0}}",
        "fmaxf(acc.b - acc.a * (acc.a / (float)n), 0.0f) / ((float)n - CORR)",
        shift=True,
        second=True,
    ),
    "std": Kind(
        "{0.0f, 0.0f, 0}",
        "SumOp",
        "Acc{{{v} - K, ({v} - K) * ({v} - K), 0}}",
        "sqrtf(fmaxf(acc.b - acc.a * (acc.a / (float)n), 0.0f) / ((float)n - CORR))",
        shift=True,
        second=True,
    ),
    "logsumexp": Kind(
        f"{{-{_INF}, 0.0f, 0}}", "LseOp", "", f"(acc.a == -{_INF} ? -{_INF} : acc.a + logf(acc.b))"
    ),
    "norm1": Kind("{0.0f, 0.0f, 0}", "SumOp", "Acc{{fabsf({v}), 0.0f, 0}}", "acc.a"),
    "norm2": Kind("{0.0f, 0.0f, 0}", "SumOp", "Acc{{({v}) * ({v}), 0.0f, 0}}", "sqrtf(acc.a)"),
    "norminf": Kind("{0.0f, 0.0f, 0}", "MaxOp", "Acc{{fabsf({v}), 0.0f, 0}}", "acc.a"),
    # statistics of the two-pass ops
    "softmax": Kind(f"{{-{_INF}, 0.0f, 0}}", "LseOp", "", ""),
    "log_softmax": Kind(f"{{-{_INF}, 0.0f, 0}}", "LseOp", "", ""),
    "layer_norm": Kind(
        "{0.0f, 0.0f, 0}", "SumOp", "Acc{{{v} - K, ({v} - K) * ({v} - K), 0}}", "", shift=True, second=True
    ),
    "group_norm": Kind(
        "{0.0f, 0.0f, 0}", "SumOp", "Acc{{{v} - K, ({v} - K) * ({v} - K), 0}}", "", shift=True, second=True
    ),
    "rms_norm": Kind("{0.0f, 0.0f, 0}", "SumOp", "Acc{{({v}) * ({v}), 0.0f, 0}}", ""),
    "rms_col": Kind("{0.0f, 0.0f, 0}", "SumOp", "Acc{{({v}) * ({v}), 0.0f, 0}}", ""),  # over a dim not last
    "l1_norm": Kind(
        "{0.0f, 0.0f, 0}", "SumOp", "Acc{{fabsf({v}), 0.0f, 0}}", ""
    ),  # x / sum|x| (expert's own)
    # x / max(||x||_2, eps): F.normalize (expert's own)
    "l2_normalize": Kind("{0.0f, 0.0f, 0}", "SumOp", "Acc{{({v}) * ({v}), 0.0f, 0}}", ""),
}
TWO_PASS = ("softmax", "log_softmax", "layer_norm", "group_norm", "rms_norm", "l1_norm", "l2_normalize")


def final(kind: str, correction: float) -> str:
    return KINDS[kind].final.replace("CORR", ops.lit(correction))


def store(kind: str, correction: float, out_ct: str, index: str) -> str:
    """The statement writing one reduced value (arg* write the index itself: a float cannot hold it)."""
    if kind in ("argmax", "argmin"):
        return f"y[{index}] = acc.i;"
    return f"y[{index}] = cv<{out_ct}>(post({final(kind, correction)}, {index}));"


def combine_kernel(name: str, kind: str, correction: float, out_dt: str, indices: bool, post_params: list[Param],
                   post_decl: str, threads: int, n_out: str, n: str) -> tuple[str, Signature]:  # fmt: skip
    """Merges the per-split partial accumulators (in split order, so the result is deterministic). `n_out`
    and `n` are the launcher's expressions for the outputs' count and the reduced count."""
    k = KINDS[kind]
    out_ct = ops.C_TYPES[out_dt]
    sig = Signature((
        ptr("ws", "Acc"), ptr("y", out_ct, const=False), *([ptr("yi", "long long", const=False)] if indices else []),
        i64("n_out", n_out), i32("splits"), i64("n", n), *post_params,
    ))  # fmt: skip
    wrap = [p.name for p in sig.params].index("n")  # the declaration goes on over two lines
    head, tail = Signature(sig.params[:wrap]), Signature(sig.params[wrap:])
    store_i = "            yi[t] = acc.i;\n" if indices else ""
    source = f"""extern "C" __global__ void __launch_bounds__({threads})
{name}({head.decls()},
       {tail.decls()}) {{
{post_decl}
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n_out;
         t += (long long)gridDim.x * blockDim.x) {{
        Acc acc = ws[t];
        for (int s = 1; s < splits; ++s) acc = {k.op}()(acc, ws[(long long)s * n_out + t]);
        {store(kind, correction, out_ct, "t")}
{store_i}    }}
}}"""
    return source, sig
