"""te_fuser's MoE token permutation (TE's moe_permute / moe_unpermute / moe_sort_chunks_by_index, C kernels)
against float64 references written here with explicit loops: the mask and index maps with tokens routed
nowhere, everywhere, topk 1, dropped tokens and empty inputs; forward and backward in float32, bfloat16 and
float16; gradcheck; FP8 inputs; the raw ops' fake kernels; bad arguments."""

import pytest
import torch

import te_fuser
from te_fuser import moe_permute, moe_permute_with_probs, moe_sort_chunks_by_index, moe_unpermute
from te_fuser import moe_sort_chunks_by_index_with_probs
from te_fuser.tensor.float8_tensor import Float8Tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


# -- references (float64, loops) -------------------------------------------------------------------
def mask_destinations(mask, num_out):
    """{(token, expert): row}: expert-major, tokens in order, rows at or past num_out dropped."""
    dst, row = {}, 0
    for e in range(mask.shape[1]):
        for t in range(mask.shape[0]):
            if mask[t, e]:
                if row < num_out:
                    dst[(t, e)] = row
                row += 1
    return dst


def index_destinations(index, num_out):
    """{(token, k): row}: the flattened choices t * topk + k stably sorted by expert."""
    tokens, topk = index.shape
    order = sorted(range(tokens * topk), key=lambda i: int(index[i // topk, i % topk]))  # sorted() is stable
    return {(i // topk, i % topk): row for row, i in enumerate(order) if row < num_out}


def ref_permute(x, dst, num_out):
    out = torch.zeros(num_out, x.shape[1], dtype=torch.float64)
    for (t, _), row in dst.items():
        out[row] = x[t].double()
    return out


def ref_unpermute(y, dst, weights, tokens):
    """out[t] = sum of y[row] * weight over t's slots (weight 1 without weights)."""
    out = torch.zeros(tokens, y.shape[1], dtype=torch.float64)
    for (t, c), row in dst.items():
        out[t] += y[row].double() * (1.0 if weights is None else float(weights[t, c]))
    return out


def routing(tokens, experts, generator, density=0.35):
    """A random mask with a token routed nowhere, one routed to every expert, and one expert no token uses."""
    mask = torch.rand(tokens, experts, generator=generator) < density
    mask[0] = False
    mask[1] = True
    mask[2:, -1] = False
    return mask


def rand(shape, dtype, generator):
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


# -- mask map --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("drop", [0, 5], ids=["all", "drop5"])
def test_mask_map_forward_backward(dtype, drop, generator):
    tokens, experts, hidden = 23, 6, 40
    mask = routing(tokens, experts, generator)
    num_out = int(mask.sum()) - drop
    dst = mask_destinations(mask, num_out)
    x = rand((tokens, hidden), dtype, generator).requires_grad_()
    out, row_id_map = moe_permute(x, mask, num_out_tokens=num_out)
    assert row_id_map.dtype == torch.int32 and row_id_map.shape == (tokens, 2 * experts + 1)
    assert torch.equal(out.double(), ref_permute(x.detach(), dst, num_out))  # a gather: exact

    g = rand((num_out, hidden), dtype, generator)
    out.backward(g)
    torch.testing.assert_close(x.grad.double(), ref_unpermute(g, dst, None, tokens), **TOL[dtype])

    # unpermute with merging probs (routed entries only, as a router gives them)
    probs = (torch.rand(tokens, experts, generator=generator, dtype=torch.float64) * mask).to(dtype).requires_grad_()
    y = out.detach().requires_grad_()
    merged = moe_unpermute(y, row_id_map, probs, restore_shape=x.shape)
    torch.testing.assert_close(merged.double(), ref_unpermute(y.detach(), dst, probs.detach(), tokens), **TOL[dtype])
    gm = rand((tokens, hidden), dtype, generator)
    merged.backward(gm)
    ref_dy = torch.zeros(num_out, hidden, dtype=torch.float64)
    ref_dp = torch.zeros(tokens, experts, dtype=torch.float64)
    for (t, e), row in dst.items():
        ref_dy[row] = gm[t].double() * float(probs.detach()[t, e])
        ref_dp[t, e] = (y[row].double() * gm[t].double()).sum()
    torch.testing.assert_close(y.grad.double(), ref_dy, **TOL[dtype])
    torch.testing.assert_close(probs.grad.double(), ref_dp, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * hidden)
    assert probs.grad.dtype == dtype
    # a dropped slot's probability gets no gradient
    for t in range(tokens):
        for e in range(experts):
            if (t, e) not in dst:
                assert probs.grad[t, e] == 0


def test_mask_map_layout_of_tes_example():
    """TE's documented example: per token the destination rows in descending order, their experts, the count."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.int32)
    _, row_id_map = moe_permute(torch.randn(5, 8), mask, num_out_tokens=7)
    routed = [(row_id_map[t, :int(row_id_map[t, 6])].tolist(), row_id_map[t, 3:3 + int(row_id_map[t, 6])].tolist())
              for t in range(5)]
    assert routed == [([3, 0], [1, 0]), ([5, 1], [2, 0]), ([6], [2]), ([4, 2], [1, 0]), ([], [])]


def test_unpermute_sums_in_float32():
    """bf16 terms summed in float32 and rounded once: 1 + 2^-8 + 2^-8 is 1 + 2^-7 (a bf16 value), while bf16
    additions would round each 1 + 2^-8 (a tie) back to 1."""
    mask = torch.tensor([[True, True, True]])
    _, row_id_map = moe_permute(torch.zeros(1, 1, dtype=torch.bfloat16), mask, num_out_tokens=3)
    rows = torch.tensor([[2.0 ** -8], [2.0 ** -8], [1.0]], dtype=torch.bfloat16)
    merged = moe_unpermute(rows, row_id_map, restore_shape=(1, 1))
    assert merged.item() == 1.0 + 2.0 ** -7


def test_unpermute_accumulation_order_is_descending_expert():
    """float32 sums depend on their order: the kernel adds expert 2's row first, then 1's, then 0's, so
    (-1e8 + 1e8) + 1 = 1, where the ascending order would give (1 + 1e8) - 1e8 = 0."""
    mask = torch.tensor([[True, True, True]])
    _, row_id_map = moe_permute(torch.zeros(1, 1), mask, num_out_tokens=3)
    rows = torch.tensor([[1.0], [1e8], [-1e8]])  # rows 0, 1, 2 are experts 0, 1, 2
    merged = moe_unpermute(rows, row_id_map, restore_shape=(1, 1))
    assert merged.item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_with_probs(dtype, generator):
    tokens, experts, hidden = 19, 5, 24
    mask = routing(tokens, experts, generator, density=0.5)
    num_out = int(mask.sum())
    dst = mask_destinations(mask, num_out)
    probs = (torch.rand(tokens, experts, generator=generator, dtype=torch.float64) * mask)
    pad = next(iter(k for k in dst if k[0] > 1))
    probs[pad] = 0.0  # a padding slot: routed with probability zero
    probs = probs.to(dtype).requires_grad_()
    x = rand((tokens, hidden), dtype, generator).requires_grad_()
    out, permuted_probs, row_id_map = moe_permute_with_probs(x, probs, mask, num_out_tokens=num_out)
    ref = ref_permute(x.detach(), dst, num_out)
    ref[dst[pad]] = 0.0
    assert torch.equal(out.double(), ref)
    ref_probs = torch.zeros(num_out, dtype=torch.float64)
    for (t, e), row in dst.items():
        ref_probs[row] = float(probs.detach()[t, e])
    assert permuted_probs.dtype == dtype and torch.equal(permuted_probs.double(), ref_probs)
    g, gp = rand((num_out, hidden), dtype, generator), rand((num_out,), dtype, generator)
    torch.autograd.backward([out, permuted_probs], [g, gp])
    ref_dp = torch.zeros(tokens, experts, dtype=torch.float64)
    for (t, e), row in dst.items():
        ref_dp[t, e] = float(gp[row])
    assert torch.equal(probs.grad.double(), ref_dp)
    # TE's backward sends the gradient of a padding row to its token all the same
    torch.testing.assert_close(x.grad.double(), ref_unpermute(g, dst, None, tokens), **TOL[dtype])


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_mask_map_gradcheck(generator):
    """float32 with loose tolerances (the kernels take no float64); the ops are (bi)linear, so central
    differences are exact but for rounding."""
    tokens, experts, hidden = 7, 4, 5
    mask = routing(tokens, experts, generator, density=0.5)
    num_out = int(mask.sum()) - 2
    x = torch.randn(tokens, hidden, generator=generator).requires_grad_()
    probs = (torch.rand(tokens, experts, generator=generator) * mask + 0.1).requires_grad_()

    def round_trip(x, probs):
        out, permuted_probs, row_id_map = moe_permute_with_probs(x, probs, mask, num_out_tokens=num_out)
        return moe_unpermute(out * permuted_probs[:, None], row_id_map, probs, restore_shape=x.shape)

    assert torch.autograd.gradcheck(round_trip, (x, probs), eps=1e-2, atol=2e-3, rtol=1e-2)


# -- index map -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topk,drop", [(1, 0), (2, 0), (3, 7)])
def test_index_map_forward_backward(dtype, topk, drop, generator):
    tokens, experts, hidden = 21, 5, 36
    index = torch.stack([torch.randperm(experts, generator=generator)[:topk] for _ in range(tokens)]).to(torch.int32)
    index[:4] = index[0]  # four tokens choosing the same experts
    num_out = tokens * topk - drop
    dst = index_destinations(index, num_out)
    x = rand((tokens, hidden), dtype, generator).requires_grad_()
    out, row_id_map = moe_permute(x, index, num_out_tokens=num_out if drop else -1, map_type="index")
    assert row_id_map.dtype == torch.int32 and row_id_map.shape == (tokens * topk,)
    for (t, k), row in dst.items():
        assert row_id_map[k * tokens + t] == row
    assert int((row_id_map == -1).sum()) == drop
    assert torch.equal(out.double(), ref_permute(x.detach(), dst, num_out))
    g = rand((num_out, hidden), dtype, generator)
    out.backward(g)
    torch.testing.assert_close(x.grad.double(), ref_unpermute(g, dst, None, tokens), **TOL[dtype])

    probs = torch.rand(tokens, topk, generator=generator).requires_grad_()  # TE's index path: float32 probs
    y = out.detach().requires_grad_()
    merged = moe_unpermute(y, row_id_map, probs, map_type="index")
    torch.testing.assert_close(merged.double(), ref_unpermute(y.detach(), dst, probs.detach(), tokens), **TOL[dtype])
    gm = rand((tokens, hidden), dtype, generator)
    merged.backward(gm)
    ref_dy = torch.zeros(num_out, hidden, dtype=torch.float64)
    ref_dp = torch.zeros(tokens, topk, dtype=torch.float64)
    for (t, k), row in dst.items():
        ref_dy[row] = gm[t].double() * float(probs.detach()[t, k])
        ref_dp[t, k] = (y[row].double() * gm[t].double()).sum()
    torch.testing.assert_close(y.grad.double(), ref_dy, **TOL[dtype])
    torch.testing.assert_close(probs.grad.double(), ref_dp, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * hidden)


def test_index_map_with_sparse_expert_ids(generator):
    """Expert ids far apart (up to 2^31 - 1) sort as their dense ranks would."""
    index = torch.tensor([[2 ** 31 - 1, 7], [7, 100000], [0, 2 ** 31 - 1]], dtype=torch.int32)
    x = torch.randn(3, 4, generator=generator)
    out, row_id_map = moe_permute(x, index, map_type="index")
    dst = index_destinations(index, 6)
    assert torch.equal(out.double(), ref_permute(x, dst, 6))


def test_index_unpermute_without_probs_restores_each_choice(generator):
    """Without probs TE's index unpermute gives one row per choice (tokens * topk rows), zero where dropped."""
    tokens, topk = 6, 2
    index = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]], dtype=torch.int32)
    x = torch.randn(tokens, 3, generator=generator)
    out, row_id_map = moe_permute(x, index, num_out_tokens=9, map_type="index")
    back = moe_unpermute(out, row_id_map, map_type="index")
    assert back.shape == (tokens * topk, 3)
    for i in range(tokens * topk):
        row = int(row_id_map[i])
        assert torch.equal(back[i], out[row] if row >= 0 else torch.zeros(3))


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_index_map_gradcheck(generator):
    tokens, topk, hidden = 6, 2, 4
    index = torch.tensor([[0, 3], [3, 1], [2, 0], [1, 2], [0, 1], [3, 2]], dtype=torch.int32)
    x = torch.randn(tokens, hidden, generator=generator).requires_grad_()
    probs = torch.rand(tokens, topk, generator=generator).requires_grad_()

    def round_trip(x, probs):
        out, row_id_map = moe_permute(x, index, num_out_tokens=10, map_type="index")
        return moe_unpermute(out * 2.0, row_id_map, probs, map_type="index")

    assert torch.autograd.gradcheck(round_trip, (x, probs), eps=1e-2, atol=2e-3, rtol=1e-2)


# -- chunk sort ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_sort_chunks(dtype, generator):
    sizes = torch.tensor([3, 0, 5, 1, 4])
    order = torch.tensor([4, 2, 0, 1, 3])
    tokens = int(sizes.sum())
    x = rand((tokens, 9), dtype, generator).requires_grad_()
    probs = torch.rand(tokens, generator=generator).requires_grad_()
    out, permuted_probs = moe_sort_chunks_by_index_with_probs(x, probs, sizes, order)
    starts = [sum(sizes.tolist()[:c]) for c in range(len(sizes))]
    rows = [starts[c] + r for c in order.tolist() for r in range(int(sizes[c]))]
    assert torch.equal(out, x.detach()[rows]) and torch.equal(permuted_probs, probs.detach()[rows])
    assert torch.equal(moe_sort_chunks_by_index(x, sizes, order), out)
    g, gp = rand((tokens, 9), dtype, generator), torch.rand(tokens, generator=generator)
    torch.autograd.backward([out, permuted_probs], [g, gp])
    ref, ref_p = torch.zeros_like(g), torch.zeros_like(gp)
    for i, r in enumerate(rows):
        ref[r], ref_p[r] = g[i], gp[i]
    assert torch.equal(x.grad, ref) and torch.equal(probs.grad, ref_p)


# -- empty inputs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_inputs(dtype):
    x = torch.empty(0, 16, dtype=dtype, requires_grad=True)
    probs = torch.empty(0, 4, dtype=dtype, requires_grad=True)
    out, permuted_probs, row_id_map = moe_permute_with_probs(x, probs, torch.empty(0, 4, dtype=torch.bool), 0)
    merged = moe_unpermute(out, row_id_map, probs, restore_shape=x.shape)
    assert out.shape == (0, 16) and merged.shape == (0, 16)
    merged.sum().backward()
    assert x.grad.shape == (0, 16) and probs.grad.shape == (0, 4)
    y, index_map = moe_permute(x.detach(), torch.empty(0, 2, dtype=torch.int32), map_type="index")
    assert y.shape == (0, 16) and index_map.numel() == 0
    assert moe_sort_chunks_by_index(x.detach(), torch.tensor([0, 0]), torch.tensor([1, 0])).shape == (0, 16)


# -- FP8 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_in_fp8_out(fp8_dtype, generator):
    tokens, experts, hidden = 17, 4, 32
    x = torch.randn(tokens, hidden, generator=generator)
    quantizer = te_fuser.Float8CurrentScalingQuantizer(fp8_dtype=fp8_dtype, device="cpu")
    xq = quantizer(x)
    mask = routing(tokens, experts, generator)
    num_out = int(mask.sum()) - 3
    dst = mask_destinations(mask, num_out)
    out, _ = moe_permute(xq, mask, num_out_tokens=num_out)
    assert isinstance(out, Float8Tensor) and out.fp8_dtype == fp8_dtype and out.dtype == xq.dtype
    assert torch.equal(out._scale_inv, xq._scale_inv)
    codes = xq._data
    for (t, _), row in dst.items():
        assert torch.equal(out._data[row], codes[t])
    torch.testing.assert_close(out.dequantize().double(), ref_permute(xq.dequantize(), dst, num_out), rtol=0, atol=0)
    index = torch.randint(0, experts, (tokens, 2), generator=generator, dtype=torch.int32)
    out_i, _ = moe_permute(xq, index, map_type="index")
    dst_i = index_destinations(index, tokens * 2)
    assert isinstance(out_i, Float8Tensor)
    assert torch.equal(out_i.dequantize().double(), ref_permute(xq.dequantize(), dst_i, tokens * 2))
    sorted_fp8 = moe_sort_chunks_by_index(xq, torch.tensor([10, 7]), torch.tensor([1, 0]))
    assert isinstance(sorted_fp8, Float8Tensor)
    assert torch.equal(sorted_fp8._data, torch.cat([codes[10:], codes[:10]]))


def test_fp8_gradient_of_unpermute_stays_fp8(generator):
    """moe_unpermute without probs: its backward permutes an FP8 gradient as FP8 (TE does the same)."""
    mask = routing(9, 3, generator, density=0.6)
    num_out = int(mask.sum())
    _, row_id_map = moe_permute(torch.zeros(9, 8), mask, num_out_tokens=num_out)
    y = torch.randn(num_out, 8, generator=generator, requires_grad=True)
    merged = moe_unpermute(y, row_id_map, restore_shape=(9, 8))
    grad = te_fuser.Float8CurrentScalingQuantizer(fp8_dtype=torch.float8_e4m3fn, device="cpu")(torch.randn(9, 8))
    (dy,) = torch.autograd.grad(merged, y, grad)
    dst = mask_destinations(mask, num_out)
    assert isinstance(dy, Float8Tensor) and torch.equal(dy._scale_inv, grad._scale_inv)
    assert torch.equal(dy.dequantize().double(), ref_permute(grad.dequantize(), dst, num_out))


@pytest.mark.parametrize("kind", ["mxfp8", "block_1x128"])
def test_block_scaled_rows_and_scales_permuted(kind, generator):
    """MXFP8 and 1x128-block inputs: each output row holds its token's codes and per-row scales, exactly."""
    from te_fuser.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from te_fuser.tensor.mxfp8_tensor import MXFP8Quantizer

    tokens, experts, hidden = 128, 3, 256
    if kind == "mxfp8":
        quantizer = MXFP8Quantizer(fp8_dtype=torch.float8_e4m3fn, rowwise=True, columnwise=False)
    else:
        quantizer = Float8BlockQuantizer(fp8_dtype=torch.float8_e4m3fn, rowwise=True, columnwise=False,
                                         block_scaling_dim=1)
    xq = quantizer(torch.randn(tokens, hidden, generator=generator) * torch.rand(tokens, 1, generator=generator))
    row_scales = xq._rowwise_scale_inv if kind == "mxfp8" else xq._rowwise_scale_inv.T
    mask = routing(tokens, experts, generator)
    num_out = int(mask.sum()) - 2
    dst = mask_destinations(mask, num_out)
    out, _ = moe_permute(xq, mask, num_out_tokens=num_out)
    assert type(out) is type(xq)
    out_scales = out._rowwise_scale_inv if kind == "mxfp8" else out._rowwise_scale_inv.T
    assert out_scales.shape[0] == num_out
    for (t, _), row in dst.items():
        assert torch.equal(out._rowwise_data[row].view(torch.uint8), xq._rowwise_data[t].view(torch.uint8))
        assert torch.equal(out_scales[row], row_scales[t])
    assert torch.equal(out.dequantize().double(), ref_permute(xq.dequantize(), dst, num_out))


@pytest.mark.parametrize("kind", ["mxfp8", "block_1x128"])
def test_block_scaled_quantizers_as_tes_test_builds_them(kind, generator):
    """TE's test_permutation.py builds its FP8 inputs with TE's DType, make_empty and update_quantized."""
    from te_fuser.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from te_fuser.tensor.mxfp8_tensor import MXFP8Quantizer
    from te_fuser.te_dtype import DType

    if kind == "mxfp8":
        quantizer = MXFP8Quantizer(fp8_dtype=DType.kFloat8E5M2, rowwise=True, columnwise=False)
    else:
        quantizer = Float8BlockQuantizer(fp8_dtype=DType.kFloat8E5M2, rowwise=True, columnwise=False,
                                         amax_epsilon=0.0, force_pow_2_scales=True, block_scaling_dim=1)
    x = torch.rand(128, 64, generator=generator)
    empty = quantizer.make_empty(x.shape, dtype=x.dtype, device=x.device)
    quantizer.update_quantized(x, empty)
    direct = quantizer(x)
    assert torch.equal(empty._rowwise_data.view(torch.uint8), direct._rowwise_data.view(torch.uint8))
    assert torch.equal(empty._rowwise_scale_inv, direct._rowwise_scale_inv)
    mask = routing(128, 3, generator)
    num_out = int(mask.sum())
    out, _ = moe_permute(empty, mask, num_out_tokens=num_out)
    assert torch.equal(out.dequantize().double(), ref_permute(direct.dequantize(), mask_destinations(mask, num_out),
                                                              num_out))


# -- the raw ops under torch.compile's checks ------------------------------------------------------
def test_opcheck_fake_kernels(generator):
    ops = torch.ops.te_fuser
    mask = routing(8, 3, generator)
    mask_map = ops.moe_mask_row_id_map(mask, int(mask.sum()))
    index = torch.randint(0, 3, (8, 2), generator=generator, dtype=torch.int32)
    index_map = ops.moe_index_row_id_map(index, 3, 16)
    x = torch.randn(8, 5, generator=generator)
    w = torch.rand(8, 3, generator=generator)
    permuted, permuted_w = ops.moe_permute_rows(x, mask_map, 0, int(mask.sum()), w)
    chunk_map = ops.moe_chunk_sort_map(torch.tensor([3, 5]), torch.tensor([1, 0]), 8)
    cases = [
        (ops.moe_mask_row_id_map, (mask, int(mask.sum()))),
        (ops.moe_index_row_id_map, (index, 3, 16)),
        (ops.moe_permute_rows, (x, mask_map, 0, int(mask.sum()), w)),
        (ops.moe_permute_rows, (x, index_map, 1, 16, None)),
        (ops.moe_unpermute_rows, (permuted, mask_map, 0, w, 8)),
        (ops.moe_unpermute_backward, (x, permuted, mask_map, 0, w)),
        (ops.moe_unpermute_probs, (permuted_w, mask_map, 0)),
        (ops.moe_chunk_sort_map, (torch.tensor([3, 5]), torch.tensor([1, 0]), 8)),
        (ops.moe_sort_rows, (x, chunk_map, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


# -- bad arguments ---------------------------------------------------------------------------------
def test_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="map_type"):
        moe_permute(x, torch.ones(4, 2, dtype=torch.bool), map_type="dense")
    with pytest.raises(ValueError, match="routing_map has 3 rows"):
        moe_permute(x, torch.ones(3, 2, dtype=torch.bool), num_out_tokens=6)
    with pytest.raises(ValueError, match="negative expert index"):
        moe_permute(x, torch.tensor([[0], [1], [-1], [0]], dtype=torch.int32), map_type="index")
    with pytest.raises(ValueError, match="inp must be 2-D"):
        moe_permute(torch.randn(4), torch.ones(4, 2, dtype=torch.bool))
    _, row_id_map = moe_permute(x, torch.ones(4, 2, dtype=torch.bool), num_out_tokens=8)
    with pytest.raises(ValueError, match="both merging_probs and probs"):
        moe_unpermute(torch.randn(8, 8), row_id_map, torch.ones(4, 2), probs=torch.ones(4, 2))
    with pytest.raises(ValueError, match="merging_probs must have shape"):
        moe_unpermute(torch.randn(8, 8), row_id_map, torch.ones(4, 3), restore_shape=(4, 8))
    with pytest.raises(ValueError, match="restore_shape"):
        moe_unpermute(torch.randn(8, 8), row_id_map)
    broken = row_id_map.clone()
    broken[0, 0] = 99
    with pytest.raises(RuntimeError, match="outside its range"):
        moe_unpermute(torch.randn(8, 8), broken, restore_shape=(4, 8))
    with pytest.raises(ValueError, match="permutation"):
        moe_sort_chunks_by_index(x, torch.tensor([2, 2]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="add up to"):
        moe_sort_chunks_by_index(x, torch.tensor([2, 3]), torch.tensor([1, 0]))


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_probs_gradient_holds_over_a_long_hidden_size(map_type, generator):
    """The merging probs' gradient is a dot product over the hidden size; with 8192 positive terms a float32
    running sum drifts by ~1e-5 relative, beyond TE's float32 tolerance (1e-6) that its tree sum meets."""
    tokens, hidden = 6, 8192
    x = torch.rand(tokens, hidden, generator=generator)
    if map_type == "mask":
        routing_map = torch.ones(tokens, 2, dtype=torch.bool)
        probs = torch.rand(tokens, 2, generator=generator, requires_grad=True)
    else:
        routing_map = torch.tensor([[0, 1], [1, 0]] * 3, dtype=torch.int32)
        probs = torch.rand(tokens, 2, generator=generator, requires_grad=True)
    out, row_id_map = moe_permute(x, routing_map, num_out_tokens=tokens * 2, map_type=map_type)
    kwargs = {"restore_shape": x.shape} if map_type == "mask" else {}
    g = torch.rand(tokens, hidden, generator=generator)
    moe_unpermute(out, row_id_map, probs, map_type=map_type, **kwargs).backward(g)
    ref = (x.double() * g.double()).sum(1, keepdim=True).expand(tokens, 2)  # every slot holds its token's row
    torch.testing.assert_close(probs.grad.double(), ref, rtol=1e-6, atol=1e-6)
