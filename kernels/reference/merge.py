"""fp32 oracles of merging partial attention results and of the per-request index conversion.

Conventions: kernels/reference/__init__.py."""
from __future__ import annotations

import torch

from openmla.quant.validate import check_tensor
from openmla.kernels.reference._common import _FLOATS, _NEG_INF, _nan_faults
from openmla.kernels.reference.sparse import head_matmul_ref

def merge_attn_states_ref(a_out, a_lse, b_out, b_lse):
    """Merge two partial attention results over disjoint key sets.

    Args:
        a_out, b_out: [T, H, D] any float dtype, each normalized over its own keys.
        a_lse, b_lse: [T, H] natural-log denominators of a and b. +inf or -inf means that part
            is empty (FlashAttention reports +inf for an empty split): it is ignored, whatever its
            out holds (NaN included).

    Returns (out [T, H, D] fp32, lse [T, H] fp32):
        lse = log(exp(a_lse) + exp(b_lse)),
        out = exp(a_lse - lse) * a_out + exp(b_lse - lse) * b_out;
        both empty -> out 0, lse -inf. A non-empty part with a NaN lse or a NaN or inf in its
        out makes the row's out and lse NaN; otherwise never NaN.
    """
    check_tensor("a_out", a_out, dtype=_FLOATS, ndim=3)
    check_tensor("b_out", b_out, dtype=_FLOATS, shape=tuple(a_out.shape), device=a_out.device)
    check_tensor("a_lse", a_lse, dtype=_FLOATS, shape=tuple(a_out.shape[:2]), device=a_out.device)
    check_tensor("b_lse", b_lse, dtype=_FLOATS, shape=tuple(a_out.shape[:2]), device=a_out.device)
    la, lb = a_lse.double(), b_lse.double()
    a_empty, b_empty = torch.isinf(la), torch.isinf(lb)
    la = la.masked_fill(a_empty, _NEG_INF)
    lb = lb.masked_fill(b_empty, _NEG_INF)
    lse = torch.logaddexp(la, lb)
    ref = lse.masked_fill(lse == _NEG_INF, 0.0)
    wa = torch.exp(la - ref).unsqueeze(-1)
    wb = torch.exp(lb - ref).unsqueeze(-1)
    out = (torch.where(a_empty.unsqueeze(-1), 0.0, wa * a_out.double())
           + torch.where(b_empty.unsqueeze(-1), 0.0, wb * b_out.double()))
    bad = ((~a_empty & (torch.isnan(la) | ~torch.isfinite(a_out).all(-1)))
           | (~b_empty & (torch.isnan(lb) | ~torch.isfinite(b_out).all(-1))))
    out, lse = out.float(), lse.float()
    _nan_faults(bad, out, lse)
    return out, lse


def merge_project_ref(po, plse, w):
    """A split decode's partials merged, then projected per head (kernels.merge_project).

    po: [T, S, H, D], plse: [T, S, H] (splits as merge_attn_states_ref's parts, folded one after
    another), w: [H, D, N]. Returns float32 [T, H, N]: the merged latent x [T, H, D] rounded to
    w's dtype (the latent output's rounding), then head_matmul_ref(x, w). A row whose merge is
    NaN (a faulty non-empty split) is NaN; a row of empty splits projects zeros.
    """
    check_tensor("po", po, dtype=_FLOATS, ndim=4)
    T, S, H, D = po.shape
    check_tensor("plse", plse, dtype=_FLOATS, shape=(T, S, H), device=po.device)
    check_tensor("w", w, dtype=_FLOATS, shape=(H, D, None))
    x = torch.zeros(T, H, D, dtype=torch.float32, device=po.device)
    lse = torch.full((T, H), _NEG_INF, dtype=torch.float32, device=po.device)
    for s in range(S):
        x, lse = merge_attn_states_ref(x, lse, po[:, s], plse[:, s])
    return head_matmul_ref(x.to(w.dtype), w)



def convert_req_index_ref(req_id, block_table, token_indices, block_size, *, workspace=None,
                          seq_lens=None, dcp=None):
    """Per-request token index -> global slot (DESIGN.md, Index conversion), vectorized torch.

    req_id [T], block_table [R, M], token_indices [T, K], block_size > 0; workspace optional
    (request_ids [T], -1 for decode tokens; starts [R_prefill]); seq_lens optional [R]. Returns
    int32 [T, K]: -1 where idx < 0, idx >= seq_lens[req] (when given, on both paths; a req_id
    outside [0, R) has length 0 then), idx // block_size >= M, req_id outside [0, R), the block
    table entry < 0, or the result exceeds int32; else block_table[req, idx // bs] * bs + idx % bs,
    or for a token with request_ids[t] >= 0: starts[request_ids[t]] + idx (-1 if idx < 0 or the
    id >= R_prefill).
    dcp = (world_size n, rank, interleave i): positions p with (p // i) % n == rank become local
    indices (p // (n * i)) * i + p % i, the others -1; each row's local ones, converted as above,
    go to the front in their order, -1 after them. Returns (out, lengths [T]) then.
    """
    if dcp is not None:
        n, rank, i = dcp
        p = token_indices.long()
        mine = (p >= 0) & ((p // i) % n == rank)
        local = torch.where(mine, (p // (n * i)) * i + p % i, -1)
        conv = convert_req_index_ref(req_id, block_table, local.to(torch.int32), block_size,
                                     seq_lens=seq_lens)
        order = torch.argsort((~mine).to(torch.int8), dim=1, stable=True)  # own ones first
        front = torch.where(torch.gather(mine, 1, order), torch.gather(conv, 1, order), -1)
        return front.to(torch.int32), mine.sum(1).to(torch.int32)
    idx = token_indices.long()
    R, M = block_table.shape
    req = req_id.long()[:, None].expand_as(idx)
    if seq_lens is not None:
        in_req = (req >= 0) & (req < R)
        n_len = torch.where(in_req, seq_lens.long()[req.clamp(0, max(R - 1, 0))] if R else 0, 0)
        idx = torch.where(idx < n_len, idx, -1)  # past its request: invalid like a negative index
    blk = torch.where(idx >= 0, idx // block_size, 0)
    ok = (idx >= 0) & (blk < M) & (req >= 0) & (req < R)
    entry = block_table.long()[req.clamp(0, max(R - 1, 0)), blk.clamp(0, max(M - 1, 0))] if R * M else \
        torch.full_like(idx, -1)
    slot = entry * block_size + idx % block_size
    ok &= (entry >= 0) & (slot <= 2**31 - 1)
    out = torch.where(ok, slot, -1)
    if workspace is not None:
        rid, starts = workspace[0].long()[:, None].expand_as(idx), workspace[1].long()
        pf = rid >= 0
        has = pf & (rid < starts.numel())
        row = (starts[rid.clamp(0, max(starts.numel() - 1, 0))] if starts.numel() else torch.zeros_like(idx)) + idx
        pf_out = torch.where(has & (idx >= 0) & (row <= 2**31 - 1), row, -1)
        out = torch.where(pf, pf_out, out)
    return out.to(torch.int32)
