"""tools/bench.py's FlashMLA columns and eager times, and its decode entry points.

FlashMLA itself needs a GPU and the sgl-flash-mla wheel (tools/flashmla_peer.sh); on the GPU machine
bench.py times the real one. Here `StandIn` takes its place: a small torch STAND-IN for the
flash_mla module, injected to test bench's plumbing (head padding, the call with FlashMLA's
argument order and shapes, un-padding, lse conventions, the comparison, the columns and the JSON).
It is NOT FlashMLA and says nothing about FlashMLA's speed or numbers.
"""
import json
import math
import sys

import pytest
import torch

from openmla.kernels import reference
from openmla.kernels.sparse_mla_decode import sparse_mla_decode
from openmla.kernels.sparse_mla_prefill import sparse_mla_prefill
from openmla.tools import _bench_peer, bench
from openmla.tools._bench_core import rel_l2
from tests.helpers import DEVICE

SMALL = "small"
NO_EAGER = ["--eager-calls", "0"]  # the stand-in runs would otherwise time 1500 oracle calls on a GPU


class StandIn:
    """A torch stand-in for `flash_mla` (plumbing only, NOT FlashMLA): FlashMLA's sparse decode and
    prefill signatures, shapes, head counts (64 or 128), lse layouts and +inf empty-row marker,
    computed with openmla's fp32 oracles. The padding heads (all-zero q) get NaN outputs, so a
    comparison that read them would show. It records every call's arguments and outputs.

    roll_heads: the real heads' outputs come back shifted by one head (a wrong un-padding).
    fail: every call raises (a peer that does not run)."""

    __version__ = "stand-in"

    def __init__(self, roll_heads: bool = False, fail: bool = False):
        self.roll_heads, self.fail = roll_heads, fail
        self.decode_calls, self.prefill_calls = [], []

    def get_mla_metadata(self, *args, **kwargs):
        return {"initialized": False}, None

    def _finish(self, q, out, lse):
        """out [b, h, 512] fp32, lse [b, h]: poison padding heads, +inf marker, bf16 out."""
        if self.fail:
            raise RuntimeError("stand-in failure")
        pad = (q == 0).all(-1)  # [b, h]
        h_real = int((~pad).any(0).sum())
        if self.roll_heads:
            out[:, :h_real] = out[:, :h_real].roll(1, dims=1)
        out[pad] = float("nan")
        return out.bfloat16(), lse.masked_fill(lse == float("-inf"), float("inf"))

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None,
                               indices=None, attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                               topk_length=None, extra_topk_length=None, enable_batch_invariant=False,
                               use_legacy=False, kv_format=None):
        b, s_q, h_q, d = q.shape
        assert use_legacy and is_fp8_kvcache is True and causal is False and num_splits is None
        assert head_dim_v == 512 and d == 576 and h_q in (64, 128) and s_q == 1
        assert k_cache.dtype == torch.float8_e4m3fn and tuple(k_cache.shape[2:]) == (1, 656)
        assert indices.dtype == torch.int32 and tuple(indices.shape[:2]) == (b, s_q)
        assert isinstance(tile_scheduler_metadata, dict)
        tile_scheduler_metadata["initialized"] = True
        out, lse = reference.sparse_mla_decode_ref(q[:, 0], k_cache.view(torch.uint8)[:, :, 0], indices[:, 0],
                                                   scale=softmax_scale)
        out, lse = self._finish(q[:, 0], out, lse)
        res = (out.unsqueeze(1), lse.unsqueeze(-1))  # [b, 1, h, 512], [b, h, s_q]
        self.decode_calls.append({"q": q, "k_cache": k_cache, "indices": indices, "meta": tile_scheduler_metadata,
                                  "scale": softmax_scale, "block_table": block_table, "out": res})
        return res

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                             use_legacy=False, return_log2_lse=None):
        s_q, h_q, d = q.shape
        assert use_legacy and d == 576 and d_v == 512 and h_q in (64, 128) and return_log2_lse is None
        assert tuple(kv.shape[1:]) == (1, 576) and tuple(indices.shape[:2]) == (s_q, 1)
        out, max_logits, lse = reference.sparse_mla_ref(q, kv[:, 0], indices[:, 0], scale=sm_scale)
        out, lse = self._finish(q, out, lse)
        res = (out, max_logits, lse)
        self.prefill_calls.append({"q": q, "kv": kv, "indices": indices, "scale": sm_scale, "out": res})
        return res


