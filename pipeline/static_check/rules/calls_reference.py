"""calls_reference: names Model, get_inputs or get_init_inputs; imports from the task, reference, __main__."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from pipeline.static_check.classify import model_new
from pipeline.static_check.report import Violation
from pipeline.static_check.rules.base import Context, violation
from pipeline.static_check.vocab import REFERENCE_MODULES, REFERENCE_NAMES

CODE = "calls_reference"


def is_reference_module(name: str) -> bool:
    return name.split(".")[0] in REFERENCE_MODULES


class CallsReference:
    code = CODE

    def check(self, ctx: Context) -> Iterator[Violation]:
        cls = model_new(ctx.launcher.tree)
        in_bases = {
            id(n) for base in (cls.bases if cls else []) for n in ast.walk(base)
        }  # subclass_reference's
        for _, node in ctx.nodes():
            if isinstance(node, ast.Import):
                for a in node.names:
                    if is_reference_module(a.name):
                        yield _imports_reference(node, a.name)
            elif isinstance(node, ast.ImportFrom):
                yield from self._import_from(node)
            elif isinstance(node, ast.Name) and node.id in REFERENCE_NAMES and id(node) not in in_bases:
                yield violation(
                    CODE,
                    node,
                    f"names {node.id}, part of the task's reference; a candidate must compute the result itself",
                )

    @staticmethod
    def _import_from(node: ast.ImportFrom) -> Iterator[Violation]:
        mod = node.module or ""
        if node.level:
            if is_reference_module(mod) or any(a.name in REFERENCE_NAMES for a in node.names):
                where = "." * node.level + mod
                yield violation(CODE, node, f"imports from the relative module {where}, the task's reference")
            return
        if is_reference_module(mod):
            yield _imports_reference(node, mod)
        for a in node.names:
            if a.name in REFERENCE_NAMES:
                yield violation(CODE, node, f"imports {a.name}, a name of the task's reference")


def _imports_reference(node: ast.AST, name: str) -> Violation:
    return violation(
        CODE,
        node,
        f"imports from {name}, where the task's reference lives; a candidate must compute the result itself",
    )


RULE = CallsReference()
