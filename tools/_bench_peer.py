"""FlashMLA timed beside openmla in the same run (tools/bench.py): loading the peer, and the entries
that call it on an op's own inputs.

The peer is the `flash_mla` package, as the `sgl-flash-mla` wheel ships it (SGLang's packaging of
FlashMLA; its legacy extension keeps the sm90 kernels and the 656-byte V3.2 cache format, reached
with `use_legacy=True`). It is never a dependency of openmla: `pip install openmla[bench]` where the
wheel's torch requirement can be met, else `. tools/flashmla_peer.sh` (installs the wheel from
.whl/ with --no-deps, no network). Without it every FlashMLA column says "not measured".

What bench.py does with an op's `peer` (a _bench_core.Peer) for each case:
    px = peer.prepare(x, flash_mla)    # views of the case's tensors; q copied into a padded buffer
    raw = peer.call(px)                # the first call also builds FlashMLA's scheduler metadata
    peer.unpad(px, raw), peer.ours(x)  # both outputs in the op's layout: max abs differences
    kernel_time(peer.call(px)), eager_time(peer.call(px))

Head padding: FlashMLA's sm90 sparse kernels take 64 or 128 query heads. A case with H heads is
run on q copied once (outside the timing) into a zero [.., 64 or 128, 576] buffer; the padded call
is what is timed, and only the first H heads are compared. Cases with H > 128, or a cache FlashMLA
does not read (the bf16 decode cache), are "not measured" with the reason.

Conventions: FlashMLA's decode returns lse [b, h_q, s_q] and its prefill lse [s_q, h_q], natural
log, +inf for a row with no valid index; unpad returns [T, H] with -inf there (openmla's). FlashMLA
skips only the index -1 (it does not bound-check others), so invalid indices become -1 in prepare.

DeepSeek-V4 (MODEL1, DESIGN.md): DECODE_V4_PEER views the [num_blocks, block_size, 1, 584] caches
(the main and the extra one), regroups the T = batch * s_q tokens as FlashMLA's [batch, s_q, ...]
with per-request lengths, and calls flash_mla_with_kvcache with q of head dim 512, kv_format="V4"
and use_legacy=True (sparse_mla_decode_v4). The prefill peer serves d_qk 512 rows too
(sparse_mla_prefill_v4: flash_mla_sparse_fwd on the bf16 rows, its sink padded with -inf).
Everything after prepare (timing, unpadding, comparison, columns) is shared.
"""
from __future__ import annotations

import inspect

import torch

from openmla.tools._bench_core import NotMeasured, Peer

D_V = 512
FP8_ROW_BYTES = 656  # fp8_ds_mla (FlashMLA's V3.2 format)
PEER_HEADS = (64, 128)  # the head counts FlashMLA's sm90 sparse kernels take


def load(gpu: bool):
    """(flash_mla module, None) when the peer can run here, else (None, why not)."""
    if not gpu:
        return None, "no GPU (FlashMLA's kernels need CUDA)"
    try:
        import flash_mla
    except Exception as e:  # not installed, or an extension that will not load (CUDA, torch ABI)
        cause = f"; {e.__cause__}" if e.__cause__ is not None else ""
        return None, f"flash_mla not importable ({type(e).__name__}: {e}{cause})"
    has_legacy = getattr(flash_mla, "has_legacy", None)
    if has_legacy is not None and not has_legacy():
        return None, "flash_mla without its legacy extension (the sm90 kernels and the 656-byte format)"
    return flash_mla, None


def describe(flash_mla) -> str:
    """The peer's name and version for the tables."""
    return f"flash_mla {getattr(flash_mla, '__version__', '(version unknown)')}"


def padded_heads(h: int) -> int:
    """The head count FlashMLA runs for h real heads: 64 or 128."""
    for hp in PEER_HEADS:
        if h <= hp:
            return hp
    raise NotMeasured(f"H = {h} > {PEER_HEADS[-1]}: FlashMLA's sparse kernels take at most {PEER_HEADS[-1]} heads")


def _legacy_kwargs(fn) -> dict:
    """use_legacy=True where the function has it (sgl-flash-mla: the sm90 kernels and the V3.2
    format live in its legacy extension); FlashMLA builds without the argument have them built in."""
    return {"use_legacy": True} if "use_legacy" in inspect.signature(fn).parameters else {}


