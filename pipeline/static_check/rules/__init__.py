"""The launcher rules, one module each. The order matters for reach sites: the first rule that claims a
site reports it (see base.py), so the more specific reasons come first."""

from __future__ import annotations

from pipeline.static_check.rules import (
    calls_reference,
    dynamic_access,
    forbidden_import,
    forbidden_name,
    monkey_patch,
    no_kernel_launch,
    no_model_new,
    subclass_reference,
    sync_or_timer,
    syntax_error,
    try_except,
)
from pipeline.static_check.rules.base import Context, Rule

RULES: tuple[Rule, ...] = (
    no_model_new.RULE,
    subclass_reference.RULE,
    calls_reference.RULE,
    try_except.RULE,
    sync_or_timer.RULE,  # claims before dynamic_access: torch.cuda._sleep is a sync
    dynamic_access.RULE,  # claims before forbidden_import: torch._C is private first
    monkey_patch.RULE,  # claims before forbidden_name: torch.set_* changes global state
    forbidden_import.RULE,
    forbidden_name.RULE,
    no_kernel_launch.RULE,
)

CODES: tuple[str, ...] = (syntax_error.CODE, *(r.code for r in RULES))  # every code a report may hold

__all__ = ["CODES", "RULES", "Context", "Rule", "syntax_error"]
