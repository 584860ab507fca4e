"""The saved-tensor discipline under torch.compile(fullgraph=True).

Compiled, a te_fuser module's autograd node is AOTAutograd's compiled function: te_fuser's autograd Functions
run only while dynamo traces them, where prepare_for_saving hands the FP8 buffers to save_for_backward and keeps
a Float8Record (the metadata) in place of each emptied Float8Tensor. What the compiled node saves is what those
traced save_for_backward calls saved, as AOTAutograd partitions it. The checks:
  * the compiled node saves the FP8 operands in one layout and no 16-bit copy, the same storages as eager
    (test_fp8_saved_tensors.py's checks, and its bugs, planted before compiling, are caught there too);
  * after backward nothing but parameters and scaling state is reachable from the compiled graph and no
    activation bytes stay allocated, with the output alive. With retain_graph=True, the control, the saved FP8
    buffers stay on the compiled node and both measurements see them.
"""

import pytest
import torch

import te_fuser
from te_fuser import ops
from te_fuser.memory.saved import saved_for_backward
from te_fuser.tensor.nvfp4_tensor import _BYTE_AS_E4M3_PAIR

from _fuser_ctx_walk import allowed_storages, assert_nothing_reachable, reachable_tensors, retained_cpu_bytes
from _torch_support import compiles_fp8_modules_bitwise, compiles_te_fuser_modules
from test_fp8_saved_tensors import BUGS, FP8, RECIPES, listing, seed_from, violations

pytestmark = [compiles_te_fuser_modules, compiles_fp8_modules_bitwise]

TOKENS, HIDDEN, FFN = 64, 32, 64


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_saved(module, inputs, recipe):
    """(output, what the compiled module saved for backward) on the step after the compiling one.

    The autocast is around the compiled module: its exit updates the scales eagerly. (Inside the compiled
    function, the graph's update of the backward scaling state happens in the forward, so the backward's
    scale and amax are saved too: 4-byte values of scaling state.)"""
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")

    def step():
        with te_fuser.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            return compiled(*inputs)

    step().float().sum().backward()
    return saved_for_backward(step)


def linear_saved(recipe):
    layer = te_fuser.Linear(128, 96, bias=True, params_dtype=torch.bfloat16)
    x = (torch.randn(4, 32, 128) * 3).to(torch.bfloat16).requires_grad_()
    x.data[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-3, -448.0])
    out, saved = _compiled_saved(layer, (x,), recipe)
    return out, saved, (x.numel(), layer.weight.numel()), allowed_storages(layer)


def attention_saved(recipe):
    module = te_fuser.DotProductAttention(4, 64, qkv_format="sbhd", attn_mask_type="causal")
    q, k, v = (torch.randn(48, 2, 4, 64).to(torch.bfloat16).requires_grad_() for _ in range(3))
    out, saved = _compiled_saved(module, (q, k, v), recipe)
    return out, saved, (q.numel(), k.numel(), out.numel()), allowed_storages(module)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_compiled_linear_saves_one_fp8_layout_per_operand(recipe, generator):
    seed_from(generator)
    out, saved, operands, allowed = linear_saved(RECIPES[recipe]())
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward"
    assert violations(saved, operands) == [], listing(saved)
    # x.T and W.T in FP8 with their float32 scale_inv, as eager saves them: nothing else.
    assert sorted(e.shape for e in saved if e.dtype in FP8) == [(128, 96), (128, 128)], listing(saved)
    # Besides parameters and scaling state: x.T and W.T with their scale_inv, as eager saves them.
    activations = [e for e in saved if e.tensor.untyped_storage().data_ptr() not in allowed]
    assert sorted(e.nbytes for e in activations) == [4, 4, 128 * 96, 128 * 128], listing(saved)
    out.float().sum().backward()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_compiled_attention_saves_q_k_v_and_out_in_fp8(recipe, generator):
    seed_from(generator)
    out, saved, operands, _ = attention_saved(RECIPES[recipe]())
    assert violations(saved, operands) == [], listing(saved)
    fp8 = [e for e in saved if e.dtype in FP8]
    # (the compiled node keeps q, k, v in the kernel's [b, s, h, d] view of the same bytes)
    assert [e.nbytes for e in fp8] == [48 * 2 * 4 * 64] * 4, listing(saved)
    out.float().sum().backward()


