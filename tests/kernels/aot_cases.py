"""The standard shape classes the ahead-of-time compile test (aot_compile.py) sends through the
public ops: for each, the dispatch picks kernels, constexprs and candidate configs as it would on
the target GPU. Tensors are small CPU tensors (the launches are captured, never run); only the
things a dispatch looks at are real: dtypes, head counts, head sizes, page sizes, strides, which
optional inputs are given, and counts that decide split-K / split-KV (the CPU reports 8 SMs).

`cases(full, arch)` yields (id, thunk): every class with full=True (the cross-products of head
buckets, formats, flags and phases), else the default set (CORE, plus EXTRA and SM90_EXTRA on
sm_90).
"""
from __future__ import annotations

import itertools

import torch

from openmla.kernels.head_matmul import bind_absorb_convert, head_matmul
from openmla.kernels.merge_project import merge_project
from openmla.kernels.index import convert_req_index_to_global
from openmla.kernels.indexer import decode_topk, mqa_logits, paged_mqa_logits, topk_per_row
from openmla.kernels.merge import merge_attn_states
from openmla.kernels.paged_attention import paged_attention, varlen_attention
from openmla.kernels.sparse_mla_decode import sparse_mla_decode
from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
from openmla.mla.flashmla_compat import flash_mla_with_kvcache, get_mla_metadata
from openmla.quant import BF16_MLA, FP8_DS_MLA, FP8_DS_MLA_RAW
from openmla.quant.indexer_cache import write_indexer_k_cache
from openmla.quant.int8 import quantize_per_channel, quantize_per_token_head
from openmla.quant.kv_cache import write_kv_cache
from openmla.quant.mla_gather import gather_upconvert
from openmla.quant.mla_writer import write_mla_cache
from openmla.quant.model1_format import FP8_MODEL1
from openmla.quant.model1_writer import write_model1_cache

BF16, FP16, FP8, I8, I32, F32 = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8,
                                 torch.int32, torch.float32)


def _ints(*shape, hi=1):
    return torch.randint(0, hi, shape, dtype=I32)


# ---------------------------------------------------------------------------------------------
# sparse MLA
# ---------------------------------------------------------------------------------------------
def _decode(fmt, T, H, topk, *, extras, strided):
    """sparse_mla_decode: T tokens, H heads; T=1 splits topk 2048 over programs, T=64 does not."""
    rows = 65 if strided else 64  # a hidden row per block: the non-dense (strided) cache path
    cache = torch.zeros(8, rows, fmt.row_width, dtype=fmt.cache_dtype)[:, :64]
    q = torch.zeros(T, H, 576, dtype=BF16)
    opt = dict(topk_length=_ints(T, hi=topk), attn_sink=torch.zeros(H)) if extras else {}
    return lambda: sparse_mla_decode(q, cache, _ints(T, topk), scale=0.1, **opt)


def _decode_model1(T, H, *, extra):
    """sparse_mla_decode over FlashMLA's MODEL1 view (block 256), with an extra cache (block 2) and
    both lengths and a sink (DeepSeek-V4's window + compressed caches), or the main cache alone."""
    cache = FP8_MODEL1.empty_cache(4, 256)
    q = torch.zeros(T, H, 512, dtype=BF16)
    opt = dict(topk_length=_ints(T, hi=128), attn_sink=torch.zeros(H), extra_cache=FP8_MODEL1.empty_cache(
        64, 2), extra_indices=_ints(T, 512), extra_topk_length=_ints(T, hi=512)) if extra else {}
    return lambda: sparse_mla_decode(q, cache, _ints(T, 128), scale=0.1, **opt)


def _compat(b, H, *, extras):
    """flash_mla_with_kvcache twice: the first call runs the op (the launches of the decode case of
    the same shape and options), the second the op's remembered plan, whose kernels write
    FlashMLA's +inf lse for an empty row (the INF_EMPTY constexpr)."""
    rows = 65 if extras else 64  # as _decode's strided cache with extras
    cache = torch.zeros(8, rows, 1, FP8_DS_MLA.row_width, dtype=torch.uint8)[:, :64]
    q = torch.zeros(b, 1, H, 576, dtype=BF16)
    idx = _ints(b, 1, 2048)
    meta = get_mla_metadata()[0]
    opt = dict(topk_length=_ints(b, hi=2048), attn_sink=torch.zeros(H)) if extras else {}

    def run():
        for _ in range(2):
            flash_mla_with_kvcache(q, cache, None, None, 512, meta, is_fp8_kvcache=True, indices=idx,
                                   **opt)
    return run


