"""The pieces of tools/bench.py that its op modules (tools/_bench_mla.py, tools/_bench_mha.py) need:
the Case and Op records, the registry, and the relative error. bench.py re-exports all of them.

Importing this module first also decides GPU or interpreter, before triton is imported anywhere.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch

# No GPU: run the kernels in Triton's interpreter (set before triton is imported).
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"


@dataclass
class Case:
    """One timed configuration. `params` are the op's shape parameters (JSON-able)."""

    op: str
    name: str
    params: dict
    flops: float = 0.0
    bytes: float = 0.0
    # filled by the run
    ms: float = float("nan")
    ref_ms: float = float("nan")
    rel_err: float = float("nan")
    extra: dict = field(default_factory=dict)


@dataclass
class Op:
    """A benchmarked op: how to build a case's inputs, run it, run the torch reference, check it."""

    name: str
    shape_sets: dict  # set name -> list of params dicts
    build: Callable  # params, device -> inputs dict
    run: Callable  # inputs -> output tensor (the one checked)
    torch_ref: Callable  # inputs -> output tensor (bf16 gather + matmul)
    error: Callable  # inputs, op output -> relative error against the oracle (0 = exact)
    count: Callable  # params -> (flops, bytes)
    label: Callable  # params -> case name
    # params -> True when the op's result does not depend on the Triton interpreter's numeric
    # defects (integer work, fp32 math, plain copies), so a CPU run can check it
    interpreter_exact: Callable = lambda p: False


REGISTRY: dict[str, Op] = {}


def register(op: Op) -> Op:
    REGISTRY[op.name] = op
    return op


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())
