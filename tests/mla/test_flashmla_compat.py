"""mla.flashmla_compat against FlashMLA's published usage and kernels.reference oracles.

Inputs are adversarial as elsewhere: paged caches are strided views ([num_blocks, block_size + 1
rows]) whose unwritten rows hold NaN (0xFF bytes), block tables are shuffled, every kind of
invalid index is mixed in, softmax scales are not 1/sqrt(576) unless a default is under test,
and the oracles read the same (quantized) cache, so format error is not taken for kernel error.
The FlashMLA conventions checked: lse [b, h_q, s_q] natural log, +inf for an empty row, out = 0
there, max_logits -inf there, topk_length per batch entry in decode and per query in prefill.
"""
import inspect
import textwrap

import pytest
import torch

from openmla.mla import flashmla_compat
from openmla.mla.flashmla_compat import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
from openmla.kernels.reference import sparse_mla_decode_ref, sparse_mla_ref
from openmla.quant import BF16_MLA, FP8_DS_MLA
from tests.helpers import DEVICE, assert_close, invalid_indices, random_paged_cache
from tests.helpers.flashmla import flashmla_slots

INF = float("inf")


def _flashmla_lse(lse_ths: torch.Tensor, b: int, s_q: int) -> torch.Tensor:
    """openmla's [T, H] lse (-inf when empty) -> FlashMLA's [b, h_q, s_q] (+inf when empty)."""
    lse = lse_ths.view(b, s_q, -1).transpose(1, 2)
    return torch.where(lse == -INF, INF, lse)


