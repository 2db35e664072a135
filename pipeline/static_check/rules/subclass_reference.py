"""subclass_reference: ModelNew's bases are anything but nn.Module (or it passes a metaclass)."""

from __future__ import annotations

from collections.abc import Iterator

from pipeline.static_check.classify import model_new
from pipeline.static_check.report import Violation
from pipeline.static_check.rules.base import Context, violation
from pipeline.static_check.vocab import MODULE_BASES, short

CODE = "subclass_reference"


class SubclassReference:
    code = CODE

    def check(self, ctx: Context) -> Iterator[Violation]:
        cls = model_new(ctx.launcher.tree)
        if cls is None:
            return
        if not cls.bases:
            yield violation(CODE, cls, "ModelNew has no base class; it must subclass nn.Module")
        for base in cls.bases:
            if ctx.launcher.resolve(base, ctx.launcher.module) not in MODULE_BASES:
                yield violation(
                    CODE,
                    base,
                    f"ModelNew subclasses {short(base)}; it must subclass nn.Module directly and compute "
                    "the result itself",
                )
        for kw in cls.keywords:
            yield violation(
                CODE,
                kw,
                f"ModelNew's class statement passes {kw.arg}=; it must be a plain nn.Module subclass",
            )


RULE = SubclassReference()
