"""syntax_error: the source does not parse (then no other rule runs)."""

from __future__ import annotations

import ast
import threading

from pipeline.static_check.report import Violation

CODE = "syntax_error"
# CPython 3.11 builds the Python AST with one process-wide recursion counter: two threads parsing at once
# (the LLM policy checks its proposals in a thread pool) raised "SystemError: AST constructor recursion
# depth mismatch" out of the run. One parse at a time.
_PARSING = threading.Lock()


def parse(source: str) -> ast.Module | Violation:
    try:
        with _PARSING:
            return ast.parse(source)
    except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes in the source
        line = getattr(e, "lineno", None) or 1
        why = getattr(e, "msg", None) or str(e)
        return Violation(CODE, line, f"the launcher does not parse ({why})")