def make_decode(*, b, s_q, h_q, topk, num_blocks, block_size, fp8=True, fp8_dtype=False,
                empty=(), seed=0, content_seed=None):
    """FlashMLA-shaped decode inputs: q [b, s_q, h_q, 576] (a strided view), k_cache
    [num_blocks, block_size, 1, row] over a NaN-filled backing, indices [b, s_q, topk] global slots
    made from per-request token positions through a shuffled block table (FlashMLA's
    abs_indices2indices_in_kvcache), invalid ones mixed in. Queries listed in `empty` (flat
    b * s_q positions) get only invalid indices. `seed` draws the indices, `content_seed` (default:
    seed) the cache rows and q, so layers of one batch share indices and differ in content."""
    g = torch.Generator().manual_seed(seed)
    gc = torch.Generator().manual_seed(seed if content_seed is None else content_seed)
    fmt = FP8_DS_MLA if fp8 else BF16_MLA
    cache, _ = random_paged_cache(num_blocks, block_size, fmt.row_width, fmt.cache_dtype)
    slots, table, seqlen = flashmla_slots(b, s_q, topk, num_blocks, block_size, g, empty=empty)
    used = torch.unique(slots[(slots >= 0) & (slots < num_blocks * block_size)])
    rows = fmt.pack(torch.randn(len(used), 512, generator=gc) * 1.5, torch.randn(len(used), 64, generator=gc))
    cache[used // block_size, used % block_size] = rows.to(cache.device)
    k_cache = cache.unsqueeze(2)
    if fp8_dtype:
        k_cache = k_cache.view(torch.float8_e4m3fn)  # as FlashMLA's tests/quant.py returns it
    q = (torch.randn(b, s_q, h_q, 600, generator=gc) * 2).to(torch.bfloat16)[..., 10:586]
    seqlens = torch.full((b,), seqlen, dtype=torch.int32)
    return dict(q=q.to(DEVICE), k_cache=k_cache, block_table=table.to(DEVICE),
                cache_seqlens=seqlens.to(DEVICE), indices=slots.to(torch.int32).to(DEVICE), raw_cache=cache)


def decode_ref(a, *, scale, topk_length=None, attn_sink=None):
    """The oracle on the flattened problem, returned in FlashMLA's shapes and conventions."""
    b, s_q, h_q, _ = a["q"].shape
    lengths = None if topk_length is None else topk_length.repeat_interleave(s_q)
    out, lse = sparse_mla_decode_ref(a["q"].reshape(b * s_q, h_q, 576), a["raw_cache"],
                                     a["indices"].reshape(b * s_q, -1), scale=scale,
                                     topk_length=lengths, attn_sink=attn_sink)
    return out.view(b, s_q, h_q, 512), _flashmla_lse(lse, b, s_q)


# ------------------------------------------------------------------------------------------------
# FlashMLA's README usage example (README.md "MLA Decoding"), verbatim but for the import line. The
# two "..." elisions are filled from the test's own names (EXAMPLE_FILL).
# ------------------------------------------------------------------------------------------------
README_EXAMPLE = textwrap.dedent("""\
    from flash_mla import get_mla_metadata, flash_mla_with_kvcache

    tile_scheduler_metadata, num_splits = get_mla_metadata(
        cache_seqlens,
        s_q * h_q // h_kv,
        h_kv,
        h_q,
        is_fp8,
        topk,
    )

    for i in range(num_layers):
        ...
        o_i, lse_i = flash_mla_with_kvcache(
            q_i, kvcache_i, block_table, cache_seqlens, dv,
            tile_scheduler_metadata, num_splits,
            is_causal, is_fp8_kvcache, indices,
        )
        ...
""")
PUBLISHED_ARGS = "        is_causal, is_fp8_kvcache, indices,\n"
KEYWORD_ARGS = "        causal=is_causal, is_fp8_kvcache=is_fp8_kvcache, indices=indices,\n"


def _run_example(source: str, num_layers=2, b=2, s_q=2, h_q=16, topk=37):
    source = source.replace("from flash_mla import", "from openmla.mla.flashmla_compat import")
    first, second = source.index("    ...\n"), source.rindex("    ...\n")
    source = (source[:first] + "    q_i, kvcache_i = qs[i], kvcaches[i]\n"
              + source[first + 8:second] + "    results.append((o_i, lse_i))\n" + source[second + 8:])
    layers = [make_decode(b=b, s_q=s_q, h_q=h_q, topk=topk, num_blocks=6, block_size=16,
                          fp8_dtype=True, seed=0, content_seed=i) for i in range(num_layers)]
    for layer in layers[1:]:  # one batch: every layer has the same block table and indices
        assert torch.equal(layer["indices"], layers[0]["indices"])
    a = layers[0]
    ns = dict(cache_seqlens=a["cache_seqlens"], block_table=a["block_table"], indices=a["indices"],
              s_q=s_q, h_q=h_q, h_kv=1, topk=topk, dv=512, num_layers=num_layers,
              is_fp8=True, is_fp8_kvcache=True, is_causal=False,
              qs=[x["q"] for x in layers], kvcaches=[x["k_cache"] for x in layers], results=[])
    exec(compile(source, "README.md example", "exec"), ns)
    return layers, ns["results"]


def test_readme_example_as_published_refused_with_hint():
    # The published call passes is_causal where the signature (FlashMLA's too) has softmax_scale,
    # so FlashMLA binds softmax_scale=False, causal=True, is_fp8_kvcache=indices. openmla refuses
    # that loudly instead of computing something else.
    assert PUBLISHED_ARGS in README_EXAMPLE
    with pytest.raises(ValueError, match="by keyword"):
        _run_example(README_EXAMPLE, num_layers=1)


def test_readme_example_with_keywords():
    layers, results = _run_example(README_EXAMPLE.replace(PUBLISHED_ARGS, KEYWORD_ARGS))
    assert len(results) == len(layers)
    for layer, (o_i, lse_i) in zip(layers, results):
        want, want_lse = decode_ref(layer, scale=576 ** -0.5)  # FlashMLA's default scale
        assert o_i.shape == (2, 2, 16, 512) and o_i.dtype == torch.bfloat16
        assert lse_i.shape == (2, 16, 2) and lse_i.dtype == torch.float32
        assert_close("out", o_i, want, "sparse_decode")
        assert_close("lse", lse_i, want_lse, "lse")


# ------------------------------------------------------------------------------------------------
# Decode against the oracle: any h_q, odd topk, both caches, sinks, per-batch topk_length, empty rows
# ------------------------------------------------------------------------------------------------
DECODE = [  # b, s_q, h_q, topk, num_blocks, block_size, fp8, fp8_dtype, empty, sink, lengths
    pytest.param(2, 1, 3, 37, 4, 61, True, False, (1,), False, None, id="fp8-b2-s1-H3-topk37-empty"),
    pytest.param(1, 3, 16, 64, 4, 16, True, True, (), True, None, id="fp8view-b1-s3-H16-topk64-sink"),
    pytest.param(2, 2, 5, 19, 8, 7, True, False, (2,), True, (0, 11), id="fp8-b2-s2-H5-topk19-len0-sink"),
    pytest.param(2, 2, 16, 33, 6, 16, False, False, (0,), False, (40, 5), id="bf16-b2-s2-H16-topk33-len"),
]


@pytest.mark.parametrize("b,s_q,h_q,topk,num_blocks,block_size,fp8,fp8_dtype,empty,sink,lengths", DECODE)
def test_decode_matches_oracle(b, s_q, h_q, topk, num_blocks, block_size, fp8, fp8_dtype, empty, sink, lengths):
    a = make_decode(b=b, s_q=s_q, h_q=h_q, topk=topk, num_blocks=num_blocks, block_size=block_size,
                    fp8=fp8, fp8_dtype=fp8_dtype, empty=empty, seed=h_q + topk)
    g = torch.Generator().manual_seed(1)
    attn_sink = (torch.randn(h_q, generator=g) * 2).to(DEVICE) if sink else None
    if sink:
        attn_sink[0] = INF  # FlashMLA: +inf sink -> out = 0, lse unchanged
    topk_length = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    meta, num_splits = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(a["q"], a["k_cache"], None, None, 512, meta, num_splits,
                                      softmax_scale=0.071, is_fp8_kvcache=fp8, indices=a["indices"],
                                      attn_sink=attn_sink, topk_length=topk_length)
    want, want_lse = decode_ref(a, scale=0.071, topk_length=topk_length, attn_sink=attn_sink)
    assert out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
    assert_close("out", out, want, "sparse_decode")
    assert_close("lse", lse, want_lse, "lse")
    n_empty = int((lse == INF).sum())
    assert n_empty >= len(empty) * h_q  # the empty rows: +inf lse ...
    assert bool((out.view(b * s_q, h_q, 512)[list(empty)] == 0).all())  # ... and out = 0
    if sink:
        assert bool((out[:, :, 0] == 0).all())


REPEAT = [  # b, s_q, h_q, topk, fp8, split: whether 8 SMs split the top-k over programs (on every
    # path: the Hopper Gluon kernel's 128-key blocks split 1100 keys in three on 8 SMs)
    pytest.param(2, 2, 5, 19, True, False, id="fp8-one-split"),
    pytest.param(2, 1, 16, 1100, True, True, id="fp8-splits"),
    pytest.param(3, 1, 16, 40, False, False, id="bf16-one-split"),
]


@pytest.mark.parametrize("b,s_q,h_q,topk,fp8,split", REPEAT)
def test_repeated_decode_writes_the_marker_in_the_kernels(b, s_q, h_q, topk, fp8, split, monkeypatch):
    """A repeated call of a signature that passed the checks runs the op's remembered plan, whose
    kernels (the decode kernel, or the merge after a split) write FlashMLA's +inf for an empty row:
    no second pass over lse, the same out and lse as the first call, a NaN fault kept."""
    a = make_decode(b=b, s_q=s_q, h_q=h_q, topk=topk, num_blocks=12, block_size=64, fp8=fp8,
                    empty=(0,), seed=topk)
    a["q"][b - 1, s_q - 1, 1, 7] = float("nan")  # a fault in the last query's second head
    from openmla.kernels.sparse_mla_decode import op as decode_op
    monkeypatch.setattr(decode_op, "num_sms", lambda device: 8)  # the split rule's SM count, fixed
    monkeypatch.setattr(decode_op, "_PLANS", {})  # (plans of other tests were made for the real one)
    monkeypatch.setattr(flashmla_compat, "_CHECKED", flashmla_compat.CheckedCalls())
    meta, _ = get_mla_metadata()

    def call():
        return flash_mla_with_kvcache(a["q"], a["k_cache"], None, None, 512, meta, softmax_scale=0.07,
                                      is_fp8_kvcache=fp8, indices=a["indices"])

    first_out, first_lse = call()  # every check, the op, lse converted; the plan remembered

    def second_pass(*args, **kwargs):
        raise AssertionError("a repeated call converted lse in a second pass")

    monkeypatch.setattr(torch.Tensor, "nan_to_num_", second_pass)
    out, lse = call()
    plans = [entry[2] for entry in flashmla_compat._CHECKED.values() if entry[2] is not None]
    assert plans and (plans[-1][5] > 1) == split  # the remembered plan's split count
    torch.testing.assert_close(out, first_out, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse, first_lse, rtol=0, atol=0, equal_nan=True)
    assert bool((lse[0, :, 0] == INF).all()) and bool((out[0, 0] == 0).all())  # the empty query
    assert bool(lse[b - 1, 1, s_q - 1].isnan()) and bool(out[b - 1, s_q - 1, 1].isnan().all())
    want, want_lse = decode_ref(a, scale=0.07)
    keep = torch.ones(b, s_q, h_q, dtype=torch.bool)
    keep[b - 1, s_q - 1, 1] = False  # the oracle's NaN row is checked above
    assert_close("out", out[keep], want[keep], "sparse_decode")
    assert_close("lse", lse.transpose(1, 2)[keep], want_lse.transpose(1, 2)[keep], "lse")


@pytest.mark.parametrize("case", ["s_q1-lengths", "s_q3", "tokens-not-flat", "fp8-dtype-cache"])
def test_repeated_decode_on_flashmla_tensors_as_they_are(case, monkeypatch):
    """A repeated call launches the remembered plan on FlashMLA's 4-D tensors through a layout
    (no reshape into the op's views) where b and s_q flatten into one token stride and the cache
    has the plan's dtype; elsewhere through the reshaped views. Same out and lse as the first
    call, and as the oracle, either way."""
    s_q = 1 if case == "s_q1-lengths" else 3
    a = make_decode(b=2, s_q=s_q, h_q=5, topk=40, num_blocks=6, block_size=16, empty=(1,), seed=7,
                    fp8_dtype=case == "fp8-dtype-cache")
    if case == "tokens-not-flat":  # s_q's stride does not flatten with b's: a slice of 4 tokens
        big = torch.randn(2, 4, 5, 576, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEVICE)
        big[:, :3] = a["q"]
        a["q"] = big[:, :3]
    lengths = torch.tensor([33, 5], dtype=torch.int32, device=DEVICE) if case == "s_q1-lengths" else None
    monkeypatch.setattr(flashmla_compat, "_CHECKED", flashmla_compat.CheckedCalls())
    meta, _ = get_mla_metadata()

    def call():
        return flash_mla_with_kvcache(a["q"], a["k_cache"], None, None, 512, meta, softmax_scale=0.06,
                                      is_fp8_kvcache=True, indices=a["indices"], topk_length=lengths)

    first_out, first_lse = call()
    (entry,) = flashmla_compat._CHECKED.values()
    direct = case in ("s_q1-lengths", "s_q3")
    assert (entry[4] is not None) == direct
    if direct:  # the repeated call must not build the op's views
        monkeypatch.setattr(flashmla_compat, "_op_args", lambda *x: pytest.fail("reshaped the inputs"))
    out, lse = call()
    assert lse.shape == (2, 5, s_q) and lse.is_contiguous() and out.shape == (2, s_q, 5, 512)
    assert torch.equal(out, first_out) and torch.equal(lse, first_lse)
    want, want_lse = decode_ref(a, scale=0.06, topk_length=lengths)
    assert_close("out", out, want, "sparse_decode")
    assert_close("lse", lse, want_lse, "lse")
    assert bool((lse.transpose(1, 2).reshape(-1, 5)[1] == INF).all())  # the empty query


def test_compiled_repeated_call_goes_through_the_custom_op(monkeypatch):
    """After eager calls remembered the signature (and the op's plan), a call traced by
    torch.compile still reaches the op's registered custom op, with the eager result."""
    from openmla.kernels.sparse_mla_decode import op as decode_op
    a = make_decode(b=2, s_q=1, h_q=3, topk=9, num_blocks=2, block_size=8, empty=(0,), seed=3)
    meta, _ = get_mla_metadata()

    def call(q, k_cache, indices):
        return flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, softmax_scale=0.1,
                                      is_fp8_kvcache=True, indices=indices)

    call(a["q"], a["k_cache"], a["indices"])
    want_out, want_lse = call(a["q"], a["k_cache"], a["indices"])  # the planned route
    calls = []
    real = decode_op._sparse_mla_decode_op
    monkeypatch.setattr(decode_op, "_sparse_mla_decode_op", lambda *x: calls.append(1) or real(*x))
    torch._dynamo.reset()
    out, lse = torch.compile(call, backend="eager")(a["q"], a["k_cache"], a["indices"])
    torch._dynamo.reset()
    assert calls, "torch.compile did not reach the registered op"
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert bool((lse[0] == INF).all())  # the empty query: FlashMLA's marker on both routes


