"""What the indexer's logits kernels share: the query block and one key tile's weighted ReLU sum.

A query block is QR query rows x HP heads (HP = H padded to a power of two) flattened into the
QR * HP rows of one dot, so a tile of keys is loaded once for every head and row that sees it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.kernels.device import Arch
from openmla.quant.e4m3 import e4m3_to_f16


def fp8_dot(arch: Arch) -> bool:
    """The dot takes the e4m3fn bytes as they are (NVIDIA sm_89+ tensor cores; gfx950, whose fp8
    mfma is OCP e4m3fn, where gfx942's is the fnuz variant); elsewhere, and in the interpreter,
    both operands are widened to fp16 first (exact: every e4m3fn value is an fp16 value, and
    the products are summed in fp32 either way)."""
    if arch.backend == "cuda":
        return arch.arch >= 89
    return arch.backend == "hip" and arch.arch == "gfx950"


def operand_view(t: torch.Tensor, fp8: bool) -> torch.Tensor:
    """e4m3fn bytes (float8_e4m3fn or uint8) as the kernels take them: float8_e4m3fn for the fp8
    dot, uint8 otherwise (NVIDIA before sm_89 has no fp8 pointer type in Triton 3.6)."""
    return t.view(torch.float8_e4m3fn if fp8 else torch.uint8)


@triton.jit
def as_dot_operand(b, FP8_DOT: tl.constexpr, E4M3: tl.constexpr):
    """What a load of q or k gives -> the dtype the dot takes. With FP8_DOT the tensors arrive as
    float8e4nv pointers and the loaded tile goes to the dot untouched (so the load can be
    pipelined straight into shared memory); otherwise they arrive as uint8 bytes, widened here."""
    if FP8_DOT:
        y = b
    else:
        y = e4m3_to_f16(b, E4M3)
    return y


@triton.jit
def load_query_block(q_ptr, w_ptr, o_row, m_row, stride_qr, stride_qh, stride_wr, H,
                     QR: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                     FP8_DOT: tl.constexpr, E4M3: tl.constexpr):
    """Rows o_row [QR] (int64 row numbers; m_row masks rows that do not exist) of q [*, H, D]
    (e4m3fn: fp8 or uint8 pointer, see as_dot_operand) and of the folded weights [*, H] fp32.

    Returns (b_q [QR * HP, D] dot operand, b_w [QR * HP] fp32: 0 for padded heads and rows)."""
    o_h = tl.arange(0, HP)
    o_d = tl.arange(0, D)
    m_qh = m_row[:, None] & (o_h[None, :] < H)  # [QR, HP]
    p_q = q_ptr + o_row[:, None, None] * stride_qr + o_h[None, :, None] * stride_qh + o_d[None, None, :]
    b_q = tl.load(p_q, mask=m_qh[:, :, None], other=0.0)
    b_q = tl.reshape(b_q, (QR * HP, D))
    b_w = tl.load(w_ptr + o_row[:, None] * stride_wr + o_h[None, :], mask=m_qh, other=0.0)
    return as_dot_operand(b_q, FP8_DOT, E4M3), tl.reshape(b_w.to(tl.float32), (QR * HP,))


@triton.jit
def weighted_relu_logits(b_q, b_w, b_k, b_scale, QR: tl.constexpr, HP: tl.constexpr,
                         BLOCK_N: tl.constexpr, ACC_STEP: tl.constexpr):
    """logit[r, n] = scale[n] * sum_h w[r, h] * relu(q[r, h] . k[n]) for one tile.

    b_q [QR * HP, D], b_k [BLOCK_N, D] dot operands; b_w [QR * HP] fp32; b_scale [BLOCK_N] fp32.
    Returns [QR, BLOCK_N] fp32. NaN in a product stays NaN through the ReLU (a fault stays
    visible, as torch.relu keeps it).

    Keys are the dot's rows and heads its columns: the head sum then runs along the
    accumulator's columns, which an MMA layout keeps inside a warp (shuffles), where a sum over
    its rows would cross warps through shared memory every tile."""
    # [BLOCK_N, QR * HP] in fp32. sm_90's fp8 MMA keeps its running sum at reduced precision
    # (about 14 mantissa bits); with ACC_STEP None Triton lets it run over the whole K = 128,
    # as DeepGEMM's logits kernels do (both callers). ACC_STEP = 32 adds each 32-deep MMA step into an
    # fp32 accumulator instead (3 FADDs per accumulator register a tile), so a logit is off by at
    # most about 2^-9 of sum_h |w_h| sum_d |q_hd k_d| * scale, where the whole K allows 4x that.
    # (0 would drop wgmma for mma.sync.) Other dot types ignore it.
    s = tl.dot(b_k, tl.trans(b_q), max_num_imprecise_acc=ACC_STEP)
    s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * b_w[None, :]
    s = tl.sum(tl.reshape(s, (BLOCK_N, QR, HP)), axis=2) * b_scale[:, None]
    return tl.trans(s)
