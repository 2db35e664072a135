"""The LLM policy over real HTTP: the `openai` client against a scripted chat-completions server on loopback
(tests/loopback_llm.py). Prompts, parsing, retries, timeouts, tool calls, budgets, concurrency, and the key
kept out of everything the policy returns. CPU only, no network beyond 127.0.0.1.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from loopback_llm import ROOT, SOFTMAX, LoopbackLLM, Reply, Status, good, good_content, malformed, tool_call

from pipeline.config import Config
from pipeline.generate.base import Context, Lesson, Outcome, ProposalStatus, Tried
from pipeline.generate.llm import Budget, LLMConfigError, LLMPolicy, render, trim_errors
from pipeline.generate.parse import UnparseableReply, fences, parse_reply, to_candidate
from pipeline.generate.toolbox import NO_EVIDENCE, NO_INDEX, LocalToolBox
from pipeline.profile.evidence import load_recorded
from pipeline.static_check import check_launcher
from pipeline.types import Finding, Task, TensorSpec

KEY = "sk-test-loopback-0123456789abcdef"
RECORDED = ROOT / "tests" / "fixtures" / "profiling" / "recorded" / "uncoalesced"
PARENT_SRC = (SOFTMAX / "kernel.cu").read_text()
PARENT_LAUNCHER = (SOFTMAX / "launcher.py").read_text()
BOUND = "memory-bound: DRAM 81% of peak; 0.163 ms against a floor of 0.125 ms"
FEEDBACK = "Bottleneck: memory-bound.\n1. [vector_width] Loads are 4 bytes wide. Fix: use float4 loads."


@pytest.fixture
def server():
    with LoopbackLLM() as s:
        yield s


def config(server: LoopbackLLM | None, **kw) -> Config:
    base = dict(
        llm_base_url=server.url if server else None,
        llm_api_key=KEY,
        llm_model="loopback-model",
        llm_retries=2,
        llm_timeout_s=5.0,
        llm_concurrency=4,
        llm_tool_calls=3,
    )
    base.update(kw)
    return Config(**base)


def policy(server: LoopbackLLM, toolbox=None, budget=None, **kw) -> LLMPolicy:
    return LLMPolicy(config(server, **kw), toolbox=toolbox, budget=budget, backoff_s=0.01)


def task() -> Task:
    shape = (16384, 4096)
    return Task(
        id="softmax",
        path=str(ROOT / "tasks" / "softmax.py"),
        source=(ROOT / "tasks" / "softmax.py").read_text(),
        source_hash="0" * 64,
        dtype="float32",
        atol=1e-5,
        rtol=1e-5,
        norm_tol=1e-5,
        inputs=(TensorSpec(shape, "float32"),),
        outputs=(TensorSpec(shape, "float32"),),
        init_args="[]",
        flops=5.0 * shape[0] * shape[1],
        min_bytes=2 * 4 * shape[0] * shape[1],
        param_bytes=0,
    )


def context(parent: bool = True, **kw) -> Context:
    from pipeline.candidates import make_candidate

    t = task()
    cand = make_candidate(t.id, PARENT_SRC, PARENT_LAUNCHER, edit="llm: first kernel") if parent else None
    base = dict(task=t, reference=t.source, parent=cand, bound=BOUND, feedback=FEEDBACK)
    base.update(kw)
    return Context(**base)


def assert_no_key(*things: object) -> None:
    for t in things:
        assert KEY not in repr(t)


# --- proposals -------------------------------------------------------------------------------------------


def test_good_reply_builds_a_candidate_that_passes_the_static_check(server):
    ctx = context()
    [p] = policy(server).propose(ctx, 1)
    assert p.status == ProposalStatus.OK, p.reason
    c = p.candidate
    assert c is not None and c.task_id == "softmax"
    assert c.parent == ctx.parent.key
    assert c.edit == p.edit == "llm: vectorized row softmax"
    assert p.reason == "Rows stay in registers."
    assert 'extern "C" __global__' in c.source and "class ModelNew" in c.launcher
    assert check_launcher(c.launcher).ok
    assert p.usage.calls == 1 and p.usage.prompt_tokens == 1000 and p.usage.completion_tokens == 500
    [req] = server.requests
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert req.body["model"] == "loopback-model"
    assert "tools" not in req.body  # no toolbox: no tools offered
    assert_no_key(p)


def test_first_kernel_has_no_parent(server):
    [p] = policy(server).propose(context(parent=False), 1)
    assert p.status == ProposalStatus.OK and p.candidate.parent is None
    assert "No kernel yet" in server.requests[0].text()


def test_malformed_reply_is_unparseable(server):
    server.script(malformed())
    [p] = policy(server).propose(context(), 1)
    assert p.status == ProposalStatus.UNPARSEABLE
    assert "no fenced code block" in p.reason
    assert p.candidate is None and p.usage.calls == 1


def test_rate_limit_then_success(server):
    server.script(Status(429, "slow down", retry_after="0"), good())
    [p] = policy(server).propose(context(), 1)
    assert p.status == ProposalStatus.OK
    assert p.usage.calls == 2 and len(server.requests) == 2


def test_persistent_server_error_is_refused_after_retries(server):
    server.default = Status(500, "upstream exploded")
    [p] = policy(server, llm_retries=2).propose(context(), 1)
    assert p.status == ProposalStatus.REFUSED
    assert "HTTP 500" in p.reason and "upstream exploded" in p.reason and "3 attempts" in p.reason
    assert p.usage.calls == 3 and len(server.requests) == 3


def test_timeout_is_refused_with_a_timeout_reason(server):
    server.script(Reply(content=good_content(), delay_s=2.0))
    t0 = time.monotonic()
    [p] = policy(server, llm_timeout_s=0.3).propose(context(), 1)
    assert p.status == ProposalStatus.REFUSED
    assert "timeout" in p.reason
    assert time.monotonic() - t0 < 1.8


def test_client_error_is_refused_at_once_and_the_key_never_leaks(server):
    # An endpoint that echoes the key back (some proxies do) must not put it in the reason.
    server.script(Status(401, f"Incorrect API key provided: {KEY}. Authorization: Bearer {KEY}"))
    [p] = policy(server).propose(context(), 1)
    assert p.status == ProposalStatus.REFUSED
    assert p.reason.startswith("HTTP 401") and "***" in p.reason
    assert p.usage.calls == 1
    assert_no_key(p, policy(server))


def test_base_url_without_key_uses_a_placeholder(server):
    pol = LLMPolicy(config(server, llm_api_key=None), backoff_s=0.01)
    [p] = pol.propose(context(), 1)
    assert p.status == ProposalStatus.OK
    assert server.requests[0].headers["authorization"] == "Bearer none"


def test_no_endpoint_is_a_config_error():
    with pytest.raises(LLMConfigError, match="KERNELPRO_LLM_BASE_URL"):
        LLMPolicy(Config(llm_base_url=None, llm_api_key=None))


# --- tool calls ------------------------------------------------------------------------------------------


def test_tool_round_trip_without_an_index(server):
    server.script(tool_call("search_sources", {"query": "wgmma tma"}), good())
    box = LocalToolBox(hunter=None, evidence=load_recorded(RECORDED))
    [p] = policy(server, toolbox=box).propose(context(), 1)
    assert p.status == ProposalStatus.OK, p.reason
    assert p.usage.tool_calls == ("search_sources(query='wgmma tma')",)
    assert p.usage.calls == 2
    first, second = server.requests
    offered = {t["function"]["name"] for t in first.body["tools"]}
    assert offered == {"profile", "list_profile_tools"}  # no index: the source tools are left out
    tool_msgs = [m for m in second.messages if m["role"] == "tool"]
    assert tool_msgs == [{"role": "tool", "tool_call_id": "call_1", "content": NO_INDEX}]
    assistant = next(m for m in second.messages if m["role"] == "assistant")
    assert assistant["tool_calls"][0]["function"]["name"] == "search_sources"


def test_profile_tool_returns_the_finding_on_the_parent(server):
    ev = load_recorded(RECORDED)
    server.script(tool_call("profile", {"tool": "coalescing"}, "call_p"), good())
    [p] = policy(server, toolbox=LocalToolBox(None, ev)).propose(context(), 1)
    assert p.status == ProposalStatus.OK
    assert p.usage.tool_calls == ("profile(tool='coalescing')",)
    [answer] = [m for m in server.requests[1].messages if m["role"] == "tool"]
    assert answer["tool_call_id"] == "call_p"
    assert "[coalescing]" in answer["content"]
    assert "Global loads and stores use 4.0 of 32 bytes per sector" in answer["content"]
    assert "Map threadIdx.x to the contiguous" in answer["content"]


def test_parent_evidence_from_the_context_reaches_the_toolbox(server):
    server.script(tool_call("profile", {"tool": "coalescing"}), good())
    ctx = context(extra={"evidence": load_recorded(RECORDED)})
    [p] = policy(server, toolbox=LocalToolBox()).propose(ctx, 1)
    assert p.status == ProposalStatus.OK
    assert {t["function"]["name"] for t in server.requests[0].body["tools"]} == {
        "profile",
        "list_profile_tools",
    }
    assert "[coalescing]" in server.requests[1].text()


def test_tool_budget_exceeded_tells_the_model_to_answer(server):
    server.script(
        tool_call("list_profile_tools", {}, "c1"),
        tool_call("profile", {"tool": "occupancy"}, "c2"),
        good(),
    )
    box = LocalToolBox(None, load_recorded(RECORDED))
    [p] = policy(server, toolbox=box, llm_tool_calls=1).propose(context(), 1)
    assert p.status == ProposalStatus.OK
    assert p.usage.tool_calls == (
        "list_profile_tools()",
        "profile(tool='occupancy') [refused: tool budget spent]",
    )
    last = [m for m in server.requests[2].messages if m["role"] == "tool"]
    assert "coalescing" in last[0]["content"]  # the listing
    assert (
        "tool budget of 1 call for this step is spent" in last[1]["content"]
        and "answer now" in last[1]["content"]
    )


def test_a_model_that_never_stops_calling_tools_is_cut_off(server):
    server.default = tool_call("search_sources", {"query": "x"})
    [p] = policy(server, toolbox=LocalToolBox(), llm_tool_calls=1).propose(context(), 1)
    assert p.status == ProposalStatus.UNPARSEABLE and "kept calling tools" in p.reason
    assert len(server.requests) == 4  # 1 allowed + 2 extra rounds + the first


def test_no_tools_offered_when_the_box_has_none_that_work(server):
    [p] = policy(server, toolbox=LocalToolBox()).propose(context(), 1)
    assert p.status == ProposalStatus.OK
    assert "tools" not in server.requests[0].body
    assert "## Tools" not in server.requests[0].text()


# --- budget, cost, concurrency ---------------------------------------------------------------------------


def test_token_budget_exhausted_returns_budget_without_a_request(server):
    budget = Budget(max_tokens=1500, max_cost_usd=100.0)
    pol = policy(server, budget=budget)
    [p] = pol.propose(context(), 1)
    assert p.status == ProposalStatus.OK and budget.tokens == 1500
    ps = pol.propose(context(), 2)
    assert [q.status for q in ps] == [ProposalStatus.BUDGET] * 2
    assert "token budget" in ps[0].reason and ps[0].usage.calls == 0
    assert len(server.requests) == 1
    # the same shared budget binds another policy
    [q] = policy(server, budget=budget).propose(context(), 1)
    assert q.status == ProposalStatus.BUDGET and len(server.requests) == 1


def test_cost_accounting_and_cost_budget(server):
    budget = Budget(max_tokens=10**9, max_cost_usd=0.01)
    pol = policy(server, budget=budget, llm_usd_per_mtok_in=2.0, llm_usd_per_mtok_out=8.0)
    [p] = pol.propose(context(), 1)
    assert p.usage.cost_usd == pytest.approx(1000 * 2.0 / 1e6 + 500 * 8.0 / 1e6)  # $0.006
    assert budget.cost_usd == pytest.approx(0.006)
    [q] = pol.propose(context(), 1)
    assert q.status == ProposalStatus.OK  # $0.006 < $0.01 before it went out
    [r] = pol.propose(context(), 1)
    assert r.status == ProposalStatus.BUDGET and "cost budget" in r.reason
    assert len(server.requests) == 2


def test_usage_is_estimated_when_the_server_reports_none(server):
    server.script(Reply(content=good_content(), usage=False))
    [p] = policy(server).propose(context(), 1)
    assert p.status == ProposalStatus.OK
    assert p.usage.prompt_tokens > 100 and p.usage.completion_tokens > 100


def test_propose_n_runs_concurrently_bounded_by_llm_concurrency(server):
    server.default = Reply(content=good_content(), delay_s=0.4)
    t0 = time.monotonic()
    ps = policy(server, llm_concurrency=2).propose(context(), 3)
    wall = time.monotonic() - t0
    assert [p.status for p in ps] == [ProposalStatus.OK] * 3
    assert len(server.requests) == 3
    assert server.max_in_flight == 2
    assert wall < 3 * 0.4  # not one after another


def test_propose_n_all_at_once_when_the_limit_allows(server):
    server.default = Reply(content=good_content(), delay_s=0.3)
    ps = policy(server, llm_concurrency=8).propose(context(), 3)
    assert len(ps) == 3 and server.max_in_flight == 3
    texts = [r.text() for r in server.requests]
    assert all("attempt" in t and "of 3" in t for t in texts)


# --- prompts ---------------------------------------------------------------------------------------------


def test_prompt_holds_feedback_bound_blocks_lessons_and_memory(server):
    from index.hunt import Block

    block = Block(
        corpus="cutlass",
        path="include/cute/arch/copy_sm90_tma.hpp",
        symbol="SM90_TMA_LOAD_2D",
        kind="header",
        arch=("sm90",),
        snippet="struct SM90_TMA_LOAD_2D {\n  // the TMA load atom\n};",
        include_line="#include <cute/arch/copy_sm90_tma.hpp>",
        score=1.0,
        sources=("exact",),
        start_line=10,
        end_line=12,
    )
    ctx = context(
        blocks=(block,),
        lessons=(Lesson("memory-bound row op", "4-byte loads", "vectorize_loads", "1.8x faster", 1.8),),
        tried=(Tried("aaaa", "llm: unroll rows by 2", "mismatch"),),
        siblings=(Outcome("bbbb", "compile_error", edit="llm: use tma"),),
        findings=(Finding("vector_width", 0.8, {}, "d", "a", edits=("vectorize_loads",)),),
    )
    ctx = context(
        **{**ctx.__dict__, "tried": (*ctx.tried, Tried(ctx.parent.key, "llm: fuse passes", "ok", 1.2))}
    )
    [p] = policy(server).propose(ctx, 1)
    assert p.status == ProposalStatus.OK
    text = server.requests[0].text()
    assert "## Profile of the parent" in text and FEEDBACK in text
    assert BOUND in text
    assert "struct SM90_TMA_LOAD_2D" in text and "#include <cute/arch/copy_sm90_tma.hpp>" in text
    assert "memory-bound row op" in text and "vectorize_loads: 1.8x faster" in text
    assert "llm: unroll rows by 2: mismatch" in text  # elsewhere in the tree
    assert "llm: fuse passes: ok, 1.20x vs its parent" in text  # from this parent
    assert "llm: use tma" in text  # a sibling
    assert PARENT_SRC.strip() in text and PARENT_LAUNCHER.strip() in text  # verbatim, blank lines kept
    assert ctx.reference.strip() in text
    assert 'extern "C" __global__' in server.requests[0].messages[0]["content"]  # the system prompt
    assert p.candidate.blocks == ()  # the reply does not use the block


def test_no_advice_section_without_feedback(server):
    [p] = policy(server).propose(context(feedback=""), 1)
    assert p.status == ProposalStatus.OK
    text = server.requests[0].text()
    assert "## Profile of the parent" not in text
    assert BOUND in text  # the stage-1 class is always there


def test_repair_prompt_holds_the_trimmed_compiler_error(server):
    from pipeline.candidates import make_candidate

    ctx = context()
    failed = make_candidate("softmax", "broken", PARENT_LAUNCHER, parent=ctx.parent.key, edit="llm: use tma")
    log = '\x1b[1m/tmp/kp-123/build/kernel.cu(12): error: identifier "foo" is undefined\x1b[0m\n' + "\n".join(
        f"note {i}" for i in range(200)
    )
    outcome = Outcome(failed.key, "compile_error", edit=failed.edit, errors=log)
    server.script(Reply(content=good_content(label="declare foo")))
    p = policy(server).repair(ctx, failed, outcome)
    assert p.status == ProposalStatus.OK
    assert p.candidate.parent == ctx.parent.key
    assert p.candidate.edit == "llm: use tma [repair: declare foo]"
    text = server.requests[0].text()
    assert 'kernel.cu(12): error: identifier "foo" is undefined' in text
    assert "/tmp/kp-123" not in text and "\x1b[" not in text
    assert "more lines cut" in text and "note 199" not in text
    assert "failed to compile" in text and "broken" in text


# --- parsing ---------------------------------------------------------------------------------------------

CU = 'extern "C" __global__ void k(float* x) { x[0] = 1; }\n'
PY = "import torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        kernels.k((1,), (1,), (x,))\n        return x\n"


@pytest.mark.parametrize(
    "ctag,ptag", [("cuda", "python"), ("cu", "py"), ("c++", "python"), ("cpp", "py"), ("", "")]
)
def test_parse_language_tags(ctag, ptag):
    r = parse_reply(f"Some prose first.\n```{ctag}\n{CU}```\nmore prose\n```{ptag}\n{PY}```\n")
    assert r.source == CU and r.launcher == PY and r.label == "" and r.rationale == "Some prose first."


def test_parse_takes_the_last_complete_pair_and_the_label():
    old = CU.replace("= 1", "= 0")
    text = (
        f"EDIT: first try\n```cuda\n{old}```\n```python\n{PY}```\n"
        f"Wait, a fix.\n**EDIT:** second try\n```cuda\n{CU}```\n```python\n{PY}```\n"
        "```cuda\nx[0] = 1;  // the line that changed\n```\n"  # a quoted excerpt, not a kernel
        '```cuda\nunclosed extern "C" __global__ void k('  # cut off
    )
    r = parse_reply(text)
    assert r.source == CU and r.label == "second try"


def test_parse_strips_thinking():
    r = parse_reply(f"<think>```cuda\nbad\n```</think>EDIT: ok\n```cuda\n{CU}```\n```python\n{PY}```")
    assert r.source == CU and r.label == "ok"


@pytest.mark.parametrize(
    "text,why",
    [
        ("", "empty reply"),
        ("just words", "no fenced code block"),
        (f"```python\n{PY}```", "no ```cuda block"),
        (f"```cuda\n{CU}```", "no ```python block"),
        (f"```cuda\n__global__ void k() {{}}\n```\n```python\n{PY}```", 'extern "C"'),
        (f"```cuda\n{CU}```\n```python\nclass Other: pass\n```", "class ModelNew"),
        (
            f"```cuda\n{CU}```\n```python\n{PY.replace('import torch.nn as nn', 'import os; import torch.nn as nn')}```",
            "static check: forbidden_import",
        ),
    ],
)
def test_parse_failures_have_reasons(text, why):
    with pytest.raises(UnparseableReply, match=why.replace("(", r"\(")):
        to_candidate(text, "t", None, "llm: x")


def test_the_blocks_a_reply_uses_are_recorded_with_their_corpus():
    """Over several corpora a path alone does not say where a block came from: `corpus:path` does."""
    cu = '#include "kp/block_reduce.cuh"\n' + CU.replace("x[0] = 1", "x[0] = SM90_TMA_LOAD_2D::n")
    text = f"```cuda\n{cu}```\n```python\n{PY}```"
    shown = (("kp/block_reduce.cuh", "block_reduce_sum", "local"),
             ("include/cute/arch/copy_sm90_tma.hpp", "SM90_TMA_LOAD_2D", "cutlass"),
             ("include/cute/swizzle.hpp", "Swizzle", "cutlass"))  # fmt: skip
    cand, _ = to_candidate(text, "t", None, "llm: x", shown)
    assert cand.blocks == ("local:kp/block_reduce.cuh", "cutlass:include/cute/arch/copy_sm90_tma.hpp")
    cand, _ = to_candidate(text, "t", None, "llm: x", tuple(b[:2] for b in shown))  # no corpus given
    assert cand.blocks == ("kp/block_reduce.cuh", "include/cute/arch/copy_sm90_tma.hpp")


def test_unclosed_fence_is_ignored():
    assert fences("```cuda\nint x;\n") == []


def test_render_and_trim_helpers():
    assert render("a {{x}}\n\n{{y}}\n\nb", x="{code}\n\n\n\nend", y="") == "a {code}\n\n\n\nend\n\nb\n"
    with pytest.raises(KeyError):
        render("{{missing}}")
    assert trim_errors("\n".join(["e"] * 100), max_lines=3).endswith("(97 more lines cut)")


# --- the tool box ----------------------------------------------------------------------------------------


def fake_hunter(root: Path) -> SimpleNamespace:
    (root / "include" / "cute").mkdir(parents=True)
    (root / "include" / "cute" / "atom.hpp").write_text(
        "#include <cute/util.hpp>\n" + "\n".join(f"line {i}" for i in range(2, 301))
    )
    return SimpleNamespace(
        corpus="mini",
        cfg=None,
        all_paths={"include/cute/atom.hpp"},
        file_includes={"include/cute/atom.hpp": ("cute/util.hpp",)},
        hunt=lambda query, k, arch: [],
        follow_includes=lambda block: [],
    )


def test_open_source_reads_only_indexed_files(tmp_path):
    root = tmp_path / "corpus"
    secret = tmp_path / "secret.txt"
    secret.write_text(KEY)
    box = LocalToolBox(fake_hunter(root), root=root)  # type: ignore[arg-type]
    assert box.available_tools() == ("search_sources", "open_source", "follow_includes")
    text = box.open_source("include/cute/atom.hpp", 2, 4)
    assert "line 2" in text and "line 4" in text and "line 5" not in text
    assert "mini:include/cute/atom.hpp lines 2-4 of 300" in text
    assert "line 250" not in box.open_source("mini:include/cute/atom.hpp")  # at most 200 lines
    for bad in ("../secret.txt", str(secret), "/etc/passwd", "include/../../secret.txt", "include/cute"):
        out = box.open_source(bad)
        assert out.startswith("refused") and KEY not in out
    assert "cute/util.hpp" in box.follow_includes("include/cute/atom.hpp")
    assert box.follow_includes("/etc/passwd").startswith("refused")
    assert box.search_sources("anything").startswith("no building blocks found")


def test_toolbox_without_index_or_evidence_says_so():
    box = LocalToolBox()
    assert box.available_tools() == ()
    assert box.search_sources("x") == NO_INDEX and box.open_source("a") == NO_INDEX
    assert "make index" in NO_INDEX
    assert box.profile("coalescing") == NO_EVIDENCE and box.list_profile_tools() == NO_EVIDENCE
    ev_box = box.with_evidence(load_recorded(RECORDED))
    assert ev_box.available_tools() == ("profile", "list_profile_tools")
    assert ev_box.profile("nonsense").startswith("unknown profiling tool")
    assert "memory-bound" in ev_box.list_profile_tools()
