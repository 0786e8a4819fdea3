"""Per-step batch metadata for the general MHA/GQA layer: plan once per step, run every layer.

An engine calls `build_attention_plan` (or `PagedAttentionImpl.build_plan`, which fills in the
layer's heads, ALiBi and sliding window) once per step with what it has (vLLM's
CommonAttentionMetadata); every layer's `PagedAttentionImpl.forward` then reads the frozen plan
(STYLE.md 6). The sparse MLA layer's counterpart is `mla.metadata`.

What the plan decides once per step:
    decode / prefill   the batch is ordered decodes first (query_len <= decode_threshold, the
                       leading run of such requests, as vLLM's reorder leaves it). Decodes run in
                       one launch whose short query length lets the kernel split long contexts
                       over the GPU (split-KV); prefills run in a second launch. A short request
                       after the first long one runs with the prefills: correct, only slower.
    cascade            a prefix shared by every request (common_prefix_len) is attended once
                       for all tokens (`kernels.cascade`), when vLLM's heuristic says it pays
                       off or the caller forces it.
    local attention    with attn_chunk_size, the batch is first rewritten into per-chunk
                       virtual requests (`mla.local_attention`).

Host syncs: none when the step is decode-only (max_query_len <= decode_threshold) and has no
cascade prefix and no local attention; otherwise the builder needs the host lengths
(query_lens_cpu, seq_lens_cpu, which vLLM keeps) and reads them back from the device (a sync)
when they are not given.

Decode context parallelism (dcp, mla/cp.py), as vLLM's FlashAttention backend runs it: the cache
of each rank holds its share of every request's tokens. The plan carries the rank's place and
dcp_context_lens, the tokens before each request's new ones (its context) that this rank holds;
the layer attends the group's queries to them without a causal mask, merges the ranks' partials,
and merges that with the new tokens' causal attention over their own keys and values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from openmla.kernels.device import num_sms as device_num_sms
from openmla.mla.cp import ContextParallel
from openmla.mla.mha.cascade import use_cascade_attention
from openmla.mla.mha.local import LocalAttentionBatch, make_local_attention_virtual_batches
from openmla.quant.validate import check_same_device, check_tensor, fail

__all__ = ["AttentionPlan", "AttentionSubPlan", "CascadePlan", "build_attention_plan"]

HostInts = Union[Sequence[int], np.ndarray, torch.Tensor]


@dataclass(frozen=True, eq=False)
class AttentionSubPlan:
    """One paged_attention launch over tokens [token_start, token_end) of the step.

    num_reqs requests; max_query_len: host bound on their query lengths (picks the kernel's
    tile shapes and split-KV). Device: cu_seqlens_q [num_reqs + 1] int32 from 0 (rows past its
    end are padding: out 0), seq_lens [num_reqs] int32, block_table [num_reqs, M] int32.
    """

    token_start: int
    token_end: int
    num_reqs: int
    max_query_len: int
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


@dataclass(frozen=True, eq=False)
class CascadePlan:
    """The whole step as cascade attention (kernels.cascade.cascade_attention).

    common_prefix_len: whole blocks, <= every request's context. max_query_len: host bound.
    Device: cu_seqlens_q [R + 1], block_table [R, M], prefix_cu_seqlens_q [2] = [0, tokens],
    prefix_seq_lens [1], suffix_seq_lens [R] = seq_lens - common_prefix_len; int32.
    """

    common_prefix_len: int
    max_query_len: int
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    prefix_cu_seqlens_q: torch.Tensor
    prefix_seq_lens: torch.Tensor
    suffix_seq_lens: torch.Tensor


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """What one step's batch is, built once (`build_attention_plan`) and read by every layer.

    Built for (checked on use by `check_matches`): num_tokens (T, rows of the query, padding
    included), num_heads, num_kv_heads, block_size, device.

    Requests (after the local-attention rewrite when attn_chunk_size is set: then num_reqs
    counts virtual requests and `local` holds the rewrite): num_reqs, max_query_len,
    decode_threshold, num_decodes / num_decode_tokens (the leading run of short requests),
    num_prefills / num_prefill_tokens.

    Launches: `cascade` when the step runs as cascade attention (then decode and prefill are
    None); otherwise `decode` covers tokens [0, num_decode_tokens) and `prefill` the rest,
    padding included (either may be None; with no prefills, decode covers all T rows).

    Device tensors are the engine's own where possible (views, so in-place updates between CUDA
    graph replays are seen): query_start_loc [R + 1], seq_lens [R], block_table [R, M],
    slot_mapping [T] (the cache writes; < 0 skips a token). A prefill launch after decodes
    carries its own rebased cu_seqlens_q, built at plan time.

    DCP: dcp is this rank's ContextParallel (None: one rank holds every token) and
    dcp_context_lens [R] int32 the context tokens of each request on this rank (module docstring).
    """

    num_tokens: int
    num_reqs: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    max_query_len: int
    decode_threshold: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    device: torch.device
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    decode: Optional[AttentionSubPlan] = None
    prefill: Optional[AttentionSubPlan] = None
    cascade: Optional[CascadePlan] = None
    local: Optional[LocalAttentionBatch] = None
    dcp: Optional[ContextParallel] = None
    dcp_context_lens: Optional[torch.Tensor] = None

    @property
    def use_cascade(self) -> bool:
        return self.cascade is not None

    @property
    def common_prefix_len(self) -> int:
        return self.cascade.common_prefix_len if self.cascade is not None else 0

    @property
    def attn_chunk_size(self) -> Optional[int]:
        return self.local.attn_chunk_size if self.local is not None else None

    def check_matches(self, query: torch.Tensor, k_cache: Optional[torch.Tensor] = None) -> None:
        """ValueError unless query [T, H, D] (and k_cache [num_blocks, block_size, H_kv, D] when
        given) are what this plan was built for."""
        check_tensor("query", query, ndim=3)
        if query.shape[0] != self.num_tokens:
            fail("query.shape[0]", f"{self.num_tokens} (the plan's num_tokens)", query.shape[0])
        if query.shape[1] != self.num_heads:
            fail("query.shape[1]", f"{self.num_heads} (the plan's num_heads)", query.shape[1])
        if k_cache is not None:
            check_tensor("k_cache", k_cache, ndim=4)
            if k_cache.shape[1] != self.block_size:
                fail("k_cache.shape[1] (block_size)", f"{self.block_size} (the plan's block_size)",
                     tuple(k_cache.shape))
            if k_cache.shape[2] != self.num_kv_heads:
                fail("k_cache.shape[2] (H_kv)", f"{self.num_kv_heads} (the plan's num_kv_heads)",
                     tuple(k_cache.shape))
        check_same_device(**{"plan tensors": self.query_start_loc, "query": query,
                             "k_cache": k_cache})


def _host_ints(name: str, x: HostInts, n: int) -> list:
    """Host integers from a CPU tensor, numpy array or sequence; ValueError for a device tensor
    (reading one would be a sync) or a wrong length."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            fail(f"{name}.device", "cpu (host lengths; reading a device tensor is a sync)", x.device)
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            fail(f"{name}.dtype", "an integer dtype", x.dtype)
        x = x.tolist()
    vals = [int(v) for v in np.asarray(x).reshape(-1).tolist()]
    if len(vals) != n:
        fail(f"len({name})", n, len(vals))
    return vals


