"""LossLog and detach_for_logging: detached, unsynchronized logging with correct values."""

import collections
import statistics

import pytest
import torch

from te_fuser.memory import LossLog, detach_for_logging

Parts = collections.namedtuple("Parts", ["main", "aux"])


def _refuse(*args, **kwargs):
    raise AssertionError("LossLog.append must not synchronize with the device")


def test_append_stores_detached_copies_without_syncing(monkeypatch):
    w = torch.randn(8, requires_grad=True)
    losses = [(w * torch.randn(8)).sum() for _ in range(16)]
    expected = [float(loss.detach()) for loss in losses]
    log = LossLog()
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "cpu"):
            patch.setattr(torch.Tensor, name, _refuse)
        for loss in losses:
            log.append(loss)
    assert all(stored.grad_fn is None and not stored.requires_grad for stored in log._values)
    losses[0].data.mul_(0)  # later changes to the loss do not reach the log
    assert len(log) == 16
    assert log.values() == pytest.approx(expected, rel=1e-6)
    assert log.mean() == pytest.approx(statistics.fmean(expected), rel=1e-6)


def test_numbers_empty_log_and_bad_shapes():
    log = LossLog()
    assert log.values() == []
    with pytest.raises(ValueError, match="empty"):
        log.mean()
    log.append(2.5)
    log.append(torch.tensor([[1.5]]))
    assert log.values() == [2.5, 1.5] and log.mean() == 2.0
    with pytest.raises(ValueError, match="one-element loss, got shape \\(2,\\)"):
        log.append(torch.ones(2))
    log.clear()
    assert len(log) == 0
    log.append(0.1)  # a Python float is a double: kept exactly
    log.append(2**25 + 1)
    assert log.values() == [0.1, 2**25 + 1]


def test_detach_for_logging_nested_structures():
    w = torch.randn(4, requires_grad=True)
    loss = (w * 2).sum()
    metrics = collections.OrderedDict(
        loss=loss,
        parts=Parts(main=w * 3, aux=[w.exp(), ("tag", w.sin())]),
        step=7,
        name="lm",
    )
    detached = detach_for_logging(metrics)
    assert type(detached) is collections.OrderedDict and list(detached) == ["loss", "parts", "step", "name"]
    assert type(detached["parts"]) is Parts and type(detached["parts"].aux) is list
    assert type(detached["parts"].aux[1]) is tuple and detached["parts"].aux[1][0] == "tag"
    tensors = [detached["loss"], detached["parts"].main, detached["parts"].aux[0], detached["parts"].aux[1][1]]
    originals = [loss, w * 3, w.exp(), w.sin()]
    for got, want in zip(tensors, originals):
        assert got.grad_fn is None and not got.requires_grad
        torch.testing.assert_close(got, want.detach())
    assert detached["step"] == 7 and detached["name"] == "lm"
    assert metrics["loss"].grad_fn is not None  # the input is left as it was


def test_detach_for_logging_keeps_a_plain_dict_subclass():
    class Metrics(dict):
        pass

    w = torch.randn(3, requires_grad=True)
    detached = detach_for_logging(Metrics(loss=w.sum()))
    assert type(detached) is Metrics and detached["loss"].grad_fn is None
