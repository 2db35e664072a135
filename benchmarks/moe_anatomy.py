"""Where our grouped GEMM's time goes: the kernel timed whole, without its stores, without its MMAs, and with
neither (the loads and the tile walk alone), each part switched off by a runtime test the compiler cannot
fold (K == -7), so the rest of the code is the same. Kernel work, not a result: the parts' outputs are wrong
by design, only the whole one is checked against the reference loop.

    python benchmarks/moe_anatomy.py --out DIR [--tasks qwen3_fc2,mixtral_fc2] [--trials 15] [--build-only]

Writes DIR/anatomy.json ({task: {candidate: {variant: ms}}}, rewritten after each task). If the kernel without
stores is much faster than the whole, the epilogue is worth overlapping with the next tile's mainloop (a TMA
store from shared memory, or ping-pong consumers); if the one without MMAs is close to the whole, the loads
bound it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_moe  # noqa: E402

from pipeline.candidates import candidate_key  # noqa: E402
from pipeline.compile import compile_candidates  # noqa: E402
from pipeline.config import load  # noqa: E402
from pipeline.tasks import load_module  # noqa: E402

# (variant, [(text in the kernel, its replacement)]): each must be found, or the template changed under us
# no stores: the tile's epilogue skipped whole (direct or staged stores alike), right where it begins
STORE = (
    "const long long r0 = row0;",
    "const long long r0 = row0;\n        if (K != -7) continue;  // anatomy",
)
MMA = ("            if (busy) {", "            if (busy && K == -7) {")
VARIANTS = {"whole": [], "no stores": [STORE], "no MMAs": [MMA], "loads only": [STORE, MMA]}


def variants(cand) -> dict[str, object]:
    out = {}
    for name, edits in VARIANTS.items():
        src = cand.source
        for old, new in edits:
            if src.count(old) != 1:
                raise SystemExit(f"{cand.edit}: {old.strip()!r} found {src.count(old)} times in the kernel")
            src = src.replace(old, new)
        key = candidate_key(src, cand.launcher, cand.flags)  # the whole kernel keeps its own key
        out[name] = dataclasses.replace(cand, source=src, key=key, edit=f"{cand.edit} [{name}]")
    return out


def chosen(path: Path) -> list:
    """The first candidate (the family's plan) and the first 256-wide one that does not multicast."""
    cands = bench_moe.candidates(path)
    wide = [c for c in cands[1:] if "bn=256" in c.edit and "multicast" not in c.edit][:1]
    return cands[:1] + wide


def run_task(name: str, cfg, trials: int, build_only: bool) -> dict[str, dict[str, float]]:
    path = ROOT / "tasks" / "moe" / f"{name}.py"
    sets = [variants(c) for c in chosen(path)]
    flat = [v for s in sets for v in s.values()]
    builds = dict(zip((c.key for c in flat), compile_candidates(flat, cfg), strict=True))
    if build_only:
        print(name, *(b.status.value for b in builds.values()), flush=True)
        return {}
    import torch

    from pipeline.runtime import Kernels
    from pipeline.timing import time_cuda
    from pipeline.verify import make_inputs
    from pipeline.worker_jobs import load_launcher

    module = load_module(path)
    gpu = torch.device("cuda")
    torch.manual_seed(0)
    with gpu:
        model = module.Model(*module.get_init_inputs())
    args = make_inputs(module, 0, gpu)
    with torch.no_grad():
        want = model(*args)
    row: dict[str, dict[str, float]] = {}
    for s in sets:
        label = s["whole"].edit.removesuffix(" [whole]")
        row[label] = {}
        for variant, c in s.items():
            b = builds[c.key]
            if b.cubin_path is None:
                print(f"{name}: {c.edit}: build {b.status.value}: {b.log[-300:]}", flush=True)
                continue
            ours = load_launcher(c.launcher, Kernels.from_file(b.cubin_path), c.key)(
                *module.get_init_inputs()
            )
            ours = ours.to(gpu)
            ours.load_state_dict(model.state_dict())
            with torch.no_grad():
                err = bench_moe.rel_err(ours(*args), want)
                ms = time_cuda(ours, lambda call: make_inputs(module, call, gpu), trials=trials, budget_s=3.0,
                               warmup=2).median_ms  # fmt: skip
            if variant == "whole" and err > 0.02:
                raise SystemExit(f"{name}: {c.edit}: relative error {err:.3g}: the whole kernel is wrong")
            row[label][variant] = ms
            print(f"{name}: {c.edit}: {ms:.3f} ms", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tasks", default="qwen3_fc2,mixtral_fc2,deepseek_fc1")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--build-only", action="store_true", help="compile into DIR/home's cache, no GPU")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = load(home=args.out / "home")
    results: dict[str, dict] = {}
    for name in args.tasks.split(","):
        results[name] = run_task(name, cfg, args.trials, args.build_only)
        if not args.build_only:
            (args.out / "anatomy.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
