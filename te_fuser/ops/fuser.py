"""OperationFuser: runs a chain of basic ops as ONE autograd Function, with the fusions applied.

Fusions are found once per cache key -- FP8 on/off, the recipe type and
format, grad mode, and which of the input and parameters require grad -- and
re-found only when that key changes. Under torch.no_grad the ops run without
the autograd Function: there is no graph to build and nothing to save.

Saved-tensor discipline (the bug of TransformerEngine's fuser: quantized
tensors kept as plain ctx attributes lived until the next iteration):
  * every tensor an op saves goes through autograd's save_for_backward; a
    Float8Tensor is split by prepare_for_saving() into its buffers (saved) and
    an empty shell (kept);
  * backward restores them, then drops every reference the forward left on
    the autograd node: the shells, the per-op contexts, the plan. After
    backward, the node holds no tensor, even while the output is alive.
_CLEAR_CTX_AFTER_BACKWARD = False turns the dropping off; it exists only so the
tests can show that they catch the leak.

FP8 across the chain's boundaries (TE's fp8_output / fp8_grad): the caller may
ask for the output quantized with the last linear op's output quantizer and
for the input gradient quantized with the first linear op's grad-input
quantizer; both come back as Float8Tensors carrying autograd. The grad-input
quantizer rides on the backward state and is dropped with it.

torch.autocast (te_fuser.amp): inside it the chain's input is cast to the autocast dtype, every
op's context carries that dtype as ctx.autocast_dtype (the ops cast their parameters to it) and
the ops run with autocast off.

Extra outputs: an op with num_extra_outputs > 0 sets ctx.extra_outputs in its
forward; the fuser takes them off the ctx at once and returns (output,
*extra outputs), and sets ctx.grad_extra_outputs before that op's backward.
Extra inputs (TE's AddExtraInput): the caller passes them after the input
(fuser(x, extra_inputs=...), Sequential(x, *extra)); an op with num_extra_inputs
> 0 finds its own on ctx.extra_inputs during its forward, which the fuser takes
off the ctx right after, and sets ctx.grad_extra_inputs in its backward, which
the fuser takes off at once and returns as those inputs' gradients.
"""

from typing import List, Optional, Sequence

import torch

from .. import amp
from ..export import is_in_onnx_export_mode
from ..tensor.float8_tensor import Float8Tensor
from ..quantization import FP8GlobalState, canonical_recipe, runs_while_tracing
from ..tensor.quantized_tensor import prepare_for_saving, restore_from_saved
from ._fp8_io import high_precision
from ._onnx_forward import run_chain as run_onnx_chain
from .basic.activation import _BiasActivation
from .basic.add_extra_input import AddExtraInput
from .basic.bias import Bias
from .basic.extra_output import MakeExtraOutput
from .basic.linear import BasicLinear
from .fused.activation_bias_grad import ActivationBiasGrad
from .fused.backward_linear_add import BackwardLinearAdd
from .fused.forward_linear_bias_add import ForwardLinearBiasAdd
from .fused.linear_bias_activation import LinearBiasActivation
from .op import BasicOperation, OperationContext

_CLEAR_CTX_AFTER_BACKWARD = True

SECOND_BACKWARD_MESSAGE = (
    "te_fuser: backward through the fused graph a second time is not supported; saved tensors were freed"
)


def _linear_bias_add(basic_ops: Sequence[BasicOperation], i: int) -> int:
    """How many basic ops from i on form BasicLinear (+ Bias) + AddExtraInput, or 0."""
    n = len(basic_ops)
    if not (isinstance(basic_ops[i], BasicLinear) and ForwardLinearBiasAdd.applies_to(basic_ops[i])):
        return 0
    j = i + 2 if i + 1 < n and isinstance(basic_ops[i + 1], Bias) else i + 1
    return j - i + 1 if j < n and isinstance(basic_ops[j], AddExtraInput) else 0


