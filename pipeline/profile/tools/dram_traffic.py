"""DRAM bytes moved against the task's minimum (every input, parameter and output moved once).

ncu flushes the caches before each profiled kernel, so every kernel starts cold and a one-pass design moves
about task.min_bytes. More than that means data crosses DRAM more than once: an intermediate written by one
kernel and read by the next, an input re-read per output tile because the working set outgrows the 60 MB
L2, or whole sectors fetched for a few useful bytes.
"""

from __future__ import annotations

from pipeline.profile.evidence import Evidence
from pipeline.profile.roofline import Bound, Classification
from pipeline.profile.tools.base import capped, finding, headroom, register
from pipeline.types import Finding

EXCESS_FIRES = 1.5  # 50% more than the minimum
L2_BYTES = 60 * 2**20
ELEMENT = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "int16": 2}


def _output_bytes(ev: Evidence) -> float:
    return float(sum(o.numel * ELEMENT.get(o.dtype, 1) for o in ev.task.outputs))


class DramTraffic:
    name = "dram_traffic"
    applies_to = frozenset(
        {Bound.MEMORY, Bound.LATENCY, Bound.COMPUTE}
    )  # an unfused epilogue costs a compute-bound hybrid too
    needs = frozenset({"ncu"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        minimum = ev.task.min_bytes
        if minimum <= 0 or not ev.kernels:
            return []
        read, written = ev.total("dram__bytes_read.sum"), ev.total("dram__bytes_write.sum")
        ratio = (read + written) / minimum
        if ratio < EXCESS_FIRES:
            return []
        evidence = {
            "dram__bytes_read.sum": read,
            "dram__bytes_write.sum": written,
            "task.min_bytes": float(minimum),
            "ratio": round(ratio, 2),
        }
        launches = round(ev.launches_per_call)
        evidence["launches_per_call"] = float(launches)
        local = sum(ev.total(f"l1tex__t_bytes_pipe_lsu_mem_local_op_{op}.sum") for op in ("ld", "st"))
        excess = 1 - 1 / ratio
        symptom = 1.0  # 1 when the excess is itself the cause; less when another tool names the cause
        if local >= 0.25 * (read + written):
            evidence["l1tex_local_bytes"] = local
            cause = "per-thread local memory (register spills or a local array) overflows L1 and L2 into DRAM"
            advice = "Keep per-thread data in registers or shared memory (see the local-memory finding)."
            edits: tuple[str, ...] = ("reduce_registers", "avoid_local_arrays")
            symptom = 0.7
        elif ev.library_counters and ev.our_counters:
            cause = (
                "our kernel makes a second pass over the library kernel's output instead of fusing into it"
            )
            advice = "Fuse the elementwise work into the GEMM's epilogue (CUTLASS epilogue visitor tree)."
            edits = ("fuse_epilogue", "fuse_kernels")
        elif launches > 1:
            cause = (
                f"the call runs {launches} kernels, so intermediates make a round trip through memory: "
                "written by one kernel and read back by the next"
            )
            advice = "Fuse the kernels into one pass: keep intermediates in registers or shared memory."
            edits = ("fuse_kernels",)
        elif written > 1.5 * _output_bytes(ev) and written > 0.5 * read:
            cause = "the kernel writes far more than its outputs: partial results or scratch round-trip DRAM"
            advice = "Accumulate partial results in registers or shared memory and write each output once."
            edits = ("tile_shared_memory", "fuse_kernels")
        else:
            big = minimum > L2_BYTES
            cause = "inputs are re-read from DRAM: each output tile reloads its operands" + (
                " and the working set outgrows the 60 MB L2" if big else ""
            )
            advice = (
                "Stage each input tile in shared memory once per block and reuse it for every output it "
                "feeds (larger tiles, or a block-swizzled launch order so neighbours share L2)."
            )
            edits = ("tile_shared_memory",)
        diagnosis = (
            f"The call moves {ratio:.1f}x the task's minimal DRAM bytes "
            f"({(read + written) / 1e6:.1f} MB against {minimum / 1e6:.1f} MB): {cause}."
        )
        # Re-reads cost time only in proportion to how memory-limited the kernel is; cap below a direct
        # cause (uncoalesced access also inflates DRAM bytes and is the better-named finding).
        weight = 0.75 if cls.bound == Bound.MEMORY else 0.55
        if cls.ridge and cls.task_intensity > cls.ridge:
            weight *= 0.5  # the task's floor is compute: extra bytes are mostly hidden behind the math
        severity = capped((weight * excess + 0.1) * symptom, cls)
        return [
            finding(
                self.name, severity, evidence, diagnosis, advice, edits, round(min(excess, headroom(cls)), 2)
            )
        ]


register(DramTraffic())
