"""The micro-profiling tools on evidence recorded on the H200 (benchmarks/record_profiling_fixtures.py): each
flawed fixture kernel's real flaw ranks first with a fitting edit, good kernels raise no alarm, and the
outputs, the registry and the parsers behave. CPU only; the recordings are real ncu, SASS and NVML output.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import ClassVar

import pytest

from pipeline.profile import collect
from pipeline.profile.advice import advice_block, analyze, as_json, raw_block
from pipeline.profile.collect import KernelCounters, metric_known, parse_ncu_csv, parse_sass
from pipeline.profile.evidence import Evidence, load_recorded
from pipeline.profile.roofline import Bound, Classification, classify
from pipeline.profile.tools import base, builtin
from pipeline.types import Finding

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "profiling"
RECORDED = FIXTURES / "recorded"
KERNELS = FIXTURES / "kernels"
FIXTURES_ALL = sorted(p.name for p in KERNELS.iterdir() if (p / "expect.toml").is_file())


def _valid(case: str) -> bool:
    """A recording whose ncu run succeeded (a crashed run leaves an empty ncu.csv and status != ok)."""
    info = RECORDED / case / "ncu.json"
    return info.is_file() and json.loads(info.read_text()).get("status") == "ok"


def expect(case: str) -> dict:
    return tomllib.loads((KERNELS / case / "expect.toml").read_text())


CASES = [c for c in FIXTURES_ALL if _valid(c)]
FLAWED = [c for c in CASES if not expect(c)["good"]]
GOOD = [c for c in CASES if expect(c)["good"]]
_CACHE: dict[str, tuple[Evidence, Classification, list[Finding]]] = {}


def run(case: str) -> tuple[Evidence, Classification, list[Finding]]:
    if case not in _CACHE:
        ev = load_recorded(RECORDED / case)
        cls, findings = analyze(ev)
        _CACHE[case] = (ev, cls, findings)
    return _CACHE[case]


def recorded(case: str) -> Evidence:
    if not _valid(case):
        pytest.skip(f"{case} has no valid recording (test_every_fixture_has_a_valid_recording says so)")
    return run(case)[0]


def test_every_fixture_has_a_valid_recording():
    missing = [c for c in FIXTURES_ALL if not _valid(c)]
    assert not missing, f"record these again on the H200: {missing}"


def test_recordings_cover_the_fixture_set():
    assert len(FLAWED) >= 12, f"flawed recordings: {FLAWED}"
    assert len(GOOD) >= 3, f"good recordings: {GOOD}"
    for case in CASES:
        e = expect(case)
        assert e["good"] or (e["top_tool"] in builtin.NAMES and set(e["edits"]) <= base.EDITS), case


@pytest.mark.parametrize("case", FLAWED)
def test_the_real_flaw_ranks_first(case):
    _, cls, findings = run(case)
    e = expect(case)
    assert findings, f"{case}: no finding ({cls.summary})"
    top = findings[0]
    ranking = [(f.tool, f.severity) for f in findings]
    assert top.tool == e["top_tool"], f"{case}: {ranking}; {cls.summary}"
    assert set(top.edits) & set(e["edits"]), f"{case}: {top.edits} vs {e['edits']}"
    assert top.severity >= 0.45, f"{case}: the real flaw is reported too weakly: {ranking}"
    assert top.evidence and top.diagnosis and top.advice


@pytest.mark.parametrize("case", GOOD)
def test_good_kernels_raise_no_alarm(case):
    _, cls, findings = run(case)
    loud = [(f.tool, f.severity) for f in findings if f.severity >= 0.5]
    assert not loud, f"{case}: {loud}; {cls.summary}"


def test_every_real_flaw_outranks_anything_said_about_a_good_kernel():
    loudest_good = max((f.severity for c in GOOD for f in run(c)[2]), default=0.0)
    weakest_flaw = min(run(c)[2][0].severity for c in FLAWED)
    assert loudest_good <= 0.35, loudest_good  # "a healthy kernel gets nothing above ~0.3"
    assert weakest_flaw > loudest_good + 0.1, (weakest_flaw, loudest_good)


@pytest.mark.parametrize("case", CASES)
def test_findings_are_well_formed(case):
    _, _, findings = run(case)
    assert [f.severity for f in findings] == sorted((f.severity for f in findings), reverse=True)
    for f in findings:
        assert 0.0 <= f.severity <= 1.0 and set(f.edits) <= base.EDITS
        assert all(isinstance(v, float | int) for v in f.evidence.values()), f.evidence
        assert f.expected_gain is None or 0.0 <= f.expected_gain <= 1.0
        assert not re.search(r"\b(nan|inf|None)\b", f.diagnosis + f.advice), f.diagnosis  # unformatted values
        assert "{" not in f.diagnosis + f.advice


@pytest.mark.parametrize("case", CASES)
def test_advice_block_fits_and_leads_with_the_worst(case):
    _, cls, findings = run(case)
    block = advice_block(cls, findings)
    assert len(block) <= 300 * 4, len(block)
    lines = block.splitlines()
    assert lines[0].startswith(f"Bottleneck: {cls.bound.value}-bound")
    loud = [f for f in findings if f.severity > 0]
    if loud:
        assert lines[1].startswith(f"1. [{loud[0].tool}] {loud[0].diagnosis[:40]}")
    else:
        assert lines[1].startswith("No problem found")


@pytest.mark.parametrize("case", CASES)
def test_json_round_trips(case):
    ev, cls, findings = run(case)
    data = as_json(cls, findings)
    again = json.loads(json.dumps(data))
    assert again == data
    assert again["classification"]["bound"] == cls.bound.value
    assert [f["tool"] for f in again["findings"]] == [f.tool for f in findings]
    assert raw_block(ev).startswith("kernel ")


class _RecordingMetrics(dict):
    """A metrics dict that remembers every name a tool asks for (instrumentation, not a stand-in)."""

    asked: ClassVar[set[str]] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)


def test_every_metric_the_tools_read_is_curated_and_known_to_ncu():
    asked = _RecordingMetrics.asked
    asked.clear()
    for case in CASES:
        ev = load_recorded(RECORDED / case)
        kernels = tuple(
            KernelCounters(k.name, _RecordingMetrics(k.metrics), k.grid, k.block) for k in ev.kernels
        )
        ev = Evidence(**{**ev.__dict__, "kernels": kernels})
        cls = classify(ev)
        for tool in base.registry().values():
            if base.available(ev, tool.needs):
                tool.analyze(ev, cls)
    curated = set(collect.curated_metrics())
    known = set((RECORDED / "metrics_known.txt").read_text().split())
    # launch__* attributes and the theoretical occupancy are not listed by `ncu --query-metrics`, but the raw
    # page prints them for every kernel: for those, "known" means every recording has them.
    returned = set.intersection(*(set(k.metrics) for c in CASES for k in run(c)[0].kernels))
    assert len(asked) >= 40, sorted(asked)
    assert not asked - curated, sorted(asked - curated)
    unknown = [m for m in asked if not metric_known(m, known) and m not in returned]
    assert not unknown, unknown
    assert {m for m in asked if not metric_known(m, known)} <= {
        m for m in asked if m.startswith("launch__")
    } | {"sm__maximum_warps_per_active_cycle_pct"}
    assert not metric_known("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", known)


def test_every_curated_metric_came_back_from_ncu():
    """ncu drops unknown names silently: the recorder's list of missing names must be empty."""
    for case in CASES:
        info = json.loads((RECORDED / case / "ncu.json").read_text())
        assert info["status"] == "ok", (case, info)
        assert not info["missing"], (case, info["missing"])


