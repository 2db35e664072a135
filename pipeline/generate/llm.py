"""The LLM policy: any OpenAI-compatible chat-completions endpoint (OpenAI, vLLM, llama.cpp's server, Ollama)
proposes child kernels from the parent, the profile's advice, building blocks from the source index and the
search's memory, and repairs children that failed to compile or verify.

Only `chat.completions` is used (local servers implement nothing else). Prompts are versioned files in
`prompts/` (`system.v1.md`, ...). The model may call tools (source hunt, profiling tools on the parent)
within a per-step budget; every request goes through one retry loop (429 and 5xx with backoff, timeouts,
connection errors), one concurrency limit and one shared token and cost budget. Failures are statuses, and
the key never appears in what this module returns or logs.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import openai

from pipeline.config import Config
from pipeline.generate.base import Context, Outcome, Proposal, ProposalStatus, Usage
from pipeline.generate.parse import UnparseableReply, to_candidate
from pipeline.generate.toolbox import TOOL_SPECS, ToolBox, describe_call, dispatch, format_block
from pipeline.types import Candidate

log = logging.getLogger("kernelpro.llm")

PROMPTS_DIR = Path(__file__).with_name("prompts")
PROMPT_VERSION = "v1"
DEFAULT_BASE_URL = "https://api.openai.com/v1"
PLACEHOLDER_KEY = "none"  # local servers need no key, but the client insists on one
DEFAULT_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 60.0
EXTRA_TOOL_ROUNDS = 2  # requests allowed after the tool budget is spent, for the model to answer
CHARS_PER_TOKEN = 4  # token estimate when a server reports no usage
MAX_BLOCK_CHARS = 12_000
MAX_ERROR_CHARS = 3_000
MAX_ERROR_LINES = 60
MAX_TRIED = 30
MAX_LESSONS = 8
MAX_SHORT = 200  # characters of an endpoint's error message kept in a reason


class LLMConfigError(ValueError):
    """No endpoint configured: the message says how to set one."""


# --- prompts ---------------------------------------------------------------------------------------------


@cache
def load_prompt(name: str, version: str = PROMPT_VERSION) -> str:
    path = PROMPTS_DIR / f"{name}.{version}.md"
    if not path.is_file():
        raise LLMConfigError(f"prompt template {path.name} not found in {PROMPTS_DIR}")
    return path.read_text()


_SLOT = re.compile(r"\{\{(\w+)\}\}")


def render(template: str, **values: str) -> str:
    """Fill {{name}} slots. Values go in verbatim (braces and blank lines in code are kept); a line that is
    only an empty slot disappears, and the blank lines it leaves in the template are merged."""
    missing = set(_SLOT.findall(template)) - set(values)
    if missing:
        raise KeyError(f"prompt slots without a value: {sorted(missing)}")
    lines = [
        ln
        for ln in template.splitlines()
        if not ((m := _SLOT.fullmatch(ln.strip())) and not values[m.group(1)].strip())
    ]
    kept: list[str] = []
    for ln in lines:
        if not ln.strip() and kept and not kept[-1].strip():
            continue
        kept.append(ln)
    text = _SLOT.sub(lambda m: values[m.group(1)].strip("\n"), "\n".join(kept))
    return text.strip() + "\n"


# --- budget ----------------------------------------------------------------------------------------------


class Budget:
    """Tokens and dollars spent by every request of a run, shared by all policies and threads.

    Checked before each request: requests already in flight may overshoot the limit by their own size,
    which is cheaper than serialising them.
    """

    def __init__(self, max_tokens: int, max_cost_usd: float) -> None:
        self.max_tokens = max_tokens
        self.max_cost_usd = max_cost_usd
        self._lock = threading.Lock()
        self._tokens = 0
        self._cost = 0.0

    @classmethod
    def from_config(cls, cfg: Config) -> Budget:
        return cls(cfg.max_tokens, cfg.max_cost_usd)

    def charge(self, tokens: int, cost_usd: float) -> None:
        with self._lock:
            self._tokens += tokens
            self._cost += cost_usd

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def cost_usd(self) -> float:
        return self._cost

    def exhausted(self) -> str | None:
        """Why no further request may go out, or None."""
        with self._lock:
            if self._tokens >= self.max_tokens:
                return f"token budget spent ({self._tokens} of {self.max_tokens} tokens)"
            if self._cost >= self.max_cost_usd:
                return f"cost budget spent (${self._cost:.4f} of ${self.max_cost_usd:.2f})"
        return None


# --- one conversation ------------------------------------------------------------------------------------


@dataclass
class _Tally:
    """Usage of one proposal, accumulated over its requests (retries and tool rounds included)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    calls: int = 0
    tool_calls: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def usage(self) -> Usage:
        return Usage(
            self.prompt_tokens,
            self.completion_tokens,
            round(self.cost_usd, 8),
            self.calls,
            tuple(self.tool_calls),
            round(time.monotonic() - self.started, 3),
        )


