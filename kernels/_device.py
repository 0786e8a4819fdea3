"""Device facts the launch heuristics need, read once per device (no host sync: properties only)."""
from __future__ import annotations

import torch

_SM_COUNT: dict = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessor count (cached). The CPU interpreter pretends to have 8, so that the split
    paths (split-K, split-KV) are exercised by the CPU tests with small shapes."""
    if device.type != "cuda":
        return 8
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]
