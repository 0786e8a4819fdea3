"""Triton writer of the DSA lightning indexer's K cache (vLLM's `indexer_k_quant_and_cache`).

The format (byte layout, quantization rule) and its torch references are quant/indexer_format.py;
this module re-exports them, so `quant.indexer_cache` is the one import for the indexer's cache.
The writer's bytes equal `IndexerKFormat.write_ref`'s exactly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.kernels.device import arch_of

from .e4m3 import f32_to_e4m3
from .format_types import INDEXER
from .indexer_format import (AMAX_FLOOR, FP8_MAX, INDEXER_K_FP8, INDEXER_K_FP8_RAW, IndexerKFormat,
                             indexer_k_format_of)
from .mla_writer import check_slot_range, tile_scale
from .validate import check_same_device, check_tensor, fail

__all__ = ["INDEXER", "IndexerKFormat", "INDEXER_K_FP8", "INDEXER_K_FP8_RAW", "write_indexer_k_cache",
           "indexer_k_format_of"]


# ---------------------------------------------------------------------------------- Triton writer
@triton.jit
def write_indexer_k_cache_kernel(
    k_ptr, cache_ptr, slot_ptr,
    stride_k_t, stride_cache_block, block_size, num_slots,
    GROUPS: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr,
    FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, E4M3: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    # Skipped (< 0) and out-of-range slots write nothing: never a wild write, even unchecked.
    m_slot = (slot >= 0) & (slot < num_slots)
    slot = tl.where(m_slot, slot, 0)
    i_b, i_o = slot // block_size, slot % block_size
    p_block = cache_ptr + i_b * stride_cache_block

    o_k = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    b_x = tl.load(k_ptr + i_t * stride_k_t + o_k, mask=m_slot, other=0.0).to(tl.float32)
    # max.f32 drops NaN, as CUDA's fmaxf in vLLM's writer: a NaN element does not poison the scale.
    b_amax = tl.max(tl.abs(b_x), axis=1)
    # The floor applies to amax here (vLLM's rule), so the scale rule's own floor is 0.
    b_s = tile_scale(tl.maximum(b_amax, AMAX_FLOOR), UE8M0, FP8_MAX, 0.0)
    b_q = f32_to_e4m3(tl.math.div_rn(b_x, b_s[:, None]), E4M3)
    tl.store(p_block + i_o * (GROUPS * GROUP) + o_k, b_q, mask=m_slot)
    p_scale = (p_block + block_size * (GROUPS * GROUP)).to(tl.pointer_type(tl.float32))
    tl.store(p_scale + i_o * GROUPS + tl.arange(0, GROUPS), b_s, mask=m_slot)


def write_indexer_k_cache(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          fmt=INDEXER_K_FP8, check_slots: bool = True) -> None:
    """Quantize T new indexer keys into the paged indexer K cache, in place (vLLM's
    `indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)`).

    Args:
        k: [T, 128] bf16 (fp16 / fp32 accepted), last dim contiguous, any token stride.
        cache: [num_blocks, block_size, 132] uint8 in the page-blocked layout of this module's
            docstring; any block stride (a multiple of 4), each block contiguous inside.
        slot_mapping: [T] int32 / int64, slot = block * block_size + offset; < 0 skips the token
            (padding). Distinct slots expected (duplicates: which token lands is unspecified).
        fmt: an IndexerKFormat (INDEXER_K_FP8: ue8m0 scales, default; INDEXER_K_FP8_RAW), or
            vLLM's scale_fmt string (`indexer_k_format_of`).
        check_slots: raise ValueError when some slot >= num_blocks * block_size (reads
            slot_mapping.max() back: a device sync; pass False under CUDA-graph capture). Either way
            the kernel skips out-of-range slots instead of writing out of bounds.

    The bytes written equal `fmt.write_ref(k, cache, slot_mapping)` exactly.
    """
    fmt = indexer_k_format_of(fmt)
    check_tensor("k", k, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=2,
                 last_dim_contiguous=True)
    T = k.shape[0]
    if k.shape[1] != fmt.head_dim:
        fail("k.shape", f"(T, {fmt.head_dim})", tuple(k.shape))
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(T,))
    fmt.check_cache(cache)
    if fmt.quant_block_size & (fmt.quant_block_size - 1) or fmt.scales_per_token & (fmt.scales_per_token - 1):
        raise NotImplementedError(f"write_indexer_k_cache: {fmt} needs power-of-two group sizes "
                                  "(the kernel's block shapes)")
    check_same_device(k=k, cache=cache, slot_mapping=slot_mapping)
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    num_slots = num_blocks * block_size
    if T == 0:
        return
    if check_slots:
        check_slot_range(slot_mapping, num_slots)  # device sync, documented above
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    write_indexer_k_cache_kernel[(T,)](
        k, cache, slot_mapping, k.stride(0), cache.stride(0), block_size, num_slots,
        GROUPS=fmt.scales_per_token, GROUP=fmt.quant_block_size, UE8M0=fmt.ue8m0,
        FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, E4M3=arch_of(cache.device).e4m3_plain, num_warps=4,
    )
