"""`paged_attention`: attention of varlen queries over a paged KV cache (general MHA/GQA path).

Semantics are vLLM's FlashAttention backend (DESIGN.md, General MHA path; oracle
`kernels.reference.paged_attention_ref`): query i of request r sits at key position
context_len + i with context_len = seq_len - q_len; causal keeps keys j <= context_len + i;
window (left, right); softcap c * tanh(s / c) after scaling, before masking; ALiBi; sinks in the
denominator; an all-masked row gives out = 0, lse = -inf (lse = sink with sinks). How the kernel
works: kernel.py.

Host path (an eager decode call repeats per layer and step): a call whose signature passed the
tensor checks before skips them (`_lookup`; the scalar checks run every time), eager calls and
CUDA-graph capture go straight to launch.py (its plans are cached per signature too), and only a
torch.compile trace calls the registered custom op.
"""
from __future__ import annotations

from typing import Optional

import torch

from openmla.kernels.paged_attention.checks import (check_q_out, check_score_options,
                                                    query_len_bound)
from openmla.kernels.paged_attention.launch import ScoreOptions, launch_paged
from openmla.quant.format_types import MHA
from openmla.quant.formats import cache_format
from openmla.quant.kv_cache import LAYOUTS, cache_dims, check_int8_cache_scales, check_mha_caches
from openmla.quant.mha_formats import MHAFormat, mha_format_of
from openmla.quant.validate import CheckedCalls, check_same_device, check_tensor, fail, tensor_signature


@torch.library.custom_op("openmla::paged_attention", mutates_args=("out", "lse"))
def _paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
                        scale: float, causal: bool, window_left: int, window_right: int,
                        softcap: float, alibi_slopes: Optional[torch.Tensor], alibi_sqrt: bool,
                        sinks: Optional[torch.Tensor], k_scale: Optional[torch.Tensor],
                        v_scale: Optional[torch.Tensor], layout: str, max_query_len: int,
                        max_kv_len: int, num_splits: int,
                        k_scale_cache: Optional[torch.Tensor],
                        k_smooth: Optional[torch.Tensor], fmt_name: str) -> None:
    # the cache format travels by its registry name (a custom op's arguments are tensors and
    # scalars)
    opts = ScoreOptions(scale, causal, (window_left, window_right), softcap, alibi_slopes,
                        alibi_sqrt, sinks)
    launch_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, lse, opts,
                 layout=layout, max_q=max_query_len, max_kv=max_kv_len,
                 num_splits=num_splits or None, k_scale=k_scale, v_scale=v_scale,
                 k_scale_cache=k_scale_cache, k_smooth=k_smooth, fmt=cache_format(fmt_name, MHA))


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, lse, *args):
    return None


def _fp8_default_scale(s, device):
    """An fp8 per-tensor scale as the launch takes it: 1.0 when none is given."""
    return torch.ones(1, dtype=torch.float32, device=device) if s is None else s


def _check_fp8_scales(fmt, k_scale, v_scale, k_scale_cache, cache_dtype, device):
    """[k_scale, v_scale] of a bf16/fp16 (None) or fp8 (per-tensor [1], default 1.0) cache."""
    if k_scale_cache is not None:
        fail("k_scale_cache", f"None for a {cache_dtype} k_cache (int8 K only)", "a tensor")
    scales = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not fmt.fp8_per_tensor:
            if s is not None:
                fail(name, f"None for a {cache_dtype} cache (scales dequantize fp8 only)",
                     "a tensor")
        elif s is not None:
            check_tensor(name, s, dtype=torch.float32, shape=(1,))
        scales.append(_fp8_default_scale(s, device) if fmt.fp8_per_tensor else s)
    return scales


def _check_num_splits(num_splits):
    if num_splits is not None and not (isinstance(num_splits, int) and num_splits >= 1):
        fail("num_splits", "None or an int >= 1", num_splits)


