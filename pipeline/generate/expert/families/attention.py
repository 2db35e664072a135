"""Fused attention (templates/attention.py): scaled_dot_product_attention, and the chains that attention
blocks write by hand, Q @ Kᵀ -> elementwise ops (scale, mask, bias, an activation) -> softmax -> @ V, or the
same with an activation in place of the softmax; the score chain may go on through a view that splits the
batch (B / w, w, H, L, S), ops there (Swin's shifted windows add a mask a window so) and a view back. fp32
through 3xTF32 on the tensor cores.

The family claims the chain's first product (or the SDPA call); its entry absorbs the score chain, the
softmax and the second product, and its kernel runs where the second product did (everything it reads,
a mask sliced after the first product included, is ready by then). The plain plan keeps the reference's kernels (PyTorch's SDPA, or cuBLAS
and our row-wise kernels), the tuned one the fused kernel; measurement picks. Edits: use_fused_attention
(from the unfused plan), coarsen_threads / more_parallelism (query rows a block x2 and /2), resize_grid
(both), tile_shared_memory / reduce_registers (keys a tile 32 <-> 64), increase_occupancy (one more block
an SM in the launch bounds). Over few keys (at most SHORT_KEYS, e.g. level 3's ViT, whose attention runs
over the 2 images of its batch) the tuned plan takes the CUDA-core form (templates/attention_rows.py: a
query row to a group of lanes, plain fp32 FMAs); more_parallelism offers it up to a key tile of 64, and
use_tensor_cores goes back.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from pipeline.generate.expert import ops
from pipeline.generate.expert.families.base import Family, RenderError, change, label
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import Lowered, Region, RegionKind, broadcast
from pipeline.generate.expert.templates import attention, attention_rows
from pipeline.generate.expert.templates.attention import AttnForm
from pipeline.generate.expert.templates.code import Code

MAX_HEAD = 128  # head dims above this would not fit the output and its per-tile sums in registers
SMEM_LIMIT = 227 * 1024
# Keys up to which the tuned plan computes on the CUDA cores: the narrowest key tile (32) half empty and at
# most 16 dot products a row; more_parallelism offers the CUDA cores up to ROWS_OFFER keys.
SHORT_KEYS, ROWS_OFFER = 16, 64
GEMMS = ("gemm_matmul", "gemm_bmm")
# Elementwise ops that leave the probabilities as they are (a dropout of p = 0, copies).
_IDENTITY = frozenset({"clone", "contiguous", "alias", "detach"})
_RESHAPES = frozenset({"view", "reshape", "_unsafe_view"})


@dataclass(frozen=True)
class AttnPlan(RegionPlan):
    TAG: ClassVar[str] = "attention"
    SHOWN: ClassVar[tuple[str, ...]] = ("warps", "bn", "rows")
    ABSORBS: ClassVar[tuple[str, ...]] = ("scores", "scores2", "softmax", "between", "pv", "qnorm", "knorm")

    warps: int = 4  # 16 query rows each: 64 rows a block
    bn: int = 32  # keys a tile
    # __launch_bounds__' blocks per SM: 1 lets ptxas use every register (without it, it spilled at 168)
    min_blocks: int = 1
    rows: bool = False  # the CUDA-core form for few keys (templates/attention_rows.py); warps, bn unused
    scores: str = ""  # rid of the elementwise chain on the scores (a hand-written attention)
    scores2: str = ""  # rid of the ops on the scores split by batch (a mask a window: Swin's shifted windows)
    softmax: str = ""  # rid of its softmax
    between: str = ""  # rid of an identity between the softmax and the product (a dropout of p = 0)
    pv: str = ""  # rid of its second product
    qnorm: str = ""  # rid of F.normalize on Q's head dim, done as Q is loaded
    knorm: str = ""  # rid of F.normalize on K's head dim, done as K is staged

    def describe(self) -> str:
        if not self.rows:
            return super().describe()
        return f"{self.TAG} rows (CUDA cores, a query row to a group of lanes)"


@dataclass(frozen=True)
class Match:
    form: AttnForm
    absorbs: dict[str, str]  # AttnPlan knob -> region id
    keys: int  # the keys' length in the graph's shapes


def _sole_reader(value: str, low: Lowered) -> Region | None:
    """The one region that reads `value`, when nothing else (nor the model's return) does."""
    users = low.users.get(value, ())
    if not users or value in low.graph.output_names():
        return None
    regions = {id(r): r for u in users if (r := low.region_of(u)) is not None}
    return next(iter(regions.values())) if len(regions) == 1 else None


def _heads(q: tuple, k: tuple, v: tuple, gqa: bool = False) -> tuple[int, str]:
    """(query heads per key head, "") when the shapes are an attention's, else (0, why not)."""
    if len(q) not in (3, 4) or len(k) != len(q) or len(v) != len(q):
        return 0, "only 3-D (N, L, E) and 4-D (B, H, L, E) operands have a fused attention template"
    if k[-2] != v[-2] or q[-1] != k[-1]:
        return 0, "the operands' lengths or head dims do not match"
    if q[:-3] != k[:-3] or q[:-3] != v[:-3] or k[:-2] != v[:-2]:
        return 0, "broadcast batch dims have no fused attention template"
    hg = 1
    if len(q) == 4 and q[1] != k[1]:
        if not gqa or q[1] % k[1]:
            return 0, "query and key heads differ"
        hg = q[1] // k[1]
    for name, d in (("Q/K", q[-1]), ("V", v[-1])):
        if d % 8 or not 0 < d <= MAX_HEAD:
            return 0, f"the {name} head dim {d} is not a multiple of 8 up to {MAX_HEAD}"
    return hg, ""


def _sdpa(r: Region, low: Lowered) -> Match | str:
    n = r.node
    args = list(n.args) + [None] * (6 - len(n.args))
    q, k, v = (low.by_name.get(getattr(a, "name", "")) for a in args[:3])
    if q is None or k is None or v is None or not (q.shape and k.shape and v.shape):
        return "the operands' shapes are unknown"
    if any(x.dtype != "float32" for x in (q, k, v)):
        return "fused attention takes fp32 operands (3xTF32); 16-bit attention stays in PyTorch's SDPA"
    mask = args[3] if args[3] is not None else n.kw("attn_mask")
    dropout = args[4] if args[4] is not None else n.kw("dropout_p", 0.0)
    causal = bool(args[5] if args[5] is not None else n.kw("is_causal", False))
    if dropout:
        return "attention dropout has no fused template"
    hg, why = _heads(q.shape, k.shape, v.shape, bool(n.kw("enable_gqa", False)))
    if not hg:
        return why
    mask_dt = ""
    if mask is not None:
        m = low.by_name.get(getattr(mask, "name", ""))
        scores = (*q.shape[:-1], k.shape[-2])
        if m is None or m.shape is None or broadcast(m.shape, scores) != scores:
            return "the mask does not broadcast to the scores"
        if m.dtype not in ("bool", "float32"):
            return f"a {m.dtype} mask has no fused template"
        mask_dt = m.dtype
    scale = n.kw("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    form = AttnForm(
        q.name, k.name, v.name, False, len(q.shape), q.shape[-1], v.shape[-1], r.outputs[0], scale, causal,
        mask.name if mask is not None else None, mask_dt, hg=hg, out_order=_reader_order(r.outputs[0], low),
    )  # fmt: skip
    return Match(form, {}, k.shape[-2])


def _identity(r: Region) -> bool:
    """A region that passes its one input through (a dropout of p = 0, in training mode or not; a copy)."""
    if len(r.nodes) != 1 or len(r.inputs) != 1:
        return False
    n = r.node
    if n.op in ("dropout", "native_dropout"):
        return len(n.args) > 1 and n.args[1] == 0.0
    return n.op in _IDENTITY


def _reader_order(value: str, low: Lowered) -> tuple[int, ...]:
    """The dim order a (B, H, L, Dv) output's one reader permutes it to (a transpose merging heads back, MHA's
    (L, B, H, Dv) permute), when Dv stays last; () when read as it is."""
    users = low.users.get(value, ())
    node = low.by_name[value]
    if len(users) != 1 or value in low.graph.output_names() or len(node.shape or ()) != 4:
        return ()
    u = low.by_name[users[0]]
    order = list(range(4))
    if u.op == "transpose" and len(u.args) >= 3:
        i, j = (int(d) % 4 for d in u.args[1:3])
        order[i], order[j] = order[j], order[i]
    elif u.op == "permute" and len(u.args) >= 2:
        dims = u.args[1] if isinstance(u.args[1], (list, tuple)) else u.args[1:]
        order = [int(d) % 4 for d in dims]
    return tuple(order) if order[3] == 3 and order != [0, 1, 2, 3] and sorted(order) == [0, 1, 2, 3] else ()


def _ew_on_scores(x: Region, shape: tuple, low: Lowered, main: str) -> str:
    """Why the elementwise region x cannot run inside the kernel on scores of `shape`, or ""."""
    if len(x.outputs) != 1 or x.shape != shape:
        return "the scores' elementwise ops have other outputs or another shape"
    if ops.positional(x.nodes):
        return "a positional op (triu, tril) on the scores has no place in the fused kernel yet"
    for i in x.inputs:
        v = low.by_name[i]
        if i != main and (
            v.shape is None or broadcast(v.shape, shape) != shape or v.dtype not in ops.C_TYPES
        ):
            return "an operand of the scores' ops does not broadcast to the scores"
    if next(m.dtype for m in x.nodes if m.name == x.outputs[0]) != "float32":
        return "the scores' ops do not stay in fp32"
    return ""


def _view_to(x: Region | None, shape: tuple) -> str | None:
    """x's output when x is one view or reshape to `shape`."""
    if x is None or x.kind is not RegionKind.VIEW or len(x.nodes) != 1 or x.node.op not in _RESHAPES:
        return None
    return x.outputs[0] if tuple(x.node.shape or ()) == shape else None


def _split(nxt: Region | None, shape: tuple, low: Lowered) -> tuple[int, str, Region, str] | str | None:
    """(split, the split view, the region, its scores viewed back) for scores viewed with their batch split
    in two, (B / split, split, H, L, S), elementwise ops there and viewed back to `shape` (Swin's shifted
    windows add their mask so); a reason when the view is one but what follows it is not; None when nxt is
    no such view."""
    if nxt is None or len(shape) != 4 or nxt.kind is not RegionKind.VIEW or len(nxt.nodes) != 1:
        return None
    five = tuple(nxt.node.shape or ())
    if len(five) != 5 or five[2:] != shape[1:] or five[0] * five[1] != shape[0] or five[1] < 2:
        return None
    viewed = _view_to(nxt, five)
    if viewed is None:
        return None
    ew = _sole_reader(viewed, low)
    if ew is None or ew.kind is not RegionKind.EW or _identity(ew):
        return "the scores split by batch go to no elementwise op"
    if why := _ew_on_scores(ew, five, low, viewed):
        return why
    back = _view_to(_sole_reader(ew.outputs[0], low), shape)
    if back is None:
        return "the scores split by batch are not viewed back"
    return five[1], viewed, ew, back


def _normalized(value: str, reader: Region, low: Lowered) -> tuple[str, float, Region] | None:
    """(its input, eps, the region) when `value` is F.normalize over its last dim alone (an l2_normalize row
    op, regions.py), read by `reader` alone, over a head dim the kernels can normalize as they load it."""
    src = low.region_of(value)
    if src is None or src.kind is not RegionKind.NORM or len(src.nodes) != 1 or src.outputs != (value,):
        return None
    n = src.node
    if n.op != "l2_normalize" or _sole_reader(value, low) is not reader:
        return None
    x, shape, eps = n.args
    xs = low.by_name.get(getattr(x, "name", ""))
    if xs is None or not xs.shape or tuple(shape) != (xs.shape[-1],) or xs.dtype != "float32":
        return None
    return (x.name, float(eps), src) if attention.norms_fit(xs.shape[-1]) else None


def _normalized_keys(kt: str, r: Region, low: Lowered) -> tuple[str, float, Region] | None:
    """_normalized of K where the product reads it transposed, `F.normalize(k).transpose(-2, -1)`: a view
    read by the product alone."""
    view = low.region_of(kt)
    if (
        view is None
        or view.kind is not RegionKind.VIEW
        or len(view.nodes) != 1
        or _sole_reader(kt, low) is not r
    ):
        return None
    n = view.node
    nd = len(n.shape or ())
    if n.op != "transpose" or len(n.args) != 3 or {int(d) % nd for d in n.args[1:]} != {nd - 2, nd - 1}:
        return None
    return _normalized(getattr(n.args[0], "name", ""), view, low)


def _chain(r: Region, low: Lowered) -> Match | str:
    n = r.node
    a, b = (low.by_name.get(getattr(x, "name", "")) for x in n.args[:2])
    if a is None or b is None or not a.shape or not b.shape or n.shape is None:
        return "the operands' shapes are unknown"
    if n.dtype != "float32" or a.dtype != "float32" or b.dtype != "float32":
        return "fused attention takes fp32 operands (3xTF32)"
    absorbs: dict[str, str] = {}
    cur, nxt = r.outputs[0], _sole_reader(r.outputs[0], low)
    chain = None
    if nxt is not None and nxt.kind is RegionKind.EW and not _identity(nxt):
        if why := _ew_on_scores(nxt, n.shape, low, cur):
            return why
        chain, absorbs["scores"] = nxt, nxt.rid
        cur, nxt = nxt.outputs[0], _sole_reader(nxt.outputs[0], low)
    split = _split(nxt, tuple(n.shape), low)
    if isinstance(split, str):
        return split
    if split is not None:
        absorbs["scores2"] = split[2].rid
        cur, nxt = split[3], _sole_reader(split[3], low)
    softmax = False
    if nxt is not None and nxt.kind is RegionKind.SOFTMAX:
        s = nxt.node
        nd = len(s.shape or ())
        if len(nxt.nodes) != 1 or s.op not in ("softmax", "_softmax") or int(s.args[1]) % nd != nd - 1:
            return "only a softmax over the keys (the last dim) is fused"
        if s.dtype != "float32":
            return "the softmax does not stay in fp32"
        softmax, absorbs["softmax"] = True, nxt.rid
        cur, nxt = nxt.outputs[0], _sole_reader(nxt.outputs[0], low)
    if not softmax and chain is None and split is None:
        return "two products with nothing between them are GEMMs, not an attention"
    if nxt is not None and nxt.kind in (RegionKind.EW, RegionKind.TORCH) and _identity(nxt):
        absorbs["between"] = nxt.rid
        cur, nxt = nxt.outputs[0], _sole_reader(nxt.outputs[0], low)
    if nxt is None or nxt.kind is not RegionKind.LIBRARY or nxt.node.op not in GEMMS:
        return "the weights do not go into a product with V alone"
    p, vref = nxt.node.args[:2]
    v = low.by_name.get(getattr(vref, "name", ""))
    if getattr(p, "name", None) != cur or v is None or v.shape is None or v.name == cur:
        return "the weights are not the left operand of the second product"
    if v.dtype != "float32" or nxt.node.dtype != "float32":
        return "fused attention takes fp32 operands (3xTF32)"
    kt = tuple(b.shape)
    hg, why = _heads(tuple(a.shape), (*kt[:-2], kt[-1], kt[-2]), tuple(v.shape))
    if not hg:
        return why
    if hg != 1:
        return "query and key heads differ"
    absorbs["pv"] = nxt.rid
    out_order = _reader_order(nxt.outputs[0], low)
    main = r.outputs[0]
    extras = tuple(
        (i, low.by_name[i].dtype or "float32") for i in (chain.inputs if chain else ()) if i != main
    )
    more: dict[str, Any] = {}
    if split is not None:
        w, viewed, ew, _ = split
        extras2 = tuple((i, low.by_name[i].dtype or "float32") for i in ew.inputs if i != viewed)
        more = {"chain2": ew, "chain2_main": viewed, "extras2": extras2, "split": w}
    # F.normalize of Q and of K on their head dim (SwinV2's cosine scores): done as the rows are loaded, the
    # kernel reading the raw operands (K itself, not transposed)
    qname, kname, k_transposed = a.name, b.name, True
    if (qn := _normalized(a.name, r, low)) is not None:
        qname, more["norm_q"], absorbs["qnorm"] = qn[0], qn[1], qn[2].rid
    if (kn := _normalized_keys(b.name, r, low)) is not None:
        kname, k_transposed, more["norm_k"], absorbs["knorm"] = kn[0], False, kn[1], kn[2].rid
    form = AttnForm(
        qname, kname, v.name, k_transposed, len(a.shape), a.shape[-1], v.shape[-1], nxt.outputs[0], None, False,
        None, softmax=softmax, chain=chain, chain_main=main, extras=extras, out_order=out_order, **more,
    )  # fmt: skip
    return Match(form, absorbs, kt[-1])


def match(r: Region, low: Lowered) -> Match | str:
    """The attention this region starts, or why it is not one we fuse."""
    if r.kind is RegionKind.TORCH and r.node.op == "scaled_dot_product_attention":
        return _sdpa(r, low)
    if r.kind is RegionKind.LIBRARY and r.node.op in GEMMS:
        return _chain(r, low)
    return "not an attention"


def claims(r: Region, low: Lowered) -> bool:
    return not isinstance(match(r, low), str)


def _fits(f: AttnForm, rp: AttnPlan) -> bool:
    if rp.rows:
        return True  # no shared memory; any head dims the family takes
    per_block = attention.smem_bytes(f, rp) + 1024  # the driver reserves 1 KB a block
    return rp.warps in (2, 4, 8) and rp.bn in (32, 64) and rp.min_blocks * per_block <= SMEM_LIMIT + 1024


def render(r: Region, rp: AttnPlan, low: Lowered, hunter: Any) -> Code:
    m = match(r, low)
    if isinstance(m, str):
        raise RenderError(f"region {r.rid} cannot be our fused attention: {m}")
    if {k: v for k, v in m.absorbs.items()} != {
        k: getattr(rp, k) for k in AttnPlan.ABSORBS if getattr(rp, k)
    }:
        raise RenderError(f"region {r.rid}: the plan's fusion no longer applies")
    if not _fits(m.form, rp):
        raise RenderError(f"region {r.rid}: {rp.warps} warps and {rp.bn}-key tiles do not fit")
    if rp.rows:
        return attention_rows.render(r, m.form, rp)
    return attention.render(r, m.form, rp, hunter)


def first(r: Region, low: Lowered, tuned: bool) -> None:
    return None  # the reference's kernels until settle (or an edit) fuses them


def _fused(plan: Plan, r: Region, low: Lowered) -> Plan | None:
    """The plan with the whole attention in our kernel: the absorbed regions lose their own entries."""
    m = match(r, low)
    if isinstance(m, str):
        return None
    # Wide heads take 8 warps: half the staged K and V a thread, so the prefetch fits in registers.
    rp = AttnPlan(
        r.rid, warps=4 if max(m.form.d, m.form.dv) <= 64 else 8, rows=m.keys <= SHORT_KEYS, **m.absorbs
    )
    gone = set(m.absorbs.values())
    return Plan(tuple(x for x in plan.regions if x.rid not in gone), plan.version, plan.graph).add(rp)


def settle(plan: Plan, r: Region, low: Lowered, tuned: bool) -> Plan:
    """Tuned: fused. Plain: the reference's kernels, unless nothing else would be ours."""
    if plan.get(r.rid) is None and (tuned or all(isinstance(x, AttnPlan) for x in plan.regions)):
        plan = _fused(plan, r, low) or plan
    return plan


def _take(plan: Plan, rp: AttnPlan | None, r: Region, low: Lowered) -> Any:
    if rp is None and (p := _fused(plan, r, low)) is not None:
        fused = p.get(r.rid)
        assert isinstance(fused, AttnPlan)
        yield label("use_fused_attention", r.rid, warps=fused.warps, bn=fused.bn), p


def _on_tensor_cores(rp: AttnPlan | None, r: Region, low: Lowered) -> Match | None:
    """The region's match when the plan computes it on the tensor cores (the plan the tile edits move)."""
    m = match(r, low)
    return None if rp is None or rp.rows or isinstance(m, str) else m


def _rows(edit: str, *factors: float) -> Any:
    def apply(plan: Plan, rp: AttnPlan | None, r: Region, low: Lowered) -> Any:
        if (m := _on_tensor_cores(rp, r, low)) is None:
            return
        if edit == "more_parallelism" and m.keys <= ROWS_OFFER:
            yield from change(edit, plan, rp, rows=True)
        for x in factors:
            w = int(rp.warps * x)
            if w != rp.warps and _fits(m.form, AttnPlan(rp.rid, warps=w, bn=rp.bn, min_blocks=rp.min_blocks)):
                yield from change(edit, plan, rp, warps=w)

    return apply


def _keys(edit: str) -> Any:
    def apply(plan: Plan, rp: AttnPlan | None, r: Region, low: Lowered) -> Any:
        if (m := _on_tensor_cores(rp, r, low)) is None:
            return
        bn = 64 if rp.bn == 32 else 32
        if _fits(m.form, AttnPlan(rp.rid, warps=rp.warps, bn=bn, min_blocks=rp.min_blocks)):
            yield from change(edit, plan, rp, bn=bn)

    return apply


def _occupancy(plan: Plan, rp: AttnPlan | None, r: Region, low: Lowered) -> Any:
    """One more block an SM (registers capped to fit it), while shared memory has room."""
    if (m := _on_tensor_cores(rp, r, low)) is None:
        return
    if _fits(m.form, AttnPlan(rp.rid, warps=rp.warps, bn=rp.bn, min_blocks=rp.min_blocks + 1)):
        yield from change("increase_occupancy", plan, rp, min_blocks=rp.min_blocks + 1)


def _tensor_cores(plan: Plan, rp: AttnPlan | None, r: Region, low: Lowered) -> Any:
    """From the CUDA-core form back to the tensor cores."""
    m = match(r, low)
    if (
        rp is not None
        and rp.rows
        and not isinstance(m, str)
        and _fits(m.form, dataclasses.replace(rp, rows=False))
    ):
        yield from change("use_tensor_cores", plan, rp, rows=False)


def _note(regions: list[Region], low: Lowered) -> str:
    targets = ", ".join(dict.fromkeys(r.node.target for r in regions))
    what = "an attention" if len(regions) == 1 else f"{len(regions)} attentions"
    return f"our fused attention (3xTF32 on the tensor cores) for {what} ({targets}) in the tuned plans"


def _runs_on(arch: str) -> bool:
    m = re.match(r"sm_(\d+)", arch)
    return m is not None and int(m.group(1)) >= 80  # the warp MMA on tf32


FAMILY = Family(
    knobs=AttnPlan,
    claims=claims,
    first=first,
    render=render,
    edits={
        "use_fused_attention": _take,
        "coarsen_threads": _rows("coarsen_threads", 2),
        "more_parallelism": _rows("more_parallelism", 0.5),
        "resize_grid": _rows("resize_grid", 2, 0.5),
        "tile_shared_memory": _keys("tile_shared_memory"),
        "reduce_registers": _keys("reduce_registers"),
        "increase_occupancy": _occupancy,
        "use_tensor_cores": _tensor_cores,
    },
    order=5,
    settle=settle,
    plainest=lambda rp: AttnPlan(
        rp.rid,
        scores=rp.scores,
        scores2=rp.scores2,
        softmax=rp.softmax,
        between=rp.between,
        pv=rp.pv,
        qnorm=rp.qnorm,
        knorm=rp.knorm,
    ),
    note=_note,
    cute=True,
    runs_on=_runs_on,
    optional=True,
)
