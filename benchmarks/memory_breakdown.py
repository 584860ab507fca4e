"""Memory of the example GPT in bf16 and FP8: what is saved for backward, tensor by tensor, and a step's peak.

    python benchmarks/memory_breakdown.py [--layers 1] [--no-tensors]

The model is te_fuser.examples.gpt.GPT (h=512, ffn 2048, 8 heads, s=256, b=8, bf16 params, CPU).
Three configurations:
  bf16               no FP8, torch's bf16 GEMMs (on a CPU without bf16 dot products te_fuser widens 16-bit
                     GEMMs to float32 by default; that peak is printed apart)
  FP8                fp8_autocast(DelayedScaling(fp8_dpa=True, fp8_mha=True))
  FP8 + FP8 weights  the same, the model built under te_fuser.quantized_model_init(enabled=True)
                     ("not available" while that raises NotImplementedError)
For each: every storage autograd saves for backward in one forward (te_fuser.memory.saved_for_backward:
saved_tensors_hooks, each storage once) other than the parameters' own storages (held by the step anyway),
grouped by the op that saved it (graph node, and the basic op
inside te_fuser's op fuser); the parameter bytes; and the peak of one training step (forward, backward,
AdamW on float32 master weights, the weights copied back) over the bytes held before it, from
te_fuser.memory.MemoryTracker("cpu"), measured on the second step (the first creates AdamW's state).
Ratios are against bf16 in the same run. Issue 15's target: saved for backward under FP8 <= 0.6x bf16.
"""

import argparse
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


def fp8_recipe():
    try:
        return te_fuser.recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True)
    except (TypeError, ValueError, NotImplementedError):
        return te_fuser.recipe.DelayedScaling(fp8_dpa=True)


def build(layers: int, fp8_weights: bool, weight_recipe=None):
    """The example GPT; fp8_weights: built under quantized_model_init(weight_recipe, default fp8_recipe())."""
    cfg = GPTConfig(vocab_size=256, seq_len=SEQ, hidden_size=512, num_heads=8, num_layers=layers,
                    ffn_hidden_size=2048)
    torch.manual_seed(0)
    if not fp8_weights:
        return GPT(cfg, dtype=torch.bfloat16)
    with te_fuser.quantized_model_init(enabled=True, recipe=weight_recipe or fp8_recipe()):
        return GPT(cfg, dtype=torch.bfloat16)


def param_storages(model) -> dict:
    """{data_ptr: nbytes} of the parameters' storages, each once (a quantized parameter: its buffers' storages,
    e.g. an FP8 one's data, transpose and scale, a block-scaled one's data, scales and amax per usage)."""
    seen = {}
    for p in model.parameters():
        parts = [getattr(p, name) for name in p.__tensor_flatten__()[0]] if isinstance(p, te_fuser.QuantizedTensor) \
            else [p]
        for t in parts:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return seen


WEIGHT_RECIPES = {"FP8 (DelayedScaling)": lambda: te_fuser.recipe.DelayedScaling(),
                  "MXFP8BlockScaling": lambda: te_fuser.recipe.MXFP8BlockScaling(),
                  "Float8BlockScaling": lambda: te_fuser.recipe.Float8BlockScaling(),
                  "NVFP4BlockScaling": lambda: te_fuser.recipe.NVFP4BlockScaling()}


def parameter_bytes_by_recipe(layers: int) -> dict:
    """{recipe name: parameter bytes of the GPT built under quantized_model_init(that recipe)}, with "bf16"."""
    out = {"bf16": sum(param_storages(build(layers, False)).values())}
    for name, make in WEIGHT_RECIPES.items():
        out[name] = sum(param_storages(build(layers, True, make())).values())
    return out


def without_parameters(saved: SavedTensors, model) -> SavedTensors:
    """The saved storages that are not a parameter's own: a step holds its parameters anyway, so a layer
    that saves its (bf16) weight costs nothing extra, and counting it would flatter the FP8 ratio."""
    params = param_storages(model)
    return SavedTensors([e for e in saved if e.tensor.untyped_storage().data_ptr() not in params])


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


def measure(layers: int, fp8: bool, fp8_weights: bool):
    model = build(layers, fp8_weights)
    recipe = fp8_recipe() if fp8 else None
    tokens = torch.randint(0, 256, (SEQ, BATCH), generator=torch.Generator().manual_seed(1))

    def forward():
        with te_fuser.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
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
    columns = {"bf16": measure(args.layers, False, False)}
    gemm.WIDEN_16BIT_ON_CPU = True
    probe = torch.ones(1, 1, dtype=torch.bfloat16)
    widened_peak = measure(args.layers, False, False)["peak"] if gemm.widens_to_float32(probe, probe) else None
    columns["FP8"] = measure(args.layers, True, False)
    try:
        columns["FP8 + FP8 weights"] = measure(args.layers, True, True)
    except NotImplementedError as err:
        columns["FP8 + FP8 weights"] = None
        unavailable = str(err).splitlines()[0]
    recipe = fp8_recipe()
    print(f"example GPT: h=512, ffn=2048, 8 heads, s={SEQ}, b={BATCH}, {args.layers} layer(s), bf16 params, CPU; "
          f"FP8 recipe: DelayedScaling(fp8_dpa={recipe.fp8_dpa}, fp8_mha={recipe.fp8_mha})")
    if not args.no_tensors:
        for name, col in columns.items():
            if col is not None:
                print_saved(name, col["saved"])

    base = columns["bf16"]
    rows = (("saved for backward", lambda c: c["saved"].total_bytes),
            ("parameters", lambda c: c["params"]),
            ("training step peak", lambda c: c["peak"]))
    print(f"\n{'':22s}" + "".join(f"{name:>26s}" for name in columns))
    for label, get in rows:
        cells = []
        for col in columns.values():
            if col is None:
                cells.append(f"{'not available':>26s}")
            else:
                value = get(col)
                cells.append(f"{value / MIB:>12.2f} MiB ({value / get(base):.2f}x)")
        print(f"{label:22s}" + "".join(f"{c:>26s}" for c in cells))
    if columns["FP8 + FP8 weights"] is None:
        print(f"\nFP8 + FP8 weights: not available (quantized_model_init(enabled=True): {unavailable})")
    if widened_peak is not None:
        print(f"bf16 training step peak with this CPU's float32-widened 16-bit GEMMs: {widened_peak / MIB:.2f} MiB")
    ratio = columns["FP8"]["saved"].total_bytes / base["saved"].total_bytes
    print(f"saved for backward, FP8 / bf16 = {ratio:.3f} (issue 15 target <= 0.6)")
    params = parameter_bytes_by_recipe(args.layers)
    print("\nparameters under quantized_model_init (norms, biases and the embedding stay bf16):")
    for name, value in params.items():
        print(f"  {name:22s} {value / MIB:8.2f} MiB ({value / params['bf16']:.2f}x)")
    print(f"NVFP4 / bf16 = {params['NVFP4BlockScaling'] / params['bf16']:.3f} (issue 31 target <= 0.35)")


if __name__ == "__main__":
    main()
