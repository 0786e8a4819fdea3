"""FlashMLA-compatible Python API over openmla's sparse MLA ops (a drop-in for `flash_mla`).

    from openmla.mla.flashmla_compat import get_mla_metadata, flash_mla_with_kvcache, flash_mla_sparse_fwd

Same argument names, order, defaults, shapes and conventions as FlashMLA's
`flash_mla/flash_mla_interface.py` (9241ae3: `attn_sink`, `topk_length`, the extra cache) for the
sparse paths, computed by `kernels.sparse_mla_decode` and `kernels.sparse_mla_prefill`. Both
models FlashMLA serves:

* DeepSeek-V3.2: d_qk 576, the 656-byte fp8_ds_mla cache `[num_blocks, block_size, 1, 656]`.
* DeepSeek-V4 (FlashMLA's "MODEL1"): d_qk 512, the 584-byte MODEL1 cache `[num_blocks,
  block_size, 1, 584]` (a view over blocks of block_size * 584 bytes, quant/model1_format.py);
  V is the whole 512-wide token. In decode, `extra_k_cache` (same format, its own block size),
  `extra_indices_in_kvcache` and `extra_topk_length` add a second list of tokens to the same
  softmax (V4's compressed cache beside its sliding-window cache); FlashMLA allows it for V3.2's
  format too, and so does this module. The sink applies once, to the joined result.

Differences:

* any h_q in 1..128 (decode) / >= 1 (prefill) and any topk / extra_topk >= 1; FlashMLA needs h_q
  64 or 128 and topk a multiple of 64/128. Any block size for both caches.
* a bf16 cache `[num_blocks, block_size, 1, 576]` with `is_fp8_kvcache=False` is accepted on the
  sparse decode path too (FlashMLA's sparse decode reads only fp8 formats); d_qk 512 has no bf16
  cache (NotImplementedError).
* refused with NotImplementedError: the dense (non-sparse) decode path (`indices=None`),
  `causal=True` with indices, and `indexer_topk > 0` in prefill.
* bad shapes and dtypes raise ValueError naming the argument (FlashMLA asserts). A bool
  `softmax_scale` is refused: FlashMLA's README example passes `is_causal, is_fp8_kvcache, indices`
  positionally where the signature has `softmax_scale, causal, is_fp8_kvcache`; pass those three
  by keyword.

Conventions (both match FlashMLA's tests/ref.py): `lse` is the NATURAL log of the softmax
denominator of `softmax_scale * q.k` (the sink never enters it); `max_logits` is the max of
`sm_scale * q.k` (natural units, not log2-scaled). A query row with no valid index gets out = 0,
lse = +inf (FlashMLA's marker; openmla's own ops use -inf) and max_logits = -inf.
(FlashMLA's first sparse release, without attn_sink/topk_length, returned base-2 lse and
max_logits from flash_mla_sparse_fwd; this module follows the current one.)
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from openmla.kernels.device import arch_of
from openmla.kernels.sparse_mla_decode import sparse_mla_decode
from openmla.kernels.sparse_mla_decode.op import bind_call, flashmla_plan, run_plan
from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
from openmla.quant.validate import CheckedCalls, check_scale, check_tensor, fail, tensor_signature
from openmla.quant.mla_formats import BF16_MLA, FP8_DS_MLA
from openmla.quant.model1_format import FP8_MODEL1

D_QK = FP8_DS_MLA.head_dim  # 576 (V3.2)
D_QK_V4 = FP8_MODEL1.head_dim  # 512 (V4 / MODEL1)
D_V = FP8_DS_MLA.latent_dim  # 512, both models
# is_fp8_kvcache=True: the cache's last dim names the format (656 V3.2, 584 MODEL1), as FlashMLA's
# sparse_decode.h derives bytes_per_token from d_qk
_FP8_FORMATS = {FP8_DS_MLA.row_width: FP8_DS_MLA, FP8_MODEL1.row_width: FP8_MODEL1}
_FP8_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.int8)  # FlashMLA's accepted cache dtypes


@dataclasses.dataclass(frozen=True)
class SchedConfig:
    """What a metadata object was first used for (FlashMLA's FlashMLASchedMeta.Config)."""
    b: int
    s_q: int
    h_q: int
    page_block_size: int
    h_k: int
    causal: bool
    is_fp8_kvcache: bool
    topk: Optional[int]
    extra_page_block_size: Optional[int] = None
    extra_topk: Optional[int] = None


@dataclasses.dataclass
class OpenMLASchedMeta:
    """Opaque decode metadata from `get_mla_metadata`, as FlashMLA's FlashMLASchedMeta.

    openmla's decode picks its split count from shapes and the SM count on the host, so there is
    no per-batch device state to build: the object records the configuration of its first use
    (`config`) and every later call with it must match that configuration (ValueError otherwise),
    as FlashMLA requires. `hints` holds what the old-style get_mla_metadata arguments said
    (h_q, h_k, is_fp8_kvcache, topk); the first use is checked against them. Building or checking
    it never reads a device tensor, so decode stays capturable in a CUDA graph.
    """
    hints: dict = dataclasses.field(default_factory=dict)
    config: Optional[SchedConfig] = None

    @property
    def have_initialized(self) -> bool:
        return self.config is not None


def get_mla_metadata(cache_seqlens: Optional[torch.Tensor] = None,
                     num_q_tokens_per_head_k: Optional[int] = None,
                     num_heads_k: Optional[int] = None,
                     num_heads_q: Optional[int] = None,
                     is_fp8_kvcache: Optional[bool] = None,
                     topk: Optional[int] = None,
                     **kwargs) -> Tuple[OpenMLASchedMeta, None]:
    """FlashMLA's get_mla_metadata: returns (metadata, None); pass both to flash_mla_with_kvcache.

    Accepts the old FlashMLA arguments (cache_seqlens [b] int32, s_q * h_q // h_kv, h_kv, h_q,
    is_fp8_kvcache, topk) or none at all (current FlashMLA). The given values are kept as hints
    and checked against the first flash_mla_with_kvcache call; cache_seqlens is not read (the
    sparse path does not use it), so no host sync happens. Other keyword arguments are ignored,
    as current FlashMLA ignores all of them. The second element is None: the current
    FlashMLA's `num_splits` placeholder.
    """
    hints = {}
    if cache_seqlens is not None:
        check_tensor("cache_seqlens", cache_seqlens, dtype=torch.int32, ndim=1)
        hints["b"] = cache_seqlens.shape[0]
    for name, value in (("h_k", num_heads_k), ("h_q", num_heads_q), ("topk", topk)):
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(name, "a positive int", value)
            hints[name] = value
    if is_fp8_kvcache is not None:
        hints["is_fp8_kvcache"] = bool(is_fp8_kvcache)
    return OpenMLASchedMeta(hints=hints), None


def _check_meta(meta: OpenMLASchedMeta, cfg: SchedConfig) -> None:
    """First use: record cfg (after checking the hints); later uses: cfg must equal the record."""
    if meta.config is None:
        for name, want in meta.hints.items():
            got = getattr(cfg, name)
            if got != want:
                fail(f"tile_scheduler_metadata: {name}", f"{want} (as given to get_mla_metadata)", got)
        meta.config = cfg
        return
    for field in dataclasses.fields(SchedConfig):
        want, got = getattr(meta.config, field.name), getattr(cfg, field.name)
        if want != got:
            fail(f"tile_scheduler_metadata: {field.name}",
                 f"{want} (the metadata's first use; build new metadata for new shapes)", got)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: OpenMLASchedMeta,
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse decode: attention of q over the cache rows named by `indices` (and by
    `extra_indices_in_kvcache` in `extra_k_cache`), one softmax over both lists.

    Args:
        q: [b, s_q, h_q, d_qk] bf16, h_q any 1..128, last dim contiguous. d_qk 576 (V3.2: absorbed
            latent 512 | rope 64) or 512 (V4 / MODEL1: nope 448 | rope 64); it must be the
            cache format's.
        k_cache: with is_fp8_kvcache=True, uint8, float8_e4m3fn or int8 (the bytes, as FlashMLA's
            tests/quant.py makes them): [num_blocks, block_size, 1, 656] fp8_ds_mla (V3.2) or
            [num_blocks, block_size, 1, 584] MODEL1 (V4; rows are a view over blocks of
            block_size * 584 bytes, stride(1) must be 584). With is_fp8_kvcache=False
            [num_blocks, block_size, 1, 576] bf16 (an openmla extension, V3.2 only). A strided
            view is fine (block stride >= the block's bytes, rows contiguous).
        block_table, cache_seqlens: unused on the sparse path (slots are global), may be None.
        head_dim_v: must be 512.
        tile_scheduler_metadata: from get_mla_metadata; reusable while shapes stay the same
            (incl. the extra cache's block size and extra_topk).
        num_splits: must be None (the second element get_mla_metadata returns).
        softmax_scale: float applied to q.k; None means d_qk ** -0.5 (FlashMLA's
            1/sqrt(head_dim)).
        causal: must be False with indices (as FlashMLA).
        is_fp8_kvcache: True for the fp8 formats, False for a bf16 cache.
        indices: [b, s_q, topk] int32 global slots block * block_size + offset, any topk >= 1,
            last dim contiguous; invalid = < 0 or >= num_blocks * block_size (skipped, never read).
        attn_sink: [h_q] fp32 or None: out *= exp(lse) / (exp(lse) + exp(attn_sink)) with lse over
            both lists; lse unchanged; +inf gives out = 0.
        extra_k_cache: None or a second cache in k_cache's format, its own num_blocks and
            block_size (V4: the compressed cache beside the sliding-window one).
        extra_indices_in_kvcache: [b, s_q, extra_topk] int32 slots of extra_k_cache; required with
            it, refused without it (invalid as for indices).
        topk_length: [b] int32 or None: for every query of batch i only indices[i, :, :topk_length[i]]
            count.
        extra_topk_length: [b] int32 or None (only with extra_k_cache): limits
            extra_indices_in_kvcache as topk_length limits indices.

    Returns:
        out: [b, s_q, h_q, 512] bf16.
        lse: [b, h_q, s_q] fp32 (note the transpose), natural log of the softmax denominator of
            softmax_scale * q.k over both lists; +inf for a query with no valid index (whose out
            is 0).
    """
    meta = tile_scheduler_metadata
    sig = None
    # (torch.compile traces the op's registered custom op: the checks below, then _decode)
    if extra_k_cache is None and extra_indices_in_kvcache is None and extra_topk_length is None \
            and not torch.compiler.is_compiling():
        try:
            sig = _decode_signature(q, k_cache, indices, topk_length, attn_sink, head_dim_v, meta,
                                    num_splits, softmax_scale, causal, is_fp8_kvcache)
            hit = _CHECKED.get(sig)
        except (AttributeError, TypeError):
            sig = hit = None
        if hit is not None and meta.config is hit[1]:
            # this signature passed every check below, and the op's, with this metadata object
            fmt, plan, run = hit[0], hit[2], hit[4]
            scale = (fmt.head_dim ** -0.5 if softmax_scale is None
                     else check_scale("softmax_scale", softmax_scale))
            if run is not None:  # the op's kernels on FlashMLA's tensors as they are
                b, s_q, h_q, _ = q.shape
                out = torch.empty((b, s_q, h_q, D_V), dtype=q.dtype, device=q.device)
                lse = run(q, k_cache, indices, _per_token(topk_length, s_q), attn_sink, out, scale)
                return out, (lse if s_q == 1 else lse.transpose(1, 2).contiguous())
            return _decode(q, k_cache, indices, topk_length, attn_sink, scale, fmt, {}, plan)
    # first: a bool here is the README's positional (is_causal, is_fp8_kvcache, indices) mix-up
    if isinstance(softmax_scale, bool):
        fail("softmax_scale", "a finite float or None (FlashMLA's README example passes is_causal, "
             "is_fp8_kvcache, indices positionally where the signature has softmax_scale, causal, "
             "is_fp8_kvcache: pass them by keyword)", repr(softmax_scale))
    if indices is None:
        raise NotImplementedError("flash_mla_with_kvcache: the dense (non-sparse) decode path "
                                  "(indices=None) is not supported by openmla; pass indices")
    if causal:
        raise NotImplementedError("flash_mla_with_kvcache: causal=True with indices (sparse attention "
                                  "has no causal mask; FlashMLA refuses it too)")
    if not isinstance(tile_scheduler_metadata, OpenMLASchedMeta):
        fail("tile_scheduler_metadata", "the OpenMLASchedMeta from mla.flashmla_compat.get_mla_metadata",
             type(tile_scheduler_metadata).__name__)
    if num_splits is not None:
        fail("num_splits", "None (the second element get_mla_metadata returns)", type(num_splits).__name__)
    if head_dim_v != D_V:
        fail("head_dim_v", D_V, head_dim_v)
    check_tensor("q", q, dtype=torch.bfloat16, ndim=4, last_dim_contiguous=True)
    b, s_q, h_q, _ = q.shape
    fp8 = bool(is_fp8_kvcache)
    if not fp8 and q.shape[-1] == D_QK_V4:
        raise NotImplementedError("flash_mla_with_kvcache: d_qk 512 (MODEL1) with is_fp8_kvcache=False; "
                                  "its cache is the 584-byte fp8 format (FlashMLA has no bf16 one either)")
    fmt = _cache_format("k_cache", k_cache, fp8)
    check_tensor("q", q, shape=(None, None, None, fmt.head_dim))
    scale = (fmt.head_dim ** -0.5 if softmax_scale is None
             else check_scale("softmax_scale", softmax_scale))
    check_tensor("indices", indices, dtype=torch.int32, shape=(b, s_q, None), last_dim_contiguous=True)
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=(b,))
    if extra_k_cache is None:
        for name, t in (("extra_indices_in_kvcache", extra_indices_in_kvcache),
                        ("extra_topk_length", extra_topk_length)):
            if t is not None:
                fail(name, "None without extra_k_cache (as FlashMLA)", type(t).__name__)
    else:
        if _cache_format("extra_k_cache", extra_k_cache, fp8) is not fmt:
            fail("extra_k_cache.shape", f"(*, *, 1, {fmt.row_width}) (k_cache's format, {fmt.name})",
                 tuple(extra_k_cache.shape))
        if extra_indices_in_kvcache is None:
            fail("extra_indices_in_kvcache", "a tensor with extra_k_cache (as FlashMLA)", None)
        check_tensor("extra_indices_in_kvcache", extra_indices_in_kvcache, dtype=torch.int32,
                     shape=(b, s_q, None), last_dim_contiguous=True)
        if extra_topk_length is not None:
            check_tensor("extra_topk_length", extra_topk_length, dtype=torch.int32, shape=(b,))
    _check_meta(tile_scheduler_metadata, SchedConfig(
        b=b, s_q=s_q, h_q=h_q, page_block_size=k_cache.shape[1], h_k=k_cache.shape[2],
        causal=bool(causal), is_fp8_kvcache=fp8, topk=indices.shape[-1],
        extra_page_block_size=None if extra_k_cache is None else extra_k_cache.shape[1],
        extra_topk=None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1]))

    extra = {}
    if extra_k_cache is not None:
        T = b * s_q
        extra = dict(extra_cache=_as_cache(extra_k_cache),
                     # extra_topk named, not -1: with b * s_q == 0 a -1 could be any size
                     extra_indices=extra_indices_in_kvcache.reshape(T, extra_indices_in_kvcache.shape[-1]),
                     extra_topk_length=_per_token(extra_topk_length, s_q))
    result = _decode(q, k_cache, indices, topk_length, attn_sink, scale, fmt, extra)
    if sig is not None and not extra:  # remembered once the op's checks passed too
        plan = _plan(q, k_cache, indices, topk_length, attn_sink, fmt)
        layout = _direct_layout(q, k_cache, indices) if plan is not None else None
        _CHECKED.remember(sig, (fmt, meta.config, plan, arch_of(q.device),
                                bind_call(plan, fmt, layout) if layout is not None else None))
    return result


# call signature -> (format, the metadata's config, the op's launch plan or None, the architecture
# the signature names by id, the plan's call bound to its layout of FlashMLA's own tensors
# (kernels.sparse_mla_decode.op.bind_call) or None) of decode calls
# without an extra cache that passed flash_mla_with_kvcache's checks and the op's
_CHECKED = CheckedCalls()


def _direct_layout(q, k_cache, indices):
    """run_plan's layout of FlashMLA's q [b, s_q, h_q, d], indices [b, s_q, topk], a fresh out
    [b, s_q, h_q, 512] and lse [b, h_q, 1] (s_q = 1) or [b, s_q, h_q] (transposed after), so that
    a repeated call launches on them without reshaping them into the op's [b * s_q, ...] views;
    None where those views would not be views (a token stride that does not flatten b and s_q)
    or the cache is not the plan's dtype (fp8 / int8 bytes, which the op reads as uint8)."""
    b, s_q, h_q, _ = q.shape
    if s_q == 1:
        sq_t, si_t = q.stride(0), indices.stride(0)
    elif q.stride(0) == s_q * q.stride(1) and indices.stride(0) == s_q * indices.stride(1):
        sq_t, si_t = q.stride(1), indices.stride(1)
    else:
        return None
    if k_cache.dtype not in (torch.uint8, torch.bfloat16):
        return None
    lse_shape = (b, h_q, 1) if s_q == 1 else (b, s_q, h_q)
    return (b * s_q, h_q, sq_t, q.stride(2), si_t, h_q * D_V, D_V, lse_shape)


def _decode_signature(q, k_cache, indices, topk_length, attn_sink, head_dim_v, meta, num_splits,
                      softmax_scale, causal, is_fp8_kvcache):
    """Everything flash_mla_with_kvcache's checks read, but the metadata's state and the value
    of softmax_scale (checked per call): tensor types, dtypes, shapes, strides, devices, and the
    other arguments' values or types. AttributeError / TypeError for what is not a tensor or not
    hashable, and for flags that are not bools (the full checks then say what is wrong or treat
    them as truth values)."""
    if type(causal) is not bool or type(is_fp8_kvcache) is not bool:
        raise TypeError("causal / is_fp8_kvcache: not a bool")
    sig = tensor_signature
    arch = arch_of(q.device)  # and the cache's alignment: what the op's plan depends on beyond these
    return (sig(q), sig(k_cache), k_cache.data_ptr() & 15 == 0, sig(indices), sig(topk_length),
            sig(attn_sink), head_dim_v, type(meta), num_splits is None, type(softmax_scale), causal,
            is_fp8_kvcache, id(arch), arch.gluon_sm90)


def _plan(q, k_cache, indices, topk_length, attn_sink, fmt):
    """The op's launch plan for these checked inputs, its kernels writing FlashMLA's +inf lse
    marker; None where the op has no plan to reuse (MODEL1, or no query)."""
    if getattr(fmt, "blocked", False) or q.shape[0] * q.shape[1] == 0:
        return None
    return flashmla_plan(*_op_args(q, k_cache, indices, topk_length), attn_sink, fmt)


def _op_args(q, k_cache, indices, topk_length):
    """FlashMLA's decode inputs as the op takes them: q [T, h_q, d], the cache [num_blocks,
    block_size, row], indices [T, topk] and per-token lengths, T = b * s_q."""
    b, s_q, h_q, d = q.shape
    T = b * s_q
    return (q.reshape(T, h_q, d), _as_cache(k_cache), indices.reshape(T, indices.shape[-1]),
            _per_token(topk_length, s_q))


def _decode(q, k_cache, indices, topk_length, attn_sink, scale, fmt, extra, plan=None):
    """The decode on checked inputs over [b * s_q] tokens, FlashMLA's out and lse: through the
    op (its lse's -inf turned into FlashMLA's +inf, NaN kept), or, for a signature that passed
    every check before, through the op's remembered `plan`, whose kernels write the +inf."""
    b, s_q, h_q, d = q.shape
    T = b * s_q
    out = torch.empty((b, s_q, h_q, D_V), dtype=q.dtype, device=q.device)
    *args, lengths = _op_args(q, k_cache, indices, topk_length)
    if plan is not None:
        lse = run_plan(plan, *args, lengths, attn_sink, out.view(T, h_q, D_V), scale, fmt)
        if s_q == 1:  # [b, h_q, 1] is [T, H]'s memory as it is
            return out, lse.view(b, h_q, 1)
        return out, lse.view(b, s_q, h_q).transpose(1, 2).contiguous()
    _, lse = sparse_mla_decode(*args, scale=scale, topk_length=lengths, attn_sink=attn_sink,
                               out=out.view(T, h_q, D_V), fmt=fmt, **extra)
    lse = lse.view(b, s_q, h_q).transpose(1, 2).contiguous()  # [b, h_q, s_q]
    return out, lse.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=float("inf"))


def _cache_format(name: str, cache: torch.Tensor, fp8: bool):
    """The sparse MLA format of a FlashMLA-shaped cache [num_blocks, block_size, 1, row]: with
    is_fp8_kvcache the row width picks fp8_ds_mla (656) or MODEL1 (584), else bf16 (576)."""
    if not fp8:
        check_tensor(f"{name} (is_fp8_kvcache=False)", cache, dtype=torch.bfloat16,
                     shape=(None, None, 1, BF16_MLA.row_width))
        return BF16_MLA
    check_tensor(name, cache, dtype=_FP8_DTYPES, ndim=4)
    fmt = _FP8_FORMATS.get(cache.shape[-1])
    if cache.shape[2] != 1 or fmt is None:
        fail(f"{name}.shape", f"(*, *, 1, {FP8_DS_MLA.row_width}) (V3.2 fp8_ds_mla) or "
             f"(*, *, 1, {FP8_MODEL1.row_width}) (MODEL1)", tuple(cache.shape))
    fmt.check_cache(_as_cache(cache), name)  # strides (MODEL1: a block's bytes contiguous)
    return fmt


def _as_cache(k_cache: torch.Tensor) -> torch.Tensor:
    """A FlashMLA cache as the op takes it: [num_blocks, block_size, row] (strides kept), fp8
    bytes as uint8 (the same bytes)."""
    cache = k_cache.select(2, 0)
    return cache.view(torch.uint8) if cache.dtype in (torch.float8_e4m3fn, torch.int8) else cache


def _per_token(lengths: Optional[torch.Tensor], s_q: int) -> Optional[torch.Tensor]:
    """FlashMLA's lengths are per batch entry, openmla's per query token: [b] -> [b * s_q]."""
    if lengths is None:
        return None
    if s_q == 1:
        return lengths.contiguous()
    b = lengths.shape[0]
    return lengths.reshape(b, 1).expand(b, s_q).reshape(b * s_q).contiguous()


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    indexer_topk: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse prefill: each query token attends to its own top-k rows of kv.

    Args:
        q: [s_q, h_q, d_qk] bf16, any h_q >= 1, last dim contiguous; d_qk is kv's.
        kv: [s_kv, 1, d_qk] bf16, rows contiguous: d_qk 576 (V3.2: latent 512 | rope 64, the
            latent is the value) or 512 (V4 / MODEL1: nope 448 | rope 64, the whole row is the
            value).
        indices: [s_q, 1, topk] int32 rows of kv, any topk >= 1, last dim contiguous; invalid =
            < 0 or >= s_kv (skipped, never read).
        sm_scale: softmax scale (> 0) applied to q.k; required (FlashMLA has no default).
        d_v: must be 512.
        attn_sink: [h_q] fp32 or None: out *= exp(lse) / (exp(lse) + exp(attn_sink)); lse and
            max_logits unchanged; +inf gives out = 0.
        topk_length: [s_q] int32 or None: query i uses only indices[i, :, :topk_length[i]].
        indexer_topk: must be 0 (FlashMLA's lse_indexer output is not supported).

    Returns (out, max_logits, lse):
        out: [s_q, h_q, 512] bf16.
        max_logits: [s_q, h_q] fp32, max over valid j of sm_scale * q.k_j (natural units, as
            FlashMLA's tests/ref.py); -inf for a query with no valid index.
        lse: [s_q, h_q] fp32, natural-log sum of exp(sm_scale * q.k_j); +inf for a query with no
            valid index (whose out is 0).
    """
    if sm_scale is None:  # FlashMLA's signature has no default for it
        fail("sm_scale", "a finite nonzero float (flash_mla_sparse_fwd has no default; FlashMLA's "
             f"tests pass d_qk ** -0.5 = {D_QK ** -0.5:.6g})", None)
    scale = check_scale("sm_scale", sm_scale)
    if indexer_topk:
        raise NotImplementedError("flash_mla_sparse_fwd: indexer_topk > 0 (lse_indexer) is not supported "
                                  "by openmla")
    if d_v != D_V:
        fail("d_v", D_V, d_v)
    check_tensor("kv", kv, dtype=torch.bfloat16, ndim=3, last_dim_contiguous=True)
    if kv.shape[1] != 1 or kv.shape[2] not in (D_QK, D_QK_V4):
        fail("kv.shape", f"(*, 1, {D_QK}) (V3.2) or (*, 1, {D_QK_V4}) (V4 / MODEL1)", tuple(kv.shape))
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, kv.shape[2]), last_dim_contiguous=True)
    s_q = q.shape[0]
    check_tensor("indices", indices, dtype=torch.int32, shape=(s_q, 1, None), last_dim_contiguous=True)
    out, lse, max_logits = sparse_mla_prefill(q, kv.select(1, 0), indices.select(1, 0),
                                              scale=scale,
                                              topk_length=topk_length, attn_sink=attn_sink)
    return out, max_logits, lse.masked_fill_(lse == float("-inf"), float("inf"))
