"""Device facts the launch heuristics need, read once per device (no host sync: properties only)."""
from __future__ import annotations

import importlib.util
import os

import torch
import triton

_SM_COUNT: dict = {}


def num_sms(device) -> int:
    """Multiprocessor count of a device (torch.device or str; cached). Elsewhere than CUDA (the CPU
    interpreter) it pretends to have 8, so that the split paths (split-K, split-KV) and the
    decisions made from it are exercised by the CPU tests with small shapes."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


_HAS_GLUON = importlib.util.find_spec("triton.experimental.gluon") is not None


def sm90_gluon(device) -> bool:
    """Whether the Hopper Gluon kernels (kernels/_*_sm90.py) may run on `device`: a CUDA device of
    compute capability 9.x, a Triton with Gluon, not the interpreter (Gluon does not run there),
    and not switched off with OPENMLA_SM90_GLUON=0."""
    device = torch.device(device)
    if not _HAS_GLUON or device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    if os.environ.get("OPENMLA_SM90_GLUON", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] == 9