def _int_arg(name: str, x, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < lo:
        fail(name, f"an int >= {lo}", repr(x))
    return int(x)


def build_attention_plan(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    max_query_len: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    decode_threshold: int = 1,
    query_lens_cpu: Optional[HostInts] = None,
    seq_lens_cpu: Optional[HostInts] = None,
    common_prefix_len: int = 0,
    use_cascade: Optional[bool] = None,
    attn_chunk_size: Optional[int] = None,
    use_alibi: bool = False,
    use_sliding_window: bool = False,
    num_sms: Optional[int] = None,
    dcp: Optional[ContextParallel] = None,
    dcp_context_lens_out: Optional[torch.Tensor] = None,
) -> AttentionPlan:
    """Build one step's plan from what the engine has (vLLM's CommonAttentionMetadata).

    Args:
        query_start_loc: [R + 1] int32 (device), cumulative query tokens per request, from 0.
        seq_lens: [R] int32 (device), keys per request including this step's new tokens.
        block_table: [R, M] int32 (device), physical block of each logical block.
        slot_mapping: [T] int32/int64 (device), cache slot of each query token (< 0: padding,
            not written). T, its length, is the step's token count, padding rows included.
        max_query_len: python int >= every query length (vLLM's max_query_len).
        block_size: the cache's page size. num_heads, num_kv_heads: H and H_kv of the layers.
        decode_threshold: a request with query_len <= this is a decode (raise it to the
            speculative length for spec decoding).
        query_lens_cpu, seq_lens_cpu: [R] host ints (CPU tensor, numpy or sequence). Needed for
            mixed batches, cascade and local attention, read back from the device (a sync) when
            missing. Must agree with the device tensors (not checked: a sync).
        common_prefix_len: tokens every request shares (vLLM: common prefix blocks * block_size).
            As vLLM's model runner, the plan caps it at the shortest context (seq_len - q_len)
            and rounds it down to whole blocks.
        use_cascade: None: vLLM's heuristic (`mla.mha.cascade.use_cascade_attention`) decides;
            True: cascade whenever the capped prefix is not empty (NotImplementedError with
            ALiBi, a sliding window or local attention; ValueError if the prefix rounds to 0);
            False: never.
        attn_chunk_size: chunked local attention (`mla.local_attention`), or None.
        use_alibi, use_sliding_window: the layers' features (the cascade heuristic needs them).
        num_sms: GPU multiprocessors for the heuristic (default: the device's; 8 on the CPU).
        dcp: this rank's ContextParallel (mla/cp.py) when each rank holds a share of every
            request's tokens; slot_mapping must then be the rank's (ContextParallel.slot_mapping,
            vLLM's under DCP). NotImplementedError with cascade, local attention, ALiBi or a
            sliding window (their positions are global, the rank's cache is indexed locally).
        dcp_context_lens_out: optional persistent int32 buffer of >= R elements on the batch's
            device for dcp_context_lens (CUDA graphs: the same address every step).

    Returns an AttentionPlan.
    """
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, contiguous=True)
    R = query_start_loc.shape[0] - 1
    if R < 0:
        fail("query_start_loc.shape", "(R + 1,) with R >= 0", tuple(query_start_loc.shape))
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(R,), contiguous=True)
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(R, None),
                 last_dim_contiguous=True)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), ndim=1,
                 contiguous=True)
    device = check_same_device(query_start_loc=query_start_loc, seq_lens=seq_lens,
                               block_table=block_table, slot_mapping=slot_mapping)
    T = slot_mapping.shape[0]
    max_query_len = _int_arg("max_query_len", max_query_len, 0)
    block_size = _int_arg("block_size", block_size, 1)
    num_heads = _int_arg("num_heads", num_heads, 1)
    num_kv_heads = _int_arg("num_kv_heads", num_kv_heads, 1)
    if num_heads % num_kv_heads:
        fail("num_kv_heads", f"a divisor of num_heads = {num_heads}", num_kv_heads)
    decode_threshold = _int_arg("decode_threshold", decode_threshold, 1)
    common_prefix_len = _int_arg("common_prefix_len", common_prefix_len, 0)
    if use_cascade not in (None, True, False):
        fail("use_cascade", "None (heuristic), True or False", repr(use_cascade))
    if attn_chunk_size is not None:
        attn_chunk_size = _int_arg("attn_chunk_size", attn_chunk_size, 1)
    if use_cascade and (use_alibi or use_sliding_window or attn_chunk_size is not None):
        which = [n for n, on in (("ALiBi", use_alibi), ("a sliding window", use_sliding_window),
                                 ("local attention", attn_chunk_size is not None)) if on]
        raise NotImplementedError(f"cascade attention with {' and '.join(which)} (vLLM does not "
                                  "support it either: the prefix pass has no per-query position)")
    if dcp is not None:
        if not isinstance(dcp, ContextParallel):
            fail("dcp", "None or an openmla.mla.cp.ContextParallel", type(dcp).__name__)
        which = [n for n, on in (("cascade", use_cascade), ("local attention", attn_chunk_size is not None),
                                 ("ALiBi", use_alibi), ("a sliding window", use_sliding_window)) if on]
        if which:
            raise NotImplementedError(f"DCP with {' and '.join(which)} (positions are global; "
                                      "each rank's cache is indexed by its local tokens)")
        use_cascade = False
    want_cascade = common_prefix_len > 0 and use_cascade is not False
    need_host = max_query_len > decode_threshold or want_cascade or attn_chunk_size is not None

    qlens = seq = None
    if need_host:
        if query_lens_cpu is None:
            qsl = query_start_loc.tolist()  # a sync; the engine avoids it with query_lens_cpu
            qlens = [qsl[i + 1] - qsl[i] for i in range(R)]
        else:
            qlens = _host_ints("query_lens_cpu", query_lens_cpu, R)
        if want_cascade or attn_chunk_size is not None:
            seq = seq_lens.tolist() if seq_lens_cpu is None else _host_ints("seq_lens_cpu",
                                                                            seq_lens_cpu, R)
        for i, n in enumerate(qlens):
            if n < 0 or n > max_query_len:
                fail(f"query_lens_cpu[{i}]", f"in [0, max_query_len = {max_query_len}]", n)
            if seq is not None and seq[i] < n:
                fail(f"seq_lens_cpu[{i}]", f">= its query length {n}", seq[i])
        if sum(qlens) > T:
            fail("sum(query_lens_cpu)", f"<= num tokens {T} (slot_mapping.shape[0])", sum(qlens))

    local = None
    if attn_chunk_size is not None:
        local = make_local_attention_virtual_batches(
            attn_chunk_size, np.concatenate([[0], np.cumsum(qlens, dtype=np.int64)]), seq,
            block_table, block_size)
        query_start_loc, seq_lens, block_table = local.cu_seqlens_q, local.seq_lens, local.block_table
        R, max_query_len = local.num_reqs, local.max_query_len
        qlens, seq = local.query_lens.tolist(), local.seq_lens_cpu.tolist()

    # Decodes first: the leading run of short requests.
    if qlens is None:  # max_query_len <= decode_threshold: every request is a decode
        nd, starts_nd, tokens = R, None, None
    else:
        nd = 0
        while nd < R and qlens[nd] <= decode_threshold:
            nd += 1
        tokens = sum(qlens)
        starts_nd = sum(qlens[:nd])
    common = dict(num_tokens=T, num_reqs=R, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  block_size=block_size, max_query_len=max_query_len,
                  decode_threshold=decode_threshold, num_decodes=nd,
                  num_decode_tokens=T if nd == R else starts_nd, num_prefills=R - nd,
                  num_prefill_tokens=0 if nd == R else tokens - starts_nd, device=device,
                  query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                  slot_mapping=slot_mapping, local=local)

    # Cascade: cap at the shortest context and round down to whole blocks (vLLM's runner).
    if want_cascade and R > 0:
        shared = min(common_prefix_len, min(s - q for s, q in zip(seq, qlens)))
        shared = shared // block_size * block_size
        if use_cascade and shared == 0:
            fail("common_prefix_len", "at least one whole block within every request's context "
                 "(use_cascade=True)", f"{common_prefix_len} -> 0 after capping and rounding")
        if use_cascade is None:
            chosen = use_cascade_attention(
                shared, qlens, num_heads, num_kv_heads, use_alibi=use_alibi,
                use_sliding_window=use_sliding_window,
                use_local_attention=attn_chunk_size is not None,
                num_sms=num_sms if num_sms is not None else device_num_sms(device))
        else:
            chosen = shared > 0
        if chosen:
            cascade = CascadePlan(
                common_prefix_len=shared, max_query_len=max_query_len,
                cu_seqlens_q=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                prefix_cu_seqlens_q=query_start_loc[::R].contiguous(),
                prefix_seq_lens=torch.full((1,), shared, dtype=torch.int32, device=device),
                suffix_seq_lens=seq_lens - shared)
            return AttentionPlan(cascade=cascade, **common)

    if dcp is not None:
        if dcp_context_lens_out is not None:
            check_tensor("dcp_context_lens_out", dcp_context_lens_out, dtype=torch.int32, ndim=1)
            if dcp_context_lens_out.shape[0] < R:
                fail("dcp_context_lens_out.shape[0]", f">= {R} (the step's requests)",
                     dcp_context_lens_out.shape[0])
            dcp_context_lens_out = dcp_context_lens_out[:R]
        ctx = dcp.local_seq_lens(seq_lens - (query_start_loc[1:] - query_start_loc[:-1]),
                                 out=dcp_context_lens_out)
        common.update(dcp=dcp, dcp_context_lens=ctx)
    decode = prefill = None
    if nd == R:
        decode = AttentionSubPlan(0, T, R, min(max_query_len, decode_threshold), query_start_loc,
                                  seq_lens, block_table)
    elif nd == 0:
        prefill = AttentionSubPlan(0, T, R, max_query_len, query_start_loc, seq_lens, block_table)
    else:
        decode = AttentionSubPlan(0, starts_nd, nd, min(max_query_len, decode_threshold),
                                  query_start_loc[:nd + 1], seq_lens[:nd], block_table[:nd])
        # The prefill launch's cu_seqlens_q restarts at 0 (one device subtraction, no sync).
        prefill = AttentionSubPlan(starts_nd, T, R - nd, max_query_len,
                                   query_start_loc[nd:] - query_start_loc[nd:nd + 1],
                                   seq_lens[nd:], block_table[nd:])
    return AttentionPlan(decode=decode, prefill=prefill, **common)
