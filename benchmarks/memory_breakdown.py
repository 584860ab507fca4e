"""Memory of the example GPT under each recipe: what is saved for backward, tensor by tensor, and a step's peak.

    python benchmarks/memory_breakdown.py [--layers 1] [--no-tensors]

The model is te_fuser.examples.gpt.GPT (h=512, ffn 2048, 8 heads, s=256, b=8, bf16 params, CPU).
Configurations:
  bf16               no quantization, torch's bf16 GEMMs (on a CPU without bf16 dot products te_fuser
                     widens 16-bit GEMMs to float32 by default; that peak is printed apart)
  FP8                fp8_autocast(DelayedScaling(fp8_dpa=True, fp8_mha=True))
  MXFP8, FP8 block,  fp8_autocast(MXFP8BlockScaling(E4M3)), (Float8BlockScaling()), (NVFP4BlockScaling())
  NVFP4
  MXFP8 / NVFP4      the same recipes with fp8_dpa=True and TE's NVTE_DPA_FP8_RECIPE=Float8CurrentScaling:
  + FP8 attn         the attention in per-tensor FP8 between the block-scaled linears, the one FP8 attention
                     TE offers those recipes (FP8 block has none, as in TE)
  "+ weights"        the same, the model built under te_fuser.quantized_model_init(enabled=True) with the
                     recipe ("not available" while that raises NotImplementedError)
For each: every storage autograd saves for backward in one forward (te_fuser.memory.saved_for_backward:
saved_tensors_hooks, each storage once) other than the parameters' own storages (held by the step anyway),
grouped by the op that saved it (graph node, and the basic op inside te_fuser's op fuser), and the part of
those bytes kept in 16 or 32 bits (what the recipe leaves unquantized: TE keeps a LayerNorm's input, the
activation's input under MXFP8 and NVFP4, the LM head's input and, without FP8 attention, q, k, v and the
attention output in high precision, so those bytes bound the ratio from below); the parameter
bytes (a quantized parameter: every buffer it holds); and the peak of one training step (forward, backward,
AdamW on float32 master weights, the weights copied back) over the bytes held before it, from
te_fuser.memory.MemoryTracker("cpu"), measured on the second step (the first creates AdamW's state).
Ratios are against bf16 in the same run (the 16/32-bit part against bf16's whole saved bytes). Targets:
saved for backward FP8 and MXFP8 <= 0.6x bf16, NVFP4 <= 0.4x; parameters under NVFP4 weights <= 0.35x.
"""

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import te_fuser  # noqa: E402
from te_fuser.examples.gpt import GPT, GPTConfig  # noqa: E402
from te_fuser.memory import MemoryTracker  # noqa: E402
from te_fuser.memory.saved import SavedTensors, saved_for_backward  # noqa: E402
from te_fuser.ops import gemm  # noqa: E402

MIB = 2**20
SEQ, BATCH = 256, 8


RECIPES = {
    "FP8": lambda: te_fuser.recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True),
    "MXFP8": lambda: te_fuser.recipe.MXFP8BlockScaling(fp8_format=te_fuser.recipe.Format.E4M3),
    "FP8 block": lambda: te_fuser.recipe.Float8BlockScaling(),
    "NVFP4": lambda: te_fuser.recipe.NVFP4BlockScaling(),
}
# Block-scaled recipes with FP8 attention: (recipe, NVTE_DPA_FP8_RECIPE while it runs).
FP8_ATTENTION = {
    "MXFP8 + FP8 attn": lambda: te_fuser.recipe.MXFP8BlockScaling(fp8_format=te_fuser.recipe.Format.E4M3,
                                                                  fp8_dpa=True),
    "NVFP4 + FP8 attn": lambda: te_fuser.recipe.NVFP4BlockScaling(fp8_dpa=True),
}
DPA_SWITCH = "Float8CurrentScaling"
TARGETS = {"FP8": 0.6, "MXFP8": 0.6, "NVFP4": 0.4, "MXFP8 + FP8 attn + weights": 0.6,
           "NVFP4 + FP8 attn + weights": 0.4}  # saved for backward, over bf16
PARAM_TARGETS = {"NVFP4 + weights": 0.35}


def build(layers: int, recipe):
    cfg = GPTConfig(vocab_size=256, seq_len=SEQ, hidden_size=512, num_heads=8, num_layers=layers,
                    ffn_hidden_size=2048)
    torch.manual_seed(0)
    if recipe is None:
        return GPT(cfg, dtype=torch.bfloat16)
    with te_fuser.quantized_model_init(enabled=True, recipe=recipe):
        return GPT(cfg, dtype=torch.bfloat16)


def param_storages(model) -> dict:
    """{data_ptr: nbytes} of the parameters' storages, each once (a quantized parameter: every buffer it holds,
    as its __tensor_flatten__ names them)."""
    seen = {}
    for p in model.parameters():
        parts = [p]
        if hasattr(type(p), "__tensor_flatten__"):
            names, _ = p.__tensor_flatten__()
            parts = [getattr(p, name) for name in names]
        for t in parts:
            if t is not None and t.untyped_storage().nbytes():
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return seen


def without_parameters(saved: SavedTensors, model) -> SavedTensors:
    """The saved storages that are not a parameter's own: a step holds its parameters anyway, so a layer
    that saves its (bf16) weight costs nothing extra, and counting it would flatter the FP8 ratio."""
    params = param_storages(model)
    return SavedTensors([e for e in saved if e.tensor.untyped_storage().data_ptr() not in params])


def high_precision_bytes(saved: SavedTensors) -> int:
    """The saved bytes kept in 16 or 32-bit floating point."""
    return sum(e.nbytes for e in saved if e.dtype.is_floating_point and e.dtype.itemsize >= 2)


