"""paged_mqa_topk: the indexer's decode logits and their top-k in one launch (small batches).

At batch 1-8 the decode logits take 3-7 us and a separate top-k three dependent launches of a few
us each (kernels/indexer/topk.py's split path). Here one cooperative launch does both: the grid is
paged_mqa_logits' (request b, part s of its key tiles), every program computes its logits as that
kernel does, then the request's programs run topk.py's split stages over the fresh logits rows
(still in L2), parted by contiguous columns, with a barrier between stages instead of a launch:

    logits | barrier | stage 1 (bounds) | barrier | stage 2 (histogram) | barrier | stage 3 (writes;
    the row's last part to finish runs stage 4)

The barrier counts the request's arrivals on one int32 (release add, volatile spin, acquire), so
it needs every program of the request resident at once: the launch is cooperative (the driver
refuses a grid that cannot be co-resident rather than run it) and the grid is sized from the
compiled kernel's registers and shared memory. The last program of a request to leave resets
its counts to zero, so a workspace can be reused without a memset.

The interpreter runs programs one after another, where a barrier cannot be passed: there, and on
GPUs without the launch (not CUDA), paged_mqa_topk runs paged_mqa_logits then decode_topk. Both
ways give the same indices slot for slot (the stages and the parting rules are topk.py's).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.kernels.device import arch_of, num_sms
from openmla.kernels.indexer.paged_mqa_logits import (paged_logits_program, paged_mqa_logits,
                                                      prepare_launch)
from openmla.kernels.indexer import topk as _topk
from openmla.kernels.indexer.topk import _check_k, decode_topk, split_bucket, split_stats, split_write
from openmla.kernels.launch import cdiv, next_pow2
from openmla.quant.indexer_cache import INDEXER_K_FP8
from openmla.quant.validate import check_tensor, fail

__all__ = ["paged_mqa_topk"]

# Query rows (batch x next_n) up to which the fused launch is used; above, the logits kernel fills
# the GPU with more programs than can be co-resident, and the split top-k's launches are a small
# part of the step.
_FUSED_MAX_ROWS = 16
# Programs per SM the fused grid aims for (at most what the compiled kernel lets be resident)
_FUSED_WAVES = 4
_WARPS = 4


@triton.jit
def _request_barrier(p_cnt, target):
    """Wait until the request's count reaches `target` (its programs times the barriers so far):
    this program's stores before its arrival (CTA barrier, release add by one thread), every
    other program's stores before what follows (acquire, CTA barrier)."""
    tl.debug_barrier()
    tl.atomic_add(p_cnt, 1, sem="release")
    seen = tl.load(p_cnt, volatile=True)
    while seen < target:
        seen = tl.load(p_cnt, volatile=True)
    tl.atomic_add(p_cnt, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _row_end(ctx_ptr, i_b, j, N, stride_ctx_b, stride_ctx_n, L, PER_ROW_CTX: tl.constexpr):
    """Row j of request i_b selects among positions [0, end) (paged_mqa_logits' visibility)."""
    if PER_ROW_CTX:
        end = tl.load(ctx_ptr + i_b * stride_ctx_b + j * stride_ctx_n)
    else:
        end = tl.load(ctx_ptr + i_b * stride_ctx_b) - N + 1 + j
    return tl.minimum(tl.maximum(end, 0), L)


@triton.jit
def paged_mqa_topk_kernel(
    q_ptr, w_ptr, cache_ptr, scale_ptr, k_desc, s_desc, ctx_ptr, bt_ptr, logits_ptr,
    stride_qb, stride_qn, stride_qh, stride_wr, stride_cb, stride_ctx_b, stride_ctx_n,
    stride_bt, stride_lr,
    N, H, block_size, num_blocks, table_width, max_model_len, splits,
    out_ptr, stats_ptr, hist_ptr, suffix_ptr, done_ptr, sync_ptr, cand_ptr, stride_out, K, P, CAND,
    NP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PER_ROW_CTX: tl.constexpr, FP8_DOT: tl.constexpr, E4M3: tl.constexpr,
    TMA: tl.constexpr, ACC_STEP: tl.constexpr,
    NBINS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Program (b, s): request b's logits over its tiles s, s + splits, .. (columns past the
    longest row end unwritten), then part s (of P <= splits; programs s >= P only pass the
    barriers) of each of its rows through the top-k stages."""
    i_b = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    paged_logits_program(
        i_b, i_s, q_ptr, w_ptr, cache_ptr, scale_ptr, k_desc, s_desc, ctx_ptr, bt_ptr, logits_ptr,
        stride_qb, stride_qn, stride_qh, stride_wr, stride_cb, stride_ctx_b, stride_ctx_n, stride_bt,
        stride_lr, N, H, block_size, num_blocks, table_width, max_model_len, splits,
        NP, HP, D, BLOCK_N, PER_ROW_CTX, False, FP8_DOT, E4M3, TMA, ACC_STEP)
    p_sync = sync_ptr + i_b * 2
    _request_barrier(p_sync, splits)
    if i_s < P:
        for j in range(N):
            i_r = i_b * N + j
            end = _row_end(ctx_ptr, i_b, j, N, stride_ctx_b, stride_ctx_n, max_model_len, PER_ROW_CTX)
            split_stats(logits_ptr + i_r * stride_lr, stats_ptr, hist_ptr, done_ptr, i_r, i_s, P, 0, end, K,
                        NBINS, BLOCK)
    _request_barrier(p_sync, 2 * splits)
    if i_s < P:
        for j in range(N):
            i_r = i_b * N + j
            end = _row_end(ctx_ptr, i_b, j, N, stride_ctx_b, stride_ctx_n, max_model_len, PER_ROW_CTX)
            split_bucket(logits_ptr + i_r * stride_lr, stats_ptr, hist_ptr, suffix_ptr, i_r, i_s, P, 0, end,
                         K, NBINS, BLOCK, BLOCK_P)
    _request_barrier(p_sync, 3 * splits)
    if i_s < P:
        for j in range(N):
            i_r = i_b * N + j
            end = _row_end(ctx_ptr, i_b, j, N, stride_ctx_b, stride_ctx_n, max_model_len, PER_ROW_CTX)
            split_write(logits_ptr + i_r * stride_lr, out_ptr + i_r * stride_out, cand_ptr + i_r * (2 * CAND),
                        stats_ptr, hist_ptr, suffix_ptr, done_ptr, i_r, i_s, P, 0, end, K, CAND, True,
                        NBINS, BLOCK, BLOCK_K, BLOCK_P, BLOCK_C)
    # Every program has passed the last barrier once it counts here: the last one zeroes the counts.
    if tl.atomic_add(p_sync + 1, 1, sem="relaxed") == splits - 1:
        tl.store(p_sync, 0)
        tl.store(p_sync + 1, 0)


_resident = {}


def _programs_per_sm(kernel, device) -> int:
    """Programs of the compiled kernel one SM holds at once (registers, shared memory, threads)."""
    key = (id(kernel), device)
    if key not in _resident:
        kernel._init_handles()
        props = torch.cuda.get_device_properties(device)
        regs = getattr(props, "regs_per_multiprocessor", 65536)
        threads = getattr(props, "max_threads_per_multi_processor", 2048)
        smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
        warp_regs = cdiv(max(kernel.n_regs, 1) * 32, 256) * 256  # allocated per warp in units of 256
        by_regs = regs // (warp_regs * _WARPS)
        by_smem = smem // (kernel.metadata.shared + 1024)  # 1 KB a block reserved by the driver
        _resident[key] = max(0, min(by_regs, by_smem, threads // (32 * _WARPS), 32))
    return _resident[key]


def _fused_ok(q: torch.Tensor) -> bool:
    """The fused launch runs on NVIDIA GPUs (Triton's cooperative launch), not in the interpreter."""
    return arch_of(q.device).backend == "cuda"


def paged_mqa_topk(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                   context_lens: torch.Tensor, block_table: torch.Tensor, *, max_model_len: int, k: int,
                   fmt=INDEXER_K_FP8, out: torch.Tensor = None, logits: torch.Tensor = None,
                   workspace: torch.Tensor = None, fused: bool = None, waves: int = None,
                   topk_block: int = None) -> torch.Tensor:
    """The decode indexer's selection: paged_mqa_logits then decode_topk, in one launch for small
    batches (module docstring).

    Args:
        q, weights, cache, context_lens, block_table, max_model_len, fmt: as paged_mqa_logits.
        k: int >= 1, positions kept per query row.
        out: optional [B * next_n, k] int32 with a contiguous last dim.
        logits: optional [B * next_n, max_model_len] fp32 scratch for the logits (contiguous last
            dim); columns at and past each request's longest row end are left unwritten.
        workspace: optional int32 tensor of at least 2 * B elements, zero on first use, for the
            fused launch's barrier counts (each launch leaves it zero); None: allocated zeroed.
        fused: force the fused launch (True: ValueError where it cannot run) or the two-kernel
            path (False); None picks.
        waves, topk_block: the fused grid's programs per SM (at most what fits) and the columns a
            top-k part takes (a power of two, 128..1024); None picks.

    Returns [B * next_n, k] int32, decode_topk's result for these logits.
    """
    k = _check_k(k)
    check_tensor("q", q, dtype=(torch.float8_e4m3fn, torch.uint8), ndim=4, last_dim_contiguous=True)
    B, N = q.shape[:2]
    R = B * N
    if out is None:
        out = torch.empty(R, k, dtype=torch.int32, device=q.device)
    else:
        check_tensor("out", out, dtype=torch.int32, shape=(R, k), last_dim_contiguous=True)
    use = (_fused_ok(q) and R <= _FUSED_MAX_ROWS) if fused is None else bool(fused)
    if use and not _fused_ok(q):
        fail("fused", "False or None on this device (the fused launch needs an NVIDIA GPU)", fused)
    if not use:
        lg = paged_mqa_logits(q, weights, cache, context_lens, block_table, max_model_len=max_model_len,
                              fmt=fmt, clean_logits=False, out=logits)
        return decode_topk(lg, context_lens, N, k, out=out)
    launch = prepare_launch(q, weights, cache, context_lens, block_table, max_model_len, fmt, logits, 64)
    if launch.splits == 0:
        return out
    L = max_model_len
    if workspace is None:
        workspace = torch.zeros(2 * B, dtype=torch.int32, device=q.device)
    else:
        check_tensor("workspace", workspace, dtype=torch.int32, contiguous=True)
        if workspace.numel() < 2 * B:
            fail("workspace.numel()", f">= {2 * B}", workspace.numel())
    block = topk_block if topk_block is not None else 256
    if block < 128 or block > 1024 or block & (block - 1):
        fail("topk_block", "a power of two in 128..1024", block)
    nbins = _topk._BUCKETS
    meta = dict(launch.meta, NBINS=nbins, BLOCK=block, BLOCK_K=min(1024, next_pow2(k)), BLOCK_C=_topk._PAIRWISE)
    tiles = cdiv(L, meta["BLOCK_N"])
    want = _FUSED_WAVES if waves is None else waves
    cand_len = max(1, min(L, _topk._CANDIDATES))
    dev = q.device
    cand = torch.empty(R, 2, cand_len, dtype=torch.int32, device=dev)
    hist = torch.empty(R, nbins, dtype=torch.int32, device=dev)
    done = torch.empty(R, dtype=torch.int32, device=dev)
    # The grid: the logits' splits at `want` programs per SM, fewer when the kernel does not fit.
    splits = max(1, min(tiles, cdiv(want * num_sms(dev), B)))
    common = dict(meta, num_warps=_WARPS, num_stages=launch.stages, launch_cooperative_grid=True)

    def arguments(splits):
        P = min(splits, cdiv(L, block))
        stats = torch.empty(R, P, 3, dtype=torch.int32, device=dev)
        suffix = torch.empty(R, P, nbins, dtype=torch.int32, device=dev)
        return launch.args[:-1] + (splits, out, stats, hist, suffix, done, workspace, cand, out.stride(0),
                                   k, P, cand_len), next_pow2(P)

    args, block_p = arguments(splits)
    if dev.type == "cuda":
        compiled = paged_mqa_topk_kernel.warmup(*args, BLOCK_P=block_p, grid=(B, splits), **common)
        fit = _programs_per_sm(compiled, dev) * num_sms(dev)
    else:  # an ahead-of-time compile (kernels.device.assume): the launch is captured, not run
        fit = B * splits
    if fit < B:
        raise NotImplementedError(f"paged_mqa_topk: {B} requests need {B} co-resident programs; "
                                  f"the GPU holds {fit} of the fused kernel")
    if B * splits > fit:
        splits = fit // B
        args, block_p = arguments(splits)
    paged_mqa_topk_kernel[(B, splits)](*args, BLOCK_P=block_p, **common)
    return out
