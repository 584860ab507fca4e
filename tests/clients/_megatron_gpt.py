"""Megatron-core GPT on CPU with gloo: the harness behind test_megatron_gpt.py.

Builds a tiny GPTModel twice with the same weights -- from Megatron's local (pure-torch) layer spec
as the reference, and from get_gpt_layer_with_transformer_engine_spec() with `transformer_engine`
resolving to te_fuser -- trains both for a few steps on the same tokens and returns the losses and
what the autograd graph still holds after backward. Everything runs in spawned worker processes
(one per gloo rank), so the alias and Megatron's global state never touch the pytest process.
"""

import contextlib
import copy
import os
import queue
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

MEMORY_TESTS = str(Path(__file__).resolve().parents[1] / "memory")  # home of the graph walk

VOCAB, SEQ, BATCH = 128, 32, 2
HIDDEN, HEADS, FFN, LAYERS = 64, 4, 256, 2
STEPS, MICROBATCHES, LR, SEED = 4, 2, 0.1, 1234
TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Megatron's own CUDA assumptions, patched for a CPU run. te_fuser is never patched: the
# torch.cuda replacements answer only callers inside megatron.*, anyone else gets torch's own
# function (which raises on a CPU build of torch), so te_fuser cannot lean on them unseen.
# ---------------------------------------------------------------------------------------------
def _for_megatron_only(original, cpu_version):
    def patched(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("megatron."):
            return cpu_version(*args, **kwargs)
        return original(*args, **kwargs)

    return patched


def patch_megatron_for_cpu() -> None:
    """Megatron 0.16.1 hard-codes CUDA in places a CPU run reaches:
    - torch.cuda.current_device(): its global memory buffer (local-spec attention), RoPE's inv_freq;
    - its activation recompute (tensor_parallel/random.py CheckpointFunction) and its RNG-tracker fork
      save and restore the *CUDA* generator (_get_cuda_rng_state/_set_cuda_rng_state): here the CPU
      default generator stands in for it, as it does for te_fuser's RNG tracker on CPU;
    - transformer/utils.get_default_causal_mask builds its mask on device="cuda" (local-spec attention).
    (torch.cuda.manual_seed, which model_parallel_cuda_manual_seed calls, is a lazy no-op without CUDA.)
    """
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel.random as mrandom

    cpu = torch.device("cpu")
    torch.cuda.current_device = _for_megatron_only(torch.cuda.current_device, lambda: cpu)
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)


def init_parallel(rank: int, world: int, port: int) -> None:
    """gloo, and Megatron's parallel state with all ranks in one tensor-parallel group."""
    from megatron.core import parallel_state

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def make_config(dtype="fp32", fp8_recipe=None, recompute=False, hidden_dropout=0.0, cpu_init=True,
                normalization="LayerNorm", distribute_saved_activations=False, fp8_format="hybrid", fp4_recipe=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  tensor_model_parallel_size=dist.get_world_size(), use_cpu_initialization=cpu_init,
                  hidden_dropout=hidden_dropout, attention_dropout=0.0, init_method_std=0.05,
                  normalization=normalization)
    if dtype == "bf16":
        kwargs.update(bf16=True, params_dtype=torch.bfloat16)
    if fp8_recipe is not None:
        kwargs.update(fp8=fp8_format, fp8_recipe=fp8_recipe)
    if fp4_recipe is not None:
        kwargs.update(fp4="e2m1", fp4_recipe=fp4_recipe)
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                      distribute_saved_activations=distribute_saved_activations)
    return TransformerConfig(**kwargs)


