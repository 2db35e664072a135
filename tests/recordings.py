"""Run logs recorded on the GPU, as the CPU tests replay them."""

from __future__ import annotations

import json
from pathlib import Path


def stamped(logs: list[Path], into: Path, **config: str) -> list[Path]:
    """Copies of these recordings, under `into`, whose start event says they ran with these settings."""
    out = []
    for i, path in enumerate(logs):
        first, *rest = path.read_text().splitlines()
        start = json.loads(first)
        start["data"]["config"].update(config)
        copy = into / f"recording{i}" / "log.jsonl"
        copy.parent.mkdir(parents=True)
        copy.write_text("\n".join([json.dumps(start), *rest]) + "\n")
        out.append(copy)
    return out
