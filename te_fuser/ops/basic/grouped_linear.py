"""GroupedBasicLinear: y_i = x_i @ W_i.T (+ b_i) for consecutive row groups x_i of the input (MoE experts).

One basic op, so a GroupedLinear is one autograd node on the fuser, with the
fuser's saved-tensor discipline. Every GEMM has its own FP8 quantizers:
forward (input_i, weight_i) at indices 2i, 2i + 1, backward grad_output_i at i.
The weights, biases and split sizes are passed to each forward as keywords
(`weights`, `biases`, `m_splits`), so the module keeps TransformerEngine's
parameter names weight0..weight{n-1}, bias0..bias{n-1}.

Under the block-scaled recipes (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling) each group runs
BasicLinear's block-scaled GEMMs (ops/block_gemm.py), any group size (a ragged last block), and saves
only the columnwise usages the gradients read, as BasicLinear does; quantized weights (quantized_model_init)
of the recipe's format are used as they are, as BasicLinear uses them.
"""

from typing import List, Optional, Sequence

import torch

from ... import amp
from ...kernels.bias_grad import bias_grad
from ...quantization import FP8GlobalState, is_block_scaled
from ...tensor.quantized_tensor import QuantizedTensor
from ...tensor.float8_tensor import Float8Tensor, fp8_data, fp8_data_transpose
from .._fp8_io import high_precision, with_transpose
from ..gemm import check_fp8_gemm_dims, fp8_gemm_nt, gemm_nt, mm
from .._delayed_wgrad import finish_wgrad, refuse_delayed_wgrad_while_tracing
from ..op import BasicOperation
from .._gemm_kind import gemm_block
from ..block_gemm import block_gemm
from .linear import (_block_scaled_wgrad, _columnwise_only, _same_quantization, fp8_wgrad, high_precision_wgrad,
                     saved_block_weight, saved_weight, sync_weight_quantizer, transposed_data)


