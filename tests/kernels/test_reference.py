"""kernels/reference/ against a second, naive formulation of the same maths.

The naive side shares no code with the oracles: it reads every input through .tolist(), walks
tokens, heads and keys in Python loops in float64 (math.exp, math.fsum), writes each mask
condition out per (query, key), and decodes fp8 cache bytes by hand. Inputs are adversarial:
NaN in every unused cache row, shuffled block tables, every kind of invalid index, duplicates,
a non-default softmax scale, empty rows.
"""
from __future__ import annotations

import math

import pytest
import torch

from openmla.kernels.reference import (
    attention_varlen_ref,
    merge_attn_states_ref,
    paged_attention_ref,
    sparse_mla_decode_ref,
    sparse_mla_ref,
)
from openmla.quant import BF16_MLA, FP8_DS_MLA, FP8_DS_MLA_RAW
from tests.helpers import DEVICE, assert_close, invalid_indices, random_paged_cache, shuffled_block_table

NEG_INF = float("-inf")
NAN = float("nan")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, std=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * std).to(dtype).to(DEVICE)


def _dot(a, b) -> float:
    return math.fsum(x * y for x, y in zip(a, b))


def _t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def _e4m3fn(byte: int) -> float:
    """One float8_e4m3fn byte by hand: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return NAN
    if e == 0:
        return sign * (m / 8.0) * 2.0 ** -6
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


# ---------------------------------------------------------------------------------------------
# Sparse MLA
# ---------------------------------------------------------------------------------------------

def naive_sparse(q, kv, indices, scale, topk_length=None, sink=None, d_v=512):
    """Loops over tokens, heads and the listed indices; returns float64 (out, max_logits, lse)."""
    qs, rows, idx = q.double().tolist(), kv.double().tolist(), indices.tolist()
    lens = None if topk_length is None else topk_length.tolist()
    sk = None if sink is None else sink.double().tolist()
    out, mls, lses = [], [], []
    for t in range(len(qs)):
        count = len(idx[t]) if lens is None else max(0, min(lens[t], len(idx[t])))
        keys = [i for i in idx[t][:count] if 0 <= i < len(rows)]
        o_t, m_t, l_t = [], [], []
        for h in range(len(qs[t])):
            if not keys:
                o_t.append([0.0] * d_v), m_t.append(NEG_INF), l_t.append(NEG_INF)
                continue
            s = [scale * _dot(qs[t][h], rows[i]) for i in keys]
            m = max(s)
            e = [math.exp(x - m) for x in s]
            z = math.fsum(e)
            denom = z if sk is None else z + math.exp(sk[h] - m)
            o_t.append([math.fsum(e[j] * rows[i][d] for j, i in enumerate(keys)) / denom
                        for d in range(d_v)])
            m_t.append(m), l_t.append(m + math.log(z))
        out.append(o_t), mls.append(m_t), lses.append(l_t)
    return _t64(out).reshape(len(qs), -1, d_v), _t64(mls), _t64(lses)


def _sparse_inputs(g, T, H, D, topk, n_rows, n_used, *, dtype=torch.float32, idx_dtype=torch.int32):
    """q, kv (rows never listed are NaN, row 0 among them) and indices mixing used rows, every
    kind of invalid index and duplicates."""
    used = torch.randperm(n_rows - 1, generator=g)[:n_used] + 1
    kv = torch.full((n_rows, D), NAN)
    kv[used] = torch.randn(n_used, D, generator=g)
    idx = used[torch.randint(n_used, (T, topk), generator=g)]
    inv = torch.tensor(invalid_indices(n_rows))
    flip = torch.rand(T, topk, generator=g) < 0.25
    idx = torch.where(flip, inv[torch.randint(len(inv), (T, topk), generator=g)], idx)
    if topk >= 2 + len(inv):
        idx[0, 2:2 + len(inv)] = inv  # each kind at least once
    if topk >= 2:
        idx[:, 1] = idx[:, 0]  # a duplicate in every row
    q = torch.randn(T, H, D, generator=g)
    return (q.to(dtype).to(DEVICE), kv.to(dtype).to(DEVICE), idx.to(idx_dtype).to(DEVICE))


SPARSE_CASES = [
    pytest.param(dict(T=4, H=3, D=576, topk=16, n_rows=40), id="T4-H3-topk16-mixed"),
    pytest.param(dict(T=3, H=2, D=576, topk=9, n_rows=25, idx_dtype=torch.int64), id="T3-H2-topk9-int64"),
    pytest.param(dict(T=4, H=2, D=576, topk=12, n_rows=30, topk_length=[0, 5, 22, 12]),
                 id="T4-topk_length-0-partial-over-full"),
    pytest.param(dict(T=3, H=3, D=576, topk=10, n_rows=30, sink=[1.5, -3.0, 4.0]), id="T3-H3-sink"),
    pytest.param(dict(T=4, H=3, D=576, topk=10, n_rows=30, sink=[0.5, -1.0, 2.0], topk_length=[10, 0, 3, 99],
                      empty_row=1), id="T4-sink-empty-rows-topk_length"),
    pytest.param(dict(T=3, H=2, D=576, topk=13, n_rows=50, dtype=torch.bfloat16), id="T3-bf16-inputs"),
    pytest.param(dict(T=5, H=4, D=40, topk=7, n_rows=12, d_v=32), id="T5-D40-dv32"),
    pytest.param(dict(T=2, H=16, D=576, topk=33, n_rows=64), id="T2-H16-topk33"),
]


@pytest.mark.parametrize("case", SPARSE_CASES)
def test_sparse_mla_ref_matches_naive(case):
    g = _gen(1)
    T, H, D, topk, n_rows = case["T"], case["H"], case["D"], case["topk"], case["n_rows"]
    q, kv, idx = _sparse_inputs(g, T, H, D, topk, n_rows, n_used=min(n_rows - 1, 2 * topk),
                                dtype=case.get("dtype", torch.float32),
                                idx_dtype=case.get("idx_dtype", torch.int32))
    if "empty_row" in case:
        inv = invalid_indices(n_rows)
        idx[case["empty_row"]] = torch.tensor([inv[j % len(inv)] for j in range(topk)], dtype=idx.dtype)
    lens = None
    if "topk_length" in case:
        lens = torch.tensor(case["topk_length"], dtype=torch.int32, device=DEVICE)
    sink = None if "sink" not in case else torch.tensor(case["sink"], device=DEVICE)
    d_v, scale = case.get("d_v", 512), 0.7 / math.sqrt(D)
    out, ml, lse = sparse_mla_ref(q, kv, idx, scale=scale, topk_length=lens, attn_sink=sink, d_v=d_v)
    w_out, w_ml, w_lse = naive_sparse(q, kv, idx, scale, lens, sink, d_v)
    assert out.dtype == ml.dtype == lse.dtype == torch.float32
    assert_close("out", out, w_out, "fp32")
    assert_close("max_logits", ml, w_ml, "lse")
    assert_close("lse", lse, w_lse, "lse")


def test_sparse_mla_ref_all_invalid_rows_are_zero_and_neg_inf():
    g = _gen(2)
    T, H, n_rows = 3, 4, 20
    q, kv, _ = _sparse_inputs(g, T, H, 576, 6, n_rows, n_used=8)
    inv = invalid_indices(n_rows)
    idx = torch.tensor([inv, inv[::-1], inv[2:] + inv[:2]], dtype=torch.int32, device=DEVICE)
    for sink in (None, torch.tensor([0.0, 3.0, -2.0, 10.0], device=DEVICE)):
        out, ml, lse = sparse_mla_ref(q, kv, idx, scale=0.05, attn_sink=sink)
        assert torch.equal(out, torch.zeros(T, H, 512, device=DEVICE))
        assert torch.equal(ml, torch.full((T, H), NEG_INF, device=DEVICE))
        assert torch.equal(lse, torch.full((T, H), NEG_INF, device=DEVICE))


def test_sparse_mla_ref_duplicates_count_each_time():
    g = _gen(3)
    q, kv, _ = _sparse_inputs(g, 1, 2, 576, 4, 10, n_used=9)
    once = torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE)  # rows 1..9 are all written
    twice = torch.tensor([[1, 1, 2, -1]], dtype=torch.int32, device=DEVICE)
    _, _, lse1 = sparse_mla_ref(q, kv, once, scale=0.04)
    out2, _, lse2 = sparse_mla_ref(q, kv, twice, scale=0.04)
    assert_close("out", out2, naive_sparse(q, kv, twice, 0.04)[0], "fp32")
    assert not torch.allclose(lse1, lse2)  # the repeated row weighs twice


@pytest.mark.parametrize("fmt", [pytest.param(FP8_DS_MLA, id="fp8_ds_mla"),
                                 pytest.param(FP8_DS_MLA_RAW, id="fp8_ds_mla_raw"),
                                 pytest.param(BF16_MLA, id="bf16")])
def test_sparse_mla_decode_ref_equals_sparse_ref_on_unpacked_rows(fmt):
    g = _gen(4)
    nb, bs, T, H, topk = 5, 4, 3, 4, 12
    slots_n = nb * bs
    cache, backing = random_paged_cache(nb, bs, fmt.row_width, fmt.cache_dtype)
    written = torch.randperm(slots_n, generator=g)[:11]
    kv_c = torch.randn(len(written), 512, generator=g) * 3.0
    kv_c[0, :128] *= 1e-4  # a tile near the pow2 scale floor
    k_pe = torch.randn(len(written), 64, generator=g)
    packed = fmt.pack(kv_c.to(DEVICE), k_pe.to(torch.bfloat16).to(DEVICE))
    cache[(written // bs).to(DEVICE), (written % bs).to(DEVICE)] = packed
    rows = torch.full((slots_n, 576), NAN, device=DEVICE)
    rows[written.to(DEVICE)] = fmt.unpack(packed)
    idx = written[torch.randint(len(written), (T, topk), generator=g)]
    idx[0, 2:8] = torch.tensor(invalid_indices(slots_n))
    idx[:, 1] = idx[:, 0]
    idx[2] = torch.tensor(invalid_indices(slots_n) * 2)  # an empty row
    idx = idx.to(torch.int32).to(DEVICE)
    q = _randn(g, T, H, 576, dtype=torch.bfloat16)
    lens = torch.tensor([topk, 7, topk], dtype=torch.int32, device=DEVICE)
    sink = torch.tensor([0.3, -1.0, 2.0, 0.0], device=DEVICE)
    scale = 0.6 / math.sqrt(576)
    out, lse = sparse_mla_decode_ref(q, cache, idx, scale=scale, topk_length=lens, attn_sink=sink,
                                     fmt=fmt if fmt is FP8_DS_MLA_RAW else None)
    w_out, _, w_lse = sparse_mla_ref(q, rows, idx, scale=scale, topk_length=lens, attn_sink=sink)
    assert torch.equal(out, w_out) and torch.equal(lse, w_lse)  # the same computation, bit for bit
    n_out, _, n_lse = naive_sparse(q, rows, idx, scale, lens, sink)
    assert_close("out vs naive", out, n_out, "fp32")
    assert_close("lse vs naive", lse, n_lse, "lse")
    assert torch.equal(out[2], torch.zeros(H, 512, device=DEVICE))
    assert bool((lse[2] == NEG_INF).all())


# ---------------------------------------------------------------------------------------------
# General MHA: naive formulation
# ---------------------------------------------------------------------------------------------

def naive_attention(q, keys, vals, q_starts, ctx_lens, H_kv, *, scale, causal, window=(-1, -1),
                    softcap=0.0, slopes=None, alibi_sqrt=False, sinks=None):
    """keys[r], vals[r]: nested lists [L][H_kv][D] of request r; its queries are q rows
    q_starts[r]:q_starts[r+1], query i at position ctx_lens[r] + i. Returns float64 (out, lse)."""
    qs = q.double().tolist()
    T, H = len(qs), q.shape[1]
    Dv = len(next(v[0][0] for v in vals if v)) if any(vals) else q.shape[2]
    sl = None if slopes is None else slopes.double().tolist()
    sk = None if sinks is None else sinks.double().tolist()
    left, right = window
    out = [[[0.0] * Dv for _ in range(H)] for _ in range(T)]
    lse = [[NEG_INF] * H for _ in range(T)]
    for r in range(len(q_starts) - 1):
        K, V, ctx = keys[r], vals[r], ctx_lens[r]
        for i in range(q_starts[r + 1] - q_starts[r]):
            t, p = q_starts[r] + i, ctx_lens[r] + i
            for h in range(H):
                hk = h // (H // H_kv)
                scores, vecs = [], []
                for j in range(len(K)):
                    if causal and j > p:
                        continue
                    if left >= 0 and j < p - left:
                        continue
                    if right >= 0 and j > p + right:
                        continue
                    s = scale * _dot(qs[t][h], K[j][hk])
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if sl is not None:
                        s += sl[h] * ((-math.sqrt(p - j) if j <= p else 0.0) if alibi_sqrt else (j - ctx))
                    scores.append(s), vecs.append(V[j][hk])
                terms = scores + ([sk[h]] if sk is not None else [])
                if not terms:
                    continue
                m = max(terms)
                z = math.fsum(math.exp(x - m) for x in terms)
                lse[t][h] = m + math.log(z)
                e = [math.exp(x - m) / z for x in scores]
                out[t][h] = [math.fsum(e[j] * vecs[j][d] for j in range(len(vecs))) for d in range(Dv)]
    return _t64(out).reshape(T, H, Dv), _t64(lse).reshape(T, H)


def _naive_paged_tokens(cache, bt_row, L, bs, layout, kv_scale):
    """Positions 0..L-1 of one request, read through its block table by hand -> [L][H_kv][D]."""
    if cache.dtype == torch.float8_e4m3fn:
        raw = cache.view(torch.uint8).tolist()
        s = 1.0 if kv_scale is None else float(kv_scale)
        dec = lambda x: _e4m3fn(x) * s  # noqa: E731
    else:
        raw, dec = cache.double().tolist(), float
    H_kv = cache.shape[2] if layout == "NHD" else cache.shape[1]
    tokens = []
    for pos in range(L):
        b, o = bt_row[pos // bs], pos % bs
        tokens.append([[dec(x) for x in (raw[b][o][h] if layout == "NHD" else raw[b][h][o])]
                       for h in range(H_kv)])
    return tokens


def _build_paged(g, q_lens, seq_lens, H_kv, D, bs, layout, dtype, k_scale, v_scale):
    """NaN-filled strided caches (one hidden row per block), a shuffled block table with spare
    columns pointing at NaN blocks, and seq_lens[r] tokens written per request."""
    R = len(q_lens)
    M = max(-(-L // bs) for L in seq_lens) + 1
    nb = R * M + 2
    bt = shuffled_block_table(R, M, nb, generator=g)
    shape = (nb, bs + 1, H_kv, D) if layout == "NHD" else (nb, H_kv, bs + 1, D)
    caches = []
    for kv_scale in (k_scale, v_scale):
        backing = torch.full(shape, NAN).to(dtype).to(DEVICE)
        view = backing[:, :bs] if layout == "NHD" else backing[:, :, :bs]
        for r, L in enumerate(seq_lens):
            x = torch.randn(L, H_kv, D, generator=g)
            if dtype == torch.float8_e4m3fn:
                x = (x * 0.5 / float(kv_scale)).to(dtype).view(torch.uint8)
            else:
                x = x.to(dtype)
            pos = torch.arange(L, device=DEVICE)
            blocks, offs = bt[r, pos // bs].long(), pos % bs
            dst = view.view(torch.uint8) if dtype == torch.float8_e4m3fn else view
            if layout == "NHD":
                dst[blocks, offs] = x.to(DEVICE)
            else:
                dst[blocks, :, offs] = x.to(DEVICE)
        caches.append(view)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=DEVICE)
    return caches[0], caches[1], bt, cu, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def _slopes(H):
    return torch.tensor([2.0 ** (-(h + 1) / 2) for h in range(H)], device=DEVICE)


def _sinks(H):
    return torch.tensor([(-1.0) ** h * (0.5 + h) for h in range(H)], device=DEVICE)


BASE = dict(q_lens=[3, 1, 4], seq_lens=[7, 5, 4], H=4, H_kv=4, D=16, bs=4, layout="NHD",
            dtype=torch.bfloat16, causal=True)

PAGED_CASES = [
    pytest.param(dict(), id="causal-bottom-right-H4"),
    pytest.param(dict(H=8, H_kv=2), id="gqa-H8-Hkv2"),
    pytest.param(dict(H=5, H_kv=1, D=8), id="gqa-H5-Hkv1-D8"),
    pytest.param(dict(window=(2, 0)), id="sliding-window-3"),
    pytest.param(dict(causal=False, window=(2, 1)), id="window-2-1-noncausal"),
    pytest.param(dict(causal=False, window=(-1, 1)), id="window-right-only-noncausal"),
    pytest.param(dict(softcap=2.0, scale=1.0), id="softcap-2"),
    pytest.param(dict(alibi=True), id="alibi"),
    pytest.param(dict(alibi=True, alibi_sqrt=True), id="alibi-sqrt"),
    pytest.param(dict(alibi=True, alibi_sqrt=True, causal=False), id="alibi-sqrt-noncausal"),
    pytest.param(dict(sinks=True), id="sinks"),
    pytest.param(dict(layout="HND", bs=3), id="HND-bs3"),
    pytest.param(dict(dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=torch.tensor([0.03])),
                 id="fp8-NHD-scales"),
    pytest.param(dict(dtype=torch.float8_e4m3fn, layout="HND", k_scale=torch.tensor(0.2), v_scale=0.1),
                 id="fp8-HND-scales"),
    pytest.param(dict(dtype=torch.float16, bs=5), id="fp16-bs5"),
    pytest.param(dict(dtype=torch.float32, bs=1), id="fp32-bs1"),
    pytest.param(dict(q_lens=[4, 2], seq_lens=[2, 6]), id="all-masked-rows-seq_len-lt-q_len"),
    pytest.param(dict(q_lens=[4, 2], seq_lens=[2, 6], sinks=True), id="all-masked-rows-sinks"),
    pytest.param(dict(pad_rows=2), id="rows-past-cu_seqlens"),
    pytest.param(dict(H=8, H_kv=2, layout="HND", dtype=torch.float8_e4m3fn, k_scale=0.04, v_scale=0.07,
                      window=(3, 0), softcap=3.0, alibi=True, sinks=True, q_lens=[2, 5, 1],
                      seq_lens=[9, 5, 13]), id="everything-gqa-HND-fp8"),
]


@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_attention_ref_matches_naive(case):
    c = {**BASE, **case}
    g = _gen(5)
    H, H_kv, D, bs, layout = c["H"], c["H_kv"], c["D"], c["bs"], c["layout"]
    k_scale, v_scale = c.get("k_scale"), c.get("v_scale")
    kc, vc, bt, cu, seq = _build_paged(g, c["q_lens"], c["seq_lens"], H_kv, D, bs, layout, c["dtype"],
                                       k_scale, v_scale)
    T = sum(c["q_lens"]) + c.get("pad_rows", 0)
    q = _randn(g, T, H, D, dtype=torch.bfloat16)
    opts = dict(scale=c.get("scale", 0.37), causal=c["causal"], window=c.get("window", (-1, -1)),
                softcap=c.get("softcap", 0.0), alibi_sqrt=c.get("alibi_sqrt", False))
    slopes = _slopes(H) if c.get("alibi") else None
    sinks = _sinks(H) if c.get("sinks") else None
    out, lse = paged_attention_ref(q, kc, vc, bt, cu, seq, alibi_slopes=slopes, sinks=sinks,
                                   k_scale=k_scale, v_scale=v_scale, layout=layout, **opts)
    bt_rows, cu_l = bt.tolist(), cu.tolist()
    keys = [_naive_paged_tokens(kc, bt_rows[r], L, bs, layout, k_scale) for r, L in enumerate(c["seq_lens"])]
    vals = [_naive_paged_tokens(vc, bt_rows[r], L, bs, layout, v_scale) for r, L in enumerate(c["seq_lens"])]
    ctx = [L - ql for L, ql in zip(c["seq_lens"], c["q_lens"])]
    w_out, w_lse = naive_attention(q, keys, vals, cu_l, ctx, H_kv, slopes=slopes, sinks=sinks, **opts)
    assert out.dtype == lse.dtype == torch.float32
    assert_close("out", out, w_out, "fp32")
    assert_close("lse", lse, w_lse, "lse")
    if c["seq_lens"][0] < c["q_lens"][0]:  # bottom-right: the first q_len - seq_len queries see nothing
        n_empty = c["q_lens"][0] - c["seq_lens"][0]
        assert torch.equal(out[:n_empty], torch.zeros(n_empty, H, D, device=DEVICE))
        want = (sinks.expand(n_empty, H) if sinks is not None
                else torch.full((n_empty, H), NEG_INF, device=DEVICE))
        assert torch.equal(lse[:n_empty], want)
    if c.get("pad_rows"):
        assert torch.equal(out[-c["pad_rows"]:], torch.zeros(c["pad_rows"], H, D, device=DEVICE))
        assert bool((lse[-c["pad_rows"]:] == NEG_INF).all())


def _split(x, lens):
    return [x[a:b].double().tolist() for a, b in zip([0] + lens[:-1], lens)]


VARLEN_CASES = [
    pytest.param(dict(q_lens=[3, 5], k_lens=[3, 5]), id="encoder-noncausal"),
    pytest.param(dict(q_lens=[2, 3], k_lens=[5, 3], causal=True), id="causal-q_len-lt-k_len"),
    pytest.param(dict(q_lens=[4], k_lens=[2], causal=True), id="causal-q_len-gt-k_len-all-masked"),
    pytest.param(dict(q_lens=[2, 3], k_lens=[0, 4]), id="empty-k-request"),
    pytest.param(dict(q_lens=[2, 3], k_lens=[0, 4], sinks=True), id="empty-k-request-sinks"),
    pytest.param(dict(q_lens=[4, 2], k_lens=[6, 2], H=8, H_kv=2, window=(1, 1)), id="gqa-window-1-1"),
    pytest.param(dict(q_lens=[3, 2], k_lens=[4, 7], alibi=True, softcap=1.5, sinks=True, causal=True),
                 id="alibi-softcap-sinks-causal"),
    pytest.param(dict(q_lens=[3, 2], k_lens=[4, 7], alibi=True, alibi_sqrt=True), id="alibi-sqrt-noncausal"),
    pytest.param(dict(q_lens=[2, 2], k_lens=[3, 5], Dv=8, H=6, H_kv=3), id="Dv8-ne-D16-gqa"),
]


@pytest.mark.parametrize("case", VARLEN_CASES)
def test_attention_varlen_ref_matches_naive(case):
    g = _gen(6)
    H, H_kv, D = case.get("H", 4), case.get("H_kv", 4), 16
    Dv = case.get("Dv", D)
    q_lens, k_lens = case["q_lens"], case["k_lens"]
    q = _randn(g, sum(q_lens), H, D)
    k = _randn(g, sum(k_lens), H_kv, D, dtype=torch.float16)
    v = _randn(g, sum(k_lens), H_kv, Dv)
    cq = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ck = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    opts = dict(scale=0.29, causal=case.get("causal", False), window=case.get("window", (-1, -1)),
                softcap=case.get("softcap", 0.0), alibi_sqrt=case.get("alibi_sqrt", False))
    slopes = _slopes(H) if case.get("alibi") else None
    sinks = _sinks(H) if case.get("sinks") else None
    out, lse = attention_varlen_ref(q, k, v, cq, ck, alibi_slopes=slopes, sinks=sinks, **opts)
    ends = ck.tolist()[1:]
    keys, vals = _split(k, ends), _split(v, ends)
    ctx = [kl - ql for ql, kl in zip(q_lens, k_lens)]
    w_out, w_lse = naive_attention(q, keys, vals, cq.tolist(), ctx, H_kv, slopes=slopes, sinks=sinks, **opts)
    assert_close("out", out, w_out, "fp32")
    assert_close("lse", lse, w_lse, "lse")


def test_paged_equals_varlen_on_the_gathered_tokens():
    """The paged oracle is the varlen oracle after the block-table gather (one shared core)."""
    g = _gen(7)
    q_lens, seq_lens, H, H_kv, D, bs = [2, 3], [6, 3], 6, 2, 16, 4
    kc, vc, bt, cu, seq = _build_paged(g, q_lens, seq_lens, H_kv, D, bs, "NHD", torch.bfloat16, None, None)
    q = _randn(g, sum(q_lens), H, D)
    opts = dict(scale=0.4, causal=True, window=(3, 0), softcap=4.0, alibi_slopes=_slopes(H), sinks=_sinks(H))
    out, lse = paged_attention_ref(q, kc, vc, bt, cu, seq, **opts)
    pos = [torch.arange(L, device=DEVICE) for L in seq_lens]
    k = torch.cat([kc[bt[r, p // bs].long(), p % bs] for r, p in enumerate(pos)])
    v = torch.cat([vc[bt[r, p // bs].long(), p % bs] for r, p in enumerate(pos)])
    ck = torch.tensor([0, 6, 9], dtype=torch.int32, device=DEVICE)
    w_out, w_lse = attention_varlen_ref(q, k, v, cu, ck, **opts)
    assert torch.equal(out, w_out) and torch.equal(lse, w_lse)


# ---------------------------------------------------------------------------------------------
# merge_attn_states
# ---------------------------------------------------------------------------------------------

def naive_merge(a_out, a_lse, b_out, b_lse):
    ao, al, bo, bl = (x.double().tolist() for x in (a_out, a_lse, b_out, b_lse))
    T, H, D = a_out.shape
    out = [[[0.0] * D for _ in range(H)] for _ in range(T)]
    lse = [[NEG_INF] * H for _ in range(T)]
    for t in range(T):
        for h in range(H):
            parts = [(l, o) for l, o in ((al[t][h], ao[t][h]), (bl[t][h], bo[t][h])) if not math.isinf(l)]
            if not parts:
                continue
            m = max(l for l, _ in parts)
            z = math.fsum(math.exp(l - m) for l, _ in parts)
            lse[t][h] = m + math.log(z)
            out[t][h] = [math.fsum(math.exp(l - m) / z * o[d] for l, o in parts) for d in range(D)]
    return _t64(out), _t64(lse)


def test_merge_every_empty_combination():
    """Heads enumerate (a, b) lse kinds {finite, -inf, +inf}^2; an empty part's out is NaN."""
    g = _gen(8)
    kinds = [0.0, NEG_INF, float("inf")]
    combos = [(ka, kb) for ka in kinds for kb in kinds]
    T, H, D = 3, len(combos), 8
    a_out, b_out = _randn(g, T, H, D), _randn(g, T, H, D)
    a_lse, b_lse = _randn(g, T, H, std=3.0), _randn(g, T, H, std=3.0)
    for h, (ka, kb) in enumerate(combos):
        if math.isinf(ka):
            a_lse[:, h], a_out[:, h] = ka, NAN
        if math.isinf(kb):
            b_lse[:, h], b_out[:, h] = kb, NAN
    out, lse = merge_attn_states_ref(a_out, a_lse, b_out, b_lse)
    w_out, w_lse = naive_merge(a_out, a_lse, b_out, b_lse)
    assert not bool(out.isnan().any()) and not bool(lse.isnan().any())
    assert_close("out", out, w_out, "fp32")
    assert_close("lse", lse, w_lse, "lse")
    for h, (ka, kb) in enumerate(combos):
        if math.isinf(ka) and math.isinf(kb):
            assert torch.equal(out[:, h], torch.zeros(T, D, device=DEVICE))
            assert bool((lse[:, h] == NEG_INF).all())
        elif math.isinf(ka):
            assert_close("a empty -> b", out[:, h], b_out[:, h], "fp32")
            assert torch.equal(lse[:, h], b_lse[:, h])


