"""Would each traced step capture on a GPU? A capture rehearsed on the ``meta`` device, per step kind.

    python benchmarks/bench_capture_rehearsal.py                              # all cases, the table
    python benchmarks/bench_capture_rehearsal.py --out bench_capture_rehearsal_before

For every step kind the engine replays from a CUDA graph (plain, EAGLE-1 with and without a draft vocabulary,
EAGLE-3 chains and trees, the block drafter, rollout history), batch 1 and 8, greedy and T=1, float32, bfloat16 and
float32 weights under ``torch.autocast(bfloat16)`` (as TRL generates): a tiny random Llama generates on the host
with ``cuda_graphs="static"`` until the engine traces a step of that kind; then the policy, the drafter and every
buffer the step reaches move to ``meta`` and the step's graph region runs once under
``tlt_trainers.rollout.capture_rehearsal.CaptureRehearsal``. A row says "passes" or the first op a capture would
refuse and the line of ours that issued it. Counts, not timings: any CPU gives the same table.
"""

from __future__ import annotations

import argparse
import time

from common import print_table, write_results
from rehearsal_cases import all_cases, rehearse_case


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_capture_rehearsal")
    p.add_argument("--kinds", default="", help="comma-separated step kinds (default: all)")
    args = p.parse_args()
    kinds = {k for k in args.kinds.split(",") if k}
    rows, results = [], []
    start = time.perf_counter()
    for case in all_cases():
        if kinds and case.kind not in kinds:
            continue
        result = rehearse_case(case)
        verdict = result.describe()
        print(f"{case.name}: {verdict}", flush=True)
        rows.append([case.kind, case.batch, case.sampling, case.dtype, verdict])
        results.append({"kind": case.kind, "batch": case.batch, "sampling": case.sampling, "dtype": case.dtype,
                        "passes": result.passes, "traced": result.traced, "ops": result.ops,
                        "rule": result.fault.rule if result.fault else None,
                        "where": result.fault.where if result.fault else None,
                        "context_rules": [f.rule for f in result.context_faults], "verdict": verdict})
    table = print_table(["kind", "batch", "sampling", "dtype", "rehearsed capture"], rows)
    passed = sum(r["passes"] for r in results)
    print(f"{passed} of {len(results)} cases would capture ({time.perf_counter() - start:.0f} s)")
    path = write_results(args.out, {"cases": len(results), "passing": passed, "results": results, "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