@dataclass(frozen=True)
class _Failure:
    status: ProposalStatus
    reason: str


class LLMPolicy:
    name = "llm"

    def __init__(
        self,
        cfg: Config,
        toolbox: ToolBox | None = None,
        budget: Budget | None = None,
        client: Any = None,
        *,
        backoff_s: float | None = None,
        prompt_version: str = PROMPT_VERSION,
    ) -> None:
        if not cfg.llm_base_url and not cfg.llm_api_key and client is None:
            raise LLMConfigError(
                "no LLM endpoint configured: set KERNELPRO_LLM_BASE_URL (any OpenAI-compatible server, e.g. "
                "http://localhost:8000/v1) and/or KERNELPRO_LLM_API_KEY (OPENAI_API_KEY also works), or use "
                "the offline policy (--policy expert)"
            )
        self.cfg = cfg
        self.toolbox = toolbox
        self.budget = budget or Budget.from_config(cfg)
        self.prompt_version = prompt_version
        for name in ("system", "propose", "repair"):
            load_prompt(name, prompt_version)  # fail at construction, not mid-run
        # Not in Config yet: the retry backoff base; tests shorten it.
        self.backoff_s = (
            backoff_s if backoff_s is not None else float(getattr(cfg, "llm_backoff_s", DEFAULT_BACKOFF_S))
        )
        self._secret = cfg.llm_api_key or ""
        base_url = cfg.llm_base_url or DEFAULT_BASE_URL
        self._openai_proper = "api.openai.com" in base_url
        # The client's own retries are off: ours count every HTTP request and honour the shared budget.
        self.client = client or openai.OpenAI(
            api_key=cfg.llm_api_key or PLACEHOLDER_KEY,
            base_url=base_url,
            timeout=cfg.llm_timeout_s,
            max_retries=0,
        )
        self._slots = threading.BoundedSemaphore(max(1, cfg.llm_concurrency))

    def __repr__(self) -> str:  # never the client (it holds the key)
        return f"LLMPolicy(model={self.cfg.llm_model!r}, prompts={self.prompt_version})"

    # --- Policy ------------------------------------------------------------------------------------------

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        if n <= 0:
            return []
        box = self._toolbox(ctx)
        jobs = [self.propose_messages(ctx, i, n, box) for i in range(n)]
        parent = ctx.parent.key if ctx.parent else None
        default = "llm: first kernel" if ctx.parent is None else "llm: rewrite"
        if n == 1:
            return [self._run(jobs[0], ctx, box, parent, default)]
        workers = min(n, max(1, self.cfg.llm_concurrency))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llm") as pool:
            futures = [pool.submit(self._run, m, ctx, box, parent, default) for m in jobs]
            return [f.result() for f in futures]

    def repair(self, ctx: Context, failed: Candidate, outcome: Outcome) -> Proposal:
        box = self._toolbox(ctx)
        messages = self.repair_messages(ctx, failed, outcome, box)
        parent = ctx.parent.key if ctx.parent else failed.parent
        base = failed.edit or "llm"
        return self._run(messages, ctx, box, parent, f"{base} [repair]", f"{base} [repair: {{label}}]")

    # --- prompts -----------------------------------------------------------------------------------------

    def _toolbox(self, ctx: Context) -> ToolBox | None:
        """The step's toolbox: ctx.extra["toolbox"] when given, else ours with the parent's evidence
        (ctx.extra["evidence"]) when there is one: the profile changes with the parent, the index does not."""
        extra = ctx.extra or {}
        box = extra.get("toolbox") or self.toolbox
        ev = extra.get("evidence")
        if ev is not None and hasattr(box, "with_evidence"):
            box = box.with_evidence(ev)  # type: ignore[union-attr]
        return box

    def _offered(self, box: ToolBox | None) -> list[str]:
        if box is None or self.cfg.llm_tool_calls <= 0:
            return []
        return [t for t in box.available_tools() if t in TOOL_SPECS]

    def _system(self, ctx: Context, offered: list[str]) -> str:
        note = (
            "Before answering you may call the tools offered to you; your final message must be the answer."
            if offered
            else ""
        )
        return render(load_prompt("system", self.prompt_version), arch=ctx.arch, tools_note=note)

    def _tools_section(self, offered: list[str]) -> str:
        if not offered:
            return ""
        return (
            f"## Tools\n\nYou may call these tools before you answer, at most {self.cfg.llm_tool_calls} "
            f"calls in all: {', '.join(offered)}. Use them when the context above is not enough (a "
            "building block to look up, a profiling tool's detail on the parent); otherwise answer at once."
        )

    def propose_messages(
        self, ctx: Context, i: int = 0, n: int = 1, box: ToolBox | None = None
    ) -> list[dict]:
        offered = self._offered(box)
        if ctx.parent is None:
            instruction = (
                "Write the first candidate for this task: correct for every shape the reference accepts, "
                "and already efficient for the bottleneck the task implies."
            )
        else:
            instruction = (
                "Propose one change to the parent that attacks the bottleneck above and differs from every "
                "edit already tried. Keep what already works; return the complete new kernel and launcher."
            )
        if n > 1:
            instruction += f"\n\nThis is attempt {i + 1} of {n} made in parallel from the same context."
            hints = _edit_hints(ctx)
            if hints:
                instruction += f" To spread the search, prefer this direction: {hints[i % len(hints)]}."
            elif i > 0:
                instruction += " To spread the search, avoid the most obvious change; try another direction."
        user = render(
            load_prompt("propose", self.prompt_version),
            task_id=ctx.task.id,
            task_summary=_task_summary(ctx),
            reference=ctx.reference.strip(),
            parent_section=_parent_section(ctx),
            bound=ctx.bound.strip() or "not classified yet: the parent has no profile",
            advice_section=_advice_section(ctx.feedback),
            blocks_section=_blocks_section(ctx.blocks),
            lessons_section=_lessons_section(ctx),
            memory_section=_memory_section(ctx),
            tools_section=self._tools_section(offered),
            instruction=instruction,
        )
        return [{"role": "system", "content": self._system(ctx, offered)}, {"role": "user", "content": user}]

    def repair_messages(
        self, ctx: Context, failed: Candidate, outcome: Outcome, box: ToolBox | None = None
    ) -> list[dict]:
        offered = self._offered(box)
        user = render(
            load_prompt("repair", self.prompt_version),
            task_id=ctx.task.id,
            task_summary=_task_summary(ctx),
            reference=ctx.reference.strip(),
            edit=f"edit: {failed.edit}" if failed.edit else "a new kernel",
            failure=_FAILURES.get(outcome.status, f"failed ({outcome.status})"),
            source=failed.source.rstrip(),
            launcher=failed.launcher.rstrip(),
            status=outcome.status,
            errors=trim_errors(outcome.errors) or "(no error text was recorded)",
            blocks_section=_blocks_section(ctx.blocks),
            tools_section=self._tools_section(offered),
        )
        return [{"role": "system", "content": self._system(ctx, offered)}, {"role": "user", "content": user}]

    # --- one proposal: the conversation, the tool loop and the parse ------------------------------------

    def _run(
        self,
        messages: list[dict],
        ctx: Context,
        box: ToolBox | None,
        parent: str | None,
        default_edit: str,
        label_format: str = "llm: {label}",
    ) -> Proposal:
        tally = _Tally()
        messages = list(messages)
        offered = self._offered(box)
        tools = [TOOL_SPECS[t] for t in offered]
        limit = self.cfg.llm_tool_calls
        used = 0
        shown_blocks = [
            (b.path, b.symbol, getattr(b, "corpus", "")) for b in ctx.blocks if hasattr(b, "path")
        ]
        notes = [f"prompt {self.prompt_version}", f"model {self.cfg.llm_model}"]
        for _ in range(limit + EXTRA_TOOL_ROUNDS + 1):
            result = self._complete(messages, tools, tally)
            if isinstance(result, _Failure):
                return Proposal(result.status, reason=result.reason, usage=tally.usage(), notes=tuple(notes))
            message, finish = result
            calls = list(getattr(message, "tool_calls", None) or [])
            if not calls:
                break
            messages.append(_assistant_message(message, calls))
            for call in calls:
                name = call.function.name
                args = _arguments(call.function.arguments)
                used += 1
                line = describe_call(name, args)
                if used > limit:
                    calls_word = "call" if limit == 1 else "calls"
                    answer = (
                        f"error: the tool budget of {limit} {calls_word} for this step is spent. Do not call "
                        "tools again: answer now with the EDIT line, the ```cuda block and the ```python block."
                    )
                    line += " [refused: tool budget spent]"
                elif args is None:
                    answer = "error: the arguments are not a JSON object"
                else:
                    answer = self._call_tool(box, name, args)
                tally.tool_calls.append(line)
                log.debug("tool call %s", line)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
        else:
            return Proposal(
                ProposalStatus.UNPARSEABLE,
                reason=f"the model kept calling tools after its budget of {limit} calls",
                usage=tally.usage(),
                notes=tuple(notes),
            )
        text = getattr(message, "content", None) or ""
        if finish == "length":
            notes.append("reply cut at the output token limit")
        try:
            cand, reply = to_candidate(
                text,
                ctx.task.id,
                parent,
                default_edit,
                tuple(shown_blocks),
                label_format=label_format,
            )
        except UnparseableReply as e:
            reason = str(e) + (" (the reply was cut at the output token limit)" if finish == "length" else "")
            return Proposal(
                ProposalStatus.UNPARSEABLE, reason=reason, usage=tally.usage(), notes=tuple(notes)
            )
        return Proposal(
            ProposalStatus.OK,
            candidate=cand,
            edit=cand.edit or default_edit,
            reason=reply.rationale,
            usage=tally.usage(),
            notes=tuple(notes),
        )

    def _call_tool(self, box: ToolBox | None, name: str, args: dict[str, Any]) -> str:
        try:
            return dispatch(box, name, args)
        except Exception as e:  # a custom toolbox's bug is the model's answer, not our crash
            return f"error: {name} failed: {type(e).__name__}: {self._scrub(str(e))[:MAX_SHORT]}"

    # --- one completion with retries --------------------------------------------------------------------

    def _complete(
        self, messages: list[dict], tools: list[dict], tally: _Tally
    ) -> tuple[Any, str | None] | _Failure:
        """One completion: retried on 429, 5xx and connection errors; a timeout or other error ends it."""
        params: dict[str, Any] = {
            "model": self.cfg.llm_model,
            "messages": messages,
            "temperature": self.cfg.llm_temperature,
            "timeout": self.cfg.llm_timeout_s,
        }
        # OpenAI's newer models take only max_completion_tokens; local servers know max_tokens.
        key = "max_completion_tokens" if self._openai_proper else "max_tokens"
        params[key] = self.cfg.llm_max_output_tokens
        if tools:
            params["tools"] = tools
        last = "no request made"
        for attempt in range(self.cfg.llm_retries + 1):
            spent = self.budget.exhausted()
            if spent:
                return _Failure(ProposalStatus.BUDGET, spent)
            t0 = time.monotonic()
            wait: float | None = None
            try:
                tally.calls += 1
                with self._slots:
                    resp = self.client.chat.completions.create(**params)
            except openai.APITimeoutError:
                # Not retried: a reply that took longer than the limit will likely do so again, and each
                # attempt may be billed.
                log.debug("llm call timed out after %.1fs", time.monotonic() - t0)
                return _Failure(
                    ProposalStatus.REFUSED, f"timeout: no reply within {self.cfg.llm_timeout_s:g} s"
                )
            except openai.APIStatusError as e:
                code = e.status_code
                last = f"HTTP {code}: {self._short(e)}"
                log.debug("llm call failed: %s", last)
                if code == 429:
                    wait = _retry_after(e.response)
                elif code < 500:
                    return _Failure(ProposalStatus.REFUSED, last)
            except openai.APIConnectionError as e:
                last = f"connection error: {self._scrub(type(e).__name__)}"
                log.debug("llm call failed: %s", last)
            except Exception as e:  # response validation, a broken reply: reduce, never re-raise
                return _Failure(
                    ProposalStatus.REFUSED, f"{type(e).__name__}: {self._scrub(str(e))[:MAX_SHORT]}"
                )
            else:
                self._account(resp, messages, tally)
                log.debug(
                    "llm call ok in %.1fs (%d calls so far, %d+%d tokens)",
                    time.monotonic() - t0,
                    tally.calls,
                    tally.prompt_tokens,
                    tally.completion_tokens,
                )
                choices = getattr(resp, "choices", None) or []
                if not choices:
                    return _Failure(ProposalStatus.UNPARSEABLE, "the reply held no choices")
                return choices[0].message, getattr(choices[0], "finish_reason", None)
            if attempt < self.cfg.llm_retries:
                if wait is None:
                    wait = min(MAX_BACKOFF_S, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)
                time.sleep(wait)
        return _Failure(ProposalStatus.REFUSED, f"{last} (after {self.cfg.llm_retries + 1} attempts)")

    def _account(self, resp: Any, messages: list[dict], tally: _Tally) -> None:
        u = getattr(resp, "usage", None)
        p = int(getattr(u, "prompt_tokens", 0) or 0) if u is not None else 0
        c = int(getattr(u, "completion_tokens", 0) or 0) if u is not None else 0
        if u is None:  # some servers report no usage: estimate, so the budget still binds
            p = sum(len(str(m.get("content") or "")) for m in messages) // CHARS_PER_TOKEN
            choices = getattr(resp, "choices", None) or []
            text = (getattr(choices[0].message, "content", None) or "") if choices else ""
            c = len(text) // CHARS_PER_TOKEN
        cost = p * self.cfg.llm_usd_per_mtok_in / 1e6 + c * self.cfg.llm_usd_per_mtok_out / 1e6
        tally.prompt_tokens += p
        tally.completion_tokens += c
        tally.cost_usd += cost
        self.budget.charge(p + c, cost)

    # --- secrets ----------------------------------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        if self._secret:
            text = text.replace(self._secret, "***")
        text = re.sub(r"(?i)(bearer\s+)\S+", r"\1***", text)
        return re.sub(r"\bsk-[A-Za-z0-9_-]{6,}", "sk-***", text)

    def _short(self, e: openai.APIStatusError) -> str:
        """The endpoint's own message, one line: never the exception's text, which can echo headers."""
        msg = ""
        body = e.body
        if isinstance(body, dict):
            err = body.get("error", body)
            msg = str(err.get("message", "") if isinstance(err, dict) else err)
        msg = " ".join(msg.split()) or _REASONS.get(e.status_code, "error")
        return self._scrub(msg)[:MAX_SHORT]