# The bugs of test_fp8_saved_tensors.py that leave a backward to trace: planted before compiling, the traced
# forward saves what the bug saves. (Its linear bugs break the backward, which torch.compile traces with the
# forward: they fail there before anything is saved. Nor is a 16-bit tensor the backward does not read a
# control: AOTAutograd saves only what the backward reads; given save_original_input=True it even quantizes
# in the forward and saves the FP8 bytes.) For the linear, the control is the layer without FP8.
@pytest.mark.parametrize("bug", ["bf16_qkv", "bf16_out"])
def test_compiled_attention_checks_catch_the_bugs(bug, monkeypatch, generator):
    seed_from(generator)
    BUGS[bug](monkeypatch)
    _, saved, operands, _ = attention_saved(RECIPES["delayed"]())
    assert violations(saved, operands)


def test_compiled_linear_check_catches_a_16_bit_input(generator):
    seed_from(generator)
    _, saved, operands, _ = linear_saved(None)
    assert any("16-bit/fp32 tensor of an FP8 operand's size" in v for v in violations(saved, operands))


# -- nothing left after backward ------------------------------------------------------------------------------------

def _model():
    torch.manual_seed(0)
    return ops.Sequential(ops.LayerNorm(HIDDEN), ops.BasicLinear(HIDDEN, FFN), ops.Bias(FFN), ops.GELU(),
                          ops.BasicLinear(FFN, HIDDEN), ops.Bias(HIDDEN))


COMPILE_RECIPES = {"no_fp8": None, "delayed": te_fuser.recipe.DelayedScaling(amax_history_len=4),
                   "current": te_fuser.recipe.Float8CurrentScaling(),
                   "mxfp8": te_fuser.recipe.MXFP8BlockScaling(), "block": te_fuser.recipe.Float8BlockScaling(),
                   "nvfp4": te_fuser.recipe.NVFP4BlockScaling()}


def _compiled_model(recipe_name):
    model = _model()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    recipe = COMPILE_RECIPES[recipe_name]

    def forward(x):
        with te_fuser.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            return compiled(x)

    forward(torch.randn(TOKENS, HIDDEN, requires_grad=True)).sum().backward()  # compiles; makes the FP8 state
    model.zero_grad(set_to_none=True)
    return model, forward


@pytest.fixture
def keep_graph(request, monkeypatch):
    """The control: backward(retain_graph=True) (AOTAutograd then needs its donated buffers off)."""
    if request.param:
        if not hasattr(torch._functorch.config, "donated_buffer"):  # a failed setattr would break the config
            pytest.skip(f"torch {torch.__version__} has no torch._functorch.config.donated_buffer to turn off")
        monkeypatch.setattr(torch._functorch.config, "donated_buffer", False)
    return request.param


@pytest.mark.parametrize("keep_graph", [False, True], ids=["backward", "retain_graph-control"], indirect=True)
@pytest.mark.parametrize("recipe_name", list(COMPILE_RECIPES))
def test_compiled_graph_holds_nothing_after_backward(recipe_name, keep_graph):
    model, forward = _compiled_model(recipe_name)
    # and NVFP4's decoding table, a module constant the compiled backward reads (the graph holds it as an input)
    allowed = allowed_storages(model) | {_BYTE_AS_E4M3_PAIR.untyped_storage().data_ptr()}
    out = forward(torch.randn(TOKENS, HIDDEN, requires_grad=True))
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward"
    assert reachable_tensors(out, allowed)  # the walk sees what the compiled node saved
    out.backward(torch.randn_like(out), retain_graph=keep_graph)
    if keep_graph:
        with pytest.raises(AssertionError, match="still reachable"):
            assert_nothing_reachable(out, allowed)
    else:
        assert_nothing_reachable(out, allowed)  # while `out` is alive


@pytest.mark.parametrize("keep_graph", [False, True], ids=["backward", "retain_graph-control"], indirect=True)
@pytest.mark.parametrize("recipe_name", list(COMPILE_RECIPES))
def test_compiled_step_retains_only_output_and_grads(recipe_name, keep_graph):
    model, forward = _compiled_model(recipe_name)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    grad = torch.randn(TOKENS, HIDDEN)

    def step():
        out = forward(x)
        out.backward(grad, retain_graph=keep_graph)
        return out

    out, retained = retained_cpu_bytes(step)
    param_grads = sum(p.numel() * p.element_size() for p in model.parameters())
    expected = out.numel() * out.element_size() + x.numel() * x.element_size() + param_grads
    if keep_graph:  # at least the FFN activation's saved FP8 bytes (fp32 without FP8)
        assert retained >= expected + TOKENS * FFN * (1 if recipe_name != "no_fp8" else 4), (retained, expected)
    else:
        assert retained <= expected + 4096, (retained, expected)
