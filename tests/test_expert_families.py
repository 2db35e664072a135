"""The expert's op families (pipeline/generate/expert/families/): the registry that finds them, what each
declares, the plan knobs and their JSON, which regions they claim, and the kernel signatures that write
both sides of every launch."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import textwrap
from pathlib import Path

import pytest

from pipeline.generate.base import Context
from pipeline.generate.expert import ExpertPolicy, capture, plan_of
from pipeline.generate.expert.families import FAMILIES, by_tag, discover, family_of, owner
from pipeline.generate.expert.families.base import Family
from pipeline.generate.expert.families.colwise import ColPlan
from pipeline.generate.expert.families.gemm16 import GemmPlan
from pipeline.generate.expert.families.rowwise import RowPlan
from pipeline.generate.expert.plan import Plan, RegionPlan
from pipeline.generate.expert.regions import FALLBACK
from pipeline.generate.expert.render import prepare
from pipeline.generate.expert.templates.signature import Signature, i32, i64, ptr
from pipeline.static_check import RUNTIME_METHODS
from pipeline.tasks import probe

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
BUILTIN = sorted((ROOT / "tasks").glob("*.py"))
FAMILY_DIR = ROOT / "pipeline" / "generate" / "expert" / "families"


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Path]:
    """The built-in tasks and the CPU tests' family cases (every template, the op vocabulary)."""
    from test_expert import CASES, task_file

    folder = tmp_path_factory.mktemp("family-cases")
    out = {p.stem: p for p in BUILTIN}
    out |= {
        name: task_file(folder, name, body, inputs, init) for name, (body, inputs, init, _) in CASES.items()
    }
    fp32_linear = """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(64, 24)
            def forward(self, x):
                return torch.relu(self.linear(x))
        """
    out["linear_fp32"] = task_file(folder, "linear_fp32", fp32_linear, "[torch.randn(5, 64)]")
    from test_moe import _loop

    out["moe_loop"] = _loop(folder, "swiglu_skip_idle")  # a grouped GEMM
    return out


# ------------------------------------------------------------------------------------------- registry


def test_every_module_that_declares_a_family_is_registered_once():
    declared = [p.stem for p in FAMILY_DIR.glob("*.py") if re.search(r"^FAMILY = \w", p.read_text(), re.M)]
    assert len(declared) >= 6  # elementwise, row-wise, strided, scan, 16-bit GEMM, fp32 GEMM
    assert len(FAMILIES) == len(declared) == len({f.tag for f in FAMILIES})
    assert [f.order for f in FAMILIES] == sorted(f.order for f in FAMILIES)
    for f in FAMILIES:
        assert by_tag(f.tag) is f and owner(f.knobs("r")) is f


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.tag)
def test_a_family_declares_knobs_with_defaults_and_edits_that_exist(family: Family):
    assert issubclass(family.knobs, RegionPlan) and family.knobs.TAG
    fields = dataclasses.fields(family.knobs)
    assert fields[0].name == "rid" and all(f.default is not dataclasses.MISSING for f in fields[1:])
    assert set(family.knobs.SHOWN) | set(family.knobs.ABSORBS) <= {f.name for f in fields}
    assert family.edits and all(callable(e) for e in family.edits.values())
    plain = family.plainest(family.knobs("r"))
    assert plain is None or plain == family.knobs("r")
    assert family.optional or plain is not None  # a region with no library fallback keeps an entry


def _module(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))


TOY = """
    from dataclasses import dataclass
    from typing import ClassVar

    from pipeline.generate.expert.families.base import Family
    from pipeline.generate.expert.plan import RegionPlan


    @dataclass(frozen=True)
    class ToyPlan(RegionPlan):
        TAG: ClassVar[str] = "{tag}"
        width: int = 1


    FAMILY = Family(ToyPlan, claims=lambda r, low: False, first=lambda r, low, tuned: None,
                    render=lambda r, rp, low, hunter: None, edits={{}}, order={order})
"""


