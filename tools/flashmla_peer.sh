# Source this on the GPU machine to make FlashMLA importable for tools/bench.py, which then times it
# beside openmla in the same run (the "FlashMLA ms" and "ratio" columns). Nothing is fetched: the
# wheel comes from .whl/ at the checkout's root, downloaded beforehand on a machine with network:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .whl sgl-flash-mla==1.0.0
# and is installed into a folder outside the checkout ($FLASHMLA_PEER_DIR, default
# /tmp/openmla-flashmla-peer) that goes on PYTHONPATH:
#   . tools/flashmla_peer.sh && python3 tools/bench.py --op sparse_mla_decode,sparse_mla_prefill
# --no-deps: the wheel's metadata asks for torch >= 2.14.1, but it is built against torch's stable
# C++ ABI (abi3) and runs on the machine's older torch; pip must not try to replace that torch.
# FlashMLA is never a dependency of openmla or its tests (pyproject's `bench` extra is optional).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "flashmla_peer.sh: source it (. tools/flashmla_peer.sh) so that PYTHONPATH reaches your shell" >&2
  exit 2
fi
_openmla_flashmla_peer() {
  unset -f _openmla_flashmla_peer
  local root dir whl
  root=$(cd "$(dirname "$1")/.." && pwd)
  dir=${FLASHMLA_PEER_DIR:-/tmp/openmla-flashmla-peer}
  whl=$(ls "$root"/.whl/sgl_flash_mla-*.whl 2>/dev/null | sort | tail -n 1)
  if [ -z "$whl" ]; then
    echo "flashmla_peer.sh: no sgl_flash_mla-*.whl in $root/.whl (download it there first: see this script's header)" >&2
    return 1
  fi
  if ! PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-deps --no-index --upgrade --target "$dir" "$whl"; then
    echo "flashmla_peer.sh: pip could not install $whl into $dir" >&2
    return 1
  fi
  export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}"
  # Say what bench.py will find (an import failure is reported, not fatal: bench says "not measured").
  python3 -c 'import flash_mla; print("flashmla_peer.sh: flash_mla", flash_mla.__version__, "from", flash_mla.__file__, "legacy (sm90, V3.2 format):", flash_mla.has_legacy())' \
    || echo "flashmla_peer.sh: flash_mla installed in $dir but does not import; bench.py will say why" >&2
}
_openmla_flashmla_peer "${BASH_SOURCE[0]}"
