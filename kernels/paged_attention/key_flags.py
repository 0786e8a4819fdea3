"""Per-key fault flags of a paged K cache for the long-query path of `paged_attention_kernel`.

One byte per request, KV head and group of GROUP key positions: 1 when a key of the group (a
position < the request's seq_len, behind a valid block id) holds a NaN or inf in any element.
Any such element makes that key's score non-finite for every finite query row, so a row block
whose interior tiles (keys every one of its rows attends, kernel.py) cover a flagged group is
NaN whole, and the interior loop needs no per-score fault work: it reads the flags of its
interior range once, before the loop. Interior tiles start and end at multiples of BLOCK_N, so
their groups are whole. Masked tiles keep their per-score check (kernels/softmax.py).

The pass reads K once, a group's keys with all their heads a step (67 MB of bf16 K for 32768
keys x 8 heads x 128), against the per-score fma it replaces in every row block's loop
(docs/notes/paged_attention.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

GROUP = 16  # key positions a flag covers (BLOCK_N is a multiple of it)


@triton.jit
def key_flags_kernel(
    k_ptr, bt_ptr, lens_ptr, flags_ptr, NUM_BLOCKS, KV_CAP, NPROG, H_KV,
    s_kb, s_kt, s_kh, s_bt, s_fr, s_fh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HK: tl.constexpr, PAGE_SIZE: tl.constexpr,
    GROUP_: tl.constexpr,
):
    """flags[r, h, g] for groups g < cdiv(min(seq_len_r, KV_CAP), GROUP_) of request r = program
    0, BLOCK_HK KV heads at a time; program 1 of NPROG takes every NPROG-th group. A step reads
    the GROUP_ keys' rows for BLOCK_HK heads (within a page one contiguous run when the heads are
    and BLOCK_HK covers them), not one head's 2 * HEAD_DIM bytes a key. Groups past the
    request's keys are not written (the kernel never reads them)."""
    i_r = tl.program_id(0)
    i_p = tl.program_id(1)
    seq_len = tl.minimum(tl.load(lens_ptr + i_r), KV_CAP)
    n_groups = tl.cdiv(tl.maximum(seq_len, 0), GROUP_)
    o_j = tl.arange(0, GROUP_)
    o_h = tl.arange(0, BLOCK_HK)
    o_d = tl.arange(0, BLOCK_D)
    p_bt = bt_ptr + i_r.to(tl.int64) * s_bt
    p_f = flags_ptr + i_r.to(tl.int64) * s_fr
    for g in range(i_p, n_groups, NPROG):
        o_pos = g * GROUP_ + o_j
        m_pos = o_pos < seq_len
        b_blk = tl.load(p_bt + o_pos // PAGE_SIZE, mask=m_pos, other=0).to(tl.int64)
        # an invalid block id is never read (the kernel sends its range to the masked loop)
        m_pos = m_pos & (b_blk >= 0) & (b_blk < NUM_BLOCKS)
        o_row = b_blk * s_kb + (o_pos % PAGE_SIZE) * s_kt
        for h0 in range(0, H_KV, BLOCK_HK):
            o_hc = h0 + o_h
            m_hd = (o_hc < H_KV)[:, None] & (o_d < HEAD_DIM)[None, :]
            b_k = tl.load(k_ptr + o_row[:, None, None] + (o_hc[:, None] * s_kh + o_d[None, :])[None, :, :],
                          mask=m_pos[:, None, None] & m_hd[None, :, :], other=0.0).to(tl.float32)
            # x * 0 is NaN exactly for a NaN or inf x
            b_bad = tl.sum(tl.sum(((b_k * 0.0) != 0.0).to(tl.int32), 2), 0)
            tl.store(p_f + o_hc * s_fh + g, (b_bad > 0).to(tl.uint8), mask=o_hc < H_KV)
