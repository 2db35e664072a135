"""The tools an LLM may call while it writes a kernel: hunt the indexed sources, read them, follow their
includes, and ask for one micro-profiling tool's findings on the parent.

Every method returns text for the model, never raises for a bad argument or a missing index: the answer
then says what is missing and what to do. `TOOL_SPECS` holds the chat-completions `tools` schemas;
`available_tools()` names those that can work, so the policy offers only them.
"""

from __future__ import annotations

import threading
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.profile.evidence import Evidence

if TYPE_CHECKING:
    from index.hunt import Block, Hunter, Hunters

NO_INDEX = "no source index built: run `make index` (kernelpro index build) to let me search sources"
NO_EVIDENCE = (
    "no profile of the parent: it has not been profiled (a first kernel, a failed parent, or profiling is "
    "off), so no profiling tool can answer"
)
MAX_K = 8
SEARCH_SNIPPET_LINES = 40
OPEN_MAX_LINES = 200
MAX_TOOL_CHARS = 8000  # every answer is cut to this: tool results go back into the prompt

SOURCE_TOOLS = ("search_sources", "open_source", "follow_includes")
PROFILE_TOOLS = ("profile", "list_profile_tools")


def _fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


TOOL_SPECS: dict[str, dict[str, Any]] = {
    "search_sources": _fn(
        "search_sources",
        "Search the indexed CUDA sources (CUTLASS/CuTe, CCCL, the user's kernels) for building blocks: "
        "an MMA atom, a TMA copy, a pipeline, a reduction. Natural language or identifiers.",
        {
            "query": {"type": "string", "description": "words or identifiers, e.g. 'wgmma tma pipeline'"},
            "k": {"type": "integer", "description": f"results, 1..{MAX_K}", "default": 5},
        },
        ["query"],
    ),
    "open_source": _fn(
        "open_source",
        "Read lines of an indexed source file (a path as search_sources printed it).",
        {
            "path": {"type": "string"},
            "start_line": {"type": "integer", "default": 1},
            "end_line": {"type": "integer", "description": f"at most {OPEN_MAX_LINES} lines are shown"},
        },
        ["path"],
    ),
    "follow_includes": _fn(
        "follow_includes",
        "The files an indexed source includes and the definitions it uses from them.",
        {"path": {"type": "string"}},
        ["path"],
    ),
    "profile": _fn(
        "profile",
        "Run one micro-profiling tool on the parent kernel's recorded profile and return its findings "
        "(diagnosis, evidence, advice). list_profile_tools names them.",
        {"tool": {"type": "string", "description": "e.g. coalescing, occupancy, warp_stalls"}},
        ["tool"],
    ),
    "list_profile_tools": _fn(
        "list_profile_tools",
        "The micro-profiling tools, the bottleneck classes they apply to, and whether the parent's "
        "profile has the evidence each needs.",
        {},
        [],
    ),
}


class ToolBox(Protocol):
    def available_tools(self) -> tuple[str, ...]:
        """Names (keys of TOOL_SPECS) of the tools that can answer now."""
        ...

    def search_sources(self, query: str, k: int = 5) -> str: ...

    def open_source(self, path: str, start_line: int = 1, end_line: int | None = None) -> str: ...

    def follow_includes(self, path: str) -> str: ...

    def profile(self, tool: str) -> str: ...

    def list_profile_tools(self) -> str: ...


