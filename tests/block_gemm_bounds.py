"""The error bounds of docs/block_scaling.md ("GEMM engines and their distance"), in float64, for the block-scaled
GEMM's engines: u = 2^-24 (float32's unit roundoff), gamma(n) = n u / (1 - n u), and D = sum over K blocks of
|sa sb| sum_k |a_k b_k|, the magnitude every rounding error is measured against. They hold while no float32 value
overflows or underflows to a subnormal (the tests' scales keep them normal)."""

import torch

U = 2.0**-24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def blocks(k: int, block: int) -> int:
    return -(-k // block)


def _dequantized64(codes, scales, block):
    k = codes.shape[1]
    return codes.double() * scales.double().repeat_interleave(block, dim=1)[:, :k]


def exact64(a, sa, b, sb, block, bias=None):
    """a @ b.T with the block scales, in float64 (exact to float64's rounding: far below the float32 bounds)."""
    out = _dequantized64(a, sa, block) @ _dequantized64(b, sb, block).t()
    return out if bias is None else out + bias.double()


def magnitude64(a, sa, b, sb, block, bias=None):
    """D (plus |bias| when given)."""
    out = _dequantized64(a, sa, block).abs() @ _dequantized64(b, sb, block).abs().t()
    return out if bias is None else out + bias.double().abs()


def split_bound(k: int, block: int, bias: bool = False, scale_roundings: int = 0) -> float:
    """|split accumulation - exact| <= split_bound * D: a block's sum (block - 1 roundings), times float32(sa sb)
    (2 more), the blocks' total (nb - 1), the bias (1); scale_roundings: those inside each scale (NVFP4's decode
    factor float32(float32(s * amax) * c) has 2, so float32(fa fb) carries 4 more)."""
    return gamma(block + blocks(k, block) + (1 if bias else 0) + scale_roundings)


def one_pass_bound(k: int, scale_roundings: int = 0) -> float:
    """|one-pass accumulation - exact| <= one_pass_bound * D: each product times float32(sa sb) (2 roundings), the
    K terms summed in float32 in any order (K - 1); scale_roundings: 2 more for NVFP4's alpha (products exact,
    alpha = float32(float32(amax_a c) float32(amax_b c)) has 3 roundings and multiplies the sum: 4 in all)."""
    return gamma(k + 1 + scale_roundings)
