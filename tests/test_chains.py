"""Chains of views, cuts and copies composed into one gather (pipeline/generate/expert/chains.py): the
algebra against PyTorch on random chains (reshapes, permutes, slices, selects, copies), what a returned
link and an input source keep, Swin's window partition and reverse lowered to one gather each, a cut
between copies to one strided gather, and both tasks through the expert and the CPU emulator."""

from __future__ import annotations

import math
import random
import textwrap
from pathlib import Path

import pytest
import torch
from fuzz_expert import check_task

from pipeline.generate.expert import chains
from pipeline.generate.expert.graph import Node, Ref
from pipeline.generate.expert.policy import analyse


def _run(nodes: list[Node], x: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    """The links evaluated as PyTorch (and the launcher: a reshape copies where no view exists) runs them,
    and the copies made (each `contiguous`, as the launcher's region writes one, and each such reshape)."""
    env, copies = {"x": x}, 0
    for n in nodes:
        t = env[n.args[0].name]
        if n.op == "permute":
            env[n.name] = t.permute(*n.args[1])
        elif n.op == "transpose":
            env[n.name] = t.transpose(n.args[1], n.args[2])
        elif n.op == "contiguous":
            env[n.name] = t.contiguous()
            copies += 1
        elif n.op == "slice":
            env[n.name] = t[(slice(None),) * n.args[1] + (slice(*n.args[2:5]),)]
        elif n.op == "select":
            env[n.name] = t.select(n.args[1], n.args[2])
        elif n.op == "as_strided":  # the launcher's _strided: counted in elements of the contiguous source
            c = t.contiguous()
            env[n.name] = c.as_strided(n.args[1], n.args[2], c.storage_offset() + n.args[3])
        else:
            try:
                env[n.name] = t.view(tuple(n.args[1]))
            except RuntimeError:
                env[n.name] = t.reshape(tuple(n.args[1]))
                copies += 1
    return env, copies


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _random_chain(rng: random.Random) -> tuple[tuple[int, ...], list[Node]]:
    shape = tuple(rng.choice((1, 2, 3, 4, 5, 6, 8, 12)) for _ in range(rng.randint(1, 4)))
    cur, nodes, prev = shape, [], "x"
    for i in range(rng.randint(2, 7)):
        kind = rng.choice(("reshape", "reshape", "permute", "transpose", "contiguous", "slice", "select"))
        if kind == "reshape":  # regroup the prime factors, in order, or (now and then) shuffled: misaligned
            ps = [p for d in cur for p in _primes(d)]
            if rng.random() < 0.2:
                rng.shuffle(ps)
            new, j = [], 0
            while j < len(ps):
                k = rng.randint(1, 3)
                new.append(math.prod(ps[j : j + k]))
                j += k
            if rng.random() < 0.3:
                new.insert(rng.randrange(len(new) + 1), 1)
            n = Node(f"n{i}", "view", "default", (Ref(prev), tuple(new)), (), tuple(new), "float32")
            cur = tuple(new)
        elif kind == "permute" and len(cur) > 1:
            perm = list(range(len(cur)))
            rng.shuffle(perm)
            cur = tuple(cur[d] for d in perm)
            n = Node(f"n{i}", "permute", "default", (Ref(prev), tuple(perm)), (), cur, "float32")
        elif kind == "transpose" and len(cur) > 1:
            a, b = rng.sample(range(len(cur)), 2)
            c = list(cur)
            c[a], c[b] = c[b], c[a]
            cur = tuple(c)
            n = Node(f"n{i}", "transpose", "default", (Ref(prev), -len(cur) + a, b), (), cur, "float32")
        elif kind == "slice" and cur and max(cur) > 1:
            d = rng.choice([d for d, s in enumerate(cur) if s > 1])
            start, step = rng.randrange(cur[d] - 1), rng.choice((1, 1, 2, 3))
            stop = rng.choice((None, rng.randint(start + 1, cur[d]), -1 if start < cur[d] - 1 else None))
            part = tuple(range(cur[d]))[start:stop:step]
            c = list(cur)
            c[d] = len(part)
            cur = tuple(c)
            n = Node(f"n{i}", "slice", "Tensor", (Ref(prev), d, start, stop, step), (), cur, "float32")
        elif kind == "select" and len(cur) > 1:
            d = rng.randrange(len(cur))
            idx = rng.randrange(-cur[d], cur[d])
            cur = cur[:d] + cur[d + 1 :]
            n = Node(f"n{i}", "select", "int", (Ref(prev), d, idx), (), cur, "float32")
        else:
            n = Node(f"n{i}", "contiguous", "default", (Ref(prev),), (), cur, "float32")
        nodes.append(n)
        prev = n.name
    return shape, nodes


def test_random_chains_compose_to_the_same_tensor_with_fewer_copies():
    rng = random.Random(7)
    composed = strided = 0
    for _ in range(1500):
        shape, links = _random_chain(rng)
        src = Node("x", "input", "default", (), (), shape, "float32")
        by_name = {n.name: n for n in (src, *links)}
        new = chains.compose(list(links), by_name)
        x = torch.randn(shape)
        end = links[-1].name
        (before, copied), (after, copies) = _run(links, x), _run(new, x)
        want, got = before[end], after[end]
        assert got.shape == want.shape and torch.equal(got, want), (shape, links, new)
        assert copied == chains._copies(src, links)  # the rule's count is the launcher's
        if new != links:
            composed += 1
            strided += any(n.op == "as_strided" for n in new)
            assert copies < copied, (links, new)  # each part composed saved a copy at least
    # the draw exercises the rewrite (with cuts: the source's elements at strides), not only what it leaves
    assert composed > 100 and strided > 30, (composed, strided)


SWIN = """
import torch
import torch.nn as nn


class Model(nn.Module):
    # a window partition with its heads split off, a per-window map, and the way back (Swin-MLP's pattern)
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(6, 1, 1))

    def forward(self, x):
        B, H, W, C = x.shape
        w = x.view(B, H // 3, 3, W // 3, 3, C).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, 9, C)
        h = w.view(-1, 9, 2, C // 2).transpose(1, 2).reshape(-1, 18, C // 2)
        h = torch.tanh(h) * 1.5 + 0.25
        w = h.view(-1, 2, 9, C // 2).transpose(1, 2).reshape(-1, 9, C).view(-1, 3, 3, C)
        w = w.view(B, H // 3, W // 3, 3, 3, C).permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H * W, C)
        return w + x.view(B, H * W, C)


def get_inputs():
    return [torch.randn(2, 6, 9, 12)]


def get_init_inputs():
    return []
"""


CUT = """
import torch
import torch.nn as nn


class Model(nn.Module):
    # channels last made contiguous, then its border cut off and made contiguous again, rows taken by a step
    def forward(self, x):
        y = x.permute(0, 2, 3, 1).contiguous()[:, 1:-1, ::2].contiguous().view(x.shape[0], -1)
        return torch.sigmoid(y) * 2.0 - 0.5


def get_inputs():
    return [torch.randn(3, 5, 9, 11)]


def get_init_inputs():
    return []
"""


def test_a_cut_between_copies_lowers_to_one_strided_gather(tmp_path):
    path = tmp_path / "cut.py"
    path.write_text(textwrap.dedent(CUT))
    low, why = analyse(path)
    assert low is not None, why
    ops = [n.op for n in low.nodes]
    assert ops.count("contiguous") == 1 and ops.count("as_strided") == 1, ops
    assert "slice" not in ops and "permute" not in ops


def test_a_link_that_is_returned_ends_its_chain(tmp_path):
    path = tmp_path / "returned.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
        "        a = x.permute(0, 2, 1).contiguous()\n"
        "        return a, a.view(2, 5, 3, 3).transpose(1, 2).contiguous() * 2.0\n\n\n"
        "def get_inputs():\n    return [torch.randn(2, 9, 5)]\n\n\ndef get_init_inputs():\n    return []\n"
    )
    low, why = analyse(path)
    assert low is not None, why
    copies = [n for n in low.nodes if n.op == "contiguous"]
    assert len(copies) == 2 and copies[0].args[0] != copies[1].args[0], [(n.name, n.op) for n in low.nodes]
    assert any(n.name == low.graph.output_names()[0] for n in low.nodes)  # the first output still computed


