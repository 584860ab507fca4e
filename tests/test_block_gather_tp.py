"""The sequence-parallel all-gathers under the block-scaled recipes move the quantized bytes (issue 31).

2 gloo ranks on the CPU, bf16 parameters. MXFP8BlockScaling, Float8BlockScaling (1x128 tiles) and
NVFP4BlockScaling gather each rank's quantized shard, data and scales (ops/_block_gather.py, as TE's
distributed.py; NVFP4's shards quantized under the group's amaxes, its stochastically rounded gradients gathered
in high precision). Checked:
  * the helper: the gathered tensor is bitwise the quantization of the gathered high-precision tensor, every
    buffer, rowwise for any shard size and columnwise for shards of whole blocks (edge values: a zero block,
    an outlier, tiny values, ragged columns); NVFP4 shards under their own amaxes (the bug-on control) are
    refused by the gather;
  * modules (Linear column and row, LayerNormLinear, LayerNormMLP): outputs and gradients bitwise those of
    the same module gathering in high precision (the bug-on switch); column-parallel outputs and weight
    gradients bitwise the single-process module's; everything within the single-process module's own
    quantization error of its bf16 result (each recipe's TP run differs from the single-process one only by
    the sums of the row-parallel halves and, under NVFP4, each shard's own global scale);
  * bytes: each gather sends one byte per element plus the scales, half of bf16's (NVFP4: half a byte and an
    E4M3 scale per 16 elements, under 0.3x); the high-precision switch
    (the bug-on control) sends bf16's bytes and the check flags it; a shard whose rows split a columnwise block
    gathers in high precision, and its rowwise-only gather still in low precision;
  * 4 ranks as two strided TP groups of 2: each group gathers its own shards, bitwise as above;
  * memory: the column-parallel wgrad keeps this rank's columnwise shard (its bytes), not the gathered input;
    nothing stays on the autograd node after backward.
"""

import pytest
import torch
import torch.distributed as dist

from _gloo_ranks import run_cases
from test_fp8_all_gather_tp import fp8_gather_switch, recorded_gathers

import te_fuser
from te_fuser import recipe
from te_fuser.ops._block_gather import all_gather_rows, gathers_low_precision, quantize_rows
from te_fuser.tensor.float8_blockwise_tensor import Float8BlockQuantizer
from te_fuser.tensor.mxfp8_tensor import MXFP8Quantizer
from te_fuser.tensor.nvfp4_tensor import NVFP4Quantizer

WORLD = 2
SEQ, BATCH, HIDDEN, OUT = 128, 2, 256, 256  # 128 tokens a rank: whole 32- and 128-row blocks
DT = torch.bfloat16
SEED = 31

RECIPES = {
    "mxfp8": recipe.MXFP8BlockScaling,
    "block": recipe.Float8BlockScaling,
    "block_fp32_scales": lambda: recipe.Float8BlockScaling(fp8_quant_fwd_inp=recipe.QParams(False, 1e-3),
                                                           fp8_quant_bwd_grad=recipe.QParams(False)),
    "nvfp4": recipe.NVFP4BlockScaling,
}
LOW_PRECISION = {"mxfp8": True, "block": True, "block_fp32_scales": True, "nvfp4": True}
# (bytes of a scale, elements of a block: along a row rowwise, along a column columnwise): E8M0 1 byte a 32,
# float32 4 bytes a 128
SCALES = {"mxfp8": (1, 32), "block": (4, 128), "block_fp32_scales": (4, 128)}


def _shard(t, rank, dim=0):
    return t.detach().chunk(WORLD, dim)[rank].contiguous()


def _rel(got, expect):
    return ((got.double() - expect.double()).norm() / expect.double().norm()).item()


def _buffers(t):
    return {name: getattr(t, name) for name in t._BUFFERS}


def _assert_same_bytes(got, want, what):
    assert type(got) is type(want) and got.shape == want.shape, what
    for name, b in _buffers(want).items():
        g = getattr(got, name)
        assert (g is None) == (b is None), (what, name)
        if b is not None:
            assert g.shape == b.shape and torch.equal(g.view(torch.uint8), b.view(torch.uint8)), (what, name)


