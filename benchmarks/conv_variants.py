"""The implicit-GEMM convolution (templates/conv_tf32.py) as the template writes it now against the forms it
replaced, measured through the harness on the GPU.

    python benchmarks/conv_variants.py --out DIR TASK.py [TASK.py ...] [--repeat 2] [--forms now,whole,one]

For each task the expert's tuned candidate in each form, the template's rules set here for the generation
only (the candidates are ordinary sources):
- `now`: as the template writes it;
- `whole`: input channels past 16 padded to whole 32-channel k tiles (48 channels took 64 columns a tap),
  the rule before 16-channel halves (`cin_pad`);
- `one`: one gathering warpgroup whatever the tile (384 threads), the rule before a second one gathered the
  alternate k tiles of tiles of 64 channels or fewer (`gatherers`).
Each is verified and timed against eager `--repeat` times in separate passes, so a difference is believed
only when the passes agree. Writes DIR/results.json as it goes.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness_forms import compare, parser  # noqa: E402  (beside this script)

from pipeline.generate.base import Context  # noqa: E402
from pipeline.generate.expert import ExpertPolicy  # noqa: E402
from pipeline.generate.expert import policy as expert_policy  # noqa: E402
from pipeline.generate.expert.templates import conv_tf32  # noqa: E402
from pipeline.tasks import probe  # noqa: E402


def _whole_tiles(f: conv_tf32.ConvForm, new=conv_tf32.cin_pad) -> int:
    """The padding before 16-channel halves: past 16 channels, a multiple of 32."""
    cinp = new(f)
    return -(-cinp // conv_tf32.BK) * conv_tf32.BK if cinp > 16 else cinp


# form -> (template attribute, its value while the form's candidate is generated)
FORMS = {"now": (), "whole": (("cin_pad", _whole_tiles),), "one": (("TWO_GATHERERS_N", 0),)}


def tuned(path: Path, form: str):
    task = probe(path)
    saved = {name: getattr(conv_tf32, name) for name, _ in FORMS[form]}
    for name, value in FORMS[form]:
        setattr(conv_tf32, name, value)
    expert_policy._RENDERED.clear()  # renders are remembered by plan: this one differs in its template
    try:
        props = ExpertPolicy().propose(Context(task=task, reference=task.source, parent=None), 2)
    finally:
        for name, value in saved.items():
            setattr(conv_tf32, name, value)
        expert_policy._RENDERED.clear()
    return props[1].candidate


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--forms", default=",".join(FORMS), help="comma-separated, of: " + ", ".join(FORMS))
    args = ap.parse_args()
    forms = [form for form in args.forms.split(",") if form in FORMS]

    def describe(row: dict, c) -> None:
        row["geometry"] = [
            ln.strip() for ln in c.source.splitlines() if "CINP = " in ln or "GATHERERS =" in ln
        ]

    compare(args.out, args.tasks, args.repeat, lambda path: [(f, tuned(path, f)) for f in forms], 30, 3.0,
            describe=describe)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
