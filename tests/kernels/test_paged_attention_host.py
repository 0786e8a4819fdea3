"""paged_attention's host path (kernels/paged_attention/paged.py, launch.py): what it caches per
call signature must never serve a call it was not made for.

- Plans (grid, split count, every int argument and constexpr) are cached per signature: two
  signatures get two plans, and a call that differs only in a stride, a view or the out buffer
  gets its own plan and a correct result.
- Tensor checks are skipped for a signature that passed them before; every call that differs
  from it in a checked property still raises, and the scalar checks run on every call.
- Eager calls launch directly; torch.compile traces the registered custom op.

FastLaunch itself is bypassed under the interpreter (tests/kernels/test_launch.py); these run
everywhere, the GPU test at the end exercises the cached launches."""
import pytest
import torch

from openmla.kernels.paged_attention import launch as pa_launch
from openmla.kernels.paged_attention import paged as pa_paged
from openmla.kernels.paged_attention import paged_attention
from openmla.kernels.reference import paged_attention_ref
from openmla.quant import FP8_PER_TENSOR, MHA_BF16
from tests.helpers import DEVICE, GPU_ONLY, assert_close, count_full_checks, paged_batch

SCALE = 0.31


def _batch(seed=0, **kw):
    """Two requests (a decode and a 2-token query), H 4 / H_kv 2, D 32, page 8: small enough for
    the interpreter, split-KV on its pretend 8 SMs."""
    b = paged_batch([(1, 40), (2, 23)], 4, 2, 32, 8, seed=seed, **kw)
    del b["k_scale"], b["v_scale"]  # bf16 caches
    return b


def _run(b, **kw):
    out, lse = paged_attention(**b, scale=SCALE, return_lse=True, **kw)
    want, want_lse = paged_attention_ref(**b, scale=SCALE)
    assert_close("out", out, want, "bf16")
    assert_close("lse", lse, want_lse, "fp32")
    return out


@pytest.fixture
def counted_checks(monkeypatch):
    """Counts the full checks (`_check_paged`) on a clean signature cache."""
    return count_full_checks(monkeypatch, pa_paged, "_check_paged")


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------
def test_two_signatures_get_two_plans(monkeypatch):
    monkeypatch.setattr(pa_launch, "_PLANS", {})
    b = _batch()
    _run(b)
    assert len(pa_launch._PLANS) == 1
    _run(b)  # the same signature: the same plan
    assert len(pa_launch._PLANS) == 1
    _run(b, num_splits=3)
    assert len(pa_launch._PLANS) == 2
    first, forced = pa_launch._PLANS.values()
    assert forced.splits == 3 and forced.consts["NUM_SPLITS"] == 3 and forced.part_numel > 0
    assert first.consts["NUM_SPLITS"] != 3
    c = paged_batch([(1, 40), (2, 23), (1, 9)], 4, 2, 32, 8)  # one more request: another grid
    del c["k_scale"], c["v_scale"]
    _run(c)
    assert len(pa_launch._PLANS) == 3
    assert list(pa_launch._PLANS.values())[2].ints_a[:2] == (c["q"].shape[0], 3)


@pytest.mark.parametrize("change", ["cache-strides", "q-strides", "out-strides", "table-strides",
                                    "hnd-layout"])
def test_changed_strides_are_not_served_a_stale_plan(change, monkeypatch):
    """The same shapes with other strides, one after the other: each result is right."""
    monkeypatch.setattr(pa_launch, "_PLANS", {})
    b = _batch(seed=1)
    _run(b)  # strided views (a hidden row per block, q a slice of a wider tensor)
    c = dict(b)
    out = None
    if change == "cache-strides":  # block stride block_size rows instead of block_size + 1
        c["k_cache"], c["v_cache"] = b["k_cache"].contiguous(), b["v_cache"].contiguous()
    elif change == "q-strides":
        c["q"] = b["q"].contiguous()
    elif change == "out-strides":
        T, H, D = b["q"].shape
        out = torch.full((T, 2, H, D), float("nan"), dtype=b["q"].dtype,
                         device=DEVICE)[:, 1]  # token stride 2 * H * D
    elif change == "table-strides":
        wide = torch.full((b["block_table"].shape[0], 2 * b["block_table"].shape[1]), -1,
                          dtype=torch.int32, device=DEVICE)
        wide[:, :b["block_table"].shape[1]] = b["block_table"]
        c["block_table"] = wide[:, :b["block_table"].shape[1]]
    else:  # the same caches seen as HND: another shape under the same numbers of elements
        c = _batch(seed=1, layout="HND")
    got = _run(c, out=out)
    if out is not None:
        assert got.data_ptr() == out.data_ptr()
    assert len(pa_launch._PLANS) == 2


