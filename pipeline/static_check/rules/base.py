"""The rule interface and what every rule reads.

A rule is one module under rules/ that declares its violation code and checks a parsed launcher for it
(`check(ctx)` yields Violations). Reach sites (the places the launcher reaches into a module) go to the
rules in order and the first rule that claims a site reports it, so a site gets its most telling code:
torch.cuda._sleep is a sync, not a private name; torch._C is private before it is a forbidden module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from pipeline.static_check.classify import Classification
from pipeline.static_check.report import Violation
from pipeline.static_check.resolver import Launcher, Site
from pipeline.static_check.scopes import Scope


@runtime_checkable
class Rule(Protocol):
    code: ClassVar[str]

    def check(self, ctx: Context) -> Iterable[Violation]: ...


@dataclass
class Context:
    launcher: Launcher
    classification: Classification
    sites: list[Site]
    _claimed: set[int] = field(default_factory=set)

    def open_sites(self) -> Iterator[Site]:
        """The reach sites no earlier rule has claimed."""
        return (site for site in self.sites if id(site) not in self._claimed)

    def claim(self, site: Site) -> None:
        self._claimed.add(id(site))

    def nodes(self) -> Iterator[tuple[Scope, ast.AST]]:
        """Every node of the launcher with the scope it belongs to."""
        for s in self.launcher.scopes:
            for node in s.nodes:
                yield s, node


def violation(code: str, node: ast.AST, why: str) -> Violation:
    return Violation(code, getattr(node, "lineno", 1), why)
