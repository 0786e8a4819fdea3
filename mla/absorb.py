"""MLA weight absorption: split `kv_b_proj` into W_UK / W_UV and fold them into the projections.

One place for the maths that `tools/absorb.py` (offline, on a checkpoint) and an impl's
`load_kv_b_proj(weight, weight_scale_inv=None)` (at load time) share. Names follow DeepSeek's
Hugging Face checkpoints; per layer (H = num_attention_heads, n = qk_nope_head_dim,
r = qk_rope_head_dim, v = v_head_dim, L = kv_lora_rank):

    kv_b_proj.weight  [H*(n+v), L]    rows per head: n rows of W_UK[h] | v rows of W_UV[h]^T
    q_b_proj.weight   [H*(n+r), q_lora_rank]  rows per head: n "nope" rows | r rope rows
                      (DeepSeek-V2(-Lite) with q_lora_rank null: q_proj.weight [H*(n+r), hidden])
    o_proj.weight     [hidden, H*v]

    W_UK [H, n, L]   k_nope_h = W_UK[h] c          (c: the kv_lora_rank latent of a token)
    W_UV [H, L, v]   v_h      = W_UV[h]^T c

Absorbed (MQA) form: q_lat_h = W_UK[h]^T q_nope_h, so q_lat_h . c = q_nope_h . k_nope_h; the
attention runs over rows [c | k_pe] of width L + r with the latent as the value, and the
latent output o_lat_h becomes v-space as W_UV[h]^T o_lat_h. Folding puts both into the weights:

    q_b_proj'  [H*(L+r), q_in]  rows per head: W_UK[h]^T Wq_nope[h] (L rows) | Wq_rope[h] (r rows)
    o_proj'    [hidden, H*L]    columns of head h: Wo[:, h*v:(h+1)*v] W_UV[h]^T

RoPE touches only the r rope rows of each head, so it is applied to the folded query exactly as
to the original (at the new per-head stride L + r).

fp8 e4m3 weights carry `weight_scale_inv` [ceil(rows/128), ceil(cols/128)] fp32 (the block
shape is the checkpoint's `quantization_config.weight_block_size`) and dequantize as
`w.float() * scale_inv[i // 128, j // 128]`, edge blocks ragged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from openmla.kernels.reference import sparse_mla_ref
from openmla.quant.validate import check_tensor, fail

__all__ = [
    "FP8_WEIGHT_BLOCK",
    "MLAWeightDims",
    "scale_inv_shape",
    "dequantize_fp8_blocks",
    "quantize_fp8_blocks",
    "weight_to_fp32",
    "split_kv_b_proj",
    "fold_q_proj",
    "fold_o_proj",
    "attention_unabsorbed",
    "layer_output_unabsorbed",
    "layer_output_split",
    "layer_output_folded",
]

FP8_WEIGHT_BLOCK = (128, 128)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INTS = (torch.int32, torch.int64)


@dataclass(frozen=True)
class MLAWeightDims:
    """The dimensions of one MLA attention layer's weights, as a DeepSeek config.json names them.

    q_lora_rank None means the query comes from `q_proj` on the hidden state (DeepSeek-V2-Lite).
    """

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    q_lora_rank: Optional[int]
    hidden_size: int

    @classmethod
    def from_config(cls, config: dict) -> "MLAWeightDims":
        """Read the dimensions from a config.json dict; ValueError naming a missing or bad key."""
        def get(key, optional=False):
            if key not in config:
                fail(f"config[{key!r}]", "present", "missing")
            val = config[key]
            if val is None and optional:
                return None
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                text = repr(val)  # cut: a wrong value may be a huge list
                fail(f"config[{key!r}]", "a positive int" + (" or null" if optional else ""),
                     text if len(text) <= 80 else text[:80] + "...")
            return val

        q_lora = get("q_lora_rank", optional=True) if "q_lora_rank" in config else None
        return cls(get("num_attention_heads"), get("qk_nope_head_dim"), get("qk_rope_head_dim"),
                   get("v_head_dim"), get("kv_lora_rank"), q_lora, get("hidden_size"))

    @property
    def q_in(self) -> int:
        """Input width of the query projection: q_lora_rank, or hidden_size for q_proj."""
        return self.q_lora_rank if self.q_lora_rank is not None else self.hidden_size

    @property
    def softmax_scale(self) -> float:
        """DeepSeek's base softmax scale (qk_nope + qk_rope)^-0.5 (before any YaRN mscale)."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def shapes(self) -> dict:
        """Expected weight shapes, original and absorbed, keyed by role."""
        H, n, r, v, L = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim,
                         self.v_head_dim, self.kv_lora_rank)
        return {
            "kv_b": (H * (n + v), L),
            "q": (H * (n + r), self.q_in),
            "o": (self.hidden_size, H * v),
            "w_uk": (H, n, L),
            "w_uv": (H, L, v),
            "q_folded": (H * (L + r), self.q_in),
            "o_folded": (self.hidden_size, H * L),
        }


