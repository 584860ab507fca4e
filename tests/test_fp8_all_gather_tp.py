"""The sequence-parallel input all-gather under FP8 moves FP8 bytes plus a scale (issue 15).

2 gloo ranks on the CPU, bf16 parameters. Every all-gather of torch.distributed is wrapped to
record what it sends. Checked per recipe (delayed and current scaling, E4M3 and HYBRID):
  * bytes: the forward's input gather sends half the bytes of the bf16 gather (plus 4 bytes of
    scale_inv under delayed scaling); the bf16 run and FP8 with the 16-bit gather switched back
    on (the bug-on control) send the full bf16 bytes, and the check flags the latter;
  * exactness: the gathered FP8 bytes are exactly torch's float8 cast of the whole (unsharded)
    input with the unsharded model's scale, and the forward equals float64 math on those
    dequantized operands;
  * outputs and gradients match the unsharded single-process module within FP8 tolerance
    (Linear, LayerNormLinear, LayerNormMLP, whose fc1 runs the fused LinearBiasActivation op);
  * memory: the weight gradient keeps this rank's FP8 shard only (1 byte per element of the
    shard), not the gathered input, and nothing is left on the autograd node after backward.
"""

import contextlib

import torch
import torch.distributed as dist

from _gloo_ranks import run_cases

import te_fuser
from te_fuser import recipe
from te_fuser.tensor.float8_tensor import Float8Tensor
from te_fuser.ops import _fp8_gather
from te_fuser.ops.basic import linear as linear_module

WORLD = 2
SEQ, BATCH, HIDDEN, OUT = 32, 2, 64, 64  # FP8 GEMM dims: tokens, features all multiples of 16
DT = torch.bfloat16
SEED = 1234

RECIPES = {
    "delayed-E4M3": lambda: recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, amax_history_len=4),
    "delayed-HYBRID": lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4),
    "current-E4M3": lambda: recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3),
    "current-HYBRID": lambda: recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID),
}
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")


@contextlib.contextmanager
def recorded_gathers():
    """Every all-gather call in the block as (sent dtype, sent bytes, gathered tensor)."""
    calls, originals = [], {name: getattr(dist, name) for name in GATHERS if hasattr(dist, name)}

    def wrap(name, fn):
        def gather(*args, **kwargs):
            out, sent = args[0], args[1]
            result = fn(*args, **kwargs)
            gathered = torch.cat([t.reshape(-1) for t in out]) if name == "all_gather" else out.reshape(-1)
            calls.append((sent.dtype, sent.numel() * sent.element_size(), gathered.clone()))
            return result
        return gather

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def fp8_gather_switch(on: bool):
    previous = linear_module._GATHER_IN_FP8
    linear_module._GATHER_IN_FP8 = on
    try:
        yield
    finally:
        linear_module._GATHER_IN_FP8 = previous


def _autocast(recipe_name):
    if recipe_name is None:
        return contextlib.nullcontext()
    return te_fuser.fp8_autocast(fp8_recipe=RECIPES[recipe_name](), fp8_group=dist.group.WORLD)


def _shard(t, rank, dim=0):
    return t.detach().chunk(WORLD, dim)[rank].contiguous()


def _grad_tol(recipe_name):
    """Relative error allowed between two FP8 gradients whose dy were quantized with different scales:
    E4M3 keeps 3 mantissa bits, HYBRID's backward E5M2 only 2. A gather that mixes up scales or
    rows is off by tens of percent or more."""
    return 0.2 if recipe_name.endswith("HYBRID") else 0.1


def _rel(got, expect):
    return ((got.double() - expect.double()).norm() / expect.double().norm()).item()


# -- the modules: unsharded and sharded, the same parameters -------------------------------------
def _make_linear(rank):
    group = dist.group.WORLD
    full = te_fuser.Linear(HIDDEN, OUT, params_dtype=DT, device="cpu")
    with torch.no_grad():
        full.weight.normal_(0, 0.2), full.bias.normal_(0, 0.5)
    tp = te_fuser.Linear(HIDDEN, OUT, parallel_mode="column", sequence_parallel=True, tp_group=group,
                         params_dtype=DT, device="cpu")
    with torch.no_grad():
        tp.weight.copy_(_shard(full.weight, rank)), tp.bias.copy_(_shard(full.bias, rank))
    grads = lambda m, sharded: [(m.weight.grad, 0), (m.bias.grad, 0)]  # noqa: E731 (dim of each shard)
    return full, tp, grads, "column"


