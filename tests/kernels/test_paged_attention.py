"""kernels.paged_attention: paged_attention and varlen_attention against kernels.reference.

Every case is adversarial by default: caches are strided views (one hidden row per block) whose
unwritten rows are NaN, block tables are shuffled and their unused columns hold invalid ids,
q is a non-contiguous view, the softmax scale is not 1/sqrt(D), and a few padding rows follow
the last request. The oracle reads the same bf16/fp16/fp8 values as the kernel, so bf16
tolerances (vLLM's: atol 1.5e-2, rtol 1e-2) apply to fp8 caches too. The Done-when (q_len,
kv_len) pairs run at full length everywhere; in the other groups the CPU shrinks kv lengths to
about 300 (`kv_len`) to keep the interpreter fast. Every kind of case runs on the CPU; only the
full-size sweeps at the end are GPU-only.
"""
import math

import pytest
import torch

from openmla.kernels.paged_attention import paged_attention, varlen_attention
from openmla.kernels.reference import attention_varlen_ref, paged_attention_ref
from tests.helpers import DEVICE, GPU_ONLY, INT32_MAX, assert_close
from tests.helpers.kernels import build, kv_len


def run_case(b, H, *, alibi=False, alibi_sqrt=False, sinks=False, num_splits=None,
             max_query_len=None, **opts):
    g = torch.Generator().manual_seed(1)
    D = b["q"].shape[-1]
    if alibi:
        opts["alibi_slopes"] = (torch.rand(H, generator=g) * 0.3 + 0.02).to(DEVICE)
        opts["alibi_sqrt"] = alibi_sqrt
    if sinks:
        opts["sinks"] = (torch.randn(H, generator=g) * 2).to(DEVICE)
    opts.setdefault("scale", 0.83 / math.sqrt(D))
    out, lse = paged_attention(**b, **opts, return_lse=True, num_splits=num_splits,
                               max_query_len=max_query_len)
    want_out, want_lse = paged_attention_ref(**b, **opts)
    assert out.dtype == b["q"].dtype and out.shape == b["q"].shape
    assert_close("out", out, want_out, "bf16")
    assert_close("lse", lse, want_lse, "fp32")
    return out, lse


# ---------------------------------------------------------------------------------------------
# Regular: the Done-when (q_len, kv_len) pairs, heads, head sizes and block sizes
# ---------------------------------------------------------------------------------------------
REGULAR = [  # (seqs, H, H_kv, D, bs, extra options)
    pytest.param([(1, 1328)], 4, 4, 64, 16, {}, id="q1-kv1328-H4/4-D64-bs16"),
    pytest.param([(5, 18)], 8, 2, 80, 1, {}, id="q5-kv18-H8/2-D80-bs1"),
    pytest.param([(129, 463)], 5, 1, 128, 64, {}, id="q129-kv463-H5/1-D128-bs64"),
    pytest.param([(1, 2011)], 32, 8, 256, 16, {}, id="q1-kv2011-H32/8-D256-bs16"),
    pytest.param([(1, 1328), (5, 18), (129, 463), (1, 2011)], 8, 2, 64, 16, {},
                 id="mixed-4req-H8/2-D64-bs16"),
    pytest.param([(1, 700), (1, 33), (1, 1)], 32, 8, 128, 16, {}, id="decode-3req-H32/8-D128"),
    pytest.param([(4, 900), (4, 37)], 32, 8, 128, 64, {"max_query_len": 4}, id="specdec-q4-H32/8"),
]


@pytest.mark.parametrize("seqs,H,H_kv,D,bs,opts", REGULAR)
def test_regular(seqs, H, H_kv, D, bs, opts):
    # The Done-when pairs run at full length on the CPU too (about 25 s in the interpreter).
    run_case(build(seqs, H, H_kv, D, bs), H, **opts)