# -- registry ------------------------------------------------------------------------------------------
class _LaunchOnly:
    name = "test_launch_only"
    applies_to = frozenset({Bound.LAUNCH})
    needs = frozenset({"system"})

    def analyze(self, ev: Evidence, cls: Classification) -> list[Finding]:
        return [base.finding(self.name, 0.99, {"kernels_per_call": ev.system["kernels_per_call"]},
                             "test diagnosis", "test advice", ("fuse_kernels",))]  # fmt: skip


def test_builtin_tools_are_registered_with_valid_declarations():
    tools = base.registry()
    assert set(builtin.NAMES) <= set(tools)
    for name in builtin.NAMES:
        t = tools[name]
        assert t.name == name and isinstance(t, base.Tool)
        assert t.applies_to and t.applies_to <= set(Bound)
        assert t.needs <= {"ncu", "sass", "ptxas", "system", "energy", "timing"}


def test_a_third_party_tool_runs_only_on_its_class():
    launch = recorded("many_small_launches")
    memory = recorded("good_rowsum")
    base.register(_LaunchOnly())
    try:
        assert "test_launch_only" in base.registry() and set(builtin.NAMES) <= set(base.registry())
        cls, findings = analyze(launch)
        assert cls.bound == Bound.LAUNCH
        assert findings[0].tool == "test_launch_only"
        cls, findings = analyze(memory)
        assert cls.bound == Bound.MEMORY
        assert "test_launch_only" not in {f.tool for f in findings}
        assert "coalescing" in {t.name for t in base.registry().values() if cls.bound in t.applies_to}
        _, findings = analyze(memory, every_class=True)  # the ablation switch runs every tool
        assert "test_launch_only" in {f.tool for f in findings}
    finally:
        base.unregister("test_launch_only")
    assert "test_launch_only" not in base.registry()


