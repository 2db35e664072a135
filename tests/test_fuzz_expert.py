"""The random-model hunt (tests/fuzz_expert.py) itself: its draws are reproducible and run in PyTorch, and a
few of them go through the expert and the CPU emulator here. The long hunt runs by hand:
`python tests/fuzz_expert.py --seeds 1000:3000 --out DIR`."""

from __future__ import annotations

import shutil

import pytest
from fuzz_expert import V2_SEEDS, V3_SEEDS, V4_SEEDS, generate, run_case

from pipeline.tasks import load_module

torch = pytest.importorskip("torch")


def test_draws_are_reproducible_and_run_in_pytorch(tmp_path):
    invalid = []
    for seed in [
        *range(200),
        *(s for v in (V2_SEEDS, V3_SEEDS, V4_SEEDS) for s in range(v, v + 100)),
    ]:  # each set
        case = generate(seed)
        assert case.source() == generate(seed).source()
        path = tmp_path / f"fuzz_{seed}.py"
        path.write_text(case.source())
        module = load_module(path)
        with torch.no_grad():
            try:
                module.Model(*module.get_init_inputs())(*module.get_inputs())
            except Exception as e:  # the generator's own mistakes: rare (batch norm of one value a channel)
                invalid.append((seed, case.steps, str(e)[:80]))
    assert len(invalid) <= 12, invalid


# drawn cases the hunt passed: a direct convolution and a loss; a norm after a softmax over dim 0; a pool and
# KL divergence; attention written by hand, twice; (third set) a vector-matrix product and a norm of order
# -inf, an adaptive pool after a matmul, bilinear upsampling, batch statistics; (fourth set) a crop-and-pad
# then a roll of two dims, a pad before a transposed convolution and a cat, a chunk's halves then a cross
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the CPU emulator")
@pytest.mark.parametrize("seed", [1063, 1081, 1024, 1101, 20032, 20050, 20053, 20070, 22036, 22052, 22087])
def test_drawn_cases_through_the_expert_and_the_emulator(tmp_path, seed):
    result = run_case(seed, tmp_path, edits=1)
    assert result["outcome"] == "ok", result