# ---------------------------------------------------------------------------------------------
# Masks and score modifiers: windows, softcap, ALiBi, sinks, non-causal
# ---------------------------------------------------------------------------------------------
FEATURES = [  # (seqs, H, H_kv, D, bs, build options, run options)
    pytest.param([(129, 463)], 4, 4, 64, 16, {}, {"window": (63, 0)}, id="prefill-window64"),
    pytest.param([(1, 1328), (5, 300)], 8, 2, 64, 16, {}, {"window": (255, 0)},
                 id="decode-window256"),
    pytest.param([(40, 90)], 8, 2, 64, 16, {}, {"causal": False, "window": (20, 9)},
                 id="noncausal-window20/9"),
    pytest.param([(33, 200)], 8, 2, 128, 16, {"q_mult": 30.0}, {"softcap": 50.0},
                 id="prefill-softcap50"),
    pytest.param([(1, 400)], 8, 8, 64, 16, {"q_mult": 30.0}, {"softcap": 50.0, "window": (63, 0)},
                 id="decode-softcap50-window64"),
    pytest.param([(20, 150), (1, 77)], 8, 2, 64, 16, {}, {"alibi": True}, id="alibi"),
    pytest.param([(20, 150), (1, 77)], 8, 2, 64, 16, {}, {"alibi": True, "alibi_sqrt": True},
                 id="alibi-sqrt"),
    pytest.param([(20, 150), (1, 77)], 8, 4, 64, 16, {}, {"sinks": True}, id="sinks"),
    pytest.param([(3, 500)], 8, 4, 64, 16, {}, {"sinks": True, "window": (99, 0), "num_splits": 3},
                 id="sinks-window-split3"),
    pytest.param([(30, 60)], 4, 2, 64, 16, {}, {"causal": False}, id="noncausal"),
]


@pytest.mark.parametrize("seqs,H,H_kv,D,bs,bopts,opts", FEATURES)
def test_features(seqs, H, H_kv, D, bs, bopts, opts):
    seqs = [(q, kv_len(kv)) for q, kv in seqs]
    run_case(build(seqs, H, H_kv, D, bs, **bopts), H, **opts)


# ---------------------------------------------------------------------------------------------
# Cache formats and layouts: fp8 with per-tensor scales, HND, fp16, odd block sizes
# ---------------------------------------------------------------------------------------------
FORMATS = [  # (seqs, H, H_kv, D, bs, build options)
    pytest.param([(1, 600), (7, 120)], 8, 2, 128, 16, {"cache": "fp8"}, id="fp8-NHD-bs16"),
    pytest.param([(65, 200)], 8, 2, 64, 64, {"cache": "fp8", "layout": "HND"}, id="fp8-HND-bs64"),
    pytest.param([(1, 300), (17, 80)], 8, 2, 64, 16, {"layout": "HND"}, id="bf16-HND-bs16"),
    pytest.param([(1, 300), (17, 80)], 6, 3, 96, 16, {"dtype": "fp16"}, id="fp16-H6/3-D96"),
    pytest.param([(2, 150), (9, 40)], 4, 1, 64, 7, {}, id="bs7-H4/1"),
    pytest.param([(70, 100)], 4, 2, 8, 1, {"cache": "fp8", "layout": "HND"}, id="D8-bs1-fp8-HND"),
    pytest.param([(1, 64), (3, 64)], 4, 2, 32, 64, {}, id="full-blocks-only"),
]


@pytest.mark.parametrize("seqs,H,H_kv,D,bs,bopts", FORMATS)
def test_formats(seqs, H, H_kv, D, bs, bopts):
    seqs = [(q, kv_len(kv)) for q, kv in seqs]
    run_case(build(seqs, H, H_kv, D, bs, **bopts), H)


# ---------------------------------------------------------------------------------------------
# Split-KV: forced counts, the automatic choice, and every split count agreeing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [1, 2, 5, None], ids=lambda s: f"splits-{s}")
def test_split_kv_decode(num_splits):
    seqs = [(1, kv_len(1328)), (1, 17), (1, 1)]
    run_case(build(seqs, 8, 2, 64, 16), 8, num_splits=num_splits)


