"""mla.sparse.v4_impl.SparseMLAV4Impl and its plan (mla/sparse/v4_plan.py): a DeepSeek-V4-style
layer over a sliding-window cache plus a compressed cache, one softmax, against an oracle written
from the definition per query token.

Each step: requests with a context and new tokens (decodes first, a long prefill, a request with
no context, speculative-style multi-token decodes), padding tokens past the last request, both
caches MODEL1 (FP8_MODEL1) written by the layer's write_cache through shuffled block tables, every
unwritten token NaN (0xFF bytes), window pages wholly before every query's window unmapped (-1,
as an engine frees them; their bytes stay NaN), the indexer's top-k with every kind of invalid
entry (negative, not yet visible to the query, past the request's entries, INT32_MAX),
per-head sinks with a -inf head, a non-default scale.

The oracle (`oracle`): for token t of request r at position p, the keys are the request's window
tokens max(p - W + 1, 0) .. p and the compressed entries e its list names with 0 <= e <
(p + 1) // ratio (all of those for a C128A-style layer), each as the MODEL1 round trip of the
value written (FP8_MODEL1.pack then unpack); then kernels.reference.sparse_mla_ref over them.
"""
from __future__ import annotations

import pytest
import torch

from openmla.kernels.reference import sparse_mla_ref
from openmla.mla.sparse.v4_impl import SparseMLAV4Impl
from openmla.mla.sparse.v4_plan import V4PlanBuffers, build_sparse_mla_v4_plan
from openmla.quant import FP8_MODEL1
from tests.helpers import DEVICE, INT32_MAX, INT32_MIN, assert_close, capture, shuffled_block_table

D = 512
SCALE = 0.061
# (context, new tokens) per request, decodes first
STEP = [(40, 1), (7, 1), (21, 3), (0, 5), (61, 9)]


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    """MODEL1 quantize-dequantize of tokens [n, 512] (what a cache read gives), fp32."""
    if x.shape[0] == 0:
        return x.float()
    return FP8_MODEL1.unpack(FP8_MODEL1.pack(x.view(-1, 1, D))).view(-1, D)


