"""syntax_error: the source does not parse (then no other rule runs)."""

from __future__ import annotations

import ast

from pipeline.static_check.report import Violation

CODE = "syntax_error"


def parse(source: str) -> ast.Module | Violation:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes in the source
        line = getattr(e, "lineno", None) or 1
        why = getattr(e, "msg", None) or str(e)
        return Violation(CODE, line, f"the launcher does not parse ({why})")
