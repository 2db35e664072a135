"""Turn an LLM reply into a candidate: one fenced CUDA block, one fenced Python block, an optional first line
`EDIT: <label>`. Tolerant of what models do (prose around the code, thinking blocks, a repeated or revised
answer, untagged fences); strict about what the rest of the pipeline needs (an `extern "C"` kernel, a
`class ModelNew` launcher that passes the static check). A reply that fails says why in `UnparseableReply`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.candidates import make_candidate
from pipeline.static_check import check_launcher
from pipeline.types import Candidate

CUDA_TAGS = frozenset({"cuda", "cu", "c++", "cpp", "cxx", "cuh", "c"})
PYTHON_TAGS = frozenset({"python", "py", "python3"})
MAX_LABEL = 80

_FENCE_OPEN = re.compile(r"^[ \t]*(?P<fence>`{3,}|~{3,})[ \t]*(?P<tag>[^\s`]*)[^\n`]*$")
_EDIT_LINE = re.compile(r"^[ \t*_#>]*EDIT[*_]*[ \t]*:[ \t]*(?P<label>.+?)[ \t*_]*$", re.I | re.M)
_THINK = re.compile(r"<(think|thinking|reasoning)>.*?</\1>", re.S | re.I)
_EXTERN_C = re.compile(r'extern\s+"C"')
_GLOBAL = re.compile(r"\b__global__\b")
_MODEL_NEW = re.compile(r"^class[ \t]+ModelNew\b", re.M)


class UnparseableReply(ValueError):
    """The reply holds no usable kernel + launcher; str(e) is the reason, one line."""


@dataclass(frozen=True)
class Fence:
    tag: str  # lower-cased language tag, "" when untagged
    body: str
    start: int  # character offsets of the opening fence and of the end of the closing one
    end: int


@dataclass(frozen=True)
class Reply:
    source: str
    launcher: str
    label: str  # from the EDIT line, "" when absent
    rationale: str  # the first line of prose, "" when none


def fences(text: str) -> list[Fence]:
    """Complete fenced blocks in order; a block the reply never closes (cut off) is left out."""
    out: list[Fence] = []
    lines = text.splitlines(keepends=True)
    offset, i = 0, 0
    offsets = []
    for ln in lines:
        offsets.append(offset)
        offset += len(ln)
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i].rstrip("\r\n"))
        if not m:
            i += 1
            continue
        fence = m.group("fence")
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j].rstrip("\r\n")):
            j += 1
        if j >= len(lines):
            break  # unclosed: truncated reply
        body = "".join(lines[i + 1 : j])
        end = offsets[j] + len(lines[j])
        out.append(Fence(m.group("tag").lower(), body.rstrip() + "\n", offsets[i], end))
        i = j + 1
    return out


def _kind(f: Fence) -> str | None:
    if f.tag in CUDA_TAGS:
        return "cuda"
    if f.tag in PYTHON_TAGS:
        return "python"
    if f.tag:
        return None
    # Untagged: sniff the content.
    if _MODEL_NEW.search(f.body):
        return "python"
    if _GLOBAL.search(f.body):
        return "cuda"
    return None


def _is_kernel(src: str) -> bool:
    return bool(_EXTERN_C.search(src) and _GLOBAL.search(src))


def parse_reply(text: str) -> Reply:
    """The kernel source, the launcher and the label of a reply; raises UnparseableReply with the reason."""
    if not text or not text.strip():
        raise UnparseableReply("empty reply")
    text = _THINK.sub("", text)
    blocks = fences(text)
    if not blocks:
        raise UnparseableReply("no fenced code block in the reply (expected one ```cuda and one ```python)")
    cuda = [b for b in blocks if _kind(b) == "cuda"]
    py = [b for b in blocks if _kind(b) == "python"]
    if not cuda:
        raise UnparseableReply("no ```cuda block with the kernel source")
    if not py:
        raise UnparseableReply("no ```python block with the launcher")
    # The last block that looks complete wins: a model that revises itself puts the final answer last, and a
    # short excerpt quoted after it (one line of a kernel) must not displace it.
    kernel = next((b for b in reversed(cuda) if _is_kernel(b.body)), None)
    if kernel is None:
        raise UnparseableReply('the CUDA block has no extern "C" __global__ kernel')
    launcher = next((b for b in reversed(py) if _MODEL_NEW.search(b.body)), None)
    if launcher is None:
        raise UnparseableReply("the Python block does not define `class ModelNew`")
    prose = text[: blocks[0].start]
    # The EDIT line that introduces the chosen answer: the last one outside code before its second block.
    label = ""
    cut = max(kernel.start, launcher.start)
    pos = 0
    for b in [*blocks, None]:
        seg_end = b.start if b is not None else len(text)
        for m in _EDIT_LINE.finditer(text, pos, min(seg_end, cut)):
            label = m.group("label").strip().strip("`*_").strip()[:MAX_LABEL]
        if b is None or b.start >= cut:
            break
        pos = b.end
    rationale = ""
    for ln in prose.splitlines():
        s = ln.strip().strip("#*_ ").strip()
        if s and not _EDIT_LINE.match(ln):
            rationale = s[:160]
            break
    return Reply(kernel.body, launcher.body, label, rationale)


def check_reply(reply: Reply) -> None:
    """The launcher's static check; raises UnparseableReply with its first violations."""
    report = check_launcher(reply.launcher)
    if not report.ok:
        shown = "; ".join(str(v) for v in report.violations[:3])
        more = f" (+{len(report.violations) - 3} more)" if len(report.violations) > 3 else ""
        raise UnparseableReply(f"the launcher fails the static check: {shown}{more}")


def to_candidate(
    text: str,
    task_id: str,
    parent: str | None,
    default_edit: str,
    block_paths: tuple[tuple[str, ...], ...] = (),
    label_format: str = "llm: {label}",
) -> tuple[Candidate, Reply]:
    """Parse, check and build the candidate. The edit is label_format filled with the EDIT label, else
    default_edit. block_paths: (path, symbol) or (path, symbol, corpus) of the building blocks shown; those
    whose include line or symbol name appears in the source are recorded as used (`corpus:path` where the
    corpus is given, so a run over several corpora says which one each came from)."""
    reply = parse_reply(text)
    check_reply(reply)
    edit = (
        label_format.replace("{label}", reply.label) if reply.label else default_edit
    )  # not .format: edits may hold braces
    used = tuple(
        f"{b[2]}:{b[0]}" if len(b) > 2 and b[2] else b[0]
        for b in block_paths
        if _uses(reply.source, b[0], b[1])
    )
    cand = make_candidate(
        task_id, reply.source, reply.launcher, parent=parent, edit=edit, blocks=tuple(dict.fromkeys(used))
    )
    return cand, reply


def _uses(source: str, path: str, symbol: str) -> bool:
    tail = path.split("include/", 1)[-1]
    if tail and re.search(rf"#\s*include\s*[<\"][^>\"]*{re.escape(tail)}[>\"]", source):
        return True
    name = re.split(r"[<(]", symbol, maxsplit=1)[0].rsplit("::", 1)[-1].strip()
    return len(name) > 3 and bool(re.search(rf"\b{re.escape(name)}\b", source))
