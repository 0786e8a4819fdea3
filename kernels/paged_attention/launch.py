"""Host side of `paged_attention_kernel`: tile class and split count from shapes alone, then one
launch of the kernel (and of the split-KV reduction when keys are split).

Two launches with their own arguments: `launch_paged` (keys in a paged cache, in any of its
formats) and `launch_varlen` (keys in contiguous rows of k and v). Each describes where the
kernel finds request r's keys as a `_KeySource`, and `_make_plan` turns that and the shapes into
a `_Plan`: the grid, the split count, every int argument and constexpr of both launches.

A plan depends only on what its key holds (shapes, strides, dtypes, the format's flags, which
optional inputs are given, the score options' flags, max_q / max_kv / num_splits, the device and its
architecture), so it is made once per call signature and reused: a decode step repeats the same call
in every layer. Per call only the pointers and the two float scales are new (the split partials are
views of the stream's reusable scratch, kernels/scratch.py). Short queries (decode, speculative
decoding) launch through `kernels.launch.FastLaunch` (their BLOCK_M is the plan's BLOCK_M_WANT, so
their grid is known before the launch); long queries through Triton's own launch, whose grid follows
the BLOCK_M that autotuning picks.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import triton

from openmla.kernels import scratch as _scratch
from openmla.kernels.device import arch_of, num_sms
from openmla.kernels.launch import FastLaunch
from openmla.kernels.merge import parts_tile
from openmla.kernels.paged_attention.kernel import (paged_attention_kernel,
                                                    paged_attention_reduce_kernel)
from openmla.kernels.paged_attention.key_flags import GROUP, key_flags_kernel
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

_MAIN = FastLaunch(paged_attention_kernel)
_REDUCE = FastLaunch(paged_attention_reduce_kernel)
# Plans by call signature (module docstring); cleared when full (signatures that never repeat).
_PLANS: dict = {}
_MAX_PLANS = 4096
# The plan key of a call by the caller's checked call signature (paged.py's `_lookup`: each
# tensor's type, dtype, shape, strides and device) and the call's other plan inputs: a repeated
# call skips building the key (stride reads and a tuple of ~30 items, several microseconds).
_BY_SIG: dict = {}


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
    agrees. Only a new plan builds one (its tensors are not kept)."""
    is_paged: bool
    page_size: int
    num_blocks: int  # blocks of the cache (paged), else 0
    kv_cap: int  # positions a request can address: table columns * page size, else rows of k
    h_kv: int
    s_k: tuple  # (block, token, head) strides of k; block stride 0 for rows
    s_v: tuple
    s_bt: int

    @staticmethod
    def paged(k_cache, v_cache, block_table, layout):
        num_blocks, page, h_kv, _ = cache_dims(k_cache, layout)
        return _KeySource(True, page, num_blocks, block_table.shape[1] * page, h_kv,
                          tuple(cache_strides(k_cache, layout)),
                          tuple(cache_strides(v_cache, layout)), block_table.stride(0))

    @staticmethod
    def rows(k, v):
        return _KeySource(False, 1, 0, k.shape[0], k.shape[1], (0, k.stride(0), k.stride(1)),
                          (0, v.stride(0), v.stride(1)), 0)


class _Plan(NamedTuple):
    """Everything of one call signature's launches that is not a pointer or a float scale."""
    grid: Optional[tuple]  # short queries: BLOCK_M is BLOCK_M_WANT; None for long queries
    grid_fn: Callable  # the grid as a function of the launched config (any BLOCK_M)
    ints_a: tuple  # T, R, NUM_BLOCKS, MAX_KV (the kernel's ints before its float scales)
    ints_b: tuple  # window, strides (after them)
    consts: dict  # the kernel's constexprs
    splits: int
    part_numel: int  # fp32 elements of the split partials, out then lse (0: no split)
    lse_off: int  # the partial out's elements (a multiple of 4), where the lse's count starts
    is_fp8: bool
    v_int8: bool
    k_int8: bool
    as_bytes: bool  # fp8 caches reach the kernel as uint8 (no float8e4nv on this GPU)
    reduce_grid: tuple
    reduce_ints: tuple  # the reduction's ints after its four pointers
    reduce_consts: dict
    flags: Optional[tuple]  # key_flags.py's pass: (bytes, grid, ints, constexprs), or None
    pid: int  # a number no plan of any op shares (scratch.PLAN_IDS): keys its launches and scratch


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


def _stride(t: Optional[torch.Tensor]):
    return None if t is None else t.stride()