def build_local_gpt(config):
    """The reference: Megatron's local spec, with torch's LayerNorm as the final norm too (when a
    `transformer_engine` is importable Megatron's block would otherwise pick TENorm for it)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec(normalization=config.normalization)
    spec = TransformerBlockSubmodules(layer_specs=[layer] * LAYERS, layer_norm=WrappedTorchNorm)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def build_te_gpt(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


def local_to_te_names(local_model) -> dict:
    """Parameter names of the local model -> names in the TE-spec model, by the key map Megatron's
    local layer spec declares for exactly this (its norms live inside TE's LayerNormLinear)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    names = {}
    for name, _ in local_model.named_parameters():
        mapped = name
        for old, new in keys_map.items():
            if f".{old}" in mapped:
                mapped = mapped.replace(f".{old}", f".{new}")
        names[name] = mapped
    return names


def copy_weights(local_model, te_model) -> None:
    te_params = dict(te_model.named_parameters())
    names = local_to_te_names(local_model)
    missing = sorted(set(te_params) - set(names.values()))
    if missing:
        raise AssertionError(f"TE-spec parameters with no local counterpart: {missing}")
    with torch.no_grad():
        for name, p in local_model.named_parameters():
            target = te_params[names[name]]
            if target.shape != p.shape:
                raise AssertionError(f"{name} -> {names[name]}: {tuple(p.shape)} vs {tuple(target.shape)}")
            target.copy_(p)


# ---------------------------------------------------------------------------------------------
# Training and the graph walk
# ---------------------------------------------------------------------------------------------
def batches():
    """STEPS x MICROBATCHES batches, the same on every rank (tensor parallelism wants equal inputs).
    The next token is a fixed permutation of the current one: something to learn in a few steps."""
    g = torch.Generator().manual_seed(SEED)
    successor = torch.randperm(VOCAB, generator=g)
    out = []
    for _ in range(STEPS * MICROBATCHES):
        tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for i in range(SEQ):
            tokens[:, i + 1] = successor[tokens[:, i]]
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def train(model, data, on_last_backward=None):
    """SGD steps of MICROBATCHES accumulated microbatches; returns each step's loss.
    As Megatron's schedule does (pipeline_parallel/schedules.py, forward_step), the model is told
    when a step's first microbatch starts: TE layers cast their FP8 weights there and reuse the
    cast for the step's later microbatches. on_last_backward(loss) runs after the last backward
    while the loss (and with it the whole graph) is still alive."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    losses = []
    model.train()
    for step in range(len(data) // MICROBATCHES):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(MICROBATCHES):
            if micro == 0:
                model.set_is_first_microbatch()
            tokens, labels = data[step * MICROBATCHES + micro]
            loss = model(tokens, position_ids, None, labels=labels).float().mean() / MICROBATCHES
            loss.backward()
            total += loss.item()
        if on_last_backward is not None and step == len(data) // MICROBATCHES - 1:
            on_last_backward(loss)
        opt.step()
        losses.append(total)
    return losses


def graph_leftovers(model):
    """A callback for train(): records [(path, shape, dtype)] of the tensors still reachable from the
    graph after backward, apart from the model's parameters and te_fuser's FP8 recipe state."""
    if MEMORY_TESTS not in sys.path:
        sys.path.append(MEMORY_TESTS)
    from _fuser_ctx_walk import allowed_storages, reachable_tensors

    found = []

    def walk(loss):
        allowed = allowed_storages(model)
        found.extend((path, tuple(t.shape), str(t.dtype)) for path, t in reachable_tensors(loss, allowed))

    return found, walk


# ---------------------------------------------------------------------------------------------
# Cases (run inside a worker; return plain data)
# ---------------------------------------------------------------------------------------------
def run_case(case: dict) -> dict:
    """One training run of the TE-spec GPT (and of the local-spec reference on the same weights).

    case keys: dtype ("fp32"|"bf16"), fp8 (Megatron's --fp8-recipe: None|"delayed"|"tensorwise"|"mxfp8"),
    fp8_format (its --fp8-format, default "hybrid"), fp4 (its --fp4-recipe: None|"nvfp4"), recompute (bool),
    distribute_saved_activations (bool), normalization ("LayerNorm"|"RMSNorm"),
    cpu_init (Megatron's use_cpu_initialization; False: layers built on "the current device" and
    initialized under the RNG tracker), hidden_dropout (Megatron's bias-dropout-add; attention
    dropout stays 0: TE's and Megatron's attention draw their masks differently),
    reference ("local": also train the local spec; "none"), bug_on (a te_fuser switch that
    releases saved state after backward, turned off: "fuser" or "checkpoint"), te_cross_entropy (the
    TE-spec model computes its loss with TE's parallel_cross_entropy: Megatron's
    cross_entropy_loss_fusion with cross_entropy_fusion_impl="te"; the reference keeps Megatron's own).
    """
    data = batches()
    config = make_config(case.get("dtype", "fp32"), case.get("fp8"), case.get("recompute", False),
                         case.get("hidden_dropout", 0.0), case.get("cpu_init", True),
                         case.get("normalization", "LayerNorm"), case.get("distribute_saved_activations", False),
                         case.get("fp8_format", "hybrid"), case.get("fp4"))
    with _fp4_gate_lifted(case.get("fp4") is not None):
        return _run_configured_case(case, config, data)


def _run_configured_case(case: dict, config, data) -> dict:
    result = {}
    _reseed()
    local = build_local_gpt(config)
    te_config = config
    if case.get("te_cross_entropy"):
        te_config = copy.copy(config)
        te_config.cross_entropy_loss_fusion, te_config.cross_entropy_fusion_impl = True, "te"
    te_model = build_te_gpt(te_config)
    copy_weights(local, te_model)
    if case.get("reference", "local") == "local":
        _reseed()
        result["local"] = train(local, data)
    found, walk = graph_leftovers(te_model)
    _reseed()
    with _release_switch_off(case.get("bug_on")), _counting_cross_entropy_calls() as calls:
        result["te"] = train(te_model, data, on_last_backward=walk)
    result["te_cross_entropy_calls"] = len(calls)
    result["leftovers"] = found
    result["te_fuser_classes"] = sorted(_te_fuser_classes(te_model))
    # Megatron (TE >= 2.6, non-delayed FP8) asks linear_proj to save its unquantized input.
    result["proj_save_original_input"] = [getattr(m, "save_original_input", None)
                                          for n, m in te_model.named_modules() if n.endswith("linear_proj")]
    return result


@contextlib.contextmanager
def _fp4_gate_lifted(lift: bool):
    """Megatron 0.16.1's FP4 (megatron/core/fp4_utils.py: get_fp4_recipe, its NVFP4BlockScaling) runs only
    when TE reports >= 2.7.0.dev0, the TE development line that added NVFP4. te_fuser reports TE 2.6's API
    level (te_fuser/compat) and has NVFP4BlockScaling, so for an --fp4-recipe case that one module's
    version check answers yes to 2.7.0.dev0; every other Megatron check still sees 2.6."""
    if not lift:
        yield
        return
    import megatron.core.fp4_utils as fp4_utils

    original = fp4_utils.is_te_min_version
    fp4_utils.is_te_min_version = lambda version, *a, **k: version == "2.7.0.dev0" or original(version, *a, **k)
    try:
        yield
    finally:
        fp4_utils.is_te_min_version = original


@contextlib.contextmanager
def _counting_cross_entropy_calls():
    """The calls of te_fuser's cross-entropy Function (Megatron's te_parallel_cross_entropy) in the block."""
    from te_fuser.cross_entropy import CrossEntropyFunction

    calls = []
    apply = CrossEntropyFunction.apply
    CrossEntropyFunction.apply = staticmethod(lambda *args: calls.append(1) or apply(*args))
    try:
        yield calls
    finally:
        del CrossEntropyFunction.apply  # torch.autograd.Function's own again


def _reseed() -> None:
    """The same RNG states before each training run (dropout masks): Megatron's seeding, with
    TE's RNG tracker -- te_fuser's CudaRNGStatesTracker under the alias."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED, te_rng_tracker=True, force_reset_rng=True)


def _te_fuser_classes(model) -> set:
    """The te_fuser classes the model's modules are (Megatron's TE wrappers subclass them)."""
    found = set()
    for m in model.modules():
        for cls in type(m).__mro__:
            if cls.__module__.startswith("te_fuser"):
                found.add(f"{cls.__module__}.{cls.__qualname__}")
                break
    return found


# te_fuser's switches that release what backward no longer needs; off only to show the walk sees it.
_RELEASE_SWITCHES = {"fuser": ("te_fuser.ops.fuser", "_CLEAR_CTX_AFTER_BACKWARD"),
                     "checkpoint": ("te_fuser.distributed", "_CLEAR_FRAME_AFTER_BACKWARD")}


@contextlib.contextmanager
def _release_switch_off(which):
    if which is None:
        yield
        return
    import importlib

    module_name, flag = _RELEASE_SWITCHES[which]
    module = importlib.import_module(module_name)
    saved = getattr(module, flag)
    setattr(module, flag, False)
    try:
        yield
    finally:
        setattr(module, flag, saved)


def worker(rank: int, world: int, port: int, cases: dict, results) -> None:
    """Installs the alias, then runs every case on this rank; puts (rank, name, result or
    {"error": traceback}) on results."""
    torch.set_num_threads(1)
    try:
        from te_fuser.compat import install_transformer_engine

        install_transformer_engine()
        patch_megatron_for_cpu()
        init_parallel(rank, world, port)
    except Exception:
        for name in cases:
            results.put((rank, name, {"error": traceback.format_exc()}))
        return
    try:
        for name, case in cases.items():
            try:
                results.put((rank, name, run_case(case)))
            except Exception:
                results.put((rank, name, {"error": traceback.format_exc()}))
    finally:
        dist.destroy_process_group()


def run_cases(cases: dict, world: int) -> dict:
    """{name: [result of rank 0, result of rank 1, ...]} for every case, from `world` spawned ranks."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(rank, world, port, cases, results)) for rank in range(world)]
    for p in procs:
        p.start()
    out = {name: [None] * world for name in cases}
    pending = world * len(cases)
    deadline = time.monotonic() + TIMEOUT_S
    while pending:
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise TimeoutError(f"Megatron workers gave no result within {TIMEOUT_S} s (a hang in gloo?)")
        try:
            rank, name, result = results.get(timeout=5)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:  # a rank died without reporting (a crash): stop the others and say which
                for p in procs:
                    p.kill()
                raise RuntimeError(f"Megatron worker ranks died (rank, exit code): {dead}")
            continue
        out[name][rank] = result
        pending -= 1
    for p in procs:
        p.join(timeout=60)
    return out
