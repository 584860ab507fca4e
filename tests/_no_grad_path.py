"""Runs a layer with grad on, then under torch.no_grad with its autograd Function refused, for the
tests of the no_grad paths (no Function call, nothing made for a backward)."""

import torch


def run_with_and_without_grad(monkeypatch, function_cls, watched, context, call):
    """(output with grad on, output under no_grad, the calls of `watched` under no_grad).

    Under no_grad `function_cls.apply` raises, and watched = (module, name) is wrapped to record its
    calls (something only a backward needs, which the no_grad path must not make)."""
    with context():
        expected = call()
    calls = []
    module, name = watched
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(args) or real(*args))

    def refuse(*args):
        raise AssertionError(f"{function_cls.__name__} ran under no_grad")

    monkeypatch.setattr(function_cls, "apply", refuse)
    with torch.no_grad(), context():
        out = call()
    return expected, out, calls
