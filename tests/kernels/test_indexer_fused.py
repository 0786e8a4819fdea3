"""kernels/indexer/paged_topk.py: the decode logits and their top-k in one cooperative launch.

Everywhere: paged_mqa_topk against the oracle chain (fp32 logits, top-k up to ties) on the paged
tests' adversarial batches, and its argument checks. On the GPU: the fused launch gives the
two-kernel path's result slot for slot (ties across part boundaries, NaN and -inf keys, rows
shorter than k, speculative rows, every ranking path of the last stage), leaves its workspace
zero, replays in a CUDA graph, and sizes its grid to what can be resident. The interpreter runs
programs one after another, where the fused launch's barriers cannot be passed: there the op
runs the two kernels (the module docstring), so the fused tests need a GPU.
"""
import pytest
import torch

from openmla.kernels.indexer import decode_topk, paged_mqa_logits, paged_mqa_topk
from openmla.kernels.indexer import topk as topk_module
from openmla.kernels.reference import paged_mqa_logits_ref
from openmla.quant.indexer_cache import write_indexer_k_cache
from tests.helpers import DEVICE
from tests.kernels.test_indexer import _check_topk, _paged_batch, _paged_bound, assert_logits

FUSED_GPU = pytest.mark.skipif(DEVICE == "cpu", reason="the fused launch needs co-resident programs "
                               "(an NVIDIA GPU); the interpreter runs the two-kernel path, tested above")


def _ends(cl, next_n):
    if cl.dim() == 2 and next_n > 1:
        return cl.reshape(-1).clamp_min(0).int()
    j = torch.arange(next_n, device=cl.device)
    return (cl.reshape(-1)[:, None] - next_n + 1 + j[None, :]).reshape(-1).clamp_min(0).int()


