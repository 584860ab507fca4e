"""benchmarks/bench_attention_cuda.py, the one-run GPU attention benchmark, on the CPU: its arguments parse
(and bad ones are refused naming the option), its thd lengths and FLOP counts are what its docstring says,
and the calls it times run (small CPU tensors: DotProductAttention per layout, with fp8_dpa, and SDPA)."""

import importlib.util
from pathlib import Path

import pytest
import torch

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention_cuda.py"
_spec = importlib.util.spec_from_file_location("bench_attention_cuda", _BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_arguments_parse_and_bad_ones_are_named(capsys):
    args = bench.parse_args([])
    assert args.seqlens == [2048, 8192, 16384] and args.head_dims == [128, 64]
    assert args.layouts == ["bshd", "sbhd", "thd"] and args.backends == ["te_fuser", "cudnn", "flash"]
    assert args.passes == ["fwd", "fwd+bwd"]
    for bad, option in ((["--layouts", "bhsd"], "--layouts"), (["--backends", "fa3"], "--backends"),
                        (["--passes", "bwd"], "--passes")):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert option in capsys.readouterr().err
    with pytest.raises(SystemExit) as help_exit:
        bench.parse_args(["--help"])
    assert help_exit.value.code == 0


@pytest.mark.parametrize("seqlen", [2048, 8192, 16384])
def test_thd_lengths_are_mixed_and_fill_the_tokens(seqlen):
    lengths = bench.thd_lengths(seqlen)
    assert sum(lengths) == bench.TOKENS and len(set(lengths)) > 1
    assert all(0 < n <= seqlen for n in lengths) and all(n >= seqlen // 8 for n in lengths[:-1])
    assert bench.case_lengths("bshd", seqlen) == [seqlen] * (bench.TOKENS // seqlen)


def test_flops_sum_over_sequences():
    assert bench.flops([4, 2], heads=3, head_dim=5, causal=False, backward=False) == 4 * 3 * 5 * (16 + 4)
    assert bench.flops([4], heads=1, head_dim=1, causal=True, backward=True) == 4 * 16 / 2 * 3.5


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
def test_the_timed_calls_run(layout, monkeypatch):
    """The module and SDPA calls the benchmark times, on small CPU inputs."""
    lengths = [24, 9, 31] if layout == "thd" else [16, 16]
    shape = (sum(lengths), 4, 32) if layout == "thd" else ((2, 16, 4, 32) if layout == "bshd" else (16, 2, 4, 32))
    qkv = tuple(torch.randn(shape).bfloat16() for _ in range(3))
    dout = torch.randn(shape).bfloat16().flatten(-2)
    kwargs = {}
    if layout == "thd":
        cu = torch.tensor([0, 24, 33, 64], dtype=torch.int32)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=31, max_seqlen_kv=31)
    for fp8 in (False, True):
        bench.module_run(layout, 4, 32, True, None, qkv, dout, kwargs, backward=True, fp8=fp8)()
    bench.module_run(layout, 4, 32, True, "unfused", qkv, dout, kwargs, backward=True)()
    if layout != "thd":  # torch's varlen flash op has no CPU kernel
        bench.sdpa_run("flash", layout, True, qkv, dout, kwargs, backward=True)()
    assert bench.sdpa_run("cudnn", "thd", True, qkv, dout, kwargs, backward=True) is None