def _make_layernorm_linear(rank):
    group = dist.group.WORLD
    full = te_fuser.LayerNormLinear(HIDDEN, OUT, params_dtype=DT, device="cpu")
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.5, 0.3)
    tp = te_fuser.LayerNormLinear(HIDDEN, OUT, parallel_mode="column", sequence_parallel=True, tp_group=group,
                                  params_dtype=DT, device="cpu")
    with torch.no_grad():
        tp.layer_norm_weight.copy_(full.layer_norm_weight), tp.layer_norm_bias.copy_(full.layer_norm_bias)
        tp.weight.copy_(_shard(full.weight, rank)), tp.bias.copy_(_shard(full.bias, rank))
    grads = lambda m, sharded: [(m.weight.grad, 0), (m.bias.grad, 0),  # noqa: E731
                                (m.layer_norm_weight.grad, None)]
    return full, tp, grads, "column"


def _make_layernorm_mlp(rank):
    group = dist.group.WORLD
    ffn = 2 * HIDDEN
    full = te_fuser.LayerNormMLP(HIDDEN, ffn, params_dtype=DT, device="cpu")
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.2, 0.3)
    tp = te_fuser.LayerNormMLP(HIDDEN, ffn, sequence_parallel=True, tp_group=group, set_parallel_mode=True,
                               params_dtype=DT, device="cpu")
    with torch.no_grad():
        tp.layer_norm_weight.copy_(full.layer_norm_weight), tp.layer_norm_bias.copy_(full.layer_norm_bias)
        tp.fc1_weight.copy_(_shard(full.fc1_weight, rank)), tp.fc1_bias.copy_(_shard(full.fc1_bias, rank))
        tp.fc2_weight.copy_(_shard(full.fc2_weight, rank, 1)), tp.fc2_bias.copy_(full.fc2_bias)
    grads = lambda m, sharded: [(m.fc1_weight.grad, 0), (m.fc1_bias.grad, 0),  # noqa: E731
                                (m.fc2_weight.grad, 1)]
    return full, tp, grads, "row"


MODULES = {"Linear": _make_linear, "LayerNormLinear": _make_layernorm_linear, "LayerNormMLP": _make_layernorm_mlp}


def _step(module, x, dy, recipe_name):
    x = x.detach().requires_grad_()
    with _autocast(recipe_name):
        out = module(x)
    out.backward(dy)
    return out.detach(), x.grad, out


# -- (a) bytes moved -------------------------------------------------------------------------------
def _forward_gather_bytes(module, x, recipe_name):
    """[(dtype, bytes)] of the all-gathers in one forward."""
    with recorded_gathers() as calls:
        with _autocast(recipe_name):
            module(x)
    return [(dtype, nbytes) for dtype, nbytes, _ in calls]


def _bytes_case(rank, module_name, recipe_name):
    torch.manual_seed(SEED)
    _, tp, _, _ = MODULES[module_name](rank)
    x = _shard(torch.randn(SEQ, BATCH, HIDDEN, dtype=DT), rank)
    bf16 = _forward_gather_bytes(tp, x, None)
    fp8 = _forward_gather_bytes(tp, x, recipe_name)
    with fp8_gather_switch(False):
        fp8_16bit = _forward_gather_bytes(tp, x, recipe_name)
    shard_elems = x.numel()
    assert bf16 == [(DT, 2 * shard_elems)], bf16
    data = [nbytes for dtype, nbytes in fp8 if dtype == torch.uint8]
    scales = [nbytes for dtype, nbytes in fp8 if dtype != torch.uint8]
    assert data == [shard_elems], fp8  # one byte per element: half of bf16's gather
    # delayed scaling: the ranks' scale_inv (one float32 each); current scaling shares the scale
    # through the amax all-reduce, so it sends none
    assert scales == ([4] if recipe_name.startswith("delayed") else []), fp8
    assert sum(data) + sum(scales) <= bf16[0][1] // 2 + 4

    def halved(record):
        return sum(n for d, n in record if d == torch.uint8) == bf16[0][1] // 2

    assert halved(fp8)
    # The bug-on control: the 16-bit gather under FP8 sends bf16's bytes, and the check catches it.
    assert fp8_16bit == bf16 and not halved(fp8_16bit), fp8_16bit


