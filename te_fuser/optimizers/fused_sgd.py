"""FusedSGD: TransformerEngine's SGD (transformer_engine/pytorch/optimizers/fused_sgd.py at v2.6).

torch.optim.SGD's update, with TE's options: momentum (the buffer starts as the first gradient), dampening,
Nesterov, weight decay applied before the momentum (torch's) or after it (`wd_after_momentum=True`).
float16 / bfloat16 parameters and their momentum buffers are updated in float32 and stored rounded. `materialize_master_grads` concerns
apex's amp master copies, which te_fuser does not keep: it is accepted and has no effect.
"""

from typing import Optional

import torch
from torch.optim.optimizer import required

from ._set_grad_none import resolved_set_to_none, warn_set_grad_none


class FusedSGD(torch.optim.Optimizer):
    """TE's FusedSGD (see the module docstring)."""

    def __init__(self, params, lr=required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: Optional[bool] = None):
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                    "nesterov": nesterov}
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        self.set_grad_none = set_grad_none
        warn_set_grad_none("FusedSGD", set_grad_none)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=resolved_set_to_none("FusedSGD", self.set_grad_none, set_to_none))

    def get_momentums(self, params):
        """The momentum buffers of `params` (made, zero, where missing) and whether this is their first run."""
        momentums, first_run = [], True
        for p in params:
            state = self.state[p]
            first_run = "momentum_buffer" not in state
            if first_run:
                state["momentum_buffer"] = torch.zeros_like(p)  # the parameter's dtype, as in TE
            momentums.append(state["momentum_buffer"])
        return momentums, first_run

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        scale = 1.0 / self.most_recent_scale if self.scale_set_by_backward else 1.0
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("FusedSGD does not support sparse gradients")
            weights = [p.float() for p in params]
            grads = [p.grad.float() * scale if scale != 1.0 else p.grad.float() for p in params]
            weight_decay, momentum = group["weight_decay"], group["momentum"]
            if weight_decay != 0 and not self.wd_after_momentum:
                grads = torch._foreach_add(grads, weights, alpha=weight_decay)
            if momentum != 0:
                stored, first_run = self.get_momentums(params)
                if first_run:
                    buffers = grads
                else:
                    buffers = [b.float() for b in stored]
                    torch._foreach_mul_(buffers, momentum)
                    torch._foreach_add_(buffers, grads, alpha=1.0 - group["dampening"])
                torch._foreach_copy_(stored, buffers)
                # The update reads the buffer as stored (rounded to the parameter's dtype).
                buffers = [b.float() for b in stored]
                grads = torch._foreach_add(grads, buffers, alpha=momentum) if group["nesterov"] else buffers
            if weight_decay != 0 and self.wd_after_momentum:
                grads = torch._foreach_add(grads, weights, alpha=weight_decay)
            torch._foreach_add_(weights, grads, alpha=-group["lr"])
            for p, weight in zip(params, weights):
                if weight is not p:
                    p.copy_(weight)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss
