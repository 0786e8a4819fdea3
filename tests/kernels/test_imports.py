"""Import order does not change what the package runs: the Gluon (sm_90) kernel modules catch an
ImportError to run without Gluon, so a circular import between the kernel packages would switch
Hopper's kernels off without a word (it did once: the prefill's split merge took `sink_factor` from
the decode package, whose bf16 kernel imports the prefill kernel's row copy). In a child process
without the interpreter, each package in turn is imported first into a fresh set of openmla
modules, then every Gluon module's flag is read: all must say whether this Triton has Gluon."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLUON_MODULES = [
    "openmla.kernels.sparse_mla_decode.sm90", "openmla.kernels.sparse_mla_decode.sm90_kn",
    "openmla.kernels.sparse_mla_decode.sm90_bf16", "openmla.kernels.sparse_mla_decode.sm90_bf16_kn",
    "openmla.kernels.sparse_mla_prefill.sm90", "openmla.kernels.sparse_mla_prefill.sm90_kn",
]
FIRST = ["openmla.kernels.sparse_mla_prefill", "openmla.kernels.sparse_mla_prefill.tail",
         "openmla.kernels.sparse_mla_decode", "openmla.kernels.sparse_mla_decode.shared", "openmla.kernels.merge",
         "openmla.kernels.softmax", "openmla.mla", "openmla.kernels.indexer", "openmla"]

_CHILD = """
import importlib, json, sys
first, mods = json.loads(sys.argv[1])
seen = {}
for f in first:
    for name in [m for m in sys.modules if m == "openmla" or m.startswith("openmla.")]:
        del sys.modules[name]
    importlib.import_module(f)
    seen[f] = [importlib.import_module(m)._GLUON for m in mods]
print(json.dumps(seen))
"""


def test_gluon_kernels_whatever_is_imported_first():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([FIRST, GLUON_MODULES])],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    want = importlib.util.find_spec("triton.experimental.gluon") is not None
    bad = {f: [m for m, ok in zip(GLUON_MODULES, flags) if ok != want] for f, flags in seen.items()}
    assert not any(bad.values()), f"Gluon modules whose flag is not {want} after importing first: {bad}"
