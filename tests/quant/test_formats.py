"""quant/formats.py: the registry of cache formats and the one function that maps a kv_cache_dtype
name to its descriptor. Every name resolves (per family, openmla's and vLLM's), unknown names
fail with the supported list, descriptors are frozen and say what a cache is made of, and each
format's pack/unpack references round-trip within the format's own error bound."""
import dataclasses

import pytest
import torch

from openmla.quant import (BF16_MLA, CACHE_FORMATS, FAMILIES, FP8_DS_MLA, FP8_DS_MLA_RAW, FP8_PER_TENSOR,
                           INDEXER, INDEXER_K_FP8, INT8_QK, INT8_QKV, MHA, MHA_AUTO, MHA_BF16, MHA_FP16,
                           SPARSE_MLA, CacheFormat, CacheTensor, Scale, cache_format, formats,
                           kv_cache_dtype_names, mha_format_of)
from openmla.quant.format_types import SCALE_KINDS
from openmla.quant.kv_cache import write_kv_cache
from tests.helpers import DEVICE

ALL = [pytest.param(f, id=f"{f.family}-{f.name}") for f in CACHE_FORMATS]


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------
def test_registry_holds_every_format():
    assert {(f.family, f.name) for f in CACHE_FORMATS} == {
        (SPARSE_MLA, "bf16"), (SPARSE_MLA, "fp8_ds_mla"), (SPARSE_MLA, "fp8_ds_mla_raw"),
        (SPARSE_MLA, "fp8_model1"),
        (MHA, "auto"), (MHA, "bf16"), (MHA, "fp16"), (MHA, "fp8"), (MHA, "int8_qkv"), (MHA, "int8_qk"),
        (INDEXER, "fp8_indexer"), (INDEXER, "fp8_indexer_raw")}
    assert len({(f.family, f.name) for f in CACHE_FORMATS}) == len(CACHE_FORMATS)
    for fam in FAMILIES:
        assert formats(fam) == tuple(f for f in CACHE_FORMATS if f.family == fam)


@pytest.mark.parametrize("fmt", ALL)
def test_every_name_resolves_to_its_format(fmt):
    assert fmt.kv_cache_dtypes[0] == fmt.name
    for name in fmt.kv_cache_dtypes + fmt.vllm_kv_cache_dtypes:
        assert cache_format(name, fmt.family) is fmt
    for name in fmt.vllm_kv_cache_dtypes:
        assert cache_format(name, fmt.family, vllm=True) is fmt
    for name in set(fmt.kv_cache_dtypes) - set(fmt.vllm_kv_cache_dtypes):
        if name not in kv_cache_dtype_names(fmt.family, vllm=True):
            with pytest.raises(NotImplementedError, match=f"kv_cache_dtype {name!r} is not supported"):
                cache_format(name, fmt.family, vllm=True)
    assert cache_format(fmt, fmt.family) is fmt  # a descriptor is accepted where a name is


def test_the_names_users_and_vllm_pass():
    """The names the layers and the vLLM adapters accepted before the registry, unchanged."""
    assert set(kv_cache_dtype_names(SPARSE_MLA, vllm=True)) == {"auto", "bfloat16", "fp8_ds_mla", "fp8"}
    assert set(kv_cache_dtype_names(MHA, vllm=True)) == {"auto", "bfloat16", "float16", "fp8", "fp8_e4m3"}
    assert {"auto", "bf16", "fp8_ds_mla"} <= set(kv_cache_dtype_names(SPARSE_MLA))
    assert {"auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "int8_qkv", "int8_qk"} <= set(
        kv_cache_dtype_names(MHA))
    # the same name means different formats in the two families, as in vLLM
    assert cache_format("auto", SPARSE_MLA) is BF16_MLA and cache_format("auto", MHA) is MHA_AUTO
    assert cache_format("fp8", SPARSE_MLA) is FP8_DS_MLA and cache_format("fp8", MHA) is FP8_PER_TENSOR


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("vllm", [False, True], ids=["openmla", "vllm"])
@pytest.mark.parametrize("name", ["fp8_e5m2", "int8", "nvfp4_ds_mla", "", "FP8_DS_MLA"])
def test_unknown_names_fail_with_the_supported_list(family, vllm, name):
    with pytest.raises(NotImplementedError) as e:
        cache_format(name, family, vllm=vllm, who="MyLayer")
    msg = str(e.value)
    assert msg.startswith(f"MyLayer: kv_cache_dtype {name!r} is not supported; supported: ")
    for n in kv_cache_dtype_names(family, vllm=vllm):
        assert repr(n) in msg


