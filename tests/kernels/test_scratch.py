"""kernels.scratch: the split partials' reusable buffer (an eager call allocates only its outputs),
and the ops that use it (sparse_mla_decode, paged_attention): repeated and interleaved calls of
plans of different sizes, growth of the buffer, another host thread."""
import threading

import pytest
import torch

from openmla.kernels import scratch
from openmla.kernels.paged_attention import paged_attention
from openmla.kernels.reference import paged_attention_ref, sparse_mla_decode_ref
from openmla.kernels.sparse_mla_decode import op as decode_op
from openmla.kernels.sparse_mla_decode import sparse_mla_decode
from openmla.quant import FP8_DS_MLA
from tests.helpers import DEVICE, GPU_ONLY, assert_close
from tests.kernels.test_sparse_mla_decode import SCALE, make_inputs


@pytest.fixture(autouse=True)
def _fresh():
    scratch.release()
    yield
    scratch.release()


# a list long enough to split at one or two tokens on the GPU kernels too (the interpreter splits 200)
TOPK = 2048 if DEVICE == "cuda" else 200


def _device():
    return torch.empty(0, device=DEVICE).device  # with its index, as the ops' tensors have it


def _buffers():
    return list(scratch._BUFS.values())


def test_views_are_kept_per_plan_and_share_one_buffer():
    dev = _device()
    a = scratch.partials(-101, dev, ((2, 3, 5), (7,)))
    assert [t.shape for t in a] == [(2, 3, 5), (7,)]
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in a)
    base = _buffers()[0].data_ptr()  # the allocator's alignment (CUDA: 512 bytes, CPU: 64)
    assert base % 16 == 0 and all((t.data_ptr() - base) % 128 == 0 for t in a)
    assert a[1].data_ptr() >= a[0].data_ptr() + a[0].numel() * 4  # disjoint
    assert scratch.partials(-101, dev, ((2, 3, 5), (7,))) is a  # the same tensors again
    b = scratch.partials(-102, dev, ((4,),))
    assert len(_buffers()) == 1 and b[0].data_ptr() == a[0].data_ptr()  # one buffer, both plans


def test_growth_replaces_the_buffer_and_every_view_of_the_old_one():
    dev = _device()
    small = scratch.partials(-1, dev, ((8,),))
    big = scratch.partials(-2, dev, ((4096,), (64,)))
    (buf,) = _buffers()
    assert buf.numel() >= 4096 + 64
    again = scratch.partials(-1, dev, ((8,),))
    assert again is not small and again[0].data_ptr() == buf.data_ptr()
    assert scratch.partials(-2, dev, ((4096,), (64,))) is big  # made on the new buffer
    assert len(scratch._VIEWS) == 2


def test_another_thread_gets_its_own_buffer():
    dev = _device()
    mine = scratch.partials(-5, dev, ((16,),))[0]
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(scratch.partials(-5, dev, ((16,),))[0]))
    t.start()
    t.join()
    assert len(_buffers()) == 2
    assert theirs[0].data_ptr() != mine.data_ptr()


def test_decode_calls_of_two_plans_interleaved():
    """Two split plans (T1 and T2) alternate on one buffer; each call equals
    the oracle and its own first result bit for bit, and no call after the first two allocates
    partials (the buffer and its address stay)."""
    ins = [make_inputs("fp8", T, 16, TOPK, 64, 64, seed=T) for T in (2, 1)]
    for q, cache, idx in ins:
        assert decode_op._get_plan(q, cache, idx, None, None, FP8_DS_MLA)[5] > 1
    first = [sparse_mla_decode(q, c, i, scale=SCALE) for q, c, i in ins]  # the buffer's size
    (buf,) = _buffers()
    for (q, c, i), (out0, lse0) in zip(ins * 2, first * 2):
        out, lse = sparse_mla_decode(q, c, i, scale=SCALE)
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
        want, want_lse = sparse_mla_decode_ref(q, c, i, scale=SCALE)
        assert_close("out", out, want, "sparse_decode")
        assert_close("lse", lse, want_lse, "lse")
    assert len(_buffers()) == 1 and _buffers()[0] is buf


