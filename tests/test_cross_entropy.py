"""te_fuser.cross_entropy.parallel_cross_entropy (TE's fused vocabulary-parallel loss, C kernels) against
F.cross_entropy in float64: losses and gradients, label smoothing, ignored tokens, 16-bit logits, edge
values; vocabulary shards on gloo ranks against the unsharded loss; torch.compile; the saved tensors and the
peak memory; bad arguments."""

import math

import pytest
import torch
import torch.nn.functional as F

from _gloo_ranks import run_cases
from te_fuser.cross_entropy import parallel_cross_entropy
from te_fuser.memory import MemoryTracker, audit_autograd

IGNORE = -100
TOLERANCE = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-5, atol=2e-5),
             torch.float16: dict(rtol=2e-5, atol=2e-5)}
GRAD_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-4),
                  torch.float16: dict(rtol=1e-3, atol=1e-5)}


def logits_with_edges(shape, dtype, generator):
    """Random logits of a few magnitudes, with a row of equal values, a very peaked row and -inf entries
    (masked vocabulary), in dtype."""
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 4
    flat = x.view(-1, shape[-1])
    flat[0] = 3.0
    flat[1, 7] = 60.0
    flat[2, ::5] = -math.inf
    return x.to(dtype)


def targets(shape, vocab, generator):
    t = torch.randint(0, vocab, shape, generator=generator)
    flat = t.view(-1)
    flat[1] = 7
    flat[3] = IGNORE
    flat[4] = vocab - 1
    flat[5] = 0
    return t


def reference(x, t, smoothing, reduce_loss):
    """F.cross_entropy in float64 over the last dimension, with its loss and gradient."""
    x64 = x.detach().to(torch.float64).requires_grad_()
    loss = F.cross_entropy(x64.reshape(-1, x.shape[-1]), t.reshape(-1), ignore_index=IGNORE,
                           label_smoothing=smoothing, reduction="mean" if reduce_loss else "none")
    return loss if reduce_loss else loss.view(t.shape), x64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduce_loss", [False, True])
@pytest.mark.parametrize("shape", [(3, 5, 1031), (2, 9, 64)], ids=["vocab1031", "vocab64"])
def test_matches_float64_cross_entropy(dtype, smoothing, reduce_loss, shape):
    g = torch.Generator().manual_seed(hash((str(dtype), smoothing, reduce_loss, shape)) % 2**31)
    x = logits_with_edges(shape, dtype, g).requires_grad_()
    t = targets(shape[:-1], shape[-1], g)
    t.view(-1)[2] = 3  # row 2 has -inf logits (every fifth), not at its target
    loss = parallel_cross_entropy(x, t, smoothing, reduce_loss)
    want, x64 = reference(x, t, smoothing, reduce_loss)
    assert loss.dtype == torch.float32 and loss.shape == want.shape
    torch.testing.assert_close(loss.double(), want.detach(), **TOLERANCE[dtype])
    dy = torch.rand(want.shape, generator=g, dtype=torch.float64) + 0.5
    (grad,) = torch.autograd.grad(loss, x, dy.float())
    (want_grad,) = torch.autograd.grad(want, x64, dy)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.double(), want_grad, **GRAD_TOLERANCE[dtype])
    assert (grad.view(-1, shape[-1])[3] == 0).all()  # the ignored token


def test_infinite_and_nan_losses_follow_torch():
    x = torch.tensor([[0.0, -math.inf, 1.0], [0.0, 1.0, 2.0], [math.nan, 0.0, 0.0]])
    t = torch.tensor([1, IGNORE, 1])
    for smoothing in (0.0, 0.3):
        got = parallel_cross_entropy(x, t, smoothing)
        want = F.cross_entropy(x.double(), t, ignore_index=IGNORE, label_smoothing=smoothing, reduction="none")
        torch.testing.assert_close(got.double(), want, equal_nan=True)
    every_token_ignored = parallel_cross_entropy(x, torch.full((3,), IGNORE), 0.0, True)
    assert torch.isnan(every_token_ignored)  # F.cross_entropy's mean over no token


def test_other_ignore_index_and_int32_targets():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (6,), generator=g, dtype=torch.int32)
    t[2] = 39  # an ordinary class here, the ignored one below
    loss = parallel_cross_entropy(x, t, 0.0, True, None, 39)
    want = F.cross_entropy(x.double(), t.long(), ignore_index=39)
    torch.testing.assert_close(loss.double(), want)


def test_gradient_is_saved_tensors_only_and_freed_after_backward():
    x = torch.randn(4, 8, 300, requires_grad=True)
    t = torch.randint(0, 300, (4, 8))
    loss = parallel_cross_entropy(x * 1.0, t, 0.1, True)
    assert audit_autograd(loss).findings == ()
    loss.backward()
    assert audit_autograd(loss).findings == ()
    node = loss.grad_fn
    while type(node).__name__ != "CrossEntropyFunctionBackward":
        node = node.next_functions[0][0]
    with pytest.raises(RuntimeError, match="freed|backward through the graph a second time"):
        node.saved_tensors  # noqa: B018  (freed by backward)


