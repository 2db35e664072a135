import numpy
import torch
import torch.nn as nn

REG_ITEMS = 16  # floats per thread held in registers by softmax_reg_* (N * V in kernel.cu)
MAX_THREADS = 1024
MAX_BLOCKS = 65535  # the kernels loop over rows beyond this


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.numel() == 0:
            return y
        cols = x.shape[-1]
        rows = x.numel() // cols
        # 16-byte accesses need every row start aligned: cols % 4 == 0 and aligned base pointers.
        vec = cols % 4 == 0 and x.data_ptr() % 16 == 0 and y.data_ptr() % 16 == 0
        threads = 32 * -(-cols // (REG_ITEMS * 32))  # enough threads for the row to fit in registers
        args = (x, y, numpy.int64(rows), numpy.int32(cols))
        grid, block = (min(rows, MAX_BLOCKS),), (min(threads, MAX_THREADS),)
        # Direct calls (not a kernel held in a variable), so a static reading sees every launch.
        # `kernels` is provided by the runtime.
        if threads <= MAX_THREADS and vec:
            kernels.softmax_reg_v4(grid, block, args)  # noqa: F821
        elif threads <= MAX_THREADS:
            kernels.softmax_reg_v1(grid, block, args)  # noqa: F821
        elif vec:  # too long for registers: two passes over the row
            kernels.softmax_long_v4(grid, block, args)  # noqa: F821
        else:
            kernels.softmax_long_v1(grid, block, args)  # noqa: F821
        return y
