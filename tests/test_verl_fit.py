"""A full veRL training run on CPU: ``python -m tlt_trainers.verl.main_ppo`` (the real entry point, a local Ray,
gloo, FSDP2 actor, our tlt rollout backend) for 2 GRPO steps on a tiny random Llama, then a resume for a third.

Needs the ``[verl]`` extra (skipped without it). About 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("verl")
pd = pytest.importorskip("pandas")

from tiny_models import EOS, char_tokenizer, tiny_model  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"

REWARD = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        """1 for the right answer, else a small response-dependent value so GRPO's advantages are not all 0."""
        if solution_str.strip().startswith(ground_truth):
            return 1.0
        return (len(set(solution_str)) % 7) / 7.0
''')


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl_fit")
    model_dir = root / "tiny_llama"
    model = tiny_model("llama", vocab_size=64, seed=11, logit_scale=2.0)
    model.generation_config.eos_token_id = EOS
    model.config.eos_token_id = EOS
    model.save_pretrained(model_dir)
    tokenizer = char_tokenizer(64)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)

    def rows(n, split):
        return [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i % 7}+{(3 * i) % 5}"}],
                 "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i % 7 + (3 * i) % 5)},
                 "extra_info": {"index": i, "split": split}} for i in range(n)]

    pd.DataFrame(rows(16, "train")).to_parquet(root / "train.parquet")
    pd.DataFrame(rows(4, "test")).to_parquet(root / "val.parquet")
    (root / "reward.py").write_text(REWARD)
    return root


def train(assets, steps: int) -> subprocess.CompletedProcess:
    overrides = [
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
        "trainer.project_name=tlt-test", "trainer.experiment_name=fit",
        "tlt.speculation=always", "tlt.num_speculative_tokens=2",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1",
           "RAY_DEDUP_LOGS": "0"}
    command = [sys.executable, "-m", "tlt_trainers.verl.main_ppo", "platform=cpu", *overrides]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=assets)


def test_two_grpo_steps_on_cpu_then_resume(assets):
    first = train(assets, steps=2)
    log = first.stdout + first.stderr
    assert first.returncode == 0, log[-6000:]
    for step in (1, 2):
        line = next((ln for ln in log.splitlines() if f"step:{step} -" in ln), None)
        assert line is not None, f"no step {step} in the training log:\n{log[-4000:]}"
        for key in ("actor/pg_loss", "tlt/acceptance_length", "tlt/drafter_steps", "critic/score/mean"):
            assert key in line, f"{key} missing from step {step}"
    for step in (1, 2):
        drafter = assets / "ckpt" / f"global_step_{step}" / "drafter"
        assert (drafter / "config.json").is_file(), f"no drafter checkpoint in {drafter}"

    resumed = train(assets, steps=3)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-6000:]
    assert "TLT: drafter restored from" in log and "global_step_2" in log
    assert any("step:3 -" in ln for ln in log.splitlines())