def _make_row_linear(rank):
    """Row-parallel Linear under sequence parallelism: its backward all-gathers the output gradient."""
    full = te_fuser.Linear(HIDDEN, OUT, params_dtype=DT, device="cpu")
    with torch.no_grad():
        full.weight.normal_(0, 0.2), full.bias.normal_(0, 0.5)
    tp = te_fuser.Linear(HIDDEN, OUT, parallel_mode="row", sequence_parallel=True, tp_group=dist.group.WORLD,
                         params_dtype=DT, device="cpu")
    with torch.no_grad():
        tp.weight.copy_(_shard(full.weight, rank, 1)), tp.bias.copy_(full.bias)
    return full, tp


def _grad_bytes_case(rank, recipe_name):
    """The backward's gather of the output gradient (row-parallel) in FP8, against bf16's."""
    torch.manual_seed(SEED)
    _, tp = _make_row_linear(rank)
    x = _shard(torch.randn(SEQ, BATCH, HIDDEN, dtype=DT), rank, 2)
    dy = _shard(torch.randn(SEQ, BATCH, OUT, dtype=DT), rank)

    def backward_gather_bytes(recipe):
        with _autocast(recipe):
            out = tp(x)
        with recorded_gathers() as calls:
            out.backward(dy)
        return [(dtype, nbytes) for dtype, nbytes, _ in calls]

    bf16 = backward_gather_bytes(None)
    fp8 = backward_gather_bytes(recipe_name)
    with fp8_gather_switch(False):
        fp8_16bit = backward_gather_bytes(recipe_name)
    assert bf16 == [(DT, 2 * dy.numel())], bf16
    scale = [(torch.float32, 4)] if recipe_name.startswith("delayed") else []
    assert fp8 == scale + [(torch.uint8, dy.numel())], fp8  # half of bf16's, plus the scale_inv
    assert fp8_16bit == bf16, fp8_16bit  # the bug-on control: what the check above refuses


# -- (b) exactness and agreement with the unsharded module --------------------------------------
def _torch_fp8_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """torch's own float8 cast of x * scale, saturated: the independent reference of the bytes."""
    fmax = torch.finfo(fp8_dtype).max
    return (x.float() * scale.float()).clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8)


def _delayed_scales(module):
    """The forward scales (input, weight) a module's next FP8 forward uses under delayed scaling."""
    states = module._ops[0]._fp8_states
    return states[0].scale.clone() if states is not None else torch.ones(2)


def _input_scale(full, recipe_name, x_full):
    """The scale the unsharded Linear quantizes its input with in the next forward."""
    fp8_dtype = RECIPES[recipe_name]().fp8_format.fwd_dtype
    if recipe_name.startswith("delayed"):
        return _delayed_scales(full)[0:1], fp8_dtype
    amax = x_full.float().abs().max().reshape(1)
    return torch.full_like(amax, torch.finfo(fp8_dtype).max) / amax, fp8_dtype