@pytest.mark.parametrize("split", [pytest.param("interleaved", id="interleaved"),
                                   pytest.param("b-empty", id="b-empty-set")])
def test_merge_equals_attention_over_the_union(split):
    g = _gen(9)
    T, H, D, Lk = 3, 4, 16, 11
    q, k, v = _randn(g, T, H, D), _randn(g, Lk, H, D), _randn(g, Lk, H, D)
    perm = torch.randperm(Lk, generator=g).to(DEVICE)
    a_keys, b_keys = (perm[:5], perm[5:]) if split == "interleaved" else (perm, perm[:0])

    def part(keys):
        cq = torch.tensor([0, T], dtype=torch.int32, device=DEVICE)
        ck = torch.tensor([0, len(keys)], dtype=torch.int32, device=DEVICE)
        return attention_varlen_ref(q, k[keys], v[keys], cq, ck, scale=0.3, sinks=None)

    (a_out, a_lse), (b_out, b_lse) = part(a_keys), part(b_keys)
    out, lse = merge_attn_states_ref(a_out, a_lse, b_out, b_lse)
    w_out, w_lse = part(torch.arange(Lk, device=DEVICE))
    assert_close("out", out, w_out, "fp32")
    assert_close("lse", lse, w_lse, "lse")
    n_out, n_lse = naive_merge(a_out, a_lse, b_out, b_lse)
    assert_close("out vs naive", out, n_out, "fp32")
    assert_close("lse vs naive", lse, n_lse, "lse")