def _rows(printed: str) -> dict:
    """{(op, case): {column: cell}} of the table bench.main prints."""
    rows, header = {}, None
    for line in printed.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| op | case |"):
            header = cells
        elif header and line.startswith("| ") and not line.startswith("|---"):
            rows[(cells[0], cells[1])] = dict(zip(header, cells))
    return rows


def _bench(args, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(args + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    return json.loads(out.read_text()), printed


@pytest.fixture
def peer(monkeypatch):
    """Install a StandIn as the peer bench.main loads; returns a function that makes it."""
    def use(**kwargs):
        s = StandIn(**kwargs)
        monkeypatch.setattr(_bench_peer, "load", lambda gpu: (s, None))
        return s
    return use


# ----------------------------------------------------------------------------------------------
def test_peer_loader_says_why_not(monkeypatch):
    assert _bench_peer.load(False) == (None, "no GPU (FlashMLA's kernels need CUDA)")
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # `import flash_mla` raises ModuleNotFoundError
    fm, why = _bench_peer.load(True)
    assert fm is None and why.startswith("flash_mla not importable (ModuleNotFoundError")


def test_padded_heads_and_cases_flashmla_cannot_run():
    assert [_bench_peer.padded_heads(h) for h in (1, 16, 32, 64, 65, 128)] == [64, 64, 64, 64, 128, 128]
    with pytest.raises(bench.NotMeasured, match="at most 128 heads"):
        _bench_peer.padded_heads(129)
    op = bench.REGISTRY["sparse_mla_decode"]
    p = dict(op.shape_sets[SMALL][0], cache="bf16")
    x = op.build(p, torch.device(DEVICE))
    with pytest.raises(bench.NotMeasured, match="only the 656-byte fp8 cache"):
        op.peer.prepare(x, StandIn())


def test_bench_without_flash_mla_says_not_measured(tmp_path, capsys, monkeypatch):
    real_load = _bench_peer.load
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    monkeypatch.setattr(_bench_peer, "load", lambda gpu: real_load(True))  # as on a GPU without the wheel
    result, printed = _bench(["--op", "sparse_mla_prefill", "--shapes", SMALL, "--no-ref"] + NO_EAGER, tmp_path,
                             capsys)
    assert "# FlashMLA: not measured: flash_mla not importable (ModuleNotFoundError" in printed
    assert result["peer"]["not_measured"].startswith("flash_mla not importable")
    (c,) = result["cases"]
    assert c["extra"]["peer"]["status"] == "not measured" and math.isnan(c["peer_ms"])
    row = _rows(printed)[("sparse_mla_prefill", c["name"])]
    for col in bench.PEER_HEADER.split(" | "):
        assert row[col] == "not measured", col
    # the markdown says it too: the columns, and why
    md = bench.report(result)
    assert bench.PEER_HEADER in md and "FlashMLA not measured: flash_mla not importable (ModuleNotFoundError" in md
    assert f"| {c['name']} | {c['ms']:.4f} | not measured | not measured | not measured |" in md


def test_bench_times_and_compares_the_peer(tmp_path, capsys, peer):
    """Stand-in peer (NOT FlashMLA): bench pads q to 64 heads, calls FlashMLA's API, compares only
    the real heads, and prints and records what it measured."""
    fm = peer()
    result, printed = _bench(["--op", "sparse_mla_decode,sparse_mla_prefill", "--shapes", SMALL, "--no-ref"]
                             + NO_EAGER, tmp_path, capsys)
    assert "# FlashMLA: flash_mla stand-in, timed in this run" in printed
    assert result["peer"] == {"module": "flash_mla stand-in"}
    rows = _rows(printed)
    cases = {c["op"]: c for c in result["cases"]}
    for op, calls in (("sparse_mla_decode", fm.decode_calls), ("sparse_mla_prefill", fm.prefill_calls)):
        c = cases[op]
        rec = c["extra"]["peer"]
        H = c["params"]["heads"]
        assert rec["status"] == "measured" and rec["heads_run"] == 64 and rec["version"] == "flash_mla stand-in"
        # on the CPU the compared call is also the timed one; a GPU times it again (graph replays)
        assert len(calls) == 1 if not bench.GPU else len(calls) > 1
        call = calls[0]
        q = call["q"] if op == "sparse_mla_prefill" else call["q"][:, 0]
        assert q.shape[-2] == 64 and not q[:, H:].any() and q[:, :H].abs().amin(-1).gt(0).all()
        # openmla on the very inputs the peer got, against the peer's outputs, real heads only
        if op == "sparse_mla_decode":
            assert all(k["meta"] is call["meta"] for k in calls) and call["meta"]["initialized"]
            assert call["block_table"] is None and call["scale"] == 576 ** -0.5
            out, lse = call["out"]
            out, lse = out[:, 0], lse[:, :, 0]
            cache = call["k_cache"].view(torch.uint8)[:, :, 0]
            ours, ours_lse = sparse_mla_decode(q[:, :H].contiguous(), cache, call["indices"][:, 0].contiguous(),
                                               scale=call["scale"])
            want = reference.sparse_mla_decode_ref(q[:8, :H], cache, call["indices"][:8, 0], scale=call["scale"])[0]
        else:
            out, _, lse = call["out"]
            kv, idx = call["kv"][:, 0], call["indices"][:, 0].contiguous()
            ours, ours_lse, _ = sparse_mla_prefill(q[:, :H].contiguous(), kv, idx, scale=call["scale"])
            want = reference.sparse_mla_ref(q[:8, :H], kv, idx[:8], scale=call["scale"])[0]
        assert out[:, H:].isnan().all()  # the padding heads' poison never reached the comparison
        assert rec["max_abs_out"] == float((ours.double() - out[:, :H].double()).abs().max())
        assert rec["max_abs_lse"] == float((ours_lse.double() - lse[:, :H].double()).abs().max())
        assert 0 < rec["max_abs_out"] < 2e-2 and rec["max_abs_lse"] < 1e-3
        assert rec["peer_rel_err"] == rel_l2(out[:8, :H], want) and rec["peer_rel_err"] < 5e-3
        assert c["peer_ms"] > 0 and math.isnan(c["peer_eager_ms"])
        assert rec["timing"] == "cpu, 1 run" if not bench.GPU else rec["timing"] in ("cuda-graph", "eager")
        row = rows[(op, c["name"])]
        assert row["FlashMLA ms"] == f"{c['peer_ms']:.4f}" and row["ratio"] == f"{c['ms'] / c['peer_ms']:.2f}"
        assert row["max abs diff out / lse"] == f"{rec['max_abs_out']:.1e} / {rec['max_abs_lse']:.1e}"
        assert row["FlashMLA rel err"] == f"{rec['peer_rel_err']:.1e}"
        assert row["FlashMLA eager ms"] == "not measured"
    md = bench.report(result)
    assert "FlashMLA (flash_mla stand-in, `flash_mla_with_kvcache`) timed in the same run" in md
    assert "FlashMLA (flash_mla stand-in, `flash_mla_sparse_fwd`) timed in the same run" in md


def test_bench_peer_disagreement_and_failure_show(tmp_path, capsys, peer):
    """Stand-ins (NOT FlashMLA): a peer whose heads come back shifted disagrees in the columns; a
    peer that raises is reported as failed, and openmla's own numbers are kept."""
    peer(roll_heads=True)
    result, _ = _bench(["--op", "sparse_mla_prefill", "--shapes", SMALL, "--no-ref"] + NO_EAGER, tmp_path, capsys)
    rec = result["cases"][0]["extra"]["peer"]
    assert rec["status"] == "measured" and rec["max_abs_out"] > 0.05 and rec["peer_rel_err"] > 0.1

    peer(fail=True)
    result, printed = _bench(["--op", "sparse_mla_prefill", "--shapes", SMALL, "--no-ref"] + NO_EAGER, tmp_path,
                             capsys)
    c = result["cases"][0]
    assert c["extra"]["peer"] == {"name": "flash_mla_sparse_fwd", "status": "failed",
                                  "reason": "RuntimeError: stand-in failure"}
    assert c["ms"] > 0 and math.isnan(c["peer_ms"])
    assert _rows(printed)[("sparse_mla_prefill", c["name"])]["FlashMLA ms"] == "failed"
    assert "FlashMLA failed: RuntimeError: stand-in failure (every case)." in bench.report(result)


# ----------------------------------------------------------------------------------------------
# eager mode
def test_bench_eager_times(tmp_path, capsys, monkeypatch):
    calls = []
    op = bench.Op(name="cheap", shape_sets={SMALL: [dict(n=64)]},
                  build=lambda p, dev: {"x": torch.randn(p["n"], device=dev)},
                  run=lambda x: calls.append(1) or x["x"] * 2, torch_ref=lambda x: x["x"] * 2,
                  error=lambda x, out: bench.rel_l2(out, x["x"] * 2), count=lambda p: (0.0, 8.0 * p["n"]),
                  label=lambda p: f"n{p['n']}", interpreter_exact=lambda p: True)
    monkeypatch.setitem(bench.REGISTRY, "cheap", op)
    result, printed = _bench(["--op", "cheap", "--shapes", SMALL, "--no-ref", "--eager-calls", "7",
                              "--eager-repeats", "3"], tmp_path, capsys)
    if not bench.GPU:  # the checked run, the warm-up, 3 repeats of 7 calls (a GPU also replays graphs)
        assert len(calls) == 1 + 1 + 3 * 7
    (c,) = result["cases"]
    assert c["eager_ms"] > 0 and c["extra"]["eager_timing"] == "eager, 7 calls, one sync, median of 3"
    assert result["eager"] == {"calls": 7, "repeats": 3}
    assert _rows(printed)[("cheap", "n64")]["eager ms"] == f"{c['eager_ms']:.4f}"
    md = bench.report(result)
    assert "| case | ms | eager ms | torch ref ms |" in md and "eager ms: wall time per call" in md
    with pytest.raises(SystemExit) as e:
        bench.main(["--op", "cheap", "--shapes", SMALL, "--eager-calls", "-1"])
    assert e.value.code == 2


def test_eager_time_keeps_long_kernels_short():
    n = []
    ms, how = bench.eager_time(lambda: n.append(1), 300, 2, kernel_ms=100.0)  # 500 ms budget: 10 calls
    assert how == "eager, 10 calls, one sync, median of 2" and len(n) == 1 + 2 * 10 and ms >= 0
    n.clear()
    assert bench.eager_time(lambda: n.append(1), 300, 1, kernel_ms=0.01)[1] == "eager, 300 calls, one sync, median of 1"


# ----------------------------------------------------------------------------------------------
# the decode entry points added for host-overhead timing: checked against the oracle here (the
# corrected interpreter), where a CPU bench run cannot check them
@pytest.mark.parametrize("name", ["flashmla_compat_decode", "sparse_mla_impl_decode"])
def test_decode_entry_points_match_their_oracle(name):
    op = bench.REGISTRY[name]
    assert op.shape_sets["host"] == op.shape_sets["standard"]
    assert {(p["tokens"], p["heads"]) for p in op.shape_sets["host"]} == {(1, 16), (1, 128), (32, 16), (32, 128)}
    p = op.shape_sets[SMALL][0]
    x = op.build(p, torch.device(DEVICE))
    out = op.run(x)
    assert op.error(x, out) < 1e-2
    assert op.error(x, op.torch_ref(x)) < 2e-2  # the torch baseline computes the same thing
    assert op.error(x, out * 1.05) > 0.04  # and the check can fail
    if name == "flashmla_compat_decode":  # the API's layout and lse marker undone: the decode op's result
        got, want = op.peer.ours(x), _bench_peer.decode_peer().ours(x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_flushed_timing_is_recorded_and_reported(tmp_path, capsys, peer):
    """--timing flushed (FlashMLA's own timing regime) is kept in the JSON and said in the markdown,
    for openmla's ms and for the FlashMLA column; a default run keeps the CUDA-graph wording."""
    peer()
    args = ["--op", "sparse_mla_prefill", "--shapes", SMALL, "--no-ref"] + NO_EAGER
    flushed, _ = _bench(args + ["--timing", "flushed"], tmp_path, capsys)
    assert flushed["timing"] == "flushed"
    md = bench.report(flushed)
    assert "ms: FlashMLA's timing regime (--timing flushed)" in md and "(timed as openmla; eager" in md
    if bench.GPU:
        (c,) = flushed["cases"]
        assert c["extra"]["timing"].startswith("flushed") and c["extra"]["peer"]["timing"].startswith("flushed")
    graph, _ = _bench(args, tmp_path, capsys)
    md = bench.report(graph)
    assert graph["timing"] == "graph" and "FlashMLA's timing regime" not in md and "(CUDA-graph replay; eager" in md
    with pytest.raises(SystemExit):
        bench.main(args + ["--timing", "kineto"])


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="times GPU work (CUDA events, a memset on the device); the mode's recording "
                           "and report are tested above on every device")
def test_flushed_time_calls_alone_and_takes_the_median():
    calls = []
    x = torch.randn(1 << 20, device="cuda")
    ms = bench.flushed_time(lambda: calls.append(x.mul_(1.0)), calls=5)
    assert len(calls) == 5 + 3 and 0 < ms < 100