def _linear_exact_case(rank):
    """Linear: two steps per recipe (the second with delayed scales set by the first), checking the
    gathered bytes against torch's cast of the whole input and the forward against float64 math."""
    for recipe_name in RECIPES:
        torch.manual_seed(SEED)
        full, tp, _, _ = _make_linear(rank)
        for step in range(2):
            x_full = torch.randn(SEQ, BATCH, HIDDEN, dtype=DT) * (1 + step)
            x_full[0, 0, 0] = 7.5  # an edge value: the amax, on rank 0's shard
            dy_full = torch.randn(SEQ, BATCH, OUT, dtype=DT)
            scale, fp8_dtype = _input_scale(full, recipe_name, x_full)
            delayed = recipe_name.startswith("delayed")
            tp_scales, full_scales = (_delayed_scales(tp), _delayed_scales(full)) if delayed else (None, None)
            out_full, dx_full, _ = _step(full, x_full, dy_full, recipe_name)
            with recorded_gathers() as calls:
                out_tp, dx_tp, _ = _step(tp, _shard(x_full, rank), _shard(dy_full, rank, 2), recipe_name)
            gathered = [g for dtype, _, g in calls if dtype == torch.uint8]
            assert len(gathered) == 2, [c[:2] for c in calls]  # forward, and the wgrad's in backward
            expect_bytes = _torch_fp8_cast(x_full.reshape(-1), scale, fp8_dtype)
            for g in gathered:
                assert torch.equal(g, expect_bytes), (recipe_name, step, (g != expect_bytes).sum().item())
            # Forward: float64 math on the dequantized operands (the GEMM accumulates in float32
            # and rounds once to bf16).
            w_local = tp.weight.detach()
            if delayed:
                # the amaxes are all-reduced over fp8_group: the unsharded model's scales
                assert torch.equal(tp_scales, full_scales), (tp_scales, full_scales)
                w_scale = tp_scales[1:2]
            else:
                w_scale = torch.full((1,), torch.finfo(fp8_dtype).max) / w_local.float().abs().max()
            x64 = expect_bytes.view(fp8_dtype).double().reshape(-1, HIDDEN) / scale.double()
            w64 = _torch_fp8_cast(w_local, w_scale, fp8_dtype).view(fp8_dtype).double() / w_scale.double()
            ref = (x64 @ w64.t() + tp.bias.detach().double()).reshape(SEQ, BATCH, -1)
            torch.testing.assert_close(out_tp.double(), ref, rtol=2 ** -8, atol=1e-4)
            # Against the unsharded FP8 module: under delayed scaling the same operand bytes, so the
            # same output up to the float32 summation order; under current scaling each rank's
            # weight shard has its own scale (as in TE). Gradients within FP8 tolerance (dy has
            # its own scale per rank under current scaling, the dgrad sums the ranks' parts).
            assert _rel(out_tp, _shard(out_full, rank, 2)) < (2 ** -7 if delayed else 0.05), recipe_name
            assert _rel(dx_tp, _shard(dx_full, rank)) < _grad_tol(recipe_name), recipe_name
            assert _rel(tp.weight.grad, _shard(full.weight.grad, rank)) < _grad_tol(recipe_name), recipe_name
            assert _rel(tp.bias.grad, _shard(full.bias.grad, rank)) < 1e-2, recipe_name
            full.zero_grad(), tp.zero_grad()


