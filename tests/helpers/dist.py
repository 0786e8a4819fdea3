"""Multi-process tests on the CPU: gloo ranks started by torch.multiprocessing.spawn.

A rank that finished its work leaves through `leave_rank`: its output is on disk and its process
group destroyed, so it exits at once (os._exit) instead of running the interpreter's and C++'s
teardown of torch.distributed's threads (the gloo pairs, rank 0's TCPStore server), which can
abort a finished rank with "terminate called without an active exception" (seen once, in CI on
2026-11-25: tests/tools/test_bench_dcp.py, rank 0 after writing its JSON; not in 56 local reruns). A rank that raised
does not get here: spawn reports its traceback as before."""
import os
import socket
import sys

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, n: int, *args) -> None:
    """fn(rank, n, port, *args) in n processes (spawn); raises if any rank failed."""
    mp.spawn(fn, args=(n, free_port(), *args), nprocs=n)


def leave_rank() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