_REASONS = {429: "rate limited", 500: "server error", 502: "bad gateway", 503: "unavailable", 504: "timeout"}
_FAILURES = {
    "compile_error": "failed to compile",
    "compile_timeout": "took too long to compile (simplify templates and unrolling)",
    "mismatch": "compiled and ran, but its output does not match the reference",
    "launch_error": "failed to launch",
    "crash": "crashed at run time (an illegal memory access or similar)",
    "timeout": "ran past the time limit (an endless loop or a deadlock at a barrier)",
    "suspicious": "was flagged as suspicious by the verifier (too fast to be computing the result)",
    "rejected": "was rejected by the static check of its launcher",
}


def _retry_after(response: Any) -> float | None:
    headers = getattr(response, "headers", None) or {}
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            return max(0.0, min(MAX_RETRY_AFTER_S, float(raw) * scale))
        except ValueError:
            continue  # an HTTP date: fall back to our own backoff
    return None


def _arguments(raw: Any) -> dict[str, Any] | None:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _assistant_message(message: Any, calls: Sequence[Any]) -> dict[str, Any]:
    """The assistant turn that asked for tools, echoed back as plain JSON (only the fields servers know)."""
    return {
        "role": "assistant",
        "content": getattr(message, "content", None),
        "tool_calls": [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": c.function.arguments
                    if isinstance(c.function.arguments, str)
                    else json.dumps(c.function.arguments),
                },
            }
            for c in calls
        ],
    }


