"""The tools print what they computed, and a broken format, kernel or op shows (tools/sweep.py,
tools/bench.py, tools/docs.py); plus the shared checker of tests.helpers.

The default paths run end to end: `sweep.main([])`'s grid on the CPU oracles (about 20 s on two
cores), `bench.main(["--shapes", "small"])` (the interpreter without a GPU, natively with one).
"""
import contextlib
import csv
import io
import json
import math
import os
import re
import shutil

import pytest
import torch

from openmla.kernels import reference
from openmla.quant import FP8_DS_MLA, FP8_MODEL1, FP8DSMLAFormat
from tests.helpers import DEVICE, assert_close
from openmla.tools import bench, docs, sweep

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _table_rows(printed: str, first_col: str) -> list[list[str]]:
    """Cells of the markdown table rows of `printed` whose first cell is first_col."""
    rows = []
    for line in printed.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_col:
            rows.append(cells)
    return rows


def _same(printed: str, value: float) -> bool:
    """A printed number (3 significant digits) is the computed one."""
    return math.isclose(float(printed), value, rel_tol=6e-3, abs_tol=1e-300)


# ----------------------------------------------------------------------------------------------
# sweep: the default path
@pytest.fixture(scope="module")
def default_sweep(tmp_path_factory):
    """sweep.main() with no grid options (the README's main job) plus --out json and csv."""
    d = tmp_path_factory.mktemp("sweep")
    out = {"json": d / "sweep.json", "csv": d / "sweep.csv"}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert sweep.main(["--out", str(out["json"]), "--out", str(out["csv"])]) == 0
    return buf.getvalue(), json.loads(out["json"].read_text()), out["csv"]


def test_sweep_default_grid_is_complete(default_sweep):
    _, result, _ = default_sweep
    ready = [f for f in sweep.FORMATS if f.pending is None]
    want = {(f.family, f.name, k, sweep.shape_label(f.family, s))
            for f in ready for k in sweep.DATA_KINDS for s in sweep.GRIDS["default"][f.family]}
    assert {(r["family"], r["format"], r["data"], r["shape"]) for r in result["rows"]} == want
    assert len(result["rows"]) == len(want)
    # the cases come from the registry: every format a bf16 model has (not auto, which is its
    # bf16 row, nor an fp16 model's cache), int8 also with K smoothing; all measured, none pending
    assert [(f.family, f.name) for f in sweep.FORMATS] == [
        ("mla", "bf16"), ("mla", "fp8_ds_mla"), ("mla", "fp8_ds_mla_raw"), ("mla_v4", "fp8_model1"), ("mha", "bf16"),
        ("mha", "fp8"), ("mha", "int8_qkv"), ("mha", "int8_qkv_smooth"), ("mha", "int8_qk"),
        ("mha", "int8_qk_smooth")]
    assert result["pending"] == []
    assert {r["format"] for r in result["rows"] if r["family"] == "mha"} == {
        "bf16", "fp8", "int8_qkv", "int8_qk", "int8_qkv_smooth", "int8_qk_smooth"}


def test_sweep_prints_the_numbers_it_computed(default_sweep):
    printed, result, csv_path = default_sweep
    lines = {}
    for fam in ("mla", "mla_v4", "mha"):
        for cells in _table_rows(printed, fam):
            lines[tuple(cells[1:4])] = cells
    keys = ("rel_l2", "max_abs", "cosine_min", "lse_abs")
    for r in result["rows"]:
        cells = lines[(r["format"], r["data"], r["shape"])]
        expect_kernel = r["kernel_err"] is not None
        assert cells[4] == r["measured"] == ("kernel" if expect_kernel else "oracle")
        for i, key in enumerate(keys):
            assert _same(cells[5 + i], r["vs_bf16"][key]), (r["format"], r["shape"], key)
            assert _same(cells[9 + i], r["vs_fp32"][key]), (r["format"], r["shape"], key)
        assert _same(cells[13], r["format_err"]["rel_l2"])
        assert cells[14] == (f"{r['kernel_err']['rel_l2']:.2e}" if expect_kernel else "n/a (CPU)")
    assert "pending" not in printed
    # the CSV holds the same numbers, one line per row
    with open(csv_path) as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(result["rows"])
    for r, c in zip(result["rows"], table):
        assert (c["status"], c["format"], c["shape"]) == ("ok", r["format"], r["shape"])
        assert float(c["vs_bf16_rel_l2"]) == r["vs_bf16"]["rel_l2"]
        assert float(c["format_err_lse_abs"]) == r["format_err"]["lse_abs"]


