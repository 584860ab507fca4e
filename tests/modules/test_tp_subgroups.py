"""Tensor parallelism on subgroups: 4 gloo ranks as 2 data-parallel replicas x 2 tensor-parallel
ranks, in two arrangements, TP groups {0,1},{2,3} ("blocks") and {0,2},{1,3} ("strided"), so a
rank's group rank differs from its global rank. Each replica runs on its own data.

Every TP collective of te_fuser runs on the subgroup, against float64 math of the unsharded layer:
  * all-gather, reduce-scatter (gloo: all-reduce, then the group rank's chunk) and all-reduce
    (ops/_tensor_parallel.py) through Linear (column, row), LayerNormLinear (with its gathered norm
    output, whose gradient is reduce-scattered) and LayerNormMLP, sequence parallel on and off, FP8
    off, current scaling and delayed scaling: outputs and every gradient;
  * the FP8 all-gathers (ops/_fp8_gather.py): under current scaling the amax all-reduced over the
    group and the gathered bytes, checked exactly (float64 math on torch's FP8 casts with the
    group's scale); the scale_inv all-gather and requantization (delayed scaling without
    fp8_group, second step); the delayed-scaling amax reduction over fp8_group;
  * checkpoint(distribute_saved_activations=True, tp_group=...): the kept chunk and its all-gather.
Every module with set_tensor_parallel_group() (Linear, LayerNormLinear, LayerNormMLP,
MultiheadAttention, TransformerLayer, GroupedLinear) is also built with tp_group=None and tp_size
and given the group afterwards (Megatron's deferred path): its outputs and gradients must equal,
bit for bit, those of the module built with the group.

Bugs planted to check the tests (each made the test fail; reverted):
  * ops/_tensor_parallel.py, reduce_scatter_dim0's gloo branch keeping the global rank's chunk,
    `x.chunk(size)[dist.get_rank()]`: ranks 2 and 3 fail (IndexError) in every sequence-parallel
    case and the exact FP8 case.
  * module/layernorm_linear.py, set_tensor_parallel_group without the line
    `self._linear_op.tensor_parallel_group = tp_group`: every deferred LayerNormLinear case fails,
    and the TransformerLayer ones (their layernorm_qkv): on BasicLinear's refusal to run without
    its group; without that refusal, on the dgrad that is not all-reduced ("dgrad differs") and
    the input that is not gathered.
  * ops/_fp8_gather.py, quantize_shard's amax all-reduce without group= (over all 4 ranks): the
    exact FP8 case fails on replica 0 (its input is cast with replica 1's scale).
  * distributed.py, _split_for_rank with `torch.distributed.get_rank()`: the checkpoint case fails.
  * ops/basic/linear.py without the check of the group's size: the refusal test fails for each module.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import te_fuser
from te_fuser import recipe
from te_fuser.distributed import checkpoint

import layer_reference
from _gloo_ranks import run_cases
from _module_checks import assert_close64
from fp8_torch_reference import current_scaled_round_trip

WORLD, TP = 4, 2
ARRANGEMENTS = {"blocks": ((0, 1), (2, 3)), "strided": ((0, 2), (1, 3))}
SEQ, BATCH, HIDDEN, FFN, HEADS = 32, 2, 64, 128, 4  # FP8 GEMM dims (tokens, local features) multiples of 16
RTOL = 1e-4  # float32 results against float64: relative to the largest magnitude (assert_close64)
E4M3 = recipe.Format.E4M3  # also for gradients: E5M2's noise would swamp the comparisons
RECIPES = {"current": lambda: recipe.Float8CurrentScaling(fp8_format=E4M3),
           "delayed": lambda: recipe.DelayedScaling(fp8_format=E4M3, amax_history_len=4)}

_GROUPS = {}


def _tp_group(rank, arrangement):
    """(this rank's TP group, its rank there, its data-parallel replica) in the arrangement."""
    if not _GROUPS:  # every rank makes every group, in the same order, in its first case
        # A rank left waiting by a peer whose case failed gives up after a minute.
        for name, groups in ARRANGEMENTS.items():
            _GROUPS[name] = [dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=60)) for ranks in groups]
    for replica, ranks in enumerate(ARRANGEMENTS[arrangement]):
        if rank in ranks:
            group = _GROUPS[arrangement][replica]
            assert dist.get_rank(group) == ranks.index(rank)
            return group, ranks.index(rank), replica


