"""The engine's CPU decode paths against the stock ones, one policy forward at a time (SmolLM2-135M-Instruct).

    python benchmarks/bench_cpu_paths.py            # 10 shapes, 8 interleaved repeats each
    python benchmarks/bench_cpu_paths.py --quick    # 4 shapes, 4 repeats

Each shape (batch x new tokens, cached context) is one forward of the engine's policy (decoder, LM head,
softmax), timed alternately with the stock paths (``F.linear``, transformers' ``repeat_kv`` + SDPA) and with
``tlt_trainers.modeling.cpu_paths`` (few-row linears, ``enable_gqa``) in one process; the second-fastest of each
is kept (this VM has seconds-long bursts of slowness). Ratios are what to read. Writes
benchmarks/results/bench_cpu_paths[_quick].json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402

from tlt_trainers.modeling.target import TargetModel  # noqa: E402
from tlt_trainers.pretrained import load_smollm2  # noqa: E402
from tlt_trainers.rollout.costs import _verify_runs  # noqa: E402

SHAPES = [(1, 1, 200), (1, 5, 200), (2, 1, 300), (4, 1, 300), (8, 1, 300), (8, 3, 300), (16, 1, 300),
          (16, 3, 300), (32, 1, 300), (64, 1, 300)]
QUICK_SHAPES = [(1, 5, 200), (4, 1, 300), (16, 1, 300), (64, 1, 300)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 shapes, 4 repeats")
    p.add_argument("--reps", type=int, default=None, help="timings per path and shape, default 8 (quick: 4)")
    return p.parse_args()


@torch.no_grad()
def main() -> None:
    args = parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    reps = args.reps or (4 if args.quick else 8)
    model, _ = load_smollm2()
    target = TargetModel(model)
    paths = target._cpu_paths
    fast = (paths.linears, paths.config)
    rows, raw = [], []
    for batch, tokens, context in shapes:
        run = _verify_runs(target, batch, [tokens], context)[tokens]
        times = {"stock": [], "cpu_paths": []}
        for i in range(2 * reps):
            name = "cpu_paths" if i % 2 else "stock"
            paths.linears, paths.config = fast if name == "cpu_paths" else ([], None)
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
        paths.linears, paths.config = fast
        kept = {name: sorted(ts)[1] for name, ts in times.items()}
        ratio = kept["cpu_paths"] / kept["stock"]
        raw.append({"batch": batch, "tokens": tokens, "context": context, "seconds": times, "kept": kept,
                    "ratio": ratio})
        rows.append([f"{batch} x {tokens}", context, kept["stock"] * 1e3, kept["cpu_paths"] * 1e3, ratio])
        print(f"batch {batch} x {tokens} tokens, context {context}: ratio {ratio:.3f}", flush=True)
    table = print_table(["batch x tokens", "context", "stock ms", "cpu paths ms", "cpu paths / stock"], rows)
    path = write_results("bench_cpu_paths_quick" if args.quick else "bench_cpu_paths",
                         {"shapes": raw, "reps": reps, "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
