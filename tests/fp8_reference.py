"""Independent references for FP8 tests: torch's own float8 casts and plain float32 formulas."""

import torch

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLT_MAX = torch.finfo(torch.float32).max


def fp8_max(fp8_dtype):
    return torch.finfo(fp8_dtype).max


def reference_quantize(x, scale, fp8_dtype):
    """(x * scale) in float32 on the CPU, saturated to the largest finite value, cast by torch: te_fuser's
    kernels write the CPU's bytes on every device (Inf * 0 is x86's negative default NaN, where a GPU's
    multiply gives +NaN).

    NaN keeps the input's sign. torch's CPU multiply keeps it too, but its GPU
    multiply returns +NaN, so the sign is taken from x itself.
    """
    m = fp8_max(fp8_dtype)
    q = (x.float().cpu() * scale.float().cpu()).clamp(-m, m).to(fp8_dtype).view(torch.uint8).to(x.device)
    negative = x.view({4: torch.int32, 2: torch.int16}[x.element_size()]) < 0
    nan_code = torch.where(negative, 0xFF, 0x7F).to(torch.uint8)
    return torch.where(x.isnan(), nan_code, q).view(fp8_dtype)


def reference_amax(x):
    return x.float().abs().amax() if x.numel() else torch.zeros((), device=x.device)


def edge_values(fp8_dtype, dtype):
    """Zeros, fp8 subnormals and their midpoints, the largest finite value and just past it, Inf, NaN."""
    m = fp8_max(fp8_dtype)
    tiny = torch.finfo(fp8_dtype).smallest_normal
    mbits = 3 if fp8_dtype == torch.float8_e4m3fn else 2
    step = tiny / 2**mbits
    vals = [0.0, -0.0, step, step / 2, step * 1.5, step * 2.5, tiny, tiny - step / 2, m, m * 1.01, m * 1.5, 1e30,
            float("inf"), float("nan"), 1.0, 1.0 + 2**-(mbits + 1), 1.0 + 3 * 2**-(mbits + 1)]
    v = torch.tensor(vals + [-x for x in vals], dtype=torch.float64)
    v = v.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).where(v.abs() != float("inf"), v)
    return v.to(dtype)


def random_decades(n, dtype, generator, low=-40, high=20):
    """Values spread over many decades, both signs."""
    mag = torch.pow(10.0, torch.empty(n, dtype=torch.float64).uniform_(low, high, generator=generator))
    sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0).double()
    x = (mag * sign).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return x.to(dtype)


def all_16bit_patterns(dtype):
    """Every bfloat16 or float16 value, NaNs and Infs included."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def reference_delayed_update(history, scale, fp8_max_value, margin, algo):
    """TransformerEngine's delayed-scaling update on float32 tensors, in its history layout (row 0 the
    amaxes recorded since the last update, rows 1.. the completed ones, oldest first): a column that
    recorded nothing (0) stays as it is; otherwise its window is reduced, rolled up one row (the recorded
    amax last) and row 0 reset. Returns (history, scale, scale_inv), new tensors."""
    recorded = history[0]
    reduced = history.amax(dim=0) if algo == "max" else recorded  # amax propagates NaN
    new = torch.tensor(fp8_max_value, dtype=torch.float32) / reduced
    new = torch.where(torch.isinf(new), torch.tensor(FLT_MAX), new)
    new = new / torch.tensor(2.0**margin, dtype=torch.float32)
    keep = (reduced <= 0) | ~torch.isfinite(reduced) | (recorded == 0)
    new_scale = torch.where(keep, scale, new)
    rolled = torch.roll(history, -1, dims=0)
    rolled[0] = 0.0
    new_history = torch.where(recorded == 0, history, rolled)
    return new_history, new_scale, 1.0 / new_scale


def reference_current_scale(amax, fp8_max_value, epsilon, pow2):
    a = float(amax)
    if not (a > 0) or a == float("inf"):
        return torch.tensor([1.0])
    floored = torch.tensor([max(a, epsilon)], dtype=torch.float32)
    s = torch.tensor([fp8_max_value], dtype=torch.float32) / floored
    s = torch.where(torch.isinf(s), torch.tensor(FLT_MAX), s)
    if pow2:
        s = torch.pow(2.0, torch.floor(torch.log2(s.double()))).float()
    return s
