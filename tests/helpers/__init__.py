"""Shared test helpers: one assert_close with one tolerance table, adversarial inputs (STYLE.md 12-13).

Test files import helpers from here and never from another test file. This module holds what
every layer uses; the layers' own builders live beside it: tests.helpers.quant (MLA latent
inputs), tests.helpers.kernels (paged_attention batches), tests.helpers.sparse (SparseMLAImpl
engine steps), tests.helpers.mha (PagedAttentionImpl engine steps), tests.helpers.vllm (vLLM
test plumbing that imports vLLM only when called).
"""
from __future__ import annotations

import math
from typing import Optional
import os

import pytest
import torch

from openmla.kernels.device import sm90_gluon

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

# Full-size cases: every kind of case also has a small CPU case; these sizes run on the GPU only.
GPU_ONLY = pytest.mark.skipif(INTERPRET or DEVICE == "cpu",
                              reason="too slow for the CPU interpreter; runs on GPU")
# tests of a Triton kernel that Hopper's Gluon twins would otherwise replace (they force it there)
SM90_ONLY = pytest.mark.skipif(not sm90_gluon(DEVICE),
                               reason="off Hopper the Triton kernel is the only path, and the tests "
                                      "above already run it")

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

# name -> (atol, rtol, max cosine distance). An element passes if abs err <= atol OR
# rel err <= rtol (the issues' "abs err <= a or rel err <= r elementwise").
TOLERANCES = {
    "exact": (0.0, 0.0, 1e-12),  # cosine of identical tensors rounds to ~2e-16
    "fp32": (1e-5, 1e-5, 1e-7),
    "lse": (1e-5, 0.0, 1e-7),
    "sparse_decode": (1e-3, 2 / 128, 1e-5),
    # FlashMLA's MODEL1 decode bounds (tests/test_flash_mla_sparse_decoding.py: cosine 5e-6)
    "sparse_decode_model1": (1e-3, 2 / 128, 5e-6),
    "sparse_prefill": (8e-4, 3 / 128, 1e-5),
    "bf16": (1.5e-2, 1e-2, 1e-4),
    "fp8": (1.5e-1, 1.5e-1, 1e-3),
}


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: str = "fp32") -> None:
    """Compare got against want (an oracle): inf/NaN positions first, then abs/rel error and cosine.

    On failure the message says where the worst element is and what both sides hold there.
    """
    atol, rtol, max_cos = TOLERANCES[tol]
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != expected {tuple(want.shape)}")
    g = got.detach().double().cpu()
    w = want.detach().double().cpu()
    for what, fn in (("NaN", torch.isnan), ("+inf", lambda x: x == float("inf")),
                     ("-inf", lambda x: x == float("-inf"))):
        mg, mw = fn(g), fn(w)
        if not torch.equal(mg, mw):
            bad = (mg != mw).nonzero()[0].tolist()
            raise AssertionError(
                f"{name}: {what} positions differ, first at {bad}: got {g[tuple(bad)].item()}, "
                f"want {w[tuple(bad)].item()} ({int((mg != mw).sum())} positions)")
    finite = torch.isfinite(w)
    g, w = g[finite], w[finite]
    if g.numel() == 0:
        return
    err = (g - w).abs()
    rel = err / w.abs().clamp_min(1e-30)
    ok = (err <= atol) | (rel <= rtol)
    if not bool(ok.all()):
        bad_vals = torch.where(ok, torch.zeros_like(err), err)
        i = int(bad_vals.argmax())
        idx = finite.nonzero()[i].tolist()
        raise AssertionError(
            f"{name}: {int((~ok).sum())}/{ok.numel()} elements outside atol={atol} rtol={rtol} "
            f"({tol}); worst at {idx}: got {g[i].item():.6g}, want {w[i].item():.6g}, "
            f"abs err {err[i].item():.3g}, rel err {rel[i].item():.3g}")
    denom = g.norm() * w.norm()
    if denom > 0:
        cos_dist = 1.0 - float((g * w).sum() / denom)
        if cos_dist > max_cos:
            raise AssertionError(f"{name}: cosine distance {cos_dist:.3g} > {max_cos} ({tol})")


