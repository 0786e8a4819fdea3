"""quant.int8: the Triton int8 quantizers equal their torch references exactly (int8 values and fp32
scale bits), the references follow DESIGN.md's rule (checked against hand-computed values), V scale
calibration equals a plain loop / numpy.percentile, and V scale files round trip bit-exact and reject
bad content with ValueError naming the layer."""
import os
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from openmla.quant.int8 import (
    K_SMOOTH_RANGE,
    calibrate_k_smooth,
    calibrate_v_scale,
    dequantize_per_channel,
    dequantize_per_token_head,
    load_v_scales,
    quantize_per_channel,
    quantize_per_channel_ref,
    quantize_per_token_head,
    quantize_per_token_head_ref,
    save_v_scales,
)
from tests.helpers import DEVICE

NAN, INF = float("nan"), float("inf")


def _bits(s: torch.Tensor) -> torch.Tensor:
    """fp32 scales as int32 bits with every NaN mapped to one pattern (NaN sign is unspecified)."""
    s = s.detach().cpu()
    return torch.where(torch.isnan(s), torch.full_like(s, NAN), s).view(torch.int32)


def assert_same_q(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.int8 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    diff = (got.cpu() != want.cpu())
    if bool(diff.any()):
        i = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"int8 values differ at {int(diff.sum())} positions, first {i}: "
                             f"got {got.cpu()[i].item()}, want {want.cpu()[i].item()}")


def assert_same_scale(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    diff = _bits(got) != _bits(want)
    if bool(diff.any()):
        i = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"scales differ in bits at {int(diff.sum())} positions, first {i}: "
                             f"got {got.cpu()[i].item()!r}, want {want.cpu()[i].item()!r}")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def make_x(T, H, D, dtype, seed, *, kind="gauss", layout="contiguous"):
    """[T, H, D] on DEVICE. kind: gauss | outlier (channels 50-200x larger, a tiny head) | zero_rows.
    layout: contiguous | sliced (token/head strides of a wider tensor) | transposed ([H, T, D]
    storage) | d_strided (stride(-1) == 2)."""
    g = _gen(seed)
    x = torch.randn(T, H, D, generator=g) * 2.0
    if kind == "outlier":
        x[:, :, 3] *= 200.0
        x[:, 0, D - 1] *= 50.0
        x[:, H - 1] *= 1e-6  # a head of tiny values: scale near, not at, the floor
    if kind == "zero_rows":
        x[0] = 0.0
        x[T - 1, H - 1] = 0.0
        x[T // 2, 0] = -0.0
    x = x.to(dtype)
    if layout == "contiguous":
        return x.to(DEVICE)
    if layout == "sliced":
        wide = torch.full((T, H + 3, D + 16), NAN, dtype=dtype)
        wide[:, 1:H + 1, 8:D + 8] = x
        v = wide.to(DEVICE)[:, 1:H + 1, 8:D + 8]
    elif layout == "transposed":
        v = x.transpose(0, 1).contiguous().to(DEVICE).transpose(0, 1)
    elif layout == "d_strided":
        wide = torch.full((T, H, 2 * D), NAN, dtype=dtype)
        wide[:, :, ::2] = x
        v = wide.to(DEVICE)[:, :, ::2]
    assert not v.is_contiguous() and torch.equal(v.cpu(), x)
    return v


# ----------------------------------------------------------------------------------------------
# The references follow the rule (hand-computed values: the oracle of the oracle)
# ----------------------------------------------------------------------------------------------
# Row 0: amax 127 -> scale exactly 1, so x / s are the values themselves: ties round to even.
_TIE_ROW = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5]
_TIE_Q = [127, 2, -4, 0, 0, 2, 126, -126]


def test_ref_rounds_ties_to_even():
    x = torch.tensor([[_TIE_ROW]], device=DEVICE)
    q, s = quantize_per_token_head_ref(x)
    assert s.item() == 1.0
    assert q.cpu().flatten().tolist() == _TIE_Q


def test_ref_zero_row_scale_floor():
    x = torch.zeros(1, 1, 8, device=DEVICE)
    q, s = quantize_per_token_head_ref(x)
    assert _bits(s).item() == torch.tensor(1e-8, dtype=torch.float32).view(torch.int32).item()
    assert q.abs().sum().item() == 0