def _cut(text: str, limit: int = MAX_TOOL_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... (cut: {len(text) - limit} more characters)"


def format_block(b: Block, max_lines: int = SEARCH_SNIPPET_LINES) -> str:
    lines = b.snippet.splitlines()
    if len(lines) > max_lines:
        lines = [*lines[:max_lines], f"// ... ({len(lines) - max_lines} more lines: open_source to read)"]
    where = f"{b.corpus}:{b.path}"
    if b.start_line:
        where += f" lines {b.start_line}-{b.end_line}"
    head = f"### {where}  `{b.symbol}`" + (f"  [{', '.join(b.arch)}]" if b.arch else "")
    inc = f"\n{b.include_line}" if b.include_line else ""
    snippet = "\n".join(lines)
    return f"{head}{inc}\n```cpp\n{snippet}\n```"


class LocalToolBox:
    """Tools over a Hunter (the index) and the parent's Evidence; either may be missing."""

    def __init__(
        self,
        hunter: Hunter | Hunters | None = None,
        evidence: Evidence | None = None,
        *,
        root: str | Path | None = None,
        arch: str | None = None,
    ) -> None:
        self.hunter = hunter  # a Hunter, or an index.hunt.Hunters over several corpora
        self.evidence = evidence
        self.arch = arch
        self._root = Path(root) if root is not None else None  # the files of a single corpus, if known
        self._roots: dict[str, Path] = {}  # corpus -> its files on disk, resolved when first read
        self._root_errors: dict[str, str] = {}
        # Proposals run in threads; the index (Chroma client, embedding model) is shared, so one query at a time.
        self._lock = threading.Lock()

    def with_evidence(self, evidence: Evidence | None) -> LocalToolBox:
        """The same index with another parent's profile (the loop makes one per expansion)."""
        box = LocalToolBox(self.hunter, evidence, root=self._root, arch=self.arch)
        box._roots, box._root_errors = self._roots, self._root_errors
        box._lock = self._lock
        return box

    def available_tools(self) -> tuple[str, ...]:
        names: list[str] = []
        if self.hunter is not None:
            names += SOURCE_TOOLS
        if self.evidence is not None:
            names += PROFILE_TOOLS
        return tuple(names)

    # --- sources ---------------------------------------------------------------------------------------

    def search_sources(self, query: str, k: int = 5) -> str:
        if self.hunter is None:
            return NO_INDEX
        if not str(query).strip():
            return "error: empty query: give words or an identifier to search for"
        k = max(1, min(MAX_K, int(k)))
        try:
            with self._lock:
                blocks = self.hunter.hunt(query, k=k, arch=self.arch)
        except Exception as e:  # a failing index must not end the conversation
            return f"error: the search failed: {type(e).__name__}: {str(e)[:200]}"
        if not blocks:
            return f"no building blocks found for {query!r}"
        return _cut("\n\n".join(format_block(b) for b in blocks))

    def _members(self) -> tuple[Any, ...]:
        """The hunter of each corpus searched (one, or the members of a Hunters)."""
        if self.hunter is None:
            return ()
        return tuple(getattr(self.hunter, "hunters", None) or (self.hunter,))

    def _corpus_root(self, member: Any) -> Path | None:
        name = member.corpus
        if self._root is not None and len(self._members()) == 1:
            return self._root
        if name not in self._roots and name not in self._root_errors:
            try:  # lazily: resolving a packaged corpus reads distribution metadata
                from corpora import load_corpus, resolve_root

                # A folder corpus (local) is read where its index was built from (--folder), when known.
                built = (getattr(getattr(member, "side", None), "manifest", None) or {}).get("root")
                if built and Path(built).is_dir():
                    self._roots[name] = Path(built)
                else:
                    self._roots[name] = resolve_root(load_corpus(name), member.cfg.cache_dir)
            except Exception as e:
                self._root_errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
        return self._roots.get(name)

    def _indexed(self, path: str) -> tuple[Any, str] | None:
        """The corpus's hunter and the corpus-relative path when it names an indexed file (`corpus:path` or
        the path alone, looked up in the corpora in order); None for anything else."""
        p = str(path).strip().replace("\\", "/")
        members = self._members()
        named = [(m, p.removeprefix(f"{m.corpus}:")) for m in members if p.startswith(f"{m.corpus}:")]
        for m, rel in named or [(m, p) for m in members]:
            pure = PurePosixPath(rel)
            if pure.is_absolute() or ".." in pure.parts:
                return None
            if pure.as_posix() in m.all_paths:
                return m, pure.as_posix()
        return None

    def _names(self) -> str:
        names = [m.corpus for m in self._members()]
        return f"corpus {names[0]!r}" if len(names) == 1 else f"corpora {', '.join(map(repr, names))}"

    def _read(self, member: Any, rel: str) -> str:
        root = self._corpus_root(member)
        if root is None:
            why = self._root_errors.get(member.corpus, "no root")
            raise FileNotFoundError(f"the corpus files are not on disk ({why})")
        root = root.resolve()
        full = (root / rel).resolve()
        if not full.is_relative_to(root):  # a symlink out of the corpus
            raise PermissionError(f"{rel} resolves outside the corpus root")
        return full.read_text(errors="replace")

    def open_source(self, path: str, start_line: int = 1, end_line: int | None = None) -> str:
        if self.hunter is None:
            return NO_INDEX
        found = self._indexed(path)
        if found is None:
            # Only files of the index: the model must not read arbitrary files of this machine.
            return (
                f"refused: {path!r} is not a file of the indexed {self._names()}; use a path exactly as "
                "search_sources printed it"
            )
        member, rel = found
        try:
            lines = self._read(member, rel).splitlines()
        except (OSError, PermissionError) as e:
            return f"error: cannot read {rel}: {e}"
        start = max(1, int(start_line or 1))
        end = int(end_line) if end_line else start + OPEN_MAX_LINES - 1
        end = min(len(lines), end, start + OPEN_MAX_LINES - 1)
        if start > len(lines):
            return f"{rel} has only {len(lines)} lines"
        body = "\n".join(f"{n:5d}  {lines[n - 1]}" for n in range(start, end + 1))
        more = f"\n... ({len(lines) - end} more lines)" if end < len(lines) else ""
        return _cut(f"{member.corpus}:{rel} lines {start}-{end} of {len(lines)}\n{body}{more}")

    def follow_includes(self, path: str) -> str:
        if self.hunter is None:
            return NO_INDEX
        found = self._indexed(path)
        if found is None:
            return f"refused: {path!r} is not a file of the indexed {self._names()}"
        member, rel = found
        from index.hunt import Block, include_line

        includes = member.file_includes.get(rel, ())
        try:
            text = self._read(member, rel)
        except (OSError, PermissionError):
            text = ""
        out = [f"{rel} includes: {', '.join(includes) if includes else '(nothing)'}"]
        if text:
            block = Block(
                corpus=member.corpus,
                path=rel,
                symbol=PurePosixPath(rel).name,
                kind="header",
                arch=(),
                snippet=text,
                include_line=include_line(rel, "header"),
                score=0.0,
                sources=(),
            )
            try:
                with self._lock:
                    deps = member.follow_includes(block)
            except Exception as e:
                deps = []
                out.append(f"(could not follow definitions: {type(e).__name__})")
            if deps:
                out.append("Definitions it uses from them:")
                out += [format_block(d, max_lines=25) for d in deps]
        return _cut("\n\n".join(out))

    # --- profiling -------------------------------------------------------------------------------------

    def profile(self, tool: str) -> str:
        if self.evidence is None:
            return NO_EVIDENCE
        from pipeline.profile.roofline import classify
        from pipeline.profile.tools.base import available, registry

        tools = registry()
        t = tools.get(str(tool).strip())
        if t is None:
            return f"unknown profiling tool {tool!r}; the tools are: {', '.join(sorted(tools))}"
        if not available(self.evidence, t.needs):
            return f"{t.name} needs {', '.join(sorted(t.needs))} evidence, which the parent's profile lacks"
        try:
            cls = classify(self.evidence)
            findings = t.analyze(self.evidence, cls)
        except Exception as e:  # a tool bug must not end the conversation
            return f"error: {t.name} failed: {type(e).__name__}: {str(e)[:200]}"
        head = f"[{t.name}] on the parent ({cls.bound.value}-bound)"
        if cls.bound not in t.applies_to:
            head += f"; note: this tool does not usually apply to a {cls.bound.value}-bound kernel"
        if not findings:
            return f"{head}: no finding"
        parts = [head]
        for f in findings:
            ev = ", ".join(f"{k}={v:g}" for k, v in f.evidence.items())
            edits = f" Suggested edits: {', '.join(f.edits)}." if f.edits else ""
            parts.append(f"severity {f.severity:.2f}: {f.diagnosis}\nFix: {f.advice}{edits}\nEvidence: {ev}")
        return _cut("\n".join(parts))

    def list_profile_tools(self) -> str:
        if self.evidence is None:
            return NO_EVIDENCE
        from pipeline.profile.roofline import classify
        from pipeline.profile.tools.base import available, registry

        try:
            bound = classify(self.evidence).bound.value
        except Exception:
            bound = "unknown"
        lines = [f"The parent is {bound}-bound. Tools (call profile(tool)):"]
        for name, t in sorted(registry().items()):
            applies = ", ".join(sorted(b.value for b in t.applies_to))
            ok = "evidence present" if available(self.evidence, t.needs) else "evidence missing"
            lines.append(f"- {name}: applies to {applies}; needs {', '.join(sorted(t.needs))} ({ok})")
        return "\n".join(lines)


def describe_call(name: str, args: dict[str, Any] | None) -> str:
    """A short log line for a tool call: `search_sources(query='wgmma tma')`."""
    if args is None:
        return f"{name}(<unreadable arguments>)"
    parts = []
    for k, v in args.items():
        r = repr(v)
        parts.append(f"{k}={r[:60] + '...' if len(r) > 60 else r}")
    return f"{name}({', '.join(parts)})"


def dispatch(box: ToolBox | None, name: str, args: dict[str, Any]) -> str:
    """Call one tool by name with the model's arguments; every failure is an answer, not an exception."""
    if box is None:
        return "error: no tools are available in this session; answer with the code blocks"
    try:
        if name == "search_sources":
            return box.search_sources(str(args["query"]), int(args.get("k", 5) or 5))
        if name == "open_source":
            end = args.get("end_line")
            return box.open_source(
                str(args["path"]), int(args.get("start_line", 1) or 1), int(end) if end else None
            )
        if name == "follow_includes":
            return box.follow_includes(str(args["path"]))
        if name == "profile":
            return box.profile(str(args["tool"]))
        if name == "list_profile_tools":
            return box.list_profile_tools()
    except KeyError as e:
        return f"error: {name} needs the argument {e.args[0]!r}"
    except (TypeError, ValueError) as e:
        return f"error: bad arguments for {name}: {str(e)[:200]}"
    return f"error: unknown tool {name!r}; the tools are: {', '.join(TOOL_SPECS)}"


__all__ = [
    "NO_EVIDENCE",
    "NO_INDEX",
    "TOOL_SPECS",
    "LocalToolBox",
    "ToolBox",
    "describe_call",
    "dispatch",
    "format_block",
]
