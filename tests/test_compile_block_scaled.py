"""torch.compile(fullgraph=True) of te_fuser's modules under the block-scaled recipes (MXFP8BlockScaling,
Float8BlockScaling, NVFP4BlockScaling, and a CustomRecipe of block quantizers), as test_compile_fullgraph.py checks
them under per-tensor FP8.

Each case trains a module three steps (forward, backward, an SGD update) eagerly and compiled from the same weights
and inputs and asserts the same bits after every step: output, input and parameter gradients. The steps after the
first run under set_stance("fail_on_recompile"). NVFP4's stochastic rounding of gradients draws a seed from
torch's default generator at each quantization: each compiled step starts from the generator state its eager step
started from, so a graph that drew its seed once, while tracing, would round differently from step two on.
Inductor lowers random ops to its own generator; fallback_random makes it draw from torch's, as eager does.

Then: a new, equal recipe each step does not recompile (recipes with nested QParams among them); a recipe made
inside the compiled function gets states for its own fields; quantized weights (quantized_model_init) train as
eagerly. (The lifetime discipline of the compiled graph under these recipes:
tests/memory/test_compiled_saved_tensors.py.)
"""

import contextlib
import dataclasses

import pytest
import torch

import te_fuser
from te_fuser.recipe import (CustomRecipe, Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling,
                             QParams)
from te_fuser.kernels import nvfp4 as nvfp4_kernels
from te_fuser.tensor import Float8BlockQuantizer
from te_fuser.tensor._block_scaled_tensor import BlockScaledTensor

import test_compile_fullgraph as fullgraph
from _torch_support import compiles_fp8_modules_bitwise, compiles_te_fuser_modules
from test_compile_fullgraph import _fresh_dynamo  # noqa: F401 (autouse: each case compiles from scratch)

pytestmark = [compiles_te_fuser_modules, compiles_fp8_modules_bitwise]

def _custom_quantizer(role):
    """A CustomRecipe factory: Float8 block scaling, 128x128 blocks for the weight, 1x128 tiles otherwise."""
    return Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, amax_epsilon=1e-6,
                                block_scaling_dim=2 if role.tensor_type == "weight" else 1)


RECIPES = {
    "mxfp8": MXFP8BlockScaling(fp8_format=Format.E4M3),
    "block": Float8BlockScaling(),
    # non-default QParams: fp32 scales for the input, an amax floor for the gradient
    "block-qparams": Float8BlockScaling(fp8_quant_fwd_inp=QParams(power_2_scale=False),
                                        fp8_quant_bwd_grad=QParams(amax_epsilon=1e-3)),
    "nvfp4": NVFP4BlockScaling(),  # 2-D weight blocks, the wgrad's Hadamard transform, stochastic rounding
    "nvfp4-1d-rtne": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                       disable_2d_quantization=True),
    "custom": CustomRecipe(qfactory=_custom_quantizer),  # the same object each step (its callable: no interning)
}

# (module, recipe, autocast inside the compiled function?, backend)
CASES = [(name, recipe, inside, "aot_eager")
         for name in ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "TransformerLayer")
         for recipe, inside in (("mxfp8", True), ("block", False), ("nvfp4", True))]
CASES += [
    ("Linear", "block-qparams", True, "aot_eager"),
    ("LayerNormMLP", "nvfp4-1d-rtne", False, "aot_eager"),
    ("ops.Sequential", "nvfp4", False, "aot_eager"),
    ("Linear", "custom", True, "aot_eager"),
    ("LayerNormMLP", "custom", False, "aot_eager"),
    ("LayerNormMLP", "mxfp8", True, "inductor"),
    ("Linear", "block", False, "inductor"),
    ("LayerNormLinear", "nvfp4", True, "inductor"),
]


