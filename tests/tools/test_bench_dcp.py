"""tools/bench_dcp.py on the CPU: 2 gloo ranks, tiny shapes, the interpreter with tests/conftest.py's
corrections loaded in every rank, so the tool's own check (the DCP step's output against one rank
holding every token) is meaningful here; timings are not. Both layer kinds run through the tool's
rank entry point (what torchrun and --nproc call) and rank 0 writes the JSON rows."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.dist import leave_rank, spawn_ranks


def _rank(rank, n, port, out):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import tests.conftest  # noqa: F401  (interpreter corrections, in this process too)
    from openmla.tools import bench_dcp
    args = SimpleNamespace(layer=["mha", "sparse"], batch=2, context=40, heads=2, topk=12,
                           interleave=2, iters=1, out=out)
    bench_dcp._rank_main(rank, n, args, port)
    leave_rank()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine tools/bench_dcp.py runs NCCL with one "
                    "GPU a rank (run it by hand: --nproc N); this test is its CPU path (gloo, interpreter)")
def test_bench_dcp_two_ranks(tmp_path):
    out = tmp_path / "dcp.json"
    spawn_ranks(_rank, 2, str(out))
    rows = json.loads(out.read_text())
    assert [r["layer"] for r in rows] == ["mha", "sparse"]
    for r in rows:
        assert r["ranks"] == 2 and r["interleave"] == 2
        assert r["max_err"] <= 2e-2, r  # the tool's check, with correct bf16 arithmetic
        for k in ("one_ms", "dcp_ms", "gather_ms", "merge_ms"):
            assert r[k] > 0
        assert 0 < r["share"] < 1
