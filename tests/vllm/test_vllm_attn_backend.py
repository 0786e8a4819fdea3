"""mla/vllm/attn.py (OPENMLA_ATTN) against the real vLLM 0.32 (how it runs:
tests/vllm/test_vllm_backend.py's docstring; tools/ci_vllm.sh, OPENMLA_REQUIRE_VLLM=1).

The layer test builds one engine step as tests/mla/test_mha_impl.py does (decodes, 3-token speculative
decodes, prefills with and without context, padding rows; shuffled block table with invalid unused
entries, strided query, non-default scale), puts the cache where vLLM puts it: the layer views
that vLLM's own create_kv_cache_views cuts from one backing buffer for two layers, in the
layer-compact NHD and HND layouts and the block-outermost layout that interleaves the layers'
pages, every unwritten byte 0xFF (NaN in bf16, fp16 and e4m3fn). It describes the step with vLLM's
CommonAttentionMetadata, runs our builder's build and our impl's forward (vLLM's calling
convention: layer, query, key, value, kv_cache, metadata, output), and checks every byte of both
layers' caches and the output against kernels.reference.paged_attention_ref (tolerance "bf16";
fp8 also against the unquantized keys and values at the "fp8" tolerance).

vllm_config is a stand-in carrying only the fields the builder reads (a real VllmConfig needs a
model's HF config); the KV cache spec, layouts, views and metadata are vLLM's.
"""
import math
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.vllm import common_metadata, import_vllm, registered_in_fresh_process, vllm_config

vllm = import_vllm()

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheTensor, compute_layer_kv_cache_shape_bytes, create_kv_cache_views,
    get_kv_quant_mode,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

import openmla.mla.vllm.attn as ab  # noqa: E402
from openmla.kernels.reference import attention_varlen_ref  # noqa: E402
from tests.helpers import DEVICE, assert_close  # noqa: E402
from tests.helpers.mha import MIXED, SCALES, caches_of, make_impl, make_step, step_oracle  # noqa: E402

NHD, HND, INTERLEAVED = KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC


def vllm_layer_caches(k_cache, kv, layout, num_layers=2):
    """(spec, views): one [num_blocks, H_kv, block_size, 2 * D] view per layer of a single
    0xFF-filled buffer, cut by vLLM's create_kv_cache_views as its allocate_kv_cache does (uint8
    storage for fp8), for `num_layers` layers whose caches are shaped like k_cache
    [num_blocks, block_size, H_kv, D]."""
    nb, bs, H_kv, D = k_cache.shape
    fp8 = kv.startswith("fp8")
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=H_kv, head_size=D,
                             dtype=torch.uint8 if fp8 else k_cache.dtype,
                             kv_quant_mode=get_kv_quant_mode(kv))
    page = math.prod(compute_layer_kv_cache_shape_bytes(spec, 1)[1:])
    if layout.is_layer_compact:
        layer_stride, block_stride = page * nb, page
    else:
        layer_stride, block_stride = page, page * num_layers
    size = page * nb * num_layers
    raw = torch.full((size,), -1, dtype=torch.int8, device=DEVICE)
    t = KVCacheTensor(size=size, layers=[f"layers.{i}.attn" for i in range(num_layers)],
                      layer_stride=layer_stride, block_stride=block_stride)
    return spec, create_kv_cache_views(raw, spec, nb, layout, t)


def kv_views(cache, D, kv):
    """vLLM's split of a layer cache into NHD key and value views (as its Triton backend)."""
    k, v = cache.transpose(1, 2).split(D, dim=-1)
    if kv.startswith("fp8"):
        k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
    return k, v


def bits(x):
    return x.contiguous().view(torch.uint8 if x.element_size() == 1 else torch.int16).cpu()


def vllm_impl(ref, kv, *, window=None, softcap=None, attn_type=AttentionType.DECODER,
              kv_sharing=None):
    """OPENMLA_ATTN's impl, constructed as vLLM's Attention layer does (positional arguments,
    sinks as a keyword), with the options of openmla's reference layer `ref`."""
    alibi = None if ref.alibi_slopes is None else ref.alibi_slopes.tolist()
    return ab.OpenMLAAttentionImpl(ref.num_heads, ref.head_size, ref.scale, ref.num_kv_heads,
                                   alibi, window, kv, softcap, attn_type, kv_sharing,
                                   sinks=ref.sinks)


