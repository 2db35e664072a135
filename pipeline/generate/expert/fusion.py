"""Which elementwise regions can run inside a neighbouring kernel that hosts them (a reduction, softmax,
norm or scan: the families that host call these with their own regions)."""

from __future__ import annotations

from pipeline.generate.expert.graph import Ref
from pipeline.generate.expert.regions import Lowered, Region, RegionKind
from pipeline.generate.expert.templates.fused import Fused, fusable


def _region(low: Lowered, rid: str) -> Region:
    return next(r for r in low.regions if r.rid == rid)


def prologue(host: Region, low: Lowered) -> Fused | None:
    """The ew region that produces the host's input, computed on the host's loads."""
    if not host.node.args or not isinstance(host.node.args[0], Ref):
        return None
    src = host.node.args[0].name
    p = low.region_of(src)
    if p is None or p.kind is not RegionKind.EW or p.outputs != (src,) or p.inplace:
        return None
    if low.users.get(src, ()) != (host.node.name,) or src in low.graph.output_names():
        return None
    # the host indexes its input by the main operand's own shape: one of the region's shape exactly, not one
    # that merely has its elements ((6000,) under a (1, 6000) region; found by the fuzz hunt, seed 6526)
    mains = [i for i in p.inputs if tuple(low.by_name[i].shape or ()) == tuple(p.shape or ())]
    if not mains:
        return None
    return fusable(p, mains[0], low, "f")


def epilogue(host: Region, low: Lowered) -> Fused | None:
    """The ew region that consumes the host's only output, computed on the host's stores."""
    if len(host.outputs) != 1:
        return None
    out = host.outputs[0]
    node = low.by_name[out]
    if node.shape is None or node.dtype not in ("float32", "float16", "bfloat16"):
        return None  # tuples (max over a dim) and integer results (argmax) stay as they are
    users = low.users.get(out, ())
    if not users or out in low.graph.output_names():
        return None
    e = low.region_of(users[0])
    if e is None or e.kind is not RegionKind.EW or any(low.region_of(u) is not e for u in users):
        return None
    # E runs where the host runs, so whatever else it reads must be ready by then.
    position = {r.rid: i for i, r in enumerate(low.regions)}
    for i in e.inputs:
        src = low.region_of(i)
        if i != out and src is not None and position[src.rid] >= position[host.rid]:
            return None
    return fusable(e, out, low, "e")


def neighbours(host: Region, low: Lowered) -> tuple[Fused | None, Fused | None]:
    """The (prologue, epilogue) a host region could absorb."""
    return prologue(host, low), epilogue(host, low)
