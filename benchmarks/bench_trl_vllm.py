"""GRPO with vLLM: stock ``GRPOTrainer(use_vllm=True)`` against ``TLTGRPOTrainer(use_vllm=True)``, same settings.

    python benchmarks/bench_trl_vllm.py                     # 4 steps, 2 reps, temperature 1.0
    python benchmarks/bench_trl_vllm.py --steps 2 --reps 1 --max-completion-length 32     # smoke

Each trainer run is a process of its own (a run in the process of the one before it ran up to a third slower
whichever trainer it was: the earlier engine's leftovers), the trainers one after the other, the order alternating
per rep, each on a fresh trainer
(TRL's colocated vLLM engine, ``vllm_mode="colocate"``) over the same reasoning-gym prompts and reward, the real
SmolLM2-135M-Instruct, ``num_generations`` answers per prompt ending at their own end of sequence. The table reports
TRL's own ``step_time`` per optimizer step (median over the steps after the first, which holds the engines'
warm-up) and stock/TLT (>1: TLT faster), the same over seconds per answer token (the trainers' answers differ in
length: their sampling draws differ), plus what TLT did in those steps: drafter micro-steps and seconds, vLLM's
acceptance length, drafter updates loaded into the engine, the seconds speculation saved. TLT runs twice by default:
``tlt`` with its default ``drafter_update_budget="payback"`` (training paid from what speculation saved) and
``tlt-fixed`` with ``"fixed"`` (``drafter_update_fraction`` of every rollout, the budget before it).

On a CPU, stock TRL's colocated engine cannot start (TRL asks vLLM for its ``external_launcher`` executor and loads
weights with ``load_weights``, which vLLM's CPU backend does not support), so the baseline there is
``GRPOTrainer`` with only those two CPU fix-ups of :mod:`tlt_trainers.trl.vllm_colocate` (vLLM's ``uni`` executor,
``reload_weights``) and no drafter. TLT's trainer serves its drafter in vLLM at every temperature (exact on CPUs
through TLT's vLLM plugin) under its default ``speculation="adaptive"``: vLLM drafts at the batch sizes where the
running engine measures that it pays. The table adds the share of vLLM's steps that drafted and TRL's
importance-sampling ratio between vLLM's and the trainer's log-probabilities. Writes
benchmarks/results/bench_trl_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (x num_generations answers)")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dataset", default="basic_arithmetic")
    p.add_argument("--output-dir", default="runs/bench_trl_vllm")
    p.add_argument("--trainers", default="stock,tlt,tlt-fixed",
                   help="comma-separated: stock, tlt (drafter_update_budget='payback', the default) and tlt-fixed "
                        "(drafter_update_budget='fixed': drafter_update_fraction of every rollout)")
    p.add_argument("--out", default="bench_trl_vllm", help="results file name under benchmarks/results/")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one run, KIND: what the parent starts
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def dataset(count: int, name: str):
    import reasoning_gym
    from datasets import Dataset

    items = list(reasoning_gym.create_dataset(name, size=count, seed=5))
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": item["question"] + " Think step by step."}]
                                         for item in items],
                              "answer": [str(item["answer"]) for item in items]})


def correct(completions, answer, **kwargs):
    """1 when the last number in the answer is the reference answer."""
    scores = []
    for completion, reference in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion[0]["content"])
        scores.append(float(bool(numbers) and numbers[-1] == reference))
    return scores


def step_logs():
    """A callback that keeps TRL's per-step logs (the ones with ``step_time``) in ``.logs``."""
    from transformers import TrainerCallback

    class StepLogs(TrainerCallback):
        def __init__(self):
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "step_time" in logs:
                self.logs.append(dict(logs))

    return StepLogs()


def build(kind: str, path: str, args, train_dataset, tokenizer, callback):
    from trl import GRPOConfig, GRPOTrainer

    from tlt_trainers import TLTGRPOConfig, TLTGRPOTrainer

    common = dict(output_dir=f"{args.output_dir}/{kind}", use_vllm=True, vllm_mode="colocate",
                  max_steps=args.steps, per_device_train_batch_size=args.prompts * args.num_generations,
                  num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                  temperature=args.temperature, learning_rate=1e-6, logging_steps=1, save_strategy="no",
                  report_to=[], use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(), seed=0,
                  vllm_max_model_length=1024, disable_tqdm=True)
    kwargs = dict(model=path, reward_funcs=correct, train_dataset=train_dataset, processing_class=tokenizer,
                  callbacks=[callback])
    if kind.startswith("tlt"):
        budget = "fixed" if kind == "tlt-fixed" else "payback"
        return TLTGRPOTrainer(args=TLTGRPOConfig(**common, drafter_update_budget=budget), **kwargs)
    if torch.cuda.is_available():
        return GRPOTrainer(args=GRPOConfig(**common), **kwargs)
    from tlt_trainers.trl.vllm_colocate import tlt_vllm_generation

    with tlt_vllm_generation():  # only the CPU fix-ups (see the module docstring), no drafter
        trainer = GRPOTrainer(args=GRPOConfig(**common), **kwargs)
    trainer.vllm_generation.start(None)
    return trainer


