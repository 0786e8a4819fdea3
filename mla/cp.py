"""Decode context parallelism (DCP): one request's KV tokens spread over the ranks of a group.

As vLLM 0.32 lays them out (`--decode-context-parallel-size N`, `cp_kv_cache_interleave_size I`;
vllm/v1/worker/block_table.py, vllm/v1/attention/backends/utils.py get_dcp_local_seq_lens), the
tokens of a request are dealt to the N ranks in runs of I:

    owner(p)  = (p // I) % N                       rank holding token position p
    local(p)  = (p // (N * I)) * I + p % I         its index among that rank's tokens

Each rank keeps its tokens in its own paged cache, through the same block table, indexed by the
local index (slot = block_table[req, local // block_size] * block_size + local % block_size), so
a request of seq_len tokens has `local_seq_lens` of them on each rank. Attention runs on every
rank over its local tokens and returns the output normalized over them with its lse; `merge`
combines the N partials into the attention over all tokens, exact up to rounding (the merge maths
of kernels/merge.py):

    lse = log(sum_r exp(lse_r))      out = sum_r exp(lse_r - lse) * out_r

Heads. "sharded" (vLLM's: the DCP ranks are tensor-parallel ranks, each owning H query heads):
`gather_heads` all-gathers the query to the group's N * H heads before attention, and `merge`
sends each rank back its own H heads (an all-to-all of the partials), so every rank ends with its
heads' full result. "replicated": every rank has the same H heads; `merge` all-gathers the
partials and every rank ends with the full result. Either way one collective carries out and lse
together (the lse bits packed behind each head's output row), and the combine runs locally in
fp32 (merge_attn_states folding the N parts), so no sum is rounded to bf16 between ranks.

Reliability (DESIGN.md): an empty local set (lse -inf, or +inf as FlashAttention reports it) is
ignored whatever its out holds; all parts empty gives out = 0, lse = -inf; a part with a NaN lse or
a NaN or inf in its out makes the merged row NaN, out and lse. A sink (`attn_sink [H]`) is one more
logit per head with no value: applied once, in the merge, never per rank.

Collectives are torch.distributed's (all_gather_single / all_to_all_single), on the group given
(None: the default group): NCCL on GPUs, gloo on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from openmla.kernels.merge import merge_attn_states
from openmla.quant.validate import check_tensor, fail

__all__ = ["ContextParallel", "HEAD_MODES"]

HEAD_MODES = ("sharded", "replicated")


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # all_gather_single is torch >= 2.11's name of all_gather_into_tensor
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """This rank's place in a DCP group.

    Args:
        world_size: N, ranks sharing each request's tokens (>= 1).
        rank: this rank's index in the group, 0..N-1.
        interleave: I, consecutive tokens per run on one rank (vLLM's
            cp_kv_cache_interleave_size; >= 1).
        group: the torch.distributed process group of the N ranks (None: the default group).
            Only `gather_heads` and `merge` use it.
        heads: "sharded" (each rank owns H of the group's N * H query heads; vLLM's) or
            "replicated" (every rank has the same H heads).
    """

    world_size: int
    rank: int
    interleave: int = 1
    group: Any = None
    heads: str = "sharded"

    def __post_init__(self):
        for name, val, lo in (("world_size", self.world_size, 1), ("interleave", self.interleave, 1),
                              ("rank", self.rank, 0)):
            if isinstance(val, bool) or not isinstance(val, int) or val < lo:
                fail(f"ContextParallel.{name}", f"an int >= {lo}", repr(val))
        if self.rank >= self.world_size:
            fail("ContextParallel.rank", f"< world_size = {self.world_size}", self.rank)
        if self.heads not in HEAD_MODES:
            fail("ContextParallel.heads", f"one of {HEAD_MODES}", repr(self.heads))

    @classmethod
    def from_group(cls, group=None, *, interleave: int = 1, heads: str = "sharded") -> "ContextParallel":
        """The ContextParallel of this process in `group` (torch.distributed must be initialized)."""
        return cls(dist.get_world_size(group), dist.get_rank(group), interleave, group, heads)

    def attn_heads(self, num_heads: int) -> int:
        """Query heads the attention kernels see on this rank for a layer of num_heads per rank."""
        return num_heads * self.world_size if self.heads == "sharded" else num_heads

    # ------------------------------------------------------------------ token layout
    def local_indices(self, token_indices: torch.Tensor) -> torch.Tensor:
        """Per-request token positions -> this rank's local indices, -1 for a position another
        rank holds and for every negative one (int32, same shape; no host read).

        token_indices: int32 (any shape), positions within each token's request (the indexer's
        top-k). A position past the request's end maps past its local_seq_len, so the caller's
        bound by local_seq_lens drops it, as the single-rank bound by seq_len would."""
        p = token_indices
        n, i = self.world_size, self.interleave
        chunk = torch.div(p, i, rounding_mode="floor")
        local = torch.div(chunk, n, rounding_mode="floor") * i + (p - chunk * i)
        mine = (p >= 0) & (chunk % n == self.rank)
        return torch.where(mine, local, torch.full_like(local, -1))

    def local_seq_lens(self, seq_lens: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tokens of each request this rank holds, of the first seq_lens[r] (int32, device ops
        only; `out`: a persistent [R] int32 buffer to write into). vLLM's get_dcp_local_seq_lens."""
        n, i = self.world_size, self.interleave
        s = seq_lens.to(torch.int32)
        full = torch.div(s, n * i, rounding_mode="floor") * i
        local = full + (s - full * n - self.rank * i).clamp(0, i)
        if out is None:
            return local
        return out.copy_(local)

    def slot_mapping(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
        """The cache slot of each of the step's new tokens on this rank, -1 where another rank
        holds it (its writer skips it), for padding tokens (past query_start_loc[R]) and where
        the block table has no entry (< 0 or past its width). int64 [num_tokens], device ops
        only (vLLM's ComputeSlotMappingKernel; token t of request r sits at position
        seq_lens[r] - query_len[r] + t - query_start_loc[r])."""
        check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1)
        R = query_start_loc.shape[0] - 1
        check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(R,))
        check_tensor("block_table", block_table, dtype=torch.int32, shape=(R, None))
        dev = query_start_loc.device
        t = torch.arange(num_tokens, dtype=torch.int32, device=dev)
        req = torch.searchsorted(query_start_loc[1:], t, right=True, out_int32=True)
        real = req < R
        r = req.clamp(max=max(R - 1, 0)).long()
        if R == 0:
            return torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
        qsl = query_start_loc.long()
        pos = seq_lens.long()[r] - (qsl[r + 1] - qsl[r]) + t.long() - qsl[r]
        local = self.local_indices(pos)
        blk = torch.div(local, block_size, rounding_mode="floor")
        ok = real & (local >= 0) & (blk < block_table.shape[1])
        entry = block_table[r, blk.clamp(0, block_table.shape[1] - 1)].long()
        ok &= entry >= 0
        slot = entry * block_size + local - blk * block_size
        return torch.where(ok, slot, torch.full_like(slot, -1))

    # ------------------------------------------------------------------ collectives
    def gather_heads(self, q: torch.Tensor, num_kv_heads: int = 1) -> torch.Tensor:
        """"sharded": q [T, H, D] of this rank -> [T, N * H, D], the group's heads (an all-gather);
        "replicated": q itself. With num_kv_heads > 1 (GQA, the group's ranks holding the same KV
        heads) the gathered heads are ordered KV head by KV head (all ranks' queries of KV head 0
        first), so head h reads KV head h // (N * H / num_kv_heads) as the kernels assume;
        `merge(..., num_kv_heads=)` undoes the order."""
        if self.heads == "replicated" or self.world_size == 1:
            return q
        T, H, D = q.shape
        g = torch.empty(self.world_size * T, H, D, dtype=q.dtype, device=q.device)
        _all_gather(g, q.contiguous(), self.group)
        g = g.view(self.world_size, T, H, D)
        if num_kv_heads == 1:
            return g.permute(1, 0, 2, 3).reshape(T, self.world_size * H, D)
        return (g.view(self.world_size, T, num_kv_heads, H // num_kv_heads, D)
                .permute(1, 2, 0, 3, 4).reshape(T, self.world_size * H, D))

    def merge(self, out: torch.Tensor, lse: torch.Tensor, *, attn_sink: Optional[torch.Tensor] = None,
              lse_with_sink: bool = False, num_kv_heads: int = 1,
              result: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Combine this rank's partial attention with the other ranks' (collective: every rank of
        the group calls it with the same shapes).

        Args:
            out: [T, Hk, D] bf16/fp16/fp32, this rank's output normalized over its local keys
                (Hk = N * H for "sharded", in gather_heads' order; H for "replicated").
            lse: [T, Hk] fp32 natural log of its softmax denominator; -inf (or +inf) = no local key.
            attn_sink: optional [H] fp32 (this rank's heads): one more logit per head, no value,
                applied once to the merged result.
            lse_with_sink: whether the returned lse includes the sink (the MHA path's lse does;
                sparse MLA's lse does not: DESIGN.md).
            num_kv_heads: the KV heads gather_heads ordered the query by.
            result: optional [T, H, D] tensor in out's dtype to write the merged output into.

        Returns (out [T, H, D] in out's dtype, lse [T, H] fp32): this rank's heads over every
        rank's keys. Empty parts are ignored; all empty gives 0 and -inf; faults stay NaN.
        """
        check_tensor("out", out, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=3,
                     last_dim_contiguous=True)
        T, Hk, D = out.shape
        check_tensor("lse", lse, dtype=torch.float32, shape=(T, Hk))
        n = self.world_size
        sharded = self.heads == "sharded" and n > 1
        if sharded and Hk % n:
            fail("out.shape[1]", f"a multiple of world_size = {n} (sharded heads)", Hk)
        H = Hk // n if sharded else Hk
        if attn_sink is not None:
            check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(H,))
        if result is None:
            result = torch.empty(T, H, D, dtype=out.dtype, device=out.device)
        else:
            check_tensor("result", result, dtype=out.dtype, shape=(T, H, D), last_dim_contiguous=True)
        merged_lse = torch.empty(T, H, dtype=torch.float32, device=out.device)
        if n == 1:
            parts = [(out, lse)]
        else:
            parts = self._exchange(out, lse, sharded, num_kv_heads)
        if attn_sink is not None:  # the sink: one more part, lse = sink[h], out = 0
            zero = out.new_zeros(1, 1, D).expand(T, H, D)
            parts.append((zero, attn_sink.view(1, H).expand(T, H)))
        if len(parts) == 1:
            result.copy_(parts[0][0])
            merged_lse.copy_(parts[0][1])
            return result, merged_lse
        # fold in fp32; the last fold writes the caller's dtype (one rounding)
        acc = result if len(parts) == 2 or out.dtype == torch.float32 else \
            torch.empty(T, H, D, dtype=torch.float32, device=out.device)
        a_out, a_lse = parts[0]
        sink_lse = None
        for k, (b_out, b_lse) in enumerate(parts[1:], start=2):
            dst = result if k == len(parts) else acc
            if attn_sink is not None and k == len(parts) and not lse_with_sink:
                sink_lse = torch.empty_like(merged_lse)  # the lse stays the keys' own
                merge_attn_states(dst, a_out, a_lse, b_out, b_lse, out_lse=sink_lse)
            else:
                merge_attn_states(dst, a_out, a_lse, b_out, b_lse, out_lse=merged_lse)
            a_out, a_lse = dst, merged_lse
        if sink_lse is not None and len(parts) == 2:  # no fold before the sink's: its lse
            merged_lse.copy_(parts[0][1])
        return result, merged_lse

    def _exchange(self, out, lse, sharded: bool, num_kv_heads: int) -> list:
        """The N partials of this rank's heads: [(out_r [T, H, D], lse_r [T, H])] for r in
        0..N-1, moved in one collective. Each head row is packed as [out (D, padded to 16 bytes)
        | lse bits (16 bytes)], so out rows stay 16-byte aligned for the merge's loads."""
        n = self.world_size
        T, Hk, D = out.shape
        H = Hk // n if sharded else Hk
        e = out.element_size()
        align = 16 // e
        Dp = -(-D // align) * align
        W = Dp + align
        send = torch.empty((n, T, H, W) if sharded else (1, T, H, W), dtype=out.dtype,
                           device=out.device)
        lse_bits = send[..., Dp:Dp + 4 // e].view(torch.float32).squeeze(-1)
        if sharded:
            G = H // num_kv_heads
            o = out.reshape(T, num_kv_heads, n, G, D).permute(2, 0, 1, 3, 4)
            send[..., :D].view(n, T, num_kv_heads, G, D).copy_(o)
            lse_bits.view(n, T, num_kv_heads, G).copy_(
                lse.reshape(T, num_kv_heads, n, G).permute(2, 0, 1, 3))
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.group)
        else:
            send[0, ..., :D].copy_(out)
            lse_bits[0].copy_(lse)
            recv = torch.empty((n, T, H, W), dtype=out.dtype, device=out.device)
            _all_gather(recv.view(-1), send.view(-1), self.group)
        r_lse = recv[..., Dp:Dp + 4 // e].view(torch.float32).squeeze(-1)
        return [(recv[r, ..., :D], r_lse[r]) for r in range(n)]
