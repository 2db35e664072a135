"""Our kernels against liger-kernel's hand-tuned Triton kernels (on PyPI) on the shapes where both apply:
RMSNorm, LayerNorm, softmax and cross-entropy over rows, with eager and torch.compile alongside.

    python3 benchmarks/bench_peers.py --out DIR [--cases rmsnorm,layernorm,softmax,cross_entropy] [--rows 4096]

Ours: the expert's first proposals and an edit of each (the candidates a short search starts from), through
the harness: verified, timed with fresh inputs and the L2 flushed, next to eager and torch.compile. Liger:
the same timing function (pipeline.timing.time_cuda, the same fresh inputs and flush) in this process, its
outputs checked against the task's reference first. liger-kernel is a trusted library here, not generated
code, so it runs in the benchmark's process. quack-kernels (CuTe DSL) is the other peer the issue names;
its runtime wheel for CUDA 13 is 92 MB, more than a device call carries, so it is not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"

# name -> (task body with {cols}, inputs with {rows} and {cols}, init inputs)
CASES: dict[str, tuple[str, str, str]] = {
    "rmsnorm": (
        "class Model(nn.Module):\n    def __init__(self, d):\n        super().__init__()\n"
        "        self.weight = nn.Parameter(torch.ones(d))\n\n    def forward(self, x):\n"
        "        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight\n",
        "[torch.randn({rows}, {cols})]",
        "[{cols}]",
    ),
    "layernorm": (
        "class Model(nn.Module):\n    def __init__(self, d):\n        super().__init__()\n"
        "        self.norm = nn.LayerNorm(d)\n\n    def forward(self, x):\n        return self.norm(x)\n",
        "[torch.randn({rows}, {cols})]",
        "[{cols}]",
    ),
    "softmax": (
        "class Model(nn.Module):\n    def forward(self, x):\n        return torch.softmax(x, dim=-1)\n",
        "[torch.randn({rows}, {cols})]",
        "[]",
    ),
    "cross_entropy": (
        "class Model(nn.Module):\n    def forward(self, x, t):\n        return F.cross_entropy(x, t)\n",
        "[torch.randn({rows}, {cols}), torch.randint(0, {cols}, ({rows},))]",
        "[]",
    ),
}
COLS = {"rmsnorm": 8192, "layernorm": 8192, "softmax": 8192, "cross_entropy": 32000}


def write_task(folder: Path, name: str, rows: int, cols: int | None = None) -> Path:
    body, inputs, init = CASES[name]
    cols = cols or COLS[name]
    path = folder / f"{name}_{rows}x{cols}.py"
    path.write_text(
        HEADER + body + f"\n\ndef get_inputs():\n    return {inputs.format(rows=rows, cols=cols)}\n\n\n"
        f"def get_init_inputs():\n    return {init.format(cols=cols)}\n"
    )
    return path


def liger_call(name: str, model):
    """Liger's kernel for the case, with the reference model's parameters (its autograd functions, called as
    liger_kernel.transformers.functional does, without importing the Hugging Face integration)."""
    from liger_kernel import ops as lg

    if name == "rmsnorm":
        return lambda x: lg.LigerRMSNormFunction.apply(x, model.weight, 1e-6, 0.0, "llama", False)
    if name == "layernorm":
        return lambda x: lg.LigerLayerNormFunction.apply(
            x, model.norm.weight, model.norm.bias, model.norm.eps
        )
    if name == "softmax":
        return lg.LigerSoftmaxFunction.apply
    # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap, z_loss,
    # token_accuracy, predicted_tokens) -> (loss, ...)
    return lambda x, t: lg.LigerCrossEntropyFunction.apply(
        x, t, None, -100, 0.0, 0.0, "mean", None, False, False, False
    )[0]


def time_liger(path: Path, name: str, cfg) -> dict:
    """Liger's median on fresh inputs with the L2 flushed, after a check against the task's reference."""
    import torch

    from pipeline import timing, verify
    from pipeline.tasks import load_module

    module = load_module(path)
    device = torch.device("cuda")
    ref = verify.build_reference(
        module, list(module.get_init_inputs()), cfg.seed, device, redraw_constant=True
    )
    fn = liger_call(name, ref)
    with torch.no_grad():
        inputs = verify.make_inputs(module, cfg.seed + 1, device)
        want = ref(*[x.clone() for x in inputs])  # liger's cross-entropy writes its gradient into the logits
        got = fn(*inputs)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()
    if err > 1e-4:
        return {"liger_status": "mismatch", "liger_max_rel_error": err}
    t = timing.time_cuda(
        fn,
        lambda call: verify.make_inputs(module, cfg.seed + 7919 * (call + 1), device),
        trials=cfg.timing_trials,
        budget_s=cfg.timing_budget_s,
        warmup=cfg.warmup,
    )
    return {"liger_status": "ok", "liger_ms": t.median_ms, "liger_max_rel_error": err}


def ours(path: Path, cfg, pool) -> dict:
    """The best of the expert's first proposals and an edit of each, measured by the harness."""
    from pipeline import stages
    from pipeline.generate.base import Context, ProposalStatus
    from pipeline.generate.expert import ExpertPolicy
    from pipeline.types import Status

    task = stages.probe_task(pool, path)
    policy = ExpertPolicy()
    first = [
        p for p in policy.propose(Context(task=task, reference=task.source, parent=None), 2) if p.candidate
    ]
    cands = [p.candidate for p in first]
    for p in first:
        kids = policy.propose(Context(task=task, reference=task.source, parent=p.candidate), 1)
        cands += [k.candidate for k in kids if k.status == ProposalStatus.OK and k.candidate]
    best: dict = {"status": "no_kernel"}
    for c, r in zip(cands, stages.evaluate_candidates(path, cands, cfg, pool=pool), strict=True):
        m = r.measurement
        if r.status != Status.OK or m is None or m.timing is None:
            continue
        if "ours_ms" not in best or m.timing.median_ms < best["ours_ms"]:
            best = {
                "status": "ok", "ours_ms": m.timing.median_ms, "edit": c.edit, "kind": r.verdict.kind.value,
                "eager_ms": m.baselines["eager"].median_ms, "floor_ms": m.floor_ms,
                **({"compile_ms": m.baselines["compile"].median_ms} if "compile" in m.baselines else {}),
            }  # fmt: skip
    return best


def main(argv: list[str] | None = None) -> int:
    from pipeline import stages
    from pipeline.config import load

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rows", type=int, default=4096)
    args = ap.parse_args(argv)
    (args.out / "tasks").mkdir(parents=True, exist_ok=True)
    cfg = load(home=args.out / "home", baselines=("eager", "compile"), energy=False)
    results: dict[str, dict] = {}
    with stages.open_pool(cfg) as pool:
        for name in args.cases.split(","):
            path = write_task(args.out / "tasks", name, args.rows)
            row = ours(path, cfg, pool)
            try:
                row.update(time_liger(path, name, cfg))
            except Exception as e:  # a peer that fails is a row that says why, not the end of the run
                row["liger_error"] = f"{type(e).__name__}: {e}"[:300]
            if row.get("ours_ms") and row.get("liger_ms"):
                row["ours_over_liger"] = row["liger_ms"] / row["ours_ms"]
            results[path.stem] = row
            print(f"{path.stem}: {json.dumps(row)}", flush=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
