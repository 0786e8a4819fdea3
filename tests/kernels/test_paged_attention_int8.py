"""kernels.paged_attention over int8 caches (issue 8): int8_qkv and int8_qk.

The caches are built by the torch quantizers of `quant/int8.py` from the adversarial bf16 batches
of tests.helpers.kernels.build (strided views, shuffled block tables, invalid unused entries,
padding rows): unwritten rows hold the byte -128 (the quantizer never produces it) and NaN K
scales, so reading one shows. The oracle (`paged_attention_ref` with int8 caches) quantizes q by
the same rule and computes in float64 from the same int8 values and scales, so bf16 tolerances
apply. A second group measures the error against unquantized bf16 attention.
"""
import math

import pytest
import torch

from openmla.kernels.cascade import cascade_attention
from openmla.kernels.paged_attention import paged_attention
from openmla.kernels.reference import paged_attention_ref
from openmla.quant import FP8_PER_TENSOR, INT8_QK, INT8_QKV, MHA_AUTO
from openmla.quant.int8 import (calibrate_k_smooth, calibrate_v_scale, quantize_per_channel_ref,
                        quantize_per_token_head_ref)
from openmla.quant.kv_cache import cache_dims, write_kv_cache
from tests.helpers import DEVICE, GPU_ONLY, assert_close, paged_batch
from tests.helpers.kernels import build, kv_len

POISON = -128  # never written by the int8 quantizers (they clamp to +-127)


def _nhd(cache, layout):
    """[num_blocks, block_size, H_kv, D] view of a cache in `layout`."""
    return cache if layout == "NHD" else cache.transpose(1, 2)


def _int8_view(like, layout):
    """An int8 cache shaped like `like`, a strided view with one hidden row per block, poisoned."""
    nb, bs, h, d = cache_dims(like, layout)
    shape = (nb, bs + 1, h, d) if layout == "NHD" else (nb, h, bs + 1, d)
    back = torch.full(shape, POISON, dtype=torch.int8, device=like.device)
    return back[:, :bs] if layout == "NHD" else back[:, :, :bs]


def to_int8(b, mode, k_smooth=None):
    """The bf16 batch `b` with its caches quantized: mode "int8_qkv" or "int8_qk"; with k_smooth
    [H_kv, D], K is stored as the quantization of K / k_smooth (write_kv_cache's rule)."""
    layout = b["layout"]
    nb, bs, H_kv, D = cache_dims(b["k_cache"], layout)
    k = _nhd(b["k_cache"], layout).reshape(nb * bs, H_kv, D)
    if k_smooth is not None:
        k = k.float() / k_smooth
    k8, ks = quantize_per_token_head_ref(k)  # unwritten (NaN) rows: scale NaN
    unused = torch.isnan(ks)
    kc = _int8_view(b["k_cache"], layout)
    _nhd(kc, layout).copy_(k8.masked_fill(unused[..., None], POISON).view(nb, bs, H_kv, D))
    ksc_back = torch.full((nb, H_kv, bs + 3), float("nan"), device=k.device)
    ksc = ksc_back[:, :, 1:bs + 1]  # a strided view
    ksc.copy_(ks.view(nb, bs, H_kv).transpose(1, 2))
    out = {**b, "k_cache": kc, "k_scale_cache": ksc, "k_scale": None, "v_scale": None,
           "k_smooth": k_smooth}
    if mode == "int8_qkv":
        v = _nhd(b["v_cache"], layout).reshape(nb * bs, H_kv, D)
        seen = ~torch.isnan(v).any(-1).any(-1)
        v_scale = calibrate_v_scale(v[seen])
        v8 = quantize_per_channel_ref(v.nan_to_num(0.0), v_scale)
        vc = _int8_view(b["v_cache"], layout)
        _nhd(vc, layout).copy_(v8.masked_fill(~seen[:, None, None], POISON).view(nb, bs, H_kv, D))
        out.update(v_cache=vc, v_scale=v_scale)
    return out


