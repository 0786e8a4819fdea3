"""The general MHA/GQA layer over a paged KV cache: PagedAttentionImpl.

    impl = PagedAttentionImpl(num_heads, head_size, scale, num_kv_heads, sliding_window=4096,
                              kv_cache_dtype="fp8")
    impl.set_kv_scales(k_scale, v_scale)                                   # fp8 cache, at load
    impl.load_v_scale("v_scales.safetensors", "layers.3.attn")             # int8_qkv, at load
    plan = impl.build_plan(query_start_loc, seq_lens, block_table, slot_mapping,
                           max_query_len=..., block_size=16, query_lens_cpu=...)  # once per step
    out = impl.forward(query, key, value, kv_cache, plan)                  # per layer

Semantics are vLLM's FlashAttention backend (DESIGN.md, General MHA path): forward writes the new
keys and values into the cache (`quant.write_kv_cache`), then attends with
`kernels.paged_attention` (causal, bottom-right aligned). Encoder attention ("encoder",
"encoder_only") is non-causal over the step's own keys and values, with no cache.

int8 caches (kv_cache_dtype "int8_qkv" / "int8_qk", DESIGN.md): the cache is the triple
(k_cache int8, v_cache int8 or the model's dtype, k_scale_cache [num_blocks, H_kv, block_size]
fp32); the writer quantizes K per (token, head) into it, and int8_qkv's static per-channel V scale
[H_kv, D] is set once (`set_v_scale`, `load_v_scale` from safetensors, or `calibrate_v_scale`).
Optional K smoothing for outlier channels: `set_k_smooth` (`quant.int8.calibrate_k_smooth`).

The per-step plan (decode/prefill split, cascade, local attention) is `mla.attention_plan`; its
names are re-exported here. forward never reads the device.

Decode context parallelism (dcp=, mla/cp.py; vLLM's FlashAttention DCP scheme): the rank's cache
holds its share of every request's tokens (the plan's slot mapping is the rank's). forward writes
the step's local tokens, attends the group's queries (gathered, for "sharded" heads) to the rank's
context tokens without a causal mask, merges the ranks' partials (ContextParallel.merge), attends
the new tokens causally to the step's own keys and values (identical on every rank, so the sink
joins this part, once), and merges the two. The new tokens' keys are read from key/value as
given, not from the (possibly quantized) cache.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from openmla.kernels.cascade import cascade_attention
from openmla.kernels.merge import merge_attn_states
from openmla.kernels.paged_attention import paged_attention, varlen_attention
from openmla.mla.cp import ContextParallel
from openmla.mla.mha.plan import (AttentionPlan, AttentionSubPlan, CascadePlan, _int_arg,
                                build_attention_plan)
from openmla.quant.format_types import MHA
from openmla.quant.formats import cache_format
from openmla.quant.validate import check_quant_scale, check_tensor, fail
from openmla.quant.int8 import calibrate_v_scale, load_v_scales
from openmla.quant.kv_cache import write_kv_cache

__all__ = ["AttentionPlan", "AttentionSubPlan", "CascadePlan", "PagedAttentionImpl",
           "build_attention_plan", "ATTN_TYPES"]

ATTN_TYPES = ("decoder", "encoder", "encoder_only")
_Q_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_SIZE = 256


def _scale_tensor(name: str, s) -> torch.Tensor:
    """An fp8 per-tensor scale as a [1] fp32 tensor. A host value (a number or a CPU tensor) must
    be finite and > 0 (quant.validate.check_quant_scale); a device tensor is taken as it is:
    reading it would be a host sync, and vLLM's adapter sets its layer's device scales on every
    forward, decode included."""
    if isinstance(s, torch.Tensor):
        if s.numel() != 1:
            fail(f"{name}.numel()", 1, s.numel())
        s = s.detach().reshape(1).float()
        if s.device.type == "cpu":
            check_quant_scale(name, s)
    else:
        s = torch.tensor([check_quant_scale(name, s)], dtype=torch.float32)
    return s


class PagedAttentionImpl:
    """One MHA/GQA attention layer over a paged KV cache (per tensor-parallel rank), no vLLM.

    Args:
        num_heads: H, query heads. head_size: D, 1..256 (multiples of 8 are the fast case).
        scale: softmax scale applied to q.k.
        num_kv_heads: H_kv, a divisor of H (query head h reads KV head h // (H / H_kv)).
        sliding_window: w tokens (None: unbounded). As vLLM: (w - 1, 0) for decoder and
            "encoder" attention, (w - 1, w - 1) for "encoder_only".
        softcap: logits soft cap c (None or 0: off): s = c * tanh(s / c).
        alibi_slopes: [H] floats (list or tensor), or None.
        sinks: [H] tensor (any float dtype; read at every forward, so a parameter loaded after
            construction is seen), or None.
        kv_cache_dtype: the cache format, by name or as a quant descriptor (resolved once, by
            quant.cache_format, and kept as `cache_format`): "auto" (the model's dtype),
            "bfloat16"/"bf16", "float16"/"fp16", or "fp8"/"fp8_e4m3" (float8_e4m3fn with
            per-tensor scales `k_scale`, `v_scale`, default 1.0; set them with `set_kv_scales`),
            or "int8_qkv" / "int8_qk" (int8 K with per-token-head scales, V int8 with a static
            per-channel scale / V in the model's dtype; head_size a multiple of 8). Others raise
            NotImplementedError.
        attn_type: "decoder" (causal, paged cache), "encoder" or "encoder_only" (non-causal over
            the step's own keys and values, no cache; fp8 kv_cache_dtype is not supported there,
            as in vLLM). "encoder_decoder" (cross-attention) raises NotImplementedError.
        dcp: this rank's ContextParallel (mla/cp.py), or None; decoder attention without ALiBi
            or a sliding window only (NotImplementedError otherwise). build_plan passes it on.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, *,
                 sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                 alibi_slopes=None, sinks: Optional[torch.Tensor] = None,
                 kv_cache_dtype="auto", attn_type: str = "decoder",
                 dcp: Optional[ContextParallel] = None):
        for name, val in (("num_heads", num_heads), ("head_size", head_size),
                          ("num_kv_heads", num_kv_heads)):
            _int_arg(name, val, 1)
        if num_heads % num_kv_heads:
            fail("num_kv_heads", f"a divisor of num_heads = {num_heads}", num_kv_heads)
        if head_size > MAX_HEAD_SIZE:
            raise NotImplementedError(f"PagedAttentionImpl: head_size {head_size} > "
                                      f"{MAX_HEAD_SIZE} (the kernel's limit)")
        if (isinstance(scale, bool) or not isinstance(scale, (int, float))
                or not math.isfinite(scale)):
            fail("scale", "a finite float", repr(scale))
        fmt = cache_format(kv_cache_dtype, MHA, who="PagedAttentionImpl")
        if attn_type == "encoder_decoder":
            raise NotImplementedError("PagedAttentionImpl: attn_type 'encoder_decoder' "
                                      "(cross-attention) is not supported")
        if attn_type not in ATTN_TYPES:
            fail("attn_type", f"one of {ATTN_TYPES}", repr(attn_type))
        if fmt.k_int8 and head_size % 8:
            raise NotImplementedError(f"PagedAttentionImpl: kv_cache_dtype {fmt.name!r} "
                                      f"with head_size {head_size} (int8: multiples of 8)")
        if attn_type != "decoder" and fmt.quantized:
            raise NotImplementedError(f"PagedAttentionImpl: kv_cache_dtype {fmt.name!r} "
                                      f"with attn_type {attn_type!r} (as vLLM: no quantization "
                                      "for encoder attention)")
        if sliding_window is None:
            window = (-1, -1)
        else:
            _int_arg("sliding_window", sliding_window, 1)
            right = sliding_window - 1 if attn_type == "encoder_only" else 0
            window = (sliding_window - 1, right)
        if softcap is None:
            softcap = 0.0
        if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
            fail("softcap", "None or a finite float >= 0", repr(softcap))
        if alibi_slopes is not None:
            alibi_slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32).detach()
            check_tensor("alibi_slopes", alibi_slopes, shape=(num_heads,))
            alibi_slopes = alibi_slopes.contiguous()
        if sinks is not None:
            check_tensor("sinks", sinks, shape=(num_heads,))
        if dcp is not None:
            if not isinstance(dcp, ContextParallel):
                fail("dcp", "None or an openmla.mla.cp.ContextParallel", type(dcp).__name__)
            which = [n for n, on in (("ALiBi", alibi_slopes is not None),
                                     ("a sliding window", sliding_window is not None),
                                     (f"attn_type {attn_type!r}", attn_type != "decoder")) if on]
            if which:
                raise NotImplementedError(f"PagedAttentionImpl: DCP with {' and '.join(which)}")
        self.dcp = dcp
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = window
        self.softcap = float(softcap)
        self.alibi_slopes = alibi_slopes
        self.sinks = sinks
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_format = fmt
        self.attn_type = attn_type
        self.k_scale = torch.ones(1, dtype=torch.float32)
        self.v_scale = torch.ones(1, dtype=torch.float32)
        self.int8_v_scale: Optional[torch.Tensor] = None  # int8_qkv: [H_kv, D] fp32
        self.k_smooth: Optional[torch.Tensor] = None  # int8 K smoothing factors [H_kv, D] fp32

    # ------------------------------------------------------------------ load time
    def set_kv_scales(self, k_scale, v_scale) -> None:
        """Per-tensor fp8 dequantization scales (floats or 1-element tensors): the cache holds
        e4m3fn(rne(x / scale)). Only meaningful for an fp8 kv_cache_dtype. Numbers and CPU
        tensors must be finite and > 0 (ValueError naming the scale); a device tensor is used as
        it is, unread (no host sync: this runs on every forward under vLLM), so check a device
        scale where it is made (write_kv_cache with check_slots does, in its one host read)."""
        k, v = _scale_tensor("k_scale", k_scale), _scale_tensor("v_scale", v_scale)  # both, or neither
        self.k_scale, self.v_scale = k, v

    def set_v_scale(self, v_scale: torch.Tensor) -> None:
        """int8_qkv: the static per-channel V scale [H_kv, D] fp32 (v_int8 = rne(v / scale))."""
        if not self.cache_format.v_int8:
            fail("kv_cache_dtype", "'int8_qkv' for a per-channel V scale", self.cache_format.name)
        check_tensor("v_scale", v_scale, dtype=torch.float32,
                     shape=(self.num_kv_heads, self.head_size))
        if not bool(torch.isfinite(v_scale).all() and (v_scale > 0).all()):  # load time: a sync is fine
            fail("v_scale", "positive finite values", "a zero, negative or non-finite entry")
        self.int8_v_scale = v_scale.detach().contiguous()

    def set_k_smooth(self, k_smooth: Optional[torch.Tensor]) -> None:
        """int8 caches: per-channel K smoothing factors [H_kv, D] fp32 (positive, finite; from
        `quant.int8.calibrate_k_smooth`), or None (off). Set before the cache is first written:
        the cache holds K / k_smooth and attention multiplies q by it."""
        if not self.cache_format.k_int8:
            fail("kv_cache_dtype", "'int8_qkv' or 'int8_qk' for K smoothing", self.cache_format.name)
        if k_smooth is not None:
            check_tensor("k_smooth", k_smooth, dtype=torch.float32,
                         shape=(self.num_kv_heads, self.head_size))
            if not bool(torch.isfinite(k_smooth).all() and (k_smooth > 0).all()):  # load time
                fail("k_smooth", "positive finite values", "a zero, negative or non-finite entry")
            k_smooth = k_smooth.detach().contiguous()
        self.k_smooth = k_smooth

    def load_v_scale(self, path, layer_name: str) -> None:
        """int8_qkv: this layer's V scale from a `quant.int8.save_v_scales` file (shape checked)."""
        want = (self.num_kv_heads, self.head_size)
        scales = load_v_scales(path, expect_shapes={layer_name: want})
        if layer_name not in scales:
            fail(f"{path} [{layer_name!r}]", f"a {list(want)} V scale", "no such entry")
        self.set_v_scale(scales[layer_name])

    def calibrate_v_scale(self, samples, *, percentile: Optional[float] = None) -> torch.Tensor:
        """int8_qkv: set (and return) the V scale calibrated from observed values [T_i, H_kv, D]
        (`quant.int8.calibrate_v_scale`: abs-max, or a percentile)."""
        self.set_v_scale(calibrate_v_scale(samples, percentile=percentile))
        return self.int8_v_scale

    # ------------------------------------------------------------------ per step
    def build_plan(self, query_start_loc, seq_lens, block_table, slot_mapping, *,
                   max_query_len: int, block_size: int, **kwargs) -> AttentionPlan:
        """build_attention_plan with this layer's heads, ALiBi and sliding window."""
        return build_attention_plan(
            query_start_loc, seq_lens, block_table, slot_mapping, max_query_len=max_query_len,
            block_size=block_size, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            use_alibi=self.alibi_slopes is not None,
            use_sliding_window=self.sliding_window != (-1, -1), dcp=self.dcp, **kwargs)

    # ------------------------------------------------------------------ per layer
    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor],
                value: Optional[torch.Tensor], kv_cache, plan: AttentionPlan,
                output: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write this step's keys and values into the cache, then attend.

        Args:
            query: [T, H, D] bf16/fp16, last dim contiguous (any token/head strides).
            key, value: [T, H_kv, D] (or more rows: only the first T are written), or both None
                to skip the cache write (a layer sharing another layer's cache). Encoder
                attention needs them: they are its keys.
            kv_cache: (k_cache, v_cache), each [num_blocks, block_size, H_kv, D], or one
                [2, num_blocks, block_size, H_kv, D] tensor (vLLM's); the model's dtype, or
                float8_e4m3fn (uint8 storage is viewed as such) for fp8. Any strides with the
                last dim contiguous (an HND memory layout is a permuted view: pass it as is).
                int8: (k_cache int8, v_cache int8 (int8_qkv) or the model's dtype (int8_qk),
                k_scale_cache [num_blocks, H_kv, block_size] fp32).
                Ignored (may be None) for encoder attention.
            plan: this step's plan, checked against the shapes here.
            output: optional [T, H, D] in query's dtype (last dim contiguous) to write into.

        Returns output [T, H, D]: padding rows (past the plan's last request) are 0.
        """
        io_ok = self._io_ok(query, key, value, plan, output)
        if not io_ok:
            self._check_io(query, key, value, output)
        T = query.shape[0]
        if output is None:
            output = torch.empty(T, self.num_heads, self.head_size, dtype=query.dtype,
                                 device=query.device)
        if self.attn_type != "decoder":
            return self._forward_encoder(query, key, value, plan, output)

        k_cache, v_cache, k_scale_cache = self._split_cache(kv_cache, query.dtype)
        if not (io_ok and k_cache.shape[1] == plan.block_size
                and k_cache.shape[2] == plan.num_kv_heads and k_cache.device == plan.device):
            plan.check_matches(query, k_cache)
        k_scale = v_scale = None
        if self.cache_format.fp8_per_tensor:
            k_scale, v_scale = self._scales(query.device)
        elif self.cache_format.v_int8:
            v_scale = self._int8_v_scale(query.device)
        k_smooth = None
        if self.k_smooth is not None:
            if self.k_smooth.device != query.device:  # moved once, then reused
                self.k_smooth = self.k_smooth.to(query.device)
            k_smooth = self.k_smooth
        if key is not None:
            n = plan.slot_mapping.shape[0]
            if key.shape[0] < n:
                fail("key.shape[0]", f">= {n} (the plan's slot_mapping)", key.shape[0])
            if key.shape[0] > n or value.shape[0] > n:
                key, value = key[:n], value[:n]
            # check_slots=False: no host read; out-of-range slots are skipped in the kernel.
            write_kv_cache(key, value, k_cache, v_cache, plan.slot_mapping,
                           k_scale=k_scale, v_scale=v_scale, check_slots=False,
                           k_scale_cache=k_scale_cache, k_smooth=k_smooth, fmt=self.cache_format)
        if T == 0:
            return output
        sinks = self._sinks(query.device)
        if plan.dcp is not None:
            return self._forward_dcp(query, key, value, k_cache, v_cache, k_scale_cache, k_scale,
                                     v_scale, k_smooth, sinks, plan, output)
        if plan.cascade is not None:
            if self.alibi_slopes is not None or self.sliding_window != (-1, -1):
                raise NotImplementedError("PagedAttentionImpl: a cascade plan with ALiBi or a "
                                          "sliding window (build the plan with impl.build_plan)")
            c = plan.cascade
            cascade_attention(query, k_cache, v_cache, c.block_table, c.cu_seqlens_q, c.seq_lens,
                              common_prefix_len=c.common_prefix_len, scale=self.scale,
                              softcap=self.softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                              k_scale_cache=k_scale_cache, k_smooth=k_smooth, fmt=self.cache_format, out=output,
                              max_query_len=c.max_query_len,
                              prefix_cu_seqlens_q=c.prefix_cu_seqlens_q,
                              prefix_seq_lens=c.prefix_seq_lens, suffix_seq_lens=c.suffix_seq_lens)
            return output
        alibi = self._alibi(query.device)
        for sub in (plan.decode, plan.prefill):
            if sub is None or sub.token_end == sub.token_start:
                continue
            t0, t1 = sub.token_start, sub.token_end
            q, o = (query, output) if t1 - t0 == T else (query[t0:t1], output[t0:t1])
            paged_attention(q, k_cache, v_cache, sub.block_table, sub.cu_seqlens_q,
                            sub.seq_lens, scale=self.scale, causal=True,
                            window=self.sliding_window, softcap=self.softcap, alibi_slopes=alibi,
                            sinks=sinks, k_scale=k_scale, v_scale=v_scale, out=o,
                            max_query_len=sub.max_query_len, k_scale_cache=k_scale_cache,
                            k_smooth=k_smooth, fmt=self.cache_format)
        return output

    def _forward_dcp(self, query, key, value, k_cache, v_cache, k_scale_cache, k_scale, v_scale,
                     k_smooth, sinks, plan, output):
        """DCP attention (module docstring): context over the ranks' caches, merged, then
        merged with the new tokens' causal attention over their own keys."""
        cp, T, H, D = plan.dcp, query.shape[0], self.num_heads, self.head_size
        if self.dcp is None or (cp.world_size, cp.rank) != (self.dcp.world_size, self.dcp.rank):
            fail("plan.dcp", "this layer's dcp (build the plan with impl.build_plan)", cp)
        if key is None:
            raise NotImplementedError("PagedAttentionImpl: DCP without the step's keys and values "
                                      "(a layer sharing another layer's cache)")
        qa = cp.gather_heads(query, self.num_kv_heads)
        part, lse = paged_attention(
            qa, k_cache, v_cache, plan.block_table, plan.query_start_loc, plan.dcp_context_lens,
            scale=self.scale, causal=False, softcap=self.softcap, k_scale=k_scale, v_scale=v_scale,
            return_lse=True, max_query_len=plan.max_query_len, k_scale_cache=k_scale_cache,
            k_smooth=k_smooth, fmt=self.cache_format)
        ctx, ctx_lse = cp.merge(part, lse, num_kv_heads=self.num_kv_heads)
        new = torch.empty(T, H, D, dtype=query.dtype, device=query.device)
        cu = plan.query_start_loc
        _, new_lse = varlen_attention(query, key[:T], value[:T], cu, cu, scale=self.scale,
                                      causal=True, softcap=self.softcap, sinks=sinks, out=new,
                                      return_lse=True, max_query_len=plan.max_query_len,
                                      max_kv_len=plan.max_query_len)
        merge_attn_states(output, ctx, ctx_lse, new, new_lse)
        return output

    # ------------------------------------------------------------------ helpers
    def _io_ok(self, query, key, value, plan, output) -> bool:
        """forward's checks of query, output, key and value against this layer and the plan
        (`_check_io` and plan.check_matches, which name what is wrong) as one expression of
        attribute reads, for the call that passes them all."""
        T, H, H_kv, D, dev = plan.num_tokens, self.num_heads, self.num_kv_heads, self.head_size, plan.device
        shape = (T, H, D)
        return (isinstance(query, torch.Tensor) and query.dtype in _Q_DTYPES and query.shape == shape
                and (D == 1 or query.stride(2) == 1) and query.device == dev
                and plan.num_heads == H
                and (output is None or (isinstance(output, torch.Tensor) and output.dtype == query.dtype
                                        and output.shape == shape and (D == 1 or output.stride(2) == 1)))
                and ((key is None and value is None)
                     or (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
                         and key.dim() == 3 and key.shape[1:] == (H_kv, D)
                         and value.dim() == 3 and value.shape[1:] == (H_kv, D))))

    def _check_io(self, query, key, value, output) -> None:
        """ValueError naming the first of query, output, key, value that is not what forward
        takes."""
        H, D = self.num_heads, self.head_size
        check_tensor("query", query, dtype=_Q_DTYPES, shape=(None, H, D), last_dim_contiguous=True)
        if output is not None:
            check_tensor("output", output, dtype=query.dtype, shape=(query.shape[0], H, D),
                         last_dim_contiguous=True)
        if (key is None) != (value is None):
            fail("key, value", "both tensors or both None", f"key {type(key).__name__}, value "
                 f"{type(value).__name__}")
        if key is not None:
            check_tensor("key", key, shape=(None, self.num_kv_heads, D))
            check_tensor("value", value, shape=(None, self.num_kv_heads, D))

    def _forward_encoder(self, query, key, value, plan, output):
        """Non-causal attention of each request over its own new keys (no cache)."""
        if key is None:
            fail("key", "a [T, H_kv, D] tensor (encoder attention attends to the step's keys)",
                 None)
        plan.check_matches(query)
        check_tensor("key", key, dtype=query.dtype, shape=(query.shape[0], None, None))
        cu = plan.query_start_loc
        varlen_attention(query, key, value, cu, cu, scale=self.scale, causal=False,
                         window=self.sliding_window, softcap=self.softcap,
                         alibi_slopes=self._alibi(query.device), sinks=self._sinks(query.device),
                         out=output, max_query_len=plan.max_query_len,
                         max_kv_len=plan.max_query_len)
        return output

    def _split_cache(self, kv_cache, q_dtype):
        """(k_cache, v_cache, k_scale_cache or None) of the layer's cache argument."""
        fmt = self.cache_format
        if fmt.k_int8:
            if not (isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 3):
                fail("kv_cache", f"(k_cache, v_cache, k_scale_cache) for {fmt.name}",
                     type(kv_cache).__name__ + (f" of {len(kv_cache)}"
                                                if isinstance(kv_cache, (tuple, list)) else ""))
            k_cache, v_cache, k_scale_cache = kv_cache
            shape = (None, None, self.num_kv_heads, self.head_size)
            check_tensor("k_cache", k_cache, dtype=fmt.k_cache_dtype(q_dtype), shape=shape,
                         last_dim_contiguous=True)
            check_tensor("v_cache", v_cache, dtype=fmt.v_cache_dtype(q_dtype), shape=shape,
                         last_dim_contiguous=True)
            return k_cache, v_cache, k_scale_cache  # the kernels check k_scale_cache
        want = fmt.k_cache_dtype(q_dtype)  # K and V alike
        tail = (self.num_kv_heads, self.head_size)
        if isinstance(kv_cache, torch.Tensor):
            if kv_cache.dim() != 5:
                check_tensor("kv_cache", kv_cache, ndim=5)  # raises, naming it
            if kv_cache.shape[0] != 2:
                fail("kv_cache.shape[0]", "2 (keys, values)", tuple(kv_cache.shape))
            k_cache, v_cache = kv_cache.unbind(0)
            if (kv_cache.dtype == want and kv_cache.shape[3:] == tail
                    and (tail[1] == 1 or kv_cache.stride(4) == 1)):
                return k_cache, v_cache, None  # both halves pass the checks below
        elif isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
            k_cache, v_cache = kv_cache
        else:
            fail("kv_cache", "(k_cache, v_cache) or a [2, num_blocks, block_size, H_kv, D] tensor",
                 type(kv_cache).__name__)
        if (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
                and k_cache.dtype == want and v_cache.dtype == want and k_cache.dim() == 4
                and v_cache.dim() == 4 and k_cache.shape[2:] == tail and v_cache.shape[2:] == tail
                and (tail[1] == 1 or (k_cache.stride(3) == 1 and v_cache.stride(3) == 1))):
            return k_cache, v_cache, None  # the checks below, passed (one expression)
        caches = []
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if fmt.fp8_per_tensor and isinstance(c, torch.Tensor) and c.dtype == torch.uint8:
                c = c.view(torch.float8_e4m3fn)  # vLLM stores fp8 caches as uint8
            check_tensor(name, c, dtype=want, shape=(None, None, self.num_kv_heads,
                                                     self.head_size), last_dim_contiguous=True)
            caches.append(c)
        return caches[0], caches[1], None

    def _scales(self, device):
        if self.k_scale.device != device:  # moved once, then reused
            self.k_scale = self.k_scale.to(device)
        if self.v_scale.device != device:
            self.v_scale = self.v_scale.to(device)
        return self.k_scale, self.v_scale

    def _int8_v_scale(self, device):
        if self.int8_v_scale is None:
            fail("v_scale (int8_qkv)", "set before forward: set_v_scale, load_v_scale or "
                 "calibrate_v_scale", None)
        if self.int8_v_scale.device != device:  # moved once, then reused
            self.int8_v_scale = self.int8_v_scale.to(device)
        return self.int8_v_scale

    def _alibi(self, device):
        if self.alibi_slopes is not None and self.alibi_slopes.device != device:
            self.alibi_slopes = self.alibi_slopes.to(device)
        return self.alibi_slopes

    def _sinks(self, device):
        s = self.sinks
        if s is None:
            return None
        if s.device != device:
            fail("sinks.device", device, s.device)
        if s.dtype != torch.float32 or not s.is_contiguous():
            s = s.detach().float().contiguous()
        return s
