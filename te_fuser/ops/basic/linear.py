"""BasicLinear: y = x @ W.T, high precision or FP8, optionally tensor-parallel."""

import math
from typing import Optional

import torch

from ... import amp
from ...tensor.float8_tensor import Float8Quantizer, Float8Tensor, fp8_data, fp8_data_transpose, fp8_transpose
from ...tensor._block_scaled_tensor import traced_quantizer
from ...tensor.quantized_tensor import QuantizedTensor
from ...quantization import FP8GlobalState, current_init, make_recipe_state, runs_while_tracing
from ...tensor.utils import initialize_weight, quantize_weights, rowwise_copy
from .. import _tensor_parallel as tp
from .._delayed_wgrad import finish_wgrad, refuse_delayed_wgrad_while_tracing
from .._block_gather import all_gather_rows, gathers_low_precision, quantize_rows
from .._fp8_gather import all_gather_fp8_dim0, quantize_shard, shard_for_saving
from .._fp8_io import high_precision, with_transpose
from .._gemm_kind import PER_TENSOR, gemm_block, quantizer_block
from .._onnx_forward import float32, quantize_dequantize
from ..block_gemm import block_gemm
from ..gemm import check_fp8_gemm_dims, fp8_gemm_nt, gemm_nt, mm
from ..op import BasicOperation, OperationContext

TP_MODES = (None, "column", "row")

# Switched off only by the tests, to show that their byte count catches a 16-bit all-gather under
# FP8 or a block-scaled recipe (the gathers this module did before it gathered quantized bytes).
_GATHER_IN_FP8 = True


def _saved_transpose(t: Float8Tensor) -> Float8Tensor:
    """What a gradient GEMM keeps of an FP8 operand: the transposed matrix, as its own Float8Tensor.

    Its data is t's transposed bytes (t viewed as (rows, last dim), transposed), with t's
    scale_inv. A new object, so prepare_for_saving() cannot empty a tensor that lives on (the
    cached FP8 weight), and the row-major data is not kept alive.
    """
    return Float8Tensor(fp8_data_transpose(t), t._scale_inv, t.fp8_dtype, t.dtype)


def saved_weight(w: Float8Tensor, fp8_weight: bool) -> Float8Tensor:
    """What dgrad keeps of the FP8 weight. A cast weight: its transposed data (_saved_transpose). An FP8
    parameter: a new object over the parameter's own bytes (no copy; autograd's version check catches
    an update before backward) and a copy of its scale, transposed in backward when needed."""
    if not fp8_weight:
        return _saved_transpose(with_transpose(w))
    return Float8Tensor(w._data, w._scale_inv.clone(), w.fp8_dtype, w.dtype)


def transposed_data(saved: Float8Tensor, row_major: bool) -> torch.Tensor:
    """The transposed FP8 data a gradient GEMM reads: saved as such (_saved_transpose), or made now from
    saved row-major bytes (an FP8 parameter's, saved_weight; the caller's FP8 input, _saved_input)."""
    return fp8_transpose(fp8_data(saved)) if row_major else fp8_data(saved)


def sync_weight_quantizer(weight: Float8Tensor, quantizer) -> None:
    """Point an FP8 weight at the running recipe's quantizer for its slot (the recipe state may have
    been made anew since the weight was built), when it casts to the weight's format."""
    if quantizer.fp8_dtype != weight.fp8_dtype:
        return
    # Written only when it changes: under torch.compile a write is a side effect of the traced forward.
    if not _same_scaling(weight._quantizer, quantizer):
        weight._quantizer = rowwise_copy(quantizer)


def _same_scaling(a, b) -> bool:
    """Whether quantizers a and b cast with the same scaling tensors (a rowwise copy shares them; a state's
    slot is compared by its buffers, which the graph reads instead of the slot's views)."""
    if type(a) is not type(b):
        return False
    slot_a, slot_b = getattr(a, "_slot", None), getattr(b, "_slot", None)
    if slot_a is not None and slot_b is not None:
        return slot_a[0] is slot_b[0] and slot_a[1] is slot_b[1] and slot_a[2] == slot_b[2]
    return slot_a is None and slot_b is None and a.scale is b.scale and a.amax is b.amax


