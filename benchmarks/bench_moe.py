"""MoE expert projections (tasks/moe/) on a GPU: our grouped GEMM candidates through the harness (verified, timed
against the per-expert loop in the same worker run), then the libraries on the same shapes and routings:
torch._grouped_mm (with torch's SwiGLU after it for fc1) and VeOmni's Triton group GEMM where the package
imports. Fresh inputs and routing each call, L2 flushed, CUDA events, median of many (pipeline.timing).

    python benchmarks/bench_moe.py --out DIR [--tasks qwen3_fc1,qwen3_fc2] [--repeat 2] [--compile]

A whole block (`--tasks qwen3_block`) computes its routing itself: no library takes its inputs as they are,
so eager and torch.compile of the reference (`--compile`) are its baselines.

Writes DIR/results.json (one entry per task, rewritten after each) and prints a line per task.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import stages  # noqa: E402
from pipeline.config import load  # noqa: E402
from pipeline.generate.base import Context, ProposalStatus  # noqa: E402
from pipeline.generate.expert import ExpertPolicy, supports  # noqa: E402
from pipeline.generate.expert.plan import plan_of  # noqa: E402
from pipeline.tasks import load_module, probe  # noqa: E402
from pipeline.types import Status, speedup  # noqa: E402
from pipeline.verify import make_inputs  # noqa: E402

TASKS = sorted(p.stem for p in (ROOT / "tasks" / "moe").glob("*_fc*.py"))  # the grouped GEMMs


def candidates(path: Path) -> list:
    """Our grouped kernel (the tuned plan) and its children with another tile or ring depth; and, of it and of
    its 256-wide child, the children with weight tiles multicast to a cluster of two (multicast_loads), with
    stores direct from the accumulators (coalesce_accesses) and with ping-pong consumers (overlap_epilogue)."""
    task = probe(path)
    policy = ExpertPolicy()
    first = policy.propose(Context(task=task, reference=task.source, parent=None), 2)
    ours = [
        p.candidate for p in first if p.candidate and "wgmma_grouped" in p.candidate.source.splitlines()[0]
    ]
    if not ours:
        return []
    kids = policy.propose(Context(task=task, reference=task.source, parent=ours[0]), 8)
    moved = [
        k.candidate
        for k in kids
        if k.status == ProposalStatus.OK
        and k.edit.startswith(("coarsen_threads", "more_parallelism", "pipeline_loads"))
    ]
    edited = []  # the plain tile's and the wide one's: the children's edits read alike, so the tile is named
    for parent in [ours[0], *(c for c in moved[:3] if "bn=256" in c.edit)][:2]:
        kids = policy.propose(Context(task=task, reference=task.source, parent=parent), 8)
        bn = plan_of(parent.source).regions[-1].bn
        for edit in ("multicast_loads", "coalesce_accesses", "overlap_epilogue"):
            edited += [dataclasses.replace(k.candidate, edit=f"{k.edit} at bn={bn}") for k in kids
                       if k.status == ProposalStatus.OK and k.candidate and edit in k.edit][:1]  # fmt: skip
    out: dict[str, object] = {}  # one of each kernel: edits from either parent may reach the same plan
    for c in [ours[0], *moved[:3], *edited]:
        out.setdefault(c.source, c)
    return list(out.values())


def libraries(module, model) -> dict[str, Callable]:
    """The same computation by the libraries, each called with the task's inputs: (x, counts), or for a weight
    gradient (x, dy, counts)."""
    import inspect

    import torch
    import torch.nn.functional as F

    if len(inspect.signature(module.Model.forward).parameters) < 3:  # forward(self, x): a whole block
        return {}
    w = next((p for p in model.parameters() if p.dim() == 3), None)
    if w is None:  # a weight gradient: the groups split the tokens (K)

        def ragged_k(x, dy, counts):
            return torch._grouped_mm(x.t(), dy, offs=counts.cumsum(0).to(torch.int32))

        return {"torch._grouped_mm": ragged_k}
    swiglu = w.shape[-1] == 2 * model.intermediate if hasattr(model, "intermediate") else False

    def epilogue(h):
        if not swiglu:
            return h
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    def k_major(x) -> bool:  # dgrad: w[e] is (N, K), read transposed
        return w.shape[1] != w.shape[2] and w.shape[2] == x.shape[-1]

    def grouped_mm(x, counts):
        b = w.transpose(-2, -1) if k_major(x) else w
        return epilogue(torch._grouped_mm(x, b, offs=counts.cumsum(0).to(torch.int32)))

    out = {"torch._grouped_mm": grouped_mm}
    veomni = _veomni()
    if veomni is not None:
        wc = w.contiguous()

        def triton_group_gemm(x, counts):
            ends = counts.cumsum(0).to(torch.int32)
            return epilogue(veomni(x, wc, ends, int(counts.max()), transpose_b=k_major(x)))

        out["veomni triton"] = triton_group_gemm
    return out


def _veomni():
    """VeOmni's Triton group GEMM (same N and K per group), or None where the package is not importable."""
    for name in (
        "veomni.ops.kernels.moe._kernels.kernel.group_gemm",  # 0.1.12, on PyPI
        "veomni.ops.group_gemm.kernel.group_gemm",
    ):
        try:
            mod = __import__(name, fromlist=["group_gemm_same_nk"])
            return mod.group_gemm_same_nk
        except Exception:  # not installed, or an import of one of its optional dependencies fails
            continue
    return None