def fuse_forward_ops(basic_ops: Sequence[BasicOperation]) -> List[tuple]:
    """[(op, basic op indices)]: BasicLinear (+ Bias) + AddExtraInput become ForwardLinearBiasAdd, and
    BasicLinear + Bias (+ an element-wise activation) LinearBiasActivation."""
    plan, i, n = [], 0, len(basic_ops)
    while i < n:
        op = basic_ops[i]
        width = _linear_bias_add(basic_ops, i)
        if width:
            bias = basic_ops[i + 1] if width == 3 else None
            plan.append((ForwardLinearBiasAdd(op, bias, basic_ops[i + width - 1]), tuple(range(i, i + width))))
            i += width
        elif (isinstance(op, BasicLinear) and i + 1 < n and isinstance(basic_ops[i + 1], Bias)
              and LinearBiasActivation.applies_to(op)):
            act = basic_ops[i + 2] if i + 2 < n and isinstance(basic_ops[i + 2], _BiasActivation) else None
            width = 3 if act is not None else 2
            plan.append((LinearBiasActivation(op, basic_ops[i + 1], act), tuple(range(i, i + width))))
            i += width
        else:
            plan.append((op, (i,)))
            i += 1
    return plan


def fuse_backward_ops(basic_ops: Sequence[BasicOperation]) -> List[tuple]:
    """[(op, basic op indices)] in forward order: Bias + an element-wise activation become ActivationBiasGrad,
    MakeExtraOutput + BasicLinear BackwardLinearAdd."""
    plan, i, n = [], 0, len(basic_ops)
    while i < n:
        if isinstance(basic_ops[i], Bias) and i + 1 < n and isinstance(basic_ops[i + 1], _BiasActivation):
            plan.append((ActivationBiasGrad(basic_ops[i], basic_ops[i + 1]), (i, i + 1)))
            i += 2
        elif (isinstance(basic_ops[i], MakeExtraOutput) and i + 1 < n and isinstance(basic_ops[i + 1], BasicLinear)
              and BackwardLinearAdd.applies_to(basic_ops[i], basic_ops[i + 1])):
            plan.append((BackwardLinearAdd(basic_ops[i], basic_ops[i + 1]), (i, i + 1)))
            i += 2
        else:
            plan.append((basic_ops[i], (i,)))
            i += 1
    return plan


class _Plan:
    """The fusions and per-op requires-grad pattern for one cache key, and what each forward and
    backward step needs of them, worked out once (a small layer's step is mostly this bookkeeping)."""

    __slots__ = ("forward_ops", "backward_ops", "input_requires_grad", "params_require_grad", "param_slices",
                 "num_params", "forward_steps", "backward_steps")

    def __init__(self, basic_ops, input_requires_grad, params_require_grad, param_counts, extras_require_grad=()):
        self.forward_ops = fuse_forward_ops(basic_ops)
        self.backward_ops = fuse_backward_ops(basic_ops)
        self.params_require_grad = tuple(params_require_grad)
        self.num_params = len(self.params_require_grad)
        # Op j's input requires grad when the chain input, or a parameter or extra input of an earlier op, does.
        self.input_requires_grad, self.param_slices, extra_slices = [], [], []
        needs, start, extra_start = input_requires_grad, 0, 0
        for op, count in zip(basic_ops, param_counts):
            self.input_requires_grad.append(needs)
            self.param_slices.append((start, start + count))
            extra_slices.append((extra_start, extra_start + op.num_extra_inputs))
            needs = (needs or any(params_require_grad[start:start + count])
                     or any(extras_require_grad[extra_start:extra_start + op.num_extra_inputs]))
            start += count
            extra_start += op.num_extra_inputs
        last = len(basic_ops) - 1
        # (op, basic op indices, the op before it, the op after it, those of its basic ops with extra outputs,
        # (basic op index, extra input slice) of those with extra inputs)
        self.forward_steps = tuple(
            (op, idx, basic_ops[idx[0] - 1] if idx[0] > 0 else None, basic_ops[idx[-1] + 1] if idx[-1] < last else None,
             tuple(j for j in idx if basic_ops[j].num_extra_outputs),
             tuple((j, slice(*extra_slices[j])) for j in idx if basic_ops[j].num_extra_inputs))
            for op, idx in self.forward_ops)
        # Last op first: (op, basic op indices, whether it or an op before it wants a gradient, its
        # basic ops' first parameter positions, (basic op index, extra input slice) of those with extra inputs).
        self.backward_steps = tuple(
            (op, idx, any(self.input_requires_grad[j] or any(self.params_require_grad[slice(*self.param_slices[j])])
                          or any(extras_require_grad[slice(*extra_slices[j])]) for j in idx),
             tuple(self.param_slices[j][0] for j in idx),
             tuple((j, slice(*extra_slices[j])) for j in idx if basic_ops[j].num_extra_inputs))
            for op, idx in reversed(self.backward_ops))


