"""The conventions every attention op shares (kernels/__init__.py): one softmax-scale rule, one
`out=` rule, results in the order (out, lse[, extras]).

Each op is called through a small adapter on small adversarial inputs (NaN in unused cache rows,
shuffled block tables, strided views: the builders of tests.helpers); the numerics of each op
are tested in its own file.
"""
from __future__ import annotations

import re

import pytest
import torch

from openmla.kernels.cascade import cascade_attention
from openmla.kernels.paged_attention import paged_attention, varlen_attention
from openmla.kernels.sparse_mla_decode import sparse_mla_decode
from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
from tests.helpers import DEVICE, paged_batch


def _sparse_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    T, H, N, topk = 3, 4, 40, 8
    q = torch.randn(T, H, 576, generator=g).bfloat16().to(DEVICE)
    kv = torch.randn(N, 576, generator=g).bfloat16().to(DEVICE)
    idx = torch.randint(0, N, (T, topk), generator=g, dtype=torch.int32)
    idx[0, 1], idx[1, 3] = -1, N  # invalid indices: skipped
    return q, kv, idx.to(DEVICE)


def decode(scale, out=None):
    q, kv, idx = _sparse_inputs(1)
    cache = kv.view(10, 4, 576)  # a bf16 MLA cache of 10 blocks of 4 rows: slot s = row s
    return q, sparse_mla_decode(q, cache, idx, scale=scale, out=out)


def prefill(scale, out=None):
    q, kv, idx = _sparse_inputs(2)
    return q, sparse_mla_prefill(q, kv, idx, scale=scale, out=out)


def _paged():
    return paged_batch([(1, 20), (3, 17)], 4, 2, 32, 8, shared_blocks=1)


def paged(scale, out=None):
    b = _paged()
    return b["q"], paged_attention(**b, scale=scale, out=out, return_lse=True)


def cascade(scale, out=None):
    b = _paged()
    return b["q"], cascade_attention(**b, common_prefix_len=8, scale=scale, out=out,
                                     return_lse=True)


def varlen(scale, out=None):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 32, generator=g).bfloat16().to(DEVICE)
    kv = torch.randn(9, 2, 2, 32, generator=g).bfloat16().to(DEVICE)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    return q, varlen_attention(q, kv[:, 0], kv[:, 1], cu_q, cu_k, scale=scale, out=out,
                               return_lse=True)


OPS = [pytest.param(decode, id="sparse_mla_decode"), pytest.param(prefill, id="sparse_mla_prefill"),
       pytest.param(paged, id="paged_attention"), pytest.param(varlen, id="varlen_attention"),
       pytest.param(cascade, id="cascade_attention")]
D_V = {decode: 512, prefill: 512, paged: 32, varlen: 32, cascade: 32}
Q = {decode: lambda: _sparse_inputs(1)[0], prefill: lambda: _sparse_inputs(2)[0],
     paged: lambda: _paged()["q"], cascade: lambda: _paged()["q"],
     varlen: lambda: torch.empty(5, 4, 32, dtype=torch.bfloat16, device=DEVICE)}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("scale", [0.0, float("nan"), float("inf"), True, "0.1", None,
                                   torch.tensor(0.1)],
                         ids=["zero", "nan", "inf", "bool", "str", "None", "tensor"])
def test_one_scale_rule(op, scale):
    """Every op refuses the same scales with the same message, naming `scale`."""
    with pytest.raises(ValueError, match="^" + re.escape("scale: expected a finite nonzero float")):
        op(scale)


@pytest.mark.parametrize("op", OPS)
def test_out_is_written_and_returned_first(op):
    """A strided out= view is written in place and comes back as the first result, followed by
    lse [T, H] fp32; the values equal those of a call that allocates its own out."""
    q, want = op(0.3)
    T, H = q.shape[0], q.shape[1]
    backing = torch.full((T, H + 1, D_V[op] + 16), float("nan"), dtype=q.dtype, device=DEVICE)
    buf = backing[:, 1:, 8:8 + D_V[op]]
    q, got = op(0.3, out=buf)
    assert got[0] is buf
    assert got[1].shape == (T, H) and got[1].dtype == torch.float32
    assert len(got) == len(want) == (3 if op is prefill else 2)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.isnan(backing[:, 0]).all() and torch.isnan(backing[:, :, :8]).all()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad,name", [
    (lambda q, d: q.new_empty(q.shape[0], q.shape[1], d, dtype=torch.float32), "out.dtype"),
    (lambda q, d: q.new_empty(q.shape[0], q.shape[1] + 1, d), "out.shape"),
    (lambda q, d: q.new_empty(q.shape[0], q.shape[1], d, 2)[..., 0], "out.stride(-1)"),
], ids=["dtype", "shape", "last-dim-strided"])
def test_one_out_rule(op, bad, name):
    """Every op refuses the same bad out= buffers with the same message (nothing is launched)."""
    q = Q[op]()
    with pytest.raises(ValueError, match="^" + re.escape(name)):
        op(0.3, out=bad(q, D_V[op]))
