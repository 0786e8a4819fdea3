"""kernels.cascade: cascade attention against plain paged attention's oracle, and vLLM's
use_cascade_attention heuristic on its documented cases.

Batches (tests.helpers.paged_batch) are adversarial as in tests/kernels/test_paged_attention.py: caches
are strided views of NaN-filled backings (one hidden row per block, spare blocks never
referenced), block tables are shuffled with invalid ids in unused columns, q is a non-contiguous
view, the softmax scale is not 1/sqrt(D), and padding rows follow the last request. Requests share
their first `shared_blocks` physical blocks (the prefix), so cascade over them must equal
attention over the whole context: kernels.reference.paged_attention_ref is the oracle, bf16
tolerances for out (the cache values are the oracle's too, so fp8 caches also get bf16
tolerances), fp32 for lse.
"""
import pytest
import torch

from openmla.kernels.cascade import cascade_attention
from openmla.mla.mha.cascade import MIN_CASCADE_PREFIX, use_cascade_attention
from openmla.kernels.paged_attention import paged_attention
from openmla.kernels.reference import paged_attention_ref
from tests.helpers import DEVICE, assert_close, attention_options, paged_batch


# ---------------------------------------------------------------------------------------------
# Cascade == plain attention over the full context
# ---------------------------------------------------------------------------------------------
CASES = [  # (seqs, H, H_kv, D, bs, shared blocks, build options, run options)
    pytest.param([(1, 50), (1, 37), (1, 70)], 8, 2, 64, 16, 2, {}, {}, id="decode-R3-prefix32"),
    pytest.param([(1, 60), (3, 41), (7, 55), (1, 33)], 8, 2, 64, 16, 2, {},
                 {"sinks": True, "softcap": 30.0}, id="mixed-sinks-softcap-prefix32"),
    pytest.param([(5, 37), (1, 60)], 4, 4, 32, 16, 2, {}, {}, id="prefix-is-whole-context"),
    pytest.param([(1, 20), (2, 23), (4, 30)], 6, 3, 40, 7, 2, {}, {}, id="bs7-H6/3-D40"),
    pytest.param([(1, 9), (2, 8), (3, 12)], 4, 2, 32, 1, 5, {}, {}, id="bs1-prefix5"),
    pytest.param([(1, 70), (4, 50), (2, 40)], 8, 2, 64, 16, 2, {"cache": "fp8"}, {"sinks": True},
                 id="fp8-sinks"),
    pytest.param([(3, 50), (1, 36)], 8, 2, 64, 16, 2, {"layout": "HND"}, {}, id="HND"),
    # 40 tokens x GQA 4 = 160 packed rows: the prefix pass is a long query, split over the
    # 512-token prefix by cascade itself (the kernel never splits long queries on its own).
    pytest.param([(4, 520 + i) for i in range(10)], 8, 2, 32, 64, 8, {}, {},
                 id="long-prefix-pass-forced-splits"),
]


@pytest.mark.parametrize("seqs,H,H_kv,D,bs,shared,bopts,ropts", CASES)
def test_cascade_equals_full_attention(seqs, H, H_kv, D, bs, shared, bopts, ropts):
    b = paged_batch(seqs, H, H_kv, D, bs, shared_blocks=shared, **bopts)
    opts = attention_options(H, D, scale_factor=0.83, seed=1, **ropts)
    out, lse = cascade_attention(**b, common_prefix_len=shared * bs, return_lse=True, **opts)
    want, want_lse = paged_attention_ref(**b, **opts)
    assert out.dtype == b["q"].dtype and out.shape == b["q"].shape
    assert_close("out", out, want, "bf16")
    assert_close("lse", lse, want_lse, "fp32")
    # Padding rows past the last request: out 0, lse -inf (as paged_attention).
    assert torch.equal(out[-2:].float().cpu(), torch.zeros(2, H, D))
    assert bool((lse[-2:] == float("-inf")).all())


