"""Reproductions of the seed patterns shared by the memory tests (not a test module).

Float8TensorLike stands in for a quantized tensor object (te_fuser.Float8Tensor, TE's
QuantizedTensorStorage): a Python object whose memory sits in tensor attributes.
"""

import torch

FP8_MAX = 448.0


class Float8TensorLike:
    """fp8 bytes, optionally their transpose, and the inverse scale, as plain attributes."""

    def __init__(self, data, scale_inv, transpose=None):
        self._data = data
        self._scale_inv = scale_inv
        self._transpose = transpose

    @classmethod
    def quantize(cls, x, with_transpose=True):
        scale = FP8_MAX / x.abs().amax().clamp(min=1e-12)
        data = (x * scale).to(torch.float8_e4m3fn)
        transpose = data.t().contiguous() if with_transpose else None
        return cls(data, scale.reciprocal().reshape(1), transpose)

    def dequantize(self):
        return self._data.to(torch.float32) * self._scale_inv

    def nbytes(self):
        return sum(t.untyped_storage().nbytes() for t in (self._data, self._transpose, self._scale_inv) if t is not None)

    def prepare_for_saving(self):
        """Hands the tensors over to save_for_backward and leaves an empty shell."""
        tensors = [self._data, self._transpose, self._scale_inv]
        self._data = self._transpose = self._scale_inv = None
        return tensors

    def restore_from_saved(self, tensors):
        self._data, self._transpose, self._scale_inv = tensors[:3]
        return tensors[3:]


def prepare_for_saving(*objects):
    tensors = [t for obj in objects for t in obj.prepare_for_saving()]
    return tensors, list(objects)


def restore_from_saved(objects, tensors):
    rest = list(tensors)
    for obj in objects:
        rest = obj.restore_from_saved(rest)
    return objects


class QuantizedLinearFunction(torch.autograd.Function):
    """y = x @ w through fp8 copies saved as (tensors, ctx.tensor_objects), like TE's op fuser.

    clear_tensor_objects=False is seed 000's bug: after restore_from_saved the shells on
    ctx.tensor_objects hold the fp8 tensors again, and live as long as the graph node.
    """

    @staticmethod
    def forward(ctx, x, w, clear_tensor_objects):
        qx = Float8TensorLike.quantize(x)
        qw = Float8TensorLike.quantize(w)
        out = qx.dequantize() @ qw.dequantize()
        tensors, objects = prepare_for_saving(qx, qw)
        ctx.save_for_backward(*tensors)
        ctx.tensor_objects = objects
        ctx.clear_tensor_objects = clear_tensor_objects
        return out

    @staticmethod
    def backward(ctx, grad):
        qx, qw = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
        if ctx.clear_tensor_objects:
            ctx.tensor_objects = None  # the fix
        return grad @ qw.dequantize().t(), qx.dequantize().t() @ grad, None


class StageFunction(torch.autograd.Function):
    """A pipeline stage wrapped in one Function, like Fast-LLM's wrap_forward_backward (seed 002).

    The stage's input/output pair sits on ``ctx.context`` (a plain attribute): it lives as long
    as anything references the returned loss's grad_fn.
    """

    @staticmethod
    def forward(ctx, x, w):
        hidden = torch.tanh(x @ w)
        ctx.save_for_backward(x, w)
        ctx.context = {"input": x, "hidden": hidden}
        return hidden.square().mean()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        hidden = ctx.context["hidden"]
        grad_pre = grad * 2 * hidden / hidden.numel() * (1 - hidden.square())
        return grad_pre @ w.t(), x.t() @ grad_pre


class TeFuserQuantizedLinearFunction(torch.autograd.Function):
    """The same pattern with te_fuser's own Float8Tensor and saved-tensor helpers."""

    @staticmethod
    def forward(ctx, x, w, clear_tensor_objects):
        import te_fuser

        quantizer = te_fuser.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, columnwise=True)
        qx, qw = quantizer(x), quantizer(w)
        out = qx.dequantize() @ qw.dequantize()
        tensors, objects = te_fuser.prepare_for_saving(qx, qw)
        ctx.save_for_backward(*tensors)
        ctx.tensor_objects = objects
        ctx.clear_tensor_objects = clear_tensor_objects
        return out

    @staticmethod
    def backward(ctx, grad):
        import te_fuser

        qx, qw = te_fuser.restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
        if ctx.clear_tensor_objects:
            ctx.tensor_objects = None  # the fix
        return grad @ qw.dequantize().t(), qx.dequantize().t() @ grad, None


def shell_keeps_a_link(prepare_for_saving):
    """A quantized tensor's prepare_for_saving with the bug: the shell left on ctx keeps a link to the
    bytes it handed over, under a name no list of buffer names knows."""
    def keeping(self):
        tensors, shell = prepare_for_saving(self)
        shell.__dict__["handed_over"] = [tensors]
        return tensors, shell
    return keeping
