"""Sparse MLA decode over a paged latent cache (fp8_ds_mla or bf16), any H 1..128, any topk:
the public op, its dispatch, configs and topk splits.

The portable Triton kernel (kernels/sparse_mla_decode/triton_kernel.py) serves every GPU.
On Hopper, fp8 caches go to Gluon kernels with the same contract: more than 32 heads to
kernels/sparse_mla_decode/sm90.py (64-head wgmma tiles, score tile split over the warpgroups, row
bytes gathered a step ahead), up to 32 heads to kernels/sparse_mla_decode/sm90_kn.py (keys on the
wgmma M, K and V^T register operands built from the bytes, a producer warpgroup gathering); the
Triton kernel serves everything else.

When T x head blocks cannot fill the GPU, topk is split across programs and a second kernel
merges the partial (out, lse) pairs (kernels.merge.merge_step). The split count comes from
shapes and the SM count alone, so the op never reads a device tensor on the host and can be
captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from openmla.kernels.sparse_mla_decode import sm90 as _sm90
from openmla.kernels.sparse_mla_decode import sm90_kn as _kn
from openmla.kernels.sparse_mla_decode.triton_kernel import (sparse_mla_decode_kernel,
                                                             sparse_mla_decode_merge_kernel)
from openmla.kernels.configs import ConfigSpace
from openmla.kernels.device import arch_of, num_sms, sm90_gluon
from openmla.kernels.launch import FastLaunch
from openmla.quant.validate import check_out, check_same_device, check_scale, check_tensor, fail
from openmla.quant.format_types import SPARSE_MLA
from openmla.quant.formats import cache_format
from openmla.quant.mla_formats import check_mla_format

LOG2E = 1.4426950408889634  # host: softmax scale -> log2-domain scale
_TILES = 4  # the kernels hold the 512-wide latent as four 128-wide tiles (fp8_ds_mla's scale tiles)
MAX_HEADS = 128

# The Triton kernel's config is selected on the host, not autotuned (kernels/configs.py):
# autotuning benchmarks on the first call, which cannot happen inside CUDA-graph capture, and the
# split count chosen on the host depends on the block shape. `_SPACE`'s prune rule is the table
# measured on Hopper (docs/notes/sparse_mla_decode.md).


def _config(block_h, block_n, num_warps, maxnreg=None):
    return triton.Config({"BLOCK_H": block_h, "BLOCK_N": block_n}, num_warps=num_warps,
                         num_stages=2, maxnreg=maxnreg)


def _table(configs, named_args, *, H):
    """The table measured on Hopper (docs/notes/sparse_mla_decode.md), one config per head-count
    bucket: H <= 16 in 16-head blocks of 32 rows at 4 warps, capped at 168 registers (three
    programs per SM); larger H in 32-head blocks of 64 rows at 8 warps (one program per SM).
    Both fit every target's shared memory (at most 115 KB on sm_90, 63 KB before it, 41 KB on
    AMD: tests/kernels/test_aot_compile.py); the register cap is an NVIDIA option (AMD has no
    maxnreg), so there the 16-head block runs uncapped."""
    capped_ok = arch_of(named_args["q_ptr"].device).maxnreg
    return [c for c in configs if (c.kwargs["BLOCK_H"] == 16) == (H <= 16)
            and (c.maxnreg is None or capped_ok)]


_SPACE = ConfigSpace("sparse_mla_decode_kernel",
                     (_config(16, 32, 4, maxnreg=168), _config(16, 32, 4), _config(32, 64, 8)),
                     key=("H",), prune=_table)


def _pick_config(q, H: int) -> dict:
    """The config of the Triton kernel for H heads (`_SPACE.select`), as the planner reads it.

    occupancy: programs of this config resident per SM (registers and shared memory), used to
    size the split count. 16-head blocks: 168 registers x 128 threads and 72 KB shared -> 3 per
    SM. 32-head blocks: one program of 8 warps per SM (255 registers)."""
    c = _SPACE.select({"q_ptr": q}, H=H)
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, maxnreg=c.maxnreg,
                occupancy=3 if c.kwargs["BLOCK_H"] == 16 else 1)


WAVES = 2  # at most about two rounds of resident programs
MIN_STEPS = 5  # shorter splits spend more on the q prologue, partial stores and the merge
MIN_FILL = 0.9  # share of the resident-program slots the last round must keep busy


def _split_chunk(topk: int, splits: int, block_n: int) -> int:
    """Keys per split: a multiple of BLOCK_N; ceil(topk / chunk) splits actually run."""
    return triton.cdiv(triton.cdiv(topk, splits), block_n) * block_n


def _pick_splits(T: int, num_hb: int, topk: int, cfg: dict, num_sms: int) -> int:
    """Split count from shapes and the SM count only (no device tensor is read).

    Programs all run the same number of key blocks, so the GPU works in rounds of
    occupancy x SMs programs: a count just under a multiple of that round keeps every slot busy,
    one just over leaves a nearly empty last round that takes as long as a full one. Take the
    largest split count up to WAVES rounds whose rounds are
    at least MIN_FILL full, with at least MIN_STEPS key blocks per split; failing that, the
    fullest."""
    base = T * num_hb
    slots = cfg["occupancy"] * num_sms
    if cfg.get("one_round"):
        # the Gluon kernel (one program per SM): fewer, longer splits within a single round, as
        # each split pays the q prologue and a partial row for each of its 64 heads (the timings
        # against the two-round rule: docs/notes/sparse_mla_decode.md)
        most = max(1, min(slots // base, topk // (cfg.get("min_steps", MIN_STEPS) * cfg["BLOCK_N"])))
    else:
        most = max(1, min(triton.cdiv(WAVES * slots, base), topk // (MIN_STEPS * cfg["BLOCK_N"])))
    best, best_fill = 1, 0.0
    for s in range(1, most + 1):
        s = triton.cdiv(topk, _split_chunk(topk, s, cfg["BLOCK_N"]))
        n = base * s
        fill = n / (triton.cdiv(n, slots) * slots)
        if fill >= MIN_FILL or fill > best_fill + 1e-9 and best_fill < MIN_FILL:
            best, best_fill = s, fill
    return best


# What a launch needs beyond its tensors, per call signature: the kernel, grid, split count and
# constexprs depend only on shapes, strides, the format, the device and the optional inputs, so
# they are chosen once and reused (a decode step repeats the same call every layer).
_PLANS: dict = {}
_MAX_PLANS = 4096
_TRITON = FastLaunch(sparse_mla_decode_kernel)
_MERGE = FastLaunch(sparse_mla_decode_merge_kernel)
_SM90 = FastLaunch(_sm90.sparse_mla_decode_sm90_kernel) if _sm90._GLUON else None
_KN = FastLaunch(_kn.sparse_mla_decode_sm90_kn_kernel) if _kn._GLUON else None


def _plan_launch(q, cache, indices, topk_length, attn_sink, fmt, config, num_splits):
    """(kernel launcher, grid, the int arguments before q's strides, the cache's row strides,
    constexprs, splits)."""
    T, H, _ = q.shape
    topk = indices.shape[1]
    is_fp8 = fmt.quantized
    # Hopper, fp8 cache, more than 32 heads: the Gluon kernel (64-head wgmma tiles); a pinned
    # config (tests, sweeps) always means the Triton kernel
    sm90 = is_fp8 and H > 32 and not config and _sm90.usable(q, cache)
    kn = is_fp8 and H <= _kn.MAX_HEADS and not config and _kn.usable(q, cache)
    if sm90:
        cfg = dict(BLOCK_H=_sm90.BLOCK_H, BLOCK_N=_sm90.BLOCK_N, occupancy=_sm90.OCCUPANCY,
                   one_round=True)
    elif kn:
        cfg = dict(BLOCK_H=_kn.block_h(H), BLOCK_N=_kn.BLOCK_N, occupancy=_kn.OCCUPANCY,
                   one_round=True, min_steps=_kn.MIN_STEPS)
    else:
        cfg = _pick_config(q, H)
        if config:
            cfg.update(config)
    block_h = max(16, min(cfg["BLOCK_H"], triton.next_power_of_2(H)))
    block_n = cfg["BLOCK_N"]
    num_hb = triton.cdiv(H, block_h)
    if num_splits is None:
        num_splits = _pick_splits(T, num_hb, topk, cfg, num_sms(q.device))
    chunk = _split_chunk(topk, num_splits, block_n)
    num_splits = triton.cdiv(topk, chunk)
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
                  ROPE_OFF=fmt.rope_offset)
    if sm90:
        return (_SM90, (T * num_hb, num_splits), ints, (stride_cb, stride_cr),
                dict(consts, num_warps=_sm90.NUM_WARPS), num_splits)
    if kn:
        return (_KN, (T * num_hb, num_splits), ints, (stride_cb, stride_cr),
                dict(consts, BS_SHIFT=_kn.bs_shift(block_size), num_warps=_kn.NUM_WARPS), num_splits)
    consts.update(FP8=is_fp8, E4M3=arch_of(q.device).e4m3, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        consts["maxnreg"] = cfg["maxnreg"]
    return _TRITON, (T * num_hb, num_splits), ints, (stride_cb, stride_cr), consts, num_splits


def _launch(q, cache, indices, topk_length, attn_sink, out, scale, fmt, *, config=None, num_splits=None):
    """Launch on validated inputs; writes out, returns lse [T, H] fp32. fmt: the cache's
    sparse MLA format descriptor (the constexprs below come from it)."""
    T, H, _ = q.shape
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return lse
    num_blocks, block_size, _ = cache.shape
    key = (q.device, T, H, indices.shape[1], fmt, cache.dtype, num_blocks, block_size,
           cache.stride(0), cache.stride(1), cache.data_ptr() & 15 == 0, topk_length is None,
           attn_sink is None,
           tuple(sorted(config.items())) if config else None, num_splits, sm90_gluon(q.device),
           arch_of(q.device))  # the path and e4m3 mode follow the device (or an assumed one)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _plan_launch(q, cache, indices, topk_length, attn_sink, fmt, config,
                                          num_splits)
    kernel, grid, ints, cache_strides, consts, num_splits = plan
    if num_splits > 1:
        po = torch.empty((T, num_splits, H, fmt.latent_dim), dtype=torch.float32, device=q.device)
        plse = torch.empty((T, num_splits, H), dtype=torch.float32, device=q.device)
    else:
        po = plse = lse  # unused
    sink = attn_sink if attn_sink is not None else lse
    length = topk_length if topk_length is not None else lse
    args = (q, cache, indices, length, sink, out, lse, po, plse, *ints, q.stride(0), q.stride(1),
            *cache_strides, indices.stride(0), out.stride(0), out.stride(1), float(scale) * LOG2E)
    # the plan's key and the strides below fix every int argument and dtype; with every pointer
    # 16-byte aligned (as the caching allocator gives them) it keys the launch too
    aligned = (q.data_ptr() | indices.data_ptr() | out.data_ptr() | length.data_ptr()
               | sink.data_ptr() | po.data_ptr() | plse.data_ptr() | lse.data_ptr()) & 15 == 0
    if aligned:
        kernel.keyed((key, q.stride(0), q.stride(1), indices.stride(0), out.stride(0), out.stride(1)),
                     grid, *args, **consts)
    else:
        kernel(grid, *args, **consts)
    if num_splits > 1:
        block_hm = min(16, triton.next_power_of_2(H))
        margs = (po, plse, sink, out, lse, H, num_splits, out.stride(0), out.stride(1))
        mconsts = dict(HAS_SINK=attn_sink is not None, BLOCK_H=block_hm, DV=fmt.latent_dim,
                       num_warps=4)
        mgrid = (T, triton.cdiv(H, block_hm))
        if aligned:
            _MERGE.keyed((key, out.stride(0), out.stride(1)), mgrid, *margs, **mconsts)
        else:
            _MERGE(mgrid, *margs, **mconsts)
    return lse


@torch.library.custom_op("openmla::sparse_mla_decode", mutates_args=("out",))
def _sparse_mla_decode_op(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor,
                          topk_length: Optional[torch.Tensor], attn_sink: Optional[torch.Tensor],
                          out: torch.Tensor, scale: float, fmt_name: str) -> torch.Tensor:
    # the format travels by its registry name (a custom op's arguments are tensors and scalars)
    return _launch(q, cache, indices, topk_length, attn_sink, out, scale,
                   cache_format(fmt_name, SPARSE_MLA))


@_sparse_mla_decode_op.register_fake
def _(q, cache, indices, topk_length, attn_sink, out, scale, fmt_name):
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


def sparse_mla_decode(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, *, scale: float,
                      topk_length: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None, fmt=None):
    """Sparse MLA decode attention over a paged latent cache.

    Args:
        q: [T, H, 576] bf16, absorbed query (latent 512 | rope 64), H any 1..128; last dim contiguous.
        cache: fp8_ds_mla [num_blocks, block_size, 656] uint8 (dequantized in the kernel) or
            bf16 [num_blocks, block_size, 576]; a strided view is fine (block stride >= block_size
            rows, rows contiguous). Slot s is row (s // block_size, s % block_size).
        indices: [T, topk] int32 global slots, topk >= 1; invalid = < 0 or >= num_blocks * block_size,
            skipped and never read.
        scale: softmax scale applied to q.k.
        topk_length: optional [T] int32; only the first topk_length[i] indices of row i count
            (values > topk act as topk, values <= 0 give an empty row).
        attn_sink: optional [H] fp32; out *= exp(lse) / (exp(lse) + exp(attn_sink)), lse unchanged.
        out: optional [T, H, 512] bf16 to write into (last dim contiguous).
        fmt: the cache's sparse MLA format (quant.FP8_DS_MLA, FP8_DS_MLA_RAW, BF16_MLA, or a
            layer's descriptor), checked against the cache; default `mla_format_of(cache)`.

    Returns:
        (out [T, H, 512] bf16, lse [T, H] fp32 natural log of the softmax denominator of scale*q.k).
        A row with no valid index gives out = 0 and lse = -inf.
    """
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3, last_dim_contiguous=True)
    T, H, d_qk = q.shape
    fmt = check_mla_format(cache, fmt)
    if (fmt.latent_dim, fmt.rope_dim) != (_TILES * 128, 64) or (fmt.quantized and fmt.num_tiles != _TILES):
        raise NotImplementedError(f"sparse_mla_decode: format {fmt} (the kernels read a {_TILES} x 128 "
                                  "latent in 128-wide scale tiles and a 64-wide rope)")
    if d_qk != fmt.head_dim:
        fail("q.shape[-1]", fmt.head_dim, d_qk)
    if not 1 <= H <= MAX_HEADS:
        fail("q.shape[1] (heads)", f"1..{MAX_HEADS}", H)
    check_tensor("cache", cache, ndim=3, last_dim_contiguous=True)
    num_blocks, block_size, width = cache.shape
    if num_blocks < 1 or block_size < 1:
        fail("cache.shape", "[num_blocks >= 1, block_size >= 1, width]", tuple(cache.shape))
    if cache.stride(1) < width:
        fail("cache.stride(1)", f">= {width} (rows must not overlap)", cache.stride(1))
    if cache.stride(0) < block_size * cache.stride(1):
        fail("cache.stride(0)", f">= block_size * stride(1) = {block_size * cache.stride(1)}", cache.stride(0))
    check_tensor("indices", indices, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    if indices.shape[0] != T:
        fail("indices.shape[0]", f"{T} (q.shape[0])", indices.shape[0])
    if indices.shape[1] < 1:
        fail("indices.shape[1] (topk)", ">= 1", indices.shape[1])
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=(T,), contiguous=True)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(H,), contiguous=True)
    scale = check_scale("scale", scale)
    out = check_out(out, q, fmt.latent_dim)
    check_same_device(q=q, cache=cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                      out=out)
    if torch.compiler.is_compiling():
        # traced by torch.compile: the registered op, which the compiler treats as one opaque call
        lse = _sparse_mla_decode_op(q, cache, indices, topk_length, attn_sink, out, float(scale),
                                    fmt.name)
    else:
        # eager and CUDA-graph capture: straight to the launch (the custom op's dispatcher costs
        # more host time than the launch itself)
        lse = _launch(q, cache, indices, topk_length, attn_sink, out, float(scale), fmt)
    return out, lse
