import numpy
import torch
import torch.nn as nn

THREADS = 256
UNROLL = 4  # float4s per thread per step: kUnroll in kernel.cu
# Cap on the grid, past which the kernel's grid-stride loop takes over. Measured on the H200 at 8192^2: a
# grid covering the tensor in one step (16384 blocks) ran ~3% faster than 32 blocks per SM looping.
MAX_BLOCKS_PER_SM = 128


class ModelNew(nn.Module):
    def __init__(self, scale: float, shift: float):
        super().__init__()
        self.scale = scale
        self.shift = shift
        self.sms = 0  # SM count, read on the first call (the device is not known before)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        n = x.numel()
        if n == 0:
            return y
        if not self.sms:
            self.sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        blocks = min(-(-n // (4 * THREADS * UNROLL)), self.sms * MAX_BLOCKS_PER_SM)
        kernels.elementwise_chain(  # noqa: F821 -- `kernels` is provided by the runtime
            (blocks,),
            (THREADS,),
            (x, y, numpy.int64(n), numpy.float32(self.scale), numpy.float32(self.shift)),
        )
        return y
