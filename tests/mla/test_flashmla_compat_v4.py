"""mla.flashmla_compat with DeepSeek-V4 inputs (FlashMLA's MODEL1: d_qk 512, the 584-byte cache)
and the extra cache, against kernels.reference oracles in FlashMLA's conventions.

Decode: caches are MODEL1 caches packed by quant's FP8_MODEL1 (FlashMLA's block stride) whose
unselected tokens are NaN, indices go through shuffled block tables with every kind of invalid
index mixed in (tests/helpers/flashmla.py), the extra cache has its own block count and size
(FlashMLA's configs: 64 / 2), lengths are per batch entry, sinks include +inf (out = 0) and
-inf, and some queries have no valid index in either list (out 0, lse +inf). The oracle reads the
same packed caches, so format error is not taken for kernel error. V3.2's fp8_ds_mla cache takes an
extra cache too (FlashMLA's API allows it). Prefill: d_qk 512 rows through flash_mla_sparse_fwd.
"""
import pytest
import torch

from openmla.kernels.reference import sparse_mla_decode_ref, sparse_mla_ref
from openmla.mla.flashmla_compat import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
from openmla.quant import FP8_DS_MLA
from tests.helpers import DEVICE, assert_close, invalid_indices, random_paged_cache
from tests.helpers.flashmla import flashmla_slots, model1_scope

INF = float("inf")


def _per_token(x, s_q):
    return None if x is None else x.repeat_interleave(s_q)


def decode_ref(q, cache, indices, *, scale, topk_length=None, attn_sink=None, extra_cache=None,
               extra_indices=None, extra_topk_length=None):
    """The oracle on the flattened problem, in FlashMLA's shapes and conventions: out
    [b, s_q, h_q, 512], lse [b, h_q, s_q] with +inf for an empty query."""
    b, s_q, h_q, d = q.shape
    extra = {}
    if extra_cache is not None:
        extra = dict(extra_cache=extra_cache, extra_indices=extra_indices.reshape(b * s_q, -1),
                     extra_topk_length=_per_token(extra_topk_length, s_q))
    out, lse = sparse_mla_decode_ref(q.reshape(b * s_q, h_q, d), cache, indices.reshape(b * s_q, -1),
                                     scale=scale, topk_length=_per_token(topk_length, s_q),
                                     attn_sink=attn_sink, **extra)
    lse = lse.view(b, s_q, h_q).transpose(1, 2)
    return out.view(b, s_q, h_q, 512), torch.where(lse == -INF, INF, lse)