class _BackwardState:
    """Everything the backward needs besides the saved tensors; dropped once backward ran."""

    __slots__ = ("plan", "op_ctxs", "tensor_objects", "has_shells", "save_ranges", "num_params",
                 "num_extra_inputs", "grad_input_quantizer", "backward_update")


def _run_forward(plan: _Plan, input_, kwargs_list, output_quantizer, autocast_dtype, extra_inputs=()):
    """The chain's forward: (output, extra outputs, the basic ops' contexts)."""
    ctxs = []
    for needs, (start, end) in zip(plan.input_requires_grad, plan.param_slices):
        ctx = OperationContext()
        ctx.autocast_dtype = autocast_dtype
        ctx.input_requires_grad = needs
        ctx.params_require_grad = plan.params_require_grad[start:end]
        ctxs.append(ctx)
    # The chain's ends: an op there may hand a quantized tensor out of the chain (Quantize does, as in TE).
    ctxs[0].first_in_chain = ctxs[-1].last_in_chain = True
    x, extras = input_, []
    for op, idx, prev_op, next_op, extra_ops, extra_in in plan.forward_steps:
        for j, where in extra_in:
            ctxs[j].extra_inputs = tuple(extra_inputs[where])
        x = op.fuser_forward([ctxs[j] for j in idx], x,
                             prev_op.grad_output_quantizer() if prev_op is not None else None,
                             next_op.input_quantizer() if next_op is not None else None,
                             [kwargs_list[j] for j in idx])
        for j, _ in extra_in:
            del ctxs[j].extra_inputs
        for j in extra_ops:
            extras.extend(ctxs[j].__dict__.pop("extra_outputs"))
    if output_quantizer is not None:
        x = output_quantizer(high_precision(x).contiguous())
    elif isinstance(x, Float8Tensor) and not getattr(ctxs[-1], "quantized_output", False):
        x = x.dequantize()
    return x, extras, ctxs


def _backward(func_ctx, grad_output, *grad_extra_outputs):
    """_FuserFunction's backward."""
    # Under torch.compile this runs once, at trace time, on trace-time objects: the
    # graph's real autograd node is AOTAutograd's, so there is nothing to mark or clear.
    compiling = torch.compiler.is_compiling()
    if not compiling:
        if func_ctx.backward_done:
            raise RuntimeError(SECOND_BACKWARD_MESSAGE)
        func_ctx.backward_done = True
    state = func_ctx.state
    saved = func_ctx.saved_tensors
    if state.has_shells:
        saved = restore_from_saved(state.tensor_objects, saved)
    if compiling:
        ctxs = [_BackwardContext(ctx, tuple(saved[start:end]))
                for ctx, (start, end) in zip(state.op_ctxs, state.save_ranges)]
    else:
        ctxs = state.op_ctxs
        for ctx, (start, end) in zip(ctxs, state.save_ranges):
            ctx.saved_tensors = tuple(saved[start:end])

    if grad_extra_outputs:  # hand each op the gradients of the extra outputs it made
        pending = list(grad_extra_outputs)
        basic_ops = [op for fused, _ in state.plan.backward_ops for op in fused.basic_ops]
        for op, ctx in zip(basic_ops, ctxs):
            if op.num_extra_outputs:
                ctx.grad_extra_outputs = tuple(pending[:op.num_extra_outputs])
                del pending[:op.num_extra_outputs]

    param_grads: List[Optional[torch.Tensor]] = [None] * state.num_params
    extra_grads: List[Optional[torch.Tensor]] = [None] * state.num_extra_inputs
    dy = grad_output
    for op, idx, wants_grad, param_starts, extra_in in state.plan.backward_steps:
        if not wants_grad:
            # Neither these ops nor any before them (frozen, with an input that needs no
            # gradient) want a gradient, and they saved nothing for one.
            dy = None
            break
        dy, grads_per_op = op.fuser_backward([ctxs[j] for j in idx], dy)
        for start, grads in zip(param_starts, grads_per_op):
            param_grads[start:start + len(grads)] = grads
        for j, where in extra_in:
            extra_grads[where] = ctxs[j].__dict__.pop("grad_extra_inputs")
    if state.grad_input_quantizer is not None and dy is not None:
        dy = state.grad_input_quantizer(high_precision(dy).contiguous())
    elif isinstance(dy, Float8Tensor) and not getattr(ctxs[0], "quantized_grad_input", False):
        dy = dy.dequantize()
    if state.backward_update is not None:  # the first chain of an fp8_autocast: TE's backward scale update
        state.backward_update.run()
        state.backward_update = None

    if _CLEAR_CTX_AFTER_BACKWARD and not compiling:
        # The restored Float8Tensors (tensor_objects), the per-op contexts and the
        # plan: drop them all, so the node keeps nothing while the output lives.
        state.tensor_objects = None
        for ctx in state.op_ctxs:
            ctx.clear()
        func_ctx.state = None
    return (dy, None, None, None, None, None, *param_grads, *extra_grads)


