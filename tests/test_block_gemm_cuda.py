"""The block-scaled GEMM on a GPU against te_fuser's C kernel on the CPU, within docs/block_scaling.md's bounds:
the engine the device takes (cuBLASLt where block_gemm_engine names it, else the emulation) and the emulation
itself, for each recipe's block."""

import pytest
import torch

from block_gemm_bounds import magnitude64, split_bound
from te_fuser.kernels import gemm as gemm_kernels
from te_fuser.ops.block_gemm import block_scaled_gemm_nt
from te_fuser.ops.block_gemm_cuda import emulated_block_scaled_gemm_nt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
HARDWARE_U = 2.0**-14  # the FP8 tensor cores' accumulator keeps about 14 bits (DeepSeek-V3 report, H800)


def random_case(generator, m, n, k, block):
    nb = -(-k // block)
    a = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=generator).view(torch.float8_e4m3fn).float()
    b = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=generator).view(torch.float8_e4m3fn).float()
    a, b = (torch.where(x.isfinite(), x, 1.0).to(torch.float8_e4m3fn) for x in (a, b))
    # powers of two: exact in E8M0 for the MXFP8 library; odd values elsewhere
    sa = torch.exp2(torch.randint(-12, 6, (m, nb), generator=generator).float())
    sb = torch.exp2(torch.randint(-12, 6, (n, nb), generator=generator).float())
    if block != 32:
        sa, sb = sa * (1 + torch.rand(m, nb, generator=generator)), sb * (1 + torch.rand(n, nb, generator=generator))
    return a, sa, b, sb, torch.randn(n, generator=generator)


def assert_within(out, ref, bound):
    excess = (out.double().cpu() - ref.double()).abs() - bound
    assert bool((excess <= 0).all()), f"{int((excess > 0).sum())} values beyond the bound, worst by {excess.max()}"


@pytest.mark.parametrize("m,n,k,block", [(64, 48, 512, 128), (64, 48, 512, 32), (64, 48, 512, 16),
                                         (37, 29, 300, 32), (20, 33, 200, 128)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_device_engine_against_the_c_kernel(m, n, k, block, out_dtype, generator):
    a, sa, b, sb, bias = random_case(generator, m, n, k, block)
    bias = bias.to(out_dtype)
    c_kernel = block_scaled_gemm_nt(a, sa, b, sb, block, out_dtype, bias)
    dev = [t.to(CUDA) for t in (a, sa, b, sb, bias)]
    engine = gemm_kernels.block_gemm_engine(dev[0], dev[2], block, out_dtype)
    out = block_scaled_gemm_nt(*dev[:4], block, out_dtype, dev[4])
    assert gemm_kernels.last_block_gemm_engine() == engine and out.device.type == "cuda" and out.dtype == out_dtype
    d = magnitude64(a, sa, b, sb, block, bias)
    rounding = torch.finfo(out_dtype).eps * (out.double().cpu().abs() + c_kernel.double().abs())
    if engine == "device_emulation":
        assert_within(out, c_kernel, 2 * split_bound(k, block, bias=True) * d + rounding)
    else:  # the tensor cores' order and accumulator width, then the bias added to the bf16 result
        hardware = (k + 3) * HARDWARE_U
        assert_within(out, c_kernel, (split_bound(k, block, bias=True) + hardware) * d + 2 * rounding)


@pytest.mark.parametrize("m,n,k,block", [(64, 48, 512, 128), (37, 29, 300, 32), (33, 17, 80, 16)])
def test_emulation_on_the_device_against_the_c_kernel(m, n, k, block, generator):
    a, sa, b, sb, bias = random_case(generator, m, n, k, block)
    c_kernel = block_scaled_gemm_nt(a, sa, b, sb, block, torch.float32, bias)
    out = emulated_block_scaled_gemm_nt(*(t.to(CUDA) for t in (a, sa, b, sb)), block, torch.float32, bias.to(CUDA))
    assert_within(out, c_kernel, 2 * split_bound(k, block, bias=True) * magnitude64(a, sa, b, sb, block, bias))
