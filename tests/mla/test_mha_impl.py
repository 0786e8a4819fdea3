"""mla.attention: build_attention_plan and PagedAttentionImpl (write the cache, then attend).

A step is a list of requests (q_len, context_len): the context is already in the cache, forward
writes the q_len new keys/values and attends. The oracle is kernels.reference.paged_attention_ref
over the cache the step should leave behind, built by torch alone (context rows plus the new rows,
fp8 by torch's own e4m3fn(rne(x / scale)) quantization), with the layer's window, softcap, ALiBi
and sinks. The written cache is compared bit for bit with that expected cache (NaN-filled unused
rows included: nothing else may be written). Inputs are adversarial: NaN-filled
strided caches with hidden rows, shuffled block tables with invalid unused entries, strided q,
padding rows (slot -1: never written, out 0), a non-default scale. Tolerances: bf16 for out
(fp8 caches too: the oracle reads the same quantized values); the fp8 cases also meet the fp8
tolerance against the unquantized keys and values.
"""
import numpy as np
import pytest
import torch

from openmla.kernels.reference import attention_varlen_ref, local_attention_ref, paged_attention_ref
from openmla.mla import AttentionPlan, PagedAttentionImpl, build_attention_plan
from tests.helpers import DEVICE, assert_close
from tests.helpers.mha import MIXED, SCALES, caches_of, make_impl, make_step, step_oracle, step_plan


def _check_cache_written(s, kv_cache):
    """Every byte of the caches' visible rows (untouched NaN rows included) as expected."""
    for got, want in zip(caches_of(kv_cache), (s["want_k"], s["want_v"])):
        bits = torch.uint8 if got.dtype == torch.float8_e4m3fn else torch.int16
        assert torch.equal(got.contiguous().view(bits).cpu(), want.contiguous().view(bits).cpu())


# ---------------------------------------------------------------------------------------------
# Forward over a mixed batch: decodes, speculative decodes (q_len 3), prefills
# ---------------------------------------------------------------------------------------------
FORWARD = [  # (reqs, H, H_kv, D, bs, impl options, plan options, step options)
    pytest.param(MIXED, 8, 2, 64, 16, dict(window=16, softcap=30.0, sinks=True),
                 dict(decode_threshold=3), {}, id="bf16-GQA4-window16-softcap-sinks"),
    pytest.param(MIXED, 8, 2, 64, 16, dict(cache="fp8", window=16, softcap=30.0, sinks=True),
                 dict(decode_threshold=3), dict(cache="fp8"), id="fp8-GQA4-window16-softcap-sinks"),
    pytest.param(MIXED, 8, 2, 64, 16, dict(cache="fp8"), {}, dict(cache="fp8", kv5d=False),
                 id="fp8-tuple-cache-threshold1"),
    pytest.param(MIXED, 4, 4, 32, 8, dict(alibi=True), {}, {}, id="bf16-MHA-alibi"),
    pytest.param([(1, 30), (1, 3), (1, 0), (1, 44)], 6, 1, 40, 7, dict(window=9), {},
                 dict(pad=3), id="decode-only-GQA6-bs7-window9"),
    pytest.param([(9, 5), (16, 0)], 4, 2, 32, 16, {}, {}, dict(q_dtype=torch.float16, kv5d=False),
                 id="fp16-prefill-only"),
    pytest.param(MIXED, 8, 2, 32, 16, dict(cache="fp8", window=16), dict(decode_threshold=3),
                 dict(cache="fp8", hnd_memory=True), id="fp8-HND-memory-order"),
]


