"""The pieces of tools/bench.py that its op modules (tools/_bench_mla.py, tools/_bench_mha.py,
tools/_bench_peer.py) need: the Case, Op and Peer records, the registry, and the relative error.
bench.py re-exports all of them.

Importing this module first also decides GPU or interpreter, before triton is imported anywhere.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

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
    ms: float = float("nan")  # CUDA-graph replay (kernel time)
    eager_ms: float = float("nan")  # wall time per eager call (host overhead included)
    ref_ms: float = float("nan")
    peer_ms: float = float("nan")  # FlashMLA, CUDA-graph replay, same tensors, same process
    peer_eager_ms: float = float("nan")  # FlashMLA, wall time per eager call
    rel_err: float = float("nan")
    extra: dict = field(default_factory=dict)


class NotMeasured(Exception):
    """A peer cannot run this case (e.g. a cache format it does not read); the message says why."""


@dataclass
class Peer:
    """How to run an op's FlashMLA counterpart on the op's own inputs (tools/_bench_peer.py).

    prepare(x, flash_mla) -> px: the peer's inputs made from the case's tensors (views where the
        layouts agree, q copied into a head-padded buffer where FlashMLA needs 64 or 128 heads),
        outside the timing; raises NotMeasured when the peer cannot run the case.
    call(px) -> the peer's raw outputs: the one call that is timed.
    unpad(px, raw) -> (out, lse) in the op's layout and openmla's conventions, real heads only.
    ours(x) -> (out, lse) of the openmla op on the same inputs, same layout.
    """

    name: str
    prepare: Callable
    call: Callable
    unpad: Callable
    ours: Callable


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
    # FlashMLA's counterpart, timed and compared beside the op when flash_mla is importable
    peer: Optional[Peer] = None
    # inputs -> a function that runs the op as an engine replays it from a CUDA graph (the host
    # work before each replay, then the replay), timed like eager calls into `captured ms`
    captured: Optional[Callable] = None


REGISTRY: dict[str, Op] = {}


def register(op: Op) -> Op:
    REGISTRY[op.name] = op
    return op


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())