def scale_inv_shape(weight_shape: Sequence[int], block=FP8_WEIGHT_BLOCK) -> tuple:
    """[ceil(rows / block[0]), ceil(cols / block[1])]: one scale per block, ragged edges included."""
    return (math.ceil(weight_shape[0] / block[0]), math.ceil(weight_shape[1] / block[1]))


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                          block=FP8_WEIGHT_BLOCK) -> torch.Tensor:
    """Dequantize a block-scaled fp8 weight exactly as DeepSeek does.

    Args:
        weight: [R, C] float8_e4m3fn.
        scale_inv: [ceil(R / block[0]), ceil(C / block[1])] float (fp32 in DeepSeek checkpoints);
            despite the name it multiplies: block (i, j) covers rows i*b0 .. min(R, (i+1)*b0)
            and columns j*b1 .. min(C, (j+1)*b1), so the last row/column blocks may be ragged.
        block: (b0, b1), the checkpoint's weight_block_size.

    Returns [R, C] fp32: w.float() * scale_inv[i // b0, j // b1].
    """
    check_tensor("weight", weight, dtype=torch.float8_e4m3fn, ndim=2)
    R, C = weight.shape
    check_tensor("weight_scale_inv", scale_inv, dtype=_SCALE_DTYPES,
                 shape=scale_inv_shape((R, C), block), device=weight.device)
    out = torch.empty(R, C, dtype=torch.float32, device=weight.device)
    # One row block at a time, so that no full-size scale map is ever materialized.
    for i in range(0, R, block[0]):
        s = scale_inv[i // block[0]].float().repeat_interleave(block[1])[:C]
        torch.mul(weight[i:i + block[0]].float(), s, out=out[i:i + block[0]])
    return out


def quantize_fp8_blocks(weight: torch.Tensor, block=FP8_WEIGHT_BLOCK):
    """Block-quantize a weight the way DeepSeek's fp8 checkpoints are (the inverse of
    dequantize_fp8_blocks; used to build test and demo checkpoints).

    Args:
        weight: [R, C] float.
        block: (b0, b1).

    Returns (float8_e4m3fn [R, C], scale_inv fp32 [ceil(R/b0), ceil(C/b1)]) with
    scale_inv = amax(|block|) / 448 (at least 1e-12) and fp8 = e4m3fn(w / scale_inv).
    """
    check_tensor("weight", weight, dtype=_WEIGHT_DTYPES, ndim=2)
    R, C = weight.shape
    sr, sc = scale_inv_shape((R, C), block)
    amax = weight.new_zeros(sr * block[0], sc * block[1], dtype=torch.float32)
    amax[:R, :C] = weight.float().abs()
    scale = (amax.view(sr, block[0], sc, block[1]).amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
    s = scale.repeat_interleave(block[0], 0)[:R].repeat_interleave(block[1], 1)[:, :C]
    return (weight.float() / s).to(torch.float8_e4m3fn), scale


def weight_to_fp32(weight: torch.Tensor, scale_inv: Optional[torch.Tensor] = None,
                   block=FP8_WEIGHT_BLOCK) -> torch.Tensor:
    """A linear weight [R, C] as fp32: fp8 e4m3 needs its scale_inv (dequantized), floats don't."""
    if weight.dtype == torch.float8_e4m3fn:
        if scale_inv is None:
            fail("weight_scale_inv", "a block scale tensor for a float8_e4m3fn weight", None)
        return dequantize_fp8_blocks(weight, scale_inv, block)
    check_tensor("weight", weight, dtype=_WEIGHT_DTYPES + (torch.float8_e4m3fn,), ndim=2)
    if scale_inv is not None:
        fail("weight_scale_inv", f"None for a {weight.dtype} weight (scales go with fp8)",
             f"a tensor of shape {tuple(scale_inv.shape)}")
    return weight.float()


def split_kv_b_proj(weight: torch.Tensor, weight_scale_inv: Optional[torch.Tensor] = None, *,
                    num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                    block=FP8_WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Split kv_b_proj into the per-head up-projections.

    Args:
        weight: [H*(n+v), L] bf16/fp16/fp32, or float8_e4m3fn with weight_scale_inv; rows grouped
            per head as [n rows of W_UK[h] | v rows of W_UV[h]^T].
        weight_scale_inv: [ceil(H*(n+v)/b0), ceil(L/b1)] for an fp8 weight, else None.
        num_heads (H), qk_nope_head_dim (n), v_head_dim (v): from the model config.
        block: the fp8 block shape (b0, b1).

    Returns (fp32, contiguous):
        W_UK: [H, n, L], k_nope of head h = W_UK[h] @ c.
        W_UV: [H, L, v], v of head h = W_UV[h]^T @ c.
    """
    w = weight_to_fp32(weight, weight_scale_inv, block)
    H, n, v = num_heads, qk_nope_head_dim, v_head_dim
    check_tensor("kv_b_proj.weight", w, shape=(H * (n + v), None))
    w = w.view(H, n + v, w.shape[1])
    return w[:, :n].contiguous(), w[:, n:].transpose(1, 2).contiguous()


# Folded outputs are produced a few heads at a time straight into the output dtype, so the peak
# is the output plus one chunk (DeepSeek-V3's folded o_proj is 470M elements).
_FOLD_CHUNK_ELEMS = 1 << 25


def fold_q_proj(wq: torch.Tensor, w_uk: torch.Tensor, *, qk_rope_head_dim: int,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fold W_UK into the query projection so the query comes out absorbed.

    Args:
        wq: [H*(n+r), q_in] fp32 (dequantized q_b_proj, or q_proj), rows per head [n nope | r rope].
        w_uk: [H, n, L] fp32.
        qk_rope_head_dim: r.
        out_dtype: dtype of the result (each element computed in fp32, rounded once).

    Returns [H*(L+r), q_in], rows per head [W_UK[h]^T Wq_nope[h] (L rows) | Wq_rope[h] (r)].
    """
    check_tensor("w_uk", w_uk, dtype=torch.float32, ndim=3)
    H, n, L = w_uk.shape
    r = qk_rope_head_dim
    check_tensor("wq", wq, dtype=torch.float32, shape=(H * (n + r), None), device=w_uk.device)
    q_in = wq.shape[1]
    wq = wq.view(H, n + r, q_in)
    out = torch.empty(H, L + r, q_in, dtype=out_dtype, device=wq.device)
    step = max(1, _FOLD_CHUNK_ELEMS // (L * q_in))
    for h in range(0, H, step):
        out[h:h + step, :L] = torch.einsum("hnl,hni->hli", w_uk[h:h + step], wq[h:h + step, :n])
    out[:, L:] = wq[:, n:]
    return out.view(H * (L + r), q_in)


def fold_o_proj(wo: torch.Tensor, w_uv: torch.Tensor, *,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fold W_UV into the output projection so it takes the latent attention output.

    Args:
        wo: [hidden, H*v] fp32 (dequantized o_proj).
        w_uv: [H, L, v] fp32.
        out_dtype: dtype of the result (each element computed in fp32, rounded once).

    Returns [hidden, H*L] = wo @ blockdiag(W_UV[0]^T, ..., W_UV[H-1]^T).
    """
    check_tensor("w_uv", w_uv, dtype=torch.float32, ndim=3)
    H, L, v = w_uv.shape
    check_tensor("wo", wo, dtype=torch.float32, shape=(None, H * v), device=w_uv.device)
    hidden = wo.shape[0]
    wo = wo.view(hidden, H, v)
    out = torch.empty(hidden, H, L, dtype=out_dtype, device=wo.device)
    step = max(1, _FOLD_CHUNK_ELEMS // (hidden * L))
    for h in range(0, H, step):
        out[:, h:h + step] = torch.einsum("dhv,hlv->dhl", wo[:, h:h + step], w_uv[h:h + step])
    return out.view(hidden, H * L)


# ---------------------------------------------------------------------------------------------
# One attention layer, three ways (verification of what was absorbed), all in float64. RoPE is
# left out: it acts on q_pe and k_pe identically in every form, so random q_pe/k_pe stand for
# rotated ones.
# ---------------------------------------------------------------------------------------------

def attention_unabsorbed(q, k_nope, k_pe, v, indices, *, scale):
    """Per-head (MHA form) sparse attention, from the maths, in float64.

    Args:
        q: [T, H, n + r] float (nope | rope). k_nope: [N, H, n]. k_pe: [N, r] (shared by heads).
        v: [N, H, v_dim]. indices: [T, K] int, invalid = < 0 or >= N (skipped, never read); a
            row listed twice counts twice. scale: softmax scale over the n + r dims.

    Returns [T, H, v_dim] float64; 0 for a token without a valid index.
    """
    check_tensor("q", q, ndim=3)
    T, H, _ = q.shape
    check_tensor("k_nope", k_nope, ndim=3)
    N, _, n = k_nope.shape
    check_tensor("k_pe", k_pe, shape=(N, q.shape[2] - n))
    check_tensor("v", v, shape=(N, H, None))
    check_tensor("indices", indices, dtype=_INTS, shape=(T, None))
    idx = indices.long()
    valid = (idx >= 0) & (idx < N)
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    # An invalid slot gathers row 0 as a placeholder and is zeroed, so it never contributes.
    zero = ~valid[..., None, None]
    kn = k_nope.double()[safe].masked_fill(zero, 0.0)              # [T, K, H, n]
    kp = k_pe.double()[safe].masked_fill(~valid[..., None], 0.0)   # [T, K, r]
    vv = v.double()[safe].masked_fill(zero, 0.0)                   # [T, K, H, v]
    qd = q.double()
    s = torch.einsum("thn,tkhn->thk", qd[..., :n], kn) + torch.einsum("thr,tkr->thk", qd[..., n:], kp)
    s = (scale * s).masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    den = p.sum(-1, keepdim=True)
    p = p / torch.where(den > 0, den, torch.ones_like(den))
    return torch.einsum("thk,tkhv->thv", p, vv)


def _linear64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ w [out, in]^T in float64, w upcast 2^24 elements at a time (a folded o_proj of
    DeepSeek-V3 is 470M elements: upcast whole, it would be 3.8 GB)."""
    x = x.double()
    rows = max(1, (1 << 24) // max(1, w.shape[1]))
    return torch.cat([w[i:i + rows].double() @ x.T for i in range(0, w.shape[0], rows)], dim=0).T


def _latent_attention(q_abs, c_kv, k_pe, indices, scale, kv_lora_rank):
    kv = torch.cat([c_kv.double(), k_pe.double()], dim=-1)
    out, _, _ = sparse_mla_ref(q_abs.double(), kv, indices, scale=scale, d_v=kv_lora_rank)
    return out.double()  # [T, H, L]


def layer_output_unabsorbed(x_q, c_kv, k_pe, indices, *, wq, kv_b, wo, dims: MLAWeightDims,
                            scale: float) -> torch.Tensor:
    """The original layer: q = Wq x_q; per head k_nope, v from kv_b_proj; o_proj.

    Args:
        x_q: [T, q_in] input of the query projection (q_a_layernorm output, or hidden states).
        c_kv: [N, L] latents (kv_a_layernorm output). k_pe: [N, r] rope keys.
        indices: [T, K] int rows of c_kv/k_pe, invalid = < 0 or >= N.
        wq [H*(n+r), q_in], kv_b [H*(n+v), L], wo [hidden, H*v]: the weights as floats
            (fp8 dequantized first).

    Returns [T, hidden] fp32, computed in float64 (so that the only error left in a comparison
    is the one the weights carry).
    """
    H, n, r, v = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
    T, N = x_q.shape[0], c_kv.shape[0]
    q = _linear64(x_q, wq).view(T, H, n + r)
    kv = _linear64(c_kv, kv_b).view(N, H, n + v)
    o = attention_unabsorbed(q, kv[..., :n], k_pe, kv[..., n:], indices, scale=scale)
    return _linear64(o.reshape(T, H * v), wo).float()


def layer_output_split(x_q, c_kv, k_pe, indices, *, wq, w_uk, w_uv, wo, dims: MLAWeightDims,
                       scale: float) -> torch.Tensor:
    """The absorbed layer with W_UK/W_UV applied at run time (engines' load-time absorption).

    q_lat_h = W_UK[h]^T q_nope_h; latent attention over [c | k_pe] (kernels.reference
    sparse_mla_ref, d_v = L); v_h = W_UV[h]^T o_lat_h; o_proj. Arguments as
    layer_output_unabsorbed, with w_uk [H, n, L] and w_uv [H, L, v] in place of kv_b.
    Returns [T, hidden] fp32, computed in float64.
    """
    H, n, r = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim
    T = x_q.shape[0]
    q = _linear64(x_q, wq).view(T, H, n + r)
    q_lat = torch.einsum("thn,hnl->thl", q[..., :n], w_uk.double())
    o_lat = _latent_attention(torch.cat([q_lat, q[..., n:]], -1), c_kv, k_pe, indices, scale,
                              dims.kv_lora_rank)
    o = torch.einsum("thl,hlv->thv", o_lat, w_uv.double())
    return _linear64(o.reshape(T, -1), wo).float()


def layer_output_folded(x_q, c_kv, k_pe, indices, *, wq_folded, wo_folded, dims: MLAWeightDims,
                        scale: float) -> torch.Tensor:
    """The absorbed layer with folded weights: q = Wq' x_q is already [T, H, L + r]; the latent
    output [T, H*L] goes straight through o_proj'. Returns [T, hidden] fp32, computed in float64."""
    H, L, r = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
    T = x_q.shape[0]
    q = _linear64(x_q, wq_folded).view(T, H, L + r)
    o_lat = _latent_attention(q, c_kv, k_pe, indices, scale, L)
    return _linear64(o_lat.reshape(T, H * L), wo_folded).float()