def test_decode_metadata_reuse_checked():
    a = make_decode(b=1, s_q=1, h_q=3, topk=9, num_blocks=2, block_size=8, seed=3)
    meta, _ = get_mla_metadata(a["cache_seqlens"], 3, 1, 3, True, 9)  # README-style hints
    args = (a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], 512, meta)
    first, _ = flash_mla_with_kvcache(*args, is_fp8_kvcache=True, indices=a["indices"])
    again, _ = flash_mla_with_kvcache(*args, is_fp8_kvcache=True, indices=a["indices"])
    assert torch.equal(first, again) and meta.have_initialized
    with pytest.raises(ValueError, match="topk"):
        flash_mla_with_kvcache(*args, is_fp8_kvcache=True, indices=a["indices"][..., :5])
    hinted, _ = get_mla_metadata(a["cache_seqlens"], 4, 1, 4, True, 9)  # says h_q = 4
    with pytest.raises(ValueError, match="h_q"):
        flash_mla_with_kvcache(a["q"], a["k_cache"], None, None, 512, hinted, is_fp8_kvcache=True,
                               indices=a["indices"])


# ------------------------------------------------------------------------------------------------
# Prefill against the oracle
# ------------------------------------------------------------------------------------------------
PREFILL = [  # s_q, h_q, topk, s_kv, sink, lengths
    pytest.param(3, 3, 37, 50, False, None, id="s3-H3-topk37"),
    pytest.param(4, 16, 33, 90, True, (33, 0, 7, 100), id="s4-H16-topk33-sink-len"),
]