def test_options_of_one_signature_each_get_their_plan(monkeypatch):
    """One set of tensors called with other score options, split counts and outputs in turn, and
    back: a repeated call finds its plan by the tensors' signature and the other plan inputs
    (launch._BY_SIG), so each option must be one of them; every result matches the oracle."""
    monkeypatch.setattr(pa_launch, "_PLANS", {})
    monkeypatch.setattr(pa_launch, "_BY_SIG", {})
    b = _batch(seed=4)
    calls = [{}, {"num_splits": 3}, {"causal": False}, {"window": (5, 0)}, {"softcap": 2.0},
             {"sinks": torch.randn(4, device=DEVICE)}, {"num_splits": 1}]
    for kw in calls + calls[::-1]:
        out, lse = paged_attention(**b, scale=SCALE, return_lse=True, **kw)
        ref_kw = {k: v for k, v in kw.items() if k != "num_splits"}
        want, want_lse = paged_attention_ref(**b, scale=SCALE, **ref_kw)
        assert_close("out", out, want, "bf16")
        assert_close("lse", lse, want_lse, "fp32")
        alone = paged_attention(**b, scale=SCALE, **kw)  # no lse: another plan again
        assert_close("out", alone, want, "bf16")
    assert len(pa_launch._PLANS) == len(pa_launch._BY_SIG) == 2 * len(calls)