def _pad_heads(q: torch.Tensor, hp: int) -> torch.Tensor:
    """q [..., H, D] copied into zeros [..., hp, D]; the padding heads' outputs are discarded."""
    qp = q.new_zeros(*q.shape[:-2], hp, q.shape[-1])
    qp[..., :q.shape[-2], :] = q
    return qp


def _minus_one_invalid(indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Indices with every invalid entry (< 0 or >= num_rows) set to -1, the one FlashMLA skips."""
    return torch.where((indices >= 0) & (indices < num_rows), indices, torch.full_like(indices, -1))


def _openmla_lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashMLA's lse marker for a row with no valid index (+inf) as openmla's (-inf)."""
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over all elements; equal infinities agree; NaN anywhere gives NaN."""
    a, b = a.double(), b.double()
    d = torch.where(a == b, torch.zeros_like(a), (a - b).abs())
    return float(d.max()) if d.numel() else 0.0


# --------------------------------------------------------------------------------------------
# sparse decode over the 656-byte fp8 cache: flash_mla_with_kvcache
def _decode_prepare(x: dict, fm) -> dict:
    q, cache, indices = x["q"], x["cache"], x["indices"]
    if cache.dtype != torch.uint8 or cache.shape[-1] != FP8_ROW_BYTES:
        raise NotMeasured("FlashMLA's sparse decode reads only the 656-byte fp8 cache")
    T, H, _ = q.shape
    hp = padded_heads(H)
    meta, _ = fm.get_mla_metadata()
    return {
        "fm": fm, "heads": H, "scale": x["scale"], "meta": meta,
        "kwargs": _legacy_kwargs(fm.flash_mla_with_kvcache),
        "q": _pad_heads(q.unsqueeze(1), hp),  # [T, 1, hp, 576]: batch T, one query each
        "cache": cache.view(torch.float8_e4m3fn).unsqueeze(2),  # [num_blocks, block_size, 1, 656]
        "indices": _minus_one_invalid(indices, cache.shape[0] * cache.shape[1]).unsqueeze(1).contiguous(),
    }


def _decode_call(px: dict):
    return px["fm"].flash_mla_with_kvcache(
        px["q"], px["cache"], None, None, D_V, px["meta"], None, softmax_scale=px["scale"],
        causal=False, is_fp8_kvcache=True, indices=px["indices"], **px["kwargs"])


def _decode_unpad(px: dict, raw) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = raw  # [T, 1, hp, 512], [T, hp, 1]
    h = px["heads"]
    return out[:, 0, :h], _openmla_lse(lse[:, :h, 0])


def _decode_ours(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from openmla.kernels.sparse_mla_decode import sparse_mla_decode
    out, lse = sparse_mla_decode(x["q"], x["cache"], x["indices"], scale=x["scale"])
    return out, lse


def decode_peer(ours=_decode_ours) -> Peer:
    """The decode peer, compared with `ours` (x -> (out [T, H, 512], lse [T, H])): by default
    kernels.sparse_mla_decode; entries that reach the same kernel another way pass their own."""
    return Peer(name="flash_mla_with_kvcache", prepare=_decode_prepare, call=_decode_call,
                unpad=_decode_unpad, ours=ours)


# --------------------------------------------------------------------------------------------
# sparse decode over DeepSeek-V4 (MODEL1) caches, with the extra cache: flash_mla_with_kvcache
def _decode_v4_prepare(x: dict, fm) -> dict:
    q, s_q = x["q"], x["s_q"]
    T, H, _ = q.shape
    hp = padded_heads(H)
    b = T // s_q

    def per_request(t):  # openmla's per-token rows [T, ...] -> FlashMLA's [b, s_q, ...]
        return t.view(b, s_q, *t.shape[1:])

    def lengths(name):  # FlashMLA's lengths are per request: every token of one carries the same
        n = x.get(name)
        if n is None:
            return None
        if not bool((per_request(n) == per_request(n)[:, :1]).all()):
            raise NotMeasured(f"{name} differs between the tokens of a request (FlashMLA's is per request)")
        return per_request(n)[:, 0].contiguous()

    kw = dict(topk_length=lengths("topk_length"), extra_topk_length=lengths("extra_topk_length"))
    if x.get("extra_cache") is not None:
        extra = x["extra_cache"]
        kw.update(extra_k_cache=extra, extra_indices_in_kvcache=per_request(
            _minus_one_invalid(x["extra_indices"], extra.shape[0] * extra.shape[1])).contiguous())
    if x.get("attn_sink") is not None:
        kw["attn_sink"] = _pad_sink(x["attn_sink"], hp)
    cache = x["cache"]
    return {
        "fm": fm, "heads": H, "scale": x["scale"], "meta": fm.get_mla_metadata()[0],
        "kwargs": dict(kw, kv_format="V4", **_legacy_kwargs(fm.flash_mla_with_kvcache)),
        "q": per_request(_pad_heads(q, hp)),  # [b, s_q, hp, 512]
        "cache": cache, "indices": per_request(_minus_one_invalid(
            x["indices"], cache.shape[0] * cache.shape[1])).contiguous(),
    }


def _decode_v4_unpad(px: dict, raw) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = raw  # [b, s_q, hp, 512], [b, hp, s_q]
    h = px["heads"]
    return out[:, :, :h].flatten(0, 1), _openmla_lse(lse[:, :h].transpose(1, 2).flatten(0, 1))


def _decode_v4_ours(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from openmla.kernels.sparse_mla_decode import sparse_mla_decode
    return sparse_mla_decode(x["q"], x["cache"], x["indices"], **x["kwargs"])


DECODE_V4_PEER = Peer(name="flash_mla_with_kvcache (V4)", prepare=_decode_v4_prepare, call=_decode_call,
                      unpad=_decode_v4_unpad, ours=_decode_v4_ours)


# --------------------------------------------------------------------------------------------
# sparse prefill over bf16 rows: flash_mla_sparse_fwd
def _prefill_prepare(x: dict, fm) -> dict:
    q, kv, indices = x["q"], x["kv"], x["indices"]
    T, H, _ = q.shape
    hp = padded_heads(H)
    return {
        "fm": fm, "heads": H, "scale": x["scale"],
        "kwargs": _legacy_kwargs(fm.flash_mla_sparse_fwd),
        "q": _pad_heads(q, hp),  # [T, hp, d_qk] (576 or 512)
        "kv": kv.unsqueeze(1),  # [N, 1, d_qk]
        "indices": _minus_one_invalid(indices, kv.shape[0]).unsqueeze(1).contiguous(),  # [T, 1, topk]
        "sink": {} if x.get("attn_sink") is None else {"attn_sink": _pad_sink(x["attn_sink"], hp)},
    }


def _pad_sink(sink: torch.Tensor, hp: int) -> torch.Tensor:
    """attn_sink [H] padded with -inf (no effect) to the peer's hp heads."""
    return torch.cat([sink, sink.new_full((hp - sink.shape[0],), float("-inf"))])


def _prefill_call(px: dict):
    return px["fm"].flash_mla_sparse_fwd(px["q"], px["kv"], px["indices"], px["scale"], D_V, **px["sink"],
                                         **px["kwargs"])


def _prefill_unpad(px: dict, raw) -> tuple[torch.Tensor, torch.Tensor]:
    out, _, lse = raw  # [T, hp, 512], max_logits [T, hp], lse [T, hp]
    h = px["heads"]
    return out[:, :h], _openmla_lse(lse[:, :h])


def _prefill_ours(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
    out, lse, _ = sparse_mla_prefill(x["q"], x["kv"], x["indices"], scale=x["scale"],
                                     attn_sink=x.get("attn_sink"))
    return out, lse


PREFILL_PEER = Peer(name="flash_mla_sparse_fwd", prepare=_prefill_prepare, call=_prefill_call,
                    unpad=_prefill_unpad, ours=_prefill_ours)


def compare(peer: Peer, x: dict, px: dict, raw, error) -> dict:
    """The agreement record of one case: max |openmla - FlashMLA| of out and lse over the real
    heads, and FlashMLA's own relative error against the fp32 oracle (the op's `error`)."""
    p_out, p_lse = peer.unpad(px, raw)
    o_out, o_lse = peer.ours(x)
    if p_out.shape != o_out.shape or p_lse.shape != o_lse.shape:
        raise RuntimeError(f"peer {peer.name}: outputs {tuple(p_out.shape)} / {tuple(p_lse.shape)} against "
                           f"openmla's {tuple(o_out.shape)} / {tuple(o_lse.shape)}")
    return {"max_abs_out": max_abs_diff(o_out, p_out), "max_abs_lse": max_abs_diff(o_lse, p_lse),
            "peer_rel_err": error(x, p_out)}


def padded_to(px: dict) -> int:
    """The head count the peer ran (q's head dimension in px)."""
    return int(px["q"].shape[-2])
