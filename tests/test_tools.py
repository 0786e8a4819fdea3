"""The sweep tool prints what it computed; the shared checkers catch what they must."""
import json

import pytest
import torch

from quant import FP8_DS_MLA, FP8DSMLAFormat
from tests.helpers import assert_close
from tools import sweep


def test_sweep_default_grid_prints_its_numbers(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert sweep.main(["--tokens", "256", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert {(r["format"], r["data"]) for r in rows} == {
        (f, d) for f in ("fp8_ds_mla", "fp8_ds_mla_raw", "bf16") for d in ("gaussian", "outliers")}
    for r in rows:
        assert f"| {r['format']} | {r['data']} | {r['rel_l2']:.3e} |" in printed
        assert r["rope_exact"]
        if r["format"] == "bf16":
            assert r["rel_l2"] == 0.0 and r["max_abs"] == 0.0
        else:
            # e4m3 keeps 3 mantissa bits: relative step 2^-4 at worst, about 2-3% RMS on random data
            assert 5e-3 < r["rel_l2"] < 6e-2
            assert r["cosine"] > 0.999


def test_sweep_sees_a_corrupted_format():
    class Broken(FP8DSMLAFormat):
        def unpack(self, cache):  # drops the scales: every tile comes back 1/scale times off
            lat, _, rope = self.unpack_parts(cache)
            return torch.cat([lat, rope.float()], dim=-1)

    gen = torch.Generator().manual_seed(1)
    kv_c, k_pe = sweep.make_latents("gaussian", 64, gen)
    good = sweep.round_trip_errors(FP8_DS_MLA, kv_c, k_pe)
    bad = sweep.round_trip_errors(Broken(), kv_c, k_pe)
    assert good["rel_l2"] < 0.05 and bad["rel_l2"] > 1.0


@pytest.mark.parametrize("got, want, msg", [
    pytest.param([1.0, float("nan")], [1.0, 2.0], "NaN positions", id="nan-where-finite"),
    pytest.param([1.0, 2.0], [1.0, float("-inf")], "-inf positions", id="finite-where-neg-inf"),
    pytest.param([float("inf")], [float("-inf")], "inf positions", id="inf-sign"),
    pytest.param([1.0, 2.1], [1.0, 2.0], "outside", id="value"),
    pytest.param([1.0, 2.0, 3.0], [1.0, 2.0], "shape", id="shape"),
])
def test_assert_close_rejects(got, want, msg):
    with pytest.raises(AssertionError, match=msg):
        assert_close("x", torch.tensor(got), torch.tensor(want), "fp32")


def test_assert_close_accepts_within_tolerance():
    w = torch.tensor([1.0, -2.0, float("-inf"), 1e-9])
    assert_close("x", w * (1 + 1e-6), w, "fp32")
    assert_close("x", w + 9e-4, w, "sparse_decode")