# ---------------------------------------------------------------------------------------------
# The checks of a repeated signature
# ---------------------------------------------------------------------------------------------
def test_repeated_signature_skips_only_the_tensor_checks(counted_checks):
    b = _batch(seed=2)
    first = _run(b)
    assert len(counted_checks) == 1
    again = _run(b)  # the signature passed: its tensor checks are not repeated
    assert len(counted_checks) == 1
    assert torch.equal(first, again)
    # new tensors of the same signature (another step's data) take the cached path too
    _run(_batch(seed=3))
    assert len(counted_checks) == 1
    # scalar checks run on every call
    with pytest.raises(ValueError, match="scale"):
        paged_attention(**b, scale=float("nan"))
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(**b, scale=SCALE, num_splits=0)
    with pytest.raises(ValueError, match="window"):
        paged_attention(**b, scale=SCALE, window=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(**b, scale=SCALE, softcap=-1.0)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention(**b, scale=SCALE, max_query_len=-1)
    assert len(counted_checks) == 1


def _noncontiguous(t):
    return torch.stack([t, t], -1)[..., 0]  # the same shape and values, stride 2


BAD_AFTER_GOOD = [  # (what changes, the error's match)
    pytest.param(lambda b: {"cu_seqlens_q": _noncontiguous(b["cu_seqlens_q"])}, "cu_seqlens_q",
                 id="cu_seqlens_q-not-contiguous"),
    pytest.param(lambda b: {"seq_lens": _noncontiguous(b["seq_lens"])}, "seq_lens",
                 id="seq_lens-not-contiguous"),
    pytest.param(lambda b: {"block_table": b["block_table"].long()}, "block_table.dtype",
                 id="block_table-int64"),
    pytest.param(lambda b: {"block_table": b["block_table"].t().contiguous().t()},
                 "block_table.stride", id="block_table-column-major"),
    pytest.param(lambda b: {"v_cache": b["v_cache"].half()}, "v_cache.dtype", id="v_cache-fp16"),
    pytest.param(lambda b: {"k_cache": b["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)},
                 "k_cache.stride", id="k_cache-last-dim-strided"),
    pytest.param(lambda b: {"q": b["q"].half()}, "k_cache.dtype", id="q-fp16"),
    pytest.param(lambda b: {"fmt": FP8_PER_TENSOR}, "k_cache.dtype", id="fmt-fp8"),
    pytest.param(lambda b: {"fmt": "bf16"}, "fmt", id="fmt-a-name"),
    pytest.param(lambda b: {"k_scale": torch.ones(1, device=DEVICE)}, "k_scale", id="k_scale-bf16"),
    pytest.param(lambda b: {"sinks": torch.ones(3, device=DEVICE)}, "sinks", id="sinks-shape"),
    pytest.param(lambda b: {"out": torch.empty(b["q"].shape, dtype=b["q"].dtype, device="meta")},
                 "out.device", id="out-meta-device"),
    pytest.param(lambda b: {"out": torch.empty(b["q"].shape, dtype=torch.float16, device=DEVICE)},
                 "out.dtype", id="out-fp16"),
    pytest.param(lambda b: {"layout": "HND"}, "k_cache.shape", id="layout-HND"),
    pytest.param(lambda b: {"layout": ["NHD"]}, "layout", id="layout-unhashable"),
    pytest.param(lambda b: {"seq_lens": b["seq_lens"].tolist()}, "seq_lens", id="seq_lens-a-list"),
]


@pytest.mark.parametrize("bad,match", BAD_AFTER_GOOD)
def test_bad_input_raises_after_a_good_call(bad, match, counted_checks):
    b = _batch(seed=4)
    paged_attention(**b, scale=SCALE)
    paged_attention(**b, scale=SCALE)
    assert len(counted_checks) == 1
    with pytest.raises((ValueError, NotImplementedError), match=match):
        paged_attention(**{**b, **bad(b)}, scale=SCALE)
    assert len(counted_checks) == 2  # the full checks ran (and raised)


def test_fmt_is_matched_by_identity(counted_checks):
    """A descriptor given once and then left out (or given as another object) is checked again;
    the cached entry keeps the descriptor it was made for."""
    b = _batch(seed=5)
    want = _run(b, fmt=MHA_BF16)
    assert torch.equal(_run(b, fmt=MHA_BF16), want)
    assert len(counted_checks) == 1
    assert torch.equal(_run(b), want)  # fmt None: another signature
    assert len(counted_checks) == 2
    assert any(entry[0] is MHA_BF16 for entry in pa_paged._CHECKED.values())


# ---------------------------------------------------------------------------------------------
# Eager launch, compiled custom op
# ---------------------------------------------------------------------------------------------
def test_eager_call_skips_the_custom_op(monkeypatch):
    def refuse(*args):
        raise AssertionError("eager call reached the custom op")
    monkeypatch.setattr(pa_paged, "_paged_attention_op", refuse)
    _run(_batch(seed=6))


def test_compiled_call_goes_through_the_custom_op(monkeypatch):
    b = _batch(seed=7)
    want, want_lse = paged_attention(**b, scale=SCALE, return_lse=True)
    calls = []
    real = pa_paged._paged_attention_op
    monkeypatch.setattr(pa_paged, "_paged_attention_op", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda **kw: paged_attention(**kw, scale=SCALE, return_lse=True),
                           backend="eager")
        got, got_lse = fn(**b)
    finally:
        torch._dynamo.reset()
    assert calls, "torch.compile did not reach the registered op"
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@GPU_ONLY
def test_cached_launches_follow_the_pointers():
    """Repeated calls of one signature (FastLaunch's cached launches, main and reduce) read this
    call's tensors; a q that is not 16-byte aligned takes the launch keyed on the arguments."""
    for seed in range(3):
        _run(_batch(seed=10 + seed))
        _run(_batch(seed=10 + seed), num_splits=4)
    b = _batch(seed=20)
    wide = torch.empty(b["q"].numel() + 1, dtype=b["q"].dtype, device=DEVICE)
    q = wide[1:].view(b["q"].shape)  # 2-byte offset
    q.copy_(b["q"])
    assert q.data_ptr() % 16
    _run({**b, "q": q})
    _run({**b, "q": q}, num_splits=4)
