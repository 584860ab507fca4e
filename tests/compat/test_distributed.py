"""te_fuser.distributed: TE's RNG tracker, checkpoint, recompute flags and FSDP preparation."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import te_fuser
from te_fuser import distributed as ted
from te_fuser.recipe import DelayedScaling

from _gloo_ranks import free_port


def test_tracker_forks_a_seeded_stream_and_leaves_the_default_one_alone(generator):
    """The tracker's streams are the GPU's where there is one (as in TE), else the CPU's."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seed = int(torch.randint(0, 2**30, (1,), generator=generator))
    tracker = ted.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", seed)
    assert ted.get_all_rng_states() is tracker.states_

    torch.manual_seed(seed + 1)
    expected_outside = torch.rand(4, device=dev, generator=torch.Generator(dev).manual_seed(seed + 1))
    reference = torch.Generator(dev).manual_seed(seed)
    with tracker.fork():
        first = torch.rand(3, device=dev)
    outside = torch.rand(4, device=dev)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3, device=dev)
    assert torch.equal(first, torch.rand(3, device=dev, generator=reference))
    assert torch.equal(second, torch.rand(3, device=dev, generator=reference))  # the forked stream continues
    assert torch.equal(outside, expected_outside)  # the default stream never saw the forks

    saved = tracker.get_states()
    assert saved == tracker.states_ and saved is not tracker.states_
    with tracker.fork():
        a = torch.rand(2, device=dev)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(2, device=dev), a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tracker_adds_a_stream_before_cuda_is_initialized():
    """Megatron seeds the tracker first thing in a process; CUDA's generators exist only after its lazy init."""
    code = ("import torch; from te_fuser import distributed as ted; assert not torch.cuda.is_initialized(); "
            "t = ted.CudaRNGStatesTracker(); t.add('model-parallel-rng', 7)\n"
            "with t.fork(): x = torch.rand(3, device='cuda')\n"
            "assert torch.equal(x, torch.rand(3, device='cuda', generator=torch.Generator('cuda').manual_seed(7)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_tracker_errors_match_te():
    tracker = ted.CudaRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(RuntimeError, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(RuntimeError, match="cuda rng state a already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="cuda rng state missing is not added"):
        with tracker.fork("missing"):
            pass
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("a", 1)  # seeds and names are free again


class MegatronStyleTracker(ted.CudaRNGStatesTracker):
    """How Megatron-LM subclasses TE's tracker at import (megatron/core/extensions/transformer_engine.py)."""

    def __init__(self, is_inference_rng_tracker=False):
        super().__init__()
        self.reset()
        self.is_inference_rng_tracker = is_inference_rng_tracker

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        super().reset()
        self._is_initialized = False

    def set_states(self, states):
        super().set_states(states)
        self._is_initialized = True

    def add(self, name, seed):
        super().add(name, seed)
        self._is_initialized = True


def test_megatron_subclass_works():
    tracker = MegatronStyleTracker()
    assert not tracker.is_initialized()
    tracker.add("model-parallel-rng", 7)
    assert tracker.is_initialized()
    with tracker.fork():
        torch.rand(1)


def _block(tracker, dropout_p=0.3):
    torch.manual_seed(0)
    linear = te_fuser.Linear(32, 32, device="cpu")
    phases = []

    def block(x, scale=1.0):
        phases.append(ted.in_fp8_activation_recompute_phase())
        y = torch.nn.functional.dropout(linear(x), dropout_p)  # the default generator
        with tracker.fork():
            y = torch.nn.functional.dropout(y, dropout_p) * scale  # the tracker's stream
        return y

    return linear, block, phases


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_checkpoint_recomputes_with_the_forward_rng_and_fp8_state(use_reentrant, fp8, generator):
    tracker = ted.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    linear, block, phases = _block(tracker)
    reference_linear, reference_block, _ = _block(tracker)
    recipe = DelayedScaling(amax_history_len=2)
    for step in range(3):  # later steps run on updated delayed scales
        x = (torch.randn(16, 32, generator=generator) * (step + 1)).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        states, cpu = tracker.get_states(), torch.get_rng_state()
        with te_fuser.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            out = ted.checkpoint(block, x, distribute_saved_activations=False, get_rng_state_tracker=lambda: tracker,
                                 tp_group=None, use_reentrant=use_reentrant, scale=2.0)
        out.square().sum().backward()
        tracker.set_states(states)
        torch.set_rng_state(cpu)
        with te_fuser.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            expected = reference_block(x_ref, scale=2.0)
        expected.square().sum().backward()
        assert torch.equal(out, expected)
        assert torch.equal(x.grad, x_ref.grad)
        assert torch.equal(linear.weight.grad, reference_linear.weight.grad)
    assert phases == [False, True] * 3  # forward, then its recompute
    if fp8:
        assert torch.equal(linear._ops[0]._fp8_states[0].scale, reference_linear._ops[0]._fp8_states[0].scale)


def test_checkpoint_keeps_its_own_keywords_and_releases_its_frame():
    seen = {}

    def function(x, **kwargs):
        seen.update(kwargs)
        return x * 2

    x = torch.randn(4, requires_grad=True)
    out = ted.checkpoint(function, x, distribute_saved_activations=True, get_rng_state_tracker=None, tp_group=None,
                         use_reentrant=True, alpha=1)
    assert seen == {"alpha": 1}  # checkpoint's own keywords never reach the function
    assert ted.use_reentrant_activation_recompute()
    node = out.grad_fn
    assert node.frame is not None
    out.sum().backward()
    assert node.frame is None and node.non_tensors is None  # nothing of the forward stays on ctx
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    with pytest.raises(TypeError, match="function must be callable"):
        ted.checkpoint(None, x)


def test_activation_recompute_forward_flags():
    assert not ted.is_fp8_activation_recompute_enabled() and not ted.in_fp8_activation_recompute_phase()
    with ted.activation_recompute_forward(activation_recompute=True, recompute_phase=False):
        assert not ted.is_fp8_activation_recompute_enabled()  # FP8 is off
    with te_fuser.fp8_autocast():
        with ted.activation_recompute_forward(activation_recompute=True, recompute_phase=True):
            assert ted.is_fp8_activation_recompute_enabled() and ted.in_fp8_activation_recompute_phase()
        assert not ted.is_fp8_activation_recompute_enabled()

    @ted.activation_recompute_forward(activation_recompute=True, recompute_phase=True)
    def decorated():
        return ted.in_fp8_activation_recompute_phase()

    assert decorated() and not ted.in_fp8_activation_recompute_phase()


def test_prepare_te_modules_for_fsdp_rejects_an_unwrapped_model():
    with pytest.raises(TypeError, match="fsdp_root must be wrapped by FullyShardedDataParallel"):
        ted.prepare_te_modules_for_fsdp(torch.nn.Linear(2, 2))


def _two_rank_worker(rank, world_size, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        linear = te_fuser.Linear(32, 32, device="cpu")
        x = torch.randn(16, 32, requires_grad=True)
        kept = []

        def block(inp):
            return linear(inp).relu()

        out = ted.checkpoint(block, x, distribute_saved_activations=True, tp_group=dist.group.WORLD)
        kept.append(x.numel())  # what the checkpoint keeps of its input until backward
        out.sum().backward()
        x_ref = x.detach().clone().requires_grad_()
        grad_w = linear.weight.grad.clone()
        linear.weight.grad = None
        block(x_ref).sum().backward()
        result = (kept[0], tuple(x.shape), torch.equal(x.grad, x_ref.grad), torch.equal(grad_w, linear.weight.grad))

        # A sequence-parallel input: each rank its own shard. Split and gathered back it would mix the ranks'
        # values; every rank refuses it. One element apart is enough.
        shard = x.detach().clone()
        shard[5, 7] += rank
        try:
            ted.checkpoint(block, shard, distribute_saved_activations=True, tp_group=dist.group.WORLD)
            refused = ""
        except ValueError as e:
            refused = str(e)
        result += ("differs between the ranks" in refused and "sequence-parallel" in refused,)

        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(te_fuser.Linear(32, 32, device="cpu"), device_id=torch.device("cpu"))
        ted.prepare_te_modules_for_fsdp(wrapped)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_distribute_saved_activations_keeps_one_chunk_per_rank(tmp_path):
    mp.spawn(_two_rank_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == (16 * 32 // 2, (16, 32), True, True, True)
