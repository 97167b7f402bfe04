"""GRPO on veRL with TLT: reasoning-gym arithmetic, verifiable reward, `python -m tlt_trainers.verl.main_ppo`.

    python examples/verl_grpo.py --steps 2     # CPU: the embedded SmolLM2-135M-Instruct, about 10 min per step
    python examples/verl_grpo.py --model /path/or/hub-id --gpus 1 --steps 50 --response-length 1024   # GPU

Writes the data as veRL parquet files under `--output-dir`, then runs veRL's trainer with TLT (the `tlt` rollout
backend, idle-time drafter training, the drafter in every checkpoint) and prints the command it ran; any extra
arguments are passed on as hydra overrides (e.g. `tlt.speculation=never` for the same run without a drafter).
This file also holds the reward function veRL loads (`compute_score`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

INSTRUCTION = " Give only the final answer."


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 when the last number of the answer is the result (veRL's custom reward signature)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", solution_str.replace(",", ""))
    try:
        return float(bool(numbers) and float(numbers[-1]) == float(ground_truth))
    except ValueError:
        return 0.0


def write_data(folder: Path, train_size: int, val_size: int, seed: int) -> tuple[Path, Path]:
    """reasoning-gym basic_arithmetic (two terms, + and -) as veRL's RL parquet: prompt messages, ground truth."""
    import pandas as pd
    import reasoning_gym

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, size, split_seed in (("train", train_size, seed), ("val", val_size, seed + 10_000)):
        data = reasoning_gym.create_dataset("basic_arithmetic", size=size, seed=split_seed, min_terms=2, max_terms=2,
                                            min_digits=1, max_digits=2, operators=("+", "-"))
        rows = [{"data_source": "basic_arithmetic", "ability": "math",
                 "prompt": [{"role": "user", "content": item["question"] + INSTRUCTION}],
                 "reward_model": {"style": "rule", "ground_truth": str(item["answer"])},
                 "extra_info": {"index": i, "split": split}} for i, item in enumerate(data)]
        path = folder / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(path)
        paths.append(path)
    return paths[0], paths[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF model path or Hub id (default: the embedded SmolLM2)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per node; 0 runs on CPU (platform=cpu)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt (GRPO's n)")
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/verl_grpo")
    args, overrides = parser.parse_known_args()

    out = Path(args.output_dir).resolve()
    model = args.model
    if model is None:
        from tlt_trainers.pretrained import cache_root, load_smollm2

        load_smollm2()  # converts the embedded GGUF once and caches a plain HF copy
        model = str(cache_root() / "smollm2-135m-instruct")
    train, val = write_data(out / "data", train_size=max(64, args.batch_size * args.steps), val_size=16,
                            seed=args.seed)
    command = [
        sys.executable, "-m", "tlt_trainers.verl.main_ppo",
        *(["platform=cpu"] if args.gpus == 0 else [f"trainer.n_gpus_per_node={args.gpus}"]),
        f"data.train_files={train}", f"data.val_files={val}", f"data.train_batch_size={args.batch_size}",
        "data.max_prompt_length=128", f"data.max_response_length={args.response_length}", f"data.seed={args.seed}",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.batch_size}",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.rollout.n={args.group_size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.batch_size}",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"reward.custom_reward_function.path={Path(__file__).resolve()}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={args.steps}", "trainer.logger=[console]", "trainer.val_before_train=False",
        "trainer.test_freq=-1", f"trainer.save_freq={args.steps}", f"trainer.default_local_dir={out / 'checkpoints'}",
        "trainer.project_name=tlt-verl", "trainer.experiment_name=grpo", f"tlt.seed={args.seed}",
        *overrides,
    ]
    print("running:", " ".join(command), flush=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    raise SystemExit(subprocess.call(command, env=env))


if __name__ == "__main__":
    main()
