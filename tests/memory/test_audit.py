"""audit_autograd: tensors on custom Function ctxs, found through objects, before and after backward."""

import pytest
import torch
from memory_patterns import Float8TensorLike, QuantizedLinearFunction

from te_fuser.memory import audit_autograd
from te_fuser.tensor import Float8Quantizer


def _inputs():
    return torch.randn(64, 128, requires_grad=True), torch.randn(128, 96, requires_grad=True)


def test_buggy_tensor_objects_found_after_backward_fixed_one_clean():
    for clear, expect_findings in ((False, True), (True, False)):
        x, w = _inputs()
        out = QuantizedLinearFunction.apply(x, w, clear)
        # before backward the shells are empty: the fp8 tensors sit in save_for_backward
        assert audit_autograd(out).clean
        out.sum().backward()
        report = audit_autograd(out)
        assert report.clean is not expect_findings
    # the last graph is the fixed one; rebuild the buggy one to inspect its report
    x, w = _inputs()
    out = QuantizedLinearFunction.apply(x, w, False)
    out.sum().backward()
    report = audit_autograd(out)
    (finding,) = report.findings
    assert (finding.node, finding.attribute) == ("QuantizedLinearFunctionBackward", "tensor_objects")
    paths = {held.path: held for held in finding.tensors}
    assert set(paths) == {
        "tensor_objects[0]._data",
        "tensor_objects[0]._scale_inv",
        "tensor_objects[0]._transpose",
        "tensor_objects[1]._data",
        "tensor_objects[1]._scale_inv",
        "tensor_objects[1]._transpose",
    }
    assert paths["tensor_objects[1]._transpose"].shape == (96, 128)
    assert paths["tensor_objects[1]._transpose"].dtype == torch.float8_e4m3fn
    expected = 2 * (64 * 128) + 2 * (128 * 96) + 2 * 4  # data + transpose in fp8, two float32 scales
    assert finding.nbytes == report.total_bytes == expected
    text = str(report)
    assert "QuantizedLinearFunctionBackward.tensor_objects" in text and "tensor_objects[1]._transpose  [96x128]" in text


class _KeepsObjects(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, extra):
        ctx.quantized = Float8TensorLike.quantize(x, with_transpose=False)
        ctx.nested = {"a": [x.exp(), (extra,)], "b": extra[2:]}  # extra and its view share a storage
        ctx.number = 3
        ctx.weight = torch.nn.Parameter(torch.ones(3))
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def test_nested_containers_storage_dedup_and_parameters_skipped():
    x = torch.randn(32, 16, requires_grad=True)
    extra = torch.randn(1000)
    out = _KeepsObjects.apply(x, extra).exp()  # a built-in node in front of the custom one
    report = audit_autograd(out)
    assert report.nodes_visited == 3 and report.custom_nodes == 1
    assert report.node_counts == {"ExpBackward0": 1, "_KeepsObjectsBackward": 1, "AccumulateGrad": 1}
    by_attribute = {f.attribute: f for f in report.findings}
    assert set(by_attribute) == {"quantized", "nested"}  # number: no tensor; weight: a Parameter
    nested_paths = [held.path for held in by_attribute["nested"].tensors]
    assert nested_paths == ["nested['a'][0]", "nested['a'][1][0]", "nested['b']"]
    assert by_attribute["nested"].nbytes == 32 * 16 * 4 + 1000 * 4  # the view of extra counted once
    assert report.total_bytes == by_attribute["nested"].nbytes + 32 * 16 + 4
    # after backward the plain attributes are all still there
    out.sum().backward()
    assert audit_autograd(out).total_bytes == report.total_bytes


class _Slotted:
    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner


