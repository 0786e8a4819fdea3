"""Sparse MLA prefill over a bf16 workspace: each query token attends to its own top-k rows.

    out[t, h]  = sum_j softmax_j(scale * q[t, h] . kv[i_j]) * kv[i_j, :512],  i_j = indices[t, j]

over the valid j (0 <= i_j < N and j < topk_length[t]). Two row widths d_qk, the value always
the first 512 dims of a row:

- 576 (DeepSeek-V3.2): a 512-wide latent part ("nope", also the value) and a 64-wide rope part.
- 512 (DeepSeek-V4, FlashMLA's MODEL1): 448 nope + 64 rope dims, and the value is the whole row;
  the kernel sees no rope part (D_ROPE = 0): the score is q . kv over the 512 dims it also sums.

One kernel, `sparse_mla_prefill_kernel`: a program owns one query token and a block of heads
(16, 32 or 64, never more: the [heads, 512] fp32 accumulator lives in registers), and walks the
token's indices BLOCK_N at a time with an online softmax in base 2 (log2(e) folded into the
scale). Per block of rows:

- the rows are gathered once, as three tiles: latent[:256], latent[256:], rope (d_qk 576; two at
  d_qk 512). Three score dots (no padding of 576 to 640) and two value dots that reuse the two
  latent tiles as V. The halves
  also give each thread fewer distinct rows to address (Triton spreads a 512-wide tile over the
  warps of a row; a 256-wide one fits one warp), and the loop is instruction-bound.
- the loads are masked (an invalid index is never read) and software-pipelined (num_stages):
  the compiler turns them into asynchronous copies into shared memory, a block ahead. For 16- and
  32-head blocks the next block's indices are loaded one iteration early into registers
  (PREFETCH): with the index load inside the iteration, Triton waits for every copy, the next
  block's included, at each step; prefetched, the copy of block i+1 overlaps block i's dots.
- row offsets are 32-bit when the whole workspace is addressable so (OFF32, host-checked):
  fewer integer instructions per gathered row in a loop that is instruction-bound.
- heads are the M of the dots: 64-head blocks run Hopper wgmma (M = 64 per warpgroup), 16- and
  32-head blocks mma.sync, so a small head count pays for no padding to 64.
- a short grid's last round is split (tail.py): its programs become pieces over parts of their
  index lists, whose fp32 rows a second kernel merges, as in the Gluon kernels.

On Hopper (Gluon available, kv rows on 16 bytes) two Gluon kernels take over: H <= 32 runs with
keys on the wgmma M, warp-specialised (kernels/sparse_mla_prefill/sm90_kn.py), H > 32 in 64-head
blocks (kernels/sparse_mla_prefill/sm90.py: warp-specialised, a producer, a score warpgroup and a
value warpgroup; also d_qk 512, with no rope buffers). The keys-on-M kernel
is written for d_qk 576. This kernel serves everything else (d_qk 512 at H <= 32, other GPUs, the
interpreter, OPENMLA_SM90_GLUON=0, unaligned rows).

Timings: docs/benchmarks.md; the measurements behind these choices and the variants tried:
docs/notes/sparse_mla_prefill.md.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from openmla.kernels.configs import ConfigSpace
from openmla.kernels.sparse_mla_prefill import sm90 as _sm90
from openmla.kernels.sparse_mla_prefill import sm90_kn as _kn
from openmla.kernels.sparse_mla_prefill.shared import finish_rows, keep_faults, max_logits, piece_range, split_program
from openmla.kernels.sparse_mla_prefill.tail import PIECE_N, merge_tail, tail_split, tail_workspace
from openmla.kernels.device import arch_of, num_sms
from openmla.quant.validate import check_out, check_same_device, check_scale, check_tensor, fail
from openmla.quant.mla_formats import BF16_MLA

D_LAT = BF16_MLA.latent_dim  # 512, also the value width
D_ROPE = BF16_MLA.rope_dim  # 64
D_QK = D_LAT + D_ROPE  # 576 (V3.2 rows)
D_QK_V4 = D_LAT  # 512 (V4 / MODEL1 rows: the value is the whole row, no score-only part)

_SMEM_SLACK = 8 * 1024  # the compiler's reduction and layout-conversion scratch beyond the estimate
_LOG2E = 1.4426950408889634


def _block_h(H: int, arch, d_qk: int = D_QK) -> int:
    """Heads per program: the smallest of 16 / 32 / 64 that holds H (tensor-core M is >= 16), at
    most what leaves room beside q for one 32-row buffer in the device's shared memory (on 99 KB
    GPUs 32 heads, on 64 KB ones 16: more head blocks, each gathering the rows again)."""
    block_h = 16 if H <= 16 else 32 if H <= 32 else 64
    while (block_h > 16
           and _smem_estimate(block_h, 32, 2, True, arch, d_qk) > arch.smem_bytes - _SMEM_SLACK):
        block_h //= 2
    return block_h


def _programs_per_sm(block_h: int, arch, d_qk: int) -> int:
    """Programs of the default config an SM runs at once (the split's slots are SMs x this): one of
    64 heads (its accumulator takes the registers), else as many as shared memory holds of the
    default config (prefetched 32-row blocks, 3 stages), at most two (4 warps of up to 255
    registers)."""
    if block_h >= 64:
        return 1
    return max(1, min(2, arch.smem_bytes // _smem_estimate(block_h, 32, 3, True, arch, d_qk)))


def _bucket(x: int, lo: int, hi: int) -> int:
    """Shape class for autotune keys: the next power of two of x, clamped to [lo, hi]."""
    return min(max(triton.next_power_of_2(max(int(x), 1)), lo), hi)


# ---------------------------------------------------------------------------------------------
# Autotune configs
# ---------------------------------------------------------------------------------------------
_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "PREFETCH": pf}, num_warps=w, num_stages=s)
    for pf in (True, False) for bn, s in ((32, 3), (32, 5), (64, 3), (32, 2)) for w in (4, 8)
]


def _smem_estimate(block_h: int, block_n: int, stages: int, prefetch: bool, arch,
                   d_qk: int = D_QK) -> int:
    """Shared memory of a config on `arch`, at most: q (bf16, resident) plus the row buffers.
    Buffers Triton 3.6 allocates (compiles for each target, tests/kernels/test_aot_compile.py):
    with the index load in the loop max(stages - 2, 2) (the index load and the consumer take a
    stage each); with prefetched indices stages - 1 under mma.sync and stages under wgmma (sm_90,
    64-head blocks: the value wgmma of block i-1 still reads its buffer while block i+1 is
    copied). sm_100's tcgen05 dots (64-head blocks) stage operands in 1.5 buffers more."""
    wide = block_h >= 64 and arch.mma in ("wgmma", "tcgen05")
    buffers = (stages if wide else stages - 1) if prefetch else max(stages - 2, 2)
    if block_h >= 64 and arch.mma == "tcgen05":
        buffers += 1.5
    return int(block_h * d_qk * 2 + buffers * block_n * d_qk * 2)


def _prune_configs(configs, named_args, **kwargs):
    """Configs worth timing for this head block on this device; each rule says why it drops a
    config. The rules after the register one were tuned on Hopper; where none of their
    choices fits the device's shared memory, every config that fits is timed. The rules were
    measured at d_qk 576; d_qk 512 rows (D_ROPE = 0) keep them, with their own shared memory."""
    block_h = kwargs["BLOCK_H"]
    d_qk = D_LAT + kwargs.get("D_ROPE", D_ROPE)
    arch = arch_of(named_args["q_ptr"].device)
    budget = arch.smem_bytes - _SMEM_SLACK
    fits = [c for c in configs
            if _smem_estimate(block_h, c.kwargs["BLOCK_N"], c.num_stages, c.kwargs["PREFETCH"], arch,
                              d_qk) <= budget
            # The [64, 512] fp32 accumulator is 128 registers a thread at 8 warps; at 4 warps it
            # would be 256, more than a thread has.
            and not (block_h >= 64 and c.num_warps != 8)]
    kept = []
    for c in fits:
        bn, w, s, pf = c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.kwargs["PREFETCH"]
        if block_h >= 64:
            # Prefetching needs `stages` 72 KB buffers of 64 rows here: 64 x 3 does not fit, and
            # what fits (64 x 2, 32 x 3/4) is no faster than the index load in the loop with 64 x 3
            # (docs/notes/sparse_mla_prefill.md).
            if pf:
                continue
            # With the index load in the loop, 32-row blocks at 3 stages get a single in-flight
            # buffer (the copy of the next rows is waited for right after it is issued).
            if bn == 32 and s < 5:
                continue
        else:
            # mma.sync tiles of 16/32 heads: 8 warps only split the 512 columns finer and are
            # slower than 4.
            if w != 4:
                continue
            # Prefetched 32-row blocks at 3 stages (one block in flight, 93 / 113 KB: two
            # programs per SM, which the instruction-bound loop needs). More stages leave one
            # program per SM, 16-row blocks cost more instructions per row, and the index load in
            # the loop waits for every copy (timings: docs/notes/sparse_mla_prefill.md).
            if not pf or bn != 32 or s != 3:
                continue
        kept.append(c)
    return kept or fits


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------
def _defaults_first(c) -> bool:
    """Sort key putting the sound defaults first (what runs untimed, kernels/configs.py): the
    measured choice of 16/32-head blocks (prefetched 32-row blocks, 3 stages, 4 warps) and of
    64-head blocks (64-row blocks with the index load in the loop, 3 stages, 8 warps)."""
    return (c.kwargs["BLOCK_N"], c.kwargs["PREFETCH"], c.num_stages, c.num_warps) not in (
        (32, True, 3, 4), (64, False, 3, 8))


_SPACE = ConfigSpace("sparse_mla_prefill_kernel", tuple(sorted(_CONFIGS, key=_defaults_first)),
                     key=("H_BUCKET", "TOPK_BUCKET", "D_ROPE"), prune=_prune_configs)


@_SPACE.autotune()
@triton.jit(do_not_specialize=["H", "N", "TOPK", "NUM_HB", "H_BUCKET", "TOPK_BUCKET", "P_MAIN", "SPLITS"])
def sparse_mla_prefill_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, ml_ptr, lse_ptr,
    H, N, TOPK, NUM_HB,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
    scale, scale_log2,
    H_BUCKET, TOPK_BUCKET,
    ws_o_ptr, ws_lse_ptr, ws_ml_ptr, P_MAIN, SPLITS,
    HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, OFF32: tl.constexpr,
    D_LAT: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, PIECE_N: tl.constexpr,
):
    HALF: tl.constexpr = D_LAT // 2
    # The head blocks of one token are neighbouring programs: they gather the same rows. Programs
    # from P_MAIN on are pieces of the split programs P_MAIN.. (tail.py), SPLITS of each in a row.
    i_t, i_hb, i_w = split_program(tl.program_id(0), P_MAIN, SPLITS, NUM_HB)  # i_w >= 0: a piece

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_a = tl.arange(0, HALF)
    o_b = HALF + tl.arange(0, HALF)

    p_q = q_ptr + i_t * stride_qt + o_h[:, None] * stride_qh
    b_qa = tl.load(p_q + o_a[None, :], mask=m_h[:, None], other=0.0)
    b_qb = tl.load(p_q + o_b[None, :], mask=m_h[:, None], other=0.0)
    if D_ROPE > 0:  # d_qk 576: the score-only rope tile (d_qk 512 rows have none)
        o_r = D_LAT + tl.arange(0, D_ROPE)
        b_qr = tl.load(p_q + o_r[None, :], mask=m_h[:, None], other=0.0)

    n_use = TOPK
    if HAS_LEN:
        n_use = tl.minimum(tl.maximum(tl.load(len_ptr + i_t), 0), TOPK)
    p_idx, n_use = piece_range(idx_ptr + i_t * stride_it, n_use, i_w, SPLITS, PIECE_N)

    # m_i is the running max of the raw q.k (scale > 0), so max_logits = scale * m_i exactly.
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc_b = tl.zeros([BLOCK_H, HALF], tl.float32)
    o_nn = tl.arange(0, BLOCK_N)
    if PREFETCH:
        b_idx_nx = tl.load(p_idx + o_nn, mask=o_nn < n_use, other=-1)
    for i_n in range(0, n_use, BLOCK_N):
        if PREFETCH:
            # This block's indices came from the previous iteration (a loop-carried register
            # tensor), so the row copies below depend on no load of this iteration and the
            # pipeliner can issue them a block ahead.
            b_idx = b_idx_nx
            o_nx = i_n + BLOCK_N + o_nn
            b_idx_nx = tl.load(p_idx + o_nx, mask=o_nx < n_use, other=-1)
        else:
            o_n = i_n + o_nn
            b_idx = tl.load(p_idx + o_n, mask=o_n < n_use, other=-1)
        m_n = (b_idx >= 0) & (b_idx < N)
        # Invalid rows are never read: the mask keeps them off the memory system (their offset
        # may wrap in 32 bits; it is never dereferenced). 64-bit row offsets when N * stride
        # can pass 2**31 elements.
        if OFF32:
            p_kv = kv_ptr + b_idx * stride_kv
        else:
            p_kv = kv_ptr + b_idx.to(tl.int64) * stride_kv
        b_ka = tl.load(p_kv[:, None] + o_a[None, :], mask=m_n[:, None], other=0.0)
        b_kb = tl.load(p_kv[:, None] + o_b[None, :], mask=m_n[:, None], other=0.0)
        if D_ROPE > 0:
            b_kr = tl.load(p_kv[:, None] + o_r[None, :], mask=m_n[:, None], other=0.0)
            b_s = tl.dot(b_qr, tl.trans(b_kr))
            b_s = tl.dot(b_qa, tl.trans(b_ka), b_s)
        else:
            b_s = tl.dot(b_qa, tl.trans(b_ka))
        b_s = tl.dot(b_qb, tl.trans(b_kb), b_s)
        # a NaN or inf score of a valid row turns NaN (kernels/softmax.py): the query ends NaN
        b_s = tl.where(m_n[None, :], keep_faults(b_s), float("-inf"))

        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        # A head with nothing valid yet keeps max -inf; shift by 0 there so no inf - inf appears.
        m_sh = tl.where(m_new == float("-inf"), 0.0, m_new * scale_log2)
        b_p = tl.exp2(b_s * scale_log2 - m_sh[:, None])
        alpha = tl.exp2(m_i * scale_log2 - m_sh)
        l_i = l_i * alpha + tl.sum(b_p, 1)
        b_pv = b_p.to(b_ka.dtype)
        acc_a = tl.dot(b_pv, b_ka, acc_a * alpha[:, None])
        acc_b = tl.dot(b_pv, b_kb, acc_b * alpha[:, None])
        m_i = m_new

    # a piece (i_w >= 0) leaves the sink to the merge: its sink load is masked off (factor 1)
    inv, lse = finish_rows(l_i, m_i, scale, sink_ptr, o_h, m_h & (i_w < 0), HAS_SINK)

    if i_w >= 0:  # a piece: fp32 rows of every head of the block, lse and max_logits into row i_w
        o_hw = i_w * BLOCK_H + tl.arange(0, BLOCK_H)
        p_w = ws_o_ptr + o_hw.to(tl.int64)[:, None] * D_LAT
        tl.store(p_w + o_a[None, :], acc_a * inv[:, None])
        tl.store(p_w + o_b[None, :], acc_b * inv[:, None])
        tl.store(ws_ml_ptr + o_hw, max_logits(m_i, lse, scale))
        tl.store(ws_lse_ptr + o_hw, lse)
    else:
        p_o = out_ptr + i_t * stride_ot + o_h[:, None] * stride_oh
        tl.store(p_o + o_a[None, :], (acc_a * inv[:, None]).to(out_ptr.dtype.element_ty), mask=m_h[:, None])
        tl.store(p_o + o_b[None, :], (acc_b * inv[:, None]).to(out_ptr.dtype.element_ty), mask=m_h[:, None])
        tl.store(ml_ptr + i_t * H + o_h, max_logits(m_i, lse, scale), mask=m_h)
        tl.store(lse_ptr + i_t * H + o_h, lse, mask=m_h)


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------
def _launch(q, kv, indices, scale, topk_length, attn_sink, out):
    """Run the kernel over (token, head block) programs, writing out; returns (lse, max_logits)."""
    T, H, d_qk = q.shape
    N, topk = kv.shape[0], indices.shape[1]
    max_logits = torch.empty((T, H), dtype=torch.float32, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return lse, max_logits
    # Hopper with Gluon and 16-byte rows: V3.2 rows at any H, V4's 512-wide rows in 64-head blocks
    # (the keys-on-M kernel is written for 576)
    if _sm90.usable(q, kv) and (d_qk == D_QK or H > _kn.MAX_HEADS):
        sm90 = _kn if H <= _kn.MAX_HEADS else _sm90
        sm90.launch(q, kv, indices, topk_length, attn_sink, out, max_logits, lse, scale, _LOG2E,
                    D_LAT, d_qk - D_LAT)
        return lse, max_logits
    arch = arch_of(q.device)
    block_h = _block_h(H, arch, d_qk)
    num_hb = triton.cdiv(H, block_h)
    # the grid's last round split (tail.py), over the programs that run at once
    p_main, splits = tail_split(T * num_hb, num_sms(q.device) * _programs_per_sm(block_h, arch, d_qk),
                                triton.cdiv(topk, PIECE_N), block_h, "triton")
    grid, ws_o, ws_lse, ws_ml = tail_workspace(T * num_hb, p_main, splits, block_h, D_LAT, lse)
    # Unused pointer arguments get a tensor of the right kind; the kernel never reads them.
    len_arg = topk_length if topk_length is not None else indices
    sink_arg = attn_sink if attn_sink is not None else lse
    sparse_mla_prefill_kernel[(grid,)](
        q, kv, indices, len_arg, sink_arg, out, max_logits, lse,
        H, N, topk, num_hb,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        scale, scale * _LOG2E,
        _bucket(H, 16, 128), _bucket(topk, 32, 2048),
        ws_o, ws_lse, ws_ml, p_main, splits,
        HAS_LEN=topk_length is not None, HAS_SINK=attn_sink is not None,
        OFF32=(N - 1) * kv.stride(0) + d_qk < 2 ** 31,
        D_LAT=D_LAT, D_ROPE=d_qk - D_LAT, BLOCK_H=block_h, PIECE_N=PIECE_N,
    )
    if splits > 1:
        merge_tail(ws_o, ws_lse, ws_ml, attn_sink, out, lse, max_logits, p_main, splits, num_hb, num_sms(q.device))
    return lse, max_logits


@torch.library.custom_op("openmla::sparse_mla_prefill", mutates_args=("out",))
def _sparse_mla_prefill_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                           topk_length: Optional[torch.Tensor], attn_sink: Optional[torch.Tensor],
                           out: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, kv, indices, scale, topk_length, attn_sink, out)