# ---------------------------------------------------------------------------------------------
# Boundary validation
# ---------------------------------------------------------------------------------------------

def test_bad_inputs_raise_value_error_naming_the_tensor():
    q = torch.randn(2, 3, 576, device=DEVICE)
    kv = torch.randn(10, 576, device=DEVICE)
    with pytest.raises(ValueError, match="indices.shape"):
        sparse_mla_ref(q, kv, torch.zeros(3, 4, dtype=torch.int32, device=DEVICE), scale=0.1)
    with pytest.raises(ValueError, match="kv.shape"):
        sparse_mla_ref(q, kv[:, :512], torch.zeros(2, 4, dtype=torch.int32, device=DEVICE), scale=0.1)
    with pytest.raises(ValueError, match="indices.dtype"):
        sparse_mla_ref(q, kv, torch.zeros(2, 4, device=DEVICE), scale=0.1)
    g = _gen(10)
    kc, vc, bt, cu, seq = _build_paged(g, [1], [3], 2, 8, 4, "NHD", torch.bfloat16, None, None)
    qm = torch.randn(1, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="H_kv"):
        paged_attention_ref(qm, kc, vc, bt, cu, seq, scale=0.1)
    qm = torch.randn(1, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="layout"):
        paged_attention_ref(qm, kc, vc, bt, cu, seq, scale=0.1, layout="BHSD")
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention_ref(qm, kc, vc, bt, cu, seq, scale=0.1, k_scale=2.0)
    with pytest.raises(ValueError, match="block_table"):
        paged_attention_ref(qm, kc, vc, torch.full_like(bt, -1), cu, seq, scale=0.1)
    with pytest.raises(ValueError, match="window"):
        paged_attention_ref(qm, kc, vc, bt, cu, seq, scale=0.1, window=(-2, 0))
