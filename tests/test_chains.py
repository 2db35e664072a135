"""Chains of views and copies composed into one gather (pipeline/generate/expert/chains.py): the algebra
against PyTorch on random chains, Swin's window partition and reverse lowered to one gather each, and a
window-partitioned task through the expert and the CPU emulator."""

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


def _run(nodes: list[Node], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The links evaluated as PyTorch (and the launcher: a reshape copies where no view exists) runs them."""
    env = {"x": x}
    for n in nodes:
        t = env[n.args[0].name]
        if n.op == "permute":
            env[n.name] = t.permute(*n.args[1])
        elif n.op == "transpose":
            env[n.name] = t.transpose(n.args[1], n.args[2])
        elif n.op == "contiguous":
            env[n.name] = t.contiguous()
        else:
            env[n.name] = t.reshape(tuple(n.args[1]))
    return env


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
        kind = rng.choice(("reshape", "reshape", "permute", "transpose", "contiguous"))
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
        else:
            n = Node(f"n{i}", "contiguous", "default", (Ref(prev),), (), cur, "float32")
        nodes.append(n)
        prev = n.name
    return shape, nodes


def test_random_chains_compose_to_the_same_tensor_with_fewer_copies():
    rng = random.Random(7)
    composed = 0
    for _ in range(600):
        shape, links = _random_chain(rng)
        src = Node("x", "input", "default", (), (), shape, "float32")
        by_name = {n.name: n for n in (src, *links)}
        new = chains.compose(list(links), by_name)
        x = torch.randn(shape)
        end = links[-1].name
        want, got = _run(links, x)[end], _run(new, x)[end]
        assert got.shape == want.shape and torch.equal(got, want), (shape, links, new)
        if new != links:
            composed += 1
            assert chains._copies(src, links) >= 2
            assert sum(n.op == "contiguous" for n in new) <= 1  # one gather, or none (a regrouping only)
            assert sum(n.op != "permute" and n.op != "contiguous" for n in new) <= 2
    assert composed > 50  # the draw exercises the rewrite, not only the chains it leaves alone


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


def test_swin_windows_lower_to_one_gather_each_way(tmp_path):
    path = tmp_path / "windows.py"
    path.write_text(textwrap.dedent(SWIN))
    low, why = analyse(path)
    assert low is not None, why
    gathers = [n for n in low.nodes if n.op == "contiguous"]
    assert len(gathers) == 2, [(n.name, n.op) for n in low.nodes]  # four copies as written
    assert not any(n.op == "reshape" for n in low.nodes)


@pytest.mark.slow
def test_a_window_partitioned_task_verifies_in_the_emulator(tmp_path):
    path = tmp_path / "windows.py"
    path.write_text(textwrap.dedent(SWIN))
    result = check_task(Path(path), 1e-5, edits=1)
    assert result["outcome"] == "ok", result