@pytest.mark.parametrize("reqs,H,H_kv,D,bs,iopts,popts,sopts", FORWARD)
def test_forward_mixed_batch(reqs, H, H_kv, D, bs, iopts, popts, sopts):
    s = make_step(reqs, H, H_kv, D, bs, **sopts)
    impl = make_impl(H, D, H_kv, **iopts)
    plan = step_plan(impl, s, **popts)
    T = s["query"].shape[0]
    assert plan.cascade is None and plan.num_tokens == T
    out = impl.forward(s["query"], s["key"], s["value"], s["kv_cache"], plan)
    assert out.shape == (T, H, D) and out.dtype == s["query"].dtype
    _check_cache_written(s, s["kv_cache"])
    want, _ = step_oracle(impl, s)
    assert_close("out", out, want, "bf16")
    if s["cache"] == "fp8":  # the format's own error stays inside the fp8 tolerance
        want_full, _ = step_oracle(impl, s, full=True)
        assert_close("out vs unquantized", out, want_full, "fp8")
    pad = T - sum(s["qlens"])
    assert torch.equal(out[T - pad:].float().cpu(), torch.zeros(pad, H, D))


def test_forward_into_output_and_uint8_fp8_storage():
    """vLLM keeps fp8 caches as uint8: they are viewed as e4m3fn. Output goes into the caller's
    strided buffer."""
    s = make_step(MIXED[:4], 8, 2, 32, 16, cache="fp8")
    impl = make_impl(8, 32, 2, cache="fp8", sinks=True)
    plan = step_plan(impl, s, decode_threshold=3)
    T = s["query"].shape[0]
    buf = torch.full((T, 8, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = impl.forward(s["query"], s["key"], s["value"], s["kv_cache"].view(torch.uint8), plan,
                       buf[:, :, :32])
    assert out.data_ptr() == buf.data_ptr()
    _check_cache_written(s, s["kv_cache"])
    assert_close("out", out, step_oracle(impl, s)[0], "bf16")


def test_forward_without_key_skips_the_write():
    """key = value = None (a layer sharing another layer's cache): nothing is written; attention
    reads what is there (here: the expected caches, written beforehand)."""
    s = make_step(MIXED, 8, 2, 32, 16)
    k, v = caches_of(s["kv_cache"])
    k.copy_(s["want_k"])
    v.copy_(s["want_v"])
    impl = make_impl(8, 32, 2, softcap=10.0)
    out = impl.forward(s["query"], None, None, s["kv_cache"], step_plan(impl, s, decode_threshold=3))
    _check_cache_written(s, s["kv_cache"])
    assert_close("out", out, step_oracle(impl, s)[0], "bf16")


# ---------------------------------------------------------------------------------------------
# Cascade and local attention through the plan
# ---------------------------------------------------------------------------------------------
def test_forward_cascade_forced_and_rounded():
    """common_prefix_len = 2 blocks + 5: the plan rounds it down to 2 whole blocks (vLLM's runner)
    and forward runs cascade; fp8 cache with sinks."""
    reqs = [(1, 50), (3, 40), (7, 33), (1, 61)]
    s = make_step(reqs, 8, 2, 32, 16, cache="fp8", shared_blocks=2)
    impl = make_impl(8, 32, 2, cache="fp8", sinks=True, softcap=25.0)
    plan = step_plan(impl, s, common_prefix_len=2 * 16 + 5, use_cascade=True)
    assert plan.use_cascade and plan.common_prefix_len == 32
    out = impl.forward(s["query"], s["key"], s["value"], s["kv_cache"], plan)
    _check_cache_written(s, s["kv_cache"])
    assert_close("out", out, step_oracle(impl, s)[0], "bf16")


def test_forward_cascade_by_heuristic():
    """8 requests, mixed query lengths, a 256-token shared prefix (4 blocks of 64), capped at the
    shortest context: vLLM's heuristic picks cascade; the result is plain attention's."""
    reqs = [(1, 270), (1, 300), (2, 259), (1, 281), (3, 290), (1, 256), (2, 262), (5, 275)]
    s = make_step(reqs, 4, 2, 32, 64, shared_blocks=4)
    impl = make_impl(4, 32, 2)
    plan = step_plan(impl, s, common_prefix_len=320)  # > shortest context 256: capped to 256
    assert plan.use_cascade and plan.common_prefix_len == 256
    out = impl.forward(s["query"], s["key"], s["value"], s["kv_cache"], plan)
    assert_close("out", out, step_oracle(impl, s)[0], "bf16")


def test_forward_local_attention():
    """attn_chunk_size 8 over block size 4: the plan rewrites the batch into virtual requests;
    the result is chunk-masked attention."""
    reqs = [(1, 21), (3, 6), (13, 4), (6, 0)]
    s = make_step(reqs, 8, 4, 32, 4)
    impl = make_impl(8, 32, 4, sinks=True)
    plan = step_plan(impl, s, attn_chunk_size=8, decode_threshold=3)
    assert plan.attn_chunk_size == 8 and plan.local.num_reqs == plan.num_reqs > len(reqs)
    out = impl.forward(s["query"], s["key"], s["value"], s["kv_cache"], plan)
    _check_cache_written(s, s["kv_cache"])
    want, _ = local_attention_ref(s["query"], s["want_k"], s["want_v"], s["block_table"],
                                  s["query_start_loc"], s["seq_lens"], attn_chunk_size=8,
                                  scale=impl.scale, sinks=impl.sinks.float())
    assert_close("out", out, want, "bf16")


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (graph capture)")
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_decode_steps_in_cuda_graph(cache):
    """A decode step captured once (plan built on the engine's static buffers, no host reads),
    replayed for two consecutive steps after in-place updates of q/k/v, slots and seq_lens: each
    replay writes its tokens and attends over the grown context (long contexts split-KV)."""
    H, H_kv, D, bs = 8, 2, 128, 16
    ctxs = [700, 40, 129, 6, 1500]
    R = len(ctxs)
    s = make_step([(2, c) for c in ctxs], H, H_kv, D, bs, cache=cache, pad=0)
    impl = make_impl(H, D, H_kv, cache=cache, window=256, sinks=True)
    q_buf = torch.empty(R, H, D, dtype=torch.bfloat16, device=DEVICE)
    k_buf = torch.empty(R, H_kv, D, dtype=torch.bfloat16, device=DEVICE)
    v_buf = torch.empty_like(k_buf)
    slot_buf = torch.empty(R, dtype=torch.int64, device=DEVICE)
    base = torch.tensor(ctxs, dtype=torch.int32, device=DEVICE) + 1
    seq_buf = base.clone()
    qsl = torch.arange(R + 1, dtype=torch.int32, device=DEVICE)
    out_buf = torch.empty(R, H, D, dtype=torch.bfloat16, device=DEVICE)
    plan = impl.build_plan(qsl, seq_buf, s["block_table"], slot_buf, max_query_len=1, block_size=bs)

    def fill(j):  # decode step j: the j-th new token of every request
        rows = torch.arange(R, device=DEVICE) * 2 + j
        q_buf.copy_(s["query"][rows])
        k_buf.copy_(s["key"][rows])
        v_buf.copy_(s["value"][rows])
        slot_buf.copy_(s["slot_mapping"][rows])
        seq_buf.copy_(base + j)

    def step():
        return impl.forward(q_buf, k_buf, v_buf, s["kv_cache"], plan, out_buf)

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: autotuning and compilation happen outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    scales = dict(k_scale=SCALES[0], v_scale=SCALES[1]) if cache == "fp8" else {}
    for j in range(2):
        fill(j)
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, _ = paged_attention_ref(q_buf, s["want_k"], s["want_v"], s["block_table"], qsl,
                                      base + j, scale=impl.scale, window=impl.sliding_window,
                                      sinks=impl.sinks.float(), **scales)
        assert_close(f"step {j}", out_buf, want, "bf16")
    _check_cache_written(s, s["kv_cache"])


# ---------------------------------------------------------------------------------------------
# Encoder attention: non-causal over the step's own keys, no cache
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn_type,iopts,want_window", [
    pytest.param("encoder_only", dict(window=5), (4, 4), id="encoder_only-window5-both-sides"),
    pytest.param("encoder", dict(window=5, sinks=True, softcap=20.0), (4, 0),
                 id="encoder-window5-left-sinks-softcap"),
    pytest.param("encoder", dict(alibi=True), (-1, -1), id="encoder-alibi"),
])
def test_encoder_attention(attn_type, iopts, want_window):
    H, H_kv, D = 8, 2, 32
    g = torch.Generator().manual_seed(5)
    qlens, pad = [7, 1, 12], 2
    T = sum(qlens)
    q = (torch.randn(T + pad, H, D + 8, generator=g).to(torch.bfloat16).to(DEVICE))[:, :, :D]
    k = torch.randn(T + pad, H_kv, D, generator=g).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(T + pad, H_kv, D, generator=g).to(torch.bfloat16).to(DEVICE)
    cu = torch.tensor([0] + qlens).cumsum(0).to(torch.int32).to(DEVICE)
    impl = make_impl(H, D, H_kv, attn_type=attn_type, **iopts)
    assert impl.sliding_window == want_window
    plan = build_attention_plan(cu, cu[1:].clone(), torch.zeros(3, 0, dtype=torch.int32, device=DEVICE),
                                torch.full((T + pad,), -1, dtype=torch.int32, device=DEVICE),
                                max_query_len=12, block_size=16, num_heads=H, num_kv_heads=H_kv,
                                query_lens_cpu=qlens, seq_lens_cpu=qlens)
    out = impl.forward(q, k, v, None, plan)
    want, _ = attention_varlen_ref(
        q, k, v, cu, cu, scale=impl.scale, causal=False, window=want_window,
        softcap=impl.softcap, sinks=None if impl.sinks is None else impl.sinks.float(),
        alibi_slopes=None if impl.alibi_slopes is None else impl.alibi_slopes.to(DEVICE))
    assert_close("out", out, want, "bf16")
    assert torch.equal(out[T:].float().cpu(), torch.zeros(pad, H, D))


