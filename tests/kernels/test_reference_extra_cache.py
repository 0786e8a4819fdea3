"""kernels/reference/sparse.py `sparse_mla_decode_ref` with a second cache (FlashMLA's extra_k_cache,
DeepSeek-V4) and over FP8_MODEL1 caches, against a naive formulation that shares no code with it.

The naive side follows FlashMLA 9241ae3 tests/ref.py's order of operations, in Python loops and
float64: each list gathers its own counted keys (its own cache, block size, lengths), the two key
lists are concatenated into one softmax, and the sink is applied afterwards as
out *= 1 / (1 + exp(sink - lse)). MODEL1 bytes are decoded by hand from the block layout (record
r at r * 576: e4m3 nope | bf16 rope; scales at bs * 576 + r * 8, ue8m0 = 2^(byte - 127)).
Unused cache slots hold NaN; every kind of invalid index appears in both lists."""
from __future__ import annotations

import math
import struct

import pytest
import torch

from openmla.kernels.reference import sparse_mla_decode_ref
from openmla.quant import BF16_MLA, FP8_DS_MLA, FP8_MODEL1
from tests.helpers import DEVICE, assert_close, invalid_indices

NEG_INF = float("-inf")


def _e4m3(byte: int) -> float:
    """float8_e4m3fn by ldexp: exponent field 0 is subnormal (2^-6 * m/8), 0x7F/0xFF NaN."""
    mag, e, m = byte & 0x7F, (byte >> 3) & 0xF, byte & 7
    if mag == 0x7F:
        return float("nan")
    v = math.ldexp(m, -9) if e == 0 else math.ldexp(8 + m, e - 10)
    return -v if byte & 0x80 else v


