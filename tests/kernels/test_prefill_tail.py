"""The split last round of the 64-head prefill (kernels/sparse_mla_prefill/tail.py): the rule on the
host, the merge of pieces in the interpreter against the oracle over each piece's keys, the launch
recorded on the CPU, and on Hopper the whole path (forced and natural splits) against the oracle."""
from __future__ import annotations

import zlib

import pytest
import torch

from openmla.kernels.reference import sparse_mla_ref
import contextlib

from openmla.kernels.device import ARCHES, assume
from openmla.kernels.sparse_mla_prefill import op as prefill_op
from openmla.kernels.sparse_mla_prefill import sm90, sm90_kn
from openmla.kernels.sparse_mla_prefill import tail
from openmla.kernels.sparse_mla_prefill.tail import MIN_PIECE_BLOCKS, merge_tail, predicted_gain, tail_split
from openmla.kernels.device import sm90_gluon
from tests.helpers import DEVICE, GPU_ONLY, assert_close
from tests.helpers.prefill import Case, build, check

BLOCK_N = 64  # the 64-head kernel's key block: the pieces' unit


@pytest.mark.parametrize("programs,sms,blocks,block_h,want", [
    (1, 132, 32, 64, (0, 16)),  # one token x 64 heads: 16 pieces of 2 blocks
    (64, 132, 32, 64, (0, 2)),
    (64, 132, 8, 64, (64, 1)),  # 4 blocks saved a program do not pay for 128 pieces
    (133, 132, 32, 64, (132, 16)),
    (4096, 132, 32, 64, (4096, 1)),  # 31 rounds and more: never split
    (132, 132, 32, 64, (132, 1)),  # whole rounds: nothing to fill
    (100, 132, 32, 64, (100, 1)),  # 32 idle SMs: fewer than one piece a program
    (16, 132, 3, 64, (16, 1)),  # 3 blocks: no two pieces of MIN_PIECE_BLOCKS
    # keys-on-M programs (16 / 32 heads): smaller pieces, so more of them pay
    (16, 132, 32, 16, (0, 8)),
    (16, 132, 32, 32, (0, 8)),
    (16, 132, 32, 64, (0, 4)),
    (64, 132, 16, 32, (0, 2)),
    (64, 132, 8, 16, (64, 1)),
])
def test_tail_split_examples(programs, sms, blocks, block_h, want):
    assert tail_split(programs, sms, blocks, block_h) == want