def test_register_refuses_what_is_not_a_tool_and_edits_outside_the_vocabulary():
    with pytest.raises(TypeError):
        base.register(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        base.finding("x", 0.5, {}, "d", "a", ("make_it_fast",))


# -- parsers ----------------------------------------------------------------------------------------------
def test_parse_ncu_csv_on_recordings():
    for case in CASES:
        kernels = parse_ncu_csv((RECORDED / case / "ncu.csv").read_text())
        ours = {k.name for k in kernels if k.name in expect(case)["kernels"]}
        assert ours == set(expect(case)["kernels"]), (case, [k.name for k in kernels])
        assert all(k.get("gpu__time_duration.sum") > 0 and len(k.metrics) >= 66 for k in kernels), case
        assert all(k.grid.startswith("(") and k.block.startswith("(") for k in kernels), case
    launches = parse_ncu_csv((RECORDED / "many_small_launches" / "ncu.csv").read_text())
    # 256 identical launches per call: ncu profiles one per distinct configuration ...
    assert len(launches) == 1 and launches[0].name == "add_row"
    assert launches[0].get("launch__grid_size") == 1 and launches[0].get("launch__block_size") == 64
    # ... and the system profile's launch count weights it back to the whole call.
    ev = load_recorded(RECORDED / "many_small_launches")
    assert ev.launches_per_call == 256 and ev.weight(launches[0]) == 256
    one = launches[0].get("dram__bytes_read.sum")
    assert ev.total("dram__bytes_read.sum") == 256 * one
    hybrid = parse_ncu_csv((RECORDED / "good_cublas_matmul" / "ncu.csv").read_text())
    assert len(hybrid) == 2 and hybrid[1].name == "relu_bf16_inplace"
    assert hybrid[0].get("sm__inst_executed_pipe_tensor_op_gmma.sum") > 0  # cuBLAS takes the WGMMA path
    assert parse_ncu_csv("==PROF== Disconnected\nno csv here") == ()


def test_parse_sass_on_recordings():
    for case in CASES:
        sass = parse_sass((RECORDED / case / "sass.txt").read_text())
        assert set(expect(case)["kernels"]) <= set(sass), (case, set(sass))
        for name in expect(case)["kernels"]:
            assert sass[name].instructions > 0 and sass[name].count("EXIT") >= 1, (case, name)
        if case not in ("local_memory_array", "register_spills"):
            assert not any(s.count("LDL") or s.count("STL") for s in sass.values()), case
    sass = {c: parse_sass((RECORDED / c / "sass.txt").read_text()) for c in CASES}
    assert sass["scalar_loads"]["scale_scalar"].global_loads == {32: 1}
    assert sass["good_rowsum"]["rowsum_block"].global_loads.get(128, 0) > 0
    hmma = sass["tensor_core_hmma"]["matmul_relu_wmma_v8"]
    assert hmma.count("HMMA") > 0 and hmma.count("HGMMA") == 0 and hmma.global_loads.get(128)
    assert any(op.startswith("HMMA.16816.F32.BF16") for op in hmma.opcodes)
    spills = sass["register_spills"]["rowsum_regs"]
    assert spills.count("LDL") >= 100 and spills.count("STL") >= 100
    table = sass["local_memory_array"]["poly_table"]
    assert table.count("LDL") > 0 and table.count("STL") > 0


# -- stage 1 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("case", "bound"),
    [("good_vectorized", Bound.MEMORY), ("good_rowsum", Bound.MEMORY), ("uncoalesced", Bound.MEMORY),
     ("many_small_launches", Bound.LAUNCH), ("tiny_grid", Bound.LATENCY), ("divergent", Bound.COMPUTE)],
)  # fmt: skip
def test_stage1_classifies_clear_cases(case, bound):
    cls = classify(recorded(case))
    assert cls.bound == bound, cls.summary
    if bound != Bound.LAUNCH:
        assert cls.busy_fraction is not None and cls.busy_fraction > 0.8  # one kernel keeps the GPU busy