def _paged_inputs():
    g = torch.Generator().manual_seed(3)
    B, H, H_kv, D, page, nblk = 2, 4, 2, 64, 16, 12
    k = torch.randn(nblk, page, H_kv, D, generator=g).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(nblk, page, H_kv, D, generator=g).to(torch.bfloat16).to(DEVICE)
    table = torch.randperm(nblk, generator=g)[:2 * 6].view(2, 6).to(torch.int32).to(DEVICE)
    lens = torch.tensor([90, 33], dtype=torch.int32, device=DEVICE)
    cu = torch.arange(B + 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
    return q, k, v, table, cu, lens


def test_paged_attention_splits_on_the_scratch():
    """A split-KV paged decode repeated after another plan used (and grew) the buffer: same result,
    equal to the oracle."""
    args = _paged_inputs()
    out0 = paged_attention(*args, scale=0.11, num_splits=3)
    assert len(_buffers()) == 1
    scratch.partials(next(scratch.PLAN_IDS), _device(), ((1 << 16,),))  # grows it
    out1 = paged_attention(*args, scale=0.11, num_splits=3)
    assert torch.equal(out0, out1)
    want, _ = paged_attention_ref(*args, scale=0.11)
    assert_close("out", out1, want, "bf16")


def test_plans_of_two_ops_keep_apart():
    """The decode's and the paged attention's plans number themselves from one counter: their
    views of the one buffer never mix (paged, decode, paged again, decode again: each its own
    first result)."""
    paged = _paged_inputs()
    dec = make_inputs("fp8", 1, 16, TOPK, 64, 64, seed=4)
    p0 = paged_attention(*paged, scale=0.11, num_splits=3)
    d0, l0 = sparse_mla_decode(*dec, scale=SCALE)
    for _ in range(2):
        assert torch.equal(paged_attention(*paged, scale=0.11, num_splits=3), p0)
        d, lse = sparse_mla_decode(*dec, scale=SCALE)
        assert torch.equal(d, d0) and torch.equal(lse, l0)
    assert len(_buffers()) == 1


@GPU_ONLY
def test_captured_decode_keeps_its_own_partials():
    """A decode captured in a CUDA graph allocates its partials in the graph's pool (the eager
    scratch is neither used nor grown while capturing); replays interleaved with eager calls of
    another plan on the scratch give the eager results bit for bit."""
    a = make_inputs("fp8", 1, 16, 2048, 64, 64, seed=1)
    b = make_inputs("fp8", 2, 16, 2048, 64, 64, seed=2)
    out_a, lse_a = sparse_mla_decode(*a, scale=SCALE)
    out_b, lse_b = sparse_mla_decode(*b, scale=SCALE)
    bufs = _buffers()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got_a, got_lse_a = sparse_mla_decode(*a, scale=SCALE)
    assert [x.data_ptr() for x in _buffers()] == [x.data_ptr() for x in bufs]
    for _ in range(3):
        got_a.zero_()
        g.replay()
        again_b, again_lse_b = sparse_mla_decode(*b, scale=SCALE)
        torch.cuda.synchronize()
        assert torch.equal(got_a, out_a) and torch.equal(got_lse_a, lse_a)
        assert torch.equal(again_b, out_b) and torch.equal(again_lse_b, lse_b)


def test_repeated_decode_signature_off_16_bytes():
    """A repeated call signature (same shapes and strides) whose q or out starts off 16 bytes runs
    run_plan's unkeyed launch: the bound launches key on 16-byte aligned pointers."""
    q, cache, idx = make_inputs("fp8", 1, 16, TOPK, 64, 64, seed=6)
    wide = torch.full((1, 16, 584), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    outs = torch.full((1, 16, 520), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    want, want_lse = sparse_mla_decode_ref(q, cache, idx, scale=SCALE)
    for off in (0, 1, 0, 3):  # elements of 2 bytes: 0 is aligned, 1 and 3 are not
        q_view = wide[:, :, off:off + 576]
        q_view.copy_(q)
        out = outs[:, :, off:off + 512]
        got, lse = sparse_mla_decode(q_view, cache, idx, scale=SCALE, out=out)
        assert got is out
        assert_close("out", got, want, "sparse_decode")
        assert_close("lse", lse, want_lse, "lse")
    assert len(decode_op._VALIDATED) >= 1