# ---------------------------------------------------------------------------------------------
# The plan: decode-first split, no reads for decode steps, cascade decisions, reuse checks
# ---------------------------------------------------------------------------------------------
def _meta_batch(qlens, seqs, pad=0, device=DEVICE):
    qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
    return dict(query_start_loc=qsl.to(device),
                seq_lens=torch.tensor(seqs, dtype=torch.int32).to(device),
                block_table=torch.zeros(len(qlens), 8, dtype=torch.int32).to(device),
                slot_mapping=torch.zeros(sum(qlens) + pad, dtype=torch.int64).to(device))


@pytest.mark.parametrize("qlens,threshold,pad", [
    pytest.param([1] * 5, 1, 0, id="decode-R5"),
    pytest.param([3, 1, 3, 2], 3, 2, id="specdecode-padded"),
])
def test_decode_only_plan_reads_nothing(qlens, threshold, pad):
    """Device inputs on `meta` (unreadable): a decode step's plan must not read them (CUDA-graph
    safe); it is one decode launch over every row, padding included, on the engine's tensors."""
    b = _meta_batch(qlens, [40] * len(qlens), pad, device="meta")
    plan = build_attention_plan(**b, max_query_len=max(qlens), block_size=16, num_heads=8,
                                num_kv_heads=2, decode_threshold=threshold)
    T = sum(qlens) + pad
    assert plan.prefill is None and plan.cascade is None and plan.local is None
    d = plan.decode
    assert (d.token_start, d.token_end, d.num_reqs, d.max_query_len) == (0, T, len(qlens), threshold)
    assert d.cu_seqlens_q is b["query_start_loc"] and d.block_table is b["block_table"]
    assert (plan.num_decodes, plan.num_decode_tokens, plan.num_prefills) == (len(qlens), T, 0)