def run_int8(b, H, *, sinks=False, alibi=False, num_splits=None, **opts):
    g = torch.Generator().manual_seed(3)
    if sinks:
        opts["sinks"] = (torch.randn(H, generator=g) * 2).to(DEVICE)
    if alibi:
        opts["alibi_slopes"] = (torch.rand(H, generator=g) * 0.3 + 0.02).to(DEVICE)
    opts.setdefault("scale", 0.83 / math.sqrt(b["q"].shape[-1]))
    out, lse = paged_attention(**b, **opts, return_lse=True, num_splits=num_splits)
    want_out, want_lse = paged_attention_ref(**b, **opts)
    assert out.dtype == b["q"].dtype and out.shape == b["q"].shape
    assert_close("out", out, want_out, "bf16")
    assert_close("lse", lse, want_lse, "fp32")
    return out, lse


MODES = ["int8_qkv", "int8_qk"]

# ---------------------------------------------------------------------------------------------
# Against the oracle on the same quantized values
# ---------------------------------------------------------------------------------------------
CASES = [  # (seqs, H, H_kv, D, bs, build options, run options)
    pytest.param([(1, 900), (1, 37), (1, 1)], 8, 2, 128, 16, {}, {}, id="decode-gqa4-D128-bs16"),
    pytest.param([(4, 300), (1, 90)], 8, 8, 64, 16, {"layout": "HND"}, {}, id="spec4-mha-HND"),
    pytest.param([(70, 500), (33, 33), (1, 60)], 8, 2, 64, 16, {}, {}, id="prefill-interior-tiles"),
    pytest.param([(3, 120)], 6, 3, 40, 61, {}, {}, id="D40-bs61"),
    pytest.param([(2, 70)], 4, 2, 8, 1, {"layout": "HND"}, {}, id="D8-bs1-HND"),
    pytest.param([(1, 1328), (2, 17)], 8, 2, 64, 16, {}, {"num_splits": 5}, id="split-kv-5"),
    pytest.param([(40, 400)], 8, 2, 64, 16, {}, {"window": (100, 0), "sinks": True, "softcap": 15.0},
                 id="window-sinks-softcap"),
    pytest.param([(5, 200)], 4, 1, 64, 16, {"dtype": "fp16"}, {"alibi": True}, id="fp16-alibi"),
    pytest.param([(6, 3), (1, 20)], 4, 2, 64, 16, {}, {}, id="masked-rows"),
    pytest.param([(70, 500), (1, 90)], 8, 2, 64, 16, {}, {"scale": -0.09}, id="negative-scale"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seqs,H,H_kv,D,bs,bopts,opts", CASES)
def test_int8_matches_oracle(mode, seqs, H, H_kv, D, bs, bopts, opts):
    seqs = [(q, kv_len(kv)) for q, kv in seqs]
    run_int8(to_int8(build(seqs, H, H_kv, D, bs, **bopts), mode), H, **opts)


@pytest.mark.parametrize("mode", MODES)
def test_written_by_write_kv_cache(mode):
    """The pipeline as an engine runs it: write_kv_cache quantizes new tokens into int8 caches
    (Triton writer), paged_attention reads them; the oracle reads the same caches."""
    g = torch.Generator().manual_seed(5)
    H, H_kv, D, bs, nb = 8, 2, 64, 16, 24
    lens = [kv_len(150), 40]
    kc = torch.full((nb, bs, H_kv, D), POISON, dtype=torch.int8, device=DEVICE)
    vdt = torch.int8 if mode == "int8_qkv" else torch.bfloat16
    vc = torch.full((nb, bs, H_kv, D), POISON if vdt == torch.int8 else float("nan"), dtype=vdt,
                    device=DEVICE)
    ksc = torch.full((nb, H_kv, bs), float("nan"), device=DEVICE)
    table = torch.randperm(nb, generator=g)[:2 * 10].view(2, 10).to(torch.int32)
    k = torch.randn(sum(lens), H_kv, D, generator=g)
    v = torch.randn(sum(lens), H_kv, D, generator=g)
    v_scale = calibrate_v_scale(v).to(DEVICE) if mode == "int8_qkv" else None
    slots = torch.cat([table[r, torch.arange(n) // bs] * bs + torch.arange(n) % bs
                       for r, n in enumerate(lens)])
    write_kv_cache(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE), v_scale=v_scale,
                   k_scale_cache=ksc)
    b = dict(q=torch.randn(3, H, D, generator=g).bfloat16().to(DEVICE), k_cache=kc, v_cache=vc,
             block_table=table.to(DEVICE), seq_lens=torch.tensor(lens, dtype=torch.int32).to(DEVICE),
             cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32).to(DEVICE),
             k_scale_cache=ksc, v_scale=v_scale)
    run_int8(b, H)


def test_q_quantization_is_per_token_and_head():
    """Scaling one (token, head) row of q by 2^k changes only that row's int8 scale, so its
    output equals attention with that row's softmax scale times 2^k (exact in the int8 domain)."""
    b = to_int8(build([(3, kv_len(200))], 4, 2, 64, 16, pad_rows=0), "int8_qkv")
    q = b["q"].clone()
    q[1, 2] *= 8.0  # a power of two: the quantized row is identical, its scale 8x
    got = paged_attention(**{**b, "q": q}, scale=0.05)
    want = paged_attention(**b, scale=0.4)
    assert torch.equal(got[1, 2], want[1, 2])
    base = paged_attention(**b, scale=0.05)
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(got[keep], base[keep])


# ---------------------------------------------------------------------------------------------
# Against unquantized bf16 attention: what the format costs
# ---------------------------------------------------------------------------------------------
def _rel_l2(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("mode,bound", [("int8_qkv", 2e-2), ("int8_qk", 2e-2)])
def test_error_against_bf16_gaussian(mode, bound):
    """Gaussian K/V (decode over 1-2k keys, GQA 4): measured rel L2 ~1.2e-2 (int8_qkv) and
    ~0.9e-2 (int8_qk) in float64 (docs/accuracy.md); the bound leaves room for seeds."""
    seqs = [(1, kv_len(2000)), (1, kv_len(1500)), (2, 700)]
    b = build(seqs, 8, 2, 128, 16)
    want = paged_attention_ref(**b, scale=128 ** -0.5)[0]
    got = paged_attention(**to_int8(b, mode), scale=128 ** -0.5)
    T = sum(q for q, _ in seqs)
    assert _rel_l2(got[:T], want[:T]) <= bound


def _outlier_batch(seqs, H, H_kv, D, seed=0):
    """A bf16 batch whose K and V have 1 channel in 64 (per KV head) scaled by U(50, 200), with q
    divided by the same factor on its KV head's channels (tools/sweep.py's "outliers" kind:
    every channel still counts in the scores)."""
    g = torch.Generator().manual_seed(seed + 11)
    b = build(seqs, H, H_kv, D, 16, seed=seed)
    gain = torch.ones(H_kv, D)
    for h in range(H_kv):
        ch = torch.randperm(D, generator=g)[:max(1, D // 64)]
        gain[h, ch] = torch.empty(len(ch)).uniform_(50, 200, generator=g)
    gain = gain.to(DEVICE)
    for c in ("k_cache", "v_cache"):  # unwritten rows stay NaN
        b[c] = _scaled_view(b[c], gain)
    q = (b["q"].float() / gain.repeat_interleave(H // H_kv, 0)).to(b["q"].dtype)
    return {**b, "q": q}


def _scaled_view(c, gain):
    """c * gain (per head and channel) in a fresh strided view with the same hidden rows."""
    back = torch.full((c.shape[0], c.shape[1] + 1) + tuple(c.shape[2:]), float("nan"),
                      dtype=c.dtype, device=c.device)
    view = back[:, :c.shape[1]]
    view.copy_((c.float() * gain).to(c.dtype))
    return view


def _seen_keys(b):
    nb, bs, H_kv, D = b["k_cache"].shape
    k = b["k_cache"].reshape(nb * bs, H_kv, D)
    return k[~torch.isnan(k).any(-1).any(-1)]


@pytest.mark.parametrize("mode", MODES)
def test_error_against_bf16_outlier_channels(mode):
    """Issue 8's bar: rel. L2 <= 3e-2 against unquantized bf16 attention on outlier-channel data.
    Per-token K scales alone cannot (measured 0.27-0.51 in docs/accuracy.md, > 0.1 here): the
    outlier channel sets each key's scale. With per-channel K smoothing calibrated on the keys and
    a few queries (quant.int8.calibrate_k_smooth) it holds."""
    seqs = [(1, kv_len(2000)), (1, kv_len(1500)), (2, 700)]
    T = sum(q for q, _ in seqs)
    b = _outlier_batch(seqs, 8, 2, 128)
    want = paged_attention_ref(**b, scale=128 ** -0.5)[0][:T]
    plain = paged_attention(**to_int8(b, mode), scale=128 ** -0.5)[:T]
    assert _rel_l2(plain, want) > 0.1
    f = calibrate_k_smooth(_seen_keys(b), b["q"][:T])
    smooth = paged_attention(**to_int8(b, mode, k_smooth=f), scale=128 ** -0.5)[:T]
    assert _rel_l2(smooth, want) <= 3e-2


SMOOTH = [  # (seqs, H, H_kv, D, bs, build options, run options)
    pytest.param([(1, 900), (4, 60)], 8, 2, 64, 16, {}, {"num_splits": 3}, id="decode-split"),
    pytest.param([(70, 500), (1, 33)], 8, 2, 64, 16, {"layout": "HND"}, {"scale": -0.09},
                 id="prefill-HND-negative-scale"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seqs,H,H_kv,D,bs,bopts,opts", SMOOTH)
def test_k_smooth_matches_oracle(mode, seqs, H, H_kv, D, bs, bopts, opts):
    """The kernel multiplies q by the factors of its KV head before quantizing, as the oracle."""
    seqs = [(q, kv_len(kv)) for q, kv in seqs]
    g = torch.Generator().manual_seed(8)
    f = (torch.rand(H_kv, D, generator=g) * 8 + 0.125).to(DEVICE)  # 0.125..8.125, not powers of 2
    run_int8(to_int8(build(seqs, H, H_kv, D, bs, **bopts), mode, k_smooth=f), H, **opts)


STREAM_CASES = [  # short queries, the class whose autotuning may pick key streams
    pytest.param([(1, 900), (1, 37), (1, 1)], 8, 2, 128, 16, {}, {"num_splits": 3},
                 id="decode-gqa4-D128-split3"),
    pytest.param([(4, 300), (1, 90)], 8, 8, 64, 16, {"layout": "HND"}, {"sinks": True},
                 id="spec4-mha-HND-sinks"),
    pytest.param([(3, 120)], 6, 3, 40, 61, {}, {"window": (50, 0)}, id="D40-bs61-window"),
    pytest.param([(6, 3), (1, 20)], 4, 2, 64, 16, {}, {"scale": -0.09}, id="masked-rows-neg-scale"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("streams,bn", [(2, 64), (4, 128)], ids=["streams2-BN64", "streams4-BN128"])
@pytest.mark.parametrize("seqs,H,H_kv,D,bs,bopts,opts", STREAM_CASES)
def test_key_streams_match_oracle(mode, streams, bn, seqs, H, H_kv, D, bs, bopts, opts,
                                  monkeypatch):
    """One key stream per warp (the int8 decode configs' layout), with K smoothing: the same
    answers as the oracle."""
    import openmla.kernels.paged_attention.kernel as pa
    cfg = pa._config(16, bn, streams, 3, streams=streams)
    monkeypatch.setattr(pa.paged_attention_kernel, "configs", [cfg])  # one config: no tuning
    seqs = [(q, kv_len(kv)) for q, kv in seqs]
    f = (torch.rand(H_kv, D, generator=torch.Generator().manual_seed(9)) * 4 + 0.3).to(DEVICE)
    run_int8(to_int8(build(seqs, H, H_kv, D, bs, **bopts), mode, k_smooth=f), H, **opts)
    assert pa.paged_attention_kernel.best_config.kwargs["STREAMS"] == streams


@pytest.mark.parametrize("mode,smooth", [("int8_qkv", False), ("int8_qk", True)])
def test_cascade_over_int8_caches(mode, smooth):
    """cascade_attention passes the int8 scale cache (and smoothing) to both of its passes: the
    merged result is attention over the whole context."""
    b = paged_batch([(1, 60), (3, 41), (1, 55)], 8, 2, 64, 16, shared_blocks=2)
    f = (torch.rand(2, 64, generator=torch.Generator().manual_seed(2)) * 4 + 0.3).to(DEVICE)
    b = to_int8(b, mode, k_smooth=f if smooth else None)
    out, lse = cascade_attention(**b, common_prefix_len=32, scale=0.11, return_lse=True)
    want, want_lse = paged_attention_ref(**b, scale=0.11)
    assert_close("out", out, want, "bf16")
    assert_close("lse", lse, want_lse, "fp32")


@pytest.mark.parametrize("mode", MODES)
def test_format_descriptor_argument(mode):
    """fmt= (a layer's descriptor) gives what the cache dtypes alone give; the other int8 format
    is refused: int8_qkv caches read as int8_qk would take V for the model's dtype."""
    b = to_int8(build([(2, 30), (1, 9)], 4, 2, 16, 8), mode)
    fmt, other = (INT8_QKV, INT8_QK) if mode == "int8_qkv" else (INT8_QK, INT8_QKV)
    want = paged_attention(**b, scale=0.3)
    assert torch.equal(paged_attention(**b, scale=0.3, fmt=fmt), want)
    with pytest.raises(ValueError, match=r"v_cache\.dtype"):
        paged_attention(**b, scale=0.3, fmt=other)
    with pytest.raises(ValueError, match=r"k_cache\.dtype: expected torch.float8_e4m3fn"):
        paged_attention(**b, scale=0.3, fmt=FP8_PER_TENSOR)
    bf = build([(2, 30)], 4, 2, 16, 8)
    assert torch.equal(paged_attention(**bf, scale=0.3, fmt=MHA_AUTO), paged_attention(**bf, scale=0.3))
    with pytest.raises(ValueError, match="fmt: expected an MHA cache format descriptor"):
        paged_attention(**bf, scale=0.3, fmt="auto")


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
def test_bad_inputs_raise():
    b = to_int8(build([(1, 40)], 4, 2, 64, 16), "int8_qkv")
    nb, bs = b["k_cache"].shape[:2]
    kw = dict(scale=0.1)
    with pytest.raises(ValueError, match="k_scale_cache"):
        paged_attention(**{**b, "k_scale_cache": None}, **kw)
    with pytest.raises(ValueError, match=r"k_scale_cache.*\(3, 2, 16\)|k_scale_cache"):
        paged_attention(**{**b, "k_scale_cache": b["k_scale_cache"][:3]}, **kw)
    with pytest.raises(ValueError, match="k_scale_cache"):
        paged_attention(**{**b, "k_scale_cache": b["k_scale_cache"].double()}, **kw)
    with pytest.raises(ValueError, match="v_scale"):
        paged_attention(**{**b, "v_scale": None}, **kw)
    with pytest.raises(ValueError, match="v_scale"):
        paged_attention(**{**b, "v_scale": b["v_scale"][:, :32]}, **kw)
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(**{**b, "k_scale": torch.ones(1, device=DEVICE)}, **kw)
    qk = to_int8(build([(1, 40)], 4, 2, 64, 16), "int8_qk")
    with pytest.raises(ValueError, match="v_scale"):
        paged_attention(**{**qk, "v_scale": b["v_scale"]}, **kw)
    with pytest.raises(ValueError, match="v_cache"):  # int8_qk's V must be in q's dtype
        paged_attention(**{**qk, "v_cache": qk["v_cache"].half()}, **kw)
    bf = build([(1, 40)], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="v_cache"):  # int8 V needs an int8 K
        paged_attention(**{**bf, "v_cache": b["v_cache"]}, **kw)
    with pytest.raises(ValueError, match="k_scale_cache"):  # a scale cache for a bf16 K
        paged_attention(**{**bf, "k_scale_cache": b["k_scale_cache"]}, **kw)
    with pytest.raises(ValueError, match="k_smooth"):  # smoothing for a bf16 K
        paged_attention(**bf, k_smooth=torch.ones(2, 64, device=DEVICE), **kw)
    with pytest.raises(ValueError, match="k_smooth"):  # [H_kv, D] per KV head
        paged_attention(**{**b, "k_smooth": torch.ones(4, 64, device=DEVICE)}, **kw)
    odd = to_int8(build([(1, 40)], 4, 2, 8, 16), "int8_qk")
    with pytest.raises(NotImplementedError, match="multiples of 8"):
        paged_attention(**{**odd, "q": odd["q"][..., :6], "k_cache": odd["k_cache"][..., :6],
                           "v_cache": odd["v_cache"][..., :6]}, **kw)


# ---------------------------------------------------------------------------------------------
# GPU sizes
# ---------------------------------------------------------------------------------------------
@GPU_ONLY
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("R,ctx", [(1, 32768), (8, 32768), (32, 4096)])
def test_gpu_long_decode(mode, R, ctx):
    run_int8(to_int8(build([(1, ctx)] * R, 32, 8, 128, 16), mode), 32)


@GPU_ONLY
@pytest.mark.parametrize("mode", MODES)
def test_gpu_long_prefill(mode):
    run_int8(to_int8(build([(2048, 8192), (700, 700)], 16, 4, 128, 64), mode), 16)
