"""Independent float64 references of TE's block-scaled FP8 formats (docs/block_scaling.md).

Everything is computed in float64 from the formats' definitions: the FP8 grid by its exponent and
quantum, the E8M0 code by frexp, float32 rounding by one cast of an exactly computed float64 value
(a product of two float32 values, or a correctly rounded quotient, which rounds once more as a
float32 operation would). No te_fuser code is used. Inputs are 2-D (rows, cols) tensors.
"""

import torch

FP8_GRID = {  # mantissa bits, exponent bias, largest finite value, its code
    torch.float8_e4m3fn: (3, 7, 448.0, 0x7E),
    torch.float8_e5m2: (2, 15, 57344.0, 0x7B),
}
INPUT_MAX = {  # TE's TypeExtrema<IType>::max, the scale that replaces an infinite one
    torch.float32: torch.finfo(torch.float32).max,
    torch.bfloat16: torch.finfo(torch.bfloat16).max,
    torch.float16: torch.finfo(torch.float16).max,
}
MX_BLOCK = 32
BLOCK_LEN = 128


def round_f32(t):
    """float64 -> the nearest float32 (ties to even, subnormals, overflow to Inf), as float64."""
    return t.to(torch.float32).to(torch.float64)


def fp8_encode(v, fp8_dtype):
    """uint8 codes of float64 values: round to nearest even on the FP8 grid, saturate beyond the
    largest finite value (Inf too), NaN -> 0x7F with the sign of v."""
    mbits, bias, fmax, max_code = FP8_GRID[fp8_dtype]
    sign = torch.signbit(v).to(torch.int64) << 7
    a = v.abs()
    _, e = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    exponent = torch.clamp(e.to(torch.int64) - 1, min=1 - bias)  # the binade's exponent, or the subnormals'
    quantum = torch.ldexp(torch.ones_like(a), exponent - mbits)
    steps = torch.round(torch.where(torch.isfinite(a), a, torch.zeros_like(a)) / quantum)  # exact, ties to even
    value = steps * quantum
    # Subnormal (and zero) codes count quanta; a normal value's code is its biased exponent, then
    # the mantissa bits below the leading one.
    _, e2 = torch.frexp(torch.where(value > 0, value, torch.ones_like(value)))
    biased = torch.where(value > 0, torch.clamp(e2.to(torch.int64) - 1 + bias, min=0), 0)
    normal_mantissa = torch.ldexp(value, mbits - (biased - bias)).to(torch.int64) - (1 << mbits)
    code = torch.where(biased > 0, (biased << mbits) | normal_mantissa, steps.to(torch.int64))
    code = torch.where((value > fmax) | torch.isinf(a), torch.full_like(code, max_code), code)
    code = torch.where(torch.isnan(a), torch.full_like(code, 0x7F), code)
    return (code | sign).to(torch.uint8)


def fp8_decode(codes, fp8_dtype):
    """float64 values of uint8 codes (NaN for NaN codes, +-Inf for E5M2's)."""
    mbits, bias, _, _ = FP8_GRID[fp8_dtype]
    c = codes.to(torch.int64)
    magnitude = c & 0x7F
    e = magnitude >> mbits
    m = magnitude & ((1 << mbits) - 1)
    value = torch.where(e == 0, torch.ldexp(m.double(), torch.full_like(m, 1 - bias - mbits)),
                        torch.ldexp((m + (1 << mbits)).double(), e - bias - mbits))
    if fp8_dtype == torch.float8_e4m3fn:
        value = torch.where(magnitude == 0x7F, torch.full_like(value, float("nan")), value)
    else:
        special = e == 31
        value = torch.where(special, torch.where(m == 0, torch.full_like(value, float("inf")),
                                                 torch.full_like(value, float("nan"))), value)
    return torch.where((c & 0x80) != 0, -value, value)


def _blocks(x, block_rows, block_cols):
    """(rows, cols) -> (row blocks, col blocks, block_rows * block_cols), zero-padded: a zero never
    raises a NaN-free amax."""
    rows, cols = x.shape
    nr, nc = -(-rows // block_rows), -(-cols // block_cols)
    padded = torch.zeros(nr * block_rows, nc * block_cols, dtype=torch.float64)
    padded[:rows, :cols] = x
    return padded.reshape(nr, block_rows, nc, block_cols).permute(0, 2, 1, 3).reshape(nr, nc, -1)


def block_amax(x64, block_rows, block_cols):
    """max |x| per block, NaN elements ignored (TE's fmaxf)."""
    a = x64.abs()
    return _blocks(torch.where(torch.isnan(a), torch.zeros_like(a), a), block_rows, block_cols).amax(dim=-1)


def _expand(per_block, block_rows, block_cols, rows, cols):
    return per_block.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]


# -- MXFP8 ------------------------------------------------------------------------------------------
def mxfp8_scale_code(amax, fp8_dtype):
    """TE's E8M0 code: v = float32(amax * float32(1 / fp8_max)), rounded up to a power of two."""
    fmax = FP8_GRID[fp8_dtype][2]
    rcp = round_f32(torch.tensor(1.0 / fmax, dtype=torch.float64))
    v = round_f32(amax * rcp)
    m, e = torch.frexp(torch.where(v > 0, v, torch.ones_like(v)))
    ceil_log2 = torch.where(m == 0.5, e.to(torch.int64) - 1, e.to(torch.int64))
    code = torch.clamp(ceil_log2 + 127, 0, 254)
    code = torch.where(v == 0, torch.zeros_like(code), code)
    return torch.where(torch.isinf(v), torch.full_like(code, 254), code).to(torch.uint8)