def _peak_bytes(loss_fn, x, t):
    with MemoryTracker(device="cpu") as mem:
        loss = loss_fn(x, t)
        loss.backward()
        del loss
    return mem.peak_bytes


def _float32_copy_loss(x, t):
    """The bug this kernel avoids: a float32 copy of the logits (what F.cross_entropy on .float() holds)."""
    return F.cross_entropy(x.float().reshape(-1, x.shape[-1]), t.reshape(-1))


def test_no_float32_copy_of_the_logits():
    """bf16 logits of L bytes: the loss step allocates the bf16 gradient (L) and per-token float32 values,
    well under the 2 L of a float32 copy (+2 L for its softmax gradient). The control measures that copy."""
    x = torch.randn(8, 64, 4096, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 4096, (8, 64))
    logits_bytes = x.numel() * x.element_size()
    fused = _peak_bytes(lambda a, b: parallel_cross_entropy(a, b, 0.0, True), x, t)
    x.grad = None
    copied = _peak_bytes(_float32_copy_loss, x, t)
    assert fused < 1.25 * logits_bytes, f"peak {fused} B for {logits_bytes} B of logits"
    assert copied > 2 * logits_bytes, f"the control's float32 copy was not seen: peak {copied} B"


def test_torch_compile_fullgraph_gives_eager_results():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 96, generator=g, dtype=torch.bfloat16)
    t = torch.randint(0, 96, (3, 4), generator=g)
    t[0, 0] = IGNORE

    def step(logits, target):
        return parallel_cross_entropy(logits, target, 0.1, True)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        logits = x.clone().requires_grad_()
        loss = fn(logits, t)
        loss.backward()
        results.append((loss, logits.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _sharded_case(rank, smoothing, reduce_loss, dtype):
    world = torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(11)
    full = logits_with_edges((4, 3, 128), dtype, g)
    t = targets((4, 3), 128, g)
    shard = 128 // world
    x = full[..., rank * shard:(rank + 1) * shard].contiguous().requires_grad_()
    loss = parallel_cross_entropy(x, t, smoothing, reduce_loss, torch.distributed.group.WORLD)
    want, full64 = reference(full, t, smoothing, reduce_loss)
    torch.testing.assert_close(loss.double(), want.detach(), **TOLERANCE[dtype])
    dy = torch.rand(want.shape, generator=g, dtype=torch.float64) + 0.5
    (grad,) = torch.autograd.grad(loss, x, dy.float())
    (want_grad,) = torch.autograd.grad(want, full64, dy)
    torch.testing.assert_close(grad.double(), want_grad[..., rank * shard:(rank + 1) * shard],
                               **GRAD_TOLERANCE[dtype])


def test_vocabulary_shards_on_two_ranks_match_the_whole_vocabulary():
    run_cases([(_sharded_case, smoothing, reduce_loss, dtype) for smoothing in (0.0, 0.1)
               for reduce_loss in (False, True) for dtype in (torch.float32, torch.bfloat16)])


def test_bad_arguments_name_the_argument():
    x = torch.randn(2, 3, 10)
    t = torch.randint(0, 10, (2, 3))
    with pytest.raises(ValueError, match="target holds 10"):
        parallel_cross_entropy(x, torch.full((2, 3), 10))
    with pytest.raises(ValueError, match="target holds -1"):
        parallel_cross_entropy(x, torch.full((2, 3), -1))
    with pytest.raises(ValueError, match="target must have logits' shape"):
        parallel_cross_entropy(x, t[:, :2])
    with pytest.raises(TypeError, match="logits must have dtype"):
        parallel_cross_entropy(x.double(), t)
    with pytest.raises(ValueError, match="label_smoothing"):
        parallel_cross_entropy(x, t, 1.5)
    with pytest.raises(TypeError, match="target must be an integer tensor"):
        parallel_cross_entropy(x, t.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_float64(dtype):
    g = torch.Generator().manual_seed(13)
    x = logits_with_edges((4, 6, 1031), dtype, g)
    t = targets((4, 6), 1031, g)
    want, x64 = reference(x, t, 0.1, False)
    logits = x.cuda().requires_grad_()
    loss = parallel_cross_entropy(logits, t.cuda(), 0.1, False)
    torch.testing.assert_close(loss.double().cpu(), want.detach(), **TOLERANCE[dtype])
    loss.backward(torch.ones_like(loss))
    (want_grad,) = torch.autograd.grad(want, x64, torch.ones_like(want))
    torch.testing.assert_close(logits.grad.double().cpu(), want_grad, **GRAD_TOLERANCE[dtype])
