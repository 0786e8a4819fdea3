"""Symmetric int8 quantizers for the MHA path's int8 caches (DESIGN.md "int8 caches").

The rule, for a group of values x sharing one fp32 scale s:

    s = max(amax / 127, 1e-8)          amax = max |x| over the group, in fp32
    q = clamp(rne(x_fp32 / s), -127, 127) as int8       (-128 is never produced)
    x ~= q * s                         (dequantize)

Two granularities, one function each (STYLE.md 7):
  - dynamic per token and head (Q at attention time, K in the cache): the group is the D values
    of one (token, head); `quantize_per_token_head` returns the int8 values and the [T, H] scales.
  - static per channel (V of `int8_qkv`): the scale [H_kv, D] is given (from `calibrate_v_scale`
    or `load_v_scales`); `quantize_per_channel` returns the int8 values only.

The torch functions `*_ref` are the byte-level truth (as `FP8_DS_MLA.pack` is for MLA); the
Triton functions equal them exactly (int8 values and fp32 scale bits) because:
  - amax is an exact fp32 max (widening bf16/fp16 is exact);
  - amax / 127 and x / s are correctly rounded divisions: `div_rn` in Triton (its `/` on fp32 is
    the approximate `div.full.f32` on NVIDIA), a tensor divisor in torch (on CUDA
    `tensor / python_float` becomes a multiply by the rounded reciprocal);
  - rne is `libdevice.nearbyint` (round half to even, `cvt.rni` on NVIDIA; AMD's libdevice has
    no `rint`), `torch.round` in the reference.

NaN / inf policy (int8 has neither):
  - per token and head: amax propagates NaN (as torch.amax), so a (token, head) holding a NaN
    gets a NaN scale, a +-inf gets an inf scale; every q of such a group is 0 (x / NaN and
    inf / inf are NaN, which quantizes to 0; finite / inf is 0). Dequantized, the group is
    NaN (0 * NaN, 0 * inf): the bad value stays visible instead of being silently clipped.
  - per channel (static scale): a NaN element quantizes to 0; +-inf clamps to +-127.
  - NaN never reaches a float->int conversion (whose result is undefined): it is replaced by 0
    first, in both the reference and the kernels.

Calibration and storage of V scales: `calibrate_v_scale` (amax or a percentile of |v| per
(head, channel)), `save_v_scales` / `load_v_scales` (safetensors, keyed by layer name).
Optional per-channel K smoothing for outlier channels: `calibrate_k_smooth` (see there).

The `@triton.jit` helpers `int8_quantize_rows` and `int8_quantize_with_scale` are the building
blocks the cache writer and the attention kernels call on their own tiles, so every producer of
int8 values applies the same rule.
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping, Optional, Union

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .validate import check_same_device, check_tensor, fail

INT8_MAX = 127  # symmetric range: -127..127
INT8_SCALE_FLOOR = 1e-8  # the scale of an all-zero group (fp32 1e-8)
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_D = 256
_V_SCALES_FORMAT = "openmla.int8_v_scales"


# ----------------------------------------------------------------------------------------------
# torch references (the byte-level truth)
# ----------------------------------------------------------------------------------------------
def _round_clamp_int8(y: torch.Tensor) -> torch.Tensor:
    """fp32 quotients -> int8 by the rule: NaN -> 0, rne, clamp to +-127."""
    y = torch.where(torch.isnan(y), torch.zeros_like(y), y)
    return torch.round(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # torch.round is half-to-even


def int8_scales_ref(amax: torch.Tensor) -> torch.Tensor:
    """Scale from an fp32 abs-max: max(amax / 127, 1e-8) in fp32 (NaN stays NaN, inf stays inf)."""
    amax = amax.float()
    # A tensor divisor: correctly rounded on every device (see the module docstring).
    s = amax / torch.full_like(amax, float(INT8_MAX))
    return torch.clamp_min(s, INT8_SCALE_FLOOR)  # clamp_min propagates NaN


def _check_thd(name: str, x) -> None:
    check_tensor(name, x, dtype=_IN_DTYPES, ndim=3)
    d = x.shape[2]
    if d % 8 or not 8 <= d <= _MAX_D:
        fail(f"{name}.shape[2]", f"a head size that is a multiple of 8 in [8, {_MAX_D}]", d)


def _check_channel_scale(x: torch.Tensor, scale) -> None:
    check_tensor("scale", scale, dtype=torch.float32, shape=(x.shape[1], x.shape[2]))
    check_same_device(x=x, scale=scale)


def quantize_per_token_head_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 quantization per (token, head), in torch (the reference).

    Args:
        x: [T, H, D] bf16 / fp16 / fp32, any strides; D a multiple of 8 up to 256.
    Returns:
        q: [T, H, D] int8 in [-127, 127], contiguous.
        scale: [T, H] fp32, max(amax / 127, 1e-8) with amax = max |x[t, h, :]|; x ~= q * scale[..., None].
        A (token, head) holding NaN (inf) gets a NaN (inf) scale and q = 0 (module docstring).
    """
    _check_thd("x", x)
    xf = x.float()
    scale = int8_scales_ref(xf.abs().amax(dim=-1))  # torch.amax propagates NaN
    q = _round_clamp_int8(xf / scale.unsqueeze(-1))
    return q.contiguous(), scale.contiguous()


