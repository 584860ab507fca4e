"""KV caching for inference: TransformerEngine's InferenceParams and its paged and non-paged cache managers.

A workflow, as in TE:

    inference_params = InferenceParams(max_batch_size, max_sequence_length, num_heads_kv, head_dim_k, dtype)
    for each iteration:
        step_dict = OrderedDict(zip(seq_ids, step_lens))  # the sequences of this step, their new tokens
        inference_params.pre_step(step_dict)
        out = model(new_tokens, inference_params=inference_params, ...)  # attn_mask_type "padding(_causal)"

The batch of a step lists the sequences in step_dict's order: those that continue, in the order they had,
then the new ones. A continuing sequence absent from step_dict has finished: its cache rows (non-paged) or
pages (paged) are free for others. New tokens are written into the cache in place; the cache tensors of a
layer are allocated once (allocate_memory, or the first MultiheadAttention call) and kept until the
InferenceParams is dropped; reset() forgets the sequences, not the memory.

The caches are bshd: non-paged [max_batch_size, max_sequence_length, heads, dim], row b holding the b-th
sequence of the current batch; paged [total_num_pages, page_size, heads, dim], a sequence's tokens in the
pages its page_table row lists, pages taken from a free list as it grows and returned when it finishes.
Where TE 2.6 advances a continuing sequence by one token, te_fuser advances it by its step_dict length
(the same for TE's one-token steps), so a continuing sequence may also take several tokens.
"""

from collections import OrderedDict, deque
from typing import List, Optional

import torch

__all__ = ["InferenceParams", "KVCacheManager", "NonPagedKVCacheManager", "PagedKVCacheManager"]

QKV_FORMATS = ("bshd", "sbhd", "thd")
CACHE_QKV_FORMAT = "bshd"


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def token_indices(cu_new_seqlens: torch.Tensor, cu_cached_seqlens: torch.Tensor, batch_size: int):
    """(batch index, index within the step, position in the sequence) of every new token of a step, in the
    packed (thd) order; cu_cached_seqlens counts the tokens after the step."""
    new = (cu_new_seqlens[1:batch_size + 1] - cu_new_seqlens[:batch_size]).long()
    total = (cu_cached_seqlens[1:batch_size + 1] - cu_cached_seqlens[:batch_size]).long()
    batch = torch.repeat_interleave(torch.arange(batch_size, device=new.device), new)
    within = torch.arange(batch.numel(), device=new.device) - cu_new_seqlens[:batch_size].long()[batch]
    return batch, within, (total - new)[batch] + within


def new_tokens(t: torch.Tensor, qkv_format: str, batch: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
    """The new tokens of t (in qkv_format), packed: [tokens, heads, dim]."""
    if qkv_format == "bshd":
        return t[batch, within]
    if qkv_format == "sbhd":
        return t[within, batch]
    return t[:batch.numel()]


def check_inference_params(inference_params) -> None:
    if not isinstance(inference_params, InferenceParams):
        raise TypeError(f"inference_params must be an InferenceParams, got {type(inference_params).__name__}")


class KVCacheManager:
    """The base of TE's cache managers: cache[layer_number] = (k_cache, v_cache); sequences {seq_id: length}."""

    def __init__(self):
        self.cache = {}
        self.sequences = OrderedDict()

    def reset(self):
        self.sequences = OrderedDict()

    def allocate_memory(self, layer_number: int):
        self.cache[layer_number] = (None, None)

    def pre_step(self, step_dict: OrderedDict):
        return self.sequences

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, cu_new_seqlens: torch.Tensor,
             cu_cached_seqlens: torch.Tensor, qkv_format: str):
        return self.cache[layer_number]


