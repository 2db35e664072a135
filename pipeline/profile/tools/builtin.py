"""Imports, and thereby registers, every built-in micro-profiling tool."""

from __future__ import annotations

from pipeline.profile.tools import (  # noqa: F401 - each module registers its tool on import
    bank_conflicts,
    coalescing,
    divergence,
    dram_traffic,
    energy,
    launch_overhead,
    local_memory,
    occupancy,
    pipe_utilisation,
    register_spills,
    tensor_cores,
    vector_width,
    warp_stalls,
    waves_tail,
    wgmma_pipeline,
)

NAMES = (
    "coalescing", "vector_width", "dram_traffic", "bank_conflicts", "occupancy", "register_spills",
    "local_memory", "tensor_cores", "pipe_utilisation", "warp_stalls", "divergence", "waves_tail",
    "launch_overhead", "energy", "wgmma_pipeline",
)  # fmt: skip
