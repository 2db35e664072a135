"""Static checks on a candidate's launcher: a pure AST analysis; the launcher is never executed.

`check_launcher(source)` returns a `LauncherReport`: the rules the launcher breaks (each a `Violation`,
whose str() reads "<code>: line N: <why>"), the kernels it names, and whether ModelNew.forward computes only
in our kernels (`Kind.CUSTOM`) or also through torch library calls (`Kind.HYBRID`, with those calls in
`library_ops`; see classify.py).

What a launcher may reach is an allow-list (allowlist.py): the modules it may import, the names of each it
may use, the builtins. Violation codes (the rest of the project matches on them, see `CODES`), one rule
module each under rules/:
  syntax_error        the source does not parse
  no_model_new        no top-level `class ModelNew`, or the name ModelNew is bound more than once
  subclass_reference  ModelNew's bases are anything but nn.Module (or it passes a metaclass)
  calls_reference     names Model, get_inputs or get_init_inputs; imports from the task, reference, __main__
  try_except          a try statement, or a context manager's __exit__ that could swallow errors
  sync_or_timer       streams, events, CUDA graphs, synchronisation, torch.backends switches; in forward
                      also .item()/.tolist()/.cpu()/.numpy() and int()/float()/bool() of a tensor
  dynamic_access      builtins off the list (eval, getattr, open, ...); dunder and private attributes;
                      frames and foreign code; the runtime's internals; a module object used as a value
  monkey_patch        sets or deletes an attribute of anything but self or an object the function created;
                      setattr/delattr; `global`; module hooks; torch.set_* and other global torch state
  forbidden_import    imports a module outside the allow-list, or reaches any other module object
  forbidden_name      a path through allowed modules ends on a name not on that module's list
  no_kernel_launch    forward never reaches `kernels`, directly or through a helper it calls
"""

from __future__ import annotations

from functools import lru_cache

from pipeline.static_check.classify import classify
from pipeline.static_check.report import LauncherReport, Violation
from pipeline.static_check.resolver import Launcher
from pipeline.static_check.rules import CODES, RULES, Context, syntax_error
from pipeline.static_check.vocab import RUNTIME_METHODS
from pipeline.types import Kind

__all__ = ["CODES", "RUNTIME_METHODS", "LauncherReport", "Violation", "check_launcher"]


# A pure function of the text, and its report is frozen: a candidate's launcher is checked when the policy
# proposes it and again when it is evaluated (a level-3 launcher takes a tenth of a second or more).
@lru_cache(maxsize=512)
def check_launcher(source: str) -> LauncherReport:
    tree = syntax_error.parse(source)
    if isinstance(tree, Violation):
        return LauncherReport(ok=False, kind=Kind.CUSTOM, violations=(tree,))
    launcher = Launcher(tree)
    classification = classify(launcher)
    ctx = Context(launcher, classification, launcher.sites())
    found = [v for rule in RULES for v in rule.check(ctx)]
    seen: set[tuple[int, str]] = set()
    violations = []
    for v in sorted(found, key=lambda v: v.line):
        if (v.line, v.code) not in seen:  # one report per rule and line is enough to act on
            seen.add((v.line, v.code))
            violations.append(v)
    return LauncherReport(
        ok=not violations,
        kind=classification.kind,
        library_ops=classification.library_ops,
        kernels_used=classification.kernels_used,
        violations=tuple(violations),
    )