class GroupedBasicLinear(BasicOperation):
    """num_gemms linear maps over consecutive row groups; in/out features are local (already sharded)."""

    supports_block_scaling = True

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, use_bias: bool,
                 accumulate_into_main_grad: bool = False):
        super().__init__()
        self.num_gemms = int(num_gemms)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.use_bias = bool(use_bias)
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self.num_forward_quantizers = 2 * self.num_gemms
        self.num_backward_quantizers = self.num_gemms
        self._fp8_weight_cache: List[Optional[Float8Tensor]] = [None] * self.num_gemms
        self.wgrad_queue = None  # a WgradQueue (delay_wgrad_compute): as BasicLinear's, one entry for all GEMMs

    def op_params(self, weights=(), biases=(), **kwargs):
        del kwargs
        return tuple(weights) + (tuple(biases) if self.use_bias else ())

    def configure_quantizers(self, input_requires_grad, params_require_grad):
        if not self._fp8_enabled:
            return
        weight_requires_grad = any(params_require_grad[:self.num_gemms])
        for i in range(self.num_gemms):
            self._forward_quantizers[2 * i].set_usage(columnwise=weight_requires_grad)
            self._forward_quantizers[2 * i + 1].set_usage(columnwise=input_requires_grad)
            self._backward_quantizers[i].set_usage(columnwise=weight_requires_grad)

    def _quantized_weight(self, i: int, weight: torch.Tensor, is_first_microbatch: Optional[bool]) -> Float8Tensor:
        """As BasicLinear: True quantizes and caches, False reuses the cache, None never caches.
        An FP8 weight (quantized_model_init) is used as it is; under a block-scaled recipe, a weight quantized
        with other options of the recipe (or, through te_fuser.ops, for another recipe: GroupedLinear refuses
        that, check_weight_recipes) is quantized again from its values."""
        if isinstance(weight, QuantizedTensor) and is_block_scaled(self._fp8_recipe):
            weight = high_precision(weight.detach())
        if isinstance(weight, Float8Tensor):
            sync_weight_quantizer(weight, self._forward_quantizers[2 * i + 1])
            return weight
        cached = self._fp8_weight_cache[i]
        if is_first_microbatch is False and cached is not None:
            return cached
        if is_first_microbatch and torch.compiler.is_compiling():
            return cached  # quantized and cached by before_traced_forward
        wq = self._forward_quantizers[2 * i + 1](weight.detach())
        if is_first_microbatch is not None or cached is not None:  # (as BasicLinear: no needless write)
            self._fp8_weight_cache[i] = wq if is_first_microbatch is not None else None
        return wq

    def before_traced_forward(self, weights=(), m_splits: Sequence[int] = (), is_first_microbatch=None,
                              **kwargs) -> None:
        """As BasicLinear's: under torch.compile, is_first_microbatch=True quantizes and caches the weights here."""
        del kwargs
        if not (is_first_microbatch and self._fp8_enabled):
            return
        for i, (m, w) in enumerate(zip(m_splits, weights)):
            if m and not isinstance(w, Float8Tensor):
                self._fp8_weight_cache[i] = self._forward_quantizers[2 * i + 1](w.detach())

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer, next_op_input_quantizer,
                   weights=(), biases=(), m_splits: Sequence[int] = (), is_first_microbatch=None):
        del prev_op_grad_output_quantizer, next_op_input_quantizer
        is_first_microbatch = FP8GlobalState.microbatch_flag(is_first_microbatch)
        k, n = self.in_features, self.out_features
        x = input_.reshape(-1, k)
        xs = x.split(list(m_splits))
        weight_requires_grad = weights[0].requires_grad
        fp8 = self._fp8_enabled
        block = gemm_block(type(self).__name__, [("input", self._forward_quantizers[0]),
                                                 ("weight", self._forward_quantizers[1]),
                                                 ("grad_output", self._backward_quantizers[0])]) if fp8 else None
        dtype = ctx.autocast_dtype  # torch.autocast: as BasicLinear, W cast for 16 bits, quantized as it is
        out_dtype = weights[0].dtype if dtype is None else dtype
        if fp8 and block is None:
            check_fp8_gemm_dims(**{"in_features": k, "out_features": n})
            check_fp8_gemm_dims(**{f"m_splits[{i}]": m for i, m in enumerate(m_splits)})
        outs, saved = [], []
        for i, (xi, w) in enumerate(zip(xs, weights)):
            b = amp.cast(biases[i], dtype) if self.use_bias else None
            if dtype is None and xi.dtype != w.dtype:
                raise TypeError(f"input dtype {xi.dtype} does not match weight{i}'s dtype {w.dtype}")
            if xi.shape[0] == 0:  # an expert without tokens: no GEMM, nothing to save
                outs.append(x.new_empty(0, n))
                saved += [None, None]
                continue
            if block is not None:  # the columnwise usages only are saved, as new tensors (BasicLinear's)
                xq = self._forward_quantizers[2 * i](xi)
                if isinstance(w, QuantizedTensor) and _same_quantization(w, self._forward_quantizers[2 * i + 1]):
                    wq = w  # quantized_model_init: the parameter's own bytes
                    w_saved = saved_block_weight(w) if ctx.input_requires_grad else None
                else:
                    wq = self._quantized_weight(i, w, is_first_microbatch)
                    w_saved = _columnwise_only(wq) if ctx.input_requires_grad else None
                outs.append(block_gemm(xq, False, wq, False, out_dtype, b))
                saved += [_columnwise_only(xq) if weight_requires_grad else None, w_saved]
            elif fp8:
                xq = self._forward_quantizers[2 * i](xi)
                wq = self._quantized_weight(i, w, is_first_microbatch)
                outs.append(fp8_gemm_nt(fp8_data(xq), xq._scale_inv, fp8_data(wq), wq._scale_inv, out_dtype, b,
                                        fast_accum=True))
                saved += [saved_weight(xq, False) if weight_requires_grad else None,
                          saved_weight(wq, isinstance(w, Float8Tensor)) if ctx.input_requires_grad else None]
            else:
                w = amp.cast(w, dtype)
                outs.append(gemm_nt(xi, w, b))  # an FP8 weight outside fp8_autocast: dequantized values
                w_saved = saved_weight(w, True) if isinstance(w, Float8Tensor) else w
                saved += [xi if weight_requires_grad else None, w_saved if ctx.input_requires_grad else None]
        ctx.save_for_backward(*saved)
        ctx.fp8 = fp8
        ctx.block = block
        ctx.fp8_weights = [isinstance(w, Float8Tensor) for w in weights]
        ctx.m_splits = tuple(m_splits)
        ctx.lead_shape = tuple(input_.shape[:-1])
        ctx.dtype = out_dtype
        ctx.weight_dtype = weights[0].dtype
        ctx.weight_requires_grad = weight_requires_grad
        ctx.bias_requires_grad = self.use_bias and biases[0].requires_grad
        ctx.grad_output_quantizers = list(self._backward_quantizers) if fp8 else None
        ctx.main_grad_weights = list(weights) if self.accumulate_into_main_grad and weight_requires_grad else None
        return torch.cat(outs).view(*ctx.lead_shape, n)

    def op_backward(self, ctx, grad_output):
        k, n = self.in_features, self.out_features
        dys = grad_output.reshape(-1, n).split(list(ctx.m_splits))
        # wgrads: (GEMM, operands) of each weight gradient; None for an expert without tokens (zeros)
        dxs, wgrads, dbs = [], [], []
        for i, dy in enumerate(dys):
            x_saved, w_saved = ctx.saved_tensors[2 * i], ctx.saved_tensors[2 * i + 1]
            if dy.shape[0] == 0:
                dxs.append(dy.new_empty(0, k))
                wgrads.append(None)
                dbs.append(dy.new_zeros(n) if ctx.bias_requires_grad else None)
                continue
            dx = None
            if ctx.block is not None:
                quantizer = ctx.grad_output_quantizers[i].with_usage(rowwise=ctx.input_requires_grad,
                                                                     columnwise=ctx.weight_requires_grad)
                dyq = quantizer(dy.contiguous())
                if ctx.input_requires_grad:
                    if w_saved._columnwise_data is None:  # a weight parameter in 2-D blocks (saved_block_weight)
                        w_saved = w_saved.columnwise_from_rowwise()
                    dx = block_gemm(dyq, False, w_saved, True, ctx.dtype)
                if ctx.weight_requires_grad:
                    # queued (delay_wgrad_compute): only dy's columnwise buffers, the rowwise ones go now
                    wgrads.append((_block_scaled_wgrad, (dyq if self.wgrad_queue is None else _columnwise_only(dyq),
                                                         x_saved)))
            elif ctx.fp8:
                dyq = ctx.grad_output_quantizers[i](dy.contiguous())
                if ctx.input_requires_grad:
                    dx = fp8_gemm_nt(fp8_data(dyq), dyq._scale_inv, transposed_data(w_saved, ctx.fp8_weights[i]),
                                     w_saved._scale_inv, ctx.dtype)
                if ctx.weight_requires_grad:
                    with_transpose(dyq)
                    wgrads.append((fp8_wgrad, (fp8_data_transpose(dyq), dyq._scale_inv, fp8_data(x_saved),
                                                x_saved._scale_inv)))
            else:
                if ctx.input_requires_grad:
                    dx = mm(dy, w_saved)
                if ctx.weight_requires_grad:
                    wgrads.append((high_precision_wgrad, (dy, x_saved)))
            dxs.append(dx)
            dbs.append(bias_grad(dy) if ctx.bias_requires_grad else None)
        grad_input = torch.cat(dxs).view(*ctx.lead_shape, k) if ctx.input_requires_grad else None
        weight_grads = (None,) * self.num_gemms
        if ctx.weight_requires_grad:
            finish = (wgrads, (n, k), grad_output.device, ctx.weight_dtype, ctx.main_grad_weights)
            if self.wgrad_queue is None:
                weight_grads = _finished_wgrads(*finish)
            else:  # TE's delay_wgrad_compute: for the module's backward_dw()
                refuse_delayed_wgrad_while_tracing()
                self.wgrad_queue.put(_finished_wgrads, *finish)
        return grad_input, tuple(weight_grads) + (tuple(dbs) if self.use_bias else ())