def test_wrong_family_and_wrong_types():
    with pytest.raises(NotImplementedError, match=r"mha:fp8 is a mha format; supported: the sparse_mla formats"):
        cache_format(FP8_PER_TENSOR, SPARSE_MLA)
    with pytest.raises(NotImplementedError, match="sparse_mla:fp8_ds_mla is a sparse_mla format"):
        cache_format(FP8_DS_MLA, MHA)
    for bad in (None, torch.bfloat16, 8):
        with pytest.raises(ValueError, match="kv_cache_dtype: expected a name"):
            cache_format(bad, MHA)
    with pytest.raises(ValueError, match="family: expected one of"):
        cache_format("auto", "mla")


# ---------------------------------------------------------------------------------------------
# Descriptors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ALL)
def test_descriptors_are_frozen_and_complete(fmt):
    assert isinstance(fmt, CacheFormat) and dataclasses.is_dataclass(fmt)
    field = dataclasses.fields(fmt)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(fmt, field, getattr(fmt, field))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fmt.name = "other"
    assert hash(fmt) == hash(dataclasses.replace(fmt)) and fmt == dataclasses.replace(fmt)
    assert fmt.about and str(fmt) == f"{fmt.family}:{fmt.name}"
    assert fmt.tensors and all(isinstance(t, CacheTensor) for t in fmt.tensors)
    assert all(isinstance(s, Scale) and s.kind in SCALE_KINDS for s in fmt.scales)
    assert fmt.quantized == bool(fmt.scales)


def test_what_the_caches_are_made_of():
    assert [(t.name, t.dtype) for t in FP8_DS_MLA.tensors] == [("cache", torch.uint8)]
    assert FP8_DS_MLA.tensors[0].shape == "[num_blocks, block_size, 656]"
    assert [(t.name, t.dtype) for t in BF16_MLA.tensors] == [("cache", torch.bfloat16)]
    assert [(s.of, s.kind) for s in FP8_DS_MLA_RAW.scales] == [("latent", "per_tile")]
    assert (FP8_DS_MLA.pow2, FP8_DS_MLA_RAW.pow2) == (True, False)
    assert [t.name for t in INT8_QK.tensors] == ["k_cache", "v_cache", "k_scale_cache"]
    assert [t.dtype for t in INT8_QK.tensors] == [torch.int8, None, torch.float32]  # None: model dtype
    assert [t.dtype for t in MHA_AUTO.tensors] == [None, None]
    assert [(s.of, s.kind) for s in INT8_QKV.scales] == [("k", "per_token_head"), ("q", "per_token_head"),
                                                        ("v", "per_channel")]
    assert [(s.of, s.kind) for s in FP8_PER_TENSOR.scales] == [("k", "per_tensor"), ("v", "per_tensor")]
    # the flags writers and kernels take their constexprs from
    flags = {f.name: (f.fp8_per_tensor, f.k_int8, f.v_int8) for f in formats(MHA)}
    assert flags == {"auto": (False, False, False), "bf16": (False, False, False),
                     "fp16": (False, False, False), "fp8": (True, False, False),
                     "int8_qkv": (False, True, True), "int8_qk": (False, True, False)}
    # the DSA indexer's K cache: one uint8 tensor, a per-token fp32 scale inside each page block
    assert [(t.name, t.dtype) for t in INDEXER_K_FP8.tensors] == [("cache", torch.uint8)]
    assert [(s.of, s.kind) for s in INDEXER_K_FP8.scales] == [("k", "per_token_head")]
    assert formats(INDEXER) == (INDEXER_K_FP8, cache_format("fp8_indexer_raw", INDEXER))
    assert MHA_AUTO.k_cache_dtype(torch.float16) == torch.float16
    assert INT8_QK.v_cache_dtype(torch.bfloat16) == torch.bfloat16 and INT8_QK.k_cache_dtype(torch.bfloat16) == torch.int8