class _PreallocatedCache(KVCacheManager):
    """What both managers share: the shapes, the one allocation per layer, the sequence bookkeeping."""

    def __init__(self, rows: int, row_len: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 max_batch_size: int, max_seqlen: int, head_dim_v: Optional[int], device):
        super().__init__()
        self.max_batch_size = max_batch_size
        self.max_seqlen = max_seqlen
        self.num_heads = num_heads
        self.head_dim_k = head_dim_k
        self.head_dim_v = head_dim_v if head_dim_v is not None else head_dim_k
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else _default_device()
        self._rows, self._row_len = rows, row_len

    def allocate_memory(self, layer_number: int):
        """Allocate layer_number's K and V caches; a layer that has them keeps them (its memory is reused)."""
        if layer_number in self.cache:
            return
        shape = (self._rows, self._row_len, self.num_heads)
        self.cache[layer_number] = (torch.zeros(*shape, self.head_dim_k, dtype=self.dtype, device=self.device),
                                    torch.zeros(*shape, self.head_dim_v, dtype=self.dtype, device=self.device))

    def _advance(self, step_dict: OrderedDict):
        """Check step_dict against the tracked sequences; (finished ids, new sequences' lengths by id)."""
        if not isinstance(step_dict, dict) or not step_dict:
            raise ValueError(f"step_dict must be a non-empty OrderedDict {{seq_id: new tokens}}, got {step_dict!r}")
        if len(step_dict) > self.max_batch_size:
            raise ValueError(f"step_dict has {len(step_dict)} sequences, more than max_batch_size="
                             f"{self.max_batch_size}")
        for seq, count in step_dict.items():
            if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
                raise ValueError(f"step_dict[{seq!r}] must be a positive int (the step's new tokens), got {count!r}")
            if self.sequences.get(seq, 0) + count > self.max_seqlen:
                raise ValueError(f"sequence {seq!r} would hold {self.sequences.get(seq, 0) + count} tokens, more "
                                 f"than max_sequence_length={self.max_seqlen}")
        ids = list(step_dict)
        continuing = [seq for seq in self.sequences if seq in step_dict]
        if ids[:len(continuing)] != continuing:
            raise ValueError(f"step_dict must list the continuing sequences first, in their previous order "
                             f"{continuing}, then the new ones; got {ids}")
        finished = [seq for seq in self.sequences if seq not in step_dict]
        return finished, ids[len(continuing):]

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, cu_new_seqlens: torch.Tensor,
             cu_cached_seqlens: torch.Tensor, qkv_format: str):
        """Write the new tokens of new_k and new_v (in qkv_format) into layer_number's caches, in place."""
        if layer_number not in self.cache:
            self.allocate_memory(layer_number)
        k_cache, v_cache = self.cache[layer_number]
        batch, within, position = token_indices(cu_new_seqlens, cu_cached_seqlens, len(self.sequences))
        rows, offsets = self._slots(batch, position)
        k_cache[rows, offsets] = new_tokens(new_k, qkv_format, batch, within).to(k_cache.dtype)
        v_cache[rows, offsets] = new_tokens(new_v, qkv_format, batch, within).to(v_cache.dtype)
        return k_cache, v_cache


class NonPagedKVCacheManager(_PreallocatedCache):
    """One cache row per batch entry: [max_batch_size, max_seqlen, num_heads, head_dim] per layer.

    When sequences finish, the rows of those that continue move up in place (row b of the cache is always
    the b-th sequence of the batch, as the attention reads cache[:batch_size])."""

    def __init__(self, max_batch_size: int, max_seqlen: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 head_dim_v: Optional[int] = None, device=None):
        super().__init__(max_batch_size, max_seqlen, num_heads, head_dim_k, dtype, max_batch_size, max_seqlen,
                         head_dim_v, device)

    def pre_step(self, step_dict: OrderedDict):
        finished, new_ids = self._advance(step_dict)
        old_rows = {seq: row for row, seq in enumerate(self.sequences)}
        for seq in finished:
            self.sequences.pop(seq)
        # Continuing sequences keep their order, so each moves to a row at or before its own: copying them
        # in order never overwrites a row still to be read.
        for row, (seq, length) in enumerate(self.sequences.items()):
            if old_rows[seq] != row:
                for k_cache, v_cache in self.cache.values():
                    k_cache[row, :length].copy_(k_cache[old_rows[seq], :length])
                    v_cache[row, :length].copy_(v_cache[old_rows[seq], :length])
        for seq in self.sequences:
            self.sequences[seq] += step_dict[seq]
        for seq in new_ids:
            self.sequences[seq] = step_dict[seq]
        return self.sequences

    def _slots(self, batch, position):
        return batch, position