# -- the helper: gathered bytes = the whole tensor's quantization ------------------------------------------
def _edge_input(rows, cols):
    x = torch.randn(rows, cols, dtype=DT)
    x[:32, :32] = 0  # a zero block (scale of an all-zero block)
    x[rows // 2 + 3, 5] = 3e4  # an outlier on rank 1's shard, in a block of ordinary values
    x[-32:, -40:] *= 1e-30  # tiny values: the smallest scales
    return x


def _helper_case(rank):
    group = dist.group.WORLD
    quantizers = [lambda: MXFP8Quantizer(torch.float8_e4m3fn), lambda: MXFP8Quantizer(torch.float8_e5m2),
                  lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1),
                  lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1,
                                               force_pow_2_scales=False, amax_epsilon=1e-3),
                  lambda: NVFP4Quantizer(with_rht=True), NVFP4Quantizer]
    for make in quantizers:
        for rows, cols, columnwise in ((512, 200, True), (512, 256, True), (2 * 24, 200, False), (2 * 7, 33, False)):
            torch.manual_seed(SEED)
            x = _edge_input(rows, cols)
            shard = _shard(x, rank)
            assert gathers_low_precision(make(), shard, columnwise)
            got = all_gather_rows(quantize_rows(shard, make(), rowwise=True, columnwise=columnwise, group=group),
                                  group)
            want = quantize_rows(x, make(), rowwise=True, columnwise=columnwise)
            _assert_same_bytes(got, want, (make(), rows, cols, columnwise))
    # NVFP4 under each shard's own amax (the bug-on control: no reduction): the shard holding the outlier has a
    # larger global scale than the other's, which the gather refuses (one tensor holds one amax).
    torch.manual_seed(SEED)
    x = _edge_input(512, 256)
    with pytest.raises(RuntimeError, match="hold different _amax_rowwise"):
        all_gather_rows(NVFP4Quantizer(with_rht=True)(_shard(x, rank)), group)
    # A columnwise block split by the shards, NVFP4's stochastic rounding (each element's bits depend on its place
    # in the whole tensor) and 2-D blocks (16x16, 128x128): high precision.
    shard = torch.randn(24, 64, dtype=DT)
    assert not gathers_low_precision(MXFP8Quantizer(torch.float8_e4m3fn), shard, True)
    assert not gathers_low_precision(NVFP4Quantizer(with_rht=True), shard, True)
    assert not gathers_low_precision(Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True,
                                                          block_scaling_dim=1), torch.randn(64, 64), True)
    assert not gathers_low_precision(NVFP4Quantizer(stochastic_rounding=True), torch.randn(64, 64), False)
    assert not gathers_low_precision(NVFP4Quantizer(with_2d_quantization=True), torch.randn(64, 64), False)
    assert not gathers_low_precision(Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=False,
                                                          block_scaling_dim=2), torch.randn(128, 128), False)


# -- the modules: unsharded and sharded, the same parameters ---------------------------------------------
def _make_linear(rank, mode="column", group=None):
    full = te_fuser.Linear(HIDDEN, OUT, params_dtype=DT, device="cpu")
    with torch.no_grad():
        full.weight.normal_(0, 0.1), full.bias.normal_(0, 0.5)
    tp = te_fuser.Linear(HIDDEN, OUT, parallel_mode=mode, sequence_parallel=True,
                         tp_group=group or dist.group.WORLD, params_dtype=DT, device="cpu")
    with torch.no_grad():
        if mode == "column":
            tp.weight.copy_(_shard(full.weight, rank)), tp.bias.copy_(_shard(full.bias, rank))
        else:
            tp.weight.copy_(_shard(full.weight, rank, 1)), tp.bias.copy_(full.bias)
    return full, tp