# --- prompt sections ---------------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _task_summary(ctx: Context) -> str:
    t = ctx.task

    def specs(ts: Sequence[Any]) -> str:
        return ", ".join(f"{s.dtype}{list(s.shape)}" for s in ts) or "none"

    return "\n".join(
        [
            f"- inputs: {specs(t.inputs)}; outputs: {specs(t.outputs)}; init args: {t.init_args}",
            f"- tolerances: atol {t.atol:g}, rtol {t.rtol:g}; main dtype {t.dtype}",
            f"- work: {t.flops / 1e9:.3g} GFLOP; minimal traffic {_bytes(t.min_bytes)} "
            f"({t.flops / t.min_bytes if t.min_bytes else 0:.3g} FLOP/byte)",
            f"- target: {ctx.arch}",
        ]
    )


def _outcome_line(o: Outcome) -> str:
    parts = [f"status {o.status}"]
    if o.time_ms is not None:
        parts.append(f"{o.time_ms:.4g} ms")
    if o.speedup_eager is not None:
        parts.append(f"{o.speedup_eager:.2f}x vs eager PyTorch")
    return ", ".join(parts)


def _parent_section(ctx: Context) -> str:
    best = f"\n\nBest so far: {ctx.best.edit or ctx.best.key}, {_outcome_line(ctx.best)}." if ctx.best else ""
    p = ctx.parent
    if p is None:
        return f"## Starting point\n\nNo kernel yet.{best}"
    head = f"## Parent candidate `{p.key}`" + (f" (made by: {p.edit})" if p.edit else "")
    measured = f"\n\nMeasured: {_outcome_line(ctx.parent_outcome)}." if ctx.parent_outcome else ""
    return f"{head}{measured}{best}\n\n```cuda\n{p.source.rstrip()}\n```\n\n```python\n{p.launcher.rstrip()}\n```"


