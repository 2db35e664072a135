"""Side by side for the profiling fixtures: Nsight Compute's own guided-analysis rules (recorded/<case>/
rules.txt, from `ncu --set full --page details`) against our top finding. CPU only; reads the recordings.

    python benchmarks/profiling_table.py [--recorded DIR] [--full]

Prints a Markdown table (for docs/profiling.md). ncu's "top" rule is the optimisation hint (OPT) with the
largest estimated speedup on our dominant kernel, as a person reading the report would take it.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.profile.advice import analyze  # noqa: E402
from pipeline.profile.evidence import load_recorded  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "profiling"
_RULE = re.compile(r"^(\s+)(OPT|WRN|INF|ERR)\s{2,}(.*\S)\s*$")
_KERNEL = re.compile(r"^  (\S+) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
_SPEEDUP = re.compile(r"Est\. (?:Global )?Speedup: ([\d.]+)%")  # the kernel-wide estimate
_ANY_SPEEDUP = re.compile(r"Est\. (?:Global |Local )?Speedup: [\d.]+%")
_MEASURED = re.compile(r"\d\.\d|\d%")  # a sentence that reports a measurement, not a definition


@dataclass(frozen=True)
class Rule:
    kernel: str
    kind: str  # OPT, WRN, INF, ERR
    message: str
    speedup: float | None

    @property
    def headline(self) -> str:
        """The first sentence that reports a measurement (rules often open with a definition), and the
        next one when it is short."""
        text = _ANY_SPEEDUP.sub("", self.message).strip()
        sentences = [t.strip() for t in re.split(r"(?<=[a-z0-9)][.!?])\s*(?=[A-Z])", text) if t.strip()]
        if not sentences:
            return ""
        i = next((n for n, t in enumerate(sentences) if _MEASURED.search(t)), 0)
        head = sentences[i]
        if i > 0 and (re.search(r"\d", sentences[i - 1]) or "access pattern" in sentences[i - 1]):
            head = sentences[i - 1] + " " + head  # what the number is about (loads of which kind, waves)
        elif len(head) < 90 and i + 1 < len(sentences) and _MEASURED.search(sentences[i + 1]):
            head += " " + sentences[i + 1]
        return head


def parse_rules(text: str) -> list[Rule]:
    """Rule results from ncu's text report: a typed first line, then lines indented under its message."""
    rules: list[Rule] = []
    kernel = ""
    current: tuple[str, str, list[str], int] | None = None  # kernel, kind, lines, message column

    def close() -> None:
        nonlocal current
        if current:
            k, kind, lines, _ = current
            msg = " ".join(" ".join(lines).split())
            m = _SPEEDUP.search(msg)
            rules.append(Rule(k, kind, msg, float(m.group(1)) if m else None))
        current = None

    for line in text.splitlines():
        km = _KERNEL.match(line)
        if km:
            close()
            kernel = km.group(1)
            continue
        rm = _RULE.match(line)
        if rm:
            close()
            column = line.index(rm.group(3))
            current = (kernel, rm.group(2), [rm.group(3)], column)
            continue
        if current and line.strip() and len(line) - len(line.lstrip()) >= current[3] and "----" not in line:
            current[2].append(line.strip())
            continue
        close()
    close()
    return rules


def top_rule(rules: list[Rule], kernels: set[str]) -> Rule | None:
    ours = [r for r in rules if r.kernel in kernels] or rules
    opts = [r for r in ours if r.kind == "OPT"] or [r for r in ours if r.kind == "WRN"]
    if not opts:
        return None
    return max(opts, key=lambda r: (r.speedup or 0.0, -opts.index(r)))


def rows(recorded: Path) -> list[tuple[str, str, str, str, str]]:
    out = []
    for case_dir in sorted(p for p in recorded.iterdir() if (p / "eval.json").is_file()):
        case = case_dir.name
        expect = tomllib.loads((FIXTURES / "kernels" / case / "expect.toml").read_text())
        ev = load_recorded(case_dir)
        _, findings = analyze(ev)
        rules_path = case_dir / "rules.txt"
        rule = top_rule(parse_rules(rules_path.read_text()), set(ev.ours)) if rules_path.exists() else None
        ncu = "(no rule fired)" if rule is None else rule.headline
        if rule is not None and rule.speedup is not None:
            ncu += f" [est. speedup {rule.speedup:.0f}%]"
        top = findings[0] if findings and findings[0].severity > 0 else None
        ours = "(nothing above severity 0)" if top is None else f"{top.diagnosis} Fix: {top.advice}"
        tool = "-" if top is None else f"{top.tool} {top.severity:.2f}"
        out.append((case, expect.get("top_tool") or "(good)", ncu, tool, ours))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recorded", type=Path, default=FIXTURES / "recorded")
    ap.add_argument("--full", action="store_true", help="print every ncu rule per case as well")
    args = ap.parse_args()
    print("| case | expected | Nsight Compute's top rule | our top tool | our diagnosis and fix |")
    print("|---|---|---|---|---|")
    for case, expected, ncu, tool, ours in rows(args.recorded):
        cells = [c.replace("|", "\\|") for c in (case, expected, ncu, tool, ours)]
        print("| " + " | ".join(cells) + " |")
    if args.full:
        for case_dir in sorted(p for p in args.recorded.iterdir() if (p / "rules.txt").is_file()):
            print(f"\n## {case_dir.name}")
            for r in parse_rules((case_dir / "rules.txt").read_text()):
                print(f"- {r.kernel} {r.kind} {r.speedup}: {r.headline}")


if __name__ == "__main__":
    main()
