"""CUDA graphs in both vLLM backends (mla/vllm/sparse.py, mla/vllm/attn.py) against the real vLLM
0.32 (how it runs: tests/vllm/test_vllm_backend.py's docstring; tools/ci_vllm.sh).

What vLLM reads: the support level each builder reports (through vLLM's own get_attn_cg_support
over AttentionGroups holding our backends) and the decode length its variable-length graphs may
replay; what it calls: AttentionGroup.build_metadata_for_cudagraph_capture on the dummy batch it
captures, then build_metadata on every later step, over the same persistent tensors.

A FULL CUDA graph replays what its capture recorded: the launches of the capture-time metadata,
their scalars and their addresses, over whatever those addresses hold at replay. The layer tests
emulate that on the CPU: vLLM's capture batch (uniform decodes, null blocks, no slots) is built
for capture and kept; a later decode step of fewer requests is written into the same engine
tensors, padded as vLLM pads it (tests/helpers/vllm.EngineBuffers), and built as vLLM builds it
before a replay. The forward run with the capture-time metadata (the replay) must then give, for
the real requests, bit for bit what the forward with the step's own metadata and the forward of an
unpadded build of the step give, padding rows 0; the unpadded result is checked against the
oracle. The plans' device tensors must be the builders' and the engine's persistent ones. On a
GPU the same is checked with real graphs (tests/mla/test_cudagraph.py, which builds the plans
through the same functions, mla/vllm/common.py, without vLLM).
"""
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.vllm import EngineBuffers, import_vllm, vllm_config

vllm = import_vllm()

from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.worker.gpu.attn_utils import get_attn_cg_support  # noqa: E402
from vllm.v1.worker.utils import AttentionGroup  # noqa: E402

import openmla.mla.vllm.attn as ab  # noqa: E402
import openmla.mla.vllm.sparse as vb  # noqa: E402
from openmla.mla.sparse.impl import SparseMLAImpl  # noqa: E402
from tests.helpers import DEVICE, assert_close  # noqa: E402
from tests.helpers.mha import SCALES, caches_of, make_impl, make_step, step_oracle  # noqa: E402
from tests.helpers.sparse import (  # noqa: E402
    N_NOPE, ROPE, SCALE, V_DIM, L, Step, kv_b_proj_fp8, reference_weight,
)


def group_of(backend, spec, cfg):
    """An AttentionGroup of one layer with its builder, as vLLM's runner makes it."""
    group = AttentionGroup(backend, ["layers.0.attn"], spec, 0)
    group.create_metadata_builders(cfg, DEVICE)
    return group


def common(bufs):
    return CommonAttentionMetadata(**bufs.metadata())


def same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------------------------
# Declared support, as vLLM reads it.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec_tokens", [0, 3])
def test_declared_cudagraph_support(spec_tokens):
    sparse = group_of(vb.OpenMLASparseBackend, SimpleNamespace(block_size=64),
                      vllm_config(16, "fp8_ds_mla", 128, spec_tokens))
    cfg = vllm_config(8, "auto", 128, spec_tokens)
    attn = group_of(ab.OpenMLAAttentionBackend, SimpleNamespace(block_size=16, num_kv_heads=2), cfg)
    for group in (sparse, attn):
        info = get_attn_cg_support([[group]], cfg)
        assert info.min_cg_support == AttentionCGSupport.UNIFORM_BATCH
        builder = group.get_metadata_builder()
        assert builder.reorder_batch_threshold == 1 + spec_tokens
        assert type(builder).get_varlen_cudagraph_max_query_len(cfg, group.kv_cache_spec) == 1 + spec_tokens