def test_split_kv_forced_on_long_queries():
    """Splitting keys is exact for any query length (chunked prefill over a long context)."""
    run_case(build([(40, kv_len(500)), (33, 60)], 8, 2, 64, 16), 8, num_splits=3, window=(200, 0))


def test_split_kv_more_splits_than_tiles():
    """Splits past the end of a short sequence are empty (lse -inf parts) and must not disturb it."""
    run_case(build([(2, 5), (1, 40)], 4, 2, 64, 16), 4, num_splits=7, window=(3, 0))


# (BLOCK_M, BLOCK_N, warps, stages, key streams)
TILES = [(16, 32, 4, 2, 0), (16, 128, 4, 3, 0), (32, 64, 4, 2, 0), (64, 32, 8, 2, 0),
         (128, 128, 8, 2, 0), (16, 64, 2, 3, 2), (16, 128, 4, 3, 4)]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: "BM{}-BN{}-w{}-s{}-streams{}".format(*t))
def test_every_tile_shape(tile, monkeypatch):
    """Autotuning may pick any config (the interpreter always takes the first): each tile shape
    must give the same answer on a mixed batch and on a split decode batch."""
    import openmla.kernels.paged_attention.kernel as pa
    bm, bn, w, s, streams = tile
    cfg = pa._config(bm, bn, w, s, streams=streams)
    monkeypatch.setattr(pa.paged_attention_kernel, "configs", [cfg])  # one config: no tuning
    mixed = build([(1, kv_len(300)), (5, 18), (70, 150)], 8, 2, 80, 16)
    run_case(mixed, 8, window=(99, 0), sinks=True)
    decode = build([(1, kv_len(400)), (2, 70)], 8, 2, 64, 16)
    run_case(decode, 8, num_splits=3, softcap=20.0)
    # Short queries with every score option (streams: masked tiles at both window edges, the sink
    # counted once across streams, a page size that does not divide the tile).
    spec = build([(3, kv_len(333)), (1, 45), (2, 2)], 6, 3, 80, 24)
    run_case(spec, 6, window=(150, 0), sinks=True, alibi=True, alibi_sqrt=True, num_splits=2)


# ---------------------------------------------------------------------------------------------
# Corner cases: all-masked rows, empty requests, padding, huge block ids
# ---------------------------------------------------------------------------------------------
CORNERS = [  # (seqs, H, H_kv, D, bs, run options)
    pytest.param([(6, 3), (1, 20)], 4, 2, 64, 16, {}, id="seq-shorter-than-query-masked-rows"),
    pytest.param([(6, 3), (1, 20)], 4, 2, 64, 16, {"sinks": True}, id="masked-rows-with-sinks"),
    pytest.param([(3, 0), (2, 9)], 4, 2, 64, 16, {}, id="kv-len-0"),
    pytest.param([(0, 5), (2, 9), (0, 0)], 4, 2, 64, 16, {}, id="q-len-0-requests"),
    pytest.param([(4, 50)], 4, 2, 64, 16, {"window": (0, 0), "causal": False}, id="window-0-0-diagonal"),
    pytest.param([(4, 50)], 4, 2, 64, 16, {"window": (10, 0), "num_splits": 4, "sinks": True},
                 id="decode-window-with-splits-and-sinks"),
]


