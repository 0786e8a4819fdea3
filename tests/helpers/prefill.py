"""Sparse prefill cases (tests/kernels/test_sparse_mla_prefill*.py): adversarial inputs for
kernels.sparse_mla_prefill at both row widths, and the check against the fp32 oracle.

Inputs: every kv row that no valid index selects is NaN (so any read of an invalid or unused row
shows), invalid indices of every kind, duplicate indices, a row with no valid index, topk_length
below 0 / 0 / above topk, sinks with a -inf head. Data scale: q ~ N(0, 1), kv ~ N(0, 1) / 10, as in
FlashMLA's prefill tests. The kernel, like FlashMLA and FlashAttention, feeds the softmax weights
to the value dot as bf16 (relative error up to 2^-9 per weight), so the absolute error of out
scales with |v|; with unit-variance values and a few dominant keys it would exceed 8e-4 on
near-zero outputs. The scale does not hide wrong indexing, masking or softmax bookkeeping, which
all show as O(1) relative errors.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

import torch

from openmla.kernels.reference import sparse_mla_ref
from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
from tests.helpers import DEVICE, assert_close, invalid_indices

D_V = 512


@dataclass(frozen=True)
class Case:
    T: int
    H: int
    topk: int
    N: int = 400
    invalid: float = 0.0  # fraction of indices replaced by invalid values (every kind cycles)
    lengths: bool = False  # topk_length with 0, negative, > topk and random values
    sink: bool = False
    scale: Optional[float] = None  # None: d_qk ** -0.5
    row_stride: Optional[int] = None  # kv row stride in elements (> d_qk: a strided view)
    q_heads_stride: int = 0  # extra heads in q's backing buffer (q a strided view), 0: contiguous
    d_qk: int = 576  # 576 (V3.2) or 512 (V4 / MODEL1: the value is the whole row)

    @property
    def softmax_scale(self) -> float:
        return self.d_qk ** -0.5 if self.scale is None else self.scale


def build(c: Case, seed: int) -> dict:
    """The op's arguments for case c (on DEVICE): q, kv, indices, topk_length, attn_sink."""
    g = torch.Generator().manual_seed(seed)
    backing = torch.full((c.N, c.row_stride or c.d_qk), float("nan"), dtype=torch.bfloat16)
    kv = backing[:, :c.d_qk]
    idx = torch.randint(0, c.N, (c.T, c.topk), generator=g, dtype=torch.int32)  # duplicates too
    if c.invalid:
        bad = torch.tensor(invalid_indices(c.N), dtype=torch.int32)
        which = torch.rand(c.T, c.topk, generator=g) < c.invalid
        kinds = torch.arange(c.T * c.topk).view(c.T, c.topk) % len(bad)
        idx = torch.where(which, bad[kinds], idx)
        if c.T > 1:
            idx[-1] = bad[torch.arange(c.topk) % len(bad)]  # a row with no valid index at all
    used = idx[(idx >= 0) & (idx < c.N)].long().unique()
    kv[used] = (torch.randn(used.numel(), c.d_qk, generator=g) / 10).to(torch.bfloat16)
    q_full = torch.randn(c.T, c.H + c.q_heads_stride, c.d_qk, generator=g).to(torch.bfloat16)
    q = q_full[:, :c.H]
    topk_length = None
    if c.lengths:
        topk_length = torch.randint(-2, c.topk + 3, (c.T,), generator=g, dtype=torch.int32)
        topk_length[0] = 0
        if c.T > 2:
            topk_length[1] = c.topk + 5
    attn_sink = None
    if c.sink:
        attn_sink = torch.randn(c.H, generator=g) * 2
        attn_sink[0] = float("-inf")  # a head whose sink takes nothing
    args = dict(q=q, kv=kv, indices=idx, topk_length=topk_length, attn_sink=attn_sink)
    return {k: (v.to(DEVICE) if v is not None else None) for k, v in args.items()}


def check(c: Case, request, a: Optional[dict] = None):
    """Run the op on a (default: build(c) seeded by the test's name) and compare it with the
    oracle: out within "sparse_prefill", max_logits and lse within "lse". Returns
    (out, max_logits, lse)."""
    if a is None:
        a = build(c, zlib.crc32(request.node.name.encode()))
    scale = c.softmax_scale
    out, lse, max_logits = sparse_mla_prefill(a["q"], a["kv"], a["indices"], scale=scale,
                                              topk_length=a["topk_length"], attn_sink=a["attn_sink"])
    want_out, want_ml, want_lse = sparse_mla_ref(a["q"], a["kv"], a["indices"], scale=scale,
                                                 topk_length=a["topk_length"],
                                                 attn_sink=a["attn_sink"], d_v=D_V)
    assert out.dtype == torch.bfloat16 and out.shape == (c.T, c.H, D_V)
    assert_close("out", out.float(), want_out, "sparse_prefill")
    assert_close("max_logits", max_logits, want_ml, "lse")
    assert_close("lse", lse, want_lse, "lse")
    return out, max_logits, lse
