"""Faults stay visible (DESIGN.md, Sparse MLA semantics): a NaN or inf in q or in a key or value a
row attends to makes that row's out and lse NaN, whatever the number of splits; merges keep a NaN
part NaN; only lse = -inf means "no keys". Invalid indices, keys past topk_length and NaN in
slots nobody selects never reach an output, and a row with no key stays empty (out 0, lse -inf)
whatever its q holds.

Each case puts one fault into one place and checks the kernel against the oracle (which must
agree: NaN positions first, tests.helpers.assert_close) and against the expectation written out:
which rows are NaN and which are clean. Splits are forced to 1, 2 and 5 (the decode op's
num_splits override; the Gluon kernels on Hopper take it too) and left to the op, which picks
the count from the GPU.
"""
from __future__ import annotations

import math

import pytest
import torch

from openmla.kernels.cascade import cascade_attention
from openmla.kernels.merge import merge_attn_states
from openmla.kernels.paged_attention import paged_attention, varlen_attention
from openmla.kernels.reference import (attention_varlen_ref, local_attention_ref,
                                       merge_attn_states_ref, paged_attention_ref,
                                       sparse_mla_decode_ref, sparse_mla_ref)
from openmla.kernels.sparse_mla_decode import sparse_mla_decode
from openmla.kernels.sparse_mla_decode.op import _launch as decode_launch
from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
from openmla.mla.mha.local import make_local_attention_virtual_batches
from openmla.quant import BF16_MLA, FP8_DS_MLA
from openmla.quant.int8 import calibrate_v_scale, quantize_per_channel_ref, quantize_per_token_head_ref
from tests.helpers import (DEVICE, GPU_ONLY, assert_close, invalid_indices, paged_batch,
                           random_paged_cache)