def test_ref_per_channel_clamps_and_ties():
    scale = torch.tensor([[0.5, 0.5, 0.01, 0.01, 0.01, 0.01, 0.01, 1.0]], device=DEVICE)
    x = torch.tensor([[[1.25, -1.75, 5.0, -1e30, INF, -INF, NAN, 127.5]]], device=DEVICE)
    q = quantize_per_channel_ref(x, scale)
    # 2.5 -> 2, -3.5 -> -4, 500 -> 127, -1e32 -> -127, +-inf -> +-127, NaN -> 0, 127.5 -> 127 (clamp)
    assert q.cpu().flatten().tolist() == [2, -4, 127, -127, 127, -127, 0, 127]


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
])
def test_dequantize_error_bound(dtype):
    """|x - q * s| <= s / 2 for every unclipped element (the rounding bound of the rule)."""
    x = make_x(6, 3, 64, dtype, 5, kind="outlier")
    q, s = quantize_per_token_head_ref(x)
    err = (dequantize_per_token_head(q, s) - x.float()).abs()
    assert bool((err <= s.unsqueeze(-1) / 2).all())
    vs = calibrate_v_scale(x)
    err = (dequantize_per_channel(quantize_per_channel_ref(x, vs), vs) - x.float()).abs()
    assert bool((err <= vs.unsqueeze(0) / 2).all())


# ----------------------------------------------------------------------------------------------
# Triton == reference, exactly
# ----------------------------------------------------------------------------------------------
REGULAR = [  # (T, H, D, dtype, kind, layout)
    pytest.param(5, 4, 128, torch.bfloat16, "gauss", "contiguous", id="T5-H4-D128-bf16"),
    pytest.param(3, 8, 64, torch.float16, "gauss", "contiguous", id="T3-H8-D64-fp16"),
    pytest.param(4, 2, 8, torch.float32, "gauss", "contiguous", id="T4-H2-D8-fp32"),
    pytest.param(3, 3, 80, torch.bfloat16, "outlier", "contiguous", id="T3-H3-D80-bf16-outlier"),
    pytest.param(2, 20, 256, torch.float32, "outlier", "contiguous", id="T2-H20-D256-fp32-outlier-2progs"),
    pytest.param(4, 5, 64, torch.bfloat16, "zero_rows", "contiguous", id="T4-H5-D64-bf16-zero-rows"),
]
STRIDED = [
    pytest.param(4, 3, 80, torch.bfloat16, "outlier", "sliced", id="T4-H3-D80-bf16-sliced"),
    pytest.param(3, 5, 64, torch.float32, "gauss", "transposed", id="T3-H5-D64-fp32-transposed"),
    pytest.param(3, 2, 128, torch.float16, "zero_rows", "d_strided", id="T3-H2-D128-fp16-d-stride2"),
]


@pytest.mark.parametrize("T, H, D, dtype, kind, layout", REGULAR + STRIDED)
def test_per_token_head_equals_ref(T, H, D, dtype, kind, layout):
    x = make_x(T, H, D, dtype, T * 1000 + H * 10 + D, kind=kind, layout=layout)
    q, s = quantize_per_token_head(x)
    q_ref, s_ref = quantize_per_token_head_ref(x)
    assert q.is_contiguous() and s.is_contiguous()
    assert_same_q(q, q_ref)
    assert_same_scale(s, s_ref)
    assert bool((q != -128).all())
    if kind == "zero_rows":
        assert bool((s[0] == torch.tensor(1e-8)).all()) and q[0].abs().sum().item() == 0


