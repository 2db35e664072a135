"""try_except: a try statement, or a context manager's __exit__ that could swallow errors."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from pipeline.static_check.report import Violation
from pipeline.static_check.rules.base import Context, violation
from pipeline.static_check.vocab import FUNCS

CODE = "try_except"


class TryExcept:
    code = CODE

    def check(self, ctx: Context) -> Iterator[Violation]:
        for _, node in ctx.nodes():
            if isinstance(node, (ast.Try, ast.TryStar)):
                yield violation(
                    CODE, node, "a try statement: a fallback or a swallowed error would hide a broken kernel"
                )
            elif isinstance(node, FUNCS) and node.name in ("__exit__", "__aexit__"):
                yield violation(
                    CODE, node, f"defines {node.name}, which can swallow exceptions like a try/except"
                )


RULE = TryExcept()
