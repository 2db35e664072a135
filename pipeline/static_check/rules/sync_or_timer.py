"""sync_or_timer: streams, events, CUDA graphs, synchronisation, torch.backends switches; in forward also
.item()/.tolist()/.cpu()/.numpy() and int()/float()/bool()/numpy.float32()/... of a tensor (each waits for
the GPU)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from pipeline.static_check.report import Violation
from pipeline.static_check.resolver import Launcher
from pipeline.static_check.rules.base import Context, violation
from pipeline.static_check.scopes import Scope
from pipeline.static_check.vocab import FORWARD_SYNC, SYNC_METHODS

CODE = "sync_or_timer"
_SYNC_WORDS = ("stream", "event", "graph", "synchron", "sync_debug", "_sleep")  # in a torch.* path


class SyncOrTimer:
    code = CODE

    def check(self, ctx: Context) -> Iterator[Violation]:
        launcher = ctx.launcher
        for site in ctx.open_sites():
            why = _torch_path(site.path, site.store)
            if why:
                ctx.claim(site)
                yield violation(CODE, site.node, why)
        for s, node in ctx.nodes():
            if isinstance(node, ast.Attribute) and node.attr in SYNC_METHODS:
                path = launcher.resolve(node, s)
                if not (path and path[0] == "kernels"):  # a kernel may be called `record`
                    yield violation(
                        CODE, node, f"uses .{node.attr}; synchronisation and timing belong to the harness"
                    )
        for s in ctx.classification.reachable:
            for node in s.nodes:
                if isinstance(node, ast.Call):
                    yield from _forward_sync(launcher, node, s)


def _torch_path(path: tuple[str, ...], store: bool) -> str | None:
    if path[0] != "torch":
        return None
    dotted = ".".join(path)
    if any(w in c.lower() for c in path[1:] for w in _SYNC_WORDS):
        return (
            f"uses {dotted}; streams, events, graphs and synchronisation belong to the harness that times "
            "the launcher"
        )
    if path[1:2] == ("backends",) and store:
        return f"sets {dotted}, a global backend switch that changes how the reference and timing run"
    return None


def _forward_sync(launcher: Launcher, call: ast.Call, s: Scope) -> Iterator[Violation]:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in FORWARD_SYNC and not launcher.is_value(func.value, s):
        yield violation(
            CODE, call, f"calls .{func.attr}() in forward, which copies to the host and waits for the GPU"
        )
    p = launcher.resolve(func, s)
    to_number = p is not None and (
        (p[0] == "<builtin>" and p[1] in ("int", "float", "bool", "complex")) or p[0] == "numpy"
    )
    if to_number and call.args and launcher.is_tensor(call.args[0], s):
        name = ".".join(p)  # type: ignore[arg-type]
        yield violation(CODE, call, f"calls {name}() on a tensor in forward, which waits for the GPU")


RULE = SyncOrTimer()