@pytest.mark.parametrize("backend", ["sparse", "attn"])
def test_capture_of_a_prefill_batch_is_refused(backend):
    """A FULL graph of a batch with a prefill would replay its prefill launches: refused."""
    if backend == "sparse":
        group = group_of(vb.OpenMLASparseBackend, SimpleNamespace(block_size=16),
                         vllm_config(8, "fp8_ds_mla", 128, 1))
    else:
        group = group_of(ab.OpenMLAAttentionBackend, SimpleNamespace(block_size=16, num_kv_heads=2),
                         vllm_config(8, "auto", 128, 1))
    bufs = EngineBuffers(8, 2, 4, DEVICE)
    bufs.fill([2, 6], [10, 6], None, None, max_query_len=6)
    with pytest.raises(ValueError, match=r"max_query_len of a CUDA graph capture batch: expected <= 2"):
        group.build_metadata_for_cudagraph_capture(common(bufs))


# ----------------------------------------------------------------------------------------------
# OPENMLA_SPARSE: capture batch, a later padded decode step, its unpadded build.
# ----------------------------------------------------------------------------------------------
CONTEXTS = [30, 47, 20, 37, 11, 25]
_REF_NAMES = {"auto": "bf16", "fp8_ds_mla": "fp8_ds_mla", "fp8": "fp8_ds_mla"}

SPARSE_CASES = [  # vLLM cache_dtype, H, block_size, topk, spec tokens, capture T, the step's query lens
    pytest.param("auto", 4, 16, 24, 0, 8, [1] * 5, id="bf16-H4-decode-5of8"),
    pytest.param("fp8_ds_mla", 8, 7, 24, 2, 12, [3] * 3, id="fp8-H8-mixed-spec2-3of4reqs"),
    pytest.param("fp8", 32, 16, 24, 0, 4, [1] * 3, id="fp8alias-H32-separate-3of4"),
    pytest.param("fp8_ds_mla", 8, 16, 24, 2, 12, [3, 1, 2], id="fp8-H8-varlen-3-1-2of12"),
]


def sparse_impl(H, kv, topk_buffer):
    return vb.OpenMLASparseImpl(
        num_heads=H, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype=kv, logits_soft_cap=None, attn_type="decoder",
        kv_sharing_target_layer_name=None, topk_indices_buffer=topk_buffer, indexer=None,
        q_lora_rank=None, kv_lora_rank=L, qk_nope_head_dim=N_NOPE, qk_rope_head_dim=ROPE,
        qk_head_dim=N_NOPE + ROPE, v_head_dim=V_DIM, kv_b_proj=None)