def test_cascade_matches_plain_kernel_and_writes_out():
    """Into a caller's out buffer (a strided view), with max_query_len and precomputed plan
    tensors, the answer is the plain kernel's up to bf16 rounding of the two parts."""
    seqs, H, D, bs = [(1, 40), (2, 35), (6, 48)], 8, 64, 16
    b = paged_batch(seqs, H, 2, D, bs, shared_blocks=2, pad_rows=0)
    opts = attention_options(H, D, scale_factor=0.83, seed=1)
    T = b["q"].shape[0]
    backing = torch.full((T, H, D + 8), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = backing[:, :, :D]
    R = len(seqs)
    got = cascade_attention(**b, common_prefix_len=2 * bs, out=out, max_query_len=6,
                            prefix_cu_seqlens_q=b["cu_seqlens_q"][::R].contiguous(),
                            prefix_seq_lens=torch.tensor([2 * bs], dtype=torch.int32, device=DEVICE),
                            suffix_seq_lens=b["seq_lens"] - 2 * bs, **opts)
    assert got.data_ptr() == out.data_ptr()
    plain = paged_attention(**b, **opts)
    want, _ = paged_attention_ref(**b, **opts)
    assert_close("out", out, want, "bf16")
    assert_close("out vs plain kernel", out, plain.float(), "bf16")


def test_long_prefix_pass_is_split(monkeypatch):
    """The pseudo-request of a decode-heavy batch is a long query (many packed rows): cascade
    forces split-KV on it when its row blocks alone underfill the GPU (8 SMs on the CPU), and
    leaves short ones and the suffix pass to the kernel's own choice."""
    import openmla.kernels.cascade as cascade_mod
    calls = []

    def spy(*args, **kwargs):
        calls.append((kwargs["causal"], kwargs.get("num_splits")))
        return paged_attention(*args, **kwargs)

    monkeypatch.setattr(cascade_mod, "paged_attention", spy)
    long_b = paged_batch([(4, 520 + i) for i in range(10)], 8, 2, 32, 64, shared_blocks=8)
    cascade_attention(**long_b, common_prefix_len=512, scale=0.1)
    short_b = paged_batch([(1, 40), (1, 50)], 8, 2, 32, 16, shared_blocks=2)
    cascade_attention(**short_b, common_prefix_len=32, scale=0.1)
    # long: 160 rows -> 3 programs x 2 KV heads; 2 * 8 SMs / 6 -> 3, capped by 512 / 256 = 2.
    assert calls == [(False, 2), (True, None), (False, None), (True, None)]


# ---------------------------------------------------------------------------------------------
# The prefix must be whole blocks (vLLM asserts it); the plan rounds down instead
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix,match", [
    pytest.param(20, "multiple of block_size = 16", id="unaligned-20"),
    pytest.param(0, "positive multiple", id="zero"),
    pytest.param(-16, "positive multiple", id="negative"),
    pytest.param(16.0, "positive multiple", id="float"),
    pytest.param(16 * 9, "block_table columns", id="past-the-table"),
])
def test_prefix_must_be_whole_blocks(prefix, match):
    b = paged_batch([(1, 40), (2, 50)], 4, 2, 32, 16, shared_blocks=2)
    with pytest.raises(ValueError, match=match):
        cascade_attention(**b, common_prefix_len=prefix, scale=0.1)


# ---------------------------------------------------------------------------------------------
# vLLM's heuristic, rule by rule (its docstring and comments)
# ---------------------------------------------------------------------------------------------
HEURISTIC = [  # (prefix, query_lens, H, H_kv, options, expected)
    pytest.param(255, [2] * 8, 32, 8, {}, False, id="prefix-255-too-short"),
    pytest.param(256, [2] * 8, 32, 8, {}, True, id="prefix-256-specdecode-no-flashdecoding"),
    pytest.param(4096, [5] * 8, 32, 8, {"use_alibi": True}, False, id="alibi"),
    pytest.param(4096, [5] * 8, 32, 8, {"use_sliding_window": True}, False, id="sliding-window"),
    pytest.param(4096, [5] * 8, 32, 8, {"use_local_attention": True}, False, id="local-attention"),
    pytest.param(4096, [5] * 7, 32, 8, {}, False, id="7-requests-too-few"),
    pytest.param(4096, [5] * 8, 32, 8, {"dcp_world_size": 2}, False, id="dcp"),
    pytest.param(1024, [1] * 8, 32, 32, {}, True, id="mha-decode-no-flashdecoding"),
    pytest.param(1024, [1] * 7 + [9], 32, 8, {}, True, id="gqa-one-prefill-no-flashdecoding"),
    # FlashDecoding cases, the performance model: 8 requests, 8 prefix tiles. cascade: 32 CTAs,
    # 1 wave x 8 tiles = 8; decoding: 8 * 8 * 1 * 8 = 512 CTAs over 132 SMs = 4. 8 < 4: no.
    pytest.param(1024, [1] * 8, 32, 8, {}, False, id="gqa-decode-R8-model-says-no"),
    # 128 requests, 2 tiles: cascade 32 CTAs, 1 wave x 2 = 2; decoding 128*8*2 = 2048 -> 16.
    pytest.param(256, [1] * 128, 32, 8, {}, True, id="gqa-decode-R128-model-says-yes"),
    # Tie: cascade 64 CTAs on 64 SMs = 1 wave x 2 tiles = 2; decoding 8*8*1*2 = 128 CTAs / 64 = 2.
    pytest.param(256, [1] * 8, 64, 8, {"num_sms": 64}, False, id="gqa-decode-tie-is-no"),
    # One request more: decoding 9*8*1*2 = 144 CTAs / 64 = 3 > 2: yes.
    pytest.param(256, [1] * 9, 64, 8, {"num_sms": 64}, True, id="gqa-decode-R9-one-more-is-yes"),
]


@pytest.mark.parametrize("prefix,qlens,H,H_kv,opts,want", HEURISTIC)
def test_use_cascade_attention(prefix, qlens, H, H_kv, opts, want):
    opts = {"num_sms": 132, **opts}
    assert use_cascade_attention(prefix, qlens, H, H_kv, **opts) is want
    assert use_cascade_attention(prefix, torch.tensor(qlens), H, H_kv, **opts) is want


def test_heuristic_threshold_constant():
    assert MIN_CASCADE_PREFIX == 256  # vLLM's "arbitrary threshold of 256 tokens"