def _advice_section(feedback: str) -> str:
    if not feedback.strip():
        return ""  # the "none" ablation: no section at all
    body = feedback.strip()
    if body.startswith(("{", "[")):
        body = f"```json\n{body}\n```"
    return f"## Profile of the parent\n\n{body}"


def _blocks_section(blocks: Sequence[Any]) -> str:
    if not blocks:
        return ""
    parts, used = [], 0
    for b in blocks:
        text = format_block(b) if hasattr(b, "snippet") else str(b)
        if used + len(text) > MAX_BLOCK_CHARS and parts:
            parts.append(f"(+{len(blocks) - len(parts)} more blocks left out)")
            break
        parts.append(text)
        used += len(text)
    return "## Building blocks from the source index\n\n" + "\n\n".join(parts)


def _lessons_section(ctx: Context) -> str:
    if not ctx.lessons:
        return ""
    lines = ["## Lessons from earlier runs"]
    for le in ctx.lessons[:MAX_LESSONS]:
        gain = f", gain {le.gain:.2f}x" if le.gain is not None else ""
        lines.append(f"- on {le.task_features}: {le.finding} -> {le.edit}: {le.outcome}{gain}")
    return "\n".join(lines)


def _tried_line(t: Any) -> str:
    speed = f", {t.speedup_vs_parent:.2f}x vs its parent" if t.speedup_vs_parent is not None else ""
    return f"- {t.edit}: {t.status}{speed}"


