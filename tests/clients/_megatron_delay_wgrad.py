"""Megatron's MLP from its TransformerEngine spec (TELayerNormColumnParallelLinear + TERowParallelLinear,
te_fuser under the alias) with delay_wgrad_compute, driven as Megatron's EP-overlap schedule drives it:
backward, then MLP.backward_dw() (fc2's, then fc1's). Runs in a spawned process, as _megatron_gpt.py's
workers do, so the alias and Megatron's global state never touch the pytest process."""

import traceback

import torch
import torch.distributed as dist

import _megatron_gpt as harness

HIDDEN, FFN, SEQ, BATCH, MICROBATCHES = 64, 128, 16, 2, 3


def _mlp(delay: bool, fusion: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
                               use_cpu_initialization=True, init_method_std=0.05,
                               gradient_accumulation_fusion=fusion)
    # Megatron's config accepts delay_wgrad_compute only with its MoE expert-parallel overlap (the schedule
    # that calls backward_dw, which needs several GPUs); the layers read the flag itself.
    config.delay_wgrad_compute = delay
    torch.manual_seed(0)
    return build_module(get_mlp_module_spec(use_te=True), config=config, ffn_hidden_size=FFN)


WEIGHTS = ("linear_fc1.weight", "linear_fc2.weight")


def _grads(mlp, fusion: bool) -> dict:
    """{name: a copy of its gradient}: main_grad for the linear weights under gradient_accumulation_fusion."""
    return {n: None if g is None else g.clone()
            for n, g in ((n, p.main_grad if fusion and n.endswith(WEIGHTS) else p.grad)
                         for n, p in mlp.named_parameters())}


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def run(fusion: bool) -> dict:
    """Per microbatch, against the same MLP without the delay: whether the input's gradients are equal, the
    weights whose gradient backward changed (none may), and the parameters whose gradient differs from the
    reference's after backward_dw() (none may); and the modules' TE base classes."""
    ref, delayed = _mlp(False, fusion), _mlp(True, fusion)
    delayed.load_state_dict(ref.state_dict())
    if fusion:  # what Megatron's DDP gives each parameter
        for mlp in (ref, delayed):
            for p in mlp.parameters():
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    result = {"dx_equal": [], "changed_by_backward": [], "differ": [],
              "te_bases": sorted({next(f"{c.__module__}.{c.__name__}" for c in type(m).__mro__
                                       if c.__module__.startswith("te_fuser."))
                                  for m in delayed.modules() if type(m).__name__.startswith("TE")})}
    for _ in range(MICROBATCHES):
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        dxs = []
        for mlp in (ref, delayed):
            xi = x.clone().requires_grad_()
            before = _grads(mlp, fusion)
            out, bias = mlp(xi)
            (out + bias).backward(dy)
            dxs.append(xi.grad)
            if mlp is delayed:
                after = _grads(mlp, fusion)
                result["changed_by_backward"] += [n for n in after if n.endswith(WEIGHTS)
                                                  and not _same(before[n], after[n])]
                mlp.backward_dw()  # megatron.core.transformer.mlp.MLP.backward_dw: fc2's, then fc1's
        result["dx_equal"].append(torch.equal(*dxs))
        ref_grads, grads = _grads(ref, fusion), _grads(delayed, fusion)
        result["differ"] += [n for n in ref_grads if not _same(ref_grads[n], grads[n])]
    return result


def worker(port: int, results) -> None:
    torch.set_num_threads(1)
    try:
        from te_fuser.compat import install_transformer_engine

        install_transformer_engine()
        harness.patch_megatron_for_cpu()
        harness.init_parallel(0, 1, port)
        try:
            results.put({fusion: run(fusion) for fusion in (False, True)})
        finally:
            dist.destroy_process_group()
    except Exception:
        results.put({"error": traceback.format_exc()})
