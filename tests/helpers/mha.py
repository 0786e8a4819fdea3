"""PagedAttentionImpl engine steps (tests/mla/test_mha_impl*.py, tests/vllm/test_vllm_attn_backend.py):
requests (q_len, context_len) whose contexts are already in NaN-filled strided paged caches with
shuffled block tables, the layer that runs them, its plan and the torch oracle over the cache the
step should leave behind."""
import math

import torch

from openmla.kernels.reference import paged_attention_ref
from openmla.mla import PagedAttentionImpl
from openmla.quant.kv_cache import quantize_fp8_per_tensor
from tests.helpers import DEVICE, nan_filled, prefix_sharing_block_table

SCALES = (0.027, 0.019)  # fp8 k_scale, v_scale: randn / 0.027 spans ~ +-150 of e4m3's +-448


def make_step(reqs, H, H_kv, D, bs, *, cache="bf16", pad=2, shared_blocks=0, kv5d=True,
              hnd_memory=False, q_dtype=torch.bfloat16, seed=0):
    """A step: requests (q_len, ctx_len) with their contexts written in NaN-filled paged caches.

    Returns a dict: query [T+pad, H, D] (strided), key/value [T+pad, H_kv, D] (new tokens; padding
    rows random), kv_cache (a [2, ...] strided view or a (k, v) tuple), the engine metadata
    (query_start_loc, seq_lens, block_table, slot_mapping, qlens, seqs), the expected caches
    after the write (want_k, want_v) and the unquantized full K/V per request (full_k, full_v)."""
    g = torch.Generator().manual_seed(seed)
    cdt = torch.float8_e4m3fn if cache == "fp8" else q_dtype
    seqs = [q + c for q, c in reqs]
    qlens = [q for q, _ in reqs]
    nblk = [max(math.ceil(s / bs), shared_blocks) for s in seqs]
    table, num_blocks = prefix_sharing_block_table(nblk, shared_blocks, 3, g)
    if hnd_memory:  # vLLM's HND stride order: [2, blocks, H_kv, rows, D] seen as NHD
        backing = nan_filled((2, num_blocks, H_kv, bs + 1, D), cdt)
        logical = lambda x: x.permute(0, 1, 3, 2, 4)[:, :, :bs]  # noqa: E731
    else:
        backing = nan_filled((2, num_blocks, bs + 1, H_kv, D), cdt)
        logical = lambda x: x[:, :, :bs]  # noqa: E731
    view = logical(backing)
    longest = max(seqs)
    shared_kv = torch.randn(2, longest, H_kv, D, generator=g).to(q_dtype).float()
    full_k, full_v, slots = [], [], []
    want = view.clone()
    store = (lambda x, i: quantize_fp8_per_tensor(x, SCALES[i])) if cache == "fp8" else (lambda x, i: x.to(cdt))
    for r, (q_len, ctx) in enumerate(reqs):
        s = seqs[r]
        # Values the model dtype represents exactly: the writer sees the same numbers as torch.
        kv = torch.randn(2, s, H_kv, D, generator=g).to(q_dtype).float()
        in_shared = torch.arange(s) < shared_blocks * bs
        kv[:, in_shared] = shared_kv[:, :s][:, in_shared]
        p = torch.arange(s)
        blk, off = table[r, p // bs].long(), p % bs
        for i in range(2):
            want[i, blk, off] = store(kv[i], i)
            view[i, blk[:ctx], off[:ctx]] = store(kv[i, :ctx], i)  # the context is already cached
        full_k.append(kv[0])
        full_v.append(kv[1])
        slots += (blk[ctx:] * bs + off[ctx:]).tolist()
    T = sum(qlens)
    new_k = torch.randn(T + pad, H_kv, D, generator=g)
    new_v = torch.randn(T + pad, H_kv, D, generator=g)
    t = 0
    for r, (q_len, ctx) in enumerate(reqs):
        new_k[t:t + q_len], new_v[t:t + q_len] = full_k[r][ctx:], full_v[r][ctx:]
        t += q_len
    wide = torch.randn(T + pad, H, D + 16, generator=g)
    qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    kv_cache = logical(dev(backing))
    if not kv5d:
        kv_cache = tuple(kv_cache.unbind(0))
    return dict(
        query=dev(wide.to(q_dtype))[:, :, 8:8 + D], key=dev(new_k.to(q_dtype)),
        value=dev(new_v.to(q_dtype)), kv_cache=kv_cache,
        query_start_loc=dev(qsl), seq_lens=dev(torch.tensor(seqs, dtype=torch.int32)),
        block_table=dev(table), slot_mapping=dev(torch.tensor(slots + [-1] * pad, dtype=torch.int64)),
        qlens=qlens, seqs=seqs, want_k=dev(want[0]), want_v=dev(want[1]), full_k=full_k,
        full_v=full_v, cache=cache)


def caches_of(kv_cache):
    return kv_cache.unbind(0) if isinstance(kv_cache, torch.Tensor) else kv_cache


def make_impl(H, D, H_kv, *, cache="bf16", window=None, softcap=None, alibi=False, sinks=False,
              attn_type="decoder", seed=2):
    g = torch.Generator().manual_seed(seed)
    impl = PagedAttentionImpl(
        H, D, 0.81 / math.sqrt(D), H_kv, sliding_window=window, softcap=softcap,
        alibi_slopes=(torch.rand(H, generator=g) * 0.3 + 0.02).tolist() if alibi else None,
        sinks=(torch.randn(H, generator=g) * 2).to(torch.bfloat16).to(DEVICE) if sinks else None,
        kv_cache_dtype="fp8" if cache == "fp8" else "auto", attn_type=attn_type)
    if cache == "fp8":
        impl.set_kv_scales(*SCALES)
    return impl


def step_oracle(impl, s, *, cache_k=None, cache_v=None, full=False):
    """paged_attention_ref over the expected caches (or, full=True, over the unquantized keys and
    values in a float32 copy of the same layout), with the layer's options."""
    kc, vc = (s["want_k"], s["want_v"]) if cache_k is None else (cache_k, cache_v)
    opts = dict(scale=impl.scale, window=impl.sliding_window, softcap=impl.softcap,
                sinks=None if impl.sinks is None else impl.sinks.float(),
                alibi_slopes=None if impl.alibi_slopes is None else impl.alibi_slopes.to(DEVICE))
    if full:
        kc = torch.full(kc.shape, float("nan"), device=DEVICE)
        vc = torch.full(vc.shape, float("nan"), device=DEVICE)
        bs = kc.shape[1]
        for r, s_len in enumerate(s["seqs"]):
            p = torch.arange(s_len, device=DEVICE)
            blk, off = s["block_table"][r, p // bs].long(), p % bs
            kc[blk, off], vc[blk, off] = s["full_k"][r].to(DEVICE), s["full_v"][r].to(DEVICE)
        return paged_attention_ref(s["query"], kc, vc, s["block_table"], s["query_start_loc"],
                                   s["seq_lens"], **opts)
    scales = dict(k_scale=SCALES[0], v_scale=SCALES[1]) if s["cache"] == "fp8" else {}
    return paged_attention_ref(s["query"], kc, vc, s["block_table"], s["query_start_loc"],
                               s["seq_lens"], **opts, **scales)


def step_plan(impl, s, **kw):
    return impl.build_plan(s["query_start_loc"], s["seq_lens"], s["block_table"],
                           s["slot_mapping"], max_query_len=max(s["qlens"]),
                           block_size=caches_of(s["kv_cache"])[0].shape[1],
                           query_lens_cpu=s["qlens"], seq_lens_cpu=s["seqs"], **kw)


# decodes, speculative decodes (q_len 3), prefills with and without context
MIXED = [(1, 39), (1, 8), (3, 27), (3, 14), (20, 0), (12, 33)]
