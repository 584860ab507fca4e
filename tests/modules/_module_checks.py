"""Checks every te_fuser module's tests share: float64 references, the graph walk and
retained-bytes measurement with its bug-on control, and a 2-rank gloo spawn."""

import atexit
import datetime
import os
import queue
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import te_fuser
from te_fuser.ops import fuser as fuser_module

from _fuser_ctx_walk import allowed_storages, reachable_tensors, retained_cpu_bytes
from _gloo_ranks import free_port
from _cpu_default import build_modules_on_cpu


# -- float64 references ------------------------------------------------------------------
def norm64(x, weight, bias, eps, normalization, zero_centered_gamma):
    """The norm in float64 from the formula (F.layer_norm / x * rsqrt(mean(x^2) + eps))."""
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma


def leaf64(t):
    return None if t is None else t.detach().double().requires_grad_()


def grads_of(*tensors):
    return [None if t is None else t.grad for t in tensors]


def assert_close64(name, got, ref, rtol):
    """Returns max |got - ref|, after checking it against rtol: elementwise against
    rtol * (max |ref| + 1) for float32 results; for 16-bit results -- whose reductions over
    rounded terms can cancel -- the relative error ||got - ref|| / ||ref|| is checked."""
    assert got is not None and ref is not None, f"{name}: missing gradient ({got is None}, {ref is None})"
    ref = ref.detach().double()
    diff = got.detach().double() - ref
    if got.dtype == torch.float32:
        err, bound = diff.abs().max().item(), rtol * (ref.abs().max().item() + 1)
    else:
        err, bound = (diff.norm() / ref.norm()).item(), rtol
    assert err <= bound, f"{name}: err {err} > {bound}"
    return diff.abs().max().item()


# -- one autograd node, nothing on ctx after backward --------------------------------------
def fuser_nodes(out):
    """The fuser's autograd nodes reachable from out."""
    nodes, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "_FuserFunctionBackward":
            nodes.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return nodes


def autocast(fp8_recipe):
    return te_fuser.fp8_autocast(fp8_recipe=fp8_recipe) if fp8_recipe is not None else te_fuser.fp8_autocast(False)


def ctx_walk_check(module, make_input, fp8_recipe, monkeypatch, first=lambda r: r):
    """After backward nothing but parameters/FP8 state is reachable from the output's graph;
    with te_fuser's clearing switched off the same walk finds the saved tensors."""
    def run():
        x = make_input()
        with autocast(fp8_recipe):
            out = first(module(x))
        allowed = allowed_storages(module)
        assert reachable_tensors(out, allowed), "the walk must see what the forward saved"
        out.backward(torch.randn_like(out))
        return out, allowed

    out, allowed = run()
    found = reachable_tensors(out, allowed)
    assert not found, "tensors still reachable after backward:\n" + "\n".join(
        f"  {p}: {tuple(t.shape)}" for p, t in found)
    assert all(node.state is None for node in fuser_nodes(out))
    monkeypatch.setattr(fuser_module, "_CLEAR_CTX_AFTER_BACKWARD", False)
    out, allowed = run()
    assert reachable_tensors(out, allowed), "bug-on control: the walk must find the leaked tensors"
    monkeypatch.setattr(fuser_module, "_CLEAR_CTX_AFTER_BACKWARD", True)


def retained_bytes_check(module, make_input, fp8_recipe, monkeypatch, min_leak, first=lambda r: r):
    """A training step with its output alive keeps only the output, the input's grad and the
    parameter grads (+ slack for FP8 scaling state); with clearing off it keeps >= min_leak more."""
    x = make_input()

    def measure():
        with autocast(fp8_recipe):
            first(module(x)).sum()  # first step: creates the FP8 state
        module.zero_grad(set_to_none=True)
        x.grad = None

        def step():
            with autocast(fp8_recipe):
                out = first(module(x))
            out.backward(torch.ones_like(out))
            return out

        out, retained = retained_cpu_bytes(step)
        grads = sum(p.numel() * p.element_size() for p in module.parameters())
        return retained, out.numel() * out.element_size() + x.numel() * x.element_size() + grads

    retained, expected = measure()
    assert retained <= expected + 4096, (retained, expected)
    monkeypatch.setattr(fuser_module, "_CLEAR_CTX_AFTER_BACKWARD", False)
    retained, expected = measure()
    assert retained >= expected + min_leak, ("bug-on control", retained, expected, min_leak)
    monkeypatch.setattr(fuser_module, "_CLEAR_CTX_AFTER_BACKWARD", True)


# -- 2 gloo ranks ------------------------------------------------------------------------
# Starting a process that imports torch takes tens of seconds on a loaded machine, so the
# distributed tests share one pair of gloo ranks for the whole session: each test sends
# them a function (by reference: module-level) and waits for both results.
WORLD = 2
_JOB_TIMEOUT_S = 300


def _rank_main(rank, port, jobs, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    build_modules_on_cpu()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            fn(rank, *args)
            results.put((rank, None))
        except BaseException:  # noqa: BLE001 (reported to the test)
            results.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


class _RankPool:
    def __init__(self):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(WORLD)]
        self.procs = [ctx.Process(target=_rank_main, args=(r, port, self.jobs[r], self.results), daemon=True)
                      for r in range(WORLD)]
        for p in self.procs:
            p.start()

    def run(self, fn, args):
        for q in self.jobs:
            q.put((fn, args))
        errors = []
        for _ in range(WORLD):
            try:
                rank, err = self.results.get(timeout=_JOB_TIMEOUT_S)
            except queue.Empty:
                errors.append(f"no answer from a rank within {_JOB_TIMEOUT_S} s")
                break
            if err is not None:
                errors.append(f"rank {rank}:\n{err}")
        return errors

    def close(self, graceful=True):
        for q, p in zip(self.jobs, self.procs):
            if graceful and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=30 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join()


_POOL = None


def spawn(fn, *args):
    """Runs fn(rank, *args) on the session's 2 gloo ranks; fails with the ranks' tracebacks.
    After a failure the ranks are replaced (a collective may have been left half done)."""
    global _POOL
    if _POOL is None:
        _POOL = _RankPool()
        atexit.register(lambda: _POOL is not None and _POOL.close())
    errors = _POOL.run(fn, args)
    if errors:
        _POOL.close(graceful=False)
        _POOL = None
        raise AssertionError("\n".join(errors))