@pytest.mark.parametrize("seqs,H,H_kv,D,bs,opts", CORNERS)
def test_corners(seqs, H, H_kv, D, bs, opts):
    out, lse = run_case(build(seqs, H, H_kv, D, bs, pad_rows=3), H, **opts)
    assert torch.equal(out[-3:].float().cpu(), torch.zeros(3, H, D)), "padding rows must be 0"


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits-{s}")
def test_window_never_reads_blocks_behind_it(num_splits):
    """vLLM frees blocks that slid out of every query's window and points their table entries
    at a null block: the result must not change when those entries lead to NaN rows."""
    seqs, bs, left = [(3, kv_len(400)), (1, 90)], 16, 40
    b = build(seqs, 4, 2, 64, bs)
    want, want_lse = paged_attention_ref(**b, scale=0.2, window=(left, 0))
    used = set(b["block_table"].flatten().tolist())
    nan_block = min(set(range(b["k_cache"].shape[0])) - used)  # a spare block: all NaN
    table = b["block_table"].clone()
    for r, (q_len, kv) in enumerate(seqs):
        first_visible = kv - q_len - left  # position of the first query minus the window
        table[r, :max(first_visible, 0) // bs] = nan_block
    got, lse = paged_attention(**{**b, "block_table": table}, scale=0.2, window=(left, 0),
                               num_splits=num_splits, return_lse=True)
    assert_close("out", got, want, "bf16")
    assert_close("lse", lse, want_lse, "fp32")


def test_invalid_block_ids_are_skipped_not_read():
    """Invalid table entries inside a sequence (a caller bug) and a seq_len past the table drop
    their keys; nothing out of bounds is read. Non-causal attention is a function of the key
    set, so the oracle is varlen attention over the keys that remain."""
    seqs, bs, H, H_kv, D = [(2, 40), (3, 32)], 16, 4, 2, 64
    b = build(seqs, H, H_kv, D, bs, pad_rows=0)
    table = b["block_table"].clone()  # columns past each request's blocks hold invalid ids
    kept = [[p for p in range(40) if p // bs != 1], [p for p in range(32) if p // bs != 0]]
    tab = table.cpu()
    keys = [torch.stack([b["k_cache"][tab[r, p // bs], p % bs] for p in ps]) for r, ps in enumerate(kept)]
    vals = [torch.stack([b["v_cache"][tab[r, p // bs], p % bs] for p in ps]) for r, ps in enumerate(kept)]
    table[0, 1], table[1, 0] = -1, INT32_MAX
    lens = b["seq_lens"].clone()
    lens[1] = 10 ** 6  # far past the table's M * block_size positions
    out, lse = paged_attention(**{**b, "block_table": table, "seq_lens": lens}, scale=0.2,
                               causal=False, return_lse=True)
    cu_k = torch.tensor([0, len(kept[0]), len(kept[0]) + len(kept[1])], dtype=torch.int32)
    want, want_lse = attention_varlen_ref(b["q"], torch.cat(keys), torch.cat(vals), b["cu_seqlens_q"],
                                          cu_k.to(DEVICE), scale=0.2)
    assert_close("out", out, want, "bf16")
    assert_close("lse", lse, want_lse, "fp32")


def test_invalid_block_ids_inside_a_long_causal_query():
    """A long query's interior key tiles skip masking; an invalid block id there must send the
    range to the masked path (dropping those keys), never to an out-of-bounds read."""
    kv = kv_len(2000)
    b = build([(70, kv), (40, 120)], 8, 2, 64, 16)
    table = b["block_table"].clone()
    table[0, 2], table[0, 5] = -1, INT32_MAX
    got = paged_attention(**{**b, "block_table": table}, scale=0.11)
    # oracle: causal attention of request 0 over its keys minus pages 2 and 5; request 1 untouched
    tab, cu, lens = table.cpu(), b["cu_seqlens_q"].tolist(), b["seq_lens"].tolist()
    bs, reps = 16, 8 // 2
    want = torch.zeros(cu[-1], 8, 64, dtype=torch.float64)
    for r in range(2):
        L, ql = lens[r], cu[r + 1] - cu[r]
        pos = [p for p in range(L) if not (r == 0 and p // bs in (2, 5))]
        k = torch.stack([b["k_cache"][tab[r, p // bs], p % bs] for p in pos]).double().cpu()
        v = torch.stack([b["v_cache"][tab[r, p // bs], p % bs] for p in pos]).double().cpu()
        k, v = k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1)
        s = torch.einsum("thd,lhd->htl", b["q"][cu[r]:cu[r + 1]].double().cpu(), k) * 0.11
        keep = torch.tensor(pos)[None, :] <= (L - ql + torch.arange(ql))[:, None]
        s = s.masked_fill(~keep[None], float("-inf"))
        want[cu[r]:cu[r + 1]] = torch.einsum("htl,lhd->thd", torch.softmax(s, -1), v)
    assert_close("out", got[:cu[-1]], want.float().to(got.device), "bf16")


@pytest.mark.parametrize("D", [64, 80])
def test_negative_scale_long_and_short_queries(D):
    b = build([(70, kv_len(2000)), (1, 90), (33, 33)], 8, 2, D, 16)
    run_case(b, 8, scale=-0.09)
    run_case(b, 8, scale=-0.09, window=(50, 0), sinks=True)


def test_masked_rows_are_exactly_zero():
    b = build([(6, 3)], 4, 2, 64, 16, pad_rows=0)
    out, lse = paged_attention(**b, scale=0.1, return_lse=True)
    assert torch.equal(out[:3].float().cpu(), torch.zeros(3, 4, 64))
    assert bool((lse[:3] == float("-inf")).all())


def test_only_padding_rows():
    b = build([(0, 4)], 4, 2, 64, 16, pad_rows=5)
    out, lse = paged_attention(**b, scale=0.1, return_lse=True, sinks=torch.ones(4, device=DEVICE))
    assert torch.equal(out.float().cpu(), torch.zeros(5, 4, 64))
    assert bool((lse == float("-inf")).all())


@pytest.mark.parametrize("cache", ["same", "fp8"])
def test_block_ids_of_a_32768_block_cache(cache):
    """Blocks near the top of a 32768-block cache with a 65600-element block stride: block *
    stride exceeds 2^31, so 32-bit offsets would read the wrong rows. The backing is 2^31+
    elements of lazily committed memory; only the used blocks are ever touched."""
    b = build([(1, kv_len(700)), (9, 100)], 2, 1, 64, 16, cache=cache, big_cache=True)
    kc = b["k_cache"]
    assert kc.shape[0] == 32768 and kc.stride(0) * (kc.shape[0] - 1) > 2**31
    run_case(b, 2)


# ---------------------------------------------------------------------------------------------
# Large cases: the Done-when shapes at full kv length, many requests
# ---------------------------------------------------------------------------------------------
@GPU_ONLY
@pytest.mark.parametrize("D", [64, 80, 128, 256])
@pytest.mark.parametrize("bs", [1, 16, 64])
def test_gpu_full_size(D, bs):
    seqs = [(1, 1328), (5, 18), (129, 463), (1, 2011), (300, 4000), (8, 9000)]
    run_case(build(seqs, 32, 8, D, bs), 32, window=(255, 0) if bs == 16 else (-1, -1))


@GPU_ONLY
@pytest.mark.parametrize("R", [1, 8, 33, 128])
def test_gpu_decode_batches(R):
    g = torch.Generator().manual_seed(R)
    seqs = [(1, int(n)) for n in torch.randint(1, 5000, (R,), generator=g)]
    run_case(build(seqs, 32, 8, 128, 16), 32)


# ---------------------------------------------------------------------------------------------
# varlen_attention (encoder attention: contiguous k / v, no cache)
# ---------------------------------------------------------------------------------------------
VARLEN = [  # (q_lens, k_lens, H, H_kv, D, options)
    pytest.param([17, 40, 3], [17, 40, 3], 4, 4, 64, {}, id="encoder-self-attention"),
    pytest.param([9, 1], [30, 25], 8, 2, 80, {"causal": True}, id="causal-bottom-right"),
    pytest.param([1, 2], [60, 300], 8, 2, 64, {"max_query_len": 2}, id="short-queries-split"),
    pytest.param([24], [24], 4, 1, 128, {"window": (5, 5), "sinks": True}, id="window-sinks"),
    pytest.param([12, 0, 5], [12, 3, 0], 2, 2, 32, {"alibi": True}, id="empty-requests-alibi"),
]


@pytest.mark.parametrize("streams", [0, 4], ids=["autotuned", "key-streams"])
@pytest.mark.parametrize("q_lens,k_lens,H,H_kv,D,opts", VARLEN)
def test_varlen(q_lens, k_lens, H, H_kv, D, opts, streams, monkeypatch):
    if streams:  # pin the key-stream layout (contiguous k / v rows instead of pages)
        import openmla.kernels.paged_attention.kernel as pa
        monkeypatch.setattr(pa.paged_attention_kernel, "configs",
                            [pa._config(16, 64, streams, 3, streams=streams)])
    g = torch.Generator().manual_seed(2)
    Tq, Tk = sum(q_lens), sum(k_lens)
    q = torch.randn(Tq + 2, H, D + 8, generator=g).bfloat16().to(DEVICE)[:, :, :D]
    kv = torch.randn(Tk, 2, H_kv, D, generator=g).bfloat16().to(DEVICE)
    k, v = kv[:, 0], kv[:, 1]  # token stride 2 * H_kv * D: non-contiguous views
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(DEVICE)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32).to(DEVICE)
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = (torch.rand(H, generator=g) * 0.3).to(DEVICE)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(H, generator=g).to(DEVICE)
    max_q = opts.pop("max_query_len", None)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, scale=0.3, return_lse=True,
                                max_query_len=max_q, **opts)
    want_out, want_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, scale=0.3, **opts)
    assert_close("out", out, want_out, "bf16")
    assert_close("lse", lse, want_lse, "fp32")


# ---------------------------------------------------------------------------------------------
# Interface: out= buffers, errors, custom op
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits-{s}")
def test_out_buffer_is_written_and_returned(num_splits):
    """A strided out= view is filled (with and without the split reduction) and returned."""
    b = build([(3, 40)], 4, 2, 64, 16, pad_rows=0)
    buf = torch.full((2, 3, 4, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)[1]
    got = paged_attention(**b, scale=0.2, out=buf, num_splits=num_splits)
    assert got.data_ptr() == buf.data_ptr()
    want, _ = paged_attention_ref(**b, scale=0.2)
    assert_close("out", buf, want, "bf16")


def test_bad_inputs_raise():
    b = build([(2, 20)], 4, 2, 64, 16, pad_rows=0)
    with pytest.raises(ValueError, match="q.dtype"):
        paged_attention(**{**b, "q": b["q"].float()}, scale=0.1)
    with pytest.raises(ValueError, match="v_cache"):
        paged_attention(**{**b, "v_cache": b["v_cache"][:, :, :1]}, scale=0.1)
    with pytest.raises(ValueError, match="k_cache.shape"):
        paged_attention(**{**b, "q": torch.zeros(2, 3, 64, dtype=torch.bfloat16, device=DEVICE)},
                        scale=0.1)
    with pytest.raises(ValueError, match="block_table.dtype"):
        paged_attention(**{**b, "block_table": b["block_table"].long()}, scale=0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q.shape"):
        paged_attention(**{**b, "cu_seqlens_q": b["cu_seqlens_q"][:1]}, scale=0.1)
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(**{**b, "k_scale": torch.ones(1, device=DEVICE)}, scale=0.1)
    with pytest.raises(ValueError, match="window"):
        paged_attention(**b, scale=0.1, window=(-2, 0))
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(**b, scale=0.1, sinks=torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="layout"):
        paged_attention(**{**b, "layout": "BHSD"}, scale=0.1)
    with pytest.raises(NotImplementedError, match="head size"):
        q = torch.zeros(2, 4, 264, dtype=torch.bfloat16, device=DEVICE)
        paged_attention(**{**b, "q": q}, scale=0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(**b, scale=0.1, num_splits=0)


def test_registered_as_custom_ops():
    assert hasattr(torch.ops.openmla, "paged_attention")
    assert hasattr(torch.ops.openmla, "varlen_attention")
    b = build([(2, 20)], 4, 2, 64, 16, pad_rows=0)
    out = torch.empty_like(b["q"])
    torch.library.opcheck(
        torch.ops.openmla.paged_attention.default,
        (b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["cu_seqlens_q"], b["seq_lens"],
         out, None, 0.1, True, -1, -1, 0.0, None, False, None, None, None, "NHD", 2, 32, 0, None, None,
         "bf16"),
        test_utils=("test_schema", "test_faketensor"))
