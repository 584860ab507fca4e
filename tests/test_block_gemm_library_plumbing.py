"""The call plumbing of the block-scaled GEMM's library engines (te_fuser.ops.block_gemm_cuda), on meta tensors
with the device capability stubbed: which engine block_scaled_gemm_nt takes and reports, and the arguments it
hands torch's _scaled_mm_v2 (operand layouts, scale recipes, swizzles, dtypes, shapes and strides), checked
here against torch's documented layouts, since torch 2.14's meta kernel no longer checks the scales (2.13's
does, and runs on every call below). The re-layouts themselves (the E8M0 cast, the 32_4_4 swizzle) run on CPU
tensors against an independent index formula."""

import pytest
import torch
import torch.nn.functional as F

from te_fuser.kernels import gemm as gemm_kernels
from te_fuser.ops import block_gemm_cuda
from te_fuser.ops.block_gemm import block_scaled_gemm_nt, e8m0_values

META = torch.device("meta")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Recorder:
    """Stands in for torch.ops.aten in block_gemm_cuda: runs each op and records (name, args)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)

        def call(*args):
            self.calls.append((name, args))
            return op(*args)
        return call


@pytest.fixture
def aten(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(block_gemm_cuda, "_aten", recorder)
    return recorder


def capability(monkeypatch, cap):
    monkeypatch.setattr(block_gemm_cuda, "_capability", lambda device: cap)


def meta_case(m, n, k, block, dtypes=(E4M3, E4M3), strided=False):
    nb = -(-k // block)
    sb = torch.empty(nb, n, device=META).t() if strided else torch.empty(n, nb, device=META)
    return (torch.empty(m, k, dtype=dtypes[0], device=META), torch.empty(m, nb, device=META),
            torch.empty(n, k, dtype=dtypes[1], device=META), sb)


def round_up(x, to):
    return -(-x // to) * to


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_float8_block_scaling_on_sm90(aten, monkeypatch, strided, bias):
    capability(monkeypatch, (9, 0))
    m, n, k = 48, 64, 384
    a, sa, b, sb = meta_case(m, n, k, 128, strided=strided)
    out = block_scaled_gemm_nt(a, sa, b, sb, 128, torch.bfloat16, torch.empty(n, device=META) if bias else None)
    assert gemm_kernels.last_block_gemm_engine() == "cublaslt_blockwise_1x128" and out.shape == (m, n)
    assert out.dtype == torch.bfloat16
    [(name, args)] = aten.calls
    assert name == "_scaled_mm_v2"
    mat_a, mat_b, [scale_a], recipe_a, swizzle_a, [scale_b], recipe_b, swizzle_b, lib_bias, dtype, dims, fast = args
    assert mat_a.shape == (m, k) and mat_a.stride() == (k, 1)  # row-major A
    assert mat_b.shape == (k, n) and mat_b.stride() == (1, k)  # column-major B: b.T
    assert recipe_a == recipe_b == [F.ScalingType.BlockWise1x128.value]
    assert swizzle_a == swizzle_b == [F.SwizzleType.NO_SWIZZLE.value]
    # torch's layout: (rows, K / 128) float32, column-major
    assert scale_a.shape == (m, 3) and scale_a.stride() == (1, m) and scale_a.dtype == torch.float32
    assert scale_b.shape == (n, 3) and scale_b.stride() == (1, n) and scale_b.dtype == torch.float32
    assert lib_bias is None and dtype == torch.bfloat16 and dims == [] and fast is False


@pytest.mark.parametrize("cap", [(10, 0), (10, 3)])
def test_mxfp8_on_sm100(aten, monkeypatch, cap):
    capability(monkeypatch, cap)
    m, n, k = 144, 32, 224  # 7 K blocks: padded to 8; 144 rows padded to 256
    a, sa, b, sb = meta_case(m, n, k, 32, dtypes=(E4M3, E5M2), strided=True)
    out = block_scaled_gemm_nt(a, sa, b, sb, 32, torch.bfloat16)
    assert gemm_kernels.last_block_gemm_engine() == "cublaslt_mxfp8" and out.shape == (m, n)
    [(name, args)] = aten.calls
    mat_a, mat_b, [scale_a], recipe_a, swizzle_a, [scale_b], recipe_b, swizzle_b = args[:8]
    assert mat_a.stride() == (k, 1) and mat_b.shape == (k, n) and mat_b.stride() == (1, k)
    assert mat_a.dtype == E4M3 and mat_b.dtype == E5M2
    assert recipe_a == recipe_b == [F.ScalingType.BlockWise1x32.value]
    assert swizzle_a == swizzle_b == [F.SwizzleType.SWIZZLE_32_4_4.value]
    assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu
    assert scale_a.shape == (round_up(m, 128) * round_up(7, 4),) and scale_b.shape == (128 * 8,)
    assert args[8] is None and args[9] == torch.bfloat16


# (capability, m, n, k, block, dtypes, out_dtype): what each library cannot take runs one GEMM on scale-folded
# operands, in bf16 for MXFP8's power-of-two scales, else in float32
ONE_PASS = [
    ((9, 0), 48, 64, 384, 32, (E4M3, E4M3), torch.bfloat16),     # MXFP8 on Hopper
    ((10, 0), 48, 64, 384, 128, (E4M3, E4M3), torch.bfloat16),   # 1x128 blocks on Blackwell
    ((10, 0), 48, 64, 384, 16, (E4M3, E4M3), torch.bfloat16),    # NVFP4 decode factors
    ((9, 0), 48, 64, 384, 128, (E4M3, E5M2), torch.bfloat16),    # HYBRID's E5M2 gradient
    ((10, 0), 48, 64, 384, 32, (E5M2, E5M2), torch.bfloat16),
    ((9, 0), 48, 64, 384, 128, (E4M3, E4M3), torch.float32),     # wgrad's float32 output
    ((10, 0), 48, 64, 400, 32, (E4M3, E4M3), torch.bfloat16),    # K ragged
    ((10, 0), 40, 64, 384, 32, (E4M3, E4M3), torch.bfloat16),    # M not a multiple of 16
    ((8, 9), 48, 64, 384, 128, (E4M3, E4M3), torch.bfloat16),
]


@pytest.mark.parametrize("allow_tf32", [False, True])
@pytest.mark.parametrize("cap,m,n,k,block,dtypes,out_dtype", ONE_PASS)
def test_the_rest_runs_one_pass_or_on_the_emulation(aten, monkeypatch, cap, m, n, k, block, dtypes, out_dtype,
                                                     allow_tf32):
    """TF32 would round the float32 engine's folded values: the split emulation (FP8 values, exact in TF32)
    runs instead; the bf16 engine's operands are bf16 either way."""
    capability(monkeypatch, cap)
    monkeypatch.setattr(block_gemm_cuda, "_tf32_matmuls", lambda: allow_tf32)
    a, sa, b, sb = meta_case(m, n, k, block, dtypes)
    engine = ("device_one_pass_bf16" if block == 32 else
              "device_emulation" if allow_tf32 else "device_one_pass_f32")
    assert gemm_kernels.block_gemm_engine(a, b, block, out_dtype) == engine
    out = block_scaled_gemm_nt(a, sa, b, sb, block, out_dtype, torch.empty(n, device=META))
    assert gemm_kernels.last_block_gemm_engine() == engine
    assert out.shape == (m, n) and out.dtype == out_dtype and out.device == META
    assert not any(name.startswith("_scaled_mm") for name, _ in aten.calls)


