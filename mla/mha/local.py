"""Local (chunked) attention as virtual batches, vLLM's `make_local_attention_virtual_batches`.

Chunked local attention (Llama 4's iRoPE layers) cuts every sequence into chunks of
`attn_chunk_size` positions: the query at position p attends causally to the keys of its own
chunk only, keys j with j // C == p // C and j <= p. The paged attention kernel has no such mask,
so each request is rewritten as one "virtual" request per chunk its queries touch: the virtual
request of chunk c owns the request's query tokens at positions [max(ctx, c*C), min(s, (c+1)*C))
(ctx = s - q_len the context length, s = seq_len), its keys are positions [c*C, min(s, (c+1)*C)),
and its block table row is the request's table from column c*C / block_size on. Ordinary causal
attention over the virtual batch is then exactly chunked local attention over the real one.
Query tokens keep their order, so q, out and the slot mapping are untouched.

vLLM's example (C = 4, block_size 2): q_lens [4, 10, 5], seq_lens [6, 17, 9] become
    virtual q_lens  [2, 2, 1, 4, 4, 1, 4, 1]   (requests 0 | 1 | 2: 2 | 4 | 2 chunks)
    virtual k_lens  [4, 2, 4, 4, 4, 1, 4, 1]
    block rows      table[0, 0:2], table[0, 2:4], table[1, 2:4], ..., table[2, 4:6].

The rewrite needs the lengths on the host (vLLM keeps them there: query_start_loc_cpu,
seq_lens_cpu); the device work is one gather of the block table, no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

from openmla.quant.validate import check_tensor, fail

__all__ = ["LocalAttentionBatch", "make_local_attention_virtual_batches"]

HostInts = Union[Sequence[int], np.ndarray, torch.Tensor]


@dataclass(frozen=True, eq=False)
class LocalAttentionBatch:
    """A batch rewritten into per-chunk virtual requests (module docstring).

    Host:
        attn_chunk_size: C. num_reqs: V, virtual requests. max_query_len, max_seq_len: largest
        virtual q_len / k_len. query_lens, seq_lens_cpu: [V] int32 numpy, per virtual request.
        request_index: [V] int32 numpy, the real request each one came from. chunk_index: [V]
        int32 numpy, its chunk (positions chunk*C .. chunk*C + C - 1).
    Device (the real batch's device):
        cu_seqlens_q: [V + 1] int32, query_start_loc of the virtual batch (ends where the real
            one ends, so padding rows stay padding).
        seq_lens: [V] int32, keys per virtual request.
        block_table: [V, C // block_size] int32, block table rows (columns past the real table's
            width repeat its last column, as vLLM's clip does; they lie past seq_lens, unread).
    """

    attn_chunk_size: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_lens: np.ndarray
    seq_lens_cpu: np.ndarray
    request_index: np.ndarray
    chunk_index: np.ndarray
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


def _host_array(name: str, x: HostInts) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            fail(f"{name}.device", "cpu (host lengths; reading a device tensor is a sync)", x.device)
        x = x.numpy()
    arr = np.asarray(x)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) and arr.size:
        fail(name, "a 1-D sequence of host integers", f"{arr.dtype} of shape {arr.shape}")
    return arr.astype(np.int64)


def _to_device(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> device tensor without a host sync (pinned staging on CUDA, as vLLM's
    async_tensor_h2d)."""
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def make_local_attention_virtual_batches(attn_chunk_size: int, query_start_loc_cpu: HostInts,
                                         seq_lens_cpu: HostInts, block_table: torch.Tensor,
                                         block_size: int) -> LocalAttentionBatch:
    """Rewrite a batch for chunked local attention (vLLM semantics, module docstring).

    Args:
        attn_chunk_size: C > 0, a multiple of block_size (vLLM asserts the same), so each chunk
            starts on a block boundary.
        query_start_loc_cpu: [R + 1] host ints (CPU tensor, numpy array or sequence) from 0.
        seq_lens_cpu: [R] host ints, keys per request including its new tokens (>= q_len).
        block_table: [R, M] int32 (device), the real batch's table.
        block_size: the cache's page size.

    Returns a LocalAttentionBatch. A request with no query tokens becomes one virtual request
    with no queries and no keys (vLLM assumes q_len > 0 and would point such a request at a
    negative block column when its seq_len is 0).
    """
    for name, val in (("attn_chunk_size", attn_chunk_size), ("block_size", block_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            fail(name, "a positive int", repr(val))
    if attn_chunk_size % block_size:
        fail("attn_chunk_size", f"a multiple of block_size = {block_size}", attn_chunk_size)
    qsl = _host_array("query_start_loc_cpu", query_start_loc_cpu)
    if qsl.shape[0] < 1 or qsl[0] != 0 or np.any(np.diff(qsl) < 0):
        fail("query_start_loc_cpu", "non-decreasing host ints from 0", qsl.tolist())
    R = qsl.shape[0] - 1
    seq = _host_array("seq_lens_cpu", seq_lens_cpu)
    if seq.shape[0] != R:
        fail("len(seq_lens_cpu)", R, seq.shape[0])
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(R, None))
    q_lens = np.diff(qsl)
    ctx = seq - q_lens
    if np.any(ctx < 0):
        r = int(np.argmax(ctx < 0))
        fail(f"seq_lens_cpu[{r}]", f">= its query length {int(q_lens[r])}", int(seq[r]))
    C = attn_chunk_size

    # Chunks touched by each request's queries: from the chunk of its first query position to
    # that of its last; one (empty) chunk for a request without queries.
    first = ctx // C
    last = np.where(q_lens > 0, (seq - 1) // C, first)
    n_chunks = last - first + 1
    V = int(n_chunks.sum())
    req = np.repeat(np.arange(R), n_chunks)
    # Chunk ordinal within its request: a batched arange.
    ordinal = np.arange(V) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    chunk = first[req] + ordinal
    lo, hi = chunk * C, np.minimum(seq[req], (chunk + 1) * C)
    has_q = q_lens[req] > 0
    v_q = np.where(has_q, hi - np.maximum(ctx[req], lo), 0)
    v_k = np.where(has_q, hi - lo, 0)

    cu = np.zeros(V + 1, dtype=np.int32)
    np.cumsum(v_q, out=cu[1:])
    pages = C // block_size
    M = block_table.shape[1]
    cols = (chunk * C // block_size)[:, None] + np.arange(pages)[None, :]
    cols = np.clip(cols, 0, max(M - 1, 0))
    device = block_table.device
    rows_t = _to_device(np.repeat(req, pages).astype(np.int64), device)
    cols_t = _to_device(cols.reshape(-1).astype(np.int64), device)
    if M > 0:
        local_table = block_table[rows_t, cols_t].view(V, pages)
    else:  # no columns to gather (every request is empty)
        local_table = torch.full((V, pages), -1, dtype=torch.int32, device=device)
    return LocalAttentionBatch(
        attn_chunk_size=C, num_reqs=V,
        max_query_len=int(v_q.max()) if V else 0, max_seq_len=int(v_k.max()) if V else 0,
        query_lens=v_q.astype(np.int32), seq_lens_cpu=v_k.astype(np.int32),
        request_index=req.astype(np.int32), chunk_index=chunk.astype(np.int32),
        cu_seqlens_q=_to_device(cu, device),
        seq_lens=_to_device(v_k.astype(np.int32), device),
        block_table=local_table)
