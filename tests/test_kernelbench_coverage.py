"""Every KernelBench task beside the repository (../shared/kernelbench: 218 tasks, levels 1-3) through the
expert: it writes a launcher that parses and passes the static check (for its plain plan and its tuned
one), or it says in one line why it cannot, and never raises. One task of each kind of kernel mix compiles for sm_90a with real nvcc.

The refusals are listed here, each with its reason: a task that stops being written fails this test, and
so does one that starts being written (update the list, and the coverage figure in docs/benchmarks.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pipeline import selfcheck
from pipeline.compile import ToolchainError, compile_candidates, find_nvcc
from pipeline.config import Config
from pipeline.generate.base import Context, ProposalStatus
from pipeline.generate.expert import ExpertPolicy, supports
from pipeline.generate.expert.policy import TUNED_BROKEN
from pipeline.static_check import check_launcher
from pipeline.tasks import probe
from pipeline.types import Status

ROOT = Path(__file__).resolve().parent.parent
KERNELBENCH = ROOT.parent / "shared" / "kernelbench"
TASKS = selfcheck.task_files([KERNELBENCH]) if KERNELBENCH.is_dir() else []
needs_kb = pytest.mark.skipif(not TASKS, reason="../shared/kernelbench is not beside the repository")

try:
    find_nvcc(Config())
    HAVE_NVCC = True
except ToolchainError:
    HAVE_NVCC = False

# What the expert cannot write, and the start of the reason it gives. Anything else refused is a bug.
NOT_READ = "the expert cannot read this reference"
NOTHING_OURS = "nothing for our kernels to compute"
REFUSED = {
    "level3/33_VanillaRNN": NOT_READ,  # hidden state held as a plain tensor attribute
    "level3/36_LSTMHn": NOTHING_OURS,  # the recurrence is cuDNN's; nothing after it
    "level3/37_LSTMCn": NOTHING_OURS,
    "level3/39_GRU": NOTHING_OURS,
    "level3/40_GRUHidden": NOTHING_OURS,
    "level3/41_GRUBidirectional": NOTHING_OURS,
    "level3/42_GRUBidirectionalHidden": NOTHING_OURS,
}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, tuple[bool, str]]:
    """supports() of every task, once, in a process a core."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(4, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        return dict(zip((selfcheck.task_key(p) for p in TASKS), ex.map(supports, TASKS), strict=True))


@needs_kb
@pytest.mark.slow
def test_every_task_gets_a_launcher_that_passes_the_static_check_or_one_line_why_not(verdicts):
    assert len(verdicts) == 218
    wrong = {}
    for key, (ok, why) in verdicts.items():
        if not why or "\n" in why:
            wrong[key] = f"the reason is not one line: {why!r}"
        elif TUNED_BROKEN in why:  # the tuned plan's launcher, rendered and checked by supports() too
            wrong[key] = why
        elif ok == (key in REFUSED):
            wrong[key] = f"{'written' if ok else 'refused'} against the list: {why}"
        elif not ok and not why.startswith(REFUSED[key]):
            wrong[key] = f"refused for another reason than listed: {why}"
    assert not wrong, wrong
    level1 = [k for k in verdicts if k.startswith("level1/")]
    written = [k for k in level1 if verdicts[k][0]]
    assert len(level1) == 86 and len(written) / len(level1) >= 0.95  # issue 15's coverage target


def _mix(why: str) -> str:
    """The kinds of region a written task's kernels hold, as supports() sums them up: "ew, reduce"."""
    m = re.search(r"in our kernels \(([^)]*)\)", why)
    assert m, why
    return ", ".join(sorted(m.group(1).split(", ")))


@needs_kb
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_NVCC, reason="no nvcc on this machine")
def test_one_task_of_each_kernel_mix_compiles_for_sm_90a(verdicts, tmp_path):
    firsts: dict[str, Path] = {}
    for path in TASKS:
        ok, why = verdicts[selfcheck.task_key(path)]
        if ok:
            firsts.setdefault(_mix(why), path)
    assert len(firsts) >= 15  # element-wise, reductions, norms, softmax, scans, pools, library, mixes
    policy, cands = ExpertPolicy(), []
    for path in firsts.values():
        task = probe(path)
        (first, *_) = policy.propose(Context(task=task, reference=task.source, parent=None), 1)
        assert first.status == ProposalStatus.OK, (path.name, first.reason)
        report = check_launcher(first.candidate.launcher)
        assert report.ok, (path.name, report.violations)
        cands.append((path.name, first.candidate))
    builds = compile_candidates([c for _, c in cands], Config(home=tmp_path, arch="sm_90a"))
    bad = [(name, b.status, b.log[-500:]) for (name, _), b in zip(cands, builds, strict=True)
           if b.status != Status.OK]  # fmt: skip
    assert not bad, bad