def fp8_layer():
    """What the impl reads of vLLM's Attention layer: its fp8 scales (0-dim fp32 tensors)."""
    return SimpleNamespace(_k_scale=torch.tensor(SCALES[0], device=DEVICE),
                           _v_scale=torch.tensor(SCALES[1], device=DEVICE))


# ----------------------------------------------------------------------------------------------
# Builder + impl on a step described by vLLM's CommonAttentionMetadata, caches in vLLM's layouts.
# ----------------------------------------------------------------------------------------------
LAYER_CASES = [  # (reqs, H, H_kv, D, bs, kv, q dtype, layout, spec tokens, layer options)
    pytest.param(MIXED, 8, 2, 64, 16, "auto", torch.bfloat16, NHD, 2,
                 dict(window=16, softcap=30.0, sinks=True),
                 id="auto-bf16-NHD-GQA4-window-softcap-sinks"),
    pytest.param(MIXED, 4, 1, 32, 7, "fp8_e4m3", torch.bfloat16, HND, 2, dict(alibi=True),
                 id="fp8e4m3-HND-bs7-MQA-alibi"),
    pytest.param(MIXED[:4] + [(9, 0)], 6, 3, 40, 16, "fp8", torch.float16, INTERLEAVED, 2,
                 dict(sinks=True), id="fp8-fp16-interleaved-layers-D40-sinks"),
    pytest.param([(1, 30), (1, 3), (1, 0), (1, 44)], 8, 2, 32, 16, "float16", torch.float16,
                 INTERLEAVED, 0, dict(window=9), id="float16-interleaved-decode-only-window9"),
]


@pytest.mark.parametrize("reqs,H,H_kv,D,bs,kv,q_dtype,layout,spec_tokens,lopts", LAYER_CASES)
def test_build_and_forward(reqs, H, H_kv, D, bs, kv, q_dtype, layout, spec_tokens, lopts):
    fp8 = kv.startswith("fp8")
    pad = 2
    s = make_step(reqs, H, H_kv, D, bs, cache="fp8" if fp8 else "bf16", pad=pad, q_dtype=q_dtype,
                  seed=H + bs)
    k0, v0 = caches_of(s["kv_cache"])  # the context, already cached; NaN elsewhere
    spec, caches = vllm_layer_caches(k0, kv, layout)
    k, v = kv_views(caches[0], D, kv)
    k.copy_(k0)
    v.copy_(v0)
    other = bits(caches[1])

    builder = ab.OpenMLAAttentionMetadataBuilder(spec, ["layers.0.attn"],
                                                 vllm_config(H, kv, 128, spec_tokens), DEVICE)
    threshold = 1 + spec_tokens
    assert builder.reorder_batch_threshold == threshold
    cm = common_metadata(s["query_start_loc"], s["seq_lens"], s["block_table"], s["slot_mapping"],
                         s["qlens"], s["seqs"])
    md = builder.build(0, cm)
    plan = md.plan
    T = s["query"].shape[0]
    nd = next((i for i, q in enumerate(s["qlens"]) if q > threshold), len(reqs))
    assert (plan.num_tokens, plan.block_size, plan.num_heads, plan.num_kv_heads) == (T, bs, H, H_kv)
    assert (plan.decode_threshold, plan.num_decodes, plan.num_prefills) == (threshold, nd,
                                                                            len(reqs) - nd)
    assert plan.cascade is None and plan.slot_mapping.data_ptr() == cm.slot_mapping.data_ptr()
    assert (md.num_actual_tokens, md.max_query_len, md.causal) == (T, max(s["qlens"]), True)

    window, softcap = lopts.get("window"), lopts.get("softcap")
    ref = make_impl(H, D, H_kv, cache="fp8" if fp8 else "bf16", **lopts)
    impl = vllm_impl(ref, kv, window=window, softcap=softcap)
    layer = fp8_layer() if fp8 else SimpleNamespace()
    output = torch.full((T, H, D), float("nan"), dtype=q_dtype, device=DEVICE)
    got = impl.forward(layer, s["query"], s["key"], s["value"], caches[0], md, output)
    assert got is output

    assert torch.equal(bits(k), bits(s["want_k"])) and torch.equal(bits(v), bits(s["want_v"]))
    assert torch.equal(bits(caches[1]), other)  # the other layer's pages are untouched
    assert_close("out", output, step_oracle(ref, s)[0], "bf16")
    if fp8:
        assert_close("out vs unquantized", output, step_oracle(ref, s, full=True)[0], "fp8")
    assert torch.equal(output[T - pad:].float().cpu(), torch.zeros(pad, H, D))