def _row_exact_case(rank):
    """Row-parallel Linear: the gathered output-gradient bytes are torch's cast of the whole dy with
    the scale of the whole dy (current scaling; delayed: of the last step's whole dy), and dgrad / wgrad equal float64 math on the dequantized
    operands (float32 accumulation, one rounding)."""
    for recipe_name in RECIPES:
        torch.manual_seed(SEED)
        _, tp = _make_row_linear(rank)
        fmt = RECIPES[recipe_name]().fp8_format
        delayed = recipe_name.startswith("delayed")
        expect_dy_scale = torch.ones(1)  # delayed scaling's first step
        for step in range(2):
            x_full = torch.randn(SEQ, BATCH, HIDDEN, dtype=DT)
            dy_full = torch.randn(SEQ, BATCH, OUT, dtype=DT) * (1 + step)
            dy_full[-1, -1, -1] = -9.0  # an edge value: the amax, on rank 1's shard
            x = _shard(x_full, rank, 2).requires_grad_()
            forward_scales = _delayed_scales(tp) if delayed else None  # (input, weight), before the update
            with _autocast(recipe_name):
                out = tp(x)
            if delayed:  # the scale this backward uses: the last step's dy amax, reduced over the ranks
                dy_scale = tp._ops[0]._fp8_states[1].scale[0:1].clone()
                assert torch.equal(dy_scale, expect_dy_scale), (dy_scale, expect_dy_scale)
                expect_dy_scale = torch.full((1,), fmt.max_bwd) / dy_full.float().abs().max()
                x_scale = forward_scales[0:1]
            else:
                dy_scale = torch.full((1,), fmt.max_bwd) / dy_full.float().abs().max()
                x_scale = torch.full((1,), fmt.max_fwd) / x.detach().float().abs().max()
            with recorded_gathers() as calls:
                out.backward(_shard(dy_full, rank))
            gathered = [g for dtype, _, g in calls if dtype == torch.uint8]
            dy_bytes = _torch_fp8_cast(dy_full.reshape(-1), dy_scale, fmt.bwd_dtype)
            assert len(gathered) == 1 and torch.equal(gathered[0], dy_bytes), recipe_name
            dy64 = dy_bytes.view(fmt.bwd_dtype).double().reshape(-1, OUT) / dy_scale.double()
            x64 = (_torch_fp8_cast(x.detach(), x_scale, fmt.fwd_dtype).view(fmt.fwd_dtype).double()
                   .reshape(-1, HIDDEN // WORLD) / x_scale.double())
            w_local = tp.weight.detach()
            if delayed:
                w_scale = forward_scales[1:2]
            else:
                w_scale = torch.full((1,), fmt.max_fwd) / w_local.float().abs().max()
            w64 = _torch_fp8_cast(w_local, w_scale, fmt.fwd_dtype).view(fmt.fwd_dtype).double() / w_scale.double()
            tol = dict(rtol=2 ** -8, atol=1e-4)
            torch.testing.assert_close(x.grad.double().reshape(-1, HIDDEN // WORLD), dy64 @ w64, **tol)
            torch.testing.assert_close(tp.weight.grad.double(), dy64.t() @ x64, **tol)
            tp.zero_grad()


def _module_case(rank, module_name, recipe_name):
    """Outputs and gradients of the sharded module against the unsharded one (FP8 tolerance), and
    against the bf16 module (a bound a wrong gather, e.g. one with mismatched scales, breaks)."""
    group = dist.group.WORLD
    torch.manual_seed(SEED)
    full, tp, grads, out_split = MODULES[module_name](rank)
    for step in range(2):
        x_full = torch.randn(SEQ, BATCH, HIDDEN, dtype=DT)
        if step:  # rank 1's shard gets the larger amax, also after a norm: an outlier feature
            x_full[SEQ // 2:] *= 4
            x_full[SEQ // 2:, :, 0] += 60
        dy_shape = (SEQ, BATCH, OUT if module_name != "LayerNormMLP" else HIDDEN)
        dy_full = torch.randn(dy_shape, dtype=DT)
        out_full, dx_full, _ = _step(full, x_full, dy_full, recipe_name)
        dy_local = _shard(dy_full, rank, 2) if out_split == "column" else _shard(dy_full, rank)
        out_tp, dx_tp, out_node = _step(tp, _shard(x_full, rank), dy_local, recipe_name)
        expect_out = _shard(out_full, rank, 2) if out_split == "column" else _shard(out_full, rank)
        assert _rel(out_tp, expect_out) < 0.05, (module_name, recipe_name, step)
        assert _rel(dx_tp, _shard(dx_full, rank)) < _grad_tol(recipe_name), (module_name, recipe_name, step)
        for (g_full, dim), (g_tp, _) in zip(grads(full, False), grads(tp, True)):
            if dim is None:  # a replicated parameter: partial gradients, summed by the framework
                dist.all_reduce(g_tp, group=group)
                expect = g_full
            else:
                expect = _shard(g_full, rank, dim)
            assert _rel(g_tp, expect) < _grad_tol(recipe_name), (module_name, recipe_name, step, dim)
        # ctx discipline: the fuser dropped everything it kept for backward
        assert out_node.grad_fn.state is None
        full.zero_grad(), tp.zero_grad()


# -- memory: what the weight gradient keeps ----------------------------------------------------------
def _saved_case(rank, recipe_name):
    torch.manual_seed(SEED)
    _, tp, _, _ = _make_linear(rank)
    x = _shard(torch.randn(SEQ, BATCH, HIDDEN, dtype=DT), rank).requires_grad_()

    def saved_input_bytes(fp8_gather):
        saved = []
        with fp8_gather_switch(fp8_gather), _autocast(recipe_name):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = tp(x)
        out.backward(torch.ones_like(out))
        # FP8 bytes saved: the input's and the weight's transposed copy (for the dgrad)
        return sum(t.numel() for t in saved if t.element_size() == 1)

    kept = saved_input_bytes(True)
    # The shard (1 byte per element), not the gathered input ...
    assert kept == x.numel() + tp.weight.numel(), kept
    # ... which the 16-bit gather kept (transposed): WORLD times as much, and the check sees it.
    assert saved_input_bytes(False) == WORLD * x.numel() + tp.weight.numel()


def _save_original_input_case(rank, recipe_name):
    """save_original_input (current scaling only, as in TE): the wgrad keeps the high-precision
    shard and quantizes it again in backward with the group's amax, so the backward gathers the
    very bytes the forward gathered, in FP8."""
    torch.manual_seed(SEED)
    full, tp, _, _ = _make_linear(rank)
    tp.save_original_input = True
    x_full = torch.randn(SEQ, BATCH, HIDDEN, dtype=DT)
    x_full[SEQ // 2:] *= 4  # rank 1 holds the amax
    dy_full = torch.randn(SEQ, BATCH, OUT, dtype=DT)
    _, dx_full, _ = _step(full, x_full, dy_full, recipe_name)
    with recorded_gathers() as calls:
        _, dx_tp, out = _step(tp, _shard(x_full, rank), _shard(dy_full, rank, 2), recipe_name)
    assert [c[:2] for c in calls] == [(torch.uint8, x_full.numel() // WORLD)] * 2, [c[:2] for c in calls]
    assert torch.equal(calls[0][2], calls[1][2])
    assert _rel(dx_tp, _shard(dx_full, rank)) < _grad_tol(recipe_name)
    assert _rel(tp.weight.grad, _shard(full.weight.grad, rank)) < _grad_tol(recipe_name)
    assert out.grad_fn.state is None


# -- delayed scaling without fp8_group: the ranks' scales differ -----------------------------------
def _scale_mismatch_case(rank):
    group = dist.group.WORLD
    e4m3 = torch.float8_e4m3fn
    torch.manual_seed(SEED)
    x_full = torch.randn(SEQ * BATCH, HIDDEN, dtype=DT) * 3
    # Rank 1's scale is larger (its scale_inv smaller), not by a power of 2, so its requantized
    # codes differ from its own; neither saturates (|x| < 18).
    scales = (torch.tensor([16.0]), torch.tensor([24.0]))
    amax = torch.zeros(1)
    quantizer = te_fuser.tensor.float8_tensor.Float8Quantizer(scales[rank].clone(), amax, e4m3, columnwise=False)
    shard = _fp8_gather.quantize_shard(_shard(x_full, rank), quantizer, group)
    assert amax.item() == _shard(x_full, rank).float().abs().max().item()  # this shard's amax recorded
    gathered = _fp8_gather.all_gather_fp8_dim0(shard, group)
    # The common scale is the smaller one (no shard overflows it).
    assert isinstance(gathered, Float8Tensor) and gathered._scale_inv.item() == 1 / 16
    got = gathered._data.view(torch.uint8).reshape(WORLD, -1)
    # Rank 0's shard had that scale already: torch's direct cast, byte for byte.
    assert torch.equal(got[0], _torch_fp8_cast(_shard(x_full, 0), scales[0], e4m3).reshape(-1))
    # Rank 1's shard: cast at its own scale, dequantized, cast again at the common one.
    own = _torch_fp8_cast(_shard(x_full, 1), scales[1], e4m3).view(e4m3).float() * torch.reciprocal(scales[1])
    requantized = _torch_fp8_cast(own, scales[0], e4m3).reshape(-1)
    assert torch.equal(got[1], requantized)
    assert not torch.equal(got[1], _torch_fp8_cast(_shard(x_full, 1), scales[0], e4m3).reshape(-1))
    # Two roundings: within one E4M3 step (2^-3 relative) of the values.
    values = gathered.fp8_data.double() * gathered._scale_inv.double()
    rel = (values.reshape(x_full.shape) - x_full.double()).abs() / x_full.double().abs().clamp(min=2 ** -6)
    assert rel.max() <= 2 ** -3, rel.max()


def test_fp8_all_gather_bytes_halved():
    run_cases([(_bytes_case, m, r) for m in MODULES for r in RECIPES] + [(_grad_bytes_case, r) for r in RECIPES],
              world=WORLD)


def test_fp8_all_gather_exact_and_matches_unsharded():
    cases = [(_linear_exact_case,), (_row_exact_case,), (_scale_mismatch_case,)]
    cases += [(_saved_case, r) for r in RECIPES]
    cases += [(_save_original_input_case, r) for r in RECIPES if r.startswith("current")]
    cases += [(_module_case, m, r) for m in MODULES for r in RECIPES]
    run_cases(cases, world=WORLD)
