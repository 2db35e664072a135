"""no_model_new: no top-level `class ModelNew`, or the name ModelNew is bound more than once."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from pipeline.static_check.classify import model_new
from pipeline.static_check.report import Violation
from pipeline.static_check.rules.base import Context, violation
from pipeline.static_check.vocab import FUNCS

CODE = "no_model_new"


class NoModelNew:
    code = CODE

    def check(self, ctx: Context) -> Iterator[Violation]:
        launcher = ctx.launcher
        cls = model_new(launcher.tree)
        if cls is None:
            yield violation(CODE, launcher.tree, "the launcher defines no top-level class ModelNew")
            return
        bindings = [n for n, _, _ in launcher.module.bindings if n == "ModelNew"]
        bindings += [n for n in launcher.imports if n == "ModelNew"]
        bindings += [
            n.name
            for n in launcher.module.nodes
            if isinstance(n, (*FUNCS, ast.ClassDef)) and n.name == "ModelNew"
        ]
        if len(bindings) > 1:
            yield violation(
                CODE, cls, f"the name ModelNew is bound {len(bindings)} times; define it once, as a class"
            )


RULE = NoModelNew()
