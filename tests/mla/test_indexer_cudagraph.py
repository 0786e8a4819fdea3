"""mla/sparse/indexer_step.py under CUDA graphs (DESIGN.md, Serving contract); GPU only.

A decode step's indexer (build_indexer_plan without host lengths, then indexer_topk: paged
logits and top-k, one row per token) is captured in one torch.cuda.CUDAGraph over vLLM-style
persistent engine tensors (tests/helpers/vllm.EngineBuffers: query_start_loc, seq_lens, block
table), the plan rebuilt inside the graph. Later steps write new contexts, block tables, index
keys and queries into the same tensors (fewer requests padded to the capture size, speculative
and variable-length decodes); the replay must equal an eager call on the same inputs bit for bit,
the eager call must not read the device from the host (CUDA's sync debug mode "error"), padding
tokens select nothing and the selection matches the oracles (sets up to ties).
"""
import pytest
import torch

from openmla.mla.sparse.indexer_step import build_indexer_plan, indexer_topk
from openmla.quant.indexer_cache import INDEXER_K_FP8
from tests.helpers import DEVICE, capture
from tests.helpers.indexer import IndexInputs, assert_same_selection, oracle_selection
from tests.helpers.vllm import EngineBuffers

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: CUDA graph capture")

HEADS, BS, MAX_CTX = 64, 64, 3000


@pytest.mark.parametrize("q_len,T,topk,steps", [
    pytest.param(1, 16, 2048, [[1] * 16, [1] * 5], id="decode-T16-topk2048"),
    pytest.param(3, 12, 64, [[3, 3, 3, 3], [2, 3, 1], [1]], id="spec3-varlen-T12-topk64"),
])
def test_indexer_graph_replays(q_len, T, topk, steps):
    g = torch.Generator().manual_seed(T + topk)
    R = T // q_len
    M = -(-(MAX_CTX + q_len) // BS)
    num_blocks = R * M + 8
    bufs = EngineBuffers(T, R, M + 3, DEVICE)
    q = torch.empty(T, HEADS, 128, dtype=torch.float8_e4m3fn, device=DEVICE)
    w = torch.empty(T, HEADS, dtype=torch.float32, device=DEVICE)
    out = torch.empty(T, topk, dtype=torch.int32, device=DEVICE)
    cache = None

    def run():
        plan = build_indexer_plan(bufs.query_start_loc, bufs.seq_lens, bufs.block_table, num_tokens=T,
                                  max_context=M * BS)
        return indexer_topk(q, w, cache, plan, topk=topk, out=out)

    for i, qlens in enumerate([[q_len] * R] + steps):
        ctx = [int(c) for c in torch.randint(1, MAX_CTX, (len(qlens),), generator=g)]
        reqs = list(zip(ctx, qlens))
        nblk = [-(-(c + n) // BS) for c, n in reqs]
        bt = torch.randperm(num_blocks, generator=g)[:len(reqs) * M].view(len(reqs), M).to(torch.int32)
        for r, nb in enumerate(nblk):
            bt[r, nb:] = -1
        bt = bt.to(DEVICE)
        idx = IndexInputs(reqs, bt, num_blocks, BS, T, HEADS, INDEXER_K_FP8, seed=i)
        idx.write_new()
        if cache is None:
            cache = idx.cache  # the graph reads this cache: later steps write into it
        else:
            cache.copy_(idx.cache)
        bufs.fill(qlens, [c + n for c, n in reqs], bt, idx.slots[:sum(qlens)], max_query_len=q_len)
        q.copy_(idx.q_fp8)
        w.copy_(idx.weights)
        if i == 0:  # vLLM's capture batch (its own contents here), then the capture
            graph, static = capture(run)
            continue
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            want = run().clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, want), f"step {qlens}: replay differs from eager"
        real = sum(qlens)
        assert torch.all(want[real:] == -1)
        sel, logits_of = oracle_selection(idx, bt, topk)
        assert_same_selection(want[:real], sel[:real], logits_of)
