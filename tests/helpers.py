"""Shared test helpers: one assert_close with one tolerance table, adversarial inputs (STYLE.md 12-13)."""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

# name -> (atol, rtol, max cosine distance). An element passes if abs err <= atol OR
# rel err <= rtol (the issues' "abs err <= a or rel err <= r elementwise").
TOLERANCES = {
    "exact": (0.0, 0.0, 1e-12),  # cosine of identical tensors rounds to ~2e-16
    "fp32": (1e-5, 1e-5, 1e-7),
    "lse": (1e-5, 0.0, 1e-7),
    "sparse_decode": (1e-3, 2 / 128, 1e-5),
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
