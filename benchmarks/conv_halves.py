"""Input channels padded to 16-channel halves of a k tile, or to whole 32-channel k tiles, in the implicit-GEMM
convolution (templates/conv_tf32.py, `cin_pad`), measured through the harness on the GPU.

    python benchmarks/conv_halves.py --out DIR TASK.py [TASK.py ...] [--repeat 2]

For each task (convolutions of 33-48 input channels: KernelBench level 1's 61 and 70 have 48) the expert's
tuned candidate twice: as the template writes it now (48 channels take 48 columns a tap, a k tile's two
halves gathered from one tap each) and with the padding rule it replaced (48 channels padded to 64, whole k
tiles a tap), set here for the generation only. Both are verified and timed against eager `--repeat` times
in separate passes, so a difference is believed only when the passes agree. Writes DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline import stages  # noqa: E402
from pipeline.config import load  # noqa: E402
from pipeline.generate.base import Context  # noqa: E402
from pipeline.generate.expert import ExpertPolicy  # noqa: E402
from pipeline.generate.expert import policy as expert_policy  # noqa: E402
from pipeline.generate.expert.templates import conv_tf32  # noqa: E402
from pipeline.tasks import probe  # noqa: E402
from pipeline.types import Status  # noqa: E402


def _whole_tiles(f: conv_tf32.ConvForm, new=conv_tf32.cin_pad) -> int:
    """The padding before 16-channel halves: past 16 channels, a multiple of 32."""
    cinp = new(f)
    return -(-cinp // conv_tf32.BK) * conv_tf32.BK if cinp > 16 else cinp


def tuned(path: Path, whole: bool):
    task = probe(path)
    saved = conv_tf32.cin_pad
    if whole:
        conv_tf32.cin_pad = _whole_tiles
    expert_policy._RENDERED.clear()  # renders are remembered by plan: this one differs in its template
    try:
        props = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    finally:
        conv_tf32.cin_pad = saved
    return props[1].candidate


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("tasks", type=Path, nargs="+")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = load(
        home=args.out / "home", baselines=("eager",), energy=False, timing_trials=30, timing_budget_s=3.0
    )
    results: dict[str, list[dict]] = {}
    with stages.open_pool(cfg) as pool:
        for path in args.tasks:
            cands = [("halves", tuned(path, False)), ("whole tiles", tuned(path, True))]
            rows = [{"form": form, "cinp": [ln.strip() for ln in c.source.splitlines() if "CINP = " in ln][:1],
                     "ours_ms": [], "eager_ms": []} for form, c in cands]  # fmt: skip
            for _ in range(args.repeat):
                evals = stages.evaluate_candidates(path, [c for _, c in cands], cfg, pool=pool)
                for row, r in zip(rows, evals, strict=True):
                    row["status"] = r.verdict.status.value
                    m = r.measurement
                    if r.status != Status.OK or m is None or m.timing is None:
                        row["reasons"] = list(r.verdict.reasons)
                        continue
                    row["ours_ms"].append(m.timing.median_ms)
                    row["eager_ms"].append(m.baselines["eager"].median_ms)
                    row["floor_ms"] = m.floor_ms
            for row in rows:
                if row["ours_ms"]:
                    row["vs_eager"] = min(row["eager_ms"]) / min(row["ours_ms"])
            results[path.stem] = rows
            print(path.stem, [(r["form"], r["ours_ms"], r.get("vs_eager")) for r in rows], flush=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
