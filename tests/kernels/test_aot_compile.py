"""Every kernel compiles ahead of time, on the CPU, for the GPU generations the README lists:
NVIDIA sm_80, sm_86, sm_89, sm_90, sm_100, sm_120 (Triton ships ptxas) and AMD gfx942, gfx950
(Triton's AMD backend assembles and links in-process; all eight in the full set, five in the
default run), in what the dispatch picks there
(tests/kernels/aot_compile.py says how launches are captured; aot_cases.py lists the shape
classes). A compile failure, a config whose shared memory exceeds the target's, a dispatch that
raises, a Gluon kernel picked off sm_90, or a kernel of kernels/ or quant/ that no case reaches
fails the test.

The default run (CORE classes on five targets, DEFAULT_TARGETS: sm_80, sm_90, sm_100, sm_120,
gfx942; EXTRA and SM90_EXTRA on sm_90, where they reach the Gluon kernels CORE does not) is the
suite's largest item (README, CI timing) and runs the targets in parallel, one per core
(tests/conftest.py hands this file out first under pytest-xdist, so the other worker runs the rest
of the suite meanwhile). The full set
(every shape class and every autotune candidate on all eight targets) is marked aot_full and runs with
    OPENMLA_AOT_FULL=1 python -m pytest tests/kernels/test_aot_compile.py -m aot_full
Only there since 2026-11-28: EXTRA on sm_80 (the Triton kernels and branches that sm_90's
OPENMLA_SM90_GLUON=0 pass compiles too, none at a shared-memory limit; see aot_cases.py).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

import pytest

from openmla.kernels.device import ARCHES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = list(ARCHES)
# Targets whose dispatch choices another default target makes too, compiled in the full set only:
# sm_86 and sm_89 (99 KB of shared memory like sm_120, e4m3 by bit arithmetic like sm_80 / by
# PTX like sm_120; Ampere's code generation is sm_80's) and gfx950 (gfx942's AMD back end, with
# sm_80-sized configs).
FULL_ONLY = ("sm_86", "sm_89", "gfx950")
DEFAULT_TARGETS = [a for a in TARGETS if a not in FULL_ONLY]
FULL = os.environ.get("OPENMLA_AOT_FULL", "0") == "1"


def _compile_target(arch: str, full: bool) -> list:
    """Run aot_compile.py for one target in a child process (no interpreter) -> its JSON lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OPENMLA_SM90_GLUON")}
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
        cmd = [sys.executable, "-m", "tests.kernels.aot_compile", arch, "--out", out.name]
        run = subprocess.run(cmd + (["--full"] if full else []), cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert run.returncode == 0, f"{arch}: aot_compile.py exited {run.returncode}:\n" \
                                    f"{run.stderr[-3000:]}"
        with open(out.name) as f:
            return [json.loads(line) for line in f]


def _compile_all(full: bool) -> dict:
    targets = TARGETS if full else DEFAULT_TARGETS
    workers = max(1, min(len(targets), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        jobs = {arch: pool.submit(_compile_target, arch, full) for arch in targets}
        return {arch: job.result() for arch, job in jobs.items()}


@pytest.fixture(scope="module")
def default_results():
    return _compile_all(full=False)


@pytest.fixture(scope="module")
def full_results():
    return _compile_all(full=True)


def _check_target(arch: str, lines: list) -> set:
    """Assert one target's results; returns the kernels it compiled."""
    *compiles, summary = lines
    assert "kernels" in summary, f"{arch}: the run stopped before its summary line"
    smem, found = summary["smem_bytes"], summary["kernels"]
    failed = [c for c in compiles if not c["ok"]]
    assert not failed, f"{arch}: {len(failed)} of {len(compiles)} compiles failed; first: " \
                       f"{failed[0]['case']} {failed[0]['kernel']} {failed[0].get('config')}\n" \
                       f"{failed[0]['error']}"
    too_big = [c for c in compiles if c["shared"] > smem]
    assert not too_big, f"{arch}: shared memory over the {smem} bytes a program may use: " + \
        "; ".join(f"{c['case']} {c['kernel']} {c['config']}: {c['shared']}" for c in too_big)
    compiled = {c["kernel"] for c in compiles}
    gluon = {k for k, is_gluon in found.items() if is_gluon}
    with mock.patch.dict(os.environ):
        os.environ.pop("OPENMLA_SM90_GLUON", None)  # the child runs without it (_compile_target)
        gluon_target = ARCHES[arch].gluon_sm90
    if gluon_target:
        assert gluon <= compiled, f"{arch}: Gluon kernels not reached: {sorted(gluon - compiled)}"
    else:
        assert not compiled & gluon, f"{arch}: the dispatch picked Gluon kernels off sm_90: " \
                                     f"{sorted(compiled & gluon)}"
    unknown = compiled - set(found)
    assert not unknown, f"{arch}: compiled kernels the discovery missed: {sorted(unknown)}"
    return compiled


@pytest.mark.parametrize("arch", DEFAULT_TARGETS)
def test_aot_compile(arch, default_results):
    _check_target(arch, default_results[arch])


def test_aot_compile_reaches_every_kernel(default_results):
    """Over the default set's targets together, every kernel of kernels/ and quant/ compiles."""
    found = default_results[DEFAULT_TARGETS[0]][-1]["kernels"]
    compiled = set().union(*(_check_target(a, r) for a, r in default_results.items()))
    assert set(found) - compiled == set(), f"kernels no default case reaches: " \
                                           f"{sorted(set(found) - compiled)}"


@pytest.mark.aot_full
@pytest.mark.skipif(not FULL, reason="the full set (every shape class and autotune candidate on "
                                     "8 targets) takes CPU-hours; OPENMLA_AOT_FULL=1 runs it")
@pytest.mark.parametrize("arch", TARGETS)
def test_aot_compile_full(arch, full_results):
    """Every shape class and autotune candidate on this target; every kernel compiles here
    (Gluon kernels on sm_90 only)."""
    compiled = _check_target(arch, full_results[arch])
    found = full_results[arch][-1]["kernels"]
    want = {k for k, is_gluon in found.items() if ARCHES[arch].gluon_sm90 or not is_gluon}
    assert want <= compiled, f"{arch}: kernels no case reaches: {sorted(want - compiled)}"
