"""forbidden_import: imports a module outside the allow-list, or reaches any module object the allow-list
does not name through an attribute path (torch.cuda.os, typing.sys, torch.utils, numpy.random, ...)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from pipeline.static_check import allowlist
from pipeline.static_check.report import Violation
from pipeline.static_check.rules.base import Context, violation
from pipeline.static_check.rules.calls_reference import is_reference_module
from pipeline.static_check.vocab import REFERENCE_NAMES

CODE = "forbidden_import"


class ForbiddenImport:
    code = CODE

    def check(self, ctx: Context) -> Iterator[Violation]:
        for _, node in ctx.nodes():
            if isinstance(node, ast.Import):
                for a in node.names:
                    yield from _module(a.name, node)
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if not node.level:
                    yield from _module(mod, node)
                elif not (is_reference_module(mod) or any(a.name in REFERENCE_NAMES for a in node.names)):
                    where = "." * node.level + mod
                    yield violation(
                        CODE,
                        node,
                        f"a relative import (from {where}); allowed are only {allowlist.IMPORTABLE_TEXT}",
                    )
        for site in ctx.open_sites():
            reach = allowlist.judge(site.path[:-1] if site.store else site.path)
            if reach is not None and reach.what == "module":
                ctx.claim(site)
                yield violation(
                    CODE,
                    site.node,
                    f"reaches {reach.dotted}, a module outside the allow-list; a launcher may use only "
                    f"{allowlist.IMPORTABLE_TEXT} (and a few torch.cuda queries)",
                )


def _module(name: str, node: ast.AST) -> Iterator[Violation]:
    if not is_reference_module(name) and name not in allowlist.IMPORTABLE:  # else calls_reference
        yield violation(CODE, node, f"imports {name}; a launcher may import only {allowlist.IMPORTABLE_TEXT}")


RULE = ForbiddenImport()