# Signatures of calls whose tensor checks passed (`_lookup`), with the format they resolved to
# and max_kv; cleared when full (shapes that never repeat).
_CHECKED = CheckedCalls()


def _lookup(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, alibi_slopes, sinks,
            k_scale, v_scale, k_scale_cache, k_smooth, fmt, layout):
    """(signature, its _CHECKED entry or None). The signature holds everything the tensor checks
    of `paged_attention` read (`_check_paged` less the score options, num_splits and return_lse,
    which are checked on every call): each tensor's type, dtype, shape, strides (contiguity is a
    function of shape and strides) and device, which are None, the format object (by identity:
    its entry holds it, so its id is not reused) and the layout. (None, None) when an argument
    has no such attributes or is unhashable: the full checks then say what is wrong."""
    try:
        t = tensor_signature
        sig = (t(q), t(k_cache), t(v_cache), t(block_table), t(cu_seqlens_q), t(seq_lens), t(out),
               t(alibi_slopes), t(sinks), t(k_scale), t(v_scale), t(k_scale_cache), t(k_smooth),
               id(fmt), layout)
        return sig, _CHECKED.get(sig)
    except Exception:  # noqa: BLE001 - not tensors as the checks want them: the full checks
        return None, None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, *, scale: float, causal: bool = True,
                    window: tuple = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, alibi_sqrt: bool = False,
                    sinks: Optional[torch.Tensor] = None, k_scale: Optional[torch.Tensor] = None,
                    v_scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                    return_lse: bool = False, layout: str = "NHD",
                    max_query_len: Optional[int] = None, num_splits: Optional[int] = None,
                    k_scale_cache: Optional[torch.Tensor] = None,
                    k_smooth: Optional[torch.Tensor] = None, fmt: Optional[MHAFormat] = None):
    """Attention of varlen queries over a paged KV cache (vLLM FlashAttention semantics).

    Args:
        q: [T, H, D] bf16/fp16, last dim contiguous; D in 1..256 (multiples of 8 are the
            fast case).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] ("NHD") or
            [num_blocks, H_kv, block_size, D] ("HND"), q's dtype or float8_e4m3fn; last dim
            contiguous, other strides free (strided views, interleaved layers). H % H_kv == 0:
            query head h reads KV head h // (H // H_kv). Any block_size >= 1.
            int8 caches (DESIGN.md, as `quant.kv_cache.write_kv_cache` writes them; D a
            multiple of 8): an int8 k_cache with an int8 v_cache is `int8_qkv`, with a v_cache in
            q's dtype `int8_qk`. Q is then quantized per (token, head) inside the kernel
            (`quant.int8` rule), Q.K is an int8 dot with int32 accumulation scaled by
            s_q * s_k[token] * scale, and an int8 V is converted exactly for the P.V dot with
            its per-channel scale applied once to the output.
        block_table: [R, M] int32, last dim contiguous; token p of request r lives in block
            block_table[r, p // block_size] at offset p % block_size. Only entries for positions
            < seq_lens[r] are read; block offsets are computed in 64 bits. An invalid entry
            (< 0 or >= num_blocks) is never dereferenced: its keys are left out.
        cu_seqlens_q: [R + 1] int32: request r owns q rows cu_seqlens_q[r]:cu_seqlens_q[r+1].
            Rows past cu_seqlens_q[R] (padding) get out = 0, lse = -inf.
        seq_lens: [R] int32, total KV length of request r including its new tokens
            (<= M * block_size: keys past the table are never read); query i sits at position
            seq_len - q_len + i.
        scale: softmax scale, s = scale * q.k.
        causal: keys j <= seq_len - q_len + i (bottom-right aligned).
        window: (left, right), -1 unbounded (vLLM maps sliding window w to (w - 1, 0)).
        softcap: c > 0: s = c * tanh(s / c) after scaling, before masking and ALiBi.
        alibi_slopes: [H] fp32: s += slope[h] * (j - context_len); with alibi_sqrt,
            s += slope[h] * -sqrt(context_len + i - j) for j <= context_len + i (else 0).
        sinks: [H] fp32: one more logit per head in the denominator (no value); lse includes it.
        k_scale, v_scale: [1] fp32 per-tensor dequantization scales of an fp8 cache (None = 1.0);
            must be None for a bf16/fp16 cache. int8: k_scale None; v_scale the static
            per-channel scale [H_kv, D] fp32 of an int8 V (int8_qkv), None for int8_qk.
        out: optional [T, H, D] in q's dtype (last dim contiguous) to write into.
        return_lse: also return lse.
        layout: "NHD" or "HND".
        max_query_len: optional python int >= every query length. It only picks tile shapes and
            the split-KV count, never the result. When None it is T - R + 1 if that is
            <= 16 (every decode and short speculative batch: no device read); otherwise it is
            computed from cu_seqlens_q with ONE host sync. Pass it (vLLM's metadata has it) to
            keep speculative decoding free of syncs and CUDA-graph capturable.
        num_splits: None (choose from shapes and the SM count: short queries split when the
            grid underfills the GPU, long ones never) or a positive int forcing the split-KV
            count of any launch (tests, benchmarks, long-context chunked prefill).
        k_scale_cache: [num_blocks, H_kv, block_size] fp32 (any strides), the per-(token, head)
            K scales of an int8 k_cache (required there, None otherwise).
        k_smooth: optional [H_kv, D] fp32 per-channel K smoothing factors of an int8 k_cache
            written with the same factors (`write_kv_cache(..., k_smooth=)`, from
            `quant.int8.calibrate_k_smooth`): q is multiplied by them before it is quantized.
        fmt: the caches' MHA format (a quant descriptor: MHA_AUTO, MHA_BF16, MHA_FP16,
            FP8_PER_TENSOR, INT8_QKV, INT8_QK, or a layer's), checked against the caches; its
            16-bit parts are q's dtype. Default: the format the cache dtypes give
            (`quant.mha_format_of`: an int8 v_cache with an int8 k_cache is int8_qkv).

    Returns:
        out [T, H, D] in q's dtype; with return_lse also lse [T, H] fp32 natural log.
        An all-masked row gives out = 0 and lse = -inf (lse = sinks[h] with sinks).
    """
    compiling = torch.compiler.is_compiling()
    sig, hit = (None, None) if compiling else _lookup(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, alibi_slopes, sinks,
        k_scale, v_scale, k_scale_cache, k_smooth, fmt, layout)
    if hit is not None and hit[0] is fmt:
        # A signature whose tensor checks passed before: they read only what it holds, so they
        # pass again. The checks of the other arguments run on every call.
        _, fmt, max_kv = hit
        T, H, D = q.shape
        if out is None:
            out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if return_lse else None
        opts = check_score_options(H, scale, causal, window, softcap, alibi_slopes, alibi_sqrt,
                                   sinks)
        _check_num_splits(num_splits)
        if fmt.fp8_per_tensor:
            k_scale = _fp8_default_scale(k_scale, q.device)
            v_scale = _fp8_default_scale(v_scale, q.device)
        scales = (k_scale, v_scale)
    else:
        out, lse, opts, fmt_used, scales, max_kv = _check_paged(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, causal, window,
            softcap, alibi_slopes, alibi_sqrt, sinks, k_scale, v_scale, out, return_lse, layout,
            num_splits, k_scale_cache, k_smooth, fmt)
        if sig is not None:
            _CHECKED.remember(sig, (fmt, fmt_used, max_kv))  # fmt kept alive: its id stays its own
        fmt = fmt_used
        T = q.shape[0]
    if T > 0:
        max_q = query_len_bound(max_query_len, cu_seqlens_q, T, cu_seqlens_q.shape[0] - 1)
        if compiling:
            # traced by torch.compile: the registered op, one opaque call to the compiler
            _paged_attention_op(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out,
                                lse, opts.scale, opts.causal, opts.window[0], opts.window[1],
                                opts.softcap, alibi_slopes, opts.alibi_sqrt, sinks, scales[0],
                                scales[1], layout, max_q, max_kv, num_splits or 0,
                                k_scale_cache, k_smooth, fmt.name)
        else:
            # eager and CUDA-graph capture: straight to the launch (the custom op's dispatcher
            # costs more host time than both launches)
            launch_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, lse, opts,
                         layout=layout, max_q=max_q, max_kv=max_kv, num_splits=num_splits,
                         k_scale=scales[0], v_scale=scales[1], k_scale_cache=k_scale_cache,
                         k_smooth=k_smooth, fmt=fmt, sig=sig)
    return (out, lse) if return_lse else out