def _memory_section(ctx: Context) -> str:
    here = ctx.parent.key if ctx.parent else None
    local = [t for t in ctx.tried if t.parent == here][-MAX_TRIED:]
    other = [t for t in ctx.tried if t.parent != here][-MAX_TRIED:]
    if not (local or other or ctx.siblings):
        return ""
    lines = ["## Already tried (do not repeat these)"]
    if local:
        lines += ["From this parent:", *map(_tried_line, local)]
    if ctx.siblings:
        lines.append("Other children of this parent:")
        lines += [f"- {s.edit or s.key}: {_outcome_line(s)}" for s in ctx.siblings[-MAX_TRIED:]]
    if other:
        lines += ["Elsewhere in the search tree:", *map(_tried_line, other)]
    return "\n".join(lines)


def _edit_hints(ctx: Context) -> list[str]:
    """Distinct suggested edits of the findings, worst finding first: one direction per parallel attempt."""
    seen: dict[str, None] = {}
    for f in ctx.findings:
        for e in f.edits:
            seen.setdefault(e, None)
    tried = {t.edit for t in ctx.tried}
    return [e for e in seen if e not in tried]


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TMP_PATH = re.compile(r"(?:/[^\s:()\"']+)+/((?:kernel\.cu|launcher\.py))")


def trim_errors(text: str, max_chars: int = MAX_ERROR_CHARS, max_lines: int = MAX_ERROR_LINES) -> str:
    """The head of an error log (the first errors are the cause), paths to our temp files shortened."""
    text = _TMP_PATH.sub(r"\1", _ANSI.sub("", text or "")).strip()
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    kept: list[str] = []
    size = 0
    for ln in lines:
        if len(kept) >= max_lines or size + len(ln) > max_chars:
            break
        kept.append(ln)
        size += len(ln) + 1
    if len(kept) < len(lines):
        kept.append(f"... ({len(lines) - len(kept)} more lines cut)")
    return "\n".join(kept)


__all__ = ["PROMPT_VERSION", "Budget", "LLMConfigError", "LLMPolicy", "load_prompt", "render", "trim_errors"]