def test_sweep_numbers_are_the_oracles(default_sweep):
    """Recompute rows from the oracles directly (decode oracle over the packed cache, paged oracle
    over the fp8 cache), independently of the sweep's own plumbing."""
    _, result, _ = default_sweep
    dev = "cuda" if sweep.GPU else "cpu"
    for row in result["rows"]:
        if (row["family"], row["format"], row["data"]) == ("mla", "fp8_ds_mla", "gaussian"):
            break
    shape = {k: row[k] for k in ("tokens", "heads", "topk", "slots", "block_size")}
    gen = torch.Generator(device=dev).manual_seed(sweep.case_seed(0, "mla", row["shape"], "gaussian"))
    _, x = sweep._mla_inputs(shape, "gaussian", gen, dev)
    cache = FP8_DS_MLA.pack(x["kv_c"], x["k_pe"]).view(-1, shape["block_size"], 656)
    got = reference.sparse_mla_decode_ref(x["q"], cache, x["indices"], scale=192 ** -0.5)
    want = reference.sparse_mla_ref(x["q"], torch.cat([x["kv_c"], x["k_pe"]], -1), x["indices"],
                                    scale=192 ** -0.5)
    rel = float((got[0].double() - want[0].double()).norm() / want[0].double().norm())
    assert math.isclose(row["format_err"]["rel_l2"], rel, rel_tol=1e-9)
    assert math.isclose(row["format_err"]["lse_abs"], float((got[1] - want[2]).abs().max()), rel_tol=1e-6)


def test_sweep_v4_rows_are_the_oracles(default_sweep):
    """The DeepSeek-V4 rows: decode oracle over an FP8_MODEL1 cache packed here, against the
    oracle over the bf16 tokens (nope 448 | rope 64), scale 1/sqrt(512)."""
    _, result, _ = default_sweep
    dev = "cuda" if sweep.GPU else "cpu"
    row = next(r for r in result["rows"] if (r["family"], r["data"]) == ("mla_v4", "outliers"))
    shape = {k: row[k] for k in ("tokens", "heads", "topk", "slots", "block_size")}
    gen = torch.Generator(device=dev).manual_seed(sweep.case_seed(0, "mla_v4", row["shape"], "outliers"))
    _, x = sweep._mla_v4_inputs(shape, "outliers", gen, dev)
    assert x["q"].shape[-1] == x["k"].shape[-1] == 512 and x["k"].dtype == torch.bfloat16
    cache = FP8_MODEL1.pack(x["k"].view(-1, shape["block_size"], 1, 512))
    got = reference.sparse_mla_decode_ref(x["q"], cache, x["indices"], scale=512 ** -0.5)
    want = reference.sparse_mla_ref(x["q"], x["k"], x["indices"], scale=512 ** -0.5)
    rel = float((got[0].double() - want[0].double()).norm() / want[0].double().norm())
    assert math.isclose(row["format_err"]["rel_l2"], rel, rel_tol=1e-9)
    assert 5e-3 < rel < 0.3


def test_sweep_round_trip_of_the_v4_format():
    kv_c, k_pe = sweep.make_latents("outliers", 64, torch.Generator().manual_seed(2))
    r = sweep.round_trip_errors(FP8_MODEL1, kv_c, k_pe)
    assert r["rope_exact"] and 5e-3 < r["latent_rel_l2"] < 0.1 and r["cosine"] > 0.999
    k = torch.cat([kv_c[:, :448], k_pe], -1).double()  # the errors are those of the 512-wide token
    back = FP8_MODEL1.unpack(FP8_MODEL1.pack(k.bfloat16().view(-1, 1, 512))).view(-1, 512).double()
    assert math.isclose(r["rel_l2"], float((back - k).norm() / k.norm()), rel_tol=1e-12)


