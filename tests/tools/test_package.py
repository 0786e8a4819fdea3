"""The distribution installs one import package, `openmla`: the wheel holds nothing else, and an
installed (non-editable) copy runs an op on its own, with no top-level `kernels`, `quant` or `mla`.

The wheel is built from this checkout with the running interpreter's setuptools (no build
isolation: nothing is downloaded). The fresh venv reaches torch, triton and numpy through a .pth
line naming this interpreter's site-packages; .pth files inside a directory added that way are not
run, so this checkout's editable install does not leak into it."""
import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--no-index", "-q", "-w", str(out), REPO],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = [out / f for f in os.listdir(out) if f.endswith(".whl")]
    return path


def test_wheel_holds_only_openmla(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not (n.startswith("openmla/") or n.split("/")[0].endswith(".dist-info"))]
    assert not outside, outside
    for sub in ("kernels", "quant", "mla", "tools"):
        assert f"openmla/{sub}/__init__.py" in names
    assert "openmla/kernels/sparse_mla_decode/op.py" in names
    meta = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    entry_points = zipfile.ZipFile(wheel).read(meta[0]).decode()
    assert "openmla = openmla.mla.vllm:register" in entry_points
    for script in ("openmla-sweep", "openmla-absorb", "openmla-bench"):
        assert script in entry_points


def test_installed_wheel_runs_an_op_and_has_no_other_top_level(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--target", site, str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(site, "deps.pth"), "w") as f:  # torch, triton, numpy of this interpreter
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import importlib.util, torch\n"
        "for name in ('kernels', 'quant', 'mla', 'tools'):\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "import openmla.kernels.merge as m\n"
        "assert m.__file__.startswith(%r), m.__file__\n"
        "g = torch.Generator().manual_seed(0)\n"
        "a, b = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)\n"
        "la, lb = torch.randn(3, 2, generator=g), torch.randn(3, 2, generator=g)\n"
        "out = torch.empty_like(a)\n"
        "m.merge_attn_states(out, a, la, b, lb)\n"
        "w = torch.sigmoid(la - lb)[..., None]\n"
        "torch.testing.assert_close(out, w * a + (1 - w) * b)\n"
        "print('ok')\n" % site)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")