def quantize_per_channel_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static symmetric int8 quantization with a per-(head, channel) scale, in torch (the reference).

    Args:
        x: [T, H, D] bf16 / fp16 / fp32, any strides; D a multiple of 8 up to 256.
        scale: [H, D] fp32, positive and finite (from `calibrate_v_scale` / `load_v_scales`).
    Returns:
        q: [T, H, D] int8 = clamp(rne(x / scale), -127, 127), contiguous; values beyond 127 * scale
        clamp; NaN -> 0.
    """
    _check_thd("x", x)
    _check_channel_scale(x, scale)
    return _round_clamp_int8(x.float() / scale.unsqueeze(0)).contiguous()


def dequantize_per_token_head(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] int8, scale [T, H] fp32 -> [T, H, D] fp32 = q * scale[..., None] (exact products)."""
    check_tensor("q", q, dtype=torch.int8, ndim=3)
    check_tensor("scale", scale, dtype=torch.float32, shape=(q.shape[0], q.shape[1]))
    return q.float() * scale.unsqueeze(-1)


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] int8, scale [H, D] fp32 -> [T, H, D] fp32 = q * scale[None] (exact products)."""
    check_tensor("q", q, dtype=torch.int8, ndim=3)
    check_tensor("scale", scale, dtype=torch.float32, shape=(q.shape[1], q.shape[2]))
    return q.float() * scale.unsqueeze(0)


# ----------------------------------------------------------------------------------------------
# Triton building blocks (shared with the cache writer and the attention kernels)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _max_nan(a, b):
    # torch.amax propagates NaN; tl.max's default combine (max.f32) would drop it.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def int8_quantize_with_scale(b_x, b_scale):
    """fp32 tile and a broadcastable fp32 scale -> int8 tile: clamp(rne(x / s), -127, 127), NaN -> 0."""
    b_y = tl.math.div_rn(b_x, b_scale)
    # Replace NaN before min/max: max.f32 would return the other operand (+-127), and a NaN
    # float -> int conversion is undefined.
    b_y = tl.where(b_y == b_y, b_y, 0.0)
    b_y = tl.minimum(tl.maximum(libdevice.nearbyint(b_y), -127.0), 127.0)
    return b_y.to(tl.int8)


@triton.jit
def int8_quantize_rows(b_x, SCALE_FLOOR: tl.constexpr):
    """fp32 tile [R, C] (masked-off entries must be 0) -> (int8 [R, C], fp32 scale [R]) per row.

    scale = max(amax / 127, SCALE_FLOOR), NaN-propagating like the reference."""
    b_amax = tl.reduce(tl.abs(b_x), 1, _max_nan)
    b_scale = tl.maximum(tl.math.div_rn(b_amax, 127.0), SCALE_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    return int8_quantize_with_scale(b_x, b_scale[:, None]), b_scale


@triton.jit
def _load_token_heads(x_ptr, stride_xt, stride_xh, stride_xd, H, D,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's [BLOCK_H, BLOCK_D] tile of x[token, heads, :] (program ids: token, head
    block) as fp32, with its token, offsets and mask. Masked entries load as 0: they cannot
    change an abs-max."""
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_x = (o_h < H)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x_ptr + i_t * stride_xt + o_h[:, None].to(tl.int64) * stride_xh
                  + o_d[None, :].to(tl.int64) * stride_xd, mask=m_x, other=0.0).to(tl.float32)
    return i_t, o_h, o_d, m_x, b_x


