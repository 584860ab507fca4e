"""FusedAdam: TransformerEngine's Adam / AdamW with master weights and low-precision optimizer states.

TE's constructor and semantics (transformer_engine/pytorch/optimizers/fused_adam.py at v2.6): Adam with L2
weight decay (`adam_w_mode=False`) or decoupled weight decay (AdamW, the default); `bias_correction`;
`master_weights` (float32 or float16 copies of float16 / bfloat16 / FP8 parameters, the model's parameters
written from them after each step); `exp_avg_dtype` / `exp_avg_sq_dtype` / `master_weight_dtype` of float32,
float16, bfloat16 or torch.uint8 (FP8 E4M3), the non-float32 states kept scaled by a float32 factor so their
largest magnitude fills the format (`get_unscaled_state` / `set_scaled_state`, state_dict in float32);
`store_param_remainders` (bfloat16 parameters with float32 masters kept as the low 16 bits only);
`use_decoupled_grad` (gradients from `param.decoupled_grad`); `capturable` (lr and step as tensors, a
GradScaler's found-inf skips the step and its scale is divided out). FP8 (Float8Tensor) parameters are
updated in place: their bytes re-quantized from the master with their quantizer's scale, its amax recorded.

The update runs in float32 with torch's foreach ops (TE's multi_tensor_adam math: denominator
sqrt(v / bias_correction2) + eps).
"""

from copy import deepcopy
from itertools import chain
from typing import Optional

import torch

from ..tensor.float8_tensor import Float8Quantizer, Float8Tensor
from ..te_dtype import DType
from ._set_grad_none import resolved_set_to_none, warn_set_grad_none

_STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
_STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
# The largest magnitude a scaled state is given: half float16's range, E4M3's maximum.
_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.uint8: 448.0}


