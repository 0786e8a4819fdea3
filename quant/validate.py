"""The one validation helper used at every public boundary (STYLE.md 5)."""
from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional, Sequence

import torch


def fail(name: str, want, got) -> None:
    raise ValueError(f"{name}: expected {want}, got {got}")


def check_scale(name: str, value) -> float:
    """A softmax scale given as a host number, the one rule of every attention op
    (kernels/__init__.py): a real (not bool, not a tensor or string), finite and nonzero (0 would
    make every score equal, and the sparse prefill kernels, which keep the largest raw q.k, cannot
    represent it). Returns it as a float; ValueError naming `name` otherwise."""
    want = "a finite nonzero float"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(name, want, repr(value))
    v = float(value)
    if not math.isfinite(v) or v == 0:
        fail(name, want, repr(value))
    return v


def check_quant_scale(name: str, value) -> float:
    """A per-tensor fp8 cache scale (k_scale / v_scale: the cache holds e4m3fn(rne(x / scale)))
    given as a host value (a real, or a one-element tensor the caller has already read): finite and
    > 0. A scale of 0 would saturate every element to +-448, a negative one flip every sign, NaN or
    inf write NaN or 0 for every element. Returns it as a float; ValueError naming `name` otherwise."""
    want = "a finite scale > 0"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            fail(f"{name}.numel()", 1, value.numel())
        value = value.reshape(()).item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(name, want, repr(value))
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        fail(name, want, repr(value))
    return v


def check_out(out, q: torch.Tensor, d_v: int) -> torch.Tensor:
    """The `out=` argument of an attention op over q [T, H, *] (kernels/__init__.py): None
    allocates [T, H, d_v] in q's dtype; a given tensor must have that shape and dtype and a
    contiguous last dim (other strides free). Returns the tensor the op writes. Its device is
    checked with the op's other tensors (check_same_device)."""
    T, H = q.shape[0], q.shape[1]
    if out is None:
        return torch.empty((T, H, d_v), dtype=q.dtype, device=q.device)
    return check_tensor("out", out, dtype=q.dtype, shape=(T, H, d_v), last_dim_contiguous=True)


def check_tensor(
    name: str,
    t,
    *,
    dtype: Optional[torch.dtype | Iterable[torch.dtype]] = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument; raise ValueError naming it, the expected and the actual value.

    `shape` entries that are None match any size. Returns the tensor for chaining.
    """
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = allowed[0] if len(allowed) == 1 else " or ".join(str(d) for d in allowed)
            fail(f"{name}.dtype", want, t.dtype)
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        fail(f"{name}.dim()", ndim, f"{t.dim()} (shape {tuple(t.shape)})")
    if shape is not None:
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                parts = ["*" if s is None else str(s) for s in shape]
                pretty = "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
                fail(f"{name}.shape", pretty, tuple(t.shape))
    if device is not None and t.device != torch.device(device):
        fail(f"{name}.device", torch.device(device), t.device)
    if contiguous and not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()} for shape {tuple(t.shape)}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(f"{name}.stride(-1)", 1, t.stride(-1))
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All given tensors (None skipped) live on one device; returns it."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.device != first.device:
            fail(f"{n}.device", f"{first.device} (the device of {first_name})", t.device)
    return first.device


def tensor_signature(t):
    """What check_tensor and check_same_device can read from a tensor argument: its type, dtype,
    shape, strides and device (None for None). Public ops key a cache of call signatures that
    passed their checks on tuples of these, so that a repeated call skips checks it provably
    passes again; a non-tensor raises AttributeError (the caller then runs the full checks)."""
    return None if t is None else (type(t), t.dtype, t.shape, t.stride(), t.device)


class CheckedCalls(dict):
    """Call signatures (tuples of tensor_signature and the other arguments the checks read) that
    passed a public op's checks, each with what the op keeps for it (the resolved format, a
    plan). A dict that `remember` keeps below `limit` entries by starting over (signatures that
    never repeat must not grow it without bound). An entry should hold any object that its
    signature names by id(), so that no other object can take that id while the entry exists."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def remember(self, sig, entry=True) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[sig] = entry
