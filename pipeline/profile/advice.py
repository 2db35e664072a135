"""Stage 2 and its outputs: run the tools that apply to the stage-1 class, then present the findings three
ways: structured JSON, a concise advice block for prompts (worst first, about 300 tokens for all tools
together), or, for ablations, raw metrics only or nothing at all.
"""

from __future__ import annotations

import enum
from typing import Any

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Classification, classify
from pipeline.profile.tools.base import Tool, available, registry
from pipeline.types import Finding, to_dict

ADVICE_TOKENS = 300
_CHARS_PER_TOKEN = 4  # a conservative average for English prose with numbers


class Feedback(enum.StrEnum):
    ADVICE = "advice"
    JSON = "json"
    RAW = "raw"
    NONE = "none"


def analyze(
    ev: Evidence, tools: dict[str, Tool] | None = None, every_class: bool = False
) -> tuple[Classification, list[Finding]]:
    """Stage 1, then the stage-2 tools that apply to its class (all tools with `every_class`)."""
    cls = classify(ev)
    findings: list[Finding] = []
    for tool in (tools or registry()).values():
        if not every_class and cls.bound not in tool.applies_to:
            continue
        if not available(ev, tool.needs):
            continue
        findings.extend(tool.analyze(ev, cls))
    findings.sort(key=lambda f: (-f.severity, f.tool))
    return cls, findings


def advice_block(cls: Classification, findings: list[Finding], max_tokens: int = ADVICE_TOKENS) -> str:
    """Plain-language advice, worst first, cut to a token budget: what the generator reads."""
    budget = max_tokens * _CHARS_PER_TOKEN
    shown = [f for f in findings if f.severity > 0]
    lines = [f"Bottleneck: {cls.summary}."]
    used = len(lines[0])
    for i, f in enumerate(shown):
        line = f"{i + 1}. [{f.tool}] {f.diagnosis} Fix: {f.advice}"
        note = f"(+{len(shown) - i - 1} lower-priority findings omitted)" if i + 1 < len(shown) else ""
        room = budget - used - 1 - (len(note) + 1 if note else 0)  # newlines count; keep room for the note
        if len(line) > room:
            if i == 0:  # the worst finding always appears, cut short if it must be
                lines.append(line[: max(0, room - 3)] + "...")
                used += len(lines[-1]) + 1
                continue
            lines.append(f"(+{len(shown) - i} lower-priority findings omitted)")
            break
        lines.append(line)
        used += len(line) + 1
    if len(lines) == 1:
        lines.append("No problem found beyond the stage-1 position.")
    return "\n".join(lines)


def as_json(cls: Classification, findings: list[Finding]) -> dict[str, Any]:
    return {"classification": to_dict(cls), "findings": [to_dict(f) for f in findings]}


def raw_block(ev: Evidence, limit: int = 60) -> str:
    """The ablation without interpretation: the dominant kernel's metrics as name = value lines."""
    k = ev.dominant()
    if k is None:
        return "no counters"
    from pipeline.profile.collect import curated_metrics

    wanted = curated_metrics()
    items = [(m, k.metrics[m]) for m in wanted if m in k.metrics][:limit]
    return "\n".join([f"kernel {k.name}"] + [f"{name} = {value:g}" for name, value in items])


def feedback(ev: Evidence, mode: Feedback) -> str:
    if mode == Feedback.NONE:
        return ""
    if mode == Feedback.RAW:
        return raw_block(ev)
    cls, findings = analyze(ev)
    if mode == Feedback.JSON:
        import json

        return json.dumps(as_json(cls, findings), indent=2)
    return advice_block(cls, findings)
