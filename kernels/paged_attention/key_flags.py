"""Per-key fault flags of a paged K cache for the long-query path of `paged_attention_kernel`.

One byte per request, KV head and group of GROUP key positions: 1 when a key of the group (a
position < the request's seq_len, behind a valid block id) holds a NaN or inf in any element.
Any such element makes that key's score non-finite for every finite query row, so a row block
whose interior tiles (keys every one of its rows attends, kernel.py) cover a flagged group is
NaN whole, and the interior loop needs no per-score fault work: it reads the flags of its
interior range once, before the loop. Interior tiles start and end at multiples of BLOCK_N, so
their groups are whole. Masked tiles keep their per-score check (kernels/softmax.py).

The pass reads K once (16.8 MB of bf16 K for 8192 keys x 8 heads x 128; not timed on its own:
the measured prefill times include it), against the per-score fma it replaces in every row
block's loop (docs/notes/paged_attention.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

GROUP = 16  # key positions a flag covers (BLOCK_N is a multiple of it)
GROUPS_A_STEP = 4  # groups one step of a program reads: 64 keys x D


@triton.jit
def key_flags_kernel(
    k_ptr, bt_ptr, lens_ptr, flags_ptr, NUM_BLOCKS, KV_CAP, NPROG,
    s_kb, s_kt, s_kh, s_bt, s_fr, s_fh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    GROUP_: tl.constexpr, GROUPS: tl.constexpr,
):
    """flags[r, h, g] for groups g < cdiv(min(seq_len_r, KV_CAP), GROUP_) of request r = program
    0 and KV head h = program 1; program 2 of NPROG takes every NPROG-th step of GROUPS groups.
    Groups past the request's keys are not written (the kernel never reads them)."""
    i_r = tl.program_id(0)
    i_h = tl.program_id(1)
    i_p = tl.program_id(2)
    seq_len = tl.minimum(tl.load(lens_ptr + i_r), KV_CAP)
    n_groups = tl.cdiv(tl.maximum(seq_len, 0), GROUP_)
    o_j = tl.arange(0, GROUPS * GROUP_)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    p_bt = bt_ptr + i_r.to(tl.int64) * s_bt
    p_k = k_ptr + i_h * s_kh
    p_f = flags_ptr + i_r.to(tl.int64) * s_fr + i_h * s_fh
    for g0 in range(i_p * GROUPS, n_groups, NPROG * GROUPS):
        o_pos = g0 * GROUP_ + o_j
        m_pos = o_pos < seq_len
        b_blk = tl.load(p_bt + o_pos // PAGE_SIZE, mask=m_pos, other=0).to(tl.int64)
        # an invalid block id is never read (the kernel sends its range to the masked loop)
        m_pos = m_pos & (b_blk >= 0) & (b_blk < NUM_BLOCKS)
        o_row = b_blk * s_kb + (o_pos % PAGE_SIZE) * s_kt
        b_k = tl.load(p_k + o_row[:, None] + o_d[None, :], mask=m_pos[:, None] & m_d[None, :],
                      other=0.0).to(tl.float32)
        # x * 0 is NaN exactly for a NaN or inf x
        b_bad = tl.sum(((b_k * 0.0) != 0.0).to(tl.int32), 1)
        b_bad = tl.sum(tl.reshape(b_bad, [GROUPS, GROUP_]), 1)
        o_g = g0 + tl.arange(0, GROUPS)
        tl.store(p_f + o_g, (b_bad > 0).to(tl.uint8), mask=o_g < n_groups)