def test_sweep_values_are_plausible(default_sweep):
    _, result, _ = default_sweep
    for r in result["rows"]:
        if r["format"] == "bf16":  # the bf16 cache holds the bf16 inputs exactly
            assert r["format_err"]["rel_l2"] == 0.0 and r["format_err"]["lse_abs"] == 0.0
            # against fp32 it costs the bf16 rounding of q and the cache (2^-9 relative per element)
            assert 1e-3 < r["vs_fp32"]["rel_l2"] < 3e-2
        elif r["format"].startswith("int8"):
            err = r["format_err"]["rel_l2"]
            if r["data"] == "gaussian":  # 8-bit Q and K: ~1e-2 (measured 0.9-1.3e-2)
                assert 5e-3 < err < 2e-2, r
            elif r["data"] == "outliers" and r["format"].endswith("_smooth"):
                assert 3e-3 < err <= 3e-2, r  # issue 8's bar, met with K smoothing
            elif r["data"] == "outliers":
                # A key's per-token scale is set by its outlier channel (x50-200): the other
                # channels keep ~1 bit; measured 0.27-0.51 (issue 8 note). A change here is news.
                assert 0.1 < err < 0.8, r
            else:
                # Student-t(3): a channel's (V) or token's (Q, K) int8 step is its largest value
                # / 127, and that maximum is itself heavy-tailed (10-60 sigma over a few thousand
                # draws), so the error moves with the sample: 0.02-0.07 on the CPU's draws,
                # 0.157 for int8_qkv_smooth at ctx 4096 on the H200's (2026-11-22).
                assert 1e-2 < err < 0.3, r
        else:
            # e4m3 keeps 3 mantissa bits: a few % RMS; the softmax passes it on
            assert 5e-3 < r["format_err"]["rel_l2"] < 0.3, r
        if r["data"] == "gaussian":
            assert r["vs_bf16"]["cosine_min"] > 0.99
        # |e32 - e16| <= ||ref16 - ref32|| / ||ref32|| * (1 + e16) (triangle inequality, both norms)
        floor = r["bf16_vs_fp32"]["rel_l2"]
        assert abs(r["vs_fp32"]["rel_l2"] - r["vs_bf16"]["rel_l2"]) <= floor * (1 + r["vs_bf16"]["rel_l2"]) + 1e-12
        if r["format"] == "bf16" and r["measured"] == "oracle":
            assert r["vs_fp32"] == r["bf16_vs_fp32"]


# ----------------------------------------------------------------------------------------------
# sweep: broken formats and kernels show; the kernel column through the library's kernels
class ScalesDropped(FP8DSMLAFormat):
    def unpack(self, cache):  # every tile comes back 1/scale times off
        lat, _, rope = self.unpack_parts(cache)
        return torch.cat([lat, rope.float()], dim=-1)


def _broken_mla():
    good = next(f for f in sweep.FORMATS if f.family == "mla" and f.name == "fp8_ds_mla")
    bad = ScalesDropped()
    return sweep.Case("broken", "mla", "fp8_ds_mla read without its scales", good.quantize,
                        lambda x, cache: {"q": x["q"], "kv": bad.unpack(cache).reshape(-1, 576)}, good.kernel)


def _broken_mha():
    good = next(f for f in sweep.FORMATS if f.family == "mha" and f.name == "fp8")

    def dequantize(x, st):  # v_scale applied twice
        t = good.dequantize(x, st)
        return {**t, "v": t["v"] * st["v_scale"]}
    return sweep.Case("broken", "mha", "fp8 with v_scale applied twice", good.quantize, dequantize, good.kernel)