def e8m0_value(codes):
    """2^(code - 127); NaN for 255."""
    c = codes.to(torch.int64)
    value = torch.ldexp(torch.ones_like(c, dtype=torch.float64), c - 127)
    return torch.where(c == 255, torch.full_like(value, float("nan")), value)


def mxfp8_quantize(x, fp8_dtype, columnwise=False):
    """(codes, scale codes) of x (rows, cols): rowwise 1x32 blocks, scales (rows, ceil(cols / 32));
    columnwise 32x1 blocks, same data layout, scales (ceil(rows / 32), cols)."""
    x64 = x.to(torch.float64)
    rows, cols = x64.shape
    br, bc = (MX_BLOCK, 1) if columnwise else (1, MX_BLOCK)
    codes = mxfp8_scale_code(block_amax(x64, br, bc), fp8_dtype)
    multiplier = 1.0 / e8m0_value(_expand(codes, br, bc, rows, cols))  # exact: a power of two
    return fp8_encode(round_f32(x64 * multiplier), fp8_dtype), codes


def mxfp8_dequantize(data_codes, scale_codes, fp8_dtype, dtype, columnwise=False):
    rows, cols = data_codes.shape
    br, bc = (MX_BLOCK, 1) if columnwise else (1, MX_BLOCK)
    scale = _expand(e8m0_value(scale_codes), br, bc, rows, cols)
    return round_f32(fp8_decode(data_codes, fp8_dtype) * scale).to(dtype)


# -- Float8 block scaling --------------------------------------------------------------------------
def float8_block_scale(amax, fp8_dtype, x_dtype, epsilon=0.0, pow2=False):
    """TE's compute_scale_from_amax; returns (scale, scale_inv) as float64 tensors of float32 values."""
    fmax = FP8_GRID[fp8_dtype][2]
    eps = float(round_f32(torch.tensor(epsilon, dtype=torch.float64)))
    amax = torch.where(amax < eps, torch.full_like(amax, eps), amax)
    scale = round_f32(fmax / torch.where(amax > 0, amax, torch.ones_like(amax)))
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, INPUT_MAX[x_dtype]), scale)
    if pow2:
        _, e = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), e - 1)
    scale = torch.where((amax == 0) | torch.isinf(amax), torch.ones_like(scale), scale)
    return scale, round_f32(1.0 / scale)


def float8_block_quantize(x, fp8_dtype, block_dim, epsilon=0.0, pow2=False, columnwise=False):
    """(codes, scale_inv per block) of x (rows, cols), TE's blocks without its scale layouts.

    Rowwise: codes (rows, cols); scale_inv (rows, ceil(cols / 128)) for 1D, (ceil(rows / 128),
    ceil(cols / 128)) for 2D. Columnwise: the transposed data (cols, rows) with the scales of its
    own rows: 1D (cols, ceil(rows / 128)) from 128x1 tiles of x; 2D (ceil(cols / 128),
    ceil(rows / 128)), the same blocks transposed."""
    if columnwise:
        return float8_block_quantize(x.t(), fp8_dtype, block_dim, epsilon, pow2)
    x64 = x.to(torch.float64)
    rows, cols = x64.shape
    br = 1 if block_dim == 1 else BLOCK_LEN
    scale, scale_inv = float8_block_scale(block_amax(x64, br, BLOCK_LEN), fp8_dtype, x.dtype, epsilon, pow2)
    per_element = _expand(scale, br, BLOCK_LEN, rows, cols)
    return fp8_encode(round_f32(x64 * per_element), fp8_dtype), scale_inv


def float8_block_dequantize(data_codes, scale_inv, fp8_dtype, dtype, block_dim):
    """Inverse of float8_block_quantize's rowwise result (or of its columnwise one, which has the
    same form for the transposed data)."""
    rows, cols = data_codes.shape
    br = 1 if block_dim == 1 else BLOCK_LEN
    scale = _expand(scale_inv, br, BLOCK_LEN, rows, cols)
    return round_f32(fp8_decode(data_codes, fp8_dtype) * scale).to(dtype)


# -- exact values ------------------------------------------------------------------------------------
def mxfp8_values(x, fp8_dtype, columnwise=False):
    """float64 values of x's MXFP8 quantization in x's layout: each code times its power-of-two scale."""
    codes, scales = mxfp8_quantize(x, fp8_dtype, columnwise)
    br, bc = (MX_BLOCK, 1) if columnwise else (1, MX_BLOCK)
    return fp8_decode(codes, fp8_dtype) * _expand(e8m0_value(scales), br, bc, *x.shape)


def float8_block_values(x, fp8_dtype, block_dim, epsilon=0.0, pow2=False, columnwise=False):
    """float64 values of x's Float8 block quantization in x's layout: each code times its block's
    scale_inv (exact in float64: 4 bits times 24)."""
    codes, s_inv = float8_block_quantize(x, fp8_dtype, block_dim, epsilon, pow2, columnwise)
    values = fp8_decode(codes, fp8_dtype) * _expand(s_inv, 1 if block_dim == 1 else BLOCK_LEN, BLOCK_LEN, *codes.shape)
    return values.t() if columnwise else values
