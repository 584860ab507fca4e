"""torch.compile(fullgraph=True) traces functions that quantize and dequantize; compiled training of
FP8 weights (quantized_model_init) matches eager. (Every module under torch.compile: test_compile_fullgraph.py.)"""

import contextlib

import pytest
import torch

import te_fuser
from te_fuser.kernels import fp8 as k

from _torch_support import compiles_fp8_modules_bitwise, compiles_te_fuser_modules


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


@compiles_te_fuser_modules
@compiles_fp8_modules_bitwise
@pytest.mark.parametrize("make_recipe", [te_fuser.recipe.DelayedScaling, te_fuser.recipe.Float8CurrentScaling],
                         ids=["delayed", "current"])
def test_compiled_steps_on_fp8_weights_match_eager(make_recipe, generator):
    """Three steps (forward, backward, an SGD update written back through the weight's quantizer) of a
    Linear with FP8 weights, eager and under torch.compile(fullgraph=True), from the same start: bitwise equal
    outputs, gradients, FP8 weight bytes and scale_inv. One graph serves every step. (The graph reads a
    delayed-scaling state's slots as views it cuts from the state's buffers: AOTAutograd refuses written
    graph inputs that alias each other next to a tensor-subclass input, the FP8 weight.)"""
    fp8_recipe = make_recipe()

    def build():
        torch.manual_seed(0)
        with te_fuser.quantized_model_init(recipe=fp8_recipe):
            return te_fuser.Linear(64, 48, params_dtype=torch.bfloat16)

    def stepper(module):
        def step(x):
            with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
                return module(x)
        return step

    torch._dynamo.reset()
    eager_module, compiled_module = build(), build()
    eager, compiled = stepper(eager_module), torch.compile(stepper(compiled_module), fullgraph=True,
                                                           backend="aot_eager")
    for step in range(3):
        x = torch.randn(32, 64, generator=generator).to(torch.bfloat16)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_a = eager(xa)
        with torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext():
            out_b = compiled(xb)
        out_a.float().square().sum().backward()
        out_b.float().square().sum().backward()
        assert torch.equal(out_a, out_b)
        assert torch.equal(xa.grad, xb.grad)
        assert torch.equal(eager_module.weight.grad, compiled_module.weight.grad)
        with torch.no_grad():
            for module in (eager_module, compiled_module):
                module.weight.copy_(module.weight.dequantize() - 0.01 * module.weight.grad)
                module.weight.grad = None
        assert torch.equal(eager_module.weight._data.view(torch.uint8), compiled_module.weight._data.view(torch.uint8))
        assert torch.equal(eager_module.weight._scale_inv, compiled_module.weight._scale_inv)
