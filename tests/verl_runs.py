"""What the real veRL runs of tests/test_verl_fit.py and tests/test_verl_vllm.py share: the data, the reward, and the
``python -m tlt_trainers.verl.main_ppo platform=cpu`` command of a tiny 2-GRPO-step run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
from tiny_models import save_with_char_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"

REWARD = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        """1 for the right answer, else a small response-dependent value so GRPO's advantages are not all 0."""
        if solution_str.strip().startswith(ground_truth):
            return 1.0
        return (len(set(solution_str)) % 7) / 7.0
''')


def write_assets(root: Path, model) -> Path:
    """``model`` with the char tokenizer in ``root/tiny_llama``, arithmetic train/val parquet files, the reward."""
    save_with_char_tokenizer(model, root / "tiny_llama", CHAT_TEMPLATE)

    def rows(n, split):
        return [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i % 7}+{(3 * i) % 5}"}],
                 "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i % 7 + (3 * i) % 5)},
                 "extra_info": {"index": i, "split": split}} for i in range(n)]

    pd.DataFrame(rows(16, "train")).to_parquet(root / "train.parquet")
    pd.DataFrame(rows(4, "test")).to_parquet(root / "val.parquet")
    (root / "reward.py").write_text(REWARD)
    return root


def run_main_ppo(assets: Path, steps: int, experiment: str, *overrides: str, entry: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m tlt_trainers.verl.main_ppo platform=cpu`` for ``steps`` GRPO steps of the tiny model, checkpoints
    every step under ``assets/ckpt``; ``entry``: config groups before ``platform=cpu``, ``overrides`` after ours."""
    common = [
        f"data.train_files={assets / 'train.parquet'}", f"data.val_files={assets / 'val.parquet'}",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=16",
        f"actor_rollout_ref.model.path={assets / 'tiny_llama'}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"reward.custom_reward_function.path={assets / 'reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={steps}", "trainer.logger=[console]", "trainer.val_before_train=False",
        "trainer.test_freq=-1", "trainer.save_freq=1", f"trainer.default_local_dir={assets / 'ckpt'}",
        "trainer.project_name=tlt-test", f"trainer.experiment_name={experiment}",
    ]
    environment = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1",
                   "RAY_DEDUP_LOGS": "0", **(env or {})}
    command = [sys.executable, "-m", "tlt_trainers.verl.main_ppo", *entry, "platform=cpu", *common, *overrides]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900, cwd=assets)


# Ray prefixes each line a worker prints with its actor and pid (in colour on a terminal)
_RAY_PREFIX = re.compile(r"^(?:\x1b\[\d+m)?\((\w+) pid=\d+\)(?:\x1b\[0m)? ?")
_STEP = re.compile(r"step:(\d+) - ")


def step_lines(log: str, actor: str = "TLTTaskRunner") -> dict[int, str]:
    """veRL's console line of each training step (``step:N - key:value - ...``), by step.

    Ray's log monitor can cut a long line into pieces, each with its own ``(actor pid=...)`` prefix (seen: a step's
    line cut after 600-odd characters, its ``actor/*`` metrics in the second piece). So a step's line is its piece
    and every later piece the actor printed, up to the next step's."""
    lines: dict[int, str] = {}
    step = None
    for line in log.splitlines():
        prefix = _RAY_PREFIX.match(line)
        if prefix is None or prefix.group(1) != actor:
            continue
        piece = line[prefix.end():]
        start = _STEP.match(piece)
        if start is not None:
            step = int(start.group(1))
            lines[step] = piece
        elif step is not None:
            lines[step] += piece
    return lines