def _make_layernorm_linear(rank):
    full = te_fuser.LayerNormLinear(HIDDEN, OUT, params_dtype=DT, device="cpu")
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.1, 0.1)
    tp = te_fuser.LayerNormLinear(HIDDEN, OUT, parallel_mode="column", sequence_parallel=True,
                                  tp_group=dist.group.WORLD, params_dtype=DT, device="cpu")
    with torch.no_grad():
        tp.layer_norm_weight.copy_(full.layer_norm_weight), tp.layer_norm_bias.copy_(full.layer_norm_bias)
        tp.weight.copy_(_shard(full.weight, rank)), tp.bias.copy_(_shard(full.bias, rank))
    return full, tp


def _make_layernorm_mlp(rank):
    ffn = 2 * HIDDEN
    full = te_fuser.LayerNormMLP(HIDDEN, ffn, params_dtype=DT, device="cpu")
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0.05, 0.1)
    tp = te_fuser.LayerNormMLP(HIDDEN, ffn, sequence_parallel=True, tp_group=dist.group.WORLD,
                               set_parallel_mode=True, params_dtype=DT, device="cpu")
    with torch.no_grad():
        tp.layer_norm_weight.copy_(full.layer_norm_weight), tp.layer_norm_bias.copy_(full.layer_norm_bias)
        tp.fc1_weight.copy_(_shard(full.fc1_weight, rank)), tp.fc1_bias.copy_(_shard(full.fc1_bias, rank))
        tp.fc2_weight.copy_(_shard(full.fc2_weight, rank, 1)), tp.fc2_bias.copy_(full.fc2_bias)
    return full, tp


# name: (maker, output split dim (None: sequence-sharded), {parameter: shard dim (None: replicated)}, column-exact)
MODULES = {
    "Linear": (_make_linear, 2, {"weight": 0, "bias": 0}, ("weight", "bias")),
    "RowLinear": (lambda rank: _make_linear(rank, "row"), None, {"weight": 1, "bias": None}, ()),
    "LayerNormLinear": (_make_layernorm_linear, 2, {"weight": 0, "bias": 0, "layer_norm_weight": None,
                                                     "layer_norm_bias": None}, ("weight", "bias")),
    "LayerNormMLP": (_make_layernorm_mlp, None, {"fc1_weight": 0, "fc1_bias": 0, "fc2_weight": 1, "fc2_bias": None,
                                                 "layer_norm_weight": None, "layer_norm_bias": None}, ()),
}


def _step(module, x, dy, recipe_name, seed=SEED):
    """(out, dx, {name: grad}, out) of one forward and backward; seeded (NVFP4's stochastic rounding)."""
    torch.manual_seed(seed)
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with te_fuser.fp8_autocast(enabled=recipe_name is not None,
                               fp8_recipe=RECIPES[recipe_name]() if recipe_name else None):
        out = module(x)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}, out