def test_discovery_takes_each_module_that_defines_a_family(tmp_path, monkeypatch):
    pkg = tmp_path / "toyfamilies"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _module(pkg, "helpers", "SIZE = 3\n")  # a helper module: no FAMILY, not a family
    _module(pkg, "late", TOY.format(tag="late", order=30))
    _module(pkg, "early", TOY.format(tag="early", order=5))
    monkeypatch.syspath_prepend(str(tmp_path))
    found = discover("toyfamilies")
    assert [f.tag for f in found] == ["early", "late"]  # by order, whatever the module names
    _module(pkg, "twin", TOY.format(tag="early", order=7))
    importlib.invalidate_caches()  # a module written after the package was imported
    with pytest.raises(ImportError, match="distinct"):
        discover("toyfamilies")


# ----------------------------------------------------------------------------------------------- knobs


def _changed_knobs(knobs: type[RegionPlan]) -> RegionPlan:
    values = {}
    for f in dataclasses.fields(knobs)[1:]:
        d = f.default
        values[f.name] = (not d) if isinstance(d, bool) else (d + 3) if isinstance(d, int) else f"{d}x"
    return knobs("r", **values)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.tag)
def test_every_familys_plan_entry_round_trips_through_the_source_header(family: Family):
    entry = _changed_knobs(family.knobs)
    plan = Plan((family.knobs("a"), entry))
    text = plan.to_json()
    assert f'"family":"{family.tag}"' in text and '"rid":"a"}' in text  # defaults are left out
    assert Plan.from_json(text) == plan
    assert plan_of(f"// kernelpro-expert-plan: {text}\n") == plan


def test_an_entry_of_an_unknown_family_makes_the_source_foreign():
    assert plan_of('// kernelpro-expert-plan: {"regions":[{"family":"nope","rid":"a"}],"v":1}\n') is None


def test_describe_lists_knobs_in_declaration_order_flags_by_name():
    assert RowPlan("r", vec=4, regs=16, warp_reduce=True, epilogue="e").describe() == (
        "row vec=4 threads=256 regs=16 warp_reduce epilogue=e"
    )
    assert ColPlan("c", splits=2).describe() == "col vec=1 threads=256 splits=2 bx=32"  # bx always shown
    assert GemmPlan("g", 128, 4, "e").describe() == (
        "wgmma tile=128x128x64 stages=4 (TMA, 2 consumer warpgroups) epilogue=e"
    )
    assert Plan((RowPlan("r", prologue="p", epilogue="e"), GemmPlan("g", epilogue="f"))).fused() == {
        "p",
        "e",
        "f",
    }


# ---------------------------------------------------------------------------------------------- claims


def test_each_kernel_region_is_computed_by_one_family(cases):
    """One family computes each region: the only one that claims it, or (a pattern that starts at a region
    another family also takes, such as an attention at its first product) the first by order, never a tie."""
    claimed: set[str] = set()
    overlaps = set()
    for name, path in cases.items():
        low = prepare(capture(path))
        for r in low.regions:
            takers = [f.tag for f in FAMILIES if f.claims(r, low)]
            orders = [by_tag(t).order for t in takers]
            assert len(set(orders)) == len(orders), (name, r.rid, takers)
            if len(takers) > 1:
                overlaps.add(tuple(takers))
            if r.kind not in FALLBACK:  # no torch path of its own: some family must compute it
                assert takers, (name, r.rid, r.kind)
            if takers:
                assert family_of(r, low) is by_tag(takers[0])
                claimed.add(takers[0])
    assert claimed == {f.tag for f in FAMILIES}  # every family has a region in these tasks
    assert overlaps <= {("attention", "wgmma_3xtf32")}, overlaps  # the only pattern over another's region


# ------------------------------------------------------------------------------------------ signatures


