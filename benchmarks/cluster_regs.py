"""A long row's cluster segments in registers or in shared memory, measured through the harness on the GPU.

    python benchmarks/cluster_regs.py --out DIR TASK.py [TASK.py ...] [--repeat 2]

For each task (a two-pass row op whose rows one block cannot cache: KernelBench level 1's InstanceNorm,
L1Norm, L2Norm) candidates of the same lowering: the expert's tuned plan, the cluster's blocks holding their
segments in registers (templates/rowwise.py, `_cluster_regs_body`) at 256, 512 and 1024 threads where they
fit, and the segment cached in shared memory by 1024 threads with 8 loads in flight (regs 0). All are
verified and timed against eager (L2 flushed, median of the harness's trials) `--repeat` times in separate
passes, so a difference is believed only when the passes agree. Writes DIR/results.json as it goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness_forms import compare  # noqa: E402  (beside this script)

from pipeline.candidates import make_candidate  # noqa: E402
from pipeline.generate.base import Context  # noqa: E402
from pipeline.generate.expert import ExpertPolicy  # noqa: E402
from pipeline.generate.expert.families.rowwise import CLUSTER_UNROLL, RowPlan, regs_for  # noqa: E402
from pipeline.generate.expert.plan import Plan, plan_of  # noqa: E402
from pipeline.generate.expert.policy import analyse  # noqa: E402
from pipeline.generate.expert.render import nvcc_flags, render  # noqa: E402
from pipeline.tasks import probe  # noqa: E402


def candidates(path: Path) -> list[tuple[str, object]]:
    """The tuned candidate, the same cluster with its segments in registers at each block size they fit,
    and the shared-memory plan."""
    task = probe(path)
    tuned = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)[1].candidate
    plan = plan_of(tuned.source)
    low, why = analyse(path)
    if low is None:
        raise SystemExit(f"{path}: {why}")
    region = {r.rid: r for r in low.regions}

    def variant(label: str, in_regs: bool, **knobs: int) -> tuple[str, object] | None:
        rps = []
        for rp in plan.regions:
            if isinstance(rp, RowPlan) and rp.cluster:
                rp = dataclasses.replace(rp, **knobs, regs=0)
                if in_regs:
                    regs = regs_for(rp, region[rp.rid], low)
                    if not regs:
                        return None  # the segment does not fit this block's registers
                    rp = dataclasses.replace(rp, regs=regs)
            rps.append(rp)
        p = Plan(tuple(rps))
        source, launcher = render(low, p)
        return label, make_candidate(task.id, source, launcher, nvcc_flags(p), parent=None, edit=label)

    forms = [("tuned", tuned)]
    forms += [v for t in (256, 512, 1024) if (v := variant(f"registers, {t} threads", True, threads=t))]
    forms.append(variant("shared", False, threads=1024, unroll=CLUSTER_UNROLL))
    return [f for i, f in enumerate(forms) if i == 0 or f[1].key != tuned.key]  # the tuned one once


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("tasks", type=Path, nargs="+")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    def note(row: dict, r) -> None:
        res = r.build.resources if r.build else ()
        row["kernels"] = [(x.name, x.registers, x.spill_stores) for x in res if "_cluster" in x.name]

    def describe(row: dict, c) -> None:
        row["plan"] = c.source.splitlines()[0]

    compare(args.out, args.tasks, args.repeat, candidates, 50, 2.0, note, describe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