@contextlib.contextmanager
def dpa_recipe(switch):
    """NVTE_DPA_FP8_RECIPE=switch (None: unset) while the block runs; te_fuser reads it at each call."""
    old = os.environ.pop("NVTE_DPA_FP8_RECIPE", None)
    if switch is not None:
        os.environ["NVTE_DPA_FP8_RECIPE"] = switch
    try:
        yield
    finally:
        os.environ.pop("NVTE_DPA_FP8_RECIPE", None)
        if old is not None:
            os.environ["NVTE_DPA_FP8_RECIPE"] = old


def train_step(model, tokens, recipe, masters, optimizer):
    with te_fuser.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    del logits, loss
    params = list(model.parameters())
    for p, m in zip(params, masters):
        m.grad = p.grad.float()
        p.grad = None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m)


def step_peak(model, tokens, recipe) -> int:
    masters = [p.detach().float().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(masters, lr=1e-4)
    train_step(model, tokens, recipe, masters, optimizer)  # AdamW's state, FP8 scaling state
    with MemoryTracker("cpu") as tracker:
        train_step(model, tokens, recipe, masters, optimizer)
    return tracker.peak_bytes


def measure(layers: int, recipe, quantized_weights: bool = False):
    model = build(layers, recipe if quantized_weights else None)
    tokens = torch.randint(0, 256, (SEQ, BATCH), generator=torch.Generator().manual_seed(1))

    def forward():
        with te_fuser.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            return model(tokens)

    forward()  # FP8 scaling state created outside the measurement
    out, saved = saved_for_backward(forward)
    del out
    return dict(saved=without_parameters(saved, model), params=sum(param_storages(model).values()),
                peak=step_peak(model, tokens, recipe))


def print_saved(title, saved):
    print(f"\n== {title}: saved for backward (parameters' storages not counted), {saved.total_bytes / MIB:.2f} MiB "
          f"in {len(saved)} storages")
    for op, entries in saved.by_op().items():
        total = sum(e.nbytes for e in entries)
        print(f"  {op}  ({total / MIB:.3f} MiB)")
        for e in entries:
            print(f"      {e.slot:30s} {str(e.shape):22s} {str(e.dtype):22s} {e.nbytes:>10d} B")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1, help="transformer blocks (default 1)")
    parser.add_argument("--no-tensors", action="store_true", help="print only the summary table")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")

    # The bf16 baseline runs torch's bf16 GEMMs, as on a GPU or a CPU with bf16 dot products; on a CPU
    # without them te_fuser widens 16-bit GEMMs to float32 (te_fuser/ops/gemm.py), whose transient
    # float32 copies are reported apart.
    gemm.WIDEN_16BIT_ON_CPU = False
    columns = {"bf16": measure(args.layers, None)}
    gemm.WIDEN_16BIT_ON_CPU = True
    probe = torch.ones(1, 1, dtype=torch.bfloat16)
    widened_peak = measure(args.layers, None)["peak"] if gemm.widens_to_float32(probe, probe) else None
    unavailable = {}
    configs = [(name, make, None) for name, make in RECIPES.items()]
    configs += [(name, make, DPA_SWITCH) for name, make in FP8_ATTENTION.items()]
    for name, make, switch in configs:
        with dpa_recipe(switch):
            columns[name] = measure(args.layers, make())
            try:
                columns[f"{name} + weights"] = measure(args.layers, make(), quantized_weights=True)
            except NotImplementedError as err:
                unavailable[f"{name} + weights"] = str(err).splitlines()[0]
    print(f"example GPT: h=512, ffn=2048, 8 heads, s={SEQ}, b={BATCH}, {args.layers} layer(s), bf16 params, CPU; "
          f"recipes: " + "; ".join(f"{name} {make()!r}" for name, make in RECIPES.items())
          + f"; + FP8 attn: fp8_dpa=True, NVTE_DPA_FP8_RECIPE={DPA_SWITCH}")
    if not args.no_tensors:
        for name, col in columns.items():
            print_saved(name, col["saved"])

    base = columns["bf16"]
    saved_base = base["saved"].total_bytes
    # (label, value of a column, what it is divided by): the 16/32-bit part over bf16's whole saved bytes,
    # the least ratio quantizing the rest could reach.
    rows = (("saved for backward", lambda c: c["saved"].total_bytes, saved_base),
            ("of it 16/32-bit", lambda c: high_precision_bytes(c["saved"]), saved_base),
            ("parameters", lambda c: c["params"], base["params"]),
            ("training step peak", lambda c: c["peak"], base["peak"]))
    print(f"\n{'':28s}" + "".join(f"{label:>28s}" for label, _, _ in rows))
    for name, col in columns.items():
        cells = [f"{get(col) / MIB:>12.2f} MiB ({get(col) / over:.2f}x)" for _, get, over in rows]
        print(f"{name:28s}" + "".join(f"{c:>28s}" for c in cells))
    for name, why in unavailable.items():
        print(f"{name}: not available (quantized_model_init(enabled=True): {why})")
    if widened_peak is not None:
        print(f"bf16 training step peak with this CPU's float32-widened 16-bit GEMMs: {widened_peak / MIB:.2f} MiB")
    for name, target in TARGETS.items():
        ratio = columns[name]["saved"].total_bytes / saved_base
        print(f"saved for backward, {name} / bf16 = {ratio:.3f} (target <= {target})")
    for name, target in PARAM_TARGETS.items():
        if name in columns:
            print(f"parameters, {name} / bf16 = {columns[name]['params'] / base['params']:.3f} (target <= {target})")


if __name__ == "__main__":
    main()
