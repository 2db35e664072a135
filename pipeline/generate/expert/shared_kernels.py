"""One copy of each distinct kernel text in a rendered source: regions of the same form share it.

A model of repeated blocks (a ResNet's bottlenecks, a transformer's layers, an RNN unrolled over its time
steps) renders one region's kernels per block, identical but for their names: nvcc then compiles each copy
(level 3's unrolled RNN came to 5.5 MB of CUDA for 5 distinct texts). Here a region whose kernel text is an
earlier region's, up to the names only it uses, drops its text and its launcher calls the earlier region's
kernels. Its launcher stays its own (its shapes, arguments and any state it keeps), as does its place in
forward.

A name counts as the region's own when it starts with `kp_` or `v_` (the templates' prefixes for their
kernels, device functions, namespaces and chain values) and no other region's code and no shared helper
mentions it. Two texts are the same when they are equal with their own names numbered in order of first
use and their line comments removed; every other name must match as written. A name shared with another
region is thus the same name in both texts, and a region's own names are defined in its own text (nothing
else mentions them, and the headers a source includes declare no such name it could call: CuTe's `v_idx`
and the like are its functions' locals), so calling the earlier region's kernels computes what the dropped
text would have.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable

from pipeline.generate.expert.templates.code import Code

_NAME = re.compile(r"\b(?:kp|v)_\w+")
_LINE_COMMENT = re.compile(r"//[^\n]*")


def _canonical(cuda: str, own: set[str]) -> tuple[str, list[str]]:
    """The text with its comments removed and its own names numbered in order of first use, and those names
    in that order."""
    order: dict[str, str] = {}

    def number(m: re.Match[str]) -> str:
        name = m.group(0)
        if name not in own:
            return name
        return order.setdefault(name, f"kp_@{len(order)}")

    return _NAME.sub(number, _LINE_COMMENT.sub("", cuda)), list(order)


def share_kernels(codes: dict[str, Code], shared_text: Iterable[str] = ()) -> dict[str, Code]:
    """`codes` (in the source's order) with each kernel text that repeats an earlier one dropped, and the
    launchers of the regions that dropped theirs calling the earlier region's kernels by name.
    `shared_text`: the source's other parts (prelude, helpers, gathers): a name they mention is no region's
    own."""
    mentions: Counter[str] = Counter()
    for c in codes.values():
        mentions.update(set(_NAME.findall(c.cuda)) | set(_NAME.findall(c.launcher)))
    for text in shared_text:
        mentions.update({name: 2 for name in set(_NAME.findall(text))})
    first: dict[str, list[str]] = {}  # canonical text -> the kept region's own names, in order
    out: dict[str, Code] = {}
    for rid, c in codes.items():
        own = {name for name in _NAME.findall(c.cuda) if mentions[name] == 1}
        key, names = _canonical(c.cuda, own)
        kept = first.get(key)
        if kept is None or not c.cuda.strip():
            first.setdefault(key, names)
            out[rid] = c
            continue
        out[rid] = _calling(c, dict(zip(names, kept, strict=True)))
    return out


def _calling(c: Code, rename: dict[str, str]) -> Code:
    """The region's code without its kernel text, its launcher calling the kept region's kernels."""
    launcher = _NAME.sub(lambda m: rename.get(m.group(0), m.group(0)), c.launcher)
    kernels = tuple(rename.get(k, k) for k in c.kernels)
    return dataclasses.replace(c, cuda="", launcher=launcher, kernels=kernels)


__all__ = ["share_kernels"]