def test_stage1_single_kernels_are_not_launch_bound():
    """A single ~70 us kernel is not launch-bound even though a synchronised call costs ~0.3 ms of host time."""
    for case in CASES:
        if expect(case)["launches"] == 1:
            assert classify(recorded(case)).bound != Bound.LAUNCH, case


def test_stage1_many_tiny_launches_are_launch_bound_even_with_a_busy_gpu():
    """256 kernels of under 1 us each cannot be fed by the host, whatever the busy ratio of one recording."""
    ev = recorded("many_small_launches")
    busier = dataclasses.replace(
        ev, timing=dataclasses.replace(ev.timing, median_ms=ev.system["gpu_busy_us_per_call"] * 1.2e-3)
    )
    assert classify(busier).busy_fraction > 0.8
    assert classify(busier).bound == Bound.LAUNCH
    few = dataclasses.replace(ev, system={**ev.system, "kernels_per_call": 2.0, "gpu_busy_us_per_call": 1.0})
    assert classify(few).bound != Bound.LAUNCH  # two short launches are not a launch problem


def test_stage1_naive_matmul_is_far_from_the_tensor_core_roofline():
    ev = recorded("naive_ffma_matmul")
    cls = classify(ev)
    k = ev.dominant()
    assert k.get("sm__inst_executed_pipe_tensor_op_hmma.sum") == 0  # nothing ran on tensor cores
    assert cls.task_intensity > cls.ridge  # a compute floor: the task belongs on tensor cores
    assert cls.achieved_flops < 0.05 * ev.ceilings.tf32_flops
    assert cls.fraction_of_floor < 0.05
    assert cls.bound != Bound.LAUNCH


def test_launch_overhead_suggests_fusing_and_a_cuda_graph_on_many_tiny_launches():
    """The recorded 256 launches a call: launch_overhead names both fixes the expert can make, fusing the
    kernels and replaying the call from a CUDA graph (the capture_graph edit)."""
    from pipeline.profile.tools.launch_overhead import LaunchOverhead

    ev = recorded("many_small_launches")
    (f,) = LaunchOverhead().analyze(ev, classify(ev))
    assert f.edits == ("fuse_kernels", "capture_graph") and "CUDA graph" in f.advice


def test_wgmma_pipeline_names_the_kernel_whose_mmas_ptxas_serialized():
    """The compile's report (parse_ptxas) is the evidence: a recorded tensor-core kernel given ptxas's C7518
    line ranks the serialization among its findings; its own clean report draws none; C7517 alone is milder."""
    from pipeline.compile import parse_ptxas

    ev, _, findings = run("tensor_core_hmma")
    assert "wgmma_pipeline" not in {f.tool for f in findings}
    name = ev.dominant().name
    ptxas = (
        f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'\n"
        "ptxas info    : Used 128 registers, used 1 barriers\n"
    )
    serialized = parse_ptxas(
        ptxas + "ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are "
        f"serialized due to program dependence on compiler-inserted WG.DP in divergent path in the function '{name}'\n"
    )
    injected = parse_ptxas(
        ptxas
        + "ptxas info    : (C7517) warpgroup.wait is injected in around line 99 by compiler to allow use "
        f"of registers defined by GMMA in function '{name}'\n"
    )
    severities = []
    for resources in (serialized, injected):
        _, found = analyze(dataclasses.replace(ev, resources=resources))
        (f,) = [f for f in found if f.tool == "wgmma_pipeline"]
        assert name in f.diagnosis and f.edits == ("pipeline_loads",) and f.expected_gain > 0, f
        severities.append(f.severity)
    assert severities[0] > severities[1] > 0.3, severities