@_sparse_mla_prefill_op.register_fake
def _(q, kv, indices, topk_length, attn_sink, out, scale):
    T, H, _ = q.shape
    return q.new_empty((T, H), dtype=torch.float32), q.new_empty((T, H), dtype=torch.float32)


def sparse_mla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float,
                       topk_length: Optional[torch.Tensor] = None,
                       attn_sink: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None):
    """Sparse MLA attention of prefill tokens over rows of a bf16 workspace.

    Args:
        q: [T, H, d_qk] bf16, last dim contiguous (any H >= 1, any token/head strides); d_qk is
            kv's.
        kv: [N, d_qk] bf16, rows contiguous, row stride may exceed d_qk (a flat view of a bf16
            cache or the chunk workspace). d_qk 576 (V3.2): latent 512 | rope 64, the latent is
            the value; d_qk 512 (V4 / MODEL1): nope 448 | rope 64, the whole row is the value.
        indices: [T, topk] int32 rows of kv, last dim contiguous; an index < 0 or >= N is
            invalid, skipped and never read.
        scale: softmax scale applied to q . k: any finite nonzero number.
        topk_length: [T] int32 or None: only the first topk_length[t] indices of row t count
            (values above topk mean topk, <= 0 means none).
        attn_sink: [H] fp32 or None: out *= exp(lse) / (exp(lse) + exp(sink[h])); lse unchanged.
        out: optional [T, H, 512] bf16 to write into (last dim contiguous).

    Returns (the order of every attention op, kernels/__init__.py):
        out: [T, H, 512] bf16, the softmax-weighted sum of the rows' first 512 dims.
        lse: [T, H] fp32, natural-log sum of exp(scale * q . k_j).
        max_logits: [T, H] fp32, max over valid j of scale * q . k_j.
        A row with no valid index gives out = 0, lse = -inf, max_logits = -inf.
    """
    # kv's width names the model (576 V3.2, 512 V4); q must have the same
    check_tensor("kv", kv, dtype=torch.bfloat16, ndim=2, last_dim_contiguous=True)
    if kv.shape[1] not in (D_QK, D_QK_V4):
        fail("kv.shape", f"(*, {D_QK}) or (*, {D_QK_V4})", tuple(kv.shape))
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, kv.shape[1]),
                 last_dim_contiguous=True)
    T, H, _ = q.shape
    check_tensor("indices", indices, dtype=torch.int32, shape=(T, None), last_dim_contiguous=True)
    if indices.shape[1] < 1:
        fail("indices.shape[1] (topk)", ">= 1", indices.shape[1])
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=(T,), contiguous=True)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(H,), contiguous=True)
    scale = check_scale("scale", scale)
    out = check_out(out, q, D_LAT)
    check_same_device(q=q, kv=kv, indices=indices, topk_length=topk_length, attn_sink=attn_sink,
                      out=out)
    if scale < 0:
        # The kernels keep the running max of the unscaled q . k and scale it afterwards, which is
        # the max of scale * q . k only for scale > 0: -scale * (-q) . k is the same score (exact).
        q, scale = -q, -scale
    lse, max_logits = _sparse_mla_prefill_op(q, kv, indices, topk_length, attn_sink, out, scale)
    return out, lse, max_logits
