"""Host side of `paged_attention_kernel`: tile class and split count from shapes alone, then one
launch of the kernel (and of the split-KV reduction when keys are split).

Two launches with their own arguments: `launch_paged` (keys in a paged cache, in any of its
formats) and `launch_varlen` (keys in contiguous rows of k and v). Each describes where the
kernel finds request r's keys as a `_KeySource` and hands it to `_launch`, which owns everything
the two share (row packing, splits, score options, outputs).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton

from openmla.kernels.device import arch_of, num_sms
from openmla.kernels.paged_attention.kernel import (paged_attention_kernel,
                                                    paged_attention_reduce_kernel)
from openmla.quant.kv_cache import cache_dims, cache_strides
from openmla.quant.mha_formats import MHA_AUTO, MHAFormat

LOG2E = 1.4426950408889634
# Queries up to this many tokens (and GQA * tokens rows up to SHORT_MAX_ROWS) form the "short"
# class: one row block per request and KV head, split-KV when the grid underfills the GPU.
SHORT_MAX_Q = 16
SHORT_MAX_ROWS = 128
# A split gets at least this many keys (a few BLOCK_N steps), and there are at most MAX_SPLITS.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# Programs per SM the split count aims for: the grid fills at most one round of WAVES programs
# per SM (decode programs run two per SM: ~255 registers x 128 threads). Rounding the split
# count up instead starts a second, mostly idle round that takes as long as a full one.
WAVES = 2


class ScoreOptions(NamedTuple):
    """Validated score options, as `paged_attention` documents them (window = (left, right)).
    Immutable, and a tuple: built on every call, it costs the host well under a microsecond."""
    scale: float
    causal: bool
    window: tuple
    softcap: float
    alibi_slopes: Optional[torch.Tensor]
    alibi_sqrt: bool
    sinks: Optional[torch.Tensor]


class _KeySource(NamedTuple):
    """Where the kernel finds request r's keys: its IS_PAGED and PAGE_SIZE constexprs with the
    arguments they give a meaning to. Built only by `paged` and `rows`, so the pair always
    agrees (immutable, and cheap to build per call like ScoreOptions)."""
    is_paged: bool
    page_size: int
    table: torch.Tensor  # bt_ptr: the block table (paged), else an int32 tensor never read
    lens: torch.Tensor  # lens_ptr: seq_lens [R] (paged), else cu_seqlens_k [R + 1]
    num_blocks: int  # blocks of the cache (paged), else 0
    kv_cap: int  # positions a request can address: table columns * page size, else rows of k
    h_kv: int
    s_k: tuple  # (block, token, head) strides of k; block stride 0 for rows
    s_v: tuple
    s_bt: int

    @staticmethod
    def paged(k_cache, v_cache, block_table, seq_lens, layout):
        num_blocks, page, h_kv, _ = cache_dims(k_cache, layout)
        return _KeySource(True, page, block_table, seq_lens, num_blocks,
                          block_table.shape[1] * page, h_kv, tuple(cache_strides(k_cache, layout)),
                          tuple(cache_strides(v_cache, layout)), block_table.stride(0))

    @staticmethod
    def rows(k, v, cu_seqlens_k, placeholder):
        return _KeySource(False, 1, placeholder, cu_seqlens_k, 0, k.shape[0], k.shape[1],
                          (0, k.stride(0), k.stride(1)), (0, v.stride(0), v.stride(1)), 0)


def _plan(T: int, R: int, H_kv: int, gqa: int, max_q: int, max_kv: int, num_sms: int,
          num_splits: Optional[int]):
    """(BLOCK_M_WANT, NUM_SPLITS) from shapes alone. BLOCK_M_WANT = 0: long queries, BLOCK_M is
    autotuned and keys are split only when forced (num_splits). max_kv bounds every seq_len
    (block table width * page size)."""
    rows = max_q * gqa
    if max_q > SHORT_MAX_Q or rows > SHORT_MAX_ROWS:
        return 0, num_splits or 1
    block_m = max(16, triton.next_power_of_2(rows))
    if num_splits is not None:
        return block_m, num_splits
    programs = R * H_kv  # one row block per request and KV head
    want = WAVES * num_sms // max(programs, 1)
    return block_m, max(1, min(want, MAX_SPLITS, triton.cdiv(max_kv, MIN_KEYS_PER_SPLIT)))


def launch_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, lse,
                 opts: ScoreOptions, *, layout: str, max_q: int, max_kv: int,
                 num_splits: Optional[int], k_scale: Optional[torch.Tensor],
                 v_scale: Optional[torch.Tensor], k_scale_cache: Optional[torch.Tensor],
                 k_smooth: Optional[torch.Tensor], fmt: MHAFormat):
    """Run `paged_attention` on validated inputs: writes out (and lse when given).
    fmt: the caches' format (the kernel's IS_FP8, K_INT8, V_INT8 come from it). k_scale /
    v_scale: [1] fp32 for fp8 per tensor; for int8 K (int8_qk / int8_qkv) k_scale is None,
    k_scale_cache holds the per-token K scales and v_scale is None (int8_qk) or the per-channel
    [H_kv, D] scale of an int8 V; None for bf16 / fp16 caches."""
    keys = _KeySource.paged(k_cache, v_cache, block_table, seq_lens, layout)
    _launch(q, k_cache, v_cache, keys, cu_seqlens_q, out, lse, opts, max_q, max_kv, num_splits,
            k_scale, v_scale, k_scale_cache, k_smooth, fmt)


def launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, opts: ScoreOptions, *,
                  max_q: int, max_kv: int):
    """Run `varlen_attention` on validated inputs: writes out (and lse when given)."""
    keys = _KeySource.rows(k, v, cu_seqlens_k, placeholder=cu_seqlens_q)
    # contiguous keys are q's dtype: the model-dtype format
    _launch(q, k, v, keys, cu_seqlens_q, out, lse, opts, max_q, max_kv, None, None, None, None,
            None, MHA_AUTO)


def _launch(q, k, v, keys: _KeySource, cu_seqlens_q, out, lse, opts: ScoreOptions, max_q,
            max_kv, num_splits, k_scale, v_scale, k_scale_cache, k_smooth, fmt: MHAFormat):
    T, H, D = q.shape
    R = cu_seqlens_q.shape[0] - 1
    H_kv = keys.h_kv
    s_kb, s_kt, s_kh = keys.s_k
    s_vb, s_vt, s_vh = keys.s_v
    gqa = H // H_kv
    block_m_want, splits = _plan(T, R, H_kv, gqa, max_q, max_kv, num_sms(q.device), num_splits)
    is_fp8, k_int8, v_int8 = fmt.fp8_per_tensor, fmt.k_int8, fmt.v_int8
    arch = arch_of(q.device)
    if is_fp8 and not arch.fp8_type:
        # no float8e4nv type on this GPU: the kernel converts the bytes (quant/e4m3.py)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    dummy = cu_seqlens_q  # pointer arguments the kernel never reads under its flags
    ksc = k_scale_cache if k_int8 else dummy
    s_ksc = tuple(k_scale_cache.stride()) if k_int8 else (0, 0, 0)
    s_vs = tuple(v_scale.stride()) if v_int8 else (0, 0)
    ksm = k_smooth if k_smooth is not None else dummy
    s_ksm = tuple(k_smooth.stride()) if k_smooth is not None else (0, 0)
    if splits > 1:
        part_out = torch.empty((splits, T, H, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, T, H), dtype=torch.float32, device=q.device)
        o_args = (part_out, part_lse, *part_out.stride()[:3], *part_lse.stride())
        write_lse = True
    else:
        lse_arg = lse if lse is not None else dummy
        o_args = (out, lse_arg, 0, out.stride(0), out.stride(1), 0,
                  lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0)
        write_lse = lse is not None
    scale, softcap = opts.scale, opts.softcap
    alibi_slopes, sinks = opts.alibi_slopes, opts.sinks
    left, right = opts.window
    grid = lambda meta: (triton.cdiv(T * gqa, meta["BLOCK_M"]) + R + 1, H_kv, splits)  # noqa: E731
    paged_attention_kernel[grid](
        q, k, v, keys.table, cu_seqlens_q, keys.lens,
        alibi_slopes if alibi_slopes is not None else dummy,
        sinks if sinks is not None else dummy,
        k_scale if is_fp8 else dummy, v_scale if (is_fp8 or v_int8) else dummy, ksc, ksm,
        o_args[0], o_args[1],
        T, R, keys.num_blocks, keys.kv_cap,
        abs(scale) * LOG2E, softcap * LOG2E, left, right,
        q.stride(0), q.stride(1), s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, keys.s_bt,
        *o_args[2:], *s_ksc, *s_vs, *s_ksm,
        # int8 dots take K in steps of 32 (mma k32).
        BLOCK_M_WANT=block_m_want, GQA=gqa, HEAD_DIM=D,
        BLOCK_D=max(32 if k_int8 else 16, triton.next_power_of_2(D)),
        PAGE_SIZE=keys.page_size, IS_PAGED=keys.is_paged, IS_FP8=is_fp8,
        CAUSAL=opts.causal, HAS_WINDOW=left >= 0 or right >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None, ALIBI_SQRT=opts.alibi_sqrt,
        HAS_SINKS=sinks is not None,
        NUM_SPLITS=splits, WRITE_LSE=write_lse, NEG_Q=scale < 0,
        KV_SAME=(s_kb, s_kt) == (s_vb, s_vt), K_INT8=k_int8, V_INT8=v_int8,
        V_FAST_CVT=v_int8 and arch.ptx, K_SMOOTH=k_smooth is not None,
    )
    if splits > 1:
        block_d = triton.next_power_of_2(D)
        block_h = min(triton.next_power_of_2(H), max(1, 2048 // block_d))
        lse_arg = lse if lse is not None else dummy
        paged_attention_reduce_kernel[(T, triton.cdiv(H, block_h))](
            part_out, part_lse, out, lse_arg,
            H, *part_out.stride()[:3], part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
            HEAD_DIM=D, NUM_SPLITS=splits, WRITE_LSE=lse is not None,
            BLOCK_H=block_h, BLOCK_D=block_d,
        )
