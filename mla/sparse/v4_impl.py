"""SparseMLAV4Impl: one DeepSeek-V4-style sparse attention layer (FlashMLA's MODEL1) without vLLM.

    plan = build_sparse_mla_v4_plan(query_start_loc, seq_lens, window_block_table, T,
                                    window_size=128, window_block_size=64, num_heads=H,
                                    max_model_len=..., compressed={4: (c4_table, 16),
                                                                   128: (c128_table, 1)})  # per step
    impl = SparseMLAV4Impl(H, scale, compress_ratio=4, attn_sink=sink)                    # per layer
    impl.write_cache(k, window_cache, window_slot_mapping)                                 # per layer
    out = impl.forward_mqa(q, window_cache, plan, compressed_cache=cc, compressed_indices=topk)

A V4 layer is multi-query attention over 512-wide tokens (448 nope + 64 rope; the value is the
whole token), read from two MODEL1 caches (quant/model1_format.py): the sliding window of the
query's own request and, for layers with compress_ratio > 1, a compressed cache (one entry per
`ratio` tokens). mla/sparse/v4_plan.py says which tokens each list holds. Both lists join one
softmax in one launch of the decode kernel (the compressed list is its extra cache), and the
per-head sink applies once to the joined result, as FlashMLA's flash_mla_with_kvcache(
extra_k_cache=...) and vLLM's DeepseekV4FlashMLAAttention do.

Every query token, prefill ones included, runs through the decode kernel, which reads both fp8
caches in place (no bf16 workspace): its launches depend on T and the shapes alone, and the
window list is at most window_size long. (vLLM's prefill path gathers both caches into a bf16
workspace for the prefill kernel, which pays off for long prefills at large head counts; the
d_qk 512 prefill kernel is there for an engine that gathers itself.)

The query projection and the output projection (V4's grouped wo_a / wo_b with the inverse rope)
are the model's; this class takes the 512-wide query and returns the 512-wide attention output.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from openmla.kernels.sparse_mla_decode import sparse_mla_decode
from openmla.mla.sparse.v4_plan import MAX_HEADS, SparseMLAV4Plan
from openmla.quant.format_types import SPARSE_MLA
from openmla.quant.formats import cache_format
from openmla.quant.model1_format import FP8_MODEL1
from openmla.quant.model1_writer import write_model1_cache
from openmla.quant.validate import check_same_device, check_tensor, fail

__all__ = ["SparseMLAV4Impl"]

D = FP8_MODEL1.head_dim  # 512: q, k and v width


class SparseMLAV4Impl:
    """One V4 attention layer (per tensor-parallel rank).

    Args:
        num_heads: H, query heads of this rank, 1..128 (never padded).
        scale: softmax scale applied to q.k (finite, > 0).
        compress_ratio: this layer's compression: <= 1 a window-only layer, 4 (indexer top-k over
            the compressed cache, "C4A"), 128 (every visible compressed entry, "C128A"), or any
            other ratio > 1 the plan has.
        attn_sink: optional [H] fp32 per-head sink (DeepSeek-V4 has one per head): out *=
            exp(lse) / (exp(lse) + exp(sink)); set later with set_attn_sink.
        kv_cache_dtype: the caches' format, "fp8_model1" (FP8_MODEL1); other formats raise
            NotImplementedError.
    """

    def __init__(self, num_heads: int, scale: float, *, compress_ratio: int,
                 attn_sink: Optional[torch.Tensor] = None, kv_cache_dtype="fp8_model1"):
        self.cache_format = cache_format(kv_cache_dtype, SPARSE_MLA, who="SparseMLAV4Impl")
        if self.cache_format != FP8_MODEL1:
            raise NotImplementedError(f"SparseMLAV4Impl: kv_cache_dtype {self.cache_format.name!r}; the V4 "
                                      f"layer reads {FP8_MODEL1.name} caches")
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            fail("num_heads", "a positive int", repr(num_heads))
        if num_heads > MAX_HEADS:
            raise NotImplementedError(f"SparseMLAV4Impl: num_heads={num_heads} > {MAX_HEADS} (the kernels' limit)")
        if (isinstance(scale, bool) or not isinstance(scale, (int, float))
                or not (math.isfinite(scale) and scale > 0)):
            fail("scale", "a finite positive float", repr(scale))
        if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, int):
            fail("compress_ratio", "an int", repr(compress_ratio))
        self.num_heads = num_heads
        self.scale = float(scale)
        self.compress_ratio = compress_ratio
        self.attn_sink: Optional[torch.Tensor] = None
        if attn_sink is not None:
            self.set_attn_sink(attn_sink)

    @property
    def window_only(self) -> bool:
        return self.compress_ratio <= 1

    def set_attn_sink(self, attn_sink: Optional[torch.Tensor]) -> None:
        """attn_sink: [H] float (kept as fp32, contiguous) or None."""
        if attn_sink is not None:
            check_tensor("attn_sink", attn_sink, dtype=(torch.float32, torch.bfloat16, torch.float16),
                         shape=(self.num_heads,))
            attn_sink = attn_sink.float().contiguous()
        self.attn_sink = attn_sink

    def write_cache(self, k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize tokens into a MODEL1 cache (window or compressed): k [T, 512] bf16,
        slot_mapping [T] int32/int64 (< 0 or past the cache: skipped); no host sync."""
        write_model1_cache(k, cache, slot_mapping, fmt=self.cache_format, check_slots=False)

    def forward_mqa(self, q: torch.Tensor, window_cache: torch.Tensor, plan: SparseMLAV4Plan, *,
                    compressed_cache: Optional[torch.Tensor] = None,
                    compressed_indices: Optional[torch.Tensor] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of one layer over its window list and, with compress_ratio > 1, its
        compressed list, one softmax.

        Args:
            q: [T, H, 512] bf16 (nope 448 | rope 64, RoPE applied), last dim contiguous.
            window_cache: this layer's window cache, MODEL1 [num_blocks, plan.window_block_size,
                (1,) 584] uint8, written for every token of the step.
            plan: this step's plan (build_sparse_mla_v4_plan).
            compressed_cache: the layer's compressed cache (MODEL1, the plan's block size for this
                ratio); required when compress_ratio > 1, None otherwise.
            compressed_indices: [T, topk] int32 per-request compressed entry numbers (the
                indexer's top-k of a C4A layer); invalid ones (< 0, not yet visible to the
                query, past the request's entries) are skipped. None: every entry the query sees
                (C128A).
            out: optional [T, H, 512] bf16, last dim contiguous.

        Returns [T, H, 512] bf16; 0 for a padding token (it attends nothing).
        """
        T, H = plan.num_tokens, self.num_heads
        if not isinstance(plan, SparseMLAV4Plan):
            fail("plan", "a SparseMLAV4Plan (build_sparse_mla_v4_plan)", type(plan).__name__)
        check_tensor("q", q, dtype=torch.bfloat16, shape=(T, H, D), last_dim_contiguous=True)
        if plan.num_heads != H:
            fail("plan.num_heads", f"{H} (this layer's heads)", plan.num_heads)
        self.cache_format.check_cache(window_cache, "window_cache")
        if window_cache.shape[1] != plan.window_block_size:
            fail("window_cache.shape[1] (block_size)", f"{plan.window_block_size} (the plan's)",
                 tuple(window_cache.shape))
        if out is not None:
            check_tensor("out", out, dtype=torch.bfloat16, shape=(T, H, D), last_dim_contiguous=True)
        extra = {}
        if self.window_only:
            if compressed_cache is not None or compressed_indices is not None:
                fail("compressed_cache / compressed_indices", "None for a window-only layer "
                     f"(compress_ratio {self.compress_ratio})", "a tensor")
        else:
            extra = self._compressed(plan, compressed_cache, compressed_indices)
        check_same_device(q=q, window_cache=window_cache, out=out, attn_sink=self.attn_sink,
                          **{"plan tensors": plan.window_slots})
        if out is None:
            out = torch.empty(T, H, D, dtype=torch.bfloat16, device=q.device)
        if T == 0:
            return out
        sparse_mla_decode(q, window_cache, plan.window_slots, scale=self.scale,
                          topk_length=plan.window_lens, attn_sink=self.attn_sink, out=out,
                          fmt=self.cache_format, **extra)
        return out

    def _compressed(self, plan: SparseMLAV4Plan, cache, indices) -> dict:
        """The decode kernel's extra-cache arguments for this layer's compressed list."""
        r = self.compress_ratio
        if cache is None:
            fail("compressed_cache", f"this layer's compressed cache (compress_ratio {r})", None)
        self.cache_format.check_cache(cache, "compressed_cache")
        part = plan._part(r)
        if cache.shape[1] != part.block_size:
            fail("compressed_cache.shape[1] (block_size)", f"{part.block_size} (the plan's for ratio {r})",
                 tuple(cache.shape))
        if indices is None:
            slots, lengths = plan.all_visible(r)
            return dict(extra_cache=cache, extra_indices=slots, extra_topk_length=lengths)
        check_tensor("compressed_indices", indices, dtype=torch.int32, shape=(plan.num_tokens, None),
                     last_dim_contiguous=True)
        if indices.shape[1] < 1:
            fail("compressed_indices.shape[1] (topk)", ">= 1", indices.shape[1])
        return dict(extra_cache=cache, extra_indices=plan.compressed_slots(r, indices))
