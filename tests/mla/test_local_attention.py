"""mla.local_attention: chunked local attention virtual batches.

Two kinds of checks: the rewrite itself against vLLM's documented cases (its docstring example and
the cases of vLLM's own test, same arange block tables), and paged_attention over the virtual
batch against kernels.reference.local_attention_ref, an oracle that knows nothing of virtual
batches (each query token alone through paged_attention_ref with the window that is its chunk).
Batches come from tests.helpers.paged_batch (NaN-filled strided caches, shuffled tables, padding
rows).
"""
import math

import numpy as np
import pytest
import torch

from openmla.kernels.paged_attention import paged_attention
from openmla.kernels.reference import local_attention_ref
from openmla.mla.mha.local import make_local_attention_virtual_batches
from tests.helpers import DEVICE, assert_close, attention_options, paged_batch


def _arange_table(qlens, seqs, bs):
    """vLLM's test tables: row r holds r * M .. r * M + M - 1, M = cdiv(max seq_len, bs)."""
    M = math.ceil(max(seqs) / bs)
    return torch.arange(len(seqs) * M, dtype=torch.int32).view(len(seqs), M)


# ---------------------------------------------------------------------------------------------
# The rewrite: vLLM's documented cases
# ---------------------------------------------------------------------------------------------
VLLM_CASES = [  # (q_lens, seq_lens, chunk, block_size, virtual q_lens, virtual k_lens, table)
    pytest.param([4, 10, 5], [6, 17, 9], 4, 2, [2, 2, 1, 4, 4, 1, 4, 1], [4, 2, 4, 4, 4, 1, 4, 1],
                 [[0, 1], [2, 3], [11, 12], [13, 14], [15, 16], [17, 17], [20, 21], [22, 23]],
                 id="docstring-example"),
    pytest.param([8], [12], 4, 2, [4, 4], [4, 4], [[2, 3], [4, 5]], id="last-chunk-full"),
    pytest.param([7], [10], 4, 2, [1, 4, 2], [4, 4, 2], [[0, 1], [2, 3], [4, 4]],
                 id="every-kv-position-used"),
    pytest.param([4], [6], 10, 2, [4], [6], [[0, 1, 2, 2, 2]], id="chunk-longer-than-seq"),
    pytest.param([6, 6], [8, 8], 4, 4, [2, 4, 2, 4], [4, 4, 4, 4], [[0], [1], [2], [3]],
                 id="chunk-equals-block"),
    pytest.param([1], [5], 4, 2, [1], [1], [[2, 2]], id="decode-in-second-chunk"),
]


@pytest.mark.parametrize("qlens,seqs,chunk,bs,want_q,want_k,want_table", VLLM_CASES)
def test_virtual_batches_match_vllm(qlens, seqs, chunk, bs, want_q, want_k, want_table):
    table = _arange_table(qlens, seqs, bs).to(DEVICE)
    qsl = np.concatenate([[0], np.cumsum(qlens)])
    lb = make_local_attention_virtual_batches(chunk, torch.tensor(qsl), seqs, table, bs)
    assert lb.query_lens.tolist() == want_q
    assert lb.seq_lens_cpu.tolist() == want_k
    assert lb.num_reqs == len(want_q)
    assert (lb.max_query_len, lb.max_seq_len) == (max(want_q), max(want_k))
    assert lb.cu_seqlens_q.dtype == torch.int32 and lb.seq_lens.dtype == torch.int32
    assert lb.cu_seqlens_q.tolist() == [0] + np.cumsum(want_q).tolist()
    assert lb.seq_lens.tolist() == want_k
    assert lb.block_table.dtype == torch.int32 and lb.block_table.tolist() == want_table
    assert all(q <= chunk and k <= chunk for q, k in zip(want_q, want_k))


def test_request_and_chunk_indices():
    lb = make_local_attention_virtual_batches(4, [0, 4, 14, 19], [6, 17, 9],
                                              _arange_table([4, 10, 5], [6, 17, 9], 2), 2)
    assert lb.request_index.tolist() == [0, 0, 1, 1, 1, 1, 2, 2]
    assert lb.chunk_index.tolist() == [0, 1, 1, 2, 3, 4, 1, 2]