def test_mixed_plan_splits_decodes_first():
    qlens, seqs = [1, 3, 1, 6, 2, 9], [30, 23, 48, 16, 4, 9]
    b = _meta_batch(qlens, seqs, pad=3, device=DEVICE)
    kw = dict(max_query_len=9, block_size=16, num_heads=8, num_kv_heads=2, decode_threshold=3)
    plan = build_attention_plan(**b, **kw, query_lens_cpu=np.array(qlens), seq_lens_cpu=seqs)
    assert (plan.num_decodes, plan.num_decode_tokens) == (3, 5)
    assert (plan.num_prefills, plan.num_prefill_tokens, plan.num_tokens) == (3, 17, 25)
    d, p = plan.decode, plan.prefill
    assert (d.token_start, d.token_end, d.num_reqs, d.max_query_len) == (0, 5, 3, 3)
    assert d.cu_seqlens_q.tolist() == [0, 1, 4, 5] and d.seq_lens.tolist() == seqs[:3]
    # The 2-token request after the first prefill runs with the prefills; padding rows too.
    assert (p.token_start, p.token_end, p.num_reqs, p.max_query_len) == (5, 25, 3, 9)
    assert p.cu_seqlens_q.tolist() == [0, 6, 8, 17] and p.seq_lens.tolist() == seqs[3:]
    assert torch.equal(p.block_table, b["block_table"][3:])
    # Without host lengths the builder reads them back (documented sync): same split.
    again = build_attention_plan(**b, **kw)
    assert (again.num_decodes, again.prefill.cu_seqlens_q.tolist()) == (3, [0, 6, 8, 17])


