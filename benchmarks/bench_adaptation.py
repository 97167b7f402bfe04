"""How fast the drafter adapts to a task it never saw, inside TLTGRPOTrainer: acceptance per GRPO step.

    python benchmarks/bench_adaptation.py                      # 8 steps, shipped and fresh drafter, knights_knaves
    python benchmarks/bench_adaptation.py --steps 2 --quick    # a smoke run (2 x 4 answers of 64 tokens)

Issue 53 asks that the drafter be accepted from a new task's first steps and climb within a few. This runs
``TLTGRPOTrainer`` as a new user would (a plain ``TLTGRPOConfig``, TLT's engine, temperature 1, the default online
update) on the real SmolLM2-135M-Instruct and a reasoning-gym task that is held out of every shipped drafter's data
(``tlt_trainers.shipped.prompts.HELD_OUT_TASKS``), once from the shipped drafter and once from a fresh one, with the
same seed and GRPO settings. Speculation is forced on (``speculation="always"``, a chain of ``--k``), so every
step's rollout measures the drafter as it stands: step s's acceptance length is that of the drafter after the
updates of steps 1..s-1 (the update follows the rollout it trains on). The table has, per step and start: tokens
per policy pass (acceptance length), the update's drafter steps and seconds, its top-1 agreement on the fresh
rollouts, and the reward. In one process nobody waits for anybody: the update gets ``drafter_update_fraction`` of the
rollout's seconds; ``--update-fraction`` sets it (the idle time of a run whose ranks wait for a long tail).
Writes ``benchmarks/results/bench_adaptation.json`` (``--out`` to rename).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_results  # noqa: E402

from tlt_trainers.metric_names import (  # noqa: E402
    ACCEPTANCE_LENGTH,
    DRAFTER_STEPS,
    DRAFTER_TOP1,
    DRAFTER_UPDATE_SECONDS,
)

STARTS = {"shipped": None, "fresh": "fresh"}  # drafter_name_or_path: None takes the drafter shipped for the policy


def answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion contains the task's answer (a verifiable reward; the policy is tiny, so rarely)."""
    def text(completion) -> str:
        return completion if isinstance(completion, str) else " ".join(m.get("content", "") for m in completion)

    return [float(re.sub(r"\s+", " ", str(expected)).strip().lower() in text(c).lower())
            for c, expected in zip(completions, answer)]


def task_dataset(tokenizer, task: str, count: int, seed: int):
    import reasoning_gym
    from datasets import Dataset

    from tlt_trainers.shipped.prompts import chat_prompt

    data = reasoning_gym.create_dataset(task, size=count, seed=seed)
    return Dataset.from_dict({"prompt": [chat_prompt(tokenizer, item["question"] + " Think step by step.")
                                         for item in data],
                              "answer": [str(item["answer"]) for item in data]})