_backward_once_differentiable = torch.autograd.function.once_differentiable(_backward)


class _FuserFunction(torch.autograd.Function):

    @staticmethod
    def forward(func_ctx, input_, plan, kwargs_list, boundary_quantizers, autocast_dtype, backward_update,
                *params_and_extra_inputs):
        output_quantizer, grad_input_quantizer = boundary_quantizers
        extra_inputs = params_and_extra_inputs[plan.num_params:]
        x, extras, ctxs = _run_forward(plan, input_, kwargs_list, output_quantizer, autocast_dtype, extra_inputs)
        to_save, ranges = [], []
        for ctx in ctxs:
            start = len(to_save)
            to_save.extend(ctx.to_save)
            ranges.append((start, len(to_save)))
            ctx.to_save = ()
        tensors, objects = prepare_for_saving(*to_save)
        func_ctx.save_for_backward(*tensors)
        state = _BackwardState()
        state.plan, state.op_ctxs = plan, ctxs
        state.tensor_objects, state.save_ranges, state.num_params = objects, ranges, plan.num_params
        state.num_extra_inputs = len(extra_inputs)
        # Tested with `is`: list.count(None) would compare each FP8 shell with None through
        # Tensor.__eq__, a torch op per shell.
        state.has_shells = any(obj is not None for obj in objects)
        state.grad_input_quantizer = grad_input_quantizer
        state.backward_update = backward_update
        func_ctx.state = state
        func_ctx.backward_done = False
        return (x, *extras) if extras else x

    @staticmethod
    def backward(func_ctx, grad_output, *grad_extra_outputs):
        # The engine runs backward with grad mode on only for backward(create_graph=True): then the
        # gradients carry once_differentiable's error node, and a second backward through them raises.
        # Otherwise that wrapper would only cost its call.
        if torch.is_grad_enabled():
            return _backward_once_differentiable(func_ctx, grad_output, *grad_extra_outputs)
        return _backward(func_ctx, grad_output, *grad_extra_outputs)


class _BackwardContext:
    """An op's context as its backward sees it under torch.compile: the forward's attributes
    plus the restored saved tensors, in a new object (dynamo refuses writes into objects
    the forward created)."""

    def __init__(self, ctx: OperationContext, saved_tensors: tuple):
        self._ctx = ctx
        self.saved_tensors = saved_tensors

    def __getattr__(self, name):
        return getattr(self._ctx, name)


_NO_BOUNDARY_QUANTIZERS = (None, None)