def _q(b, s_q, h_q, d, seed):
    """FlashMLA's decode q (randn clamped to +-1) as a strided view."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s_q, h_q, d + 8, generator=g).clamp(-1, 1).to(torch.bfloat16)[..., 4:d + 4].to(DEVICE)


def _sink(h_q, seed):
    g = torch.Generator().manual_seed(seed)
    sink = torch.randn(h_q, generator=g)
    sink[0], sink[-1] = INF, -INF  # FlashMLA: +inf zeroes the output, -inf changes nothing
    return sink.to(DEVICE)


# ------------------------------------------------------------------------------------------------
# MODEL1 decode, with and without the extra cache
# ------------------------------------------------------------------------------------------------
V4 = [  # b, s_q, h_q, (topk, blocks, bs), extra (topk, blocks, bs) or None, lengths, extra lengths,
        # sink, empty queries, cache dtype
    pytest.param(2, 1, 8, (20, 4, 16), None, None, None, False, (), torch.uint8, id="b2-s1-H8-topk20"),
    pytest.param(1, 2, 3, (9, 2, 64), None, (5,), None, True, (1,), torch.float8_e4m3fn,
                 id="b1-s2-H3-topk9-bs64-len-sink-empty-fp8view"),
    pytest.param(2, 2, 5, (13, 4, 16), (24, 40, 2), (13, 0), (3, 24), True, (1,), torch.uint8,
                 id="b2-s2-H5-topk13+24-extra-bs2-lens-sink-empty"),
    pytest.param(2, 1, 16, (16, 2, 64), (40, 6, 16), None, (100, 7), False, (0,), torch.int8,
                 id="b2-s1-H16-topk16+40-extra-len-int8"),
    pytest.param(3, 1, 64, (128, 6, 64), (64, 12, 16), (128, 5, 0), (64, 0, 17), True, (), torch.uint8,
                 id="b3-s1-H64-topk128+64-lens-sink"),
]


@pytest.mark.parametrize("b,s_q,h_q,main,extra,lengths,extra_lengths,sink,empty,dtype", V4)
def test_model1_decode_matches_oracle(b, s_q, h_q, main, extra, lengths, extra_lengths, sink, empty,
                                      dtype):
    topk, nb, bs = main
    k_cache, indices = model1_scope(b, s_q, topk, nb, bs, seed=h_q + topk, empty=empty, dtype=dtype)
    kw = {}
    if extra is not None:
        e_topk, e_nb, e_bs = extra
        e_cache, e_idx = model1_scope(b, s_q, e_topk, e_nb, e_bs, seed=7 * h_q + e_topk, empty=empty,
                                      dtype=dtype)
        kw = dict(extra_k_cache=e_cache, extra_indices_in_kvcache=e_idx)
        if extra_lengths is not None:
            kw["extra_topk_length"] = torch.tensor(extra_lengths, dtype=torch.int32, device=DEVICE)
    q = _q(b, s_q, h_q, 512, seed=topk)
    topk_length = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    attn_sink = _sink(h_q, 3) if sink else None
    scale = 512 ** -0.55  # FlashMLA's decode tests' scale
    meta, num_splits = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, num_splits, softmax_scale=scale,
                                      is_fp8_kvcache=True, indices=indices, attn_sink=attn_sink,
                                      topk_length=topk_length, **kw)
    want, want_lse = decode_ref(
        q, k_cache.view(torch.uint8), indices, scale=scale, topk_length=topk_length, attn_sink=attn_sink,
        extra_cache=None if extra is None else kw["extra_k_cache"].view(torch.uint8),
        extra_indices=kw.get("extra_indices_in_kvcache"), extra_topk_length=kw.get("extra_topk_length"))
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == torch.bfloat16 and lse.shape == (b, h_q, s_q)
    assert_close("out", out, want, "sparse_decode_model1")
    assert_close("lse", lse, want_lse, "lse")
    for i in empty:  # no valid index in either list: out 0, lse +inf
        assert bool((out.view(b * s_q, h_q, 512)[i] == 0).all())
        assert bool((lse.transpose(1, 2).reshape(b * s_q, h_q)[i] == INF).all())
    if sink:
        assert bool((out[:, :, 0] == 0).all())
    assert meta.config.extra_topk == (None if extra is None else extra[0])
    assert meta.config.extra_page_block_size == (None if extra is None else extra[2])


def test_model1_default_scale_is_d_qk_to_the_minus_half():
    k_cache, indices = model1_scope(1, 1, 12, 2, 16, seed=1)
    q = _q(1, 1, 4, 512, seed=2)
    got, _ = flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0],
                                    is_fp8_kvcache=True, indices=indices)
    want, _ = flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0],
                                     softmax_scale=512 ** -0.5, is_fp8_kvcache=True, indices=indices)
    assert torch.equal(got, want)


def test_v32_decode_with_extra_cache():
    """FlashMLA's API takes an extra cache for the 656-byte format too: one softmax over both."""
    g = torch.Generator().manual_seed(11)
    b, s_q, h_q = 2, 2, 5
    caches, lists = [], []
    for topk, nb, bs in ((9, 4, 16), (21, 10, 4)):
        cache, _ = random_paged_cache(nb, bs, FP8_DS_MLA.row_width, torch.uint8)
        slots, _, _ = flashmla_slots(b, s_q, topk, nb, bs, g, empty=(3,))
        used = torch.unique(slots[(slots >= 0) & (slots < nb * bs)])
        cache[used // bs, used % bs] = FP8_DS_MLA.pack(torch.randn(len(used), 512, generator=g),
                                                       torch.randn(len(used), 64, generator=g)).to(DEVICE)
        caches.append(cache)
        lists.append(slots.to(torch.int32).to(DEVICE))
    q = _q(b, s_q, h_q, 576, seed=5)
    lens = torch.tensor([4, 9], dtype=torch.int32, device=DEVICE)
    e_lens = torch.tensor([21, 2], dtype=torch.int32, device=DEVICE)
    out, lse = flash_mla_with_kvcache(q, caches[0].unsqueeze(2), None, None, 512, get_mla_metadata()[0],
                                      softmax_scale=0.07, is_fp8_kvcache=True, indices=lists[0],
                                      attn_sink=_sink(h_q, 4), extra_k_cache=caches[1].unsqueeze(2),
                                      extra_indices_in_kvcache=lists[1], topk_length=lens,
                                      extra_topk_length=e_lens)
    want, want_lse = decode_ref(q, caches[0], lists[0], scale=0.07, topk_length=lens,
                                attn_sink=_sink(h_q, 4), extra_cache=caches[1], extra_indices=lists[1],
                                extra_topk_length=e_lens)
    assert_close("out", out, want, "sparse_decode")
    assert_close("lse", lse, want_lse, "lse")
    assert bool((lse[1, :, 1] == INF).all())  # query 3 (batch 1, s 1): nothing valid in either list


