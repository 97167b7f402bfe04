"""What the measured acceptance would buy on a GPU: a prediction, every step-cost ratio in it assumed.

    python benchmarks/predict_gpu_speedup.py
    python benchmarks/predict_gpu_speedup.py --from benchmarks/results/bench_drafters.json --verify-cost 1.1
    python benchmarks/predict_gpu_speedup.py --from A.json B.json --drafters 'A:block shipped,B:eagle3 shipped'

Speculation's speedup over plain decoding is the tokens a verify pass emits per row (the acceptance length, measured
on the CPU by ``bench_drafters.py``, and the same on any device: it depends on the drafter and the policy, not on the
hardware) divided by what a speculative step costs in plain steps:

    predicted speedup = acceptance length / (verify cost + drafter passes x drafter pass cost)

No GPU run of this repository has measured the two costs, so both are assumptions, stored with the prediction:

- ``verify cost``: a verify pass over k + 1 tokens per row, in plain steps (``--verify-cost``, default 1.2: decoding
  a small batch is bound by reading the weights, so scoring a few more tokens per row costs little more);
- ``drafter pass cost``: one drafter pass, in plain steps, taken as the drafter's share of the policy's linear weights
  (what a memory-bound pass reads), ``linear_weights(drafter) / linear_weights(policy)``; an EAGLE-3 chain of k makes
  k passes, the block drafter one.

Reads ``bench_drafters.py`` results files (their rows: drafter, drafts, temperature, batch, acceptance length, and the
CPU's spec/plain ratio, printed beside the prediction; ``--drafters`` keeps the named rows, so that each drafter comes
from the file that measured its newest version) and writes ``benchmarks/results/predict_gpu_speedup.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, print_table, write_results  # noqa: E402


def drafter_pass_costs(paths: dict[str, str]) -> dict[str, dict]:
    """Per drafter of the results file: its share of the policy's linear weights, and passes per chain of k."""
    from tlt_trainers import BlockDrafter, Drafter
    from tlt_trainers.pretrained import load_smollm2
    from tlt_trainers.rollout.costs import linear_weights

    model, _ = load_smollm2()
    costs = {}
    for name, path in paths.items():
        drafter = Drafter.from_pretrained(path, target=model)
        costs[name] = {"share": linear_weights(drafter) / linear_weights(model),
                       "one_pass": isinstance(drafter, BlockDrafter)}
    return costs


def predict(rows: list[dict], costs: dict[str, dict], verify_cost: float) -> list[dict]:
    predicted = []
    for row in rows:
        cost = costs[row["drafter"]]
        passes = 1 if cost["one_pass"] else row["k"]
        step = verify_cost + passes * cost["share"]
        predicted.append({**{key: row[key] for key in ("drafter", "k", "temperature", "batch", "acceptance_length")},
                          "cpu_speedup": row.get("speedup"), "drafter_passes": passes,
                          "drafter_pass_cost": cost["share"], "verify_cost": verify_cost, "step_cost": step,
                          "predicted_gpu_speedup": row["acceptance_length"] / step})
    return predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="sources", nargs="+",
                        default=[str(RESULTS / "bench_drafters_issue52_after.json")],
                        help="bench_drafters.py results files")
    parser.add_argument("--drafters", default=None,
                        help="comma-separated result rows to predict from, ROW or FILE_STEM:ROW (default: every row "
                             "of every file)")
    parser.add_argument("--verify-cost", type=float, default=1.2,
                        help="assumed: a verify pass over k + 1 tokens per row, in plain steps")
    parser.add_argument("--out", default="predict_gpu_speedup")
    options = parser.parse_args()
    wanted = options.drafters.split(",") if options.drafters else None
    rows, costs, sources = [], {}, []
    for source_path in options.sources:
        source = json.loads(Path(source_path).read_text())
        stem = Path(source_path).stem
        # "ROW" from any file, "FILE_STEM:ROW" from that file only
        kept = [r for r in source["rows"]
                if wanted is None or r["drafter"] in wanted or f"{stem}:{r['drafter']}" in wanted]
        if not kept:
            continue
        named = {r["drafter"] for r in kept}
        if named & costs.keys():
            raise SystemExit(f"{source_path} measures {sorted(named & costs.keys())} again: name one file's rows "
                             "with --drafters.")
        costs.update(drafter_pass_costs({name: path for name, path in source["drafters"].items() if name in named}))
        relative = str(Path(source_path).resolve().relative_to(Path(__file__).resolve().parents[1]))
        rows += [{**row, "source": stem} for row in predict(kept, costs, options.verify_cost)]
        sources.append({"file": relative, "machine": source.get("machine"), "drafters": sorted(named)})
    if not rows:
        raise SystemExit(f"No rows named {sorted(wanted)} in {options.sources}.")
    table = print_table(
        ["drafter", "measured in", "drafts", "T", "batch", "acceptance length", "CPU spec/plain (measured)",
         "drafter passes", "pass cost (assumed)", "verify cost (assumed)", "predicted GPU spec/plain"],
        [[r["drafter"], r["source"], r["k"], r["temperature"], r["batch"], round(r["acceptance_length"], 2),
          round(r["cpu_speedup"], 2) if r["cpu_speedup"] is not None else "-", r["drafter_passes"],
          round(r["drafter_pass_cost"], 3), r["verify_cost"], round(r["predicted_gpu_speedup"], 2)] for r in rows])
    path = write_results(options.out, {
        "sources": sources,
        "assumed": {"verify_cost": options.verify_cost,
                    "drafter_pass_cost": "the drafter's share of the policy's linear weights"},
        "drafter_pass_costs": costs, "rows": rows, "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
