#!/usr/bin/env python3
"""Regenerate the measured tables of docs/benchmarks.md and docs/accuracy.md from the tools' JSON.

    python tools/docs.py            # rewrite the generated sections in place
    python tools/docs.py --check    # exit 1 (and say which) if a document is out of date

Every JSON file under docs/bench/ (written by `tools/bench.py --out`) and docs/accuracy/
(`tools/sweep.py --out`) has one generated section in its document, between

    <!-- generated:bench/NAME -->        (NAME = the file name without .json)
    ...                                  (device, date and command, then the tables)
    <!-- /generated -->

A marker may name ops of its run, `<!-- generated:bench/NAME#OP1,OP2 -->`: its section holds the
same header (device, date, git revision, command) and only those ops' tables. docs/benchmarks.md
opens with such sections, one current table per op, each from the newest run that measured it.

Only the text between the markers is rewritten; everything around them (headings, commentary)
is kept as written. A JSON file with no section yet gets one appended at the end of its document,
under a heading naming the device and date (a run counts as having a section when any marker,
with or without ops, names it); a section whose JSON file is gone, or that names an op its run
did not measure, is an error.
A missing docs/accuracy.md is created with a short introduction.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the checkout, also through tools/dev_path.sh links
MARKER = re.compile(r"<!-- generated:(?P<name>[\w./-]+)(?:#(?P<ops>\w+(?:,\w+)*))? -->\n(?P<body>.*?)"
                    r"<!-- /generated -->", re.S)

ACCURACY_INTRO = """# Accuracy of the cache formats

What each KV cache format costs in attention outputs, against attention over the unquantized
bf16 inputs and over the fp32 inputs before rounding. Made by `tools/sweep.py` (its docstring
defines every column); each run's JSON is in `docs/accuracy/`, and `python tools/docs.py`
regenerates the tables below from them.
"""


def _renderers():
    # Imported here: the tools pull in torch and triton, which --help does not need.
    from openmla.tools import bench, sweep
    return {"bench": ("benchmarks.md", bench.report), "accuracy": ("accuracy.md", sweep.report)}


def _section(name: str, body: str) -> str:
    return f"<!-- generated:{name} -->\n{body.rstrip()}\n<!-- /generated -->"


def render(doc_text: str, kind: str, json_dir: str, report) -> tuple[str, list[str]]:
    """(new text of one document, problems). Each marker's body is replaced by report(JSON);
    JSON files without a marker are appended as new sections."""
    problems = []
    files = sorted(f[:-5] for f in os.listdir(json_dir) if f.endswith(".json")) if os.path.isdir(json_dir) else []
    seen = set()

    def fill(m: re.Match) -> str:
        name, ops = m["name"], m["ops"]
        if not name.startswith(kind + "/"):
            problems.append(f"marker generated:{name}: expected a name under {kind}/")
            return m[0]
        stem = name[len(kind) + 1:]
        seen.add(stem)
        path = os.path.join(json_dir, stem + ".json")
        if not os.path.exists(path):
            problems.append(f"marker generated:{name}: {os.path.relpath(path, ROOT)} does not exist")
            return m[0]
        with open(path) as f:
            result = json.load(f)
        if ops is None:
            return _section(name, report(result))
        cases = [c for c in result.get("cases", []) if c.get("op") in ops.split(",")]
        missing = sorted(set(ops.split(",")) - {c["op"] for c in cases})
        if missing:
            problems.append(f"marker generated:{name}#{ops}: {os.path.relpath(path, ROOT)} has no cases of "
                            f"{', '.join(missing)}")
            return m[0]
        return _section(f"{name}#{ops}", report({**result, "cases": cases}))

    text = MARKER.sub(fill, doc_text)
    for stem in files:
        if stem in seen:
            continue
        with open(os.path.join(json_dir, stem + ".json")) as f:
            result = json.load(f)
        text = text.rstrip("\n") + (f"\n\n## {result['device']}, {result['date']} (`docs/{kind}/{stem}.json`)\n\n"
                                    + _section(f"{kind}/{stem}", report(result)) + "\n")
    return text, problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a document would change")
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs"), help="the docs folder (default: the repo's)")
    args = ap.parse_args(argv)
    stale, problems = [], []
    for kind, (doc, report) in _renderers().items():
        path = os.path.join(args.docs, doc)
        old = open(path).read() if os.path.exists(path) else (ACCURACY_INTRO if kind == "accuracy" else "")
        new, bad = render(old, kind, os.path.join(args.docs, kind), report)
        problems += [f"{doc}: {b}" for b in bad]
        if new != (open(path).read() if os.path.exists(path) else None):
            stale.append(doc)
            if not args.check:
                with open(path, "w") as f:
                    f.write(new)
    for p in problems:
        print(f"docs.py: {p}", file=sys.stderr)
    if args.check:
        print("docs up to date" if not stale else f"out of date: {', '.join(stale)} (run python tools/docs.py)")
        return 1 if stale or problems else 0
    print(f"rewrote {', '.join(stale)}" if stale else "nothing to change")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