def test_metadata_records_the_extra_cache():
    """A metadata object is bound to its first call's extra block size and extra_topk, as FlashMLA's
    Config (extra_page_block_size, extra_topk)."""
    k_cache, idx = model1_scope(1, 1, 8, 2, 16, seed=1)
    e_cache, e_idx = model1_scope(1, 1, 6, 4, 4, seed=2)
    q = _q(1, 1, 2, 512, seed=3)
    meta, _ = get_mla_metadata()
    call = dict(q=q, k_cache=k_cache, block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=meta, is_fp8_kvcache=True, indices=idx, extra_k_cache=e_cache,
                extra_indices_in_kvcache=e_idx)
    first, _ = flash_mla_with_kvcache(**call)
    again, _ = flash_mla_with_kvcache(**call)
    assert torch.equal(first, again)
    with pytest.raises(ValueError, match="extra_topk"):
        flash_mla_with_kvcache(**{**call, "extra_indices_in_kvcache": e_idx[..., :3]})
    other_bs, other_idx = model1_scope(1, 1, 6, 2, 8, seed=2)
    with pytest.raises(ValueError, match="extra_page_block_size"):
        flash_mla_with_kvcache(**{**call, "extra_k_cache": other_bs, "extra_indices_in_kvcache": other_idx})
    with pytest.raises(ValueError, match="extra_page_block_size"):  # and without the extra cache
        flash_mla_with_kvcache(**{**call, "extra_k_cache": None, "extra_indices_in_kvcache": None})


# ------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------
def _v4_args():
    k_cache, idx = model1_scope(1, 1, 5, 2, 4, seed=5)
    e_cache, e_idx = model1_scope(1, 1, 3, 2, 2, seed=6)
    return dict(q=_q(1, 1, 2, 512, seed=1), k_cache=k_cache, block_table=None, cache_seqlens=None,
                head_dim_v=512, tile_scheduler_metadata=get_mla_metadata()[0], is_fp8_kvcache=True,
                indices=idx, extra_k_cache=e_cache, extra_indices_in_kvcache=e_idx)


def _v32_cache(a):
    cache, _ = random_paged_cache(2, 4, FP8_DS_MLA.row_width, torch.uint8)
    return cache.unsqueeze(2)


def _rows_apart(a):
    """A [nb, bs, 1, 584] view whose tokens are 600 bytes apart: not MODEL1's block layout."""
    store = torch.zeros(2, 4, 1, 600, dtype=torch.uint8, device=DEVICE)
    return store[..., :584]


