"""The run report from run logs recorded on the H200 (tests/fixtures/runs/): the Markdown says what the log
says, the HTML has every section and every evaluation, and `show` renders without writing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline import report
from pipeline.runlog import RunLogError, read_events
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


@pytest.mark.parametrize("name", RECORDINGS)
def test_html_has_every_section_and_every_evaluation(tmp_path, name):
    folder = copy_run(tmp_path, name)
    html = report.render(folder).html
    for section in ("summary", "best", "progress", "evaluations", "roofline", "energy", "paid-off", "tree",
                    "environment"):  # fmt: skip
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
    assert "no arithmetic" in html and "holds no measured ceilings" in html
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
