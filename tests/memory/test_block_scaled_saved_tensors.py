"""The lifetime discipline for MXFP8Tensor, Float8BlockwiseQTensor and NVFP4Tensor, as for Float8Tensor: saved for
backward through prepare_for_saving (which empties the shell kept on ctx) and nothing left on a ctx
after backward. Each check also runs on the bug it catches and must see it:
  * a prepare_for_saving that keeps the buffers on the shell: under saved-tensor hooks that move
    what autograd saves (CPU offloading), the originals then stay alive with the graph;
  * a backward that keeps ctx.tensor_objects (TransformerEngine's fuser and FP8-attention leak):
    the quantized buffers then survive until the graph dies, one step too long.
"""

import pytest
import torch

import te_fuser
from te_fuser.memory import MemoryTracker, audit_autograd
from te_fuser.tensor import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer
from te_fuser.tensor._block_scaled_tensor import BlockScaledTensor

ROWS, IN, OUT = 256, 256, 128
QUANTIZERS = {
    "mxfp8": lambda: MXFP8Quantizer(torch.float8_e4m3fn),
    "block1d": lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1),
    "block2d": lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=2),
    "nvfp4": lambda: NVFP4Quantizer(with_rht=True),  # six buffers: each usage's data, scales and amax
}


class BlockScaledLinearFunction(torch.autograd.Function):
    """y = x wᵀ on the quantized operands, saving them the way te_fuser's layers do."""

    @staticmethod
    def forward(ctx, x, w, quantizer, clear_tensor_objects):
        qx, qw = quantizer(x), quantizer(w)
        out = qx.dequantize() @ qw.dequantize().t()
        tensors, objects = te_fuser.prepare_for_saving(qx, qw)
        ctx.save_for_backward(*tensors)
        ctx.tensor_objects = objects
        ctx.clear_tensor_objects = clear_tensor_objects
        return out

    @staticmethod
    def backward(ctx, grad):
        qx, qw = te_fuser.restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
        if ctx.clear_tensor_objects:
            ctx.tensor_objects = None  # the fix
        return grad @ qw.dequantize(), grad.t() @ qx.columnwise_dequantize(), None, None


def quantized_bytes(quantizer, *tensors):
    return sum(b.nbytes for t in tensors for b in quantizer(t)._buffers() if b is not None)


def training_loop(quantizer, clear, steps=3):
    """`loss` of step k is dropped only when step k+1 assigns it, as in a real loop."""
    torch.manual_seed(0)
    w = torch.randn(OUT, IN, requires_grad=True)
    x = torch.randn(ROWS, IN)
    loss = None
    with MemoryTracker("cpu") as tracker:
        for _ in range(steps):
            w.grad = None
            loss = BlockScaledLinearFunction.apply(x, w, quantizer, clear).square().mean()
            loss.backward()
    return tracker, loss, w, x


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_nothing_stays_on_ctx_after_backward(kind):
    quantizer = QUANTIZERS[kind]()
    fixed, fixed_loss, w, x = training_loop(quantizer, clear=True)
    buggy, buggy_loss, _, _ = training_loop(quantizer, clear=False)
    expected = quantized_bytes(quantizer, x, w.detach())
    assert audit_autograd(fixed_loss).clean
    report = audit_autograd(buggy_loss)  # bug-on control: the walk finds the buffers
    assert report.total_bytes == expected and {f.attribute for f in report.findings} == {"tensor_objects"}
    assert buggy.retained_bytes - fixed.retained_bytes == expected


def offloaded_forward(quantizer):
    """Bytes a forward retains when every saved tensor is moved into a copy (what CPU offloading does
    with the originals: drops them), keeping the graph alive."""
    torch.manual_seed(0)
    x, w = torch.randn(ROWS, IN), torch.randn(OUT, IN, requires_grad=True)
    with MemoryTracker("cpu") as tracker:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            out = BlockScaledLinearFunction.apply(x, w, quantizer, True)
    return tracker.retained_bytes, out, quantized_bytes(quantizer, x, w.detach())


def _keeping_prepare_for_saving(self):
    """The bug: the buffers are handed over but the shell keeps them too."""
    return self._buffers(), self


@pytest.mark.parametrize("kind", sorted(QUANTIZERS))
def test_prepare_for_saving_lets_offloading_free_the_originals(kind, monkeypatch):
    quantizer = QUANTIZERS[kind]()
    retained, out, expected = offloaded_forward(quantizer)
    assert retained == expected + out.nbytes  # the copies and the output: the originals are gone
    out.sum().backward()

    monkeypatch.setattr(BlockScaledTensor, "prepare_for_saving", _keeping_prepare_for_saving)
    retained_bug, out_bug, _ = offloaded_forward(quantizer)
    assert retained_bug - retained == expected  # bug-on control: the shell kept the originals
    out_bug.sum().backward()