@pytest.mark.parametrize("block_h", [16, 32, 64])
def test_tail_split_fills_the_last_round_only(block_h):
    gain = lambda b, n, s: predicted_gain(b, n, s, block_h)  # noqa: E731
    for sms in (8, 78, 132):
        for blocks in (1, 2, 5, 32, 256):
            for programs in range(1, 4 * sms + 2):
                p_main, splits = tail_split(programs, sms, blocks, block_h)
                r = programs % sms
                if splits == 1:  # not split: whole rounds, too many rounds, or no positive gain
                    assert p_main == programs
                    if r and programs < tail.MAX_ROUNDS * sms:
                        assert all(gain(blocks, r, s) <= 0 for s in range(2, min(sms // r, blocks // 2) + 1))
                    continue
                tail_n = programs - p_main
                assert p_main % sms == 0 and 0 < tail_n < sms and programs < tail.MAX_ROUNDS * sms
                assert tail_n * splits <= sms and splits * MIN_PIECE_BLOCKS <= blocks
                # the best predicted gain, and a positive one
                gains = [gain(blocks, tail_n, s) for s in range(2, min(sms // tail_n, blocks // 2) + 1)]
                assert gain(blocks, tail_n, splits) == max(gains) > 0, (programs, sms, blocks)


def _piece_rows(q, kv, idx, lengths, scale, t, h0, hb, j, splits):
    """The oracle of piece j of token t's head block [h0, h0 + hb): its rows normalized over its
    own keys (blocks [j * n_blk // splits, (j + 1) * n_blk // splits)), lse and max_logits; heads
    past H filled with NaN (a piece computes them on zero q; the merge must not read them)."""
    topk = idx.shape[1]
    n_use = topk if lengths is None else min(max(int(lengths[t]), 0), topk)
    n_blk = -(-n_use // BLOCK_N)
    lo, hi = j * n_blk // splits * BLOCK_N, (j + 1) * n_blk // splits * BLOCK_N
    sub = idx[t:t + 1, lo:max(hi, lo + 1)]
    n = torch.tensor([max(min(n_use, hi) - lo, 0)], dtype=torch.int32)
    heads = slice(h0, min(h0 + hb, q.shape[1]))
    o, ml, lse = sparse_mla_ref(q[t:t + 1, heads], kv, sub, scale=scale, topk_length=n)
    po = torch.full((hb, o.shape[-1]), float("nan"))
    pl = torch.full((hb,), float("nan"))
    pm = torch.full((hb,), float("nan"))
    k = o.shape[1]
    po[:k], pl[:k], pm[:k] = o[0], lse[0], ml[0]
    return po, pl, pm


@pytest.mark.parametrize("H,p_main,splits", [(80, 3, 3), (64, 0, 4), (40, 1, 5)],
                         ids=["H80-tail-3x3", "H64-all-4", "H40-tail-5"])
def test_merge_tail_matches_oracle(H, p_main, splits, request):
    """merge_tail on pieces computed by the oracle (each over its own keys, no sink): the split
    programs' rows equal the oracle over the whole list with the sink, NaN faults included; the
    other programs' rows are not written."""
    hb = 64
    c = Case(T=4, H=H, topk=300, N=3000, invalid=0.2, lengths=True, sink=True)
    a = {k: (v.cpu() if v is not None else None) for k, v in build(c, zlib.crc32(request.node.name.encode())).items()}
    q, kv, idx, lengths, sink = a["q"], a["kv"], a["indices"], a["topk_length"], a["attn_sink"]
    kv = kv.clone()
    kv[int(idx[1][(idx[1] >= 0) & (idx[1] < c.N)][0])] = float("nan")  # token 1 (all counted) selects a NaN row
    scale = c.softmax_scale
    num_hb = -(-H // hb)
    programs = c.T * num_hb
    po, plse, pml = [], [], []
    for i_p in range(p_main, programs):
        t, h0 = i_p // num_hb, i_p % num_hb * hb
        for j in range(splits):
            o, l, m = _piece_rows(q, kv, idx, lengths, scale, t, h0, hb, j, splits)
            po.append(o), plse.append(l), pml.append(m)
    po, plse, pml = (torch.stack(x).to(DEVICE) for x in (po, plse, pml))
    out = torch.full((c.T, H, 512), 7.0, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((c.T, H), 7.0, device=DEVICE)
    ml = torch.full((c.T, H), 7.0, device=DEVICE)
    merge_tail(po, plse, pml, sink.to(DEVICE), out, lse, ml, p_main, splits, num_hb, 8)
    want_out, want_ml, want_lse = sparse_mla_ref(q, kv, idx, scale=scale, topk_length=lengths, attn_sink=sink)
    done = torch.zeros(c.T, H, dtype=torch.bool)
    for i_p in range(p_main, programs):
        done[i_p // num_hb, i_p % num_hb * hb:(i_p % num_hb + 1) * hb] = True
    # split rows of every kind: a fault (token 1), finite rows, an empty row (token 3: no valid index)
    assert bool(want_lse[1].isnan().all()) and bool(want_lse[3].isneginf().all())
    assert bool(want_lse[done].isfinite().any())
    d = done.to(DEVICE)
    assert_close("out", out[d].float(), want_out.to(DEVICE)[d], "sparse_prefill")
    assert_close("lse", lse[d], want_lse.to(DEVICE)[d], "lse")
    assert_close("max_logits", ml[d], want_ml.to(DEVICE)[d], "lse")
    assert bool((out[~d] == 7).all()) and bool((lse[~d] == 7).all()) and bool((ml[~d] == 7).all())


@pytest.mark.skipif(not sm90._GLUON, reason="this Triton has no Gluon: the 64-head sm_90 kernel whose launch this "
                                             "records is not built (the Triton kernel's launch: below)")
def test_sm90_launch_splits_the_last_round(monkeypatch):
    """The launch (recorded: Gluon does not run in the interpreter) grows the grid by the pieces,
    hands the kernel the split and a workspace of a row block per piece, then merges; no split, no
    workspace and no merge. (On the CPU num_sms says 8.)"""
    seen = []

    class _Record:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(dict(grid=grid, **kw))

    merged = []
    monkeypatch.setattr(sm90, "sparse_mla_prefill_sm90_kernel", _Record())
    monkeypatch.setattr(sm90, "merge_tail", lambda *args: merged.append(args))
    for T, topk, want in ((3, 2048, (0, 2)), (8, 2048, (8, 1)), (11, 2048, (8, 2)), (3, 64, (3, 1)),
                          (40, 2048, (40, 1))):
        seen.clear(), merged.clear()
        q, kv = torch.randn(T, 64, 576).bfloat16(), torch.randn(100, 576).bfloat16()
        idx = torch.zeros(T, topk, dtype=torch.int32)
        out, ml, lse = torch.empty(T, 64, 512, dtype=torch.bfloat16), torch.empty(T, 64), torch.empty(T, 64)
        sm90.launch(q, kv, idx, None, None, out, ml, lse, 0.1, 1.4426950408889634, 512, 64)
        p_main, splits = want
        pieces = (T - p_main) * splits if splits > 1 else 0
        k = seen[0]
        assert k["grid"] == (p_main + pieces,) and (k["p_main"], k["splits"]) == want
        if pieces:
            assert k["ws_o"].shape == (pieces, 64, 512) and k["ws_lse"].shape == (pieces, 64)
            assert len(merged) == 1 and merged[0][0] is k["ws_o"] and merged[0][7:9] == (p_main, splits)
        else:
            assert not merged


@pytest.mark.skipif(not sm90_kn._GLUON, reason="this Triton has no Gluon: the keys-on-M sm_90 kernel whose launch this "
                                                "records is not built (the Triton kernel's launch: below)")
@pytest.mark.parametrize("H,T,want,flags", [(16, 3, (0, 2), False), (32, 3, (0, 2), False), (32, 11, (8, 2), True),
                                            (16, 8, (8, 1), False)])
def test_sm90_kn_launch_splits_the_last_round(H, T, want, flags, monkeypatch):
    """The keys-on-M kernel (H <= 32) takes the same split: grid, workspace of its 16- or 32-head
    blocks, the merge; with the fault passes' token states (flags) or without. (num_sms: 8 here.)"""
    seen, merged = [], []

    class _Record:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(dict(grid=grid, **kw))

    monkeypatch.setattr(sm90_kn, "sparse_mla_prefill_sm90_kn_kernel", _Record())
    monkeypatch.setattr(sm90, "merge_tail", lambda *args: merged.append(args))
    # the fault passes are Triton kernels (the CPU tensors here run only in the interpreter); their
    # token states only travel to the kernel
    tok = torch.zeros(T, dtype=torch.uint8)
    monkeypatch.setattr(sm90_kn, "token_faults", lambda *args: tok)
    monkeypatch.setattr(sm90_kn, "kv_row_faults", lambda kv: None)
    topk, hb = 2048, sm90_kn.block_h(H)
    q, kv = torch.randn(T, H, 576).bfloat16(), torch.randn(2000 if flags else 100000, 576).bfloat16()
    idx = torch.randint(0, kv.shape[0], (T, topk), dtype=torch.int32)
    out, ml, lse = torch.empty(T, H, 512, dtype=torch.bfloat16), torch.empty(T, H), torch.empty(T, H)
    sm90_kn.launch(q, kv, idx, None, None, out, ml, lse, 0.1, 1.4426950408889634, 512, 64)
    p_main, splits = want
    pieces = (T - p_main) * splits if splits > 1 else 0
    k = seen[0]
    assert k["grid"] == (p_main + pieces,) and (k["p_main"], k["splits"]) == want and k["FLAGS"] is flags
    assert (k["flag_ptr"] is tok) is flags
    if pieces:
        assert k["ws_o"].shape == (pieces, hb, 512) and k["ws_lse"].shape == (pieces, hb)
        assert len(merged) == 1 and merged[0][0] is k["ws_o"] and merged[0][7:10] == (p_main, splits, 1)
    else:
        assert not merged


# ------------------------------------------------------------------------------------------------
# The portable Triton kernel's pieces (op.py), on every device: in the interpreter on the CPU, as an
# sm_80 runs it on a GPU
TRITON_FORCED = [  # (case, forced (p_main, splits))
    pytest.param(Case(T=4, H=16, topk=300, N=1000, invalid=0.2, lengths=True, sink=True), (1, 3),
                 id="T4-H16-tail-3-len-sink-invalid"),
    pytest.param(Case(T=3, H=40, topk=256, N=500, sink=True), (2, 2), id="T3-H40-tail-2-sink"),
    pytest.param(Case(T=3, H=5, topk=200, N=500, d_qk=512), (0, 4), id="T3-H5-d512-all-4"),
    pytest.param(Case(T=2, H=20, topk=128, N=300, lengths=True), (0, 5), id="T2-H20-more-pieces-than-units"),
]


@pytest.mark.parametrize("case,split", TRITON_FORCED)
def test_triton_split_matches_oracle(case, split, request, monkeypatch):
    calls = []
    monkeypatch.setattr(prefill_op, "tail_split", lambda *args: calls.append(args) or split)
    path = assume(ARCHES["sm_80"]) if DEVICE != "cpu" else contextlib.nullcontext()
    with path:
        check(case, request)
    assert calls and calls[0][-1] == "triton", calls


def _faults_through_pieces(c, request, bad_tok, bad_q, path=contextlib.nullcontext()):
    """Run case c with a NaN kv row that only token bad_tok selects and a NaN at q[bad_q] (token,
    head, dim): against the oracle (check), and exactly those rows NaN."""
    a = build(c, zlib.crc32(request.node.name.encode()))
    idx, kv, q = a["indices"].clone(), a["kv"].clone(), a["q"].clone()
    bad_row = c.N - 1
    idx[idx == bad_row] = 0
    idx[bad_tok, 7] = bad_row
    kv[bad_row] = float("nan")
    q[bad_q] = float("nan")
    a.update(indices=idx, kv=kv, q=q)
    with path:
        out, _, lse = check(c, request, a)
    want = torch.zeros(c.T, c.H, dtype=torch.bool)
    want[bad_tok] = True
    want[bad_q[:2]] = True
    assert torch.equal(lse.isnan().cpu(), want), lse.isnan().nonzero()
    assert bool(out[bad_tok].isnan().all()) and bool(out[bad_q[:2]].isnan().all())


def test_triton_split_faults(request, monkeypatch):
    """Pieces of the Triton kernel keep faults visible through the merge: a NaN row one split
    token selects and a NaN in one head of another split token's q make those rows NaN, and only
    those."""
    calls = []
    monkeypatch.setattr(prefill_op, "tail_split", lambda *args: calls.append(args) or (1, 2))
    _faults_through_pieces(Case(T=4, H=20, topk=256, N=600, invalid=0.1, sink=True), request, 2, (1, 17, 3),
                           assume(ARCHES["sm_80"]) if DEVICE != "cpu" else contextlib.nullcontext())
    assert calls


@pytest.mark.parametrize("H,T,topk,slots", [(16, 3, 2048, 16), (16, 40, 2048, 16), (64, 3, 2048, 8), (16, 3, 64, 16),
                                             (32, 100, 2048, 16)])
def test_triton_launch_splits_the_last_round(H, T, topk, slots, monkeypatch):
    """The Triton kernel's launch (recorded, CPU tensors: 8 SMs) asks the rule with its slots (SMs x
    programs an SM: two of 16 / 32 heads, one of 64), its 64-key units, head block and cost table,
    and sizes the grid, the workspace and the merge from the answer; no split, no merge."""
    seen, merged, asked = [], [], []

    class _Record:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(dict(grid=grid, args=args, **kw))

    rule = prefill_op.tail_split
    monkeypatch.setattr(prefill_op, "sparse_mla_prefill_kernel", _Record())
    monkeypatch.setattr(prefill_op, "merge_tail", lambda *args: merged.append(args))
    monkeypatch.setattr(prefill_op, "tail_split", lambda *args: asked.append(args) or rule(*args))
    q, kv = torch.randn(T, H, 576).bfloat16(), torch.randn(100, 576).bfloat16()
    idx = torch.zeros(T, topk, dtype=torch.int32)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16)
    prefill_op._launch(q, kv, idx, 0.1, None, None, out)
    hb = 16 if H <= 16 else 32 if H <= 32 else 64
    programs = T * -(-H // hb)
    assert asked == [(programs, slots, -(-topk // 64), hb, "triton")]
    p_main, splits = rule(*asked[0])
    assert (splits > 1) is ((T, topk) not in ((3, 64), (100, 2048)))  # 1 unit; over 3 rounds
    k = seen[0]
    ws_o, ws_lse, ws_ml, a_main, a_splits = k["args"][22:27]
    assert (a_main, a_splits) == (p_main, splits)
    if splits > 1:
        pieces = (programs - p_main) * splits
        assert k["grid"] == (p_main + pieces,)
        assert ws_o.shape == (pieces, hb, 512) and ws_lse.shape == ws_ml.shape == (pieces, hb)
        assert len(merged) == 1 and merged[0][0] is ws_o and merged[0][7:9] == (p_main, splits)
    else:
        assert k["grid"] == (programs,) and not merged


# ------------------------------------------------------------------------------------------------
# On Hopper: the Gluon kernels' pieces and the merge against the oracle
# (the rule, the merge and the launch are tested above on every device)
needs_sm90 = pytest.mark.skipif(not sm90_gluon(DEVICE), reason="the Gluon kernels run on Hopper only (the Triton "
                                                              "kernel's pieces: tested above on every device)")

FORCED = [  # (case, forced (p_main, splits) or None for the launch's own rule)
    pytest.param(Case(T=5, H=128, topk=2048, N=8000, invalid=0.2, lengths=True, sink=True), (0, 4),
                 id="T5-H128-all-4-len-sink-invalid"),
    pytest.param(Case(T=5, H=128, topk=2048, N=8000, invalid=0.2, lengths=True, sink=True), (7, 3),
                 id="T5-H128-tail-3-len-sink-invalid"),
    pytest.param(Case(T=4, H=64, topk=500, N=3000, lengths=True), (1, 40),
                 id="T4-H64-more-pieces-than-blocks"),
    pytest.param(Case(T=3, H=100, topk=1000, N=3000, sink=True), (2, 5), id="T3-H100-tail-5-sink"),
    pytest.param(Case(T=6, H=64, topk=700, N=3000, sink=True, d_qk=512), (4, 6), id="T6-H64-d512-tail-6-sink"),
    pytest.param(Case(T=140, H=64, topk=2048, N=32768, invalid=0.1), None, id="T140-H64-rule"),
    pytest.param(Case(T=3, H=64, topk=2048, N=32768, sink=True), None, id="T3-H64-rule"),
    # the keys-on-M kernel (H <= 32; its fault passes: test_sm90_kn_split_fault_passes)
    pytest.param(Case(T=4, H=16, topk=1000, N=30000, invalid=0.2, lengths=True, sink=True), (1, 5),
                 id="T4-H16-tail-5-len-sink-invalid"),
    pytest.param(Case(T=3, H=5, topk=700, N=3000, sink=True), (0, 6), id="T3-H5-all-6-sink"),
    pytest.param(Case(T=6, H=24, topk=800, N=3000, lengths=True), (3, 40), id="T6-H24-more-pieces-than-blocks"),
    pytest.param(Case(T=2, H=32, topk=2048, N=32768, sink=True), None, id="T2-H32-rule"),
]


@GPU_ONLY
@needs_sm90
@pytest.mark.parametrize("case,split", FORCED)
def test_sm90_split_matches_oracle(case, split, request, monkeypatch):
    calls = []
    rule = sm90.tail_split

    def _split(programs, sms, blocks, block_h):
        calls.append(rule(programs, sms, blocks, block_h) if split is None else split)
        return calls[-1]

    monkeypatch.setattr(sm90, "tail_split", _split)
    check(case, request)
    assert calls and calls[0][1] > 1, calls  # the case was split


@GPU_ONLY
@needs_sm90
def test_sm90_kn_split_fault_passes(request, monkeypatch):
    """The keys-on-M kernel at 32 heads with the fault passes (T * topk >= FLAG_RATIO * N): pieces
    take their token's state, so a NaN row one split token selects, and a NaN in one head of
    another split token's q, make those rows NaN through the merge, and only those."""
    c = Case(T=5, H=32, topk=2048, N=1200, invalid=0.1, sink=True)
    assert c.T * c.topk >= sm90_kn.FLAG_RATIO * c.N
    calls = []
    monkeypatch.setattr(sm90, "tail_split", lambda *args: calls.append(args) or (2, 4))
    _faults_through_pieces(c, request, 3, (2, 5, 100))
    assert calls
