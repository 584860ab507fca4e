"""FP8 round trips computed with torch's own float8 casts, for references independent of te_fuser's kernels."""

import torch


def current_scaled_round_trip(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """t cast to FP8 with the per-tensor scale fp8_max / amax(t) (float32), then back, in float64."""
    t = t.detach().float()
    scale = torch.tensor(torch.finfo(fp8_dtype).max, dtype=torch.float32) / t.abs().max()
    return (t * scale).to(fp8_dtype).double() * torch.reciprocal(scale).double()
