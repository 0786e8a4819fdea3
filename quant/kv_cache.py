"""Paged KV cache writer for the general MHA/GQA path (vLLM's `reshape_and_cache_flash`).

Caches are [num_blocks, block_size, H_kv, D] ("NHD") or [num_blocks, H_kv, block_size, D]
("HND"), bf16/fp16, or float8_e4m3fn with one fp32 scale per tensor:

    fp8 = e4m3fn(rne(x_fp32 / scale)), saturating at +-448 (NaN stays NaN)

or int8 (DESIGN.md "int8 caches"; the rule and its NaN/inf policy are `quant/int8.py`'s, applied
through its jit helpers so the bytes equal its torch references):
  - `int8_qkv`: int8 K with a dynamic per-(token, head) fp32 scale s = max(amax / 127, 1e-8)
    stored in a K-scale cache [num_blocks, H_kv, block_size] (both layouts), and int8 V with a
    static per-channel scale v_scale [H_kv, D] fp32 given by the caller;
  - `int8_qk`: int8 K as above, V in the model dtype (a bf16/fp16 V cache).

Token t goes to slot s = slot_mapping[t], that is block s // block_size, offset s % block_size,
through the caches' real strides (a cache may be a strided view). A slot < 0 is skipped (vLLM
pads batches with -1).

Host path (a layer writes once per decode step): a call whose signature passed the metadata
checks before skips them (`_lookup`; the value checks of check_slots and CPU fp8 scales run every
time), the launch is planned once per signature and goes through `kernels.launch.FastLaunch`, and
only a torch.compile trace calls the registered custom op (eager calls and CUDA-graph capture
launch directly).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from openmla.kernels.device import E4M3_BITS, arch_of
from openmla.kernels.launch import FastLaunch

from .e4m3 import f32_to_e4m3
from .validate import (CheckedCalls, check_quant_scale, check_same_device, check_tensor, fail,
                       tensor_signature)
from .format_types import MHA
from .formats import cache_format
from .int8 import INT8_SCALE_FLOOR, int8_quantize_rows, int8_quantize_with_scale
from .mha_formats import CACHE_DTYPES, MODEL_DTYPES, MHAFormat, mha_format_of
from .mha_formats import quantize_fp8_per_tensor  # noqa: F401  (the fp8 rule, importable from here)
from .mla_formats import FP8_E4M3_MAX

_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAYOUTS = ("NHD", "HND")
_E4M3_BITS = tl.constexpr(E4M3_BITS)


def cache_dims(cache: torch.Tensor, layout: str):
    """(num_blocks, block_size, H_kv, D) of a 4-D paged cache in `layout` ("NHD" or "HND")."""
    if layout == "NHD":
        nb, bs, h, d = cache.shape
    else:
        nb, h, bs, d = cache.shape
    return nb, bs, h, d


def cache_strides(cache: torch.Tensor, layout: str):
    """(block, token, head) element strides of a paged cache in `layout`; the last dim is unit."""
    if layout == "NHD":
        return cache.stride(0), cache.stride(1), cache.stride(2)
    return cache.stride(0), cache.stride(2), cache.stride(1)


@triton.jit
def _quantize(x, scale_ptr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, dtype: tl.constexpr,
              E4M3: tl.constexpr):
    if IS_FP8:
        # Correctly rounded division, as the reference's x / scale (a reciprocal multiply is not).
        y = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        y = tl.minimum(tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
        if E4M3 == _E4M3_BITS:  # the cache is a uint8 view: no float8e4nv on this GPU
            y = f32_to_e4m3(y, E4M3)
        else:
            y = y.to(dtype, fp_downcast_rounding="rtne")
    else:
        y = x.to(dtype)
    return y


@triton.jit
def write_kv_cache_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, ksc_ptr, ksm_ptr,
    H, D, NUM_SLOTS, BLOCK_SIZE,
    s_kt, s_kh, s_vt, s_vh,
    s_kcb, s_kct, s_kch, s_vcb, s_vct, s_vch,
    s_kscb, s_ksch, s_ksct, s_vsh, s_vsd, s_ksmh, s_ksmd,
    IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    K_INT8: tl.constexpr, V_INT8: tl.constexpr, SCALE_FLOOR: tl.constexpr,
    K_SMOOTH: tl.constexpr, E4M3: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    # Padding tokens (< 0) are skipped; out-of-range slots too (the host check is optional).
    if (slot >= 0) & (slot < NUM_SLOTS):
        i_b = slot // BLOCK_SIZE
        i_o = slot % BLOCK_SIZE
        o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        o_d = tl.arange(0, BLOCK_D)
        m_hd = (o_h < H)[:, None] & (o_d < D)[None, :]

        b_k = tl.load(k_ptr + i_t * s_kt + o_h[:, None] * s_kh + o_d[None, :], mask=m_hd)
        b_v = tl.load(v_ptr + i_t * s_vt + o_h[:, None] * s_vh + o_d[None, :], mask=m_hd)
        if K_INT8:
            b_kf = b_k.to(tl.float32)
            if K_SMOOTH:  # k / f per channel, correctly rounded (as the reference's division)
                b_f = tl.load(ksm_ptr + o_h[:, None] * s_ksmh + o_d[None, :] * s_ksmd, mask=m_hd,
                              other=1.0)
                b_kf = tl.math.div_rn(b_kf, b_f)
            # Masked-off lanes must be 0 for the abs-max (the loads above leave them undefined).
            b_k, b_ks = int8_quantize_rows(tl.where(m_hd, b_kf, 0.0), SCALE_FLOOR)
            tl.store(ksc_ptr + i_b * s_kscb + o_h * s_ksch + i_o * s_ksct, b_ks, mask=o_h < H)
        else:
            b_k = _quantize(b_k, k_scale_ptr, IS_FP8, FP8_MAX, kc_ptr.dtype.element_ty, E4M3)
        if V_INT8:
            # other=1: masked lanes divide by 1, never by 0 (they are not stored).
            b_vs = tl.load(v_scale_ptr + o_h[:, None] * s_vsh + o_d[None, :] * s_vsd, mask=m_hd,
                           other=1.0)
            b_v = int8_quantize_with_scale(b_v.to(tl.float32), b_vs)
        else:
            b_v = _quantize(b_v, v_scale_ptr, IS_FP8, FP8_MAX, vc_ptr.dtype.element_ty, E4M3)
        p_kc = kc_ptr + i_b * s_kcb + i_o * s_kct + o_h[:, None] * s_kch + o_d[None, :]
        p_vc = vc_ptr + i_b * s_vcb + i_o * s_vct + o_h[:, None] * s_vch + o_d[None, :]
        tl.store(p_kc, b_k, mask=m_hd)
        tl.store(p_vc, b_v, mask=m_hd)


# The launch of one call signature (grid, int arguments, constexprs): shapes, strides, dtypes,
# the format's flags and the device decide it, so it is made once per signature (every layer of
# every decode step repeats the same write). Cleared when full (shapes that never repeat).
_PLANS: dict = {}
_MAX_PLANS = 4096
_WRITE = FastLaunch(write_kv_cache_kernel)


def _stride(t):
    return None if t is None else t.stride()


def _plan(key, value, k_cache, v_cache, layout, k_scale_cache, v_scale, k_smooth, fmt, e4m3):
    """(grid, int arguments after the pointers, constexprs, whether fp8 caches go as bytes)."""
    T, H, D = key.shape
    nb, bs, _, _ = cache_dims(k_cache, layout)
    is_fp8, k_int8, v_int8 = fmt.fp8_per_tensor, fmt.k_int8, fmt.v_int8
    block_d = triton.next_power_of_2(D)
    block_h = min(triton.next_power_of_2(H), max(1, 2048 // block_d))
    ksc_strides = k_scale_cache.stride() if k_int8 else (0, 0, 0)
    vs_strides = v_scale.stride() if v_int8 else (0, 0)
    ksm_strides = k_smooth.stride() if k_smooth is not None else (0, 0)
    ints = (H, D, nb * bs, bs, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *cache_strides(k_cache, layout), *cache_strides(v_cache, layout),
            *ksc_strides, *vs_strides, *ksm_strides)
    consts = dict(IS_FP8=is_fp8, FP8_MAX=FP8_E4M3_MAX, BLOCK_H=block_h, BLOCK_D=block_d,
                  K_INT8=k_int8, V_INT8=v_int8, SCALE_FLOOR=INT8_SCALE_FLOOR,
                  K_SMOOTH=k_smooth is not None, E4M3=e4m3)
    # no float8e4nv type on this GPU: write the bytes
    return (T, triton.cdiv(H, block_h)), ints, consts, is_fp8 and e4m3 == E4M3_BITS


def _launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, layout, k_scale_cache,
            k_smooth, fmt: MHAFormat):
    T, H, _ = key.shape
    if T == 0 or H == 0:
        return
    is_fp8, k_int8, v_int8 = fmt.fp8_per_tensor, fmt.k_int8, fmt.v_int8
    e4m3 = arch_of(k_cache.device).e4m3_plain
    # everything _plan reads, and the dtypes the launch key needs (the boundary fixed the scales'
    # dtypes and v_cache's shape to k_cache's)
    pkey = (k_cache.device, e4m3, layout, key.dtype, key.shape, key.stride(), value.dtype,
            value.stride(), k_cache.dtype, v_cache.dtype, k_cache.shape, k_cache.stride(),
            v_cache.stride(), slot_mapping.dtype, is_fp8, k_int8, v_int8, _stride(k_scale_cache),
            _stride(v_scale), _stride(k_smooth))
    plan = _PLANS.get(pkey)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[pkey] = _plan(key, value, k_cache, v_cache, layout, k_scale_cache, v_scale,
                                    k_smooth, fmt, e4m3)
    grid, ints, consts, as_bytes = plan
    if as_bytes:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    scale_k = k_scale if is_fp8 else slot_mapping  # never read unless IS_FP8
    scale_v = v_scale if is_fp8 or v_int8 else slot_mapping  # read if IS_FP8 or V_INT8
    ksc = k_scale_cache if k_int8 else slot_mapping  # never written unless K_INT8
    ksm = k_smooth if k_smooth is not None else slot_mapping  # read only with K_SMOOTH
    args = (key, value, k_cache, v_cache, slot_mapping, scale_k, scale_v, ksc, ksm, *ints)
    # the plan's key fixes every int argument, constexpr and dtype; with every pointer 16-byte
    # aligned it keys the launch too (else FastLaunch keys on the arguments)
    if (key.data_ptr() | value.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()
            | slot_mapping.data_ptr() | scale_k.data_ptr() | scale_v.data_ptr() | ksc.data_ptr()
            | ksm.data_ptr()) & 15 == 0:
        _WRITE.keyed(pkey, grid, *args, **consts)
    else:
        _WRITE(grid, *args, **consts)


@torch.library.custom_op("openmla::write_kv_cache",
                         mutates_args=("k_cache", "v_cache", "k_scale_cache"))
def _write_kv_cache_op(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                       layout: str, k_scale_cache: Optional[torch.Tensor],
                       k_smooth: Optional[torch.Tensor], fmt_name: str) -> None:
    # k_scale_cache has no default on purpose: torch 2.11 drops trailing default-valued
    # arguments before its in-place bookkeeping indexes the mutated ones (an IndexError with
    # `= None`).
    # The format travels by its registry name (a custom op's arguments are tensors and scalars).
    _launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, layout, k_scale_cache,
            k_smooth, cache_format(fmt_name, MHA))


@_write_kv_cache_op.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, layout, k_scale_cache,
      k_smooth, fmt_name):
    return None


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                   k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                   layout: str = "NHD", check_slots: bool = True,
                   k_scale_cache: Optional[torch.Tensor] = None,
                   k_smooth: Optional[torch.Tensor] = None, fmt: Optional[MHAFormat] = None) -> None:
    """Write new keys and values into paged caches, in place.

    The cache format (quant/mha_formats.py) is `fmt`, or without it the one the cache dtypes
    give (`mha_format_of`):
      - both bf16, both fp16, or both float8_e4m3fn (per-tensor scales);
      - `int8_qkv`: k_cache and v_cache int8 (K scales dynamic into k_scale_cache, V scale static);
      - `int8_qk`: k_cache int8, v_cache bf16/fp16 (V stored as value.to(v_cache.dtype)).
    Other mixes involving int8 (int8 V with a non-int8 K, fp8 with int8) raise NotImplementedError.

    Args:
        key, value: [T, H_kv, D] bf16/fp16/fp32, last dim contiguous (any token/head strides).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] ("NHD") or
            [num_blocks, H_kv, block_size, D] ("HND"), same shape, dtypes as above; last dim
            contiguous, other strides free (strided views welcome).
        slot_mapping: [T] int32/int64; token t goes to slot s = block * block_size + offset.
            s < 0 is skipped (padding).
        k_scale, v_scale: for an fp8 cache, [1] fp32 per-tensor scales (required), finite and
            > 0 (ValueError naming the scale otherwise): fp8 = e4m3fn(rne(x_fp32 / scale)),
            saturating at +-448. Checked whenever they can be read without a device sync: scales
            on the CPU always, device scales with check_slots (in its one host read); with
            check_slots=False a device scale is not read (the run path: the layer checked it when
            it was set, `PagedAttentionImpl.set_kv_scales`).
            For an int8 V cache, v_scale is the static per-channel scale [H_kv, D] fp32 (required;
            positive and finite, as `calibrate_v_scale` / `load_v_scales` give it; any strides):
            v_int8 = clamp(rne(v_fp32 / v_scale[h, d]), -127, 127), NaN -> 0.
            None everywhere else (k_scale is always None with an int8 K: its scales are dynamic).
        layout: "NHD" or "HND".
        check_slots: when True (default) a slot >= num_blocks * block_size raises ValueError.
            That check reads slot_mapping on the host: ONE device sync per call. Pass False in
            the decode/run path (CUDA graphs): out-of-range slots are then skipped in the kernel,
            never written.
        k_scale_cache: [num_blocks, H_kv, block_size] fp32 (in both layouts; any strides),
            required with an int8 k_cache and only there. Slot s of head h receives the scale of
            its key: max(amax / 127, 1e-8) over key[t, h, :] in fp32, and k_cache receives
            clamp(rne(key_fp32 / scale), -127, 127) (NaN/inf policy of `quant/int8.py`). Both equal
            `quant.int8.quantize_per_token_head_ref(key)` bit for bit.
        k_smooth: optional [H_kv, D] fp32 per-channel K smoothing factors (positive, finite: from
            `quant.int8.calibrate_k_smooth`), int8 K only: the cache then holds the per-token
            quantization of key_fp32 / k_smooth (correctly rounded division), i.e.
            `quantize_per_token_head_ref(key.float() / k_smooth)`; the attention kernels multiply
            q by the same factors (`paged_attention(..., k_smooth=)`), so q.k is unchanged while
            outlier channels no longer set every key's scale.
        fmt: an MHA format descriptor (`quant.MHA_BF16`, `FP8_PER_TENSOR`, `INT8_QKV`, ...,
            or a layer's); the caches must be in it (ValueError otherwise).

    bf16/fp16 caches receive key.to(cache dtype) (round to nearest even).
    """
    compiling = torch.compiler.is_compiling()
    sig, hit = (None, None) if compiling else _lookup(
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_scale_cache, k_smooth, fmt,
        layout)
    if hit is not None and hit[0] is fmt:
        # a signature whose checks passed before: they read only what it holds, so they pass
        # again (the value checks below run on every call)
        _, fmt, num_slots = hit
    else:
        fmt_used, num_slots = _check_write(key, value, k_cache, v_cache, slot_mapping, k_scale,
                                           v_scale, layout, k_scale_cache, k_smooth, fmt)
        if sig is not None:
            _CHECKED.remember(sig, (fmt, fmt_used, num_slots))  # fmt kept alive: its id stays its own
        fmt = fmt_used
    T = key.shape[0]
    # host reads, before anything is written: the slots with check_slots, the fp8 scales with
    # check_slots or when they live on the CPU (no sync); all in one read
    read_scales = fmt.fp8_per_tensor and (check_slots or k_cache.device.type == "cpu")
    read_slots = check_slots and T > 0
    if read_slots or read_scales:
        parts = [slot_mapping.max().double().reshape(1)] if read_slots else []
        if read_scales:
            parts += [k_scale.double(), v_scale.double()]
        vals = torch.cat(parts).tolist()  # the one host sync (see check_slots)
        if read_scales:
            check_quant_scale("k_scale", vals[-2])
            check_quant_scale("v_scale", vals[-1])
        if read_slots and int(vals[0]) >= num_slots:
            fail("slot_mapping", f"slots < num_blocks * block_size = {num_slots} (or < 0: skip)",
                 f"max {int(vals[0])}")
    if compiling:  # torch.compile traces the registered op
        _write_kv_cache_op(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, layout,
                           k_scale_cache, k_smooth, fmt.name)
    else:  # eager and CUDA-graph capture: straight to the launch (the dispatcher costs more)
        _launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, layout,
                k_scale_cache, k_smooth, fmt)


# Signatures of calls whose checks passed (`_lookup`), with the format they resolved to and the
# cache's slot count; cleared when full (shapes that never repeat).
_CHECKED = CheckedCalls()


def _lookup(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_scale_cache, k_smooth,
            fmt, layout):
    """(signature, its _CHECKED entry or None). The signature holds everything `_check_write`
    reads: each tensor's type, dtype, shape, strides (contiguity is a function of shape and
    strides) and device, which are None, the format object (by identity: its entry holds it, so
    its id is not reused) and the layout. (None, None) when an argument has no such attributes
    or is unhashable: the full checks then say what is wrong."""
    try:
        t = tensor_signature
        sig = (t(key), t(value), t(k_cache), t(v_cache), t(slot_mapping), t(k_scale), t(v_scale),
               t(k_scale_cache), t(k_smooth), id(fmt), layout)
        return sig, _CHECKED.get(sig)
    except Exception:  # noqa: BLE001 - not tensors as the checks want them: the full checks
        return None, None


def _check_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, layout,
                 k_scale_cache, k_smooth, fmt):
    """Every metadata check of `write_kv_cache`, in order; returns (the caches' format,
    num_blocks * block_size)."""
    if layout not in LAYOUTS:
        fail("layout", "'NHD' or 'HND'", repr(layout))
    check_tensor("key", key, dtype=_IN_DTYPES, ndim=3, last_dim_contiguous=True)
    T, H, D = key.shape
    check_tensor("value", value, dtype=_IN_DTYPES, shape=(T, H, D), last_dim_contiguous=True)
    check_tensor("k_cache", k_cache, dtype=CACHE_DTYPES, ndim=4, last_dim_contiguous=True)
    nb, bs, h_kv, d = cache_dims(k_cache, layout)
    want = tuple(k_cache.shape)
    if (h_kv, d) != (H, D):
        fail(f"k_cache.shape ({layout})", f"H_kv = {H} and D = {D} as in key",
             f"H_kv = {h_kv}, D = {d} (shape {want})")
    if fmt is None:
        try:
            fmt = mha_format_of(k_cache, v_cache)
        except NotImplementedError as e:
            raise NotImplementedError(f"write_kv_cache: {e}") from None
    elif not isinstance(fmt, MHAFormat):
        fail("fmt", "an MHA cache format descriptor (quant.MHA_BF16, FP8_PER_TENSOR, INT8_QKV, ...)",
             type(fmt).__name__)
    check_mha_caches(fmt, k_cache, v_cache, shape=want)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(T,),
                 contiguous=True)
    is_fp8, k_int8 = fmt.fp8_per_tensor, fmt.k_int8
    if k_int8:
        check_int8_cache_scales(fmt, k_scale, v_scale, k_scale_cache, nb, bs, H, D)
        if k_smooth is not None:
            check_tensor("k_smooth", k_smooth, dtype=torch.float32, shape=(H, D))
    elif k_smooth is not None:
        fail("k_smooth", f"None for a {k_cache.dtype} k_cache (int8 K only)", "a tensor")
    else:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if is_fp8:
                if s is None:
                    fail(name, "a [1] fp32 tensor for a float8_e4m3fn cache", None)
                check_tensor(name, s, dtype=torch.float32, shape=(1,))
            elif s is not None:
                fail(name, f"None for a {k_cache.dtype} cache (scales quantize fp8 only)",
                     "a tensor")
        if k_scale_cache is not None:
            fail("k_scale_cache", f"None for a {k_cache.dtype} k_cache (int8 K only)", "a tensor")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                      slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale,
                      k_scale_cache=k_scale_cache, k_smooth=k_smooth)
    return fmt, nb * bs


def check_mha_caches(fmt: MHAFormat, k_cache, v_cache, *, shape, model_dtype=None) -> None:
    """ValueError unless k_cache and v_cache (same shape, last dim contiguous) have `fmt`'s dtypes.
    A model-dtype part (None in fmt) is model_dtype when given, else bf16 or fp16 (and for
    `auto`, V's dtype is K's)."""
    def want(d):
        return d if d is not None else (model_dtype if model_dtype is not None else MODEL_DTYPES)
    check_tensor("k_cache", k_cache, dtype=want(fmt.k_dtype), shape=shape, last_dim_contiguous=True)
    v_want = want(fmt.v_dtype)
    if fmt.k_dtype is None and fmt.v_dtype is None:
        v_want = k_cache.dtype
    check_tensor("v_cache", v_cache, dtype=v_want, shape=shape, last_dim_contiguous=True)


def check_int8_cache_scales(fmt: MHAFormat, k_scale, v_scale, k_scale_cache, nb, bs, H, D) -> None:
    """Scale arguments of the int8 formats (fmt.k_int8) for the writer and the attention
    kernels: k_scale None, k_scale_cache [nb, H, bs] fp32, v_scale [H, D] fp32 for an int8
    V (int8_qkv) and None for a model-dtype one (int8_qk)."""
    if k_scale is not None:
        fail("k_scale", "None for an int8 k_cache (its per-token scales are k_scale_cache)",
             "a tensor")
    if k_scale_cache is None:
        fail("k_scale_cache", f"a [{nb}, {H}, {bs}] fp32 tensor for an int8 k_cache", None)
    check_tensor("k_scale_cache", k_scale_cache, dtype=torch.float32, shape=(nb, H, bs))
    if fmt.v_int8:
        if v_scale is None:
            fail("v_scale", f"a [{H}, {D}] fp32 per-channel scale for an int8 v_cache", None)
        check_tensor("v_scale", v_scale, dtype=torch.float32, shape=(H, D))
    elif v_scale is not None:
        fail("v_scale", f"None for a model-dtype v_cache ({fmt.name}: V is not quantized)", "a tensor")
