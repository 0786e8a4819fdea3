"""Sparse MLA decode over a paged latent cache (fp8_ds_mla, bf16 or MODEL1), any H 1..128, any
topk, optionally joined by an extra cache: the public op, its dispatch and plans.

The portable Triton kernel (kernels/sparse_mla_decode/triton_kernel.py) serves fp8_ds_mla and bf16
caches on every GPU. On Hopper, fp8 caches go to Gluon kernels with the same contract: more than 32
heads to kernels/sparse_mla_decode/sm90.py (64-head wgmma tiles, score tile split over the
warpgroups, row bytes gathered a step ahead; not where tokens x 64-head blocks <= sm90.FEW_BLOCKS, a
batch of one or two, which the Triton kernel's 32-head blocks serve faster), up to 32 heads to
kernels/sparse_mla_decode/sm90_kn.py (keys on the wgmma M, K and V^T register operands built from
the bytes, a producer warpgroup gathering); bf16 caches, their rows copied to shared memory by
cp.async as they are, up to 32 heads to kernels/sparse_mla_decode/sm90_bf16_kn.py (keys on the
wgmma M, every operand from shared memory), more to kernels/sparse_mla_decode/sm90_bf16.py
(64-head blocks); the Triton kernel serves everything else. MODEL1 (DeepSeek-V4) caches go to
kernels/sparse_mla_decode/model1_kernel.py on every GPU, with or without the extra cache (its
programs walk the main list, then the extra one, in one softmax), and on Hopper at every head count
to its Gluon counterpart kernels/sparse_mla_decode/sm90_model1.py (64-head blocks, bf16 K
dequantized once a block: its producer's gathers bound it, so padded heads cost little; 1.2-2x
faster than the Triton kernel at 16-48 heads, docs/benchmarks.md); an extra cache beside the other
formats runs the Triton kernel once per list into one set of partials.

When T x head blocks cannot fill the GPU, topk is split across programs and a second kernel
merges the partial (out, lse) pairs (kernels.merge.merge_step) and applies the sink. The split
count comes from shapes and the SM count alone (kernels/sparse_mla_decode/config.py), so the op
never reads a device tensor on the host and can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from openmla.kernels.sparse_mla_decode import sm90 as _sm90
from openmla.kernels.sparse_mla_decode import sm90_bf16 as _bf
from openmla.kernels.sparse_mla_decode import sm90_bf16_kn as _bk
from openmla.kernels.sparse_mla_decode import sm90_kn as _kn
from openmla.kernels.sparse_mla_decode import sm90_model1 as _m1
from openmla.kernels.sparse_mla_decode.config import (_M1_SPACE, _head_blocks, _pick_config, _splits,
                                                      _triton_config)
from openmla.kernels.sparse_mla_decode.model1_kernel import sparse_mla_decode_model1_kernel
from openmla.kernels.sparse_mla_decode.triton_kernel import (sparse_mla_decode_kernel,
                                                             sparse_mla_decode_merge_kernel)
from openmla.kernels import scratch as _scratch
from openmla.kernels.device import arch_of, num_sms
from openmla.kernels.launch import BoundLaunch, FastLaunch
from openmla.kernels.merge import parts_tile
from openmla.quant.validate import (CheckedCalls, check_out, check_same_device, check_scale,
                                    check_tensor, fail, tensor_signature)
from openmla.quant.format_types import SPARSE_MLA
from openmla.quant.formats import cache_format
from openmla.quant.mla_cache_format import check_mla_format

LOG2E = 1.4426950408889634  # host: softmax scale -> log2-domain scale
_TILES = 4  # the kernels hold the 512-wide latent as four 128-wide tiles (fp8_ds_mla's scale tiles)
MAX_HEADS = 128

# What a launch needs beyond its tensors, per call signature: the kernel, grid, split count and
# constexprs depend only on shapes, strides, the format, the device and the optional inputs, so
# they are chosen once and reused (a decode step repeats the same call every layer).
_PLANS: dict = {}
_MAX_PLANS = 4096
_TRITON = FastLaunch(sparse_mla_decode_kernel)
_MERGE = FastLaunch(sparse_mla_decode_merge_kernel)
_SM90 = FastLaunch(_sm90.sparse_mla_decode_sm90_kernel) if _sm90._GLUON else None
_KN = FastLaunch(_kn.sparse_mla_decode_sm90_kn_kernel) if _kn._GLUON else None
_BF = FastLaunch(_bf.sparse_mla_decode_sm90_bf16_kernel) if _bf._GLUON else None
_BK = FastLaunch(_bk.sparse_mla_decode_sm90_bf16_kn_kernel) if _bk._GLUON else None


def _new_plan(key, make, *args):
    """make(*args), kept in the plan cache under key."""
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = _PLANS[key] = make(*args)
    return plan


def _partials(lse, num_splits, fmt, always=False):
    """Per-split partial out [T, S, H, d_v] and lse [T, S, H] (fp32) for the merge; lse itself as
    a placeholder (never written) when one split writes the output directly."""
    if num_splits == 1 and not always:
        return lse, lse
    T, H = lse.shape
    return (torch.empty((T, num_splits, H, fmt.latent_dim), dtype=torch.float32, device=lse.device),
            torch.empty((T, num_splits, H), dtype=torch.float32, device=lse.device))


def _plan_launch(q, cache, indices, topk_length, attn_sink, fmt, config, num_splits, inf_empty=False):
    """(kernel launcher, grid, the int arguments before q's strides, the cache's row strides,
    constexprs, splits, the merge's grid and constexprs, a number no other plan has).
    inf_empty: a row without a valid index gets lse = +inf (FlashMLA's marker) instead of -inf."""
    T, H, _ = q.shape
    topk = indices.shape[1]
    is_fp8 = fmt.quantized
    # Hopper, fp8 cache, more than 32 heads: the Gluon kernel (64-head wgmma tiles), unless the
    # tokens give it at most _sm90.FEW_BLOCKS head blocks; a pinned config (tests, sweeps) always
    # means the Triton kernel
    few = T * triton.cdiv(H, _sm90.BLOCK_H) <= _sm90.FEW_BLOCKS
    sm90 = is_fp8 and H > 32 and not config and not few and _sm90.usable(q, cache)
    kn = is_fp8 and H <= _kn.MAX_HEADS and not config and _kn.usable(q, cache)
    # Hopper, bf16 cache: the Gluon kernels of bf16 rows (cp.async), keys on M up to 32 heads,
    # 64-head blocks from 33
    bk = not is_fp8 and H <= _bk.MAX_HEADS and not config and _bk.usable(q, cache)
    bf = not is_fp8 and H >= _bf.MIN_HEADS and not config and _bf.usable(q, cache)
    if sm90:
        cfg = dict(BLOCK_H=_sm90.BLOCK_H, BLOCK_N=_sm90.BLOCK_N, occupancy=_sm90.OCCUPANCY,
                   one_round=True)
    elif bf:
        cfg = dict(BLOCK_H=_bf.BLOCK_H, BLOCK_N=_bf.BLOCK_N, occupancy=_bf.OCCUPANCY, one_round=True)
    elif bk:
        cfg = dict(BLOCK_H=_bk.block_h(H), BLOCK_N=_bk.BLOCK_N, occupancy=_bk.OCCUPANCY, one_round=True)
    elif kn:
        cfg = dict(BLOCK_H=_kn.block_h(H), BLOCK_N=_kn.BLOCK_N, occupancy=_kn.OCCUPANCY,
                   one_round=True)
    else:
        cfg = _triton_config(q, H, config)
    # (the bf16 Gluon kernel's 64-head layouts never shrink to a smaller H)
    block_h, num_hb = (cfg["BLOCK_H"], triton.cdiv(H, cfg["BLOCK_H"])) if bf else _head_blocks(cfg, H)
    block_n = cfg["BLOCK_N"]
    chunk, num_splits = _splits(T, num_hb, topk, cfg, num_splits, num_sms(q.device))
    split = num_splits > 1

    num_blocks, block_size, _ = cache.shape
    stride_cb, stride_cr = cache.stride(0), cache.stride(1)
    dense = block_size == 1 or stride_cb == block_size * stride_cr
    if block_size == 1:
        stride_cr = stride_cb
    ints = (H, topk, chunk, num_hb, num_splits, num_blocks * block_size, block_size)
    consts = dict(DENSE=dense, HAS_LEN=topk_length is not None, HAS_SINK=attn_sink is not None,
                  SPLIT=split, BLOCK_H=block_h, BLOCK_N=block_n, TILE=fmt.latent_dim // _TILES,
                  ROPE=fmt.rope_dim, SCALE_OFF=fmt.scale_offset if is_fp8 else 0,
                  ROPE_OFF=fmt.rope_offset, INF_EMPTY=inf_empty and not split)  # (split: the merge)
    grid = (T * num_hb, num_splits)
    merge = _merge_plan(T, H, num_splits, attn_sink is not None, fmt, num_sms(q.device), inf_empty)
    pid = next(_scratch.PLAN_IDS)
    if sm90:
        return (_SM90, grid, ints, (stride_cb, stride_cr),
                dict(consts, BS_SHIFT=_kn.bs_shift(block_size), num_warps=_sm90.NUM_WARPS), num_splits,
                merge, pid)
    if bf:
        return (_BF, grid, ints, (stride_cb, stride_cr),
                dict(consts, BS_SHIFT=_kn.bs_shift(block_size), num_warps=_bf.NUM_WARPS), num_splits,
                merge, pid)
    if bk:
        return (_BK, grid, ints, (stride_cb, stride_cr),
                dict(consts, BS_SHIFT=_kn.bs_shift(block_size), num_warps=_bk.NUM_WARPS), num_splits,
                merge, pid)
    if kn:
        return (_KN, grid, ints, (stride_cb, stride_cr),
                dict(consts, BS_SHIFT=_kn.bs_shift(block_size), num_warps=_kn.NUM_WARPS), num_splits,
                merge, pid)
    consts.update(FP8=is_fp8, E4M3=arch_of(q.device).e4m3, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        consts["maxnreg"] = cfg["maxnreg"]
    return _TRITON, grid, ints, (stride_cb, stride_cr), consts, num_splits, merge, pid


def _plan_key(q, cache, indices, topk_length, attn_sink, fmt, config, num_splits, inf_empty=False):
    """What a launch plan depends on: shapes, cache strides and alignment, the format, the
    optional inputs, a pinned config or split count, the empty row's lse, and the device's path
    and e4m3 mode (which follow the device, or an assumed one: kernels.device.assume)."""
    num_blocks, block_size, _ = cache.shape
    arch = arch_of(q.device)
    return (q.device, q.shape[0], q.shape[1], indices.shape[1], fmt, cache.dtype, num_blocks,
            block_size, cache.stride(0), cache.stride(1), cache.data_ptr() & 15 == 0,
            topk_length is None, attn_sink is None,
            tuple(sorted(config.items())) if config else None, num_splits, inf_empty, arch.gluon_sm90,
            arch)


def _get_plan(q, cache, indices, topk_length, attn_sink, fmt, config=None, num_splits=None,
              inf_empty=False):
    """The launch plan of these inputs, from the cache or made and kept there."""
    key = _plan_key(q, cache, indices, topk_length, attn_sink, fmt, config, num_splits, inf_empty)
    return _PLANS.get(key) or _new_plan(key, _plan_launch, q, cache, indices, topk_length,
                                        attn_sink, fmt, config, num_splits, inf_empty)


def flashmla_plan(q, cache, indices, topk_length, attn_sink, fmt):
    """The launch plan of a call that passed sparse_mla_decode's checks (a fp8_ds_mla or bf16
    cache, no extra cache, T >= 1) whose rows without a valid index get lse = +inf, FlashMLA's
    marker: mla.flashmla_compat runs it with `run_plan` on later calls of the same signature."""
    return _get_plan(q, cache, indices, topk_length, attn_sink, fmt, inf_empty=True)


def _launch(q, cache, indices, topk_length, attn_sink, out, scale, fmt, *, config=None, num_splits=None):
    """Launch on validated inputs; writes out, returns lse [T, H] fp32. fmt: the cache's
    sparse MLA format descriptor (the constexprs below come from it)."""
    if q.shape[0] == 0:
        return torch.empty((0, q.shape[1]), dtype=torch.float32, device=q.device)
    plan = _get_plan(q, cache, indices, topk_length, attn_sink, fmt, config, num_splits)
    return run_plan(plan, q, cache, indices, topk_length, attn_sink, out, scale, fmt)


def layer_plan(q, cache, indices, fmt):
    """The launch plan of a call that passed sparse_mla_decode's checks, without topk_length or a
    sink (a fp8_ds_mla or bf16 cache, T >= 1), and the scratch its `run_plan` needs: (plan, lse
    shape, partials' shapes or None for one split). mla.sparse.impl keeps it per step and cache
    signature and passes the step's buffers as `scratch`, so a layer allocates nothing."""
    plan = _get_plan(q, cache, indices, None, None, fmt)
    T, H = q.shape[0], q.shape[1]
    splits = plan[5]
    parts = ((T, splits, H, fmt.latent_dim), (T, splits, H)) if splits > 1 else None
    return plan, (T, H), parts


def run_plan(plan, q, cache, indices, topk_length, attn_sink, out, scale, fmt, layout=None,
             scratch=None, merge=True):
    """One launch of `plan` (and its merge) on validated inputs with T >= 1; returns lse [T, H].
    The plan's number with q's, indices' and out's strides keys the launch when every pointer is
    16-byte aligned.
    layout: None for q [T, H, d], indices [T, topk], out [T, H, 512]; else (T, H, q's token and
    head strides, indices' token stride, out's token and head strides, lse's shape) of tensors
    whose memory is laid out so (mla.flashmla_compat passes its 4-D tensors: with b and s_q
    flattened by one stride, token t = i * s_q + j is one stride from t - 1). The cache is read
    through the plan's strides, so any view of its memory serves.
    scratch: None, or (lse, partial out, partial lse) fp32 tensors of the shapes `layer_plan`
    gives (the partials None for one split), written instead of new allocations. Without it the
    partials are this stream's reusable scratch (kernels/scratch.py) and lse a new tensor.
    merge=False leaves a split plan's partials in `scratch` unmerged (out and lse not written; the
    caller merges them: kernels.merge_project)."""
    kernel, grid, ints, cache_strides, consts, num_splits, mplan, pid = plan
    if layout is None:
        T, H = q.shape[0], q.shape[1]
        sq, si, so = q.stride(), indices.stride(0), out.stride()
        layout = (T, H, sq[0], sq[1], si, so[0], so[1], (T, H))
    T, H, sq0, sq1, si, so0, so1, lse_shape = layout
    if scratch is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        if num_splits > 1:  # the plan fixes T, H and the splits: its number keys the views
            po, plse = _scratch.partials(pid, q.device, ((T, num_splits, H, fmt.latent_dim),
                                                         (T, num_splits, H)))
        else:
            po = plse = lse
    else:
        lse, po, plse = scratch
        if po is None:
            po = plse = lse
    sink = attn_sink if attn_sink is not None else lse
    length = topk_length if topk_length is not None else lse
    args = (q, cache, indices, length, sink, out, lse, po, plse, *ints, sq0, sq1,
            *cache_strides, si, so0, so1, float(scale) * LOG2E)
    # the plan's key and the strides below fix every int argument and dtype; with every pointer
    # 16-byte aligned it keys the launch too (lse is a fresh allocation, which the caching
    # allocator aligns; the scratch views start on 128 bytes)
    aligned = (q.data_ptr() | cache.data_ptr() | indices.data_ptr() | out.data_ptr()
               | length.data_ptr() | sink.data_ptr()) & 15 == 0
    # (the plan's number stands for its key: cheaper to hash, and never reused)
    lkey = (pid, sq0, sq1, si, so0, so1) if aligned else None
    if aligned:
        kernel.keyed(lkey, grid, *args, **consts)
    else:
        kernel(grid, *args, **consts)
    if num_splits > 1 and merge:
        _merge(po, plse, attn_sink, out, lse, fmt, lkey, mplan, (so0, so1))
    return lse


def bind_call(plan, fmt, layout):
    """run_plan(plan, q, cache, indices, topk_length, attn_sink, out, scale, fmt, layout) for the
    repeated calls of one checked call signature, whose tensors' shapes and strides (so the
    launch key and every int argument) are those of `layout` (run_plan's layout argument): returns
    `run(q, cache, indices, topk_length, attn_sink, out, scale) -> lse`, which launches the same
    kernels through launchers bound once (kernels.launch.BoundLaunch) with the arguments that do
    not change built once; a call with a pointer off 16 bytes takes run_plan's unkeyed path."""
    kernel, grid, ints, cache_strides, consts, num_splits, mplan, pid = plan
    T, H, sq0, sq1, si, so0, so1, lse_shape = layout
    key = (pid, sq0, sq1, si, so0, so1)
    decode = BoundLaunch(kernel, key, grid, **consts)
    merged = BoundLaunch(_MERGE, key, mplan[0], **mplan[1]) if num_splits > 1 else None
    parts = ((T, num_splits, H, fmt.latent_dim), (T, num_splits, H))
    tail = (*ints, sq0, sq1, *cache_strides, si, so0, so1)

    def run(q, cache, indices, topk_length, attn_sink, out, scale):
        ptrs = q.data_ptr() | cache.data_ptr() | indices.data_ptr() | out.data_ptr()
        if topk_length is not None:
            ptrs |= topk_length.data_ptr()
        if attn_sink is not None:
            ptrs |= attn_sink.data_ptr()
        if ptrs & 15:
            return run_plan(plan, q, cache, indices, topk_length, attn_sink, out, scale, fmt, layout)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        po, plse = _scratch.partials(pid, q.device, parts) if merged is not None else (lse, lse)
        sink = attn_sink if attn_sink is not None else lse
        decode(q, cache, indices, topk_length if topk_length is not None else lse, sink, out, lse,
               po, plse, *tail, float(scale) * LOG2E)
        if merged is not None:
            merged(po, plse, sink, out, lse, H, num_splits, so0, so1)
        return lse
    return run


def bind_layer(plan, q, indices, out, scratch, fmt, merge=True):
    """run_plan(plan, q, cache, indices, None, None, out, scale, fmt, scratch=scratch,
    merge=merge) with everything but the cache and the scale fixed: returns `run(cache, scale) ->
    lse`, which makes the same launches with an argument list built once. For a decode step's
    layers (mla.sparse.impl), whose q, slots, latent output and scratch are the step's buffers
    and whose caches share the layout `plan` was made for (the plan fixes the cache's strides; the
    caller guarantees them)."""
    kernel, grid, ints, cache_strides, consts, num_splits, mplan, pid = plan
    merge = merge and num_splits > 1
    H = q.shape[1]
    sq, si, so = q.stride(), indices.stride(0), out.stride()
    lse, po, plse = scratch
    if po is None:
        po = plse = lse

    def unbound(cache, scale):
        return run_plan(plan, q, cache, indices, None, None, out, scale, fmt, scratch=scratch,
                        merge=merge)
    if (q.data_ptr() | indices.data_ptr() | out.data_ptr() | lse.data_ptr()) & 15:
        return unbound  # run_plan's own (unkeyed) launches
    # (lse stands in for the absent lengths and sink, as in run_plan)
    mid = (indices, lse, lse, out, lse, po, plse, *ints, sq[0], sq[1], *cache_strides, si, so[0], so[1])
    lkey = (pid, sq[0], sq[1], si, so[0], so[1])
    decode = BoundLaunch(kernel, lkey, grid, **consts)
    if merge:
        mgrid, mconsts = mplan
        margs = (po, plse, lse, out, lse, H, num_splits, so[0], so[1])
        merged = BoundLaunch(_MERGE, lkey, mgrid, **mconsts)
    # the same arguments with the step's buffers as their addresses, for the compiled launchers
    # (BoundLaunch.try_launch; this closure holds the tensors)
    q_ptr, mid_ptrs = q.data_ptr(), _ptrs(mid)
    margs_ptrs = _ptrs(margs) if merge else None

    def run(cache, scale):
        if cache.data_ptr() & 15:
            return unbound(cache, scale)
        s = float(scale) * LOG2E
        if not decode.try_launch(q_ptr, cache, *mid_ptrs, s):
            decode(q, cache, *mid, s)
        if merge and not merged.try_launch(*margs_ptrs):
            merged(*margs)
        return lse
    return run


def _ptrs(args) -> tuple:
    """args with each tensor replaced by its address (BoundLaunch.try_launch's int pointers)."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def _merge_plan(T, H, num_splits, has_sink, fmt, sms, inf_empty=False):
    """The merge kernel's grid and constexprs."""
    block_s, block_h, _ = parts_tile(T, H, fmt.latent_dim, num_splits, sms)
    return (T, triton.cdiv(H, block_h)), dict(HAS_SINK=has_sink, BLOCK_S=block_s, BLOCK_H=block_h,
                                              DV=fmt.latent_dim, INF_EMPTY=inf_empty, num_warps=4)


def _merge(po, plse, attn_sink, out, lse, fmt, key, plan=None, out_strides=None):
    """Merge the partials po [T, S, H, D] / plse [T, S, H] into out and lse; the sink applies here,
    once. key: a FastLaunch key fixing every argument but the pointers (None: Triton's launch).
    plan: _merge_plan's result for these shapes, when the caller has it. out_strides: out's token
    and head strides when out is not [T, H, D] (run_plan's layout)."""
    T, num_splits, H = plse.shape
    mgrid, mconsts = plan or _merge_plan(T, H, num_splits, attn_sink is not None, fmt,
                                         num_sms(po.device))
    sink = attn_sink if attn_sink is not None else lse
    so = out_strides or (out.stride(0), out.stride(1))
    margs = (po, plse, sink, out, lse, H, num_splits, so[0], so[1])
    if key is not None:
        _MERGE.keyed(key, mgrid, *margs, **mconsts)
    else:
        _MERGE(mgrid, *margs, **mconsts)


_M1 = FastLaunch(sparse_mla_decode_model1_kernel)
_M1_SM90 = FastLaunch(_m1.sparse_mla_decode_sm90_model1_kernel) if _m1._GLUON else None


def _plan_model1(q, cache, indices, extra_cache, extra_indices, fmt, config, num_splits):
    """(launcher, grid, ints, constexprs, splits) of a MODEL1 kernel: the Gluon kernel
    (sm90_model1.py) on Hopper, else the Triton kernel
    (model1_kernel.py); a pinned config (tests, sweeps) always means the Triton kernel. Both take the
    same arguments; a program walks one split of the joined list: the main indices, then from
    XSTART (topk rounded up to BLOCK_N) the extra ones; the splits are sized over that length as
    for the fp8_ds_mla kernels (config.py)."""
    T, H, _ = q.shape
    topk = indices.shape[1]
    gluon = not config and _m1.usable(q, cache, extra_cache)
    if gluon:
        cfg = dict(BLOCK_H=_m1.BLOCK_H, BLOCK_N=_m1.BLOCK_N, occupancy=_m1.OCCUPANCY, one_round=True)
    else:
        cfg = _triton_config(q, H, config, _M1_SPACE)
    # the Gluon kernel's layouts are for 64 rows: its blocks never shrink to a smaller H
    block_h, num_hb = (_m1.BLOCK_H, triton.cdiv(H, _m1.BLOCK_H)) if gluon else _head_blocks(cfg, H)
    block_n = cfg["BLOCK_N"]
    xtopk = extra_indices.shape[1] if extra_cache is not None else 0
    xstart = triton.cdiv(topk, block_n) * block_n
    joined = xstart + xtopk if xtopk else topk
    chunk, num_splits = _splits(T, num_hb, joined, cfg, num_splits, num_sms(q.device))
    nb, bs = cache.shape[:2]
    xnb, xbs = extra_cache.shape[:2] if xtopk else (1, 1)
    ints = (H, topk, xtopk, xstart, chunk, num_hb, num_splits, nb * bs, bs, xnb * xbs, xbs)
    consts = dict(E4M3=arch_of(q.device).e4m3, HAS_EXTRA=xtopk > 0, SPLIT=num_splits > 1,
                  BLOCK_H=block_h, BLOCK_N=block_n, TILE=fmt.tile_size, NT=fmt.num_tiles,
                  ROPE=fmt.rope_dim, REC=fmt.record_bytes, ROPE_OFF=fmt.rope_offset,
                  SCALE_BYTES=fmt.scale_stride)
    if gluon:
        consts.update(num_warps=_m1.NUM_WARPS, STAGE_OUT=_m1.stage_out(H, num_splits), ROLL=_m1.roll(H))
        return _M1_SM90, (T * num_hb, num_splits), ints, consts, num_splits
    consts.update(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        consts["maxnreg"] = cfg["maxnreg"]
    return _M1, (T * num_hb, num_splits), ints, consts, num_splits


def _launch_model1(q, cache, indices, topk_length, attn_sink, out, scale, fmt, extra_cache=None,
                   extra_indices=None, extra_topk_length=None, *, config=None, num_splits=None):
    """Launch over validated MODEL1 inputs (an optional extra cache); writes out, returns lse."""
    T, H, _ = q.shape
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return lse
    extra = extra_cache is not None
    # a block's stride matters only when there is more than one block
    stride_cb = cache.stride(0) if cache.shape[0] > 1 else 0
    stride_xb = extra_cache.stride(0) if extra and extra_cache.shape[0] > 1 else 0
    key = ("model1", q.device, T, H, indices.shape[1], fmt, tuple(cache.shape[:2]), stride_cb,
           tuple(extra_cache.shape[:2]) if extra else None, extra_indices.shape[1] if extra else 0,
           stride_xb, tuple(sorted(config.items())) if config else None, num_splits,
           arch_of(q.device), cache.data_ptr() & 15 == 0,
           extra_cache.data_ptr() & 15 == 0 if extra else None)
    plan = _PLANS.get(key) or _new_plan(key, _plan_model1, q, cache, indices, extra_cache,
                                        extra_indices, fmt, config, num_splits)
    launcher, grid, ints, consts, num_splits = plan
    po, plse = _partials(lse, num_splits, fmt)
    sink = attn_sink if attn_sink is not None else lse
    length = topk_length if topk_length is not None else lse
    xlength = extra_topk_length if extra_topk_length is not None else lse
    xcache = extra_cache if extra else cache
    xidx = extra_indices if extra else indices
    consts = dict(consts, HAS_LEN=topk_length is not None, HAS_XLEN=extra_topk_length is not None,
                  HAS_SINK=attn_sink is not None)
    args = (q, cache, indices, length, xcache, xidx, xlength, sink, out, lse, po, plse, *ints,
            q.stride(0), q.stride(1), stride_cb, stride_xb, indices.stride(0), xidx.stride(0),
            out.stride(0), out.stride(1), float(scale) * LOG2E)
    # the plan's key, the optional inputs and the strides below fix every int argument and dtype;
    # with every pointer 16-byte aligned it keys the launch too
    aligned = (q.data_ptr() | cache.data_ptr() | indices.data_ptr() | length.data_ptr()
               | xcache.data_ptr() | xidx.data_ptr() | xlength.data_ptr() | sink.data_ptr()
               | out.data_ptr() | lse.data_ptr() | po.data_ptr() | plse.data_ptr()) & 15 == 0
    if aligned:
        key = (key, topk_length is None, extra_topk_length is None, attn_sink is None, q.stride(0),
               q.stride(1), indices.stride(0), xidx.stride(0), out.stride(0), out.stride(1))
        launcher.keyed(key, grid, *args, **consts)
    else:
        launcher(grid, *args, **consts)
    if num_splits > 1:
        _merge(po, plse, attn_sink, out, lse, fmt, (key, 0) if aligned else None)
    return lse


def _launch_extra(q, cache, indices, topk_length, attn_sink, out, scale, fmt, extra_cache,
                  extra_indices, extra_topk_length):
    """fp8_ds_mla or bf16 caches with an extra cache: the Triton kernel runs over each list in
    split mode, writing its partials into one buffer at its own split offset, and the merge joins
    them and applies the sink once. (FlashMLA serves this combination on no model; it is here for
    completeness, not speed.)"""
    T, H, _ = q.shape
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return lse
    pinned = {k: v for k, v in _pick_config(q, H).items() if k in ("BLOCK_H", "BLOCK_N")}
    parts = [_plan_launch(q, c, i, n, None, fmt, pinned, None)
             for c, i, n in ((cache, indices, topk_length), (extra_cache, extra_indices, extra_topk_length))]
    total = sum(p[5] for p in parts)  # their split counts
    po, plse = _partials(lse, total, fmt, always=True)
    first = 0
    for (kernel, grid, ints, strides, consts, splits, _, _), c, i, n in zip(
            parts, (cache, extra_cache), (indices, extra_indices), (topk_length, extra_topk_length)):
        ints = ints[:4] + (total,) + ints[5:]  # NUM_SPLITS: the partials' split stride
        # the partial rows of this list start at split `first` (pointer offsets)
        args = (q, c, i, n if n is not None else lse, lse, out, lse, po.view(-1)[first * H * fmt.latent_dim:],
                plse.view(-1)[first * H:], *ints, q.stride(0), q.stride(1), *strides, i.stride(0),
                out.stride(0), out.stride(1), float(scale) * LOG2E)
        kernel(grid, *args, **dict(consts, SPLIT=True, HAS_SINK=False))
        first += splits
    _merge(po, plse, attn_sink, out, lse, fmt, None)
    return lse


def _run(q, cache, indices, topk_length, attn_sink, out, scale, fmt, extra_cache, extra_indices,
         extra_topk_length):
    """The launch for validated inputs: MODEL1 kernel, an extra cache over the other formats, or
    the fp8_ds_mla / bf16 kernels. Returns lse."""
    if getattr(fmt, "blocked", False):
        return _launch_model1(q, cache, indices, topk_length, attn_sink, out, scale, fmt,
                              extra_cache, extra_indices, extra_topk_length)
    if extra_cache is not None:
        return _launch_extra(q, cache, indices, topk_length, attn_sink, out, scale, fmt,
                             extra_cache, extra_indices, extra_topk_length)
    return _launch(q, cache, indices, topk_length, attn_sink, out, scale, fmt)


@torch.library.custom_op("openmla::sparse_mla_decode", mutates_args=("out",))
def _sparse_mla_decode_op(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor,
                          topk_length: Optional[torch.Tensor], attn_sink: Optional[torch.Tensor],
                          out: torch.Tensor, scale: float, fmt_name: str,
                          extra_cache: Optional[torch.Tensor] = None,
                          extra_indices: Optional[torch.Tensor] = None,
                          extra_topk_length: Optional[torch.Tensor] = None) -> torch.Tensor:
    # the format travels by its registry name (a custom op's arguments are tensors and scalars)
    return _run(q, cache, indices, topk_length, attn_sink, out, scale,
                cache_format(fmt_name, SPARSE_MLA), extra_cache, extra_indices, extra_topk_length)


@_sparse_mla_decode_op.register_fake
def _(q, cache, indices, topk_length, attn_sink, out, scale, fmt_name, extra_cache=None,
      extra_indices=None, extra_topk_length=None):
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


def _check_cache(name, cache, fmt):
    """A paged cache of `fmt` (already matched to its dtype and width): MODEL1 by its descriptor;
    the others [num_blocks, block_size, width] with contiguous, non-overlapping rows."""
    if getattr(fmt, "blocked", False):
        fmt.check_cache(cache, name)
    else:
        check_tensor(name, cache, ndim=3, last_dim_contiguous=True)
        width = cache.shape[2]
        if cache.stride(1) < width:
            fail(f"{name}.stride(1)", f">= {width} (rows must not overlap)", cache.stride(1))
        if cache.stride(0) < cache.shape[1] * cache.stride(1):
            fail(f"{name}.stride(0)", f">= block_size * stride(1) = {cache.shape[1] * cache.stride(1)}",
                 cache.stride(0))
    if cache.shape[0] < 1 or cache.shape[1] < 1:
        fail(f"{name}.shape", "num_blocks >= 1 and block_size >= 1", tuple(cache.shape))


def check_inputs(q, cache, indices, fmt):
    """sparse_mla_decode's checks of q, the cache (in `fmt`, or the one its dtype and width name)
    and indices; returns the format. The optional tensors, out and the devices are the caller's
    to check (mla.sparse.impl runs this on a decode step's first layer, whose own launches
    follow)."""
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3, last_dim_contiguous=True)
    T, H, d_qk = q.shape
    fmt = check_mla_format(cache, fmt)
    if getattr(fmt, "blocked", False):
        if (fmt.tile_size, fmt.rope_dim, fmt.latent_dim, fmt.scale_stride) != (64, 64, 512, 8):
            raise NotImplementedError(f"sparse_mla_decode: format {fmt} (the MODEL1 kernel reads 64-wide "
                                      "tiles, a 64-wide rope and 8 scale bytes a token)")
    elif (fmt.latent_dim, fmt.rope_dim) != (_TILES * 128, 64) or (fmt.quantized and fmt.num_tiles != _TILES):
        raise NotImplementedError(f"sparse_mla_decode: format {fmt} (the kernels read a {_TILES} x 128 "
                                  "latent in 128-wide scale tiles and a 64-wide rope)")
    if d_qk != fmt.head_dim:
        fail("q.shape[-1]", fmt.head_dim, d_qk)
    if not 1 <= H <= MAX_HEADS:
        fail("q.shape[1] (heads)", f"1..{MAX_HEADS}", H)
    _check_cache("cache", cache, fmt)
    _check_indices("indices", indices, T)
    return fmt


def _check_indices(name, indices, T):
    check_tensor(name, indices, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    if indices.shape[0] != T:
        fail(f"{name}.shape[0]", f"{T} (q.shape[0])", indices.shape[0])
    if indices.shape[1] < 1:
        fail(f"{name}.shape[1] (topk)", ">= 1", indices.shape[1])


def _signature(q, cache, indices, topk_length, attn_sink, out, fmt):
    """Everything sparse_mla_decode's checks read from its arguments (types, dtypes, shapes,
    strides, devices, which optional tensors are given, the format argument) and what its plan
    depends on beyond them (the cache's alignment, the device's path). A call whose signature
    passed the checks once passes them again and runs the same plan. Raises AttributeError or
    TypeError for arguments that are not tensors or not hashable (the full checks say what)."""
    arch = arch_of(q.device)
    sig = tensor_signature
    return (sig(q), sig(cache), cache.data_ptr() & 15 == 0, sig(indices), sig(topk_length),
            sig(attn_sink), sig(out), id(fmt), id(arch), arch.gluon_sm90)


# signature -> (format, plan, the format argument, the architecture, the plan's bound call) of the
# calls that passed the checks (fp8_ds_mla and bf16 caches without an extra cache, T >= 1): a
# repeated call goes straight to the launch
_VALIDATED = CheckedCalls()


def sparse_mla_decode(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, *, scale: float,
                      topk_length: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, fmt=None, extra_cache: Optional[torch.Tensor] = None,
                      extra_indices: Optional[torch.Tensor] = None,
                      extra_topk_length: Optional[torch.Tensor] = None):
    """Sparse MLA decode attention over a paged latent cache, optionally joined by a second one.

    Args:
        q: [T, H, D_qk] bf16, H any 1..128; last dim contiguous. D_qk = 576 (fp8_ds_mla, bf16:
            absorbed latent 512 | rope 64) or 512 (MODEL1: nope 448 | rope 64).
        cache: fp8_ds_mla [num_blocks, block_size, 656] uint8 (dequantized in the kernel),
            bf16 [num_blocks, block_size, 576], or MODEL1 (DeepSeek-V4) [num_blocks, block_size,
            1, 584] uint8 (or without the 1; quant/model1_format.py: a view over blocks of
            block_size * 584 bytes). A strided view is fine (block stride >= the block's bytes;
            rows contiguous). Slot s is token s % block_size of block s // block_size.
        indices: [T, topk] int32 global slots, topk >= 1; invalid = < 0 or >= num_blocks * block_size,
            skipped and never read. One row per query token (a batch of s_q tokens a request: T =
            batch * s_q rows).
        scale: softmax scale applied to q.k.
        topk_length: optional [T] int32; only the first topk_length[i] indices of row i count
            (values > topk act as topk, values <= 0 count none).
        attn_sink: optional [H] fp32; out *= exp(lse) / (exp(lse) + exp(attn_sink)), lse unchanged;
            applied once, to the joined result when there is an extra cache.
        out: optional [T, H, 512] bf16 to write into (last dim contiguous).
        fmt: the cache's sparse MLA format (quant.FP8_DS_MLA, FP8_DS_MLA_RAW, BF16_MLA, FP8_MODEL1,
            or a layer's descriptor), checked against both caches; default `mla_format_of(cache)`.
        extra_cache: optional second cache of the same format, its own block size and count
            (DeepSeek-V4: the compressed cache beside the sliding-window one).
        extra_indices: [T, extra_topk] int32 slots of extra_cache, required with it (invalid as for
            indices). Its tokens join the same softmax as the first list's.
        extra_topk_length: optional [T] int32, limits extra_indices as topk_length limits indices.

    Returns:
        (out [T, H, 512] bf16, lse [T, H] fp32 natural log of the softmax denominator of scale*q.k
        over both lists). A row with no valid index gives out = 0 and lse = -inf.
    """
    sig = None
    if extra_cache is None and extra_indices is None and extra_topk_length is None \
            and not torch.compiler.is_compiling():
        try:
            sig = _signature(q, cache, indices, topk_length, attn_sink, out, fmt)
            hit = _VALIDATED.get(sig)
        except (AttributeError, TypeError):
            sig = hit = None
        if hit is not None:
            fmt, run = hit[0], hit[4]
            scale = check_scale("scale", scale)
            if out is None:
                out = torch.empty((q.shape[0], q.shape[1], fmt.latent_dim), dtype=q.dtype, device=q.device)
            return out, run(q, cache, indices, topk_length, attn_sink, out, scale)
    fmt_arg = fmt
    fmt = check_inputs(q, cache, indices, fmt)
    T, H, _ = q.shape
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=(T,), contiguous=True)
    if extra_cache is None:
        if extra_indices is not None or extra_topk_length is not None:
            fail("extra_indices / extra_topk_length", "None without extra_cache", "a tensor")
    else:
        check_mla_format(extra_cache, fmt, "extra_cache")
        _check_cache("extra_cache", extra_cache, fmt)
        if extra_indices is None:
            fail("extra_indices", "[T, extra_topk] int32 with extra_cache", None)
        _check_indices("extra_indices", extra_indices, T)
        if extra_topk_length is not None:
            check_tensor("extra_topk_length", extra_topk_length, dtype=torch.int32, shape=(T,),
                         contiguous=True)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(H,), contiguous=True)
    scale = check_scale("scale", scale)
    out = check_out(out, q, fmt.latent_dim)
    check_same_device(q=q, cache=cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                      out=out, extra_cache=extra_cache, extra_indices=extra_indices,
                      extra_topk_length=extra_topk_length)
    if torch.compiler.is_compiling():
        # traced by torch.compile: the registered op, which the compiler treats as one opaque call
        lse = _sparse_mla_decode_op(q, cache, indices, topk_length, attn_sink, out, float(scale),
                                    fmt.name, extra_cache, extra_indices, extra_topk_length)
    elif sig is not None and T > 0 and not getattr(fmt, "blocked", False):
        # eager and CUDA-graph capture: straight to the launch (the custom op's dispatcher costs
        # more host time than the launch itself), and the signature remembered as checked
        plan = _get_plan(q, cache, indices, topk_length, attn_sink, fmt)
        # (the signature names the format argument and the architecture by identity: the entry
        # keeps both alive, so no other object takes their ids while it exists)
        # (a call without `out` gets a new contiguous one: the same strides on every such call)
        layout = (T, H, q.stride(0), q.stride(1), indices.stride(0), out.stride(0), out.stride(1),
                  (T, H))
        _VALIDATED.remember(sig, (fmt, plan, fmt_arg, arch_of(q.device), bind_call(plan, fmt, layout)))
        lse = run_plan(plan, q, cache, indices, topk_length, attn_sink, out, float(scale), fmt)
    else:
        lse = _run(q, cache, indices, topk_length, attn_sink, out, float(scale), fmt, extra_cache,
                   extra_indices, extra_topk_length)
    return out, lse