V4_BAD = [
    pytest.param("q", lambda a: _q(1, 1, 2, 576, seed=1), ValueError, "q.shape", id="q576-model1-cache"),
    pytest.param("is_fp8_kvcache", lambda a: False, NotImplementedError, "MODEL1", id="bf16-d512"),
    pytest.param("k_cache", lambda a: a["k_cache"].view(torch.uint8)[..., :576], ValueError,
                 "k_cache.shape", id="cache-576-bytes"),
    pytest.param("k_cache", _rows_apart, ValueError, "k_cache.stride", id="cache-rows-apart"),
    pytest.param("k_cache", lambda a: a["k_cache"].view(torch.bfloat16), ValueError, "k_cache.dtype",
                 id="cache-bf16"),
    pytest.param("extra_k_cache", _v32_cache, ValueError, "extra_k_cache.shape", id="extra-other-format"),
    pytest.param("extra_indices_in_kvcache", lambda a: a["extra_indices_in_kvcache"].expand(2, -1, -1),
                 ValueError, "extra_indices_in_kvcache.shape", id="extra-idx-b2"),
    pytest.param("extra_indices_in_kvcache", lambda a: a["extra_indices_in_kvcache"].long(), ValueError,
                 "extra_indices_in_kvcache.dtype", id="extra-idx-int64"),
    pytest.param("extra_indices_in_kvcache", lambda a: None, ValueError, "extra_indices_in_kvcache",
                 id="extra-idx-missing"),
    pytest.param("extra_topk_length", lambda a: torch.ones(2, dtype=torch.int32, device=DEVICE), ValueError,
                 "extra_topk_length.shape", id="extra-len-b2"),
    pytest.param("extra_topk_length", lambda a: torch.ones(1, device=DEVICE), ValueError,
                 "extra_topk_length.dtype", id="extra-len-fp32"),
    pytest.param("head_dim_v", lambda a: 448, ValueError, "head_dim_v", id="dv448"),
]


@pytest.mark.parametrize("name,value,exc,match", V4_BAD)
def test_model1_decode_refuses(name, value, exc, match):
    args = _v4_args()
    args[name] = value(args)
    with pytest.raises(exc, match=match):
        flash_mla_with_kvcache(**args)


# ------------------------------------------------------------------------------------------------
# Prefill with d_qk 512 rows (V = the whole row)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("s_q,h_q,topk,s_kv,sink,lengths", [
    pytest.param(3, 5, 37, 50, False, None, id="s3-H5-topk37"),
    pytest.param(4, 16, 33, 90, True, (33, 0, 7, 100), id="s4-H16-topk33-sink-len"),
])
def test_prefill_d512_matches_oracle(s_q, h_q, topk, s_kv, sink, lengths):
    g = torch.Generator().manual_seed(s_q * 10 + h_q)
    wide = torch.full((s_kv, 1, 540), float("nan"), dtype=torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32)
    bad = torch.tensor(invalid_indices(s_kv), dtype=torch.int32)
    idx[torch.rand(s_q, 1, topk, generator=g) < 0.25] = bad[0]
    idx[-1] = bad[torch.arange(topk) % len(bad)]  # the last query: no valid index
    used = torch.unique(idx[(idx >= 0) & (idx < s_kv)]).long()
    wide[used, 0, 8:520] = (torch.randn(len(used), 512, generator=g) / 10).to(torch.bfloat16)
    kv = wide.to(DEVICE)[:, :, 8:520]  # strided rows; unused rows stay NaN
    q = torch.randn(s_q, h_q, 512, generator=g).to(torch.bfloat16).to(DEVICE)
    attn_sink = _sink(h_q, 9) if sink else None
    topk_length = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, max_logits, lse = flash_mla_sparse_fwd(q, kv, idx.to(DEVICE), 0.5, attn_sink=attn_sink,
                                                topk_length=topk_length)
    want, want_ml, want_lse = sparse_mla_ref(q, kv[:, 0], idx[:, 0].to(DEVICE), scale=0.5,
                                             topk_length=topk_length, attn_sink=attn_sink, d_v=512)
    assert out.shape == (s_q, h_q, 512) and out.dtype == torch.bfloat16
    assert_close("out", out.float(), want, "sparse_prefill")
    assert_close("max_logits", max_logits, want_ml, "lse")
    assert_close("lse", lse, torch.where(want_lse == -INF, INF, want_lse), "lse")
    assert bool((lse[-1] == INF).all()) and bool((out[-1] == 0).all())


@pytest.mark.parametrize("q_d,kv_d,match", [
    pytest.param(576, 512, "q.shape", id="q576-kv512"),
    pytest.param(512, 576, "q.shape", id="q512-kv576"),
    pytest.param(448, 448, "kv.shape", id="kv448"),
])
def test_prefill_d_qk_mismatch_refused(q_d, kv_d, match):
    with pytest.raises(ValueError, match=match):
        flash_mla_sparse_fwd(torch.zeros(2, 2, q_d, dtype=torch.bfloat16, device=DEVICE),
                             torch.zeros(8, 1, kv_d, dtype=torch.bfloat16, device=DEVICE),
                             torch.zeros(2, 1, 3, dtype=torch.int32, device=DEVICE), 0.1)