def _check_training_steps(name, recipe, autocast_inside, backend, generator):
    modules = []
    for _ in range(2):
        torch.manual_seed(0)
        modules.append(fullgraph.MODULES[name]())
    eager_module, compiled_module = modules

    def stepper(module):
        if not autocast_inside:
            return module

        def step(*args, **kwargs):
            with te_fuser.fp8_autocast(fp8_recipe=recipe):
                return module(*args, **kwargs)
        return step

    compiled = torch.compile(stepper(compiled_module), fullgraph=True, backend=backend)
    for step in range(3):
        xs, kwargs = fullgraph._inputs(name, generator, step)
        grad_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        rng = torch.get_rng_state()
        eager = fullgraph._train_step(stepper(eager_module), eager_module, xs, kwargs, recipe, autocast_inside,
                                      grad_seed)
        torch.set_rng_state(rng)
        with torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext():
            compiled_result = fullgraph._train_step(compiled, compiled_module, xs, kwargs, recipe, autocast_inside,
                                                    grad_seed)
        fullgraph._assert_same_bits(eager, compiled_result, step)


@pytest.mark.parametrize("name, recipe_name, autocast_inside, backend", CASES,
                         ids=[f"{n}-{r}-{'inside' if i else 'outside'}-{b}" for n, r, i, b in CASES])
def test_compiled_training_steps_match_eager_bitwise(name, recipe_name, autocast_inside, backend, generator,
                                                     monkeypatch):
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    _check_training_steps(name, RECIPES[recipe_name], autocast_inside, backend, generator)


def test_stochastic_rounding_draws_a_seed_each_time_the_graph_runs(generator):
    """The control of the generator restore above: without it, the eager and compiled backwards of NVFP4 draw
    different seeds and their gradients differ; two compiled runs from the same generator state agree."""
    torch.manual_seed(0)
    module = te_fuser.Linear(fullgraph.HIDDEN, 16)
    x = torch.randn(fullgraph.SEQ, fullgraph.HIDDEN, generator=generator)
    dy = torch.randn(fullgraph.SEQ, 16, generator=generator)  # values between E2M1's: stochastic rounding shows

    def step(x):
        with te_fuser.fp8_autocast(fp8_recipe=RECIPES["nvfp4"]):
            return module(x)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")

    def weight_grad(fn):
        module.weight.grad = None
        fn(x.clone().requires_grad_()).backward(dy)
        return module.weight.grad.clone()

    rng = torch.get_rng_state()
    first = weight_grad(compiled)
    torch.set_rng_state(rng)
    assert torch.equal(weight_grad(compiled), first)
    assert not torch.equal(weight_grad(step), weight_grad(step))  # eager draws anew each call
    with torch.compiler.set_stance("fail_on_recompile"):
        assert not torch.equal(weight_grad(compiled), first)


@pytest.mark.parametrize("recipe_name", ["mxfp8", "block-qparams", "nvfp4"])
def test_a_new_equal_recipe_each_step_does_not_recompile(recipe_name):
    """test_compile_recompiles.py's check: a recipe object made anew each step (Float8BlockScaling's and
    NVFP4BlockScaling's nested QParams / MMParams included) compiles once."""
    template = RECIPES[recipe_name]
    fields = {f.name: getattr(template, f.name) for f in dataclasses.fields(template) if f.init}
    torch.manual_seed(0)
    module = te_fuser.LayerNormMLP(fullgraph.HIDDEN, fullgraph.FFN)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = torch.randn(fullgraph.SEQ, fullgraph.HIDDEN, requires_grad=True)
    for step in range(3):
        stance = "fail_on_recompile" if step else "default"
        with torch.compiler.set_stance(stance), te_fuser.fp8_autocast(fp8_recipe=type(template)(**fields)):
            out = compiled(x)
        out.sum().backward()


def test_block_recipe_made_inside_the_compiled_function(generator):
    """A Float8BlockScaling with non-default QParams constructed in the compiled function: the states are made
    for its fields (the QParams included), and train as eagerly."""
    def step(module, x):
        recipe = Float8BlockScaling(fp8_quant_fwd_inp=QParams(power_2_scale=False, amax_epsilon=0.5),
                                    x_block_scaling_dim=1, w_block_scaling_dim=1)
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            return module(x)

    modules = []
    for _ in range(2):
        torch.manual_seed(0)
        modules.append(te_fuser.Linear(fullgraph.HIDDEN, 16))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for s in range(3):
        xs, _ = fullgraph._inputs("Linear", generator, s)
        dy = torch.randn(fullgraph.SEQ, fullgraph.BATCH, 16, generator=generator)
        results = []
        for fn, module in ((step, modules[0]), (compiled, modules[1])):
            x = xs[0].clone().requires_grad_()
            out = fn(module, x)
            out.backward(dy)
            results.append((out, x.grad, module.weight.grad))
            module.weight.grad = None
        for a, b in zip(*results):
            assert torch.equal(a, b), f"step {s}"
    state_recipe = modules[1]._ops[0]._fp8_states[0].recipe
    assert state_recipe.fp8_quant_fwd_inp == QParams(power_2_scale=False, amax_epsilon=0.5)
    assert state_recipe.w_block_scaling_dim == 1