def _model1_rows(cache: torch.Tensor) -> list:
    """Every slot of a MODEL1 cache decoded by hand: list[num_blocks * bs] of 512 floats."""
    nb, bs = cache.shape[:2]
    stride = cache.stride(0) if nb > 1 else bs * 584
    raw = cache.as_strided((nb, bs * 584), (stride, 1)).cpu().tolist()
    rows = []
    for blk in raw:
        for r in range(bs):
            rec = blk[r * 576: r * 576 + 576]
            sc = blk[bs * 576 + r * 8: bs * 576 + r * 8 + 7]
            nope = [_e4m3(rec[j]) * (math.ldexp(1.0, sc[j // 64] - 127) if sc[j // 64] != 255 else float("nan"))
                    for j in range(448)]
            rope = [struct.unpack("<f", bytes([0, 0, rec[448 + 2 * i], rec[449 + 2 * i]]))[0] for i in range(64)]
            rows.append(nope + rope)
    return rows


def _rows(cache, fmt) -> list:
    if fmt is FP8_MODEL1:
        return _model1_rows(cache)
    return fmt.unpack(cache).reshape(-1, fmt.head_dim).double().cpu().tolist()  # checked elsewhere


def naive_two_lists(q, lists, scale, sink, d_v):
    """lists: [(rows, indices [T][K], lengths or None)]. float64 (out [T, H, d_v], lse [T, H])."""
    qs = q.double().cpu().tolist()
    sk = None if sink is None else sink.double().cpu().tolist()
    out, lses = [], []
    for t in range(len(qs)):
        keys = []
        for rows, idx, lens in lists:
            k = len(idx[t]) if lens is None else max(0, min(lens[t], len(idx[t])))
            keys += [rows[i] for i in idx[t][:k] if 0 <= i < len(rows)]
        o_t, l_t = [], []
        for h in range(len(qs[t])):
            if not keys:
                o_t.append([0.0] * d_v), l_t.append(NEG_INF)
                continue
            s = [scale * math.fsum(a * b for a, b in zip(qs[t][h], key)) for key in keys]
            lse = max(s) + math.log(math.fsum(math.exp(x - max(s)) for x in s))
            p = [math.exp(x - lse) for x in s]
            o = [math.fsum(p[j] * keys[j][d] for j in range(len(keys))) for d in range(d_v)]
            if sk is not None:  # FlashMLA: the sink rescales the finished output once
                f = 0.0 if sk[h] - lse > 700 else 1.0 / (1.0 + math.exp(sk[h] - lse))
                o = [x * f for x in o]
            o_t.append(o), l_t.append(lse)
        out.append(o_t), lses.append(l_t)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lses, dtype=torch.float64)


def _cache(fmt, g, nb, bs, written):
    """A cache of `fmt` with `written` slots holding random tokens, every other slot NaN."""
    D = fmt.head_dim
    k = torch.full((nb * bs, D), float("nan"))
    k[written] = torch.randn(len(written), D, generator=g) * (torch.rand(len(written), 1, generator=g) * 3 + 0.2)
    if fmt is FP8_MODEL1:  # blocks 36 bytes further apart than FlashMLA's, to test strides
        return fmt.pack(k.view(nb, bs, 1, D).bfloat16(), block_stride=fmt.padded_block_bytes(bs) + 36).to(DEVICE)
    return fmt.pack(k[:, :512], k[:, 512:].bfloat16()).view(nb, bs, -1).to(DEVICE)


def _indices(g, T, K, written, n_slots):
    idx = written[torch.randint(len(written), (T, K), generator=g)]
    inv = torch.tensor(invalid_indices(n_slots))
    flip = torch.rand(T, K, generator=g) < 0.3
    idx = torch.where(flip, inv[torch.randint(len(inv), (T, K), generator=g)], idx)
    if K >= len(inv) + 2:
        idx[0, 2: 2 + len(inv)] = inv
    if K >= 2:
        idx[:, 1] = idx[:, 0]  # a slot listed twice counts twice
    return idx.to(torch.int32)


def _nan_past_lengths(idx, lens, written, n_slots):
    """Positions at or past a row's length point at unwritten (NaN) slots: they must not count."""
    unwritten = sorted(set(range(n_slots)) - set(written.tolist()))
    for t, n in enumerate(lens or []):
        idx[t, max(n, 0):] = unwritten[t % len(unwritten)]
    return idx


CASES = [  # (id, main fmt, extra fmt or None, T, H, K, K_extra, bs, extra bs, lengths, extra lengths, sink)
    ("model1-extra-lengths-sink", FP8_MODEL1, FP8_MODEL1, 5, 3, 12, 10, 4, 2,
     [12, 0, 5, 99, 7], [10, 3, 0, 10, -2], [0.5, float("inf"), float("-inf")]),
    ("model1-extra-no-lengths", FP8_MODEL1, FP8_MODEL1, 3, 2, 9, 13, 8, 3, None, None, None),
    ("model1-only-extra-lengths", FP8_MODEL1, FP8_MODEL1, 3, 2, 6, 6, 2, 4, None, [6, 2, 0], [1.0, -2.0]),
    ("model1-no-extra", FP8_MODEL1, None, 4, 3, 11, 0, 4, 0, [11, 4, 0, 30], None, [2.0, -1.0, 0.0]),
    ("v32-fp8-extra", FP8_DS_MLA, FP8_DS_MLA, 3, 2, 10, 7, 4, 2, [10, 6, 1], [7, 0, 4], [0.3, -0.7]),
    ("v32-bf16-with-fp8-extra", BF16_MLA, FP8_DS_MLA, 2, 2, 8, 5, 2, 4, None, [5, 2], None),
]


@pytest.mark.parametrize("case", [pytest.param(c[1:], id=c[0]) for c in CASES])
def test_extra_cache_oracle_matches_naive(case):
    fmt, xfmt, T, H, K, KX, bs, xbs, lens, xlens, sink = case
    g = torch.Generator().manual_seed(31)
    nb, xnb = 5, 4
    written = torch.randperm(nb * bs, generator=g)[: max(2, nb * bs // 2)]
    cache = _cache(fmt, g, nb, bs, written)
    idx = _indices(g, T, K, written, nb * bs)
    idx = _nan_past_lengths(idx, lens, written, nb * bs)
    idx[T - 1] = torch.tensor((invalid_indices(nb * bs) * K)[:K], dtype=torch.int32)  # first list empty
    q = (torch.randn(T, H, fmt.head_dim, generator=g) * 0.5).bfloat16().to(DEVICE)
    as_len = (lambda v: None if v is None else torch.tensor(v, dtype=torch.int32, device=DEVICE))
    sink_t = None if sink is None else torch.tensor(sink, device=DEVICE)
    scale = fmt.head_dim ** -0.55
    lists = [(_rows(cache, fmt), idx.tolist(), lens)]
    kw = {}
    if xfmt is not None:
        xwritten = torch.randperm(xnb * xbs, generator=g)[: max(2, xnb * xbs // 2)]
        xcache = _cache(xfmt, g, xnb, xbs, xwritten)
        xidx = _nan_past_lengths(_indices(g, T, KX, xwritten, xnb * xbs), xlens, xwritten, xnb * xbs)
        lists.append((_rows(xcache, xfmt), xidx.tolist(), xlens))
        kw = dict(extra_cache=xcache, extra_indices=xidx.to(DEVICE), extra_topk_length=as_len(xlens))
    out, lse = sparse_mla_decode_ref(q, cache, idx.to(DEVICE), scale=scale, topk_length=as_len(lens),
                                     attn_sink=sink_t, **kw)
    w_out, w_lse = naive_two_lists(q, lists, scale, sink_t, fmt.latent_dim)
    assert out.shape == (T, H, fmt.latent_dim) and lse.shape == (T, H)
    assert bool(torch.isfinite(lse[:-1]).any())  # something was attended
    assert_close("out", out, w_out, "fp32")
    assert_close("lse", lse, w_lse, "lse")


def test_empty_lists_and_a_nan_key():
    """Both lists empty: out 0, lse -inf whatever the sink; zero-length extra list == no extra
    cache; a counted extra key holding NaN makes exactly its rows NaN."""
    g = torch.Generator().manual_seed(32)
    nb, bs, T, H = 3, 4, 3, 2
    written = torch.tensor([0, 5, 6, 9])
    cache = _cache(FP8_MODEL1, g, nb, bs, written)
    xcache = _cache(FP8_MODEL1, g, 2, 2, torch.tensor([1, 2]))
    q = torch.randn(T, H, 512, generator=g).to(DEVICE)
    idx = torch.tensor([[0, 5, -1], [6, 9, 12], [-1, 12, 2**31 - 1]], dtype=torch.int32, device=DEVICE)
    xidx = torch.tensor([[1, 2], [2, 4], [0, 3]], dtype=torch.int32, device=DEVICE)  # 0 and 3 hold NaN
    sink = torch.tensor([1.0, float("inf")], device=DEVICE)
    zero = torch.zeros(T, dtype=torch.int32, device=DEVICE)
    out, lse = sparse_mla_decode_ref(q, cache, idx, scale=0.05, attn_sink=sink, extra_cache=xcache,
                                     extra_indices=xidx, extra_topk_length=zero)
    base, base_lse = sparse_mla_decode_ref(q, cache, idx, scale=0.05, attn_sink=sink)
    assert torch.equal(out, base) and torch.equal(lse, base_lse)
    assert torch.equal(out[2], torch.zeros(H, 512, device=DEVICE)) and bool((lse[2] == NEG_INF).all())
    assert torch.equal(out[:2, 1], torch.zeros(2, 512, device=DEVICE))  # an infinite sink takes it all
    out, lse = sparse_mla_decode_ref(q, cache, idx, scale=0.05, extra_cache=xcache, extra_indices=xidx)
    assert bool(torch.isfinite(out[:2]).all()) and bool(torch.isfinite(lse[:2]).all())
    assert bool(out[2].isnan().all()) and bool(lse[2].isnan().all())  # the extra list reaches a NaN slot


def test_extra_cache_bad_inputs():
    q = torch.randn(2, 2, 512, device=DEVICE)
    cache = FP8_MODEL1.empty_cache(2, 4, device=DEVICE)
    idx = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="extra_cache: expected a cache when extra_indices"):
        sparse_mla_decode_ref(q, cache, idx, scale=0.1, extra_indices=idx)
    with pytest.raises(ValueError, match="extra_indices: expected"):
        sparse_mla_decode_ref(q, cache, idx, scale=0.1, extra_cache=cache)
    v32 = torch.zeros(2, 4, 656, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=r"extra_cache \(fp8_ds_mla\) head_dim: expected 512"):
        sparse_mla_decode_ref(q, cache, idx, scale=0.1, extra_cache=v32, extra_indices=idx)
    with pytest.raises(ValueError, match=r"extra_indices.shape\[0\]: expected 2"):
        sparse_mla_decode_ref(q, cache, idx, scale=0.1, extra_cache=cache, extra_indices=idx[:1])
    with pytest.raises(ValueError, match=r"extra_topk_length.shape"):
        sparse_mla_decode_ref(q, cache, idx, scale=0.1, extra_cache=cache, extra_indices=idx,
                              extra_topk_length=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"cache.shape: expected \[num_blocks, block_size, row\]"):
        sparse_mla_decode_ref(q, torch.zeros(2, 4, 2, 584, dtype=torch.uint8, device=DEVICE), idx, scale=0.1)
