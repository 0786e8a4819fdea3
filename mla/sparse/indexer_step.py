"""The sparse-attention step of a DeepSeek-V3.2 layer: lightning indexer -> top-k -> sparse MLA.

    step = SparseAttentionStep(mla_impl, topk=2048)                       # once per layer
    iplan = build_indexer_plan(query_start_loc, seq_lens, block_table,    # once per step
                               req_id_per_token=plan.req_id_per_token, max_context=...,
                               query_lens_cpu=..., seq_lens_cpu=..., decode_threshold=...)
    step.write_index_cache(index_k, index_cache, slot_mapping)            # per layer
    out = step.forward(q_nope, q_pe, mla_cache, index_q, index_weights,   # per layer
                       index_cache, plan, iplan)

Every query token t of the batch belongs to request req[t] and sees the first context_len[t]
tokens of its request (causal: a token at position p of its request sees positions [0, p], so
context_len = p + 1; decode, speculative decode and prefill tokens alike). The indexer scores
those tokens against the request's index-K cache, keeps the top `topk` per token as positions
within the request (-1 where the request has fewer visible tokens), and SparseMLAImpl attends
over them. A padding token (no request) selects nothing and its attention output is 0.

Two paths, one result:
  * paged rows (kernels.indexer.paged_mqa_logits + decode_topk): tokens read their request's
    keys through the block table, one row per token (any batch: decodes, speculative decodes of
    any lengths, prefills, padding), or one group of n rows per request when the step's decodes
    all have n tokens (the keys read once per request);
  * ragged chunks (mla/sparse/indexer_ragged.py: kernels.indexer.mqa_logits + topk_per_row):
    prefill requests scored against their keys gathered back to back, a block of rows per key
    tile. build_indexer_plan takes this path for the requests after the leading decodes when
    the host lengths are given.

CUDA graphs: build_indexer_plan without host lengths reads nothing from the device and makes
every launch depend on T, the heads and max_context only, so a decode step's plan and selection
can be captured together and replayed for any decode batch padded to T (the vLLM hookup does
this inside its op; tests/mla/test_indexer_cudagraph.py). Logits rows are `max_context` wide (a
host bound on every context length: the engine's max_seq_len for an eager step, its
max_model_len for a captured one). Rows are scored in blocks whose logits fit
`max_logits_bytes`, so a long prefill never materializes its whole T x max_context matrix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from openmla.kernels.indexer import decode_topk, paged_mqa_logits
from openmla.mla.sparse.impl import SparseMLAImpl
from openmla.mla.sparse.indexer_ragged import ragged_chunks, ragged_topk
from openmla.mla.sparse.plan import SparseMLAPlan, _host_ints
from openmla.quant.indexer_cache import INDEXER_K_FP8, indexer_k_format_of, write_indexer_k_cache
from openmla.quant.validate import check_same_device, check_tensor, fail

__all__ = ["IndexerPlan", "SparseAttentionStep", "build_indexer_plan", "indexer_plan_from_tokens",
           "indexer_topk"]

# Logits scratch of one row block (fp32). vLLM bounds its prefill logits the same way
# (VLLM_SPARSE_INDEXER_MAX_LOGITS_MB); rows are independent, so blocks change nothing else.
DEFAULT_MAX_LOGITS_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True, eq=False)
class IndexerPlan:
    """Which tokens each query token of a step may select, built once per step.

    Host ints: num_tokens (T, padding included), num_reqs (R, rows of block_table),
    max_context (logits width: >= every context length).
    Device tensors: req_id_per_token [T] int32 (a value outside [0, R) is a token of no
    request: it selects nothing), context_lens [T] int32 (visible tokens of its request, the
    positions [0, context_len)), block_table [R, M] int32 (the requests' index-cache blocks; an
    entry < 0 is unmapped and its tokens are never read).

    Paths: tokens [0, num_paged_tokens) are scored as paged rows in groups of paged_next_n
    (one request's tokens, its keys read once for all of them): group g holds tokens
    [g * n, (g + 1) * n), its block-table row paged_block_table[g] and its request's seq_len
    paged_context_lens[g] (row j sees positions < seq_len - n + 1 + j). With n = 1 (any batch)
    every token is its own group: the token's request row of block_table (all -1 for a token of
    no request) and its context length (0 for such a token, so that it selects nothing rather
    than the -inf positions of a row of -1), expanded once per step; n > 1 when the step's
    decodes are all n tokens long (speculative decoding). ragged_chunks
    (mla/sparse/indexer_ragged.py: prefill requests against their gathered keys) cover token
    ranges after them; tokens in neither select nothing (padding).
    """

    num_tokens: int
    num_reqs: int
    max_context: int
    device: torch.device
    req_id_per_token: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    num_paged_tokens: int
    paged_block_table: torch.Tensor
    paged_context_lens: torch.Tensor
    ragged_chunks: tuple = ()
    paged_next_n: int = 1


def _paged_rows(req: torch.Tensor, ctx: torch.Tensor, block_table: torch.Tensor):
    """(paged_block_table, paged_context_lens) of tokens with requests `req` and context
    lengths `ctx` (IndexerPlan)."""
    R, M = block_table.shape
    if R == 0 or M == 0:
        return (torch.full((req.shape[0], max(M, 1)), -1, dtype=torch.int32, device=req.device),
                torch.zeros_like(ctx))
    own = (req >= 0) & (req < R)
    rows = block_table[req.clamp(0, R - 1).long()]
    return torch.where(own[:, None], rows, -1), torch.where(own, ctx, 0)


def _positive_int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        fail(name, "a positive int", repr(x))
    return x


def indexer_plan_from_tokens(req_id_per_token: torch.Tensor, context_lens: torch.Tensor,
                             block_table: torch.Tensor, *, max_context: int,
                             ragged_chunks: tuple = (), num_tokens: Optional[int] = None) -> IndexerPlan:
    """An IndexerPlan from per-token requests and context lengths an engine already has
    (vLLM's indexer metadata: mla/vllm/indexer.py). Shapes and dtypes as IndexerPlan; nothing is
    read from the device (a context length above max_context is clipped to it by the logits,
    a negative one selects nothing). The tokens given are paged rows; ragged_chunks (token
    ranges after them) are the prefill chunks the engine built; num_tokens: the step's T (rows
    of q, default: up to the last token given), tokens past both select nothing."""
    _positive_int("max_context", max_context)
    check_tensor("req_id_per_token", req_id_per_token, dtype=torch.int32, ndim=1, contiguous=True)
    T = req_id_per_token.shape[0]
    check_tensor("context_lens", context_lens, dtype=torch.int32, shape=(T,), contiguous=True)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    device = check_same_device(req_id_per_token=req_id_per_token, context_lens=context_lens,
                               block_table=block_table)
    T_all = max([T] + [ch.token_end for ch in ragged_chunks])
    if num_tokens is not None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < T_all:
            fail("num_tokens", f"an int >= {T_all} (the tokens given)", repr(num_tokens))
        T_all = num_tokens
    table, ctx = _paged_rows(req_id_per_token, context_lens, block_table)
    return IndexerPlan(num_tokens=T_all, num_reqs=block_table.shape[0], max_context=max_context,
                       device=device, req_id_per_token=req_id_per_token,
                       context_lens=context_lens, block_table=block_table, num_paged_tokens=T,
                       paged_block_table=table, paged_context_lens=ctx,
                       ragged_chunks=tuple(ragged_chunks))


def build_indexer_plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                       block_table: torch.Tensor, *, num_tokens: Optional[int] = None,
                       req_id_per_token: Optional[torch.Tensor] = None,
                       max_context: int, query_lens_cpu=None, seq_lens_cpu=None,
                       decode_threshold: int = 1,
                       max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES) -> IndexerPlan:
    """One step's IndexerPlan from the engine's batch tensors (the ones SparseMLAImpl.build_plan
    takes), on the device, without a host sync (CUDA-graph capturable).

    Args:
        query_start_loc: [R+1] int32, cumulative query tokens per request, from 0.
        seq_lens: [R] int32, tokens per request including this step's (all in the cache).
        block_table: [R, M] int32, the index cache's blocks of each request (vLLM gives the
            indexer cache the same block table as the MLA cache).
        num_tokens: T, rows of q (>= query_start_loc[R]; tokens past the last request are
            padding). Default: req_id_per_token's length (one of the two is required).
        req_id_per_token: optional [T] int32, the request of each token as SparseMLAPlan
            computes it (R for padding); computed here when not given.
        max_context: host bound on every seq_len (logits width).
        query_lens_cpu, seq_lens_cpu: optional [R] host ints (CPU tensors or sequences) of the
            same lengths. With both, the requests after the leading run of decodes (query_len
            <= decode_threshold) take the ragged prefill path in chunks whose logits fit
            max_logits_bytes (mla/sparse/indexer_ragged.py); without them every token is a
            paged row (correct for any batch; the decode-only and CUDA-graph form).

    Token t of request r (query positions [qsl[r], qsl[r+1])) sees
    context_len = seq_lens[r] - (qsl[r+1] - t) + 1 tokens: its own position plus one, clamped
    at 0 for a seq_len shorter than the request's query length (inconsistent input).
    """
    _positive_int("max_context", max_context)
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, contiguous=True)
    R = query_start_loc.shape[0] - 1
    if R < 0:
        fail("query_start_loc.shape", "(R + 1,) with R >= 0", tuple(query_start_loc.shape))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(R,), contiguous=True)
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(R, None), last_dim_contiguous=True)
    if req_id_per_token is None:
        if num_tokens is None:
            fail("num_tokens", "an int when req_id_per_token is not given", None)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            fail("num_tokens", "an int >= 0", repr(num_tokens))
        T = num_tokens
    else:
        check_tensor("req_id_per_token", req_id_per_token, dtype=torch.int32, ndim=1, contiguous=True)
        T = req_id_per_token.shape[0]
        if num_tokens is not None and num_tokens != T:
            fail("num_tokens", f"{T} (req_id_per_token.shape[0])", num_tokens)
    device = check_same_device(query_start_loc=query_start_loc, seq_lens=seq_lens,
                               block_table=block_table, req_id_per_token=req_id_per_token)
    tokens = torch.arange(T, dtype=torch.int32, device=device)
    if req_id_per_token is None:
        req_id_per_token = torch.searchsorted(query_start_loc[1:], tokens, right=True, out_int32=True)
    if R == 0:
        ctx = torch.zeros(T, dtype=torch.int32, device=device)
    else:
        own = (req_id_per_token >= 0) & (req_id_per_token < R)
        r = req_id_per_token.clamp(0, R - 1).long()
        ctx = seq_lens[r] - query_start_loc[r + 1] + tokens + 1
        ctx = torch.where(own, ctx, 0).clamp_(min=0).to(torch.int32)
    paged, chunks, next_n = T, (), 1
    if query_lens_cpu is not None and seq_lens_cpu is not None:
        _positive_int("decode_threshold", decode_threshold)
        _positive_int("max_logits_bytes", max_logits_bytes)
        qlens, seqs = _host_ints("query_lens_cpu", query_lens_cpu, R), _host_ints("seq_lens_cpu", seq_lens_cpu, R)
        if sum(qlens) > T or any(q < 0 for q in qlens):
            fail("query_lens_cpu", f"lengths >= 0 summing to <= num tokens {T}", qlens)
        nd = 0
        while nd < R and qlens[nd] <= decode_threshold:
            nd += 1
        if nd and qlens[0] > 1 and qlens[:nd] == [qlens[0]] * nd:  # uniform speculative decodes
            next_n, paged = qlens[0], nd * qlens[0]
        elif nd < R:
            paged = sum(qlens[:nd])
        if nd < R:
            for i in range(nd, R):
                if qlens[i] > seqs[i]:
                    fail(f"seq_lens_cpu[{i}]", f">= query_lens_cpu[{i}] = {qlens[i]}", seqs[i])
            chunks = tuple(ragged_chunks(qlens[nd:], seqs[nd:], first_req=nd, first_token=sum(qlens[:nd]),
                                         block_table=block_table, max_logits_bytes=max_logits_bytes))
    if next_n > 1:  # groups of next_n tokens: the decode requests' own rows and seq_lens
        table, pctx = block_table[:paged // next_n], seq_lens[:paged // next_n]
    else:
        table, pctx = _paged_rows(req_id_per_token[:paged], ctx[:paged], block_table)
    return IndexerPlan(num_tokens=T, num_reqs=R, max_context=max_context, device=device,
                       req_id_per_token=req_id_per_token, context_lens=ctx, block_table=block_table,
                       num_paged_tokens=paged, paged_block_table=table, paged_context_lens=pctx,
                       ragged_chunks=chunks, paged_next_n=next_n)


def indexer_topk(q_fp8: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                 plan: IndexerPlan, *, topk: int, fmt=INDEXER_K_FP8, out: Optional[torch.Tensor] = None,
                 max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES) -> torch.Tensor:
    """The lightning indexer's selection for every token of a step (module docstring).

    Args:
        q_fp8: [T, H, 128] float8_e4m3fn, the indexer query (quantized per token and head).
        weights: [T, H] fp32, the head weights with q's scale, the softmax scale and H^-0.5
            folded in (vLLM's Indexer; kernels/reference/indexer.py indexer_q_quant_ref).
        index_cache: [num_blocks, block_size, 132] uint8, the index-K cache (quant/indexer_cache.py;
            every visible token written).
        plan: this step's IndexerPlan (T rows).
        topk: k >= 1, tokens kept per query token.
        fmt: the index cache's IndexerKFormat (or vLLM's scale_fmt string).
        out: optional [T, topk] int32 (last dim contiguous) to write into.
        max_logits_bytes: fp32 logits scratch of one row block (>= one row is always scored).

    Returns [T, topk] int32: positions within each token's request of its `topk` best-scored
    visible tokens (logit = sum_h weights[t, h] * relu(q[t, h] . k) * k_scale; in descending
    order of logit, ties in any order, NaN above everything so a fault stays visible), or all
    of its visible positions in ascending order followed by -1 when it sees at most topk.
    """
    fmt = indexer_k_format_of(fmt)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        fail("topk", "an int >= 1", repr(topk))
    T = plan.num_tokens
    check_tensor("q_fp8", q_fp8, dtype=torch.float8_e4m3fn, shape=(T, None, fmt.head_dim),
                 last_dim_contiguous=True)
    H = q_fp8.shape[1]
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H))
    fmt.check_cache(index_cache, "index_cache")
    if out is None:
        out = torch.empty(T, topk, dtype=torch.int32, device=plan.device)
    else:
        check_tensor("out", out, dtype=torch.int32, shape=(T, topk), last_dim_contiguous=True)
    check_same_device(q_fp8=q_fp8, weights=weights, index_cache=index_cache, out=out,
                      **{"plan tensors": plan.context_lens})
    W, P, n = plan.max_context, plan.num_paged_tokens, plan.paged_next_n
    if P < T:
        out[P:].fill_(-1)  # ragged chunks overwrite their rows; the rest is padding
    groups = max(1, max_logits_bytes // (4 * W * n))
    for g0 in range(0, P // n, groups):
        g1 = min(P // n, g0 + groups)
        t0, t1 = g0 * n, g1 * n
        table, ctx = plan.paged_block_table[g0:g1], plan.paged_context_lens[g0:g1]
        # columns past a row's end are left unwritten: the top-k reads [0, row end) only
        logits = paged_mqa_logits(q_fp8[t0:t1].unflatten(0, (g1 - g0, n)), weights[t0:t1], index_cache,
                                  ctx, table, max_model_len=W, fmt=fmt, clean_logits=False)
        decode_topk(logits, ctx, n, topk, out=out[t0:t1])
    for ch in plan.ragged_chunks:
        ragged_topk(q_fp8, weights, index_cache, fmt, ch, topk, out)
    return out


class SparseAttentionStep:
    """Indexer -> top-k -> sparse MLA of one layer, on top of a SparseMLAImpl.

    Args:
        mla: the layer's SparseMLAImpl (weights loaded).
        topk: tokens each query token attends to (DeepSeek-V3.2: 2048), >= 1.
        index_format: the index-K cache's IndexerKFormat or vLLM's scale_fmt string
            (default "ue8m0", DeepSeek-V3.2's).
        max_logits_bytes: as indexer_topk.
    """

    def __init__(self, mla: SparseMLAImpl, *, topk: int, index_format=INDEXER_K_FP8,
                 max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES):
        if not isinstance(mla, SparseMLAImpl):
            fail("mla", "a SparseMLAImpl", type(mla).__name__)
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            fail("topk", "an int >= 1", repr(topk))
        _positive_int("max_logits_bytes", max_logits_bytes)
        self.mla = mla
        self.topk = topk
        self.index_format = indexer_k_format_of(index_format)
        self.max_logits_bytes = max_logits_bytes

    def write_index_cache(self, k: torch.Tensor, index_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
        """This step's indexer keys k [T, 128] bf16 into the index cache at slot_mapping [T]
        (< 0 and out-of-range slots skipped; no host sync)."""
        write_indexer_k_cache(k, index_cache, slot_mapping, fmt=self.index_format, check_slots=False)

    def select(self, q_fp8: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
               plan: IndexerPlan, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """indexer_topk with this layer's topk and format: [T, topk] int32 positions."""
        return indexer_topk(q_fp8, weights, index_cache, plan, topk=self.topk, fmt=self.index_format,
                            out=out, max_logits_bytes=self.max_logits_bytes)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                index_q: torch.Tensor, index_weights: torch.Tensor, index_cache: torch.Tensor,
                plan: SparseMLAPlan, index_plan: IndexerPlan, *, out: Optional[torch.Tensor] = None,
                topk_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer's sparse attention for one step.

        Args:
            q_nope, q_pe, cache, plan, out: as SparseMLAImpl.forward ([T, H, n], [T, H, r] bf16,
                the MLA cache, its plan; out [T, H, v] bf16).
            index_q, index_weights, index_cache, index_plan: as indexer_topk (the same T).
            topk_out: optional [T, topk] int32 for the selected positions (step scratch
                otherwise).

        Returns [T, H, v] bf16: attention over each token's top-k positions (0 for a token
        with none: padding).
        """
        if index_plan.num_tokens != plan.num_tokens:
            fail("index_plan.num_tokens", f"{plan.num_tokens} (the MLA plan's num_tokens)",
                 index_plan.num_tokens)
        if topk_out is None:
            topk_out = plan.buffer("topk_indices", (plan.num_tokens, self.topk), torch.int32)
        idx = self.select(index_q, index_weights, index_cache, index_plan, out=topk_out)
        return self.mla.forward(q_nope, q_pe, cache, idx, plan, out=out)
