"""Copy the benchmark tables from benchmarks/results/*.json into README.md (between results markers).

    python benchmarks/update_readme.py

Each README block `<!-- results:NAME -->` ... `<!-- /results:NAME -->` is replaced by the table stored
in benchmarks/results/NAME.json, with the command and machine that produced it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"


def block(name: str) -> str | None:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    machine = data.get("machine", {})
    cores = machine.get("cpus") or machine.get("threads")
    where = f"{cores} CPU cores, torch {machine.get('torch')}"
    if machine.get("cuda"):
        where = machine["cuda"]
    parts = [f"`{data['command']}` ({where}; `benchmarks/results/{name}.json`)", ""]
    if "table" in data:
        parts.append(data["table"])
    for title, key in (("Totals", "totals"), ("Per active-batch bucket", "buckets")):
        if key in data.get("tables", {}):
            parts += [f"{title}:", "", data["tables"][key], ""]
    if data.get("tables", {}).get("sweep"):
        parts += ["Fixed batch, adaptive vs no-spec in lockstep (decode seconds no-spec / adaptive, >1: adaptive "
                  "faster; `benchmarks/batch_sweep.py`):", "", data["tables"]["sweep"], ""]
    if data.get("proposers"):
        parts += ["Proposers per rep (vs no-spec of the same rep):", "", proposer_table(data["proposers"])]
    if data.get("cost_table"):
        parts += ["", "Policy forward time with ~200 cached tokens, by new tokens per row:", "", data["cost_table"]]
    return "\n".join(parts)


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


def main() -> None:
    text = README.read_text()
    for name in sorted({m.group(1) for m in re.finditer(r"<!-- results:(\w+) -->", text)}):
        content = block(name)
        if content is None:
            print(f"no results for {name}; left as is")
            continue
        pattern = re.compile(rf"<!-- results:{name} -->.*?<!-- /results:{name} -->", re.S)
        replacement = f"<!-- results:{name} -->\n{content}\n<!-- /results:{name} -->"
        if pattern.search(text):
            text = pattern.sub(lambda _, r=replacement: r, text)
        else:
            text = text.replace(f"<!-- results:{name} -->", replacement, 1)
        print(f"updated {name}")
    README.write_text(text)


if __name__ == "__main__":
    main()