def _prefill(T, H, topk, *, extras, d_qk=576):
    """sparse_mla_prefill over rows of d_qk 576 (V3.2) or 512 (V4: the Triton kernel on every GPU)."""
    q = torch.zeros(T, H, d_qk, dtype=BF16)
    kv = torch.zeros(256, d_qk, dtype=BF16)
    opt = dict(topk_length=_ints(T, hi=topk), attn_sink=torch.zeros(H)) if extras else {}
    return lambda: sparse_mla_prefill(q, kv, _ints(T, topk), scale=0.1, **opt)


def sparse_cases():
    for fmt, H, (T, topk), extras, strided in itertools.product(
            (FP8_DS_MLA, BF16_MLA), (16, 32, 64, 128), ((1, 2048), (64, 128)), (False, True),
            (False, True)):
        yield f"decode-{fmt.name}-H{H}-T{T}{'-len-sink' if extras else ''}" \
              f"{'-strided' if strided else ''}", _decode(fmt, T, H, topk, extras=extras,
                                                          strided=strided)
    for H, T, extra in itertools.product((16, 64, 128), (1, 64), (False, True)):
        yield f"decode-fp8_model1-H{H}-T{T}{'-extra-len-sink' if extra else ''}", \
            _decode_model1(T, H, extra=extra)
    for H, b, extras in ((16, 1, True), (16, 64, False), (64, 64, False)):  # T = 1 splits the top-k
        yield f"flashmla_compat-H{H}-T{b}{'-len-sink-strided' if extras else ''}", _compat(b, H, extras=extras)
    for H, extras in itertools.product((16, 32, 64, 128), (False, True)):
        yield f"prefill-H{H}{'-len-sink' if extras else ''}", _prefill(4, H, 2048, extras=extras)
    for H in (16, 32, 64, 128):
        yield f"prefill-d512-H{H}-len-sink", _prefill(4, H, 1024, extras=True, d_qk=512)


# ---------------------------------------------------------------------------------------------
# MLA cache writers and readers
# ---------------------------------------------------------------------------------------------
def cache_cases():
    for fmt in (FP8_DS_MLA, FP8_DS_MLA_RAW, BF16_MLA):
        cache = torch.zeros(4, 64, fmt.row_width, dtype=fmt.cache_dtype)
        kv_c, k_pe, slots = torch.zeros(8, 512, dtype=BF16), torch.zeros(8, 64, dtype=BF16), _ints(8)
        yield f"write_mla_cache-{fmt.name}", \
            lambda fmt=fmt, cache=cache: write_mla_cache(kv_c, k_pe, cache, slots, fmt=fmt)
    cache = torch.zeros(4, 64, FP8_DS_MLA.row_width, dtype=torch.uint8)
    dst = torch.zeros(256, 576, dtype=BF16)
    yield "gather_upconvert", lambda: gather_upconvert(cache, dst, _ints(2, 4), _ints(2, hi=64),
                                                       torch.tensor([0, 128], dtype=I32))
    # DeepSeek-V4 (FlashMLA MODEL1): FlashMLA's [num_blocks, 64, 1, 584] view, blocks padded
    v4 = FP8_MODEL1.empty_cache(4, 64)
    yield "write_model1_cache", lambda: write_model1_cache(torch.zeros(8, 512, dtype=BF16), v4, _ints(8))
    yield "gather_upconvert-fp8_model1", lambda: gather_upconvert(
        v4, torch.zeros(256, 512, dtype=BF16), _ints(2, 4), _ints(2, hi=64), torch.tensor([0, 128], dtype=I32))


# ---------------------------------------------------------------------------------------------
# general MHA path
# ---------------------------------------------------------------------------------------------
# (q dtype, cache kind): bf16/fp16 caches, fp8 per-tensor, int8_qkv, int8_qk
CACHES = [(BF16, "same"), (FP16, "same"), (BF16, "fp8"), (BF16, "int8_qkv"), (FP16, "int8_qk")]
# (name, H, H_kv, D, page, options): head layouts of common models, with the options they use
MODELS = [
    ("gqa4-d128", 32, 8, 128, 16, {}),  # Llama-3-8B class
    ("mha-d64-sinks-window", 8, 8, 64, 16, dict(sinks=True, window=(127, 0))),  # gpt-oss class
    ("gqa2-d256-softcap", 8, 4, 256, 16, dict(softcap=50.0, window=(4095, 0))),  # Gemma-2 class
    ("gqa8-d128-p64-alibi", 16, 2, 128, 64, dict(alibi=True)),  # page 64, ALiBi
    ("mqa-d80-hnd", 8, 1, 80, 32, dict(layout="HND")),  # odd head size, HND layout
]
# (name, per-request (q_len, kv_len)): decode (split-KV), speculative decode, prefill
# (the CPU reports 8 SMs: one decode request splits its keys, two spec-decode requests do not)
PHASES = [("decode", [(1, 2048)]), ("spec4", [(4, 2048)] * 2), ("prefill", [(96, 200)] * 2)]