@pytest.mark.parametrize("kv,H,bs,topk,spec_tokens,T,qlens", SPARSE_CASES)
def test_sparse_capture_then_padded_step(kv, H, bs, topk, spec_tokens, T, qlens):
    q_len = 1 + spec_tokens
    R, n, real = T // q_len, len(qlens), sum(qlens)
    g = torch.Generator().manual_seed(H * 10 + T)
    w8, s = kv_b_proj_fp8(H, g)
    ref = SparseMLAImpl(H, SCALE, _REF_NAMES[kv], max_model_len=64)
    ref.load_kv_b_proj(w8.to(DEVICE), s.to(DEVICE))
    step = Step(ref, list(zip(CONTEXTS, qlens)), block_size=bs, topk=topk, padding=T - real,
                seed=H + T)
    cfg = vllm_config(H, kv, 64, spec_tokens, max_num_batched_tokens=2 * T)
    group = group_of(vb.OpenMLASparseBackend, SimpleNamespace(block_size=bs), cfg)
    builder = group.get_metadata_builder()
    M = step.block_table.shape[1] + 2  # vLLM's table is wider than any request needs
    bufs = EngineBuffers(T, R, M, DEVICE)

    # the indexer's buffer (rows past T and the padding rows hold stale indices) and the query
    topk_buf = torch.randint(-5, 60, (2 * T, topk), generator=g, dtype=torch.int32).to(DEVICE)
    impl = sparse_impl(H, kv, topk_buf)
    ql_nope = torch.randn(T, H, L, generator=g).to(torch.bfloat16).to(DEVICE)
    q_pe = torch.randn(T, H, ROPE, generator=g).to(torch.bfloat16).to(DEVICE)

    # capture: vLLM's dummy batch, built for capture and run once (what the graph records)
    bufs.capture_batch(q_len)
    captured = group.build_metadata_for_cudagraph_capture(common(bufs))
    plan = captured.plan
    assert plan.is_decode_only and plan.num_decode_tokens == T and plan.num_tokens == T
    impl.forward_mqa((ql_nope, q_pe), step.cache, captured, None)

    # a later step of n < R requests, padded to T, into the same tensors
    ql_nope[:real] = torch.bmm(step.q_nope[:real].transpose(0, 1), ref.W_UK).transpose(0, 1)
    q_pe[:real] = step.q_pe[:real]
    topk_buf[:real] = step.topk_indices[:real]
    even = [real // n + (i < real % n) for i in range(n)]  # the host split vLLM keeps for varlen
    bufs.fill(qlens, step.seq, step.block_table, step.slot_mapping[:real], max_query_len=q_len,
              qlens_cpu=even)
    md = group.build_metadata(common(bufs))
    for p in (plan, md.plan):  # the graph's addresses: the builder's buffer, vLLM's tensors
        assert same_storage(p.req_id_per_token, builder.req_id_buffer)
        assert same_storage(p.block_table, bufs.block_table) and same_storage(p.seq_lens, bufs.seq_lens)
    assert md.plan.req_id_per_token.tolist() == [r for r, q in enumerate(qlens) for _ in range(q)] \
        + [R] * (T - real)  # padding rows belong to no request

    # vLLM's MLA layer hands a cache named "fp8" viewed as float8_e4m3fn (the same bytes)
    handed = step.cache.view(torch.float8_e4m3fn) if kv == "fp8" else step.cache
    replay, _ = impl.forward_mqa((ql_nope, q_pe), handed, captured, None)
    eager, _ = impl.forward_mqa((ql_nope, q_pe), handed, md, None)

    # the step alone, unpadded, through a second builder (the first one's buffer is the graph's)
    alone = EngineBuffers(real, n, M, DEVICE)
    alone.fill(qlens, step.seq, step.block_table, step.slot_mapping[:real], max_query_len=max(qlens))
    solo = group_of(vb.OpenMLASparseBackend, SimpleNamespace(block_size=bs), cfg)
    unpadded, _ = impl.forward_mqa((ql_nope[:real], q_pe[:real]), step.cache,
                                   solo.build_metadata(common(alone)), None)
    assert torch.equal(replay[:real], unpadded) and torch.equal(eager[:real], unpadded)
    assert torch.count_nonzero(replay[real:]) == 0 and torch.count_nonzero(eager[real:]) == 0
    out = torch.bmm(unpadded.transpose(0, 1), ref.W_UV).transpose(0, 1)
    assert_close("out", out, step.reference(reference_weight(w8, s), H)[:real], "bf16")


# ----------------------------------------------------------------------------------------------
# OPENMLA_ATTN: the same, with the step's keys and values written by forward.
# ----------------------------------------------------------------------------------------------
ATTN_CASES = [  # kv_cache_dtype, H, H_kv, D, block_size, spec tokens, capture T, the step's query lens, options
    pytest.param("auto", 8, 2, 64, 16, 0, 8, [1] * 5, dict(window=9, sinks=True),
                 id="auto-GQA4-decode-5of8-window-sinks"),
    pytest.param("fp8", 4, 1, 32, 7, 2, 12, [3] * 3, {}, id="fp8-MQA-bs7-spec2-3of4reqs"),
    pytest.param("auto", 6, 3, 40, 16, 2, 12, [3, 1, 2], dict(softcap=20.0),
                 id="auto-D40-varlen-3-1-2of12-softcap"),
]


def vllm_cache(kv_cache, kv):
    """vLLM's logical layer cache [num_blocks, H_kv, block_size, 2 * D] (uint8 storage for fp8,
    keys then values along the last axis) holding make_step's NHD caches."""
    k, v = caches_of(kv_cache)
    nb, bs, H_kv, D = k.shape
    raw = torch.empty(nb, bs, H_kv, 2 * D, dtype=k.dtype, device=k.device)
    raw[..., :D], raw[..., D:] = k, v
    if kv.startswith("fp8"):
        raw = raw.view(torch.uint8)
    return raw.transpose(1, 2)


@pytest.mark.parametrize("kv,H,H_kv,D,bs,spec_tokens,T,qlens,opts", ATTN_CASES)
def test_attn_capture_then_padded_step(kv, H, H_kv, D, bs, spec_tokens, T, qlens, opts):
    q_len = 1 + spec_tokens
    R, n, real = T // q_len, len(qlens), sum(qlens)
    fp8 = kv.startswith("fp8")
    s = make_step(list(zip(qlens, CONTEXTS)), H, H_kv, D, bs, cache="fp8" if fp8 else "bf16",
                  pad=T - real, seed=H + T)
    ref = make_impl(H, D, H_kv, cache="fp8" if fp8 else "bf16", window=opts.get("window"),
                    softcap=opts.get("softcap"), sinks=opts.get("sinks", False))
    impl = ab.OpenMLAAttentionImpl(H, D, ref.scale, H_kv, None, opts.get("window"), kv,
                                   opts.get("softcap"), "decoder", None, sinks=ref.sinks)
    layer = SimpleNamespace(_k_scale=torch.tensor(SCALES[0], device=DEVICE),
                            _v_scale=torch.tensor(SCALES[1], device=DEVICE))
    cfg = vllm_config(H, kv, 128, spec_tokens, max_num_batched_tokens=2 * T)
    spec = SimpleNamespace(block_size=bs, num_kv_heads=H_kv)
    group = group_of(ab.OpenMLAAttentionBackend, spec, cfg)
    M = s["block_table"].shape[1] + 2
    bufs = EngineBuffers(T, R, M, DEVICE)
    cache = vllm_cache(s["kv_cache"], kv)
    query, key, value = s["query"].clone(), s["key"], s["value"]  # [T, ...]: the engine's rows
    output = torch.full((T, H, D), float("nan"), dtype=query.dtype, device=DEVICE)

    bufs.capture_batch(q_len)
    captured = group.build_metadata_for_cudagraph_capture(common(bufs))
    assert captured.plan.prefill is None and captured.plan.decode.token_end == T
    impl.forward(layer, query, key, value, cache, captured, output)  # slots -1: writes nothing

    even = [real // n + (i < real % n) for i in range(n)]
    bufs.fill(qlens, s["seqs"], s["block_table"], s["slot_mapping"][:real], max_query_len=q_len,
              qlens_cpu=even)
    md = group.build_metadata(common(bufs))
    for p in (captured.plan, md.plan):  # views of vLLM's tensors, nothing of the plan's own
        for t, b in ((p.query_start_loc, bufs.query_start_loc), (p.seq_lens, bufs.seq_lens),
                     (p.block_table, bufs.block_table), (p.slot_mapping, bufs.slot_mapping)):
            assert same_storage(t, b)
        assert same_storage(p.decode.cu_seqlens_q, bufs.query_start_loc)

    replay = impl.forward(layer, query, key, value, cache, captured, output.clone())
    eager = impl.forward(layer, query, key, value, cache, md, output.clone())
    alone = EngineBuffers(real, n, M, DEVICE)
    alone.fill(qlens, s["seqs"], s["block_table"], s["slot_mapping"][:real], max_query_len=max(qlens))
    unpadded = impl.forward(layer, query[:real], key[:real], value[:real], cache,
                            group_of(ab.OpenMLAAttentionBackend, spec, cfg).build_metadata(common(alone)),
                            output[:real].clone())
    assert torch.equal(replay[:real], unpadded) and torch.equal(eager[:real], unpadded)
    assert torch.count_nonzero(replay[real:]) == 0 and torch.count_nonzero(eager[real:]) == 0
    k, v = cache.transpose(1, 2).split(D, dim=-1)
    if fp8:
        k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
    want = step_oracle(ref, s, cache_k=k, cache_v=v)[0]
    assert_close("output", unpadded, want[:real], "bf16")
    assert torch.equal(k.float().nan_to_num(7.0), s["want_k"].float().nan_to_num(7.0))
    assert torch.equal(v.float().nan_to_num(7.0), s["want_v"].float().nan_to_num(7.0))