def launch_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, lse,
                 opts: ScoreOptions, *, layout: str, max_q: int, max_kv: int,
                 num_splits: Optional[int], k_scale: Optional[torch.Tensor],
                 v_scale: Optional[torch.Tensor], k_scale_cache: Optional[torch.Tensor],
                 k_smooth: Optional[torch.Tensor], fmt: MHAFormat, sig=None):
    """Run `paged_attention` on validated inputs: writes out (and lse when given).
    fmt: the caches' format (the kernel's IS_FP8, K_INT8, V_INT8 come from it). k_scale /
    v_scale: [1] fp32 for fp8 per tensor; for int8 K (int8_qk / int8_qkv) k_scale is None,
    k_scale_cache holds the per-token K scales and v_scale is None (int8_qk) or the per-channel
    [H_kv, D] scale of an int8 V; None for bf16 / fp16 caches.
    sig: the tensor signature of the call's arguments (paged.py's `_lookup`), or None. With it,
    out must be the caller's out (in sig) or, where that was None, a fresh contiguous
    [T, H, D]; lse a fresh contiguous [T, H] or None; and the fp8 scales the caller's or fresh
    [1] tensors: then sig fixes every shape, stride and dtype the plan's key reads."""
    device = q.device
    arch = arch_of(device)
    skey = None
    if sig is not None:
        skey = (sig, arch, layout, lse is None, opts.causal, opts.window, opts.softcap > 0,
                opts.alibi_sqrt, opts.sinks is None, opts.alibi_slopes is None, opts.scale < 0,
                max_q, max_kv, num_splits, fmt.fp8_per_tensor, fmt.k_int8, fmt.v_int8)
        key = _BY_SIG.get(skey)
        plan = _PLANS.get(key) if key is not None else None
        if plan is not None:
            _run(plan, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, lse, opts,
                 k_scale, v_scale, k_scale_cache, k_smooth)
            return
    # Everything _make_plan reads, and the dtypes and strides the launch keys need (the
    # boundary fixed the other tensors' dtypes, v_cache's shape to k_cache's and
    # cu_seqlens_q's length to the table's rows + 1).
    key = (device, arch, layout, q.dtype, q.shape, q.stride(), k_cache.dtype, v_cache.dtype,
           k_cache.shape, k_cache.stride(), v_cache.stride(), block_table.shape,
           block_table.stride(0), out.stride(), _stride(lse), opts.causal, opts.window,
           opts.softcap > 0, opts.alibi_slopes is None, opts.alibi_sqrt, opts.sinks is None,
           opts.scale < 0, max_q, max_kv, num_splits, fmt.fp8_per_tensor, fmt.k_int8, fmt.v_int8,
           _stride(k_scale_cache), _stride(v_scale), _stride(k_smooth))
    plan = _PLANS.get(key)
    if plan is None:
        keys = _KeySource.paged(k_cache, v_cache, block_table, layout)
        plan = _new_plan(key, q, keys, cu_seqlens_q, out, lse, opts, max_q, max_kv, num_splits,
                         v_scale, k_scale_cache, k_smooth, fmt, arch)
    if skey is not None:
        if len(_BY_SIG) >= _MAX_PLANS:
            _BY_SIG.clear()
        _BY_SIG[skey] = key
    _run(plan, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, lse, opts,
         k_scale, v_scale, k_scale_cache, k_smooth)


def launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, opts: ScoreOptions, *,
                  max_q: int, max_kv: int):
    """Run `varlen_attention` on validated inputs: writes out (and lse when given)."""
    device = q.device
    arch = arch_of(device)
    key = ("rows", device, arch, q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(),
           cu_seqlens_q.shape, out.stride(), _stride(lse), opts.causal, opts.window,
           opts.softcap > 0, opts.alibi_slopes is None, opts.alibi_sqrt, opts.sinks is None,
           opts.scale < 0, max_q, max_kv)
    plan = _PLANS.get(key)
    if plan is None:
        # contiguous keys are q's dtype: the model-dtype format
        plan = _new_plan(key, q, _KeySource.rows(k, v), cu_seqlens_q, out, lse, opts, max_q,
                         max_kv, None, None, None, None, MHA_AUTO, arch)
    # the block-table pointer is never read for rows: cu_seqlens_q stands in
    _run(plan, q, k, v, cu_seqlens_q, cu_seqlens_q, cu_seqlens_k, out, lse, opts, None, None,
         None, None)