def _high_precision(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 copy (an FP8 tensor's `.float()` would be itself: its nominal dtype may be float32)."""
    tensor = tensor.detach()
    if isinstance(tensor, Float8Tensor):
        return tensor.dequantize(dtype=torch.float32)
    return tensor.to(torch.float32, copy=True)


def _bf16_with_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master a bfloat16 parameter and its int16 low bits stand for (the parameter was rounded
    to nearest from it, up when the remainder's top bit is set)."""
    high = param.view(torch.int16).to(torch.int32) - (remainder < 0).to(torch.int32)
    bits = (high << 16) | (remainder.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32)


def _split_to_bf16(master: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write a float32 master back as its bfloat16 rounding (to nearest, ties up) and low 16 bits."""
    bits = master.view(torch.int32)
    low = (bits & 0xFFFF).to(torch.int16)
    high = (bits >> 16) + (low < 0).to(torch.int32)
    param.view(torch.int16).copy_(high.to(torch.int16))
    remainder.copy_(low)


class FusedAdam(torch.optim.Optimizer):
    """TE's FusedAdam (see the module docstring); a drop-in for torch.optim.AdamW, or Adam with
    adam_w_mode=False."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, bias_correction: bool = True, adam_w_mode: bool = True,
                 capturable: bool = False, master_weights: bool = False, master_weight_dtype=torch.float32,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False, set_grad_none: Optional[bool] = None):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (amsgrad=True)")
        if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
            raise RuntimeError(f"FusedAdam: master_weight_dtype must be torch.float32 or torch.float16, "
                               f"got {master_weight_dtype}")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in _STATE_DTYPES:
                raise RuntimeError(f"FusedAdam: {name} must be one of fp32/fp16/bf16/fp8 (torch.uint8), got {dtype}")
        if capturable:
            if master_weights and master_weight_dtype != torch.float32:
                raise RuntimeError("FusedAdam: capturable=True needs master_weight_dtype=torch.float32")
            if exp_avg_dtype != torch.float32 or exp_avg_sq_dtype != torch.float32:
                raise RuntimeError("FusedAdam: capturable=True needs float32 exp_avg_dtype and exp_avg_sq_dtype")
            if store_param_remainders:
                raise RuntimeError("FusedAdam: capturable=True does not support store_param_remainders")
        if not 0.0 <= eps:
            raise ValueError(f"FusedAdam: eps must be >= 0, got {eps}")
        lr = torch.tensor(lr, dtype=torch.float32) if capturable else lr
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = bool(master_weights)
        if capturable:
            for group in self.param_groups:
                if group["params"]:
                    group["lr"] = group["lr"].to(group["params"][0].device)
            self._step_supports_amp_scaling = True
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self._scales = {}
        self.use_decoupled_grad = use_decoupled_grad
        # Only bfloat16 parameters with float32 masters keep remainders.
        self.store_param_remainders = (store_param_remainders and self.master_weights
                                       and master_weight_dtype == torch.float32)
        self.set_grad_none = set_grad_none
        warn_set_grad_none("FusedAdam", set_grad_none)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Gradients (or decoupled_grad) to None (the default) or zero."""
        set_to_none = resolved_set_to_none("FusedAdam", self.set_grad_none, set_to_none)
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.decoupled_grad = None
                elif getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()

    # -- states ----------------------------------------------------------------------------------
    def _keeps_remainder(self, param, state_name: str) -> bool:
        return self.store_param_remainders and state_name == "master_param" and param.dtype == torch.bfloat16

    def _apply_scale(self, state_name: str, unscaled: torch.Tensor, scaled: torch.Tensor,
                     scale: torch.Tensor) -> None:
        """Store float32 `unscaled` into the low-precision `scaled`, `scale` (float32, (1,)) = absmax / range."""
        if scaled.dtype == torch.bfloat16 and not isinstance(scaled, Float8Tensor):
            scaled.copy_(unscaled)
            return
        dtype = self.name_to_dtype_map[state_name]
        absmax = unscaled.abs().amax() if unscaled.numel() else unscaled.new_zeros(())
        torch.div(absmax.reshape(1), _RANGE[dtype], out=scale)
        if isinstance(scaled, Float8Tensor):
            scaled._quantizer.scale.copy_(torch.where(scale > 0, scale.reciprocal(), 1.0))
            scaled.copy_(unscaled)
        else:
            scaled.copy_(unscaled * torch.where(scale > 0, scale.reciprocal(), 0.0))

    def get_unscaled_state(self, param, state_name: str) -> torch.Tensor:
        """The float32 value of a parameter's state (the stored tensor itself when it is float32; with
        store_param_remainders, the int16 remainders)."""
        if state_name not in self.name_to_dtype_map:
            raise ValueError(f"state_name must be one of {_STATE_NAMES}, got {state_name!r}")
        stored = self.state[param][state_name]
        dtype = self.name_to_dtype_map[state_name]
        if dtype == torch.float16:
            return stored.float() * self._scales[param][state_name]
        if dtype == torch.uint8:
            return stored.dequantize(dtype=torch.float32)
        if dtype == torch.bfloat16:
            return stored.float()
        return stored

    def set_scaled_state(self, param, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Set a parameter's state from its float32 value (int16 remainders with store_param_remainders),
        scaled into the state's dtype."""
        remainder = self._keeps_remainder(param, state_name)
        want = torch.int16 if remainder else torch.float32
        if unscaled_state.dtype != want:
            raise TypeError(f"unscaled_state for {state_name!r} must be {want}, got {unscaled_state.dtype}")
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, False, remainder)
        if self.name_to_dtype_map[state_name] != torch.float32:
            self._apply_scale(state_name, unscaled_state, self.state[param][state_name],
                              self._scales[param][state_name])
        else:
            self.state[param][state_name].copy_(unscaled_state)

    def _initialize_state(self, param, state_name: str, zero_buffer: bool, store_param_remainders: bool = False):
        dtype = self.name_to_dtype_map[state_name]
        # Plain tensors of the parameter's shape (zeros_like of an FP8 parameter would be FP8).
        data_dtype = torch.int16 if store_param_remainders else torch.float32 if dtype == torch.uint8 else dtype
        data = torch.zeros(param.shape, dtype=data_dtype, device=param.device)
        del zero_buffer  # always zeros: an uninitialized master is set right after
        if dtype == torch.uint8:
            quantizer = Float8Quantizer(scale=torch.ones(1, device=param.device),
                                        amax=torch.zeros(1, device=param.device), fp8_dtype=DType.kFloat8E4M3)
            state = quantizer.make_empty(param.shape, device=param.device)
            state.quantize_(data)
            self.state[param][state_name] = state
        else:
            self.state[param][state_name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[state_name] = torch.ones(1, dtype=torch.float32, device=param.device)

    def initialize_state(self, param, store_param_remainders: bool) -> None:
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False,
                                   store_param_remainders=store_param_remainders)
            if not store_param_remainders:
                self.set_scaled_state(param, "master_param", _high_precision(param))

    def _id_map(self, state_dict):
        saved = deepcopy(state_dict["param_groups"])
        return dict(zip(chain.from_iterable(g["params"] for g in saved),
                        chain.from_iterable(g["params"] for g in self.param_groups)))

    def state_dict(self):
        """torch's state_dict with every state as its float32 value (remainders as int16)."""
        state_dict = super().state_dict()
        for key, value in self._id_map(state_dict).items():
            if key in state_dict["state"]:
                state_dict["state"][key] = {name: self.get_unscaled_state(value, name)
                                            for name in state_dict["state"][key]}
        return state_dict

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for key, param in self._id_map(state_dict).items():
            if key not in state_dict["state"]:
                continue
            self.state[param] = {}
            for name, value in state_dict["state"][key].items():
                if value is None:
                    continue
                value = value.to(param.device)
                self.set_scaled_state(param, name, value if self._keeps_remainder(param, name) else value.float())

    # -- step ------------------------------------------------------------------------------------
    def _grad(self, p):
        return getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad

    def step(self, closure=None, grad_scaler=None):
        """One Adam step over every parameter with a gradient."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            device = group["params"][0].device
            inv_scale, skip = None, False
            if self.capturable and grad_scaler is not None:
                found_inf = grad_scaler._check_inf_per_device(self)[device]
                skip = bool(found_inf.item())
                inv_scale = grad_scaler._get_scale_async().double().reciprocal().float()
            if skip:
                group.setdefault("step", torch.zeros(1, dtype=torch.int, device=device))
                continue
            if self.capturable:
                group["step"] = group.get("step", torch.zeros(1, dtype=torch.int, device=device)) + 1
            else:
                group["step"] = group.get("step", 0) + 1
            self._step_group(group, inv_scale)
        return loss

    def _step_group(self, group, inv_scale) -> None:
        kinds = {p.dtype for p in group["params"] if self._grad(p) is not None
                 and not isinstance(p, Float8Tensor) and p.dtype != torch.float32}
        if {torch.float16, torch.bfloat16} <= kinds:
            raise RuntimeError("FusedAdam does not support a mix of float16 and bfloat16 model weights")
        rows = []  # (param, grad, exp_avg, exp_avg_sq, float32 weights)
        for p in group["params"]:
            state = self.state[p]
            remainder = self.store_param_remainders and p.dtype == torch.bfloat16
            if len(state) == 0:
                self.initialize_state(p, remainder)
            grad = self._grad(p)
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("FusedAdam does not support sparse gradients")
            if isinstance(p, Float8Tensor):
                if self.capturable:
                    raise RuntimeError("FusedAdam does not support FP8 model weights with capturable=True")
                if not self.master_weights:
                    raise RuntimeError("FusedAdam: FP8 (Float8Tensor) parameters need master_weights=True")
            elif p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise RuntimeError(f"FusedAdam only supports model weights in fp32, fp16, bf16 and fp8, got {p.dtype}")
            if remainder:
                weights = _bf16_with_remainder(p.detach(), state["master_param"])
            elif self.master_weights and (isinstance(p, Float8Tensor) or p.dtype != torch.float32):
                weights = self.get_unscaled_state(p, "master_param")
            else:
                weights = p.detach().float()
            grad = _high_precision(grad)
            if inv_scale is not None:
                grad = grad * inv_scale
            # Float32 states are updated in place; the others through float32 copies, scaled back after.
            rows.append((p, grad, self.get_unscaled_state(p, "exp_avg"), self.get_unscaled_state(p, "exp_avg_sq"),
                         weights))
        if not rows:
            return
        params, grads, exp_avgs, exp_avg_sqs, weights = (list(column) for column in zip(*rows))
        self._adam_math(group, grads, exp_avgs, exp_avg_sqs, weights)
        for p, exp_avg, exp_avg_sq, weight in zip(params, exp_avgs, exp_avg_sqs, weights):
            self._store(p, exp_avg, exp_avg_sq, weight)

    def _adam_math(self, group, grads, exp_avgs, exp_avg_sqs, weights) -> None:
        """TE's multi_tensor_adam update, in float32, in place on exp_avgs, exp_avg_sqs and weights."""
        beta1, beta2 = group["betas"]
        step = group["step"]
        step = float(step.item()) if isinstance(step, torch.Tensor) else float(step)
        lr = group["lr"]
        lr = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
        correction1 = 1.0 - beta1 ** step if group["bias_correction"] else 1.0
        correction2 = 1.0 - beta2 ** step if group["bias_correction"] else 1.0
        weight_decay = group["weight_decay"]
        if weight_decay != 0 and not self.adam_w_mode:  # L2: the decay joins the gradient
            grads = torch._foreach_add(grads, weights, alpha=weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_div(exp_avg_sqs, correction2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(exp_avgs, correction1)
        torch._foreach_div_(update, denom)
        if weight_decay != 0 and self.adam_w_mode:
            torch._foreach_add_(update, weights, alpha=weight_decay)
        torch._foreach_add_(weights, update, alpha=-lr)

    def _store(self, p, exp_avg, exp_avg_sq, weight) -> None:
        state = self.state[p]
        for name, value in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if self.name_to_dtype_map[name] != torch.float32:
                self.set_scaled_state(p, name, value)
        with torch.no_grad():
            if self.store_param_remainders and p.dtype == torch.bfloat16:
                _split_to_bf16(weight, p.detach(), state["master_param"])
                return
            if isinstance(p, Float8Tensor):
                p.detach().quantize_(weight)  # in place: the same bytes, the quantizer's scale, its amax
            elif weight is not p:
                p.detach().copy_(weight)
            if "master_param" in state and weight is not state["master_param"]:
                self.set_scaled_state(p, "master_param", weight)
