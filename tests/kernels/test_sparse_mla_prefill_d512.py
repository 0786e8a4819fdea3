"""kernels.sparse_mla_prefill with d_qk 512 rows (DeepSeek-V4, FlashMLA's MODEL1) against the fp32
oracle kernels.reference.sparse_mla_ref(d_v=512): the value is the whole row, there is no
score-only rope part.

Two generators:
- tests/helpers/prefill.py (adversarial, as for d_qk 576): every kv row no valid index selects is
  NaN, invalid indices of every kind, duplicates, rows with no valid index, topk_length below 0 /
  0 / above topk, sinks of -inf and finite values, q ~ N(0, 1), kv ~ N(0, 1) / 10.
- `flashmla_inputs`: FlashMLA 9241ae3's prefill generator (tests/lib.py generate_testcase): q and kv
  randn / 10 plus a random offset, unique indices per row padded with its invalid candidates
  when topk > s_kv, sm_scale 0.5, sinks with -inf and +inf heads, topk_length in [0, topk];
  checked within FlashMLA's tolerances (tests/test_flash_mla_sparse_prefill.py).

Tolerances: out "sparse_prefill" (abs 8e-4 or rel 3/128, FlashMLA's), max_logits and lse "lse"
(abs 1e-5); inf and NaN positions exact.
"""
from __future__ import annotations

import re
import zlib

import pytest
import torch

from openmla.kernels.sparse_mla_prefill import op as prefill_op
from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
from tests.helpers import DEVICE, GPU_ONLY, INT32_MAX, INT32_MIN
from tests.helpers.prefill import Case, build, check

D = 512
# FlashMLA's invalid candidates (tests/lib.py), s_kv added per case
FLASHMLA_INVALID = [INT32_MIN, -123456, -1, 114514, 1919810, 2147480000, INT32_MAX]


def flashmla_inputs(c: Case, seed: int) -> dict:
    """FlashMLA's generator (module docstring). c.invalid: the fraction of query rows whose
    indices are all one invalid value (FlashMLA's is_all_indices_invalid); c.row_stride pads rows
    with NaN; c.q_heads_stride is not used."""
    g = torch.Generator().manual_seed(seed)

    def offset():
        return (float(torch.rand((), generator=g)) - 0.5) / 10

    q = (torch.randn(c.T, c.H, D, generator=g) / 10 + offset()).to(torch.bfloat16).clamp(-10, 10)
    rows = (torch.randn(c.N, D, generator=g) / 10 + offset()).to(torch.bfloat16).clamp(-10, 10)
    backing = torch.full((c.N, c.row_stride or D), float("nan"), dtype=torch.bfloat16)
    backing[:, :D] = rows
    # unique indices per row; positions past s_kv get one of the invalid candidates
    perm = torch.rand(c.T, max(c.N, c.topk), generator=g)
    perm[:, c.N:] = float("-inf")
    idx = perm.topk(c.topk, dim=-1).indices.to(torch.int32)
    cands = torch.tensor(FLASHMLA_INVALID + [c.N], dtype=torch.int32)
    fill = cands[torch.randint(0, len(cands), idx.shape, generator=g)]
    idx = torch.where(idx >= c.N, fill, idx)
    if c.invalid:
        dead = torch.rand(c.T, generator=g) < c.invalid
        idx[dead] = cands[int(torch.randint(0, len(cands), (), generator=g))]
    lengths = sink = None
    if c.sink:
        sink = torch.randn(c.H, generator=g)
        pick = torch.randn(c.H, generator=g)
        sink[pick < -0.5] = float("-inf")
        sink[pick > 0.5] = float("inf")
    if c.lengths:
        lengths = torch.randint(0, max(c.topk + 1, 64), (c.T,), generator=g,
                                dtype=torch.int32).clamp_max(c.topk)
    a = dict(q=q, kv=backing[:, :D], indices=idx, topk_length=lengths, attn_sink=sink)
    return {k: (v.to(DEVICE) if v is not None else None) for k, v in a.items()}


def V4(**kw) -> Case:
    """A case with d_qk 512 rows."""
    return Case(d_qk=D, **kw)