# ---------------------------------------------------------------------------------------------
# pack / unpack references
# ---------------------------------------------------------------------------------------------
# token-row formats; the per-block MODEL1 layout has its own tests (tests/quant/test_model1_format.py)
@pytest.mark.parametrize("fmt", [pytest.param(f, id=f.name) for f in formats(SPARSE_MLA) if not f.blocked])
def test_mla_round_trip(fmt):
    g = torch.Generator().manual_seed(3)
    kv_c = (torch.randn(9, 512, generator=g) * torch.logspace(-3, 2, 512)).bfloat16()
    k_pe = torch.randn(9, 64, generator=g).bfloat16()
    cache = fmt.pack(kv_c, k_pe)
    assert cache.dtype == fmt.cache_dtype and cache.shape == (9, fmt.row_width)
    back = fmt.unpack(cache)
    assert torch.equal(back[:, 512:], k_pe.float())  # rope verbatim
    if not fmt.quantized:
        assert torch.equal(back[:, :512], kv_c.float())
        return
    # e4m3: half a step of 3 mantissa bits of the element, or of the smallest subnormal times the
    # tile scale (elements far below the tile's amax)
    scale = fmt.tile_scales(kv_c.float().view(9, 4, 128).abs().amax(-1)).repeat_interleave(128, -1)
    err = (back[:, :512] - kv_c.float()).abs()
    assert bool((err <= kv_c.float().abs() * 2 ** -4 + scale * 2 ** -10).all())
    assert float(err.max()) > 0  # it does quantize


def _kv(dtype, seed, n=7, h=2, d=16):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, h, d, generator=g) * torch.logspace(-2, 1, d)
    v = torch.randn(n, h, d, generator=g) * 3
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("fmt", [pytest.param(f, id=f.name) for f in formats(MHA)])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mha_round_trip(fmt, model_dtype):
    k, v = _kv(model_dtype, seed=4)
    # per-tensor scales as calibrated (amax / 448: nothing saturates), not powers of two
    ks, vs = k.float().abs().amax().reshape(1) / 448 * 1.01, v.float().abs().amax().reshape(1) / 448 * 1.03
    v_chan = (v.float().abs().amax(0) / 127).clamp_min(1e-8)  # [H_kv, D], as calibrate_v_scale
    kw = dict(k_scale=ks, v_scale=vs) if fmt.fp8_per_tensor else dict(v_scale=v_chan) if fmt.v_int8 else {}
    parts = fmt.pack(k, v, model_dtype=model_dtype, **kw)
    assert set(parts) == {t.name for t in fmt.tensors}
    assert parts["k_cache"].dtype == fmt.k_cache_dtype(model_dtype)
    assert parts["v_cache"].dtype == fmt.v_cache_dtype(model_dtype)
    k2, v2 = fmt.unpack(parts, **kw)
    kf, vf = k.float(), v.float()
    if fmt.fp8_per_tensor:
        assert bool(((k2 - kf).abs() <= kf.abs() * 2 ** -4 + ks * 2 ** -10).all())
        assert bool(((v2 - vf).abs() <= vf.abs() * 2 ** -4 + vs * 2 ** -10).all())
        return
    if fmt.k_int8:  # half a step of the (token, head)'s scale amax / 127
        s = kf.abs().amax(-1, keepdim=True) / 127
        assert parts["k_scale_cache"].shape == k.shape[:2]
        assert bool(((k2 - kf).abs() <= s / 2 * (1 + 2 ** -20)).all())
    else:  # a 16-bit cache holds K rounded to its dtype (exact when it is the model's)
        assert torch.equal(k2, k.to(fmt.k_cache_dtype(model_dtype)).float())
    if fmt.v_int8:
        assert bool(((v2 - vf).abs() <= v_chan / 2 * (1 + 2 ** -20)).all())
    else:
        assert torch.equal(v2, v.to(fmt.v_cache_dtype(model_dtype)).float())
    if fmt.quantized:
        assert float((k2 - kf).abs().max()) > 0  # it does quantize