def _shard(t, dim, group_rank):
    return t if dim is None else t.chunk(TP, dim)[group_rank].contiguous()


def _rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def _data(replica, step, *shapes):
    """This replica's random tensors of a step."""
    gen = torch.Generator().manual_seed(1000 * replica + step)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def _randomize(module):
    torch.manual_seed(0)  # the same weights on every rank
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "layer_norm_weight" in name else 0.0))


def _copy_shards(full, sharded, shard_dim, group_rank):
    params = dict(sharded.named_parameters())
    assert set(params) == set(dict(full.named_parameters()))
    with torch.no_grad():
        for name, p in full.named_parameters():
            params[name].copy_(_shard(p, shard_dim(name), group_rank))


def _made_and_deferred(build, group):
    """The module built with the group, and built with tp_size then given the group."""
    made = build(tp_group=group)
    deferred = build(tp_size=TP)
    deferred.set_tensor_parallel_group(group)
    return made, deferred


def _assert_equal_runs(made, deferred):
    for name in made:
        assert torch.equal(made[name], deferred[name]), f"set_tensor_parallel_group: {name} differs"


# -- Linear, LayerNormLinear, LayerNormMLP --------------------------------------------------------
def _build(kind, **tp):
    """The unsharded module (no tp arguments) or its tensor-parallel form."""
    if kind in ("column", "row"):
        return te_fuser.Linear(HIDDEN, HIDDEN, parallel_mode=kind if tp else None, device="cpu", **tp)
    if kind == "layernorm_linear":
        return te_fuser.LayerNormLinear(HIDDEN, HIDDEN, parallel_mode="column" if tp else None, device="cpu",
                                        return_layernorm_output=True, return_layernorm_output_gathered=True, **tp)
    return te_fuser.LayerNormMLP(HIDDEN, FFN, set_parallel_mode=bool(tp), device="cpu", **tp)


def _param_dim(kind, name):
    if kind == "layernorm_mlp":
        return layer_reference.tp_shard_dim(name)
    if "layer_norm" in name:
        return None
    if kind == "row":
        return 1 if name == "weight" else None
    return 0


def _reference(kind, full, x, dy, dln):
    """Float64 outputs and gradients of the unsharded layer (dln: the norm output's gradient)."""
    P = {n: p.detach().double().requires_grad_() for n, p in full.named_parameters()}
    x64 = x.double().requires_grad_()
    ln = None
    if kind in ("column", "row"):
        out = F.linear(x64, P["weight"], P["bias"])
    elif kind == "layernorm_linear":
        ln = F.layer_norm(x64, (HIDDEN,), P["layer_norm_weight"], P["layer_norm_bias"], full.eps)
        out = F.linear(ln, P["weight"], P["bias"])
    else:
        out, bias, _ = layer_reference.mlp(full, x64, P=P)
        out = out + bias
    loss = (out * dy.double()).sum() + ((ln * dln.double()).sum() if ln is not None else 0)
    grads = torch.autograd.grad(loss, [x64, *P.values()])
    result = {"out": out.detach(), "dgrad": grads[0], **dict(zip(P, grads[1:]))}
    if ln is not None:
        result["ln_out"] = ln.detach()
    return result