def _tokens_swapped(family):
    """A 'kernel' that returns the oracle's result for the wrong tokens (rolled by one)."""
    good = next(f for f in sweep.FORMATS if f.family == family and f.name == "bf16")
    oracle = sweep.FAMILIES[family][1]

    def kernel(x, st):
        out, lse = oracle(x, good.dequantize(x, st))
        return out.roll(1, 0), lse.roll(1, 0)
    return sweep.Case("broken", family, "oracle of the neighbouring token", good.quantize, good.dequantize,
                        kernel)


TINY = {"mla": [sweep._mla(16, 64, 16, 2, 256)], "mla_v4": [sweep._mla(16, 64, 16, 2, 256)], "mha": [sweep._mha(4, 2, 40, 16, 2)]}


@pytest.mark.parametrize("family, make, where", [
    pytest.param("mla", _broken_mla, "format_err", id="mla-fp8-scales-dropped"),
    pytest.param("mha", _broken_mha, "format_err", id="mha-fp8-v-scale-twice"),
    pytest.param("mla", lambda: _tokens_swapped("mla"), "kernel_err", id="mla-kernel-wrong-token"),
    pytest.param("mha", lambda: _tokens_swapped("mha"), "kernel_err", id="mha-kernel-wrong-token"),
])
def test_sweep_sees_a_broken_format_or_kernel(family, make, where):
    broken = make()
    if where == "kernel_err":  # the kernel column: only the fake kernel runs (no Triton launch)
        rows = sweep.run({family: TINY[family]}, ["gaussian"], [broken], device=DEVICE, run_kernels=True,
                         progress=io.StringIO())
        (bad,) = rows
        assert bad["format_err"]["rel_l2"] == 0.0
        assert bad["kernel_err"]["rel_l2"] > 0.5 and bad["vs_bf16"]["rel_l2"] > 0.5
        assert bad["vs_bf16"]["cosine_min"] < 0.9
    else:  # oracles only, next to the good formats of the family
        fmts = [f for f in sweep.FORMATS if f.family == family and f.pending is None] + [broken]
        rows = sweep.run({family: TINY[family]}, ["gaussian"], fmts, device=DEVICE, run_kernels=False,
                         progress=io.StringIO())
        by = {r["format"]: r for r in rows}
        assert by["broken"]["format_err"]["rel_l2"] > 0.5, by["broken"]
        assert by["broken"]["vs_fp32"]["rel_l2"] > 0.5
        for name, r in by.items():
            if name != "broken":
                assert r["format_err"]["rel_l2"] < 0.1
    text = sweep.table(rows, [])
    (cells,) = [c for c in _table_rows(text, family) if c[1] == "broken"]
    assert _same(cells[5], next(r for r in rows if r["format"] == "broken")["vs_bf16"]["rel_l2"])


def test_sweep_round_trip_sees_a_corrupted_format():
    gen = torch.Generator().manual_seed(1)
    kv_c, k_pe = sweep.make_latents("gaussian", 64, gen)
    good = sweep.round_trip_errors(FP8_DS_MLA, kv_c, k_pe)
    bad = sweep.round_trip_errors(ScalesDropped(), kv_c, k_pe)
    assert good["rel_l2"] < 0.05 and bad["rel_l2"] > 1.0


def test_sweep_kernel_column_through_the_kernels():
    """The GPU path (kernels run, kernel err filled) on tiny shapes: natively on a GPU; on a CPU
    through the interpreter, corrected by tests/conftest.py. Block size 16, a context of 40
    (not a multiple of it), topk 64 over 256 slots."""
    fmts = [f for f in sweep.FORMATS if f.pending is None]
    rows = sweep.run(TINY, ["outliers"], fmts, device=DEVICE, run_kernels=True, progress=io.StringIO())
    assert {(r["family"], r["format"]) for r in rows} == {(f.family, f.name) for f in fmts}
    for r in rows:
        assert r["measured"] == "kernel"
        # the kernels round out to bf16 (2^-9 relative) and accumulate in fp32
        assert r["kernel_err"]["rel_l2"] < 1e-2, r
        assert r["kernel_err"]["cosine_min"] > 0.9999, r
        assert r["kernel_err"]["lse_abs"] < 1e-3, r
        if r["format"] == "bf16":  # format err 0: against bf16 the kernel is all there is
            assert r["vs_bf16"] == r["kernel_err"]


