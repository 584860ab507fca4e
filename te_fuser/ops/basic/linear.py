"""BasicLinear: y = x @ W.T, high precision or FP8, optionally tensor-parallel."""

import math
from typing import Optional

import torch

from ...float8_tensor import Float8Tensor, fp8_transpose
from ...fp8_state import FP8GlobalState, make_recipe_state
from ...quantizer import Float8Quantizer
from .. import _tensor_parallel as tp
from .._fp8_io import high_precision, with_transpose
from ..gemm import check_fp8_gemm_dims, fp8_gemm_nt, gemm_nt
from ..op import BasicOperation, OperationContext

TP_MODES = (None, "column", "row")


def _saved_transpose(t: Float8Tensor) -> Float8Tensor:
    """What a gradient GEMM keeps of an FP8 operand: its transposed data and scale_inv only.

    A new object, so prepare_for_saving() cannot empty a tensor that lives on
    (the cached FP8 weight), and the row-major data is not kept alive.
    """
    return Float8Tensor(None, t._scale_inv, t._fp8_dtype, t.dtype, t._transpose, shape=t.shape)


def _saved_input_transpose(x: Float8Tensor, caller_owned: bool) -> Float8Tensor:
    """_saved_transpose of the FP8 GEMM input. The caller's Float8Tensor (an FP8 output of the
    previous module) is not given a transpose buffer: it would live on as long as the caller's tensor."""
    if caller_owned and x._transpose is None:
        return Float8Tensor(None, x._scale_inv, x._fp8_dtype, x.dtype, fp8_transpose(x._data), shape=x.shape)
    return _saved_transpose(with_transpose(x))


