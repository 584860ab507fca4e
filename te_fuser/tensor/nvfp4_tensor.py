"""NVFP4Tensor and NVFP4Quantizer: E2M1 values in blocks of 16 sharing an E4M3 scale, under a float32
per-tensor scale from the tensor's amax (TransformerEngine's NVFP4BlockScaling; docs/block_scaling.md).

Rowwise data is scaled in 1x16 blocks along the last dimension, packed two values a byte,
(*shape[:-1], shape[-1] / 2) uint8; columnwise data is the transposed matrix, (shape[-1],
prod(shape[:-1]) / 2), in 1x16 blocks of its own rows (16x1 blocks of the tensor). With
with_2d_quantization one scale covers each 16x16 block, for both usages; with with_rht the columnwise
data holds the random Hadamard transform of each 16 values (the weight-gradient GEMM's operands, whose
transforms cancel in the product). Scales are uint8 E4M3 codes in TE's padded shapes; the float32
amaxes `_amax_rowwise` / `_amax_columnwise` (after the transform) set each usage's global scale.

A matrix dimension that is not a multiple of 16 (TE refuses those) is quantized as the zero-padded
tensor: each packed row holds its values rounded up to 16 (the padding code 0, or under with_rht the
transform's spread of a partial group), so a last partial block's scale comes from the values present.
"""

import math
from typing import Optional, Tuple

import torch

from ..kernels import nvfp4 as kernels
from ..recipe import NVFP4BlockScaling
from ..te_dtype import DType
from ._block_scaled_tensor import (BUFFERS, BlockScaledQuantizer, BlockScaledTensor, _rebuild_block_scaled,
                                   traced_quantizer)

NVFP4_BLOCK_SCALING_SIZE = kernels.NVFP4_BLOCK

# The E4M3 code of each E2M1 code (sign and magnitude {0, 0.5, 1, 1.5, 2, 3, 4, 6}): every E2M1 value is one.
_E2M1_AS_E4M3 = torch.tensor([0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C,
                              0x80, 0xB0, 0xB8, 0xBC, 0xC0, 0xC4, 0xC8, 0xCC], dtype=torch.uint8)
# The two E4M3 codes of each packed byte (low nibble first), held as one int16 whose bytes they are, so
# unpacking a tensor is one lookup per byte.
_BYTE = torch.arange(256)
_BYTE_AS_E4M3_PAIR = torch.stack((_E2M1_AS_E4M3[_BYTE & 15], _E2M1_AS_E4M3[_BYTE >> 4]), dim=1).view(torch.int16)[:, 0]

# TE's fixed random signs of the wgrad transform (row j of the Hadamard matrix negated where -1).
_WGRAD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def get_wgrad_sign_vector(device=None) -> torch.Tensor:
    """The signs of the random Hadamard transform on the weight-gradient operands, float32."""
    return torch.tensor(_WGRAD_SIGNS, dtype=torch.float32, device=device)


def get_rht_matrix(device=None) -> torch.Tensor:
    """The transform's matrix M = diag(signs) H / 4 (H the 16x16 Sylvester Hadamard matrix), float32 and
    exact; a group of 16 values v becomes v @ M. M is orthogonal: M @ M.T = I."""
    index = torch.arange(16)
    parity = torch.tensor([[bin(i & j).count("1") % 2 for j in range(16)] for i in index.tolist()])
    hadamard = 1.0 - 2.0 * parity.to(torch.float32)
    return (get_wgrad_sign_vector()[:, None] * hadamard * 0.25).to(device)


