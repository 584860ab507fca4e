"""An independent float64 reference of TransformerEngine's NVFP4 (docs/block_scaling.md, "NVFP4").

Computed from the format's definition: the E2M1 grid as a list of values, round to nearest by distance
(ties to the even code), the scales' float32 operations as one cast of an exactly computed float64 value
(a product of float32 values, or a correctly rounded quotient), E4M3 codes by
block_scaling_reference.fp8_encode, the Hadamard matrix by Sylvester's construction, the stochastic
rounding stream by SplitMix64 in numpy's wrapping uint64 arithmetic. No te_fuser code is used. Inputs
are 2-D (rows, cols) tensors of any sizes: sizes that are not multiples of 16 quantize x zero-padded to
multiples of 16, of which the data keeps x's rows (the last block partial, its padding stored).
"""

import numpy as np
import torch

import block_scaling_reference as ref

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
BLOCK = 16
FLT_MAX = float(torch.finfo(torch.float32).max)
WGRAD_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # TE's get_wgrad_sign_vector
round_f32 = ref.round_f32


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))


def e2m1_decode(codes):
    """float64 values of 4-bit codes (bit 3 the sign)."""
    c = codes.to(torch.int64)
    magnitude = E2M1_GRID[c & 7]
    return torch.where((c & 8) != 0, -magnitude, magnitude)


def _sign(v):
    return torch.signbit(v).to(torch.int64) << 3


def e2m1_encode_rn(v):
    """Codes of float64 values: the nearest grid magnitude (beyond 6: 6), a tie to the even code."""
    a = v.abs().clamp(max=7.0).reshape(-1, 1)  # at and beyond 6 (Inf too), 6 is nearest
    distance = (a - E2M1_GRID).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values
    preference = nearest.to(torch.int64) * (2 - torch.arange(8) % 2)  # an even code wins a tie
    return (preference.argmax(dim=1).reshape(v.shape) | _sign(v)).to(torch.uint8)


def e2m1_neighbours(v):
    """(lower, upper) grid indices around |v|: lower the largest grid value <= |v| (7 at and beyond 6)."""
    a = v.abs().reshape(-1, 1)
    lower = (E2M1_GRID[1:] <= a).sum(dim=1).reshape(v.shape)
    return lower, torch.clamp(lower + 1, max=7)


def e2m1_encode_sr(v, u24):
    """Stochastic rounding with 24 random bits per value: up when u24 < (|v| - lower) / step * 2^24."""
    lower, upper = e2m1_neighbours(v)
    step = E2M1_GRID[upper] - E2M1_GRID[lower]
    fraction = torch.where(step > 0, (v.abs() - E2M1_GRID[lower]) / torch.where(step > 0, step, 1.0), 0.0)
    up = u24.to(torch.float64) < fraction * 2.0**24
    return (torch.where(up & (lower < 7), upper, lower) | _sign(v)).to(torch.uint8)


