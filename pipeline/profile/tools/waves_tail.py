"""Grid size against the machine: too few blocks to fill 132 SMs, or a partial last wave.

launch__waves_per_multiprocessor = blocks / (132 SMs x resident blocks per SM). Below one wave (fewer
blocks than SMs in the worst case) SMs sit idle for the whole kernel. Above one, a fractional last wave
leaves SMs idle while it runs: with equal blocks the idle share of SM time is (ceil(w) - w) / ceil(w).
(ncu's LaunchConfiguration rule estimates 1 / (1 + full waves) whatever the fill, so it flags 3.88 waves
at 25% where the loss is 3%.)
"""

from __future__ import annotations

import math

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register
from pipeline.types import Finding

SMS = 132  # H200
TAIL_FIRES = 0.2  # idle share of SM time in the last wave, as in ncu's rule


class WavesTail:
    name = "waves_tail"
    applies_to = frozenset({Bound.MEMORY, Bound.LATENCY, Bound.COMPUTE})
    needs = frozenset({"ncu"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        k = ev.dominant()
        if k is None or "launch__grid_size" not in k.metrics:
            return []
        grid = k.get("launch__grid_size")
        waves = k.get("launch__waves_per_multiprocessor")
        block = k.get("launch__block_size")
        evidence = {
            "launch__grid_size": grid,
            "launch__waves_per_multiprocessor": waves,
            "launch__block_size": block,
        }
        if grid < SMS:
            idle = 1 - grid / SMS
            diagnosis = (
                f"The grid has {grid:.0f} blocks of {block:.0f} threads for {SMS} SMs: {SMS - grid:.0f} "
                f"SMs ({100 * idle:.0f}%) sit idle for the whole kernel — the work is cut too coarsely "
                "(one block per row, batch or output)."
            )
            advice = (
                f"Split the work over at least {2 * SMS} blocks: smaller tiles, a block per row chunk, "
                "or split the reduction dimension across blocks (split-K) with a second small combine "
                "step."
            )
            severity = capped(0.95 * idle, cls)
            return [
                finding(
                    self.name,
                    severity,
                    evidence,
                    diagnosis,
                    advice,
                    ("more_parallelism", "resize_grid"),
                    round(min(headroom(cls), idle), 2),
                )
            ]
        if waves <= 0:
            return []
        full = math.ceil(waves - 1e-9)
        idle = (full - waves) / full
        if idle < TAIL_FIRES:
            return []
        per_sm = grid / (waves * SMS)
        tail_blocks = round((waves - math.floor(waves)) * per_sm * SMS)
        diagnosis = (
            f"The grid is {waves:.2f} waves ({grid:.0f} blocks, {per_sm:.0f} per SM at a time): "
            f"after {math.floor(waves)} full wave(s) only {tail_blocks} blocks run, so {100 * idle:.0f}% "
            "of SM time is idle in the tail."
        )
        advice = (
            f"Size the grid to whole waves ({SMS * per_sm:.0f} blocks per wave), or launch a persistent "
            f"grid of {SMS * per_sm:.0f} blocks that loop over the tiles; smaller tiles also shorten "
            "the tail."
        )
        severity = capped(min(0.85, 1.5 * idle), cls)
        return [
            finding(
                self.name,
                severity,
                evidence,
                diagnosis,
                advice,
                ("resize_grid", "persistent_grid"),
                round(min(headroom(cls), idle), 2),
            )
        ]


register(WavesTail())