@pytest.mark.parametrize("recipe_name", ["mxfp8", "block", "nvfp4"])
def test_compiled_steps_on_block_scaled_weights_match_eager(recipe_name, generator):
    """test_compile_fp8.py's check on quantized weights (quantized_model_init): three steps of a Linear whose
    weight is an MXFP8Tensor / Float8BlockwiseQTensor / NVFP4Tensor parameter, each step's SGD update written
    back through the weight's quantizer; outputs, gradients and every byte of the weight's buffers bitwise."""
    fp8_recipe = RECIPES[recipe_name]

    def build():
        torch.manual_seed(0)
        with te_fuser.quantized_model_init(recipe=fp8_recipe):
            return te_fuser.Linear(64, 48, params_dtype=torch.bfloat16)

    def stepper(module):
        def step(x):
            with te_fuser.fp8_autocast(fp8_recipe=fp8_recipe):
                return module(x)
        return step

    eager_module, compiled_module = build(), build()
    assert isinstance(compiled_module.weight, BlockScaledTensor)
    eager = stepper(eager_module)
    compiled = torch.compile(stepper(compiled_module), fullgraph=True, backend="aot_eager")
    for step in range(3):
        x = torch.randn(32, 64, generator=generator).to(torch.bfloat16)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        rng = torch.get_rng_state()
        out_a = eager(xa)
        out_a.float().square().sum().backward()
        torch.set_rng_state(rng)
        with torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext():
            out_b = compiled(xb)
        out_b.float().square().sum().backward()
        assert torch.equal(out_a, out_b)
        assert torch.equal(xa.grad, xb.grad)
        assert torch.equal(eager_module.weight.grad, compiled_module.weight.grad)
        with torch.no_grad():
            for module in (eager_module, compiled_module):
                module.weight.copy_(module.weight.dequantize() - 0.01 * module.weight.grad)
                module.weight.grad = None
        buffers = [(a, b) for a, b in zip(eager_module.weight._buffers(), compiled_module.weight._buffers())
                   if a is not None]
        assert buffers and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in buffers)


def test_nvfp4_quantize_takes_its_seed_as_a_tensor(generator):
    """The compiled graph's seed is a tensor (te_fuser::nvfp4_quantize_seeded): the same bytes as the int seed."""
    x = torch.randn(48, 40, generator=generator)
    for seed in (0, 12345, 2**62 + 5):
        by_int = nvfp4_kernels.nvfp4_quantize(x, stochastic=True, seed=seed)
        by_tensor = nvfp4_kernels.nvfp4_quantize(x, stochastic=True, seed=torch.tensor(seed))
        assert all(torch.equal(a, b) for a, b in zip(by_int, by_tensor))
    with pytest.raises(ValueError, match="seed must be an int or an int64 tensor"):
        nvfp4_kernels.nvfp4_quantize(x, stochastic=True, seed=torch.tensor(1.0))


def test_compiled_nvfp4_quantize_refuses_inf_when_the_graph_runs():
    """The finite check of the input traces (a branch on the values would break the graph): the graph asserts it
    when it runs, and refuses Inf."""
    quantize = torch.compile(lambda x: nvfp4_kernels.nvfp4_quantize(x)[0], fullgraph=True, backend="aot_eager")
    x = torch.ones(16, 32)
    assert torch.equal(quantize(x), nvfp4_kernels.nvfp4_quantize(x)[0])
    x[3, 5] = float("inf")
    with pytest.raises(RuntimeError, match="Inf or NaN"):
        quantize(x)
