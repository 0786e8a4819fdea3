"""tools/bench.py's sparse_mla_decode_v4 entry (tools/_bench_mla_v4.py) and its FlashMLA peer
plumbing (tools/_bench_peer.py DECODE_V4_PEER), on the CPU.

`StandInV4` takes FlashMLA's place: a torch STAND-IN with flash_mla_with_kvcache's V4 signature and
shapes ([b, s_q, 64 or 128, 512] q, the [nb, bs, 1, 584] caches, per-request lengths, lse
[b, h, s_q] with +inf for an empty row), computed with openmla's fp32 oracle. It is NOT FlashMLA:
it tests the regrouping of tokens into requests, the head padding, the lengths and the un-padding.
"""
import pytest
import torch

from openmla.kernels import reference
from openmla.tools import _bench_mla_v4 as v4
from openmla.tools import _bench_peer
from openmla.tools._bench_core import NotMeasured, rel_l2
from tests.helpers import DEVICE

SMALL = dict(heads=16, topk=16, extra_topk=24, block_size=64, extra_block_size=2, tokens=4, s_q=2)


class StandInV4:
    """flash_mla_with_kvcache for V4 caches (plumbing only, NOT FlashMLA). Padding heads (zero q)
    come back NaN, so an un-padding that read them would show."""

    def get_mla_metadata(self, *args, **kwargs):
        return {"initialized": False}, None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None,
                               indices=None, attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                               topk_length=None, extra_topk_length=None, use_legacy=False, kv_format=None):
        b, s_q, h_q, d = q.shape
        assert use_legacy and kv_format == "V4" and is_fp8_kvcache is True and not causal and num_splits is None
        assert head_dim_v == 512 and d == 512 and h_q in (64, 128)
        assert tuple(k_cache.shape[2:]) == (1, 584) and tuple(extra_k_cache.shape[2:]) == (1, 584)
        assert tuple(indices.shape[:2]) == (b, s_q) and tuple(extra_indices_in_kvcache.shape[:2]) == (b, s_q)
        assert attn_sink.shape == (h_q,) and (extra_topk_length is None or extra_topk_length.shape == (b,))

        def per_token(n):
            return None if n is None else n.repeat_interleave(s_q)

        out, lse = reference.sparse_mla_decode_ref(
            q.flatten(0, 1), k_cache, indices.flatten(0, 1), scale=softmax_scale, attn_sink=attn_sink,
            topk_length=per_token(topk_length), extra_cache=extra_k_cache,
            extra_indices=extra_indices_in_kvcache.flatten(0, 1), extra_topk_length=per_token(extra_topk_length))
        out[:, (q.flatten(0, 1) == 0).all(-1).all(0)] = float("nan")
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        return out.bfloat16().view(b, s_q, h_q, 512), lse.view(b, s_q, h_q).transpose(1, 2)


@pytest.mark.parametrize("extra_len", [False, True], ids=["no-xlen", "xlen"])
def test_entry_and_peer_plumbing(extra_len):
    """The entry runs and matches the oracle; the peer's inputs, regrouped into FlashMLA's
    requests and head-padded, give back the same out and lse (real heads, openmla's -inf)."""
    p = dict(SMALL, extra_len=extra_len)
    x = v4._build(p, DEVICE)
    out = v4._run(x)
    assert v4._error(x, out) < 1e-2
    if extra_len:
        assert x["extra_topk_length"].view(2, 2).unique(dim=1).shape[1] == 1  # one length a request
        x["extra_topk_length"][:2] = 0  # request 0 (tokens 0, 1): an empty extra list
    else:  # without lengths and the sink the torch baseline computes the same attention
        plain = dict(x, kwargs=dict(x["kwargs"], attn_sink=None))
        assert rel_l2(v4._torch(x), v4._run(plain)) < 1e-2
    peer = _bench_peer.DECODE_V4_PEER
    px = peer.prepare(x, StandInV4())
    assert px["q"].shape == (2, 2, 64, 512)
    res = _bench_peer.compare(peer, x, px, peer.call(px), v4._error)
    assert res["max_abs_out"] < 2e-2 and res["max_abs_lse"] < 1e-4 and res["peer_rel_err"] < 1e-2, res


def test_peer_refuses_per_token_lengths():
    """FlashMLA's lengths are per request: tokens of one request with different lengths are not
    measured (NotMeasured), never silently regrouped."""
    x = v4._build(dict(SMALL, extra_len=True), DEVICE)
    x["extra_topk_length"][1] = x["extra_topk_length"][0] + 1
    with pytest.raises(NotMeasured, match="extra_topk_length differs between the tokens of a request"):
        _bench_peer.DECODE_V4_PEER.prepare(x, StandInV4())


def test_standard_cases_are_flashmla_configs():
    """The standard set holds FlashMLA's MODEL1 configs 1, 2, 4 at batch 64/128/256 (s_q 2), the
    cases issue 25's bar names, and config 1 at 16 and 32 heads."""
    labels = {v4._label(p) for p in v4._STANDARD}
    assert "T512-H128-topk128+1024-bs256/2-xlen" in labels and "T128-H64-topk128+512-bs256/64" in labels
    assert len(v4._STANDARD) == 9 and all(p["s_q"] == 2 for p in v4._STANDARD)