def _usage_only(t, usage: str):
    """A new block-scaled tensor over t's buffers of one usage ("rowwise" / "columnwise"): what a GEMM of the
    backward keeps of an operand (prepare_for_saving() then empties this object, not t, which may live on as
    the cached weight or be the weight parameter itself)."""
    buffers = {name[1:]: getattr(t, name) for name in t._BUFFERS if name.startswith(f"_{usage}")
               or name == f"_amax_{usage}"}
    # (_meta through the class: dynamo puts a method called on a traced tensor subclass into the graph as an op)
    return type(t)(t.shape, t.dtype, fp8_dtype=t._fp8_dtype, quantizer=traced_quantizer(t._quantizer), **buffers,
                   **type(t)._meta(t))


def _columnwise_only(t):
    return _usage_only(t, "columnwise")


def saved_block_weight(w):
    """What the dgrad keeps of a block-scaled weight parameter: a new object over its own columnwise buffers,
    or, for a weight in 2-D blocks holding its rowwise usage only, over those (the backward transposes them:
    columnwise_from_rowwise). No copy; autograd's version check catches an update before backward."""
    return _columnwise_only(w) if w._columnwise_data is not None else _usage_only(w, "rowwise")


def _same_quantization(weight, quantizer) -> bool:
    """Whether a quantized weight was quantized as `quantizer` quantizes (its format and options, whatever the
    usages): the GEMMs then read its bytes as they are."""
    own = getattr(weight, "_quantizer", None)
    if type(own) is not type(quantizer):
        return False
    usages = ("rowwise_usage", "columnwise_usage")
    return {k: v for k, v in vars(own).items() if k not in usages} == \
        {k: v for k, v in vars(quantizer).items() if k not in usages}


def fp8_wgrad(dy_t, dy_scale_inv, x_t, x_scale_inv) -> torch.Tensor:
    """dW = dy.T @ x from the transposed FP8 bytes of dy and x, in float32."""
    return fp8_gemm_nt(dy_t, dy_scale_inv, x_t, x_scale_inv, torch.float32)


def _block_scaled_wgrad(dyq, xq) -> torch.Tensor:
    """dW = dy.T @ x over token blocks, from the columnwise usage of the block-scaled dy and x."""
    return block_gemm(dyq, True, xq, True, torch.float32)


def high_precision_wgrad(dy, x) -> torch.Tensor:
    """dW = dy.T @ x in high precision."""
    return mm(dy.t(), x)


