"""The last round of a prefill grid, split: which programs are split (`tail_split`) and the merge of
their pieces (`merge_tail`).

A program of the Gluon prefill kernels (sm90.py: 64 heads; sm90_kn.py: 16 or 32 heads, keys on M)
owns one token's head block and walks its whole index list in 64-key blocks, one program an SM (the
Triton kernel, op.py: S below counts the programs that run at once, its slots). A grid of P
programs on S SMs ends with a round of P mod S programs while the other SMs idle: a grid
smaller than S (a short prefill: 16 tokens x 64 heads take 16 SMs) is all last round, and a grid of
two or three rounds waits for its last one as long as for the others (over many rounds the programs'
ends drift apart and the last round fills in). There each of the last r programs becomes `splits`
pieces (at most S // r, each of at least MIN_PIECE_BLOCKS blocks of its list) where the cost model
below predicts a gain; a piece writes its rows normalized over its own keys in fp32 with their lse
and max_logits (no sink), and `merge_tail` folds the pieces of a program into out, lse and
max_logits (sink applied there).

Piece j of `splits` owns blocks [j * n_blk // splits, (j + 1) * n_blk // splits) of its token's
n_blk = cdiv(min(topk_length, topk), PIECE_N) blocks: every piece gets n_blk // splits or one more
(an empty piece, only where topk_length cuts the list short, reports lse -inf and is ignored).
The Triton kernel takes the same split (its BLOCK_N, 32 or 64, divides PIECE_N).
Measured: docs/notes/sparse_mla_prefill.md ("The last round, split").
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from openmla.kernels.merge import fold_parts, merge_finish, parts_tile
from openmla.kernels.softmax import sink_factor

PIECE_N = 64  # keys of the pieces' unit (a Gluon kernel's block; two or one of the Triton kernel's)
MIN_PIECE_BLOCKS = 2  # blocks of PIECE_N keys a piece walks at least
# Split only grids of fewer rounds: past them the programs' ends drift apart and the last round
# fills in by itself (docs/notes/sparse_mla_prefill.md, "The last round, split").
MAX_ROUNDS = 3
# The cost model of a split (`predicted_gain`; where its values come from: same notes section): a
# 64-key block of a program of block_h heads takes BLOCK_US[kernel][block_h] microseconds in a loaded
# round ("gluon": sm90.py at 64 heads, sm90_kn.py at 16 / 32; "triton": op.py's kernel); a split
# costs PIECES_US[0] (the merge's launch and wait) plus PIECES_US[1] a piece per 64 heads of its
# block (its fp32 rows written, then read by the merge).
BLOCK_US = {"gluon": {64: 2.0, 32: 2.0, 16: 1.4}, "triton": {64: 4.5, 32: 4.3, 16: 3.0}}
PIECES_US = (5.0, 0.13)


def predicted_gain(blocks: int, programs_split: int, splits: int, block_h: int = 64,
                   kernel: str = "gluon") -> float:
    """Microseconds the model expects a split of `programs_split` last-round programs of block_h
    heads into `splits` pieces each to save: the blocks no longer walked by the round, less the
    pieces' cost."""
    saved = blocks - -(-blocks // splits)
    return saved * BLOCK_US[kernel][block_h] - (PIECES_US[0] + PIECES_US[1] * block_h / 64 * programs_split * splits)


@functools.lru_cache(maxsize=1024)
def tail_split(programs: int, slots: int, blocks: int, block_h: int = 64, kernel: str = "gluon") -> tuple[int, int]:
    """(p_main, splits): programs p_main.. of the grid are split into `splits` pieces each (the
    grid has p_main + (programs - p_main) * splits programs); splits = 1: none is. slots: the
    programs that run at once (SMs x programs an SM); `blocks`: the 64-key blocks of a full index
    list (cdiv(topk, 64)); block_h and kernel: the programs' head block and kernel (BLOCK_US). The
    split count is the one of the largest positive `predicted_gain`, if any."""
    r = programs % slots
    best, gain = 1, 0.0
    if r and programs < MAX_ROUNDS * slots:
        for s in range(2, min(slots // r, blocks // MIN_PIECE_BLOCKS) + 1):
            g = predicted_gain(blocks, r, s, block_h, kernel)
            if g > gain:
                best, gain = s, g
    return (programs - r, best) if best > 1 else (programs, 1)


def tail_workspace(programs: int, p_main: int, splits: int, block_h: int, dv: int, dummy: torch.Tensor):
    """The grid of a split (p_main + pieces programs) and the pieces' workspace: rows ws_o [pieces,
    block_h, dv] fp32, ws_lse and ws_ml [pieces, block_h]; without pieces the three are `dummy`
    (the kernel never touches them)."""
    pieces = (programs - p_main) * splits  # 0 without a split (p_main = programs)
    if not pieces:
        return programs, dummy, dummy, dummy
    dev = dummy.device
    return (p_main + pieces, torch.empty((pieces, block_h, dv), dtype=torch.float32, device=dev),
            *(torch.empty((pieces, block_h), dtype=torch.float32, device=dev) for _ in range(2)))


@triton.jit
def merge_tail_kernel(
    po_ptr, plse_ptr, pml_ptr, sink_ptr, out_ptr, lse_ptr, ml_ptr,
    H, NUM_HB, P_MAIN, SPLITS, stride_ot, stride_oh,
    HAS_SINK: tl.constexpr, HB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
    DV: tl.constexpr,
):
    """Program (k, c): heads c * BLOCK_H.. of split program P_MAIN + k (token, head block of HB
    heads), from its SPLITS pieces (po [pieces, HB, DV] fp32, plse / pml [pieces, HB]), BLOCK_S
    pieces a step (kernels.merge.fold_parts)."""
    k = tl.program_id(0)
    i_p = P_MAIN + k
    i_t = (i_p // NUM_HB).to(tl.int64)
    o_hl = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # heads within the program's block
    o_h = (i_p % NUM_HB) * HB + o_hl
    m_h = o_h < H
    o_d = tl.arange(0, DV)
    acc, m_i, l_i = fold_parts(po_ptr, plse_ptr, k * SPLITS, SPLITS, HB, o_hl, m_h, BLOCK_S, BLOCK_H, DV)
    o_s = tl.arange(0, BLOCK_S)
    m_x = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):  # max_logits: the pieces' largest
        o_row = (k * SPLITS + (o_s + s0))[:, None] * HB + o_hl[None, :]
        m_x = tl.maximum(m_x, tl.max(tl.load(pml_ptr + o_row, mask=((o_s + s0) < SPLITS)[:, None] & m_h[None, :],
                                             other=float("-inf")), 0))
    b_o, b_lse = merge_finish(acc, m_i, l_i)
    if HAS_SINK:
        b_o = b_o * sink_factor(sink_ptr, o_h, m_h, b_lse)[:, None]
    tl.store(out_ptr + i_t * stride_ot + o_h[:, None] * stride_oh + o_d[None, :],
             b_o.to(out_ptr.dtype.element_ty), mask=m_h[:, None])
    tl.store(lse_ptr + i_t * H + o_h, b_lse, mask=m_h)
    # max_logits NaN where the merged lse is (a piece's fault), as the unsplit kernels report it
    tl.store(ml_ptr + i_t * H + o_h, tl.where(b_lse != b_lse, b_lse, m_x), mask=m_h)


def merge_tail(po: torch.Tensor, plse: torch.Tensor, pml: torch.Tensor, attn_sink, out: torch.Tensor,
               lse: torch.Tensor, max_logits: torch.Tensor, p_main: int, splits: int, num_hb: int,
               num_sms: int) -> None:
    """Fold the pieces of programs p_main.. (po [pieces, HB, DV], plse / pml [pieces, HB], pieces =
    programs split x splits, each program's pieces in a row) into out [T, H, DV] bf16, lse and
    max_logits [T, H] (contiguous)."""
    n_prog = po.shape[0] // splits
    H, HB, DV = out.shape[1], po.shape[1], po.shape[2]
    block_s, block_h, _ = parts_tile(n_prog, HB, DV, splits, num_sms)
    merge_tail_kernel[(n_prog, triton.cdiv(HB, block_h))](
        po, plse, pml, attn_sink if attn_sink is not None else plse, out, lse, max_logits,
        H, num_hb, p_main, splits, out.stride(0), out.stride(1),
        HAS_SINK=attn_sink is not None, HB=HB, BLOCK_S=block_s, BLOCK_H=block_h, DV=DV,
    )