# ------------------------------------------------------------------------------------------------
# Regular and irregular shapes: head counts FlashMLA runs (64, 128) and those it cannot
SHAPES = [
    pytest.param(V4(T=3, H=16, topk=64), id="T3-H16-topk64"),
    pytest.param(V4(T=2, H=32, topk=128), id="T2-H32-topk128"),
    pytest.param(V4(T=2, H=64, topk=128), id="T2-H64-topk128"),
    pytest.param(V4(T=2, H=128, topk=64), id="T2-H128-topk64"),
    pytest.param(V4(T=3, H=1, topk=1), id="T3-H1-topk1"),
    pytest.param(V4(T=3, H=5, topk=50), id="T3-H5-topk50"),
    pytest.param(V4(T=2, H=48, topk=77), id="T2-H48-topk77"),
    pytest.param(V4(T=2, H=100, topk=40), id="T2-H100-topk40"),
    pytest.param(V4(T=64, H=64, topk=512, N=32768), id="T64-H64-topk512", marks=GPU_ONLY),
    pytest.param(V4(T=64, H=128, topk=1024, N=32768), id="T64-H128-topk1024", marks=GPU_ONLY),
    pytest.param(V4(T=33, H=8, topk=1000, N=5000), id="T33-H8-topk1000", marks=GPU_ONLY),
    pytest.param(V4(T=33, H=40, topk=777, N=5000), id="T33-H40-topk777", marks=GPU_ONLY),
]


@pytest.mark.parametrize("case", SHAPES)
def test_matches_oracle(case, request):
    check(case, request)


# ------------------------------------------------------------------------------------------------
# Invalid indices, topk_length, sinks, scale and strides
FEATURES = [
    pytest.param(V4(T=4, H=16, topk=50, invalid=0.3), id="T4-H16-topk50-invalid"),
    pytest.param(V4(T=3, H=64, topk=64, invalid=0.5), id="T3-H64-topk64-invalid"),
    pytest.param(V4(T=5, H=16, topk=50, lengths=True), id="T5-H16-topk50-len"),
    pytest.param(V4(T=3, H=5, topk=50, sink=True), id="T3-H5-topk50-sink"),
    pytest.param(V4(T=4, H=32, topk=50, sink=True, lengths=True, invalid=0.3),
                 id="T4-H32-topk50-sink-len-invalid"),
    pytest.param(V4(T=3, H=16, topk=50, scale=-0.05, sink=True, invalid=0.2),
                 id="T3-H16-topk50-negative-scale"),
    pytest.param(V4(T=3, H=16, topk=50, row_stride=520, q_heads_stride=3),
                 id="T3-H16-topk50-kvstride520-qstrided"),
    pytest.param(V4(T=2, H=64, topk=64, row_stride=576, invalid=0.2),
                 id="T2-H64-topk64-kvstride576"),
    pytest.param(V4(T=48, H=128, topk=1024, N=8000, lengths=True, sink=True, invalid=0.2),
                 id="T48-H128-topk1024-sink-len-invalid", marks=GPU_ONLY),
]


@pytest.mark.parametrize("case", FEATURES)
def test_features(case, request):
    out, max_logits, lse = check(case, request)
    if case.invalid and case.T > 1:  # the last row has no valid index
        assert bool((out[-1] == 0).all()) and bool((lse[-1] == float("-inf")).all())
        assert bool((max_logits[-1] == float("-inf")).all())
    if case.lengths:  # row 0 has topk_length 0
        assert bool((out[0] == 0).all()) and bool((lse[0] == float("-inf")).all())


# ------------------------------------------------------------------------------------------------
# FlashMLA's own generator and corner cases (tests/test_flash_mla_sparse_prefill.py, d_qk 512):
# topk > s_kv ("OOB topk"), sinks of +-inf, topk_length, scale 0.5
FLASHMLA = [
    pytest.param(V4(T=2, H=64, topk=128, N=95, scale=0.5), id="s_kv95-topk128-H64"),
    pytest.param(V4(T=2, H=128, topk=128, N=592, scale=0.5), id="s_kv592-topk128-H128"),
    pytest.param(V4(T=3, H=64, topk=128, N=95, scale=0.5, sink=True, lengths=True),
                 id="s_kv95-topk128-H64-sink-len"),
    pytest.param(V4(T=2, H=16, topk=64, N=32, scale=0.5, sink=True, lengths=True),
                 id="s_kv32-topk64-H16-sink-len"),
    pytest.param(V4(T=6, H=64, topk=128, N=128, scale=0.5, sink=True, lengths=True, invalid=0.5),
                 id="s_kv128-topk128-H64-all-invalid-rows-sink-len"),
    pytest.param(V4(T=62, H=128, topk=384, N=114, scale=0.5, sink=True, lengths=True),
                 id="s_q62-s_kv114-topk384-H128-sink-len", marks=GPU_ONLY),
    pytest.param(V4(T=213, H=64, topk=512, N=1521, scale=0.5, sink=True,
                      lengths=True), id="s_q213-s_kv1521-topk512-H64-sink-len", marks=GPU_ONLY),
    pytest.param(V4(T=1024, H=64, topk=2048, N=32, scale=0.5, sink=True,
                      lengths=True), id="s_q1024-s_kv32-topk2048-H64-sink-len", marks=GPU_ONLY),
    pytest.param(V4(T=1234, H=128, topk=4096, N=4321, scale=0.5, sink=True, lengths=True,
                    invalid=0.03), id="s_q1234-s_kv4321-topk4096-H128-all-invalid-rows",
                 marks=GPU_ONLY),
]