@pytest.mark.parametrize("s_q,h_q,topk,s_kv,sink,lengths", PREFILL)
def test_prefill_matches_oracle(s_q, h_q, topk, s_kv, sink, lengths):
    g = torch.Generator().manual_seed(s_q * 100 + h_q)
    wide = torch.full((s_kv + 4, 1, 640), float("nan"), dtype=torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32)
    bad = torch.tensor(invalid_indices(s_kv), dtype=torch.int32)
    mask = torch.rand(s_q, 1, topk, generator=g) < 0.25
    idx[mask] = bad[torch.randint(0, len(bad), (int(mask.sum()),), generator=g)]
    idx[-1] = bad[torch.arange(topk) % len(bad)]  # the last query: no valid index
    used = torch.unique(idx[(idx >= 0) & (idx < s_kv)]).long()
    # magnitudes of FlashMLA's and openmla's prefill tests (kv / 10): the kernel's bf16 P.V
    # is specified for those
    wide[used, 0, 16:592] = (torch.randn(len(used), 576, generator=g) / 10).to(torch.bfloat16)
    kv = wide.to(DEVICE)[:s_kv, :, 16:592]  # strided rows; unused rows stay NaN
    q = torch.randn(s_q, h_q, 576, generator=g).to(torch.bfloat16).to(DEVICE)
    attn_sink = None
    if sink:  # FlashMLA: a -inf sink changes nothing, a +inf one zeroes the output
        attn_sink = (torch.randn(h_q, generator=g) * 2).to(DEVICE)
        attn_sink[0], attn_sink[1] = INF, -INF
    topk_length = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, max_logits, lse = flash_mla_sparse_fwd(q, kv, idx.to(DEVICE), 0.083, attn_sink=attn_sink,
                                                topk_length=topk_length)
    want, want_ml, want_lse = sparse_mla_ref(q, kv[:, 0], idx[:, 0].to(DEVICE), scale=0.083,
                                             topk_length=topk_length, attn_sink=attn_sink)
    want_lse = torch.where(want_lse == -INF, INF, want_lse)  # FlashMLA's empty-row marker
    assert out.shape == (s_q, h_q, 512) and out.dtype == torch.bfloat16
    assert_close("out", out.float(), want, "sparse_prefill")
    assert_close("max_logits", max_logits, want_ml, "lse")
    assert_close("lse", lse, want_lse, "lse")
    assert bool((lse[-1] == INF).all()) and bool((max_logits[-1] == -INF).all())
    assert bool((out[-1] == 0).all())
    if sink:
        assert bool((out[:, 0] == 0).all())


