"""tools/docs.py markers that pick ops out of a run (`<!-- generated:bench/RUN#OP1,OP2 -->`), as
docs/benchmarks.md's current tables do. The whole-run markers are tested in test_tools.py."""
import json
import os
import shutil

from openmla.tools import bench, docs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_op_marker_renders_only_its_ops_and_counts_as_the_runs_section(tmp_path, capsys):
    d = tmp_path / "docs"
    (d / "bench").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "docs/bench/h200-2026-11-22-all.json"), d / "bench/run-a.json")
    before = ("# Benchmarks\n\n## Current\n\n<!-- generated:bench/run-a#varlen_attention,merge_attn_states -->\n"
              "stale table\n<!-- /generated -->\n\nHand-written commentary.\n")
    (d / "benchmarks.md").write_text(before)
    capsys.readouterr()

    assert docs.main(["--docs", str(d)]) == 0
    text = (d / "benchmarks.md").read_text()
    with open(d / "bench/run-a.json") as f:
        a = json.load(f)
    picked = [c for c in a["cases"] if c["op"] in ("varlen_attention", "merge_attn_states")]
    assert {c["op"] for c in picked} == {"varlen_attention", "merge_attn_states"}
    assert len(picked) < len(a["cases"])
    assert text == ("# Benchmarks\n\n## Current\n\n<!-- generated:bench/run-a#varlen_attention,merge_attn_states -->\n"
                    + bench.report({**a, "cases": picked}).rstrip()
                    + "\n<!-- /generated -->\n\nHand-written commentary.\n")
    # the run's header (device, date, git revision) and command head the section
    body = text.split("-->\n", 1)[1]
    assert body.startswith(f"{a['device']}, {a['date']}, torch {a['torch']}, triton {a['triton']}, git {a['git']}.")
    assert f"Command: `PYTHONPATH=. python3 {a['command']}`" in body
    assert "### merge_attn_states" in text and "### varlen_attention" in text
    assert "### paged_attention" not in text and "stale table" not in text
    # the op marker is the run's section: nothing appended for run-a
    assert "run-a.json`)" not in text
    capsys.readouterr()
    assert docs.main(["--docs", str(d), "--check"]) == 0

    # an op the run did not measure is an error naming it, and the section is left as it was
    bad = text.replace("#varlen_attention,merge_attn_states", "#varlen_attention,sparse_mla_nonesuch")
    (d / "benchmarks.md").write_text(bad)
    capsys.readouterr()
    assert docs.main(["--docs", str(d), "--check"]) == 1
    assert "has no cases of sparse_mla_nonesuch" in capsys.readouterr().err