class V4Step:
    """One engine step for a layer of `ratio` (<= 1: window only)."""

    def __init__(self, reqs, *, H, window, window_bs, ratio, comp_bs, topk, padding, seed,
                 max_model_len=128, free_old_blocks=True, sink=True):
        g = torch.Generator().manual_seed(seed)
        self.reqs, self.H, self.window, self.ratio, self.max_model_len = reqs, H, window, ratio, max_model_len
        R = len(reqs)
        qlens = [n for _, n in reqs]
        self.seq = [c + n for c, n in reqs]
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        self.T = qsl[-1] + padding
        self.tok = [(r, c + i) for r, (c, n) in enumerate(reqs) for i in range(n)]  # (request, pos)
        self.impl = SparseMLAV4Impl(H, SCALE, compress_ratio=ratio)
        if sink:
            s = torch.randn(H, generator=g) * 2
            s[0] = float("-inf")
            self.impl.set_attn_sink(s.to(DEVICE))

        # the window cache: every position of every request is written (an engine writes each
        # token once); pages wholly before every window of this step are then unmapped
        self.k_win = [torch.randn(s, D, generator=g).to(torch.bfloat16) for s in self.seq]
        self.window_cache, self.window_table = self._paged(self.k_win, window_bs, g, new=qlens)
        if free_old_blocks:
            for r, (c, n) in enumerate(reqs):
                first_visible = max(c - window + 1, 0)  # the earliest window start of the request
                for b in self.window_table[r, : first_visible // window_bs].tolist():
                    self.window_cache[b] = 0xFF  # freed: NaN bytes, and unmapped below
                self.window_table[r, : first_visible // window_bs] = -1
        compressed = None
        self.k_comp = [torch.randn(s // max(ratio, 1), D, generator=g).to(torch.bfloat16) for s in self.seq]
        if ratio > 1:
            self.comp_cache, comp_table = self._paged(self.k_comp, comp_bs, g)
            compressed = {ratio: (comp_table.to(DEVICE), comp_bs)}
        self.q = torch.randn(self.T, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
        self.indices = None
        if topk:
            idx = torch.randint(-1, max(self.seq) // max(ratio, 1) + 2, (self.T, topk), generator=g,
                                dtype=torch.int32)
            bad = torch.tensor([INT32_MIN, -5, INT32_MAX], dtype=torch.int32)
            idx[torch.rand(self.T, topk, generator=g) < 0.2] = bad[0]
            idx[:, -1] = bad[torch.arange(self.T) % 3]
            self.indices = idx.to(DEVICE)
        self.plan_args = (torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                          torch.tensor(self.seq, dtype=torch.int32, device=DEVICE),
                          self.window_table.to(DEVICE), self.T)
        self.plan_kw = dict(window_size=window, window_block_size=window_bs, num_heads=H,
                            max_model_len=max_model_len, compressed=compressed)

    def _paged(self, per_req, bs, g, new=None):
        """A NaN-filled MODEL1 cache holding each request's tokens through a shuffled table: the
        last new[r] tokens of request r written by the layer's write_cache (this step's), the
        earlier ones packed by FP8_MODEL1.pack (an earlier step's: the same bytes)."""
        R = len(per_req)
        nblk = max([-(-len(x) // bs) for x in per_req] + [1])
        num_blocks = R * nblk + 3
        table = shuffled_block_table(R, nblk, num_blocks, generator=g, device="cpu")
        old = torch.full((num_blocks * bs, D), float("nan"), dtype=torch.bfloat16)
        ks, slots = [], []
        for r, x in enumerate(per_req):
            p = torch.arange(len(x))
            slot = table[r, p // bs].long() * bs + p % bs
            n = 0 if new is None else new[r]
            old[slot[:len(x) - n]] = x[:len(x) - n]
            ks.append(x[len(x) - n:])
            slots.append(slot[len(x) - n:])
        cache = FP8_MODEL1.pack(old.view(num_blocks, bs, 1, D).to(DEVICE))
        if new is not None:
            self.impl.write_cache(torch.cat(ks).to(DEVICE), cache, torch.cat(slots).to(DEVICE))
        return cache, table

    def plan(self, **kw):
        return build_sparse_mla_v4_plan(*self.plan_args, **{**self.plan_kw, **kw})

    def forward(self, plan=None, **kw):
        plan = self.plan() if plan is None else plan
        extra = {}
        if self.ratio > 1:
            extra = dict(compressed_cache=self.comp_cache, compressed_indices=self.indices)
        return self.impl.forward_mqa(self.q, self.window_cache, plan, **extra, **kw)

    def oracle(self):
        out = torch.zeros(self.T, self.H, D)
        lse = torch.full((self.T, self.H), float("-inf"))
        for t, (r, p) in enumerate(self.tok):
            rows = [_round_trip(self.k_win[r][max(p - self.window + 1, 0): p + 1])]
            if self.ratio > 1:
                visible = (p + 1) // self.ratio
                entries = (range(visible) if self.indices is None else
                           [e for e in self.indices[t].tolist() if 0 <= e < visible])
                rows.append(_round_trip(self.k_comp[r][list(entries)]))
            kv = torch.cat(rows).to(DEVICE)
            idx = torch.arange(kv.shape[0], dtype=torch.int32, device=DEVICE)[None]
            o, _, l = sparse_mla_ref(self.q[t:t + 1], kv, idx, scale=SCALE, attn_sink=self.impl.attn_sink,
                                     d_v=D)
            out[t], lse[t] = o[0].cpu(), l[0].cpu()
        return out, lse


CASES = [  # H, window, window_bs, ratio, comp_bs, topk, padding
    pytest.param(5, 16, 8, 4, 4, 7, 2, id="C4A-H5-w16-bs8-topk7-pad2"),
    pytest.param(16, 8, 4, 4, 2, 12, 0, id="C4A-H16-w8-bs4-cbs2-topk12"),
    pytest.param(3, 16, 16, 8, 1, 0, 1, id="C128A-style-ratio8-all-visible-H3"),
    pytest.param(8, 16, 8, 1, 0, 0, 3, id="window-only-H8-pad3"),
]


@pytest.mark.parametrize("H,window,window_bs,ratio,comp_bs,topk,padding", CASES)
def test_layer_matches_oracle(H, window, window_bs, ratio, comp_bs, topk, padding):
    s = V4Step(STEP, H=H, window=window, window_bs=window_bs, ratio=ratio, comp_bs=comp_bs, topk=topk,
               padding=padding, seed=H * 7 + ratio)
    out = s.forward()
    want, _ = s.oracle()
    assert out.shape == (s.T, H, D) and out.dtype == torch.bfloat16
    assert_close("out", out.float(), want, "sparse_decode_model1")
    if padding:
        assert bool((out[s.T - padding:] == 0).all())


def test_plan_window_lists():
    """The window list of each token: its request's positions max(p - W + 1, 0) .. p in order as
    slots of the window cache, -1 after them and on unmapped pages; lengths; padding empty."""
    s = V4Step(STEP, H=2, window=16, window_bs=8, ratio=1, comp_bs=0, topk=0, padding=2, seed=1)
    plan = s.plan()
    table = s.window_table
    for t in range(s.T):
        if t >= len(s.tok):
            assert int(plan.window_lens[t]) == 0 and bool((plan.window_slots[t] == -1).all())
            assert int(plan.req_id_per_token[t]) == len(STEP)
            continue
        r, p = s.tok[t]
        pos = list(range(max(p - 15, 0), p + 1))
        want = [int(table[r, q // 8]) * 8 + q % 8 if int(table[r, q // 8]) >= 0 else -1 for q in pos]
        assert plan.window_slots[t, :len(pos)].tolist() == want
        assert bool((plan.window_slots[t, len(pos):] == -1).all())
        assert int(plan.window_lens[t]) == len(pos) and int(plan.positions[t]) == p


def test_compressed_slots_are_causal_and_isolated():
    """Entry e of a query at position p counts only when 0 <= e < (p + 1) // ratio (its request's
    entries are seq_len // ratio >= that): a later entry, one past the request, or a negative one
    is -1, never another request's slot."""
    s = V4Step(STEP, H=2, window=8, window_bs=8, ratio=4, comp_bs=4, topk=5, padding=1, seed=2)
    plan = s.plan()
    entries = torch.arange(20, dtype=torch.int32, device=DEVICE).repeat(s.T, 1) - 2  # -2 .. 17
    slots = plan.compressed_slots(4, entries)
    table = plan.compressed[4].block_table.cpu()
    for t in range(s.T):
        visible = (s.tok[t][1] + 1) // 4 if t < len(s.tok) else 0
        r = s.tok[t][0] if t < len(s.tok) else None
        for k, e in enumerate(entries[t].tolist()):
            want = int(table[r, e // 4]) * 4 + e % 4 if 0 <= e < visible else -1
            assert int(slots[t, k]) == want, (t, e)


def test_plan_buffers_keep_their_addresses():
    """A plan built into V4PlanBuffers equals one built without, and two steps' plans share the
    buffers' storage (a captured graph replays with the next step's plan)."""
    s = V4Step(STEP, H=4, window=16, window_bs=8, ratio=4, comp_bs=4, topk=6, padding=2, seed=3)
    bufs = V4PlanBuffers.allocate(s.T + 5, 16, DEVICE)
    free, kept = s.plan(), s.plan(buffers=bufs)
    for name in ("req_id_per_token", "positions", "window_slots", "window_lens"):
        assert torch.equal(getattr(free, name), getattr(kept, name)), name
    assert kept.window_slots.data_ptr() == bufs.window_slots.data_ptr()
    assert kept.req_id_per_token.data_ptr() == bufs.req_id.data_ptr()
    assert torch.equal(s.forward(kept), s.forward(free))


def test_all_visible_list_is_built_once_per_step():
    s = V4Step(STEP, H=2, window=8, window_bs=8, ratio=8, comp_bs=2, topk=0, padding=0, seed=4)
    plan = s.plan()
    first = plan.all_visible(8)
    assert plan.all_visible(8) is first
    slots, lengths = first
    assert slots.shape == (s.T, -(-128 // 8))
    assert lengths.tolist() == [(p + 1) // 8 for _, p in s.tok]


def test_no_host_sync(monkeypatch):
    """Building the plan and running the layer read no device value on the host."""
    s = V4Step(STEP, H=4, window=8, window_bs=8, ratio=4, comp_bs=4, topk=6, padding=1, seed=5)

    def refuse(*args, **kwargs):
        raise AssertionError("a host read of a tensor value")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    s.forward(s.plan())


# ------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------
def _step():
    return V4Step(STEP[:2], H=2, window=8, window_bs=8, ratio=4, comp_bs=4, topk=3, padding=0, seed=6)


def test_refusals():
    s = _step()
    plan = s.plan()
    with pytest.raises(ValueError, match="compressed_cache"):
        s.impl.forward_mqa(s.q, s.window_cache, plan)
    with pytest.raises(ValueError, match="compress_ratio"):
        build = s.plan(compressed={8: (plan.compressed[4].block_table, 4)})
        s.impl.forward_mqa(s.q, s.window_cache, build, compressed_cache=s.comp_cache)
    with pytest.raises(ValueError, match="compressed_cache.shape\\[1\\]"):
        s.impl.forward_mqa(s.q, s.window_cache, s.plan(compressed={4: (plan.compressed[4].block_table, 2)}),
                           compressed_cache=s.comp_cache)
    with pytest.raises(ValueError, match="window_cache.shape\\[1\\]"):
        s.impl.forward_mqa(s.q, s.window_cache, s.plan(window_block_size=4), compressed_cache=s.comp_cache)
    with pytest.raises(ValueError, match="^q.shape"):
        s.impl.forward_mqa(s.q[..., :448], s.window_cache, plan, compressed_cache=s.comp_cache)
    with pytest.raises(ValueError, match="plan.num_heads"):
        s.impl.forward_mqa(s.q, s.window_cache, s.plan(num_heads=3), compressed_cache=s.comp_cache)
    with pytest.raises(ValueError, match="compressed_indices.dtype"):
        s.impl.forward_mqa(s.q, s.window_cache, plan, compressed_cache=s.comp_cache,
                           compressed_indices=s.indices.long())
    window_only = SparseMLAV4Impl(2, SCALE, compress_ratio=1)
    with pytest.raises(ValueError, match="window-only"):
        window_only.forward_mqa(s.q, s.window_cache, plan, compressed_cache=s.comp_cache)
    with pytest.raises(NotImplementedError, match="fp8_model1"):
        SparseMLAV4Impl(2, SCALE, compress_ratio=4, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(NotImplementedError, match="num_heads"):
        SparseMLAV4Impl(129, SCALE, compress_ratio=4)
    with pytest.raises(ValueError, match="attn_sink.shape"):
        SparseMLAV4Impl(2, SCALE, compress_ratio=4, attn_sink=torch.zeros(3))
    with pytest.raises(ValueError, match="compressed \\(ratio\\)"):
        s.plan(compressed={1: (plan.compressed[4].block_table, 4)})
    with pytest.raises(ValueError, match="buffers.window_slots.shape"):
        s.plan(buffers=V4PlanBuffers.allocate(s.T, 4, DEVICE))


# ------------------------------------------------------------------------------------------------
# GPU: DeepSeek-V4's sizes (window 128, top-k 512 over a ratio-4 cache, block 64 / 16) and CUDA
# graphs (the plan rebuilt into the same buffers between replays)
# ------------------------------------------------------------------------------------------------
BIG_STEP = [(700, 1)] * 6 + [(300, 2), (129, 1), (0, 40), (1000, 17)]


@pytest.mark.skipif(DEVICE != "cuda", reason="V4-sized steps: too slow for the CPU interpreter")
@pytest.mark.parametrize("H,ratio,topk", [pytest.param(64, 4, 512, id="C4A-H64-topk512"),
                                          pytest.param(128, 128, 0, id="C128A-H128"),
                                          pytest.param(16, 1, 0, id="window-only-H16")])
def test_v4_sizes_match_oracle(H, ratio, topk):
    s = V4Step(BIG_STEP, H=H, window=128, window_bs=64, ratio=ratio, comp_bs=64 // max(ratio, 1) or 1,
               topk=topk, padding=3, seed=H + ratio, max_model_len=1024)
    want, _ = s.oracle()
    assert_close("out", s.forward().float(), want, "sparse_decode_model1")


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: CUDA graph capture")
@pytest.mark.parametrize("ratio,topk", [pytest.param(4, 64, id="C4A"), pytest.param(8, 0, id="C128A-style")])
def test_cuda_graph_replays_the_next_steps_plan(ratio, topk):
    """forward_mqa captured with a plan built into V4PlanBuffers over persistent engine tensors;
    the next step's values are written into the same tensors, its plan rebuilt into the same
    buffers (with CUDA's sync debug mode "error": no host read) and the graph replayed: bit for
    bit what an eager call on the next step gives."""
    steps = [V4Step([(30, 1), (17, 1), (50, 1)], H=16, window=16, window_bs=8, ratio=ratio, comp_bs=4,
                    topk=topk, padding=1, seed=10 + k) for k in range(2)]
    a, b = steps
    # engine tensors: step a's, overwritten in place with step b's (same shapes: same batch sizes)
    qsl, seq, wtable, T = (x.clone() if isinstance(x, torch.Tensor) else x for x in a.plan_args)
    ctable = a.plan_kw["compressed"][ratio][0].clone()
    bufs = V4PlanBuffers.allocate(T, 16, DEVICE)
    q, win, comp = a.q.clone(), a.window_cache.clone(), a.comp_cache.clone()
    idx = a.indices.clone() if topk else None

    def build():
        return build_sparse_mla_v4_plan(qsl, seq, wtable, T, **{**a.plan_kw, "compressed": {ratio: (ctable, 4)},
                                                                "buffers": bufs})

    plan = build()

    def fwd():
        return a.impl.forward_mqa(q, win, plan, compressed_cache=comp, compressed_indices=idx)

    graph, out = capture(fwd)
    for src, dst in ((b.plan_args[0], qsl), (b.plan_args[1], seq), (b.plan_args[2], wtable),
                     (b.plan_kw["compressed"][ratio][0], ctable), (b.q, q), (b.window_cache, win),
                     (b.comp_cache, comp)) + (((b.indices, idx),) if topk else ()):
        dst.copy_(src)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        build()  # the next step's plan, into the same buffers
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph.replay()
    # the captured layer (a's weights: its sink) on step b's inputs, eagerly, with b's own plan
    want = a.impl.forward_mqa(b.q, b.window_cache, b.plan(), compressed_cache=b.comp_cache,
                              compressed_indices=b.indices)
    assert torch.equal(out, want)
    assert not torch.equal(out, a.forward())  # the replay computed step b, not step a again
