"""Every te_fuser module under torch FSDP on 2 gloo CPU ranks: FSDP1 with use_orig_params False
and True, each with and without activation checkpointing, and FSDP2 (fully_shard). Losses and
updated parameters equal those of the unsharded module (te_fuser.Linear used to read
self._parameters[...], which FSDP1's flat parameters empty: KeyError)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import te_fuser

from _module_checks import spawn

HIDDEN, TOKENS, STEPS, LR = 32, 16, 2, 1.0

MODULES = {
    "Linear": lambda: te_fuser.Linear(HIDDEN, HIDDEN, device="cpu"),
    "LayerNorm": lambda: te_fuser.LayerNorm(HIDDEN, device="cpu"),
    "RMSNorm": lambda: te_fuser.RMSNorm(HIDDEN, device="cpu"),
    "LayerNormLinear": lambda: te_fuser.LayerNormLinear(HIDDEN, HIDDEN, normalization="RMSNorm", device="cpu"),
    "LayerNormMLP": lambda: te_fuser.LayerNormMLP(HIDDEN, 2 * HIDDEN, activation="swiglu", device="cpu"),
}
CASES = [("fsdp1", False, False), ("fsdp1", False, True), ("fsdp1", True, False), ("fsdp1", True, True),
         ("fsdp2", None, False)]


def _make(name):
    torch.manual_seed(0)
    module = MODULES[name]()
    with torch.no_grad():  # no parameter left at a constant init: every gradient shows
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module


def _train(model, params, x, probe):
    """STEPS steps of SGD on loss = sum(out * probe); the losses."""
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = (model(x) * probe).sum()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _full_params(model, kind):
    if kind == "fsdp1":
        with FSDP.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _cases(rank, name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    g = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, generator=g)  # the same batch on both ranks:
    probe = torch.randn(TOKENS, HIDDEN, generator=g)  # averaged grads = the unsharded grads
    reference = _make(name)
    ref_losses = _train(reference, reference.parameters(), x, probe)
    ref_params = [p.detach() for p in reference.parameters()]
    for kind, use_orig_params, activation_checkpointing in CASES:
        case = f"{name} {kind} use_orig_params={use_orig_params} checkpointing={activation_checkpointing}"
        module = _make(name)
        if activation_checkpointing:
            module = checkpoint_wrapper(module)
        if kind == "fsdp1":
            model = FSDP(module, use_orig_params=use_orig_params, device_id=torch.device("cpu"))
        else:
            model = fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        losses = _train(model, model.parameters(), x, probe)
        for step, (got, expect) in enumerate(zip(losses, ref_losses)):
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5, msg=f"{case}: loss of step {step}")
        params = _full_params(model, kind)
        assert len(params) == len(ref_params), case
        for i, (got, expect) in enumerate(zip(params, ref_params)):
            torch.testing.assert_close(got.reshape(expect.shape), expect, rtol=1e-5, atol=1e-5,
                                       msg=f"{case}: parameter {i}")


@pytest.mark.parametrize("name", list(MODULES))
def test_fsdp1_and_fsdp2_match_the_unsharded_module(name):
    spawn(_cases, name)