def _run(module, x, dy, dln, fp8_recipe):
    """Outputs and gradients (as the module leaves them) of one forward and backward."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with te_fuser.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
        out = module(x)
    out, ln = out if isinstance(out, tuple) else (out, None)
    torch.autograd.backward([out] + ([ln] if ln is not None else []), [dy] + ([dln] if ln is not None else []))
    result = {"out": out.detach(), "dgrad": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    if ln is not None:
        result["ln_out"] = ln.detach()
    return result


def _module_case(rank, arrangement, kind, sequence_parallel, fp8):
    group, g, replica = _tp_group(rank, arrangement)
    full = _build(kind)
    _randomize(full)
    made, deferred = _made_and_deferred(lambda **tp: _build(kind, sequence_parallel=sequence_parallel, **tp), group)
    for m in (made, deferred):
        _copy_shards(full, m, lambda n: _param_dim(kind, n), g)
    # How each result is split over the TP ranks: (dim, shard) or whole.
    seq = 0 if sequence_parallel else None
    in_dim = 2 if kind == "row" else seq
    out_dim = 2 if kind in ("column", "layernorm_linear") else seq
    dims = {"out": out_dim, "dgrad": in_dim, "ln_out": None,
            **{n: _param_dim(kind, n) for n, _ in full.named_parameters()}}
    fp8_recipes = [RECIPES[fp8]() for _ in range(3)] if fp8 else [None] * 3  # full, made, deferred
    for step in range(2):  # delayed scaling: the second step's scales differ between the TP ranks
        x, dy, dln = _data(replica, step, (SEQ, BATCH, HIDDEN), (SEQ, BATCH, HIDDEN), (SEQ, BATCH, HIDDEN))
        ref = _reference(kind, full, x, dy, dln)
        # The gathered norm output's gradient is summed over the TP ranks: each gives a part.
        dln_local = dln * (g + 1) / 3 if sequence_parallel else dln
        runs = [_run(m, _shard(x, in_dim, g), _shard(dy, out_dim, g), dln_local, r)
                for m, r in zip((made, deferred), fp8_recipes[1:])]
        _assert_equal_runs(*runs)
        got = runs[0]
        if sequence_parallel:  # replicated parameters saw this rank's tokens: the framework sums them
            for name, dim in dims.items():
                if dim is None and name in dict(full.named_parameters()):
                    dist.all_reduce(got[name], group=group)
        full_fp8 = _run(full, x, dy, dln, fp8_recipes[0]) if fp8 else None
        assert set(got) == set(ref), (sorted(got), sorted(ref))
        for name, value in got.items():
            expect = _shard(ref[name], dims[name], g)
            where = f"{kind} sp={sequence_parallel} fp8={fp8} step {step}: {name}"
            if fp8:
                # The unsharded module's FP8 error calibrates the TP module's (each rank casts its
                # shards with its own scales, so they differ within FP8 precision).
                bound = 2 * _rel(full_fp8[name], ref[name]) + 0.01
                assert _rel(value, expect) <= bound, f"{where}: relative error {_rel(value, expect)} > {bound}"
            else:
                assert_close64(where, value, expect, RTOL)


# -- FP8: the group's scales, exactly -------------------------------------------------------------
def _fp8_scales_case(rank, arrangement):
    """Current scaling casts a gathered tensor with the amax of the group's whole tensor: the column
    forward (input gathered) and the row backward (output gradient gathered) equal float64 math on
    torch's casts with that scale. Delayed scaling reduces amaxes over fp8_group (the TP group)."""
    group, g, replica = _tp_group(rank, arrangement)
    fp8_dtype = torch.float8_e4m3fn
    rt = lambda t: current_scaled_round_trip(t, fp8_dtype)  # noqa: E731
    x, dy = _data(replica, 0, (SEQ, BATCH, HIDDEN), (SEQ, BATCH, HIDDEN))
    # The amax, on group rank 1's shard (rows) and group rank 0's (columns); replica 1's is larger,
    # so replica 0 would get another scale from a reduction over all ranks.
    x[-1, -1, 0] = dy[-1, -1, 0] = 9.0 * (1 + 2 * replica)
    torch.manual_seed(0)
    weight = torch.randn(HIDDEN, HIDDEN) * 0.2
    tol = dict(rtol=1e-5, atol=1e-5)  # float32 accumulation of the same FP8 operands

    column = te_fuser.Linear(HIDDEN, HIDDEN, bias=False, parallel_mode="column", sequence_parallel=True,
                             tp_group=group, device="cpu")
    row = te_fuser.Linear(HIDDEN, HIDDEN, bias=False, parallel_mode="row", sequence_parallel=True,
                          tp_group=group, device="cpu")
    with torch.no_grad():
        column.weight.copy_(_shard(weight, 0, g)), row.weight.copy_(_shard(weight, 1, g))
    with te_fuser.fp8_autocast(fp8_recipe=RECIPES["current"]()):
        out = column(_shard(x, 0, g))
    torch.testing.assert_close(out.double(), F.linear(rt(x), rt(column.weight)), **tol)
    x_row = _shard(x, 2, g).requires_grad_()
    with te_fuser.fp8_autocast(fp8_recipe=RECIPES["current"]()):
        out = row(x_row)
    out.backward(_shard(dy, 0, g))
    torch.testing.assert_close(x_row.grad.double(), rt(dy) @ rt(row.weight), **tol)

    delayed = te_fuser.Linear(HIDDEN, HIDDEN, parallel_mode="row", tp_group=group, device="cpu")
    with te_fuser.fp8_autocast(fp8_recipe=RECIPES["delayed"](), fp8_group=group):
        delayed(_shard(x, 2, g))
    # the group's amax is in the history (wherever the layout keeps it; the rest is zeros)
    assert delayed._ops[0]._fp8_states[0].amax_history[:, 0].max().item() == x.abs().max().item()


