"""Every written-argument form requantizes: whatever way an op writes into a quantized tensor (an in-place
method, an aten overload called directly, a keyword-only out=, a written list of a foreach op, index and
slice assignment, an optimizer step), the tensor then holds quantize(what the same op leaves in a plain
tensor), with its scaling state to match. For every kind in _quantized_kinds.KINDS.

Reference: the same op on a plain tensor holding the dequantized values (torch math, the nominal dtype),
then the kind's reference quantization (torch's float8 cast of value * scale, read back with the stored
1 / scale). Operands are in the nominal dtype, so that a copy needs no rounding before it is quantized.

Planted and seen failing (then reverted):
- out= skipped: the `elif argument.name in kwargs` branch of quantized_tensor._written_arguments
  removed. Every out= form fails (the tensor keeps its old bytes; torch.add returns the stand-in).
- written lists skipped (the state of the code before this test: _written_arguments yielded a list as
  one argument, which is no QuantizedTensor): every foreach form and the optimizer steps with
  foreach=True or fused=True fail, the FP8 weight unchanged.
"""

import pytest
import torch

from _quantized_kinds import KINDS, assert_holds, random_values

ROWS, COLS = 16, 24


def _operands(t, generator):
    values = lambda *shape: random_values(shape, generator, t.dtype)  # noqa: E731
    mask = torch.rand(ROWS, COLS, generator=generator) < 0.4
    return {"a": values(ROWS, COLS), "b": values(ROWS, COLS), "row": values(COLS), "mask": mask,
            "index": torch.tensor([5, 0, 11]), "left": values(ROWS, 8), "right": values(8, COLS),
            "seed": int(torch.randint(0, 2**31 - 1, (1,), generator=generator))}


def _seeded(o):
    return torch.Generator().manual_seed(o["seed"])


# name -> (write into t with operands o, whether the op returns the tensor it wrote)
FORMS = {
    # in-place methods, the tensor passed positionally as `self`
    "copy_": (lambda t, o: t.copy_(o["a"]), True),
    "copy_broadcast": (lambda t, o: t.copy_(o["row"]), True),
    "add_": (lambda t, o: t.add_(o["a"], alpha=0.5), True),
    "sub_": (lambda t, o: t.sub_(o["a"]), True),
    "mul_tensor": (lambda t, o: t.mul_(o["a"]), True),
    "mul_scalar": (lambda t, o: t.mul_(-1.5), True),
    "div_": (lambda t, o: t.div_(4.0), True),
    "zero_": (lambda t, o: t.zero_(), True),
    "fill_": (lambda t, o: t.fill_(1.5), True),
    "clamp_": (lambda t, o: t.clamp_(-1.0, 2.0), True),
    "lerp_": (lambda t, o: t.lerp_(o["a"], 0.25), True),
    "addcmul_": (lambda t, o: t.addcmul_(o["a"], o["b"], value=0.5), True),
    "masked_fill_": (lambda t, o: t.masked_fill_(o["mask"], -2.0), True),
    "index_fill_": (lambda t, o: t.index_fill_(0, o["index"], 3.0), True),
    "uniform_": (lambda t, o: t.uniform_(-2.0, 2.0, generator=_seeded(o)), True),
    "normal_": (lambda t, o: t.normal_(0.0, 2.0, generator=_seeded(o)), True),
    "aten.add_.Tensor": (lambda t, o: torch.ops.aten.add_.Tensor(t, o["a"]), True),
    # out=: keyword-only in every aten schema
    "add_out": (lambda t, o: torch.add(o["a"], o["b"], out=t), True),
    "mul_out": (lambda t, o: torch.mul(o["a"], o["b"], out=t), True),
    "clamp_out": (lambda t, o: torch.clamp(o["a"], -1.0, 1.0, out=t), True),
    "where_out": (lambda t, o: torch.where(o["mask"], o["a"], o["b"], out=t), True),
    "mm_out": (lambda t, o: torch.mm(o["left"], o["right"], out=t), True),
    "aten.add.out": (lambda t, o: torch.ops.aten.add.out(o["a"], o["b"], alpha=2, out=t), True),
    # written lists: the foreach ops (optimizers with foreach=True), positional and out=
    "_foreach_add_": (lambda t, o: torch._foreach_add_([t], [o["a"]]), False),
    "_foreach_mul_": (lambda t, o: torch._foreach_mul_([t], 0.5), False),
    "_foreach_copy_": (lambda t, o: torch._foreach_copy_([t], [o["a"]]), False),
    "_foreach_add.List_out": (lambda t, o: torch.ops.aten._foreach_add.List_out([o["a"]], [o["b"]], out=[t]), False),
    # index and slice assignment
    "setitem_rows": (lambda t, o: t.__setitem__(slice(2, 5), o["a"][2:5]), False),
    "setitem_row": (lambda t, o: t.__setitem__(3, o["row"]), False),
    "setitem_columns": (lambda t, o: t.__setitem__((slice(None), slice(1, 4)), o["a"][:, 1:4]), False),
    "setitem_index": (lambda t, o: t.__setitem__(o["index"], o["a"][o["index"]]), False),
    "setitem_mask": (lambda t, o: t.__setitem__(o["mask"], 0.5), False),
    "setitem_all": (lambda t, o: t.__setitem__(Ellipsis, o["a"]), False),
    "index_put_": (lambda t, o: t.index_put_((o["index"],), o["a"][o["index"]]), True),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_every_written_argument_form_requantizes(kind, form, generator):
    write, returns_it = FORMS[form]
    t = kind.make(random_values((ROWS, COLS), generator))
    o = _operands(t, generator)
    plain = kind.dequantized(t).clone()
    assert torch.equal(plain, t.dequantize())  # the kind's torch-math reading agrees with te_fuser's
    with torch.no_grad():
        write(plain, o)
        expected = kind.expect(t, plain)
        assert not torch.equal(expected["values"], kind.observe(t)["values"]), "the write must change the values"
        result = write(t, o)
    if returns_it:
        assert result is t
    assert_holds(kind, t, expected, form)
    assert torch.equal(t.dequantize(), kind.dequantized(t))


OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.75, momentum=0.5, foreach=False),
    "SGD_foreach": lambda params: torch.optim.SGD(params, lr=0.75, momentum=0.5, foreach=True),
    "Adam": lambda params: torch.optim.Adam(params, lr=0.5, foreach=False),
    "Adam_foreach": lambda params: torch.optim.Adam(params, lr=0.5, foreach=True),
    "Adam_fused": lambda params: torch.optim.Adam(params, lr=0.5, fused=True),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_optimizer_steps_requantize(kind, optimizer, generator):
    """An optimizer stepping quantized parameters directly: each step leaves quantize(the step a plain
    parameter of the dequantized values takes)."""
    t = kind.make(random_values((ROWS, COLS), generator)).requires_grad_()
    plain = kind.dequantized(t).clone().requires_grad_()
    step_t, step_plain = OPTIMIZERS[optimizer]([t]), OPTIMIZERS[optimizer]([plain])
    for _ in range(2):
        grad = random_values((ROWS, COLS), generator, t.dtype)
        t.grad, plain.grad = grad.clone(), grad.clone()
        plain.data.copy_(kind.dequantized(t))  # the plain parameter starts each step where t is
        step_plain.step()
        expected = kind.expect(t, plain.detach())
        assert not torch.equal(expected["values"], kind.observe(t)["values"]), "the step must change the values"
        step_t.step()
        assert_holds(kind, t, expected, optimizer)
