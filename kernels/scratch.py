"""Reusable fp32 scratch for split partials: an eager call allocates only its outputs.

A decode that splits its keys over programs writes per-split partial outputs and lse, which its
merge reads right after, on the same stream. Those buffers need not be new on every call: each
(device, stream, host thread) keeps one flat fp32 buffer, grown to the largest request seen, and
each launch plan keeps its views of it (a slice and a view cost about what an allocation does,
so the views are made once, not per call).

Why this is safe: kernels on one stream run in launch order, so the next call's writes come after
this call's merge has read. The host thread is part of the key because two threads launching on
one stream could interleave one call's decode and merge with another call's. While a CUDA graph
is being captured the buffers are allocated as before (the graph's private pool owns them and
keeps them for its replays, which may run while eager calls do).

Memory: one buffer per (device, stream, thread), the largest partials of any call made there
(a few MB to ~35 MB for 64-128 heads), held until `release()`.
"""
from __future__ import annotations

import itertools
import math
import threading

import torch

__all__ = ["PLAN_IDS", "partials", "release"]

# Plan numbers: each op's launch plans take theirs from here, so that no two plans of any op share
# one (the scratch views below are kept by plan number)
PLAN_IDS = itertools.count()

_ALIGN = 32  # floats: each view starts on 128 bytes (launch keys assume 16-byte aligned pointers)
_BUFS: dict = {}   # (device, stream, thread) -> flat fp32 buffer
_VIEWS: dict = {}  # (plan id, device, stream, thread) -> (buffer, views)
_MAX_VIEWS = 4096

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def partials(pid, device: torch.device, shapes) -> tuple:
    """fp32 tensors of `shapes` (contiguous, disjoint) for the plan numbered `pid` (a number from
    PLAN_IDS, whose plan asks for these shapes on every call): views of this stream's and thread's
    buffer, the same tensors on every call while the buffer stands; new allocations while the
    current CUDA stream is being captured."""
    cuda = device.type == "cuda"
    if cuda and _capturing():
        return tuple(torch.empty(s, dtype=torch.float32, device=device) for s in shapes)
    stream = None
    if cuda:
        stream = _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    where = (device, stream, threading.get_ident())
    buf = _BUFS.get(where)
    hit = _VIEWS.get((pid, where))
    if hit is not None and hit[0] is buf:
        return hit[1]
    sizes = [-(-math.prod(s) // _ALIGN) * _ALIGN for s in shapes]
    need = sum(sizes)
    if buf is None or buf.numel() < need:
        # a larger buffer: the views of the old one go with it (their memory returns to the
        # caching allocator, for this stream, once the calls that hold them are done with it)
        for key in [k for k in list(_VIEWS) if k[1] == where]:  # (list(): one step under the GIL)
            _VIEWS.pop(key, None)
        buf = _BUFS[where] = torch.empty((need,), dtype=torch.float32, device=device)
    views, off = [], 0
    for shape, size in zip(shapes, sizes):
        views.append(buf[off:off + math.prod(shape)].view(shape))
        off += size
    if len(_VIEWS) >= _MAX_VIEWS:  # plans that never repeat: start over
        _VIEWS.clear()
    views = tuple(views)
    _VIEWS[(pid, where)] = (buf, views)
    return views


def release() -> None:
    """Drop every buffer and view (their memory returns to the caching allocator)."""
    _VIEWS.clear()
    _BUFS.clear()
