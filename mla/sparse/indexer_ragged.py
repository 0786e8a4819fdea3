"""The indexer's prefill path: a chunk of prefill requests scored against their keys gathered
back to back (kernels.indexer.mqa_logits), instead of one paged row per token.

A prefill request of n new tokens after c cached ones has n query rows that all read the same
keys; the ragged kernel scores a block of rows against each key tile it loads, where the paged
one would load the request's keys once per row. A chunk gathers the keys of its requests into
a contiguous [S, 128] e4m3 + [S] fp32 copy (S = the chunk's summed key rows), scores its rows
(row t sees the gathered rows [ks[t], ke[t]): its own request's positions [0, position + 1)),
and keeps the top-k relative to ks (positions within the request).

Chunks bound their fp32 logits (rows x S x 4 bytes) by max_logits_bytes, as vLLM's indexer does:
requests are grouped greedily, and a request whose rows alone exceed the bound is split by
query rows, each part gathering only the keys its rows see.

An unmapped page inside a request's context (a block-table entry < 0 or past the cache: an
engine bug, vLLM never hands one) is not read: its keys score 0, and the sparse MLA skips such
positions anyway (kernels/index.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from openmla.kernels.indexer import mqa_logits, topk_per_row

__all__ = ["RaggedChunk", "ragged_chunks", "ragged_topk"]


@dataclass(frozen=True, eq=False)
class RaggedChunk:
    """Query tokens [token_start, token_end) of a step and the num_keys key rows they read.

    Device tensors: ks, ke [token_end - token_start] int32 (row bounds in the gathered keys),
    key_req, key_pos [num_keys] int32 (gathered row i is position key_pos[i] of the request
    whose block-table row is key_req[i]), block_table [R, M] int32 (the rows key_req indexes).
    """

    token_start: int
    token_end: int
    num_keys: int
    ks: torch.Tensor
    ke: torch.Tensor
    key_req: torch.Tensor
    key_pos: torch.Tensor
    block_table: torch.Tensor


def ragged_chunks(qlens: Sequence[int], seq_lens: Sequence[int], *, first_req: int, first_token: int,
                  block_table: torch.Tensor, max_logits_bytes: int) -> list:
    """Chunks of the prefill requests [first_req, first_req + len(qlens)) of a step from their
    host query lengths and sequence lengths (tokens of request first_req start at first_token).
    All index data go to the device in one copy."""
    parts = []  # per chunk: [(first token of the request, request, context, row i0, row i1)]
    budget = max(1, max_logits_bytes // 4)
    cur, cur_rows, cur_keys, tok = [], 0, 0, first_token
    for j, (n, s) in enumerate(zip(qlens, seq_lens)):
        r, c = first_req + j, s - n
        if cur and (cur_rows + n) * (cur_keys + s) > budget:
            parts.append(cur)
            cur, cur_rows, cur_keys = [], 0, 0
        if n * s > budget:  # alone too large: split by query rows
            if cur:
                parts.append(cur)
                cur, cur_rows, cur_keys = [], 0, 0
            step = max(1, budget // max(1, s))
            for i0 in range(0, n, step):
                parts.append([(tok, r, c, i0, min(n, i0 + step))])
        else:
            cur.append((tok, r, c, 0, n))
            cur_rows, cur_keys = cur_rows + n, cur_keys + s
        tok += n
    if cur:
        parts.append(cur)

    host, layout = [], []
    for part in parts:
        ks, ke, kreq, kpos, base = [], [], [], [], 0
        for _, r, c, i0, i1 in part:
            ks += [base] * (i1 - i0)
            ke += [base + c + i + 1 for i in range(i0, i1)]
            kreq += [r] * (c + i1)
            kpos += range(c + i1)
            base += c + i1
        layout.append((part[0][0] + part[0][3], len(ks), base, len(host)))
        host += ks + ke + kreq + kpos
    buf = torch.tensor(host, dtype=torch.int32).to(block_table.device)
    out = []
    for t0, n, S, off in layout:
        out.append(RaggedChunk(
            token_start=t0, token_end=t0 + n, num_keys=S, ks=buf[off:off + n],
            ke=buf[off + n:off + 2 * n], key_req=buf[off + 2 * n:off + 2 * n + S],
            key_pos=buf[off + 2 * n + S:off + 2 * n + 2 * S], block_table=block_table))
    return out


def _gather_keys(cache: torch.Tensor, fmt, ch: RaggedChunk):
    """The chunk's keys back to back: ([S, 128] uint8 e4m3 bytes, [S] fp32 scales); a row whose
    page is unmapped is 0 with scale 0 (never read)."""
    values, scales = fmt.read_ref(cache)  # views of the page-blocked layout
    nb, bs = values.shape[0], values.shape[1]
    bt, M = ch.block_table, ch.block_table.shape[1]
    pos, req = ch.key_pos.long(), ch.key_req.long()
    blk = pos // bs
    page = bt[req, blk.clamp(max=max(M - 1, 0))].long() if M else torch.full_like(pos, -1)
    ok = (blk < M) & (page >= 0) & (page < nb)
    page, off = torch.where(ok, page, 0), pos % bs
    k = torch.where(ok[:, None], values[page, off], 0)
    scale = torch.where(ok, scales[page, off, 0], 0.0)
    return k, scale


def ragged_topk(q_fp8: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, fmt,
                ch: RaggedChunk, topk: int, out: torch.Tensor) -> None:
    """Top-k of the chunk's rows into out[token_start:token_end] (arguments as
    mla.sparse.indexer_step.indexer_topk, checked there)."""
    t0, t1 = ch.token_start, ch.token_end
    if t1 == t0:
        return
    if ch.num_keys == 0:
        out[t0:t1] = -1
        return
    k, scale = _gather_keys(cache, fmt, ch)
    # columns outside a row's [ks, ke) are left unwritten: the top-k reads only those
    logits = mqa_logits(q_fp8[t0:t1], weights[t0:t1], k, scale, ch.ks, ch.ke, clean_logits=False)
    topk_per_row(logits, ch.ke, topk, starts=ch.ks, out=out[t0:t1])