def test_a_torch_without_block_scaled_mm_runs_one_pass(aten, monkeypatch):
    """torch before 2.10 has neither _scaled_mm_v2 nor F.ScalingType: even sm90's 1x128 case runs one pass."""
    capability(monkeypatch, (9, 0))
    monkeypatch.setattr(block_gemm_cuda, "_TORCH_HAS_BLOCK_SCALED_MM", False)
    a, sa, b, sb = meta_case(48, 64, 384, 128)
    assert gemm_kernels.block_gemm_engine(a, b, 128, torch.bfloat16) == "device_one_pass_f32"
    block_scaled_gemm_nt(a, sa, b, sb, 128, torch.bfloat16)
    assert not any(name.startswith("_scaled_mm") for name, _ in aten.calls)


def test_cpu_operands_report_the_c_kernel(generator):
    a = torch.randn(16, 64, generator=generator).to(E4M3)
    s = torch.ones(16, 2)
    assert gemm_kernels.block_gemm_engine(a, a, 32, torch.bfloat16) == "cpu"
    block_scaled_gemm_nt(a, s, a, s, 32, torch.float32)
    assert gemm_kernels.last_block_gemm_engine() == "cpu"


def test_e8m0_scales_convert_exactly():
    """Every code through e8m0_values (gemm_operand's float32 scales) and back; swizzled as E8M0 the bytes land
    where the bytes themselves do."""
    codes = torch.arange(256, dtype=torch.uint8)
    converted = block_gemm_cuda._as_e8m0(e8m0_values(codes)[None])
    assert torch.equal(converted.view(torch.uint8)[0], codes)
    matrix = codes.repeat(3)[:130 * 5].reshape(130, 5)
    swizzled = block_gemm_cuda.swizzle_32_4_4(block_gemm_cuda._as_e8m0(e8m0_values(matrix)))
    assert swizzled.dtype == torch.float8_e8m0fnu
    assert torch.equal(swizzled.view(torch.uint8), block_gemm_cuda.swizzle_32_4_4(matrix))


@pytest.mark.parametrize("rows,blocks", [(1, 1), (128, 4), (130, 5), (300, 9)])
def test_swizzle_32_4_4_places_each_scale_at_cublas_offset(rows, blocks):
    """Offset of scale (r, c): the 128 x 4 tile (r // 128, c // 4), tiles row-major over roundup(blocks, 4) / 4
    tile columns, 512 bytes each; inside, (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4. Padding zero."""
    scales = torch.arange(1, rows * blocks + 1, dtype=torch.int32).reshape(rows, blocks)
    flat = block_gemm_cuda.swizzle_32_4_4(scales)
    tile_cols = -(-blocks // 4)
    assert flat.shape == (round_up(rows, 128) * tile_cols * 4,)
    expected = torch.zeros_like(flat)
    for r in range(rows):
        for c in range(blocks):
            tile = (r // 128) * tile_cols + c // 4
            expected[tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = scales[r, c]
    assert torch.equal(flat, expected)