def capture(fn):
    """(CUDA graph, fn's output inside it): one warm-up call on a side stream, then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def count_full_checks(monkeypatch, module, check_name: str, cache_name: str = "_CHECKED") -> list:
    """Counts the calls of `module.check_name` (a public op's full checks) after emptying the op's
    cache of checked call signatures (`module.cache_name`, a quant.validate.CheckedCalls)."""
    from openmla.quant.validate import CheckedCalls
    monkeypatch.setattr(module, cache_name, CheckedCalls())
    calls = []
    real = getattr(module, check_name)
    monkeypatch.setattr(module, check_name, lambda *a: calls.append(1) or real(*a))
    return calls


def invalid_indices(num_slots: int) -> list[int]:
    """Every kind of invalid index for a table of num_slots rows (DESIGN.md: < 0 or >= slots)."""
    return [INT32_MIN, -123456, -1, num_slots, num_slots + 7, INT32_MAX]


def random_paged_cache(num_blocks: int, block_size: int, row_width: int, dtype: torch.dtype,
                       *, extra_rows: int = 1, device=DEVICE, fill_nan: bool = True):
    """A paged cache as a strided view: each block owns block_size + extra_rows rows (FlashMLA's
    tests do this), the view exposes [num_blocks, block_size, row_width]. The hidden rows and, when
    fill_nan, every row start as NaN (bytes 0xFF for uint8) so that reads of unwritten rows show.
    Returns (view, backing tensor)."""
    backing = torch.empty(num_blocks, block_size + extra_rows, row_width, dtype=dtype, device=device)
    if dtype == torch.uint8:
        backing.fill_(0xFF)  # 0xFF as fp8 e4m3fn is NaN; as fp32 scale bytes, NaN too
    elif fill_nan:
        backing.fill_(float("nan"))
    else:
        backing.normal_()
    return backing[:, :block_size, :], backing


def shuffled_block_table(num_requests: int, blocks_per_request: int, num_blocks: int,
                         generator: torch.Generator | None = None, device=DEVICE) -> torch.Tensor:
    """[num_requests, blocks_per_request] int32 of distinct physical blocks in random order."""
    need = num_requests * blocks_per_request
    if need > num_blocks:
        raise ValueError(f"num_blocks: expected >= {need}, got {num_blocks}")
    perm = torch.randperm(num_blocks, generator=generator)[:need]
    return perm.view(num_requests, blocks_per_request).to(torch.int32).to(device)


def nan_filled(shape, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of NaN (bytes 0x7F for float8_e4m3fn, one of its NaN encodings)."""
    t = torch.empty(shape, dtype=dtype)
    if dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)
    else:
        t.fill_(float("nan"))
    return t