def test_request_without_queries_is_one_empty_virtual_request():
    """vLLM assumes q_len > 0; a q_len 0 request (seq_len 0 included) owns no rows and no keys."""
    lb = make_local_attention_virtual_batches(4, [0, 0, 3, 3], [0, 5, 7],
                                              torch.zeros(3, 2, dtype=torch.int32), 4)
    # request 1: context 2, queries at positions 2, 3 (chunk 0) and 4 (chunk 1)
    assert lb.query_lens.tolist() == [0, 2, 1, 0]
    assert lb.seq_lens_cpu.tolist() == [0, 4, 1, 0]
    assert lb.cu_seqlens_q.tolist() == [0, 0, 2, 3, 3]


@pytest.mark.parametrize("kwargs,match", [
    pytest.param(dict(attn_chunk_size=6, block_size=4), "multiple of block_size = 4", id="unaligned"),
    pytest.param(dict(attn_chunk_size=0, block_size=4), "positive int", id="chunk-0"),
    pytest.param(dict(seq_lens_cpu=[3, 9]), r"seq_lens_cpu\[0\]: expected >= its query length 4",
                 id="seq-shorter-than-query"),
    pytest.param(dict(seq_lens_cpu=[9]), r"len\(seq_lens_cpu\)", id="seq-lens-length"),
    pytest.param(dict(query_start_loc_cpu=[0, 4, 2]), "non-decreasing", id="qsl-decreasing"),
    pytest.param(dict(seq_lens_cpu=torch.tensor([8, 9], device="meta")), "cpu", id="device-lens"),
])
def test_errors(kwargs, match):
    args = dict(attn_chunk_size=8, query_start_loc_cpu=[0, 4, 6], seq_lens_cpu=[8, 9],
                block_table=torch.zeros(2, 3, dtype=torch.int32), block_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        make_local_attention_virtual_batches(**args)


# ---------------------------------------------------------------------------------------------
# Attention over the virtual batch == chunk-masked attention
# ---------------------------------------------------------------------------------------------
NUMERIC = [  # (seqs, H, H_kv, D, bs, chunk, build options, run options)
    pytest.param([(4, 6), (10, 17), (5, 9)], 4, 2, 32, 2, 4, {}, {}, id="vllm-example-bs2-C4"),
    pytest.param([(1, 40), (1, 16), (9, 30), (20, 20)], 8, 2, 64, 8, 16, {}, {},
                 id="decodes-and-prefills-bs8-C16"),
    pytest.param([(12, 45), (1, 33)], 8, 4, 32, 4, 8, {"cache": "fp8"},
                 {"sinks": True, "softcap": 20.0}, id="fp8-sinks-softcap-C8"),
    pytest.param([(7, 7), (3, 29)], 4, 4, 32, 16, 16, {"layout": "HND"}, {}, id="HND-C16"),
]


@pytest.mark.parametrize("seqs,H,H_kv,D,bs,chunk,bopts,ropts", NUMERIC)
def test_local_attention_equals_chunk_mask_oracle(seqs, H, H_kv, D, bs, chunk, bopts, ropts):
    b = paged_batch(seqs, H, H_kv, D, bs, **bopts)
    opts = attention_options(H, D, scale_factor=0.77, seed=3, **ropts)
    qsl = [0] + np.cumsum([q for q, _ in seqs]).tolist()
    lb = make_local_attention_virtual_batches(chunk, qsl, [kv for _, kv in seqs],
                                              b["block_table"], bs)
    vb = {**b, "cu_seqlens_q": lb.cu_seqlens_q, "seq_lens": lb.seq_lens,
          "block_table": lb.block_table}
    out, lse = paged_attention(**vb, **opts, return_lse=True, max_query_len=lb.max_query_len)
    want, want_lse = local_attention_ref(**b, attn_chunk_size=chunk, **opts)
    assert_close("out", out, want, "bf16")
    assert_close("lse", lse, want_lse, "fp32")
    assert torch.equal(out[-2:].float().cpu(), torch.zeros(2, H, D)), "padding rows must be 0"
