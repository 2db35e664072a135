"""The run report from run logs recorded on the H200 (tests/fixtures/runs/): the Markdown says what the log
says, the HTML has every section and every evaluation, and `show` renders without writing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline import report
from pipeline.runlog import RunLogError, read_events
from pipeline.runstate import fold
from pipeline.search import matched
from pipeline.types import Status

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "tests" / "fixtures" / "runs" / "softmax"
RECORDINGS = sorted(p.parent.name for p in RUNS.glob("*/log.jsonl"))


def copy_run(tmp_path: Path, name: str, edit=None) -> Path:
    """A recorded run in a runs folder of its own; `edit` may change the list of events (seqs renumbered)."""
    events = [json.loads(x) for x in (RUNS / name / "log.jsonl").read_text().splitlines()]
    if edit:
        events = edit(events)
    for i, e in enumerate(events):
        e["seq"] = i
    folder = tmp_path / "runs" / name
    folder.mkdir(parents=True)
    (folder / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def results(folder: Path) -> list:
    return [e for e in read_events(folder / "log.jsonl") if e.type == "result"]


@pytest.mark.parametrize("name", RECORDINGS)
def test_markdown_says_what_the_log_says(tmp_path, name):
    folder = copy_run(tmp_path, name)
    events = read_events(folder / "log.jsonl")
    md = report.render(folder).markdown
    end = next(e.data for e in reversed(events) if e.type == "end")
    timings = next(e.data for e in events if e.type == "baselines")["timings"]
    assert md.startswith(f"# kernelpro run {name}\n")
    assert f"- stopped: {end['reason']}; {end['evaluations']} evaluations" in md
    assert (
        f"- eager: {timings['eager']['median_ms']:.4f} ms; torch.compile: {timings['compile']['median_ms']:.4f} ms"
        in md
    )
    assert f"`{end['best_key']}`" in md and f"{end['best_speedup_eager']:.2f}x over eager" in md
    # The tree: the reference and one line per proposal, each with its speedup or its status.
    tree = md.split("## Search tree\n\n")[1].split("\n\n")[0].splitlines()
    proposals = [e.data for e in events if e.type == "proposal"]
    assert len(tree) == 1 + len(proposals)
    for p in proposals:
        assert any(line.lstrip().startswith(f"- #{p['node']} {p['edit']} — ") for line in tree), p["node"]
    for section in ("## Best candidate", "## Best speedup over eager, by evaluation", "## What paid off",
                    "## Environment"):  # fmt: skip
        assert section in md


def test_the_kernels_that_ran_are_in_the_report_and_the_bench_row(tmp_path):
    """Measurement.kernels (every kernel of the call the profiler check watched, us by name): the run report's
    best candidate names its three longest with their shares, and its bench row keeps them all, longest
    first. A log recorded before the field (the others here) says nothing of them."""
    from pipeline import bench

    ran = {"kp_rows_cluster": 900.0, "kp_total": 60.0, "kp_gather_f32": 30.0, "kp_pad": 10.0}

    def add(events):
        for e in events:
            m = (e["data"].get("measurement") or {}) if e["type"] in ("result", "final") else {}
            if m.get("timing"):
                m["kernels"] = dict(ran)
        return events

    folder = copy_run(tmp_path, RECORDINGS[0], add)
    md = report.render(folder).markdown
    line = next(x for x in md.splitlines() if x.startswith("- kernels in a call: "))
    assert line == (
        "- kernels in a call: `kp_rows_cluster` 90% (0.9 ms), `kp_total` 6% (0.06 ms), `kp_gather_f32` 3% "
        "(0.03 ms), and 1 more"
    )
    row = bench.summarise(folder)
    assert list(row["kernels"]) == ["kp_rows_cluster", "kp_total", "kp_gather_f32", "kp_pad"]
    plain = copy_run(tmp_path / "plain", RECORDINGS[0])
    assert "kernels in a call" not in report.render(plain).markdown and "kernels" not in bench.summarise(
        plain
    )


@pytest.mark.parametrize("name", RECORDINGS)
def test_html_has_every_section_and_every_evaluation(tmp_path, name):
    folder = copy_run(tmp_path, name)
    html = report.render(folder).html
    for section in ("summary", "best", "matched", "progress", "evaluations", "roofline", "energy", "paid-off",
                    "tree", "environment"):  # fmt: skip
        assert f'<section id="{section}">' in html, section
    done = results(folder)
    # Every evaluation is a point of the progress plot (matplotlib keeps each point's gid) and a table row.
    points = re.findall(r'<g id="eval-(\d+)"', html)
    assert sorted(map(int, points)) == list(range(1, len(done) + 1))
    rows = re.findall(r'<tr id="evaluation-(\d+)">', html)
    assert len(rows) == len(done)
    for r, n in zip(done, rows, strict=True):
        row = html.split(f'<tr id="evaluation-{n}">')[1].split("</tr>")[0]
        assert f"s-{r.data['verdict']['status']}" in row and f"#{r.data['node']}" in row
    # Eager = 1, torch.compile and the roofline floor as lines of the progress plot.
    for line in ("line-eager", "line-torch.compile", "line-roofline floor"):
        assert f'id="{line}"' in html, line
    # The search tree: every node, coloured by its status.
    status = {r.data["node"]: r.data["verdict"]["status"] for r in done}
    for node, st in status.items():
        assert re.search(rf'<li id="node-{node}"><span class="status s-{st}">', html), node
    # The roofline of the candidates: a task that does no arithmetic is plotted as bandwidth.
    assert len(re.findall(r'<g id="roof-\d+"', html)) == sum(
        r.data["verdict"]["status"] == "ok" for r in done
    )
    assert "no arithmetic" in html and "copy ceiling of NVIDIA H200" in html  # calibrated before the run
    assert "J per call" in html  # the energy panel: the eager baseline and the re-measured best


def test_html_markdown_body_escapes_raw_html(tmp_path):
    def edit(events):
        for e in events:
            if e["type"] == "proposal" and e["data"]["node"] == 1:
                e["data"]["edit"] = "<script>alert(1)</script> unroll"
        return events

    html = report.render(copy_run(tmp_path, "mcts", edit)).html
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_roofline_with_the_runs_measured_ceilings(tmp_path):
    ceilings = {"gpu": "NVIDIA H200", "copy_bytes_per_s": 4.3e12, "fp32_flops": 5.1e13, "tf32_flops": 3.7e14,
                "bf16_flops": 7.2e14, "environment": {}}  # fmt: skip

    def with_ceilings(events):
        i = next(i for i, e in enumerate(events) if e["type"] == "baselines")
        return [
            *events[: i + 1],
            {"seq": 0, "type": "ceilings", "t": 0.0, "data": ceilings},
            *events[i + 1 :],
        ]

    html = report.render(copy_run(tmp_path, "mcts", with_ceilings)).html
    assert "copy ceiling of NVIDIA H200" in html and "holds no measured ceilings" not in html

    def without_ceilings(events):  # a run before calibration: said, and drawn without ceilings
        return [e for e in events if e["type"] != "ceilings"]

    html = report.render(copy_run(tmp_path / "none", "mcts", without_ceilings)).html
    assert "holds no measured ceilings" in html and "copy ceiling of" not in html

    def with_flops(events):  # the same run as if the task did arithmetic: the classic roofline
        events = with_ceilings(events)
        events[0]["data"]["task"]["flops"] = 2.0e9
        return events

    html = report.render(copy_run(tmp_path / "f", "mcts", with_flops)).html
    assert "arithmetic intensity" in html and "ceilings of NVIDIA H200" in html
    assert "FLOP/byte" in html


def test_no_energy_panel_without_energy(tmp_path):
    def strip(events):
        for e in events:
            e["data"].pop("energy_eager_j", None)
            m = e["data"].get("measurement")
            if m:
                m["energy"] = None
        return events

    html = report.render(copy_run(tmp_path, "mcts", strip)).html
    assert '<section id="energy">' not in html and '<section id="roofline">' in html


def test_render_writes_nothing_and_write_report_writes_both(tmp_path):
    folder = copy_run(tmp_path, "mcts")
    rep = report.render(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["log.jsonl"]
    path = report.write_report(folder)
    assert path.read_text() == rep.markdown and (folder / "report.html").read_text() == rep.html


def test_show_prints_the_rendered_report_and_leaves_the_folder_alone(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    folder = copy_run(tmp_path, "mcts")
    stamp = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    res = CliRunner().invoke(app, ["show", "mcts", "--runs-dir", str(tmp_path / "runs")])
    assert res.exit_code == 0, res.output
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamp  # no report.md, no report.html
    assert "Search tree" in res.stdout and "## Search tree" not in res.stdout  # rendered, not raw Markdown
    assert "•" in res.stdout and "`" not in res.stdout
    end = next(e.data for e in reversed(read_events(folder)) if e.type == "end")
    assert end["best_key"] in res.stdout


def test_a_log_that_is_not_one_tree_is_an_error_in_one_line(tmp_path):
    def orphan(events):
        next(e for e in events if e["type"] == "profile")["data"]["node"] = 42
        return events

    with pytest.raises(RunLogError, match="names node 42, which no proposal made"):
        report.load_view(copy_run(tmp_path, "mcts", orphan))


def test_every_status_has_a_colour():
    assert {s.value for s in Status} <= set(report.COLOURS)


def test_a_failed_evaluation_is_a_point_and_a_node_of_its_status(tmp_path):
    def fail_first(events):
        r = next(e for e in events if e["type"] == "result")
        r["data"]["verdict"]["status"] = "compile_error"
        r["data"]["measurement"] = None
        return events

    folder = copy_run(tmp_path, "mcts", fail_first)
    node = results(folder)[0].data["node"]
    html = report.render(folder).html
    point = html.split('<g id="eval-1"')[1].split("</g>")[0]
    assert report.COLOURS["compile_error"] in point and report.COLOURS["ok"] not in point
    assert re.search(rf'<li id="node-{node}"><span class="status s-compile_error">', html)
    row = html.split('<tr id="evaluation-1">')[1].split("</tr>")[0]
    assert "s-compile_error" in row and "–" in row  # no time for a kernel that did not compile


# -- energy at matched speed ------------------------------------------------------------------------------


def test_a_run_without_energy_readings_says_so_in_one_line(tmp_path):
    rep = report.render(copy_run(tmp_path, "mcts"))  # recorded under --objective time: no candidate energies
    body = rep.markdown.split("## Energy at matched speed\n\n")[1].split("\n\n")[0]
    assert body == report.NO_ENERGY
    html = rep.html.split('<section id="matched">')[1].split("</section>")[0]
    assert "<svg" not in html and "No energy readings" in html


def with_energies(joules_of, spread=0.004, tolerance="0.03", eager_j=None):
    """The recorded run as if measured under --objective energy: each verified result with an energy per
    call (joules_of(node, ms)), eager's Energy with its spread, no end (the report makes the choice)."""

    def edit(events):
        out = []
        for e in events:
            d = e["data"]
            if e["type"] == "end":
                continue
            if e["type"] == "start":
                d["config"].update(objective="energy", speed_tolerance=tolerance)
            if e["type"] == "baselines":
                j = d["energy_eager_j"] = eager_j or d["energy_eager_j"]
                d["energy_eager"] = {"joules_per_call": j, "avg_power_w": 699.0, "window_s": 1.5, "repeats": 4,
                                     "spread": 0.002}  # fmt: skip
            m = d.get("measurement") if e["type"] == "result" else None
            if m and m.get("timing"):
                j = joules_of(d["node"], m["timing"]["median_ms"])
                m["energy"] = {"joules_per_call": j, "avg_power_w": 700.0, "window_s": 1.5, "repeats": 3,
                               "spread": spread}  # fmt: skip
            out.append(e)
        return out

    return edit