@pytest.mark.parametrize("qlens,seqs,prefix,use,want", [
    pytest.param([1] * 8, [300] * 8, 280, None, 0, id="heuristic-no-flashdecoding-wins"),
    pytest.param([2] * 8, [300] * 8, 280, None, 272, id="heuristic-yes-rounded"),
    pytest.param([2] * 8, [300] * 7 + [200], 280, None, 0, id="capped-below-256-no"),
    pytest.param([2] * 3, [300] * 3, 280, None, 0, id="heuristic-too-few-requests"),
    pytest.param([2] * 3, [300] * 3, 280, True, 272, id="forced"),
    pytest.param([2] * 8, [300] * 8, 280, False, 0, id="disabled"),
    pytest.param([2] * 3, [40, 50, 35], 40, True, 32, id="forced-capped-at-context-33"),
])
def test_cascade_decision(qlens, seqs, prefix, use, want):
    b = _meta_batch(qlens, seqs)
    plan = build_attention_plan(**b, max_query_len=max(qlens), block_size=16, num_heads=32,
                                num_kv_heads=8, common_prefix_len=prefix, use_cascade=use,
                                query_lens_cpu=qlens, seq_lens_cpu=seqs, num_sms=132)
    assert plan.common_prefix_len == want and plan.use_cascade == (want > 0)
    if want:
        c = plan.cascade
        assert plan.decode is None and plan.prefill is None
        assert c.prefix_cu_seqlens_q.tolist() == [0, sum(qlens)]
        assert c.prefix_seq_lens.tolist() == [want]
        assert c.suffix_seq_lens.tolist() == [s - want for s in seqs]


@pytest.mark.parametrize("kw,exc,match", [
    pytest.param(dict(use_cascade=True, use_sliding_window=True), NotImplementedError,
                 "sliding window", id="cascade-window"),
    pytest.param(dict(use_cascade=True, use_alibi=True), NotImplementedError, "ALiBi",
                 id="cascade-alibi"),
    pytest.param(dict(use_cascade=True, attn_chunk_size=16), NotImplementedError,
                 "local attention", id="cascade-local"),
    pytest.param(dict(use_cascade=True, common_prefix_len=15), ValueError, "whole block",
                 id="cascade-rounds-to-0"),
    pytest.param(dict(max_query_len=2), ValueError, r"query_lens_cpu\[1\]", id="max-query-len-low"),
    pytest.param(dict(num_kv_heads=3), ValueError, "divisor", id="heads"),
    pytest.param(dict(query_lens_cpu=[1, 3]), ValueError, r"len\(query_lens_cpu\)", id="qlens-len"),
])
def test_plan_errors(kw, exc, match):
    qlens, seqs = [1, 3, 2], [40, 50, 35]
    args = dict(max_query_len=3, block_size=16, num_heads=8, num_kv_heads=2,
                common_prefix_len=32, query_lens_cpu=qlens, seq_lens_cpu=seqs)
    args.update(kw)
    with pytest.raises(exc, match=match):
        build_attention_plan(**_meta_batch(qlens, seqs), **args)


