"""forbidden_name: an attribute path through allowed modules ends on a name that is not on that module's
allow-list (torch.load, torch.from_file, numpy.save, typing.get_type_hints, torch.cuda.empty_cache, ...)."""

from __future__ import annotations

from collections.abc import Iterator

from pipeline.static_check import allowlist
from pipeline.static_check.report import Violation
from pipeline.static_check.rules.base import Context, violation

CODE = "forbidden_name"


class ForbiddenName:
    code = CODE

    def check(self, ctx: Context) -> Iterator[Violation]:
        for site in ctx.open_sites():
            reach = allowlist.judge(site.path[:-1] if site.store else site.path)
            if reach is not None and reach.what == "name":
                ctx.claim(site)
                module = ".".join(reach.upto[:-1])
                yield violation(
                    CODE,
                    site.node,
                    f"uses {reach.dotted}, which is not on the list of {module} names a launcher may use "
                    "(tensor ops, factories, dtypes and a few helpers)",
                )


RULE = ForbiddenName()
