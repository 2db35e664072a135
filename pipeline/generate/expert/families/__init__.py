"""The registry of op families: every module of this package that defines `FAMILY` (a base.Family).

Adding a family is adding a module here (with its template, if it renders with a new one, and its
tests): the plan, the first plans, the edits, the renderer and the policy find it through this registry
and name no family themselves.
"""

from __future__ import annotations

import importlib
import pkgutil

from pipeline.generate.expert.families.base import Family
from pipeline.generate.expert.plan import RegionPlan
from pipeline.generate.expert.regions import Lowered, Region


def discover(package: str) -> tuple[Family, ...]:
    """The `FAMILY` of every module in a package, by order then tag."""
    found = []
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda m: m.name):
        family = getattr(importlib.import_module(f"{package}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            found.append(family)
    tags = [f.tag for f in found]
    if len(set(tags)) != len(tags) or "" in tags:
        raise ImportError(f"op families need distinct, non-empty tags: {tags}")
    return tuple(sorted(found, key=lambda f: (f.order, f.tag)))


FAMILIES = discover(__name__)
_BY_TAG = {f.tag: f for f in FAMILIES}


def by_tag(tag: str) -> Family:
    """The family a plan entry names; KeyError for one no module defines (a plan from elsewhere)."""
    return _BY_TAG[tag]


def owner(rp: RegionPlan) -> Family:
    """The family whose knobs a plan entry holds."""
    return _BY_TAG[rp.TAG]


def family_of(region: Region, low: Lowered) -> Family | None:
    """The family that computes a region (the first by order that claims it), or None: the launcher runs
    it with torch (a library call, a view, an op no template covers)."""
    return next((f for f in FAMILIES if f.claims(region, low)), None)


def edit_names() -> tuple[str, ...]:
    """Every edit some family makes, in family order."""
    return tuple(dict.fromkeys(e for f in FAMILIES for e in f.edits))


__all__ = ["FAMILIES", "Family", "by_tag", "discover", "edit_names", "family_of", "owner"]