def test_plan_reuse_mismatch_raises():
    s = make_step(MIXED[:3], 8, 2, 32, 16)
    impl = make_impl(8, 32, 2)
    plan = step_plan(impl, s)
    assert isinstance(plan, AttentionPlan)
    k, v = caches_of(s["kv_cache"])
    with pytest.raises(ValueError, match="the plan's num_tokens"):
        impl.forward(s["query"][:-1], s["key"], s["value"], s["kv_cache"], plan)
    other = make_impl(4, 32, 2)
    with pytest.raises(ValueError, match="the plan's num_heads"):
        other.forward(s["query"][:, :4], s["key"], s["value"], s["kv_cache"], plan)
    with pytest.raises(ValueError, match="the plan's block_size"):
        impl.forward(s["query"], s["key"], s["value"], (k[:, :8], v[:, :8]), plan)


# ---------------------------------------------------------------------------------------------
# Unsupported configurations
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,exc,match", [
    pytest.param(dict(kv_cache_dtype="int8"), NotImplementedError, "int8_qkv", id="int8-unnamed-mode"),
    pytest.param(dict(kv_cache_dtype="fp8_e5m2"), NotImplementedError, "fp8_e5m2", id="fp8_e5m2"),
    pytest.param(dict(kv_cache_dtype="fp8", attn_type="encoder"), NotImplementedError,
                 "encoder", id="fp8-encoder"),
    pytest.param(dict(attn_type="encoder_decoder"), NotImplementedError, "cross-attention",
                 id="cross-attention"),
    pytest.param(dict(attn_type="bidirectional"), ValueError, "attn_type", id="attn-type"),
    pytest.param(dict(head_size=264), NotImplementedError, "264", id="head-size-264"),
    pytest.param(dict(num_kv_heads=3), ValueError, "divisor", id="gqa-ratio"),
    pytest.param(dict(sliding_window=0), ValueError, "sliding_window", id="window-0"),
    pytest.param(dict(alibi_slopes=[0.1] * 3), ValueError, "alibi_slopes", id="alibi-shape"),
])
def test_impl_rejects(kw, exc, match):
    args = dict(num_heads=8, head_size=64, scale=0.1, num_kv_heads=2)
    args.update(kw)
    with pytest.raises(exc, match=match):
        PagedAttentionImpl(**args)


def test_forward_rejects_wrong_cache_dtype():
    s = make_step(MIXED[:2], 8, 2, 32, 16)  # bf16 caches
    impl = make_impl(8, 32, 2, cache="fp8")
    with pytest.raises(ValueError, match="k_cache.dtype"):
        impl.forward(s["query"], s["key"], s["value"], s["kv_cache"], step_plan(impl, s))


# ----------------------------------------------------------------------------------------------
# fp8 per-tensor scales: set_kv_scales refuses a host value that is not finite and > 0
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), float("inf"), torch.tensor([0.0]), torch.tensor(-2.0),
                                 torch.tensor([float("nan")]), True, "0.5"],
                         ids=["zero", "negative", "nan", "inf", "cpu-tensor-zero", "cpu-tensor-negative",
                              "cpu-tensor-nan", "bool", "string"])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_set_kv_scales_refuses_bad_host_scales(bad, which):
    impl = make_impl(8, 32, 2, cache="fp8")
    before = (impl.k_scale.clone(), impl.v_scale.clone())
    scales = dict(k_scale=0.5, v_scale=torch.tensor([2.0]))
    scales[which] = bad
    with pytest.raises(ValueError, match=f"^{which}: expected a finite scale > 0, got "):
        impl.set_kv_scales(**scales)
    assert torch.equal(impl.k_scale, before[0]) and torch.equal(impl.v_scale, before[1]), "neither is set"
    impl.set_kv_scales(0.5, torch.tensor([2.0]))  # good ones are taken
    assert impl.k_scale.tolist() == [0.5] and impl.v_scale.tolist() == [2.0]