def _check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, causal, window,
                 softcap, alibi_slopes, alibi_sqrt, sinks, k_scale, v_scale, out, return_lse,
                 layout, num_splits, k_scale_cache, k_smooth, fmt):
    """Every boundary check of `paged_attention`, in order. Returns (out, lse, score options,
    the caches' format, [k_scale, v_scale] as the launch takes them, max_kv)."""
    out, lse = check_q_out(q, out, return_lse)
    T, H, D = q.shape
    if layout not in LAYOUTS:
        fail("layout", "'NHD' or 'HND'", repr(layout))
    check_tensor("k_cache", k_cache, dtype=(q.dtype, torch.float8_e4m3fn, torch.int8), ndim=4,
                 last_dim_contiguous=True)
    nb, page, H_kv, d = cache_dims(k_cache, layout)
    want = tuple(k_cache.shape)
    if d != D:
        fail(f"k_cache.shape ({layout})", f"head size {D} as q", want)
    if H_kv == 0 or H % H_kv:
        fail(f"k_cache.shape ({layout})", f"H_kv dividing H = {H}", want)
    if fmt is None:
        v_dtypes = (torch.int8, q.dtype) if k_cache.dtype == torch.int8 else k_cache.dtype
        check_tensor("v_cache", v_cache, dtype=v_dtypes, shape=want, last_dim_contiguous=True)
        fmt = mha_format_of(k_cache, v_cache)
    elif not isinstance(fmt, MHAFormat):
        fail("fmt", "an MHA cache format descriptor (quant.MHA_BF16, FP8_PER_TENSOR, INT8_QKV, ...)",
             type(fmt).__name__)
    else:
        check_mha_caches(fmt, k_cache, v_cache, shape=want, model_dtype=q.dtype)
    k_int8 = fmt.k_int8
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    R, M = block_table.shape
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, shape=(R + 1,), contiguous=True)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(R,), contiguous=True)
    opts = check_score_options(H, scale, causal, window, softcap, alibi_slopes, alibi_sqrt, sinks)
    if k_int8:
        if D % 8:
            raise NotImplementedError(f"int8 KV caches: head size {D} (supported: multiples of 8)")
        check_int8_cache_scales(fmt, k_scale, v_scale, k_scale_cache, nb, page, H_kv, D)
        if k_smooth is not None:
            check_tensor("k_smooth", k_smooth, dtype=torch.float32, shape=(H_kv, D))
        scales = [None, v_scale]
    else:
        if k_smooth is not None:
            fail("k_smooth", f"None for a {k_cache.dtype} k_cache (int8 K only)", "a tensor")
        scales = _check_fp8_scales(fmt, k_scale, v_scale, k_scale_cache, k_cache.dtype, q.device)
    _check_num_splits(num_splits)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                      cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, out=out,
                      alibi_slopes=alibi_slopes, sinks=sinks, k_scale=scales[0],
                      v_scale=scales[1], k_scale_cache=k_scale_cache, k_smooth=k_smooth)
    return out, lse, opts, fmt, scales, M * page
