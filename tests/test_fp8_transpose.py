"""te_fuser::fp8_transpose (the CPU byte transpose behind Float8Tensor's transposed data) against torch's
own transpose of the same bytes, its errors, and its fake kernel under torch.compile."""

import pytest
import torch

from te_fuser.tensor.float8_tensor import fp8_transpose
from te_fuser.kernels import cpu, fp8

# AVX-512 CPUs transpose whole panels of 128 rows by up to 4096 columns, in blocks of 64 columns,
# and the rest in tiles: shapes with and without whole panels, blocks and tiles.
SHAPES = [(2048, 512), (67, 131), (3, 5, 72), (1, 16), (16,), (130, 7), (0, 4), (5, 0), (2, 128, 64),
          (300, 100), (257, 4200)]


def random_bytes(shape, dtype, generator):
    """Every byte value, NaN and infinity codes included: the transpose copies codes, it does not decode them."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).view(dtype)


def torch_transpose(data):
    rows = data.shape[:-1].numel()
    return data.view(torch.uint8).reshape(rows, data.shape[-1]).t().contiguous()


@pytest.mark.parametrize("isa", cpu.available_isa())
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_torch_byte_for_byte(shape, dtype, isa, generator):
    data = random_bytes(shape, dtype, generator)
    with cpu.isa(isa):
        out = fp8.transpose(data)
    assert out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), torch_transpose(data))


def test_float8_tensor_helper_takes_it_on_the_cpu(generator, monkeypatch):
    data = random_bytes((96, 40), torch.float8_e4m3fn, generator)
    calls, op = [], torch.ops.te_fuser.fp8_transpose
    monkeypatch.setattr(fp8._ops, "fp8_transpose", lambda d: calls.append(d) or op(d))
    assert torch.equal(fp8_transpose(data).view(torch.uint8), torch_transpose(data))
    assert len(calls) == 1
    # a non-contiguous view is made contiguous first, not refused
    view = random_bytes((40, 96), torch.float8_e5m2, generator).t()
    assert torch.equal(fp8_transpose(view).view(torch.uint8), torch_transpose(view.contiguous()))


def test_bad_inputs_raise_clear_errors(generator):
    with pytest.raises(TypeError, match="data must have dtype"):
        fp8.transpose(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="data must be contiguous"):
        fp8.transpose(random_bytes((4, 8), torch.float8_e4m3fn, generator).t())
    with pytest.raises(ValueError, match="at least 1 dimension"):
        fp8.transpose(random_bytes((), torch.float8_e4m3fn, generator))
    with pytest.raises(RuntimeError, match="data"):
        torch.ops.te_fuser.fp8_transpose(torch.zeros(4, 4))


def test_fake_kernel_and_compile(generator):
    # finite codes: opcheck compares eager and traced outputs as values, and NaN != NaN
    data = torch.randn(64, 48, generator=generator).to(torch.float8_e4m3fn)
    torch.library.opcheck(torch.ops.te_fuser.fp8_transpose, (data,),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    out = torch.compile(fp8.transpose, fullgraph=True)(data)
    assert torch.equal(out.view(torch.uint8), torch_transpose(data))