NAN, INF = float("nan"), float("inf")
SCALE = 0.083
# NumPy under the interpreter warns where a fault meets arithmetic (a max over NaN scores, inf * 0,
# inf - inf); those rows are what is tested
pytestmark = [pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

# ------------------------------------------------------------------------------------------------
# Sparse decode
# ------------------------------------------------------------------------------------------------
# 5 forced splits need topk >= 5 key blocks: 32 keys in the Triton kernel at H <= 16 (the CPU
# runs that one), 64 or 128 in the Gluon kernels (Hopper)
DEC_TOPK = 160 if DEVICE == "cpu" else 640
DEC_NB, DEC_BS = 24, 64
# where tokens 0 and 1 select the faulty slot: in the second and the last of 5 splits
FAULT_POS = (DEC_TOPK * 5 // 16, DEC_TOPK * 15 // 16)


def _decode_inputs(fmt, H, seed):
    """q [3, H, 576], a NaN-filled strided cache with only the selected slots written, indices
    [3, DEC_TOPK] with every kind of invalid index mixed in. Tokens 0 and 1 select `slot` at
    FAULT_POS; token 2 never does. Returns (q, cache, idx, slot)."""
    g = torch.Generator().manual_seed(seed)
    slots = DEC_NB * DEC_BS
    cache, _ = random_paged_cache(DEC_NB, DEC_BS, fmt.row_width, fmt.cache_dtype)
    slot = 77
    others = torch.tensor([s for s in range(slots) if s != slot])
    idx = others[torch.randint(0, len(others), (3, DEC_TOPK), generator=g)].to(torch.int32)
    bad = torch.tensor(invalid_indices(slots), dtype=torch.int32)
    for t in range(3):
        pos = torch.randperm(DEC_TOPK, generator=g)[:DEC_TOPK // 16]
        pos = pos[(pos != FAULT_POS[0]) & (pos != FAULT_POS[1])]
        idx[t, pos] = bad[torch.arange(len(pos)) % len(bad)]
    idx[0, FAULT_POS[0]] = slot
    idx[1, FAULT_POS[1]] = slot
    used = torch.unique(idx[(idx >= 0) & (idx < slots)]).long()
    rows = fmt.pack(torch.randn(len(used), 512, generator=g) * 1.5, torch.randn(len(used), 64, generator=g))
    cache[used // DEC_BS, used % DEC_BS] = rows.to(DEVICE)
    q = torch.randn(3, H, 576, generator=g).to(torch.bfloat16)
    return q.to(DEVICE), cache, idx.to(DEVICE), slot


def _poison_row(cache, fmt, slot, where, value):
    """Write one fault into the row of `slot`: where = "latent" (element 7), "rope" (element 3 of
    the rope) or, fp8_ds_mla only, "scale" (tile 1's scale). value: NaN, +inf or -inf (an fp8
    latent byte can only be NaN: 0x7F)."""
    row = cache[slot // DEC_BS, slot % DEC_BS]
    if fmt is BF16_MLA:
        row[{"latent": 7, "rope": 512 + 3}[where]] = value
        return
    if where == "latent":
        row[7] = 0x7F
    elif where == "rope":
        rope = row[FP8_DS_MLA.rope_offset:].view(torch.bfloat16)
        rope[3] = value
    else:
        scales = row[FP8_DS_MLA.scale_offset:FP8_DS_MLA.rope_offset].view(torch.float32)
        scales[1] = value


CACHE_FAULTS = [  # fmt, where, value
    pytest.param(BF16_MLA, "latent", NAN, id="bf16-latent-nan"),
    pytest.param(BF16_MLA, "latent", INF, id="bf16-latent-inf"),
    pytest.param(BF16_MLA, "latent", -INF, id="bf16-latent-neginf"),
    pytest.param(BF16_MLA, "rope", NAN, id="bf16-rope-nan"),
    pytest.param(BF16_MLA, "rope", INF, id="bf16-rope-inf"),
    pytest.param(BF16_MLA, "rope", -INF, id="bf16-rope-neginf"),
    pytest.param(FP8_DS_MLA, "latent", NAN, id="fp8-latent-nan"),
    pytest.param(FP8_DS_MLA, "rope", INF, id="fp8-rope-inf"),
    pytest.param(FP8_DS_MLA, "rope", -INF, id="fp8-rope-neginf"),
    pytest.param(FP8_DS_MLA, "scale", NAN, id="fp8-scale-nan"),
    pytest.param(FP8_DS_MLA, "scale", INF, id="fp8-scale-inf"),
]


def _decode_all_splits(fmt, q, cache, idx, topk_length=None, attn_sink=None):
    """(label, out, lse) for 1, 2 and 5 forced splits and the op's own choice."""
    runs = []
    for n in (1, 2, 5):
        out = torch.empty(q.shape[0], q.shape[1], 512, dtype=q.dtype, device=q.device)
        lse = decode_launch(q, cache, idx, topk_length, attn_sink, out, SCALE, fmt, num_splits=n)
        runs.append((f"{n} splits", out, lse))
    out, lse = sparse_mla_decode(q, cache, idx, scale=SCALE, topk_length=topk_length, attn_sink=attn_sink)
    runs.append(("op's splits", out, lse))
    return runs


def _check_decode(fmt, q, cache, idx, nan_rows, *, topk_length=None, attn_sink=None):
    """Every split count agrees with the oracle, and nan_rows [T, H] bool are exactly the NaN rows
    (every element of out NaN there, none elsewhere; lse likewise)."""
    want, want_lse = sparse_mla_decode_ref(q, cache, idx, scale=SCALE, topk_length=topk_length,
                                           attn_sink=attn_sink)
    assert torch.equal(torch.isnan(want_lse).cpu(), nan_rows), "the oracle disagrees with the contract"
    for label, out, lse in _decode_all_splits(fmt, q, cache, idx, topk_length, attn_sink):
        assert torch.equal(torch.isnan(lse).cpu(), nan_rows), f"{label}: lse NaN rows"
        assert bool(torch.isnan(out[nan_rows.to(out.device)]).all()), f"{label}: out of a NaN row"
        assert bool(torch.isfinite(out[~nan_rows.to(out.device)]).all()), f"{label}: out of a clean row"
        assert_close(f"out ({label})", out, want, "sparse_decode")
        assert_close(f"lse ({label})", lse, want_lse, "lse")


@pytest.mark.parametrize("fmt,where,value", CACHE_FAULTS)
def test_decode_cache_fault(fmt, where, value):
    """One bad row that tokens 0 and 1 select: both NaN in every head, token 2 clean."""
    H = 3
    q, cache, idx, slot = _decode_inputs(fmt, H, seed=5)
    _poison_row(cache, fmt, slot, where, value)
    nan_rows = torch.zeros(3, H, dtype=torch.bool)
    nan_rows[:2] = True
    _check_decode(fmt, q, cache, idx, nan_rows)


@pytest.mark.parametrize("fmt", [BF16_MLA, FP8_DS_MLA], ids=["bf16", "fp8"])
@pytest.mark.parametrize("value,dim", [(NAN, 5), (INF, 300), (-INF, 530)], ids=["nan", "inf", "neginf-rope"])
def test_decode_q_fault(fmt, value, dim):
    """A NaN or inf in one head of one token's q: that row only."""
    H = 3
    q, cache, idx, _ = _decode_inputs(fmt, H, seed=6)
    q[2, 1, dim] = value
    nan_rows = torch.zeros(3, H, dtype=torch.bool)
    nan_rows[2, 1] = True
    _check_decode(fmt, q, cache, idx, nan_rows)


@pytest.mark.parametrize("fmt", [BF16_MLA, FP8_DS_MLA], ids=["bf16", "fp8"])
def test_decode_fault_outside_what_a_row_attends(fmt):
    """The bad row sits past token 1's topk_length, NaN fills every unselected slot, a NaN q sits in
    a row with no valid index (out 0, lse -inf), and sinks are on: only token 0 turns NaN."""
    H = 3
    q, cache, idx, slot = _decode_inputs(fmt, H, seed=7)
    _poison_row(cache, fmt, slot, "rope", -INF)
    slots = DEC_NB * DEC_BS
    bad = torch.tensor(invalid_indices(slots), dtype=torch.int32, device=DEVICE)
    idx[2] = bad[torch.arange(DEC_TOPK, device=DEVICE) % len(bad)]
    q[2, :, 9] = NAN
    topk_length = torch.tensor([DEC_TOPK, FAULT_POS[1], DEC_TOPK + 3], dtype=torch.int32, device=DEVICE)
    sink = torch.tensor([0.5, -1.0, 2.0], device=DEVICE)
    nan_rows = torch.zeros(3, H, dtype=torch.bool)
    nan_rows[0] = True
    _check_decode(fmt, q, cache, idx, nan_rows, topk_length=topk_length, attn_sink=sink)
    out, lse = sparse_mla_decode(q, cache, idx, scale=SCALE, topk_length=topk_length, attn_sink=sink)
    assert bool((out[2] == 0).all()) and bool((lse[2] == -INF).all())


@GPU_ONLY
@pytest.mark.parametrize("H", [16, 32, 64, 128])  # Hopper: keys-on-M Gluon (<= 32), 64-head Gluon
@pytest.mark.parametrize("where,value", [("latent", NAN), ("rope", -INF), ("scale", INF)],
                         ids=["latent-nan", "rope-neginf", "scale-inf"])
def test_decode_fault_every_kernel(H, where, value):
    q, cache, idx, slot = _decode_inputs(FP8_DS_MLA, H, seed=H)
    _poison_row(cache, FP8_DS_MLA, slot, where, value)
    nan_rows = torch.zeros(3, H, dtype=torch.bool)
    nan_rows[:2] = True
    _check_decode(FP8_DS_MLA, q, cache, idx, nan_rows)


@GPU_ONLY
@pytest.mark.parametrize("H", [64, 128])  # Hopper: the bf16 Gluon kernel
@pytest.mark.parametrize("where,value", [("latent", NAN), ("latent", INF), ("rope", -INF)],
                         ids=["latent-nan", "latent-inf", "rope-neginf"])
def test_decode_fault_bf16_every_kernel(H, where, value):
    q, cache, idx, slot = _decode_inputs(BF16_MLA, H, seed=H + 1)
    _poison_row(cache, BF16_MLA, slot, where, value)
    nan_rows = torch.zeros(3, H, dtype=torch.bool)
    nan_rows[:2] = True
    _check_decode(BF16_MLA, q, cache, idx, nan_rows)


# ------------------------------------------------------------------------------------------------
# Sparse prefill
# ------------------------------------------------------------------------------------------------
PRE_N, PRE_TOPK = 300, 96


@pytest.fixture(params=["per-score", pytest.param("row-flags", marks=GPU_ONLY)])
def kn_fault_path(request, monkeypatch):
    """The keys-on-M Hopper prefill kernel finds faults per score, or at 17-32 heads from its
    passes' token states (kv row flags, then each token's counted keys) and q when it gathers many
    more rows than the kv pass reads (kernels/sparse_mla_prefill/sm90_kn.py, FLAG_RATIO): both,
    whatever the shapes here. Off Hopper the Triton kernel runs
    (per score), so the second run is GPU-only."""
    from openmla.kernels.sparse_mla_prefill import sm90_kn
    monkeypatch.setattr(sm90_kn, "FLAG_RATIO", 0 if request.param == "row-flags" else 1 << 40)
    return request.param


def _prefill_inputs(H, seed):
    """q [3, H, 576], kv [PRE_N, 576] NaN except the selected rows (values / 10, as the prefill
    tests), indices with invalid ones mixed in; tokens 0 and 1 select row `r` (at 20 and 90),
    token 2 never does. Returns (q, kv, idx, r)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.full((PRE_N, 576), NAN, dtype=torch.bfloat16)
    r = 123
    others = torch.tensor([i for i in range(PRE_N) if i != r])
    idx = others[torch.randint(0, len(others), (3, PRE_TOPK), generator=g)].to(torch.int32)
    bad = torch.tensor(invalid_indices(PRE_N), dtype=torch.int32)
    idx[:, 40:40 + len(bad)] = bad
    idx[0, 20] = r
    idx[1, 90] = r
    used = idx[(idx >= 0) & (idx < PRE_N)].long().unique()
    kv[used] = (torch.randn(len(used), 576, generator=g) / 10).to(torch.bfloat16)
    q = torch.randn(3, H, 576, generator=g).to(torch.bfloat16)
    return q.to(DEVICE), kv.to(DEVICE), idx.to(DEVICE), r


def _check_prefill(q, kv, idx, nan_rows, **kw):
    out, lse, ml = sparse_mla_prefill(q, kv, idx, scale=SCALE, **kw)
    want, want_ml, want_lse = sparse_mla_ref(q, kv, idx, scale=SCALE, **kw)
    assert torch.equal(torch.isnan(want_lse).cpu(), nan_rows), "the oracle disagrees with the contract"
    for name, got in (("lse", lse), ("max_logits", ml)):
        assert torch.equal(torch.isnan(got).cpu(), nan_rows), f"{name}: NaN rows"
    m = nan_rows.to(out.device)
    assert bool(torch.isnan(out[m]).all()) and bool(torch.isfinite(out[~m]).all())
    assert_close("out", out.float(), want, "sparse_prefill")
    assert_close("max_logits", ml, want_ml, "lse")
    assert_close("lse", lse, want_lse, "lse")
    return out, ml, lse


@pytest.mark.parametrize("H", [3, pytest.param(20, marks=GPU_ONLY), pytest.param(64, marks=GPU_ONLY)])
@pytest.mark.parametrize("col,value", [(7, NAN), (7, INF), (515, NAN), (515, INF), (515, -INF)],
                         ids=["latent-nan", "latent-inf", "rope-nan", "rope-inf", "rope-neginf"])
def test_prefill_row_fault(H, col, value, kn_fault_path):
    q, kv, idx, r = _prefill_inputs(H, seed=H + col)
    kv[r, col] = value
    nan_rows = torch.zeros(3, H, dtype=torch.bool)
    nan_rows[:2] = True
    _check_prefill(q, kv, idx, nan_rows)


@pytest.mark.parametrize("value,dim", [(NAN, 5), (INF, 300), (-INF, 530)], ids=["nan", "inf", "neginf-rope"])
def test_prefill_q_fault(value, dim, kn_fault_path):
    q, kv, idx, _ = _prefill_inputs(3, seed=11)
    q[2, 1, dim] = value
    nan_rows = torch.zeros(3, 3, dtype=torch.bool)
    nan_rows[2, 1] = True
    _check_prefill(q, kv, idx, nan_rows)


def test_prefill_fault_outside_what_a_row_attends(kn_fault_path):
    """The bad row past token 1's topk_length, a NaN q in a row with no valid index, sinks on."""
    q, kv, idx, r = _prefill_inputs(3, seed=12)
    kv[r, 515] = -INF
    bad = torch.tensor(invalid_indices(PRE_N), dtype=torch.int32, device=DEVICE)
    idx[2] = bad[torch.arange(PRE_TOPK, device=DEVICE) % len(bad)]
    q[2, :, 9] = NAN
    topk_length = torch.tensor([PRE_TOPK, 90, PRE_TOPK], dtype=torch.int32, device=DEVICE)
    sink = torch.tensor([0.5, -1.0, 2.0], device=DEVICE)
    nan_rows = torch.zeros(3, 3, dtype=torch.bool)
    nan_rows[0] = True
    out, ml, lse = _check_prefill(q, kv, idx, nan_rows, topk_length=topk_length, attn_sink=sink)
    assert bool((out[2] == 0).all()) and bool((lse[2] == -INF).all()) and bool((ml[2] == -INF).all())


def test_prefill_partials_merge_to_nan():
    """The issue's case: prefill over two halves of the indices, merged. The half holding the bad
    row is NaN and the merge keeps it NaN (it used to return the clean half alone)."""
    q, kv, idx, r = _prefill_inputs(3, seed=13)
    kv[r, 7] = NAN
    a_out, a_lse, _ = sparse_mla_prefill(q, kv, idx[:, :48].contiguous(), scale=SCALE)
    b_out, b_lse, _ = sparse_mla_prefill(q, kv, idx[:, 48:].contiguous(), scale=SCALE)
    assert bool(torch.isnan(a_lse[0]).all()) and bool(torch.isfinite(b_lse[0]).all())
    out = torch.empty_like(a_out)
    lse = torch.empty_like(a_lse)
    merge_attn_states(out, a_out, a_lse, b_out, b_lse, lse)
    want, want_lse = merge_attn_states_ref(a_out, a_lse, b_out, b_lse)
    assert bool(torch.isnan(out[:2]).all()) and bool(torch.isnan(lse[:2]).all())
    assert bool(torch.isfinite(out[2]).all()) and bool(torch.isfinite(lse[2]).all())
    assert_close("out", out.float(), want, "bf16")
    assert_close("lse", lse, want_lse, "lse")


# ------------------------------------------------------------------------------------------------
# Paged and varlen attention (bf16, fp8, int8_qkv, int8_qk), cascade, local attention
# ------------------------------------------------------------------------------------------------
H, H_KV, D, BS = 4, 2, 32, 16
MHA_SCALE = 0.7 / math.sqrt(D)
# a decode, a speculative decode of 3 over 47 context keys, a prefill of 6 over 24 (then 2 padding
# rows): rows 0 | 1-3 | 4-9 | 10-11
MHA_SEQS = [(1, 40), (3, 50), (6, 30)]
REQ_ROWS = {0: range(0, 1), 1: range(1, 4), 2: range(4, 10)}


def _int8(b, mode):
    """The bf16 batch b with its caches quantized (quant/int8.py's torch rules): K per (token,
    head) into an int8 cache and a k_scale_cache (unwritten rows: scale NaN, never read), V per
    channel (int8_qkv) or left in bf16 (int8_qk)."""
    nb, bs, h, d = b["k_cache"].shape
    k8, ks = quantize_per_token_head_ref(b["k_cache"].reshape(nb * bs, h, d).float())
    out = {**b, "k_cache": k8.view(nb, bs, h, d), "k_scale_cache": ks.view(nb, bs, h).transpose(1, 2),
           "k_scale": None, "v_scale": None}
    if mode == "int8_qkv":
        v = b["v_cache"].reshape(nb * bs, h, d).float()
        seen = ~torch.isnan(v).any(-1).any(-1)
        v_scale = calibrate_v_scale(v[seen])
        out.update(v_cache=quantize_per_channel_ref(v.nan_to_num(0.0), v_scale).view(nb, bs, h, d),
                   v_scale=v_scale)
    return out


def _mha_batch(cache, seed, seqs=MHA_SEQS, **kw):
    b = paged_batch(seqs, H, H_KV, D, BS, cache="fp8" if cache == "fp8" else "bf16", seed=seed, **kw)
    return _int8(b, cache) if cache.startswith("int8") else b


def _poison_kv(b, what, r, pos, value):
    """One fault at key position pos of request r, KV head 0, dim 5: what = "k" or "v" (the cache
    element; an fp8 cache holds NaN only), or "kscale" (an int8 K's scale)."""
    blk, off = int(b["block_table"][r, pos // BS]), pos % BS
    if what == "kscale":
        b["k_scale_cache"][blk, 0, off] = value
    else:
        b[f"{what}_cache"][blk, off, 0, 5] = value


def _check_mha(b, nan_rows, **opts):
    """paged_attention with 1, 2 and 5 forced splits and its own choice against the oracle; the
    NaN rows [T, H] (lse NaN, out NaN in every element) are exactly nan_rows."""
    want, want_lse = paged_attention_ref(**b, scale=MHA_SCALE, **opts)
    assert torch.equal(torch.isnan(want_lse).cpu(), nan_rows), "the oracle disagrees with the contract"
    for n in (1, 2, 5, None):
        out, lse = paged_attention(**b, scale=MHA_SCALE, return_lse=True, num_splits=n, **opts)
        m = nan_rows.to(out.device)
        assert torch.equal(torch.isnan(lse).cpu(), nan_rows), f"num_splits={n}: lse NaN rows"
        assert bool(torch.isnan(out[m]).all()) and bool(torch.isfinite(out[~m]).all()), f"num_splits={n}"
        assert_close(f"out (num_splits={n})", out, want, "bf16")
        assert_close(f"lse (num_splits={n})", lse, want_lse, "fp32")


def _rows(*rows, heads=(0, 1)):
    """nan_rows [T, H] with the given rows (query heads `heads`: KV head 0 with GQA 2) True."""
    m = torch.zeros(12, H, dtype=torch.bool)
    for t in rows:
        m[t, list(heads)] = True
    return m


KV_FAULTS = [  # cache, what, value
    pytest.param("bf16", "k", NAN, id="bf16-k-nan"),
    pytest.param("bf16", "k", INF, id="bf16-k-inf"),
    pytest.param("bf16", "k", -INF, id="bf16-k-neginf"),
    pytest.param("bf16", "v", NAN, id="bf16-v-nan"),
    pytest.param("bf16", "v", -INF, id="bf16-v-neginf"),
    pytest.param("fp8", "k", NAN, id="fp8-k-nan"),
    pytest.param("fp8", "v", NAN, id="fp8-v-nan"),
    pytest.param("int8_qkv", "kscale", NAN, id="int8qkv-kscale-nan"),
    pytest.param("int8_qkv", "kscale", INF, id="int8qkv-kscale-inf"),
    pytest.param("int8_qk", "kscale", INF, id="int8qk-kscale-inf"),
    pytest.param("int8_qk", "v", INF, id="int8qk-v-inf"),
]


@pytest.mark.parametrize("cache,what,value", KV_FAULTS)
def test_paged_kv_fault(cache, what, value):
    """A bad key or value that every query row of its request attends (the decode's, the
    speculative decode's context, the prefill's context): those rows NaN in the two query heads
    of KV head 0, every other row clean."""
    b = _mha_batch(cache, seed=1)
    _poison_kv(b, what, 0, 7, value)
    _poison_kv(b, what, 1, 30, value)
    _poison_kv(b, what, 2, 3, value)
    _check_mha(b, _rows(*range(10)))


@pytest.mark.parametrize("cache", ["bf16", "fp8", "int8_qkv"])
def test_paged_key_fault_is_exact_under_the_causal_mask(cache):
    """A bad key at position 27 of the prefill (context 24): only its queries 3..5 attend it, so
    only rows 7..9 turn NaN; at position 49 of the speculative decode only its last query. (A key's
    fault never crosses the mask: its score is masked away; for values see
    kernels/paged_attention/tile.py.)"""
    b = _mha_batch(cache, seed=2)
    what = "kscale" if cache == "int8_qkv" else "k"
    _poison_kv(b, what, 2, 27, NAN)
    _poison_kv(b, what, 1, 49, NAN)
    _check_mha(b, _rows(3, 7, 8, 9))


@pytest.mark.parametrize("cache", ["bf16", "fp8", "int8_qkv", "int8_qk"])
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_paged_q_fault(cache, value):
    """A NaN or inf in one query row and head: that row only (int8: through its quantization
    scale); the same in a padding row changes nothing."""
    b = _mha_batch(cache, seed=3)
    b["q"][5, 2, 7] = value
    b["q"][11, 1, 3] = value
    _check_mha(b, _rows(5, heads=(2,)))


def test_paged_fault_with_sinks_softcap_window():
    """Sinks, softcap (which would map +-inf to +-softcap) and a sliding window: a bad key inside
    every row's window turns them NaN; one outside every window (position 2 of the 50-key
    request, window 20) is never attended."""
    b = _mha_batch("bf16", seed=4)
    _poison_kv(b, "k", 1, 40, -INF)
    _poison_kv(b, "k", 1, 2, NAN)
    _poison_kv(b, "v", 1, 2, NAN)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    _check_mha(b, _rows(1, 2, 3), sinks=sinks, softcap=5.0, window=(20, 0))


LONG_SEQS = [(40, 300), (20, 180)]  # long queries (> 16 tokens): rows 0-39 | 40-59 | 60-61 padding


@pytest.mark.parametrize("causal,q_fault", [(True, "inf"), (False, "inf"), (True, "nan"),
                                             (False, "inf-every-score--inf")],
                         ids=["causal", "full", "causal-q-nan", "full-q-scores-all--inf"])
def test_paged_long_query_faults(causal, q_fault):
    """Long queries over a bf16 cache take their interior tiles' key faults from key flags
    (kernels/paged_attention/key_flags.py): a NaN key and a -inf key that every row of their
    request attends (-inf scores would otherwise vanish in the softmax), an +inf key past most
    rows' causal bound (a masked tile: only the rows that attend it), and NaN in every unused
    slot of the caches; 1, 2 and 3 forced splits and the op's own choice. A NaN or inf in one q
    row has no flag: every score of that row is non-finite, which turns its sum NaN by itself,
    also where every one of them is -inf (q's +inf against keys that are all negative there;
    request 1 then has 256 keys, a whole number of tiles: no masked tile, whose fault check
    would catch it instead)."""
    seqs = LONG_SEQS if q_fault != "inf-every-score--inf" else [(40, 300), (20, 256)]
    b = paged_batch(seqs, H, H_KV, D, BS, seed=8)
    _poison_kv(b, "k", 0, 5, NAN)
    _poison_kv(b, "k", 1, 100, -INF)
    _poison_kv(b, "k", 0, 290, INF)  # context 260: queries 30..39 attend it (causal)
    b["q"][45, 3, 9] = NAN if q_fault == "nan" else INF  # request 1, token 5, head 3 (KV head 1)
    if q_fault == "inf-every-score--inf":  # request 1's keys of KV head 1 negative in dim 9
        for pos in range(256):
            blk = int(b["block_table"][1, pos // BS])
            b["k_cache"][blk, pos % BS, 1, 9] = -b["k_cache"][blk, pos % BS, 1, 9].abs() - 0.25
    nan_rows = torch.zeros(62, H, dtype=torch.bool)
    nan_rows[0:60, 0:2] = True  # both requests' rows of KV head 0
    nan_rows[45, 3] = True
    want, want_lse = paged_attention_ref(**b, scale=MHA_SCALE, causal=causal)
    assert torch.equal(torch.isnan(want_lse).cpu()[:60], nan_rows[:60]), "the oracle disagrees"
    for n in (1, 2, 3, None):
        out, lse = paged_attention(**b, scale=MHA_SCALE, return_lse=True, num_splits=n,
                                   causal=causal, max_query_len=40)
        m = nan_rows[:60].to(out.device)
        assert torch.equal(torch.isnan(lse[:60]).cpu(), nan_rows[:60]), f"num_splits={n}"
        assert bool(torch.isnan(out[:60][m]).all()) and bool(torch.isfinite(out[:60][~m]).all())
        assert_close(f"out (num_splits={n})", out[:60], want[:60], "bf16")
        assert_close(f"lse (num_splits={n})", lse[:60], want_lse[:60], "fp32")


def test_paged_long_query_key_fault_past_the_causal_bound():
    """A bad key that only the last rows of a long query attend, and one beyond every row
    (position 299 of request 0 is its last key; request 1's keys end at 180): exactly the rows
    that attend it turn NaN, whatever tile class (interior or masked) it falls in."""
    b = paged_batch(LONG_SEQS, H, H_KV, D, BS, seed=9)
    _poison_kv(b, "k", 0, 299, -INF)  # only query 39 (context 260 + 39) attends it
    _poison_kv(b, "k", 1, 170, NAN)   # context 160: queries 10..19 of request 1
    nan_rows = torch.zeros(62, H, dtype=torch.bool)
    nan_rows[39, 0:2] = True
    nan_rows[50:60, 0:2] = True
    want, want_lse = paged_attention_ref(**b, scale=MHA_SCALE)
    assert torch.equal(torch.isnan(want_lse).cpu()[:60], nan_rows[:60]), "the oracle disagrees"
    out, lse = paged_attention(**b, scale=MHA_SCALE, return_lse=True, max_query_len=40)
    assert torch.equal(torch.isnan(lse[:60]).cpu(), nan_rows[:60])
    assert_close("out", out[:60], want[:60], "bf16")
    assert_close("lse", lse[:60], want_lse[:60], "fp32")


def test_varlen_fault():
    """varlen_attention (contiguous k / v, causal): a bad key of request 1 at a position both its
    queries attend."""
    g = torch.Generator().manual_seed(5)
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 20], dtype=torch.int32, device=DEVICE)
    q = torch.randn(5, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(20, H_KV, D, generator=g).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(20, H_KV, D, generator=g).to(torch.bfloat16).to(DEVICE)
    k[9 + 4, 1, 0] = -INF
    nan_rows = torch.zeros(5, H, dtype=torch.bool)
    nan_rows[3:5, 2:4] = True
    want, want_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, scale=MHA_SCALE, causal=True)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, scale=MHA_SCALE, causal=True, return_lse=True)
    assert torch.equal(torch.isnan(want_lse).cpu(), nan_rows)
    assert torch.equal(torch.isnan(lse).cpu(), nan_rows)
    assert_close("out", out, want, "bf16")
    assert_close("lse", lse, want_lse, "fp32")


@pytest.mark.parametrize("splits", [None, 1, 2, 5], ids=["splits-auto", "splits-1", "splits-2", "splits-5"])
@pytest.mark.parametrize("where", ["prefix", "suffix"])
def test_cascade_fault(where, splits, monkeypatch):
    """Cascade attention over a 32-key shared prefix: a bad value in the prefix turns every
    request's rows NaN, one in request 1's suffix its rows only; the merge keeps them NaN, with
    the prefix pass in 1, 2 or 5 splits (or the op's choice)."""
    if splits is not None:
        import openmla.kernels.cascade as cascade_mod
        monkeypatch.setattr(cascade_mod, "_prefix_num_splits", lambda *a, **k: splits)
    seqs = [(1, 40), (3, 50), (4, 40)]  # contexts 39, 47, 36: all past the prefix
    b = _mha_batch("bf16", seed=6, seqs=seqs, shared_blocks=2)
    if where == "prefix":
        _poison_kv(b, "v", 0, 5, NAN)  # a shared block: every request's position 5
        nan_rows = _rows(*range(8))
    else:
        _poison_kv(b, "v", 1, 40, INF)
        nan_rows = _rows(1, 2, 3)
    want, want_lse = paged_attention_ref(**b, scale=MHA_SCALE)
    out, lse = cascade_attention(**b, common_prefix_len=32, scale=MHA_SCALE, return_lse=True)
    nan_rows = nan_rows[:10]
    assert torch.equal(torch.isnan(want_lse).cpu(), nan_rows)
    assert torch.equal(torch.isnan(lse).cpu(), nan_rows)
    assert_close("out", out, want, "bf16")
    assert_close("lse", lse, want_lse, "fp32")


@pytest.mark.parametrize("splits", [None, 1, 2, 5], ids=["splits-auto", "splits-1", "splits-2", "splits-5"])
def test_local_attention_fault(splits):
    """Chunked local attention (chunk 16) over the prefill's virtual batches: a bad key in chunk 0
    is seen by no query (all sit in chunk 1); one in chunk 1 by every query; with the keys in 1,
    2 or 5 splits (or the op's choice)."""
    b = _mha_batch("bf16", seed=7, seqs=[(6, 30)])
    _poison_kv(b, "k", 0, 3, NAN)
    _poison_kv(b, "v", 0, 18, -INF)
    lb = make_local_attention_virtual_batches(16, [0, 6], [30], b["block_table"], BS)
    vb = {**b, "cu_seqlens_q": lb.cu_seqlens_q, "seq_lens": lb.seq_lens, "block_table": lb.block_table}
    out, lse = paged_attention(**vb, scale=MHA_SCALE, return_lse=True, max_query_len=lb.max_query_len,
                               num_splits=splits)
    want, want_lse = local_attention_ref(**b, attn_chunk_size=16, scale=MHA_SCALE)
    nan_rows = torch.zeros(8, H, dtype=torch.bool)
    nan_rows[:6, :2] = True
    assert torch.equal(torch.isnan(want_lse).cpu(), nan_rows)
    assert torch.equal(torch.isnan(lse).cpu(), nan_rows)
    assert_close("out", out, want, "bf16")
    assert_close("lse", lse, want_lse, "fp32")


# ------------------------------------------------------------------------------------------------
# Merges
# ------------------------------------------------------------------------------------------------
MERGE_FAULTS = [  # which part, what: the part's lse NaN, or a NaN / inf in its out with a finite lse
    pytest.param("a", "lse-nan", id="a-lse-nan"),
    pytest.param("b", "lse-nan", id="b-lse-nan"),
    pytest.param("a", "out-nan", id="a-out-nan"),
    pytest.param("b", "out-inf", id="b-out-inf"),
    pytest.param("b", "out-neginf", id="b-out-neginf"),
]


@pytest.mark.parametrize("other_lse", [1.5, -INF, INF], ids=["other-finite", "other-empty", "other-empty+inf"])
@pytest.mark.parametrize("part,fault", MERGE_FAULTS)
def test_merge_keeps_a_faulty_part_visible(part, fault, other_lse):
    """Row (0, 1) carries the fault; the other part is finite, empty (-inf) or empty (+inf). Row
    (1, 1) has the fault in a part marked empty, which is ignored. Every other row is clean."""
    g = torch.Generator().manual_seed(3)
    T, H, D = 2, 3, 40
    parts = {p: (torch.randn(T, H, D, generator=g).to(DEVICE), (torch.randn(T, H, generator=g) * 3).to(DEVICE))
             for p in "ab"}
    other = "b" if part == "a" else "a"
    bad_out, bad_lse = parts[part]
    bad_out[:, 1, 17] = {"lse-nan": NAN, "out-nan": NAN, "out-inf": INF, "out-neginf": -INF}[fault]
    if fault == "lse-nan":
        bad_lse[0, 1] = NAN
        bad_out[:, 1, 17] = 0.25
    bad_lse[1, 1] = -INF  # an empty part: whatever its out holds is ignored
    bad_out[1, 1] = NAN
    parts[other][1][0, 1] = other_lse
    (a, a_lse), (b, b_lse) = parts["a"], parts["b"]
    out = torch.empty(T, H, D, device=DEVICE)
    lse = torch.empty(T, H, device=DEVICE)
    merge_attn_states(out, a, a_lse, b, b_lse, lse)
    want, want_lse = merge_attn_states_ref(a, a_lse, b, b_lse)
    nan_rows = torch.zeros(T, H, dtype=torch.bool)
    nan_rows[0, 1] = True
    for name, got in (("kernel", lse), ("oracle", want_lse)):
        assert torch.equal(torch.isnan(got).cpu(), nan_rows), f"{name}: lse NaN rows"
    assert bool(torch.isnan(out[0, 1]).all()) and bool(torch.isfinite(out[~nan_rows.to(DEVICE)]).all())
    assert_close("out", out, want, "fp32")
    assert_close("lse", lse, want_lse, "lse")


# ------------------------------------------------------------------------------------------------
# The oracle, on its own: the rule written out on tiny inputs
# ------------------------------------------------------------------------------------------------
def test_oracle_marks_exactly_the_attended_faults():
    """sparse_mla_ref: a -inf score (which a softmax alone would weigh 0) and an inf value of a
    counted key make the row NaN; the same faults in an invalid index's row or past topk_length do
    not; a NaN q in a row with no counted key leaves it empty."""
    kv = torch.randn(6, 8, dtype=torch.float64)
    q = torch.ones(4, 1, 8, dtype=torch.float64)
    kv[2, 6] = -INF  # score -inf (q = 1), value dims 0..3 clean
    kv[4, 1] = INF  # value inf
    idx = torch.tensor([[0, 2], [1, 4], [0, 3], [7, -1]])
    q[3, 0, 0] = NAN
    out, ml, lse = sparse_mla_ref(q, kv, idx, scale=1.0, d_v=4,
                                  topk_length=torch.tensor([2, 2, 1, 2]))
    assert torch.isnan(lse[:2]).all() and torch.isnan(ml[:2]).all() and torch.isnan(out[:2]).all()
    assert torch.isfinite(lse[2]).all() and torch.isfinite(out[2]).all()
    assert lse[3, 0] == -INF and (out[3] == 0).all()
    out, _, lse = sparse_mla_ref(q, kv, idx, scale=1.0, d_v=4, topk_length=torch.tensor([1, 1, 1, 2]))
    assert torch.isfinite(lse[:3]).all() and torch.isfinite(out[:3]).all()


def test_kv_row_fault_flags():
    """The flag pass of the keys-on-M prefill kernel: 1 exactly for the rows holding a NaN or
    +-inf anywhere (latent or rope, first or last column), on a strided kv."""
    from openmla.kernels.sparse_mla_prefill.sm90_kn import kv_row_faults
    g = torch.Generator().manual_seed(5)
    base = torch.randn(150, 600, generator=g).to(torch.bfloat16)
    kv = base[:, :576]  # row stride 600
    for row, col, val in [(0, 0, NAN), (7, 575, INF), (64, 511, -INF), (65, 512, NAN), (149, 300, INF)]:
        kv[row, col] = val
    base[3, 580] = NAN  # past the row's 576 columns: not part of the row
    flags = kv_row_faults(kv.to(DEVICE)).cpu()
    assert torch.equal(flags, (~torch.isfinite(kv.float())).any(1).to(torch.uint8))
    assert int(flags.sum()) == 5


@pytest.mark.parametrize("with_len", [False, True], ids=["topk", "topk_length"])
def test_token_fault_states(with_len):
    """The token pass of the keys-on-M prefill kernel: 0 for a token that counts no key, 1 for only
    clean keys, 2 when a counted key's row is flagged; a flagged row behind an invalid index (-1,
    N, past N, negative) or past topk_length never counts; keys past the pass's 512-key block."""
    from openmla.kernels.sparse_mla_prefill.sm90_kn import token_faults
    N, topk = 40, 700
    g = torch.Generator().manual_seed(6)
    kv_flags = torch.zeros(N, dtype=torch.uint8)
    kv_flags[[3, 17, 39]] = 1
    clean = torch.tensor([i for i in range(N) if i not in (3, 17, 39)])
    idx = clean[torch.randint(0, len(clean), (8, topk), generator=g)].to(torch.int32)
    idx[1, 650] = 17  # flagged key in the second 512-key block
    idx[2] = -1  # no key at all
    idx[3, :] = -1
    idx[3, 5] = 39  # only a flagged key
    idx[4, [0, 1, 2, 3]] = torch.tensor([N, N + 7, -5, -1], dtype=torch.int32)  # invalid: skipped
    idx[5, 600] = 3  # flagged key past topk_length (with_len), counted without it
    idx[6, 0] = 3  # flagged key first
    idx[7, 699] = 39  # flagged key last
    lens = torch.tensor([topk, topk, topk, 10, topk, 600, 0, topk], dtype=torch.int32)
    kv_flags[N - 1] = 1
    tok = token_faults(idx.to(DEVICE), lens.to(DEVICE) if with_len else None, kv_flags.to(DEVICE)).cpu()
    want = [1, 2, 0, 2, 1, 1 if with_len else 2, 0 if with_len else 2, 2]
    assert tok.tolist() == want
    idx_s = torch.full((8, topk + 3), 5, dtype=torch.int32)  # a strided view: rows of topk + 3
    idx_s[:, :topk] = idx
    tok_s = token_faults(idx_s[:, :topk].to(DEVICE), lens.to(DEVICE) if with_len else None,
                         kv_flags.to(DEVICE)).cpu()
    assert tok_s.tolist() == want