class PagedKVCacheManager(_PreallocatedCache):
    """Pages of page_size tokens, [total_num_pages, page_size, num_heads, head_dim] per layer, shared by
    all sequences through page_table [max_batch_size, max_seqlen // page_size] (row b: the page ids of the
    b-th sequence of the batch, in order; unused entries 0)."""

    def __init__(self, total_num_pages: int, page_size: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 max_batch_size: int, max_seqlen: int, head_dim_v: Optional[int] = None, device=None):
        super().__init__(total_num_pages, page_size, num_heads, head_dim_k, dtype, max_batch_size, max_seqlen,
                         head_dim_v, device)
        self.total_num_pages = total_num_pages
        self.page_size = page_size
        self.max_pages_per_seq = max_seqlen // page_size
        self.page_table = torch.zeros(max_batch_size, self.max_pages_per_seq, dtype=torch.int32, device=self.device)
        self.reset()

    def reset(self):
        super().reset()
        self.free_pages = deque(range(self.total_num_pages))
        self.allocated_pages = {}
        self.page_table.fill_(0)

    def get_sequence_count(self) -> int:
        return len(self.sequences)

    def get_sequence_lengths(self) -> List[int]:
        return list(self.sequences.values())

    def has_free_page(self) -> bool:
        return len(self.free_pages) > 0

    def get_page_count(self, seq) -> int:
        return len(self.allocated_pages.get(seq, ()))

    def get_page_list(self, seq) -> List[int]:
        return list(self.allocated_pages.get(seq, ()))

    def allocate_page(self, seq):
        if not self.free_pages:
            raise RuntimeError(f"KV cache is full: all total_num_pages={self.total_num_pages} pages are in use")
        self.allocated_pages.setdefault(seq, []).append(self.free_pages.popleft())

    def allocate_sequence(self, seq, context_len: int):
        for _ in range(-(-context_len // self.page_size) - self.get_page_count(seq)):
            self.allocate_page(seq)

    def deallocate_sequence(self, seq):
        self.free_pages.extend(self.allocated_pages.pop(seq, ()))

    def get_page_table(self, sequences: List) -> torch.Tensor:
        rows = [self.get_page_list(seq) + [0] * (self.max_pages_per_seq - self.get_page_count(seq))
                for seq in sequences]
        if rows:
            self.page_table[:len(rows)].copy_(torch.tensor(rows, dtype=torch.int32))
        return self.page_table

    def pre_step(self, step_dict: OrderedDict):
        finished, new_ids = self._advance(step_dict)
        needed = sum(-(-(self.sequences.get(seq, 0) + count) // self.page_size) - self.get_page_count(seq)
                     for seq, count in step_dict.items())
        available = len(self.free_pages) + sum(self.get_page_count(seq) for seq in finished)
        if needed > available:
            raise RuntimeError(f"KV cache is full: this step needs {needed} more pages, {available} of "
                               f"total_num_pages={self.total_num_pages} are free")
        for seq in finished:
            self.sequences.pop(seq)
            self.deallocate_sequence(seq)
        for seq in list(self.sequences) + new_ids:
            self.sequences[seq] = self.sequences.get(seq, 0) + step_dict[seq]
            self.allocate_sequence(seq, self.sequences[seq])
        self.get_page_table(list(self.sequences))
        return self.sequences

    def _slots(self, batch, position):
        page_size = self.page_size
        return self.page_table[batch, position // page_size].long(), position % page_size

    def print_cache(self) -> str:
        """The pages in use and each sequence's pages (TE logs this; here it is also returned)."""
        lines = [f"pages: {self.total_num_pages} (free {len(self.free_pages)})"]
        lines += [f"  batch {b}: seq {seq!r}, {length} tokens, pages {self.get_page_list(seq)}"
                  for b, (seq, length) in enumerate(self.sequences.items())]
        return "\n".join(lines)


class InferenceParams:
    """KV caching for inference, with TransformerEngine's constructor and methods.

    max_batch_size, max_sequence_length: the largest batch and sequence the cache holds.
    num_heads_kv, head_dim_k, dtype (required), head_dim_v (default head_dim_k): the cache's shape.
    is_paged: a paged cache of total_num_pages pages of page_size tokens (max_sequence_length a multiple of
    page_size); else one row of max_sequence_length tokens per batch entry. max_ctx_len: the longest
    prompt (required with qkv_format='thd', as in TE). qkv_format: the layout of the new tokens
    ('bshd', 'sbhd' or 'thd'); the cache is always bshd. custom_cache_manager: a KVCacheManager subclass
    built with the same keywords as the default one. device (te_fuser's; TE uses the current CUDA device):
    where the caches live, by default the current CUDA device, else the CPU.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int, num_heads_kv: int = None,
                 head_dim_k: int = None, dtype: torch.dtype = None, head_dim_v: int = None, is_paged: bool = False,
                 total_num_pages: int = None, page_size: int = None, max_ctx_len: int = None,
                 qkv_format: str = "bshd", custom_cache_manager=None, device=None):
        self.max_batch_size = _positive_int("max_batch_size", max_batch_size)
        self.max_sequence_length = _positive_int("max_sequence_length", max_sequence_length)
        for name, value in (("num_heads_kv", num_heads_kv), ("head_dim_k", head_dim_k), ("dtype", dtype)):
            if value is None:
                raise ValueError(f"InferenceParams needs {name} (num_heads_kv, head_dim_k and dtype are required, "
                                 "as in TransformerEngine >= 2.2)")
        self.num_heads_kv = _positive_int("num_heads_kv", num_heads_kv)
        self.head_dim_k = _positive_int("head_dim_k", head_dim_k)
        self.head_dim_v = _positive_int("head_dim_v", head_dim_v) if head_dim_v is not None else head_dim_k
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.dtype = dtype
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
        if qkv_format == "thd" and max_ctx_len is None:
            raise ValueError("qkv_format='thd' needs max_ctx_len (the longest context of a step)")
        if max_ctx_len is not None and not 1 <= _positive_int("max_ctx_len", max_ctx_len) <= max_sequence_length:
            raise ValueError(f"max_ctx_len must lie in [1, max_sequence_length={max_sequence_length}], "
                             f"got {max_ctx_len}")
        self.max_ctx_len = max_ctx_len
        self.is_paged = bool(is_paged)
        common = dict(num_heads=self.num_heads_kv, head_dim_k=self.head_dim_k, dtype=dtype,
                      head_dim_v=self.head_dim_v, max_batch_size=self.max_batch_size,
                      max_seqlen=self.max_sequence_length)
        if custom_cache_manager is None:  # a TE custom manager is built with TE's keywords only
            common["device"] = device
        if self.is_paged:
            self.page_size = _positive_int("page_size", page_size)
            if max_sequence_length % page_size:
                raise ValueError(f"a paged cache needs max_sequence_length ({max_sequence_length}) to be a "
                                 f"multiple of page_size ({page_size})")
            self.total_num_pages = _positive_int("total_num_pages", total_num_pages)
            manager = custom_cache_manager or PagedKVCacheManager
            self.cache_manager = manager(total_num_pages=total_num_pages, page_size=page_size, **common)
        else:
            for name, value in (("page_size", page_size), ("total_num_pages", total_num_pages)):
                if value is not None:
                    raise ValueError(f"{name} is for a paged cache (is_paged=True)")
            manager = custom_cache_manager or NonPagedKVCacheManager
            common.pop("max_batch_size"), common.pop("max_seqlen")
            self.cache_manager = manager(max_batch_size=self.max_batch_size,
                                         max_seqlen=self.max_sequence_length, **common)
        self.device = getattr(self.cache_manager, "device", None) or (
            torch.device(device) if device is not None else _default_device())
        self.cache_qkv_format = CACHE_QKV_FORMAT
        self.input_qkv_format = qkv_format
        self.output_qkv_format = self._output_format(qkv_format)
        self.sequences = OrderedDict()
        self.sequences_pre_step = OrderedDict()
        self.batch_size = 0
        # Updated in place by pre_step (as TE's, for CUDA graphs): offsets of the new and of all tokens,
        # repeated past the batch, and each sequence's length before the step.
        self.cu_seqlens_q = torch.zeros(self.max_batch_size + 1, dtype=torch.int32, device=self.device)
        self.cu_seqlens_kv = torch.zeros(self.max_batch_size + 1, dtype=torch.int32, device=self.device)
        self.pre_step_seqlens = torch.zeros(self.max_batch_size, dtype=torch.int32, device=self.device)
        self.device = self.cu_seqlens_q.device  # where the tensors went (a CUDA index filled in)

    def _output_format(self, qkv_format: str) -> str:
        return self.cache_qkv_format if qkv_format == self.cache_qkv_format else f"{qkv_format}_2{self.cache_qkv_format}"

    def __repr__(self) -> str:
        size = (f"total_pages={self.total_num_pages}, page_size={self.page_size}" if self.is_paged else
                f"max_batch_size={self.max_batch_size}, max_seqlen={self.max_sequence_length}")
        return (f"InferenceParams(dtype={self.dtype}, is_paged={self.is_paged}, {size}, num_heads={self.num_heads_kv}, "
                f"head_dim_k={self.head_dim_k}, head_dim_v={self.head_dim_v})")

    def reset(self):
        """Forget every sequence (the cache memory stays allocated, for the next ones)."""
        self.sequences = OrderedDict()
        self.sequences_pre_step = OrderedDict()
        self.batch_size = 0
        self.cache_manager.reset()

    def allocate_memory(self, layer_number: int):
        """Allocate layer_number's K and V caches (non-paged [max_batch_size, max_sequence_length, heads, dim],
        paged [total_num_pages, page_size, heads, dim]); kept if the layer has them already."""
        self.cache_manager.allocate_memory(layer_number)

    def pre_step(self, step_dict: OrderedDict):
        """Start a step: step_dict {seq_id: new tokens}, the continuing sequences first, in order, then new
        ones; a tracked sequence missing from it has finished and frees its cache."""
        self.sequences = self.cache_manager.pre_step(step_dict)
        self.batch_size = len(step_dict)
        self.sequences_pre_step = OrderedDict((seq, length - step_dict[seq]) for seq, length in self.sequences.items())
        pad = self.max_batch_size - self.batch_size
        self.pre_step_seqlens.copy_(torch.tensor(list(self.sequences_pre_step.values()) + [0] * pad,
                                                 dtype=torch.int32))
        for target, lengths in ((self.cu_seqlens_q, list(step_dict.values())),
                                (self.cu_seqlens_kv, list(self.sequences.values()))):
            offsets = [0]
            for length in lengths:
                offsets.append(offsets[-1] + length)
            target.copy_(torch.tensor(offsets + [offsets[-1]] * pad, dtype=torch.int32))

    def get_seqlens_pre_step(self) -> torch.Tensor:
        """Each sequence's length before this step, [max_batch_size] (0 past the batch)."""
        return self.pre_step_seqlens

    def convert_paged_to_nonpaged(self, layer_number: int, max_seqlen: Optional[int] = None):
        """(k, v) of the batch's sequences gathered out of the pages into bshd [batch_size, seq, heads, dim]:
        a new tensor; seq is max_sequence_length, or the pages covering max_seqlen tokens when given."""
        k_cache, v_cache = self.cache_manager.cache[layer_number]
        pages = self.cache_manager.max_pages_per_seq
        if max_seqlen is not None:
            pages = min(pages, -(-max_seqlen // self.page_size))
        table = self.cache_manager.page_table[:self.batch_size, :pages].long()
        return tuple(c[table].flatten(1, 2) for c in (k_cache, v_cache))

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, qkv_format: str):
        """Write the step's new K and V tokens (in qkv_format) into layer_number's cache. Returns TE's
        (k_cache, v_cache, cu_seqlens_q, cu_seqlens_kv, max_sequence_length, output qkv_format)."""
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
        if self.batch_size == 0:
            raise RuntimeError("InferenceParams.step before pre_step: call pre_step(step_dict) to start a step")
        self.input_qkv_format = qkv_format
        self.output_qkv_format = self._output_format(qkv_format)
        k_cache, v_cache = self.cache_manager.step(layer_number, new_k, new_v, self.cu_seqlens_q,
                                                   self.cu_seqlens_kv, qkv_format)
        if not self.is_paged:
            k_cache, v_cache = k_cache[:self.batch_size], v_cache[:self.batch_size]
        return (k_cache, v_cache, self.cu_seqlens_q, self.cu_seqlens_kv, self.max_sequence_length,
                self.output_qkv_format)