def _saved_input(x: Float8Tensor, caller_owned: bool) -> tuple:
    """(what the wgrad keeps of the FP8 GEMM input, whether it is row-major).

    Our own quantized input: its _saved_transpose. The caller's Float8Tensor without a transpose (an
    FP8 output of the previous module, e.g. the attention's, which keeps the same bytes for its own
    backward): a new wrapper over its row-major bytes, transposed in backward. Its bytes live as long
    as the caller keeps them anyway; a transposed copy would double them.
    """
    if caller_owned and x._transpose is None:
        return x.rewrapped(), True
    return _saved_transpose(with_transpose(x)), False


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

    Under FP8 the sequence-parallel all-gathers move FP8 bytes (see
    ops/_fp8_gather.py): each rank quantizes its shard with a scale shared by
    the group and the bytes are gathered -- the input of "column", and the
    output gradient of "row" in backward, as in TE. The weight gradient of
    "column" keeps only this rank's FP8 input shard and gathers it again in
    backward (TE does the same), so the saved input is 1/tp of the gathered
    one. The reduce-scatters stay in high precision, as in TE. Under MXFP8 and
    Float8 block scaling (1x128 tiles) the gathers move the quantized bytes and
    scales in the same way (ops/_block_gather.py; NVFP4 and shards whose rows
    split a columnwise block gather high precision).

    wgrad_queue (a WgradQueue, TE's delay_wgrad_compute): the backward computes the input's
    gradient only and queues the weight-gradient GEMM with its operands -- the transposed FP8 bytes
    of dy and x under FP8 -- for the module's backward_dw(); the weight then gets no gradient from
    autograd.
    """

    num_forward_quantizers = 2
    num_backward_quantizers = 1
    supports_block_scaling = True

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
        self.wgrad_queue = None  # a WgradQueue: weight gradients left for backward_dw()
        self._fp8_init = current_init()  # quantized_model_init at construction
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
        if self.weight is None:
            return
        initialize_weight(self.weight, lambda w: torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5)))
        if self._fp8_init.enabled:
            quantize_weights(self, [("weight", self, 1)], self._fp8_init)

    def op_params(self, weight=None, **kwargs):
        del kwargs
        return (self.weight if weight is None else weight,)

    # -- FP8 ----------------------------------------------------------------------------
    def input_quantizer(self):
        return self._forward_quantizers[0] if self._fp8_enabled else None

    def grad_output_quantizer(self):
        return self._backward_quantizers[0] if self._fp8_enabled else None

    def _gemm_block(self):
        """The K block of this op's FP8 GEMMs (PER_TENSOR: per-tensor FP8), from its quantizers' kinds."""
        return gemm_block(type(self).__name__, (("linear_input", self._forward_quantizers[0]),
                                                ("linear_weight", self._forward_quantizers[1]),
                                                ("linear_grad_output", self._backward_quantizers[0])))

    @property
    def gathers_input(self) -> bool:
        """Whether forward all-gathers its input along dim 0 (column-parallel, sequence-parallel)."""
        return self.tensor_parallel_mode == "column" and self.sequence_parallel

    @property
    def gathers_grad_output(self) -> bool:
        """Whether backward all-gathers its output gradient along dim 0 (row-parallel, sequence-parallel)."""
        return self.tensor_parallel_mode == "row" and self.sequence_parallel

    def configure_quantizers(self, input_requires_grad, params_require_grad):
        if not self._fp8_enabled:
            return
        weight_requires_grad = bool(params_require_grad[0])
        # x.T for wgrad, unless the backward quantizes the saved original input itself, or the
        # transpose is made from the gathered input (a shard's transpose is of no use)
        self._forward_quantizers[0].set_usage(columnwise=weight_requires_grad and not self.save_original_input
                                              and not self.gathers_input)
        self._forward_quantizers[1].set_usage(columnwise=input_requires_grad)   # W.T for dgrad
        self._backward_quantizers[0].set_usage(  # dy.T for wgrad, made after a gather
            columnwise=weight_requires_grad and not self.gathers_grad_output)

    def _quantized_weight(self, weight: torch.Tensor, is_first_microbatch: Optional[bool]) -> Float8Tensor:
        """is_first_microbatch: True quantizes and caches, False reuses the cache, None never caches.
        An FP8 weight (quantized_model_init) is used as it is."""
        if isinstance(weight, Float8Tensor):
            sync_weight_quantizer(weight, self._forward_quantizers[1])
            return weight
        if is_first_microbatch is False and self._fp8_weight_cache is not None:
            return self._fp8_weight_cache
        if is_first_microbatch and torch.compiler.is_compiling():
            return self._fp8_weight_cache  # quantized and cached by before_traced_forward
        # A block-scaled weight (through te_fuser.ops: the modules refuse one quantized for another recipe,
        # check_weight_recipes): from its values.
        wq = self._forward_quantizers[1](high_precision(weight.detach()))
        if is_first_microbatch is not None or self._fp8_weight_cache is not None:
            # Written only when it changes: under torch.compile a write is a side effect inside the traced
            # autograd Function, after which dynamo cannot hand the saved FP8 buffers to the backward.
            self._fp8_weight_cache = wq if is_first_microbatch is not None else None
        return wq

    def before_traced_forward(self, weight=None, is_first_microbatch=None, **kwargs) -> None:
        """is_first_microbatch=True under torch.compile: the weight is quantized and cached here, outside the
        fuser's autograd Function."""
        del kwargs
        weight = self.weight if weight is None else weight
        if is_first_microbatch and self._fp8_enabled and not isinstance(weight, Float8Tensor):
            self._fp8_weight_cache = self._forward_quantizers[1](weight.detach())

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
        if self._gemm_block() is not PER_TENSOR:
            raise NotImplementedError(f"te_fuser does not implement fp8_output / fp8_grad with block-scaled "
                                      f"quantizers ({type(self._forward_quantizers[0]).__name__}, under "
                                      f"{type(self._fp8_recipe).__name__})")
        self._ensure_fp8_io_state(kind, torch.device(device))
        quantizer = self._fp8_io_states[kind].quantizers(FP8GlobalState.get_group())[0]
        if quantizer_block(f"linear_{kind}", quantizer) is not PER_TENSOR:
            raise NotImplementedError(f"te_fuser implements fp8_output / fp8_grad in per-tensor FP8 only; "
                                      f"CustomRecipe's qfactory returned {type(quantizer).__name__} for role "
                                      f"linear_{kind}")
        return quantizer

    @runs_while_tracing
    def _ensure_fp8_io_state(self, kind: str, device: torch.device) -> None:
        states = self.__dict__.setdefault("_fp8_io_states", {})
        state = states.get(kind)
        if state is None or state.recipe != self._fp8_recipe:
            states[kind] = make_recipe_state(self._fp8_recipe, 1, kind == "output", device, [kind])
        elif hasattr(state, "amax") and state.amax.device != device:
            state.to(device)

    def load_fp8_io_state(self, kind: str, state: dict, device) -> None:
        """Restore the fp8_io_quantizer(kind) state from `_extra_state` (after load_fp8_extra_state)."""
        loaded = make_recipe_state(self._fp8_recipe, 1, kind == "output", device, [kind])
        loaded.load_state_dict(state)
        self.__dict__.setdefault("_fp8_io_states", {})[kind] = loaded

    # -- forward / backward -------------------------------------------------------------
    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer,
                   weight=None, is_first_microbatch=None, input_gathered=False):
        del next_op_input_quantizer
        ctx.grad_input_quantizer = prev_op_grad_output_quantizer
        return self.forward_gemm(ctx, input_, self.weight if weight is None else weight, None, is_first_microbatch,
                                 input_gathered)

    def onnx_forward(self, input_, weight=None, is_first_microbatch=None, input_gathered=False):
        """y = x @ W.T in float32, on the quantized-and-dequantized operands under FP8."""
        del is_first_microbatch, input_gathered
        if self.tensor_parallel_size > 1:
            raise NotImplementedError("ONNX export of a tensor-parallel linear")
        weight = self.weight if weight is None else weight
        x, w = float32(input_), float32(weight)
        if self._fp8_enabled:
            x = quantize_dequantize(x, self._forward_quantizers[0])
            w = quantize_dequantize(w, self._forward_quantizers[1])
        return torch.nn.functional.linear(x, w).to(weight.dtype), ()

    def forward_gemm(self, ctx: OperationContext, x, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     is_first_microbatch: Optional[bool], input_gathered: bool = False) -> torch.Tensor:
        """y = x @ W.T (+ bias), saving what the backward needs on ctx. Shared with the fused ops.

        Under torch.autocast (ctx.autocast_dtype) y is in the autocast dtype: x, W and the bias are
        cast to it, except that FP8 quantizes W from the parameter itself (TE's order)."""
        is_first_microbatch = FP8GlobalState.microbatch_flag(is_first_microbatch)
        if x.shape[-1] != self.local_in_features:
            raise ValueError(f"input's last dimension must be in_features = {self.local_in_features}"
                             f"{' (local to this TP rank)' if self.tensor_parallel_size > 1 else ''}, "
                             f"got input shape {tuple(x.shape)}")
        group = self.tensor_parallel_group
        if self.tensor_parallel_mode is not None and tp.world_size(group) != self.tensor_parallel_size:
            # Without its group the layer would skip its collectives and return a partial result.
            raise RuntimeError(f"tensor_parallel_size is {self.tensor_parallel_size} but the tensor-parallel group "
                               f"has {tp.world_size(group)} rank(s): pass tp_group (tensor_parallel_group) or call "
                               "set_tensor_parallel_group() before the forward")
        input_requires_grad = ctx.input_requires_grad
        weight_requires_grad = weight.requires_grad
        dtype = ctx.autocast_dtype
        out_dtype = weight.dtype if dtype is None else dtype
        bias = amp.cast(bias, dtype)
        gather = self.gathers_input and not input_gathered
        # The original (pre-gather, high-precision) input, when the wgrad is to use it.
        wgrad_needed = weight_requires_grad and bool(ctx.params_require_grad[0])  # False under no_grad
        original = x if self.save_original_input and wgrad_needed and not isinstance(x, Float8Tensor) else None
        if original is not None and self._fp8_enabled and isinstance(self._forward_quantizers[0], Float8Quantizer):
            raise ValueError("save_original_input does not work with the DelayedScaling recipe, nor any "
                             "Float8Quantizer input quantizer (as in TransformerEngine): its backward could not "
                             "reproduce the forward's scale")
        block = self._gemm_block() if self._fp8_enabled else PER_TENSOR
        block_scaled = block is not PER_TENSOR
        fp8_gather = gather and self._fp8_enabled and not block_scaled and _GATHER_IN_FP8
        # Block-scaled: the rowwise bytes gathered now, the shard's columnwise usage (for the wgrad) saved and
        # gathered in backward (ops/_block_gather.py says when, else high precision gathered and quantized).
        shard_columnwise = wgrad_needed and original is None
        block_gather = (gather and block_scaled and _GATHER_IN_FP8
                        and gathers_low_precision(self._forward_quantizers[0], x, shard_columnwise))
        # The saved input is this rank's shard, gathered again in backward.
        ctx.regather_input = gather and (original is not None or fp8_gather or (block_gather and shard_columnwise))
        ctx.block_scaled = block_scaled
        x_shard = None
        lead_shape = (x.shape[0] * tp.world_size(group), *x.shape[1:-1]) if gather else tuple(x.shape[:-1])
        if fp8_gather:
            x_shard = quantize_shard(x, self._forward_quantizers[0], group)
            x = all_gather_fp8_dim0(x_shard, group)
        elif block_gather:
            x_shard = quantize_rows(high_precision(x), self._forward_quantizers[0], rowwise=True,
                                    columnwise=shard_columnwise, group=group)
            x = all_gather_rows(_usage_only(x_shard, "rowwise"), group)
            x_shard = _columnwise_only(x_shard) if shard_columnwise else None
        elif gather:
            x = tp.all_gather_dim0(high_precision(x), group)
        k, n = self.local_in_features, self.local_out_features
        ctx.fp8 = self._fp8_enabled
        if block_scaled:
            y = self._block_scaled_forward(ctx, x if block_gather else high_precision(x), weight, bias,
                                           is_first_microbatch, original, wgrad_needed, x_shard)
        elif self._fp8_enabled:
            check_fp8_gemm_dims(**{"the number of input rows (tokens)": math.prod(lead_shape),
                                   "in_features (local)": k, "out_features (local)": n})
            input_quantizer = self._forward_quantizers[0]
            # An FP8 input in the format this GEMM reads (the previous module's fp8_output, or the
            # gathered FP8 input) is used as is.
            caller_owned = isinstance(x, Float8Tensor) and x.fp8_dtype == input_quantizer.fp8_dtype
            xq = x if caller_owned else input_quantizer(high_precision(x))
            if dtype is None and xq.dtype != weight.dtype:
                raise TypeError(f"input dtype {xq.dtype} does not match the weight dtype {weight.dtype}")
            wq = self._quantized_weight(weight, is_first_microbatch)
            y = fp8_gemm_nt(fp8_data(xq).reshape(-1, k), xq._scale_inv, fp8_data(wq), wq._scale_inv, out_dtype,
                            bias, fast_accum=True)
            ctx.grad_output_quantizer = self._backward_quantizers[0]
            ctx.input_quantizer = input_quantizer if original is not None else None
            ctx.input_rowmajor = False
            if original is not None:
                x_saved = original
            elif not wgrad_needed:
                x_saved = None
            elif x_shard is not None:
                x_saved = shard_for_saving(x_shard)
            else:
                x_saved, ctx.input_rowmajor = _saved_input(xq, caller_owned)
            ctx.fp8_weight = isinstance(weight, Float8Tensor)
            ctx.save_for_backward(x_saved, saved_weight(wq, ctx.fp8_weight) if input_requires_grad else None)
        else:
            x = amp.cast(high_precision(x), dtype)
            w = amp.cast(weight, dtype)
            if x.dtype != w.dtype:
                raise TypeError(f"input dtype {x.dtype} does not match the weight dtype {w.dtype}")
            if x.device != w.device:
                raise ValueError(f"input is on {x.device} but the weight is on {w.device}")
            # An FP8 weight outside fp8_autocast: the GEMM sees its dequantized values.
            y = gemm_nt(x.reshape(-1, k), w, bias)
            x_saved = original if original is not None else (x if wgrad_needed else None)
            if isinstance(w, Float8Tensor):  # keep its bytes (a new object: the parameter stays whole)
                w = saved_weight(w, True)
            elif isinstance(w, QuantizedTensor):  # the values the forward read: the rowwise usage's
                w = _usage_only(w, "rowwise")
            ctx.save_for_backward(x_saved, w if input_requires_grad else None)
        ctx.lead_shape = lead_shape
        ctx.dtype = out_dtype
        ctx.weight_dtype = weight.dtype
        ctx.weight_requires_grad = weight_requires_grad
        ctx.main_grad_weight = weight if self.accumulate_into_main_grad and weight_requires_grad else None
        y = y.view(*lead_shape, n)
        if self.tensor_parallel_mode == "row":
            if self.sequence_parallel:
                y = tp.reduce_scatter_dim0(y, self.tensor_parallel_group)
            else:
                y = tp.all_reduce(y, self.tensor_parallel_group)
        return y

    def op_backward(self, ctx, grad_output, grad_input_addend=None):
        """grad_input_addend (the fused linear + add backward): a tensor of the input's shape added to dx,
        by the dgrad GEMM itself (beta = 1) in high precision when no collective follows it."""
        x_saved, w_saved = ctx.saved_tensors
        dy = grad_output
        if self.gathers_grad_output:
            group = self.tensor_parallel_group
            if ctx.fp8 and not ctx.block_scaled and _GATHER_IN_FP8:
                dy = all_gather_fp8_dim0(quantize_shard(dy, ctx.grad_output_quantizer, group), group)
            elif ctx.block_scaled and _GATHER_IN_FP8 and gathers_low_precision(ctx.grad_output_quantizer, dy,
                                                                                ctx.weight_requires_grad):
                dy = all_gather_rows(quantize_rows(high_precision(dy), ctx.grad_output_quantizer,
                                                   rowwise=ctx.input_requires_grad,
                                                   columnwise=ctx.weight_requires_grad, group=group), group)
            else:
                dy = tp.all_gather_dim0(high_precision(dy), group)
        k, n = self.local_in_features, self.local_out_features
        if ctx.regather_input and ctx.weight_requires_grad:
            x_saved = self._gather_saved_input(ctx, x_saved)
        dx = dw = None
        if ctx.block_scaled:
            dx, dw = self._block_scaled_backward(ctx, dy if isinstance(dy, QuantizedTensor) else high_precision(dy),
                                                 x_saved, w_saved)
        elif ctx.fp8:
            dyq = dy if isinstance(dy, Float8Tensor) else ctx.grad_output_quantizer(dy.contiguous())
            if ctx.input_requires_grad:
                dx = fp8_gemm_nt(fp8_data(dyq).reshape(-1, n), dyq._scale_inv,
                                 transposed_data(w_saved, ctx.fp8_weight),
                                 w_saved._scale_inv, ctx.dtype)
            if ctx.weight_requires_grad:
                with_transpose(dyq)
                if ctx.input_quantizer is not None and not ctx.regather_input:  # the saved original input
                    x_saved = _saved_transpose(with_transpose(ctx.input_quantizer(x_saved)))
                dw = self._wgrad(ctx, fp8_wgrad, fp8_data_transpose(dyq), dyq._scale_inv,
                                 transposed_data(x_saved, ctx.input_rowmajor), x_saved._scale_inv)
        else:
            dy2 = high_precision(dy).reshape(-1, n)
            if ctx.input_requires_grad:
                fold = (grad_input_addend is not None and self.tensor_parallel_mode != "column"
                        and grad_input_addend.dtype == dy2.dtype)
                dx = mm(dy2, w_saved, grad_input_addend.reshape(-1, k) if fold else None)
                if fold:
                    grad_input_addend = None
            if ctx.weight_requires_grad:
                dw = self._wgrad(ctx, high_precision_wgrad, dy2, x_saved.reshape(-1, k))
        if dx is not None:
            dx = dx.view(*ctx.lead_shape, k)
            if self.tensor_parallel_mode == "column":
                if self.sequence_parallel:
                    dx = tp.reduce_scatter_dim0(dx, self.tensor_parallel_group)
                else:
                    dx = tp.all_reduce(dx, self.tensor_parallel_group)
            if grad_input_addend is not None:
                dx = dx + grad_input_addend.view_as(dx)
        return dx, (dw,)

    def _wgrad(self, ctx, gemm, *operands) -> Optional[torch.Tensor]:
        """The weight's gradient from gemm(*operands) (None once accumulated into main_grad); with a
        wgrad_queue, None now and the GEMM queued, with what finishes it, for backward_dw()."""
        if self.wgrad_queue is None:
            return _finished_wgrad(gemm, operands, ctx.weight_dtype, ctx.main_grad_weight)
        refuse_delayed_wgrad_while_tracing()
        self.wgrad_queue.put(_finished_wgrad, gemm, operands, ctx.weight_dtype, ctx.main_grad_weight)
        return None

    # -- block-scaled recipes (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling) -
    def _block_scaled_forward(self, ctx, x, weight, bias, is_first_microbatch, original, wgrad_needed,
                              x_shard=None):
        """y = x @ W.T on block-scaled operands (ops/block_gemm.py). The backward keeps each operand's
        columnwise usage only (x's for the wgrad, W's for the dgrad), as new tensors. x: high precision, or
        the gathered rowwise usage (then x_shard, when given, is this rank's columnwise usage, kept)."""
        recipe = self._fp8_recipe
        if x.dtype != weight.dtype:
            raise TypeError(f"input dtype {x.dtype} does not match the weight dtype {weight.dtype}")
        input_quantizer = self._forward_quantizers[0].with_usage(rowwise=True,
                                                                 columnwise=wgrad_needed and original is None)
        xq = x if isinstance(x, QuantizedTensor) else input_quantizer(x)
        if isinstance(weight, QuantizedTensor) and _same_quantization(weight, self._forward_quantizers[1]):
            wq = weight  # quantized_model_init: the parameter's own bytes, no requantization
            w_saved = saved_block_weight(weight) if ctx.input_requires_grad else None
        else:
            wq = self._quantized_block_weight(weight, is_first_microbatch, ctx.input_requires_grad)
            w_saved = _columnwise_only(wq) if ctx.input_requires_grad else None
        y = block_gemm(xq, False, wq, False, weight.dtype, bias)
        ctx.grad_output_quantizer = self._backward_quantizers[0]
        ctx.input_quantizer = input_quantizer if original is not None else None
        x_saved = original if original is not None else x_shard if x_shard is not None else (
            _columnwise_only(xq) if wgrad_needed else None)
        ctx.save_for_backward(x_saved, w_saved)
        return y

    def _quantized_block_weight(self, weight, is_first_microbatch, columnwise: bool):
        """The block-scaled weight (rowwise, and columnwise for the dgrad), cached like _quantized_weight."""
        if is_first_microbatch is False and self._fp8_weight_cache is not None:
            return self._fp8_weight_cache
        quantizer = self._forward_quantizers[1].with_usage(rowwise=True,
                                                           columnwise=columnwise or is_first_microbatch is not None)
        # A weight quantized with other options of the recipe (or, through te_fuser.ops, for another recipe):
        # quantized again from its values.
        wq = quantizer(high_precision(weight.detach()))
        if is_first_microbatch is not None or self._fp8_weight_cache is not None:  # (a write: a traced side effect)
            self._fp8_weight_cache = wq if is_first_microbatch is not None else None
        return wq

    def _block_scaled_backward(self, ctx, dy, x_saved, w_saved):
        """(dx, dW): dx = dy @ W over out_features blocks, dW = dy.T @ x over token blocks."""
        n = self.local_out_features
        dx, dw = None, None
        quantizer = ctx.grad_output_quantizer.with_usage(rowwise=ctx.input_requires_grad,
                                                         columnwise=ctx.weight_requires_grad)
        dyq = dy if isinstance(dy, QuantizedTensor) else quantizer(dy.reshape(-1, n))
        if ctx.input_requires_grad:
            if w_saved._columnwise_data is None:  # a weight parameter in 2-D blocks (saved_block_weight)
                w_saved = w_saved.columnwise_from_rowwise()
            dx = block_gemm(dyq, False, w_saved, True, ctx.dtype)
        if ctx.weight_requires_grad:
            if ctx.input_quantizer is not None and not isinstance(x_saved, QuantizedTensor):  # the original input
                quantizer = ctx.input_quantizer.with_usage(rowwise=False, columnwise=True)
                x_saved = quantizer(x_saved.reshape(-1, self.local_in_features))
            # Queued: only dy's columnwise buffers (a new tensor over them); the rowwise ones go now.
            dy_cols = dyq if self.wgrad_queue is None else _columnwise_only(dyq)
            dw = self._wgrad(ctx, _block_scaled_wgrad, dy_cols, x_saved)
        return dx, dw

    def _gather_saved_input(self, ctx, x_saved):
        """The whole input again from this rank's saved shard: FP8 bytes under FP8 (a saved
        original input is quantized first, with the group's common scale), the block-scaled columnwise
        usage's bytes (a saved original input quantized first where its blocks fit the shard), else high
        precision."""
        group = self.tensor_parallel_group
        if ctx.block_scaled:
            if isinstance(x_saved, QuantizedTensor):
                return all_gather_rows(x_saved, group)
            if _GATHER_IN_FP8 and gathers_low_precision(ctx.input_quantizer, x_saved, True):
                return all_gather_rows(quantize_rows(x_saved, ctx.input_quantizer, rowwise=False, columnwise=True,
                                                     group=group), group)
            return tp.all_gather_dim0(x_saved, group)
        if not ctx.fp8:
            return tp.all_gather_dim0(x_saved, group)
        if not _GATHER_IN_FP8:  # the tests' bug-on switch (save_original_input only)
            return ctx.input_quantizer(tp.all_gather_dim0(x_saved, group))
        if ctx.input_quantizer is not None:
            x_saved = quantize_shard(x_saved, ctx.input_quantizer, group)
        # Only the transposed layout the wgrad reads: the gathered row-major bytes go at once.
        return _saved_transpose(with_transpose(all_gather_fp8_dim0(x_saved, group)))


def _finished_wgrad(gemm, operands, weight_dtype, main_grad_weight) -> Optional[torch.Tensor]:
    """gemm(*operands) finished: in the weight's dtype, or accumulated into main_grad (then None)."""
    return finish_wgrad(gemm(*operands), weight_dtype, main_grad_weight)