@pytest.mark.parametrize("case", FLASHMLA)
def test_flashmla_generator(case, request):
    check(case, request, flashmla_inputs(case, zlib.crc32(request.node.name.encode())))


# ------------------------------------------------------------------------------------------------
# Faults stay visible: a NaN or inf in q or in a row a query attends makes that query NaN; a NaN
# past topk_length or in an unselected row does not reach any output
@pytest.mark.parametrize("where", ["q", "row", "past_length"])
def test_faults(where, request):
    c = V4(T=3, H=16, topk=40, lengths=where == "past_length")
    a = build(c, 7)
    if where == "q":
        a["q"] = a["q"].clone()
        a["q"][1, 3, 100] = float("nan")
    elif where == "row":
        a["kv"][int(a["indices"][2, 5]), 450] = float("inf")  # a rope dim: in the value too
    else:
        a["topk_length"] = torch.tensor([10, 20, 30], dtype=torch.int32, device=DEVICE)
        fresh = torch.arange(a["kv"].shape[0], device=DEVICE)
        spare = fresh[~torch.isin(fresh, a["indices"][:, :30].long())]
        a["indices"] = a["indices"].clone()
        a["indices"][:, 35] = spare[0].to(torch.int32)  # a NaN row, listed past every length
        a["kv"][spare[0]] = float("nan")
    out, max_logits, lse = check(c, request, a)
    if where == "q":
        assert bool(lse[1, 3].isnan()) and bool(out[1, 3].isnan().all())
        assert not bool(lse[0].isnan().any())
    elif where == "row":
        assert bool(lse[2].isnan().all())
    else:
        assert not bool(lse.isnan().any()) and not bool(out.isnan().any())


# ------------------------------------------------------------------------------------------------
# d_qk 512 never takes the Hopper Gluon kernels (they are written for 576): with them declared
# usable and made to fail, a 512 launch still runs (the Triton kernel) and a 576 one reaches them
def test_d512_routes_to_the_triton_kernel(monkeypatch, request):
    def refuse(*args, **kwargs):
        raise RuntimeError("the sm_90 Gluon kernel was launched")

    monkeypatch.setattr(prefill_op._sm90, "usable", lambda q, kv: True)
    monkeypatch.setattr(prefill_op._sm90, "launch", refuse)
    monkeypatch.setattr(prefill_op._kn, "launch", refuse)
    check(V4(T=2, H=20, topk=40, sink=True), request)
    q576 = torch.randn(1, 20, 576, device=DEVICE).to(torch.bfloat16)
    kv576 = torch.randn(10, 576, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="Gluon"):
        sparse_mla_prefill(q576, kv576, torch.zeros(1, 4, dtype=torch.int32, device=DEVICE), scale=0.1)


# ------------------------------------------------------------------------------------------------
# q and kv must agree on d_qk; kv is 512 or 576 wide
BAD = [
    pytest.param(dict(q=torch.zeros(2, 4, 576, dtype=torch.bfloat16)), "q.shape", id="q576-kv512"),
    pytest.param(dict(kv=torch.zeros(10, 576, dtype=torch.bfloat16)), "q.shape", id="q512-kv576"),
    pytest.param(dict(kv=torch.zeros(10, 448, dtype=torch.bfloat16)), "kv.shape", id="kv448"),
    pytest.param(dict(q=torch.zeros(2, 4, 448, dtype=torch.bfloat16),
                      kv=torch.zeros(10, 448, dtype=torch.bfloat16)), "kv.shape", id="both448"),
    pytest.param(dict(out=torch.zeros(2, 4, 448, dtype=torch.bfloat16)), "out.shape", id="out448"),
]


@pytest.mark.parametrize("override,names", BAD)
def test_bad_arguments_raise(override, names):
    a = dict(q=torch.zeros(2, 4, D, dtype=torch.bfloat16), kv=torch.zeros(10, D, dtype=torch.bfloat16),
             indices=torch.zeros(2, 8, dtype=torch.int32), out=None)
    a.update(override)
    with pytest.raises(ValueError, match="^" + re.escape(names)):
        sparse_mla_prefill(a["q"], a["kv"], a["indices"], scale=0.1, out=a["out"])
