"""What the check returns: violations as records, and the report on one launcher."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.types import Kind


@dataclass(frozen=True)
class Violation:
    """One broken rule; str() is "<code>: line N: <why>", the form the rest of the project reads."""

    code: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"{self.code}: line {self.line}: {self.why}"

    def startswith(self, prefix: str) -> bool:
        """The text's startswith, for callers that match a violation by its text."""
        return str(self).startswith(prefix)


@dataclass(frozen=True)
class LauncherReport:
    ok: bool
    kind: Kind
    library_ops: tuple[str, ...] = ()  # HYBRID: the torch calls forward makes, in evaluation order
    kernels_used: tuple[str, ...] = ()  # names after `kernels.`, first appearance first
    violations: tuple[Violation, ...] = ()

    @property
    def codes(self) -> tuple[str, ...]:
        """The code of each violation, in the same order."""
        return tuple(v.code for v in self.violations)
