"""Per-request token indices -> global cache slots (or prefill-workspace rows) for sparse MLA.

The indexer of a DeepSeek-V3.2 layer picks, for each query token, top-k positions *within its
request*. The decode kernel wants global slots of the paged cache; the prefill kernel wants rows
of the bf16 workspace that a chunk of prefill requests was gathered into. This op does both in one
pass over the indices, any topk, no host sync.

Request isolation (DESIGN.md): given the requests' lengths (`seq_lens`), a position at or past
its own request's length is invalid (-1) on both paths, like a negative one: the indexer's
positions live in [0, seq_len) of their request, and a position outside it must never become a
slot of a stale or reused block, nor a workspace row of the next request (the workspace packs
the requests of a chunk back to back). The length is read on the device per token (no host
sync, CUDA-graph capturable: the engine's seq_lens tensor is updated in place between steps).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from openmla.kernels.launch import FastLaunch, next_pow2
from openmla.quant.validate import CheckedCalls, check_same_device, check_tensor, fail, tensor_signature

_INT32_MAX = 2**31 - 1


@triton.jit
def convert_req_index_to_global_kernel(
    req_id_ptr, block_table_ptr, tok_ptr, out_ptr, count_ptr, ws_rid_ptr, ws_start_ptr, len_ptr,
    K, M, R, R_WS, block_size,
    stride_bt, stride_tok, stride_out, cp_size, cp_rank, cp_interleave,
    BLOCK_K: tl.constexpr, HAS_WS: tl.constexpr, COUNT: tl.constexpr, HAS_LEN: tl.constexpr,
    CP: tl.constexpr,
):
    convert_row(tl.program_id(0).to(tl.int64), req_id_ptr, block_table_ptr, tok_ptr, out_ptr,
                count_ptr, ws_rid_ptr, ws_start_ptr, len_ptr, K, M, R, R_WS, block_size,
                stride_bt, stride_tok, stride_out, BLOCK_K, HAS_WS, COUNT, HAS_LEN,
                cp_size, cp_rank, cp_interleave, CP)


@triton.jit
def convert_row(
    i_t, req_id_ptr, block_table_ptr, tok_ptr, out_ptr, count_ptr, ws_rid_ptr, ws_start_ptr, len_ptr,
    K, M, R, R_WS, block_size,
    stride_bt, stride_tok, stride_out,
    BLOCK_K: tl.constexpr, HAS_WS: tl.constexpr, COUNT: tl.constexpr, HAS_LEN: tl.constexpr,
    cp_size=1, cp_rank=0, cp_interleave=1, CP: tl.constexpr = False,
):
    """Token i_t's row (int64): the kernel's work for one program (kernels.head_matmul's layer
    prologue runs it beside the absorption).

    CP (decode context parallelism, mla/cp.py's layout): a position is this rank's when
    (p // cp_interleave) % cp_size == cp_rank and then becomes its local index; the row's own
    positions are converted and written to the front of the output row in their order, every
    other position as -1 behind them, and count_ptr gets how many are in front."""
    req = tl.load(req_id_ptr + i_t).to(tl.int64)
    req_ok = (req >= 0) & (req < R)
    if HAS_LEN:
        # request isolation: positions at or past the request's length are invalid on both paths
        # (a token of no request has length 0)
        n_len = tl.load(len_ptr + req, mask=req_ok, other=0).to(tl.int64)
    if HAS_WS:
        rid = tl.load(ws_rid_ptr + i_t).to(tl.int64)
        is_pf = rid >= 0
        # A workspace request id past `starts` has no rows: every index of that token is invalid.
        pf_ok = is_pf & (rid < R_WS)
        ws_start = tl.load(ws_start_ptr + rid, mask=pf_ok, other=0).to(tl.int64)
    o_k = tl.arange(0, BLOCK_K)
    count = tl.zeros([BLOCK_K], dtype=tl.int32)
    n_front = tl.full([], 0, tl.int32)
    for k0 in range(0, K, BLOCK_K):
        m_k = (k0 + o_k) < K
        idx = tl.load(tok_ptr + i_t * stride_tok + k0 + o_k, mask=m_k, other=-1).to(tl.int64)
        if CP:
            chunk = tl.where(idx >= 0, idx // cp_interleave, 0)
            mine = m_k & (idx >= 0) & (chunk % cp_size == cp_rank)
            idx = tl.where(mine, (chunk // cp_size) * cp_interleave + (idx - chunk * cp_interleave), -1)
            # destination: the rank's positions to the front in order, the others from the back
            n_mine = n_front + tl.cumsum(mine.to(tl.int32), axis=0)
            dest = tl.where(mine, n_mine - 1, K - (k0 + o_k + 1 - n_mine))
            n_front += tl.sum(mine.to(tl.int32), axis=0)
        else:
            dest = k0 + o_k
        pos = idx >= 0
        if HAS_LEN:
            pos = pos & (idx < n_len)
        blk = tl.where(pos, idx // block_size, 0)
        m_blk = m_k & pos & (blk < M) & req_ok
        entry = tl.load(block_table_ptr + req * stride_bt + blk, mask=m_blk, other=-1).to(tl.int64)
        slot = entry * block_size + (idx - blk * block_size)
        valid = m_blk & (entry >= 0) & (slot <= 2147483647)
        if HAS_WS:
            row = ws_start + idx
            pf_valid = m_k & pos & pf_ok & (row <= 2147483647)
            slot = tl.where(is_pf, row, slot)
            valid = tl.where(is_pf, pf_valid, valid)
        res = tl.where(valid, slot, -1).to(tl.int32)
        tl.store(out_ptr + i_t * stride_out + dest, res, mask=m_k)
        count += valid.to(tl.int32)
    if CP:
        tl.store(count_ptr + i_t, n_front)
    elif COUNT:
        tl.store(count_ptr + i_t, tl.sum(count, axis=0))


_KERNEL = FastLaunch(convert_req_index_to_global_kernel)


def _launch(req_id, block_table, token_indices, block_size, ws_rid, ws_start, seq_lens, out, counts,
            cp=None):
    T, K = token_indices.shape
    block_k = min(1024, next_pow2(max(K, 16)))
    dummy = out  # never dereferenced when the matching constexpr flag is off
    args = (req_id, block_table, token_indices, out,
            counts if counts is not None else dummy,
            ws_rid if ws_rid is not None else dummy,
            ws_start if ws_start is not None else dummy,
            seq_lens if seq_lens is not None else dummy,
            K, block_table.shape[1], block_table.shape[0],
            ws_start.shape[0] if ws_start is not None else 0, block_size,
            block_table.stride(0), token_indices.stride(0), out.stride(0)) + (cp or (1, 0, 1))
    consts = dict(BLOCK_K=block_k, HAS_WS=ws_rid is not None, COUNT=counts is not None,
                  HAS_LEN=seq_lens is not None, CP=cp is not None)
    # every tensor is int32 (checked); with every pointer 16-byte aligned, the int arguments and
    # the flags key the launch
    aligned = (req_id.data_ptr() | block_table.data_ptr() | token_indices.data_ptr() | out.data_ptr()
               | args[4].data_ptr() | args[5].data_ptr() | args[6].data_ptr() | args[7].data_ptr()) & 15 == 0
    if aligned:
        _KERNEL.keyed(args[8:] + (block_k, ws_rid is not None, counts is not None, seq_lens is not None,
                                  cp is not None), (T,), *args, **consts)
    else:
        _KERNEL((T,), *args, **consts)


def convert_req_index_to_global(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    block_size: int,
    *,
    workspace: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    seq_lens: Optional[torch.Tensor] = None,
    return_valid_counts: bool = False,
    out: Optional[torch.Tensor] = None,
    dcp: Optional[Tuple[int, int, int]] = None,
):
    """Convert per-request token indices to global cache slots (DESIGN.md, Index conversion).

    Args:
        req_id: [T] int32, the request row of `block_table` each query token belongs to.
        block_table: [R, M] int32, physical block of each request's logical block; < 0 = unmapped.
        token_indices: [T, K] int32, positions within the token's request; any K >= 1.
        block_size: cache page size in tokens (> 0).
        workspace: optional (request_ids [T] int32, starts [R_prefill] int32) for a prefill chunk:
            tokens with request_ids[t] >= 0 map to workspace rows `starts[request_ids[t]] + idx`
            instead of cache slots; request_ids[t] = -1 marks a decode token (block table path).
        seq_lens: optional [R] int32, each request's length (the block table row's tokens); given,
            an index >= seq_lens[req_id[t]] is invalid on both paths (request isolation: it is
            never turned into a slot of the request's blocks past its tokens, nor into a
            workspace row of the next request). The layer passes it (mla.sparse.impl); without
            it only the block table bounds an index.
        return_valid_counts: also return the number of valid outputs per token.
        out: optional [T, K] int32 (last dim contiguous) to write into, on token_indices' device.
        dcp: optional (world_size, rank, interleave) of decode context parallelism (mla/cp.py):
            the cache and block table hold only this rank's tokens, by local index. A position p
            is this rank's when (p // interleave) % world_size == rank; it becomes its local
            index (p // (world_size * interleave)) * interleave + p % interleave, which is then
            bounded by seq_lens (the rank's local lengths) and converted as above. Each row's
            own positions are written to the front of its output row in their order, -1 behind
            them; returns (out, lengths [T] int32: how many each row has in front, the decode
            kernel's topk_length). Not with workspace or return_valid_counts.

    Returns:
        out: [T, K] int32 (the given `out`, or a new tensor). -1 where idx < 0, idx >= seq_lens[req_id] (when given),
            idx // block_size >= M, the block table entry is < 0, req_id is outside [0, R), or
            the result would not fit int32; otherwise
            block_table[req_id, idx // block_size] * block_size + idx % block_size (or the workspace row).
        counts: [T] int32 valid outputs per token, when return_valid_counts.
    """
    sig = None
    if workspace is None and type(block_size) is int and type(return_valid_counts) is bool:
        try:
            sig = (tensor_signature(req_id), tensor_signature(block_table),
                   tensor_signature(token_indices), tensor_signature(seq_lens), block_size,
                   return_valid_counts, tensor_signature(out), dcp)
            checked = sig in _CHECKED
        except (AttributeError, TypeError):
            sig, checked = None, False
        if checked:  # this signature passed the checks below
            return _convert(req_id, block_table, token_indices, block_size, None, None, seq_lens,
                            return_valid_counts, out, dcp)
    check_tensor("req_id", req_id, dtype=torch.int32, ndim=1)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    check_tensor("token_indices", token_indices, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    T, K = token_indices.shape
    if req_id.shape[0] != T:
        fail("req_id.shape", f"({T},) to match token_indices.shape[0]", tuple(req_id.shape))
    if K < 1:
        fail("token_indices.shape[1]", ">= 1", K)
    if not isinstance(block_size, int) or block_size < 1:
        fail("block_size", "a positive int", block_size)
    ws_rid = ws_start = None
    if workspace is not None:
        if not (isinstance(workspace, (tuple, list)) and len(workspace) == 2):
            fail("workspace", "a (request_ids, starts) pair", type(workspace).__name__)
        ws_rid, ws_start = workspace
        check_tensor("workspace.request_ids", ws_rid, dtype=torch.int32, shape=(T,))
        check_tensor("workspace.starts", ws_start, dtype=torch.int32, ndim=1, contiguous=True)
    if seq_lens is not None:
        check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(block_table.shape[0],), contiguous=True)
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(T, K), last_dim_contiguous=True)
    check_same_device(token_indices=token_indices, req_id=req_id, block_table=block_table,
                      seq_lens=seq_lens, out=out,
                      **{"workspace.request_ids": ws_rid, "workspace.starts": ws_start})
    if dcp is not None:
        _check_dcp(dcp, workspace, return_valid_counts)
    if sig is not None:
        _CHECKED.remember(sig)
    return _convert(req_id, block_table, token_indices, block_size, ws_rid, ws_start, seq_lens,
                    return_valid_counts, out, dcp)


def _check_dcp(dcp, workspace, return_valid_counts) -> None:
    if not (type(dcp) is tuple and len(dcp) == 3 and all(type(v) is int for v in dcp)):
        fail("dcp", "a (world_size, rank, interleave) tuple of ints", repr(dcp))
    n, rank, inter = dcp
    if not (n >= 1 and 0 <= rank < n and inter >= 1 and n * inter <= _INT32_MAX):
        fail("dcp", "world_size >= 1, 0 <= rank < world_size, interleave >= 1", repr(dcp))
    if workspace is not None or return_valid_counts:
        raise NotImplementedError("convert_req_index_to_global(dcp=...) with a prefill workspace or "
                                  "return_valid_counts (decode context parallelism is decode-only)")


# call signatures (no workspace) that passed convert_req_index_to_global's checks
_CHECKED = CheckedCalls()


def convert_checked(req_id, block_table, token_indices, block_size, seq_lens, out) -> None:
    """convert_req_index_to_global(..., seq_lens=seq_lens, out=out) without its checks, for a
    caller whose arguments have the types, shapes, strides and device of arguments that passed
    them (mla.sparse.impl: a decode step's later layers; req_id contiguous)."""
    if token_indices.shape[0] > 0:
        _launch(req_id, block_table, token_indices, block_size, None, None, seq_lens, out, None)


def _convert(req_id, block_table, token_indices, block_size, ws_rid, ws_start, seq_lens,
             return_valid_counts, out=None, dcp=None):
    T, K = token_indices.shape
    if out is None:
        out = torch.empty((T, K), dtype=torch.int32, device=token_indices.device)
    counts = torch.empty(T, dtype=torch.int32, device=out.device) \
        if return_valid_counts or dcp is not None else None
    if T > 0:
        _launch(req_id.contiguous(), block_table, token_indices, block_size,
                None if ws_rid is None else ws_rid.contiguous(), ws_start, seq_lens, out, counts, dcp)
    return (out, counts) if counts is not None else out
