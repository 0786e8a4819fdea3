"""Device facts the launch heuristics need, read once per device (no host sync: properties only)."""
from __future__ import annotations

import torch

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