def test_scatter_front_and_savings_at_matched_speed(tmp_path):
    # 700 W for every candidate, but node 3 (0.81% slower than the fastest, node 7) 10% below that.
    folder = copy_run(tmp_path, "mcts", with_energies(lambda n, ms: 0.7 * ms * (0.9 if n == 3 else 1.0)))
    state = fold(read_events(folder / "log.jsonl"))
    cands = {c.node: c for c in state.at_speed()}
    rep = report.render(folder)
    # Every verified candidate is a point of the scatter; the front, the bound and the choice are drawn.
    html = rep.html.split('<section id="matched">')[1].split("</section>")[0]
    assert sorted({int(n) for n in re.findall(r'<g id="te-(\d+)"', html)}) == sorted(cands)
    for gid in ("pareto", "speed-bound", "chosen", "te-eager"):
        assert f'<g id="{gid}"' in html, gid
    md = rep.markdown.split("## Energy at matched speed\n\n")[1].split("\n\n")[0]
    # Within 3% node 3 is at speed and 10% lower: the choice, against eager and against the fastest.
    c3, c7 = cands[3], cands[7]
    assert c3.joules is not None and c7.joules is not None and state.baselines is not None
    assert "- chosen: node #3 " in md and "at speed)" in md
    eager = matched.saving(state.baselines.energy_eager_j or 0.0, 0.002, c3.joules, 0.004)
    assert f"- saving against eager: {eager.ratio:.3f}x ± {100 * eager.spread:.1f}% (beyond noise)" in md  # type: ignore[operator]
    vs_fast = c7.joules / c3.joules
    assert f"- saving against the fastest candidate (node #7): {vs_fast:.3f}x ± 0.6% (beyond noise)" in md
    front = matched.pareto_front(list(cands.values()))
    assert [c.node for c in front] == [7, 3]
    listed = ", ".join(f"#{c.node} ({c.time_ms:.4f} ms, {1e3 * (c.joules or 0):.4g} mJ)" for c in front)
    assert f"- Pareto front (time, energy): {listed}\n" in md
    # The best-candidate section follows the choice under energy; a re-measurement's spread is shown.
    best = rep.markdown.split("## Best candidate")[1].split("\n## ")[0]
    assert "- node #3 `" in best
    assert "mJ per call at 694 W (± 0.9% over 6 windows)\n" in best  # the recorded re-measurement's spread

    def remeasured_with_spread(events):
        for e in events:
            if e["type"] == "final":
                e["data"]["measurement"]["energy"].update(spread=0.0031, repeats=5)
        return events

    md = report.render(copy_run(tmp_path / "s", "mcts", remeasured_with_spread)).markdown
    assert "mJ per call at 694 W (± 0.3% over 5 windows)" in md


def test_savings_within_noise_and_out_of_bound(tmp_path):
    # 1% below the fastest is within noise: the tie goes to the faster, node 7.
    folder = copy_run(tmp_path, "mcts", with_energies(lambda n, ms: 0.7 * ms * (0.99 if n == 3 else 1.0)))
    assert "- chosen: node #7 " in report.render(folder).markdown
    # At 0.2% node 3 (0.81% slower) is out of bound however frugal: the fastest is chosen.
    ten_less = with_energies(lambda n, ms: 0.7 * ms * (0.9 if n == 3 else 1.0), tolerance="0.002")
    md = report.render(copy_run(tmp_path / "b", "mcts", ten_less)).markdown
    assert "- chosen: node #7 " in md and "the chosen one is the fastest" in md
    # Eager 1% above the chosen candidate: a saving the noise cannot tell from none is not claimed.
    near_eager = with_energies(lambda n, ms: 0.7 * ms, eager_j=1.01 * 0.7 * 0.13415999710559845)
    md = report.render(copy_run(tmp_path / "c", "mcts", near_eager)).markdown
    assert "- saving against eager: 1.010x ± 0.4% (within noise: not claimed)" in md