def random24(seed: int, counters):
    """The top 24 bits of SplitMix64 of seed + (counter + 1) * 0x9E3779B97F4A7C15, mod 2^64."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + (np.asarray(counters, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return torch.from_numpy((z >> np.uint64(40)).astype(np.int64))


def hadamard_matrix():
    """M = diag(TE's signs) H / 4, H the 16x16 Sylvester Hadamard matrix built by doubling."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.tensor(WGRAD_SIGNS, dtype=torch.float64)[:, None] * h / 4


def hadamard_rows(x64):
    """Each 16 consecutive values of each row times M, summed in float32 from +0 in the order of M's rows
    (each product and each addition rounded to float32)."""
    rows, cols = x64.shape
    groups = x64.reshape(rows, cols // BLOCK, BLOCK)
    m = hadamard_matrix()
    out = torch.zeros(rows, cols // BLOCK, BLOCK, dtype=torch.float64)
    for j in range(BLOCK):
        out = round_f32(out + round_f32(groups[:, :, j:j + 1] * m[j]))
    return out.reshape(rows, cols)


def global_scale(amax: float) -> float:
    """S_enc = float32(2688 / amax), FLT_MAX where infinite, 1 for amax 0."""
    if amax == 0.0:
        return 1.0
    s = _f32(2688.0 / amax)
    s = FLT_MAX if s == float("inf") else s
    return 1.0 if s == 0.0 else s


def block_scale_codes(block_amax, s_enc: float):
    """E4M3 codes of float32(block_amax * float32(S_enc * float32(1/6))), saturated at 448."""
    multiplier = _f32(s_enc * _f32(1.0 / 6.0))
    s = round_f32(block_amax * multiplier)
    return ref.fp8_encode(torch.clamp(s, max=FLT_MAX), torch.float8_e4m3fn)


def encode_multipliers(codes, s_enc: float):
    """float32(1 / float32(scale * float32(1 / S_enc))), FLT_MAX where infinite."""
    s_dec = _f32(1.0 / s_enc)
    product = round_f32(ref.fp8_decode(codes, torch.float8_e4m3fn) * s_dec)
    with torch.no_grad():
        r = round_f32(1.0 / product)
    return torch.clamp(r, max=FLT_MAX)


def _block_amax(v, block_2d):
    rows, cols = v.shape
    if block_2d:
        per_block = v.abs().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).amax(dim=(1, 3))
        return per_block.repeat_interleave(BLOCK, 0)
    return v.abs().reshape(rows, cols // BLOCK, BLOCK).amax(dim=2)


def _up16(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def quantize(x, columnwise=False, block_2d=False, rht=False, seed=None, amax=None):
    """(codes (n, m) unpacked, scale codes (n, m / 16), amax) of x's rowwise data (n, m = rows, cols) or of
    its columnwise data (the transposed matrix, Hadamard-transformed when rht); stochastic rounding with
    the stream `seed` when it is given (rowwise counters r * cols + c, columnwise rows * cols + c * rows + r).
    Sizes not multiples of 16: those of x zero-padded to (rows_p, cols_p), multiples of 16, n then x's rows
    or columns and m rounded up to 16 (counters r * cols_p + c and rows_p * cols_p + c * rows_p + r).
    amax: the tensor amax to take the global scale from (a group's), instead of the data's own."""
    rows, cols = x.shape
    x64 = torch.zeros(_up16(rows), _up16(cols), dtype=torch.float64)
    x64[:rows, :cols] = x.to(torch.float64)
    kept = cols if columnwise else rows
    rows, cols = x64.shape
    v = x64.t() if columnwise else x64
    if rht:
        v = hadamard_rows(v)
    if amax is None:
        amax = float(v.abs().max()) if v.numel() else 0.0
    s_enc = global_scale(amax)
    codes_s = block_scale_codes(_block_amax(v, block_2d), s_enc)
    scaled = round_f32(v * encode_multipliers(codes_s, s_enc).repeat_interleave(BLOCK, 1))
    if seed is None:
        codes = e2m1_encode_rn(scaled)
    else:
        n, m = v.shape
        counters = torch.arange(n * m, dtype=torch.int64).reshape(n, m) + (rows * cols if columnwise else 0)
        codes = e2m1_encode_sr(scaled, random24(seed, counters.numpy()).reshape(n, m))
    return codes[:kept], codes_s[:kept], amax


def pack(codes):
    """Two codes a byte, the even-indexed one in the low nibble."""
    c = codes.to(torch.int64)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8)


def unpack(data):
    d = data.to(torch.int64)
    return torch.stack((d & 15, d >> 4), dim=-1).reshape(d.shape[0], -1).to(torch.uint8)


def decode_factors(scale_codes, amax: float):
    """float32(float32(scale * amax) * float32(1/2688)) per block."""
    return round_f32(round_f32(ref.fp8_decode(scale_codes, torch.float8_e4m3fn) * _f32(amax)) * _f32(1.0 / 2688.0))


def dequantize(codes, scale_codes, amax: float, dtype):
    """dtype(float32(e2m1 * factor)) of unpacked codes (n, m)."""
    factors = decode_factors(scale_codes, amax).repeat_interleave(BLOCK, 1)
    return round_f32(e2m1_decode(codes) * factors).to(dtype)


def values(x, columnwise=False, block_2d=False, rht=False, seed=None):
    """float64 values a usage's data stands for in the data's own layout (transposed for columnwise, each
    row with its padding to a multiple of 16): each code times its block's decode factor, exactly."""
    codes, scale_codes, amax = quantize(x, columnwise, block_2d, rht, seed)
    return e2m1_decode(codes) * decode_factors(scale_codes, amax).repeat_interleave(BLOCK, 1)