# -- checkpoint(distribute_saved_activations) -----------------------------------------------------
def _checkpoint_case(rank, arrangement):
    """A TP LayerNormMLP under checkpoint keeps the group rank's chunk of its input and gathers it
    back for the recompute: outputs and gradients as float64 math."""
    group, g, replica = _tp_group(rank, arrangement)
    full = _build("layernorm_mlp")
    _randomize(full)
    tp = _build("layernorm_mlp", tp_group=group)
    _copy_shards(full, tp, layer_reference.tp_shard_dim, g)
    x, dy = _data(replica, 0, (SEQ, BATCH, HIDDEN), (SEQ, BATCH, HIDDEN))
    ref = _reference("layernorm_mlp", full, x, dy, None)
    xi = x.clone().requires_grad_()
    out = checkpoint(tp, xi, distribute_saved_activations=True, tp_group=group)
    assert torch.equal(xi.detach(), x.reshape(-1).chunk(TP)[g])  # what the input keeps until backward
    out.backward(dy)
    assert_close64("out", out, ref["out"], RTOL)
    assert_close64("dgrad", xi.grad, ref["dgrad"], RTOL)
    for name, p in tp.named_parameters():
        assert_close64(name, p.grad, _shard(ref[name], layer_reference.tp_shard_dim(name), g), RTOL)


# -- set_tensor_parallel_group on the composite modules -------------------------------------------
def _attention_build(kind, sequence_parallel):
    def build(**tp):
        tp_kwargs = dict(set_parallel_mode=True, sequence_parallel=sequence_parallel, **tp) if tp else {}
        if kind == "mha":
            return te_fuser.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, num_gqa_groups=2,
                                               device="cpu", **tp_kwargs)
        return te_fuser.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=2, hidden_dropout=0.0,
                                         attention_dropout=0.0, fuse_qkv_params=True, seq_length=SEQ,
                                         device="cpu", **tp_kwargs)
    return build


