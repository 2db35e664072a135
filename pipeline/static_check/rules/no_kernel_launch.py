"""no_kernel_launch: forward never reaches `kernels`, directly or through a helper it calls."""

from __future__ import annotations

from collections.abc import Iterator

from pipeline.static_check.classify import model_new, reaches_kernels
from pipeline.static_check.report import Violation
from pipeline.static_check.rules.base import Context, violation

CODE = "no_kernel_launch"


class NoKernelLaunch:
    code = CODE

    def check(self, ctx: Context) -> Iterator[Violation]:
        cls = model_new(ctx.launcher.tree)
        forward = ctx.classification.forward
        if cls is None:
            return  # no_model_new says so
        if forward is None:
            yield violation(CODE, cls, "ModelNew defines no forward, so it launches no kernel")
        elif not any(reaches_kernels(ctx.launcher, s) for s in ctx.classification.reachable):
            yield violation(
                CODE,
                forward.root,
                "ModelNew.forward never uses `kernels`, directly or through a helper it calls; a candidate "
                "must launch its own kernels",
            )


RULE = NoKernelLaunch()