# ------------------------------------------------------------------------------------------------
# Refusals: bad shapes -> ValueError naming the argument; unsupported paths -> NotImplementedError
# ------------------------------------------------------------------------------------------------
def _decode_args():
    a = make_decode(b=1, s_q=1, h_q=2, topk=5, num_blocks=2, block_size=4, seed=5)
    return dict(q=a["q"], k_cache=a["k_cache"], block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=get_mla_metadata()[0], is_fp8_kvcache=True, indices=a["indices"])


DECODE_BAD = [
    pytest.param("q", lambda a: a["q"][0], ValueError, "q.dim", id="q-3d"),
    pytest.param("q", lambda a: a["q"][..., :512], ValueError, "q.shape", id="q-d512"),
    pytest.param("k_cache", lambda a: a["k_cache"].expand(-1, -1, 2, -1), ValueError, "k_cache.shape", id="hk2"),
    pytest.param("k_cache", lambda a: a["k_cache"][..., :576], ValueError, "k_cache.shape", id="cache-576-fp8"),
    pytest.param("indices", lambda a: a["indices"].expand(2, -1, -1), ValueError, "indices.shape", id="idx-b2"),
    pytest.param("indices", lambda a: a["indices"].long(), ValueError, "indices.dtype", id="idx-int64"),
    pytest.param("head_dim_v", lambda a: 256, ValueError, "head_dim_v", id="dv256"),
    pytest.param("topk_length", lambda a: torch.ones(2, dtype=torch.int32), ValueError, "topk_length", id="len-b2"),
    pytest.param("softmax_scale", lambda a: True, ValueError, "by keyword", id="scale-bool"),
    pytest.param("num_splits", lambda a: torch.ones(1), ValueError, "num_splits", id="num-splits-tensor"),
    pytest.param("tile_scheduler_metadata", lambda a: None, ValueError, "tile_scheduler_metadata", id="meta-none"),
    pytest.param("indices", lambda a: None, NotImplementedError, "dense", id="dense-path"),
    pytest.param("extra_k_cache", lambda a: a["k_cache"], ValueError, "extra_indices_in_kvcache",
                 id="extra-cache-without-indices"),
    pytest.param("extra_indices_in_kvcache", lambda a: a["indices"], ValueError, "extra_indices_in_kvcache",
                 id="extra-indices-without-cache"),
    pytest.param("extra_topk_length", lambda a: torch.ones(1, dtype=torch.int32), ValueError,
                 "extra_topk_length", id="extra-length-without-cache"),
    pytest.param("causal", lambda a: True, NotImplementedError, "causal", id="causal"),
]


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-a-good-call"])
@pytest.mark.parametrize("name,value,exc,match", DECODE_BAD)
def test_decode_refuses(name, value, exc, match, warm):
    """Also after a good call with the same metadata (warm): checked call signatures are
    remembered, and a changed argument must still be checked."""
    args = _decode_args()
    if warm:
        flash_mla_with_kvcache(**args)
    args[name] = value(args)
    with pytest.raises(exc, match=match):
        flash_mla_with_kvcache(**args)