def test_kv_sharing_layer_reads_without_writing():
    """A layer with kv_sharing_target_layer_name attends over the target's cache (written
    beforehand) and writes nothing, whatever key and value it is given."""
    H, H_kv, D, bs = 8, 2, 32, 16
    s = make_step(MIXED, H, H_kv, D, bs, cache="fp8")
    spec, caches = vllm_layer_caches(s["want_k"], "fp8", NHD)
    k, v = kv_views(caches[0], D, "fp8")
    k.copy_(s["want_k"])
    v.copy_(s["want_v"])
    before = bits(caches[0])
    builder = ab.OpenMLAAttentionMetadataBuilder(spec, ["layers.1.attn"],
                                                 vllm_config(H, "fp8", 128, 0), DEVICE)
    md = builder.build(0, common_metadata(s["query_start_loc"], s["seq_lens"], s["block_table"],
                                          s["slot_mapping"], s["qlens"], s["seqs"]))
    ref = make_impl(H, D, H_kv, cache="fp8", softcap=10.0)
    impl = vllm_impl(ref, "fp8", softcap=10.0, kv_sharing="layers.0.attn")
    T = s["query"].shape[0]
    out = impl.forward(fp8_layer(), s["query"], s["key"] * 3, s["value"], caches[0], md,
                       torch.empty(T, H, D, dtype=torch.bfloat16, device=DEVICE))
    assert torch.equal(bits(caches[0]), before)
    assert_close("out", out, step_oracle(ref, s)[0], "bf16")


def test_encoder_only_layer():
    """Encoder-only attention as vLLM runs it: its EncoderOnlyAttentionBuilder sets causal=False
    in the common metadata, and the layer has no cache; non-causal over each request's keys."""
    H, H_kv, D = 8, 2, 32
    g = torch.Generator().manual_seed(5)
    qlens, pad = [7, 1, 12], 2
    T = sum(qlens) + pad
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(T, H_kv, D, generator=g).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(T, H_kv, D, generator=g).to(torch.bfloat16).to(DEVICE)
    cu = torch.tensor([0] + qlens).cumsum(0).to(torch.int32).to(DEVICE)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=H_kv, head_size=D, dtype=torch.bfloat16)
    builder = ab.OpenMLAAttentionMetadataBuilder(spec, ["layers.0.attn"],
                                                 vllm_config(H, "auto", 64, 0), DEVICE)
    cm = common_metadata(cu, torch.tensor(qlens, dtype=torch.int32, device=DEVICE),
                         torch.zeros(3, 1, dtype=torch.int32, device=DEVICE),
                         torch.full((T,), -1, dtype=torch.int64, device=DEVICE), qlens, qlens,
                         causal=False)
    md = builder.build(0, cm)
    ref = make_impl(H, D, H_kv, attn_type="encoder_only", window=5, sinks=True)
    impl = vllm_impl(ref, "auto", window=5, attn_type=AttentionType.ENCODER_ONLY)
    out = impl.forward(SimpleNamespace(), q, k, v, torch.tensor([]), md,
                       torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device=DEVICE))
    want, _ = attention_varlen_ref(q, k, v, cu, cu, scale=ref.scale, causal=False, window=(4, 4),
                                   sinks=ref.sinks.float())
    assert_close("out", out, want, "bf16")
    assert torch.equal(out[T - pad:].float().cpu(), torch.zeros(pad, H, D))