def _batch(ctx, next_n, bs, seed, *, ties=None, nan_page=None, per_row=None):
    """_paged_batch plus: `ties` (request, first, count) positions written with one key (equal
    logits across part boundaries), `nan_page` (request, page) pointed at a block never written
    (NaN keys), per-row lengths [B, next_n]."""
    q, w, cache, table = _paged_batch(ctx, next_n, 64, bs, seed)
    if ties is not None:
        b, first, count = ties
        pos = torch.arange(first, first + count)
        slots = table[b, pos // bs].long().cpu() * bs + pos % bs
        key = torch.randn(1, 128, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        write_indexer_k_cache(key.expand(count, 128).contiguous().to(DEVICE), cache, slots.to(DEVICE))
    if nan_page is not None:
        used = set(table[table >= 0].tolist())
        table[nan_page] = next(i for i in range(cache.shape[0]) if i not in used)
    cl = torch.tensor(per_row if per_row is not None else ctx, dtype=torch.int32, device=DEVICE)
    return q, w, cache, table, cl


CASES = [
    pytest.param([300, 1, 64], 1, 16, 32, {}, id="B3-k32-short-rows"),
    pytest.param([130, 200], 2, 8, 50, dict(ties=(1, 20, 90)), id="B2-n2-k50-ties"),
    pytest.param([260], 3, 4, 7, dict(nan_page=(0, 5), per_row=[[255, 260, 3]]), id="B1-n3-k7-nan-per-row"),
    pytest.param([0, 90], 1, 16, 100, {}, id="B2-k100-all-shorter"),
]


@pytest.mark.parametrize("ctx,next_n,bs,k,extra", CASES)
def test_paged_topk_oracle(ctx, next_n, bs, k, extra):
    q, w, cache, table, cl = _batch(ctx, next_n, bs, seed=len(ctx) + k, **extra)
    L = max(ctx) + 16
    got = paged_mqa_topk(q, w, cache, cl, table, max_model_len=L, k=k)
    # the top-k oracle over the logits (the logits kernel is held to paged_mqa_logits_ref in
    # test_indexer.py; here its rounding decides which of two close keys is selected)
    logits = paged_mqa_logits(q, w, cache, cl, table, max_model_len=L)
    assert_logits("logits", logits, paged_mqa_logits_ref(q, w, cache, cl, table, max_model_len=L),
                  _paged_bound(q, w, cache, cl, table, L))
    _check_topk(got.cpu(), logits.cpu(), _ends(cl, next_n).cpu(), k)


def test_paged_topk_bad_input():
    q, w, cache, table, cl = _batch([40, 5], 1, 4, seed=1)
    with pytest.raises(ValueError, match="k"):
        paged_mqa_topk(q, w, cache, cl, table, max_model_len=48, k=0)
    with pytest.raises(ValueError, match="out"):
        paged_mqa_topk(q, w, cache, cl, table, max_model_len=48, k=8,
                       out=torch.empty(2, 9, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="weights"):
        paged_mqa_topk(q, w[:1], cache, cl, table, max_model_len=48, k=8, fused=DEVICE != "cpu")
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="fused"):
            paged_mqa_topk(q, w, cache, cl, table, max_model_len=48, k=8, fused=True)
    else:
        with pytest.raises(ValueError, match="workspace"):
            paged_mqa_topk(q, w, cache, cl, table, max_model_len=48, k=8, fused=True,
                           workspace=torch.zeros(3, dtype=torch.int32, device=DEVICE))
        with pytest.raises(ValueError, match="topk_block"):
            paged_mqa_topk(q, w, cache, cl, table, max_model_len=48, k=8, fused=True, topk_block=100)


# ---------------------------------------------------------------------------------------------
# The fused launch (GPU)
# ---------------------------------------------------------------------------------------------
def _both(q, w, cache, table, cl, L, k, **kw):
    fused = paged_mqa_topk(q, w, cache, cl, table, max_model_len=L, k=k, fused=True, **kw)
    logits = paged_mqa_logits(q, w, cache, cl, table, max_model_len=L, clean_logits=False)
    two = decode_topk(logits, cl, q.shape[1], k)
    return fused, two, logits


@FUSED_GPU
@pytest.mark.parametrize("limits", [{}, {"_PAIRWISE": 2}, {"_CANDIDATES": 3}])
@pytest.mark.parametrize("B,ctx,next_n,k,block", [
    (1, 4096, 1, 2048, 256), (1, 16384, 1, 2048, 128), (3, 65536, 1, 2048, 1024), (8, 16384, 1, 2048, 256),
    (2, 5000, 2, 2048, 512), (4, 3000, 1, 300, 128),
])
def test_paged_topk_fused_equals_two_kernels(B, ctx, next_n, k, block, limits, monkeypatch):
    for name, v in limits.items():
        monkeypatch.setattr(topk_module, name, v)
    g = torch.Generator().manual_seed(B * 7 + next_n)
    lens = [ctx] + torch.randint(1, ctx + 1, (B - 1,), generator=g).tolist()
    q, w, cache, table, cl = _batch(lens, next_n, 64, seed=B + k, ties=(0, ctx // 3, 700),
                                    nan_page=(B - 1, 1) if B > 2 else None)
    fused, two, logits = _both(q, w, cache, table, cl, ctx, k, topk_block=block)
    assert torch.equal(fused, two)
    _check_topk(fused.cpu(), logits.cpu(), _ends(cl, next_n).cpu(), k)


@FUSED_GPU
def test_paged_topk_fused_per_row_lens_and_invalid_pages():
    q, w, cache, table, cl = _batch([9000, 2500], 2, 64, seed=5, per_row=[[8999, 9000], [2100, 0]])
    table[0, 3] = -1
    table[1, 1] = 1 << 30
    fused, two, logits = _both(q, w, cache, table, cl, 9024, 2048)
    assert torch.equal(fused, two)
    _check_topk(fused.cpu(), logits.cpu(), _ends(cl, 2).cpu(), 2048)


@FUSED_GPU
def test_paged_topk_fused_workspace_graph_and_grid():
    q, w, cache, table, cl = _batch([20000, 7000], 1, 64, seed=9, ties=(1, 100, 3000))
    ws = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    want = decode_topk(paged_mqa_logits(q, w, cache, cl, table, max_model_len=20000, clean_logits=False),
                       cl, 1, 2048)
    out = torch.empty_like(want)
    for _ in range(3):  # the counts left zero: the same workspace serves the next call
        out.fill_(-7)
        paged_mqa_topk(q, w, cache, cl, table, max_model_len=20000, k=2048, fused=True, workspace=ws,
                       out=out)
        assert torch.equal(out, want)
        assert not ws.any()
    # a grid asked for past what can be resident is cut to what can (else the launch would fail)
    assert torch.equal(paged_mqa_topk(q, w, cache, cl, table, max_model_len=20000, k=2048, fused=True,
                                      waves=64), want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_mqa_topk(q, w, cache, cl, table, max_model_len=20000, k=2048, fused=True, workspace=ws, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_mqa_topk(q, w, cache, cl, table, max_model_len=20000, k=2048, fused=True, workspace=ws, out=out)
    for _ in range(3):
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert not ws.any()