def _new_plan(key, *args):
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = _PLANS[key] = _make_plan(*args)
    return plan


def _make_plan(q, keys: _KeySource, cu_seqlens_q, out, lse, opts: ScoreOptions, max_q, max_kv,
               num_splits, v_scale, k_scale_cache, k_smooth, fmt: MHAFormat, arch) -> _Plan:
    T, H, D = q.shape
    R = cu_seqlens_q.shape[0] - 1
    H_kv = keys.h_kv
    s_kb, s_kt, s_kh = keys.s_k
    s_vb, s_vt, s_vh = keys.s_v
    gqa = H // H_kv
    block_m_want, splits = _plan(T, R, H_kv, gqa, max_q, max_kv, num_sms(q.device), num_splits)
    is_fp8, k_int8, v_int8 = fmt.fp8_per_tensor, fmt.k_int8, fmt.v_int8
    s_ksc = tuple(k_scale_cache.stride()) if k_int8 else (0, 0, 0)
    s_vs = tuple(v_scale.stride()) if v_int8 else (0, 0)
    s_ksm = tuple(k_smooth.stride()) if k_smooth is not None else (0, 0)
    s_lse = tuple(lse.stride()) if lse is not None else (0, 0)
    # Long queries over a bf16 / fp16 paged cache take their interior tiles' key faults from a
    # flag pass over K (key_flags.py) instead of a check per score; the other score options
    # (softcap, alibi) and quantized K keep the per-score check everywhere.
    key_flags = (block_m_want == 0 and keys.is_paged and not (is_fp8 or k_int8)
                 and opts.softcap <= 0 and opts.alibi_slopes is None)
    flags = None
    s_kf = (0, 0)
    if key_flags:
        groups = triton.cdiv(keys.kv_cap, GROUP)
        s_kf = (H_kv * groups, groups)
        nprog = max(1, triton.cdiv(4 * num_sms(q.device), R))
        block_d = triton.next_power_of_2(D)
        # a step: 16 keys x block_hk heads x D, at most 16K elements (8 warps, no spills)
        block_hk = min(triton.next_power_of_2(H_kv), max(1, 1024 // block_d))
        flags = (R * H_kv * groups, (R, nprog),
                 (keys.num_blocks, keys.kv_cap, nprog, H_kv, s_kb, s_kt, s_kh, keys.s_bt, *s_kf),
                 dict(HEAD_DIM=D, BLOCK_D=block_d, BLOCK_HK=block_hk, PAGE_SIZE=keys.page_size,
                      GROUP_=GROUP, num_warps=8))
    part_numel = lse_off = 0
    if splits > 1:
        # fp32 partials: out [splits, T, H, D] (lse_off values), then lse [splits, T, H]
        lse_off = triton.cdiv(splits * T * H * D, 4) * 4
        part_numel = lse_off + splits * T * H
        s_o = (T * H * D, H * D, D, T * H, H, 1)
    else:
        s_o = (0, out.stride(0), out.stride(1), 0, *s_lse)
    left, right = opts.window
    ints_a = (T, R, keys.num_blocks, keys.kv_cap)
    ints_b = (left, right, q.stride(0), q.stride(1), s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
              keys.s_bt, *s_o, *s_ksc, *s_vs, *s_ksm, *s_kf)
    consts = dict(
        # int8 dots take K in steps of 32 (mma k32).
        BLOCK_M_WANT=block_m_want, GQA=gqa, HEAD_DIM=D,
        BLOCK_D=max(32 if k_int8 else 16, triton.next_power_of_2(D)),
        PAGE_SIZE=keys.page_size, IS_PAGED=keys.is_paged, IS_FP8=is_fp8,
        CAUSAL=opts.causal, HAS_WINDOW=left >= 0 or right >= 0, HAS_SOFTCAP=opts.softcap > 0,
        HAS_ALIBI=opts.alibi_slopes is not None, ALIBI_SQRT=opts.alibi_sqrt,
        HAS_SINKS=opts.sinks is not None,
        NUM_SPLITS=splits, WRITE_LSE=splits > 1 or lse is not None, NEG_Q=opts.scale < 0,
        KV_SAME=(s_kb, s_kt) == (s_vb, s_vt), K_INT8=k_int8, V_INT8=v_int8,
        V_FAST_CVT=v_int8 and arch.ptx, K_SMOOTH=k_smooth is not None, KEY_FLAGS=key_flags,
    )

    def grid_fn(meta):  # request r's row blocks start at cu_q[r] * GQA // BLOCK_M + r
        return triton.cdiv(T * gqa, meta["BLOCK_M"]) + R + 1, H_kv, splits

    # short queries: BLOCK_M is BLOCK_M_WANT (the prune rule keeps no other)
    grid = grid_fn({"BLOCK_M": block_m_want}) if block_m_want else None
    block_s, block_h, block_d = parts_tile(T, H, D, splits, num_sms(q.device))
    reduce_ints = (H, T * H * D, H * D, D, T * H, H, out.stride(0), out.stride(1), *s_lse)
    reduce_consts = dict(HEAD_DIM=D, NUM_SPLITS=splits, WRITE_LSE=lse is not None,
                         BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_D=block_d)
    return _Plan(grid, grid_fn, ints_a, ints_b, consts, splits, part_numel, lse_off, is_fp8,
                 v_int8, k_int8, is_fp8 and not arch.fp8_type, (T, triton.cdiv(H, block_h)),
                 reduce_ints, reduce_consts, flags, next(_scratch.PLAN_IDS))


def _run(plan: _Plan, q, k, v, table, cu_seqlens_q, lens, out, lse, opts: ScoreOptions,
         k_scale, v_scale, k_scale_cache, k_smooth):
    """The launches of one call: the plan's ints and constexprs with this call's pointers."""
    if plan.as_bytes:  # the kernel converts the bytes (quant/e4m3.py)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    dummy = cu_seqlens_q  # pointer arguments the kernel never reads under its flags
    alibi = opts.alibi_slopes if opts.alibi_slopes is not None else dummy
    sinks = opts.sinks if opts.sinks is not None else dummy
    ks = k_scale if plan.is_fp8 else dummy
    vs = v_scale if (plan.is_fp8 or plan.v_int8) else dummy
    ksc = k_scale_cache if plan.k_int8 else dummy
    ksm = k_smooth if k_smooth is not None else dummy
    lse_arg = lse if lse is not None else dummy
    kflags = dummy
    if plan.flags is not None:
        numel, fgrid, fints, fconsts = plan.flags
        kflags = torch.empty((numel,), dtype=torch.uint8, device=q.device)
        key_flags_kernel[fgrid](k, table, lens, kflags, *fints, **fconsts)
    split = plan.splits > 1
    if split:
        # this stream's reusable scratch (kernels/scratch.py): the partial outputs, then their lse
        o_ptr, l_ptr = _scratch.partials(plan.pid, q.device, ((plan.lse_off,),
                                                              (plan.part_numel - plan.lse_off,)))
    else:
        o_ptr, l_ptr = out, lse_arg
    args = (q, k, v, table, cu_seqlens_q, lens, alibi, sinks, ks, vs, ksc, ksm, kflags, o_ptr,
            l_ptr, *plan.ints_a, abs(opts.scale) * LOG2E, opts.softcap * LOG2E, *plan.ints_b)
    # The plan's key fixes every int argument, constexpr and tensor dtype of both launches; with
    # every pointer 16-byte aligned (as the caching allocator gives them) the plan's number
    # keys the launches. Otherwise FastLaunch keys on the arguments themselves.
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | table.data_ptr() | dummy.data_ptr()
               | lens.data_ptr() | alibi.data_ptr() | sinks.data_ptr() | ks.data_ptr()
               | vs.data_ptr() | ksc.data_ptr() | ksm.data_ptr() | out.data_ptr()
               | lse_arg.data_ptr() | o_ptr.data_ptr() | l_ptr.data_ptr()
               | kflags.data_ptr()) & 15 == 0
    if plan.grid is None or len(paged_attention_kernel.configs) == 1:
        # Triton's launch, the grid from the config it picks: long queries (BLOCK_M autotuned),
        # or a config list of one (tests pin one), which Triton's autotuner launches without the
        # prune rule, so its BLOCK_M may differ from BLOCK_M_WANT
        paged_attention_kernel[plan.grid_fn](*args, **plan.consts)
    elif aligned:
        _MAIN.keyed(plan.pid, plan.grid, *args, **plan.consts)
    else:
        _MAIN(plan.grid, *args, **plan.consts)
    if split:
        rargs = (o_ptr, l_ptr, out, lse_arg, *plan.reduce_ints)
        if aligned:
            _REDUCE.keyed(plan.pid, plan.reduce_grid, *rargs, **plan.reduce_consts)
        else:
            _REDUCE(plan.reduce_grid, *rargs, **plan.reduce_consts)