def test_sweep_plot_or_a_clear_message(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit) as e:
            sweep.main(["--plot", str(png)])
        assert e.value.code == 2
        assert "pip install -e '.[plot]'" in capsys.readouterr().err
        assert not png.exists()
        return
    assert sweep.main(["--family", "mha", "--data", "gaussian", "outliers", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args", [
    pytest.param(["--out", "x.txt"], id="out-extension"),
    pytest.param(["--formats", "fp4"], id="unknown-format"),
    pytest.param(["--data", "zeros"], id="unknown-data"),
])
def test_sweep_rejects_bad_arguments(args, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.main(args)
    assert e.value.code == 2


def _sweep_refuses(monkeypatch, capsys, args):
    """sweep.main(args) exits 2 with one line on stderr before any measurement; returns the line."""
    def never(*a, **k):
        raise AssertionError("the sweep ran before its arguments were checked")
    monkeypatch.setattr(sweep, "run", never)
    with pytest.raises(SystemExit) as e:
        sweep.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("sweep.py: error: "), err
    return err[0]


def test_sweep_checks_out_before_running(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-such-folder" / "sweep.json"
    line = _sweep_refuses(monkeypatch, capsys, ["--family", "mha", "--out", str(missing)])
    assert f"folder {missing.parent} does not exist" in line
    folder = tmp_path / "sweep.csv"
    folder.mkdir()
    line = _sweep_refuses(monkeypatch, capsys, ["--family", "mha", "--out", str(folder)])
    assert "is a folder" in line
    line = _sweep_refuses(monkeypatch, capsys, ["--out", str(tmp_path / "x.txt")])
    assert "expected a .json or .csv file name" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder, so there is "
                    "no unwritable folder to point --out at")
def test_sweep_checks_out_is_writable(tmp_path, monkeypatch, capsys):
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        line = _sweep_refuses(monkeypatch, capsys, ["--family", "mha", "--out", str(ro / "sweep.json")])
    finally:
        ro.chmod(0o700)
    assert "not writable" in line


def test_sweep_empty_selection_is_an_error(monkeypatch, capsys):
    line = _sweep_refuses(monkeypatch, capsys, ["--family", "mla", "--formats", "fp8"])
    assert "fp8" in line and "nothing to sweep" in line


# ----------------------------------------------------------------------------------------------
# bench
def test_bench_small_prints_its_numbers(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--shapes", "small", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    result = json.loads(out.read_text())
    want = {(n, op.label(p)) for n, op in bench.REGISTRY.items() for p in op.shape_sets["small"]}
    assert {(c["op"], c["name"]) for c in result["cases"]} == want
    for new in ("merge_attn_states", "convert_req_index_to_global", "write_kv_cache", "varlen_attention"):
        assert {"small", "standard"} <= set(bench.REGISTRY[new].shape_sets)
    rows, header = {}, None
    for line in printed.out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| op | case |"):
            header = cells
        if line.startswith("| ") and (cells[0], cells[1]) in want:
            rows[(cells[0], cells[1])] = dict(zip(header, cells))
    for c in result["cases"]:
        cells = rows[(c["op"], c["name"])]
        assert cells["rel err"] == bench._err(c)
        if math.isfinite(c["ms"]):
            assert cells["ms"] == f"{c['ms']:.4f}" and cells["torch ref ms"] == f"{c['ref_ms']:.4f}"
        # eager times: measured by default on a GPU, not in the interpreter (seconds a call)
        assert cells["eager ms"] == (f"{c['eager_ms']:.4f}" if bench.GPU else "not measured")
        # the FlashMLA columns: the peer's status for ops that have one (tests/tools/test_bench_peer.py)
        if bench.REGISTRY[c["op"]].peer is None:
            assert "peer" not in c["extra"] and cells["FlashMLA ms"] == "–"
        elif c["extra"]["peer"]["status"] != "measured":
            assert cells["FlashMLA ms"] == cells["ratio"] == c["extra"]["peer"]["status"]
        if c["extra"]["check"] == "oracle":
            assert c["rel_err"] <= 2e-2
        if c["op"] in ("convert_req_index_to_global", "write_kv_cache", "write_mla_cache", "gather_upconvert") \
                and c["extra"]["check"] == "oracle":
            assert c["rel_err"] == 0.0  # integer work and byte-exact writers
    if bench.GPU:
        assert all(c["extra"]["check"] == "oracle" for c in result["cases"])
        assert "warning" not in result
    else:
        assert result["warning"] == bench.CPU_WARNING and bench.CPU_WARNING in printed.out
        checked = {(c["op"], c["name"]) for c in result["cases"] if c["extra"]["check"] == "oracle"}
        assert checked == {(n, bench.REGISTRY[n].label(p)) for n, op in bench.REGISTRY.items()
                           for p in op.shape_sets["small"] if op.interpreter_exact(p)}
        assert {"convert_req_index_to_global", "merge_attn_states", "write_kv_cache"} <= {o for o, _ in checked}
    # --report: one table per op, device, date and command right above each
    assert bench.main(["--report", str(out)]) == 0
    md = capsys.readouterr().out
    caption = f"_{result['device']}, {result['date']}: `{result['command']}`_"
    lines = md.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("| case |")]
    assert len(heads) == len(bench.REGISTRY)
    assert all(lines[i - 2] == caption for i in heads)


def test_bench_refuses_to_time_a_wrong_result(monkeypatch):
    op = bench.Op(name="broken", shape_sets={"small": [dict(n=64)]},
                  build=lambda p, dev: {"x": torch.randn(p["n"], device=dev)},
                  run=lambda x: x["x"] * 1.1, torch_ref=lambda x: x["x"],
                  error=lambda x, out: bench.rel_l2(out, x["x"]), count=lambda p: (0.0, 4.0 * p["n"]),
                  label=lambda p: f"n{p['n']}", interpreter_exact=lambda p: True)
    monkeypatch.setitem(bench.REGISTRY, "broken", op)
    with pytest.raises(RuntimeError, match="broken n64: relative L2 error 0.1 .*refusing to time"):
        bench.main(["--op", "broken", "--shapes", "small"])


@pytest.mark.skipif(bench.GPU, reason="with a GPU the standard shapes run (minutes); this checks the CPU refusal")
def test_bench_refuses_gpu_shapes_on_cpu(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--shapes", "standard"])
    assert e.value.code == 2 and "only the 'small' shape sets" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# docs
def test_docs_regenerates_between_markers_and_keeps_the_rest(tmp_path, capsys, default_sweep):
    d = tmp_path / "docs"
    (d / "bench").mkdir(parents=True)
    (d / "accuracy").mkdir()
    shutil.copy(os.path.join(REPO, "docs/bench/h200-2026-11-22-all.json"), d / "bench/run-a.json")
    shutil.copy(os.path.join(REPO, "docs/bench/h200-2026-11-22-paged-baseline.json"), d / "bench/run-b.json")
    # the accuracy JSON: the module's default sweep run (sweep.main's --out file, as written)
    (d / "accuracy/cpu.json").write_text(json.dumps(default_sweep[1]))
    before = "# Benchmarks\n\nHand-written intro.\n\n<!-- generated:bench/run-a -->\nstale table\n" \
             "<!-- /generated -->\n\nHand-written commentary | with a pipe.\n"
    (d / "benchmarks.md").write_text(before)
    capsys.readouterr()

    assert docs.main(["--docs", str(d), "--check"]) == 1
    assert "out of date: benchmarks.md, accuracy.md" in capsys.readouterr().out
    assert docs.main(["--docs", str(d)]) == 0
    text = (d / "benchmarks.md").read_text()
    with open(d / "bench/run-a.json") as f:
        a = json.load(f)
    assert text.startswith("# Benchmarks\n\nHand-written intro.\n\n<!-- generated:bench/run-a -->\n"
                           + bench.report(a).rstrip()
                           + "\n<!-- /generated -->\n\nHand-written commentary | with a pipe.\n")
    assert "stale table" not in text
    # the JSON without a section got one, appended under a heading naming device and date
    assert "\n## NVIDIA H200, 2026-11-22 (`docs/bench/run-b.json`)\n\n<!-- generated:bench/run-b -->\n" in text
    # device, date and command right above every table
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| case |"):
            assert re.fullmatch(r"_NVIDIA H200, 2026-11-22: `tools/bench\.py .*`_", lines[i - 2]), lines[i - 2]
    acc = (d / "accuracy.md").read_text()
    assert acc.startswith(docs.ACCURACY_INTRO)
    with open(d / "accuracy/cpu.json") as f:
        assert sweep.report(json.load(f)).rstrip() in acc
    assert f"Command: `{default_sweep[1]['command']}`" in acc
    assert default_sweep[1]["command"].startswith("python tools/sweep.py --out ")

    capsys.readouterr()
    assert docs.main(["--docs", str(d), "--check"]) == 0 and docs.main(["--docs", str(d)]) == 0
    assert "nothing to change" in capsys.readouterr().out
    (d / "bench/run-b.json").unlink()  # a section whose JSON is gone is an error
    assert docs.main(["--docs", str(d), "--check"]) == 1
    assert "bench/run-b.json does not exist" in capsys.readouterr().err


def test_repository_docs_are_generated_from_their_json(capsys):
    assert docs.main(["--check"]) == 0, capsys.readouterr()


# ----------------------------------------------------------------------------------------------
# tests.helpers: the shared checker
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


def test_bench_paths_time_the_triton_kernels_under_their_switch(monkeypatch):
    """--paths: "triton" runs a case with OPENMLA_SM90_GLUON=0 (and restores the caller's value),
    names it "[triton]"; "both" asks for two runs only where Gluon kernels could run."""
    import torch
    from openmla.tools import bench
    seen = []

    def fake_run_case(op, params, device, **kw):
        seen.append(os.environ.get("OPENMLA_SM90_GLUON"))
        return bench.Case(op=op.name, name="c", params=params, flops=0, bytes=0)

    monkeypatch.setattr(bench, "run_case", fake_run_case)
    monkeypatch.setenv("OPENMLA_SM90_GLUON", "1")
    op = bench.REGISTRY["sparse_mla_decode"]
    c = bench._run_on_path("triton", op, {}, torch.device("cpu"))
    assert seen == ["0"] and c.name == "c [triton]" and "triton" in c.extra["path"]
    assert os.environ["OPENMLA_SM90_GLUON"] == "1"
    monkeypatch.delenv("OPENMLA_SM90_GLUON")
    bench._run_on_path(None, op, {}, torch.device("cpu"))
    bench._run_on_path("triton", op, {}, torch.device("cpu"))
    assert seen[1:] == [None, "0"] and "OPENMLA_SM90_GLUON" not in os.environ
    cpu = torch.device("cpu")
    assert bench._paths("gluon", "sparse_mla_decode", cpu) == (None,)
    assert bench._paths("triton", "paged_attention", cpu) == ("triton",)
    assert bench._paths("both", "sparse_mla_decode", cpu) == (None,)  # no Gluon off Hopper
    assert bench._paths("both", "paged_attention", cpu) == (None,)
    from openmla.kernels import device as kdevice
    with kdevice.assume(kdevice.ARCHES["sm_90"]):
        assert bench._paths("both", "sparse_mla_decode", torch.device("cuda")) == (None, "triton")
        assert bench._paths("both", "paged_attention", torch.device("cuda")) == (None,)
    with kdevice.assume(kdevice.ARCHES["sm_80"]):
        assert bench._paths("both", "sparse_mla_prefill", torch.device("cuda")) == (None,)
