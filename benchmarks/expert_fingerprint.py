"""Fingerprint every proposal the expert policy makes, to show a refactor of it changes no candidate.

For the built-in tasks, the GPU tests' tasks (tests/test_gpu_expert.py's families at every shape, and
tests/fixtures/tasks/*.py), the CPU tests' family cases (tests/test_expert.py) and the GEMM tests' tasks
(tests/test_gemm.py) it walks: `supports`, all first proposals, all children of each, all grandchildren of the
first children of the plain and tuned plans, a repair of each of those, the children under findings that
suggest edits (applicable or not), and the first proposals before Hopper. Each proposal is recorded as
status, edit, candidate key (hash of source, launcher and flags), reason, notes and building blocks.

    python benchmarks/expert_fingerprint.py --write before.json    # before the change
    python benchmarks/expert_fingerprint.py --compare before.json  # after: counts and lists the differences

A repair that raised before (recorded as "raised") and now answers counts apart: that is a fix.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from pipeline.generate.base import Context, Outcome, Proposal  # noqa: E402
from pipeline.generate.expert.policy import ExpertPolicy, supports  # noqa: E402
from pipeline.tasks import probe  # noqa: E402
from pipeline.types import Finding  # noqa: E402

SUGGESTED = (
    ("use_tensor_cores", "tile_shared_memory", "fix_bank_conflicts"),
    ("use_wgmma", "fuse_epilogue", "pipeline_loads", "lower_power"),
    ("reduce_registers", "coalesce_accesses", "more_parallelism"),
)


def task_paths(folder: Path) -> dict[str, Path]:
    """Every task the expert's tests walk, by a stable name."""
    import test_expert
    import test_gemm
    import test_gpu_expert

    out = {f"builtin/{p.stem}": p for p in sorted((ROOT / "tasks").glob("*.py"))}
    out |= {f"fixture/{p.stem}": p for p in sorted((ROOT / "tests" / "fixtures" / "tasks").glob("*.py"))}
    gpu = folder / "gpu"
    gpu.mkdir()
    for name in test_gpu_expert.FAMILIES:
        for shape in test_gpu_expert.SHAPES[name]:
            path = test_gpu_expert.family_task(gpu, name, shape)
            out[f"gpu/{path.stem}"] = path
    cpu = folder / "cpu"
    cpu.mkdir()
    for name, (body, inputs, init, _) in test_expert.CASES.items():
        out[f"cpu/{name}"] = test_expert.task_file(cpu, name, body, inputs, init)
    g = folder / "gemm"
    g.mkdir()
    out["gemm/linear_epi"] = test_gemm.linear(g, "epi", expr="torch.relu(self.linear(x)) * self.s + 0.5")
    out["gemm/linear_fp32"] = test_gemm.linear(g, "fp32", dt="float32")
    out["gemm/linear_odd_k"] = test_gemm.linear(g, "odd_k", k=1001)
    out["gemm/lone16"] = test_gemm.linear(g, "lone16", bias=False, dt="float16", k=1024, n=1000)
    out["gemm/tanh_bf16"] = test_gemm.linear(g, "tanh_bf16", expr="torch.tanh(self.linear(x)) * self.s")
    out["gemm/tanh_fp32"] = test_gemm.linear(g, "tanh_fp32", expr="torch.tanh(self.linear(x)).float()")
    out["gemm/bmm"] = test_gemm.product(
        g, "bmm", (4, 300, 256), (4, 256, 136), "torch.relu(torch.bmm(a, b)) * 2 + c[0]", [(4, 300, 1)]
    )
    for name, (a, b, expr) in {
        "matmul": ((5, 3, 64), (64, 24), "torch.matmul(a, b)"),
        "mm": ((5, 64), (64, 24), "torch.mm(a, b) * 2"),
        "batched4d": ((2, 3, 5, 64), (2, 3, 64, 24), "torch.relu(a @ b)"),
        "linear_fn": ((5, 64), (24, 64), "F.linear(a, b) + 1"),
        "odd_n": ((5, 64), (64, 25), "torch.mm(a, b) + 1"),
        "broadcast": ((5, 64), (4, 64, 24), "torch.matmul(a, b) + 1"),
    }.items():
        out[f"gemm/{name}"] = test_gemm.product(g, name, a, b, expr)
    return out