def _module_case(rank, module_name, recipe_name):
    group = dist.group.WORLD
    make, out_dim, param_dims, column_exact = MODULES[module_name]
    torch.manual_seed(SEED)
    full, tp = make(rank)
    x_full = torch.randn(SEQ, BATCH, HIDDEN, dtype=DT)
    x_full[SEQ // 2:] *= 4  # rank 1's shard holds the larger values
    x_full[SEQ // 2 + 1, 0, 7] = 40.0
    out_features = HIDDEN if module_name == "LayerNormMLP" else OUT
    dy_full = torch.randn(SEQ, BATCH, out_features, dtype=DT)
    row = module_name == "RowLinear"  # its input: the whole sequence, split along the features

    def local_input(t):
        return _shard(t, rank, 2) if row else _shard(t, rank)

    dy = _shard(dy_full, rank, 2) if out_dim == 2 else _shard(dy_full, rank)
    x_local = local_input(x_full)

    out, dx, grads, node = _step(tp, x_local, dy, recipe_name)
    assert node.grad_fn.state is None  # the fuser kept nothing on its node after backward
    with fp8_gather_switch(False):  # the same module gathering high precision
        out_hp, dx_hp, grads_hp, _ = _step(tp, x_local, dy, recipe_name)
    assert torch.equal(out, out_hp) and torch.equal(dx, dx_hp), (module_name, recipe_name)
    for name, g in grads.items():
        assert torch.equal(g, grads_hp[name]), (module_name, recipe_name, name)

    for name in param_dims:  # replicated parameters see this rank's tokens: partial gradients, summed
        if param_dims[name] is None:
            dist.all_reduce(grads[name], group=group)
    out_q, dx_q, grads_q, _ = _step(full, x_full, dy_full, recipe_name)
    out_bf16, dx_bf16, grads_bf16, _ = _step(full, x_full, dy_full, None)

    def local(t, dim):
        return t if dim is None else _shard(t, rank, dim)

    pairs = [("out", out, local(out_q, out_dim or 0), local(out_bf16, out_dim or 0)),
             ("dgrad", dx, local_input(dx_q), local_input(dx_bf16))]
    pairs += [(name, grads[name], local(grads_q[name], dim), local(grads_bf16[name], dim))
              for name, dim in param_dims.items()]
    for name, got, want, ref in pairs:
        if recipe_name != "nvfp4" and (name == "out" and out_dim == 2 or name in column_exact):
            assert torch.equal(got, want), (module_name, recipe_name, name, (got - want).abs().max())
        # within the single-process module's own quantization error of its bf16 result
        assert _rel(got, ref) < 2 * _rel(want, ref) + 0.01, (module_name, recipe_name, name, _rel(got, ref),
                                                            _rel(want, ref))


# -- bytes moved ---------------------------------------------------------------------------------------------
def _sent(calls):
    return [nbytes for _, nbytes, _ in calls]


def _bytes_case(rank, recipe_name):
    torch.manual_seed(SEED)
    _, column = _make_linear(rank)
    _, row = _make_linear(rank, "row")
    x = torch.randn(SEQ // WORLD, BATCH, HIDDEN, dtype=DT)
    rows, elems = SEQ // WORLD * BATCH, x.numel()
    per_scale, col_block = SCALES.get(recipe_name, (None, None))

    def gathers(module, inp, recipe, low_precision):
        with fp8_gather_switch(low_precision):
            inp = inp.clone().requires_grad_()
            with recorded_gathers() as forward:
                with te_fuser.fp8_autocast(fp8_recipe=RECIPES[recipe]()):
                    out = module(inp)
            with recorded_gathers() as backward:
                out.backward(torch.ones_like(out))
        return forward, backward

    forward, backward = gathers(column, x, recipe_name, True)
    forward_hp, backward_hp = gathers(column, x, recipe_name, False)
    dy = SEQ // WORLD * BATCH * OUT
    x_row = torch.randn(SEQ, BATCH, HIDDEN // WORLD, dtype=DT)  # the whole sequence, this rank's features
    row_forward, row_backward = gathers(row, x_row, recipe_name, True)
    _, row_backward_hp = gathers(row, x_row, recipe_name, False)
    # the bug-on control: bf16's bytes, which the checks below refuse (the whole input then kept for the wgrad:
    # no second gather)
    assert _sent(forward_hp) == [2 * elems] and not backward_hp, (forward_hp, backward_hp)
    assert _sent(row_backward_hp) == [2 * dy] and not row_forward, (row_backward_hp, row_forward)
    if recipe_name == "nvfp4":  # a byte per two elements, an E4M3 scale per 16, the 4-byte global amax
        assert sorted(_sent(forward)) == sorted([elems // 2, rows * HIDDEN // 16, 4]), forward
        assert sorted(_sent(backward)) == sorted([elems // 2, HIDDEN * rows // 16, 4]), backward
        assert all(dtype == torch.uint8 for dtype, _, _ in forward + backward)
        assert sum(_sent(forward)) < sum(_sent(forward_hp)) * 0.3
        # the output gradient's quantizer rounds stochastically: gathered in bf16
        assert _sent(row_backward) == [2 * dy], row_backward
        return
    rowwise_scales = rows * -(-HIDDEN // col_block) * per_scale
    columnwise_scales = rows // col_block * HIDDEN * per_scale
    # forward: the rowwise data and scales; backward: the saved shard's columnwise data and scales
    assert sorted(_sent(forward)) == sorted([elems, rowwise_scales]), forward
    assert sorted(_sent(backward)) == sorted([elems, columnwise_scales]), backward
    assert all(dtype == torch.uint8 for dtype, _, _ in forward + backward)
    # row-parallel backward: dy in both usages (dgrad rowwise, wgrad columnwise)
    dy_rows = SEQ // WORLD * BATCH
    assert sorted(_sent(row_backward)) == sorted(
        [dy, dy, dy_rows * -(-OUT // col_block) * per_scale, dy_rows // col_block * OUT * per_scale])

    def low(calls, data_elems):  # what the checks above demand: about half of bf16's bytes
        return sum(_sent(calls)) <= data_elems * (1 + per_scale / col_block) + 4 * data_elems // 32

    assert low(forward, elems) and low(backward, elems) and not low(forward_hp, elems)
    # The output gradient goes in both usages (dgrad, wgrad), as in TE: one byte per element each, as many bytes
    # as bf16's gather, but the quantized ones (the control sends bf16 values).
    def quantized(calls):
        return all(dtype == torch.uint8 for dtype, _, _ in calls)

    assert quantized(row_backward) and not quantized(row_backward_hp)


def _unaligned_case(rank, recipe_name):
    """A shard of 24 tokens splits a columnwise block (32 / 128 rows): with the wgrad, high precision (and the
    same results); without it (frozen weight), the rowwise bytes alone."""
    torch.manual_seed(SEED)
    _, tp = _make_linear(rank)
    x = torch.randn(12, 2, HIDDEN, dtype=DT)
    dy = torch.randn(WORLD * 12, 2, OUT // WORLD, dtype=DT)
    with recorded_gathers() as calls:
        out, dx, grads, _ = _step(tp, x, dy, recipe_name)
    assert _sent(calls) == [2 * x.numel()], calls  # the forward's, high precision; nothing regathered
    with fp8_gather_switch(False):
        out_hp, dx_hp, grads_hp, _ = _step(tp, x, dy, recipe_name)
    assert torch.equal(out, out_hp) and torch.equal(dx, dx_hp) and torch.equal(grads["weight"], grads_hp["weight"])
    tp.weight.requires_grad_(False)
    with recorded_gathers() as calls:
        _step(tp, x, dy, recipe_name)
    assert calls and x.numel() in _sent(calls) and 2 * x.numel() not in _sent(calls), calls


# -- memory: what the column-parallel wgrad keeps ----------------------------------------------------------
def _saved_case(rank, recipe_name):
    torch.manual_seed(SEED)
    _, tp = _make_linear(rank)
    x = torch.randn(SEQ // WORLD, BATCH, HIDDEN, dtype=DT).requires_grad_()

    def saved_bytes(low_precision):
        saved = []
        with fp8_gather_switch(low_precision), te_fuser.fp8_autocast(fp8_recipe=RECIPES[recipe_name]()):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = tp(x)
        out.backward(torch.ones_like(out))
        return sum(t.numel() * t.element_size() for t in saved)

    x_shard, x_whole = x.detach().reshape(-1, HIDDEN), torch.cat([x.detach()] * WORLD).reshape(-1, HIDDEN)

    def columnwise_bytes(t):
        q = {"mxfp8": lambda: MXFP8Quantizer(torch.float8_e4m3fn), "nvfp4": lambda: NVFP4Quantizer(with_rht=True),
             "block": lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True,
                                                   block_scaling_dim=1)}[recipe_name]()
        q.set_usage(rowwise=False, columnwise=True)
        qt = q(t)
        return sum(b.numel() * b.element_size() for b in (qt._columnwise_data, qt._columnwise_scale_inv))

    kept, kept_hp = saved_bytes(True), saved_bytes(False)
    # the shard's columnwise bytes, not the gathered input's: the difference is (WORLD - 1) shards' worth
    assert kept_hp - kept == columnwise_bytes(x_whole) - columnwise_bytes(x_shard), (kept, kept_hp)
    per_element = 0.5 if recipe_name == "nvfp4" else 1  # NVFP4: two values a byte
    assert kept_hp - kept >= (WORLD - 1) * x_shard.numel() * per_element


def _subgroup_case(rank):
    """4 ranks as two TP groups of 2, strided ((0, 2), (1, 3)): a group's rank is not the global one. Each
    group gathers its own shards (each replica its own data): bitwise the group's whole tensor quantized, and
    a column-parallel Linear bitwise the single-process one (output, weight gradient) and its high-precision
    gather's."""
    groups = [dist.new_group(list(ranks)) for ranks in ((0, 2), (1, 3))]
    replica, group = rank % 2, groups[rank % 2]
    g = dist.get_rank(group)
    for name in ("mxfp8", "block"):
        torch.manual_seed(SEED + replica)
        full, tp = _make_linear(g, group=group)
        x_full = _edge_input(SEQ * BATCH, HIDDEN).reshape(SEQ, BATCH, HIDDEN)
        dy_full = torch.randn(SEQ, BATCH, OUT, dtype=DT)
        make = (lambda: MXFP8Quantizer(torch.float8_e4m3fn)) if name == "mxfp8" else (
            lambda: Float8BlockQuantizer(torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=1))
        got = all_gather_rows(quantize_rows(_shard(x_full, g), make(), rowwise=True, columnwise=True), group)
        _assert_same_bytes(got, quantize_rows(x_full, make(), rowwise=True, columnwise=True), (name, rank))
        out, dx, grads, _ = _step(tp, _shard(x_full, g), _shard(dy_full, g, 2), name)
        with fp8_gather_switch(False):
            out_hp, dx_hp, grads_hp, _ = _step(tp, _shard(x_full, g), _shard(dy_full, g, 2), name)
        out_q, _, grads_q, _ = _step(full, x_full, dy_full, name)
        assert torch.equal(out, out_hp) and torch.equal(dx, dx_hp) and torch.equal(grads["weight"],
                                                                                   grads_hp["weight"])
        assert torch.equal(out, _shard(out_q, g, 2)) and torch.equal(grads["weight"], _shard(grads_q["weight"], g))


def _save_original_input_case(rank, recipe_name):
    """save_original_input: the wgrad keeps the high-precision shard, quantizes its columnwise usage in backward
    and gathers those bytes (not bf16's); results bitwise the high-precision gather's."""
    torch.manual_seed(SEED)
    _, tp = _make_linear(rank)
    tp.save_original_input = True
    x = torch.randn(SEQ // WORLD, BATCH, HIDDEN, dtype=DT)
    dy = torch.randn(SEQ, BATCH, OUT // WORLD, dtype=DT)
    with recorded_gathers() as calls:
        out, dx, grads, _ = _step(tp, x, dy, recipe_name)
    with fp8_gather_switch(False), recorded_gathers() as calls_hp:
        out_hp, dx_hp, grads_hp, _ = _step(tp, x, dy, recipe_name)
    assert torch.equal(out, out_hp) and torch.equal(dx, dx_hp) and torch.equal(grads["weight"], grads_hp["weight"])
    per_scale, col_block = SCALES[recipe_name]
    rows = x.numel() // HIDDEN
    assert sorted(_sent(calls)) == sorted([x.numel(), rows * HIDDEN // col_block * per_scale,
                                           x.numel(), rows // col_block * HIDDEN * per_scale]), calls
    assert _sent(calls_hp) == [2 * x.numel()] * 2  # the control: bf16 forward and backward


def test_gathered_bytes_are_the_whole_tensors_quantization():
    run_cases([(_helper_case,)], world=WORLD)


def test_modules_match_the_high_precision_gather_and_the_single_process_module():
    run_cases([(_module_case, module, recipe_name) for module in MODULES for recipe_name in RECIPES], world=WORLD)


def test_gathers_send_the_quantized_bytes():
    run_cases([(_bytes_case, name) for name in RECIPES] + [(_unaligned_case, name) for name in ("mxfp8", "block")]
              + [(_saved_case, name) for name in ("mxfp8", "block", "nvfp4")]
              + [(_save_original_input_case, name) for name in ("mxfp8", "block")], world=WORLD)


def test_gathers_on_tensor_parallel_subgroups():
    run_cases([(_subgroup_case,)], world=4)