def test_mha_pack_needs_its_scales():
    k, v = _kv(torch.bfloat16, seed=5)
    with pytest.raises(ValueError, match="k_scale, v_scale: expected both given for the fp8 format"):
        FP8_PER_TENSOR.pack(k, v, k_scale=0.1)
    with pytest.raises(ValueError, match="v_scale: expected a \\[H_kv, D\\] fp32 per-channel scale"):
        INT8_QKV.pack(k, v)


# ---------------------------------------------------------------------------------------------
# Caches -> format at the public ops' boundary, and writers that take the descriptor
# ---------------------------------------------------------------------------------------------
BF, F16, FP8, I8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8


@pytest.mark.parametrize("kd,vd,want", [
    (BF, BF, MHA_BF16), (F16, F16, MHA_FP16), (FP8, FP8, FP8_PER_TENSOR), (I8, I8, INT8_QKV),
    (I8, BF, INT8_QK), (I8, F16, INT8_QK)])
def test_mha_format_of(kd, vd, want):
    assert mha_format_of(torch.zeros(1, 2, 1, 8, dtype=kd), torch.zeros(1, 2, 1, 8, dtype=vd)) is want


@pytest.mark.parametrize("kd,vd,exc,match", [
    (I8, FP8, NotImplementedError, "int8 k_cache with a torch.float8_e4m3fn v_cache"),
    (BF, I8, NotImplementedError, "int8 v_cache with a torch.bfloat16 k_cache"),
    (torch.float32, torch.float32, ValueError, r"k_cache\.dtype"),
    (I8, torch.float32, ValueError, r"v_cache\.dtype")])
def test_mha_format_of_rejects(kd, vd, exc, match):
    with pytest.raises(exc, match=match):
        mha_format_of(torch.zeros(1, 2, 1, 8, dtype=kd), torch.zeros(1, 2, 1, 8, dtype=vd))


def test_writer_takes_the_descriptor():
    """write_kv_cache(fmt=...) writes what the dtypes alone give, and refuses caches of another
    format (int8/int8 caches are int8_qkv: with fmt=INT8_QK the V cache is wrong)."""
    k, v = _kv(torch.bfloat16, seed=6, n=3)
    k, v = k.to(DEVICE), v.to(DEVICE)
    slots = torch.tensor([5, -1, 0], device=DEVICE)
    caches = []
    for fmt in (None, MHA_AUTO, MHA_BF16):
        kc = torch.full((2, 4, 2, 16), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        vc = kc.clone()
        write_kv_cache(k, v, kc, vc, slots, fmt=fmt)
        caches.append((kc, vc))
    for kc, vc in caches[1:]:
        assert torch.equal(kc.view(torch.int16), caches[0][0].view(torch.int16))
        assert torch.equal(vc.view(torch.int16), caches[0][1].view(torch.int16))
    kc = torch.zeros(2, 4, 2, 16, dtype=I8, device=DEVICE)
    ksc = torch.zeros(2, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"v_cache\.dtype: expected torch.bfloat16 or torch.float16, got torch.int8"):
        write_kv_cache(k, v, kc, kc.clone(), slots, k_scale_cache=ksc, fmt=INT8_QK)
    with pytest.raises(ValueError, match=r"k_cache\.dtype: expected torch.float16, got torch.bfloat16"):
        write_kv_cache(k, v, caches[0][0], caches[0][1], slots, fmt=MHA_FP16)
    with pytest.raises(ValueError, match="fmt: expected an MHA cache format descriptor"):
        write_kv_cache(k, v, caches[0][0], caches[0][1], slots, fmt=BF16_MLA)
