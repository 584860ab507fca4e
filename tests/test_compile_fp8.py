"""torch.compile(fullgraph=True) traces functions that quantize and dequantize."""

import torch

import te_fuser
from te_fuser.kernels import fp8 as k


def test_compile_quantize_dequantize(generator):
    def roundtrip(x, scale, amax):
        data = k.quantize(x, scale, amax, torch.float8_e4m3fn)
        return k.dequantize(data, torch.reciprocal(scale), torch.float32)

    x = torch.randn(64, 48, generator=generator)
    scale = torch.tensor([4.0])
    eager_amax, compiled_amax = torch.zeros(1), torch.zeros(1)
    eager = roundtrip(x, scale, eager_amax)
    compiled = torch.compile(roundtrip, fullgraph=True)(x, scale, compiled_amax)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(compiled_amax, eager_amax, rtol=0, atol=0)


def test_compile_current_scaling_quantizer_and_cast_transpose(generator):
    def fn(x):
        amax = k.compute_amax(x)
        scale, scale_inv = k.current_scale(amax, 448.0)
        t = te_fuser.Float8Tensor(*k.cast_transpose(x, scale, amax.clone(), torch.float8_e4m3fn)[:1],
                                  scale_inv, torch.float8_e4m3fn, x.dtype)
        return t.dequantize() + 1

    x = torch.randn(32, 16, generator=generator, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x), fn(x), rtol=0, atol=0)
