"""Which kernel an ungrouped convolution should go to: the implicit GEMM (3xTF32 on the tensor cores) or the
direct kernel (CUDA cores, a thread's outputs over several output channels), measured on the same task
files through the harness (verify, then time against eager with the L2 flushed), on the GPU.

    python benchmarks/conv_routes.py --out DIR TASK.py [TASK.py ...] [--repeat 2]

For each task the expert's first proposals are generated twice: once with every ungrouped convolution
routed to the implicit GEMM, once with every one routed to the direct kernel (templates/conv_tf32.py's
routing bounds, LIMITS below, set here for the generation only; the candidates are ordinary sources); the
direct route adds the tuned plan with the other loop order. Each
proposal that puts the convolution in the route's kernel is evaluated `--repeat` times, in separate passes,
so a difference is believed only when both agree. Writes DIR/results.json as it goes.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness_forms import compare, parser  # noqa: E402  (beside this script)

from pipeline.generate.base import Context, ProposalStatus  # noqa: E402
from pipeline.generate.expert import ExpertPolicy  # noqa: E402
from pipeline.generate.expert.plan import plan_of  # noqa: E402
from pipeline.generate.expert.templates import conv_tf32  # noqa: E402
from pipeline.tasks import probe  # noqa: E402

BIG = 1 << 30
# route -> (the plan entry's family, then LIMITS' values while its proposals are made)
ROUTES = {"gemm": ("wgmma_conv_3xtf32", 0, 0, 0, 0, 0), "direct": ("direct_conv", BIG, BIG, BIG, BIG, BIG)}
LIMITS = ("NARROW_COUT", "NARROW_K", "NARROW_K_TAPS", "NARROW_PRODUCTS", "SPARSE_PRODUCTS")


def candidates(path: Path, route: str, n: int) -> list:
    """The first proposals (plain, tuned, the tuned one's edits) whose plan has the route's kernel, and for
    the direct kernel the tuned plan's other loop order (its pipeline_loads edit: input channels
    innermost or outermost), so both orders are timed on the same task."""
    tag, *limits = ROUTES[route]
    saved = [getattr(conv_tf32, name) for name in LIMITS]
    for name, value in zip(LIMITS, limits, strict=True):
        setattr(conv_tf32, name, value)
    try:
        task = probe(path)
        policy = ExpertPolicy()
        props = policy.propose(Context(task=task, reference=task.source, parent=None), n)
        tuned = next(
            (p.candidate for p in props if p.status == ProposalStatus.OK and "tuned" in p.edit), None
        )
        if route == "direct" and tuned is not None:
            kids = policy.propose(Context(task=task, reference=task.source, parent=tuned), 12)
            props += [k for k in kids if "ci_inner=" in k.edit][:1]
    finally:
        for name, value in zip(LIMITS, saved, strict=True):
            setattr(conv_tf32, name, value)
    return [
        p.candidate
        for p in props
        if p.status == ProposalStatus.OK and any(tag == rp.TAG for rp in plan_of(p.candidate.source).regions)
    ]


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--proposals", type=int, default=4, help="first proposals generated a route")
    ap.add_argument("--routes", default=",".join(ROUTES), help="comma-separated, of: " + ", ".join(ROUTES))
    args = ap.parse_args()
    routes = [x for x in args.routes.split(",") if x in ROUTES]

    def note(row: dict, r) -> None:
        res = r.build.resources if r.build else ()
        row["registers"] = [x.registers for x in res if x.name.endswith(("_dconv", "_conv"))]

    def describe(row: dict, c) -> None:
        row.update(route=row["form"], edit=c.edit, plan=c.source.splitlines()[0])

    def forms_of(path: Path) -> list:
        return [(route, c) for route in routes for c in candidates(path, route, args.proposals)]

    results = compare(args.out, args.tasks, args.repeat, forms_of, 50, 2.0, note, describe)
    for task, rows in results.items():  # each route's best
        best = {route: min((min(r["ours_ms"]) for r in rows if r["route"] == route and r["ours_ms"]), default=None)
                for route in routes}  # fmt: skip
        print(f"{task}: best {best}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