def _attention_case(rank, arrangement, kind, sequence_parallel):
    """MultiheadAttention (qkv and proj) and TransformerLayer (layernorm_qkv, proj, layernorm_mlp):
    the deferred group equals the given one, and both equal float64 math of the unsharded module."""
    group, g, replica = _tp_group(rank, arrangement)
    build = _attention_build(kind, sequence_parallel)
    full = build()
    _randomize(full)
    made, deferred = _made_and_deferred(build, group)
    for m in (made, deferred):
        _copy_shards(full, m, layer_reference.tp_shard_dim, g)
    x, dy = _data(replica, 0, (SEQ, BATCH, HIDDEN), (SEQ, BATCH, HIDDEN))
    seq = 0 if sequence_parallel else None
    runs = [_run(m, _shard(x, seq, g), _shard(dy, seq, g), None, None) for m in (made, deferred)]
    _assert_equal_runs(*runs)

    P = {n: p.detach().double().requires_grad_() for n, p in full.named_parameters()}
    x64 = x.double().requires_grad_()
    if kind == "mha":
        out, bias, _ = layer_reference.mha(full, x64, P=P)
        out = out + bias
    else:
        out = layer_reference.transformer_layer(full, x64, P=P)
    grads = torch.autograd.grad((out * dy.double()).sum(), [x64, *P.values()])
    ref = {"out": out.detach(), "dgrad": grads[0], **dict(zip(P, grads[1:]))}
    got = runs[0]
    for name, value in got.items():
        dim = seq if name in ("out", "dgrad") else layer_reference.tp_shard_dim(name)
        if sequence_parallel and dim is None:
            dist.all_reduce(value, group=group)
        assert_close64(f"{kind} sp={sequence_parallel}: {name}", value, _shard(ref[name], dim, g), RTOL)


def _grouped_linear_case(rank, arrangement):
    """GroupedLinear keeps the group it is given (it communicates nothing itself)."""
    group, g, replica = _tp_group(rank, arrangement)
    made, deferred = _made_and_deferred(
        lambda **tp: te_fuser.GroupedLinear(2, HIDDEN, HIDDEN, parallel_mode="column", bias=False, device="cpu",
                                            **tp), group)
    assert deferred.tp_group is group and deferred.tp_size == made.tp_size == TP
    _copy_shards(made, deferred, lambda name: None, g)
    x, = _data(replica, 0, (SEQ, HIDDEN))
    assert torch.equal(made(x, [SEQ // 2, SEQ // 2]), deferred(x, [SEQ // 2, SEQ // 2]))


CASES = [(_fp8_scales_case, a) for a in ARRANGEMENTS]
CASES += [(_module_case, a, kind, sp, fp8) for a in ARRANGEMENTS
          for kind in ("column", "row", "layernorm_linear", "layernorm_mlp")
          for sp in (False, True) for fp8 in (None, "current", "delayed")]
CASES += [(_checkpoint_case, a) for a in ARRANGEMENTS]
CASES += [(_attention_case, a, kind, sp) for a in ARRANGEMENTS for kind, sp in (("mha", False), ("layer", True))]
CASES += [(_grouped_linear_case, a) for a in ARRANGEMENTS]


def test_every_tensor_parallel_collective_on_subgroups():
    run_cases(CASES, world=WORLD)


@pytest.mark.parametrize("kind", ["column", "row", "layernorm_linear", "layernorm_mlp", "mha", "layer"])
def test_a_tensor_parallel_module_without_its_group_refuses_to_run(kind):
    """Built with tp_size and no group, and never given one: the forward raises (as TE's "TP group not
    initialized") instead of skipping the collectives and returning one rank's partial result."""
    if kind in ("mha", "layer"):
        module = _attention_build(kind, sequence_parallel=False)(tp_size=TP)
    else:
        module = _build(kind, tp_size=TP)
    x = torch.randn(SEQ, BATCH, HIDDEN // TP if kind == "row" else HIDDEN)
    with pytest.raises(RuntimeError, match=r"tensor_parallel_size is 2 .* set_tensor_parallel_group\(\)"):
        module(x)