def _paged(q_dt, kind, H, H_kv, D, page, seqs, opts):
    layout = opts.get("layout", "NHD")
    nb = 16
    shape = (nb, page, H_kv, D) if layout == "NHD" else (nb, H_kv, page, D)
    k_dt = {"same": q_dt, "fp8": FP8}.get(kind, I8)
    v_dt = q_dt if kind in ("same", "int8_qk") else (FP8 if kind == "fp8" else I8)
    kc, vc = torch.zeros(shape, dtype=k_dt), torch.zeros(shape, dtype=v_dt)
    T = sum(q for q, _ in seqs)
    R = len(seqs)
    q = torch.zeros(T, H, D, dtype=q_dt)
    cu = torch.tensor([0] + [q for q, _ in seqs], dtype=I32).cumsum(0).to(I32)
    lens = torch.tensor([kv for _, kv in seqs], dtype=I32)
    bt = _ints(R, max(kv for _, kv in seqs) // page + 1)
    kw = dict(scale=0.1, causal=True, window=opts.get("window", (-1, -1)),
              softcap=opts.get("softcap", 0.0), layout=layout, return_lse=True,
              max_query_len=max(q for q, _ in seqs))
    if opts.get("sinks"):
        kw["sinks"] = torch.zeros(H)
    if opts.get("alibi"):
        kw["alibi_slopes"] = torch.zeros(H)
    if kind == "fp8":
        kw.update(k_scale=torch.ones(1), v_scale=torch.ones(1))
    if kind.startswith("int8"):
        kw["k_scale_cache"] = torch.ones(nb, H_kv, page)
        if kind == "int8_qkv":
            kw["v_scale"] = torch.ones(H_kv, D)
    return lambda: paged_attention(q, kc, vc, bt, cu, lens, **kw)


def _varlen(H, H_kv, D, q_len, k_len):
    q = torch.zeros(2 * q_len, H, D, dtype=BF16)
    k = v = torch.zeros(2 * k_len, H_kv, D, dtype=BF16)
    cu_q = torch.tensor([0, q_len, 2 * q_len], dtype=I32)
    cu_k = torch.tensor([0, k_len, 2 * k_len], dtype=I32)
    return lambda: varlen_attention(q, k, v, cu_q, cu_k, scale=0.1, max_query_len=q_len,
                                    max_kv_len=k_len)


def mha_cases():
    # every cache format with the first model, every model's options with bf16 (and the fp8 and
    # int8_qkv caches once more with page 64): the options and the formats are separate branches
    # of the kernel, and a full cross-product would add compiles, not paths
    for (q_dt, kind), (name, H, H_kv, D, page, opts), (phase, seqs) in itertools.product(
            CACHES, MODELS, PHASES):
        if not (name == MODELS[0][0] or kind == "same" and q_dt == BF16
                or page == 64 and kind in ("fp8", "int8_qkv")):
            continue
        yield f"paged-{name}-{phase}-{str(q_dt)[6:]}-{kind}", \
            _paged(q_dt, kind, H, H_kv, D, page, seqs, opts)
    for H, H_kv, D in ((16, 16, 64), (32, 8, 128)):
        yield f"varlen-H{H}-Hkv{H_kv}-D{D}", _varlen(H, H_kv, D, 200, 200)


def mha_cache_cases():
    for q_dt, kind in CACHES:
        H_kv, D, page = 8, 128, 16
        k_dt = {"same": q_dt, "fp8": FP8}.get(kind, I8)
        v_dt = q_dt if kind in ("same", "int8_qk") else (FP8 if kind == "fp8" else I8)
        kc = torch.zeros(8, page, H_kv, D, dtype=k_dt)
        vc = torch.zeros(8, page, H_kv, D, dtype=v_dt)
        x = torch.zeros(4, H_kv, D, dtype=q_dt)
        kw = {}
        if kind == "fp8":
            kw = dict(k_scale=torch.ones(1), v_scale=torch.ones(1))
        elif kind.startswith("int8"):
            kw = dict(k_scale_cache=torch.ones(8, H_kv, page), k_smooth=torch.ones(H_kv, D))
            if kind == "int8_qkv":
                kw["v_scale"] = torch.ones(H_kv, D)
        yield f"write_kv_cache-{str(q_dt)[6:]}-{kind}", \
            lambda x=x, kc=kc, vc=vc, kw=kw: write_kv_cache(x, x, kc, vc, _ints(4), **kw)
    x = torch.zeros(4, 8, 128, dtype=BF16)
    yield "int8-per-token-head", lambda: quantize_per_token_head(x)
    yield "int8-per-channel", lambda: quantize_per_channel(x, torch.ones(8, 128))


# ---------------------------------------------------------------------------------------------
# small ops
# ---------------------------------------------------------------------------------------------
def misc_cases():
    for dt in (BF16, FP16, F32):
        o = torch.zeros(4, 8, 128, dtype=dt)
        lse = torch.zeros(4, 8)
        yield f"merge-{str(dt)[6:]}", \
            lambda o=o, lse=lse: merge_attn_states(o, o, lse, o, lse, out_lse=lse.clone())
    yield "index-cache", lambda: convert_req_index_to_global(
        _ints(4), _ints(2, 8), _ints(4, 2048), 64, return_valid_counts=True)
    yield "index-workspace", lambda: convert_req_index_to_global(
        _ints(4), _ints(2, 8), _ints(4, 2048), 64,
        workspace=(torch.tensor([0, 0, -1, -1], dtype=I32), torch.zeros(1, dtype=I32)))
    # SparseMLAImpl's absorption (with the rope tail) and output projection, DeepSeek's sizes
    yield "head_matmul-absorb-T1", lambda: head_matmul(torch.zeros(1, 16, 128, dtype=BF16),
                                                       torch.zeros(16, 128, 512, dtype=BF16),
                                                       tail=torch.zeros(1, 16, 64, dtype=BF16))
    yield "head_matmul-project-T64", lambda: head_matmul(torch.zeros(64, 16, 512, dtype=BF16),
                                                         torch.zeros(16, 512, 128, dtype=BF16))
    # a split decode's merge with the output projection (a decode step at up to 4 tokens)
    yield "merge_project-T1", lambda: merge_project(torch.zeros(1, 16, 16, 512), torch.zeros(1, 16, 16),
                                                    torch.zeros(16, 512, 128, dtype=BF16))
    # the later layers' prologue of a decode step: the absorption and the index conversion
    yield "absorb_convert-T1", lambda: bind_absorb_convert(
        torch.zeros(1, 16, 576, dtype=BF16), _ints(1), _ints(1, 8), _ints(1, 2048), _ints(1), 64)(
        torch.zeros(1, 16, 128, dtype=BF16), torch.zeros(16, 128, 512, dtype=BF16),
        torch.zeros(1, 16, 64, dtype=BF16), _ints(1, 2048))



# ---------------------------------------------------------------------------------------------
# DSA indexer (DeepSeek-V3.2 shapes: 64 heads of 128, page 64, next_n 1 and 2, topk 2048)
# ---------------------------------------------------------------------------------------------
def indexer_cases():
    cache = torch.zeros(4, 64, 132, dtype=torch.uint8)
    yield "write_indexer_k_cache", lambda: write_indexer_k_cache(
        torch.zeros(8, 128, dtype=BF16), cache, _ints(8), check_slots=False)
    for n in (1, 2):
        q, w = torch.zeros(2, n, 64, 128, dtype=FP8), torch.zeros(2 * n, 64)
        yield f"paged_mqa_logits-n{n}", lambda q=q, w=w: paged_mqa_logits(
            q, w, cache, _ints(2, hi=200), _ints(2, 4), max_model_len=256)
    yield "mqa_logits", lambda: mqa_logits(torch.zeros(8, 64, 128, dtype=FP8), torch.zeros(8, 64),
                                           torch.zeros(64, 128, dtype=FP8), torch.zeros(64),
                                           _ints(8), _ints(8, hi=64))
    logits = torch.zeros(4, 4096)
    yield "topk_per_row", lambda: topk_per_row(logits, _ints(4, hi=4096), 2048, starts=_ints(4))
    yield "decode_topk", lambda: decode_topk(logits, _ints(2, hi=4096), 2, 2048)
    # rows split over programs: the bound, bucket (atomics), write and last-step kernels
    # (2 x 4 programs: one wave of the 8 SMs the CPU device reports, so the last step runs in the
    # write launch, and on sm_90+ under programmatic dependent launch; 2 x 8: its own launch)
    yield "decode_topk-split", lambda: decode_topk(torch.zeros(2, 16384), _ints(2, hi=16384), 1, 2048,
                                                   row_programs=4)
    yield "decode_topk-split-waves", lambda: decode_topk(torch.zeros(2, 16384), _ints(2, hi=16384), 1,
                                                         2048, row_programs=8)

# The default set. CORE runs on every target and compiles every kernel of kernels/ and quant/
# there (the Gluon ones on sm_90 only): the code that differs between GPUs (each e4m3 path:
# decode, encode, fp8 and int8 caches; Gluon or Triton on sm_90; the configs with the most
# shared memory, which the per-target budgets prune: 64-head prefill blocks, long-query MHA
# tiles; NVIDIA-only options such as maxnreg) and the small kernels. EXTRA adds, on sm_90 (where
# it reaches the Gluon kernels CORE does not, and whose OPENMLA_SM90_GLUON=0 pass compiles the
# Triton kernels of the same classes), the remaining branches (the second decode config, 16- and
# 32-head prefill blocks, int8_qk, sinks + window, varlen); SM90_EXTRA the FlashMLA marker of
# flash_mla_with_kvcache's repeated calls. EXTRA also ran on sm_80 until 2026-11-28: the same
# Triton kernels and branches as sm_90's second pass, with no config at a shared-memory limit
# (CORE holds those) - it runs there in the full set. The full set (`full=True`, the aot_full
# marker) runs every class on every target.
CORE = (
    "decode-fp8_ds_mla-H16-T1-len-sink-strided", "decode-fp8_model1-H64-T1-extra-len-sink",
    "prefill-H64-len-sink", "prefill-d512-H64-len-sink",
    "write_mla_cache-fp8_ds_mla", "write_mla_cache-bf16", "gather_upconvert", "write_model1_cache", "gather_upconvert-fp8_model1",
    "paged-gqa4-d128-decode-bfloat16-fp8", "paged-gqa4-d128-prefill-bfloat16-same",
    "paged-gqa4-d128-decode-bfloat16-int8_qkv",
    "write_kv_cache-bfloat16-fp8", "write_kv_cache-float16-int8_qk",
    "int8-per-token-head", "int8-per-channel", "merge-bfloat16", "index-workspace",
    "head_matmul-absorb-T1", "head_matmul-project-T64", "absorb_convert-T1", "merge_project-T1",
    "write_indexer_k_cache", "paged_mqa_logits-n1", "mqa_logits", "topk_per_row", "decode_topk-split",
    "decode_topk-split-waves",
)
EXTRA = (
    "prefill-H32",  # sm_90: the keys-on-M kernel with token flags and their passes (kv_row_faults, token_faults)
    "decode-bf16-H16-T64",  # sm_90: the bf16 keys-on-M kernel (sm90_bf16_kn)
    "decode-fp8_ds_mla-H64-T64", "decode-bf16-H128-T1", "decode-fp8_model1-H16-T64", "prefill-H16",
    "paged-gqa4-d128-spec4-float16-int8_qk", "paged-mha-d64-sinks-window-prefill-bfloat16-same",
    "varlen-H16-Hkv16-D64",
)
EXTRA_ARCHES = ("sm_90",)
# sm_90 only: FlashMLA's +inf marker in the kernels a repeated flash_mla_with_kvcache call runs
# (both Gluon kernels and, in the OPENMLA_SM90_GLUON=0 pass, the Triton kernel and the merge)
SM90_EXTRA = ("flashmla_compat-H16-T1-len-sink-strided", "flashmla_compat-H16-T64", "flashmla_compat-H64-T64")


def cases(full: bool, arch_name: str):
    """(id, thunk) of every standard shape class (full), or of the default set for this target."""
    pick = set(CORE) | (set(EXTRA) if arch_name in EXTRA_ARCHES else set()) \
        | (set(SM90_EXTRA) if arch_name == "sm_90" else set())
    found = set()
    for group in (sparse_cases, cache_cases, mha_cases, mha_cache_cases, misc_cases, indexer_cases):
        for case_id, thunk in group():
            found.add(case_id)
            if full or case_id in pick:
                yield case_id, thunk
    missing = (set(CORE) | set(EXTRA) | set(SM90_EXTRA)) - found
    assert not missing, f"CORE / EXTRA name cases that do not exist: {sorted(missing)}"