def test_decode_step_build_reads_no_device_tensor():
    """A decode-only step (query lengths <= the speculative threshold): build never reads the
    engine's device tensors (here on `meta`, unreadable), so no host sync per step."""
    qlens, seqs = [3, 1, 2, 3], [40, 9, 17, 100]
    meta = dict(device="meta")
    cm = common_metadata(torch.empty(5, dtype=torch.int32, **meta),
                         torch.empty(4, dtype=torch.int32, **meta),
                         torch.empty(4, 7, dtype=torch.int32, **meta),
                         torch.empty(11, dtype=torch.int64, **meta), qlens, seqs)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    builder = ab.OpenMLAAttentionMetadataBuilder(spec, ["layers.0.attn"],
                                                 vllm_config(8, "auto", 128, 2), "meta")
    plan = builder.build(0, cm).plan
    assert plan.prefill is None and plan.decode.cu_seqlens_q is cm.query_start_loc
    assert (plan.num_decodes, plan.num_decode_tokens, plan.decode.max_query_len) == (4, 11, 3)


def test_profiling_run_without_metadata_zeroes_output():
    ref = make_impl(4, 32, 2)
    out = torch.full((5, 4, 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    vllm_impl(ref, "auto").forward(SimpleNamespace(), out.clone(), None, None, None, None, out)
    assert torch.count_nonzero(out) == 0


# ----------------------------------------------------------------------------------------------
# Capabilities: vLLM's own validate_configuration (which calls supports_combination).
# ----------------------------------------------------------------------------------------------
def _validate(head_size=128, dtype=torch.bfloat16, kv="auto", block_size=16, use_mla=False,
              has_sink=False, use_sparse=False, use_mm_prefix=False, attn_type="decoder", **kw):
    return ab.OpenMLAAttentionBackend.validate_configuration(
        head_size, dtype, kv, block_size, use_mla, has_sink, use_sparse, use_mm_prefix, False,
        DeviceCapability(9, 0), attn_type, **kw)


CLAIMED = [
    pytest.param(dict(dtype=torch.bfloat16, kv="auto"), id="bf16-auto"),
    pytest.param(dict(dtype=torch.bfloat16, kv="auto", use_dcp=True), id="bf16-auto-dcp"),
    pytest.param(dict(dtype=torch.bfloat16, kv="bfloat16"), id="bf16-bf16cache"),
    pytest.param(dict(dtype=torch.float16, kv="auto"), id="fp16-auto"),
    pytest.param(dict(dtype=torch.float16, kv="float16"), id="fp16-fp16cache"),
    pytest.param(dict(dtype=torch.bfloat16, kv="fp8"), id="bf16-fp8"),
    pytest.param(dict(dtype=torch.float16, kv="fp8_e4m3"), id="fp16-fp8e4m3"),
    pytest.param(dict(head_size=8, block_size=1), id="D8-bs1"),
    pytest.param(dict(head_size=72, block_size=7), id="D72-bs7"),
    pytest.param(dict(head_size=256, block_size=64, kv="fp8"), id="D256-bs64-fp8"),
    pytest.param(dict(has_sink=True, has_sliding_window=True), id="sinks-sliding-window"),
    pytest.param(dict(attn_type="encoder"), id="encoder"),
    pytest.param(dict(attn_type="encoder_only", head_size=64), id="encoder-only"),
    pytest.param(dict(use_kv_connector=True), id="kv-connector"),
]


@pytest.mark.parametrize("kw", CLAIMED)
def test_claimed_combinations_accepted(kw):
    assert _validate(**kw) == []


REFUSED = [
    pytest.param(dict(head_size=264), "head_size not supported", id="head264"),
    pytest.param(dict(head_size=100), "head_size not supported", id="head100-not-multiple-of-8"),
    pytest.param(dict(dtype=torch.float32), "dtype not supported", id="fp32"),
    pytest.param(dict(kv="fp8_e5m2"), "kv_cache_dtype not supported", id="fp8e5m2"),
    pytest.param(dict(kv="int8_per_token_head"), "kv_cache_dtype not supported", id="int8-pth"),
    pytest.param(dict(kv="fp8_per_token_head"), "kv_cache_dtype not supported", id="fp8-pth"),
    pytest.param(dict(kv="fp8_ds_mla"), "kv_cache_dtype not supported", id="fp8_ds_mla"),
    pytest.param(dict(dtype=torch.float16, kv="bfloat16"),
                 "kv_cache_dtype bfloat16 with torch.float16 activations: a 16-bit cache is read "
                 "in the model's dtype", id="fp16-bf16cache"),
    pytest.param(dict(dtype=torch.bfloat16, kv="float16"),
                 "kv_cache_dtype float16 with torch.bfloat16 activations: a 16-bit cache is read "
                 "in the model's dtype", id="bf16-fp16cache"),
    pytest.param(dict(use_mla=True), "MLA not supported", id="mla"),
    pytest.param(dict(use_sparse=True), "sparse not supported", id="sparse"),
    pytest.param(dict(attn_type="encoder_decoder"), "attention type encoder_decoder not supported",
                 id="cross-attention"),
    pytest.param(dict(use_mm_prefix=True), "partial multimodal token full attention not supported",
                 id="mm-prefix"),
    pytest.param(dict(use_non_causal=True), "non-causal attention not supported", id="non-causal"),
    pytest.param(dict(use_rswa=True), "R-SWA not supported", id="rswa"),
    pytest.param(dict(use_batch_invariant=True), "batch invariance not supported",
                 id="batch-invariant"),
]


@pytest.mark.parametrize("kw,reason", REFUSED)
def test_unclaimed_combinations_refused(kw, reason):
    assert reason in _validate(**kw)


@pytest.mark.parametrize("args,kw,match", [
    pytest.param((8, 64, 0.1, 2, None, None, "int8_per_token_head"), {},
                 "kv_cache_dtype 'int8_per_token_head' is not supported", id="int8-pth"),
    pytest.param((8, 64, 0.1, 2, None, None, "int8_qkv"), {},
                 "kv_cache_dtype 'int8_qkv' is not supported", id="openmla-int8-not-via-vllm"),
    pytest.param((8, 64, 0.1, 2, None, None, "auto", None, AttentionType.ENCODER_DECODER), {},
                 "encoder_decoder", id="cross-attention"),
    pytest.param((8, 64, 0.1, 2, None, None, "fp8", None, AttentionType.ENCODER_ONLY), {},
                 "with attn_type 'encoder_only'", id="fp8-encoder"),
    pytest.param((8, 264, 0.1, 2, None, None, "auto"), {}, "head_size 264", id="head264"),
])
def test_impl_refuses_unsupported_options(args, kw, match):
    with pytest.raises(NotImplementedError, match=match):
        ab.OpenMLAAttentionImpl(*args, **kw)


# ----------------------------------------------------------------------------------------------
# Registration through the entry point, in a fresh process.
# ----------------------------------------------------------------------------------------------
def test_entry_point_registers_backend_in_fresh_process():
    assert registered_in_fresh_process("OPENMLA_ATTN") == (
        "OPENMLA_ATTN openmla.mla.vllm.attn OpenMLAAttentionBackend OPENMLA_ATTN")


def test_chosen_backend_unpickles_in_a_process_without_plugins():
    """vLLM pickles its config, holding the chosen backend, into engine processes; a spawned one
    unpickles it before loading plugins. Our members still resolve there (registering first)."""
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import openmla.mla.vllm as vb
    vb.register()
    data = pickle.dumps([AttentionConfig(backend="OPENMLA_ATTN"),
                         AttentionBackendEnum.OPENMLA_SPARSE, AttentionBackendEnum.FLASH_ATTN])
    code = ("import pickle, sys\n"
            "assert 'openmla.mla.vllm.sparse' not in sys.modules\n"
            "config, sparse, flash = pickle.loads(sys.stdin.buffer.read())\n"
            "from vllm.v1.attention.backends.registry import AttentionBackendEnum as B\n"
            "print(config.backend.name, config.backend is B.OPENMLA_ATTN,"
            " sparse is B.OPENMLA_SPARSE, flash.name, sparse.get_class().get_name())\n")
    r = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=180,
                       env={"PATH": "/usr/bin:/bin", "VLLM_PLUGINS": ""})  # plugins off there
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert r.stdout.decode().strip().splitlines()[-1] == (
        "OPENMLA_ATTN True True FLASH_ATTN OPENMLA_SPARSE")
