"""The CPU emulator the kernel tests run on (tests/cuda_emulator.py): barriers, shuffles and cluster
barriers among a block's threads behave as on the GPU, and what a GPU would hang or fault on is an error."""

from __future__ import annotations

import shutil

import numpy
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the CPU emulator")

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(1024) block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
    extern __shared__ __align__(16) unsigned char kp_smem[];
    float* part = reinterpret_cast<float*>(kp_smem);
    float v = 0.f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) v += x[i];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) out[blockIdx.x] = v;
    }
}

extern "C" __global__ void __launch_bounds__(256) rotate(float* __restrict__ out, int barrier) {
    extern __shared__ __align__(16) unsigned char kp_smem[];
    float* s = reinterpret_cast<float*>(kp_smem);
    s[threadIdx.x] = (float)threadIdx.x;
    if (barrier) __syncthreads();
    out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

extern "C" __global__ void __launch_bounds__(128) divergent(float* __restrict__ out) {
    if (threadIdx.x < 64) __syncthreads();  // half the block never reaches it
    out[threadIdx.x] = 1.f;
}

extern "C" __global__ void __launch_bounds__(64) __cluster_dims__(4, 1, 1) neighbours(float* __restrict__ out) {
    extern __shared__ __align__(16) unsigned char kp_smem[];
    float* s = reinterpret_cast<float*>(kp_smem);
    s[threadIdx.x] = (float)(blockIdx.x * 1000 + threadIdx.x);
    kp_cluster_arrive();
    kp_cluster_wait();  // every block's shared memory is written
    const unsigned next = (kp_cluster_rank() + 1) % 4;
    out[blockIdx.x * blockDim.x + threadIdx.x] = kp_cluster_map(s, next)[threadIdx.x];
    kp_cluster_sync();  // no block leaves while another still reads its shared memory
}
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    from cuda_emulator import build

    return build(SOURCE, tmp_path_factory.mktemp("emu"))


@pytest.mark.parametrize("block", [32, 96, 1024])
def test_a_block_reduction_through_shuffles_and_shared_memory_is_exact(kernels, block):
    torch.manual_seed(0)
    x = torch.randint(-50, 50, (5000,)).float()  # integers: every order of the sum is exact
    out = torch.empty(3)
    kernels.block_sum((3,), (block,), [x, out, numpy.int32(x.numel())], shared_mem=4 * 32)
    assert out.sum().item() == x.sum().item()


def test_a_read_of_shared_memory_sees_other_threads_writes_only_after_the_barrier(kernels):
    expected = torch.roll(torch.arange(256).float(), -1)
    out = torch.empty(256)
    kernels.rotate((1,), (256,), [out, numpy.int32(1)], shared_mem=4 * 256)
    assert torch.equal(out, expected)
    kernels.rotate((1,), (256,), [out, numpy.int32(0)], shared_mem=4 * 256)
    assert not torch.equal(out, expected)  # the missing barrier shows: later threads had not written yet


def test_a_barrier_some_threads_never_reach_is_an_error_not_a_hang(kernels):
    with pytest.raises(RuntimeError, match="barrier the others never reach"):
        kernels.divergent((2,), (128,), [torch.empty(128)])
    out = torch.zeros(256)  # and the emulator is usable after it
    kernels.rotate((1,), (256,), [out, numpy.int32(1)], shared_mem=4 * 256)
    assert out[0].item() == 1.0


def test_each_block_of_a_cluster_reads_its_neighbours_shared_memory(kernels):
    out = torch.empty(8 * 64)
    kernels.neighbours((8,), (64,), [out], shared_mem=4 * 64)
    block = torch.arange(8).repeat_interleave(64)
    neighbour = block // 4 * 4 + (block % 4 + 1) % 4
    assert torch.equal(out, (neighbour * 1000 + torch.arange(64).repeat(8)).float())


STATIC = r"""
namespace kp_sizes {
constexpr int N = WIDTH;  // the array's size: the function's name and template arguments do not change
}
template <bool V>
__device__ __forceinline__ void fill_and_sum(float* __restrict__ out) {
    using namespace kp_sizes;
    __shared__ float buf[N], other[N];
    buf[threadIdx.x] = (float)(threadIdx.x + 1);
    __syncthreads();
    other[threadIdx.x] = 1000.f;  // beside buf: a buf too small for N runs into it
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (int i = 0; i < N; ++i) s += buf[i];
        out[0] = s;
    }
}
extern "C" __global__ void __launch_bounds__(WIDTH) kp_static_sum(float* __restrict__ out) {
    fill_and_sum<false>(out);
}
"""


def test_two_libraries_keep_their_own_shared_arrays_of_one_name(tmp_path):
    """A __shared__ array in a template function is a static here: two candidates' libraries (a 256-thread
    and a 512-thread version of one kernel) each keep their own, as two modules on the GPU do. As GNU unique
    symbols they were one (the first library's), and the second kernel's writes ran past it."""
    from cuda_emulator import build

    small = build(STATIC.replace("WIDTH", "8"), tmp_path)
    wide = build(STATIC.replace("WIDTH", "16"), tmp_path)
    outs = []
    for k, threads in ((small, 8), (wide, 16), (small, 8)):
        out = torch.zeros(1)
        k.kp_static_sum((1,), (threads,), (out,))
        outs.append(out.item())
    assert outs == [36.0, 136.0, 36.0]