def run_one(kind: str, args) -> dict:
    """One trainer's run in this process: ``{"seconds", "logs"}`` (TRL's per-step logs, numbers only)."""
    from transformers import AutoTokenizer

    from tlt_trainers.pretrained import smollm2_hf_dir

    path = str(smollm2_hf_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    callback = step_logs()
    trainer = build(kind, path, args, dataset(args.steps * args.prompts, args.dataset), tokenizer, callback)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [{k: float(v) for k, v in log.items() if isinstance(v, (int, float)) and v is not None}
            for log in callback.logs]
    return {"seconds": seconds, "logs": logs}


def run_in_own_process(kind: str, args) -> dict:
    """:func:`run_one` in a fresh interpreter, so that no earlier run's engine shares the process."""
    forwarded = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                 if value is not None and name not in ("child", "child_out")]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), *forwarded, "--child", kind,
                        "--child-out", str(out)], check=True)
        return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    if args.child is not None:
        Path(args.child_out).write_text(json.dumps(run_one(args.child, args)))
        return
    import trl
    import vllm

    kinds = tuple(args.trainers.split(","))
    if "stock" not in kinds or not set(kinds) <= {"stock", "tlt", "tlt-fixed"}:
        raise SystemExit(f"--trainers {args.trainers}: name stock and any of tlt, tlt-fixed")
    raw = []
    for rep in range(args.reps):
        for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
            run = run_in_own_process(kind, args)
            for log in run["logs"]:
                raw.append({"rep": rep, "trainer": kind, "train_seconds": run["seconds"], **log})
            print(f"rep {rep} {kind}: {run['seconds']:.1f} s, step times "
                  f"{[round(log['step_time'], 1) for log in run['logs']]}", flush=True)

    def steps(kind, rep=None):
        return [r for r in raw if r["trainer"] == kind and (rep is None or r["rep"] == rep)]

    def median_step(kind, rep):
        times = [r["step_time"] for r in steps(kind, rep)]
        return statistics.median(times[1:] if len(times) > 1 else times)

    def seconds_per_token(kind, rep):  # over the steps after the first: a step's seconds grow with its answers
        counted = steps(kind, rep)[1:] or steps(kind, rep)
        return (sum(r["step_time"] for r in counted)
                / sum(r["completions/mean_length"] * args.prompts * args.num_generations for r in counted))

    rows = []
    for kind in kinds:
        mine = steps(kind)
        row = [kind, f"{statistics.median(median_step(kind, rep) for rep in range(args.reps)):.2f}",
               f"{statistics.median(r['completions/mean_length'] for r in mine):.0f}"]
        if kind != "stock":
            ratios = [median_step("stock", rep) / median_step(kind, rep) for rep in range(args.reps)]
            per_token = [seconds_per_token("stock", rep) / seconds_per_token(kind, rep) for rep in range(args.reps)]
            row += [f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                    f"{statistics.median(per_token):.3f} ({min(per_token):.3f}-{max(per_token):.3f})",
                    f"{statistics.mean(r.get('tlt/drafter_steps', 0) for r in mine):.1f}",
                    f"{statistics.mean(r.get('tlt/drafter_update_seconds', 0) for r in mine):.2f}",
                    _fmt(statistics.mean([r["tlt/acceptance_length"] for r in mine if "tlt/acceptance_length" in r]
                                         or [float("nan")])),  # steps that drafted nothing log none
                    f"{max(r.get('tlt/drafter_updates_loaded', 0) for r in mine):.0f}",
                    _fmt(statistics.mean(r.get("tlt/vllm_speculative_step_fraction", float("nan")) for r in mine)),
                    _fmt(statistics.mean(r.get("tlt/speculation_saved_seconds", float("nan")) for r in mine))]
        else:
            row += ["1", "1", "-", "-", "-", "-", "-", "-"]
        row.append(_fmt(statistics.mean(r.get("sampling/importance_sampling_ratio/mean", float("nan")) for r in mine)))
        rows.append(row)
    print(f"TRL {trl.__version__}, vLLM {vllm.__version__}, SmolLM2-135M-Instruct, {args.prompts} prompts x "
          f"{args.num_generations} answers, up to {args.max_completion_length} tokens, temperature "
          f"{args.temperature}, {args.steps} steps x {args.reps} reps; TLT: vLLM with the drafter, adaptive:")
    table = print_table(["trainer", "step s (median)", "completion tokens", "stock/TLT step time",
                         "stock/TLT s per answer token",
                         "drafter steps/step", "drafter s/step", "acceptance length", "updates loaded",
                         "drafting steps", "saved s/step", "IS ratio (mean)"], rows)
    write_results(args.out, {"trl": trl.__version__, "vllm": vllm.__version__, "settings": vars(args),
                                     "raw": raw, "table": table})


def _fmt(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"


if __name__ == "__main__":
    main()