def prefix_sharing_block_table(nblk: list[int], shared_blocks: int, spare_blocks: int,
                               generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """A shuffled block table whose requests share their first `shared_blocks` physical blocks.

    nblk: blocks used by each request (each >= shared_blocks). Returns (table [R, max(nblk) + 1]
    int32 CPU, num_blocks): unused entries hold invalid ids (INT32_MAX, -7), never to be read,
    and `spare_blocks` of the num_blocks physical blocks are referenced by no request."""
    assert all(n >= shared_blocks for n in nblk)
    R = len(nblk)
    M = max(nblk + [0]) + 1  # one column more than any request needs
    need = shared_blocks + sum(n - shared_blocks for n in nblk)
    num_blocks = need + spare_blocks
    ids = torch.randperm(num_blocks, generator=generator)[:need].to(torch.int32)
    table = torch.empty(R, M, dtype=torch.int32)
    table[:, 0::2], table[:, 1::2] = INT32_MAX, -7  # unused entries: invalid, never read
    pos = shared_blocks
    for r, n in enumerate(nblk):
        table[r, :shared_blocks] = ids[:shared_blocks]
        table[r, shared_blocks:n] = ids[pos:pos + n - shared_blocks]
        pos += n - shared_blocks
    return table, num_blocks


FP8_SCALES = (0.027, 0.019)  # paged_batch's fp8 k_scale, v_scale; stored values are x * 40


def put_rows(cache, layout: str, blk, off, rows) -> None:
    """cache[blk[i], off[i]] = rows[i] (token rows [n, H_kv, D]) in a paged cache laid out as
    "NHD" [num_blocks, block_size, H_kv, D] or "HND" [num_blocks, H_kv, block_size, D]."""
    if layout == "NHD":
        cache[blk, off] = rows
    else:
        cache[blk, :, off] = rows


def paged_batch(seqs, H, H_kv, D, bs, *, cache="bf16", shared_blocks=0, pad_rows=2,
                layout="NHD", spare_blocks=3, seed=0):
    """Requests (q_len, kv_len) over NaN-filled paged caches holding all their keys/values.

    Adversarial as STYLE.md 12: the caches are strided views (a hidden row per block) of
    NaN-filled backings with spare blocks, the block table is shuffled with invalid ids in unused
    columns, q [T + pad_rows, H, D] bf16 is a strided view, padding rows follow the last request.
    The first `shared_blocks` table entries of every request are the same physical blocks
    (a shared prefix). cache: "bf16", or "fp8" (float8_e4m3fn holding x * 40, FP8_SCALES).
    layout: "NHD" or "HND". Returns a dict of paged_attention's arguments (q, k_cache, v_cache,
    block_table, cu_seqlens_q, seq_lens, k_scale, v_scale, layout)."""
    g = torch.Generator().manual_seed(seed)
    cdt = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
    nblk = [math.ceil(kv / bs) for _, kv in seqs]
    table, num_blocks = prefix_sharing_block_table(nblk, shared_blocks, spare_blocks, g)
    rows = bs + 1  # a hidden row per block: the view's block stride exceeds block_size rows
    shape = (num_blocks, rows, H_kv, D) if layout == "NHD" else (num_blocks, H_kv, rows, D)
    backings = [nan_filled(shape, cdt) for _ in range(2)]
    visible = (lambda x: x[:, :bs]) if layout == "NHD" else (lambda x: x[:, :, :bs])  # noqa: E731
    kc, vc = (visible(x) for x in backings)
    longest = max([kv for _, kv in seqs] + [0])
    # Position p of every request holds the same shared values while p is in a shared block.
    shared_k = torch.randn(longest, H_kv, D, generator=g)
    shared_v = torch.randn(longest, H_kv, D, generator=g)
    for r, (_, kv) in enumerate(seqs):
        p = torch.arange(kv)
        k = torch.randn(kv, H_kv, D, generator=g)
        v = torch.randn(kv, H_kv, D, generator=g)
        in_shared = p < shared_blocks * bs
        k[in_shared], v[in_shared] = shared_k[:kv][in_shared], shared_v[:kv][in_shared]
        if cache == "fp8":
            k, v = k * 40, v * 40
        blk, off = table[r, p // bs].long(), p % bs
        put_rows(kc, layout, blk, off, k.to(cdt))
        put_rows(vc, layout, blk, off, v.to(cdt))
    T = sum(q for q, _ in seqs)
    wide = torch.randn(T + pad_rows, H, D + 24, generator=g)
    q = wide.to(torch.bfloat16).to(DEVICE)[:, :, 8:8 + D]  # strides of a wider tensor
    cu = torch.tensor([0] + [q_len for q_len, _ in seqs]).cumsum(0).to(torch.int32)
    lens = torch.tensor([kv for _, kv in seqs], dtype=torch.int32)
    scales = (None, None)
    if cache == "fp8":
        scales = tuple(torch.tensor([s], device=DEVICE) for s in FP8_SCALES)
    # Move the backings, then take the views: the device caches keep their hidden rows.
    kc, vc = (visible(x.to(DEVICE)) for x in backings)
    return dict(q=q, k_cache=kc, v_cache=vc,
                block_table=table.to(DEVICE), cu_seqlens_q=cu.to(DEVICE),
                seq_lens=lens.to(DEVICE), k_scale=scales[0], v_scale=scales[1], layout=layout)


def attention_options(H: int, D: int, *, scale_factor: float, seed: int, sinks: bool = False,
                      softcap: float = 0.0) -> dict:
    """paged_attention options with a non-default scale (scale_factor / sqrt(D)), softcap and,
    with sinks=True, random sinks [H] fp32 (seeded by seed)."""
    g = torch.Generator().manual_seed(seed)
    opts = dict(scale=scale_factor / math.sqrt(D), softcap=softcap)
    if sinks:
        opts["sinks"] = (torch.randn(H, generator=g) * 2).to(DEVICE)
    return opts


# The compile server: a child process (no interpreter) that reads one JSON request a line, compiles
# the Gluon kernel it names for sm_90a and answers one line, "RESULT <json>" or "ERROR <traceback>"
# (other lines on its stdout are Triton's prints). One per test process, started on first use, so
# that torch, Triton and openmla are imported once, not once a compile.
_COMPILE_SM90 = """
import importlib, json, os, re, subprocess, sys, tempfile, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource


def compile_one(module, name, const, ptrs, warps, named):
    fn = getattr(importlib.import_module(module), name)
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in const:
            sig[arg] = "constexpr"
        elif arg in named:
            sig[arg] = named[arg]
            if not named[arg].startswith("tensordesc"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif i < len(ptrs):
            sig[arg], attrs[(i,)] = ptrs[i], [["tt.divisibility", 16]]
        else:
            sig[arg] = "fp32" if "scale" in arg else "i32"
    k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = map(int, re.search(r"REG:(\\d+) STACK:(\\d+)", usage).groups())
    return dict(shared=k.metadata.shared, regs=regs, stack=stack, hgmma=sass.count("HGMMA"),
                ldgsts128=sass.count("LDGSTS.E.BYPASS.128"), ldgsts=sass.count("LDGSTS"),
                ldg128=len(re.findall(r"LDG\\.E[.A-Z0-9_]*\\.128", sass)),
                stg128=len(re.findall(r"STG\\.E[.A-Z0-9_]*\\.128", sass)),
                tma_store=sass.count("UTMASTG"), tma_load=sass.count("UTMALDG"))


for line in sys.stdin:
    try:
        out = "RESULT " + json.dumps(compile_one(*json.loads(line)))
    except Exception:
        out = "ERROR " + json.dumps(traceback.format_exc())
    print(out, flush=True)
"""
_COMPILE_SERVER: list = []  # [the child process, its stderr file] once started


def _compile_server():
    import atexit
    import subprocess
    import sys
    import tempfile

    if _COMPILE_SERVER and _COMPILE_SERVER[0].poll() is None:
        return _COMPILE_SERVER
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    err = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen([sys.executable, "-c", _COMPILE_SM90], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=root)
    atexit.register(child.kill)
    _COMPILE_SERVER[:] = [child, err]
    return _COMPILE_SERVER


def compile_gluon_sm90(module: str, name: str, const: dict, ptr_types: list, num_warps: int,
                       named_ptrs: Optional[dict] = None) -> dict:
    """Compile a Gluon kernel for sm_90a without a GPU (ptxas ships with Triton) and return its
    shared memory, registers, spill stack and SASS counts (wgmma, cp.async). Gluon does not run
    in the interpreter, which also replaces jit functions in this process: a child process (the
    compile server above) compiles it.
    ptr_types: the types of the leading (pointer) arguments; named_ptrs: {argument: type} for
    arguments further on that a launch specializes as multiples of 16 (pointers, or int strides),
    or tensor descriptors (their `triton.runtime.jit.mangle_type`)."""
    import json

    child, err = _compile_server()
    child.stdin.write(json.dumps([module, name, const, ptr_types, num_warps, named_ptrs or {}]) + "\n")
    child.stdin.flush()
    for line in child.stdout:
        kind, _, payload = line.rstrip("\n").partition(" ")
        if kind in ("RESULT", "ERROR"):
            break
    else:  # the child exited
        err.seek(0)
        raise AssertionError(f"the compile server exited ({child.wait()}):\n{err.read()[-3000:]}")
    assert kind == "RESULT", json.loads(payload)[-3000:]
    return json.loads(payload)
