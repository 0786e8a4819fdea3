"""Per-step plan of a DeepSeek-V4-style sparse attention layer: a sliding-window cache plus a
compressed cache, two index lists, one softmax (FlashMLA's MODEL1 with extra_k_cache).

What a V4 layer attends (vLLM 0.32's DeepseekV4FlashMLAAttention and FlashMLA 9241ae3 describe
it; openmla computes the same in its own words):

- the window list: for a query at position `pos` of its request, the positions
  [max(pos - window_size + 1, 0), pos] of the request, in order, in the window cache (its own
  page table and page size); `window_lens` = how many (<= window_size). The same for every layer
  of the step, so it is built here, once.
- the compressed list: the compressed cache holds one token per `compress_ratio` tokens of the
  request (entry j summarises positions [j * ratio, (j + 1) * ratio)), in pages of its own size
  with its own page table. A layer with ratio 4 ("C4A") attends the top-k entries its indexer
  picks (per-request entry numbers, different per layer: `SparseMLAV4Plan.compressed_slots`, per
  layer); a layer with ratio 128 ("C128A") attends every entry the query can see, the first
  (pos + 1) // ratio (`SparseMLAV4Plan.all_visible`, built once per step and ratio, on first use).
  A layer with ratio <= 1 has the window list only.

Both lists join one softmax (the decode kernel's extra cache); the sink applies once.

Host syncs: none. Every tensor is computed on the device from the engine's tensors (positions
from query_start_loc and seq_lens); the host only needs num_tokens and the static sizes
(window_size, max_model_len). A plan built with `buffers` (V4PlanBuffers.allocate, once) writes its
per-token tensors into them, so their addresses stay the same from step to step (CUDA graphs:
a captured forward replays with the next step's plan written into the same buffers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

import torch

from openmla.kernels.index import convert_req_index_to_global
from openmla.mla.sparse.plan import MAX_HEADS, _positive_int
from openmla.quant.validate import check_same_device, check_tensor, fail

__all__ = ["CompressedPlan", "V4PlanBuffers", "SparseMLAV4Plan", "build_sparse_mla_v4_plan"]


@dataclass(frozen=True)
class V4PlanBuffers:
    """Persistent per-token tensors a plan writes into (CUDA graphs): req_id [N] int32,
    window_slots [N, window_size] int32, window_lens [N] int32, positions [N] int32, for steps of
    at most N tokens."""
    req_id: torch.Tensor
    window_slots: torch.Tensor
    window_lens: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def allocate(cls, max_num_tokens: int, window_size: int, device) -> "V4PlanBuffers":
        _positive_int("max_num_tokens", max_num_tokens)
        _positive_int("window_size", window_size)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(torch.empty(max_num_tokens, **i32), torch.empty(max_num_tokens, window_size, **i32),
                   torch.empty(max_num_tokens, **i32), torch.empty(max_num_tokens, **i32))


@dataclass(frozen=True, eq=False)
class CompressedPlan:
    """The compressed cache of one ratio: ratio (tokens per entry, > 1), block_size (entries per
    page), block_table [R, M] int32 (the requests' pages; < 0: unmapped)."""
    ratio: int
    block_size: int
    block_table: torch.Tensor


@dataclass(frozen=True, eq=False)
class SparseMLAV4Plan:
    """One step's V4 plan (build_sparse_mla_v4_plan), read by every layer of the step.

    Built for: num_tokens T (padding included: tokens past query_start_loc[R] attend nothing),
    num_reqs R, num_heads, window_size, window_block_size, max_model_len, device.
    Device tensors: req_id_per_token [T] int32 (R for padding), positions [T] int32 (position of
    each token in its request; 0 for padding), window_slots [T, window_size] int32 (global slots of
    the window cache, -1 past window_lens), window_lens [T] int32 (0 for padding), seq_lens [R]
    int32 (the engine's).
    compressed: {ratio: CompressedPlan} for the ratios the engine gave.

    Entry counts are derived on use, from positions and seq_lens (a few elementwise ops, inside
    a captured graph when the layer is captured): a query sees (pos + 1) // ratio entries (0 for
    padding: pos 0), a request has seq_len // ratio.
    """
    num_tokens: int
    num_reqs: int
    num_heads: int
    window_size: int
    window_block_size: int
    max_model_len: int
    device: torch.device
    req_id_per_token: torch.Tensor
    positions: torch.Tensor
    window_slots: torch.Tensor
    window_lens: torch.Tensor
    seq_lens: torch.Tensor
    compressed: Mapping[int, CompressedPlan]
    _cache: dict = field(default_factory=dict, repr=False)

    def _part(self, ratio: int) -> CompressedPlan:
        part = self.compressed.get(ratio)
        if part is None:
            fail("compress_ratio", f"one of the plan's ratios {sorted(self.compressed)}", ratio)
        return part

    def visible(self, ratio: int) -> torch.Tensor:
        """[T] int32: compressed entries each query sees, (pos + 1) // ratio (0 for padding)."""
        return torch.div(self.positions + 1, ratio, rounding_mode="floor")

    def compressed_slots(self, ratio: int, entries: torch.Tensor) -> torch.Tensor:
        """Per-request entry numbers [T, K] int32 (an indexer's top-k) -> global slots of the
        ratio's compressed cache [T, K] int32: -1 where the entry is < 0, not visible to the query
        yet (>= (pos + 1) // ratio), past its request's seq_len // ratio entries, or on an
        unmapped page."""
        part = self._part(ratio)
        causal = torch.where(entries < self.visible(ratio)[:, None], entries, -1)
        return convert_req_index_to_global(self.req_id_per_token, part.block_table, causal,
                                           part.block_size,
                                           seq_lens=torch.div(self.seq_lens, ratio, rounding_mode="floor"))

    def all_visible(self, ratio: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(slots [T, ceil(max_model_len / ratio)] int32, lengths [T] int32): every compressed entry
        each query sees, in order (C128A layers). Built by the step's first layer that asks, reused
        by the others; kept apart by whether a CUDA graph is being captured (as SparseMLAPlan's
        step scratch), so that a captured graph never reads a tensor made outside it."""
        key = (ratio, self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        got = self._cache.get(key)
        if got is None:
            visible = self.visible(ratio)
            j = torch.arange(-(-self.max_model_len // ratio), dtype=torch.int32, device=self.device)
            entries = torch.where(j[None, :] < visible[:, None], j[None, :], -1).to(torch.int32)
            got = self._cache[key] = (self.compressed_slots(ratio, entries), visible)
        return got


def build_sparse_mla_v4_plan(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    window_block_table: torch.Tensor,
    num_tokens: int,
    *,
    window_size: int,
    window_block_size: int,
    num_heads: int,
    max_model_len: int,
    compressed: Optional[Mapping[int, Tuple[torch.Tensor, int]]] = None,
    buffers: Optional[V4PlanBuffers] = None,
) -> SparseMLAV4Plan:
    """Build one step's plan from the engine's tensors; no host sync.

    Args:
        query_start_loc: [R+1] int32 (device), cumulative query tokens per request, from 0.
        seq_lens: [R] int32 (device), tokens per request including this step's (all of them
            already in the caches).
        window_block_table: [R, M] int32, pages of the window cache (< 0: unmapped or freed; a
            window position on such a page is skipped).
        num_tokens: T, rows of q (>= query_start_loc[R]; the rest are padding).
        window_size: positions of the window, the query's own included (DeepSeek-V4: 128).
        window_block_size: page size of the window cache.
        num_heads: H, query heads per rank, 1..128.
        max_model_len: longest sequence; sizes the all-visible compressed lists.
        compressed: {ratio: (block_table [R, M_c] int32, block_size)} per compression ratio > 1
            the step's layers use (DeepSeek-V4: 4 and 128), or None for window-only layers.
        buffers: optional V4PlanBuffers of >= T rows and window_size columns (CUDA graphs).

    Returns a SparseMLAV4Plan.
    """
    for name, val in (("num_heads", num_heads), ("window_size", window_size),
                      ("window_block_size", window_block_size), ("max_model_len", max_model_len)):
        _positive_int(name, val)
    if num_heads > MAX_HEADS:
        raise NotImplementedError(f"sparse MLA V4: num_heads {num_heads} > {MAX_HEADS} (the kernels' limit)")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        fail("num_tokens", "an int >= 0", repr(num_tokens))
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, contiguous=True)
    R = query_start_loc.shape[0] - 1
    if R < 0:
        fail("query_start_loc.shape", "(R + 1,) with R >= 0", tuple(query_start_loc.shape))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(R,), contiguous=True)
    check_tensor("window_block_table", window_block_table, dtype=torch.int32, shape=(R, None),
                 last_dim_contiguous=True)
    compressed = dict(compressed or {})
    for ratio, part in compressed.items():
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 2:
            fail("compressed (ratio)", "ints >= 2 (a ratio <= 1 layer has no compressed cache)", repr(ratio))
        if not (isinstance(part, (tuple, list)) and len(part) == 2):
            fail(f"compressed[{ratio}]", "a (block_table, block_size) pair", type(part).__name__)
        check_tensor(f"compressed[{ratio}] block_table", part[0], dtype=torch.int32, shape=(R, None),
                     last_dim_contiguous=True)
        _positive_int(f"compressed[{ratio}] block_size", part[1])
    if buffers is not None:
        if not isinstance(buffers, V4PlanBuffers):
            fail("buffers", "None or a V4PlanBuffers", type(buffers).__name__)
        if buffers.window_slots.shape[0] < num_tokens or buffers.window_slots.shape[1] != window_size:
            fail("buffers.window_slots.shape", f"(>= {num_tokens}, {window_size})",
                 tuple(buffers.window_slots.shape))
    device = check_same_device(query_start_loc=query_start_loc, seq_lens=seq_lens,
                               window_block_table=window_block_table,
                               **{f"compressed[{r}] block_table": p[0] for r, p in compressed.items()},
                               **({} if buffers is None else {"buffers": buffers.window_slots}))

    T = num_tokens
    tokens = torch.arange(T, dtype=torch.int32, device=device)
    req = torch.searchsorted(query_start_loc[1:], tokens, right=True, out_int32=True,
                             out=None if buffers is None else buffers.req_id[:T])
    if R > 0:
        real = req < R
        r = req.clamp(max=R - 1).long()
        start_q = query_start_loc[r]
        pos = seq_lens[r] - (query_start_loc[r + 1] - start_q) + (tokens - start_q)
        pos = torch.where(real, pos, 0)
    else:
        real = torch.zeros(T, dtype=torch.bool, device=device)
        pos = torch.zeros(T, dtype=torch.int32, device=device)
    # window: positions start .. pos (at most window_size of them), the rest -1
    start = (pos - (window_size - 1)).clamp(min=0)
    lens = torch.where(real, pos - start + 1, 0).to(torch.int32)
    j = torch.arange(window_size, dtype=torch.int32, device=device)
    local = torch.where(j[None, :] < lens[:, None], start[:, None] + j[None, :], -1).to(torch.int32)
    slots = (convert_req_index_to_global(req, window_block_table, local, window_block_size,
                                         seq_lens=seq_lens) if T > 0 else local)
    pos = pos.to(torch.int32)
    if buffers is not None:
        slots = buffers.window_slots[:T].copy_(slots)
        lens = buffers.window_lens[:T].copy_(lens)
        pos = buffers.positions[:T].copy_(pos)

    parts = {ratio: CompressedPlan(ratio=ratio, block_size=bs, block_table=table)
             for ratio, (table, bs) in compressed.items()}
    return SparseMLAV4Plan(num_tokens=T, num_reqs=R, num_heads=num_heads, window_size=window_size,
                           window_block_size=window_block_size, max_model_len=max_model_len,
                           device=device, req_id_per_token=req, positions=pos, window_slots=slots,
                           window_lens=lens, seq_lens=seq_lens, compressed=parts)