def _finished_wgrads(wgrads, shape, device, weight_dtype, main_grad_weights) -> List[Optional[torch.Tensor]]:
    """Each weight's gradient (zeros for an expert without tokens), in the weights' dtype or accumulated
    into weight_i.main_grad (then None, as in TE)."""
    grads = []
    for i, job in enumerate(wgrads):
        dw = torch.zeros(shape, dtype=torch.float32, device=device) if job is None else job[0](*job[1])
        main_grad_weight = None if main_grad_weights is None else main_grad_weights[i]
        grads.append(finish_wgrad(dw, weight_dtype, main_grad_weight, f"weight{i}"))
    return grads


def validate_m_splits(m_splits, num_gemms: int, rows: int) -> List[int]:
    """m_splits (list or 1-D tensor) as a list of non-negative ints summing to the input's rows."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.dtype.is_complex:
            raise ValueError(f"m_splits must be a 1-D integer tensor or a list of ints, got {m_splits!r}")
        m_splits = m_splits.tolist()
    try:
        splits = [int(m) for m in m_splits]
    except (TypeError, ValueError):
        raise TypeError(f"m_splits must be a list of ints or a 1-D integer tensor, got {m_splits!r}") from None
    if any(s != m for s, m in zip(splits, m_splits)):
        raise TypeError(f"m_splits must hold integers, got {list(m_splits)}")
    if len(splits) != num_gemms:
        raise ValueError(f"m_splits has {len(splits)} entries, expected num_gemms = {num_gemms}")
    if any(s < 0 for s in splits):
        raise ValueError(f"m_splits must be non-negative, got {splits}")
    if sum(splits) != rows:
        raise ValueError(f"m_splits sums to {sum(splits)}, but the input has {rows} rows "
                         f"(the product of its leading dimensions)")
    return splits