class _Deep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.deep = _Slotted([[{"t": x.exp()}]])
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_depth_is_bounded_and_slots_are_searched():
    x = torch.randn(8, requires_grad=True)
    out = _Deep.apply(x)
    # deep -> .inner -> [0] -> [0] -> ['t']: four levels below the attribute
    assert [h.path for f in audit_autograd(out).findings for h in f.tensors] == ["deep.inner[0][0]['t']"]
    assert audit_autograd(out, max_depth=3).clean


def test_identical_findings_printed_once_with_a_count_and_several_roots():
    outs = []
    for _ in range(3):
        x, w = _inputs()
        out = QuantizedLinearFunction.apply(x, w, False)
        out.sum().backward()
        outs.append(out)
    report = audit_autograd(outs)
    assert len(report.findings) == 3
    lines = str(report).splitlines()
    assert lines[1] == "  3 x QuantizedLinearFunctionBackward.tensor_objects: 40.0 KiB in 6 tensor(s)"
    assert len(lines) == 2 + 6  # header, the grouped finding, its six tensors


class _KeepsEmptiedFloat8Tensors(torch.autograd.Function):
    """Keeps on ctx two emptied Float8Tensors that still reach bytes: a part (a view of its whole), and
    one with a tensor under an attribute no list of buffer names knows."""

    @staticmethod
    def forward(ctx, x, whole):
        part = whole[2:6]
        part.clear()
        other = whole.clone()
        other.clear()
        other.cached = torch.ones(100)
        ctx.shells = [part, other]
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def test_every_attribute_of_an_emptied_float8_tensor_is_searched():
    quantizer = Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e4m3fn, columnwise=True)
    whole = quantizer(torch.randn(16, 32))
    out = _KeepsEmptiedFloat8Tensors.apply(torch.randn(4, requires_grad=True), whole)
    (finding,) = audit_autograd(out).findings
    assert {held.path for held in finding.tensors} == {
        "shells[0]._base._data", "shells[0]._base._transpose", "shells[0]._base._scale_inv", "shells[1].cached"}
    assert finding.nbytes == 2 * 16 * 32 + 4 + 100 * 4


def test_leaf_and_bad_arguments():
    assert audit_autograd(torch.randn(3, requires_grad=True)).nodes_visited == 0
    with pytest.raises(TypeError, match="expects a tensor"):
        audit_autograd("loss")


class _StashesActivationAndState(torch.autograd.Function):
    """Keeps a persistent state tensor and an activation on its ctx (the second is the bug)."""

    @staticmethod
    def forward(ctx, x, state):
        ctx.state, ctx.activation = state, x * 2
        return x * state

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.state, None


def test_persistent_storages_are_not_reported_and_everything_else_still_is():
    state = torch.ones(1024, 1)
    x = torch.randn(1024, 1, requires_grad=True)
    out = _StashesActivationAndState.apply(x, state)
    out.sum().backward()
    every = audit_autograd(out)
    assert {h.path for f in every.findings for h in f.tensors} == {"state", "activation"}
    with_state = audit_autograd(out, persistent=[state])
    assert [h.path for f in with_state.findings for h in f.tensors] == ["activation"]
    assert with_state.total_bytes == every.total_bytes - state.untyped_storage().nbytes()


def test_a_compiled_fp8_step_holds_only_recipe_state_after_backward():
    """torch.compile's autograd node keeps the FP8 scaling state it read on its ctx after backward: persistent
    tensors (te_fuser.quantization.recipe_state_tensors), so nothing else may be there."""
    import te_fuser
    from te_fuser.quantization import recipe_state_tensors
    from te_fuser.recipe import DelayedScaling

    torch.manual_seed(0)
    layer = te_fuser.LayerNormMLP(32, 64)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(16, 32, requires_grad=True)
    recipe = DelayedScaling()
    for _ in range(2):
        with te_fuser.fp8_autocast(fp8_recipe=recipe):
            out = compiled(x)
        out.sum().backward()
    assert audit_autograd(out).total_bytes > 0  # the control: the node does keep the state it read
    assert audit_autograd(out, persistent=recipe_state_tensors()).total_bytes == 0
