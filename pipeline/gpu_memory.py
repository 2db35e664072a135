"""GPU memory for the verification protocol: what is free, the NaN poison, and input fingerprints.

The protocol must fit for any task whose eager forward fits (a 7.5 GB fp32 input included), so every
allocation it makes beyond the task's own is sized from what is free now, and an input too large to copy is
checked for mutation by a keyed fingerprint instead of a clone.
"""

from __future__ import annotations

import os

import torch

POISON_BYTE = 0xFF  # NaN in every float format, -1 in signed integers
POISON_SHARE = 0.25  # of the free memory, at most, for the poison block
CLONE_SHARE = 0.15  # inputs larger than this share of free memory are fingerprinted, not cloned
_FP_CHUNK = 1 << 24

# A random key per process: a candidate cannot craft a mutation that keeps the fingerprint.
_KEY = int.from_bytes(os.urandom(8), "little") | 1
_MASK = (1 << 64) - 1


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation can get: free on the device plus what torch's cache holds unused."""
    if device.type != "cuda":
        return 1 << 62
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def poison_allocator(device: torch.device, want_bytes: int) -> None:
    """Leave the caching allocator full of NaN-filled free blocks, so that memory a candidate allocates and
    never writes reads back as poison. Both pools: large blocks and the 2 MB segments of small ones. The big
    block is sized from free memory: never the cause of an out-of-memory error where eager runs."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    size = min(max(want_bytes, 64 << 20), int(POISON_SHARE * free_bytes(device)))
    big = torch.empty(max(size, 1 << 20), dtype=torch.uint8, device=device)
    big.fill_(POISON_BYTE)
    small = [torch.empty(s, dtype=torch.uint8, device=device) for s in (512, 4096, 65536, 512 << 10) * 8]
    for t in small:
        t.fill_(POISON_BYTE)
    torch.cuda.synchronize(device)
    del big, small


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width, flattened: NaN equals NaN, -0 differs from 0."""
    x = t.detach()
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if x.is_complex():
        x = torch.view_as_real(x)
    return x.contiguous().reshape(-1).view(_BITS[x.element_size()])


def fingerprint(t: torch.Tensor) -> int:
    """A keyed hash of a tensor's bits: any change to any element changes it (but for a 2^-64 chance)."""
    x = bits(t)
    weights_cache: dict[int, torch.Tensor] = {}
    acc = x.numel() & _MASK
    for start in range(0, x.numel(), _FP_CHUNK):
        part = x[start : start + _FP_CHUNK].to(torch.int64)
        n = part.numel()
        w = weights_cache.get(n)
        if w is None:
            # Odd weights from a keyed linear congruence: cheap to make on the device, unknown to the candidate.
            idx = torch.arange(n, dtype=torch.int64, device=x.device)
            w = weights_cache[n] = (idx * 6364136223846793005 + _KEY) | 1
        acc = (acc * 1099511628211 + int((part * w).sum())) & _MASK
    return acc


def keep_for_mutation_check(inputs: list, device: torch.device) -> list:
    """Clones of the inputs when they fit comfortably, else fingerprints (ints); non-tensors as they are."""
    total = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
    clone = total <= CLONE_SHARE * free_bytes(device)
    return [(x.clone() if clone else fingerprint(x)) if isinstance(x, torch.Tensor) else x for x in inputs]


def mutation_reasons(inputs: list, kept: list) -> list[str]:
    reasons = []
    for i, (x, k) in enumerate(zip(inputs, kept, strict=True)):
        if not isinstance(x, torch.Tensor):
            continue
        if isinstance(k, torch.Tensor):
            if x.shape != k.shape or not torch.equal(bits(x), bits(k)):
                changed = int((bits(x) != bits(k)).sum()) if x.shape == k.shape else x.numel()
                reasons.append(f"input_mutated: input {i} changed in {changed} of {x.numel()} elements")
        elif fingerprint(x) != k:
            reasons.append(
                f"input_mutated: input {i} changed (its fingerprint differs; too large to keep a copy)"
            )
    return reasons