def record(p: Proposal) -> dict:
    c = p.candidate
    return {
        "status": str(p.status),
        "edit": p.edit,
        "key": c.key if c else None,
        "reason": p.reason,
        "notes": list(p.notes),
        "blocks": list(c.blocks) if c else [],
        "flags": list(c.flags) if c else [],
        "parent": c.parent if c else None,
    }


def repaired(policy: ExpertPolicy, ctx: Context, failed) -> dict:
    try:
        return record(policy.repair(ctx, failed, Outcome(failed.key, "mismatch")))
    except Exception as e:  # a policy must not raise: recorded so that a fix shows up as a difference
        return {"raised": f"{type(e).__name__}: {e}"}


def walk(path: Path) -> dict:
    task = probe(path)
    policy = ExpertPolicy()

    def ctx(parent=None, **kw) -> Context:
        return Context(task=task, reference=task.source, parent=parent, **kw)

    out: dict = {"supports": list(supports(path))}
    first = policy.propose(ctx(), 64)
    out["first"] = [record(p) for p in first]
    out["sm_80"] = [record(p) for p in policy.propose(ctx(arch="sm_80"), 64)]
    ok = [p.candidate for p in first if p.candidate is not None]
    out["children"], out["repairs"], out["suggested"] = {}, {}, {}
    for i, parent in enumerate(ok):
        kids = policy.propose(ctx(parent), 64)
        out["children"][parent.key] = [record(k) for k in kids]
        out["repairs"][parent.key] = repaired(policy, ctx(), parent)
        if i >= 2:
            continue
        for j, edits in enumerate(SUGGESTED):
            finding = Finding("tool", 0.5, {}, "d", "a", edits=edits)
            got = policy.propose(ctx(parent, findings=(finding,)), 3)
            out["suggested"][f"{parent.key}/{j}"] = [record(k) for k in got]
        for kid in [k.candidate for k in kids if k.candidate is not None][:3]:
            grand = policy.propose(ctx(kid), 64)
            out["children"][kid.key] = [record(g) for g in grand]
            out["repairs"][kid.key] = repaired(policy, ctx(parent), kid)
    return out


def fingerprint() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return {name: walk(path) for name, path in task_paths(Path(tmp)).items()}


def count(fp: dict) -> int:
    n = 0
    for t in fp.values():
        n += len(t["first"]) + len(t["sm_80"]) + len(t["repairs"])
        n += sum(len(v) for v in t["children"].values()) + sum(len(v) for v in t["suggested"].values())
    return n


def differences(a: dict, b: dict, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}/{k}: only before" for k in a if k not in b]
        out += [f"{where}/{k}: only after" for k in b if k not in a]
        for k in a:
            if k in b:
                out += differences(a[k], b[k], f"{where}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} -> {b!r}"]


def fixed_repairs(before: dict, after: dict) -> list[str]:
    """Repairs that raised before and answer now."""
    return [
        f"/{task}/repairs/{key}"
        for task, t in before.items()
        for key, r in t["repairs"].items()
        if "raised" in r and "raised" not in after.get(task, {}).get("repairs", {}).get(key, {"raised": ""})
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path)
    group.add_argument("--compare", type=Path)
    ap.add_argument("--save", type=Path, help="with --compare: also write this run's fingerprint here")
    args = ap.parse_args()
    t0 = time.time()
    fp = fingerprint()
    print(f"{len(fp)} tasks, {count(fp)} proposals in {time.time() - t0:.0f} s", file=sys.stderr)
    if args.write or args.save:
        (args.write or args.save).write_text(json.dumps(fp, indent=1, sort_keys=True) + "\n")
    if args.write:
        return 0
    before = json.loads(args.compare.read_text())
    fixed = fixed_repairs(before, fp)
    diff = [d for d in differences(before, fp) if not any(d.startswith(f + "/") for f in fixed)]
    kinds: dict[str, int] = {}
    for d in diff:
        field = d.split(":", 1)[0].rsplit("/", 1)[-1].split("[", 1)[0]
        kinds[field] = kinds.get(field, 0) + 1
    print(f"repairs that raised before and answer now: {len(fixed)}")
    print(f"other differences by field: {kinds}")
    for d in diff[:50]:
        print(d)
    print(
        f"{len(diff)} differences over {count(before)} proposals before, {count(fp)} after ({len(fp)} tasks)"
    )
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