PREFILL_BAD = [
    pytest.param("kv", lambda a: a["kv"].expand(-1, 2, -1), ValueError, "kv.shape", id="hkv2"),
    pytest.param("kv", lambda a: a["kv"][:, 0], ValueError, "kv.dim", id="kv-2d"),
    pytest.param("indices", lambda a: a["indices"][:, 0], ValueError, "indices.dim", id="idx-2d"),
    pytest.param("indices", lambda a: a["indices"][:1], ValueError, "indices.shape", id="idx-sq1"),
    pytest.param("d_v", lambda a: 256, ValueError, "d_v", id="dv256"),
    pytest.param("sm_scale", lambda a: None, ValueError, "sm_scale", id="scale-none"),
    pytest.param("attn_sink", lambda a: torch.zeros(3), ValueError, "attn_sink", id="sink-h3"),
    pytest.param("indexer_topk", lambda a: 512, NotImplementedError, "indexer_topk", id="indexer"),
]


@pytest.mark.parametrize("name,value,exc,match", PREFILL_BAD)
def test_prefill_refuses(name, value, exc, match):
    args = dict(q=torch.randn(2, 2, 576).to(torch.bfloat16), kv=torch.randn(8, 1, 576).to(torch.bfloat16),
                indices=torch.zeros(2, 1, 3, dtype=torch.int32), sm_scale=0.1)
    args = {k: v.to(DEVICE) for k, v in args.items() if isinstance(v, torch.Tensor)} | {"sm_scale": 0.1}
    args[name] = value(args)
    with pytest.raises(exc, match=match):
        flash_mla_sparse_fwd(**args)