@triton.jit
def quantize_per_token_head_kernel(
    x_ptr, q_ptr, scale_ptr,
    stride_xt, stride_xh, stride_xd,
    H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SCALE_FLOOR: tl.constexpr,
):
    i_t, o_h, o_d, m_x, b_x = _load_token_heads(x_ptr, stride_xt, stride_xh, stride_xd, H, D,
                                                BLOCK_H, BLOCK_D)
    b_q, b_scale = int8_quantize_rows(b_x, SCALE_FLOOR)
    tl.store(q_ptr + (i_t * H + o_h[:, None]) * D + o_d[None, :], b_q, mask=m_x)
    tl.store(scale_ptr + i_t * H + o_h, b_scale, mask=o_h < H)


@triton.jit
def quantize_per_channel_kernel(
    x_ptr, scale_ptr, q_ptr,
    stride_xt, stride_xh, stride_xd, stride_sh, stride_sd,
    H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_t, o_h, o_d, m_x, b_x = _load_token_heads(x_ptr, stride_xt, stride_xh, stride_xd, H, D,
                                                BLOCK_H, BLOCK_D)
    # other=1: masked lanes divide by 1, never by 0 (their results are not stored anyway).
    b_s = tl.load(scale_ptr + o_h[:, None] * stride_sh + o_d[None, :] * stride_sd, mask=m_x, other=1.0)
    b_q = int8_quantize_with_scale(b_x, b_s)
    tl.store(q_ptr + (i_t * H + o_h[:, None]) * D + o_d[None, :], b_q, mask=m_x)


def _blocks(H: int, D: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(D)
    # About 4096 elements per program: a whole token for H*D <= 4096, several programs otherwise.
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_d))
    return block_h, block_d


def _launch_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, D = x.shape
    q = torch.empty((T, H, D), dtype=torch.int8, device=x.device)
    scale = torch.empty((T, H), dtype=torch.float32, device=x.device)
    if T == 0 or H == 0:
        return q, scale
    block_h, block_d = _blocks(H, D)
    grid = (T, triton.cdiv(H, block_h))
    quantize_per_token_head_kernel[grid](
        x, q, scale, x.stride(0), x.stride(1), x.stride(2), H, D,
        BLOCK_H=block_h, BLOCK_D=block_d, SCALE_FLOOR=INT8_SCALE_FLOOR, num_warps=4,
    )
    return q, scale


