"""Which elementwise regions can run inside a neighbouring reduction / softmax / norm / scan kernel."""

from __future__ import annotations

from pipeline.generate.expert.graph import Ref
from pipeline.generate.expert.layout import operand_class
from pipeline.generate.expert.regions import Lowered, Region
from pipeline.generate.expert.templates.fused import Fused, fusable

HOSTS = ("reduce", "softmax", "norm", "scan")


def _region(low: Lowered, rid: str) -> Region:
    return next(r for r in low.regions if r.rid == rid)


def prologue(host: Region, low: Lowered) -> Fused | None:
    """The ew region that produces the host's input, computed on the host's loads."""
    if host.kind not in HOSTS or not host.node.args or not isinstance(host.node.args[0], Ref):
        return None
    src = host.node.args[0].name
    p = low.region_of(src)
    if p is None or p.kind != "ew" or p.outputs != (src,) or p.inplace:
        return None
    if low.users.get(src, ()) != (host.node.name,) or src in low.graph.output_names():
        return None
    mains = [i for i in p.inputs if operand_class(low.by_name[i].shape or (), p.shape, 0) == "full"]
    if not mains:
        return None
    return fusable(p, mains[0], low, "f")


def epilogue(host: Region, low: Lowered) -> Fused | None:
    """The ew region that consumes the host's only output, computed on the host's stores."""
    if host.kind not in HOSTS or len(host.outputs) != 1:
        return None
    out = host.outputs[0]
    node = low.by_name[out]
    if node.shape is None or node.dtype not in ("float32", "float16", "bfloat16"):
        return None  # tuples (max over a dim) and integer results (argmax) stay as they are
    users = low.users.get(out, ())
    if not users or out in low.graph.output_names():
        return None
    e = low.region_of(users[0])
    if e is None or e.kind != "ew" or any(low.region_of(u) is not e for u in users):
        return None
    # E runs where the host runs, so whatever else it reads must be ready by then.
    position = {r.rid: i for i, r in enumerate(low.regions)}
    for i in e.inputs:
        src = low.region_of(i)
        if i != out and src is not None and position[src.rid] >= position[host.rid]:
            return None
    return fusable(e, out, low, "e")


def options(low: Lowered) -> dict[str, tuple[Fused | None, Fused | None]]:
    """host rid -> (prologue, epilogue) it could absorb."""
    return {r.rid: (prologue(r, low), epilogue(r, low)) for r in low.regions if r.kind in HOSTS}