def rel_err(got, want) -> float:
    """The relative error of an output against the reference loop's (Frobenius norms, in fp32)."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def time_libraries(path: Path, flops: float, trials: int = 50) -> dict[str, dict]:
    import torch

    from pipeline.timing import time_cuda

    module = load_module(path)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = module.Model(*module.get_init_inputs())

    def inputs_for(call: int) -> list:  # drawn on the GPU: a host-side draw of 10^8 bf16 values takes seconds
        return make_inputs(module, call, torch.device("cuda"))

    rows = {}
    for name, fn in libraries(module, model).items():
        with torch.no_grad():
            args = inputs_for(0)
            want = model(*args)
            got = fn(*args)
            t = time_cuda(fn, inputs_for, trials=trials, budget_s=3.0, warmup=3)
        rows[name] = {"ms": t.median_ms, "tflops": flops / t.median_ms / 1e9, "rel_err": rel_err(got, want)}
    return rows


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="time torch.compile of the reference loop too")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = load(
        home=args.out / "home",
        baselines=("eager", "compile") if args.compile else ("eager",),
        energy=False,
        timing_trials=50,
        timing_budget_s=3.0,
    )
    results: dict[str, dict] = {}
    with stages.open_pool(cfg) as pool:
        for name in args.tasks.split(","):
            path = ROOT / "tasks" / "moe" / f"{name}.py"
            flops = probe(path).flops
            t0 = time.monotonic()
            cands = candidates(path)
            say(f"{name}: {len(cands)} candidates in {time.monotonic() - t0:.0f} s")
            if not cands:  # e.g. a weight gradient: the libraries are still timed, for the record
                say(f"{name}: no grouped kernel of ours: {supports(path)[1]}")
            rows: dict[str, dict] = {c.edit: {"ours_ms": [], "eager_ms": [], "compile_ms": []} for c in cands}
            for i in range(args.repeat):
                evaluated = stages.evaluate_candidates(path, cands, cfg, pool=pool)
                say(f"{name}: evaluation {i + 1} of {args.repeat} done at {time.monotonic() - t0:.0f} s")
                for c, r in zip(cands, evaluated, strict=True):
                    row = rows[c.edit]
                    row["status"] = r.verdict.status.value
                    m = r.measurement
                    if r.status != Status.OK or m is None or m.timing is None:
                        row["reasons"] = list(r.verdict.reasons) or [r.build.log[-400:] if r.build else ""]
                        continue
                    row["ours_ms"].append(m.timing.median_ms)
                    row["eager_ms"].append(m.baselines["eager"].median_ms)
                    if "compile" in m.baselines:  # torch.compile of the loop, timed in the same worker run
                        row["compile_ms"].append(m.baselines["compile"].median_ms)
            libs = time_libraries(path, flops)
            say(f"{name}: libraries timed at {time.monotonic() - t0:.0f} s")
            for row in rows.values():
                if row["ours_ms"]:
                    best = min(row["ours_ms"])
                    row["tflops"] = flops / best / 1e9
                    row["vs_loop"] = speedup(min(row["eager_ms"]), best)
                    if row["compile_ms"]:
                        row["vs_compile"] = speedup(min(row["compile_ms"]), best)
                    for lib, v in libs.items():
                        row[f"vs {lib}"] = speedup(v["ms"], best)
            results[name] = {"candidates": rows, "libraries": libs, "flops": flops}
            print(f"{name}: {json.dumps(results[name])}", flush=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
