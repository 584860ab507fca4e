"""Quantize a tensor to FP8 with te_fuser and print the error and the speed.

    python -m te_fuser.examples.quantize_demo
"""

import time

import torch

import te_fuser
from te_fuser.kernels import fp8 as fp8_kernels


def main(numel: int = 8 * 2**20) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(numel, device=device, dtype=torch.bfloat16)
    print(f"te_fuser {te_fuser.__version__} on {device}: {numel} bfloat16 values")
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        quantizer = te_fuser.Float8CurrentScalingQuantizer(fp8_dtype, device=device, columnwise=False)
        q = quantizer(x)
        err = (q.dequantize(torch.float32) - x.float()).abs()
        rel = (err / x.float().abs().clamp_min(1e-3)).median().item()
        scale, amax = quantizer.scale, torch.zeros(1, device=device)
        start = time.perf_counter()
        for _ in range(10):
            fp8_kernels.quantize(x, scale, amax, fp8_dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 10
        gbs = numel * (x.element_size() + 1) / seconds / 1e9
        print(f"  {str(fp8_dtype).split('.')[-1]:>14}: amax {quantizer.amax.item():.3f}  scale {scale.item():.3f}  "
              f"max abs err {err.max().item():.4f}  median rel err {rel:.4f}  quantize+amax {gbs:.1f} GB/s")


if __name__ == "__main__":
    main()