def run(start: str, options, dataset) -> dict:
    from transformers import TrainerCallback

    from tlt_trainers import TLTGRPOConfig, TLTGRPOTrainer
    from tlt_trainers.pretrained import load_smollm2

    model, tokenizer = load_smollm2()
    steps: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and ACCEPTANCE_LENGTH in logs:
                steps.append({"step": state.global_step, "acceptance_length": logs[ACCEPTANCE_LENGTH],
                              "drafter_steps": logs.get(DRAFTER_STEPS, 0.0),
                              "drafter_update_seconds": logs.get(DRAFTER_UPDATE_SECONDS, 0.0),
                              "drafter_top1": logs.get(DRAFTER_TOP1), "reward": logs.get("reward"),
                              "completion_length": logs.get("completions/mean_length"),
                              "step_time": logs.get("step_time")})
                print(f"[{start}] step {state.global_step}: {steps[-1]}", flush=True)

    args = TLTGRPOConfig(
        output_dir=str(Path(options.output_dir) / start), max_steps=options.steps,
        per_device_train_batch_size=options.prompts_per_step * options.num_generations,
        num_generations=options.num_generations, max_completion_length=options.max_completion_length,
        temperature=1.0, learning_rate=options.learning_rate, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=False, seed=options.seed, data_seed=options.seed,
        disable_tqdm=True, drafter_name_or_path=STARTS[start], speculation="always",
        num_speculative_tokens=options.k,
        **({"drafter_update_fraction": options.update_fraction} if options.update_fraction is not None else {}),
        **({"drafter_targets": options.drafter_targets} if options.drafter_targets is not None else {}))
    trainer = TLTGRPOTrainer(model=model, reward_funcs=answer_reward, args=args, train_dataset=dataset,
                             processing_class=tokenizer, callbacks=[Record()])
    trainer.train()
    drafter = trainer.drafter
    return {"start": start, "drafter": type(drafter).__name__,
            "draft_vocab_size": int(getattr(drafter.config, "draft_vocab_size", 0) or 0), "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="knights_knaves", help="a reasoning-gym task held out of the shipped data")
    parser.add_argument("--starts", default="shipped,fresh", help="comma-separated: shipped, fresh")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--k", type=int, default=4, help="draft length (a chain)")
    parser.add_argument("--learning-rate", type=float, default=1e-6, help="the policy's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--update-fraction", type=float, default=None,
                        help="drafter_update_fraction (default: the setting's): the share of a rollout's seconds one "
                             "process trains its drafter after it; a multi-rank run's idle time can be far more")
    parser.add_argument("--drafter-targets", default=None, choices=["auto", "law", "sampled"],
                        help="drafter_targets (default: the setting's): what the drafter learns from each rollout")
    parser.add_argument("--quick", action="store_true", help="4 answers of 64 tokens a step")
    parser.add_argument("--output-dir", default="/tmp/bench_adaptation")
    parser.add_argument("--out", default="bench_adaptation", help="results file name (without .json)")
    options = parser.parse_args()
    if options.quick:
        options.prompts_per_step, options.max_completion_length = 1, 64
    from tlt_trainers.pretrained import load_smollm2
    from tlt_trainers.shipped.prompts import HELD_OUT_TASKS

    if options.task not in HELD_OUT_TASKS:
        print(f"note: {options.task} is not one of the held-out tasks {HELD_OUT_TASKS}: shipped data may cover it")
    starts = [s.strip() for s in options.starts.split(",") if s.strip()]
    unknown = set(starts) - set(STARTS)
    if unknown:
        parser.error(f"unknown start(s) {sorted(unknown)}: use {sorted(STARTS)}")
    _, tokenizer = load_smollm2()
    dataset = task_dataset(tokenizer, options.task, options.steps * options.prompts_per_step * 4, options.seed)
    runs = {start: run(start, options, dataset) for start in starts}
    headers = ["step"] + [f"{start} {column}" for start in starts
                          for column in ("acceptance", "drafter steps", "drafter s", "top-1")]
    rows = []
    for index in range(options.steps):
        row: list = [index + 1]
        for start in starts:
            steps = runs[start]["steps"]
            step = steps[index] if index < len(steps) else {}
            row += [step.get("acceptance_length", float("nan")), step.get("drafter_steps", float("nan")),
                    step.get("drafter_update_seconds", float("nan")),
                    step.get("drafter_top1") if step.get("drafter_top1") is not None else float("nan")]
        rows.append(row)
    table = print_table(headers, rows)
    summary = {start: {"first_two": sum(s["acceptance_length"] for s in runs[start]["steps"][:2]) / 2,
                       "last": runs[start]["steps"][-1]["acceptance_length"],
                       "best": max(s["acceptance_length"] for s in runs[start]["steps"])}
               for start in starts if len(runs[start]["steps"]) >= 2}
    path = write_results(options.out, {"settings": vars(options), "summary": summary, "runs": runs,
                                       "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
