#!/usr/bin/env bash
# On a GPU machine: the whole test suite natively, then benchmarks. Logs and JSON go to $OUT.
#   OUT=out OPENMLA_REV=$(git rev-parse --short HEAD) tools/gpu_run.sh [bench shape set, default standard] [bench op, default all]
# With the sgl-flash-mla wheel in .whl/ (see tools/flashmla_peer.sh), FlashMLA is installed from it
# (no network) and the benchmarks time it beside openmla.
# OPENMLA_AUTOTUNE=0 for the tests: one config per shape class instead of benchmarking every
# candidate at each new shape (the tests check results, not speed); the benchmarks autotune.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
. "$(dirname "$0")/dev_path.sh"  # openmla importable without an install
if ls "$(dirname "$0")"/../.whl/sgl_flash_mla-*.whl >/dev/null 2>&1; then
  . "$(dirname "$0")/flashmla_peer.sh" >"$OUT/flashmla_peer.log" 2>&1  # not in a pipe: it exports PYTHONPATH
  cat "$OUT/flashmla_peer.log"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
start=$(date +%s)
OPENMLA_AUTOTUNE=0 python3 -m pytest tests -q -p no:cacheprovider -rfE --continue-on-collection-errors ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -40
echo "tests: $(( $(date +%s) - start )) s"
if [ "${1:-standard}" != "none" ]; then
  python3 tools/bench.py --op "${2:-all}" --shapes "${1:-standard}" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
fi
echo "total: $(( $(date +%s) - start )) s"
