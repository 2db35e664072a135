import numpy
import torch
import torch.nn as nn

THREADS = 256
MAX_BLOCKS = 132 * 32


class ModelNew(nn.Module):
    def __init__(self, scale: float, shift: float):
        super().__init__()
        self.scale = scale
        self.shift = shift

    def _blocks(self, n: int) -> int:
        return max(1, min((n + THREADS - 1) // THREADS, MAX_BLOCKS))

    def _launch_residual(self, x: torch.Tensor, acc: torch.Tensor) -> None:
        n = x.numel()
        kernels.accumulate_residual(self._blocks(n), THREADS, (x, acc, numpy.int64(n)))

    def _launch_activation(self, x: torch.Tensor, acc: torch.Tensor) -> None:
        n = x.numel()
        args = (x, acc, numpy.int64(n), numpy.float32(self.scale), numpy.float32(self.shift))
        kernels.accumulate_activation(self._blocks(n), THREADS, args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        acc = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        if x.numel() == 0:
            return acc
        self._launch_residual(x, acc)
        self._launch_activation(x, acc)
        return acc
