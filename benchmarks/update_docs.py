"""Copy the benchmark tables from benchmarks/results/*.json into docs/benchmarks.md and README.md.

    python benchmarks/update_docs.py            # rewrite the results blocks in place
    python benchmarks/update_docs.py --check    # exit 1 if a block differs from its JSON, or a figure in the docs
                                                # comes from no results file (nothing written)

Each block `<!-- results:NAME -->` ... `<!-- /results:NAME -->` in those files is replaced by the table stored
in benchmarks/results/NAME.json, headed by the command that produced it, the date and the machine it ran on.
The prose around the blocks is written by hand for the result it names; its figures, and those of README.md,
docs/*.md and the shipped model cards, are checked against the results files by ``doc_figures.py`` (how a figure is
traced, and how to mark one that is not a measurement, is in its docstring).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_figures  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TARGETS = (ROOT / "docs" / "benchmarks.md", ROOT / "README.md")
MARKER = re.compile(r"<!-- results:(\w+) -->")


def run_date(data: dict, path: Path) -> str:
    """The date stored with the result, else the day its file was first committed."""
    date = data.get("machine", {}).get("date") or data.get("date")
    if date:
        return date
    try:
        log = subprocess.run(["git", "log", "--diff-filter=A", "--format=%cs", "--", str(path)], cwd=ROOT,
                             capture_output=True, text=True, check=False).stdout.split()
    except OSError:
        log = []
    return log[-1] if log else "date not recorded"


def where(machine: dict) -> str:
    """The device in words: the GPU, or the CPU's model and the cores torch used, and the torch build."""
    if machine.get("cuda"):
        return f"{machine['cuda']}, torch {machine.get('torch')}"
    cores = machine.get("torch_threads") or machine.get("threads") or machine.get("cpus")
    cpu = machine.get("cpu") or f"a CPU ({machine.get('platform', 'model not recorded')})"
    return f"{cpu}, {cores} cores, torch {machine.get('torch')}"


def header(name: str, data: dict, path: Path) -> str:
    return (f"`{data['command']}`: ran {run_date(data, path)} on {where(data.get('machine', {}))} "
            f"(`benchmarks/results/{name}.json`)")


def block(name: str) -> str | None:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    parts = [header(name, data, path), ""]
    if "table" in data:
        parts.append(data["table"])
    tables = data.get("tables", {})
    for title, key in (("Totals", "totals"), ("Completion lengths (tokens; hit max: share at the cap)", "lengths"),
                       ("Per active-batch bucket", "buckets")):
        if key in tables:
            parts += [f"{title}:", "", tables[key], ""]
    if tables.get("sweep"):
        parts += ["Fixed batch, adaptive vs no-spec in lockstep (decode seconds no-spec / adaptive, >1: adaptive "
                  "faster; `benchmarks/batch_sweep.py`):", "", tables["sweep"], ""]
    if tables.get("proposers"):
        parts += ["Per rep (vs no-spec of the same rep):", "", tables["proposers"]]
    elif data.get("proposers"):
        parts += ["Per rep (vs no-spec of the same rep):", "", proposer_table(data["proposers"])]
    if data.get("cost_table"):
        parts += ["", "Policy forward time with ~200 cached tokens, by new tokens per row:", "", data["cost_table"]]
    return "\n".join(parts).rstrip("\n")


def proposer_table(items: list[dict]) -> str:
    def fmt(x):
        return "-" if x is None else f"{x:.3g}"

    lines = ["| T | rep | engine | accept len | vs no-spec | tail vs no-spec | history tokens proposed |",
             "|---|---|---|---|---|---|---|"]
    for it in items:
        lines.append(f"| {it['temperature']} | {it['rep']} | {it['engine']} | {fmt(it['acceptance_length'])} | "
                     f"{fmt(it['speedup_vs_no_spec'])} | {fmt(it['tail_speedup_vs_no_spec'])} | "
                     f"{it['history_proposed']} |")
    return "\n".join(lines)


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every results block filled from its JSON; also the names that have no JSON."""
    missing = []
    for name in sorted(set(MARKER.findall(text))):
        content = block(name)
        if content is None:
            missing.append(name)
            continue
        pattern = re.compile(rf"<!-- results:{name} -->.*?<!-- /results:{name} -->", re.S)
        replacement = f"<!-- results:{name} -->\n{content}\n<!-- /results:{name} -->"
        if pattern.search(text):
            text = pattern.sub(lambda _, r=replacement: r, text)
        else:
            text = text.replace(f"<!-- results:{name} -->", replacement, 1)
    return text, missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale blocks and exit 1; write nothing")
    options = parser.parse_args()
    stale = []
    for target in TARGETS:
        text = target.read_text()
        updated, missing = render(text)
        for name in missing:
            print(f"{target.relative_to(ROOT)}: no benchmarks/results/{name}.json; block left as is")
        if missing and options.check:
            stale.append(target)
        if updated == text:
            continue
        stale.append(target)
        if not options.check:
            target.write_text(updated)
            print(f"updated {target.relative_to(ROOT)}")
    untraced = doc_figures.check(ROOT)
    for problem in untraced:
        print(problem)
    if untraced:
        print(f"{len(untraced)} figure(s) in the docs that the results files named for them do not hold "
              "(benchmarks/doc_figures.py says how figures are traced)")
    if options.check and stale:
        print("out of date: " + ", ".join(sorted({str(t.relative_to(ROOT)) for t in stale}))
              + " (run python benchmarks/update_docs.py)")
    if options.check and (stale or untraced):
        sys.exit(1)


if __name__ == "__main__":
    main()
