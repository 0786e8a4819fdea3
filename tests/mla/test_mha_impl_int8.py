"""mla.mha.impl.PagedAttentionImpl with int8 caches (issue 8): kv_cache_dtype "int8_qkv" / "int8_qk".

A step (tests.helpers.mha.make_step: contexts already cached, new tokens written by forward,
shuffled block tables, padding slots -1, strided q) runs over int8 caches built by the torch
quantizers of quant/int8.py: the cache after forward must equal, byte for byte, the cache the
torch references give for every row (unwritten rows keep their poison: int8 -128, NaN scales),
and the output must match paged_attention_ref over that expected cache within bf16 tolerance.
"""
import math

import pytest
import torch

from openmla.kernels.reference import paged_attention_ref
from openmla.mla import PagedAttentionImpl
from openmla.quant.int8 import (calibrate_k_smooth, calibrate_v_scale, quantize_per_channel_ref,
                        quantize_per_token_head_ref, save_v_scales)
from tests.helpers import DEVICE, assert_close
from tests.helpers.mha import make_step, step_plan

POISON = -128


def _int8_caches(s, mode, v_scale, *, all_rows, k_smooth=None):
    """(k_cache, v_cache, k_scale_cache) holding the context rows (all_rows=False: what the
    step starts from) or every row of every request (all_rows=True: what forward must leave)."""
    k_bf = s["want_k"]  # [nb, bs, H_kv, D] view with NaN in unwritten rows
    nb, bs, H_kv, D = k_bf.shape
    kc = torch.full((nb, bs + 1, H_kv, D), POISON, dtype=torch.int8, device=DEVICE)[:, :bs]
    if mode == "int8_qkv":
        vc = torch.full((nb, bs + 1, H_kv, D), POISON, dtype=torch.int8, device=DEVICE)[:, :bs]
    else:
        vc = torch.full((nb, bs + 1, H_kv, D), float("nan"), dtype=s["query"].dtype,
                        device=DEVICE)[:, :bs]
    ksc = torch.full((nb, H_kv, bs + 2), float("nan"), device=DEVICE)[:, :, 2:]
    table = s["block_table"].cpu()
    for r, (q_len, seq) in enumerate(zip(s["qlens"], s["seqs"])):
        n = seq if all_rows else seq - q_len
        p = torch.arange(n)
        blk, off = table[r, p // bs].long().to(DEVICE), (p % bs).to(DEVICE)
        k = s["full_k"][r][:n].to(DEVICE)
        k8, ks = quantize_per_token_head_ref(k if k_smooth is None else k.float() / k_smooth)
        kc[blk, off], ksc[blk, :, off] = k8, ks
        v = s["full_v"][r][:n].to(DEVICE)
        vc[blk, off] = quantize_per_channel_ref(v, v_scale) if mode == "int8_qkv" else v.to(vc.dtype)
    return kc, vc, ksc


def _same(a, b):
    """Equal bit for bit, NaN where NaN."""
    return bool((torch.isnan(a) == torch.isnan(b)).all() and (a.nan_to_num() == b.nan_to_num()).all())


STEPS = [  # (requests (q_len, context_len), H, H_kv, D, bs, layer options)
    pytest.param([(1, 300), (1, 40), (5, 30), (60, 0)], 8, 2, 64, 16, {}, id="mixed-gqa4"),
    pytest.param([(1, 700), (1, 9)], 4, 4, 128, 16, {"sliding_window": 200}, id="decode-window"),
    pytest.param([(3, 50), (40, 10)], 8, 2, 32, 16, {"softcap": 25.0, "sinks": True}, id="softcap-sinks"),
]


def check_step(mode, reqs, H, H_kv, D, bs, opts, *, smooth=False):
    s = make_step(reqs, H, H_kv, D, bs, kv5d=False)
    g = torch.Generator().manual_seed(4)
    sinks = (torch.randn(H, generator=g) * 2).to(DEVICE) if opts.pop("sinks", False) else None
    impl = PagedAttentionImpl(H, D, 0.81 / math.sqrt(D), H_kv, sinks=sinks, kv_cache_dtype=mode,
                              **opts)
    v_scale = k_smooth = None
    if mode == "int8_qkv":
        v_scale = impl.calibrate_v_scale(torch.cat(s["full_v"]).to(DEVICE))
    if smooth:
        k_smooth = calibrate_k_smooth(torch.cat(s["full_k"]).to(DEVICE), s["query"])
        impl.set_k_smooth(k_smooth)
    kc, vc, ksc = _int8_caches(s, mode, v_scale, all_rows=False, k_smooth=k_smooth)
    plan = step_plan(impl, s)
    out = impl.forward(s["query"], s["key"], s["value"], (kc, vc, ksc), plan)
    want_k, want_v, want_ksc = _int8_caches(s, mode, v_scale, all_rows=True, k_smooth=k_smooth)
    assert torch.equal(kc, want_k), "k_cache bytes"
    assert _same(ksc, want_ksc), "k_scale_cache"
    assert torch.equal(vc, want_v) if mode == "int8_qkv" else _same(vc, want_v), "v_cache"
    ref, _ = paged_attention_ref(s["query"], want_k, want_v, s["block_table"],
                                 s["query_start_loc"], s["seq_lens"], scale=impl.scale,
                                 window=impl.sliding_window, softcap=impl.softcap, sinks=sinks,
                                 k_scale_cache=want_ksc, v_scale=v_scale, k_smooth=k_smooth)
    T = sum(s["qlens"])
    assert_close("out", out[:T], ref[:T], "bf16")
    assert torch.equal(out[T:].float().cpu(), torch.zeros_like(out[T:].float().cpu())), "padding rows"


@pytest.mark.parametrize("mode", ["int8_qkv", "int8_qk"])
@pytest.mark.parametrize("reqs,H,H_kv,D,bs,opts", STEPS)
def test_forward_writes_and_attends(mode, reqs, H, H_kv, D, bs, opts):
    check_step(mode, reqs, H, H_kv, D, bs, dict(opts))


@pytest.mark.parametrize("mode", ["int8_qkv", "int8_qk"])
def test_forward_with_k_smooth(mode):
    """set_k_smooth: the writer stores K / f and attention quantizes q * f (both checked)."""
    check_step(mode, [(1, 200), (6, 20)], 8, 2, 64, 16, {}, smooth=True)


def test_v_scale_from_file_and_errors(tmp_path):
    H, H_kv, D = 8, 2, 64
    impl = PagedAttentionImpl(H, D, 0.1, H_kv, kv_cache_dtype="int8_qkv")
    s = make_step([(2, 20)], H, H_kv, D, 16, kv5d=False)
    kc, vc, ksc = _int8_caches(s, "int8_qk", None, all_rows=False)
    plan = step_plan(impl, s)
    with pytest.raises(ValueError, match="v_scale"):  # int8_qkv before any V scale is set
        impl.forward(s["query"], s["key"], s["value"], (kc, kc.clone(), ksc), plan)
    scale = calibrate_v_scale(torch.randn(50, H_kv, D) * 3)
    save_v_scales(tmp_path / "v.safetensors", {"layers.0.attn": scale, "layers.1.attn": scale * 2})
    impl.load_v_scale(tmp_path / "v.safetensors", "layers.1.attn")
    assert torch.equal(impl.int8_v_scale, scale * 2)
    with pytest.raises(ValueError, match="layers.7.attn"):
        impl.load_v_scale(tmp_path / "v.safetensors", "layers.7.attn")
    with pytest.raises(ValueError, match="v_scale"):
        impl.set_v_scale(torch.ones(H_kv, D + 8))
    with pytest.raises(ValueError, match="v_scale"):
        impl.set_v_scale(torch.zeros(H_kv, D))
    with pytest.raises(ValueError, match="kv_cache"):  # int8 needs the scale cache in the triple
        impl.forward(s["query"], s["key"], s["value"], (kc, kc), plan)
    with pytest.raises(ValueError, match="v_cache"):  # int8_qkv: V int8
        impl.forward(s["query"], s["key"], s["value"], (kc, vc, ksc), plan)
    qk = PagedAttentionImpl(H, D, 0.1, H_kv, kv_cache_dtype="int8_qk")
    with pytest.raises(ValueError, match="int8_qkv"):  # no V scale in int8_qk
        qk.set_v_scale(scale)
    with pytest.raises(ValueError, match="k_smooth"):
        qk.set_k_smooth(torch.zeros(H_kv, D))
    with pytest.raises(ValueError, match="k_smooth"):
        qk.set_k_smooth(torch.ones(H, D))
    with pytest.raises(ValueError, match="int8"):
        PagedAttentionImpl(H, D, 0.1, H_kv).set_k_smooth(torch.ones(H_kv, D))
    with pytest.raises(NotImplementedError, match="multiples of 8"):
        PagedAttentionImpl(H, 36, 0.1, H_kv, kv_cache_dtype="int8_qk")
    with pytest.raises(NotImplementedError, match="encoder"):
        PagedAttentionImpl(H, D, 0.1, H_kv, kv_cache_dtype="int8_qk", attn_type="encoder")