class BasicLinear(BasicOperation):
    """Linear map without bias. FP8 quantizers: input and weight (forward), grad_output (backward).

    in_features/out_features are the global sizes; with tensor_parallel_mode
    "column" the weight holds out_features / tp_size rows, with "row"
    in_features / tp_size columns. With sequence_parallel, "column" gathers the
    input along dim 0 first and "row" reduce-scatters the output along dim 0;
    without it "row" all-reduces the output.

    create_weight=False leaves the weight to the caller, passed to each
    forward as the `weight` keyword (te_fuser.Linear does this to keep
    TransformerEngine's parameter names). The `input_gathered=True` keyword
    says a "column" + sequence_parallel input was already all-gathered by the
    previous op (MakeExtraOutput); the backward still reduce-scatters.
    """

    num_forward_quantizers = 2
    num_backward_quantizers = 1

    def __init__(self, in_features: int, out_features: int, *, device=None, dtype=None,
                 tensor_parallel_mode: Optional[str] = None, tensor_parallel_group=None,
                 tensor_parallel_size: Optional[int] = None, sequence_parallel: bool = False,
                 accumulate_into_main_grad: bool = False, create_weight: bool = True):
        super().__init__()
        if tensor_parallel_mode not in TP_MODES:
            raise ValueError(f"tensor_parallel_mode must be one of {TP_MODES}, got {tensor_parallel_mode!r}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.tensor_parallel_mode = tensor_parallel_mode
        self.tensor_parallel_group = tensor_parallel_group
        size = tensor_parallel_size if tensor_parallel_size is not None else tp.world_size(tensor_parallel_group)
        self.tensor_parallel_size = int(size) if tensor_parallel_mode else 1
        self.sequence_parallel = bool(sequence_parallel) and tensor_parallel_mode is not None
        self.local_in_features, self.local_out_features = self._local_shape()
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self._fp8_weight_cache: Optional[Float8Tensor] = None
        # Keep the high-precision input for the weight gradient (quantized again in backward under
        # FP8), not an FP8 copy: saves memory when the caller keeps that input alive anyway.
        self.save_original_input = False
        if create_weight:
            self.weight = torch.nn.Parameter(torch.empty(self.local_out_features, self.local_in_features,
                                                         device=device, dtype=dtype))
            self.mark_weight(self.weight)
            if self.weight.device.type != "meta":
                self.reset_parameters()
        else:
            self.weight = None

    def _local_shape(self):
        size = self.tensor_parallel_size
        if self.tensor_parallel_mode == "column":
            if self.out_features % size:
                raise ValueError(f"out_features ({self.out_features}) must be divisible by the TP size {size}")
            return self.in_features, self.out_features // size
        if self.tensor_parallel_mode == "row":
            if self.in_features % size:
                raise ValueError(f"in_features ({self.in_features}) must be divisible by the TP size {size}")
            return self.in_features // size, self.out_features
        return self.in_features, self.out_features

    def mark_weight(self, weight: torch.Tensor) -> None:
        """Tag a weight of this op's shape with the tensor-parallel attributes of its mode."""
        weight.tensor_model_parallel = False
        if self.tensor_parallel_mode is not None:
            tp.mark_parallel_param(weight, 0 if self.tensor_parallel_mode == "column" else 1)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def op_params(self, weight=None, **kwargs):
        del kwargs
        return (self.weight if weight is None else weight,)

    # -- FP8 ----------------------------------------------------------------------------
    def input_quantizer(self):
        return self._forward_quantizers[0] if self._fp8_enabled else None

    def grad_output_quantizer(self):
        return self._backward_quantizers[0] if self._fp8_enabled else None

    def configure_quantizers(self, input_requires_grad, params_require_grad):
        if not self._fp8_enabled:
            return
        weight_requires_grad = bool(params_require_grad[0])
        # x.T for wgrad, unless the backward quantizes the saved original input itself
        self._forward_quantizers[0].set_usage(columnwise=weight_requires_grad and not self.save_original_input)
        self._forward_quantizers[1].set_usage(columnwise=input_requires_grad)   # W.T for dgrad
        self._backward_quantizers[0].set_usage(columnwise=weight_requires_grad)  # dy.T for wgrad

    def _quantized_weight(self, weight: torch.Tensor, is_first_microbatch: Optional[bool]) -> Float8Tensor:
        """is_first_microbatch: True quantizes and caches, False reuses the cache, None never caches."""
        if is_first_microbatch is False and self._fp8_weight_cache is not None:
            return self._fp8_weight_cache
        wq = self._forward_quantizers[1](weight.detach())
        self._fp8_weight_cache = wq if is_first_microbatch is not None else None
        return wq

    def fp8_io_quantizer(self, kind: str, device) -> object:
        """The quantizer of this op's FP8 output (kind "output", TE's forward GEMM1_OUTPUT slot) or of the
        FP8 gradient of the module input (kind "grad_input", TE's backward GRAD_INPUT1 slot).

        Each has its own recipe state of one slot (delayed scaling: its own amax history, updated with
        the others; current scaling: the tensor's amax), made on first use. They are kept apart from the
        input/weight/grad_output states, whose layout the `_extra_state` format relies on.
        """
        if kind not in ("output", "grad_input"):
            raise ValueError(f"kind must be 'output' or 'grad_input', got {kind!r}")
        if not self._fp8_enabled:
            raise RuntimeError("fp8_io_quantizer() needs FP8 to be set up (inside fp8_autocast)")
        states = self.__dict__.setdefault("_fp8_io_states", {})
        state = states.get(kind)
        device = torch.device(device)
        if state is None or state.recipe != self._fp8_recipe:
            state = states[kind] = make_recipe_state(self._fp8_recipe, 1, kind == "output", device)
        elif hasattr(state, "amax") and state.amax.device != device:
            state.to(device)
        return state.quantizers(FP8GlobalState.get_group())[0]

    def load_fp8_io_state(self, kind: str, state: dict, device) -> None:
        """Restore the fp8_io_quantizer(kind) state from `_extra_state` (after load_fp8_extra_state)."""
        loaded = make_recipe_state(self._fp8_recipe, 1, kind == "output", device)
        loaded.load_state_dict(state)
        self.__dict__.setdefault("_fp8_io_states", {})[kind] = loaded

    # -- forward / backward -------------------------------------------------------------
    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer,
                   weight=None, is_first_microbatch=None, input_gathered=False):
        del next_op_input_quantizer
        ctx.grad_input_quantizer = prev_op_grad_output_quantizer
        return self.forward_gemm(ctx, input_, self.weight if weight is None else weight, None, is_first_microbatch,
                                 input_gathered)

    def forward_gemm(self, ctx: OperationContext, x, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     is_first_microbatch: Optional[bool], input_gathered: bool = False) -> torch.Tensor:
        """y = x @ W.T (+ bias), saving what the backward needs on ctx. Shared with the fused ops."""
        if x.shape[-1] != self.local_in_features:
            raise ValueError(f"input's last dimension must be in_features = {self.local_in_features}"
                             f"{' (local to this TP rank)' if self.tensor_parallel_size > 1 else ''}, "
                             f"got input shape {tuple(x.shape)}")
        input_requires_grad = ctx.input_requires_grad
        weight_requires_grad = weight.requires_grad
        gather = self.tensor_parallel_mode == "column" and self.sequence_parallel
        # The original (pre-gather, high-precision) input, when the wgrad is to use it.
        wgrad_needed = weight_requires_grad and bool(ctx.params_require_grad[0])  # False under no_grad
        original = x if self.save_original_input and wgrad_needed and not isinstance(x, Float8Tensor) else None
        ctx.regather_input = gather and not input_gathered and original is not None
        if gather and not input_gathered:
            x = tp.all_gather_dim0(high_precision(x), self.tensor_parallel_group)
        lead_shape = tuple(x.shape[:-1])
        k, n = self.local_in_features, self.local_out_features
        ctx.fp8 = self._fp8_enabled
        if self._fp8_enabled:
            check_fp8_gemm_dims(**{"the number of input rows (tokens)": math.prod(lead_shape),
                                   "in_features (local)": k, "out_features (local)": n})
            input_quantizer = self._forward_quantizers[0]
            if original is not None and isinstance(input_quantizer, Float8Quantizer):
                raise ValueError("save_original_input does not work with the DelayedScaling recipe (as in "
                                 "TransformerEngine): its backward could not reproduce the forward's scale")
            # An FP8 input in the format this GEMM reads (the previous module's fp8_output) is used as is.
            caller_owned = isinstance(x, Float8Tensor) and x._fp8_dtype == input_quantizer.fp8_dtype
            xq = x if caller_owned else input_quantizer(high_precision(x))
            if xq.dtype != weight.dtype:
                raise TypeError(f"input dtype {xq.dtype} does not match the weight dtype {weight.dtype}")
            wq = self._quantized_weight(weight, is_first_microbatch)
            y = fp8_gemm_nt(xq._data.reshape(-1, k), xq._scale_inv, wq._data, wq._scale_inv, weight.dtype, bias)
            ctx.grad_output_quantizer = self._backward_quantizers[0]
            ctx.input_quantizer = input_quantizer if original is not None else None
            if original is not None:
                x_saved = original
            else:
                x_saved = _saved_input_transpose(xq, caller_owned) if weight_requires_grad else None
            ctx.save_for_backward(x_saved, _saved_transpose(with_transpose(wq)) if input_requires_grad else None)
        else:
            x = high_precision(x)
            if x.dtype != weight.dtype:
                raise TypeError(f"input dtype {x.dtype} does not match the weight dtype {weight.dtype}")
            if x.device != weight.device:
                raise ValueError(f"input is on {x.device} but the weight is on {weight.device}")
            y = gemm_nt(x.reshape(-1, k), weight, bias)
            x_saved = original if original is not None else (x if weight_requires_grad else None)
            ctx.save_for_backward(x_saved, weight if input_requires_grad else None)
        ctx.lead_shape = lead_shape
        ctx.dtype = weight.dtype
        ctx.weight_requires_grad = weight_requires_grad
        ctx.main_grad_weight = weight if self.accumulate_into_main_grad and weight_requires_grad else None
        y = y.view(*lead_shape, n)
        if self.tensor_parallel_mode == "row":
            if self.sequence_parallel:
                y = tp.reduce_scatter_dim0(y, self.tensor_parallel_group)
            else:
                y = tp.all_reduce(y, self.tensor_parallel_group)
        return y

    def op_backward(self, ctx, grad_output):
        x_saved, w_saved = ctx.saved_tensors
        dy = grad_output
        if self.tensor_parallel_mode == "row" and self.sequence_parallel:
            dy = tp.all_gather_dim0(high_precision(dy), self.tensor_parallel_group)
        k, n = self.local_in_features, self.local_out_features
        if ctx.regather_input:
            x_saved = tp.all_gather_dim0(x_saved, self.tensor_parallel_group)
        dx = dw = None
        if ctx.fp8:
            dyq = dy if isinstance(dy, Float8Tensor) else ctx.grad_output_quantizer(dy.contiguous())
            if ctx.input_requires_grad:
                dx = fp8_gemm_nt(dyq._data.reshape(-1, n), dyq._scale_inv, w_saved._transpose,
                                 w_saved._scale_inv, ctx.dtype)
            if ctx.weight_requires_grad:
                with_transpose(dyq)
                if ctx.input_quantizer is not None:  # the saved original input, quantized now
                    x_saved = with_transpose(ctx.input_quantizer(x_saved))
                dw = fp8_gemm_nt(dyq._transpose, dyq._scale_inv, x_saved._transpose, x_saved._scale_inv,
                                 torch.float32)
        else:
            dy2 = high_precision(dy).reshape(-1, n)
            if ctx.input_requires_grad:
                dx = torch.mm(dy2, w_saved)
            if ctx.weight_requires_grad:
                dw = torch.mm(dy2.t(), x_saved.reshape(-1, k))
        if dx is not None:
            dx = dx.view(*ctx.lead_shape, k)
            if self.tensor_parallel_mode == "column":
                if self.sequence_parallel:
                    dx = tp.reduce_scatter_dim0(dx, self.tensor_parallel_group)
                else:
                    dx = tp.all_reduce(dx, self.tensor_parallel_group)
        if dw is not None:
            dw = self._finish_wgrad(ctx, dw)
        return dx, (dw,)

    @staticmethod
    def _finish_wgrad(ctx, dw: torch.Tensor) -> Optional[torch.Tensor]:
        """dW in the weight's dtype, or accumulated into weight.main_grad (then no .grad, as in TE)."""
        weight = ctx.main_grad_weight
        if weight is None:
            return dw.to(ctx.dtype)
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None:
            raise RuntimeError("fuse_wgrad_accumulation is on but weight.main_grad is not set")
        if getattr(weight, "overwrite_main_grad", False):
            main_grad.copy_(dw)
        else:
            main_grad.add_(dw)
        weight.grad_added_to_main_grad = True
        return None