class OperationFuser:
    """Runs basic ops as one autograd Function; see the module docstring."""

    def __init__(self, basic_ops: Sequence[BasicOperation]):
        for op in basic_ops:
            if not isinstance(op, BasicOperation):
                raise TypeError(f"OperationFuser takes BasicOperations, got {type(op).__name__}")
        self.basic_ops = tuple(basic_ops)
        self.num_extra_inputs = sum(op.num_extra_inputs for op in self.basic_ops)
        self._no_kwargs = tuple({} for _ in self.basic_ops)
        self._plan: Optional[_Plan] = None
        self._plan_key = None
        self.plans_built = 0  # how often fusions were (re)found; tests check the cache with it

    def __call__(self, input_: torch.Tensor, basic_op_kwargs: Optional[Sequence[dict]] = None, *,
                 extra_inputs: Sequence[torch.Tensor] = (), fp8_output: bool = False,
                 fp8_grad: bool = False) -> torch.Tensor:
        """Run the chain. extra_inputs: the tensors the ops with extra inputs take, in op order.
        fp8_output / fp8_grad (TE's semantics): under fp8_autocast, the output is a
        Float8Tensor quantized with the last linear op's output quantizer, and the input's gradient
        one quantized with the first linear op's grad-input quantizer; outside it they do nothing."""
        if not isinstance(input_, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input_).__name__}")
        if input_.dim() == 0:
            raise ValueError("input must have at least one dimension (its last is the features), got a 0-d tensor")
        if len(extra_inputs) != self.num_extra_inputs:
            raise ValueError(f"extra_inputs: the ops take {self.num_extra_inputs} extra input(s), "
                             f"got {len(extra_inputs)}")
        for t in extra_inputs:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"extra_inputs must be torch.Tensors, got {type(t).__name__}")
        kwargs_list = basic_op_kwargs if basic_op_kwargs is not None else self._no_kwargs
        dtype = amp.autocast_dtype(input_.device.type)
        if dtype is not None:
            input_ = amp.cast_input(input_)
        if is_in_onnx_export_mode():
            with amp.autocast_off(input_.device.type, dtype):
                return run_onnx_chain(self.basic_ops, input_, kwargs_list, extra_inputs)
        params_per_op = [op.op_params(**kw) for op, kw in zip(self.basic_ops, kwargs_list)]
        params = [p for ps in params_per_op for p in ps]
        fp8 = FP8GlobalState.is_enabled()
        recipe = canonical_recipe(FP8GlobalState.get_recipe()) if fp8 else None
        grad = torch.is_grad_enabled()
        params_rg = tuple([grad and p.requires_grad for p in params])
        extras_rg = tuple([grad and t.requires_grad for t in extra_inputs])
        key = (fp8, type(recipe), getattr(recipe, "fp8_format", None), grad, grad and input_.requires_grad,
               params_rg, extras_rg)
        self._ensure_plan(key, tuple(len(ps) for ps in params_per_op), extras_rg)
        plan = self._plan
        if fp8 or any(op.fp8_enabled for op in self.basic_ops):
            group = FP8GlobalState.get_group()
            for j, op in enumerate(self.basic_ops):
                op.setup_fp8(fp8, recipe, group, input_.device)
                start, end = plan.param_slices[j]
                op.configure_quantizers(plan.input_requires_grad[j], params_rg[start:end])
            if torch.compiler.is_compiling():
                for op, kwargs in zip(self.basic_ops, kwargs_list):
                    op.before_traced_forward(**kwargs)
        boundary = _NO_BOUNDARY_QUANTIZERS
        if fp8 and (fp8_output or fp8_grad):
            boundary = (self._boundary_quantizer("output", fp8_output, input_.device, reverse=True),
                        self._boundary_quantizer("grad_input", fp8_grad and key[4], input_.device))
        with amp.autocast_off(input_.device.type, dtype):
            if not grad:  # no graph to build: the autograd Function would only cost its call (~13 us)
                x, extras, _ = _run_forward(plan, input_, kwargs_list, boundary[0], dtype, extra_inputs)
                return (x, *extras) if extras else x
            backward_update = None
            if fp8 and (key[4] or any(params_rg) or any(extras_rg)):  # a backward will run
                backward_update = FP8GlobalState.claim_backward_update()
            return _FuserFunction.apply(input_, plan, kwargs_list, boundary, dtype, backward_update, *params,
                                        *extra_inputs)

    # TE's names for the fusions found by the last call: forward order, and backward order (last op first).
    @property
    def _forward_ops(self) -> List[tuple]:
        return list(self._plan.forward_ops) if self._plan is not None else []

    @property
    def _backward_ops(self) -> List[tuple]:
        return list(reversed(self._plan.backward_ops)) if self._plan is not None else []

    @runs_while_tracing  # a plan made in the graph would be new at each call: one compilation per call
    def _ensure_plan(self, key: tuple, param_counts: tuple, extras_rg: tuple) -> None:
        if key != self._plan_key:
            self._plan = _Plan(self.basic_ops, key[4], key[5], list(param_counts), extras_rg)
            self._plan_key = key
            self.plans_built += 1

    def _boundary_quantizer(self, kind: str, wanted: bool, device, reverse: bool = False):
        """The last (reverse) or first linear op's fp8_io_quantizer(kind), when wanted."""
        if not wanted:
            return None
        ops = reversed(self.basic_ops) if reverse else self.basic_ops
        owner = next((op for op in ops if hasattr(op, "fp8_io_quantizer") and op.fp8_enabled), None)
        if owner is None:
            raise ValueError(f"fp8_{'output' if kind == 'output' else 'grad'}=True needs a linear op in FP8 "
                             f"in this chain; it has none")
        return owner.fp8_io_quantizer(kind, device)
