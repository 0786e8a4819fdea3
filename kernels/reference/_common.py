"""Pieces shared by the oracles of kernels/reference/: the softmax with a sink, fault marking."""
from __future__ import annotations

from typing import Optional

import torch

from openmla.quant.validate import fail

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int32, torch.int64)
_NEG_INF = float("-inf")
# Largest float64 score/gather block formed at once (elements): 2**24 * 8 B = 128 MiB.
_CHUNK_ELEMS = 1 << 24


def _softmax(s: torch.Tensor, sink: Optional[torch.Tensor] = None):
    """Softmax weights of scores with an optional value-less sink logit.

    s: [..., K] float64, -inf where a key is not counted. sink: broadcastable to s[..., 0]
    (float64) or None.
    Returns (p [..., K] = exp(s) / (sum_k exp(s_k) + exp(sink)),
             lse_keys [...] = log sum_k exp(s_k), natural log, -inf for a row with no key).
    A row whose whole denominator is 0 gets p = 0 (every s there is -inf, so exp(s - 0) = 0).
    """
    lse_keys = torch.logsumexp(s, dim=-1)  # handles all -inf and K = 0 rows: -inf
    denom = lse_keys if sink is None else torch.logaddexp(lse_keys, sink)
    denom = torch.where(denom == _NEG_INF, torch.zeros_like(denom), denom)
    return torch.exp(s - denom.unsqueeze(-1)), lse_keys


def _nan_faults(bad: torch.Tensor, *outs: torch.Tensor) -> None:
    """Set the rows where bad [...] is True to NaN in each output ([...] or [..., D]), in place."""
    for o in outs:
        o.masked_fill_(bad.unsqueeze(-1) if o.dim() > bad.dim() else bad, float("nan"))


def _as_float(name: str, x) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            fail(f"{name}.numel()", 1, x.numel())
        return float(x.reshape(()).item())
    return float(x)