def test_a_chain_from_an_input_keeps_a_copy_where_it_needs_none(tmp_path):
    """Two transposes and two copies are the input itself: a view of it returned would share its memory,
    which the harness rejects (verify.check_aliasing), so one copy stays."""
    path = tmp_path / "round_trip.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
        "        return x.transpose(1, 2).contiguous().transpose(1, 2).contiguous()\n\n\n"
        "def get_inputs():\n    return [torch.randn(2, 9, 5)]\n\n\ndef get_init_inputs():\n    return []\n"
    )
    low, why = analyse(path)
    assert low is not None, why
    assert [n.op for n in low.nodes] == ["view", "contiguous"], [(n.name, n.op, n.args) for n in low.nodes]


def test_swin_windows_lower_to_one_gather_each_way(tmp_path):
    path = tmp_path / "windows.py"
    path.write_text(textwrap.dedent(SWIN))
    low, why = analyse(path)
    assert low is not None, why
    gathers = [n for n in low.nodes if n.op == "contiguous"]
    assert len(gathers) == 2, [(n.name, n.op) for n in low.nodes]  # four copies as written
    assert not any(n.op == "reshape" for n in low.nodes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SWIN", "CUT"])
def test_composed_chains_verify_in_the_emulator(tmp_path, name):
    path = tmp_path / f"{name.lower()}.py"
    path.write_text(textwrap.dedent(globals()[name]))
    result = check_task(Path(path), 1e-5, edits=1)
    assert result["outcome"] == "ok", result
