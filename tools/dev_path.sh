# Source this on a machine where openmla is not installed (the GPU machines: no pip install
# there): it makes `import openmla` resolve to this checkout without installing anything, through
# a temporary folder holding openmla/{kernels,mla,quant,tools} as links to the checkout's folders,
# put on PYTHONPATH with the checkout itself (for `tests`).
#   . tools/dev_path.sh && python3 -m pytest tests -q
_openmla_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_openmla_site=$(mktemp -d /tmp/openmla-path.XXXXXX)
mkdir "$_openmla_site/openmla"
for _d in kernels mla quant tools; do ln -s "$_openmla_root/$_d" "$_openmla_site/openmla/$_d"; done
export PYTHONPATH="$_openmla_site:$_openmla_root${PYTHONPATH:+:$PYTHONPATH}"
unset _d _openmla_root _openmla_site