def test_a_signature_writes_the_c_parameters_and_the_launcher_arguments_from_one_list():
    sig = Signature(
        (ptr("x", "__half"), ptr("y", "float", "out", const=False), i64("rows", "m * k"), i32("s"))
    )
    assert sig.decls() == "const __half* __restrict__ x, float* __restrict__ y, long long rows, int s"
    assert sig.names() == "x, y, rows, s"
    assert sig.args() == "x, out, numpy.int64(m * k), numpy.int32(s)"


def _c_params(source: str) -> dict[str, list[str]]:
    out = {}
    for m in re.finditer(
        # the launch bounds and a cluster's dims (the grouped GEMM's multicast) may stand before the name
        r'extern "C" __global__ void\s+(?:__(?:launch_bounds|cluster_dims)__\([^)]*\)\s*)*(\w+)\(([^)]*)\)',
        source,
    ):
        out[m.group(1)] = [" ".join(p.split()) for p in m.group(2).split(",")]
    return out


def _launches(launcher: str) -> list[tuple[str, list[ast.expr]]]:
    """(kernel, argument expressions) of every launch whose argument tuple is spelled out in the launcher."""
    # One walk: each node goes to the innermost function it stands in.
    found: dict[
        int, tuple[dict[int, ast.Tuple], list[ast.Call]]
    ] = {}  # function -> (line -> `args = (...)`, calls)
    stack: list[tuple[ast.AST, int | None]] = [(ast.parse(launcher), None)]
    while stack:
        node, fn = stack.pop()
        if isinstance(node, ast.FunctionDef):
            fn = id(node)
            found[fn] = ({}, [])
        elif fn is not None:
            tuples, calls = found[fn]
            named = isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)]
            if named and "args" in named and isinstance(node.value, ast.Tuple):
                tuples[node.lineno] = node.value
            f = node.func if isinstance(node, ast.Call) else None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "kernels":
                calls.append(node)
        stack.extend((child, fn) for child in ast.iter_child_nodes(node))
    out = []
    for tuples, calls in found.values():
        for call in sorted(calls, key=lambda c: c.lineno):
            if call.func.attr in RUNTIME_METHODS:  # the runtime's own (tensor_map, graphed, ...), no kernel
                continue
            arg = call.args[2]
            if isinstance(arg, ast.Name):  # the latest `args = (...)` above the launch
                arg = tuples[max(line for line in tuples if line < call.lineno)]
            if not any(isinstance(e, ast.Starred) for e in arg.elts):  # the gather helper spreads its sizes
                out.append((call.func.attr, arg.elts))
    return out


def _launch_mismatches(path: Path) -> tuple[int, list[tuple]]:
    """Launches checked, and those whose arguments do not match their kernel's parameters, over the first
    proposals of one task and the edits of two of them."""
    policy, seen, bad = ExpertPolicy(), 0, []
    task = probe(path)
    first = policy.propose(Context(task=task, reference=task.source, parent=None), 8)
    cands = [p.candidate for p in first if p.candidate]
    for c in cands[:2]:
        kids = policy.propose(Context(task=task, reference=task.source, parent=c), 30)
        cands += [k.candidate for k in kids if k.candidate]
    for c in cands:
        params = _c_params(c.source)
        for name, args in _launches(c.launcher):
            decls = params[name]
            texts = [ast.unparse(a) for a in args]
            if len(args) != len(decls):
                bad.append((c.edit, name, decls, texts))
            for decl, text in zip(decls, texts, strict=False):
                want = {"long long": "numpy.int64(", "int": "numpy.int32("}.get(decl.rsplit(" ", 1)[0])
                if not (text.startswith(want) if want else not text.startswith("numpy.")):
                    bad.append((c.edit, decl, text))
            seen += 1
    return seen, bad


def test_every_launch_passes_the_arguments_its_kernel_declares(cases):
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(4, os.cpu_count() or 1))  # a process a core: proposing is single-threaded Python
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        results = list(ex.map(_launch_mismatches, cases.values()))
    bad = [b for _, found in results for b in found]
    assert not bad, bad[:5]
    assert sum(seen for seen, _ in results) > 500