@pytest.mark.parametrize("T, H, D, dtype, kind, layout", REGULAR + STRIDED)
def test_per_channel_equals_ref(T, H, D, dtype, kind, layout):
    x = make_x(T, H, D, dtype, T * 1000 + H * 10 + D + 1, kind=kind, layout=layout)
    # A scale from the first half of the tokens only, shrunk: the rest of x goes beyond 127 * s.
    scale = calibrate_v_scale(x[: max(1, T // 2)].float() * 0.5)
    q = quantize_per_channel(x, scale)
    q_ref = quantize_per_channel_ref(x, scale)
    assert_same_q(q, q_ref)
    assert bool((q.abs() == 127).any()), "the case should exercise the clamp"


def test_per_channel_strided_scale():
    x = make_x(3, 4, 64, torch.bfloat16, 11)
    wide = (torch.rand(64, 4 * 2, generator=_gen(12)) + 0.01).to(DEVICE) / 64
    scale = wide.t()[::2]  # [4, 64] with strides (2, 8)
    assert scale.shape == (4, 64) and not scale.is_contiguous()
    assert_same_q(quantize_per_channel(x, scale), quantize_per_channel_ref(x, scale))


def test_ties_round_to_even_in_triton():
    row = torch.tensor(_TIE_ROW)
    x = torch.stack([row, -row, row * 0.5]).reshape(1, 3, 8).to(DEVICE)  # scales 1, 1, 0.5
    q, s = quantize_per_token_head(x)
    assert s.cpu().tolist() == [[1.0, 1.0, 0.5]]
    want = torch.tensor([_TIE_Q, [-v for v in _TIE_Q], _TIE_Q], dtype=torch.int8).reshape(1, 3, 8)
    assert_same_q(q, want)
    assert_same_q(quantize_per_channel(x, torch.ones(3, 8, device=DEVICE)),
                  torch.tensor([_TIE_Q, [-v for v in _TIE_Q], [64, 1, -2, 0, 0, 1, 63, -63]],
                               dtype=torch.int8).reshape(1, 3, 8))


# numpy (the interpreter) warns on inf / inf; the result (NaN -> q 0) is what is being tested.
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_nan_inf_policy_per_token_head():
    """A NaN (inf) in a (token, head) gives it a NaN (inf) scale and q = 0; other rows are untouched."""
    x = make_x(3, 4, 64, torch.float32, 21)
    x[0, 1, 7] = NAN
    x[1, 2, 0] = INF
    x[2, 3, 5] = -INF
    x[2, 0, 9] = NAN
    q, s = quantize_per_token_head(x)
    q_ref, s_ref = quantize_per_token_head_ref(x)
    assert_same_q(q, q_ref)
    assert_same_scale(s, s_ref)
    assert torch.isnan(s[0, 1]) and torch.isnan(s[2, 0]) and s[1, 2] == INF and s[2, 3] == INF
    for t, h in ((0, 1), (1, 2), (2, 3), (2, 0)):
        assert q[t, h].abs().sum().item() == 0
        assert bool(torch.isnan(dequantize_per_token_head(q, s)[t, h]).all())
    clean = torch.ones(3, 4, dtype=torch.bool)
    clean[0, 1] = clean[1, 2] = clean[2, 3] = clean[2, 0] = False
    assert bool(torch.isfinite(s.cpu()[clean]).all()) and bool((q.cpu()[clean].abs().amax(-1) == 127).all())


def test_nan_inf_policy_per_channel():
    x = make_x(2, 2, 8, torch.float32, 22)
    x[0, 0, :3] = torch.tensor([NAN, INF, -INF])
    scale = torch.full((2, 8), 0.05, device=DEVICE)
    q = quantize_per_channel(x, scale)
    assert_same_q(q, quantize_per_channel_ref(x, scale))
    assert q[0, 0, :3].cpu().tolist() == [0, 127, -127]


@pytest.mark.parametrize("D", [8, 64, 80, 128, 256], ids=lambda d: f"D{d}")
def test_head_sizes(D):
    x = make_x(2, 3, D, torch.bfloat16, D, kind="outlier")
    q, s = quantize_per_token_head(x)
    q_ref, s_ref = quantize_per_token_head_ref(x)
    assert_same_q(q, q_ref)
    assert_same_scale(s, s_ref)
    vs = calibrate_v_scale(x[:1])
    assert_same_q(quantize_per_channel(x, vs), quantize_per_channel_ref(x, vs))


def test_empty_token_count():
    x = torch.randn(0, 4, 64, device=DEVICE)
    q, s = quantize_per_token_head(x)
    assert q.shape == (0, 4, 64) and s.shape == (0, 4)
    assert quantize_per_channel(x, torch.ones(4, 64, device=DEVICE)).shape == (0, 4, 64)


BAD_INPUT = [  # (what, args, name the message must contain)
    pytest.param("tok", lambda: (torch.randn(2, 3, 64).int(),), "x.dtype", id="tok-int-dtype"),
    pytest.param("tok", lambda: (torch.randn(2, 64),), "x.dim()", id="tok-2d"),
    pytest.param("tok", lambda: (torch.randn(2, 3, 12),), "x.shape[2]", id="tok-D12"),
    pytest.param("tok", lambda: (torch.randn(2, 3, 264),), "x.shape[2]", id="tok-D264"),
    pytest.param("tok", lambda: ([[1.0]],), "x", id="tok-not-tensor"),
    pytest.param("chan", lambda: (torch.randn(2, 3, 64), torch.ones(3, 32)), "scale.shape", id="chan-scale-shape"),
    pytest.param("chan", lambda: (torch.randn(2, 3, 64), torch.ones(3, 64, dtype=torch.float16)), "scale.dtype",
                 id="chan-scale-fp16"),
    pytest.param("chan", lambda: (torch.randn(2, 3, 64).double(), torch.ones(3, 64)), "x.dtype", id="chan-x-fp64"),
]


@pytest.mark.parametrize("what, make_args, name", BAD_INPUT)
def test_bad_input_raises(what, make_args, name):
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in make_args()]
    fns = (quantize_per_token_head, quantize_per_token_head_ref) if what == "tok" else (
        quantize_per_channel, quantize_per_channel_ref)
    for fn in fns:
        with pytest.raises(ValueError, match="^" + re.escape(name)):
            fn(*args)


# ----------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------
def _samples(seed, Ts=(5, 0, 9, 3), H=2, D=8, dtype=torch.bfloat16):
    g = _gen(seed)
    out = []
    for T in Ts:
        v = torch.randn(T, H, D, generator=g) * torch.linspace(0.1, 30.0, H * D).reshape(1, H, D)
        out.append(v.to(dtype).to(DEVICE))
    out[0][:, 1, 2] = 0.0  # a channel that is zero in this sample only
    return out


def _loop_amax(samples):
    H, D = samples[0].shape[1:]
    a = np.zeros((H, D), dtype=np.float32)
    for v in samples:
        vv = v.float().cpu().numpy()
        for t in range(vv.shape[0]):
            for h in range(H):
                for d in range(D):
                    a[h, d] = max(a[h, d], abs(vv[t, h, d]))
    return a


def _scale_np(a):
    return np.maximum(np.float32(a) / np.float32(127.0), np.float32(1e-8)).astype(np.float32)


def test_calibrate_amax_equals_loop():
    samples = _samples(31)
    got = calibrate_v_scale(iter(samples))  # a one-pass iterator is enough
    assert got.dtype == torch.float32 and got.shape == (2, 8)
    want = torch.from_numpy(_scale_np(_loop_amax(samples)))
    assert_same_scale(got, want)


def test_calibrate_one_tensor_and_zero_channel():
    v = _samples(32, Ts=(6,))[0]
    v[:, 0, 4] = 0.0
    got = calibrate_v_scale(v)
    assert_same_scale(got, torch.from_numpy(_scale_np(_loop_amax([v]))))
    assert got[0, 4].item() == torch.tensor(1e-8).item()


@pytest.mark.parametrize("p", [50.0, 99.9, 100.0, 1e-3], ids=lambda p: f"p{p:g}")
def test_calibrate_percentile_equals_numpy(p):
    samples = _samples(33, Ts=(40, 0, 61), dtype=torch.float32)
    got = calibrate_v_scale(samples, percentile=p)
    allv = np.abs(np.concatenate([s.cpu().numpy() for s in samples], axis=0)).astype(np.float64)
    a = np.percentile(allv, p, axis=0).astype(np.float32)
    assert_same_scale(got, torch.from_numpy(_scale_np(a)))
    if p == 100.0:
        assert_same_scale(got, calibrate_v_scale(samples))


def test_calibrate_percentile_ignores_a_rare_outlier():
    v = _samples(34, Ts=(2000,), dtype=torch.float32)[0]
    v[123, 1, 5] = 1e4
    amax_scale = calibrate_v_scale(v)
    pct_scale = calibrate_v_scale(v, percentile=99.9)
    assert amax_scale[1, 5].item() == pytest.approx(1e4 / 127)
    assert pct_scale[1, 5].item() < 1e4 / 127 / 50
    assert bool((pct_scale <= amax_scale).all())


BAD_CALIBRATION = [
    pytest.param(lambda s: s[:1] + [s[1][:, :, :4]], {}, "samples[1].shape", id="head-size-mismatch"),
    pytest.param(lambda s: [s[0], s[2].clone().fill_(NAN)], {}, "samples[1]", id="nan-sample"),
    pytest.param(lambda s: [s[0].clone().fill_(INF)], {}, "samples[0]", id="inf-sample"),
    pytest.param(lambda s: [], {}, "samples", id="empty-iterable"),
    pytest.param(lambda s: [s[1]], {}, "samples", id="zero-tokens"),
    pytest.param(lambda s: s, {"percentile": 0}, "percentile", id="percentile-0"),
    pytest.param(lambda s: s, {"percentile": 100.5}, "percentile", id="percentile-100.5"),
    pytest.param(lambda s: [s[0].int()], {}, "samples[0].dtype", id="int-dtype"),
]


@pytest.mark.parametrize("edit, kw, name", BAD_CALIBRATION)
def test_calibrate_rejects(edit, kw, name):
    with pytest.raises(ValueError, match="^" + re.escape(name)):
        calibrate_v_scale(edit(_samples(35, dtype=torch.float32)), **kw)


# ----------------------------------------------------------------------------------------------
# K smoothing factors
# ----------------------------------------------------------------------------------------------
def test_calibrate_k_smooth_is_sqrt_of_amax_ratio_per_kv_head():
    """f[h_kv, c] = sqrt(amax |k| over tokens / amax |q| over tokens and the group's query heads),
    against a plain loop; 1 where a channel is all zero; the clamp at the range's ends."""
    g = torch.Generator().manual_seed(3)
    k = [torch.randn(40, 2, 16, generator=g) * 3, torch.randn(9, 2, 16, generator=g)]
    q = torch.randn(30, 6, 16, generator=g).bfloat16()  # GQA 3: heads 0-2 -> kv 0, 3-5 -> kv 1
    k[0][:, 1, 5] = 0.0
    k[1][:, 1, 5] = 0.0  # an all-zero key channel
    q[:, 0:3, 7] = 0.0  # an all-zero query channel of kv head 0
    k[0][3, 0, 9] = 1e30  # a huge key channel: clamped to 2^20
    f = calibrate_k_smooth((x.to(DEVICE) for x in k), q.to(DEVICE)).cpu()
    assert f.dtype == torch.float32 and f.shape == (2, 16)
    kk, qq = torch.cat(k).double().abs(), q.double().abs()
    for h in range(2):
        for c in range(16):
            ak, aq = float(kk[:, h, c].max()), float(qq[:, 3 * h:3 * h + 3, c].max())
            want = 1.0 if ak == 0 or aq == 0 else min(max((ak / aq) ** 0.5, K_SMOOTH_RANGE[0]),
                                                       K_SMOOTH_RANGE[1])
            assert f[h, c].item() == np.float32(want), (h, c)
    assert f[1, 5] == 1.0 and f[0, 7] == 1.0 and f[0, 9] == K_SMOOTH_RANGE[1]


def test_calibrate_k_smooth_rejects():
    k, q = torch.randn(5, 2, 16), torch.randn(5, 4, 16)
    with pytest.raises(ValueError, match="^q_samples.shape"):
        calibrate_k_smooth(k, torch.randn(5, 3, 16))  # 3 heads over 2 kv heads
    with pytest.raises(ValueError, match="^q_samples.shape"):
        calibrate_k_smooth(k, torch.randn(5, 4, 8))
    with pytest.raises(ValueError, match=r"^k_samples\[0\]"):
        calibrate_k_smooth(k.clone().fill_(NAN), q)
    with pytest.raises(ValueError, match="^q_samples"):
        calibrate_k_smooth(k, [])


# ----------------------------------------------------------------------------------------------
# Save / load
# ----------------------------------------------------------------------------------------------
def _layer_scales():
    g = _gen(41)
    return {
        "model.layers.0.self_attn.attn": (torch.rand(2, 64, generator=g) + 1e-3) / 127,
        "model.layers.1.self_attn.attn": torch.full((2, 64), 1e-8),  # the floor survives bit-exact
        "model.layers.2.self_attn.attn": torch.rand(4, 128, generator=g) * 3 + 1e-8,
    }


def test_save_load_round_trip_bit_exact(tmp_path):
    scales = {k: v.to(DEVICE) for k, v in _layer_scales().items()}
    path = tmp_path / "v_scales.safetensors"
    save_v_scales(path, scales)
    expect = {k: tuple(v.shape) for k, v in scales.items()}
    for loaded in (load_v_scales(path), load_v_scales(str(path), expect_shapes=expect, device=DEVICE)):
        assert sorted(loaded) == sorted(scales)
        for k in scales:
            assert loaded[k].dtype == torch.float32
            assert_same_scale(loaded[k], scales[k])


def test_load_rejects_wrong_shape(tmp_path):
    path = tmp_path / "v.safetensors"
    save_v_scales(path, _layer_scales())
    expect = {"model.layers.0.self_attn.attn": (2, 64), "model.layers.2.self_attn.attn": (8, 128)}
    with pytest.raises(ValueError) as e:
        load_v_scales(path, expect_shapes=expect)
    msg = str(e.value)
    assert "model.layers.2.self_attn.attn" in msg and "(8, 128)" in msg and "(4, 128)" in msg, msg


def test_load_rejects_missing_layer(tmp_path):
    path = tmp_path / "v.safetensors"
    save_v_scales(path, _layer_scales())
    with pytest.raises(ValueError, match="model.layers.7.self_attn.attn.*missing"):
        load_v_scales(path, expect_shapes={"model.layers.0.self_attn.attn": (2, 64),
                                           "model.layers.7.self_attn.attn": (2, 64)})


BAD_FILES = [  # tensors written behind save_v_scales' back, and what load must say
    pytest.param({"l0": torch.ones(2, 64, dtype=torch.float16)}, "layer 'l0' dtype", id="fp16"),
    pytest.param({"l0": torch.ones(2, 64, dtype=torch.bfloat16)}, "layer 'l0' dtype", id="bf16"),
    pytest.param({"l0": torch.ones(2, 64), "l1": torch.ones(128)}, "layer 'l1' ndim", id="1d"),
    pytest.param({"l0": torch.zeros(2, 64)}, "layer 'l0' values", id="zero-scale"),
    pytest.param({"l0": torch.full((2, 64), NAN)}, "layer 'l0' values", id="nan-scale"),
]


@pytest.mark.parametrize("tensors, name", BAD_FILES)
def test_load_rejects_bad_file(tmp_path, tensors, name):
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="^" + re.escape(name)):
        load_v_scales(path)


def _truncated(path):
    save_v_scales(path, _layer_scales())
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


def _garbage(path):
    path.write_bytes(bytes(range(256)) * 4)


UNREADABLE = [  # what a user may point load_v_scales at by mistake
    pytest.param(_truncated, "unreadable", id="truncated"),
    pytest.param(_garbage, "unreadable", id="not-safetensors"),
    pytest.param(lambda p: p.write_text('{"l0": [1, 2]}'), "unreadable", id="json-text"),
    pytest.param(lambda p: p.write_bytes(b""), "unreadable", id="empty-file"),
    pytest.param(lambda p: p.mkdir(), "a directory", id="folder"),
    pytest.param(lambda p: None, "no such file", id="missing"),
]


@pytest.mark.parametrize("make, why", UNREADABLE)
def test_load_unreadable_file_names_the_path(tmp_path, make, why):
    path = tmp_path / "v_scales.safetensors"
    make(path)
    with pytest.raises(ValueError) as e:
        load_v_scales(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: expected a safetensors file of V scales") and why in msg, msg


def test_load_rejects_foreign_format(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"l0": torch.ones(2, 64)}, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="metadata 'format'"):
        load_v_scales(path)


@pytest.mark.parametrize("scales, name", [
    pytest.param({"l0": torch.ones(2, 64, dtype=torch.float16)}, "layer 'l0' dtype", id="fp16"),
    pytest.param({"l0": torch.ones(2, 64, 1)}, "layer 'l0' ndim", id="3d"),
    pytest.param({"l0": -torch.ones(2, 64)}, "layer 'l0' values", id="negative"),
    pytest.param({}, "scales", id="empty"),
])
def test_save_rejects(tmp_path, scales, name):
    path = tmp_path / "never.safetensors"
    with pytest.raises(ValueError, match="^" + re.escape(name)):
        save_v_scales(path, scales)
    assert not path.exists()


# ----------------------------------------------------------------------------------------------
# Torch custom op registration (fake implementations agree with the real ones)
# ----------------------------------------------------------------------------------------------
def test_custom_ops_opcheck():
    x = make_x(3, 2, 64, torch.bfloat16, 51, layout="sliced")
    scale = calibrate_v_scale(x)
    torch.library.opcheck(torch.ops.openmla.int8_quantize_per_token_head.default, (x,))
    torch.library.opcheck(torch.ops.openmla.int8_quantize_per_channel.default, (x, scale))
