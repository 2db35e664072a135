import numpy
import torch
import torch.nn as nn

REG_ITEMS_V4, REG_ITEMS_V1 = 32, 16  # floats per thread held in registers (N * V in kernel.cu)
MAX_THREADS = 1024
MAX_BLOCKS = 65535  # the kernels loop over rows beyond this


class ModelNew(nn.Module):
    def __init__(self, normalized_shape: int, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(normalized_shape, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        w = self.norm.weight.contiguous()
        b = self.norm.bias.contiguous()
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.numel() == 0:
            return y
        cols = w.numel()  # the normalised (last) dimension
        rows = x.numel() // cols
        ptrs = (x.data_ptr(), y.data_ptr(), w.data_ptr(), b.data_ptr())
        vec = cols % 4 == 0 and all(p % 16 == 0 for p in ptrs)
        items = REG_ITEMS_V4 if vec else REG_ITEMS_V1
        threads = 32 * -(-cols // (items * 32))  # enough threads for the row to fit in registers
        args = (x, w, b, y, numpy.int64(rows), numpy.int32(cols), numpy.float32(self.norm.eps))
        grid, block = (min(rows, MAX_BLOCKS),), (min(threads, MAX_THREADS),)
        # Direct calls (not a kernel held in a variable), so a static reading sees every launch.
        # `kernels` is provided by the runtime.
        if threads <= MAX_THREADS and vec:
            kernels.layernorm_reg_v4(grid, block, args)  # noqa: F821
        elif threads <= MAX_THREADS:
            kernels.layernorm_reg_v1(grid, block, args)  # noqa: F821
        elif vec:  # too long for registers: a statistics pass, then a normalising pass
            kernels.layernorm_long_v4(grid, block, args)  # noqa: F821
        else:
            kernels.layernorm_long_v1(grid, block, args)  # noqa: F821
        return y