@pytest.mark.parametrize("value", [
    pytest.param(None, id="None"), pytest.param(0.0, id="zero"),
    pytest.param(float("nan"), id="nan"), pytest.param("0.1", id="str"),
    pytest.param(torch.tensor(0.1), id="tensor"), pytest.param(True, id="bool"),
])
def test_prefill_scale_errors_name_sm_scale(value):
    """Every refused sm_scale is reported under the caller's name, sm_scale, with the same rule
    as the op (finite, nonzero); None (FlashMLA has no default here) gets a message that does not
    offer None."""
    args = dict(q=torch.randn(2, 2, 576).to(torch.bfloat16).to(DEVICE),
                kv=torch.randn(8, 1, 576).to(torch.bfloat16).to(DEVICE),
                indices=torch.zeros(2, 1, 3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError) as e:
        flash_mla_sparse_fwd(**args, sm_scale=value)
    msg = str(e.value)
    assert msg.startswith("sm_scale: expected a finite nonzero float"), msg
    if value is None:
        assert "no default" in msg and "or None" not in msg, msg


@pytest.mark.parametrize("fp8", [pytest.param(True, id="fp8"), pytest.param(False, id="bf16")])
@pytest.mark.parametrize("b, s_q", [pytest.param(0, 2, id="b0"), pytest.param(2, 0, id="s_q0"),
                                    pytest.param(0, 0, id="b0-s_q0")])
def test_decode_empty_batch(b, s_q, fp8):
    """An empty batch returns FlashMLA's shapes (out [b, s_q, h_q, 512], lse [b, h_q, s_q])."""
    fmt = FP8_DS_MLA if fp8 else BF16_MLA
    cache, _ = random_paged_cache(2, 4, fmt.row_width, fmt.cache_dtype)
    q = torch.randn(b, s_q, 3, 576).to(torch.bfloat16).to(DEVICE)
    for topk_length in (None, torch.ones(b, dtype=torch.int32, device=DEVICE)):
        out, lse = flash_mla_with_kvcache(q, cache.unsqueeze(2), None, None, 512, get_mla_metadata()[0],
                                          softmax_scale=0.07, is_fp8_kvcache=fp8,
                                          indices=torch.zeros(b, s_q, 5, dtype=torch.int32, device=DEVICE),
                                          topk_length=topk_length)
        assert out.shape == (b, s_q, 3, 512) and out.dtype == torch.bfloat16
        assert lse.shape == (b, 3, s_q) and lse.dtype == torch.float32


def test_prefill_empty_batch():
    out, max_logits, lse = flash_mla_sparse_fwd(
        torch.randn(0, 3, 576).to(torch.bfloat16).to(DEVICE), torch.randn(8, 1, 576).to(torch.bfloat16).to(DEVICE),
        torch.zeros(0, 1, 5, dtype=torch.int32, device=DEVICE), 0.07)
    assert out.shape == (0, 3, 512) and max_logits.shape == lse.shape == (0, 3)


def test_signatures_match_flashmla():
    """Argument names, order and defaults as FlashMLA's flash_mla_interface.py."""
    dec = inspect.signature(flashmla_compat.flash_mla_with_kvcache).parameters
    assert list(dec) == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                         "num_splits", "softmax_scale", "causal", "is_fp8_kvcache", "indices", "attn_sink",
                         "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length"]
    assert [dec[n].default for n in ("num_splits", "softmax_scale", "causal", "is_fp8_kvcache", "indices")] == \
        [None, None, False, False, None]
    pre = inspect.signature(flashmla_compat.flash_mla_sparse_fwd).parameters
    assert list(pre) == ["q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length", "indexer_topk"]
    assert [pre[n].default for n in ("d_v", "attn_sink", "topk_length", "indexer_topk")] == [512, None, None, 0]