class NVFP4Tensor(BlockScaledTensor):
    """A tensor quantized to NVFP4. Its rowwise values are `e2m1 * float32(scale * _amax_rowwise / 2688)`
    per 1x16 block; see BlockScaledTensor for the buffers and the module docstring for the layouts.
    `_columnwise_rht` says the columnwise data holds the Hadamard-transformed values."""

    _BUFFERS = BUFFERS + ("_amax_rowwise", "_amax_columnwise")
    SAVED_TENSORS = len(_BUFFERS)

    @classmethod
    def _check_data(cls, fp8_dtype, rowwise_data, columnwise_data) -> None:
        if fp8_dtype != torch.uint8:
            raise ValueError(f"fp8_dtype (the data's storage dtype) must be torch.uint8 for NVFP4, got {fp8_dtype!r}")
        for data in (rowwise_data, columnwise_data):
            if data is not None and data.dtype != torch.uint8:
                raise ValueError(f"NVFP4 data must be uint8 (two E2M1 values a byte), got {data.dtype}")

    def _set_meta(self, amax_rowwise=None, amax_columnwise=None, columnwise_rht: bool = False) -> None:
        self._amax_rowwise, self._amax_columnwise = amax_rowwise, amax_columnwise
        self._columnwise_rht = bool(columnwise_rht)

    def _meta(self) -> dict:
        return {"columnwise_rht": self._columnwise_rht}

    @property
    def _fp4_dtype(self) -> DType:
        return DType.kFloat4E2M1

    def _usage_matrix(self, columnwise: bool):
        """(data, scale, amax, n, m) of a usage, n x m the data's matrix: (rows, cols) rowwise, (cols, rows)
        columnwise, m rounded up to 16."""
        cols = self.shape[-1]
        rows = self.numel() // cols
        if columnwise:
            return (self._columnwise_data, self._columnwise_scale_inv, self._amax_columnwise, cols,
                    kernels.padded_len(rows))
        return self._rowwise_data, self._rowwise_scale_inv, self._amax_rowwise, rows, kernels.padded_len(cols)

    def _packed_operand(self, columnwise: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A usage as NVFP4's CPU GEMM takes it (te_fuser.kernels.gemm.nvfp4_gemm): (packed data (n, m / 2), E4M3
        scale codes (n, m / 16), amax), n x m as in _usage_matrix."""
        data, scale, amax, n, m = NVFP4Tensor._usage_matrix(self, columnwise)
        return data.reshape(n, m // 2).contiguous(), scale[:n, : m // NVFP4_BLOCK_SCALING_SIZE], amax

    def _codes_and_factors(self, columnwise: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """A usage's values as (E4M3 codes (n, m) of its E2M1 values, float32 decode factors (n, m / 16),
        float32(float32(scale * amax) * float32(1 / 2688))), n x m the data's matrix: (rows, cols)
        rowwise, (cols, rows) columnwise, m rounded up to 16 (the padding's codes 0 unless with_rht).
        Each value is exactly code * factor."""
        data, scale, amax, n, m = NVFP4Tensor._usage_matrix(self, columnwise)
        if data.device.type == "cpu":
            codes = kernels.e2m1_as_e4m3(data.reshape(n, m // 2).contiguous())
        else:
            packed = data.reshape(n * (m // 2)).to(torch.int32)
            codes = _BYTE_AS_E4M3_PAIR.to(data.device).index_select(0, packed).view(torch.float8_e4m3fn).reshape(n, m)
        block_scales = scale[:n, : m // NVFP4_BLOCK_SCALING_SIZE].contiguous().view(torch.float8_e4m3fn).float()
        return codes, block_scales * amax.reshape(()) * torch.tensor(1.0 / 2688.0, dtype=torch.float32)

    def _stored_values(self, columnwise: bool, dtype: torch.dtype) -> torch.Tensor:
        """A usage's values as its data holds them: (rows, cols) rowwise, (cols, rows) columnwise (the
        padding dropped), the Hadamard-transformed values when _columnwise_rht."""
        cols = self.shape[-1]
        if columnwise:
            data, scale, amax = self._columnwise_data, self._columnwise_scale_inv, self._amax_columnwise
            m = self.numel() // cols
        else:
            data, scale, amax = self._rowwise_data, self._rowwise_scale_inv, self._amax_rowwise
            m = cols
        values = kernels.nvfp4_dequantize(data.reshape(data.shape[0] if columnwise else -1, data.shape[-1]), scale,
                                          amax, dtype)
        return values if values.shape[1] == m else values[:, :m]

    def _dequantize_usage(self, columnwise: bool, dtype: torch.dtype) -> torch.Tensor:
        if not columnwise:
            return self._stored_values(False, dtype).reshape(self.shape)
        if not self._columnwise_rht:
            return self._stored_values(True, dtype).t().reshape(self.shape)
        # The exact values (code * factor), then the inverse transform (M.T), exact in float64 too: a block's
        # 16 values share one float32 factor. One rounding to float32 at the end.
        codes, factors = self._codes_and_factors(True)
        cols = self.shape[-1]
        groups = codes.double().reshape(codes.shape[0], -1, NVFP4_BLOCK_SCALING_SIZE) * factors.double()[..., None]
        values = (groups @ get_rht_matrix(codes.device).double().t()).reshape(codes.shape)[:, :self.numel() // cols]
        return values.to(torch.float32).to(dtype).t().reshape(self.shape)

    _ROW_BLOCK = NVFP4_BLOCK_SCALING_SIZE

    def _row_layout(self) -> dict:
        # Rowwise (rows, cols / 2) and scales per row; columnwise (cols, rows / 2), scales (cols, rows / 16).
        return {"_rowwise_data": (0, 1), "_rowwise_scale_inv": (0, 1), "_columnwise_data": (1, 2),
                "_columnwise_scale_inv": (1, NVFP4_BLOCK_SCALING_SIZE)}

    def _buffer_shape(self, name: str, shape) -> Tuple[int, ...]:
        columnwise = "columnwise" in name
        if name.startswith("_amax"):
            return (1,)
        if name.endswith("_data"):
            return tuple(kernels.nvfp4_data_shape(tuple(shape), columnwise))
        return kernels.nvfp4_scale_shape(tuple(shape), columnwise)

    def columnwise_from_rowwise(self) -> "NVFP4Tensor":
        """A new tensor holding only the columnwise usage, made from the rowwise usage of a tensor quantized
        in 16x16 blocks (with_2d_quantization, without the transform) without requantizing: the E2M1 codes
        transposed, each block's scale and the amax as they are (what a quantizer with both usages
        writes). A weight keeps its rowwise usage only and its dgrad reads this. Rowwise data in 1x16
        blocks gives other values than its quantizer's columnwise usage: only 2-D data may come here."""
        if self._rowwise_data is None:
            raise ValueError("columnwise_from_rowwise() needs the rowwise usage")
        cols = self.shape[-1]
        rows = self.numel() // cols
        if rows % NVFP4_BLOCK_SCALING_SIZE or cols % NVFP4_BLOCK_SCALING_SIZE:
            raise ValueError(f"columnwise_from_rowwise() needs 16x16 blocks, got a {rows}x{cols} matrix")
        packed = self._rowwise_data.reshape(rows, cols // 2)
        codes_t = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(rows, cols).t().reshape(cols, rows // 2, 2)
        data_t = codes_t[..., 0] | (codes_t[..., 1] << 4)
        blocks = self._rowwise_scale_inv[:rows:NVFP4_BLOCK_SCALING_SIZE, : cols // NVFP4_BLOCK_SCALING_SIZE]
        scale_t = self._rowwise_scale_inv.new_zeros(kernels.nvfp4_scale_shape(tuple(self.shape), True))
        scale_t[:cols, : rows // NVFP4_BLOCK_SCALING_SIZE] = blocks.t().repeat_interleave(NVFP4_BLOCK_SCALING_SIZE, 0)
        return NVFP4Tensor(self.shape, self.dtype, columnwise_data=data_t, columnwise_scale_inv=scale_t,
                           amax_columnwise=self._amax_rowwise, fp8_dtype=torch.uint8,
                           quantizer=traced_quantizer(self._quantizer))

    def __repr__(self, *, tensor_contents=None) -> str:
        usages = [u for u, name in (("rowwise", "_rowwise_data"), ("columnwise", "_columnwise_data"))
                  if getattr(self, name, None) is not None]
        return f"NVFP4Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, usages={usages or '<empty shell>'})"


class NVFP4Quantizer(BlockScaledQuantizer):
    """Quantizes a high-precision tensor to NVFP4 (TE's NVFP4Quantizer, both usages by default).

    with_2d_quantization: 16x16 blocks (TE uses them for weights); with_rht: the columnwise data is the
    random Hadamard transform's (TE: the wgrad operands), its amax taken after the transform
    (with_post_rht_amax, which follows with_rht unless given); stochastic_rounding: each quantize() draws a
    seed from torch's default CPU generator (so torch.manual_seed makes it reproducible), else round to
    nearest even. with_amax_reduction: the amaxes (rowwise, and the transformed columnwise one) are all-reduced
    (MAX) over amax_reduction_group (default: the whole world) before the tensor is quantized, so every rank's
    shard takes the global scale of the tensor the shards make up (TE's sequence-parallel gathers). Not
    implemented (NotImplementedError): with_random_sign_mask=False, with_rht without the post-transform amax."""

    def __init__(self, fp4_dtype=DType.kFloat4E2M1, rowwise: bool = True, columnwise: bool = True,
                 with_amax_reduction: bool = False, amax_reduction_group=None, with_rht: bool = False,
                 with_post_rht_amax: Optional[bool] = None, with_2d_quantization: bool = False,
                 stochastic_rounding: bool = False, with_random_sign_mask: bool = True):
        if fp4_dtype != DType.kFloat4E2M1:
            raise ValueError(f"fp4_dtype must be DType.kFloat4E2M1, got {fp4_dtype!r}")
        if not with_random_sign_mask:
            raise NotImplementedError("te_fuser's NVFP4Quantizer does not implement with_random_sign_mask=False "
                                      "(its transform always uses TE's wgrad signs)")
        with_post_rht_amax = bool(with_rht) if with_post_rht_amax is None else bool(with_post_rht_amax)
        if with_rht and not with_post_rht_amax:
            raise NotImplementedError("te_fuser's NVFP4Quantizer does not implement with_rht=True with "
                                      "with_post_rht_amax=False (the columnwise amax is the transformed values')")
        if with_rht and with_2d_quantization:
            raise ValueError("with_rht and with_2d_quantization cannot both be set (TE's recipe uses 2D blocks for "
                             "weights and the transform for the wgrad operands)")
        self.dtype = fp4_dtype
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.with_rht = bool(with_rht)
        self.with_post_rht_amax = with_post_rht_amax
        self.with_2d_quantization = bool(with_2d_quantization)
        self.stochastic_rounding = bool(stochastic_rounding)
        super().__init__(rowwise=rowwise, columnwise=columnwise)

    @property
    def rht_matrix(self) -> torch.Tensor:
        return get_rht_matrix()

    def _get_compatible_recipe(self):
        return NVFP4BlockScaling

    def quantize(self, x: torch.Tensor) -> NVFP4Tensor:
        if x.dim() < 1:
            raise ValueError("x must have at least 1 dimension to be quantized to NVFP4")
        seed = 0
        if self.stochastic_rounding:  # compiled, the graph draws it each run (an int would be a constant)
            seed = torch.randint(0, 2**62, ())
            seed = seed if torch.compiler.is_compiling() else int(seed)
        x = x.detach().contiguous()
        amaxes = self._group_amaxes(x) if self.with_amax_reduction else None
        data, scale, amax, col_data, col_scale, col_amax = kernels.nvfp4_quantize(
            x, self.rowwise, self.columnwise, self.with_2d_quantization, self.with_rht, self.stochastic_rounding,
            seed, amaxes=amaxes)
        return NVFP4Tensor(x.shape, x.dtype, rowwise_data=data, rowwise_scale_inv=scale, columnwise_data=col_data,
                           columnwise_scale_inv=col_scale, amax_rowwise=amax, amax_columnwise=col_amax,
                           fp8_dtype=torch.uint8, quantizer=traced_quantizer(self),
                           columnwise_rht=self.with_rht and self.columnwise)

    def _group_amaxes(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rowwise, columnwise) amaxes of x, each the group's maximum: one all-reduce of both."""
        if not torch.distributed.is_initialized():
            raise RuntimeError("with_amax_reduction=True needs torch.distributed to be initialized")
        own = kernels.nvfp4_amax(x)
        if self.columnwise and self.with_rht:
            own = torch.cat([own, kernels.nvfp4_amax(x, rht=True)])
        amaxes = own.clone()
        torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=self.amax_reduction_group)
        # The group's amax says nothing of this rank's Inf or NaN (the other ranks have already reduced, so no
        # rank waits on this one): refused here, as the kernel refuses them through its own amax. A CUDA tensor is
        # not checked (that would wait for the device), as the CUDA kernel does not check either.
        if x.device.type == "cpu" and not bool(torch.isfinite(own).all()):
            raise ValueError("x holds Inf or NaN, which NVFP4 cannot represent (no E2M1 code stands for them)")
        return amaxes[0:1], amaxes[-1:]

    def get_scale_shape(self, shape, columnwise: bool) -> Tuple[int, int]:
        return kernels.nvfp4_scale_shape(tuple(shape), columnwise)

    def get_columnwise_shape(self, shape) -> Tuple[int, ...]:
        shape = tuple(shape)
        return (shape[-1], *shape[:-1]) if shape else ()

    @staticmethod
    def convert_shape_for_fp4(shape) -> Tuple[int, ...]:
        """A shape with its last dimension halved: the packed data's (rounded up to 16 values first)."""
        return (*tuple(shape)[:-1], kernels.padded_len(shape[-1]) // 2)

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """TE's test: at least 2-D, both matrix dimensions multiples of 16 (te_fuser's kernels also take other
        sizes, as the zero-padded tensor)."""
        return inp.dim() >= 2 and inp.shape[-1] % NVFP4_BLOCK_SCALING_SIZE == 0 and \
            math.prod(inp.shape[:-1]) % NVFP4_BLOCK_SCALING_SIZE == 0

    def __repr__(self) -> str:
        return (f"NVFP4Quantizer(rowwise={self.rowwise}, columnwise={self.columnwise}, with_rht={self.with_rht}, "
                f"with_2d_quantization={self.with_2d_quantization}, stochastic_rounding={self.stochastic_rounding}, "
                f"with_amax_reduction={self.with_amax_reduction})")


torch.serialization.add_safe_globals([NVFP4Tensor, NVFP4Quantizer, _rebuild_block_scaled, DType])