def _launch_per_channel(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    T, H, D = x.shape
    q = torch.empty((T, H, D), dtype=torch.int8, device=x.device)
    if T == 0 or H == 0:
        return q
    block_h, block_d = _blocks(H, D)
    grid = (T, triton.cdiv(H, block_h))
    quantize_per_channel_kernel[grid](
        x, scale, q, x.stride(0), x.stride(1), x.stride(2), scale.stride(0), scale.stride(1), H, D,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )
    return q


@torch.library.custom_op("openmla::int8_quantize_per_token_head", mutates_args=())
def _per_token_head_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_per_token_head(x)


@_per_token_head_op.register_fake
def _(x):
    T, H, D = x.shape
    return x.new_empty((T, H, D), dtype=torch.int8), x.new_empty((T, H), dtype=torch.float32)


@torch.library.custom_op("openmla::int8_quantize_per_channel", mutates_args=())
def _per_channel_op(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _launch_per_channel(x, scale)


@_per_channel_op.register_fake
def _(x, scale):
    return x.new_empty(x.shape, dtype=torch.int8)


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 quantization per (token, head), in Triton (Q and K of int8 caches).

    Args:
        x: [T, H, D] bf16 / fp16 / fp32, any strides (slices and transposed views are fine);
            D a multiple of 8 up to 256.
    Returns:
        q: [T, H, D] int8 in [-127, 127], contiguous.
        scale: [T, H] fp32 = max(amax / 127, 1e-8) per (token, head).
    Both equal `quantize_per_token_head_ref(x)` bit for bit, NaN/inf policy included (module
    docstring). No host sync; registered as the torch custom op openmla::int8_quantize_per_token_head.
    """
    _check_thd("x", x)
    return _per_token_head_op(x)


def quantize_per_channel(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static symmetric int8 quantization with a per-(head, channel) scale, in Triton (V of int8_qkv).

    Args:
        x: [T, H, D] bf16 / fp16 / fp32, any strides; D a multiple of 8 up to 256.
        scale: [H, D] fp32, any strides, positive and finite (not checked here: that would be a
            host sync; `calibrate_v_scale`, `save_v_scales` and `load_v_scales` guarantee it).
    Returns:
        q: [T, H, D] int8 = clamp(rne(x / scale), -127, 127), NaN -> 0, contiguous; equal to
        `quantize_per_channel_ref(x, scale)` exactly. No host sync; registered as the torch custom
        op openmla::int8_quantize_per_channel.
    """
    _check_thd("x", x)
    _check_channel_scale(x, scale)
    return _per_channel_op(x, scale)


# ----------------------------------------------------------------------------------------------
# V scale calibration and storage
# ----------------------------------------------------------------------------------------------
def _percentile_along_0(a: torch.Tensor, percentile: float) -> torch.Tensor:
    """Linear-interpolation percentile along dim 0 (numpy's default method), computed in fp64."""
    n = a.shape[0]
    s = torch.sort(a.double(), dim=0).values
    pos = percentile / 100.0 * (n - 1)
    lo = int(pos // 1)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    if frac == 0.0:
        return s[lo]
    return s[lo] + (s[hi] - s[lo]) * frac


def _abs_samples(samples, name: str):
    """Validated |x| (fp32) of each non-empty sample: `samples` is one tensor or an iterable of
    tensors [T_i, A, B] (bf16 / fp16 / fp32, any strides, same A and B, same device, all values
    finite). Returns (list of |x| [T_i, A, B], (A, B)); ValueError naming `name`[i] otherwise."""
    if isinstance(samples, torch.Tensor):
        samples = [samples]
    out, shape, device = [], None, None
    for i, v in enumerate(samples):
        nm = f"{name}[{i}]"
        check_tensor(nm, v, dtype=_IN_DTYPES, ndim=3)
        if shape is None:
            shape, device = tuple(v.shape[1:]), v.device
        elif tuple(v.shape[1:]) != shape:
            fail(f"{nm}.shape", f"(T, {shape[0]}, {shape[1]}) like {name}[0]", tuple(v.shape))
        elif v.device != device:
            fail(f"{nm}.device", f"{device} (the device of {name}[0])", v.device)
        if v.shape[0] == 0:
            continue
        a = v.float().abs()
        if not bool(torch.isfinite(a).all()):
            bad = (~torch.isfinite(a)).nonzero()[0].tolist()
            fail(nm, "finite values", f"{v[tuple(bad)].item()} at {bad}")
        out.append(a)
    if shape is None:
        fail(name, "at least one tensor [T, H, D]", "an empty iterable")
    if not out:
        fail(name, "at least one token in all", "0 tokens")
    return out, shape


def calibrate_v_scale(samples: Union[torch.Tensor, Iterable[torch.Tensor]], *,
                      percentile: Optional[float] = None) -> torch.Tensor:
    """Static per-channel V scale from observed V values.

    Args:
        samples: one tensor or an iterable of tensors [T_i, H_kv, D] (bf16 / fp16 / fp32, any
            strides, same H_kv and D, same device, T_i >= 0 with at least one token in all). Every
            value must be finite (a NaN or inf would poison its channel's scale): ValueError names
            the sample otherwise. This reads values back to the host: a calibration-time tool.
        percentile: None for the abs-max over all tokens (no value clips); or p in (0, 100]: the
            p-th percentile of |v| over all tokens, per (head, channel), linearly interpolated
            between order statistics as numpy.percentile's default (e.g. 99.9 ignores rare
            outliers, which then clip to +-127). Needs all samples in memory at once.
    Returns:
        scale: [H_kv, D] fp32 = max(a / 127, 1e-8), on the samples' device.
    """
    if percentile is not None and not (isinstance(percentile, (int, float)) and 0 < percentile <= 100):
        fail("percentile", "None or a number in (0, 100]", percentile)
    absv, shape = _abs_samples(samples, "samples")
    if percentile is None:
        amax = torch.stack([a.amax(dim=0) for a in absv]).amax(dim=0)
    else:
        flat = torch.cat([a.reshape(a.shape[0], -1) for a in absv], dim=0)
        amax = _percentile_along_0(flat, float(percentile)).float().reshape(shape)
    return int8_scales_ref(amax)


K_SMOOTH_RANGE = (2.0 ** -20, 2.0 ** 20)  # factors are clamped to this range


def calibrate_k_smooth(k_samples: Union[torch.Tensor, Iterable[torch.Tensor]],
                       q_samples: Union[torch.Tensor, Iterable[torch.Tensor]]) -> torch.Tensor:
    """Static per-channel K smoothing factors for int8 K (an opt-in beside DESIGN.md's format).

    A key's per-(token, head) int8 scale is set by its largest channel: an outlier channel 50x
    the others leaves them about one bit. Dividing K by f per channel before quantizing and
    multiplying q by the same f (q.k unchanged) moves the outlier into q, which is quantized
    per (token, head) as well; f = sqrt(amax|k| / amax|q|) per (KV head, channel) balances the
    two (SmoothQuant's rule with alpha 1/2). `write_kv_cache(..., k_smooth=f)` and
    `paged_attention(..., k_smooth=f)` apply it.

    It pays where outliers sit in fixed channels. Without them it can cost: f follows each
    channel's sample maximum, and q * f lets a few query channels set the query's scale, which
    hurts heavy-tailed keys (docs/accuracy.md has the errors of both cases). Compare with and
    without it on the model's own keys (tools/sweep.py) before turning it on.

    Args:
        k_samples: one tensor or an iterable [T_i, H_kv, D] of observed keys (finite values).
        q_samples: one tensor or an iterable [T_j, H, D] of observed queries, H a multiple of
            H_kv; query head h belongs to KV head h // (H / H_kv) (GQA).
    Returns:
        f: [H_kv, D] fp32 = sqrt(amax_k / amax_q) clamped to [2^-20, 2^20]; 1 for a channel
        where either abs-max is 0. Calibration-time tool (reads values back to the host).
    """
    ka, (h_kv, d) = _abs_samples(k_samples, "k_samples")
    qa, (h, dq) = _abs_samples(q_samples, "q_samples")
    if dq != d or h % h_kv:
        fail("q_samples.shape", f"(T, H, {d}) with H a multiple of H_kv = {h_kv}", (None, h, dq))
    amax_k = torch.stack([a.amax(dim=0) for a in ka]).amax(dim=0).double()
    amax_q = torch.stack([a.amax(dim=0) for a in qa]).amax(dim=0).double().to(amax_k.device)
    amax_q = amax_q.view(h_kv, h // h_kv, d).amax(dim=1)  # over the query heads of each KV head
    both = (amax_k > 0) & (amax_q > 0)
    f = torch.where(both, (amax_k / torch.where(both, amax_q, 1.0)).sqrt(), 1.0)
    return f.clamp(*K_SMOOTH_RANGE).float()


def _check_scale_entry(name: str, t, expect_shapes) -> None:
    if not isinstance(t, torch.Tensor):
        fail(f"layer {name!r}", "a torch.Tensor", type(t).__name__)
    if t.dtype != torch.float32:
        fail(f"layer {name!r} dtype", torch.float32, t.dtype)
    if t.dim() != 2:
        fail(f"layer {name!r} ndim", "2 ([H_kv, D])", f"{t.dim()} (shape {tuple(t.shape)})")
    if expect_shapes is not None and name in expect_shapes:
        want = tuple(int(s) for s in expect_shapes[name])
        if tuple(t.shape) != want:
            fail(f"layer {name!r} shape", want, tuple(t.shape))
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        fail(f"layer {name!r} values", "positive finite scales", f"{t[tuple(idx)].item()} at {idx}")


def save_v_scales(path: Union[str, os.PathLike], scales: Mapping[str, torch.Tensor]) -> None:
    """Write per-layer static V scales to a safetensors file.

    Args:
        path: the file to write (overwritten).
        scales: {layer name: [H_kv, D] fp32, positive and finite}, any device; stored as-is
            (bit-exact), with metadata {"format": "openmla.int8_v_scales", "version": "1"}.
    Raises ValueError naming the layer for a wrong dtype, rank or value (nothing is written).
    """
    if not isinstance(scales, Mapping) or not scales:
        fail("scales", "a non-empty dict {layer name: [H_kv, D] fp32}",
             type(scales).__name__ if not isinstance(scales, Mapping) else "an empty dict")
    for name, t in scales.items():
        if not isinstance(name, str):
            fail("scales key", "a layer name (str)", repr(name))
        _check_scale_entry(name, t, None)
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in scales.items()}
    save_file(tensors, os.fspath(path), metadata={"format": _V_SCALES_FORMAT, "version": "1"})


def load_v_scales(path: Union[str, os.PathLike], *, expect_shapes: Optional[Mapping[str, tuple]] = None,
                  device: Union[str, torch.device] = "cpu") -> dict[str, torch.Tensor]:
    """Read per-layer static V scales written by `save_v_scales`.

    Args:
        path: a safetensors file.
        expect_shapes: optional {layer name: (H_kv, D)}: every named layer must be in the file
            with exactly that shape. Layers in the file but not named are returned unchecked
            for shape.
        device: where the returned tensors live.
    Returns:
        {layer name: [H_kv, D] fp32}, bit-identical to what was saved.
    Raises ValueError: a path that is missing, a directory or not a readable safetensors file
    (truncated, foreign bytes), naming the path; a layer that is not fp32, not 2-D, not positive
    finite, of another shape than expected (naming the layer, the expected and the actual
    shape), or missing.
    """
    from safetensors import safe_open

    p = os.fspath(path)
    want = "a safetensors file of V scales (save_v_scales)"
    if os.path.isdir(p):
        fail(p, want, "a directory")
    if not os.path.exists(p):
        fail(p, want, "no such file")
    out = {}
    try:
        with safe_open(p, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            for name in f.keys():
                out[name] = f.get_tensor(name)
    except Exception as e:  # safetensors' own error type (truncated, foreign bytes) or an OSError
        fail(p, want, f"an unreadable file ({' '.join(str(e).split())[:200]})")
    if meta.get("format", _V_SCALES_FORMAT) != _V_SCALES_FORMAT:  # absent: a hand-made file, accepted
        fail(f"{p} metadata 'format'", repr(_V_SCALES_FORMAT), repr(meta.get("format")))
    if expect_shapes is not None:
        for name in expect_shapes:
            if name not in out:
                fail(f"layer {name!r}", f"present in {p}", f"missing (file has {sorted(out)})")
    for name, t in out.items():
        _check_scale_entry(name, t, expect_shapes)
    return {name: t.to(device) for name, t in out.items()}
